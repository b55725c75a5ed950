//! The resilient wrapper: a deadline on every store call and a circuit breaker.
//!
//! Stripe's lesson: a rate limiter must never take the API down with it. Every call gets
//! a deadline (default 100 ms, their ~0.1 s); after `failures` consecutive failures the
//! breaker opens and calls fail at once for `cooldown`, so a dead store is not sent more
//! work; then one call is let through as a probe, and its success closes the breaker.
//! What the client sees when a call fails is the engine's failure policy.

use super::{
    Commit, GiveBack, GrantAsk, Hold, PoolCall, Refund, RegistryOp, RegistryReply, Reservation, Settled, Store,
    StoreError,
};
use crate::algo::grant::{Granted, Open};
use crate::algo::pool::Pool;
use crate::algo::{ConcurrencyState, Decision, Lease, Limit, Op};
use crate::tag::Tag;
use crate::telemetry::{StoreMetrics, StoreOp};
use crate::time::Millis;
use async_trait::async_trait;
use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// The deadline of one registry call (a page of overrides, a change): not a decision's,
/// which is far shorter, since nothing waits on it but the instance's copy of the set.
pub const REGISTRY_DEADLINE: Duration = Duration::from_secs(2);

/// Deadline and breaker settings.
#[derive(Debug, Clone, Copy)]
pub struct Resilience {
    /// Longest a store call may take.
    pub deadline: Duration,
    /// Consecutive failures that open the breaker.
    pub failures: u32,
    /// How long an open breaker fails calls before it lets a probe through.
    pub cooldown: Duration,
}

impl Default for Resilience {
    fn default() -> Self {
        Self { deadline: Duration::from_millis(100), failures: 5, cooldown: Duration::from_secs(1) }
    }
}

/// Deadline and breaker settings that can change while the store runs: what a config
/// reload retunes without reconnecting. Several wrapped stores (a migration's two sides)
/// may share one.
#[derive(Debug)]
pub struct Tuning {
    deadline_ms: AtomicU64,
    failures: AtomicU32,
    cooldown_ms: AtomicU64,
    /// The `store` label of the store's series, when not its kind ([`Tuning::labelled`]).
    label: Option<&'static str>,
}

impl Tuning {
    /// Settings starting as `r`.
    pub fn new(r: Resilience) -> Self {
        let t = Self {
            deadline_ms: AtomicU64::new(0),
            failures: AtomicU32::new(0),
            cooldown_ms: AtomicU64::new(0),
            label: None,
        };
        t.set(r);
        t
    }

    /// Labels the store's series `store="<label>"` rather than by its kind: the global
    /// store of regions (`global`), apart from the region's own store of the same kind.
    pub fn labelled(mut self, label: &'static str) -> Self {
        self.label = Some(label);
        self
    }

    /// Changes the settings; calls already running keep the deadline they started with.
    pub fn set(&self, r: Resilience) {
        self.deadline_ms.store(r.deadline.as_millis() as u64, Ordering::Relaxed);
        self.failures.store(r.failures.max(1), Ordering::Relaxed);
        self.cooldown_ms.store(r.cooldown.as_millis() as u64, Ordering::Relaxed);
    }

    /// The settings now.
    pub fn get(&self) -> Resilience {
        Resilience {
            deadline: Duration::from_millis(self.deadline_ms.load(Ordering::Relaxed)),
            failures: self.failures.load(Ordering::Relaxed),
            cooldown: Duration::from_millis(self.cooldown_ms.load(Ordering::Relaxed)),
        }
    }
}

/// The breaker's state, for metrics and `/readyz`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

#[derive(Debug)]
enum Breaker {
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
    },
    /// A probe is out; other calls fail until it answers.
    HalfOpen,
}

/// Counts an operator watches.
#[derive(Debug, Default)]
pub struct ResilienceStats {
    pub timeouts: AtomicU64,
    pub errors: AtomicU64,
    /// Calls refused at once because the breaker was open.
    pub short_circuited: AtomicU64,
}

