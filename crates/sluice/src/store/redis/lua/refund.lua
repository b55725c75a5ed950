-- refund: gives back charges (twin of algo::Limit::refund), never above the limit and
-- never into a later window than the one charged.
-- KEYS[i]   where refund i's state lives (as apply's)
-- ARGV[1]   now, ms since the epoch
-- ARGV[2]   grace, ms (as apply's)
-- ARGV[3..] 4 values per refund: its policy (as apply's), cost, window (the charging
--           decision's reset_at), its state's field
-- Reply     the number of states changed
local now, grace = int(ARGV[1]), int(ARGV[2])
local changed = 0
for i = 1, #KEYS do
  local b = 2 + (i - 1) * 4
  local p = policy(ARGV[b + 1])
  local kind, p1, p2, p3 = p[1], p[2], p[3], p[4]
  local cost, window, field = int(ARGV[b + 2]), int(ARGV[b + 3]), ARGV[b + 4]
  local lx, ly, lz = load(kind, KEYS[i], field, p2, now)
  if lx ~= nil and kind ~= CONCURRENCY then
    local x, y, z = normalize(kind, lx, ly, lz, p1, p2, p3, now)
    local nx, ny, nz = refund(kind, x, y, z, p1, p2, p3, cost, window)
    if nx ~= nil then
      store(kind, KEYS[i], field, nx, ny, nz, p1, p2, p3, now, grace, lx, ly, lz, nil)
      changed = changed + 1
    end
  end
end
return changed
