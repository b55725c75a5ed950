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
        assert!(line.starts_with("sluice_") || line.starts_with("process_"), "a line of /metrics was broken: {line:?}");
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

/// A request of `descriptors` descriptors of `entries` entries each, keys of `key`
/// bytes and values of `value` bytes (the first entry's key is `user`, so a rule matches).
fn shaped(descriptors: usize, entries: usize, key: usize, value: usize) -> serde_json::Value {
    let entry = |i: usize| {
        let k = if i == 0 { "user".to_string() } else { format!("k{i}").repeat(key).chars().take(key).collect() };
        serde_json::json!({"key": k, "value": "v".repeat(value)})
    };
    let descriptor = serde_json::json!({"entries": (0..entries).map(entry).collect::<Vec<_>>()});
    serde_json::json!({"domain": "d", "descriptors": vec![descriptor; descriptors]})
}

/// Each bound on what a request may carry, at its edge (answered) and one past it (400,
/// naming the setting), with the defaults and with `limiter.request_bounds` set.
#[tokio::test]
async fn request_bounds_hold_at_and_past_their_edges() {
    let defaults = common::start(&common::rule(1_000_000));
    let set = common::start_with(
        "limiter:\n  request_bounds: {descriptors: 3, entries: 2, key_bytes: 8, value_bytes: 16}\n",
        &common::rule(1_000_000),
    );
    let client = reqwest::Client::new();
    let send = |base: &str, body: serde_json::Value| client.post(format!("{base}/v1/ratelimit")).json(&body).send();
    let cases = [
        (&defaults, (64, 1, 4, 1), (65, 1, 4, 1), "limiter.request_bounds.descriptors"),
        (&defaults, (1, 16, 8, 1), (1, 17, 8, 1), "limiter.request_bounds.entries"),
        (&defaults, (1, 2, 256, 1), (1, 2, 257, 1), "256"),
        (&defaults, (1, 1, 4, 1024), (1, 1, 4, 1025), "1024"),
        (&set, (3, 1, 4, 1), (4, 1, 4, 1), "at most 3"),
        (&set, (1, 2, 4, 1), (1, 3, 4, 1), "at most 2"),
        (&set, (1, 2, 8, 1), (1, 2, 9, 1), "at most 8"),
        (&set, (1, 1, 4, 16), (1, 1, 4, 17), "at most 16"),
    ];
    for (s, (d, e, k, v), (d2, e2, k2, v2), says) in cases {
        let at = send(&s.base, shaped(d, e, k, v)).await.unwrap();
        assert_eq!(at.status(), 200, "at the edge {:?}: {}", (d, e, k, v), at.text().await.unwrap());
        let past = send(&s.base, shaped(d2, e2, k2, v2)).await.unwrap();
        assert_eq!(past.status(), 400, "past the edge {:?}", (d2, e2, k2, v2));
        let error = past.json::<serde_json::Value>().await.unwrap()["error"].clone();
        let message = error["message"].as_str().unwrap_or_default().to_string();
        assert!(message.contains(says), "{:?}: {error}", (d2, e2, k2, v2));
    }
}

/// `server.max_body_bytes` at its edge: a body of exactly that many bytes is read, one
/// byte more is 413 (Content-Length declared, and chunked with no length).
#[tokio::test]
async fn the_body_limit_holds_at_and_past_its_edge() {
    let s = common::start_with("  max_body_bytes: 1000\n", &common::rule(1_000_000));
    let client = reqwest::Client::new();
    let json = serde_json::to_string(&common::body("d", &[("user", "edge")])).unwrap();
    let padded = |len: usize| format!("{json}{}", " ".repeat(len - json.len()));
    let post = |body: String| client.post(format!("{}/v1/ratelimit", s.base)).body(body).send();
    assert_eq!(post(padded(1000)).await.unwrap().status(), 200);
    assert_eq!(post(padded(1001)).await.unwrap().status(), 413);
    // chunked: no length declared, so the limit is found while reading
    let chunked = |len: usize| {
        use std::io::{Read, Write};
        let body = padded(len);
        let mut c = std::net::TcpStream::connect(s.base.trim_start_matches("http://")).unwrap();
        let head = "POST /v1/ratelimit HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
        write!(c, "{head}{:x}\r\n{body}\r\n0\r\n\r\n", body.len()).unwrap();
        let mut answer = String::new();
        c.read_to_string(&mut answer).unwrap();
        answer.split(' ').nth(1).unwrap_or_default().to_string()
    };
    assert_eq!(chunked(1000), "200");
    assert_eq!(chunked(1001), "413");
}

/// A response given before its request's body was read (a 413, a 401) says `Connection:
/// close`, so a keep-alive client never sends its next request into a connection the
/// server is closing (reqwest lost one so in a CI run: IncompleteMessage after a 413); a
/// request read whole keeps its connection. The client still writing a refused body gets
/// the 413, not a broken pipe: the server reads and discards the rest before it closes.
#[tokio::test]
async fn a_response_before_the_body_is_read_closes_the_connection() {
    let s = common::start_with("  api_tokens: [t0k3n-0123456789abcdef]\n", &common::rule(1_000_000));
    let client = reqwest::Client::new();
    let url = format!("{}/v1/ratelimit", s.base);
    let (huge, small) = ("x".repeat(1 << 20), common::body("d", &[("user", "k")]));
    for i in 0..30 {
        let r = client.post(&url).bearer_auth("t0k3n-0123456789abcdef").body(huge.clone()).send().await.unwrap();
        assert_eq!((r.status().as_u16(), common::header(&r, "connection")), (413, "close".into()), "try {i}");
        let r = client.post(&url).json(&small).send().await.unwrap();
        assert_eq!((r.status().as_u16(), common::header(&r, "connection")), (401, "close".into()), "try {i}");
        let r = client.post(&url).bearer_auth("t0k3n-0123456789abcdef").json(&small).send().await.unwrap();
        assert_eq!((r.status().as_u16(), common::header(&r, "connection")), (200, String::new()), "try {i}");
    }
}
