//! One limit across regions: quota grants one level up (escrow: O'Neil, TODS 1986; the
//! demarcation protocol of Barbara and Garcia-Molina).
//!
//! A global rule's window (a limit `L`, aligned to the clock so that every region agrees
//! where it starts and ends) lives in the *global store*. Regions take shares of it as
//! quota grants ([`super::grant`]), in the background, and give back what they will not
//! use. A region keeps what it holds in its own store as a [`Pool`]: a window whose
//! capacity is what the region holds rather than the limit. Its instances take their
//! grants from the pool as they take them from any window, so a decision on a client its
//! region already serves never calls the global store. One that finds the pool short (a
//! client new to the region) has the allocator's move made for it at once and waits for
//! it, bounded (`crate::regions`): a limit refuses only what does not fit.
//!
//! Two invariants bound what the fleet admits in a window:
//!
//! 1. In the global store, the units granted to regions never pass `L` (the grant
//!    algorithm's own invariant, in one atomic step of that store).
//! 2. A pool's capacity never passes what its region holds in the global store: the
//!    region adds to its pool ([`fill`]) only after the global store granted, and takes
//!    from its pool ([`drain`], only what is unspent there) before it gives back.
//!
//! So every region admits at most its pool's capacity, at most what it holds, and the
//! holdings sum to at most `L`. A step lost between the two stores (a process killed, a
//! link cut, a reply lost) leaves a capacity *below* the holding: units idle until the
//! window ends, never a unit spent twice. Each window is a state of its own (its key
//! names the window), so units taken ahead for the next window never meet this one's.
//!
//! [`plan`] is what a region's allocator does at each tick, from the region's recent
//! demand: hold enough for the next `horizon` (about twice the cross-region round trip
//! and a tick), ask for more before it runs out, and give back what it holds beyond
//! twice that, so that units follow demand from region to region.

use super::Limit;
use super::fixed_window::WindowState;
use super::grant::{self, Ask, GrantBook, Granted, Open};
use crate::time::Millis;

/// The key of the window of `limit` (a fixed window, aligned) that `now` is in, for the
/// state `key`: each window of a global limit is a state of its own, so units asked for
/// ahead of a window never meet the one before. Reversible: [`base_key`].
pub fn window_key(key: u64, limit: &Limit, now: Millis) -> u64 {
    key ^ mix(now / window_length(limit))
}

/// The state key [`window_key`] was made from, given the window's end.
pub fn base_key(window_key: u64, limit: &Limit, end: Millis) -> u64 {
    window_key ^ mix(end / window_length(limit) - 1)
}

/// The key of the window `at` is in, for the state whose window `from` was in is keyed
/// `key` (the same key when both are in one window).
pub fn rekey(key: u64, limit: &Limit, from: Millis, at: Millis) -> u64 {
    window_key(base_key(key, limit, window_end(limit, from)), limit, at)
}

/// The length of a global limit's window (a fixed window's; 1 for any other limit).
pub fn window_length(limit: &Limit) -> Millis {
    match *limit {
        Limit::FixedWindow { window, .. } => window.max(1),
        _ => 1,
    }
}

/// Where the aligned window of `limit` that `now` is in ends.
pub fn window_end(limit: &Limit, now: Millis) -> Millis {
    let window = window_length(limit);
    (now / window + 1) * window
}

/// A 64-bit mix of a window's number (splitmix64's finalizer): windows next to each
/// other give keys far apart.
fn mix(n: u64) -> u64 {
    let mut z = n.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A region's pool of one global window: what it holds (`cap`), what its instances took
/// (`used`), where the window ends; which allocator acts on it until when (`claim_until`:
/// one at a time, so that a region's instances do not all ask at once); the region's
/// recent demand, as its instances report it; and what the global store said was left
/// of the window when the region last asked (`left`; `None`: not asked in this window),
/// so that every instance of the region answers with the fleet's count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pool {
    pub cap: u64,
    pub used: u64,
    pub resets_at: Millis,
    pub claim_until: Millis,
    pub demand: Demand,
    pub left: Option<u64>,
}

