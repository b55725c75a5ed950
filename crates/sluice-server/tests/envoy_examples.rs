//! envoyproxy/ratelimit's README examples (1 to 11, in `tests/envoy-examples/`), loaded
//! unchanged from a directory, answered over Envoy's gRPC as that README says they are;
//! then the answers a migrating user relies on beyond them: unknown domains, empty
//! descriptors and costs above a limit as theirs answers them, `dynamic_metadata`, and
//! their HTTP endpoints `POST /json` and `GET /healthcheck`.

mod common;

use common::{Sluice, metrics, start_with};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus, rate_limit::Unit};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use serde_json::{Value, json};

type Client = RateLimitServiceClient<tonic::transport::Channel>;

fn examples() -> Sluice {
    let dir = format!("{}/tests/envoy-examples", env!("CARGO_MANIFEST_DIR"));
    start_with(
        &format!("domains_from: \"{dir}\"\nenvoy: {{merge_domains: true, response_dynamic_metadata: true}}\n"),
        "  []\n",
    )
}

/// `ShouldRateLimit` for `descriptors`, each charged `hits` (0: the default, 1).
async fn ask(rls: &mut Client, domain: &str, descriptors: &[&[(&str, &str)]], hits: u32) -> RateLimitResponse {
    let descriptors = descriptors
        .iter()
        .map(|entries| RateLimitDescriptor {
            entries: entries.iter().map(|(k, v)| Entry { key: (*k).into(), value: (*v).into() }).collect(),
            ..Default::default()
        })
        .collect();
    let request = RateLimitRequest { domain: domain.into(), descriptors, hits_addend: hits };
    rls.should_rate_limit(request).await.expect("an answer").into_inner()
}

/// A status's code, limit (requests per unit, unit, name) and remaining.
fn seen(s: &DescriptorStatus) -> (Code, Option<(u32, Unit, String)>, u32) {
    let limit = s.current_limit.as_ref().map(|l| (l.requests_per_unit, l.unit(), l.name.clone()));
    (s.code(), limit, s.limit_remaining)
}

async fn client(s: &Sluice) -> Client {
    RateLimitServiceClient::connect(format!("http://{}", s.grpc)).await.unwrap()
}

#[tokio::test]
async fn examples_1_to_5_match_limit_and_block_as_their_readme_says() {
    let s = examples();
    let mut rls = client(&s).await;
    // 1: two values of one key, 500 a second each; another value has no limit
    let r = ask(&mut rls, "mongo_cps", &[&[("database", "users")]], 0).await;
    assert_eq!(seen(&r.statuses[0]), (Code::Ok, Some((500, Unit::Second, String::new())), 499));
    let r = ask(&mut rls, "mongo_cps", &[&[("database", "other")]], 0).await;
    assert_eq!(seen(&r.statuses[0]), (Code::Ok, None, 0));
    // 2: marketing messages to a number, 5 a day, and every message to it, 100 a day
    let both: &[&[(&str, &str)]] =
        &[&[("message_type", "marketing"), ("to_number", "2061111111")], &[("to_number", "2061111111")]];
    for left in (0..5).rev() {
        let r = ask(&mut rls, "messaging", both, 0).await;
        assert_eq!((r.overall_code(), r.statuses[0].limit_remaining), (Code::Ok, left));
    }
    for _ in 0..3 {
        let r = ask(&mut rls, "messaging", both, 0).await;
        assert_eq!(r.overall_code(), Code::OverLimit);
        // nothing charged when refused: the day's count of the number stays at 5
        assert_eq!(seen(&r.statuses[1]), (Code::Ok, Some((100, Unit::Day, String::new())), 95));
    }
    // 3: the most specific match; requests_per_unit 0 blocks that address
    let r = ask(&mut rls, "edge_proxy_per_ip", &[&[("remote_address", "50.0.0.5")]], 0).await;
    assert_eq!(seen(&r.statuses[0]), (Code::OverLimit, Some((0, Unit::Second, String::new())), 0));
    let r = ask(&mut rls, "edge_proxy_per_ip", &[&[("remote_address", "50.0.0.1")]], 0).await;
    assert_eq!(seen(&r.statuses[0]), (Code::Ok, Some((10, Unit::Second, String::new())), 9));
    // 4: a descriptor deeper than the rules matches nothing; the nested rule matches it
    let deeper: &[&[(&str, &str)]] = &[&[("key", "value"), ("subkey", "subvalue")]];
    assert_eq!(seen(&ask(&mut rls, "example4", deeper, 0).await.statuses[0]), (Code::Ok, None, 0));
    let r = ask(&mut rls, "example4_nested", deeper, 0).await;
    assert_eq!(seen(&r.statuses[0]), (Code::Ok, Some((300, Unit::Second, String::new())), 299));
    // 5: unlimited answers OK with the largest remaining, and no limit
    let r = ask(&mut rls, "internal", &[&[("ldap", "x")]], 0).await;
    assert_eq!(seen(&r.statuses[0]), (Code::Ok, None, u32::MAX));
    assert!(r.response_headers_to_add.is_empty(), "no limit, so no rate limit headers");
    let r = ask(&mut rls, "internal", &[&[("ldap", "x")], &[("azure", "y")]], 0).await;
    assert_eq!(seen(&r.statuses[1]), (Code::Ok, Some((100, Unit::Minute, String::new())), 99));
}

