//! The engine: a planned request becomes store calls, and the store's answers become one
//! [`Verdict`].
//!
//! [`crate::plan`] turns a request into groups of ops, one group per client tag. Each
//! group is one [`Store::apply`]: all or nothing, one round trip. Groups of different
//! tags run in parallel; if any group refuses, the charges of the groups that allowed are
//! given back, so a request is charged everywhere or nowhere. A group whose store call
//! fails is decided by its policies' failure policy (invariant 7).

use crate::algo::{Decision, Lease, Limit, Op};
use crate::config::Failure;
use crate::grants::{Ledger, Leftovers};
use crate::near_cache::NearCache;
use crate::overrides::Overrides;
use crate::plan::{Group, Mode, Plan, plan, unevaluated};
use crate::request::{Request, RequestError};
use crate::rules::{Domain, Rules};
use crate::store::{Commit, Refund, Store, StoreError};
use crate::tag::Tag;
use crate::telemetry;
use crate::time::{Clock, Millis};
use crate::verdict::{Code, DescriptorVerdict, LeaseId, Outcome, Source, Verdict, binding};
use std::sync::Arc;

mod admin;
mod failure;
mod granted;
mod reservations;

pub use admin::{HeldLeases, RegionalPool};
use failure::FailureLog;
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
        regions.sweeps(&self.grants);
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
        if let Some(regions) = &self.regions {
            regions.sweeps(&grants);
        }
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

/// Whether the request met limits in quota mode and every one of them refused: then it is
/// refused, as envoyproxy/ratelimit's quota mode refuses it, though each store call
/// allowed (in the store a quota-mode op vetoes nothing), and what was charged goes
/// back as for any refusal. One quota left is enough to go on.
fn quota_spent(descriptors: &[DescriptorVerdict]) -> bool {
    let mut quotas = descriptors.iter().flat_map(|d| &d.policies).filter(|p| p.quota && !p.shadow).peekable();
    quotas.peek().is_some() && quotas.all(|p| !p.decision.allowed)
}

/// Marks each descriptor refused by an enforced policy (over its limit), or by a
/// fail-closed policy whose store did not answer (unavailable), and says what the
/// request gets.
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
