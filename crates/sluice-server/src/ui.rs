//! The live page (`server.ui: true`): `GET /ui`, one HTML file embedded in the binary
//! (no CDN: it works air-gapped), which polls `GET /v1/admin/overview` every two seconds.
//! Both sit behind the admin token, as `Authorization: Bearer <token>` or, so a browser
//! can ask for it, HTTP Basic with the token as the password.
//!
//! What it shows comes from the metrics the server already keeps: once a second a task
//! reads them (the Prometheus text `/metrics` renders) and keeps five minutes of
//! samples, from which the overview computes rates per second. Nothing on the decision
//! path changes when the page is on.

use crate::state::AppState;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Samples kept: one a second for five minutes.
const KEPT: usize = 300;

/// The page.
const PAGE: &str = include_str!("ui.html");

/// One reading of the metrics: series (name and labels, as `/metrics` writes them) to
/// value.
struct Sample {
    at_ms: u64,
    values: BTreeMap<String, f64>,
}

/// The last five minutes of samples.
#[derive(Default)]
pub struct History {
    samples: Mutex<VecDeque<Sample>>,
}

impl History {
    fn push(&self, sample: Sample) {
        let mut samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        if samples.len() == KEPT {
            samples.pop_front();
        }
        samples.push_back(sample);
    }
}

/// Samples the metrics every second while the server runs, when the page is on.
pub fn start_sampling(state: &Arc<AppState>) {
    let (Some(history), state) = (state.ui.clone(), state.clone()) else { return };
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let Some(metrics) = &state.metrics else { return };
            let text = metrics.render();
            let at_ms = sluice::time::Clock::now(&sluice::time::SystemClock);
            history.push(Sample { at_ms, values: parse(&text) });
        }
    });
}

/// The samples of Prometheus text: `name{labels} value` lines, comments skipped.
fn parse(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// A series' name and its labels.
fn split(series: &str) -> (&str, BTreeMap<&str, &str>) {
    let (name, rest) = series.split_once('{').unwrap_or((series, "}"));
    let labels = rest
        .trim_end_matches('}')
        .split(',')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k, v.trim_matches('"')))
        .collect();
    (name, labels)
}

/// `GET /ui`.
pub async fn page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8"), (header::CACHE_CONTROL, "no-store")], PAGE).into_response()
}

/// Overrides the overview lists at most (by id); `overrides_held` counts them all.
const OVERRIDES_SHOWN: usize = 100;

/// `GET /v1/admin/overview`: what the page shows, documented in docs/operations.md.
pub async fn overview(State(state): State<Arc<AppState>>) -> Response {
    let Some(history) = &state.ui else {
        return crate::http::error(axum::http::StatusCode::NOT_FOUND, "ui_off", "server.ui is off".into());
    };
    let samples = history.samples.lock().unwrap_or_else(|p| p.into_inner());
    let engine = state.engine.load();
    let mut body = rates(&samples);
    body["store"] = store(&samples, engine.limiter.store().kind());
    body["top_refused"] = top_refused(&engine.limiter);
    // the first of them: the page is polled every 2 s, and there may be 200,000
    let overrides = engine.limiter.overrides().list(None);
    body["overrides_held"] = json!(overrides.len());
    body["overrides"] = json!(&overrides[..overrides.len().min(OVERRIDES_SHOWN)]);
    axum::Json(body).into_response()
}

