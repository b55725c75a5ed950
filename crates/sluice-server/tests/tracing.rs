//! OpenTelemetry traces (`telemetry.otlp`), received by a collector in the test that
//! decodes the real OTLP requests with the official definitions (`opentelemetry-proto`):
//! a caller's `traceparent` (HTTP header or gRPC metadata) continued through the
//! decision and its store call on a real Redis, the sampled flag and ratio obeyed,
//! descriptor values kept off spans unless asked, the trace id in log lines, and a
//! collector that is down costing the decisions nothing.

#[path = "common/collector.rs"]
mod collector;
mod common;

use collector::{Collector, hex};
use common::{SERVER, body, spawn, start_with};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use sluice_testkit::{RedisServer, TempDir};
use std::time::{Duration, Instant};

/// A span's attribute.
fn attr(span: &Span, key: &str) -> Value {
    let found = span.attributes.iter().find(|a| a.key == key);
    found.and_then(|a| a.value.as_ref()?.value.clone()).unwrap_or_else(|| panic!("no {key} on {span:#?}"))
}

fn string(v: &str) -> Value {
    Value::StringValue(v.into())
}

/// The decision's span (kind server) and its store calls' spans.
fn split(spans: Vec<Span>) -> (Span, Vec<Span>) {
    let (server, store): (Vec<Span>, Vec<Span>) = spans.into_iter().partition(|s| s.kind == SpanKind::Server as i32);
    assert_eq!(server.len(), 1, "one decision span: {server:#?}");
    (server.into_iter().next().unwrap(), store)
}

/// A W3C traceparent: trace `t` (32 hex digits), parent span `p` (16), sampled or not.
fn traceparent(t: &str, p: &str, sampled: bool) -> String {
    format!("00-{t}-{p}-{}", if sampled { "01" } else { "00" })
}

const DOMAINS: &str = "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 2}\n      - key: trial\n        shadow_mode: true\n        rate_limit: {name: trial, unit: hour, requests_per_unit: 1}\n";

const SECRET: &str = "alice-secret-4711";

async fn post(base: &str, entries: &[(&str, &str)], traceparent: Option<String>) -> reqwest::Response {
    let mut r = reqwest::Client::new().post(format!("{base}/v1/ratelimit")).json(&body("d", entries));
    if let Some(t) = traceparent {
        r = r.header("traceparent", t).header("tracestate", "vendor=x");
    }
    r.send().await.unwrap()
}

/// Checks the decision's span continues `parent` and its store call is its child,
/// inside it in time; returns them.
fn continues(spans: Vec<Span>, parent: &str, calls: usize) -> (Span, Vec<Span>) {
    let (decision, store) = split(spans);
    assert_eq!(hex(&decision.parent_span_id), parent, "{decision:#?}");
    assert_eq!(decision.trace_state, "vendor=x");
    assert_eq!(decision.flags & 0x301, 0x301, "sampled, with a remote parent: {:#x}", decision.flags);
    assert_eq!(store.len(), calls, "{store:#?}");
    for call in &store {
        assert_eq!(call.parent_span_id, decision.span_id, "{call:#?}");
        assert_eq!(call.kind, SpanKind::Client as i32);
        assert!(decision.start_time_unix_nano <= call.start_time_unix_nano);
        assert!(call.start_time_unix_nano <= call.end_time_unix_nano);
        assert!(call.end_time_unix_nano <= decision.end_time_unix_nano);
    }
    (decision, store)
}

/// No span anywhere says `value`.
fn nowhere(spans: &[Span], value: &str) {
    for span in spans {
        let values = span.attributes.iter().filter_map(|a| a.value.as_ref()?.value.as_ref());
        for v in values {
            assert!(!format!("{v:?}").contains(value), "{value} on {span:#?}");
        }
    }
}

