//! One limit across regions, a region's side: the allocator that keeps the region's pools
//! of global windows filled from the global store, and gives back what the region does
//! not need (see [`crate::algo::pool`] for the design and its bound).
//!
//! Every instance runs one. Each counts the units its decisions were asked for on each
//! global window (admitted or not), and at every tick reports them into the pool (so the
//! pool holds the region's demand, all instances together), reads it, and plans (for the
//! clients with units asked for here since the last tick, or a grant of its own open). One
//! allocator acts on a pool at a time (the pool's claim), so a region's instances do not
//! all ask at once. A grant is asked for with this instance's id, so only this instance
//! gives it back; the units themselves are the region's, in its pool. Decisions spend
//! grants taken from the pool, in the region's own store; one that finds the pool short
//! of its cost has this allocator's move made for its client at once (`Regions::hurry`)
//! and waits for it, at most twice the round trip and 100 ms, so that a global limit refuses
//! only when the fleet has spent it, not when the region had not asked yet.

mod agree;
mod fleet;
mod hurry;
mod outage;
mod stats;
#[cfg(test)]
mod tests;

pub use crate::rules::GlobalRule;
pub use agree::{Variants, fleet_variants};
pub use fleet::{FleetWindow, RegionGrants, RegionView, region_code};
pub(crate) use hurry::Hurried;
pub use outage::BEAT;
use stats::Metrics;
pub use stats::RegionStats;

use crate::algo::grant::Open;
use crate::algo::pool::{self, Act, Move, Pool, Seen};
use crate::algo::{Limit, Op};
use crate::store::{GiveBack, GrantAsk, PoolCall, Store, StoreError};
use crate::tag::Tag;
use crate::time::{Clock, Millis};
use futures_util::StreamExt;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use tokio::time::Instant;

/// How often an allocator looks at its pools.
pub const TICK: Millis = 100;

/// Clients of global limits an allocator keeps at most (`Regions::arrived`). Past it, the
/// idle ones (no units asked for since the last tick, no grant of this instance open,
/// none asked for within a horizon) are dropped, at most once a second; a client that
/// still finds no room is not kept: its decisions are still served by their own moves
/// (`Regions::hurry`), one global call for each pool found short, and counted
/// (`RegionStats::untracked`). So a flood of distinct clients costs bounded memory, and a
/// tick's work is bounded by it too.
pub const MAX_ACTIVE: usize = 100_000;

/// The moves of a tick under way at once (one per client with something to do).
const MOVES_AT_ONCE: usize = 256;

/// The cross-region round trip assumed until a global call has been timed.
const FIRST_ROUND_TRIP: Millis = 100;

/// What a decision waits for its region's pool to be filled (`Regions::hurry`) beyond
/// twice the round trip to the global store: the region's own calls around the global
/// one (a read, a claim, the fill, the grant), on a busy machine.
pub const WAIT_MARGIN: Millis = 100;

/// One global limit's state of one client as this instance sees it.
struct Active {
    limit: Limit,
    /// Units asked for since the last tick, not yet reported.
    arrived: u64,
    seen_at: Millis,
    /// By window end: this instance's grants open in the global store, and what the
    /// global store said was left when it last answered.
    windows: BTreeMap<Millis, Holding>,
}

#[derive(Debug, Clone, Default)]
struct Holding {
    open: Vec<Open>,
    left_globally: Option<u64>,
    /// When the global store last answered.
    answered_at: Millis,
    /// The pool as the allocator last read it: what the region holds (`cap`) and what
    /// its instances took (`used`), for the live page.
    seen: (u64, u64),
    /// When the pool was last read.
    seen_at: Millis,
    /// When this instance last took units for the window: a tick gives none back within
    /// a horizon of it (they were taken for demand seen then, and the decisions that
    /// waited for them are taking them).
    taken_at: Option<Millis>,
    /// Units this instance charged on the global store's window itself, its region's
    /// store down (part of the region's share, should the global store fail too).
    decided: u64,
}

impl Active {
    /// Whether this instance has a grant open in one of the client's windows (units it
    /// may have to give back).
    fn holds(&self) -> bool {
        self.windows.values().any(|h| !h.open.is_empty())
    }
}

