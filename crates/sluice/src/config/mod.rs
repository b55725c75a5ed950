//! The rule model: what the `limiter` and `domains` sections of a config say.
//!
//! Each item of `domains` is a domain in envoyproxy/ratelimit's format (`domain`,
//! `descriptors` with `key`, `value`, `rate_limit`, nested `descriptors`,
//! `shadow_mode`), so their files load unchanged. Sluice's extension lives beside it:
//! several `policies` per descriptor, of any algorithm and any period. Parsing (and
//! file:line:col in errors) is the server's job, and so are deployment settings
//! (addresses, which store, TLS files); values that can be wrong on their own (a unit, a
//! duration, a name) are checked while they are read, so the parser can point at them.
//! From Rust, [`crate::RulesBuilder`] writes the same model without YAML.

use crate::algo::{Limit, LimitError};
use serde::Deserialize;

mod values;

pub use values::{Duration, Grants, Name, Unit};

/// The rule sections of a config (`limiter` and `domains`), for a program that keeps
/// its rules in files of its own (JSON, YAML, TOML) and reads them with serde.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulesConfig {
    #[serde(default)]
    pub limiter: LimiterConfig,
    #[serde(default)]
    pub domains: Vec<DomainConfig>,
}

/// `limiter`: how the engine derives keys and treats failures.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimiterConfig {
    /// Secret for client tags. Every server sharing a store must use the same one; change
    /// it from the default so clients cannot predict where their state lives.
    pub key_secret: String,
    /// A file whose content is `key_secret` (a mounted secret): `sluice serve` reads it
    /// at start and at each reload. The library itself does not read it.
    pub key_secret_file: Option<std::path::PathBuf>,
    /// Where `now` comes from: `system` (precise to the millisecond, see
    /// [`crate::time::SystemClock`]) or `coarse` (the kernel tick, 1 to 4 ms, a little
    /// cheaper to read; see [`crate::time::CoarseClock`]).
    pub clock: ClockKind,
    /// What a request gets when the store cannot answer in time: `open` (allowed, the
    /// default, as Stripe's limiters do) or `closed` (refused with 503). Descriptors and
    /// policies can override it with their own `failure`.
    pub failure: Failure,
    /// Longest a store call may take before the failure policy decides.
    pub deadline: Duration,
    /// The circuit breaker: after this many consecutive store failures, skip the store
    /// for `breaker_cooldown`, then let one call through to probe it.
    pub breaker_failures: u32,
    pub breaker_cooldown: Duration,
    /// Most refusals remembered in process memory, so a client already refused costs the
    /// store nothing until its retry time. 0 turns the near-cache off. Not used with the
    /// memory store, which is as fast as the cache.
    pub near_cache: usize,
    /// Allowed decisions that leave less than this share of the quota unused count as
    /// near the limit (`sluice_near_limit_total`).
    pub near_limit_ratio: f64,
    /// Every rule of every domain in shadow mode: decisions are counted, logged and
    /// reported as if enforced, and every request is allowed. For trying a config out.
    pub shadow_mode: bool,
    /// Every rule's limits in quota mode (envoyproxy/ratelimit's `QUOTA_MODE`; see
    /// [`DescriptorConfig::quota_mode`]).
    pub quota_mode: bool,
    /// The most one request may carry (descriptors, entries, key and value bytes).
    pub request_bounds: RequestBounds,
    /// The lists of the clients each rule refuses and admits most (`GET /v1/admin/top`).
    pub top_clients: TopClients,
    /// The most stored overrides the fleet keeps (a store's registry): a change that
    /// would store more is refused, saying so. Every instance holds them all in memory
    /// (about 1 KB each) and reads them all when it starts.
    pub max_overrides: u64,
    /// Also count the decisions of envoyproxy/ratelimit-style rules (`rate_limit:`) under
    /// the names envoyproxy/ratelimit's Prometheus mapping gives them
    /// (`ratelimit_service_rate_limit_*{domain, key1, key2}`), for dashboards that query
    /// those. Labels come from the rules, never from requests.
    pub ratelimit_metrics: bool,
    /// Reservations (`POST /v1/reservations`, Kuadrant's `Reserve` and `Commit`): unset,
    /// served when the store keeps them (memory and Redis; memcached answers each one
    /// with the reason); `true`, required, so a store that cannot keep them is refused
    /// when the config loads; `false`, refused, saying so.
    pub reservations: Option<bool>,
    /// Count the hits of a call that envoyproxy/ratelimit-style rules (`rate_limit:`, and
    /// limits that come with a request) refuse, as envoyproxy/ratelimit does (its counters
    /// are incremented, then compared): a usage report Envoy sends when a response ends
    /// (`apply_on_stream_done`) is charged even past the limit. A fixed window admits the
    /// same calls of one hit either way; a refused call of many hits spends them. Unset:
    /// on where the rules are envoyproxy/ratelimit's (`--ratelimit-env`, and rules pushed
    /// over `xds`), off for a config file's `domains`. Sluice's own `policies:` are never
    /// charged when refused.
    pub count_refused_hits: Option<bool>,
    /// Start the windows of envoyproxy/ratelimit-style rules (`rate_limit:`, and limits
    /// that come with a request) on the clock, as envoyproxy/ratelimit counts them (a
    /// minute's window from hh:mm:00), instead of at a client's first request with its
    /// reset stored. Unset: on where the rules are envoyproxy/ratelimit's
    /// (`--ratelimit-env`, and rules pushed over `xds`), off for a config file's
    /// `domains`. Sluice's own `policies:` say `aligned` for themselves.
    pub aligned_windows: Option<bool>,
}

