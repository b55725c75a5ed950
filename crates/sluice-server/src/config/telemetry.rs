//! `telemetry`: what the server reports besides `/metrics` (traces over OTLP, whose
//! settings are `otel`'s; envoyproxy/ratelimit's stats over StatsD, sent by `statsd.rs`).

use crate::otel::OtlpConfig;
use serde::Deserialize;
use sluice::config::Duration as ConfigDuration;

/// `telemetry`: what the server reports besides `/metrics`.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Traces, sent to an OpenTelemetry collector; off without it.
    #[serde(default)]
    pub otlp: Option<OtlpConfig>,
    /// The `rate_limit:` rules' hits, sent to StatsD as envoyproxy/ratelimit sends them
    /// (`statsd.rs`); off without it.
    #[serde(default)]
    pub statsd: Option<StatsdConfig>,
}

/// `telemetry.statsd` (sent by `statsd.rs`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatsdConfig {
    /// The StatsD server, `host:port` (a name is resolved at each connect).
    pub address: String,
    /// `tcp` (theirs: gostats' TCP sink) or `udp`.
    #[serde(default)]
    pub protocol: Protocol,
    /// `lyft` (tags folded into the name, as their gostats writes) or `dogstatsd`.
    #[serde(default)]
    pub format: Format,
    /// How often the counters are sent (theirs: `STATS_FLUSH_INTERVAL`, 10 s).
    #[serde(default = "ten_seconds")]
    pub flush_interval: ConfigDuration,
    /// Tags on every stat (their `EXTRA_TAGS`).
    #[serde(default)]
    pub tags: std::collections::BTreeMap<String, String>,
    /// With `format: dogstatsd`: stat names rewritten into a name and tags, the first
    /// whose `pattern` matches (their `USE_DOG_STATSD_MOGRIFIERS`).
    #[serde(default)]
    pub mogrifiers: Vec<Mogrifier>,
}

/// One mogrifier: a stat whose name matches `pattern` (a regular expression) is sent as
/// `name`, with `tags`; `$0`, `$1`... in either are the match and its groups.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mogrifier {
    pub pattern: String,
    pub name: String,
    #[serde(default)]
    pub tags: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    #[default]
    Tcp,
    Udp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    #[default]
    Lyft,
    Dogstatsd,
}

fn ten_seconds() -> ConfigDuration {
    ConfigDuration(10_000)
}
