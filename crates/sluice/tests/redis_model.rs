//! Property test: random operation sequences through a Redis store (a node, and a
//! cluster) and through the pure algorithms, under the same clock, give identical
//! answers. The Lua scripts are held to the model the memory store runs.

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use sluice::algo::Op;
use sluice::store::Store;
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

/// Decisions in flight at once share a script call (`store/redis/batch.rs`). A batch
/// must decide and store exactly what the same calls sent one by one, in that order,
/// would: random rounds of concurrent calls (several clients, all algorithms, shadow
/// ops, leases) go through a batching store on one Redis and one by one through
/// another, under one clock; every decision and every stored byte (fields, sorted sets,
/// expiry times) must match. Run with the calls made on the runtime that started the
/// store, and on another thread's single-threaded runtime (as the gRPC threads make
/// them), whose calls are queued and batched on that thread.
#[test]
fn a_batch_decides_and_stores_as_calls_one_by_one() {
    batches_decide_as_calls_one_by_one(false);
}

#[test]
fn a_batch_of_another_threads_calls_decides_and_stores_as_calls_one_by_one() {
    batches_decide_as_calls_one_by_one(true);
}

/// A multi-threaded runtime, and a store on `url` started on one of its threads: calls
/// made elsewhere on a single-threaded runtime are another thread's.
fn store_on_another_thread(url: &str, options: RedisOptions) -> (tokio::runtime::Runtime, RedisStore) {
    let home = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let url = url.to_string();
    let store = home.block_on(home.spawn(async move { RedisStore::new(&url, &[], options).unwrap() })).unwrap();
    (home, store)
}

fn batches_decide_as_calls_one_by_one(on_another_thread: bool) {
    let (a, b) = (RedisServer::start(), RedisServer::start());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let options = RedisOptions { buckets: 4, ..RedisOptions::default() };
    let (_home, batched) = match on_another_thread {
        true => {
            let (home, store) = store_on_another_thread(&a.url(), options.clone());
            (Some(home), store)
        }
        false => (None, rt.block_on(async { RedisStore::new(&a.url(), &[], options.clone()).unwrap() })),
    };
    let alone = rt.block_on(async { RedisStore::new(&b.url(), &[], options).unwrap().one_by_one() });
    let ops = prop::collection::btree_map(0..LIMITS.len() as u64, (0u64..4, prop::bool::weighted(0.2), 0u128..4), 1..4)
        .prop_map(|m| m.into_iter().map(|(k, (c, s, l))| op_on(k, c, s, l)).collect::<Vec<Op>>());
    let round = (prop_oneof![Just(0u64), 0u64..50, 0u64..2_500], prop::collection::vec((0u128..5, ops), 1..12));
    let mut runner = TestRunner::new(Config { cases: 32, ..Config::default() });
    runner
        .run(&prop::collection::vec(round, 1..20), |rounds| {
            for r in [&a, &b] {
                r.command("FLUSHALL").unwrap();
            }
            let (calls_a, calls_b) = (a.script_calls(), b.script_calls());
            let mut now = conformance::t0();
            let (mut sent, mut batches) = (0, 0);
            for (gap, calls) in &rounds {
                now += gap;
                let tag = |client: u128| sluice::tag::Tag(client * 0x9e37_79b9_7f4a_7c15 + 1);
                let together = rt.block_on(futures_util::future::join_all(
                    calls.iter().map(|(client, ops)| batched.apply(tag(*client), ops, now)),
                ));
                let mut apart = Vec::new();
                for (client, ops) in calls {
                    apart.push(rt.block_on(alone.apply(tag(*client), ops, now)));
                }
                prop_assert_eq!(&together, &apart, "decisions of the round {:?}", calls);
                sent += calls.len() as u64;
                batches += 1;
            }
            prop_assert_eq!(dump(&a), dump(&b), "what the two Redis servers store");
            // the batching store really batched: one script call per round
            prop_assert_eq!(a.script_calls() - calls_a, batches);
            prop_assert_eq!(b.script_calls() - calls_b, sent);
            Ok(())
        })
        .unwrap();
}

