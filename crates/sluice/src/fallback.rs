//! `failure: local`: when the store cannot answer, each instance admits at most its fair
//! part of a limit, counted in process.
//!
//! Fail-open admits without bound while the store is down; fail-closed refuses all. With
//! `local`, an instance counts each client's decisions itself, in windows of the limit's
//! period, and admits up to the limit over the instances it last knew (its fair part):
//! the fleet admits about the limit, however long the outage. What it knows of the fleet
//! comes from a heartbeat: every [`HEARTBEAT`] each instance holds a lease in the store's
//! set of instances (a concurrency limit of the store's own), and the count of leases
//! held is the fleet. An instance that never reached the store knows only itself.
//! Grants an instance holds are spent first, as ever: this decides only what they cannot.
//!
//! When the store answers again, what an instance admitted here in windows still running
//! is charged to it (a report: past the limit too), so the fleet's count holds it; and a
//! client decided here in the window running now is decided here until that window ends,
//! or for [`FINISH_AT_MOST`] after the store answered, whichever comes first. Were it
//! decided by the store at once, the window would admit what was admitted here plus the
//! whole limit from the store (187 of 100 measured), as the other instances' local counts
//! reach the store only when each of them does: in the meantime every instance has
//! found the store again (a breaker's cool-down, a second by default) and charged it.

use crate::algo::{Decision, Lease, Limit, Op};
use crate::store::{Commit, Store};
use crate::tag::{Tag, Tagger};
use crate::time::{Clock, Millis};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// How often an instance says it is there.
pub const HEARTBEAT: Millis = 5_000;

/// How long a heartbeat counts: three missed, and the instance is no longer counted.
const HEARTBEAT_TTL: Millis = 3 * HEARTBEAT;

/// The most clients counted one by one at once. Past it (once the windows that ended
/// are dropped, at most once a second), new clients share [`SPILL`] counts, by a hash
/// of their state: a shared count refuses sooner, never later, so the bound holds at a
/// fixed memory, and a decision's cost does not grow with the clients.
const MAX_COUNTED: usize = 100_000;

/// The counts clients past [`MAX_COUNTED`] share.
const SPILL: usize = 65_536;

/// How often a full table drops the windows that ended (a scan of all of it).
const SWEEP_EVERY: Millis = 1_000;

/// An instance's local counts and what it knows of its fleet.
#[derive(Debug)]
pub struct Fallback {
    instances: AtomicU64,
    counts: Mutex<HashMap<(Tag, u64), Counted>>,
    beating: AtomicBool,
    /// The end of the last window a client was decided here in, to be charged to the
    /// store: before it, a decision may be this instance's to finish.
    owed_until: AtomicU64,
    /// The units admitted here not yet charged to the store.
    owed: AtomicU64,
    /// When the store answered after it last failed (`u64::MAX` while it fails; 0 when it
    /// never has).
    answered: AtomicU64,
    /// One settling at a time, at most one begun every [`SETTLE_EVERY`].
    settling: AtomicBool,
    attempts: crate::time::Throttle,
    sweeps: crate::time::Throttle,
    /// Window ends and counts shared past [`MAX_COUNTED`] (allocated when first needed).
    spill: Mutex<Vec<(Millis, u64)>>,
}

/// How long after the store answered again the clients decided here in windows still
/// running are decided here: long enough for every instance to find the store again and
/// charge it; short enough that a long window (an hour's) is the store's again soon.
pub const FINISH_AT_MOST: Millis = 10_000;

/// How often an instance that owes the store tries to charge it: the store may answer
/// again any time, and every try while it does not costs a call that fails.
const SETTLE_EVERY: Millis = 100;

/// A client's count here, in one window of its limit's period.
#[derive(Debug, Clone, Copy)]
struct Counted {
    end: Millis,
    used: u64,
    /// What the store has not been charged of `used`.
    owed: u64,
    /// A charge sent that may have landed or not (its call failed: a stalled store may
    /// still run it), by its id and units: sent again under the same id, which the store
    /// counts once (`Store::commit`).
    sent: Option<(u64, u64)>,
    /// Whether it is charged to the store when it answers (not a global limit's, counted
    /// against its region's share, whose own store holds the rest).
    charged: bool,
    limit: Limit,
}

