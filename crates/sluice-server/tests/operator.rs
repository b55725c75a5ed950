//! What an operator does to a running server, and what it must survive: a config
//! emptied or half-written by an editor, SIGHUP to reload, a store outage that must not
//! flood the log.

mod common;

use common::{bin, hit, num, rss_of};
use sluice_testkit::{Process, RedisServer, TempDir};
use std::path::Path;
use std::time::{Duration, Instant};

fn config(limit: u64) -> String {
    format!(
        "{}domains:\n  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {{unit: hour, requests_per_unit: {limit}}}\n",
        common::SERVER
    )
}

/// `sluice serve --config FILE`, logging to the temp dir; the server's base URL.
fn serve(dir: &TempDir, file: &Path) -> (Process, String) {
    let (p, http, _) = common::spawn(file, dir.path());
    (p, format!("http://{http}"))
}

fn log(dir: &TempDir) -> String {
    std::fs::read_to_string(dir.path().join("sluice.log")).unwrap_or_default()
}

/// Waits until the config's limit is `limit`.
async fn until_limit(client: &reqwest::Client, base: &str, limit: u64, dir: &TempDir) {
    let started = Instant::now();
    loop {
        let r = client.get(format!("{base}/v1/ratelimit?domain=d&user=probe")).send().await.unwrap();
        if r.status() == 200 && num(&r, "x-ratelimit-limit") == limit {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(4), "limit {limit} not in force:\n{}", log(dir));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An empty file, a comment-only file and a file with only `server:` are refused by
/// `config check` and at start, naming the problem.
#[test]
fn a_config_without_domains_is_refused() {
    let dir = TempDir::new("sluice-empty");
    for (name, text) in [("empty", ""), ("comments", "# to do\n"), ("server", "server:\n  http: 127.0.0.1:0\n")] {
        let file = dir.path().join(format!("{name}.yaml"));
        std::fs::write(&file, text).unwrap();
        for args in [&["config", "check"][..], &["serve", "--config"][..]] {
            let out = std::process::Command::new(bin()).args(args).arg(&file).output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{name}: `sluice {}` accepted it", args.join(" "));
            assert!(stderr.contains("no domain"), "{name}: {stderr}");
        }
    }
}

/// What `serve` refuses without touching the network, `config check` refuses too, with
/// the same words: a store that cannot run the rules, the live page without a token, a
/// Redis URL without its scheme; and each error says what to write instead.
#[test]
fn config_check_refuses_what_serve_refuses() {
    let dir = TempDir::new("sluice-check");
    let rule = "domains:\n  - domain: d\n    descriptors:\n      - key: user\n";
    let fixed = "        rate_limit: {unit: hour, requests_per_unit: 5}\n";
    let bucket = "        policies: [{name: b, token_bucket: {rate: 1, per: 1s, burst: 5}}]\n";
    let granted = "        policies: [{name: f, fixed_window: {limit: 5, window: 1h}, grants: auto}]\n";
    let memcached = "store: {kind: memcached, servers: [\"127.0.0.1:11211\"]}\n";
    for (name, text, says) in [
        ("memcached-bucket", format!("{memcached}{rule}{bucket}"), "store memcached runs fixed windows only"),
        ("memcached-grants", format!("{memcached}{rule}{granted}"), "grants"),
        ("ui", format!("server: {{ui: true}}\n{rule}{fixed}"), "set server.admin_token"),
        ("url", format!("store: {{kind: redis, url: 127.0.0.1:6379}}\n{rule}{fixed}"), "write redis://HOST:PORT"),
        (
            "no-url",
            format!("store: {{kind: redis}}\n{rule}{fixed}"),
            "store: missing field `url`; add `url: redis://HOST:PORT`",
        ),
        ("http", format!("server: {{http: \"9000\"}}\n{rule}{fixed}"), "write IP:PORT, e.g. 127.0.0.1:9000"),
    ] {
        let file = dir.path().join(format!("{name}.yaml"));
        std::fs::write(&file, &text).unwrap();
        let mut said = Vec::new();
        for args in [&["config", "check"][..], &["serve", "--config"][..]] {
            let out = std::process::Command::new(bin()).args(args).arg(&file).output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr).to_string();
            assert!(!out.status.success(), "{name}: `sluice {}` accepted it", args.join(" "));
            assert!(stderr.contains(says) && stderr.contains(&format!("{name}.yaml:")), "{name}: {stderr}");
            said.push(stderr.lines().find(|l| l.contains(says)).unwrap_or_default().to_string());
        }
        assert!(said[1].contains(said[0].trim_start_matches("error: ")), "{name}: check and serve differ: {said:?}");
    }
    // and a file it passes says what it could not check
    let file = dir.path().join("ok.yaml");
    std::fs::write(&file, format!("store: {{kind: redis, url: \"redis://127.0.0.1:1\"}}\n{rule}{fixed}")).unwrap();
    let out = std::process::Command::new(bin()).args(["config", "check"]).arg(&file).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("the store is not contacted"), "{stdout}");
}

