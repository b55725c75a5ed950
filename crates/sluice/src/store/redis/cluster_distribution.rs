//! (A unit test: it reads the store's private key layout.) Client tags spread evenly over a real Redis Cluster's slots and primaries, and crafted
//! identities cannot pile onto one slot: the tag is a keyed hash, so a client cannot
//! choose its hash tag (invariant 6, docs/architecture.md).

use super::{DEFAULT_BUCKETS, Location};
use crate::algo::Limit;
use crate::tag::{Tag, Tagger};
use sluice_testkit::RedisCluster;
use std::collections::HashMap;

const FW: Limit = Limit::FixedWindow { limit: 1, window: 1, aligned: false };

/// The Redis key of state `key` of client `tag` under `limit`, with the default buckets.
fn state_key(tag: Tag, key: u64, limit: &Limit) -> String {
    Location::of(tag, key, limit, DEFAULT_BUCKETS).key
}

/// Asks the cluster which slot each key is in (`CLUSTER KEYSLOT`, pipelined).
fn slots(con: &mut redis::Connection, keys: &[String]) -> Vec<u16> {
    let mut pipe = redis::pipe();
    for k in keys {
        pipe.cmd("CLUSTER").arg("KEYSLOT").arg(k);
    }
    pipe.query(con).expect("CLUSTER KEYSLOT")
}

#[test]
fn tags_spread_evenly_and_cannot_be_crafted() {
    let cluster = RedisCluster::start();
    let mut con = redis::Client::open(cluster.nodes[0].url()).unwrap().get_connection().unwrap();
    // slot -> primary, from CLUSTER SLOTS
    let raw: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER").arg("SLOTS").query(&mut con).unwrap();
    let int = |v: &redis::Value| redis::from_redis_value::<i64>(v.clone()).unwrap();
    let ranges: Vec<(u16, u16, String)> = raw
        .iter()
        .map(|r| {
            let primary: Vec<redis::Value> = redis::from_redis_value(r[2].clone()).unwrap();
            (int(&r[0]) as u16, int(&r[1]) as u16, format!("port {}", int(&primary[1])))
        })
        .collect();
    let owner = |slot: u16| ranges.iter().find(|(a, b, _)| (*a..=*b).contains(&slot)).unwrap().2.clone();

    let tagger = Tagger::new("a secret");
    let n = 30_000;
    let keys: Vec<String> =
        (0..n).map(|i| state_key(tagger.tag("api", "user", &format!("user-{i}")), 1, &FW)).collect();
    let slots_of = slots(&mut con, &keys);
    let mut per_node: HashMap<String, usize> = HashMap::new();
    let mut per_slot: HashMap<u16, usize> = HashMap::new();
    for &s in &slots_of {
        *per_node.entry(owner(s)).or_default() += 1;
        *per_slot.entry(s).or_default() += 1;
    }
    assert_eq!(per_node.len(), 3);
    for (node, count) in &per_node {
        let share = *count as f64 / n as f64;
        assert!((share - 1.0 / 3.0).abs() < 0.03, "{node} holds {share:.3} of the clients");
    }
    // 30,000 clients over 16,384 slots: about 1.8 a slot. Clients share a slot through
    // their bucket (65,536 buckets, about 4 a slot), which widens the spread a little; a
    // uniform one rarely puts more than 16 on one slot
    let max = per_slot.values().max().copied().unwrap_or(0);
    assert!(max <= 16, "one slot holds {max} clients");

    // Crafted identities: all carry the same Redis hash tag. A limiter that put the
    // identity in the key would send them all to one slot; keyed tags scatter them.
    let crafted: Vec<String> =
        (0..2_000).map(|i| state_key(tagger.tag("api", "user", &format!("{{hot}}-{i}")), 1, &FW)).collect();
    let crafted_slots: std::collections::HashSet<u16> = slots(&mut con, &crafted).into_iter().collect();
    assert!(crafted_slots.len() > 1_800, "2,000 crafted identities landed on only {} slots", crafted_slots.len());

    // every key of one client is in one slot
    let tag = tagger.tag("api", "user", "someone");
    let leases = Limit::Concurrency { limit: 1, lease_ttl: 1 };
    let one: Vec<String> = (0..50u64)
        .map(|k| state_key(tag, k.wrapping_mul(0x1234_5678_9abc_def1), if k % 2 == 0 { &FW } else { &leases }))
        .collect();
    let s: std::collections::HashSet<u16> = slots(&mut con, &one).into_iter().collect();
    assert_eq!(s.len(), 1, "a client's keys must share one slot");
}
