//! Envoy's rate limit service, `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`:
//! what an Envoy's `envoy.filters.http.ratelimit` filter calls, on `server.grpc`
//! (127.0.0.1:8081 by default), the port envoyproxy/ratelimit uses.
//!
//! It shares the HTTP API's engine path: the same `Limiter::check`, so the same decisions,
//! headers and errors. A request that cannot be evaluated answers `INVALID_ARGUMENT`; a
//! refusal by a fail-closed policy whose store failed answers `UNAVAILABLE`, so Envoy's
//! `failure_mode_deny` decides; fail-open answers OK (counted, as everywhere).

use crate::otel::Call;
use crate::state::AppState;
use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit, rate_limit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf as pb;
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use sluice::algo::Limit;
use sluice::config::Unit;
use sluice::headers;
use sluice::{CheckError, Descriptor, Entry, LimitOverride, Outcome, Request, RequestError, Verdict};
use std::sync::Arc;
use tonic::Status;

/// The gRPC service.
#[derive(Clone)]
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
    Ok(Request { domain: r.domain, descriptors, hits_addend, lenient: true })
}

/// The engine's verdict as Envoy's response. A descriptor's status reports the limit
/// that binds it (a shadow limit when it has no other, as envoyproxy/ratelimit does); an
/// `unlimited` one reports no limit and the most remaining there is, 2^32 - 1.
fn response(v: &Verdict, engine: &crate::state::Engine, req: &Request) -> RateLimitResponse {
    let statuses = v
        .descriptors
        .iter()
        .map(|d| {
            if d.unlimited {
                return DescriptorStatus { code: Code::Ok as i32, limit_remaining: u32::MAX, ..Default::default() };
            }
            let binding = d.binding().map(|i| &d.policies[i]);
            DescriptorStatus {
                code: match d.code {
                    sluice::Code::Ok => Code::Ok,
                    // a descriptor refused by a fail-closed policy beside one over its limit
                    // (a request refused only so is answered UNAVAILABLE): Envoy has no
                    // code for it, and x-sluice-degraded says why
                    sluice::Code::OverLimit | sluice::Code::Unavailable => Code::OverLimit,
                } as i32,
                current_limit: binding.map(|p| RateLimit {
                    // a limit the config did not name is reported without one, as theirs
                    name: if p.anonymous { String::new() } else { p.name.to_string() },
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
        response_headers_to_add: headers::render(v, &engine.headers)
            .into_iter()
            .map(|(k, v)| HeaderValue { key: k.to_string(), value: v, ..Default::default() })
            .collect(),
        dynamic_metadata: engine.envoy.response_dynamic_metadata.then(|| dynamic_metadata(req, Some(v))),
        ..Default::default()
    }
}

/// The answer for a domain no config defines: OK for every descriptor, with no limit, as
/// envoyproxy/ratelimit answers it (a drop-in must not refuse traffic its predecessor
/// let through).
fn unknown_domain(engine: &crate::state::Engine, req: &Request) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: Code::Ok as i32,
        statuses: req
            .descriptors
            .iter()
            .map(|_| DescriptorStatus { code: Code::Ok as i32, ..Default::default() })
            .collect(),
        dynamic_metadata: engine.envoy.response_dynamic_metadata.then(|| dynamic_metadata(req, None)),
        ..Default::default()
    }
}

/// `dynamic_metadata` as envoyproxy/ratelimit writes it (`envoy.response_dynamic_metadata`):
/// the domain, each descriptor's entries as `key=value` (and its `hitsAddend`, `limit`),
/// the request's `hitsAddend`, and `metadata`: the config `metadata` of the rules of the
/// descriptors that were allowed, merged (nested maps merged, a later value replacing).
/// Written from the engine's request, which holds all of Envoy's.
fn dynamic_metadata(req: &Request, v: Option<&Verdict>) -> pb::Struct {
    use serde_json::{Map, Value, json};
    let descriptors: Vec<Value> = req
        .descriptors
        .iter()
        .map(|d| {
            let entries: Vec<String> = d.entries.iter().map(|e| format!("{}={}", e.key, e.value)).collect();
            let mut one = json!({ "entries": entries });
            if let Some(h) = d.hits_addend {
                one["hitsAddend"] = json!(h);
            }
            if let Some(l) = &d.limit {
                let unit = wire_unit(l.unit).as_str_name();
                one["limit"] = json!(format!("requests_per_unit:{} unit:{unit}", l.requests_per_unit));
            }
            one
        })
        .collect();
    let mut out = json!({ "domain": req.domain, "descriptors": descriptors });
    if let Some(h) = req.hits_addend {
        out["hitsAddend"] = json!(h);
    }
    let mut passed = Map::new();
    for d in v.iter().flat_map(|v| &v.descriptors).filter(|d| d.code == sluice::Code::Ok) {
        merge(&mut passed, d.metadata.iter().flat_map(|m| m.iter()));
    }
    if !passed.is_empty() {
        out["metadata"] = Value::Object(passed);
    }
    let Value::Object(fields) = out else { unreachable!("built as an object") };
    pb::Struct { fields: fields.into_iter().map(|(k, v)| (k, pb_value(v))).collect() }
}

/// Merges `from` into `into`: maps under the same key merge, anything else replaces.
fn merge<'a>(
    into: &mut serde_json::Map<String, serde_json::Value>,
    from: impl Iterator<Item = (&'a String, &'a serde_json::Value)>,
) {
    for (k, v) in from {
        match (into.get_mut(k), v) {
            (Some(serde_json::Value::Object(mine)), serde_json::Value::Object(theirs)) => merge(mine, theirs.iter()),
            _ => {
                into.insert(k.clone(), v.clone());
            }
        }
    }
}

/// A JSON value as `google.protobuf.Value`.
fn pb_value(v: serde_json::Value) -> pb::Value {
    use pb::value::Kind;
    use serde_json::Value;
    let kind = match v {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        Value::String(s) => Kind::StringValue(s),
        Value::Array(a) => Kind::ListValue(pb::ListValue { values: a.into_iter().map(pb_value).collect() }),
        Value::Object(o) => {
            Kind::StructValue(pb::Struct { fields: o.into_iter().map(|(k, v)| (k, pb_value(v))).collect() })
        }
    };
    pb::Value { kind: Some(kind) }
}

/// The path of the one method served.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The largest request accepted, as tonic's own default for a decoded message.
const MAX_REQUEST: usize = 4 << 20;

type GrpcRequest = axum::http::Request<tonic::body::Body>;
type GrpcResponse = axum::http::Response<tonic::body::Body>;

impl tonic::server::NamedService for Rls {
    const NAME: &'static str = "envoy.service.ratelimit.v3.RateLimitService";
}

/// The service as tonic's transport calls it, written by hand rather than generated:
/// Envoy's calls are unary, and a generated server decodes through a streaming codec with
/// two 8 KiB buffers a call (a quarter of the server's CPU per decision in a profile),
/// decodes only the first of several messages, and answers a message that does not
/// decode with INTERNAL, which tells Envoy the server is broken rather than the request.
/// This one reads the whole request (bounded), accepts exactly one uncompressed message,
/// decodes it with prost, and answers one message and `grpc-status: 0`; every failure is
/// a gRPC status.
impl tower::Service<GrpcRequest> for Rls {
    type Response = GrpcResponse;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<Box<dyn std::future::Future<Output = Result<GrpcResponse, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: GrpcRequest) -> Self::Future {
        let state = self.state.clone();
        let parent = crate::otel::Parent::from_headers(req.headers());
        Box::pin(async move {
            let work = async { unary(&state, req).await.unwrap_or_else(Status::into_http) };
            let tracer = state.tracer.as_deref();
            Ok(crate::otel::around(tracer, parent, Call::Grpc(SHOULD_RATE_LIMIT), work, grpc_ended).await)
        })
    }
}

