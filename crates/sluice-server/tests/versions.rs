//! Which Redis servers Sluice runs on: one older than 7.0 (a real Redis 6.2.14, built by
//! `scripts/old-redis`) is refused at start with a message naming its version, instead
//! of failing on the first script.

mod common;

use sluice_testkit::{RedisServer, TempDir};

#[test]
fn a_redis_older_than_7_0_is_refused_at_start() {
    let program = std::env::var("SLUICE_OLD_REDIS").unwrap_or_else(|_| {
        panic!(
            "set SLUICE_OLD_REDIS to a redis-server older than 7.0: `scripts/old-redis` builds Redis 6.2.14 and prints its path (scripts/test does this)"
        )
    });
    let old = RedisServer::start_program(std::path::Path::new(&program), &[]);
    let info = old.command("INFO server").unwrap();
    assert!(info.contains("redis_version:6."), "not an old server: {info}");
    let dir = TempDir::new("sluice-old-redis");
    let file = dir.path().join("sluice.yaml");
    let config = format!(
        "{}store:\n  kind: redis\n  url: \"{}\"\ndomains:\n  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {{unit: hour, requests_per_unit: 10}}\n",
        common::SERVER,
        old.url()
    );
    std::fs::write(&file, config).unwrap();
    let out = std::process::Command::new(common::bin()).args(["serve", "--config"]).arg(&file).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "sluice started on Redis 6:\n{stderr}");
    assert!(stderr.contains("version 6.2.14") && stderr.contains("Redis 7.0 or later"), "{stderr}");
}
