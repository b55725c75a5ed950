//! The engine end to end over the memory store, under a manual clock: window boundaries
//! and refills are crossed by moving the clock, never by sleeping.

use sluice::config::RulesConfig;
use sluice::store::MemoryStore;
use sluice::time::ManualClock;
use sluice::{CheckError, Code, Descriptor, Entry, Outcome, Request, RequestError};
use sluice::{Limiter, headers};
use std::sync::Arc;

const T0: u64 = 1_767_225_600_000;

/// The domains of a YAML config, compiled, behind an engine with a manual clock.
fn limiter(domains: &str) -> (Limiter, ManualClock) {
    // the config model is YAML-shaped; the library has no YAML parser, so build it by
    // way of JSON, which serde reads through the same derive
    let config: RulesConfig = serde_json::from_str(domains).expect("test config");
    let clock = ManualClock::new(T0);
    let rules = Arc::new(config.compile().expect("rules compile"));
    (Limiter::new(rules, Arc::new(MemoryStore::new(10_000)), Arc::new(clock.clone())), clock)
}

/// Domain `d`: each `user` may make `limit` requests a minute.
fn user_per_minute(limit: u64) -> String {
    format!(
        r#"{{"domains":[{{"domain":"d","descriptors":[{{"key":"user","rate_limit":{{"unit":"minute","requests_per_unit":{limit}}}}}]}}]}}"#
    )
}

fn req(domain: &str, descriptors: &[&[(&str, &str)]]) -> Request {
    Request {
        domain: domain.into(),
        descriptors: descriptors
            .iter()
            .map(|entries| Descriptor {
                entries: entries.iter().map(|(k, v)| Entry { key: (*k).into(), value: (*v).into() }).collect(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

fn header(v: &sluice::Verdict, name: &str) -> String {
    let h = headers::render(v, &Default::default());
    h.into_iter().find(|(n, _)| *n == name).map(|(_, v)| v).unwrap_or_default()
}

#[tokio::test]
async fn fixed_window_resets_at_the_stored_time_not_before() {
    let (l, clock) = limiter(
        r#"{"domains":[{"domain":"d","descriptors":[{"key":"user","rate_limit":{"unit":"minute","requests_per_unit":2}}]}]}"#,
    );
    let r = req("d", &[&[("user", "a")]]);
    clock.advance(123);
    let first = l.check(&r).await.unwrap();
    let reset = header(&first, "x-ratelimit-reset");
    assert_eq!(reset, ((T0 + 123 + 60_000).div_ceil(1000)).to_string());
    clock.advance(30_000);
    assert!(l.check(&r).await.unwrap().allowed());
    let denied = l.check(&r).await.unwrap();
    assert!(!denied.allowed());
    assert_eq!(denied.outcome, Outcome::OverLimit);
    assert_eq!(header(&denied, "x-ratelimit-reset"), reset);
    assert_eq!(header(&denied, "retry-after"), "30");
    clock.advance(29_999);
    assert!(!l.check(&r).await.unwrap().allowed(), "one millisecond before the stored reset");
    clock.advance(1);
    let fresh = l.check(&r).await.unwrap();
    assert!(fresh.allowed(), "at the stored reset a new window starts");
    assert_eq!(header(&fresh, "x-ratelimit-remaining"), "1");
}

#[tokio::test]
async fn token_bucket_refills_as_the_clock_moves() {
    let (l, clock) = limiter(
        r#"{"domains":[{"domain":"d","descriptors":[{"key":"k","policies":[{"name":"b","token_bucket":{"rate":2,"per":"1s","burst":2}}]}]}]}"#,
    );
    let r = req("d", &[&[("k", "v")]]);
    assert!(l.check(&r).await.unwrap().allowed());
    assert!(l.check(&r).await.unwrap().allowed());
    let denied = l.check(&r).await.unwrap();
    assert!(!denied.allowed());
    assert_eq!(denied.binding().unwrap().decision.retry_after, Some(500));
    clock.advance(499);
    assert!(!l.check(&r).await.unwrap().allowed());
    clock.advance(1);
    assert!(l.check(&r).await.unwrap().allowed(), "one token every 500 ms");
    clock.advance(60_000);
    let v = l.check(&r).await.unwrap();
    assert_eq!(v.binding().unwrap().decision.remaining, 1, "refill stops at the burst");
}

#[tokio::test]
async fn several_policies_are_all_or_nothing() {
    let (l, _clock) = limiter(
        r#"{"domains":[{"domain":"d","descriptors":[{"key":"token","policies":[
            {"name":"core","fixed_window":{"limit":100,"window":"1h"}},
            {"name":"burst","token_bucket":{"rate":1,"per":"1s","burst":3}}]}]}]}"#,
    );
    let r = req("d", &[&[("token", "t")]]);
    for _ in 0..3 {
        assert!(l.check(&r).await.unwrap().allowed());
    }
    let denied = l.check(&r).await.unwrap();
    assert!(!denied.allowed());
    assert_eq!(header(&denied, "x-ratelimit-resource"), "burst");
    let core = &denied.descriptors[0].policies[0];
    assert_eq!((&*core.name, core.decision.used), ("core", 3), "core must not be charged for the refused request");
    let policy = header(&denied, "ratelimit-policy");
    assert!(policy.contains("\"core\";q=100;w=3600") && policy.contains("\"burst\";q=3;w=3"), "{policy}");
}

