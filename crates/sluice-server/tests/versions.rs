//! Which Redis servers Sluice runs on: one older than 7.0 (a real Redis 6.2.14, built by
//! `scripts/old-redis`) is refused at start with a message naming its version, instead
//! of failing on the first script.

mod common;

use sluice_testkit::{RedisServer, TempDir};

/// A real Redis 6.2.14 (the path in SLUICE_OLD_REDIS).
fn old_redis() -> RedisServer {
    let program = std::env::var("SLUICE_OLD_REDIS").unwrap_or_else(|_| {
        panic!(
            "set SLUICE_OLD_REDIS to a redis-server older than 7.0: `scripts/old-redis` builds Redis 6.2.14 and prints its path (scripts/test does this)"
        )
    });
    RedisServer::start_program(std::path::Path::new(&program), &[])
}

/// A config on the Redis at `url`.
fn store(url: &str) -> String {
    format!("store:\n  kind: redis\n  url: \"{url}\"\n")
}

const DOMAINS: &str =
    "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 10}\n";

#[test]
fn a_redis_older_than_7_0_is_refused_at_start() {
    let old = old_redis();
    let info = old.command("INFO server").unwrap();
    assert!(info.contains("redis_version:6."), "not an old server: {info}");
    let dir = TempDir::new("sluice-old-redis");
    let file = dir.path().join("sluice.yaml");
    let config = format!("{}{}domains:\n{DOMAINS}", common::SERVER, store(&old.url()));
    std::fs::write(&file, config).unwrap();
    let out = std::process::Command::new(common::bin()).args(["serve", "--config"]).arg(&file).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "sluice started on Redis 6:\n{stderr}");
    assert!(stderr.contains("version 6.2.14") && stderr.contains("Redis 7.0 or later"), "{stderr}");
}

/// A Redis that was down at start and comes up too old is named in the log once it
/// answers (the start could not ask it).
#[test]
fn a_redis_that_comes_up_too_old_later_is_named_in_the_log() {
    let mut old = old_redis();
    old.kill();
    let s = common::start_unready(&store(&old.url()), DOMAINS);
    old.restart();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !s.log().contains("this redis cannot run Sluice's scripts") {
        assert!(std::time::Instant::now() < deadline, "not named 10 s after it came up:\n{}", s.log());
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(s.log().contains("version 6.2.14"), "{}", s.log());
}
