//! The adaptive concurrency limit: how many requests may run at once, learned from
//! their latency.
//!
//! A service that can run `C` requests at once, each taking `S`, answers in `S` while
//! fewer than `C` run and queues the rest: with `L > C` admitted, each waits its turn and
//! the mean latency is `S * L / C` (Little's law: throughput stays `C / S`). So when
//! latency rises from its no-load value `base` to `mean` under a limit `L`, the capacity
//! is `L * base / mean`, measured. The controller works in windows (about twenty
//! no-load latencies long) and, at the end of each:
//!
//! - **cut** when `mean > base * tolerance`: `L <- L * base / mean`, straight to the
//!   capacity just measured (Gradient2's ratio, without its added queue, so the windows
//!   after run at capacity and show the no-load latency again). The window after a cut
//!   is not judged: it still holds requests admitted before the cut;
//! - **grow** when the window was saturated (some request found the limit reached) and
//!   `mean <= base * (1 + (tolerance - 1) / 2)`: `L <- L * (1 + (tolerance - 1) / 2)`,
//!   so a step up alone never calls for a cut (doubling until the first cut, like TCP's
//!   slow start); a limit grows only while it is what holds requests back;
//! - otherwise keep `L`: between half the tolerance and the whole of it the limit rests,
//!   a band as Vegas has. Without it, a limit under a long overload sawed between the
//!   capacity and 1.4 times it, and each cut left the requests above the new limit to
//!   drain: on a real service of 10 slots and 50 ms the admitted p99 was 1.9 times the
//!   unloaded one; with it, 1.6 to 1.7.
//!
//! `base` is the lowest window mean of the last 30 s (two half-horizon minima, O(1)
//! memory). Cuts land at capacity, where no request queues, so the windows after a cut
//! keep `base` honest through an overload of any length, without Envoy's probes that
//! pin concurrency low and refuse requests while they measure. A service that became
//! slower for its own reasons is told apart by the cuts: if two cuts in a row did not
//! bring latency down by a quarter of what queueing predicts, the latency is not
//! queueing, and `base` is reset to it instead of the limit collapsing.
//!
//! A dropped request (timed out or abandoned) counts as congestion: a window with drops
//! cuts by at least a tenth. The limit stays within `floor..=ceiling`.
//!
//! Why not Vegas: it estimates the queue from the minimum latency of single requests,
//! which jitter keeps below the typical no-load latency, so its thresholds need tuning
//! per service; comparing window means with window means needs none. Why not Gradient2
//! as written: adding a queue of `sqrt(L)` every window keeps latency above `base` under
//! a sustained overload, so its long-term average drifts up with the load (Netflix
//! resets it when it drifts 2x).
//!
//! Pure: time (`now`, µs on any monotonic base) and latencies are the caller's.

/// Microseconds.
pub type Micros = u64;

/// The controller's parameters. The defaults serve services from 1 ms to 1 s and from
/// a few to thousands of requests at once without tuning.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradientParams {
    /// The limit before anything is learned.
    pub initial: u32,
    /// Never below this.
    pub floor: u32,
    /// Never above this.
    pub ceiling: u32,
    /// How far the window mean may rise above `base` before the limit is cut.
    pub tolerance: f64,
    /// A window lasts this many `base` latencies (within 10 ms ..= 1 s) and at least
    /// `min_samples` requests.
    pub window_latencies: u32,
    /// Fewest requests a window decides on.
    pub min_samples: u32,
    /// How long the no-load latency is remembered, µs.
    pub horizon: Micros,
}

impl Default for GradientParams {
    fn default() -> Self {
        Self {
            initial: 20,
            floor: 4,
            ceiling: 5_000,
            tolerance: 1.25,
            window_latencies: 10,
            min_samples: 20,
            horizon: 30_000_000,
        }
    }
}

/// Parameters the controller cannot run with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GradientError {
    #[error("adaptive concurrency needs 1 <= floor ({floor}) <= initial ({initial}) <= ceiling ({ceiling})")]
    Bounds { floor: u32, initial: u32, ceiling: u32 },
    #[error("the latency tolerance must be above 1 (it is {0})")]
    Tolerance(f64),
    #[error("a window needs at least one latency and one sample")]
    Window,
}

impl GradientParams {
    /// Checks the parameters.
    pub fn validate(&self) -> Result<(), GradientError> {
        let (floor, initial, ceiling) = (self.floor, self.initial, self.ceiling);
        if !(1 <= floor && floor <= initial && initial <= ceiling) {
            return Err(GradientError::Bounds { floor, initial, ceiling });
        }
        if self.tolerance.is_nan() || self.tolerance <= 1.0 {
            return Err(GradientError::Tolerance(self.tolerance));
        }
        if self.window_latencies == 0 || self.min_samples == 0 || self.horizon == 0 {
            return Err(GradientError::Window);
        }
        Ok(())
    }
}

/// How a request ended, as the controller counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Answered: its latency is a sample.
    Served,
    /// Failed fast or otherwise not a measure of load: not a sample.
    Ignored,
    /// Timed out or abandoned while running: congestion.
    Dropped,
}

/// The lowest window mean seen in the last horizon: the minimum of the current half
/// horizon and of the one before.
#[derive(Debug, Clone, PartialEq)]
struct Baseline {
    current: f64,
    previous: f64,
    since: Micros,
}