/// Per domain and rule: allowed and refused a second over the samples kept, and the
/// totals; requests decided without the store a second (refused, 503, or admitted by
/// failing open), and shed a second per priority class.
fn rates(samples: &VecDeque<Sample>) -> Value {
    let seconds: Vec<f64> = samples
        .iter()
        .zip(samples.iter().skip(1))
        .map(|(a, b)| (b.at_ms.saturating_sub(a.at_ms) as f64 / 1000.0).max(0.001))
        .collect();
    // the per-second rate of every series along the samples
    let rate = |series: &str| -> Vec<f64> {
        let value = |s: &Sample| s.values.get(series).copied().unwrap_or(0.0);
        samples.iter().zip(samples.iter().skip(1)).zip(&seconds).map(|((a, b), s)| (value(b) - value(a)) / s).collect()
    };
    let mut rules: BTreeMap<(String, String), (Vec<f64>, Vec<f64>)> = BTreeMap::new();
    let (mut unavailable, mut fail_open) = (vec![0.0; seconds.len()], vec![0.0; seconds.len()]);
    let mut shed: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let last = samples.back().map(|s| s.values.keys().cloned().collect::<Vec<_>>()).unwrap_or_default();
    for series in &last {
        let (name, labels) = split(series);
        let add = |into: &mut Vec<f64>| into.iter_mut().zip(rate(series)).for_each(|(t, r)| *t += r);
        match (name, labels.get("outcome"), labels.get("failure")) {
            ("sluice_decisions_total", Some(outcome), _) => {
                let key = (labels["domain"].to_string(), labels["policy"].to_string());
                let (allowed, refused) =
                    rules.entry(key).or_insert_with(|| (vec![0.0; seconds.len()], vec![0.0; seconds.len()]));
                add(if *outcome == "allowed" { allowed } else { refused });
            }
            ("sluice_degraded_total", _, Some(&"closed")) => add(&mut unavailable),
            ("sluice_degraded_total", _, Some(&"open")) => add(&mut fail_open),
            ("sluice_shed_total", _, _) => {
                let class = labels.get("class").copied().unwrap_or("").to_string();
                add(shed.entry(class).or_insert_with(|| vec![0.0; seconds.len()]))
            }
            _ => {}
        }
    }
    let total = |v: &Vec<f64>| v.iter().zip(&seconds).map(|(r, s)| r * s).sum::<f64>().round();
    let rules: Vec<Value> = rules
        .iter()
        .filter(|(_, (a, r))| total(a) + total(r) > 0.0)
        .map(|((domain, rule), (allowed, refused))| {
            json!({"domain": domain, "rule": rule, "allowed_per_s": allowed, "refused_per_s": refused,
                   "allowed": total(allowed) as u64, "refused": total(refused) as u64})
        })
        .collect();
    json!({"seconds": seconds.iter().sum::<f64>().round(), "rules": rules,
           "unavailable_per_s": unavailable, "fail_open_per_s": fail_open, "shed_per_s_by_class": shed})
}

/// The store's health: its kind, apply latency over the last minute (p50, p99), the
/// breaker, a migration's percentage, the shedder's amount.
fn store(samples: &VecDeque<Sample>, kind: &str) -> Value {
    let (Some(last), Some(first)) = (samples.back(), samples.iter().rev().nth(60).or(samples.front())) else {
        return json!({"kind": kind});
    };
    let gauge = |name: &str| last.values.iter().find(|(s, _)| split(s).0 == name).map(|(_, v)| *v);
    // the apply histogram's buckets over the last minute: (upper bound, count below)
    let mut buckets: Vec<(f64, f64)> = last
        .values
        .iter()
        .filter_map(|(series, v)| {
            let (name, labels) = split(series);
            (name == "sluice_store_call_seconds_bucket" && labels.get("op") == Some(&"apply")).then(|| {
                let le = labels.get("le").and_then(|l| l.parse::<f64>().ok()).unwrap_or(f64::INFINITY);
                (le, v - first.values.get(series).copied().unwrap_or(0.0))
            })
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let quantile = |q: f64| {
        let n = buckets.last()?.1;
        (n > 0.0).then(|| buckets.iter().find(|(_, c)| *c >= q * n).map(|(le, _)| le * 1000.0))?
    };
    let breaker = gauge("sluice_circuit_breaker_state").map(|b| ["closed", "open", "half_open"][(b as usize).min(2)]);
    json!({"kind": kind, "p50_ms": quantile(0.5), "p99_ms": quantile(0.99), "breaker": breaker,
           "migration_percent": gauge("sluice_migration_percent"), "shed_amount": gauge("sluice_shed_amount")})
}

/// Each domain's rules' most refused clients (five each), when the top lists are on.
fn top_refused(limiter: &sluice::Limiter) -> Value {
    let mut out = Vec::new();
    for domain in limiter.rules().domain_names() {
        for t in limiter.top_clients(domain, None, true, 5).unwrap_or_default() {
            if t.clients.is_empty() {
                continue;
            }
            let clients: Vec<Value> = t.clients.iter().map(|c| json!({"client": c.client, "count": c.count})).collect();
            out.push(json!({"domain": domain, "rule": t.rule, "clients": clients}));
        }
    }
    Value::Array(out)
}