/// A reload of an emptied file is refused (the domains keep serving), and a file an
/// editor truncates and then writes is read whole: none of ten such edits is refused.
#[tokio::test]
async fn an_emptied_or_half_written_file_never_replaces_the_rules() {
    let dir = TempDir::new("sluice-truncate");
    let file = dir.path().join("sluice.yaml");
    std::fs::write(&file, config(100)).unwrap();
    let (_server, base) = serve(&dir, &file);
    let client = reqwest::Client::new();
    std::fs::write(&file, "").unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let metrics = common::metrics(&client, &base).await;
    assert!(metrics.contains("sluice_config_reloads_total{result=\"failed\"} 1"), "{metrics}");
    until_limit(&client, &base, 100, &dir).await;
    // an editor's save: truncate, then write a moment later. The promise is for saves
    // faster than the watcher's settle time (250 ms); on a loaded machine the test's own
    // 100 ms pause can stretch past it, and such a save is an emptied file for a while:
    // each of those may add one refusal, and no other may
    let mut stretched = 0;
    for limit in 101..111 {
        std::fs::write(&file, "").unwrap();
        let emptied = Instant::now();
        tokio::time::sleep(Duration::from_millis(100)).await;
        std::fs::write(&file, config(limit)).unwrap();
        stretched += usize::from(emptied.elapsed() >= Duration::from_millis(200));
        until_limit(&client, &base, limit, &dir).await;
    }
    let metrics = common::metrics(&client, &base).await;
    let failed = common::series(&metrics, "sluice_config_reloads_total{result=\"failed\"}") as usize;
    assert!((1..=1 + stretched).contains(&failed), "{failed} refused, {stretched} saves stretched:\n{metrics}");
}

/// A reload that drops a domain says which.
#[tokio::test]
async fn a_reload_that_drops_a_domain_names_it() {
    let dir = TempDir::new("sluice-drop");
    let file = dir.path().join("sluice.yaml");
    let two = config(5).replace("  - domain: d\n", "  - domain: gone\n    descriptors: [{key: k}]\n  - domain: d\n");
    std::fs::write(&file, &two).unwrap();
    let (_server, base) = serve(&dir, &file);
    std::fs::write(&file, config(6)).unwrap();
    until_limit(&reqwest::Client::new(), &base, 6, &dir).await;
    let log = log(&dir);
    assert!(log.contains("domains are gone") && log.contains("gone"), "{log}");
}

