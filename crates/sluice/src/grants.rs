//! Quota grants, the instance's side: the units this instance holds, spent in process.
//!
//! A rule with `grants:` has its fixed windows decided here. The first decision of a key
//! takes a grant from the store ([`Store::grant`], which charges the shared window at
//! once); later decisions spend it without a store call; when a quarter of it is left,
//! the next grant is asked for in the background, sized from the key's rate, so a busy
//! key never waits on the store while units are left. What is not spent goes back
//! ([`Store::give_back`], once per grant). The store never grants past the limit, so the
//! fleet never admits past it: units lost with a crashed instance or a window that ended
//! are admitted less, never more (docs/architecture.md, "Quota grants").
//!
//! Revocation: grants taken under one limit are given back when a decision names
//! another (an override or a reload changed it), when the overrides' generation moves
//! (a reset anywhere in the fleet), and when a key sits idle; all of it within a second.

use crate::algo::grant::{BUCKET_TTL, Granted};
use crate::algo::{Decision, Limit, Op};
use crate::rules::GrantRule;
use crate::store::{GiveBack, GrantAsk, Store, StoreError};
use crate::tag::Tag;
use crate::time::Millis;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// A key idle this long gives its grants back: its units may serve another instance.
pub const IDLE: Millis = 500;

/// What the grants of one key on this instance look like.
#[derive(Debug)]
struct Held {
    /// The rule they serve (its counters).
    rule: Arc<GrantRule>,
    /// The limit the grants were taken under: a decision under another revokes them.
    limit: Limit,
    /// A fixed window's: the window they were taken from (its reset). A token bucket's
    /// grants lapse one by one instead (0 here).
    window: Millis,
    /// The grants held, oldest first.
    parts: Vec<Part>,
    /// Grants spent to the last unit: closed at the store by the next grant call.
    spent_ids: Vec<u64>,
    /// The state's remaining at the latest grant, after it, and its reset then.
    store_remaining: u64,
    reset_at: Millis,
    /// The least remaining reported (in this window; for a bucket, since its latest
    /// grant): what is reported never goes up meanwhile.
    reported: u64,
    /// The size of the latest grant; the next is asked for at a quarter of it left.
    last_units: u64,
    /// Units spent since `since`: the key's rate, which sizes the next grant.
    spent: u64,
    since: Millis,
    /// A grant is being asked for in the background.
    refreshing: bool,
    /// When the store was last asked for a grant.
    asked_at: Millis,
    /// The last decision on it.
    used_at: Millis,
}

/// One grant held: its id, the units it holds unspent and it was granted, and when it
/// lapses.
#[derive(Debug, Clone, Copy)]
struct Part {
    id: u64,
    left: u64,
    granted: u64,
    lapses: Millis,
}

impl Held {
    fn left(&self) -> u64 {
        self.parts.iter().map(|p| p.left).sum()
    }

    fn bucket(&self) -> bool {
        matches!(self.limit, Limit::TokenBucket { .. })
    }

    /// Spends `cost` from the oldest grants first; the caller checked it is there.
    fn spend(&mut self, cost: u64) {
        let mut cost = cost;
        for p in self.parts.iter_mut() {
            let take = cost.min(p.left);
            p.left -= take;
            cost -= take;
        }
        for p in self.parts.iter().filter(|p| p.left == 0) {
            self.spent_ids.push(p.id);
        }
        self.parts.retain(|p| p.left > 0);
    }

