//! Typed rule builders: the rule model of a config file, written in Rust, so a library
//! user never formats YAML into a string.
//!
//! ```
//! use sluice::{DomainBuilder, RulesBuilder};
//! use std::time::Duration;
//!
//! let rules = RulesBuilder::new()
//!     .key_secret("shared by every server of the fleet")
//!     .domain(
//!         DomainBuilder::new("api")
//!             // every client (`token` entry): 5,000 an hour, bursts of 100 at 10 a second
//!             .rule([("token", None)], |r| {
//!                 r.fixed_window("core", 5_000, Duration::from_secs(3600))
//!                     .token_bucket("burst", 10, Duration::from_secs(1), 100)
//!             })
//!             // one route for everyone, nested below its method
//!             .rule([("method", Some("POST")), ("path", Some("/charges"))], |r| {
//!                 r.concurrency("inflight", 50, Duration::from_secs(30))
//!             }),
//!     )
//!     .build()?;
//! assert_eq!(rules.domain_names(), ["api"]);
//! # Ok::<(), sluice::rules::RuleError>(())
//! ```
//!
//! Each method writes what the YAML would say; [`RulesBuilder::build`] compiles it with
//! the same checks and errors as a config file.

use crate::config::{
    ConcurrencyConfig, DescriptorConfig, DomainConfig, Duration as ConfigDuration, Failure, FixedWindowConfig,
    LimiterConfig, Name, PolicyConfig, SlidingWindowConfig, TokenBucketConfig,
};
use crate::rules::{RuleError, Rules};
use std::time::Duration;

/// Builds [`Rules`]: engine settings and domains.
#[derive(Debug, Clone, Default)]
pub struct RulesBuilder {
    limiter: LimiterConfig,
    domains: Vec<DomainBuilder>,
}

impl RulesBuilder {
    /// No domains yet, the `limiter` settings of a config file's defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// The secret of client tags (`limiter.key_secret`); every server sharing a store
    /// must use the same one.
    pub fn key_secret(mut self, secret: impl Into<String>) -> Self {
        self.limiter.key_secret = secret.into();
        self
    }

    /// What requests get when the store fails (`limiter.failure`, default open).
    pub fn failure(mut self, failure: Failure) -> Self {
        self.limiter.failure = failure;
        self
    }

    /// Every rule in shadow mode (`limiter.shadow_mode`).
    pub fn shadow_mode(mut self, on: bool) -> Self {
        self.limiter.shadow_mode = on;
        self
    }

    /// Adds a domain.
    pub fn domain(mut self, domain: DomainBuilder) -> Self {
        self.domains.push(domain);
        self
    }

    /// Compiles the rules, with the checks a config file gets.
    pub fn build(self) -> Result<Rules, RuleError> {
        let domains = self.domains.into_iter().map(DomainBuilder::into_config).collect::<Result<Vec<_>, _>>()?;
        Rules::compile(&self.limiter, &domains)
    }
}

/// The entries `(key, value)` that reach a rule, one nesting level each.
type Path = Vec<(String, Option<String>)>;

/// Builds one domain: a tree of rules, each reached by a path of descriptor entries.
#[derive(Debug, Clone)]
pub struct DomainBuilder {
    name: String,
    client_key: Option<String>,
    shadow: bool,
    rules: Vec<(Path, RuleBuilder)>,
}

impl DomainBuilder {
    /// A domain named `name` (1 to 256 of `A-Z a-z 0-9 _ . - /`; checked by `build`).
    pub fn new(name: impl Into<String>) -> Self {
        Self { name: name.into(), client_key: None, shadow: false, rules: Vec::new() }
    }

    /// Which descriptor entry identifies the client (default: all of a descriptor's
    /// entries together).
    pub fn client_key(mut self, key: impl Into<String>) -> Self {
        self.client_key = Some(key.into());
        self
    }

    /// Every rule of the domain in shadow mode.
    pub fn shadow_mode(mut self, on: bool) -> Self {
        self.shadow = on;
        self
    }

