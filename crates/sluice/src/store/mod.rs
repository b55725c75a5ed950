//! Where state lives. A store runs the algorithms atomically; it is not a key-value API.
//!
//! Every call names one client tag, and every op of a call is evaluated all or nothing
//! in one atomic step (one lock, one Lua script, one round trip). Every store passes the
//! same conformance suite (`store::conformance`, feature `conformance`), whose
//! reference is [`crate::algo`].

#[cfg(feature = "conformance")]
pub mod conformance;
mod memcached;
mod memory;
mod migrating;
mod per_second;
#[cfg(feature = "redis")]
pub mod redis;
mod registry;
mod resilient;

use crate::algo::grant::{Granted, Open};
use crate::algo::pool::{Act, Pool};
pub use crate::algo::reservation::{Hold, Settled};
use crate::algo::{ConcurrencyState, Decision, Lease, Limit, Op};
use crate::tag::Tag;
use crate::time::Millis;
use async_trait::async_trait;

pub use memcached::{
    Connector as MemcachedConnector, Io as MemcachedIo, MemcachedStore, ServerList as MemcachedServers,
};
pub use memory::{MemoryStats, MemoryStore};
pub use migrating::MigratingStore;
pub use per_second::PerSecondStore;
pub(crate) use registry::LocalRegistry;
pub use registry::{Change, RegistryOp, RegistryReply, TOMBSTONES};
pub use resilient::{BreakerState, Resilience, ResilienceStats, Resilient, Tuning};

/// Appends the low `6 * chars` bits of `v` in base64url, most significant first.
pub(crate) fn b64(out: &mut String, v: u128, chars: u32) {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    for i in (0..chars).rev() {
        out.push(ALPHABET[((v >> (6 * i)) & 63) as usize] as char);
    }
}

/// A charge to give back: `cost` on the state `key`, in the window the charging
/// decision reported as `reset_at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refund {
    pub key: u64,
    pub limit: Limit,
    pub cost: u64,
    pub window: Millis,
}

/// A grant to take (see [`crate::algo::grant`]): up to `want` units, at least `need`,
/// of the fixed-window or token-bucket state `key`, recorded as grant `id`; the grants
/// in `close` (this instance's, of the same state) are spent. With `pool`, the state is
/// a region's pool of a global window ([`crate::algo::pool`]): what the region holds
/// bounds the grant, not the limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantAsk {
    pub key: u64,
    pub limit: Limit,
    pub need: u64,
    pub want: u64,
    pub id: u64,
    pub close: Vec<u64>,
    pub pool: bool,
}

/// An allocator's call on a region's pool of a global window (see
/// [`crate::algo::pool::change`]): the pool of fixed window `key` (under `limit`) that
/// ends at `end`, with `arrived` units reported (demand counted in buckets of `bucket`
/// ms), then `act`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolCall {
    pub key: u64,
    pub limit: Limit,
    pub end: Millis,
    pub arrived: u64,
    pub act: Act,
    pub bucket: Millis,
    /// What the global store said was left of the window, to record in the pool.
    pub left: Option<u64>,
}

/// Unspent units of grant `id`, taken from state `key` (a fixed window: in the window
/// that resets at `window`), to give back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GiveBack {
    pub key: u64,
    pub limit: Limit,
    pub id: u64,
    pub unspent: u64,
    pub window: Millis,
    /// Units of the grant that stay open (0: it closes); on a fixed window only, and
    /// only if the grant held `unspent + keep` ([`crate::algo::grant::give_back`]).
    pub keep: u64,
}

/// One state's part of a reservation's commit (see [`crate::algo::reservation`]): the
/// actual amount spent against the fixed window `key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    pub key: u64,
    pub limit: Limit,
    pub actual: u64,
}

/// A reservation to hold: as reservation `id`, until `now + ttl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    pub id: u64,
    pub ttl: Millis,
}

