//! The rules over xDS, as Envoy Gateway pushes them: a control plane written here (an
//! Aggregated Discovery Service speaking the real protobuf messages, state of the
//! world) serves `RateLimitConfig` resources to two `sluice serve --ratelimit-env`
//! instances on one Redis, started with `CONFIG_TYPE=GRPC_XDS_SOTW`, and a real Envoy
//! in front of an upstream is limited by what it pushes.

mod common;
#[path = "common/envoy.rs"]
mod envoy_kit;

use envoy_kit::{Envoy, bootstrap, grpc_cluster, ratelimit_filter};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use sluice_testkit::{Process, RedisServer, TempDir};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// go-control-plane's `RateLimitConfig` and the parts of it this test sends, declared
/// from the proto's field numbers.
#[derive(Clone, PartialEq, Message)]
struct RateLimitConfig {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    domain: String,
    #[prost(message, repeated, tag = "3")]
    descriptors: Vec<RateLimitDescriptor>,
}

#[derive(Clone, PartialEq, Message)]
struct RateLimitDescriptor {
    #[prost(string, tag = "1")]
    key: String,
    #[prost(message, optional, tag = "3")]
    rate_limit: Option<RateLimitPolicy>,
    #[prost(bool, tag = "7")]
    quota_mode: bool,
}

#[derive(Clone, PartialEq, Message)]
struct RateLimitPolicy {
    #[prost(int32, tag = "1")]
    unit: i32,
    #[prost(uint32, tag = "2")]
    requests_per_unit: u32,
}

/// Domain `eg`: `user` limited to `n` a minute (`unit` 2), or with no unit (0), which
/// cannot compile.
fn per_user(n: u32, unit: i32) -> Vec<Any> {
    let rate_limit = Some(RateLimitPolicy { unit, requests_per_unit: n });
    let descriptors = vec![RateLimitDescriptor { key: "user".into(), rate_limit, quota_mode: false }];
    let config = RateLimitConfig { name: "eg-config".into(), domain: "eg".into(), descriptors };
    vec![Any { type_url: TYPE_URL.into(), value: config.encode_to_vec() }]
}

/// A request a client sent: which instance (its node metadata), and what it said.
#[derive(Clone, Debug)]
struct Seen {
    instance: String,
    version: String,
    nonce: String,
    error: Option<String>,
}

/// What the control plane serves and has heard, kept across its restarts.
#[derive(Default)]
struct Plane {
    /// The version and resources served to every stream, and a count of changes.
    current: Mutex<(String, Vec<Any>)>,
    changed: tokio::sync::Notify,
    seen: Mutex<Vec<Seen>>,
    /// Streams opened, and whether new ones get nothing (as go-control-plane sends a
    /// node it has no snapshot for).
    opened: std::sync::atomic::AtomicUsize,
    silent: std::sync::atomic::AtomicBool,
}

