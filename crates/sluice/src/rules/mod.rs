//! Compiled rules: the config's descriptor trees, ready to match requests.
//!
//! Matching follows envoyproxy/ratelimit: a request descriptor's entries are walked one
//! nesting level at a time; at each level an entry matches a rule with the same key and
//! value first, then the first rule (in file order) whose value is a wildcard matching it
//! (each `*` matches any run of characters, none included: `bar*b` matches `barb` and
//! `bar123b`, `foo*bar*baz` matches `foobarbaz`), then a rule with the key alone. The
//! limits that apply are those of the rule reached by the last entry. A descriptor that
//! falls off the tree matches nothing and is allowed.

use crate::algo::Limit;
use crate::config::{DescriptorConfig, DomainConfig, Failure, Grants, LimiterConfig, RulesConfig};
use crate::tag::{Tag, Tagger};
use crate::telemetry::{DomainCounters, GrantCounters, PolicyCounters};
use crate::time::Millis;
use std::collections::HashMap;
use std::sync::Arc;

mod compile;

use compile::{Wildcard, compile_domain};

/// One limit of a rule.
#[derive(Debug, Clone)]
pub(crate) struct Policy {
    /// Reported in `X-RateLimit-Resource` and the IETF headers.
    pub name: Arc<str>,
    pub limit: Limit,
    /// Counted and reported, never enforced.
    pub shadow: bool,
    /// In quota mode (`quota_mode`): its refusal alone refuses no request (see
    /// `DescriptorConfig::quota_mode`).
    pub quota: bool,
    /// What a request gets when the store cannot answer.
    pub failure: Failure,
    /// Its decision counters (`sluice_decisions_total` ...).
    pub counters: Arc<PolicyCounters>,
    /// `detailed_metric` or `value_to_metric`: also count decisions by descriptor, with
    /// this label.
    pub metric: Option<MetricLabel>,
    /// Named by Sluice, not by the config (a `rate_limit` without `name`).
    pub anonymous: bool,
    /// Decided from quota grants (`grants:` on its rule).
    pub grants: Option<Arc<GrantRule>>,
    /// A refused call's hits are counted all the same (`limiter.count_refused_hits`).
    pub count_refused: bool,
}

/// A policy's quota grants (`grants:` on its rule): its settings, and its counters
/// (`sluice_grant*`, by domain and policy).
#[derive(Debug)]
pub(crate) struct GrantRule {
    pub grants: Grants,
    pub counters: GrantCounters,
    /// One limit across regions: its grants come from the region's pool, its window's
    /// key names the window ([`crate::algo::pool`]).
    pub global: bool,
}

/// A limit shared across regions as this instance configures it: its name (domain and
/// policy), limit and window (what the regions compare: `crate::regions`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalRule {
    pub name: String,
    pub limit: u64,
    pub window: Millis,
}

/// How the `descriptor` label of `sluice_decisions_detailed_total` is written for a
/// rule's decisions: one part per entry of the descriptor, joined by `.`.
#[derive(Debug, Clone)]
pub(crate) struct MetricLabel(Arc<[LabelPart]>);

#[derive(Debug, Clone)]
enum LabelPart {
    /// The entry as the request has it: `key_value`.
    Request,
    /// The entry as the request has it, its key alone for an empty value (their
    /// `value_to_metric`).
    Value,
    /// As the config has it: `key`, `key_value` or `key_wildcard`.
    Config(String),
}

impl MetricLabel {
    /// The label for a descriptor's entries. Control characters (CR, LF, NUL ...) become
    /// `_`: a client's bytes must not break a line of `/metrics` open.
    pub(crate) fn render<'e>(&self, entries: impl Iterator<Item = (&'e str, &'e str)>) -> String {
        let printable = |s: &str| s.chars().map(|c| if c.is_control() { '_' } else { c }).collect::<String>();
        let parts: Vec<String> = self
            .0
            .iter()
            .zip(entries)
            .map(|(part, (k, v))| match part {
                LabelPart::Request => format!("{}_{}", printable(k), printable(v)),
                LabelPart::Value => crate::telemetry::entry_name(&printable(k), &printable(v)),
                LabelPart::Config(text) => printable(text),
            })
            .collect();
        parts.join(".")
    }
}

