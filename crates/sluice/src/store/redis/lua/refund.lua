-- refund: gives back charges (twin of algo::Limit::refund), never above the limit and
-- never into a later window than the one charged.
-- KEYS[i]   where refund i's state lives (as apply's)
-- ARGV[1]   now, ms since the epoch
-- ARGV[2]   grace, ms (as apply's)
-- ARGV[3..] 7 values per refund: algorithm, p1, p2, p3, cost, window (the charging
--           decision's reset_at), field
-- Reply     the number of states changed
local now, grace = int(ARGV[1]), int(ARGV[2])
local changed = 0
for i = 1, #KEYS do
  local b = 2 + (i - 1) * 7
  local kind, p1, p2, p3 = int(ARGV[b + 1]), int(ARGV[b + 2]), int(ARGV[b + 3]), int(ARGV[b + 4])
  local cost, window, field = int(ARGV[b + 5]), int(ARGV[b + 6]), ARGV[b + 7]
  local loaded = load(kind, KEYS[i], field, p1, p2, now)
  if loaded ~= nil and kind ~= CONCURRENCY then
    local new = refund(kind, normalize(kind, loaded, p1, p2, p3, now), p1, p2, p3, cost, window)
    if new ~= nil then
      store(kind, KEYS[i], field, new, p1, p2, p3, now, grace, loaded)
      changed = changed + 1
    end
  end
end
return changed
