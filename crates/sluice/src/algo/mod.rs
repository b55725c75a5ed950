//! The pure algorithms: state machines that take `now` and a cost and return a decision.
//!
//! No IO, no async, no clock reads. They are the reference model every store is held to:
//! the memory store runs them under a lock, and the Redis scripts are checked against them
//! by property tests.
//!
//! Each algorithm works in two steps so that several limits can be applied all or
//! nothing:
//! 1. [`Limit::normalize`] brings stored state up to `now` (a window that has passed
//!    restarts, a bucket refills). Normalizing charges nothing, and a normalized state is
//!    safe to store even when the request is refused: that is how a window's reset time
//!    is stored the first time it is reported, so it can never wobble.
//! 2. [`Limit::charge`] tries to take the cost from normalized state.
//!
//! The store normalizes every limit of a client, tries to charge each, and writes the
//! charged states only if every enforced limit allowed; otherwise it writes the
//! normalized ones.

pub(crate) mod concurrency;
pub(crate) mod fixed_window;
pub mod grant;
pub mod overload;
pub mod pool;
pub mod reservation;
pub mod shedder;
pub(crate) mod sliding_window;
pub(crate) mod token_bucket;

use crate::time::Millis;

pub use concurrency::{ConcurrencyState, Lease};
pub use fixed_window::WindowState;
pub use sliding_window::SlidingState;
pub use token_bucket::BucketState;

/// Largest value any limit, cost or product of the two may take.
///
/// Redis runs Lua with double-precision numbers, which are exact integers only up to
/// 2^53. Every store must compute the same answers, so the whole system stays below it.
pub const MAX_EXACT: u64 = (1 << 53) - 1;

/// Longest period a limit may have: 100 years in ms.
pub const MAX_SPAN: Millis = 100 * 365 * 24 * 3600 * 1000;

fn invalid(what: String) -> Result<(), LimitError> {
    Err(LimitError::Invalid(what))
}

/// What one limit allows: the four algorithms and their parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    /// GitHub's fixed window: `limit` per `window` ms, the window starting at the first
    /// hit (or on clock boundaries when `aligned`).
    FixedWindow { limit: u64, window: Millis, aligned: bool },
    /// Stripe's token bucket: `rate` tokens per `per` ms, holding at most `burst`.
    TokenBucket { rate: u64, per: Millis, burst: u64 },
    /// The two-window weighted counter: about `limit` per sliding `window` ms.
    SlidingWindow { limit: u64, window: Millis },
    /// At most `limit` leases held at once; a lease not released is reclaimed after
    /// `lease_ttl` ms.
    Concurrency { limit: u64, lease_ttl: Millis },
}

/// The stored state of one limit for one client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    Window(WindowState),
    Bucket(BucketState),
    Sliding(SlidingState),
    Leases(ConcurrencyState),
}

impl Default for State {
    fn default() -> Self {
        State::Window(WindowState::default())
    }
}

/// The answer for one limit: everything the response headers need, from one state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether this limit admits the request.
    pub allowed: bool,
    /// The quota: requests per window, bucket capacity, or concurrent leases.
    pub limit: u64,
    /// How much of the quota is in use after this decision.
    pub used: u64,
    /// How much is left after this decision. Always 0 when refused for lack of quota.
    pub remaining: u64,
    /// When the quota is whole again, in ms since the epoch. For a fixed window, the
    /// stored reset.
    pub reset_at: Millis,
    /// When refused: how long until the same request could succeed, in ms. On a fixed
    /// window with reservations open, at most until the first of them lapses.
    pub retry_after: Option<Millis>,
    /// Whether reservations hold part of `used` (a fixed window with holds open, see
    /// [`reservation`]): a commit on any instance may give units back at any moment, so
    /// such a refusal is never answered from the near-cache.
    pub holds: bool,
}

/// A limit that is not well formed, or that no store could count exactly.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    #[error("{0}")]
    Invalid(String),
}

impl Limit {
    /// The most one request may cost: the window's limit or the bucket's burst.
    pub fn capacity(&self) -> u64 {
        match *self {
            Limit::FixedWindow { limit, .. }
            | Limit::SlidingWindow { limit, .. }
            | Limit::Concurrency { limit, .. } => limit,
            Limit::TokenBucket { burst, .. } => burst,
        }
    }

