//! Metrics, through the `metrics` facade: whatever recorder the application installs
//! (`sluice serve` installs a Prometheus one and serves `/metrics`) gets them; without a
//! recorder they cost nothing.
//!
//! Per-policy counters are registered once, when rules are compiled, so a decision only
//! increments atomics. Labels are names from the config (domain, policy, store) and fixed
//! words. A descriptor value (a user id, a token) becomes a label in one case only: a
//! rule that sets `detailed_metric: true` adds `sluice_decisions_detailed_total` with a
//! `descriptor` label, for rules whose values are few (routes, not users).
//!
//! A leaf of the crate: it uses nothing else in it, and anything may use it. Only the
//! metric [`names`] are public; the handles are the crate's.

use metrics::{Counter, Gauge, Histogram, counter, gauge, histogram};
use std::collections::HashMap;
use std::fmt;

/// Every metric name, for the docs and the tests.
pub mod names {
    pub const DECISIONS: &str = "sluice_decisions_total";
    pub const NEAR_LIMIT: &str = "sluice_near_limit_total";
    pub const SHADOW_OVER_LIMIT: &str = "sluice_shadow_over_limit_total";
    pub const NEAR_CACHE_HITS: &str = "sluice_near_cache_hits_total";
    pub const DEGRADED: &str = "sluice_degraded_total";
    pub const LEASES_ACQUIRED: &str = "sluice_leases_acquired_total";
    pub const LEASES_RELEASED: &str = "sluice_leases_released_total";
    pub const STORE_CALL_SECONDS: &str = "sluice_store_call_seconds";
    pub const STORE_ERRORS: &str = "sluice_store_errors_total";
    pub const BREAKER_STATE: &str = "sluice_circuit_breaker_state";
    pub const MEMORY_KEYS: &str = "sluice_memory_store_keys";
    pub const MEMORY_EVICTIONS: &str = "sluice_memory_store_evictions_total";
    pub const MEMORY_FULL: &str = "sluice_memory_store_full_total";
    pub const CONFIG_RELOADS: &str = "sluice_config_reloads_total";
    pub const DECISIONS_DETAILED: &str = "sluice_decisions_detailed_total";
    pub const RATELIMIT_TOTAL_HITS: &str = "ratelimit_service_rate_limit_total_hits";
    pub const RATELIMIT_OVER_LIMIT: &str = "ratelimit_service_rate_limit_over_limit";
    pub const RATELIMIT_NEAR_LIMIT: &str = "ratelimit_service_rate_limit_near_limit";
    pub const RATELIMIT_WITHIN_LIMIT: &str = "ratelimit_service_rate_limit_within_limit";
    pub const RATELIMIT_SHADOW_MODE: &str = "ratelimit_service_rate_limit_shadow_mode";
    pub const SHED: &str = "sluice_shed_total";
    pub const SHED_AMOUNT: &str = "sluice_shed_amount";
    pub const ADAPTIVE_LIMIT: &str = "sluice_adaptive_limit";
    pub const ADAPTIVE_IN_FLIGHT: &str = "sluice_adaptive_in_flight";
    pub const ADAPTIVE_WAITING: &str = "sluice_adaptive_waiting";
    pub const ADAPTIVE_BASE_SECONDS: &str = "sluice_adaptive_base_latency_seconds";
    pub const HTTP_OVER_LIMIT: &str = "sluice_http_connections_over_limit_total";
    pub const GRPC_CONNECTIONS: &str = "sluice_grpc_connections";
    pub const GRPC_OVER_LIMIT: &str = "sluice_grpc_connections_over_limit_total";
    pub const GRPC_CLOSED: &str = "sluice_grpc_connections_closed_total";
    pub const ADMIN_ACTIONS: &str = "sluice_admin_actions_total";
    pub const OVERRIDES: &str = "sluice_overrides";
    pub const OVERRIDES_REFRESHED: &str = "sluice_overrides_refreshed_timestamp_seconds";
    pub const GRANTS_TAKEN: &str = "sluice_grants_taken_total";
    pub const GRANT_UNITS: &str = "sluice_grant_units_total";
    pub const GRANT_UNITS_HELD: &str = "sluice_grant_units_held";
    pub const GRANT_LOCAL: &str = "sluice_grant_decisions_local_total";
    pub const GRANT_STORE_CALLS: &str = "sluice_grant_store_calls_total";
    pub const MIGRATION_PERCENT: &str = "sluice_migration_percent";
    pub const REGION_UNITS: &str = "sluice_region_units_total";
    pub const REGION_GLOBAL_CALLS: &str = "sluice_region_global_calls_total";
    pub const REGION_GLOBAL_SECONDS: &str = "sluice_region_global_call_seconds";
    pub const REGION_HORIZON: &str = "sluice_region_horizon_seconds";
    pub const REGION_HURRIED: &str = "sluice_region_hurried_total";
    pub const REGION_REFUSALS: &str = "sluice_region_refusals_total";
    pub const REGION_DECIDED_GLOBALLY: &str = "sluice_region_decided_globally_total";
    pub const REGION_LOST_UNITS: &str = "sluice_region_lost_units_total";
    pub const REGION_DISAGREEMENTS: &str = "sluice_region_disagreements";
    pub const RESERVATIONS: &str = "sluice_reservations_total";
    pub const RESERVATION_UNITS: &str = "sluice_reservation_units_total";
    pub const RESERVATION_SETTLEMENTS: &str = "sluice_reservation_settlements_total";
    pub const RESERVATIONS_OPEN: &str = "sluice_reservations_open";
    pub const RESERVATION_HELD_UNITS: &str = "sluice_reservation_held_units";
}

