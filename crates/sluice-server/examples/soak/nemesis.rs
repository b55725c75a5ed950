//! The nemesis: faults on a schedule drawn from the seed, each logged with when it was
//! injected and repaired. The last seconds of a run are quiet, so it ends exact.

use crate::Rng;
use crate::check::{Clock, Fault};
use crate::fleet::{ADMIN_TOKEN, Fleet, Servers, StoreKind};
use std::sync::Arc;
use std::time::Duration;

/// The quiet end of a run.
const QUIET_MS: u64 = 6_000;

/// The least time between two failovers: Sentinel waits twice its failover timeout (10 s
/// here) before it fails the same primary over again, and a Cluster's restarted node
/// needs its full resync first.
const FAILOVER_EVERY_MS: u64 = 25_000;

/// The kinds of fault a store can take.
fn kinds(store: StoreKind, regions: bool) -> Vec<&'static str> {
    let mut k = vec!["kill-instance", "term-instance", "pause-primary", "reload-limit", "override"];
    if regions {
        // a region cut off from the global store and healed; demand moving between regions
        k.extend(["partition", "shift", "shift"]);
        return k;
    }
    if matches!(store, StoreKind::Sentinel | StoreKind::Cluster) {
        k.push("failover");
    }
    if store == StoreKind::Cluster {
        k.push("move-slots");
    }
    k
}

/// Injects faults until `length` less the quiet end has passed; the fault log.
pub async fn run(fleet: Arc<Fleet>, mut rng: Rng, clock: Clock, length: Duration, only: &[String]) -> Vec<Fault> {
    let end = length.as_millis() as u64;
    let mut kinds = kinds(fleet.kind, fleet.regions() > 0);
    if !only.is_empty() {
        kinds.retain(|k| only.iter().any(|o| o == k));
        assert!(!kinds.is_empty(), "none of {only:?} is a fault this store takes");
    }
    let mut faults = Vec::new();
    let (mut lowered, mut failed_over) = (false, None::<u64>);
    loop {
        tokio::time::sleep(Duration::from_millis(rng.between(2_000, 6_000))).await;
        if clock.ms() + QUIET_MS + 4_000 > end {
            break;
        }
        let mut kind = kinds[rng.below(kinds.len() as u64) as usize];
        let start = clock.ms();
        if kind == "failover" && failed_over.is_some_and(|at| start < at + FAILOVER_EVERY_MS) {
            kind = "pause-primary";
        }
        if kind == "failover" {
            failed_over = Some(start);
        }
        let detail = match kind {
            "kill-instance" | "term-instance" => restart(&fleet, &mut rng, kind).await,
            "pause-primary" => pause(&fleet, &mut rng).await,
            "failover" => failover(&fleet).await,
            "move-slots" => move_slots(&fleet, &mut rng).await,
            "partition" => partition(&fleet, &mut rng).await,
            "shift" => shift(&fleet, &mut rng),
            "reload-limit" => {
                lowered = !lowered;
                let limit = if lowered { 12 } else { 20 };
                fleet.reload(limit);
                let before = if lowered { 20 } else { 12 };
                match fleet.regions() {
                    0 => format!("fw limit {before} -> {limit} on every instance"),
                    _ => format!("fw limit {before} -> {limit}, gl {} -> {}, on every instance", 2 * before, 2 * limit),
                }
            }
            _ => override_client(&fleet, &mut rng).await,
        };
        faults.push(Fault { kind, start, end: clock.ms(), detail });
    }
    if lowered {
        fleet.reload(20);
    }
    tokio::time::sleep(Duration::from_millis(end.saturating_sub(clock.ms()))).await;
    faults
}

/// Stops an instance (-9, or -TERM: it gives its grants and leases back first) and
/// starts it again 0.5 to 2 s later.
async fn restart(fleet: &Fleet, rng: &mut Rng, kind: &str) -> String {
    let i = rng.below(fleet.size() as u64) as usize;
    let signal = if kind == "kill-instance" { "-KILL" } else { "-TERM" };
    fleet.stop_instance(i, signal).await;
    let down = rng.between(500, 2_000);
    tokio::time::sleep(Duration::from_millis(down)).await;
    fleet.start_instance(i).await;
    format!("instance {i} {signal}, down {down} ms")
}

/// SIGSTOP of the store's primary (a Cluster's: one of them) for 0.2 to 0.8 s: shorter
/// than Sentinel's and the Cluster's failure detection, so no failover.
async fn pause(fleet: &Fleet, rng: &mut Rng) -> String {
    let (pid, which) = {
        let servers = fleet.servers.lock().unwrap();
        match &*servers {
            Servers::Redis(r) | Servers::Replicas { primary: r, .. } => (r.pid(), format!("primary :{}", r.port())),
            Servers::Sentinel(s) => {
                let port = s.primary_port().unwrap_or(s.primary.port());
                let r = s.server(port).unwrap_or(&s.primary);
                (r.pid(), format!("primary :{port}"))
            }
            Servers::Cluster(c) => {
                let ps = c.primaries();
                let n = ps[rng.below(ps.len() as u64) as usize];
                (c.nodes[n].pid(), format!("cluster primary {n}"))
            }
            Servers::Regions { regional, global, .. } => match rng.below(regional.len() as u64 + 1) as usize {
                r if r < regional.len() => (regional[r].pid(), format!("region r{r}'s redis")),
                _ => (global.pid(), "the global redis".to_string()),
            },
        }
    };
    let paused = rng.between(200, 800);
    signal(pid, "-STOP");
    tokio::time::sleep(Duration::from_millis(paused)).await;
    signal(pid, "-CONT");
    format!("{which} stopped {paused} ms")
}

