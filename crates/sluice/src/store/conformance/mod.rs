//! The conformance suite: one set of behaviours every store must show.
//!
//! Each check is an async function over `&dyn Store`. The reference is the pure
//! algorithms: [`sequence_matches_model`] drives a store and [`crate::algo`] through the
//! same random operations and demands identical decisions. A store joins the suite with
//! one line:
//!
//! ```ignore
//! sluice::conformance_suite!(memory, async { (sluice::store::MemoryStore::new(100_000), ()) });
//! ```
//!
//! The expression yields the store and a guard that lives as long as the test (a server
//! process, say). Time is passed to the store directly (stores take `now` as an
//! argument), so the suite crosses window boundaries without sleeping. Every check uses
//! fresh random tags, so checks may share one store and one server.

use super::{Commit, GiveBack, GrantAsk, PoolCall, Refund, RegistryOp, Reservation, Settled, Store};
use crate::algo::escrow::Act;
use crate::algo::{self, Decision, Lease, Limit, Op, State};
use crate::tag::Tag;
use crate::time::{Clock, Millis};
use std::collections::HashMap;
use std::sync::Arc;

/// A start time for the checks: an hour from now, at a non-round millisecond, so aligned
/// windows do not start exactly at it. Tests move their own clock forward from here; it
/// must not lie in the past, because a Redis store sets TTLs (`PEXPIREAT`) from the times
/// it is given and its server expires keys by the real clock.
pub fn t0() -> Millis {
    (crate::time::SystemClock.now() / 1000 + 3600) * 1000 + 123
}

const FW: Limit = Limit::FixedWindow { limit: 5, window: 60_000, aligned: false };

/// A fresh random client tag.
pub fn fresh_tag() -> Tag {
    let mut b = [0u8; 16];
    // a fresh random tag per check; getrandom failing is not something a test can fix
    getrandom::fill(&mut b).expect("getrandom");
    Tag(u128::from_le_bytes(b))
}

fn op(key: u64, limit: Limit, cost: u64) -> Op {
    Op { key, limit, cost, lease: None, shadow: false }
}

async fn hit(s: &dyn Store, t: Tag, o: Op, now: Millis) -> Decision {
    s.apply(t, &[o], now).await.expect("store call failed")[0]
}

/// A fixed window admits its limit, refuses the rest without charging, keeps one stored
/// reset for the whole window, and starts afresh at the reset.
pub async fn fixed_window_counts_and_resets(s: &dyn Store) {
    let t0 = t0();
    let t = fresh_tag();
    let mut resets = Vec::new();
    for i in 0..5u64 {
        let d = hit(s, t, op(1, FW, 1), t0 + i * 7_001).await;
        assert!(d.allowed, "hit {i} refused: {d:?}");
        assert_eq!((d.limit, d.used, d.remaining), (5, i + 1, 4 - i));
        resets.push(d.reset_at);
    }
    assert!(resets.iter().all(|&r| r == t0 + 60_000), "the reset moved: {resets:?}");
    let d = hit(s, t, op(1, FW, 1), t0 + 59_999).await;
    assert!(!d.allowed);
    assert_eq!((d.remaining, d.used, d.reset_at, d.retry_after), (0, 5, t0 + 60_000, Some(1)));
    let d = hit(s, t, op(1, FW, 1), t0 + 60_000).await;
    assert!(d.allowed, "a new window must start at the stored reset");
    assert_eq!((d.used, d.reset_at), (1, t0 + 120_000));
}

/// Aligned windows end on multiples of the window.
pub async fn aligned_window_ends_on_boundary(s: &dyn Store) {
    let t0 = t0();
    let t = fresh_tag();
    let l = Limit::FixedWindow { limit: 2, window: 1_000, aligned: true };
    let d = hit(s, t, op(1, l, 1), t0).await;
    assert_eq!(d.reset_at, (t0 / 1000 + 1) * 1000);
}

/// A refusal by one limit charges none of the others (all or nothing).
pub async fn all_or_nothing(s: &dyn Store) {
    let t0 = t0();
    let t = fresh_tag();
    let tight = Limit::FixedWindow { limit: 1, window: 60_000, aligned: false };
    let ops = [op(1, FW, 1), op(2, tight, 1)];
    let d = s.apply(t, &ops, t0).await.unwrap();
    assert!(d[0].allowed && d[1].allowed);
    let d = s.apply(t, &ops, t0 + 1).await.unwrap();
    assert!(!d[1].allowed);
    assert!(d[0].allowed, "the loose limit alone would allow");
    assert_eq!(d[0].remaining, 4, "the loose limit must not be charged when another refuses");
    let d = s.peek(t, &ops[..1], t0 + 2).await.unwrap();
    assert_eq!(d[0].used, 1);
}

