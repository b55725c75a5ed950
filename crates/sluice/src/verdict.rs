//! The engine's answer to one request: every policy's decision, the one the headers
//! report, and what the request as a whole gets.
//!
//! The engine speaks its own language here ([`Outcome`]); each interface maps it once:
//! the HTTP API to 200/429/503, Envoy's gRPC to OK/OVER_LIMIT/UNAVAILABLE, the tower
//! layer to a refusal or your service's response.

use crate::algo::{Decision, Lease, Limit};
use crate::config::Failure;
use crate::request::RequestError;
use crate::store::Refund;
use crate::tag::Tag;
use crate::telemetry::PolicyCounters;
use crate::time::Millis;
use std::fmt;
use std::sync::Arc;

/// What a request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Every enforced policy allowed (or the store failed and every policy met fails
    /// open).
    Allowed,
    /// An enforced policy refused: over a rate limit or out of leases (HTTP 429).
    OverLimit,
    /// Refused only because the store failed and a fail-closed policy was met (HTTP 503).
    Unavailable,
}

/// Envoy's per-descriptor response codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Ok,
    OverLimit,
    /// Refused by a fail-closed policy because the store did not answer: no limit was
    /// passed. Envoy has no such code: a request refused only so is answered the gRPC
    /// status `UNAVAILABLE` (Envoy's `failure_mode_deny` decides), and such a descriptor
    /// beside one over its limit `OVER_LIMIT`, with `x-sluice-degraded: fail-closed`.
    Unavailable,
}

impl Code {
    /// Envoy's name for the code (`UNAVAILABLE` is Sluice's own, in its HTTP API).
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Ok => "OK",
            Code::OverLimit => "OVER_LIMIT",
            Code::Unavailable => "UNAVAILABLE",
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a decision came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The store's answer.
    Store,
    /// A refusal remembered by the near-cache; the op at this index of its group.
    NearCache(usize),
    /// Not evaluated: another policy of the same client was refused from the near-cache.
    Skipped,
    /// The store failed; the policy's failure policy decided.
    Degraded,
    /// The store failed, and this instance decided by its fair part of the limit
    /// (`failure: local`): a refusal is the limit's, 429.
    Local,
}

/// One policy's decision.
#[derive(Debug, Clone)]
pub struct PolicyDecision {
    pub name: Arc<str>,
    pub limit: Limit,
    pub shadow: bool,
    /// Decided in quota mode: its refusal marks its descriptor, and refuses the request
    /// only if every quota-mode decision of it refused.
    pub quota: bool,
    pub decision: Decision,
    pub source: Source,
    /// The stored override whose limit this is, if one is in force for this client.
    pub overridden_by: Option<Arc<crate::overrides::Override>>,
    /// The policy's counters; None for a limit that came with the request.
    pub(crate) counters: Option<Arc<PolicyCounters>>,
    /// Counted by descriptor too (`detailed_metric`, `value_to_metric`), with this label.
    pub(crate) metric: Option<crate::rules::MetricLabel>,
    /// The config gave this limit no name (`name` is made up, and Envoy's answer names
    /// none).
    pub anonymous: bool,
    /// A refused call's hits are counted all the same (`limiter.count_refused_hits`).
    pub(crate) count_refused: bool,
}

/// One descriptor's outcome.
#[derive(Debug, Clone)]
pub struct DescriptorVerdict {
    /// OVER_LIMIT when an enforced policy of this descriptor refused.
    pub code: Code,
    /// Whether a rule matched this descriptor.
    pub matched: bool,
    /// Whether the matched rule is `unlimited`.
    pub unlimited: bool,
    /// The matched rule's `metadata`.
    pub metadata: Option<Arc<serde_json::Map<String, serde_json::Value>>>,
    pub policies: Vec<PolicyDecision>,
}

impl DescriptorVerdict {
    /// Index of the policy this descriptor's status reports (as [`Verdict::binding`]); a
    /// descriptor whose only limits are in shadow mode reports the most binding of them
    /// (what it would have been told).
    pub fn binding(&self) -> Option<usize> {
        most_binding(self.policies.iter().enumerate(), false)
            .or_else(|| most_binding(self.policies.iter().enumerate(), true))
    }
}

