//! Planning: a request becomes the store operations that decide it. Pure: no IO, no
//! clock, no store.
//!
//! For each descriptor the domain's rules give the policies that apply; each policy
//! becomes an [`Op`] on the state keyed by descriptor and policy, under the client's tag.
//! Ops are grouped by tag: each group is one store call, all or nothing, one round trip
//! (invariant 5). The plan also holds the skeleton of the verdict, one slot per policy,
//! that the engine fills with the store's decisions.

use crate::algo::pool;
use crate::algo::{Decision, Lease, Limit, Op};
use crate::config::Failure;
use crate::overrides::{Override, OverrideSet};
use crate::request::{Descriptor, Request, RequestError, validate};
use crate::rules::{Domain, GrantRule, Node, Policy, Rules};
use crate::tag::Tag;
use crate::time::Millis;
use crate::verdict::{Code, DescriptorVerdict, PolicyDecision, Source};
use std::collections::HashSet;
use std::sync::Arc;

/// What a call does with the matching policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Charge rate policies. Concurrency policies are not touched.
    Charge,
    /// Report every policy without charging.
    Peek,
    /// Take a lease on every concurrency policy.
    Acquire,
    /// Give back rate policies' charges.
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

    /// Whether the mode charges (and so consults and feeds the near-cache).
    pub(crate) fn charges(self) -> bool {
        matches!(self, Mode::Charge | Mode::Admit)
    }

    /// Whether a policy's quota grants `g` go with its op: in the charging modes, which
    /// spend them, and in a status read for a global limit, only to say it is global (its
    /// answer is the fleet's count).
    fn carries(self, g: &GrantRule) -> bool {
        self.charges() || (self == Mode::Peek && g.global)
    }

    /// Whether limits in quota mode decide in it: in decisions and status reads (leases
    /// and refunds have nothing to fall back on).
    fn quota(self) -> bool {
        matches!(self, Mode::Charge | Mode::Peek | Mode::Admit)
    }
}

/// One client tag's share of a request: its ops, and where each decision goes.
#[derive(Debug)]
pub(crate) struct Group {
    pub tag: Tag,
    pub ops: Vec<Op>,
    /// Each op's failure policy.
    pub failures: Vec<Failure>,
    /// Each op's `(descriptor, policy)` slot in the verdict.
    pub slots: Vec<(usize, usize)>,
    /// Each op's quota grants, when it is decided from grants (a charging mode; a status
    /// read's global limits too, to answer with the fleet's count); empty (no allocation)
    /// while no op of the group is (see [`Group::grants_of`]).
    grants: Vec<Option<Arc<GrantRule>>>,
}

impl Group {
    fn new(tag: Tag) -> Self {
        Self { tag, ops: Vec::new(), failures: Vec::new(), slots: Vec::new(), grants: Vec::new() }
    }

    /// Adds one op with its failure policy, verdict slot and grants.
    fn push(&mut self, op: Op, failure: Failure, slot: (usize, usize), grants: Option<Arc<GrantRule>>) {
        if grants.is_some() && self.grants.is_empty() {
            self.grants.resize(self.ops.len(), None);
        }
        if grants.is_some() || !self.grants.is_empty() {
            self.grants.push(grants);
        }
        self.ops.push(op);
        self.failures.push(failure);
        self.slots.push(slot);
    }

    /// Whether an op of the group is decided from quota grants.
    pub fn granted(&self) -> bool {
        !self.grants.is_empty()
    }

    /// The quota grants of op `i`, if it is decided from them.
    pub fn grants_of(&self, i: usize) -> Option<&Arc<GrantRule>> {
        self.grants.get(i).and_then(Option::as_ref)
    }
}

/// A request, planned.
#[derive(Debug)]
pub(crate) struct Plan<'r> {
    pub domain: &'r Domain,
    /// The verdict's descriptors, their decisions still to fill.
    pub descriptors: Vec<DescriptorVerdict>,
    pub groups: Vec<Group>,
}

/// The placeholder decision of a policy that was not evaluated: allowed, nothing known.
pub(crate) fn unevaluated(limit: &Limit) -> Decision {
    let capacity = limit.capacity();
    Decision {
        holds: false,
        allowed: true,
        limit: capacity,
        used: 0,
        remaining: capacity,
        reset_at: 0,
        retry_after: None,
    }
}