/// How a decision made here counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Count {
    /// Counted here, and charged to the store once it answers.
    Owed,
    /// Counted here only (a global limit's, within its region's share).
    Here,
    /// Not counted (a status read).
    Not,
}

impl Count {
    /// [`Count::Owed`] for a decision that charges, [`Count::Not`] for a status read.
    pub(crate) fn owed_if(charge: bool) -> Self {
        if charge { Count::Owed } else { Count::Not }
    }
}

impl Default for Fallback {
    fn default() -> Self {
        Self {
            instances: AtomicU64::new(1),
            counts: Mutex::new(HashMap::new()),
            beating: AtomicBool::new(false),
            owed_until: AtomicU64::new(0),
            owed: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            settling: AtomicBool::new(false),
            attempts: Default::default(),
            sweeps: Default::default(),
            spill: Mutex::new(Vec::new()),
        }
    }
}

impl Fallback {
    /// The instances this one last knew (itself included).
    pub fn instances(&self) -> u64 {
        self.instances.load(Relaxed).max(1)
    }

    /// The decision of `op` by its fair part, counted here: the limit's capacity over
    /// the instances known, in windows of the limit's period aligned to the clock.
    pub(crate) fn decide(&self, tag: Tag, op: &Op, count: Count, now: Millis) -> Decision {
        let capacity = match op.limit {
            Limit::FixedWindow { limit, .. } | Limit::SlidingWindow { limit, .. } => limit,
            Limit::TokenBucket { rate, .. } => rate,
            Limit::Concurrency { limit, .. } => limit,
        };
        self.decide_within(tag, op, capacity.div_ceil(self.instances()), count, now)
    }

    /// The decision of `op`, admitting at most `fair` in each window of the limit's
    /// period, counted here as `count` says (a global limit's part of its region's
    /// share: `crate::regions::Regions::share`).
    pub(crate) fn decide_within(&self, tag: Tag, op: &Op, fair: u64, count: Count, now: Millis) -> Decision {
        let period = match op.limit {
            Limit::FixedWindow { window, .. } | Limit::SlidingWindow { window, .. } => window,
            Limit::TokenBucket { per, .. } => per,
            Limit::Concurrency { .. } => 1_000,
        };
        let end = (now / period.max(1) + 1) * period.max(1);
        let mut counts = self.counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if counts.len() >= MAX_COUNTED && self.sweeps.due(now, SWEEP_EVERY) {
            let mut ended = 0;
            counts.retain(|_, c| {
                ended += if c.end > now { 0 } else { c.pending() };
                c.end > now
            });
            // what was owed in windows that ended is owed no more
            self.owed.fetch_sub(ended, Relaxed);
        }
        // a concurrency limit's count here is of a second's requests, not of leases the
        // store could be charged with
        let charged = count == Count::Owed && !matches!(op.limit, Limit::Concurrency { .. });
        let fresh = Counted { end, used: 0, owed: 0, sent: None, charged, limit: op.limit };
        let mut read;
        let c = match count {
            Count::Not => {
                read = counts.get(&(tag, op.key)).copied().filter(|c| c.end == end).unwrap_or(fresh);
                &mut read
            }
            _ if counts.len() >= MAX_COUNTED && !counts.contains_key(&(tag, op.key)) => {
                drop(counts);
                return self.spilled(tag, op, fair, end, now);
            }
            _ => {
                let c = counts.entry((tag, op.key)).or_insert(fresh);
                if c.end != end {
                    self.owed.fetch_sub(c.pending(), Relaxed);
                    *c = fresh;
                }
                c
            }
        };
        let allowed = c.used + op.cost <= fair || op.shadow;
        if allowed && !op.shadow && count != Count::Not {
            c.used += op.cost;
            if c.charged {
                c.owed += op.cost;
                self.owed.fetch_add(op.cost, Relaxed);
                self.owed_until.fetch_max(end, Relaxed);
            }
        }
        decision(allowed, fair, c.used, end, now)
    }

