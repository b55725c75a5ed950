//! What the HTTP API and Envoy's gRPC service share: the engine in force and the
//! handles a reload or an admin call changes.

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
    pub max_body_bytes: usize,
    /// `server.body_timeout`.
    pub body_timeout: std::time::Duration,
    /// Renders `/metrics`; None when no recorder is installed.
    pub metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
}

impl AppState {
    /// The state of a freshly built engine.
    pub fn new(
        built: crate::build::Built,
        server: &crate::config::ServerConfig,
        metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    ) -> Self {
        Self {
            engine: ArcSwap::from_pointee(built.engine),
            migration: ArcSwapOption::new(built.migration),
            tuning: ArcSwap::new(built.tuning),
            admin_token: server.admin_token.clone(),
            max_body_bytes: server.max_body_bytes,
            body_timeout: std::time::Duration::from_millis(server.body_timeout.0),
            metrics,
        }
    }

    /// Puts a freshly built engine in force.
    pub fn install(&self, built: crate::build::Built) {
        self.engine.store(Arc::new(built.engine));
        self.migration.store(built.migration);
        self.tuning.store(built.tuning);
    }
}
