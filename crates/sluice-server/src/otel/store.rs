//! The store's calls as spans: a wrapper that times each call made while a sampled
//! request is decided (installed only when tracing is on).

use super::*;

/// A store whose calls made while a sampled request is decided become spans
/// (installed only when tracing is on).
pub struct TracedStore(pub Arc<dyn Store>);

#[async_trait::async_trait]
impl Store for TracedStore {
    async fn apply(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
        store_call("apply", self.0.apply(tag, ops, now)).await
    }

    async fn peek(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
        store_call("peek", self.0.peek(tag, ops, now)).await
    }

    async fn release(&self, tag: Tag, keys: &[u64], lease: Lease, now: Millis) -> Result<bool, StoreError> {
        store_call("release", self.0.release(tag, keys, lease, now)).await
    }

    async fn leases(&self, tag: Tag, key: u64, ttl: Millis, now: Millis) -> Result<ConcurrencyState, StoreError> {
        store_call("leases", self.0.leases(tag, key, ttl, now)).await
    }

    async fn refund(&self, tag: Tag, refunds: &[Refund], now: Millis) -> Result<(), StoreError> {
        store_call("refund", self.0.refund(tag, refunds, now)).await
    }

    async fn reset(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<(), StoreError> {
        store_call("reset", self.0.reset(tag, ops, now)).await
    }

    fn grants(&self) -> bool {
        self.0.grants()
    }

    async fn grant(&self, tag: Tag, ask: GrantAsk, now: Millis) -> Result<Granted, StoreError> {
        store_call("grant", self.0.grant(tag, ask, now)).await
    }

    async fn give_back(&self, tag: Tag, back: GiveBack, now: Millis) -> Result<u64, StoreError> {
        store_call("give_back", self.0.give_back(tag, back, now)).await
    }

    fn reservations(&self) -> bool {
        self.0.reservations()
    }

    async fn reserve(&self, tag: Tag, ops: &[Op], r: Reservation, now: Millis) -> Result<Vec<Decision>, StoreError> {
        store_call("reserve", self.0.reserve(tag, ops, r, now)).await
    }

    async fn commit(&self, tag: Tag, id: u64, commits: &[Commit], now: Millis) -> Result<Vec<Settled>, StoreError> {
        store_call("commit", self.0.commit(tag, id, commits, now)).await
    }

    async fn holds(&self, tag: Tag, key: u64, limit: &Limit, now: Millis) -> Result<Vec<Hold>, StoreError> {
        store_call("holds", self.0.holds(tag, key, limit, now)).await
    }

    async fn grants_open(&self, tag: Tag, key: u64, limit: &Limit, now: Millis) -> Result<Vec<Open>, StoreError> {
        store_call("grants_open", self.0.grants_open(tag, key, limit, now)).await
    }

    fn keeps_registry(&self) -> bool {
        self.0.keeps_registry()
    }

    async fn registry(&self, op: RegistryOp) -> Result<RegistryReply, StoreError> {
        self.0.registry(op).await
    }

    async fn preflight(&self) -> Result<(), StoreError> {
        self.0.preflight().await
    }

    async fn ready(&self) -> bool {
        self.0.ready().await
    }

    fn kind(&self) -> &'static str {
        self.0.kind()
    }
}

/// Times a store call into the request being traced (just the call when none is).
pub(super) async fn store_call<T>(
    op: &'static str,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    if RECORDING.try_with(|_| ()).is_err() {
        return call.await;
    }
    let start = unix_nanos();
    let result = call.await;
    let end = unix_nanos();
    let error = result.as_ref().err().map(|e| e.to_string());
    let _ = RECORDING.try_with(|r| r.borrow_mut().calls.push(StoreCall { op, start, end, error }));
    result
}
