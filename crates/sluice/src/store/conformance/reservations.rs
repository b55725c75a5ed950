//! The conformance checks of reservations (`algo::reservation`): holds that count in
//! their window until committed or lapsed, settled once, bounded, and as the model says.

use super::*;

/// Reservations (`algo::reservation`): held units count against every limit of the
/// request, all or nothing; a commit replaces them by the actual, once; a hold past its
/// deadline gives its units back, and a commit after that is a report; only fixed
/// windows take them.
pub async fn reservations_hold_and_settle(s: &dyn Store) {
    let t0 = t0();
    let t = fresh_tag();
    let (big, small) = (
        Limit::FixedWindow { limit: 100, window: 60_000, aligned: false },
        Limit::FixedWindow { limit: 50, window: 60_000, aligned: false },
    );
    let r = |id, ttl| Reservation { id, ttl };
    if !s.reservations() {
        assert!(s.reserve(t, &[op(1, big, 1)], r(1, 1_000), t0).await.is_err(), "a store without them must refuse one");
        return;
    }
    let both = |a, b| [op(1, big, a), op(2, small, b)];
    let d = s.reserve(t, &both(60, 30), r(1, 30_000), t0).await.unwrap();
    assert!(d.iter().all(|d| d.allowed) && d[0].remaining == 40 && d[1].remaining == 20, "{d:?}");
    let d = s.reserve(t, &both(30, 30), r(2, 30_000), t0 + 1).await.unwrap();
    assert!(d[0].allowed && !d[1].allowed, "{d:?}");
    assert_eq!(hit(s, t, op(1, big, 0), t0 + 2).await.used, 60, "refused as a whole: nothing held");
    let commits = [Commit { key: 1, limit: big, actual: 70 }, Commit { key: 2, limit: small, actual: 10 }];
    let settled = s.commit(t, 1, &commits, t0 + 3).await.unwrap();
    assert_eq!(settled, [Settled::Committed { held: 60 }, Settled::Committed { held: 30 }]);
    assert_eq!(s.commit(t, 1, &commits, t0 + 4).await.unwrap(), [Settled::Again, Settled::Again]);
    assert_eq!((hit(s, t, op(1, big, 0), t0 + 5).await.used, hit(s, t, op(2, small, 0), t0 + 5).await.used), (70, 10));
    // an orphan: held until its deadline, given back at it, even to a plain decision
    assert!(s.reserve(t, &[op(1, big, 20)], r(3, 5_000), t0 + 10).await.unwrap()[0].allowed);
    assert_eq!(s.peek(t, &[op(1, big, 0)], t0 + 5_009).await.unwrap()[0].used, 90);
    assert_eq!(hit(s, t, op(1, big, 0), t0 + 5_010).await.used, 70, "released at its deadline");
    let late = s.commit(t, 3, &[Commit { key: 1, limit: big, actual: 5 }], t0 + 6_000).await.unwrap();
    assert_eq!((late[0], hit(s, t, op(1, big, 0), t0 + 6_001).await.used), (Settled::Reported, 75));
    // the next window holds nothing of this one
    assert!(s.reserve(t, &[op(1, big, 100)], r(4, 5_000), t0 + 60_000).await.unwrap()[0].allowed);
    let bucket = Limit::TokenBucket { rate: 1, per: 1_000, burst: 5 };
    assert!(s.reserve(t, &[op(9, bucket, 1)], r(5, 1_000), t0).await.is_err(), "fixed windows only");
}

/// Many reservations at once on one window: exactly as many as fit are admitted.
pub async fn concurrent_reservations_never_pass_the_limit(s: Arc<dyn Store>) {
    let t0 = t0();
    let t = fresh_tag();
    let l = Limit::FixedWindow { limit: 100, window: 60_000, aligned: false };
    if !s.reservations() {
        let refused = s.reserve(t, &[op(1, l, 7)], Reservation { id: 1, ttl: 1_000 }, t0).await;
        assert!(
            refused.is_err_and(|e| e.to_string().contains("keeps no reservations")),
            "a store without them says so"
        );
        return;
    }
    let calls = (0..50u64).map(|id| {
        let s = s.clone();
        tokio::spawn(async move { s.reserve(t, &[op(1, l, 7)], Reservation { id, ttl: 30_000 }, t0).await.unwrap()[0] })
    });
    let mut admitted = 0;
    for c in calls {
        admitted += u64::from(c.await.unwrap().allowed);
    }
    assert_eq!(admitted, 100 / 7);
    assert_eq!(hit(&*s, t, op(1, l, 0), t0).await.used, 7 * (100 / 7));
}

