//! `store.kind: memcached`: GitHub's old backend, fixed windows only.
//!
//! Kept for what GitHub did with it: run it beside Redis and move clients over with the
//! `migrating` store. Each window is two keys: `KEY:r` holds the stored reset time
//! (created with `add`, replaced with `cas` once it has passed), and `KEY:RESET` counts
//! the window (`incr`, created with `add`); a refused charge is given back with `decr`.
//! With unit costs this is exact under concurrency: a count only overshoots the limit by
//! requests that are refused anyway.
//!
//! Its flaws, which are why GitHub left it (see docs/operations.md):
//! - **Eviction.** Memcached is a cache: when it fills it evicts, live windows included,
//!   and those clients get a fresh limit (demonstrated in `tests/memcached.rs`).
//! - **No multi-key atomicity.** Several limits of one client are charged one by one and
//!   given back when one refuses: all or nothing in effect, but not in one step.
//! - Only fixed windows; no replicas; a server's clock decides key expiry.

use super::{Refund, Store, StoreError};
use crate::algo::fixed_window::window_end;
use crate::algo::{ConcurrencyState, Decision, Lease, Limit, Op};
use crate::store::b64;
use crate::tag::Tag;
use crate::time::Millis;
use arc_swap::ArcSwap;
use async_trait::async_trait;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufStream};
use tokio::net::TcpStream;

/// A key outlives its window by this many seconds.
const GRACE_S: u64 = 1;

/// A byte stream the store speaks memcached's protocol over: a TCP connection, or what
/// a [`Connector`] makes of one (TLS, say).
pub trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// Opens a connection to a server's `host:port` (see [`MemcachedStore::with_connector`]).
pub type Connector = std::sync::Arc<
    dyn Fn(String) -> std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<Box<dyn Io>>> + Send>>
        + Send
        + Sync,
>;

/// One connection, kept in a small pool per server.
type Conn = BufStream<Box<dyn Io>>;

/// A memcached server and its idle connections.
struct Server {
    addr: String,
    idle: Mutex<Vec<Conn>>,
}

impl Server {
    fn new(addr: &str) -> Self {
        Self { addr: addr.trim_start_matches("memcached://").to_string(), idle: Mutex::new(Vec::new()) }
    }
}

/// The servers of a [`MemcachedStore`], replaced whole when their list changes, and how
/// many times it did (clients move between servers when it does).
#[derive(Clone)]
pub struct ServerList(Arc<(ArcSwap<Vec<Arc<Server>>>, AtomicU64)>);

impl ServerList {
    /// Puts `addrs` in place of the servers (their list discovered again: a DNS SRV
    /// record, say); a server in both keeps its idle connections. Clients whose server
    /// changes start afresh on their new one, as when a memcached node is added or lost.
    /// An empty list is ignored: the servers in force stay.
    pub fn set(&self, addrs: &[String]) {
        if addrs.is_empty() {
            return;
        }
        let current = self.load();
        let next: Vec<_> = addrs
            .iter()
            .map(|a| {
                let addr = a.trim_start_matches("memcached://");
                current.iter().find(|s| s.addr == addr).cloned().unwrap_or_else(|| Arc::new(Server::new(a)))
            })
            .collect();
        if next.iter().map(|s| &s.addr).eq(current.iter().map(|s| &s.addr)) {
            return;
        }
        self.0.0.store(Arc::new(next));
        self.0.1.fetch_add(1, Ordering::Relaxed);
    }

    fn load(&self) -> arc_swap::Guard<Arc<Vec<Arc<Server>>>> {
        self.0.0.load()
    }
}

/// The Memcached store.
pub struct MemcachedStore {
    servers: ServerList,
    timeout: Duration,
    /// How connections are opened; plain TCP without one.
    connector: Option<Connector>,
}

/// A reply line of the text protocol.
#[derive(Debug)]
enum Reply {
    Stored,
    NotStored,
    Exists,
    NotFound,
    Deleted,
    Number(u64),
    /// `VALUE` lines: (value, cas)
    Values(Vec<(String, u64)>),
    Version,
}

fn protocol(what: impl std::fmt::Display) -> StoreError {
    StoreError::protocol(format!("memcached: {what}"))
}

impl MemcachedStore {
    /// A store on `servers` (`host:port`); each client tag lives on one of them.
    /// Connects lazily.
    pub fn new(servers: &[String], timeout: Duration) -> Result<Self, StoreError> {
        if servers.is_empty() {
            return Err(StoreError::unavailable("store.servers is empty: list at least one memcached host:port"));
        }
        let servers = servers.iter().map(|a| Arc::new(Server::new(a))).collect::<Vec<_>>();
        let list = ServerList(Arc::new((ArcSwap::from_pointee(servers), AtomicU64::new(0))));
        Ok(Self { servers: list, timeout, connector: None })
    }

