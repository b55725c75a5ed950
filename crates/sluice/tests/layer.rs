//! The tower layer over a real service, under a manual clock: refusals (429 and 503,
//! bodies and headers), leases given back when a response is dropped, 304 refunds, and
//! the order of the limiters. Tokio's time is paused where the tests wait for the tasks that
//! give leases back: the wait runs them, and costs no wall-clock time.

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use sluice::algo::shedder::ShedderParams;
use sluice::layer::{Extract, SluiceLayer, SluiceLayerBuilder, Utilization};
use sluice::store::MemoryStore;
use sluice::time::ManualClock;
use sluice::{DomainBuilder, Limiter, RulesBuilder};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tower::{Layer, Service, ServiceExt};

fn limiter(clock: &ManualClock) -> Arc<Limiter> {
    let minute = Duration::from_secs(60);
    let rules = RulesBuilder::new()
        .domain(
            DomainBuilder::new("api")
                .rule([("user", None)], |r| {
                    r.fixed_window("core", 3, Duration::from_secs(3600)).concurrency("inflight", 1, minute)
                })
                .rule([("fleet", None)], |r| r.concurrency("fleet", 1, minute)),
        )
        .build()
        .unwrap();
    let rules = Arc::new(rules);
    Arc::new(Limiter::new(rules, Arc::new(MemoryStore::new(1000)), Arc::new(clock.clone())))
}

/// A service answering `status` (200 unless the request asks for another).
fn app()
-> impl Service<Request<()>, Response = Response<Full<Bytes>>, Error = Infallible, Future: Send> + Clone + Send + 'static
{
    tower::service_fn(|req: Request<()>| async move {
        let status = req.headers().get("x-answer").map_or(200, |v| v.to_str().unwrap().parse().unwrap());
        Ok::<_, Infallible>(Response::builder().status(status).body(Full::new(Bytes::from("hello"))).unwrap())
    })
}

fn get(user: &str) -> Request<()> {
    Request::builder().uri("/repos/a/b").header("x-user", user).body(()).unwrap()
}

fn layer(l: &Arc<Limiter>, clock: &ManualClock) -> SluiceLayerBuilder {
    SluiceLayer::builder(l.clone(), "api")
        .descriptor(vec![("user", Extract::Header("x-user".parse().unwrap()))])
        .clock(Arc::new(clock.clone()))
}

/// What a client's policies hold, read without charging.
async fn used(l: &Limiter, user: &str) -> (u64, u64) {
    let v = l.status(&sluice::Request::new("api").descriptor([("user", user)])).await.unwrap();
    let p = &v.descriptors[0].policies;
    (p[0].decision.used, p[1].decision.used)
}

