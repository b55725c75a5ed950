//! The HTTP JSON API's data plane: decisions, status reads, leases and refunds (see
//! docs/configuration.md and the README for examples).

use super::error::{check_error, error, unauthorized_for};
use super::json::{RequestJson, response_json};
use crate::app::{AppState, Engine};
use crate::otel::Call;
use axum::body::{Body, to_bytes};
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use sluice::{CheckError, Descriptor, Entry, LeaseId, Outcome, Request, RequestError, Verdict, headers};
use std::sync::Arc;

type Shared = State<Arc<AppState>>;

/// Reads a bounded body and parses it as a rate limit request.
async fn read_request(state: &AppState, headers: &HeaderMap, body: Body) -> Result<Request, Response> {
    let bytes = read_body(state, headers, body).await?;
    let parsed: RequestJson = serde_json::from_slice(&bytes).map_err(|e| {
        error(StatusCode::BAD_REQUEST, "invalid_json", format!("the body is not a valid rate limit request: {e}"))
    })?;
    parsed.into_request().map_err(|e| error(StatusCode::BAD_REQUEST, "bad_limit", e))
}

/// Reads a request body of at most `server.max_body_bytes` within `server.body_timeout`;
/// the error response says which bound it broke.
pub(crate) async fn read_body(state: &AppState, headers: &HeaderMap, body: Body) -> Result<bytes::Bytes, Response> {
    let max = state.max_body_bytes;
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("the request body is larger than {max} bytes (server.max_body_bytes)"),
        )
    };
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    if declared.is_some_and(|n| n > max) {
        return Err(too_large());
    }
    let Ok(read) = tokio::time::timeout(state.body_timeout, to_bytes(body, max)).await else {
        let message = format!("the request body did not arrive within {:?} (server.body_timeout)", state.body_timeout);
        return Err(error(StatusCode::REQUEST_TIMEOUT, "body_timeout", message));
    };
    read.map_err(|e| {
        // over the limit is a 413; a body that breaks off or is malformed (a bad chunk
        // size) is the client's mistake of another kind: a 400
        let over = std::iter::successors(Some(&e as &dyn std::error::Error), |e| e.source())
            .any(|e| e.is::<http_body_util::LengthLimitError>());
        match over {
            true => too_large(),
            false => error(StatusCode::BAD_REQUEST, "bad_body", format!("the request body could not be read: {e}")),
        }
    })
}

/// A verdict as a response: status, headers, JSON body. The headers are rendered with
/// the settings of the engine that decided, not whatever a reload has put in
/// force since.
fn verdict_response(engine: &Engine, v: &Verdict, status: StatusCode) -> Response {
    verdict_response_with(engine, v, status, None, None)
}

/// [`verdict_response`], with the id of the reservation it made, if any, or why it made
/// none when that is not plain from the statuses.
pub(crate) fn verdict_response_with(
    engine: &Engine,
    v: &Verdict,
    status: StatusCode,
    reservation_id: Option<String>,
    reason: Option<&'static str>,
) -> Response {
    // written once into a buffer that holds a one-descriptor answer (a growing buffer
    // copies what it holds at each step)
    let mut body = Vec::with_capacity(RESPONSE_BYTES);
    let json = super::json::ResponseJson { reservation_id, reason, ..response_json(v) };
    serde_json::to_writer(&mut body, &json).expect("strings, numbers and lists write to a Vec");
    let rendered = headers::render(v, &engine.headers);
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.reserve(rendered.len() + 1);
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    for (name, value) in rendered {
        // the rendered text becomes the header's bytes, uncopied
        if let Ok(value) = HeaderValue::try_from(value) {
            h.insert(HeaderName::from_static(name), value);
        }
    }
    resp
}

/// Room for the JSON answer to a request of one descriptor with one policy (about 400
/// bytes) and for longer names.
const RESPONSE_BYTES: usize = 640;

