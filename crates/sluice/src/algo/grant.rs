//! Quota grants (escrow: O'Neil, TODS 1986), on fixed windows and token buckets.
//!
//! An instance takes a *grant* of units from a shared limit in one atomic step, spends
//! them in process memory, and gives back what it did not spend. Granting takes the
//! units from the shared state at once, so the shared count never passes the limit and
//! neither can the fleet: units granted and never spent (an instance that crashed, a
//! window that ended) are only ever admitted less, never more.
//!
//! Beside the state, the store keeps a [`GrantBook`]: the grants still open, by id. A
//! give-back names its grant; it takes effect once and closes the grant, so a give-back
//! sent twice (a retry after a lost reply) gives back once. A grant call also closes the
//! caller's grants it names as spent.
//!
//! *Fixed windows.* A book belongs to one window: when the window restarts, its grants
//! lapse with it.
//!
//! *Token buckets.* A bucket refills, so units taken early and spent late could meet a
//! bucket that refilled meanwhile (a grant of the whole burst spent just before the
//! bucket is full again: twice the burst at once). The book is what keeps it exact: the
//! units of open grants count as *in the bucket* for its refill, which fills only up to
//! `burst - open units`. Then tokens in the bucket plus units held by instances never
//! pass the burst, they grow only by the refill, and whatever the instances spend, when,
//! is a schedule a single bucket would have admitted. A bucket's grant lapses
//! [`BUCKET_TTL`] after it was taken at its holder, and [`SKEW`] later at the store, so a
//! holder whose clock is behind by less than that never spends a unit the store no
//! longer counts. Closing a spent grant, or giving one back, refills under the open
//! units as they were, then removes them: the order keeps the bound.

use super::Decision;
use super::fixed_window::{self, WindowState};
use super::token_bucket::{self, BucketState};
use crate::time::Millis;

/// One open grant: its id, its units, and when it lapses (a fixed window's reset; a
/// token bucket grant's deadline at its holder).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Open {
    pub id: u64,
    pub units: u64,
    pub expires: Millis,
}

/// The grants open on one state, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GrantBook {
    pub open: Vec<Open>,
}

/// Open grants a book holds at most: every instance holds one or two at a time, so this
/// is a fleet of 32 or more. A window's grant past it closes the oldest (its holder can
/// no longer give it back: an under-admission); a bucket's is not granted (closing it
/// would hand its units out twice).
pub const MAX_OPEN: usize = 64;

/// How long a token bucket's grant may be spent, from the moment it was asked for.
pub const BUCKET_TTL: Millis = 1_000;

/// How much later than its holder the store lets a bucket's grant lapse: the clock skew
/// between instances that grants on token buckets tolerate.
pub const SKEW: Millis = 1_000;

impl GrantBook {
    /// The book as it stands in window `window`: only that window's grants.
    pub fn of_window(mut self, window: Millis) -> Self {
        self.open.retain(|o| o.expires == window);
        self
    }

    /// Units held by open grants.
    pub fn units(&self) -> u64 {
        self.open.iter().map(|o| o.units).sum()
    }

    /// When the book stops mattering: its last grant's lapse (0: empty).
    pub fn expires(&self) -> Millis {
        self.open.iter().map(|o| o.expires).max().unwrap_or(0)
    }

    /// Closes the grants `ids` (spent by their holder), if open.
    fn close(&mut self, ids: &[u64]) {
        if !ids.is_empty() {
            self.open.retain(|o| !ids.contains(&o.id));
        }
    }

    /// Grant `id`, if open with `held` units, keeps `keep` of them: the units it held.
    fn shrink(&mut self, id: u64, held: u64, keep: u64) -> Option<u64> {
        let o = self.open.iter_mut().find(|o| o.id == id && o.units == held)?;
        o.units = keep;
        Some(held)
    }

    /// Removes grant `id`; its units if it was open.
    fn take(&mut self, id: u64) -> Option<u64> {
        let at = self.open.iter().position(|o| o.id == id)?;
        Some(self.open.remove(at).units)
    }
}

