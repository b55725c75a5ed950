-- registry: the fleet's stored overrides, values under ids, and a version that every
-- change moves (instances poll the version with a plain GET, and read the values here
-- when it moved).
-- KEYS[1]   the hash of id -> value
-- KEYS[2]   the version counter
-- ARGV[1]   read | put | remove | touch
-- ARGV[2]   the id (put, remove)
-- ARGV[3]   put: the value; remove: '' or the value the id must still have
-- Reply     {version, previous value or false, then id, value, id, value ... for read}
local action = ARGV[1]
local version = tonumber(redis.call('GET', KEYS[2]) or '0')
if action == 'read' then
  local reply = {version, false}
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all do reply[i + 2] = all[i] end
  return reply
elseif action == 'touch' then
  return {redis.call('INCR', KEYS[2]), false}
end
local previous = redis.call('HGET', KEYS[1], ARGV[2])
if action == 'put' then
  redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
elseif action == 'remove' then
  if not previous or (ARGV[3] ~= '' and previous ~= ARGV[3]) then
    return {version, false}
  end
  redis.call('HDEL', KEYS[1], ARGV[2])
else
  return redis.error_reply('registry: unknown action ' .. tostring(action))
end
return {redis.call('INCR', KEYS[2]), previous}
