//! The engine: a request's descriptors become store calls, and the store's answers
//! become one verdict.
//!
//! For each descriptor the domain's rules give the policies that apply; each policy
//! becomes an [`Op`] on the state keyed by descriptor and policy, under the client's tag.
//! Ops are grouped by tag and each group is one [`Store::apply`]: all or nothing, one
//! round trip. Groups of different tags run in parallel; if any group refuses, the
//! charges of the groups that allowed are given back, so a request is charged everywhere
//! or nowhere.

use crate::algo::{Decision, Lease, Limit, MAX_EXACT, Op};
use crate::config::{Failure, Unit};
use crate::near_cache::NearCache;
use crate::rules::{Domain, Policy, Rules};
use crate::store::{Refund, Store, StoreError};
use crate::tag::Tag;
use crate::telemetry::{self, PolicyCounters};
use crate::time::{Clock, Millis};
use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

/// Longest descriptor entry key accepted, in bytes.
pub const MAX_KEY_BYTES: usize = 256;
/// Longest descriptor entry value accepted, in bytes.
pub const MAX_VALUE_BYTES: usize = 1024;
/// Most descriptors in one request.
pub const MAX_DESCRIPTORS: usize = 64;
/// Most entries in one descriptor.
pub const MAX_ENTRIES: usize = 16;

/// One `key=value` of a descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub value: String,
}

/// A request-supplied limit that replaces the configured one (Envoy's descriptor
/// `limit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitOverride {
    pub requests_per_unit: u64,
    pub unit: Unit,
}

/// One descriptor of a request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Descriptor {
    pub entries: Vec<Entry>,
    /// This descriptor's cost; None takes the request's.
    pub hits_addend: Option<u64>,
    pub limit: Option<LimitOverride>,
}

/// A rate limit request, as Envoy's `RateLimitRequest` has it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    pub domain: String,
    pub descriptors: Vec<Descriptor>,
    /// The cost of each descriptor that names none; None means 1.
    pub hits_addend: Option<u64>,
}

/// A request the engine refuses to evaluate. Each says what is wrong and what to send.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("unknown domain '{domain}'; configured domains: {known}")]
    UnknownDomain { domain: String, known: String },
    #[error("`descriptors` is empty; send at least one descriptor with at least one entry")]
    NoDescriptors,
    #[error("descriptors[{0}] has no entries; each descriptor needs at least one {{key, value}}")]
    EmptyDescriptor(usize),
    #[error("{0} descriptors sent; at most {MAX_DESCRIPTORS} are accepted")]
    TooManyDescriptors(usize),
    #[error("descriptors[{0}] has {1} entries; at most {MAX_ENTRIES} are accepted")]
    TooManyEntries(usize, usize),
    #[error("descriptors[{descriptor}].entries[{entry}].{field} is {len} bytes; at most {max} are accepted")]
    TooLong { descriptor: usize, entry: usize, field: &'static str, len: usize, max: usize },
    #[error("descriptors[{descriptor}].entries[{entry}].key is empty")]
    EmptyKey { descriptor: usize, entry: usize },
    #[error(
        "descriptors[{descriptor}]: hits_addend {cost} exceeds the capacity {capacity} of policy '{policy}', \
         so it could never be admitted; send a cost of at most {capacity}"
    )]
    CostAboveCapacity { descriptor: usize, cost: u64, policy: String, capacity: u64 },
    #[error(
        "descriptors[{descriptor}]: hits_addend {cost} is larger than {MAX_EXACT} (2^53-1), the largest cost \
         Sluice counts exactly; no limit could ever admit it"
    )]
    CostTooLarge { descriptor: usize, cost: u64 },
    #[error("descriptors[{descriptor}].limit: {message}")]
    BadLimit { descriptor: usize, message: String },
    #[error("lease id '{0}' is not one this service issued")]
    BadLeaseId(String),
}

impl RequestError {
    /// A stable machine-readable code for JSON errors.
    pub fn code(&self) -> &'static str {
        match self {
            RequestError::UnknownDomain { .. } => "unknown_domain",
            RequestError::NoDescriptors | RequestError::EmptyDescriptor(_) => "empty_descriptors",
            RequestError::TooManyDescriptors(_) | RequestError::TooManyEntries(..) => "too_many_descriptors",
            RequestError::TooLong { .. } | RequestError::EmptyKey { .. } => "bad_entry",
            RequestError::CostAboveCapacity { .. } | RequestError::CostTooLarge { .. } => "cost_above_capacity",
            RequestError::BadLimit { .. } => "bad_limit",
            RequestError::BadLeaseId(_) => "bad_lease_id",
        }
    }
}

