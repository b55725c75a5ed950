//! Reservations through the engine (see [`crate::algo::reservation`]): a request's
//! estimate held on every matching fixed window, all or nothing across clients, settled
//! by a commit on any instance; reports; the holds a client has open; and what this
//! instance issued, for its gauges and the live page.

use super::granted::Spent;
use super::{CheckError, Limiter, Tally, outcome, quota_spent};
use crate::algo::reservation::{Hold, REPORT};
use crate::algo::{Decision, Limit, MAX_EXACT, Op, pool};
use crate::grants::Leftovers;
use crate::plan::{Group, Mode, Plan, plan};
use crate::request::{Request, RequestError};
use crate::rules::policy_digest;
use crate::store::{Commit, Refund, Reservation, Settled, StoreError};
use crate::tag::Tag;
use crate::telemetry::ReservationCounters;
use crate::time::Millis;
use crate::verdict::{DescriptorVerdict, Source, Verdict, binding};
use std::collections::BTreeSet;
use std::sync::Arc;

mod issued;
mod token;

pub use issued::Issued;
use token::HeldWindow;
pub use token::{MAX_RESERVED_DESCRIPTORS, MAX_RESERVED_WINDOWS, Reserved};

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
    global: &BTreeSet<(usize, usize)>,
) -> Vec<(Tag, Vec<HeldWindow>)> {
    let mut held: Vec<(Tag, Vec<HeldWindow>)> = parts
        .iter()
        .enumerate()
        .map(|(p, (tag, once))| {
            let windows = (once.iter().enumerate())
                .map(|(i, op)| HeldWindow {
                    key: op.key,
                    limit: op.limit,
                    policy: 0,
                    of: Vec::new(),
                    global: global.contains(&(p, i)),
                })
                .collect();
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

/// The windows, by (part, window) of [`merged`], that are global limits' (`global:
/// true`, decided from the region's pool).
fn global_windows(groups: &[Group], at: &[Vec<(usize, usize)>]) -> BTreeSet<(usize, usize)> {
    let mut global = BTreeSet::new();
    for (g, at) in groups.iter().zip(at) {
        global
            .extend(at.iter().enumerate().filter(|(i, _)| g.grants_of(*i).is_some_and(|r| r.global)).map(|(_, w)| *w));
    }
    global
}

/// Where the store holds a reservation of a global limit's window: beside the window (its
/// key mixed with a constant), under a limit that never refuses. The units themselves
/// came from the region's pool; this holds only what the commit must settle, and settles
/// it once however often the commit is sent (the store's reservation ledger).
fn ledger(op: &Op) -> Op {
    const LEDGER: u64 = u64::from_be_bytes(*b"reserved");
    let Limit::FixedWindow { window, aligned, .. } = op.limit else { return *op };
    Op { key: op.key.rotate_left(29) ^ LEDGER, limit: Limit::FixedWindow { limit: MAX_EXACT, window, aligned }, ..*op }
}

/// Group `g`'s decisions in a reservation: each op's by its window's answer in the
/// store (its part's, at `at`), or a global limit's by what its pool gave.
fn answered(
    g: &Group,
    at: &[(usize, usize)],
    spent: &Result<Spent, StoreError>,
    results: &[Result<Vec<Decision>, StoreError>],
) -> Result<(Vec<Decision>, Source), StoreError> {
    (at.iter().enumerate())
        .map(|(oi, &(p, i))| match (spent, g.grants_of(oi).is_some_and(|r| r.global)) {
            (Ok(s), true) => Ok(s.decisions[oi]),
            (Err(e), true) => Err(e.clone()),
            (_, false) => results[p].as_ref().map(|d| d[i]).map_err(Clone::clone),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(|d| (d, Source::Store))
}

/// The global windows, by (part, window), of the groups whose pools failed: they spent
/// nothing, so their ledgers hold nothing for a commit to give back.
fn unspent(
    at: &[Vec<(usize, usize)>],
    spent: &[Result<Spent, StoreError>],
    global: &BTreeSet<(usize, usize)>,
) -> Vec<(usize, usize)> {
    (at.iter().zip(spent))
        .filter(|(_, s)| s.is_err())
        .flat_map(|(at, _)| at.iter().copied().filter(|w| global.contains(w)))
        .collect()
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
    /// reservation is a store call, and counts in the same window as grants do), except
    /// a global limit's (`global: true`): its units are spent from the region's pool as a
    /// check's are, and the store holds the reservation beside the window (`ledger`) for
    /// the commit to give back what was not used. When admitted, what its commit needs.
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
        let (mut parts, at) = merged(&groups);
        bounded(descriptors.len(), parts.iter().map(|p| p.1.len()).sum())?;
        let global = global_windows(&groups, &at);
        let held = held_windows(&parts, &groups, &at, &descriptors, &global);
        let (mut spent, results) = self.hold(&groups, &mut parts, &global, Reservation { id, ttl }, now).await;
        let mut tally = Tally::default();
        for ((g, at), spent) in groups.iter().zip(&at).zip(&spent) {
            let result = self.or_failed(g, answered(g, at, spent, &results), Mode::Charge, now).await;
            self.record(g, result, Mode::Charge, &mut descriptors, &mut tally)?;
        }
        // a pool that failed spent nothing: its ledger holds nothing to settle
        let failed = unspent(&at, &spent, &global);
        self.settle(&parts, id, now, |w| failed.contains(&w)).await?;
        let allowed = tally.refused_groups == 0 && !quota_spent(&descriptors);
        if !allowed {
            // another client's part refused (or every quota is spent): what the others
            // hold goes back, and what the pools gave
            self.settle(&parts, id, now, |_| true).await?;
            for (g, s) in groups.iter().zip(&mut spent) {
                if let Ok(s) = s {
                    self.put_back(g, &s.spent, &mut s.decisions, now).await?;
                }
            }
            given_back(&parts, &groups, &at, &tally.charged, &mut descriptors);
        }
        let outcome = outcome(allowed, &mut descriptors);
        self.count(domain, req, Mode::Charge, &descriptors, tally.degraded, false);
        self.reserved(&groups, &descriptors, allowed.then_some((id, now + ttl)));
        let reserved = allowed.then(|| Reserved {
            id,
            domain: req.domain.clone(),
            descriptors: descriptors.len() as u16,
            groups: held,
        });
        let binding = binding(&descriptors);
        let v =
            Verdict { outcome, descriptors, binding, lease: None, degraded: tally.degraded, now, charges: Vec::new() };
        Ok((v, reserved))
    }

    /// Holds a reservation's windows: a global limit's units spent from the region's
    /// pool, as a check spends them, and its window swapped for its ledger (`ledger`),
    /// so that the store holds the reservation there and its commit settles it once;
    /// then each part's windows reserved in the store. What each group spent, and each
    /// part's answer.
    async fn hold(
        &self,
        groups: &[Group],
        parts: &mut [Part],
        global: &BTreeSet<(usize, usize)>,
        r: Reservation,
        now: Millis,
    ) -> (Vec<Result<Spent, StoreError>>, Vec<Result<Vec<Decision>, StoreError>>) {
        let mut spent = Vec::with_capacity(groups.len());
        for g in groups {
            spent.push(self.spend_group(g, now, |rule| rule.global).await);
        }
        for &(p, i) in global {
            parts[p].1[i] = ledger(&parts[p].1[i]);
        }
        let reserved = parts.iter().map(|(tag, once)| self.store.reserve(*tag, once, r, now));
        (spent, futures_util::future::join_all(reserved).await)
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
            // a global limit's cost is spent from the region's pool while the fleet has
            // units for it (past them, the window is spent: nothing more is admitted)
            let pooled = self.spend_group(g, now, |r| r.global).await?;
            let global = |i: usize| g.grants_of(i).is_some_and(|r| r.global);
            let here: Vec<usize> = (0..g.ops.len()).filter(|&i| !global(i)).collect();
            let commits: Vec<Commit> = (here.iter().map(|&i| &g.ops[i]))
                .map(|o| Commit { key: o.key, limit: o.limit, actual: o.cost })
                .collect();
            let done = match commits.is_empty() {
                true => Vec::new(),
                false => self.store.commit(g.tag, REPORT, &commits, now).await?,
            };
            let settled = (here.iter().zip(done)).chain(pooled.spent.iter().zip(std::iter::repeat(Settled::Reported)));
            for (&i, s) in settled {
                let (op, (di, pi)) = (&g.ops[i], g.slots[i]);
                if let Some(c) = &descriptors[di].policies[pi].counters {
                    count_settled(c.reservations(), s, REPORT, op.cost);
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
    /// reservation released at its deadline is charged its actual as a report. On a
    /// global limit's window, see `settle_global`. One answer per window held.
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
                // a global limit's reservation is held on its window's ledger
                let at = if w.global { ledger(&w.op(actual)) } else { w.op(actual) };
                commits.push(Commit { key: at.key, limit: at.limit, actual });
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
                if w.global {
                    self.settle_global((*tag, &r.domain), w, *s, c.actual, now).await?;
                }
            }
            // units given back here are not refused from this instance's cache
            self.forget(*tag, commits.iter().map(|c| c.key));
            settled.extend(done);
        }
        self.issued.settle(r.id);
        Ok(settled)
    }

    /// Releases what reservation `id` holds on the windows of `parts` that `which` takes,
    /// by (part, window) (a commit of 0).
    async fn settle(
        &self,
        parts: &[Part],
        id: u64,
        now: Millis,
        which: impl Fn((usize, usize)) -> bool,
    ) -> Result<(), StoreError> {
        for (p, (tag, once)) in parts.iter().enumerate() {
            let commits: Vec<Commit> = (once.iter().enumerate())
                .filter(|&(i, _)| which((p, i)))
                .map(|(_, o)| Commit { key: o.key, limit: o.limit, actual: 0 })
                .collect();
            if !commits.is_empty() {
                self.store.commit(*tag, id, &commits, now).await?;
            }
        }
        Ok(())
    }

    /// Settles what a reservation held of a global limit's window, once its ledger said
    /// `settled` for `actual`: the units held past the actual go back to the region's
    /// pool (the fleet may admit them again in the window); an actual past them is spent
    /// from the pool when the fleet has units for all of it, and otherwise not charged:
    /// the window's use then passes the limit by what the work overran its reservation,
    /// never by an admission. A reservation lapsed, or of a window that ended, keeps what
    /// it held spent: the fleet admits less, never more.
    async fn settle_global(
        &self,
        (tag, domain): (Tag, &str),
        w: &HeldWindow,
        settled: Settled,
        actual: u64,
        now: Millis,
    ) -> Result<(), StoreError> {
        let Settled::Committed { held } = settled else { return Ok(()) };
        if actual < held {
            let window = pool::window_end(&w.limit, now);
            return self
                .give_back(&[(tag, Refund { key: w.key, limit: w.limit, cost: held - actual, window })], now)
                .await;
        }
        let rule = self.rules.domain(domain).and_then(|d| d.grant_rule_of(w.policy));
        if let Some(rule) = rule.filter(|_| actual > held) {
            let mut out = Leftovers::default();
            self.spend(tag, &w.op(actual - held), &rule, (&mut out, now)).await?;
            self.settle_later(out, now);
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
        for (tag, mut op, policy, descriptor) in self.peek_ops(req, now)? {
            if let Limit::FixedWindow { .. } = op.limit {
                // a global limit's reservations are held on its window's ledger
                if self.rules.is_global(&req.domain, &policy) {
                    op = ledger(&op);
                }
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
        for (op, &(di, pi)) in g.ops.iter().zip(&g.slots) {
            if !matches!(op.limit, Limit::FixedWindow { .. }) {
                let policy = descriptors[di].policies[pi].name.to_string();
                return Err(RequestError::NotReservable { descriptor: di, policy, algorithm: op.limit.algorithm() });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
