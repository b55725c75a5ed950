-- reset: forgets states of one client at once; the client starts afresh on them.
-- KEYS[i]   the key of state i: its bucket hash, or a concurrency state's sorted set
-- ARGV[i]   the field of state i in its bucket hash, or '' for a key of its own
--           (a fixed window's grant book, the field beside it, a global window's pool and its
--           reservations' keys go too)
-- Reply     how many states were there
local gone = 0
for i = 1, #KEYS do
  if ARGV[i] == '' then
    gone = gone + redis.call('DEL', KEYS[i])
  else
    gone = gone + redis.call('HDEL', KEYS[i], ARGV[i])
    redis.call('HDEL', KEYS[i], ARGV[i] .. '~', ARGV[i] .. '$')
    redis.call('DEL', KEYS[i] .. ARGV[i] .. '^', KEYS[i] .. ARGV[i] .. '>', KEYS[i] .. ARGV[i] .. '!')
  end
end
return gone
