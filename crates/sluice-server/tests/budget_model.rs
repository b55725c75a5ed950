//! Token budgets from every front door, against a model of what each client should have
//! left, in real time (#49). Clients run random sequences of reservations (HTTP and
//! Kuadrant's `Reserve`), commits (open, twice, after the hold lapsed; HTTP and
//! Kuadrant's `Commit`), decisions (HTTP and Envoy's `ShouldRateLimit`), status reads
//! (HTTP `GET` and Kuadrant's `CheckRateLimit`), refunds and waits that pass
//! holds' deadlines by 0 to 5 s, spread over two instances of one store (one instance on
//! the memory store); twice a run every client stops while the rule's clients have their
//! limit overridden, then the override removed. Every answer is compared with the model: the window's committed
//! units, the holds open, the limit in force (overrides), and each instance's near-cache
//! (a refusal with no hold open is kept there until the window's end, and let go by a
//! refund, a commit or an override change through that instance: docs/configuration.md).
//!
//! Kinds of client: one on the rule's own limit (and its overrides), one whose requests
//! carry their own `limit`, one whose reservations name their descriptor twice.
//!
//! The clock is real, and a hold's deadline is known only between the reservation's
//! sending and its answer: a step that runs within 300 ms of a deadline is not judged
//! (the model follows what the server answered); every other step is.

mod common;
#[path = "common/kuadrant.rs"]
mod kuadrant;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor, rate_limit_descriptor::Entry, rate_limit_descriptor::RateLimitOverride,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt64Value};
use kuadrant::{CommitRequest, CommitResponse, ReserveRequest, ReserveResponse};
use serde_json::{Value, json};
use sluice_testkit::{RedisCluster, RedisServer};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKEN: &str = "budget-model-admin-token-0123";

/// The rule's limit per `user`, and the limit requests of the second kind carry.
const RULE: u64 = 100;
const OWN: u64 = 40;

const DOMAINS: &str = "  - domain: llm\n    descriptors:\n      - key: user\n        rate_limit: {name: budget, unit: hour, requests_per_unit: 100}\n";

/// A step's answer is judged only this far from every hold's deadline.
const MARGIN: Duration = Duration::from_millis(300);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// The rule's limit, overridden now and then.
    Rule,
    /// Each request carries `limit: {requests_per_unit: OWN, unit: hour}`.
    Own,
    /// Reservations name the descriptor twice: one window holds both.
    Twice,
}

struct Hold {
    id: String,
    units: u64,
    /// When the deadline falls: after `from` and before `to`.
    from: Instant,
    to: Instant,
}

/// What one client should have left.
struct Model {
    kind: Kind,
    user: String,
    limit: u64,
    committed: u64,
    open: Vec<Hold>,
    /// Committed once (a second commit is `again`), or released (a late commit reports).
    committed_ids: Vec<String>,
    lapsed: Vec<(String, u64)>,
    /// Each instance's near-cache: the least cost it refuses from memory.
    cached: Vec<Option<u64>>,
    judged: usize,
}

impl Model {
    fn held(&self) -> u64 {
        self.open.iter().map(|h| h.units).sum()
    }

    fn used(&self) -> u64 {
        self.committed + self.held()
    }

    fn left(&self) -> u64 {
        self.limit.saturating_sub(self.used())
    }

    /// Holds certainly past their deadline by `now` are released.
    fn lapse(&mut self, now: Instant) {
        let (gone, open): (Vec<Hold>, Vec<Hold>) =
            std::mem::take(&mut self.open).into_iter().partition(|h| h.to <= now);
        self.open = open;
        self.lapsed.extend(gone.into_iter().map(|h| (h.id, h.units)));
    }

    /// Whether a step sent at `sent` and answered at `got` could have met a deadline.
    fn near_deadline(&self, sent: Instant, got: Instant) -> bool {
        self.open.iter().any(|h| sent < h.to + MARGIN && got + MARGIN > h.from)
    }

