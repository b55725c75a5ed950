//! The embedded store: the pure algorithms under a lock.
//!
//! State is split over shards by client tag; one shard's mutex covers every op of one
//! call, which makes a call atomic.
//!
//! The store is bounded, and a flood of new clients cannot buy anyone quota: when a
//! shard is full it collects state whose time has passed (a window after its reset, a
//! full bucket), and when that frees nothing, it **never evicts live state** (a forgotten
//! window is a fresh limit: a client sending unique keys would wipe real clients' counts
//! mid-window). The call that needs room answers [`StoreError::Full`] instead, so the
//! policy's failure mode decides for that new client (fail-open admits it uncounted,
//! fail-closed refuses it) while every client already held keeps its exact count. Room
//! comes back as windows end; [`MemoryStats::full`] counts the calls that found none.

use super::{
    Commit, GiveBack, GrantAsk, Hold, LocalRegistry, PoolCall, Refund, RegistryOp, RegistryReply, Reservation, Settled,
    Store, StoreError, no_grants_for, only_windows,
};
use crate::algo::grant::{self, GrantBook, Granted, Open};
use crate::algo::pool::{self, Pool};
use crate::algo::reservation::{self, Ledger};
use crate::algo::{self, ConcurrencyState, Decision, Lease, Limit, Op, State};
use crate::tag::Tag;
use crate::time::Millis;
use async_trait::async_trait;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Keys are already keyed hashes (see [`crate::tag`]), so hashing them again is wasted
/// work: fold them into a u64 and multiply to spread the bits.
#[derive(Default)]
struct FoldHasher(u64);

impl Hasher for FoldHasher {
    fn finish(&self) -> u64 {
        // a multiply only carries low bits upward; fold the high half back down, since
        // the table picks buckets by the low bits
        let h = crate::hash::spread(self.0);
        h ^ (h >> 32)
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(29) ^ n).wrapping_mul(0xff51_afd7_ed55_8ccd);
    }
}

type Map = HashMap<Slot, Entry, BuildHasherDefault<FoldHasher>>;

/// Where one state lives: the client tag and the state key folded into 128 bits, held as
/// two u64 so a table slot is 8-byte aligned (a `u128` would pad every slot to 16). Tags
/// are keyed 128-bit hashes and the fold is a bijection in each argument, so two states
/// share a slot only by a 128-bit collision.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Slot(u64, u64);

fn slot(tag: Tag, key: u64) -> Slot {
    Slot(tag.0 as u64 ^ crate::hash::spread(key), (tag.0 >> 64) as u64)
}

struct Entry {
    state: State,
    /// When the state stops mattering (see [`Limit::expires_at`]).
    expires_at: Millis,
}

struct Shard {
    map: Map,
    /// The open quota grants of granted windows (see [`crate::algo::grant`]).
    books: HashMap<Slot, GrantBook, BuildHasherDefault<FoldHasher>>,
    /// The reservations of windows that have some (see [`crate::algo::reservation`]).
    ledgers: HashMap<Slot, Ledger, BuildHasherDefault<FoldHasher>>,
    /// Regional pools of global windows (see [`crate::algo::pool`]): all but `used`,
    /// which is the window's.
    pools: HashMap<Slot, Pool, BuildHasherDefault<FoldHasher>>,
    /// Collecting scans the shard; do it at most once a second.
    next_collect: Millis,
}

/// Counters an operator watches.
#[derive(Debug, Default)]
pub struct MemoryStats {
    /// States dropped because their time had passed.
    pub collected: AtomicU64,
    /// Calls refused room for a new client's state because the store was full (the
    /// policy's failure mode decided them).
    pub full: AtomicU64,
}

/// The in-memory store.
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    per_shard: usize,
    stats: MemoryStats,
    registry: LocalRegistry,
}

const SHARDS: usize = 64;