/// Validates `req` and plans it in `mode` under the overrides in force at `now`;
/// `lease` is the lease id to take, for the modes that take one.
pub(crate) fn plan<'r>(
    rules: &'r Rules,
    overrides: &OverrideSet,
    req: &Request,
    mode: Mode,
    lease: Option<Lease>,
    now: Millis,
) -> Result<Plan<'r>, RequestError> {
    if let Some(why) = &rules.pending {
        return Err(RequestError::NoRules(why.to_string()));
    }
    let domain = rules
        .domain(&req.domain)
        .ok_or_else(|| RequestError::UnknownDomain { domain: req.domain.chars().take(200).collect() })?;
    validate(req, &rules.request_bounds)?;
    let nodes: Vec<Option<&Node>> = req
        .descriptors
        .iter()
        .map(|d| domain.find(d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str()))))
        .collect();
    // a rule's `replaces` drops the named limits of every other matching rule
    let replaced: HashSet<&str> = nodes.iter().flatten().flat_map(|n| n.replaces.iter().map(|r| &**r)).collect();
    let overrides = overrides.domain(&domain.name);
    let mut plan = Plan { domain, descriptors: Vec::with_capacity(req.descriptors.len()), groups: Vec::new() };
    for (di, (d, node)) in req.descriptors.iter().zip(nodes).enumerate() {
        let cost = if mode == Mode::Peek { 0 } else { d.hits_addend.or(req.hits_addend).unwrap_or(1) };
        let from_request;
        let policies: &[Policy] = match (&d.limit, node) {
            (Some(_), _) => {
                from_request = [request_policy(rules, domain, d, di)?];
                &from_request
            }
            (None, Some(n)) => &n.policies,
            (None, None) => &[],
        };
        let mut entries: Vec<(&str, &str)> = d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str())).collect();
        if let Some(n) = node {
            n.keyed(&mut entries);
        }
        let tag = domain.tag(&rules.tagger, &entries);
        plan.descriptors.push(DescriptorVerdict {
            code: Code::Ok,
            matched: node.is_some() || d.limit.is_some(),
            unlimited: node.is_some_and(|n| n.unlimited),
            metadata: node.and_then(|n| n.metadata.clone()),
            policies: Vec::new(),
        });
        // a limit from the request is not the config's: stored overrides leave it
        let candidates = overrides.filter(|_| d.limit.is_none()).map(|o| o.candidates(&entries)).unwrap_or_default();
        for p in policies.iter().filter(|p| mode.wants(&p.limit) && !replaced.contains(&*p.name)) {
            let o = candidates.find(&p.name, now);
            let mut op = windowed(p, op_for(rules, p, o.map(|o| &**o), &entries, cost, lease, di, req.lenient)?, now);
            op.shadow |= p.quota && mode.quota(); // vetoes nothing in the store: see quota_spent
            let grants = p.grants.clone().filter(|g| mode.carries(g));
            plan.add(tag, op, p, o.cloned(), di, grants);
        }
    }
    Ok(plan)
}

/// `op` of policy `p`, keyed by the window `now` is in when `p` is a global limit: each
/// window of it is a state of its own (see [`pool`]).
fn windowed(p: &Policy, op: Op, now: Millis) -> Op {
    match p.grants.as_ref().is_some_and(|g| g.global) {
        true => Op { key: pool::window_key(op.key, &op.limit, now), ..op },
        false => op,
    }
}

/// The policy of a limit that came with the request (Envoy's descriptor `limit`),
/// lowered to `limiter.request_bounds.limit_per_unit`.
fn request_policy(rules: &Rules, domain: &Domain, d: &Descriptor, di: usize) -> Result<Policy, RequestError> {
    let o = d.limit.expect("called for descriptors with a limit");
    let most = rules.request_bounds.limit_per_unit.unwrap_or(u64::MAX);
    let (limit, window) = (o.requests_per_unit.min(most), o.unit.millis());
    let limit = Limit::FixedWindow { limit, window, aligned: rules.aligned_windows };
    limit.validate().map_err(|source| RequestError::BadLimit { descriptor: di, source })?;
    Ok(Policy {
        name: crate::rules::REQUEST_LIMIT.into(),
        limit,
        shadow: false,
        quota: rules.quota_mode,
        failure: rules.default_failure,
        counters: domain.override_counters.clone(),
        metric: None,
        anonymous: true,
        grants: None,
        count_refused: rules.count_refused,
    })
}

