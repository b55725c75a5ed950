//! The allocator's bounds, on memory stores and a stepped clock.

use super::*;
use crate::store::MemoryStore;
use crate::time::ManualClock;

fn allocator(clock: &ManualClock) -> Arc<Regions> {
    let store = || -> Arc<dyn Store> { Arc::new(MemoryStore::new(1_000)) };
    Regions::named("eu", store(), store(), Arc::new(clock.clone()))
}

fn op(client: u64) -> Op {
    let limit = Limit::FixedWindow { limit: 10, window: 3_600_000, aligned: true };
    Op { key: client, limit, cost: 1, shadow: false, lease: None }
}

/// A flood of distinct clients keeps at most [`MAX_ACTIVE`]: past it, a new client is
/// counted and not kept while none is idle; once the kept ones are idle (nothing asked
/// for since the last tick, no grant open, none seen within a horizon), the next new
/// client sweeps them out and is kept, and a sweep comes at most once a second. A
/// client holding a grant of this instance is never swept.
#[test]
fn a_flood_of_clients_keeps_a_bounded_number() {
    let clock = ManualClock::new(1_000_000);
    let regions = allocator(&clock);
    let now = clock.now();
    for c in 0..MAX_ACTIVE as u64 {
        regions.arrived(Tag(u128::from(c)), &op(c), now);
    }
    regions.arrived(Tag(u128::MAX), &op(7), now);
    let kept = || regions.active.lock().unwrap().len();
    assert_eq!((kept(), regions.stats().untracked.load(Relaxed)), (MAX_ACTIVE, 1), "full, none idle");
    {
        // a tick reported every client's demand; one of them holds a grant open
        let mut active = regions.active.lock().unwrap();
        active.values_mut().for_each(|a| a.arrived = 0);
        let a = active.get_mut(&(Tag(3), pool::base_key(3, &op(3).limit, 3_600_000))).expect("kept");
        a.windows.entry(3_600_000).or_default().open.push(Open { id: 1, units: 2, expires: 3_600_000 });
    }
    // within the second of the first sweep: not swept again
    clock.set(now + 999);
    regions.arrived(Tag(u128::MAX), &op(8), clock.now());
    assert_eq!((kept(), regions.stats().untracked.load(Relaxed)), (MAX_ACTIVE, 2), "swept at most once a second");
    clock.set(now + 1_000);
    regions.arrived(Tag(u128::MAX), &op(9), clock.now());
    let active = regions.active.lock().unwrap();
    assert_eq!(active.len(), 2, "the idle swept: the client holding a grant, and the new one");
    assert!(active.contains_key(&(Tag(3), pool::base_key(3, &op(3).limit, 3_600_000))));
    drop(active);
    assert_eq!(regions.view().untracked, 2, "said in the region's figures");
}

/// A region's beats count it once, even after a beat skipped (the global store cut off
/// for a beat, the instance paused): the lease of the beat before the skipped one is
/// given back too, not left to count as another region until it lapses.
#[tokio::test]
async fn a_beat_skipped_leaves_no_second_region() {
    use super::outage::{beat_in, beat_lease, befores};
    let store = MemoryStore::new(1_000);
    let beat = |n: u64| {
        let store = &store;
        async move {
            let (lease, before) = (beat_lease("eu", n), befores(n, |k| beat_lease("eu", k)));
            beat_in(store, (2, lease, &before), n * BEAT).await.unwrap()
        }
    };
    assert_eq!(beat(10).await, 1);
    assert_eq!(beat(11).await, 1);
    assert_eq!(beat(13).await, 1, "beat 12 skipped: beat 11's lease is given back too");
    // another region beating here is counted
    let other = beat_in(&store, (2, beat_lease("us", 13), &[]), 13 * BEAT).await.unwrap();
    assert_eq!(other, 2, "two regions on one store");
}
