-- refund: gives back charges (algo::Limit::refund), never above the limit and never into
-- a later window than the one charged.
-- KEYS[i]   where refund i's state lives (as apply's)
-- ARGV[1]   now, ms since the epoch
-- ARGV[2]   grace, ms (as apply's)
-- ARGV[3..] 7 values per refund: kind, p1, p2, p3, cost, window (the charging
--           decision's reset_at), field
-- Reply     the number of states changed
local now, grace = tonumber(ARGV[1]), tonumber(ARGV[2])
local changed = 0
for i = 1, #KEYS do
  local b = 2 + (i - 1) * 7
  local kind, p1, p2, p3 = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
  local cost, window, field = tonumber(ARGV[b + 5]), tonumber(ARGV[b + 6]), ARGV[b + 7]
  local loaded = load(kind, KEYS[i], field, p1, p2, now)
  if loaded ~= nil and kind ~= 4 then
    local st = normalize(kind, loaded, p1, p2, p3, now)
    local new = nil
    if kind == 1 then
      if st.r == window and st.u > 0 then new = {u = max(st.u - cost, 0), r = st.r} end
    elseif kind == 2 then
      new = {t = min(st.t + cost * p2, p3 * p2), a = st.a}
    else
      local charged = window - 2 * p2
      if charged >= 0 and st.s == charged then
        new = {s = st.s, c = max(st.c - cost, 0), p = st.p}
      elseif charged >= 0 and st.s == charged + p2 then
        new = {s = st.s, c = st.c, p = max(st.p - cost, 0)}
      end
    end
    if new ~= nil then
      store(kind, KEYS[i], field, new, p1, p2, p3, now, grace, loaded)
      changed = changed + 1
    end
  end
end
return changed