/// The underlying error of a [`StoreError`] (an IO error, a Redis reply), kept for
/// callers that look at [`std::error::Error::source`].
pub type Cause = std::sync::Arc<dyn std::error::Error + Send + Sync>;

/// `s` with every byte but RFC 3986's unreserved characters percent-encoded: safe in a
/// URL's path, query or credentials (the credentials of a Redis URL the Sentinel store writes; the admin CLI's queries).
pub fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Why a store call failed. The engine's failure policy decides what the client sees.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached or did not answer (connection refused, reset,
    /// its own timeout): the failure policy decides, and the circuit breaker counts it.
    #[error("store unavailable: {what}")]
    Unavailable { what: String, cause: Option<Cause> },
    /// The engine's deadline passed before the store answered.
    #[error("store call timed out after {0}ms")]
    Timeout(Millis),
    /// The store answered, but not what Sluice expects (a script error, a reply of the
    /// wrong shape): a bug or a misconfigured server, not a dead one.
    #[error("store answered something unexpected: {what}")]
    Protocol { what: String, cause: Option<Cause> },
    /// Not sent: the circuit breaker is open after repeated failures.
    #[error("store skipped: its circuit breaker is open after repeated failures")]
    CircuitOpen,
    /// A bounded store had no room for a new client's state and evicts no live state
    /// (that would hand the evicted client a fresh limit): the failure policy decides
    /// for this client until room frees up. Not an outage.
    #[error("store full: no room for a new client's state (live state is never evicted)")]
    Full,
}

impl StoreError {
    /// An unreachable store, described by `what`.
    pub fn unavailable(what: impl Into<String>) -> Self {
        StoreError::Unavailable { what: what.into(), cause: None }
    }

    /// An unexpected answer, described by `what`.
    pub fn protocol(what: impl Into<String>) -> Self {
        StoreError::Protocol { what: what.into(), cause: None }
    }

    /// The same error, keeping `e`, whose text its message already says, for
    /// [`StoreError::cause`]. Not its `source()`: a chain printed whole would say it twice.
    pub fn because(mut self, e: impl std::error::Error + Send + Sync + 'static) -> Self {
        if let StoreError::Unavailable { cause, .. } | StoreError::Protocol { cause, .. } = &mut self {
            *cause = Some(std::sync::Arc::new(e));
        }
        self
    }

    /// The error of the client library underneath (the Redis or Memcached client's), to
    /// downcast; its text is in this error's message.
    pub fn cause(&self) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
        match self {
            StoreError::Unavailable { cause, .. } | StoreError::Protocol { cause, .. } => cause.as_deref(),
            _ => None,
        }
    }

    /// A short stable name of the kind of failure, for metrics and logs: `unavailable`,
    /// `timeout`, `protocol`, `circuit_open` or `full`.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Unavailable { .. } => "unavailable",
            StoreError::Timeout(_) => "timeout",
            StoreError::Protocol { .. } => "protocol",
            StoreError::CircuitOpen => "circuit_open",
            StoreError::Full => "full",
        }
    }

    /// Whether the store is likely down (as opposed to answering wrongly): what the
    /// circuit breaker counts.
    pub fn is_outage(&self) -> bool {
        matches!(self, StoreError::Unavailable { .. } | StoreError::Timeout(_))
    }
}

/// Two errors are equal when they say the same thing; causes are not compared.
impl PartialEq for StoreError {
    fn eq(&self, other: &Self) -> bool {
        self.kind() == other.kind() && self.to_string() == other.to_string()
    }
}