/// A rule node reached by a descriptor.
#[derive(Debug, Default)]
pub(crate) struct Node {
    pub policies: Vec<Policy>,
    /// `rate_limit.unlimited`: matched, and never limited.
    pub unlimited: bool,
    /// Names of other rules' limits this rule's limit replaces when both match.
    pub replaces: Vec<Arc<str>>,
    /// `share_threshold`: for each entry on the way here, the wildcard whose matches
    /// share one counter (it stands for the value in the state's key), if any.
    pub shared: Option<Box<[Option<String>]>>,
    /// `metadata`, passed on in Envoy's response.
    pub metadata: Option<Arc<serde_json::Map<String, serde_json::Value>>>,
    /// An `unlimited` rule's stats under its key: listed, never counted, as
    /// envoyproxy/ratelimit registers them and never passes the rule to its cache.
    stat: Option<crate::telemetry::StatCounts>,
    children: Level,
}

impl Node {
    /// A descriptor's entries as its state is keyed: a value matched by a shared
    /// wildcard is replaced by the wildcard.
    pub(crate) fn keyed<'a>(&'a self, entries: &mut [(&'a str, &'a str)]) {
        let Some(shared) = &self.shared else { return };
        for (entry, pattern) in entries.iter_mut().zip(shared.iter()) {
            if let Some(p) = pattern {
                entry.1 = p;
            }
        }
    }
}

#[derive(Debug, Default)]
struct Level {
    by_key: HashMap<String, KeyRules>,
}

#[derive(Debug, Default)]
struct KeyRules {
    exact: HashMap<String, Node>,
    /// Wildcard values, in file order: the first that matches wins.
    wildcards: Vec<(Wildcard, Node)>,
    any: Option<Node>,
}

impl KeyRules {
    /// The rule a value matches: the same value, else the first wildcard matching it,
    /// else the key alone.
    fn matching(&self, v: &str) -> Option<&Node> {
        self.exact
            .get(v)
            .or_else(|| self.wildcards.iter().find(|(w, _)| w.matches(v)).map(|(_, n)| n))
            .or(self.any.as_ref())
    }
}

/// The rules of one domain.
#[derive(Debug)]
pub(crate) struct Domain {
    pub name: String,
    client_key: Option<String>,
    root: Level,
    /// Failure-policy and lease counters.
    pub counters: DomainCounters,
    /// The decision counters of limits that come with a request (policy `override`).
    pub override_counters: Arc<PolicyCounters>,
    /// Counters by a digest of the policy's name (see [`Domain::counters_of`]).
    by_digest: std::sync::OnceLock<HashMap<u64, Arc<PolicyCounters>>>,
}

impl Domain {
    /// The counters of the policy whose name has [`policy_digest`] `digest` (a map made
    /// at the first call; the limits that come with a request's under `request_limit`).
    pub(crate) fn counters_of(&self, digest: u64) -> Option<&Arc<PolicyCounters>> {
        let by = self.by_digest.get_or_init(|| {
            let own = self.policies().into_iter().map(|p| (policy_digest(&p.name), p.counters.clone()));
            own.chain([(policy_digest(REQUEST_LIMIT), self.override_counters.clone())]).collect()
        });
        by.get(&digest)
    }

    /// The quota grants (`grants:`, `global: true`) of the policy whose name digests to
    /// `digest` ([`policy_digest`]), if it takes them.
    pub(crate) fn grant_rule_of(&self, digest: u64) -> Option<Arc<GrantRule>> {
        self.policies().into_iter().find(|p| policy_digest(&p.name) == digest)?.grants.clone()
    }

    /// Every policy of every rule of the domain.
    fn policies(&self) -> Vec<&Policy> {
        self.nodes().into_iter().flat_map(|n| &n.policies).collect()
    }

    fn nodes(&self) -> Vec<&Node> {
        let (mut levels, mut all) = (vec![&self.root], Vec::new());
        while let Some(level) = levels.pop() {
            for rules in level.by_key.values() {
                for node in rules.exact.values().chain(rules.wildcards.iter().map(|(_, n)| n)).chain(&rules.any) {
                    all.push(node);
                    levels.push(&node.children);
                }
            }
        }
        all
    }

