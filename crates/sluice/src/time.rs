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

/// The kernel's coarse real-time clock (Linux `CLOCK_REALTIME_COARSE`): about ten times
/// cheaper to read than [`SystemClock`], with the resolution of the kernel tick (1 to 4
/// ms, see `clock_getres`). It lags real time by at most one tick, never leads it, so a
/// limiter on it admits nothing early; windows and buckets move in tick-sized steps.
/// Elsewhere than Linux it is the system clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct CoarseClock;

impl Clock for CoarseClock {
    #[cfg(target_os = "linux")]
    fn now(&self) -> Millis {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `ts` is a valid, writable timespec; the call only writes into it.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) };
        if rc != 0 {
            return SystemClock.now();
        }
        ts.tv_sec as Millis * 1000 + ts.tv_nsec as Millis / 1_000_000
    }
    #[cfg(not(target_os = "linux"))]
    fn now(&self) -> Millis {
        SystemClock.now()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coarse_clock_tracks_the_system_clock() {
        let (a, c, b) = (SystemClock.now(), CoarseClock.now(), SystemClock.now());
        // never ahead of real time, and behind it by at most a tick (plus scheduling)
        assert!(c <= b, "coarse {c} is ahead of system {b}");
        assert!(a.saturating_sub(c) < 50, "coarse {c} lags system {a} by more than 50 ms");
    }
}
