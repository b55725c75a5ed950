//! RLQS shares at the end of a window: a TTL is whole seconds, so the window's last
//! piece is sent again to last to the window's end, and a report that could only send
//! a shorter piece sends nothing.

use sluice::config::RulesConfig;
use sluice::rlqs::{Assignment, MARGIN, SLOP, Share};
use sluice::store::MemoryStore;
use sluice::time::{ManualClock, Millis};
use sluice::{Limiter, rlqs::QuotaTarget};
use std::sync::Arc;

const LIMIT: u64 = 1_200;
const WINDOW: Millis = 60_000;

fn limiter(clock: &ManualClock) -> Limiter {
    let config = serde_json::json!({"domains": [{"domain": "edge", "descriptors": [
        {"key": "name", "policies": [{"name": "per_minute", "fixed_window": {"limit": LIMIT, "window": "1m"}}]},
    ]}]});
    let rules = serde_json::from_value::<RulesConfig>(config).unwrap().compile().unwrap();
    Limiter::new(Arc::new(rules), Arc::new(MemoryStore::new(10_000)), Arc::new(clock.clone()))
}

fn target(limiter: &Limiter) -> QuotaTarget {
    limiter.quota_target("edge", &[("name", "hot")]).unwrap()
}

/// Reports `allowed` requests (and three times as many denied) over 5 s, ticks, and
/// returns what would be sent.
async fn report(share: &mut Share, limiter: &Limiter, allowed: u64) -> Option<Assignment> {
    share.report(allowed, allowed * 3, 5);
    share.tick(limiter, &target(limiter), limiter.now()).await.unwrap().assignment
}

#[tokio::test]
async fn the_windows_last_piece_is_sent_again_to_last_to_its_end() {
    let clock = ManualClock::new(sluice::store::conformance::t0());
    let limiter = limiter(&clock);
    let mut share = Share::default();
    assert!(report(&mut share, &limiter, 0).await.is_some(), "the first report is assigned a share");
    let end = share.window;
    assert_eq!(end, limiter.now() + WINDOW, "the window starts with the first grant");
    assert_eq!(share.due(), end, "mid-window, the share is due when its window ends");

    // 3.7 s before the end: a 7 s TTL is cut to 3 whole seconds, which lapse 0.6 s early
    clock.set(end - 3_700);
    let Some(Assignment::TokenBucket { rate, depth, ttl: 3 }) = report(&mut share, &limiter, 50).await else {
        panic!("a 3 s token bucket: {:?}", share.assignment)
    };
    let pieces = share.pieces.len();
    let top_up = share.due();
    assert_eq!(top_up, end - MARGIN - 3_000 - SLOP, "sent again when a whole 3 s and SLOP are left");
    // then, the same settings (the Envoy keeps its bucket) for 3 s more from then
    clock.set(top_up);
    let tick = share.tick(&limiter, &target(&limiter), top_up).await.unwrap();
    assert_eq!(tick.assignment, Some(Assignment::TokenBucket { rate, depth, ttl: 3 }));
    assert_eq!(share.pieces.len(), pieces, "the piece in force is extended, not replaced");
    let last = *share.pieces.last().unwrap();
    assert_eq!(last.expires, end - MARGIN - SLOP, "it lapses {} ms before the window ends", MARGIN + SLOP);
    assert!(last.until <= end, "and never outlives the window");
    assert_eq!(share.due(), end, "nothing more is due before the window ends");
    assert!(share.committed() <= share.held && share.held <= LIMIT);

    // a report 1.5 s before the end could only send a piece lapsing 0.45 s earlier
    clock.set(end - 1_500);
    assert_eq!(report(&mut share, &limiter, 50).await, None, "a shorter piece is not sent");
    assert_eq!(*share.pieces.last().unwrap(), last, "the piece in force stands");
}

#[tokio::test]
async fn a_report_that_cannot_send_a_longer_piece_leaves_it_due_again() {
    let clock = ManualClock::new(sluice::store::conformance::t0());
    let limiter = limiter(&clock);
    let mut share = Share::default();
    report(&mut share, &limiter, 0).await;
    let end = share.window;
    clock.set(end - 3_700);
    report(&mut share, &limiter, 50).await;
    let in_force = share.pieces.last().unwrap().expires;
    assert_eq!(in_force, end - 700);
    // its tick to send it again did not come (late, or the store failed); a report 2.8 s
    // before the end could send 2 s, which lapse sooner than the piece in force
    clock.set(end - 2_800);
    assert_eq!(report(&mut share, &limiter, 50).await, None, "a shorter piece is not sent");
    assert_eq!(share.pieces.last().unwrap().expires, in_force, "the piece in force stands");
    let due = share.due();
    assert_eq!(due, end - MARGIN - 2_000 - SLOP, "and is due again when 2 s and SLOP are left");
    clock.set(due);
    let tick = share.tick(&limiter, &target(&limiter), due).await.unwrap();
    assert!(matches!(tick.assignment, Some(Assignment::TokenBucket { ttl: 2, .. })), "{tick:?}");
    assert_eq!(share.pieces.last().unwrap().expires, end - MARGIN - SLOP);
}
