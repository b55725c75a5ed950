//! The live page's history (`http/ui.rs` shows it): a task renders the metrics the
//! server keeps (the Prometheus text `/metrics` serves, streamed, never held whole) and
//! folds each reading at once into a [`Sample`] of bounded size: totals over every
//! rule, the rules with decisions (at most [`RULES_KEPT`], the most decided), the store's
//! few figures. Five minutes of samples are kept. So the page's memory is bounded
//! whatever the config holds (300 samples of a few KB), and so is its CPU: a reading is
//! taken once a second, or [`CPU_SHARE`] times the last reading's duration apart when
//! rendering takes longer (100,000 rules). Before, each second's whole reading was
//! kept, parsed, for five minutes: with 10,000 domains an idle server grew 10 MB a
//! second to 3.1 GB. Nothing on the decision path changes when the page is on.

use crate::app::AppState;
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

/// Readings are spaced at least this many times the last one's duration: the page
/// takes at most 1/20 of a core, however large the config.
const CPU_SHARE: u32 = 20;

/// One reading of the metrics, folded to what the page shows.
#[derive(Default)]
pub struct Sample {
    pub at_ms: u64,
    /// Decisions allowed and refused, summed over every rule (cumulative).
    pub allowed: f64,
    pub refused: f64,
    /// Requests decided by the failure policy: refused (fail-closed), admitted
    /// (fail-open), decided on local counts (`local`).
    pub unavailable: f64,
    pub fail_open: f64,
    pub local: f64,
    /// Requests shed, per priority class (a few classes).
    pub shed: BTreeMap<String, f64>,
    /// The rules with any decision, up to [`RULES_KEPT`] of them (the most decided):
    /// (domain, rule) to (allowed, refused), cumulative.
    pub rules: BTreeMap<(String, String), (f64, f64)>,
    /// Whether rules with decisions were left out (then a rule missing is not known to
    /// be at 0).
    pub rules_full: bool,
    /// The store's `apply` call histogram: (upper bound in s, calls at or below it).
    pub apply: Vec<(f64, f64)>,
    pub breaker: Option<f64>,
    pub migration: Option<f64>,
    pub shed_amount: Option<f64>,
    /// The adaptive stage's limit and requests in flight, when one runs here.
    pub adaptive_limit: Option<f64>,
    pub adaptive_in_flight: Option<f64>,
}

/// The last five minutes of samples.
#[derive(Default)]
pub struct History {
    samples: Mutex<VecDeque<Sample>>,
}

impl History {
    /// The samples kept, oldest first.
    pub fn samples(&self) -> std::sync::MutexGuard<'_, VecDeque<Sample>> {
        self.samples.lock().unwrap_or_else(|p| p.into_inner())
    }

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
fn read(metrics: &crate::app::Metrics) -> Sample {
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
        const SHOWN: [&str; 9] = [
            "sluice_decisions_total{",
            "sluice_degraded_total{",
            "sluice_shed_total",
            "sluice_store_call_seconds_bucket{",
            "sluice_circuit_breaker_state",
            "sluice_migration_percent",
            "sluice_shed_amount",
            "sluice_adaptive_limit",
            "sluice_adaptive_in_flight",
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
            ("sluice_degraded_total", _, Some(&"local")) => s.local += v,
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
            ("sluice_adaptive_limit", _, _) => s.adaptive_limit = Some(v),
            ("sluice_adaptive_in_flight", _, _) => s.adaptive_in_flight = Some(v),
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
