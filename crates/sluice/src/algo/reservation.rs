//! Reservations: an estimate held against a limit now, the actual amount settled later,
//! for budgets whose cost is known only when the work ends (the tokens of an LLM
//! response).
//!
//! A reservation of `units` is charged at once, exactly as a decision of that cost is
//! (refused, charging nothing, when it does not fit), and recorded in the state's
//! [`Ledger`] with its deadline. Committing it replaces its units by the actual amount,
//! which may be more (never refused: the work is done) or less. One not committed by its
//! deadline is released, its units given back, so a client that died mid-stream holds
//! nothing once its TTL is over. So, within a window, what is committed plus what is held
//! never passes the limit when a reservation is admitted; what passes it afterwards is
//! the underestimates (actual above estimate) of the reservations open at the time, and
//! nothing when estimates are upper bounds.
//!
//! The ledger remembers what it settled until the later of the reservation's deadline
//! and the window's end: a commit sent twice settles once; a commit of a reservation
//! released at its deadline charges the actual then, as a report (never refused).
//! A window that ends takes its holds with it: a later commit is a report in the window
//! it comes in.
//!
//! This module is the reference: every store runs it (the memory store as is, Redis in
//! Lua), and the conformance suite holds them to it.

use super::fixed_window::{self, WindowState};
use super::{Decision, MAX_EXACT};
use crate::time::Millis;

/// One open reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    pub id: u64,
    pub units: u64,
    /// Its deadline: released, its units given back, at this moment.
    pub expires: Millis,
}

/// How a reservation was settled, remembered for a commit that comes again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Committed: a second commit changes nothing.
    Committed,
    /// Released at its deadline: a commit charges its actual, once.
    Released,
}

/// The reservations of one state: those open, and those settled, each kept until
/// `until`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    pub open: Vec<Hold>,
    pub settled: Vec<(u64, Outcome, Millis)>,
}

/// Reservations one state holds open at most: past it, a reservation is refused until
/// one is settled (the ledger is read and written whole at every call).
pub const MAX_OPEN: usize = 4_096;

/// Settled reservations one state remembers at most: past it the oldest is forgotten
/// (a commit of it sent again after 4,096 later settlements is charged as a report).
/// Without it a client settling reservations (or reporting unknown ids) grew its state
/// without end.
pub const MAX_SETTLED: usize = 4_096;

/// The id of no reservation: a commit of it is a report (the actual charged, never
/// refused), and nothing is remembered of it, so reports cost no ledger (Envoy's
/// `apply_on_stream_done` charges, Kuadrant's `Report`). Reservations are never given it.
pub const REPORT: u64 = 0;

/// What a commit did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// The reservation was open: its units replaced by the actual.
    Committed { held: u64 },
    /// It was not (released at its deadline, from another window, or unknown): the
    /// actual charged as a report.
    Reported,
    /// It was committed already: nothing changed.
    Again,
}

impl Ledger {
    /// Units held by open reservations.
    pub fn held(&self) -> u64 {
        self.open.iter().map(|h| h.units).sum()
    }

    /// When the ledger stops mattering (0: empty): a store keeps it until then.
    pub fn expires(&self) -> Millis {
        let open = self.open.iter().map(|h| h.expires);
        open.chain(self.settled.iter().map(|s| s.2)).max().unwrap_or(0)
    }

    fn settle(&mut self, id: u64, outcome: Outcome, until: Millis) {
        self.settled.retain(|s| s.0 != id);
        if self.settled.len() >= MAX_SETTLED {
            self.settled.remove(0);
        }
        self.settled.push((id, outcome, until));
    }

    /// Whether [`normalize`] would change anything at `now` for a window that resets at
    /// `resets_at`: it rolled, a hold lapsed, or a settlement is to be forgotten. Reads
    /// only: a decision on a window with reservations pays no write when nothing is due.
    pub fn due(&self, resets_at: Millis, now: Millis) -> bool {
        now >= resets_at || self.open.iter().any(|h| h.expires <= now) || self.settled.iter().any(|s| s.2 <= now)
    }
}

/// A window of `window` ms (aligned or not) and its ledger brought to `now`: a new window
/// drops the holds of the old one (their units went with it); a hold past its deadline
/// is released (its units given back); what was settled is forgotten past its `until`.
pub fn normalize(
    s: WindowState,
    mut ledger: Ledger,
    (window, aligned): (Millis, bool),
    now: Millis,
) -> (WindowState, Ledger) {
    let rolled = now >= s.resets_at;
    let s = state_at(s, &ledger, (window, aligned), now);
    let (lapsed, open) = std::mem::take(&mut ledger.open).into_iter().partition(|h| rolled || h.expires <= now);
    ledger.open = open;
    for h in lapsed {
        ledger.settle(h.id, Outcome::Released, h.expires.max(s.resets_at));
    }
    ledger.settled.retain(|&(_, _, until)| until > now);
    (s, ledger)
}

