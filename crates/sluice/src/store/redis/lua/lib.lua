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
-- lease_ttl, -). A policy crosses the boundary as one string "kind:p1:p2:p3:shadow",
-- parsed once per script call however many decisions of a batch name it.
--
-- States and decisions are plain values, never tables: a state is up to three numbers
-- (x, y, z; x nil: no state) and a decision six (allowed (0/1), limit, used, remaining,
-- reset_at, retry_after (-1: none)). A charge returns the decision, then the charged
-- state (nothing when nothing was charged). A Lua table costs Redis an allocation, a
-- few hashed stores and garbage collection; with the decision and three states of every
-- op in tables, the Lua around the calls cost Redis more than the calls themselves
-- (docs/benchmarks.md).

local floor = math.floor
local function cdiv(a, b) return floor((a + b - 1) / b) end
local function min(a, b) if a < b then return a end return b end
local function max(a, b) if a > b then return a end return b end
-- Numbers cross the script boundary as strings both ways, and each conversion (strtod,
-- printf) costs Redis about as much as a small table. A script call converts each
-- distinct string or number once: a batch's calls share `now`, their policies and, for
-- aligned windows, the window's end. The tables live for one script call: every
-- EVALSHA runs this file afresh.
local parsed, formatted, policies = {}, {}, {}
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
-- The policy a "kind:p1:p2:p3:shadow" string names: {kind, p1, p2, p3, shadow (bool)}.
local function policy(s)
  local p = policies[s]
  if p == nil then
    local k, a, b, c, shadow = string.match(s, '^(%d+):(%d+):(%d+):(%d+):([01])$')
    if k == nil then error('sluice: malformed policy ' .. tostring(s)) end
    p = {int(k), int(a), int(b), int(c), shadow == '1'}
    policies[s] = p
  end
  return p
end

-- Fixed window (algo::fixed_window): (u = used, r = resets_at, h), stored "r:u", or
-- "r:u:h" while reservations are open on it, h the earliest of their deadlines (see
-- Reservations below): h rides along every function here unchanged.

-- fixed_window::window_end
local function fixed_window_end(window, aligned, now)
  if aligned == 1 then return (floor(now / window) + 1) * window end
  return now + window
end

-- fixed_window::normalize (u nil: fixed_window::fresh; a new window holds nothing)
local function fixed_window_normalize(u, r, window, aligned, now, h)
  if u == nil or now >= r then return 0, fixed_window_end(window, aligned, now) end
  return u, r, h
end

-- fixed_window::charge
local function fixed_window_charge(u, r, h, limit, cost, now)
  local used = u + cost
  if used <= limit then
    if cost > 0 then return 1, limit, used, limit - used, r, -1, used, r, h end
    return 1, limit, used, limit - used, r, -1
  end
  local retry = -1
  if cost <= limit then retry = max(r - now, 0) end
  return 0, limit, u, 0, r, retry
end

-- fixed_window::refund
local function fixed_window_refund(u, r, h, cost, charged_window)
  if r == charged_window and u > 0 then return max(u - cost, 0), r, h end
end

-- Token bucket (algo::token_bucket): (t = tokens in 1/per units, a = at), stored
-- "full_at:t:(full_at - a)".

-- token_bucket::normalize (t nil: token_bucket::fresh)
local function token_bucket_normalize(t, a, rate, per, burst, now)
  local cap = burst * per
  if t == nil then return cap, now end
  if now <= a then return min(t, cap), a end
  local missing = max(cap - t, 0)
  if now - a >= cdiv(missing, rate) then return cap, now end
  return t + (now - a) * rate, now
end

-- token_bucket::full_at
local function token_bucket_full_at(t, a, rate, per, burst)
  return a + cdiv(max(burst * per - t, 0), rate)
end

-- token_bucket::charge
local function token_bucket_charge(t, a, rate, per, burst, cost, now)
  local need = cost * per
  if need <= t then
    local after = t - need
    local remaining = floor(after / per)
    local full_at = token_bucket_full_at(after, a, rate, per, burst)
    if cost > 0 then return 1, burst, burst - remaining, remaining, full_at, -1, after, a end
    return 1, burst, burst - remaining, remaining, full_at, -1
  end
  local retry = -1
  if cost <= burst then retry = max(a + cdiv(need - t, rate) - now, 0) end
  return 0, burst, burst - floor(t / per), 0, token_bucket_full_at(t, a, rate, per, burst), retry
