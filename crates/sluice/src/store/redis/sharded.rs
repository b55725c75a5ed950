//! GitHub's client-side sharding: several replicated Redis groups, each client on one.
//!
//! A client tag goes to the shard with the highest rendezvous score (a keyed mix of tag
//! and shard index). Adding a shard to N moves only the clients whose new highest score
//! is the new shard: about 1/(N+1) of them. A moved client starts afresh on its new shard
//! (its counters stay behind on the old one until they expire): for a window, it may get up
//! to one extra window's worth once; plan shard changes at quiet times.

use super::RedisStore;
use crate::store::{Router, Store};
use crate::tag::Tag;

/// `store.kind: redis_sharded`.
pub struct ShardedRedisStore {
    shards: Vec<RedisStore>,
}

impl ShardedRedisStore {
    /// Shards in a fixed order: the order is part of the placement, keep it stable.
    pub fn new(shards: Vec<RedisStore>) -> Self {
        assert!(!shards.is_empty(), "redis_sharded needs at least one shard");
        Self { shards }
    }

    /// The shard index of a tag.
    pub fn shard_of(tag: Tag, shards: usize) -> usize {
        (0..shards).max_by_key(|&i| crate::hash::rendezvous(tag.0, i as u64)).unwrap_or(0)
    }
}

impl Router for ShardedRedisStore {
    fn route(&self, tag: Tag) -> &dyn Store {
        &self.shards[Self::shard_of(tag, self.shards.len())]
    }
    fn stores(&self) -> Vec<&dyn Store> {
        self.shards.iter().map(|s| s as &dyn Store).collect()
    }
    fn kind(&self) -> &'static str {
        "redis_sharded"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tag::Tagger;

    #[test]
    fn adding_a_shard_moves_about_one_in_n_plus_one() {
        let t = Tagger::new("s");
        let tags: Vec<Tag> = (0..20_000).map(|i| t.tag("d", "user", &i.to_string())).collect();
        for n in 2..6 {
            let moved = tags
                .iter()
                .filter(|&&tag| ShardedRedisStore::shard_of(tag, n) != ShardedRedisStore::shard_of(tag, n + 1))
                .count();
            let expected = tags.len() / (n + 1);
            assert!(
                moved.abs_diff(expected) < expected / 10,
                "{n} -> {}: moved {moved}, expected about {expected}",
                n + 1
            );
            // and every moved client went to the new shard
            assert!(tags.iter().all(|&tag| {
                let (a, b) = (ShardedRedisStore::shard_of(tag, n), ShardedRedisStore::shard_of(tag, n + 1));
                a == b || b == n
            }));
        }
    }

    #[test]
    fn clients_spread_evenly() {
        let t = Tagger::new("s");
        let mut count = [0usize; 4];
        for i in 0..40_000 {
            count[ShardedRedisStore::shard_of(t.tag("d", "user", &i.to_string()), 4)] += 1;
        }
        assert!(count.iter().all(|&c| c.abs_diff(10_000) < 500), "{count:?}");
    }
}
