//! The adaptive stage of the tower layer in front of a service that can run ten
//! requests at once, each for 10 ms (a thread pool, in effect): offered half its
//! capacity, then three times, then half again, in real time.

// These measure wall-clock time itself (real servers, real waits): the OS's clock is
// what they judge (crates/sluice/clippy.toml bans it in the library).
#![allow(clippy::disallowed_types)]

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use sluice::algo::overload::GradientParams;
use sluice::layer::SluiceLayer;
use sluice::{DomainBuilder, Limiter, RulesBuilder};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tower::{Layer, ServiceExt};

const CAPACITY: usize = 10;
const SERVICE: Duration = Duration::from_millis(10);

/// What one request saw.
struct Seen {
    at: Duration,
    class: usize,
    status: u16,
    retry_after: Option<String>,
}

fn request(class: usize) -> Request<()> {
    let mut r = Request::builder().uri("/v1/charges");
    r = match class {
        0 => r.method(Method::GET).header("x-test-mode", "1"),
        1 => r.method(Method::GET),
        2 => r.method(Method::POST),
        _ => r.method(Method::POST).header("x-sluice-priority", "critical"),
    };
    r.body(()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_adaptive_stage_sheds_lower_classes_and_keeps_critical_traffic() {
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder().unwrap();
    let rules = RulesBuilder::new().domain(DomainBuilder::new("api")).build().unwrap();
    let layer = SluiceLayer::builder(Arc::new(Limiter::in_memory(rules)), "api")
        .adaptive(GradientParams::default())
        .unwrap()
        .build();
    let pool = Arc::new(Semaphore::new(CAPACITY));
    let svc = layer.clone().layer(tower::service_fn(move |_req: Request<()>| {
        let pool = pool.clone();
        async move {
            let _permit = pool.acquire().await.unwrap();
            tokio::time::sleep(SERVICE).await;
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("ok"))))
        }
    }));
    let capacity = CAPACITY as f64 / SERVICE.as_secs_f64(); // a second
    let schedule = [(0.5, 2.0), (3.0, 4.0), (0.5, 2.0)];
    let seen = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let (mut tasks, mut due, mut n, mut last) = (Vec::new(), 0.0, 0usize, 0.0);
    let mut limit_at_overload_end = None;
    for (load, seconds) in schedule {
        let until = start.elapsed().as_secs_f64() + seconds;
        while start.elapsed().as_secs_f64() < until {
            tokio::time::sleep(Duration::from_millis(1)).await;
            // offer what is due by now (the sleep may have taken longer than 1 ms)
            let now = start.elapsed().as_secs_f64();
            due += load * capacity * (now - last);
            last = now;
            while due >= 1.0 {
                due -= 1.0;
                n += 1;
                let class = [0, 1, 1, 2, 1, 0, 2, 1, 1, 3][n % 10];
                let (svc, seen) = (svc.clone(), seen.clone());
                tasks.push(tokio::spawn(async move {
                    let at = start.elapsed();
                    let r = svc.oneshot(request(class)).await.unwrap();
                    let status = r.status().as_u16();
                    let retry_after = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
                    let _ = r.into_body().collect().await;
                    seen.lock().unwrap().push(Seen { at, class, status, retry_after });
                }));
            }
        }
        if load > 1.0 {
            limit_at_overload_end = layer.adaptive_state();
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let seen = seen.lock().unwrap();
    let in_phase = |from: f64, to: f64| seen.iter().filter(move |s| (from..to).contains(&s.at.as_secs_f64()));
    let share_served = |from: f64, to: f64, class: usize| {
        let all: Vec<&Seen> = in_phase(from, to).filter(|s| s.class == class).collect();
        all.iter().filter(|s| s.status == 200).count() as f64 / all.len().max(1) as f64
    };
    let (limit, _, _) = limit_at_overload_end.unwrap();
    let offered = in_phase(2.0, 6.0).count();
    eprintln!(
        "offered {offered} in the overload ({:.0}/s); served: critical {:.3}, POST {:.3}, GET {:.3}, test {:.3}; limit {limit}",
        offered as f64 / 4.0,
        share_served(3.0, 6.0, 3),
        share_served(3.0, 6.0, 2),
        share_served(3.0, 6.0, 1),
        share_served(3.0, 6.0, 0)
    );
    assert!((5..=40).contains(&limit), "the limit at the end of the overload: {limit}");
    assert!(share_served(3.0, 6.0, 3) >= 0.97, "critical: {:.3} served", share_served(3.0, 6.0, 3));
    assert!(share_served(3.0, 6.0, 0) <= 0.5, "test mode: {:.3} served", share_served(3.0, 6.0, 0));
    for s in in_phase(0.0, 8.5).filter(|s| s.status != 200) {
        assert_eq!((s.status, s.retry_after.as_deref()), (503, Some("1")), "a refusal at {:?}", s.at);
    }
    let after: Vec<&Seen> = in_phase(6.5, 8.0).filter(|s| s.status != 200).collect();
    assert!(after.is_empty(), "{} refused after the load fell, the first at {:?}", after.len(), after[0].at);
    let text = metrics.render();
    assert!(text.contains("sluice_adaptive_limit "), "{text}");
    assert!(text.contains("sluice_shed_total{shedder=\"adaptive\",class=\"0\"}"), "{text}");
}

/// Reads a body the way hyper sends one: frames until `is_end_stream` says there are
/// no more (hyper never polls a whole body a second time, to see its end).
async fn read_as_hyper_does<B: http_body::Body + Unpin>(mut body: B) {
    while !body.is_end_stream() {
        match body.frame().await {
            Some(Ok(_)) => {}
            _ => return,
        }
    }
}

/// A response read as hyper reads it is a latency sample: the limit, held at its
/// initial 20 by requests 30 at a time, grows. (Once, it never did: only a body polled
/// to its `None` counted as finished, so behind hyper every response was ignored and
/// the limit never moved from where it started.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_as_hyper_sends_them_teach_the_limit() {
    let layer = SluiceLayer::adaptive_only();
    let svc = layer.clone().layer(tower::service_fn(|_req: Request<()>| async {
        tokio::time::sleep(Duration::from_millis(5)).await;
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("ok"))))
    }));
    let initial = layer.adaptive_state().unwrap().0;
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(600) {
        let round: Vec<_> = (0..30)
            .map(|i| {
                let svc = svc.clone();
                tokio::spawn(async move {
                    let r = svc.oneshot(request(i % 4)).await.unwrap();
                    read_as_hyper_does(r.into_body()).await;
                })
            })
            .collect();
        for t in round {
            t.await.unwrap();
        }
    }
    let (limit, in_flight, _) = layer.adaptive_state().unwrap();
    assert!(limit > initial, "the limit stayed at {limit}: no response counted as a sample");
    assert_eq!(in_flight, 0, "every slot is given back");
}
