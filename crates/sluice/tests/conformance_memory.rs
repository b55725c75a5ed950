//! The in-process stores against the conformance suite: the memory store, and the
//! stores made of stores (a migration half way, and the deadline and breaker wrapper),
//! which must answer exactly as what they wrap.

use sluice::store::{MemoryStore, MigratingStore, Resilience, Resilient};
use std::sync::Arc;

sluice::conformance_suite!(memory, async { (MemoryStore::new(100_000), ()) });

// half the clients on each side: a client's calls all go to one side
sluice::conformance_suite!(migrating, async {
    let (from, to) = (Arc::new(MemoryStore::new(100_000)), Arc::new(MemoryStore::new(100_000)));
    (MigratingStore::new(from, to, 50), ())
});

sluice::conformance_suite!(resilient, async { (Resilient::new(MemoryStore::new(100_000), Resilience::default()), ()) });

// one-second windows on a store of their own (envoyproxy/ratelimit's REDIS_PERSECOND): a
// client's calls that meet both are two, kept all or nothing
sluice::conformance_suite!(per_second, async {
    let (main, second) = (Arc::new(MemoryStore::new(100_000)), Arc::new(MemoryStore::new(100_000)));
    (sluice::store::PerSecondStore::new(main, second), ())
});

/// The per-second store keeps each window on its side, and a call that meets both all
/// or nothing: a refusal on one side gives back what the other charged (and a lease it
/// took), and reports it so.
#[tokio::test]
async fn one_second_windows_live_apart_and_calls_stay_all_or_nothing() {
    use sluice::algo::{Limit, Op};
    use sluice::store::Store;
    let (main, second) = (Arc::new(MemoryStore::new(1_000)), Arc::new(MemoryStore::new(1_000)));
    let s = sluice::store::PerSecondStore::new(main.clone(), second.clone());
    let t = sluice::store::conformance::fresh_tag();
    let t0 = sluice::store::conformance::t0();
    let op = |key, limit| Op { key, limit, cost: 1, lease: None, shadow: false };
    let per_second = op(1, Limit::FixedWindow { limit: 1, window: 1_000, aligned: false });
    let minute = op(2, Limit::FixedWindow { limit: 5, window: 60_000, aligned: false });
    let d = s.apply(t, &[per_second, minute], t0).await.unwrap();
    assert!(d.iter().all(|d| d.allowed));
    // each on its side, and only there
    assert_eq!(second.peek(t, &[per_second], t0).await.unwrap()[0].used, 1);
    assert_eq!(main.peek(t, &[per_second], t0).await.unwrap()[0].used, 0);
    assert_eq!(main.peek(t, &[minute], t0).await.unwrap()[0].used, 1);
    // the per-second window refuses: the minute's charge is given back, and said so
    let d = s.apply(t, &[per_second, minute], t0 + 10).await.unwrap();
    assert!(!d[0].allowed && d[1].allowed);
    assert_eq!((d[1].used, d[1].remaining), (1, 4));
    assert_eq!(main.peek(t, &[minute], t0 + 10).await.unwrap()[0].used, 1, "given back");
    // the main side refuses: the per-second charge is given back
    let tight = op(3, Limit::FixedWindow { limit: 0, window: 60_000, aligned: false });
    let d = s.apply(t, &[per_second, tight], t0 + 2_000).await.unwrap();
    assert!(d[0].allowed && !d[1].allowed);
    assert_eq!(second.peek(t, &[per_second], t0 + 2_000).await.unwrap()[0].used, 0, "given back");
    // a lease taken on the main side goes back when the per-second window refuses
    let lease = Op { lease: Some(7), ..op(4, Limit::Concurrency { limit: 1, lease_ttl: 60_000 }) };
    assert!(s.apply(t, &[per_second], t0 + 3_000).await.unwrap()[0].allowed);
    let d = s.apply(t, &[per_second, lease], t0 + 3_010).await.unwrap();
    assert!(!d[0].allowed);
    let held = main.leases(t, 4, 60_000, t0 + 3_010).await.unwrap();
    assert!(held.leases.is_empty(), "the lease was given back: {held:?}");
}
