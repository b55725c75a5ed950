//! `sluice serve` on Redis, end to end: real sluice processes, real redis-server
//! processes (a primary and a replica), GitHub's two bugs, failures and floods.

mod common;

use common::{body, header, hit, num, start_with};
use sluice_testkit::RedisServer;
use std::time::{Duration, Instant};

fn redis_store(primary: &RedisServer, replicas: &[&RedisServer]) -> String {
    let replicas: Vec<String> = replicas.iter().map(|r| format!("\"{}\"", r.url())).collect();
    format!("store:\n  kind: redis\n  url: {}\n  replicas: [{}]\n", primary.url(), replicas.join(", "))
}

fn rule(limit: u64, unit: &str) -> String {
    format!(
        "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {{unit: {unit}, requests_per_unit: {limit}}}\n"
    )
}

/// Two sluice processes sharing one primary with one replica admit exactly 100 of 300
/// concurrent requests for a client whose limit is 100.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_share_one_exact_limit() {
    let _heavy = common::heavy().await;
    let primary = RedisServer::start();
    let replica = RedisServer::replica_of(&primary);
    // a deadline no scheduling hiccup reaches: a burst of 300 on two cores beside the
    // other tests left 7 decisions to the failure policy at the default 100 ms (the
    // exactness judged here is the store's, not the deadline's)
    let store = format!("{}limiter:\n  deadline: 1s\n", redis_store(&primary, &[&replica]));
    let (a, b) = (start_with(&store, &rule(100, "hour")), start_with(&store, &rule(100, "hour")));
    let (ok, degraded) = common::burst(&[a.base.clone(), b.base.clone()], "d", "shared", 300).await;
    assert_eq!(degraded, 0, "decisions left to the failure policy");
    assert_eq!(ok, 100);
}

/// GitHub's first bug, the wobble: requests spread over a window, across many second
/// boundaries, all see one and the same `x-ratelimit-reset`.
#[tokio::test]
async fn the_reset_does_not_wobble() {
    let _heavy = common::heavy().await;
    let redis = RedisServer::start();
    let s = start_with(&redis_store(&redis, &[]), &rule(1000, "minute"));
    let client = reqwest::Client::new();
    let started = Instant::now();
    let mut resets = std::collections::BTreeSet::new();
    while started.elapsed() < Duration::from_millis(3_300) {
        let r = hit(&client, &s.base, "d", &[("user", "w")]).await;
        assert_eq!(r.status(), 200);
        resets.insert(num(&r, "x-ratelimit-reset"));
        tokio::time::sleep(Duration::from_millis(37)).await;
    }
    assert_eq!(resets.len(), 1, "x-ratelimit-reset wobbled: {resets:?}");
}