/// Gives every metric of [`names`] its help text (Prometheus's `# HELP` line), once the
/// application has installed its recorder. The words are docs/operations.md's, shorter.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    use names::*;
    describe_counter!(DECISIONS, "Policy decisions, by domain, policy and outcome (allowed, over_limit).");
    for (name, what) in [
        (
            RATELIMIT_TOTAL_HITS,
            "Hits of a rate_limit rule (envoyproxy/ratelimit's name, with limiter.ratelimit_metrics).",
        ),
        (RATELIMIT_OVER_LIMIT, "Hits a rate_limit rule refused (envoyproxy/ratelimit's name)."),
        (
            RATELIMIT_NEAR_LIMIT,
            "Hits a rate_limit rule allowed past the near-limit share (envoyproxy/ratelimit's name).",
        ),
        (RATELIMIT_WITHIN_LIMIT, "Hits a rate_limit rule allowed (envoyproxy/ratelimit's name)."),
        (RATELIMIT_SHADOW_MODE, "Hits a shadow-mode rate_limit rule would have refused (envoyproxy/ratelimit's name)."),
    ] {
        describe_counter!(name, what);
    }
    describe_counter!(NEAR_LIMIT, "Allowed decisions that used at least limiter.near_limit_ratio of the quota.");
    describe_counter!(SHADOW_OVER_LIMIT, "Shadow-mode decisions that would have refused (the request was allowed).");
    describe_counter!(NEAR_CACHE_HITS, "Refusals answered from the near-cache, without a store call.");
    describe_counter!(
        DEGRADED,
        "Requests decided by the failure policy (open or closed) because the store did not answer."
    );
    describe_counter!(LEASES_ACQUIRED, "Concurrency leases taken.");
    describe_counter!(LEASES_RELEASED, "Concurrency leases given back.");
    describe_histogram!(STORE_CALL_SECONDS, metrics::Unit::Seconds, "Store call latency, by store and op.");
    describe_counter!(STORE_ERRORS, "Failed store calls, by store and cause.");
    describe_gauge!(BREAKER_STATE, "The store's circuit breaker: 0 closed, 1 open, 2 half-open.");
    describe_gauge!(MEMORY_KEYS, "States held by the memory store.");
    describe_counter!(MEMORY_EVICTIONS, "States the memory store dropped because their time had passed.");
    describe_counter!(MEMORY_FULL, "Calls that found the memory store full with a new client's state to hold.");
    describe_counter!(CONFIG_RELOADS, "Config reloads applied (ok) and refused (failed: the last good config stayed).");
    describe_counter!(DECISIONS_DETAILED, "Decisions by descriptor value, for rules with detailed_metric: true.");
    describe_counter!(HTTP_OVER_LIMIT, "HTTP connections accepted past server.max_connections (one request each).");
    describe_gauge!(GRPC_CONNECTIONS, "gRPC connections open.");
    describe_counter!(GRPC_OVER_LIMIT, "gRPC connections closed at their accept, past server.max_connections.");
    describe_counter!(
        GRPC_CLOSED,
        "gRPC connections closed by a deadline: no first call (first_call) or none open (idle)."
    );
    describe_counter!(ADMIN_ACTIONS, "Admin actions, each also an audit log line.");
    describe_gauge!(OVERRIDES, "Stored overrides this instance holds.");
    describe_gauge!(
        OVERRIDES_REFRESHED,
        metrics::Unit::Seconds,
        "When this instance last read the stored overrides' version (seconds since the epoch)."
    );
    describe_counter!(GRANTS_TAKEN, "Quota grants taken, per granted policy.");
    describe_counter!(GRANT_UNITS, "Grant units granted to this instance, given back, and lapsed unspent.");
    describe_gauge!(GRANT_UNITS_HELD, "Grant units this instance holds unspent.");
    describe_counter!(GRANT_LOCAL, "Decisions answered from a grant, without a store call.");
    describe_counter!(GRANT_STORE_CALLS, "Store calls made for grants (taking and giving back).");
    describe_gauge!(MIGRATION_PERCENT, "A migrating store's share of clients on its `to` store.");
    describe_regions();
    describe_reservations();
    describe_shedders();
}

