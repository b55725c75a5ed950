-- apply: every op of one client, all or nothing (twin of algo::apply_into).
-- KEYS[i]   where op i's state lives: its bucket, or its sorted set (see lib.lua)
-- ARGV[1]   now, ms since the epoch: the caller's clock; scripts never read TIME
-- ARGV[2]   grace, ms: a key outlives the moment its state stops mattering by this much
-- ARGV[3..] 8 values per op: algorithm, p1, p2, p3, cost, shadow (0/1), lease (hex;
--           '' = none), field (the state's field in its bucket)
-- Reply     6 integers per op: allowed (0/1), limit, used, remaining, reset_at,
--           retry_after (-1 = none)
local now, grace = tonumber(ARGV[1]), tonumber(ARGV[2])
local ops, refused = {}, false
-- pass 1: normalize every op and find whether an enforced one refuses
for i = 1, #KEYS do
  local b = 2 + (i - 1) * 8
  local op = {kind = tonumber(ARGV[b + 1]), p1 = tonumber(ARGV[b + 2]), p2 = tonumber(ARGV[b + 3]),
    p3 = tonumber(ARGV[b + 4]), cost = tonumber(ARGV[b + 5]), shadow = ARGV[b + 6] == '1', lease = ARGV[b + 7],
    field = ARGV[b + 8]}
  op.loaded = load(op.kind, KEYS[i], op.field, op.p1, op.p2, now)
  op.st = normalize(op.kind, op.loaded, op.p1, op.p2, op.p3, now)
  op.held = op.kind == CONCURRENCY and concurrency_held(KEYS[i], op.lease, op.p2, now)
  local d = charge(op.kind, op.st, op.p1, op.p2, op.p3, op.cost, op.lease, op.held, now)
  if d[1] == 0 and not op.shadow then refused = true end
  ops[i] = op
end
-- pass 2: charge for real, or report the uncharged state; write back
local reply = {}
for i, op in ipairs(ops) do
  local d, new = charge(op.kind, op.st, op.p1, op.p2, op.p3, op.cost, op.lease, op.held, now)
  local st = op.st
  if new ~= nil and not refused then
    st = new
  elseif new ~= nil then
    d = charge(op.kind, op.st, op.p1, op.p2, op.p3, 0, '', false, now)
  end
  store(op.kind, KEYS[i], op.field, st, op.p1, op.p2, op.p3, now, grace, op.loaded)
  for j = 1, 6 do reply[#reply + 1] = d[j] end
end
return reply