#[tokio::test(start_paused = true)]
async fn over_the_limit_answers_429_problem_json_with_headers() {
    let clock = ManualClock::new(1_767_225_600_000);
    let l = limiter(&clock);
    let mut svc = layer(&l, &clock).build().layer(app());
    for left in ["2", "1", "0"] {
        let r = svc.ready().await.unwrap().call(get("ann")).await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-ratelimit-remaining"], left);
        assert_eq!(r.headers()["x-ratelimit-resource"], "core");
        assert_eq!(r.into_body().collect().await.unwrap().to_bytes(), "hello");
        // the lease goes back in a task once the body is done: let it run
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let r = svc.ready().await.unwrap().call(get("ann")).await.unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    assert_eq!(r.headers()["x-ratelimit-remaining"], "0");
    assert_eq!(r.headers()["retry-after"], "3600");
    let body: serde_json::Value = serde_json::from_slice(&r.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["status"], 429);
    assert!(body["type"].as_str().unwrap().ends_with("rate-limited"));
    assert!(body["detail"].as_str().unwrap().contains("core"));
}

#[tokio::test(start_paused = true)]
async fn a_dropped_response_gives_its_lease_back() {
    let clock = ManualClock::new(1_767_225_600_000);
    let l = limiter(&clock);
    let mut svc = layer(&l, &clock).build().layer(app());
    let held = svc.ready().await.unwrap().call(get("bo")).await.unwrap();
    assert_eq!(used(&l, "bo").await, (1, 1), "a lease is held while the response is");
    let r = svc.ready().await.unwrap().call(get("bo")).await.unwrap();
    assert_eq!(r.status(), 429, "concurrency limit 1");
    assert_eq!(used(&l, "bo").await, (1, 1), "refused by concurrency: the rate limit was not charged either");
    drop(held); // the client went away without reading the body
    tokio::task::yield_now().await;
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert_eq!(used(&l, "bo").await.1, 0, "the lease came back");
    let r = svc.ready().await.unwrap().call(get("bo")).await.unwrap();
    assert_eq!(r.status(), 200);
    // a body read to the end gives it back too
    r.into_body().collect().await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert_eq!(used(&l, "bo").await.1, 0);
}

#[tokio::test(start_paused = true)]
async fn a_304_costs_nothing() {
    let clock = ManualClock::new(1_767_225_600_000);
    let l = limiter(&clock);
    let mut svc = layer(&l, &clock).build().layer(app());
    for _ in 0..5 {
        let mut req = get("cy");
        req.headers_mut().insert("x-answer", "304".parse().unwrap());
        let r = svc.ready().await.unwrap().call(req).await.unwrap();
        assert_eq!(r.status(), 304);
        r.into_body().collect().await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert_eq!(used(&l, "cy").await, (0, 0), "refunded, and the lease given back");
}

/// Stripe's order: worker utilization shedder, fleet shedder, then the client's
/// concurrency and rate limits. A refusal at one stage leaves the later ones untouched.
#[tokio::test(start_paused = true)]
async fn the_limiters_apply_in_order_and_shedding_spares_critical_traffic() {
    // a recorder, to see the shed counters (this binary's only one)
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder().unwrap();
    let clock = ManualClock::new(1_767_225_600_000);
    let l = limiter(&clock);
    let utilization = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let u = utilization.clone();
    let gauge = Utilization::Gauge(Arc::new(move || f64::from_bits(u.load(std::sync::atomic::Ordering::Relaxed))));
    let mut svc = layer(&l, &clock)
        .worker_shedder(ShedderParams::default(), gauge)
        .fleet_shedder(l.clone(), "api")
        .seed(7)
        .build()
        .layer(app());

    // the fleet shedder: one non-critical request at a time fleet-wide; a second is
    // refused with 503 before the client's own limits are touched
    let held = svc.ready().await.unwrap().call(get("dee")).await.unwrap();
    assert_eq!(held.status(), 200);
    let r = svc.ready().await.unwrap().call(get("eve")).await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    assert_eq!(used(&l, "eve").await, (0, 0), "refused by the fleet shedder: nothing charged");
    // critical traffic does not pass through the fleet shedder
    let mut critical = get("eve");
    critical.headers_mut().insert("x-sluice-priority", "critical".parse().unwrap());
    let r = svc.ready().await.unwrap().call(critical).await.unwrap();
    assert_eq!(r.status(), 200);
    drop(r);
    drop(held);
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;

    // the worker utilization shedder: saturated for 3 minutes, it drops non-critical
    // requests before anything else is asked
    utilization.store(1.0f64.to_bits(), std::sync::atomic::Ordering::Relaxed);
    for _ in 0..180 {
        clock.advance(1_000);
        let mut c = get("fay");
        c.headers_mut().insert("x-sluice-priority", "critical".parse().unwrap());
        svc.ready().await.unwrap().call(c).await.unwrap(); // samples the controller each second
    }
    let (mut dropped, mut passed) = (0, 0);
    for _ in 0..20 {
        let r = svc.ready().await.unwrap().call(get("gus")).await.unwrap();
        if r.status() == 503 {
            dropped += 1;
        } else {
            passed += 1;
        }
    }
    assert_eq!((dropped, passed), (20, 0), "everything non-critical is shed");
    assert_eq!(used(&l, "gus").await, (0, 0), "shed before the client's limits were asked");
    let mut c = get("gus");
    c.headers_mut().insert("x-sluice-priority", "critical".parse().unwrap());
    assert_eq!(svc.ready().await.unwrap().call(c).await.unwrap().status(), 200, "critical is never shed");
    let text = metrics.render();
    assert!(text.contains("sluice_shed_total{shedder=\"worker\",class=\"1\"} 20"), "{text}");
    assert!(text.contains("sluice_shed_total{shedder=\"fleet\",class=\"1\"} 1"), "{text}");
    assert!(text.contains("sluice_shed_amount 1"), "{text}");
}

/// A budget metered by the layer: each request reserves its estimate (`x-max-tokens`),
/// refused with 429 when it does not fit beside what others hold; the response's cost,
/// from an `Actual` extension, an `x-sluice-actual` header or a trailer, replaces it;
/// a response that tells nothing is charged its estimate.
#[tokio::test]
async fn a_budget_reserves_the_estimate_and_commits_what_the_response_used() {
    let clock = ManualClock::new(sluice::store::conformance::t0());
    let rules = RulesBuilder::new()
        .domain(
            DomainBuilder::new("api")
                .rule([("user", None), ("budget", None)], |r| r.fixed_window("tokens", 1_000, Duration::from_secs(60))),
        )
        .build()
        .unwrap();
    let l = Arc::new(Limiter::new(Arc::new(rules), Arc::new(MemoryStore::new(1000)), Arc::new(clock.clone())));
    let estimate = |p: &http::request::Parts| {
        p.headers.get("x-max-tokens").and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(100)
    };
    let budget = vec![
        ("user", Extract::Header("x-user".parse().unwrap())),
        ("budget", Extract::Custom(Arc::new(|_: &http::request::Parts| Some("tokens".to_string())))),
    ];
    // the service answers its cost as the request asks: extension, header or trailer
    let app = tower::service_fn(|req: Request<()>| async move {
        let used: u64 = req.headers().get("x-used").map_or(0, |v| v.to_str().unwrap().parse().unwrap());
        let how = req.headers().get("x-how").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
        let mut trailers = http::HeaderMap::new();
        let mut r = Response::builder();
        match how.as_str() {
            "extension" => r = r.extension(sluice::layer::Actual(used)),
            "header" => r = r.header(sluice::layer::ACTUAL_HEADER, used),
            "trailer" => _ = trailers.insert(sluice::layer::ACTUAL_HEADER, used.into()),
            _ => {}
        }
        let frames = vec![
            Ok::<_, Infallible>(http_body::Frame::data(Bytes::from("tokens..."))),
            Ok(http_body::Frame::trailers(trailers)),
        ];
        Ok::<_, Infallible>(r.body(http_body_util::StreamBody::new(futures_util::stream::iter(frames))).unwrap())
    });
    let mut svc = SluiceLayer::builder(l.clone(), "api")
        .clock(Arc::new(clock.clone()))
        .budget(budget, estimate, Duration::from_secs(30))
        .build()
        .layer(app);
    let ask = |max: u64, used: u64, how: &str| {
        Request::builder()
            .header("x-user", "ann")
            .header("x-max-tokens", max)
            .header("x-used", used)
            .header("x-how", how)
            .body(())
            .unwrap()
    };
    let spent = || async {
        let v =
            l.status(&sluice::Request::new("api").descriptor([("user", "ann"), ("budget", "tokens")])).await.unwrap();
        v.descriptors[0].policies[0].decision.used
    };
    let settled = || async {
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
    };
    // held while the response streams; replaced by its cost when it ends
    let r = svc.ready().await.unwrap().call(ask(600, 250, "extension")).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(spent().await, 600, "the estimate is held while the response streams");
    let refused = svc.ready().await.unwrap().call(ask(500, 0, "")).await.unwrap();
    assert_eq!(refused.status(), 429, "600 held + 500 > 1000");
    assert!(refused.headers().contains_key("x-ratelimit-remaining"));
    r.into_body().collect().await.unwrap();
    settled().await;
    assert_eq!(spent().await, 250, "the extension's 250 replaced the 600 held");
    let r = svc.ready().await.unwrap().call(ask(300, 120, "header")).await.unwrap();
    assert!(!r.headers().contains_key(sluice::layer::ACTUAL_HEADER), "the layer takes its header off");
    r.into_body().collect().await.unwrap();
    let r = svc.ready().await.unwrap().call(ask(300, 400, "trailer")).await.unwrap();
    r.into_body().collect().await.unwrap();
    let r = svc.ready().await.unwrap().call(ask(50, 0, "")).await.unwrap();
    r.into_body().collect().await.unwrap();
    settled().await;
    assert_eq!(spent().await, 250 + 120 + 400 + 50, "header, trailer (past its estimate), and an estimate that stands");
}
