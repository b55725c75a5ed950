//! The failure policy (invariant 7): a group whose store call failed is decided by each
//! policy's `failure` (open, closed, or `local`: counted on this instance within its
//! fair part, or a global limit's on the global store or within the region's share), and
//! the outage is summed up in the log, never a line a request.

use super::Limiter;
use crate::algo::{Decision, Op};
use crate::config::Failure;
use crate::fallback::Count;
use crate::plan::{Group, Mode, unevaluated};
use crate::store::StoreError;
use crate::tag::Tag;
use crate::time::Millis;
use crate::verdict::Source;

/// How long a fail-closed refusal tells the client to wait, in ms.
const FAIL_CLOSED_RETRY: Millis = 1_000;

/// How often a store outage is summed up in the log.
const FAILURE_LOG_EVERY: Millis = 5_000;

/// The log of decisions left to the failure policy: the first at once, then one line at
/// most every [`FAILURE_LOG_EVERY`] with how many there were since: never a line per
/// request, however many requests an outage meets. (The store's own transitions, failing
/// and answering again, are logged by the resilient wrapper.)
#[derive(Default)]
pub(super) struct FailureLog {
    line: crate::time::Throttle,
    /// Failed store calls since the last line.
    since: std::sync::atomic::AtomicU64,
}

impl FailureLog {
    pub(super) fn failed(&self, e: &StoreError, now: Millis) {
        use std::sync::atomic::Ordering::Relaxed;
        let count = self.since.fetch_add(1, Relaxed) + 1;
        if self.line.due(now, FAILURE_LOG_EVERY) {
            self.since.fetch_sub(count, Relaxed);
            tracing::warn!(error = %e, store_calls_failed = count, "the failure policy decided (store calls failing)");
        }
    }
}

impl Limiter {
    /// A group's decisions, or when its store call failed those of its failure policies
    /// ([`Self::fail`]).
    pub(super) async fn or_failed(
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
    pub(super) fn finishing_locally(&self, g: &Group, now: Millis) -> bool {
        g.ops.iter().any(|op| self.fallback.deciding(g.tag, op.key, now))
            && g.failures.iter().all(|f| *f == Failure::Local)
            && (0..g.ops.len()).all(|i| !g.grants_of(i).is_some_and(|r| r.global))
    }

    /// A group's decisions by this instance's fair parts, counted here; charged (here,
    /// and to the store once it answers) only if `charge` (not a status read). Tries to
    /// charge the store with what is owed: these clients' requests do not reach it, and
    /// it may answer again.
    pub(super) fn decide_locally(&self, g: &Group, charge: bool, now: Millis) -> (Vec<Decision>, Failure) {
        let count = Count::owed_if(charge);
        let decided = g.ops.iter().map(|op| self.fallback.decide(g.tag, op, count, now)).collect();
        self.settle_owed(now);
        (decided, Failure::Local)
    }

    /// What was admitted here while the store did not answer is charged to it, in the
    /// background, if any is owed (`crate::fallback::Fallback::settle_due`).
    pub(super) fn settle_owed(&self, now: Millis) {
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
    pub(super) async fn fail(&self, g: &Group, e: &StoreError, charge: bool, now: Millis) -> (Vec<Decision>, Failure) {
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
    pub(super) fn within_share(
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
}
