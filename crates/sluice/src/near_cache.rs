//! The near-cache of denials: what keeps the store calm when an abusive client floods.
//!
//! Stripe's document tells of scraping surges "orders of magnitude over allowed limits"
//! that pushed their Redis over. A client refused until a known time (a window's stored
//! reset, a bucket's or sliding window's exact `retry_after`) is refused from process
//! memory until then, without a store call.
//!
//! It never refuses what the store would allow: an entry only answers for a cost at least
//! as large as the one refused (quota only grows back with time), never for concurrency
//! limits (a release frees a place at any moment) nor for a window with reservations open
//! (a commit frees units at any moment, on any instance: [`Decision::holds`]), and a
//! refund, commit or report through this process drops the entry. A refund through
//! another process is not seen here: that client may wait until the cached time, never
//! longer than the store said. Bounded: when a shard is full, its expired
//! entries are dropped (a scan of the shard, at most once a second: during the floods the
//! cache is for, each new refusal would scan it), and while it stays full nothing new is
//! cached there.

use crate::algo::{Decision, Limit, Op};
use crate::tag::Tag;
use crate::time::Millis;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

struct Entry {
    until: Millis,
    min_cost: u64,
    decision: Decision,
}

const SHARDS: usize = 16;

/// How often a full shard drops its expired entries.
const SWEEP_EVERY: Millis = 1_000;

/// A bounded cache of refusals.
pub struct NearCache {
    shards: Vec<Mutex<HashMap<(u128, u64), Entry>>>,
    per_shard: usize,
    /// When each shard, full, may next be swept.
    sweeps: Vec<crate::time::Throttle>,
    hits: AtomicU64,
    /// The generation of the overrides the entries were cached under (see [`NearCache::sync`]).
    generation: AtomicU64,
    /// The store's routing the entries were cached under.
    routing: AtomicU64,
}