    /// The decision of a client past [`MAX_COUNTED`], on the count it shares. A shared
    /// count still running for another window (a limit of another period) is kept and
    /// runs to the later end: only ever stricter. Not charged to the store.
    fn spilled(&self, tag: Tag, op: &Op, fair: u64, end: Millis, now: Millis) -> Decision {
        let mut spill = self.spill.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if spill.is_empty() {
            spill.resize(SPILL, (0, 0));
        }
        // a tag is a keyed hash already: its low bits are as good as any
        let at = (tag.0 as u64 ^ op.key.rotate_left(29)) as usize % SPILL;
        let (shared_end, used) = &mut spill[at];
        if *shared_end <= now {
            (*shared_end, *used) = (end, 0);
        }
        *shared_end = (*shared_end).max(end);
        let allowed = *used + op.cost <= fair || op.shadow;
        if allowed && !op.shadow {
            *used += op.cost;
        }
        decision(allowed, fair, *used, *shared_end, now)
    }

    /// The store failed a call: decisions fall to the failure policy.
    pub(crate) fn store_failed(&self) {
        self.answered.store(u64::MAX, Relaxed);
    }

    /// The store answered a call at `now`. Called on every decision the store made: a
    /// load alone while nothing failed (a write each time would pass one cache line
    /// between every core deciding).
    pub(crate) fn store_answered(&self, now: Millis) {
        if self.answered.load(Relaxed) == u64::MAX {
            let _ = self.answered.compare_exchange(u64::MAX, now, Relaxed, Relaxed);
        }
    }

    /// Whether `tag`'s state `key` was decided here in the window running now, to be
    /// charged to the store, and the store failed or answered again less than
    /// [`FINISH_AT_MOST`] ago: then it is decided here too.
    pub(crate) fn deciding(&self, tag: Tag, key: u64, now: Millis) -> bool {
        let answered = self.answered.load(Relaxed);
        if self.owed_until.load(Relaxed) <= now || answered.saturating_add(FINISH_AT_MOST) <= now {
            return false;
        }
        let counts = self.counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        counts.get(&(tag, key)).is_some_and(|c| c.charged && c.end > now)
    }

    /// Whether some of what was admitted here is still to be charged to the store, no
    /// settling is under way and none was begun in the last [`SETTLE_EVERY`].
    pub(crate) fn settle_due(&self, now: Millis) -> bool {
        self.owed.load(Relaxed) > 0 && !self.settling.load(Relaxed) && self.attempts.due(now, SETTLE_EVERY)
    }

    /// Charges the store with what was admitted here in windows still running, once at
    /// a time (a call while one runs does nothing); what a failed call could not charge
    /// stays owed. Returns the units charged.
    pub(crate) async fn settle(&self, store: &dyn Store, now: Millis) -> u64 {
        if self.settling.swap(true, Relaxed) {
            return 0;
        }
        let owed: Vec<((Tag, u64), Counted)> = {
            let mut counts = self.counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let owed: Vec<_> = counts
                .iter_mut()
                .filter(|(_, c)| c.pending() > 0)
                .map(|(at, c)| (*at, std::mem::replace(c, Counted { owed: 0, sent: None, ..*c })))
                .collect();
            self.owed.fetch_sub(owed.iter().map(|(_, c)| c.pending()).sum(), Relaxed);
            // what was owed in windows that ended is owed no more
            owed.into_iter().filter(|(_, c)| c.end > now).collect()
        };
        let (mut charged, mut left) = (0, owed.into_iter());
        for ((tag, key), c) in left.by_ref() {
            if let Err(unsettled) = charge(store, tag, key, &c, now).await {
                // the store failed again: this and the rest stay owed
                self.owe_again(std::iter::once(((tag, key), unsettled)));
                break;
            }
            self.store_answered(now);
            charged += c.pending();
        }
        self.owe_again(left);
        self.settling.store(false, Relaxed);
        charged
    }

    /// Owes again what could not be charged, where its window still runs here.
    fn owe_again(&self, uncharged: impl Iterator<Item = ((Tag, u64), Counted)>) {
        let mut counts = self.counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for (at, c) in uncharged {
            if let Some(now) = counts.get_mut(&at).filter(|now| now.end == c.end) {
                now.owed += c.owed;
                now.sent = c.sent;
                self.owed.fetch_add(c.pending(), Relaxed);
            }
        }
    }