/// The HTTP status of a verdict: the API's one mapping of the engine's outcome.
pub(crate) fn code(v: &Verdict) -> StatusCode {
    match v.outcome {
        Outcome::Allowed => StatusCode::OK,
        Outcome::OverLimit => StatusCode::TOO_MANY_REQUESTS,
        Outcome::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// `POST /v1/ratelimit`: charge and decide.
pub(crate) async fn ratelimit(State(state): Shared, headers: HeaderMap, body: Body) -> Response {
    traced(&state, &headers, "POST /v1/ratelimit", decide(&state, &headers, body, false)).await
}

/// `POST /v1/leases`: take a lease on every matching concurrency policy.
pub(crate) async fn acquire(State(state): Shared, headers: HeaderMap, body: Body) -> Response {
    traced(&state, &headers, "POST /v1/leases", decide(&state, &headers, body, true)).await
}

/// A decision on the request in `body`: charged (`lease`: and a lease taken).
async fn decide(state: &AppState, headers: &HeaderMap, body: Body, lease: bool) -> Response {
    let engine = state.engine.load_full();
    match read_request(state, headers, body).await {
        Ok(req) => {
            let decided = match lease {
                true => engine.limiter.acquire(&req).await,
                false => engine.limiter.check(&req).await,
            };
            crate::otel::decided(&engine.limiter, &req, &decided);
            answer(&engine, decided)
        }
        Err(resp) => resp,
    }
}

/// One data-plane call's handling, inside its trace when it has one (see `otel`).
async fn traced(
    state: &AppState,
    headers: &HeaderMap,
    route: &'static str,
    work: impl std::future::Future<Output = Response>,
) -> Response {
    let ended = |r: &Response| crate::otel::Ended::http(r.status().as_u16());
    let parent = crate::otel::Parent::from_headers(headers);
    crate::otel::around(state.tracer.as_deref(), parent, Call::Http(route), work, ended).await
}

/// A decision as a response.
fn answer(engine: &Engine, decided: Result<Verdict, CheckError>) -> Response {
    match decided {
        Ok(v) => verdict_response(engine, &v, code(&v)),
        Err(e) => check_error(e),
    }
}

/// `GET /v1/ratelimit?domain=D&KEY=VALUE...`: the status of one descriptor (its entries
/// in query order), never charging.
pub(crate) async fn status(
    State(state): Shared,
    headers: HeaderMap,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Response {
    let work = async {
        let req = match client_query(query, None) {
            Ok((req, _)) => req,
            Err(resp) => return *resp,
        };
        let engine = state.engine.load_full();
        let decided = engine.limiter.status(&req).await;
        crate::otel::decided(&engine.limiter, &req, &decided);
        match decided {
            // what a request of the query's cost (1) would get now: a client with nothing
            // left reads OVER_LIMIT (HTTP 200 still: a status read is answered)
            Ok(v) => verdict_response(&engine, &crate::rls_messages::budget::as_check(v, &req), StatusCode::OK),
            Err(e) => check_error(e),
        }
    };
    traced(&state, &headers, "GET /v1/ratelimit", work).await
}

/// A client named in a query string: `domain=D`, then the descriptor's `KEY=VALUE`
/// pairs in order; the value of the `reserved` key (like `policy`) is taken out and
/// returned apart.
pub(crate) fn client_query(
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
    reserved: Option<&str>,
) -> Result<(Request, Option<String>), Box<Response>> {
    let Query(pairs) = query.map_err(|e| {
        error(StatusCode::BAD_REQUEST, "bad_query", format!("the query string is not KEY=VALUE pairs: {e}"))
    })?;
    let (mut domain, mut entries, mut taken) = (None, Vec::new(), None);
    for (key, value) in pairs {
        if key == "domain" && domain.is_none() {
            domain = Some(value);
        } else if reserved == Some(key.as_str()) && taken.is_none() {
            taken = Some(value);
        } else {
            entries.push(Entry { key, value });
        }
    }
    let domain = domain.ok_or_else(|| {
        Box::new(error(
            StatusCode::BAD_REQUEST,
            "missing_domain",
            "add ?domain=NAME and the descriptor's KEY=VALUE pairs".into(),
        ))
    })?;
    let req = Request {
        domain,
        descriptors: vec![Descriptor { entries, ..Default::default() }],
        hits_addend: None,
        lenient: false,
    };
    Ok((req, taken))
}

/// `DELETE /v1/leases/{lease_id}`: give a lease back (idempotent).
pub(crate) async fn release(
    State(state): Shared,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
) -> Response {
    let work = async {
        let lease_id = match path {
            Ok(Path(id)) => id,
            Err(e) => {
                return error(StatusCode::BAD_REQUEST, "bad_lease_id", format!("the lease id is not readable: {e}"));
            }
        };
        let lease: LeaseId = match lease_id.parse() {
            Ok(l) => l,
            Err(e) => return error(StatusCode::BAD_REQUEST, RequestError::code(&e), e.to_string()),
        };
        match state.engine.load_full().limiter.release(&lease).await {
            Ok(held) => axum::Json(json!({"released": held})).into_response(),
            Err(e) => check_error(e.into()),
        }
    };
    traced(&state, &headers, "DELETE /v1/leases/{lease_id}", work).await
}

/// `POST /v1/refund`: give back the request's cost in the current windows.
pub(crate) async fn refund(State(state): Shared, headers: HeaderMap, body: Body) -> Response {
    let work = async {
        let req = match read_request(&state, &headers, body).await {
            Ok(r) => r,
            Err(resp) => return resp,
        };
        match state.engine.load_full().limiter.refund_request(&req).await {
            Ok(_) => axum::Json(json!({"refunded": true})).into_response(),
            Err(e) => check_error(e),
        }
    };
    traced(&state, &headers, "POST /v1/refund", work).await
}

/// The data plane's credential: with `server.api_tokens` set, a request must carry one
/// of them as a bearer token (compared in constant time), or it is answered 401.
pub(crate) async fn data_plane_token(
    State(state): Shared,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let given = request.headers().get(header::AUTHORIZATION).map(HeaderValue::as_bytes);
    let peer = request.extensions().get::<crate::http::listen::PeerAddr>().and_then(|p| p.0);
    if state.api_token_matches(given, "http", peer) {
        next.run(request).await
    } else {
        unauthorized_for("one of server.api_tokens")
    }
}