#[tokio::test]
async fn a_callers_trace_continues_through_the_decision_and_its_store_call() {
    let mut redis = RedisServer::start();
    let (collector, endpoint) = Collector::start().await;
    let config = format!(
        "log: {{format: json}}\nstore: {{kind: redis, url: '{}'}}\ntelemetry:\n  otlp: {{endpoint: '{endpoint}', sampling_ratio: 0}}\n",
        redis.url()
    );
    let s = start_with(&config, DOMAINS);
    let (p1, p2, p3) = ("00f067aa0ba902b7", "1111111111111111", "2222222222222222");
    let t = |i: u8| format!("4bf92f3577b34da6a3ce929d0e0e47{i:02}");

    // HTTP: allowed, then over the limit
    for i in 1..=2 {
        let r = post(&s.base, &[("user", SECRET)], Some(traceparent(&t(i), p1, true))).await;
        assert_eq!(r.status(), 200);
    }
    let r = post(&s.base, &[("user", SECRET)], Some(traceparent(&t(3), p2, true))).await;
    assert_eq!(r.status(), 429);
    // gRPC, the parent in the call's metadata (as Envoy sends it)
    let mut rls = RateLimitServiceClient::connect(format!("http://{}", s.grpc)).await.unwrap();
    let mut call = tonic::Request::new(RateLimitRequest {
        domain: "d".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry { key: "user".into(), value: "bob".into() }],
            ..Default::default()
        }],
        hits_addend: 0,
    });
    call.metadata_mut().insert("traceparent", traceparent(&t(4), p3, true).parse().unwrap());
    call.metadata_mut().insert("tracestate", "vendor=x".parse().unwrap());
    rls.should_rate_limit(call).await.unwrap();
    // not sampled by the caller; no caller (and a ratio of 0): neither is recorded
    assert_eq!(post(&s.base, &[("user", "carol")], Some(traceparent(&t(5), p1, false))).await.status(), 200);
    assert_eq!(post(&s.base, &[("user", "dave")], None).await.status(), 200);
    // a shadow-mode refusal is logged, with the caller's trace id
    for _ in 0..2 {
        post(&s.base, &[("trial", SECRET)], Some(traceparent(&t(6), p1, true))).await;
    }

    let (decision, store) = continues(collector.trace(&t(1), 2, || s.log()).await, p1, 1);
    assert_eq!(decision.name, "POST /v1/ratelimit");
    for (key, value) in [
        ("sluice.domain", string("d")),
        ("sluice.outcome", string("allowed")),
        ("sluice.store", string("redis")),
        ("sluice.degraded", Value::BoolValue(false)),
        ("http.response.status_code", Value::IntValue(200)),
        ("sluice.store.calls", Value::IntValue(1)),
    ] {
        assert_eq!(attr(&decision, key), value, "{key}");
    }
    let Value::IntValue(latency) = attr(&decision, "sluice.store.latency_us") else { panic!("an int") };
    let measured = (store[0].end_time_unix_nano - store[0].start_time_unix_nano) / 1_000;
    assert_eq!(latency as u64, measured);
    assert_eq!((store[0].name.as_str(), attr(&store[0], "sluice.store.op")), ("store apply", string("apply")));
    let (over, _) = continues(collector.trace(&t(3), 2, || s.log()).await, p2, 1);
    assert_eq!(attr(&over, "sluice.outcome"), string("over_limit"));
    assert_eq!(attr(&over, "http.response.status_code"), Value::IntValue(429));
    assert_eq!(attr(&over, "sluice.policy"), string("user"));
    let (grpc, _) = continues(collector.trace(&t(4), 2, || s.log()).await, p3, 1);
    assert_eq!(grpc.name, "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit");
    assert_eq!(attr(&grpc, "rpc.grpc.status_code"), Value::IntValue(0));
    assert_eq!(attr(&grpc, "sluice.outcome"), string("allowed"));
    // t(6) was sent after the unsampled ones: its spans came, theirs never will
    collector.trace(&t(6), 4, || s.log()).await;
    let all = collector.spans();
    assert!(all.iter().all(|sp| hex(&sp.trace_id) != t(5)), "a trace its caller did not sample was recorded");
    assert_eq!(all.len(), 12, "only the sampled decisions (six), two spans each: {all:#?}");
    nowhere(&all, SECRET);
    nowhere(&all, "bob");
    // the log line about the shadow refusal names the trace, and parses as JSON
    let line = s.log().lines().find(|l| l.contains("shadow mode")).map(str::to_string);
    let line: serde_json::Value = serde_json::from_str(&line.expect("a shadow mode line")).unwrap();
    assert_eq!(line["span"]["trace_id"], t(6), "{line}");

    // the store down: the failure policy decides, the span says so, its call failed
    redis.kill();
    let r = post(&s.base, &[("user", "erin")], Some(traceparent(&t(7), p1, true))).await;
    assert_eq!(r.status(), 200, "fail-open");
    let (degraded, store) = continues(collector.trace(&t(7), 2, || s.log()).await, p1, 1);
    assert_eq!(attr(&degraded, "sluice.degraded"), Value::BoolValue(true));
    assert_eq!(attr(&degraded, "sluice.failure"), string("fail-open"));
    let status = store[0].status.as_ref().expect("a status on the failed call");
    assert_eq!(status.code, StatusCode::Error as i32);
    assert!(!status.message.is_empty());
}

