//! The config file: the library's rule model (`limiter`, `headers`, `domains`) and the
//! deployment settings only the server has: where it listens, which store it connects
//! to, and the files that secure those connections.

pub mod checks;
pub mod env;
pub mod load;
pub mod secrets;
mod telemetry;

pub use telemetry::{Format, Mogrifier, Protocol, StatsdConfig, TelemetryConfig};

use serde::{Deserialize, Deserializer, de};
use sluice::config::{DomainConfig, Duration, LimiterConfig};
use sluice::headers::HeadersConfig;
use std::net::SocketAddr;

/// A whole config file.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub server: ServerConfig,
    #[serde(default)]
    pub store: StoreConfig,
    #[serde(default)]
    pub limiter: LimiterConfig,
    #[serde(default)]
    pub headers: HeadersConfig,
    #[serde(default)]
    pub domains: Vec<DomainConfig>,
    /// A directory of envoyproxy/ratelimit config files (`*.yaml`, `*.yml`), one domain
    /// each, loaded beside `domains`. Relative to the config file.
    #[serde(default)]
    pub domains_from: Option<std::path::PathBuf>,
    #[serde(default)]
    pub log: crate::logs::LogConfig,
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    #[serde(default)]
    pub envoy: EnvoyConfig,
    /// The rules come from an xDS management server instead of `domains`.
    #[serde(default)]
    pub xds: Option<XdsConfig>,
    /// This instance's region, when limits are shared across regions (`global: true` on a
    /// limit): its instances share what the region holds of each global window.
    #[serde(default)]
    pub region: Option<String>,
    /// The store every region reaches (the `store` section's schema), where global
    /// limits live; decisions never call it (docs/configuration.md, "One limit across
    /// regions").
    #[serde(default)]
    pub global_store: Option<StoreConfig>,
}

/// `xds`: the rules are pushed by an xDS management server (Envoy Gateway's, or any
/// that serves envoyproxy/ratelimit's `RateLimitConfig` resources over ADS, state of the
/// world), not read from `domains` or `domains_from`, which must then be absent: the two
/// never mix. See `xds/mod.rs` and docs/envoy.md, "With xDS".
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct XdsConfig {
    /// The management server: `host:port` (a DNS name is resolved at every connect).
    pub server: String,
    /// The node id this instance subscribes as (Envoy Gateway serves `envoy-ratelimit`).
    #[serde(default = "default_node_id")]
    pub node_id: String,
    /// The node's metadata, string values.
    #[serde(default)]
    pub node_metadata: std::collections::BTreeMap<String, String>,
    /// gRPC metadata sent with the stream (an authorization header, say).
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// The first wait before reconnecting a lost stream; it doubles at each failure up
    /// to `max_retry`, with jitter, and starts again once a stream delivers.
    #[serde(default = "default_xds_retry")]
    pub retry: Duration,
    #[serde(default = "default_xds_max_retry")]
    pub max_retry: Duration,
    /// Largest response accepted, in bytes (gRPC's default, 4 MiB).
    #[serde(default = "default_xds_max_message")]
    pub max_message_bytes: usize,
    /// Serve before the first push (answering every decision `UNAVAILABLE`, which
    /// Envoy's filter takes as allowed unless `failure_mode_deny`), ready at once. Off:
    /// readiness (`/readyz`, `/healthcheck`) waits for the first push.
    #[serde(default)]
    pub start_without_config: bool,
    /// TLS to the management server; plain TCP without it.
    #[serde(default)]
    pub tls: Option<XdsTls>,
    /// How long a stream may stay silent before the first push (Envoy's
    /// `initial_fetch_timeout`, 15 s as there): past it the stream is logged as a
    /// warning (a management server answers nothing to a node it does not know),
    /// counted, and opened again after the retry wait. 0s waits without end.
    #[serde(default = "default_initial_fetch_timeout")]
    pub initial_fetch_timeout: Duration,
}

/// `xds.tls`: PEM files.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct XdsTls {
    /// The CA that signed the server's certificate; without it, the system's roots.
    pub ca_file: Option<std::path::PathBuf>,
    /// This client's certificate and key, for a server that verifies clients.
    pub cert_file: Option<std::path::PathBuf>,
    pub key_file: Option<std::path::PathBuf>,
    /// The name the server's certificate must carry (default: the host of `server`).
    pub server_name: Option<String>,
}

