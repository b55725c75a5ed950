//! One limit across regions, from the front door: `sluice serve` in three regions, two
//! instances each, each region on its own store (a redis-server in two of them, a
//! six-node Redis Cluster in the third), all sharing one global Redis reached through a
//! link that delays every byte 40 ms each way (`sluice_testkit::Proxy`). Clients of the
//! HTTP API in every region ask for one tenant's limit; a checker counts every admission
//! by the window its answer names. Never over the limit in any window, through a demand
//! that moves between regions and an instance killed with SIGKILL; most of the limit used
//! when demand is twice it. The baseline beside it: the same run with each region
//! counting alone admits up to three times the limit.

mod common;

use common::{Sluice, hit, start_with};
use sluice_testkit::{Proxy, RedisCluster, RedisServer};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const LIMIT: u64 = 200;
const WINDOW_S: u64 = 4;

fn domains(global: bool) -> String {
    domains_failing(global, "open")
}

/// The rule of [`domains`], with `failure` (its decision while a store fails).
fn domains_failing(global: bool, failure: &str) -> String {
    format!(
        "  - domain: api\n    descriptors:\n      - key: tenant\n        failure: {failure}\n        policies:\n          - name: tenant\n            fixed_window: {{limit: {LIMIT}, window: {WINDOW_S}s, global: {global}}}\n"
    )
}

/// An instance of region `name` on `store` (a `store:` section), sharing `global`.
fn instance(name: &str, store: &str, global: &str, shared: bool) -> Sluice {
    let regions = match shared {
        true => format!("region: {name}\nglobal_store: {{kind: redis, url: \"redis://{global}\"}}\n"),
        false => String::new(),
    };
    start_with(&format!("  admin_token: {TOKEN}\n  ui: true\n{store}{regions}"), &domains(shared))
}

const TOKEN: &str = "a-region-admin-token";

/// One real-time test of this file at a time: each judges what real time shows (how long
/// a region waits on the global store), and another's load on the two cores would be
/// judged with it (a new client refused after a wait stretched by the other tests).
async fn alone() -> tokio::sync::MutexGuard<'static, ()> {
    static ONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    ONE.lock().await
}

/// Admissions by the window each answer names (its reset, in epoch seconds), by region.
type Windows = BTreeMap<u64, [u64; 3]>;

/// What a run saw: admissions by window, and every answer's time.
struct Run {
    windows: Windows,
    took: Vec<Duration>,
}

impl Run {
    /// The answers' time at quantile `q` (0 to 1).
    fn quantile(&self, q: f64) -> Duration {
        let mut took = self.took.clone();
        took.sort();
        took[((took.len() - 1) as f64 * q) as usize]
    }
}

