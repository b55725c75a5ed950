//! `/metrics`: Prometheus text with decisions, near-limit and shadow counts, and no
//! descriptor value as a label. Shadow mode end to end.

mod common;

use common::{hit, start};
use std::collections::BTreeMap;

/// The value of the sample `name` whose labels include all of `labels`.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
        if n != name {
            return None;
        }
        let found: BTreeMap<&str, &str> = rest
            .trim_end_matches('}')
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k, v.trim_matches('"')))
            .collect();
        labels.iter().all(|(k, v)| found.get(k) == Some(v)).then(|| value.parse().ok())?
    })
}

#[tokio::test]
async fn decisions_are_counted_without_descriptor_values() {
    let s = start(
        "  - domain: demo\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 5}\n      - key: trial\n        shadow_mode: true\n        rate_limit: {name: trial, unit: minute, requests_per_unit: 1}\n",
    );
    let client = reqwest::Client::new();
    for _ in 0..7 {
        hit(&client, &s.base, "demo", &[("user", "alice-secret-42")]).await;
    }
    // a shadow-mode rule with limit 1: three requests allowed, two reported
    let mut reported = 0;
    for _ in 0..3 {
        let r = hit(&client, &s.base, "demo", &[("trial", "bob")]).await;
        assert_eq!(r.status(), 200, "shadow mode never refuses");
        let json: serde_json::Value = r.json().await.unwrap();
        reported += json["shadow_denials"].as_array().map_or(0, |a| a.len());
    }
    assert_eq!(reported, 2);
    let text = common::metrics(&client, &s.base).await;
    let d = |outcome| {
        sample(&text, "sluice_decisions_total", &[("domain", "demo"), ("policy", "user"), ("outcome", outcome)])
    };
    assert_eq!(d("allowed"), Some(5.0), "{text}");
    assert_eq!(d("over_limit"), Some(2.0));
    // used 4 and 5 of 5 are at or past 80%
    assert_eq!(sample(&text, "sluice_near_limit_total", &[("policy", "user")]), Some(2.0));
    assert_eq!(sample(&text, "sluice_shadow_over_limit_total", &[("policy", "trial")]), Some(2.0));
    assert!(!text.contains("alice-secret-42") && !text.contains("bob"), "a descriptor value became a label");
}

/// `detailed_metric: true` counts a rule's decisions by descriptor value; other rules'
/// values still never appear.
#[tokio::test]
async fn detailed_metric_counts_by_value_when_a_rule_asks() {
    let s = start(
        "  - domain: demo\n    descriptors:\n      - key: plan\n        detailed_metric: true\n        rate_limit: {unit: minute, requests_per_unit: 1}\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 1}\n",
    );
    let client = reqwest::Client::new();
    for _ in 0..3 {
        hit(&client, &s.base, "demo", &[("plan", "gold")]).await;
        hit(&client, &s.base, "demo", &[("user", "carol-private")]).await;
    }
    let text = common::metrics(&client, &s.base).await;
    let d = |outcome| {
        sample(&text, "sluice_decisions_detailed_total", &[("descriptor", "plan_gold"), ("outcome", outcome)])
    };
    assert_eq!((d("allowed"), d("over_limit")), (Some(1.0), Some(2.0)), "{text}");
    assert!(!text.contains("carol-private"));
}

/// The standard process metrics: CPU time that grows with work, resident memory as the
/// system reports it, open file descriptors.
#[tokio::test]
async fn the_process_reports_its_cpu_memory_and_files() {
    let s = start(&common::rule(1_000_000));
    let client = reqwest::Client::new();
    let first = common::metrics(&client, &s.base).await;
    for i in 0..300 {
        hit(&client, &s.base, "d", &[("user", &format!("u{i}"))]).await;
    }
    let then = common::metrics(&client, &s.base).await;
    let cpu = |t: &str| sample(t, "process_cpu_seconds_total", &[]).expect("process_cpu_seconds_total");
    assert!(cpu(&then) > cpu(&first), "CPU time did not grow with 300 decisions:\n{then}");
    let vm_rss = common::rss_of(s.process.pid()) as f64;
    let rss = sample(&then, "process_resident_memory_bytes", &[]).expect("process_resident_memory_bytes");
    assert!(rss > vm_rss / 2.0 && rss < vm_rss * 2.0, "resident memory {rss}, the system says {vm_rss}");
    assert!(sample(&then, "process_open_fds", &[]).is_some_and(|n| n >= 3.0), "{then}");
}

