//! Redis behind Sentinel, end to end: three real Sentinels, a primary and two replicas;
//! the primary killed under load. Every decision is answered within the deadline + 50 ms
//! (failing open, marked degraded, while there is no primary), and decisions are exact
//! again within 5 s of the promotion. The old primary, started again at once, takes no
//! write.

mod common;

use common::{header, hit, start_with};
use sluice_testkit::RedisSentinels;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// `limiter.deadline` of the server under test.
const DEADLINE: Duration = Duration::from_millis(100);

/// One answer: when it was sent, how long it took, its status and degraded mark.
struct Seen {
    took: Duration,
    status: u16,
    degraded: String,
}

/// Sends requests for fresh clients from `workers` loops until `stop`.
fn load(base: &str, workers: usize, stop: Arc<AtomicBool>) -> Vec<tokio::task::JoinHandle<Vec<Seen>>> {
    (0..workers)
        .map(|w| {
            let (base, stop, c) = (base.to_string(), stop.clone(), reqwest::Client::new());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let started = Instant::now();
                    let r = hit(&c, &base, "d", &[("user", &format!("load-{w}-{}", n / 5))]).await;
                    seen.push(Seen {
                        took: started.elapsed(),
                        status: r.status().as_u16(),
                        degraded: header(&r, "x-sluice-degraded"),
                    });
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                seen
            })
        })
        .collect()
}

