//! The rate limit service: Envoy's `RateLimitRequest` as the engine's request, its
//! verdict as Envoy's `RateLimitResponse`. Both front-ends that speak Envoy's messages
//! call it: gRPC's `ShouldRateLimit` (`grpc/rls.rs`) and envoyproxy/ratelimit's `/json`
//! (`http/envoy.rs`), as their `NewJsonHandler` takes the service, not the server.
//!
//! It shares the HTTP API's engine path: the same `Limiter::check`, so the same decisions,
//! headers and errors. A request that cannot be evaluated is `INVALID_ARGUMENT`; a
//! refusal by a fail-closed policy whose store failed is `UNAVAILABLE`, so Envoy's
//! `failure_mode_deny` decides; fail-open answers OK (counted, as everywhere).

use crate::app::AppState;
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
use tonic::Status;

pub mod budget;

/// What a call asks of its request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    /// A decision: charged when allowed (`ShouldRateLimit`).
    Decide,
    /// A check that charges nothing: over the limit when a descriptor's cost does not fit
    /// (Kuadrant's `CheckRateLimit`; Envoy's filter with `x-sluice-mode: check`).
    Check,
    /// A charge never refused: the work is done (Kuadrant's `Report`; Envoy's
    /// `apply_on_stream_done` calls, from a filter with `x-sluice-mode: report`).
    Report,
}

impl Ask {
    /// The ask an Envoy call's `x-sluice-mode` metadata names (none: a decision). Envoy's
    /// rate limit filter sends it from its `grpc_service.initial_metadata`: a filter whose
    /// calls are all checks, or all stream-done reports, says so once.
    pub fn from_metadata(mode: Option<&[u8]>) -> Result<Ask, Status> {
        match mode {
            None | Some(b"decide") => Ok(Ask::Decide),
            Some(b"check") => Ok(Ask::Check),
            Some(b"report") => Ok(Ask::Report),
            Some(other) => Err(Status::invalid_argument(format!(
                "x-sluice-mode {:?} is not one of decide, check, report",
                String::from_utf8_lossy(other)
            ))),
        }
    }
}

/// One decision for Envoy: the engine's verdict as its response, or the status that
/// says why there is none.
pub async fn should_rate_limit(state: &AppState, r: RateLimitRequest) -> Result<RateLimitResponse, Status> {
    counted(state, answer(state, r, Ask::Decide)).await
}

/// `answering` (a `ShouldRateLimit`), counted and timed for their service stats
/// (`app::service_stats`).
pub async fn counted(
    state: &AppState,
    answering: impl std::future::Future<Output = Answer>,
) -> Result<RateLimitResponse, Status> {
    let started = std::time::Instant::now();
    let Answer { reply, store_failed } = answering.await;
    state.service_stats.answered(started.elapsed(), store_failed);
    reply
}

/// What [`answer`] answered, and what it came to for the service stats: `Ok(true)` when a
/// store failure decided it (a failure policy's decision, or fail-closed's refusal),
/// `Ok(false)` when the store or the rules did (rules still to come over xDS too), and
/// `Err(())` when the call itself was wrong. Told by the verdict and the error's type,
/// never by a header or a message's text.
pub struct Answer {
    pub reply: Result<RateLimitResponse, Status>,
    pub store_failed: Result<bool, ()>,
}

/// What `ask` answers for Envoy's request.
pub async fn answer(state: &AppState, r: RateLimitRequest, ask: Ask) -> Answer {
    let req = match request(r) {
        Ok(req) => req,
        Err(s) => return Answer { reply: Err(s), store_failed: Err(()) },
    };
    let engine = state.engine.load_full();
    let decided = match ask {
        Ask::Decide => engine.limiter.check(&req).await,
        Ask::Check => engine.limiter.status(&req).await.map(|v| budget::as_check(v, &req)),
        Ask::Report => match engine.limiter.report(&req).await {
            Ok(()) => {
                let reply = Ok(RateLimitResponse { overall_code: Code::Ok as i32, ..Default::default() });
                return Answer { reply, store_failed: Ok(false) };
            }
            Err(e) => Err(e),
        },
    };
    if ask == Ask::Decide {
        crate::otel::decided(&engine.limiter, &req, &decided);
    }
    match decided {
        Ok(v) if v.outcome == Outcome::Unavailable => Answer {
            reply: Err(Status::unavailable("the rate limit store is unavailable (fail-closed)")),
            store_failed: Ok(true),
        },
        Ok(v) => {
            if ask == Ask::Decide && engine.limiter.rules().global_shadow() && v.shadow_denials().next().is_some() {
                state.service_stats.shadowed();
            }
            Answer { store_failed: Ok(v.degraded.is_some()), reply: Ok(response(&v, &engine, &req)) }
        }
        Err(CheckError::Request(RequestError::UnknownDomain { .. })) if !req.domain.is_empty() => {
            tracing::debug!(domain = %req.domain.escape_debug(), "unknown domain: answered OK");
            state.service_stats.unknown_domain(&req.domain);
            Answer { reply: Ok(unknown_domain(&engine, &req)), store_failed: Ok(false) }
        }
        Err(e) => {
            let store_failed = match &e {
                CheckError::Store(_) => Ok(true),
                CheckError::Request(RequestError::NoRules(_)) => Ok(false),
                CheckError::Request(_) => Err(()),
            };
            Answer { reply: Err(status_of(e)), store_failed }
        }
    }
}

/// The gRPC status of a request that has no verdict.
pub fn status_of(e: CheckError) -> Status {
    match e {
        // rules still to come, as envoyproxy/ratelimit answers before its first config:
        // an error, which Envoy's filter takes as allowed unless `failure_mode_deny`
        CheckError::Request(RequestError::NoRules(why)) => {
            metrics::counter!(crate::app::xds::WITHOUT_RULES, "api" => "grpc").increment(1);
            Status::unavailable(why)
        }
        CheckError::Request(e) => Status::invalid_argument(e.to_string()),
        CheckError::Store(e) => Status::unavailable(e.to_string()),
    }
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
pub fn request(r: RateLimitRequest) -> Result<Request, Status> {
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
pub fn response(v: &Verdict, engine: &crate::app::Engine, req: &Request) -> RateLimitResponse {
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
fn unknown_domain(engine: &crate::app::Engine, req: &Request) -> RateLimitResponse {
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
/// descriptors that were allowed, merged (nested maps merged; for any other value the
/// first descriptor's is kept, as their `mergeMetadata` keeps it).
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

/// Merges `from` into `into`: maps under the same key merge, and a key `into` already
/// has keeps its value (envoyproxy/ratelimit's `mergeMetadata`: the first descriptor that
/// passed names it).
fn merge<'a>(
    into: &mut serde_json::Map<String, serde_json::Value>,
    from: impl Iterator<Item = (&'a String, &'a serde_json::Value)>,
) {
    for (k, v) in from {
        match (into.get_mut(k), v) {
            (Some(serde_json::Value::Object(mine)), serde_json::Value::Object(theirs)) => merge(mine, theirs.iter()),
            (Some(_), _) => {}
            (None, _) => {
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
