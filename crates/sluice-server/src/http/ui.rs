//! The live page (`server.ui: true`): `GET /ui`, one HTML file embedded in the binary
//! (no CDN: it works air-gapped), which polls `GET /v1/admin/overview` every two seconds.
//! Both sit behind the admin token, as `Authorization: Bearer <token>` or, so a browser
//! can ask for it, HTTP Basic with the token as the password.
//!
//! What it shows comes from the history of the metrics the server keeps
//! (`state/history.rs`: five minutes of readings, each of bounded size), from which the
//! overview computes rates per second.

use crate::app::AppState;
use crate::app::history::Sample;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// The rules the overview shows: the most decided over the samples kept.
const RULES_SHOWN: usize = 50;

/// The page.
const PAGE: &str = include_str!("ui.html");

/// `GET /ui`.
pub async fn page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8"), (header::CACHE_CONTROL, "no-store")], PAGE).into_response()
}

/// This instance, as the region card names it: its host (a pod's name) and process.
fn instance() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty());
    format!("{} (pid {})", host.as_deref().unwrap_or("?"), std::process::id())
}

/// Overrides the overview lists at most (by id); `overrides_held` counts them all.
const OVERRIDES_SHOWN: usize = 100;

/// `GET /v1/admin/overview`: what the page shows, documented in docs/operations.md.
pub async fn overview(State(state): State<Arc<AppState>>) -> Response {
    let Some(history) = &state.ui else {
        return super::error::error(axum::http::StatusCode::NOT_FOUND, "ui_off", "server.ui is off".into());
    };
    let samples = history.samples();
    let engine = state.engine.load();
    let mut body = rates(&samples);
    // one limit across regions: the pools as this instance's allocator last read them
    if let Some(regions) = engine.limiter.regions() {
        body["region"] = json!(regions.view());
        body["region"]["instance"] = json!(instance());
    }
    body["store"] = store(&samples, engine.limiter.store().kind());
    body["top_refused"] = top_refused(&engine.limiter);
    // the first of them: the page is polled every 2 s, and there may be 200,000
    let overrides = engine.limiter.overrides().list(None);
    body["overrides_held"] = json!(overrides.len());
    body["overrides"] = json!(&overrides[..overrides.len().min(OVERRIDES_SHOWN)]);
    // at most one line a policy: bounded by the rules
    let held = engine.limiter.issued().held(engine.limiter.now());
    let held: Vec<Value> =
        held.iter().map(|(d, p, n, u)| json!({"domain": d, "policy": p, "open": n, "held_units": u})).collect();
    body["reservations"] = Value::Array(held);
    axum::Json(body).into_response()
}

