//! StatsD as envoyproxy/ratelimit sends it: a `rate_limit:` rule's hits under their stat
//! names, every flush interval, over UDP (here a listener of the test's, from the config
//! file) and over TCP (from their environment: `USE_STATSD`, `STATSD_HOST`, `STATSD_PORT`,
//! `STATS_FLUSH_INTERVAL`, `EXTRA_TAGS`), in Lyft's format and in DogStatsD's
//! (`USE_DOG_STATSD`). Each line is parsed; the names are those of their stats tests
//! (`ratelimit.service.rate_limit.DOMAIN.KEY_VALUE.total_hits`).

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Every StatsD line received, each `NAME:VALUE|TYPE[|#TAGS]`.
type Lines = Arc<Mutex<Vec<String>>>;

/// A UDP listener on loopback gathering the lines of every datagram.
fn udp() -> (u16, Lines) {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = socket.local_addr().unwrap().port();
    let lines: Lines = Default::default();
    let into = lines.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 65_536];
        while let Ok(n) = socket.recv(&mut buf) {
            into.lock().unwrap().extend(String::from_utf8_lossy(&buf[..n]).lines().map(str::to_string));
        }
    });
    (port, lines)
}

/// A TCP listener on loopback gathering the lines of every connection.
fn tcp() -> (u16, Lines) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let lines: Lines = Default::default();
    let into = lines.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let into = into.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(conn).lines().map_while(Result::ok) {
                    into.lock().unwrap().push(line);
                }
            });
        }
    });
    (port, lines)
}

/// The counters received, summed by name (with its tags), once `name` has reached
/// `want`; fails after 10 s.
fn counters_once(lines: &Lines, name: &str, want: u64) -> BTreeMap<String, u64> {
    let started = Instant::now();
    loop {
        let mut sums = BTreeMap::new();
        for l in lines.lock().unwrap().iter() {
            // Lyft's NAME:VALUE|c, or DogStatsD's NAME:VALUE|c|#TAGS (summed as NAME#TAGS)
            let (head, tags) = l.split_once("|#").map_or((l.as_str(), None), |(h, t)| (h, Some(t)));
            let (stat, rest) = head.rsplit_once(':').unwrap_or_else(|| panic!("not a StatsD line: {l}"));
            let (value, kind) = rest.split_once('|').unwrap_or_else(|| panic!("not a StatsD line: {l}"));
            assert_eq!(kind, "c", "a counter: {l}");
            let key = tags.map_or(stat.to_string(), |t| format!("{stat}#{t}"));
            *sums.entry(key).or_insert(0) += value.parse::<u64>().unwrap();
        }
        if sums.get(name) == Some(&want) {
            return sums;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{name} never reached {want}: {sums:#?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

const DOMAINS: &str =
    "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 2}\n";

#[tokio::test]
async fn udp_from_the_config_file_in_lyfts_format() {
    let (port, lines) = udp();
    let sections = format!(
        "telemetry:\n  statsd: {{address: \"127.0.0.1:{port}\", protocol: udp, flush_interval: 200ms, tags: {{env: test}}}}\n"
    );
    let s = common::start_with(&sections, DOMAINS);
    let client = reqwest::Client::new();
    for _ in 0..3 {
        common::hit(&client, &s.base, "d", &[("user", "a")]).await;
    }
    let name = |stat: &str| format!("ratelimit.service.rate_limit.d.user.{stat}.__env=test");
    let got = counters_once(&lines, &name("total_hits"), 3);
    assert_eq!((got.get(&name("within_limit")), got.get(&name("over_limit"))), (Some(&2), Some(&1)), "{got:#?}");
    // counters are deltas: two more hits add two, whatever was sent before
    for _ in 0..2 {
        common::hit(&client, &s.base, "d", &[("user", "a")]).await;
    }
    let got = counters_once(&lines, &name("total_hits"), 5);
    assert_eq!(got.get(&name("over_limit")), Some(&3), "{got:#?}");
}

/// Their environment: StatsD is on unless `USE_STATSD=false`, over TCP as theirs; and
/// `USE_DOG_STATSD` sends DogStatsD's lines over UDP.
#[tokio::test]
async fn their_environment_sends_over_tcp_and_as_dogstatsd() {
    let (tcp_port, tcp_lines) = tcp();
    let (udp_port, udp_lines) = udp();
    let redis = sluice_testkit::RedisServer::start();
    let url = redis.addr().to_string();
    for (dog, port) in [(false, tcp_port), (true, udp_port)] {
        let dir = sluice_testkit::TempDir::new("sluice-statsd");
        let rule = "domain: d\ndescriptors:\n  - key: user\n    value: a\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";
        let (port, dog) = (port.to_string(), if dog { "true" } else { "false" });
        let vars = [
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", url.as_str()),
            ("USE_STATSD", "true"),
            ("STATSD_HOST", "127.0.0.1"),
            ("STATSD_PORT", port.as_str()),
            ("STATS_FLUSH_INTERVAL", "200ms"),
            ("EXTRA_TAGS", "az:one"),
            ("USE_DOG_STATSD", dog),
        ];
        let (_sluice, grpc) = common::their_way(&dir, rule, &vars);
        let mut rls =
            envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::connect(
                format!("http://{grpc}"),
            )
            .await
            .unwrap();
        for _ in 0..2 {
            let _ = rls.should_rate_limit(common::rls_request("d", &[("user", "a")])).await;
        }
        let (lines, name) = match dog {
            "false" => (&tcp_lines, "ratelimit.service.rate_limit.d.user_a.total_hits.__az=one".to_string()),
            _ => (&udp_lines, "ratelimit.service.rate_limit.d.user_a.total_hits#az:one".to_string()),
        };
        counters_once(lines, &name, 2);
    }
}