/// Quota grants and reservations on one window: a grant is a share of what is neither
/// committed nor held, a hold refuses what grants took, and a hold's deadline survives
/// the grant's and the give-back's writes (its units come back at it).
pub async fn reservations_and_grants_share_a_window(s: &dyn Store) {
    if !s.grants() || !s.reservations() {
        return;
    }
    let (t0, t) = (t0(), fresh_tag());
    let l = Limit::FixedWindow { limit: 100, window: 60_000, aligned: false };
    assert!(s.reserve(t, &[op(1, l, 30)], Reservation { id: 1, ttl: 5_000 }, t0).await.unwrap()[0].allowed);
    let g = s
        .grant(t, GrantAsk { key: 1, limit: l, need: 1, want: 1_000, id: 9, close: Vec::new(), pool: false }, t0 + 1)
        .await;
    assert_eq!(g.unwrap().units, 35, "half of the 70 neither held nor committed");
    let back = GiveBack { key: 1, limit: l, id: 9, unspent: 5, window: t0 + 60_000, keep: 0 };
    assert_eq!(s.give_back(t, back, t0 + 2).await.unwrap(), 5);
    assert_eq!(hit(s, t, op(1, l, 0), t0 + 4_999).await.used, 60, "30 held, 30 granted");
    assert_eq!(hit(s, t, op(1, l, 0), t0 + 5_000).await.used, 30, "the hold released at its deadline");
    let d = s.reserve(t, &[op(1, l, 71)], Reservation { id: 2, ttl: 5_000 }, t0 + 5_001).await.unwrap();
    assert!(!d[0].allowed && d[0].used == 30, "what grants took is not reserved again: {d:?}");
}

/// A window holds at most `reservation::MAX_OPEN` reservations open: one more is
/// refused, told when the first ends, and a commit makes room again.
pub async fn reservations_are_bounded(s: &dyn Store) {
    use crate::algo::reservation::MAX_OPEN;
    if !s.reservations() {
        return;
    }
    let (t0, t) = (t0(), fresh_tag());
    let l = Limit::FixedWindow { limit: 1_000_000, window: 60_000, aligned: false };
    for id in 1..=MAX_OPEN as u64 {
        let d = s.reserve(t, &[op(1, l, 1)], Reservation { id, ttl: 50_000 + id }, t0).await.unwrap();
        assert!(d[0].allowed, "hold {id}: {d:?}");
    }
    let d = s.reserve(t, &[op(1, l, 1)], Reservation { id: 1 << 40, ttl: 1_000 }, t0 + 1).await.unwrap()[0];
    assert!(!d.allowed && d.retry_after == Some(50_000), "full until the first ends: {d:?}");
    assert_eq!(
        s.commit(t, 1, &[Commit { key: 1, limit: l, actual: 1 }], t0 + 2).await.unwrap(),
        [Settled::Committed { held: 1 }]
    );
    assert!(s.reserve(t, &[op(1, l, 1)], Reservation { id: 1 << 40, ttl: 1_000 }, t0 + 3).await.unwrap()[0].allowed);
    let d = s.reserve(t, &[op(1, l, 1)], Reservation { id: 1 << 41, ttl: 1_000 }, t0 + 4).await.unwrap()[0];
    assert!(crate::algo::reservation::too_many_holds(&d, 1), "refused for its holds, not its units: {d:?}");
    // a reservation of nothing holds nothing, so it takes no place: never refused so
    let zero = s.reserve(t, &[op(1, l, 0)], Reservation { id: 1 << 42, ttl: 1_000 }, t0 + 5).await.unwrap()[0];
    assert!(zero.allowed, "a reservation of 0 units: {zero:?}");
}

