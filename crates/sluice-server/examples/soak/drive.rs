//! The clients: tasks sending decisions, leases and reservations to the instances that
//! are up, over HTTP and gRPC, to a few hot clients and a long tail; every answer logged
//! with when it was sent and answered.

use crate::Rng;
use crate::check::{Clock, Decision, Lease, Reserved, Rule, Seen};
use crate::fleet::{Endpoint, Fleet};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor::Entry};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Client tasks.
const TASKS: u64 = 24;

/// What the clients saw, shared.
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<Seen>>);

impl Log {
    pub fn take(&self) -> Seen {
        std::mem::take(&mut *self.0.lock().unwrap())
    }

    fn with(&self, f: impl FnOnce(&mut Seen)) {
        f(&mut self.0.lock().unwrap())
    }
}

pub fn spawn(
    fleet: Arc<Fleet>,
    log: Log,
    stop: Arc<AtomicBool>,
    rng: Rng,
    clock: Clock,
) -> Vec<tokio::task::JoinHandle<()>> {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap();
    (0..TASKS)
        .map(|i| {
            let c = Client {
                fleet: fleet.clone(),
                log: log.clone(),
                http: http.clone(),
                clock,
                rng: Rng(rng.0 ^ (i + 1).wrapping_mul(0x2545_f491_4f6c_dd1d)),
            };
            let stop = stop.clone();
            tokio::spawn(async move { c.run(stop).await })
        })
        .collect()
}

struct Client {
    fleet: Arc<Fleet>,
    log: Log,
    http: reqwest::Client,
    clock: Clock,
    rng: Rng,
}

/// A descriptor's JSON: `key` = `client`.
fn body(key: &str, client: u32) -> Value {
    json!({"domain": "soak", "descriptors": [{"entries": [{"key": key, "value": format!("c{client}")}]}]})
}

impl Client {
    async fn run(mut self, stop: Arc<AtomicBool>) {
        while !stop.load(Ordering::Relaxed) {
            // a pause between calls: the load stays below what two cores serve with room
            // (at 5 to 25 ms, the optimized test build drew 620 calls a second over three
            // regions, every core busy, and one answer came 2 ms past its bound)
            tokio::time::sleep(Duration::from_millis(self.rng.between(10, 30))).await;
            // a few hot clients take most of the traffic; a long tail the rest
            let client = if self.rng.below(10) < 6 { self.rng.below(4) } else { 4 + self.rng.below(100) } as u32;
            let Some((instance, at)) = self.pick(client) else { continue };
            // with regions, a quarter of the calls are for the limit they share
            let global = self.fleet.regions() > 0 && self.rng.below(4) == 0;
            let answered = match self.rng.below(100) {
                _ if global => self.decide_global(client).await,
                0..30 => self.decide(Rule::Fw, client, instance, &at).await,
                30..45 => self.decide(Rule::Tb, client, instance, &at).await,
                45..60 => self.decide(Rule::Sw, client, instance, &at).await,
                60..80 => self.decide(Rule::Gr, client, instance, &at).await,
                80..90 => self.lease(client, &at).await,
                _ => self.reserve(client, &at).await,
            };
            if answered.is_none() {
                self.log.with(|s| s.unanswered += 1);
            }
        }
    }

    /// A running instance for `client`'s own limits, at random: with regions, one of its
    /// home region's (a limit not shared across regions counts in each region apart, so
    /// each client keeps to one region and the checks stay fleet-wide).
    fn pick(&mut self, client: u32) -> Option<(u8, Arc<Endpoint>)> {
        let home = (self.fleet.regions() > 0).then(|| client as usize % self.fleet.regions());
        self.pick_in(home, false)
    }

    /// A running instance of `region` (or of any region when it has none up and
    /// `anywhere`), at random.
    fn pick_in(&mut self, region: Option<usize>, anywhere: bool) -> Option<(u8, Arc<Endpoint>)> {
        let up: Vec<(usize, Arc<Endpoint>)> = {
            let eps = self.fleet.endpoints.read().unwrap();
            eps.iter().enumerate().filter_map(|(i, e)| Some((i, e.clone()?))).collect()
        };
        let there: Vec<&(usize, Arc<Endpoint>)> =
            up.iter().filter(|(i, _)| region.is_none_or(|r| self.fleet.region_of(*i) == r)).collect();
        let from = if there.is_empty() && anywhere { up.iter().collect() } else { there };
        let (i, e) = from.get(self.rng.below(from.len() as u64) as usize)?;
        Some((*i as u8, e.clone()))
    }

    /// A decision of the limit the regions share, 80% of them in the hot region.
    async fn decide_global(&mut self, client: u32) -> Option<()> {
        let hot = self.fleet.hot.load(Ordering::Relaxed);
        let region = (self.rng.below(10) < 8).then_some(hot);
        let Some((instance, at)) = self.pick_in(region, true) else { return Some(()) };
        self.decide(Rule::Gl, client, instance, &at).await
    }

    /// One decision of `rule` for `client`, over HTTP or gRPC (half and half).
    async fn decide(&mut self, rule: Rule, client: u32, instance: u8, at: &Endpoint) -> Option<()> {
        let sent = self.clock.ms();
        let mut d = match self.rng.below(2) {
            0 => self.over_http(rule, client, at).await?,
            _ => self.over_grpc(rule, client, at, sent).await?,
        };
        (d.sent, d.answered, d.instance) = (sent, self.clock.ms(), instance);
        self.log.with(|s| s.decisions.push(d));
        Some(())
    }

