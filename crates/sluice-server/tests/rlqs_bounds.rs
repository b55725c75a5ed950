//! RLQS streams within bounds (`server.rlqs`, `rlqs.rs`): buckets per stream and per
//! instance, streams per peer, a deadline for the first report, malformed and absurd
//! reports, and fair parts among many streams of one bucket.

mod common;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy;
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::Streaming;

const DOMAINS: &str = "  - domain: edge\n    descriptors:\n      - key: name\n        policies:\n          - {name: per_window, fixed_window: {limit: 100000, window: 10s}}\n";

/// A report of `buckets` (bucket `name: N` each), each with these counts.
fn report(buckets: impl IntoIterator<Item = String>, allowed: u64, seconds: i64) -> RateLimitQuotaUsageReports {
    let usage = |name: String| BucketQuotaUsage {
        bucket_id: Some(BucketId { bucket: [("name".to_string(), name)].into() }),
        time_elapsed: Some(PbDuration { seconds, nanos: 0 }),
        num_requests_allowed: allowed,
        num_requests_denied: 0,
    };
    RateLimitQuotaUsageReports { domain: "edge".into(), bucket_quota_usages: buckets.into_iter().map(usage).collect() }
}

/// A stream open on `grpc`: where to send reports, and the answers.
async fn open(
    client: &mut RateLimitQuotaServiceClient<tonic::transport::Channel>,
) -> (mpsc::Sender<RateLimitQuotaUsageReports>, Streaming<RateLimitQuotaResponse>) {
    let (tx, rx) = mpsc::channel(4);
    let reports = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let answers = client.stream_rate_limit_quotas(reports).await.unwrap().into_inner();
    (tx, answers)
}

async fn client(s: &common::Sluice) -> RateLimitQuotaServiceClient<tonic::transport::Channel> {
    RateLimitQuotaServiceClient::connect(format!("http://{}", s.grpc)).await.unwrap()
}

/// How the stream ends: its status, within `limit`.
async fn ends(answers: &mut Streaming<RateLimitQuotaResponse>, limit: Duration) -> tonic::Status {
    let end = tokio::time::timeout(limit, async {
        loop {
            match answers.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => return tonic::Status::ok("ended"),
                Err(e) => return e,
            }
        }
    });
    end.await.expect("the stream did not end")
}

/// A report past `max_buckets_per_stream`, or past the instance's `max_buckets`, ends its
/// stream with RESOURCE_EXHAUSTED naming the bound, before any store call; a report of
/// 100,000 buckets (2.4 MB) is refused as it arrives, without the memory or the
/// seconds it cost (836 MB and 35 s before).
#[tokio::test]
async fn reports_past_the_bucket_bounds_are_refused() {
    let s = common::start_with("  rlqs: {max_buckets_per_stream: 100, max_buckets: 150}\n", DOMAINS);
    let mut c = client(&s).await;
    let (tx, mut answers) = open(&mut c).await;
    tx.send(report((0..101).map(|i| format!("b{i}")), 1, 1)).await.unwrap();
    let e = ends(&mut answers, Duration::from_secs(2)).await;
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("server.rlqs.max_buckets_per_stream (100)"), "{e:?}");
    // two streams of 100 buckets: the second passes the instance's 150
    let (tx1, mut a1) = open(&mut c).await;
    tx1.send(report((0..100).map(|i| format!("x{i}")), 1, 1)).await.unwrap();
    assert!(a1.message().await.unwrap().is_some(), "the first stream is answered");
    let (tx2, mut a2) = open(&mut c).await;
    tx2.send(report((0..100).map(|i| format!("y{i}")), 1, 1)).await.unwrap();
    let e = ends(&mut a2, Duration::from_secs(2)).await;
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("server.rlqs.max_buckets (150)"), "{e:?}");
    let scrape = common::metrics(&reqwest::Client::new(), &s.base).await;
    assert_eq!(common::series(&scrape, "sluice_rlqs_buckets{domain=\"edge\"}"), 100.0, "{scrape}");
    // 100,000 buckets in one message
    let rss = common::rss_of(s.process.pid());
    let (tx3, mut a3) = open(&mut c).await;
    let started = std::time::Instant::now();
    tx3.send(report((0..100_000).map(|i| format!("bucket-{i:08}")), 1, 1)).await.unwrap();
    let e = ends(&mut a3, Duration::from_secs(3)).await;
    assert!(e.code() != tonic::Code::Ok, "{e:?}");
    assert!(started.elapsed() < Duration::from_secs(2), "refused after {:?}", started.elapsed());
    let grown = common::rss_of(s.process.pid()).saturating_sub(rss);
    assert!(grown < 64 << 20, "RSS grew {} MB", grown >> 20);
    drop((tx, tx1, tx2, tx3));
}