/// `sluice bench --rate` paces its calls: two seconds at 150 a second are about 300
/// decisions, however fast the server answers.
#[test]
fn bench_paces_calls_at_a_rate() {
    let s = common::start_with("", &common::rule(1_000_000));
    let target = s.base.trim_start_matches("http://").to_string();
    let out = std::process::Command::new(common::bin())
        .args(["bench", "--json", "--domain", "d", "--duration", "2s", "--concurrency", "4", "--rate", "150"])
        .args(["--target", &target])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let n = report["requests"].as_u64().unwrap();
    assert!((270..=306).contains(&n), "{n} requests: {report}");
    assert_eq!(report["errors"].as_u64(), Some(0), "{report}");
}

/// `sluice bench` reads the server's CPU time (from its `/metrics`) and Redis's (`INFO
/// cpu`) before and after, and reports both per decision.
#[test]
fn bench_reports_server_and_redis_cpu_per_decision() {
    let redis = sluice_testkit::RedisServer::start();
    let store = format!("store:\n  kind: redis\n  url: {}\n", redis.url());
    let s = common::start_with(&store, &common::rule(1_000_000));
    let target = s.base.trim_start_matches("http://").to_string();
    let redis_addr = redis.addr().to_string();
    let out = std::process::Command::new(common::bin())
        .args(["bench", "--json", "--domain", "d", "--duration", "2s", "--concurrency", "8"])
        .args(["--target", &target, "--redis-cpu", &redis_addr])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report["requests"].as_u64().unwrap() > 100, "{report}");
    for field in ["server_cpu_us", "redis_cpu_us"] {
        let us = report[field].as_f64().unwrap_or_else(|| panic!("no {field}: {report}"));
        assert!(us > 0.0 && us < 10_000.0, "{field} = {us}: {report}");
    }
}

/// The series `/metrics` exports are bounded by the rules, never by the clients: with
/// three rules, the series after 100,000 distinct clients are the series after two,
/// the same as before any decision, and three a rule (docs/operations.md, "Metrics").
#[tokio::test]
async fn series_are_bounded_by_rules_not_clients() {
    let s = start(
        "  - domain: api\n    descriptors:\n      - key: user\n        rate_limit: {unit: day, requests_per_unit: 1}\n      - key: token\n        rate_limit: {unit: day, requests_per_unit: 1}\n      - key: route\n        descriptors:\n          - key: user\n            rate_limit: {unit: day, requests_per_unit: 1}\n",
    );
    let rules = 3;
    let client = reqwest::Client::new();
    let series = |text: &str| text.lines().filter(|l| !l.is_empty() && !l.starts_with('#')).count();
    let idle = series(&common::metrics(&client, &s.base).await);
    // client i of the rule i % 3, `n` of them from `from`, in one request
    let post = |from: usize, n: usize| {
        let descriptors: Vec<serde_json::Value> = (from..from + n)
            .map(|i| {
                let entries = match i % 3 {
                    0 => serde_json::json!([{"key": "user", "value": format!("u{i}")}]),
                    1 => serde_json::json!([{"key": "token", "value": format!("t{i}")}]),
                    _ => {
                        serde_json::json!([{"key": "route", "value": "/a"}, {"key": "user", "value": format!("u{i}")}])
                    }
                };
                serde_json::json!({ "entries": entries })
            })
            .collect();
        let body = serde_json::json!({"domain": "api", "descriptors": descriptors});
        let request = client.post(format!("{}/v1/ratelimit", s.base)).json(&body);
        async move { request.send().await.unwrap().status().as_u16() }
    };
    // two clients of each rule, each refused once: every outcome of every rule is seen
    for from in [0, 3] {
        for i in from..from + 3 {
            assert_eq!(post(i, 1).await, 200);
            assert_eq!(post(i, 1).await, 429);
        }
    }
    let seen = series(&common::metrics(&client, &s.base).await);
    // 50 clients a request (a request carries at most 64 descriptors), 16 in flight
    let requests = (0..2_000).map(|r| post(1_000 + r * 50, 50));
    let statuses: Vec<u16> = futures_util::StreamExt::collect(futures_util::StreamExt::buffer_unordered(
        futures_util::stream::iter(requests),
        16,
    ))
    .await;
    assert!(statuses.iter().all(|&code| code == 200), "{statuses:?}");
    let text = common::metrics(&client, &s.base).await;
    let allowed = text
        .lines()
        .filter(|l| l.starts_with("sluice_decisions_total{") && l.contains("outcome=\"allowed\""))
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<f64>().unwrap())
        .sum::<f64>();
    assert_eq!(allowed, 100_006.0, "every decision was counted:\n{text}");
    let after = series(&text);
    assert_eq!((idle, seen), (after, after), "series before any decision, after two clients, after 100,000");
    let of_rules = text.lines().filter(|l| l.contains("policy=\"") && !l.contains("policy=\"request_limit\"")).count();
    assert_eq!(of_rules, 3 * rules, "{text}");
}

