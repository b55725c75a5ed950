//! Compiling a config's descriptor trees into [`super::Rules`]: each rule's place in its
//! level (exact value, wildcard, any value), what it inherits from the rules above it
//! (shadow, quota mode, failure, top lists), its metric label and its quota grants; and
//! the wildcard matcher.

use super::*;

/// Compiles domain `d` (at `path`, for errors) under the limiter's settings.
pub(super) fn compile_domain(d: &DomainConfig, limiter: &LimiterConfig, path: &str) -> Result<Domain, RuleError> {
    let mut root = Level::default();
    let anchors = vec![d.domain.0.clone()];
    let inherited = Inherited {
        domain: &d.domain.0,
        top: limiter.top_clients,
        shadow: limiter.shadow_mode || d.shadow_mode,
        quota: limiter.quota_mode,
        failure: limiter.failure,
        ratelimit_metrics: limiter.ratelimit_metrics,
        count_refused: limiter.count_refused_hits.unwrap_or(false),
        aligned: limiter.aligned_windows.unwrap_or(false),
    };
    for (i, c) in d.descriptors.iter().enumerate() {
        add(&mut root, c, inherited, &[], &anchors, &format!("{path}.descriptors[{i}]"))?;
    }
    Ok(Domain {
        name: d.domain.0.clone(),
        client_key: d.client_key.clone(),
        root,
        counters: DomainCounters::new(&d.domain.0),
        override_counters: Arc::new(
            PolicyCounters::new(&d.domain.0, REQUEST_LIMIT, false, inherited.lists()).with_request_stats(&d.domain.0),
        ),
        by_digest: Default::default(),
    })
}

/// What a rule takes from the rules and the domain above it.
#[derive(Clone, Copy)]
struct Inherited<'a> {
    domain: &'a str,
    /// `limiter.top_clients`.
    top: crate::config::TopClients,
    /// The domain's shadow mode (or the global one). A rule's own `shadow_mode` is its
    /// own, as in envoyproxy/ratelimit.
    shadow: bool,
    /// The global quota mode (`limiter.quota_mode`); a rule's own is its own.
    quota: bool,
    failure: Failure,
    /// `limiter.ratelimit_metrics`.
    ratelimit_metrics: bool,
    /// `limiter.count_refused_hits`.
    count_refused: bool,
    /// `limiter.aligned_windows`: `rate_limit:` windows start on the clock.
    aligned: bool,
}

impl Inherited<'_> {
    /// A policy's top lists, when `limiter.top_clients` has any.
    fn lists(&self) -> Option<crate::topk::RuleLists> {
        crate::topk::RuleLists::new(self.top.capacity, self.top.interval.0)
    }
}

/// One rule on the way to a rule below it: what that rule needs to know of it.
#[derive(Clone)]
struct Step {
    /// `key` or `key_value`: a part of the name made up for a limit without one.
    name: String,
    /// With `share_threshold`: the wildcard, whose matches share one counter.
    shared: Option<String>,
    /// `value_to_metric` on a rule not shared: the request's value names the series.
    by_value: bool,
}

impl Step {
    fn of(c: &DescriptorConfig) -> Result<Self, String> {
        let wildcard = c.value.as_deref().filter(|v| v.contains('*'));
        if c.share_threshold && wildcard.is_none() {
            return Err("`share_threshold` needs a wildcard `value` (one with a `*`): it makes every value \
                        the wildcard matches share one counter"
                .into());
        }
        let name = match &c.value {
            Some(v) => format!("{}_{}", c.key, v),
            None => c.key.clone(),
        };
        let shared = wildcard.filter(|_| c.share_threshold).map(str::to_string);
        // a shared wildcard is counted as the wildcard, whatever asks for values
        Ok(Step { name, by_value: c.value_to_metric && shared.is_none(), shared })
    }
}

