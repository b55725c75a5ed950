//! StatsD as envoyproxy/ratelimit sends it: a `rate_limit:` rule's hits under their stat
//! names, every flush interval, over UDP (here a listener of the test's, from the config
//! file) and over TCP (from their environment: `USE_STATSD`, `STATSD_HOST`, `STATSD_PORT`,
//! `STATS_FLUSH_INTERVAL`, `EXTRA_TAGS`), in Lyft's format and in DogStatsD's
//! (`USE_DOG_STATSD`). Each line is parsed; the names are those of their stats tests
//! (`ratelimit.service.rate_limit.DOMAIN.KEY_VALUE.total_hits`); and Etsy's daemon, the
//! reference StatsD server, counts what is sent.

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
            let key = tags.map_or(stat.to_string(), |t| format!("{stat}#{t}"));
            match kind {
                "c" => *sums.entry(key).or_insert(0) += value.parse::<u64>().unwrap(),
                // a timer's sample: counted as samples, under NAME|ms
                "ms" => *sums.entry(format!("{key}|ms")).or_insert(0) += u64::from(value.parse::<f64>().is_ok()),
                other => panic!("a counter or a timer, not {other}: {l}"),
            }
        }
        if sums.get(name) == Some(&want) {
            return sums;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{name} never reached {want}: {sums:#?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

const DOMAINS: &str = concat!(
    "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 2}\n",
    "      - key: plan\n        detailed_metric: true\n        rate_limit: {unit: hour, requests_per_unit: 2}\n"
);

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
    // a detailed_metric rule: each value under a name of its own, as theirs
    common::hit(&client, &s.base, "d", &[("plan", "pro")]).await;
    let plan = "ratelimit.service.rate_limit.d.plan_pro.total_hits.__env=test";
    let got = counters_once(&lines, plan, 1);
    assert_eq!(got.get("ratelimit.service.rate_limit.d.plan.total_hits.__env=test"), None, "{got:#?}");
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
        let rule = "domain: d\ndescriptors:\n  - key: user\n    value: a\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";
        let dog = if dog { "true" } else { "false" };
        // DogStatsD's with their mogrifier: a rule's stats named by what it counts, tagged
        let mogrifier = [
            ("USE_DOG_STATSD_MOGRIFIERS", "RL"),
            ("DOG_STATSD_MOGRIFIER_RL_PATTERN", r"^ratelimit\.service\.rate_limit\.(\w+)\.(.+)\.(\w+)$"),
            ("DOG_STATSD_MOGRIFIER_RL_NAME", "ratelimit.service.rate_limit.$3"),
            ("DOG_STATSD_MOGRIFIER_RL_TAGS", "domain:$1,descriptor:$2"),
        ];
        // SHADOW_MODE: the second call, over the limit, is allowed (global_shadow_mode);
        // each run its own clients on the one Redis
        let secret = format!("statsd-{dog}-a-secret-of-its-own");
        let own = [
            ("EXTRA_TAGS", "az:one"),
            ("USE_DOG_STATSD", dog),
            ("SHADOW_MODE", "true"),
            ("SLUICE_KEY_SECRET", &secret),
        ];
        let vars = [&own[..], &mogrifier].concat();
        let (_sluice, _dir, grpc) = their_calls(rule, &url, port, &vars, 2).await;
        // a domain no rule names: answered OK, and counted by name
        common::rls(&grpc).await.should_rate_limit(common::rls_request("nowhere", &[("user", "a")])).await.unwrap();
        let (lines, name): (_, fn(&str) -> String) = match dog {
            "false" => (&tcp_lines, |s| format!("{s}.__az=one")),
            _ => (&udp_lines, |s| format!("{s}#az:one")),
        };
        let total_hits = match dog {
            "false" => name("ratelimit.service.rate_limit.d.user_a.total_hits"),
            _ => "ratelimit.service.rate_limit.total_hits#az:one,descriptor:user_a,domain:d".to_string(),
        };
        counters_once(lines, &total_hits, 2);
        // their service's stats beside each rule's (counted once the call is answered:
        // perhaps a flush later), a response time a call
        counters_once(lines, &name("ratelimit_server.ShouldRateLimit.total_requests"), 3);
        counters_once(lines, &(name("ratelimit_server.ShouldRateLimit.response_time") + "|ms"), 3);
        let got = counters_once(lines, &name("ratelimit.service.rate_limit.nowhere.domain_not_found"), 1);
        assert_eq!(got.get(&name("ratelimit.service.config_load_success")), Some(&1), "{got:#?}");
        assert_eq!(got.get(&name("ratelimit.service.global_shadow_mode")), Some(&1), "{got:#?}");
    }
}