/// `log.format: json`: every line one JSON object, the audit line's fields structured;
/// `log.level` filters by target and a reload that changes it is in force at once.
#[tokio::test]
async fn json_logs_and_a_reloaded_level() {
    let sections =
        |level: &str| format!("  admin_token: tok-9d2-0123456789ab\nlog:\n  format: json\n  level: \"{level}\"\n");
    let domains =
        "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 5}\n";
    let s = common::start_with(&sections("warn,sluice::audit=info"), domains);
    let c = reqwest::Client::new();
    let body = serde_json::json!({"domain": "d", "entries": [{"key": "user", "value": "a"}], "limit": 9, "reason": "ticket 12"});
    let r = c
        .put(format!("{}/v1/overrides/raise-a", s.base))
        .bearer_auth("tok-9d2-0123456789ab")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let lines = |log: String| -> Vec<serde_json::Value> {
        log.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"))).collect()
    };
    let logged = lines(s.log());
    let audit = logged.iter().find(|l| l["message"] == "admin action").expect("an audit line");
    assert_eq!(
        (&audit["action"], &audit["resource"], &audit["reason"]),
        (&"override_set".into(), &"raise-a".into(), &"ticket 12".into()),
        "{audit}"
    );
    assert_eq!(audit["target"], "sluice::audit");
    assert!(audit["by"].as_str().unwrap().starts_with("admin_token:") && audit["timestamp"].is_string(), "{audit}");
    let new: serde_json::Value = serde_json::from_str(audit["new"].as_str().unwrap()).unwrap();
    assert_eq!(new["limit"], 9, "the new value, as JSON text");
    assert!(!logged.iter().any(|l| l["message"] == "sluice is serving"), "info lines are filtered out at warn");
    assert!(!s.log().contains("tok-9d2"), "the token is in the log");

    let config = s.dir.path().join("sluice.yaml");
    let text = std::fs::read_to_string(&config).unwrap().replace("warn,sluice::audit=info", "info");
    std::fs::write(&config, text).unwrap();
    let started = Instant::now();
    while !lines(s.log()).iter().any(|l| l["message"] == "config reloaded") {
        assert!(started.elapsed() < Duration::from_secs(5), "no info line after the reload:\n{}", s.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reloaded = lines(s.log()).into_iter().find(|l| l["message"] == "config reloaded").unwrap();
    assert!(reloaded["applied"].as_str().unwrap().contains("log.level"), "{reloaded}");
}

/// SIGHUP reloads the config, as a file change does, and the server keeps serving.
/// (It used to end the process with exit 129.)
#[tokio::test]
async fn sighup_reloads_and_never_kills() {
    let dir = TempDir::new("sluice-hup");
    let file = dir.path().join("sluice.yaml");
    std::fs::write(&file, config(7)).unwrap();
    let (mut server, base) = serve(&dir, &file);
    let client = reqwest::Client::new();
    until_limit(&client, &base, 7, &dir).await;
    for _ in 0..3 {
        server.signal("-HUP");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(!server.exited(), "SIGHUP ended the server:\n{}", log(&dir));
    let started = Instant::now();
    while !common::metrics(&client, &base).await.contains("sluice_config_reloads_total{result=\"ok\"}") {
        assert!(started.elapsed() < Duration::from_secs(3), "SIGHUP did not reload:\n{}", log(&dir));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(log(&dir).contains("SIGHUP: reloading"), "{}", log(&dir));
    assert_eq!(hit(&client, &base, "d", &[("user", "u")]).await.status(), 200);
}

/// A 5 s Redis outage under load: the log says the store is failing, sums up what the
/// failure policy decided, and says when the store is back; fewer than 50 lines in all,
/// never one per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_is_logged_in_a_few_lines() {
    let _heavy = common::heavy().await;
    let mut redis = RedisServer::start();
    let store = format!("store:\n  kind: redis\n  url: {}\n", redis.url());
    let s = common::start_with(&store, &common::rule(1_000_000));
    let client = reqwest::Client::new();
    let before = s.log().lines().count();
    let load = {
        let (client, base) = (client.clone(), s.base.clone());
        tokio::spawn(async move {
            let mut answered = 0u64;
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(7) {
                let r = hit(&client, &base, "d", &[("user", &format!("u{}", answered % 100))]).await;
                assert!(r.status() == 200, "{}", r.status());
                answered += 1;
            }
            answered
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    redis.kill();
    tokio::time::sleep(Duration::from_secs(5)).await;
    redis.restart();
    let answered = load.await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let log = s.log();
    let lines: Vec<&str> = log.lines().skip(before).collect();
    assert!(answered > 500, "the load was too light to mean anything: {answered}");
    assert!(lines.len() < 50, "{} log lines for a 5 s outage:\n{}", lines.len(), lines.join("\n"));
    assert!(log.contains("store failing") && log.contains("store answering again"), "{log}");
}

/// A chunked body with a malformed chunk size is the client's mistake: 400, not the 413
/// a body over the size limit gets.
#[test]
fn a_malformed_chunk_is_a_bad_request() {
    use std::io::{Read, Write};
    let s = common::start(&common::rule(10));
    let addr = s.base.trim_start_matches("http://").to_string();
    let mut c = std::net::TcpStream::connect(&addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let head = format!("POST /v1/ratelimit HTTP/1.1\r\nHost: {addr}\r\nTransfer-Encoding: chunked\r\n\r\n");
    c.write_all(head.as_bytes()).unwrap();
    c.write_all(b"zz\r\n{}\r\n0\r\n\r\n").unwrap();
    let mut answer = vec![0u8; 512];
    let n = c.read(&mut answer).unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("bad_body"), "{answer}");
}

/// A server with short timeouts and a small connection limit, for the edges below.
fn bounded(extra_server: &str) -> common::Sluice {
    common::start_with(
        &format!("  header_timeout: 1s\n  body_timeout: 1s\n  shutdown_grace: 2s\n{extra_server}"),
        &common::rule(1_000),
    )
}

/// Reads until the peer closes; how long that took, and what was read.
fn read_to_close(c: &mut std::net::TcpStream, limit: Duration) -> (Duration, String) {
    use std::io::Read;
    let started = Instant::now();
    c.set_read_timeout(Some(limit)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match c.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => {
                panic!("the connection was still open after {limit:?} ({e}); read {:?}", String::from_utf8_lossy(&got))
            }
        }
    }
    (started.elapsed(), String::from_utf8_lossy(&got).into_owned())
}

fn connect(s: &common::Sluice) -> std::net::TcpStream {
    std::net::TcpStream::connect(s.base.trim_start_matches("http://")).unwrap()
}

/// A request head sent a byte at a time is cut off at `header_timeout`; one that
/// arrives in time is answered.
#[test]
fn a_slow_request_head_is_closed_at_the_header_timeout() {
    use std::io::Write;
    let s = bounded("");
    let mut c = connect(&s);
    let started = Instant::now();
    for b in b"POST /v1/ratelimit HTTP/1.1\r\nHost: x\r\n".iter().take(6) {
        if c.write_all(&[*b]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    let (_, got) = read_to_close(&mut c, Duration::from_secs(3));
    let took = started.elapsed();
    assert!(took < Duration::from_millis(2_500), "closed after {took:?}");
    assert!(!got.contains("200 OK"), "{got}");
    // at the edge: a head that arrives within the timeout is served
    let mut c = connect(&s);
    c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    c.write_all(b"Connection: close\r\n\r\n").unwrap();
    let (_, got) = read_to_close(&mut c, Duration::from_secs(3));
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
}

/// A keep-alive connection that sends no next request is closed at `header_timeout`.
#[test]
fn an_idle_keep_alive_connection_is_closed() {
    use std::io::Write;
    let s = bounded("");
    let mut c = connect(&s);
    c.write_all(b"GET /v1/ratelimit?domain=d&user=idle HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let (took, got) = read_to_close(&mut c, Duration::from_secs(4));
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_millis(2_500), "closed after {took:?}");
}

/// A body that stops arriving is answered 408 at `body_timeout`.
#[test]
fn a_slow_body_is_answered_408() {
    use std::io::Write;
    let s = bounded("");
    let mut c = connect(&s);
    c.write_all(b"POST /v1/ratelimit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"domain\"")
        .unwrap();
    let (took, got) = read_to_close(&mut c, Duration::from_secs(4));
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains("body_timeout"), "{got}");
    assert!(took < Duration::from_millis(2_500), "answered after {took:?}");
}

/// Past `max_connections`, connections still get an answer (a health probe gets
/// through) and reaching the limit is logged and counted.
#[tokio::test]
async fn health_is_answered_past_the_connection_limit() {
    use std::io::{Read, Write};
    let s = bounded("  max_connections: 4\n");
    // eight keep-alive connections, each with a request answered and held open
    let held: Vec<_> = (0..8)
        .map(|_| {
            let mut c = connect(&s);
            c.write_all(b"GET /v1/ratelimit?domain=d&user=held HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            assert!(c.read(&mut [0u8; 1024]).unwrap() > 0);
            c
        })
        .collect();
    let client = reqwest::Client::new();
    let started = Instant::now();
    let r = client.get(format!("{}/healthz", s.base)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(started.elapsed() < Duration::from_millis(500), "health took {:?}", started.elapsed());
    let metrics = common::metrics(&client, &s.base).await;
    assert!(metrics.contains("sluice_http_connections_over_limit_total"), "{metrics}");
    assert!(s.log().contains("connection limit reached"), "{}", s.log());
    drop(held);
}

/// SIGTERM with one client stalled halfway through a request head and one idle
/// keep-alive connection: the server exits 0 within the grace period, and says how many
/// connections it dropped. (It used to wait forever.)
#[test]
fn sigterm_with_a_stalled_client_exits_within_the_grace() {
    use std::io::Write;
    let mut s = common::start_with("  header_timeout: 30s\n  shutdown_grace: 2s\n", &common::rule(10));
    let mut stalled = connect(&s);
    stalled.write_all(b"POST /v1/ratelimit HTTP/1.1\r\nHost: x\r\nContent-Len").unwrap();
    let mut idle = connect(&s);
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    s.process.signal("-TERM");
    assert_eq!(s.exit_code_within(Duration::from_secs(5)), 0, "{}", s.log());
    assert!(started.elapsed() < Duration::from_millis(3_500), "took {:?}", started.elapsed());
    assert!(s.log().contains("stopped"), "{}", s.log());
}

/// One keep-alive client: requests one after another until the server says it closes
/// the connection or refuses it. Returns (answered, unanswered): a request written whose
/// answer never came is unanswered.
fn keep_alive_client(addr: String, stop_after: Duration) -> (u64, u64) {
    use std::io::{BufRead, BufReader, Read, Write};
    let Ok(stream) = std::net::TcpStream::connect(&addr) else { return (0, 0) };
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    let body = r#"{"domain":"d","descriptors":[{"entries":[{"key":"user","value":"k"}]}]}"#;
    let request = format!(
        "POST /v1/ratelimit HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let (started, mut answered) = (Instant::now(), 0);
    while started.elapsed() < stop_after {
        if writer.write_all(request.as_bytes()).is_err() {
            return (answered, 0); // closed before this request went out: nothing lost
        }
        let (mut length, mut closes, mut line) = (0usize, false, String::new());
        loop {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return (answered, 1),
                Ok(_) if line == "\r\n" => break,
                Ok(_) => {
                    let lower = line.to_ascii_lowercase();
                    if let Some(v) = lower.strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                    closes |= lower.starts_with("connection: close");
                }
            }
        }
        let mut body = vec![0u8; length];
        if reader.read_exact(&mut body).is_err() {
            return (answered, 1);
        }
        answered += 1;
        if closes {
            return (answered, 0);
        }
    }
    (answered, 0)
}

/// SIGTERM under keep-alive load: every request a client has written is answered (the
/// last ones with `Connection: close`), none is reset, and the server exits 0. (Before,
/// idle keep-alive connections were closed at once, resetting requests already sent.)
#[test]
fn sigterm_under_keep_alive_load_answers_every_request_written() {
    let mut s = common::start_with("  shutdown_grace: 3s\n", &common::rule(1_000_000_000));
    let addr = s.base.trim_start_matches("http://").to_string();
    let clients: Vec<_> = (0..16)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || keep_alive_client(addr, Duration::from_secs(8)))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(700));
    s.process.signal("-TERM");
    let (mut answered, mut unanswered) = (0, 0);
    for c in clients {
        let (a, u) = c.join().unwrap();
        answered += a;
        unanswered += u;
    }
    assert_eq!(s.exit_code_within(Duration::from_secs(5)), 0, "{}", s.log());
    assert!(answered > 100, "the load was too light to mean anything: {answered}");
    assert_eq!(unanswered, 0, "requests written and never answered ({answered} answered)");
}

/// 3,000 connections, each with a request answered and held open, then all closed: the
/// memory they took goes back to the system within seconds (idle allocator threads would keep it).
#[test]
fn memory_goes_back_after_a_burst_of_connections() {
    use std::io::{Read, Write};
    let s = common::start_with("  max_connections: 10000\n", &common::rule(1_000_000_000));
    let addr = s.base.trim_start_matches("http://").to_string();
    let pid = s.process.pid();
    let body = r#"{"domain":"d","descriptors":[{"entries":[{"key":"user","value":"m"}]}]}"#;
    let request = format!(
        "POST /v1/ratelimit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    std::thread::sleep(Duration::from_millis(300));
    let before = rss_of(pid);
    let mut held = Vec::new();
    for _ in 0..3_000 {
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        c.write_all(request.as_bytes()).unwrap();
        let mut buf = [0u8; 2048];
        assert!(c.read(&mut buf).unwrap() > 0);
        held.push(c);
    }
    let peak = rss_of(pid);
    drop(held);
    let grown = peak.saturating_sub(before);
    // within 10 s (given back about 2 s after the last close; slower when the cores are busy)
    let closed = std::time::Instant::now();
    let mut after = rss_of(pid);
    while after >= before + grown / 4 && closed.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(250));
        after = rss_of(pid);
    }
    eprintln!("rss: {before} before, {peak} with 3,000 connections, {after} {:?} after they closed", closed.elapsed());
    assert!(grown > 4 << 20, "the connections took too little memory to tell: {before} -> {peak}");
    assert!(
        after < before + grown / 4,
        "memory stayed after the connections closed: {before} before, {peak} with them, {after} after"
    );
}

/// Decisions as fast as they go over one keep-alive connection: the median of `n`.
async fn decision_speed(client: &reqwest::Client, base: &str, n: usize) -> Duration {
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        assert_eq!(common::hit(client, base, "d", &[("user", "speed")]).await.status(), 200);
        times.push(started.elapsed());
    }
    times.sort();
    times[n / 2]
}

/// Overload, at the scale the suite affords: 1,000 connections of decisions driven as
/// fast as they go (`sluice bench`; about 30 times the concurrency that saturates the
/// server). Every `/healthz` and `/metrics` on a new connection is answered within 100 ms (behind the
/// decisions, a probe waited 128 ms at the median at 2,000 connections on a release
/// build), memory stays bounded, and within 5 s of the load ending decisions are as fast
/// as before it. The full figures are in docs/benchmarks.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_overload_health_answers_memory_holds_and_speed_recovers() {
    let _heavy = common::heavy().await;
    let s = common::start(&common::rule(1_000_000_000));
    let (pid, target) = (s.process.pid(), s.base.trim_start_matches("http://").to_string());
    let fast = reqwest::Client::new();
    let before = decision_speed(&fast, &s.base, 200).await;
    let rss_before = rss_of(pid);
    let mut load = std::process::Command::new(bin())
        .args(["bench", "--domain", "d", "--concurrency", "1000", "--duration", "10s", "--target", &target])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let client = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let (mut waits, mut rss_peak) = (Vec::new(), 0);
    for i in 0..20 {
        // health probes and metrics scrapes, both on new connections
        let path = if i % 2 == 0 { "/healthz" } else { "/metrics" };
        let started = Instant::now();
        let r = client.get(format!("{}{path}", s.base)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
        waits.push(started.elapsed());
        rss_peak = rss_peak.max(rss_of(pid));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(load.try_wait().unwrap().is_none(), "the load ended before the probes did");
    let _ = load.wait();
    let ended = Instant::now();
    waits.sort();
    let worst = waits[waits.len() - 1];
    let grown = rss_peak.saturating_sub(rss_before) >> 20;
    assert!(
        worst < Duration::from_millis(100),
        "health or metrics waited up to {worst:?} under load (median {:?})",
        waits[10]
    );
    assert!(grown < 100, "memory grew by {grown} MB under load");
    // recovered: the same speed as before the load, in a measurement begun within 5 s
    let (at, after) = loop {
        let at = ended.elapsed();
        let after = decision_speed(&fast, &s.base, 200).await;
        if after <= before * 2 + Duration::from_millis(1) {
            break (at, after);
        }
        assert!(at < Duration::from_secs(5), "not recovered 5 s after the load: {after:?} (was {before:?})");
    };
    eprintln!(
        "overload: health median {:?}, worst {worst:?}; memory +{grown} MB; decisions' median {before:?} before, {after:?} {at:?} after",
        waits[10]
    );
}

/// Idle connections past `max_connections` that never send a byte are closed after a
/// second, not the whole header timeout: 20,000 of them once filled the file
/// descriptors and stopped `/healthz`.
#[test]
fn idle_connections_past_the_limit_are_closed_within_a_second() {
    let s = common::start_with("  header_timeout: 30s\n  max_connections: 20\n", &common::rule(1_000));
    let mut idle: Vec<_> = (0..120).map(|_| connect(&s)).collect();
    std::thread::sleep(Duration::from_millis(2_500));
    let still_open = |c: &mut std::net::TcpStream| {
        c.set_nonblocking(true).unwrap();
        // an open, silent connection would block; a closed one reads 0 or errs
        matches!(std::io::Read::read(c, &mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    };
    let open = idle.iter_mut().map(still_open).filter(|&open| open).count();
    assert!(open <= 20, "{open} idle connections still open past a limit of 20:\n{}", s.log());
    assert!(open >= 15, "connections under the limit were closed too ({open} open)");
    assert!(s.log().contains("connection limit reached"), "{}", s.log());
}

/// Errors a newcomer met that did not say how to fix them now do: the admin API asked
/// of a server without `admin_token`, the admin client pointed at the gRPC port, `sluice
/// bench` at a wrong port or without the token the server wants, and a Redis that does
/// not answer at start.
#[tokio::test]
async fn errors_say_how_to_fix_them() {
    let s = common::start_with("  api_tokens: [bench-token-0123456789]\n", &common::rule(1_000));
    let run = |args: &[&str]| {
        let out = std::process::Command::new(bin()).args(args).env_remove("SLUICE_API_TOKEN").output().unwrap();
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    };
    let admin = |server: &str| {
        let out = std::process::Command::new(bin())
            .args(["admin", "--server", server, "override", "list"])
            .env("SLUICE_ADMIN_TOKEN", "an-admin-token-0123456789")
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let said = admin(&s.base);
    assert!(said.contains("the admin API is off: set server.admin_token"), "{said}");
    let said = admin(&format!("http://{}", s.grpc));
    assert!(said.contains("looks like the gRPC port"), "{said}");
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let said = run(&["bench", "--target", &closed.to_string(), "--duration", "200ms", "--concurrency", "1"]);
    assert!(said.contains("the first:") && said.contains("refused"), "{said}");
    let target = s.base.trim_start_matches("http://");
    let said = run(&["bench", "--target", target, "--domain", "d", "--duration", "200ms", "--concurrency", "1"]);
    assert!(said.contains("401") && said.contains("pass --token"), "{said}");
    let token = "bench-token-0123456789";
    let said = run(&["bench", "--target", target, "--duration", "200ms", "--concurrency", "1", "--token", token]);
    assert!(said.contains("400") && said.contains("--domain"), "{said}");
    let said = run(&[
        "bench",
        "--target",
        target,
        "--domain",
        "d",
        "--duration",
        "200ms",
        "--concurrency",
        "1",
        "--token",
        "bench-token-0123456789",
    ]);
    assert!(said.contains("200:") && !said.contains("401"), "{said}");
    // a Redis that does not answer at start: the log names where, and readiness
    let redis =
        common::start_unready(&format!("store: {{kind: redis, url: \"redis://{closed}\"}}\n"), &common::rule(5));
    let c = reqwest::Client::new();
    assert_eq!(common::hit(&c, &redis.base, "d", &[("user", "u")]).await.status(), 200, "failing open");
    let log = redis.log();
    assert!(log.contains(&closed.to_string()) && log.contains("/readyz answers 503"), "{log}");
}