/// Why a check failed entirely.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What a call does with the matching policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Charge rate policies (`/v1/ratelimit`). Concurrency policies are not touched.
    Charge,
    /// Report every policy without charging (`GET /v1/ratelimit`).
    Peek,
    /// Take a lease on every concurrency policy (`/v1/leases`).
    Acquire,
    /// Give back rate policies' charges (`/v1/refund`).
    Refund,
    /// Take leases on concurrency policies and charge rate policies, all or nothing, in
    /// one store call per client: what the tower layer does for each request.
    Admit,
}

impl Mode {
    fn wants(self, limit: &Limit) -> bool {
        let concurrency = matches!(limit, Limit::Concurrency { .. });
        match self {
            Mode::Peek | Mode::Admit => true,
            Mode::Acquire => concurrency,
            Mode::Charge | Mode::Refund => !concurrency,
        }
    }
}

/// Envoy's response codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Ok,
    OverLimit,
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Code::Ok => "OK",
            Code::OverLimit => "OVER_LIMIT",
        })
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
}

/// One policy's decision.
#[derive(Debug, Clone)]
pub struct PolicyDecision {
    pub name: Arc<str>,
    pub limit: Limit,
    pub shadow: bool,
    pub decision: Decision,
    pub source: Source,
    /// The policy's counters; None for a limit that came with the request.
    pub counters: Option<Arc<PolicyCounters>>,
    /// Counted by descriptor value too (`detailed_metric`).
    pub detailed: bool,
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
    pub policies: Vec<PolicyDecision>,
}

impl DescriptorVerdict {
    /// Index of the policy this descriptor's status reports (as [`Verdict::binding`]).
    pub fn binding(&self) -> Option<usize> {
        most_binding(self.policies.iter().enumerate())
    }
}

/// The answer to one request.
#[derive(Debug, Clone)]
pub struct Verdict {
    pub allowed: bool,
    /// HTTP status: 200; 429 over a limit; 503 refused by a fail-closed policy whose
    /// store failed.
    pub status: u16,
    pub descriptors: Vec<DescriptorVerdict>,
    /// `(descriptor, policy)` of the decision the headers report: the refusal with the
    /// longest wait, else the enforced policy with the least remaining.
    pub binding: Option<(usize, usize)>,
    /// The lease taken, for [`Limiter::release`] (`Mode::Acquire`).
    pub lease: Option<LeaseId>,
    /// Set when a store call failed and the failure policy decided: the stricter policy
    /// met (`x-sluice-degraded`).
    pub degraded: Option<Failure>,
    /// When the decision was made.
    pub now: Millis,
    charges: Vec<(Tag, Refund)>,
}