/// A shadow op's refusal is reported, but the other ops are charged.
pub async fn shadow_does_not_block(s: &dyn Store) {
    let t0 = t0();
    let t = fresh_tag();
    let tight = Limit::FixedWindow { limit: 1, window: 60_000, aligned: false };
    let shadow = Op { shadow: true, ..op(2, tight, 1) };
    for i in 0..3u64 {
        let d = s.apply(t, &[op(1, FW, 1), shadow], t0 + i).await.unwrap();
        assert!(d[0].allowed);
        assert_eq!(d[0].used, i + 1, "enforced op must be charged");
        assert_eq!(d[1].allowed, i == 0, "shadow op reports what it would do");
    }
}

/// Cost 0 reports status and charges nothing.
pub async fn cost_zero_charges_nothing(s: &dyn Store) {
    let t0 = t0();
    let t = fresh_tag();
    let tb = Limit::TokenBucket { rate: 1, per: 1_000, burst: 3 };
    for _ in 0..3 {
        let d = s.apply(t, &[op(1, FW, 0), op(2, tb, 0)], t0).await.unwrap();
        assert_eq!((d[0].used, d[0].remaining), (0, 5));
        assert_eq!(d[1].remaining, 3);
    }
}

/// Peeks never change state; a window whose stored reset has passed reads as fresh.
pub async fn peek_never_charges(s: &dyn Store) {
    let t0 = t0();
    let t = fresh_tag();
    hit(s, t, op(1, FW, 3), t0).await;
    for i in 0..10 {
        let d = s.peek(t, &[op(1, FW, 1)], t0 + i).await.unwrap()[0];
        assert_eq!((d.used, d.remaining, d.reset_at), (3, 2, t0 + 60_000));
    }
    let d = s.peek(t, &[op(1, FW, 1)], t0 + 60_000).await.unwrap()[0];
    assert_eq!((d.used, d.remaining), (0, 5), "a passed window must read as empty");
    let fresh = s.peek(fresh_tag(), &[op(1, FW, 1)], t0).await.unwrap()[0];
    assert_eq!((fresh.used, fresh.remaining), (0, 5));
}

/// A token bucket spends its burst, refills at exactly its rate, and says when to retry.
pub async fn token_bucket_burst_and_refill(s: &dyn Store) {
    let t0 = t0();
    let t = fresh_tag();
    let tb = Limit::TokenBucket { rate: 3, per: 1_000, burst: 3 };
    for left in [2, 1, 0] {
        let d = hit(s, t, op(1, tb, 1), t0).await;
        assert!(d.allowed);
        assert_eq!(d.remaining, left);
    }
    let d = hit(s, t, op(1, tb, 1), t0).await;
    assert!(!d.allowed);
    assert_eq!(d.retry_after, Some(334), "a token every 333.3 ms");
    assert_eq!(d.reset_at, t0 + 1_000);
    assert!(!hit(s, t, op(1, tb, 1), t0 + 333).await.allowed);
    assert!(hit(s, t, op(1, tb, 1), t0 + 334).await.allowed);
    let d = hit(s, t, op(1, tb, 2), t0 + 10_000).await;
    assert_eq!(d.remaining, 1, "refill stops at the burst");
}

/// The sliding window weighs the previous window.
pub async fn sliding_window_weighs_previous(s: &dyn Store) {
    let t0 = t0();
    let t = fresh_tag();
    let sw = Limit::SlidingWindow { limit: 10, window: 1_000 };
    let base = (t0 / 1000 + 1) * 1000;
    let d = hit(s, t, op(1, sw, 10), base + 999).await;
    assert!(d.allowed);
    let d = hit(s, t, op(1, sw, 1), base + 1_000).await;
    assert!(!d.allowed);
    assert_eq!(d.retry_after, Some(100));
    assert!(!hit(s, t, op(1, sw, 1), base + 1_099).await.allowed);
    assert!(hit(s, t, op(1, sw, 1), base + 1_100).await.allowed);
}

