//! [`Sharded`]: a hash map split in [`SHARDS`] parts, each shared until written, so a copy
//! costs [`SHARDS`] reference counts and a change then copies one part: a change to a set
//! of 200,000 overrides copies about 3,000 entries, not 200,000.
//!
//! Why: the set an instance holds is swapped whole (readers never lock), so every change
//! makes a new set from the last. With one map, that copy grew with the set and made
//! each `PUT` slower as the set grew.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// Parts a map is split in.
pub(crate) const SHARDS: usize = 64;

/// A hash map whose copy is cheap and whose change copies one part.
#[derive(Debug, Clone)]
pub(crate) struct Sharded<K, V> {
    /// Empty until the first insert (a set has many small maps: one a class of override).
    shards: Vec<Arc<HashMap<K, V>>>,
    len: usize,
}

impl<K, V> Default for Sharded<K, V> {
    fn default() -> Self {
        Self { shards: Vec::new(), len: 0 }
    }
}

/// The part `key` lives in (a fixed hash: which part only spreads the entries).
fn shard<Q: Hash + ?Sized>(key: &Q) -> usize {
    let mut h = DefaultHasher::new();
    key.hash(&mut h);
    (h.finish() % SHARDS as u64) as usize
}

impl<K: Hash + Eq + Clone, V: Clone> Sharded<K, V> {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn get<Q: Hash + Eq + ?Sized>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        self.shards.get(shard(key))?.get(key)
    }

    pub(crate) fn contains_key<Q: Hash + Eq + ?Sized>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
    {
        self.get(key).is_some()
    }

    /// The part `key` lives in, to change: copied first if another set shares it.
    fn part<Q: Hash + ?Sized>(&mut self, key: &Q) -> &mut HashMap<K, V> {
        if self.shards.is_empty() {
            self.shards = (0..SHARDS).map(|_| Arc::new(HashMap::new())).collect();
        }
        Arc::make_mut(&mut self.shards[shard(key)])
    }

    pub(crate) fn get_mut<Q: Hash + Eq + ?Sized>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
    {
        // looked at first, so that a miss copies nothing
        self.get(key)?;
        self.part(key).get_mut(key)
    }

    pub(crate) fn insert(&mut self, key: K, value: V) -> Option<V> {
        let old = self.part(&key).insert(key, value);
        self.len += old.is_none() as usize;
        old
    }

    /// The value of `key`, inserted by `make` when there is none.
    pub(crate) fn get_or_insert_with(&mut self, key: K, make: impl FnOnce() -> V) -> &mut V {
        self.len += !self.contains_key(&key) as usize;
        self.part(&key).entry(key).or_insert_with(make)
    }

    pub(crate) fn remove<Q: Hash + Eq + ?Sized>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        self.get(key)?;
        let old = self.part(key).remove(key);
        self.len -= old.is_some() as usize;
        old
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &V> {
        self.shards.iter().flat_map(|s| s.values())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_shares_every_part_until_one_is_written() {
        let mut a: Sharded<u64, u64> = Sharded::default();
        for k in 0..1_000 {
            a.insert(k, k);
        }
        *a.get_or_insert_with(5_000, || 1) += 1;
        let mut b = a.clone();
        b.insert(1, 10);
        b.remove(&2);
        *b.get_mut(&3).unwrap() = 30;
        let shared = a.shards.iter().zip(&b.shards).filter(|(x, y)| Arc::ptr_eq(x, y)).count();
        assert!(shared >= SHARDS - 3, "only the parts written were copied: {shared} shared");
        assert_eq!((a.get(&1), a.get(&2), a.get(&3), a.len()), (Some(&1), Some(&2), Some(&3), 1_001));
        assert_eq!((b.get(&1), b.get(&2), b.get(&3), b.len()), (Some(&10), None, Some(&30), 1_000));
        assert_eq!(b.get(&5_000), Some(&2));
        assert_eq!(b.values().count(), 1_000);
        assert!(b.remove(&2).is_none() && b.get_mut(&2).is_none() && b.len() == 1_000);
    }
}