#[tokio::test]
async fn descriptors_of_other_clients_are_given_back_when_one_refuses() {
    let (l, _clock) = limiter(
        r#"{"domains":[{"domain":"d","descriptors":[
            {"key":"user","rate_limit":{"unit":"hour","requests_per_unit":10}},
            {"key":"ip","rate_limit":{"unit":"hour","requests_per_unit":1}}]}]}"#,
    );
    let both = req("d", &[&[("user", "u")], &[("ip", "1.2.3.4")]]);
    assert!(l.check(&both).await.unwrap().allowed());
    let denied = l.check(&both).await.unwrap();
    assert!(!denied.allowed());
    assert_eq!(denied.descriptors[0].code, Code::Ok);
    assert_eq!(denied.descriptors[1].code, Code::OverLimit);
    let status = l.status(&req("d", &[&[("user", "u")]])).await.unwrap();
    assert_eq!(status.descriptors[0].policies[0].decision.used, 1, "the user's charge was given back");
}

#[tokio::test]
async fn envoy_matching_value_wildcard_nesting_unlimited_replaces() {
    let (l, _clock) = limiter(
        r#"{"domains":[{"domain":"d","descriptors":[
            {"key":"user","rate_limit":{"unit":"minute","requests_per_unit":1}},
            {"key":"user","value":"vip","rate_limit":{"unit":"minute","requests_per_unit":3}},
            {"key":"user","value":"bot-*","rate_limit":{"unit":"minute","requests_per_unit":2}},
            {"key":"user","value":"root","rate_limit":{"unlimited":true}},
            {"key":"tenant","descriptors":[{"key":"path","rate_limit":{"unit":"minute","requests_per_unit":1}}]},
            {"key":"plan","value":"free","rate_limit":{"name":"free","unit":"minute","requests_per_unit":1}},
            {"key":"plan","value":"promo","rate_limit":{"unit":"minute","requests_per_unit":5,"replaces":[{"name":"free"}]}}
        ]}]}"#,
    );
    let admitted = |entries: &'static [(&'static str, &'static str)], n: usize| {
        let l = &l;
        async move {
            let mut ok = 0;
            for _ in 0..n {
                ok += l.check(&req("d", &[entries])).await.unwrap().allowed() as usize;
            }
            ok
        }
    };
    assert_eq!(admitted(&[("user", "plain")], 5).await, 1);
    assert_eq!(admitted(&[("user", "vip")], 5).await, 3, "key=value beats key alone");
    assert_eq!(admitted(&[("user", "bot-7")], 5).await, 2, "a trailing * matches by prefix");
    assert_eq!(admitted(&[("user", "root")], 5).await, 5, "unlimited");
    assert_eq!(admitted(&[("tenant", "a"), ("path", "/x")], 3).await, 1);
    assert_eq!(admitted(&[("tenant", "a"), ("path", "/y")], 3).await, 1, "each path counted apart");
    assert_eq!(admitted(&[("tenant", "b"), ("path", "/x")], 3).await, 1, "each tenant counted apart");
    assert_eq!(admitted(&[("tenant", "a")], 3).await, 3, "no limit on tenant alone");
    assert_eq!(admitted(&[("tenant", "a"), ("path", "/x"), ("extra", "1")], 3).await, 3, "deeper than the rules");
    let both = req("d", &[&[("plan", "free")], &[("plan", "promo")]]);
    for _ in 0..3 {
        let v = l.check(&both).await.unwrap();
        assert!(v.allowed(), "the promo limit replaces the free one");
        assert!(v.descriptors[0].policies.is_empty());
    }
}