/// The metric label of the limits of the rule reached by `steps`: every value with
/// `detailed_metric` on that rule, else the values of the rules with `value_to_metric`
/// on the way, else none (the policy's own counters say it all).
fn metric_label(c: &DescriptorConfig, steps: &[Step]) -> Option<MetricLabel> {
    let config = |s: &Step| LabelPart::Config(s.name.clone());
    let label = |part: &dyn Fn(&Step) -> LabelPart| MetricLabel(steps.iter().map(part).collect());
    if c.detailed_metric && steps.iter().all(|s| s.shared.is_none()) {
        return Some(label(&|_| LabelPart::Request));
    }
    if c.detailed_metric {
        // every value but a shared wildcard's, an empty one as its key (as theirs)
        return Some(label(&|s| if s.shared.is_none() { LabelPart::Value } else { config(s) }));
    }
    steps.iter().any(|s| s.by_value).then(|| label(&|s| if s.by_value { LabelPart::Value } else { config(s) }))
}

/// The grants policy `policy` (of `domain`) of rule `c` takes: those of `grants:` on the
/// rule, for the algorithms grants keep exact, with the policy's grant counters. A
/// `global` limit always takes them (`auto` unless the rule says), from its region's pool.
fn grants_for(
    c: &DescriptorConfig,
    domain: &str,
    policy: &str,
    (limit, global): (&Limit, bool),
) -> Result<Option<Arc<GrantRule>>, String> {
    if global && !matches!(limit, Limit::FixedWindow { .. }) {
        return Err(format!(
            "`global: true` shares fixed windows across regions, not a {}: a bucket's refill would have to be \
             shared too (write it as a fixed_window)",
            limit.algorithm()
        ));
    }
    let Some(grants) = c.grants.or(global.then_some(Grants::AUTO)) else { return Ok(None) };
    match limit {
        Limit::FixedWindow { .. } | Limit::TokenBucket { .. } => {
            Ok(Some(Arc::new(GrantRule { grants, counters: GrantCounters::new(domain, policy), global })))
        }
        Limit::SlidingWindow { .. } => Err("`grants` cannot keep a sliding_window exact (its count weighs the \
             previous window, which a grant taken earlier cannot know): use a fixed_window"
            .into()),
        Limit::Concurrency { .. } => Err("`grants` does not apply to concurrency limits: a lease is held \
             and given back by one request, so there is nothing to hand out ahead"
            .into()),
    }
}

/// What a rule's own limits are, beside their limit.
struct Own {
    shadow: bool,
    quota: bool,
    metric: Option<MetricLabel>,
}

/// Compiles rule `c` (at `path`, below the rules `parents`) into `level`.
fn add(
    level: &mut Level,
    c: &DescriptorConfig,
    inherited: Inherited,
    parents: &[Step],
    anchors: &[String],
    path: &str,
) -> Result<(), RuleError> {
    let mut anchors = anchors.to_vec();
    anchors.push(c.key.clone());
    let err = |message: String| RuleError { path: path.to_string(), message, anchors: anchors.clone() };
    if c.key.is_empty() {
        return Err(err("`key` must not be empty".into()));
    }
    let inherited = Inherited { failure: c.failure.unwrap_or(inherited.failure), ..inherited };
    let mut steps = parents.to_vec();
    steps.push(Step::of(c).map_err(&err)?);
    let own = Own {
        shadow: inherited.shadow || c.shadow_mode,
        quota: inherited.quota || c.quota_mode,
        metric: metric_label(c, &steps),
    };
    let mut node = node(c, inherited, &own, &steps, &err)?;
    for (j, p) in c.policies.iter().enumerate() {
        let at = |message: String| {
            let mut anchors = anchors.clone();
            anchors.push(p.name.0.clone());
            RuleError { path: format!("{path}.policies[{j}]"), message, anchors }
        };
        let limit = p.limit().map_err(|e| at(e.to_string()))?;
        if node.policies.iter().any(|q| *q.name == *p.name.0) {
            return Err(err(format!("two limits on this descriptor are named '{}'; names must differ", p.name)));
        }
        node.policies.push(Policy {
            name: p.name.0.as_str().into(),
            limit,
            shadow: own.shadow || p.shadow_mode,
            quota: own.quota,
            failure: p.failure.unwrap_or(inherited.failure),
            counters: Arc::new(PolicyCounters::new(
                inherited.domain,
                &p.name.0,
                own.shadow || p.shadow_mode,
                inherited.lists(),
            )),
            metric: own.metric.clone(),
            anonymous: false,
            grants: grants_for(c, inherited.domain, &p.name.0, (&limit, p.global())).map_err(at)?,
            count_refused: false,
        });
    }
    if node.unlimited && !node.policies.is_empty() {
        return Err(err("an `unlimited` rule cannot also have `policies`".into()));
    }
    for (j, child) in c.descriptors.iter().enumerate() {
        add(&mut node.children, child, inherited, &steps, &anchors, &format!("{path}.descriptors[{j}]"))?;
    }
    insert(level, c, node).map_err(err)
}