impl NearCache {
    /// A cache of at most about `capacity` refusals.
    pub fn new(capacity: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: capacity.div_ceil(SHARDS).max(1),
            sweeps: (0..SHARDS).map(|_| Default::default()).collect(),
            hits: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            routing: AtomicU64::new(0),
        }
    }

    /// Refusals answered from the cache so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    fn shard(&self, tag: Tag) -> std::sync::MutexGuard<'_, HashMap<(u128, u64), Entry>> {
        self.shards[Self::shard_of(tag)].lock().unwrap_or_else(|p| p.into_inner())
    }

    fn shard_of(tag: Tag) -> usize {
        (tag.0 >> 64) as usize % SHARDS
    }

    fn cacheable(op: &Op) -> bool {
        !op.shadow && op.cost > 0 && !matches!(op.limit, Limit::Concurrency { .. })
    }

    /// The refusal `op` would get now, if one is cached.
    pub fn get(&self, tag: Tag, op: &Op, now: Millis) -> Option<Decision> {
        if !Self::cacheable(op) {
            return None;
        }
        let shard = self.shard(tag);
        let e = shard.get(&(tag.0, op.key))?;
        if now >= e.until || op.cost < e.min_cost || e.decision.limit != op.limit.capacity() {
            return None;
        }
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(Decision { retry_after: Some(e.until - now), ..e.decision })
    }

    /// Remembers a refusal of `op` until its retry time.
    pub fn put(&self, tag: Tag, op: &Op, d: &Decision, now: Millis) {
        let Some(wait) = d.retry_after.filter(|&w| w > 0 && !d.allowed && !d.holds && Self::cacheable(op)) else {
            return;
        };
        let mut shard = self.shard(tag);
        if shard.len() >= self.per_shard && !shard.contains_key(&(tag.0, op.key)) {
            if self.sweeps[Self::shard_of(tag)].due(now, SWEEP_EVERY) {
                shard.retain(|_, e| e.until > now);
            }
            if shard.len() >= self.per_shard {
                return;
            }
        }
        shard.insert((tag.0, op.key), Entry { until: now + wait, min_cost: op.cost, decision: *d });
    }

    /// Drops every entry when `generation` (of [`crate::overrides::Overrides`]) moved: a
    /// client reset, or overrides changed, on some instance of the fleet; or when
    /// `routing` (the store's [`crate::store::Store::routing`]) moved: clients moved to
    /// another backend, which holds none of the counts the entries came from. Costs two
    /// atomic loads when nothing moved.
    pub fn sync(&self, generation: u64, routing: u64) {
        if self.generation.load(Ordering::Acquire) == generation && self.routing.load(Ordering::Acquire) == routing {
            return;
        }
        self.generation.store(generation, Ordering::Release);
        self.routing.store(routing, Ordering::Release);
        for s in &self.shards {
            s.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
    }

    /// Drops what is cached for these states (after a refund).
    pub fn forget(&self, tag: Tag, keys: impl Iterator<Item = u64>) {
        let mut shard = self.shard(tag);
        for k in keys {
            shard.remove(&(tag.0, k));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FW: Limit = Limit::FixedWindow { limit: 5, window: 1000, aligned: false };

    fn denied(retry: u64) -> Decision {
        Decision {
            holds: false,
            allowed: false,
            limit: 5,
            used: 5,
            remaining: 0,
            reset_at: 2000,
            retry_after: Some(retry),
        }
    }

    #[test]
    fn answers_only_what_the_store_would_refuse() {
        let c = NearCache::new(100);
        let op = Op { key: 1, limit: FW, cost: 2, lease: None, shadow: false };
        c.put(Tag(1), &op, &denied(500), 1500);
        assert_eq!(c.get(Tag(1), &op, 1700).unwrap().retry_after, Some(300));
        assert!(c.get(Tag(1), &Op { cost: 1, ..op }, 1700).is_none(), "a smaller cost may fit");
        assert!(c.get(Tag(1), &op, 2000).is_none(), "not past the store's retry time");
        assert!(c.get(Tag(2), &op, 1700).is_none());
        c.forget(Tag(1), [1].into_iter());
        assert!(c.get(Tag(1), &op, 1700).is_none(), "a refund drops the entry");
        let lease = Op { limit: Limit::Concurrency { limit: 1, lease_ttl: 1000 }, lease: Some(1), ..op };
        c.put(Tag(1), &lease, &denied(500), 1500);
        assert!(c.get(Tag(1), &lease, 1600).is_none(), "concurrency refusals are never cached");
        c.put(Tag(1), &op, &denied(500), 1500);
        c.sync(0, 0);
        assert!(c.get(Tag(1), &op, 1700).is_some(), "the same generation keeps entries");
        c.sync(1, 0);
        assert!(c.get(Tag(1), &op, 1700).is_none(), "a new generation drops them");
        c.put(Tag(1), &op, &denied(500), 1500);
        c.sync(1, 0);
        assert!(c.get(Tag(1), &op, 1700).is_some());
        c.sync(1, 100);
        assert!(c.get(Tag(1), &op, 1700).is_none(), "a new routing (a migration moved) drops them");
    }

    #[test]
    fn bounded() {
        let c = NearCache::new(16);
        let op = Op { key: 1, limit: FW, cost: 1, lease: None, shadow: false };
        for t in 0..1000u128 {
            c.put(Tag(t << 64), &op, &denied(500), 0);
        }
        let held: usize = c.shards.iter().map(|s| s.lock().unwrap().len()).sum();
        assert!(held <= 16, "{held}");
        // expired, they make room, once a second: not on every refusal of a flood (the
        // tags below all fall in shard 0, whose first sweep was at 0)
        let (fresh, next) = (Tag(2000 << 64), Tag(2016 << 64));
        c.put(fresh, &op, &denied(500), 1_100);
        assert!(c.get(fresh, &op, 1_100).is_some(), "the expired entries were swept");
        c.put(next, &op, &denied(500), 1_700);
        assert!(c.get(next, &op, 1_700).is_none(), "not swept again within the second");
        c.put(next, &op, &denied(500), 2_200);
        assert!(c.get(next, &op, 2_200).is_some(), "swept a second later");
    }
}