    /// Puts `addrs` in place of the servers (see [`ServerList::set`]).
    pub fn set_servers(&self, addrs: &[String]) {
        self.servers.set(addrs);
    }

    /// A handle on the store's servers, to change them from elsewhere (a task that
    /// reads a DNS SRV record again, say).
    pub fn server_list(&self) -> ServerList {
        self.servers.clone()
    }

    /// The same store, opening its connections with `connector` (TLS to the servers,
    /// say: the library itself speaks plain TCP).
    pub fn with_connector(mut self, connector: Connector) -> Self {
        self.connector = Some(connector);
        self
    }

    /// A new connection to `server`.
    async fn connect(&self, server: &Server) -> std::io::Result<Conn> {
        let io: Box<dyn Io> = match &self.connector {
            Some(connect) => connect(server.addr.clone()).await?,
            None => {
                let s = TcpStream::connect(&server.addr).await?;
                s.set_nodelay(true).ok();
                Box::new(s)
            }
        };
        Ok(BufStream::new(io))
    }

    fn server(&self, tag: Tag) -> Arc<Server> {
        let servers = self.servers.load();
        servers[((tag.0 >> 64) as u64 % servers.len() as u64) as usize].clone()
    }

    /// Sends one command (and its data block) and reads its reply.
    async fn call(&self, server: &Server, line: &str, data: Option<&str>) -> Result<Reply, StoreError> {
        let idle = server.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut conn = match idle {
            Some(c) => c,
            None => tokio::time::timeout(self.timeout, self.connect(server))
                .await
                .map_err(|_| StoreError::unavailable(format!("memcached {}: connect timed out", server.addr)))?
                .map_err(|e| StoreError::unavailable(format!("memcached {}: {e}", server.addr)).because(e))?,
        };
        let reply = tokio::time::timeout(self.timeout, exchange(&mut conn, line, data))
            .await
            .map_err(|_| StoreError::unavailable(format!("memcached {}: timed out", server.addr)))?
            .map_err(|e| StoreError::unavailable(format!("memcached {}: {e}", server.addr)).because(e))?;
        // a connection that answered is good for the next call
        server.idle.lock().unwrap_or_else(|p| p.into_inner()).push(conn);
        reply
    }

    async fn gets(&self, s: &Server, key: &str) -> Result<Option<(u64, u64)>, StoreError> {
        match self.call(s, &format!("gets {key}"), None).await? {
            Reply::Values(v) => match v.first() {
                Some((value, cas)) => Ok(Some((value.parse().map_err(protocol)?, *cas))),
                None => Ok(None),
            },
            _ => Err(protocol("unexpected reply to gets")),
        }
    }

    /// `add` or `cas` of a number; returns whether it was stored.
    async fn store(
        &self,
        s: &Server,
        verb: &str,
        key: &str,
        value: u64,
        exptime: u64,
        cas: Option<u64>,
    ) -> Result<bool, StoreError> {
        let v = value.to_string();
        let cas = cas.map(|c| format!(" {c}")).unwrap_or_default();
        match self.call(s, &format!("{verb} {key} 0 {exptime} {}{cas}", v.len()), Some(&v)).await? {
            Reply::Stored => Ok(true),
            Reply::NotStored | Reply::Exists | Reply::NotFound => Ok(false),
            _ => Err(protocol(format!("unexpected reply to {verb}"))),
        }
    }

    async fn incr(&self, s: &Server, verb: &str, key: &str, by: u64) -> Result<Option<u64>, StoreError> {
        match self.call(s, &format!("{verb} {key} {by}"), None).await? {
            Reply::Number(n) => Ok(Some(n)),
            Reply::NotFound => Ok(None),
            _ => Err(protocol(format!("unexpected reply to {verb}"))),
        }
    }

    /// The stored reset of a window, starting a new window when there is none or it has
    /// passed (the fixed window's normalize step).
    async fn window(&self, s: &Server, key: &str, limit: &Limit, now: Millis) -> Result<Millis, StoreError> {
        let Limit::FixedWindow { window, aligned, .. } = *limit else { unreachable!("checked by fixed_only") };
        let rkey = format!("{key}:r");
        for _ in 0..8 {
            let fresh = window_end(window, aligned, now);
            let exp = fresh.div_ceil(1000) + GRACE_S;
            match self.gets(s, &rkey).await? {
                Some((reset, _)) if now < reset => return Ok(reset),
                Some((_, cas)) => {
                    if self.store(s, "cas", &rkey, fresh, exp, Some(cas)).await? {
                        return Ok(fresh);
                    }
                }
                None => {
                    if self.store(s, "add", &rkey, fresh, exp, None).await? {
                        return Ok(fresh);
                    }
                }
            }
            // another server changed it between our read and write: read again
        }
        Err(StoreError::unavailable("memcached: the window key kept changing"))
    }