/// The node of rule `c` (reached by `steps`) with its envoyproxy/ratelimit `rate_limit`,
/// if any.
fn node(
    c: &DescriptorConfig,
    inherited: Inherited,
    own: &Own,
    steps: &[Step],
    err: &dyn Fn(String) -> RuleError,
) -> Result<Node, RuleError> {
    let shared = steps.iter().any(|s| s.shared.is_some()).then(|| steps.iter().map(|s| s.shared.clone()).collect());
    let metadata = c.metadata.clone().map(Arc::new);
    let mut node = Node { shared, metadata, ..Node::default() };
    let Some(rl) = &c.rate_limit else { return Ok(node) };
    if rl.unlimited && rl.unit.is_some() {
        return Err(err(
            "an `unlimited: true` rate_limit takes no `unit`: it has no window (remove one of them)".into()
        ));
    }
    if let Some(own) = rl.replaces.iter().find(|r| rl.name.as_ref().is_some_and(|n| n.0 == r.name.0)) {
        return Err(err(format!(
            "rate_limit '{}' lists itself in `replaces`: a limit replaces others, never itself",
            own.name.0
        )));
    }
    node.unlimited = rl.unlimited;
    let names: Vec<&str> = steps.iter().map(|s| s.name.as_str()).collect();
    if rl.unlimited {
        let key = std::iter::once(inherited.domain).chain(names.iter().copied()).collect::<Vec<_>>().join(".");
        node.stat = Some(crate::telemetry::StatCounts::new(key, false));
    }
    node.replaces = rl.replaces.iter().map(|r| Arc::from(r.name.0.as_str())).collect();
    if !rl.unlimited {
        let (Some(unit), Some(rpu)) = (rl.unit, rl.requests_per_unit) else {
            return Err(err("rate_limit needs `unit` and `requests_per_unit` (or `unlimited: true`)".into()));
        };
        // 0 requests a unit is allowed here: envoyproxy/ratelimit's way to block a value
        let limit = Limit::FixedWindow { limit: rpu, window: unit.millis(), aligned: rl.global || inherited.aligned };
        limit.validate().map_err(|e| err(format!("rate_limit: {e}")))?;
        let name = rl.name.as_ref().map(|n| n.0.clone()).unwrap_or_else(|| auto_name(&names));
        let mut counters = PolicyCounters::new(inherited.domain, &name, own.shadow, inherited.lists())
            .with_stat_key(inherited.domain, &names);
        if inherited.ratelimit_metrics {
            counters = counters.with_ratelimit_names(inherited.domain, &names);
        }
        let counters = Arc::new(counters);
        let grants = grants_for(c, inherited.domain, &name, (&limit, rl.global)).map_err(err)?;
        node.policies.push(Policy {
            name: name.into(),
            limit,
            shadow: own.shadow,
            quota: own.quota,
            failure: inherited.failure,
            counters,
            metric: own.metric.clone(),
            anonymous: rl.name.is_none(),
            grants,
            count_refused: inherited.count_refused,
        });
    }
    Ok(node)
}
/// Puts the node of rule `c` in its place at `level`: by exact value, by prefix, or for
/// any value. Fails when that place is taken.
fn insert(level: &mut Level, c: &DescriptorConfig, node: Node) -> Result<(), String> {
    let rules = level.by_key.entry(c.key.clone()).or_default();
    match &c.value {
        None if rules.any.is_some() => Err(format!("`key: {}` without a value is defined twice at this level", c.key)),
        None => {
            rules.any = Some(node);
            Ok(())
        }
        Some(v) if v.contains('*') => {
            let wildcard = Wildcard::new(v);
            if rules.wildcards.iter().any(|(w, _)| w.parts == wildcard.parts) {
                return Err(format!("`{}: {v}` is defined twice at this level", c.key));
            }
            rules.wildcards.push((wildcard, node));
            Ok(())
        }
        Some(v) if rules.exact.contains_key(v) => Err(format!("`{}: {v}` is defined twice at this level", c.key)),
        Some(v) => {
            rules.exact.insert(v.clone(), node);
            Ok(())
        }
    }
}