    /// The decision of a request that spent `cost`, or of a refusal. What is left is the
    /// store's remaining at the latest grant plus the units held; it is reported only
    /// ever lower (by at least each cost spent), although another instance's give-back
    /// may raise the store's.
    fn decision(&mut self, cost: u64, allowed: bool, now: Millis) -> Decision {
        let limit = self.limit.capacity();
        let remaining = (self.store_remaining + self.left()).min(self.reported.saturating_sub(cost)).min(limit);
        self.reported = remaining;
        let retry_after = match self.limit {
            _ if allowed => None,
            // a bucket: when one more request's units have come in
            Limit::TokenBucket { rate, per, .. } => Some((cost.max(1) * per).div_ceil(rate)),
            _ => Some(self.window.saturating_sub(now)),
        };
        let remaining = if allowed { remaining } else { 0 };
        Decision {
            holds: false,
            allowed,
            limit,
            used: limit - remaining,
            remaining,
            reset_at: self.reset_at,
            retry_after,
        }
    }

    /// Drops the grants lapsed by `now` (a bucket's), counting their units as expired.
    fn lapse(&mut self, now: Millis, out: &mut Leftovers) {
        let mut expired = 0;
        self.parts.retain(|p| {
            let live = p.lapses > now;
            if !live {
                expired += p.left;
            }
            live
        });
        out.expire(&self.rule, expired);
    }
}

/// What [`Ledger::take`] found.
#[derive(Debug)]
pub(crate) enum Take {
    /// Spent from a grant held: the decision, and a grant to ask for in the background.
    Spent(Decision, Option<GrantAsk>),
    /// Not enough units held: ask the store for this grant, then take again.
    Short(GrantAsk),
    /// Refused without a store call: the store had less than the cost left when it was
    /// asked less than `refresh` ago.
    Refused(Decision),
}

/// Grants to give back (revoked) and units that lapsed unspent with their window.
#[derive(Debug, Default)]
pub(crate) struct Leftovers {
    pub give_back: Vec<(Tag, GiveBack, Arc<GrantRule>)>,
    /// Units that lapsed (already counted in their rule's metrics as they lapsed).
    pub expired: u64,
}

impl Leftovers {
    /// Counts `units` of `rule` as lapsed unspent.
    fn expire(&mut self, rule: &GrantRule, units: u64) {
        if units > 0 {
            self.expired += units;
            rule.counters.expired.increment(units);
        }
    }
}

/// This instance's totals over every rule (the metrics count them per rule, in
/// `GrantCounters`).
#[derive(Debug, Default)]
pub struct GrantStats {
    /// Grants taken.
    pub taken: AtomicU64,
    /// Units given back.
    pub returned: AtomicU64,
    /// Decisions answered from a grant without a store call.
    pub local: AtomicU64,
}

/// One shard of the ledger: the grants held, by client tag and state key.
type Shard = HashMap<(Tag, u64), Held>;

/// The grants this instance holds, by client tag and state key.
pub struct Ledger {
    shards: Box<[Mutex<Shard>]>,
    /// Turns to ask the store for a grant, by key (hashed into these slots): of the
    /// requests that find too few units at once, one asks and the others wait for its
    /// answer, instead of a grant call each.
    turns: Box<[Turn]>,
    /// Grant ids: random high bits per instance, a counter below.
    next_id: AtomicU64,
    generation: AtomicU64,
    stats: GrantStats,
}

const SHARDS: usize = 16;

/// A turn to ask the store for a grant, and how many requests wait for it.
#[derive(Default)]
struct Turn {
    lock: tokio::sync::Mutex<()>,
    waiting: AtomicU64,
    /// When an ask in this turn last failed (ms; 0: never): those waiting behind it do
    /// not ask again, each after its own deadline.
    failed_at: AtomicU64,
}
/// Give-backs sent at once by [`Ledger::settle`].
const SETTLE_AT_ONCE: usize = 32;
const TURNS: usize = 256;

impl Default for Ledger {
    fn default() -> Self {
        // ids only need to differ between the instances holding one state's grants; if
        // the OS has no randomness to give, the process id and the time still differ
        let mut seed = [0u8; 8];
        if getrandom::fill(&mut seed).is_err() {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            seed = (u64::from(std::process::id()) << 32 ^ now.as_nanos() as u64).to_le_bytes();
        }
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            turns: (0..TURNS).map(|_| Turn::default()).collect(),
            next_id: AtomicU64::new(u64::from_le_bytes(seed) & !0xffff_ffff),
            generation: AtomicU64::new(0),
            stats: GrantStats::default(),
        }
    }
}

