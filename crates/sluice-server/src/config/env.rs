//! `sluice serve --ratelimit-env`: envoyproxy/ratelimit's environment variables read as
//! a Sluice config, so a deployment swaps their image for Sluice's and changes nothing
//! else. The variables become a config file (written beside nothing the user owns, in a
//! directory of its own under the system's temporary directory), which then loads,
//! reloads and fails exactly as a written one does; `sluice config from-env` prints it.
//!
//! Every variable of theirs falls in one of three groups (the table in docs/envoy.md):
//! honoured (mapped to a config key), without meaning here (accepted, and named in one
//! log line at start: a connection pool size, for a client that multiplexes), or asking
//! for what Sluice does not do (a StatsD sink, per-second limits on a second Redis):
//! those refuse the start, each with the reason, never silently ignored.

use serde_json::{Value, json};
use sluice::store::percent_encode;

/// What the environment says: the config, and the variables accepted without effect.
pub struct FromEnv {
    pub config: Value,
    pub without_effect: Vec<&'static str>,
}

/// Variables accepted and not needed: what they tune does not exist here.
const WITHOUT_EFFECT: &[&str] = &[
    "REDIS_POOL_SIZE",
    "REDIS_PIPELINE_WINDOW",
    "REDIS_PIPELINE_LIMIT",
    "REDIS_CLUSTER_PIPELINE_PARALLELISM",
    "REDIS_POOL_ON_EMPTY_BEHAVIOR",
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
    "USE_PROMETHEUS",
    "DISABLE_STATS",
    "STATS_FLUSH_INTERVAL",
    "EXTRA_TAGS",
    "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS",
];

/// Reads the variables (through `env`) into a config, or says every one it refuses.
pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<FromEnv, String> {
    let get = |name: &str| env(name).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    let on = |name: &str| get(name).is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "true" | "1" | "t"));
    let mut refused = refusals(&get, &on);
    let store = store(&get, &on).unwrap_or_else(|e| {
        refused.push(e);
        Value::Null
    });
    if !refused.is_empty() {
        return Err(format!(
            "--ratelimit-env: {} (docs/envoy.md has the table of their variables)",
            refused.join("; ")
        ));
    }
    // an IPv6 address (Istio's sample sets HOST=::) is written in brackets before its port;
    // `::` listens on IPv6 and IPv4 alike where the system allows it (Linux's default)
    let host = |h: &str, p: &str, port: &str| {
        let address = get(h).unwrap_or_else(|| "0.0.0.0".into());
        let address = match address.contains(':') && !address.starts_with('[') {
            true => format!("[{address}]"),
            false => address,
        };
        format!("{address}:{}", get(p).unwrap_or_else(|| port.into()))
    };
    let runtime = std::path::Path::new(&get("RUNTIME_ROOT").unwrap_or_else(|| "/srv/runtime_data/current".into()))
        .join(get("RUNTIME_SUBDIRECTORY").unwrap_or_default())
        .join(get("RUNTIME_APPDIRECTORY").unwrap_or_else(|| "config".into()));
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
        "limiter": {"near_cache": near_cache, "shadow_mode": on("SHADOW_MODE"), "key_secret": secret,
            "near_limit_ratio": get("NEAR_LIMIT_RATIO").and_then(|r| r.parse::<f64>().ok()).unwrap_or(0.8)},
        "headers": {"github": false, "ietf": false, "envoy_ratelimit": headers},
        "envoy": {"merge_domains": on("MERGE_DOMAIN_CONFIG"), "response_dynamic_metadata": on("RESPONSE_DYNAMIC_METADATA")},
        "domains_from": runtime,
        "log": {"level": get("LOG_LEVEL").unwrap_or_else(|| "warn".into()).to_ascii_lowercase(),
            "format": get("LOG_FORMAT").unwrap_or_else(|| "text".into()).to_ascii_lowercase()},
    });
    if let Some(tls) = listener_tls(&get, &on) {
        config["server"]["tls"] = tls;
    }
    if on("TRACING_ENABLED") {
        config["telemetry"] = json!({"otlp": {
            "endpoint": get("OTEL_EXPORTER_OTLP_ENDPOINT").unwrap_or_else(|| "http://127.0.0.1:4317".into()),
            "service_name": get("TRACING_SERVICE_NAME").unwrap_or_else(|| "RateLimit".into()),
            "sampling_ratio": get("TRACING_SAMPLING_RATE").and_then(|r| r.parse::<f64>().ok()).unwrap_or(1.0)}});
    }
    let without_effect = WITHOUT_EFFECT.iter().copied().filter(|v| get(v).is_some()).collect();
    Ok(FromEnv { config, without_effect })
}

