//! The JSON form of Envoy's `RateLimitRequest` and `RateLimitResponse`, as the HTTP API
//! speaks it. Field names are accepted in snake_case and lowerCamelCase (protobuf's JSON
//! mapping), and 64-bit numbers as JSON numbers or strings (protobuf writes them as
//! strings).

use serde::{Deserialize, Deserializer, Serialize};
use sluice::algo::Limit;
use sluice::config::Unit;
use sluice::time::ceil_secs;
use sluice::{
    Code, Descriptor, DescriptorVerdict, Entry, LimitOverride, Outcome, PolicyDecision, Request, Source, Verdict,
};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestJson {
    pub domain: String,
    #[serde(default)]
    pub descriptors: Vec<DescriptorJson>,
    #[serde(default, alias = "hitsAddend", deserialize_with = "opt_u64")]
    pub hits_addend: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DescriptorJson {
    #[serde(default)]
    pub entries: Vec<EntryJson>,
    #[serde(default, alias = "hitsAddend", deserialize_with = "opt_u64")]
    pub hits_addend: Option<u64>,
    #[serde(default)]
    pub limit: Option<LimitJson>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EntryJson {
    pub key: String,
    pub value: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitJson {
    #[serde(alias = "requestsPerUnit", deserialize_with = "req_u64")]
    pub requests_per_unit: u64,
    pub unit: String,
}

/// A u64 written as a number or a string.
#[derive(Deserialize)]
#[serde(untagged)]
enum U64 {
    N(u64),
    S(String),
}

fn to_u64<E: serde::de::Error>(v: U64) -> Result<u64, E> {
    match v {
        U64::N(n) => Ok(n),
        U64::S(s) => s.parse().map_err(|_| E::custom(format!("`{s}` is not a whole number from 0 to 2^64-1"))),
    }
}

fn opt_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Option::<U64>::deserialize(d)?.map(to_u64).transpose()
}

fn req_u64<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    to_u64(U64::deserialize(d)?)
}

impl RequestJson {
    /// The engine's request. Fails only on a limit override with an unknown unit.
    pub fn into_request(self) -> Result<Request, String> {
        let mut descriptors = Vec::with_capacity(self.descriptors.len());
        for (i, d) in self.descriptors.into_iter().enumerate() {
            let limit = match d.limit {
                Some(l) => Some(LimitOverride {
                    requests_per_unit: l.requests_per_unit,
                    unit: Unit::parse(&l.unit).map_err(|e| format!("descriptors[{i}].limit: {e}"))?,
                }),
                None => None,
            };
            descriptors.push(Descriptor {
                entries: d.entries.into_iter().map(|e| Entry { key: e.key, value: e.value }).collect(),
                hits_addend: d.hits_addend,
                limit,
            });
        }
        Ok(Request { domain: self.domain, descriptors, hits_addend: self.hits_addend, lenient: false })
    }
}

/// The response to a decision. It borrows the verdict's names: a response is written
/// once, right after it is made.
#[derive(Debug, Serialize)]
pub struct ResponseJson<'a> {
    pub overall_code: &'static str,
    pub statuses: Vec<StatusJson<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<String>,
    /// The reservation made (`POST /v1/reservations`), to commit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reservation_id: Option<String>,
    /// Why a reservation was refused when its units would fit: `too_many_holds` (the
    /// window's holds are full until the first lapses, `retry_after_ms` from now).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<&'static str>,
    /// `fail-open` or `fail-closed` when the store could not answer and the failure
    /// policy decided.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub degraded: Option<&'static str>,
    /// Policies in shadow mode that would have refused this request.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shadow_denials: Vec<&'a str>,
}

#[derive(Debug, Serialize)]
pub struct StatusJson<'a> {
    pub code: &'static str,
    /// Whether a rule (or a request `limit`) matched this descriptor. An unmatched
    /// descriptor is allowed, as Envoy's service allows it.
    pub matched: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub unlimited: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub current_limit: Option<CurrentLimitJson<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit_remaining: Option<u64>,
    /// Protobuf's JSON duration, e.g. `"42s"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_until_reset: Option<String>,
    pub policies: Vec<PolicyJson<'a>>,
}

#[derive(Debug, Serialize)]
pub struct CurrentLimitJson<'a> {
    pub name: &'a str,
    pub requests_per_unit: u64,
    /// Envoy's unit when the period is exactly one; otherwise absent (see `period_ms`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unit: Option<&'static str>,
    pub period_ms: u64,
}

#[derive(Debug, Serialize)]
pub struct PolicyJson<'a> {
    pub name: &'a str,
    pub algorithm: &'static str,
    pub allowed: bool,
    pub shadow: bool,
    pub limit: u64,
    pub used: u64,
    pub remaining: u64,
    /// Epoch seconds, rounded up, as `X-RateLimit-Reset`.
    pub reset: u64,
    pub reset_at_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// `store`, `near_cache` (a refusal remembered in process), `skipped` (not evaluated:
    /// another limit of the client refused from the near-cache) or `degraded` (the store
    /// failed; the failure policy decided, and the numbers are unknown).
    pub source: &'static str,
}

fn policy_json(p: &PolicyDecision) -> PolicyJson<'_> {
    let d = &p.decision;
    PolicyJson {
        name: &p.name,
        algorithm: p.limit.algorithm(),
        allowed: d.allowed,
        shadow: p.shadow,
        limit: d.limit,
        used: d.used,
        remaining: d.remaining,
        reset: ceil_secs(d.reset_at),
        reset_at_ms: d.reset_at,
        retry_after_ms: d.retry_after,
        source: match p.source {
            Source::Store => "store",
            Source::NearCache(_) => "near_cache",
            Source::Skipped => "skipped",
            Source::Degraded => "degraded",
            Source::Local => "local",
        },
    }
}

fn status_json(d: &DescriptorVerdict, now: u64) -> StatusJson<'_> {
    let binding = d.binding().map(|i| &d.policies[i]);
    StatusJson {
        code: d.code.as_str(),
        matched: d.matched,
        unlimited: d.unlimited,
        current_limit: binding.map(|p| CurrentLimitJson {
            // a limit the config did not name is reported without one, as Envoy's
            // service does (the policy keeps the name it is given, below)
            name: if p.anonymous { "" } else { &p.name },
            requests_per_unit: p.limit.capacity(),
            unit: match p.limit {
                Limit::FixedWindow { window, .. } => Unit::from_millis(window).map(Unit::envoy_name),
                _ => None,
            },
            period_ms: p.limit.period(),
        }),
        // an `unlimited` descriptor has the most there is left, as Envoy's service says
        limit_remaining: binding.map(|p| p.decision.remaining).or(d.unlimited.then_some(u64::from(u32::MAX))),
        duration_until_reset: binding.map(|p| format!("{}s", ceil_secs(p.decision.reset_at.saturating_sub(now)))),
        policies: d.policies.iter().map(policy_json).collect(),
    }
}

/// The response body for a verdict.
pub fn response_json(v: &Verdict) -> ResponseJson<'_> {
    let overall = match v.outcome {
        Outcome::Allowed => Code::Ok,
        Outcome::OverLimit => Code::OverLimit,
        Outcome::Unavailable => Code::Unavailable,
    };
    ResponseJson {
        overall_code: overall.as_str(),
        statuses: v.descriptors.iter().map(|d| status_json(d, v.now)).collect(),
        lease_id: v.lease.as_ref().map(|l| l.to_string()),
        reservation_id: None,
        reason: None,
        degraded: v.degraded.map(|f| f.header_value()),
        shadow_denials: v.shadow_denials().map(|p| &*p.name).collect(),
    }
}