impl XdsConfig {
    /// `headers` as gRPC metadata, or which entry cannot be one.
    pub fn metadata(
        &self,
    ) -> Result<Vec<(tonic::metadata::AsciiMetadataKey, tonic::metadata::AsciiMetadataValue)>, String> {
        self.headers
            .iter()
            .map(|(k, v)| {
                let key = tonic::metadata::AsciiMetadataKey::from_bytes(k.to_ascii_lowercase().as_bytes());
                match (key, tonic::metadata::AsciiMetadataValue::try_from(v.as_str())) {
                    (Ok(key), Ok(value)) => Ok((key, value)),
                    _ => Err(format!(
                        "xds.headers: `{k}: {v}` is not a valid gRPC metadata entry (a name of letters, digits, `-`, `_` \
                         and `.`, not ending in -bin; a value of visible ASCII and spaces)"
                    )),
                }
            })
            .collect()
    }

    /// What a server waiting for the first push says: the reason its pending rules give
    /// every request until then (`Rules::pending`), and its readiness.
    pub fn waiting(&self) -> String {
        format!(
            "no rate limit configuration loaded yet: waiting for the first push from the xDS server at {}",
            self.server
        )
    }
}

fn default_node_id() -> String {
    "default".into()
}

fn default_xds_retry() -> Duration {
    Duration(1_000)
}

fn default_xds_max_retry() -> Duration {
    Duration(30_000)
}

fn default_initial_fetch_timeout() -> Duration {
    Duration(15_000)
}

fn default_xds_max_message() -> usize {
    4 << 20
}

/// `envoy`: envoyproxy/ratelimit's settings that have no other home here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EnvoyConfig {
    /// Several files of `domains_from` may define one domain, whose rules are then read
    /// together (their `MERGE_DOMAIN_CONFIG`). A rule defined in two of them is still
    /// refused, naming both. Off: a domain in two files is refused, naming both.
    pub merge_domains: bool,
    /// Envoy's answer carries `dynamic_metadata` (their `RESPONSE_DYNAMIC_METADATA`): the
    /// domain, the descriptors, and the config `metadata` of the rules that allowed.
    pub response_dynamic_metadata: bool,
}

impl Config {
    /// Compiles the rules this config describes.
    pub fn rules(&self) -> Result<sluice::rules::Rules, sluice::rules::RuleError> {
        sluice::rules::Rules::compile(&self.limiter, &self.domains)
    }
}