/// What one grant call asks for: up to `want` units, at least `need`, as grant `id`,
/// and the caller's grants in `close` are spent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask<'a> {
    pub need: u64,
    pub want: u64,
    pub id: u64,
    pub close: &'a [u64],
}

/// What one grant call answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granted {
    /// Units granted: 0 when fewer than `need` are left.
    pub units: u64,
    /// The state after the grant, as a status request would report it.
    pub decision: Decision,
    /// Grants open after this one, this one included.
    pub holders: u64,
}

/// How many units a grant may take from `remaining`, when `open` grants are already out
/// and the caller wants `want` and needs at least `need`: at most a share of what is
/// left, `remaining / (2 x (open + 1))`, so the end of a window is handed out in ever
/// smaller pieces and no holder sits on much of it; at least `need` (one request's
/// cost), or nothing when less than that is left.
pub fn size(remaining: u64, open: u64, need: u64, want: u64) -> u64 {
    if remaining < need.max(1) {
        return 0;
    }
    let share = (remaining / (2 * (open + 1))).max(1);
    want.min(share).max(need).min(remaining)
}

/// Grants a share of a window of `limit`, normalized to `now` (see [`size`]). Returns
/// the answer, the charged window and the book to store.
pub fn grant(s: WindowState, book: GrantBook, limit: u64, ask: &Ask, now: Millis) -> (Granted, WindowState, GrantBook) {
    let mut book = book.of_window(s.resets_at);
    book.close(ask.close);
    let units = size(limit.saturating_sub(s.used), book.open.len() as u64, ask.need, ask.want);
    let s = WindowState { used: s.used + units, ..s };
    if units > 0 {
        if book.open.len() >= MAX_OPEN {
            book.open.remove(0);
        }
        book.open.push(Open { id: ask.id, units, expires: s.resets_at });
    }
    let decision = fixed_window::charge(s, limit, 0, now).0;
    (Granted { units, decision, holders: book.open.len() as u64 }, s, book)
}

/// Gives back `unspent` units of grant `id` taken in window `window`, once. With `keep`
/// 0 the grant is closed, and a second give-back of it changes nothing. With `keep` > 0
/// it is a part: the grant stays open holding `keep` units, and only if it held
/// `unspent + keep` (what its holder knew), so a part sent twice (a retry after a lost
/// reply) is given back once, and the rest can still be given back later (a region whose
/// demand left gives back through it). Never more than the grant was, never into another
/// window. Returns the units given back and the new state.
pub fn give_back(
    s: WindowState,
    book: GrantBook,
    (id, unspent, keep): (u64, u64, u64),
    window: Millis,
) -> (u64, WindowState, GrantBook) {
    let mut book = book.of_window(s.resets_at);
    if s.resets_at != window {
        return (0, s, book);
    }
    let units = match keep {
        0 => book.take(id),
        _ => book.shrink(id, unspent.saturating_add(keep), keep),
    };
    let Some(units) = units else { return (0, s, book) };
    let back = unspent.min(units).min(s.used);
    (back, WindowState { used: s.used - back, ..s }, book)
}

/// A token bucket of `rate` per `per` and `burst`, with its book, brought to `now`: it
/// refills only up to `burst` less the units of open grants; then the grants that
/// lapsed ([`SKEW`] after their holder stopped spending them) leave the book.
pub fn bucket_normalize(
    s: BucketState,
    mut book: GrantBook,
    (rate, per, burst): (u64, Millis, u64),
    now: Millis,
) -> (BucketState, GrantBook) {
    let s = token_bucket::normalize(s, rate, per, burst.saturating_sub(book.units()), now);
    book.open.retain(|o| o.expires + SKEW > now);
    (s, book)
}

