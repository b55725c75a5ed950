//! How a store connects: client settings (TCP, TLS, retries), URLs (checked, with the
//! password found, replaced or hidden), read replicas, and `RedisOptions`.

use super::*;

/// Sockets without Nagle's algorithm: a connection carries many calls at once, and with
/// it each small write after the first waits for the last one's ACK (a delayed ACK: up
/// to 40 ms on Linux, and a whole round trip across regions; the slow-link tests' calls
/// to a store 80 ms away took 120 to 160 ms). The client library leaves it on.
pub(super) fn tcp() -> redis::io::tcp::TcpSettings {
    redis::io::tcp::TcpSettings::default().set_nodelay(true)
}

/// A client for `url` (TLS with `options.tls` for `rediss://`).
pub(super) fn client(url: &str, options: &RedisOptions) -> Result<redis::Client, StoreError> {
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
pub(super) fn manager(url: &str, options: &RedisOptions, retries: usize) -> Result<ConnectionManager, StoreError> {
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
pub(super) struct Replica {
    pub(super) conn: Conn,
    pub(super) healthy: AtomicBool,
    pub(super) url: String,
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
    pub(super) fn certificates(&self) -> redis::TlsCertificates {
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
pub(super) fn crypto_provider() {
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