impl Ledger {
    /// The counters.
    pub fn stats(&self) -> &GrantStats {
        &self.stats
    }

    /// Units held now, unspent.
    pub fn held_units(&self) -> u64 {
        let shard =
            |s: &Mutex<Shard>| s.lock().unwrap_or_else(|p| p.into_inner()).values().map(Held::left).sum::<u64>();
        self.shards.iter().map(shard).sum()
    }

    /// Publishes the units held (`sluice_grant_units_held`), once a grant was ever
    /// taken; the rest of `sluice_grant*` is counted per rule as it happens.
    pub fn publish(&self) {
        if self.stats.taken.load(Relaxed) > 0 {
            metrics::gauge!(crate::telemetry::names::GRANT_UNITS_HELD).set(self.held_units() as f64);
        }
    }

    fn shard(&self, tag: Tag) -> std::sync::MutexGuard<'_, Shard> {
        self.shards[(tag.0 as usize) % SHARDS].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Spends `op.cost` from the grants held for it, or says which grant to ask for.
    /// Grants of another limit or a passed window are dropped first (into `out`).
    pub(crate) fn take(&self, tag: Tag, op: &Op, rule: &GrantRule, now: Millis, out: &mut Leftovers) -> Take {
        let grants = rule.grants;
        let mut shard = self.shard(tag);
        self.drop_if(&mut shard, tag, op.key, now, out, |h| h.limit != op.limit || (!h.bucket() && now >= h.window));
        // a global limit's first grant is small: units an instance holds are hidden from
        // its region and the fleet (half a small limit's pool, taken at a window's start,
        // sat in one instance while the other regions were refused)
        let first = grants.max.unwrap_or(u64::MAX).min(op.cost.max(1) * if rule.global { 2 } else { 16 });
        let Some(h) = shard.get_mut(&(tag, op.key)) else {
            return Take::Short(self.ask(op, op.cost, first));
        };
        h.lapse(now, out);
        if h.left() < op.cost {
            // a global limit's pool may be filled at any time: the region's allocator
            // says when the fleet has spent it (engine::spend), not what the pool held
            let recent = now.saturating_sub(h.asked_at) < grants.refresh && !rule.global;
            if h.store_remaining + h.left() < op.cost && recent {
                return Take::Refused(h.decision(0, false, now));
            }
            return Take::Short(self.ask(op, op.cost, first));
        }
        h.spend(op.cost);
        h.spent += op.cost;
        h.used_at = now;
        let d = h.decision(op.cost, true, now);
        let refresh = (!h.refreshing && h.left() * 4 <= h.last_units).then(|| {
            h.refreshing = true;
            // the key's rate over the time since the last grant, for `refresh` ms
            let rate = h.spent as f64 / now.saturating_sub(h.since).max(1) as f64;
            let want = (rate * grants.refresh as f64).ceil() as u64;
            self.ask(op, 1, want.clamp(1, grants.max.unwrap_or(u64::MAX)))
        });
        self.stats.local.fetch_add(1, Relaxed);
        rule.counters.local.increment(1);
        Take::Spent(d, refresh)
    }

    /// Removes the grants held for `key` of `tag` when `stale` says so, into `out`.
    fn drop_if(
        &self,
        shard: &mut Shard,
        tag: Tag,
        key: u64,
        now: Millis,
        out: &mut Leftovers,
        stale: impl Fn(&Held) -> bool,
    ) {
        if shard.get(&(tag, key)).is_some_and(stale)
            && let Some(h) = shard.remove(&(tag, key))
        {
            self.drop_held(tag, key, &h, now, out);
        }
    }

