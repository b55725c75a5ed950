//! Redis stores: one node (with optional replicas for reads), and client-side shards.
//!
//! Every call is one Lua script on one primary (invariant 4, docs/architecture.md): `apply` runs every
//! op of a client tag all or nothing, and its reply carries every decision, so a response
//! is built from that one call. Scripts live in `lua/` and share `lib.lua`, the Lua twin of
//! [`crate::algo`]; the conformance suite and a property test hold them to it.
//!
//! Scripts are called by SHA (`EVALSHA`); a `NOSCRIPT` answer (a restarted or new server,
//! a replica just promoted) is met by sending the same call as `EVAL` with the source,
//! which runs it and caches it on exactly the node that lacked it (in a cluster, the
//! node owning the client's slot). `now` always comes from
//! the caller, and TTLs only collect garbage a grace period after a state stops mattering.

mod batch;
#[cfg(test)]
mod cluster_distribution;
mod registry_reply;
mod sentinel;
mod sharded;

pub use sentinel::{Auth, FOLLOW_EVERY, SentinelOptions};
pub use sharded::ShardedRedisStore;

use super::{
    Commit, GiveBack, GrantAsk, Hold, PoolCall, Refund, RegistryOp, RegistryReply, Reservation, Settled, Store,
    StoreError, b64,
};
use crate::algo::escrow::{Act, Demand, Pool};
use crate::algo::grant::Granted;
use crate::algo::{ConcurrencyState, Decision, Lease, Limit, Op};
use crate::tag::Tag;
use crate::time::Millis;
use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// One Lua script: its source and SHA1.
struct Script {
    code: String,
    sha: String,
}

impl Script {
    fn new(code: String) -> Self {
        let sha = redis::Script::new(&code).get_hash().to_string();
        Self { code, sha }
    }
}

/// The scripts: those that run the algorithms are the prelude and `lib.lua` followed by
/// their body.
struct Scripts {
    apply: Script,
    peek: Script,
    refund: Script,
    release: Script,
    reset: Script,
    registry: Script,
    grant: Script,
    give_back: Script,
    pool: Script,
    reserve: Script,
    commit: Script,
}

const LIB: &str = include_str!("lua/lib.lua");

impl Scripts {
    fn new() -> Self {
        let lib = format!("{}{LIB}", Kind::prelude());
        Self {
            apply: Script::new(format!("{lib}{}", include_str!("lua/apply.lua"))),
            // the no-writes flag lets replicas run it (EVALSHA_RO); it must come first
            peek: Script::new(format!("#!lua flags=no-writes\n{lib}{}", include_str!("lua/peek.lua"))),
            refund: Script::new(format!("{lib}{}", include_str!("lua/refund.lua"))),
            release: Script::new(include_str!("lua/release.lua").to_string()),
            reset: Script::new(include_str!("lua/reset.lua").to_string()),
            registry: Script::new(format!(
                "local TOMBSTONES = {}\n{}",
                super::registry::TOMBSTONES,
                include_str!("lua/registry.lua")
            )),
            grant: Script::new(format!("{lib}{}", include_str!("lua/grant.lua"))),
            give_back: Script::new(format!("{lib}{}", include_str!("lua/give_back.lua"))),
            pool: Script::new(format!("{lib}{}", include_str!("lua/pool.lua"))),
            reserve: Script::new(format!("{lib}{}", include_str!("lua/reserve.lua"))),
            commit: Script::new(format!("{lib}{}", include_str!("lua/commit.lua"))),
        }
    }
}

/// The Lua source of the apply script exactly as Sluice sends it to Redis (prelude,
/// `lib.lua`, `apply.lua`): to audit it, or to load it by hand (`SCRIPT LOAD`) and
/// measure Redis alone with `redis-benchmark`, as `scripts/bench` does.
pub fn apply_script() -> String {
    Scripts::new().apply.code
}

/// The algorithms as the scripts number them. The one place these numbers are written:
/// every script starts with a prelude naming them (`local FIXED_WINDOW, ... = 1, ...`),
/// and `lib.lua` uses only the names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    FixedWindow = 1,
    TokenBucket = 2,
    SlidingWindow = 3,
    Concurrency = 4,
}

impl Kind {
    const ALL: [(Kind, &'static str); 4] = [
        (Kind::FixedWindow, "FIXED_WINDOW"),
        (Kind::TokenBucket, "TOKEN_BUCKET"),
        (Kind::SlidingWindow, "SLIDING_WINDOW"),
        (Kind::Concurrency, "CONCURRENCY"),
    ];

    /// The Lua line that names every algorithm's number, the grants' constants
    /// (`algo::grant`: the most grants a book holds, a bucket grant's time to live and
    /// the skew the store allows it) and the reservations' (`algo::reservation`: the most
    /// holds a window keeps open, and settlements it remembers).
    fn prelude() -> String {
        use crate::algo::MAX_EXACT;
        use crate::algo::grant::{BUCKET_TTL, MAX_OPEN, SKEW};
        use crate::algo::reservation::{MAX_OPEN as HOLDS_MAX, MAX_SETTLED};
        let names: Vec<&str> = Self::ALL.iter().map(|(_, n)| *n).collect();
        let numbers: Vec<String> = Self::ALL.iter().map(|(k, _)| (*k as u8).to_string()).collect();
        format!(
            "local {}, MAX_OPEN, BUCKET_TTL, SKEW, HOLDS_MAX, SETTLED_MAX, MAX_EXACT = {}, {MAX_OPEN}, {BUCKET_TTL}, \
             {SKEW}, {HOLDS_MAX}, {MAX_SETTLED}, {MAX_EXACT}\n",
            names.join(", "),
            numbers.join(", ")
        )
    }
}

/// How long a key outlives the moment its state stops mattering. Expiry is decided by
/// the scripts from stored times; the TTL only collects garbage.
const GRACE_MS: Millis = 1_000;

/// Where one state lives: the key a script touches and, for states kept in a bucket, the
/// field inside it.
///
/// Fixed windows, token buckets and sliding windows are fields of a bucket hash
/// `s:{<bucket>}` shared by the clients whose tags fall in it: one key of its own with a TTL
/// costs Redis 7 about 165 bytes, a field in a bucket of a few dozen about 50 (see
/// docs/benchmarks.md). The bucket is also the cluster hash tag, so every state of a
/// client is in one slot. A concurrency limit is a sorted set, its own key in the same
/// slot: `s:{<bucket>}<field>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Location {
    pub key: String,
    pub field: String,
}

impl Location {
    /// The location of state `key` of the client `tag` under `limit`, with `buckets`
    /// buckets.
    pub fn of(tag: Tag, key: u64, limit: &Limit, buckets: u32) -> Self {
        match limit {
            Limit::Concurrency { .. } => Self::leases(tag, key, buckets),
            _ => Self::field(tag, key, buckets),
        }
    }

    /// The location of a concurrency state: a key of its own, in the bucket's slot.
    pub fn leases(tag: Tag, key: u64, buckets: u32) -> Self {
        let at = Self::field(tag, key, buckets);
        Self { key: at.key + &at.field, field: String::new() }
    }