/// Another thread's queue has a task on that thread, which ends when the store is
/// dropped: then no task holds the store's connection, and it closes.
#[test]
fn another_threads_queue_ends_with_the_store() {
    let redis = RedisServer::start();
    let (home, store) = store_on_another_thread(&redis.url(), RedisOptions::default());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let tag = sluice::tag::Tag(7);
    let op = op_on(0, 1, false, 0);
    let calls = 16;
    let script_calls = redis.script_calls();
    let answers = rt.block_on(futures_util::future::join_all(
        (0..calls).map(|_| store.apply(tag, std::slice::from_ref(&op), conformance::t0())),
    ));
    let used: Vec<u64> = answers.iter().map(|a| a.as_ref().expect("decided")[0].used).collect();
    let cap = LIMITS[0].capacity();
    assert_eq!(used, (1..=calls).map(|n| n.min(cap)).collect::<Vec<u64>>(), "decided one after another, in order");
    assert!(redis.script_calls() - script_calls < calls, "batched on this thread");
    assert!(connections_to(redis.port()) > 0, "the store is connected");
    drop(store);
    // the task notices when this thread's runtime next runs; the connection then closes
    rt.block_on(async {
        for _ in 0..100 {
            if connections_to(redis.port()) == 0 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        panic!("the store's connection is still open");
    });
    drop(home);
}

/// Connections open to `port` on 127.0.0.1 (client sides, established), from
/// /proc/net/tcp: those of the store (a command of the test harness closes its own
/// before it returns).
fn connections_to(port: u16) -> usize {
    let tcp = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp (Linux)");
    let remote = format!("0100007F:{port:04X}");
    tcp.lines()
        .skip(1)
        .filter(|l| l.split_whitespace().nth(2) == Some(remote.as_str()) && l.split_whitespace().nth(3) == Some("01"))
        .count()
}

/// Every key of a Redis server with its value and absolute expiry, sorted.
fn dump(redis: &RedisServer) -> Vec<String> {
    let mut c = redis::Client::open(redis.url()).unwrap().get_connection().unwrap();
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut c).unwrap();
    keys.sort();
    keys.iter()
        .map(|k| {
            let kind: String = redis::cmd("TYPE").arg(k).query(&mut c).unwrap();
            let mut value: Vec<String> = match kind.as_str() {
                "hash" => redis::cmd("HGETALL").arg(k).query(&mut c).unwrap(),
                "zset" => redis::cmd("ZRANGE").arg(k).arg(0).arg(-1).arg("WITHSCORES").query(&mut c).unwrap(),
                other => vec![format!("unexpected type {other}")],
            };
            value.sort();
            let expires: i64 = redis::cmd("PEXPIRETIME").arg(k).query(&mut c).unwrap();
            format!("{k} {value:?} expires {expires}")
        })
        .collect()
}

/// A call that fails inside a batch answers its own error, and the calls before and
/// after it in the same script call are decided and stored as if it were not there:
/// the middle client's bucket is made a string, so its HGET fails with WRONGTYPE.
#[test]
fn a_failed_call_in_a_batch_answers_its_error_and_no_other() {
    let redis = RedisServer::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let options = RedisOptions { buckets: 4, ..RedisOptions::default() };
    let store = rt.block_on(async { RedisStore::new(&redis.url(), &[], options).unwrap() });
    let tag = |client: u128| sluice::tag::Tag(client * 0x9e37_79b9_7f4a_7c15 + 1);
    let op = op_on(0, 1, false, 0);
    let now = conformance::t0();
    // the bucket each client's state lands in: its first call creates it
    let bucket = |client: u128| {
        redis.command("FLUSHALL").unwrap();
        rt.block_on(store.apply(tag(client), std::slice::from_ref(&op), now)).unwrap();
        redis.command("KEYS *").unwrap().lines().find(|l| l.starts_with("s:")).unwrap().to_string()
    };
    let mut clients: Vec<(u128, String)> = Vec::new();
    for client in 0.. {
        let b = bucket(client);
        if clients.iter().all(|(_, seen)| *seen != b) {
            clients.push((client, b));
        }
        if clients.len() == 3 {
            break;
        }
    }
    redis.command("FLUSHALL").unwrap();
    redis.command(&format!("SET {} not-a-hash", clients[1].1)).unwrap();
    let before = redis.script_calls();
    let answers = rt.block_on(futures_util::future::join_all(
        clients.iter().map(|(client, _)| store.apply(tag(*client), std::slice::from_ref(&op), now)),
    ));
    assert_eq!(redis.script_calls() - before, 1, "the three calls went in one script call");
    for i in [0, 2] {
        let decided = answers[i].as_ref().expect("a call beside the failed one is decided");
        assert!(decided[0].allowed && decided[0].used == 1, "{decided:?}");
        assert!(redis.command(&format!("HLEN {}", clients[i].1)).unwrap().contains('1'), "its state is stored");
    }
    let failed = answers[1].as_ref().expect_err("the call on a string fails");
    assert!(failed.to_string().contains("WRONGTYPE"), "{failed}");
}

/// A token bucket retuned by a reload (a new rate, the same state) and then asked at
/// cost 0 writes back its refilled state with the expiry the new rate gives: the stored
/// expiry text is reused only when it equals the new one. Redis then decides as the
/// memory store does, which runs the pure algorithm.
#[test]
fn a_retuned_token_bucket_stores_the_expiry_its_new_rate_gives() {
    use sluice::algo::Limit;
    use sluice::store::MemoryStore;
    use sluice::tag::Tag;
    let redis = RedisServer::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = rt.block_on(async { RedisStore::new(&redis.url(), &[], RedisOptions::default()).unwrap() });
    let memory = MemoryStore::new(1_000);
    let (tag, t0) = (Tag(42), 1_800_000_000_000u64);
    let bucket = |rate| Op {
        key: 0,
        limit: Limit::TokenBucket { rate, per: 1_000, burst: 10 },
        cost: 0,
        lease: None,
        shadow: false,
    };
    let steps = [(Op { cost: 4, ..bucket(1) }, t0), (bucket(2), t0 + 300), (Op { cost: 1, ..bucket(2) }, t0 + 600)];
    for (i, (op, now)) in steps.iter().enumerate() {
        let (got, want) =
            rt.block_on(async { (store.apply(tag, &[*op], *now).await, memory.apply(tag, &[*op], *now).await) });
        assert_eq!(got.unwrap(), want.unwrap(), "step {i}: Redis and the model differ");
    }
}