/// The load shedders' help texts.
fn describe_shedders() {
    use metrics::{describe_counter, describe_gauge};
    use names::*;
    describe_counter!(SHED, "Requests dropped by the load shedders, by shedder and priority class.");
    describe_gauge!(SHED_AMOUNT, "The worker utilization shedder's controller amount (below 0: at rest).");
    describe_gauge!(ADAPTIVE_LIMIT, "The adaptive concurrency limit: how many requests may run at once.");
    describe_gauge!(ADAPTIVE_IN_FLIGHT, "Requests running through the adaptive stage now.");
    describe_gauge!(ADAPTIVE_WAITING, "Requests waiting for a slot of the adaptive stage now.");
    describe_gauge!(ADAPTIVE_BASE_SECONDS, metrics::Unit::Seconds, "The no-load latency the adaptive stage learned.");
}

/// The regional allocator's help texts (one limit across regions).
fn describe_regions() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    use names::*;
    describe_counter!(REGION_UNITS, "Units of global limits this instance took from the global store, and gave back.");
    describe_counter!(
        REGION_HURRIED,
        "Decisions on global limits that found their region's pool short and asked the global store at once."
    );
    describe_counter!(
        REGION_REFUSALS,
        "Refusals on global limits after asking the global store: fleet_spent (the limit is spent), waiting (its \
         answer came too late: refused under the limit)."
    );
    describe_counter!(
        REGION_GLOBAL_CALLS,
        "Calls to the global store (ok, error): the allocator's, and those of decisions that found their pool short."
    );
    describe_histogram!(REGION_GLOBAL_SECONDS, metrics::Unit::Seconds, "Time of each call to the global store.");
    describe_counter!(
        REGION_DECIDED_GLOBALLY,
        "Decisions on global limits charged on the global store itself, while the region's own store failed \
         (failure: local)."
    );
    describe_counter!(
        REGION_LOST_UNITS,
        "Units of global windows this instance held that the global store no longer counted: it lost its data."
    );
    describe_gauge!(
        REGION_DISAGREEMENTS,
        "Global rules whose limit or window the regions configure differently (units are asked for under the \
         smallest limit)."
    );
    describe_gauge!(
        REGION_HORIZON,
        metrics::Unit::Seconds,
        "How far ahead a region holds units of a global window: twice the global calls' latency and a tick."
    );
}

/// The reservation metrics' help texts.
fn describe_reservations() {
    use metrics::{describe_counter, describe_gauge};
    use names::*;
    describe_counter!(RESERVATIONS, "Reservations asked for, by domain, policy and result (admitted, refused).");
    describe_counter!(RESERVATION_UNITS, "Reservation units held at admission, and committed (the actuals).");
    describe_counter!(
        RESERVATION_SETTLEMENTS,
        "Commits, by what they found: committed, expired (the hold was released at its TTL), again, reported."
    );
    describe_gauge!(
        RESERVATIONS_OPEN,
        "Reservations this instance admitted that are neither committed nor past their TTL."
    );
    describe_gauge!(RESERVATION_HELD_UNITS, "Units those reservations hold.");
}

/// One admin action, for the audit log.
#[derive(Debug, Clone, Copy)]
pub struct Audit<'a> {
    /// What was done: `override_set`, `override_removed`, `override_expired`,
    /// `client_reset`, `migration_percent` ...
    pub action: &'a str,
    /// What it was done to: an override id, a client's descriptor, a store. (Logged as
    /// `resource`: `target` is the log line's own, `sluice::audit`.)
    pub resource: &'a str,
    /// The value before, as JSON text (None when there was none: logged as `null`).
    pub old: Option<&'a str>,
    /// The value after, as JSON text (None when there is none: logged as `null`).
    pub new: Option<&'a str>,
    pub reason: &'a str,
    /// Who: an identifier of the credential used (never the credential), or `expiry`.
    pub by: &'a str,
}

/// Writes one audit line (target `sluice::audit`, every field structured: JSON when the
/// log is JSON) and counts it in `sluice_admin_actions_total{action}`.
pub fn audit(a: &Audit<'_>) {
    counter!(names::ADMIN_ACTIONS, "action" => a.action.to_string()).increment(1);
    tracing::info!(
        target: "sluice::audit",
        action = a.action,
        resource = a.resource,
        old = a.old.unwrap_or("null"),
        new = a.new.unwrap_or("null"),
        reason = a.reason,
        by = a.by,
        "admin action"
    );
}

