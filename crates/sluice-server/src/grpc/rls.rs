//! Envoy's rate limit service, `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`:
//! what an Envoy's `envoy.filters.http.ratelimit` filter calls, on `server.grpc`
//! (127.0.0.1:8081 by default), the port envoyproxy/ratelimit uses.
//!
//! The call is decided by the rate limit service (`service.rs`), which `/json` shares:
//! the same decisions, headers and errors. This module is the gRPC transport: one
//! message in, one out, every failure a gRPC status.

use super::unary::{self, GrpcRequest, GrpcResponse};
use crate::app::AppState;
use crate::rls_messages::Ask;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use std::sync::Arc;
use tonic::Status;

/// The gRPC service, served by hand (`unary.rs`) rather than generated:
/// Envoy's calls are unary, and a generated server decodes through a streaming codec with
/// two 8 KiB buffers a call (a quarter of the server's CPU per decision in a profile),
/// decodes only the first of several messages, and answers a message that does not
/// decode with INTERNAL, which tells Envoy the server is broken rather than the request.
/// This one reads the whole request (bounded), accepts exactly one uncompressed message,
/// decodes it with prost, and answers one message and `grpc-status: 0`; every failure is
/// a gRPC status.
#[derive(Clone)]
pub struct Rls {
    pub state: Arc<AppState>,
}

/// The path of the one method served.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

impl tonic::server::NamedService for Rls {
    const NAME: &'static str = "envoy.service.ratelimit.v3.RateLimitService";
}

/// The path's method (the one served), or UNIMPLEMENTED.
fn method(path: &str) -> Result<&'static str, Status> {
    match path == SHOULD_RATE_LIMIT {
        true => Ok(SHOULD_RATE_LIMIT),
        false => Err(Status::unimplemented(format!("no method {path}; this server answers {SHOULD_RATE_LIMIT}"))),
    }
}

unary::unary_service!(Rls, method, unary);

/// A call: the request, decided, checked or reported as its `x-sluice-mode` metadata
/// asks (`rls_messages::Ask`).
async fn unary(state: &AppState, _: &str, req: GrpcRequest) -> Result<GrpcResponse, Status> {
    let ask = Ask::from_metadata(req.headers().get("x-sluice-mode").map(|v| v.as_bytes()))?;
    let request: RateLimitRequest = unary::read(state, req).await?;
    let answering = crate::rls_messages::answer(state, request, ask);
    Ok(unary::answer(&crate::rls_messages::counted(state, answering).await?))
}