/// The gRPC status of an answer (in its headers when it is an error, else OK).
fn grpc_ended(answer: &GrpcResponse) -> crate::otel::Ended {
    let code = answer.headers().get("grpc-status").and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(0);
    crate::otel::Ended::grpc(code)
}

async fn unary(state: &AppState, req: GrpcRequest) -> Result<GrpcResponse, Status> {
    use http_body_util::BodyExt;
    use prost::Message;
    if req.uri().path() != SHOULD_RATE_LIMIT {
        return Err(Status::unimplemented(format!(
            "no method {}; this server answers {SHOULD_RATE_LIMIT}",
            req.uri().path()
        )));
    }
    let given = req.headers().get("authorization").map(|v| v.as_bytes());
    if !state.api_token_matches(given) {
        return Err(Status::unauthenticated("send metadata authorization: Bearer <one of server.api_tokens>"));
    }
    let body = match http_body_util::Limited::new(req.into_body(), MAX_REQUEST).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => return Err(Status::invalid_argument(format!("the request could not be read: {e}"))),
    };
    let message = one_message(&body).map_err(Status::invalid_argument)?;
    let request = RateLimitRequest::decode(message)
        .map_err(|e| Status::invalid_argument(format!("the message is not a RateLimitRequest: {e}")))?;
    let response = should_rate_limit(state, request).await?;
    // one message, uncompressed: flag 0, its length, the message
    let len = response.encoded_len();
    let mut framed = bytes::BytesMut::with_capacity(5 + len);
    bytes::BufMut::put_u8(&mut framed, 0);
    bytes::BufMut::put_u32(&mut framed, len as u32);
    response.encode(&mut framed).expect("the buffer was sized for the message");
    let mut trailers = axum::http::HeaderMap::with_capacity(1);
    trailers.insert("grpc-status", axum::http::HeaderValue::from_static("0"));
    let frames = [
        Ok::<_, std::convert::Infallible>(http_body::Frame::data(framed.freeze())),
        Ok(http_body::Frame::trailers(trailers)),
    ];
    let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
    let mut answer = axum::http::Response::new(tonic::body::Body::new(body));
    answer.headers_mut().insert("content-type", axum::http::HeaderValue::from_static("application/grpc"));
    Ok(answer)
}