    /// The stats counted in `/stats`: every `rate_limit:` rule's, an `unlimited` one's,
    /// and those of descriptors' own `limit`s.
    fn stat_counts(&self) -> impl Iterator<Item = &crate::telemetry::StatCounts> {
        let nodes = self.nodes();
        let rules = nodes
            .into_iter()
            .flat_map(|n| n.policies.iter().map(|p| p.counters.stat.as_ref()).chain([n.stat.as_ref()]));
        rules.chain([self.override_counters.stat.as_ref()]).flatten()
    }

    /// The rule a descriptor's entries reach, if any.
    pub(crate) fn find<'a, 'e>(&'a self, entries: impl IntoIterator<Item = (&'e str, &'e str)>) -> Option<&'a Node> {
        let mut level = &self.root;
        let mut node = None;
        for (k, v) in entries {
            let n = level.by_key.get(k)?.matching(v)?;
            node = Some(n);
            level = &n.children;
        }
        node
    }

    /// An order of `entries` that walks the rule tree to a rule with limits, for a set
    /// of entries that comes without one (an Envoy RLQS bucket id is a map): at each
    /// level, the entries whose key has rules there are tried in the order given, and
    /// the first order that reaches a rule with limits (or `unlimited`) using every
    /// entry wins. Returns the entries' indices in that order.
    pub(crate) fn arrange(&self, entries: &[(&str, &str)]) -> Option<Vec<usize>> {
        fn walk(level: &Level, entries: &[(&str, &str)], order: &mut Vec<usize>, node: Option<&Node>) -> bool {
            if order.len() == entries.len() {
                return node.is_some_and(|n| !n.policies.is_empty() || n.unlimited);
            }
            for (i, &(k, v)) in entries.iter().enumerate() {
                if order.contains(&i) {
                    continue;
                }
                let Some(next) = level.by_key.get(k).and_then(|rules| rules.matching(v)) else { continue };
                order.push(i);
                if walk(&next.children, entries, order, Some(next)) {
                    return true;
                }
                order.pop();
            }
            false
        }
        let mut order = Vec::with_capacity(entries.len());
        walk(&self.root, entries, &mut order, None).then_some(order)
    }

    /// The client tag of a descriptor: its entry keyed `client_key`, else all its
    /// entries (as keyed: a shared wildcard's pattern, not the value). All entries, not
    /// the first: in Envoy's usual `[route, user]` the first is shared by every user,
    /// and one tag for all of them was one memory shard and one Redis hash holding every
    /// user of the route (docs/architecture.md, invariant 5).
    pub(crate) fn tag<'e>(&self, tagger: &Tagger, entries: &[(&'e str, &'e str)]) -> Tag {
        let client = self.client_key.as_deref().and_then(|ck| entries.iter().find(|(k, _)| *k == ck));
        match client {
            Some(&(k, v)) => tagger.tag(&self.name, k, v),
            None => tagger.tag_of(&self.name, entries),
        }
    }
}

/// A digest of a policy's name, as a reservation carries it (FNV-1a: the same on every
/// instance and every build).
pub(crate) fn policy_digest(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Everything the engine needs from a config: the compiled domains, and the settings
/// that shape every decision.
#[derive(Debug)]
pub struct Rules {
    domains: HashMap<String, Domain>,
    pub(crate) tagger: Tagger,
    /// The failure policy of limits that come with a request (Envoy's `limit`).
    pub(crate) default_failure: Failure,
    /// Decisions that use at least this share of their quota count as near the limit.
    pub(crate) near_limit_ratio: f64,
    /// The most a request may carry.
    pub(crate) request_bounds: crate::config::RequestBounds,
    /// The most stored overrides (`limiter.max_overrides`).
    pub(crate) max_overrides: u64,
    /// `limiter.count_refused_hits`, for limits that come with a request.
    pub(crate) count_refused: bool,
    /// `limiter.aligned_windows`, for limits that come with a request.
    pub(crate) aligned_windows: bool,
    /// `limiter.quota_mode`, for limits that come with a request.
    pub(crate) quota_mode: bool,
    /// `limiter.shadow_mode`: every rule in shadow mode.
    shadow_mode: bool,
    /// Why there are no rules yet, when they are still to come (pushed by a control
    /// plane): every request is answered [`crate::RequestError::NoRules`] until then.
    pub(crate) pending: Option<Arc<str>>,
}

/// A config that cannot be compiled: where (a path like
/// `domains[0].descriptors[1]`) and what.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct RuleError {
    pub path: String,
    pub message: String,
    /// Texts that appear, in this order, in the config file on the way to the error
    /// (domain name, descriptor keys, policy name): a loader finds the error's line by
    /// searching for them one after the other.
    pub anchors: Vec<String>,
}