    async fn used(&self, s: &Server, ckey: &str) -> Result<u64, StoreError> {
        Ok(self.gets(s, ckey).await?.map_or(0, |(v, _)| v))
    }

    /// Charges `cost` on the window counter; returns the count after.
    async fn charge(&self, s: &Server, ckey: &str, cost: u64, reset: Millis) -> Result<u64, StoreError> {
        for _ in 0..8 {
            if let Some(n) = self.incr(s, "incr", ckey, cost).await? {
                return Ok(n);
            }
            if self.store(s, "add", ckey, cost, reset.div_ceil(1000) + GRACE_S, None).await? {
                return Ok(cost);
            }
        }
        Err(StoreError::unavailable("memcached: the counter kept disappearing"))
    }
}

/// Writes a command and reads one reply.
async fn exchange(conn: &mut Conn, line: &str, data: Option<&str>) -> std::io::Result<Result<Reply, StoreError>> {
    conn.write_all(line.as_bytes()).await?;
    conn.write_all(b"\r\n").await?;
    if let Some(d) = data {
        conn.write_all(d.as_bytes()).await?;
        conn.write_all(b"\r\n").await?;
    }
    conn.flush().await?;
    let mut values = Vec::new();
    loop {
        let mut l = String::new();
        if conn.read_line(&mut l).await? == 0 {
            return Err(std::io::Error::other("connection closed"));
        }
        let l = l.trim_end();
        let mut words = l.split(' ');
        return Ok(Ok(match words.next() {
            Some("STORED") => Reply::Stored,
            Some("NOT_STORED") => Reply::NotStored,
            Some("EXISTS") => Reply::Exists,
            Some("NOT_FOUND") => Reply::NotFound,
            Some("DELETED") => Reply::Deleted,
            Some("END") => Reply::Values(values),
            Some("VERSION") => Reply::Version,
            Some("VALUE") => {
                let (_key, _flags) = (words.next(), words.next());
                let len: usize = words.next().and_then(|b| b.parse().ok()).unwrap_or(0);
                let cas: u64 = words.next().and_then(|c| c.parse().ok()).unwrap_or(0);
                let mut buf = vec![0u8; len + 2];
                conn.read_exact(&mut buf).await?;
                values.push((String::from_utf8_lossy(&buf[..len]).into_owned(), cas));
                continue;
            }
            Some(n) if n.bytes().all(|b| b.is_ascii_digit()) && !n.is_empty() => Reply::Number(n.parse().unwrap_or(0)),
            _ => return Ok(Err(protocol(format!("unexpected reply {l:?}")))),
        }));
    }
}

fn fixed_only(limit: &Limit) -> Result<u64, StoreError> {
    match *limit {
        Limit::FixedWindow { limit, .. } => Ok(limit),
        other => Err(StoreError::protocol(format!(
            "the memcached store supports fixed windows only, not {}; use redis",
            other.algorithm()
        ))),
    }
}

fn decision(allowed: bool, limit: u64, used: u64, reset: Millis, cost: u64, now: Millis) -> Decision {
    if allowed {
        Decision {
            holds: false,
            allowed,
            limit,
            used,
            remaining: limit.saturating_sub(used),
            reset_at: reset,
            retry_after: None,
        }
    } else {
        let retry_after = (cost <= limit).then(|| reset.saturating_sub(now));
        Decision { holds: false, allowed, limit, used, remaining: 0, reset_at: reset, retry_after }
    }
}

/// The error for a concurrency call: Memcached keeps no leases.
fn no_concurrency() -> StoreError {
    StoreError::protocol("the memcached store has no concurrency limits; use redis")
}

