//! Memory-store decisions side by side with governor's keyed limiter, in one run.
//!
//! Both sides always admit (quotas far above the request rate), so the steady-state
//! check is measured: a time read, a keyed lookup, the algorithm, a write. Sluice's tag is
//! computed once per client, as the engine caches it per request; the `engine` group
//! measures the whole `Limiter::check` path (descriptor matching, keyed hashing, the
//! future) for comparison.
//!
//! The `adaptive` group measures the adaptive stage's decision: taking a slot of the
//! learned limit and giving it back with the request's latency, under the lock the tower
//! layer takes (the time read included).
//!
//! Run: `cargo bench -p sluice --bench memory_store`.

// A benchmark measures wall-clock time: the OS's clock is what it reads
// (crates/sluice/clippy.toml bans it in the library).
#![allow(clippy::disallowed_types)]

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use governor::{Quota, RateLimiter};
use sluice::Request;
use sluice::algo::{Limit, Op};
use sluice::store::MemoryStore;
use sluice::tag::{Tag, Tagger};
use sluice::time::{Clock, CoarseClock, SystemClock};
use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

const TB: Limit = Limit::TokenBucket { rate: 1_000_000_000, per: 1_000, burst: 1_000_000_000 };
const FW: Limit = Limit::FixedWindow { limit: 1 << 50, window: 3_600_000, aligned: false };

fn tags(n: usize) -> Vec<Tag> {
    let t = Tagger::new("bench");
    (0..n).map(|i| t.tag("bench", "user", &i.to_string())).collect()
}

fn governor_limiter<K: std::hash::Hash + Eq + Clone>() -> governor::DefaultKeyedRateLimiter<K> {
    RateLimiter::keyed(Quota::per_second(NonZeroU32::MAX))
}

/// Runs `iters` checks split over `threads` threads; returns the wall time.
fn spread(iters: u64, threads: u64, f: impl Fn(u64) + Sync) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let f = &f;
            s.spawn(move || {
                for i in 0..iters / threads {
                    f(i * threads + t);
                }
            });
        }
    });
    start.elapsed()
}

thread_local! {
    static OUT: std::cell::RefCell<Vec<sluice::algo::Decision>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn decisions(c: &mut Criterion) {
    c.bench_function("clock/system", |b| b.iter(|| black_box(SystemClock.now())));
    c.bench_function("clock/coarse", |b| b.iter(|| black_box(CoarseClock.now())));
    let clocks: [(&str, &dyn Clock); 2] = [("system", &SystemClock), ("coarse", &CoarseClock)];
    for (algo, limit) in [("token_bucket", TB), ("fixed_window", FW)] {
        let mut g = c.benchmark_group(format!("memory/{algo}"));
        g.throughput(Throughput::Elements(1));
        for keys in [1usize, 100_000] {
            for threads in [1u64, 2] {
                let id = format!("{keys}keys/{threads}threads");
                let store = MemoryStore::new(1_000_000);
                let tags = tags(keys);
                for (clock_name, clock) in clocks {
                    g.bench_function(BenchmarkId::new(format!("sluice-{clock_name}-clock"), &id), |b| {
                        b.iter_custom(|iters| {
                            spread(iters, threads, |i| {
                                // a caller on the fast path keeps its decision buffer
                                OUT.with_borrow_mut(|out| {
                                    out.clear();
                                    let op = Op { key: 1, limit, cost: 1, lease: None, shadow: false };
                                    store.apply_into(tags[i as usize % keys], &[op], clock.now(), out).expect("room");
                                    black_box(&out[0]);
                                })
                            })
                        })
                    });
                }
                if algo == "token_bucket" {
                    // governor's best case: the caller hands it a u64
                    let gov = governor_limiter::<u64>();
                    g.bench_function(BenchmarkId::new("governor-u64-key", &id), |b| {
                        b.iter_custom(|iters| {
                            spread(iters, threads, |i| {
                                let _ = black_box(gov.check_key(&(i % keys as u64)));
                            })
                        })
                    });
                    // the same key material Sluice's store gets: a 128-bit client tag
                    let gov = governor_limiter::<u128>();
                    g.bench_function(BenchmarkId::new("governor-u128-key", &id), |b| {
                        b.iter_custom(|iters| {
                            spread(iters, threads, |i| {
                                let _ = black_box(gov.check_key(&tags[i as usize % keys].0));
                            })
                        })
                    });
                }
            }
        }
        g.finish();
    }
}

fn engine(c: &mut Criterion) {
    // one fixed window per second that never refuses: the engine's own cost
    let rules = sluice::RulesBuilder::new()
        .domain(
            sluice::DomainBuilder::new("bench")
                .rule([("user", None)], |r| r.fixed_window("per_second", 1 << 40, Duration::from_secs(1))),
        )
        .build()
        .unwrap();
    let limiter = sluice::Limiter::new(Arc::new(rules), Arc::new(MemoryStore::new(1_000_000)), Arc::new(SystemClock));
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let requests: Vec<Request> =
        (0..1000).map(|i| Request::new("bench").descriptor([("user", format!("user-{i}"))])).collect();
    let mut g = c.benchmark_group("engine");
    g.throughput(Throughput::Elements(1));
    let mut i = 0;
    g.bench_function("check/fixed_window/1000keys", |b| {
        b.iter(|| {
            i = (i + 1) % requests.len();
            black_box(rt.block_on(limiter.check(&requests[i])).unwrap())
        })
    });
    g.finish();
}

fn adaptive(c: &mut Criterion) {
    use sluice::algo::overload::{Admission, Entry, GradientParams, Outcome};
    let epoch = Instant::now();
    let admission = std::sync::Mutex::new(Admission::<()>::new(GradientParams::default(), 4, 0));
    let mut g = c.benchmark_group("adaptive");
    g.throughput(Throughput::Elements(1));
    g.bench_function("enter_and_finish", |b| {
        b.iter(|| {
            let now = epoch.elapsed().as_micros() as u64;
            let entry = admission.lock().unwrap().enter(3, now, ());
            assert!(matches!(entry, Entry::Run));
            let done = epoch.elapsed().as_micros() as u64;
            black_box(admission.lock().unwrap().finish(done, done - now + 1_000, Outcome::Served))
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2)).sample_size(30);
    targets = decisions, engine, adaptive
}
criterion_main!(benches);
