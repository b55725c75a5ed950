//! The stores' metrics: call latencies by operation, errors by kind, the circuit
//! breaker's state, and the memory store's size.

use super::names;
use metrics::{Counter, Gauge, Histogram, counter, gauge, histogram};

/// A store's call latencies, errors and breaker state.
pub(crate) struct StoreMetrics {
    calls: [Histogram; 7],
    /// By kind: unavailable, timeout, protocol, circuit_open.
    errors: [(&'static str, Counter); 4],
    breaker: Gauge,
}

/// The store operations, as labelled.
#[derive(Debug, Clone, Copy)]
pub(crate) enum StoreOp {
    Apply = 0,
    Peek = 1,
    Release = 2,
    Refund = 3,
    Reset = 4,
    Registry = 5,
    /// Taking a quota grant, or giving one back.
    Grant = 6,
}

impl StoreMetrics {
    /// Registers the metrics of a store of `kind`.
    pub(crate) fn new(kind: &'static str) -> Self {
        let call = |op: &'static str| histogram!(names::STORE_CALL_SECONDS, "store" => kind, "op" => op);
        let error = |k: &'static str| (k, counter!(names::STORE_ERRORS, "store" => kind, "kind" => k));
        Self {
            calls: [
                call("apply"),
                call("peek"),
                call("release"),
                call("refund"),
                call("reset"),
                call("registry"),
                call("grant"),
            ],
            errors: [error("unavailable"), error("timeout"), error("protocol"), error("circuit_open")],
            breaker: gauge!(names::BREAKER_STATE, "store" => kind),
        }
    }

    /// Records a call's duration in seconds.
    pub(crate) fn call(&self, op: StoreOp, seconds: f64) {
        self.calls[op as usize].record(seconds);
    }

    /// Counts a failed call by its kind (`StoreError::kind`).
    pub(crate) fn error(&self, kind: &str) {
        if let Some((_, c)) = self.errors.iter().find(|(k, _)| *k == kind) {
            c.increment(1);
        }
    }

    /// Sets the breaker gauge: 0 closed, 1 open, 2 half-open (probing).
    pub(crate) fn breaker(&self, state: u8) {
        self.breaker.set(f64::from(state));
    }
}

/// Publishes the memory store's size and eviction counts.
pub(crate) fn memory_store(keys: usize, collected: u64, full: u64) {
    gauge!(names::MEMORY_KEYS).set(keys as f64);
    counter!(names::MEMORY_EVICTIONS, "kind" => "expired").absolute(collected);
    counter!(names::MEMORY_FULL).absolute(full);
}
