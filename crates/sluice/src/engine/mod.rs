//! The engine: a planned request becomes store calls, and the store's answers become one
//! [`Verdict`].
//!
//! [`crate::plan`] turns a request into groups of ops, one group per client tag. Each
//! group is one [`Store::apply`]: all or nothing, one round trip. Groups of different
//! tags run in parallel; if any group refuses, the charges of the groups that allowed are
//! given back, so a request is charged everywhere or nowhere. A group whose store call
//! fails is decided by its policies' failure policy (invariant 7).

use crate::algo::escrow;
use crate::algo::{Decision, Lease, Limit, Op};
use crate::config::Failure;
use crate::fallback::Count;
use crate::grants::{Ledger, Leftovers, Take};
use crate::near_cache::NearCache;
use crate::overrides::{Override, OverrideError, Overrides};
use crate::plan::{Group, Mode, Plan, plan, unevaluated};
use crate::regions::Hurried;
use crate::request::{Request, RequestError};
use crate::rules::{Domain, GrantRule, Rules};
use crate::store::{Commit, Refund, Store, StoreError};
use crate::tag::Tag;
use crate::telemetry;
use crate::time::{Clock, Millis};
use crate::verdict::{Code, DescriptorVerdict, LeaseId, Outcome, Source, Verdict, binding};
use std::sync::Arc;

mod reservations;

/// An op a status reads: its client, the op, its policy's name, its descriptor.
type PeekOp = (Tag, Op, Arc<str>, usize);
pub use reservations::{HeldReservations, Issued, MAX_RESERVED_DESCRIPTORS, MAX_RESERVED_WINDOWS, Reserved};

/// Why a request could not be decided at all.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The request is malformed or names what the rules do not have: a 4xx.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// A store call that no failure policy covers failed (a refund, a release, a status
    /// read).
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How long a fail-closed refusal tells the client to wait, in ms.
const FAIL_CLOSED_RETRY: Millis = 1_000;

/// The leases one client holds on one concurrency policy (see [`Limiter::leases`]).
#[derive(Debug, Clone)]
pub struct HeldLeases {
    /// Which of the request's descriptors the policy belongs to.
    pub descriptor: usize,
    /// The policy's name.
    pub policy: Arc<str>,
    /// Each lease, oldest first: its id (what [`Limiter::release`] takes; it names this
    /// policy's state only) and when it lapses, in ms since the epoch.
    pub leases: Vec<(LeaseId, Millis)>,
}

/// The decision engine: rules, a store and a clock.
///
/// ```
/// use sluice::{Limiter, Request, RulesBuilder, DomainBuilder};
/// use std::time::Duration;
///
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let rules = RulesBuilder::new()
///     .domain(DomainBuilder::new("api").rule([("user", None)], |r| {
///         r.fixed_window("per_minute", 2, Duration::from_secs(60))
///     }))
///     .build()?;
/// let limiter = Limiter::in_memory(rules);
/// let alice = Request::new("api").descriptor([("user", "alice")]);
/// assert!(limiter.check(&alice).await?.allowed());
/// assert!(limiter.check(&alice).await?.allowed());
/// assert!(!limiter.check(&alice).await?.allowed());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
pub struct Limiter {
    rules: Arc<Rules>,
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    near_cache: Option<NearCache>,
    failures: FailureLog,
    overrides: Arc<Overrides>,
    grants: Arc<Ledger>,
    /// The reservations this instance issued, for its gauges.
    issued: Arc<Issued>,
    /// When the grants held were last swept for revocations and idle keys.
    sweep: crate::time::Throttle,
    /// The region's allocator, when limits are shared across regions.
    regions: Option<Arc<crate::regions::Regions>>,
    /// `failure: local`'s counts, and the instances last known.
    fallback: Arc<crate::fallback::Fallback>,
}

/// A region's pool of one global limit of a client, for inspecting it.
#[derive(Debug, Clone)]
pub struct RegionalPool {
    /// Which of the request's descriptors the policy belongs to.
    pub descriptor: usize,
    /// The policy's name.
    pub policy: Arc<str>,
    /// What the region holds of the window now, what its instances took, its demand.
    pub pool: crate::algo::escrow::Pool,
    /// This instance's grants open in the global store for that window.
    pub grants_here: Vec<crate::algo::grant::Open>,
    /// The fleet's window in the global store: units granted to the regions (spent or
    /// not) and left to grant; `None` when it could not be read.
    pub global: Option<(u64, u64)>,
}

/// How often the grants held are swept (for resets, overrides and idle keys): what
/// bounds how long a revoked grant is still spent.
const SWEEP_EVERY: Millis = 250;

