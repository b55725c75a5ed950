//! Reservations through the engine (see [`crate::algo::reservation`]): a request's
//! estimate held on every matching fixed window, all or nothing across clients, settled
//! by a commit on any instance; reports; the holds a client has open; and what this
//! instance issued, for its gauges and the live page.

use super::{CheckError, Limiter, Tally, outcome};
use crate::algo::Limit;
use crate::algo::reservation::{Hold, REPORT};
use crate::plan::{Group, Mode, Plan, plan};
use crate::request::{Request, RequestError};
use crate::store::{Commit, Reservation, Settled, StoreError};
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

impl Limiter {
    /// Reserves each descriptor's cost (its `hits_addend`, else the request's) of every
    /// matching fixed window as reservation `id`, held until `ttl` from now or until
    /// [`Limiter::commit`]: admitted all or nothing, as a check is, counting the other
    /// reservations held (see [`crate::algo::reservation`]). A matching policy of another
    /// kind is refused with [`RequestError::NotReservable`]; quota grants are not used
    /// (a reservation is a store call, and counts in the same window as grants do).
    pub async fn reserve(&self, req: &Request, id: u64, ttl: Millis) -> Result<Verdict, CheckError> {
        self.keeps_reservations()?;
        if id == REPORT {
            // a hold under it could never be committed: a commit of 0 is a report
            return Err(RequestError::NoReservations("reservation id 0 is the reports'; draw another".into()).into());
        }
        let now = self.clock.now();
        let Plan { domain, mut descriptors, groups } =
            plan(&self.rules, &self.overrides.current(), req, Mode::Charge, None, now)?;
        reservable(&groups, &descriptors)?;
        let r = Reservation { id, ttl };
        let results = futures_util::future::join_all(groups.iter().map(|g| self.store.reserve(g.tag, &g.ops, r, now)));
        let mut tally = Tally::default();
        for (g, result) in groups.iter().zip(results.await) {
            self.record(g, result.map(|d| (d, Source::Store)), Mode::Charge, now, &mut descriptors, &mut tally)?;
        }
        let allowed = tally.refused_groups == 0;
        if !allowed {
            // another client's part refused: what the others hold goes back
            self.settle(&groups, id, now).await?;
            for ((_, held), &(di, pi)) in tally.charges.drain(..).zip(&tally.charged) {
                let d = &mut descriptors[di].policies[pi].decision;
                d.used = d.used.saturating_sub(held.cost);
                d.remaining = d.remaining.saturating_add(held.cost).min(d.limit);
            }
        }
        let outcome = outcome(allowed, &mut descriptors);
        self.count(domain, req, Mode::Charge, &descriptors, tally.degraded, false);
        self.reserved(&groups, &descriptors, allowed.then_some((id, now + ttl)));
        let binding = binding(&descriptors);
        Ok(Verdict { outcome, descriptors, binding, lease: None, degraded: tally.degraded, now, charges: Vec::new() })
    }

    /// Charges each descriptor's cost to every matching fixed window, never refused (a
    /// cost past a limit is taken): the work is done, and what it cost counts against the
    /// requests after it (Kuadrant's `Report`, Envoy's `apply_on_stream_done`). A commit
    /// of no reservation ([`crate::algo::reservation::REPORT`]).
    pub async fn report(&self, req: &Request) -> Result<(), CheckError> {
        self.commit(req, crate::algo::reservation::REPORT).await.map(|_| ())
    }

    /// Commits reservation `id`: `req` names the descriptors it reserved, each with the
    /// amount actually spent as its cost (more or less than held; never refused, and a
    /// cost above a limit is taken). Settles once however often it is sent; a
    /// reservation released at its deadline is charged its actual as a report. One
    /// answer per matching fixed window, in plan order.
    pub async fn commit(&self, req: &Request, id: u64) -> Result<Vec<Settled>, CheckError> {
        self.keeps_reservations()?;
        let now = self.clock.now();
        let req = Request { lenient: true, ..req.clone() };
        let Plan { descriptors, groups, .. } =
            plan(&self.rules, &self.overrides.current(), &req, Mode::Charge, None, now)?;
        reservable(&groups, &descriptors)?;
        let mut settled = Vec::new();
        for g in &groups {
            let commits: Vec<Commit> =
                g.ops.iter().map(|o| Commit { key: o.key, limit: o.limit, actual: o.cost }).collect();
            let done = self.store.commit(g.tag, id, &commits, now).await?;
            for ((op, &(di, pi)), s) in g.ops.iter().zip(&g.slots).zip(&done) {
                if let Some(c) = &descriptors[di].policies[pi].counters {
                    count_settled(c.reservations(), *s, id, op.cost);
                }
            }
            settled.extend(done);
        }
        // a report settles no reservation (Envoy's stream-done path: no lock taken)
        if id != REPORT {
            self.issued.settle(id);
        }
        Ok(settled)
    }

    /// Releases what reservation `id` holds on every group's windows (a commit of 0).
    async fn settle(&self, groups: &[Group], id: u64, now: Millis) -> Result<(), StoreError> {
        for g in groups {
            let commits: Vec<Commit> = g.ops.iter().map(|o| Commit { key: o.key, limit: o.limit, actual: 0 }).collect();
            self.store.commit(g.tag, id, &commits, now).await?;
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
mod tests {
    use super::*;

    /// Id 0 is the reports': a reservation under it is refused, saying so.
    #[tokio::test]
    async fn id_zero_is_not_a_reservation() {
        let rules = crate::RulesBuilder::new()
            .domain(
                crate::DomainBuilder::new("d")
                    .rule([("user", None)], |r| r.fixed_window("w", 10, std::time::Duration::from_secs(60))),
            )
            .build()
            .unwrap();
        let limiter = Limiter::in_memory(rules);
        let req = Request::new("d").descriptor([("user", "a")]);
        let e = limiter.reserve(&req, REPORT, 1_000).await.unwrap_err();
        assert!(e.to_string().contains("reservation id 0"), "{e}");
        assert!(limiter.reserve(&req, 1, 1_000).await.unwrap().allowed());
    }

    /// Past MAX_ISSUED reservations tracked, one more is counted nowhere in the gauges
    /// (memory bounded whatever clients reserve); settled and lapsed ones leave them.
    #[test]
    fn the_reservations_tracked_are_bounded() {
        let c = Arc::new(PolicyCounters::new("d", "bounded", false, None));
        let issued = Issued::default();
        for id in 0..MAX_ISSUED as u64 + 10 {
            issued.add(id, 1_000 + id, vec![(c.clone(), 2)]);
        }
        assert_eq!(issued.lock().by_id.len(), MAX_ISSUED);
        assert_eq!(issued.held(0), [("d".into(), "bounded".into(), MAX_ISSUED as u64, 2 * MAX_ISSUED as u64)]);
        issued.settle(0);
        issued.sweep(1_000 + 10);
        assert_eq!(issued.lock().by_id.len(), MAX_ISSUED - 11, "one settled, ten lapsed");
    }
}