#[tokio::test]
async fn examples_6_to_9_shadow_replaces_detailed_metrics_and_wildcards() {
    let s = examples();
    let mut rls = client(&s).await;
    // 6: user-a's rule is in shadow mode: reported, never refused; user-b's is enforced.
    // A cost above the limit is refused by the limit (theirs: OVER_LIMIT, not an error)
    let a: &[&[(&str, &str)]] = &[&[("service", "auth-service"), ("user", "user-a")]];
    let r = ask(&mut rls, "example6", a, 11).await;
    assert_eq!(r.overall_code(), Code::Ok);
    assert_eq!(seen(&r.statuses[0]), (Code::Ok, Some((10, Unit::Second, String::new())), 0));
    let b: &[&[(&str, &str)]] = &[&[("service", "auth-service"), ("user", "user-b")]];
    let r = ask(&mut rls, "example6", b, 21).await;
    assert_eq!(seen(&r.statuses[0]), (Code::OverLimit, Some((20, Unit::Second, String::new())), 0));
    // 7: the replacing limit (10/s) applies; the replaced one is not reported or charged
    let user = ("user", "bkthomps");
    let r = ask(&mut rls, "example7", &[&[("key_1", "value_1"), user], &[("key_2", "value_2"), user]], 0).await;
    assert_eq!(seen(&r.statuses[0]), (Code::Ok, None, 0));
    assert_eq!(seen(&r.statuses[1]), (Code::Ok, Some((10, Unit::Second, String::new())), 9));
    let r = ask(&mut rls, "example7", &[&[("key_1", "value_1"), user]], 0).await;
    let named = Some((5, Unit::Second, "specific_limit".to_string()));
    assert_eq!(seen(&r.statuses[0]), (Code::Ok, named, 4), "alone, it applies, named as configured");
    // 8: the key-alone rule counts each value apart in the metrics; value1 has its own limit
    for v in ["unspecified_value", "unspecified_value2"] {
        assert_eq!(ask(&mut rls, "example8", &[&[("key1", v)]], 0).await.statuses[0].limit_remaining, 9);
    }
    let r = ask(&mut rls, "example8", &[&[("key1", "value1")]], 0).await;
    assert_eq!(seen(&r.statuses[0]), (Code::Ok, Some((20, Unit::Minute, String::new())), 19));
    let m = metrics(&reqwest::Client::new(), &s.base).await;
    for label in ["descriptor=\"key1_unspecified_value\"", "descriptor=\"key1_unspecified_value2\""] {
        assert!(m.lines().any(|l| l.starts_with("sluice_decisions_detailed_total") && l.contains(label)), "{label}");
    }
    // 9: three files of one domain, merged; a * anywhere, several of them
    for (key, value, limited) in [
        ("key1", "valueXYZ", true),
        ("path", "/api/123/action", true),
        ("path", "/api/123/other", false),
        ("route", "/api/v2/resource/456/action", true),
        ("route", "/api/v2/resource/456", false),
    ] {
        let r = ask(&mut rls, "example9", &[&[(key, value)]], 0).await;
        assert_eq!(r.statuses[0].current_limit.is_some(), limited, "{key}={value}");
    }
}

