//! `server.tls` on Sluice's own listeners, with certificates made by openssl for each
//! test: HTTPS answers decisions, mTLS refuses a client without a certificate (HTTP and
//! gRPC) or with one another CA signed, and a certificate rotated on disk is served to
//! the next connection without a restart. (A real Envoy over mTLS: `tests/envoy.rs`.)

mod common;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use sluice_testkit::{TempDir, make_certs};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const RULES: &str =
    "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 2}\n";

/// A client that trusts `ca` and presents `identity` (a `name.crt` and `name.key` in
/// `dir`) when given; speaking `alpn`.
fn client(dir: &Path, ca: &str, identity: Option<&str>, alpn: &[u8]) -> Arc<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(dir.join(format!("{ca}.crt"))).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut config = match identity {
        Some(name) => {
            let chain = CertificateDer::pem_file_iter(dir.join(format!("{name}.crt"))).unwrap().map(Result::unwrap);
            let key = PrivateKeyDer::from_pem_file(dir.join(format!("{name}.key"))).unwrap();
            builder.with_client_auth_cert(chain.collect(), key).unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![alpn.to_vec()];
    Arc::new(config)
}

/// One HTTP/1.1 request over TLS to `addr`; the whole response, or the error that
/// ended the exchange (a refused handshake shows as one).
async fn https(addr: &str, config: Arc<rustls::ClientConfig>, request: &str) -> std::io::Result<String> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    let mut tls = tokio_rustls::TlsConnector::from(config).connect(name, tcp).await?;
    tls.write_all(request.as_bytes()).await?;
    let mut text = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut text)).await??;
    if text.is_empty() {
        return Err(std::io::Error::other("closed without an answer"));
    }
    Ok(String::from_utf8_lossy(&text).into_owned())
}

/// Whether a TLS connection to `addr` is refused: the handshake fails, or the server
/// closes it (with an alert, as a TLS 1.3 server refuses a client certificate after the
/// client's side of the handshake) within a second of the HTTP/2 preface. A gRPC server
/// that takes it waits for a call.
async fn refused_h2(addr: &str, config: Arc<rustls::ClientConfig>) -> bool {
    let Ok(tcp) = tokio::net::TcpStream::connect(addr).await else { return true };
    let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    let Ok(mut tls) = tokio_rustls::TlsConnector::from(config).connect(name, tcp).await else { return true };
    if tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.is_err() {
        return true;
    }
    let mut buf = [0u8; 64];
    matches!(tokio::time::timeout(Duration::from_secs(1), tls.read(&mut buf)).await, Ok(Ok(0) | Err(_)))
}