/// Cuts a region's link to the global store for 1 to 6 s (up to three windows), then
/// heals it: the region spends what it holds, then refuses.
async fn partition(fleet: &Fleet, rng: &mut Rng) -> String {
    let r = rng.below(fleet.regions() as u64) as usize;
    let held = rng.between(1_000, 6_000);
    let link = |f: &dyn Fn(&sluice_testkit::Proxy)| {
        if let Servers::Regions { links, .. } = &*fleet.servers.lock().unwrap() {
            f(&links[r]);
        }
    };
    link(&|l| l.cut());
    tokio::time::sleep(Duration::from_millis(held)).await;
    link(&|l| l.heal());
    format!("region r{r} cut off from the global store for {held} ms")
}

/// Moves most of the shared limit's demand to another region, at once.
fn shift(fleet: &Fleet, rng: &mut Rng) -> String {
    let n = fleet.regions();
    let from = fleet.hot.load(std::sync::atomic::Ordering::Relaxed);
    let to = (from + 1 + rng.below(n as u64 - 1) as usize) % n;
    fleet.hot.store(to, std::sync::atomic::Ordering::Relaxed);
    format!("gl demand from region r{from} to r{to}")
}

fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill").arg(sig).arg(pid.to_string()).status();
}

/// Kills the primary so that Sentinel or the Cluster promotes a replica, then restarts
/// the old one (it comes back as a replica).
async fn failover(fleet: &Fleet) -> String {
    let fleet_servers = &fleet.servers;
    tokio::task::block_in_place(|| {
        let mut servers = fleet_servers.lock().unwrap();
        match &mut *servers {
            Servers::Sentinel(s) => {
                let before = s.agreed_primary_port().unwrap_or(s.primary.port());
                let victim = std::iter::once(&mut s.primary).chain(s.replicas.iter_mut()).find(|r| r.port() == before);
                let Some(victim) = victim else { return "no primary found".to_string() };
                victim.kill();
                let started = std::time::Instant::now();
                let mut now = before;
                while started.elapsed() < Duration::from_secs(20) {
                    now = s.agreed_primary_port().unwrap_or(before);
                    if now != before {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                if let Some(v) =
                    std::iter::once(&mut s.primary).chain(s.replicas.iter_mut()).find(|r| r.port() == before)
                {
                    v.restart();
                }
                format!("primary :{before} killed, :{now} promoted in {} ms", started.elapsed().as_millis())
            }
            Servers::Cluster(c) => {
                let ps = c.primaries();
                let n = ps[0];
                c.nodes[n].kill();
                let took = c.wait_primaries(Duration::from_secs(20));
                c.nodes[n].restart();
                let healed = heal(c);
                format!("cluster primary {n} killed, a replica promoted in {} ms{healed}", took.as_millis())
            }
            _ => "no failover on this store".to_string(),
        }
    })
}

/// Waits for the Cluster to be ok again after a failover. A node's view of one slot
/// has been seen not to converge (one primary saying `cluster_state:fail`,
/// `cluster_slots_ok:16383`, every other node ok): after 60 s the nemesis runs what an
/// operator would, `redis-cli --cluster fix`, and says so in the fault's line; if even
/// that does not help, the harness fails, keeping the logs.
fn heal(c: &sluice_testkit::RedisCluster) -> String {
    if c.ok_within(Duration::from_secs(60)).is_ok() {
        return String::new();
    }
    let before = c.states();
    let fixed = c.fix();
    match c.ok_within(Duration::from_secs(30)) {
        Ok(()) => {
            format!("; not ok after 60 s ({}), repaired by redis-cli --cluster fix", before.trim().replace('\n', ";"))
        }
        Err(states) => panic!("the cluster did not become ok, even after redis-cli --cluster fix:\n{states}\n{fixed}"),
    }
}

/// Moves 50 to 400 slots between two of the Cluster's primaries, under load.
async fn move_slots(fleet: &Fleet, rng: &mut Rng) -> String {
    let n = rng.between(50, 400) as u32;
    let pick = rng.below(1_000);
    let fleet_servers = &fleet.servers;
    tokio::task::block_in_place(|| {
        let servers = fleet_servers.lock().unwrap();
        let Servers::Cluster(c) = &*servers else { return "no slots here".to_string() };
        let ps = c.primaries();
        let (from, to) = (ps[pick as usize % ps.len()], ps[(pick as usize + 1) % ps.len()]);
        c.reshard(from, to, n);
        c.wait_agreement(Duration::from_secs(30));
        format!("{n} slots from node {from} to node {to}")
    })
}

/// Sets an override of a hot client's fw limit (5), held 1 to 4 s, then removes it.
async fn override_client(fleet: &Fleet, rng: &mut Rng) -> String {
    let client = rng.below(4);
    let held = rng.between(1_000, 4_000);
    let http = reqwest::Client::new();
    let body = serde_json::json!({"domain": "soak", "entries": [{"key": "fw", "value": format!("c{client}")}], "limit": 5, "reason": "soak"});
    let id = format!("soak-c{client}");
    let mut set = Vec::new();
    for base in fleet.admin_https() {
        let put = http.put(format!("{base}/v1/overrides/{id}")).bearer_auth(ADMIN_TOKEN).json(&body).send().await;
        set.push(put.map_or(0, |r| r.status().as_u16()));
    }
    tokio::time::sleep(Duration::from_millis(held)).await;
    for base in fleet.admin_https() {
        let _ = http.delete(format!("{base}/v1/overrides/{id}")).bearer_auth(ADMIN_TOKEN).send().await;
    }
    format!("client c{client} fw limit 5 for {held} ms (set: {set:?})")
}