/// GitHub's second bug, the stale replica: after a window's stored reset, while the
/// replica still holds the old keys, a status read served by the replica reports the full
/// limit, and the next decision reports `limit - 1`. No response is a 429 with remaining
/// above 0. Status reads are served by the replica (its script calls rise).
#[tokio::test]
async fn a_stale_replica_reports_a_fresh_window() {
    let _heavy = common::heavy().await;
    let primary = RedisServer::start();
    let replica = RedisServer::replica_of(&primary);
    let three_per_3s = "  - domain: d\n    descriptors:\n      - key: user\n        policies:\n          - {name: p, fixed_window: {limit: 3, window: 3s}}\n";
    let s = start_with(&redis_store(&primary, &[&replica]), three_per_3s);
    let client = reqwest::Client::new();
    let status = || client.get(format!("{}/v1/ratelimit?domain=d&user=stale", s.base)).send();
    let mut reset = 0;
    for i in 0..5 {
        let r = hit(&client, &s.base, "d", &[("user", "stale")]).await;
        reset = num(&r, "x-ratelimit-reset");
        if r.status() == 429 {
            assert_eq!(num(&r, "x-ratelimit-remaining"), 0, "a 429 with remaining above 0");
        } else {
            assert!(i < 3);
        }
    }
    let before = replica.script_calls();
    // the replica follows the primary asynchronously: give it a moment to catch up
    let mut r = status().await.unwrap();
    for _ in 0..50 {
        if num(&r, "x-ratelimit-remaining") == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        r = status().await.unwrap();
    }
    assert_eq!(num(&r, "x-ratelimit-remaining"), 0);
    assert!(replica.script_calls() > before, "status reads must be served by the replica");
    // wait until just past the stored reset (in ms, from the body), well inside the
    // grace period during which both servers still hold the window's keys
    let json: serde_json::Value = r.json().await.unwrap();
    let reset_ms = json["statuses"][0]["policies"][0]["reset_at_ms"].as_u64().unwrap();
    assert_eq!(reset, reset_ms.div_ceil(1000));
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    tokio::time::sleep(Duration::from_millis(reset_ms.saturating_sub(now_ms) + 50)).await;
    let keys = replica.command("KEYS s:*").unwrap();
    assert!(!keys.starts_with("*0"), "the replica should still hold the old window's keys: {keys}");
    let r = status().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(num(&r, "x-ratelimit-remaining"), 3, "the replica's stale window must read as fresh");
    let r = hit(&client, &s.base, "d", &[("user", "stale")]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(num(&r, "x-ratelimit-remaining"), 2);
}

/// Killing the redis-server mid-run: every decision answers within the deadline plus
/// 50 ms, fail-open with 200 and `x-sluice-degraded: fail-open`; `/healthz` stays 200,
/// `/readyz` says not ready. Restarted, decisions are exact again within 2 s.
#[tokio::test]
async fn a_dead_redis_fails_open_fast_and_recovers() {
    let _heavy = common::heavy().await;
    let mut redis = RedisServer::start();
    let s = start_with(&format!("{}limiter:\n  deadline: 100ms\n", redis_store(&redis, &[])), &rule(5, "hour"));
    let client = reqwest::Client::new();
    for _ in 0..5 {
        assert_eq!(hit(&client, &s.base, "d", &[("user", "k")]).await.status(), 200);
    }
    assert_eq!(hit(&client, &s.base, "d", &[("user", "k")]).await.status(), 429);
    redis.kill();
    let mut slowest = Duration::ZERO;
    for i in 0..30 {
        let t = Instant::now();
        let r = hit(&client, &s.base, "d", &[("user", &format!("k{i}"))]).await;
        slowest = slowest.max(t.elapsed());
        assert_eq!(r.status(), 200);
        assert_eq!(header(&r, "x-sluice-degraded"), "fail-open");
        assert_eq!(header(&r, "x-ratelimit-remaining"), "", "no invented numbers when degraded");
    }
    assert!(slowest <= Duration::from_millis(150), "a decision took {slowest:?} with redis down");
    assert_eq!(client.get(format!("{}/healthz", s.base)).send().await.unwrap().status(), 200);
    assert_eq!(client.get(format!("{}/readyz", s.base)).send().await.unwrap().status(), 503);
    // every one of them counted, by cause; the breaker opened
    let metrics = common::metrics(&client, &s.base).await;
    let value = |series: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert_eq!(value("sluice_degraded_total{domain=\"d\",failure=\"open\"}"), 30.0, "{metrics}");
    let errors = value("sluice_store_errors_total{store=\"redis\",kind=\"unavailable\"}")
        + value("sluice_store_errors_total{store=\"redis\",kind=\"timeout\"}")
        + value("sluice_store_errors_total{store=\"redis\",kind=\"circuit_open\"}");
    assert!(errors >= 30.0, "{metrics}");
    assert!(
        value("sluice_store_errors_total{store=\"redis\",kind=\"circuit_open\"}") > 0.0,
        "the breaker never opened"
    );
    // and its gauge says so (open, or half-open while a probe is out)
    let state = value("sluice_circuit_breaker_state{store=\"redis\"}");
    assert!(state == 1.0 || state == 2.0, "the breaker's gauge: {state}\n{metrics}\n{}", s.log());
    redis.restart();
    let back = Instant::now();
    loop {
        let r = hit(&client, &s.base, "d", &[("user", "after")]).await;
        if header(&r, "x-sluice-degraded").is_empty() {
            assert_eq!(num(&r, "x-ratelimit-remaining"), 4);
            break;
        }
        assert!(back.elapsed() < Duration::from_secs(2), "still degraded 2 s after redis came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for left in (0..4).rev() {
        assert_eq!(num(&hit(&client, &s.base, "d", &[("user", "after")]).await, "x-ratelimit-remaining"), left);
    }
    assert_eq!(hit(&client, &s.base, "d", &[("user", "after")]).await.status(), 429, "exact again");
    assert_eq!(client.get(format!("{}/readyz", s.base)).send().await.unwrap().status(), 200);
}

/// A fail-closed policy answers 503 with a clear error when the store is down.
#[tokio::test]
async fn fail_closed_refuses_with_503() {
    let _heavy = common::heavy().await;
    let mut redis = RedisServer::start();
    let domains = "  - domain: d\n    descriptors:\n      - key: user\n        failure: closed\n        rate_limit: {unit: hour, requests_per_unit: 5}\n";
    let s = start_with(&redis_store(&redis, &[]), domains);
    let client = reqwest::Client::new();
    assert_eq!(hit(&client, &s.base, "d", &[("user", "c")]).await.status(), 200);
    redis.kill();
    let r = hit(&client, &s.base, "d", &[("user", "c")]).await;
    assert_eq!(r.status(), 503);
    assert_eq!(header(&r, "x-sluice-degraded"), "fail-closed");
    assert_eq!(header(&r, "retry-after"), "1");
    let json: serde_json::Value = r.json().await.unwrap();
    assert_eq!(json["degraded"], "fail-closed");
    // one account of it: refused as unavailable, not over a limit, in the body's every
    // code (it said OVER_LIMIT overall and OK inside)
    assert_eq!(
        (&json["overall_code"], &json["statuses"][0]["code"], &json["statuses"][0]["policies"][0]["source"]),
        (&"UNAVAILABLE".into(), &"UNAVAILABLE".into(), &"degraded".into()),
        "{json}"
    );
    // Envoy's answer says the same: the call is UNAVAILABLE (Envoy's failure_mode_deny
    // then decides, as for a rate limit service that cannot answer)
    let mut rls =
        envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::connect(
            format!("http://{}", s.grpc),
        )
        .await
        .unwrap();
    let e = rls.should_rate_limit(common::rls_request("d", &[("user", "c")])).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(e.message().contains("fail-closed"), "{e:?}");
}

/// Redis unreachable at start: sluice starts anyway (`/healthz` 200, `/readyz` 503) and
/// connects by itself once Redis is there.
#[tokio::test]
async fn starts_without_redis_and_connects_later() {
    let _heavy = common::heavy().await;
    let mut redis = RedisServer::start();
    redis.kill();
    let s = common::start_unready(&redis_store(&redis, &[]), &rule(5, "hour"));
    let client = reqwest::Client::new();
    assert_eq!(client.get(format!("{}/healthz", s.base)).send().await.unwrap().status(), 200);
    assert_eq!(client.get(format!("{}/readyz", s.base)).send().await.unwrap().status(), 503);
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(5);
    while client.get(format!("{}/readyz", s.base)).send().await.unwrap().status() != 200 {
        assert!(Instant::now() < deadline, "never became ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = hit(&client, &s.base, "d", &[("user", "late")]).await;
    assert_eq!((r.status().as_u16(), num(&r, "x-ratelimit-remaining")), (200, 4));
}

/// A client already refused costs the primary at most a few script calls across 2,000
/// further requests to two instances (the near-cache).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_client_leaves_redis_alone() {
    let _heavy = common::heavy().await;
    let redis = RedisServer::start();
    let store = redis_store(&redis, &[]);
    let (a, b) = (start_with(&store, &rule(10, "minute")), start_with(&store, &rule(10, "minute")));
    let client = reqwest::Client::new();
    for _ in 0..10 {
        assert_eq!(hit(&client, &a.base, "d", &[("user", "flood")]).await.status(), 200);
    }
    assert_eq!(hit(&client, &a.base, "d", &[("user", "flood")]).await.status(), 429);
    let before = redis.script_calls();
    let mut refused = 0;
    for i in 0..2_000 {
        let base = if i % 2 == 0 { &a.base } else { &b.base };
        let r =
            client.post(format!("{base}/v1/ratelimit")).json(&body("d", &[("user", "flood")])).send().await.unwrap();
        if r.status() == 429 {
            assert_eq!(num(&r, "x-ratelimit-remaining"), 0);
            refused += 1;
        }
    }
    let calls = redis.script_calls() - before;
    assert_eq!(refused, 2_000);
    assert!(calls <= 4, "2,000 refused requests cost redis {calls} script calls");
}

/// `rediss://` with a private CA: decisions over TLS, counted exactly.
#[tokio::test]
async fn tls_to_redis() {
    let _heavy = common::heavy().await;
    let redis = sluice_testkit::TlsRedisServer::start();
    let store = format!(
        "store:\n  kind: redis\n  url: {}\n  tls: {{ca_file: \"{}\"}}\n",
        redis.url(),
        redis.ca_file().display()
    );
    let s = start_with(&store, &rule(5, "hour"));
    let client = reqwest::Client::new();
    for left in (0..5).rev() {
        let r = hit(&client, &s.base, "d", &[("user", "tls")]).await;
        assert_eq!(header(&r, "x-sluice-degraded"), "");
        assert_eq!(num(&r, "x-ratelimit-remaining"), left);
    }
    assert_eq!(hit(&client, &s.base, "d", &[("user", "tls")]).await.status(), 429);
    assert_eq!(redis.cli(&["DBSIZE"]).trim(), "1", "the window lives in the TLS redis");
}

/// A Redis with a password: the right one works; with a wrong one decisions fail open,
/// and the password appears nowhere in the log.
#[tokio::test]
async fn passwords_work_and_are_never_logged() {
    let _heavy = common::heavy().await;
    let redis = RedisServer::start_with(&["--requirepass", "hunter2-s3cret"]);
    let with = |password: &str| {
        format!("store:\n  kind: redis\n  url: redis://default:{password}@127.0.0.1:{}/\n", redis.port())
    };
    let s = start_with(&with("hunter2-s3cret"), &rule(5, "hour"));
    let client = reqwest::Client::new();
    let r = hit(&client, &s.base, "d", &[("user", "p")]).await;
    assert_eq!((r.status().as_u16(), num(&r, "x-ratelimit-remaining")), (200, 4));
    let wrong = common::start_unready(&with("not-the-password"), &rule(5, "hour"));
    let r = hit(&client, &wrong.base, "d", &[("user", "p")]).await;
    assert_eq!(header(&r, "x-sluice-degraded"), "fail-open");
    for log in [s.log(), wrong.log()] {
        assert!(!log.contains("hunter2-s3cret") && !log.contains("not-the-password"), "a password was logged: {log}");
    }
    assert!(wrong.log().contains("store failing"), "the failure should be logged: {}", wrong.log());
}

/// SIGTERM while clients hold leases: the stopping server gives back nothing a live
/// lease holds (a lease is the client's until it releases it or its TTL passes), exits
/// 0, and another server on the same Redis sees the leases held and releases them by id.
#[tokio::test]
async fn sigterm_releases_nothing_a_live_lease_holds() {
    let _heavy = common::heavy().await;
    let redis = RedisServer::start();
    let rules = "  - domain: d\n    descriptors:\n      - key: user\n        policies:\n          - {name: inflight, concurrency: {limit: 3, lease_ttl: 60s}}\n";
    let mut a = start_with(&redis_store(&redis, &[]), rules);
    let client = reqwest::Client::new();
    let take = |base: String| client.post(format!("{base}/v1/leases")).json(&body("d", &[("user", "u")])).send();
    let mut ids = Vec::new();
    for _ in 0..3 {
        let r = take(a.base.clone()).await.unwrap();
        assert_eq!(r.status(), 200, "{}", a.log());
        ids.push(r.json::<serde_json::Value>().await.unwrap()["lease_id"].as_str().unwrap().to_string());
    }
    // decisions in flight while the signal arrives (those sent after it may be refused)
    let url = format!("{}/v1/ratelimit", a.base);
    let load = futures_util::future::join_all(
        (0..200).map(|_| client.post(&url).json(&body("d", &[("user", "other")])).send()),
    );
    let term = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        a.process.signal("-TERM");
    };
    tokio::join!(load, term);
    let code = a.exit_code_within(Duration::from_secs(10));
    assert_eq!(code, 0, "{}", a.log());
    let b = start_with(&redis_store(&redis, &[]), rules);
    assert_eq!(take(b.base.clone()).await.unwrap().status(), 429, "a lease held on the stopped server was given back");
    let r = client.delete(format!("{}/v1/leases/{}", b.base, ids[0])).send().await.unwrap();
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["released"], true, "{}", b.log());
    assert_eq!(take(b.base.clone()).await.unwrap().status(), 200);
}

/// envoyproxy/ratelimit's `REDIS_PERSECOND`: their per-second limits on a Redis of their
/// own, the rest on the main one, from their environment: a second call in the second is
/// refused by the per-second limit, and each Redis holds its own window only.
#[tokio::test]
async fn per_second_limits_live_on_a_redis_of_their_own() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    let (main, second) = (RedisServer::start(), RedisServer::start());
    let dir = sluice_testkit::TempDir::new("sluice-persecond");
    let rule = "domain: d\ndescriptors:\n  - key: burst\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 10}\n";
    let (main_url, second_url) = (main.addr().to_string(), second.addr().to_string());
    let vars = [
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", main_url.as_str()),
        ("REDIS_PERSECOND", "true"),
        ("REDIS_PERSECOND_SOCKET_TYPE", "tcp"),
        ("REDIS_PERSECOND_URL", second_url.as_str()),
    ];
    let (_sluice, grpc) = common::their_way(&dir, rule, &vars);
    let mut rls = common::rls(&grpc).await;
    let call = |user: &str| {
        let mut r = common::rls_request("d", &[("burst", user)]);
        r.descriptors.extend(common::rls_request("d", &[("user", user)]).descriptors);
        r
    };
    // two calls in one second (a pair that straddles a second's end is tried again, as
    // another client: the second's window is new)
    let (mut second_call, mut users) = (None, 0);
    for attempt in 0..5 {
        let user = format!("a{attempt}");
        users += 1;
        let first = rls.should_rate_limit(call(&user)).await.unwrap().into_inner();
        assert_eq!(first.overall_code, Code::Ok as i32);
        let answer = rls.should_rate_limit(call(&user)).await.unwrap().into_inner();
        if answer.overall_code == Code::OverLimit as i32 {
            second_call = Some(answer);
            break;
        }
    }
    let second_call = second_call.expect("a second call in the second refused by 1 a second");
    assert_eq!(second_call.statuses[0].code, Code::OverLimit as i32, "refused by the per-second limit");
    // (the hourly limit counts the refused call too, as theirs does: 10 - 2)
    assert_eq!(second_call.statuses[1].limit_remaining, 8);
    let keys = |r: &RedisServer| r.command("DBSIZE").unwrap().trim().trim_start_matches(':').parse::<u64>().unwrap();
    // an hour's windows on the main one, one a client; a second's (gone in a second or
    // two) on the other
    let (on_main, on_second) = (keys(&main), keys(&second));
    assert!(on_main == users && (1..=users).contains(&on_second), "{on_main} and {on_second} keys for {users}");
    assert!(second.script_calls() > 0 && main.script_calls() > 0);
}