impl Verdict {
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
/// state, so any server sharing the store can release it.
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

/// One client tag's share of a request: its ops, and where each decision goes.
struct Group {
    tag: Tag,
    ops: Vec<Op>,
    /// Each op's failure policy.
    failures: Vec<Failure>,
    slots: Vec<(usize, usize)>,
}

/// How long a fail-closed refusal tells the client to wait, in ms.
const FAIL_CLOSED_RETRY: Millis = 1_000;

/// The placeholder decision of a policy that was not evaluated: allowed, nothing known.
fn unevaluated(limit: &Limit) -> Decision {
    let capacity = limit.capacity();
    Decision { allowed: true, limit: capacity, used: 0, remaining: capacity, reset_at: 0, retry_after: None }
}

/// The decision engine.
pub struct Limiter {
    rules: Arc<Rules>,
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    near_cache: Option<NearCache>,
    near_cache_capacity: usize,
}

impl Limiter {
    /// An engine over compiled rules, a store and a clock.
    pub fn new(rules: Arc<Rules>, store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> Self {
        Self { rules, store, clock, near_cache: None, near_cache_capacity: 0 }
    }

    /// Remembers refusals in process memory (see [`crate::near_cache`]), up to
    /// `capacity` of them. Worth it in front of a remote store; the memory store is as
    /// fast as the cache.
    pub fn with_near_cache(mut self, capacity: usize) -> Self {
        self.near_cache = Some(NearCache::new(capacity));
        self.near_cache_capacity = capacity;
        self
    }

    /// The same engine (store, clock, near-cache size) with other rules: what a config
    /// reload makes. The near-cache starts empty: refusals remembered under the old rules
    /// are not the new rules' refusals.
    pub fn with_rules(&self, rules: Arc<Rules>) -> Self {
        let next = Self::new(rules, self.store.clone(), self.clock.clone());
        match self.near_cache {
            Some(_) => next.with_near_cache(self.near_cache_capacity),
            None => next,
        }
    }

    /// Refusals answered from the near-cache so far.
    pub fn near_cache_hits(&self) -> u64 {
        self.near_cache.as_ref().map_or(0, NearCache::hits)
    }

    /// The rules in force.
    pub fn rules(&self) -> &Rules {
        &self.rules
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Charges a request's rate policies (`Mode::Charge`).
    pub async fn check(&self, req: &Request) -> Result<Verdict, CheckError> {
        self.run(req, Mode::Charge).await
    }

    /// Evaluates a request in the given mode.
    pub async fn run(&self, req: &Request, mode: Mode) -> Result<Verdict, CheckError> {
        let now = self.clock.now();
        let lease = match mode {
            Mode::Acquire | Mode::Admit => Some(random_lease()),
            _ => None,
        };
        let (domain, mut descriptors, groups) = self.plan(req, mode, lease)?;
        if mode == Mode::Refund {
            for g in &groups {
                let refunds: Vec<Refund> = g.ops.iter().map(|o| refund_of(o, o.cost, 0)).collect();
                let refunds = self.current_windows(g, refunds, now).await?;
                self.store.refund(g.tag, &refunds, now).await?;
                self.forget(g.tag, &refunds);
            }
        }
        let results = match mode {
            Mode::Refund => Vec::new(),
            _ => futures_util::future::join_all(groups.iter().map(|g| self.evaluate(g, mode, now))).await,
        };
        let mut charges = Vec::new();
        let mut group_allowed = Vec::with_capacity(groups.len());
        let mut degraded = None;
        for (g, result) in groups.iter().zip(results) {
            let (decisions, source) = match result {
                Ok(answer) => answer,
                Err(e) => {
                    let failed = self.fail(g, &e, now);
                    degraded = degraded.max(Some(failed.1));
                    (failed.0, Source::Degraded)
                }
            };
            if decisions.len() != g.ops.len() {
                let e = StoreError::Protocol(format!("{} decisions for {} ops", decisions.len(), g.ops.len()));
                return Err(e.into());
            }
            let allowed = g.ops.iter().zip(&decisions).all(|(o, d)| o.shadow || d.allowed);
            group_allowed.push(allowed);
            for (i, ((op, d), &(di, pi))) in g.ops.iter().zip(&decisions).zip(&g.slots).enumerate() {
                let p = &mut descriptors[di].policies[pi];
                p.decision = *d;
                p.source = match source {
                    // a refusal from the near-cache stands for its own op; the others
                    // of the group were not evaluated
                    Source::NearCache(at) if at != i => Source::Skipped,
                    s => s,
                };
                let charging = matches!(mode, Mode::Charge | Mode::Admit) && op.lease.is_none();
                if allowed && d.allowed && op.cost > 0 && charging && source == Source::Store {
                    charges.push((g.tag, refund_of(op, op.cost, d.reset_at)));
                }
            }
        }
        let allowed = group_allowed.iter().all(|&a| a);
        if !allowed && !charges.is_empty() {
            // another tag refused: give back what the allowing tags were charged
            self.give_back(&charges, now).await?;
            charges.clear();
        }
        let mut over_limit = false;
        for d in &mut descriptors {
            if d.policies.iter().any(|p| !p.shadow && !p.decision.allowed && p.source != Source::Degraded) {
                d.code = Code::OverLimit;
                over_limit = true;
            }
        }
        let lease = match (lease, allowed) {
            (Some(lease), true) => groups.iter().find(|g| g.ops.iter().any(|o| o.lease.is_some())).map(|g| LeaseId {
                tag: g.tag,
                lease,
                // only the concurrency states: a group may hold rate limits too (Admit)
                keys: g.ops.iter().filter(|o| o.lease.is_some()).map(|o| o.key).collect(),
            }),
            _ => None,
        };
        let status = match (allowed, over_limit) {
            (true, _) => 200,
            (false, true) => 429,
            // refused only because a fail-closed policy's store failed
            (false, false) => 503,
        };
        self.count(domain, req, mode, &descriptors, degraded, lease.is_some());
        let binding = binding(&descriptors);
        Ok(Verdict { allowed, status, descriptors, binding, lease, degraded, now, charges })
    }

    /// Counts a request's decisions (see [`crate::telemetry`]).
    fn count(
        &self,
        domain: &Domain,
        req: &Request,
        mode: Mode,
        descriptors: &[DescriptorVerdict],
        degraded: Option<Failure>,
        leased: bool,
    ) {
        match degraded {
            Some(Failure::Open) => domain.counters.fail_open.increment(1),
            Some(Failure::Closed) => domain.counters.fail_closed.increment(1),
            None => {}
        }
        if leased {
            domain.counters.leases_acquired.increment(1);
        }
        if !matches!(mode, Mode::Charge | Mode::Admit) {
            return;
        }
        let ratio = self.rules.near_limit_ratio;
        for (di, p) in descriptors.iter().enumerate().flat_map(|(di, d)| d.policies.iter().map(move |p| (di, p))) {
            let (Some(c), false) = (&p.counters, matches!(p.source, Source::Skipped | Source::Degraded)) else {
                continue;
            };
            let d = &p.decision;
            let near = d.used as f64 >= ratio * d.limit as f64;
            c.count(d.allowed, p.shadow, near, matches!(p.source, Source::NearCache(_)));
            if p.detailed {
                let entries = req.descriptors[di].entries.iter().map(|e| (e.key.as_str(), e.value.as_str()));
                telemetry::detailed(&req.domain, &p.name, entries, d.allowed || p.shadow);
            }
            if p.shadow && !d.allowed {
                tracing::info!(domain = %req.domain, policy = %p.name, "shadow mode: this request would have been refused");
            }
        }
    }

    /// One group's decisions: from the near-cache when it holds a refusal for one of
    /// the group's ops (no store call), else from the store.
    async fn evaluate(&self, g: &Group, mode: Mode, now: Millis) -> Result<(Vec<Decision>, Source), StoreError> {
        if g.ops.is_empty() {
            return Ok((Vec::new(), Source::Store));
        }
        if matches!(mode, Mode::Charge | Mode::Admit)
            && let Some(cache) = &self.near_cache
        {
            for (i, op) in g.ops.iter().enumerate() {
                if let Some(denied) = cache.get(g.tag, op, now) {
                    let mut decisions: Vec<Decision> = g.ops.iter().map(|o| unevaluated(&o.limit)).collect();
                    decisions[i] = denied;
                    return Ok((decisions, Source::NearCache(i)));
                }
            }
        }
        let decisions = match mode {
            Mode::Peek => self.store.peek(g.tag, &g.ops, now).await?,
            _ => self.store.apply(g.tag, &g.ops, now).await?,
        };
        if matches!(mode, Mode::Charge | Mode::Admit)
            && let Some(cache) = &self.near_cache
        {
            for (op, d) in g.ops.iter().zip(&decisions) {
                cache.put(g.tag, op, d, now);
            }
        }
        Ok((decisions, Source::Store))
    }

    /// Decisions for a group whose store call failed, by each policy's failure policy:
    /// fail-open allows, fail-closed refuses. Returns them and the stricter policy met.
    fn fail(&self, g: &Group, e: &StoreError, now: Millis) -> (Vec<Decision>, Failure) {
        tracing::warn!(error = %e, "store call failed; applying the failure policy");
        let mut worst = Failure::Open;
        let decisions = g
            .ops
            .iter()
            .zip(&g.failures)
            .map(|(op, &f)| {
                worst = worst.max(f);
                let mut d = unevaluated(&op.limit);
                if f == Failure::Closed && !op.shadow {
                    d.allowed = false;
                    d.reset_at = now + FAIL_CLOSED_RETRY;
                    d.retry_after = Some(FAIL_CLOSED_RETRY);
                }
                d
            })
            .collect();
        (decisions, worst)
    }

    fn forget(&self, tag: Tag, refunds: &[Refund]) {
        if let Some(cache) = &self.near_cache {
            cache.forget(tag, refunds.iter().map(|r| r.key));
        }
    }

    /// Gives back everything `verdict` charged (GitHub's rule: a `304 Not Modified` costs
    /// nothing). Charges in a window that has since passed are not given back.
    pub async fn refund(&self, verdict: &Verdict) -> Result<(), StoreError> {
        self.give_back(&verdict.charges, self.clock.now()).await
    }

    /// Releases a lease (idempotent). Returns whether it was held.
    pub async fn release(&self, lease: &LeaseId) -> Result<bool, StoreError> {
        let held = self.store.release(lease.tag, &lease.keys, lease.lease, self.clock.now()).await?;
        if held {
            telemetry::lease_released();
        }
        Ok(held)
    }

    async fn give_back(&self, charges: &[(Tag, Refund)], now: Millis) -> Result<(), StoreError> {
        let mut tags: Vec<Tag> = charges.iter().map(|(t, _)| *t).collect();
        tags.dedup();
        for tag in tags {
            let refunds: Vec<Refund> = charges.iter().filter(|(t, _)| *t == tag).map(|(_, r)| *r).collect();
            self.store.refund(tag, &refunds, now).await?;
            self.forget(tag, &refunds);
        }
        Ok(())
    }

    /// A stateless refund (`POST /v1/refund`) knows no window: it gives back in the
    /// current one, which a peek tells.
    async fn current_windows(
        &self,
        g: &Group,
        mut refunds: Vec<Refund>,
        now: Millis,
    ) -> Result<Vec<Refund>, StoreError> {
        let status = self.store.peek(g.tag, &g.ops, now).await?;
        for (r, d) in refunds.iter_mut().zip(status) {
            r.window = d.reset_at;
        }
        Ok(refunds)
    }

    /// Validates a request and turns it into per-descriptor verdicts (decisions still to
    /// fill) and per-tag groups of ops.
    fn plan(
        &self,
        req: &Request,
        mode: Mode,
        lease: Option<Lease>,
    ) -> Result<(&Domain, Vec<DescriptorVerdict>, Vec<Group>), RequestError> {
        let rules = &*self.rules;
        let domain = rules.domain(&req.domain).ok_or_else(|| RequestError::UnknownDomain {
            domain: req.domain.chars().take(200).collect(),
            known: rules.domain_names().join(", "),
        })?;
        validate(req)?;
        let base_cost = req.hits_addend.unwrap_or(1);
        let mut nodes = Vec::with_capacity(req.descriptors.len());
        for d in &req.descriptors {
            nodes.push(domain.find(d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str()))));
        }
        let replaced: HashSet<&str> = nodes.iter().flatten().flat_map(|n| n.replaces.iter().map(|r| &**r)).collect();
        let mut descriptors = Vec::with_capacity(req.descriptors.len());
        let mut groups: Vec<Group> = Vec::new();
        for (di, (d, node)) in req.descriptors.iter().zip(nodes).enumerate() {
            let cost = if mode == Mode::Peek { 0 } else { d.hits_addend.unwrap_or(base_cost) };
            let override_policy;
            let policies: &[Policy] = match (&d.limit, node) {
                (Some(o), _) => {
                    let limit =
                        Limit::FixedWindow { limit: o.requests_per_unit, window: o.unit.millis(), aligned: false };
                    limit.validate().map_err(|e| RequestError::BadLimit { descriptor: di, message: e.to_string() })?;
                    override_policy = [Policy {
                        name: "override".into(),
                        limit,
                        shadow: false,
                        failure: rules.default_failure,
                        counters: domain.override_counters.clone(),
                        detailed: false,
                    }];
                    &override_policy
                }
                (None, Some(n)) => &n.policies,
                (None, None) => &[],
            };
            let entries: Vec<(&str, &str)> = d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str())).collect();
            let tag = domain.tag(&rules.tagger, &entries);
            let mut verdict = DescriptorVerdict {
                code: Code::Ok,
                matched: node.is_some() || d.limit.is_some(),
                unlimited: node.is_some_and(|n| n.unlimited),
                policies: Vec::new(),
            };
            for p in policies.iter().filter(|p| mode.wants(&p.limit) && !replaced.contains(&*p.name)) {
                let capacity = p.limit.capacity();
                let is_lease = matches!(p.limit, Limit::Concurrency { .. });
                if cost > capacity && !is_lease {
                    return Err(RequestError::CostAboveCapacity {
                        descriptor: di,
                        cost,
                        policy: p.name.to_string(),
                        capacity,
                    });
                }
                let op = Op {
                    key: rules.tagger.state_key(entries.iter().copied(), &p.name, p.limit.algorithm()),
                    limit: p.limit,
                    cost: if is_lease { u64::from(lease.is_some()) } else { cost },
                    lease: if is_lease { lease } else { None },
                    shadow: p.shadow,
                };
                let slot = (di, verdict.policies.len());
                verdict.policies.push(PolicyDecision {
                    name: p.name.clone(),
                    limit: p.limit,
                    shadow: p.shadow,
                    decision: unevaluated(&p.limit),
                    source: Source::Store,
                    counters: Some(p.counters.clone()),
                    detailed: p.detailed,
                });
                match groups.iter_mut().find(|g| g.tag == tag) {
                    Some(g) if !g.ops.iter().any(|o| o.key == op.key) => {
                        g.ops.push(op);
                        g.failures.push(p.failure);
                        g.slots.push(slot);
                    }
                    // the same state twice in one request (two identical descriptors):
                    // a separate call keeps each op's decision its own
                    _ => groups.push(Group { tag, ops: vec![op], failures: vec![p.failure], slots: vec![slot] }),
                }
            }
            descriptors.push(verdict);
        }
        Ok((domain, descriptors, groups))
    }
}

