//! What a client sends as descriptor keys and values, however hostile (CR, LF, NUL,
//! quotes, non-ASCII), never reaches a response header, and becomes a metric label only
//! on a `detailed_metric` rule, where the exporter escapes it so `/metrics` stays whole.

mod common;

const HOSTILE: [&str; 5] = ["a\r\nX-Injected: 1", "nul\0byte", "quote\"and\\slash", "ünïcødé ☃", "tab\tand\nnewline"];

#[tokio::test]
async fn hostile_descriptor_values_never_reach_headers() {
    let s = common::start(&common::rule(100));
    let client = reqwest::Client::new();
    for value in HOSTILE {
        let r = common::hit(&client, &s.base, "d", &[("user", value)]).await;
        assert_eq!(r.status(), 200, "{value:?}");
        assert!(r.headers().get("x-injected").is_none(), "{value:?} injected a header");
        for (name, v) in r.headers() {
            let v = v.to_str().unwrap_or_else(|_| panic!("header {name} is not plain text for {value:?}"));
            assert!(!v.contains(value), "header {name} carries the client's value {value:?}");
        }
        assert_eq!(common::header(&r, "x-ratelimit-resource"), "user", "the rule's name, not the value");
    }
    let metrics = common::metrics(&client, &s.base).await;
    for value in HOSTILE {
        assert!(!metrics.contains(value), "{value:?} became a metric label");
    }
}

#[tokio::test]
async fn a_detailed_metric_escapes_what_it_labels() {
    let rule = "  - domain: d\n    descriptors:\n      - key: user\n        detailed_metric: true\n        rate_limit: {unit: hour, requests_per_unit: 100}\n";
    let s = common::start(rule);
    let client = reqwest::Client::new();
    for value in HOSTILE {
        assert_eq!(common::hit(&client, &s.base, "d", &[("user", value)]).await.status(), 200);
    }
    let metrics = common::metrics(&client, &s.base).await;
    // every line is a comment or `name{labels} value`: no value broke a line open
    for line in metrics.lines().filter(|l| !l.is_empty() && !l.starts_with('#')) {
        assert!(line.starts_with("sluice_"), "a line of /metrics was broken: {line:?}");
        assert!(!line.contains('\r') && !line.contains('\0'), "{line:?}");
    }
    let detailed = metrics.lines().filter(|l| l.starts_with("sluice_decisions_detailed_total{")).count();
    assert_eq!(detailed, HOSTILE.len(), "one series per value:\n{metrics}");
    assert!(metrics.contains(r#"quote\"and\\slash"#), "quotes and backslashes escaped:\n{metrics}");
}
