-- apply: calls of one or more clients, one after another, each all or nothing (twin of
-- algo::apply_into). Decisions in flight at once for one node go in one script call
-- (store/redis/batch.rs): the same as sending them one by one in this order, for a
-- fraction of Redis's time per decision.
-- KEYS      the keys of every op of every call, in order: its bucket, or its sorted set
-- ARGV[1]   grace, ms: a key outlives the moment its state stops mattering by this much
-- ARGV[2..] per call: now (ms since the epoch: the caller's clock; scripts never read
--           TIME), the number of ops n, then 8 values per op: algorithm, p1, p2, p3, cost,
--           shadow (0/1), lease (hex; '' = none), field (the state's field in its bucket)
-- Reply     per call: 6 integers per op (allowed (0/1), limit, used, remaining,
--           reset_at, retry_after (-1 = none)), or the error that stopped that call
local grace = int(ARGV[1])

-- One call: `n` ops whose keys start after KEYS[k] and values after ARGV[a].
local function apply(k, a, n, now)
  local ops, refused = {}, false
  -- pass 1: normalize every op and find whether an enforced one refuses
  for i = 1, n do
    local b, key = a + (i - 1) * 8, KEYS[k + i]
    local op = {kind = int(ARGV[b + 1]), p1 = int(ARGV[b + 2]), p2 = int(ARGV[b + 3]),
      p3 = int(ARGV[b + 4]), cost = int(ARGV[b + 5]), shadow = ARGV[b + 6] == '1', lease = ARGV[b + 7],
      field = ARGV[b + 8], key = key}
    op.loaded = load(op.kind, key, op.field, op.p1, op.p2, now)
    op.st = normalize(op.kind, op.loaded, op.p1, op.p2, op.p3, now)
    op.held = op.kind == CONCURRENCY and concurrency_held(key, op.lease, op.p2, now)
    op.d, op.new = charge(op.kind, op.st, op.p1, op.p2, op.p3, op.cost, op.lease, op.held, now)
    if op.d[1] == 0 and not op.shadow then refused = true end
    ops[i] = op
  end
  -- pass 2: keep the charges, or report the uncharged state; write back
  local reply = {}
  for _, op in ipairs(ops) do
    local d, new = op.d, op.new
    local st = op.st
    if new ~= nil and not refused then
      st = new
    elseif new ~= nil then
      d = charge(op.kind, op.st, op.p1, op.p2, op.p3, 0, '', false, now)
    end
    store(op.kind, op.key, op.field, st, op.p1, op.p2, op.p3, now, grace, op.loaded)
    for j = 1, 6 do reply[#reply + 1] = d[j] end
  end
  return reply
end

-- A lone call's error is the script's (a cluster client retries on some, e.g. TRYAGAIN
-- while a slot moves); in a batch, a failed call answers its error and stops no other.
local alone = #ARGV == 3 + 8 * int(ARGV[3])
local replies, k, a = {}, 0, 1
while a < #ARGV do
  local now, n = int(ARGV[a + 1]), int(ARGV[a + 2])
  local ok, reply = true, nil
  if alone then
    reply = apply(k, a + 2, n, now)
  else
    ok, reply = pcall(apply, k, a + 2, n, now)
  end
  if not ok then
    if type(reply) == 'table' then reply = reply.err end
    reply = tostring(reply)
  end
  replies[#replies + 1] = reply
  k, a = k + n, a + 2 + n * 8
end
return replies