impl Plane {
    fn push(&self, version: &str, resources: Vec<Any>) {
        *self.current.lock().unwrap() = (version.to_string(), resources);
        self.changed.notify_waiters();
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Waits until each instance has answered the response of `version` (the nonce is
    /// the version here): with an ACK of it, or (`nack`) a NACK that keeps `kept`.
    async fn answered(&self, instances: &[&str], version: &str, nack: Option<&str>, log: &dyn Fn() -> String) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let seen = self.seen();
            let done = instances.iter().all(|i| {
                seen.iter().any(|s| {
                    s.instance == *i
                        && s.nonce == version
                        && match nack {
                            None => s.version == version && s.error.is_none(),
                            Some(kept) => s.version == kept && s.error.is_some(),
                        }
                })
            });
            if done {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "no answer to version {version} from {instances:?}: {seen:#?}\n{}",
                log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

struct Ads(Arc<Plane>);

type Responses = std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<DiscoveryResponse, tonic::Status>> + Send>>;
type DeltaResponses =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<DeltaDiscoveryResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = Responses;
    type DeltaAggregatedResourcesStream = DeltaResponses;

    /// Records every request; sends the current resources at once and at each change.
    async fn stream_aggregated_resources(
        &self,
        request: tonic::Request<tonic::Streaming<DiscoveryRequest>>,
    ) -> Result<tonic::Response<Responses>, tonic::Status> {
        let mut requests = request.into_inner();
        let first = requests.message().await?.ok_or_else(|| tonic::Status::invalid_argument("no request"))?;
        let node = first.node.clone().unwrap_or_default();
        assert_eq!(node.id, "envoy-ratelimit");
        assert_eq!(first.type_url, TYPE_URL);
        let field = node.metadata.as_ref().and_then(|m| m.fields.get("instance")).and_then(|v| v.kind.clone());
        let instance = match field {
            Some(envoy_types::pb::google::protobuf::value::Kind::StringValue(s)) => s,
            other => panic!("no instance in the node metadata: {other:?}"),
        };
        let plane = self.0.clone();
        let record = move |plane: &Plane, r: &DiscoveryRequest| {
            let error = r.error_detail.as_ref().map(|e| e.message.clone());
            let seen = Seen {
                instance: instance.clone(),
                version: r.version_info.clone(),
                nonce: r.response_nonce.clone(),
                error,
            };
            plane.seen.lock().unwrap().push(seen);
        };
        record(&plane, &first);
        plane.opened.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if plane.silent.load(std::sync::atomic::Ordering::SeqCst) {
            // hold the stream open and send nothing, for as long as the client stays
            tokio::spawn(async move { while let Ok(Some(_)) = requests.message().await {} });
            return Ok(tonic::Response::new(Box::pin(futures_util::stream::pending())));
        }
        let listening = plane.clone();
        tokio::spawn(async move {
            while let Ok(Some(r)) = requests.message().await {
                record(&listening, &r);
            }
        });
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            loop {
                let changed = plane.changed.notified();
                let (version, resources) = plane.current.lock().unwrap().clone();
                let response = DiscoveryResponse {
                    version_info: version.clone(),
                    resources,
                    type_url: TYPE_URL.into(),
                    nonce: version,
                    ..Default::default()
                };
                if tx.send(Ok(response)).await.is_err() {
                    return;
                }
                changed.await;
            }
        });
        Ok(tonic::Response::new(Box::pin(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)))))
    }

    async fn delta_aggregated_resources(
        &self,
        _: tonic::Request<tonic::Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<tonic::Response<DeltaResponses>, tonic::Status> {
        Err(tonic::Status::unimplemented("state of the world only"))
    }
}

/// The control plane, on a runtime of its own: dropping it ends every stream and closes
/// its port, as a restarted process does.
struct ControlPlane {
    runtime: Option<tokio::runtime::Runtime>,
    port: u16,
}

impl ControlPlane {
    /// Serves `plane` on `port` (0: the system's choice, read back).
    fn start(plane: Arc<Plane>, port: u16) -> Self {
        Self::start_with(plane, port, None)
    }

    /// As [`ControlPlane::start`], over TLS with `tls` when given.
    fn start_with(plane: Arc<Plane>, port: u16, tls: Option<tokio_rustls::TlsAcceptor>) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tonic::transport::Server::builder().add_service(AggregatedDiscoveryServiceServer::new(Ads(plane)));
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            match tls {
                None => server.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)).await,
                Some(tls) => server.serve_with_incoming(tls_incoming(listener, tls)).await,
            }
        });
        Self { runtime: Some(runtime), port }
    }

    fn stop(&mut self) {
        if let Some(r) = self.runtime.take() {
            r.shutdown_background();
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Connections accepted on `listener` that finish a TLS handshake with `tls`.
fn tls_incoming(
    listener: tokio::net::TcpListener,
    tls: tokio_rustls::TlsAcceptor,
) -> impl futures_util::Stream<Item = std::io::Result<TlsConn>> {
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (tls, tx) = (tls.clone(), tx.clone());
            tokio::spawn(async move {
                if let Ok(s) = tls.accept(tcp).await {
                    let _ = tx.send(Ok(TlsConn(s))).await;
                }
            });
        }
    });
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// A TLS connection as tonic's server takes one.
struct TlsConn(tokio_rustls::server::TlsStream<tokio::net::TcpStream>);