/// Leases: capacity, idempotent release, reclaim after the TTL.
pub async fn concurrency_leases(s: &dyn Store) {
    let t0 = t0();
    let t = fresh_tag();
    let cc = Limit::Concurrency { limit: 3, lease_ttl: 10_000 };
    let take = |lease: u128, now| {
        let o = Op { lease: Some(lease), ..op(9, cc, 1) };
        async move { s.apply(t, &[o], now).await.unwrap()[0] }
    };
    for id in 1..=3 {
        assert!(take(id, t0).await.allowed);
    }
    let d = take(4, t0 + 1).await;
    assert!(!d.allowed);
    assert_eq!((d.remaining, d.retry_after), (0, Some(9_999)));
    let held = s.leases(t, 9, 10_000, t0 + 1).await.unwrap();
    assert_eq!(held.leases, vec![(1, t0), (2, t0), (3, t0)], "listed with when taken");
    assert!(s.release(t, &[9], 2, t0 + 2).await.unwrap());
    assert!(!s.release(t, &[9], 2, t0 + 2).await.unwrap(), "release is idempotent");
    assert!(take(4, t0 + 3).await.allowed);
    assert!(!take(5, t0 + 4).await.allowed);
    assert!(take(5, t0 + 10_000).await.allowed, "leases past their TTL are reclaimed");
    let live = s.leases(t, 9, 10_000, t0 + 10_000).await.unwrap().leases;
    assert_eq!(live.iter().map(|l| l.0).collect::<Vec<_>>(), [4, 5], "only live leases are listed: {live:?}");
    assert!(s.leases(t, 8, 10_000, t0).await.unwrap().leases.is_empty(), "no state, no leases");
}

/// Refunds give back within the charged window and never reach a later one.
pub async fn refunds(s: &dyn Store) {
    let t0 = t0();
    let t = fresh_tag();
    let d = hit(s, t, op(1, FW, 5), t0).await;
    let r = Refund { key: 1, limit: FW, cost: 2, window: d.reset_at };
    s.refund(t, &[r], t0 + 1).await.unwrap();
    assert_eq!(hit(s, t, op(1, FW, 0), t0 + 2).await.remaining, 2);
    // the window passed: the refund must not add to the new one
    hit(s, t, op(1, FW, 1), t0 + 60_000).await;
    s.refund(t, &[r], t0 + 60_001).await.unwrap();
    assert_eq!(hit(s, t, op(1, FW, 0), t0 + 60_002).await.used, 1);
}

/// A reset forgets the states it names, and only those: the client starts a fresh window.
pub async fn reset_forgets_state(s: &dyn Store) {
    let t0 = t0();
    let t = fresh_tag();
    hit(s, t, op(1, FW, 5), t0).await;
    hit(s, t, op(2, FW, 3), t0).await;
    s.reset(t, &[op(1, FW, 0)], t0 + 1).await.unwrap();
    let d = hit(s, t, op(1, FW, 1), t0 + 2).await;
    assert!(d.allowed, "refused after a reset: {d:?}");
    assert_eq!((d.used, d.reset_at), (1, t0 + 2 + 60_000), "a reset client starts a fresh window");
    assert_eq!(hit(s, t, op(2, FW, 0), t0 + 3).await.used, 3, "a state not named keeps its count");
    s.reset(fresh_tag(), &[op(1, FW, 0)], t0 + 4).await.expect("resetting what is not there is no error");
}

/// A reset empties buckets' debt and drops leases, in one call.
pub async fn reset_forgets_every_kind(s: &dyn Store) {
    let t0 = t0();
    let t = fresh_tag();
    let tb = Limit::TokenBucket { rate: 1, per: 60_000, burst: 2 };
    let cc = Limit::Concurrency { limit: 1, lease_ttl: 60_000 };
    let lease = |id| Op { lease: Some(id), ..op(2, cc, 1) };
    assert!(hit(s, t, op(1, tb, 2), t0).await.allowed);
    assert!(hit(s, t, lease(1), t0).await.allowed);
    assert!(!hit(s, t, op(1, tb, 1), t0 + 1).await.allowed);
    assert!(!hit(s, t, lease(2), t0 + 1).await.allowed);
    s.reset(t, &[op(1, tb, 0), op(2, cc, 0)], t0 + 2).await.unwrap();
    assert_eq!(hit(s, t, op(1, tb, 1), t0 + 3).await.remaining, 1, "a full bucket again");
    assert!(hit(s, t, lease(3), t0 + 3).await.allowed, "the lease held was dropped");
}

