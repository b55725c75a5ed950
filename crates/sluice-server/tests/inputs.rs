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

/// A body over `max_body_bytes` is answered 413, and the client reads that answer: the
/// server never closes on a client still sending, which would reset the connection and
/// lose the response. A hundred times in a row.
#[test]
fn an_oversized_body_is_answered_not_reset() {
    use std::io::{Read, Write};
    let s = common::start(&common::rule(10));
    let addr = s.base.trim_start_matches("http://").to_string();
    let body = vec![b'x'; 1 << 20];
    for i in 0..100 {
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        c.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        let head = format!(
            "POST /v1/ratelimit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        c.write_all(head.as_bytes()).unwrap();
        // the server may answer before the body is all sent; a write error is fine, a
        // lost answer is not
        let _ = c.write_all(&body);
        let mut answer = [0u8; 64];
        let n = c.read(&mut answer).unwrap_or_else(|e| panic!("try {i}: the answer was lost: {e}"));
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.starts_with("HTTP/1.1 413"), "try {i}: {answer:?}");
    }
}
