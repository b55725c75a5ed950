//! Property tests of the pure algorithms against simple reference models.

use proptest::prelude::*;
use sluice::algo::{Decision, Limit, State};

/// Applies one hit the way a store does: normalize, charge, keep the charged state.
fn hit(limit: Limit, state: Option<State>, cost: u64, now: u64) -> (Decision, State) {
    let s = limit.normalize(state, now);
    let (d, c) = limit.charge(&s, cost, None, now);
    (d, c.unwrap_or(s))
}

/// One small limit of each algorithm.
const ONE_OF_EACH: [Limit; 4] = [
    Limit::FixedWindow { limit: 5, window: 1_000, aligned: true },
    Limit::TokenBucket { rate: 3, per: 1_000, burst: 5 },
    Limit::SlidingWindow { limit: 5, window: 1_000 },
    Limit::Concurrency { limit: 2, lease_ttl: 900 },
];

/// Times that only move forward: (gap, cost) pairs.
fn steps() -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop::collection::vec((0u64..700, 0u64..4), 1..300)
}

proptest! {
    /// A fixed window never admits more than its limit per window, keeps its reset for the
    /// whole window, and its remaining never rises within a window.
    #[test]
    fn fixed_window_model(limit in 1u64..20, window in 1u64..5_000, aligned: bool, start in 0u64..1_000_000, steps in steps()) {
        let l = Limit::FixedWindow { limit, window, aligned };
        let (mut now, mut state) = (start, None);
        // the model: (window end, admitted in it)
        let mut model: Option<(u64, u64)> = None;
        let mut last_remaining = None;
        for (gap, cost) in steps {
            now += gap;
            let (d, s) = hit(l, state, cost, now);
            state = Some(s);
            let (end, used) = match model {
                Some((end, used)) if now < end => (end, used),
                _ => {
                    last_remaining = None;
                    (if aligned { (now / window + 1) * window } else { now + window }, 0)
                }
            };
            prop_assert_eq!(d.reset_at, end, "the reset is the stored window end");
            let admit = used + cost <= limit;
            prop_assert_eq!(d.allowed, admit);
            let used = if admit { used + cost } else { used };
            prop_assert!(used <= limit);
            model = Some((end, used));
            if !d.allowed {
                prop_assert_eq!(d.remaining, 0, "a refusal says remaining 0");
            } else {
                prop_assert_eq!(d.remaining, limit - used);
                if let Some(prev) = last_remaining {
                    prop_assert!(d.remaining <= prev, "remaining rose within a window");
                }
                last_remaining = Some(d.remaining);
            }
        }
    }

    /// The token bucket admits exactly what GCRA (an independent formulation, in exact
    /// rational time) admits, so it never refuses when the model has tokens; and over any
    /// interval of length t it admits at most `burst + rate * t / per`.
    #[test]
    fn token_bucket_model(rate in 1u64..50, per in 1u64..5_000, burst in 1u64..20, start in 0u64..1_000_000, steps in steps()) {
        let l = Limit::TokenBucket { rate, per, burst };
        // GCRA in units of 1/rate ms: emission interval `per`, tolerance `burst * per`
        let (rate128, per128, burst128) = (rate as u128, per as u128, burst as u128);
        let mut tat: u128 = 0;
        let (mut now, mut state) = (start, None);
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for (gap, cost) in steps {
            now += gap;
            let (d, s) = hit(l, state, cost, now);
            state = Some(s);
            let now_s = now as u128 * rate128;
            let new_tat = tat.max(now_s) + cost as u128 * per128;
            let model_allows = new_tat - now_s <= burst128 * per128;
            prop_assert_eq!(d.allowed, model_allows, "at {} cost {}", now, cost);
            if model_allows {
                tat = new_tat;
                admitted.push((now, cost));
            } else if cost > burst {
                prop_assert_eq!(d.retry_after, None, "an impossible cost has no retry time");
            } else {
                // retry_after is exact: the model admits then and not a millisecond before
                let wait = d.retry_after.unwrap() as u128;
                let at = |t: u128| tat.max(t * rate128) + cost as u128 * per128 - t * rate128 <= burst128 * per128;
                prop_assert!(at(now as u128 + wait));
                prop_assert!(wait == 0 || !at(now as u128 + wait - 1));
            }
        }
        for (i, &(t0, _)) in admitted.iter().enumerate() {
            let mut sum = 0u128;
            for &(t1, c) in &admitted[i..] {
                sum += c as u128;
                // sum <= burst + rate * (t1 - t0) / per, multiplied out by per
                prop_assert!(sum * per128 <= burst128 * per128 + rate128 * (t1 - t0) as u128);
            }
        }
    }

    /// Cost 0 never charges, whatever the algorithm and state.
    #[test]
    fn cost_zero_never_charges(kind in 0usize..3, start in 0u64..1_000_000, steps in steps()) {
        let l = [
            Limit::FixedWindow { limit: 5, window: 1_000, aligned: false },
            Limit::TokenBucket { rate: 2, per: 1_000, burst: 5 },
            Limit::SlidingWindow { limit: 5, window: 1_000 },
        ][kind];
        let (mut now, mut state) = (start, None);
        for (gap, cost) in steps {
            now += gap;
            let before = l.peek(state.clone(), now);
            let (d, s) = hit(l, state.clone(), 0, now);
            prop_assert!(d.allowed);
            prop_assert_eq!(d.remaining, before.remaining);
            prop_assert_eq!(l.peek(Some(s), now), before);
            state = Some(hit(l, state, cost, now).1);
        }
    }

    /// A cost above the capacity is never admitted, even from a full quota.
    #[test]
    fn cost_above_capacity_never_admitted(burst in 1u64..100, extra in 1u64..100, now in 0u64..1_000_000) {
        for l in [
            Limit::TokenBucket { rate: 10, per: 1_000, burst },
            Limit::FixedWindow { limit: burst, window: 1_000, aligned: false },
            Limit::SlidingWindow { limit: burst, window: 1_000 },
        ] {
            let d = hit(l, None, burst + extra, now).0;
            prop_assert!(!d.allowed);
            prop_assert_eq!(d.retry_after, None);
        }
    }

    /// The sliding window admits at most its limit in any one aligned window, and its
    /// retry_after is exact when nothing else happens.
    #[test]
    fn sliding_window_bounds(limit in 1u64..20, window in 1u64..3_000, start in 0u64..1_000_000, steps in steps()) {
        let l = Limit::SlidingWindow { limit, window };
        let (mut now, mut state) = (start, None);
        let mut per_window = std::collections::HashMap::new();
        for (gap, cost) in steps {
            now += gap;
            let (d, s) = hit(l, state.clone(), cost, now);
            if d.allowed {
                *per_window.entry(now / window).or_insert(0) += cost;
                prop_assert!(per_window[&(now / window)] <= limit);
            } else if cost > limit {
                prop_assert_eq!(d.retry_after, None);
            } else {
                let wait = d.retry_after.unwrap();
                prop_assert!(hit(l, state.clone(), cost, now + wait).0.allowed, "retry_after too short");
                if wait > 0 {
                    prop_assert!(!hit(l, state.clone(), cost, now + wait - 1).0.allowed, "retry_after too long");
                }
            }
            state = Some(s);
        }
    }
}

