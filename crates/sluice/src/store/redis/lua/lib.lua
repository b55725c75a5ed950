-- The pure algorithms of crates/sluice/src/algo, in Lua, line for line. Every script
-- begins with this file. Property tests hold these functions to the Rust model.
--
-- Numbers: Lua 5.1 has only doubles, exact for integers below 2^53. Sluice keeps every
-- limit, cost and product below 2^52 (algo::MAX_EXACT), so every sum and quotient here is
-- exact, and floor(a / b) is the exact integer quotient. Numbers are written back with
-- "%.0f": Lua's own number-to-string conversion keeps only 14 digits.
--
-- Layout (see docs/architecture.md): states of kinds 1 to 3 are fields of a bucket hash
-- `s:{bucket}` shared by many clients; the field names one state of one client and its
-- value is "expires_at:a:b", the moment the state stops mattering first, so that pruning
-- reads one number. A bucket of a few dozen fields stays a listpack, about 50 bytes a
-- state instead of about 165 for a key of its own with a TTL. The bucket's TTL is the
-- latest expiry of its fields plus the grace; fields that expire while the bucket lives
-- are pruned as new ones arrive. Kind 4 keeps a sorted set per client, `s:{bucket}field`.
--
-- Kinds: 1 fixed window {u = used, r = resets_at}, stored "r:u"; 2 token bucket
-- {t = tokens in 1/per units, a = at}, stored "full_at:t:(full_at - a)"; 3 sliding window
-- {s = start, c = cur, p = prev}, stored "(s + 2 * window):c:p"; 4 concurrency: a sorted
-- set of lease -> acquired_at, held in Lua as {n = count, min = oldest at, max = newest
-- at}. Parameters p1, p2, p3 per kind: fixed (limit, window, aligned), bucket (rate, per,
-- burst), sliding (limit, window, -), concurrency (limit, lease_ttl, -).

local floor = math.floor
local function cdiv(a, b) return floor((a + b - 1) / b) end
local function min(a, b) if a < b then return a end return b end
local function max(a, b) if a > b then return a end return b end
local function num(x) return string.format('%.0f', x) end

