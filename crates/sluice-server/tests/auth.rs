//! The data plane's credentials (`server.api_tokens`): with tokens set, decisions,
//! status reads, leases and refunds over HTTP, and Envoy's gRPC calls, need one of them;
//! health stays open, and the admin API keeps its own token.

mod common;
#[path = "common/kuadrant.rs"]
mod kuadrant;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

#[tokio::test]
async fn the_data_plane_needs_one_of_the_tokens() {
    let s = common::start_with("  api_tokens: [old-token-0123456789, new-token-0123456789]\n", &common::rule(10));
    let client = reqwest::Client::new();
    let body = common::body("d", &[("user", "a")]);
    let post = |path: &str, token: Option<&str>| {
        let r = client.post(format!("{}{path}", s.base)).json(&body);
        match token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    };
    for (path, token) in [
        ("/v1/ratelimit", None),
        ("/v1/ratelimit", Some("wrong")),
        ("/v1/refund", None),
        ("/v1/reservations", None),
        ("/v1/reservations/anything/commit", None),
    ] {
        let r = post(path, token).send().await.unwrap();
        assert_eq!(r.status(), 401, "{path} with {token:?}");
        assert_eq!(common::header(&r, "www-authenticate"), "Bearer");
    }
    let r = client.get(format!("{}/v1/ratelimit?domain=d&user=a", s.base)).send().await.unwrap();
    assert_eq!(r.status(), 401, "a status read needs a token too");
    let r = client.delete(format!("{}/v1/leases/{}", s.base, "0".repeat(80))).send().await.unwrap();
    assert_eq!(r.status(), 401, "so does a release");
    // either token, so one can be rotated out while the other serves
    for token in ["old-token-0123456789", "new-token-0123456789"] {
        let r = post("/v1/ratelimit", Some(token)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{token}");
    }
    assert_eq!(client.get(format!("{}/healthz", s.base)).send().await.unwrap().status(), 200);
    assert_eq!(client.get(format!("{}/readyz", s.base)).send().await.unwrap().status(), 200);
    // each refusal is counted; the log says it once (at most every 10 s), with the peer
    let metrics = common::metrics(&client, &s.base).await;
    assert!(metrics.contains("sluice_unauthenticated_total{listener=\"http\"} 7\n"), "{metrics}");
    refusals_logged_once(&s.log());
}

/// The log holds one line for the refusals (they came within 10 s), naming the peer and
/// where the fix is.
fn refusals_logged_once(log: &str) {
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("refused for their credentials")).collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(lines[0].contains("peer=127.0.0.1:") && lines[0].contains("When Sluice requires credentials"), "{log}");
}

#[tokio::test]
async fn envoys_calls_need_one_of_the_tokens_in_metadata() {
    let s = common::start_with("  api_tokens: [envoy-token-0123456789]\n", &common::rule(10));
    let mut rls = RateLimitServiceClient::connect(format!("http://{}", s.grpc)).await.unwrap();
    let request = || RateLimitRequest {
        domain: "d".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry { key: "user".into(), value: "e".into() }],
            ..Default::default()
        }],
        hits_addend: 0,
    };
    let e = rls.should_rate_limit(request()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    let mut with = tonic::Request::new(request());
    with.metadata_mut().insert("authorization", "Bearer envoy-token-0123456789".parse().unwrap());
    assert!(rls.should_rate_limit(with).await.is_ok());
    // Kuadrant's service on the same listener takes the same tokens
    for method in ["CheckRateLimit", "Report"] {
        let e = kuadrant::call::<_, RateLimitResponse>(&s.grpc, method, request()).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{method}: {e:?}");
    }
    let reserve = kuadrant::ReserveRequest { request: Some(request()), ttl: None };
    let e = kuadrant::call::<_, kuadrant::ReserveResponse>(&s.grpc, "Reserve", reserve).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    // Envoy fails open on UNAUTHENTICATED: what it lets through is counted and logged
    let metrics = common::metrics(&reqwest::Client::new(), &s.base).await;
    assert!(metrics.contains("sluice_unauthenticated_total{listener=\"grpc\"} 4\n"), "{metrics}");
    refusals_logged_once(&s.log());
}

#[tokio::test]
async fn without_tokens_the_loopback_default_is_open() {
    let s = common::start(&common::rule(10));
    let r = common::hit(&reqwest::Client::new(), &s.base, "d", &[("user", "open")]).await;
    assert_eq!(r.status(), 200);
}

/// An empty, blank or short token is no credential: `config check` refuses it with the
/// reason and the place, and so does `serve` (which then never opens the admin API or
/// the data plane to requests that send none).
#[test]
fn empty_and_short_tokens_are_refused_by_check_and_serve() {
    for (section, says) in [
        ("  admin_token: \"\"\n", "server.admin_token is empty"),
        ("  admin_token: \"   \"\n", "server.admin_token is empty"),
        ("  admin_token: admin\n", "server.admin_token is 5 bytes"),
        ("  api_tokens: [\"\"]\n", "server.api_tokens[0] is empty"),
        ("  api_tokens: [a-long-enough-token-1, short]\n", "server.api_tokens[1] is 5 bytes"),
    ] {
        let dir = sluice_testkit::TempDir::new("sluice-token");
        let file = dir.path().join("sluice.yaml");
        std::fs::write(&file, format!("{}{section}domains:\n{}", common::SERVER, common::rule(10))).unwrap();
        let check = std::process::Command::new(common::bin()).args(["config", "check"]).arg(&file).output().unwrap();
        let err = String::from_utf8_lossy(&check.stderr);
        assert!(!check.status.success() && err.contains(says), "check of {section:?}: {err}");
        assert!(err.contains("sluice.yaml:4:"), "the place is named: {err}");
        let serve = std::process::Command::new(common::bin()).arg("serve").arg("--config").arg(&file).output().unwrap();
        let err = String::from_utf8_lossy(&serve.stderr);
        assert!(!serve.status.success() && err.contains(says), "serve of {section:?}: {err}");
    }
}
