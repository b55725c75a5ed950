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
//!
//! Here, the store itself (`RedisStore` and its `Store` calls); beside it: `scripts` (the
//! scripts and how they are sent), `keys` (where a state lives), `encode` (a call's
//! arguments, its reply, its errors), `conn` (connections), `options` (URLs, TLS,
//! replicas), `writer` (the primary and a grant's replica acknowledgements), `batch`
//! (calls coalesced), `sentinel`, `sharded` and `registry_reply`.

mod batch;
#[cfg(test)]
mod cluster_distribution;
mod conn;
mod encode;
mod keys;
mod options;
mod registry_reply;
mod scripts;
mod sentinel;
mod sharded;
mod writer;

pub use sentinel::{Auth, FOLLOW_EVERY, SentinelOptions};
pub use sharded::ShardedRedisStore;

use super::{
    Commit, GiveBack, GrantAsk, Hold, PoolCall, Refund, RegistryOp, RegistryReply, Reservation, Settled, Store,
    StoreError, b64,
};
use crate::algo::grant::{Granted, Open};
use crate::algo::pool::{Act, Demand, Pool};
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

pub use conn::*;
use encode::*;
pub use keys::*;
pub use options::*;
pub use scripts::*;
pub(crate) use writer::*;

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
            cmd.arg(back.id).arg(back.unspent).arg(back.window).arg(back.keep);
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

    async fn grants_open(&self, tag: Tag, key: u64, limit: &Limit, now: Millis) -> Result<Vec<Open>, StoreError> {
        super::only_windows(std::iter::once(limit))?;
        let at = Location::of(tag, key, limit, self.writer.options.buckets);
        let book = format!("{}~", at.field);
        let reply = self
            .writer
            .conn
            .query(redis::cmd("HMGET").arg(&at.key).arg(&at.field).arg(&book))
            .await
            .map_err(store_error)?;
        let [window, book]: [Option<String>; 2] =
            redis::from_redis_value(reply).map_err(|e| StoreError::protocol(format!("grants reply: {e}")))?;
        // the window "r:u:h", its book "e:id:units:expires:..." (lua/lib.lua): the
        // grants of the window now
        let resets_at = window.as_deref().and_then(|v| v.split(':').next()?.parse::<Millis>().ok());
        let (Some(resets_at), Some(book)) = (resets_at.filter(|r| now < *r), book) else { return Ok(Vec::new()) };
        let parts: Vec<&str> = book.split(':').skip(1).collect();
        let open = parts.chunks_exact(3).filter_map(|g| {
            Some(Open { id: g[0].parse().ok()?, units: g[1].parse().ok()?, expires: g[2].parse().ok()? })
        });
        Ok(open.filter(|o| o.expires == resets_at).collect())
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
