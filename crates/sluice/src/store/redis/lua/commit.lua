-- commit: settles reservation `id` on each state with its actual amount (twin of
-- algo::reservation::commit): an open hold's units are replaced by the actual; a
-- reservation not open (released at its deadline, of another window, unknown) is
-- charged its actual as a report, never refused; one committed already changes nothing.
-- Id 0 (reservation::REPORT) is a report of no reservation, remembered nowhere. A
-- window's count stops at MAX_EXACT (2^53 - 1), the last integer a double holds exactly.
-- KEYS[i]   commit i's bucket
-- ARGV      now, grace (as apply's), the reservation's id (decimal), then 3 values per
--           commit: its policy (as apply's), the actual amount, its state's field
-- Reply     2 integers per commit: what it did (0 committed, 1 reported, 2 again) and
--           the units the hold had
local now, grace, id = int(ARGV[1]), int(ARGV[2]), ARGV[3]
local reply = {}
for i = 1, #KEYS do
  local p, actual, field = policy(ARGV[1 + 3 * i]), int(ARGV[2 + 3 * i]), ARGV[3 + 3 * i]
  local s = reserved_load(KEYS[i], field, p, now)
  local sk = settled_key(KEYS[i], field)
  local did, held, keep = 1, 0, nil
  local until_ = id ~= '0' and redis.call('ZSCORE', sk, id)
  if id == '0' then
    s.u = min(s.u + actual, MAX_EXACT)
  elseif until_ and tonumber(until_) > now then
    did = 2
  else
    local hold = redis.call('HGET', s.hk, id)
    if hold then
      local units, e = string.match(hold, '^(%d+):(%d+)$')
      held = int(units)
      redis.call('HDEL', s.hk, id)
      redis.call('ZREM', s.dk, id)
      s.h = holds_first(s.dk, now)
      if s.h == nil then redis.call('DEL', s.hk, s.dk) end
      s.u, did, keep = min(max(s.u - held, 0) + actual, MAX_EXACT), 0, max(max(int(e), s.r), now)
    else
      s.u, keep = min(s.u + actual, MAX_EXACT), max(s.r, now)
    end
    -- Ledger::settle: remembered until `keep`, the oldest forgotten past SETTLED_MAX
    redis.call('ZREMRANGEBYSCORE', sk, '-inf', num(now))
    redis.call('ZADD', sk, num(keep), id)
    if redis.call('ZCARD', sk) > SETTLED_MAX then redis.call('ZREMRANGEBYRANK', sk, 0, 0) end
    live_until(sk, keep + grace)
  end
  reserved_store(s, KEYS[i], field, p, now, grace)
  reply[2 * i - 1], reply[2 * i] = did, held
end
return reply