fn refund_of(op: &Op, cost: u64, window: Millis) -> Refund {
    Refund { key: op.key, limit: op.limit, cost, window }
}

fn validate(req: &Request) -> Result<(), RequestError> {
    if req.descriptors.is_empty() {
        return Err(RequestError::NoDescriptors);
    }
    if req.descriptors.len() > MAX_DESCRIPTORS {
        return Err(RequestError::TooManyDescriptors(req.descriptors.len()));
    }
    for (di, d) in req.descriptors.iter().enumerate() {
        if d.entries.is_empty() {
            return Err(RequestError::EmptyDescriptor(di));
        }
        if d.entries.len() > MAX_ENTRIES {
            return Err(RequestError::TooManyEntries(di, d.entries.len()));
        }
        for (ei, e) in d.entries.iter().enumerate() {
            if e.key.is_empty() {
                return Err(RequestError::EmptyKey { descriptor: di, entry: ei });
            }
            for (field, len, max) in [("key", e.key.len(), MAX_KEY_BYTES), ("value", e.value.len(), MAX_VALUE_BYTES)] {
                if len > max {
                    return Err(RequestError::TooLong { descriptor: di, entry: ei, field, len, max });
                }
            }
        }
        let cost = d.hits_addend.or(req.hits_addend).unwrap_or(1);
        if cost > MAX_EXACT {
            return Err(RequestError::CostAboveCapacity {
                descriptor: di,
                cost,
                policy: "any".into(),
                capacity: MAX_EXACT,
            });
        }
    }
    Ok(())
}

