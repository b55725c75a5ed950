//! `sluice serve --ratelimit-env`: envoyproxy/ratelimit's environment variables read as
//! a Sluice config, so a deployment swaps their image for Sluice's and changes nothing
//! else. The variables become a config's text, held in memory (Envoy Gateway runs the
//! image on a read-only root), which then loads, reloads its `domains_from` and fails
//! exactly as a written one does; `sluice config from-env` prints it. With
//! `CONFIG_TYPE=GRPC_XDS_SOTW` the rules come from an xDS server instead (`xds/`).
//!
//! Every variable of theirs falls in one of three groups (the table in docs/envoy.md):
//! honoured (mapped to a config key), without meaning here (accepted, and named in one
//! log line at start: a connection pool size, for a client that multiplexes), or asking
//! for what Sluice does not do (a certificate's hostname unchecked) or theirs refuses
//! (a boolean `strconv.ParseBool` does not take): each refuses the start, named.

use crate::config::secrets::PLACEHOLDER;
use serde_json::{Value, json};
use sluice::store::percent_encode;

mod store;
mod values;

use store::*;
use values::*;

/// What the environment says: the config, and what to log about it at start.
pub struct FromEnv {
    pub config: Value,
    /// The variables without effect here, and which source of rules won.
    pub notes: Vec<String>,
}

/// Variables accepted and not needed: what they tune does not exist here, or is always
/// so here (docs/envoy.md has each reason).
const WITHOUT_EFFECT: &[&str] = &[
    "REDIS_POOL_SIZE",
    "REDIS_PIPELINE_WINDOW",
    "REDIS_PIPELINE_LIMIT",
    "REDIS_CLUSTER_PIPELINE_PARALLELISM",
    "REDIS_POOL_ON_EMPTY_BEHAVIOR",
    "REDIS_PERSECOND_POOL_SIZE",
    "REDIS_PERSECOND_PIPELINE_WINDOW",
    "REDIS_PERSECOND_PIPELINE_LIMIT",
    "REDIS_PERSECOND_CLUSTER_PIPELINE_PARALLELISM",
    "REDIS_PERSECOND_POOL_ON_EMPTY_BEHAVIOR",
    "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION",
    "REDIS_STARTUP_INITIAL_INTERVAL",
    "REDIS_STARTUP_MAX_INTERVAL",
    "REDIS_STARTUP_MAX_ELAPSED_TIME",
    "MEMCACHE_MAX_IDLE_CONNS",
    "EXPIRATION_JITTER_MAX_SECONDS",
    "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
    "RUNTIME_WATCH_ROOT",
    "RUNTIME_IGNOREDOTFILES",
    "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
    "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS",
    "GRPC_SERVER_TLS_CA_CERT",
    "XDS_CLIENT_BACKOFF_RANDOM_FACTOR",
    "XDS_CLIENT_BACKOFF_JITTER",
];

