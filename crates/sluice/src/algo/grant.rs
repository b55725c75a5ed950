//! Quota grants on a fixed window (escrow: O'Neil, TODS 1986).
//!
//! An instance takes a *grant* of units from a shared window in one atomic step, spends
//! them in process memory, and gives back what it did not spend. Granting charges the
//! window at once, so the shared count never passes the limit and neither can the fleet:
//! units granted and never spent (an instance that crashed, a window that ended) are
//! only ever admitted less, never more.
//!
//! Beside the window, the store keeps a [`GrantBook`]: the grants still open in that
//! window, by id. A give-back names its grant; it takes effect once and closes the
//! grant, so a give-back sent twice (a retry after a lost reply) gives back once. A
//! book belongs to one window: when the window restarts, its grants lapse with it.

use super::Decision;
use super::fixed_window::{self, WindowState};
use crate::time::Millis;

/// The grants open on one window state: `(id, units)`, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GrantBook {
    /// The window the grants were taken from (its `resets_at`).
    pub window: Millis,
    pub open: Vec<(u64, u64)>,
}

/// Open grants a book holds at most: every instance holds one or two at a time, so this
/// is a fleet of 32 or more. A grant past it closes the oldest (its holder can no longer
/// give it back: an under-admission, never an over-admission).
pub const MAX_OPEN: usize = 64;

impl GrantBook {
    /// The book as it stands in window `window`: empty if it was another window's.
    pub fn of_window(self, window: Millis) -> Self {
        if self.window == window { self } else { GrantBook { window, open: Vec::new() } }
    }
}

/// What one grant call answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granted {
    /// Units granted: 0 when the window has fewer than `need` left.
    pub units: u64,
    /// The window after the grant, as a status request would report it.
    pub decision: Decision,
    /// Grants open in the window after this one, this one included.
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

/// Grants up to `want` units (at least `need`) of a window of `limit`, normalized to
/// `now`, as grant `id`. Returns the answer, the charged window and the book to store.
pub fn grant(
    s: WindowState,
    book: GrantBook,
    limit: u64,
    need: u64,
    want: u64,
    id: u64,
    now: Millis,
) -> (Granted, WindowState, GrantBook) {
    let mut book = book.of_window(s.resets_at);
    let units = size(limit.saturating_sub(s.used), book.open.len() as u64, need, want);
    let s = WindowState { used: s.used + units, ..s };
    if units > 0 {
        if book.open.len() >= MAX_OPEN {
            book.open.remove(0);
        }
        book.open.push((id, units));
    }
    let decision = fixed_window::charge(s, limit, 0, now).0;
    (Granted { units, decision, holders: book.open.len() as u64 }, s, book)
}

/// Gives back `unspent` units of grant `id` taken in window `window`, once: the grant
/// is closed, and a second give-back of it changes nothing. Never more than the grant
/// was, never into another window. Returns the units given back and the new state.
pub fn give_back(
    s: WindowState,
    book: GrantBook,
    id: u64,
    unspent: u64,
    window: Millis,
) -> (u64, WindowState, GrantBook) {
    let mut book = book.of_window(s.resets_at);
    if s.resets_at != window {
        return (0, s, book);
    }
    let Some(at) = book.open.iter().position(|&(g, _)| g == id) else {
        return (0, s, book);
    };
    let (_, units) = book.open.remove(at);
    let back = unspent.min(units).min(s.used);
    (back, WindowState { used: s.used - back, ..s }, book)
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: WindowState = WindowState { used: 0, resets_at: 60_000 };

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
        let (g, s, book) = grant(W, GrantBook::default(), 100, 1, 1_000, 7, 0);
        assert_eq!((g.units, s.used, g.holders, g.decision.remaining), (50, 50, 1, 50));
        assert_eq!(book, GrantBook { window: 60_000, open: vec![(7, 50)] });
        let mut s = s;
        let mut book = book;
        let mut total = 50;
        for id in 8..200 {
            let (g, s2, b2) = grant(s, book, 100, 1, 1_000, id, 0);
            total += g.units;
            (s, book) = (s2, b2);
        }
        assert_eq!((total, s.used), (100, 100), "every unit handed out, none twice");
        let (g, _, _) = grant(s, book, 100, 1, 1_000, 999, 0);
        assert_eq!((g.units, g.decision.remaining), (0, 0));
    }

    #[test]
    fn a_give_back_counts_once_and_only_in_its_window() {
        let (_, s, book) = grant(W, GrantBook::default(), 100, 1, 40, 7, 0);
        let (back, s2, book2) = give_back(s, book.clone(), 7, 30, 60_000);
        assert_eq!((back, s2.used), (30, 10));
        let (again, s3, _) = give_back(s2, book2, 7, 30, 60_000);
        assert_eq!((again, s3.used), (0, 10), "a retried give-back changes nothing");
        let (more, _, _) = give_back(s, book.clone(), 7, 500, 60_000);
        assert_eq!(more, 40, "never more than was granted");
        let (other, _, _) = give_back(s, book.clone(), 8, 5, 60_000);
        assert_eq!(other, 0, "an unknown grant gives nothing back");
        // the window restarted: its grants lapsed with it
        let next = fixed_window::normalize(s, 60_000, false, 60_000);
        let (late, s4, _) = give_back(next, book, 7, 30, 60_000);
        assert_eq!((late, s4.used), (0, 0));
    }

    #[test]
    fn a_full_book_closes_its_oldest_grant() {
        let mut s = WindowState { used: 0, resets_at: 60_000 };
        let mut book = GrantBook::default();
        for id in 0..=MAX_OPEN as u64 {
            let (_, s2, b2) = grant(s, book, 1_000_000, 1, 1, id, 0);
            (s, book) = (s2, b2);
        }
        assert_eq!(book.open.len(), MAX_OPEN);
        assert_eq!(book.open[0].0, 1, "grant 0 closed");
        assert_eq!(give_back(s, book, 0, 1, 60_000).0, 0);
    }
}
