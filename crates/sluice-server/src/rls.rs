//! Envoy's rate limit service, `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`:
//! what an Envoy's `envoy.filters.http.ratelimit` filter calls, on `server.grpc`
//! (127.0.0.1:8081 by default), the port envoyproxy/ratelimit uses.
//!
//! It shares the HTTP API's engine path: the same `Limiter::check`, so the same decisions,
//! headers and errors. A request that cannot be evaluated answers `INVALID_ARGUMENT`; a
//! refusal by a fail-closed policy whose store failed answers `UNAVAILABLE`, so Envoy's
//! `failure_mode_deny` decides; fail-open answers OK (counted, as everywhere).

use crate::state::AppState;
use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit, rate_limit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use sluice::algo::Limit;
use sluice::config::Unit;
use sluice::headers;
use sluice::{CheckError, Descriptor, Entry, LimitOverride, Outcome, Request, Verdict};
use std::sync::Arc;
use tonic::{Response, Status};

/// The gRPC service.
pub struct Rls {
    pub state: Arc<AppState>,
}

/// `envoy.type.v3.RateLimitUnit` as numbered on the wire.
fn unit_of(n: i32) -> Result<Unit, String> {
    Ok(match n {
        1 => Unit::Second,
        2 => Unit::Minute,
        3 => Unit::Hour,
        4 => Unit::Day,
        5 => Unit::Month,
        6 => Unit::Year,
        7 => Unit::Week,
        other => return Err(format!("unknown rate limit unit {other}")),
    })
}

fn wire_unit(u: Unit) -> rate_limit::Unit {
    match u {
        Unit::Second => rate_limit::Unit::Second,
        Unit::Minute => rate_limit::Unit::Minute,
        Unit::Hour => rate_limit::Unit::Hour,
        Unit::Day => rate_limit::Unit::Day,
        Unit::Week => rate_limit::Unit::Week,
        Unit::Month => rate_limit::Unit::Month,
        Unit::Year => rate_limit::Unit::Year,
    }
}

/// Envoy's request as the engine's. Request `hits_addend` 0 means unset (1); a
/// descriptor's `hits_addend` 0 checks without charging.
fn request(r: RateLimitRequest) -> Result<Request, Status> {
    let descriptors = r
        .descriptors
        .into_iter()
        .enumerate()
        .map(|(i, d): (usize, RateLimitDescriptor)| {
            let limit = match d.limit {
                Some(o) => Some(LimitOverride {
                    requests_per_unit: u64::from(o.requests_per_unit),
                    unit: unit_of(o.unit)
                        .map_err(|e| Status::invalid_argument(format!("descriptors[{i}].limit: {e}")))?,
                }),
                None => None,
            };
            Ok(Descriptor {
                entries: d.entries.into_iter().map(|e| Entry { key: e.key, value: e.value }).collect(),
                hits_addend: d.hits_addend.map(|h| h.value),
                limit,
            })
        })
        .collect::<Result<Vec<_>, Status>>()?;
    let hits_addend = (r.hits_addend > 0).then_some(u64::from(r.hits_addend));
    Ok(Request { domain: r.domain, descriptors, hits_addend })
}

/// The engine's verdict as Envoy's response.
fn response(v: &Verdict, headers_cfg: &sluice::headers::HeadersConfig) -> RateLimitResponse {
    let statuses = v
        .descriptors
        .iter()
        .map(|d| {
            let binding = d.binding().map(|i| &d.policies[i]);
            DescriptorStatus {
                code: match d.code {
                    sluice::Code::Ok => Code::Ok,
                    sluice::Code::OverLimit => Code::OverLimit,
                } as i32,
                current_limit: binding.map(|p| RateLimit {
                    name: p.name.to_string(),
                    requests_per_unit: p.limit.capacity().min(u64::from(u32::MAX)) as u32,
                    unit: match p.limit {
                        Limit::FixedWindow { window, .. } => {
                            Unit::from_millis(window).map_or(0, |u| wire_unit(u) as i32)
                        }
                        _ => 0,
                    },
                }),
                limit_remaining: binding.map_or(0, |p| p.decision.remaining.min(u64::from(u32::MAX)) as u32),
                duration_until_reset: binding.map(|p| {
                    let ms = p.decision.reset_at.saturating_sub(v.now);
                    PbDuration { seconds: (ms / 1000) as i64, nanos: ((ms % 1000) * 1_000_000) as i32 }
                }),
                ..Default::default()
            }
        })
        .collect();
    RateLimitResponse {
        overall_code: if v.allowed() { Code::Ok } else { Code::OverLimit } as i32,
        statuses,
        response_headers_to_add: headers::render(v, headers_cfg)
            .into_iter()
            .map(|(k, v)| HeaderValue { key: k.to_string(), value: v, ..Default::default() })
            .collect(),
        ..Default::default()
    }
}

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request_: tonic::Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let given = request_.metadata().get("authorization").map(|v| v.as_bytes());
        if !self.state.api_token_matches(given) {
            return Err(Status::unauthenticated("send metadata authorization: Bearer <one of server.api_tokens>"));
        }
        let req = request(request_.into_inner())?;
        let engine = self.state.engine.load_full();
        match engine.limiter.check(&req).await {
            Ok(v) if v.outcome == Outcome::Unavailable => {
                Err(Status::unavailable("the rate limit store is unavailable (fail-closed)"))
            }
            Ok(v) => Ok(Response::new(response(&v, &engine.headers))),
            Err(CheckError::Request(e)) => Err(Status::invalid_argument(e.to_string())),
            Err(CheckError::Store(e)) => Err(Status::unavailable(e.to_string())),
        }
    }
}