/// Units asked for in a region (admitted or not) in two buckets of a set length: the one
/// that started at `at` (`this`), and the one before it (`before`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Demand {
    pub at: Millis,
    pub before: u64,
    pub this: u64,
}

impl Demand {
    /// Counts `arrived` units at `now`, in buckets of `bucket` ms.
    pub fn report(self, arrived: u64, bucket: Millis, now: Millis) -> Self {
        let d = match now.saturating_sub(self.at) {
            e if e < bucket => self,
            e if e < 2 * bucket => Demand { at: now, before: self.this, this: 0 },
            _ => Demand { at: now, before: 0, this: 0 },
        };
        Demand { this: d.this.saturating_add(arrived), ..d }
    }

    /// Units a second in the current bucket alone once it is `span` ms old, else over the
    /// last bucket and the current one ([`Self::per_s`]): a drop in demand shows within
    /// `span` rather than after two buckets.
    pub fn recent_per_s(&self, bucket: Millis, span: Millis, now: Millis) -> f64 {
        match now.saturating_sub(self.at) {
            e if e >= span && e < bucket => self.this as f64 * 1_000.0 / e as f64,
            _ => self.per_s(bucket, now),
        }
    }

    /// Units a second, over the last bucket and the current one.
    pub fn per_s(&self, bucket: Millis, now: Millis) -> f64 {
        let span = bucket + now.saturating_sub(self.at).min(bucket);
        (self.before + self.this) as f64 * 1_000.0 / span.max(1) as f64
    }
}

impl Pool {
    /// The pool as it stands for the window ending at `window_end`: empty if what is
    /// stored belongs to another window.
    pub fn of_window(self, window_end: Millis) -> Self {
        if self.resets_at == window_end { self } else { Pool { resets_at: window_end, ..Pool::default() } }
    }

    /// Units held and not yet taken by an instance.
    pub fn unspent(&self) -> u64 {
        self.cap.saturating_sub(self.used)
    }

    fn window(&self) -> WindowState {
        WindowState { used: self.used, resets_at: self.resets_at }
    }
}

/// What an allocator does to a pool, in one atomic step of the region's store, after
/// reporting the units its instance was asked for since its last call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// Nothing: read it.
    Read,
    /// Take the pool's claim for `ttl` ms, if no other allocator holds it: 1 if taken.
    Claim { ttl: Millis },
    /// Add units the global store granted ([`fill`]); the claim ends.
    Fill(u64),
    /// Take unspent units out, to give back ([`drain`]); the claim ends.
    Drain(u64),
    /// End the claim (a grant asked for and refused).
    Release,
}

/// One allocator call on the pool of the window ending at `end`: `arrived` units
/// reported and what the global store said was `left` recorded (if it said), then `act`.
/// Returns the units the act moved (a claim: 1 if taken) and the pool after it.
pub fn change(
    p: Pool,
    end: Millis,
    (arrived, left): (u64, Option<u64>),
    act: Act,
    (bucket, now): (Millis, Millis),
) -> (u64, Pool) {
    let p = p.of_window(end);
    let p = Pool { demand: p.demand.report(arrived, bucket, now), left: left.or(p.left), ..p };
    match act {
        Act::Read => (0, p),
        Act::Claim { ttl } if now >= p.claim_until => (1, Pool { claim_until: now + ttl, ..p }),
        Act::Claim { .. } => (0, p),
        Act::Fill(units) => (units, Pool { claim_until: 0, ..fill(p, units, end) }),
        Act::Drain(units) => {
            let (n, p) = drain(p, units, end);
            (n, Pool { claim_until: 0, ..p })
        }
        Act::Release => (0, Pool { claim_until: 0, ..p }),
    }
}

/// Adds `units` the global store granted for the window ending at `window_end`.
pub fn fill(p: Pool, units: u64, window_end: Millis) -> Pool {
    let p = p.of_window(window_end);
    Pool { cap: p.cap.saturating_add(units), ..p }
}