impl Rules {
    /// Compiles domains under the engine settings of `limiter`.
    pub fn compile(limiter: &LimiterConfig, domains: &[DomainConfig]) -> Result<Self, RuleError> {
        let config = domains;
        let mut domains = HashMap::new();
        for (i, d) in config.iter().enumerate() {
            let path = format!("domains[{i}] (domain {})", d.domain);
            let domain = compile_domain(d, limiter, &path)?;
            if domains.insert(domain.name.clone(), domain).is_some() {
                let message = format!("domain '{}' is defined twice; merge the two", d.domain);
                return Err(RuleError { path, message, anchors: vec![d.domain.0.clone(), d.domain.0.clone()] });
            }
        }
        Ok(Self {
            domains,
            tagger: Tagger::new(&limiter.key_secret),
            default_failure: limiter.failure,
            near_limit_ratio: limiter.near_limit_ratio,
            request_bounds: limiter.request_bounds,
            max_overrides: limiter.max_overrides,
            count_refused: limiter.count_refused_hits.unwrap_or(false),
            aligned_windows: limiter.aligned_windows.unwrap_or(false),
            quota_mode: limiter.quota_mode,
            shadow_mode: limiter.shadow_mode,
            pending: None,
        })
    }

    /// These rules, standing for rules still to come: every request is answered
    /// [`crate::RequestError::NoRules`] saying `why` (a server waiting for its control
    /// plane's first push), not taken for an unknown domain.
    pub fn pending(mut self, why: impl Into<Arc<str>>) -> Self {
        self.pending = Some(why.into());
        self
    }

    /// A domain's rules.
    pub(crate) fn domain(&self, name: &str) -> Option<&Domain> {
        self.domains.get(name)
    }

    /// The top lists of every rule of `domain` by rule name, sorted by name (a name met
    /// at several places of the rule tree has each place's lists), and `override` for
    /// limits sent with a request; None for a domain not configured. Empty lists when
    /// `limiter.top_clients` is off.
    pub fn top_lists(&self, domain: &str) -> Option<Vec<(&str, Vec<&crate::topk::RuleLists>)>> {
        let d = self.domains.get(domain)?;
        let mut by_name: std::collections::BTreeMap<&str, Vec<&crate::topk::RuleLists>> = Default::default();
        by_name.entry(REQUEST_LIMIT).or_default().extend(d.override_counters.top.as_ref());
        for p in d.policies() {
            by_name.entry(&p.name).or_default().extend(p.counters.top.as_ref());
        }
        Some(by_name.into_iter().collect())
    }