    /// Keeps this instance in the store's set of instances while this fallback is in use,
    /// and what it knows of the fleet current. Once: a second call does nothing.
    pub fn spawn_heartbeat(self: &Arc<Self>, store: Arc<dyn Store>, tagger: &Tagger, clock: Arc<dyn Clock>) {
        if self.beating.swap(true, Relaxed) {
            return;
        }
        let (me, tag) = (Arc::downgrade(self), tagger.tag("sluice", "instances", "all"));
        let limit = Limit::Concurrency { limit: 1 << 20, lease_ttl: HEARTBEAT_TTL };
        tokio::spawn(async move {
            let (mut held, mut seen_before): (Option<(Lease, Millis)>, u64) = (None, 0);
            loop {
                let Some(fallback) = me.upgrade() else { return };
                let now = clock.now();
                // a new lease each beat, the old one given back after: a lease taken again
                // keeps its first time, and giving back first would let instances beating
                // at once each miss the others (a count too low: a fair part too large)
                let lease = new_lease();
                let op = Op { key: 1, limit, cost: 1, lease: Some(lease), shadow: false };
                if let Ok(d) = store.apply(tag, &[op], now).await {
                    fallback.store_answered(now);
                    // this instance's lease before, if the store still counts it
                    let mine = u64::from(held.is_some_and(|(_, at)| at + HEARTBEAT_TTL > now));
                    let seen = d.first().map_or(1, |d| d.used.saturating_sub(mine).max(1));
                    // a fleet that grew counts at once (a fair part smaller); one that shrank
                    // only once two beats in a row saw it: a store started again empty has
                    // none of the others' leases until they beat again, and a count of one
                    // would let this instance admit the whole limit alone
                    fallback.instances.store(seen.max(seen_before), Relaxed);
                    seen_before = seen;
                    if let Some((old, _)) = held.replace((lease, now)) {
                        let _ = store.release(tag, &[op.key], old, now).await;
                    }
                    // the store answers: what was admitted here while it did not is owed
                    // to it (requests settle it sooner, when they reach the store)
                    if fallback.settle_due(now) {
                        fallback.settle(&*store, now).await;
                    }
                }
                drop(fallback);
                tokio::time::sleep(std::time::Duration::from_millis(next_beat())).await;
            }
        });
    }
}

/// A decision of a count here: `used` of `fair` in the window ending at `end`.
fn decision(allowed: bool, fair: u64, used: u64, end: Millis, now: Millis) -> Decision {
    let retry_after = (!allowed).then(|| end.saturating_sub(now));
    let remaining = if allowed { fair - used.min(fair) } else { 0 };
    Decision { holds: false, allowed, limit: fair, used, remaining, reset_at: end, retry_after }
}

impl Counted {
    /// The units still to be charged: owed, and sent without an answer.
    fn pending(&self) -> u64 {
        self.owed + self.sent.map_or(0, |(_, units)| units)
    }
}

/// Charges what `c` still owes of `tag`'s state `key` to `store`: on a fixed window, as
/// a commit counted past the limit too (they were admitted) under an id of its own, so
/// that a charge sent again after a call that failed, but ran, counts once; else as much
/// of it as the state has left. What could not be charged, on an error.
async fn charge(store: &dyn Store, tag: Tag, key: u64, c: &Counted, now: Millis) -> Result<(), Counted> {
    if matches!(c.limit, Limit::FixedWindow { .. }) && store.reservations() {
        let commit = |actual| [Commit { key, limit: c.limit, actual }];
        if let Some((id, units)) = c.sent {
            store.commit(tag, id, &commit(units), now).await.map_err(|_| *c)?;
        }
        if c.owed > 0 {
            let id = new_lease() as u64 | 1;
            let unsent = Counted { sent: Some((id, c.owed)), owed: 0, ..*c };
            store.commit(tag, id, &commit(c.owed), now).await.map_err(|_| unsent)?;
        }
        return Ok(());
    }
    let op = |cost| Op { key, limit: c.limit, cost, lease: None, shadow: false };
    let d = store.apply(tag, &[op(c.pending())], now).await.map_err(|_| *c)?;
    match d.first() {
        Some(d) if !d.allowed && d.remaining > 0 => {
            store.apply(tag, &[op(d.remaining)], now).await.map(|_| ()).map_err(|_| *c)
        }
        _ => Ok(()),
    }
}