proptest! {
    /// `admits` (the all-or-nothing pass's shortcut) agrees with `charge` everywhere.
    #[test]
    fn admits_agrees_with_charge(kind in 0usize..4, start in 0u64..1_000_000, steps in steps()) {
        let l = ONE_OF_EACH[kind];
        let (mut now, mut state) = (start, None);
        for (i, (gap, cost)) in steps.into_iter().enumerate() {
            now += gap;
            let s = l.normalize(state, now);
            let lease = (kind == 3 && cost > 0).then_some((i % 4) as u128);
            let (d, c) = l.charge(&s, cost, lease, now);
            prop_assert_eq!(l.admits(&s, cost, lease, now), d.allowed);
            state = Some(c.unwrap_or(s));
        }
    }
}

proptest! {
    /// The single-op fast path ([`sluice::algo::apply_one`]) is the all-or-nothing model
    /// for one op: same decisions, same stored state, and the expiry it reports is
    /// [`Limit::expires_at`] of that state.
    #[test]
    fn apply_one_is_apply_all_for_one_op(kind in 0usize..4, shadow: bool, start in 0u64..1_000_000, steps in steps()) {
        let limit = ONE_OF_EACH[kind];
        let mut now = start;
        let mut model = [Some(limit.fresh(now))];
        let mut fast = limit.fresh(now);
        for (i, (gap, cost)) in steps.into_iter().enumerate() {
            now += gap;
            let lease = (kind == 3 && cost > 0).then_some((i % 4) as u128);
            let op = sluice::algo::Op { key: 1, limit, cost, lease, shadow };
            let want = sluice::algo::apply_all(&[op], &mut model, now);
            let (got, expires_at) = sluice::algo::apply_one(&op, &mut fast, now);
            prop_assert_eq!(got, want[0]);
            prop_assert_eq!(Some(&fast), model[0].as_ref());
            prop_assert_eq!(expires_at, limit.expires_at(&fast));
        }
    }
}

