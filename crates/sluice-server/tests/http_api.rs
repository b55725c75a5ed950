//! The HTTP API, end to end against the running `sluice` binary.

mod common;

use common::{bin, body, header, num, start};
use std::time::{Duration, Instant};

const DEMO: &str = "  - domain: demo\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 50}\n";

/// 60 sequential POSTs, spread over more than two seconds: exactly 50 x 200 then 10 x 429,
/// remaining counting 49 down to 0, and one `x-ratelimit-reset` for the whole window.
#[tokio::test]
async fn fifty_per_minute_with_one_stable_reset() {
    let s = start(DEMO);
    let client = reqwest::Client::new();
    let started = Instant::now();
    let mut resets = std::collections::BTreeSet::new();
    let mut seconds_seen = std::collections::BTreeSet::new();
    for i in 0..60u64 {
        let r = client
            .post(format!("{}/v1/ratelimit", s.base))
            .json(&body("demo", &[("user", "alice")]))
            .send()
            .await
            .unwrap();
        seconds_seen.insert(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs());
        assert_eq!(num(&r, "x-ratelimit-limit"), 50);
        resets.insert(num(&r, "x-ratelimit-reset"));
        if i < 50 {
            assert_eq!(r.status(), 200, "request {i}");
            assert_eq!(num(&r, "x-ratelimit-remaining"), 49 - i);
            assert_eq!(num(&r, "x-ratelimit-used"), i + 1);
            if i == 0 {
                // the answer's shape: its type, the codes and the rule's name where a
                // client reads them
                assert_eq!(header(&r, "content-type"), "application/json");
                assert_eq!(header(&r, "x-ratelimit-resource"), "user");
                let json: serde_json::Value = r.json().await.unwrap();
                assert_eq!(json["overall_code"], "OK");
                let status = &json["statuses"][0];
                assert_eq!(status["code"], "OK");
                // unnamed in the config: no name in Envoy's field, the given one in policies
                assert_eq!(status["current_limit"]["name"], "");
                assert_eq!(status["current_limit"]["unit"], "MINUTE");
                assert_eq!(status["duration_until_reset"].as_str().map(|d| d.ends_with('s')), Some(true));
                assert_eq!(status["policies"][0]["name"], "user");
                assert_eq!(status["policies"][0]["source"], "store");
                assert!(json.get("shadow_denials").is_none(), "no shadow policy refused: {json}");
            }
        } else {
            assert_eq!(r.status(), 429, "request {i}");
            assert_eq!(num(&r, "x-ratelimit-remaining"), 0, "a 429 says remaining 0");
            assert_eq!(num(&r, "x-ratelimit-used"), 50);
            assert!(num(&r, "retry-after") >= 1);
            assert!(header(&r, "ratelimit").contains("r=0"));
            let json: serde_json::Value = r.json().await.unwrap();
            assert_eq!(json["overall_code"], "OVER_LIMIT");
            assert_eq!(json["statuses"][0]["limit_remaining"], 0);
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    assert!(started.elapsed() > Duration::from_secs(2));
    assert!(seconds_seen.len() >= 3, "the test must cross second boundaries");
    assert_eq!(resets.len(), 1, "x-ratelimit-reset wobbled: {resets:?}");
}

/// 300 concurrent POSTs for one client with limit 100 admit exactly 100.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_admit_exactly_the_limit() {
    let s = start(
        "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 100}\n",
    );
    let client = reqwest::Client::new();
    let tasks: Vec<_> = (0..300)
        .map(|_| {
            let (client, url) = (client.clone(), format!("{}/v1/ratelimit", s.base));
            tokio::spawn(async move {
                client.post(url).json(&body("d", &[("user", "bob")])).send().await.unwrap().status().as_u16()
            })
        })
        .collect();
    let mut codes = std::collections::BTreeMap::new();
    for t in tasks {
        *codes.entry(t.await.unwrap()).or_insert(0) += 1;
    }
    assert_eq!(codes.get(&200), Some(&100), "{codes:?}");
    assert_eq!(codes.get(&429), Some(&200), "{codes:?}");
}

/// `GET /v1/ratelimit` reports without charging.
#[tokio::test]
async fn status_reads_never_charge() {
    let s = start(DEMO);
    let client = reqwest::Client::new();
    for _ in 0..3 {
        client.post(format!("{}/v1/ratelimit", s.base)).json(&body("demo", &[("user", "carol")])).send().await.unwrap();
    }
    for _ in 0..10 {
        let r = client.get(format!("{}/v1/ratelimit?domain=demo&user=carol", s.base)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(num(&r, "x-ratelimit-remaining"), 47);
        let json: serde_json::Value = r.json().await.unwrap();
        assert_eq!(json["statuses"][0]["policies"][0]["used"], 3);
    }
    let r =
        client.post(format!("{}/v1/ratelimit", s.base)).json(&body("demo", &[("user", "carol")])).send().await.unwrap();
    assert_eq!(num(&r, "x-ratelimit-remaining"), 46);
    // spent: the read answers for a request of cost 1, and every part of it says so
    for _ in 0..46 {
        client.post(format!("{}/v1/ratelimit", s.base)).json(&body("demo", &[("user", "carol")])).send().await.unwrap();
    }
    let r = client.get(format!("{}/v1/ratelimit?domain=demo&user=carol", s.base)).send().await.unwrap();
    assert_eq!(r.status(), 200, "a status read is answered");
    let json: serde_json::Value = r.json().await.unwrap();
    assert_eq!(json["overall_code"], "OVER_LIMIT", "{json}");
    assert_eq!(json["statuses"][0]["code"], "OVER_LIMIT", "{json}");
    let policy = &json["statuses"][0]["policies"][0];
    assert_eq!(
        (&policy["allowed"], &policy["remaining"], &policy["used"]),
        (&false.into(), &0.into(), &50.into()),
        "{json}"
    );
}

/// Bad input gets a 4xx with a JSON error naming the problem, and the server keeps
/// answering.
#[tokio::test]
async fn bad_input_is_refused_clearly() {
    let s = start(DEMO);
    let client = reqwest::Client::new();
    let url = format!("{}/v1/ratelimit", s.base);
    let raw = |b: String| client.post(&url).header("content-type", "application/json").body(b).send();
    let huge = "x".repeat(1 << 20);
    let long = "y".repeat(2000);
    let cases: Vec<(String, u16, &str, &str)> = vec![
        ("{\"domain\": \"demo\", \"descriptors\": [".into(), 400, "invalid_json", "EOF"),
        ("not json".into(), 400, "invalid_json", "expected"),
        (r#"{"domain":"demo","descriptors":[]}"#.into(), 400, "empty_descriptors", "descriptors"),
        (r#"{"domain":"demo","descriptors":[{"entries":[]}]}"#.into(), 400, "empty_descriptors", "entries"),
        (body("demo", &[("user", &huge)]).to_string(), 413, "body_too_large", "larger than"),
        (body("demo", &[("user", &long)]).to_string(), 400, "bad_entry", "2000 bytes"),
        (
            r#"{"domain":"demo","hits_addend":9223372036854775808,"descriptors":[{"entries":[{"key":"user","value":"a"}]}]}"#.into(),
            400,
            "cost_above_capacity",
            "9223372036854775808",
        ),
        (
            r#"{"domain":"demo","descriptors":[{"hits_addend":51,"entries":[{"key":"user","value":"a"}]}]}"#.into(),
            400,
            "cost_above_capacity",
            "capacity 50",
        ),
        (body("nope", &[("user", "a")]).to_string(), 400, "unknown_domain", "unknown domain 'nope': no rules"),
        (r#"{"domain":"demo","descriptor":[]}"#.into(), 400, "invalid_json", "unknown field `descriptor`"),
    ];
    for (b, status, code, needle) in cases {
        let r = raw(b.clone()).await.unwrap();
        assert_eq!(r.status(), status, "for body {:.80}", b);
        let json: serde_json::Value = r.json().await.unwrap();
        assert_eq!(json["error"]["code"], code, "{json}");
        let message = json["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{message:?} should mention {needle:?}");
        // the configured domains are named to no caller of the data plane
        assert!(!message.contains("demo"), "{message:?}");
    }
    let r = client.get(format!("{}/healthz", s.base)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = client.post(&url).json(&body("demo", &[("user", "a")])).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(num(&r, "x-ratelimit-remaining"), 49, "refused requests charged nothing");
}

/// A descriptor no rule matches is allowed, and the body says so (Envoy's semantics).
#[tokio::test]
async fn unmatched_descriptors_are_allowed() {
    let s = start(DEMO);
    let r = reqwest::Client::new()
        .post(format!("{}/v1/ratelimit", s.base))
        .json(&body("demo", &[("path", "/x")]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-ratelimit-limit"), "");
    let json: serde_json::Value = r.json().await.unwrap();
    assert_eq!(json["statuses"][0]["matched"], false);
    assert_eq!(json["statuses"][0]["code"], "OK");
}

/// Leases: capacity 3 gives 200, 200, 200, 429; a release frees a place.
#[tokio::test]
async fn leases_take_and_release() {
    let s = start(
        "  - domain: d\n    descriptors:\n      - key: user\n        policies:\n          - {name: inflight, concurrency: {limit: 3, lease_ttl: 60s}}\n",
    );
    let client = reqwest::Client::new();
    let take = || client.post(format!("{}/v1/leases", s.base)).json(&body("d", &[("user", "u")])).send();
    let mut ids = Vec::new();
    for _ in 0..3 {
        let r = take().await.unwrap();
        assert_eq!(r.status(), 200);
        let json: serde_json::Value = r.json().await.unwrap();
        ids.push(json["lease_id"].as_str().unwrap().to_string());
    }
    let r = take().await.unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(num(&r, "x-ratelimit-remaining"), 0);
    // /v1/ratelimit never takes leases
    let r = client.post(format!("{}/v1/ratelimit", s.base)).json(&body("d", &[("user", "u")])).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = client.delete(format!("{}/v1/leases/{}", s.base, ids[0])).send().await.unwrap();
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["released"], true);
    let r = client.delete(format!("{}/v1/leases/{}", s.base, ids[0])).send().await.unwrap();
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["released"], false, "release is idempotent");
    assert_eq!(take().await.unwrap().status(), 200);
    let r = client.delete(format!("{}/v1/leases/zz", s.base)).send().await.unwrap();
    assert_eq!(r.status(), 400);
}

/// `POST /v1/refund` gives a charge back.
#[tokio::test]
async fn refund_gives_back() {
    let s = start(DEMO);
    let client = reqwest::Client::new();
    for _ in 0..5 {
        client.post(format!("{}/v1/ratelimit", s.base)).json(&body("demo", &[("user", "r")])).send().await.unwrap();
    }
    let mut b = body("demo", &[("user", "r")]);
    b["hits_addend"] = 2.into();
    let r = client.post(format!("{}/v1/refund", s.base)).json(&b).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = client.get(format!("{}/v1/ratelimit?domain=demo&user=r", s.base)).send().await.unwrap();
    assert_eq!(num(&r, "x-ratelimit-used"), 3);
}

/// `sluice config check`: exit 0 when valid; otherwise file:line:col and the problem.
#[test]
fn config_check_points_at_the_problem() {
    let dir = sluice_testkit::TempDir::new("sluice-config");
    let bad = dir.path().join("bad.yaml");
    // the unknown unit is on line 7
    std::fs::write(
        &bad,
        "server:\n  http: 127.0.0.1:9999\ndomains:\n  - domain: demo\n    descriptors:\n      - key: user\n        rate_limit: {unit: fortnight, requests_per_unit: 5}\n",
    )
    .unwrap();
    let out = std::process::Command::new(bin()).args(["config", "check"]).arg(&bad).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("{}:7:", bad.display())), "{err}");
    assert!(err.contains("unknown unit `fortnight`") && err.contains("minute"), "{err}");

    // a Redis store's bucket count out of range, on line 4
    let bad = dir.path().join("buckets.yaml");
    std::fs::write(&bad, "store:\n  kind: redis\n  url: redis://127.0.0.1:1/\n  buckets: 0\ndomains: []\n").unwrap();
    let out = std::process::Command::new(bin()).args(["config", "check"]).arg(&bad).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("{}:4:", bad.display())) && err.contains("`buckets` is 0; write 1 to"), "{err}");

    let good = dir.path().join("good.yaml");
    std::fs::write(&good, "domains:\n  - domain: demo\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 5}\n").unwrap();
    let out = std::process::Command::new(bin()).args(["config", "check"]).arg(&good).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `sluice serve` with no arguments answers on 127.0.0.1:8080 with the built-in config,
/// and stops cleanly on SIGTERM.
#[tokio::test]
async fn serve_without_arguments_uses_the_defaults() {
    assert!(
        std::net::TcpListener::bind("127.0.0.1:8080").is_ok(),
        "port 8080 is taken by another process; this test needs it free"
    );
    let mut p = sluice_testkit::Process::spawn(std::process::Command::new(bin()).arg("serve")).unwrap();
    assert!(sluice_testkit::wait_for_port(8080, Duration::from_secs(10)));
    let client = reqwest::Client::new();
    let r = client.get("http://127.0.0.1:8080/healthz").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r =
        client.post("http://127.0.0.1:8080/v1/ratelimit").json(&body("demo", &[("user", "x")])).send().await.unwrap();
    assert_eq!(num(&r, "x-ratelimit-limit"), 50, "the built-in config has demo/user at 50 per minute");
    p.signal("-TERM");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !p.exited() {
        assert!(Instant::now() < deadline, "sluice did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A lease never released comes back after its TTL.
#[tokio::test]
async fn lost_leases_come_back_after_their_ttl() {
    let s = start(
        "  - domain: d\n    descriptors:\n      - key: user\n        policies:\n          - {name: inflight, concurrency: {limit: 1, lease_ttl: 1s}}\n",
    );
    let client = reqwest::Client::new();
    let take = || client.post(format!("{}/v1/leases", s.base)).json(&body("d", &[("user", "lost")])).send();
    assert_eq!(take().await.unwrap().status(), 200);
    let r = take().await.unwrap();
    assert_eq!(r.status(), 429);
    let wait = num(&r, "retry-after");
    assert!((1..=2).contains(&wait), "retry-after {wait}");
    tokio::time::sleep(Duration::from_millis(1_050)).await;
    assert_eq!(take().await.unwrap().status(), 200, "the lost lease was reclaimed after its TTL");
}

/// The HTTP API answers as envoyproxy/ratelimit's service does where Envoy's fields
/// are used: a limit the config gives no name reports an empty `current_limit.name`
/// (their basic_config fixture, key3), and an `unlimited` descriptor reports the most
/// there is remaining, 2^32 - 1 (their README, example 5); /json and gRPC say the same.
#[tokio::test]
async fn unnamed_and_unlimited_answers_match_envoys_service() {
    let s = start(
        "  - domain: test-domain\n    descriptors:\n      - key: key3\n        rate_limit: {unit: day, requests_per_unit: 1}\n      - key: foo\n        value: bar\n        rate_limit: {unlimited: true}\n",
    );
    let body = serde_json::json!({"domain": "test-domain", "descriptors": [
        {"entries": [{"key": "key3", "value": "x"}]}, {"entries": [{"key": "foo", "value": "bar"}]}]});
    let c = reqwest::Client::new();
    let own: serde_json::Value =
        c.post(format!("{}/v1/ratelimit", s.base)).json(&body).send().await.unwrap().json().await.unwrap();
    assert_eq!(own["statuses"][0]["current_limit"]["name"], "", "{own}");
    assert_eq!(own["statuses"][0]["policies"][0]["name"], "key3", "the policy keeps its given name: {own}");
    assert_eq!(own["statuses"][1]["limit_remaining"], 4_294_967_295u64, "{own}");
    let theirs: serde_json::Value =
        c.post(format!("{}/json", s.base)).json(&body).send().await.unwrap().json().await.unwrap();
    assert!(theirs["statuses"][0]["currentLimit"].get("name").is_none(), "{theirs}");
    assert_eq!(theirs["statuses"][1]["limitRemaining"], 4_294_967_295u64, "{theirs}");
}