    /// Waits for the turn to ask the store for a grant for `key` of `tag`; held until
    /// the answer is added. Also returns how many requests were waiting for that turn
    /// when it came: a grant for them all is asked for at once.
    pub(crate) async fn turn(&self, tag: Tag, key: u64) -> (tokio::sync::MutexGuard<'_, ()>, u64) {
        let turn = self.turn_of(tag, key);
        turn.waiting.fetch_add(1, Relaxed);
        let guard = turn.lock.lock().await;
        let waiting = turn.waiting.fetch_sub(1, Relaxed) - 1;
        (guard, waiting)
    }

    /// The requests waiting for the turn of `key` of `tag` now.
    pub(crate) fn queued(&self, tag: Tag, key: u64) -> u64 {
        self.turn_of(tag, key).waiting.load(Relaxed)
    }

    fn turn_of(&self, tag: Tag, key: u64) -> &Turn {
        let slot = (tag.0 as u64 ^ key).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56;
        &self.turns[slot as usize % TURNS]
    }

    /// An ask for `key` of `tag` failed at `now`.
    pub(crate) fn ask_failed(&self, tag: Tag, key: u64, now: Millis) {
        self.turn_of(tag, key).failed_at.store(now.max(1), Relaxed);
    }

    /// Whether an ask for `key` of `tag` (or another key of its turn) failed at or after
    /// `since`: a decision that waited behind it fails too, at once, instead of asking
    /// again after its own deadline (which queued decisions a deadline each).
    pub(crate) fn failed_since(&self, tag: Tag, key: u64, since: Millis) -> bool {
        self.turn_of(tag, key).failed_at.load(Relaxed) >= since.max(1)
    }