impl tonic::transport::server::Connected for TlsConn {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

impl tokio::io::AsyncRead for TlsConn {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for TlsConn {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// A TLS acceptor with `dir`'s `server` certificate that requires a client certificate
/// signed by `dir`'s CA, offering HTTP/2.
fn mutual_tls(dir: &std::path::Path) -> tokio_rustls::TlsAcceptor {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_file(dir.join("ca.crt")).unwrap()).unwrap();
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone()).build().unwrap();
    let certs = vec![CertificateDer::from_pem_file(dir.join("server.crt")).unwrap()];
    let key = PrivateKeyDer::from_pem_file(dir.join("server.key")).unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

/// `sluice serve --ratelimit-env` as Envoy Gateway's Deployment runs it (xDS, Redis,
/// Prometheus), on loopback ports the system chooses; returns it, its gRPC address and
/// the `metrics=` address from its ready file.
fn instance(
    dir: &TempDir,
    name: &str,
    xds: u16,
    redis: &str,
    extra: &[(&str, &str)],
) -> (Process, String, String, String) {
    let home = dir.path().join(name);
    std::fs::create_dir_all(&home).unwrap();
    let mut cmd = std::process::Command::new(common::bin());
    cmd.args(["serve", "--ratelimit-env"]);
    let (server, metadata) = (format!("127.0.0.1:{xds}"), format!("instance={name}"));
    let vars = [
        ("HOST", "127.0.0.1"),
        ("PORT", "0"),
        ("GRPC_HOST", "127.0.0.1"),
        ("GRPC_PORT", "0"),
        ("LOG_LEVEL", "info"),
        ("USE_STATSD", "false"),
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_URL", &server),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
        ("CONFIG_GRPC_XDS_NODE_METADATA", &metadata),
        ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "100ms"),
        ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "500ms"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", redis),
        ("USE_PROMETHEUS", "true"),
        ("PROMETHEUS_ADDR", "127.0.0.1:0"),
        ("PROMETHEUS_MAPPER_YAML", "/etc/statsd-exporter/conf.yaml"),
    ];
    cmd.envs(vars.iter().chain(extra).copied());
    let (process, http, grpc) = common::spawn_command(cmd, &home);
    let ready = std::fs::read_to_string(home.join("ready")).unwrap();
    let metrics = ready.lines().find_map(|l| l.strip_prefix("metrics=")).expect("a metrics= line").to_string();
    // the start's line names the metrics listener as bound (its port was 0)
    let deadline = Instant::now() + Duration::from_secs(5);
    let log = || std::fs::read_to_string(home.join("sluice.log")).unwrap_or_default();
    while !log().contains("sluice is serving") {
        assert!(Instant::now() < deadline, "no start line:\n{}", log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(log().contains(&format!("metrics={metrics} and the http port")), "{}", log());
    (process, http, grpc, metrics)
}

/// The route's action: a descriptor of the `x-user` header.
const RATE_LIMITS: &str = "                  rate_limits:\n                  - actions:\n                    - request_headers: {header_name: x-user, descriptor_key: user}\n";

/// How many of ten requests of `user` through Envoy reached the upstream.
async fn passed(client: &reqwest::Client, envoy: &Envoy, user: &str) -> usize {
    let mut ok = 0;
    for _ in 0..10 {
        let r = client.get(format!("http://127.0.0.1:{}/", envoy.port)).header("x-user", user).send().await.unwrap();
        ok += usize::from(r.status() == 200);
    }
    ok
}

/// The sum over `scrapes` of the series `name{labels}`.
fn total(scrapes: &[String], series: &str) -> f64 {
    scrapes.iter().map(|s| common::series(s, series)).sum()
}

/// The whole round: pushed, limited, lowered within a second, a broken push NACKed
/// with the old limit holding, the control plane restarted and reconnected to; two
/// instances on one Redis exact together throughout, and envoyproxy/ratelimit's metric
/// names counting it all.
#[tokio::test]
async fn a_control_plane_pushes_the_rules_envoy_is_limited_by() {
    let _heavy = common::heavy().await;
    let redis = RedisServer::start();
    let plane = Arc::new(Plane::default());
    plane.push("1", per_user(4, 2));
    let mut cp = ControlPlane::start(plane.clone(), 0);
    let dir = TempDir::new("sluice-xds");
    let url = redis.addr().to_string();
    let (_a, http_a, grpc_a, metrics_a) = instance(&dir, "a", cp.port, &url, &[]);
    let (_b, http_b, grpc_b, metrics_b) = instance(&dir, "b", cp.port, &url, &[]);
    let log = || {
        ["a", "b"]
            .map(|n| std::fs::read_to_string(dir.path().join(n).join("sluice.log")).unwrap_or_default())
            .join("\n---\n")
    };
    plane.answered(&["a", "b"], "1", None, &log).await;
    let client = reqwest::Client::new();
    for http in [&http_a, &http_b] {
        let r = client.get(format!("http://{http}/healthcheck")).send().await.unwrap();
        assert_eq!(r.status(), 200, "{}", log());
    }
    let ports: Vec<u16> = [&grpc_a, &grpc_b].iter().map(|g| g.rsplit(':').next().unwrap().parse().unwrap()).collect();
    let envoy =
        Envoy::start(|up| bootstrap(up, "", RATE_LIMITS, &ratelimit_filter("eg"), &grpc_cluster("sluice", &ports, "")))
            .await;
    // two instances on one Redis: exactly the limit between them
    assert_eq!(passed(&client, &envoy, "a").await, 4, "{}\n{}", log(), envoy.log());

    let pushed = Instant::now();
    plane.push("2", per_user(2, 2));
    plane.answered(&["a", "b"], "2", None, &log).await;
    let in_force = pushed.elapsed();
    assert!(in_force < Duration::from_secs(1), "version 2 in force on both after {in_force:?}");
    assert_eq!(passed(&client, &envoy, "b").await, 2, "the lower limit:\n{}", log());

    plane.push("3", per_user(9, 0));
    plane.answered(&["a", "b"], "3", Some("2"), &log).await;
    let nack = plane.seen().into_iter().find(|s| s.nonce == "3").unwrap();
    let why = nack.error.unwrap();
    assert!(why.contains("eg-config") && why.contains("no unit"), "the NACK names the resource and the problem: {why}");
    assert_eq!(passed(&client, &envoy, "c").await, 2, "the last good limit holds:\n{}", log());

    cp.stop();
    assert_eq!(passed(&client, &envoy, "d").await, 2, "the rules stay while the control plane is away");
    plane.push("4", per_user(3, 2));
    let _cp = ControlPlane::start(plane.clone(), cp.port);
    plane.answered(&["a", "b"], "4", None, &log).await;
    // each came back saying the version it kept
    let seen = plane.seen();
    for i in ["a", "b"] {
        let opened = seen.iter().filter(|s| s.instance == i && s.nonce.is_empty()).map(|s| s.version.as_str());
        assert_eq!(opened.collect::<Vec<_>>(), ["", "2"], "{i}: {seen:#?}");
    }
    assert_eq!(passed(&client, &envoy, "e").await, 3, "{}", log());

    let mut scrapes = Vec::new();
    for m in [&metrics_a, &metrics_b] {
        scrapes.push(client.get(format!("http://{m}/metrics")).send().await.unwrap().text().await.unwrap());
    }
    let labels = "{domain=\"eg\",key1=\"user\"}";
    let name = |n: &str| format!("ratelimit_service_rate_limit_{n}{labels}");
    assert_eq!(total(&scrapes, &name("total_hits")), 50.0, "{}", scrapes.join("\n"));
    assert_eq!(total(&scrapes, &name("within_limit")), 13.0);
    assert_eq!(total(&scrapes, &name("over_limit")), 37.0);
    assert!(total(&scrapes, "sluice_xds_pushes_total{result=\"refused\"}") == 2.0, "one NACK each");
}

/// Before the first push: with `FORCE_START_WITHOUT_INITIAL_CONFIG=true` ready, every
/// decision answered UNAVAILABLE (HTTP 503) naming what it waits for; without it, not
/// ready. The control plane here takes connections and never answers.
#[tokio::test]
async fn before_the_first_push() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let redis = RedisServer::start();
    let dir = TempDir::new("sluice-xds-wait");
    let url = redis.addr().to_string();
    let (_forced, http, grpc, _) =
        instance(&dir, "forced", port, &url, &[("FORCE_START_WITHOUT_INITIAL_CONFIG", "true")]);
    let (_waiting, waiting_http, _, _) = instance(&dir, "waiting", port, &url, &[]);
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.get(format!("http://{http}/readyz")).send().await.unwrap().status() != 200 {
        assert!(Instant::now() < deadline, "a forced start never became ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(client.get(format!("http://{http}/healthcheck")).send().await.unwrap().status(), 200);
    let r = client.get(format!("http://{waiting_http}/healthcheck")).send().await.unwrap();
    assert_eq!(r.status(), 500);
    assert!(r.text().await.unwrap().contains("waiting for the first push"));
    let r = common::hit(&client, &format!("http://{http}"), "eg", &[("user", "x")]).await;
    assert_eq!(r.status(), 503);
    assert!(r.text().await.unwrap().contains("no_rules_yet"));
    let mut rls = common::rls(&grpc).await;
    let status = rls.should_rate_limit(common::rls_request("eg", &[("user", "x")])).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert!(status.message().contains(&format!("xDS server at 127.0.0.1:{port}")), "{}", status.message());
    drop(silent);
}

/// Envoy Gateway's xDS is TLS both ways: the instance verifies the control plane's
/// certificate against CONFIG_GRPC_XDS_SERVER_TLS_CACERT and presents its own, which the
/// control plane requires. One given another CA never gets the rules, and says why.
#[tokio::test]
async fn the_rules_come_over_mutual_tls() {
    let certs = TempDir::new("sluice-xds-certs");
    sluice_testkit::make_certs(certs.path(), "ca", &["server", "client"]);
    let other = TempDir::new("sluice-xds-other");
    sluice_testkit::make_certs(other.path(), "ca", &["server"]);
    let plane = Arc::new(Plane::default());
    plane.push("1", per_user(4, 2));
    let cp = ControlPlane::start_with(plane.clone(), 0, Some(mutual_tls(certs.path())));
    let redis = RedisServer::start();
    let dir = TempDir::new("sluice-xds-tls");
    let f = |d: &TempDir, name: &str| d.path().join(name).display().to_string();
    let (ca, other_ca, cert, key) =
        (f(&certs, "ca.crt"), f(&other, "ca.crt"), f(&certs, "client.crt"), f(&certs, "client.key"));
    let tls = |ca: &str| {
        [
            ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true".to_string()),
            ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", ca.to_string()),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", cert.clone()),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", key.clone()),
        ]
    };
    let trusted = tls(&ca);
    let vars: Vec<(&str, &str)> = trusted.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let url = redis.addr().to_string();
    let (_a, _, _, _) = instance(&dir, "a", cp.port, &url, &vars);
    let untrusted = tls(&other_ca);
    let vars: Vec<(&str, &str)> = untrusted.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (_b, _, _, _) = instance(&dir, "b", cp.port, &url, &vars);
    let log = |n: &str| std::fs::read_to_string(dir.path().join(n).join("sluice.log")).unwrap_or_default();
    plane.answered(&["a"], "1", None, &|| log("a")).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !log("b").contains("xDS stream lost") {
        assert!(Instant::now() < deadline, "the untrusted server was not refused:\n{}", log("b"));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(plane.seen().iter().all(|s| s.instance != "b"), "b reached a server its CA did not sign");
    assert!(log("b").contains("cannot connect"), "{}", log("b"));
}

/// A push past `XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES` is not read: the stream is dropped
/// and opened again, the rules in force stay, and nothing is acknowledged.
#[tokio::test]
async fn a_push_past_the_size_bound_is_not_taken() {
    let plane = Arc::new(Plane::default());
    plane.push("1", per_user(4, 2));
    let cp = ControlPlane::start(plane.clone(), 0);
    let redis = RedisServer::start();
    let dir = TempDir::new("sluice-xds-size");
    let url = redis.addr().to_string();
    let (_a, http, _, _) = instance(&dir, "a", cp.port, &url, &[("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "512")]);
    let log = || std::fs::read_to_string(dir.path().join("a").join("sluice.log")).unwrap_or_default();
    plane.answered(&["a"], "1", None, &log).await;
    let rule = |i: usize| RateLimitDescriptor {
        key: format!("a-rather-long-descriptor-key-{i}"),
        rate_limit: Some(RateLimitPolicy { unit: 2, requests_per_unit: 1 }),
        quota_mode: false,
    };
    let config = RateLimitConfig { name: "big".into(), domain: "eg".into(), descriptors: (0..40).map(rule).collect() };
    let big = vec![Any { type_url: TYPE_URL.into(), value: config.encode_to_vec() }];
    assert!(big[0].value.len() > 512);
    plane.push("2", big);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !log().contains("xDS stream lost") {
        assert!(Instant::now() < deadline, "a push past the bound was taken:\n{}", log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(plane.seen().iter().all(|s| s.nonce != "2"), "answered a push it could not read");
    let status: serde_json::Value =
        reqwest::get(format!("http://{http}/v1/ratelimit?domain=eg&user=z")).await.unwrap().json().await.unwrap();
    assert_eq!(status["statuses"][0]["policies"][0]["limit"], 4, "the rules in force stay: {status}");
}

/// A control plane that accepts the stream and sends nothing (go-control-plane, for a
/// node id it has no snapshot for): past `xds.initial_fetch_timeout` the instance says
/// so with the likely cause, counts it and opens the stream again, instead of waiting in
/// silence. Ready at once under `start_without_config`, every decision meanwhile is
/// answered without rules and counted; once rules come, the scrape shows the stream
/// open, the version in force and when it was pushed; with the control plane gone, the
/// stream closed.
#[tokio::test]
async fn a_silent_control_plane_is_said_counted_and_retried() {
    use std::sync::atomic::Ordering::SeqCst;
    let plane = Arc::new(Plane::default());
    plane.silent.store(true, SeqCst);
    let mut cp = ControlPlane::start(plane.clone(), 0);
    let xds = format!(
        "xds:\n  server: 127.0.0.1:{}\n  node_id: envoy-ratelimit\n  node_metadata: {{instance: s}}\n  initial_fetch_timeout: 1s\n  retry: 100ms\n  max_retry: 200ms\n  start_without_config: true\n",
        cp.port
    );
    let s = common::start_with(&xds, "  []\n");
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    while !s.log().contains("sent no rules within 1s") || plane.opened.load(SeqCst) < 3 {
        assert!(
            Instant::now() < deadline,
            "no word of the silent server, {} streams:\n{}",
            plane.opened.load(SeqCst),
            s.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let line = s.log().lines().find(|l| l.contains("sent no rules within 1s")).unwrap().to_string();
    assert!(line.contains("WARN") && line.contains("xds.node_id") && line.contains("envoy-ratelimit"), "{line}");
    assert_eq!(client.get(format!("{}/readyz", s.base)).send().await.unwrap().status(), 200);
    assert_eq!(common::hit(&client, &s.base, "eg", &[("user", "x")]).await.status(), 503);
    let mut rls =
        envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::connect(
            format!("http://{}", s.grpc),
        )
        .await
        .unwrap();
    let status = rls.should_rate_limit(common::rls_request("eg", &[("user", "x")])).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
    let metrics = common::metrics(&client, &s.base).await;
    assert!(common::series(&metrics, "sluice_xds_initial_fetch_timeouts_total") >= 2.0, "{metrics}");
    assert_eq!(common::series(&metrics, "sluice_decisions_without_rules_total{api=\"http\"}"), 1.0, "{metrics}");
    assert_eq!(common::series(&metrics, "sluice_decisions_without_rules_total{api=\"grpc\"}"), 1.0, "{metrics}");
    assert_eq!(common::series(&metrics, "sluice_xds_last_push_timestamp_seconds"), 0.0, "{metrics}");
    assert!(!metrics.contains("sluice_xds_config_info"), "no version before a push:\n{metrics}");

    // the server answers at last: the next stream brings the rules
    plane.push("v7", per_user(5, 2));
    plane.silent.store(false, SeqCst);
    plane.answered(&["s"], "v7", None, &|| s.log()).await;
    let r = common::hit(&client, &s.base, "eg", &[("user", "x")]).await;
    assert_eq!(r.status(), 200, "{}", s.log());
    let metrics = common::metrics(&client, &s.base).await;
    assert!(metrics.contains("sluice_xds_config_info{version=\"v7\"} 1\n"), "{metrics}");
    assert_eq!(common::series(&metrics, "sluice_xds_connected"), 1.0, "{metrics}");
    let pushed_at = common::series(&metrics, "sluice_xds_last_push_timestamp_seconds");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    assert!((now - pushed_at).abs() < 30.0, "pushed at {pushed_at}, now {now}");
    let timeouts = common::series(&metrics, "sluice_xds_initial_fetch_timeouts_total");

    cp.stop();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = common::metrics(&client, &s.base).await;
        if common::series(&metrics, "sluice_xds_connected") == 0.0 {
            // rules held: a reconnect after them is not an initial fetch
            assert_eq!(common::series(&metrics, "sluice_xds_initial_fetch_timeouts_total"), timeouts);
            break;
        }
        assert!(Instant::now() < deadline, "the stream never said closed:\n{metrics}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Quota mode and StatsD with the rules pushed over xDS: `quota_mode` in a pushed
/// resource is ACKed (it was NACKed) and decides as from a file, two quotas of 1 and 2 an
/// hour, each call charged to both while they have room: two calls pass, the third is
/// refused; and StatsD counts the pushed rules' hits under their names.
#[tokio::test]
async fn quota_mode_and_statsd_with_pushed_rules() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    let quota = |key: &str, n: u32| RateLimitDescriptor {
        key: key.into(),
        rate_limit: Some(RateLimitPolicy { unit: 3, requests_per_unit: n }),
        quota_mode: true,
    };
    let config = RateLimitConfig {
        name: "q".into(),
        domain: "eg".into(),
        descriptors: vec![quota("premium", 1), quota("standard", 2)],
    };
    let plane = Arc::new(Plane::default());
    plane.push("q1", vec![Any { type_url: TYPE_URL.into(), value: config.encode_to_vec() }]);
    let cp = ControlPlane::start(plane.clone(), 0);
    let statsd = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    statsd.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let redis = RedisServer::start();
    let dir = TempDir::new("sluice-xds-quota");
    let port = statsd.local_addr().unwrap().port().to_string();
    let vars = [
        ("USE_STATSD", "true"),
        ("STATSD_PROTOCOL", "udp"),
        ("STATSD_HOST", "127.0.0.1"),
        ("STATSD_PORT", port.as_str()),
        ("STATS_FLUSH_INTERVAL", "200ms"),
    ];
    let (_s, _, grpc, _) = instance(&dir, "q", cp.port, &redis.addr().to_string(), &vars);
    let log = || std::fs::read_to_string(dir.path().join("q").join("sluice.log")).unwrap_or_default();
    plane.answered(&["q"], "q1", None, &log).await;
    let mut rls = common::rls(&grpc).await;
    let mut codes = Vec::new();
    for _ in 0..4 {
        let mut r = common::rls_request("eg", &[("premium", "a")]);
        r.descriptors.extend(common::rls_request("eg", &[("standard", "a")]).descriptors);
        codes.push(rls.should_rate_limit(r).await.unwrap().into_inner().overall_code);
    }
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    assert_eq!(codes, [ok, ok, over, over], "premium 1, standard 2: two pass\n{}", log());
    let started = Instant::now();
    let mut seen = String::new();
    while !seen.contains("ratelimit.service.rate_limit.eg.standard.total_hits:") {
        assert!(started.elapsed() < Duration::from_secs(10), "no StatsD line for the pushed rule:\n{seen}\n{}", log());
        let mut buf = [0u8; 65_536];
        if let Ok(n) = statsd.recv(&mut buf) {
            seen += &String::from_utf8_lossy(&buf[..n]);
            seen.push('\n');
        }
    }
}
