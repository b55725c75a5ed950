//! A decision's own move: a decision that finds its region's pool short of its cost on a
//! global window has the allocator's move for its client made at once and waits for it,
//! bounded ([`Regions::wait_bound`]); one move per client and window at a time, in a task
//! of its own, so units granted reach the pool whoever still waits. And the refusals:
//! the fleet spent the window as far as the region knows, or the answer came too late.

use super::{Regions, TICK, WAIT_MARGIN};
use crate::algo::pool::Act;
use crate::algo::{Decision, Op, pool};
use crate::store::StoreError;
use crate::tag::Tag;
use crate::time::Millis;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use tokio::time::Instant;

/// What `Regions::hurry` found.
#[derive(Debug, Clone)]
pub(crate) enum Hurried {
    /// The region's pool holds the decision's units now.
    Filled,
    /// The global store said it had none left in this window: the fleet spent the limit
    /// (as far as this region can know: another region may give some back).
    Spent,
    /// The global store did not answer within the wait; it may have units.
    Waiting,
    /// The window ended while the decision waited: it is decided in the next.
    Ended,
    /// The global store, or the region's, failed: the rule's `failure` decides.
    Failed(StoreError),
}

/// A move of `Regions::hurry` under way: what it found, once it has.
pub(super) type InFlight = tokio::sync::watch::Receiver<Option<Hurried>>;

impl Regions {
    /// Whether the fleet has spent the window `op` names at `planned`, as far as this
    /// region knows: the global store said within a horizon that it had less than the
    /// cost left, and the region's pool (read within a tick) holds less than it. A decision so
    /// refused needs neither its turn nor a move (counted as `fleet_spent`), so the
    /// refusals of a spent window do not queue behind each other.
    pub(crate) async fn fleet_spent(&self, tag: Tag, op: &Op, planned: Millis) -> bool {
        let (end, cost) = (pool::window_end(&op.limit, planned), op.cost.max(1));
        let (base, now) = (pool::base_key(op.key, &op.limit, end), self.clock.now());
        let h = self.known(tag, base, end);
        if now >= end || !h.said_spent(cost, now, self.horizon()) {
            return false;
        }
        // the pool as read within a tick: a spent window's refusals cost no store call
        let (cap, used) = h.seen;
        let spent = if now < h.seen_at + TICK && cap.saturating_sub(used) < cost {
            true
        } else {
            let call = self.pool_call(op.key, &op.limit, end, Act::Read);
            let Ok((_, pool)) = self.region_pool(tag, call, now).await else { return false };
            self.saw(tag, base, end, &pool);
            pool.unspent() < cost
        };
        if spent {
            self.refused_spent();
        }
        spent
    }

    /// The round trip to the global store as measured here (smoothed), in ms.
    pub fn round_trip(&self) -> Millis {
        self.latency.load(Relaxed)
    }

    /// How long a decision waits for `Self::hurry`: twice the round trip to the global
    /// store as measured here (room for a second move, should the first one's units be
    /// taken), and [`WAIT_MARGIN`] for the region's own calls.
    pub fn wait_bound(&self) -> Millis {
        2 * self.latency.load(Relaxed) + WAIT_MARGIN
    }

    /// A decision found its region's pool short of `op`'s cost on a global window: the
    /// allocator's move for that one client, now rather than at the next tick, while the
    /// decision waits at most [`Self::wait_bound`] (the move goes on if it takes longer:
    /// units granted are never left out of the pool). See [`Hurried`].
    /// `planned`: when the decision was planned; `op`'s key names the window of that
    /// time, and only that window's pool is filled (a grant on that key asked for in the
    /// next window would be the next window's, counted apart from its own key's).
    /// `waiting`: the decisions of the client queued behind this one on this instance
    /// (asked for too, not needed: the fleet may have units for this one alone); `left`:
    /// how long the decision waits, in ms (what is left of [`Self::wait_bound`]).
    pub(crate) async fn hurry(
        self: &Arc<Self>,
        tag: Tag,
        op: &Op,
        planned: Millis,
        (waiting, left): (u64, Millis),
    ) -> Hurried {
        self.stats.hurried.fetch_add(1, Relaxed);
        self.metrics.hurried.increment(1);
        let bound = std::time::Duration::from_millis(left);
        let moved = self.move_for(tag, (op, waiting), planned, bound);
        let within = self.bounded(left, moved).await.unwrap_or_else(|late| late);
        let hurried = match within {
            Hurried::Waiting if self.clock.now() >= pool::window_end(&op.limit, planned) => Hurried::Ended,
            hurried => hurried,
        };
        if let Hurried::Spent = hurried {
            self.refused_spent();
        }
        hurried
    }

