-- apply: calls of one or more clients, one after another, each all or nothing (twin of
-- algo::apply_into). Decisions in flight at once for one node go in one script call
-- (store/redis/batch.rs): the same as sending them one by one in this order, for a
-- fraction of Redis's time per decision.
-- KEYS      the keys of every op of every call, in order: its bucket, or its sorted set
-- ARGV[1]   grace, ms: a key outlives the moment its state stops mattering by this much
-- ARGV[2..] per call: now (ms since the epoch: the caller's clock; scripts never read
--           TIME), the number of ops n, then 3 values per op: its policy
--           ("kind:p1:p2:p3:shadow"), its cost, and its state's field in its bucket (a
--           concurrency limit: the lease to take, hex, '' = none)
-- Reply     one array: per call, 6 integers per op (flags: 1 allowed, 2 holds open on a
--           fixed window (see with_holds); limit, used, remaining, reset_at, retry_after
--           (-1 = none)), or in their place the error that stopped that call (one string)
local grace = int(ARGV[1])
local reply, out = {}, 0

-- What pass 1 found for op i of the call being applied (reused by every call).
local P, LX, LY, LZ, LE, X, Y, Z, NX, NY, NZ, D = {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}

-- One call: `n` ops whose keys follow KEYS[k] and values ARGV[a]; appends its decisions.
local function apply(k, a, n, now)
  local refused = false
  -- pass 1: normalize every op, charge it, and find whether an enforced one refuses
  for i = 1, n do
    local p, key, arg = policy(ARGV[a + 3 * i - 2]), KEYS[k + i], ARGV[a + 3 * i]
    local kind, p1, p2, p3 = p[1], p[2], p[3], p[4]
    local lx, ly, lz, le = load(kind, key, arg, p2, now)
    local x, y, z = normalize(kind, lx, ly, lz, p1, p2, p3, now)
    local held = kind == CONCURRENCY and concurrency_held(key, arg, p2, now)
    local d = 6 * i
    D[d - 5], D[d - 4], D[d - 3], D[d - 2], D[d - 1], D[d], NX[i], NY[i], NZ[i] =
      charge(kind, x, y, z, p1, p2, p3, int(ARGV[a + 3 * i - 1]), arg, held, now)
    if D[d - 5] == 0 and not p[5] then refused = true end
    P[i], LX[i], LY[i], LZ[i], LE[i], X[i], Y[i], Z[i] = p, lx, ly, lz, le, x, y, z
  end
  -- pass 2: keep the charges, or report the uncharged state; write back
  for i = 1, n do
    local p, key, arg = P[i], KEYS[k + i], ARGV[a + 3 * i]
    local kind, p1, p2, p3 = p[1], p[2], p[3], p[4]
    local x, y, z, add = X[i], Y[i], Z[i], nil
    local d = 6 * i
    if NX[i] ~= nil and not refused then
      x, y, z = NX[i], NY[i], NZ[i]
      if kind == CONCURRENCY then add = arg end
    elseif NX[i] ~= nil then
      D[d - 5], D[d - 4], D[d - 3], D[d - 2], D[d - 1], D[d] = charge(kind, x, y, z, p1, p2, p3, 0, '', false, now)
    end
    store(kind, key, arg, x, y, z, p1, p2, p3, now, grace, LX[i], LY[i], LZ[i], LE[i], add)
    if kind == FIXED_WINDOW and z ~= nil then
      D[d - 5], D[d - 4], D[d - 3], D[d - 2], D[d - 1], D[d] =
        with_holds(D[d - 5], D[d - 4], D[d - 3], D[d - 2], D[d - 1], D[d], z, now)
    end
    for j = d - 5, d do
      out = out + 1
      reply[out] = D[j]
    end
  end
end

-- A lone call's error is the script's (a cluster client retries on some, e.g. TRYAGAIN
-- while a slot moves); in a batch, a failed call answers its error and stops no other.
local alone = #ARGV == 3 + 3 * int(ARGV[3])
local k, a = 0, 2
while a < #ARGV do
  local now, n = int(ARGV[a]), int(ARGV[a + 1])
  if alone then
    apply(k, a + 1, n, now)
  else
    local before = out
    local ok, err = pcall(apply, k, a + 1, n, now)
    if not ok then
      if type(err) == 'table' then err = err.err end
      for j = before + 1, out do reply[j] = nil end
      out = before + 1
      reply[out] = tostring(err)
    end
  end
  k, a = k + n, a + 2 + 3 * n
end
return reply
