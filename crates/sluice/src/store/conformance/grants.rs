//! The conformance checks of quota grants (`algo::grant`) and regions' pools of global
//! windows (`algo::pool`): shares given back once, pools bounded by what the region
//! holds, a bucket's refill held back by its open grants, and concurrent grants exact.

use super::*;

/// Quota grants (`algo::grant`): a grant charges the window at once and is a share of
/// what is left; a give-back counts once, only in its window, and a part of a grant
/// keeps the rest open to give back later; a reset closes the book; the book of the
/// window now is read as it stands (ids kept whole, for a region's code in the high
/// bits); grants and plain charges of one window add up. A store that takes no grants
/// says so.
pub async fn grants_are_shares_given_back_once(s: &dyn Store) {
    let t0 = t0();
    let t = fresh_tag();
    let l = Limit::FixedWindow { limit: 100, window: 60_000, aligned: false };
    let ask = |id, need, want| GrantAsk { key: 1, limit: l, need, want, id, close: Vec::new(), pool: false };
    if !s.grants() {
        assert!(s.grant(t, ask(1, 1, 10), t0).await.is_err(), "a store taking no grants must refuse one");
        return;
    }
    let g = s.grant(t, ask(u64::MAX, 1, 1_000), t0).await.unwrap();
    assert_eq!((g.units, g.holders, g.decision.remaining, g.decision.reset_at), (50, 1, 50, t0 + 60_000));
    let g2 = s.grant(t, ask(7, 1, 1_000), t0 + 1).await.unwrap();
    assert_eq!((g2.units, g2.holders), (12, 2), "a share of what is left among two holders");
    let open = |id, units| Open { id, units, expires: t0 + 60_000 };
    assert_eq!(s.grants_open(t, 1, &l, t0 + 1).await.unwrap(), [open(u64::MAX, 50), open(7, 12)], "the book now");
    assert_eq!(hit(s, t, op(1, l, 3), t0 + 2).await.remaining, 35, "a plain charge counts on top of grants");
    let back = |id, unspent, window| GiveBack { key: 1, limit: l, id, unspent, window, keep: 0 };
    assert_eq!(s.give_back(t, back(u64::MAX, 20, t0 + 60_000), t0 + 3).await.unwrap(), 20);
    assert_eq!(s.give_back(t, back(u64::MAX, 20, t0 + 60_000), t0 + 4).await.unwrap(), 0, "twice: once");
    // a part of grant 7 (12 units) keeps the rest open, once, and only as its holder knew it
    let part = |unspent, keep| GiveBack { keep, ..back(7, unspent, t0 + 60_000) };
    assert_eq!(s.give_back(t, part(3, 3), t0 + 5).await.unwrap(), 0, "the grant holds 12, not 6");
    assert_eq!(s.give_back(t, part(5, 7), t0 + 5).await.unwrap(), 5, "a part: 5 back, 7 kept open");
    assert_eq!(s.give_back(t, part(5, 7), t0 + 5).await.unwrap(), 0, "the part sent twice: once");
    assert_eq!(s.give_back(t, back(7, 99, t0 + 60_000), t0 + 5).await.unwrap(), 7, "never more than granted");
    assert_eq!(hit(s, t, op(1, l, 0), t0 + 6).await.used, 33);
    let need = s.grant(t, ask(8, 60, 5), t0 + 7).await.unwrap();
    assert_eq!(need.units, 60, "at least one request's cost");
    assert_eq!(s.grant(t, ask(9, 10, 10), t0 + 8).await.unwrap().units, 0, "less than asked is left: nothing");
    // the next window: the old grants lapsed and cannot be given back into it
    let g = s.grant(t, ask(10, 1, 4), t0 + 60_000).await.unwrap();
    assert_eq!((g.units, g.holders, g.decision.used), (4, 1, 4));
    let next = Open { id: 10, units: 4, expires: t0 + 120_000 };
    assert_eq!(s.grants_open(t, 1, &l, t0 + 60_000).await.unwrap(), [next], "the lapsed grants are not read");
    assert_eq!(s.grants_open(t, 1, &l, t0 + 120_000).await.unwrap(), [], "nor this one, its window over");
    assert_eq!(s.give_back(t, back(8, 60, t0 + 60_000), t0 + 60_001).await.unwrap(), 0);
    // a reset forgets the window and its book: a give-back of a grant taken before it finds nothing
    s.reset(t, &[op(1, l, 0)], t0 + 60_002).await.unwrap();
    assert_eq!(s.give_back(t, back(10, 4, t0 + 120_000), t0 + 60_003).await.unwrap(), 0);
    assert_eq!(s.grants_open(t, 1, &l, t0 + 60_003).await.unwrap(), [], "a reset closes the book");
    let g = s.grant(t, ask(11, 1, 1_000), t0 + 60_004).await.unwrap();
    assert_eq!((g.units, g.holders, g.decision.reset_at), (50, 1, t0 + 120_004));
}