/// Sluice from their environment, `rule` its domain file and `redis_url` its store,
/// sending StatsD to `port` on loopback every 200 ms (and `vars`), after `calls` calls
/// for user `a` over gRPC; the server and its directory.
async fn their_calls(
    rule: &str,
    redis_url: &str,
    port: u16,
    vars: &[(&str, &str)],
    calls: usize,
) -> (sluice_testkit::Process, sluice_testkit::TempDir, String) {
    let dir = sluice_testkit::TempDir::new("sluice-statsd");
    let port = port.to_string();
    let statsd = [
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", redis_url),
        ("USE_STATSD", "true"),
        ("STATSD_HOST", "127.0.0.1"),
        ("STATSD_PORT", port.as_str()),
        ("STATS_FLUSH_INTERVAL", "200ms"),
    ];
    let (sluice, grpc) = common::their_way(&dir, rule, &[&statsd[..], vars].concat());
    let mut rls = common::rls(&grpc).await;
    for _ in 0..calls {
        rls.should_rate_limit(common::rls_request("d", &[("user", "a")])).await.unwrap();
    }
    (sluice, dir, grpc)
}

/// The reference StatsD server, Etsy's daemon (npm's `statsd`, which scripts/test
/// installs in tests/statsd-daemon), on a free port speaking TCP (as their gostats sink
/// sends), printing each flush with its console backend; its output so far.
struct Daemon {
    _process: sluice_testkit::Process,
    port: u16,
    out: std::path::PathBuf,
    _dir: sluice_testkit::TempDir,
}

impl Daemon {
    fn start() -> Self {
        let home = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/statsd-daemon");
        let stats = home.join("node_modules/statsd/stats.js");
        assert!(
            stats.exists(),
            "no StatsD daemon at {}: run scripts/test, or `cd {} && npm install`",
            stats.display(),
            home.display()
        );
        let node = sluice_testkit::require("node", "nodejs");
        // a port found free can be taken before the daemon binds it: try a few
        for _ in 0..5 {
            let dir = sluice_testkit::TempDir::new("sluice-statsd-daemon");
            let free = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let (port, mgmt) = (free(), free());
            let config = format!(
                "{{ address: \"127.0.0.1\", port: {port}, mgmt_address: \"127.0.0.1\", mgmt_port: {mgmt}, server: \"./servers/tcp\", backends: [\"./backends/console\"], flushInterval: 300 }}"
            );
            std::fs::write(dir.path().join("config.js"), config).unwrap();
            let out = dir.path().join("out.txt");
            let mut cmd = std::process::Command::new(&node);
            cmd.arg(&stats).arg(dir.path().join("config.js")).current_dir(home.join("node_modules/statsd"));
            let process = sluice_testkit::Process::spawn_logging(&mut cmd, &out).expect("start the StatsD daemon");
            if sluice_testkit::wait_for_port(port, Duration::from_secs(10)) {
                return Self { _process: process, port, out, _dir: dir };
            }
            drop(process);
        }
        panic!("the StatsD daemon never listened");
    }