/// Per domain and rule (of those kept by name): allowed and refused a second over the
/// samples kept, and the totals; over every rule, allowed and refused a second;
/// requests decided without the store a second (refused, 503, admitted by failing
/// open, or decided on local counts), and shed a second per priority class.
fn rates(samples: &VecDeque<Sample>) -> Value {
    let pairs: Vec<(&Sample, &Sample)> = samples.iter().zip(samples.iter().skip(1)).collect();
    let seconds: Vec<f64> =
        pairs.iter().map(|(a, b)| (b.at_ms.saturating_sub(a.at_ms) as f64 / 1000.0).max(0.001)).collect();
    // the per-second rate of one figure of the samples along them
    let rate = |of: &dyn Fn(&Sample) -> f64| -> Vec<f64> {
        pairs.iter().zip(&seconds).map(|((a, b), s)| (of(b) - of(a)).max(0.0) / s).collect()
    };
    let total = |v: &Vec<f64>| v.iter().zip(&seconds).map(|(r, s)| r * s).sum::<f64>().round();
    let last = samples.back().map(|s| s.rules.keys().cloned().collect::<Vec<_>>()).unwrap_or_default();
    let mut rules: Vec<(f64, Value)> = last
        .iter()
        .map(|key| {
            // a rule missing from a sample that kept every rule with decisions had none;
            // from one that left some out, its count then is not known: no rate
            let pair_rate = |pick: fn(&(f64, f64)) -> f64| -> Vec<f64> {
                let count = |s: &Sample| s.rules.get(key).map(pick).or((!s.rules_full).then_some(0.0));
                pairs
                    .iter()
                    .zip(&seconds)
                    .map(|((a, b), s)| match (count(a), count(b)) {
                        (Some(x), Some(y)) => (y - x).max(0.0) / s,
                        _ => 0.0,
                    })
                    .collect()
            };
            (key, pair_rate(|c| c.0), pair_rate(|c| c.1))
        })
        .filter(|(_, a, r)| total(a) + total(r) > 0.0)
        .map(|((domain, rule), allowed, refused)| {
            let (a, r) = (total(&allowed), total(&refused));
            (
                a + r,
                json!({"domain": domain, "rule": rule, "allowed_per_s": allowed, "refused_per_s": refused,
                           "allowed": a as u64, "refused": r as u64}),
            )
        })
        .collect();
    rules.sort_by(|a, b| b.0.total_cmp(&a.0));
    let rules: Vec<Value> = rules.into_iter().take(RULES_SHOWN).map(|(_, v)| v).collect();
    let classes: Vec<String> = samples.back().map(|s| s.shed.keys().cloned().collect()).unwrap_or_default();
    let shed: BTreeMap<String, Vec<f64>> = classes
        .into_iter()
        .map(|c| {
            let r = rate(&|s: &Sample| s.shed.get(&c).copied().unwrap_or(0.0));
            (c, r)
        })
        .collect();
    let (allowed, refused) = (rate(&|s| s.allowed), rate(&|s| s.refused));
    json!({"seconds": seconds.iter().sum::<f64>().round(), "rules": rules,
           "allowed": total(&allowed) as u64, "refused": total(&refused) as u64,
           "allowed_per_s": allowed, "refused_per_s": refused,
           "unavailable_per_s": rate(&|s| s.unavailable), "fail_open_per_s": rate(&|s| s.fail_open),
           "local_per_s": rate(&|s| s.local),
           "shed_per_s_by_class": shed})
}

/// The store's health: its kind, apply latency over the last minute (p50, p99), the
/// breaker, a migration's percentage, the shedder's amount, the adaptive stage's limit
/// and requests in flight.
fn store(samples: &VecDeque<Sample>, kind: &str) -> Value {
    let Some(last) = samples.back() else { return json!({"kind": kind}) };
    // the newest sample a minute older than the last, else the oldest
    let first = samples.iter().rev().find(|s| s.at_ms + 60_000 <= last.at_ms).or(samples.front()).unwrap_or(last);
    // the apply histogram's buckets over the last minute: (upper bound, count below)
    let buckets: Vec<(f64, f64)> = last
        .apply
        .iter()
        .map(|(le, c)| (*le, c - first.apply.iter().find(|(b, _)| b == le).map_or(0.0, |(_, c)| *c)))
        .collect();
    let quantile = |q: f64| {
        let n = buckets.last()?.1;
        (n > 0.0).then(|| buckets.iter().find(|(_, c)| *c >= q * n).map(|(le, _)| le * 1000.0))?
    };
    let breaker = last.breaker.map(|b| ["closed", "open", "half_open"][(b as usize).min(2)]);
    json!({"kind": kind, "p50_ms": quantile(0.5), "p99_ms": quantile(0.99), "breaker": breaker,
           "migration_percent": last.migration, "shed_amount": last.shed_amount,
           "adaptive_limit": last.adaptive_limit, "adaptive_in_flight": last.adaptive_in_flight})
}

/// The most refused clients (five each) of the [`RULES_SHOWN`] rules whose top client
/// is refused most, when the top lists are on.
fn top_refused(limiter: &sluice::Limiter) -> Value {
    let mut out = Vec::new();
    for domain in limiter.rules().domain_names() {
        for t in limiter.top_clients(domain, None, true, 5).unwrap_or_default() {
            if t.clients.is_empty() {
                continue;
            }
            let clients: Vec<Value> = t.clients.iter().map(|c| json!({"client": c.client, "count": c.count})).collect();
            out.push((t.clients[0].count, json!({"domain": domain, "rule": t.rule, "clients": clients})));
        }
    }
    out.sort_by_key(|b| std::cmp::Reverse(b.0));
    Value::Array(out.into_iter().take(RULES_SHOWN).map(|(_, v)| v).collect())
}