    /// Releases the holds past their deadline by more than the margin (a wait at the
    /// override barrier can outlast one: judged as open, such a hold failed the run on a
    /// busy machine), then sleeps past every deadline within the margin of now.
    async fn clear_of_deadlines(&mut self) {
        loop {
            let now = Instant::now();
            if let Some(clear) = now.checked_sub(MARGIN) {
                self.lapse(clear);
            }
            match self.open.iter().filter(|h| now + MARGIN > h.from && now < h.to + MARGIN).map(|h| h.to).max() {
                Some(to) => tokio::time::sleep(to + MARGIN - now).await,
                None => break,
            }
        }
    }
}

/// One instance's doors.
#[derive(Clone)]
struct Door {
    base: String,
    grpc: String,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

fn descriptor(m: &Model) -> Value {
    let mut d = json!({"entries": [{"key": "user", "value": m.user}]});
    if m.kind == Kind::Own {
        d["limit"] = json!({"requests_per_unit": OWN, "unit": "hour"});
    }
    d
}

fn envoy_request(m: &Model, hits: u64) -> RateLimitRequest {
    let limit = (m.kind == Kind::Own).then_some(RateLimitOverride { requests_per_unit: OWN as u32, unit: 3 });
    let entries = vec![Entry { key: "user".into(), value: m.user.clone() }];
    let d = RateLimitDescriptor { entries, limit, ..Default::default() };
    RateLimitRequest { domain: "llm".into(), descriptors: vec![d], hits_addend: hits as u32 }
}

async fn grpc<Q, A>(grpc: &str, service: &str, method: &str, q: Q) -> A
where
    Q: prost::Message + Send + Sync + 'static,
    A: prost::Message + Default + Send + Sync + 'static,
{
    let channel = kuadrant::channel(grpc).await;
    let mut client = tonic::client::Grpc::new(channel);
    client.ready().await.unwrap();
    let path = format!("/{service}/{method}").parse().unwrap();
    let codec = tonic_prost::ProstCodec::<Q, A>::default();
    client.unary(tonic::Request::new(q), path, codec).await.unwrap_or_else(|e| panic!("{method}: {e:?}")).into_inner()
}

const KUADRANT: &str = "kuadrant.service.ratelimit.v1.RateLimitService";
const ENVOY: &str = "envoy.service.ratelimit.v3.RateLimitService";
const OK: i32 = 1;

/// Runs one client's random sequence of `steps` against `doors`, checking each answer.
async fn client(
    doors: Vec<Door>,
    barrier: Arc<tokio::sync::Barrier>,
    (kind, user, seed): (Kind, String, u64),
    steps: usize,
) -> Model {
    let http = reqwest::Client::new();
    let mut rng = Rng(seed | 1);
    let mut m = Model {
        kind,
        user,
        limit: if kind == Kind::Own { OWN } else { RULE },
        committed: 0,
        open: Vec::new(),
        committed_ids: Vec::new(),
        lapsed: Vec::new(),
        cached: vec![None; doors.len()],
        judged: 0,
    };
    let mut overridden = false;
    for step in 0..steps {
        if step > 0 && step % (steps / 3) == 0 {
            // every client at once: the rule's clients have their limit overridden (or
            // the override removed); an override change lets go of every near-cache entry
            // of every client, on every instance within a second
            barrier.wait().await;
            if m.kind == Kind::Rule {
                let id = format!("model-{}", m.user);
                let door = &doors[rng.next(doors.len() as u64) as usize];
                let r = if overridden {
                    m.limit = RULE;
                    http.delete(format!("{}/v1/overrides/{id}", door.base)).bearer_auth(TOKEN).send().await
                } else {
                    m.limit = 60 + rng.next(80);
                    let entries = [json!({"key": "user", "value": m.user})];
                    let body = json!({"domain": "llm", "entries": entries, "limit": m.limit, "reason": "model"});
                    http.put(format!("{}/v1/overrides/{id}", door.base)).bearer_auth(TOKEN).json(&body).send().await
                };
                let r = r.unwrap();
                assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
                overridden = !overridden;
            }
            barrier.wait().await;
            tokio::time::sleep(Duration::from_millis(1_300)).await;
            m.cached.iter_mut().for_each(|c| *c = None);
        }
        m.clear_of_deadlines().await;
        let i = rng.next(doors.len() as u64) as usize;
        let door = &doors[i];
        let via_grpc = rng.next(2) == 1;
        let what = rng.next(24);
        let at = format!("{:?} {} step {step} ({what}, door {i}, grpc {via_grpc})", m.kind, m.user);
        let sent = Instant::now();
        match what {
            // reserve
            0..=5 => {
                let units = rng.next(m.limit / 2 + 10);
                let ttl = 500 + rng.next(2_500);
                let twice = m.kind == Kind::Twice;
                let (first, second) = if twice { (units / 3, units - units / 3) } else { (units, 0) };
                let (admitted, id, remaining) = if via_grpc {
                    let mut req = envoy_request(&m, units);
                    if twice {
                        req.descriptors[0].hits_addend = Some(UInt64Value { value: first });
                        let mut d2 = req.descriptors[0].clone();
                        d2.hits_addend = Some(UInt64Value { value: second });
                        req.descriptors.push(d2);
                    }
                    let ttl =
                        Some(PbDuration { seconds: (ttl / 1_000) as i64, nanos: (ttl % 1_000) as i32 * 1_000_000 });
                    let r: ReserveResponse =
                        grpc(&door.grpc, KUADRANT, "Reserve", ReserveRequest { request: Some(req), ttl }).await;
                    let resp = r.response.unwrap();
                    let remaining = resp.statuses[0].limit_remaining as u64;
                    (resp.overall_code == OK, r.reservation_id, remaining)
                } else {
                    let mut ds = vec![descriptor(&m)];
                    if twice {
                        ds[0]["hits_addend"] = json!(first);
                        let mut d2 = ds[0].clone();
                        d2["hits_addend"] = json!(second);
                        ds.push(d2);
                    }
                    let body = json!({"domain": "llm", "descriptors": ds, "amount": units, "ttl": format!("{ttl}ms")});
                    let r = http.post(format!("{}/v1/reservations", door.base)).json(&body).send().await.unwrap();
                    let code = r.status().as_u16();
                    let v: Value = r.json().await.unwrap();
                    assert!(code == 200 || code == 429, "{at}: {code} {v}");
                    let id = v["reservation_id"].as_str().unwrap_or_default().to_string();
                    (code == 200, id, v["statuses"][0]["limit_remaining"].as_u64().unwrap_or(0))
                };
                let got = Instant::now();
                let fits = m.used() + units <= m.limit;
                if !m.near_deadline(sent, got) {
                    m.judged += 1;
                    assert_eq!(admitted, fits, "{at}: reserve {units} with {} used of {}", m.used(), m.limit);
                    let left = if admitted { m.left() - units } else { m.left() };
                    let holds: Vec<String> = m
                        .open
                        .iter()
                        .map(|h| format!("{} units due in {:?}..{:?}", h.units, h.from - sent, h.to - sent))
                        .collect();
                    assert_eq!(
                        remaining, left,
                        "{at}: what is left after reserving {units} (admitted {admitted}; {} committed of {}, holds \
                         open as the model has them, from this step's sending: {holds:?})",
                        m.committed, m.limit
                    );
                }
                if admitted && units == 0 {
                    // a reservation of nothing holds nothing: its commit is a report
                    m.lapsed.push((id, 0));
                } else if admitted {
                    let ttl = Duration::from_millis(ttl);
                    m.open.push(Hold { id, units, from: sent + ttl, to: got + ttl });
                }
            }
            // commit: an open hold, one settled, one lapsed
            6..=10 => {
                let pick = rng.next(3);
                let (id, expect) = match pick {
                    0 if !m.open.is_empty() => {
                        let h = &m.open[rng.next(m.open.len() as u64) as usize];
                        (h.id.clone(), "committed")
                    }
                    1 if !m.committed_ids.is_empty() => {
                        (m.committed_ids[rng.next(m.committed_ids.len() as u64) as usize].clone(), "again")
                    }
                    2 if !m.lapsed.is_empty() => {
                        (m.lapsed[rng.next(m.lapsed.len() as u64) as usize].0.clone(), "reported")
                    }
                    _ => continue,
                };
                let actual = rng.next(m.limit / 2 + 10);
                let (first, second) = (actual / 2, actual - actual / 2);
                let settled: Vec<String> = if via_grpc {
                    let actuals = if m.kind == Kind::Twice { vec![first, second] } else { vec![actual] };
                    let c = CommitRequest { reservation_id: id.clone(), actual: None, actuals };
                    let r: CommitResponse = grpc(&door.grpc, KUADRANT, "Commit", c).await;
                    let word = |s: &i32| ["committed", "reported", "again"][*s as usize].to_string();
                    r.settled.iter().map(word).collect()
                } else {
                    let body = match m.kind {
                        Kind::Twice => json!({"actuals": [first, second]}),
                        _ => json!({"actual": actual}),
                    };
                    let r = http.post(format!("{}/v1/reservations/{id}/commit", door.base)).json(&body).send().await;
                    let v: Value = r.unwrap().json().await.unwrap();
                    let words = v["settled"].as_array().unwrap_or_else(|| panic!("{at}: {v}"));
                    words.iter().map(|w| w.as_str().unwrap().to_string()).collect()
                };
                assert_eq!(settled.len(), 1, "{at}: one window, whatever the descriptors: {settled:?}");
                if !m.near_deadline(sent, Instant::now()) {
                    m.judged += 1;
                    assert_eq!(settled[0], expect, "{at}: commit of a hold that should be {expect}");
                }
                // every commit lets go of its instance's near-cache entries, once again too
                m.cached[i] = None;
                if expect != "again" {
                    m.committed += actual;
                    m.open.retain(|h| h.id != id);
                    m.lapsed.retain(|l| l.0 != id);
                    m.committed_ids.push(id);
                }
            }
            // a decision
            11..=14 => {
                let hits = 1 + rng.next(m.limit / 3 + 5);
                let (allowed, remaining) = if via_grpc {
                    let r: RateLimitResponse =
                        grpc(&door.grpc, ENVOY, "ShouldRateLimit", envoy_request(&m, hits)).await;
                    (r.overall_code == OK, r.statuses[0].limit_remaining as u64)
                } else {
                    let mut d = descriptor(&m);
                    d["hits_addend"] = json!(hits);
                    let body = json!({"domain": "llm", "descriptors": [d]});
                    let r = http.post(format!("{}/v1/ratelimit", door.base)).json(&body).send().await.unwrap();
                    let code = r.status().as_u16();
                    let v: Value = r.json().await.unwrap();
                    (code == 200, v["statuses"][0]["limit_remaining"].as_u64().unwrap_or(0))
                };
                let got = Instant::now();
                let from_cache = m.cached[i].is_some_and(|least| hits >= least);
                let fits = !from_cache && m.used() + hits <= m.limit;
                if !m.near_deadline(sent, got) {
                    m.judged += 1;
                    assert_eq!(
                        allowed,
                        fits,
                        "{at}: {hits} hits with {} committed, {} held of {} (cached {:?})",
                        m.committed,
                        m.held(),
                        m.limit,
                        m.cached[i]
                    );
                    assert_eq!(remaining, if allowed { m.left() - hits } else { 0 }, "{at}: remaining");
                    if !allowed && !from_cache && m.open.is_empty() {
                        // a refusal with no hold open is kept until the window's end
                        m.cached[i] = Some(hits);
                    }
                }
                if allowed {
                    m.committed += hits;
                }
            }
            // a status read: what a request of `cost` would get (1 over HTTP)
            15..=16 => {
                if !via_grpc && m.kind == Kind::Own {
                    continue; // a status read over HTTP carries no limit: the rule's window is another
                }
                let cost = if via_grpc { 1 + rng.next(10) } else { 1 };
                let (over, remaining) = if via_grpc {
                    let r: RateLimitResponse =
                        grpc(&door.grpc, KUADRANT, "CheckRateLimit", envoy_request(&m, cost)).await;
                    (r.overall_code != OK, r.statuses[0].limit_remaining as u64)
                } else {
                    let url = format!("{}/v1/ratelimit?domain=llm&user={}", door.base, m.user);
                    let v: Value = http.get(url).send().await.unwrap().json().await.unwrap();
                    (v["overall_code"] != "OK", v["statuses"][0]["limit_remaining"].as_u64().unwrap())
                };
                if !m.near_deadline(sent, Instant::now()) {
                    m.judged += 1;
                    assert_eq!(remaining, m.left(), "{at}: status, {} committed {} held", m.committed, m.held());
                    assert_eq!(over, m.left() < cost, "{at}: a status read for {cost} with {} left", m.left());
                }
            }
            // a refund of what was committed
            17 if m.committed > 0 => {
                let k = 1 + rng.next(m.committed.min(20));
                let mut d = descriptor(&m);
                d["hits_addend"] = json!(k);
                let body = json!({"domain": "llm", "descriptors": [d]});
                let r = http.post(format!("{}/v1/refund", door.base)).json(&body).send().await.unwrap();
                assert_eq!(r.status(), 200, "{at}: {}", r.text().await.unwrap());
                m.committed -= k;
                m.cached[i] = None;
            }
            // a wait, past deadlines by up to 5 s
            _ => {
                let wait = [0, 300, 1_500, 2_500, 5_000][rng.next(5) as usize];
                tokio::time::sleep(Duration::from_millis(wait)).await;
            }
        }
        m.lapse(Instant::now());
    }
    m
}

/// Four clients of each kind at once on `doors`; fails with the instances' logs.
async fn run(doors: Vec<Door>, logs: impl Fn() -> String) {
    let seed = std::env::var("BUDGET_MODEL_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(2026u64);
    let run = format!("{seed:x}{}", std::process::id());
    let kinds = [Kind::Rule, Kind::Own, Kind::Twice, Kind::Rule];
    let barrier = Arc::new(tokio::sync::Barrier::new(kinds.len()));
    let mut tasks = tokio::task::JoinSet::new();
    for (n, kind) in kinds.into_iter().enumerate() {
        let who = (kind, format!("u{n}-{run}"), seed.wrapping_mul(31).wrapping_add(n as u64));
        tasks.spawn(client(doors.clone(), barrier.clone(), who, 60));
    }
    let mut judged = 0;
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(m) => judged += m.judged,
            Err(e) => {
                // the others would wait at the barrier for it
                tasks.abort_all();
                panic!("{e}\nlogs:\n{}", logs());
            }
        }
    }
    assert!(judged >= 100, "only {judged} answers judged: the run waited on deadlines all along");
    eprintln!("budget model: {judged} answers judged against the model");
}

fn sections(store: &str) -> String {
    format!("  admin_token: {TOKEN}\n{store}")
}

async fn two_instances(store: &str) {
    let a = common::start_with(&sections(store), DOMAINS);
    let b = common::start_with(&sections(store), DOMAINS);
    let doors =
        vec![Door { base: a.base.clone(), grpc: a.grpc.clone() }, Door { base: b.base.clone(), grpc: b.grpc.clone() }];
    run(doors, || format!("{}\n---\n{}", a.log(), b.log())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budgets_follow_the_model_on_memory() {
    let s = common::start_with(&sections(""), DOMAINS);
    run(vec![Door { base: s.base.clone(), grpc: s.grpc.clone() }], || s.log()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budgets_follow_the_model_on_one_redis() {
    let _heavy = common::heavy().await;
    let redis = RedisServer::start();
    two_instances(&format!("store:\n  kind: redis\n  url: \"{}\"\n", redis.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budgets_follow_the_model_on_a_redis_cluster() {
    let _heavy = common::heavy().await;
    let cluster = RedisCluster::start();
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    two_instances(&format!("store:\n  kind: redis_cluster\n  nodes: [{}]\n", nodes.join(", "))).await;
}