/// Regional pools of global windows (`algo::pool`): an instance's grant from a pool is
/// bounded by what was filled, not by the limit; a drain takes only what is unspent; one
/// allocator holds the claim at a time, and a fill or a drain ends it; the region's demand
/// is counted; each window's pool is its own; a reset forgets it. A store that keeps none
/// says so.
pub async fn pools_hold_what_the_region_holds(s: &dyn Store) {
    let t = fresh_tag();
    let l = Limit::FixedWindow { limit: 100, window: 10_000, aligned: true };
    let now = (t0() / 10_000) * 10_000 + 100;
    let end = now - 100 + 10_000;
    let call = |act, arrived| PoolCall { key: 1, limit: l, end, arrived, act, bucket: 1_000, left: None };
    let ask = |id, want| GrantAsk { key: 1, limit: l, need: 1, want, id, close: Vec::new(), pool: true };
    if !s.pools() {
        assert!(s.pool(t, call(Act::Read, 0), now).await.is_err(), "a store keeping no pools must refuse a call");
        return;
    }
    assert_eq!(s.grant(t, ask(1, 50), now).await.unwrap().units, 0, "nothing filled: nothing granted");
    let (filled, p) = s.pool(t, call(Act::Fill(10), 7), now).await.unwrap();
    assert_eq!((filled, p.cap, p.used, p.resets_at, p.demand.this), (10, 10, 0, end, 7));
    let g = s.grant(t, ask(2, 4), now + 1).await.unwrap();
    assert_eq!((g.units, g.decision.remaining), (4, 6), "within what is held");
    let (drained, p) = s.pool(t, call(Act::Drain(100), 5), now + 2).await.unwrap();
    assert_eq!((drained, p.cap, p.used, p.demand.this), (6, 4, 4, 12), "only the unspent");
    assert_eq!(s.grant(t, ask(3, 50), now + 3).await.unwrap().units, 0, "all of it granted: nothing more");
    let back = GiveBack { key: 1, limit: l, id: 2, unspent: 3, window: end, keep: 0 };
    assert_eq!(s.give_back(t, back, now + 4).await.unwrap(), 3, "an instance gives back into the pool");
    assert_eq!(s.grant(t, ask(4, 50), now + 5).await.unwrap().units, 1, "a share of the 3 back");
    let (claimed, p) = s.pool(t, call(Act::Claim { ttl: 500 }, 0), now + 6).await.unwrap();
    assert_eq!((claimed, p.claim_until), (1, now + 506));
    assert_eq!(s.pool(t, call(Act::Claim { ttl: 500 }, 0), now + 7).await.unwrap().0, 0, "one at a time");
    let (_, p) = s.pool(t, call(Act::Fill(20), 0), now + 8).await.unwrap();
    assert_eq!((p.cap, p.claim_until), (24, 0), "a fill ends the claim");
    assert_eq!(s.pool(t, call(Act::Claim { ttl: 500 }, 0), now + 9).await.unwrap().0, 1);
    assert_eq!(s.pool(t, call(Act::Release, 0), now + 10).await.unwrap().1.claim_until, 0);
    let plain = GrantAsk { pool: false, ..ask(5, 1_000) };
    assert_eq!(s.grant(t, plain, now + 11).await.unwrap().decision.limit, 100, "a plain grant keeps the limit");
    // the next window's pool is its own (its key names it), filled ahead of its start
    let next = PoolCall { key: 2, end: end + 10_000, ..call(Act::Fill(9), 0) };
    assert_eq!(s.pool(t, next, end).await.unwrap().1.cap, 9);
    let (_, p) = s.pool(t, call(Act::Read, 0), now + 12).await.unwrap();
    assert_eq!(p.cap, 24, "this window's is untouched");
    // what the global store said was left is kept for the window, until it says again
    assert_eq!(p.left, None, "not said yet");
    let (_, p) = s.pool(t, PoolCall { left: Some(76), ..call(Act::Release, 0) }, now + 13).await.unwrap();
    assert_eq!(p.left, Some(76));
    assert_eq!(s.pool(t, call(Act::Read, 0), now + 14).await.unwrap().1.left, Some(76), "kept");
    let (_, p) = s.pool(t, PoolCall { left: Some(0), ..call(Act::Fill(1), 0) }, now + 15).await.unwrap();
    assert_eq!((p.left, p.cap), (Some(0), 25), "said again");
    assert_eq!(
        s.pool(t, PoolCall { key: 2, end: end + 10_000, ..call(Act::Read, 0) }, end).await.unwrap().1.left,
        None
    );
    // a reset forgets the window's pool with its count: the client starts afresh
    s.reset(t, &[op(1, l, 1)], now + 16).await.unwrap();
    let (_, p) = s.pool(t, call(Act::Read, 0), now + 17).await.unwrap();
    assert_eq!((p.cap, p.used, p.left), (0, 0, None), "a reset pool is empty");
    assert_eq!(s.grant(t, ask(6, 50), now + 18).await.unwrap().units, 0, "nothing filled since the reset");
}

