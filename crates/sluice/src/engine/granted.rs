//! Decisions from quota grants (`grants:`, `global: true`): units held by this instance
//! spent without a store call, a grant asked for when they run short (one request at a
//! time a key), and on a global limit the region's allocator hurried while the decision
//! waits, bounded; a group stays all or nothing, a refusal putting the spent units back.

use super::{Limiter, refund_of};
use crate::algo::{Decision, Op, pool};
use crate::grants::{Leftovers, Take};
use crate::plan::{Group, unevaluated};
use crate::regions::Hurried;
use crate::rules::GrantRule;
use crate::store::StoreError;
use crate::tag::Tag;
use crate::time::Millis;
use std::sync::Arc;

/// What spending a group's granted ops came to ([`Limiter::spend_group`]): each op's
/// decision (unevaluated for the ops not spent here), the ops that took units, and
/// whether an enforced one was refused.
#[derive(Default)]
pub(super) struct Spent {
    pub decisions: Vec<Decision>,
    pub spent: Vec<usize>,
    pub refused: bool,
}

impl Limiter {
    /// One group's decisions when some of its ops are decided from quota grants: those
    /// spend units held (or take a grant first), the others are one store call, and
    /// the group stays all or nothing: a refusal puts the spent units back.
    pub(super) async fn evaluate_granted(&self, g: &Group, now: Millis) -> Result<Vec<Decision>, StoreError> {
        let Spent { mut decisions, spent, mut refused } = self.spend_group(g, now, |_| true).await?;
        let rest: Vec<usize> = (0..g.ops.len()).filter(|&i| g.grants_of(i).is_none()).collect();
        if !rest.is_empty() {
            let ops: Vec<Op> = rest.iter().map(|&i| g.ops[i]).collect();
            // a refused request charges nothing: the others only report
            let answer = match refused {
                true => self.store.peek(g.tag, &ops, now).await,
                false => self.store.apply(g.tag, &ops, now).await,
            };
            let answer = match answer {
                Ok(answer) => answer,
                Err(e) => {
                    self.put_back(g, &spent, &mut decisions, now).await?;
                    return Err(e);
                }
            };
            refused |= ops.iter().zip(&answer).any(|(o, d)| !o.shadow && !d.allowed);
            for (i, d) in rest.into_iter().zip(answer) {
                decisions[i] = d;
            }
        }
        if refused {
            self.put_back(g, &spent, &mut decisions, now).await?;
        }
        Ok(decisions)
    }

    /// Spends the cost of each op of `g` decided from grants whose rule `which` takes;
    /// the other ops are left unevaluated. A store error puts back what was spent.
    pub(super) async fn spend_group(
        &self,
        g: &Group,
        now: Millis,
        which: impl Fn(&GrantRule) -> bool,
    ) -> Result<Spent, StoreError> {
        let mut s = Spent { decisions: g.ops.iter().map(|o| unevaluated(&o.limit)).collect(), ..Spent::default() };
        let mut out = Leftovers::default();
        for (i, op) in g.ops.iter().enumerate() {
            let Some(rule) = g.grants_of(i).filter(|r| which(r)) else { continue };
            let d = match self.spend(g.tag, op, rule, (&mut out, now)).await {
                Ok(d) => d,
                Err(e) => {
                    self.settle_later(out, now);
                    self.put_back(g, &s.spent, &mut s.decisions, now).await?;
                    return Err(e);
                }
            };
            s.refused |= !d.allowed && !op.shadow;
            if d.allowed && op.cost > 0 {
                s.spent.push(i);
            }
            s.decisions[i] = match self.regions.as_ref().filter(|_| rule.global && d.allowed) {
                Some(regions) => self.fleet_answer(regions, g.tag, op, d, now).await,
                None => d,
            };
        }
        self.settle_later(out, now);
        Ok(s)
    }

