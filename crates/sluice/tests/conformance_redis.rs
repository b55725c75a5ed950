//! The Redis stores against the conformance suite, on real redis-server processes.

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
