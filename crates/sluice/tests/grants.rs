//! Quota grants never admit past the limit: several instances (each a `Limiter` with
//! grants of its own) over one store, random demand, instances that crash with grants
//! in hand (their give-backs never sent), windows that end with units held, under one
//! injected clock. In every window, what all instances admitted together is at most the
//! limit; requests are all or nothing with a limit that takes no grants.

// These measure wall-clock time itself (real servers, real waits): the OS's clock is
// what they judge (crates/sluice/clippy.toml bans it in the library).
#![allow(clippy::disallowed_types)]

use sluice::config::RulesConfig;
use sluice::store::conformance::Rng;
use sluice::store::redis::{RedisOptions, RedisStore};
use sluice::store::{MemoryStore, Store};
use sluice::time::ManualClock;
use sluice::{Limiter, Request};
use std::collections::HashMap;
use std::sync::Arc;

const ROUTE_LIMIT: u64 = 20;
const USER_LIMIT: u64 = 6;
const WINDOW: u64 = 1_000;

/// The route's limit: a fixed window of ROUTE_LIMIT a second, or a token bucket.
fn rules(route: serde_json::Value) -> sluice::rules::Rules {
    let config = serde_json::json!({"domains": [{"domain": "api", "descriptors": [
        {"key": "route", "grants": "auto", "policies": [route]},
        {"key": "user", "rate_limit": {"name": "user", "unit": "second", "requests_per_unit": USER_LIMIT}},
    ]}]});
    serde_json::from_value::<RulesConfig>(config).unwrap().compile().unwrap()
}

fn window() -> serde_json::Value {
    serde_json::json!({"name": "route", "fixed_window": {"limit": ROUTE_LIMIT, "window": "1s"}})
}

/// Demand on a window: three users (past their limits too), about 30 units a window.
const WINDOWED: (u64, u64) = (3, WINDOW / 2);
/// Demand on a bucket: thirty users, about 75 units a second.
const BUCKETED: (u64, u64) = (30, WINDOW / 5);

/// 40 a second, burst 20: it refills within a grant's life.
const BUCKET: (u64, u64, u64) = (40, 1_000, 20);

fn bucket() -> serde_json::Value {
    let (rate, _, burst) = BUCKET;
    serde_json::json!({"name": "route", "token_bucket": {"rate": rate, "per": "1s", "burst": burst}})
}

/// What the run saw: admitted per route window (and when, with their costs) and per
/// user window, and decisions.
#[derive(Default)]
struct Seen {
    route: HashMap<u64, u64>,
    admitted: Vec<(u64, u64)>,
    user: HashMap<(u64, u64), u64>,
    decisions: u64,
    crashes: u64,
}

/// Drives four limiters over `store` through `windows` windows of random demand from
/// `users` users: bursts of requests, the clock moved on by up to `step` ms after each.
async fn drive(
    store: Arc<dyn Store>,
    route: serde_json::Value,
    (users, step): (u64, u64),
    windows: u64,
    seed: u64,
) -> Seen {
    let instances = 4;
    let clock = ManualClock::new(sluice::store::conformance::t0());
    let rules = Arc::new(rules(route));
    let make = || Limiter::new(rules.clone(), store.clone(), Arc::new(clock.clone()));
    let mut fleet: Vec<Limiter> = (0..instances).map(|_| make()).collect();
    let mut rng = Rng(seed | 1);
    let mut seen = Seen::default();
    let end = clock.now_ms() + windows * WINDOW;
    while clock.now_ms() < end {
        // a burst of requests, then time moves on by up to a fifth of a window
        for _ in 0..rng.next(12) {
            let i = rng.next(instances as u64) as usize;
            let user = rng.next(users);
            let cost = 1 + rng.next(3) / 2;
            let req = Request::new("api")
                .descriptor([("route", "r")])
                .descriptor([("user", format!("u{user}").as_str())])
                .cost(cost);
            let v = fleet[i].check(&req).await.expect("a decision");
            seen.decisions += 1;
            if v.allowed() {
                let route = v.descriptors[0].policies[0].decision;
                let u = v.descriptors[1].policies[0].decision;
                *seen.route.entry(route.reset_at).or_default() += cost;
                seen.admitted.push((clock.now_ms(), cost));
                *seen.user.entry((user, u.reset_at)).or_default() += cost;
            }
            if rng.next(500) == 0 {
                // a crash: the grants it holds are never given back
                fleet[i] = make();
                seen.crashes += 1;
            }
            tokio::task::yield_now().await;
        }
        clock.advance(rng.next(step));
    }
    seen
}