/// The counters of one policy of one domain: three series for an enforced policy
/// (allowed, over_limit, near_limit), two for a shadow one (shadow_over_limit,
/// near_limit), registered when the rules are compiled whatever the traffic. Series are
/// bounded by rules, never by clients (docs/operations.md, "Metrics").
pub(crate) struct PolicyCounters {
    near_limit: Counter,
    /// The domain and policy, for the counters registered on first use.
    names: (String, String),
    /// The policy's reservation counters, registered when it first holds one.
    reservations: std::sync::OnceLock<ReservationCounters>,
    decided: Decided,
    /// The same decisions under envoyproxy/ratelimit's names (`limiter.ratelimit_metrics`).
    ratelimit: Option<RatelimitCounters>,
    /// A `rate_limit:` rule's counts under its statsd key, for the debug listener's
    /// `/stats` and `/rlconfig` (kept in process: a few atomics a rule).
    pub(crate) stat: Option<StatCounts>,
    /// The clients the policy refuses and admits most (`limiter.top_clients`), when on.
    pub top: Option<crate::topk::RuleLists>,
}

/// What a policy's decisions are counted as: refusals of a shadow policy only (it allows
/// everything), or both outcomes of an enforced one.
enum Decided {
    Shadow { over_limit: Counter },
    Enforced { allowed: Counter, over_limit: Counter },
}

impl fmt::Debug for PolicyCounters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PolicyCounters")
    }
}

impl PolicyCounters {
    /// Registers the counters of `policy` in `domain`, in shadow mode or not, with its
    /// top lists when `top` has some.
    pub(crate) fn new(domain: &str, policy: &str, shadow: bool, top: Option<crate::topk::RuleLists>) -> Self {
        let (d, p) = (domain.to_string(), policy.to_string());
        let decisions =
            |outcome| counter!(names::DECISIONS, "domain" => d.clone(), "policy" => p.clone(), "outcome" => outcome);
        let decided = if shadow {
            Decided::Shadow {
                over_limit: counter!(names::SHADOW_OVER_LIMIT, "domain" => d.clone(), "policy" => p.clone()),
            }
        } else {
            Decided::Enforced { allowed: decisions("allowed"), over_limit: decisions("over_limit") }
        };
        let near_limit = counter!(names::NEAR_LIMIT, "domain" => d.clone(), "policy" => p.clone());
        Self { near_limit, names: (d, p), reservations: Default::default(), decided, ratelimit: None, stat: None, top }
    }

    /// Also counted in process under the rule's statsd key, `DOMAIN.KEY1[.KEY2...]`
    /// (each step `key` or `key_value`), as envoyproxy/ratelimit names its stats.
    pub(crate) fn with_stat_key(mut self, domain: &str, steps: &[&str]) -> Self {
        let key = std::iter::once(domain).chain(steps.iter().copied()).collect::<Vec<_>>().join(".");
        self.stat = Some(StatCounts::new(key, false));
        self
    }

    /// Counted in process under each request's own name, `DOMAIN.KEY1[_VALUE1]...`: the
    /// counters of a descriptor's own `limit`, as envoyproxy/ratelimit names their stats.
    pub(crate) fn with_request_stats(mut self, domain: &str) -> Self {
        self.stat = Some(StatCounts::new(domain.to_string(), true));
        self
    }

    /// The name a request's decision counts under in `/stats`, when not the rule's key:
    /// the domain and the request's `entries` as its rule's `label` wrote them, or as a
    /// descriptor's own `limit` names them (`key`, or `key_value` for a value).
    pub(crate) fn stat_name<'e>(
        &self,
        label: Option<&str>,
        entries: impl Iterator<Item = (&'e str, &'e str)>,
    ) -> Option<String> {
        let stat = self.stat.as_ref()?;
        let parts = match (stat.by_request, label) {
            (true, _) => entries.map(|(k, v)| entry_name(k, v)).collect::<Vec<_>>().join("."),
            (false, Some(label)) => label.to_string(),
            (false, None) => return None,
        };
        Some(format!("{}.{parts}", self.names.0))
    }

    /// Also counted under envoyproxy/ratelimit's names, for the rule reached by `steps`
    /// (each `key` or `key_value`) in `domain`.
    pub(crate) fn with_ratelimit_names(mut self, domain: &str, steps: &[&str]) -> Self {
        self.ratelimit = Some(RatelimitCounters::new(domain, steps));
        self
    }

    /// Counts one decision of `hits`. `near` is whether an allowed decision used at
    /// least the near-limit share of its quota.
    /// `stat` names the `/stats` counts it adds to, when not the rule's key.
    pub(crate) fn count(&self, stat: Option<&str>, allowed: bool, near: bool, hits: u64) {
        let shadow = matches!(self.decided, Decided::Shadow { .. });
        if let Some(r) = &self.ratelimit {
            r.count(allowed, near, shadow, hits);
        }
        if let Some(s) = &self.stat {
            s.count(stat, allowed, near, shadow, hits);
        }
        match (&self.decided, allowed) {
            (Decided::Shadow { over_limit }, false) | (Decided::Enforced { over_limit, .. }, false) => {
                over_limit.increment(1)
            }
            (Decided::Enforced { allowed, .. }, true) => allowed.increment(1),
            (Decided::Shadow { .. }, true) => {}
        }
        if allowed && near {
            self.near_limit.increment(1);
        }
    }
}