/// A refusal on a window whose units reservations hold says when the first of them
/// lapses (not the window's end), and is marked so (no near-cache keeps it: a commit
/// may give units back at any moment); once no hold is open, neither.
pub async fn refusals_with_holds_say_when_the_first_lapses(s: &dyn Store) {
    if !s.reservations() {
        return;
    }
    let (t0, t) = (t0(), fresh_tag());
    let l = Limit::FixedWindow { limit: 10, window: 60_000, aligned: false };
    assert!(s.reserve(t, &[op(1, l, 6)], Reservation { id: 1, ttl: 9_000 }, t0).await.unwrap()[0].holds);
    assert!(s.reserve(t, &[op(1, l, 4)], Reservation { id: 2, ttl: 5_000 }, t0).await.unwrap()[0].allowed);
    let d = hit(s, t, op(1, l, 1), t0 + 1).await;
    assert_eq!((d.allowed, d.holds, d.retry_after), (false, true, Some(4_999)), "hold 2 lapses first: {d:?}");
    let peeked = s.peek(t, &[op(1, l, 0)], t0 + 1).await.unwrap()[0];
    assert!(peeked.holds && peeked.used == 10, "{peeked:?}");
    // hold 2 committed: hold 1 is the first to lapse now
    s.commit(t, 2, &[Commit { key: 1, limit: l, actual: 4 }], t0 + 2).await.unwrap();
    let d = hit(s, t, op(1, l, 1), t0 + 3).await;
    assert_eq!((d.allowed, d.retry_after), (false, Some(8_997)), "{d:?}");
    s.commit(t, 1, &[Commit { key: 1, limit: l, actual: 0 }], t0 + 4).await.unwrap();
    let d = hit(s, t, op(1, l, 1), t0 + 5).await;
    assert_eq!((d.allowed, d.holds, d.used), (true, false, 5), "no hold open: {d:?}");
    let d = hit(s, t, op(1, l, 6), t0 + 6).await;
    assert_eq!((d.allowed, d.holds, d.retry_after), (false, false, Some(59_994)), "the window's end: {d:?}");
}

/// Real time: a hold whose deadline passed is given back when its window is first
/// touched late, by a decision, a status read, a reservation or a commit. The rest of the
/// suite moves its own clock; a Redis server expires keys on the real one, and a store
/// that let the holds go at their deadline (plus a grace) kept their units for the rest
/// of the window.
pub async fn lapsed_holds_come_back_when_touched_late(s: &dyn Store) {
    if !s.reservations() {
        return;
    }
    let real = || crate::time::SystemClock.now();
    let l = Limit::FixedWindow { limit: 100, window: 60_000, aligned: false };
    let tags: Vec<Tag> = (0..4).map(|_| fresh_tag()).collect();
    for &t in &tags {
        let d = s.reserve(t, &[op(1, l, 30)], Reservation { id: 1, ttl: 100 }, real()).await.unwrap()[0];
        assert!(d.allowed, "{d:?}");
    }
    // past the deadline by more than the grace a store keeps keys for (Redis: 1 s)
    tokio::time::sleep(std::time::Duration::from_millis(2_600)).await;
    let now = real();
    let d = hit(s, tags[0], op(1, l, 5), now).await;
    assert_eq!((d.allowed, d.used, d.holds), (true, 5, false), "a decision, late: {d:?}");
    let d = s.peek(tags[1], &[op(1, l, 0)], now).await.unwrap()[0];
    assert_eq!((d.used, d.holds), (0, false), "a status read, late: {d:?}");
    let d = s.reserve(tags[2], &[op(1, l, 100)], Reservation { id: 2, ttl: 1_000 }, now).await.unwrap()[0];
    assert_eq!((d.allowed, d.used), (true, 100), "a reservation, late: {d:?}");
    let c = s.commit(tags[3], 1, &[Commit { key: 1, limit: l, actual: 7 }], now).await.unwrap();
    assert_eq!(c, [Settled::Reported], "a commit, late: released, so charged as a report");
    assert_eq!(hit(s, tags[3], op(1, l, 0), now + 1).await.used, 7, "only the actual counts");
}

