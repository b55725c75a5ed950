//! The Redis bucket layout (docs/architecture.md, "Redis"): many clients' states as
//! fields of one hash, pruned once they stop mattering, the bucket kept alive exactly as
//! long as its latest state matters. Forced into one bucket so every client shares it.

use sluice::algo::{Limit, Op};
use sluice::store::Store;
use sluice::store::redis::{RedisOptions, RedisStore};
use sluice::tag::Tag;
use sluice::time::{Clock, SystemClock};
use sluice_testkit::RedisServer;

/// An integer reply of `redis-cli`-style RESP text (`:123\r\n`).
fn int(redis: &RedisServer, command: &str) -> i64 {
    let reply = redis.command(command).unwrap();
    reply.trim().trim_start_matches(':').parse().unwrap_or_else(|_| panic!("{command}: {reply:?}"))
}

#[tokio::test]
async fn expired_states_are_pruned_and_the_bucket_outlives_its_latest_state() {
    let redis = RedisServer::start();
    let store = RedisStore::new(&redis.url(), &[], RedisOptions { buckets: 1, ..RedisOptions::default() }).unwrap();
    let op = Op {
        key: 1,
        limit: Limit::FixedWindow { limit: 5, window: 10_000, aligned: false },
        cost: 1,
        lease: None,
        shadow: false,
    };
    // Redis expires keys by its own clock, so the scripts' `now` must be real time
    let t0 = SystemClock.now();
    for c in 0..40 {
        store.apply(Tag(c), &[op], t0).await.unwrap();
    }
    assert_eq!(int(&redis, "DBSIZE"), 1, "every state in one bucket");
    assert_eq!(int(&redis, "HLEN s:{A}"), 40);
    // the bucket lives a grace second past its latest state's reset, and a later state
    // pushes that out
    assert_eq!(int(&redis, "PEXPIRETIME s:{A}"), (t0 + 11_000) as i64);
    let late = store.apply(Tag(1_000), &[op], t0 + 5_000).await.unwrap();
    assert_eq!(int(&redis, "PEXPIRETIME s:{A}"), (t0 + 16_000) as i64);
    // an earlier state does not pull it back in
    store.apply(Tag(1_001), &[op], t0 + 1_000).await.unwrap();
    assert_eq!(int(&redis, "PEXPIRETIME s:{A}"), (t0 + 16_000) as i64);

    // past the first 40 windows and their grace, new clients arrive (42 fields so far):
    // reaching a multiple of 16 fields triggers a prune, which drops exactly the 40 whose
    // time has passed
    let t1 = t0 + 11_000;
    for c in 2_000..2_005 {
        store.apply(Tag(c), &[op], t1).await.unwrap();
    }
    assert_eq!(int(&redis, "HLEN s:{A}"), 48 - 1, "no prune before the 48th field");
    store.apply(Tag(2_005), &[op], t1).await.unwrap();
    assert_eq!(int(&redis, "HLEN s:{A}"), 48 - 40, "the 40 expired states are pruned");
    // what remains is intact: the late client is still in its window
    let again = store.apply(Tag(1_000), &[op], t1).await.unwrap();
    assert_eq!((again[0].used, again[0].reset_at), (2, late[0].reset_at));
    // and a pruned client starts afresh, as its window had ended anyway
    let fresh = store.apply(Tag(0), &[op], t1).await.unwrap();
    assert_eq!((fresh[0].used, fresh[0].reset_at), (1, t1 + 10_000));
}
