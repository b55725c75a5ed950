//! Reservations through the engine (see [`crate::algo::reservation`]): a request's
//! estimate held on every matching fixed window, all or nothing across clients, settled
//! by a commit on any instance; reports; the holds a client has open; and what this
//! instance issued, for its gauges and the live page.

use super::{CheckError, Limiter, Tally, outcome, quota_spent};
use crate::algo::reservation::{Hold, REPORT};
use crate::algo::{Limit, MAX_EXACT, Op};
use crate::plan::{Group, Mode, Plan, plan};
use crate::request::{Request, RequestError};
use crate::rules::policy_digest;
use crate::store::{Commit, Reservation, Settled, StoreError};
use crate::tag::Tag;
use crate::telemetry::{PolicyCounters, ReservationCounters};
use crate::time::Millis;
use crate::verdict::{DescriptorVerdict, Source, Verdict, binding};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

/// The reservations open on one fixed window of a client, for inspecting it.
#[derive(Debug, Clone)]
pub struct HeldReservations {
    /// Which of the request's descriptors the policy belongs to.
    pub descriptor: usize,
    /// The policy's name.
    pub policy: Arc<str>,
    /// Each hold: its number, units, and when it lapses (ms since the epoch).
    pub holds: Vec<Hold>,
}

/// Reservations an instance tracks at most for its gauges: past it a reservation is
/// counted but not tracked (it stays out of `sluice_reservations_open`).
pub const MAX_ISSUED: usize = 100_000;

/// The reservations this instance admitted and has not seen settled, until their TTL:
/// what `sluice_reservations_open` and `sluice_reservation_held_units` count and the live
/// page shows. A commit sent to another instance is not seen here; its reservation
/// leaves these gauges at its TTL. Kept across reloads (`Limiter::with_issued`).
#[derive(Default)]
pub struct Issued(Mutex<IssuedInner>);

type Held = Vec<(Arc<PolicyCounters>, u64)>;

#[derive(Default)]
struct IssuedInner {
    by_id: HashMap<u64, (Millis, Held)>,
    by_deadline: BTreeSet<(Millis, u64)>,
}

impl Issued {
    fn lock(&self) -> std::sync::MutexGuard<'_, IssuedInner> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self, id: u64, deadline: Millis, held: Held) {
        let mut inner = self.lock();
        if inner.by_id.len() >= MAX_ISSUED {
            return;
        }
        for (c, units) in &held {
            let r = c.reservations();
            r.open.increment(1.0);
            r.held.increment(*units as f64);
        }
        inner.by_deadline.insert((deadline, id));
        inner.by_id.insert(id, (deadline, held));
    }

    /// Reservation `id` is settled (or lapsed): out of the gauges.
    fn settle(&self, id: u64) {
        let mut inner = self.lock();
        if let Some((deadline, held)) = inner.by_id.remove(&id) {
            inner.by_deadline.remove(&(deadline, id));
            drop(inner);
            release(&held);
        }
    }

    /// Drops the reservations past their TTL at `now` from the gauges (what a metrics
    /// scrape needs, and no more).
    pub fn sweep(&self, now: Millis) {
        Self::sweep_locked(&mut self.lock(), now);
    }

    fn sweep_locked(inner: &mut IssuedInner, now: Millis) {
        while let Some(&(deadline, id)) = inner.by_deadline.first().filter(|(d, _)| *d <= now) {
            inner.by_deadline.remove(&(deadline, id));
            if let Some((_, held)) = inner.by_id.remove(&id) {
                release(&held);
            }
        }
    }

    /// [`Issued::sweep`], then, per (domain, policy), the reservations still open and
    /// the units they hold (the live page).
    pub fn held(&self, now: Millis) -> Vec<(String, String, u64, u64)> {
        let mut inner = self.lock();
        Self::sweep_locked(&mut inner, now);
        let mut sums: std::collections::BTreeMap<(String, String), (u64, u64)> = Default::default();
        for (_, held) in inner.by_id.values() {
            for (c, units) in held {
                let (d, p) = c.names();
                let sum = sums.entry((d.to_string(), p.to_string())).or_default();
                *sum = (sum.0 + 1, sum.1 + units);
            }
        }
        sums.into_iter().map(|((d, p), (n, u))| (d, p, n, u)).collect()
    }
}

fn release(held: &Held) {
    for (c, units) in held {
        let r = c.reservations();
        r.open.decrement(1.0);
        r.held.decrement(*units as f64);
    }
}