/// A request without a `traceparent` starts a trace (at ratio 1, every one), descriptor
/// values go on the span with `detailed: true`, the text log names the trace, and the
/// spans of the last decisions are sent when the server stops.
#[tokio::test]
async fn roots_details_and_the_last_spans_at_shutdown() {
    let (collector, endpoint) = Collector::start().await;
    let config = format!("telemetry:\n  otlp: {{endpoint: '{endpoint}', detailed: true}}\n");
    let s = start_with(&config, DOMAINS);
    for _ in 0..2 {
        post(&s.base, &[("trial", "frank")], None).await;
    }
    // stopped at once: the exporter's next tick has not come
    s.process.signal("-TERM");
    let started = Instant::now();
    let spans = loop {
        let spans = collector.spans();
        if spans.len() >= 4 {
            break spans;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{spans:#?}\n{}", s.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (decision, store) =
        split(spans.into_iter().filter(|sp| sp.trace_id == collector.spans()[0].trace_id).collect());
    assert!(decision.parent_span_id.is_empty(), "a root: {decision:#?}");
    assert_eq!(decision.flags & 0x300, 0, "no remote parent");
    assert_eq!(attr(&decision, "sluice.store"), string("memory"));
    let Value::ArrayValue(entries) = attr(&decision, "sluice.descriptors") else { panic!("an array") };
    assert_eq!(entries.values[0].value, Some(string("trial=frank")));
    assert_eq!(store.len(), 1);
    // the second request's shadow refusal, in the text log with its trace id
    let traces: Vec<String> = collector.spans().iter().map(|sp| hex(&sp.trace_id)).collect();
    let line = s.log().lines().find(|l| l.contains("shadow mode")).map(str::to_string).expect("a shadow line");
    assert!(traces.iter().any(|t| line.contains(&format!("trace_id={t}"))), "{line}\n{traces:?}");
}

/// OTLP/HTTP (`protocol: http`, envoyproxy/ratelimit's default, which Envoy Gateway
/// relies on): the spans reach `POST /v1/traces` as protobuf, on a resource with the
/// namespace and instance Envoy Gateway names.
#[tokio::test]
async fn traces_go_over_otlp_http() {
    let (collector, endpoint) = Collector::start_http().await;
    let config = format!(
        "telemetry:\n  otlp: {{endpoint: '{endpoint}', protocol: http, service_name: envoy-ratelimit, \
         service_namespace: envoy-gateway-system, service_instance_id: envoy-ratelimit-0}}\n"
    );
    let s = start_with(&config, DOMAINS);
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    post(&s.base, &[("user", "gail")], Some(traceparent(trace, "00f067aa0ba902b7", true))).await;
    let started = Instant::now();
    while !collector.spans_of("envoy-ratelimit").iter().any(|sp| hex(&sp.trace_id) == trace) {
        assert!(started.elapsed() < Duration::from_secs(10), "no span over OTLP/HTTP:\n{}", s.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let resource = collector.resource_of("envoy-ratelimit");
    for (key, value) in [("service.namespace", "envoy-gateway-system"), ("service.instance.id", "envoy-ratelimit-0")] {
        assert!(resource.contains(&(key.to_string(), Some(string(value)))), "{key}: {resource:?}");
    }
}

/// Without `telemetry`, a caller's trace id still reaches the log lines about its
/// request; and a collector that is down costs the decisions nothing: its failures are
/// counted and said once.
#[tokio::test]
async fn logs_name_the_callers_trace_and_a_dead_collector_costs_nothing() {
    let s = start_with("", DOMAINS);
    let t = "0af7651916cd43dd8448eb211c80319c";
    for _ in 0..2 {
        post(&s.base, &[("trial", "gina")], Some(traceparent(t, "b7ad6b7169203331", false))).await;
    }
    let line = s.log().lines().find(|l| l.contains("shadow mode")).map(str::to_string).expect("a shadow line");
    assert!(line.contains(&format!("trace_id={t}")), "{line}");

    // a port nothing listens on
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let dir = TempDir::new("sluice-test");
    let config = dir.path().join("sluice.yaml");
    let otlp = format!("telemetry:\n  otlp: {{endpoint: 'http://{closed}', timeout: 500ms}}\n");
    std::fs::write(&config, format!("{SERVER}{otlp}domains:\n{DOMAINS}")).unwrap();
    let (_process, http, _) = spawn(&config, dir.path());
    let base = format!("http://{http}");
    let started = Instant::now();
    for i in 0..300 {
        let r = post(&base, &[("user", &format!("u{i}"))], None).await;
        assert_eq!(r.status(), 200);
    }
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "300 decisions took {took:?}");
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    let log = || std::fs::read_to_string(dir.path().join("sluice.log")).unwrap_or_default();
    loop {
        let m = common::metrics(&client, &base).await;
        if m.lines().any(|l| l.starts_with("sluice_trace_exports_total{result=\"error\"}")) {
            break;
        }
        assert!(Instant::now() < deadline, "no failed export counted:\n{m}\n{}", log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(log().matches("traces: export failed").count(), 1, "{}", log());
}
