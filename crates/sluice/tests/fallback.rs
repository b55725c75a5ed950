//! `failure: local`: four instances over one real Redis know each other by their
//! heartbeats; with the Redis stopped (SIGSTOP: every call waits out its deadline, then
//! the breaker opens), each admits at most its fair part of a limit in each window, so
//! the four together admit about the limit, where fail-open admits every request.
//! `SLUICE_OUTAGE_S` sets how long the outage lasts (8 s by default, five eighths of it on
//! the local limit; docs/benchmarks.md quotes a run of 30). When it answers again in the
//! middle of a window, that window still admits the limit once.

// These measure wall-clock time itself (real servers, real waits): the OS's clock is
// what they judge (crates/sluice/clippy.toml bans it in the library).
#![allow(clippy::disallowed_types)]

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

/// One test at a time: each stops a Redis under four instances, and times its windows.
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn rules() -> Arc<sluice::rules::Rules> {
    let policy = |name: &str, failure: &str, window: &str| {
        serde_json::json!({"name": name, "failure": failure,
            "fixed_window": {"limit": LIMIT, "window": window, "aligned": true}})
    };
    let config = serde_json::json!({"domains": [{"domain": "api", "descriptors": [
        {"key": "local", "policies": [policy("local", "local", "2s")]},
        {"key": "open", "policies": [policy("open", "open", "2s")]},
        {"key": "recover", "policies": [policy("recover", "local", "12s")]},
    ]}]});
    Arc::new(serde_json::from_value::<RulesConfig>(config).unwrap().compile().unwrap())
}

/// Admitted by window end, all instances together, for descriptor `key`, sending 400
/// requests a second (four times the limit's rate) spread over the instances; each
/// admitted one decided by the failure policy (the store is stopped).
async fn drive(instances: &[Limiter], key: &str, run: Duration) -> (BTreeMap<u64, u64>, u64) {
    let (windows, sent, sources) = drive_seeing(instances, key, run).await;
    assert!(!sources.contains_key("store"), "the store is stopped: {sources:?}");
    (windows, sent)
}

/// As [`drive`], with how many decisions (admitted or not) each source made (`local`,
/// `store`, `degraded` for fail-open...).
async fn drive_seeing(
    instances: &[Limiter],
    key: &str,
    run: Duration,
) -> (BTreeMap<u64, u64>, u64, BTreeMap<&'static str, u64>) {
    let mut sources = BTreeMap::new();
    let (started, mut windows, mut sent, mut turn) = (Instant::now(), BTreeMap::new(), 0u64, 0usize);
    let request = Request::new("api").descriptor([(key, "t1")]);
    while started.elapsed() < run {
        let due = (started.elapsed().as_millis() as u64 * 400 / 1_000).saturating_sub(sent);
        for _ in 0..due {
            turn += 1;
            let v = instances[turn % instances.len()].check(&request).await.unwrap();
            sent += 1;
            let p = &v.descriptors[0].policies[0];
            *sources.entry(source(p.source)).or_default() += 1;
            if v.allowed() {
                *windows.entry(p.decision.reset_at).or_default() += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (windows, sent, sources)
}

fn source(s: sluice::Source) -> &'static str {
    use sluice::Source;
    match s {
        Source::Store => "store",
        Source::Local => "local",
        Source::Degraded => "degraded",
        Source::NearCache(_) | Source::Skipped => "near_cache",
    }
}

/// Four instances over one real Redis, with a limit of 100 per window.
async fn four(redis: &RedisServer) -> Vec<Limiter> {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let instances: Vec<Limiter> = (0..4).map(|_| limiter(redis, clock.clone())).collect();
    instances.iter().for_each(Limiter::spawn_heartbeat);
    // each knows the four once every heartbeat has been seen (one every 5 s); while two
    // beat at once one may count a fifth (a fair part a little smaller), never fewer
    let started = Instant::now();
    while instances.iter().any(|l| !(4..=5).contains(&l.fallback().instances())) {
        let known: Vec<u64> = instances.iter().map(|l| l.fallback().instances()).collect();
        assert!(started.elapsed() < Duration::from_secs(15), "instances known: {known:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    instances
}

fn limiter(redis: &RedisServer, clock: Arc<dyn Clock>) -> Limiter {
    let store = RedisStore::new(&redis.url(), &[], RedisOptions::default()).unwrap();
    let store: Arc<dyn Store> = Arc::new(Resilient::new(store, Resilience::default()));
    Limiter::new(rules(), store, clock)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_failure_admits_the_fleet_about_the_limit_when_the_store_is_down() {
    let _alone = ALONE.lock().await;
    let redis = RedisServer::start();
    let instances = four(&redis).await;
    assert!(rules().use_local_failure());
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

/// The store comes back in the middle of a window (killed, and started again empty, as a
/// pod without persistence is): what the instances admitted in it while it was down is
/// charged to it, and each finishes the window on its own counts, so the window admits
/// the limit once (it admitted what was admitted locally plus the whole limit from the
/// store: 187 of 100). An instance that never counted the client finds the store's count
/// holding every local admission, exactly; the next window is the store's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_the_store_comes_back_in_admits_the_limit_once() {
    let _alone = ALONE.lock().await;
    let mut redis = RedisServer::start();
    let instances = four(&redis).await;
    // down early in a 12 s window, back 2 s later
    const WINDOW: u64 = 12_000;
    while !(200..600).contains(&(SystemClock.now() % WINDOW)) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    redis.kill();
    let (outage, _) = drive(&instances, "recover", Duration::from_millis(2_000)).await;
    redis.restart();
    let (after, _, sources) = drive_seeing(&instances, "recover", Duration::from_millis(2_000)).await;
    eprintln!("admitted while down: {outage:?}; after: {after:?}, decided by {sources:?}");
    let (end, local) = outage.iter().next().map(|(e, n)| (*e, *n)).unwrap();
    assert_eq!(outage.len(), 1, "one window: {outage:?}");
    assert!(local >= LIMIT * 3 / 4, "each admitted its fair part: {local}");
    assert_eq!(sources.keys().copied().collect::<Vec<_>>(), ["local"], "the window is finished locally: {sources:?}");
    let total = local + after.get(&end).unwrap_or(&0);
    assert!(total <= LIMIT, "{local} then {after:?} in the window ending at {end}");
    assert!(SystemClock.now() < end - 3_000, "the run took 9 s of the 12 s window: {after:?}");

    // an instance that never counted it: the store holds every local admission
    let fifth = limiter(&redis, Arc::new(SystemClock));
    let request = Request::new("api").descriptor([("recover", "t1")]);
    let charged = Instant::now();
    loop {
        let v = fifth.status(&request).await.unwrap();
        let p = &v.descriptors[0].policies[0];
        assert_eq!(source(p.source), "store", "{v:?}");
        if p.decision.used == total {
            break;
        }
        assert!(p.decision.used < total, "charged more than was admitted: {} of {total}", p.decision.used);
        assert!(charged.elapsed() < Duration::from_secs(3), "the store holds {} of {total}", p.decision.used);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!fifth.check(&request).await.unwrap().allowed(), "the window is spent");
}