/// What a [`Holding`] says of its window, without its grants (read on a decision's path:
/// no list cloned).
#[derive(Debug, Clone, Copy, Default)]
struct Known {
    left_globally: Option<u64>,
    answered_at: Millis,
    seen: (u64, u64),
    seen_at: Millis,
    decided: u64,
}

impl Known {
    /// What is left of the fleet's limit as known: what the global store had not granted
    /// and what the region's pool held unspent; `None` if the global store never said.
    fn left(&self) -> Option<u64> {
        self.left_globally.map(|left| left + self.seen.0.saturating_sub(self.seen.1))
    }

    /// Whether the global store said, within `horizon` of `now`, that it had less than
    /// `cost` left: the fleet spent the window.
    fn said_spent(&self, cost: u64, now: Millis, horizon: Millis) -> bool {
        self.left_globally.is_some_and(|l| l < cost) && now < self.answered_at + horizon
    }
}

/// A region's allocator on one instance.
pub struct Regions {
    /// This instance's region (`region` in the config; the `region` label of its series).
    name: String,
    global: Arc<dyn Store>,
    local: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    active: Mutex<HashMap<(Tag, u64), Active>>,
    ids: AtomicU64,
    /// The global calls' latency, smoothed, in ms: half the horizon.
    latency: AtomicU64,
    stats: RegionStats,
    metrics: Metrics,
    /// Window lengths found too short for the round trip measured (warned once each).
    short: Mutex<std::collections::BTreeSet<Millis>>,
    /// The moves `Self::hurry` has under way, by client and window end: a decision that
    /// finds one waits for it rather than starting another.
    hurrying: Mutex<HashMap<(Tag, u64, Millis), hurry::InFlight>>,
    /// The regions known to share the global store ([`outage`]), and whether its last
    /// call failed.
    regions: AtomicU64,
    global_down: AtomicBool,
    /// The calls under way to the global store and to the region's, and their answers:
    /// a decision that waited its bound while one had calls under way and answered none
    /// finds it stalled (`Regions::bounded`).
    global_calls: stats::Calls,
    region_calls: stats::Calls,
    /// When the next beat is due ([`outage`]).
    beat: crate::time::Throttle,
    /// The clients kept, [`MAX_ACTIVE`] reached, swept of the idle at most once a second;
    /// a client not kept said in the log at most once a minute.
    sweep: crate::time::Throttle,
    untracked_told: crate::time::Throttle,
    /// The global rules configured here; the smallest limit the regions configure for
    /// each (limit, window) here they differ on; the disagreements already logged; and
    /// whether a regional store shared with another region was ([`agree`]).
    rules: Mutex<Vec<GlobalRule>>,
    agreed: Mutex<HashMap<(u64, Millis), u64>>,
    told: Mutex<std::collections::HashSet<(String, agree::Variants)>>,
    shared_told: AtomicBool,
    /// The quota grants of the engine that holds this allocator, swept of the idle each
    /// tick ([`Self::sweep_grants`]).
    grants: Mutex<std::sync::Weak<crate::grants::Ledger>>,
}

/// The round trips to the global store a global window should last at least: under that,
/// a region's share runs out before the next arrives and part of the limit goes unused
/// (measured on the model: docs/architecture.md, "One limit across regions").
pub const SERVED_ROUND_TRIPS: Millis = 25;

impl Regions {
    /// An allocator between the region's store `local` and the `global` store, in a
    /// region without a name (its series' `region` label is empty).
    pub fn new(global: Arc<dyn Store>, local: Arc<dyn Store>, clock: Arc<dyn Clock>) -> Arc<Self> {
        Self::named("", global, local, clock)
    }