fn decision(user: &str) -> String {
    let body = format!(r#"{{"domain":"d","descriptors":[{{"entries":[{{"key":"user","value":"{user}"}}]}}]}}"#);
    format!(
        "POST /v1/ratelimit HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// `server.tls` naming `server.crt`, `server.key` (and `ca.crt` for mTLS) in `dir`.
fn tls_section(dir: &Path, mutual: bool) -> String {
    let f = |name: &str| dir.join(name).display().to_string();
    let ca = if mutual { format!(", client_ca_file: {}", f("ca.crt")) } else { String::new() };
    format!("  tls: {{cert_file: {}, key_file: {}{ca}}}\n", f("server.crt"), f("server.key"))
}

fn addr(base: &str) -> &str {
    base.trim_start_matches("http://")
}

#[tokio::test]
async fn https_decides_and_plain_http_gets_nothing() {
    let certs = TempDir::new("sluice-tls");
    make_certs(certs.path(), "ca", &["server"]);
    let s = common::start_unready(&tls_section(certs.path(), false), RULES);
    let config = client(certs.path(), "ca", None, b"http/1.1");
    let statuses: Vec<String> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            let answer = https(addr(&s.base), config.clone(), &decision("ann"))
                .await
                .unwrap_or_else(|e| panic!("{e}\n{}", s.log()));
            v.push(answer.split(' ').nth(1).unwrap_or_default().to_string());
        }
        v
    };
    assert_eq!(statuses, ["200", "200", "429"], "{}", s.log());
    // a plain decision on the TLS port is not answered; a plain health probe is (a
    // kubelet cannot present a client certificate under mTLS)
    let plain = reqwest::Client::new();
    let decided = plain.post(format!("{}/v1/ratelimit", s.base)).body(decision("ann")).send().await;
    assert!(decided.is_err(), "a plain HTTP decision was answered: {decided:?}");
    let health = plain.get(format!("{}/healthz", s.base)).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let metrics = plain.get(format!("{}/metrics", s.base)).send().await;
    assert!(metrics.is_err(), "metrics were served in the clear: {metrics:?}");
}

#[tokio::test]
async fn mutual_tls_refuses_clients_without_a_certificate_from_the_ca() {
    let certs = TempDir::new("sluice-mtls");
    make_certs(certs.path(), "ca", &["server", "client"]);
    make_certs(certs.path(), "other", &["stranger"]);
    let s = common::start_unready(&tls_section(certs.path(), true), RULES);
    let with = client(certs.path(), "ca", Some("client"), b"http/1.1");
    let answer = https(addr(&s.base), with, &decision("bo")).await.unwrap_or_else(|e| panic!("{e}\n{}", s.log()));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    for identity in [None, Some("stranger")] {
        let refused = https(addr(&s.base), client(certs.path(), "ca", identity, b"http/1.1"), &decision("bo")).await;
        assert!(refused.is_err(), "{identity:?} was answered: {refused:?}");
        // gRPC, the same
        let refused =
            https(&s.grpc, client(certs.path(), "ca", identity, b"h2"), "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
        assert!(refused.is_err(), "{identity:?} was answered over gRPC: {refused:?}");
    }
}

/// The certificate files replaced on disk (a new CA's): the next connection gets the
/// new certificate, without a restart and without touching the config file.
#[tokio::test]
async fn a_rotated_certificate_is_served_without_a_restart() {
    let certs = TempDir::new("sluice-tls-rotate");
    make_certs(certs.path(), "ca", &["server"]);
    let s = common::start_unready(&tls_section(certs.path(), false), RULES);
    assert!(https(addr(&s.base), client(certs.path(), "ca", None, b"http/1.1"), &decision("cy")).await.is_ok());
    let next = TempDir::new("sluice-tls-next");
    make_certs(next.path(), "next", &["server"]);
    for f in ["server.key", "server.crt"] {
        std::fs::copy(next.path().join(f), certs.path().join(f)).unwrap();
    }
    let trusts_new = client(next.path(), "next", None, b"http/1.1");
    let started = Instant::now();
    while https(addr(&s.base), trusts_new.clone(), &decision("cy")).await.is_err() {
        assert!(started.elapsed() < Duration::from_secs(10), "the new certificate was never served:\n{}", s.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let old = https(addr(&s.base), client(certs.path(), "ca", None, b"http/1.1"), &decision("cy")).await;
    assert!(old.is_err(), "the old certificate is still served");
    assert!(s.log().contains("server.tls (files read again)"), "{}", s.log());
}

/// A broken certificate file refuses the reload; the certificate in force stays.
#[tokio::test]
async fn a_broken_certificate_file_keeps_the_one_in_force() {
    let certs = TempDir::new("sluice-tls-broken");
    make_certs(certs.path(), "ca", &["server"]);
    let s = common::start_unready(&tls_section(certs.path(), false), RULES);
    std::fs::write(certs.path().join("server.crt"), "not a certificate\n").unwrap();
    let started = Instant::now();
    while !s.log().contains("config reload refused") {
        assert!(started.elapsed() < Duration::from_secs(10), "no refusal logged:\n{}", s.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(s.log().contains("server.tls.cert_file"), "{}", s.log());
    let answer = https(addr(&s.base), client(certs.path(), "ca", None, b"http/1.1"), &decision("di")).await;
    assert!(answer.is_ok_and(|a| a.starts_with("HTTP/1.1 200")), "{}", s.log());
}

/// `server.tls.client_san` (envoyproxy/ratelimit's `GRPC_CLIENT_TLS_SAN`): a client
/// certificate the CA signed is taken only if it is valid for that name too, over gRPC and
/// HTTP alike (the test certificates name `localhost` and 127.0.0.1).
#[tokio::test]
async fn mutual_tls_can_require_the_clients_name() {
    let certs = TempDir::new("sluice-mtls-san");
    make_certs(certs.path(), "ca", &["server", "client"]);
    for (san, taken) in [("localhost", true), ("127.0.0.1", true), ("envoy.other.example", false)] {
        let section = tls_section(certs.path(), true).replace("}\n", &format!(", client_san: \"{san}\"}}\n"));
        let s = common::start_unready(&section, RULES);
        let with = client(certs.path(), "ca", Some("client"), b"http/1.1");
        let answer = https(addr(&s.base), with, &decision("cy")).await;
        assert_eq!(answer.is_ok(), taken, "{san}: {answer:?}\n{}", s.log());
        let refused = refused_h2(&s.grpc, client(certs.path(), "ca", Some("client"), b"h2")).await;
        assert_eq!(!refused, taken, "{san} over gRPC\n{}", s.log());
        // the same from their environment (TLS on gRPC alone, as theirs)
        let dir = TempDir::new("sluice-env-san");
        let f = |name: &str| certs.path().join(name).display().to_string();
        let (cert, key, ca) = (f("server.crt"), f("server.key"), f("ca.crt"));
        let vars = [
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", cert.as_str()),
            ("GRPC_SERVER_TLS_KEY", key.as_str()),
            ("GRPC_CLIENT_TLS_CACERT", ca.as_str()),
            ("GRPC_CLIENT_TLS_SAN", san),
        ];
        let (_sluice, grpc) = common::their_way(&dir, ENV_RULE, &vars);
        let refused = refused_h2(&grpc, client(certs.path(), "ca", Some("client"), b"h2")).await;
        assert_eq!(!refused, taken, "{san} from GRPC_CLIENT_TLS_SAN");
    }
}

/// [`RULES`] as one of envoyproxy/ratelimit's domain files.
const ENV_RULE: &str = "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";

/// The memcached store over TLS (`store.tls`; envoyproxy/ratelimit's `MEMCACHE_TLS`):
/// memcached with `-Z` and the test CA's certificate, verified by its address; a limit
/// of 2 counts there (the third call refused, not failed open). With another CA, the
/// server is not trusted: decisions fail open, saying so.
#[tokio::test]
async fn the_memcached_store_speaks_tls() {
    let certs = TempDir::new("sluice-memcached-tls");
    make_certs(certs.path(), "ca", &["server"]);
    make_certs(certs.path(), "other", &[]);
    let f = |name: &str| certs.path().join(name).display().to_string();
    let bin = sluice_testkit::require("memcached", "memcached");
    let mut server = None;
    // a port found free can be taken before memcached binds it: try a few
    for _ in 0..5 {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let ssl = format!("ssl_chain_cert={},ssl_key={}", f("server.crt"), f("server.key"));
        let mut cmd = std::process::Command::new(&bin);
        cmd.args(["-l", "127.0.0.1", "-p", &port.to_string(), "-U", "0", "-u", "root", "-Z", "-o", &ssl]);
        let process = sluice_testkit::Process::spawn(&mut cmd).unwrap();
        if sluice_testkit::wait_for_port(port, Duration::from_secs(5)) {
            server = Some((process, port));
            break;
        }
    }
    let (_memcached, port) = server.expect("memcached with TLS never listened");
    for (ca, counted) in [("ca.crt", true), ("other.crt", false)] {
        let store =
            format!("store: {{kind: memcached, servers: [\"127.0.0.1:{port}\"], tls: {{ca_file: {}}}}}\n", f(ca));
        let s = common::start_unready(&store, RULES);
        let client = reqwest::Client::new();
        let mut answers = Vec::new();
        for _ in 0..3 {
            let r = common::hit(&client, &s.base, "d", &[("user", ca)]).await;
            answers.push((r.status().as_u16(), common::header(&r, "x-sluice-degraded")));
        }
        let statuses: Vec<u16> = answers.iter().map(|a| a.0).collect();
        match counted {
            true => assert_eq!(statuses, [200, 200, 429], "{answers:?}\n{}", s.log()),
            false => assert!(answers.iter().all(|a| a == &(200, "fail-open".to_string())), "{answers:?}"),
        }
    }
    // the same store from their environment: MEMCACHE_TLS with its CA file
    let dir = TempDir::new("sluice-env-memcached-tls");
    let (at, ca) = (format!("127.0.0.1:{port}"), f("ca.crt"));
    let vars = [
        ("BACKEND_TYPE", "memcache"),
        ("MEMCACHE_HOST_PORT", at.as_str()),
        ("MEMCACHE_TLS", "true"),
        ("MEMCACHE_TLS_CACERT", ca.as_str()),
    ];
    let (_sluice, grpc) = common::their_way(&dir, ENV_RULE, &vars);
    let (codes, log) = common::overall_codes(&grpc, "d", &[("user", "env")], 3, dir.path()).await;
    assert_eq!(codes, common::TWO_THEN_OVER, "{log}");
}
