//! The Redis stores against the conformance suite, on real redis-server processes.

// These measure wall-clock time itself (real servers, real waits): the OS's clock is
// what they judge (crates/sluice/clippy.toml bans it in the library).
#![allow(clippy::disallowed_types)]

use sluice::store::redis::{RedisOptions, RedisStore, ShardedRedisStore};
use sluice_testkit::RedisServer;

fn options() -> RedisOptions {
    RedisOptions { timeout: std::time::Duration::from_secs(2), ..RedisOptions::default() }
}

sluice::conformance_suite!(redis_node, async {
    let redis = RedisServer::start();
    (RedisStore::new(&redis.url(), &[], options()).unwrap(), redis)
});

// Peeks go to the replica. Each write waits until the replica has it (`replica_acks: 1`),
// so a peek right after a write sees it, as the suite demands.
sluice::conformance_suite!(redis_with_replica, async {
    let primary = RedisServer::start();
    let replica = RedisServer::replica_of(&primary);
    let opts = RedisOptions { replica_acks: 1, ..options() };
    (RedisStore::new(&primary.url(), &[replica.url()], opts).unwrap(), (primary, replica))
});

sluice::conformance_suite!(redis_sharded, async {
    let (a, b) = (RedisServer::start(), RedisServer::start());
    let shards =
        vec![RedisStore::new(&a.url(), &[], options()).unwrap(), RedisStore::new(&b.url(), &[], options()).unwrap()];
    (ShardedRedisStore::new(shards), (a, b))
});

// A six-node Redis Cluster (three primaries, three replicas): every client's keys share a
// hash tag, so each script runs on the one node owning the client's slot.
sluice::conformance_suite!(redis_cluster, async {
    let cluster = sluice_testkit::RedisCluster::start();
    (RedisStore::cluster(&cluster.urls(), false, options()).unwrap(), cluster)
});

// Behind Sentinel: the primary and a replica for peeks found by asking a Sentinel (one
// here; the failover test in sluice-server's tests/sentinel.rs runs three). Each write
// waits for the replica, so a peek right after it sees it.
sluice::conformance_suite!(redis_sentinel, async {
    let set = sluice_testkit::RedisSentinels::start(1, 1, 5_000);
    let sentinel = sluice::store::redis::SentinelOptions {
        sentinels: set.addrs(),
        master_name: sluice_testkit::RedisSentinels::MASTER.into(),
        read_from_replicas: true,
        ..Default::default()
    };
    let opts = RedisOptions { replica_acks: 1, ..options() };
    (RedisStore::sentinel(&sentinel, opts).unwrap(), set)
});

// envoyproxy/ratelimit's REDIS_PERSECOND: one-second windows on a Redis of their own
sluice::conformance_suite!(redis_per_second, async {
    let (main, second) = (RedisServer::start(), RedisServer::start());
    let store = |r: &RedisServer| {
        std::sync::Arc::new(RedisStore::new(&r.url(), &[], options()).unwrap())
            as std::sync::Arc<dyn sluice::store::Store>
    };
    (sluice::store::PerSecondStore::new(store(&main), store(&second)), (main, second))
});

/// A charge of one on a client's window of 10 a minute.
fn ten_a_minute() -> sluice::algo::Op {
    let limit = sluice::algo::Limit::FixedWindow { limit: 10, window: 60_000, aligned: false };
    sluice::algo::Op { key: 1, limit, cost: 1, lease: None, shadow: false }
}

/// While every Sentinel holds the primary down, no call goes to its address: the store
/// says so at once, rather than connect to whatever answers there next (a primary
/// started again empty, before the Sentinels demote it, would take writes the fleet then
/// loses). Once a Sentinel holds it up again (here: started again, with nothing to
/// promote in its place), the store follows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_the_sentinels_hold_down_gets_no_calls() {
    use sluice::store::Store;
    use std::time::{Duration, Instant};
    // no replica: the Sentinels cannot promote one, and hold the primary down until it is back
    let mut set = sluice_testkit::RedisSentinels::start(0, 3, 1_000);
    let sentinel = sluice::store::redis::SentinelOptions {
        sentinels: set.addrs(),
        master_name: sluice_testkit::RedisSentinels::MASTER.into(),
        ..Default::default()
    };
    let store = RedisStore::sentinel(&sentinel, options()).unwrap();
    let op = ten_a_minute();
    let (t, t0) = (sluice::store::conformance::fresh_tag(), sluice::store::conformance::t0());
    assert!(store.apply(t, &[op], t0).await.unwrap()[0].allowed);

    set.primary.kill();
    let down = |flags: &str| flags.contains("s_down");
    let flags = |s: &sluice_testkit::SentinelServer| {
        let reply = s.cli(&["SENTINEL", "MASTER", sluice_testkit::RedisSentinels::MASTER]);
        reply.lines().skip_while(|l| *l != "flags").nth(1).unwrap_or_default().to_string()
    };
    let killed = Instant::now();
    while !set.sentinels.iter().all(|s| down(&flags(s))) {
        assert!(killed.elapsed() < Duration::from_secs(20), "the Sentinels never held the primary down");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // a call that still had the old address fails there and drops it; the next asks
    let mut said = Vec::new();
    for _ in 0..3 {
        let e = store.apply(t, &[op], t0).await.unwrap_err().to_string();
        if e.contains("the Sentinels hold it down") {
            break;
        }
        said.push(e);
    }
    assert!(said.len() < 3, "calls still went to the primary's address: {said:?}");

    set.primary.restart();
    let restarted = Instant::now();
    loop {
        if let Ok(d) = store.apply(t, &[op], t0).await {
            assert!(d[0].allowed, "{d:?}");
            break;
        }
        assert!(restarted.elapsed() < Duration::from_secs(20), "the store never followed the primary back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// While a node stalls (SIGSTOP), the calls queued for it are bounded: past 20,000
/// waiting, a call fails at once saying why (the failure policy then decides it), where
/// the queue grew with the arrival rate before. Once the node answers, those queued are
/// answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_node_queues_a_bounded_number_of_calls() {
    use sluice::store::Store;
    use std::time::{Duration, Instant};
    let redis = RedisServer::start();
    let opts = RedisOptions { timeout: Duration::from_secs(5), ..options() };
    let store = std::sync::Arc::new(RedisStore::new(&redis.url(), &[], opts).unwrap());
    let op = ten_a_minute();
    let t0 = sluice::store::conformance::t0();
    assert!(store.apply(sluice::store::conformance::fresh_tag(), &[op], t0).await.unwrap()[0].allowed);
    redis.signal("-STOP");
    const CALLS: usize = 25_000;
    let calls: Vec<_> = (0..CALLS)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                let started = Instant::now();
                let answer = store.apply(sluice::store::conformance::fresh_tag(), &[op], t0).await;
                (started.elapsed(), answer.err().map(|e| e.to_string()))
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    redis.signal("-CONT");
    let (mut full, mut answered, mut other) = (0, 0, Vec::new());
    for call in calls {
        match call.await.unwrap() {
            (took, Some(e)) if e.contains("calls already wait for this redis node") => {
                assert!(took < Duration::from_millis(1_000), "refused only after {took:?}");
                full += 1;
            }
            (_, None) => answered += 1,
            (_, Some(e)) => other.push(e),
        }
    }
    // 20,000 wait in the queue, and at most two batches of 128 were on the wire
    assert!(other.is_empty(), "{:?}", &other[..other.len().min(3)]);
    assert!((CALLS - 20_000 - 256..=CALLS - 20_000).contains(&full), "{full} refused at once, {answered} answered");
    assert_eq!(full + answered, CALLS);
}
