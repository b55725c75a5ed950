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
//! For the primary, every Sentinel is asked at once and the newest configuration that
//! holds its primary up is followed: a Sentinel still naming a primary that was failed
//! over (down, or started again empty) is outvoted by one that saw the promotion; the
//! Sentinel leading a failover, which names the old primary under the new epoch until
//! the failover ends, is not heard meanwhile; and while every Sentinel that answers
//! holds the primary down no call goes to it. For a
//! replica, Sentinels are asked in turn, starting with the last that answered; one that
//! is down costs one connection timeout, and only while the link is looking.

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

    /// Asks each Sentinel in turn until one answers `cmd` with something `read` accepts
    /// (an answer it refuses says why, and the next Sentinel is asked).
    async fn ask<T>(&self, cmd: &redis::Cmd, read: impl Fn(Value) -> Result<T, String>) -> Result<T, NoAnswer> {
        let n = self.sentinels.len();
        let first = self.first.load(Ordering::Relaxed);
        let mut no = NoAnswer { refused: false, last: String::from("no Sentinel answered") };
        for i in (0..n).map(|i| (first + i) % n) {
            let (addr, conn) = &self.sentinels[i];
            let reply = tokio::time::timeout(self.timeout, cmd.query_async::<Value>(&mut conn.clone())).await;
            match reply {
                Ok(Ok(v)) => match read(v) {
                    Ok(found) => {
                        self.first.store(i, Ordering::Relaxed);
                        return Ok(found);
                    }
                    Err(why) => no = NoAnswer { refused: true, last: format!("Sentinel {addr} {why}") },
                },
                Ok(Err(e)) => no.last = format!("Sentinel {addr}: {e}"),
                Err(_) => no.last = format!("Sentinel {addr} did not answer within {:?}", self.timeout),
            }
        }
        Err(no)
    }

    /// The primary's `host:port`, as the Sentinels see it now. All are asked at once;
    /// of those that hold the primary they name up, the one with the newest
    /// configuration (`config-epoch`) is followed. A Sentinel that has not heard of a
    /// promotion yet still names the old primary: first down, then, once it is started
    /// again (empty, a primary until the Sentinels demote it), up. A connection to it
    /// would take writes the fleet then loses, grants among them.
    async fn primary(&self) -> Result<String, NoAnswer> {
        let mut cmd = redis::cmd("SENTINEL");
        cmd.arg("MASTER").arg(&self.name);
        let cmd = &cmd;
        let asks = self.sentinels.iter().map(|(addr, conn)| async move {
            (addr, tokio::time::timeout(self.timeout, cmd.query_async::<Value>(&mut conn.clone())).await)
        });
        let answers = futures_util::future::join_all(asks).await.into_iter().map(|(addr, reply)| match reply {
            Ok(Ok(v)) => named_primary(v, &self.name)
                .map_err(|why| NoAnswer { refused: true, last: format!("Sentinel {addr} {why}") }),
            Ok(Err(e)) => Err(NoAnswer { refused: false, last: format!("Sentinel {addr}: {e}") }),
            Err(_) => Err(NoAnswer {
                refused: false,
                last: format!("Sentinel {addr} did not answer within {:?}", self.timeout),
            }),
        });
        newest(answers)
    }

    /// The replicas the Sentinels hold healthy (not down, linked to the primary), as
    /// `host:port`, sorted.
    async fn replicas(&self) -> Result<Vec<String>, NoAnswer> {
        let mut cmd = redis::cmd("SENTINEL");
        cmd.arg("REPLICAS").arg(&self.name);
        self.ask(&cmd, |v| {
            let all: Vec<std::collections::HashMap<String, String>> =
                redis::from_redis_value(v).map_err(|_| format!("does not know '{}'", self.name))?;
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
            Ok(healthy)
        })
        .await
    }
}

/// The configuration epoch and `host:port` of the primary a `SENTINEL MASTER` reply
/// names; refused, saying why, when the Sentinel holds it down (`s_down`, `o_down`).
fn named_primary(reply: Value, name: &str) -> Result<(u64, String), String> {
    let unknown = || format!("does not know '{name}'");
    let m: std::collections::HashMap<String, String> = redis::from_redis_value(reply).map_err(|_| unknown())?;
    let (Some(ip), Some(port)) = (m.get("ip"), m.get("port")) else { return Err(unknown()) };
    let flags = m.get("flags").map_or("", String::as_str);
    let flagged = |flag: &str| flags.split(',').any(|f| f == flag);
    if flagged("s_down") || flagged("o_down") {
        return Err(format!("holds the primary {ip}:{port} down ({flags})"));
    }
    // the Sentinel leading a failover names the old primary, under the new epoch already,
    // until the failover ends (seconds after the promotion): once the old one is started
    // again it is no longer down there, and would tie with the promoted one
    if flagged("failover_in_progress") {
        return Err(format!("is failing {ip}:{port} over ({flags})"));
    }
    let epoch = m.get("config-epoch").and_then(|e| e.parse().ok()).unwrap_or(0);
    Ok((epoch, format!("{ip}:{port}")))
}

