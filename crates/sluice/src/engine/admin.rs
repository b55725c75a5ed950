//! What the engine does to a client's state besides deciding: refunds (of a verdict, of
//! a request, and what gives the units back), leases released, overrides set and
//! removed, resets, and the reads that inspect a client (its leases, its region's pools).

use super::{CheckError, Limiter, refund_of};
use crate::algo::{Limit, Op};
use crate::overrides::{Misfit, Override, OverrideError};
use crate::plan::{Mode, Plan, plan};
use crate::request::Request;
use crate::store::{Refund, StoreError};
use crate::tag::Tag;
use crate::telemetry;
use crate::time::Millis;
use crate::verdict::{LeaseId, Verdict};
use std::sync::Arc;

/// An op a status reads: its client, the op, its policy's name, its descriptor.
type PeekOp = (Tag, Op, Arc<str>, usize);

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

/// A region's pool of one global limit of a client, for inspecting it.
#[derive(Debug, Clone)]
pub struct RegionalPool {
    /// Which of the request's descriptors the policy belongs to.
    pub descriptor: usize,
    /// The policy's name.
    pub policy: Arc<str>,
    /// The window as this instance sees it: the region's pool (what it holds now, what
    /// its instances took, its demand), this instance's grants, the global store's count
    /// and every region's grants there.
    pub fleet: crate::regions::FleetWindow,
}

impl Limiter {
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
    /// In force on this instance at once (see [`crate::Overrides`] for the others). Returns the
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
        self.fits_rules(&o)?;
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
                true => o.check(now).and_then(|()| self.fits_rules(o).map_err(|m| m.to_string())),
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
    pub(super) fn fits_rules(&self, o: &Override) -> Result<(), Misfit> {
        let domain = self.rules.domain(&o.domain).ok_or_else(|| Misfit::UnknownDomain {
            domain: o.domain.clone(),
            known: self.rules.domain_names().join(", "),
        })?;
        // the same bounds as a request naming these entries
        let descriptor = crate::request::Descriptor { entries: o.entries.clone(), ..Default::default() };
        let as_request =
            Request { domain: o.domain.clone(), descriptors: vec![descriptor], hits_addend: None, lenient: false };
        crate::request::validate(&as_request, &self.rules.request_bounds)?;
        let node = domain
            .find(o.entries.iter().map(|e| (e.key.as_str(), e.value.trim_end_matches('*'))))
            .filter(|n| !n.policies.is_empty())
            .ok_or_else(|| Misfit::NoLimit(o.domain.clone()))?;
        let limits = || node.policies.iter().map(|p| &*p.name).collect::<Vec<_>>().join(", ");
        if let Some(name) = &o.policy
            && !node.policies.iter().any(|p| *p.name == **name)
        {
            return Err(Misfit::NoPolicy { policy: name.clone(), limits: limits() });
        }
        let targets: Vec<_> =
            node.policies.iter().filter(|p| o.policy.as_deref().is_none_or(|n| n == &*p.name)).collect();
        let takes = |field: &'static str, algorithm: &'static str| match targets
            .iter()
            .any(|p| p.limit.algorithm() == algorithm)
        {
            true => Ok(()),
            false => Err(Misfit::Inapplicable { field, algorithm, limits: limits() }),
        };
        if o.window.is_some() {
            takes("window", "fixed_window")?;
        }
        if o.rate.is_some() {
            takes("rate", "token_bucket")?;
        }
        for p in targets {
            let bad = |source| Misfit::BadLimit { policy: p.name.to_string(), source };
            o.limit_for(p.limit).validate().map_err(bad)?;
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
    pub(super) fn peek_ops(&self, req: &Request, now: Millis) -> Result<Vec<PeekOp>, CheckError> {
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
                let fleet = regions.inspect(tag, &op, now).await?;
                out.push(RegionalPool { descriptor, policy, fleet });
            }
        }
        Ok(out)
    }

    /// Drops this instance's near-cache entries for states whose quota came back (a
    /// refund, a commit, a report).
    pub(super) fn forget(&self, tag: Tag, keys: impl Iterator<Item = u64>) {
        if let Some(cache) = &self.near_cache {
            cache.forget(tag, keys);
        }
    }

    /// Gives back `charges`: one store call per client tag, each tag once, however its
    /// charges are spread through the list.
    pub(super) async fn give_back(&self, charges: &[(Tag, Refund)], now: Millis) -> Result<(), StoreError> {
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
            // a global window's pool now holds them: its last read is stale
            if let Some(regions) = &self.regions {
                refunds.iter().for_each(|r| regions.pool_changed(tag, r.key, &r.limit, r.window));
            }
        }
        Ok(())
    }
}