impl PolicyCounters {
    /// A refusal of `hits` answered from the near-cache (also counted by [`Self::count`]).
    pub(crate) fn near_cache_hit(&self, stat: Option<&str>, hits: u64) {
        if let Some(s) = &self.stat {
            s.near_cache(stat, hits);
        }
    }

    /// The domain and policy it counts.
    pub(crate) fn names(&self) -> (&str, &str) {
        (&self.names.0, &self.names.1)
    }

    /// The policy's reservation counters (registered on the first call: ten series a
    /// policy that ever held a reservation).
    pub(crate) fn reservations(&self) -> &ReservationCounters {
        self.reservations.get_or_init(|| ReservationCounters::new(&self.names.0, &self.names.1))
    }
}

/// One policy's reservation counters (`sluice_reservation*{domain, policy}`).
pub(crate) struct ReservationCounters {
    pub admitted: Counter,
    pub refused: Counter,
    pub held_units: Counter,
    pub committed_units: Counter,
    pub committed: Counter,
    pub expired: Counter,
    pub again: Counter,
    pub reported: Counter,
    pub open: Gauge,
    pub held: Gauge,
}

impl ReservationCounters {
    fn new(domain: &str, policy: &str) -> Self {
        let (d, p) = (domain.to_string(), policy.to_string());
        let result = |r| counter!(names::RESERVATIONS, "domain" => d.clone(), "policy" => p.clone(), "result" => r);
        let units = |k| counter!(names::RESERVATION_UNITS, "domain" => d.clone(), "policy" => p.clone(), "kind" => k);
        let settled =
            |s| counter!(names::RESERVATION_SETTLEMENTS, "domain" => d.clone(), "policy" => p.clone(), "settled" => s);
        Self {
            admitted: result("admitted"),
            refused: result("refused"),
            held_units: units("held"),
            committed_units: units("committed"),
            committed: settled("committed"),
            expired: settled("expired"),
            again: settled("again"),
            reported: settled("reported"),
            open: gauge!(names::RESERVATIONS_OPEN, "domain" => d.clone(), "policy" => p.clone()),
            held: gauge!(names::RESERVATION_HELD_UNITS, "domain" => d, "policy" => p),
        }
    }
}

/// The names of a rule's stats under its key, in the order [`StatCounts::counts`] keeps
/// them (envoyproxy/ratelimit's `ratelimit.service.rate_limit.KEY.NAME`).
pub const STAT_NAMES: [&str; 6] =
    ["total_hits", "over_limit", "near_limit", "within_limit", "shadow_mode", "over_limit_with_local_cache"];

/// One `rate_limit:` rule's hits, counted as envoyproxy/ratelimit counts them, under its
/// statsd key, and under the names its requests give it (a `detailed_metric` or
/// `value_to_metric` rule's values, a descriptor's own `limit`).
#[derive(Debug)]
pub struct StatCounts {
    /// `DOMAIN.KEY1[.KEY2...]`.
    pub key: String,
    /// A descriptor's own `limit` (the domain's `request_limit`): counted under the
    /// request's entries alone (their `descriptorKey`), the key counting only the names
    /// past [`STAT_MAX_NAMES`].
    by_request: bool,
    counts: [std::sync::atomic::AtomicU64; 6],
    /// The counts under the requests' names.
    named: std::sync::Mutex<HashMap<String, [u64; 6]>>,
    /// How many names may be counted apart, shared by every rule.
    budget: &'static NameBudget,
}

/// An entry as envoyproxy/ratelimit names it in a stat: `key_value`, or `key` for an
/// empty value.
pub(crate) fn entry_name(key: &str, value: &str) -> String {
    match value {
        "" => key.to_string(),
        v => format!("{key}_{v}"),
    }
}

/// Most names counted apart in one process (over every rule): each is a line of `/stats`
/// and of every StatsD flush, so a client sending unique values to a `detailed_metric`
/// rule would otherwise grow both without end. Past it, hits count under the rule's key.
pub const STAT_MAX_NAMES: usize = 10_000;

/// The names all [`StatCounts`] hold now, and the most they may.
#[derive(Debug)]
struct NameBudget {
    held: std::sync::atomic::AtomicUsize,
    max: usize,
}

static NAME_BUDGET: NameBudget = NameBudget { held: std::sync::atomic::AtomicUsize::new(0), max: STAT_MAX_NAMES };

impl StatCounts {
    pub(crate) fn new(key: String, by_request: bool) -> Self {
        Self { key, by_request, counts: Default::default(), named: Default::default(), budget: &NAME_BUDGET }
    }

    /// Adds `hits` to the counts `name` (or the key's, for `None`) keeps, as
    /// envoyproxy/ratelimit counts them.
    fn count(&self, name: Option<&str>, allowed: bool, near: bool, shadow: bool, hits: u64) {
        let mut add = [hits, 0, 0, 0, 0, 0];
        match allowed {
            false => {
                add[1] = hits;
                add[4] = if shadow { hits } else { 0 };
            }
            true => {
                add[3] = hits;
                add[2] = if near { hits } else { 0 };
            }
        }
        self.add(name, add);
    }