/// Writes every credential of a config made from the environment as the placeholder
/// (which `config check` refuses), for printing: the key secret, the stores' passwords
/// and the passwords in their URLs. A printed config is meant to become a file, and a
/// config file a ConfigMap anyone who reads the namespace may read.
fn without_credentials(config: &mut Value) {
    match config {
        Value::Object(map) => {
            for (key, value) in map.iter_mut() {
                match (key.as_str(), value) {
                    ("key_secret", v) => *v = json!(format!("{PLACEHOLDER}-the-key-secret")),
                    ("password" | "sentinel_password", v @ Value::String(_)) => *v = json!(PLACEHOLDER),
                    (_, v) => without_credentials(v),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(without_credentials),
        Value::String(text) if text.contains("://") => {
            *text = sluice::store::redis::with_password(text, PLACEHOLDER);
        }
        _ => {}
    }
}

/// Reads the variables (through `env`) into a config, or says every one it refuses.
pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<FromEnv, String> {
    let get = |name: &str| env(name).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    // a value that is no boolean is refused by `checked` (`values`), naming its variable
    let on = |name: &str| get(name).and_then(|v| go_bool(&v)).unwrap_or(false);
    let (store, refused) = checked(&get, &on);
    if !refused.is_empty() {
        return Err(format!(
            "--ratelimit-env: {} (docs/envoy.md has the table of their variables)",
            refused.join("; ")
        ));
    }
    // an IPv6 address (Istio's sample sets HOST=::) is written in brackets before its port;
    // `::` listens on IPv6 and IPv4 alike where the system allows it (Linux's default)
    let host = |h: &str, p: &str, port: &str| {
        address(&get(h).unwrap_or_else(|| "0.0.0.0".into()), &get(p).unwrap_or_else(|| port.into()))
    };
    // each entry of the near-cache holds a key and a decision: about 64 bytes
    let near_cache = get("LOCAL_CACHE_SIZE_IN_BYTES").and_then(|b| b.parse::<usize>().ok()).unwrap_or(0) / 64;
    // Sluice's own secret (no variable of theirs names one), and their prefix keeps two
    // deployments sharing a Redis apart, as it does there
    let secret = get("SLUICE_KEY_SECRET").unwrap_or_else(|| sluice::config::DEFAULT_KEY_SECRET.into());
    let secret = format!("{secret}{}", get("CACHE_KEY_PREFIX").unwrap_or_default());
    let headers = on("LIMIT_RESPONSE_HEADERS_ENABLED");
    let mut config = json!({
        "server": {"http": host("HOST", "PORT", "8080"), "grpc": host("GRPC_HOST", "GRPC_PORT", "8081")},
        "store": store,
        "limiter": {"near_cache": near_cache, "shadow_mode": on("SHADOW_MODE"), "quota_mode": on("QUOTA_MODE"),
            "key_secret": secret,
            "count_refused_hits": true, "aligned_windows": true,
            "near_limit_ratio": get("NEAR_LIMIT_RATIO").and_then(|r| r.parse::<f64>().ok()).unwrap_or(0.8)},
        "headers": {"github": false, "ietf": false, "retry_after": false, "envoy_ratelimit": headers, "envoy_ratelimit_names": {
            "limit": get("LIMIT_LIMIT_HEADER"), "remaining": get("LIMIT_REMAINING_HEADER"),
            "reset": get("LIMIT_RESET_HEADER")}},
        "envoy": {"merge_domains": on("MERGE_DOMAIN_CONFIG"), "response_dynamic_metadata": on("RESPONSE_DYNAMIC_METADATA")},
        "log": {"level": log_level(&get("LOG_LEVEL").unwrap_or_else(|| "warn".into())).unwrap_or("warn"),
            "format": get("LOG_FORMAT").unwrap_or_else(|| "text".into()).to_ascii_lowercase()},
    });
    let mut notes = Vec::new();
    rules_source(&get, &on, &mut config, &mut notes);
    prometheus(&get, &on, &mut config, &mut notes);
    if let Some(tls) = listener_tls(&get, &on) {
        config["server"]["tls"] = tls;
    }
    listeners(&get, &mut config["server"]);
    if on("TRACING_ENABLED") {
        config["telemetry"] = tracing(&get);
    }
    if let Some(statsd) = statsd(&get, &on) {
        config["telemetry"]["statsd"] = statsd;
    }
    let without_effect: Vec<&'static str> = WITHOUT_EFFECT.iter().copied().filter(|v| get(v).is_some()).collect();
    if !without_effect.is_empty() {
        notes.insert(0, format!("these have no effect here (docs/envoy.md says why): {}", without_effect.join(", ")));
    }
    Ok(FromEnv { config, notes })
}

/// The store their variables describe, and every variable that cannot be honoured as
/// it is set, each with why: one error names them all.
fn checked(get: &dyn Fn(&str) -> Option<String>, on: &dyn Fn(&str) -> bool) -> (Value, Vec<String>) {
    let mut refused = refusals(get, on);
    let store = store(get, on).unwrap_or_else(|e| {
        refused.push(e);
        Value::Null
    });
    refused.extend(ports(get, on));
    refused.extend(values(get));
    refused.extend(mogrifier_refusals(get));
    let durations = [
        ("REDIS_TIMEOUT", ""),
        ("REDIS_PERSECOND_TIMEOUT", ""),
        ("STATS_FLUSH_INTERVAL", ""),
        ("MEMCACHE_SRV_REFRESH", ""),
    ];
    refused.extend(AGES.iter().chain(&durations).filter_map(|(var, _)| {
        let value = get(var)?;
        let why = sluice::config::Duration::parse(&value).err()?;
        Some(format!("{var}={value} is not a duration ({why}): write e.g. 24h, 90s or 500ms"))
    }));
    (store, refused)
}

/// The listeners' settings beside HTTP and gRPC's addresses: connection ages, gRPC on a
/// Unix socket (`GRPC_UDS`), the debug port (theirs listens on 6070 whatever is set;
/// here only when `DEBUG_HOST` or `DEBUG_PORT` asks).
fn listeners(get: &dyn Fn(&str) -> Option<String>, server: &mut Value) {
    AGES.iter().filter_map(|(var, key)| Some((key, get(var)?))).for_each(|(key, d)| server[key] = json!(d));
    if let Some(path) = get("GRPC_UDS") {
        server["grpc_uds"] = json!(path);
    }
    if get("DEBUG_HOST").is_some() || get("DEBUG_PORT").is_some() {
        let host = get("DEBUG_HOST").unwrap_or_else(|| "0.0.0.0".into());
        server["debug"] = json!(address(&host, &get("DEBUG_PORT").unwrap_or_else(|| "6070".into())));
    }
}

/// Their connection ages, and where each goes.
const AGES: [(&str, &str); 2] = [
    ("GRPC_MAX_CONNECTION_AGE", "grpc_max_connection_age"),
    ("GRPC_MAX_CONNECTION_AGE_GRACE", "grpc_max_connection_age_grace"),
];

/// The port variables that are not port numbers, and a `PROMETHEUS_ADDR` whose port is
/// one the HTTP or gRPC listener takes (it failed at bind: "Address already in use").
fn ports(get: &dyn Fn(&str) -> Option<String>, on: &dyn Fn(&str) -> bool) -> Vec<String> {
    let mut refused = Vec::new();
    let mut port = |name: &str, default: &str| {
        if ["DEBUG_PORT", "STATSD_PORT"].contains(&name) && get(name).is_none() {
            return None;
        }
        let value = get(name).unwrap_or_else(|| default.into());
        let parsed = value.parse::<u16>().ok();
        if parsed.is_none() {
            refused.push(format!("{name}={value} is not a port number: write 0 to 65535 (0: the system's choice)"));
        }
        parsed
    };
    let (http, grpc) = (port("PORT", "8080"), port("GRPC_PORT", "8081"));
    port("DEBUG_PORT", "6070");
    port("STATSD_PORT", "8125");
    if http.is_some_and(|h| h != 0) && http == grpc {
        refused.push(format!("PORT and GRPC_PORT are both {}: give each listener its own port", http.unwrap_or(0)));
    }
    if on("USE_PROMETHEUS") {
        let addr = get("PROMETHEUS_ADDR").unwrap_or_else(|| ":9090".into());
        match addr.rsplit_once(':').map(|(_, p)| p.parse::<u16>()) {
            Some(Ok(0)) => {}
            Some(Ok(p)) => {
                for (name, taken) in [("PORT", http), ("GRPC_PORT", grpc)] {
                    if taken == Some(p) {
                        refused.push(format!(
                            "PROMETHEUS_ADDR={addr} takes port {p}, which {name} gives its listener: give /metrics a \
                             port of its own (it is also served on the HTTP port, at /metrics)"
                        ));
                    }
                }
            }
            _ => refused.push(format!("PROMETHEUS_ADDR={addr} is not [HOST]:PORT, e.g. :9090")),
        }
    }
    refused
}

/// `host:port`, an IPv6 host in brackets; a bare `:port` (Go's way to say every
/// address) listens on every IPv4 address.
fn address(host: &str, port: &str) -> String {
    match host {
        "" => format!("0.0.0.0:{port}"),
        h if h.contains(':') && !h.starts_with('[') => format!("[{h}]:{port}"),
        h => format!("{h}:{port}"),
    }
}

/// Where the rules come from: the files under `RUNTIME_ROOT` (`CONFIG_TYPE=FILE`, the
/// default), or an xDS server (`GRPC_XDS_SOTW`); never both, and the log says which.
fn rules_source(
    get: &dyn Fn(&str) -> Option<String>,
    on: &dyn Fn(&str) -> bool,
    config: &mut Value,
    notes: &mut Vec<String>,
) {
    let runtime = std::path::Path::new(&get("RUNTIME_ROOT").unwrap_or_else(|| "/srv/runtime_data/current".into()))
        .join(get("RUNTIME_SUBDIRECTORY").unwrap_or_default())
        .join(get("RUNTIME_APPDIRECTORY").unwrap_or_else(|| "config".into()));
    if !get("CONFIG_TYPE").is_some_and(|t| t.eq_ignore_ascii_case("grpc_xds_sotw")) {
        config["domains_from"] = json!(runtime);
        if on("FORCE_START_WITHOUT_INITIAL_CONFIG") {
            notes.push(
                "FORCE_START_WITHOUT_INITIAL_CONFIG has no effect with CONFIG_TYPE=FILE: the files are read at start"
                    .into(),
            );
        }
        return;
    }
    let server = get("CONFIG_GRPC_XDS_SERVER_URL").unwrap_or_else(|| "localhost:18000".into());
    let node = get("CONFIG_GRPC_XDS_NODE_ID").unwrap_or_else(|| "default".into());
    let pairs = |name: &str, sep: char| -> serde_json::Map<String, Value> {
        let text = get(name).unwrap_or_default();
        let pair = |p: &str| p.split_once(sep).map(|(k, v)| (k.trim().to_string(), json!(v.trim())));
        text.split(',').filter_map(pair).collect()
    };
    let retry =
        get("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL").or_else(|| get("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL"));
    let mut xds = json!({"server": server, "node_id": node, "node_metadata": pairs("CONFIG_GRPC_XDS_NODE_METADATA", '='),
        "headers": pairs("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", ':'),
        "start_without_config": on("FORCE_START_WITHOUT_INITIAL_CONFIG")});
    for (key, value) in [("retry", retry), ("max_retry", get("XDS_CLIENT_BACKOFF_MAX_INTERVAL"))] {
        if let Some(v) = value {
            xds[key] = json!(v);
        }
    }
    if let Some(bytes) =
        get("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES").and_then(|b| b.parse::<usize>().ok()).filter(|&b| b > 0)
    {
        xds["max_message_bytes"] = json!(bytes);
    }
    if on("CONFIG_GRPC_XDS_SERVER_USE_TLS") {
        xds["tls"] = json!({"ca_file": get("CONFIG_GRPC_XDS_SERVER_TLS_CACERT"), "cert_file": get("CONFIG_GRPC_XDS_CLIENT_TLS_CERT"),
            "key_file": get("CONFIG_GRPC_XDS_CLIENT_TLS_KEY"), "server_name": get("CONFIG_GRPC_XDS_SERVER_TLS_SAN")});
    }
    config["xds"] = xds;
    notes.push(format!(
        "CONFIG_TYPE=GRPC_XDS_SOTW: the rules are the ones the xDS server at {server} pushes to node {node}; the files under \
         RUNTIME_ROOT ({}) are not read (xDS and files never mix)",
        runtime.display()
    ));
}

/// `USE_PROMETHEUS`: `/metrics` also on `PROMETHEUS_ADDR`, with envoyproxy/ratelimit's
/// metric names beside Sluice's own.
fn prometheus(
    get: &dyn Fn(&str) -> Option<String>,
    on: &dyn Fn(&str) -> bool,
    config: &mut Value,
    notes: &mut Vec<String>,
) {
    if !on("USE_PROMETHEUS") {
        let set: Vec<&str> =
            ["PROMETHEUS_ADDR", "PROMETHEUS_MAPPER_YAML"].into_iter().filter(|v| get(v).is_some()).collect();
        if !set.is_empty() {
            notes.push(format!("{} without USE_PROMETHEUS=true: no effect, as there", set.join(", ")));
        }
        return;
    }
    let addr = get("PROMETHEUS_ADDR").unwrap_or_else(|| ":9090".into());
    let (host, port) = addr.rsplit_once(':').unwrap_or(("", addr.as_str()));
    config["server"]["metrics"] = json!(address(host.trim_start_matches('[').trim_end_matches(']'), port));
    if let Some(path) = get("PROMETHEUS_PATH") {
        config["server"]["metrics_path"] = json!(path);
    }
    config["limiter"]["ratelimit_metrics"] = json!(true);
    if let Some(file) = get("PROMETHEUS_MAPPER_YAML") {
        notes.push(format!(
            "PROMETHEUS_MAPPER_YAML={file} is not read: the names served are those of envoyproxy/ratelimit's default \
             mapping (ratelimit_service_rate_limit_total_hits, _over_limit, _near_limit, _within_limit, _shadow_mode, \
             labelled domain, key1, key2), beside Sluice's own"
        ));
    }
}

/// `telemetry.statsd`, from `USE_STATSD` (on unless `false`, as theirs: a Deployment
/// that never set it sends to `localhost:8125`), `USE_DOG_STATSD`, `STATSD_HOST`,
/// `STATSD_PORT`, `STATSD_PROTOCOL`, `STATS_FLUSH_INTERVAL` and `EXTRA_TAGS`
/// (`k:v,k2:v2`); none with `DISABLE_STATS`.
fn statsd(get: &dyn Fn(&str) -> Option<String>, on: &dyn Fn(&str) -> bool) -> Option<Value> {
    let statsd = get("USE_STATSD").is_none_or(|_| on("USE_STATSD"));
    let dog = on("USE_DOG_STATSD");
    if on("DISABLE_STATS") || !(statsd || dog) {
        return None;
    }
    let host = get("STATSD_HOST").unwrap_or_else(|| "localhost".into());
    let port = get("STATSD_PORT").unwrap_or_else(|| "8125".into());
    let default = if dog { "udp" } else { "tcp" };
    let mogrifiers: Vec<Value> = mogrifier_names(get)
        .iter()
        .map(|m| {
            let v = |part: &str| get(&format!("DOG_STATSD_MOGRIFIER_{m}_{part}"));
            json!({"pattern": v("PATTERN"), "name": v("NAME"), "tags": tag_pairs(&v("TAGS").unwrap_or_default())})
        })
        .collect();
    let mut out = json!({"address": address(&host, &port), "format": if dog { "dogstatsd" } else { "lyft" },
        "protocol": get("STATSD_PROTOCOL").unwrap_or_else(|| default.into()).to_ascii_lowercase(),
        "tags": tag_pairs(&get("EXTRA_TAGS").unwrap_or_default()), "mogrifiers": mogrifiers});
    if let Some(every) = get("STATS_FLUSH_INTERVAL") {
        out["flush_interval"] = json!(every);
    }
    Some(out)
}

/// `k:v,k2:v2` (their `EXTRA_TAGS`, a mogrifier's `_TAGS`) as a map.
fn tag_pairs(text: &str) -> serde_json::Map<String, Value> {
    text.split(',').filter_map(|p| p.split_once(':').map(|(k, v)| (k.trim().to_string(), json!(v.trim())))).collect()
}

/// Their `USE_DOG_STATSD_MOGRIFIERS`: the mogrifiers' names, each read from
/// `DOG_STATSD_MOGRIFIER_{NAME}_PATTERN`, `_NAME` and `_TAGS`.
fn mogrifier_names(get: &dyn Fn(&str) -> Option<String>) -> Vec<String> {
    get("USE_DOG_STATSD_MOGRIFIERS")
        .unwrap_or_default()
        .split(',')
        .map(|n| n.trim().to_string())
        .filter(|n| !n.is_empty())
        .collect()
}

/// The mogrifiers missing a part, or whose pattern does not compile, each named.
fn mogrifier_refusals(get: &dyn Fn(&str) -> Option<String>) -> Vec<String> {
    let mut refused = Vec::new();
    for m in mogrifier_names(get) {
        let var = |part: &str| format!("DOG_STATSD_MOGRIFIER_{m}_{part}");
        for part in ["PATTERN", "NAME"] {
            if get(&var(part)).is_none() {
                refused.push(format!("{}: the mogrifier {m} needs it", var(part)));
            }
        }
        if let Some(Err(e)) = get(&var("PATTERN")).map(|p| regex_lite::Regex::new(&p)) {
            refused.push(format!("{}: not a regular expression ({e})", var("PATTERN")));
        }
        refused.extend(not_tags(get, &var("TAGS")));
    }
    refused
}

/// Why `var`, if set, is not a list of tags as theirs reads one (`k:v,k2:v2`: every item
/// one key and one value).
fn not_tags(get: &dyn Fn(&str) -> Option<String>, var: &str) -> Option<String> {
    let v = get(var)?;
    let pair = |item: &str| matches!(item.split_once(':'), Some((k, v)) if !k.trim().is_empty() && !v.contains(':'));
    (!v.split(',').all(pair)).then(|| {
        format!("{var}={v} is not a list of tags: write key:value pairs, comma separated, e.g. env:prod,team:edge")
    })
}

/// `telemetry`, from `TRACING_*` and `OTEL_EXPORTER_OTLP_ENDPOINT`: their default
/// protocol is OTLP/HTTP (port 4318), as Envoy Gateway sets it.
fn tracing(get: &dyn Fn(&str) -> Option<String>) -> Value {
    let grpc = get("TRACING_EXPORTER_PROTOCOL").is_some_and(|p| p.eq_ignore_ascii_case("grpc"));
    let (protocol, port) = if grpc { ("grpc", 4317) } else { ("http", 4318) };
    json!({"otlp": {
        "endpoint": get("OTEL_EXPORTER_OTLP_ENDPOINT").unwrap_or_else(|| format!("http://127.0.0.1:{port}")),
        "protocol": protocol,
        "service_name": get("TRACING_SERVICE_NAME").unwrap_or_else(|| "RateLimit".into()),
        "service_namespace": get("TRACING_SERVICE_NAMESPACE"),
        "service_instance_id": get("TRACING_SERVICE_INSTANCE_ID"),
        "sampling_ratio": get("TRACING_SAMPLING_RATE").and_then(|r| r.parse::<f64>().ok()).unwrap_or(1.0)}})
}

/// `sluice config from-env`: prints the config the environment describes, then, as
/// comments, each variable it read with its value, and what is worth a word (variables
/// without effect here, which source of rules won).
pub fn print() -> Result<(), String> {
    let read = std::cell::RefCell::new(std::collections::BTreeMap::new());
    let get = |name: &str| {
        let value = std::env::var(name).ok();
        if let Some(v) = &value {
            read.borrow_mut().insert(name.to_string(), v.clone());
        }
        value
    };
    let mut from = from_env(&get)?;
    without_credentials(&mut from.config);
    print!("{}", serde_norway::to_string(&from.config).map_err(|e| e.to_string())?);
    // what was read, as comments: the output stays a config file
    println!(
        "# credentials are written {PLACEHOLDER}, which `config check` and `serve` refuse: keep each in a Secret \
         (limiter.key_secret_file for SLUICE_KEY_SECRET's value followed by CACHE_KEY_PREFIX's; docs/operations.md, \
         \"Secrets\")"
    );
    println!("# made of these variables of envoyproxy/ratelimit's (credentials not shown):");
    for (name, value) in read.borrow().iter() {
        let secret = ["AUTH", "PASSWORD", "SECRET", "TOKEN", "KEY"].iter().any(|w| name.contains(w));
        println!("#   {name}={}", if secret { "(set)" } else { value.as_str() });
    }
    for note in &from.notes {
        println!("# {note}");
    }
    Ok(())
}

/// The config the environment describes, for `serve` to load (and watch its
/// `domains_from`), held in memory: nothing is written, so a read-only root file system
/// (Envoy Gateway's security context) is fine. Returns it with the lines to log at start.
pub fn source() -> Result<(crate::config::load::Source, Vec<String>), String> {
    let from = from_env(&|name| std::env::var(name).ok())?;
    let text = serde_norway::to_string(&from.config).map_err(|e| e.to_string())?;
    let name = "<envoyproxy/ratelimit environment> (`sluice config from-env` prints it)".to_string();
    Ok((crate::config::load::Source::Text { name, text }, from.notes))
}

/// Logs what the environment asked that is worth a line (once, at start): the variables
/// without effect here, and which source of rules won.
pub fn note(notes: &[String]) {
    for note in notes {
        tracing::info!("--ratelimit-env: {note}");
    }
}

#[cfg(test)]
mod tests;
