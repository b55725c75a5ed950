//! The unit tests of `grants`.

use super::*;
use crate::algo::grant::Granted;
use crate::config::Grants;
use crate::telemetry::GrantCounters;

const L: Limit = Limit::FixedWindow { limit: 100, window: 60_000, aligned: false };
const OP: Op = Op { key: 1, limit: L, cost: 1, lease: None, shadow: false };

fn rule() -> Arc<GrantRule> {
    Arc::new(GrantRule { grants: Grants::AUTO, counters: GrantCounters::new("d", "p"), global: false })
}

fn granted(units: u64, remaining: u64) -> Granted {
    let decision = Decision {
        holds: false,
        allowed: true,
        limit: 100,
        used: 100 - remaining,
        remaining,
        reset_at: 60_000,
        retry_after: None,
    };
    Granted { units, decision, holders: 1 }
}

/// A ledger holding one grant of `units` for `tag`, the store having `remaining`
/// left after it; the ask it was taken with.
fn holding(ledger: &Ledger, r: &Arc<GrantRule>, tag: Tag, units: u64, remaining: u64) -> GrantAsk {
    let mut out = Leftovers::default();
    let Take::Short(ask) = ledger.take(tag, &OP, r, 0, &mut out) else { panic!("nothing held") };
    ledger.add(tag, &ask, &granted(units, remaining), r, 0, &mut out);
    ask
}

#[test]
fn spends_locally_asks_ahead_and_never_reports_more_left() {
    let (ledger, r) = (Ledger::default(), rule());
    holding(&ledger, &r, Tag(1), 8, 92);
    let mut out = Leftovers::default();
    let mut reported = Vec::new();
    let mut asked = None;
    for t in 1..=6 {
        match ledger.take(Tag(1), &OP, &r, t, &mut out) {
            Take::Spent(d, refresh) => {
                reported.push(d.remaining);
                asked = asked.or(refresh);
            }
            _ => panic!("units were held"),
        }
    }
    assert_eq!(reported, [99, 98, 97, 96, 95, 94]);
    let ask = asked.expect("a refresh asked for at a quarter left");
    assert_eq!(ledger.take(Tag(1), &OP, &r, 7, &mut out).remaining(), Some(93));
    // another instance gave units back: the store's remaining went up, the report does not
    ledger.add(Tag(1), &ask, &granted(10, 90), &r, 8, &mut out);
    assert_eq!(ledger.take(Tag(1), &OP, &r, 9, &mut out).remaining(), Some(92));
    // that unit came from the first grant, spent and to be closed: it goes to the store
    assert_eq!(ledger.put_back(Tag(1), 1, &L, 1, 60_000), 1);
    assert_eq!(ledger.take(Tag(1), &OP, &r, 10, &mut out).remaining(), Some(91));
    assert_eq!(ledger.put_back(Tag(1), 1, &L, 1, 60_000), 0, "this one came from the second");
    assert!(out.give_back.is_empty() && out.expired == 0);
}

#[test]
fn another_limit_or_a_generation_revokes_and_a_window_end_expires() {
    let (ledger, r) = (Ledger::default(), rule());
    let ask = holding(&ledger, &r, Tag(1), 8, 92);
    let mut out = Leftovers::default();
    let other = Op { limit: Limit::FixedWindow { limit: 50, window: 60_000, aligned: false }, ..OP };
    assert!(matches!(ledger.take(Tag(1), &other, &r, 1, &mut out), Take::Short(_)));
    assert_eq!(out.give_back.len(), 1);
    assert_eq!(out.give_back[0].1.unspent, 8);
    let mut out = Leftovers::default();
    ledger.add(Tag(2), &ask, &granted(8, 92), &r, 1, &mut out);
    ledger.sweep(0, 2, &mut out);
    assert!(out.give_back.is_empty(), "same generation, not idle: kept");
    ledger.sweep(1, 3, &mut out);
    assert_eq!(out.give_back.len(), 1, "a new generation revokes");
    let mut out = Leftovers::default();
    ledger.add(Tag(3), &ask, &granted(8, 92), &r, 4, &mut out);
    ledger.sweep(1, 60_000, &mut out);
    assert_eq!((out.give_back.len(), out.expired), (0, 8), "a window that ended: lapsed, not given back");
}

/// A unit spent from a grant since closed (all its units spent) cannot go back into
/// another grant past what that one was granted: the store counts only grants.
#[test]
fn a_unit_put_back_never_fills_a_grant_past_its_size() {
    let (ledger, r) = (Ledger::default(), rule());
    let a = holding(&ledger, &r, Tag(1), 2, 98);
    let mut out = Leftovers::default();
    for t in 1..=2 {
        assert!(matches!(ledger.take(Tag(1), &OP, &r, t, &mut out), Take::Spent(..)));
    }
    let b = GrantAsk { id: a.id + 1, ..a.clone() };
    ledger.add(Tag(1), &b, &granted(3, 95), &r, 3, &mut out);
    assert!(matches!(ledger.take(Tag(1), &OP, &r, 4, &mut out), Take::Spent(..)));
    assert_eq!(ledger.put_back(Tag(1), 1, &L, 2, 60_000), 1, "one unit fits grant b, one goes to the store");
    assert_eq!(ledger.held_units(), 3);
}

impl Take {
    fn remaining(&self) -> Option<u64> {
        match self {
            Take::Spent(d, _) => Some(d.remaining),
            Take::Short(_) | Take::Refused(_) => None,
        }
    }
}