/// How long until the next beat: [`HEARTBEAT`] less up to a fifth of it, at random.
/// Instances started together (a rollout) would otherwise beat together for ever, and an
/// instance that counts while another is between taking its new lease and giving back
/// its old one counts that one twice (a CI saw 6 instances of 4, every beat).
fn next_beat() -> Millis {
    let mut seed = [0u8; 8];
    let _ = getrandom::fill(&mut seed);
    HEARTBEAT - u64::from_le_bytes(seed) % (HEARTBEAT / 5)
}

fn new_lease() -> Lease {
    let mut seed = [0u8; 16];
    let _ = getrandom::fill(&mut seed);
    u128::from_le_bytes(seed).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(key: u64) -> Op {
        Op {
            key,
            limit: Limit::FixedWindow { limit: 2, window: 3_600_000, aligned: false },
            cost: 1,
            lease: None,
            shadow: false,
        }
    }

    /// A flood of distinct clients in hour-long windows (none ends to make room): past
    /// the bound, clients share counts; the table stays at its bound, none is admitted
    /// past its fair part, and those counted one by one keep their counts.
    /// `cargo test --release -p sluice --lib fallback -- --nocapture` prints the cost.
    #[test]
    fn past_its_bound_clients_share_counts_that_never_admit_more() {
        let f = Fallback::default();
        let now = 1_000_000;
        let tag = |i: u64| Tag(u128::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835));
        let clients = MAX_COUNTED as u64 + 200_000;
        let started = tokio::time::Instant::now();
        let mut admitted_past_bound = 0;
        for i in 0..clients {
            let admitted = (0..3).filter(|_| f.decide(tag(i), &op(1), Count::Owed, now).allowed).count();
            assert!(admitted <= 2, "client {i}: {admitted} of a fair part of 2");
            if i < MAX_COUNTED as u64 {
                assert_eq!(admitted, 2, "client {i}, counted one by one");
            } else {
                admitted_past_bound += admitted;
            }
        }
        let took = started.elapsed();
        eprintln!(
            "{} decisions of {clients} clients: {:.2} us each; past the bound {admitted_past_bound} admitted of {}",
            3 * clients,
            took.as_secs_f64() * 1e6 / (3 * clients) as f64,
            2 * (clients - MAX_COUNTED as u64)
        );
        assert_eq!(f.counts.lock().unwrap().len(), MAX_COUNTED);
        assert!(!f.decide(tag(7), &op(1), Count::Owed, now).allowed, "a counted client keeps its count");
        assert!(admitted_past_bound > 0, "the clients past the bound were all refused");
        // the windows end: the table makes room again, one client at a time
        let later = now + 3_600_000;
        assert!(f.decide(tag(clients + 1), &op(1), Count::Owed, later).allowed);
        assert_eq!(f.counts.lock().unwrap().len(), 1, "the ended windows were dropped");
    }

    /// What was admitted here is owed to the store, and a status read counts nothing.
    #[test]
    fn admissions_are_owed_and_reads_count_nothing() {
        let f = Fallback::default();
        let t = Tag(42);
        f.store_failed();
        assert!(f.decide(t, &op(1), Count::Not, 10).allowed);
        assert!(!f.deciding(t, 1, 10), "a read decides nothing");
        assert!(f.decide(t, &op(1), Count::Owed, 10).allowed);
        assert!(f.decide(t, &op(1), Count::Here, 10).allowed);
        assert!(f.deciding(t, 1, 10) && !f.deciding(t, 2, 10));
        assert_eq!(f.owed.load(Relaxed), 2);
        assert!(!f.deciding(t, 1, 3_600_000), "the window ended");
        // the store answers again: decided here for a while, not for the rest of the hour
        f.store_answered(20);
        assert!(f.deciding(t, 1, 20 + FINISH_AT_MOST - 1) && !f.deciding(t, 1, 20 + FINISH_AT_MOST));
        f.store_answered(30);
        assert!(!f.deciding(t, 1, 20 + FINISH_AT_MOST), "answered once: the first answer counts");
        f.store_failed();
        assert!(f.deciding(t, 1, 20 + FINISH_AT_MOST), "failing again");
        // a new window drops what the old one owed
        assert!(f.decide(t, &op(1), Count::Owed, 3_600_000).allowed);
        assert_eq!(f.owed.load(Relaxed), 1);
    }
}