    /// Hits refused from the near-cache, without a store call (their local cache's).
    fn near_cache(&self, name: Option<&str>, hits: u64) {
        self.add(name, [0, 0, 0, 0, 0, hits]);
    }

    fn add(&self, name: Option<&str>, add: [u64; 6]) {
        use std::sync::atomic::Ordering::Relaxed;
        if let Some(name) = name.filter(|n| *n != self.key) {
            let mut named = self.named.lock().unwrap_or_else(|p| p.into_inner());
            let counts = match named.get_mut(name) {
                Some(counts) => Some(counts),
                None if self.budget.held.fetch_add(1, Relaxed) < self.budget.max => {
                    Some(named.entry(name.to_string()).or_default())
                }
                None => {
                    self.budget.held.fetch_sub(1, Relaxed);
                    None
                }
            };
            if let Some(counts) = counts {
                counts.iter_mut().zip(add).for_each(|(c, a)| *c = c.saturating_add(a));
                return;
            }
        }
        self.counts.iter().zip(add).for_each(|(c, a)| _ = c.fetch_add(a, Relaxed));
    }

    /// The counts so far, in the order of [`STAT_NAMES`].
    pub fn counts(&self) -> [u64; 6] {
        self.counts.each_ref().map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Every name counted and its counts: the key's (for a descriptor's own `limit`,
    /// only once it counted some, as `DOMAIN._other`), then the requests' names.
    pub fn all(&self) -> Vec<(String, [u64; 6])> {
        let own = self.counts();
        let mut all = match self.by_request {
            false => vec![(self.key.clone(), own)],
            true if own.iter().any(|&n| n > 0) => vec![(format!("{}.{DETAILED_OVERFLOW}", self.key), own)],
            true => Vec::new(),
        };
        let named = self.named.lock().unwrap_or_else(|p| p.into_inner());
        all.extend(named.iter().map(|(name, counts)| (name.clone(), *counts)));
        all
    }
}

impl Drop for StatCounts {
    fn drop(&mut self) {
        let held = self.named.get_mut().map_or(0, |n| n.len());
        self.budget.held.fetch_sub(held, std::sync::atomic::Ordering::Relaxed);
    }
}

/// One rule's counters under envoyproxy/ratelimit's Prometheus names: its statsd key
/// `ratelimit.service.rate_limit.DOMAIN.KEY1[.KEY2...].total_hits` as its default
/// mapping turns it into a name and labels (`domain`, `key1`, and `key2` for a rule two
/// or more deep; deeper steps are not labelled, as there). Counted in hits, as there.
struct RatelimitCounters {
    total_hits: Counter,
    over_limit: Counter,
    near_limit: Counter,
    within_limit: Counter,
    shadow_mode: Counter,
}

impl RatelimitCounters {
    fn new(domain: &str, steps: &[&str]) -> Self {
        let mut labels = vec![("domain", domain.to_string())];
        labels.extend(["key1", "key2"].into_iter().zip(steps.iter().map(|s| s.to_string())));
        let labels: Vec<metrics::Label> = labels.into_iter().map(|(k, v)| metrics::Label::new(k, v)).collect();
        let c = |name: &'static str| counter!(name, labels.iter());
        Self {
            total_hits: c(names::RATELIMIT_TOTAL_HITS),
            over_limit: c(names::RATELIMIT_OVER_LIMIT),
            near_limit: c(names::RATELIMIT_NEAR_LIMIT),
            within_limit: c(names::RATELIMIT_WITHIN_LIMIT),
            shadow_mode: c(names::RATELIMIT_SHADOW_MODE),
        }
    }

    /// As theirs: every hit is total; a refused one over_limit (and shadow_mode when the
    /// rule is in shadow mode, which allows it); an allowed one within_limit, and
    /// near_limit too when past the near-limit share.
    fn count(&self, allowed: bool, near: bool, shadow: bool, hits: u64) {
        self.total_hits.increment(hits);
        match allowed {
            false => {
                self.over_limit.increment(hits);
                if shadow {
                    self.shadow_mode.increment(hits);
                }
            }
            true => {
                self.within_limit.increment(hits);
                if near {
                    self.near_limit.increment(hits);
                }
            }
        }
    }
}

/// The counters of one policy's quota grants (`sluice_grant*{domain, policy}`),
/// registered when a rule with `grants:` is compiled: six series a granted policy.
pub(crate) struct GrantCounters {
    pub taken: Counter,
    pub granted: Counter,
    pub returned: Counter,
    pub expired: Counter,
    pub local: Counter,
    pub store_calls: Counter,
}

impl fmt::Debug for GrantCounters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GrantCounters")
    }
}