/// envoyproxy/ratelimit's wildcards: a `*` anywhere in a rule's value, several of them,
/// each matching any run of characters (none included). An exact value beats every
/// wildcard, the first wildcard in file order beats later ones, any wildcard beats the
/// key alone.
#[tokio::test]
async fn envoy_wildcards_anywhere_in_a_value_and_their_precedence() {
    let (l, _clock) = limiter(
        r#"{"domains":[{"domain":"d","descriptors":[
            {"key":"path","rate_limit":{"name":"default","unit":"minute","requests_per_unit":9}},
            {"key":"path","value":"bar*b","rate_limit":{"name":"bar-b","unit":"minute","requests_per_unit":1}},
            {"key":"path","value":"foo*bar*baz","rate_limit":{"name":"foo-bar-baz","unit":"minute","requests_per_unit":1}},
            {"key":"path","value":"ba*","rate_limit":{"name":"ba","unit":"minute","requests_per_unit":1}},
            {"key":"path","value":"barab","rate_limit":{"name":"exact","unit":"minute","requests_per_unit":1}},
            {"key":"path","value":"*.json","rate_limit":{"name":"json","unit":"minute","requests_per_unit":1}}
        ]}]}"#,
    );
    for (value, rule) in [
        ("barab", "exact"),
        ("bar123b", "bar-b"),
        ("barb", "bar-b"),
        ("barba", "ba"),
        ("bab", "ba"),
        ("foo123bar456baz", "foo-bar-baz"),
        ("foobarbaz", "foo-bar-baz"),
        ("foobaz", "default"),
        ("foo123baz", "default"),
        ("foobarbazz", "default"),
        ("a/b.json", "json"),
        (".json", "json"),
        ("x", "default"),
    ] {
        let v = l.status(&req("d", &[&[("path", value)]])).await.unwrap();
        assert_eq!(&*v.descriptors[0].policies[0].name, rule, "{value}");
    }
}

#[tokio::test]
async fn shadow_mode_reports_but_allows() {
    let (l, _clock) = limiter(
        r#"{"domains":[{"domain":"d","descriptors":[{"key":"user","shadow_mode":true,"rate_limit":{"unit":"minute","requests_per_unit":1}}]}]}"#,
    );
    let r = req("d", &[&[("user", "s")]]);
    let mut would_deny = 0;
    for _ in 0..3 {
        let v = l.check(&r).await.unwrap();
        assert!(v.allowed());
        would_deny += v.shadow_denials().count();
    }
    assert_eq!(would_deny, 2);
}

#[tokio::test]
async fn refund_gives_back_a_verdicts_charge() {
    let (l, _clock) = limiter(&user_per_minute(5));
    let r = req("d", &[&[("user", "n")]]);
    for _ in 0..3 {
        let v = l.check(&r).await.unwrap();
        l.refund(&v).await.unwrap(); // each a 304 Not Modified
    }
    let v = l.check(&r).await.unwrap();
    assert_eq!(v.binding().unwrap().decision.remaining, 4);
}

#[tokio::test]
async fn client_key_chooses_the_tag_and_errors_are_clear() {
    let (l, _clock) = limiter(
        r#"{"domains":[{"domain":"d","client_key":"user","descriptors":[{"key":"path","descriptors":[{"key":"user","rate_limit":{"unit":"minute","requests_per_unit":2}}]}]}]}"#,
    );
    let r = req("d", &[&[("path", "/a"), ("user", "x")]]);
    assert!(l.check(&r).await.unwrap().allowed());
    let err = l.check(&req("nope", &[&[("a", "b")]])).await.unwrap_err().to_string();
    assert!(
        err.contains("unknown domain 'nope'") && !err.contains("configured domains"),
        "no list for any caller: {err}"
    );
    let mut costly = r.clone();
    costly.hits_addend = Some(3);
    let e = l.check(&costly).await.unwrap_err();
    assert!(matches!(e, CheckError::Request(RequestError::CostAboveCapacity { capacity: 2, .. })), "{e}");
}

