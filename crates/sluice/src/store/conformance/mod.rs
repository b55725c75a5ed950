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
use crate::algo::grant::Open;
use crate::algo::pool::Act;
use crate::algo::{self, Decision, Lease, Limit, Op, State};
use crate::tag::Tag;
use crate::time::{Clock, Millis};
use std::collections::HashMap;
use std::sync::Arc;

mod grants;
mod model;
mod reservations;

pub use grants::*;
pub use model::*;
pub use reservations::*;

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