/// The largest request accepted, as tonic's own default for a decoded message.
const MAX_REQUEST: usize = 4 << 20;

/// Envoy's calls are unary: exactly one message each. tonic's unary handling decodes the
/// first message and ignores any other, and answers a message that does not decode with
/// INTERNAL, which tells Envoy the server is broken rather than the request. This layer
/// reads the whole request (bounded) and refuses anything but one whole message with
/// INVALID_ARGUMENT, and turns tonic's decode failures into INVALID_ARGUMENT.
#[derive(Debug, Clone, Copy, Default)]
pub struct UnaryGuard;

impl<S> tower::Layer<S> for UnaryGuard {
    type Service = Guarded<S>;
    fn layer(&self, inner: S) -> Guarded<S> {
        Guarded { inner }
    }
}

/// A service behind [`UnaryGuard`].
#[derive(Debug, Clone)]
pub struct Guarded<S> {
    inner: S,
}

type GrpcRequest = axum::http::Request<tonic::body::Body>;
type GrpcResponse = axum::http::Response<tonic::body::Body>;

impl<S> tower::Service<GrpcRequest> for Guarded<S>
where
    S: tower::Service<GrpcRequest, Response = GrpcResponse> + Clone + Send + 'static,
    S::Future: Send,
{
    type Response = GrpcResponse;
    type Error = S::Error;
    type Future = std::pin::Pin<Box<dyn std::future::Future<Output = Result<GrpcResponse, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: GrpcRequest) -> Self::Future {
        // the clone is ready only after poll_ready; keep the ready one (tower's rule)
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            use http_body_util::BodyExt;
            let (parts, body) = req.into_parts();
            let bytes = match http_body_util::Limited::new(body, MAX_REQUEST).collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(e) => return Ok(refuse(format!("the request could not be read: {e}"))),
            };
            if let Err(why) = one_message(&bytes) {
                return Ok(refuse(why));
            }
            let body = tonic::body::Body::new(http_body_util::Full::new(bytes));
            let response = inner.call(axum::http::Request::from_parts(parts, body)).await?;
            Ok(decode_failure_is_invalid(response))
        })
    }
}

/// Checks that a request body is exactly one whole gRPC message (1 byte flag, 4 bytes
/// length, the message).
fn one_message(body: &[u8]) -> Result<(), String> {
    let Some(header) = body.get(..5) else {
        return Err("a unary call carries exactly one message; this one carries none".into());
    };
    let length = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    match (body.len() - 5).cmp(&length) {
        std::cmp::Ordering::Equal => Ok(()),
        std::cmp::Ordering::Less => Err(format!("the message is cut short: {} of {length} bytes", body.len() - 5)),
        std::cmp::Ordering::Greater => {
            Err("a unary call carries exactly one message; this one carries more than one".into())
        }
    }
}

fn refuse(message: String) -> GrpcResponse {
    Status::invalid_argument(message).into_http()
}

/// tonic answers a message that does not decode with INTERNAL; it is the request's
/// fault, so INVALID_ARGUMENT.
fn decode_failure_is_invalid(response: GrpcResponse) -> GrpcResponse {
    match Status::from_header_map(response.headers()) {
        Some(s) if s.code() == tonic::Code::Internal && s.message().contains("decode") => {
            Status::invalid_argument(s.message().to_string()).into_http()
        }
        _ => response,
    }
}