#[tokio::test]
async fn global_shadow_mode_allows_everything_and_reports() {
    let (l, _clock) = limiter(
        r#"{"limiter":{"shadow_mode":true},"domains":[{"domain":"d","descriptors":[{"key":"user","rate_limit":{"unit":"minute","requests_per_unit":1}}]}]}"#,
    );
    let r = req("d", &[&[("user", "g")]]);
    let mut reported = 0;
    for _ in 0..3 {
        let v = l.check(&r).await.unwrap();
        assert!(v.allowed() && v.outcome == Outcome::Allowed);
        reported += v.shadow_denials().count();
    }
    assert_eq!(reported, 2);
}

/// A request naming one client twice with another between (three store calls: the same
/// state twice gets its own call): a refund gives each charge back exactly once.
#[tokio::test]
async fn a_refund_gives_each_charge_back_once() {
    let (l, _clock) = limiter(&user_per_minute(10));
    let a = req("d", &[&[("user", "a")]]);
    for _ in 0..3 {
        assert!(l.check(&a).await.unwrap().allowed());
    }
    let v = l.check(&req("d", &[&[("user", "a")], &[("user", "b")], &[("user", "a")]])).await.unwrap();
    assert!(v.allowed());
    let used = |v: &sluice::Verdict| v.descriptors[0].policies[0].decision.used;
    assert_eq!(used(&l.status(&a).await.unwrap()), 5);
    l.refund(&v).await.unwrap();
    assert_eq!(used(&l.status(&a).await.unwrap()), 3, "a's two charges given back once each");
    assert_eq!(used(&l.status(&req("d", &[&[("user", "b")]])).await.unwrap()), 0);
}

/// A flood of new clients into a full memory store never buys anyone quota: the known
/// heavy client keeps its exact count while 200,000 others arrive; the newcomers are
/// decided by the failure policy (here fail-closed: refused, marked degraded) until
/// windows end and room returns.
#[tokio::test]
async fn a_full_memory_store_keeps_every_live_count_and_decides_newcomers_by_policy() {
    let config = r#"{"limiter":{"failure":"closed"},"domains":[{"domain":"d","descriptors":[{"key":"user","rate_limit":{"unit":"minute","requests_per_unit":3}}]}]}"#;
    let config: RulesConfig = serde_json::from_str(config).expect("test config");
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::new(6_400));
    let l = Limiter::new(Arc::new(config.compile().unwrap()), store.clone(), Arc::new(clock.clone()));
    let heavy = req("d", &[&[("user", "heavy")]]);
    for _ in 0..3 {
        assert!(l.check(&heavy).await.unwrap().allowed());
    }
    assert!(!l.check(&heavy).await.unwrap().allowed(), "the heavy client has used its limit");
    let (mut admitted, mut degraded) = (0, 0);
    for i in 0..200_000 {
        clock.advance(i % 2); // 100 s pass in all: the flood spans the heavy client's window
        let v = l.check(&req("d", &[&[("user", &format!("flood-{i}"))]])).await.unwrap();
        admitted += usize::from(v.allowed());
        degraded += usize::from(v.degraded.is_some());
        if i % 1_000 == 0 && clock_ms(&clock) < T0 + 60_000 {
            let h = l.check(&heavy).await.unwrap();
            assert!(!h.allowed() && h.degraded.is_none(), "request {i}: the heavy client got quota back");
        }
    }
    assert!(store.len() <= 6_400, "the store holds {} states, over its bound", store.len());
    let full = store.stats().full.load(std::sync::atomic::Ordering::Relaxed);
    assert!(full > 100_000 && degraded as u64 == full, "full {full}, degraded {degraded}");
    assert_eq!(admitted + degraded, 200_000, "every newcomer either counted or refused by policy");
    // once the flood's windows end too, their room comes back
    clock.advance(61_000);
    assert!(l.check(&heavy).await.unwrap().allowed(), "a new window after the reset");
    assert!(l.check(&req("d", &[&[("user", "late")]])).await.unwrap().allowed());
}