trait Now {
    fn now_ms(&self) -> u64;
}

impl Now for ManualClock {
    fn now_ms(&self) -> u64 {
        sluice::time::Clock::now(self)
    }
}

fn check(seen: &Seen, windows: u64) {
    let over: Vec<_> = seen.route.iter().filter(|(_, n)| **n > ROUTE_LIMIT).take(10).collect();
    assert!(over.is_empty(), "windows admitted past the granted limit of {ROUTE_LIMIT} (first 10): {over:?}");
    let over: Vec<_> = seen.user.iter().filter(|(_, n)| **n > USER_LIMIT).take(10).collect();
    assert!(over.is_empty(), "windows admitted past the user limit of {USER_LIMIT} (first 10): {over:?}");
    assert!(seen.route.len() as u64 >= windows / 2, "only {} windows seen", seen.route.len());
    let full = seen.route.values().filter(|&&n| n >= ROUTE_LIMIT - 2).count();
    assert!(full > 0, "no window came near its limit: the demand is too low to test anything");
    assert!(seen.crashes > 0, "no instance crashed");
}

#[test]
fn no_window_admits_past_its_limit_on_the_memory_store() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let windows = 130_000;
    let seen = rt.block_on(drive(Arc::new(MemoryStore::new(100_000)), window(), WINDOWED, windows, 0x5eed));
    check(&seen, windows);
    assert!(seen.route.len() >= 100_000, "only {} windows saw an admission", seen.route.len());
    println!("{} decisions, {} windows, {} crashes", seen.decisions, seen.route.len(), seen.crashes);
}

#[test]
fn no_window_admits_past_its_limit_on_redis() {
    let redis = sluice_testkit::RedisServer::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let windows = 1_500;
    let seen = rt.block_on(async {
        let store: Arc<dyn Store> = Arc::new(RedisStore::new(&redis.url(), &[], RedisOptions::default()).unwrap());
        drive(store, window(), WINDOWED, windows, 0xbeef).await
    });
    check(&seen, windows);
}

/// What instances spending grants of one token bucket admitted is a schedule the bucket
/// alone admits in full: replayed through it, every request fits.
fn check_bucket(seen: &Seen) {
    let (rate, per, burst) = BUCKET;
    let t0 = seen.admitted.first().map_or(0, |a| a.0);
    // the bucket in units of 1/per token: it gains `rate` a millisecond, up to burst * per
    let (mut tokens, mut last) = (burst * per, t0);
    for (i, &(at, cost)) in seen.admitted.iter().enumerate() {
        tokens = (tokens + (at - last) * rate).min(burst * per);
        last = at;
        assert!(tokens >= cost * per, "admission {i} (cost {cost} at {} ms) is more than the bucket admits", at - t0);
        tokens -= cost * per;
    }
    let over: Vec<_> = seen.user.iter().filter(|(_, n)| **n > USER_LIMIT).take(10).collect();
    assert!(over.is_empty(), "windows admitted past the user limit of {USER_LIMIT} (first 10): {over:?}");
    let admitted: u64 = seen.admitted.iter().map(|a| a.1).sum();
    let most = burst + (last - t0) * rate / per;
    assert!(
        admitted * 10 >= most * 9,
        "{admitted} admitted of the {most} the bucket allows: too little demand to test it"
    );
    assert!(seen.crashes > 0, "no instance crashed");
}

#[test]
fn no_bucket_admits_past_its_rate_and_burst_on_the_memory_store() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let seen = rt.block_on(drive(Arc::new(MemoryStore::new(100_000)), bucket(), BUCKETED, 20_000, 0xb0b));
    check_bucket(&seen);
    println!("{} decisions, {} admitted, {} crashes", seen.decisions, seen.admitted.len(), seen.crashes);
}

