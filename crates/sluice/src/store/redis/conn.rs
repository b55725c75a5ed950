//! The connections: one node, a Cluster or a Sentinel-followed primary, each
//! reconnecting by itself; and the server version check.

use super::*;

/// A connection that reconnects by itself, opened lazily: a Redis that is down when
/// Sluice starts does not stop it from starting.
#[derive(Clone)]
pub(super) enum Conn {
    Node(ConnectionManager),
    Cluster(Arc<ClusterLink>),
    /// The server Sentinel names, followed through failovers (`sentinel.rs`).
    Sentinel(Arc<sentinel::SentinelLink>),
}

/// A Redis Cluster connection, opened on first use and kept; attempts are spaced so a
/// cluster that is down is not sent a connection storm.
pub(super) struct ClusterLink {
    pub(super) client: ClusterClient,
    pub(super) conn: std::sync::Mutex<Option<ClusterConnection>>,
    pub(super) connecting: tokio::sync::Mutex<Option<tokio::time::Instant>>,
}

impl ClusterLink {
    pub(super) async fn get(&self) -> Result<ClusterConnection, RedisError> {
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
        *last = Some(tokio::time::Instant::now());
        let c = self.client.get_async_connection().await?;
        *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = Some(c.clone());
        Ok(c)
    }

    pub(super) fn cached(&self) -> Option<ClusterConnection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Conn {
    pub(super) fn open(url: &str, options: &RedisOptions) -> Result<Self, StoreError> {
        manager(url, options, 2).map(Conn::Node)
    }

    pub(super) fn open_cluster(
        nodes: &[String],
        options: &RedisOptions,
        read_from_replicas: bool,
    ) -> Result<Self, StoreError> {
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

    pub(super) async fn query(&self, cmd: &Cmd) -> Result<Value, RedisError> {
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
    pub(super) async fn query_at(&self, cmd: &Cmd, key: &str) -> Result<Value, RedisError> {
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
    pub(super) async fn run(
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
    pub(super) async fn version_check(&self, timeout: Duration) -> Option<Result<(), StoreError>> {
        let reply = tokio::time::timeout(timeout, self.query(redis::cmd("INFO").arg("server"))).await.ok()?.ok()?;
        Some(texts(reply).iter().find_map(|info| too_old(info)).map_or(Ok(()), Err))
    }

    /// Whether the server answers PING now. One PING: a dead server costs one timeout.
    pub(super) async fn ping(&self) -> bool {
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
pub(super) fn too_old(info: &str) -> Option<StoreError> {
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
pub(super) fn texts(v: Value) -> Vec<String> {
    match v {
        Value::BulkString(b) => vec![String::from_utf8_lossy(&b).into_owned()],
        Value::VerbatimString { text, .. } | Value::SimpleString(text) => vec![text],
        Value::Array(items) | Value::Set(items) => items.into_iter().flat_map(texts).collect(),
        Value::Map(pairs) => pairs.into_iter().flat_map(|(_, v)| texts(v)).collect(),
        _ => Vec::new(),
    }
}
