//! Token budgets under load, as an LLM gateway meets them: 1,000 streams at once on two
//! instances over one Redis and over a Redis Cluster, each estimate off by up to 50%
//! from the tokens the stream really uses, through Kuadrant's service.
//!
//! With reservations (Reserve at the request, Commit at the end) what is committed
//! passes the budget by at most the underestimates of the reservations open at the last
//! admission, computed from the run's own log, and by nothing when estimates are upper
//! bounds. Checking first and charging at the end (CheckRateLimit, then Report, as the
//! peers and Envoy's `apply_on_stream_done` do) overspends by what was in flight. An
//! orphan (its instance killed -9) is released at its TTL, and the budget is whole again.
//! Each run prints its figures (docs/benchmarks.md, "Token budgets").

mod common;
#[path = "common/kuadrant.rs"]
mod kuadrant;

use common::{Sluice, start_with};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use kuadrant::{CommitRequest, CommitResponse, ReserveRequest, ReserveResponse, call, call_on, channel};
use sluice_testkit::{RedisCluster, RedisServer};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// The budget: tokens an hour (one window for the whole run).
const BUDGET: u64 = 200_000;
const STREAMS: usize = 1_000;
const OK: i32 = 1;

/// 1,000 calls at once on two debug builds sharing two cores queue for longer than the
/// default 100 ms a store call may take: the runs measure budgets, not deadlines. So may
/// a Redis reply on a busy machine take longer than the store's default 1 s (a full run
/// beside three soaks failed so): `STORE_TIMEOUT` too.
const LIMITER: &str = "limiter:\n  deadline: 5s\n";
const STORE_TIMEOUT: &str = "  timeout: 5s\n";

fn domains() -> String {
    format!(
        "  - domain: llm\n    descriptors:\n      - key: user\n        rate_limit: {{unit: hour, requests_per_unit: {BUDGET}}}\n"
    )
}

fn request(user: &str, hits: u64) -> RateLimitRequest {
    RateLimitRequest { hits_addend: hits as u32, ..common::rls_request("llm", &[("user", user)]) }
}

/// A small deterministic generator (xorshift) per stream.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// How estimates relate to what a stream really uses.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Estimates {
    /// Off by up to 50% either way.
    Off,
    /// Never below the actual (up to 50% above).
    UpperBounds,
}

/// One admitted stream, as its client saw it (ms since the run began).
struct Admitted {
    sent: u64,
    answered: u64,
    estimate: u64,
    actual: u64,
    committed: u64,
}

/// A stream's next job: the tokens it will use, and its estimate of them.
fn job(rng: &mut Rng, estimates: Estimates) -> (u64, u64) {
    let actual = 500 + rng.below(1_001);
    let off = match estimates {
        Estimates::Off => rng.below(101) as i64 - 50,
        Estimates::UpperBounds => rng.below(51) as i64,
    };
    (actual, (actual as i64 * (100 + off) / 100) as u64)
}

/// One stream with reservations: reserve the estimate, "stream" 50 to 250 ms, commit the
/// actual; again, until a reservation is refused.
async fn reserving(ch: Channel, user: String, seed: u64, estimates: Estimates, t0: Instant) -> Vec<Admitted> {
    let (mut rng, mut log) = (Rng(seed), Vec::new());
    let ms = || t0.elapsed().as_millis() as u64;
    loop {
        let (actual, estimate) = job(&mut rng, estimates);
        let sent = ms();
        let hold =
            ReserveRequest { request: Some(request(&user, estimate)), ttl: Some(PbDuration { seconds: 60, nanos: 0 }) };
        let r: ReserveResponse = call_on(ch.clone(), "Reserve", hold).await.unwrap();
        let answered = ms();
        if r.response.unwrap().overall_code != OK {
            return log;
        }
        tokio::time::sleep(Duration::from_millis(50 + rng.below(201))).await;
        let commit = CommitRequest { reservation_id: r.reservation_id, actual: Some(actual), actuals: vec![] };
        let _: CommitResponse = call_on(ch.clone(), "Commit", commit).await.unwrap();
        log.push(Admitted { sent, answered, estimate, actual, committed: ms() });
    }
}

/// One stream as the peers meter it: check (charging nothing), stream, report the
/// actual; again, until a check is refused. What it reported.
async fn checking(ch: Channel, user: String, seed: u64) -> u64 {
    let (mut rng, mut reported) = (Rng(seed), 0);
    loop {
        let (actual, _) = job(&mut rng, Estimates::Off);
        let checked: RateLimitResponse = call_on(ch.clone(), "CheckRateLimit", request(&user, 1)).await.unwrap();
        if checked.overall_code != OK {
            return reported;
        }
        tokio::time::sleep(Duration::from_millis(50 + rng.below(201))).await;
        let _: RateLimitResponse = call_on(ch.clone(), "Report", request(&user, actual)).await.unwrap();
        reported += actual;
    }
}