/// Their `REDIS_TIMEOUT` and `REDIS_PERSECOND_TIMEOUT`: each Redis's own bound on a reply.
/// With each Redis stopped (SIGSTOP: connections held, nothing answered), a call that
/// needs the main one (10 ms) is answered after its timeout; one that needs the per-second
/// one (2 s) after `limiter.deadline`, 100 ms, which decides first. The fastest of three
/// calls each, so a slow scheduler cannot make the first look slower.
#[tokio::test]
async fn their_redis_timeouts_bound_a_stalled_call() {
    let (main, second) = (RedisServer::start(), RedisServer::start());
    let dir = sluice_testkit::TempDir::new("sluice-env-timeouts");
    let rule = "domain: d\ndescriptors:\n  - key: burst\n    rate_limit: {unit: second, requests_per_unit: 100}\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 10}\n";
    let (main_url, second_url) = (main.addr().to_string(), second.addr().to_string());
    let vars = [
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", main_url.as_str()),
        ("REDIS_TIMEOUT", "10ms"),
        ("REDIS_PERSECOND", "true"),
        ("REDIS_PERSECOND_SOCKET_TYPE", "tcp"),
        ("REDIS_PERSECOND_URL", second_url.as_str()),
        ("REDIS_PERSECOND_TIMEOUT", "2s"),
    ];
    let (_sluice, grpc) = common::their_way(&dir, rule, &vars);
    let mut rls = common::rls(&grpc).await;
    let mut fastest = async |key: &str| {
        let mut took = Vec::new();
        for _ in 0..3 {
            let started = Instant::now();
            let _ = rls.should_rate_limit(common::rls_request("d", &[(key, "t")])).await;
            took.push(started.elapsed());
        }
        took.into_iter().min().unwrap()
    };
    for key in ["user", "burst"] {
        assert!(fastest(key).await < Duration::from_millis(50), "{key} answered at once while its Redis runs");
    }
    main.signal("-STOP");
    let took = fastest("user").await;
    main.signal("-CONT");
    assert!((Duration::from_millis(10)..Duration::from_millis(60)).contains(&took), "REDIS_TIMEOUT: {took:?}");
    second.signal("-STOP");
    let took = fastest("burst").await;
    second.signal("-CONT");
    assert!((Duration::from_millis(100)..Duration::from_millis(1_000)).contains(&took), "the deadline: {took:?}");
}