/// Envoy's usual descriptor `[route, user]`: every user of one route is a client of its
/// own, not the route. With the first entry as the client, the 3,000 users of one route
/// shared one tag, so one of the memory store's 64 shards (room for 100 of the 6,400
/// states here): the store said full at the 101st user and the failure policy decided
/// the rest. Now all 3,000 are counted, each exactly.
#[tokio::test]
async fn every_user_of_one_route_is_a_client_of_its_own() {
    let config = r#"{"limiter":{"failure":"closed"},"domains":[{"domain":"d","descriptors":[{"key":"route","descriptors":[{"key":"user","rate_limit":{"unit":"minute","requests_per_unit":1}}]}]}]}"#;
    let config: RulesConfig = serde_json::from_str(config).expect("test config");
    let store = Arc::new(MemoryStore::new(6_400));
    let l = Limiter::new(Arc::new(config.compile().unwrap()), store.clone(), Arc::new(ManualClock::new(T0)));
    for i in 0..3_000 {
        let r = req("d", &[&[("route", "/a"), ("user", &format!("u{i}"))]]);
        let v = l.check(&r).await.unwrap();
        assert!(v.allowed() && v.degraded.is_none(), "user {i} of the route: {:?}", v.outcome);
        assert!(!l.check(&r).await.unwrap().allowed(), "user {i} has used its one request");
    }
    assert_eq!(store.len(), 3_000);
    assert_eq!(store.stats().full.load(std::sync::atomic::Ordering::Relaxed), 0);
}

fn clock_ms(clock: &ManualClock) -> u64 {
    sluice::time::Clock::now(clock)
}

/// A rule's `shadow_mode` and `detailed_metric` are its own, as in envoyproxy/ratelimit:
/// a rule nested below a shadow rule is enforced. A `rate_limit` without a `name` is
/// reported as anonymous (Envoy's answer names none).
#[tokio::test]
async fn shadow_mode_is_a_rules_own() {
    let (l, _clock) = limiter(
        r#"{"domains":[{"domain":"d","descriptors":[
            {"key":"tenant","shadow_mode":true,"rate_limit":{"unit":"hour","requests_per_unit":1},
             "descriptors":[{"key":"user","rate_limit":{"name":"per_user","unit":"hour","requests_per_unit":1}}]}]}]}"#,
    );
    let tenant = req("d", &[&[("tenant", "t")]]);
    for _ in 0..3 {
        let v = l.check(&tenant).await.unwrap();
        assert!(v.allowed(), "the shadow rule never refuses");
        assert!(v.descriptors[0].policies[0].anonymous);
    }
    let user = req("d", &[&[("tenant", "t"), ("user", "u")]]);
    assert!(l.check(&user).await.unwrap().allowed());
    let v = l.check(&user).await.unwrap();
    assert!(!v.allowed(), "the nested rule is enforced");
    assert!(!v.descriptors[0].policies[0].anonymous);
}

/// A descriptor's own `limit` (Envoy's override action) is taken as sent by default,
/// named `request_limit`; `request_bounds.limit_per_unit` lowers it, and
/// `request_bounds.limits: false` refuses it.
#[tokio::test]
async fn request_limits_can_be_capped_or_refused() {
    let with = |bounds: &str| {
        let domains = user_per_minute(5);
        let limiter = format!(r#"{{"limiter":{{"request_bounds":{{{bounds}}}}},{}"#, &domains[1..]);
        limiter
    };
    let mut r = req("d", &[&[("user", "big")]]);
    r.descriptors[0].limit =
        Some(sluice::LimitOverride { requests_per_unit: u64::from(u32::MAX), unit: sluice::config::Unit::Second });
    let (l, _) = limiter(&with(""));
    let v = l.check(&r).await.unwrap();
    let p = v.binding().unwrap();
    assert_eq!((&*p.name, p.decision.limit), ("request_limit", u64::from(u32::MAX)));
    let (l, _) = limiter(&with(r#""limit_per_unit":100"#));
    let v = l.check(&r).await.unwrap();
    assert_eq!(v.binding().unwrap().decision.limit, 100, "lowered to the cap");
    let (l, _) = limiter(&with(r#""limits":false"#));
    match l.check(&r).await {
        Err(CheckError::Request(e @ RequestError::LimitRefused(0))) => {
            assert!(e.to_string().contains("limiter.request_bounds.limits"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    // without a limit of its own, the same descriptor is decided by the config
    r.descriptors[0].limit = None;
    assert_eq!(l.check(&r).await.unwrap().binding().unwrap().decision.limit, 5);
}
