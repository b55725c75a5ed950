//! What operators look at (issue #19, point 4), checked rather than trusted: the alert
//! rules of deploy/prometheus pass their `promtool` unit tests, every alert has one, and
//! the Grafana dashboard and the rules name only metrics Sluice exports (each listed in
//! docs/operations.md).

mod common;

use sluice_testkit::require;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The metric names a text mentions (`sluice_*`, `process_*`), a histogram's series
/// (`_bucket`, `_sum`, `_count`) under the histogram's name.
fn metrics_named(text: &str) -> BTreeSet<String> {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.split(|c: char| !word(c))
        .filter(|w| w.starts_with("sluice_") || w.starts_with("process_"))
        .map(|w| {
            let base = ["_bucket", "_sum", "_count"].iter().find_map(|s| w.strip_suffix(s));
            base.unwrap_or(w).to_string()
        })
        .collect()
}

/// Every string literal `"sluice_..."` in the sources: where each metric's name is
/// written.
fn sluice_metrics_in_sources() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut dirs = vec![repo().join("crates/sluice/src"), repo().join("crates/sluice-server/src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                for literal in text.split("\"sluice_").skip(1) {
                    let name = literal.split('"').next().unwrap();
                    if name.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                        names.insert(format!("sluice_{name}"));
                    }
                }
            }
        }
    }
    names
}

#[test]
fn the_alert_rules_pass_their_unit_tests() {
    let promtool = require("promtool", "prometheus");
    let dir = repo().join("deploy/prometheus");
    for args in [&["check", "rules", "rules.yaml"][..], &["test", "rules", "rules_test.yaml"]] {
        let out = Command::new(&promtool).args(args).current_dir(&dir).output().unwrap();
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "promtool {}:\n{said}", args.join(" "));
    }
    let rules = read("deploy/prometheus/rules.yaml");
    let tests = read("deploy/prometheus/rules_test.yaml");
    let alerts: Vec<&str> = rules.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")).collect();
    assert!(alerts.len() >= 8, "at least 8 alerts on the limiter's own health: {alerts:?}");
    for alert in &alerts {
        let fired = format!("alertname: {alert}\n        exp_alerts:");
        assert!(tests.contains(&fired), "{alert} has no test that expects it to fire");
    }
}

#[tokio::test]
async fn the_dashboard_and_alerts_name_only_metrics_sluice_exports() {
    let dashboard: serde_json::Value = serde_json::from_str(&read("deploy/grafana/sluice.json")).unwrap();
    let queries: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter().map(|t| t["expr"].as_str().unwrap().to_string()))
        .collect();
    assert!(queries.len() >= 10, "{queries:?}");
    let used = metrics_named(&queries.join("\n"));
    for part in ["decisions_total", "store_call_seconds", "shed_total", "near_cache_hits_total", "degraded_total"] {
        assert!(used.contains(&format!("sluice_{part}")), "the dashboard shows sluice_{part}");
    }
    for process in ["process_cpu_seconds_total", "process_resident_memory_bytes"] {
        assert!(used.contains(process), "the dashboard shows {process}");
    }
    // the process metrics Sluice really exports, read from a running server
    let s = common::start(
        "  - domain: d\n    descriptors:\n      - key: k\n        rate_limit: {unit: minute, requests_per_unit: 1}\n",
    );
    let scraped = common::metrics(&reqwest::Client::new(), &s.base).await;
    let mut exported = sluice_metrics_in_sources();
    exported.extend(metrics_named(&scraped).into_iter().filter(|m| m.starts_with("process_")));
    let documented = metrics_named(&read("docs/operations.md"));
    let named = used.into_iter().chain(metrics_named(&read("deploy/prometheus/rules.yaml")));
    for metric in named {
        assert!(exported.contains(&metric), "{metric} is not a metric Sluice exports: {exported:?}");
        assert!(documented.contains(&metric), "{metric} is not in docs/operations.md's metrics table");
    }
}

/// A scrape taken after real traffic (decisions allowed and refused, a shadow refusal, a
/// lease taken and given back, a gRPC decision, a detailed metric) passes `promtool
/// check metrics`: every series has its HELP and TYPE, and the names follow
/// Prometheus's conventions (it exited 3: no help text, and a `_total` gauge).
#[tokio::test]
async fn a_scrape_after_traffic_passes_promtool() {
    let promtool = require("promtool", "prometheus");
    let s = common::start(
        "  - domain: d\n    descriptors:\n      - key: user\n        detailed_metric: true\n        rate_limit: {unit: minute, requests_per_unit: 1}\n      - key: trial\n        shadow_mode: true\n        rate_limit: {unit: minute, requests_per_unit: 1}\n      - key: job\n        policies: [{name: inflight, concurrency: {limit: 1, lease_ttl: 10s}}]\n",
    );
    let c = reqwest::Client::new();
    for _ in 0..2 {
        common::hit(&c, &s.base, "d", &[("user", "u")]).await;
        common::hit(&c, &s.base, "d", &[("trial", "t")]).await;
    }
    let lease: serde_json::Value = c
        .post(format!("{}/v1/leases", s.base))
        .json(&common::body("d", &[("job", "j")]))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = lease["lease_id"].as_str().expect("a lease");
    assert!(c.delete(format!("{}/v1/leases/{id}", s.base)).send().await.unwrap().status().is_success());
    let mut rls =
        envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::connect(
            format!("http://{}", s.grpc),
        )
        .await
        .unwrap();
    rls.should_rate_limit(common::rls_request("d", &[("user", "g")])).await.unwrap();
    let scrape = common::metrics(&c, &s.base).await;
    assert!(scrape.contains("sluice_leases_released_total") && scrape.contains("sluice_grpc_connections"), "{scrape}");
    let mut check = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(check.stdin.as_mut().unwrap(), scrape.as_bytes()).unwrap();
    let out = check.wait_with_output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "promtool check metrics: {said}\n{scrape}");
}
