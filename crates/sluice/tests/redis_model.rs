//! Property test: random operation sequences through the memory store and a Redis store,
//! under the same clock, give identical decisions. The Lua scripts are held to the same
//! model the memory store runs.

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use sluice::algo::{Limit, Op};
use sluice::store::redis::{RedisOptions, RedisStore};
use sluice::store::{MemoryStore, Refund, Store};
use sluice::tag::Tag;
use sluice_testkit::RedisServer;

const LIMITS: [Limit; 6] = [
    Limit::FixedWindow { limit: 5, window: 2_000, aligned: false },
    Limit::FixedWindow { limit: 3, window: 1_000, aligned: true },
    Limit::TokenBucket { rate: 7, per: 3_000, burst: 4 },
    Limit::SlidingWindow { limit: 6, window: 1_500 },
    Limit::SlidingWindow { limit: 1, window: 700 },
    Limit::Concurrency { limit: 2, lease_ttl: 900 },
];

#[derive(Debug, Clone)]
enum Step {
    Apply { gap: u64, client: u8, ops: Vec<(usize, u64, bool, u8)> },
    Peek { gap: u64, client: u8, policies: Vec<usize> },
    Refund { gap: u64, client: u8, policy: usize, cost: u64 },
    Release { gap: u64, client: u8, lease: u8 },
}

fn step() -> impl Strategy<Value = Step> {
    let gap = prop_oneof![Just(0u64), 0u64..50, 0u64..2_500];
    prop_oneof![
        6 => (gap.clone(), 0u8..3, prop::collection::btree_map(0usize..6, (0u64..4, prop::bool::weighted(0.2), 0u8..4), 1..4))
            .prop_map(|(gap, client, m)| Step::Apply { gap, client, ops: m.into_iter().map(|(k, (c, s, l))| (k, c, s, l)).collect() }),
        2 => (gap.clone(), 0u8..3, prop::collection::btree_set(0usize..6, 1..4))
            .prop_map(|(gap, client, s)| Step::Peek { gap, client, policies: s.into_iter().collect() }),
        1 => (gap.clone(), 0u8..3, 0usize..5, 0u64..3).prop_map(|(gap, client, policy, cost)| Step::Refund { gap, client, policy, cost }),
        1 => (gap, 0u8..3, 0u8..4).prop_map(|(gap, client, lease)| Step::Release { gap, client, lease }),
    ]
}

fn op(key: usize, cost: u64, shadow: bool, lease: u8) -> Op {
    let limit = LIMITS[key];
    let is_lease = matches!(limit, Limit::Concurrency { .. });
    Op { key: key as u64, limit, cost, lease: is_lease.then_some(lease as u128), shadow }
}

#[test]
fn memory_and_redis_decide_alike() {
    let redis = RedisServer::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = rt.block_on(async { RedisStore::new(&redis.url(), &[], RedisOptions::default()).unwrap() });
    decide_alike(&rt, &store);
}

#[test]
fn memory_and_redis_cluster_decide_alike() {
    let cluster = sluice_testkit::RedisCluster::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = rt.block_on(async { RedisStore::cluster(&cluster.urls(), false, RedisOptions::default()).unwrap() });
    decide_alike(&rt, &store);
}

/// Random sequences through the memory store and `store`, compared decision by decision.
fn decide_alike(rt: &tokio::runtime::Runtime, store: &RedisStore) {
    let mut runner = TestRunner::new(Config { cases: 96, ..Config::default() });
    let case = std::sync::atomic::AtomicU64::new(0);
    runner
        .run(&prop::collection::vec(step(), 1..60), |steps| {
            let case = u128::from(case.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
            let memory = MemoryStore::new(10_000);
            // fresh clients per case, so cases do not see each other's state in Redis
            // spread over the 128 bits, so a cluster's clients land on many slots
            let tags: Vec<Tag> = (0..3)
                .map(|i| Tag(((case << 8) | i).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835)))
                .collect();
            let mut now = sluice::store::conformance::t0();
            rt.block_on(async {
                for (i, s) in steps.iter().enumerate() {
                    match s {
                        Step::Apply { gap, client, ops } => {
                            now += gap;
                            let ops: Vec<Op> = ops.iter().map(|&(k, c, sh, l)| op(k, c, sh, l)).collect();
                            let t = tags[*client as usize];
                            let (m, r) =
                                (memory.apply(t, &ops, now).await.unwrap(), store.apply(t, &ops, now).await.unwrap());
                            prop_assert_eq!(m, r, "apply at step {}", i);
                        }
                        Step::Peek { gap, client, policies } => {
                            now += gap;
                            let ops: Vec<Op> = policies.iter().map(|&k| op(k, 0, false, 0)).collect();
                            let t = tags[*client as usize];
                            let (m, r) =
                                (memory.peek(t, &ops, now).await.unwrap(), store.peek(t, &ops, now).await.unwrap());
                            prop_assert_eq!(m, r, "peek at step {}", i);
                        }
                        Step::Refund { gap, client, policy, cost } => {
                            now += gap;
                            let t = tags[*client as usize];
                            let o = op(*policy, 0, false, 0);
                            let window = memory.peek(t, &[o], now).await.unwrap()[0].reset_at;
                            let r = [Refund { key: o.key, limit: o.limit, cost: *cost, window }];
                            memory.refund(t, &r, now).await.unwrap();
                            store.refund(t, &r, now).await.unwrap();
                        }
                        Step::Release { gap, client, lease } => {
                            now += gap;
                            let t = tags[*client as usize];
                            let (m, r) = (
                                memory.release(t, &[5], *lease as u128, now).await.unwrap(),
                                store.release(t, &[5], *lease as u128, now).await.unwrap(),
                            );
                            prop_assert_eq!(m, r, "release at step {}", i);
                        }
                    }
                }
                Ok(())
            })
        })
        .unwrap();
}