    fn field(tag: Tag, key: u64, buckets: u32) -> Self {
        // tags and keys are opaque to a store: spread them (see crate::hash) before
        // taking bits apart
        let t = crate::hash::spread_tag(tag.0);
        let bucket = ((t >> 64) as u64) % u64::from(buckets.max(1));
        let mut field = String::with_capacity(FIELD_CHARS as usize);
        b64(&mut field, crate::hash::state_name(t as u64, key) >> (128 - 6 * FIELD_CHARS), FIELD_CHARS);
        let chars = (64 - u64::from(buckets.max(2) - 1).leading_zeros()).div_ceil(6);
        let mut key = String::with_capacity(5 + chars as usize + field.len());
        key.push_str("s:{");
        b64(&mut key, u128::from(bucket), chars);
        key.push('}');
        Self { key, field }
    }
}

/// The length of a state's field name: 72 bits of [`crate::hash::state_name`]. Two live
/// states of one bucket share a name with odds of about n^2 / 2^73 for n states in it
/// (at 128 a bucket, 65,536 buckets full: one in 10^13); each character more costs
/// every state about a byte (19 characters cost 105 bytes a state at 100k clients, 12
/// cost 100: docs/benchmarks.md).
const FIELD_CHARS: u32 = 12;

/// The registry (see [`RegistryOp`]), in one slot: the hash of overrides, its version,
/// the change log, the removed ids, the log's floor and the versions logged
/// (`lua/registry.lua`).
const REGISTRY_KEYS: [&str; 6] = [
    "sluice:{registry}:overrides",
    "sluice:{registry}:version",
    "sluice:{registry}:log",
    "sluice:{registry}:gone",
    "sluice:{registry}:floor",
    "sluice:{registry}:logged",
];

/// Buckets when the configuration names none: fewer than one state per bucket wastes
/// the sharing, more than 128 turns a bucket from a listpack into a hash table (about 100
/// bytes a state, and pruning scans get longer). 65,536 suits up to about 8 million
/// active states.
pub const DEFAULT_BUCKETS: u32 = 65_536;

fn keys(at: &[Location]) -> Vec<&str> {
    at.iter().map(|l| l.key.as_str()).collect()
}

/// A policy as the scripts take it: "kind:p1:p2:p3:shadow" (see `lua/lib.lua`), one
/// argument where four numbers and a flag were five (Redis parses and Lua interns every
/// argument of every decision).
fn policy(limit: &Limit, shadow: bool) -> String {
    let (kind, p) = match *limit {
        Limit::FixedWindow { limit, window, aligned } => (Kind::FixedWindow, [limit, window, aligned as u64]),
        Limit::TokenBucket { rate, per, burst } => (Kind::TokenBucket, [rate, per, burst]),
        Limit::SlidingWindow { limit, window } => (Kind::SlidingWindow, [limit, window, 0]),
        Limit::Concurrency { limit, lease_ttl } => (Kind::Concurrency, [limit, lease_ttl, 0]),
    };
    format!("{}:{}:{}:{}:{}", kind as u8, p[0], p[1], p[2], shadow as u8)
}

fn lease_hex(lease: Lease) -> String {
    format!("{lease:032x}")
}

fn store_error(e: RedisError) -> StoreError {
    if e.is_timeout() {
        StoreError::unavailable(format!("redis timed out: {e}")).because(e)
    } else if e.is_io_error() || e.is_connection_dropped() || e.is_unrecoverable_error() {
        StoreError::unavailable(format!("redis connection: {e}")).because(e)
    } else {
        StoreError::protocol(format!("redis: {e}")).because(e)
    }
}

/// Decodes a reply of 6 integers per op.
fn decisions(v: Value, n: usize) -> Result<Vec<Decision>, StoreError> {
    let ints: Vec<i64> =
        redis::from_redis_value(v).map_err(|e| StoreError::protocol(format!("script reply: {e}")).because(e))?;
    if ints.len() != n * 6 {
        return Err(StoreError::protocol(format!("script answered {} numbers for {n} ops", ints.len())));
    }
    ints.chunks_exact(6).map(decision).collect()
}

/// One decision of a script's reply: its 6 integers (see `lua/apply.lua`; the first
/// holds flags: 1 allowed, 2 reservations open on the window; the last is -1 for no
/// wait). A negative count or time is refused, not read as a huge one.
fn decision(d: &[i64]) -> Result<Decision, StoreError> {
    let n = |i: usize| natural(d[i], "a decision");
    Ok(Decision {
        allowed: d[0] & 1 == 1,
        holds: d[0] & 2 == 2,
        limit: n(1)?,
        used: n(2)?,
        remaining: n(3)?,
        reset_at: n(4)?,
        retry_after: (d[5] != -1).then(|| n(5)).transpose()?,
    })
}

/// A count or time a script answered: never negative.
fn natural(n: i64, what: &str) -> Result<u64, StoreError> {
    u64::try_from(n).map_err(|_| StoreError::protocol(format!("{what} held the negative number {n}")))
}

/// One client's apply call: its ops, where their states live, and `now`.
pub(crate) struct Call {
    at: Vec<Location>,
    ops: Vec<Op>,
    now: Millis,
}

/// The apply script's arguments for `calls`, one after another (see `lua/apply.lua`).
fn apply_args(cmd: &mut Cmd, calls: &[&Call]) {
    cmd.arg(GRACE_MS);
    for c in calls {
        cmd.arg(c.now).arg(c.ops.len());
        for (op, at) in c.ops.iter().zip(&c.at) {
            cmd.arg(policy(&op.limit, op.shadow)).arg(op.cost);
            if let Limit::Concurrency { .. } = op.limit {
                cmd.arg(op.lease.map(lease_hex).unwrap_or_default());
            } else {
                cmd.arg(&at.field);
            }
        }
    }
}

/// The apply script's reply: per call, its decisions or the error that stopped it.
fn answers(reply: Result<Value, StoreError>, calls: &[&Call]) -> Vec<Result<Vec<Decision>, StoreError>> {
    let values = match reply {
        Ok(Value::Array(values)) => values,
        Ok(other) => return fail_all(StoreError::protocol(format!("apply answered {other:?}")), calls),
        Err(e) => return fail_all(e, calls),
    };
    let mut values = values.into_iter();
    let answers = calls.iter().map(|call| answer(&mut values, call.ops.len())).collect();
    match values.next() {
        None => answers,
        Some(_) => fail_all(StoreError::protocol(format!("apply answered too much for {} calls", calls.len())), calls),
    }
}

/// One call's part of the apply script's reply: 6 integers per op, or one error string.
fn answer(values: &mut std::vec::IntoIter<Value>, ops: usize) -> Result<Vec<Decision>, StoreError> {
    if ops == 0 {
        return Ok(Vec::new());
    }
    match values.as_slice().first() {
        Some(Value::BulkString(why)) => {
            let why = String::from_utf8_lossy(why).into_owned();
            values.next();
            Err(StoreError::protocol(format!("redis script: {why}")))
        }
        _ => decisions(Value::Array(values.by_ref().take(ops * 6).collect()), ops),
    }
}