/// Streams that open and send nothing are counted (under no domain) and ended at
/// `server.header_timeout` with DEADLINE_EXCEEDED; streams past `max_streams_per_peer`
/// are refused at once.
#[tokio::test]
async fn silent_streams_are_counted_and_ended() {
    let s = common::start_with("  header_timeout: 1s\n  rlqs: {max_streams_per_peer: 40}\n", DOMAINS);
    let mut c = client(&s).await;
    let mut open_streams = Vec::new();
    for _ in 0..40 {
        open_streams.push(open(&mut c).await);
    }
    let scrape = common::metrics(&reqwest::Client::new(), &s.base).await;
    assert_eq!(common::series(&scrape, "sluice_rlqs_streams{domain=\"\"}"), 40.0, "{scrape}");
    let (_tx, rx) = mpsc::channel::<RateLimitQuotaUsageReports>(1);
    let reports = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let e = c.stream_rate_limit_quotas(reports).await.expect_err("a 41st stream from one peer");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("server.rlqs.max_streams_per_peer (40)"), "{e:?}");
    for (_tx, answers) in &mut open_streams {
        let e = ends(answers, Duration::from_secs(3)).await;
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
    }
    let scrape = common::metrics(&reqwest::Client::new(), &s.base).await;
    assert_eq!(common::series(&scrape, "sluice_rlqs_streams{domain=\"\"}"), 0.0, "{scrape}");
    // their places are free again
    let (tx, mut answers) = open(&mut c).await;
    tx.send(report(["hot".to_string()], 1, 1)).await.unwrap();
    assert!(answers.message().await.unwrap().is_some());
}

/// A message that does not decode ends the stream with INVALID_ARGUMENT (it ended with
/// OK); absurd counts (u64 max) and times (i64 max seconds) are capped: the counters do
/// not wrap, the assignment's TTL stays sane, and the server stays up.
#[tokio::test]
async fn malformed_and_absurd_reports() {
    let s = common::start(DOMAINS);
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", s.grpc)).unwrap().connect().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    let path = http::uri::PathAndQuery::from_static(
        "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas",
    );
    grpc.ready().await.unwrap();
    let garbage = futures_util::stream::iter(vec![vec![0xff, 0xff, 0xff, 0x01]]);
    let answer = grpc.streaming(tonic::Request::new(garbage), path, common::Raw).await;
    let e = match answer {
        Err(e) => e,
        Ok(r) => {
            let mut answers = r.into_inner();
            tokio::time::timeout(Duration::from_secs(2), answers.message()).await.unwrap().unwrap_err()
        }
    };
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    let mut c = client(&s).await;
    for _ in 0..2 {
        let (tx, mut answers) = open(&mut c).await;
        tx.send(report(["absurd".to_string()], u64::MAX, i64::MAX)).await.unwrap();
        let answer = answers.message().await.unwrap().unwrap();
        let Some(Action::QuotaAssignmentAction(a)) = &answer.bucket_action[0].bucket_action else {
            panic!("{answer:?}")
        };
        let ttl = a.assignment_time_to_live.unwrap().seconds;
        assert!((1..=10).contains(&ttl), "a TTL of {ttl} s");
    }
    let scrape = common::metrics(&reqwest::Client::new(), &s.base).await;
    let reported = common::series(&scrape, "sluice_rlqs_requests_reported_total{domain=\"edge\",outcome=\"allowed\"}");
    assert_eq!(reported, 2.0 * f64::from(u32::MAX), "{scrape}");
}

