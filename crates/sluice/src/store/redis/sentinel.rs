//! Redis behind Sentinel: the primary (and, for reads, a replica) found by asking the
//! Sentinels, and followed through a failover.
//!
//! A link asks the Sentinels where its server is when it is first used, every
//! [`FOLLOW_EVERY`] after that, and at once when a call fails in a way a failover causes
//! (a connection refused or dropped, a timeout, `READONLY` from a primary turned
//! replica). When the answer changes it connects to the new address; calls in flight on
//! the old one fail and are decided by the failure policy. So after Sentinel promotes a
//! replica, decisions are exact again within one look (250 ms) plus a connection.
//!
//! Sentinels are asked in turn, starting with the last that answered; one that is down
//! costs one connection timeout, and only while the link is looking.

use super::{RedisOptions, manager};
use crate::store::{StoreError, percent_encode};
use redis::aio::ConnectionManager;
use redis::{ErrorKind, RedisError, ServerErrorKind, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often a link asks the Sentinels where its server is, failing nothing.
pub const FOLLOW_EVERY: Duration = Duration::from_millis(250);

/// A user name and password (either may be absent).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Auth {
    pub username: Option<String>,
    pub password: Option<String>,
}

/// Where the Sentinels are and what they watch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SentinelOptions {
    /// `host:port` of each Sentinel.
    pub sentinels: Vec<String>,
    /// The name the Sentinels monitor the primary under (`sentinel monitor <name> ...`).
    pub master_name: String,
    /// Send status reads to a replica the Sentinels report healthy.
    pub read_from_replicas: bool,
    /// Credentials for the Sentinels (`requirepass` / ACL of the Sentinel processes).
    pub sentinel_auth: Auth,
    /// Credentials for the primary and replicas.
    pub redis_auth: Auth,
}

/// Asks the Sentinels.
pub(crate) struct Discovery {
    sentinels: Vec<(String, ConnectionManager)>,
    name: String,
    /// The Sentinel that answered last: asked first next time.
    first: AtomicUsize,
    timeout: Duration,
}

impl Discovery {
    pub(crate) fn new(o: &SentinelOptions, options: &RedisOptions) -> Result<Self, StoreError> {
        if o.sentinels.is_empty() {
            return Err(StoreError::unavailable("store.sentinels is empty: list the Sentinels as host:port"));
        }
        if o.master_name.is_empty() {
            return Err(StoreError::unavailable("store.master_name is empty: name the primary the Sentinels monitor"));
        }
        let sentinels = o
            .sentinels
            .iter()
            .map(|addr| {
                let conn = connect(addr, &o.sentinel_auth, options).ok_or_else(|| {
                    StoreError::unavailable(format!("store.sentinels: '{addr}' is not host:port (no scheme, no path)"))
                })??;
                Ok((addr.clone(), conn))
            })
            .collect::<Result<_, StoreError>>()?;
        Ok(Self { sentinels, name: o.master_name.clone(), first: AtomicUsize::new(0), timeout: options.timeout })
    }

    /// Asks each Sentinel in turn until one answers `cmd` with something `read` accepts.
    async fn ask<T>(&self, cmd: &redis::Cmd, read: impl Fn(Value) -> Option<T>) -> Result<T, RedisError> {
        let n = self.sentinels.len();
        let first = self.first.load(Ordering::Relaxed);
        let mut last = String::from("no Sentinel answered");
        for i in (0..n).map(|i| (first + i) % n) {
            let (addr, conn) = &self.sentinels[i];
            let reply = tokio::time::timeout(self.timeout, cmd.query_async::<Value>(&mut conn.clone())).await;
            match reply {
                Ok(Ok(v)) => match read(v) {
                    Some(found) => {
                        self.first.store(i, Ordering::Relaxed);
                        return Ok(found);
                    }
                    None => last = format!("Sentinel {addr} does not know '{}'", self.name),
                },
                Ok(Err(e)) => last = format!("Sentinel {addr}: {e}"),
                Err(_) => last = format!("Sentinel {addr} did not answer within {:?}", self.timeout),
            }
        }
        Err(RedisError::from((ErrorKind::Io, "no Sentinel told where the server is", last)))
    }

