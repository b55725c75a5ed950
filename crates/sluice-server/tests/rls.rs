//! Envoy's rate limit service over gRPC, on the running binary: the same engine path as
//! the HTTP API (same counts, same headers), and its errors.

mod common;

use common::{hit, num, start};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

fn request(domain: &str, user: &str) -> RateLimitRequest {
    common::rls_request(domain, &[("user", user)])
}

#[tokio::test]
async fn should_rate_limit_shares_the_http_engine() {
    let s = start(
        "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 5}\n",
    );
    let mut rls = RateLimitServiceClient::connect(format!("http://{}", s.grpc)).await.unwrap();
    for left in (1..5).rev() {
        let r = rls.should_rate_limit(request("d", "envoy")).await.unwrap().into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);
        let status = &r.statuses[0];
        assert_eq!(status.limit_remaining, left);
        assert_eq!(status.current_limit.as_ref().unwrap().requests_per_unit, 5);
        assert!(status.duration_until_reset.as_ref().unwrap().seconds <= 60);
        let remaining = r.response_headers_to_add.iter().find(|h| h.key == "x-ratelimit-remaining").unwrap();
        assert_eq!(remaining.value, left.to_string(), "the same headers as the HTTP API");
    }
    // the HTTP API sees the same counter: the 5th request of the window
    let client = reqwest::Client::new();
    let r = hit(&client, &s.base, "d", &[("user", "envoy")]).await;
    assert_eq!((r.status().as_u16(), num(&r, "x-ratelimit-remaining")), (200, 0));
    let r = rls.should_rate_limit(request("d", "envoy")).await.unwrap().into_inner();
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
    assert!(r.response_headers_to_add.iter().any(|h| h.key == "retry-after"));
    // a descriptor no rule matches is allowed, as envoyproxy/ratelimit allows it
    let mut other = request("d", "x");
    other.descriptors[0].entries[0].key = "path".into();
    assert_eq!(rls.should_rate_limit(other).await.unwrap().into_inner().overall_code, Code::Ok as i32);
    // an unknown domain is OK with no limit, as envoyproxy/ratelimit answers it; an
    // empty one is an error, as there
    let r = rls.should_rate_limit(request("nope", "x")).await.unwrap().into_inner();
    assert_eq!((r.overall_code, r.statuses[0].current_limit.is_none()), (Code::Ok as i32, true));
    let e = rls.should_rate_limit(request("", "x")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("unknown domain ''"), "{}", e.message());
}

/// A message that does not decode is INVALID_ARGUMENT (INTERNAL would tell Envoy the
/// server is broken), and so is a unary call carrying two messages (it used to be
/// answered OK from the first); one good message still works.
#[tokio::test]
async fn malformed_calls_are_invalid_arguments() {
    use prost::Message;
    let s = start(
        "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 5}\n",
    );
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", s.grpc)).unwrap().connect().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    let path = http::uri::PathAndQuery::from_static("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit");
    let good = request("d", "raw").encode_to_vec();

    grpc.ready().await.unwrap();
    let ok = grpc.unary(tonic::Request::new(good.clone()), path.clone(), common::Raw).await;
    assert!(ok.is_ok(), "{ok:?}");

    grpc.ready().await.unwrap();
    let garbage = grpc.unary(tonic::Request::new(vec![0xff, 0xff, 0xff, 0x01]), path.clone(), common::Raw).await;
    let e = garbage.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    grpc.ready().await.unwrap();
    let two = futures_util::stream::iter(vec![good.clone(), good]);
    let e = grpc.client_streaming(tonic::Request::new(two), path, common::Raw).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("exactly one message"), "{e:?}");

    grpc.ready().await.unwrap();
    let other = http::uri::PathAndQuery::from_static("/envoy.service.ratelimit.v3.RateLimitService/Other");
    let e = grpc.unary(tonic::Request::new(request("d", "raw").encode_to_vec()), other, common::Raw).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");
}