#[async_trait]
impl Store for MemcachedStore {
    async fn apply(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
        let server = self.server(tag);
        let s = &*server;
        // charge one by one: (op, counter key, reset, count, charged, refused, limit)
        let mut done = Vec::with_capacity(ops.len());
        for op in ops {
            let limit = fixed_only(&op.limit)?;
            let key = state_key(tag, op.key);
            let reset = self.window(s, &key, &op.limit, now).await?;
            let ckey = format!("{key}:{reset}");
            let (used, charged, refused) = if op.cost == 0 {
                (self.used(s, &ckey).await?, false, false)
            } else {
                let after = self.charge(s, &ckey, op.cost, reset).await?;
                if after > limit {
                    // refused: give the charge back at once
                    self.incr(s, "decr", &ckey, op.cost).await?;
                    (after - op.cost, false, true)
                } else {
                    (after, true, false)
                }
            };
            done.push((op, ckey, reset, used, charged, refused, limit));
        }
        let any_refused = done.iter().any(|(op, _, _, _, _, refused, _)| *refused && !op.shadow);
        let mut out = Vec::with_capacity(ops.len());
        for (op, ckey, reset, used, charged, refused, limit) in done {
            if charged && any_refused {
                // another limit refused: all or nothing, so give this one back
                self.incr(s, "decr", &ckey, op.cost).await?;
                out.push(decision(true, limit, used - op.cost, reset, 0, now));
            } else {
                out.push(decision(!refused, limit, used, reset, op.cost, now));
            }
        }
        Ok(out)
    }

    async fn peek(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
        let server = self.server(tag);
        let s = &*server;
        let mut out = Vec::with_capacity(ops.len());
        for op in ops {
            let limit = fixed_only(&op.limit)?;
            let Limit::FixedWindow { window, aligned, .. } = op.limit else { unreachable!() };
            let key = state_key(tag, op.key);
            let d = match self.gets(s, &format!("{key}:r")).await? {
                Some((reset, _)) if now < reset => {
                    let used = self.used(s, &format!("{key}:{reset}")).await?;
                    decision(true, limit, used.min(limit), reset, 0, now)
                }
                // no window, or one whose stored reset has passed: a fresh window
                _ => decision(true, limit, 0, window_end(window, aligned, now), 0, now),
            };
            out.push(d);
        }
        Ok(out)
    }

    async fn release(&self, _tag: Tag, _keys: &[u64], _lease: Lease, _now: Millis) -> Result<bool, StoreError> {
        Err(no_concurrency())
    }

    async fn leases(&self, _tag: Tag, _key: u64, _ttl: Millis, _now: Millis) -> Result<ConcurrencyState, StoreError> {
        Err(no_concurrency())
    }

    async fn refund(&self, tag: Tag, refunds: &[Refund], now: Millis) -> Result<(), StoreError> {
        let server = self.server(tag);
        let s = &*server;
        for r in refunds {
            fixed_only(&r.limit)?;
            let key = state_key(tag, r.key);
            if let Some((reset, _)) = self.gets(s, &format!("{key}:r")).await?
                && reset == r.window
                && now < reset
            {
                // decr stops at 0
                self.incr(s, "decr", &format!("{key}:{reset}"), r.cost).await?;
            }
        }
        Ok(())
    }

    /// Deletes each window's stored reset: the next hit starts a fresh window (under a new
    /// counter key). One delete per state: Memcached has no atomic multi-key change.
    async fn reset(&self, tag: Tag, ops: &[Op], _now: Millis) -> Result<(), StoreError> {
        let server = self.server(tag);
        let s = &*server;
        for op in ops {
            fixed_only(&op.limit)?;
            match self.call(s, &format!("delete {}:r", state_key(tag, op.key)), None).await? {
                Reply::Deleted | Reply::NotFound => {}
                other => return Err(protocol(format!("delete answered {other:?}"))),
            }
        }
        Ok(())
    }

    async fn ready(&self) -> bool {
        let first = self.servers.load()[0].clone();
        matches!(self.call(&first, "version", None).await, Ok(Reply::Version))
    }

    fn routing(&self) -> u64 {
        self.servers.0.1.load(Ordering::Relaxed)
    }

    fn address(&self) -> String {
        self.servers.load().iter().map(|s| s.addr.as_str()).collect::<Vec<_>>().join(", ")
    }
    fn kind(&self) -> &'static str {
        "memcached"
    }
}

/// The key of one state in Memcached: `s:{TAG}KEY`, TAG 96 bits of the client tag and
/// KEY 48 bits of the state key, in base64url, 28 bytes. 96 bits keep tag collisions
/// negligible (about 6e-12 among 10^9 clients); 48 bits separate the few states of one
/// client. (Redis keeps states in shared buckets instead: see `store/redis`.)
fn state_key(tag: Tag, key: u64) -> String {
    // Tags and keys are opaque to a store: multiply by an odd constant (a bijection, so
    // every input bit matters) before keeping the high bits.
    let tag = crate::hash::spread_tag(tag.0) >> 32;
    let key = crate::hash::spread(key) >> 16;
    let mut out = String::with_capacity(28);
    out.push_str("s:{");
    b64(&mut out, tag, 16);
    out.push('}');
    b64(&mut out, u128::from(key), 8);
    out
}
