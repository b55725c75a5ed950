//! `store.kind: per_second`: envoyproxy/ratelimit's `REDIS_PERSECOND`, a store of its own
//! for the fixed windows of one second (their `unit: SECOND` limits), the others on the
//! main store: per-second windows are the most written, and there they get a Redis of
//! their own.
//!
//! One client's limits then live on two stores, and a decision that meets both is two
//! calls, made at once. Each call is atomic on its store; across the two the decision is
//! kept all or nothing the way the engine keeps it across clients: when one side refuses,
//! what the other charged is given back (a refund), and its decisions report what is true
//! once it is. For that moment between the charge and its refund, a concurrent decision
//! on the other side may see the charge (and be refused by it), never a charge that stays.
//! A lease (concurrency) is the main store's alone, and is given back the same way.

use super::{
    Commit, GiveBack, GrantAsk, PoolCall, Refund, RegistryOp, RegistryReply, Reservation, Settled, Store, StoreError,
};
use crate::algo::grant::{Granted, Open};
use crate::algo::pool::Pool;
use crate::algo::reservation::Hold;
use crate::algo::{ConcurrencyState, Decision, Lease, Limit, Op};
use crate::tag::Tag;
use crate::time::Millis;
use async_trait::async_trait;
use std::sync::Arc;

/// The main store, and the store of the one-second windows.
pub struct PerSecondStore {
    main: Arc<dyn Store>,
    per_second: Arc<dyn Store>,
}

/// Whether `limit` lives on the per-second store: a fixed window of one second.
fn per_second(limit: &Limit) -> bool {
    matches!(limit, Limit::FixedWindow { window: 1_000, .. })
}

/// `items` parted by `side`: those on the main store, those on the per-second one, each
/// with its place in `items`.
fn parted<T: Clone>(items: &[T], side: impl Fn(&T) -> bool) -> [(Vec<usize>, Vec<T>); 2] {
    let mut parts: [(Vec<usize>, Vec<T>); 2] = Default::default();
    for (i, item) in items.iter().enumerate() {
        let p = &mut parts[usize::from(side(item))];
        p.0.push(i);
        p.1.push(item.clone());
    }
    parts
}

/// The two parts' answers in the order of the items they were parted from.
fn joined<T: Clone>(len: usize, parts: [(&[usize], Vec<T>); 2]) -> Vec<T> {
    let mut out: Vec<Option<T>> = vec![None; len];
    for (at, answers) in parts {
        for (&i, a) in at.iter().zip(answers) {
            out[i] = Some(a);
        }
    }
    out.into_iter().map(|a| a.expect("every item answered")).collect()
}

impl PerSecondStore {
    /// Fixed windows of one second on `per_second`, everything else on `main`.
    pub fn new(main: Arc<dyn Store>, per_second: Arc<dyn Store>) -> Self {
        Self { main, per_second }
    }

    fn side(&self, per_second: bool) -> &dyn Store {
        if per_second { &*self.per_second } else { &*self.main }
    }

    /// Takes back what `decisions` of `ops` (on `store`) charged or leased, when the
    /// other side refused or failed; the decisions then report the state without it.
    async fn undo(
        store: &dyn Store,
        tag: Tag,
        ops: &[Op],
        decisions: &mut [Decision],
        now: Millis,
    ) -> Result<(), StoreError> {
        let refunds: Vec<Refund> = ops
            .iter()
            .zip(decisions.iter())
            .filter(|(o, d)| d.allowed && o.cost > 0 && o.lease.is_none())
            .map(|(o, d)| Refund { key: o.key, limit: o.limit, cost: o.cost, window: d.reset_at })
            .collect();
        if !refunds.is_empty() {
            store.refund(tag, &refunds, now).await?;
        }
        for (o, d) in ops.iter().zip(decisions.iter_mut()).filter(|(o, d)| d.allowed && o.cost > 0 && o.lease.is_none())
        {
            d.used = d.used.saturating_sub(o.cost);
            d.remaining = d.remaining.saturating_add(o.cost).min(d.limit);
        }
        let leased: Vec<u64> = ops.iter().filter(|o| o.lease.is_some()).map(|o| o.key).collect();
        if let (Some(lease), false) = (ops.iter().find_map(|o| o.lease), leased.is_empty()) {
            store.release(tag, &leased, lease, now).await?;
        }
        Ok(())
    }

    /// `call` on each side's part of `ops` at once, kept all or nothing across the two
    /// (see the module's doc): [`Store::apply`] and [`Store::reserve`] alike.
    async fn both<F>(&self, tag: Tag, ops: &[Op], now: Millis, call: F) -> Result<Vec<Decision>, StoreError>
    where
        F: for<'a> Fn(
            &'a dyn Store,
            &'a [Op],
        ) -> futures_util::future::BoxFuture<'a, Result<Vec<Decision>, StoreError>>,
    {
        let [(main_at, main_ops), (second_at, second_ops)] = parted(ops, |o| per_second(&o.limit));
        if second_ops.is_empty() || main_ops.is_empty() {
            return call(self.side(main_ops.is_empty()), ops).await;
        }
        let (main, second) =
            futures_util::future::join(call(&*self.main, &main_ops), call(&*self.per_second, &second_ops)).await;
        let refused = |ops: &[Op], d: &[Decision]| ops.iter().zip(d).any(|(o, d)| !o.shadow && !d.allowed);
        match (main, second) {
            (Ok(mut m), Ok(mut s)) => {
                if refused(&main_ops, &m) && !refused(&second_ops, &s) {
                    Self::undo(&*self.per_second, tag, &second_ops, &mut s, now).await?;
                } else if refused(&second_ops, &s) && !refused(&main_ops, &m) {
                    Self::undo(&*self.main, tag, &main_ops, &mut m, now).await?;
                }
                Ok(joined(ops.len(), [(&main_at, m), (&second_at, s)]))
            }
            (Ok(mut m), Err(e)) => {
                let _ = Self::undo(&*self.main, tag, &main_ops, &mut m, now).await;
                Err(e)
            }
            (Err(e), Ok(mut s)) => {
                let _ = Self::undo(&*self.per_second, tag, &second_ops, &mut s, now).await;
                Err(e)
            }
            (Err(e), Err(_)) => Err(e),
        }
    }
}

