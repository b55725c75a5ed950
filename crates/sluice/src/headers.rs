//! Rate limit headers, all rendered from one verdict.
//!
//! Every header of a response comes from the same store answer (invariant 4, docs/architecture.md), so
//! they cannot contradict each other: a 429 always says `Remaining: 0`, and the reset is
//! the stored one.

use crate::algo::Limit;
use crate::time::ceil_secs;
use crate::verdict::{Outcome, Verdict};
use serde::Deserialize;

/// `headers`: which rate limit headers responses carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HeadersConfig {
    /// GitHub's `X-RateLimit-Limit`, `-Remaining`, `-Used`, `-Reset`, `-Resource`.
    pub github: bool,
    /// IETF draft-ietf-httpapi-ratelimit-headers-10 `RateLimit-Policy` and `RateLimit`.
    pub ietf: bool,
    /// envoyproxy/ratelimit's `RateLimit-Limit`, `RateLimit-Remaining` and
    /// `RateLimit-Reset` (seconds until the reset), their `LIMIT_RESPONSE_HEADERS_ENABLED`.
    pub envoy_ratelimit: bool,
}

impl Default for HeadersConfig {
    fn default() -> Self {
        Self { github: true, ietf: true, envoy_ratelimit: false }
    }
}

/// The headers for a verdict, as `(name, value)` pairs in lower case.
pub fn render(v: &Verdict, cfg: &HeadersConfig) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if let Some(f) = v.degraded {
        // decided by the failure policy, not by the store: say so, and invent no numbers
        out.push(("x-sluice-degraded", f.header_value().to_string()));
        if v.outcome == Outcome::Unavailable {
            out.push(("retry-after", "1".to_string()));
        }
    }
    let Some(b) = v.binding() else { return out };
    let d = &b.decision;
    if cfg.github {
        out.push(("x-ratelimit-limit", d.limit.to_string()));
        out.push(("x-ratelimit-remaining", d.remaining.to_string()));
        out.push(("x-ratelimit-used", d.used.to_string()));
        // rounded up: a client that waits until this second is never early
        out.push(("x-ratelimit-reset", ceil_secs(d.reset_at).to_string()));
        out.push(("x-ratelimit-resource", b.name.to_string()));
    }
    if cfg.ietf {
        let policies: Vec<String> = v
            .enforced()
            .filter(|p| !matches!(p.limit, Limit::Concurrency { .. }))
            .map(|p| format!("\"{}\";q={};w={}", p.name, p.limit.capacity(), ceil_secs(p.limit.period())))
            .collect();
        if !policies.is_empty() {
            out.push(("ratelimit-policy", policies.join(", ")));
        }
        let t = ceil_secs(d.retry_after.unwrap_or_else(|| d.reset_at.saturating_sub(v.now)));
        out.push(("ratelimit", format!("\"{}\";r={};t={}", b.name, d.remaining, t)));
    }
    if cfg.envoy_ratelimit {
        out.push(("ratelimit-limit", d.limit.to_string()));
        out.push(("ratelimit-remaining", d.remaining.to_string()));
        out.push(("ratelimit-reset", (d.reset_at.saturating_sub(v.now) / 1000).to_string()));
    }
    if let Some(wait) = d.retry_after.filter(|_| v.outcome == Outcome::OverLimit) {
        out.push(("retry-after", ceil_secs(wait).to_string()));
    }
    out
}
