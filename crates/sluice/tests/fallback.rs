//! `failure: local`: four instances over one real Redis know each other by their
//! heartbeats; with the Redis stopped (SIGSTOP: every call waits out its deadline, then
//! the breaker opens), each admits at most its fair part of a limit in each window, so
//! the four together admit about the limit, where fail-open admits every request.
//! `SLUICE_OUTAGE_S` sets how long the outage lasts (8 s by default, five eighths of it on
//! the local limit; docs/benchmarks.md quotes a run of 30).

use sluice::config::{Failure, RulesConfig};
use sluice::store::redis::{RedisOptions, RedisStore};
use sluice::store::{Resilience, Resilient, Store};
use sluice::time::{Clock, SystemClock};
use sluice::{Limiter, Request};
use sluice_testkit::RedisServer;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

const LIMIT: u64 = 100;

fn rules() -> Arc<sluice::rules::Rules> {
    let policy = |name: &str, failure: &str| {
        serde_json::json!({"name": name, "failure": failure,
            "fixed_window": {"limit": LIMIT, "window": "2s", "aligned": true}})
    };
    let config = serde_json::json!({"domains": [{"domain": "api", "descriptors": [
        {"key": "local", "policies": [policy("local", "local")]},
        {"key": "open", "policies": [policy("open", "open")]},
    ]}]});
    Arc::new(serde_json::from_value::<RulesConfig>(config).unwrap().compile().unwrap())
}

/// Admitted by window end, all instances together, for descriptor `key`, sending 400
/// requests a second (four times the limit's rate) spread over the instances.
async fn drive(instances: &[Limiter], key: &str, run: Duration) -> (BTreeMap<u64, u64>, u64) {
    let (started, mut windows, mut sent, mut turn) = (Instant::now(), BTreeMap::new(), 0u64, 0usize);
    let request = Request::new("api").descriptor([(key, "t1")]);
    while started.elapsed() < run {
        let due = (started.elapsed().as_millis() as u64 * 400 / 1_000).saturating_sub(sent);
        for _ in 0..due {
            turn += 1;
            let v = instances[turn % instances.len()].check(&request).await.unwrap();
            sent += 1;
            if v.allowed() {
                assert!(v.degraded.is_some(), "the store is stopped: decided by the failure policy");
                *windows.entry(v.descriptors[0].policies[0].decision.reset_at).or_default() += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (windows, sent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_failure_admits_the_fleet_about_the_limit_when_the_store_is_down() {
    let redis = RedisServer::start();
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let instances: Vec<Limiter> = (0..4)
        .map(|_| {
            let store = RedisStore::new(&redis.url(), &[], RedisOptions::default()).unwrap();
            let store: Arc<dyn Store> = Arc::new(Resilient::new(store, Resilience::default()));
            let limiter = Limiter::new(rules(), store, clock.clone());
            limiter.spawn_heartbeat();
            limiter
        })
        .collect();
    assert!(rules().use_local_failure());
    // each knows the four once every heartbeat has been seen (one every 5 s); while two
    // beat at once one may count a fifth (a fair part a little smaller), never fewer
    let started = Instant::now();
    while instances.iter().any(|l| !(4..=5).contains(&l.fallback().instances())) {
        let known: Vec<u64> = instances.iter().map(|l| l.fallback().instances()).collect();
        assert!(started.elapsed() < Duration::from_secs(15), "instances known: {known:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    redis.signal("-STOP");
    let outage: u64 = std::env::var("SLUICE_OUTAGE_S").ok().and_then(|s| s.parse().ok()).unwrap_or(8);
    let (local, sent) = drive(&instances, "local", Duration::from_millis(outage * 1_000 * 5 / 8)).await;
    let (open, _) = drive(&instances, "open", Duration::from_millis(outage * 1_000 * 3 / 8)).await;
    redis.signal("-CONT");
    eprintln!("local: {local:?} of {sent} sent; open: {open:?}");
    for (end, admitted) in &local {
        assert!(*admitted <= LIMIT, "window ending at {end}: {admitted} admitted, past {LIMIT}");
    }
    let whole: Vec<u64> = local.values().copied().collect();
    let inner = &whole[1..whole.len().saturating_sub(1)];
    assert!(!inner.is_empty() && inner.iter().all(|a| *a >= LIMIT * 9 / 10), "each its fair part: {local:?}");
    let open_most = open.values().copied().max().unwrap_or(0);
    assert!(open_most > 2 * LIMIT, "fail-open admits without bound: {open:?}");
    assert_eq!(Failure::Local.header_value(), "local");
}
