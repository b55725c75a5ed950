//! Reservations over HTTP (see `sluice::algo::reservation`): `POST /v1/reservations`
//! holds an estimate against a request's fixed windows, and `POST
//! /v1/reservations/{id}/commit` settles the actual, on any instance.
//!
//! The reservation id is a token that carries what a commit needs (the domain, each
//! descriptor's entries, the reservation's number), sealed with a keyed
//! digest under `limiter.key_secret`, so any instance of the fleet takes it back and none
//! takes one it did not issue or one altered. The store keeps the holds; the token keeps
//! nothing a client could use to charge another client.

use super::api::{read_body, verdict_response_with};
use super::error::{check_error, error};
use super::json::{DescriptorJson, RequestJson};
use crate::state::AppState;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use sluice::store::Settled;
use sluice::{Descriptor, Entry, Request};
use std::sync::Arc;

/// The longest a reservation may be held: a response that takes longer is committed as
/// a report.
const MAX_TTL: sluice::config::Duration = sluice::config::Duration(3_600_000);

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
    sluice::config::Duration(30_000)
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

/// What a token carries.
#[derive(Serialize, Deserialize)]
struct Token {
    /// The domain.
    d: String,
    /// Each descriptor's entries.
    e: Vec<Vec<(String, String)>>,
    /// The reservation's number.
    i: u64,
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
    if parsed.ttl.0 == 0 || parsed.ttl.0 > MAX_TTL.0 {
        let message = format!("ttl {} is not between 1ms and {MAX_TTL}", parsed.ttl);
        return error(StatusCode::BAD_REQUEST, "bad_ttl", message);
    }
    let json = RequestJson { domain: parsed.domain, descriptors: parsed.descriptors, hits_addend: Some(parsed.amount) };
    let req = match json.into_request() {
        Ok(req) => req,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_limit", e),
    };
    let engine = state.engine.load_full();
    let id = random_id();
    match engine.limiter.reserve(&req, id, parsed.ttl.0).await {
        Ok(v) if v.outcome == sluice::Outcome::Allowed => {
            let token = seal(&engine.limiter, &req, id);
            verdict_response_with(&engine, &v, StatusCode::OK, Some(token))
        }
        Ok(v) => verdict_response_with(&engine, &v, super::api::code(&v), None),
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
    let Some(token) = open(&engine.limiter, &id) else {
        let message = "the reservation id is not one this fleet issued (or was altered)".to_string();
        return error(StatusCode::BAD_REQUEST, "bad_reservation_id", message);
    };
    let actuals = match serde_json::from_slice::<CommitJson>(&bytes)
        .map_err(|e| e.to_string())
        .and_then(|c| actuals(c, token.e.len()))
    {
        Ok(a) => a,
        Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_json", format!("the body is not a commit: {e}")),
    };
    let descriptors = token
        .e
        .into_iter()
        .zip(actuals)
        .map(|(entries, actual)| Descriptor {
            entries: entries.into_iter().map(|(key, value)| Entry { key, value }).collect(),
            hits_addend: Some(actual),
            limit: None,
        })
        .collect();
    let req = Request { domain: token.d, descriptors, hits_addend: None, lenient: false };
    match engine.limiter.commit(&req, token.i).await {
        Ok(settled) => {
            let words: Vec<&str> = settled.iter().map(|s| word(*s)).collect();
            axum::Json(serde_json::json!({"settled": words})).into_response()
        }
        Err(e) => check_error(e),
    }
}

/// Each descriptor's actual, from a commit's body, for `n` descriptors.
fn actuals(c: CommitJson, n: usize) -> Result<Vec<u64>, String> {
    match (c.actual, c.actuals) {
        (Some(a), None) => Ok(vec![a; n]),
        (None, Some(all)) if all.len() == n => Ok(all),
        (None, Some(all)) => Err(format!("`actuals` has {} numbers for {n} descriptors", all.len())),
        _ => Err("send `actual` (for every descriptor) or `actuals` (one a descriptor), not both".into()),
    }
}

fn word(s: Settled) -> &'static str {
    match s {
        Settled::Committed { .. } => "committed",
        Settled::Reported => "reported",
        Settled::Again => "again",
    }
}

/// A fresh reservation number.
fn random_id() -> u64 {
    let mut b = [0u8; 8];
    let _ = getrandom::fill(&mut b);
    u64::from_le_bytes(b)
}

/// The token of reservation `id` of `req`.
fn seal(limiter: &sluice::Limiter, req: &Request, id: u64) -> String {
    let e =
        req.descriptors.iter().map(|d| d.entries.iter().map(|e| (e.key.clone(), e.value.clone())).collect()).collect();
    let token = Token { d: req.domain.clone(), e, i: id };
    let payload = serde_json::to_vec(&token).expect("strings and numbers serialize");
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    format!("{}.{:032x}", b64.encode(&payload), limiter.seal(&payload))
}

/// What a token carries, if it is one this fleet sealed (its seal written exactly as
/// [`seal`] writes it: one spelling a token).
fn open(limiter: &sluice::Limiter, token: &str) -> Option<Token> {
    let (payload, mac) = token.split_once('.')?;
    let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload).ok()?;
    let sealed = crate::state::same(mac.as_bytes(), format!("{:032x}", limiter.seal(&payload)).as_bytes());
    sealed.then(|| serde_json::from_slice(&payload).ok()).flatten()
}