    /// Spends `op`'s cost from the grants held, taking a grant from the store first when
    /// too few units are held; asks for the next grant in the background when due.
    /// `planned`: when the request was planned (a global limit's op names that time's
    /// window; if that window ends while the decision waits, it is decided in the next,
    /// and its decision names that one).
    pub(super) async fn spend(
        &self,
        tag: Tag,
        op: &Op,
        rule: &Arc<GrantRule>,
        (out, mut planned): (&mut Leftovers, Millis),
    ) -> Result<Decision, StoreError> {
        let (mut turn, mut granted, began) = (None, None, self.clock.now());
        let (mut hurries, mut op) = (0u8, *op);
        let op = &mut op;
        if let Some(regions) = self.regions.as_ref().filter(|_| rule.global) {
            regions.arrived(tag, op, planned);
        }
        loop {
            // the time now, not when the request came in: a grant's units lapse, and
            // waiting for a turn or the store takes time
            let now = self.clock.now();
            if rule.global && now >= pool::window_end(&op.limit, planned) {
                op.key = pool::rekey(op.key, &op.limit, planned, now);
                (planned, granted, hurries) = (now, None, 0);
            }
            match self.grants.take(tag, op, rule, now, out) {
                Take::Spent(d, refresh) => {
                    if let Some(ask) = refresh {
                        self.refresh(tag, ask, rule.clone());
                    }
                    return Ok(d);
                }
                Take::Refused(d) => return Ok(d),
                // one request at a time asks for a key; the others then find its units
                Take::Short(_) if turn.is_none() => {
                    if let Some(d) = self.spent_fleet(tag, (op, rule), planned, now).await {
                        return Ok(d);
                    }
                    match self.turn_within(tag, (op, rule), planned, began).await {
                        Ok(t) => turn = Some(t),
                        Err(answer) => return answer,
                    }
                }
                // the grant was short: refused, or (a global limit) hurried
                Take::Short(_) if let Some(g) = &granted => {
                    match self.hurry(tag, (op, rule), g, (planned, now, began), &mut hurries).await {
                        Some(answer) => return answer,
                        None => granted = None,
                    }
                }
                Take::Short(_) if self.grants.failed_since(tag, op.key, began) => {
                    let why = "the grant asked for while this decision waited failed; not asked again";
                    return Err(StoreError::unavailable(why));
                }
                Take::Short(ask) => {
                    let waiting = turn.as_ref().map_or(0, |(_, waiting)| *waiting);
                    granted = Some(self.ask_grant(tag, (op, rule), ask, (waiting, now), out).await?);
                }
            }
        }
    }

    /// Asks the store for the grant `ask` of `op` under `rule`, for this request and the
    /// `waiting` behind it.
    pub(super) async fn ask_grant(
        &self,
        tag: Tag,
        (op, rule): (&Op, &Arc<GrantRule>),
        mut ask: crate::store::GrantAsk,
        (waiting, now): (u64, Millis),
        out: &mut Leftovers,
    ) -> Result<crate::algo::grant::Granted, StoreError> {
        // grants of a limit this one replaced go back first: the store counts them until
        // then
        if !out.give_back.is_empty() {
            let _ = self.grants.settle(&*self.store, std::mem::take(out), now).await;
        }
        // enough for the requests waiting behind this one too (a burst on a key costs a
        // grant call, not one a few requests), within `max`
        let burst = op.cost.saturating_mul(waiting + 1).min(rule.grants.max.unwrap_or(u64::MAX));
        ask.want = ask.want.max(burst);
        let asked = self.grants.ask_store(&*self.store, tag, ask, rule, now, out);
        // a global limit's grant comes from the region's pool: counted under way, as a
        // call of the region's store others wait for (`Regions::bounded`)
        let asked = match self.regions.as_ref().filter(|_| rule.global) {
            Some(regions) => regions.region_call(asked).await,
            None => asked.await,
        };
        if asked.is_err() {
            self.grants.ask_failed(tag, op.key, self.clock.now());
        }
        asked
    }

    /// The refusal of a global limit's `op` whose window the fleet has spent, as its
    /// region knows (`Regions::fleet_spent`); None for any other.
    pub(super) async fn spent_fleet(
        &self,
        tag: Tag,
        (op, rule): (&Op, &GrantRule),
        planned: Millis,
        now: Millis,
    ) -> Option<Decision> {
        let regions = self.regions.as_ref().filter(|_| rule.global)?;
        match regions.fleet_spent(tag, op, planned).await {
            true => Some(self.grants.refusal_in(tag, op, pool::window_end(&op.limit, planned), now)),
            false => None,
        }
    }

    /// The turn to ask for `op`'s key. A global limit's decision waits for it at most
    /// what is left of its wait ([`crate::regions::Regions::wait_bound`] from `began`),
    /// then is refused as waiting (`Retry-After`: the horizon): the turn's holder may be
    /// waiting on the global store itself, and no decision waits longer than its bound.
    /// Or, if the global store or the region's answered nothing in that wait while calls
    /// were under way (the holder hung on a stalled store), the error: the rule's
    /// `failure` decides ([`crate::regions::Regions::bounded`]).
    pub(super) async fn turn_within(
        &self,
        tag: Tag,
        (op, rule): (&Op, &GrantRule),
        planned: Millis,
        began: Millis,
    ) -> Result<(tokio::sync::MutexGuard<'_, ()>, u64), Result<Decision, StoreError>> {
        let Some(regions) = self.regions.as_ref().filter(|_| rule.global) else {
            return Ok(self.grants.turn(tag, op.key).await);
        };
        let left = regions.wait_bound().saturating_sub(self.clock.now().saturating_sub(began));
        match regions.bounded(left, self.grants.turn(tag, op.key)).await {
            Ok(turn) => Ok(turn),
            Err(Hurried::Failed(e)) => Err(Err(e)),
            Err(_) => {
                let now = self.clock.now();
                let refused = self.grants.refusal_in(tag, op, pool::window_end(&op.limit, planned), now);
                Err(Ok(regions.refuse_waiting(tag, op, planned, refused, now)))
            }
        }
    }

