//! The tower layer's overhead per request: the same axum handler bare, behind
//! `SluiceLayer` (memory store, one fixed window that always admits), and behind the
//! same layer with its adaptive stage on, side by side in one run, called in process (no
//! network) so the layer's own cost shows.
//!
//! Run: `cargo bench -p sluice-server --bench layer`.

use axum::Router;
use axum::body::Body;
use axum::http::Request;
use axum::routing::get;
use criterion::{Criterion, criterion_group, criterion_main};
use sluice::layer::{Extract, SluiceLayer};
use sluice::{DomainBuilder, Limiter, RulesBuilder};
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;
use tower::ServiceExt;

fn requests(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let rules = RulesBuilder::new()
        .domain(
            DomainBuilder::new("api")
                .rule([("user", None)], |r| r.fixed_window("core", 1_000_000_000_000, Duration::from_secs(3600))),
        )
        .build()
        .unwrap();
    let limiter = Arc::new(Limiter::in_memory(rules));
    let shared = limiter.clone();
    let bare = Router::new().route("/", get(|| async { "hello" }));
    let layer = SluiceLayer::builder(limiter, "api")
        .descriptor(vec![("user", Extract::Header("x-user".parse().unwrap()))])
        .build();
    let limited = Router::new().route("/", get(|| async { "hello" })).route_layer(layer);
    let adaptive = SluiceLayer::builder(shared, "api")
        .descriptor(vec![("user", Extract::Header("x-user".parse().unwrap()))])
        .adaptive(sluice::algo::overload::GradientParams::default())
        .unwrap()
        .build();
    let adaptive = Router::new().route("/", get(|| async { "hello" })).route_layer(adaptive);
    let request =
        |i: u64| Request::builder().uri("/").header("x-user", format!("u{}", i % 1000)).body(Body::empty()).unwrap();
    let mut g = c.benchmark_group("layer");
    let mut i = 0u64;
    g.bench_function("bare_axum_handler", |b| {
        b.iter(|| {
            i += 1;
            black_box(rt.block_on(bare.clone().oneshot(request(i))).unwrap())
        })
    });
    g.bench_function("behind_sluice_layer", |b| {
        b.iter(|| {
            i += 1;
            black_box(rt.block_on(limited.clone().oneshot(request(i))).unwrap())
        })
    });
    g.bench_function("behind_sluice_layer_adaptive", |b| {
        b.iter(|| {
            i += 1;
            black_box(rt.block_on(adaptive.clone().oneshot(request(i))).unwrap())
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3)).sample_size(30);
    targets = requests
}
criterion_main!(benches);
