-- peek: what every op would report now, writing nothing. Flagged no-writes, so it runs
-- on replicas (EVALSHA_RO). A state whose stored reset has passed reads as fresh, also
-- on a replica that still holds it: expiry is decided here, not by Redis's TTL. A
-- reservation past its deadline reads as released.
-- KEYS[i]   where op i's state lives (as apply's)
-- ARGV[1]   now, ms since the epoch
-- ARGV[2..] 2 values per op: its policy (as apply's), its state's field
-- Reply     6 integers per op, as apply's
WRITES = false
local now = int(ARGV[1])
local reply = {}
for i = 1, #KEYS do
  local p = policy(ARGV[2 * i])
  local kind, p1, p2, p3 = p[1], p[2], p[3], p[4]
  local lx, ly, lz = load(kind, KEYS[i], ARGV[2 * i + 1], p2, now)
  local x, y, z = normalize(kind, lx, ly, lz, p1, p2, p3, now)
  local d = 6 * i
  reply[d - 5], reply[d - 4], reply[d - 3], reply[d - 2], reply[d - 1], reply[d] =
    charge(kind, x, y, z, p1, p2, p3, 0, '', false, now)
  if kind == FIXED_WINDOW and z ~= nil then
    reply[d - 5], reply[d - 4], reply[d - 3], reply[d - 2], reply[d - 1], reply[d] =
      with_holds(reply[d - 5], reply[d - 4], reply[d - 3], reply[d - 2], reply[d - 1], reply[d], z, now)
  end
end
return reply