/// The window as [`normalize`] leaves it, the ledger only read (a status).
pub fn state_at(s: WindowState, ledger: &Ledger, (window, aligned): (Millis, bool), now: Millis) -> WindowState {
    let rolled = now >= s.resets_at;
    let mut s = fixed_window::normalize(s, window, aligned, now);
    if !rolled {
        let lapsed: u64 = ledger.open.iter().filter(|h| h.expires <= now).map(|h| h.units).sum();
        s.used = s.used.saturating_sub(lapsed);
    }
    s
}

/// Reserves `units` of `limit` as reservation `id` until `now + ttl`, on a normalized
/// window (the ledger only read): the decision, and when admitted, the charged state and
/// the hold to add to the ledger (none for 0 units: a reservation of nothing holds
/// nothing, and takes no place among the [`MAX_OPEN`]).
pub fn reserve(
    s: WindowState,
    ledger: &Ledger,
    limit: u64,
    (id, units, ttl): (u64, u64, Millis),
    now: Millis,
) -> (Decision, Option<(WindowState, Option<Hold>)>) {
    if units > 0 && ledger.open.len() >= MAX_OPEN {
        // full until the first hold lapses (with_holds says when)
        let (d, _) = fixed_window::charge(s, limit, 0, now);
        let full = Decision { allowed: false, remaining: 0, retry_after: Some(Millis::MAX), ..d };
        return (with_holds(full, ledger, now), None);
    }
    let (d, charged) = fixed_window::charge(s, limit, units, now);
    let d = with_holds(d, ledger, now);
    if !d.allowed {
        return (d, None);
    }
    (d, Some((charged.unwrap_or(s), (units > 0).then_some(Hold { id, units, expires: now + ttl }))))
}

/// Whether a refusal of a reservation of `units` came from [`MAX_OPEN`] (the window has
/// room for them, its holds do not): the reason a client is told.
pub fn too_many_holds(d: &Decision, units: u64) -> bool {
    !d.allowed && d.holds && d.used.saturating_add(units) <= d.limit
}

/// A fixed window's decision on a normalized window with `ledger`: marked
/// [`Decision::holds`] while reservations are open, and a refusal's wait cut to when the
/// first of them lapses (its units may be enough; a commit may come sooner, anywhere).
pub fn with_holds(d: Decision, ledger: &Ledger, now: Millis) -> Decision {
    let Some(first) = ledger.open.iter().map(|h| h.expires).filter(|&e| e > now).min() else { return d };
    if now >= d.reset_at {
        return d;
    }
    let retry_after = match d.retry_after {
        Some(wait) if !d.allowed => Some(wait.min(first.saturating_sub(now))),
        other => other,
    };
    Decision { holds: true, retry_after, ..d }
}