fn fail_all(e: StoreError, calls: &[&Call]) -> Vec<Result<Vec<Decision>, StoreError>> {
    calls.iter().map(|_| Err(e.clone())).collect()
}

/// A connection that reconnects by itself, opened lazily: a Redis that is down when
/// Sluice starts does not stop it from starting.
#[derive(Clone)]
enum Conn {
    Node(ConnectionManager),
    Cluster(Arc<ClusterLink>),
    /// The server Sentinel names, followed through failovers (`sentinel.rs`).
    Sentinel(Arc<sentinel::SentinelLink>),
}

/// A Redis Cluster connection, opened on first use and kept; attempts are spaced so a
/// cluster that is down is not sent a connection storm.
struct ClusterLink {
    client: ClusterClient,
    conn: std::sync::Mutex<Option<ClusterConnection>>,
    connecting: tokio::sync::Mutex<Option<std::time::Instant>>,
}

impl ClusterLink {
    async fn get(&self) -> Result<ClusterConnection, RedisError> {
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        let mut last = self.connecting.lock().await;
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        if last.is_some_and(|t| t.elapsed() < Duration::from_millis(250)) {
            return Err(RedisError::from((ErrorKind::Io, "redis cluster not connected yet")));
        }
        *last = Some(std::time::Instant::now());
        let c = self.client.get_async_connection().await?;
        *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = Some(c.clone());
        Ok(c)
    }

    fn cached(&self) -> Option<ClusterConnection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Conn {
    fn open(url: &str, options: &RedisOptions) -> Result<Self, StoreError> {
        manager(url, options, 2).map(Conn::Node)
    }

    fn open_cluster(nodes: &[String], options: &RedisOptions, read_from_replicas: bool) -> Result<Self, StoreError> {
        crypto_provider();
        let mut b = ClusterClientBuilder::new(nodes.to_vec())
            .connection_timeout(options.timeout)
            .response_timeout(options.timeout)
            // MOVED, ASK, TRYAGAIN, CLUSTERDOWN, a dead node: retried a few times, quickly,
            // so resharding and failover fit inside the engine's deadline
            .retries(options.cluster_retries)
            .retry_wait_formula(2, 2)
            .min_retry_wait(1)
            .max_retry_wait(50)
            .tcp_settings(tcp());
        if let Some(tls) = &options.tls {
            b = b.certs(tls.certificates());
        }
        if read_from_replicas {
            b = b.read_routing_strategy(redis::cluster_read_routing::RoundRobinReplicaStrategy::default());
        }
        let client = b.build().map_err(|e| {
            let nodes: Vec<String> = nodes.iter().map(|n| redacted(n)).collect();
            StoreError::unavailable(format!("invalid redis cluster nodes {nodes:?}: {e}")).because(e)
        })?;
        let link = ClusterLink { client, conn: Default::default(), connecting: Default::default() };
        Ok(Conn::Cluster(Arc::new(link)))
    }

    async fn query(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        match self {
            Conn::Node(m) => cmd.query_async(&mut m.clone()).await,
            Conn::Cluster(link) => cmd.query_async(&mut link.get().await?).await,
            Conn::Sentinel(link) => {
                let reply = cmd.query_async(&mut link.get().await?).await;
                link.saw(&reply);
                reply
            }
        }
    }

    /// Sends `cmd` (one without keys, such as `WAIT`) where `key` lives: on a Cluster, to
    /// the primary that owns its slot; elsewhere, as [`Conn::query`].
    async fn query_at(&self, cmd: &Cmd, key: &str) -> Result<Value, RedisError> {
        use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr};
        match self {
            Conn::Cluster(link) => {
                let route = Route::with_slot(Slot::for_key(key), SlotAddr::Master);
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route));
                link.get().await?.route_command(cmd.clone(), routing).await
            }
            _ => self.query(cmd).await,
        }
    }

    /// Runs `script` on `keys`, with the arguments `fill` appends; on NOSCRIPT sends the
    /// source instead of the SHA.
    async fn run(
        &self,
        script: &Script,
        read_only: bool,
        keys: &[&str],
        fill: impl Fn(&mut Cmd),
    ) -> Result<Value, RedisError> {
        let call = |name: &str, body: &str| {
            let mut cmd = redis::cmd(name);
            cmd.arg(body).arg(keys.len()).arg(keys);
            fill(&mut cmd);
            cmd
        };
        let (by_sha, by_source) = if read_only { ("EVALSHA_RO", "EVAL_RO") } else { ("EVALSHA", "EVAL") };
        match self.query(&call(by_sha, &script.sha)).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.query(&call(by_source, &script.code)).await
            }
            other => other,
        }
    }

    /// Whether the server answers `INFO server` within `timeout`, and if so, why it
    /// (any node of a cluster) cannot run the scripts: older than [`OLDEST_REDIS`].
    async fn version_check(&self, timeout: Duration) -> Option<Result<(), StoreError>> {
        let reply = tokio::time::timeout(timeout, self.query(redis::cmd("INFO").arg("server"))).await.ok()?.ok()?;
        Some(texts(reply).iter().find_map(|info| too_old(info)).map_or(Ok(()), Err))
    }

    /// Whether the server answers PING now. One PING: a dead server costs one timeout.
    async fn ping(&self) -> bool {
        match self.query(&redis::cmd("PING")).await {
            Ok(Value::SimpleString(s)) => s == "PONG",
            Ok(Value::BulkString(b)) => b == b"PONG",
            _ => false,
        }
    }
}

/// The oldest Redis the scripts run on: 7.0 brought `EVALSHA_RO` (status reads on
/// replicas), the `#!lua flags=no-writes` shebang and `PEXPIREAT ... GT`.
pub const OLDEST_REDIS: (u64, u64) = (7, 0);

/// The error for a server whose `INFO server` reply names a version older than
/// [`OLDEST_REDIS`]; None when it is new enough or says no version.
fn too_old(info: &str) -> Option<StoreError> {
    let version = info.lines().find_map(|l| l.strip_prefix("redis_version:"))?.trim();
    let mut parts = version.split('.').map(|p| p.parse::<u64>().ok());
    let (major, minor) = (parts.next()??, parts.next()??);
    ((major, minor) < OLDEST_REDIS).then(|| {
        let (m, n) = OLDEST_REDIS;
        StoreError::protocol(format!(
            "the redis server is version {version}; Sluice needs Redis {m}.{n} or later (its scripts use EVALSHA_RO, `#!lua flags=no-writes` and PEXPIREAT ... GT): upgrade the server or point store.url elsewhere"
        ))
    })
}

