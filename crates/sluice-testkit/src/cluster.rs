//! A six-node Redis Cluster (three primaries, three replicas), created with `redis-cli
//! --cluster create`.

use crate::*;

/// A six-node Redis Cluster (three primaries, three replicas) on free loopback ports,
/// every node in its own temp dir, killed on drop.
pub struct RedisCluster {
    /// Nodes in creation order: 0 to 2 start as primaries, 3 to 5 as their replicas.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts six nodes, creates the cluster with `redis-cli --cluster create`, and waits
    /// until every node reports `cluster_state:ok` and knows all 16384 slots.
    pub fn start() -> Self {
        require("redis-cli", "redis-tools");
        let nodes: Vec<RedisServer> = (0..6)
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                    "--repl-diskless-sync-delay",
                    "0",
                ])
            })
            .collect();
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port())).collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(out.status.success(), "redis-cli --cluster create failed: {}", String::from_utf8_lossy(&out.stdout));
        let cluster = Self { nodes };
        cluster.wait_ok(Duration::from_secs(20));
        cluster
    }

    /// `redis://` URLs of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// Waits until every running node says `cluster_state:ok`, agrees on all slots being
    /// assigned, and every replica's link is up.
    pub fn wait_ok(&self, timeout: Duration) {
        if let Err(states) = self.ok_within(timeout) {
            panic!("the cluster did not become ok within {timeout:?}:\n{states}");
        }
    }

    /// What [`Self::wait_ok`] waits for, or each node's state when `timeout` passed.
    pub fn ok_within(&self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            let ok = self.nodes.iter().filter(|n| ping(n.port()).is_ok()).all(|n| {
                let info = n.command("CLUSTER INFO").unwrap_or_default();
                let repl = n.command("INFO replication").unwrap_or_default();
                info.contains("cluster_state:ok")
                    && info.contains("cluster_slots_ok:16384")
                    && (repl.contains("role:master") || repl.contains("master_link_status:up"))
            });
            if ok {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(self.states());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis-cli --cluster fix` through the first node that answers: what an operator
    /// runs when a node's view of the slots does not converge.
    pub fn fix(&self) -> String {
        let Some(node) = self.nodes.iter().find(|n| ping(n.port()).is_ok()) else { return "no node answers".into() };
        // redis-cli 7.0 still asks before it covers an uncovered slot, --cluster-yes
        // or not: answer each question yes on its stdin
        let mut child = Command::new("redis-cli")
            .args(["--cluster", "fix", &format!("127.0.0.1:{}", node.port()), "--cluster-yes"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("run redis-cli --cluster fix");
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all("yes\n".repeat(16).as_bytes());
        }
        let out = child.wait_with_output().expect("wait for redis-cli --cluster fix");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Each node's port, cluster state, role and replication link, one line a node.
    pub fn states(&self) -> String {
        let wanted = ["cluster_state:", "cluster_slots_ok:", "cluster_known_nodes:", "role:", "master_link_status:"];
        self.nodes
            .iter()
            .map(|n| {
                let reply = format!(
                    "{}{}",
                    n.command("CLUSTER INFO").unwrap_or_default(),
                    n.command("INFO replication").unwrap_or_default()
                );
                let fields: Vec<&str> =
                    reply.lines().map(str::trim).filter(|l| wanted.iter().any(|w| l.starts_with(w))).collect();
                format!("  :{} {}", n.port(), if fields.is_empty() { "down".to_string() } else { fields.join(" ") })
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Waits, after a primary was killed, until a replica took its place (three
    /// primaries answer) and the cluster is ok; returns how long the promotion took.
    pub fn wait_promotion(&self, timeout: Duration) -> Duration {
        let promoted = self.wait_primaries(timeout);
        self.wait_ok(timeout);
        promoted
    }

    /// Waits, after a primary was killed, until a replica took its place (three
    /// primaries answer); returns how long that took.
    pub fn wait_primaries(&self, timeout: Duration) -> Duration {
        let started = Instant::now();
        while self.primaries().len() < 3 {
            assert!(started.elapsed() < timeout, "no replica was promoted within {timeout:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
        started.elapsed()
    }

    /// A node's cluster id.
    pub fn node_id(&self, i: usize) -> String {
        let reply = self.nodes[i].command("CLUSTER MYID").unwrap_or_default();
        reply.lines().nth(1).unwrap_or_default().trim().to_string()
    }

    /// Indexes of the nodes that are primaries now.
    pub fn primaries(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| ping(self.nodes[i].port()).is_ok())
            .filter(|&i| self.nodes[i].command("INFO replication").unwrap_or_default().contains("role:master"))
            .collect()
    }

    /// Moves `slots` slots from node `from` to node `to` (both primaries) with
    /// `redis-cli --cluster reshard`, keys included; returns when it is done.
    pub fn reshard(&self, from: usize, to: usize, slots: u32) {
        self.wait_agreement(Duration::from_secs(20));
        let out = Command::new("redis-cli")
            .args(["--cluster", "reshard", &format!("127.0.0.1:{}", self.nodes[from].port())])
            .args(["--cluster-from", &self.node_id(from), "--cluster-to", &self.node_id(to)])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster reshard");
        assert!(out.status.success(), "reshard failed: {}", String::from_utf8_lossy(&out.stdout));
        self.wait_agreement(Duration::from_secs(20));
    }

    /// Waits until `redis-cli --cluster check` finds every node agreeing on the slot
    /// configuration, with no slot left open.
    pub fn wait_agreement(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let port = self.nodes.iter().find(|n| ping(n.port()).is_ok()).map(RedisServer::port).expect("no node is up");
        loop {
            let out = Command::new("redis-cli")
                .args(["--cluster", "check", &format!("127.0.0.1:{port}")])
                .output()
                .expect("run redis-cli --cluster check");
            let text = String::from_utf8_lossy(&out.stdout);
            if out.status.success() && !text.contains("[ERR]") && !text.contains("[WARNING]") {
                return;
            }
            assert!(Instant::now() < deadline, "the cluster nodes do not agree: {text}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
