//! One limit across regions when a store fails or forgets.
//!
//! - **The region's own store down, the global store answering.** A global limit whose
//!   rule says `failure: local` is decided on the global store's window itself: each
//!   decision is charged there (one cross-region round trip a decision, for the length of
//!   the outage). Exact: the global store's count is the fleet's, and what the region
//!   held before the outage stays granted there, so the regions together never pass the
//!   limit. (Counting in process instead, at the limit over the region's instances, would
//!   let the region admit a whole limit beside what the other regions take.)
//! - **The global store down.** A client with units in its region's pool spends them; one
//!   with none has the rule's `failure` decide, and `local` admits at most the region's
//!   share: the limit over the regions that said lately, in the global store, that they
//!   are there ([`BEAT`]), less what the region's pool held of the window when last
//!   read, split between the region's instances. In a window that starts during the
//!   outage no pool holds anything, and the regions' shares sum to the limit.
//! - **The global store losing its count** (`FLUSHALL`, a restart without persistence, a
//!   failover to an empty replica). Each grant names its window's count as the global
//!   store keeps it after the grant; a region whose pool holds more of that window than
//!   the count says (all it was granted there, spent or not) knows the count was lost:
//!   it logs it, counts it (`sluice_region_lost_units_total`), and asks the global store
//!   for what it holds again (declares it again), so that the global store grants no one
//!   those units a second time. The other regions declare theirs at their next take in
//!   that window; until then what they hold is not counted there: the window of the loss
//!   can pass the limit by what the other regions held in it (spent or not), never by
//!   more, and the windows after it start afresh.
//! - **A reset** (`sluice admin reset`) of a client on a global limit is a loss on
//!   purpose: the global store forgets its count of the window, and the resetting
//!   region its pool. It leaves a mark of the reset in the global store, so the other
//!   regions, finding the count below what they hold, declare it again without taking
//!   it for lost data: the client starts afresh with the limit less what the other
//!   regions hold of the window (spent or not), once they have declared it. Before they
//!   ask again (a region told lately that the window was spent does not ask for a
//!   horizon), the resetting region may take the whole limit: the reset window's
//!   admissions after the reset pass the limit by at most what the other regions held
//!   unspent then, as for a loss.

use super::Regions;
use crate::algo::grant::{Granted, Open};
use crate::algo::pool;
use crate::algo::{Decision, Lease, Limit, Op};
use crate::store::{GrantAsk, StoreError};
use crate::tag::Tag;
use crate::time::Millis;
use std::hash::Hasher;
use std::sync::atomic::Ordering::Relaxed;

/// How often a region says, in the global store, that it is there (as `failure: local`'s
/// heartbeat in a region's own store).
pub const BEAT: Millis = crate::fallback::HEARTBEAT;

/// How long a region's beat counts: three missed, and the region is no longer counted.
const BEAT_TTL: Millis = 3 * BEAT;

/// Where the regions' beats live in the global store: one state for the fleet, apart
/// from every client's (a client's tag is a keyed hash; this is a constant).
pub(super) const REGIONS: Tag = Tag(u128::from_be_bytes(*b"sluice:regions\0\0"));

/// The lease of `region` in beat `n`: every instance of the region takes the same one,
/// so the leases held count regions, not instances.
pub(super) fn beat_lease(region: &str, n: u64) -> Lease {
    use siphasher::sip128::Hasher128;
    let mut h = siphasher::sip128::SipHasher13::new_with_keys(0x7265_6769_6f6e_7321, n);
    h.write(region.as_bytes());
    let k = h.finish128();
    ((u128::from(k.h1) << 64) | u128::from(k.h2)).max(1)
}

