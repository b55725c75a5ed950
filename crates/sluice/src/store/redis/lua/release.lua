-- release: gives a lease back on every concurrency state; idempotent.
-- KEYS[i]   a concurrency state (sorted set of lease -> acquired_at)
-- ARGV[1]   the lease (hex)
-- Reply     1 if any of them held the lease, else 0
local held = 0
for i = 1, #KEYS do
  held = held + redis.call('ZREM', KEYS[i], ARGV[1])
end
if held > 0 then return 1 end
return 0