/// `sluice config from-env`: prints the config the environment describes.
pub fn print() -> Result<(), String> {
    let from = from_env(&|name| std::env::var(name).ok())?;
    print!("{}", serde_norway::to_string(&from.config).map_err(|e| e.to_string())?);
    Ok(())
}

/// Writes the config the environment describes to a directory of its own, for `serve`
/// to load and watch; returns its path and the variables without effect.
pub fn write() -> Result<(std::path::PathBuf, Vec<&'static str>), String> {
    let from = from_env(&|name| std::env::var(name).ok())?;
    let dir = std::env::temp_dir().join(format!("sluice-ratelimit-env-{}", std::process::id()));
    let path = dir.join("sluice.yaml");
    let text = serde_norway::to_string(&from.config).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&path, text))
        .map_err(|e| format!("--ratelimit-env: cannot write {}: {e}", path.display()))?;
    Ok((path, from.without_effect))
}

/// Logs the variables set that have no effect here (once, at start).
pub fn note(without_effect: &[&str]) {
    if !without_effect.is_empty() {
        let variables = without_effect.join(", ");
        tracing::info!(%variables, "--ratelimit-env: these have no effect here (docs/envoy.md says why)");
    }
}

/// The variables set to ask for what Sluice does not do, each with why.
fn refusals(get: &dyn Fn(&str) -> Option<String>, on: &dyn Fn(&str) -> bool) -> Vec<String> {
    let set = |name: &str| get(name).is_some();
    let not =
        |name: &str, allowed: &[&str]| get(name).is_some_and(|v| !allowed.contains(&v.to_ascii_lowercase().as_str()));
    let headers = [("LIMIT_LIMIT_HEADER", "ratelimit-limit"), ("LIMIT_REMAINING_HEADER", "ratelimit-remaining")];
    let renamed =
        headers.into_iter().chain([("LIMIT_RESET_HEADER", "ratelimit-reset")]).any(|(v, name)| not(v, &[name]));
    let checks = [
        (not("CONFIG_TYPE", &["file"]), "CONFIG_TYPE: rules come from files (RUNTIME_ROOT); xDS is not supported"),
        (
            on("FORCE_START_WITHOUT_INITIAL_CONFIG"),
            "FORCE_START_WITHOUT_INITIAL_CONFIG: Sluice never starts (or reloads) without rules",
        ),
        (on("QUOTA_MODE"), "QUOTA_MODE: quota mode is not built"),
        (
            on("REDIS_PERSECOND"),
            "REDIS_PERSECOND: every window lives in one store; point REDIS_URL at one Redis (or a cluster) sized for all limits",
        ),
        (
            on("USE_STATSD"),
            "USE_STATSD: statistics are Prometheus metrics at /metrics on the HTTP port (set USE_STATSD=false)",
        ),
        (on("USE_DOG_STATSD"), "USE_DOG_STATSD: statistics are Prometheus metrics at /metrics"),
        (
            set("PROMETHEUS_ADDR"),
            "PROMETHEUS_ADDR: /metrics is served on the HTTP port (PORT), not on a port of its own",
        ),
        (not("PROMETHEUS_PATH", &["/metrics"]), "PROMETHEUS_PATH: the path is /metrics"),
        (set("PROMETHEUS_MAPPER_YAML"), "PROMETHEUS_MAPPER_YAML: metric names are Sluice's own (docs/operations.md)"),
        (
            set("DEBUG_HOST") || set("DEBUG_PORT"),
            "DEBUG_HOST/DEBUG_PORT: there is no debug port; /metrics and /healthcheck are on the HTTP port",
        ),
        (set("GRPC_UDS"), "GRPC_UDS: gRPC is served on TCP (GRPC_HOST, GRPC_PORT)"),
        (
            set("GRPC_MAX_CONNECTION_AGE") || set("GRPC_MAX_CONNECTION_AGE_GRACE"),
            "GRPC_MAX_CONNECTION_AGE: connections are not aged out",
        ),
        (set("GRPC_CLIENT_TLS_SAN"), "GRPC_CLIENT_TLS_SAN: a client certificate is checked against the CA only"),
        (renamed, "LIMIT_*_HEADER: the headers are named RateLimit-Limit, RateLimit-Remaining and RateLimit-Reset"),
        (
            on("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION"),
            "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION: the Redis certificate is always verified",
        ),
        (set("MEMCACHE_SRV"), "MEMCACHE_SRV: list the servers in MEMCACHE_HOST_PORT"),
        (on("MEMCACHE_TLS"), "MEMCACHE_TLS: memcached is spoken in plain TCP"),
        (not("BACKEND_TYPE", &["redis", "memcache"]), "BACKEND_TYPE: redis or memcache"),
        (not("REDIS_TYPE", &["single", "cluster", "sentinel"]), "REDIS_TYPE: SINGLE, CLUSTER or SENTINEL"),
        (not("REDIS_SOCKET_TYPE", &["tcp", "unix"]), "REDIS_SOCKET_TYPE: tcp or unix"),
        (not("LOG_FORMAT", &["text", "json"]), "LOG_FORMAT: text or json"),
        (
            // theirs defaults to http (OTLP/HTTP, port 4318), which Sluice does not
            // speak: sending gRPC there would lose every span without a word
            on("TRACING_ENABLED") && get("TRACING_EXPORTER_PROTOCOL").is_none_or(|p| !p.eq_ignore_ascii_case("grpc")),
            "TRACING_EXPORTER_PROTOCOL: unset or http means OTLP/HTTP (envoyproxy/ratelimit's default), and Sluice exports OTLP/gRPC only: set TRACING_EXPORTER_PROTOCOL=grpc and point OTEL_EXPORTER_OTLP_ENDPOINT at the collector's gRPC port (4317)",
        ),
    ];
    checks.into_iter().filter(|(refuse, _)| *refuse).map(|(_, why)| why.to_string()).collect()
}

