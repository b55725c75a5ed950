//! `failure: local`: when the store cannot answer, each instance admits at most its fair
//! part of a limit, counted in process.
//!
//! Fail-open admits without bound while the store is down; fail-closed refuses all. With
//! `local`, an instance counts each client's decisions itself, in windows of the limit's
//! period, and admits up to the limit over the instances it last knew (its fair part):
//! the fleet admits about the limit, however long the outage. What it knows of the fleet
//! comes from a heartbeat: every [`HEARTBEAT`] each instance holds a lease in the store's
//! set of instances (a concurrency limit of the store's own), and the count of leases
//! held is the fleet. An instance that never reached the store knows only itself.
//! Grants an instance holds are spent first, as ever: this decides only what they cannot.

use crate::algo::{Decision, Lease, Limit, Op};
use crate::store::Store;
use crate::tag::{Tag, Tagger};
use crate::time::{Clock, Millis};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// How often an instance says it is there.
pub const HEARTBEAT: Millis = 5_000;

/// How long a heartbeat counts: three missed, and the instance is no longer counted.
const HEARTBEAT_TTL: Millis = 3 * HEARTBEAT;

/// The most clients counted in process at once; past it, the windows that ended go.
const MAX_COUNTED: usize = 100_000;

/// An instance's local counts and what it knows of its fleet.
#[derive(Debug)]
pub struct Fallback {
    instances: AtomicU64,
    counts: Mutex<HashMap<(Tag, u64), (Millis, u64)>>,
    beating: AtomicBool,
}

impl Default for Fallback {
    fn default() -> Self {
        Self { instances: AtomicU64::new(1), counts: Mutex::new(HashMap::new()), beating: AtomicBool::new(false) }
    }
}

impl Fallback {
    /// The instances this one last knew (itself included).
    pub fn instances(&self) -> u64 {
        self.instances.load(Relaxed).max(1)
    }

    /// The decision of `op` by its fair part, counted here: the limit's capacity over
    /// the instances known, in windows of the limit's period aligned to the clock.
    pub(crate) fn decide(&self, tag: Tag, op: &Op, now: Millis) -> Decision {
        let capacity = match op.limit {
            Limit::FixedWindow { limit, .. } | Limit::SlidingWindow { limit, .. } => limit,
            Limit::TokenBucket { rate, .. } => rate,
            Limit::Concurrency { limit, .. } => limit,
        };
        self.decide_within(tag, op, capacity.div_ceil(self.instances()), now)
    }

    /// The decision of `op`, admitting at most `fair` in each window of the limit's
    /// period, counted here (a global limit's part of its region's share:
    /// `crate::regions::Regions::share`).
    pub(crate) fn decide_within(&self, tag: Tag, op: &Op, fair: u64, now: Millis) -> Decision {
        let period = match op.limit {
            Limit::FixedWindow { window, .. } | Limit::SlidingWindow { window, .. } => window,
            Limit::TokenBucket { per, .. } => per,
            Limit::Concurrency { .. } => 1_000,
        };
        let end = (now / period.max(1) + 1) * period.max(1);
        let mut counts = self.counts.lock().expect("fallback lock");
        if counts.len() >= MAX_COUNTED {
            counts.retain(|_, (e, _)| *e > now);
        }
        let (counted_end, used) = counts.entry((tag, op.key)).or_insert((end, 0));
        if *counted_end != end {
            (*counted_end, *used) = (end, 0);
        }
        let allowed = *used + op.cost <= fair || op.shadow;
        if allowed && !op.shadow {
            *used += op.cost;
        }
        let retry_after = (!allowed).then(|| end.saturating_sub(now));
        let remaining = if allowed { fair - (*used).min(fair) } else { 0 };
        Decision { holds: false, allowed, limit: fair, used: *used, remaining, reset_at: end, retry_after }
    }

    /// Keeps this instance in the store's set of instances while this fallback is in use,
    /// and what it knows of the fleet current. Once: a second call does nothing.
    pub fn spawn_heartbeat(self: &Arc<Self>, store: Arc<dyn Store>, tagger: &Tagger, clock: Arc<dyn Clock>) {
        if self.beating.swap(true, Relaxed) {
            return;
        }
        let (me, tag) = (Arc::downgrade(self), tagger.tag("sluice", "instances", "all"));
        let limit = Limit::Concurrency { limit: 1 << 20, lease_ttl: HEARTBEAT_TTL };
        tokio::spawn(async move {
            let mut held: Option<(Lease, Millis)> = None;
            loop {
                let Some(fallback) = me.upgrade() else { return };
                let now = clock.now();
                // a new lease each beat, the old one given back after: a lease taken again
                // keeps its first time, and giving back first would let instances beating
                // at once each miss the others (a count too low: a fair part too large)
                let lease = new_lease();
                let op = Op { key: 1, limit, cost: 1, lease: Some(lease), shadow: false };
                if let Ok(d) = store.apply(tag, &[op], now).await {
                    // this instance's lease before, if the store still counts it
                    let mine = u64::from(held.is_some_and(|(_, at)| at + HEARTBEAT_TTL > now));
                    fallback.instances.store(d.first().map_or(1, |d| d.used.saturating_sub(mine).max(1)), Relaxed);
                    if let Some((old, _)) = held.replace((lease, now)) {
                        let _ = store.release(tag, &[op.key], old, now).await;
                    }
                }
                drop(fallback);
                tokio::time::sleep(std::time::Duration::from_millis(HEARTBEAT)).await;
            }
        });
    }
}

fn new_lease() -> Lease {
    let mut seed = [0u8; 16];
    let _ = getrandom::fill(&mut seed);
    u128::from_le_bytes(seed).max(1)
}