/// One step of a reservation script: reserve `units`, commit the `pick`-th open one
/// with `actual`, or let `gap` ms pass.
#[derive(Debug, Clone)]
enum Step {
    Reserve { units: u64, ttl: u64 },
    Commit { pick: usize, actual: u64 },
    Wait { gap: u64 },
}

fn reservation_steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        (0u64..40, 1u64..3_000).prop_map(|(units, ttl)| Step::Reserve { units, ttl }),
        (0usize..8, 0u64..60).prop_map(|(pick, actual)| Step::Commit { pick, actual }),
        (0u64..900).prop_map(|gap| Step::Wait { gap }),
    ];
    prop::collection::vec(step, 1..200)
}

proptest! {
    /// Reservations against a reference ledger: the window's count is always what was
    /// committed plus what is held; a reservation is admitted only when that leaves the
    /// count within the limit; so the count passes the limit by no more than the
    /// underestimates of the commits in the window; an orphan's units come back at its
    /// deadline.
    #[test]
    fn reservations_never_overspend_past_the_underestimates(limit in 1u64..200, steps in reservation_steps()) {
        use sluice::algo::WindowState;
        use sluice::algo::reservation::{self, Ledger, Settled};
        let window = (10_000, false);
        let (mut now, mut next_id) = (1_000_000u64, 0u64);
        let (mut s, mut ledger) = reservation::normalize(WindowState::default(), Ledger::default(), window, now);
        // the reference: per window, committed units and their underestimates; open holds
        let (mut committed, mut under) = (0u64, 0u64);
        let mut open: Vec<(u64, u64, u64)> = Vec::new();
        for step in steps {
            match step {
                Step::Wait { gap } => now += gap,
                Step::Reserve { units, ttl } => {
                    next_id += 1;
                    let (d, next) = reservation::reserve(s, &ledger, limit, (next_id, units, ttl), now);
                    let held: u64 = open.iter().map(|o| o.1).sum();
                    prop_assert_eq!(d.allowed, committed + held + units <= limit);
                    if let Some((ns, hold)) = next {
                        s = ns;
                        ledger.open.extend(hold);
                        // a reservation of nothing holds nothing: its commit is a report
                        if units > 0 {
                            open.push((next_id, units, now + ttl));
                        }
                    }
                }
                Step::Commit { pick, actual } => {
                    let Some(&(id, held, _)) = open.get(pick) else { continue };
                    let settled;
                    (settled, s, ledger) = reservation::commit(s, ledger, id, actual, now);
                    prop_assert_eq!(settled, Settled::Committed { held });
                    open.retain(|o| o.0 != id);
                    committed += actual;
                    under += actual.saturating_sub(held);
                }
            }
            let before = s.resets_at;
            (s, ledger) = reservation::normalize(s, ledger, window, now);
            if s.resets_at != before {
                (committed, under) = (0, 0);
                open.clear();
            }
            open.retain(|o| o.2 > now);
            let held: u64 = open.iter().map(|o| o.1).sum();
            prop_assert_eq!(s.used, committed + held, "the count is committed plus held");
            prop_assert!(s.used <= limit + under, "{} past {} + {}", s.used, limit, under);
            prop_assert_eq!(ledger.held(), held);
        }
    }
}
