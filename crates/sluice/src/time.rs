//! Time, as the limiter sees it.
//!
//! Every algorithm takes `now` as an argument and never reads a clock (DESIGN invariant 1).
//! GitHub's wobbling `X-RateLimit-Reset` came from mixing two clocks in one answer; a
//! single caller-supplied `now` makes that impossible and lets tests travel in time.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, or a duration in milliseconds.
pub type Millis = u64;

/// Where the engine gets `now` from.
pub trait Clock: Send + Sync + 'static {
    /// The current time in milliseconds since the Unix epoch.
    fn now(&self) -> Millis;
}

/// The system's wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Millis {
        SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as Millis).unwrap_or(0)
    }
}

/// A clock that only moves when told to: for tests that cross window boundaries without
/// sleeping. Clones share the same time.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock stopped at `start`.
    pub fn new(start: Millis) -> Self {
        Self(Arc::new(AtomicU64::new(start)))
    }
    /// Moves the clock forward by `by` milliseconds.
    pub fn advance(&self, by: Millis) {
        self.0.fetch_add(by, Ordering::SeqCst);
    }
    /// Sets the clock to `to`.
    pub fn set(&self, to: Millis) {
        self.0.store(to, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Millis {
        self.0.load(Ordering::SeqCst)
    }
}

/// Whole seconds, rounded up: what `Retry-After` needs (waiting a little too long is
/// safe, retrying a little too early is another 429).
pub fn ceil_secs(ms: Millis) -> u64 {
    ms.div_ceil(1000)
}