/// Clients in each region at `rate(region, elapsed)` requests a second, for `run`; an
/// instance of region 0 killed with SIGKILL at `kill_at`, if given.
async fn drive(
    regions: &mut [Vec<Sluice>],
    run: Duration,
    rate: impl Fn(usize, Duration) -> u64,
    kill_at: Option<Duration>,
) -> Run {
    let client = reqwest::Client::new();
    let (started, mut windows, mut carry, mut turn) = (Instant::now(), Windows::new(), [0f64; 3], 0usize);
    let mut took = Vec::new();
    let (mut killed, mut last) = (false, Instant::now());
    while started.elapsed() < run {
        if kill_at.is_some_and(|k| started.elapsed() >= k) && !killed {
            regions[0][0].process.kill();
            killed = true;
        }
        let mut asks = Vec::new();
        let step = last.elapsed().as_secs_f64();
        last = Instant::now();
        for (r, instances) in regions.iter().enumerate() {
            carry[r] += rate(r, started.elapsed()) as f64 * step;
            // the killed instance's clients go to the other
            let alive = &instances[usize::from(killed && r == 0)..];
            while carry[r] >= 1.0 {
                carry[r] -= 1.0;
                turn += 1;
                let base = alive[turn % alive.len()].base.clone();
                let client = client.clone();
                asks.push(async move {
                    let asked = Instant::now();
                    (r, hit(&client, &base, "api", &[("tenant", "t1")]).await, asked.elapsed())
                });
            }
        }
        for (r, answer, time) in futures_util::future::join_all(asks).await {
            took.push(time);
            let reset = common::header(&answer, "x-ratelimit-reset");
            if answer.status() == 200 && reset.is_empty() {
                // admitted by the rule's failure (fail-open, the global store slow on a
                // loaded machine): uncounted by design, and it must say so
                let degraded = common::header(&answer, "x-sluice-degraded");
                assert!(!degraded.is_empty(), "admitted without a reset, not degraded: {:?}", answer.headers());
            } else if answer.status() == 200 {
                windows.entry(reset.parse().unwrap()).or_default()[r] += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Run { windows, took }
}

/// Twice the limit's rate, 80% of it in region `hot`.
fn twice(region: usize, hot: usize) -> u64 {
    let per_s = 2 * LIMIT / WINDOW_S;
    if region == hot { per_s * 8 / 10 } else { per_s / 10 }
}

/// The windows wholly inside a run (not its first or last).
fn whole(w: &Windows) -> Vec<(u64, u64)> {
    let all: Vec<(u64, u64)> = w.iter().map(|(e, r)| (*e, r.iter().sum())).collect();
    all[1..all.len().saturating_sub(1)].to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_regions_never_pass_one_limit() {
    let _alone = alone().await;
    let global = RedisServer::start();
    let (a, b, c) = (RedisServer::start(), RedisServer::start(), RedisCluster::start());
    let links: Vec<Proxy> = (0..3).map(|_| Proxy::start(global.addr(), Duration::from_millis(40))).collect();
    let nodes: Vec<String> = c.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let stores = [
        format!("store: {{kind: redis, url: \"{}\"}}\n", a.url()),
        format!("store: {{kind: redis, url: \"{}\"}}\n", b.url()),
        format!("store: {{kind: redis_cluster, nodes: [{}]}}\n", nodes.join(", ")),
    ];
    let names = ["eu", "us", "ap"];
    let mut regions: Vec<Vec<Sluice>> = (0..3)
        .map(|r| (0..2).map(|_| instance(names[r], &stores[r], &links[r].addr().to_string(), true)).collect())
        .collect();
    // demand in eu, then moving to us; an eu instance killed holding its grants
    let run = Duration::from_secs(5 * WINDOW_S);
    let moved = |r: usize, t: Duration| twice(r, usize::from(t >= run / 2));
    let shared = drive(&mut regions, run, moved, Some(run / 3)).await;
    let windows = &shared.windows;
    let log = || regions.iter().flatten().map(|s| s.log()).collect::<Vec<_>>().join("\n");
    for (end, by_region) in windows {
        let total: u64 = by_region.iter().sum();
        assert!(total <= LIMIT, "window ending at {end}: {by_region:?}, {total} over {LIMIT}\n{}", log());
    }
    for (end, total) in whole(windows) {
        assert!(total * 100 >= LIMIT * 90, "window ending at {end}: {total} of {LIMIT} used: {windows:?}");
    }
    let (p50, p99) = (shared.quantile(0.5), shared.quantile(0.99));
    eprintln!("shared: {windows:?}, answers p50 {p50:?} p99 {p99:?}");
    assert!(p50 < Duration::from_millis(40), "a decision waited on the global store: p50 {p50:?}");
    // what the allocators did, in /metrics: units taken and given back as demand moved
    let scrape = common::metrics(&reqwest::Client::new(), &regions[1][0].base).await;
    let value = |series: &str| common::series(&scrape, series);
    assert!(value("sluice_region_units_total{region=\"us\",kind=\"taken\"}") > 0.0, "{scrape}");
    assert!(value("sluice_region_global_calls_total{region=\"us\",result=\"ok\"}") > 0.0, "{scrape}");
    let horizon = value("sluice_region_horizon_seconds{region=\"us\"}");
    assert!((0.2..2.0).contains(&horizon), "twice an 80 ms round trip and a tick: {horizon}");
    // and in `sluice admin inspect`: the region's pool of the window now
    let inspect = std::process::Command::new(common::bin())
        .args(["admin", "--server", &regions[1][0].base, "inspect", "--domain", "api", "tenant=t1", "--json"])
        .env("SLUICE_ADMIN_TOKEN", TOKEN)
        .output()
        .unwrap();
    let seen: serde_json::Value = serde_json::from_slice(&inspect.stdout).unwrap();
    let region = &seen["policies"][0]["region"];
    let (held, taken) = (region["held"].as_u64().unwrap(), region["taken_by_instances"].as_u64().unwrap());
    assert!(taken <= held && held <= LIMIT && region["demand_per_s"].is_number(), "{seen}");
    // and the fleet's window in the global store: every region's holdings, and what is left
    let (granted, left) = (region["global_granted"].as_u64().unwrap(), region["global_left"].as_u64().unwrap());
    assert!(held <= granted && granted + left == LIMIT, "{seen}");
    // each region's grants open there (the demand has stopped: what is left of them is
    // being given back), this one ("us") named by its code, the others by code only
    let by_region = region["regions"].as_array().unwrap();
    let code = serde_json::json!(format!("{:04x}", sluice::regions::region_code("us")));
    let open: u64 = by_region.iter().map(|r| r["granted_open"].as_u64().unwrap()).sum();
    assert!(open <= granted, "{seen}");
    for r in by_region {
        let named = if r["code"] == code { serde_json::json!("us") } else { serde_json::Value::Null };
        assert_eq!(r["region"], named, "{seen}");
    }
    let text = std::process::Command::new(common::bin())
        .args(["admin", "--server", &regions[1][0].base, "inspect", "--domain", "api", "tenant=t1"])
        .env("SLUICE_ADMIN_TOKEN", TOKEN)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("region holds") && text.contains("this instance's grants in the global store"), "{text}");
    assert!(text.contains("the global store:") && text.contains("granted to the regions"), "{text}");
    live_page_shows_the_region(&regions[1][0].base).await;
}

/// Clients well under the limit, through the HTTP API in three regions with the
/// near-cache as shipped, the global store 40 ms away each way: a client that sends
/// every 300 ms through each region in turn, and brand-new clients (a tenant never seen,
/// each request, through HTTP and through Envoy's gRPC). Every request admitted, none says
/// nothing is left, and the region's figures count the pools found short apart (none
/// refused); a new client's first decision's time is printed for each door.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparse_and_new_clients_are_admitted_at_the_front_door() {
    let _alone = alone().await;
    let global = RedisServer::start();
    let stores: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let links: Vec<Proxy> = (0..3).map(|_| Proxy::start(global.addr(), Duration::from_millis(40))).collect();
    let names = ["eu", "us", "ap"];
    let regions: Vec<Sluice> = (0..3)
        .map(|r| {
            let store = format!("store: {{kind: redis, url: \"{}\"}}\n", stores[r].url());
            instance(names[r], &store, &links[r].addr().to_string(), true)
        })
        .collect();
    let client = reqwest::Client::new();
    // warm, as a deployment is: connections, and the global store's scripts loaded
    for s in &regions {
        hit(&client, &s.base, "api", &[("tenant", "warm")]).await;
    }
    let mut rls = Vec::new();
    for s in &regions {
        rls.push(common::rls(&s.grpc).await);
    }
    let (mut wrong, mut firsts) = (Vec::new(), [Vec::new(), Vec::new()]);
    for i in 0..30 {
        let s = &regions[i % 3];
        for tenant in ["steady".to_string(), format!("new-{i}")] {
            let asked = std::time::Instant::now();
            let a = hit(&client, &s.base, "api", &[("tenant", tenant.as_str())]).await;
            let remaining = common::header(&a, "x-ratelimit-remaining");
            let took = asked.elapsed();
            if a.status() != 200 || remaining == "0" {
                wrong.push((i, tenant.clone(), a.status(), remaining, common::header(&a, "retry-after"), took));
            }
            if tenant.starts_with("new") {
                firsts[0].push(took);
            }
        }
        // and a brand-new client through Envoy's door (gRPC)
        let (tenant, asked) = (format!("grpc-new-{i}"), std::time::Instant::now());
        let a = rls[i % 3].should_rate_limit(common::rls_request("api", &[("tenant", &tenant)])).await.unwrap();
        firsts[1].push(asked.elapsed());
        let a = a.into_inner();
        let remaining = a.statuses[0].limit_remaining;
        if a.overall_code != 1 || remaining == 0 {
            wrong.push((
                i,
                tenant,
                reqwest::StatusCode::OK,
                remaining.to_string(),
                a.overall_code.to_string(),
                firsts[1][i],
            ));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    for (door, took) in ["HTTP", "gRPC"].iter().zip(&mut firsts) {
        took.sort();
        let at = |q: f64| took[((took.len() - 1) as f64 * q) as usize];
        eprintln!(
            "a new client's first decision through {door}: p50 {:?}, p99 {:?} ({})",
            at(0.5),
            at(0.99),
            took.len()
        );
    }
    let mut log = String::new();
    for s in &regions {
        let scrape = common::metrics(&client, &s.base).await;
        log += &scrape.lines().filter(|l| l.starts_with("sluice_region_")).collect::<Vec<_>>().join("\n");
        log += &format!("\n{}\n", s.log());
    }
    // the start names the region and its global store
    let started = regions[0].log();
    assert!(started.contains("global limits are shared") && started.contains("region=\"eu\""), "{started}");
    assert!(wrong.is_empty(), "refused or said nothing left, under the limit: {wrong:?}\n{log}");
    let scrape = common::metrics(&client, &regions[0].base).await;
    assert!(common::series(&scrape, "sluice_region_hurried_total{region=\"eu\"}") > 0.0, "{scrape}");
    assert_eq!(common::series(&scrape, "sluice_region_refusals_total{region=\"eu\",why=\"waiting\"}"), 0.0, "{scrape}");
    // the round trips are a histogram, as the dashboard's histogram_quantile reads them
    assert!(scrape.contains("sluice_region_global_call_seconds_bucket{region=\"eu\",le=\"0.1\"}"), "{scrape}");
    reservations_reach_the_fleet(&client, &regions[0].base).await;
}

/// A reservation on the global limit through the HTTP API: held from the region's pool
/// (more than the fleet has left is refused), its commit settled once.
async fn reservations_reach_the_fleet(c: &reqwest::Client, base: &str) {
    // well inside one window, so the commit settles in the window of the reservation
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    tokio::time::sleep(Duration::from_millis((WINDOW_S * 1_000 - ms % (WINDOW_S * 1_000) + 200) % (WINDOW_S * 1_000)))
        .await;
    let hold = |amount: u64| {
        serde_json::json!({"domain": "api", "descriptors": [{"entries": [{"key": "tenant", "value": "reserving"}]}],
            "amount": amount, "ttl": "30s"})
    };
    let reserve = |amount: u64| c.post(format!("{base}/v1/reservations")).json(&hold(amount)).send();
    let r = reserve(LIMIT - 50).await.unwrap();
    let (code, first): (u16, serde_json::Value) = (r.status().as_u16(), r.json().await.unwrap());
    assert_eq!(code, 200, "held from the region's pool: {first}");
    let r = reserve(100).await.unwrap();
    assert_eq!(r.status(), 429, "50 left of the fleet's {LIMIT}: {}", r.text().await.unwrap());
    let id = first["reservation_id"].as_str().unwrap();
    for settled in ["committed", "again"] {
        let r = c.post(format!("{base}/v1/reservations/{id}/commit")).json(&serde_json::json!({"actual": 10}));
        let answer: serde_json::Value = r.send().await.unwrap().json().await.unwrap();
        assert_eq!(answer["settled"], serde_json::json!([settled]), "{answer}");
    }
    let r = reserve(100).await.unwrap();
    assert_eq!(r.status(), 200, "what the commit gave back: {}", r.text().await.unwrap());
}

/// The live page's region card: its endpoint's figures, and the page showing them.
async fn live_page_shows_the_region(base: &str) {
    let c = reqwest::Client::new();
    let o: serde_json::Value =
        c.get(format!("{base}/v1/admin/overview")).bearer_auth(TOKEN).send().await.unwrap().json().await.unwrap();
    let region = &o["region"];
    assert_eq!((&region["region"], &region["global_store"]), (&serde_json::json!("us"), &serde_json::json!("redis")));
    let n = |k: &str| region[k].as_u64().unwrap_or_else(|| panic!("no {k} in {o}"));
    assert!(n("clients") >= 1 && n("spent") <= n("held") && n("held") <= LIMIT, "{o}");
    assert!(n("taken") > 0 && n("global_calls") > 0 && region["global_mean_ms"].as_f64() > Some(0.0), "{o}");
    // what is true now, beside the counts since the start: the global store answers, 80 ms away
    assert!(n("round_trip_ms") >= 40 && region["failing"] == false, "{o}");
    assert!(region["instance"].as_str().is_some_and(|i| i.contains("(pid ")), "{o}");
    let dom = common::chromium(
        &["--dump-dom"],
        &format!("{}/ui", base.replace("http://", &format!("http://admin:{TOKEN}@"))),
    );
    let shown = |id: &str| {
        let at = dom.find(&format!("id=\"{id}\">")).unwrap_or_else(|| panic!("no {id} on the page:\n{dom}"));
        let rest = &dom[at + id.len() + 6..];
        rest[..rest.find('<').unwrap()].to_string()
    };
    assert!(dom.contains("<div class=\"card\" id=\"region\">"), "the region card is hidden:\n{dom}");
    assert_eq!(shown("region-name"), "us", "{dom}");
    assert!(shown("region-calls").parse::<u64>().is_ok_and(|calls| calls >= n("global_calls")), "{dom}");
    assert_eq!(shown("region-errors"), region["global_errors"].to_string(), "{dom}");
    assert_eq!(shown("region-state"), "answering", "{dom}");
    assert!(shown("region-instance").contains("(pid "), "{dom}");
    assert!(shown("region-rtt").parse::<u64>().is_ok_and(|ms| ms >= 40), "{dom}");
}

/// The baseline: the same regions, each counting alone (no `global`), admit up to three
/// times the limit in a window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_counting_alone_admit_up_to_three_times() {
    let _alone = alone().await;
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let mut regions: Vec<Vec<Sluice>> = servers
        .iter()
        .map(|s| vec![instance("", &format!("store: {{kind: redis, url: \"{}\"}}\n", s.url()), "", false)])
        .collect();
    let even = |_: usize, _: Duration| 2 * LIMIT / WINDOW_S;
    let alone = drive(&mut regions, Duration::from_secs(3 * WINDOW_S), even, None).await;
    let most = whole(&alone.windows).iter().map(|(_, t)| *t).max().unwrap_or(0);
    assert!(most > 2 * LIMIT, "alone, three regions admit past the limit: {:?}", alone.windows);
    eprintln!("alone: {:?}, answers p50 {:?}", alone.windows, alone.quantile(0.5));
}

/// The other baseline: every decision of every region calls one global Redis, 40 ms
/// away each way. Exact, and each decision waits the round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_far_store_for_every_decision_costs_the_round_trip() {
    let _alone = alone().await;
    let global = RedisServer::start();
    let links: Vec<Proxy> = (0..3).map(|_| Proxy::start(global.addr(), Duration::from_millis(40))).collect();
    let mut regions: Vec<Vec<Sluice>> = links
        .iter()
        .map(|l| {
            vec![instance(
                "",
                &format!("store: {{kind: redis, url: \"redis://{}\"}}\nlimiter: {{deadline: 1s}}\n", l.addr()),
                "",
                false,
            )]
        })
        .collect();
    let far = drive(&mut regions, Duration::from_secs(3 * WINDOW_S), |r, _| twice(r, 0), None).await;
    for (end, by_region) in &far.windows {
        assert!(by_region.iter().sum::<u64>() <= LIMIT, "window ending at {end}: {by_region:?}");
    }
    let p50 = far.quantile(0.5);
    eprintln!("far: {:?}, answers p50 {p50:?} p99 {:?}", far.windows, far.quantile(0.99));
    assert!(p50 >= Duration::from_millis(80), "each decision waits the round trip: p50 {p50:?}");
}

/// `failure: local` on a global limit with its stores really down (redis-servers
/// killed), three regions of one instance, each asking for the limit every window (the
/// fleet three times it), the global store reached directly. With eu's own store down,
/// eu decides on the global store itself (one call a decision): it admits, and the fleet
/// stays within the limit (counted in process at the limit, eu alone admitted a whole
/// limit besides the others' part). With the global store down too, each region admits
/// at most its share, the limit over the three regions it knows, and some: no region
/// refuses every client, and the fleet stays within the limit (each region admitted a
/// whole limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_local_holds_a_global_limit_with_stores_down() {
    let _alone = alone().await;
    let mut global = RedisServer::start();
    let mut locals: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let names = ["eu", "us", "ap"];
    let mut regions: Vec<Vec<Sluice>> = (0..3)
        .map(|r| {
            let store = format!("store: {{kind: redis, url: \"{}\"}}\n", locals[r].url());
            let shared = format!("region: {}\nglobal_store: {{kind: redis, url: \"{}\"}}\n", names[r], global.url());
            vec![start_with(&format!("  admin_token: {TOKEN}\n{store}{shared}"), &domains_failing(true, "local"))]
        })
        .collect();
    let even = |_: usize, _: Duration| LIMIT / WINDOW_S;
    let phase = Duration::from_secs(2 * WINDOW_S);
    // two windows with every store up: each region beats twice, and knows the three
    let mut all = drive(&mut regions, phase, even, None).await.windows;
    locals[0].kill();
    let cut = drive(&mut regions, phase, even, None).await.windows;
    global.kill();
    let alone = drive(&mut regions, phase, even, None).await.windows;
    eprintln!("eu's store down: {cut:?}; the global store down too: {alone:?}");
    let log = || regions.iter().flatten().map(|s| s.log()).collect::<Vec<_>>().join("\n");
    for (end, by) in whole(&cut).iter().map(|(end, _)| (end, cut[end])) {
        assert!(by[0] > 0, "window ending at {end}: eu admitted nothing on the global store: {cut:?}\n{}", log());
    }
    for (end, by) in whole(&alone).iter().map(|(end, _)| (end, alone[end])) {
        assert!(
            by.iter().all(|&n| n > 0 && n <= LIMIT / 3),
            "window ending at {end}: {by:?}, each its share\n{}",
            log()
        );
    }
    for (end, by) in cut.iter().chain(&alone) {
        let w = all.entry(*end).or_default();
        (0..3).for_each(|r| w[r] += by[r]);
    }
    for (end, by) in &all {
        let total: u64 = by.iter().sum();
        assert!(total <= LIMIT, "window ending at {end}: {by:?}, {total} over {LIMIT}\n{}", log());
    }
    let scrape = common::metrics(&reqwest::Client::new(), &regions[0][0].base).await;
    assert!(common::series(&scrape, "sluice_region_decided_globally_total{region=\"eu\"}") > 0.0, "{scrape}");
    // the global store's failures under its own label, apart from eu's own redis
    let failed = |store: &str| {
        ["unavailable", "timeout", "circuit_open"]
            .iter()
            .map(|kind| {
                common::series(&scrape, &format!("sluice_store_errors_total{{store=\"{store}\",kind=\"{kind}\"}}"))
            })
            .sum::<f64>()
    };
    assert!(failed("global") > 0.0 && failed("redis") > 0.0, "{scrape}");
}

/// Overrides across regions: with a `global_store` they live there, one set for every
/// region. An override set through eu's admin API is in force in us within about a
/// second (its answers name the new limit, its admin API lists it), and the fleet, asked
/// four times the overridden limit from both regions, admits at most it in every window.
/// Before, it lived in eu's own store: us kept the configured limit, and the fleet
/// admitted up to the larger of the two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_set_in_one_region_holds_in_every_region() {
    let _alone = alone().await;
    let global = RedisServer::start();
    let locals: Vec<RedisServer> = (0..2).map(|_| RedisServer::start()).collect();
    let names = ["eu", "us"];
    let mut regions: Vec<Vec<Sluice>> = (0..2)
        .map(|r| {
            let store = format!("store: {{kind: redis, url: \"{}\"}}\n", locals[r].url());
            vec![instance(names[r], &store, &global.addr().to_string(), true)]
        })
        .collect();
    let c = reqwest::Client::new();
    let body = serde_json::json!({"domain": "api", "entries": [{"key": "tenant", "value": "t1"}],
        "limit": LIMIT / 4, "reason": "ticket 4711"});
    let put = c.put(format!("{}/v1/overrides/t1", regions[0][0].base)).bearer_auth(TOKEN).json(&body);
    let r = put.send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let listed = c.get(format!("{}/v1/overrides/t1", regions[1][0].base)).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(listed.status(), 200, "us lists the override set in eu");
    let r = hit(&c, &regions[1][0].base, "api", &[("tenant", "t1")]).await;
    assert_eq!(common::header(&r, "x-ratelimit-limit"), (LIMIT / 4).to_string(), "us applies eu's override");
    let run = drive(&mut regions, Duration::from_secs(3 * WINDOW_S), |_, _| LIMIT / 2 / WINDOW_S, None).await;
    for (end, by) in &run.windows {
        let total: u64 = by.iter().sum();
        assert!(total <= LIMIT / 4, "window ending at {end}: {by:?}, over the overridden {}", LIMIT / 4);
    }
    let whole = whole(&run.windows);
    assert!(whole.iter().all(|(_, n)| *n * 100 >= LIMIT / 4 * 90), "the overridden limit is used: {:?}", run.windows);
}