#[tokio::test]
async fn examples_10_and_11_values_in_metrics_and_shared_thresholds() {
    let s = examples();
    let mut rls = client(&s).await;
    // 10: the values of the rules with value_to_metric name the counters' series
    for (route, method) in [("api", "GET"), ("web", "POST")] {
        ask(&mut rls, "example10", &[&[("route", route), ("http_method", method), ("subject_id", "123")]], 0).await;
    }
    let read = &[("user", "alice"), ("action", "readfile"), ("resource", "documents")];
    ask(&mut rls, "example10_wildcard", &[read], 0).await;
    ask(&mut rls, "example11_metrics", &[&[("route", "api/v1"), ("method", "GET")]], 0).await;
    // 11: every files/* shares one threshold; each files_no_share/* has its own
    for (value, hits, code) in
        [("files/a.pdf", 5, Code::Ok), ("files/b.csv", 5, Code::Ok), ("files/c.txt", 1, Code::OverLimit)]
    {
        assert_eq!(ask(&mut rls, "example11", &[&[("files", value)]], hits).await.overall_code(), code, "{value}");
    }
    let own = |v| [("files_no_share", v)];
    assert_eq!(ask(&mut rls, "example11", &[&own("files_no_share/a.pdf")], 10).await.overall_code(), Code::Ok);
    assert_eq!(ask(&mut rls, "example11", &[&own("files_no_share/a.pdf")], 1).await.overall_code(), Code::OverLimit);
    assert_eq!(ask(&mut rls, "example11", &[&own("files_no_share/b.csv")], 10).await.overall_code(), Code::Ok);
    let m = metrics(&reqwest::Client::new(), &s.base).await;
    for label in [
        "route_api.http_method_GET.subject_id",
        "route_web.http_method_POST.subject_id",
        "user_alice.action_readfile.resource",
    ] {
        let line = format!("descriptor=\"{label}\"");
        assert!(
            m.lines().any(|l| l.starts_with("sluice_decisions_detailed_total") && l.contains(&line)),
            "{label}:\n{m}"
        );
    }
    // a shared wildcard is counted as the wildcard (theirs: `route_api/*.method`, the
    // rule's own key): the rule's own series, no series by value
    let shared = |l: &&str| l.contains("domain=\"example11_metrics\"");
    assert!(m.lines().filter(shared).any(|l| l.starts_with("sluice_decisions_total")), "{m}");
    assert!(!m.lines().filter(shared).any(|l| l.starts_with("sluice_decisions_detailed_total")), "{m}");
}

