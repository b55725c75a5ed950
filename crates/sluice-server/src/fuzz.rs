//! Fuzz targets: every surface a client or an operator writes to, fed arbitrary bytes and
//! mutations of valid inputs (proptest: this machine's stable toolchain has no
//! coverage-guided fuzzer without building AFL++). Each target checks what the server
//! promises: no panic, no hang, a malformed input answered 4xx (gRPC INVALID_ARGUMENT)
//! with a message, a broken config refused with a message and a position inside the file.
//!
//! `scripts/test` runs each target for [`DEFAULT_CASES`]; for hours:
//!
//! ```sh
//! SLUICE_FUZZ_CASES=10000000 cargo test --release -p sluice-server fuzz -- --nocapture
//! ```
//!
//! The Lua scripts' arguments are fuzzed through the Redis store by
//! `crates/sluice/tests/redis_model.rs` (random ops against the Rust model).

use crate::app::AppState;
use axum::body::{Body, to_bytes};
use axum::http::{Method, Request, StatusCode};
use proptest::prelude::*;
use std::sync::Arc;
use tower::ServiceExt;

const DEFAULT_CASES: u32 = 3_000;

fn cases() -> u32 {
    std::env::var("SLUICE_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_CASES)
}

fn settings() -> ProptestConfig {
    ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() }
}

/// A server's config with every kind of rule, a migrating store (for the admin body) and
/// an admin token.
const CONFIG: &str = r#"
server: {admin_token: admin-0123456789abcdef}
store: {kind: migrating, from: {kind: memory}, to: {kind: memory}, percent: 0}
domains:
  - domain: d
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 5}
      - key: app
        policies:
          - {name: bucket, token_bucket: {rate: 10, per: 1s, burst: 20}}
          - {name: inflight, concurrency: {limit: 3, lease_ttl: 60s}}
      - key: plan
        value: gold
        detailed_metric: true
        descriptors:
          - key: path
            rate_limit: {unit: second, requests_per_unit: 2}
"#;

/// Valid inputs to mutate.
const BODIES: &[&str] = &[
    r#"{"domain":"d","descriptors":[{"entries":[{"key":"user","value":"a"}]}]}"#,
    r#"{"domain":"d","descriptors":[{"entries":[{"key":"app","value":"x"}],"hits_addend":3}],"hits_addend":1}"#,
    r#"{"domain":"d","descriptors":[{"entries":[{"key":"plan","value":"gold"},{"key":"path","value":"/"}]}]}"#,
    r#"{"domain":"d","descriptors":[{"entries":[{"key":"user","value":"a"}],"limit":{"requests_per_unit":3,"unit":"second"}}]}"#,
    r#"{"domain":"d","descriptors":[{"entries":[{"key":"user","value":"a"}]}],"charges":[{"policy":"user","cost":1}]}"#,
    r#"{"percent": 50}"#,
];

/// Arbitrary bytes, or a valid input with a few random edits (a byte replaced, bytes
/// inserted, the tail cut off, a slice repeated).
fn input(seeds: &'static [&'static str]) -> impl Strategy<Value = Vec<u8>> {
    let edit = (0usize..4, any::<usize>(), prop::collection::vec(any::<u8>(), 0..8));
    let mutated = (prop::sample::select(seeds), prop::collection::vec(edit, 1..5)).prop_map(|(seed, edits)| {
        let mut b = seed.as_bytes().to_vec();
        for (kind, at, bytes) in edits {
            let at = at % (b.len() + 1);
            match kind {
                0 if at < b.len() => b[at] = bytes.first().copied().unwrap_or(0),
                1 => drop(b.splice(at..at, bytes)),
                2 => b.truncate(at),
                _ => b.extend_from_within(at..(at + 8).min(b.len())),
            }
        }
        b
    });
    prop_oneof![prop::collection::vec(any::<u8>(), 0..256), mutated]
}

/// A runtime, and a router on [`CONFIG`] built in it.
type Server = (tokio::runtime::Runtime, axum::Router, Arc<AppState>);

/// Runs `f` on this thread's server, built on first use: a case costs a request, not a
/// server.
fn with_server<T>(f: impl FnOnce(&Server) -> T) -> T {
    thread_local!(static SERVER: Server = server());
    SERVER.with(f)
}

fn server() -> Server {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let state = rt.block_on(async {
        let crate::config::load::Loaded { config, rules, .. } =
            crate::config::load::load_str(CONFIG, "fuzz.yaml").unwrap();
        Arc::new(AppState::new(crate::app::build::build(&config, rules).unwrap(), &config.server, None, None))
    });
    (rt, crate::http::router(state.clone()), state)
}

/// Sends one request; checks the server's promise about the answer.
fn exchange(rt: &tokio::runtime::Runtime, router: &axum::Router, method: Method, uri: &str, body: Vec<u8>) {
    let Ok(request) =
        Request::builder().method(method).uri(uri).header("authorization", "Bearer admin").body(Body::from(body))
    else {
        return; // not a request hyper would have parsed either
    };
    rt.block_on(async {
        let answer = tokio::time::timeout(std::time::Duration::from_secs(5), router.clone().oneshot(request)).await;
        let response = answer.expect("answered within 5 s").expect("infallible");
        let status = response.status();
        assert!(status.as_u16() < 500 || status == StatusCode::SERVICE_UNAVAILABLE, "{uri}: {status}");
        if status.is_client_error() {
            let text = to_bytes(response.into_body(), 1 << 20).await.unwrap();
            let json: serde_json::Value = serde_json::from_slice(&text).expect("an error answers JSON");
            if status == StatusCode::TOO_MANY_REQUESTS {
                assert_eq!(json["overall_code"], "OVER_LIMIT", "{uri}: a 429 that is not a verdict: {json}");
            } else {
                let message = json["error"]["message"].as_str().unwrap_or_default();
                assert!(!message.is_empty(), "{uri}: {status} without a message: {json}");
            }
        }
    });
}

