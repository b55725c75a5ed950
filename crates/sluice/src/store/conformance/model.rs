//! The store against the pure algorithms: random sequences of operations replayed on a
//! store and on [`crate::algo`], whose decisions must be identical.

use super::*;

/// One step of a random sequence: what a client does, and how long after the step
/// before it. Clients are numbered; [`replay`] gives each a fresh tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Apply { gap: Millis, client: usize, ops: Vec<Op> },
    Peek { gap: Millis, client: usize, ops: Vec<Op> },
    Refund { gap: Millis, client: usize, op: Op },
    Release { gap: Millis, client: usize, key: u64, lease: Lease },
}

/// Replays `steps` through the store and through the pure algorithms (the reference
/// model) under one clock, and returns the first step whose answers differ. The one
/// random-sequence harness: the suite feeds it seeded sequences, and property tests
/// feed it shrinking ones.
pub async fn replay(s: &dyn Store, steps: &[Step]) -> Result<(), String> {
    let clients = steps.iter().map(Step::client).max().map_or(0, |c| c + 1);
    let tags: Vec<Tag> = (0..clients).map(|_| fresh_tag()).collect();
    let mut model: HashMap<(Tag, u64), State> = HashMap::new();
    let mut now = t0();
    for (i, step) in steps.iter().enumerate() {
        now += step.gap();
        let t = tags[step.client()];
        let store_error = |e| format!("step {i}: the store failed: {e}");
        match step {
            Step::Apply { ops, .. } => {
                let mut states: Vec<Option<State>> = ops.iter().map(|o| model.get(&(t, o.key)).cloned()).collect();
                let want = algo::apply_all(ops, &mut states, now);
                for (o, st) in ops.iter().zip(states) {
                    model.extend(st.map(|st| ((t, o.key), st)));
                }
                let got = s.apply(t, ops, now).await.map_err(store_error)?;
                if got != want {
                    return Err(format!("apply differs at step {i} for {ops:?}:\n store {got:?}\n model {want:?}"));
                }
            }
            Step::Peek { ops, .. } => {
                let want = algo::peek_all(ops, ops.iter().map(|o| model.get(&(t, o.key)).cloned()).collect(), now);
                let got = s.peek(t, ops, now).await.map_err(store_error)?;
                if got != want {
                    return Err(format!("peek differs at step {i} for {ops:?}:\n store {got:?}\n model {want:?}"));
                }
            }
            Step::Refund { op, .. } => {
                let stored = model.get(&(t, op.key)).cloned();
                let window = op.limit.peek(stored.clone(), now).reset_at;
                if let Some(new) = stored.and_then(|st| op.limit.refund(st, op.cost, window, now)) {
                    model.insert((t, op.key), new);
                }
                let r = Refund { key: op.key, limit: op.limit, cost: op.cost, window };
                s.refund(t, &[r], now).await.map_err(store_error)?;
            }
            Step::Release { key, lease, .. } => {
                let want = match model.get_mut(&(t, *key)) {
                    Some(State::Leases(l)) => algo::concurrency::release(l, *lease),
                    _ => false,
                };
                let got = s.release(t, &[*key], *lease, now).await.map_err(store_error)?;
                if got != want {
                    return Err(format!("release differs at step {i}: store {got}, model {want}"));
                }
            }
        }
    }
    Ok(())
}

impl Step {
    fn gap(&self) -> Millis {
        match self {
            Step::Apply { gap, .. } | Step::Peek { gap, .. } | Step::Refund { gap, .. } | Step::Release { gap, .. } => {
                *gap
            }
        }
    }

    fn client(&self) -> usize {
        match self {
            Step::Apply { client, .. }
            | Step::Peek { client, .. }
            | Step::Refund { client, .. }
            | Step::Release { client, .. } => *client,
        }
    }
}

/// The limits of random sequences, state key = index: every algorithm, windows aligned
/// and not, a bucket whose rate does not divide its period, a sliding window of 1; the
/// concurrency limit last ([`LEASES`]).
pub const LIMITS: [Limit; 6] = [
    Limit::FixedWindow { limit: 7, window: 2_000, aligned: false },
    Limit::FixedWindow { limit: 4, window: 1_500, aligned: true },
    Limit::TokenBucket { rate: 7, per: 3_000, burst: 4 },
    Limit::SlidingWindow { limit: 6, window: 1_000 },
    Limit::SlidingWindow { limit: 1, window: 700 },
    Limit::Concurrency { limit: 2, lease_ttl: 1_200 },
];

/// The state key of [`LIMITS`]' concurrency limit.
pub const LEASES: u64 = 5;

/// The op on [`LIMITS`]`[key]`; for the concurrency limit, taking `lease`.
pub fn op_on(key: u64, cost: u64, shadow: bool, lease: Lease) -> Op {
    let limit = LIMITS[key as usize];
    let lease = matches!(limit, Limit::Concurrency { .. }).then_some(lease);
    Op { key, limit, cost, lease, shadow }
}

/// A small deterministic generator (xorshift), so a failing sequence can be replayed
/// from its seed (which must not be 0).
pub struct Rng(pub u64);
impl Rng {
    /// The next number below `n`.
    pub fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// 400 steps of apply, peek, refund and release by two clients over [`LIMITS`], the
/// clock moving forward irregularly, from `seed`.
pub fn steps_from_seed(seed: u64) -> Vec<Step> {
    let mut rng = Rng(seed | 1);
    let mut steps = Vec::new();
    for _ in 0..400 {
        let gap = rng.next(3) * rng.next(400);
        let client = rng.next(2) as usize;
        let mut ops: Vec<Op> = Vec::new();
        for _ in 0..1 + rng.next(3) {
            let k = rng.next(LIMITS.len() as u64);
            let (cost, shadow, lease) = (rng.next(3), rng.next(5) == 0, 1 + rng.next(4) as u128);
            // one state per key: a call naming a key twice is not meaningful
            if !ops.iter().any(|o| o.key == k) {
                ops.push(op_on(k, cost, shadow, lease));
            }
        }
        steps.push(match rng.next(10) {
            0..6 => Step::Apply { gap, client, ops },
            6..8 => Step::Peek { gap, client, ops },
            8 => Step::Refund { gap, client, op: ops[0] },
            _ => Step::Release { gap, client, key: LEASES, lease: 1 + rng.next(4) as u128 },
        });
    }
    steps
}

/// Random sequences of apply, peek, refund and release give the same answers from the
/// store as from the pure algorithms (five seeds).
pub async fn sequence_matches_model(s: &dyn Store) {
    for seed in [1, 7, 42, 1234, 99991] {
        if let Err(e) = replay(s, &steps_from_seed(seed)).await {
            panic!("seed {seed}: {e}");
        }
    }
}