/// The refusal with the longest wait; else the enforced policy with the least remaining.
fn binding(descriptors: &[DescriptorVerdict]) -> Option<(usize, usize)> {
    most_binding(
        descriptors
            .iter()
            .enumerate()
            .flat_map(|(di, d)| d.policies.iter().enumerate().map(move |(pi, p)| ((di, pi), p))),
    )
}

fn most_binding<'a, K>(all: impl Iterator<Item = (K, &'a PolicyDecision)>) -> Option<K> {
    all.filter(|(_, p)| !p.shadow && matches!(p.source, Source::Store | Source::NearCache(_)))
        .min_by_key(|(_, p)| {
            let d = &p.decision;
            // among allowed decisions the headers describe a rate limit, not the lease
            // count; a refusal binds whatever refused
            let lease = d.allowed && matches!(p.limit, Limit::Concurrency { .. });
            (d.allowed, lease, std::cmp::Reverse(d.retry_after.unwrap_or(0)), d.remaining)
        })
        .map(|(at, _)| at)
}

/// A lease id: 128 bits from the OS's random source (a lease id is a capability: who
/// holds it can release the lease). Drawn 4 KiB at a time per thread, so a request does
/// not pay a system call for it.
fn random_lease() -> Lease {
    thread_local! {
        static POOL: std::cell::RefCell<([u8; 4096], usize)> = const { std::cell::RefCell::new(([0; 4096], 4096)) };
    }
    POOL.with_borrow_mut(|(buf, used)| {
        if *used == buf.len() {
            if getrandom::fill(buf).is_err() {
                // no OS randomness: time and address entropy; unique, if guessable
                let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
                return t ^ ((buf.as_ptr() as usize as u128) << 64);
            }
            *used = 0;
        }
        let mut b = [0u8; 16];
        b.copy_from_slice(&buf[*used..*used + 16]);
        *used += 16;
        u128::from_le_bytes(b)
    })
}
