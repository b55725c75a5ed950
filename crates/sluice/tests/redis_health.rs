//! `ready()` (what `/readyz` asks) against a real Redis that stops answering: one PING,
//! so one timeout, never two.

// These measure wall-clock time itself (real servers, real waits): the OS's clock is
// what they judge (crates/sluice/clippy.toml bans it in the library).
#![allow(clippy::disallowed_types)]

use sluice::store::Store;
use sluice::store::redis::{RedisOptions, RedisStore};
use sluice_testkit::RedisServer;
use std::time::{Duration, Instant};

#[tokio::test]
async fn a_stopped_server_costs_one_timeout() {
    let redis = RedisServer::start();
    let timeout = Duration::from_millis(400);
    let store = RedisStore::new(&redis.url(), &[], RedisOptions { timeout, ..RedisOptions::default() }).unwrap();
    let started = Instant::now();
    while !store.ready().await {
        assert!(started.elapsed() < Duration::from_secs(5), "redis never answered PING");
    }
    // SIGSTOP: the server holds its connections and answers nothing, as a hung one does
    redis.signal("-STOP");
    let started = Instant::now();
    let ready = store.ready().await;
    let took = started.elapsed();
    redis.signal("-CONT");
    assert!(!ready, "a stopped server is not ready");
    assert!(took >= timeout, "answered before the timeout: {took:?}");
    assert!(took < timeout * 3 / 2, "a dead server cost more than one timeout: {took:?}");
}
