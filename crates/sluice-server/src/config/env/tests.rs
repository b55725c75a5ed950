//! The unit tests of `env`.

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
    assert!(e.err().unwrap().contains("REDIS_PERSECOND_URL=s:1 is not a socket path"), "the variable at fault named");
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
    assert_eq!((&c.config["server"]["http"], &c.config["server"]["grpc"]), (&json!("[::]:8080"), &json!("[::1]:9081")));
    let v4 = read(&[("HOST", "10.0.0.1"), ("USE_STATSD", "false"), ("REDIS_SOCKET_TYPE", "tcp"), ("REDIS_URL", "r:1")]);
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
    let e =
        read(&[("USE_STATSD", "false"), ("REDIS_URL", "/s"), ("GRPC_MAX_CONNECTION_AGE", "a while")]).err().unwrap();
    assert!(e.contains("GRPC_MAX_CONNECTION_AGE=a while is not a duration"), "{e}");
    assert_eq!(c["limiter"]["quota_mode"], true);
    assert_eq!(c["server"]["metrics_path"], "/stats/prometheus");
    assert_eq!(c["headers"]["envoy_ratelimit_names"]["reset"], "X-Reset-In");
    assert!(c["headers"]["envoy_ratelimit_names"]["limit"].is_null(), "unset: their name");
}