end

-- token_bucket::refund
local function token_bucket_refund(t, a, per, burst, cost)
  return min(t + cost * per, burst * per), a
end

-- Sliding window (algo::sliding_window): (s = start, c = cur, p = prev), stored
-- "(s + 2 * window):c:p".

-- sliding_window::normalize (s nil: sliding_window::fresh)
local function sliding_window_normalize(s, c, p, window, now)
  local start = now - now % window
  if s == nil then return start, 0, 0 end
  if start <= s then return s, c, p end
  if start == s + window then return start, 0, c end
  return start, 0, 0
end

-- sliding_window::count
local function sliding_window_count(s, c, p, window, now)
  local elapsed = max(now - s, 0)
  return cdiv(p * (window - min(elapsed, window)), window) + c
end

-- sliding_window::first_fit
local function sliding_window_first_fit(prev, window, k)
  if prev == 0 then return 0 end
  return max(window - floor(k * window / prev), 0)
end

-- sliding_window::charge
local function sliding_window_charge(s, c, p, limit, window, cost, now)
  local count = sliding_window_count(s, c, p, window, now)
  if count + cost <= limit then
    local cur = c + cost
    local reset = s + window
    if cur > 0 then reset = s + 2 * window end
    if cost > 0 then return 1, limit, count + cost, limit - count - cost, reset, -1, s, cur, p end
    return 1, limit, count + cost, limit - count - cost, reset, -1
  end
  local retry_at
  local k = limit - (c + cost)
  if k >= 0 and sliding_window_first_fit(p, window, k) < window then
    retry_at = s + sliding_window_first_fit(p, window, k)
  else
    retry_at = s + window + sliding_window_first_fit(c, window, max(limit - cost, 0))
  end
  local reset = s + window
  if c > 0 then reset = s + 2 * window end
  local retry = -1
  if cost <= limit then retry = max(retry_at - now, 0) end
  return 0, limit, min(count, limit), 0, reset, retry
end

-- sliding_window::refund (charged_reset_at: the reset the charging decision reported)
local function sliding_window_refund(s, c, p, window, cost, charged_reset_at)
  local charged = charged_reset_at - 2 * window
  if charged >= 0 and s == charged then return s, max(c - cost, 0), p end
  if charged >= 0 and s == charged + window then return s, c, max(p - cost, 0) end
end

-- Concurrency (algo::concurrency): a sorted set of lease -> acquired_at, held here as
-- (n = count, first = oldest at, last = newest at) of the live leases.

