//! A primary, its replicas and three `redis-sentinel` processes watching them, with
//! failovers the tests start.

use crate::*;

/// Redis behind Sentinel: a primary, its replicas and Sentinels watching it as
/// [`RedisSentinels::MASTER`], each on a free loopback port in its own temp dir, killed on
/// drop. Returned once every Sentinel names the primary and sees every replica (and, with
/// several, the other Sentinels), as a failover needs.
pub struct RedisSentinels {
    pub primary: RedisServer,
    pub replicas: Vec<RedisServer>,
    pub sentinels: Vec<SentinelServer>,
    /// The servers' password, if they have one.
    password: Option<String>,
}

/// One `redis-sentinel` process.
pub struct SentinelServer {
    process: Process,
    port: u16,
    password: Option<String>,
    _dir: TempDir,
}

impl SentinelServer {
    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// A command's reply as `redis-cli` prints it.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, self.password.as_deref(), args)
    }

    /// Kills it now.
    pub fn kill(&mut self) {
        self.process.kill();
    }
}

impl RedisSentinels {
    /// The name the Sentinels monitor the primary under.
    pub const MASTER: &'static str = "sluice-primary";

    /// `replicas` replicas and `sentinels` Sentinels (quorum: a majority of them), each
    /// calling the primary down after `down_after_ms` without an answer.
    pub fn start(replicas: usize, sentinels: usize, down_after_ms: u64) -> Self {
        Self::start_with_passwords(replicas, sentinels, down_after_ms, None)
    }

    /// As [`RedisSentinels::start`], with `passwords`: the servers' (`requirepass`, and
    /// `masterauth` for replication) and the Sentinels' own (`requirepass`; they reach
    /// the servers with `sentinel auth-pass`).
    pub fn start_with_passwords(
        replicas: usize,
        sentinels: usize,
        down_after_ms: u64,
        passwords: Option<(&str, &str)>,
    ) -> Self {
        let bin = require("redis-sentinel", "redis-sentinel");
        let sentinel_auth = match passwords {
            Some((r, s)) => format!("requirepass {s}\nsentinel auth-pass {} {r}\n", Self::MASTER),
            None => String::new(),
        };
        let redis_password = passwords.map(|p| p.0);
        let primary = match redis_password {
            Some(p) => RedisServer::start_with(&["--requirepass", p, "--masterauth", p]),
            None => RedisServer::start(),
        };
        let replicas: Vec<RedisServer> =
            (0..replicas).map(|_| RedisServer::replica_with_password(&primary, redis_password)).collect();
        let quorum = sentinels / 2 + 1;
        let sentinels: Vec<SentinelServer> = (0..sentinels)
            .map(|_| {
                let mut last = String::new();
                for _ in 0..5 {
                    let (dir, port) = (TempDir::new("sluice-sentinel"), free_port());
                    let conf = dir.path().join("sentinel.conf");
                    std::fs::write(
                        &conf,
                        format!(
                            "port {port}\nbind 127.0.0.1\nprotected-mode no\ndaemonize no\ndir {}\n\
                             sentinel monitor {} 127.0.0.1 {} {quorum}\n\
                             sentinel down-after-milliseconds {} {down_after_ms}\n\
                             sentinel failover-timeout {} 10000\n{sentinel_auth}",
                            dir.path().display(),
                            Self::MASTER,
                            primary.port(),
                            Self::MASTER,
                            Self::MASTER,
                        ),
                    )
                    .expect("write sentinel.conf");
                    let mut cmd = Command::new(&bin);
                    cmd.arg(&conf);
                    let mut process = Process::spawn(&mut cmd).expect("start redis-sentinel");
                    if wait_for_port(port, Duration::from_secs(5)) && ping(port).is_ok() {
                        let password = passwords.map(|p| p.1.to_string());
                        return SentinelServer { process, port, password, _dir: dir };
                    }
                    process.kill();
                    last = format!("redis-sentinel on port {port} did not answer PING");
                }
                panic!("{last}")
            })
            .collect();
        let set = Self { primary, replicas, sentinels, password: passwords.map(|p| p.0.to_string()) };
        set.wait_until_known();
        set
    }

    /// Waits until every Sentinel sees every replica linked and the other Sentinels.
    fn wait_until_known(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        for s in &self.sentinels {
            loop {
                let replicas = s.cli(&["SENTINEL", "REPLICAS", Self::MASTER]);
                let linked = replicas
                    .lines()
                    .collect::<Vec<_>>()
                    .windows(2)
                    .filter(|w| w[0] == "master-link-status" && w[1] == "ok")
                    .count();
                let master = s.cli(&["SENTINEL", "MASTER", Self::MASTER]);
                let lines: Vec<&str> = master.lines().collect();
                let others =
                    lines.windows(2).find(|w| w[0] == "num-other-sentinels").and_then(|w| w[1].parse::<usize>().ok());
                if linked == self.replicas.len() && others == Some(self.sentinels.len() - 1) {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "Sentinel {} does not know the set yet:\n{replicas}\n{master}",
                    s.addr()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// How many scripts the replicas have run (`EVALSHA_RO` and `EVALSHA` calls).
    pub fn replica_script_calls(&self) -> u64 {
        let stats = self.replicas.iter().map(|r| cli(r.port(), self.password.as_deref(), &["INFO", "commandstats"]));
        stats.map(|s| script_calls(&s)).sum()
    }

    /// Every Sentinel's `host:port`.
    pub fn addrs(&self) -> Vec<String> {
        self.sentinels.iter().map(SentinelServer::addr).collect()
    }

    /// The port of the server the first Sentinel that answers names as the primary.
    pub fn primary_port(&self) -> Option<u16> {
        self.sentinels.iter().find_map(|s| {
            let reply = s.cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", Self::MASTER]);
            reply.lines().nth(1)?.trim().parse().ok()
        })
    }

    /// The newest configuration epoch a Sentinel holds for the set: 0 before any
    /// failover, 1 after one, more after a Sentinel failed the promoted one over again.
    pub fn config_epoch(&self) -> u64 {
        let epoch = |s: &SentinelServer| {
            let master = s.cli(&["SENTINEL", "MASTER", Self::MASTER]);
            let lines: Vec<&str> = master.lines().collect();
            lines.windows(2).find(|w| w[0] == "config-epoch").and_then(|w| w[1].trim().parse().ok())
        };
        self.sentinels.iter().filter_map(epoch).max().unwrap_or(0)
    }

    /// The port of the primary every Sentinel names, when they all name the same one.
    pub fn agreed_primary_port(&self) -> Option<u16> {
        let named: Vec<Option<u16>> = self
            .sentinels
            .iter()
            .map(|s| s.cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", Self::MASTER]).lines().nth(1)?.trim().parse().ok())
            .collect();
        named.iter().all(|p| *p == named[0]).then_some(named[0]).flatten()
    }

    /// The server (primary or replica) on `port`.
    pub fn server(&self, port: u16) -> Option<&RedisServer> {
        std::iter::once(&self.primary).chain(&self.replicas).find(|r| r.port() == port)
    }
}
