//! The HTTP listener's routes, each front-end a module of its own: the API's data plane
//! (`api.rs`, its JSON in `json.rs`), the admin API (`admin.rs`) and its live page
//! (`ui.rs`), envoyproxy/ratelimit's own `/json` and `/healthcheck` (`envoy.rs`), health
//! and metrics (`probes.rs`); the error replies they share (`error.rs`); the listener's
//! connections (`listen.rs`). This room never uses `grpc/`: what both serve is below
//! them (`service.rs`, `state/`).

pub mod admin;
pub mod admin_import;
pub mod api;
pub mod envoy;
pub mod error;
pub mod json;
pub mod listen;
pub mod probes;
pub mod reservations;
pub mod ui;

use crate::app::AppState;
use axum::Router;
use axum::routing::{delete, get, post};
use std::sync::Arc;

/// The API's routes.
pub fn router(state: Arc<AppState>) -> Router {
    let admin = match state.admin_token {
        Some(_) => admin::routes(state.clone()),
        None => Router::new(),
    };
    let mut data = Router::new()
        .route("/v1/ratelimit", post(api::ratelimit).get(api::status))
        .route("/v1/leases", post(api::acquire))
        .route("/v1/leases/{lease_id}", delete(api::release))
        .route("/v1/refund", post(api::refund))
        .route("/v1/reservations", post(reservations::reserve))
        .route("/v1/reservations/{id}/commit", post(reservations::commit))
        .route("/json", post(envoy::json));
    // the data plane: behind `server.api_tokens` when there are any (a layer only then:
    // without tokens a decision pays nothing for it)
    if let Some(adaptive) = &state.adaptive {
        data = data.route_layer(adaptive.clone());
    }
    if !state.api_tokens.is_empty() {
        data = data.route_layer(axum::middleware::from_fn_with_state(state.clone(), api::data_plane_token));
    }
    admin
        .merge(data)
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(probes::ready))
        .route("/healthcheck", get(envoy::healthcheck))
        .route("/metrics", get(probes::metrics))
        .fallback(error::not_found)
        .with_state(state)
}

/// The debug listener's routes (`server.debug`: envoyproxy/ratelimit's debug port).
pub fn debug_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/", get(probes::debug_index))
        .route("/rlconfig", get(probes::rlconfig))
        .route("/stats", get(probes::stats))
        .fallback(error::not_found)
        .with_state(state)
}

/// The routes of `server.metrics`, a listener for scrapes alone (envoyproxy/ratelimit's
/// `PROMETHEUS_ADDR`): `/metrics`, and `/healthz` for its probe.
pub fn metrics_router(state: Arc<AppState>, path: &str) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(path, get(probes::metrics))
        .fallback(error::not_found)
        .with_state(state)
}
