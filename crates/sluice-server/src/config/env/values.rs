//! Their values read as their Go code reads them: booleans as `strconv.ParseBool`
//! takes them, log levels, and the values theirs refuses, each refusing the start, named.

use super::*;

/// Their boolean variables: theirs refuses to start on any of them set to what Go's
/// `strconv.ParseBool` does not take ([`go_bool`]); so does this.
pub(super) const BOOLEANS: [&str; 28] = [
    "GRPC_SERVER_USE_TLS",
    "FORCE_START_WITHOUT_INITIAL_CONFIG",
    "CONFIG_GRPC_XDS_SERVER_USE_TLS",
    "XDS_CLIENT_BACKOFF_JITTER",
    "USE_DOG_STATSD",
    "USE_STATSD",
    "DISABLE_STATS",
    "USE_PROMETHEUS",
    "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS",
    "RUNTIME_IGNOREDOTFILES",
    "RUNTIME_WATCH_ROOT",
    "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
    "LIMIT_RESPONSE_HEADERS_ENABLED",
    "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
    "REDIS_TLS",
    "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
    "REDIS_USE_EXPLICIT_PIPELINE",
    "REDIS_PERSECOND",
    "REDIS_PERSECOND_TLS",
    "REDIS_PERSECOND_USE_EXPLICIT_PIPELINE",
    "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION",
    "MEMCACHE_TLS",
    "MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION",
    "SHADOW_MODE",
    "QUOTA_MODE",
    "RESPONSE_DYNAMIC_METADATA",
    "MERGE_DOMAIN_CONFIG",
    "TRACING_ENABLED",
];

/// A boolean as Go's `strconv.ParseBool` reads it (their variables are read so): `1`,
/// `t`, `T`, `TRUE`, `true`, `True` and their false twins; anything else is none.
pub(super) fn go_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// `LOG_LEVEL` as theirs (logrus) takes it, in any case, as a level here: `panic` and
/// `fatal` log errors, `warning` is `warn`; none for a level theirs refuses.
pub(super) fn log_level(value: &str) -> Option<&'static str> {
    Some(match value.to_ascii_lowercase().as_str() {
        "panic" | "fatal" | "error" => "error",
        "warn" | "warning" => "warn",
        "info" => "info",
        "debug" => "debug",
        "trace" => "trace",
        _ => return None,
    })
}

/// The variables whose values theirs refuses (and these, beyond theirs, for a value that
/// would mean nothing: a ratio past 1, a flush every 0 s), each naming its variable.
pub(super) fn values(get: &dyn Fn(&str) -> Option<String>) -> Vec<String> {
    let mut refused: Vec<String> = (BOOLEANS.iter().filter_map(|&var| Some((var, get(var)?))))
        .filter(|(_, v)| go_bool(v).is_none())
        .map(|(var, v)| {
            format!("{var}={v} is not a boolean: write true or false (theirs takes 1, t, T, TRUE, true, True and 0, f, F, FALSE, false, False, and refuses to start on anything else)")
        })
        .collect();
    for var in ["NEAR_LIMIT_RATIO", "TRACING_SAMPLING_RATE"] {
        let Some(v) = get(var) else { continue };
        if !v.parse::<f64>().is_ok_and(|r| (0.0..=1.0).contains(&r)) {
            refused.push(format!("{var}={v} is not a ratio: write a number from 0 to 1, e.g. 0.8"));
        }
    }
    if let Some(v) = get("LOG_LEVEL").filter(|v| log_level(v).is_none()) {
        refused.push(format!("LOG_LEVEL={v} is not a level: write one of trace, debug, info, warn, error"));
    }
    refused.extend(not_tags(get, "EXTRA_TAGS"));
    if get("STATS_FLUSH_INTERVAL").and_then(|v| sluice::config::Duration::parse(&v).ok()).is_some_and(|d| d.0 == 0) {
        refused.push("STATS_FLUSH_INTERVAL=0s: write how often to send, e.g. 10s".into());
    }
    refused
}

/// The variables set to ask for what Sluice does not do, each with why.
pub(super) fn refusals(get: &dyn Fn(&str) -> Option<String>, on: &dyn Fn(&str) -> bool) -> Vec<String> {
    let not =
        |name: &str, allowed: &[&str]| get(name).is_some_and(|v| !allowed.contains(&v.to_ascii_lowercase().as_str()));
    let checks = [
        (not("CONFIG_TYPE", &["file", "grpc_xds_sotw"]), "CONFIG_TYPE: FILE or GRPC_XDS_SOTW"),
        (not("STATSD_PROTOCOL", &["tcp", "udp"]), "STATSD_PROTOCOL: tcp or udp"),
        (
            on("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION"),
            "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION: the Redis certificate is always verified",
        ),
        (
            on("MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION"),
            "MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION: the memcached certificates are always verified",
        ),
        (not("BACKEND_TYPE", &["redis", "memcache"]), "BACKEND_TYPE: redis or memcache"),
        (not("REDIS_TYPE", &["single", "cluster", "sentinel"]), "REDIS_TYPE: SINGLE, CLUSTER or SENTINEL"),
        (not("REDIS_SOCKET_TYPE", &["tcp", "unix"]), "REDIS_SOCKET_TYPE: tcp or unix"),
        (not("LOG_FORMAT", &["text", "json"]), "LOG_FORMAT: text or json"),
        (not("TRACING_EXPORTER_PROTOCOL", &["http", "grpc"]), "TRACING_EXPORTER_PROTOCOL: http or grpc"),
    ];
    checks.into_iter().filter(|(refuse, _)| *refuse).map(|(_, why)| why.to_string()).collect()
}