/// The op that applies policy `p` (under override `o`, if any) to the descriptor
/// `entries` of descriptor `di`. A cost above the limit's capacity is an error, unless
/// `lenient` (the limit then refuses it); a capacity of 0 refuses every cost.
#[allow(clippy::too_many_arguments)]
fn op_for(
    rules: &Rules,
    p: &Policy,
    o: Option<&Override>,
    entries: &[(&str, &str)],
    cost: u64,
    lease: Option<Lease>,
    di: usize,
    lenient: bool,
) -> Result<Op, RequestError> {
    let limit = o.map_or(p.limit, |o| o.limit_for(p.limit));
    let is_lease = matches!(limit, Limit::Concurrency { .. });
    let capacity = limit.capacity();
    if cost > capacity && capacity > 0 && !is_lease && !lenient {
        return Err(RequestError::CostAboveCapacity { descriptor: di, cost, policy: p.name.to_string(), capacity });
    }
    Ok(Op {
        // keyed without the limit: an override keeps the client's usage
        key: rules.tagger.state_key(entries.iter().copied(), &p.name, limit.algorithm()),
        limit,
        // a concurrency op takes one lease when the mode takes leases, else reports
        cost: if is_lease { u64::from(lease.is_some()) } else { cost },
        lease: if is_lease { lease } else { None },
        shadow: p.shadow,
    })
}