/// 200 streams of one bucket on one instance: once they are all there, each window's
/// assignments give every stream a token bucket, the largest rate at most three times
/// the smallest (before, the first few to tick took the window and the rest got
/// DENY_ALL).
#[tokio::test]
async fn many_streams_of_one_bucket_get_fair_parts() {
    let s = common::start_with("  rlqs: {max_streams_per_peer: 1000}\n", DOMAINS.replace("100000", "20000").as_str());
    let mut c = client(&s).await;
    let mut streams = Vec::new();
    for _ in 0..200 {
        let (tx, answers) = open(&mut c).await;
        tx.send(report(["hot".to_string()], 0, 0)).await.unwrap();
        streams.push((tx, answers));
    }
    // the first assignments, in arrival order, in the window the first one started
    let mut started = None;
    for (_tx, answers) in &mut streams {
        answers.message().await.unwrap().unwrap();
        started.get_or_insert_with(std::time::Instant::now);
    }
    // the next window starts 10 s after the first: every stream is sent its share then
    let sample = started.unwrap() + Duration::from_millis(11_500);
    tokio::time::sleep_until(sample.into()).await;
    let mut rates = Vec::new();
    for (_tx, answers) in &mut streams {
        let mut last = None;
        while let Ok(Ok(Some(answer))) = tokio::time::timeout(Duration::from_millis(50), answers.message()).await {
            last = Some(answer);
        }
        let answer = last.expect("no assignment at the next window's start");
        let Some(Action::QuotaAssignmentAction(a)) = &answer.bucket_action[0].bucket_action else {
            panic!("{answer:?}")
        };
        match a.rate_limit_strategy.as_ref().and_then(|r| r.strategy.as_ref()) {
            Some(Strategy::TokenBucket(b)) => rates.push(b.tokens_per_fill.unwrap().value),
            other => panic!("a stream was sent {other:?}"),
        }
    }
    // each takes a 200th of what is left, one after another, for a piece of 7 s of the
    // 10 s window: the last finds about e^(-7/10) of what the first found
    let (min, max) = (*rates.iter().min().unwrap(), *rates.iter().max().unwrap());
    assert!(min >= 1 && max <= 3 * min, "rates from {min} to {max}: {rates:?}");
}

/// Past `max_streams`, a new stream is refused at once, whoever opens it, naming the
/// bound; a stream that ends frees its place.
#[tokio::test]
async fn streams_past_the_instance_bound_are_refused() {
    let s = common::start_with("  rlqs: {max_streams: 3}\n", DOMAINS);
    let mut c = client(&s).await;
    let mut open_streams = Vec::new();
    for i in 0..3 {
        let (tx, mut answers) = open(&mut c).await;
        tx.send(report([format!("b{i}")], 1, 1)).await.unwrap();
        assert!(answers.message().await.unwrap().is_some(), "stream {i} is served");
        open_streams.push((tx, answers));
    }
    let (_tx, rx) = mpsc::channel::<RateLimitQuotaUsageReports>(1);
    let reports = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let e = c.stream_rate_limit_quotas(reports).await.expect_err("a fourth stream");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("server.rlqs.max_streams (3)"), "{e:?}");
    // one ends: its place is free again
    drop(open_streams.pop());
    let started = std::time::Instant::now();
    loop {
        let (tx, mut answers) = open(&mut c).await;
        if tx.send(report(["again".to_string()], 1, 1)).await.is_ok()
            && let Ok(Some(_)) = answers.message().await
        {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(3), "the place was never given back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