impl MemoryStore {
    /// A store holding at most about `max_keys` states (one per policy per client).
    pub fn new(max_keys: usize) -> Self {
        let shards = (0..SHARDS)
            .map(|_| {
                Mutex::new(Shard {
                    map: Map::default(),
                    books: Default::default(),
                    ledgers: Default::default(),
                    pools: Default::default(),
                    next_collect: 0,
                })
            })
            .collect();
        let per_shard = max_keys.div_ceil(SHARDS).max(1);
        Self { shards, per_shard, stats: MemoryStats::default(), registry: LocalRegistry::default() }
    }

    /// Eviction and collection counters.
    pub fn stats(&self) -> &MemoryStats {
        &self.stats
    }

    /// How many states are held.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).map.len()).sum()
    }

    /// Whether no state is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every state whose time has passed. The server calls it periodically; the
    /// store also collects by itself when a shard fills up.
    pub fn collect(&self, now: Millis) {
        for s in self.shards.iter() {
            self.collect_shard(&mut lock(s), now);
        }
    }

    /// Collects expired state every `every` in the background (on the current tokio
    /// runtime), and publishes the store's size and evictions as metrics, until the
    /// store is dropped.
    pub fn collect_in_background(
        self: &std::sync::Arc<Self>,
        clock: std::sync::Arc<dyn crate::time::Clock>,
        every: std::time::Duration,
    ) {
        let store = std::sync::Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                let Some(store) = store.upgrade() else { return };
                store.collect(clock.now());
                let stats = store.stats();
                crate::telemetry::memory_store(
                    store.len(),
                    stats.collected.load(Ordering::Relaxed),
                    stats.full.load(Ordering::Relaxed),
                );
            }
        });
    }

    fn collect_shard(&self, shard: &mut Shard, now: Millis) {
        let before = shard.map.len();
        shard.map.retain(|_, e| e.expires_at > now);
        shard.books.retain(|_, b| b.expires() + grant::SKEW > now);
        shard.pools.retain(|_, p| p.resets_at > now);
        // a ledger lives as long as its window: a hold past its deadline is given back
        // when the window is next touched, however late (collected at the hold's own
        // deadline, its units were never given back)
        let Shard { map, ledgers, .. } = shard;
        ledgers.retain(|at, l| l.expires() > now || map.contains_key(at));
        shard.next_collect = now + 1000;
        self.stats.collected.fetch_add((before - shard.map.len()) as u64, Ordering::Relaxed);
    }

    fn shard(&self, tag: Tag) -> MutexGuard<'_, Shard> {
        // the high bits pick the shard (the low bits are what the table inside uses first)
        lock(&self.shards[((tag.0 >> 64) as usize) % SHARDS])
    }

    /// [`Store::apply`] without the future: the in-process fast path, writing decisions
    /// into `out`. [`StoreError::Full`] when a new state finds no room (nothing written).
    pub fn apply_into(&self, tag: Tag, ops: &[Op], now: Millis, out: &mut Vec<Decision>) -> Result<(), StoreError> {
        let mut shard = self.shard(tag);
        if shard.ledgers.is_empty() {
            return self.apply_locked(&mut shard, tag, ops, now, out);
        }
        // reservations past their deadline give their units back before anything counts
        for op in ops {
            Self::settle_lapsed(&mut shard, slot(tag, op.key), &op.limit, now);
        }
        let from = out.len();
        self.apply_locked(&mut shard, tag, ops, now, out)?;
        for (op, d) in ops.iter().zip(&mut out[from..]) {
            if let Some(l) = shard.ledgers.get(&slot(tag, op.key)) {
                *d = reservation::with_holds(*d, l, now);
            }
        }
        Ok(())
    }

    fn apply_locked(
        &self,
        shard: &mut Shard,
        tag: Tag,
        ops: &[Op],
        now: Millis,
        out: &mut Vec<Decision>,
    ) -> Result<(), StoreError> {
        // the common case, one limit: one lookup, no allocation
        if let [op] = ops {
            let key = slot(tag, op.key);
            if let Some(e) = shard.map.get_mut(&key) {
                let (d, expires_at) = algo::apply_one(op, &mut e.state, now);
                e.expires_at = expires_at;
                out.push(d);
                return Ok(());
            }
        }
        // counting the new states costs a lookup each: only when the shard may be full
        if shard.map.len() + ops.len() > self.per_shard {
            let new = ops.iter().filter(|op| !shard.map.contains_key(&slot(tag, op.key))).count();
            self.make_room(shard, new, now)?;
        }
        let mut states: Vec<Option<State>> =
            ops.iter().map(|op| shard.map.get_mut(&slot(tag, op.key)).map(|e| std::mem::take(&mut e.state))).collect();
        algo::apply_into(ops, &mut states, now, out);
        for (op, state) in ops.iter().zip(states) {
            if let Some(state) = state {
                let expires_at = op.limit.expires_at(&state);
                shard.map.insert(slot(tag, op.key), Entry { state, expires_at });
            }
        }
        Ok(())
    }

    /// Ensures room for `new` more states: collects expired state when the shard is
    /// full (at most once a second), and never evicts live state (see the module doc).
    fn make_room(&self, shard: &mut Shard, new: usize, now: Millis) -> Result<(), StoreError> {
        if new == 0 || shard.map.len() + new <= self.per_shard {
            return Ok(());
        }
        if now >= shard.next_collect {
            self.collect_shard(shard, now);
        }
        if shard.map.len() + new <= self.per_shard {
            return Ok(());
        }
        self.stats.full.fetch_add(1, Ordering::Relaxed);
        Err(StoreError::Full)
    }

    /// Replaces a state already held (a refund never creates one).
    fn replace(shard: &mut Shard, key: Slot, limit: Limit, state: State) {
        if let Some(e) = shard.map.get_mut(&key) {
            *e = Entry { expires_at: limit.expires_at(&state), state };
        }
    }

    /// Brings a window with reservations and its ledger to `now` (a lapsed hold's units
    /// back, see [`reservation::normalize`]).
    fn settle_lapsed(shard: &mut Shard, at: Slot, limit: &Limit, now: Millis) {
        let Some(Entry { state: State::Window(s), .. }) = shard.map.get(&at) else { return };
        // nothing due (the common case): no write
        if !shard.ledgers.get(&at).is_some_and(|l| l.due(s.resets_at, now)) {
            return;
        }
        let (s, ledger) = Self::reserved(shard, at, limit, now);
        Self::put_reserved(shard, at, limit, s, ledger);
    }

    /// Stores a window and its ledger.
    fn put_reserved(shard: &mut Shard, at: Slot, limit: &Limit, s: algo::WindowState, ledger: Ledger) {
        let state = State::Window(s);
        let expires_at = limit.expires_at(&state).max(ledger.expires());
        shard.map.insert(at, Entry { state, expires_at });
        match ledger.open.is_empty() && ledger.settled.is_empty() {
            true => shard.ledgers.remove(&at),
            false => shard.ledgers.insert(at, ledger),
        };
    }

    /// A fixed window and its ledger, taken out of the shard and brought to `now` (fresh
    /// when there is none), for [`MemoryStore::put_reserved`] to put back.
    fn reserved(shard: &mut Shard, at: Slot, limit: &Limit, now: Millis) -> (algo::WindowState, Ledger) {
        let ledger = shard.ledgers.remove(&at).unwrap_or_default();
        reservation::normalize(Self::window(shard, at), ledger, window_of(limit), now)
    }

    /// The fixed window stored at `at` (a fresh one when there is none).
    fn window(shard: &Shard, at: Slot) -> algo::WindowState {
        match shard.map.get(&at) {
            Some(Entry { state: State::Window(s), .. }) => *s,
            _ => algo::WindowState::default(),
        }
    }

    fn get(shard: &Shard, tag: Tag, key: u64) -> Option<State> {
        shard.map.get(&slot(tag, key)).map(|e| e.state.clone())
    }

    /// A granted state and its book, as stored (fresh when there is none).
    fn granted(shard: &Shard, at: Slot, limit: &Limit, now: Millis) -> (State, GrantBook) {
        let state = shard.map.get(&at).map_or_else(|| limit.fresh(now), |e| e.state.clone());
        (state, shard.books.get(&at).cloned().unwrap_or_default())
    }

    /// Stores a granted state and its book (the book may outlive the state: a token
    /// bucket's grants lapse after it is full).
    fn put_granted(shard: &mut Shard, at: Slot, limit: &Limit, state: State, book: GrantBook) {
        let expires_at = limit.expires_at(&state);
        shard.map.insert(at, Entry { state, expires_at });
        match book.open.is_empty() {
            true => shard.books.remove(&at),
            false => shard.books.insert(at, book),
        };
    }
}