/// Takes up to `units` unspent units out of the pool, to give back to the global store:
/// returns how many it took (never more than is unspent) and the pool.
pub fn drain(p: Pool, units: u64, window_end: Millis) -> (u64, Pool) {
    let p = p.of_window(window_end);
    let n = units.min(p.unspent());
    (n, Pool { cap: p.cap - n, ..p })
}

/// An instance's grant from the pool: [`grant::grant`] with the pool's capacity as the
/// limit, so an instance never takes what the region does not hold.
pub fn grant(p: Pool, book: GrantBook, ask: &Ask, now: Millis) -> (Granted, Pool, GrantBook) {
    let (g, s, book) = grant::grant(p.window(), book, p.cap, ask, now);
    (g, Pool { used: s.used, ..p }, book)
}

/// An instance gives back `unspent` units of its grant `id` ([`grant::give_back`]).
pub fn give_back(p: Pool, book: GrantBook, id: u64, unspent: u64, window: Millis) -> (u64, Pool, GrantBook) {
    let (back, s, book) = grant::give_back(p.window(), book, (id, unspent, 0), window);
    (back, Pool { used: s.used, ..p }, book)
}

/// What a region's allocator does next for one global window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Move {
    /// Nothing: what is held fits the demand.
    Hold,
    /// Ask the global store for up to `want` more units, and at least `need` (nothing if
    /// fewer are left).
    Take { want: u64, need: u64 },
    /// Drain the units of `parts` from the pool, then give back each `(id, unspent)`:
    /// `unspent` units as part of grant `id`, which the global store then closes.
    GiveBack { parts: Vec<(u64, u64)> },
}

/// What a region knows of one global window: its demand (units asked for, admitted or
/// not, per second, lately; and in the current bucket alone, `recent_per_s`: what a
/// drop shows first), what is unspent in its pool, its grants open in the global
/// store, and what the global store said was left when it last answered (`None`: not
/// asked yet).
#[derive(Debug, Clone, Copy)]
pub struct Seen<'a> {
    pub demand_per_s: f64,
    pub recent_per_s: f64,
    pub unspent: u64,
    pub open: &'a [Open],
    pub left_globally: Option<u64>,
}

/// The region's next move for a window of which `left` ms remain. It holds the demand of
/// the next `horizon` ms (or of what is left of the window, if less): below that it asks
/// for twice that, and at least that much (the global store's grants are otherwise a
/// share of what is left, sized for a fleet of instances, not for a few regions) or what
/// is left globally if less; above twice that (the demand of the current bucket alone,
/// if lower: a region the demand left gives its units back within a tick, not two
/// buckets later) it gives back down to it, whole grants first, largest first, while
/// they fit in the excess (so later give-backs stay possible), then part of the smallest
/// left (its grant kept open for the rest).
pub fn plan(seen: Seen, horizon: Millis, left: Millis) -> Move {
    let Seen { demand_per_s, recent_per_s, unspent, open, left_globally } = seen;
    let of = |per_s: f64| (per_s * horizon.min(left) as f64 / 1_000.0).ceil() as u64;
    let target = of(demand_per_s);
    if unspent < target.max(1) && demand_per_s > 0.0 {
        // nothing left when last asked: ask again for anything (another region may have
        // given some back since)
        let need = (target - unspent.min(target)).max(1).min(left_globally.unwrap_or(u64::MAX).max(1));
        return Move::Take { want: 2 * target.max(1) - unspent, need };
    }
    let mut excess = unspent.saturating_sub(2 * of(recent_per_s.min(demand_per_s)));
    let mut grants: Vec<&Open> = open.iter().collect();
    grants.sort_by_key(|o| std::cmp::Reverse(o.units));
    let mut parts = Vec::new();
    for o in grants.iter().filter(|o| o.units > 0) {
        if o.units <= excess {
            parts.push((o.id, o.units));
            excess -= o.units;
        }
    }
    let smallest_left = grants.iter().rev().find(|o| !parts.iter().any(|(id, _)| *id == o.id));
    if let (true, Some(o)) = (excess > 0, smallest_left) {
        parts.push((o.id, excess.min(o.units)));
    }
    if parts.is_empty() { Move::Hold } else { Move::GiveBack { parts } }
}

