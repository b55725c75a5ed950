//! 200,000 stored overrides on real Redis (one node, and a Cluster): stored by one import,
//! bounded by `limiter.max_overrides`, loaded by an instance that starts after them (not
//! ready until it holds them all), and none of it touching decisions: their p99 and
//! degraded count with the set loaded, and while another instance reads it, against
//! none. Redis is never blocked long (of some 1,200 registry calls, at most 3 in its
//! slowlog at 20 ms, a busy machine's noise).

mod common;

use common::{Sluice, metrics, start_unready, start_with};
use serde_json::{Value, json};
use sluice_testkit::{RedisCluster, RedisServer};
use std::time::{Duration, Instant};

const TOKEN: &str = "adm-scale-secret";
const N: usize = 200_000;

/// Domain `d`: each `user` 5 an hour.
const DOMAINS: &str = "  - domain: d\n    descriptors:\n      - key: user\n        policies:\n          - {name: hourly, fixed_window: {limit: 5, window: 1h}}\n";

/// The `server:` continuation, the store, and a maximum of exactly `N` overrides.
fn sections(store: &str) -> String {
    format!("  admin_token: {TOKEN}\n{store}limiter:\n  max_overrides: {N}\n")
}

/// `N` overrides, `o-I` raising user `u-I` to 50, as one import body.
fn import_body() -> String {
    let all: Vec<Value> = (0..N)
        .map(|i| {
            json!({"id": format!("o-{i}"), "domain": "d", "entries": [{"key": "user", "value": format!("u-{i}")}],
                   "limit": 50, "reason": "scale test"})
        })
        .collect();
    Value::Array(all).to_string()
}

