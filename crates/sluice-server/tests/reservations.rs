//! Reservations over HTTP on the default store: `POST /v1/reservations` holds an
//! estimate, `POST /v1/reservations/{id}/commit` settles the actual; input and output
//! amounts held against different rules; an orphan released at its deadline; a token
//! taken back only as issued.

mod common;

use base64::Engine as _;
use common::start;
use serde_json::{Value, json};
use std::time::Duration;

const DOMAINS: &str = "  - domain: llm
    descriptors:
      - key: user
        descriptors:
          - key: tokens
            value: input
            rate_limit: {unit: minute, requests_per_unit: 1000}
          - key: tokens
            value: output
            rate_limit: {unit: minute, requests_per_unit: 100}
      - key: bucket
        policies: [{name: b, token_bucket: {rate: 10, per: 1s, burst: 10}}]
";

fn output(user: &str) -> Value {
    json!({"entries": [{"key": "user", "value": user}, {"key": "tokens", "value": "output"}]})
}

async fn reserve(client: &reqwest::Client, base: &str, body: Value) -> (u16, Value) {
    let r = client.post(format!("{base}/v1/reservations")).json(&body).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

async fn commit(client: &reqwest::Client, base: &str, id: &str, body: Value) -> (u16, Value) {
    let r = client.post(format!("{base}/v1/reservations/{id}/commit")).json(&body).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// What the output rule of `user` has used, by a status call (never charging).
async fn used(client: &reqwest::Client, base: &str, user: &str) -> u64 {
    let url = format!("{base}/v1/ratelimit?domain=llm&user={user}&tokens=output");
    let v: Value = client.get(url).send().await.unwrap().json().await.unwrap();
    v["statuses"][0]["policies"][0]["used"].as_u64().unwrap_or_else(|| panic!("{v}"))
}

#[tokio::test]
async fn an_estimate_is_held_and_the_actual_settled_once() {
    let s = start(DOMAINS);
    let (client, base) = (reqwest::Client::new(), s.base.clone());
    let hold = |amount: u64| json!({"domain": "llm", "descriptors": [output("ann")], "amount": amount, "ttl": "30s"});
    let (code, first) = reserve(&client, &base, hold(60)).await;
    assert_eq!(code, 200, "{first}");
    let first_id = first["reservation_id"].as_str().unwrap().to_string();
    let (code, refused) = reserve(&client, &base, hold(50)).await;
    assert_eq!(code, 429, "60 held + 50 > 100: {refused}");
    assert!(refused.get("reservation_id").is_none());
    assert_eq!(used(&client, &base, "ann").await, 60, "held counts as used");
    let (code, settled) = commit(&client, &base, &first_id, json!({"actual": 30})).await;
    assert_eq!((code, &settled["settled"]), (200, &json!(["committed"])));
    assert_eq!(used(&client, &base, "ann").await, 30, "the actual replaced the estimate");
    let (code, second) = reserve(&client, &base, hold(50)).await;
    assert_eq!(code, 200, "{second}");
    let second_id = second["reservation_id"].as_str().unwrap();
    // an underestimate is charged, never refused
    assert_eq!(commit(&client, &base, second_id, json!({"actual": 80})).await.0, 200);
    assert_eq!(used(&client, &base, "ann").await, 110);
    let (_, again) = commit(&client, &base, &first_id, json!({"actual": 30})).await;
    assert_eq!(again["settled"], json!(["again"]), "a commit sent twice settles once");
    assert_eq!(used(&client, &base, "ann").await, 110);
    // an id is short and names no value: what it carries is keyed digests
    assert!(first_id.len() < 160, "{} bytes: {first_id}", first_id.len());
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(&first_id).unwrap();
    assert!(!bytes.windows(3).any(|w| w == b"ann"), "the id names the user");
    // a token altered (anywhere: its reservation, or its seal), or made up, is refused
    let flip = |at: usize| {
        let mut b = bytes.clone();
        b[at] ^= 1;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
    };
    for forged in [flip(0), flip(9), flip(bytes.len() / 2), flip(bytes.len() - 1), format!("{first_id}A"), "x".into()]
        .into_iter()
        .filter(|f| *f != first_id)
    {
        let (code, e) = commit(&client, &base, &forged, json!({"actual": 1})).await;
        assert_eq!((code, e["error"]["code"].as_str()), (400, Some("bad_reservation_id")), "{forged}: {e}");
    }
    assert_eq!(used(&client, &base, "ann").await, 110);
}

/// One request holds its input tokens (known) and an output estimate against two rules,
/// and commits each its own actual.
#[tokio::test]
async fn input_and_output_are_held_apart() {
    let s = start(DOMAINS);
    let (client, base) = (reqwest::Client::new(), s.base.clone());
    let input =
        json!({"entries": [{"key": "user", "value": "bo"}, {"key": "tokens", "value": "input"}], "hits_addend": 400});
    let body = json!({"domain": "llm", "descriptors": [input, output("bo")], "amount": 90});
    let (code, held) = reserve(&client, &base, body).await;
    assert_eq!(code, 200, "{held}");
    let id = held["reservation_id"].as_str().unwrap();
    let (code, settled) = commit(&client, &base, id, json!({"actuals": [400, 35]})).await;
    assert_eq!((code, &settled["settled"]), (200, &json!(["committed", "committed"])), "{settled}");
    assert_eq!(used(&client, &base, "bo").await, 35);
    let url = format!("{base}/v1/ratelimit?domain=llm&user=bo&tokens=input");
    let v: Value = client.get(url).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["statuses"][0]["policies"][0]["used"], 400);
    let (code, e) = commit(&client, &base, id, json!({"actuals": [1]})).await;
    assert_eq!(code, 400, "one number for two descriptors: {e}");
}

/// A reservation never committed (a client gone mid-stream) holds nothing after its TTL;
/// a rule that is not a fixed window is refused by name; bad TTLs are refused.
#[tokio::test]
async fn orphans_lapse_and_mistakes_are_named() {
    let s = start(DOMAINS);
    let (client, base) = (reqwest::Client::new(), s.base.clone());
    let body = json!({"domain": "llm", "descriptors": [output("cy")], "amount": 100, "ttl": "300ms"});
    assert_eq!(reserve(&client, &base, body.clone()).await.0, 200);
    assert_eq!(reserve(&client, &base, body.clone()).await.0, 429, "the budget is held");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(used(&client, &base, "cy").await, 0, "released at its deadline");
    assert_eq!(reserve(&client, &base, body).await.0, 200, "the budget is whole again");
    let bucket = json!({"domain": "llm", "descriptors": [{"entries": [{"key": "bucket", "value": "x"}]}], "amount": 1});
    let (code, e) = reserve(&client, &base, bucket).await;
    assert_eq!((code, e["error"]["code"].as_str()), (400, Some("not_reservable")), "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("'b'"), "{e}");
    for ttl in ["0s", "2h"] {
        let body = json!({"domain": "llm", "descriptors": [output("cy")], "amount": 1, "ttl": ttl});
        let (code, e) = reserve(&client, &base, body).await;
        assert_eq!((code, e["error"]["code"].as_str()), (400, Some("bad_ttl")), "{ttl}: {e}");
    }
}

/// Where reservations cannot be served it is said, never silently skipped: memcached
/// answers each one with the reason, `limiter.reservations: true` refuses it when the
/// config loads (naming the line), and `limiter.reservations: false` turns them off.
#[tokio::test]
async fn a_store_without_reservations_says_so() {
    let memcached = sluice_testkit::MemcachedServer::start();
    let store = format!("store:\n  kind: memcached\n  servers: [\"{}\"]\n", memcached.addr());
    let s = common::start_with(
        &store,
        "  - domain: llm\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 100}\n",
    );
    let client = reqwest::Client::new();
    let body = json!({"domain": "llm", "descriptors": [{"entries": [{"key": "user", "value": "x"}]}], "amount": 1});
    let (code, e) = reserve(&client, &s.base, body.clone()).await;
    assert_eq!((code, e["error"]["code"].as_str()), (400, Some("no_reservations")), "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("memcached store keeps no reservations"), "{e}");
    // asked for, with memcached: refused at load, at the line
    let dir = sluice_testkit::TempDir::new("sluice-reservations-check");
    let config = dir.path().join("sluice.yaml");
    let text = format!("{store}limiter:\n  reservations: true\ndomains:\n  - domain: llm\n    descriptors: []\n");
    std::fs::write(&config, &text).unwrap();
    let out = std::process::Command::new(common::bin()).args(["config", "check"]).arg(&config).output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("sluice.yaml:5:") && said.contains("store memcached keeps no reservations"), "{said}");
    // turned off
    let off = start_with_off().await;
    let (code, e) = reserve(&client, &off.base, body).await;
    assert_eq!((code, e["error"]["code"].as_str()), (400, Some("no_reservations")), "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("limiter.reservations: false"), "{e}");
}

async fn start_with_off() -> common::Sluice {
    common::start_with(
        "limiter:\n  reservations: false\n",
        "  - domain: llm\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 100}\n",
    )
}

/// Ids are bounded whatever is reserved: a reservation of the most windows it may hold
/// (64: 32 users under two policies each, values of 1,000 bytes) gets an id under the
/// longest one taken back (8 KB, `service::budget::MAX_TOKEN`) that commits; one more
/// window is refused with the reason; an id past 8 KB is refused without being decoded.
#[tokio::test]
async fn ids_are_bounded_at_every_size() {
    let two = "  - domain: wide\n    descriptors:\n      - key: user\n        policies:\n          - {name: minute, fixed_window: {limit: 100000, window: 1m}}\n          - {name: hour, fixed_window: {limit: 100000, window: 1h}}\n";
    let s = start(two);
    let (client, base) = (reqwest::Client::new(), s.base.clone());
    let users = |n: usize| -> Vec<Value> {
        (0..n).map(|i| json!({"entries": [{"key": "user", "value": format!("{i:0>1000}")}]})).collect()
    };
    let (code, held) = reserve(&client, &base, json!({"domain": "wide", "descriptors": users(32), "amount": 1})).await;
    assert_eq!(code, 200, "{held}");
    let id = held["reservation_id"].as_str().unwrap();
    assert!(id.len() < 8_192, "the id of 64 windows is {} bytes", id.len());
    let (code, settled) = commit(&client, &base, id, json!({"actual": 1})).await;
    assert_eq!((code, settled["settled"].as_array().map(Vec::len)), (200, Some(64)), "{settled}");
    let (code, e) = reserve(&client, &base, json!({"domain": "wide", "descriptors": users(33), "amount": 1})).await;
    assert_eq!((code, e["error"]["code"].as_str()), (400, Some("bad_reservation")), "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("66 windows"), "{e}");
    let long = "A".repeat(8_193);
    let (code, e) = commit(&client, &base, &long, json!({"actual": 1})).await;
    assert_eq!((code, e["error"]["code"].as_str()), (400, Some("bad_reservation_id")), "{e}");
}