/// Every text in a reply (a cluster answers `INFO` with one per node).
fn texts(v: Value) -> Vec<String> {
    match v {
        Value::BulkString(b) => vec![String::from_utf8_lossy(&b).into_owned()],
        Value::VerbatimString { text, .. } | Value::SimpleString(text) => vec![text],
        Value::Array(items) | Value::Set(items) => items.into_iter().flat_map(texts).collect(),
        Value::Map(pairs) => pairs.into_iter().flat_map(|(_, v)| texts(v)).collect(),
        _ => Vec::new(),
    }
}

/// Sockets without Nagle's algorithm: a connection carries many calls at once, and with
/// it each small write after the first waits for the last one's ACK (a delayed ACK: up
/// to 40 ms on Linux, and a whole round trip across regions; the slow-link tests' calls
/// to a store 80 ms away took 120 to 160 ms). The client library leaves it on.
fn tcp() -> redis::io::tcp::TcpSettings {
    redis::io::tcp::TcpSettings::default().set_nodelay(true)
}

/// A client for `url` (TLS with `options.tls` for `rediss://`).
fn client(url: &str, options: &RedisOptions) -> Result<redis::Client, StoreError> {
    use redis::IntoConnectionInfo;
    crypto_provider();
    let info = url.into_connection_info().map(|i| i.set_tcp_settings(tcp()));
    info.and_then(|info| match &options.tls {
        Some(tls) => redis::Client::build_with_tls(info, tls.certificates()),
        None => redis::Client::open(info),
    })
    .map_err(|e| {
        let hint = "write redis://HOST:PORT (rediss:// for TLS, redis+unix:///PATH for a socket)";
        StoreError::unavailable(format!("invalid redis url {}: {e}; {hint}", redacted(url))).because(e)
    })
}

/// Whether `url` is a Redis URL a store can be opened on: what building the store would
/// refuse, found without connecting (`sluice config check`).
pub fn check_url(url: &str) -> Result<(), StoreError> {
    client(url, &RedisOptions::default()).map(drop)
}

/// A connection to `url` that reconnects by itself (up to `retries` times a call),
/// opened lazily: a Redis that is down when Sluice starts does not stop it from starting.
fn manager(url: &str, options: &RedisOptions, retries: usize) -> Result<ConnectionManager, StoreError> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(options.timeout))
        .set_response_timeout(Some(options.timeout))
        .set_number_of_retries(retries)
        .set_max_delay(Duration::from_millis(500));
    ConnectionManager::new_lazy_with_config(client(url, options)?, config).map_err(store_error)
}

/// Where a Redis URL's password lies, as a byte range: in its user info
/// (`redis://user:PASSWORD@host`), or in a Unix socket URL's query
/// (`redis+unix:///path?pass=PASSWORD`, as `--ratelimit-env` writes `REDIS_AUTH` for a
/// socket); none without one.
pub fn password_span(url: &str) -> Option<std::ops::Range<usize>> {
    if let Some(at) = url.find("pass=").filter(|&i| url[..i].ends_with(['?', '&'])) {
        let start = at + "pass=".len();
        return Some(start..url[start..].find('&').map_or(url.len(), |e| start + e));
    }
    let scheme = url.find("://")? + 3;
    let at = url.rfind('@').filter(|&at| at > scheme)?;
    let colon = url[scheme..at].find(':')? + scheme;
    Some(colon + 1..at)
}

/// `url` with its password, if it has one ([`password_span`]), written `with`.
pub fn with_password(url: &str, with: &str) -> String {
    match password_span(url) {
        Some(span) => format!("{}{with}{}", &url[..span.start], &url[span.end..]),
        None => url.to_string(),
    }
}

/// A URL with its password replaced by `***`, for errors and logs.
pub(crate) fn redacted(url: &str) -> String {
    with_password(url, "***")
}

/// A replica for reads, with its health as the last check saw it.
struct Replica {
    conn: Conn,
    healthy: AtomicBool,
    url: String,
}

/// TLS material for `rediss://` connections, as PEM bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tls {
    /// CA certificates to verify the server with; None trusts the system's roots.
    pub ca: Option<Vec<u8>>,
    /// A client certificate and its key, for servers that verify clients.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl Tls {
    fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig { client_cert: cert.clone(), client_key: key.clone() }),
            root_cert: self.ca.clone(),
        }
    }
}

/// TLS needs a crypto provider; Sluice uses rustls with `ring`, installed once.
fn crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // another part of the process may have installed one already: keep it
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// Connection options of a Redis store.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// Bounds connecting and each reply. The engine's deadline is usually shorter.
    pub timeout: Duration,
    /// After each write, wait (`WAIT`) until this many replicas have it, at most `timeout`.
    /// 0 (the default) does not wait. With 1 or more, a failover loses no counts and
    /// reads from replicas see every earlier write, at the price of a second round trip.
    /// Not used with Redis Cluster.
    pub replica_acks: u32,
    /// Replicas that must acknowledge a quota grant (`WAIT`) before its units are spent,
    /// so that a failover cannot grant them again. None: 1 where the store knows of
    /// replicas (`replicas` listed, Sentinel), 0 elsewhere (on a Cluster whose primaries
    /// have replicas, set 1). At least `replica_acks`.
    pub grant_acks: Option<u32>,
    /// Redis Cluster: how many times a call is retried after MOVED, ASK, TRYAGAIN,
    /// CLUSTERDOWN or a dead node, with waits of 2, 4, 8 ... ms (at most 50).
    pub cluster_retries: u32,
    /// Certificates for `rediss://` URLs (None: the system's roots, no client certificate).
    pub tls: Option<Tls>,
    /// How many bucket hashes the states are spread over (a few dozen states a bucket is
    /// right; see docs/operations.md). Changing it moves every client to a new bucket,
    /// where it starts afresh.
    pub buckets: u32,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(1),
            replica_acks: 0,
            grant_acks: None,
            cluster_retries: 6,
            tls: None,
            buckets: DEFAULT_BUCKETS,
        }
    }
}

/// What writes: the primary (or the cluster), the scripts and the options.
pub(crate) struct Writer {
    conn: Conn,
    scripts: Scripts,
    options: RedisOptions,
    /// Replicas a grant waits for (`grant_acks`, resolved).
    grant_acks: u32,
    /// Writes short of their replica acknowledgements are logged at most this often,
    /// with how many.
    short_acks: crate::time::Throttle,
    short_since: AtomicUsize,
}

/// The longest a quota grant waits for its replica acknowledgements: past it (a replica
/// down, or none left after a failover) the grant is spent anyway, and logged, rather
/// than fail the decisions waiting for it (`limiter.deadline` is 100 ms by default).
const GRANT_ACK_WAIT: Duration = Duration::from_millis(50);

/// How often writes short of their replica acknowledgements are summed up in the log.
const SHORT_ACKS_LOG_EVERY: Millis = 5_000;

impl Writer {
    /// A writer on `conn`; `replicas`: whether the store knows of replicas (the default
    /// of `grant_acks`).
    fn new(conn: Conn, options: RedisOptions, replicas: bool) -> Self {
        let grant_acks = options.grant_acks.unwrap_or(u32::from(replicas)).max(options.replica_acks);
        Self {
            conn,
            scripts: Scripts::new(),
            options,
            grant_acks,
            short_acks: Default::default(),
            short_since: AtomicUsize::new(0),
        }
    }

