//! The fleet's count as a region knows it, without a move: what is left of a global
//! window for an admitted answer and a status read, a client's pools and grants for
//! `admin inspect` (every region's grants in the global store among them), and the
//! region as this instance sees it for the live page.

use super::{Regions, TICK};
use crate::algo::grant::Open;
use crate::algo::pool::{Act, Pool};
use crate::algo::{Limit, Op, pool};
use crate::store::StoreError;
use crate::tag::Tag;
use crate::time::Millis;
use std::sync::atomic::Ordering::Relaxed;

/// Where a grant's id carries its region's code ([`region_code`]): the 16 bits from
/// here up. Below, each instance counts from a random start under 2^46, so 2^46 grants
/// at least go by before the count reaches the code.
pub(super) const REGION_SHIFT: u32 = 47;

/// The code of region `name` in the ids of its grants, so that the global store's book
/// of a window says which region holds each grant (its name is known only there).
pub fn region_code(name: &str) -> u16 {
    use std::hash::Hasher;
    let mut h = siphasher::sip::SipHasher13::new_with_keys(0x6772_616e_7473, 0);
    h.write(name.as_bytes());
    h.finish() as u16
}

/// What one region holds of a global window, as the global store's book says: the units
/// of its grants open there (spent or not: a grant is closed when its region next asks)
/// (`admin inspect`, through [`crate::Limiter::pools`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RegionGrants {
    /// The region's code ([`region_code`]), and its name when it is this instance's.
    pub code: u16,
    pub region: Option<String>,
    pub units: u64,
    pub grants: usize,
}

/// What a client's global window looks like from one instance ([`crate::Limiter::pools`]).
#[derive(Debug, Clone, Default)]
pub struct FleetWindow {
    /// The region's pool of the window, read from its store.
    pub pool: Pool,
    /// This instance's grants open in the global store for it.
    pub grants_here: Vec<Open>,
    /// The global store's window: units granted to the regions (spent or not) and left
    /// to grant; `None` if it could not be read.
    pub global: Option<(u64, u64)>,
    /// Every region's grants open in the global store, this region's first, then by
    /// units held; empty if the book could not be read.
    pub regions: Vec<RegionGrants>,
}

/// A region as one instance sees it ([`Regions::view`]).
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct RegionView {
    /// The region, and the kind of its global store.
    pub region: String,
    pub global_store: &'static str,
    /// Clients of global limits active here, and what their pools hold and have spent
    /// in the windows now.
    pub clients: usize,
    pub held: u64,
    pub spent: u64,
    /// This instance's allocator since it started: units taken from the global store and
    /// given back, its calls there, those that failed, and their mean time.
    pub taken: u64,
    pub given_back: u64,
    pub global_calls: u64,
    pub global_errors: u64,
    pub global_mean_ms: f64,
    /// How far ahead the region holds; the round trip to the global store now (smoothed
    /// over the last calls), and whether its last call failed.
    pub horizon_ms: Millis,
    pub round_trip_ms: Millis,
    pub failing: bool,
    /// Decisions that asked the global store at once, the refusals because the fleet
    /// had spent the limit, and those while it may have had units (see [`RegionStats`](super::RegionStats)).
    pub hurried: u64,
    pub refused_spent: u64,
    pub refused_waiting: u64,
    /// Decisions of clients this allocator did not keep ([`MAX_ACTIVE`](super::MAX_ACTIVE) reached).
    pub untracked: u64,
}

impl Regions {
    /// What is left of the fleet's limit in the window of `op` (planned at `planned`) as
    /// the region last knew it, besides the units this instance holds: what the global
    /// store has not granted, and what the region's pool holds unspent (as the allocator
    /// read it at its last tick, or now if it has not yet: a client new here). Less than
    /// the truth by what the other regions hold unspent (about their demand for one
    /// horizon), never more. `None` when the store cannot be read.
    pub(crate) async fn fleet_left(&self, tag: Tag, op: &Op, planned: Millis) -> Option<u64> {
        let end = pool::window_end(&op.limit, planned);
        let base = pool::base_key(op.key, &op.limit, end);
        let known = self.known(tag, base, end);
        // the pool as last read, while the allocator reads it each tick (a client idle
        // here is not read at ticks: its pool is read now)
        let fresh = self.clock.now() < known.seen_at + 2 * TICK && known.seen != (0, 0);
        if let Some(left) = known.left().filter(|_| fresh) {
            return Some(left);
        }
        let now = self.clock.now().min(end - 1);
        let (_, pool) = self.region_pool(tag, self.pool_call(op.key, &op.limit, end, Act::Read), now).await.ok()?;
        self.saw(tag, base, end, &pool);
        Some(pool.left.unwrap_or(0) + pool.unspent())
    }

