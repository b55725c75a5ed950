//! The memory store's own tests (the conformance suite runs on it too).

use super::*;

/// Collecting past a hold's deadline keeps its ledger while its window lives: the
/// first call after it, however late, gives the units back (the collector ran every
/// few seconds in a server and, dropping ledgers at their last deadline, kept lapsed
/// holds' units for the rest of the window).
#[tokio::test]
async fn collecting_keeps_a_lapsed_hold_until_its_window_gives_it_back() {
    let store = MemoryStore::new(1_000);
    let (t, now) = (Tag(7), 1_000_000);
    let l = Limit::FixedWindow { limit: 100, window: 60_000, aligned: false };
    let op = |cost| Op { key: 1, limit: l, cost, lease: None, shadow: false };
    assert!(store.reserve(t, &[op(30)], Reservation { id: 1, ttl: 1_000 }, now).await.unwrap()[0].allowed);
    for late in [2_000, 3_000, 5_000] {
        store.collect(now + late);
    }
    let d = store.apply(t, &[op(1)], now + 5_001).await.unwrap()[0];
    assert_eq!((d.used, d.holds), (1, false), "{d:?}");
    store.collect(now + 60_000);
    assert!(store.is_empty(), "the window's end takes window and ledger");
    assert!(lock(&store.shards[((t.0 >> 64) as usize) % SHARDS]).ledgers.is_empty());
}
