//! The service under test, behind nothing, Stripe's static shedders, or Sluice's
//! adaptive stage.

use axum::Router;
use axum::routing::any;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use sluice::algo::overload::GradientParams;
use sluice::algo::shedder::ShedderParams;
use sluice::layer::{SluiceLayer, Utilization};
use sluice::{DomainBuilder, Limiter, RulesBuilder};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// Serves until killed.
pub async fn run(capacity: usize, service_us: u64, front: &str) {
    let pool = Arc::new(Semaphore::new(capacity));
    let handler = move || {
        let pool = pool.clone();
        async move {
            let _slot = pool.acquire().await.unwrap();
            tokio::time::sleep(Duration::from_micros(service_us)).await;
            "ok"
        }
    };
    let app = Router::new().route("/", any(handler));
    let app = match front {
        "none" => app,
        "static" => app.layer(static_shedders(capacity)),
        "adaptive" => {
            let layer = adaptive();
            if std::env::var_os("OVERLOAD_TRACE").is_some() {
                tokio::spawn(trace(layer.clone()));
            }
            app.layer(layer)
        }
        other => super::fail(&format!("--front {other}: none, static or adaptive")),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!("listening {}", listener.local_addr().unwrap());
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let mut builder = Builder::new(TokioExecutor::new());
            builder.http2().max_concurrent_streams(1_000_000);
            let _ = builder.serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

/// Stripe's two static shedders as the docs describe them: the worker utilization
/// shedder on its defaults (shed past 80% of the workers busy, after 28 s), the
/// workers being the service's capacity; and the fleet usage shedder, which keeps a
/// fifth of the capacity for critical requests (the others take a lease of a
/// concurrency policy of 80% of it).
fn static_shedders(capacity: usize) -> SluiceLayer {
    let share = (capacity as u64 * 4 / 5).max(1);
    let rules = RulesBuilder::new()
        .domain(
            DomainBuilder::new("fleet")
                .rule([("fleet", None)], |r| r.concurrency("fleet", share, Duration::from_secs(60))),
        )
        .build()
        .unwrap();
    let limiter = Arc::new(Limiter::in_memory(rules));
    SluiceLayer::builder(limiter.clone(), "api")
        .worker_shedder(ShedderParams::default(), Utilization::InFlight(capacity))
        .fleet_shedder(limiter, "fleet")
        .build()
}

/// Sluice's adaptive stage on its defaults: nothing told about the service.
fn adaptive() -> SluiceLayer {
    let rules = RulesBuilder::new().domain(DomainBuilder::new("api")).build().unwrap();
    SluiceLayer::builder(Arc::new(Limiter::in_memory(rules)), "api")
        .adaptive(GradientParams::default())
        .unwrap()
        .build()
}

/// With `OVERLOAD_TRACE` set, the adaptive stage's limit, in flight and waiting every
/// 50 ms on stderr, to see how it follows a run.
async fn trace(layer: SluiceLayer) {
    let start = std::time::Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if let Some((limit, in_flight, waiting)) = layer.adaptive_state() {
            eprintln!("trace {} {limit} {in_flight} {waiting}", start.elapsed().as_millis());
        }
    }
}
