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
