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

/// Their boolean variables: theirs refuses to start on any of them set to what Go's
/// `strconv.ParseBool` does not take ([`go_bool`]); so does this.
const BOOLEANS: [&str; 28] = [
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
fn go_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// `LOG_LEVEL` as theirs (logrus) takes it, in any case, as a level here: `panic` and
/// `fatal` log errors, `warning` is `warn`; none for a level theirs refuses.
fn log_level(value: &str) -> Option<&'static str> {
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
fn values(get: &dyn Fn(&str) -> Option<String>) -> Vec<String> {
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
fn refusals(get: &dyn Fn(&str) -> Option<String>, on: &dyn Fn(&str) -> bool) -> Vec<String> {
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

/// `store`, from `BACKEND_TYPE` and the `REDIS_*` or `MEMCACHE_*` variables.
fn store(get: &dyn Fn(&str) -> Option<String>, on: &dyn Fn(&str) -> bool) -> Result<Value, String> {
    if get("BACKEND_TYPE").is_some_and(|b| b.eq_ignore_ascii_case("memcache")) {
        return memcached(get, on);
    }
    let main = redis(get, on, "REDIS", "ratelimit")?;
    if !on("REDIS_PERSECOND") {
        return Ok(main);
    }
    // their per-second Redis: the windows of one second on a store of their own
    let second = redis(get, on, "REDIS_PERSECOND", "ratelimitpersecond")?;
    Ok(json!({"kind": "per_second", "main": main, "per_second": second}))
}

/// A Redis store from the variables `{prefix}_URL`, `_TYPE`, `_SOCKET_TYPE`, `_AUTH`,
/// `_TLS`, `_SENTINEL_AUTH` and `_TIMEOUT` (`REDIS` or `REDIS_PERSECOND`), with the TLS
/// files of `REDIS_TLS_*`; `socket` names their default Unix socket.
fn redis(
    get: &dyn Fn(&str) -> Option<String>,
    on: &dyn Fn(&str) -> bool,
    prefix: &str,
    socket: &str,
) -> Result<Value, String> {
    let var = |name: &str| format!("{prefix}_{name}");
    let v = |name: &str| get(&var(name));
    let lower = |name: &str, default: &str| v(name).unwrap_or_else(|| default.into()).to_ascii_lowercase();
    let given = v("URL").unwrap_or_else(|| format!("/var/run/nutcracker/{socket}.sock"));
    // theirs is host:port, but a URL is what users write too: its scheme is taken
    let (url, by_scheme) = without_scheme(&given, &var("URL"))?;
    let (user, password) = credentials(v("AUTH"));
    let tls = on(&var("TLS")) || by_scheme == Some(true);
    let files = json!({"ca_file": get("REDIS_TLS_CACERT"), "cert_file": get("REDIS_TLS_CLIENT_CERT"),
        "key_file": get("REDIS_TLS_CLIENT_KEY")});
    let tls_files = if tls { files } else { Value::Null };
    let with_auth = |address: &str| {
        let scheme = if tls { "rediss" } else { "redis" };
        let auth = match (&user, &password) {
            (_, None) => String::new(),
            (u, Some(p)) => format!("{}:{}@", percent_encode(u.as_deref().unwrap_or("")), percent_encode(p)),
        };
        format!("{scheme}://{auth}{address}")
    };
    let (url_var, socket_var) = (var("URL"), var("SOCKET_TYPE"));
    let mut store = match lower("TYPE", "single").as_str() {
        "cluster" => {
            let nodes: Vec<String> = url.split(',').map(|n| with_auth(n.trim())).collect();
            json!({"kind": "redis_cluster", "nodes": nodes, "tls": tls_files})
        }
        "sentinel" => {
            // theirs: the primary's name, then the Sentinels
            let mut parts = url.split(',').map(str::trim);
            let master = parts.next().unwrap_or_default();
            let (sentinel_username, sentinel_password) = credentials(v("SENTINEL_AUTH"));
            json!({"kind": "redis_sentinel", "master_name": master, "sentinels": parts.collect::<Vec<_>>(),
                "username": user, "password": password, "sentinel_username": sentinel_username,
                "sentinel_password": sentinel_password, "tls": tls_files})
        }
        _ if by_scheme.is_some() && lower("SOCKET_TYPE", "tcp") == "unix" => {
            return Err(format!("{url_var}={given} is a TCP URL, but {socket_var} is unix: set it to tcp"));
        }
        _ if by_scheme.is_none() && lower("SOCKET_TYPE", "unix") == "unix" => {
            unix_socket(&url, password.as_deref(), &url_var, &socket_var, v("SOCKET_TYPE"))?
        }
        _ => {
            let built = with_auth(&url);
            sluice::store::redis::check_url(&built).map_err(|_| {
                format!("{url_var}={given} is not host:port (or redis://host:port, rediss:// for TLS), e.g. redis:6379")
            })?;
            json!({"kind": "redis", "url": built, "tls": tls_files})
        }
    };
    // their _TIMEOUT bounds connecting and each reply, as `timeout` does here
    if let Some(t) = v("TIMEOUT").filter(|t| sluice::config::Duration::parse(t).is_ok()) {
        store["timeout"] = json!(t);
    }
    Ok(store)
}

/// A Redis store on the Unix socket `url` (their default socket type): refused, naming
/// `url_var` and `socket_var`, when `url` is no path.
fn unix_socket(
    url: &str,
    password: Option<&str>,
    url_var: &str,
    socket_var: &str,
    socket_type: Option<String>,
) -> Result<Value, String> {
    if !url.starts_with('/') {
        return Err(format!(
            "{url_var}={url} is not a socket path, and {socket_var} is {}: the default socket type is unix, as \
             envoyproxy/ratelimit's is; for a host:port set {socket_var}=tcp",
            socket_type.unwrap_or_else(|| "unset".into())
        ));
    }
    let auth = password.map(|p| format!("?pass={}", percent_encode(p))).unwrap_or_default();
    Ok(json!({"kind": "redis", "url": format!("redis+unix://{url}{auth}")}))
}

/// REDIS_URL without a `redis://` or `rediss://` scheme (and whether that scheme asks for
/// TLS), as each node of a list; another scheme is refused.
fn without_scheme(given: &str, var: &str) -> Result<(String, Option<bool>), String> {
    let mut tls = None;
    let mut nodes = Vec::new();
    for node in given.split(',') {
        let node = node.trim();
        match node.split_once("://") {
            None => nodes.push(node.to_string()),
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("redis") || scheme.eq_ignore_ascii_case("rediss") => {
                tls = Some(scheme.eq_ignore_ascii_case("rediss"));
                nodes.push(rest.trim_end_matches('/').to_string());
            }
            Some((scheme, _)) => {
                return Err(format!(
                    "{var}={given}: {scheme}:// is not a Redis scheme; write host:port (or redis://host:port)"
                ));
            }
        }
    }
    Ok((nodes.join(","), tls))
}

/// A memcached store, from `MEMCACHE_HOST_PORT` and `MEMCACHE_TLS` with its files.
fn memcached(get: &dyn Fn(&str) -> Option<String>, on: &dyn Fn(&str) -> bool) -> Result<Value, String> {
    let tls = on("MEMCACHE_TLS").then(|| {
        json!({"ca_file": get("MEMCACHE_TLS_CACERT"), "cert_file": get("MEMCACHE_TLS_CLIENT_CERT"),
            "key_file": get("MEMCACHE_TLS_CLIENT_KEY")})
    });
    // their MEMCACHE_SRV, when set, names the servers instead of MEMCACHE_HOST_PORT
    if let Some(srv) = get("MEMCACHE_SRV") {
        let refresh = get("MEMCACHE_SRV_REFRESH").unwrap_or_else(|| "0s".into());
        return Ok(json!({"kind": "memcached", "srv": srv, "srv_refresh": refresh, "tls": tls}));
    }
    let servers =
        get("MEMCACHE_HOST_PORT").ok_or("BACKEND_TYPE=memcache needs MEMCACHE_HOST_PORT (or MEMCACHE_SRV)")?;
    let servers: Vec<&str> = servers.split(',').map(str::trim).collect();
    Ok(json!({"kind": "memcached", "servers": servers, "tls": tls}))
}

/// Their `password` or `username:password`.
fn credentials(auth: Option<String>) -> (Option<String>, Option<String>) {
    match auth {
        Some(auth) => match auth.split_once(':') {
            Some((u, p)) => (Some(u.to_string()), Some(p.to_string())),
            None => (None, Some(auth)),
        },
        None => (None, None),
    }
}

/// `server.tls`, from `GRPC_SERVER_USE_TLS` and its files.
fn listener_tls(get: &dyn Fn(&str) -> Option<String>, on: &dyn Fn(&str) -> bool) -> Option<Value> {
    on("GRPC_SERVER_USE_TLS").then(|| {
        // theirs is gRPC's alone: the HTTP port (probes, /json) stays plain
        json!({"cert_file": get("GRPC_SERVER_TLS_CERT"), "key_file": get("GRPC_SERVER_TLS_KEY"),
            "client_ca_file": get("GRPC_CLIENT_TLS_CACERT"), "client_san": get("GRPC_CLIENT_TLS_SAN"), "http": false})
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn read(vars: &[(&str, &str)]) -> Result<FromEnv, String> {
        let vars: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        from_env(&|name| vars.get(name).cloned())
    }

    #[test]
    fn their_variables_become_a_config() {
        let c = read(&[
            ("USE_STATSD", "false"),
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis.internal:6379"),
            ("REDIS_AUTH", "app:p@ss"),
            ("RUNTIME_ROOT", "/data"),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("LOCAL_CACHE_SIZE_IN_BYTES", "6400"),
            ("REDIS_POOL_SIZE", "20"),
        ])
        .unwrap();
        let v = &c.config;
        assert_eq!(v["store"]["url"], "redis://app:p%40ss@redis.internal:6379");
        assert_eq!(v["domains_from"], "/data/ratelimit/config");
        assert_eq!(v["server"]["grpc"], "0.0.0.0:8081");
        assert_eq!(v["limiter"]["near_cache"], 100);
        assert_eq!(c.notes, ["these have no effect here (docs/envoy.md says why): REDIS_POOL_SIZE"]);
        let cluster = read(&[("REDIS_TYPE", "cluster"), ("REDIS_URL", "a:1,b:2"), ("REDIS_TLS", "true")]).unwrap();
        assert_eq!(cluster.config["store"]["nodes"], json!(["rediss://a:1", "rediss://b:2"]));
    }

    #[test]
    fn what_cannot_be_honoured_is_refused_with_every_reason() {
        let e = read(&[
            ("STATSD_PROTOCOL", "quic"),
            ("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "true"),
            ("CONFIG_TYPE", "GRPC_XDS_DELTA"),
        ])
        .err()
        .unwrap();
        for says in ["STATSD_PROTOCOL", "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "CONFIG_TYPE", "docs/envoy.md"] {
            assert!(e.contains(says), "{e}");
        }
        assert!(read(&[("BACKEND_TYPE", "memcache")]).err().unwrap().contains("MEMCACHE_HOST_PORT"));
        let tls = read(&[
            ("USE_STATSD", "false"),
            ("BACKEND_TYPE", "memcache"),
            ("MEMCACHE_HOST_PORT", "m1:11211,m2:11211"),
            ("MEMCACHE_TLS", "true"),
            ("MEMCACHE_TLS_CACERT", "/certs/ca.crt"),
        ])
        .unwrap();
        assert_eq!(tls.config["store"]["tls"]["ca_file"], "/certs/ca.crt", "MEMCACHE_TLS");
        let split = read(&[
            ("USE_STATSD", "false"),
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "main:6379"),
            ("REDIS_PERSECOND", "true"),
            ("REDIS_PERSECOND_URL", "second:6379"),
            ("REDIS_PERSECOND_SOCKET_TYPE", "tcp"),
            ("REDIS_PERSECOND_TIMEOUT", "2s"),
        ])
        .unwrap();
        let store = &split.config["store"];
        assert_eq!((&store["kind"], &store["main"]["url"]), (&json!("per_second"), &json!("redis://main:6379")));
        assert_eq!(
            (&store["per_second"]["url"], &store["per_second"]["timeout"]),
            (&json!("redis://second:6379"), &json!("2s"))
        );
        let e = read(&[
            ("USE_STATSD", "false"),
            ("REDIS_URL", "/m"),
            ("REDIS_PERSECOND", "true"),
            ("REDIS_PERSECOND_URL", "s:1"),
        ]);
        assert!(
            e.err().unwrap().contains("REDIS_PERSECOND_URL=s:1 is not a socket path"),
            "the variable at fault named"
        );
        let srv = read(&[
            ("USE_STATSD", "false"),
            ("BACKEND_TYPE", "memcache"),
            ("MEMCACHE_SRV", "_memcache._tcp.cache.svc"),
            ("MEMCACHE_SRV_REFRESH", "30s"),
        ])
        .unwrap();
        assert_eq!(
            (&srv.config["store"]["srv"], &srv.config["store"]["srv_refresh"]),
            (&json!("_memcache._tcp.cache.svc"), &json!("30s"))
        );
    }

    /// Istio's sample sets `HOST=::` and `GRPC_HOST=::`: an IPv6 address, written in
    /// brackets before its port (`:::8080` is no address).
    #[test]
    fn an_ipv6_host_is_bracketed() {
        let c = read(&[
            ("HOST", "::"),
            ("GRPC_HOST", "::1"),
            ("GRPC_PORT", "9081"),
            ("USE_STATSD", "false"),
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
        ])
        .unwrap();
        assert_eq!(
            (&c.config["server"]["http"], &c.config["server"]["grpc"]),
            (&json!("[::]:8080"), &json!("[::1]:9081"))
        );
        let v4 =
            read(&[("HOST", "10.0.0.1"), ("USE_STATSD", "false"), ("REDIS_SOCKET_TYPE", "tcp"), ("REDIS_URL", "r:1")]);
        assert_eq!(v4.unwrap().config["server"]["http"], "10.0.0.1:8080");
    }

    /// Tracing follows their default protocol, OTLP/HTTP (port 4318), as Envoy Gateway
    /// relies on; grpc is taken when asked for.
    #[test]
    fn tracing_follows_their_default_protocol() {
        let tcp = [("REDIS_SOCKET_TYPE", "tcp"), ("REDIS_URL", "r:6379"), ("USE_STATSD", "false")];
        let with = |extra: &[(&'static str, &'static str)]| read(&[&tcp[..], extra].concat()).unwrap();
        let http = with(&[("TRACING_ENABLED", "true")]);
        assert_eq!(http.config["telemetry"]["otlp"]["protocol"], "http");
        assert_eq!(http.config["telemetry"]["otlp"]["endpoint"], "http://127.0.0.1:4318");
        let grpc = with(&[("TRACING_ENABLED", "true"), ("TRACING_EXPORTER_PROTOCOL", "grpc")]);
        assert_eq!(grpc.config["telemetry"]["otlp"]["endpoint"], "http://127.0.0.1:4317");
        let e = read(&[&tcp[..], &[("TRACING_ENABLED", "true"), ("TRACING_EXPORTER_PROTOCOL", "udp")]].concat());
        assert!(e.err().unwrap().contains("TRACING_EXPORTER_PROTOCOL: http or grpc"));
    }

    /// Every variable Envoy Gateway's generated Deployment sets (its
    /// `internal/infrastructure/kubernetes/ratelimit/resource.go`, with Redis TLS,
    /// Prometheus and tracing on) makes a config that loads, with each honoured where it
    /// belongs, and the rest named in the start's log.
    #[test]
    fn envoy_gateways_whole_environment_loads() {
        let c = read(ENVOY_GATEWAY).unwrap();
        let v = &c.config;
        assert_eq!(v["xds"]["server"], "envoy-gateway:18001");
        assert_eq!(v["xds"]["node_id"], "envoy-ratelimit");
        assert_eq!(v["xds"]["start_without_config"], true);
        assert_eq!(v["xds"]["tls"]["ca_file"], "/certs/ca.crt");
        assert_eq!(v["xds"]["tls"]["cert_file"], "/certs/tls.crt");
        assert!(v.get("domains_from").is_none(), "xDS and files never mix");
        assert_eq!(v["server"]["tls"]["cert_file"], "/certs/tls.crt");
        assert_eq!(v["server"]["tls"]["http"], false, "their TLS is gRPC's alone");
        assert_eq!(v["server"]["metrics"], "0.0.0.0:19001");
        assert_eq!(v["limiter"]["ratelimit_metrics"], true);
        assert_eq!(v["store"]["url"], "rediss://redis.redis.svc:6379");
        assert_eq!(v["store"]["tls"]["cert_file"], "/redis-certs/tls.crt");
        let otlp = &v["telemetry"]["otlp"];
        assert_eq!((&otlp["protocol"], &otlp["service_namespace"]), (&json!("http"), &json!("envoy-gateway-system")));
        assert_eq!(otlp["service_instance_id"], "envoy-ratelimit-7d9f-abcde");
        let notes = c.notes.join("\n");
        for said in
            ["RUNTIME_IGNOREDOTFILES", "GRPC_SERVER_TLS_CA_CERT", "PROMETHEUS_MAPPER_YAML", "CONFIG_TYPE=GRPC_XDS_SOTW"]
        {
            assert!(notes.contains(said), "{said} not in the start's notes:\n{notes}");
        }
        // the Redis client certificate and the xDS files are read when the config loads:
        // the Secrets' files
        let certs = std::env::temp_dir().join(format!("sluice-eg-env-{}", std::process::id()));
        std::fs::create_dir_all(&certs).unwrap();
        for f in ["tls.crt", "tls.key", "ca.crt"] {
            std::fs::write(certs.join(f), "-----BEGIN PEM-----\n").unwrap();
        }
        let text = serde_norway::to_string(v).unwrap();
        let text = text.replace("/redis-certs/", &format!("{}/", certs.display()));
        let text = text.replace("/certs/", &format!("{}/", certs.display()));
        let source = crate::config::load::Source::Text { name: "eg".into(), text };
        let loaded = crate::config::load::load(&source).unwrap_or_else(|e| panic!("{e}"));
        assert!(loaded.config.xds.is_some() && loaded.config.domains.is_empty());
        std::fs::remove_dir_all(certs).unwrap();
    }

    /// Envoy Gateway's generated environment (its test data, `default.yaml` with Redis
    /// TLS, Prometheus and tracing on).
    pub const ENVOY_GATEWAY: &[(&str, &str)] = &[
        ("RUNTIME_ROOT", "/data"),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("RUNTIME_IGNOREDOTFILES", "true"),
        ("RUNTIME_WATCH_ROOT", "false"),
        ("LOG_LEVEL", "info"),
        ("USE_STATSD", "false"),
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", "/certs/tls.crt"),
        ("GRPC_SERVER_TLS_KEY", "/certs/tls.key"),
        ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt"),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "/certs/tls.key"),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", "redis.redis.svc:6379"),
        ("REDIS_TLS", "true"),
        ("REDIS_TLS_CLIENT_CERT", "/redis-certs/tls.crt"),
        ("REDIS_TLS_CLIENT_KEY", "/redis-certs/tls.key"),
        ("USE_PROMETHEUS", "true"),
        ("PROMETHEUS_ADDR", ":19001"),
        ("PROMETHEUS_MAPPER_YAML", "/etc/statsd-exporter/conf.yaml"),
        ("TRACING_ENABLED", "true"),
        ("TRACING_SERVICE_NAME", "envoy-ratelimit"),
        ("TRACING_SERVICE_NAMESPACE", "envoy-gateway-system"),
        ("TRACING_SERVICE_INSTANCE_ID", "envoy-ratelimit-7d9f-abcde"),
        ("TRACING_SAMPLING_RATE", "1.0"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://trace-collector.envoy-gateway-system.svc.cluster.local:4318"),
    ];

    /// A host:port in REDIS_URL with the socket type left at its default (unix, as theirs)
    /// says to set REDIS_SOCKET_TYPE=tcp (it said `redis+unix://... Missing path`).
    #[test]
    fn a_host_port_without_a_socket_type_says_to_set_tcp() {
        let e = read(&[("REDIS_URL", "redis:6379"), ("USE_STATSD", "false")]).err().unwrap();
        assert!(e.contains("set REDIS_SOCKET_TYPE=tcp") && e.contains("default socket type is unix"), "{e}");
        let unix = read(&[("REDIS_URL", "/run/redis.sock"), ("USE_STATSD", "false")]).unwrap();
        assert_eq!(unix.config["store"]["url"], "redis+unix:///run/redis.sock");
    }

    /// REDIS_URL written as a URL is taken (it became `redis://redis://...`, refused with a
    /// fix that said to write what was written); each error names its variable.
    #[test]
    fn errors_name_the_variable_at_fault() {
        let ok = |vars: &[(&str, &str)]| read(&[&[("USE_STATSD", "false")], vars].concat()).map(|f| f.config);
        let url = ok(&[("REDIS_URL", "redis://127.0.0.1:6391")]).unwrap();
        assert_eq!(url["store"]["url"], "redis://127.0.0.1:6391");
        let tls = ok(&[("REDIS_URL", "rediss://r.example:6380/"), ("REDIS_SOCKET_TYPE", "tcp")]).unwrap();
        assert_eq!(tls["store"]["url"], "rediss://r.example:6380");
        let cluster = ok(&[("REDIS_TYPE", "cluster"), ("REDIS_URL", "redis://a:1,redis://b:2")]).unwrap();
        assert_eq!(cluster["store"]["nodes"], json!(["redis://a:1", "redis://b:2"]));
        for (vars, says) in [
            (&[("REDIS_URL", "http://r:6379")][..], "REDIS_URL=http://r:6379: http:// is not a Redis scheme"),
            (&[("REDIS_URL", "redis://r:6379"), ("REDIS_SOCKET_TYPE", "unix")], "set it to tcp"),
            (&[("REDIS_URL", "r:port"), ("REDIS_SOCKET_TYPE", "tcp")], "REDIS_URL=r:port is not host:port"),
            (&[("REDIS_URL", "/s"), ("PORT", "abc")], "PORT=abc is not a port number"),
            (&[("REDIS_URL", "/s"), ("GRPC_PORT", "70000")], "GRPC_PORT=70000 is not a port number"),
            (&[("REDIS_URL", "/s"), ("PORT", "9000"), ("GRPC_PORT", "9000")], "PORT and GRPC_PORT are both 9000"),
            (
                &[("REDIS_URL", "/s"), ("PORT", "8080"), ("USE_PROMETHEUS", "true"), ("PROMETHEUS_ADDR", ":8080")],
                "PROMETHEUS_ADDR=:8080 takes port 8080, which PORT gives its listener",
            ),
            (
                &[("REDIS_URL", "/s"), ("USE_PROMETHEUS", "true"), ("PROMETHEUS_ADDR", "metrics")],
                "PROMETHEUS_ADDR=metrics is not [HOST]:PORT",
            ),
        ] {
            let e = ok(vars).err().unwrap_or_else(|| panic!("{vars:?} passed"));
            assert!(e.contains(says), "{vars:?}: {e}");
        }
        ok(&[("REDIS_URL", "/s"), ("PORT", "0"), ("USE_PROMETHEUS", "true"), ("PROMETHEUS_ADDR", ":0")]).unwrap();
    }

    /// Settings that were refused at start and are honoured now, each where it belongs.
    #[test]
    fn their_other_settings_are_honoured() {
        let c = read(&[
            ("USE_STATSD", "false"),
            ("REDIS_URL", "/s"),
            ("QUOTA_MODE", "true"),
            ("USE_PROMETHEUS", "true"),
            ("PROMETHEUS_PATH", "/stats/prometheus"),
            ("LIMIT_RESET_HEADER", "X-Reset-In"),
            ("GRPC_MAX_CONNECTION_AGE", "24h"),
            ("GRPC_MAX_CONNECTION_AGE_GRACE", "90s"),
            ("REDIS_TIMEOUT", "3s"),
            ("DEBUG_PORT", "6071"),
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_CLIENT_TLS_SAN", "envoy.internal"),
            ("GRPC_UDS", "/var/run/ratelimit.sock"),
        ])
        .unwrap()
        .config;
        assert_eq!(
            (&c["server"]["grpc_max_connection_age"], &c["server"]["grpc_max_connection_age_grace"]),
            (&json!("24h"), &json!("90s"))
        );
        assert_eq!(c["store"]["timeout"], "3s");
        assert_eq!(c["server"]["debug"], "0.0.0.0:6071", "their DEBUG_HOST's default");
        assert_eq!(c["server"]["tls"]["client_san"], "envoy.internal");
        assert_eq!(c["server"]["grpc_uds"], "/var/run/ratelimit.sock");
        let dog = read(&[
            ("USE_STATSD", "false"),
            ("REDIS_URL", "/s"),
            ("USE_DOG_STATSD", "true"),
            ("USE_DOG_STATSD_MOGRIFIERS", "RL"),
            ("DOG_STATSD_MOGRIFIER_RL_PATTERN", r"^ratelimit\.service\.rate_limit\.(\w+)\.(.+)\.(\w+)$"),
            ("DOG_STATSD_MOGRIFIER_RL_NAME", "ratelimit.service.rate_limit.$3"),
            ("DOG_STATSD_MOGRIFIER_RL_TAGS", "domain:$1,descriptor:$2"),
        ])
        .unwrap()
        .config;
        // StatsD is on unless asked off, as theirs: to localhost:8125 over TCP
        let by_default = read(&[("REDIS_URL", "/s")]).unwrap().config;
        let s = &by_default["telemetry"]["statsd"];
        assert_eq!((&s["address"], &s["protocol"]), (&json!("localhost:8125"), &json!("tcp")));
        let off = read(&[("REDIS_URL", "/s"), ("DISABLE_STATS", "true")]).unwrap().config;
        assert!(off["telemetry"]["statsd"].is_null(), "DISABLE_STATS");
        let m = &dog["telemetry"]["statsd"]["mogrifiers"][0];
        assert_eq!((&m["name"], &m["tags"]["domain"]), (&json!("ratelimit.service.rate_limit.$3"), &json!("$1")));
        let e = read(&[
            ("USE_STATSD", "false"),
            ("REDIS_URL", "/s"),
            ("USE_DOG_STATSD", "true"),
            ("USE_DOG_STATSD_MOGRIFIERS", "X"),
            ("DOG_STATSD_MOGRIFIER_X_PATTERN", "("),
        ]);
        let e = e.err().unwrap();
        assert!(
            e.contains("DOG_STATSD_MOGRIFIER_X_NAME: the mogrifier X needs it")
                && e.contains("X_PATTERN: not a regular expression"),
            "{e}"
        );
        let e = read(&[("USE_STATSD", "false"), ("REDIS_URL", "/s"), ("DEBUG_PORT", "x")]).err().unwrap();
        assert!(e.contains("DEBUG_PORT=x is not a port number"), "{e}");
        let e = read(&[("USE_STATSD", "false"), ("REDIS_URL", "/s"), ("GRPC_MAX_CONNECTION_AGE", "a while")])
            .err()
            .unwrap();
        assert!(e.contains("GRPC_MAX_CONNECTION_AGE=a while is not a duration"), "{e}");
        assert_eq!(c["limiter"]["quota_mode"], true);
        assert_eq!(c["server"]["metrics_path"], "/stats/prometheus");
        assert_eq!(c["headers"]["envoy_ratelimit_names"]["reset"], "X-Reset-In");
        assert!(c["headers"]["envoy_ratelimit_names"]["limit"].is_null(), "unset: their name");
    }
}
