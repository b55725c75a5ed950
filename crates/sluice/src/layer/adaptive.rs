//! The adaptive stage: requests run through a concurrency limit learned from the
//! service's own latency ([`crate::algo::overload`]), the most important class first,
//! the others waiting a bounded time and refused with 503 when the limit is reached.
//!
//! It is the layer's last stage, right around the service: it measures the service, so
//! only requests that reach it may hold a slot (one the rate limits refuse never takes
//! one), and a slot is held until the response body ends or is dropped, as a lease is.

use crate::algo::overload::{Admission, Entry, GradientParams, Micros, Outcome, Ticket};
use crate::telemetry::{self, AdaptiveGauges};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// The stage's state, shared by every request through the layer.
pub(super) struct Adaptive {
    admission: Mutex<Admission<oneshot::Sender<()>>>,
    epoch: Instant,
    gauges: AdaptiveGauges,
}

/// A slot held by a running request; given back by [`Adaptive::finish`].
pub(super) struct Slot {
    started: Micros,
}

/// A request waiting for a slot. If its future is dropped (the client left), it leaves
/// the queue, or gives back the slot handed to it meanwhile.
struct Waiting<'a> {
    stage: &'a Adaptive,
    ticket: Ticket,
    rx: oneshot::Receiver<()>,
    settled: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let now = self.stage.now();
        let mut a = self.stage.lock();
        if !a.withdraw(self.ticket, now) && self.rx.try_recv().is_ok() {
            self.stage.done(&mut a, now, 0, Outcome::Ignored);
            self.stage.hand_over(&mut a, now);
        }
        self.stage.publish(&a);
    }
}

impl Adaptive {
    pub(super) fn new(params: GradientParams, classes: usize) -> Self {
        let stage = Self {
            admission: Mutex::new(Admission::new(params, classes, 0)),
            epoch: Instant::now(),
            gauges: AdaptiveGauges::new(),
        };
        stage.publish_limit(&stage.lock());
        stage
    }

    fn now(&self) -> Micros {
        self.epoch.elapsed().as_micros() as Micros
    }

    fn lock(&self) -> MutexGuard<'_, Admission<oneshot::Sender<()>>> {
        self.admission.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a slot for a request of `class`, waiting for one if it must; `None`: shed.
    pub(super) async fn enter(&self, class: usize) -> Option<Slot> {
        let (tx, rx) = oneshot::channel();
        let now = self.now();
        let entry = {
            let mut a = self.lock();
            let e = a.enter(class, now, tx);
            self.publish(&a);
            e
        };
        let (ticket, deadline) = match entry {
            Entry::Run => return Some(Slot { started: now }),
            Entry::Shed(_) => return None,
            Entry::Wait { ticket, deadline, evicted } => {
                drop(evicted); // its waiter sees the channel closed: shed
                (ticket, deadline)
            }
        };
        let mut w = Waiting { stage: self, ticket, rx, settled: false };
        let waited = tokio::time::timeout(Duration::from_micros(deadline - now), &mut w.rx).await;
        w.settled = true;
        let granted = match waited {
            Ok(sent) => sent.is_ok(),
            Err(_) => {
                let mut a = self.lock();
                let granted = !a.withdraw(ticket, self.now()) && w.rx.try_recv().is_ok();
                self.publish(&a);
                granted
            }
        };
        granted.then(|| Slot { started: self.now() })
    }

    /// A request is done: its slot goes to the next waiter, and its latency and outcome
    /// teach the limit.
    pub(super) fn finish(&self, slot: Slot, outcome: Outcome) {
        let now = self.now();
        let mut a = self.lock();
        self.done(&mut a, now, now.saturating_sub(slot.started), outcome);
        self.hand_over(&mut a, now);
        self.publish(&a);
    }

    /// A slot given back; the limit's gauges follow when that ended a window (the only
    /// time the limit and the base change).
    fn done(&self, a: &mut Admission<oneshot::Sender<()>>, now: Micros, latency: Micros, outcome: Outcome) {
        if a.finish(now, latency, outcome).is_some() {
            self.publish_limit(a);
        }
    }

    /// Hands the free slots to waiters; one whose client left gives its slot back.
    fn hand_over(&self, a: &mut Admission<oneshot::Sender<()>>, now: Micros) {
        while let Some(tx) = a.next(now) {
            if tx.send(()).is_err() {
                self.done(a, now, 0, Outcome::Ignored);
            }
        }
    }

    /// The requests running and waiting, which every entry and exit changes.
    fn publish(&self, a: &Admission<oneshot::Sender<()>>) {
        self.gauges.in_flight.set(f64::from(a.in_flight()));
        self.gauges.waiting.set(f64::from(a.waiting()));
    }

    fn publish_limit(&self, a: &Admission<oneshot::Sender<()>>) {
        self.gauges.limit.set(f64::from(a.gradient().limit()));
        self.gauges.base.set(a.gradient().base().unwrap_or(0.0) / 1e6);
    }

    /// The limit, in flight and waiting now (for tests and the layer's users).
    pub(super) fn state(&self) -> (u32, u32, u32) {
        let a = self.lock();
        (a.gradient().limit(), a.in_flight(), a.waiting())
    }

    /// A refusal counted, by class.
    pub(super) fn shed(class: usize) {
        telemetry::shed("adaptive", class);
    }
}

/// How a response counts: 503 and 504 from the service are congestion; other server
/// errors say nothing of load; the rest are samples once their body has ended.
pub(super) fn outcome(status: http::StatusCode, finished: bool) -> Outcome {
    match status.as_u16() {
        503 | 504 => Outcome::Dropped,
        500..=599 => Outcome::Ignored,
        _ if finished => Outcome::Served,
        _ => Outcome::Ignored,
    }
}