    /// `call` (a decision's move, or its wait for the turn of a move under way), given
    /// `left` ms; if it took longer, what the wait found: failed if the global store's
    /// last call did (a link that drops every packet answers nothing until the call's
    /// deadline), or if the global store or the region's answered none of their calls
    /// under way after the wait's first round trip (a store stopped or hung: the rule's
    /// `failure` decides, not a refusal that says it may have units; answers already on
    /// their way when it stopped arrive within that round trip; a stalled global store is
    /// then counted as failing until it answers); else waiting (both answer, this
    /// client's move was slower).
    pub(crate) async fn bounded<T>(
        &self,
        left: Millis,
        call: impl std::future::Future<Output = T>,
    ) -> Result<T, Hurried> {
        let mut call = std::pin::pin!(call);
        let bound = std::time::Duration::from_millis(left);
        let first = std::time::Duration::from_millis(self.round_trip().min(left / 2));
        if let Ok(answer) = tokio::time::timeout(first, &mut call).await {
            return Ok(answer);
        }
        let (global, region) = (self.global_calls.answered(), self.region_calls.answered());
        if let Ok(answer) = tokio::time::timeout(bound - first, &mut call).await {
            return Ok(answer);
        }
        let stalled = |whose: &str| {
            let why = format!("{whose} store answered none of its calls under way in a wait of {left} ms");
            Hurried::Failed(StoreError::unavailable(why))
        };
        Err(if self.global_calls.stalled_since(global) {
            self.global_down.store(true, Relaxed);
            stalled("the global")
        } else if self.region_calls.stalled_since(region) {
            stalled("the region's")
        } else if !self.global_answers() {
            Hurried::Failed(StoreError::unavailable("the global store did not answer its last call"))
        } else {
            Hurried::Waiting
        })
    }

    /// A call to the region's store on a global limit's behalf (an instance's grant from
    /// the region's pool), counted under way: a decision waiting for the turn of one
    /// hung on it finds the region's store stalled ([`Self::bounded`]).
    pub(crate) async fn region_call<T>(&self, call: impl std::future::Future<Output = T>) -> T {
        self.region_calls.counted(call).await
    }

    /// Counts a decision refused because the fleet spent its window.
    pub(super) fn refused_spent(&self) {
        self.stats.refused_spent.fetch_add(1, Relaxed);
        self.metrics.refused_spent.increment(1);
    }

    /// The refusal `d` of `op` (planned at `planned`) because the global store's answer
    /// had not come within the decision's wait, counted (a refusal under the limit, as far
    /// as anyone knows): units are expected within a horizon, not at the window's end, and
    /// `remaining` and `used` are the fleet's count as the region last knew it (all of the
    /// limit if it never knew: nothing was seen spent), not a spent window's. A client
    /// told `remaining: 37` with `Retry-After: 1` knows it may come back soon (as with a
    /// secondary limit), where `remaining: 0, used: 40` said it had used everything.
    pub(crate) fn refuse_waiting(&self, tag: Tag, op: &Op, planned: Millis, d: Decision, now: Millis) -> Decision {
        self.stats.refused_waiting.fetch_add(1, Relaxed);
        self.metrics.refused_waiting.increment(1);
        let remaining = self.known_left(tag, op, planned).unwrap_or(d.limit).min(d.limit);
        let retry_after = Some(self.horizon().min(d.reset_at.saturating_sub(now)));
        Decision { retry_after, remaining, used: d.limit - remaining, ..d }
    }