/// `limiter.top_clients`: per rule, a list of the clients it refuses most and one of
/// those it admits most, over the last one to two `interval`s, each of `capacity`
/// counters whatever the number of clients (see [`crate::topk`]). Capacity 0 turns them
/// off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TopClients {
    /// Counters a list: every client with more than 1 / capacity of a rule's decisions
    /// is in it, and a count overstates by at most decisions / capacity.
    pub capacity: usize,
    /// How long a list covers (between one and two of them).
    pub interval: Duration,
}

impl Default for TopClients {
    fn default() -> Self {
        Self { capacity: 256, interval: Duration(60_000) }
    }
}

/// `limiter.request_bounds`: the most a request may carry. Every descriptor costs a store
/// op and every byte of a value goes into a hash, so these bound what one request can
/// make the server and the store do; raise them only for callers that need it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RequestBounds {
    /// Most descriptors in one request.
    pub descriptors: usize,
    /// Most entries in one descriptor.
    pub entries: usize,
    /// Longest entry key, in bytes.
    pub key_bytes: usize,
    /// Longest entry value, in bytes.
    pub value_bytes: usize,
    /// Whether a descriptor may carry its own `limit` (Envoy's `limit` override action,
    /// envoyproxy/ratelimit's `RateLimitOverride`): whoever may call the data plane may
    /// then set any client's limit. False refuses such a descriptor.
    pub limits: bool,
    /// The most requests a unit a descriptor's own `limit` may ask for; a larger one is
    /// lowered to it. None: as sent.
    pub limit_per_unit: Option<u64>,
}

impl RequestBounds {
    /// 64 descriptors of 16 entries, keys of 256 bytes, values of 1 KiB; a descriptor's
    /// own limit taken as sent.
    pub const DEFAULT: Self =
        Self { descriptors: 64, entries: 16, key_bytes: 256, value_bytes: 1024, limits: true, limit_per_unit: None };
}

impl Default for RequestBounds {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// `failure`: what a request gets when the store cannot answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Failure {
    /// Allowed, and marked `x-sluice-degraded: fail-open`.
    #[default]
    Open,
    /// Decided by this instance alone, up to its fair part of the limit (the limit over
    /// the instances it last knew), and marked `x-sluice-degraded: local`
    /// (see [`crate::fallback`]).
    Local,
    /// Refused with 503, and marked `x-sluice-degraded: fail-closed`.
    Closed,
}

impl Failure {
    /// The `x-sluice-degraded` value.
    pub fn header_value(self) -> &'static str {
        match self {
            Failure::Open => "fail-open",
            Failure::Local => "local",
            Failure::Closed => "fail-closed",
        }
    }
}

/// `limiter.clock`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClockKind {
    #[default]
    System,
    Coarse,
}

/// The secret used when none is configured.
pub const DEFAULT_KEY_SECRET: &str = "sluice-default-secret-change-me";