-- Reads the live leases (concurrency::normalize drops the others; the write removes
-- them); nothing when there are none.
local function concurrency_load(key, ttl, now)
  local live = '(' .. num(now - ttl)
  local n = redis.call('ZCOUNT', key, live, '+inf')
  if n == 0 then return end
  local first = redis.call('ZRANGEBYSCORE', key, live, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  local last = redis.call('ZREVRANGEBYSCORE', key, '+inf', live, 'WITHSCORES', 'LIMIT', 0, 1)
  return n, int(first[2]), int(last[2])
end

-- Whether `lease` is already held and live (the `any(id == lease)` of Limit::admits and
-- concurrency::acquire): taking it again admits without a second place.
local function concurrency_held(key, lease, ttl, now)
  if lease == '' then return false end
  local at = redis.call('ZSCORE', key, lease)
  return at ~= false and int(at) > now - ttl
end

-- concurrency::status
local function concurrency_status(n, first, limit, ttl, now)
  local reset = now
  if n > 0 then reset = first + ttl end
  return 1, limit, n, max(limit - n, 0), reset, -1
end

-- concurrency::acquire (the charged state: the lease's place taken)
local function concurrency_acquire(n, first, last, limit, ttl, now)
  if n < limit then
    local first2, last2 = min(first or now, now), max(last or now, now)
    local a, l, u, rem, reset, retry = concurrency_status(n + 1, first2, limit, ttl, now)
    return a, l, u, rem, reset, retry, n + 1, first2, last2
  end
  local reset = first + ttl
  return 0, limit, n, 0, reset, max(reset - now, 0)
end

-- Dispatch, as algo::Limit does.

-- Limit::normalize: the state brought up to now; charges nothing.
local function normalize(kind, x, y, z, p1, p2, p3, now)
  if kind == FIXED_WINDOW then return fixed_window_normalize(x, y, p2, p3, now, z) end
  if kind == TOKEN_BUCKET then return token_bucket_normalize(x, y, p1, p2, p3, now) end
  if kind == SLIDING_WINDOW then return sliding_window_normalize(x, y, z, p2, now) end
  if x == nil then return 0 end
  return x, y, z
end

-- Limit::charge: the decision, then the charged state (nothing when nothing was
-- charged). `held` is whether a concurrency lease is already held (concurrency_held).
local function charge(kind, x, y, z, p1, p2, p3, cost, lease, held, now)
  if kind == FIXED_WINDOW then return fixed_window_charge(x, y, z, p1, cost, now) end
  if kind == TOKEN_BUCKET then return token_bucket_charge(x, y, p1, p2, p3, cost, now) end
  if kind == SLIDING_WINDOW then return sliding_window_charge(x, y, z, p1, p2, cost, now) end
  if lease == '' or held then return concurrency_status(x, y, p1, p2, now) end
  return concurrency_acquire(x, y, z, p1, p2, now)
end

-- Limit::refund: the state with `cost` given back in the window the charge was made
-- in (`window`, the charging decision's reset_at), or nothing when nothing changes.
local function refund(kind, x, y, z, p1, p2, p3, cost, window)
  if kind == FIXED_WINDOW then return fixed_window_refund(x, y, z, cost, window) end
  if kind == TOKEN_BUCKET then return token_bucket_refund(x, y, p2, p3, cost) end
  if kind == SLIDING_WINDOW then return sliding_window_refund(x, y, z, p2, cost, window) end
end

-- Limit::expires_at: when the state stops mattering.
local function expires_at(kind, x, y, z, p1, p2, p3)
  if kind == FIXED_WINDOW then return y end
  if kind == TOKEN_BUCKET then return token_bucket_full_at(x, y, p1, p2, p3) end
  if kind == SLIDING_WINDOW then return x + 2 * p2 end
  if x == 0 then return 0 end
  return z + p2
end

-- Reservations (algo::reservation) on fixed windows. A window with open holds is stored
-- "r:u:h": u counts what is committed and what is held, and h is the earliest hold's
-- deadline, so a decision looks at the holds only once h has passed (a window without
-- reservations costs nothing more), and a refusal says when the first hold lapses.
-- The holds are a hash beside the window, `key .. field .. '^'` (in the bucket's slot:
-- the same hash tag): id -> "units:expires", and 'w' -> the window (its reset) they were
-- taken in; their deadlines are a sorted set `key .. field .. '>'` (id by deadline), so
-- the earliest and the lapsed are found without reading them all. Both live as long as
-- their window (its reset plus the grace), never less: a hold whose deadline passed is
-- given back when the window is next touched, however late (a TTL at the hold's own
-- deadline let Redis drop the holds first, and their units were never given back).
-- Committed reservations are a sorted set `key .. field .. '!'`: id by the moment it may
-- be forgotten (Ledger::settle's `until`); a released hold is remembered nowhere, since
-- a commit of it and of an unknown id are both reports. Every call on a reservation
-- reads and writes O(log n) entries; a due h reads only the lapsed holds.

-- Whether a script may write: peek runs on replicas, and reads a due hold as released
-- without writing it.
local WRITES = true

-- The keys of a state's open holds, of their deadlines, and of its committed
-- reservations.
local function holds_key(key, field) return key .. field .. '^' end
local function deadlines_key(key, field) return key .. field .. '>' end
local function settled_key(key, field) return key .. field .. '!' end

-- Gives `k` a TTL until at least `at` (PEXPIREAT GT treats a key without one as never
-- expiring).
local function live_until(k, at)
  if redis.call('PEXPIRETIME', k) < at then redis.call('PEXPIREAT', k, num(at)) end
end

-- The earliest deadline after `now` of the holds in deadlines `dk` (nil: none).
local function holds_first(dk, now)
  local f = redis.call('ZRANGEBYSCORE', dk, '(' .. num(now), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if f[2] then return tonumber(f[2]) end
end

-- Holds written by a Sluice that kept no sorted set of deadlines (one still running beside
-- this one in a rolling upgrade): their deadlines indexed from the hash.
-- A replica's read sees them unindexed, as held.
local function holds_index(hk, dk)
  if not WRITES then return end
  local all = redis.call('HGETALL', hk)
  for i = 1, #all, 2 do
    if all[i] ~= 'w' then
      local e = string.match(all[i + 1], ':(%d+)$')
      if e then redis.call('ZADD', dk, e, all[i]) end
    end
  end
  local t = redis.call('PTTL', hk)
  if t > 0 then redis.call('PEXPIRE', dk, t) end
end

-- reservation::normalize for window (u, r): the holds past their deadline released,
-- their units back (all of them dropped when taken in another window, their units gone
-- with it). Returns u and the earliest deadline left (nil: none).
local function holds_release(key, field, u, r, now)
  local hk, dk = holds_key(key, field), deadlines_key(key, field)
  local w = redis.call('HGET', hk, 'w')
  if not w or int(w) ~= r then
    if WRITES then redis.call('DEL', hk, dk) end
    return u, nil
  end
  if redis.call('EXISTS', dk) == 0 then holds_index(hk, dk) end
  local lapsed = redis.call('ZRANGEBYSCORE', dk, '-inf', num(now))
  if #lapsed > 0 then
    local held = redis.call('HMGET', hk, unpack(lapsed))
    for i = 1, #held do
      if held[i] then u = max(u - int(string.match(held[i], '^(%d+)')), 0) end
    end
    if WRITES then
      redis.call('HDEL', hk, unpack(lapsed))
      redis.call('ZREMRANGEBYSCORE', dk, '-inf', num(now))
    end
  end
  local h = holds_first(dk, now)
  if WRITES and h == nil then redis.call('DEL', hk, dk) end
  return u, h
end

-- A fixed window (u, r) with open holds, h the earliest deadline, as loaded (`e`: its
-- expiry's text): once h has passed in this window the lapsed holds are released and
-- the window written back (a read-only script only reads them so). Returns the window
-- as `load` does.
local function holds_due(key, field, u, r, h, e, now)
  if now < h or now >= r then return u, r, h, e end
  local u2, h2 = holds_release(key, field, u, r, now)
  if WRITES then
    local v = e .. ':' .. num(u2)
    if h2 ~= nil then v = v .. ':' .. num(h2) end
    redis.call('HSET', key, field, v)
  end
  return u2, r, h2, e
end

-- A fixed window's decision as a reply carries it: the first number's bit 2 set when
-- holds are open on the window (h), and a refusal's wait cut to the first hold's lapse
-- (reservation::with_holds).
local function with_holds(a, l, used, rem, reset, retry, h, now)
  if h == nil or now >= reset then return a, l, used, rem, reset, retry end
  if a == 0 and retry >= 0 then retry = min(retry, max(h - now, 0)) end
  return a + 2, l, used, rem, reset, retry
end

-- Storage: reading and writing states where they live.

-- Reads the stored state of one op (field `field` of bucket `key`; a concurrency limit:
-- the sorted set `key`), or nothing; a bucketed state's fourth value is its expiry as
-- stored, as text, for `store` to write back unconverted when it has not moved.
local function load(kind, key, field, p2, now)
  if kind == CONCURRENCY then return concurrency_load(key, p2, now) end
  local v = redis.call('HGET', key, field)
  if not v then return end
  local e, a, b = string.match(v, '^(%d+):(%d+):?(%d*)$')
  if e == nil then return end
  if kind == FIXED_WINDOW then
    if b == '' then return int(a), int(e), nil, e end
    return holds_due(key, field, int(a), int(e), int(b), e, now)
  end
  if kind == TOKEN_BUCKET then return int(a), int(e) - int(b), nil, e end
  return int(e) - 2 * p2, int(a), int(b), e
end

-- Whether a bucketed algorithm's state (x, y, z) equals the one loaded (lx, ly, lz).
local function same(kind, x, y, z, lx, ly, lz)
  if lx == nil or kind == CONCURRENCY then return false end
  return x == lx and y == ly and (kind == TOKEN_BUCKET or z == lz)
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

-- Writes a state (x, y, z) back; `add`, a lease a concurrency limit's charge took. A
-- bucket lives `grace` ms past the latest moment one of its states stops mattering.
-- (lx, ly, lz) is what was read, and `le` its expiry's text as stored (nil: nothing was
-- read): an unchanged state is not written again, and an expiry equal to the stored one
-- is written as it was read, the bucket's TTL already covering it. (A number's
-- conversion to text costs Redis about 0.8 us, a tenth of a decision's time; a known
-- client within its window needs none.)
local function store(kind, key, field, x, y, z, p1, p2, p3, now, grace, lx, ly, lz, le, add)
  if same(kind, x, y, z, lx, ly, lz) then return end
  local e = expires_at(kind, x, y, z, p1, p2, p3)
  if kind == CONCURRENCY then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', num(now - p2))
    if add then redis.call('ZADD', key, num(now), add) end
    if x > 0 then redis.call('PEXPIREAT', key, num(e + grace)) end
    return
  end
  local rest
  if kind == FIXED_WINDOW then
    rest = num(x)
    if z ~= nil then rest = rest .. ':' .. num(z) end
  elseif kind == TOKEN_BUCKET then
    rest = num(x) .. ':' .. num(e - y)
  else
    rest = num(y) .. ':' .. num(z)
  end
  local kept = le ~= nil and e == int(le)
  local added = redis.call('HSET', key, field, (kept and le or num(e)) .. ':' .. rest)
  if added == 1 then
    local n = redis.call('HLEN', key)
    if n == 1 then
      -- a new bucket: PEXPIREAT GT treats a key without a TTL as never expiring
      redis.call('PEXPIREAT', key, num(e + grace))
      return
    end
    if n % PRUNE_EVERY == 0 then prune(key, now, grace) end
  elseif kept then
    -- the moment did not move, and the bucket's TTL already covers it
    return
  end
  redis.call('PEXPIREAT', key, num(e + grace), 'GT')
end

-- Quota grants (algo::grant) on fixed windows and token buckets: the grants open on a
-- state live in the field beside it, `field .. '~'` (a field name never has '~'), as
-- "e:id:units:expires:id:units:expires...", e the moment the book stops mattering (its
-- last grant's lapse, plus SKEW for a token bucket's) so that pruning reads it. Ids are
-- kept as text (a u64 is not exact in Lua). A book is a flat list id, units, expires.

-- grant::size
local function grant_size(remaining, open, need, want)
  if remaining < max(need, 1) then return 0 end
  local share = max(floor(remaining / (2 * (open + 1))), 1)
  return min(max(min(want, share), need), remaining)
end

-- The open grants of a state, as stored.
local function book_load(key, field)
  local open = {}
  local v = redis.call('HGET', key, field .. '~')
  if not v then return open end
  for id, units, e in string.gmatch(v, ':(%d+):(%d+):(%d+)') do
    open[#open + 1] = id
    open[#open + 1] = int(units)
    open[#open + 1] = int(e)
  end
  return open
end

-- GrantBook::units
local function book_units(open)
  local n = 0
  for i = 2, #open, 3 do n = n + open[i] end
  return n
end

-- The grants of `open` that stay: not named in `closing` (a set of ids), and of window
-- `window` (GrantBook::of_window) or, without one, not lapsed before `lapsed`
-- (grant::bucket_normalize).
local function book_keep(open, closing, window, lapsed)
  local kept = {}
  for i = 1, #open, 3 do
    local e = open[i + 2]
    local live = (window ~= nil and e == window) or (window == nil and e > lapsed)
    if live and not closing[open[i]] then
      kept[#kept + 1] = open[i]
      kept[#kept + 1] = open[i + 1]
      kept[#kept + 1] = e
    end
  end
  return kept
end

-- Writes a book back (none: the field goes), after its state (whose write gave the
-- bucket its TTL); the bucket lives `grace` past the book.
local function book_store(key, field, open, skew, grace)
  if #open == 0 then
    redis.call('HDEL', key, field .. '~')
    return
  end
  local e, parts = 0, {}
  for i = 1, #open, 3 do
    e = max(e, open[i + 2])
    parts[#parts + 1] = open[i] .. ':' .. num(open[i + 1]) .. ':' .. num(open[i + 2])
  end
  e = e + skew
  redis.call('HSET', key, field .. '~', num(e) .. ':' .. table.concat(parts, ':'))
  redis.call('PEXPIREAT', key, num(e + grace), 'GT')
end

-- A granted state with its book, brought to `now`: a fixed window's grants of its
-- current window; a token bucket refilled up to its burst less the units of open
-- grants, then the lapsed grants dropped (grant::bucket_normalize). Returns x, y, the
-- book (without the grants in `closing`), and the skew its expiry is kept for.
local function granted_normalize(kind, lx, ly, open, closing, p1, p2, p3, now)
  if kind == FIXED_WINDOW then
    local x, y = fixed_window_normalize(lx, ly, p2, p3, now)
    return x, y, book_keep(open, closing, y, nil), 0
  end
  if kind == TOKEN_BUCKET then
    local x, y = token_bucket_normalize(lx, ly, p1, p2, max(p3 - book_units(open), 0), now)
    return x, y, book_keep(open, closing, nil, now - SKEW), SKEW
  end
  error('sluice: grants take fixed windows and token buckets only')
end

-- A reserved window: state `field` of bucket `key` under the fixed window policy `p`,
-- brought to `now` (reservation::normalize; holds of a window that ended dropped), as a
-- table: u, r, h, its holds' keys, and what was loaded (for `reserved_store`).
local function reserved_load(key, field, p, now)
  if p[1] ~= FIXED_WINDOW then error('sluice: reservations take fixed windows only') end
  local lx, ly, lz, le = load(FIXED_WINDOW, key, field, p[3], now)
  local u, r, h = fixed_window_normalize(lx, ly, p[3], p[4], now, lz)
  local hk, dk = holds_key(key, field), deadlines_key(key, field)
  local w = redis.call('HGET', hk, 'w')
  if w and int(w) ~= r then
    redis.call('DEL', hk, dk)
    h = nil
  end
  return {u = u, r = r, h = h, hk = hk, dk = dk, lx = lx, ly = ly, lz = lz, le = le}
end

-- Writes a reserved window back.
local function reserved_store(s, key, field, p, now, grace)
  store(FIXED_WINDOW, key, field, s.u, s.r, s.h, p[2], p[3], p[4], now, grace, s.lx, s.ly, s.lz, s.le, nil)
end

-- Regional pools of global windows (algo::pool): a pool lives in the field beside its
-- window's, `field .. '$'` (a field name never has '$'), as
-- "e:cap:claim_until:demand_at:before:this", e the window's end (so pruning reads it).
-- Its `used` is the window's own count.

-- The pool of the window ending at `e` as stored (zeros if it is another window's):
-- cap, claim_until, demand_at, before, this, left. Stored "end:cap:claim:at:before:this:left",
-- left being what the global store said was left, one more (0: nothing said); a pool
-- stored before left was kept has six numbers.
local function pool_load(key, field, e)
  local v = redis.call('HGET', key, field .. '$')
  if v then
    local pe, cap, claim, at, before, this, left = string.match(v, '^(%d+):(%d+):(%d+):(%d+):(%d+):(%d+):?(%d*)$')
    if pe ~= nil and int(pe) == e then
      if left == '' then left = '0' end
      return int(cap), int(claim), int(at), int(before), int(this), int(left)
    end
  end
  return 0, 0, 0, 0, 0, 0
end

local function pool_store(key, field, e, cap, claim, at, before, this, left, grace)
  local v = num(e) .. ':' .. num(cap) .. ':' .. num(claim) .. ':' .. num(at) .. ':' .. num(before) .. ':' .. num(this)
    .. ':' .. num(left)
  redis.call('HSET', key, field .. '$', v)
  live_until(key, e + grace)
end