/// `failure: local` from the front door: with the Redis stopped, an instance that knows
/// only itself admits the limit of each window by its own count, marked
/// `x-sluice-degraded: local`, then answers 429 (the limit's refusal, with
/// `Retry-After`), not fail-open's 200 nor fail-closed's 503.
#[tokio::test]
async fn a_local_failure_policy_counts_alone_while_the_store_is_down() {
    let redis = RedisServer::start();
    let rules = "  - domain: d\n    descriptors:\n      - key: user\n        failure: local\n        rate_limit: {unit: hour, requests_per_unit: 3}\n";
    let s = start_with(&redis_store(&redis, &[]), rules);
    let client = reqwest::Client::new();
    assert_eq!(hit(&client, &s.base, "d", &[("user", "before")]).await.status(), 200);
    redis.signal("-STOP");
    let mut seen = Vec::new();
    for _ in 0..5 {
        let r = hit(&client, &s.base, "d", &[("user", "a")]).await;
        let retry = r.headers().contains_key("retry-after");
        seen.push((r.status().as_u16(), header(&r, "x-sluice-degraded"), retry));
    }
    redis.signal("-CONT");
    let local = |status, retry| (status, "local".to_string(), retry);
    assert_eq!(
        seen,
        [local(200, false), local(200, false), local(200, false), local(429, true), local(429, true)],
        "{}",
        s.log()
    );
    let scrape = common::metrics(&client, &s.base).await;
    assert!(scrape.contains("sluice_degraded_total{domain=\"d\",failure=\"local\"} 5"), "{scrape}");
}