    async fn over_http(&mut self, rule: Rule, client: u32, at: &Endpoint) -> Option<Decision> {
        let r =
            self.http.post(format!("{}/v1/ratelimit", at.http)).json(&body(rule.key(), client)).send().await.ok()?;
        let v: Value = r.json().await.ok()?;
        let p = &v["statuses"][0]["policies"][0];
        let degraded = degraded(&v);
        Some(Decision {
            rule,
            client,
            instance: 0,
            grpc: false,
            sent: 0,
            answered: 0,
            allowed: v["overall_code"] == "OK",
            limit: p["limit"].as_u64().unwrap_or(0),
            used: p["used"].as_u64().unwrap_or(0),
            remaining: p["remaining"].as_u64().unwrap_or(0),
            reset: p["reset_at_ms"].as_u64().unwrap_or(0),
            exact_reset: true,
            degraded,
        })
    }

    async fn over_grpc(&mut self, rule: Rule, client: u32, at: &Endpoint, sent: u64) -> Option<Decision> {
        let entries = vec![Entry { key: rule.key().into(), value: format!("c{client}") }];
        let descriptors = vec![RateLimitDescriptor { entries, ..Default::default() }];
        let req = RateLimitRequest { domain: "soak".into(), descriptors, hits_addend: 0 };
        let r = RateLimitServiceClient::new(at.grpc.clone()).should_rate_limit(req).await.ok()?.into_inner();
        let s = r.statuses.first()?;
        let limit = s.current_limit.as_ref().map_or(0, |l| u64::from(l.requests_per_unit));
        let until =
            s.duration_until_reset.as_ref().map_or(0, |d| d.seconds as u64 * 1_000 + d.nanos as u64 / 1_000_000);
        let degraded = r.response_headers_to_add.iter().any(|h| h.key == "x-sluice-degraded");
        let remaining = u64::from(s.limit_remaining);
        Some(Decision {
            rule,
            client,
            instance: 0,
            grpc: true,
            sent,
            answered: 0,
            allowed: r.overall_code == 1,
            limit,
            used: limit.saturating_sub(remaining),
            remaining,
            // between the call's sending and its answer: the window's end within it
            reset: self.clock.epoch_of(sent) + until,
            exact_reset: false,
            degraded,
        })
    }

    /// A lease of the concurrency rule, held 20 to 200 ms, released on any instance.
    async fn lease(&mut self, client: u32, at: &Endpoint) -> Option<()> {
        let r = self.http.post(format!("{}/v1/leases", at.http)).json(&body("cc", client)).send().await.ok()?;
        let v: Value = r.json().await.ok()?;
        let acquired = self.clock.ms();
        let (Some(id), true) = (v["lease_id"].as_str().map(str::to_string), v["overall_code"] == "OK") else {
            return Some(());
        };
        let degraded = v.get("degraded").is_some();
        tokio::time::sleep(Duration::from_millis(self.rng.between(20, 200))).await;
        let released = self.clock.ms();
        let back = self.pick(client).map(|(_, e)| e.http.clone()).unwrap_or_else(|| at.http.clone());
        let _ = self.http.delete(format!("{back}/v1/leases/{id}")).send().await;
        if !degraded {
            self.log.with(|s| s.leases.push(Lease { client, acquired, released }));
        }
        Some(())
    }

    /// A reservation of 10 to 40 units that uses 50% to 100% of it, committed on any
    /// instance 20 to 200 ms later.
    async fn reserve(&mut self, client: u32, at: &Endpoint) -> Option<()> {
        let estimate = self.rng.between(10, 40);
        let actual = estimate * self.rng.between(50, 100) / 100;
        let mut b = body("rv", client);
        b["amount"] = json!(estimate);
        b["ttl"] = json!("10s");
        let r = self.http.post(format!("{}/v1/reservations", at.http)).json(&b).send().await.ok()?;
        let v: Value = r.json().await.ok()?;
        let Some(id) = v["reservation_id"].as_str().map(str::to_string) else { return Some(()) };
        let p = &v["statuses"][0]["policies"][0];
        let (limit, reset) = (p["limit"].as_u64().unwrap_or(0), p["reset_at_ms"].as_u64().unwrap_or(0));
        // a reservation the store did not answer in time is granted by the failure
        // policy, its window unknown; its script may still run once the store wakes
        let degraded = degraded(&v);
        tokio::time::sleep(Duration::from_millis(self.rng.between(20, 200))).await;
        let back = self.pick(client).map(|(_, e)| e.http.clone()).unwrap_or_else(|| at.http.clone());
        let settled =
            self.http.post(format!("{back}/v1/reservations/{id}/commit")).json(&json!({"actual": actual})).send().await;
        let committed = match settled {
            Ok(r) => r.json::<Value>().await.ok().is_some_and(|v| v["settled"][0] == "committed"),
            Err(_) => false,
        };
        self.log
            .with(|s| s.reservations.push(Reserved { client, reset, limit, estimate, actual, committed, degraded }));
        Some(())
    }
}

/// Whether an HTTP answer was decided by the failure policy (the store did not answer):
/// said at the top, or by its first policy's source.
fn degraded(v: &Value) -> bool {
    v.get("degraded").is_some() || v["statuses"][0]["policies"][0]["source"] == "degraded"
}
