//! envoyproxy/ratelimit's service-level stats, counted in process for StatsD
//! (`statsd.rs`): the config's loads, Envoy's calls and how long each took, and the calls
//! a store failure answered. (Each rule's own counts are [`sluice::rules::Rules::stats`].)

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The most response times kept between two flushes: a sample, not every call.
const MAX_TIMES: usize = 1_000;

/// The most unknown domains counted by name (each a name a client chose): the others
/// are not counted.
const MAX_UNKNOWN_DOMAINS: usize = 1_000;

/// The counts, and the response times since the last flush.
#[derive(Default)]
pub struct ServiceStats {
    config_load_success: AtomicU64,
    config_load_error: AtomicU64,
    calls: AtomicU64,
    store_errors: AtomicU64,
    service_errors: AtomicU64,
    global_shadow: AtomicU64,
    times_ms: Mutex<Vec<f64>>,
    unknown_domains: Mutex<std::collections::BTreeMap<String, u64>>,
}

impl ServiceStats {
    /// The stats of a process whose config loaded at start.
    pub fn loaded() -> Self {
        let stats = Self::default();
        stats.config_loaded(true);
        stats
    }

    /// A config loaded (at start, or a reload put in force), or refused.
    pub fn config_loaded(&self, ok: bool) {
        let c = if ok { &self.config_load_success } else { &self.config_load_error };
        c.fetch_add(1, Relaxed);
    }

    /// One `ShouldRateLimit` answered after `took`: decided (`degraded` when a store
    /// failure decided it), or an error.
    pub fn answered(&self, took: std::time::Duration, decided: Result<bool, ()>) {
        self.calls.fetch_add(1, Relaxed);
        match decided {
            Ok(true) => _ = self.store_errors.fetch_add(1, Relaxed),
            Ok(false) => {}
            Err(()) => _ = self.service_errors.fetch_add(1, Relaxed),
        }
        let mut times = self.times_ms.lock().unwrap_or_else(|e| e.into_inner());
        if times.len() < MAX_TIMES {
            times.push(took.as_secs_f64() * 1_000.0);
        }
    }

    /// A call global shadow mode allowed, which its limits would have refused.
    pub fn shadowed(&self) {
        self.global_shadow.fetch_add(1, Relaxed);
    }

    /// A call for a domain no rule names, answered OK (the first
    /// [`MAX_UNKNOWN_DOMAINS`] names counted each).
    pub fn unknown_domain(&self, domain: &str) {
        let mut counts = self.unknown_domains.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = counts.get_mut(domain) {
            *n += 1;
        } else if counts.len() < MAX_UNKNOWN_DOMAINS {
            counts.insert(domain.to_string(), 1);
        }
    }

    /// The counters under their stat names, counted since start.
    pub fn counters(&self) -> Vec<(String, u64)> {
        let fixed = [
            ("ratelimit.service.config_load_success", &self.config_load_success),
            ("ratelimit.service.config_load_error", &self.config_load_error),
            ("ratelimit_server.ShouldRateLimit.total_requests", &self.calls),
            ("ratelimit.service.call.should_rate_limit.redis_error", &self.store_errors),
            ("ratelimit.service.call.should_rate_limit.service_error", &self.service_errors),
            ("ratelimit.service.global_shadow_mode", &self.global_shadow),
        ];
        let mut out: Vec<(String, u64)> = fixed.iter().map(|(name, n)| (name.to_string(), n.load(Relaxed))).collect();
        let unknown = self.unknown_domains.lock().unwrap_or_else(|e| e.into_inner());
        out.extend(unknown.iter().map(|(d, n)| (format!("ratelimit.service.rate_limit.{d}.domain_not_found"), *n)));
        out
    }

    /// The response times (ms) kept since the last call, for the timer
    /// `ratelimit_server.ShouldRateLimit.response_time`.
    pub fn take_times(&self) -> Vec<f64> {
        std::mem::take(&mut *self.times_ms.lock().unwrap_or_else(|e| e.into_inner()))
    }
}
