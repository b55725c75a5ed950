//! Kuadrant's rate limit service, `kuadrant.service.ratelimit.v1.RateLimitService`
//! (`proto/kuadrantrls.proto`), on the gRPC listener beside Envoy's: what Kuadrant's
//! gateway plugin calls Limitador by. `CheckRateLimit` checks without charging, `Report`
//! charges without refusing, `Reserve` and `Commit` hold an estimate and settle the
//! actual (`rls_messages::budget`). Calls are unary and served by hand as Envoy's are
//! (`unary.rs`), with the same token, bounds and errors.

use super::unary::{self, GrpcRequest, GrpcResponse};
use crate::app::AppState;
use crate::rls_messages::{self, Ask, budget};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use std::sync::Arc;
use tonic::Status;

/// `ReserveRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ReserveRequest {
    #[prost(message, optional, tag = "1")]
    pub request: Option<RateLimitRequest>,
    #[prost(message, optional, tag = "2")]
    pub ttl: Option<PbDuration>,
}

/// `ReserveResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ReserveResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<RateLimitResponse>,
    #[prost(string, tag = "2")]
    pub reservation_id: String,
}

/// `CommitRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CommitRequest {
    #[prost(string, tag = "1")]
    pub reservation_id: String,
    #[prost(uint64, optional, tag = "2")]
    pub actual: Option<u64>,
    #[prost(uint64, repeated, tag = "3")]
    pub actuals: Vec<u64>,
}

/// `CommitResponse`: each window's `Settled` (0 committed, 1 reported, 2 again).
#[derive(Clone, PartialEq, prost::Message)]
pub struct CommitResponse {
    #[prost(int32, repeated, tag = "1")]
    pub settled: Vec<i32>,
}

/// The service.
#[derive(Clone)]
pub struct Kuadrant {
    pub state: Arc<AppState>,
}

impl tonic::server::NamedService for Kuadrant {
    const NAME: &'static str = "kuadrant.service.ratelimit.v1.RateLimitService";
}

/// The methods, by path.
const METHODS: [&str; 4] = [
    "/kuadrant.service.ratelimit.v1.RateLimitService/CheckRateLimit",
    "/kuadrant.service.ratelimit.v1.RateLimitService/Report",
    "/kuadrant.service.ratelimit.v1.RateLimitService/Reserve",
    "/kuadrant.service.ratelimit.v1.RateLimitService/Commit",
];

/// The path's method, or UNIMPLEMENTED.
fn method(path: &str) -> Result<&'static str, Status> {
    let known = METHODS.iter().find(|m| **m == path);
    known.copied().ok_or_else(|| Status::unimplemented(format!("no method {path}; this service answers {METHODS:?}")))
}

unary::unary_service!(Kuadrant, method, call);

/// One call of `method` (one of [`METHODS`]).
async fn call(state: &AppState, method: &str, req: GrpcRequest) -> Result<GrpcResponse, Status> {
    match method.rsplit('/').next() {
        Some("CheckRateLimit") => answer(state, req, Ask::Check).await,
        Some("Report") => answer(state, req, Ask::Report).await,
        Some("Reserve") => Ok(unary::answer(&reserve(state, unary::read(state, req).await?).await?)),
        _ => Ok(unary::answer(&commit(state, unary::read(state, req).await?).await?)),
    }
}

/// `CheckRateLimit` and `Report`: Envoy's messages, answered as Envoy's service answers
/// (an empty domain is Limitador's UNKNOWN).
async fn answer(state: &AppState, req: GrpcRequest, ask: Ask) -> Result<GrpcResponse, Status> {
    let request: RateLimitRequest = unary::read(state, req).await?;
    if request.domain.is_empty() {
        return Ok(unary::answer(&RateLimitResponse::default()));
    }
    Ok(unary::answer(&rls_messages::answer(state, request, ask).await.reply?))
}

/// `Reserve`.
async fn reserve(state: &AppState, r: ReserveRequest) -> Result<ReserveResponse, Status> {
    let ttl = match r.ttl {
        None => budget::DEFAULT_TTL,
        Some(d) if d.seconds < 0 || d.nanos < 0 => return Err(Status::invalid_argument("ttl is negative")),
        Some(d) => sluice::config::Duration((d.seconds as u64).saturating_mul(1_000) + d.nanos as u64 / 1_000_000),
    };
    if let Some(why) = budget::ttl_error(ttl) {
        return Err(Status::invalid_argument(why));
    }
    let req = rls_messages::request(r.request.ok_or_else(|| Status::invalid_argument("no request to reserve"))?)?;
    let engine = state.engine.load_full();
    let (v, id) = budget::reserve(&engine, &req, ttl.0).await.map_err(rls_messages::status_of)?;
    if v.outcome == sluice::Outcome::Unavailable {
        return Err(Status::unavailable("the rate limit store is unavailable (fail-closed)"));
    }
    let response = rls_messages::response(&v, &engine, &req);
    Ok(ReserveResponse { response: Some(response), reservation_id: id.unwrap_or_default() })
}

/// `Commit`.
async fn commit(state: &AppState, c: CommitRequest) -> Result<CommitResponse, Status> {
    let engine = state.engine.load_full();
    let Some(reserved) = budget::open(&engine.limiter, &c.reservation_id) else {
        return Err(Status::invalid_argument("the reservation id is not one this fleet issued (or was altered)"));
    };
    let given = (!c.actuals.is_empty()).then_some(c.actuals);
    let actuals = budget::actuals(c.actual, given, reserved.descriptors()).map_err(Status::invalid_argument)?;
    let settled = engine.limiter.commit(&reserved, &actuals).await.map_err(rls_messages::status_of)?;
    let code = |s: &sluice::store::Settled| match s {
        sluice::store::Settled::Committed { .. } => 0,
        sluice::store::Settled::Reported => 1,
        sluice::store::Settled::Again => 2,
    };
    Ok(CommitResponse { settled: settled.iter().map(code).collect() })
}
