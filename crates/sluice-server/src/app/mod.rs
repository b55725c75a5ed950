//! What the HTTP API and Envoy's gRPC service share: the engine in force and the
//! handles a reload or an admin call changes.

pub mod build;
pub mod credentials;
pub mod history;
pub mod rlqs;
pub mod service_stats;
pub mod srv;
pub mod xds;

use arc_swap::{ArcSwap, ArcSwapOption};
use sluice::Limiter;
use sluice::headers::HeadersConfig;
use sluice::store::{MigratingStore, Tuning};
use std::sync::Arc;

/// A limiter and how its verdicts are rendered, swapped together by a reload so a
/// response is always rendered by the config that decided it.
pub struct Engine {
    pub limiter: Limiter,
    pub headers: HeadersConfig,
    /// `envoy`: how Envoy's answers are written.
    pub envoy: crate::config::EnvoyConfig,
    /// `limiter.reservations: false`: reservations are refused, saying so.
    pub reservations_off: bool,
}

/// What every handler shares.
pub struct AppState {
    /// The engine in force; a config reload swaps it (see `reload.rs`).
    pub engine: ArcSwap<Engine>,
    /// The migrating store, when the store is one (admin API, reloads).
    pub migration: ArcSwapOption<MigratingStore>,
    /// The deadline and breaker of the store in force, which a reload may retune.
    pub tuning: ArcSwap<Tuning>,
    /// `server.admin_token`: the admin endpoints exist only when it is set.
    pub admin_token: Option<String>,
    /// `server.api_tokens`: when any, the data plane (HTTP and gRPC) needs one of them.
    pub api_tokens: Vec<String>,
    /// The data-plane calls refused for their credentials.
    pub refusals: credentials::Refusals,
    /// envoyproxy/ratelimit's service stats, for StatsD.
    pub service_stats: service_stats::ServiceStats,
    pub max_body_bytes: usize,
    /// `server.body_timeout`.
    pub body_timeout: std::time::Duration,
    /// `server.tls`, when the listeners speak TLS: read again at every reload.
    pub tls: Option<Arc<crate::tls::Tls>>,
    /// Renders `/metrics`; None when no recorder is installed.
    pub metrics: Option<Metrics>,
    /// `telemetry.otlp`: traces, when on (set at start).
    pub tracer: Option<Arc<crate::otel::Tracer>>,
    /// `server.ui`: the samples the live page shows, when on (set at start).
    pub ui: Option<Arc<history::History>>,
    /// `server.adaptive_concurrency`: the HTTP data plane's adaptive stage, when on.
    pub adaptive: Option<sluice::layer::SluiceLayer>,
    /// The Envoy RLQS streams open here.
    pub rlqs: rlqs::Streams,
    /// With `xds:`, the rules pushed and whether any were (set at start).
    pub xds: Option<Arc<xds::XdsState>>,
}

/// What `/metrics` renders: the recorder's metrics and the standard process metrics
/// (`process_cpu_seconds_total`, `process_resident_memory_bytes`, `process_open_fds`,
/// ...), read from the system at each scrape.
pub struct Metrics {
    pub recorder: metrics_exporter_prometheus::PrometheusHandle,
    pub process: metrics_process::Collector,
    /// One scrape renders at a time: a large config's scrape is seconds of a core and
    /// tens of MB, and `/metrics` needs no credential.
    pub turn: tokio::sync::Mutex<()>,
}

impl Metrics {
    /// The Prometheus text exposition, the process metrics read now.
    pub fn render(&self) -> String {
        self.process.collect();
        let mut text = self.recorder.render();
        // the process's CPU seconds are kept as a gauge (so they keep their fractions:
        // `sluice bench` divides them by decisions), but they only ever grow, and a
        // `_total` must be a counter (promtool); the text format takes a fractional one
        const AS_GAUGE: &str = "# TYPE process_cpu_seconds_total gauge";
        if let Some(at) = text.find(AS_GAUGE) {
            text.replace_range(at..at + AS_GAUGE.len(), "# TYPE process_cpu_seconds_total counter");
        }
        text
    }
}

