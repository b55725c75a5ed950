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
use sluice_testkit::{Proxy, RedisSentinels, RedisServer};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Units a window, and the window (aligned to the clock).
const LIMIT: u64 = 200;
const WINDOW_MS: u64 = 2_000;

fn rules(limit: u64) -> Arc<sluice::rules::Rules> {
    rules_of(limit, "2s")
}

fn rules_of(limit: u64, window: &str) -> Arc<sluice::rules::Rules> {
    // `failure: closed`: with its own store down, a region admits only what its
    // instances' grants hold (`open` would admit past the limit, marked degraded)
    let config = serde_json::json!({"domains": [{"domain": "api", "descriptors": [
        {"key": "tenant", "failure": "closed", "policies": [{"name": "tenant",
            "fixed_window": {"limit": limit, "window": window, "global": true}}]},
    ]}]});
    Arc::new(serde_json::from_value::<RulesConfig>(config).unwrap().compile().unwrap())
}

/// An instance of a region: its engine over the region's store, and its allocator.
fn instance(local: Arc<dyn Store>, global: Arc<dyn Store>, limit: u64) -> Limiter {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let regions = Regions::new(global, local.clone(), clock.clone());
    regions.spawn();
    Limiter::new(rules(limit), local, clock).with_regions(regions)
}

/// Three regions of two instances, over the stores `local(region)` and `global`.
fn regions(
    local: impl Fn(usize) -> Arc<dyn Store>,
    global: impl Fn(usize) -> Arc<dyn Store>,
    limit: u64,
) -> Vec<Vec<Limiter>> {
    (0..3)
        .map(|r| {
            let (local, global) = (local(r), global(r));
            (0..2).map(|_| instance(local.clone(), global.clone(), limit)).collect()
        })
        .collect()
}

/// What a run saw: admissions by the window each decision names (its reset), by
/// region; requests by window; decisions made.
#[derive(Default)]
struct Checker {
    windows: BTreeMap<u64, [u64; 3]>,
    asked: BTreeMap<u64, u64>,
    decisions: u64,
}