/// A rule value with `*` in it, as envoyproxy/ratelimit reads one: each `*` matches any
/// run of characters (none included), and the literal parts between must appear in that
/// order, the first at the start and the last at the end.
#[derive(Debug)]
pub(super) struct Wildcard {
    /// The literal parts around the `*`s: at least two (a trailing `*` leaves "" last).
    parts: Vec<String>,
}

impl Wildcard {
    fn new(text: &str) -> Self {
        Self { parts: text.split('*').map(str::to_string).collect() }
    }

    pub(super) fn matches(&self, v: &str) -> bool {
        let (first, last) = (&self.parts[0], &self.parts[self.parts.len() - 1]);
        let fixed: usize = self.parts.iter().map(String::len).sum();
        if v.len() < fixed || !v.starts_with(first.as_str()) || !v.ends_with(last.as_str()) {
            return false;
        }
        // between the first part and the last (which cannot overlap: the value is at
        // least as long as every part together), each middle part in turn, leftmost
        let mut rest = &v[first.len()..v.len() - last.len()];
        for part in &self.parts[1..self.parts.len() - 1] {
            match rest.find(part.as_str()) {
                Some(at) => rest = &rest[at + part.len()..],
                None => return false,
            }
        }
        true
    }
}

/// A name for a `rate_limit` without one: the rule's keys and values joined by dots,
/// with anything unsafe for headers replaced by `_`.
fn auto_name(chain: &[&str]) -> String {
    let joined = chain.join(".");
    let mut s: String =
        joined.chars().map(|c| if c.is_ascii_alphanumeric() || "_.-".contains(c) { c } else { '_' }).collect();
    s.truncate(64);
    s
}

#[cfg(test)]
mod tests {
    use super::Wildcard;

    /// A glob matcher written the slow, obvious way.
    fn glob(p: &[u8], v: &[u8]) -> bool {
        match p.split_first() {
            None => v.is_empty(),
            Some((b'*', rest)) => (0..=v.len()).any(|i| glob(rest, &v[i..])),
            Some((c, rest)) => v.first() == Some(c) && glob(rest, &v[1..]),
        }
    }

    /// Every value of up to 6 letters over {a, b, c} against patterns with one, two and
    /// adjacent `*`s: the same answers as the obvious matcher.
    #[test]
    fn wildcards_match_as_globs_do() {
        let mut values = vec![String::new()];
        for _ in 0..6 {
            let longer: Vec<String> = values.iter().flat_map(|v| ["a", "b", "c"].map(|c| format!("{v}{c}"))).collect();
            values.extend(longer);
        }
        values.sort();
        values.dedup();
        for pattern in ["a*", "*a", "*", "**", "a*b", "ab*ba", "a*b*c", "*a*", "a**b", "*ab*ba*", "c*c*c"] {
            let w = Wildcard::new(pattern);
            for v in &values {
                assert_eq!(w.matches(v), glob(pattern.as_bytes(), v.as_bytes()), "{pattern} on {v:?}");
            }
        }
    }
}