impl AppState {
    /// The state of a freshly built engine.
    pub fn new(
        built: crate::app::build::Built,
        server: &crate::config::ServerConfig,
        metrics: Option<Metrics>,
        tls: Option<Arc<crate::tls::Tls>>,
    ) -> Self {
        Self {
            tls,
            engine: ArcSwap::from_pointee(built.engine),
            migration: ArcSwapOption::new(built.migration),
            tuning: ArcSwap::new(built.tuning),
            admin_token: server.admin_token.clone(),
            api_tokens: server.api_tokens.clone(),
            refusals: credentials::Refusals::default(),
            // the config loaded at start, as their service counts it
            service_stats: service_stats::ServiceStats::loaded(),
            max_body_bytes: server.max_body_bytes,
            body_timeout: server.body_timeout.to_std(),
            metrics,
            tracer: None,
            ui: None,
            adaptive: server.adaptive_concurrency.then(sluice::layer::SluiceLayer::adaptive_only),
            rlqs: rlqs::Streams::new(server.rlqs, server.header_timeout.to_std()),
            xds: None,
        }
    }

    /// Who acted, for the audit line: a fingerprint of the admin token (never the token).
    pub fn actor(&self) -> String {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.admin_token.hash(&mut h);
        format!("admin_token:{:08x}", h.finish() >> 32)
    }

    /// Writes one admin action's audit line, by the admin token's fingerprint.
    pub fn audit(&self, action: &str, resource: &str, old: Option<String>, new: Option<String>, reason: &str) {
        let by = self.actor();
        sluice::audit(&sluice::Audit { action, resource, old: old.as_deref(), new: new.as_deref(), reason, by: &by });
    }

    /// Whether `authorization` (a header value) carries one of `server.api_tokens`, or
    /// none is configured; a call refused is counted and logged, by `listener` and `peer`.
    pub fn api_token_matches(
        &self,
        authorization: Option<&[u8]>,
        listener: &'static str,
        peer: Option<std::net::SocketAddr>,
    ) -> bool {
        let ok = self.api_tokens.is_empty() || self.api_tokens.iter().any(|t| bearer_is(authorization, t));
        if !ok {
            self.refusals.refused(listener, peer, authorization.is_some());
        }
        ok
    }

    /// Puts a freshly built engine in force.
    pub fn install(&self, built: crate::app::build::Built) {
        self.engine.store(Arc::new(built.engine));
        self.migration.store(built.migration);
        self.tuning.store(built.tuning);
    }
}

/// Whether `authorization` is `Bearer <token>`, compared in constant time (for a given
/// length), so response times do not reveal how much of a guess was right.
pub fn bearer_is(authorization: Option<&[u8]>, token: &str) -> bool {
    let given = authorization.and_then(|a| a.strip_prefix(b"Bearer ")).unwrap_or(b"");
    same(given, token.as_bytes())
}

/// Whether `authorization` is HTTP Basic with `token` as the password (any user name):
/// how a browser sends the admin token to the live page (`server.ui`).
pub fn basic_is(authorization: Option<&[u8]>, token: &str) -> bool {
    use base64::Engine;
    let given = authorization.and_then(|a| a.strip_prefix(b"Basic ")).unwrap_or(b"");
    let decoded = base64::engine::general_purpose::STANDARD.decode(given).unwrap_or_default();
    let password = decoded.iter().position(|&b| b == b':').map_or(&[][..], |i| &decoded[i + 1..]);
    same(password, token.as_bytes())
}

/// Equal bytes, compared in constant time for a given length.
pub fn same(given: &[u8], wanted: &[u8]) -> bool {
    given.len() == wanted.len() && given.iter().zip(wanted).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}