/// A place where limiter state lives.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Applies every op of one client tag, all or nothing, in one atomic step, and
    /// returns one decision per op (see [`crate::algo::apply_all`]).
    async fn apply(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError>;

    /// What `ops` would report now, without charging or writing anything. May be served
    /// by a replica; state whose stored reset has passed reads as fresh.
    async fn peek(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError>;

    /// Gives `lease` back on every concurrency state in `keys`. Idempotent; returns
    /// whether any lease was held.
    async fn release(&self, tag: Tag, keys: &[u64], lease: Lease, now: Millis) -> Result<bool, StoreError>;

    /// The live leases of the concurrency state `key` of `tag` (those younger than
    /// `ttl`), oldest first, with when each was taken. Reads only; may be served by a
    /// replica. For inspecting a client: requests never need it.
    async fn leases(&self, tag: Tag, key: u64, ttl: Millis, now: Millis) -> Result<ConcurrencyState, StoreError>;

    /// Gives back charges made under `tag`.
    async fn refund(&self, tag: Tag, refunds: &[Refund], now: Millis) -> Result<(), StoreError>;

    /// Forgets the states of `ops` (all under `tag`) at once, leases included: the client
    /// starts afresh on them, as if never seen.
    async fn reset(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<(), StoreError>;

    /// Whether the store takes quota grants (the memory and Redis stores do).
    fn grants(&self) -> bool {
        false
    }

    /// Grants units of a fixed window or a token bucket to this instance (see
    /// [`crate::algo::grant`]), atomically: the units are taken from the state at once.
    async fn grant(&self, tag: Tag, ask: GrantAsk, now: Millis) -> Result<Granted, StoreError> {
        let _ = (tag, ask, now);
        Err(StoreError::protocol(no_grants_reason(self.kind())))
    }

    /// Gives back a grant's unspent units, once per grant; returns the units given back.
    async fn give_back(&self, tag: Tag, back: GiveBack, now: Millis) -> Result<u64, StoreError> {
        let _ = (tag, back, now);
        Err(StoreError::protocol(no_grants_reason(self.kind())))
    }

    /// Whether the store keeps regional pools of global windows (the memory and Redis
    /// stores do).
    fn pools(&self) -> bool {
        false
    }

    /// One allocator call on a pool ([`crate::algo::pool::change`]), atomically:
    /// the units it moved and the pool after it.
    async fn pool(&self, tag: Tag, call: PoolCall, now: Millis) -> Result<(u64, Pool), StoreError> {
        let _ = (tag, call, now);
        Err(StoreError::protocol(format!(
            "the {} store keeps no regional pools; use a memory or redis store",
            self.kind()
        )))
    }

    /// Whether the store keeps reservations (see [`crate::algo::reservation`]).
    fn reservations(&self) -> bool {
        false
    }

    /// Reserves each op's `cost` of its fixed window as `r`, all or nothing as
    /// [`Store::apply`] decides (a shadow op never refuses the others): one decision per
    /// op, and the holds recorded only when every enforced op was admitted.
    async fn reserve(&self, tag: Tag, ops: &[Op], r: Reservation, now: Millis) -> Result<Vec<Decision>, StoreError> {
        let _ = (tag, ops, r, now);
        Err(StoreError::protocol(no_reservations_reason(self.kind())))
    }

    /// The reservations open on fixed window `key` of client `tag` at `now`, for
    /// inspecting it (none on a store that keeps none). Reads only.
    async fn holds(&self, tag: Tag, key: u64, limit: &Limit, now: Millis) -> Result<Vec<Hold>, StoreError> {
        let _ = (tag, key, limit, now);
        Ok(Vec::new())
    }

    /// The quota grants open on fixed window `key` of client `tag` in its window at `now`
    /// (on a global window, every region's), for inspecting it (none on a store that
    /// grants none). Reads only.
    async fn grants_open(&self, tag: Tag, key: u64, limit: &Limit, now: Millis) -> Result<Vec<Open>, StoreError> {
        let _ = (tag, key, limit, now);
        Ok(Vec::new())
    }

    /// Commits reservation `id` with each state's actual amount, in one atomic step:
    /// what each commit did. Never refused; a commit sent again settles once.
    async fn commit(&self, tag: Tag, id: u64, commits: &[Commit], now: Millis) -> Result<Vec<Settled>, StoreError> {
        let _ = (tag, id, commits, now);
        Err(StoreError::protocol(no_reservations_reason(self.kind())))
    }

    /// Whether the store keeps the fleet's registry (the memory and Redis stores do).
    fn keeps_registry(&self) -> bool {
        false
    }

    /// Reads or changes the registry (see [`RegistryOp`]), atomically.
    async fn registry(&self, op: RegistryOp) -> Result<RegistryReply, StoreError> {
        let _ = op;
        Err(no_registry(self.kind()))
    }

    /// Checks, once at start, that the store can run Sluice's decisions at all (a Redis
    /// new enough for the scripts). A store that cannot be reached now passes: stores
    /// connect lazily, and one that is down must not keep Sluice from starting.
    async fn preflight(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Whether the store can take calls now (for `/readyz`).
    async fn ready(&self) -> bool {
        true
    }

    /// A number that moves whenever clients may have moved to another backend (a
    /// migration's percentage): a refusal remembered in process (the near-cache) was the
    /// old backend's, and is let go of.
    fn routing(&self) -> u64 {
        0
    }

    /// A short name for logs and metrics.
    fn kind(&self) -> &'static str;

    /// Where the store is, for logs (passwords hidden); empty in process.
    fn address(&self) -> String {
        String::new()
    }
}

/// Why a store of `kind` keeps no registry, and what to use instead.
pub(crate) fn no_registry_reason(kind: &str) -> String {
    format!(
        "the {kind} store keeps no overrides; use a memory or redis store (a migrating store keeps them on a side that can)"
    )
}

/// The error of a grant asked for on a limit grants do not take.
pub(crate) fn no_grants_for(limit: &Limit) -> StoreError {
    StoreError::protocol(format!("grants take fixed windows and token buckets, not {}", limit.algorithm()))
}

/// Why a store of `kind` takes no grants.
pub(crate) fn no_grants_reason(kind: &str) -> String {
    format!("the {kind} store takes no quota grants (`grants:` on a rule); use a memory or redis store")
}

/// Why a store of `kind` keeps no reservations.
pub(crate) fn no_reservations_reason(kind: &str) -> String {
    format!("the {kind} store keeps no reservations; use a redis or memory store")
}

/// Reservations take fixed windows only: the first other limit's error, before anything
/// is read or written.
pub(crate) fn only_windows<'a>(mut limits: impl Iterator<Item = &'a Limit>) -> Result<(), StoreError> {
    match limits.find(|l| !matches!(l, Limit::FixedWindow { .. })) {
        Some(l) => Err(StoreError::protocol(format!("reservations take fixed windows, not {}", l.algorithm()))),
        None => Ok(()),
    }
}

/// The error of a store asked for a registry it does not keep.
fn no_registry(kind: &str) -> StoreError {
    StoreError::protocol(no_registry_reason(kind))
}

/// A store made of other stores, each client on one of them (client-side shards, a
/// migration). Implementing this gives the `Store`: every call goes to `route(tag)`.
pub trait Router: Send + Sync + 'static {
    /// The store that holds `tag`'s state.
    fn route(&self, tag: Tag) -> &dyn Store;
    /// Every store behind it (ready only when all are).
    fn stores(&self) -> Vec<&dyn Store>;
    /// The store that keeps the registry: by default the first that can (it must not
    /// change while the set of stores stays the same).
    fn registry_home(&self) -> Option<&dyn Store> {
        self.stores().into_iter().find(|s| s.keeps_registry())
    }
    /// The store kind, for logs and metrics.
    fn kind(&self) -> &'static str;
    /// See [`Store::routing`]: what moves when clients move between the stores.
    fn routing(&self) -> u64 {
        0
    }
}

#[async_trait]
impl<R: Router> Store for R {
    async fn apply(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
        self.route(tag).apply(tag, ops, now).await
    }
    async fn peek(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
        self.route(tag).peek(tag, ops, now).await
    }
    async fn release(&self, tag: Tag, keys: &[u64], lease: Lease, now: Millis) -> Result<bool, StoreError> {
        self.route(tag).release(tag, keys, lease, now).await
    }
    async fn leases(&self, tag: Tag, key: u64, ttl: Millis, now: Millis) -> Result<ConcurrencyState, StoreError> {
        self.route(tag).leases(tag, key, ttl, now).await
    }
    async fn refund(&self, tag: Tag, refunds: &[Refund], now: Millis) -> Result<(), StoreError> {
        self.route(tag).refund(tag, refunds, now).await
    }
    async fn reset(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<(), StoreError> {
        self.route(tag).reset(tag, ops, now).await
    }
    fn grants(&self) -> bool {
        self.stores().iter().all(|s| s.grants())
    }
    async fn grant(&self, tag: Tag, ask: GrantAsk, now: Millis) -> Result<Granted, StoreError> {
        self.route(tag).grant(tag, ask, now).await
    }
    async fn give_back(&self, tag: Tag, back: GiveBack, now: Millis) -> Result<u64, StoreError> {
        self.route(tag).give_back(tag, back, now).await
    }
    fn pools(&self) -> bool {
        self.stores().iter().all(|s| s.pools())
    }
    async fn pool(&self, tag: Tag, call: PoolCall, now: Millis) -> Result<(u64, Pool), StoreError> {
        self.route(tag).pool(tag, call, now).await
    }
    fn reservations(&self) -> bool {
        self.stores().iter().all(|s| s.reservations())
    }
    async fn reserve(&self, tag: Tag, ops: &[Op], r: Reservation, now: Millis) -> Result<Vec<Decision>, StoreError> {
        self.route(tag).reserve(tag, ops, r, now).await
    }
    async fn commit(&self, tag: Tag, id: u64, commits: &[Commit], now: Millis) -> Result<Vec<Settled>, StoreError> {
        self.route(tag).commit(tag, id, commits, now).await
    }
    async fn holds(&self, tag: Tag, key: u64, limit: &Limit, now: Millis) -> Result<Vec<Hold>, StoreError> {
        self.route(tag).holds(tag, key, limit, now).await
    }
    async fn grants_open(&self, tag: Tag, key: u64, limit: &Limit, now: Millis) -> Result<Vec<Open>, StoreError> {
        self.route(tag).grants_open(tag, key, limit, now).await
    }
    fn keeps_registry(&self) -> bool {
        self.registry_home().is_some()
    }
    async fn registry(&self, op: RegistryOp) -> Result<RegistryReply, StoreError> {
        match self.registry_home() {
            Some(s) => s.registry(op).await,
            None => Err(no_registry(Router::kind(self))),
        }
    }
    async fn preflight(&self) -> Result<(), StoreError> {
        for s in self.stores() {
            s.preflight().await?;
        }
        Ok(())
    }
    async fn ready(&self) -> bool {
        for s in self.stores() {
            if !s.ready().await {
                return false;
            }
        }
        true
    }
    fn kind(&self) -> &'static str {
        Router::kind(self)
    }
    fn routing(&self) -> u64 {
        Router::routing(self)
    }
    fn address(&self) -> String {
        self.stores().iter().map(|s| s.address()).filter(|a| !a.is_empty()).collect::<Vec<_>>().join(", ")
    }
}

#[cfg(test)]
mod tests {
    /// A store error says its cause's text once, however it is printed (an error chain
    /// printed whole, as anyhow's `{:#}` does): in its message, not again as its source.
    #[test]
    fn a_store_error_says_its_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
        let e = super::StoreError::unavailable(format!("redis connection: {io}")).because(io);
        let mut chain = e.to_string();
        let mut at = std::error::Error::source(&e);
        while let Some(s) = at {
            chain += &format!(": {s}");
            at = s.source();
        }
        assert_eq!(chain.matches("connection refused").count(), 1, "{chain}");
        assert!(e.cause().is_some_and(|c| c.downcast_ref::<std::io::Error>().is_some()), "the cause, to downcast");
    }
}