    /// The writer quota grants go through: one on a connection of its own (`open`) when
    /// they wait for replicas, else this one.
    fn for_grants(self: &Arc<Self>, open: impl FnOnce() -> Result<Conn, StoreError>) -> Result<Arc<Self>, StoreError> {
        if self.grant_acks == 0 {
            return Ok(self.clone());
        }
        let mut granter = Writer::new(open()?, self.options.clone(), false);
        granter.grant_acks = self.grant_acks;
        Ok(Arc::new(granter))
    }

    /// Runs a writing script on the primary, then waits for `replica_acks` replicas.
    async fn write(&self, script: &Script, keys: &[&str], fill: impl Fn(&mut Cmd)) -> Result<Value, StoreError> {
        self.write_acked(script, keys, fill, self.options.replica_acks, self.options.timeout).await
    }

    /// Runs a writing script on the primary, then waits (`WAIT`, at most `wait`) for
    /// `acks` replicas to hold it: on a Cluster, of the node that owns `keys[0]`. Fewer
    /// acknowledgements than asked are logged (summed up every 5 s), not an error.
    async fn write_acked(
        &self,
        script: &Script,
        keys: &[&str],
        fill: impl Fn(&mut Cmd),
        acks: u32,
        wait: Duration,
    ) -> Result<Value, StoreError> {
        let reply = self.conn.run(script, false, keys, fill).await.map_err(store_error)?;
        if acks == 0 {
            return Ok(reply);
        }
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(acks).arg(wait.as_millis() as u64);
        let acked: i64 = redis::from_redis_value(self.conn.query_at(&cmd, keys[0]).await.map_err(store_error)?)
            .map_err(|e| StoreError::protocol(format!("WAIT reply: {e}")).because(e))?;
        if acked < i64::from(acks) {
            // once per write would be a line per request while a replica is down
            let writes = self.short_since.fetch_add(1, Ordering::Relaxed) + 1;
            let now = crate::time::Clock::now(&crate::time::SystemClock);
            if self.short_acks.due(now, SHORT_ACKS_LOG_EVERY) {
                self.short_since.fetch_sub(writes, Ordering::Relaxed);
                tracing::warn!(acked, wanted = acks, writes, "fewer redis replicas acknowledged writes than asked");
            }
        }
        Ok(reply)
    }

    /// Applies `calls` in one script call, one after another.
    async fn apply(&self, calls: &[&Call]) -> Vec<Result<Vec<Decision>, StoreError>> {
        if calls.is_empty() {
            return Vec::new();
        }
        let keys: Vec<&str> = calls.iter().flat_map(|c| c.at.iter().map(|l| l.key.as_str())).collect();
        let reply = self.write(&self.scripts.apply, &keys, |cmd| apply_args(cmd, calls)).await;
        answers(reply, calls)
    }
}

/// `store.kind: redis`: one primary for everything that writes, and replicas (round
/// robin, health-checked, falling back to the primary) for peeks. Also
/// `store.kind: redis_cluster` ([`RedisStore::cluster`]): the cluster client routes each
/// script to the node that owns the client's slot, and peeks to its replicas when asked.
///
/// On one node, decisions in flight at once share a script call (`batch.rs`); on a
/// cluster each goes alone (one script runs on one slot's keys).
pub struct RedisStore {
    writer: Arc<Writer>,
    /// What quota grants are written through: a connection of their own when they wait
    /// for replicas (`WAIT` holds up every call sent after it on its connection), else
    /// `writer`.
    granter: Arc<Writer>,
    batcher: Option<batch::Batcher>,
    replicas: Vec<Arc<Replica>>,
    next: AtomicUsize,
    /// Where it is, for logs (passwords hidden).
    address: String,
}