/// Query or path text from arbitrary bytes: what a URI may carry stays, the rest is
/// percent-encoded, and a raw `%` stays (malformed escapes are part of the test).
fn uri_text(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|&b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'&' | b'=' | b'%' | b'.' | b'_' | b'~' | b'-' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

proptest! {
    #![proptest_config(settings())]

    #[test]
    fn fuzz_http_bodies(route in 0usize..4, body in input(BODIES)) {
        let (method, uri) = [
            (Method::POST, "/v1/ratelimit"),
            (Method::POST, "/v1/leases"),
            (Method::POST, "/v1/refund"),
            (Method::PUT, "/v1/admin/migration"),
        ][route].clone();
        with_server(|(rt, router, _)| exchange(rt, router, method, uri, body));
    }

    #[test]
    fn fuzz_status_queries_and_lease_ids(query in input(&["domain=d&user=a", "domain=d&plan=gold&path=%2F"]), lease in input(&["AAAA"])) {
        with_server(|(rt, router, _)| {
            exchange(rt, router, Method::GET, &format!("/v1/ratelimit?{}", uri_text(&query)), Vec::new());
            exchange(rt, router, Method::DELETE, &format!("/v1/leases/{}", uri_text(&lease)), Vec::new());
        });
    }

    #[test]
    fn fuzz_rls_requests(bytes in rls_input()) {
        with_server(|(rt, _, state)| rls_exchange(rt, state, &bytes));
    }

    #[test]
    fn fuzz_config_files(text in input(&[CONFIG, crate::config::load::DEFAULT_CONFIG])) {
        let text = String::from_utf8_lossy(&text);
        if let Err(e) = crate::config::load::load_str(&text, "fuzz.yaml") {
            check_config_error(&text, &e);
        }
    }

    #[test]
    fn fuzz_envoy_domain_files(text in input(&[ENVOY_FILE])) {
        let text = String::from_utf8_lossy(&text);
        if let Err(e) = crate::config::load::domain_file(&text, "fuzz.yaml") {
            check_config_error(&text, &e);
        }
    }
}

/// An envoyproxy/ratelimit domain file.
const ENVOY_FILE: &str = "domain: mongo_cps\ndescriptors:\n  - key: database\n    value: users\n    rate_limit:\n      unit: second\n      requests_per_unit: 500\n  - key: remote_address\n    shadow_mode: true\n    rate_limit: {unit: minute, requests_per_unit: 10}\n";

/// A refused config says why, and where: a position inside the text.
fn check_config_error(text: &str, e: &crate::config::load::ConfigError) {
    assert!(!e.message.is_empty(), "a config error without a message");
    if let Some((line, col)) = e.at {
        // YAML breaks lines at \n, \r\n and a lone \r
        let lines = text.replace("\r\n", "\n").chars().filter(|&c| c == '\n' || c == '\r').count() + 1;
        assert!(line >= 1 && line <= lines, "{e}: line {line} of {lines}");
        assert!(col >= 1, "{e}");
    }
}

/// Arbitrary bytes, or Envoy's request with random strings and numbers, sometimes cut
/// short or with a byte replaced.
fn rls_input() -> impl Strategy<Value = Vec<u8>> {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor};
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    let entry = (prop::sample::select(&["user", "app", "plan", "path", ""][..]), ".{0,12}");
    let descriptor = prop::collection::vec(entry, 0..4).prop_map(|entries| RateLimitDescriptor {
        entries: entries
            .into_iter()
            .map(|(key, value)| rate_limit_descriptor::Entry { key: key.into(), value })
            .collect(),
        ..Default::default()
    });
    let request =
        (prop::sample::select(&["d", "", "other"][..]), prop::collection::vec(descriptor, 0..4), any::<u32>());
    let encoded = (request, any::<usize>(), any::<u8>(), any::<bool>()).prop_map(
        |((domain, descriptors, hits), at, byte, cut)| {
            let request = RateLimitRequest { domain: domain.into(), descriptors, hits_addend: hits % 4 };
            let mut b = prost::Message::encode_to_vec(&request);
            let at = at % (b.len() + 1);
            match (cut, at < b.len()) {
                (true, _) => b.truncate(at),
                (false, true) => b[at] = byte,
                (false, false) => {}
            }
            b
        },
    );
    prop_oneof![prop::collection::vec(any::<u8>(), 0..256), encoded]
}

/// Decodes `bytes` as Envoy's request; a decoded request is answered, never INTERNAL.
fn rls_exchange(rt: &tokio::runtime::Runtime, state: &Arc<AppState>, bytes: &[u8]) {
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    let Ok(request) = <RateLimitRequest as prost::Message>::decode(bytes) else { return };
    if let Err(status) = rt.block_on(crate::rls_messages::should_rate_limit(state, request)) {
        let code = status.code();
        assert!(!matches!(code, tonic::Code::Internal | tonic::Code::Unknown), "{status:?}");
        assert!(!status.message().is_empty(), "{status:?}");
    }
}