/// `global: true` without `region` and `global_store` is refused at the line that says
/// it, by `config check` and `serve` alike; each of the two without the other, a token
/// bucket made global and a memcached store are refused too; a global window of 1 s is
/// loaded with a warning that says how long one should be.
#[test]
fn a_global_limit_needs_its_regions_and_says_so() {
    let rule = |limit: &str| {
        format!(
            "domains:\n  - domain: api\n    descriptors:\n      - key: tenant\n        policies:\n          - name: tenant\n            {limit}\n"
        )
    };
    let window = "fixed_window: {limit: 10, window: 1m, global: true}";
    let global = "global_store: {kind: redis, url: \"redis://127.0.0.1:1\"}\n";
    for (config, says, line) in [
        (rule(window), "needs `region`", 7),
        (format!("region: eu\n{}", rule(window)), "needs `region`", 8),
        (format!("region: eu\n{}", rule("fixed_window: {limit: 10, window: 1m}")), "without `global_store`", 1),
        (format!("{global}{}", rule("fixed_window: {limit: 10, window: 1m}")), "without `region`", 1),
        (
            format!("region: eu\n{global}{}", rule("token_bucket: {rate: 1, per: 1s, burst: 5, global: true}")),
            "not a token_bucket",
            8,
        ),
        (
            format!("region: eu\n{global}store: {{kind: memcached, servers: [\"127.0.0.1:1\"]}}\n{}", rule(window)),
            "regional pools",
            3,
        ),
    ] {
        let dir = sluice_testkit::TempDir::new("sluice-global");
        let file = dir.path().join("sluice.yaml");
        std::fs::write(&file, &config).unwrap();
        let check = std::process::Command::new(common::bin()).args(["config", "check"]).arg(&file).output().unwrap();
        let err = String::from_utf8_lossy(&check.stderr);
        assert!(!check.status.success() && err.contains(says), "{config}\n{err}");
        assert!(err.contains(&format!("sluice.yaml:{line}:")), "the place is named: {err}");
        let serve = std::process::Command::new(common::bin()).arg("serve").arg("--config").arg(&file).output().unwrap();
        assert!(!serve.status.success() && String::from_utf8_lossy(&serve.stderr).contains(says), "serve: {config}");
    }
    let dir = sluice_testkit::TempDir::new("sluice-global");
    let file = dir.path().join("sluice.yaml");
    std::fs::write(
        &file,
        format!("region: eu\n{global}{}", rule("fixed_window: {limit: 10, window: 1s, global: true}")),
    )
    .unwrap();
    let check = std::process::Command::new(common::bin()).args(["config", "check"]).arg(&file).output().unwrap();
    let err = String::from_utf8_lossy(&check.stderr);
    assert!(check.status.success(), "{err}");
    assert!(err.contains("warning: global limit 'tenant' has a window of 1000 ms") && err.contains("25"), "{err}");
}