/// Quota grants on a token bucket (`algo::grant::bucket_grant`): units held by open
/// grants count as in the bucket for its refill; a give-back counts once and never fills
/// past the burst; a spent grant named by the next ask, or one that lapsed, no longer
/// holds the refill back.
pub async fn bucket_grants_hold_the_refill_back(s: &dyn Store) {
    use crate::algo::grant::{BUCKET_TTL, SKEW};
    if !s.grants() {
        return;
    }
    let t0 = t0();
    let t = fresh_tag();
    // 10 tokens a second, burst 20
    let l = Limit::TokenBucket { rate: 10, per: 1_000, burst: 20 };
    let ask =
        |id, want, close: &[u64]| GrantAsk { key: 1, limit: l, need: 1, want, id, close: close.to_vec(), pool: false };
    let g = s.grant(t, ask(1, 100, &[]), t0).await.unwrap();
    assert_eq!((g.units, g.holders, g.decision.remaining), (10, 1, 10), "half of a full bucket");
    // 900 ms later a bucket would hold 19; the 10 units held keep it at 10
    let g = s.grant(t, ask(2, 1, &[]), t0 + 900).await.unwrap();
    assert_eq!((g.units, g.holders, g.decision.remaining), (1, 2, 9), "the refill is held back by what is held");
    let back = |id, unspent| GiveBack { key: 1, limit: l, id, unspent, window: 0, keep: 0 };
    assert_eq!(s.give_back(t, back(1, 10), t0 + 901).await.unwrap(), 10);
    assert_eq!(s.give_back(t, back(1, 10), t0 + 902).await.unwrap(), 0, "twice: once");
    // grant 2 spent and closed by the next ask: only grant 3 holds the refill back
    let g = s.grant(t, ask(3, 1, &[2]), t0 + 903).await.unwrap();
    assert_eq!((g.units, g.holders, g.decision.remaining), (1, 1, 18));
    let g = s.grant(t, ask(4, 1, &[]), t0 + 2_000).await.unwrap();
    assert_eq!((g.units, g.holders, g.decision.remaining), (1, 2, 18), "refilled to the burst less 3's unit");
    // grant 3 lapses SKEW after its holder stopped spending it
    let lapsed = t0 + 903 + BUCKET_TTL + SKEW;
    let g = s.grant(t, ask(5, 1, &[4]), lapsed).await.unwrap();
    assert_eq!((g.units, g.holders), (1, 1), "3 lapsed, 4 closed: only 5 is open");
    assert_eq!(s.give_back(t, back(3, 1), lapsed + 1).await.unwrap(), 0, "a lapsed grant gives nothing back");
    // grant after grant at one moment: never more than the bucket holds
    let t = fresh_tag();
    let mut granted = 0;
    for id in 1..100 {
        granted += s.grant(t, ask(id, 3, &[]), t0).await.unwrap().units;
    }
    assert_eq!(granted, 20, "a full bucket hands out its burst, no more");
    // a refund (a 304's, say) fills a bucket with grants open only up to the burst less
    // the units they hold
    let t = fresh_tag();
    assert_eq!(s.grant(t, ask(1, 100, &[]), t0).await.unwrap().units, 10);
    s.refund(t, &[Refund { key: 1, limit: l, cost: 15, window: 0 }], t0 + 1).await.unwrap();
    let g = s.grant(t, ask(2, 100, &[]), t0 + 2).await.unwrap();
    assert_eq!((g.units, g.decision.remaining), (2, 8), "refunded past what the open grant holds");
}

/// Grants from many tasks at once never hand out more than the window holds.
pub async fn concurrent_grants_never_pass_the_limit(s: Arc<dyn Store>) {
    if !s.grants() {
        return;
    }
    let t0 = t0();
    let t = fresh_tag();
    let l = Limit::FixedWindow { limit: 1_000, window: 60_000, aligned: false };
    let tasks: Vec<_> = (0..200u64)
        .map(|id| {
            let s = s.clone();
            let ask = GrantAsk { key: 1, limit: l, need: 1, want: 37, id, close: Vec::new(), pool: false };
            tokio::spawn(async move { s.grant(t, ask, t0 + id % 5).await.unwrap().units })
        })
        .collect();
    let mut granted = 0;
    for task in tasks {
        granted += task.await.expect("task panicked");
    }
    let used = hit(s.as_ref(), t, op(1, l, 0), t0 + 10).await.used;
    assert_eq!(used, granted, "the window counts exactly what was granted");
    // the rest, asked for one by one until nothing is left: no unit twice, none lost
    for id in 200.. {
        match s
            .grant(t, GrantAsk { key: 1, limit: l, need: 1, want: 37, id, close: Vec::new(), pool: false }, t0 + 11)
            .await
            .unwrap()
            .units
        {
            0 => break,
            units => granted += units,
        }
    }
    assert_eq!(granted, 1_000);
    assert!(!hit(s.as_ref(), t, op(1, l, 1), t0 + 12).await.allowed);
}