    /// An allocator of the region `name` between the region's store `local` and the
    /// `global` store.
    pub fn named(name: &str, global: Arc<dyn Store>, local: Arc<dyn Store>, clock: Arc<dyn Clock>) -> Arc<Self> {
        let mut seed = [0u8; 8];
        let _ = getrandom::fill(&mut seed);
        Arc::new(Self {
            name: name.to_string(),
            global,
            local,
            clock,
            active: Mutex::new(HashMap::new()),
            // the region's code above a count from a random start (fleet::REGION_SHIFT)
            ids: AtomicU64::new(u64::from(region_code(name)) << fleet::REGION_SHIFT | u64::from_le_bytes(seed) >> 18),
            latency: AtomicU64::new(FIRST_ROUND_TRIP),
            stats: RegionStats::default(),
            metrics: Metrics::new(name),
            short: Mutex::new(Default::default()),
            hurrying: Mutex::new(HashMap::new()),
            regions: AtomicU64::new(1),
            global_down: AtomicBool::new(false),
            global_calls: Default::default(),
            region_calls: Default::default(),
            beat: Default::default(),
            sweep: Default::default(),
            untracked_told: Default::default(),
            rules: Mutex::new(Vec::new()),
            agreed: Mutex::new(HashMap::new()),
            told: Mutex::new(Default::default()),
            shared_told: AtomicBool::new(false),
            grants: Mutex::new(std::sync::Weak::new()),
        })
    }

    /// This instance's region.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The global store.
    pub fn global(&self) -> &Arc<dyn Store> {
        &self.global
    }

    pub fn stats(&self) -> &RegionStats {
        &self.stats
    }

    /// How far ahead a region holds: twice the round trip to the global store and a tick.
    pub fn horizon(&self) -> Millis {
        2 * self.latency.load(Relaxed) + TICK
    }

    /// Counts a decision's units on a global window (`op`'s key names the window).
    pub(crate) fn arrived(&self, tag: Tag, op: &Op, now: Millis) {
        let end = pool::window_end(&op.limit, now);
        let base = pool::base_key(op.key, &op.limit, end);
        let mut active = self.active.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if active.len() >= MAX_ACTIVE && !active.contains_key(&(tag, base)) && !self.make_room(&mut active, now) {
            drop(active);
            self.untracked(now);
            return;
        }
        let a = active.entry((tag, base)).or_insert_with(|| Active {
            limit: op.limit,
            arrived: 0,
            seen_at: now,
            windows: BTreeMap::new(),
        });
        a.arrived = a.arrived.saturating_add(op.cost.max(1));
        a.seen_at = now;
        // a reload that changed the limit: the allocator asks under the new one from now
        // (what the pool holds of this window was granted under the old)
        a.limit = op.limit;
    }

    /// [`MAX_ACTIVE`] clients kept: drops the idle ones (see there), at most once a
    /// second; whether there is room now.
    fn make_room(&self, active: &mut HashMap<(Tag, u64), Active>, now: Millis) -> bool {
        if self.sweep.due(now, 1_000) {
            let horizon = self.horizon();
            active.retain(|_, a| a.arrived > 0 || a.holds() || a.seen_at + horizon > now);
        }
        active.len() < MAX_ACTIVE
    }

    /// A decision of a client not kept ([`MAX_ACTIVE`] reached): counted, and said at
    /// most once a minute.
    fn untracked(&self, now: Millis) {
        let untracked = self.stats.untracked.fetch_add(1, Relaxed) + 1;
        if self.untracked_told.due(now, 60_000) {
            tracing::warn!(
                region = %self.name,
                kept = MAX_ACTIVE,
                untracked,
                "the allocator keeps {MAX_ACTIVE} clients of global limits at most, and none is idle: a new \
                 client's decisions ask the global store themselves when its region's pool is short"
            );
        }
    }