/// `store`, from `BACKEND_TYPE` and the `REDIS_*` or `MEMCACHE_*` variables.
fn store(get: &dyn Fn(&str) -> Option<String>, on: &dyn Fn(&str) -> bool) -> Result<Value, String> {
    let lower = |name: &str, default: &str| get(name).unwrap_or_else(|| default.into()).to_ascii_lowercase();
    if lower("BACKEND_TYPE", "redis") == "memcache" {
        let servers = get("MEMCACHE_HOST_PORT").ok_or("BACKEND_TYPE=memcache needs MEMCACHE_HOST_PORT")?;
        let servers: Vec<&str> = servers.split(',').map(str::trim).collect();
        return Ok(json!({"kind": "memcached", "servers": servers}));
    }
    let url = get("REDIS_URL").unwrap_or_else(|| "/var/run/nutcracker/ratelimit.sock".into());
    let (user, password) = credentials(get("REDIS_AUTH"));
    let tls = on("REDIS_TLS");
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
    Ok(match lower("REDIS_TYPE", "single").as_str() {
        "cluster" => {
            let nodes: Vec<String> = url.split(',').map(|n| with_auth(n.trim())).collect();
            json!({"kind": "redis_cluster", "nodes": nodes, "tls": tls_files})
        }
        "sentinel" => {
            // theirs: the primary's name, then the Sentinels
            let mut parts = url.split(',').map(str::trim);
            let master = parts.next().unwrap_or_default();
            let (sentinel_username, sentinel_password) = credentials(get("REDIS_SENTINEL_AUTH"));
            json!({"kind": "redis_sentinel", "master_name": master, "sentinels": parts.collect::<Vec<_>>(),
                "username": user, "password": password, "sentinel_username": sentinel_username,
                "sentinel_password": sentinel_password, "tls": tls_files})
        }
        _ if lower("REDIS_SOCKET_TYPE", "unix") == "unix" => {
            if !url.starts_with('/') {
                return Err(format!(
                    "REDIS_URL={url} is not a socket path, and REDIS_SOCKET_TYPE is {}: the default socket type is \
                     unix, as envoyproxy/ratelimit's is; for a host:port set REDIS_SOCKET_TYPE=tcp",
                    get("REDIS_SOCKET_TYPE").unwrap_or_else(|| "unset".into())
                ));
            }
            let auth = password.map(|p| format!("?pass={}", percent_encode(&p))).unwrap_or_default();
            json!({"kind": "redis", "url": format!("redis+unix://{url}{auth}")})
        }
        _ => json!({"kind": "redis", "url": with_auth(&url), "tls": tls_files}),
    })
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
        json!({"cert_file": get("GRPC_SERVER_TLS_CERT"), "key_file": get("GRPC_SERVER_TLS_KEY"),
            "client_ca_file": get("GRPC_CLIENT_TLS_CACERT")})
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
        assert_eq!(c.without_effect, ["REDIS_POOL_SIZE"]);
        let cluster = read(&[("REDIS_TYPE", "cluster"), ("REDIS_URL", "a:1,b:2"), ("REDIS_TLS", "true")]).unwrap();
        assert_eq!(cluster.config["store"]["nodes"], json!(["rediss://a:1", "rediss://b:2"]));
    }

    #[test]
    fn what_cannot_be_honoured_is_refused_with_every_reason() {
        let e = read(&[("USE_STATSD", "true"), ("REDIS_PERSECOND", "true"), ("CONFIG_TYPE", "GRPC_XDS_SOTW")])
            .err()
            .unwrap();
        for says in ["USE_STATSD", "REDIS_PERSECOND", "CONFIG_TYPE", "docs/envoy.md"] {
            assert!(e.contains(says), "{e}");
        }
        assert!(read(&[("BACKEND_TYPE", "memcache")]).err().unwrap().contains("MEMCACHE_HOST_PORT"));
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

    /// Tracing on with their default protocol (http: OTLP/HTTP) is refused with the fix,
    /// not exported over gRPC to what may be an OTLP/HTTP port; grpc is taken.
    #[test]
    fn tracing_follows_their_default_protocol() {
        let tcp = [("REDIS_SOCKET_TYPE", "tcp"), ("REDIS_URL", "r:6379"), ("USE_STATSD", "false")];
        let with = |extra: &[(&'static str, &'static str)]| read(&[&tcp[..], extra].concat());
        for protocol in [None, Some("http")] {
            let mut vars = vec![("TRACING_ENABLED", "true")];
            vars.extend(protocol.map(|p| ("TRACING_EXPORTER_PROTOCOL", p)));
            let e = with(&vars).err().unwrap();
            assert!(e.contains("set TRACING_EXPORTER_PROTOCOL=grpc"), "{protocol:?}: {e}");
        }
        let ok = with(&[("TRACING_ENABLED", "true"), ("TRACING_EXPORTER_PROTOCOL", "grpc")]).unwrap();
        assert_eq!(ok.config["telemetry"]["otlp"]["endpoint"], "http://127.0.0.1:4317");
    }

    /// A host:port in REDIS_URL with the socket type left at its default (unix, as theirs)
    /// says to set REDIS_SOCKET_TYPE=tcp (it said `redis+unix://... Missing path`).
    #[test]
    fn a_host_port_without_a_socket_type_says_to_set_tcp() {
        let e = read(&[("REDIS_URL", "redis:6379"), ("USE_STATSD", "false")]).err().unwrap();
        assert!(e.contains("set REDIS_SOCKET_TYPE=tcp") && e.contains("default socket type is unix"), "{e}");
        let unix = read(&[("REDIS_URL", "/run/redis.sock"), ("USE_STATSD", "false")]).unwrap();
        assert_eq!(unix.config["store"]["url"], "redis+unix:///run/redis.sock");
    }
}