/// A fixed window's length and alignment (reservations take nothing else:
/// [`only_windows`] checked).
fn window_of(limit: &Limit) -> (Millis, bool) {
    match *limit {
        Limit::FixedWindow { window, aligned, .. } => (window, aligned),
        _ => (1, false),
    }
}

/// A poisoned lock only means another thread panicked while holding it; the state
/// inside is still whole (every write is a single assignment), so keep going.
fn lock(m: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[async_trait]
impl Store for MemoryStore {
    async fn apply(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
        let mut out = Vec::with_capacity(ops.len());
        self.apply_into(tag, ops, now, &mut out)?;
        Ok(out)
    }

    async fn peek(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
        let shard = self.shard(tag);
        // a window with reservations reads as brought to now (lapsed holds given back)
        let state = |op: &Op| match shard.ledgers.get(&slot(tag, op.key)) {
            Some(l) if matches!(op.limit, Limit::FixedWindow { .. }) => {
                let s = Self::window(&shard, slot(tag, op.key));
                Some(State::Window(reservation::state_at(s, l, window_of(&op.limit), now)))
            }
            _ => Self::get(&shard, tag, op.key),
        };
        let states = ops.iter().map(state).collect();
        let mut out = algo::peek_all(ops, states, now);
        for (op, d) in ops.iter().zip(&mut out) {
            let at = slot(tag, op.key);
            if let Some(l) = shard.ledgers.get(&at).filter(|_| now < Self::window(&shard, at).resets_at) {
                *d = reservation::with_holds(*d, l, now);
            }
        }
        Ok(out)
    }

    async fn release(&self, tag: Tag, keys: &[u64], lease: Lease, _now: Millis) -> Result<bool, StoreError> {
        let mut shard = self.shard(tag);
        let mut held = false;
        for key in keys {
            if let Some(Entry { state: State::Leases(s), .. }) = shard.map.get_mut(&slot(tag, *key)) {
                held |= algo::concurrency::release(s, lease);
            }
        }
        Ok(held)
    }

    async fn leases(&self, tag: Tag, key: u64, ttl: Millis, now: Millis) -> Result<ConcurrencyState, StoreError> {
        match Self::get(&self.shard(tag), tag, key) {
            Some(State::Leases(s)) => Ok(algo::concurrency::normalize(s, ttl, now)),
            _ => Ok(ConcurrencyState::default()),
        }
    }

    async fn refund(&self, tag: Tag, refunds: &[Refund], now: Millis) -> Result<(), StoreError> {
        let mut shard = self.shard(tag);
        for r in refunds {
            let Some(state) = Self::get(&shard, tag, r.key) else {
                continue;
            };
            // a token bucket's open grants hold its refill back (algo::grant)
            let refunded = match (r.limit, state, shard.books.get(&slot(tag, r.key))) {
                (Limit::TokenBucket { rate, per, burst }, State::Bucket(s), Some(book)) => {
                    Some(State::Bucket(grant::bucket_refund(s, book, (rate, per, burst), r.cost, now)))
                }
                (limit, state, _) => limit.refund(state, r.cost, r.window, now),
            };
            if let Some(state) = refunded {
                Self::replace(&mut shard, slot(tag, r.key), r.limit, state);
            }
        }
        Ok(())
    }

    async fn reset(&self, tag: Tag, ops: &[Op], _now: Millis) -> Result<(), StoreError> {
        let mut shard = self.shard(tag);
        for op in ops {
            shard.map.remove(&slot(tag, op.key));
            shard.books.remove(&slot(tag, op.key));
            shard.ledgers.remove(&slot(tag, op.key));
            shard.pools.remove(&slot(tag, op.key));
        }
        Ok(())
    }

    fn grants(&self) -> bool {
        true
    }

    async fn grant(&self, tag: Tag, ask: GrantAsk, now: Millis) -> Result<Granted, StoreError> {
        let mut shard = self.shard(tag);
        let at = slot(tag, ask.key);
        if !shard.map.contains_key(&at) {
            self.make_room(&mut shard, 1, now)?;
        }
        // lapsed reservations give their units back first, as for a decision
        Self::settle_lapsed(&mut shard, at, &ask.limit, now);
        let (state, book) = Self::granted(&shard, at, &ask.limit, now);
        let a = grant::Ask { need: ask.need, want: ask.want, id: ask.id, close: &ask.close };
        let (granted, state, book) = match (ask.limit, state) {
            (Limit::FixedWindow { limit, window, aligned }, State::Window(s)) => {
                let s = algo::fixed_window::normalize(s, window, aligned, now);
                // a region's pool: what the region holds bounds it
                let pool = shard.pools.get(&at).map(|p| p.of_window(s.resets_at));
                let limit = if ask.pool { pool.map_or(0, |p| p.cap) } else { limit };
                let (g, s, book) = grant::grant(s, book, limit, &a, now);
                (g, State::Window(s), book)
            }
            (Limit::TokenBucket { rate, per, burst }, State::Bucket(s)) => {
                let (g, s, book) = grant::bucket_grant(s, book, (rate, per, burst), &a, now);
                (g, State::Bucket(s), book)
            }
            (limit, _) => return Err(no_grants_for(&limit)),
        };
        Self::put_granted(&mut shard, at, &ask.limit, state, book);
        match shard.ledgers.get(&at) {
            Some(l) => Ok(Granted { decision: reservation::with_holds(granted.decision, l, now), ..granted }),
            None => Ok(granted),
        }
    }

    async fn give_back(&self, tag: Tag, back: GiveBack, now: Millis) -> Result<u64, StoreError> {
        let mut shard = self.shard(tag);
        let at = slot(tag, back.key);
        if !shard.books.contains_key(&at) {
            return Ok(0);
        }
        let (state, book) = Self::granted(&shard, at, &back.limit, now);
        let (units, state, book) = match (back.limit, state) {
            (Limit::FixedWindow { window, aligned, .. }, State::Window(s)) => {
                let s = algo::fixed_window::normalize(s, window, aligned, now);
                let (units, s, book) = grant::give_back(s, book, (back.id, back.unspent, back.keep), back.window);
                (units, State::Window(s), book)
            }
            (Limit::TokenBucket { rate, per, burst }, State::Bucket(s)) => {
                let (units, s, book) = grant::bucket_give_back(s, book, (rate, per, burst), back.id, back.unspent, now);
                (units, State::Bucket(s), book)
            }
            (limit, _) => return Err(no_grants_for(&limit)),
        };
        Self::put_granted(&mut shard, at, &back.limit, state, book);
        Ok(units)
    }

    fn pools(&self) -> bool {
        true
    }

    async fn pool(&self, tag: Tag, call: PoolCall, now: Millis) -> Result<(u64, Pool), StoreError> {
        let mut shard = self.shard(tag);
        let at = slot(tag, call.key);
        let window = Self::window(&shard, at);
        let used = if window.resets_at == call.end { window.used } else { 0 };
        let kept = shard.pools.get(&at).copied().unwrap_or_default();
        let (moved, pool) =
            pool::change(Pool { used, ..kept }, call.end, (call.arrived, call.left), call.act, (call.bucket, now));
        shard.pools.insert(at, pool);
        Ok((moved, pool))
    }

    fn reservations(&self) -> bool {
        true
    }

    async fn reserve(&self, tag: Tag, ops: &[Op], r: Reservation, now: Millis) -> Result<Vec<Decision>, StoreError> {
        only_windows(ops.iter().map(|op| &op.limit))?;
        let mut shard = self.shard(tag);
        let new = ops.iter().filter(|op| !shard.map.contains_key(&slot(tag, op.key))).count();
        self.make_room(&mut shard, new, now)?;
        let mut held = Vec::with_capacity(ops.len());
        for op in ops {
            let (s, ledger) = Self::reserved(&mut shard, slot(tag, op.key), &op.limit, now);
            let (d, next) = reservation::reserve(s, &ledger, op.limit.capacity(), (r.id, op.cost, r.ttl), now);
            held.push((op, d, s, ledger, next));
        }
        let admitted = held.iter().all(|(op, d, ..)| op.shadow || d.allowed);
        let mut out = Vec::with_capacity(ops.len());
        for (op, d, s, mut ledger, next) in held {
            // refused as a whole: the windows as brought to now, nothing held
            // reservation::reserve marked the decision for the holds open; a hold it adds too
            let s = match next {
                Some((charged, hold)) if admitted => {
                    out.push(Decision { holds: d.holds || hold.is_some(), ..d });
                    ledger.open.extend(hold);
                    charged
                }
                _ => {
                    out.push(d);
                    s
                }
            };
            Self::put_reserved(&mut shard, slot(tag, op.key), &op.limit, s, ledger);
        }
        Ok(out)
    }

    async fn commit(&self, tag: Tag, id: u64, commits: &[Commit], now: Millis) -> Result<Vec<Settled>, StoreError> {
        only_windows(commits.iter().map(|c| &c.limit))?;
        let mut shard = self.shard(tag);
        let mut out = Vec::with_capacity(commits.len());
        for c in commits {
            let at = slot(tag, c.key);
            let (s, ledger) = Self::reserved(&mut shard, at, &c.limit, now);
            let (settled, s, ledger) = reservation::commit(s, ledger, id, c.actual, now);
            Self::put_reserved(&mut shard, at, &c.limit, s, ledger);
            out.push(settled);
        }
        Ok(out)
    }

    async fn holds(&self, tag: Tag, key: u64, limit: &Limit, now: Millis) -> Result<Vec<Hold>, StoreError> {
        only_windows(std::iter::once(limit))?;
        let shard = self.shard(tag);
        let at = slot(tag, key);
        let (Some(State::Window(s)), Some(ledger)) = (shard.map.get(&at).map(|e| &e.state), shard.ledgers.get(&at))
        else {
            return Ok(Vec::new());
        };
        let open = ledger.open.iter().filter(|h| now < s.resets_at && h.expires > now);
        Ok(open.copied().collect())
    }

    async fn grants_open(&self, tag: Tag, key: u64, limit: &Limit, now: Millis) -> Result<Vec<Open>, StoreError> {
        only_windows(std::iter::once(limit))?;
        let shard = self.shard(tag);
        let (State::Window(s), book) = Self::granted(&shard, slot(tag, key), limit, now) else {
            return Ok(Vec::new());
        };
        Ok(if now < s.resets_at { book.of_window(s.resets_at).open } else { Vec::new() })
    }

    fn keeps_registry(&self) -> bool {
        true
    }

    async fn registry(&self, op: RegistryOp) -> Result<RegistryReply, StoreError> {
        Ok(self.registry.run(op))
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests;