    /// Runs [`Self::step`] every [`TICK`] while an engine holds this allocator (a reload
    /// that builds another lets this one end).
    pub fn spawn(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(std::time::Duration::from_millis(TICK));
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(me) = me.upgrade() else { return };
                me.step().await;
            }
        })
    }

    /// One tick: every client of a global window with units asked for here since the last
    /// tick, or a grant of this instance open, reports and plans, all at once
    /// (and for the next window too, once it is within the horizon); and every
    /// [`BEAT`], the region says in the global store that it is there.
    pub async fn step(self: &Arc<Self>) {
        let now = self.clock.now();
        let mut work = Vec::new();
        {
            let mut active = self.active.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            active.retain(|_, a| {
                let end = pool::window_end(&a.limit, now);
                a.windows.retain(|e, _| *e >= end);
                a.seen_at + 2 * pool::window_length(&a.limit) > now || !a.windows.is_empty()
            });
            // a client with nothing new here and no grant of this instance open has
            // nothing for this allocator to do: the instances that see its demand plan
            // (an idle long tail costs no store call)
            for (&(tag, base), a) in active.iter_mut().filter(|(_, a)| a.arrived > 0 || a.holds()) {
                work.push((tag, base, a.limit, std::mem::take(&mut a.arrived)));
            }
        }
        if self.beat.due(now, BEAT) {
            // apart from the tick: a beat's calls (a few a global rule) never hold it up
            let me = self.clone();
            tokio::spawn(async move { me.beat(now).await });
        }
        // a bounded number at once, in this task: no task spawned per client per tick
        let moves = futures_util::stream::iter(work);
        moves
            .for_each_concurrent(MOVES_AT_ONCE, |(tag, base, limit, arrived)| {
                self.allocate(tag, base, limit, arrived, now)
            })
            .await;
        self.sweep_grants(now).await;
    }

    /// Sweeps the quota grants of `ledger` (the engine's that holds this allocator) of
    /// the idle at every tick, not only at the engine's next decision.
    pub(crate) fn sweeps(&self, ledger: &Arc<crate::grants::Ledger>) {
        *self.grants.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::downgrade(ledger);
    }

    /// Gives back the units of this instance's grants idle for
    /// [`IDLE`](crate::grants::IDLE): an instance that gets no more requests (taken out
    /// of its load balancer, its clients gone to another) would hold them, hidden from
    /// its region's pool and the fleet's, until their window ended.
    async fn sweep_grants(&self, now: Millis) {
        let Some(ledger) = self.grants.lock().unwrap_or_else(std::sync::PoisonError::into_inner).upgrade() else {
            return;
        };
        let mut out = crate::grants::Leftovers::default();
        ledger.drop_idle(false, now, &mut out);
        if !out.give_back.is_empty() {
            let _ = ledger.settle(&*self.local, out, now).await;
        }
    }

    /// Reports and plans for the window of `limit` that `now` is in, of client `base`;
    /// then, once the next window is within the horizon, asks ahead for it at this
    /// window's demand (its own pool has seen none yet).
    async fn allocate(&self, tag: Tag, base: u64, limit: Limit, arrived: u64, now: Millis) {
        self.warn_if_short(&limit);
        let end = pool::window_end(&limit, now);
        let demand = self.allocate_window(tag, base, &limit, (end, arrived, None), now).await;
        if let Some(demand) = demand.filter(|_| end - now <= self.horizon()) {
            let next = end + pool::window_length(&limit);
            self.allocate_window(tag, base, &limit, (next, 0, Some(demand)), now).await;
        }
    }

    /// Reports `arrived` into the pool of the window ending at `end` and plans for it,
    /// from the pool's demand or `demand` if given; returns the demand it planned with.
    async fn allocate_window(
        &self,
        tag: Tag,
        base: u64,
        limit: &Limit,
        (end, arrived, demand): (Millis, u64, Option<f64>),
        now: Millis,
    ) -> Option<f64> {
        let key = pool::window_key(base, limit, end - pool::window_length(limit));
        // a window asked for ahead of its start is asked for as at its start
        let at = now.max(end - pool::window_length(limit));
        let horizon = self.horizon();
        let call = |act| self.pool_call(key, limit, end, act);
        let (_, pool) = self.region_pool(tag, PoolCall { arrived, ..call(Act::Read) }, at).await.ok()?;
        self.saw(tag, base, end, &pool);
        let holding = self.holding(tag, base, end);
        let demand_per_s = demand.unwrap_or_else(|| pool.demand.per_s(horizon, at));
        let recent_per_s = demand.unwrap_or_else(|| pool.demand.recent_per_s(horizon, TICK, at));
        let (unspent, open, left_globally) = (pool.unspent(), &holding.open, holding.left_globally);
        let seen = Seen { demand_per_s, recent_per_s, unspent, open, left_globally };
        let m = match pool::plan(seen, horizon, end - at) {
            Move::GiveBack { .. } if holding.taken_at.is_some_and(|t| at < t + horizon) => Move::Hold,
            m => m,
        };
        if m == Move::Hold || !matches!(self.region_pool(tag, call(Act::Claim { ttl: horizon }), at).await, Ok((1, _)))
        {
            return Some(demand_per_s);
        }
        let result = match m {
            Move::Take { want, need } => {
                self.take(tag, (base, key), limit, (end, at), (want, need), &pool).await.map(|_| ())
            }
            Move::GiveBack { parts } => self.give_back(tag, (base, key), limit, (end, at), parts).await,
            Move::Hold => Ok(()),
        };
        if result.is_err() {
            let _ = self.region_pool(tag, call(Act::Release), at).await;
        }
        Some(demand_per_s)
    }

    /// Asks the global store for units, then fills the pool with what it granted.
    async fn take(
        &self,
        tag: Tag,
        (base, key): (u64, u64),
        limit: &Limit,
        (end, at): (Millis, Millis),
        (want, need): (u64, u64),
        pool: &Pool,
    ) -> Result<u64, StoreError> {
        let holding = self.holding(tag, base, end);
        let close = pool::spent(&holding.open, pool.unspent());
        let id = self.ids.fetch_add(1, Relaxed);
        // under the limit the regions agree on (the smallest, if they differ)
        let ask = GrantAsk { key, limit: self.agreed(limit), need, want, id, close: close.clone(), pool: false };
        let g = self.timed(self.global.grant(tag, ask, at)).await?;
        let mut open: Vec<Open> = holding.open.iter().filter(|o| !close.contains(&o.id)).copied().collect();
        if g.units > 0 {
            open.push(Open { id, units: g.units, expires: end });
        }
        if let Some(again) = self.recount(tag, (key, limit), (end, at), pool.cap, &g).await {
            // the grants before are unknown to the global store now: this one stands for them
            open.retain(|o| o.id == id);
            open.push(again);
        }
        self.update(tag, base, end, |h| {
            h.open = open;
            h.left_globally = Some(g.decision.remaining);
            h.answered_at = at;
            if g.units > 0 {
                h.taken_at = Some(at);
            }
        });
        self.stats.taken.fetch_add(g.units, Relaxed);
        self.metrics.taken.increment(g.units);
        let act = if g.units > 0 { Act::Fill(g.units) } else { Act::Release };
        let call = PoolCall { left: Some(g.decision.remaining), ..self.pool_call(key, limit, end, act) };
        self.region_pool(tag, call, at).await.map(|_| g.units)
    }

    /// Drains unspent units from the pool, then gives them back to the global store.
    async fn give_back(
        &self,
        tag: Tag,
        (base, key): (u64, u64),
        limit: &Limit,
        (end, at): (Millis, Millis),
        parts: Vec<(u64, u64)>,
    ) -> Result<(), StoreError> {
        let holding = self.holding(tag, base, end);
        for (id, units) in parts {
            let held = holding.open.iter().find(|o| o.id == id).map_or(0, |o| o.units);
            let (n, _) = self.region_pool(tag, self.pool_call(key, limit, end, Act::Drain(units)), at).await?;
            // a part keeps the rest of its grant open, to give back through later (closed,
            // what the region still held of it could never go back: a region the demand
            // left kept it until the window ended, while the others were refused)
            let keep = held.saturating_sub(n);
            self.update(tag, base, end, |h| match keep {
                0 => h.open.retain(|o| o.id != id),
                _ => h.open.iter_mut().filter(|o| o.id == id).for_each(|o| o.units = keep),
            });
            if n > 0 {
                let back = GiveBack { key, limit: *limit, id, unspent: n, window: end, keep };
                let back = self.timed(self.global.give_back(tag, back, at)).await?;
                self.stats.given_back.fetch_add(back, Relaxed);
                self.metrics.given_back.increment(back);
            }
        }
        Ok(())
    }

    /// Warns once a window length is shorter than [`SERVED_ROUND_TRIPS`] round trips to
    /// the global store as measured here (after a few calls: the first are connects).
    fn warn_if_short(&self, limit: &Limit) {
        let (window, round_trip) = (pool::window_length(limit), self.latency.load(Relaxed));
        if self.stats.global_calls.load(Relaxed) < 8 || window >= SERVED_ROUND_TRIPS * round_trip {
            return;
        }
        if self.short.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(window) {
            tracing::warn!(
                window_ms = window,
                round_trip_ms = round_trip,
                "a global limit's window is shorter than {SERVED_ROUND_TRIPS} round trips to the global store as \
                 measured here: a region's share runs out before the next arrives, and part of the limit goes \
                 unused (docs/architecture.md, \"One limit across regions\"): lengthen the window"
            );
        }
    }

    /// The window lengths found too short for the round trip measured here.
    pub fn short_windows(&self) -> Vec<Millis> {
        self.short.lock().unwrap_or_else(std::sync::PoisonError::into_inner).iter().copied().collect()
    }

    /// An act on the pool `key` of the window of `limit` ending at `end`, reporting no
    /// demand, its demand counted in buckets of the horizon.
    fn pool_call(&self, key: u64, limit: &Limit, end: Millis, act: Act) -> PoolCall {
        PoolCall { key, limit: *limit, end, arrived: 0, act, bucket: self.horizon(), left: None }
    }

    /// A call on a pool in the region's store, counted under way (a move hung on it is
    /// a stalled regional store, `Regions::hurry`).
    async fn region_pool(&self, tag: Tag, call: PoolCall, at: Millis) -> Result<(u64, Pool), StoreError> {
        self.region_call(self.local.pool(tag, call, at)).await
    }

    /// A global call, timed and counted: its latency keeps the horizon.
    /// The horizon follows the engine's clock (a test's stepped clock keeps it fixed);
    /// the metrics, the wall clock's finer time.
    async fn timed<T>(&self, call: impl std::future::Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        let (started, began) = (Instant::now(), self.clock.now());
        let result = self.global_calls.counted(call).await;
        let took = started.elapsed();
        self.stats.global_calls.fetch_add(1, Relaxed);
        self.stats.global_micros.fetch_add(took.as_micros() as u64, Relaxed);
        self.metrics.seconds.record(took.as_secs_f64());
        match &result {
            Ok(_) => {
                self.global_down.store(false, Relaxed);
                let ms = self.clock.now().saturating_sub(began);
                let old = self.latency.load(Relaxed);
                self.latency.store((old * 7 + ms).div_ceil(8), Relaxed);
                self.metrics.ok.increment(1);
                self.metrics.horizon.set(self.horizon() as f64 / 1_000.0);
            }
            Err(_) => {
                self.global_down.store(true, Relaxed);
                self.stats.global_errors.fetch_add(1, Relaxed);
                self.metrics.errors.increment(1);
            }
        }
        result
    }

    /// Keeps what a read of the pool showed: what it holds and what was taken, and what
    /// the global store last said was left (another instance of the region may have
    /// asked since this one did).
    fn saw(&self, tag: Tag, base: u64, end: Millis, pool: &Pool) {
        let now = self.clock.now();
        self.update(tag, base, end, |h| {
            (h.seen, h.seen_at) = ((pool.cap, pool.used), now);
            h.left_globally = pool.left.or(h.left_globally);
        });
    }

    fn holding(&self, tag: Tag, base: u64, end: Millis) -> Holding {
        let active = self.active.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        active.get(&(tag, base)).and_then(|a| a.windows.get(&end)).cloned().unwrap_or_default()
    }

    fn known(&self, tag: Tag, base: u64, end: Millis) -> Known {
        let active = self.active.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let h = active.get(&(tag, base)).and_then(|a| a.windows.get(&end));
        h.map_or_else(Known::default, |h| Known {
            left_globally: h.left_globally,
            answered_at: h.answered_at,
            seen: h.seen,
            seen_at: h.seen_at,
            decided: h.decided,
        })
    }

    fn update(&self, tag: Tag, base: u64, end: Millis, f: impl FnOnce(&mut Holding)) {
        let mut active = self.active.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(a) = active.get_mut(&(tag, base)) {
            f(a.windows.entry(end).or_default());
        }
    }
}
