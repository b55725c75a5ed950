//! The processes: the store's servers and the `sluice serve` instances, started on free
//! loopback ports (read back, never guessed), restarted by the nemesis, stopped by PID
//! when the run ends.

use crate::check::{DEADLINE_MS, LINK_DELAY_MS};
use crate::{Args, Rng};
use sluice_testkit::{Process, Proxy, RedisCluster, RedisSentinels, RedisServer, TempDir};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// The admin token of every instance (overrides are set through it).
pub const ADMIN_TOKEN: &str = "soak-admin-0123456789abcdef";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    Redis,
    Replicas,
    Sentinel,
    Cluster,
}

impl StoreKind {
    pub fn parse(s: &str) -> Result<Self, String> {
        Ok(match s {
            "redis" => Self::Redis,
            "replicas" => Self::Replicas,
            "sentinel" => Self::Sentinel,
            "cluster" => Self::Cluster,
            other => return Err(format!("--store {other}: give redis, replicas, sentinel or cluster")),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Redis => "redis",
            Self::Replicas => "replicas",
            Self::Sentinel => "sentinel",
            Self::Cluster => "cluster",
        }
    }
}

/// The store's servers.
pub enum Servers {
    Redis(RedisServer),
    Replicas {
        primary: RedisServer,
        _replicas: Vec<RedisServer>,
    },
    Sentinel(RedisSentinels),
    Cluster(RedisCluster),
    /// `--regions`: each region's redis-server, the global one, and each region's link
    /// to it.
    Regions {
        regional: Vec<RedisServer>,
        global: RedisServer,
        links: Vec<Proxy>,
    },
}

/// Where an instance answers.
pub struct Endpoint {
    pub http: String,
    pub grpc: tonic::transport::Channel,
}

struct Instance {
    process: Option<Process>,
    dir: PathBuf,
}

pub struct Fleet {
    pub kind: StoreKind,
    pub servers: Mutex<Servers>,
    instances: Mutex<Vec<Instance>>,
    /// Each instance's endpoint while it runs (None while the nemesis holds it down).
    pub endpoints: RwLock<Vec<Option<Arc<Endpoint>>>>,
    sluice: PathBuf,
    /// The `store:` section (and with regions, the region's lines), by region.
    store_sections: Vec<String>,
    plant: Option<String>,
    dir: TempDir,
    /// The region most of gl's demand comes from (`--regions`; the nemesis moves it).
    pub hot: AtomicUsize,
}

/// The rules: every kind the promise covers (see `check::Rule`), and with regions, one
/// shared across them, at twice fw's limit (a reload changes both: a global limit
/// lowered and raised under load).
pub fn domains(fw_limit: u64, regions: bool) -> String {
    let global = match regions {
        true => format!(
            "      - key: gl\n        policies: [{{name: gl, fixed_window: {{limit: {}, window: 2s, global: true}}}}]\n",
            2 * fw_limit
        ),
        false => String::new(),
    };
    format!(
        "domains:
  - domain: soak
    descriptors:
      - key: fw
        policies: [{{name: fw, fixed_window: {{limit: {fw_limit}, window: 2s}}}}]
      - key: tb
        policies: [{{name: tb, token_bucket: {{rate: 10, per: 1s, burst: 10}}}}]
      - key: sw
        policies: [{{name: sw, sliding_window: {{limit: 20, window: 2s}}}}]
      - key: cc
        policies: [{{name: cc, concurrency: {{limit: 3, lease_ttl: 10s}}}}]
      - key: gr
        grants: auto
        policies: [{{name: gr, fixed_window: {{limit: 40, window: 2s}}}}]
      - key: rv
        policies: [{{name: rv, fixed_window: {{limit: 200, window: 2s}}}}]
{global}"
    )
}

impl Fleet {
    /// The store's servers and 2 to 4 instances (drawn from the seed).
    pub async fn start(args: &Args, rng: &mut Rng) -> Self {
        let (servers, store_sections) = tokio::task::spawn_blocking({
            let (kind, regions) = (args.store, args.regions);
            move || if regions > 0 { start_regions(regions) } else { start_store(kind) }
        })
        .await
        .expect("start the store");
        // with regions: two instances in each
        let n = if args.regions > 0 { 2 * args.regions } else { rng.between(2, 4) as usize };
        let fleet = Self {
            kind: args.store,
            servers: Mutex::new(servers),
            instances: Mutex::new(Vec::new()),
            endpoints: RwLock::new(Vec::new()),
            sluice: args.sluice.clone(),
            store_sections,
            plant: args.plant.clone(),
            dir: TempDir::new("sluice-soak"),
            hot: AtomicUsize::new(0),
        };
        for i in 0..n {
            let dir = fleet.dir.path().join(format!("instance-{i}"));
            std::fs::create_dir_all(&dir).unwrap();
            fleet.write_config(i, &dir, 20);
            fleet.instances.lock().unwrap().push(Instance { process: None, dir });
            fleet.endpoints.write().unwrap().push(None);
            fleet.start_instance(i).await;
        }
        fleet
    }

