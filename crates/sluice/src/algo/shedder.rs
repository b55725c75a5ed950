//! Stripe's worker utilization load shedder: a controller that turns a utilization
//! sample into a shed amount, slowly.
//!
//! The amount moves at a rate set by utilization: below `good` (0.7) it falls in
//! proportion to how far below; between `good` and `bad` (0.8), the dead zone, it does
//! not move; above `bad` it rises in proportion to how far above. At full speed it
//! crosses from 0 to 1 in `to_shed_all` (120 s). It rests below zero (`-before / to_shed_all`),
//! so bad utilization must last `before` (28 s) before anything is shed, and recovery
//! after a drop is gradual. Samples further apart than `before` count as `before`.
//!
//! The amount is spread over priority classes, least important first: class `i` of `k`
//! (0 = least important) is dropped with probability `clamp(amount * k - i, 0, 1)`. The
//! last class is critical and never dropped. Pure: time and randomness are the caller's.

use crate::time::Millis;

/// The controller's parameters (Stripe's defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShedderParams {
    /// End of good utilization: below it, shedding falls.
    pub good: f64,
    /// Start of bad utilization: above it, shedding rises.
    pub bad: f64,
    /// How long bad utilization lasts before shedding starts, in ms.
    pub before: Millis,
    /// How long full-speed shedding takes to go from nothing to everything, in ms.
    pub to_shed_all: Millis,
}

impl Default for ShedderParams {
    fn default() -> Self {
        Self { good: 0.7, bad: 0.8, before: 28_000, to_shed_all: 120_000 }
    }
}

impl ShedderParams {
    /// The resting amount, below zero so shedding starts only after `before`.
    pub fn resting(&self) -> f64 {
        -(self.before as f64) / self.to_shed_all as f64
    }

    /// Checks the parameters.
    pub fn validate(&self) -> Result<(), ShedderError> {
        if !(0.0 < self.good && self.good <= self.bad && self.bad < 1.0) {
            return Err(ShedderError::Thresholds { good: self.good, bad: self.bad });
        }
        if self.to_shed_all == 0 {
            return Err(ShedderError::NoTimeToShed);
        }
        Ok(())
    }
}

/// Parameters the controller cannot run with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ShedderError {
    #[error("shedding needs 0 < good ({good}) <= bad ({bad}) < 1")]
    Thresholds { good: f64, bad: f64 },
    #[error("the time to shed all traffic must be longer than 0")]
    NoTimeToShed,
}

/// The controller's state.
#[derive(Debug, Clone, PartialEq)]
pub struct Shedder {
    params: ShedderParams,
    amount: f64,
    last: Option<Millis>,
}

fn clamp(v: f64, lo: f64, hi: f64) -> f64 {
    v.max(lo).min(hi)
}

impl Shedder {
    /// A controller at rest.
    pub fn new(params: ShedderParams) -> Self {
        Self { amount: params.resting(), params, last: None }
    }

    /// The shed amount now, from the resting amount (below 0: nothing shed) to 1.
    pub fn amount(&self) -> f64 {
        self.amount
    }

    /// Takes a utilization sample (0 to 1) at `now` and returns the new amount.
    pub fn update(&mut self, utilization: f64, now: Millis) -> f64 {
        let p = self.params;
        let u = clamp(utilization, 0.0, 1.0);
        let direction = if u < p.good {
            u / p.good - 1.0
        } else if u < p.bad {
            0.0
        } else {
            (u - p.bad) / (1.0 - p.bad)
        };
        let per_ms = clamp(direction, -1.0, 1.0) / p.to_shed_all as f64;
        let elapsed = self.last.map_or(0, |last| now.saturating_sub(last).min(p.before));
        self.last = Some(now);
        self.amount = clamp(self.amount + elapsed as f64 * per_ms, p.resting(), 1.0);
        self.amount
    }

    /// The probability that a request of priority class `class` (0 = least important)
    /// of `classes` is dropped now. The last class is critical: never.
    pub fn drop_probability(&self, class: usize, classes: usize) -> f64 {
        if classes == 0 || class + 1 >= classes {
            return 0.0;
        }
        clamp(self.amount * classes as f64 - class as f64, 0.0, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the controller at `u` from `from` to `to` seconds, one sample a second.
    fn run(s: &mut Shedder, u: f64, from: u64, to: u64) {
        for t in from..=to {
            s.update(u, t * 1000);
        }
    }

    #[test]
    fn slow_to_shed_and_slow_to_recover() {
        let mut s = Shedder::new(ShedderParams::default());
        run(&mut s, 1.0, 0, 27);
        assert!(s.amount() < 0.0 && s.drop_probability(0, 4) == 0.0, "nothing shed for the first 27 s");
        run(&mut s, 1.0, 28, 150);
        assert_eq!(s.amount(), 1.0, "everything shed 150 s in");
        assert_eq!((s.drop_probability(2, 4), s.drop_probability(3, 4)), (1.0, 0.0), "critical never shed");
        run(&mut s, 0.5, 151, 211);
        assert!(s.amount() > 0.5 && s.amount() < 1.0, "60 s after the drop: {}", s.amount());
        let held = s.amount();
        run(&mut s, 0.75, 212, 300);
        assert_eq!(s.amount(), held, "the dead zone does not move it");
    }

    #[test]
    fn classes_are_shed_least_important_first() {
        let mut s = Shedder::new(ShedderParams::default());
        s.amount = 0.3; // 4 classes: class 0 fully, class 1 at 20%
        let p: Vec<f64> = (0..4).map(|c| s.drop_probability(c, 4)).collect();
        assert_eq!(p[0], 1.0);
        assert!((p[1] - 0.2).abs() < 1e-9);
        assert_eq!((p[2], p[3]), (0.0, 0.0));
    }

    #[test]
    fn a_long_gap_counts_as_before() {
        let mut s = Shedder::new(ShedderParams::default());
        s.update(1.0, 0);
        s.update(1.0, 3_600_000); // an hour later: counts as 28 s
        assert!(s.amount().abs() < 1e-9, "{}", s.amount());
    }
}
