//! The live page (`server.ui: true`): `GET /ui`, one HTML file embedded in the binary
//! (no CDN: it works air-gapped), which polls `GET /v1/admin/overview` every two seconds.
//! Both sit behind the admin token, as `Authorization: Bearer <token>` or, so a browser
//! can ask for it, HTTP Basic with the token as the password.
//!
//! What it shows comes from the metrics the server already keeps: a task renders them
//! (the Prometheus text `/metrics` serves, streamed, never held whole) and folds each
//! reading at once into a [`Sample`] of bounded size: totals over every rule, the rules
//! with decisions (at most [`RULES_KEPT`], the most decided), the store's few figures. Five minutes
//! of samples are kept, from which the overview computes rates per second. So the
//! page's memory is bounded whatever the config holds (300 samples of a few KB), and so
//! is its CPU: a reading is taken once a second, or [`CPU_SHARE`] times the last
//! reading's duration apart when rendering takes longer (100,000 rules). Before, each
//! second's whole reading was kept, parsed, for five minutes: with 10,000 domains an
//! idle server grew 10 MB a second to 3.1 GB. Nothing on the decision path changes
//! when the page is on.

use crate::state::AppState;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long samples are kept.
const KEPT_MS: u64 = 300_000;

/// The most samples kept: one a second for [`KEPT_MS`].
const KEPT: usize = 300;

/// The rules a sample keeps by name: those with any decision, up to this many (the most
/// decided since the start). Every rule counts in the totals.
const RULES_KEPT: usize = 200;

/// The rules the overview shows: the most decided over the samples kept.
pub const RULES_SHOWN: usize = 50;

/// Readings are spaced at least this many times the last one's duration: the page
/// takes at most 1/20 of a core, however large the config.
const CPU_SHARE: u32 = 20;

/// The page.
const PAGE: &str = include_str!("ui.html");

/// One reading of the metrics, folded to what the page shows.
#[derive(Default)]
struct Sample {
    at_ms: u64,
    /// Decisions allowed and refused, summed over every rule (cumulative).
    allowed: f64,
    refused: f64,
    /// Requests decided by the failure policy: refused (fail-closed), admitted.
    unavailable: f64,
    fail_open: f64,
    /// Requests shed, per priority class (a few classes).
    shed: BTreeMap<String, f64>,
    /// The rules with any decision, up to [`RULES_KEPT`] of them (the most decided):
    /// (domain, rule) to (allowed, refused), cumulative.
    rules: BTreeMap<(String, String), (f64, f64)>,
    /// Whether rules with decisions were left out (then a rule missing is not known to
    /// be at 0).
    rules_full: bool,
    /// The store's `apply` call histogram: (upper bound in s, calls at or below it).
    apply: Vec<(f64, f64)>,
    breaker: Option<f64>,
    migration: Option<f64>,
    shed_amount: Option<f64>,
}

/// The last five minutes of samples.
#[derive(Default)]
pub struct History {
    samples: Mutex<VecDeque<Sample>>,
}

impl History {
    fn push(&self, sample: Sample) {
        let mut samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        while samples.len() >= KEPT || samples.front().is_some_and(|f| f.at_ms + KEPT_MS < sample.at_ms) {
            samples.pop_front();
        }
        samples.push_back(sample);
    }
}

/// Samples the metrics while the server runs, when the page is on: once a second, or
/// [`CPU_SHARE`] times the last reading's duration apart.
pub fn start_sampling(state: &Arc<AppState>) {
    let (Some(history), state) = (state.ui.clone(), state.clone()) else { return };
    tokio::spawn(async move {
        loop {
            let reading = state.clone();
            let started = std::time::Instant::now();
            let Ok(Some(sample)) = tokio::task::spawn_blocking(move || reading.metrics.as_ref().map(read)).await else {
                return;
            };
            history.push(sample);
            tokio::time::sleep(Duration::from_secs(1).max(started.elapsed() * CPU_SHARE)).await;
        }
    });
}

/// One reading: the metrics rendered into [`Folding`], a line at a time.
fn read(metrics: &crate::state::Metrics) -> Sample {
    let mut folding = Folding::default();
    metrics.process.collect();
    let _ = metrics.recorder.render_to_write(&mut folding);
    folding.finish()
}

/// Folds Prometheus text, written into it in pieces, into a [`Sample`] line by line;
/// keeps only the partial last line, and the rules with decisions among the most
/// decided (every rule's count would not be bounded).
#[derive(Default)]
struct Folding {
    line: Vec<u8>,
    sample: Sample,
}