impl GrantCounters {
    pub(crate) fn new(domain: &str, policy: &str) -> Self {
        let (d, p) = (domain.to_string(), policy.to_string());
        let units = |kind| counter!(names::GRANT_UNITS, "domain" => d.clone(), "policy" => p.clone(), "kind" => kind);
        Self {
            taken: counter!(names::GRANTS_TAKEN, "domain" => d.clone(), "policy" => p.clone()),
            granted: units("granted"),
            returned: units("returned"),
            expired: units("expired"),
            local: counter!(names::GRANT_LOCAL, "domain" => d.clone(), "policy" => p.clone()),
            store_calls: counter!(names::GRANT_STORE_CALLS, "domain" => d, "policy" => p),
        }
    }
}

/// A domain's counters of decisions made by the failure policy, and of leases.
pub(crate) struct DomainCounters {
    fail_open: Counter,
    fail_closed: Counter,
    local: Counter,
    leases_acquired: Counter,
    /// Refusals answered from the near-cache (per domain: each is also counted as its
    /// policy's over_limit decision).
    pub near_cache: Counter,
}

impl fmt::Debug for DomainCounters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DomainCounters")
    }
}

impl DomainCounters {
    /// Registers the counters of `domain`.
    pub(crate) fn new(domain: &str) -> Self {
        let d = domain.to_string();
        Self {
            fail_open: counter!(names::DEGRADED, "domain" => d.clone(), "failure" => "open"),
            fail_closed: counter!(names::DEGRADED, "domain" => d.clone(), "failure" => "closed"),
            local: counter!(names::DEGRADED, "domain" => d.clone(), "failure" => "local"),
            leases_acquired: counter!(names::LEASES_ACQUIRED, "domain" => d.clone()),
            near_cache: counter!(names::NEAR_CACHE_HITS, "domain" => d),
        }
    }

    /// Counts one request: decided by a failure policy (`[open, local, closed]`: the
    /// stricter met), a lease taken.
    pub(crate) fn count(&self, [fail_open, local, fail_closed]: [bool; 3], leased: bool) {
        for (happened, counter) in [
            (fail_open, &self.fail_open),
            (fail_closed, &self.fail_closed),
            (local, &self.local),
            (leased, &self.leases_acquired),
        ] {
            if happened {
                counter.increment(1);
            }
        }
    }
}

/// Counts a decision of a `detailed_metric` or `value_to_metric` rule by its descriptor
/// (`key_value` parts joined by `.`, as envoyproxy/ratelimit names them: see
/// [`crate::rules::MetricLabel`]). Registered per call: only rules that ask pay for it.
pub(crate) fn detailed(domain: &str, policy: &str, mut descriptor: String, allowed: bool) {
    if !admit_detailed(domain, policy, &descriptor) {
        descriptor = DETAILED_OVERFLOW.to_string();
    }
    let outcome = if allowed { "allowed" } else { "over_limit" };
    counter!(names::DECISIONS_DETAILED, "domain" => domain.to_string(), "policy" => policy.to_string(),
        "descriptor" => descriptor, "outcome" => outcome)
    .increment(1);
}

/// Most distinct `descriptor` labels of [`names::DECISIONS_DETAILED`] in one process:
/// every label set is a series the exporter keeps forever, so a client sending unique
/// values to a `detailed_metric` rule would otherwise grow memory without end.
pub(crate) const DETAILED_MAX_SERIES: usize = 10_000;

/// The label the values past [`DETAILED_MAX_SERIES`] are counted under.
pub(crate) const DETAILED_OVERFLOW: &str = "_other";

/// Whether a label set may be counted as itself: it was seen before, or fewer than
/// [`DETAILED_MAX_SERIES`] were (the set holds their hashes).
fn admit_detailed(domain: &str, policy: &str, descriptor: &str) -> bool {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    static SEEN: std::sync::Mutex<Option<std::collections::HashSet<u64>>> = std::sync::Mutex::new(None);
    let key = BuildHasherDefault::<DefaultHasher>::default().hash_one((domain, policy, descriptor));
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    let seen = seen.get_or_insert_with(Default::default);
    seen.contains(&key) || (seen.len() < DETAILED_MAX_SERIES && seen.insert(key))
}

/// A request dropped by a load shedder (`worker` or `fleet`), by priority class.
#[cfg(feature = "tower")]
pub(crate) fn shed(shedder: &'static str, class: usize) {
    counter!(names::SHED, "shedder" => shedder, "class" => class.to_string()).increment(1);
}

/// The adaptive stage's gauges, registered once.
#[cfg(feature = "tower")]
pub(crate) struct AdaptiveGauges {
    pub limit: Gauge,
    pub in_flight: Gauge,
    pub waiting: Gauge,
    pub base: Gauge,
}

#[cfg(feature = "tower")]
impl AdaptiveGauges {
    pub(crate) fn new() -> Self {
        Self {
            limit: gauge!(names::ADAPTIVE_LIMIT),
            in_flight: gauge!(names::ADAPTIVE_IN_FLIGHT),
            waiting: gauge!(names::ADAPTIVE_WAITING),
            base: gauge!(names::ADAPTIVE_BASE_SECONDS),
        }
    }
}