impl Default for LimiterConfig {
    fn default() -> Self {
        Self {
            key_secret: DEFAULT_KEY_SECRET.into(),
            key_secret_file: None,
            clock: ClockKind::System,
            failure: Failure::Open,
            deadline: Duration(100),
            breaker_failures: 5,
            breaker_cooldown: Duration(1_000),
            near_cache: 100_000,
            near_limit_ratio: 0.8,
            shadow_mode: false,
            quota_mode: false,
            request_bounds: Default::default(),
            top_clients: Default::default(),
            max_overrides: 250_000,
            ratelimit_metrics: false,
            reservations: None,
            count_refused_hits: None,
            aligned_windows: None,
        }
    }
}

/// One domain: a namespace of rules, as in envoyproxy/ratelimit.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DomainConfig {
    pub domain: Name,
    #[serde(default)]
    pub descriptors: Vec<DescriptorConfig>,
    /// Every rule of the domain in shadow mode.
    #[serde(default)]
    pub shadow_mode: bool,
    /// Which descriptor entry identifies the client (its tag): the entry with this key,
    /// else all of the descriptor's entries together.
    #[serde(default)]
    pub client_key: Option<String>,
}

/// One rule node: matches a descriptor entry by `key` (and `value`, if given).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DescriptorConfig {
    pub key: String,
    #[serde(default)]
    pub value: Option<String>,
    /// envoyproxy/ratelimit's single limit.
    #[serde(default)]
    pub rate_limit: Option<RateLimitConfig>,
    /// Sluice's extension: several limits on one descriptor, applied all or nothing.
    #[serde(default)]
    pub policies: Vec<PolicyConfig>,
    #[serde(default)]
    pub descriptors: Vec<DescriptorConfig>,
    /// This rule's own limits in shadow mode; as in envoyproxy/ratelimit, the rules
    /// nested below it keep their own setting.
    #[serde(default)]
    pub shadow_mode: bool,
    /// envoyproxy/ratelimit's `quota_mode`, for this rule's own limits: one over its
    /// limit marks its descriptor OVER_LIMIT but refuses the request only when every
    /// quota-mode limit the request met is over (a quota spent, with another left to fall
    /// back on); limits not in quota mode decide as ever. In decisions, status reads and
    /// reservations; leases enforce such limits as any other.
    #[serde(default)]
    pub quota_mode: bool,
    /// Sluice's extension: the failure policy of this rule's limits and those below it.
    #[serde(default)]
    pub failure: Option<Failure>,
    /// Also count this rule's decisions by descriptor value
    /// (`sluice_decisions_detailed_total`), for this rule's own limits (not the rules
    /// nested below it, as in envoyproxy/ratelimit). Every distinct value is a new
    /// series: only for rules whose values are few.
    #[serde(default)]
    pub detailed_metric: bool,
    /// envoyproxy/ratelimit's `value_to_metric`: the rules below count their decisions
    /// with this entry's value from the request in the `descriptor` label of
    /// `sluice_decisions_detailed_total` (a rule's own, or its wildcard, otherwise).
    #[serde(default)]
    pub value_to_metric: bool,
    /// envoyproxy/ratelimit's `share_threshold`, for a wildcard `value`: every value the
    /// wildcard matches shares one counter, instead of one counter per value.
    #[serde(default)]
    pub share_threshold: bool,
    /// Sluice's extension: this rule's fixed-window limits are decided in process from
    /// quota grants taken from the store (`auto`, or `{max: N, refresh: 100ms}`): a
    /// store call for a twentieth of the decisions or fewer, never past the limit.
    #[serde(default)]
    pub grants: Option<Grants>,
    /// envoyproxy/ratelimit's `metadata`: free-form, passed on in Envoy's response
    /// (`dynamic_metadata`, when `server.response_dynamic_metadata` is on) for the
    /// descriptors it allowed.
    #[serde(default)]
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

/// envoyproxy/ratelimit's `rate_limit` block.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    #[serde(default)]
    pub name: Option<Name>,
    #[serde(default)]
    pub unit: Option<Unit>,
    #[serde(default)]
    pub requests_per_unit: Option<u64>,
    #[serde(default)]
    pub unlimited: bool,
    #[serde(default)]
    pub replaces: Vec<Replaces>,
    /// Sluice's extension: one limit shared by every region (top-level `region` and
    /// `global_store`): each region holds shares of it (docs/configuration.md, "One limit
    /// across regions"). Its windows are aligned to the clock.
    #[serde(default)]
    pub global: bool,
}