impl std::io::Write for Folding {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut rest = buf;
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            self.line.extend_from_slice(&rest[..end]);
            let line = std::mem::take(&mut self.line);
            self.fold(&String::from_utf8_lossy(&line));
            rest = &rest[end + 1..];
        }
        self.line.extend_from_slice(rest);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Folding {
    fn fold(&mut self, line: &str) {
        // most lines are of series the page does not show: skip them before any parsing
        const SHOWN: [&str; 7] = [
            "sluice_decisions_total{",
            "sluice_degraded_total{",
            "sluice_shed_total",
            "sluice_store_call_seconds_bucket{",
            "sluice_circuit_breaker_state",
            "sluice_migration_percent",
            "sluice_shed_amount",
        ];
        if !SHOWN.iter().any(|p| line.starts_with(p)) {
            return;
        }
        let Some((series, value)) = line.rsplit_once(' ') else { return };
        let Ok(v) = value.parse::<f64>() else { return };
        let (name, labels) = split(series);
        let s = &mut self.sample;
        match (name, labels.get("outcome"), labels.get("failure")) {
            ("sluice_decisions_total", Some(outcome), _) => {
                let allowed = *outcome == "allowed";
                *(if allowed { &mut s.allowed } else { &mut s.refused }) += v;
                if v > 0.0 {
                    let key = (labels["domain"].to_string(), labels["policy"].to_string());
                    let entry = s.rules.entry(key).or_default();
                    *(if allowed { &mut entry.0 } else { &mut entry.1 }) += v;
                    if s.rules.len() > 2 * RULES_KEPT {
                        keep_most_decided(s);
                    }
                }
            }
            ("sluice_degraded_total", _, Some(&"closed")) => s.unavailable += v,
            ("sluice_degraded_total", _, Some(&"open")) => s.fail_open += v,
            ("sluice_shed_total", _, _) => {
                *s.shed.entry(labels.get("class").copied().unwrap_or("").to_string()).or_default() += v
            }
            ("sluice_store_call_seconds_bucket", _, _) if labels.get("op") == Some(&"apply") => {
                let le = labels.get("le").and_then(|l| l.parse::<f64>().ok()).unwrap_or(f64::INFINITY);
                match s.apply.iter_mut().find(|(b, _)| *b == le) {
                    Some((_, c)) => *c += v,
                    None => s.apply.push((le, v)),
                }
            }
            ("sluice_circuit_breaker_state", _, _) => s.breaker = Some(v),
            ("sluice_migration_percent", _, _) => s.migration = Some(v),
            ("sluice_shed_amount", _, _) => s.shed_amount = Some(v),
            _ => {}
        }
    }

    fn finish(mut self) -> Sample {
        keep_most_decided(&mut self.sample);
        self.sample.apply.sort_by(|a, b| a.0.total_cmp(&b.0));
        self.sample.at_ms = sluice::time::Clock::now(&sluice::time::SystemClock);
        self.sample
    }
}

/// Keeps the [`RULES_KEPT`] rules with the most decisions, and notes when others went.
/// (A rule's two lines may come apart, one dropped between them; its count is then
/// short, in the per-rule view only.)
fn keep_most_decided(s: &mut Sample) {
    if s.rules.len() <= RULES_KEPT {
        return;
    }
    let mut counts: Vec<f64> = s.rules.values().map(|(a, r)| a + r).collect();
    counts.sort_by(|a, b| b.total_cmp(a));
    let floor = counts[RULES_KEPT - 1];
    // those above the floor, then those at it until the number is reached
    let mut room = RULES_KEPT - counts.iter().filter(|c| **c > floor).count();
    s.rules.retain(|_, (a, r)| {
        let c = *a + *r;
        let at_floor = c == floor && room > 0;
        room -= usize::from(at_floor);
        c > floor || at_floor
    });
    s.rules_full = true;
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

/// Per domain and rule (of those kept by name): allowed and refused a second over the
/// samples kept, and the totals; over every rule, allowed and refused a second;
/// requests decided without the store a second (refused, 503, or admitted by failing
/// open), and shed a second per priority class.
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
           "shed_per_s_by_class": shed})
}

/// The store's health: its kind, apply latency over the last minute (p50, p99), the
/// breaker, a migration's percentage, the shedder's amount.
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
           "migration_percent": last.migration, "shed_amount": last.shed_amount})
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
