-- registry: the fleet's stored overrides, values under ids; a version that every change
-- moves (instances poll it, with KEYS[6], in a plain MGET); a change log, a sorted set of
-- ids scored by the version of their last change, so an instance reads only what changed
-- since the version it holds. Every call touches at most a page of ids (the caller bounds it), so
-- none blocks Redis for long. The whole set is read with HSCAN, outside this script.
-- TOMBSTONES (prepended) removed ids the log keeps; past it the oldest are forgotten and
-- KEYS[5] says up to which version, so a reader behind that reads the whole set again.
-- KEYS[1]   the hash of id -> value
-- KEYS[2]   the version counter
-- KEYS[3]   the change log (sorted set: id scored by its last change's version)
-- KEYS[4]   the removed ids, oldest first (list)
-- KEYS[5]   the floor: the highest version of a forgotten removal
-- KEYS[6]   how many versions these writes moved (each also logs): the version minus it
--           counts moves made without logging, by a Sluice older than the change log,
--           and a reader that sees that count move reads the whole set again
-- ARGV[1]   changes | put | remove | touch
-- changes:  ARGV[2] the version after which, ARGV[3] how many at most
--           reply {version, floor, id, version, value or false, ...}
-- put:      ARGV[2] the most ids the hash may hold, ARGV[3..] id, value, id, value ...
--           reply {version, previous value (one id) or false, false or the ids held when
--           the new ones would pass the most: then nothing is written}
-- remove:   ARGV[2] the id, ARGV[3] '' or the value it must still have
--           reply {version, previous value or false}
-- touch:    reply {version, false}
local action = ARGV[1]
local version = tonumber(redis.call('GET', KEYS[2]) or '0')

-- moves the version and logs `id` at it
local function changed(id)
  version = redis.call('INCR', KEYS[2])
  redis.call('INCR', KEYS[6])
  redis.call('ZADD', KEYS[3], version, id)
end

if action == 'changes' then
  local reply = {version, tonumber(redis.call('GET', KEYS[5]) or '0')}
  local log = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. ARGV[2], '+inf', 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[3]))
  for i = 1, #log, 2 do
    reply[#reply + 1] = log[i]
    reply[#reply + 1] = tonumber(log[i + 1])
    reply[#reply + 1] = redis.call('HGET', KEYS[1], log[i])
  end
  return reply
elseif action == 'touch' then
  redis.call('INCR', KEYS[6])
  return {redis.call('INCR', KEYS[2]), false}
elseif action == 'put' then
  -- a page of ids in a handful of calls (one HMGET, HSET, ZADD), not a few per id: what
  -- keeps an import's call at about a millisecond
  local ids, log = {}, {}
  for i = 3, #ARGV, 2 do ids[#ids + 1] = ARGV[i] end
  local before = redis.call('HMGET', KEYS[1], unpack(ids))
  local new = 0
  for i = 1, #before do
    if not before[i] then new = new + 1 end
  end
  local held = redis.call('HLEN', KEYS[1])
  if held + new > tonumber(ARGV[2]) then return {version, false, held} end
  for i = 1, #ids do
    log[#log + 1] = version + i
    log[#log + 1] = ids[i]
  end
  redis.call('HSET', KEYS[1], unpack(ARGV, 3))
  redis.call('ZADD', KEYS[3], unpack(log))
  version = version + #ids
  redis.call('SET', KEYS[2], version)
  redis.call('INCRBY', KEYS[6], #ids)
  local previous = false
  if #ids == 1 then previous = before[1] end
  return {version, previous, false}
elseif action == 'remove' then
  local previous = redis.call('HGET', KEYS[1], ARGV[2])
  if not previous or (ARGV[3] ~= '' and previous ~= ARGV[3]) then
    return {version, false}
  end
  redis.call('HDEL', KEYS[1], ARGV[2])
  changed(ARGV[2])
  redis.call('RPUSH', KEYS[4], ARGV[2])
  -- one removal forgets at most one old one: the work per call stays constant
  if redis.call('LLEN', KEYS[4]) > TOMBSTONES then
    local old = redis.call('LPOP', KEYS[4])
    local at = redis.call('ZSCORE', KEYS[3], old)
    if at and redis.call('HEXISTS', KEYS[1], old) == 0 then
      redis.call('ZREM', KEYS[3], old)
      local floor = tonumber(redis.call('GET', KEYS[5]) or '0')
      if tonumber(at) > floor then redis.call('SET', KEYS[5], at) end
    end
  end
  return {version, previous}
end
return redis.error_reply('registry: unknown action ' .. tostring(action))