/// Counts what a commit of `actual` units did to one policy's hold.
fn count_settled(r: &ReservationCounters, s: Settled, id: u64, actual: u64) {
    match s {
        Settled::Committed { .. } => r.committed.increment(1),
        Settled::Reported if id == REPORT => r.reported.increment(1),
        Settled::Reported => r.expired.increment(1),
        Settled::Again => return r.again.increment(1),
    }
    r.committed_units.increment(actual);
}

/// A reservation as its commit needs it, resolved when it was admitted: its number, the
/// request's domain, and each window it holds (client tag, state, limit) with the
/// descriptors whose actuals it takes. The commit settles exactly these windows, on
/// any instance, whatever the rules or overrides have become since, and names no
/// descriptor value (tags and states are keyed digests). [`Reserved::to_bytes`] is
/// bounded: a reservation holds at most [`MAX_RESERVED_WINDOWS`] windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    id: u64,
    domain: String,
    descriptors: u16,
    groups: Vec<(Tag, Vec<HeldWindow>)>,
}

/// One window a reservation holds.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HeldWindow {
    key: u64,
    limit: Limit,
    /// A digest of the policy's name, for its counters at the commit.
    policy: u64,
    /// The descriptors (by index) whose actuals it takes: more than one when a request
    /// names one window twice (their holds are summed into one, and so are their actuals).
    of: Vec<u16>,
}

/// The most windows one reservation may hold (a request whose descriptors reach more is
/// refused, saying so): what keeps a reservation's id short whatever was reserved.
pub const MAX_RESERVED_WINDOWS: usize = 64;

/// The most descriptors one reservation may name (however high
/// `limiter.request_bounds.descriptors` is set): each window counts its own in a byte.
pub const MAX_RESERVED_DESCRIPTORS: usize = 255;

/// The version byte of [`Reserved::to_bytes`].
const RESERVED_V1: u8 = 1;

impl Reserved {
    /// How many descriptors the reservation named (a commit sends one actual each, or
    /// one for all).
    pub fn descriptors(&self) -> usize {
        self.descriptors.into()
    }

    /// A compact binary form (for a token a client carries; seal it against forgery).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![RESERVED_V1];
        b.extend(self.id.to_le_bytes());
        b.extend((self.domain.len() as u16).to_le_bytes());
        b.extend(self.domain.as_bytes());
        b.extend(self.descriptors.to_le_bytes());
        b.push(self.groups.len() as u8);
        for (tag, windows) in &self.groups {
            b.extend(tag.0.to_le_bytes());
            b.push(windows.len() as u8);
            for w in windows {
                let Limit::FixedWindow { limit, window, aligned } = w.limit else { unreachable!("fixed windows only") };
                b.extend(w.key.to_le_bytes());
                b.extend(limit.to_le_bytes());
                b.extend(window.to_le_bytes());
                b.push(u8::from(aligned));
                b.extend(w.policy.to_le_bytes());
                b.push(w.of.len() as u8);
                for d in &w.of {
                    b.extend(d.to_le_bytes());
                }
            }
        }
        b
    }

    /// What [`Reserved::to_bytes`] wrote, if it is that.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        let mut r = Reader(b);
        if r.u8()? != RESERVED_V1 {
            return None;
        }
        let id = r.u64()?;
        let n = r.u16()? as usize;
        let domain = String::from_utf8(r.take(n)?.to_vec()).ok()?;
        let descriptors = r.u16()?;
        let mut groups = Vec::new();
        for _ in 0..r.u8()? {
            let tag = Tag(u128::from_le_bytes(r.take(16)?.try_into().ok()?));
            let mut windows = Vec::new();
            for _ in 0..r.u8()? {
                let key = r.u64()?;
                let limit = Limit::FixedWindow { limit: r.u64()?, window: r.u64()?, aligned: r.u8()? == 1 };
                let policy = r.u64()?;
                let of = (0..r.u8()?).map(|_| r.u16()).collect::<Option<Vec<u16>>>()?;
                if of.iter().any(|&d| d >= descriptors) {
                    return None;
                }
                windows.push(HeldWindow { key, limit, policy, of });
            }
            groups.push((tag, windows));
        }
        r.0.is_empty().then_some(Self { id, domain, descriptors, groups })
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = rest;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

/// One client tag's windows of a reservation.
type Part = (Tag, Vec<Op>);

