//! One limit across regions, through the engine in real time: three regions, each with
//! its own store and instances (`Limiter`s with an allocator each, ticking), and one
//! global store; decisions never touch the global store. A checker counts every
//! admission by window: never over the limit, and most of it used when demand is twice
//! it, also as demand moves from region to region. Once over memory stores; once over
//! real Redis servers, the global one behind a proxy that delays every byte 40 ms each
//! way (an 80 ms cross-region round trip) and cuts one region off for a while.

use sluice::config::RulesConfig;
use sluice::regions::Regions;
use sluice::store::redis::{RedisOptions, RedisStore};
use sluice::store::{MemoryStore, Resilience, Resilient, Store};
use sluice::time::{Clock, SystemClock};
use sluice::{Limiter, Request};
use sluice_testkit::{Proxy, RedisServer};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Units a window, and the window (aligned to the clock).
const LIMIT: u64 = 200;
const WINDOW_MS: u64 = 2_000;

fn rules() -> Arc<sluice::rules::Rules> {
    let config = serde_json::json!({"domains": [{"domain": "api", "descriptors": [
        {"key": "tenant", "policies": [{"name": "tenant",
            "fixed_window": {"limit": LIMIT, "window": "2s", "global": true}}]},
    ]}]});
    Arc::new(serde_json::from_value::<RulesConfig>(config).unwrap().compile().unwrap())
}

/// An instance of a region: its engine over the region's store, and its allocator.
fn instance(local: Arc<dyn Store>, global: Arc<dyn Store>) -> (Limiter, Arc<Regions>) {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let regions = Regions::new(global, local.clone(), clock.clone());
    regions.spawn();
    (Limiter::new(rules(), local, clock).with_regions(regions.clone()), regions)
}

/// Admissions by window end, and by region.
#[derive(Default)]
struct Checker {
    windows: BTreeMap<u64, [u64; 3]>,
}

/// Sends `rate(region, elapsed_ms)` requests a second from each region's instances for
/// `ms`, each for tenant `t1` at cost 1, and counts what is admitted by window.
async fn drive(instances: &[Vec<Limiter>], ms: u64, rate: impl Fn(usize, u64) -> u64) -> Checker {
    let checker = Arc::new(Mutex::new(Checker::default()));
    let started = SystemClock.now();
    let step = 10;
    let mut carry = [0f64; 3];
    let mut turn = 0usize;
    while SystemClock.now() < started + ms {
        let elapsed = SystemClock.now() - started;
        for (r, region) in instances.iter().enumerate() {
            carry[r] += rate(r, elapsed) as f64 * step as f64 / 1_000.0;
            while carry[r] >= 1.0 {
                carry[r] -= 1.0;
                turn += 1;
                let limiter = &region[turn % region.len()];
                let v = limiter.check(&Request::new("api").descriptor([("tenant", "t1")])).await.unwrap();
                if v.allowed() {
                    let now = SystemClock.now();
                    let end = (now / WINDOW_MS + 1) * WINDOW_MS;
                    checker.lock().unwrap().windows.entry(end).or_default()[r] += 1;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(step)).await;
    }
    Arc::try_unwrap(checker).ok().unwrap().into_inner().unwrap()
}

/// The windows wholly inside the run (not the first, cut by its start, nor the last).
fn whole(c: &Checker) -> Vec<(u64, u64)> {
    let all: Vec<(u64, u64)> = c.windows.iter().map(|(e, r)| (*e, r.iter().sum())).collect();
    all[1..all.len().saturating_sub(1)].to_vec()
}

fn assert_never_over(c: &Checker) {
    // the figures, for a failure's output and `--nocapture`
    eprintln!("admitted by window end, by region: {:?}", c.windows);
    for (end, by_region) in &c.windows {
        let total: u64 = by_region.iter().sum();
        assert!(total <= LIMIT, "window ending at {end}: {by_region:?} admitted, {total} over {LIMIT}");
    }
}

/// Twice the limit's rate, 80% in region `hot`.
fn twice(region: usize, hot: usize) -> u64 {
    let per_s = 2 * LIMIT * 1_000 / WINDOW_MS;
    if region == hot { per_s * 8 / 10 } else { per_s / 10 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_share_one_limit_over_memory_stores() {
    let global: Arc<dyn Store> = Arc::new(MemoryStore::new(100_000));
    let instances: Vec<Vec<Limiter>> = (0..3)
        .map(|_| {
            let local: Arc<dyn Store> = Arc::new(MemoryStore::new(100_000));
            (0..2).map(|_| instance(local.clone(), global.clone()).0).collect()
        })
        .collect();
    // demand moves from region 0 to region 1 half way
    let c = drive(&instances, 5 * WINDOW_MS, |r, t| twice(r, usize::from(t >= 5 * WINDOW_MS / 2))).await;
    assert_never_over(&c);
    for (end, total) in whole(&c) {
        assert!(total * 100 >= LIMIT * 90, "window ending at {end}: {total} of {LIMIT} used: {:?}", c.windows);
    }
}

/// A Redis store at `addr`.
fn redis(addr: &str) -> Arc<dyn Store> {
    let store = RedisStore::new(&format!("redis://{addr}"), &[], RedisOptions::default()).unwrap();
    let resilience = Resilience { deadline: Duration::from_secs(1), ..Resilience::default() };
    Arc::new(Resilient::new(store, resilience))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_share_one_limit_over_redis_across_a_slow_link() {
    let global = RedisServer::start();
    let regional: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    // each region reaches the global store through a link of its own: 40 ms each way
    let links: Vec<Proxy> = (0..3).map(|_| Proxy::start(global.addr(), Duration::from_millis(40))).collect();
    let mut instances = Vec::new();
    for (r, server) in regional.iter().enumerate() {
        let local = redis(&server.addr().to_string());
        let global = redis(&links[r].addr().to_string());
        instances.push((0..2).map(|_| instance(local.clone(), global.clone()).0).collect::<Vec<_>>());
    }
    let c = drive(&instances, 4 * WINDOW_MS, |r, _| twice(r, 0)).await;
    assert_never_over(&c);
    for (end, total) in whole(&c) {
        assert!(total * 100 >= LIMIT * 90, "window ending at {end}: {total} of {LIMIT} used: {:?}", c.windows);
    }
    // region 0, with most of the demand, cut off: it spends what it holds, then refuses;
    // the others go on; healed, the fleet uses the limit again
    links[0].cut();
    let cut = drive(&instances, 2 * WINDOW_MS, |r, _| twice(r, 0)).await;
    assert_never_over(&cut);
    links[0].heal();
    let healed = drive(&instances, 4 * WINDOW_MS, |r, _| twice(r, 0)).await;
    assert_never_over(&healed);
    let last = whole(&healed);
    assert!(last.iter().any(|(_, total)| total * 100 >= LIMIT * 90), "healed: {:?}", healed.windows);
}
