//! Reservations over HTTP (see `sluice::algo::reservation` and `rls_messages::budget`): `POST
//! /v1/reservations` holds an estimate against a request's fixed windows, and `POST
//! /v1/reservations/{id}/commit` settles the actual, on any instance.

use super::api::{read_body, verdict_response_with};
use super::error::{check_error, error};
use super::json::{DescriptorJson, RequestJson};
use crate::app::AppState;
use crate::rls_messages::budget;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use sluice::store::Settled;
use std::sync::Arc;

/// `POST /v1/reservations`'s body: a request as `/v1/ratelimit` takes it, the amount to
/// hold (each descriptor's `hits_addend` overrides it), and how long.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReserveJson {
    domain: String,
    #[serde(default)]
    descriptors: Vec<DescriptorJson>,
    amount: u64,
    #[serde(default = "default_ttl")]
    ttl: sluice::config::Duration,
}

fn default_ttl() -> sluice::config::Duration {
    budget::DEFAULT_TTL
}

/// `POST /v1/reservations/{id}/commit`'s body: the actual amount, for every descriptor
/// (`actual`) or for each in order (`actuals`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CommitJson {
    #[serde(default)]
    actual: Option<u64>,
    #[serde(default)]
    actuals: Option<Vec<u64>>,
}

/// `POST /v1/reservations`.
pub async fn reserve(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let bytes = match read_body(&state, &headers, body).await {
        Ok(bytes) => bytes,
        Err(refused) => return refused,
    };
    let parsed: ReserveJson = match serde_json::from_slice(&bytes) {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_json", format!("the body is not a reservation: {e}")),
    };
    if let Some(why) = budget::ttl_error(parsed.ttl) {
        return error(StatusCode::BAD_REQUEST, "bad_ttl", why);
    }
    let json = RequestJson { domain: parsed.domain, descriptors: parsed.descriptors, hits_addend: Some(parsed.amount) };
    let req = match json.into_request() {
        Ok(req) => req,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_limit", e),
    };
    let engine = state.engine.load_full();
    match budget::reserve(&engine, &req, parsed.ttl.0).await {
        Ok((v, Some(token))) => verdict_response_with(&engine, &v, StatusCode::OK, Some(token), None),
        Ok((v, None)) => {
            let reason = budget::too_many_holds(&v, &req).then_some("too_many_holds");
            verdict_response_with(&engine, &v, super::api::code(&v), None, reason)
        }
        Err(e) => check_error(e),
    }
}

/// `POST /v1/reservations/{id}/commit`.
pub async fn commit(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let bytes = match read_body(&state, &headers, body).await {
        Ok(bytes) => bytes,
        Err(refused) => return refused,
    };
    let engine = state.engine.load_full();
    let Some(reserved) = budget::open(&engine.limiter, &id) else {
        let message = "the reservation id is not one this fleet issued (or was altered)".to_string();
        return error(StatusCode::BAD_REQUEST, "bad_reservation_id", message);
    };
    let actuals = match serde_json::from_slice::<CommitJson>(&bytes)
        .map_err(|e| e.to_string())
        .and_then(|c| budget::actuals(c.actual, c.actuals, reserved.descriptors()))
    {
        Ok(a) => a,
        Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_json", format!("the body is not a commit: {e}")),
    };
    match engine.limiter.commit(&reserved, &actuals).await {
        Ok(settled) => {
            let words: Vec<&str> = settled.iter().map(|s| word(*s)).collect();
            axum::Json(serde_json::json!({"settled": words})).into_response()
        }
        Err(e) => check_error(e),
    }
}

fn word(s: Settled) -> &'static str {
    match s {
        Settled::Committed { .. } => "committed",
        Settled::Reported => "reported",
        Settled::Again => "again",
    }
}