/// The answer to one request.
#[derive(Debug, Clone)]
pub struct Verdict {
    pub outcome: Outcome,
    pub descriptors: Vec<DescriptorVerdict>,
    /// `(descriptor, policy)` of the decision the headers report: the refusal with the
    /// longest wait, else the enforced policy with the least remaining.
    pub binding: Option<(usize, usize)>,
    /// The lease taken ([`crate::Limiter::acquire`], [`crate::Limiter::admit`]), to give
    /// back with [`crate::Limiter::release`].
    pub lease: Option<LeaseId>,
    /// Set when a store call failed and the failure policy decided: the stricter policy
    /// met (`x-sluice-degraded`).
    pub degraded: Option<Failure>,
    /// When the decision was made.
    pub now: Millis,
    /// What was charged, for [`crate::Limiter::refund`].
    pub(crate) charges: Vec<(Tag, Refund)>,
}

impl Verdict {
    /// Whether the request may proceed.
    pub fn allowed(&self) -> bool {
        self.outcome == Outcome::Allowed
    }

    /// The decision the headers report.
    pub fn binding(&self) -> Option<&PolicyDecision> {
        self.binding.map(|(d, p)| &self.descriptors[d].policies[p])
    }

    /// Every enforced (non-shadow) policy decision.
    pub fn enforced(&self) -> impl Iterator<Item = &PolicyDecision> {
        self.descriptors.iter().flat_map(|d| d.policies.iter()).filter(|p| !p.shadow)
    }

    /// Decisions of shadow policies that would have refused the request.
    pub fn shadow_denials(&self) -> impl Iterator<Item = &PolicyDecision> {
        self.descriptors.iter().flat_map(|d| d.policies.iter()).filter(|p| p.shadow && !p.decision.allowed)
    }
}

/// A lease on one client's concurrency policies: names the tag, the lease and each
/// state, so any server sharing the store can release it. Its text form (`Display`,
/// `FromStr`) is what the HTTP API hands out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseId {
    pub tag: Tag,
    pub lease: Lease,
    pub keys: Vec<u64>,
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{:032x}", self.tag, self.lease)?;
        self.keys.iter().try_for_each(|k| write!(f, "{k:016x}"))
    }
}

impl std::str::FromStr for LeaseId {
    type Err = RequestError;
    fn from_str(s: &str) -> Result<Self, RequestError> {
        let bad = || RequestError::BadLeaseId(s.chars().take(200).collect());
        if s.len() < 80 || (s.len() - 64) % 16 != 0 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        let tag = u128::from_str_radix(&s[..32], 16).map_err(|_| bad())?;
        let lease = u128::from_str_radix(&s[32..64], 16).map_err(|_| bad())?;
        let keys = (64..s.len())
            .step_by(16)
            .map(|i| u64::from_str_radix(&s[i..i + 16], 16).map_err(|_| bad()))
            .collect::<Result<_, _>>()?;
        Ok(LeaseId { tag: Tag(tag), lease, keys })
    }
}

/// The refusal with the longest wait; else the enforced policy with the least remaining.
pub(crate) fn binding(descriptors: &[DescriptorVerdict]) -> Option<(usize, usize)> {
    most_binding(
        descriptors
            .iter()
            .enumerate()
            .flat_map(|(di, d)| d.policies.iter().enumerate().map(move |(pi, p)| ((di, pi), p))),
        false,
    )
}

/// The most binding decision among enforced policies (or, with `shadow`, among shadow
/// ones) that were evaluated (by the store, or by this instance's own count under
/// `failure: local`: its numbers are that count's).
fn most_binding<'a, K>(all: impl Iterator<Item = (K, &'a PolicyDecision)>, shadow: bool) -> Option<K> {
    let evaluated = |p: &PolicyDecision| matches!(p.source, Source::Store | Source::NearCache(_) | Source::Local);
    all.filter(|(_, p)| p.shadow == shadow && evaluated(p))
        .min_by_key(|(_, p)| {
            let d = &p.decision;
            // among allowed decisions the headers describe a rate limit, not the lease
            // count; a refusal binds whatever refused
            let lease = d.allowed && matches!(p.limit, Limit::Concurrency { .. });
            (d.allowed, lease, std::cmp::Reverse(d.retry_after.unwrap_or(0)), d.remaining)
        })
        .map(|(at, _)| at)
}