    /// The period the quota is stated over, in ms (IETF `w`). For a token bucket, the
    /// time a burst takes to earn back.
    pub fn period(&self) -> Millis {
        match *self {
            Limit::FixedWindow { window, .. } | Limit::SlidingWindow { window, .. } => window,
            Limit::TokenBucket { rate, per, burst } => (burst * per).div_ceil(rate),
            Limit::Concurrency { lease_ttl, .. } => lease_ttl,
        }
    }

    /// A short name of the algorithm, used in keys, metrics and the JSON API.
    pub fn algorithm(&self) -> &'static str {
        match self {
            Limit::FixedWindow { .. } => "fixed_window",
            Limit::TokenBucket { .. } => "token_bucket",
            Limit::SlidingWindow { .. } => "sliding_window",
            Limit::Concurrency { .. } => "concurrency",
        }
    }

    /// Checks that the limit is well formed and that every store can compute it exactly
    /// (see [`MAX_EXACT`]).
    pub fn validate(&self) -> Result<(), LimitError> {
        let fits = |p: Option<u64>| p.is_some_and(|p| p <= MAX_EXACT);
        let (quota, span, exact) = match *self {
            Limit::FixedWindow { limit, window, .. } => (limit, window, true),
            // the weighted count multiplies the previous window's count by a time
            Limit::SlidingWindow { limit, window } => (limit, window, fits(limit.checked_mul(window))),
            // the bucket counts in 1/per of a token, so `burst * per` must be exact
            Limit::TokenBucket { rate, per, burst } => {
                if rate == 0 {
                    return invalid("token_bucket.rate must be at least 1".into());
                }
                (burst, per, fits(burst.checked_mul(per).and_then(|c| c.checked_add(rate))))
            }
            Limit::Concurrency { limit, lease_ttl } => (limit, lease_ttl, true),
        };
        let name = self.algorithm();
        // a fixed window of 0 refuses every request: envoyproxy/ratelimit's way to block
        if quota == 0 && !matches!(self, Limit::FixedWindow { .. }) {
            return invalid(format!(
                "{name} needs a limit of at least 1 (to refuse everything, use a fixed_window of limit 0; \
                 to allow everything, `unlimited: true`)"
            ));
        }
        if span == 0 {
            return invalid(format!("{name} needs a period longer than 0ms"));
        }
        if quota > MAX_EXACT || span > MAX_SPAN {
            return invalid(format!("{name}: the limit must be below 2^53 and the period below 100 years"));
        }
        if !exact {
            return invalid(format!(
                "{name}: limit {quota} over {span}ms is too large to count exactly \
                 (their product must stay below 2^53); lower one of them"
            ));
        }
        Ok(())
    }

    /// A fresh state, as if the client had never been seen, at `now`.
    pub fn fresh(&self, now: Millis) -> State {
        match *self {
            Limit::FixedWindow { window, aligned, .. } => State::Window(fixed_window::fresh(window, aligned, now)),
            Limit::TokenBucket { per, burst, .. } => State::Bucket(token_bucket::fresh(per, burst, now)),
            Limit::SlidingWindow { window, .. } => State::Sliding(sliding_window::fresh(window, now)),
            Limit::Concurrency { .. } => State::Leases(ConcurrencyState::default()),
        }
    }

    /// Step 1: `state` (None when nothing is stored, or stored state of another
    /// algorithm) brought up to `now`. Charges nothing.
    pub fn normalize(&self, state: Option<State>, now: Millis) -> State {
        match (*self, state) {
            (Limit::FixedWindow { window, aligned, .. }, Some(State::Window(s))) => {
                State::Window(fixed_window::normalize(s, window, aligned, now))
            }
            (Limit::TokenBucket { rate, per, burst }, Some(State::Bucket(s))) => {
                State::Bucket(token_bucket::normalize(s, rate, per, burst, now))
            }
            (Limit::SlidingWindow { window, .. }, Some(State::Sliding(s))) => {
                State::Sliding(sliding_window::normalize(s, window, now))
            }
            (Limit::Concurrency { lease_ttl, .. }, Some(State::Leases(s))) => {
                State::Leases(concurrency::normalize(s, lease_ttl, now))
            }
            (limit, _) => limit.fresh(now),
        }
    }

    /// Step 2: try to take `cost` from a normalized state. Returns the decision and, when
    /// allowed, the charged state. `lease` is needed only by concurrency limits.
    pub fn charge(&self, state: &State, cost: u64, lease: Option<Lease>, now: Millis) -> (Decision, Option<State>) {
        match (*self, state) {
            (Limit::FixedWindow { limit, .. }, State::Window(s)) => {
                let (d, s) = fixed_window::charge(*s, limit, cost, now);
                (d, s.map(State::Window))
            }
            (Limit::TokenBucket { rate, per, burst }, State::Bucket(s)) => {
                let (d, s) = token_bucket::charge(*s, rate, per, burst, cost, now);
                (d, s.map(State::Bucket))
            }
            (Limit::SlidingWindow { limit, window }, State::Sliding(s)) => {
                let (d, s) = sliding_window::charge(*s, limit, window, cost, now);
                (d, s.map(State::Sliding))
            }
            (Limit::Concurrency { limit, lease_ttl }, State::Leases(s)) => match lease {
                Some(lease) => {
                    let (d, s) = concurrency::acquire(s, limit, lease_ttl, lease, now);
                    (d, s.map(State::Leases))
                }
                None => (concurrency::status(s, limit, lease_ttl, now), None),
            },
            // normalize() always returns the matching kind; a mismatch means a caller
            // skipped it. Answer from a fresh state rather than panic.
            (limit, _) => limit.charge(&limit.fresh(now), cost, lease, now),
        }
    }

    /// Whether [`Limit::charge`] would admit `cost` on a normalized state: the same
    /// answer, without computing the decision (the all-or-nothing pass needs only this).
    pub fn admits(&self, state: &State, cost: u64, lease: Option<Lease>, now: Millis) -> bool {
        match (*self, state) {
            (Limit::FixedWindow { limit, .. }, State::Window(s)) => s.used.saturating_add(cost) <= limit,
            (Limit::TokenBucket { per, .. }, State::Bucket(s)) => cost.saturating_mul(per) <= s.tokens,
            (Limit::SlidingWindow { limit, window }, State::Sliding(s)) => {
                sliding_window::count(*s, window, now).saturating_add(cost) <= limit
            }
            (Limit::Concurrency { limit, .. }, State::Leases(s)) => match lease {
                Some(l) => s.leases.iter().any(|&(id, _)| id == l) || (s.leases.len() as u64) < limit,
                None => true,
            },
            (limit, _) => limit.charge(state, cost, lease, now).0.allowed,
        }
    }

    /// The decision a read-only status request reports: `cost` 0, nothing written.
    pub fn peek(&self, state: Option<State>, now: Millis) -> Decision {
        let s = self.normalize(state, now);
        self.charge(&s, 0, None, now).0
    }

    /// Gives back `cost` charged in the window identified by `window` (the `reset_at` of
    /// the decision that charged it). A refund never raises the quota above its limit and
    /// never reaches into a later window. Returns None when there is nothing to change.
    pub fn refund(&self, state: State, cost: u64, window: Millis, now: Millis) -> Option<State> {
        match (*self, state) {
            (Limit::FixedWindow { window: w, aligned, .. }, State::Window(s)) => {
                fixed_window::refund(fixed_window::normalize(s, w, aligned, now), cost, window).map(State::Window)
            }
            (Limit::TokenBucket { rate, per, burst }, State::Bucket(s)) => Some(State::Bucket(token_bucket::refund(
                token_bucket::normalize(s, rate, per, burst, now),
                per,
                burst,
                cost,
            ))),
            (Limit::SlidingWindow { window: w, .. }, State::Sliding(s)) => {
                sliding_window::refund(sliding_window::normalize(s, w, now), w, cost, window).map(State::Sliding)
            }
            _ => None,
        }
    }

    /// When stored state for this limit is garbage: nothing about it differs from a fresh
    /// state any more. Stores use it to collect expired state; Redis as the TTL.
    pub fn expires_at(&self, state: &State) -> Millis {
        match (*self, state) {
            (Limit::FixedWindow { .. }, State::Window(s)) => s.resets_at,
            (Limit::TokenBucket { rate, per, burst }, State::Bucket(s)) => token_bucket::full_at(*s, rate, per, burst),
            (Limit::SlidingWindow { window, .. }, State::Sliding(s)) => s.start + 2 * window,
            (Limit::Concurrency { lease_ttl, .. }, State::Leases(s)) => s.latest_expiry(lease_ttl),
            _ => 0,
        }
    }
}