/// One beat in a set of leases: takes `lease` on the state `key` of [`REGIONS`] in
/// `store`, then gives back `before` (the leases of the beats before it that may still be
/// held: [`befores`]). Returns the leases held, less those given back (every holder of one
/// name moves to the next together, so the count is of names, not holders).
pub(super) async fn beat_in(
    store: &dyn crate::store::Store,
    (key, lease, before): (u64, Lease, &[Lease]),
    now: Millis,
) -> Result<u64, crate::store::StoreError> {
    let limit = Limit::Concurrency { limit: 1 << 20, lease_ttl: BEAT_TTL };
    let op = Op { key, limit, cost: 1, lease: Some(lease), shadow: false };
    let held = store.apply(REGIONS, &[op], now).await?.first().map_or(1, |d| d.used);
    let mut released = 0;
    for &b in before.iter().filter(|&&b| b != lease) {
        released += u64::from(matches!(store.release(REGIONS, &[key], b, now).await, Ok(true)));
    }
    Ok(held.saturating_sub(released))
}

/// The leases `lease_of` gives the beats before beat `n` that may still be held (a lease
/// lasts [`BEAT_TTL`], three beats): not only the last one's, since a beat skipped (the
/// global store cut off, the instance paused) leaves the one before it held until it
/// lapses, counted as a region of its own meanwhile.
pub(super) fn befores(n: u64, lease_of: impl Fn(u64) -> Lease) -> Vec<Lease> {
    (1..=BEAT_TTL / BEAT).filter(|&k| k <= n).map(|k| lease_of(n - k)).collect()
}

impl Regions {
    /// The regions this instance last knew to share its global store (its own included;
    /// 1 until the global store first answered a beat).
    pub fn regions_known(&self) -> u64 {
        self.regions.load(Relaxed).max(1)
    }

    /// Whether the last call to the global store answered.
    pub(crate) fn global_answers(&self) -> bool {
        !self.global_down.load(Relaxed)
    }

    /// What one of `instances` instances of this region may admit of global `op` (its
    /// key names the window of `now`) while the global store cannot be asked, besides
    /// what the region's pool holds: the region's share of the limit (the limit over the
    /// regions known) less what the pool held of the window when last read and what this
    /// instance charged on the global store in it, and no more than its part of what the
    /// global store said it had left (the other regions may hold the rest), split between
    /// the instances (rounded down: the shares never sum past the limit).
    pub(crate) fn share(&self, tag: Tag, op: &Op, instances: u64, now: Millis) -> u64 {
        let Limit::FixedWindow { limit, .. } = op.limit else { return 0 };
        let end = pool::window_end(&op.limit, now);
        // a decision that outlived its window (it waited on the global store past the
        // window's end) gets nothing of it: what the region knew of that window may be
        // gone already, and a share of a window it cannot see could pass the limit
        if self.clock.now() >= end {
            return 0;
        }
        let known = self.known(tag, pool::base_key(op.key, &op.limit, end), end);
        let regions = self.regions_known();
        let share = (limit / regions).saturating_sub(known.seen.0 + known.decided);
        share.min(known.left_globally.map_or(u64::MAX, |left| left / regions)) / instances.max(1)
    }

    /// Decides global `ops` (their keys name the windows of `now`) on the global store's
    /// windows themselves, while the region's own store fails: charged there, or only
    /// read (`charge` false: another limit of the request refused it).
    pub(crate) async fn decide_globally(
        &self,
        tag: Tag,
        ops: &[Op],
        charge: bool,
        now: Millis,
    ) -> Result<Vec<Decision>, StoreError> {
        // under the limit the regions agree on (the smallest, if they differ)
        let agreed: Vec<Op> = ops.iter().map(|o| Op { limit: self.agreed(&o.limit), ..*o }).collect();
        let decided = match charge {
            true => self.timed(self.global.apply(tag, &agreed, now)).await,
            false => self.timed(self.global.peek(tag, &agreed, now)).await,
        };
        let Ok(decisions) = decided else { return decided };
        self.stats.decided_globally.fetch_add(ops.len() as u64, Relaxed);
        self.metrics.decided_globally.increment(ops.len() as u64);
        for (op, d) in ops.iter().zip(&decisions).filter(|_| charge) {
            let end = pool::window_end(&op.limit, now);
            self.update(tag, pool::base_key(op.key, &op.limit, end), end, |h| {
                h.decided += if d.allowed && !op.shadow { op.cost } else { 0 };
                (h.left_globally, h.answered_at) = (Some(d.remaining), now);
            });
        }
        Ok(decisions)
    }