/// A budget of billions (tokens a month): holds, commits and reports past 2^32 are
/// exact.
pub async fn reservations_count_billions(s: &dyn Store) {
    if !s.reservations() {
        return;
    }
    let (t0, t) = (t0(), fresh_tag());
    let month = Limit::FixedWindow { limit: 5_000_000_000, window: 30 * 86_400_000, aligned: false };
    let r = Reservation { id: 1, ttl: 60_000 };
    assert!(s.reserve(t, &[op(1, month, 4_000_000_000)], r, t0).await.unwrap()[0].allowed);
    let d = s.reserve(t, &[op(1, month, 1_000_000_001)], Reservation { id: 2, ttl: 60_000 }, t0 + 1).await.unwrap();
    assert!(!d[0].allowed && d[0].used == 4_000_000_000, "{d:?}");
    let settled = s.commit(t, 1, &[Commit { key: 1, limit: month, actual: 4_600_000_000 }], t0 + 2).await.unwrap();
    assert_eq!(settled, [Settled::Committed { held: 4_000_000_000 }]);
    s.commit(t, crate::algo::reservation::REPORT, &[Commit { key: 1, limit: month, actual: 700_000_000 }], t0 + 3)
        .await
        .unwrap();
    assert_eq!(hit(s, t, op(1, month, 0), t0 + 4).await.used, 5_300_000_000);
    // commits past 2^53 - 1 in all: the count stops there, exactly, on every store
    let most = crate::algo::MAX_EXACT;
    for at in 5..8 {
        let c = [Commit { key: 1, limit: month, actual: most - 1 }];
        s.commit(t, crate::algo::reservation::REPORT, &c, t0 + at).await.unwrap();
    }
    assert_eq!(hit(s, t, op(1, month, 0), t0 + 9).await.used, most, "the count stops at 2^53 - 1");
}

/// A seeded random sequence of reservations, commits (of open, settled, released and
/// unknown ids, and reports), plain charges and peeks on two windows (one aligned), the clock moving
/// irregularly across holds' deadlines and windows' ends: every decision and settlement
/// is the memory store's (which runs `algo::reservation` as is), step for step.
pub async fn reservations_follow_the_model(s: &dyn Store) {
    if !s.reservations() {
        return;
    }
    let model = crate::store::MemoryStore::new(1_000);
    let limits = [
        Limit::FixedWindow { limit: 100, window: 10_000, aligned: false },
        Limit::FixedWindow { limit: 60, window: 5_000, aligned: true },
    ];
    let (t, mut now, mut rng, mut next) = (fresh_tag(), t0(), Rng(0x5eed_0041), 1);
    for step in 0..300u64 {
        now += [0, 1, 250, 1_500, 4_000][rng.next(5) as usize];
        let ops: Vec<Op> = match rng.next(3) {
            0 => vec![op(1, limits[0], rng.next(40))],
            1 => vec![op(2, limits[1], rng.next(30))],
            _ => vec![op(1, limits[0], rng.next(40)), op(2, limits[1], rng.next(30))],
        };
        let what = rng.next(8);
        let at = format!("step {step} ({what}) at {now}: {ops:?}");
        match what {
            0..=2 => {
                // ids are unique, as the servers make them (64 random bits)
                let r = Reservation { id: next, ttl: 500 + rng.next(6_000) };
                next += 1;
                let (want, got) = (model.reserve(t, &ops, r, now).await, s.reserve(t, &ops, r, now).await);
                assert_eq!(got.unwrap(), want.unwrap(), "reserve, {at}");
            }
            3..=5 => {
                // an open, settled, released or unknown reservation, or a report (0)
                let id = rng.next(next + 2);
                let commits: Vec<Commit> =
                    ops.iter().map(|o| Commit { key: o.key, limit: o.limit, actual: rng.next(50) }).collect();
                let (want, got) = (model.commit(t, id, &commits, now).await, s.commit(t, id, &commits, now).await);
                assert_eq!(got.unwrap(), want.unwrap(), "commit of {id}, {at}");
            }
            6 => assert_eq!(s.apply(t, &ops, now).await.unwrap(), model.apply(t, &ops, now).await.unwrap(), "{at}"),
            _ => assert_eq!(s.peek(t, &ops, now).await.unwrap(), model.peek(t, &ops, now).await.unwrap(), "{at}"),
        }
    }
}