/// The registry: every change moves the version; a conditional remove removes only an
/// unchanged value; a put past the maximum writes nothing; the change log lists each id
/// changed after a version once, at its last change (a removed one without a value); the
/// pages of a scan hold every entry. A store without one says so.
pub async fn registry_is_versioned(s: &dyn Store) {
    if !s.keeps_registry() {
        let read = s.registry(RegistryOp::Scan { cursor: 0, count: 10 }).await;
        assert!(read.is_err(), "a store keeping no registry must refuse to read one");
        return;
    }
    let id = format!("conformance-{:x}", fresh_tag().0);
    let (other, max) = (format!("{id}-other"), u64::MAX);
    let put = |value: &str| RegistryOp::Put { entries: vec![(id.clone(), value.into())], max };
    let remove = |only_if: &str| RegistryOp::Remove { id: id.clone(), only_if: Some(only_if.into()) };
    let v0 = s.registry(RegistryOp::Version).await.unwrap().version;
    let first = s.registry(put("a")).await.unwrap();
    assert!(first.version > v0 && first.previous.is_none() && first.full.is_none(), "{first:?}");
    assert!(scan(s).await.contains(&(id.clone(), "a".into())));
    let refused = s.registry(RegistryOp::Put { entries: vec![(other.clone(), "x".into())], max: 0 }).await.unwrap();
    assert!(refused.full.is_some() && refused.version == first.version, "nothing written past the max: {refused:?}");
    assert_eq!(s.registry(put("b")).await.unwrap().previous.as_deref(), Some("a"));
    let both = vec![(id.clone(), "c".into()), (other.clone(), "d".into())];
    assert!(s.registry(RegistryOp::Put { entries: both, max }).await.unwrap().full.is_none());
    assert_eq!(s.registry(remove("a")).await.unwrap().previous, None, "changed since: not removed");
    let gone = s.registry(remove("c")).await.unwrap();
    assert_eq!(gone.previous.as_deref(), Some("c"));
    let all = scan(s).await;
    assert!(!all.iter().any(|(k, _)| *k == id) && all.contains(&(other.clone(), "d".into())), "{all:?}");
    let changes = s.registry(RegistryOp::Changes { after: v0, count: 1_000 }).await.unwrap().changes;
    let mine: Vec<_> = changes.iter().filter(|c| c.id.starts_with(&id)).map(|c| (&*c.id, c.value.as_deref())).collect();
    assert_eq!(mine, [(&*other, Some("d")), (&*id, None)], "each id once, at its last change, oldest first");
    let one = s.registry(RegistryOp::Changes { after: v0, count: 1 }).await.unwrap();
    assert!(one.changes.len() == 1 && one.floor <= v0, "{one:?}");
    assert!(s.registry(RegistryOp::Touch).await.unwrap().version > gone.version, "a touch moves the version");
    s.registry(RegistryOp::Remove { id: other, only_if: None }).await.unwrap();
}

/// Every entry of the registry, read in pages of 2.
async fn scan(s: &dyn Store) -> Vec<(String, String)> {
    let (mut cursor, mut all) = (0, Vec::new());
    loop {
        let page = s.registry(RegistryOp::Scan { cursor, count: 2 }).await.unwrap();
        all.extend(page.entries);
        cursor = page.cursor;
        if cursor == 0 {
            return all;
        }
    }
}

/// Quota grants (`algo::grant`): a grant charges the window at once and is a share of
/// what is left; a give-back counts once, only in its window; a reset closes the book;
/// grants and plain charges of one window add up. A store that takes no grants says so.
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
    assert_eq!(hit(s, t, op(1, l, 3), t0 + 2).await.remaining, 35, "a plain charge counts on top of grants");
    let back = |id, unspent, window| GiveBack { key: 1, limit: l, id, unspent, window };
    assert_eq!(s.give_back(t, back(u64::MAX, 20, t0 + 60_000), t0 + 3).await.unwrap(), 20);
    assert_eq!(s.give_back(t, back(u64::MAX, 20, t0 + 60_000), t0 + 4).await.unwrap(), 0, "twice: once");
    assert_eq!(s.give_back(t, back(7, 99, t0 + 60_000), t0 + 5).await.unwrap(), 12, "never more than granted");
    assert_eq!(hit(s, t, op(1, l, 0), t0 + 6).await.used, 33);
    let need = s.grant(t, ask(8, 60, 5), t0 + 7).await.unwrap();
    assert_eq!(need.units, 60, "at least one request's cost");
    assert_eq!(s.grant(t, ask(9, 10, 10), t0 + 8).await.unwrap().units, 0, "less than asked is left: nothing");
    // the next window: the old grants lapsed and cannot be given back into it
    let g = s.grant(t, ask(10, 1, 4), t0 + 60_000).await.unwrap();
    assert_eq!((g.units, g.holders, g.decision.used), (4, 1, 4));
    assert_eq!(s.give_back(t, back(8, 60, t0 + 60_000), t0 + 60_001).await.unwrap(), 0);
    // a reset forgets the window and its book: a give-back of a grant taken before it finds nothing
    s.reset(t, &[op(1, l, 0)], t0 + 60_002).await.unwrap();
    assert_eq!(s.give_back(t, back(10, 4, t0 + 120_000), t0 + 60_003).await.unwrap(), 0);
    let g = s.grant(t, ask(11, 1, 1_000), t0 + 60_004).await.unwrap();
    assert_eq!((g.units, g.holders, g.decision.reset_at), (50, 1, t0 + 120_004));
}