    pub fn size(&self) -> usize {
        self.endpoints.read().unwrap().len()
    }

    /// How many regions share the global limit (0 without `--regions`).
    pub fn regions(&self) -> usize {
        match self.store_sections.len() {
            1 => 0,
            n => n,
        }
    }

    /// Instance `i`'s region (instances go round the regions).
    pub fn region_of(&self, i: usize) -> usize {
        i % self.store_sections.len()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Keeps the run's directory (logs and configs) after the run.
    pub fn keep_logs(&self) {
        let kept = kept_dir();
        let _ = std::fs::rename(self.dir.path(), &kept);
        eprintln!("soak: logs kept in {}", kept.display());
    }

    /// Instance `i`'s config, with `fw_limit` for rule fw.
    fn write_config(&self, i: usize, dir: &Path, fw_limit: u64) {
        // the planted bug: instances that do not share a key secret count apart
        let secret = match self.plant.as_deref() {
            Some("split-secrets") => format!("soak-secret-of-instance-{i}"),
            _ => "soak-secret-shared".to_string(),
        };
        let text = format!(
            "server:\n  http: 127.0.0.1:0\n  grpc: 127.0.0.1:0\n  admin_token: {ADMIN_TOKEN}\n\
             limiter:\n  key_secret: {secret}\n  deadline: {DEADLINE_MS}ms\n  failure: open\n{}{}",
            self.store_sections[self.region_of(i)],
            domains(fw_limit, self.regions() > 0)
        );
        std::fs::write(dir.join("sluice.yaml"), text).unwrap();
    }

    /// Rewrites every instance's config with `fw_limit` and reloads it (SIGHUP).
    pub fn reload(&self, fw_limit: u64) {
        let instances = self.instances.lock().unwrap();
        for (i, inst) in instances.iter().enumerate() {
            self.write_config(i, &inst.dir, fw_limit);
            if let Some(p) = &inst.process {
                p.signal("-HUP");
            }
        }
    }

    /// Starts instance `i` and waits until it answers.
    pub async fn start_instance(&self, i: usize) {
        let dir = self.instances.lock().unwrap()[i].dir.clone();
        let ready = dir.join("ready");
        let _ = std::fs::remove_file(&ready);
        let mut cmd = std::process::Command::new(&self.sluice);
        cmd.arg("serve").arg("--config").arg(dir.join("sluice.yaml")).arg("--ready-file").arg(&ready);
        let log = dir.join(format!("sluice-{}.log", crate::check::Clock::epoch_ms()));
        let mut process = Process::spawn_logging(&mut cmd, &log).expect("start sluice");
        let started = Instant::now();
        let text = loop {
            if let Ok(text) = std::fs::read_to_string(&ready) {
                break text;
            }
            let tail = || std::fs::read_to_string(&log).unwrap_or_default();
            assert!(!process.exited(), "sluice exited at start:\n{}", tail());
            assert!(started.elapsed() < Duration::from_secs(30), "sluice did not start in 30 s:\n{}", tail());
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let addr = |name: &str| text.lines().find_map(|l| l.strip_prefix(name)).expect("a ready line").to_string();
        let grpc = tonic::transport::Endpoint::from_shared(format!("http://{}", addr("grpc=")))
            .unwrap()
            .connect_timeout(Duration::from_secs(1))
            .timeout(Duration::from_secs(2))
            .connect_lazy();
        let endpoint = Endpoint { http: format!("http://{}", addr("http=")), grpc };
        self.instances.lock().unwrap()[i].process = Some(process);
        self.endpoints.write().unwrap()[i] = Some(Arc::new(endpoint));
    }

    /// Takes instance `i` out of the clients' hands and stops it with `signal` (`-KILL`
    /// or `-TERM`), waiting until it is gone.
    pub async fn stop_instance(&self, i: usize, signal: &str) {
        self.endpoints.write().unwrap()[i] = None;
        let process = self.instances.lock().unwrap()[i].process.take();
        if let Some(mut p) = process {
            p.signal(signal);
            let started = Instant::now();
            while !p.exited() && started.elapsed() < Duration::from_secs(15) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            p.kill();
        }
    }

    /// The base URL of a running instance, for the admin API: one in each region (each
    /// region keeps its own overrides, in its own store).
    pub fn admin_https(&self) -> Vec<String> {
        let eps = self.endpoints.read().unwrap();
        let mut by_region: Vec<Option<String>> = vec![None; self.store_sections.len()];
        for (i, e) in eps.iter().enumerate() {
            if let (Some(e), slot @ None) = (e, &mut by_region[i % self.store_sections.len()]) {
                *slot = Some(e.http.clone());
            }
        }
        by_region.into_iter().flatten().collect()
    }
}

/// `regions` regions, each a redis-server of its own, and a global one each reaches
/// through a link of its own; each region's config lines (`store:`, `region:`,
/// `global_store:`).
fn start_regions(regions: usize) -> (Servers, Vec<String>) {
    let global = RedisServer::start();
    let regional: Vec<RedisServer> = (0..regions).map(|_| RedisServer::start()).collect();
    let delay = Duration::from_millis(LINK_DELAY_MS);
    let links: Vec<Proxy> = (0..regions).map(|_| Proxy::start(global.addr(), delay)).collect();
    let sections = (0..regions)
        .map(|r| {
            format!(
                "store:\n  kind: redis\n  url: \"{}\"\nregion: r{r}\nglobal_store: {{kind: redis, url: \"redis://{}\"}}\n",
                regional[r].url(),
                links[r].addr()
            )
        })
        .collect();
    (Servers::Regions { regional, global, links }, sections)
}

/// The store's servers and the config's `store:` section. Writes to the store wait for a
/// replica where there are replicas (`replica_acks: 1`): without it a failover loses the
/// writes the replica had not received, and the fleet admits them again.
fn start_store(kind: StoreKind) -> (Servers, Vec<String>) {
    let (servers, section) = start_one(kind);
    (servers, vec![section])
}

fn start_one(kind: StoreKind) -> (Servers, String) {
    match kind {
        StoreKind::Redis => {
            let r = RedisServer::start();
            let section = format!("store:\n  kind: redis\n  url: \"{}\"\n", r.url());
            (Servers::Redis(r), section)
        }
        StoreKind::Replicas => {
            let primary = RedisServer::start();
            let replicas: Vec<RedisServer> = (0..2).map(|_| RedisServer::replica_of(&primary)).collect();
            let urls: Vec<String> = replicas.iter().map(|r| format!("\"{}\"", r.url())).collect();
            let section = format!(
                "store:\n  kind: redis\n  url: \"{}\"\n  replicas: [{}]\n  replica_acks: 1\n",
                primary.url(),
                urls.join(", ")
            );
            (Servers::Replicas { primary, _replicas: replicas }, section)
        }
        StoreKind::Sentinel => {
            let set = RedisSentinels::start(2, 3, 2_000);
            let section = format!(
                "store:\n  kind: redis_sentinel\n  sentinels: [{}]\n  master_name: {}\n  replica_acks: 1\n",
                set.addrs().join(", "),
                RedisSentinels::MASTER
            );
            (Servers::Sentinel(set), section)
        }
        StoreKind::Cluster => {
            let c = RedisCluster::start();
            let nodes: Vec<String> = c.urls().iter().map(|u| format!("\"{u}\"")).collect();
            let section =
                format!("store:\n  kind: redis_cluster\n  nodes: [{}]\n  replica_acks: 1\n", nodes.join(", "));
            (Servers::Cluster(c), section)
        }
    }
}

/// Where a run's directory is kept when it fails.
pub fn kept_dir() -> PathBuf {
    std::env::temp_dir().join(format!("sluice-soak-kept-{}", std::process::id()))
}
