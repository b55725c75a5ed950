//! What a region's allocator counts: its statistics (read by the live page and `admin
//! inspect`), its series in `/metrics` (`sluice_region_*`, labelled by region), and the
//! calls under way to the global store and to the region's.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// What an instance's allocator counts (also in `/metrics`: `sluice_region_*`).
#[derive(Debug, Default)]
pub struct RegionStats {
    /// Units the global store granted to this region through this instance.
    pub taken: AtomicU64,
    /// Units given back to the global store.
    pub given_back: AtomicU64,
    /// Calls to the global store, and those that failed.
    pub global_calls: AtomicU64,
    pub global_errors: AtomicU64,
    /// The global calls' time, in microseconds, all together.
    pub global_micros: AtomicU64,
    /// Decisions that found the region's pool short and asked the global store at once
    /// (`Regions::hurry`); those then refused because the fleet had spent the limit,
    /// and those refused because the global store's answer came too late while it may
    /// still have had units (refusals under the limit: never expected).
    pub hurried: AtomicU64,
    pub refused_spent: AtomicU64,
    pub refused_waiting: AtomicU64,
    /// Decisions charged on the global store itself while the region's store failed, and
    /// units the global store's count was found to have lost (the `outage` module).
    pub decided_globally: AtomicU64,
    pub lost: AtomicU64,
    /// Global rules whose limit or window the regions were found to differ on, at the
    /// last beat (the `agree` module).
    pub disagreements: AtomicU64,
    /// Decisions of clients not kept, [`MAX_ACTIVE`](super::MAX_ACTIVE) reached.
    pub untracked: AtomicU64,
}

/// The allocator's series in `/metrics`.
pub(super) struct Metrics {
    pub(super) taken: metrics::Counter,
    pub(super) given_back: metrics::Counter,
    pub(super) ok: metrics::Counter,
    pub(super) errors: metrics::Counter,
    pub(super) seconds: metrics::Histogram,
    pub(super) horizon: metrics::Gauge,
    pub(super) hurried: metrics::Counter,
    pub(super) refused_spent: metrics::Counter,
    pub(super) refused_waiting: metrics::Counter,
    pub(super) decided_globally: metrics::Counter,
    pub(super) lost: metrics::Counter,
    pub(super) disagreements: metrics::Gauge,
}

impl Metrics {
    pub(super) fn new(region: &str) -> Self {
        use crate::telemetry::names::{
            REGION_DECIDED_GLOBALLY, REGION_DISAGREEMENTS, REGION_GLOBAL_CALLS, REGION_GLOBAL_SECONDS, REGION_HORIZON,
            REGION_HURRIED, REGION_LOST_UNITS, REGION_REFUSALS, REGION_UNITS,
        };
        Self {
            taken: metrics::counter!(REGION_UNITS, "region" => region.to_string(), "kind" => "taken"),
            given_back: metrics::counter!(REGION_UNITS, "region" => region.to_string(), "kind" => "given_back"),
            ok: metrics::counter!(REGION_GLOBAL_CALLS, "region" => region.to_string(), "result" => "ok"),
            errors: metrics::counter!(REGION_GLOBAL_CALLS, "region" => region.to_string(), "result" => "error"),
            seconds: metrics::histogram!(REGION_GLOBAL_SECONDS, "region" => region.to_string()),
            horizon: metrics::gauge!(REGION_HORIZON, "region" => region.to_string()),
            hurried: metrics::counter!(REGION_HURRIED, "region" => region.to_string()),
            refused_spent: metrics::counter!(REGION_REFUSALS, "region" => region.to_string(), "why" => "fleet_spent"),
            refused_waiting: metrics::counter!(REGION_REFUSALS, "region" => region.to_string(), "why" => "waiting"),
            decided_globally: metrics::counter!(REGION_DECIDED_GLOBALLY, "region" => region.to_string()),
            lost: metrics::counter!(REGION_LOST_UNITS, "region" => region.to_string()),
            disagreements: metrics::gauge!(REGION_DISAGREEMENTS, "region" => region.to_string()),
        }
    }
}

/// One store's calls under way and answers (each call's end, ok or not): a decision that
/// waited its bound while calls were under way and no answer came finds the store
/// stalled (`Regions::bounded`).
#[derive(Debug, Default)]
pub(super) struct Calls {
    in_flight: AtomicU64,
    answered: AtomicU64,
}

impl Calls {
    /// `call`, counted under way while it lives (a call dropped unanswered, as the other
    /// half of a join that failed, is no longer under way), and answered once it ends.
    pub(super) async fn counted<T>(&self, call: impl std::future::Future<Output = T>) -> T {
        let under_way = UnderWay::new(&self.in_flight);
        let result = call.await;
        drop(under_way);
        self.answered.fetch_add(1, Relaxed);
        result
    }

    /// The answers so far.
    pub(super) fn answered(&self) -> u64 {
        self.answered.load(Relaxed)
    }

    /// Whether calls are under way and none was answered since the answers numbered
    /// `answered`.
    pub(super) fn stalled_since(&self, answered: u64) -> bool {
        self.in_flight.load(Relaxed) > 0 && self.answered() == answered
    }
}

/// One call under way, counted while it lives.
struct UnderWay<'a>(&'a AtomicU64);

impl<'a> UnderWay<'a> {
    fn new(count: &'a AtomicU64) -> Self {
        count.fetch_add(1, Relaxed);
        Self(count)
    }
}

impl Drop for UnderWay<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}
