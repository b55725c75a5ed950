-- The pure algorithms of crates/sluice/src/algo, in Lua. Every script begins with the
-- prelude the Rust side writes (the algorithm numbers FIXED_WINDOW, TOKEN_BUCKET,
-- SLIDING_WINDOW, CONCURRENCY: see `Kind` in store/redis/mod.rs, the one place they are
-- set), then this file. Each function names the Rust function it twins, and they come
-- in the same order as `algo::Limit`'s variants; the conformance suite and a
-- random-sequence harness hold them to the Rust model decision for decision.
--
-- Numbers: Lua 5.1 has only doubles, exact for integers up to 2^53. Sluice keeps every
-- limit, cost and product at most 2^53 - 1 (algo::MAX_EXACT, checked by
-- Limit::validate), so every sum and quotient here is exact, and floor(a / b) is the
-- exact integer quotient. Numbers are written back with "%.0f": Lua's own
-- number-to-string conversion keeps only 14 digits.
--
-- Layout (see docs/architecture.md): fixed windows, token buckets and sliding windows
-- are fields of a bucket hash `s:{bucket}` shared by many clients; the field names one
-- state of one client and its value is "expires_at:a:b", the moment the state stops
-- mattering first, so that pruning reads one number. A bucket of a few dozen fields
-- stays a listpack, about 50 bytes a state instead of about 165 for a key of its own
-- with a TTL. The bucket's TTL is the latest expiry of its fields plus the grace; fields
-- that expire while the bucket lives are pruned as new ones arrive. A concurrency limit
-- keeps a sorted set per client, `s:{bucket}field`.
--
-- Parameters p1, p2, p3 per algorithm: fixed window (limit, window, aligned), token
-- bucket (rate, per, burst), sliding window (limit, window, -), concurrency (limit,
-- lease_ttl, -). A decision is {allowed (0/1), limit, used, remaining, reset_at,
-- retry_after (-1: none)}.

local floor = math.floor
local function cdiv(a, b) return floor((a + b - 1) / b) end
local function min(a, b) if a < b then return a end return b end
local function max(a, b) if a > b then return a end return b end
-- Numbers cross the script boundary as strings both ways, and each conversion (strtod,
-- printf) costs Redis about as much as a table or a redis.call. A script call converts
-- each distinct string or number once: a batch's calls share `now`, their policies'
-- parameters and, for aligned windows, the window's end (about 10% of Redis's CPU per
-- decision at 64 in flight, docs/benchmarks.md). The tables live for one script call:
-- every EVALSHA runs this file afresh.
local parsed, formatted = {}, {}
-- The number a decimal string holds (tonumber, remembered for this script call).
local function int(s)
  local v = parsed[s]
  if v == nil then
    v = tonumber(s)
    parsed[s] = v
  end
  return v
end
-- The decimal string of an integer (string.format('%.0f'), remembered likewise).
local function num(x)
  local s = formatted[x]
  if s == nil then
    s = string.format('%.0f', x)
    formatted[x] = s
  end
  return s
end

-- Fixed window (algo::fixed_window): {u = used, r = resets_at}, stored "r:u".

-- fixed_window::window_end
local function fixed_window_end(window, aligned, now)
  if aligned == 1 then return (floor(now / window) + 1) * window end
  return now + window
end

-- fixed_window::normalize (nil: fixed_window::fresh)
local function fixed_window_normalize(st, window, aligned, now)
  if st == nil or now >= st.r then return {u = 0, r = fixed_window_end(window, aligned, now)} end
  return st
end

-- fixed_window::charge
local function fixed_window_charge(st, limit, cost, now)
  local used = st.u + cost
  if used <= limit then
    local new = nil
    if cost > 0 then new = {u = used, r = st.r} end
    return {1, limit, used, limit - used, st.r, -1}, new
  end
  local retry = -1
  if cost <= limit then retry = max(st.r - now, 0) end
  return {0, limit, st.u, 0, st.r, retry}, nil
end

-- fixed_window::refund
local function fixed_window_refund(st, cost, charged_window)
  if st.r == charged_window and st.u > 0 then return {u = max(st.u - cost, 0), r = st.r} end
  return nil
end

-- Token bucket (algo::token_bucket): {t = tokens in 1/per units, a = at}, stored
-- "full_at:t:(full_at - a)".

-- token_bucket::normalize (nil: token_bucket::fresh)
local function token_bucket_normalize(st, rate, per, burst, now)
  local cap = burst * per
  if st == nil then return {t = cap, a = now} end
  if now <= st.a then return {t = min(st.t, cap), a = st.a} end
  local missing = max(cap - st.t, 0)
  if now - st.a >= cdiv(missing, rate) then return {t = cap, a = now} end
  return {t = st.t + (now - st.a) * rate, a = now}
end

-- token_bucket::full_at
local function token_bucket_full_at(t, a, rate, per, burst)
  return a + cdiv(max(burst * per - t, 0), rate)
end