/// The region's grants it may close as spent when it next asks (oldest first): as many
/// as leave open grants holding at least what is unspent in its pool, so that the global
/// store's book keeps only grants a give-back may still name.
pub fn spent(open: &[Open], unspent: u64) -> Vec<u64> {
    let mut held: u64 = open.iter().map(|o| o.units).sum();
    let mut ids = Vec::new();
    for o in open {
        if held - o.units < unspent {
            break;
        }
        held -= o.units;
        ids.push(o.id);
    }
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    const END: Millis = 60_000;

    fn open(id: u64, units: u64) -> Open {
        Open { id, units, expires: END }
    }

    #[test]
    fn each_window_has_its_own_key_and_gives_back_the_first() {
        let l = Limit::FixedWindow { limit: 10, window: 60_000, aligned: true };
        let (k1, k2) = (window_key(7, &l, 1_000), window_key(7, &l, 61_000));
        assert_ne!(k1, k2);
        assert_eq!(window_key(7, &l, 59_999), k1);
        assert_eq!((base_key(k1, &l, 60_000), base_key(k2, &l, 120_000)), (7, 7));
        assert_eq!((rekey(k1, &l, 1_000, 61_000), rekey(k1, &l, 1_000, 59_000)), (k2, k1), "a decision that waited");
    }

    #[test]
    fn a_pool_grants_no_more_than_the_region_holds() {
        let p = fill(Pool::default(), 10, END);
        let ask = Ask { need: 1, want: 100, id: 1, close: &[] };
        let (g, p, book) = grant(p, GrantBook::default(), &ask, 0);
        assert_eq!((g.units, p.used, p.cap), (5, 5, 10), "half of what is held, as grants share a window");
        let mut p = p;
        let mut book = book;
        let mut granted = g.units;
        for id in 2..100 {
            let (g, q, b) = grant(p, book, &Ask { need: 1, want: 100, id, close: &[] }, 0);
            (p, book, granted) = (q, b, granted + g.units);
        }
        assert_eq!((granted, p.unspent()), (10, 0), "all of it, and not a unit more");
        let (g, _, _) = grant(fill(p, 3, END), book, &Ask { need: 1, want: 100, id: 200, close: &[] }, 0);
        assert!(g.units > 0, "a fill makes room again");
    }

    #[test]
    fn a_drain_takes_only_what_is_unspent_and_another_window_is_empty() {
        let p = Pool { cap: 10, used: 7, resets_at: END, ..Pool::default() };
        assert_eq!(drain(p, 5, END), (3, Pool { cap: 7, ..p }));
        assert_eq!(drain(p, 5, END + 60_000), (0, Pool { resets_at: END + 60_000, ..Pool::default() }));
        assert_eq!(fill(p, 4, END + 60_000).cap, 4, "a fill of the next window starts from nothing");
        let (back, p, _) = give_back(p, GrantBook::default(), 9, 5, END);
        assert_eq!((back, p.used), (0, 7), "a grant the pool does not know gives back nothing");
    }

    #[test]
    fn one_allocator_at_a_time_and_the_region_s_demand_counted() {
        let at = |now| (100, now);
        let (claimed, p) = change(Pool::default(), END, (30, None), Act::Claim { ttl: 500 }, at(1_000));
        assert_eq!((claimed, p.claim_until, p.demand.this), (1, 1_500, 30));
        let (claimed, p) = change(p, END, (20, None), Act::Claim { ttl: 500 }, at(1_050));
        assert_eq!((claimed, p.demand.this), (0, 50), "another instance: not while it is held");
        let (filled, p) = change(p, END, (0, None), Act::Fill(40), at(1_120));
        assert_eq!((filled, p.cap, p.claim_until), (40, 40, 0), "a fill ends the claim");
        assert_eq!(p.demand, Demand { at: 1_120, before: 50, this: 0 }, "a new bucket");
        assert_eq!(p.demand.per_s(100, 1_170), 50.0 * 1_000.0 / 150.0);
        let (claimed, p) = change(p, END, (0, None), Act::Claim { ttl: 500 }, at(1_200));
        let (_, p) = change(p, END, (0, None), Act::Release, at(1_210));
        assert_eq!((claimed, p.claim_until), (1, 0));
        let (drained, p) = change(Pool { used: 35, ..p }, END, (0, None), Act::Drain(10), at(1_220));
        assert_eq!((drained, p.cap), (5, 35), "only what is unspent");
        let (_, p) = change(p, END, (0, None), Act::Read, at(2_000));
        assert_eq!(p.demand, Demand { at: 2_000, before: 0, this: 0 }, "long quiet: no demand");
        assert_eq!(change(p, END + 60_000, (0, None), Act::Read, at(2_000)).1.cap, 0, "the next window's is its own");
    }

    fn seen(demand_per_s: f64, unspent: u64, open: &[Open]) -> Seen<'_> {
        Seen { demand_per_s, recent_per_s: demand_per_s, unspent, open, left_globally: None }
    }

    #[test]
    fn the_plan_follows_demand_with_room_either_way() {
        // 100 units a second, a horizon of 300 ms: 30 held
        assert_eq!(plan(seen(100.0, 10, &[]), 300, 60_000), Move::Take { want: 50, need: 20 });
        let nearly_out = Seen { left_globally: Some(7), ..seen(100.0, 10, &[]) };
        assert_eq!(plan(nearly_out, 300, 60_000), Move::Take { want: 50, need: 7 }, "what is left, if less");
        let out = Seen { left_globally: Some(0), ..seen(100.0, 10, &[]) };
        assert_eq!(plan(out, 300, 60_000), Move::Take { want: 50, need: 1 }, "anything another gave back");
        assert_eq!(plan(seen(100.0, 45, &[open(1, 45)]), 300, 60_000), Move::Hold, "up to twice the target");
        let one = [open(1, 20)];
        let near_end = seen(100.0, 20, &one);
        assert_eq!(plan(near_end, 300, 100), Move::Hold, "near the end, the window's rest is the horizon");
        assert_eq!(plan(seen(0.0, 0, &[]), 300, 60_000), Move::Hold, "no demand, nothing asked");
        let grants = [open(1, 20), open(2, 50), open(3, 5)];
        let back = Move::GiveBack { parts: vec![(2, 50), (3, 5), (1, 5)] };
        assert_eq!(plan(seen(0.0, 60, &grants), 300, 60_000), back, "whole grants, largest first, then a part");
        let back = Move::GiveBack { parts: vec![(4, 74)] };
        assert_eq!(plan(seen(10.0, 80, &[open(4, 90)]), 300, 60_000), back, "a part of one too large");
        assert_eq!(plan(seen(0.0, 3, &[]), 300, 60_000), Move::Hold, "nothing to give back through");
    }

    #[test]
    fn a_drop_in_demand_gives_back_within_a_tick() {
        // 100 a second lately, 10 a second in the bucket now a tick old: 45 held (room
        // for 100 a second) is given back down to 6 (twice 10 a second's 3)
        let d = Demand { at: 1_000, before: 30, this: 1 };
        assert_eq!(d.recent_per_s(300, 100, 1_050), d.per_s(300, 1_050), "too young a bucket: both");
        assert_eq!(d.recent_per_s(300, 100, 1_100), 10.0);
        let one = [open(1, 45)];
        let dropped = Seen { recent_per_s: 10.0, ..seen(100.0, 45, &one) };
        assert_eq!(plan(dropped, 300, 60_000), Move::GiveBack { parts: vec![(1, 39)] });
        let risen = Seen { recent_per_s: 300.0, ..seen(100.0, 45, &one) };
        assert_eq!(plan(risen, 300, 60_000), Move::Hold, "a rise asks by the demand, as before");
    }

    #[test]
    fn spent_grants_are_the_oldest_that_leave_the_unspent_covered() {
        let grants = [open(1, 10), open(2, 10), open(3, 10)];
        assert_eq!(spent(&grants, 12), [1], "20 left open cover 12");
        assert_eq!(spent(&grants, 0), [1, 2, 3]);
        assert!(spent(&grants, 25).is_empty());
    }
}