    /// The algorithms the rules use (`fixed_window` ...), so a store can refuse rules it
    /// cannot run.
    pub fn algorithms(&self) -> std::collections::BTreeSet<&'static str> {
        let mut out = std::collections::BTreeSet::new();
        self.each_policy(&mut |p| {
            out.insert(p.limit.algorithm());
        });
        out
    }

    /// Whether a rule takes quota grants (`grants:`).
    pub fn use_grants(&self) -> bool {
        let mut found = false;
        self.each_policy(&mut |p| found |= p.grants.is_some());
        found
    }

    /// Whether a limit is decided by `failure: local` when the store fails.
    pub fn use_local_failure(&self) -> bool {
        let mut found = false;
        self.each_policy(&mut |p| found |= p.failure == crate::config::Failure::Local);
        found
    }

    /// Whether policy `policy` of `domain` is shared across regions (`global: true`).
    pub fn is_global(&self, domain: &str, policy: &str) -> bool {
        let Some(d) = self.domains.get(domain) else { return false };
        d.policies().iter().any(|p| &*p.name == policy && p.grants.as_ref().is_some_and(|g| g.global))
    }

    /// Whether a limit is shared across regions (`global: true`).
    pub fn use_global(&self) -> bool {
        !self.global_windows().is_empty()
    }

    /// The limits shared across regions (`global: true`): their names and windows.
    pub fn global_windows(&self) -> Vec<(String, Millis)> {
        let mut found = Vec::new();
        self.each_policy(&mut |p| {
            if let (Some(true), Limit::FixedWindow { window, .. }) = (p.grants.as_ref().map(|g| g.global), p.limit) {
                found.push((p.name.to_string(), window));
            }
        });
        found
    }

    /// The limits shared across regions (`global: true`) as the regions compare them:
    /// each named by its domain and policy, with its limit and window.
    pub fn global_limits(&self) -> Vec<GlobalRule> {
        let mut found = Vec::new();
        for (domain, d) in &self.domains {
            for p in d.policies().iter().filter(|p| p.grants.as_ref().is_some_and(|g| g.global)) {
                if let Limit::FixedWindow { limit, window, .. } = p.limit {
                    found.push(GlobalRule { name: format!("{domain}/{}", p.name), limit, window });
                }
            }
        }
        found.sort_by(|a, b| a.name.cmp(&b.name));
        found.dedup();
        found
    }

    /// Calls `f` with every policy of every rule.
    fn each_policy(&self, f: &mut dyn FnMut(&Policy)) {
        self.domains.values().flat_map(Domain::policies).for_each(f);
    }

    /// Configured domain names, sorted.
    /// The `rate_limit:` rules in force as envoyproxy/ratelimit's debug port prints them
    /// (`/rlconfig`): a line a rule, `DOMAIN.KEY...: unit=MINUTE requests_per_unit=10,
    /// shadow_mode: false, quota_mode: false`, by domain and key.
    pub fn dump(&self) -> String {
        let mut lines: Vec<String> = self
            .domains
            .values()
            .flat_map(|d| d.policies())
            .filter_map(|p| {
                let key = &p.counters.stat.as_ref()?.key;
                let Limit::FixedWindow { limit, window, .. } = p.limit else { return None };
                let unit =
                    crate::config::Unit::from_millis(window).map_or("UNKNOWN".into(), |u| u.name().to_uppercase());
                Some(format!(
                    "{key}: unit={unit} requests_per_unit={limit}, shadow_mode: {}, quota_mode: {}\n",
                    p.shadow, p.quota
                ))
            })
            .collect();
        lines.sort();
        lines.concat()
    }

    /// Every `rate_limit:` rule's hits under envoyproxy/ratelimit's stat names
    /// (`ratelimit.service.rate_limit.DOMAIN.KEY....total_hits`, `over_limit`,
    /// `near_limit`, `within_limit`, `shadow_mode`), counted since these rules were
    /// compiled, sorted by name.
    pub fn stats(&self) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = self
            .domains
            .values()
            .flat_map(|d| d.stat_counts())
            .flat_map(|s| s.all())
            .flat_map(|(key, counts)| {
                crate::telemetry::STAT_NAMES
                    .iter()
                    .zip(counts)
                    .map(move |(name, n)| (format!("ratelimit.service.rate_limit.{key}.{name}"), n))
            })
            .collect();
        out.sort();
        out
    }

    /// Whether every rule is in shadow mode (`limiter.shadow_mode`, their `SHADOW_MODE`).
    pub fn global_shadow(&self) -> bool {
        self.shadow_mode
    }

    pub fn domain_names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.domains.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }
}

impl RulesConfig {
    /// Compiles the rules.
    pub fn compile(&self) -> Result<Rules, RuleError> {
        Rules::compile(&self.limiter, &self.domains)
    }
}

/// The name of a limit that came with the request (Envoy's descriptor `limit`), as
/// headers, metrics and the top lists call it.
pub const REQUEST_LIMIT: &str = "request_limit";