/// `limiter.count_refused_hits`: a call that a `rate_limit:` rule refuses is charged its
/// hits all the same, as envoyproxy/ratelimit counts (limit 100: 90, then a report of 50
/// refused and counted, leaves nothing); the other `rate_limit:` rules of the call are
/// charged too, and a Sluice policy keeps all or nothing. Off (a config file's default),
/// the refused 50 cost nothing.
#[tokio::test]
async fn refused_hits_count_as_envoyproxy_ratelimit_counts_them() {
    let domains = "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 100}\n      - key: team\n        rate_limit: {unit: hour, requests_per_unit: 1000}\n      - key: org\n        policies:\n          - {name: own, fixed_window: {limit: 1000, window: 1h}}\n";
    // the last call asks 1 (Envoy's 0): counted refused where on, admitted where off
    for (on, left) in [(true, [0, 1000 - 141, 910]), (false, [9, 909, 909])] {
        let s = common::start_with(&format!("limiter:\n  count_refused_hits: {on}\n"), domains);
        let mut rls = RateLimitServiceClient::connect(format!("http://{}", s.grpc)).await.unwrap();
        let call = |hits: u32| {
            let d = |k: &str| RateLimitDescriptor {
                entries: vec![Entry { key: k.into(), value: "a".into() }],
                ..Default::default()
            };
            RateLimitRequest {
                domain: "d".into(),
                descriptors: vec![d("user"), d("team"), d("org")],
                hits_addend: hits,
            }
        };
        assert_eq!(rls.should_rate_limit(call(90)).await.unwrap().into_inner().overall_code, Code::Ok as i32);
        let r = rls.should_rate_limit(call(50)).await.unwrap().into_inner();
        assert_eq!(r.overall_code, Code::OverLimit as i32);
        let r = rls.should_rate_limit(call(0)).await.unwrap().into_inner();
        let got: Vec<u32> = r.statuses.iter().map(|s| s.limit_remaining).collect();
        assert_eq!(got, left, "count_refused_hits {on}: user, team (rate_limit), org (policies)");
    }
}

/// A rule's own `quota_mode` in a config file, asked over gRPC: a spent quota is marked
/// OVER_LIMIT in its status while the answer stays OK (another quota has room), the
/// dynamic metadata merges the `metadata` of the descriptors that passed only, and the
/// answer is OVER_LIMIT once every quota is spent; a rule beside them that is not in
/// quota mode refuses as ever.
#[tokio::test]
async fn a_rules_quota_mode_marks_what_is_spent_and_refuses_when_all_is() {
    let domains = "  - domain: d\n    descriptors:\n      - key: premium\n        quota_mode: true\n        metadata: {tier: premium}\n        rate_limit: {unit: hour, requests_per_unit: 1}\n      - key: standard\n        quota_mode: true\n        metadata: {tier: standard}\n        rate_limit: {unit: hour, requests_per_unit: 2}\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 5}\n";
    let s = common::start_with("envoy:\n  response_dynamic_metadata: true\n", domains);
    let mut rls = RateLimitServiceClient::connect(format!("http://{}", s.grpc)).await.unwrap();
    let call = |entries: &[(&str, &str)]| RateLimitRequest {
        domain: "d".into(),
        descriptors: entries
            .iter()
            .map(|(k, v)| RateLimitDescriptor {
                entries: vec![Entry { key: k.to_string(), value: v.to_string() }],
                ..Default::default()
            })
            .collect(),
        hits_addend: 0,
    };
    let both = [("premium", "a"), ("standard", "a")];
    let codes = |r: &RateLimitResponse| (r.overall_code, r.statuses.iter().map(|s| s.code).collect::<Vec<_>>());
    let tier = |r: &RateLimitResponse| {
        let meta = r.dynamic_metadata.as_ref().and_then(|m| m.fields.get("metadata"));
        let fields = meta.and_then(|m| match &m.kind {
            Some(envoy_types::pb::google::protobuf::value::Kind::StructValue(s)) => Some(s.fields.clone()),
            _ => None,
        });
        fields.and_then(|f| f.get("tier").cloned()).and_then(|v| match v.kind {
            Some(envoy_types::pb::google::protobuf::value::Kind::StringValue(t)) => Some(t),
            _ => None,
        })
    };
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    let mut ask = async |entries: &[(&str, &str)]| rls.should_rate_limit(call(entries)).await.unwrap().into_inner();
    let r = ask(&both).await;
    assert_eq!(codes(&r), (ok, vec![ok, ok]));
    assert_eq!(tier(&r).as_deref(), Some("premium"), "both passed: the first's value stays, as theirs");
    let r = ask(&both).await;
    assert_eq!(codes(&r), (ok, vec![over, ok]), "premium spent, standard left");
    assert_eq!(tier(&r).as_deref(), Some("standard"), "the metadata of what passed only");
    let r = ask(&both).await;
    assert_eq!(codes(&r), (over, vec![over, over]), "every quota spent");
    assert_eq!(r.statuses[1].limit_remaining, 0);
    // an enforced limit beside a quota with room refuses alone
    for _ in 0..5 {
        ask(&[("user", "a")]).await;
    }
    let r = ask(&[("user", "a"), ("standard", "b")]).await;
    assert_eq!(codes(&r), (over, vec![over, ok]), "the user's limit is enforced");
}
