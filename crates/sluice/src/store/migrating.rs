//! `store.kind: migrating`: GitHub's move from Memcached to Redis, behind a percentage.
//!
//! Each client's backend is chosen by a stable hash of its tag against `percent`: a
//! client stays on one backend while the percentage holds, and raising the percentage
//! only moves clients from `from` to `to` (lowering it moves them back). The percentage
//! changes live (config reload, `PUT /v1/admin/migration`), without a restart, so a
//! migration can be rolled back at once. A client that moves starts afresh on its new
//! backend: for a window, it may get up to one extra window's worth once.

use super::{Router, Store};
use crate::tag::Tag;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

/// Two stores and the share of clients on the second.
pub struct MigratingStore {
    from: Arc<dyn Store>,
    to: Arc<dyn Store>,
    percent: AtomicU8,
    gauge: metrics::Gauge,
}

impl MigratingStore {
    /// `percent` of clients (0 to 100) on `to`, the rest on `from`.
    pub fn new(from: Arc<dyn Store>, to: Arc<dyn Store>, percent: u8) -> Self {
        let s = Self {
            from,
            to,
            percent: AtomicU8::new(0),
            gauge: metrics::gauge!(crate::telemetry::names::MIGRATION_PERCENT),
        };
        s.set_percent(percent);
        s
    }

    /// The share of clients on `to` now.
    pub fn percent(&self) -> u8 {
        self.percent.load(Ordering::Relaxed)
    }

    /// Moves the share of clients on `to` (capped at 100).
    pub fn set_percent(&self, percent: u8) {
        let p = percent.min(100);
        self.percent.store(p, Ordering::Relaxed);
        self.gauge.set(f64::from(p));
    }

    /// Whether a client is on `to` at `percent`: its bucket (0 to 99, a stable mix of its
    /// tag) is below the percentage.
    pub fn on_new_store(tag: Tag, percent: u8) -> bool {
        crate::hash::percentile(tag.0) < u64::from(percent)
    }
}

impl Router for MigratingStore {
    fn route(&self, tag: Tag) -> &dyn Store {
        if Self::on_new_store(tag, self.percent()) { &*self.to } else { &*self.from }
    }
    fn stores(&self) -> Vec<&dyn Store> {
        vec![&*self.from, &*self.to]
    }
    /// `to` when it can: where the clients end up, so overrides stay when the migration
    /// is over and `to` becomes the store.
    fn registry_home(&self) -> Option<&dyn Store> {
        [&*self.to, &*self.from].into_iter().find(|s| s.keeps_registry())
    }
    fn kind(&self) -> &'static str {
        "migrating"
    }
    fn routing(&self) -> u64 {
        u64::from(self.percent())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tag::Tagger;

    #[test]
    fn stable_and_monotonic() {
        let t = Tagger::new("m");
        let tags: Vec<Tag> = (0..20_000).map(|i| t.tag("d", "user", &i.to_string())).collect();
        for p in [10u8, 50, 90] {
            let on = tags.iter().filter(|&&tag| MigratingStore::on_new_store(tag, p)).count();
            let want = tags.len() * p as usize / 100;
            assert!(on.abs_diff(want) < 400, "{p}%: {on} of {} on the new store", tags.len());
        }
        // raising the percentage only moves clients to the new store
        assert!(
            tags.iter().all(|&tag| !MigratingStore::on_new_store(tag, 30) || MigratingStore::on_new_store(tag, 60))
        );
        assert!(tags.iter().all(|&tag| !MigratingStore::on_new_store(tag, 0)));
        assert!(tags.iter().all(|&tag| MigratingStore::on_new_store(tag, 100)));
    }
}
