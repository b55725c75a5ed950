//! Test harness: real servers on free loopback ports, stopped by PID.
//!
//! Tests talk to real `redis-server` processes, never to mocks of Redis behaviour. A
//! server that cannot be found is an error that says how to install it: a test that
//! needs a server fails without one, it never passes silently.

mod proxy;
pub use proxy::Proxy;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("no free loopback port")
}

/// A free port below 55000, whose `port + 10000` (a Redis Cluster node's bus port) is a
/// valid port too.
pub fn free_cluster_port() -> u16 {
    (0..1000).map(|_| free_port()).find(|&p| p < 55_000).expect("no free loopback port below 55000")
}

/// The path of `program` on PATH, or a panic that says how to install it.
pub fn require(program: &str, package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|d| d.join(program)).find(|p| p.is_file()).unwrap_or_else(|| {
        panic!(
            "`{program}` was not found on PATH. Install it with `sudo apt-get install -y {package}` \
             (or run scripts/test, which installs it), then run the tests again."
        )
    })
}

/// A fresh scratch directory, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates a directory under the system temp dir.
    pub fn new(prefix: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir =
            std::env::temp_dir().join(format!("{prefix}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir_all(&dir).expect("cannot create a temp dir");
        Self(dir)
    }
    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child process killed (by its PID) and reaped on drop.
pub struct Process {
    child: Child,
}

impl Process {
    /// Starts `cmd` with its output discarded.
    pub fn spawn(cmd: &mut Command) -> std::io::Result<Self> {
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().map(|child| Self { child })
    }

    /// Starts `cmd` with its output (stdout and stderr) appended to `log`.
    pub fn spawn_logging(cmd: &mut Command, log: &Path) -> std::io::Result<Self> {
        let out = std::fs::OpenOptions::new().create(true).append(true).open(log)?;
        let err = out.try_clone()?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err).spawn().map(|child| Self { child })
    }
    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }
    /// The exit code, once the process has exited (None while it runs, or if a signal
    /// ended it).
    pub fn exit_code(&mut self) -> Option<i32> {
        self.child.try_wait().ok().flatten().and_then(|status| status.code())
    }
    /// Sends it `signal` (`-TERM`, `-HUP`) with kill(1).
    pub fn signal(&self, signal: &str) {
        let sent = Command::new("kill").arg(signal).arg(self.pid().to_string()).status().expect("run kill");
        assert!(sent.success(), "kill {signal} {} failed", self.pid());
    }
    /// Kills the process (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A real `redis-server` on a free loopback port, with no persistence, in its own temp
/// dir. Killed when dropped.
pub struct RedisServer {
    process: Process,
    port: u16,
    extra: Vec<String>,
    dir: TempDir,
    program: PathBuf,
}

impl RedisServer {
    /// Starts a redis-server and waits until it answers PING (up to 10 s).
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a redis-server with extra arguments (e.g. `["--replicaof", "127.0.0.1",
    /// "6379"]`).
    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_program(&require("redis-server", "redis-server"), extra)
    }

    /// Starts `program` (another build of redis-server) with extra arguments.
    pub fn start_program(program: &Path, extra: &[&str]) -> Self {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let cluster = extra.iter().any(|a| a == "--cluster-enabled");
        let mut last_error = String::new();
        // a port found free can be taken before the server binds it: try a few
        for _ in 0..5 {
            let dir = TempDir::new("sluice-redis");
            let port = if cluster { free_cluster_port() } else { free_port() };
            match launch(program, port, &dir, &extra) {
                Ok(process) => return Self { process, port, extra, dir, program: program.to_path_buf() },
                Err(e) => last_error = e,
            }
        }
        panic!("{last_error}")
    }

    /// Starts the server again on the same port (after [`RedisServer::kill`]), empty.
    pub fn restart(&mut self) {
        self.process.kill();
        self.process =
            launch(&self.program, self.port, &self.dir, &self.extra).unwrap_or_else(|e| panic!("restart: {e}"));
    }

    /// A replica of `primary`, returned once its replication link is up and in sync.
    pub fn replica_of(primary: &RedisServer) -> Self {
        Self::replica_with_password(primary, None)
    }

    /// A replica of `primary` whose servers want `password` (`requirepass`, and
    /// `masterauth` to replicate), returned once in sync.
    pub fn replica_with_password(primary: &RedisServer, password: Option<&str>) -> Self {
        let port = primary.port().to_string();
        let auth = password.map(|p| ["--requirepass", p, "--masterauth", p]);
        let args = [&["--replicaof", "127.0.0.1", &port][..], auth.as_ref().map_or(&[][..], |a| &a[..])].concat();
        let replica = Self::start_with(&args);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let info = cli(replica.port(), password, &["INFO", "replication"]);
            if info.contains("master_link_status:up") && !info.contains("master_sync_in_progress:1") {
                return replica;
            }
            assert!(Instant::now() < deadline, "replica on {} did not sync with its primary: {info}", replica.port());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// How many times a script has run on this server (`EVALSHA` and `EVALSHA_RO`
    /// calls in `INFO commandstats`).
    pub fn script_calls(&self) -> u64 {
        script_calls(&self.command("INFO commandstats").unwrap_or_default())
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The address.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// A `redis://` URL for this server.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The server's PID.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Sends the server `signal` (`-STOP`, `-CONT`).
    pub fn signal(&self, signal: &str) {
        self.process.signal(signal)
    }

    /// Sends a command (inline protocol) and returns the raw reply.
    pub fn command(&self, line: &str) -> std::io::Result<String> {
        send(self.port, line)
    }

    /// Kills the server now.
    pub fn kill(&mut self) {
        self.process.kill();
    }
}

/// Makes, with `openssl` in `dir`, a CA (`{ca}.crt`, `{ca}.key`) and for each of
/// `leaves` a certificate it signs (`{leaf}.crt`, `{leaf}.key`), valid for 127.0.0.1
/// and localhost (as a server, or as a client).
pub fn make_certs(dir: &Path, ca: &str, leaves: &[&str]) {
    require("openssl", "openssl");
    let run = |args: &[&str]| {
        let out = Command::new("openssl").args(args).current_dir(dir).output().expect("run openssl");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let (ca_key, ca_crt, subject) = (format!("{ca}.key"), format!("{ca}.crt"), format!("/CN={ca}"));
    run(&["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", &ca_key, "-out", &ca_crt, "-days", "2"]
        .into_iter()
        .chain(["-subj", &subject])
        .collect::<Vec<_>>());
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1,DNS:localhost\n").unwrap();
    for leaf in leaves {
        let (key, csr, crt) = (format!("{leaf}.key"), format!("{leaf}.csr"), format!("{leaf}.crt"));
        run(&["req", "-newkey", "rsa:2048", "-nodes", "-keyout", &key, "-out", &csr, "-subj", "/CN=127.0.0.1"]);
        run(&["x509", "-req", "-in", &csr, "-CA", &ca_crt, "-CAkey", &ca_key, "-CAcreateserial", "-out", &crt]
            .into_iter()
            .chain(["-days", "2", "-extfile", "san.ext"])
            .collect::<Vec<_>>());
    }
}

/// A redis-server that speaks only TLS, with a CA and a server certificate made for it
/// by `openssl`. Killed on drop.
pub struct TlsRedisServer {
    process: Process,
    port: u16,
    dir: TempDir,
}

impl TlsRedisServer {
    /// Makes the certificates and starts the server; waits until it answers PING over
    /// TLS (`redis-cli --tls`).
    pub fn start() -> Self {
        require("redis-cli", "redis-tools");
        let bin = require("redis-server", "redis-server");
        let dir = TempDir::new("sluice-redis-tls");
        let d = dir.path().to_path_buf();
        make_certs(&d, "ca", &["server"]);
        for _ in 0..5 {
            let port = free_port();
            let mut cmd = Command::new(&bin);
            cmd.args([
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--tls-cert-file", "server.crt", "--tls-key-file", "server.key", "--tls-ca-cert-file", "ca.crt"])
            .args(["--tls-auth-clients", "no", "--dir"])
            .arg(&d)
            .current_dir(&d);
            let mut process = Process::spawn(&mut cmd).expect("start redis-server with TLS");
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && !process.exited() {
                let pong = Command::new("redis-cli")
                    .args(["--tls", "--cacert"])
                    .arg(d.join("ca.crt"))
                    .args(["-p", &port.to_string(), "PING"])
                    .output()
                    .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("PONG"));
                if pong {
                    // the directory (certificates) lives as long as the server
                    return Self { process, port, dir };
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        panic!("redis-server with TLS did not answer")
    }

    /// `rediss://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}/", self.port)
    }

    /// The CA certificate (PEM) that signed the server's certificate.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// Runs `redis-cli --tls` with `args` and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["--tls", "--cacert"])
            .arg(self.ca_file())
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The server's PID.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }
}

/// A real `memcached` on a free loopback port, killed on drop.
pub struct MemcachedServer {
    process: Process,
    port: u16,
}

impl MemcachedServer {
    /// Starts memcached with `extra` arguments (e.g. `["-m", "1"]` for a 1 MB cache)
    /// and waits until it answers `version`.
    pub fn start_with(extra: &[&str]) -> Self {
        let bin = require("memcached", "memcached");
        let mut last_error = String::new();
        for _ in 0..5 {
            let port = free_port();
            let mut cmd = Command::new(&bin);
            cmd.args(["-l", "127.0.0.1", "-p", &port.to_string(), "-U", "0", "-u", "root"]).args(extra);
            let mut process =
                Process::spawn(&mut cmd).unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && !process.exited() {
                if send(port, "version").is_ok_and(|r| r.starts_with("VERSION")) {
                    return Self { process, port };
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            last_error = format!("memcached on port {port} did not answer");
        }
        panic!("{last_error}")
    }

    /// Starts memcached with its default settings.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Sends a text-protocol command and returns the raw reply.
    pub fn command(&self, line: &str) -> std::io::Result<String> {
        send(self.port, line)
    }

    /// The server's PID.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }
}

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

/// The script calls (`EVALSHA`, `EVALSHA_RO`) an `INFO commandstats` reply counts.
fn script_calls(stats: &str) -> u64 {
    stats
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_evalsha_ro:"))
        .filter_map(|l| l.split("calls=").nth(1)?.split(',').next()?.parse::<u64>().ok())
        .sum()
}

/// `redis-cli -p PORT [-a PASSWORD] ARGS...`, its output.
fn cli(port: u16, password: Option<&str>, args: &[&str]) -> String {
    let mut cmd = Command::new(require("redis-cli", "redis-tools"));
    cmd.args(["-p", &port.to_string()]);
    if let Some(p) = password {
        cmd.args(["-a", p, "--no-auth-warning"]);
    }
    let out = cmd.args(args).output().expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

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

/// Starts redis-server on `port` and waits (up to 10 s) until it answers PING.
fn launch(bin: &Path, port: u16, dir: &TempDir, extra: &[String]) -> Result<Process, String> {
    let mut cmd = Command::new(bin);
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(["--daemonize", "no", "--protected-mode", "yes"])
        .arg("--dir")
        .arg(dir.path())
        .args(extra);
    let mut process = Process::spawn(&mut cmd).map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && !process.exited() {
        // the server that answers must be this one: a port found free can be taken by
        // another test's server first, which then answers PING while this one exits
        // (a cluster was once created over such a node, which was not a cluster node)
        if ping(port).is_ok() && answers_as(port, &mut process) {
            return Ok(process);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(format!("redis-server on port {port} did not answer PING (the port may have been taken)"))
}

/// Whether the server on `port` is `process`: by the process id it reports, or, when it
/// wants a password and will not say, by `process` still running a moment later (a
/// server that could not bind its port exits at once).
fn answers_as(port: u16, process: &mut Process) -> bool {
    match send(port, "INFO server") {
        Ok(info) if info.starts_with("-NOAUTH") => {
            std::thread::sleep(Duration::from_millis(200));
            !process.exited()
        }
        Ok(info) => info.contains(&format!("process_id:{}\r", process.pid())),
        Err(_) => false,
    }
}

fn send(port: u16, line: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], port)), Duration::from_secs(1))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(format!("{line}\r\n").as_bytes())?;
    // A long reply (INFO commandstats, KEYS) can come in several reads: read until it is whole.
    let mut reply = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    while !whole(&reply) {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        reply.extend_from_slice(&buf[..n]);
    }
    Ok(String::from_utf8_lossy(&reply).into_owned())
}

/// Whether `reply` is a whole answer: one RESP value from Redis, or from memcached's text
/// protocol a line that ends the answer (`END`, or any single line that is not a `STAT`).
fn whole(reply: &[u8]) -> bool {
    match reply.first() {
        None => false,
        Some(b'+' | b'-' | b':' | b'$' | b'*' | b'_' | b'#' | b',' | b'%') => resp_end(reply, 0).is_some(),
        Some(_) => {
            reply.ends_with(b"END\r\n")
                || (reply.ends_with(b"\r\n") && !reply.starts_with(b"STAT ") && !reply.starts_with(b"VALUE "))
        }
    }
}

/// Where the RESP value starting at `at` ends, if `reply` holds all of it.
fn resp_end(reply: &[u8], at: usize) -> Option<usize> {
    let line_end = at + reply.get(at..)?.windows(2).position(|w| w == b"\r\n")?;
    let header = std::str::from_utf8(&reply[at + 1..line_end]).ok()?;
    let next = line_end + 2;
    match reply[at] {
        b'$' => match header.parse::<i64>().ok()? {
            n if n < 0 => Some(next),
            n => (reply.len() >= next + n as usize + 2).then_some(next + n as usize + 2),
        },
        b'*' | b'%' => {
            let items = header.parse::<i64>().ok()?.max(0) as usize * if reply[at] == b'%' { 2 } else { 1 };
            (0..items).try_fold(next, |end, _| resp_end(reply, end))
        }
        _ => Some(next),
    }
}

/// PINGs a Redis on `port` (a server that wants a password, and says so, answers too).
pub fn ping(port: u16) -> std::io::Result<()> {
    let reply = send(port, "PING")?;
    if reply.starts_with("+PONG") || reply.starts_with("-NOAUTH") {
        Ok(())
    } else {
        Err(std::io::Error::other(format!("unexpected reply to PING: {reply:?}")))
    }
}

/// Waits until `port` on loopback accepts connections, up to `timeout`.
pub fn wait_for_port(port: u16, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[cfg(test)]
mod tests {
    use super::whole;

    #[test]
    fn a_reply_is_whole_only_when_all_of_it_came() {
        let info = b"$19\r\n# Commandstats\r\nabc\r\n";
        assert!(whole(info));
        assert!(!whole(&info[..12]), "a bulk string cut short");
        assert!(whole(b"*2\r\n$1\r\na\r\n$-1\r\n"));
        assert!(!whole(b"*2\r\n$1\r\na\r\n"), "an array missing its second item");
        assert!(whole(b"*1\r\n*2\r\n:1\r\n:2\r\n"));
        assert!(!whole(b"*1\r\n*2\r\n:1\r\n"), "a nested array cut short");
        assert!(whole(b"+PONG\r\n") && whole(b"-NOAUTH Authentication required.\r\n"));
        assert!(!whole(b"+PON"));
        assert!(whole(b"STAT pid 1\r\nEND\r\n") && !whole(b"STAT pid 1\r\n"));
        assert!(whole(b"VERSION 1.6.21\r\n") && !whole(b""));
    }
}
