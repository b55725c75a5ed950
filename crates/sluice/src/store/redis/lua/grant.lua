-- grant: grants a share of a fixed window or a token bucket to one instance, taking the
-- units from the state at once (twin of algo::grant::grant and bucket_grant), and
-- records it in the state's book.
-- KEYS[1]   the state's bucket
-- ARGV      now, grace (as apply's), the policy (as apply's), the state's field, need,
--           want, the grant's id (decimal), 1 if the window is a region's pool of a
--           global window (what the region holds bounds the grant, not the limit), then
--           the ids of the caller's spent grants
-- Reply     units granted, the state's decision after the grant (6 integers, as
--           apply's), the grants open after it
local now, grace = int(ARGV[1]), int(ARGV[2])
local p = policy(ARGV[3])
local kind, p1, p2, p3 = p[1], p[2], p[3], p[4]
local key, field, need, want, id, pooled = KEYS[1], ARGV[4], int(ARGV[5]), int(ARGV[6]), ARGV[7], ARGV[8] == '1'
local closing = {}
for i = 9, #ARGV do closing[ARGV[i]] = true end
local lx, ly, lz, le = load(kind, key, field, p2, now)
local x, y, open, skew = granted_normalize(kind, lx, ly, book_load(key, field), closing, p1, p2, p3, now)
-- a fixed window's open reservations stay with it (their earliest deadline, lz)
local h = nil
if y == ly then h = lz end
local n = #open / 3
local units, expires = 0, y
if pooled then p1 = pool_load(key, field, y) end
if kind == FIXED_WINDOW then
  units = grant_size(max(p1 - x, 0), n, need, want)
elseif n < MAX_OPEN then
  units, expires = grant_size(floor(x / p2), n, need, want), now + BUCKET_TTL
end
if units > 0 then
  if n >= MAX_OPEN then
    for _ = 1, 3 do table.remove(open, 1) end
  end
  open[#open + 1] = id
  open[#open + 1] = units
  open[#open + 1] = expires
  if kind == FIXED_WINDOW then x = x + units else x = x - units * p2 end
end
store(kind, key, field, x, y, h, p1, p2, p3, now, grace, lx, ly, lz, le, nil)
book_store(key, field, open, skew, grace)
local a, l, used, rem, reset, retry = charge(kind, x, y, h, p1, p2, p3, 0, '', false, now)
if kind == FIXED_WINDOW then a, l, used, rem, reset, retry = with_holds(a, l, used, rem, reset, retry, h, now) end
return {units, a, l, used, rem, reset, retry, #open / 3}