/// Sends `rate(region, elapsed_ms)` requests a second from each region's instances for
/// `ms` (or until `most` decisions), each for tenant `t1` at cost 1, and counts them.
async fn drive(instances: &[Vec<Limiter>], (ms, most): (u64, u64), rate: impl Fn(usize, u64) -> u64) -> Checker {
    let mut c = Checker::default();
    let started = SystemClock.now();
    let (mut carry, mut turn, mut last) = ([0f64; 3], 0usize, started);
    let request = Request::new("api").descriptor([("tenant", "t1")]);
    while SystemClock.now() < started + ms && c.decisions < most {
        let now = SystemClock.now();
        let (elapsed, step) = (now - started, now - last);
        last = now;
        for (r, region) in instances.iter().enumerate() {
            carry[r] += rate(r, elapsed) as f64 * step as f64 / 1_000.0;
            while carry[r] >= 1.0 {
                carry[r] -= 1.0;
                turn += 1;
                let v = region[turn % region.len()].check(&request).await.unwrap();
                let end = v.descriptors[0].policies[0].decision.reset_at;
                *c.asked.entry((now / WINDOW_MS + 1) * WINDOW_MS).or_default() += 1;
                c.decisions += 1;
                if v.allowed() {
                    c.windows.entry(end).or_default()[r] += 1;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    c
}

/// The windows wholly inside the run (not the first, cut by its start, nor the last).
fn whole(c: &Checker) -> Vec<(u64, u64)> {
    let all: Vec<(u64, u64)> = c.windows.iter().map(|(e, r)| (*e, r.iter().sum())).collect();
    all[1..all.len().saturating_sub(1)].to_vec()
}

fn assert_never_over(c: &Checker, limit: u64) {
    // the figures, for a failure's output and `--nocapture`
    eprintln!("admitted by window end, by region: {:?} ({} decisions)", c.windows, c.decisions);
    for (end, by_region) in &c.windows {
        let total: u64 = by_region.iter().sum();
        assert!(total <= limit, "window ending at {end}: {by_region:?} admitted, {total} over {limit}");
    }
}

/// Twice the rate of a limit of `limit` a window, 80% in region `hot`.
fn twice(region: usize, hot: usize, limit: u64) -> u64 {
    let per_s = 2 * limit * 1_000 / WINDOW_MS;
    if region == hot { per_s * 8 / 10 } else { per_s / 10 }
}

fn memory() -> Arc<dyn Store> {
    Arc::new(MemoryStore::new(100_000))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_share_one_limit_over_memory_stores() {
    let global = memory();
    let instances = regions(|_| memory(), |_| global.clone(), LIMIT);
    // demand moves from region 0 to region 1 half way
    let moving = |r, t| twice(r, usize::from(t >= 5 * WINDOW_MS / 2), LIMIT);
    let c = drive(&instances, (5 * WINDOW_MS, u64::MAX), moving).await;
    assert_never_over(&c, LIMIT);
    for (end, total) in whole(&c) {
        assert!(total * 100 >= LIMIT * 90, "window ending at {end}: {total} of {LIMIT} used: {:?}", c.windows);
    }
}

/// A million decisions (or a minute's worth, on a slow machine) on a limit of 100,000 a
/// window: never over in any window, and at least 90% used in every whole window asked
/// for at least twice the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_decisions_never_pass_the_limit() {
    const BIG: u64 = 100_000;
    let global = memory();
    let instances = regions(|_| memory(), |_| global.clone(), BIG);
    let moving = |r, t: u64| twice(r, ((t / 3_000) % 3) as usize, BIG);
    let c = drive(&instances, (60_000, 1_000_000), moving).await;
    assert_never_over(&c, BIG);
    assert!(c.decisions >= 300_000, "only {} decisions in a minute", c.decisions);
    for (end, total) in whole(&c) {
        if c.asked.get(&end).is_some_and(|a| *a >= 2 * BIG) {
            assert!(total * 100 >= BIG * 90, "window ending at {end}: {total} of {BIG} used: {:?}", c.windows);
        }
    }
}

/// A million decisions (or 90 s' worth, on a slow machine) over real Redis servers, the
/// global one 80 ms away: never over in any window, and at least 90% used in every whole
/// window asked for at least twice the limit. Demand moves every 3 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_decisions_over_redis_never_pass_the_limit() {
    const BIG: u64 = 100_000;
    let global = RedisServer::start();
    let regional: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let links: Vec<Proxy> = (0..3).map(|_| Proxy::start(global.addr(), Duration::from_millis(40))).collect();
    let instances = regions(|r| redis(&regional[r].addr().to_string()), |r| redis(&links[r].addr().to_string()), BIG);
    let moving = |r, t: u64| twice(r, ((t / 3_000) % 3) as usize, BIG);
    let c = drive(&instances, (90_000, 1_000_000), moving).await;
    assert_never_over(&c, BIG);
    assert!(c.decisions >= 200_000, "only {} decisions in 90 s", c.decisions);
    for (end, total) in whole(&c) {
        if c.asked.get(&end).is_some_and(|a| *a >= 2 * BIG) {
            assert!(total * 100 >= BIG * 90, "window ending at {end}: {total} of {BIG} used: {:?}", c.windows);
        }
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
    let instances = regions(|r| redis(&regional[r].addr().to_string()), |r| redis(&links[r].addr().to_string()), LIMIT);
    let hot = |r, _| twice(r, 0, LIMIT);
    let c = drive(&instances, (4 * WINDOW_MS, u64::MAX), hot).await;
    assert_never_over(&c, LIMIT);
    for (end, total) in whole(&c) {
        assert!(total * 100 >= LIMIT * 90, "window ending at {end}: {total} of {LIMIT} used: {:?}", c.windows);
    }
    // region 0, with most of the demand, cut off: it spends what it holds, then refuses;
    // the others go on; healed, the fleet uses the limit again
    links[0].cut();
    let cut = drive(&instances, (2 * WINDOW_MS, u64::MAX), hot).await;
    assert_never_over(&cut, LIMIT);
    links[0].heal();
    let healed = drive(&instances, (4 * WINDOW_MS, u64::MAX), hot).await;
    assert_never_over(&healed, LIMIT);
    let last = whole(&healed);
    assert!(last.iter().any(|(_, total)| total * 100 >= LIMIT * 90), "healed: {:?}", healed.windows);
}

/// A store on the primary the Sentinels of `set` name, each grant waiting for a replica.
fn sentinel(set: &RedisSentinels) -> Arc<dyn Store> {
    let sentinel = sluice::store::redis::SentinelOptions {
        sentinels: set.addrs(),
        master_name: RedisSentinels::MASTER.into(),
        ..Default::default()
    };
    let store = RedisStore::sentinel(&sentinel, RedisOptions::default()).unwrap();
    let resilience = Resilience { deadline: Duration::from_secs(1), ..Resilience::default() };
    Arc::new(Resilient::new(store, resilience))
}

/// Kills the primary of `set` and waits until the Sentinels agree on another, then
/// starts the old one again (it comes back as a replica, as a restarted pod does); the
/// time the promotion took.
fn fail_over(set: &mut RedisSentinels) -> Duration {
    let (old, killed) = (set.primary.port(), std::time::Instant::now());
    set.primary.kill();
    while set.agreed_primary_port().is_none_or(|p| p == old) {
        assert!(killed.elapsed() < Duration::from_secs(30), "no promotion 30 s after the primary died");
        std::thread::sleep(Duration::from_millis(50));
    }
    let promoted = killed.elapsed();
    set.primary.restart();
    promoted
}

/// Region 0's own primary killed under load, then the global store's: each promoted by
/// its Sentinels. A grant (from the global store to a region, from a region's pool to an
/// instance) waits for a replica before it is spent, so the promoted replica never
/// grants the same units again: never over the limit in any window, and once both are
/// promoted the fleet uses the limit again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_regional_and_the_global_primary_fail_over_under_load() {
    let (mut global, mut region0) = (RedisSentinels::start(2, 3, 1_000), RedisSentinels::start(2, 3, 1_000));
    let others: Vec<RedisServer> = (0..2).map(|_| RedisServer::start()).collect();
    let local = |r: usize| if r == 0 { sentinel(&region0) } else { redis(&others[r - 1].addr().to_string()) };
    let instances = regions(local, |_| sentinel(&global), LIMIT);
    let hot = |r, _| twice(r, 0, LIMIT);
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(3 * WINDOW_MS));
        let regional = fail_over(&mut region0);
        std::thread::sleep(Duration::from_millis(2 * WINDOW_MS));
        let far = fail_over(&mut global);
        eprintln!("region 0's primary promoted after {regional:?}, the global one after {far:?}");
        (region0, global)
    });
    let c = drive(&instances, (12 * WINDOW_MS, u64::MAX), hot).await;
    assert_never_over(&c, LIMIT);
    let _kept = killer.join().unwrap();
    let after = drive(&instances, (4 * WINDOW_MS, u64::MAX), hot).await;
    assert_never_over(&after, LIMIT);
    let used = whole(&after);
    assert!(used.iter().any(|(_, total)| total * 100 >= LIMIT * 90), "after both failovers: {:?}", after.windows);
}

/// A window shorter than 25 round trips to the global store as measured (1 s at 80 ms)
/// is warned about, once; one of 8 s is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_too_short_for_the_round_trip_are_found() {
    let (global, local) = (RedisServer::start(), RedisServer::start());
    let link = Proxy::start(global.addr(), Duration::from_millis(40));
    for (window, short) in [("1s", vec![1_000]), ("8s", vec![])] {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let store = redis(&local.addr().to_string());
        let regions = Regions::new(redis(&link.addr().to_string()), store.clone(), clock.clone());
        regions.spawn();
        let limiter = Limiter::new(rules_of(1_000, window), store, clock).with_regions(regions.clone());
        let request = Request::new("api").descriptor([("tenant", "t1")]);
        let started = std::time::Instant::now();
        while regions.stats().global_calls.load(std::sync::atomic::Ordering::Relaxed) < 12 {
            assert!(started.elapsed() < Duration::from_secs(20), "the allocator made no global calls");
            limiter.check(&request).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(regions.short_windows(), short, "a window of {window} at an 80 ms round trip");
    }
}
