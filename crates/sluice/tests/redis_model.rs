//! Property test: random operation sequences through a Redis store (a node, and a
//! cluster) and through the pure algorithms, under the same clock, give identical
//! answers. The Lua scripts are held to the model the memory store runs.

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use sluice::algo::Op;
use sluice::store::conformance::{self, LEASES, LIMITS, Step, op_on};
use sluice::store::redis::{RedisOptions, RedisStore};
use sluice_testkit::RedisServer;

/// Random steps: several ops of one client at once, peeks, refunds and releases, with
/// gaps that cross window and bucket boundaries.
fn step() -> impl Strategy<Value = Step> {
    let gap = prop_oneof![Just(0u64), 0u64..50, 0u64..2_500];
    let keys = 0..LIMITS.len() as u64;
    let ops = prop::collection::btree_map(keys.clone(), (0u64..4, prop::bool::weighted(0.2), 0u128..4), 1..4)
        .prop_map(|m| m.into_iter().map(|(k, (c, s, l))| op_on(k, c, s, l)).collect::<Vec<Op>>());
    prop_oneof![
        6 => (gap.clone(), 0usize..3, ops).prop_map(|(gap, client, ops)| Step::Apply { gap, client, ops }),
        2 => (gap.clone(), 0usize..3, prop::collection::btree_set(keys, 1..4)).prop_map(|(gap, client, s)| {
            Step::Peek { gap, client, ops: s.into_iter().map(|k| op_on(k, 0, false, 0)).collect() }
        }),
        1 => (gap.clone(), 0usize..3, 0..LEASES, 0u64..3)
            .prop_map(|(gap, client, key, cost)| Step::Refund { gap, client, op: op_on(key, cost, false, 0) }),
        1 => (gap, 0usize..3, 0u128..4).prop_map(|(gap, client, lease)| Step::Release { gap, client, key: LEASES, lease }),
    ]
}

#[test]
fn redis_decides_as_the_model() {
    let redis = RedisServer::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = rt.block_on(async { RedisStore::new(&redis.url(), &[], RedisOptions::default()).unwrap() });
    decide_alike(&rt, &store);
}

#[test]
fn redis_cluster_decides_as_the_model() {
    let cluster = sluice_testkit::RedisCluster::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = rt.block_on(async { RedisStore::cluster(&cluster.urls(), false, RedisOptions::default()).unwrap() });
    decide_alike(&rt, &store);
}

/// Random sequences through `store` and the pure model, compared answer by answer
/// ([`conformance::replay`], the suite's own harness), shrunk to the shortest failing
/// sequence when they differ.
fn decide_alike(rt: &tokio::runtime::Runtime, store: &RedisStore) {
    let mut runner = TestRunner::new(Config { cases: 96, ..Config::default() });
    runner
        .run(&prop::collection::vec(step(), 1..60), |steps| {
            let replayed = rt.block_on(conformance::replay(store, &steps));
            prop_assert!(replayed.is_ok(), "{}", replayed.unwrap_err());
            Ok(())
        })
        .unwrap();
}