/// `config check --online` contacts the stores a file names and compares its global rules
/// with what the regions running now configure (their beats in the global store): a
/// file that agrees passes and says so, one whose limit differs fails naming the rule and
/// both limits, and a global store that does not answer fails naming it.
#[test]
fn config_check_online_compares_a_file_with_the_running_regions() {
    let (global, local) = (RedisServer::start(), RedisServer::start());
    let store = format!("store: {{kind: redis, url: \"{}\"}}\n", local.url());
    let _eu = instance("eu", &store, &global.addr().to_string(), true);
    let dir = sluice_testkit::TempDir::new("sluice-online");
    let check = |limit: u64, global: &str| {
        let rule = domains(true).replace(&format!("limit: {LIMIT},"), &format!("limit: {limit},"));
        let file = dir.path().join(format!("us-{limit}.yaml"));
        let regions = format!("region: us\nglobal_store: {{kind: redis, url: \"{global}\"}}\n");
        std::fs::write(&file, format!("{store}{regions}domains:\n{rule}")).unwrap();
        let mut command = std::process::Command::new(common::bin());
        let out = command.args(["config", "check", "--online"]).arg(&file).output().unwrap();
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), said)
    };
    // the region's first beat comes within a tick or two of its start
    let deadline = Instant::now() + Duration::from_secs(10);
    let agrees = loop {
        let (ok, said) = check(LIMIT, &global.url());
        if ok && said.contains("as every region running now") || Instant::now() > deadline {
            break (ok, said);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(agrees.0 && agrees.1.contains(&format!("global_store: {} answers", global.url())), "{}", agrees.1);
    assert!(
        agrees.1.contains("global rule 'api/tenant': 200 per 4000 ms, as every region running now"),
        "{}",
        agrees.1
    );
    let (ok, said) = check(2 * LIMIT, &global.url());
    assert!(!ok, "a limit the running regions do not have passed: {said}");
    assert!(
        said.contains("global rule 'api/tenant': 400 per 4000 ms here, the regions running now: 200 per 4000 ms"),
        "{said}"
    );
    assert!(said.contains("us-400.yaml: the regions disagree"), "{said}");
    let (ok, said) = check(LIMIT, "redis://127.0.0.1:1");
    assert!(!ok && said.contains("`global_store` at redis://127.0.0.1:1 does not answer"), "{said}");
}