#[test]
fn no_bucket_admits_past_its_rate_and_burst_on_redis() {
    let redis = sluice_testkit::RedisServer::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let seen = rt.block_on(async {
        let store: Arc<dyn Store> = Arc::new(RedisStore::new(&redis.url(), &[], RedisOptions::default()).unwrap());
        drive(store, bucket(), BUCKETED, 1_000, 0xcafe).await
    });
    check_bucket(&seen);
}

fn one_route(grants: &str, algorithm: serde_json::Value) -> Result<sluice::rules::Rules, String> {
    let grants: serde_json::Value = serde_json::from_str(grants).unwrap();
    let config = serde_json::json!({"domains": [{"domain": "api", "descriptors": [
        {"key": "route", "grants": grants, "policies": [algorithm]},
    ]}]});
    let config = serde_json::from_value::<RulesConfig>(config).map_err(|e| e.to_string())?;
    config.compile().map_err(|e| e.to_string())
}

fn route() -> Request {
    Request::new("api").descriptor([("route", "r")])
}

/// Two instances over one memory store under one manual clock, with `route` limited
/// to `limit` a minute under `grants`.
fn two_instances(grants: &str, limit: u64) -> (Limiter, Limiter, Arc<ManualClock>) {
    let window = serde_json::json!({"name": "w", "fixed_window": {"limit": limit, "window": "1m"}});
    let rules = Arc::new(one_route(grants, window).unwrap());
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(1_000));
    let clock = Arc::new(ManualClock::new(sluice::store::conformance::t0()));
    let a = Limiter::new(rules.clone(), store.clone(), clock.clone());
    (a, Limiter::new(rules, store, clock.clone()), clock)
}