/// The p99 of `n` decisions sent 16 at a time to `base` (for users with and without an
/// override), and how many the failure policy decided.
async fn decisions(base: &str, n: usize) -> (Duration, usize) {
    let client = reqwest::Client::new();
    let tasks: Vec<_> = (0..16)
        .map(|t| {
            let (client, base) = (client.clone(), base.to_string());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                for i in 0..n / 16 {
                    let user = format!("u-{}", (t * 7919 + i * 104_729) % (2 * N));
                    let started = Instant::now();
                    let r = common::hit(&client, &base, "d", &[("user", &user)]).await;
                    seen.push((started.elapsed(), r.headers().contains_key("x-sluice-degraded")));
                }
                seen
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let degraded = all.iter().filter(|(_, d)| *d).count();
    let mut times: Vec<Duration> = all.into_iter().map(|(t, _)| t).collect();
    times.sort();
    (times[times.len() * 99 / 100], degraded)
}

/// The `sluice_overrides` gauge of a server.
async fn held(client: &reqwest::Client, s: &Sluice) -> u64 {
    let text = metrics(client, &s.base).await;
    let line = text.lines().find(|l| l.starts_with("sluice_overrides ")).unwrap_or("sluice_overrides 0");
    line.split_whitespace().nth(1).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) as u64
}

async fn admin(c: &reqwest::Client, method: reqwest::Method, url: String, body: Option<String>) -> reqwest::Response {
    let request = c.request(method, url).bearer_auth(TOKEN);
    let request = match body {
        Some(b) => request.header("content-type", "application/json").body(b),
        None => request,
    };
    request.send().await.unwrap()
}

/// Waits until `b` says ready: not before it holds all `N` overrides, and saying why
/// until then (reading 200,000 takes seconds: the first looks find them not loaded).
async fn ready_only_when_loaded(c: &reqwest::Client, b: &Sluice) -> Duration {
    let started = Instant::now();
    let mut said_why = false;
    loop {
        let ready = c.get(format!("{}/readyz", b.base)).send().await.unwrap();
        let (status, text) = (ready.status(), ready.text().await.unwrap());
        if status == 200 {
            assert_eq!(held(c, b).await, N as u64, "ready before the overrides were loaded:\n{}", b.log());
            assert!(said_why, "never said the overrides were not loaded yet");
            return started.elapsed();
        }
        said_why |= text == "stored overrides not loaded yet\n";
        assert!(text.contains("store") || said_why, "{text}");
        assert!(started.elapsed() < Duration::from_secs(60), "not ready in 60 s:\n{}", b.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn at_scale(store: &str, nodes: &[&RedisServer]) {
    for n in nodes {
        n.command("CONFIG SET slowlog-log-slower-than 20000").unwrap();
        n.command("SLOWLOG RESET").unwrap();
    }
    let sections = sections(store);
    let a = start_with(&sections, DOMAINS);
    let c = reqwest::Client::new();
    let (p99_none, degraded_none) = decisions(&a.base, 1_600).await;

    let started = Instant::now();
    let r = admin(&c, reqwest::Method::POST, format!("{}/v1/overrides:import", a.base), Some(import_body())).await;
    let imported = started.elapsed();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    assert_eq!(r.json::<Value>().await.unwrap()["imported"], N);
    assert_eq!(held(&c, &a).await, N as u64, "the importer holds them at once");

    // the registry is full: a new id is refused saying why, replacing one is not
    let one = json!({"domain": "d", "entries": [{"key": "user", "value": "extra"}], "limit": 9});
    let r = admin(&c, reqwest::Method::PUT, format!("{}/v1/overrides/extra", a.base), Some(one.to_string())).await;
    assert_eq!(r.status(), 409);
    let refused: Value = r.json().await.unwrap();
    assert_eq!(refused["error"]["code"], "too_many_overrides");
    assert!(refused["error"]["message"].as_str().unwrap().contains("limiter.max_overrides"), "{refused}");
    let r = admin(&c, reqwest::Method::PUT, format!("{}/v1/overrides/o-7", a.base), Some(one.to_string())).await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());

    // another instance starts: it reads them all while A decides
    let b = start_unready(&sections, DOMAINS);
    let (loading, (p99_loading, degraded_loading)) =
        tokio::join!(ready_only_when_loaded(&c, &b), decisions(&a.base, 1_600));
    let r = common::hit(&c, &b.base, "d", &[("user", "u-199999")]).await;
    assert_eq!(common::num(&r, "x-ratelimit-limit"), 50, "B applies the imported overrides");
    let r = admin(&c, reqwest::Method::GET, format!("{}/v1/overrides/o-7", b.base), None).await;
    assert_eq!(r.json::<Value>().await.unwrap()["limit"], 9, "B holds the override replaced after the import");
    let (p99_loaded, degraded_loaded) = decisions(&a.base, 1_600).await;

    println!(
        "{N} overrides: imported in {imported:?}; a new instance ready in {loading:?}; decisions' p99 {p99_none:?} \
         with none, {p99_loaded:?} with them, {p99_loading:?} while B loaded them (B's reading shares the two \
         cores); degraded {degraded_none}, {degraded_loaded}, {degraded_loading}"
    );
    assert_eq!((degraded_none, degraded_loaded, degraded_loading), (0, 0, 0), "no decision fails open");
    // a bound a busy 2-core machine keeps (a debug build: 10-42 ms), that the old
    // whole-set read (Redis blocked 150-270 ms a read, decisions failing open) broke
    let bound = (p99_none * 3).max(Duration::from_millis(100));
    assert!(p99_loaded <= bound, "p99 {p99_loaded:?} with the overrides, {p99_none:?} without");
    assert!(p99_loading <= bound, "p99 {p99_loading:?} while they load, {p99_none:?} without");
    // Each registry call is a page of 500 (an HSCAN of 200,000 takes 0.65 ms, 1 ms at
    // p99 on this machine), but a Redis the scheduler stops for a while shows any call
    // as slow (a decision's script too, with six nodes and two servers on two cores):
    // so this counts them. The whole-set read this replaced was 150-270 ms each time.
    for n in nodes {
        let slow = n.command("SLOWLOG GET 128").unwrap();
        let registry = slow.matches("sluice:{registry}:overrides").count();
        println!("registry calls in the slowlog at 20 ms: {registry}");
        assert!(registry <= 3, "{registry} registry calls blocked Redis 20 ms or more: {slow:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_thousand_overrides_on_one_redis() {
    let _heavy = common::heavy().await;
    let redis = RedisServer::start();
    at_scale(&format!("store:\n  kind: redis\n  url: \"{}\"\n", redis.url()), &[&redis]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_thousand_overrides_on_a_redis_cluster() {
    let _heavy = common::heavy().await;
    let cluster = RedisCluster::start();
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let store = format!("store:\n  kind: redis_cluster\n  nodes: [{}]\n", nodes.join(", "));
    at_scale(&store, &cluster.nodes.iter().collect::<Vec<_>>()).await;
}
