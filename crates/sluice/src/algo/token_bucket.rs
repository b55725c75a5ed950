//! Stripe's token bucket, in exact integer arithmetic.
//!
//! A bucket holds at most `burst` tokens and gains `rate` tokens every `per` ms. Tokens
//! are counted in units of `1/per` of a token: then a bucket gains exactly `rate` units
//! per millisecond, a request of cost `n` takes `n * per` units, and no division ever
//! rounds. This is the same admission rule as GCRA (whose theoretical arrival time is
//! `at + (capacity - tokens) / rate`); it is stored as two integers instead of one
//! because GCRA's single integer would need sub-millisecond precision (`per / rate` is
//! rarely whole), and scaled to whole numbers it outgrows the 2^53 that Lua's doubles
//! count exactly. Here every value stays below `burst * per + rate`, which
//! [`super::Limit::validate`] keeps under 2^53.

use super::Decision;
use crate::time::Millis;

/// One client's bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BucketState {
    /// Tokens in the bucket, in units of `1/per` token.
    pub tokens: u64,
    /// When `tokens` was last brought up to date, in ms since the epoch.
    pub at: Millis,
}

/// A full bucket.
pub fn fresh(per: Millis, burst: u64, now: Millis) -> BucketState {
    BucketState { tokens: burst * per, at: now }
}

/// The bucket refilled up to `now`. A `now` earlier than the stored time (a server whose
/// clock is behind another's) adds nothing and keeps the later time, so skewed clocks
/// cannot mint tokens.
pub fn normalize(s: BucketState, rate: u64, per: Millis, burst: u64, now: Millis) -> BucketState {
    let cap = burst * per;
    if now <= s.at {
        return BucketState { tokens: s.tokens.min(cap), at: s.at };
    }
    let missing = cap.saturating_sub(s.tokens);
    let elapsed = now - s.at;
    // `elapsed * rate >= missing` is `elapsed >= missing / rate` without a division (a
    // product too large to hold is certainly enough)
    let tokens = if elapsed.saturating_mul(rate) >= missing { cap } else { s.tokens + elapsed * rate };
    BucketState { tokens, at: now }
}

/// When the bucket will be full again.
pub fn full_at(s: BucketState, rate: u64, per: Millis, burst: u64) -> Millis {
    s.at + (burst * per).saturating_sub(s.tokens).div_ceil(rate)
}

/// Takes `cost` tokens if the bucket holds them.
pub fn charge(
    s: BucketState,
    rate: u64,
    per: Millis,
    burst: u64,
    cost: u64,
    now: Millis,
) -> (Decision, Option<BucketState>) {
    let need = cost.saturating_mul(per);
    if need <= s.tokens {
        let after = BucketState { tokens: s.tokens - need, at: s.at };
        let remaining = after.tokens / per;
        let d = Decision {
            holds: false,
            allowed: true,
            limit: burst,
            used: burst - remaining,
            remaining,
            reset_at: full_at(after, rate, per, burst),
            retry_after: None,
        };
        (d, (cost > 0).then_some(after))
    } else {
        let d = Decision {
            holds: false,
            allowed: false,
            limit: burst,
            used: burst - s.tokens / per,
            remaining: 0,
            reset_at: full_at(s, rate, per, burst),
            // a cost above the burst never fits: there is no time to retry at
            retry_after: (cost <= burst).then(|| (s.at + (need - s.tokens).div_ceil(rate)).saturating_sub(now)),
        };
        (d, None)
    }
}

/// Puts `cost` tokens back, never above the burst.
pub fn refund(s: BucketState, per: Millis, burst: u64, cost: u64) -> BucketState {
    BucketState { tokens: s.tokens.saturating_add(cost.saturating_mul(per)).min(burst * per), at: s.at }
}

#[cfg(test)]
mod tests {
    use super::*;

    // 10 tokens per second, burst 3
    const R: u64 = 10;
    const P: u64 = 1000;
    const B: u64 = 3;

    fn hit(s: BucketState, now: Millis) -> (Decision, BucketState) {
        let s = normalize(s, R, P, B, now);
        let (d, c) = charge(s, R, P, B, 1, now);
        (d, c.unwrap_or(s))
    }

    #[test]
    fn burst_then_refill_at_the_rate() {
        let mut s = fresh(P, B, 0);
        for left in [2, 1, 0] {
            let (d, n) = hit(s, 0);
            assert!(d.allowed);
            assert_eq!(d.remaining, left);
            s = n;
        }
        let (d, _) = hit(s, 0);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(100)); // one token every 100 ms
        assert_eq!(d.reset_at, 300); // full again after 3 tokens
        let (d, _) = hit(s, 99);
        assert!(!d.allowed);
        let (d, _) = hit(s, 100);
        assert!(d.allowed);
    }

    #[test]
    fn fractional_emission_interval_is_exact() {
        // 3 per second: a token every 333.33 ms, never rounded
        let (r, p, b) = (3, 1000, 1);
        let s = normalize(fresh(p, b, 0), r, p, b, 0);
        let (_, s) = charge(s, r, p, b, 1, 0);
        let s = s.unwrap();
        let (d, _) = charge(normalize(s, r, p, b, 333), r, p, b, 1, 333);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(1));
        let (d, _) = charge(normalize(s, r, p, b, 334), r, p, b, 1, 334);
        assert!(d.allowed);
    }

    #[test]
    fn a_clock_behind_mints_nothing() {
        let s = BucketState { tokens: 0, at: 10_000 };
        assert_eq!(normalize(s, R, P, B, 5_000), s);
    }
}
