//! The harness starts a real redis-server, talks to it, and stops it by PID.

use sluice_testkit::{RedisServer, ping};

#[test]
fn starts_answers_and_stops() {
    let mut redis = RedisServer::start();
    let port = redis.port();
    ping(port).expect("a started server answers PING");
    assert_eq!(redis.command("SET sluice:smoke 42").unwrap(), "+OK\r\n");
    assert_eq!(redis.command("GET sluice:smoke").unwrap(), "$2\r\n42\r\n");
    let pid = redis.pid();
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    redis.kill();
    assert!(ping(port).is_err(), "a killed server must stop answering");
}
