//! What writes: the primary (or the cluster) with its scripts and options, and the
//! replica acknowledgements a quota grant waits for.

use super::*;

/// What writes: the primary (or the cluster), the scripts and the options.
pub(crate) struct Writer {
    pub(super) conn: Conn,
    pub(super) scripts: Scripts,
    pub(super) options: RedisOptions,
    /// Replicas a grant waits for (`grant_acks`, resolved).
    pub(super) grant_acks: u32,
    /// Writes short of their replica acknowledgements are logged at most this often,
    /// with how many.
    pub(super) short_acks: crate::time::Throttle,
    pub(super) short_since: AtomicUsize,
}

/// The longest a quota grant waits for its replica acknowledgements: past it (a replica
/// down, or none left after a failover) the grant is spent anyway, and logged, rather
/// than fail the decisions waiting for it (`limiter.deadline` is 100 ms by default).
pub(super) const GRANT_ACK_WAIT: Duration = Duration::from_millis(50);

/// How often writes short of their replica acknowledgements are summed up in the log.
pub(super) const SHORT_ACKS_LOG_EVERY: Millis = 5_000;

impl Writer {
    /// A writer on `conn`; `replicas`: whether the store knows of replicas (the default
    /// of `grant_acks`).
    pub(super) fn new(conn: Conn, options: RedisOptions, replicas: bool) -> Self {
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
    pub(super) fn for_grants(
        self: &Arc<Self>,
        open: impl FnOnce() -> Result<Conn, StoreError>,
    ) -> Result<Arc<Self>, StoreError> {
        if self.grant_acks == 0 {
            return Ok(self.clone());
        }
        let mut granter = Writer::new(open()?, self.options.clone(), false);
        granter.grant_acks = self.grant_acks;
        Ok(Arc::new(granter))
    }

    /// Runs a writing script on the primary, then waits for `replica_acks` replicas.
    pub(super) async fn write(
        &self,
        script: &Script,
        keys: &[&str],
        fill: impl Fn(&mut Cmd),
    ) -> Result<Value, StoreError> {
        self.write_acked(script, keys, fill, self.options.replica_acks, self.options.timeout).await
    }

    /// Runs a writing script on the primary, then waits (`WAIT`, at most `wait`) for
    /// `acks` replicas to hold it: on a Cluster, of the node that owns `keys[0]`. Fewer
    /// acknowledgements than asked are logged (summed up every 5 s), not an error.
    pub(super) async fn write_acked(
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
    pub(super) async fn apply(&self, calls: &[&Call]) -> Vec<Result<Vec<Decision>, StoreError>> {
        if calls.is_empty() {
            return Vec::new();
        }
        let keys: Vec<&str> = calls.iter().flat_map(|c| c.at.iter().map(|l| l.key.as_str())).collect();
        let reply = self.write(&self.scripts.apply, &keys, |cmd| apply_args(cmd, calls)).await;
        answers(reply, calls)
    }
}