/// Regional pools of global windows (`algo::escrow`): an instance's grant from a pool is
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
    let back = GiveBack { key: 1, limit: l, id: 2, unspent: 3, window: end };
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
    let back = GiveBack { key: 1, limit: l, id: 9, unspent: 5, window: t0 + 60_000 };
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
    let model = super::MemoryStore::new(1_000);
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
    let back = |id, unspent| GiveBack { key: 1, limit: l, id, unspent, window: 0 };
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

/// Concurrent calls for one client are exact: 300 at once against a limit of 100 admit
/// exactly 100.
pub async fn concurrent_calls_are_exact(s: Arc<dyn Store>) {
    let t0 = t0();
    let t = fresh_tag();
    let l = Limit::FixedWindow { limit: 100, window: 60_000, aligned: false };
    let tasks: Vec<_> = (0..300)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move { s.apply(t, &[op(1, l, 1)], t0 + i % 7).await.unwrap()[0].allowed })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.expect("task panicked") as u32;
    }
    assert_eq!(admitted, 100);
}

/// Tags and keys are independent of one another.
pub async fn tags_and_keys_are_independent(s: &dyn Store) {
    let t0 = t0();
    let (a, b) = (fresh_tag(), fresh_tag());
    hit(s, a, op(1, FW, 5), t0).await;
    assert_eq!(hit(s, b, op(1, FW, 0), t0).await.remaining, 5);
    assert_eq!(hit(s, a, op(2, FW, 0), t0).await.remaining, 5);
}

/// One step of a random sequence: what a client does, and how long after the step
/// before it. Clients are numbered; [`replay`] gives each a fresh tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Apply { gap: Millis, client: usize, ops: Vec<Op> },
    Peek { gap: Millis, client: usize, ops: Vec<Op> },
    Refund { gap: Millis, client: usize, op: Op },
    Release { gap: Millis, client: usize, key: u64, lease: Lease },
}

/// Replays `steps` through the store and through the pure algorithms (the reference
/// model) under one clock, and returns the first step whose answers differ. The one
/// random-sequence harness: the suite feeds it seeded sequences, and property tests
/// feed it shrinking ones.
pub async fn replay(s: &dyn Store, steps: &[Step]) -> Result<(), String> {
    let clients = steps.iter().map(Step::client).max().map_or(0, |c| c + 1);
    let tags: Vec<Tag> = (0..clients).map(|_| fresh_tag()).collect();
    let mut model: HashMap<(Tag, u64), State> = HashMap::new();
    let mut now = t0();
    for (i, step) in steps.iter().enumerate() {
        now += step.gap();
        let t = tags[step.client()];
        let store_error = |e| format!("step {i}: the store failed: {e}");
        match step {
            Step::Apply { ops, .. } => {
                let mut states: Vec<Option<State>> = ops.iter().map(|o| model.get(&(t, o.key)).cloned()).collect();
                let want = algo::apply_all(ops, &mut states, now);
                for (o, st) in ops.iter().zip(states) {
                    model.extend(st.map(|st| ((t, o.key), st)));
                }
                let got = s.apply(t, ops, now).await.map_err(store_error)?;
                if got != want {
                    return Err(format!("apply differs at step {i} for {ops:?}:\n store {got:?}\n model {want:?}"));
                }
            }
            Step::Peek { ops, .. } => {
                let want = algo::peek_all(ops, ops.iter().map(|o| model.get(&(t, o.key)).cloned()).collect(), now);
                let got = s.peek(t, ops, now).await.map_err(store_error)?;
                if got != want {
                    return Err(format!("peek differs at step {i} for {ops:?}:\n store {got:?}\n model {want:?}"));
                }
            }
            Step::Refund { op, .. } => {
                let stored = model.get(&(t, op.key)).cloned();
                let window = op.limit.peek(stored.clone(), now).reset_at;
                if let Some(new) = stored.and_then(|st| op.limit.refund(st, op.cost, window, now)) {
                    model.insert((t, op.key), new);
                }
                let r = Refund { key: op.key, limit: op.limit, cost: op.cost, window };
                s.refund(t, &[r], now).await.map_err(store_error)?;
            }
            Step::Release { key, lease, .. } => {
                let want = match model.get_mut(&(t, *key)) {
                    Some(State::Leases(l)) => algo::concurrency::release(l, *lease),
                    _ => false,
                };
                let got = s.release(t, &[*key], *lease, now).await.map_err(store_error)?;
                if got != want {
                    return Err(format!("release differs at step {i}: store {got}, model {want}"));
                }
            }
        }
    }
    Ok(())
}

