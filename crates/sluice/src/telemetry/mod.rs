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

use metrics::{Counter, Gauge, counter, gauge};
use std::fmt;

mod describe;
pub mod names;
mod stats;
mod store;

pub use describe::describe;
use stats::RatelimitCounters;
pub(crate) use stats::entry_name;
pub use stats::{STAT_NAMES, StatCounts};
pub(crate) use store::{StoreMetrics, StoreOp, memory_store};

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

#[cfg(test)]
mod tests {
    use super::*;

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
