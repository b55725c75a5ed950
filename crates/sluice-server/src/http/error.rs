//! The error replies every HTTP front-end gives: one JSON shape,
//! `{"error": {"code": ..., "message": ...}}`, saying what is wrong and what to do.

use crate::app::AppState;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use sluice::overrides::OverrideError;
use sluice::{CheckError, RequestError};
use std::sync::Arc;

/// A JSON error: `{"error": {"code": ..., "message": ...}}`.
pub(crate) fn error(status: StatusCode, code: &str, message: String) -> Response {
    (status, axum::Json(json!({"error": {"code": code, "message": message}}))).into_response()
}

pub(crate) fn check_error(e: CheckError) -> Response {
    match e {
        // rules still to come (a control plane's first push): not the caller's mistake
        CheckError::Request(e @ RequestError::NoRules(_)) => {
            metrics::counter!(crate::app::xds::WITHOUT_RULES, "api" => "http").increment(1);
            error(StatusCode::SERVICE_UNAVAILABLE, e.code(), e.to_string())
        }
        CheckError::Request(e) => error(StatusCode::BAD_REQUEST, e.code(), e.to_string()),
        CheckError::Store(e) => {
            // the store's failing and recovering are logged where it is wrapped, once each
            tracing::debug!(error = %e, "store call failed");
            error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", e.to_string())
        }
    }
}

/// A 401 naming the setting whose token to send.
pub(crate) fn unauthorized_for(setting: &str) -> Response {
    let mut r = error(StatusCode::UNAUTHORIZED, "unauthorized", format!("send Authorization: Bearer <{setting}>"));
    r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

/// Paths that match no route: the admin API's say that it is off until
/// `server.admin_token` is set, when it is.
pub(crate) async fn not_found(State(state): State<Arc<AppState>>, uri: axum::http::Uri) -> Response {
    let admin = ["/v1/admin", "/v1/overrides", "/ui"].iter().any(|p| uri.path().starts_with(p));
    let message = match admin && state.admin_token.is_none() {
        true => "the admin API is off: set server.admin_token (16 bytes or more) and restart".into(),
        false => "no such endpoint; see /v1/ratelimit".into(),
    };
    error(StatusCode::NOT_FOUND, "not_found", message)
}

/// Refused overrides listed in an answer, at most: enough to fix a file by, bounded
/// whatever was sent.
const REFUSED_LISTED: usize = 100;

/// An override refused, as the answer that says why.
pub(crate) fn override_error(e: OverrideError) -> Response {
    let message = e.to_string();
    match e {
        OverrideError::Invalid(_) | OverrideError::Misfit(_) => error(StatusCode::BAD_REQUEST, "bad_override", message),
        OverrideError::Unsupported(m) => error(StatusCode::NOT_IMPLEMENTED, "overrides_unsupported", m),
        OverrideError::Full { .. } => error(StatusCode::CONFLICT, "too_many_overrides", message),
        OverrideError::Rejected(items) => {
            let listed = &items[..items.len().min(REFUSED_LISTED)];
            let body = json!({"error": {"code": "bad_overrides", "message": message, "refused": listed}});
            (StatusCode::BAD_REQUEST, axum::Json(body)).into_response()
        }
        OverrideError::Incomplete { error: inner, .. } => {
            error(override_error(*inner).status(), "import_incomplete", message)
        }
        OverrideError::Store(e) => check_error(e.into()),
    }
}