    /// The primary's `host:port`, as the Sentinels see it now.
    async fn primary(&self) -> Result<String, RedisError> {
        let mut cmd = redis::cmd("SENTINEL");
        cmd.arg("GET-MASTER-ADDR-BY-NAME").arg(&self.name);
        self.ask(&cmd, |v| {
            let (host, port): (String, u16) = redis::from_redis_value(v).ok()?;
            Some(format!("{host}:{port}"))
        })
        .await
    }

    /// The replicas the Sentinels hold healthy (not down, linked to the primary), as
    /// `host:port`, sorted.
    async fn replicas(&self) -> Result<Vec<String>, RedisError> {
        let mut cmd = redis::cmd("SENTINEL");
        cmd.arg("REPLICAS").arg(&self.name);
        self.ask(&cmd, |v| {
            let all: Vec<std::collections::HashMap<String, String>> = redis::from_redis_value(v).ok()?;
            let mut healthy: Vec<String> = all
                .iter()
                .filter(|r| {
                    let flags = r.get("flags").map_or("", String::as_str);
                    !["s_down", "o_down", "disconnected"].iter().any(|f| flags.contains(f))
                        && r.get("master-link-status").is_some_and(|s| s == "ok")
                })
                .filter_map(|r| Some(format!("{}:{}", r.get("ip")?, r.get("port")?)))
                .collect();
            healthy.sort();
            Some(healthy)
        })
        .await
    }
}

/// Which server a link follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Primary,
    /// A replica the Sentinels hold healthy (the same one while it stays so).
    Replica,
}

/// A connection to the server the Sentinels name for `role`, replaced when they name
/// another.
pub(crate) struct SentinelLink {
    discovery: Arc<Discovery>,
    role: Role,
    auth: Auth,
    options: RedisOptions,
    current: Mutex<Option<(String, ConnectionManager)>>,
    /// One look at a time.
    looking: tokio::sync::Mutex<()>,
    /// Wakes the follower at once (a call failed as a failover makes calls fail).
    suspect: tokio::sync::Notify,
}

impl SentinelLink {
    /// A link for `role`; starts its follower when a runtime is running.
    pub(crate) fn new(discovery: Arc<Discovery>, role: Role, auth: Auth, options: RedisOptions) -> Arc<Self> {
        let link = Arc::new(Self {
            discovery,
            role,
            auth,
            options,
            current: Mutex::new(None),
            looking: tokio::sync::Mutex::new(()),
            suspect: tokio::sync::Notify::new(),
        });
        link.follow();
        link
    }

    /// The connection to use now (asking the Sentinels first if there is none yet).
    pub(crate) async fn get(&self) -> Result<ConnectionManager, RedisError> {
        if let Some((_, conn)) = &*self.current.lock().unwrap_or_else(|p| p.into_inner()) {
            return Ok(conn.clone());
        }
        self.look().await?;
        let current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        current.as_ref().map(|(_, c)| c.clone()).ok_or_else(|| RedisError::from((ErrorKind::Io, "no server yet")))
    }