/// The readiness probe as deploy/kubernetes ships it (its path, period and failure
/// threshold, Kubernetes' default timeout of 1 s), against a store that does not answer,
/// killed and then frozen by SIGSTOP: an instance whose rules say `failure: local` stays
/// ready throughout and keeps deciding within its bound (out of the Service, Envoy's own
/// `failure_mode_deny` would decide, and a fail-open Envoy admits without bound); one
/// with `failure: open` alone leaves it within the threshold.
#[tokio::test]
async fn the_shipped_readiness_probe_keeps_failure_local_in_the_service() {
    let deployment =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/kubernetes/deployment.yaml"));
    let deployment: serde_json::Value = serde_norway::from_str(&deployment.unwrap()).unwrap();
    let probe = &deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"];
    let (path, period) = (probe["httpGet"]["path"].as_str().unwrap(), probe["periodSeconds"].as_u64().unwrap());
    let threshold = probe["failureThreshold"].as_u64().unwrap();
    let timeout = Duration::from_secs(probe["timeoutSeconds"].as_u64().unwrap_or(1));
    let client = reqwest::Client::builder().timeout(timeout).build().unwrap();
    let probe = |base: String| {
        let client = client.clone();
        async move { client.get(format!("{base}{path}")).send().await.map(|r| r.status().as_u16()).unwrap_or(0) }
    };
    for failure in ["local", "open"] {
        let mut redis = RedisServer::start();
        let rules = format!(
            "  - domain: d\n    descriptors:\n      - key: user\n        failure: {failure}\n        rate_limit: {{unit: hour, requests_per_unit: 3}}\n"
        );
        let s = start_with(&redis_store(&redis, &[]), &rules);
        assert_eq!(probe(s.base.clone()).await, 200);
        for fault in ["-STOP", "kill"] {
            match fault {
                "kill" => {
                    redis.signal("-CONT");
                    redis.kill();
                }
                signal => redis.signal(signal),
            }
            // the probes of one threshold and one more, a period apart
            let mut seen = Vec::new();
            for _ in 0..=threshold {
                seen.push(probe(s.base.clone()).await);
                tokio::time::sleep(Duration::from_secs(period)).await;
            }
            let decided = hit(&client, &s.base, "d", &[("user", fault)]).await;
            match failure {
                "local" => {
                    assert!(seen.iter().all(|&status| status == 200), "{fault}: {seen:?}\n{}", s.log());
                    assert_eq!(header(&decided, "x-sluice-degraded"), "local", "still deciding within its bound");
                }
                _ => assert!(seen[threshold as usize - 1..].iter().all(|&status| status == 503), "{fault}: {seen:?}"),
            }
        }
    }
}