impl Plan<'_> {
    /// Adds `op` (of policy `p` under override `o`, descriptor `di`) to its tag's group,
    /// and its slot to the verdict.
    fn add(
        &mut self,
        tag: Tag,
        op: Op,
        p: &Policy,
        o: Option<Arc<Override>>,
        di: usize,
        grants: Option<Arc<GrantRule>>,
    ) {
        let verdict = &mut self.descriptors[di];
        let slot = (di, verdict.policies.len());
        verdict.policies.push(PolicyDecision {
            name: p.name.clone(),
            limit: op.limit,
            shadow: p.shadow,
            // quota mode decides here when the op was made to veto nothing for it
            quota: p.quota && op.shadow,
            decision: unevaluated(&op.limit),
            source: Source::Store,
            overridden_by: o,
            counters: Some(p.counters.clone()),
            metric: p.metric.clone(),
            anonymous: p.anonymous,
            count_refused: p.count_refused,
        });
        let first = self.groups.iter().position(|g| g.tag == tag);
        let g = match first.filter(|&i| !self.groups[i].ops.iter().any(|o| o.key == op.key)) {
            Some(i) => &mut self.groups[i],
            // a new tag, or the same state twice in one request (two identical
            // descriptors): a separate call keeps each op's decision its own
            None => {
                self.groups.push(Group::new(tag));
                self.groups.last_mut().expect("just pushed")
            }
        };
        g.push(op, p.failure, slot, grants);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builder::{DomainBuilder, RulesBuilder};
    use crate::config::{LimiterConfig, RateLimitConfig, Replaces, Unit};
    use std::time::Duration;

    /// Plans without overrides.
    fn plan0<'r>(rules: &'r Rules, req: &Request, mode: Mode, lease: Option<Lease>) -> Result<Plan<'r>, RequestError> {
        plan(rules, &OverrideSet::default(), req, mode, lease, 0)
    }

    fn rules() -> Rules {
        let minute = Duration::from_secs(60);
        RulesBuilder::new()
            .domain(
                DomainBuilder::new("api")
                    .rule([("user", None)], |r| {
                        r.fixed_window("minute", 10, minute).concurrency("inflight", 2, Duration::from_secs(30))
                    })
                    .rule([("route", None)], |r| r.token_bucket("route", 5, Duration::from_secs(1), 5)),
            )
            .build()
            .unwrap()
    }

    #[test]
    fn groups_ops_by_client_and_keeps_slots() {
        let rules = rules();
        let req =
            Request::new("api").descriptor([("user", "a")]).descriptor([("route", "/x")]).descriptor([("user", "b")]);
        let p = plan0(&rules, &req, Mode::Charge, None).unwrap();
        // a charge skips concurrency; three descriptors, three different clients
        assert_eq!(p.groups.len(), 3);
        assert!(p.groups.iter().all(|g| g.ops.len() == 1 && g.ops[0].lease.is_none()));
        assert_eq!(p.groups[1].slots, vec![(1, 0)]);
        assert_eq!(&*p.descriptors[1].policies[0].name, "route");
    }

    #[test]
    fn admit_puts_leases_and_rates_of_one_client_in_one_call() {
        let rules = rules();
        let req = Request::new("api").descriptor([("user", "a")]);
        let p = plan0(&rules, &req, Mode::Admit, Some(7)).unwrap();
        assert_eq!(p.groups.len(), 1);
        let ops = &p.groups[0].ops;
        assert_eq!(ops.len(), 2);
        assert_eq!((ops[1].lease, ops[1].cost), (Some(7), 1));
        let peek = plan0(&rules, &req, Mode::Peek, None).unwrap();
        assert!(peek.groups[0].ops.iter().all(|o| o.cost == 0), "a peek charges nothing");
    }

    #[test]
    fn the_same_state_twice_gets_its_own_call() {
        let rules = rules();
        let req = Request::new("api").descriptor([("user", "a")]).descriptor([("user", "a")]);
        let p = plan0(&rules, &req, Mode::Charge, None).unwrap();
        assert_eq!(p.groups.len(), 2);
        assert_eq!(p.groups[0].tag, p.groups[1].tag);
    }

    #[test]
    fn replaces_drops_the_named_limit_of_other_matches() {
        // envoyproxy/ratelimit's `replaces`: a `rate_limit` block of the config file
        let limit = |name: &str, replaces: &[&str]| RateLimitConfig {
            name: Some(crate::config::Name(name.into())),
            unit: Some(Unit::Minute),
            requests_per_unit: Some(10),
            unlimited: false,
            replaces: replaces.iter().map(|r| Replaces { name: crate::config::Name(r.to_string()) }).collect(),
            global: false,
        };
        let mut domain = DomainBuilder::new("api").into_config().unwrap();
        let mut any = crate::config::DescriptorConfig::new("user".into(), None);
        any.rate_limit = Some(limit("minute", &[]));
        let mut vip = crate::config::DescriptorConfig::new("vip".into(), None);
        vip.rate_limit = Some(limit("vip", &["minute"]));
        domain.descriptors = vec![any, vip];
        let rules = Rules::compile(&LimiterConfig::default(), &[domain]).unwrap();
        let req = Request::new("api").descriptor([("user", "x")]).descriptor([("vip", "y")]);
        let p = plan0(&rules, &req, Mode::Charge, None).unwrap();
        let names: Vec<Vec<&str>> =
            p.descriptors.iter().map(|d| d.policies.iter().map(|p| &*p.name).collect()).collect();
        assert_eq!(names, [vec![], vec!["vip"]]);
    }

    #[test]
    fn bad_requests_are_refused_before_any_store() {
        let rules = rules();
        let e = plan0(&rules, &Request::new("nope").descriptor([("user", "a")]), Mode::Charge, None).unwrap_err();
        assert_eq!(e.code(), "unknown_domain");
        let mut req = Request::new("api").descriptor([("user", "a")]).cost(11);
        let e = plan0(&rules, &req, Mode::Charge, None);
        assert!(matches!(e, Err(RequestError::CostAboveCapacity { capacity: 10, .. })), "{e:?}");
        // Envoy's way: the limit refuses what it could never admit
        req.lenient = true;
        assert_eq!(plan0(&rules, &req, Mode::Charge, None).unwrap().groups[0].ops[0].cost, 11);
        let mut req = Request::new("api").descriptor([("user", "a")]);
        let limit = |requests_per_unit| Some(crate::request::LimitOverride { requests_per_unit, unit: Unit::Second });
        req.descriptors[0].limit = limit(1 << 53);
        let e = plan0(&rules, &req, Mode::Charge, None).unwrap_err();
        assert_eq!(e.code(), "bad_limit");
        req.descriptors[0].limit = limit(0);
        assert!(plan0(&rules, &req.cost(3), Mode::Charge, None).is_ok(), "0 refuses every cost, as a limit");
        assert!(plan0(&rules, &Request::new("api"), Mode::Charge, None).is_err());
    }
}
