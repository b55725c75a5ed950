//! Time, as the limiter sees it.
//!
//! Every algorithm takes `now` as an argument and never reads a clock (invariant 1, docs/architecture.md).
//! GitHub's wobbling `X-RateLimit-Reset` came from mixing two clocks in one answer; a
//! single caller-supplied `now` makes that impossible and lets tests travel in time.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, or a duration in milliseconds.
pub type Millis = u64;

/// Where the engine gets `now` from.
pub trait Clock: Send + Sync + 'static {
    /// The current time in milliseconds since the Unix epoch.
    fn now(&self) -> Millis;
}

/// The system's wall clock, precise to the millisecond and cheap to read.
///
/// Asking the OS (`clock_gettime`) costs about 30 ns on a virtual machine, as much as a
/// whole in-memory decision. So each thread asks it once every [`REANCHOR_NS`] and, in
/// between, adds the time the CPU's timestamp counter has counted since (read through
/// `quanta`, which calibrates the counter against the OS clock and falls back to the OS's
/// monotonic clock where the counter cannot be trusted): about 9 ns a read. Between two anchors the error is
/// the counter's calibration error over 10 ms, nanoseconds; a step of the OS clock (NTP, an
/// operator) is seen within 10 ms.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

/// How long a thread interpolates before reading the OS clock again.
pub const REANCHOR_NS: u64 = 10_000_000;

static TICKS: OnceLock<quanta::Clock> = OnceLock::new();

thread_local! {
    /// This thread's last OS clock read: (counter ticks, ns since the epoch).
    static ANCHOR: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// The OS wall clock in ns since the epoch.
fn os_now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

impl Clock for SystemClock {
    fn now(&self) -> Millis {
        let ticks = TICKS.get_or_init(quanta::Clock::new);
        let raw = ticks.raw();
        ANCHOR.with(|anchor| {
            let (raw0, wall0) = anchor.get();
            // a counter read before the anchor (another core's counter) counts as 0
            let since = ticks.delta_as_nanos(raw0, raw);
            let ns = if wall0 == 0 || since >= REANCHOR_NS {
                let wall = os_now_ns();
                anchor.set((raw, wall));
                wall
            } else {
                wall0 + since
            };
            ns / 1_000_000
        })
    }
}

/// The kernel's coarse real-time clock (Linux `CLOCK_REALTIME_COARSE`): about 4 ns a read
/// against [`SystemClock`]'s 9, with the resolution of the kernel tick (1 to 4 ms, see
/// `clock_getres`). It lags real time by at most one tick, never leads it, so a
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

/// At most once every so often, across threads: what keeps a log line (or any other
/// report) from being written once per request when something goes wrong for each.
#[derive(Debug, Default)]
pub struct Throttle {
    /// When it is next due, in ms.
    next: std::sync::atomic::AtomicU64,
}

impl Throttle {
    /// Whether it is due at `now`; if so (for one caller only), not again until `every`
    /// has passed.
    pub fn due(&self, now: Millis, every: Millis) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let next = self.next.load(Relaxed);
        now >= next && self.next.compare_exchange(next, now + every, Relaxed, Relaxed).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coarse_clock_tracks_the_system_clock() {
        let ms = || os_now_ns() / 1_000_000;
        let (a, c, b) = (ms(), CoarseClock.now(), ms());
        // never ahead of real time, and behind it by at most a tick (plus scheduling)
        assert!(c <= b, "coarse {c} is ahead of system {b}");
        assert!(a.saturating_sub(c) < 50, "coarse {c} lags system {a} by more than 50 ms");
    }

    #[test]
    #[allow(clippy::disallowed_types)] // the OS's clock is what this test judges
    fn system_clock_is_the_os_clock_to_the_millisecond() {
        // over 300 ms, across many re-anchors and between them
        let start = std::time::Instant::now();
        let mut reads = 0;
        while start.elapsed() < std::time::Duration::from_millis(300) {
            let before = os_now_ns() / 1_000_000;
            let ours = SystemClock.now();
            let after = os_now_ns() / 1_000_000;
            assert!(before <= ours + 1 && ours <= after + 1, "{ours} outside [{before}, {after}]");
            reads += 1;
            if reads % 64 == 0 {
                std::thread::sleep(std::time::Duration::from_micros(700));
            }
        }
        assert!(reads > 1000, "only {reads} reads in 300 ms");
    }
}