/// Grants a share of a token bucket's tokens (see [`size`]), to be spent within
/// [`BUCKET_TTL`]. `s` and `book` are as stored (this normalizes them).
pub fn bucket_grant(
    s: BucketState,
    book: GrantBook,
    bucket: (u64, Millis, u64),
    ask: &Ask,
    now: Millis,
) -> (Granted, BucketState, GrantBook) {
    let (rate, per, burst) = bucket;
    let (mut s, mut book) = bucket_normalize(s, book, bucket, now);
    book.close(ask.close);
    let room = book.open.len() < MAX_OPEN;
    let units = if room { size(s.tokens / per, book.open.len() as u64, ask.need, ask.want) } else { 0 };
    if units > 0 {
        s.tokens -= units * per;
        book.open.push(Open { id: ask.id, units, expires: now + BUCKET_TTL });
    }
    let decision = token_bucket::charge(s, rate, per, burst, 0, now).0;
    (Granted { units, decision, holders: book.open.len() as u64 }, s, book)
}

/// Gives back `unspent` units of a token bucket's grant `id`, once. Returns the units
/// given back and the new state.
pub fn bucket_give_back(
    s: BucketState,
    book: GrantBook,
    bucket: (u64, Millis, u64),
    id: u64,
    unspent: u64,
    now: Millis,
) -> (u64, BucketState, GrantBook) {
    let (_, per, burst) = bucket;
    let (mut s, mut book) = bucket_normalize(s, book, bucket, now);
    let Some(units) = book.take(id) else { return (0, s, book) };
    let back = unspent.min(units);
    s.tokens = (s.tokens + back * per).min(burst.saturating_sub(book.units()) * per);
    (back, s, book)
}

