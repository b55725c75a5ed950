//! envoyproxy/ratelimit's own HTTP endpoints, so a deployment that swaps their image for
//! Sluice's keeps its health probes and its clients that cannot speak gRPC:
//!
//! - `POST /json`: a `RateLimitRequest` in protobuf's JSON mapping (camelCase or the
//!   proto's own field names), answered as Envoy's gRPC path answers it (the same
//!   decision, see `rls.rs`), as a `RateLimitResponse` in that mapping: 200 when allowed,
//!   429 over a limit, 400 for a request that is not one (503 when a fail-closed limit's
//!   store failed, where theirs has no answer).
//! - `GET /healthcheck`: `OK` with 200 while the store takes calls, 500 otherwise (and,
//!   with `xds`, 500 until the first push unless `xds.start_without_config`).

use super::api::read_body;
use super::error::error;
use crate::app::AppState;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, rate_limit};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf as pb;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use std::sync::Arc;

/// `POST /json`.
pub async fn json(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let bytes = match read_body(&state, &headers, body).await {
        Ok(bytes) => bytes,
        Err(refused) => return refused,
    };
    let request = match serde_json::from_slice::<JsonRequest>(&bytes).map_err(|e| e.to_string()).and_then(proto) {
        Ok(request) => request,
        Err(e) => {
            let message = format!("the body is not a RateLimitRequest in protobuf's JSON mapping: {e}");
            return error(StatusCode::BAD_REQUEST, "invalid_json", message);
        }
    };
    match crate::rls_messages::should_rate_limit(&state, request).await {
        Ok(r) => {
            let status = match r.overall_code == Code::OverLimit as i32 {
                true => StatusCode::TOO_MANY_REQUESTS,
                false => StatusCode::OK,
            };
            (status, axum::Json(response_json(&r))).into_response()
        }
        Err(s) if s.code() == tonic::Code::Unavailable => {
            error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", s.message().to_string())
        }
        Err(s) => error(StatusCode::BAD_REQUEST, "bad_request", s.message().to_string()),
    }
}

/// `GET /healthcheck`.
pub async fn healthcheck(State(state): State<Arc<AppState>>) -> Response {
    if let Some(why) = state.xds.as_ref().and_then(|x| x.unready()) {
        return (StatusCode::INTERNAL_SERVER_ERROR, format!("{why}\n")).into_response();
    }
    match state.engine.load_full().limiter.store().ready().await {
        true => (StatusCode::OK, "OK").into_response(),
        false => (StatusCode::INTERNAL_SERVER_ERROR, "the rate limit store is not ready\n").into_response(),
    }
}