/// Whether a fresh client gets exactly its limit (10), none of it degraded.
async fn exact(c: &reqwest::Client, base: &str, user: &str) -> bool {
    let mut admitted = 0;
    for _ in 0..12 {
        let r = hit(c, base, "d", &[("user", user)]).await;
        if !header(&r, "x-sluice-degraded").is_empty() {
            return false;
        }
        admitted += u32::from(r.status() == 200);
    }
    admitted == 10
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_killed_under_load() {
    let _heavy = common::heavy().await;
    let mut set = RedisSentinels::start(2, 3, 1_000);
    let sentinels: Vec<String> = set.addrs().iter().map(|a| format!("\"{a}\"")).collect();
    let store = format!(
        "limiter:\n  deadline: {}ms\n  failure: open\nstore:\n  kind: redis_sentinel\n  sentinels: [{}]\n  master_name: {}\n  read_from_replicas: true\n",
        DEADLINE.as_millis(),
        sentinels.join(", "),
        RedisSentinels::MASTER
    );
    let s = start_with(
        &store,
        "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 10}\n",
    );
    let c = reqwest::Client::new();
    assert!(exact(&c, &s.base, "before").await, "not exact before the failover:\n{}", s.log());
    let status = c.get(format!("{}/v1/ratelimit?domain=d&user=before", s.base)).send().await.unwrap();
    assert_eq!(common::num(&status, "x-ratelimit-remaining"), 0, "a status read (from a replica) sees the writes");
    assert!(set.replica_script_calls() > 0, "the status read went to the primary, not a replica");

    let stop = Arc::new(AtomicBool::new(false));
    let workers = load(&s.base, 3, stop.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let old = set.primary.port();
    set.primary.kill();
    let killed = Instant::now();

    // Sentinel calls it down after 1 s, agrees, elects a leader and promotes a replica
    let promoted = loop {
        if set.primary_port().is_some_and(|p| p != old) {
            break Instant::now();
        }
        assert!(killed.elapsed() < Duration::from_secs(30), "no promotion 30 s after the primary died:\n{}", s.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // the old primary started again at once, as a restarted pod is: empty, and a primary
    // until the Sentinels demote it, while some of them may still name it
    set.primary.restart();
    let mut round = 0;
    let exact_again = loop {
        round += 1;
        if exact(&c, &s.base, &format!("after-{round}")).await {
            break promoted.elapsed();
        }
        assert!(promoted.elapsed() < Duration::from_secs(10), "not exact 10 s after the promotion:\n{}", s.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    stop.store(true, Ordering::Relaxed);
    let mut seen = Vec::new();
    for w in workers {
        seen.extend(w.await.unwrap());
    }

    let slowest = seen.iter().map(|x| x.took).max().unwrap();
    let degraded = seen.iter().filter(|x| x.degraded == "fail-open").count();
    let bad: Vec<String> = seen
        .iter()
        .filter(|x| x.status != 200 && x.status != 429 || !x.degraded.is_empty() && x.degraded != "fail-open")
        .map(|x| format!("{} {}", x.status, x.degraded))
        .collect();
    println!(
        "{} decisions during the failover, {degraded} failed open; slowest {slowest:?}; promoted {:?} after the kill; exact again {exact_again:?} after the promotion",
        seen.len(),
        promoted - killed
    );
    assert!(bad.is_empty(), "answers other than 200/429 or marked otherwise: {bad:?}");
    assert!(degraded > 0, "no decision failed open while there was no primary: was the primary's death seen?");
    assert!(slowest <= DEADLINE + Duration::from_millis(50), "a decision took {slowest:?}");
    assert!(exact_again <= Duration::from_secs(5), "exact again only {exact_again:?} after the promotion");
    assert!(s.log().contains("following the server the Sentinels name"), "{}", s.log());
    // a write there would be lost when the Sentinels demote it (a grant given twice)
    let stats = set.primary.command("INFO commandstats").unwrap();
    let writes = stats.lines().find(|l| l.starts_with("cmdstat_evalsha:"));
    assert_eq!(writes, None, "the old primary, started again, took writes:\n{}", s.log());
}

/// A Sentinel store named wrongly is refused at start, saying what to write.
#[test]
fn a_bad_sentinel_address_is_refused_at_start() {
    let dir = sluice_testkit::TempDir::new("sluice-sentinel-config");
    let file = dir.path().join("bad.yaml");
    let store = "store:\n  kind: redis_sentinel\n  sentinels: [\"redis://10.0.0.8:26379\"]\n  master_name: m\n";
    let domains = "domains:\n  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 10}\n";
    std::fs::write(&file, format!("{}{store}{domains}", common::SERVER)).unwrap();
    let out = std::process::Command::new(common::bin()).args(["serve", "--config"]).arg(&file).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started with a bad Sentinel address");
    assert!(stderr.contains("'redis://10.0.0.8:26379' is not host:port"), "{stderr}");
}

/// Passwords for the servers and for the Sentinels: with both, decisions are exact and
/// status reads come from the replica; neither password reaches the log; without the
/// Sentinels' password the server is not ready and the log says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_for_the_servers_and_the_sentinels() {
    let _heavy = common::heavy().await;
    let (redis_pw, sentinel_pw) = ("redis-pw-7f2e", "sentinel-pw-91cd");
    let set = RedisSentinels::start_with_passwords(1, 1, 5_000, Some((redis_pw, sentinel_pw)));
    let store = |sentinel_password: &str| {
        format!(
            "store:\n  kind: redis_sentinel\n  sentinels: [\"{}\"]\n  master_name: {}\n  read_from_replicas: true\n  password: {redis_pw}\n{sentinel_password}  replica_acks: 1\n",
            set.addrs()[0],
            RedisSentinels::MASTER
        )
    };
    let domains =
        "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 10}\n";
    let s = start_with(&store(&format!("  sentinel_password: {sentinel_pw}\n")), domains);
    let c = reqwest::Client::new();
    assert!(exact(&c, &s.base, "u").await, "{}", s.log());
    let status = c.get(format!("{}/v1/ratelimit?domain=d&user=u", s.base)).send().await.unwrap();
    assert_eq!(common::num(&status, "x-ratelimit-remaining"), 0);
    assert!(set.replica_script_calls() > 0, "the status read went to the primary, not the replica");
    for pw in [redis_pw, sentinel_pw] {
        assert!(!s.log().contains(pw), "a password is in the log:\n{}", s.log());
    }

    let without = common::start_unready(&store(""), domains);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let ready = c.get(format!("{}/readyz", without.base)).send().await.unwrap().status();
    assert_eq!(ready, 503, "ready without the Sentinels' password");
    let log = without.log();
    assert!(log.contains("cannot ask the Sentinels") && log.contains("NOAUTH"), "{log}");
}