/// A refund into a token bucket with open grants: as a plain refund, but the bucket
/// refills and takes units back only up to its burst less the units they hold.
pub fn bucket_refund(
    s: BucketState,
    book: &GrantBook,
    (rate, per, burst): (u64, Millis, u64),
    cost: u64,
    now: Millis,
) -> BucketState {
    let cap = burst.saturating_sub(book.units());
    token_bucket::refund(token_bucket::normalize(s, rate, per, cap, now), per, cap, cost)
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: WindowState = WindowState { used: 0, resets_at: 60_000 };

    fn ask(id: u64, need: u64, want: u64) -> Ask<'static> {
        Ask { need, want, id, close: &[] }
    }

    #[test]
    fn a_grant_is_a_share_of_what_is_left_and_at_least_one_request() {
        assert_eq!(size(100, 0, 1, 1_000), 50, "alone: half of what is left");
        assert_eq!(size(100, 3, 1, 1_000), 12, "with three others: an eighth");
        assert_eq!(size(100, 0, 1, 10), 10, "no more than wanted");
        assert_eq!(size(3, 5, 1, 10), 1, "the last units go one at a time");
        assert_eq!(size(100, 9, 30, 5), 30, "one request's cost, whatever the share");
        assert_eq!(size(20, 0, 30, 5), 0, "less than one request left: nothing");
        assert_eq!(size(0, 0, 1, 5), 0);
    }

    #[test]
    fn grants_charge_the_window_and_never_pass_the_limit() {
        let (g, s, book) = grant(W, GrantBook::default(), 100, &ask(7, 1, 1_000), 0);
        assert_eq!((g.units, s.used, g.holders, g.decision.remaining), (50, 50, 1, 50));
        assert_eq!(book.open, [Open { id: 7, units: 50, expires: 60_000 }]);
        let mut s = s;
        let mut book = book;
        let mut total = 50;
        for id in 8..200 {
            let (g, s2, b2) = grant(s, book, 100, &ask(id, 1, 1_000), 0);
            total += g.units;
            (s, book) = (s2, b2);
        }
        assert_eq!((total, s.used), (100, 100), "every unit handed out, none twice");
        let (g, _, _) = grant(s, book, 100, &ask(999, 1, 1_000), 0);
        assert_eq!((g.units, g.decision.remaining), (0, 0));
    }

    #[test]
    fn spent_grants_named_by_the_next_ask_are_closed() {
        let (_, s, book) = grant(W, GrantBook::default(), 100, &ask(7, 1, 10), 0);
        let (g, s, book) = grant(s, book, 100, &ask(8, 1, 10), 0);
        assert_eq!(g.holders, 2);
        let (g, _, book) = grant(s, book, 100, &Ask { close: &[7, 8], ..ask(9, 1, 10) }, 0);
        assert_eq!((g.holders, book.open.len()), (1, 1), "7 and 8 spent: only 9 open");
    }

    #[test]
    fn a_give_back_counts_once_and_only_in_its_window() {
        let (_, s, book) = grant(W, GrantBook::default(), 100, &ask(7, 1, 40), 0);
        let (back, s2, book2) = give_back(s, book.clone(), (7, 30, 0), 60_000);
        assert_eq!((back, s2.used), (30, 10));
        let (again, s3, _) = give_back(s2, book2, (7, 30, 0), 60_000);
        assert_eq!((again, s3.used), (0, 10), "a retried give-back changes nothing");
        let (more, _, _) = give_back(s, book.clone(), (7, 500, 0), 60_000);
        assert_eq!(more, 40, "never more than was granted");
        let (other, _, _) = give_back(s, book.clone(), (8, 5, 0), 60_000);
        assert_eq!(other, 0, "an unknown grant gives nothing back");
        // the window restarted: its grants lapsed with it
        let next = fixed_window::normalize(s, 60_000, false, 60_000);
        let (late, s4, _) = give_back(next, book, (7, 30, 0), 60_000);
        assert_eq!((late, s4.used), (0, 0));
    }

    #[test]
    fn a_part_given_back_keeps_the_rest_open_once() {
        let (_, s, book) = grant(W, GrantBook::default(), 100, &ask(7, 1, 40), 0);
        let (back, s, book) = give_back(s, book, (7, 30, 10), 60_000);
        assert_eq!((back, s.used, book.units()), (30, 10, 10), "30 back, the grant open with 10");
        let (again, s, book) = give_back(s, book, (7, 30, 10), 60_000);
        assert_eq!((again, s.used, book.units()), (0, 10, 10), "the part sent twice: once");
        let (rest, s, book) = give_back(s, book, (7, 10, 0), 60_000);
        assert_eq!((rest, s.used, book.open.len()), (10, 0, 0), "the rest, through the grant kept open");
        let (_, s, book) = grant(s, book, 100, &ask(8, 1, 20), 0);
        assert_eq!(give_back(s, book, (8, 5, 5), 60_000).0, 0, "a part of a grant it did not hold: nothing");
    }

    #[test]
    fn a_full_book_closes_its_oldest_window_grant() {
        let mut s = WindowState { used: 0, resets_at: 60_000 };
        let mut book = GrantBook::default();
        for id in 0..=MAX_OPEN as u64 {
            let (_, s2, b2) = grant(s, book, 1_000_000, &ask(id, 1, 1), 0);
            (s, book) = (s2, b2);
        }
        assert_eq!(book.open.len(), MAX_OPEN);
        assert_eq!(book.open[0].id, 1, "grant 0 closed");
        assert_eq!(give_back(s, book, (0, 1, 0), 60_000).0, 0);
    }

    // 10 tokens a second, burst 20
    const B: (u64, Millis, u64) = (10, 1_000, 20);

    #[test]
    fn a_bucket_refills_around_the_units_held() {
        let s = token_bucket::fresh(1_000, 20, 0);
        let (g, s, book) = bucket_grant(s, GrantBook::default(), B, &ask(1, 1, 100), 0);
        assert_eq!((g.units, g.decision.remaining), (10, 10), "half of the 20 tokens");
        // a second later the bucket would be full again; 10 units are still held
        let (s1, _) = bucket_normalize(s, book.clone(), B, 900);
        assert_eq!(s1.tokens / 1_000, 10, "the held units count as in the bucket");
        // given back: the bucket is full, no more
        let (back, s2, book2) = bucket_give_back(s, book.clone(), B, 1, 10, 900);
        assert_eq!((back, s2.tokens / 1_000), (10, 20));
        assert_eq!(bucket_give_back(s2, book2, B, 1, 10, 901).0, 0, "once");
        // closed as spent by the next ask: until then it counted as held (the bucket
        // refilled to 10), from then on only the new grant's 4 units do
        let (g, s3, book3) = bucket_grant(s, book.clone(), B, &Ask { close: &[1], ..ask(2, 1, 4) }, 2_000);
        assert_eq!((g.units, s3.tokens / 1_000, g.holders), (4, 6, 1));
        assert_eq!(bucket_normalize(s3, book3, B, 4_000).0.tokens / 1_000, 16);
        // never closed: it lapses at its holder after BUCKET_TTL, at the store SKEW later
        let (s4, book4) = bucket_normalize(s, book, B, BUCKET_TTL + SKEW - 1);
        assert_eq!((s4.tokens / 1_000, book4.open.len()), (10, 1));
        let (s5, book5) = bucket_normalize(s4, book4, B, BUCKET_TTL + SKEW);
        assert_eq!((s5.tokens / 1_000, book5.open.len()), (10, 0), "lapsed: refills from now on");
        assert_eq!(bucket_normalize(s5, book5, B, BUCKET_TTL + SKEW + 1_000).0.tokens / 1_000, 20);
    }

    /// Holders that take grants, spend them at random moments before they lapse, give
    /// some back and close the spent ones: whatever they do, what they spent is a
    /// schedule one token bucket admits in full.
    #[test]
    fn what_bucket_grants_admit_one_bucket_admits() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rng = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        // 100 a second, burst 20: it refills well within a grant's life
        const FAST: (u64, Millis, u64) = (100, 1_000, 20);
        let (rate, per, burst) = FAST;
        for _ in 0..200 {
            let (mut s, mut book) = (token_bucket::fresh(per, burst, 0), GrantBook::default());
            // per holder: (id, units left, expires)
            let mut held: Vec<Vec<(u64, u64, Millis)>> = vec![Vec::new(); 4];
            let mut spent: Vec<Vec<u64>> = vec![Vec::new(); 4];
            let mut spends: Vec<Millis> = Vec::new();
            let (mut now, mut next_id) = (0, 1);
            for _ in 0..400 {
                now += rng(60);
                let h = rng(4) as usize;
                spent[h].extend(held[h].iter().filter(|p| p.1 == 0).map(|p| p.0));
                held[h].retain(|&(_, left, expires)| left > 0 && expires > now);
                match rng(4) {
                    // a burst of spends at one moment, as many as held
                    0 | 1 => {
                        for _ in 0..1 + rng(30) {
                            let Some(part) = held[h].iter_mut().find(|p| p.1 > 0) else { break };
                            part.1 -= 1;
                            spends.push(now);
                        }
                    }
                    // grants, several at one moment
                    2 => {
                        for _ in 0..1 + rng(6) {
                            let close = std::mem::take(&mut spent[h]);
                            let a = Ask { close: &close, ..ask(next_id, 1, 1 + rng(20)) };
                            let (g, s2, b2) = bucket_grant(s, book, FAST, &a, now);
                            (s, book) = (s2, b2);
                            if g.units > 0 {
                                held[h].push((next_id, g.units, now + BUCKET_TTL));
                            }
                            next_id += 1;
                        }
                    }
                    _ => {
                        if let Some((id, left, _)) = held[h].pop() {
                            let (_, s2, b2) = bucket_give_back(s, book, FAST, id, left, now);
                            (s, book) = (s2, b2);
                        }
                    }
                }
            }
            let mut one = token_bucket::fresh(per, burst, 0);
            for (i, &at) in spends.iter().enumerate() {
                let (d, after) =
                    token_bucket::charge(token_bucket::normalize(one, rate, per, burst, at), rate, per, burst, 1, at);
                assert!(d.allowed, "spend {i} at {at} ms is more than one bucket admits: {spends:?}");
                one = after.expect("charged");
            }
        }
    }
}
