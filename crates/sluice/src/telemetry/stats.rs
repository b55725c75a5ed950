//! envoyproxy/ratelimit's own stats: a rule's hits under its statsd names (`/stats`,
//! StatsD), within a bound on the names requests may add, and under its Prometheus names.

use super::{DETAILED_OVERFLOW, names};
use metrics::{Counter, counter};
use std::collections::HashMap;

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
    pub(super) by_request: bool,
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
    pub(super) fn count(&self, name: Option<&str>, allowed: bool, near: bool, shadow: bool, hits: u64) {
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
    pub(super) fn near_cache(&self, name: Option<&str>, hits: u64) {
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
pub(super) struct RatelimitCounters {
    total_hits: Counter,
    over_limit: Counter,
    near_limit: Counter,
    within_limit: Counter,
    shadow_mode: Counter,
}

impl RatelimitCounters {
    pub(super) fn new(domain: &str, steps: &[&str]) -> Self {
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
    pub(super) fn count(&self, allowed: bool, near: bool, shadow: bool, hits: u64) {
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
}
