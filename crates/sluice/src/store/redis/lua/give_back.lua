-- give_back: gives back the unspent units of one grant, once (twin of
-- algo::grant::give_back and bucket_give_back): the grant is closed, and a second
-- give-back finds nothing; or, a part of a fixed window's grant (keep > 0), the grant
-- stays open with `keep` units, only if it held unspent + keep (a part sent twice is
-- given back once).
-- KEYS[1]   the state's bucket
-- ARGV      now, grace, the policy, the state's field, the grant's id (decimal),
--           unspent, window (a fixed window's: the reset of the window it was taken from),
--           keep (0: close the grant)
-- Reply     the units given back
local now, grace = int(ARGV[1]), int(ARGV[2])
local p = policy(ARGV[3])
local kind, p1, p2, p3 = p[1], p[2], p[3], p[4]
local key, field, id, unspent, window = KEYS[1], ARGV[4], ARGV[5], int(ARGV[6]), int(ARGV[7])
local keep = int(ARGV[8] or '0')
local open = book_load(key, field)
if #open == 0 then return 0 end
local lx, ly, lz, le = load(kind, key, field, p2, now)
local x, y, skew
x, y, open, skew = granted_normalize(kind, lx, ly, open, {}, p1, p2, p3, now)
local h = nil
if y == ly then h = lz end
if kind == FIXED_WINDOW and (lx == nil or y ~= window) then return 0 end
for i = 1, #open, 3 do
  if open[i] == id then
    local back = min(unspent, open[i + 1])
    if keep > 0 and kind == FIXED_WINDOW then
      -- a part: only of the grant as its holder knew it
      if open[i + 1] ~= unspent + keep then return 0 end
      open[i + 1] = keep
    else
      for _ = 1, 3 do table.remove(open, i) end
    end
    if kind == FIXED_WINDOW then
      back = min(back, x)
      x = x - back
    else
      x = min(x + back * p2, max(p3 - book_units(open), 0) * p2)
    end
    store(kind, key, field, x, y, h, p1, p2, p3, now, grace, lx, ly, lz, le, nil)
    book_store(key, field, open, skew, grace)
    return back
  end
end
return 0