    /// Notes how a call ended: an error a failover causes drops the connection, so no
    /// call goes to that address again until the Sentinels name it (the next call asks
    /// them), and makes the follower look now. A connection left to reconnect by itself
    /// would follow the address, not the role: a primary killed, a replica promoted and
    /// the old one started again (empty, still a primary until the Sentinels demote it)
    /// would take writes the fleet then loses, grants among them.
    pub(crate) fn saw<T>(&self, result: &Result<T, RedisError>) {
        if let Err(e) = result {
            let moved = e.is_io_error()
                || e.is_connection_dropped()
                || e.is_connection_refusal()
                || e.is_timeout()
                || e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly);
            if moved {
                *self.current.lock().unwrap_or_else(|p| p.into_inner()) = None;
                self.suspect.notify_one();
            }
        }
    }

    /// Where the link points now (`host:port`).
    pub(crate) fn address(&self) -> Option<String> {
        self.current.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|(a, _)| a.clone())
    }

    /// Asks the Sentinels and, when they name another server, connects to it.
    async fn look(&self) -> Result<(), RedisError> {
        let _one = self.looking.lock().await;
        let now = self.address();
        let next = match self.role {
            Role::Primary => Some(self.discovery.primary().await?),
            Role::Replica => {
                let replicas = self.discovery.replicas().await?;
                // keep the replica in use while it stays healthy: its connection is warm
                match now.as_ref().filter(|a| replicas.contains(a)) {
                    Some(keep) => Some(keep.clone()),
                    None => replicas.into_iter().next(),
                }
            }
        };
        if next == now {
            return Ok(());
        }
        let conn = match &next {
            Some(addr) => {
                let conn = connect(addr, &self.auth, &self.options)
                    .ok_or_else(|| RedisError::from((ErrorKind::Io, "bad address")))?
                    .map_err(|e| RedisError::from((ErrorKind::Io, "cannot connect", e.to_string())))?;
                Some((addr.clone(), conn))
            }
            None => None,
        };
        tracing::info!(role = ?self.role, from = ?now, to = ?next, master = %self.discovery.name, "redis sentinel: following the server the Sentinels name");
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = conn;
        Ok(())
    }

    /// Looks every [`FOLLOW_EVERY`], and at once when a call saw the server go, until
    /// the link is dropped. A look that fails keeps the server in use (logged when it
    /// starts failing and when it answers again).
    fn follow(self: &Arc<Self>) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut failing = false;
            loop {
                let Some(link) = me.upgrade() else { return };
                let result = link.look().await;
                match (&result, failing) {
                    (Err(e), false) => {
                        tracing::warn!(error = %e, "redis sentinel: cannot ask the Sentinels; keeping the server in use")
                    }
                    (Ok(()), true) => tracing::info!("redis sentinel: the Sentinels answer again"),
                    _ => {}
                }
                failing = result.is_err();
                let wake = async { link.suspect.notified().await };
                let _ = tokio::time::timeout(FOLLOW_EVERY, wake).await;
            }
        });
    }
}

/// A connection (opened lazily, no retries: a link looks again instead) to `addr` with
/// `auth`; None when `addr` is not `host:port`.
fn connect(addr: &str, auth: &Auth, options: &RedisOptions) -> Option<Result<ConnectionManager, StoreError>> {
    let (host, port) = split_addr(addr)?;
    Some(manager(&url(host, port, auth, options.tls.is_some()), options, 0))
}

/// `host:port` split, for addresses written without a scheme.
fn split_addr(addr: &str) -> Option<(&str, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty() && !host.contains('/')).then_some(())?;
    Some((host, port.parse().ok()?))
}

/// A URL for `host:port` with `auth`, the credentials percent-encoded.
fn url(host: &str, port: u16, auth: &Auth, tls: bool) -> String {
    let scheme = if tls { "rediss" } else { "redis" };
    let host = if host.contains(':') { format!("[{host}]") } else { host.to_string() };
    let user = auth.username.as_deref().map(percent_encode).unwrap_or_default();
    match &auth.password {
        Some(p) => format!("{scheme}://{user}:{}@{host}:{port}/", percent_encode(p)),
        None if !user.is_empty() => format!("{scheme}://{user}@{host}:{port}/"),
        None => format!("{scheme}://{host}:{port}/"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_credentials() {
        assert_eq!(split_addr("127.0.0.1:26379"), Some(("127.0.0.1", 26379)));
        assert_eq!(split_addr("[::1]:26379"), Some(("::1", 26379)));
        assert_eq!(split_addr("redis://h:1/x"), None);
        assert_eq!(split_addr("nohost"), None);
        let auth = Auth { username: Some("app".into()), password: Some("p@ss:w/rd".into()) };
        assert_eq!(url("h", 1, &auth, false), "redis://app:p%40ss%3Aw%2Frd@h:1/");
        let url = url("::1", 2, &Auth { username: None, password: Some("x".into()) }, true);
        assert_eq!(url, "rediss://:x@[::1]:2/");
        assert!(redis::Client::open(url.as_str()).is_ok());
    }
}
