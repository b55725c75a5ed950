//! GitHub's migration, end to end: Memcached to Redis behind a percentage that moves
//! live through the admin API, under load, exact at every step.

mod common;

use common::{header, start_with};
use sluice_testkit::{MemcachedServer, RedisServer};
use std::collections::HashMap;

const TOKEN: &str = "s3cret-admin-token";

async fn set_percent(client: &reqwest::Client, base: &str, percent: u8) {
    let r = client
        .put(format!("{base}/v1/admin/migration"))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({ "percent": percent }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
}

/// A server on a migrating store, memcached to Redis at 0%, each `user` allowed `limit` a
/// `unit`.
fn migrating(memcached: &MemcachedServer, redis: &RedisServer, unit: &str, limit: u64) -> common::Sluice {
    let sections = format!(
        "  admin_token: {TOKEN}\nstore:\n  kind: migrating\n  percent: 0\n  from: {{kind: memcached, servers: [\"{}\"]}}\n  to: {{kind: redis, url: \"{}\"}}\n",
        memcached.addr(),
        redis.url()
    );
    let rule = format!(
        "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {{unit: {unit}, requests_per_unit: {limit}}}\n"
    );
    start_with(&sections, &rule)
}

fn redis_keys(redis: &RedisServer) -> u64 {
    let reply = redis.command("DBSIZE").unwrap();
    reply.trim_start_matches(':').trim().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memcached_to_redis_at_0_50_100_and_back() {
    let _heavy = common::heavy().await;
    let (memcached, redis) = (MemcachedServer::start(), RedisServer::start());
    let s = migrating(&memcached, &redis, "hour", 5);
    let client = reqwest::Client::new();

    // the admin API refuses a missing or wrong token
    let url = format!("{}/v1/admin/migration", s.base);
    assert_eq!(client.put(&url).json(&serde_json::json!({"percent": 50})).send().await.unwrap().status(), 401);
    let wrong = client.put(&url).bearer_auth("wrong").json(&serde_json::json!({"percent": 50})).send().await.unwrap();
    assert_eq!(wrong.status(), 401);
    let r = client.get(&url).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["percent"], 0, "nothing moved without the token");

    let clients = 400;
    for (step, percent) in [0u8, 50, 100, 0].into_iter().enumerate() {
        set_percent(&client, &s.base, percent).await;
        let keys_before = redis_keys(&redis);
        // eight workers, six requests for each of 400 fresh clients (limit 5)
        let workers: Vec<_> = (0..8)
            .map(|w| {
                let (client, base) = (client.clone(), s.base.clone());
                tokio::spawn(async move {
                    let mut admitted: HashMap<usize, u32> = HashMap::new();
                    let mut bad = Vec::new();
                    for round in 0..6 {
                        for c in (w..clients).step_by(8) {
                            let user = format!("step{step}-client{c}");
                            let r = common::hit(&client, &base, "d", &[("user", &user)]).await;
                            let degraded = header(&r, "x-sluice-degraded");
                            match r.status().as_u16() {
                                200 if degraded.is_empty() => *admitted.entry(c).or_default() += 1,
                                429 => {}
                                other => bad.push(format!("round {round} {user}: {other} {degraded}")),
                            }
                        }
                    }
                    (admitted, bad)
                })
            })
            .collect();
        let mut admitted = HashMap::new();
        for w in workers {
            let (a, bad) = w.await.unwrap();
            assert!(bad.is_empty(), "at {percent}%: {bad:?}");
            admitted.extend(a);
        }
        assert_eq!(admitted.len(), clients, "at {percent}%: some client was never admitted");
        assert!(admitted.values().all(|&n| n == 5), "at {percent}%: a client did not get exactly its limit");
        let on_redis = redis_keys(&redis) - keys_before;
        let share = on_redis as f64 / clients as f64;
        match percent {
            0 => assert_eq!(on_redis, 0, "at 0% nobody is on redis"),
            100 => assert_eq!(on_redis as usize, clients, "at 100% everybody is on redis"),
            _ => assert!((share - 0.5).abs() < 0.07, "at 50%, {share:.3} of the clients are on redis"),
        }
    }
    let stats = memcached.command("stats").unwrap();
    assert!(!stats.contains("STAT curr_items 0\r"), "memcached held the clients of the 0% steps");

    // each move is audited: one line with the old and new percentages, one count
    let log = s.log();
    let moves: Vec<&str> = log.lines().filter(|l| l.contains("action=\"migration_percent\"")).collect();
    assert_eq!(moves.len(), 4, "{log}");
    assert!(moves[1].contains("old=\"0\"") && moves[1].contains("new=\"50\""), "{}", moves[1]);
    assert!(moves.iter().all(|l| l.contains("by=\"admin_token:")), "{moves:?}");
    assert!(!log.contains(TOKEN), "the token is in the log");
    let m = common::metrics(&client, &s.base).await;
    assert!(m.contains("sluice_admin_actions_total{action=\"migration_percent\"} 4"), "{m}");
}

/// A client refused on the old backend and moved by a new percentage starts afresh on
/// the new one at its next request: the refusal the near-cache remembered was the old
/// backend's. (It was answered 429 from the near-cache while the new backend held
/// nothing, until the old window ended.)
#[tokio::test]
async fn a_moved_client_is_not_refused_from_the_near_cache() {
    let (memcached, redis) = (MemcachedServer::start(), RedisServer::start());
    let s = migrating(&memcached, &redis, "minute", 3);
    let client = reqwest::Client::new();
    let statuses = |n: usize| {
        let (client, base) = (client.clone(), s.base.clone());
        async move {
            let mut out = Vec::new();
            for _ in 0..n {
                out.push(common::hit(&client, &base, "d", &[("user", "m1")]).await.status().as_u16());
            }
            out
        }
    };
    assert_eq!(statuses(5).await, [200, 200, 200, 429, 429]);
    set_percent(&client, &s.base, 100).await;
    assert_eq!(statuses(4).await, [200, 200, 200, 429], "afresh on the new backend");
    set_percent(&client, &s.base, 0).await;
    // back on the old backend, whose window still holds the three
    assert_eq!(statuses(1).await, [429]);
}

/// dnsmasq on a loopback UDP port, answering the SRV record `_memcache._tcp.sluice.test`
/// with `localhost:PORT` (one `(port, weight)` a record).
struct Dns {
    _process: sluice_testkit::Process,
    port: u16,
}

const LOOPBACK: std::net::Ipv4Addr = std::net::Ipv4Addr::LOCALHOST;

impl Dns {
    /// On a free port.
    fn start(records: &[u16]) -> Self {
        // a port found free can be taken before dnsmasq binds it: try a few
        for _ in 0..5 {
            let port = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            if let Some(dns) = Self::on(LOOPBACK, port, records) {
                return dns;
            }
        }
        panic!("dnsmasq never answered");
    }

    /// On `ip:port` (the one a server before it held), once it answers.
    fn on(ip: std::net::Ipv4Addr, port: u16, records: &[u16]) -> Option<Self> {
        let bin = ["/usr/sbin/dnsmasq", "/usr/bin/dnsmasq"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| sluice_testkit::require("dnsmasq", "dnsmasq-base"));
        let mut cmd = std::process::Command::new(&bin);
        cmd.args(["--no-daemon", &format!("--listen-address={ip}"), "--bind-interfaces", "--no-resolv", "--no-hosts"])
            .args(["--conf-file=/dev/null", "--pid-file=", "--user=root", &format!("--port={port}")])
            .args(records.iter().map(|r| format!("--srv-host=_memcache._tcp.sluice.test,localhost,{r},0,1")));
        let process = sluice_testkit::Process::spawn(&mut cmd).unwrap();
        let at = std::net::SocketAddr::from((ip, port));
        let answers = (0..50).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(20));
            srv_answers("_memcache._tcp.sluice.test", at)
        });
        answers.then_some(Self { _process: process, port })
    }
}

