-- grant: grants a share of a fixed window to one instance, charging the window at once
-- (twin of algo::grant::grant), and records it in the window's book.
-- KEYS[1]   the state's bucket
-- ARGV      now, grace (as apply's), the policy (a fixed window's, as apply's), the
--           state's field, need, want, the grant's id (decimal)
-- Reply     units granted, the window's decision after the grant (6 integers, as
--           apply's), the grants open in the window
local now, grace = int(ARGV[1]), int(ARGV[2])
local p = policy(ARGV[3])
local kind, p1, p2, p3 = p[1], p[2], p[3], p[4]
if kind ~= FIXED_WINDOW then error('sluice: grants take fixed windows only') end
local key, field, need, want, id = KEYS[1], ARGV[4], int(ARGV[5]), int(ARGV[6]), ARGV[7]
local lu, lr = load(kind, key, field, p2, now)
local u, r = normalize(kind, lu, lr, nil, p1, p2, p3, now)
local open = book_load(key, field, r)
local units = grant_size(max(p1 - u, 0), #open / 2, need, want)
if units > 0 then
  if #open / 2 >= MAX_OPEN then
    table.remove(open, 1)
    table.remove(open, 1)
  end
  open[#open + 1] = id
  open[#open + 1] = num(units)
  u = u + units
  book_store(key, field, r, open)
end
store(kind, key, field, u, r, nil, p1, p2, p3, now, grace, lu, lr, nil, nil)
local a, l, used, rem, reset, retry = charge(kind, u, r, nil, p1, p2, p3, 0, '', false, now)
return {units, a, l, used, rem, reset, retry, #open / 2}
