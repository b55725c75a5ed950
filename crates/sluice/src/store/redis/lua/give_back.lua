-- give_back: gives back the unspent units of one grant, once (twin of
-- algo::grant::give_back): the grant is closed, and a second give-back finds nothing.
-- KEYS[1]   the state's bucket
-- ARGV      now, grace, the policy, the state's field, the grant's id (decimal),
--           unspent, window (the reset of the window it was taken from)
-- Reply     the units given back
local now, grace = int(ARGV[1]), int(ARGV[2])
local p = policy(ARGV[3])
local kind, p1, p2, p3 = p[1], p[2], p[3], p[4]
if kind ~= FIXED_WINDOW then error('sluice: grants take fixed windows only') end
local key, field, id, unspent, window = KEYS[1], ARGV[4], ARGV[5], int(ARGV[6]), int(ARGV[7])
local lu, lr = load(kind, key, field, p2, now)
if lu == nil then return 0 end
local u, r = normalize(kind, lu, lr, nil, p1, p2, p3, now)
if r ~= window then return 0 end
local open = book_load(key, field, r)
for i = 1, #open, 2 do
  if open[i] == id then
    local back = min(min(unspent, int(open[i + 1])), u)
    table.remove(open, i)
    table.remove(open, i)
    book_store(key, field, r, open)
    store(kind, key, field, u - back, r, nil, p1, p2, p3, now, grace, lu, lr, nil, nil)
    return back
  end
end
return 0