/// What the budget of `user` has counted, by a status call (charging nothing).
async fn counted(s: &Sluice, user: &str) -> u64 {
    let url = format!("{}/v1/ratelimit?domain=llm&user={user}", s.base);
    let v: serde_json::Value = reqwest::get(url).await.unwrap().json().await.unwrap();
    v["statuses"][0]["policies"][0]["used"].as_u64().unwrap_or_else(|| panic!("{v}"))
}

/// 1,000 reserving streams over two instances: the bound from the log, and what was
/// committed. Returns (committed, bound, reservations admitted).
async fn with_reservations(fleet: &[Sluice; 2], user: &str, estimates: Estimates) -> (u64, u64, usize) {
    let channels = [channel(&fleet[0].grpc).await, channel(&fleet[1].grpc).await];
    let t0 = Instant::now();
    let streams: Vec<_> = (0..STREAMS)
        .map(|i| tokio::spawn(reserving(channels[i % 2].clone(), user.to_string(), 0x9e37 + i as u64, estimates, t0)))
        .collect();
    let mut log = Vec::new();
    for s in streams {
        log.extend(s.await.unwrap());
    }
    let committed = counted(&fleet[0], user).await;
    assert_eq!(committed, log.iter().map(|a| a.actual).sum::<u64>(), "every commit counted, once");
    // the last admission happened between its request and its answer; a reservation
    // was open then unless its commit was answered before that request was sent
    let last = log.iter().max_by_key(|a| a.answered).expect("some reservation admitted");
    let open = log.iter().filter(|a| a.sent <= last.answered && a.committed >= last.sent);
    let bound = BUDGET + open.map(|a| a.actual.saturating_sub(a.estimate)).sum::<u64>();
    (committed, bound, log.len())
}

/// The same load metered as the peers meter it: what was reported.
async fn without_reservations(fleet: &[Sluice; 2], user: &str) -> u64 {
    let channels = [channel(&fleet[0].grpc).await, channel(&fleet[1].grpc).await];
    let streams: Vec<_> = (0..STREAMS)
        .map(|i| tokio::spawn(checking(channels[i % 2].clone(), user.to_string(), 0x9e37 + i as u64)))
        .collect();
    let mut reported = 0;
    for s in streams {
        reported += s.await.unwrap();
    }
    assert_eq!(counted(&fleet[0], user).await, reported);
    reported
}

/// Every run on one store: the bound holds, upper-bound estimates never overspend, the
/// peers' way overspends by more, and an orphan is released at its TTL.
async fn budgets_hold(store: &str, fleet: [Sluice; 2]) {
    let (committed, bound, admitted) = with_reservations(&fleet, "off", Estimates::Off).await;
    println!(
        "{store}: reservations, estimates off by up to 50%: {admitted} admitted, committed {committed} of {BUDGET} (over by {}), bound {bound}",
        committed.saturating_sub(BUDGET)
    );
    assert!(committed <= bound, "committed {committed} passes the bound {bound}");
    let (committed, _, admitted) = with_reservations(&fleet, "upper", Estimates::UpperBounds).await;
    println!("{store}: reservations, estimates upper bounds: {admitted} admitted, committed {committed} of {BUDGET}");
    assert!(committed <= BUDGET, "upper-bound estimates overspent: {committed}");
    let reported = without_reservations(&fleet, "peers").await;
    println!(
        "{store}: check then report: charged {reported} of {BUDGET} (over by {})",
        reported.saturating_sub(BUDGET)
    );
    assert!(reported > bound, "checking first overspends by what is in flight: {reported}");
    orphan_released(fleet).await;
}

/// A reservation of the whole budget through an instance killed -9 (its client gone
/// with it) holds the budget until its TTL, and not a moment longer.
async fn orphan_released(mut fleet: [Sluice; 2]) {
    let hold =
        ReserveRequest { request: Some(request("orphan", BUDGET)), ttl: Some(PbDuration { seconds: 1, nanos: 0 }) };
    let held = Instant::now();
    let r: ReserveResponse = call(&fleet[0].grpc, "Reserve", hold).await.unwrap();
    assert_eq!(r.response.unwrap().overall_code, OK);
    fleet[0].process.kill();
    let check = |hits| call::<_, RateLimitResponse>(&fleet[1].grpc, "CheckRateLimit", request("orphan", hits));
    assert_ne!(check(1).await.unwrap().overall_code, OK, "held by the orphan");
    tokio::time::sleep(Duration::from_millis(1_050).saturating_sub(held.elapsed())).await;
    assert_eq!(check(BUDGET).await.unwrap().overall_code, OK, "the whole budget back after the TTL");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_one_redis() {
    let redis = RedisServer::start();
    let store = format!("store:\n  kind: redis\n  url: {}\n{STORE_TIMEOUT}{LIMITER}", redis.url());
    budgets_hold("redis", [start_with(&store, &domains()), start_with(&store, &domains())]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_cluster() {
    let cluster = RedisCluster::start();
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let store = format!("store:\n  kind: redis_cluster\n  nodes: [{}]\n{STORE_TIMEOUT}{LIMITER}", nodes.join(", "));
    budgets_hold("cluster", [start_with(&store, &domains()), start_with(&store, &domains())]).await;
}
