//! Envoy's rate limit service, `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`:
//! what an Envoy's `envoy.filters.http.ratelimit` filter calls, on `server.grpc`
//! (127.0.0.1:8081 by default), the port envoyproxy/ratelimit uses.
//!
//! It shares the HTTP API's engine path: the same `Limiter::run`, so the same decisions,
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