/// The primary named with the newest configuration epoch; else why none was: a refusal
/// (the primary held down) over silence.
fn newest(answers: impl Iterator<Item = Result<(u64, String), NoAnswer>>) -> Result<String, NoAnswer> {
    let mut no = NoAnswer { refused: false, last: String::from("no Sentinel answered") };
    let mut newest: Option<(u64, String)> = None;
    for answer in answers {
        match answer {
            Ok((epoch, primary)) if newest.as_ref().is_none_or(|(e, _)| epoch > *e) => newest = Some((epoch, primary)),
            Ok(_) => {}
            Err(e) if e.refused || !no.refused => no = e,
            Err(_) => {}
        }
    }
    newest.map(|(_, primary)| primary).ok_or(no)
}

/// Why no Sentinel named a server: `refused` when one answered and what it said was
/// refused (the primary held down), not only silence.
#[derive(Debug)]
struct NoAnswer {
    refused: bool,
    last: String,
}

impl From<NoAnswer> for RedisError {
    fn from(no: NoAnswer) -> Self {
        RedisError::from((ErrorKind::Io, "no Sentinel named a server to use", no.last))
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
        let none = || RedisError::from((ErrorKind::Io, "no server: the Sentinels hold it down, or name none"));
        current.as_ref().map(|(_, c)| c.clone()).ok_or_else(none)
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

    /// Asks the Sentinels and, when they name another server, connects to it. When every
    /// Sentinel that answered holds the primary down, the connection is dropped: no call
    /// goes to that address until they name a primary again. When none answered, the
    /// server in use is kept.
    async fn look(&self) -> Result<(), RedisError> {
        let _one = self.looking.lock().await;
        let now = self.address();
        let found = match self.role {
            Role::Primary => self.discovery.primary().await,
            Role::Replica => self.discovery.replicas().await.map(|replicas| {
                // keep the replica in use while it stays healthy: its connection is warm
                match now.as_ref().filter(|a| replicas.contains(a)) {
                    Some(keep) => keep.clone(),
                    None => replicas.into_iter().next().unwrap_or_default(),
                }
            }),
        };
        let next = match found {
            Ok(addr) => Some(addr).filter(|a| !a.is_empty()),
            Err(no) if no.refused => None,
            Err(no) => return Err(no.into()),
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
    fn the_primary_a_sentinel_names() {
        let reply = |flags: &str, epoch: &str| {
            let fields =
                [("name", "m"), ("ip", "10.0.0.1"), ("port", "6380"), ("flags", flags), ("config-epoch", epoch)];
            Value::Array(
                fields.iter().flat_map(|(k, v)| [k, v]).map(|x| Value::BulkString(x.as_bytes().to_vec())).collect(),
            )
        };
        assert_eq!(named_primary(reply("master", "3"), "m"), Ok((3, "10.0.0.1:6380".to_string())));
        let down = named_primary(reply("master,s_down,o_down", "3"), "m").unwrap_err();
        assert_eq!(down, "holds the primary 10.0.0.1:6380 down (master,s_down,o_down)");
        assert!(named_primary(reply("s_down,master", "1"), "m").is_err());
        // the leader of a failover, the old primary started again (seen with redis 7.0)
        let leading = named_primary(reply("master,failover_in_progress", "1"), "m").unwrap_err();
        assert_eq!(leading, "is failing 10.0.0.1:6380 over (master,failover_in_progress)");
        assert_eq!(named_primary(reply("master,disconnected", "x"), "m"), Ok((0, "10.0.0.1:6380".to_string())));
        assert_eq!(named_primary(Value::Nil, "m"), Err("does not know 'm'".to_string()));
    }

    #[test]
    fn the_newest_configuration_is_followed() {
        let up = |epoch, addr: &str| Ok((epoch, addr.to_string()));
        let no = |refused, last: &str| Err(NoAnswer { refused, last: last.to_string() });
        // a Sentinel that missed the promotion names the old primary (back up, empty)
        assert_eq!(newest([up(1, "old:1"), up(2, "new:2"), no(false, "silent")].into_iter()).unwrap(), "new:2");
        assert_eq!(newest([no(true, "holds old down"), up(2, "new:2")].into_iter()).unwrap(), "new:2");
        let held =
            newest([no(false, "silent"), no(true, "holds old down"), no(false, "late")].into_iter()).unwrap_err();
        assert!(held.refused && held.last == "holds old down", "{held:?}");
        assert!(!newest([no(false, "silent")].into_iter()).unwrap_err().refused);
    }

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