/// One limit to apply for one client: which stored state (`key`, opaque to the
/// algorithm), which limit, and what to take from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    /// Which state under the client's tag this op reads and writes.
    pub key: u64,
    /// The limit to apply.
    pub limit: Limit,
    /// What to charge; 0 reports status without charging.
    pub cost: u64,
    /// For a concurrency limit, the lease to take; None reports status only.
    pub lease: Option<Lease>,
    /// A shadow op is charged and reported like any other, but its refusal neither
    /// refuses the request nor stops the other ops from being charged.
    pub shadow: bool,
}

/// Applies every op of one client, all or nothing: `states[i]` holds what is stored for
/// `ops[i]` and is replaced by what must be written back; one decision per op is pushed
/// onto `out`. If every enforced (non-shadow) op allows, each op's charged state is
/// written; if any refuses, nothing is charged and only normalized states are written (so
/// a window's reset is stored the first time it is reported). The decisions of ops
/// rolled back report the uncharged state.
///
/// This function is the reference model of a store's `apply`: the memory store calls
/// it, and the Redis scripts do the same steps in Lua. It allocates nothing (but a
/// concurrency limit's lease list).
pub fn apply_into(ops: &[Op], states: &mut [Option<State>], now: Millis, out: &mut Vec<Decision>) {
    // pass 1: normalize, and find whether any enforced op refuses
    let mut refused = false;
    for (op, slot) in ops.iter().zip(states.iter_mut()) {
        let normalized = op.limit.normalize(slot.take(), now);
        refused |= !op.shadow && !op.limit.admits(&normalized, op.cost, op.lease, now);
        *slot = Some(normalized);
    }
    // pass 2: charge for real, or report the uncharged state
    for (op, slot) in ops.iter().zip(states.iter_mut()) {
        let Some(normalized) = slot.as_ref() else { continue };
        let (d, charged) = op.limit.charge(normalized, op.cost, op.lease, now);
        match charged {
            Some(c) if !refused => {
                *slot = Some(c);
                out.push(d);
            }
            Some(_) => out.push(op.limit.charge(normalized, 0, None, now).0),
            None => out.push(d),
        }
    }
}

