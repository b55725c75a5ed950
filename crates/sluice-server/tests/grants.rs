//! Quota grants end to end: real `sluice serve` processes sharing one real Redis, a rule
//! with `grants: auto`. However the requests spread over the instances, and whatever
//! happens to an instance, no more than the limit is admitted; what an instance did not
//! spend goes back when it stops.

mod common;

use common::{Sluice, burst, header, heavy, num, start_with};
use sluice_testkit::RedisServer;
use std::time::Duration;

const LIMIT: u64 = 3_000;

fn fleet(redis: &RedisServer, n: usize) -> Vec<Sluice> {
    let store = format!("store:\n  kind: redis\n  url: {}\n", redis.url());
    let rule = format!(
        "  - domain: d\n    descriptors:\n      - key: user\n        grants: auto\n        rate_limit: {{unit: hour, requests_per_unit: {LIMIT}}}\n"
    );
    (0..n).map(|_| start_with(&store, &rule)).collect()
}

fn bases(fleet: &[Sluice]) -> Vec<String> {
    fleet.iter().map(|s| s.base.clone()).collect()
}

/// 6,000 requests at once over 4 instances, for a limit of 3,000: at most 3,000
/// admitted, nearly all of them, for a few store calls per hundred decisions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_instances_admit_at_most_the_limit() {
    let _heavy = heavy().await;
    let redis = RedisServer::start();
    let fleet = fleet(&redis, 4);
    let before = redis.script_calls();
    let (ok, degraded) = burst(&bases(&fleet), "d", "alice", 2 * LIMIT as usize).await;
    let calls = redis.script_calls() - before;
    let logs = || fleet.iter().map(Sluice::log).collect::<Vec<_>>().join("\n---\n");
    assert_eq!(degraded, 0, "decisions left to the failure policy:\n{}", logs());
    assert!(u64::from(ok) <= LIMIT, "{ok} admitted for a limit of {LIMIT}");
    assert!(u64::from(ok) >= LIMIT * 9 / 10, "only {ok} of {LIMIT} admitted");
    println!("admitted {ok} of {LIMIT}; {calls} store calls for {} decisions", 2 * LIMIT);
    assert!(calls < LIMIT, "{calls} store calls for {} decisions: grants are not saving calls", 2 * LIMIT);
}

/// One instance killed -9 halfway: its unspent units are lost (admitted less), never
/// admitted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_killed_halfway_costs_units_never_the_bound() {
    let _heavy = heavy().await;
    let redis = RedisServer::start();
    let mut fleet = fleet(&redis, 4);
    let (first, d1) = burst(&bases(&fleet), "d", "bob", LIMIT as usize).await;
    fleet[0].process.kill();
    let rest = bases(&fleet[1..]);
    let (second, d2) = burst(&rest, "d", "bob", LIMIT as usize).await;
    assert_eq!(d1 + d2, 0, "decisions left to the failure policy");
    let admitted = u64::from(first + second);
    assert!(admitted <= LIMIT, "{admitted} admitted for a limit of {LIMIT}");
    println!("admitted {admitted} of {LIMIT} with an instance killed -9 halfway");
}

/// SIGTERM gives back what the instance holds: afterwards the shared window counts
/// exactly the requests admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_gives_the_unspent_units_back() {
    let _heavy = heavy().await;
    let redis = RedisServer::start();
    let mut fleet = fleet(&redis, 2);
    let (ok, _) = burst(&[fleet[0].base.clone()], "d", "carol", 10).await;
    assert_eq!(ok, 10);
    let client = reqwest::Client::new();
    let other = fleet[1].base.clone();
    let used = || async {
        let r = client.get(format!("{other}/v1/ratelimit?domain=d&user=carol")).send().await.unwrap();
        (num(&r, "x-ratelimit-used"), header(&r, "x-ratelimit-remaining"))
    };
    let (held, _) = used().await;
    assert!(held > 10, "the store counts only {held}: no grant held beyond what was spent");
    fleet[0].process.signal("-TERM");
    assert_eq!(fleet[0].exit_code_within(Duration::from_secs(10)), 0, "{}", fleet[0].log());
    let (after, remaining) = used().await;
    assert_eq!(after, 10, "after SIGTERM the window counts {after} (remaining {remaining}):\n{}", fleet[0].log());
    assert!(fleet[0].log().contains("quota grants given back"), "{}", fleet[0].log());
}