/// A drop-in answers what their service answers where Sluice's own API would refuse: an
/// unknown domain and a descriptor without entries are OK; and `dynamic_metadata`
/// carries the request and the `metadata` of the rules that allowed.
#[tokio::test]
async fn unknown_domains_empty_descriptors_and_dynamic_metadata() {
    let domains = "  - domain: d\n    descriptors:\n      - key: user\n        metadata: {team: {name: core, on_call: true}}\n        rate_limit: {unit: minute, requests_per_unit: 1}\n      - key: plan\n        metadata: {team: {tier: gold}}\n        rate_limit: {unit: minute, requests_per_unit: 5}\n";
    let s = start_with("envoy: {response_dynamic_metadata: true}\n", domains);
    let mut rls = client(&s).await;
    let r = ask(&mut rls, "nowhere", &[&[("user", "a")]], 0).await;
    assert_eq!((r.overall_code(), seen(&r.statuses[0])), (Code::Ok, (Code::Ok, None, 0)));
    let no_entries: &[(&str, &str)] = &[];
    let r = ask(&mut rls, "d", &[no_entries], 0).await;
    assert_eq!(r.overall_code(), Code::Ok, "a descriptor with no entries matches nothing");
    let e = rls.should_rate_limit(RateLimitRequest { domain: String::new(), ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "an empty domain is an error there too");
    let r = ask(&mut rls, "d", &[&[("user", "a")], &[("plan", "p")]], 2).await;
    let json = |r: &RateLimitResponse| struct_json(r.dynamic_metadata.as_ref().expect("dynamic_metadata"));
    let meta = json(&r);
    assert_eq!(meta["domain"], "d");
    assert_eq!(meta["hitsAddend"], 2.0);
    assert_eq!(meta["descriptors"][1]["entries"], json!(["plan=p"]));
    assert_eq!(meta["metadata"], json!({"team": {"tier": "gold"}}), "user a was refused (2 > 1): only plan's");
    let r = ask(&mut rls, "d", &[&[("user", "b")], &[("plan", "q")]], 0).await;
    assert_eq!(json(&r)["metadata"], json!({"team": {"name": "core", "on_call": true, "tier": "gold"}}), "merged");
}

/// `google.protobuf.Struct` as JSON.
fn struct_json(s: &envoy_types::pb::google::protobuf::Struct) -> Value {
    fn value(v: &envoy_types::pb::google::protobuf::Value) -> Value {
        use envoy_types::pb::google::protobuf::value::Kind;
        match &v.kind {
            Some(Kind::NumberValue(n)) => json!(n),
            Some(Kind::StringValue(s)) => json!(s),
            Some(Kind::BoolValue(b)) => json!(b),
            Some(Kind::StructValue(s)) => struct_json(s),
            Some(Kind::ListValue(l)) => Value::Array(l.values.iter().map(value).collect()),
            Some(Kind::NullValue(_)) | None => Value::Null,
        }
    }
    Value::Object(s.fields.iter().map(|(k, v)| (k.clone(), value(v))).collect())
}

/// `POST /json` and `GET /healthcheck`, as their README documents them.
#[tokio::test]
async fn their_http_endpoints() {
    let s = examples();
    let c = reqwest::Client::new();
    let post = |body: Value| c.post(format!("{}/json", s.base)).json(&body).send();
    let body = json!({"domain": "internal", "descriptors": [{"entries": [{"key": "azure", "value": "x"}]}]});
    let r = post(body.clone()).await.unwrap();
    assert_eq!(r.status(), 200);
    let answer: Value = r.json().await.unwrap();
    assert_eq!(answer["overallCode"], "OK");
    assert_eq!(answer["statuses"][0]["currentLimit"], json!({"requestsPerUnit": 100, "unit": "MINUTE"}));
    assert_eq!(answer["statuses"][0]["limitRemaining"], 99);
    assert!(answer["statuses"][0]["durationUntilReset"].as_str().unwrap().ends_with('s'));
    // protobuf's own field names are read too, and a refusal is a 429
    let blocked = json!({"domain": "edge_proxy_per_ip", "hits_addend": 1,
        "descriptors": [{"entries": [{"key": "remote_address", "value": "50.0.0.5"}]}]});
    let r = post(blocked).await.unwrap();
    assert_eq!(r.status(), 429);
    let answer: Value = r.json().await.unwrap();
    assert_eq!(answer["overallCode"], "OVER_LIMIT");
    assert_eq!(answer["statuses"][0]["code"], "OVER_LIMIT");
    assert!(answer["statuses"][0].get("limitRemaining").is_none(), "0 is left out, as protobuf's mapping does");
    for bad in
        [json!({"domain": "internal", "descriptors": [{"entries": [{"key": "azure"}], "colour": 1}]}), json!([1])]
    {
        let r = post(bad.clone()).await.unwrap();
        assert_eq!(r.status(), 400, "{bad}");
    }
    let r = c.get(format!("{}/healthcheck", s.base)).send().await.unwrap();
    assert_eq!((r.status().as_u16(), r.text().await.unwrap()), (200, "OK".to_string()));
}