/// `server`: where the APIs listen.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// HTTP API address. Loopback unless you mean otherwise.
    pub http: SocketAddr,
    /// gRPC (Envoy RLS) address.
    pub grpc: SocketAddr,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// Enables the admin endpoints; callers must send `Authorization: Bearer <token>`.
    pub admin_token: Option<String>,
    /// A file whose content is `admin_token` (a Kubernetes Secret's key mounted as a
    /// file, say): the token stays out of the config. Read at start and at each reload.
    pub admin_token_file: Option<std::path::PathBuf>,
    /// Credentials of the data plane: when any are set, every decision, lease, refund and
    /// status call (HTTP `Authorization: Bearer <token>`, gRPC metadata `authorization`)
    /// must carry one of them. Several, so they can be rotated. Off by default for the
    /// loopback default; required when a listener is not on loopback.
    pub api_tokens: Vec<String>,
    /// A file of more `api_tokens`, one a line (blank lines and `#` comments skipped).
    pub api_tokens_file: Option<std::path::PathBuf>,
    /// A request head must arrive within this; a keep-alive connection that sends no
    /// next request is closed after it too (HTTP). gRPC: a connection's first call must
    /// open within it, and the HTTP/2 keep-alive ping must be answered within it.
    pub header_timeout: Duration,
    /// A request body must arrive within this (HTTP; 408 after it).
    pub body_timeout: Duration,
    /// Connections open at once, on each listener. HTTP: past it a connection gets one
    /// request and is closed, so a health probe still gets through. gRPC: past it a
    /// connection is closed at once (`grpc/listen.rs`).
    pub max_connections: usize,
    /// A gRPC connection with no call open for this long is closed (a first call must
    /// come within `header_timeout`).
    pub grpc_idle_timeout: Duration,
    /// A gRPC connection older than this is asked to close (HTTP/2 GOAWAY: its calls in
    /// flight finish, new ones come on a new connection), so that a fleet's connections
    /// spread again over instances added or restarted (envoyproxy/ratelimit's
    /// `GRPC_MAX_CONNECTION_AGE`). None: never.
    pub grpc_max_connection_age: Option<Duration>,
    /// How long calls still open on a connection asked to close may take before it is
    /// closed under them (their `GRPC_MAX_CONNECTION_AGE_GRACE`). None: as long as they take.
    pub grpc_max_connection_age_grace: Option<Duration>,
    /// How long a stopping server (SIGTERM, SIGINT) waits for requests in flight before
    /// it drops their connections and exits.
    pub shutdown_grace: Duration,
    /// TLS on both listeners (see `tls.rs`); plain TCP without it.
    pub tls: Option<ListenerTls>,
    /// The live page, `GET /ui`, and the overview it polls (needs `admin_token`).
    pub ui: bool,
    /// The HTTP data plane runs through the tower layer's adaptive stage: a concurrency
    /// limit learned from its own latency (a slow store's, mostly), 503 past it.
    pub adaptive_concurrency: bool,
    /// Threads serving gRPC, each a single-threaded runtime of its own (default: one a
    /// core). A connection stays on the thread that accepted it.
    pub grpc_threads: Option<usize>,
    /// Envoy's Rate Limit Quota Service streams' bounds.
    pub rlqs: RlqsBounds,
    /// A listener of its own for `GET /metrics` alone (envoyproxy/ratelimit's
    /// `PROMETHEUS_ADDR`), besides `/metrics` on `http`. Plain HTTP, with the HTTP
    /// listener's bounds.
    pub metrics: Option<SocketAddr>,
    /// The path of `GET /metrics` on `metrics` (envoyproxy/ratelimit's
    /// `PROMETHEUS_PATH`); the HTTP listener keeps `/metrics`.
    pub metrics_path: String,
    /// Serve gRPC on this Unix socket instead of `grpc` (envoyproxy/ratelimit's
    /// `GRPC_UDS`), with the same connection bounds; a socket file left by a process
    /// before is replaced. Plain: no TLS on it (its file's permissions guard it).
    pub grpc_uds: Option<std::path::PathBuf>,
    /// A listener of its own for envoyproxy/ratelimit's debug endpoints (their
    /// `DEBUG_HOST:DEBUG_PORT`): `/rlconfig`, the rules in force as theirs prints them;
    /// `/stats`, each rule's hits under their stat names; `/`, the list. Plain HTTP.
    pub debug: Option<SocketAddr>,
}

/// `server.rlqs`: how much RLQS streams may hold on this instance (`grpc/rlqs.rs`). A stream
/// or report past a bound ends with `RESOURCE_EXHAUSTED` naming it.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RlqsBounds {
    /// Streams open at once.
    pub max_streams: usize,
    /// Streams open at once from one peer address: a peer cannot open streams to starve
    /// the others of a bucket's fair part.
    pub max_streams_per_peer: usize,
    /// Buckets one stream may report.
    pub max_buckets_per_stream: usize,
    /// Buckets held by every stream together.
    pub max_buckets: usize,
}

impl Default for RlqsBounds {
    fn default() -> Self {
        Self { max_streams: 4_096, max_streams_per_peer: 64, max_buckets_per_stream: 1_000, max_buckets: 100_000 }
    }
}

/// `server.tls`: the listeners' certificate, and the CA whose client certificates are
/// required (mTLS) when `client_ca_file` is set. PEM files, read again at every reload.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTls {
    /// The certificate chain, leaf first.
    pub cert_file: std::path::PathBuf,
    /// The certificate's private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: std::path::PathBuf,
    /// When set, a client must present a certificate this CA signed.
    pub client_ca_file: Option<std::path::PathBuf>,
    /// With `client_ca_file`: the client's certificate must also be valid for this name
    /// (a DNS name or an IP address among its subject alternative names), as
    /// envoyproxy/ratelimit's `GRPC_CLIENT_TLS_SAN` checks it.
    #[serde(default)]
    pub client_san: Option<String>,
    /// TLS on the HTTP listener too (the default). Off, only gRPC speaks TLS, as with
    /// envoyproxy/ratelimit's `GRPC_SERVER_USE_TLS`: probes reach `/healthcheck` in the
    /// clear (Envoy Gateway's do).
    #[serde(default = "yes")]
    pub http: bool,
}