    /// Waits (10 s at most) until it has counted `n` of `name`, then for two of its
    /// flushes more (what else was sent with it is counted too).
    fn wait_for(&self, name: &str, n: u64) {
        let started = Instant::now();
        while self.counted(name) < n {
            let out = std::fs::read_to_string(&self.out).unwrap_or_default();
            assert!(started.elapsed() < Duration::from_secs(10), "the daemon never counted {n} of {name}:\n{out}");
            std::thread::sleep(Duration::from_millis(100));
        }
        std::thread::sleep(Duration::from_millis(700));
    }

    /// The sum of what its flushes counted for `name` (in their `counters:` blocks).
    fn counted(&self, name: &str) -> u64 {
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        let mut in_counters = false;
        let mut sum = 0;
        for line in text.lines() {
            let t = line.trim();
            if t.ends_with('{') || t.ends_with('}') || t.ends_with("},") {
                in_counters = t.starts_with("counters:");
            }
            let quoted = format!("'{name}': ");
            if let Some(v) = t.strip_prefix(&quoted).filter(|_| in_counters) {
                sum += v.trim_end_matches(',').parse::<u64>().unwrap_or(0);
            }
        }
        sum
    }
}

/// What Sluice sends, as Etsy's daemon (the reference server) aggregates it: the counts
/// of their stat names, from their environment (`USE_STATSD` left to its default, on).
#[tokio::test]
async fn the_reference_daemon_counts_what_is_sent() {
    let daemon = Daemon::start();
    let redis = sluice_testkit::RedisServer::start();
    let rule = "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";
    let _sluice = their_calls(rule, &redis.addr().to_string(), daemon.port, &[], 3).await;
    let stat = |s: &str| format!("ratelimit.service.rate_limit.d.user.{s}");
    daemon.wait_for(&stat("total_hits"), 3);
    let counted = [stat("total_hits"), stat("within_limit"), stat("over_limit")].map(|s| daemon.counted(&s));
    assert_eq!(counted, [3, 2, 1], "{}", std::fs::read_to_string(&daemon.out).unwrap_or_default());
}

/// Descriptor values a client controls go into the names of `detailed_metric` rules: what
/// StatsD and DogStatsD read as syntax (`:|@#`, whitespace, control characters) is
/// replaced, so a hostile value adds no counter, no tag and no bad line at Etsy's daemon
/// (before, `a:999|c` sent `...path_a:999|c.total_hits:1|c`).
#[tokio::test]
async fn client_values_cannot_shape_the_stat_names() {
    let daemon = Daemon::start();
    let redis = sluice_testkit::RedisServer::start();
    let rule = "domain: d\ndescriptors:\n  - key: path\n    detailed_metric: true\n    rate_limit: {unit: hour, requests_per_unit: 9}\n";
    let dir = sluice_testkit::TempDir::new("sluice-statsd");
    let port = daemon.port.to_string();
    let vars = [
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", &redis.addr().to_string()),
        ("USE_STATSD", "true"),
        ("STATSD_HOST", "127.0.0.1"),
        ("STATSD_PORT", port.as_str()),
        ("STATS_FLUSH_INTERVAL", "200ms"),
    ];
    let (_sluice, grpc) = common::their_way(&dir, rule, &vars);
    let mut rls = common::rls(&grpc).await;
    for value in ["a:999|c", "b|#tag:x", "c d\nevil:1|c", "e@0.5"] {
        rls.should_rate_limit(common::rls_request("d", &[("path", value)])).await.unwrap();
    }
    let stat = |v: &str| format!("ratelimit.service.rate_limit.d.path_{v}.total_hits");
    daemon.wait_for(&stat("e_0.5"), 1);
    let out = std::fs::read_to_string(&daemon.out).unwrap_or_default();
    let counted = ["a_999_c", "b__tag_x", "c_d_evil_1_c"].map(|v| daemon.counted(&stat(v)));
    assert_eq!(counted, [1, 1, 1], "{out}");
    assert_eq!(daemon.counted("statsd.bad_lines_seen"), 0, "{out}");
    for name in ["999", "evil", "c.total_hits", "tag"] {
        assert!(!out.contains(&format!("'{name}'")), "a counter {name} made by a client:\n{out}");
    }
}