    /// Says this region is there, in the global store: takes this beat's lease of the
    /// region, then gives back the one before (the region's other instances may have
    /// already). The leases held then, less the one before if it was still held, are the
    /// regions (another region's lease before may be counted for a moment: a count too
    /// high gives a share too small, never too large). Keeps [`Self::regions_known`].
    pub(super) async fn beat(&self, now: Millis) {
        let n = now / BEAT;
        let (lease, before) = (beat_lease(&self.name, n), befores(n, |k| beat_lease(&self.name, k)));
        let Ok(regions) = self.timed(beat_in(&*self.global, (1, lease, &before), now)).await else { return };
        self.regions.store(regions.max(1), Relaxed);
        self.agree(now / BEAT, now).await;
    }

    /// After grant `g` on the window `key` ending at `end`, taken while the region's pool
    /// held `held` (all the global store granted the region there, spent or not):
    /// whether the global store's count of the window is below `held` and the grant,
    /// which only a loss of its data explains. If so, logs it, counts it and declares the
    /// difference again (a grant not put into the pool: the pool has those units);
    /// returns that grant, to keep open. One allocator of the region acts on its pool at
    /// a time, so the region declares it once.
    pub(super) async fn recount(
        &self,
        tag: Tag,
        (key, limit): (u64, &Limit),
        (end, at): (Millis, Millis),
        held: u64,
        g: &Granted,
    ) -> Option<Open> {
        let lost = (held + g.units).saturating_sub(g.decision.used);
        if lost == 0 {
            return None;
        }
        let id = self.ids.fetch_add(1, Relaxed);
        let ask = GrantAsk { key, limit: *limit, need: lost, want: lost, id, close: Vec::new(), pool: false };
        let again = self.timed(self.global.grant(tag, ask, at)).await.map_or(0, |g| g.units);
        let reset = self.global.peek(tag, &[reset_mark(key, limit)], at).await;
        if reset.is_ok_and(|d| d.first().is_some_and(|d| d.used > 0)) {
            tracing::info!(region = %self.name, held, declared_again = again, "a client of a global limit was reset \
                through another region: this region declares what it holds of the window again");
            return (again > 0).then_some(Open { id, units: again, expires: end });
        }
        self.stats.lost.fetch_add(lost, Relaxed);
        self.metrics.lost.increment(lost);
        tracing::warn!(
            region = %self.name,
            held,
            counted = g.decision.used,
            declared_again = again,
            "the global store counts less of a global window than this region holds in it: it lost its data \
             (FLUSHALL, a restart without persistence, a failover to an empty replica?); the region declares what \
             it holds again, and until the other regions do, that window may pass its limit by what they hold"
        );
        (again > 0).then_some(Open { id, units: again, expires: end })
    }

    /// Resets `ops` (windows of global limits, this region's pools of them already
    /// forgotten) on the fleet's window: the global store forgets its count of each and
    /// keeps a mark of the reset for the window, and this instance forgets what it knew
    /// of them. The other regions declare what they hold again (see the module's comment).
    pub(crate) async fn reset(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<(), StoreError> {
        let marks: Vec<Op> = ops.iter().map(|op| reset_mark(op.key, &op.limit)).collect();
        self.timed(self.global.apply(tag, &marks, now)).await?;
        self.timed(self.global.reset(tag, ops, now)).await?;
        for op in ops {
            let end = pool::window_end(&op.limit, now);
            self.update(tag, pool::base_key(op.key, &op.limit, end), end, |h| *h = Default::default());
        }
        Ok(())
    }
}

/// The mark a reset leaves in the global store for the window `key` of a client's limit:
/// a count of its own in that window (a state key apart from the client's, of the same
/// tag), that only resets move.
fn reset_mark(key: u64, limit: &Limit) -> Op {
    let window = pool::window_length(limit);
    let limit = Limit::FixedWindow { limit: 1 << 40, window, aligned: true };
    Op { key: key ^ 0x7265_7365_7421_0000, limit, cost: 1, shadow: false, lease: None }
}