    /// A fresh grant id: unique among this instance's grants, and unlikely to be
    /// another instance's.
    pub fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Relaxed)
    }

    /// A grant to ask for (the spent grants it closes are added when it is sent).
    fn ask(&self, op: &Op, need: u64, want: u64) -> GrantAsk {
        let id = self.new_id();
        GrantAsk { key: op.key, limit: op.limit, need, want: want.max(need), id, close: Vec::new(), pool: false }
    }

    /// Asks `store` for the grant `ask` and adds what it grants (grants of another
    /// limit or window held for the key are dropped, into `out`).
    pub(crate) async fn ask_store(
        &self,
        store: &dyn Store,
        tag: Tag,
        mut ask: GrantAsk,
        rule: &Arc<GrantRule>,
        now: Millis,
        out: &mut Leftovers,
    ) -> Result<Granted, StoreError> {
        rule.counters.store_calls.increment(1);
        // a global limit's grants come from the region's pool (algo::pool)
        ask.pool = rule.global;
        // the grants spent since the last call are closed by this one (kept if it fails)
        if let Some(h) = self.shard(tag).get_mut(&(tag, ask.key)).filter(|h| h.limit == ask.limit) {
            ask.close = std::mem::take(&mut h.spent_ids);
        }
        let granted = match store.grant(tag, ask.clone(), now).await {
            Ok(granted) => granted,
            Err(e) => {
                if let Some(h) = self.shard(tag).get_mut(&(tag, ask.key)).filter(|h| h.limit == ask.limit) {
                    h.spent_ids.extend(ask.close);
                }
                return Err(e);
            }
        };
        self.add(tag, &ask, &granted, rule, now, out);
        Ok(granted)
    }

    /// Adds what the store granted for `ask`.
    fn add(&self, tag: Tag, ask: &GrantAsk, g: &Granted, rule: &Arc<GrantRule>, now: Millis, out: &mut Leftovers) {
        self.stats.taken.fetch_add(u64::from(g.units > 0), Relaxed);
        rule.counters.taken.increment(u64::from(g.units > 0));
        rule.counters.granted.increment(g.units);
        let mut shard = self.shard(tag);
        let bucket = matches!(ask.limit, Limit::TokenBucket { .. });
        // a fixed window's grants belong to the window; a bucket's lapse one by one
        let (window, lapses) = match bucket {
            true => (0, now + BUCKET_TTL),
            false => (g.decision.reset_at, g.decision.reset_at),
        };
        // a late answer from a window older than the one held: its units lapsed with it
        if shard.get(&(tag, ask.key)).is_some_and(|h| h.limit == ask.limit && h.window > window) {
            out.expire(rule, g.units);
            return;
        }
        self.drop_if(&mut shard, tag, ask.key, now, out, |h| h.limit != ask.limit || h.window != window);
        let h = shard.entry((tag, ask.key)).or_insert_with(|| Held {
            rule: rule.clone(),
            limit: ask.limit,
            window,
            parts: Vec::new(),
            spent_ids: Vec::new(),
            store_remaining: g.decision.remaining,
            reset_at: g.decision.reset_at,
            reported: u64::MAX,
            last_units: 0,
            spent: 0,
            since: now,
            refreshing: false,
            asked_at: now,
            used_at: now,
        });
        h.refreshing = false;
        h.asked_at = now;
        h.reset_at = g.decision.reset_at;
        // a window's remaining only falls; a bucket's refills, so each grant restarts it
        h.store_remaining = if bucket { g.decision.remaining } else { h.store_remaining.min(g.decision.remaining) };
        if bucket {
            h.reported = u64::MAX;
        }
        if g.units > 0 {
            h.parts.push(Part { id: ask.id, left: g.units, granted: g.units, lapses });
            h.last_units = g.units;
            h.spent = 0;
            h.since = now;
        }
    }

    /// A refusal of `op` in the window ending at `reset_at`, asked for nothing (the
    /// fleet spent a global limit's window): as [`Self::refusal`], the whole limit used.
    pub(crate) fn refusal_in(&self, tag: Tag, op: &Op, reset_at: Millis, now: Millis) -> Decision {
        let limit = op.limit.capacity();
        let d =
            Decision { allowed: false, limit, used: limit, remaining: 0, reset_at, retry_after: None, holds: false };
        self.refusal(tag, op, &Granted { units: 0, decision: d, holders: 0 }, now)
    }

    /// The refusal of `op` when the store granted too little: the window as this
    /// instance sees it.
    pub(crate) fn refusal(&self, tag: Tag, op: &Op, g: &Granted, now: Millis) -> Decision {
        let mut shard = self.shard(tag);
        match shard.get_mut(&(tag, op.key)).filter(|h| h.bucket() || h.window == g.decision.reset_at) {
            Some(h) => h.decision(0, false, now),
            None => {
                let retry_after = Some(g.decision.reset_at.saturating_sub(now));
                // a region's pool answers with what the region holds as its limit
                Decision { allowed: false, remaining: 0, retry_after, limit: op.limit.capacity(), ..g.decision }
            }
        }
    }

    /// Puts units spent by a request that was refused elsewhere (or refunded) back into
    /// the grants held (a fixed window's: of `window`), newest first, never past what a
    /// grant was granted (a unit spent from a grant since closed at the store must not
    /// come back into another: the store counts only what it granted). Returns the
    /// units it could not put back, for the store.
    pub(crate) fn put_back(&self, tag: Tag, key: u64, limit: &Limit, cost: u64, window: Millis) -> u64 {
        let mut shard = self.shard(tag);
        let held = |h: &&mut Held| h.limit == *limit && (h.bucket() || h.window == window);
        let Some(h) = shard.get_mut(&(tag, key)).filter(held) else {
            return cost;
        };
        let mut rest = cost;
        for p in h.parts.iter_mut().rev() {
            let back = rest.min(p.granted - p.left);
            p.left += back;
            rest -= back;
        }
        h.spent = h.spent.saturating_sub(cost - rest);
        rest
    }

    /// The units held unspent for `key` of `tag`.
    pub(crate) fn held(&self, tag: Tag, key: u64) -> u64 {
        self.shard(tag).get(&(tag, key)).map_or(0, Held::left)
    }

    /// Forgets the grants held for `keys` of `tag` (a reset deleted their state and its
    /// book at the store: there is nothing to give back, and they must not be spent).
    pub(crate) fn forget(&self, tag: Tag, keys: impl Iterator<Item = u64>) {
        let mut shard = self.shard(tag);
        for key in keys {
            shard.remove(&(tag, key));
        }
    }

    /// A grant asked for in the background failed: the next decision may ask again.
    pub(crate) fn refresh_failed(&self, tag: Tag, key: u64) {
        if let Some(h) = self.shard(tag).get_mut(&(tag, key)) {
            h.refreshing = false;
        }
    }

    /// Drops every grant when the overrides' generation moved (a reset somewhere in the
    /// fleet, an override changed), and those of keys idle for [`IDLE`]. Whether it
    /// moved.
    pub(crate) fn sweep(&self, generation: u64, now: Millis, out: &mut Leftovers) -> bool {
        let moved = self.generation.swap(generation, Relaxed) != generation;
        self.drop_idle(moved, now, out);
        moved
    }

    /// Drops the grants of keys idle for [`IDLE`] (and every grant if `all`), to give
    /// back: what [`Self::sweep`] does at a decision, for an instance that makes none (its
    /// region's allocator calls it every tick: units an instance no longer asked holds
    /// are hidden from its region's pool, and from the fleet's, until they go back).
    pub(crate) fn drop_idle(&self, all: bool, now: Millis, out: &mut Leftovers) {
        for shard in self.shards.iter() {
            shard.lock().unwrap_or_else(|p| p.into_inner()).retain(|&(tag, key), h| {
                h.lapse(now, out);
                let keep = !all && (h.bucket() || now < h.window) && now.saturating_sub(h.used_at) < IDLE;
                if !keep {
                    self.drop_held(tag, key, h, now, out);
                }
                keep
            });
        }
    }

    /// Every grant held, to give back (at shutdown).
    pub(crate) fn drain(&self, now: Millis, out: &mut Leftovers) {
        for shard in self.shards.iter() {
            let held: Vec<_> = shard.lock().unwrap_or_else(|p| p.into_inner()).drain().collect();
            for ((tag, key), h) in held {
                self.drop_held(tag, key, &h, now, out);
            }
        }
    }

    /// Counts `h`'s units as given back or lapsed.
    fn drop_held(&self, tag: Tag, key: u64, h: &Held, now: Millis, out: &mut Leftovers) {
        for p in h.parts.iter().filter(|p| p.left > 0) {
            if now >= p.lapses {
                out.expire(&h.rule, p.left);
            } else {
                let back = GiveBack { key, limit: h.limit, id: p.id, unspent: p.left, window: p.lapses, keep: 0 };
                out.give_back.push((tag, back, h.rule.clone()));
            }
        }
    }

    /// Gives `leftovers` back to `store` and counts them.
    pub(crate) async fn settle(&self, store: &dyn Store, leftovers: Leftovers, now: Millis) -> Result<(), StoreError> {
        let give_back = |(tag, back, rule): (Tag, GiveBack, Arc<GrantRule>)| async move {
            rule.counters.store_calls.increment(1);
            let units = store.give_back(tag, back, now).await?;
            self.stats.returned.fetch_add(units, Relaxed);
            rule.counters.returned.increment(units);
            Ok::<(), StoreError>(())
        };
        // a few dozen at a time (a revocation gives back every key held): one after
        // another, thousands of keys would take thousands of round trips
        let mut result = Ok(());
        let mut backs = leftovers.give_back.into_iter().peekable();
        while backs.peek().is_some() {
            let batch: Vec<_> = backs.by_ref().take(SETTLE_AT_ONCE).map(give_back).collect();
            // one lost in flight leaves its units charged until the window ends (an
            // under-admission, never an over-admission)
            for r in futures_util::future::join_all(batch).await {
                result = result.and(r);
            }
        }
        result
    }
}

#[cfg(test)]
mod tests;