/// A scrape of a large config (20,000 domains) takes a while to render; health probes
/// during a stream of scrapes are answered within 100 ms each. (Both were answered on
/// the front door's one thread: a 63 MB scrape held `/healthz` for 4.35 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_never_waits_behind_a_scrape() {
    let _heavy = common::heavy().await;
    let domains = common::many_domains(20_000, 10);
    let s = start(&domains);
    let base = s.base.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // three scrapers in a loop, each on a new connection
    let scrapers: Vec<_> = (0..3)
        .map(|_| {
            let (base, stop) = (base.clone(), stop.clone());
            tokio::spawn(async move {
                let client = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
                let mut longest = std::time::Duration::ZERO;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let started = std::time::Instant::now();
                    let text = client.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
                    assert!(text.contains("domain=\"d19999\""), "a scrape lacks the last domain");
                    longest = longest.max(started.elapsed());
                }
                longest
            })
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let mut worst = std::time::Duration::ZERO;
    for _ in 0..40 {
        let client = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
        let started = std::time::Instant::now();
        let r = client.get(format!("{base}/healthz")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        worst = worst.max(started.elapsed());
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut longest_scrape = std::time::Duration::ZERO;
    for s in scrapers {
        longest_scrape = longest_scrape.max(s.await.unwrap());
    }
    eprintln!("health worst {worst:?}, longest scrape {longest_scrape:?}");
    assert!(
        longest_scrape > std::time::Duration::from_millis(200),
        "scrapes took {longest_scrape:?}: too light to show anything"
    );
    assert!(worst < std::time::Duration::from_millis(100), "a health probe took {worst:?} while scrapes ran");
}

/// `server.metrics` with its own path (envoyproxy/ratelimit's `PROMETHEUS_ADDR` and
/// `PROMETHEUS_PATH`): the scrape answers there, the listener's `/metrics` does not, and
/// the HTTP listener keeps `/metrics`.
#[tokio::test]
async fn the_metrics_listener_answers_on_its_path() {
    let s = common::start_with("  metrics: 127.0.0.1:0\n  metrics_path: /stats/prometheus\n", &common::rule(10));
    let ready = std::fs::read_to_string(s.dir.path().join("ready")).unwrap();
    let at = ready.lines().find_map(|l| l.strip_prefix("metrics=")).expect("a metrics= line").to_string();
    let client = reqwest::Client::new();
    let get = |url: String| {
        let client = client.clone();
        async move { client.get(url).send().await.unwrap() }
    };
    let r = get(format!("http://{at}/stats/prometheus")).await;
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("sluice_config_reloads_total"));
    assert_eq!(get(format!("http://{at}/metrics")).await.status(), 404);
    assert_eq!(get(format!("{}/metrics", s.base)).await.status(), 200);
}

/// `server.debug` (envoyproxy/ratelimit's `DEBUG_HOST:DEBUG_PORT`): `/rlconfig` prints the
/// `rate_limit:` rules in force as theirs does, `/stats` each rule's hits under their
/// stat names, `/` the two.
#[tokio::test]
async fn the_debug_listener_prints_the_rules_and_their_stats() {
    let domains = "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 2}\n      - key: path\n        value: /x\n        shadow_mode: true\n        rate_limit: {unit: minute, requests_per_unit: 5}\n";
    let s = common::start_with("  debug: 127.0.0.1:0\n", domains);
    let ready = std::fs::read_to_string(s.dir.path().join("ready")).unwrap();
    let at = ready.lines().find_map(|l| l.strip_prefix("debug=")).expect("a debug= line").to_string();
    let client = reqwest::Client::new();
    for _ in 0..3 {
        hit(&client, &s.base, "d", &[("user", "a")]).await;
    }
    let get = |path: &str| {
        let (client, url) = (client.clone(), format!("http://{at}{path}"));
        async move { client.get(url).send().await.unwrap().text().await.unwrap() }
    };
    let rules = get("/rlconfig").await;
    assert_eq!(
        rules,
        "d.path_/x: unit=MINUTE requests_per_unit=5, shadow_mode: true, quota_mode: false\n\
         d.user: unit=HOUR requests_per_unit=2, shadow_mode: false, quota_mode: false\n"
    );
    let stats = get("/stats").await;
    for line in [
        "ratelimit.service.rate_limit.d.user.total_hits: 3\n",
        "ratelimit.service.rate_limit.d.user.within_limit: 2\n",
        "ratelimit.service.rate_limit.d.user.over_limit: 1\n",
        "ratelimit.service.rate_limit.d.path_/x.total_hits: 0\n",
    ] {
        assert!(stats.contains(line), "{line} not in:\n{stats}");
    }
    assert!(get("/").await.contains("/rlconfig: print out the currently loaded configuration"));
}

/// The same two listeners from envoyproxy/ratelimit's environment: `USE_PROMETHEUS` with
/// `PROMETHEUS_ADDR` and `PROMETHEUS_PATH`, `DEBUG_HOST` and `DEBUG_PORT`. A decision over
/// gRPC shows in the scrape at that path, under their metric names, and in `/stats`;
/// `/rlconfig` prints their rule file.
#[tokio::test]
async fn their_environment_names_the_metrics_path_and_the_debug_port() {
    let dir = sluice_testkit::TempDir::new("sluice-env-listeners");
    let rule = "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";
    let redis = sluice_testkit::RedisServer::start();
    let url = redis.addr().to_string();
    let vars = [
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", url.as_str()),
        ("USE_PROMETHEUS", "true"),
        ("PROMETHEUS_ADDR", "127.0.0.1:0"),
        ("PROMETHEUS_PATH", "/stats/prometheus"),
        ("DEBUG_HOST", "127.0.0.1"),
        ("DEBUG_PORT", "0"),
    ];
    let (_sluice, grpc) = common::their_way(&dir, rule, &vars);
    let ready = std::fs::read_to_string(dir.path().join("ready")).unwrap();
    let at =
        |name: &str| ready.lines().find_map(|l| l.strip_prefix(name)).unwrap_or_else(|| panic!("{name} in {ready}"));
    let (metrics, debug) = (at("metrics=").to_string(), at("debug=").to_string());
    let mut rls = common::rls(&grpc).await;
    for _ in 0..2 {
        rls.should_rate_limit(common::rls_request("d", &[("user", "ann")])).await.unwrap();
    }
    let get = |url: String| async move { reqwest::get(url).await.unwrap() };
    let scrape = get(format!("http://{metrics}/stats/prometheus")).await;
    assert_eq!(scrape.status(), 200);
    let scrape = scrape.text().await.unwrap();
    let labels = [("domain", "d"), ("key1", "user")];
    assert_eq!(sample(&scrape, "ratelimit_service_rate_limit_over_limit", &labels), Some(1.0), "{scrape}");
    assert_eq!(get(format!("http://{metrics}/metrics")).await.status(), 404, "PROMETHEUS_PATH moved it");
    let stats = get(format!("http://{debug}/stats")).await.text().await.unwrap();
    assert!(stats.contains("ratelimit.service.rate_limit.d.user.total_hits: 2\n"), "{stats}");
    let rules = get(format!("http://{debug}/rlconfig")).await.text().await.unwrap();
    assert_eq!(rules, "d.user: unit=HOUR requests_per_unit=1, shadow_mode: false, quota_mode: false\n");
}