/// Commits reservation `id` with `actual` units, on a normalized window: what it did,
/// and the state and ledger to store. The count stops at [`MAX_EXACT`]: past it a store
/// of doubles (Redis's Lua) would count inexactly, and the window is over by far anyway.
pub fn commit(
    mut s: WindowState,
    mut ledger: Ledger,
    id: u64,
    actual: u64,
    now: Millis,
) -> (Settled, WindowState, Ledger) {
    if id == REPORT {
        s.used = s.used.saturating_add(actual).min(MAX_EXACT);
        return (Settled::Reported, s, ledger);
    }
    if ledger.settled.iter().any(|&(i, o, _)| i == id && o == Outcome::Committed) {
        return (Settled::Again, s, ledger);
    }
    let until = |expires: Millis| expires.max(s.resets_at).max(now);
    let settled = match ledger.open.iter().position(|h| h.id == id) {
        Some(at) => {
            let h = ledger.open.remove(at);
            s.used = s.used.saturating_sub(h.units).saturating_add(actual).min(MAX_EXACT);
            ledger.settle(id, Outcome::Committed, until(h.expires));
            Settled::Committed { held: h.units }
        }
        None => {
            s.used = s.used.saturating_add(actual).min(MAX_EXACT);
            ledger.settle(id, Outcome::Committed, until(now));
            Settled::Reported
        }
    };
    (settled, s, ledger)
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: (Millis, bool) = (60_000, false);

    fn at(now: Millis) -> (WindowState, Ledger) {
        normalize(WindowState::default(), Ledger::default(), W, now)
    }

    /// [`reserve`], the hold added when admitted: the decision and what to store.
    fn hold(
        s: WindowState,
        mut l: Ledger,
        limit: u64,
        r: (u64, u64, Millis),
        now: Millis,
    ) -> (Decision, Option<(WindowState, Ledger)>) {
        let (d, admitted) = reserve(s, &l, limit, r, now);
        let next = admitted.map(|(s, h)| {
            l.open.extend(h);
            (s, l)
        });
        (d, next)
    }

    /// Held units count against the limit until committed; the commit replaces them by
    /// the actual, above or below the estimate.
    #[test]
    fn held_units_count_until_the_actual_replaces_them() {
        let (s, l) = at(1_000);
        let (d, next) = hold(s, l, 100, (1, 60, 30_000), 1_000);
        assert!(d.allowed && d.remaining == 40);
        let (s, l) = next.unwrap();
        let (d, none) = hold(s, l.clone(), 100, (2, 50, 30_000), 1_001);
        assert!(!d.allowed && none.is_none(), "60 held + 50 > 100");
        let (settled, s, l) = commit(s, l, 1, 20, 2_000);
        assert_eq!((settled, s.used), (Settled::Committed { held: 60 }, 20));
        let (d, next) = hold(s, l, 100, (2, 50, 30_000), 2_001);
        assert!(d.allowed);
        let (s, l) = next.unwrap();
        // an underestimate: the actual is charged, never refused, past the limit
        let (settled, s, _) = commit(s, l, 2, 95, 3_000);
        assert_eq!((settled, s.used), (Settled::Committed { held: 50 }, 115));
    }

    /// A commit sent twice settles once; an unknown reservation's commit is a report.
    #[test]
    fn a_commit_settles_once() {
        let (s, l) = at(1_000);
        let (s, l) = hold(s, l, 100, (7, 10, 30_000), 1_000).1.unwrap();
        let (_, s, l) = commit(s, l, 7, 4, 1_100);
        let (again, s, l) = commit(s, l, 7, 4, 1_200);
        assert_eq!((again, s.used), (Settled::Again, 4));
        let (reported, s, _) = commit(s, l, 8, 3, 1_300);
        assert_eq!((reported, s.used), (Settled::Reported, 7));
    }

    /// A reservation never committed is released at its deadline (its units back); a
    /// commit after that charges the actual, once.
    #[test]
    fn an_orphan_is_released_at_its_deadline() {
        let (s, l) = at(1_000);
        let (s, l) = hold(s, l, 100, (3, 90, 5_000), 1_000).1.unwrap();
        let (s, l) = normalize(s, l, W, 5_999);
        assert_eq!((s.used, l.held()), (90, 90), "held until its deadline");
        let (s, l) = normalize(s, l, W, 6_000);
        assert_eq!((s.used, l.held()), (0, 0), "released at it");
        let (late, s, l) = commit(s, l, 3, 30, 7_000);
        assert_eq!((late, s.used), (Settled::Reported, 30));
        let (again, s, _) = commit(s, l, 3, 30, 7_100);
        assert_eq!((again, s.used), (Settled::Again, 30));
    }

    /// A new window takes the old one's holds with it: a later commit is a report in the
    /// window it comes in, and the old holds are not given back into it.
    #[test]
    fn a_new_window_drops_the_old_holds() {
        let (s, l) = at(1_000);
        let (s, l) = hold(s, l, 100, (1, 40, 120_000), 1_000).1.unwrap();
        let (s, l) = normalize(s, l, W, 61_000);
        assert_eq!((s.used, l.open.len()), (0, 0));
        let (late, s, _) = commit(s, l, 1, 35, 62_000);
        assert_eq!((late, s.used), (Settled::Reported, 35));
    }

    /// A report (id REPORT) charges its actual, past the limit too, and leaves nothing
    /// in the ledger, however often it comes.
    #[test]
    fn a_report_charges_and_remembers_nothing() {
        let (s, l) = at(1_000);
        let (settled, s, l) = commit(s, l, REPORT, 150, 1_000);
        assert_eq!((settled, s.used), (Settled::Reported, 150));
        let (settled, s, l) = commit(s, l, REPORT, 10, 1_001);
        assert_eq!((settled, s.used, l), (Settled::Reported, 160, Ledger::default()));
    }

    /// The ledger is bounded: past MAX_OPEN holds a reservation is refused, saying when
    /// the first ends; what was settled is forgotten in time.
    #[test]
    fn the_ledger_is_bounded() {
        let (mut s, mut l) = at(1_000);
        for id in 0..MAX_OPEN as u64 {
            (s, l) = hold(s, l, u64::MAX, (id, 1, 10_000 + id), 1_000).1.unwrap();
        }
        let (d, none) = hold(s, l.clone(), u64::MAX, (u64::MAX, 1, 10_000), 2_000);
        assert!(!d.allowed && none.is_none());
        assert_eq!(d.retry_after, Some(9_000));
        let (_, l) = normalize(s, l, W, 1_000 + 10_000 + MAX_OPEN as u64);
        assert!(l.open.is_empty());
        let (_, l) = normalize(WindowState { used: 0, resets_at: 200_000 }, l, W, 200_000);
        assert!(l.settled.is_empty(), "forgotten past the window's end");
    }

    /// Settlements are remembered up to MAX_SETTLED, the oldest forgotten first: a
    /// client settling reservations of nothing cannot grow its state without end.
    #[test]
    fn what_was_settled_is_bounded() {
        let (mut s, mut l) = at(1_000);
        for id in 1..=MAX_SETTLED as u64 + 10 {
            (s, l) = hold(s, l, 100, (id, 1, 30_000), 1_000).1.unwrap();
            let settled;
            (settled, s, l) = commit(s, l, id, 0, 1_000);
            assert_eq!(settled, Settled::Committed { held: 1 });
        }
        assert_eq!(l.settled.len(), MAX_SETTLED);
        assert_eq!(commit(s, l.clone(), MAX_SETTLED as u64 + 10, 0, 1_000).0, Settled::Again, "the newest remembered");
        assert_eq!(commit(s, l, 1, 0, 1_000).0, Settled::Reported, "the oldest forgotten");
    }
}