/// A plan's windows, each once: per client tag (groups of one tag joined), its ops with
/// the costs of a window named twice summed; and for each op of each group, where its
/// window is (part, op).
fn merged(groups: &[Group]) -> (Vec<Part>, Vec<Vec<(usize, usize)>>) {
    let mut parts: Vec<Part> = Vec::new();
    let mut at = Vec::with_capacity(groups.len());
    for g in groups {
        let p = match parts.iter().position(|(t, _)| *t == g.tag) {
            Some(p) => p,
            None => {
                parts.push((g.tag, Vec::new()));
                parts.len() - 1
            }
        };
        let once = &mut parts[p].1;
        at.push(
            g.ops
                .iter()
                .map(|op| match once.iter().position(|o| o.key == op.key) {
                    Some(i) => {
                        once[i].cost = once[i].cost.saturating_add(op.cost);
                        once[i].shadow &= op.shadow;
                        (p, i)
                    }
                    None => {
                        once.push(*op);
                        (p, once.len() - 1)
                    }
                })
                .collect(),
        );
    }
    (parts, at)
}

/// Each window a reservation holds with the descriptors that reached it, and its
/// policy's name (the first descriptor's: one window is one policy's state).
fn held_windows(
    parts: &[Part],
    groups: &[Group],
    at: &[Vec<(usize, usize)>],
    descriptors: &[DescriptorVerdict],
) -> Vec<(Tag, Vec<HeldWindow>)> {
    let mut held: Vec<(Tag, Vec<HeldWindow>)> = parts
        .iter()
        .map(|(tag, once)| {
            let windows =
                once.iter().map(|op| HeldWindow { key: op.key, limit: op.limit, policy: 0, of: Vec::new() }).collect();
            (*tag, windows)
        })
        .collect();
    for (g, at) in groups.iter().zip(at) {
        for (&(di, pi), &(p, i)) in g.slots.iter().zip(at) {
            let w = &mut held[p].1[i];
            if w.of.is_empty() {
                w.policy = policy_digest(&descriptors[di].policies[pi].name);
            }
            w.of.push(di as u16);
        }
    }
    held
}

/// A refused reservation's answer as what is true once the holds it took are given back:
/// each charged slot less its window's whole cost.
fn given_back(
    parts: &[Part],
    groups: &[Group],
    at: &[Vec<(usize, usize)>],
    charged: &[(usize, usize)],
    descriptors: &mut [DescriptorVerdict],
) {
    for (g, at) in groups.iter().zip(at) {
        for (slot, &(p, i)) in g.slots.iter().zip(at) {
            if charged.contains(slot) {
                let cost = parts[p].1[i].cost;
                let d = &mut descriptors[slot.0].policies[slot.1].decision;
                d.used = d.used.saturating_sub(cost);
                d.remaining = d.remaining.saturating_add(cost).min(d.limit);
            }
        }
    }
}

/// Whether a reservation of `descriptors` reaching `windows` windows can be held (its id
/// stays bounded); the reason when it cannot.
fn bounded(descriptors: usize, windows: usize) -> Result<(), RequestError> {
    if descriptors > MAX_RESERVED_DESCRIPTORS {
        let why = format!(
            "the request names {descriptors} descriptors; a reservation names at most {MAX_RESERVED_DESCRIPTORS}"
        );
        return Err(RequestError::BadReservation(why));
    }
    if windows > MAX_RESERVED_WINDOWS {
        let why = format!("the request reaches {windows} windows; a reservation holds at most {MAX_RESERVED_WINDOWS}");
        return Err(RequestError::BadReservation(why));
    }
    Ok(())
}

