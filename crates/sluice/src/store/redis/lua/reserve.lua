-- reserve: holds each op's cost of its fixed window as reservation `id`, all or nothing
-- (twin of the memory store's reserve, over algo::reservation::reserve): admitted only
-- when every enforced op fits with what its window has committed and holds. A cost of 0
-- is admitted and holds nothing (it takes no place among a window's holds).
-- KEYS[i]   op i's bucket
-- ARGV      now, grace (as apply's), the reservation's id (decimal), its ttl (ms), then
--           3 values per op: its policy (as apply's), its cost, its state's field
-- Reply     6 integers per op, as apply's
local now, grace, id, ttl = int(ARGV[1]), int(ARGV[2]), ARGV[3], int(ARGV[4])
local windows, refused, reply = {}, false, {}
for i = 1, #KEYS do
  local p, cost = policy(ARGV[2 + 3 * i]), int(ARGV[3 + 3 * i])
  local s = reserved_load(KEYS[i], ARGV[4 + 3 * i], p, now)
  local a, l, used, rem, reset, retry
  if cost > 0 and s.h ~= nil and redis.call('ZCARD', s.dk) >= HOLDS_MAX then
    -- reservation::reserve: the holds are full until the first one ends
    a, l, used, rem, reset, retry = fixed_window_charge(s.u, s.r, s.h, p[2], 0, now)
    a, rem, retry = 0, 0, max(s.h - now, 0)
  else
    a, l, used, rem, reset, retry, s.charged = fixed_window_charge(s.u, s.r, s.h, p[2], cost, now)
  end
  if a == 0 and not p[5] then refused = true end
  s.p, s.cost, s.admitted = p, cost, a == 1
  windows[i] = s
  local d = 6 * i
  reply[d - 5], reply[d - 4], reply[d - 3], reply[d - 2], reply[d - 1], reply[d] = a, l, used, rem, reset, retry
end
for i = 1, #KEYS do
  local s = windows[i]
  if s.admitted and not refused then
    if s.charged ~= nil then s.u = s.charged end
    if s.cost > 0 then
      local e = now + ttl
      redis.call('HSET', s.hk, id, num(s.cost) .. ':' .. num(e), 'w', num(s.r))
      redis.call('ZADD', s.dk, num(e), id)
      -- the holds live as long as their window: given back however late it is touched
      live_until(s.hk, s.r + grace)
      live_until(s.dk, s.r + grace)
      if s.h == nil or e < s.h then s.h = e end
    end
  end
  reserved_store(s, KEYS[i], ARGV[4 + 3 * i], s.p, now, grace)
  local d = 6 * i
  reply[d - 5], reply[d - 4], reply[d - 3], reply[d - 2], reply[d - 1], reply[d] =
    with_holds(reply[d - 5], reply[d - 4], reply[d - 3], reply[d - 2], reply[d - 1], reply[d], s.h, now)
end
return reply