    /// The grant `g` was short of `op`'s cost: the refusal, unless `rule` is a global
    /// limit, whose region's allocator then asks the global store now while this waits
    /// (bounded, from `began`) for it; `None` once the pool holds the units (take them).
    /// At most twice (`hurries`): the units the first move found may be taken before this
    /// decision's grant (by another instance of the region, or given back); a decision
    /// short after two is refused as waiting, a refusal under the limit as far as anyone
    /// knows.
    pub(super) async fn hurry(
        &self,
        tag: Tag,
        (op, rule): (&Op, &GrantRule),
        g: &crate::algo::grant::Granted,
        (planned, now, began): (Millis, Millis, Millis),
        hurries: &mut u8,
    ) -> Option<Result<Decision, StoreError>> {
        // built only when refused: a hurry that fills the pool (the usual case) needs none
        let refused = || self.grants.refusal(tag, op, g, now);
        let Some(regions) = self.regions.as_ref().filter(|_| rule.global) else { return Some(Ok(refused())) };
        if *hurries >= 2 {
            return Some(Ok(regions.refuse_waiting(tag, op, planned, refused(), now)));
        }
        *hurries += 1;
        // the decisions queued behind this one are asked for too
        let waiting = self.grants.queued(tag, op.key);
        // what is left of the decision's wait (its turn took some): no decision waits longer
        let left = regions.wait_bound().saturating_sub(now.saturating_sub(began)).max(1);
        match regions.hurry(tag, op, planned, (waiting, left)).await {
            Hurried::Filled | Hurried::Ended => None,
            Hurried::Failed(e) => Some(Err(e)),
            Hurried::Spent => Some(Ok(refused())),
            Hurried::Waiting => Some(Ok(regions.refuse_waiting(tag, op, planned, refused(), now))),
        }
    }

    /// An admitted decision of a global limit as the fleet's count says it: the units
    /// this instance holds, what its region's pool holds unspent, and what the global
    /// store has not granted (as the region last knew it), not what this instance
    /// happens to hold alone (which says `remaining: 0` while the fleet has units).
    pub(super) async fn fleet_answer(
        &self,
        regions: &crate::regions::Regions,
        tag: Tag,
        op: &Op,
        d: Decision,
        planned: Millis,
    ) -> Decision {
        // the window the decision names (the next one, if the planned one ended)
        let at = d.reset_at.saturating_sub(1);
        let key = pool::rekey(op.key, &op.limit, planned, at);
        let op = Op { key, ..*op };
        let Some(elsewhere) = regions.fleet_left(tag, &op, at).await else { return d };
        let remaining = self.grants.held(tag, op.key).saturating_add(elsewhere).min(d.limit);
        Decision { remaining, used: d.limit - remaining, ..d }
    }

    /// Asks for a grant in the background.
    pub(super) fn refresh(&self, tag: Tag, ask: crate::store::GrantAsk, rule: Arc<GrantRule>) {
        let (store, ledger, clock) = (self.store.clone(), self.grants.clone(), self.clock.clone());
        tokio::spawn(async move {
            let (now, mut out, key) = (clock.now(), Leftovers::default(), ask.key);
            match ledger.ask_store(&*store, tag, ask, &rule, now, &mut out).await {
                Ok(_) => {
                    let _ = ledger.settle(&*store, out, now).await;
                }
                Err(_) => ledger.refresh_failed(tag, key),
            }
        });
    }

    /// Gives back, in the background, grants revoked and counts units lapsed.
    pub(super) fn settle_later(&self, out: Leftovers, now: Millis) {
        if out.give_back.is_empty() {
            return;
        }
        let (store, ledger) = (self.store.clone(), self.grants.clone());
        tokio::spawn(async move {
            let _ = ledger.settle(&*store, out, now).await;
        });
    }

    /// Puts the units the ops at `spent` took from grants back (the group was refused),
    /// and reports their decisions as uncharged.
    pub(super) async fn put_back(
        &self,
        g: &Group,
        spent: &[usize],
        decisions: &mut [Decision],
        now: Millis,
    ) -> Result<(), StoreError> {
        let mut refunds = Vec::new();
        for &i in spent {
            let (op, d) = (&g.ops[i], &mut decisions[i]);
            let rest = self.grants.put_back(g.tag, op.key, &op.limit, op.cost, d.reset_at);
            if rest > 0 {
                refunds.push(refund_of(op, rest, d.reset_at));
            }
            d.used = d.used.saturating_sub(op.cost);
            d.remaining = d.remaining.saturating_add(op.cost).min(d.limit);
        }
        if !refunds.is_empty() {
            self.store.refund(g.tag, &refunds, now).await?;
        }
        Ok(())
    }
}
