//! The harness starts a six-node Redis Cluster and reshards it.

use sluice_testkit::RedisCluster;
use std::time::{Duration, Instant};

#[test]
fn six_nodes_come_up_and_reshard() {
    let started = Instant::now();
    let cluster = RedisCluster::start();
    eprintln!("cluster up in {:?}", started.elapsed());
    assert_eq!(cluster.primaries().len(), 3);
    let info = cluster.nodes[0].command("CLUSTER INFO").unwrap();
    assert!(info.contains("cluster_known_nodes:6"), "{info}");
    cluster.reshard(0, 1, 100);
    cluster.wait_ok(Duration::from_secs(10));
    let nodes = cluster.nodes[0].command("CLUSTER NODES").unwrap();
    assert!(nodes.lines().count() >= 6);
}