/// On one instance the remaining reported never rises within a window; two instances
/// together admit exactly the limit when both keep asking.
#[tokio::test]
async fn remaining_never_rises_and_the_fleet_admits_exactly_the_limit() {
    let (a, b, _) = two_instances(r#""auto""#, 20);
    let (mut admitted, mut last) = (0, [u64::MAX; 2]);
    for i in 0..60 {
        let (who, limiter) = if i % 2 == 0 { (0, &a) } else { (1, &b) };
        let v = limiter.check(&route()).await.unwrap();
        let d = v.binding().unwrap().decision;
        assert!(d.remaining <= last[who], "remaining rose on one instance: {} after {}", d.remaining, last[who]);
        last[who] = d.remaining;
        admitted += u64::from(v.allowed());
        tokio::task::yield_now().await;
    }
    assert_eq!(admitted, 20, "two instances that keep asking spend every unit of the window");
    assert!(a.grants().stats().local.load(std::sync::atomic::Ordering::Relaxed) > 0, "no decision was local");
}

/// Two instances as [`two_instances`], the first watching the overrides and having
/// admitted ten requests from grants it holds.
async fn ten_admitted_on_a(grants: &str, limit: u64) -> (Limiter, Limiter, Arc<ManualClock>) {
    let (a, b, clock) = two_instances(grants, limit);
    a.overrides().watch(std::time::Duration::from_millis(50));
    for _ in 0..10 {
        assert!(a.check(&route()).await.unwrap().allowed());
    }
    (a, b, clock)
}

/// A reset anywhere revokes the grants every instance holds for the client within the
/// overrides' watch (250 ms) and a sweep: the next decision starts the fresh window.
#[tokio::test]
async fn a_reset_elsewhere_revokes_the_grants_held() {
    let (a, b, clock) = ten_admitted_on_a(r#"{"max": 50}"#, 100).await;
    let before = a.check(&route()).await.unwrap().binding().unwrap().decision;
    assert_eq!(before.used, 11);
    b.reset(&route(), None).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    clock.advance(300);
    let after = a.check(&route()).await.unwrap().binding().unwrap().decision;
    assert_eq!(after.used, 1, "still spending grants of the window before the reset: {after:?}");
    assert!(after.reset_at > before.reset_at, "not the fresh window: {after:?}");
}

/// What grants cannot keep exact is refused when the rules load, saying why.
#[test]
fn grants_on_limits_they_cannot_keep_exact_are_refused() {
    let cases = [
        (
            r#""auto""#,
            serde_json::json!({"name": "s", "sliding_window": {"limit": 5, "window": "1m"}}),
            "sliding_window",
        ),
        (r#""auto""#, serde_json::json!({"name": "c", "concurrency": {"limit": 5, "lease_ttl": "1m"}}), "concurrency"),
        (r#""sometimes""#, serde_json::json!({"name": "w", "fixed_window": {"limit": 5, "window": "1m"}}), "auto"),
        (r#"{"max": 0}"#, serde_json::json!({"name": "w", "fixed_window": {"limit": 5, "window": "1m"}}), "above 0"),
    ];
    for (grants, policy, says) in cases {
        let Err(e) = one_route(grants, policy) else { panic!("grants {grants} loaded; must be refused") };
        assert!(e.contains("grants") && e.contains(says), "{e}");
    }
}

/// Admitted per window when demand is past the limit, with demand spread over four
/// instances by `shares` (per 100 requests, instance i gets shares[i]).
async fn utilisation(shares: [u64; 4], windows: u64) -> Vec<u64> {
    const LIMIT: u64 = 1_000;
    let window = serde_json::json!({"name": "w", "fixed_window": {"limit": LIMIT, "window": "1s"}});
    let rules = Arc::new(one_route(r#""auto""#, window).unwrap());
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(1_000));
    let clock = Arc::new(ManualClock::new(sluice::store::conformance::t0()));
    let fleet: Vec<Limiter> = (0..4).map(|_| Limiter::new(rules.clone(), store.clone(), clock.clone())).collect();
    let mut admitted: HashMap<u64, u64> = HashMap::new();
    // twice the limit a window, a request every 0.5 ms, in the order the shares give
    let order: Vec<usize> = (0..4).flat_map(|i| std::iter::repeat_n(i, shares[i] as usize)).collect();
    for n in 0..windows * 2 * LIMIT {
        let v = fleet[order[n as usize % order.len()]].check(&route()).await.unwrap();
        if v.allowed() {
            *admitted.entry(v.binding().unwrap().decision.reset_at).or_default() += 1;
        }
        tokio::task::yield_now().await;
        if n % 2 == 1 {
            clock.advance(1);
        }
    }
    let mut per_window: Vec<(u64, u64)> = admitted.into_iter().collect();
    per_window.sort();
    // the first and last windows are partly outside the run
    per_window[1..per_window.len() - 1].iter().map(|w| w.1).collect()
}

/// Grants leave little of a window unused when demand is past it: at least 97% admitted
/// with demand spread evenly over four instances, at least 90% with 80% of it on one.
#[tokio::test]
async fn windows_are_used_nearly_in_full_when_demand_exceeds_them() {
    for (shares, least) in [([25, 25, 25, 25], 970), ([80, 7, 7, 6], 900)] {
        let windows = utilisation(shares, 12).await;
        assert!(windows.len() >= 10, "{windows:?}");
        assert!(windows.iter().all(|&n| n <= 1_000), "past the limit: {windows:?}");
        assert!(windows.iter().all(|&n| n >= least), "shares {shares:?}: a window used less than {least}: {windows:?}");
        println!("shares {shares:?}: admitted per window {windows:?}");
    }
}

/// An override lowering the limit, set on another instance, reaches the grants this one
/// holds within a second: its next decisions are under the new limit, and the units it
/// held go back.
#[tokio::test]
async fn an_override_elsewhere_revokes_the_grants_held() {
    let (a, b, clock) = ten_admitted_on_a(r#"{"max": 50}"#, 100).await;
    let low = sluice::Override {
        id: "low".into(),
        domain: "api".into(),
        entries: vec![sluice::Entry { key: "route".into(), value: "r".into() }],
        limit: 12,
        policy: None,
        window: None,
        rate: None,
        expires_at_ms: None,
        reason: "test".into(),
        set_at_ms: 0,
        set_by: String::new(),
        all_clients: false,
    };
    b.set_override(low).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    clock.advance(300);
    let mut admitted = 0;
    for _ in 0..20 {
        let v = a.check(&route()).await.unwrap();
        assert_eq!(v.binding().unwrap().decision.limit, 12, "still deciding under the old limit");
        admitted += u64::from(v.allowed());
        tokio::task::yield_now().await;
    }
    assert_eq!(admitted, 2, "12 a window, 10 of them used before the override");
    let returned = a.grants().stats().returned.load(std::sync::atomic::Ordering::Relaxed);
    assert!(returned > 0, "the grants held under the old limit were not given back");
}

/// A reload that changes the limit hands the grants to the new rules, which give the old
/// ones back at their next decision and decide under the new limit.
#[tokio::test]
async fn a_reload_revokes_the_grants_of_a_changed_limit() {
    let (a, _, clock) = two_instances(r#"{"max": 50}"#, 100);
    for _ in 0..10 {
        assert!(a.check(&route()).await.unwrap().allowed());
    }
    let window = serde_json::json!({"name": "w", "fixed_window": {"limit": 15, "window": "1m"}});
    let rules = Arc::new(one_route(r#"{"max": 50}"#, window).unwrap());
    let reloaded = Limiter::new(rules, a.store().clone(), clock.clone()).with_grants(a.grants().clone());
    let mut admitted = 0;
    for _ in 0..20 {
        let v = reloaded.check(&route()).await.unwrap();
        assert_eq!(v.binding().unwrap().decision.limit, 15);
        admitted += u64::from(v.allowed());
        tokio::task::yield_now().await;
    }
    assert_eq!(admitted, 5, "15 a window, 10 used before the reload");
}

/// A granted rule in shadow mode admits everything and reports what it would have
/// refused, as any shadow rule does.
#[tokio::test]
async fn a_granted_rule_in_shadow_mode_refuses_nothing() {
    let config = serde_json::json!({"domains": [{"domain": "api", "descriptors": [
        {"key": "route", "grants": "auto", "shadow_mode": true,
         "policies": [{"name": "w", "fixed_window": {"limit": 3, "window": "1m"}}]},
    ]}]});
    let rules = Arc::new(serde_json::from_value::<RulesConfig>(config).unwrap().compile().unwrap());
    let limiter = Limiter::new(rules, Arc::new(MemoryStore::new(100)), Arc::new(ManualClock::new(0)));
    let mut would = 0;
    for _ in 0..5 {
        let v = limiter.check(&route()).await.unwrap();
        assert!(v.allowed(), "a shadow rule refused");
        would += v.shadow_denials().count();
    }
    assert_eq!(would, 2, "3 a minute: the 4th and 5th would have been refused");
}

/// A stalled store (a Redis stopped with SIGSTOP) under a burst of decisions of one
/// granted key: every decision is answered within the deadline and 50 ms. Those queued
/// behind the ask for a grant used to ask again after it failed, each after its own
/// deadline (the soak found decisions at 156 to 267 ms for a deadline of 100 ms, seed
/// 11, `scripts/soak --store cluster --faults failover,pause-primary,kill-instance`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_queued_behind_a_failed_grant_keep_the_deadline() {
    use sluice::store::{Resilience, Resilient};
    let redis = sluice_testkit::RedisServer::start();
    let store = RedisStore::new(&redis.url(), &[], RedisOptions::default()).unwrap();
    let deadline = std::time::Duration::from_millis(100);
    let resilient = Resilient::new(store, Resilience { deadline, failures: 1_000, ..Resilience::default() });
    let limiter =
        Arc::new(Limiter::new(Arc::new(rules(window())), Arc::new(resilient), Arc::new(sluice::time::SystemClock)));
    let req = Request::new("api").descriptor([("route", "/search")]);
    assert!(limiter.check(&req).await.unwrap().allowed(), "a grant taken while the store answers");
    // what the grant holds is spent at once; the rest wait for the next grant's ask
    redis.signal("-STOP");
    let calls: Vec<_> = (0..30)
        .map(|_| {
            let (limiter, req) = (limiter.clone(), req.clone());
            tokio::spawn(async move {
                let started = std::time::Instant::now();
                let _ = limiter.check(&req).await;
                started.elapsed()
            })
        })
        .collect();
    let mut slowest = std::time::Duration::ZERO;
    for c in calls {
        slowest = slowest.max(c.await.unwrap());
    }
    redis.signal("-CONT");
    assert!(slowest <= deadline + std::time::Duration::from_millis(50), "the slowest took {slowest:?}");
}