    /// The rule reached by `path`, entries `(key, value)` one nesting level each; a value
    /// of None matches any value, one ending in `*` a prefix. `limits` adds its policies.
    pub fn rule<'a>(
        mut self,
        path: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
        limits: impl FnOnce(RuleBuilder) -> RuleBuilder,
    ) -> Self {
        let path = path.into_iter().map(|(k, v)| (k.to_string(), v.map(str::to_string))).collect();
        self.rules.push((path, limits(RuleBuilder::default())));
        self
    }

    pub(crate) fn into_config(self) -> Result<DomainConfig, RuleError> {
        let err = |message: String| RuleError { path: format!("domain {}", self.name), message, anchors: vec![] };
        let mut domain = DomainConfig {
            domain: Name::parse(&self.name).map_err(err)?,
            descriptors: Vec::new(),
            shadow_mode: self.shadow,
            client_key: self.client_key,
        };
        for (path, rule) in self.rules {
            if path.is_empty() {
                return Err(err("a rule needs at least one (key, value) entry in its path".into()));
            }
            rule.write(node_at(&mut domain.descriptors, &path)).map_err(err)?;
        }
        Ok(domain)
    }
}

/// The rule at `path` below `level`, made (with the rules on the way) if missing.
fn node_at<'a>(level: &'a mut Vec<DescriptorConfig>, path: &[(String, Option<String>)]) -> &'a mut DescriptorConfig {
    let (key, value) = &path[0];
    let i = match level.iter().position(|d| d.key == *key && d.value == *value) {
        Some(i) => i,
        None => {
            level.push(DescriptorConfig::new(key.clone(), value.clone()));
            level.len() - 1
        }
    };
    match path.len() {
        1 => &mut level[i],
        _ => node_at(&mut level[i].descriptors, &path[1..]),
    }
}

/// The limits of one rule.
#[derive(Debug, Clone, Default)]
pub struct RuleBuilder {
    policies: Vec<(String, Algorithm)>,
    shadow: bool,
    failure: Option<Failure>,
    detailed: bool,
}

#[derive(Debug, Clone, Copy)]
enum Algorithm {
    Fixed(FixedWindowConfig),
    Bucket(TokenBucketConfig),
    Sliding(SlidingWindowConfig),
    Concurrency(ConcurrencyConfig),
}

fn ms(d: Duration) -> ConfigDuration {
    ConfigDuration(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl RuleBuilder {
    /// GitHub's fixed window: `limit` per `window`, starting at a client's first request.
    pub fn fixed_window(mut self, name: &str, limit: u64, window: Duration) -> Self {
        let c = FixedWindowConfig { limit, window: ms(window), aligned: false, global: false };
        self.policies.push((name.into(), Algorithm::Fixed(c)));
        self
    }

    /// Stripe's token bucket: `rate` tokens per `per`, holding at most `burst`.
    pub fn token_bucket(mut self, name: &str, rate: u64, per: Duration, burst: u64) -> Self {
        let c = TokenBucketConfig { rate, per: ms(per), burst, global: false };
        self.policies.push((name.into(), Algorithm::Bucket(c)));
        self
    }

    /// The two-window weighted counter: about `limit` per sliding `window`.
    pub fn sliding_window(mut self, name: &str, limit: u64, window: Duration) -> Self {
        let c = SlidingWindowConfig { limit, window: ms(window) };
        self.policies.push((name.into(), Algorithm::Sliding(c)));
        self
    }

    /// At most `limit` requests in flight; a lease never released comes back after
    /// `lease_ttl`.
    pub fn concurrency(mut self, name: &str, limit: u64, lease_ttl: Duration) -> Self {
        let c = ConcurrencyConfig { limit, lease_ttl: ms(lease_ttl) };
        self.policies.push((name.into(), Algorithm::Concurrency(c)));
        self
    }

    /// Counted and reported, never enforced (this rule and the ones below it).
    pub fn shadow_mode(mut self) -> Self {
        self.shadow = true;
        self
    }

    /// What this rule's limits do when the store fails.
    pub fn failure(mut self, failure: Failure) -> Self {
        self.failure = Some(failure);
        self
    }

    /// Also count decisions by descriptor value (only for rules whose values are few).
    pub fn detailed_metric(mut self) -> Self {
        self.detailed = true;
        self
    }

    /// Writes the limits into the rule `d`.
    fn write(self, d: &mut DescriptorConfig) -> Result<(), String> {
        d.shadow_mode |= self.shadow;
        d.detailed_metric |= self.detailed;
        d.failure = self.failure.or(d.failure);
        for (name, algorithm) in self.policies {
            let mut p = PolicyConfig::named(Name::parse(&name)?);
            match algorithm {
                Algorithm::Fixed(c) => p.fixed_window = Some(c),
                Algorithm::Bucket(c) => p.token_bucket = Some(c),
                Algorithm::Sliding(c) => p.sliding_window = Some(c),
                Algorithm::Concurrency(c) => p.concurrency = Some(c),
            }
            d.policies.push(p);
        }
        Ok(())
    }
}