-- token_bucket::charge
local function token_bucket_charge(st, rate, per, burst, cost, now)
  local need = cost * per
  if need <= st.t then
    local after = st.t - need
    local remaining = floor(after / per)
    local new = nil
    if cost > 0 then new = {t = after, a = st.a} end
    return {1, burst, burst - remaining, remaining, token_bucket_full_at(after, st.a, rate, per, burst), -1}, new
  end
  local retry = -1
  if cost <= burst then retry = max(st.a + cdiv(need - st.t, rate) - now, 0) end
  return {0, burst, burst - floor(st.t / per), 0, token_bucket_full_at(st.t, st.a, rate, per, burst), retry}, nil
end

-- token_bucket::refund
local function token_bucket_refund(st, per, burst, cost)
  return {t = min(st.t + cost * per, burst * per), a = st.a}
end

-- Sliding window (algo::sliding_window): {s = start, c = cur, p = prev}, stored
-- "(s + 2 * window):c:p".

-- sliding_window::normalize (nil: sliding_window::fresh)
local function sliding_window_normalize(st, window, now)
  local start = now - now % window
  if st == nil then return {s = start, c = 0, p = 0} end
  if start <= st.s then return st end
  if start == st.s + window then return {s = start, c = 0, p = st.c} end
  return {s = start, c = 0, p = 0}
end

-- sliding_window::count
local function sliding_window_count(st, window, now)
  local elapsed = max(now - st.s, 0)
  return cdiv(st.p * (window - min(elapsed, window)), window) + st.c
end

-- sliding_window::first_fit
local function sliding_window_first_fit(prev, window, k)
  if prev == 0 then return 0 end
  return max(window - floor(k * window / prev), 0)
end

-- sliding_window::charge
local function sliding_window_charge(st, limit, window, cost, now)
  local count = sliding_window_count(st, window, now)
  if count + cost <= limit then
    local new = nil
    local cur = st.c + cost
    if cost > 0 then new = {s = st.s, c = cur, p = st.p} end
    local reset = st.s + window
    if cur > 0 then reset = st.s + 2 * window end
    return {1, limit, count + cost, limit - count - cost, reset, -1}, new
  end
  local retry_at
  local k = limit - (st.c + cost)
  if k >= 0 and sliding_window_first_fit(st.p, window, k) < window then
    retry_at = st.s + sliding_window_first_fit(st.p, window, k)
  else
    retry_at = st.s + window + sliding_window_first_fit(st.c, window, max(limit - cost, 0))
  end
  local reset = st.s + window
  if st.c > 0 then reset = st.s + 2 * window end
  local retry = -1
  if cost <= limit then retry = max(retry_at - now, 0) end
  return {0, limit, min(count, limit), 0, reset, retry}, nil
end

-- sliding_window::refund (charged_reset_at: the reset the charging decision reported)
local function sliding_window_refund(st, window, cost, charged_reset_at)
  local charged = charged_reset_at - 2 * window
  if charged >= 0 and st.s == charged then return {s = st.s, c = max(st.c - cost, 0), p = st.p} end
  if charged >= 0 and st.s == charged + window then return {s = st.s, c = st.c, p = max(st.p - cost, 0)} end
  return nil
end

-- Concurrency (algo::concurrency): a sorted set of lease -> acquired_at, held here as
-- {n = count, min = oldest at, max = newest at} of the live leases.