    /// What is left of the fleet's limit in the window of `op` (its key names the window
    /// of `now`) for a status read, besides the units this instance holds: what the
    /// global store has not granted (asked now: a region that never served the client
    /// in this window knows nothing of it) and what the region's pool holds unspent. Less
    /// than the truth by what the other regions hold unspent. `None` when a store cannot
    /// be read.
    pub(crate) async fn fleet_status(&self, tag: Tag, op: &Op, now: Millis) -> Option<u64> {
        let end = pool::window_end(&op.limit, now);
        let pool = self.region_pool(tag, self.pool_call(op.key, &op.limit, end, Act::Read), now);
        let global = self.timed(self.global.peek(tag, std::slice::from_ref(op), now));
        let ((_, pool), global) = futures_util::future::try_join(pool, global).await.ok()?;
        self.saw(tag, pool::base_key(op.key, &op.limit, end), end, &pool);
        Some(global.first()?.remaining + pool.unspent())
    }

    /// What is left of the fleet's limit in the window of `op` (planned at `planned`) as
    /// this instance last knew it, without a store call: what the global store had not
    /// granted and what the region's pool held unspent; `None` if it never knew.
    pub(super) fn known_left(&self, tag: Tag, op: &Op, planned: Millis) -> Option<u64> {
        let end = pool::window_end(&op.limit, planned);
        self.known(tag, pool::base_key(op.key, &op.limit, end), end).left()
    }

    /// The global window `op` (a decision's op: its key names the window) is in at `now`,
    /// as this instance sees it: the region's pool, read from its store; this instance's
    /// grants; and, read from the global store, its count and every region's grants: for
    /// inspecting a client.
    pub(crate) async fn inspect(&self, tag: Tag, op: &Op, now: Millis) -> Result<FleetWindow, StoreError> {
        let end = pool::window_end(&op.limit, now);
        let (_, pool) = self.region_pool(tag, self.pool_call(op.key, &op.limit, end, Act::Read), now).await?;
        let global = self.timed(self.global.peek(tag, std::slice::from_ref(op), now)).await;
        let global = global.ok().and_then(|d| d.first().map(|d| (d.used, d.remaining)));
        let book = self.timed(self.global.grants_open(tag, op.key, &op.limit, now)).await.unwrap_or_default();
        let here = region_code(&self.name);
        let mut regions: Vec<RegionGrants> = Vec::new();
        for o in book {
            let code = (o.id >> REGION_SHIFT) as u16;
            match regions.iter_mut().find(|r| r.code == code) {
                Some(r) => (r.units, r.grants) = (r.units + o.units, r.grants + 1),
                None => regions.push(RegionGrants {
                    code,
                    region: (code == here).then(|| self.name.clone()),
                    units: o.units,
                    grants: 1,
                }),
            }
        }
        regions.sort_by_key(|r| (r.code != here, std::cmp::Reverse(r.units), r.code));
        let grants_here = self.holding(tag, pool::base_key(op.key, &op.limit, end), end).open;
        Ok(FleetWindow { pool, grants_here, global, regions })
    }

    /// The region as this instance sees it, for the live page: what the pools of the
    /// clients active here hold and have spent in their windows now, as the allocator
    /// last read them (every tick: no store call here), and this allocator's counts.
    pub fn view(&self) -> RegionView {
        let now = self.clock.now();
        let mut view = RegionView {
            region: self.name.clone(),
            global_store: self.global.kind(),
            horizon_ms: self.horizon(),
            round_trip_ms: self.round_trip(),
            failing: !self.global_answers(),
            ..RegionView::default()
        };
        for a in self.active.lock().unwrap_or_else(std::sync::PoisonError::into_inner).values() {
            let (held, spent) = a.windows.get(&pool::window_end(&a.limit, now)).map_or((0, 0), |h| h.seen);
            (view.clients, view.held, view.spent) = (view.clients + 1, view.held + held, view.spent + spent);
        }
        let s = &self.stats;
        (view.taken, view.given_back) = (s.taken.load(Relaxed), s.given_back.load(Relaxed));
        (view.global_calls, view.global_errors) = (s.global_calls.load(Relaxed), s.global_errors.load(Relaxed));
        view.global_mean_ms = s.global_micros.load(Relaxed) as f64 / 1_000.0 / view.global_calls.max(1) as f64;
        (view.hurried, view.refused_spent) = (s.hurried.load(Relaxed), s.refused_spent.load(Relaxed));
        (view.refused_waiting, view.untracked) = (s.refused_waiting.load(Relaxed), s.untracked.load(Relaxed));
        view
    }

    /// Forgets the pool as last read for the global window of `key` (under `limit`)
    /// ending at `end`: units given back to it (a refund, a reservation's commit) make
    /// that read stale, and a decision trusting it within its tick would refuse what the
    /// pool now holds, as if the fleet had spent the window.
    pub(crate) fn pool_changed(&self, tag: Tag, key: u64, limit: &Limit, end: Millis) {
        self.update(tag, pool::base_key(key, limit, end), end, |h| h.seen_at = 0);
    }
}