#[async_trait]
impl Store for PerSecondStore {
    async fn apply(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
        self.both(tag, ops, now, |s, part| s.apply(tag, part, now)).await
    }

    async fn peek(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
        let [(main_at, main_ops), (second_at, second_ops)] = parted(ops, |o| per_second(&o.limit));
        let (m, s) = futures_util::future::join(
            async { if main_ops.is_empty() { Ok(Vec::new()) } else { self.main.peek(tag, &main_ops, now).await } },
            async {
                if second_ops.is_empty() { Ok(Vec::new()) } else { self.per_second.peek(tag, &second_ops, now).await }
            },
        )
        .await;
        Ok(joined(ops.len(), [(&main_at, m?), (&second_at, s?)]))
    }

    async fn release(&self, tag: Tag, keys: &[u64], lease: Lease, now: Millis) -> Result<bool, StoreError> {
        self.main.release(tag, keys, lease, now).await
    }

    async fn leases(&self, tag: Tag, key: u64, ttl: Millis, now: Millis) -> Result<ConcurrencyState, StoreError> {
        self.main.leases(tag, key, ttl, now).await
    }

    async fn refund(&self, tag: Tag, refunds: &[Refund], now: Millis) -> Result<(), StoreError> {
        let [(_, main), (_, second)] = parted(refunds, |r| per_second(&r.limit));
        if !main.is_empty() {
            self.main.refund(tag, &main, now).await?;
        }
        if !second.is_empty() {
            self.per_second.refund(tag, &second, now).await?;
        }
        Ok(())
    }

    async fn reset(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<(), StoreError> {
        let [(_, main), (_, second)] = parted(ops, |o| per_second(&o.limit));
        self.main.reset(tag, &main, now).await?;
        self.per_second.reset(tag, &second, now).await
    }

    fn grants(&self) -> bool {
        self.main.grants() && self.per_second.grants()
    }

    async fn grant(&self, tag: Tag, ask: GrantAsk, now: Millis) -> Result<Granted, StoreError> {
        self.side(per_second(&ask.limit)).grant(tag, ask, now).await
    }

    async fn give_back(&self, tag: Tag, back: GiveBack, now: Millis) -> Result<u64, StoreError> {
        self.side(per_second(&back.limit)).give_back(tag, back, now).await
    }

    fn pools(&self) -> bool {
        self.main.pools() && self.per_second.pools()
    }

    async fn pool(&self, tag: Tag, call: PoolCall, now: Millis) -> Result<(u64, Pool), StoreError> {
        self.side(per_second(&call.limit)).pool(tag, call, now).await
    }

    fn reservations(&self) -> bool {
        self.main.reservations() && self.per_second.reservations()
    }

    async fn reserve(&self, tag: Tag, ops: &[Op], r: Reservation, now: Millis) -> Result<Vec<Decision>, StoreError> {
        self.both(tag, ops, now, |s, part| s.reserve(tag, part, r, now)).await
    }

    async fn holds(&self, tag: Tag, key: u64, limit: &Limit, now: Millis) -> Result<Vec<Hold>, StoreError> {
        self.side(per_second(limit)).holds(tag, key, limit, now).await
    }

    async fn grants_open(&self, tag: Tag, key: u64, limit: &Limit, now: Millis) -> Result<Vec<Open>, StoreError> {
        self.side(per_second(limit)).grants_open(tag, key, limit, now).await
    }

    async fn commit(&self, tag: Tag, id: u64, commits: &[Commit], now: Millis) -> Result<Vec<Settled>, StoreError> {
        let [(main_at, main), (second_at, second)] = parted(commits, |c| per_second(&c.limit));
        let m = if main.is_empty() { Vec::new() } else { self.main.commit(tag, id, &main, now).await? };
        let s = if second.is_empty() { Vec::new() } else { self.per_second.commit(tag, id, &second, now).await? };
        Ok(joined(commits.len(), [(&main_at, m), (&second_at, s)]))
    }

    fn keeps_registry(&self) -> bool {
        self.main.keeps_registry()
    }

    async fn registry(&self, op: RegistryOp) -> Result<RegistryReply, StoreError> {
        self.main.registry(op).await
    }

    async fn preflight(&self) -> Result<(), StoreError> {
        self.main.preflight().await?;
        self.per_second.preflight().await
    }

    async fn ready(&self) -> bool {
        self.main.ready().await && self.per_second.ready().await
    }

    fn routing(&self) -> u64 {
        self.main.routing().wrapping_mul(31).wrapping_add(self.per_second.routing())
    }

    fn kind(&self) -> &'static str {
        "per_second"
    }

    fn address(&self) -> String {
        format!("{}; per second: {}", self.main.address(), self.per_second.address())
    }
}