-- Reads the live leases (concurrency::normalize drops the others; the write removes
-- them); nil when there are none.
local function concurrency_load(key, ttl, now)
  local live = '(' .. num(now - ttl)
  local n = redis.call('ZCOUNT', key, live, '+inf')
  if n == 0 then return nil end
  local first = redis.call('ZRANGEBYSCORE', key, live, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  local last = redis.call('ZREVRANGEBYSCORE', key, '+inf', live, 'WITHSCORES', 'LIMIT', 0, 1)
  return {n = n, min = int(first[2]), max = int(last[2])}
end

-- Whether `lease` is already held and live (the `any(id == lease)` of Limit::admits and
-- concurrency::acquire): taking it again admits without a second place.
local function concurrency_held(key, lease, ttl, now)
  if lease == '' then return false end
  local at = redis.call('ZSCORE', key, lease)
  return at ~= false and int(at) > now - ttl
end

-- concurrency::status
local function concurrency_status(st, limit, ttl, now)
  local reset = now
  if st.n > 0 then reset = st.min + ttl end
  return {1, limit, st.n, max(limit - st.n, 0), reset, -1}
end

-- concurrency::acquire
local function concurrency_acquire(st, limit, ttl, lease, now)
  if st.n < limit then
    local new = {n = st.n + 1, min = min(st.min or now, now), max = max(st.max or now, now), add = lease}
    return concurrency_status(new, limit, ttl, now), new
  end
  local reset = st.min + ttl
  return {0, limit, st.n, 0, reset, max(reset - now, 0)}, nil
end

-- Dispatch, as algo::Limit does.

-- Limit::normalize: the state brought up to now; charges nothing.
local function normalize(kind, st, p1, p2, p3, now)
  if kind == FIXED_WINDOW then return fixed_window_normalize(st, p2, p3, now) end
  if kind == TOKEN_BUCKET then return token_bucket_normalize(st, p1, p2, p3, now) end
  if kind == SLIDING_WINDOW then return sliding_window_normalize(st, p2, now) end
  if st == nil then return {n = 0} end
  return st
end

-- Limit::charge: the decision and the charged state (nil when nothing was charged).
-- `held` is whether a concurrency lease is already held (concurrency_held).
local function charge(kind, st, p1, p2, p3, cost, lease, held, now)
  if kind == FIXED_WINDOW then return fixed_window_charge(st, p1, cost, now) end
  if kind == TOKEN_BUCKET then return token_bucket_charge(st, p1, p2, p3, cost, now) end
  if kind == SLIDING_WINDOW then return sliding_window_charge(st, p1, p2, cost, now) end
  if lease == '' or held then return concurrency_status(st, p1, p2, now), nil end
  return concurrency_acquire(st, p1, p2, lease, now)
end

-- Limit::refund: the state with `cost` given back in the window the charge was made
-- in (`window`, the charging decision's reset_at), or nil when nothing changes.
local function refund(kind, st, p1, p2, p3, cost, window)
  if kind == FIXED_WINDOW then return fixed_window_refund(st, cost, window) end
  if kind == TOKEN_BUCKET then return token_bucket_refund(st, p2, p3, cost) end
  if kind == SLIDING_WINDOW then return sliding_window_refund(st, p2, cost, window) end
  return nil
end

-- Limit::expires_at: when the state stops mattering.
local function expires_at(kind, st, p1, p2, p3)
  if kind == FIXED_WINDOW then return st.r end
  if kind == TOKEN_BUCKET then return token_bucket_full_at(st.t, st.a, p1, p2, p3) end
  if kind == SLIDING_WINDOW then return st.s + 2 * p2 end
  if st.n == 0 then return 0 end
  return st.max + p2
end

-- Storage: reading and writing states where they live.

-- Reads the stored state of one op (field `field` of bucket `key`; a concurrency limit:
-- the sorted set `key`), or nil.
local function load(kind, key, field, p1, p2, now)
  if kind == CONCURRENCY then return concurrency_load(key, p2, now) end
  local v = redis.call('HGET', key, field)
  if not v then return nil end
  local e, a, b = string.match(v, '^(%d+):(%d+):?(%d*)$')
  if e == nil then return nil end
  if kind == FIXED_WINDOW then return {u = int(a), r = int(e)} end
  if kind == TOKEN_BUCKET then return {t = int(a), a = int(e) - int(b)} end
  return {s = int(e) - 2 * p2, c = int(a), p = int(b)}
end

-- Whether two states of a bucketed algorithm are equal.
local function same(kind, a, b)
  if a == nil or b == nil then return false end
  if kind == FIXED_WINDOW then return a.u == b.u and a.r == b.r end
  if kind == TOKEN_BUCKET then return a.t == b.t and a.a == b.a end
  if kind == SLIDING_WINDOW then return a.s == b.s and a.c == b.c and a.p == b.p end
  return false
end

-- Deletes the fields of bucket `key` that stopped mattering more than `grace` ago.
local function prune(key, now, grace)
  local all = redis.call('HGETALL', key)
  local dead = {}
  for i = 1, #all, 2 do
    local e = tonumber(string.match(all[i + 1], '^%d+'))
    if e == nil or e + grace <= now then dead[#dead + 1] = all[i] end
  end
  if #dead > 0 then redis.call('HDEL', key, unpack(dead)) end
end

-- New fields between two prunes of a bucket.
local PRUNE_EVERY = 16

-- Writes a state back. A bucket lives `grace` ms past the latest moment one of its
-- states stops mattering. `loaded` is what was read: an unchanged state is not written
-- again.
local function store(kind, key, field, st, p1, p2, p3, now, grace, loaded)
  if same(kind, st, loaded) then return end
  if kind == CONCURRENCY then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', num(now - p2))
    if st.add then redis.call('ZADD', key, num(now), st.add) end
    if st.n > 0 then redis.call('PEXPIREAT', key, num(expires_at(kind, st, p1, p2, p3) + grace)) end
    return
  end
  local e = expires_at(kind, st, p1, p2, p3)
  local rest
  if kind == FIXED_WINDOW then
    rest = num(st.u)
  elseif kind == TOKEN_BUCKET then
    rest = num(st.t) .. ':' .. num(e - st.a)
  else
    rest = num(st.c) .. ':' .. num(st.p)
  end
  local added = redis.call('HSET', key, field, num(e) .. ':' .. rest)
  local at = num(e + grace)
  if added == 1 then
    local n = redis.call('HLEN', key)
    if n == 1 then
      -- a new bucket: PEXPIREAT GT treats a key without a TTL as never expiring
      redis.call('PEXPIREAT', key, at)
      return
    end
    if n % PRUNE_EVERY == 0 then prune(key, now, grace) end
  elseif loaded ~= nil and e == expires_at(kind, loaded, p1, p2, p3) then
    -- the moment did not move, and the bucket's TTL already covers it
    return
  end
  redis.call('PEXPIREAT', key, at, 'GT')
end