impl Limiter {
    /// An engine over compiled rules, a store and a clock.
    pub fn new(rules: Arc<Rules>, store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> Self {
        let overrides = Overrides::new(store.clone(), clock.clone());
        Self {
            rules,
            store,
            clock,
            near_cache: None,
            failures: FailureLog::default(),
            overrides,
            grants: Arc::default(),
            issued: Arc::default(),
            sweep: Default::default(),
            regions: None,
            fallback: Arc::default(),
        }
    }

    /// Decides `failure: local` with `fallback`'s counts (the previous engine's, across a
    /// reload).
    pub fn with_fallback(mut self, fallback: Arc<crate::fallback::Fallback>) -> Self {
        self.fallback = fallback;
        self
    }

    /// What `failure: local` counts, and the instances it knows.
    pub fn fallback(&self) -> &Arc<crate::fallback::Fallback> {
        &self.fallback
    }

    /// Keeps this instance counted in its store's set of instances (for `failure:
    /// local`'s fair part), every [`crate::fallback::HEARTBEAT`], while its fallback is
    /// in use. Needs a Tokio runtime.
    pub fn spawn_heartbeat(&self) {
        self.fallback.spawn_heartbeat(self.store.clone(), &self.rules.tagger, self.clock.clone());
    }

    /// The region's allocator, when limits are shared across regions.
    pub fn regions(&self) -> Option<&Arc<crate::regions::Regions>> {
        self.regions.as_ref()
    }

    /// Counts the decisions of `global: true` limits for `regions`, the allocator that
    /// keeps this region's pools filled (carried across reloads, as grants are).
    pub fn with_regions(mut self, regions: Arc<crate::regions::Regions>) -> Self {
        regions.set_rules(self.rules.global_limits());
        self.regions = Some(regions);
        self
    }

    /// No longer shares limits across regions (a reload took `global_store` away).
    pub fn without_regions(mut self) -> Self {
        self.regions = None;
        self
    }

    /// Uses the quota grants `grants` holds: how a config reload hands the units this
    /// instance holds to the next engine (a limit the reload changed gives its grants
    /// back at its next decision).
    pub fn with_grants(mut self, grants: Arc<Ledger>) -> Self {
        self.grants = grants;
        self
    }

    /// Tracks its reservations in `issued` (the previous engine's, across a reload).
    pub fn with_issued(mut self, issued: Arc<Issued>) -> Self {
        self.issued = issued;
        self
    }

    /// The quota grants this instance holds.
    pub fn grants(&self) -> &Arc<Ledger> {
        &self.grants
    }

    /// Gives back every grant this instance holds (at shutdown: what was not spent is
    /// admitted elsewhere). The last error, if a give-back failed.
    pub async fn return_grants(&self) -> Result<(), StoreError> {
        let now = self.clock.now();
        let mut out = Leftovers::default();
        self.grants.drain(now, &mut out);
        self.grants.settle(&*self.store, out, now).await
    }

    /// Uses `overrides` (kept in this engine's store): how a config reload hands the
    /// overrides in force to the next engine.
    pub fn with_overrides(mut self, overrides: Arc<Overrides>) -> Self {
        self.overrides = overrides;
        self
    }

    /// The stored overrides this engine applies. To see changes made by other instances,
    /// [`Overrides::watch`] them.
    pub fn overrides(&self) -> &Arc<Overrides> {
        &self.overrides
    }

    /// An engine for one process: the memory store (up to a million states) and the
    /// system clock.
    pub fn in_memory(rules: Rules) -> Self {
        let store = Arc::new(crate::store::MemoryStore::new(1_000_000));
        Self::new(Arc::new(rules), store, Arc::new(crate::time::SystemClock))
    }

    /// Remembers refusals in process memory, up to `capacity` of them: a client refused
    /// until a known time is refused from memory until then, without a store call (what
    /// keeps the store calm when an abusive client floods). It never refuses what the
    /// store would allow. Worth it in front of a remote store; the memory store is as
    /// fast as the cache.
    pub fn with_near_cache(mut self, capacity: usize) -> Self {
        self.near_cache = Some(NearCache::new(capacity));
        self
    }

    /// Refusals answered from the near-cache so far.
    pub fn near_cache_hits(&self) -> u64 {
        self.near_cache.as_ref().map_or(0, NearCache::hits)
    }

    /// The `k` clients each rule of `domain` (or only `rule`) refused, or admitted, most
    /// over the last one to two `limiter.top_clients.interval`s, most first, with the
    /// decisions each rule counted (see [`crate::topk`]).
    pub fn top_clients(
        &self,
        domain: &str,
        rule: Option<&str>,
        refused: bool,
        k: usize,
    ) -> Result<Vec<crate::topk::RuleTop>, crate::topk::TopError> {
        use crate::topk::{RuleLists, RuleTop, TopError};
        let Some(rules) = self.rules.top_lists(domain) else {
            let known = self.rules.domain_names().join(", ");
            return Err(TopError::UnknownDomain { domain: domain.chars().take(200).collect(), known });
        };
        if rules.iter().all(|(_, lists)| lists.is_empty()) {
            return Err(TopError::Off);
        }
        if let Some(r) = rule.filter(|r| !rules.iter().any(|(name, _)| name == r)) {
            let known = rules.iter().map(|(name, _)| *name).collect::<Vec<_>>().join(", ");
            return Err(TopError::UnknownRule { rule: r.chars().take(200).collect(), known });
        }
        let now = self.clock.now();
        let tops = rules.into_iter().filter(|(name, _)| rule.is_none_or(|r| r == *name)).map(|(name, lists)| {
            let (clients, decisions) = RuleLists::top(&lists, refused, now, k);
            let capacity = lists.first().map_or(0, |l| l.capacity());
            RuleTop { rule: name.to_string(), decisions, capacity, clients }
        });
        Ok(tops.collect())
    }

    /// The rules in force.
    pub fn rules(&self) -> &Rules {
        &self.rules
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Charges a request's rate policies and decides it (concurrency policies are not
    /// touched: see [`Limiter::acquire`]).
    pub async fn check(&self, req: &Request) -> Result<Verdict, CheckError> {
        self.decide(req, Mode::Charge).await
    }

    /// Reports every matching policy without charging anything (GitHub's
    /// `/rate_limit`). May be served by a replica.
    pub async fn status(&self, req: &Request) -> Result<Verdict, CheckError> {
        self.decide(req, Mode::Peek).await
    }

    /// Takes one lease on every matching concurrency policy; the verdict's `lease` is
    /// what [`Limiter::release`] gives back.
    pub async fn acquire(&self, req: &Request) -> Result<Verdict, CheckError> {
        self.decide(req, Mode::Acquire).await
    }

    /// Takes leases and charges rates together, all or nothing, one store call per
    /// client: what the tower layer does for each request.
    pub async fn admit(&self, req: &Request) -> Result<Verdict, CheckError> {
        self.decide(req, Mode::Admit).await
    }

    /// Gives back everything `verdict` charged (GitHub's rule: a `304 Not Modified` costs
    /// nothing). Charges in a window that has since passed are not given back.
    pub async fn refund(&self, verdict: &Verdict) -> Result<(), StoreError> {
        self.give_back(&verdict.charges, self.clock.now()).await
    }

    /// Gives back a request's cost in the current windows of its rate policies, without
    /// the verdict that charged it (`POST /v1/refund`).
    pub async fn refund_request(&self, req: &Request) -> Result<(), CheckError> {
        let now = self.clock.now();
        let Plan { groups, .. } = plan(&self.rules, &self.overrides.current(), req, Mode::Refund, None, now)?;
        for g in &groups {
            // a refund without its verdict knows no window: it gives back in the current
            // one, which a peek tells
            let current = self.store.peek(g.tag, &g.ops, now).await?;
            let refunds: Vec<Refund> =
                g.ops.iter().zip(current).map(|(o, d)| refund_of(o, o.cost, d.reset_at)).collect();
            self.store.refund(g.tag, &refunds, now).await?;
            self.forget(g.tag, refunds.iter().map(|r| r.key));
        }
        Ok(())
    }

    /// A keyed digest of `bytes` under `limiter.key_secret` (see
    /// [`crate::tag::Tagger::seal`]): for tokens handed out and taken back, such as a
    /// reservation's.
    pub fn seal(&self, bytes: &[u8]) -> u128 {
        self.rules.tagger.seal(bytes)
    }

    /// Releases a lease (idempotent). Returns whether it was held.
    pub async fn release(&self, lease: &LeaseId) -> Result<bool, StoreError> {
        let held = self.store.release(lease.tag, &lease.keys, lease.lease, self.clock.now()).await?;
        if held {
            telemetry::lease_released();
        }
        Ok(held)
    }

    /// Stores an override after checking it against the rules in force: its domain must
    /// exist, its entries must reach a rule, its `policy` (if named) must be one of that
    /// rule's, and the limit it makes of each must be valid. `set_at_ms` is set to now.
    /// In force on this instance at once (see [`Overrides`] for the others). Returns the
    /// override it replaced.
    ///
    /// ```
    /// use sluice::{DomainBuilder, Entry, Limiter, Override, Request, RulesBuilder};
    /// use std::time::Duration;
    ///
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let rules = RulesBuilder::new()
    ///     .domain(DomainBuilder::new("api").rule([("user", None)], |r| {
    ///         r.fixed_window("per_minute", 2, Duration::from_secs(60))
    ///     }))
    ///     .build()?;
    /// let limiter = Limiter::in_memory(rules);
    /// let vip = Override {
    ///     id: "vip-alice".into(),
    ///     domain: "api".into(),
    ///     entries: vec![Entry { key: "user".into(), value: "alice".into() }],
    ///     limit: 100,
    ///     policy: None,
    ///     window: None,
    ///     rate: None,
    ///     expires_at_ms: None,
    ///     reason: "ticket 4711".into(),
    ///     set_at_ms: 0,
    ///     set_by: String::new(),
    ///     all_clients: false,
    /// };
    /// limiter.set_override(vip).await?;
    /// let alice = Request::new("api").descriptor([("user", "alice")]);
    /// let v = limiter.check(&alice).await?;
    /// assert_eq!(v.binding().unwrap().decision.limit, 100);
    /// limiter.reset(&alice, None).await?;
    /// assert_eq!(limiter.status(&alice).await?.binding().unwrap().decision.used, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn set_override(&self, mut o: Override) -> Result<Option<Override>, OverrideError> {
        let now = self.clock.now();
        o.set_at_ms = now;
        o.check(now).map_err(OverrideError::Invalid)?;
        self.fits_rules(&o).map_err(OverrideError::Invalid)?;
        self.overrides.put(&o, self.rules.max_overrides).await
    }

    /// Stores many overrides at once, all or nothing as far as checking goes: each is
    /// checked as [`Limiter::set_override`] checks one (and ids must not repeat), and
    /// when any is refused none is stored and the error lists each refused one. Stored
    /// [`crate::overrides::PAGE`] to a store call; returns how many were stored.
    pub async fn import_overrides(&self, mut all: Vec<Override>) -> Result<usize, OverrideError> {
        let now = self.clock.now();
        let mut seen = std::collections::HashMap::with_capacity(all.len());
        let mut refused = Vec::new();
        for (index, o) in all.iter_mut().enumerate() {
            o.set_at_ms = now;
            let first = *seen.entry(o.id.clone()).or_insert(index);
            let checked = match first == index {
                true => o.check(now).and_then(|()| self.fits_rules(o)),
                false => Err(format!("the id is also that of overrides[{first}]; ids must be unique")),
            };
            if let Err(message) = checked {
                refused.push(crate::overrides::Rejected { index, id: o.id.clone(), message });
            }
        }
        if !refused.is_empty() {
            return Err(OverrideError::Rejected(refused));
        }
        self.overrides.put_all(&all, self.rules.max_overrides).await
    }

    /// Removes the stored override `id`; returns it, or None when there was none.
    pub async fn remove_override(&self, id: &str) -> Result<Option<Override>, OverrideError> {
        self.overrides.remove(id).await
    }

    /// Whether override `o` fits the rules: the message says what does not.
    fn fits_rules(&self, o: &Override) -> Result<(), String> {
        let domain = self.rules.domain(&o.domain).ok_or_else(|| {
            format!("unknown domain '{}'; the config has: {}", o.domain, self.rules.domain_names().join(", "))
        })?;
        // the same bounds as a request naming these entries
        let descriptor = crate::request::Descriptor { entries: o.entries.clone(), ..Default::default() };
        let as_request =
            Request { domain: o.domain.clone(), descriptors: vec![descriptor], hits_addend: None, lenient: false };
        crate::request::validate(&as_request, &self.rules.request_bounds).map_err(|e| e.to_string())?;
        let node = domain
            .find(o.entries.iter().map(|e| (e.key.as_str(), e.value.trim_end_matches('*'))))
            .filter(|n| !n.policies.is_empty())
            .ok_or_else(|| {
                format!(
                    "these entries reach no limit of domain '{}': an override replaces a configured limit",
                    o.domain
                )
            })?;
        let names = || node.policies.iter().map(|p| &*p.name).collect::<Vec<_>>().join(", ");
        if let Some(name) = &o.policy
            && !node.policies.iter().any(|p| *p.name == **name)
        {
            return Err(format!(
                "policy '{name}' is not a limit of the rule these entries reach (its limits: {})",
                names()
            ));
        }
        let targets: Vec<_> =
            node.policies.iter().filter(|p| o.policy.as_deref().is_none_or(|n| n == &*p.name)).collect();
        let takes = |what: &str, algorithm: &str| match targets.iter().any(|p| p.limit.algorithm() == algorithm) {
            true => Ok(()),
            false => Err(format!("`{what}` applies to {algorithm} limits, and none of these is one: {}", names())),
        };
        if o.window.is_some() {
            takes("window", "fixed_window")?;
        }
        if o.rate.is_some() {
            takes("rate", "token_bucket")?;
        }
        for p in targets {
            o.limit_for(p.limit).validate().map_err(|e| format!("policy '{}': {e}", p.name))?;
        }
        Ok(())
    }

    /// Forgets a client's state for every policy its descriptors match (or only the one
    /// named `policy`), leases included: its next request sees the full limit (a global
    /// limit's: less what the other regions hold of the window, `Regions::reset`). Drops the
    /// client from this instance's near-cache, and moves the registry's version so every
    /// watching instance drops its near-cache within [`crate::overrides::PROPAGATION`].
    /// Returns the names of the policies reset.
    pub async fn reset(&self, req: &Request, policy: Option<&str>) -> Result<Vec<Arc<str>>, CheckError> {
        let now = self.clock.now();
        let Plan { descriptors, groups, .. } =
            plan(&self.rules, &self.overrides.current(), req, Mode::Peek, None, now)?;
        let mut names = Vec::new();
        for g in &groups {
            let chosen: Vec<(Op, Arc<str>)> = g
                .ops
                .iter()
                .zip(&g.slots)
                .map(|(op, &(di, pi))| (*op, descriptors[di].policies[pi].name.clone()))
                .filter(|(_, name)| policy.is_none_or(|p| p == &**name))
                .collect();
            if chosen.is_empty() {
                continue;
            }
            let ops: Vec<Op> = chosen.iter().map(|(op, _)| *op).collect();
            // a global limit's on the fleet's window too (`Regions::reset`)
            if let Some(regions) = &self.regions {
                let global = g.ops.iter().enumerate().filter(|(i, _)| g.grants_of(*i).is_some_and(|r| r.global));
                let global: Vec<Op> = global.map(|(_, op)| *op).filter(|op| ops.contains(op)).collect();
                if !global.is_empty() {
                    regions.reset(g.tag, &global, now).await?;
                }
            }
            self.store.reset(g.tag, &ops, now).await?;
            self.grants.forget(g.tag, ops.iter().map(|o| o.key));
            self.forget(g.tag, ops.iter().map(|o| o.key));
            names.extend(chosen.into_iter().map(|(_, name)| name));
        }
        if !names.is_empty() {
            self.overrides.touch().await?;
        }
        Ok(names)
    }

    /// The leases a client holds on each of its concurrency policies, with when each
    /// lapses, for inspecting it. Reads only (may be served by a replica).
    pub async fn leases(&self, req: &Request) -> Result<Vec<HeldLeases>, CheckError> {
        let (now, mut out) = (self.clock.now(), Vec::new());
        for (tag, op, policy, di) in self.peek_ops(req, now)? {
            let Limit::Concurrency { lease_ttl, .. } = op.limit else { continue };
            let held = self.store.leases(tag, op.key, lease_ttl, now).await?;
            let leases =
                held.leases.into_iter().map(|(lease, at)| (LeaseId { tag, lease, keys: vec![op.key] }, at + lease_ttl));
            out.push(HeldLeases { descriptor: di, policy, leases: leases.collect() });
        }
        Ok(out)
    }

    /// Each op a status of `req` would read: its client, the op, its policy's name and
    /// its descriptor.
    fn peek_ops(&self, req: &Request, now: Millis) -> Result<Vec<PeekOp>, CheckError> {
        let Plan { descriptors, groups, .. } =
            plan(&self.rules, &self.overrides.current(), req, Mode::Peek, None, now)?;
        let ops = groups.iter().flat_map(|g| {
            let named =
                |(op, &(di, pi)): (&Op, &(usize, usize))| (g.tag, *op, descriptors[di].policies[pi].name.clone(), di);
            g.ops.iter().zip(&g.slots).map(named)
        });
        Ok(ops.collect())
    }

    /// Each global limit (`global: true`) the request meets: its region's pool of the
    /// window now, and this instance's grants for it in the global store. Never charges;
    /// empty when limits are not shared across regions.
    pub async fn pools(&self, req: &Request) -> Result<Vec<RegionalPool>, CheckError> {
        let Some(regions) = &self.regions else { return Ok(Vec::new()) };
        let (now, mut out) = (self.clock.now(), Vec::new());
        for (tag, op, policy, descriptor) in self.peek_ops(req, now)? {
            if self.rules.is_global(&req.domain, &policy) {
                let (pool, grants_here, global) = regions.inspect(tag, &op, now).await?;
                out.push(RegionalPool { descriptor, policy, pool, grants_here, global });
            }
        }
        Ok(out)
    }

    /// The time now, by this engine's clock.
    pub fn now(&self) -> Millis {
        self.clock.now()
    }

    /// Plans a request, evaluates every group, and makes the verdict.
    async fn decide(&self, req: &Request, mode: Mode) -> Result<Verdict, CheckError> {
        let now = self.clock.now();
        let lease = matches!(mode, Mode::Acquire | Mode::Admit).then(random_lease);
        let Plan { domain, mut descriptors, groups } =
            plan(&self.rules, &self.overrides.current(), req, mode, lease, now)?;
        if let Some(cache) = &self.near_cache {
            cache.sync(self.overrides.generation(), self.store.routing());
        }
        if self.sweep.due(now, SWEEP_EVERY) {
            let mut out = Leftovers::default();
            if self.grants.sweep(self.overrides.generation(), now, &mut out) {
                // revoked: the units go back before this request asks for new ones (its
                // grant call would find them still charged)
                let _ = self.grants.settle(&*self.store, out, now).await;
            } else {
                self.settle_later(out, now);
            }
        }
        let results = futures_util::future::join_all(groups.iter().map(|g| async move {
            // a client decided here while the store failed, in the window running now,
            // is not sent to the store
            match self.finishing_locally(g, now) {
                true => None,
                false => Some(self.evaluate(g, mode, now).await),
            }
        }));
        let mut tally = Tally::default();
        for (g, result) in groups.iter().zip(results.await) {
            let result = match result {
                Some(result) => self.or_failed(g, result, mode, now).await,
                None => Err(self.decide_locally(g, mode.charges(), now)),
            };
            self.record(g, result, mode, &mut descriptors, &mut tally)?;
        }
        let allowed = tally.refused_groups == 0 && !quota_spent(&descriptors);
        let lease = lease.and_then(|l| lease_id(&groups, l));
        if !allowed && mode == Mode::Charge {
            // envoyproxy/ratelimit's rules count a refused call's hits all the same
            self.count_refused(&groups, &descriptors, &mut tally, now).await;
        }
        if !allowed {
            // another tag refused: give back what the allowing tags were charged, and
            // report what is true once it is given back
            self.give_back(&tally.charges, now).await?;
            for ((_, refund), &(di, pi)) in tally.charges.drain(..).zip(&tally.charged) {
                let d = &mut descriptors[di].policies[pi].decision;
                d.used = d.used.saturating_sub(refund.cost);
                d.remaining = d.remaining.saturating_add(refund.cost).min(d.limit);
            }
            if let Some(taken) = lease.as_ref().filter(|_| tally.leased) {
                self.release(taken).await?;
            }
        }
        let outcome = outcome(allowed, &mut descriptors);
        let lease = lease.filter(|_| allowed);
        self.count(domain, req, mode, &descriptors, tally.degraded, lease.is_some());
        let binding = binding(&descriptors);
        Ok(Verdict { outcome, descriptors, binding, lease, degraded: tally.degraded, now, charges: tally.charges })
    }

    /// Charges, as reports (never refused), the hits of a refused call on the policies that
    /// count them (`limiter.count_refused_hits`): those the store decided and did not
    /// charge; their charges in groups that admitted stay (taken out of what is given
    /// back). A window already past its limit is not charged again: every call is refused
    /// there until it ends whatever more it counts, so a flood of refused calls costs one
    /// store call each, not two. A refusal answered from the near-cache is not counted, as
    /// envoyproxy/ratelimit's local cache does not count it. A store that keeps no
    /// reservations (memcached) cannot take a report: nothing is counted there.
    async fn count_refused(&self, groups: &[Group], descriptors: &[DescriptorVerdict], tally: &mut Tally, now: Millis) {
        let counts = |&(di, pi): &(usize, usize)| descriptors[di].policies[pi].count_refused;
        let charges = std::mem::take(&mut tally.charges).into_iter().zip(std::mem::take(&mut tally.charged));
        (tally.charges, tally.charged) = charges.filter(|(_, slot)| !counts(slot)).unzip();
        if !self.store.reservations() {
            return;
        }
        for g in groups {
            let from_store = g.slots.iter().all(|&(di, pi)| descriptors[di].policies[pi].source == Source::Store);
            let refused = g
                .ops
                .iter()
                .zip(&g.slots)
                .any(|(o, &(di, pi))| !o.shadow && !descriptors[di].policies[pi].decision.allowed);
            if !from_store || !refused {
                continue;
            }
            let commits: Vec<Commit> = g
                .ops
                .iter()
                .zip(&g.slots)
                .filter(|(o, slot)| {
                    let d = &descriptors[slot.0].policies[slot.1].decision;
                    counts(slot) && o.cost > 0 && d.used <= d.limit && matches!(o.limit, Limit::FixedWindow { .. })
                })
                .map(|(o, _)| Commit { key: o.key, limit: o.limit, actual: o.cost })
                .collect();
            if commits.is_empty() {
                continue;
            }
            if let Err(e) = self.store.commit(g.tag, crate::algo::reservation::REPORT, &commits, now).await {
                tracing::debug!(error = %e, "the hits of a refused call could not be counted");
            }
        }
    }

    /// Writes one group's decisions into the verdict's slots, and tallies what it means
    /// for the request.
    /// `result`: the group's decisions, or those its failure policies made (and the
    /// strictest policy met) when the store failed.
    fn record(
        &self,
        g: &Group,
        result: Result<(Vec<Decision>, Source), (Vec<Decision>, Failure)>,
        mode: Mode,
        descriptors: &mut [DescriptorVerdict],
        tally: &mut Tally,
    ) -> Result<(), StoreError> {
        let (decisions, source) = result.unwrap_or_else(|(decisions, failure)| {
            tally.degraded = tally.degraded.max(Some(failure));
            (decisions, Source::Degraded)
        });
        if decisions.len() != g.ops.len() {
            return Err(StoreError::protocol(format!("{} decisions for {} ops", decisions.len(), g.ops.len())));
        }
        let allowed = g.ops.iter().zip(&decisions).all(|(o, d)| o.shadow || d.allowed);
        tally.refused_groups += usize::from(!allowed);
        tally.leased |= allowed && source == Source::Store && g.ops.iter().any(|o| o.lease.is_some());
        for (i, ((op, d), &(di, pi))) in g.ops.iter().zip(&decisions).zip(&g.slots).enumerate() {
            let p = &mut descriptors[di].policies[pi];
            p.decision = *d;
            p.source = match source {
                // a refusal from the near-cache stands for its own op; the others of the
                // group were not evaluated
                Source::NearCache(at) if at != i => Source::Skipped,
                Source::Degraded if g.failures[i] == Failure::Local => Source::Local,
                s => s,
            };
            let charged = allowed && d.allowed && op.cost > 0 && op.lease.is_none() && source == Source::Store;
            if charged && mode.charges() {
                tally.charges.push((g.tag, refund_of(op, op.cost, d.reset_at)));
                tally.charged.push((di, pi));
            }
        }
        Ok(())
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
        let by = [Failure::Open, Failure::Local, Failure::Closed].map(|f| degraded == Some(f));
        domain.counters.count(by, leased);
        if !mode.charges() {
            return;
        }
        let ratio = self.rules.near_limit_ratio;
        for (di, p) in descriptors.iter().enumerate().flat_map(|(di, d)| d.policies.iter().map(move |p| (di, p))) {
            let (Some(c), false) =
                (&p.counters, matches!(p.source, Source::Skipped | Source::Degraded | Source::Local))
            else {
                continue;
            };
            let d = &p.decision;
            let near = d.used as f64 >= ratio * d.limit as f64;
            let hits = req.descriptors[di].hits_addend.or(req.hits_addend).unwrap_or(1);
            let entries = || req.descriptors[di].entries.iter().map(|e| (e.key.as_str(), e.value.as_str()));
            let label = p.metric.as_ref().map(|l| l.render(entries()));
            let stat = c.stat_name(label.as_deref(), entries());
            c.count(stat.as_deref(), d.allowed, near, hits);
            if matches!(p.source, Source::NearCache(_)) {
                domain.counters.near_cache.increment(1);
                c.near_cache_hit(stat.as_deref(), hits);
            }
            if let Some(lists) = &c.top {
                lists.count(d.allowed, self.clock.now(), entries);
            }
            if let Some(label) = label {
                telemetry::detailed(&req.domain, &p.name, label, d.allowed || p.shadow);
            }
            if p.shadow && !d.allowed {
                tracing::info!(domain = %req.domain, policy = %p.name, "shadow mode: this request would have been refused");
            }
        }
    }

    /// One group's decisions: from the near-cache when it holds a refusal for one of
    /// the group's ops (no store call), else from the store.
    async fn evaluate(&self, g: &Group, mode: Mode, now: Millis) -> Result<(Vec<Decision>, Source), StoreError> {
        let cache = self.near_cache.as_ref().filter(|_| mode.charges());
        if let Some(cache) = cache {
            for (i, op) in g.ops.iter().enumerate() {
                if let Some(denied) = cache.get(g.tag, op, now) {
                    let mut decisions: Vec<Decision> = g.ops.iter().map(|o| unevaluated(&o.limit)).collect();
                    decisions[i] = denied;
                    return Ok((decisions, Source::NearCache(i)));
                }
            }
        }
        if g.granted() && mode.charges() {
            return Ok((self.evaluate_granted(g, now).await?, Source::Store));
        }
        let mut decisions = match mode {
            Mode::Peek => self.store.peek(g.tag, &g.ops, now).await?,
            _ => self.store.apply(g.tag, &g.ops, now).await?,
        };
        // a status read of a global limit: the fleet's count, not the region's pool's
        if let Some(regions) = self.regions.as_ref().filter(|_| mode == Mode::Peek) {
            for (i, op) in g.ops.iter().enumerate().filter(|(i, _)| g.grants_of(*i).is_some_and(|r| r.global)) {
                if let Some(left) = regions.fleet_status(g.tag, op, now).await {
                    let d = &mut decisions[i];
                    d.remaining = self.grants.held(g.tag, op.key).saturating_add(left).min(d.limit);
                    d.used = d.limit - d.remaining;
                }
            }
        }
        if let Some(cache) = cache {
            for (op, d) in g.ops.iter().zip(&decisions) {
                cache.put(g.tag, op, d, now);
            }
        }
        Ok((decisions, Source::Store))
    }

    /// One group's decisions when some of its ops are decided from quota grants: those
    /// spend units held (or take a grant first), the others are one store call, and
    /// the group stays all or nothing: a refusal puts the spent units back.
    async fn evaluate_granted(&self, g: &Group, now: Millis) -> Result<Vec<Decision>, StoreError> {
        let mut decisions: Vec<Decision> = g.ops.iter().map(|o| unevaluated(&o.limit)).collect();
        let mut spent = Vec::new();
        let mut refused = false;
        let mut out = Leftovers::default();
        for (i, op) in g.ops.iter().enumerate() {
            let Some(rule) = g.grants_of(i) else { continue };
            let d = match self.spend(g.tag, op, rule, (&mut out, now)).await {
                Ok(d) => d,
                Err(e) => {
                    self.settle_later(out, now);
                    self.put_back(g, &spent, &mut decisions, now).await?;
                    return Err(e);
                }
            };
            refused |= !d.allowed && !op.shadow;
            if d.allowed && op.cost > 0 {
                spent.push(i);
            }
            decisions[i] = match self.regions.as_ref().filter(|_| rule.global && d.allowed) {
                Some(regions) => self.fleet_answer(regions, g.tag, op, d, now).await,
                None => d,
            };
        }
        self.settle_later(out, now);
        let rest: Vec<usize> = (0..g.ops.len()).filter(|&i| g.grants_of(i).is_none()).collect();
        if !rest.is_empty() {
            let ops: Vec<Op> = rest.iter().map(|&i| g.ops[i]).collect();
            // a refused request charges nothing: the others only report
            let answer = match refused {
                true => self.store.peek(g.tag, &ops, now).await,
                false => self.store.apply(g.tag, &ops, now).await,
            };
            let answer = match answer {
                Ok(answer) => answer,
                Err(e) => {
                    self.put_back(g, &spent, &mut decisions, now).await?;
                    return Err(e);
                }
            };
            refused |= ops.iter().zip(&answer).any(|(o, d)| !o.shadow && !d.allowed);
            for (i, d) in rest.into_iter().zip(answer) {
                decisions[i] = d;
            }
        }
        if refused {
            self.put_back(g, &spent, &mut decisions, now).await?;
        }
        Ok(decisions)
    }

    /// Spends `op`'s cost from the grants held, taking a grant from the store first when
    /// too few units are held; asks for the next grant in the background when due.
    /// `planned`: when the request was planned (a global limit's op names that time's
    /// window; if that window ends while the decision waits, it is decided in the next,
    /// and its decision names that one).
    async fn spend(
        &self,
        tag: Tag,
        op: &Op,
        rule: &Arc<GrantRule>,
        (out, mut planned): (&mut Leftovers, Millis),
    ) -> Result<Decision, StoreError> {
        let (mut turn, mut granted, began) = (None, None, self.clock.now());
        let (mut hurries, mut op) = (0u8, *op);
        let op = &mut op;
        if let Some(regions) = self.regions.as_ref().filter(|_| rule.global) {
            regions.arrived(tag, op, planned);
        }
        loop {
            // the time now, not when the request came in: a grant's units lapse, and
            // waiting for a turn or the store takes time
            let now = self.clock.now();
            if rule.global && now >= escrow::window_end(&op.limit, planned) {
                op.key = escrow::rekey(op.key, &op.limit, planned, now);
                (planned, granted, hurries) = (now, None, 0);
            }
            match self.grants.take(tag, op, rule, now, out) {
                Take::Spent(d, refresh) => {
                    if let Some(ask) = refresh {
                        self.refresh(tag, ask, rule.clone());
                    }
                    return Ok(d);
                }
                Take::Refused(d) => return Ok(d),
                // one request at a time asks for a key; the others then find its units
                Take::Short(_) if turn.is_none() => {
                    if let Some(d) = self.spent_fleet(tag, (op, rule), planned, now).await {
                        return Ok(d);
                    }
                    match self.turn_within(tag, (op, rule), planned, began).await {
                        Ok(t) => turn = Some(t),
                        Err(refused) => return Ok(refused),
                    }
                }
                // the grant was short: refused, or (a global limit) hurried
                Take::Short(_) if let Some(g) = &granted => {
                    match self.hurry(tag, (op, rule), g, (planned, now, began), &mut hurries).await {
                        Some(answer) => return answer,
                        None => granted = None,
                    }
                }
                Take::Short(_) if self.grants.failed_since(tag, op.key, began) => {
                    let why = "the grant asked for while this decision waited failed; not asked again";
                    return Err(StoreError::unavailable(why));
                }
                Take::Short(ask) => {
                    let waiting = turn.as_ref().map_or(0, |(_, waiting)| *waiting);
                    granted = Some(self.ask_grant(tag, (op, rule), ask, (waiting, now), out).await?);
                }
            }
        }
    }

    /// Asks the store for the grant `ask` of `op` under `rule`, for this request and the
    /// `waiting` behind it.
    async fn ask_grant(
        &self,
        tag: Tag,
        (op, rule): (&Op, &Arc<GrantRule>),
        mut ask: crate::store::GrantAsk,
        (waiting, now): (u64, Millis),
        out: &mut Leftovers,
    ) -> Result<crate::algo::grant::Granted, StoreError> {
        // grants of a limit this one replaced go back first: the store counts them until
        // then
        if !out.give_back.is_empty() {
            let _ = self.grants.settle(&*self.store, std::mem::take(out), now).await;
        }
        // enough for the requests waiting behind this one too (a burst on a key costs a
        // grant call, not one a few requests), within `max`
        let burst = op.cost.saturating_mul(waiting + 1).min(rule.grants.max.unwrap_or(u64::MAX));
        ask.want = ask.want.max(burst);
        let asked = self.grants.ask_store(&*self.store, tag, ask, rule, now, out).await;
        if asked.is_err() {
            self.grants.ask_failed(tag, op.key, self.clock.now());
        }
        asked
    }

    /// The refusal of a global limit's `op` whose window the fleet has spent, as its
    /// region knows (`Regions::fleet_spent`); None for any other.
    async fn spent_fleet(
        &self,
        tag: Tag,
        (op, rule): (&Op, &GrantRule),
        planned: Millis,
        now: Millis,
    ) -> Option<Decision> {
        let regions = self.regions.as_ref().filter(|_| rule.global)?;
        match regions.fleet_spent(tag, op, planned).await {
            true => Some(self.grants.refusal_in(tag, op, escrow::window_end(&op.limit, planned), now)),
            false => None,
        }
    }

    /// The turn to ask for `op`'s key. A global limit's decision waits for it at most
    /// what is left of its wait ([`crate::regions::Regions::wait_bound`] from `began`),
    /// then is refused as waiting (`Retry-After`: the horizon): the turn's holder may be
    /// waiting on the global store itself, and no decision waits longer than its bound.
    async fn turn_within(
        &self,
        tag: Tag,
        (op, rule): (&Op, &GrantRule),
        planned: Millis,
        began: Millis,
    ) -> Result<(tokio::sync::MutexGuard<'_, ()>, u64), Decision> {
        let Some(regions) = self.regions.as_ref().filter(|_| rule.global) else {
            return Ok(self.grants.turn(tag, op.key).await);
        };
        let left = regions.wait_bound().saturating_sub(self.clock.now().saturating_sub(began));
        match tokio::time::timeout(std::time::Duration::from_millis(left), self.grants.turn(tag, op.key)).await {
            Ok(turn) => Ok(turn),
            Err(_) => {
                let now = self.clock.now();
                let refused = self.grants.refusal_in(tag, op, escrow::window_end(&op.limit, planned), now);
                Err(regions.refuse_waiting(tag, op, planned, refused, now))
            }
        }
    }

    /// The grant `g` was short of `op`'s cost: the refusal, unless `rule` is a global
    /// limit, whose region's allocator then asks the global store now while this waits
    /// (bounded, from `began`) for it; `None` once the pool holds the units (take them).
    /// At most twice (`hurries`): the units the first move found may be taken before this
    /// decision's grant (by another instance of the region, or given back); a decision
    /// short after two is refused as waiting, a refusal under the limit as far as anyone
    /// knows.
    async fn hurry(
        &self,
        tag: Tag,
        (op, rule): (&Op, &GrantRule),
        g: &crate::algo::grant::Granted,
        (planned, now, began): (Millis, Millis, Millis),
        hurries: &mut u8,
    ) -> Option<Result<Decision, StoreError>> {
        // built only when refused: a hurry that fills the pool (the usual case) needs none
        let refused = || self.grants.refusal(tag, op, g, now);
        let Some(regions) = self.regions.as_ref().filter(|_| rule.global) else { return Some(Ok(refused())) };
        if *hurries >= 2 {
            return Some(Ok(regions.refuse_waiting(tag, op, planned, refused(), now)));
        }
        *hurries += 1;
        // the decisions queued behind this one are asked for too
        let waiting = self.grants.queued(tag, op.key);
        // what is left of the decision's wait (its turn took some): no decision waits longer
        let left = regions.wait_bound().saturating_sub(now.saturating_sub(began)).max(1);
        match regions.hurry(tag, op, planned, (waiting, left)).await {
            Hurried::Filled | Hurried::Ended => None,
            Hurried::Failed(e) => Some(Err(e)),
            Hurried::Spent => Some(Ok(refused())),
            Hurried::Waiting => Some(Ok(regions.refuse_waiting(tag, op, planned, refused(), now))),
        }
    }

    /// An admitted decision of a global limit as the fleet's count says it: the units
    /// this instance holds, what its region's pool holds unspent, and what the global
    /// store has not granted (as the region last knew it), not what this instance
    /// happens to hold alone (which says `remaining: 0` while the fleet has units).
    async fn fleet_answer(
        &self,
        regions: &crate::regions::Regions,
        tag: Tag,
        op: &Op,
        d: Decision,
        planned: Millis,
    ) -> Decision {
        // the window the decision names (the next one, if the planned one ended)
        let at = d.reset_at.saturating_sub(1);
        let key = escrow::rekey(op.key, &op.limit, planned, at);
        let op = Op { key, ..*op };
        let Some(elsewhere) = regions.fleet_left(tag, &op, at).await else { return d };
        let remaining = self.grants.held(tag, op.key).saturating_add(elsewhere).min(d.limit);
        Decision { remaining, used: d.limit - remaining, ..d }
    }

    /// Asks for a grant in the background.
    fn refresh(&self, tag: Tag, ask: crate::store::GrantAsk, rule: Arc<GrantRule>) {
        let (store, ledger, clock) = (self.store.clone(), self.grants.clone(), self.clock.clone());
        tokio::spawn(async move {
            let (now, mut out, key) = (clock.now(), Leftovers::default(), ask.key);
            match ledger.ask_store(&*store, tag, ask, &rule, now, &mut out).await {
                Ok(_) => {
                    let _ = ledger.settle(&*store, out, now).await;
                }
                Err(_) => ledger.refresh_failed(tag, key),
            }
        });
    }

    /// Gives back, in the background, grants revoked and counts units lapsed.
    fn settle_later(&self, out: Leftovers, now: Millis) {
        if out.give_back.is_empty() {
            return;
        }
        let (store, ledger) = (self.store.clone(), self.grants.clone());
        tokio::spawn(async move {
            let _ = ledger.settle(&*store, out, now).await;
        });
    }

    /// Puts the units the ops at `spent` took from grants back (the group was refused),
    /// and reports their decisions as uncharged.
    async fn put_back(
        &self,
        g: &Group,
        spent: &[usize],
        decisions: &mut [Decision],
        now: Millis,
    ) -> Result<(), StoreError> {
        let mut refunds = Vec::new();
        for &i in spent {
            let (op, d) = (&g.ops[i], &mut decisions[i]);
            let rest = self.grants.put_back(g.tag, op.key, &op.limit, op.cost, d.reset_at);
            if rest > 0 {
                refunds.push(refund_of(op, rest, d.reset_at));
            }
            d.used = d.used.saturating_sub(op.cost);
            d.remaining = d.remaining.saturating_add(op.cost).min(d.limit);
        }
        if !refunds.is_empty() {
            self.store.refund(g.tag, &refunds, now).await?;
        }
        Ok(())
    }

    /// A group's decisions, or when its store call failed those of its failure policies
    /// ([`Self::fail`]).
    async fn or_failed(
        &self,
        g: &Group,
        result: Result<(Vec<Decision>, Source), StoreError>,
        mode: Mode,
        now: Millis,
    ) -> Result<(Vec<Decision>, Source), (Vec<Decision>, Failure)> {
        match result {
            Ok(decided) => {
                self.fallback.store_answered(now);
                self.settle_owed(now);
                Ok(decided)
            }
            Err(e) => Err(self.fail(g, &e, mode.charges(), now).await),
        }
    }

    /// Whether `g` is decided here, though the store may answer: each of its ops is
    /// `failure: local` on this instance's own store (not a global limit), and this
    /// instance decided the client here in the window running now (`crate::fallback`).
    fn finishing_locally(&self, g: &Group, now: Millis) -> bool {
        g.ops.iter().any(|op| self.fallback.deciding(g.tag, op.key, now))
            && g.failures.iter().all(|f| *f == Failure::Local)
            && (0..g.ops.len()).all(|i| !g.grants_of(i).is_some_and(|r| r.global))
    }

    /// A group's decisions by this instance's fair parts, counted here; charged (here,
    /// and to the store once it answers) only if `charge` (not a status read). Tries to
    /// charge the store with what is owed: these clients' requests do not reach it, and
    /// it may answer again.
    fn decide_locally(&self, g: &Group, charge: bool, now: Millis) -> (Vec<Decision>, Failure) {
        let count = Count::owed_if(charge);
        let decided = g.ops.iter().map(|op| self.fallback.decide(g.tag, op, count, now)).collect();
        self.settle_owed(now);
        (decided, Failure::Local)
    }

    /// What was admitted here while the store did not answer is charged to it, in the
    /// background, if any is owed (`crate::fallback::Fallback::settle_due`).
    fn settle_owed(&self, now: Millis) {
        if self.fallback.settle_due(now) {
            let (fallback, store) = (self.fallback.clone(), self.store.clone());
            tokio::spawn(async move {
                fallback.settle(&*store, now).await;
            });
        }
    }

    /// Decisions for a group whose store call failed, by each policy's failure policy:
    /// fail-open allows, fail-closed refuses, `local` counts here. A global limit's
    /// `local` is decided on the global store while it answers (the region's own store
    /// failed), else within the region's share (`crate::regions` `outage`); charged there
    /// only if `charge` (not a status read). Returns them and the stricter policy met.
    async fn fail(&self, g: &Group, e: &StoreError, charge: bool, now: Millis) -> (Vec<Decision>, Failure) {
        self.failures.failed(e, now);
        self.fallback.store_failed();
        let mut worst = Failure::Open;
        let regions = self.regions.as_ref();
        let global = |i: usize| regions.filter(|_| g.grants_of(i).is_some_and(|r| r.global));
        let mut globally = Vec::new();
        let mut decisions: Vec<Decision> = (g.ops.iter().zip(&g.failures).enumerate())
            .map(|(i, (op, &f))| {
                worst = worst.max(f);
                let mut d = unevaluated(&op.limit);
                if f == Failure::Closed && !op.shadow {
                    d.allowed = false;
                    d.reset_at = now + FAIL_CLOSED_RETRY;
                    d.retry_after = Some(FAIL_CLOSED_RETRY);
                }
                if f == Failure::Local {
                    d = match global(i) {
                        Some(r) if r.global_answers() => {
                            globally.push(i);
                            d
                        }
                        Some(r) => self.within_share(r, g.tag, op, charge, now),
                        None => self.fallback.decide(g.tag, op, Count::owed_if(charge), now),
                    };
                }
                d
            })
            .collect();
        if let (Some(r), false) = (regions, globally.is_empty()) {
            // all or nothing: a request another limit refused is not charged there
            let refused = g.ops.iter().zip(&decisions).any(|(o, d)| !o.shadow && !d.allowed);
            let ops: Vec<Op> = globally.iter().map(|&i| g.ops[i]).collect();
            match r.decide_globally(g.tag, &ops, charge && !refused, now).await {
                Ok(decided) => globally.iter().zip(decided).for_each(|(&i, d)| decisions[i] = d),
                Err(_) => {
                    globally.iter().for_each(|&i| decisions[i] = self.within_share(r, g.tag, &g.ops[i], charge, now))
                }
            }
        }
        (decisions, worst)
    }

    /// A global limit's `failure: local` decision while the global store cannot be asked:
    /// within this instance's part of its region's share.
    /// Counted here only if `charge` (not a status read).
    fn within_share(
        &self,
        regions: &crate::regions::Regions,
        tag: Tag,
        op: &Op,
        charge: bool,
        now: Millis,
    ) -> Decision {
        let fair = regions.share(tag, op, self.fallback.instances(), now);
        self.fallback.decide_within(tag, op, fair, if charge { Count::Here } else { Count::Not }, now)
    }

    /// Drops this instance's near-cache entries for states whose quota came back (a
    /// refund, a commit, a report).
    fn forget(&self, tag: Tag, keys: impl Iterator<Item = u64>) {
        if let Some(cache) = &self.near_cache {
            cache.forget(tag, keys);
        }
    }

    /// Gives back `charges`: one store call per client tag, each tag once, however its
    /// charges are spread through the list.
    async fn give_back(&self, charges: &[(Tag, Refund)], now: Millis) -> Result<(), StoreError> {
        let mut by_tag: Vec<(Tag, Vec<Refund>)> = Vec::new();
        for &(tag, refund) in charges {
            // units spent from a grant this instance still holds go back into it
            let cost = self.grants.put_back(tag, refund.key, &refund.limit, refund.cost, refund.window);
            if cost == 0 {
                continue;
            }
            let refund = Refund { cost, ..refund };
            match by_tag.iter_mut().find(|(t, _)| *t == tag) {
                Some((_, refunds)) => refunds.push(refund),
                None => by_tag.push((tag, vec![refund])),
            }
        }
        for (tag, refunds) in by_tag {
            self.store.refund(tag, &refunds, now).await?;
            self.forget(tag, refunds.iter().map(|r| r.key));
        }
        Ok(())
    }
}

/// How often a store outage is summed up in the log.
const FAILURE_LOG_EVERY: Millis = 5_000;

/// The log of decisions left to the failure policy: the first at once, then one line at
/// most every [`FAILURE_LOG_EVERY`] with how many there were since: never a line per
/// request, however many requests an outage meets. (The store's own transitions, failing
/// and answering again, are logged by the resilient wrapper.)
#[derive(Default)]
struct FailureLog {
    line: crate::time::Throttle,
    /// Failed store calls since the last line.
    since: std::sync::atomic::AtomicU64,
}

impl FailureLog {
    fn failed(&self, e: &StoreError, now: Millis) {
        use std::sync::atomic::Ordering::Relaxed;
        let count = self.since.fetch_add(1, Relaxed) + 1;
        if self.line.due(now, FAILURE_LOG_EVERY) {
            self.since.fetch_sub(count, Relaxed);
            tracing::warn!(error = %e, store_calls_failed = count, "the failure policy decided (store calls failing)");
        }
    }
}

/// What the groups of one request add up to.
#[derive(Default)]
struct Tally {
    refused_groups: usize,
    charges: Vec<(Tag, Refund)>,
    /// The `(descriptor, policy)` slot of each charge.
    charged: Vec<(usize, usize)>,
    /// A group taking a lease allowed: the lease is held.
    leased: bool,
    degraded: Option<Failure>,
}

/// Marks each descriptor refused by an enforced policy (over its limit), or by a
/// fail-closed policy whose store did not answer (unavailable), and says what the
/// request gets.
/// Whether the request met limits in quota mode and every one of them refused: then it is
/// refused, as envoyproxy/ratelimit's quota mode refuses it, though each store call
/// allowed (in the store a quota-mode op vetoes nothing), and what was charged goes
/// back as for any refusal. One quota left is enough to go on.
fn quota_spent(descriptors: &[DescriptorVerdict]) -> bool {
    let mut quotas = descriptors.iter().flat_map(|d| &d.policies).filter(|p| p.quota && !p.shadow).peekable();
    quotas.peek().is_some() && quotas.all(|p| !p.decision.allowed)
}

fn outcome(allowed: bool, descriptors: &mut [DescriptorVerdict]) -> Outcome {
    let mut over_limit = false;
    for d in descriptors {
        let refused = |p: &&crate::PolicyDecision| !p.shadow && !p.decision.allowed;
        if d.policies.iter().filter(refused).any(|p| p.source != Source::Degraded) {
            d.code = Code::OverLimit;
            over_limit = true;
        } else if d.policies.iter().any(|p| refused(&p)) {
            d.code = Code::Unavailable;
        }
    }
    match (allowed, over_limit) {
        (true, _) => Outcome::Allowed,
        (false, true) => Outcome::OverLimit,
        // refused only because a fail-closed policy's store failed
        (false, false) => Outcome::Unavailable,
    }
}

/// The id of the lease taken: the group holding the concurrency ops, and only those
/// states (a group may hold rate limits too, when admitting).
fn lease_id(groups: &[Group], lease: Lease) -> Option<LeaseId> {
    let g = groups.iter().find(|g| g.ops.iter().any(|o| o.lease.is_some()))?;
    Some(LeaseId { tag: g.tag, lease, keys: g.ops.iter().filter(|o| o.lease.is_some()).map(|o| o.key).collect() })
}

fn refund_of(op: &Op, cost: u64, window: Millis) -> Refund {
    Refund { key: op.key, limit: op.limit, cost, window }
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
