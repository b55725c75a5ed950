//! What this instance issued of reservations, for its gauges (`sluice_reservations_open`,
//! `sluice_reservation_held_units`) and the live page.

use crate::telemetry::PolicyCounters;
use crate::time::Millis;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

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

    pub(super) fn add(&self, id: u64, deadline: Millis, held: Held) {
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
    pub(super) fn settle(&self, id: u64) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