fn yes() -> bool {
    true
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            http: SocketAddr::from(([127, 0, 0, 1], 8080)),
            grpc: SocketAddr::from(([127, 0, 0, 1], 8081)),
            max_body_bytes: 64 * 1024,
            admin_token: None,
            admin_token_file: None,
            api_tokens: Vec::new(),
            api_tokens_file: None,
            header_timeout: Duration(10_000),
            body_timeout: Duration(10_000),
            max_connections: 4_096,
            grpc_idle_timeout: Duration(600_000),
            grpc_max_connection_age: None,
            grpc_max_connection_age_grace: None,
            shutdown_grace: Duration(10_000),
            tls: None,
            ui: false,
            adaptive_concurrency: false,
            grpc_threads: None,
            rlqs: RlqsBounds::default(),
            metrics: None,
            metrics_path: "/metrics".into(),
            debug: None,
            grpc_uds: None,
        }
    }
}

/// `store`: where limiter state lives.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum StoreConfig {
    /// In process memory; state is lost on restart and not shared between processes.
    Memory {
        /// Most states held (one per policy per client) before old ones are evicted.
        #[serde(default = "default_max_keys")]
        max_keys: usize,
    },
    /// One Redis primary (`url`), with optional read replicas for status reads.
    Redis {
        /// `redis://[user:password@]host:port[/db]` (or `rediss://` for TLS).
        url: String,
        #[serde(default)]
        replicas: Vec<String>,
        #[serde(flatten)]
        connection: RedisConnectionConfig,
    },
    /// Redis behind Sentinel: the primary (and a replica for status reads) named by the
    /// Sentinels, followed through a failover.
    RedisSentinel(SentinelConfig),
    /// Redis Cluster (Stripe's setup): slots, MOVED and ASK followed by the client.
    RedisCluster {
        /// Any nodes of the cluster (`redis://host:port`); the rest are discovered.
        nodes: Vec<String>,
        /// Send status reads to the replicas of the primary owning the client's slot.
        #[serde(default)]
        read_from_replicas: bool,
        /// Bounds connecting and each reply.
        #[serde(default = "default_timeout")]
        timeout: Duration,
        /// Retries after MOVED, ASK, TRYAGAIN, CLUSTERDOWN or a dead node (waits of 2,
        /// 4, 8 ... ms, at most 50); the engine's deadline bounds them all.
        #[serde(default = "default_cluster_retries")]
        retries: u32,
        /// As for `redis`: how many bucket hashes client states share.
        #[serde(default)]
        buckets: Buckets,
        /// Certificates for `rediss://` node URLs.
        #[serde(default)]
        tls: Option<TlsConfig>,
        /// Replicas of the owning primary that must acknowledge a quota grant before it
        /// is spent (0 by default: set 1 when the primaries have replicas).
        #[serde(default)]
        grant_acks: u32,
        /// Replicas of the owning primary that must acknowledge each write (`WAIT`)
        /// before it counts (0 by default: a failover may then lose the last writes the
        /// replica had not received, and the fleet admits them again).
        #[serde(default)]
        replica_acks: u32,
    },
    /// GitHub's old backend: fixed windows only, and a cache that evicts (see
    /// docs/operations.md). For migrating away from, with `migrating`.
    Memcached {
        /// `host:port` of each server; each client lives on one. Empty with `srv`.
        #[serde(default)]
        servers: Vec<String>,
        /// A DNS SRV record naming the servers instead (`_memcache._tcp.example.com`;
        /// envoyproxy/ratelimit's `MEMCACHE_SRV`), read at start.
        #[serde(default)]
        srv: Option<String>,
        /// Read the SRV record again this often (their `MEMCACHE_SRV_REFRESH`; 0s: never).
        #[serde(default = "never")]
        srv_refresh: Duration,
        /// The name server to ask (default: the first of /etc/resolv.conf, port 53).
        #[serde(default)]
        srv_nameserver: Option<SocketAddr>,
        #[serde(default = "default_timeout")]
        timeout: Duration,
        /// TLS to the servers (memcached's `-Z`), verifying each against `ca_file` (or
        /// the system's roots) by its host, presenting `cert_file` when set; plain TCP
        /// without it.
        #[serde(default)]
        tls: Option<TlsConfig>,
    },
    /// envoyproxy/ratelimit's `REDIS_PERSECOND`: fixed windows of one second on a store
    /// of their own (`per_second`), every other limit on `main`; a decision that meets
    /// both is two calls, kept all or nothing (`store/per_second.rs`).
    PerSecond { main: Box<StoreConfig>, per_second: Box<StoreConfig> },
    /// GitHub's migration: each client on `to` or `from` by a stable hash of its tag
    /// against `percent`, which can change live (config reload, admin API).
    Migrating {
        from: Box<StoreConfig>,
        to: Box<StoreConfig>,
        /// Share of clients on `to`, 0 to 100.
        percent: u8,
    },
    /// GitHub's client-side sharding: each client on one of several replicated groups.
    RedisSharded {
        shards: Vec<RedisShardConfig>,
        #[serde(flatten)]
        connection: RedisConnectionConfig,
    },
}