/// A store behind a deadline and a circuit breaker.
pub struct Resilient<S> {
    inner: S,
    settings: Arc<Tuning>,
    breaker: Mutex<Breaker>,
    stats: ResilienceStats,
    metrics: StoreMetrics,
}

impl<S: Store> Resilient<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, settings: Resilience) -> Self {
        Self::tuned(inner, Arc::new(Tuning::new(settings)))
    }

    /// Wraps `inner` with settings that can change while it runs.
    pub fn tuned(inner: S, settings: Arc<Tuning>) -> Self {
        let metrics = StoreMetrics::new(settings.label.unwrap_or(inner.kind()));
        metrics.breaker(0);
        Self {
            inner,
            settings,
            breaker: Mutex::new(Breaker::Closed { failures: 0 }),
            stats: ResilienceStats::default(),
            metrics,
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Failure counters.
    pub fn stats(&self) -> &ResilienceStats {
        &self.stats
    }

    /// The breaker's state now.
    pub fn breaker(&self) -> BreakerState {
        match *self.lock() {
            Breaker::Closed { .. } => BreakerState::Closed,
            Breaker::Open { until } if Instant::now() < until => BreakerState::Open,
            Breaker::Open { .. } | Breaker::HalfOpen => BreakerState::HalfOpen,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Breaker> {
        self.breaker.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a call may go to the store now (and if it is the probe, marks it out).
    fn admit(&self) -> bool {
        let mut b = self.lock();
        match *b {
            Breaker::Closed { .. } => true,
            Breaker::Open { until } if Instant::now() >= until => {
                *b = Breaker::HalfOpen;
                self.metrics.breaker(2);
                true
            }
            Breaker::Open { .. } | Breaker::HalfOpen => false,
        }
    }

    /// Moves the breaker after a call: `outage` is the error of a call that found the
    /// store down (a wrong answer is not an outage). Logs the transitions, never each
    /// call: the store failing, the breaker opening, the store answering again.
    fn record(&self, outage: Option<&StoreError>) {
        let mut b = self.lock();
        let next = match (&*b, outage) {
            (_, None) => Breaker::Closed { failures: 0 },
            (Breaker::Closed { failures }, Some(_)) if failures + 1 < self.settings.get().failures => {
                Breaker::Closed { failures: failures + 1 }
            }
            (_, Some(_)) => Breaker::Open { until: Instant::now() + self.settings.get().cooldown },
        };
        let store = self.inner.kind();
        match (&*b, &next, outage) {
            (Breaker::Closed { failures: 0 }, _, Some(e)) => {
                let address = self.inner.address();
                // the global store of regions is not what `/readyz` asks (http/probes.rs)
                let readyz = match self.settings.label {
                    Some("global") => "/readyz is not affected by the global store",
                    _ => "/readyz answers 503, unless a rule's failure is local",
                };
                tracing::warn!(
                    store,
                    %address,
                    error = %e,
                    readyz,
                    "store failing; the failure policy decides until it answers again"
                );
            }
            (Breaker::Closed { .. }, Breaker::Open { .. }, _) => {
                let cooldown_ms = self.settings.get().cooldown.as_millis() as u64;
                tracing::warn!(store, cooldown_ms, "store circuit breaker opened");
            }
            (Breaker::Closed { failures }, Breaker::Closed { .. }, None) if *failures > 0 => {
                tracing::info!(store, failed_calls = failures, "store answering again");
            }
            (Breaker::Open { .. } | Breaker::HalfOpen, Breaker::Closed { .. }, None) => {
                tracing::info!(store, "store answering again; circuit breaker closed");
            }
            _ => {}
        }
        match (&*b, &next) {
            (Breaker::Closed { .. }, Breaker::Closed { .. }) => {}
            (_, Breaker::Closed { .. }) => self.metrics.breaker(0),
            (_, Breaker::Open { .. }) => self.metrics.breaker(1),
            (_, Breaker::HalfOpen) => {}
        }
        *b = next;
    }

    /// Runs `f` for at most `deadline`, and counts its time and failure.
    async fn timed<T>(
        &self,
        op: StoreOp,
        deadline: Duration,
        f: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let result = match tokio::time::timeout(deadline, f).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout(deadline.as_millis() as Millis)),
        };
        self.metrics.call(op, started.elapsed().as_secs_f64());
        if let Err(e) = &result {
            self.metrics.error(e.kind());
        }
        result
    }

    async fn call<T>(&self, op: StoreOp, f: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        if !self.admit() {
            self.stats.short_circuited.fetch_add(1, Ordering::Relaxed);
            self.metrics.error(StoreError::CircuitOpen.kind());
            return Err(StoreError::CircuitOpen);
        }
        let result = self.timed(op, self.settings.get().deadline, f).await;
        match &result {
            Ok(_) => {}
            Err(StoreError::Timeout(_)) => {
                self.stats.timeouts.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        // an answer that is wrong (a protocol error) is not a dead store
        self.record(result.as_ref().err().filter(|e| e.is_outage()));
        result
    }
}

#[async_trait]
impl<S: Store> Store for Resilient<S> {
    async fn apply(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
        self.call(StoreOp::Apply, self.inner.apply(tag, ops, now)).await
    }
    async fn peek(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
        self.call(StoreOp::Peek, self.inner.peek(tag, ops, now)).await
    }
    async fn release(&self, tag: Tag, keys: &[u64], lease: Lease, now: Millis) -> Result<bool, StoreError> {
        self.call(StoreOp::Release, self.inner.release(tag, keys, lease, now)).await
    }
    async fn leases(&self, tag: Tag, key: u64, ttl: Millis, now: Millis) -> Result<ConcurrencyState, StoreError> {
        self.call(StoreOp::Peek, self.inner.leases(tag, key, ttl, now)).await
    }
    async fn refund(&self, tag: Tag, refunds: &[Refund], now: Millis) -> Result<(), StoreError> {
        self.call(StoreOp::Refund, self.inner.refund(tag, refunds, now)).await
    }
    async fn reset(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<(), StoreError> {
        self.call(StoreOp::Reset, self.inner.reset(tag, ops, now)).await
    }
    fn grants(&self) -> bool {
        self.inner.grants()
    }
    async fn grant(&self, tag: Tag, ask: GrantAsk, now: Millis) -> Result<Granted, StoreError> {
        self.call(StoreOp::Grant, self.inner.grant(tag, ask, now)).await
    }
    async fn give_back(&self, tag: Tag, back: GiveBack, now: Millis) -> Result<u64, StoreError> {
        self.call(StoreOp::Grant, self.inner.give_back(tag, back, now)).await
    }
    fn pools(&self) -> bool {
        self.inner.pools()
    }
    async fn pool(&self, tag: Tag, call: PoolCall, now: Millis) -> Result<(u64, Pool), StoreError> {
        self.call(StoreOp::Grant, self.inner.pool(tag, call, now)).await
    }
    fn reservations(&self) -> bool {
        self.inner.reservations()
    }
    async fn reserve(&self, tag: Tag, ops: &[Op], r: Reservation, now: Millis) -> Result<Vec<Decision>, StoreError> {
        self.call(StoreOp::Apply, self.inner.reserve(tag, ops, r, now)).await
    }
    async fn commit(&self, tag: Tag, id: u64, commits: &[Commit], now: Millis) -> Result<Vec<Settled>, StoreError> {
        // a commit is never refused: a refund's path (it gives back or charges work done)
        self.call(StoreOp::Refund, self.inner.commit(tag, id, commits, now)).await
    }
    async fn holds(&self, tag: Tag, key: u64, limit: &Limit, now: Millis) -> Result<Vec<Hold>, StoreError> {
        self.call(StoreOp::Peek, self.inner.holds(tag, key, limit, now)).await
    }
    async fn grants_open(&self, tag: Tag, key: u64, limit: &Limit, now: Millis) -> Result<Vec<Open>, StoreError> {
        self.call(StoreOp::Peek, self.inner.grants_open(tag, key, limit, now)).await
    }
    fn keeps_registry(&self) -> bool {
        self.inner.keeps_registry()
    }
    async fn registry(&self, op: RegistryOp) -> Result<RegistryReply, StoreError> {
        // not a decision: its own deadline (a page of overrides may take longer than a
        // decision may wait), and neither the breaker nor an open one stops it, so a slow
        // read of the registry never turns rate limiting off, nor an outage hides it
        self.timed(StoreOp::Registry, REGISTRY_DEADLINE, self.inner.registry(op)).await
    }
    async fn preflight(&self) -> Result<(), StoreError> {
        self.inner.preflight().await
    }
    async fn ready(&self) -> bool {
        let ready =
            tokio::time::timeout(self.settings.get().deadline.max(Duration::from_millis(500)), self.inner.ready())
                .await
                .unwrap_or(false);
        // a store that answers is not down: an open breaker closes, so that `/readyz`
        // saying ready means decisions reach the store again (not a cool-down later)
        if ready && self.breaker() != BreakerState::Closed {
            self.record(None);
        }
        ready
    }
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn routing(&self) -> u64 {
        self.inner.routing()
    }
    fn address(&self) -> String {
        self.inner.address()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;
    use std::sync::atomic::AtomicBool;

    /// A store that fails while `down` is set; otherwise the memory store. (It fails the
    /// way a dead server does, and only that: it is not a model of Redis.)
    struct Flaky {
        down: AtomicBool,
        slow: AtomicBool,
        calls: AtomicU64,
        inner: MemoryStore,
    }

    #[async_trait]
    impl Store for Flaky {
        async fn apply(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            if self.slow.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            if self.down.load(Ordering::Relaxed) {
                return Err(StoreError::unavailable("down"));
            }
            self.inner.apply(tag, ops, now).await
        }
        async fn peek(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
            self.inner.peek(tag, ops, now).await
        }
        async fn release(&self, tag: Tag, keys: &[u64], lease: Lease, now: Millis) -> Result<bool, StoreError> {
            self.inner.release(tag, keys, lease, now).await
        }
        async fn leases(&self, tag: Tag, key: u64, ttl: Millis, now: Millis) -> Result<ConcurrencyState, StoreError> {
            self.inner.leases(tag, key, ttl, now).await
        }
        async fn refund(&self, tag: Tag, refunds: &[Refund], now: Millis) -> Result<(), StoreError> {
            self.inner.refund(tag, refunds, now).await
        }
        async fn reset(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<(), StoreError> {
            self.inner.reset(tag, ops, now).await
        }
        async fn ready(&self) -> bool {
            !self.down.load(Ordering::Relaxed)
        }
        fn keeps_registry(&self) -> bool {
            true
        }
        async fn registry(&self, op: RegistryOp) -> Result<RegistryReply, StoreError> {
            if self.slow.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            if self.down.load(Ordering::Relaxed) {
                return Err(StoreError::unavailable("down"));
            }
            self.inner.registry(op).await
        }
        fn kind(&self) -> &'static str {
            "flaky"
        }
    }

    fn flaky(down: bool, slow: bool) -> Flaky {
        Flaky {
            down: AtomicBool::new(down),
            slow: AtomicBool::new(slow),
            calls: AtomicU64::new(0),
            inner: MemoryStore::new(100),
        }
    }

    fn op() -> Op {
        Op {
            key: 1,
            limit: crate::algo::Limit::FixedWindow { limit: 9, window: 1000, aligned: false },
            cost: 1,
            lease: None,
            shadow: false,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn breaker_opens_fails_fast_then_probes_and_closes() {
        let flaky = flaky(true, false);
        let r = Resilient::new(
            flaky,
            Resilience { deadline: Duration::from_millis(50), failures: 3, cooldown: Duration::from_millis(200) },
        );
        for _ in 0..3 {
            assert_eq!(r.apply(Tag(1), &[op()], 0).await, Err(StoreError::unavailable("down")));
        }
        assert_eq!(r.breaker(), BreakerState::Open);
        for _ in 0..10 {
            assert_eq!(r.apply(Tag(1), &[op()], 0).await, Err(StoreError::CircuitOpen));
        }
        assert_eq!(r.inner().calls.load(Ordering::Relaxed), 3, "an open breaker sends nothing to the store");
        assert_eq!(r.stats().short_circuited.load(Ordering::Relaxed), 10);
        tokio::time::sleep(Duration::from_millis(220)).await;
        r.inner().down.store(false, Ordering::Relaxed);
        assert!(r.apply(Tag(1), &[op()], 0).await.is_ok(), "the probe goes through");
        assert_eq!(r.breaker(), BreakerState::Closed);
    }

    /// `/readyz` saying ready means decisions reach the store: a store that answers
    /// closes an open breaker at once, not a cool-down later.
    #[tokio::test]
    async fn a_ready_store_closes_the_breaker() {
        let flaky = flaky(true, false);
        let r = Resilient::new(
            flaky,
            Resilience { deadline: Duration::from_millis(50), failures: 1, cooldown: Duration::from_secs(60) },
        );
        assert!(r.apply(Tag(1), &[op()], 0).await.is_err());
        assert!(!r.ready().await && r.breaker() == BreakerState::Open, "down: not ready, still open");
        r.inner().down.store(false, Ordering::Relaxed);
        assert!(r.ready().await);
        assert_eq!(r.breaker(), BreakerState::Closed);
        assert!(r.apply(Tag(1), &[op()], 0).await.is_ok(), "decisions reach the store again");
    }

    /// Reading the overrides is not a decision: a call longer than the decision deadline
    /// completes, failures never open the breaker, and an open breaker does not stop it.
    #[tokio::test(start_paused = true)]
    async fn registry_calls_have_their_own_deadline_and_leave_the_breaker_alone() {
        let r = Resilient::new(
            flaky(false, true),
            Resilience { deadline: Duration::from_millis(50), failures: 1, cooldown: Duration::from_secs(60) },
        );
        assert!(r.registry(RegistryOp::Version).await.is_ok(), "300 ms is within the registry's deadline");
        r.inner().slow.store(false, Ordering::Relaxed);
        r.inner().down.store(true, Ordering::Relaxed);
        for _ in 0..3 {
            assert_eq!(r.registry(RegistryOp::Version).await, Err(StoreError::unavailable("down")));
        }
        assert_eq!(r.breaker(), BreakerState::Closed, "registry failures are not the decisions' business");
        assert!(r.apply(Tag(1), &[op()], 0).await.is_err());
        assert_eq!(r.breaker(), BreakerState::Open);
        r.inner().down.store(false, Ordering::Relaxed);
        assert!(r.registry(RegistryOp::Version).await.is_ok(), "an open breaker does not stop a registry call");
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_bounds_a_slow_store() {
        let flaky = flaky(false, true);
        let r = Resilient::new(flaky, Resilience { deadline: Duration::from_millis(50), ..Resilience::default() });
        let start = Instant::now();
        assert_eq!(r.apply(Tag(1), &[op()], 0).await, Err(StoreError::Timeout(50)));
        // on paused time: exactly the deadline, whatever the machine's load
        assert_eq!(start.elapsed(), Duration::from_millis(50));
        assert_eq!(r.stats().timeouts.load(Ordering::Relaxed), 1);
    }
}