impl Step {
    fn gap(&self) -> Millis {
        match self {
            Step::Apply { gap, .. } | Step::Peek { gap, .. } | Step::Refund { gap, .. } | Step::Release { gap, .. } => {
                *gap
            }
        }
    }

    fn client(&self) -> usize {
        match self {
            Step::Apply { client, .. }
            | Step::Peek { client, .. }
            | Step::Refund { client, .. }
            | Step::Release { client, .. } => *client,
        }
    }
}

/// The limits of random sequences, state key = index: every algorithm, windows aligned
/// and not, a bucket whose rate does not divide its period, a sliding window of 1; the
/// concurrency limit last ([`LEASES`]).
pub const LIMITS: [Limit; 6] = [
    Limit::FixedWindow { limit: 7, window: 2_000, aligned: false },
    Limit::FixedWindow { limit: 4, window: 1_500, aligned: true },
    Limit::TokenBucket { rate: 7, per: 3_000, burst: 4 },
    Limit::SlidingWindow { limit: 6, window: 1_000 },
    Limit::SlidingWindow { limit: 1, window: 700 },
    Limit::Concurrency { limit: 2, lease_ttl: 1_200 },
];

/// The state key of [`LIMITS`]' concurrency limit.
pub const LEASES: u64 = 5;

/// The op on [`LIMITS`]`[key]`; for the concurrency limit, taking `lease`.
pub fn op_on(key: u64, cost: u64, shadow: bool, lease: Lease) -> Op {
    let limit = LIMITS[key as usize];
    let lease = matches!(limit, Limit::Concurrency { .. }).then_some(lease);
    Op { key, limit, cost, lease, shadow }
}

/// A small deterministic generator (xorshift), so a failing sequence can be replayed
/// from its seed (which must not be 0).
pub struct Rng(pub u64);
impl Rng {
    /// The next number below `n`.
    pub fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// 400 steps of apply, peek, refund and release by two clients over [`LIMITS`], the
/// clock moving forward irregularly, from `seed`.
pub fn steps_from_seed(seed: u64) -> Vec<Step> {
    let mut rng = Rng(seed | 1);
    let mut steps = Vec::new();
    for _ in 0..400 {
        let gap = rng.next(3) * rng.next(400);
        let client = rng.next(2) as usize;
        let mut ops: Vec<Op> = Vec::new();
        for _ in 0..1 + rng.next(3) {
            let k = rng.next(LIMITS.len() as u64);
            let (cost, shadow, lease) = (rng.next(3), rng.next(5) == 0, 1 + rng.next(4) as u128);
            // one state per key: a call naming a key twice is not meaningful
            if !ops.iter().any(|o| o.key == k) {
                ops.push(op_on(k, cost, shadow, lease));
            }
        }
        steps.push(match rng.next(10) {
            0..6 => Step::Apply { gap, client, ops },
            6..8 => Step::Peek { gap, client, ops },
            8 => Step::Refund { gap, client, op: ops[0] },
            _ => Step::Release { gap, client, key: LEASES, lease: 1 + rng.next(4) as u128 },
        });
    }
    steps
}

/// Random sequences of apply, peek, refund and release give the same answers from the
/// store as from the pure algorithms (five seeds).
pub async fn sequence_matches_model(s: &dyn Store) {
    for seed in [1, 7, 42, 1234, 99991] {
        if let Err(e) = replay(s, &steps_from_seed(seed)).await {
            panic!("seed {seed}: {e}");
        }
    }
}