/// The worker utilization controller's amount now (below 0: at rest, nothing shed).
#[cfg(feature = "tower")]
pub(crate) fn shed_amount(amount: f64) {
    gauge!(names::SHED_AMOUNT).set(amount);
}

/// Leases given back (any domain: a lease id does not name one).
pub(crate) fn lease_released() {
    counter!(names::LEASES_RELEASED).increment(1);
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_count_under_the_requests_names_within_a_budget() {
        static BUDGET: NameBudget = NameBudget { held: std::sync::atomic::AtomicUsize::new(0), max: 2 };
        let named = |s: &StatCounts| s.all().into_iter().map(|(n, c)| (n, c[0])).collect::<HashMap<_, _>>();
        let mut rule = StatCounts::new("d.user".into(), false);
        rule.budget = &BUDGET;
        rule.count(Some("d.user_ann"), true, false, false, 3);
        rule.count(Some("d.user"), false, false, false, 1);
        rule.count(Some("d.user_bob"), true, false, false, 1);
        // the budget is spent: a third name counts under the key
        rule.count(Some("d.user_eve"), true, false, false, 5);
        rule.count(Some("d.user_ann"), true, false, false, 1);
        let want = HashMap::from([("d.user".to_string(), 6), ("d.user_ann".into(), 4), ("d.user_bob".into(), 1)]);
        assert_eq!(named(&rule), want);
        drop(rule);
        assert_eq!(BUDGET.held.load(std::sync::atomic::Ordering::Relaxed), 0, "a dropped rule gives its names back");
        // a descriptor's own limit: its key lists only what went past the budget
        let mut own = StatCounts::new("d".into(), true);
        own.budget = &BUDGET;
        own.count(Some("d.user_ann"), false, false, false, 2);
        assert_eq!(named(&own), HashMap::from([("d.user_ann".to_string(), 2)]));
        for name in ["d.a", "d.b"] {
            own.count(Some(name), true, false, false, 1);
        }
        assert_eq!(named(&own)["d._other"], 1);
    }

    /// Unique values sent to a `detailed_metric` rule stop making series at the bound;
    /// the rest are counted under one label.
    #[test]
    fn detailed_series_are_bounded() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            for i in 0..DETAILED_MAX_SERIES + 500 {
                detailed("d", "p", format!("user_u{i}"), true);
            }
        });
        let text = handle.render();
        let series = text.lines().filter(|l| l.starts_with(names::DECISIONS_DETAILED)).count();
        assert!(series <= DETAILED_MAX_SERIES + 1, "{series} series");
        let other = format!("descriptor=\"{DETAILED_OVERFLOW}\"");
        let overflow = text.lines().find(|l| l.contains(&other)).expect("an overflow series");
        let counted: u64 = overflow.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("a count");
        assert!(counted >= 500, "{overflow}");
    }

    /// envoyproxy/ratelimit's names: `domain`, `key1` and `key2` from the rule's first two
    /// steps (a third is not labelled, as its mapping does), counted in hits; a shadow
    /// refusal is over_limit and shadow_mode.
    #[test]
    fn ratelimit_names_label_two_steps_and_count_hits() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            let deep = PolicyCounters::new("eg", "p", false, None)
                .with_ratelimit_names("eg", &["route_r1", "user", "plan_pro"]);
            deep.count(None, true, false, 3);
            deep.count(None, true, true, 2);
            deep.count(None, false, false, 4);
            let shadow = PolicyCounters::new("eg", "s", true, None).with_ratelimit_names("eg", &["path_/x"]);
            shadow.count(None, false, false, 1);
        });
        let text = handle.render();
        let value = |series: &str| {
            let line = text.lines().find(|l| l.starts_with(series)).unwrap_or_else(|| panic!("no {series} in\n{text}"));
            line.rsplit(' ').next().unwrap().parse::<u64>().unwrap()
        };
        let deep = "{domain=\"eg\",key1=\"route_r1\",key2=\"user\"}";
        assert_eq!(value(&format!("{}{deep}", names::RATELIMIT_TOTAL_HITS)), 9);
        assert_eq!(value(&format!("{}{deep}", names::RATELIMIT_WITHIN_LIMIT)), 5);
        assert_eq!(value(&format!("{}{deep}", names::RATELIMIT_NEAR_LIMIT)), 2);
        assert_eq!(value(&format!("{}{deep}", names::RATELIMIT_OVER_LIMIT)), 4);
        let shallow = "{domain=\"eg\",key1=\"path_/x\"}";
        assert_eq!(value(&format!("{}{shallow}", names::RATELIMIT_SHADOW_MODE)), 1);
        assert_eq!(value(&format!("{}{shallow}", names::RATELIMIT_OVER_LIMIT)), 1);
    }
}