/// A `RateLimitRequest` in protobuf's JSON mapping.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRequest {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<JsonDescriptor>,
    #[serde(default, rename = "hitsAddend", alias = "hits_addend")]
    hits_addend: Option<Number>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonDescriptor {
    #[serde(default)]
    entries: Vec<JsonEntry>,
    #[serde(default)]
    limit: Option<JsonLimit>,
    #[serde(default, rename = "hitsAddend", alias = "hits_addend")]
    hits_addend: Option<Number>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonEntry {
    key: String,
    #[serde(default)]
    value: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonLimit {
    #[serde(default, rename = "requestsPerUnit", alias = "requests_per_unit")]
    requests_per_unit: Option<Number>,
    #[serde(default)]
    unit: Option<Number>,
}

/// A number as the JSON mapping writes one: a number, or (64-bit integers, enums) text.
#[derive(Deserialize)]
#[serde(untagged)]
enum Number {
    Int(u64),
    Text(String),
}

impl Number {
    /// Its value; `names` reads an enum's names.
    fn read(&self, field: &str, names: fn(&str) -> Option<i32>) -> Result<u64, String> {
        match self {
            Number::Int(n) => Ok(*n),
            Number::Text(t) => t
                .parse()
                .ok()
                .or_else(|| names(t).and_then(|n| u64::try_from(n).ok()))
                .ok_or_else(|| format!("{field}: {t:?} is not a number")),
        }
    }

    fn read_u32(&self, field: &str, names: fn(&str) -> Option<i32>) -> Result<u32, String> {
        u32::try_from(self.read(field, names)?).map_err(|_| format!("{field} is above 2^32 - 1"))
    }
}

fn no_names(_: &str) -> Option<i32> {
    None
}

fn unit_names(name: &str) -> Option<i32> {
    envoy_types::pb::envoy::r#type::v3::RateLimitUnit::from_str_name(name).map(|u| u as i32)
}

/// The request as the gRPC path receives it.
fn proto(r: JsonRequest) -> Result<RateLimitRequest, String> {
    let descriptors = r
        .descriptors
        .into_iter()
        .enumerate()
        .map(|(i, d)| {
            let limit = d
                .limit
                .map(|l| -> Result<_, String> {
                    let field = format!("descriptors[{i}].limit");
                    Ok(rate_limit_descriptor::RateLimitOverride {
                        requests_per_unit: l.requests_per_unit.map_or(Ok(0), |n| n.read_u32(&field, no_names))?,
                        unit: l.unit.map_or(Ok(0), |n| n.read_u32(&format!("{field}.unit"), unit_names))? as i32,
                    })
                })
                .transpose()?;
            let hits_addend = d
                .hits_addend
                .map(|n| {
                    n.read(&format!("descriptors[{i}].hitsAddend"), no_names).map(|value| pb::UInt64Value { value })
                })
                .transpose()?;
            let entries =
                d.entries.into_iter().map(|e| rate_limit_descriptor::Entry { key: e.key, value: e.value }).collect();
            Ok(RateLimitDescriptor { entries, limit, hits_addend })
        })
        .collect::<Result<_, String>>()?;
    let hits_addend = r.hits_addend.map_or(Ok(0), |n| n.read_u32("hitsAddend", no_names))?;
    Ok(RateLimitRequest { domain: r.domain, descriptors, hits_addend })
}

/// A `RateLimitResponse` in protobuf's JSON mapping: camelCase names, enums by name,
/// and fields at their default value left out.
fn response_json(r: &RateLimitResponse) -> Value {
    let code = |c: i32| Code::try_from(c).map_or("UNKNOWN", |c| c.as_str_name());
    let statuses: Vec<Value> = r
        .statuses
        .iter()
        .map(|s| {
            let mut out = Map::new();
            if s.code != 0 {
                out.insert("code".into(), json!(code(s.code)));
            }
            if let Some(l) = &s.current_limit {
                let mut limit = Map::new();
                if !l.name.is_empty() {
                    limit.insert("name".into(), json!(l.name));
                }
                if l.requests_per_unit != 0 {
                    limit.insert("requestsPerUnit".into(), json!(l.requests_per_unit));
                }
                if let Some(unit) = rate_limit::Unit::try_from(l.unit).ok().filter(|_| l.unit != 0) {
                    limit.insert("unit".into(), json!(unit.as_str_name()));
                }
                out.insert("currentLimit".into(), Value::Object(limit));
            }
            if s.limit_remaining != 0 {
                out.insert("limitRemaining".into(), json!(s.limit_remaining));
            }
            if let Some(d) = &s.duration_until_reset {
                let text = match d.nanos {
                    0 => format!("{}s", d.seconds),
                    n => format!("{}.{:03}s", d.seconds, n / 1_000_000),
                };
                out.insert("durationUntilReset".into(), json!(text));
            }
            Value::Object(out)
        })
        .collect();
    let mut out = Map::new();
    out.insert("overallCode".into(), json!(code(r.overall_code)));
    if !statuses.is_empty() {
        out.insert("statuses".into(), Value::Array(statuses));
    }
    let headers: Vec<Value> =
        r.response_headers_to_add.iter().map(|h| json!({"key": h.key, "value": h.value})).collect();
    if !headers.is_empty() {
        out.insert("responseHeadersToAdd".into(), Value::Array(headers));
    }
    if let Some(m) = &r.dynamic_metadata {
        out.insert("dynamicMetadata".into(), struct_json(m));
    }
    Value::Object(out)
}

/// `google.protobuf.Struct` as JSON.
fn struct_json(s: &pb::Struct) -> Value {
    use pb::value::Kind;
    fn value(v: &pb::Value) -> Value {
        match &v.kind {
            None | Some(Kind::NullValue(_)) => Value::Null,
            Some(Kind::NumberValue(n)) => json!(n),
            Some(Kind::StringValue(s)) => json!(s),
            Some(Kind::BoolValue(b)) => json!(b),
            Some(Kind::StructValue(s)) => struct_json(s),
            Some(Kind::ListValue(l)) => Value::Array(l.values.iter().map(value).collect()),
        }
    }
    Value::Object(s.fields.iter().map(|(k, v)| (k.clone(), value(v))).collect())
}