-- Reads the stored state of one op (field `field` of bucket `key`; kind 4: the sorted set
-- `key`), or nil.
local function load(kind, key, field, p1, p2, now)
  if kind == 4 then
    -- leases past their TTL do not count (normalize drops them; the write removes them)
    local live = '(' .. num(now - p2)
    local n = redis.call('ZCOUNT', key, live, '+inf')
    if n == 0 then return nil end
    local first = redis.call('ZRANGEBYSCORE', key, live, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    local last = redis.call('ZREVRANGEBYSCORE', key, '+inf', live, 'WITHSCORES', 'LIMIT', 0, 1)
    return {n = n, min = tonumber(first[2]), max = tonumber(last[2])}
  end
  local v = redis.call('HGET', key, field)
  if not v then return nil end
  local e, a, b = string.match(v, '^(%d+):(%d+):?(%d*)$')
  if e == nil then return nil end
  if kind == 1 then return {u = tonumber(a), r = tonumber(e)} end
  if kind == 2 then return {t = tonumber(a), a = tonumber(e) - tonumber(b)} end
  return {s = tonumber(e) - 2 * p2, c = tonumber(a), p = tonumber(b)}
end

local function window_end(window, aligned, now)
  if aligned == 1 then return (floor(now / window) + 1) * window end
  return now + window
end

-- Limit::normalize: the state brought up to now; charges nothing.
local function normalize(kind, st, p1, p2, p3, now)
  if kind == 1 then
    if st == nil or now >= st.r then return {u = 0, r = window_end(p2, p3, now)} end
    return st
  elseif kind == 2 then
    local rate, per, burst = p1, p2, p3
    local cap = burst * per
    if st == nil then return {t = cap, a = now} end
    if now <= st.a then return {t = min(st.t, cap), a = st.a} end
    local missing = max(cap - st.t, 0)
    if now - st.a >= cdiv(missing, rate) then return {t = cap, a = now} end
    return {t = st.t + (now - st.a) * rate, a = now}
  elseif kind == 3 then
    local window = p2
    local start = now - now % window
    if st == nil then return {s = start, c = 0, p = 0} end
    if start <= st.s then return st end
    if start == st.s + window then return {s = start, c = 0, p = st.c} end
    return {s = start, c = 0, p = 0}
  end
  if st == nil then return {n = 0} end
  return st
end

local function full_at(t, a, rate, per, burst)
  return a + cdiv(max(burst * per - t, 0), rate)
end

local function sliding_count(st, window, now)
  local elapsed = max(now - st.s, 0)
  return cdiv(st.p * (window - min(elapsed, window)), window) + st.c
end

local function first_fit(prev, window, k)
  if prev == 0 then return 0 end
  return max(window - floor(k * window / prev), 0)
end

-- Limit::charge: {allowed, limit, used, remaining, reset_at, retry_after (-1: none)} and
-- the charged state (nil when nothing was charged). `held` is whether the lease is
-- already held (concurrency).
local function charge(kind, st, p1, p2, p3, cost, lease, held, now)
  if kind == 1 then
    local limit = p1
    local used = st.u + cost
    if used <= limit then
      local new = nil
      if cost > 0 then new = {u = used, r = st.r} end
      return {1, limit, used, limit - used, st.r, -1}, new
    end
    local retry = -1
    if cost <= limit then retry = max(st.r - now, 0) end
    return {0, limit, st.u, 0, st.r, retry}, nil
  elseif kind == 2 then
    local rate, per, burst = p1, p2, p3
    local need = cost * per
    if need <= st.t then
      local after = st.t - need
      local remaining = floor(after / per)
      local new = nil
      if cost > 0 then new = {t = after, a = st.a} end
      return {1, burst, burst - remaining, remaining, full_at(after, st.a, rate, per, burst), -1}, new
    end
    local retry = -1
    if cost <= burst then retry = max(st.a + cdiv(need - st.t, rate) - now, 0) end
    return {0, burst, burst - floor(st.t / per), 0, full_at(st.t, st.a, rate, per, burst), retry}, nil
  elseif kind == 3 then
    local limit, window = p1, p2
    local count = sliding_count(st, window, now)
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
    if k >= 0 and first_fit(st.p, window, k) < window then
      retry_at = st.s + first_fit(st.p, window, k)
    else
      retry_at = st.s + window + first_fit(st.c, window, max(limit - cost, 0))
    end
    local reset = st.s + window
    if st.c > 0 then reset = st.s + 2 * window end
    local retry = -1
    if cost <= limit then retry = max(retry_at - now, 0) end
    return {0, limit, min(count, limit), 0, reset, retry}, nil
  end
  local limit, ttl = p1, p2
  local function status(s)
    local reset = now
    if s.n > 0 then reset = s.min + ttl end
    return {1, limit, s.n, max(limit - s.n, 0), reset, -1}
  end
  if lease == '' or held then return status(st), nil end
  if st.n < limit then
    local new = {n = st.n + 1, min = min(st.min or now, now), max = max(st.max or now, now), add = lease}
    return status(new), new
  end
  local reset = st.min + ttl
  return {0, limit, st.n, 0, reset, max(reset - now, 0)}, nil
end

-- Limit::expires_at: when the state stops mattering.
local function expires_at(kind, st, p1, p2, p3)
  if kind == 1 then return st.r end
  if kind == 2 then return full_at(st.t, st.a, p1, p2, p3) end
  if kind == 3 then return st.s + 2 * p2 end
  if st.n == 0 then return 0 end
  return st.max + p2
end

-- Whether two states of kinds 1 to 3 are equal.
local function same(kind, a, b)
  if a == nil or b == nil then return false end
  if kind == 1 then return a.u == b.u and a.r == b.r end
  if kind == 2 then return a.t == b.t and a.a == b.a end
  if kind == 3 then return a.s == b.s and a.c == b.c and a.p == b.p end
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
  if kind == 4 then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', num(now - p2))
    if st.add then redis.call('ZADD', key, num(now), st.add) end
    if st.n > 0 then redis.call('PEXPIREAT', key, num(expires_at(kind, st, p1, p2, p3) + grace)) end
    return
  end
  local e = expires_at(kind, st, p1, p2, p3)
  local rest
  if kind == 1 then
    rest = num(st.u)
  elseif kind == 2 then
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
