//! Kuadrant's rate limit service (`proto/kuadrantrls.proto`) on the gRPC listener, as
//! Kuadrant's gateway plugin calls it: `CheckRateLimit` charges nothing and refuses
//! what does not fit, `Report` charges and never refuses, `Reserve` holds an estimate and
//! `Commit` settles the actual once. The client's messages are declared from the proto,
//! field for field; Envoy's come from envoy-types.

mod common;
#[path = "common/kuadrant.rs"]
mod kuadrant;

use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use kuadrant::{CommitRequest, CommitResponse, ReserveRequest, ReserveResponse, Settled, call};

const DOMAINS: &str = "  - domain: llm
    descriptors:
      - key: user
        descriptors:
          - key: tokens
            rate_limit: {unit: minute, requests_per_unit: 100}
";

fn request(user: &str, hits: u32) -> RateLimitRequest {
    RateLimitRequest { hits_addend: hits, ..common::rls_request("llm", &[("user", user), ("tokens", "out")]) }
}

const OK: i32 = 1;
const OVER_LIMIT: i32 = 2;

#[tokio::test]
async fn kuadrants_service_checks_reports_reserves_and_commits() {
    let s = common::start(DOMAINS);
    let g = s.grpc.as_str();
    let check = |hits| call::<_, RateLimitResponse>(g, "CheckRateLimit", request("ann", hits));
    // a check charges nothing, however often
    for _ in 0..3 {
        assert_eq!(check(100).await.unwrap().overall_code, OK);
    }
    assert_eq!(check(101).await.unwrap().overall_code, OVER_LIMIT, "101 does not fit in 100");
    // a report is never refused, past the limit too
    let reported: RateLimitResponse = call(g, "Report", request("ann", 70)).await.unwrap();
    assert_eq!(reported.overall_code, OK);
    assert_eq!(check(30).await.unwrap().overall_code, OK);
    assert_eq!(check(31).await.unwrap().overall_code, OVER_LIMIT, "70 reported");
    // a reservation holds; what does not fit beside it is refused with nothing held
    let hold = |hits, ttl_s| ReserveRequest {
        request: Some(request("ann", hits)),
        ttl: Some(PbDuration { seconds: ttl_s, nanos: 0 }),
    };
    let r: ReserveResponse = call(g, "Reserve", hold(20, 30)).await.unwrap();
    assert_eq!(r.response.as_ref().unwrap().overall_code, OK);
    assert!(!r.reservation_id.is_empty());
    let refused: ReserveResponse = call(g, "Reserve", hold(11, 30)).await.unwrap();
    assert_eq!((refused.response.unwrap().overall_code, refused.reservation_id.as_str()), (OVER_LIMIT, ""));
    assert_eq!(check(10).await.unwrap().overall_code, OK);
    assert_eq!(check(11).await.unwrap().overall_code, OVER_LIMIT, "70 reported + 20 held");
    // the commit replaces the 20 held by 5, once
    let settle =
        |actual| CommitRequest { reservation_id: r.reservation_id.clone(), actual: Some(actual), actuals: vec![] };
    let done: CommitResponse = call(g, "Commit", settle(5)).await.unwrap();
    assert_eq!(done.settled, [Settled::Committed as i32]);
    let again: CommitResponse = call(g, "Commit", settle(5)).await.unwrap();
    assert_eq!(again.settled, [Settled::Again as i32]);
    assert_eq!(check(25).await.unwrap().overall_code, OK);
    assert_eq!(check(26).await.unwrap().overall_code, OVER_LIMIT, "70 + 5");
    // bad input: clear errors, nothing charged
    let forged = CommitRequest { reservation_id: "e30.00".into(), actual: Some(1), actuals: vec![] };
    let e = call::<_, CommitResponse>(g, "Commit", forged).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let e = call::<_, ReserveResponse>(g, "Reserve", hold(1, 7_200)).await.unwrap_err();
    assert!(e.message().contains("ttl"), "{e:?}");
    let e = call::<_, RateLimitResponse>(g, "Nothing", request("ann", 1)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");
    assert_eq!(check(25).await.unwrap().overall_code, OK);
}

/// The reservation's TTL ends it: an orphan holds nothing afterwards.
#[tokio::test]
async fn an_orphaned_reservation_is_released_at_its_ttl() {
    let s = common::start(DOMAINS);
    let g = s.grpc.as_str();
    let hold =
        ReserveRequest { request: Some(request("bo", 90)), ttl: Some(PbDuration { seconds: 0, nanos: 400_000_000 }) };
    let r: ReserveResponse = call(g, "Reserve", hold).await.unwrap();
    assert_eq!(r.response.unwrap().overall_code, OK);
    let check = || call::<_, RateLimitResponse>(g, "CheckRateLimit", request("bo", 50));
    assert_eq!(check().await.unwrap().overall_code, OVER_LIMIT);
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(check().await.unwrap().overall_code, OK, "released at 400 ms");
}