    /// The move for `op`'s client in the window of `planned`: the one under way, or a
    /// new one, run in a task of its own (so that units granted reach the pool whoever
    /// still waits) that gives up `bound` from now if it has not claimed the pool yet.
    /// One move per client and window at a time: decisions that stopped waiting leave
    /// no moves behind them, each reading the pool until the window ends.
    pub(super) fn move_for(
        self: &Arc<Self>,
        tag: Tag,
        (op, waiting): (&Op, u64),
        planned: Millis,
        bound: std::time::Duration,
    ) -> impl std::future::Future<Output = Hurried> + use<> {
        let end = pool::window_end(&op.limit, planned);
        let at = (tag, pool::base_key(op.key, &op.limit, end), end);
        let mut found = {
            let mut hurrying = self.hurrying.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match hurrying.get(&at) {
                Some(moving) => moving.clone(),
                None => {
                    let (tell, found) = tokio::sync::watch::channel(None);
                    let (me, op, until) = (self.clone(), *op, Instant::now() + bound);
                    tokio::spawn(async move {
                        let hurried = me.hurry_now(tag, (&op, waiting), end, until).await;
                        me.hurrying.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&at);
                        let _ = tell.send(Some(hurried.unwrap_or_else(Hurried::Failed)));
                    });
                    hurrying.insert(at, found.clone());
                    found
                }
            }
        };
        async move {
            match found.wait_for(Option::is_some).await {
                Ok(h) => h.clone().expect("waited for"),
                Err(_) => Hurried::Failed(StoreError::unavailable("the call to the global store ended abruptly")),
            }
        }
    }

    /// The move itself; before it claims the pool it gives up at `until` (nothing asked
    /// yet: the next decision that finds the pool short starts another).
    pub(super) async fn hurry_now(
        &self,
        tag: Tag,
        (op, waiting): (&Op, u64),
        end: Millis,
        until: Instant,
    ) -> Result<Hurried, StoreError> {
        let (limit, cost) = (op.limit, op.cost.max(1));
        let base = pool::base_key(op.key, &limit, end);
        let call = |act| self.pool_call(op.key, &limit, end, act);
        let mut pause = std::time::Duration::from_millis(2);
        loop {
            // every call as at a time of the window `end` closes (its last ms at the
            // latest): never the next window's
            let now = self.clock.now().min(end - 1);
            if self.clock.now() >= end {
                return Ok(Hurried::Ended);
            }
            if Instant::now() >= until {
                return Ok(Hurried::Waiting);
            }
            let (_, pool) = self.region_pool(tag, call(Act::Read), now).await?;
            if pool.unspent() >= cost {
                return Ok(Hurried::Filled);
            }
            // the global store said lately it had nothing left: the fleet spent it
            if self.known(tag, base, end).said_spent(cost, now, self.horizon()) {
                return Ok(Hurried::Spent);
            }
            let horizon = self.horizon();
            if let (1, _) = self.region_pool(tag, call(Act::Claim { ttl: horizon }), now).await? {
                let need = cost - pool.unspent();
                // this decision's units, those of the decisions queued behind it, and
                // the region's demand until the next tick (the allocator sizes the
                // rest): a hot region that hurries does not take what the others will
                // need, and its queue is served by one move
                let per_s = pool.demand.per_s(horizon, now);
                let queued = cost.saturating_mul(waiting);
                let want = need.saturating_add(queued) + (per_s * TICK as f64 / 1_000.0).ceil() as u64;
                let taken = self.take(tag, (base, op.key), &limit, (end, now), (want, need), &pool).await;
                match taken {
                    Ok(0) => return Ok(Hurried::Spent),
                    Ok(_) => return Ok(Hurried::Filled),
                    Err(e) => {
                        let _ = self.region_pool(tag, call(Act::Release), now).await;
                        return Err(e);
                    }
                }
            }
            // another allocator of the region is moving this pool: read it again soon
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(std::time::Duration::from_millis(20));
        }
    }
}