impl Limiter {
    /// Reserves each descriptor's cost (its `hits_addend`, else the request's) of every
    /// matching fixed window as reservation `id`, held until `ttl` from now or until
    /// [`Limiter::commit`]: admitted all or nothing, as a check is, counting the other
    /// reservations held (see [`crate::algo::reservation`]). A window two descriptors
    /// name holds the sum of their costs, once. A matching policy of another kind is
    /// refused with [`RequestError::NotReservable`]; quota grants are not used (a
    /// reservation is a store call, and counts in the same window as grants do). When
    /// admitted, what its commit needs.
    pub async fn reserve(
        &self,
        req: &Request,
        id: u64,
        ttl: Millis,
    ) -> Result<(Verdict, Option<Reserved>), CheckError> {
        self.keeps_reservations()?;
        if id == REPORT {
            // a hold under it could never be committed: a commit of 0 is a report
            return Err(RequestError::NoReservations("reservation id 0 is the reports'; draw another".into()).into());
        }
        let now = self.clock.now();
        let Plan { domain, mut descriptors, groups } =
            plan(&self.rules, &self.overrides.current(), req, Mode::Charge, None, now)?;
        reservable(&groups, &descriptors)?;
        let (parts, at) = merged(&groups);
        bounded(descriptors.len(), parts.iter().map(|p| p.1.len()).sum())?;
        let r = Reservation { id, ttl };
        let results =
            futures_util::future::join_all(parts.iter().map(|(tag, once)| self.store.reserve(*tag, once, r, now)))
                .await;
        let mut tally = Tally::default();
        for (g, at) in groups.iter().zip(&at) {
            // each op answered by its window's decision
            let result = at
                .iter()
                .map(|&(p, i)| results[p].as_ref().map(|d| d[i]).map_err(Clone::clone))
                .collect::<Result<Vec<_>, _>>()
                .map(|d| (d, Source::Store));
            let result = self.or_failed(g, result, Mode::Charge, now).await;
            self.record(g, result, Mode::Charge, &mut descriptors, &mut tally)?;
        }
        let allowed = tally.refused_groups == 0 && !quota_spent(&descriptors);
        if !allowed {
            // another client's part refused (or every quota is spent): what the others
            // hold goes back
            self.settle(&parts, id, now).await?;
            given_back(&parts, &groups, &at, &tally.charged, &mut descriptors);
        }
        let outcome = outcome(allowed, &mut descriptors);
        self.count(domain, req, Mode::Charge, &descriptors, tally.degraded, false);
        self.reserved(&groups, &descriptors, allowed.then_some((id, now + ttl)));
        let reserved = allowed.then(|| Reserved {
            id,
            domain: req.domain.clone(),
            descriptors: descriptors.len() as u16,
            groups: held_windows(&parts, &groups, &at, &descriptors),
        });
        let binding = binding(&descriptors);
        let v =
            Verdict { outcome, descriptors, binding, lease: None, degraded: tally.degraded, now, charges: Vec::new() };
        Ok((v, reserved))
    }

    /// Charges each descriptor's cost to every matching fixed window, never refused (a
    /// cost past a limit is taken): the work is done, and what it cost counts against the
    /// requests after it (Kuadrant's `Report`, Envoy's `apply_on_stream_done`). A commit
    /// of no reservation ([`crate::algo::reservation::REPORT`]).
    pub async fn report(&self, req: &Request) -> Result<(), CheckError> {
        self.keeps_reservations()?;
        let now = self.clock.now();
        let req = Request { lenient: true, ..req.clone() };
        let Plan { descriptors, groups, .. } =
            plan(&self.rules, &self.overrides.current(), &req, Mode::Charge, None, now)?;
        reservable(&groups, &descriptors)?;
        for g in &groups {
            let commits: Vec<Commit> =
                g.ops.iter().map(|o| Commit { key: o.key, limit: o.limit, actual: o.cost }).collect();
            let done = self.store.commit(g.tag, REPORT, &commits, now).await?;
            for ((op, &(di, pi)), s) in g.ops.iter().zip(&g.slots).zip(&done) {
                if let Some(c) = &descriptors[di].policies[pi].counters {
                    count_settled(c.reservations(), *s, REPORT, op.cost);
                }
            }
            self.forget(g.tag, commits.iter().map(|c| c.key));
        }
        Ok(())
    }