impl Baseline {
    fn get(&self) -> f64 {
        self.current.min(self.previous)
    }

    fn observe(&mut self, mean: f64, now: Micros, horizon: Micros) {
        if now.saturating_sub(self.since) >= horizon / 2 {
            self.previous = self.current;
            self.current = f64::INFINITY;
            self.since = now;
        }
        self.current = self.current.min(mean);
    }

    fn reset(&mut self, mean: f64, now: Micros) {
        *self = Baseline { current: mean, previous: f64::INFINITY, since: now };
    }
}

/// One window's sums.
#[derive(Debug, Clone, Default, PartialEq)]
struct Window {
    start: Micros,
    samples: u32,
    total: f64,
    dropped: u32,
    saturated: bool,
}

/// What the last cut expects of the next window.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Cut {
    /// The window mean that caused it.
    mean: f64,
    /// `to / from` of the limit.
    ratio: f64,
    /// Whether a window has passed since: the requests admitted before the cut have
    /// left the service.
    settled: bool,
}

/// The controller's state.
#[derive(Debug, Clone, PartialEq)]
pub struct Gradient {
    params: GradientParams,
    limit: f64,
    base: Option<Baseline>,
    window: Window,
    slow_start: bool,
    cut: Option<Cut>,
    /// Cuts in a row that did not lower latency.
    failed_cuts: u32,
}

impl Gradient {
    /// A controller at its initial limit; the first window starts at `now`.
    pub fn new(params: GradientParams, now: Micros) -> Self {
        Self {
            limit: f64::from(params.initial),
            params,
            base: None,
            window: Window { start: now, ..Window::default() },
            slow_start: true,
            cut: None,
            failed_cuts: 0,
        }
    }

    /// The limit now: how many requests may run at once.
    pub fn limit(&self) -> u32 {
        self.limit as u32
    }

    /// The no-load latency learned so far, µs.
    pub fn base(&self) -> Option<f64> {
        self.base.as_ref().map(Baseline::get)
    }

    /// The no-load latency, or 10 ms before any is learned, µs.
    pub fn base_or_guess(&self) -> f64 {
        self.base().unwrap_or(10_000.0)
    }

    /// How long a window lasts now, µs.
    pub fn window_length(&self) -> Micros {
        let base = self.base_or_guess();
        ((base * f64::from(self.params.window_latencies)) as Micros).clamp(10_000, 1_000_000)
    }

    /// Notes that a request found the limit reached in this window.
    pub fn saturated(&mut self) {
        self.window.saturated = true;
    }

    /// Takes a finished request's latency and outcome; returns the new limit when a
    /// window ended.
    pub fn sample(&mut self, now: Micros, latency: Micros, outcome: Outcome) -> Option<u32> {
        match outcome {
            Outcome::Served => {
                self.window.samples += 1;
                self.window.total += latency as f64;
            }
            Outcome::Dropped => self.window.dropped += 1,
            Outcome::Ignored => {}
        }
        let w = &self.window;
        let decided = w.samples + w.dropped >= self.params.min_samples;
        if !decided || now.saturating_sub(w.start) < self.window_length() {
            return None;
        }
        let window = std::mem::replace(&mut self.window, Window { start: now, ..Window::default() });
        self.decide(&window, now);
        Some(self.limit())
    }

    /// Ends a window: cut, grow or keep.
    fn decide(&mut self, w: &Window, now: Micros) {
        let p = self.params;
        let cut = self.cut.take();
        if let Some(c) = cut.filter(|c| !c.settled) {
            // the window after a cut still holds requests admitted before it
            self.cut = Some(Cut { settled: true, ..c });
            return;
        }
        if w.samples == 0 {
            self.set(self.limit * 0.9);
            return;
        }
        let mean = w.total / f64::from(w.samples);
        let base = self.base.get_or_insert(Baseline { current: mean, previous: f64::INFINITY, since: now });
        if let Some(c) = cut {
            // queueing predicts a fall of latency in proportion to the cut; less than a
            // quarter of it, twice in a row, says the latency is not queueing (once is
            // not enough: the window that caused a cut may have begun before the
            // overload did, and so understate the latency at that limit)
            let failed = mean > c.mean * (1.0 - (1.0 - c.ratio) / 4.0);
            self.failed_cuts = if failed { self.failed_cuts + 1 } else { 0 };
            if self.failed_cuts >= 2 {
                base.reset(mean, now);
                self.failed_cuts = 0;
            }
        }
        base.observe(mean, now, p.horizon);
        let base = base.get();
        if mean > base * p.tolerance || w.dropped > 0 {
            let mut to = self.limit * base / mean;
            if w.dropped > 0 {
                to = to.min(self.limit * 0.9);
            }
            let from = self.limit;
            self.set(to);
            self.cut = Some(Cut { mean, ratio: self.limit / from, settled: false });
            self.slow_start = false;
        } else if w.saturated && mean <= base * (1.0 + (p.tolerance - 1.0) / 2.0) {
            let step = if self.slow_start { self.limit } else { self.limit * (p.tolerance - 1.0) / 2.0 };
            self.set(self.limit + step.max(1.0));
        }
    }

    fn set(&mut self, limit: f64) {
        self.limit = limit.clamp(f64::from(self.params.floor), f64::from(self.params.ceiling));
    }
}
