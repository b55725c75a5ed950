//! Regions that must agree: on each global rule's limit and window, and on not sharing
//! one regional store.
//!
//! A global rule is one limit only if every region configures it alike: a region asking
//! the global store for units under 400 while another asks under 200 lets the fleet
//! admit up to 400. At every beat ([`super::BEAT`]) each region says, in the global
//! store, which limit and window it has for each of its global rules (a lease whose id
//! carries them, in a state of the rule's own); the leases held are every region's
//! variant. When they differ the instance logs it (naming the rule and every variant),
//! counts the rules in `sluice_region_disagreements`, and asks for units under the
//! smallest limit of those with its window: the fleet never passes the smallest limit
//! any region configured. (A window that differs cannot be mended so: each window length
//! is a state of its own; it is logged.)
//!
//! Two regions on one regional store would merge their pools silently: each region also
//! beats in its own store, and more than one region there is logged.

use super::Regions;
use crate::algo::{Lease, Limit};
use crate::rules::GlobalRule;
use crate::store::{Store, StoreError};
use crate::time::Millis;
use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;

/// The key, in a regional store's beats (`outage::beat_in`), of the regions beating there
/// (a global rule's variants are keyed by its name's hash, 3 and up).
const REGIONS_HERE: u64 = 2;

/// The limit and window pairs the regions configure for one global rule, sorted.
pub type Variants = Vec<(u64, Millis)>;

/// A rule's state key in the global store: its name's hash.
fn rule_key(name: &str) -> u64 {
    use std::hash::Hasher;
    let mut h = siphasher::sip::SipHasher13::new_with_keys(0x7275_6c65_7321, 0);
    h.write(name.as_bytes());
    h.finish().max(3)
}

/// A variant's lease in beat `n`: the limit in the high 64 bits, the window in the next
/// 40, the beat's low 24 bits last (so every beat's lease is new, as a region's is).
fn variant_lease(limit: u64, window: Millis, n: u64) -> Lease {
    ((limit as u128) << 64 | ((window as u128) & 0xff_ffff_ffff) << 24 | (n as u128 & 0xff_ffff)).max(1)
}

/// The limit and window a variant's lease carries.
fn variant_of(lease: Lease) -> (u64, Millis) {
    ((lease >> 64) as u64, ((lease >> 24) & 0xff_ffff_ffff) as Millis)
}

impl Regions {
    /// The global rules this instance configures (its engine's, at each build or reload).
    pub fn set_rules(&self, rules: Vec<GlobalRule>) {
        *self.rules.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = rules;
    }

    /// The limit to ask the global store for units under, for a client of `limit`: the
    /// smallest any region configures for a rule this instance has at `limit` (same
    /// window), once the beats have said the regions differ; `limit` otherwise.
    pub(super) fn agreed(&self, limit: &Limit) -> Limit {
        let Limit::FixedWindow { limit: l, window, aligned } = *limit else { return *limit };
        let agreed = self.agreed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match agreed.get(&(l, window)) {
            Some(&smallest) => Limit::FixedWindow { limit: smallest.min(l), window, aligned },
            None => *limit,
        }
    }

    /// Rules whose regions were found to disagree at the last beat.
    pub fn disagreements(&self) -> u64 {
        self.stats.disagreements.load(Relaxed)
    }

    /// Says, in the global store, each global rule's limit and window here, and reads
    /// every region's (see the module's comment); then, in the region's own store, that
    /// this region is there. Part of a beat (`n`: the beat's number).
    pub(super) async fn agree(&self, n: u64, now: Millis) {
        let rules = self.rules.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let (mut agreed, mut disagreeing) = (HashMap::new(), 0);
        // every rule at once: a beat costs a few round trips, however many rules
        let found = futures_util::future::join_all(rules.iter().map(|rule| self.variants(rule, n, now))).await;
        for (rule, variants) in rules.iter().zip(found) {
            let Some(variants) = variants else { continue };
            if variants.len() < 2 {
                continue;
            }
            disagreeing += 1;
            let same_window = variants.iter().filter(|(_, w)| *w == rule.window);
            let smallest = same_window.map(|(l, _)| *l).min().unwrap_or(rule.limit);
            agreed.insert((rule.limit, rule.window), smallest);
            if self
                .told
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert((rule.name.clone(), variants.clone()))
            {
                tracing::warn!(
                    rule = %rule.name,
                    here = %format!("{} per {} ms", rule.limit, rule.window),
                    variants = %variants.iter().map(|(l, w)| format!("{l} per {w} ms")).collect::<Vec<_>>().join(", "),
                    asked_under = smallest,
                    "regions disagree on a global rule's limit or window: units are asked for under the smallest \
                     limit of this window, so the fleet never passes it; a window that differs is a limit of its own \
                     (give every region the same rules)"
                );
            }
        }
        *self.agreed.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = agreed;
        self.stats.disagreements.store(disagreeing, Relaxed);
        self.metrics.disagreements.set(disagreeing as f64);
        self.beat_here(n, now).await;
    }

    /// Takes this beat's lease of `rule`'s variant here, gives back the one before, and
    /// reads every variant held: distinct (limit, window) pairs, sorted; `None` if the
    /// global store failed.
    async fn variants(&self, rule: &GlobalRule, n: u64, now: Millis) -> Option<Variants> {
        let key = rule_key(&rule.name);
        let (lease, before) =
            (variant_lease(rule.limit, rule.window, n), variant_lease(rule.limit, rule.window, n.saturating_sub(1)));
        super::outage::beat_in(&*self.global, (key, lease, &[before]), now).await.ok()?;
        fleet_variants(&*self.global, &rule.name, now).await.ok()
    }

    /// Says in the region's own store that this region is there, and warns (once) when
    /// another region beats there too: their pools would merge.
    async fn beat_here(&self, n: u64, now: Millis) {
        let lease = super::outage::beat_lease(&self.name, n);
        let before = super::outage::befores(n, |k| super::outage::beat_lease(&self.name, k));
        let Ok(regions) = super::outage::beat_in(&*self.local, (REGIONS_HERE, lease, &before), now).await else {
            return;
        };
        if regions > 1 && !self.shared_told.swap(true, Relaxed) {
            tracing::warn!(
                region = %self.name,
                regions,
                "another region uses this region's own store: their pools of global limits merge (each region needs \
                 a store of its own)"
            );
        }
    }
}

/// What the regions running now configure for the global rule `name`, as their last
/// beats said in `global`: every distinct limit and window pair, sorted (none when no
/// region beats). Reads only: `sluice config check --online` compares a file with it.
pub async fn fleet_variants(global: &dyn Store, name: &str, now: Millis) -> Result<Variants, StoreError> {
    let held = global.leases(super::outage::REGIONS, rule_key(name), 3 * super::BEAT, now).await?;
    let mut variants: Variants = held.leases.iter().map(|&(l, _)| variant_of(l)).collect();
    variants.sort_unstable();
    variants.dedup();
    Ok(variants)
}