/// Whether a name server at `at` answers an SRV query (a UDP round trip).
fn srv_answers(name: &str, at: std::net::SocketAddr) -> bool {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    socket.set_read_timeout(Some(std::time::Duration::from_millis(200))).unwrap();
    let mut q = vec![0x12, 0x34, 0x01, 0, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in name.split('.') {
        q.push(label.len() as u8);
        q.extend(label.as_bytes());
    }
    q.extend([0, 0, 33, 0, 1]);
    socket.send_to(&q, at).is_ok() && socket.recv(&mut [0u8; 512]).is_ok()
}

/// The memcached store's servers from a DNS SRV record (`store.srv`; envoyproxy/ratelimit's
/// `MEMCACHE_SRV` and `MEMCACHE_SRV_REFRESH`), asked of dnsmasq: a limit counts on the
/// server it names; when the record names another server, the next refresh moves the
/// client there, where it starts afresh.
#[tokio::test]
async fn memcached_servers_come_from_an_srv_record() {
    let (m1, m2) = (MemcachedServer::start(), MemcachedServer::start());
    let port = |m: &MemcachedServer| m.addr().rsplit(':').next().unwrap().parse::<u16>().unwrap();
    let dns = Dns::start(&[port(&m1)]);
    let store = format!(
        "store: {{kind: memcached, srv: _memcache._tcp.sluice.test, srv_refresh: 200ms, srv_nameserver: \"127.0.0.1:{}\"}}\n",
        dns.port
    );
    let rule =
        "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 2}\n";
    let s = start_with(&store, rule);
    let client = reqwest::Client::new();
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(common::hit(&client, &s.base, "d", &[("user", "a")]).await.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 429], "{}", s.log());
    let items = |m: &MemcachedServer| {
        let stats = m.command("stats").unwrap();
        stats.lines().find_map(|l| l.strip_prefix("STAT curr_items ")?.trim().parse::<u64>().ok()).unwrap_or(0)
    };
    assert!((items(&m1), items(&m2)).0 > 0 && items(&m2) == 0, "counted on the server the record names");
    // the record now names the other server: on the next refresh the client is there
    let at = dns.port;
    drop(dns);
    let _dns = Dns::on(LOOPBACK, at, &[port(&m2)]).expect("dnsmasq again on its port");
    let started = std::time::Instant::now();
    while common::hit(&client, &s.base, "d", &[("user", "a")]).await.status() != 200 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "the refresh never moved the client:\n{}",
            s.log()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// The same from envoyproxy/ratelimit's environment (`BACKEND_TYPE=memcache`,
/// `MEMCACHE_SRV`, `MEMCACHE_SRV_REFRESH`), where the record is asked of the system's name
/// server as theirs asks it: Sluice runs in a mount namespace of its own (`unshare -m`)
/// whose /etc/resolv.conf names a dnsmasq on port 53 of a loopback address of this test.
#[tokio::test]
async fn their_environment_finds_memcached_by_srv() {
    let m = MemcachedServer::start();
    let port: u16 = m.addr().rsplit(':').next().unwrap().parse().unwrap();
    let pid = std::process::id();
    let ip = std::net::Ipv4Addr::new(127, 53, (pid >> 8) as u8, (pid as u8).max(1));
    let _dns = Dns::on(ip, 53, &[port]).expect("dnsmasq on port 53 (this test runs as root, as scripts/test)");
    let dir = sluice_testkit::TempDir::new("sluice-env-srv");
    let resolv = dir.path().join("resolv.conf");
    std::fs::write(&resolv, format!("nameserver {ip}\n")).unwrap();
    let files = dir.path().join("runtime/ratelimit/config");
    std::fs::create_dir_all(&files).unwrap();
    let rule = "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";
    std::fs::write(files.join("api.yaml"), rule).unwrap();
    let unshare = sluice_testkit::require("unshare", "util-linux");
    let mut cmd = std::process::Command::new(unshare);
    let run = format!("mount --bind {} /etc/resolv.conf && exec \"$0\" \"$@\"", resolv.display());
    cmd.args(["-m", "sh", "-c", &run]).arg(common::bin()).args(["serve", "--ratelimit-env"]);
    let runtime = dir.path().join("runtime").display().to_string();
    cmd.envs([("HOST", "127.0.0.1"), ("PORT", "0"), ("GRPC_HOST", "127.0.0.1"), ("GRPC_PORT", "0")])
        .envs([("USE_STATSD", "false"), ("RUNTIME_ROOT", runtime.as_str()), ("RUNTIME_SUBDIRECTORY", "ratelimit")])
        .envs([("BACKEND_TYPE", "memcache"), ("MEMCACHE_SRV", "_memcache._tcp.sluice.test")])
        .env("MEMCACHE_SRV_REFRESH", "1s");
    let (_sluice, _http, grpc) = common::spawn_command(cmd, dir.path());
    let (codes, log) = common::overall_codes(&grpc, "d", &[("user", "env")], 3, dir.path()).await;
    assert_eq!(codes, common::TWO_THEN_OVER, "{log}");
    let stats = m.command("stats").unwrap();
    assert!(!stats.contains("STAT curr_items 0\r"), "counted on the server the record names:\n{stats}");
}
