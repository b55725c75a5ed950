//! `sluice serve` on a six-node Redis Cluster: exact under concurrency, and exact and
//! quiet while the cluster reshards and fails over beneath it.

mod common;

use common::{header, hit, start_with};
use sluice_testkit::RedisCluster;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

fn cluster_config(cluster: &RedisCluster) -> String {
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    format!("store:\n  kind: redis_cluster\n  nodes: [{}]\n", nodes.join(", "))
}

fn rule(limit: u64) -> String {
    format!(
        "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {{unit: hour, requests_per_unit: {limit}}}\n"
    )
}

/// What a load run saw.
#[derive(Default)]
struct Seen {
    admitted: HashMap<String, u64>,
    statuses: HashMap<u16, u64>,
    degraded: u64,
    /// Requests that got no HTTP answer at all.
    errors: u64,
    slowest: Duration,
    total: u64,
}

/// Eight workers drive `clients` clients round robin until `stop` is set.
async fn drive(base: String, clients: usize, stop: Arc<AtomicBool>) -> Seen {
    let client = reqwest::Client::new();
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let (client, base, stop) = (client.clone(), base.clone(), stop.clone());
            tokio::spawn(async move {
                let mut seen = Seen::default();
                let mut i = w;
                while !stop.load(Ordering::Relaxed) {
                    let user = format!("c{}", i % clients);
                    i += 8;
                    let t = Instant::now();
                    let sent = client
                        .post(format!("{base}/v1/ratelimit"))
                        .json(&common::body("d", &[("user", &user)]))
                        .send()
                        .await;
                    seen.slowest = seen.slowest.max(t.elapsed());
                    seen.total += 1;
                    let Ok(r) = sent else {
                        seen.errors += 1;
                        continue;
                    };
                    *seen.statuses.entry(r.status().as_u16()).or_default() += 1;
                    if !header(&r, "x-sluice-degraded").is_empty() {
                        seen.degraded += 1;
                    }
                    if r.status() == 200 {
                        *seen.admitted.entry(user).or_default() += 1;
                    }
                }
                seen
            })
        })
        .collect();
    let mut all = Seen::default();
    for w in workers {
        let s = w.await.unwrap();
        for (k, v) in s.admitted {
            *all.admitted.entry(k).or_default() += v;
        }
        for (k, v) in s.statuses {
            *all.statuses.entry(k).or_default() += v;
        }
        all.degraded += s.degraded;
        all.errors += s.errors;
        all.slowest = all.slowest.max(s.slowest);
        all.total += s.total;
    }
    all
}

/// 300 concurrent requests for a client whose limit is 200: exactly 200 admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_the_limit_under_concurrency() {
    let _heavy = common::heavy().await;
    let cluster = RedisCluster::start();
    // exactness, not latency, is under test: on two shared cores 300 requests at once
    // on a cold cluster connection can take longer than the 100 ms default deadline, and
    // the failure policy would (correctly) decide them
    let sections = format!("{}limiter: {{deadline: 5s}}\n", cluster_config(&cluster));
    let s = start_with(&sections, &rule(200));
    let (ok, degraded) = common::burst(std::slice::from_ref(&s.base), "d", "one", 300).await;
    assert_eq!(degraded, 0, "decisions left to the failure policy");
    assert_eq!(ok, 200);
}

/// Moving 2,000 slots while eight workers drive 200 clients: no 5xx, no degraded
/// decision, no client above its limit, and every client's stored count equals the
/// requests it was admitted (counts survive the move).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resharding_under_load_stays_exact() {
    let _heavy = common::heavy().await;
    let cluster = Arc::new(RedisCluster::start());
    let limit = 30;
    let s = start_with(&cluster_config(&cluster), &rule(limit));
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(drive(s.base.clone(), 200, stop.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let primaries = cluster.primaries();
    let c = cluster.clone();
    let moved = Instant::now();
    tokio::task::spawn_blocking(move || {
        c.reshard(primaries[0], primaries[1], 1_000);
        c.reshard(primaries[2], primaries[1], 1_000);
    })
    .await
    .unwrap();
    let took = moved.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let seen = load.await.unwrap();
    eprintln!("moved 2,000 slots in {took:?} under {} requests: {:?}", seen.total, seen.statuses);
    assert!(seen.statuses.keys().all(|&c| c == 200 || c == 429), "{:?}", seen.statuses);
    assert_eq!((seen.errors, seen.degraded), (0, 0));
    assert!(seen.admitted.values().all(|&n| n <= limit), "a client went above its limit");
    // the stored counts, read back after the move, match what the test saw admitted
    let client = reqwest::Client::new();
    for (user, admitted) in &seen.admitted {
        let r = client.get(format!("{}/v1/ratelimit?domain=d&user={user}", s.base)).send().await.unwrap();
        let used = r.headers()["x-ratelimit-used"].to_str().unwrap().parse::<u64>().unwrap();
        assert_eq!(used, *admitted, "{user}: stored count {used}, admitted {admitted}");
    }
}

/// Killing a primary under load: no decision slower than 500 ms; once a replica is
/// promoted, decisions are neither degraded nor wrong 5 s later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_under_load() {
    let _heavy = common::heavy().await;
    let mut cluster = RedisCluster::start();
    let s = start_with(&cluster_config(&cluster), &rule(1_000_000));
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(drive(s.base.clone(), 200, stop.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let victim = cluster.primaries()[0];
    cluster.nodes[victim].kill();
    // wait for the promotion: three primaries answering again, the cluster ok
    let promoted = cluster.wait_promotion(Duration::from_secs(20));
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, Ordering::Relaxed);
    let seen = load.await.unwrap();
    eprintln!(
        "promotion {promoted:?} after the kill; {} requests, {} degraded, slowest {:?}",
        seen.total, seen.degraded, seen.slowest
    );
    assert!(seen.slowest <= Duration::from_millis(500), "a decision took {:?}", seen.slowest);
    assert_eq!(seen.errors, 0);
    assert!(seen.statuses.keys().all(|&c| c == 200), "{:?}", seen.statuses);

    // 5 s after the promotion: fresh clients get exactly their limit, nothing degraded
    let client = reqwest::Client::new();
    for u in 0..50 {
        let user = format!("after-{u}");
        let mut ok = 0;
        for _ in 0..3 {
            let r = hit(&client, &s.base, "d", &[("user", &user)]).await;
            assert_eq!(header(&r, "x-sluice-degraded"), "", "degraded 5 s after the promotion");
            assert_eq!(r.status(), 200);
            ok += 1;
            assert_eq!(r.headers()["x-ratelimit-used"].to_str().unwrap(), ok.to_string(), "{user}: wrong count");
        }
    }
}