/// One decision for Envoy: the engine's verdict as its response, or the status that
/// says why there is none.
pub async fn should_rate_limit(state: &AppState, r: RateLimitRequest) -> Result<RateLimitResponse, Status> {
    let req = request(r)?;
    let engine = state.engine.load_full();
    let decided = engine.limiter.check(&req).await;
    crate::otel::decided(&engine.limiter, &req, &decided);
    match decided {
        Ok(v) if v.outcome == Outcome::Unavailable => {
            Err(Status::unavailable("the rate limit store is unavailable (fail-closed)"))
        }
        Ok(v) => Ok(response(&v, &engine, &req)),
        Err(CheckError::Request(RequestError::UnknownDomain { .. })) if !req.domain.is_empty() => {
            tracing::debug!(domain = %req.domain.escape_debug(), "unknown domain: answered OK");
            Ok(unknown_domain(&engine, &req))
        }
        Err(CheckError::Request(e)) => Err(Status::invalid_argument(e.to_string())),
        Err(CheckError::Store(e)) => Err(Status::unavailable(e.to_string())),
    }
}

/// The one message of a unary call's body (1 byte flag, 4 bytes length, the message).
fn one_message(body: &[u8]) -> Result<&[u8], String> {
    let Some(header) = body.get(..5) else {
        return Err("a unary call carries exactly one message; this one carries none".into());
    };
    if header[0] != 0 {
        return Err("the message is compressed; this server accepts uncompressed messages only".into());
    }
    let length = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    match (body.len() - 5).cmp(&length) {
        std::cmp::Ordering::Equal => Ok(&body[5..]),
        std::cmp::Ordering::Less => Err(format!("the message is cut short: {} of {length} bytes", body.len() - 5)),
        std::cmp::Ordering::Greater => {
            Err("a unary call carries exactly one message; this one carries more than one".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::one_message;

    #[test]
    fn a_body_is_one_whole_uncompressed_message() {
        let framed = |flag: u8, len: u32, body: &[u8]| [&[flag][..], &len.to_be_bytes(), body].concat();
        assert_eq!(one_message(&framed(0, 3, b"abc")), Ok(&b"abc"[..]));
        assert_eq!(one_message(&framed(0, 0, b"")), Ok(&b""[..]));
        for (body, why) in [
            (vec![], "carries none"),
            (vec![0, 0, 0], "carries none"),
            (framed(1, 3, b"abc"), "compressed"),
            (framed(0, 4, b"abc"), "cut short: 3 of 4 bytes"),
            (framed(0, 2, b"abc"), "more than one"),
        ] {
            let e = one_message(&body).unwrap_err();
            assert!(e.contains(why), "{body:?}: {e}");
        }
    }
}