/// An entry of `rate_limit.replaces`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Replaces {
    pub name: Name,
}

/// One policy of the `policies` extension: a name and exactly one algorithm.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    pub name: Name,
    #[serde(default)]
    pub fixed_window: Option<FixedWindowConfig>,
    #[serde(default)]
    pub token_bucket: Option<TokenBucketConfig>,
    #[serde(default)]
    pub sliding_window: Option<SlidingWindowConfig>,
    #[serde(default)]
    pub concurrency: Option<ConcurrencyConfig>,
    #[serde(default)]
    pub shadow_mode: bool,
    #[serde(default)]
    pub failure: Option<Failure>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixedWindowConfig {
    pub limit: u64,
    pub window: Duration,
    #[serde(default)]
    pub aligned: bool,
    /// One limit shared by every region (see [`RateLimitConfig::global`]); aligned.
    #[serde(default)]
    pub global: bool,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenBucketConfig {
    pub rate: u64,
    pub per: Duration,
    pub burst: u64,
    /// Refused: a bucket is not shared across regions (yet); a `fixed_window` is.
    #[serde(default)]
    pub global: bool,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlidingWindowConfig {
    pub limit: u64,
    pub window: Duration,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConcurrencyConfig {
    pub limit: u64,
    pub lease_ttl: Duration,
}

/// A policy that does not name exactly one well-formed algorithm.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("policy '{0}' needs one algorithm: add fixed_window, token_bucket, sliding_window or concurrency")]
    NoAlgorithm(Name),
    #[error("policy '{0}' names {1} algorithms; give it exactly one")]
    SeveralAlgorithms(Name, usize),
    #[error("policy '{name}': {source}")]
    Invalid {
        name: Name,
        #[source]
        source: LimitError,
    },
}

impl DescriptorConfig {
    /// A rule matching `key` (and `value`, if given), with no limits yet.
    pub fn new(key: String, value: Option<String>) -> Self {
        Self {
            key,
            value,
            rate_limit: None,
            policies: Vec::new(),
            descriptors: Vec::new(),
            shadow_mode: false,
            quota_mode: false,
            failure: None,
            detailed_metric: false,
            value_to_metric: false,
            share_threshold: false,
            grants: None,
            metadata: None,
        }
    }
}

impl PolicyConfig {
    /// A policy named `name`, with no algorithm yet.
    pub fn named(name: Name) -> Self {
        Self {
            name,
            fixed_window: None,
            token_bucket: None,
            sliding_window: None,
            concurrency: None,
            shadow_mode: false,
            failure: None,
        }
    }

    /// Whether the policy's limit is shared by every region (`global: true`).
    pub fn global(&self) -> bool {
        self.fixed_window.is_some_and(|c| c.global) || self.token_bucket.is_some_and(|c| c.global)
    }

    /// The policy's limit: exactly one algorithm must be given.
    pub fn limit(&self) -> Result<Limit, PolicyError> {
        let mut found = Vec::new();
        if let Some(c) = self.fixed_window {
            found.push(Limit::FixedWindow { limit: c.limit, window: c.window.0, aligned: c.aligned || c.global });
        }
        if let Some(c) = self.token_bucket {
            found.push(Limit::TokenBucket { rate: c.rate, per: c.per.0, burst: c.burst });
        }
        if let Some(c) = self.sliding_window {
            found.push(Limit::SlidingWindow { limit: c.limit, window: c.window.0 });
        }
        if let Some(c) = self.concurrency {
            found.push(Limit::Concurrency { limit: c.limit, lease_ttl: c.lease_ttl.0 });
        }
        match found[..] {
            [limit] => limit
                .validate()
                .map(|()| limit)
                .map_err(|source| PolicyError::Invalid { name: self.name.clone(), source }),
            [] => Err(PolicyError::NoAlgorithm(self.name.clone())),
            _ => Err(PolicyError::SeveralAlgorithms(self.name.clone(), found.len())),
        }
    }
}
