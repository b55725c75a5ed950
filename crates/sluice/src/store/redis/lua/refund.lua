-- refund: gives back charges (twin of algo::Limit::refund; a token bucket with open
-- quota grants: of algo::grant::bucket_refund), never above the limit and never into a
-- later window than the one charged.
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
  local lx, ly, lz, le = load(kind, KEYS[i], field, p2, now)
  if lx ~= nil and kind ~= CONCURRENCY then
    local nx, ny, nz
    local open = kind == TOKEN_BUCKET and book_load(KEYS[i], field) or {}
    if #open > 0 then
      -- grant::bucket_refund: open grants hold the refill back
      local cap = max(p3 - book_units(open), 0)
      local x, y = token_bucket_normalize(lx, ly, p1, p2, cap, now)
      nx, ny = token_bucket_refund(x, y, p2, cap, cost)
    else
      local x, y, z = normalize(kind, lx, ly, lz, p1, p2, p3, now)
      nx, ny, nz = refund(kind, x, y, z, p1, p2, p3, cost, window)
    end
    if nx ~= nil then
      store(kind, KEYS[i], field, nx, ny, nz, p1, p2, p3, now, grace, lx, ly, lz, le, nil)
      changed = changed + 1
    end
  end
end
return changed