/// `redis_sentinel`: where the Sentinels are and what they watch.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SentinelConfig {
    /// `host:port` of each Sentinel (no scheme: TLS comes from `tls`).
    pub sentinels: Vec<String>,
    /// The name the Sentinels monitor the primary under.
    pub master_name: String,
    /// Send status reads to a replica the Sentinels hold healthy.
    #[serde(default)]
    pub read_from_replicas: bool,
    /// Credentials for the primary and replicas (`requirepass`, or an ACL user).
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
    /// Credentials for the Sentinels themselves.
    #[serde(default)]
    pub sentinel_username: Option<String>,
    #[serde(default)]
    pub sentinel_password: Option<String>,
    #[serde(flatten)]
    pub connection: RedisConnectionConfig,
}

/// One shard of `redis_sharded`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisShardConfig {
    pub primary: String,
    #[serde(default)]
    pub replicas: Vec<String>,
}

/// TLS files for `rediss://` URLs.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// PEM file of the CA that signed the server's certificate; without it, the system's
    /// trusted roots.
    pub ca_file: Option<std::path::PathBuf>,
    /// PEM certificate and key of this client, for servers that verify clients
    /// (`tls-auth-clients yes`).
    pub cert_file: Option<std::path::PathBuf>,
    pub key_file: Option<std::path::PathBuf>,
}

/// Connection settings shared by the Redis stores.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct RedisConnectionConfig {
    /// Bounds connecting and each reply (the engine's `limiter.deadline` is usually
    /// shorter and decides first).
    pub timeout: Duration,
    /// Replicas that must acknowledge each write (`WAIT`) before it counts; 0 does not
    /// wait. See docs/operations.md.
    pub replica_acks: u32,
    /// Replicas that must acknowledge a quota grant before it is spent (unset: 1 with
    /// `replicas` listed or Sentinel, else 0). See docs/configuration.md, quota grants.
    pub grant_acks: Option<u32>,
    /// Certificates for `rediss://` URLs.
    pub tls: Option<TlsConfig>,
    /// How many bucket hashes client states share (1 to 16,777,216); about the number of
    /// active states divided by 64. Changing it moves every client, which starts afresh.
    /// See docs/operations.md.
    pub buckets: Buckets,
}

impl Default for RedisConnectionConfig {
    fn default() -> Self {
        Self { timeout: Duration(1_000), replica_acks: 0, grant_acks: None, tls: None, buckets: Buckets::default() }
    }
}

/// `store.buckets`: how many bucket hashes the Redis stores spread client states over
/// (see the Redis store's bucket hashes), 1 to 16,777,216.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buckets(pub u32);

impl Buckets {
    pub const MAX: u32 = 1 << 24;
}

impl Default for Buckets {
    fn default() -> Self {
        Buckets(sluice::store::redis::DEFAULT_BUCKETS)
    }
}

impl<'de> Deserialize<'de> for Buckets {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u64::deserialize(d)?;
        match u32::try_from(n) {
            Ok(n @ 1..=Buckets::MAX) => Ok(Buckets(n)),
            _ => Err(de::Error::custom(format!(
                "`buckets` is {n}; write 1 to {} (about the number of active states / 64)",
                Buckets::MAX
            ))),
        }
    }
}

fn default_max_keys() -> usize {
    1_000_000
}

fn default_timeout() -> Duration {
    Duration(1_000)
}

fn never() -> Duration {
    Duration(0)
}

fn default_cluster_retries() -> u32 {
    6
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig::Memory { max_keys: default_max_keys() }
    }
}