/// [`apply_into`] for a single op on state already stored, updated in place: the memory
/// store's fast path. With one op, all or nothing reduces to "keep the charged state if
/// charged, else the normalized one". Also returns when the resulting state stops
/// mattering ([`Limit::expires_at`]), which for a window or a bucket is the decision's own
/// `reset_at`, so it costs nothing to compute.
pub fn apply_one(op: &Op, state: &mut State, now: Millis) -> (Decision, Millis) {
    match (op.limit, &mut *state) {
        (Limit::TokenBucket { rate, per, burst }, State::Bucket(s)) => {
            let n = token_bucket::normalize(*s, rate, per, burst, now);
            let (d, c) = token_bucket::charge(n, rate, per, burst, op.cost, now);
            *s = c.unwrap_or(n);
            (d, d.reset_at)
        }
        (Limit::FixedWindow { limit, window, aligned }, State::Window(s)) => {
            let n = fixed_window::normalize(*s, window, aligned, now);
            let (d, c) = fixed_window::charge(n, limit, op.cost, now);
            *s = c.unwrap_or(n);
            (d, d.reset_at)
        }
        (limit, state) => {
            let normalized = limit.normalize(Some(std::mem::take(state)), now);
            let (d, c) = limit.charge(&normalized, op.cost, op.lease, now);
            *state = c.unwrap_or(normalized);
            (d, limit.expires_at(state))
        }
    }
}

/// [`apply_into`], returning the decisions.
pub fn apply_all(ops: &[Op], states: &mut [Option<State>], now: Millis) -> Vec<Decision> {
    let mut out = Vec::with_capacity(ops.len());
    apply_into(ops, states, now, &mut out);
    out
}

/// Read-only decisions for `ops` over stored `states`: what a status request reports.
pub fn peek_all(ops: &[Op], states: Vec<Option<State>>, now: Millis) -> Vec<Decision> {
    ops.iter().zip(states).map(|(op, s)| op.limit.peek(s, now)).collect()
}