impl RedisStore {
    /// A store on the primary at `url` with read replicas at `replicas`. Connects lazily;
    /// fails only on a malformed URL.
    pub fn new(url: &str, replicas: &[String], options: RedisOptions) -> Result<Self, StoreError> {
        let replicas = replicas
            .iter()
            .map(|u| {
                Ok(Arc::new(Replica {
                    conn: Conn::open(u, &options)?,
                    healthy: AtomicBool::new(true),
                    url: redacted(u),
                }))
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        let writer = Arc::new(Writer::new(Conn::open(url, &options)?, options.clone(), !replicas.is_empty()));
        let granter = writer.for_grants(|| Conn::open(url, &options))?;
        let batcher = batch::Batcher::start(writer.clone());
        let address = redacted(url);
        let store = Self { writer, granter, batcher, replicas, next: AtomicUsize::new(0), address };
        store.watch_replicas();
        store.warm_up();
        Ok(store)
    }

    /// A store on the Redis Cluster reachable through `nodes` (any of its nodes; the
    /// client discovers the rest). Connects lazily. With `read_from_replicas`, peeks go to
    /// the replicas of the owning primary.
    pub fn cluster(nodes: &[String], read_from_replicas: bool, options: RedisOptions) -> Result<Self, StoreError> {
        if nodes.is_empty() {
            return Err(StoreError::unavailable("store.nodes is empty: list at least one cluster node"));
        }
        let conn = Conn::open_cluster(nodes, &options, read_from_replicas)?;
        let options = RedisOptions { replica_acks: 0, ..options };
        let writer = Arc::new(Writer::new(conn, options.clone(), false));
        let granter = writer.for_grants(|| Conn::open_cluster(nodes, &options, read_from_replicas))?;
        let address = nodes.iter().map(|n| redacted(n)).collect::<Vec<_>>().join(", ");
        let store = Self { writer, granter, batcher: None, replicas: Vec::new(), next: AtomicUsize::new(0), address };
        store.warm_up();
        Ok(store)
    }

    /// A store on the primary the Sentinels at `sentinel.sentinels` name, followed
    /// through failovers (see `sentinel.rs`); with `read_from_replicas`, status reads go
    /// to a replica they hold healthy (health-checked as `redis` replicas are, falling
    /// back to the primary). Connects lazily; fails only on a malformed address.
    pub fn sentinel(sentinel: &SentinelOptions, options: RedisOptions) -> Result<Self, StoreError> {
        use sentinel::{Discovery, Role, SentinelLink};
        let discovery = Arc::new(Discovery::new(sentinel, &options)?);
        let link = |role| SentinelLink::new(discovery.clone(), role, sentinel.redis_auth.clone(), options.clone());
        let replicas = match sentinel.read_from_replicas {
            true => vec![Arc::new(Replica {
                conn: Conn::Sentinel(link(Role::Replica)),
                healthy: AtomicBool::new(true),
                url: format!("a replica of '{}' (from the Sentinels)", sentinel.master_name),
            })],
            false => Vec::new(),
        };
        let writer = Arc::new(Writer::new(Conn::Sentinel(link(Role::Primary)), options.clone(), true));
        let granter = writer.for_grants(|| Ok(Conn::Sentinel(link(Role::Primary))))?;
        let batcher = batch::Batcher::start(writer.clone());
        let address =
            format!("the primary of '{}' (Sentinels {})", sentinel.master_name, sentinel.sentinels.join(", "));
        let store = Self { writer, granter, batcher, replicas, next: AtomicUsize::new(0), address };
        store.watch_replicas();
        store.warm_up();
        Ok(store)
    }

    /// The same store with every apply in a script call of its own, as if no two were
    /// ever in flight at once: what batched decisions are compared with.
    pub fn one_by_one(mut self) -> Self {
        self.batcher = None;
        self
    }

    /// Starts connecting now, in the background, so the first decisions do not pay for
    /// the connection (and `/readyz` turns ready as soon as the store answers).
    fn warm_up(&self) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let writer = Arc::downgrade(&self.writer);
        tokio::spawn(async move {
            // once the server answers (perhaps long after start), a server too old for
            // the scripts is said once, plainly, rather than as each script's error
            while let Some(w) = writer.upgrade() {
                match w.conn.version_check(w.options.timeout).await {
                    Some(Err(e)) => return tracing::error!(error = %e, "this redis cannot run Sluice's scripts"),
                    Some(Ok(())) => return,
                    None => {}
                }
                drop(w);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
    }

    /// Checks every replica once a second; an unhealthy one gets no reads until it
    /// answers again. Stops when the store is dropped.
    fn watch_replicas(&self) {
        if self.replicas.is_empty() || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let replicas: Vec<_> = self.replicas.iter().map(Arc::downgrade).collect();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                for r in &replicas {
                    let Some(r) = r.upgrade() else { return };
                    let ok = tokio::time::timeout(Duration::from_millis(500), r.conn.ping()).await.unwrap_or(false);
                    if ok != r.healthy.swap(ok, Ordering::Relaxed) {
                        tracing::info!(replica = %r.url, healthy = ok, "redis replica health changed");
                    }
                }
            }
        });
    }

    fn locate<'a>(&self, tag: Tag, states: impl Iterator<Item = (u64, &'a Limit)>) -> Vec<Location> {
        states.map(|(key, limit)| Location::of(tag, key, limit, self.writer.options.buckets)).collect()
    }

    /// Runs a read on a healthy replica when there is one, else (or when it fails) on
    /// the primary. A replica that fails gets no reads until its health check passes.
    async fn read<'a, F, Fut>(&'a self, call: F) -> Result<Value, StoreError>
    where
        F: Fn(&'a Conn) -> Fut,
        Fut: std::future::Future<Output = Result<Value, RedisError>>,
    {
        if let Some(r) = self.replica() {
            match call(&r.conn).await {
                Ok(reply) => return Ok(reply),
                Err(e) => {
                    r.healthy.store(false, Ordering::Relaxed);
                    tracing::warn!(replica = %r.url, error = %e, "redis replica failed a read; using the primary");
                }
            }
        }
        call(&self.writer.conn).await.map_err(store_error)
    }

    fn replica(&self) -> Option<&Arc<Replica>> {
        let n = self.replicas.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n).map(|i| &self.replicas[(start + i) % n]).find(|r| r.healthy.load(Ordering::Relaxed))
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn apply(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
        let call = Call { at: self.locate(tag, ops.iter().map(|o| (o.key, &o.limit))), ops: ops.to_vec(), now };
        match &self.batcher {
            Some(batcher) => batcher.apply(call).await,
            None => self.writer.apply(&[&call]).await.pop().unwrap_or_else(|| Err(StoreError::protocol("no reply"))),
        }
    }

    async fn peek(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
        let at = self.locate(tag, ops.iter().map(|o| (o.key, &o.limit)));
        let keys = keys(&at);
        let fill = |cmd: &mut Cmd| {
            cmd.arg(now);
            for (op, at) in ops.iter().zip(&at) {
                cmd.arg(policy(&op.limit, false)).arg(&at.field);
            }
        };
        let reply = self.read(|conn| conn.run(&self.writer.scripts.peek, true, &keys, &fill)).await?;
        decisions(reply, ops.len())
    }

    async fn release(&self, tag: Tag, keys: &[u64], lease: Lease, _now: Millis) -> Result<bool, StoreError> {
        let at: Vec<Location> = keys.iter().map(|&k| Location::leases(tag, k, self.writer.options.buckets)).collect();
        let reply = self
            .writer
            .write(&self.writer.scripts.release, &self::keys(&at), |cmd| {
                cmd.arg(lease_hex(lease));
            })
            .await;
        let held: i64 = redis::from_redis_value(reply?)
            .map_err(|e| StoreError::protocol(format!("script reply: {e}")).because(e))?;
        Ok(held == 1)
    }

    async fn leases(&self, tag: Tag, key: u64, ttl: Millis, now: Millis) -> Result<ConcurrencyState, StoreError> {
        let at = Location::leases(tag, key, self.writer.options.buckets);
        let mut cmd = redis::cmd("ZRANGEBYSCORE");
        cmd.arg(&at.key).arg(format!("({}", now.saturating_sub(ttl))).arg("+inf").arg("WITHSCORES");
        let reply = self.read(|conn| conn.query(&cmd)).await?;
        let held: Vec<(String, f64)> =
            redis::from_redis_value(reply).map_err(|e| StoreError::protocol(format!("leases reply: {e}")))?;
        let leases = held
            .into_iter()
            .filter_map(|(id, at)| Some((Lease::from_str_radix(&id, 16).ok()?, at as Millis)))
            .collect();
        Ok(ConcurrencyState { leases })
    }

    async fn refund(&self, tag: Tag, refunds: &[Refund], now: Millis) -> Result<(), StoreError> {
        let at = self.locate(tag, refunds.iter().map(|r| (r.key, &r.limit)));
        let fill = |cmd: &mut Cmd| {
            cmd.arg(now).arg(GRACE_MS);
            for (r, at) in refunds.iter().zip(&at) {
                cmd.arg(policy(&r.limit, false)).arg(r.cost).arg(r.window).arg(&at.field);
            }
        };
        self.writer.write(&self.writer.scripts.refund, &keys(&at), fill).await.map(|_| ())
    }

    async fn reset(&self, tag: Tag, ops: &[Op], _now: Millis) -> Result<(), StoreError> {
        let at = self.locate(tag, ops.iter().map(|o| (o.key, &o.limit)));
        let fill = |cmd: &mut Cmd| {
            for l in &at {
                cmd.arg(&l.field);
            }
        };
        self.writer.write(&self.writer.scripts.reset, &keys(&at), fill).await.map(|_| ())
    }

    fn grants(&self) -> bool {
        true
    }

    async fn grant(&self, tag: Tag, ask: GrantAsk, now: Millis) -> Result<Granted, StoreError> {
        let at = Location::of(tag, ask.key, &ask.limit, self.writer.options.buckets);
        let fill = |cmd: &mut Cmd| {
            cmd.arg(now).arg(GRACE_MS).arg(policy(&ask.limit, false)).arg(&at.field);
            cmd.arg(ask.need).arg(ask.want).arg(ask.id).arg(u8::from(ask.pool)).arg(&ask.close);
        };
        // durable before it is spent: a failover must not grant the same units again
        let (script, acks) = (&self.granter.scripts.grant, self.granter.grant_acks);
        let reply = self.granter.write_acked(script, &[&at.key], fill, acks, GRANT_ACK_WAIT).await?;
        let ints: Vec<i64> =
            redis::from_redis_value(reply).map_err(|e| StoreError::protocol(format!("grant reply: {e}")).because(e))?;
        let [units, ref d @ .., holders] = ints[..] else {
            return Err(StoreError::protocol(format!("grant answered {} numbers", ints.len())));
        };
        if d.len() != 6 {
            return Err(StoreError::protocol(format!("grant answered {} numbers", ints.len())));
        }
        let (units, holders) = (natural(units, "a grant")?, natural(holders, "a grant")?);
        Ok(Granted { units, decision: decision(d)?, holders })
    }

    async fn give_back(&self, tag: Tag, back: GiveBack, now: Millis) -> Result<u64, StoreError> {
        let at = Location::of(tag, back.key, &back.limit, self.writer.options.buckets);
        let fill = |cmd: &mut Cmd| {
            cmd.arg(now).arg(GRACE_MS).arg(policy(&back.limit, false)).arg(&at.field);
            cmd.arg(back.id).arg(back.unspent).arg(back.window);
        };
        let reply = self.writer.write(&self.writer.scripts.give_back, &[&at.key], fill).await?;
        redis::from_redis_value(reply).map_err(|e| StoreError::protocol(format!("give-back reply: {e}")).because(e))
    }

    fn pools(&self) -> bool {
        true
    }

    async fn pool(&self, tag: Tag, call: PoolCall, now: Millis) -> Result<(u64, Pool), StoreError> {
        let at = Location::of(tag, call.key, &call.limit, self.writer.options.buckets);
        let (act, units) = match call.act {
            Act::Read => ("read", 0),
            Act::Claim { ttl } => ("claim", ttl),
            Act::Fill(units) => ("fill", units),
            Act::Drain(units) => ("drain", units),
            Act::Release => ("release", 0),
        };
        let fill = |cmd: &mut Cmd| {
            cmd.arg(now).arg(GRACE_MS).arg(policy(&call.limit, false)).arg(&at.field);
            cmd.arg(call.end).arg(call.arrived).arg(act).arg(units).arg(call.bucket);
            // what the global store said was left, one more (0: nothing said)
            cmd.arg(call.left.map_or(0, |l| l.saturating_add(1)));
        };
        // a drain is durable before its units are given back: a failover that lost it
        // would give the region back units another region may then spend
        let acks = if matches!(call.act, Act::Drain(_)) { self.granter.grant_acks } else { 0 };
        let script = &self.granter.scripts.pool;
        let reply = self.granter.write_acked(script, &[&at.key], fill, acks, GRANT_ACK_WAIT).await?;
        let n: Vec<u64> =
            redis::from_redis_value(reply).map_err(|e| StoreError::protocol(format!("pool reply: {e}")).because(e))?;
        let [moved, cap, used, claim_until, at, before, this, left] = n[..] else {
            return Err(StoreError::protocol(format!("pool answered {} numbers", n.len())));
        };
        let (demand, left) = (Demand { at, before, this }, left.checked_sub(1));
        Ok((moved, Pool { cap, used, resets_at: call.end, claim_until, demand, left }))
    }

    fn reservations(&self) -> bool {
        true
    }

    async fn reserve(&self, tag: Tag, ops: &[Op], r: Reservation, now: Millis) -> Result<Vec<Decision>, StoreError> {
        super::only_windows(ops.iter().map(|o| &o.limit))?;
        let at = self.locate(tag, ops.iter().map(|o| (o.key, &o.limit)));
        let fill = |cmd: &mut Cmd| {
            cmd.arg(now).arg(GRACE_MS).arg(r.id).arg(r.ttl);
            for (op, at) in ops.iter().zip(&at) {
                cmd.arg(policy(&op.limit, op.shadow)).arg(op.cost).arg(&at.field);
            }
        };
        let reply = self.writer.write(&self.writer.scripts.reserve, &keys(&at), fill).await?;
        decisions(reply, ops.len())
    }

    async fn commit(&self, tag: Tag, id: u64, commits: &[Commit], now: Millis) -> Result<Vec<Settled>, StoreError> {
        super::only_windows(commits.iter().map(|c| &c.limit))?;
        let at = self.locate(tag, commits.iter().map(|c| (c.key, &c.limit)));
        let fill = |cmd: &mut Cmd| {
            cmd.arg(now).arg(GRACE_MS).arg(id);
            for (c, at) in commits.iter().zip(&at) {
                cmd.arg(policy(&c.limit, false)).arg(c.actual).arg(&at.field);
            }
        };
        let reply = self.writer.write(&self.writer.scripts.commit, &keys(&at), fill).await?;
        let ints: Vec<u64> = redis::from_redis_value(reply)
            .map_err(|e| StoreError::protocol(format!("commit reply: {e}")).because(e))?;
        if ints.len() != 2 * commits.len() {
            return Err(StoreError::protocol(format!("commit answered {} numbers", ints.len())));
        }
        let settled = |p: &[u64]| match p[0] {
            0 => Settled::Committed { held: p[1] },
            1 => Settled::Reported,
            _ => Settled::Again,
        };
        Ok(ints.chunks(2).map(settled).collect())
    }

    async fn holds(&self, tag: Tag, key: u64, limit: &Limit, now: Millis) -> Result<Vec<Hold>, StoreError> {
        super::only_windows(std::iter::once(limit))?;
        let at = Location::of(tag, key, limit, self.writer.options.buckets);
        let window =
            self.writer.conn.query(redis::cmd("HGET").arg(&at.key).arg(&at.field)).await.map_err(store_error)?;
        let window: Option<String> =
            redis::from_redis_value(window).map_err(|e| StoreError::protocol(e.to_string()))?;
        // "r:u:h": no h, no holds; a window that ended took its holds with it
        let resets_at = window.as_deref().and_then(|v| v.split(':').next()?.parse::<Millis>().ok());
        let Some(resets_at) = resets_at.filter(|r| now < *r) else { return Ok(Vec::new()) };
        let held = format!("{}{}^", at.key, at.field);
        let all = self.writer.conn.query(redis::cmd("HGETALL").arg(&held)).await.map_err(store_error)?;
        let all: Vec<(String, String)> =
            redis::from_redis_value(all).map_err(|e| StoreError::protocol(e.to_string()))?;
        if !all.iter().any(|(k, v)| k == "w" && v.parse() == Ok(resets_at)) {
            return Ok(Vec::new());
        }
        let hold = |(id, v): &(String, String)| {
            let (units, expires) = v.split_once(':')?;
            Some(Hold { id: id.parse().ok()?, units: units.parse().ok()?, expires: expires.parse().ok()? })
        };
        Ok(all.iter().filter_map(hold).filter(|h| h.expires > now).collect())
    }

    fn keeps_registry(&self) -> bool {
        true
    }

    async fn registry(&self, op: RegistryOp) -> Result<RegistryReply, StoreError> {
        let fill = |cmd: &mut Cmd| match &op {
            RegistryOp::Changes { after, count } => _ = cmd.arg("changes").arg(after).arg(count),
            RegistryOp::Put { entries, max } => {
                cmd.arg("put").arg(max);
                for (id, value) in entries {
                    cmd.arg(id).arg(value);
                }
            }
            RegistryOp::Remove { id, only_if } => _ = cmd.arg("remove").arg(id).arg(only_if.as_deref().unwrap_or("")),
            RegistryOp::Touch => _ = cmd.arg("touch"),
            RegistryOp::Version | RegistryOp::Scan { .. } => {} // plain commands, below
        };
        let (script, keys) = (&self.writer.scripts.registry, &REGISTRY_KEYS);
        let reply = match &op {
            // the watchers' poll, four times a second per instance: a plain MGET, no script
            RegistryOp::Version => self.writer.conn.query(redis::cmd("MGET").arg(keys[1]).arg(keys[5])).await,
            RegistryOp::Scan { cursor, count } => {
                self.writer.conn.query(redis::cmd("HSCAN").arg(keys[0]).arg(cursor).arg("COUNT").arg(count)).await
            }
            RegistryOp::Changes { .. } => self.writer.conn.run(script, false, keys, fill).await,
            _ => return registry_reply::written(self.writer.write(script, keys, fill).await?),
        };
        let reply = reply.map_err(store_error)?;
        match op {
            RegistryOp::Version => registry_reply::version(reply),
            RegistryOp::Scan { .. } => registry_reply::page(reply),
            _ => registry_reply::changes(reply),
        }
    }

    async fn preflight(&self) -> Result<(), StoreError> {
        // a server that does not answer now is checked when it does (`warm_up`)
        self.writer.conn.version_check(self.writer.options.timeout).await.unwrap_or(Ok(()))
    }

    async fn ready(&self) -> bool {
        self.writer.conn.ping().await
    }

    fn address(&self) -> String {
        self.address.clone()
    }

    fn kind(&self) -> &'static str {
        match self.writer.conn {
            Conn::Node(_) => "redis",
            Conn::Cluster(_) => "redis_cluster",
            Conn::Sentinel(_) => "redis_sentinel",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_older_than_7_0_are_named() {
        let e = too_old("# Server\r\nredis_version:6.2.14\r\nredis_mode:standalone\r\n").unwrap().to_string();
        assert!(e.contains("version 6.2.14") && e.contains("Redis 7.0 or later"), "{e}");
        assert!(too_old("redis_version:7.0.15\r\n").is_none());
        assert!(too_old("redis_version:8.2.1\r\n").is_none());
        assert!(too_old("# no version here").is_none());
        let cluster = Value::Map(vec![
            (
                Value::SimpleString("a".into()),
                Value::VerbatimString { format: redis::VerbatimFormat::Text, text: "redis_version:7.2.4".into() },
            ),
            (Value::SimpleString("b".into()), Value::BulkString(b"redis_version:5.0.7".to_vec())),
        ]);
        assert!(texts(cluster).iter().find_map(|t| too_old(t)).is_some(), "one old node is enough");
    }

    /// A reply's counts and times are never negative: one that is (a script or server
    /// gone wrong) is a protocol error, not a count near 2^64.
    #[test]
    fn a_negative_count_is_a_protocol_error() {
        let reply = |d: [i64; 6]| Value::Array(d.map(Value::Int).to_vec());
        let ok = decisions(reply([1, 10, 3, 7, 5_000, -1]), 1).unwrap();
        assert_eq!((ok[0].allowed, ok[0].used, ok[0].remaining, ok[0].retry_after), (true, 3, 7, None));
        assert_eq!(decisions(reply([0, 10, 10, 0, 5_000, 40]), 1).unwrap()[0].retry_after, Some(40));
        for bad in [[1, 10, -3, 7, 5_000, -1], [0, 10, 10, -1, 5_000, 40], [0, 10, 10, 0, 5_000, -2]] {
            let e = decisions(reply(bad), 1).unwrap_err().to_string();
            assert!(e.contains("a decision held the negative number"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn sockets_send_each_call_at_once() {
        for url in ["redis://127.0.0.1:1/", "redis://:secret@host:6379/2", "redis+unix:///tmp/r.sock"] {
            let c = client(url, &RedisOptions::default()).unwrap();
            assert!(c.get_connection_info().tcp_settings().nodelay(), "{url}: Nagle's algorithm left on");
        }
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redacted("redis://user:secret@host:6379/0"), "redis://user:***@host:6379/0");
        assert_eq!(redacted("redis://:secret@host/"), "redis://:***@host/");
        assert_eq!(redacted("redis://host:6379/"), "redis://host:6379/");
        assert_eq!(redacted("redis+unix:///run/redis.sock?pass=secret"), "redis+unix:///run/redis.sock?pass=***");
        assert_eq!(redacted("redis+unix:///s?db=1&pass=secret&x=1"), "redis+unix:///s?db=1&pass=***&x=1");
    }

    #[test]
    fn states_are_distinct_and_a_client_keeps_to_one_hash_tag() {
        const FW: Limit = Limit::FixedWindow { limit: 1, window: 1, aligned: false };
        const CC: Limit = Limit::Concurrency { limit: 1, lease_ttl: 1 };
        let mut seen = std::collections::HashSet::new();
        for t in 0..64u128 {
            for k in 0..64u64 {
                let at = Location::of(Tag(t), k, &FW, DEFAULT_BUCKETS);
                assert_eq!((at.key.len(), at.field.len()), (7, 12), "{at:?}");
                assert!(at.key.starts_with("s:{") && at.key.ends_with('}'));
                assert!(seen.insert((at.key, at.field)), "small tags and keys must not collide");
            }
        }
        // every state of one client, its sorted sets too: one hash tag
        let a = Location::of(Tag(7), 1, &FW, DEFAULT_BUCKETS);
        let b = Location::of(Tag(7), 2, &FW, DEFAULT_BUCKETS);
        let c = Location::of(Tag(7), 3, &CC, DEFAULT_BUCKETS);
        assert_eq!(a.key, b.key);
        assert_ne!(a.field, b.field);
        assert!(c.key.starts_with(&a.key) && c.field.is_empty() && c.key.len() == a.key.len() + 12);
        // the bucket id is as wide as the bucket count needs
        assert_eq!(Location::of(Tag(7), 1, &FW, 64).key.len(), 5);
        assert_eq!(Location::of(Tag(7), 1, &FW, 65).key.len(), 6);
        assert_eq!(Location::of(Tag(7), 1, &FW, 1).key, "s:{A}");
    }
}
