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
    /// The names of those three (their `LIMIT_LIMIT_HEADER`, `LIMIT_REMAINING_HEADER`,
    /// `LIMIT_RESET_HEADER`).
    pub envoy_ratelimit_names: EnvoyHeaderNames,
    /// `Retry-After` on a refusal (RFC 9110: when to come back). envoyproxy/ratelimit
    /// sends none, so `--ratelimit-env` turns it off.
    pub retry_after: bool,
}

impl Default for HeadersConfig {
    fn default() -> Self {
        Self {
            github: true,
            ietf: true,
            envoy_ratelimit: false,
            envoy_ratelimit_names: EnvoyHeaderNames::default(),
            retry_after: true,
        }
    }
}

/// `headers.envoy_ratelimit_names`: what envoyproxy/ratelimit's three headers are called.
/// Each is a header name (any case; sent in lower case, as HTTP/2 requires), kept for
/// the life of the process, so rendering stays free of copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvoyHeaderNames {
    pub limit: &'static str,
    pub remaining: &'static str,
    pub reset: &'static str,
}

impl Default for EnvoyHeaderNames {
    fn default() -> Self {
        Self { limit: "ratelimit-limit", remaining: "ratelimit-remaining", reset: "ratelimit-reset" }
    }
}

/// [`EnvoyHeaderNames`] as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NamesText {
    limit: Option<String>,
    remaining: Option<String>,
    reset: Option<String>,
}

// by hand: derived, the `&'static str` fields would ask every deserializer to be `'static`
impl<'de> Deserialize<'de> for EnvoyHeaderNames {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let t = NamesText::deserialize(d)?;
        let default = Self::default();
        let name = |given: Option<String>, default: &'static str| {
            given.map_or(Ok(default), header_name).map_err(serde::de::Error::custom)
        };
        Ok(Self {
            limit: name(t.limit, default.limit)?,
            remaining: name(t.remaining, default.remaining)?,
            reset: name(t.reset, default.reset)?,
        })
    }
}

/// A header name, lower-cased and kept once for the process (a reload that names it
/// again takes the same one).
fn header_name(name: String) -> Result<&'static str, String> {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static NAMES: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let name = name.to_ascii_lowercase();
    let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if name.is_empty() || !name.bytes().all(token) {
        return Err(format!("`{name}` is not a header name: letters, digits and !#$%&'*+-.^_`|~ only"));
    }
    let mut names = NAMES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    Ok(match names.get(name.as_str()) {
        Some(kept) => kept,
        None => {
            let kept: &'static str = Box::leak(name.into_boxed_str());
            names.insert(kept);
            kept
        }
    })
}

/// The headers for a verdict, as `(name, value)` pairs in lower case.
pub fn render(v: &Verdict, cfg: &HeadersConfig) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if let Some(f) = v.degraded {
        // decided by the failure policy, not by the store: say so, and invent no numbers
        // (`local` has its own count's, below)
        out.push(("x-sluice-degraded", f.header_value().to_string()));
        if v.outcome == Outcome::Unavailable && cfg.retry_after {
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
        let names = &cfg.envoy_ratelimit_names;
        out.push((names.limit, d.limit.to_string()));
        out.push((names.remaining, d.remaining.to_string()));
        // whole seconds rounded up, as theirs counts (a window's last second reads 1,
        // never 0)
        out.push((names.reset, ceil_secs(d.reset_at.saturating_sub(v.now)).to_string()));
    }
    if let Some(wait) = d.retry_after.filter(|_| v.outcome == Outcome::OverLimit && cfg.retry_after) {
        out.push(("retry-after", ceil_secs(wait).to_string()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoy_header_names_are_header_names() {
        let c: HeadersConfig =
            serde_json::from_str(r#"{"envoy_ratelimit_names": {"remaining": "X-Quota-Left"}}"#).unwrap();
        assert_eq!(c.envoy_ratelimit_names.remaining, "x-quota-left");
        assert_eq!(c.envoy_ratelimit_names.limit, "ratelimit-limit", "the others keep their names");
        let again: HeadersConfig =
            serde_json::from_str(r#"{"envoy_ratelimit_names": {"remaining": "x-QUOTA-left"}}"#).unwrap();
        assert!(std::ptr::eq(again.envoy_ratelimit_names.remaining, c.envoy_ratelimit_names.remaining), "kept once");
        let e = serde_json::from_str::<HeadersConfig>(r#"{"envoy_ratelimit_names": {"reset": "a b"}}"#).unwrap_err();
        assert!(e.to_string().contains("not a header name"), "{e}");
    }
}
