//! Health and metrics: `GET /readyz` (the store takes calls) and `GET /metrics`
//! (Prometheus text). `/healthz` is answered by the router itself, and, with `/metrics`,
//! at the listener's front door too (`listen.rs`).

use super::error::error;
use crate::app::AppState;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

type Shared = State<Arc<AppState>>;

/// `GET /metrics`: Prometheus text (docs/operations.md lists every metric). Rendered on
/// a blocking thread, one scrape at a time: a scrape of a large config takes seconds
/// (100,000 domains: 63 MB), and it ran on the thread that answers `/healthz` (the
/// front door, `http/listen.rs`), which waited behind it.
pub(crate) async fn metrics(State(state): Shared) -> Response {
    let Some(m) = &state.metrics else {
        return error(StatusCode::NOT_FOUND, "no_metrics", "metrics are not recorded in this process".into());
    };
    let _turn = m.turn.lock().await;
    let engine = state.engine.load();
    engine.limiter.grants().publish();
    // reservations past their TTL leave the gauges
    engine.limiter.issued().sweep(engine.limiter.now());
    drop(engine);
    let rendering = state.clone();
    let render = move || {
        let text = rendering.metrics.as_ref().map(crate::app::Metrics::render)?;
        Some(match &rendering.xds {
            Some(xds) => text + &xds.exposition(),
            None => text,
        })
    };
    match tokio::task::spawn_blocking(render).await {
        Ok(Some(text)) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response(),
        _ => error(StatusCode::INTERNAL_SERVER_ERROR, "metrics_failed", "the metrics could not be rendered".into()),
    }
}

/// `GET /readyz`: 200 when the store takes calls and the stored overrides have been
/// read (until then this instance would decide without them), and with `xds`, once the
/// first rules were pushed (unless `xds.start_without_config`). A store that does not
/// answer leaves the instance ready when a rule's `failure` is `local`: such an instance
/// still decides those rules within their bound, which only instances that get requests
/// can do (out of the Service, Envoy would decide by its own `failure_mode_deny`, and a
/// fail-open Envoy admits without bound). With `open` and `closed` alone it is not ready:
/// instances that still reach the store answer in its place.
pub(crate) async fn ready(State(state): Shared) -> Response {
    let limiter = &state.engine.load_full().limiter;
    if let Some(why) = state.xds.as_ref().and_then(|x| x.unready()) {
        (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response()
    } else if !limiter.store().ready().await {
        match limiter.rules().use_local_failure() {
            true => (
                StatusCode::OK,
                "ready: the store does not answer; rules with failure: local decide within their bound here\n",
            )
                .into_response(),
            false => (StatusCode::SERVICE_UNAVAILABLE, "store not ready\n").into_response(),
        }
    } else if !limiter.overrides().loaded() {
        (StatusCode::SERVICE_UNAVAILABLE, "stored overrides not loaded yet\n").into_response()
    } else {
        (StatusCode::OK, "ready\n").into_response()
    }
}

/// The debug listener's endpoints, each with what it prints (as their debug port's `/`).
const DEBUG_ENDPOINTS: [(&str, &str); 2] =
    [("/rlconfig", "print out the currently loaded configuration for debugging"), ("/stats", "print out stats")];

/// `GET /` on the debug listener: its endpoints.
pub(crate) async fn debug_index() -> String {
    DEBUG_ENDPOINTS.iter().map(|(path, what)| format!("{path}: {what}\n")).collect()
}

/// `GET /rlconfig`: the `rate_limit:` rules in force, a line each, as envoyproxy/ratelimit
/// prints them (`DOMAIN.KEY_VALUE: unit=MINUTE requests_per_unit=10, shadow_mode: false,
/// quota_mode: false`).
pub(crate) async fn rlconfig(State(state): Shared) -> String {
    state.engine.load().limiter.rules().dump()
}

/// `GET /stats`: each `rate_limit:` rule's hits under their stat names, `NAME: VALUE` a
/// line, counted since the rules in force were loaded.
pub(crate) async fn stats(State(state): Shared) -> String {
    let rules = state.engine.load().limiter.rules().stats();
    let service = state.service_stats.counters();
    rules.into_iter().chain(service).map(|(name, n)| format!("{name}: {n}\n")).collect()
}
