-- peek: what every op would report now, writing nothing. Flagged no-writes, so it runs
-- on replicas (EVALSHA_RO). A state whose stored reset has passed reads as fresh, also
-- on a replica that still holds it: expiry is decided here, not by Redis's TTL.
-- KEYS[i]   where op i's state lives (as apply's)
-- ARGV[1]   now, ms since the epoch
-- ARGV[2..] 5 values per op: algorithm, p1, p2, p3, field
-- Reply     6 integers per op, as apply's
local now = int(ARGV[1])
local reply = {}
for i = 1, #KEYS do
  local b = 1 + (i - 1) * 5
  local kind, p1, p2, p3 = int(ARGV[b + 1]), int(ARGV[b + 2]), int(ARGV[b + 3]), int(ARGV[b + 4])
  local st = normalize(kind, load(kind, KEYS[i], ARGV[b + 5], p1, p2, now), p1, p2, p3, now)
  local d = charge(kind, st, p1, p2, p3, 0, '', false, now)
  for j = 1, 6 do reply[#reply + 1] = d[j] end
end
return reply