    /// Commits reservation `r` with `actuals`, one per descriptor it named: each window
    /// it holds is settled with the sum of the actuals of the descriptors that reached
    /// it (more or less than held; never refused, and a cost above a limit is taken, up
    /// to [`MAX_EXACT`] in one commit). Settles once however often it is sent; a
    /// reservation released at its deadline is charged its actual as a report. One
    /// answer per window held.
    pub async fn commit(&self, r: &Reserved, actuals: &[u64]) -> Result<Vec<Settled>, CheckError> {
        self.keeps_reservations()?;
        if actuals.len() != r.descriptors() {
            let why = format!("{} actuals for a reservation of {} descriptors", actuals.len(), r.descriptors());
            return Err(RequestError::BadReservation(why).into());
        }
        let mut plans = Vec::with_capacity(r.groups.len());
        for (_, windows) in &r.groups {
            let mut commits = Vec::with_capacity(windows.len());
            for w in windows {
                let actual = w.of.iter().fold(0u64, |sum, &d| sum.saturating_add(actuals[d as usize]));
                if actual > MAX_EXACT {
                    let why = format!(
                        "an actual of {actual} is more than one commit may add ({MAX_EXACT}, 2^53 - 1, the most \
                         any limit counts exactly)"
                    );
                    return Err(RequestError::BadReservation(why).into());
                }
                commits.push(Commit { key: w.key, limit: w.limit, actual });
            }
            plans.push(commits);
        }
        let now = self.clock.now();
        let domain = self.rules.domain(&r.domain);
        let mut settled = Vec::new();
        for ((tag, windows), commits) in r.groups.iter().zip(&plans) {
            let done = self.store.commit(*tag, r.id, commits, now).await?;
            for ((w, c), s) in windows.iter().zip(commits).zip(&done) {
                if let Some(counters) = domain.and_then(|d| d.counters_of(w.policy)) {
                    count_settled(counters.reservations(), *s, r.id, c.actual);
                }
            }
            // units given back here are not refused from this instance's cache
            self.forget(*tag, commits.iter().map(|c| c.key));
            settled.extend(done);
        }
        self.issued.settle(r.id);
        Ok(settled)
    }

    /// Releases what reservation `id` holds on every group's windows (a commit of 0).
    async fn settle(&self, parts: &[Part], id: u64, now: Millis) -> Result<(), StoreError> {
        for (tag, once) in parts {
            let commits: Vec<Commit> = once.iter().map(|o| Commit { key: o.key, limit: o.limit, actual: 0 }).collect();
            self.store.commit(*tag, id, &commits, now).await?;
        }
        Ok(())
    }

    /// Whether the store keeps reservations; the reason when it does not.
    fn keeps_reservations(&self) -> Result<(), RequestError> {
        match self.store.reservations() {
            true => Ok(()),
            false => Err(RequestError::NoReservations(crate::store::no_reservations_reason(self.store.kind()))),
        }
    }

    /// Counts a reservation's decision on each policy it reached and, admitted as
    /// `(id, deadline)`, tracks it for the gauges.
    fn reserved(&self, groups: &[Group], descriptors: &[DescriptorVerdict], admitted: Option<(u64, Millis)>) {
        let mut held = Vec::new();
        for g in groups {
            for (op, &(di, pi)) in g.ops.iter().zip(&g.slots) {
                let Some(c) = &descriptors[di].policies[pi].counters else { continue };
                let r = c.reservations();
                match admitted {
                    Some(_) => {
                        r.admitted.increment(1);
                        r.held_units.increment(op.cost);
                        held.push((c.clone(), op.cost));
                    }
                    None => r.refused.increment(1),
                }
            }
        }
        if let Some((id, deadline)) = admitted {
            self.issued.add(id, deadline, held);
        }
    }

    /// The reservations this instance issued and has not seen settled (see [`Issued`]).
    pub fn issued(&self) -> &Arc<Issued> {
        &self.issued
    }

    /// The reservations a client holds open on each of its fixed windows, with when each
    /// lapses, for inspecting it. Reads only.
    pub async fn holds(&self, req: &Request) -> Result<Vec<HeldReservations>, CheckError> {
        let (now, mut out) = (self.clock.now(), Vec::new());
        for (tag, op, policy, descriptor) in self.peek_ops(req, now)? {
            if let Limit::FixedWindow { .. } = op.limit {
                let holds = self.store.holds(tag, op.key, &op.limit, now).await?;
                if !holds.is_empty() {
                    out.push(HeldReservations { descriptor, policy, holds });
                }
            }
        }
        Ok(out)
    }
}

/// Whether every policy a plan reaches takes reservations (fixed windows do); the
/// first that does not, named.
fn reservable(groups: &[Group], descriptors: &[DescriptorVerdict]) -> Result<(), RequestError> {
    for g in groups {
        for (i, (op, &(di, pi))) in g.ops.iter().zip(&g.slots).enumerate() {
            let policy = || descriptors[di].policies[pi].name.to_string();
            if !matches!(op.limit, Limit::FixedWindow { .. }) {
                return Err(RequestError::NotReservable {
                    descriptor: di,
                    policy: policy(),
                    algorithm: op.limit.algorithm(),
                });
            }
            if g.grants_of(i).is_some_and(|r| r.global) {
                return Err(RequestError::GlobalNotReservable { descriptor: di, policy: policy() });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
