//! Test harness: real servers on free loopback ports, stopped by PID.
//!
//! Tests talk to real `redis-server` processes, never to mocks of Redis behaviour. A
//! server that cannot be found is an error that says how to install it: a test that
//! needs a server fails without one, it never passes silently.

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
    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
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
}

impl RedisServer {
    /// Starts a redis-server and waits until it answers PING (up to 10 s).
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a redis-server with extra arguments (e.g. `["--replicaof", "127.0.0.1",
    /// "6379"]`).
    pub fn start_with(extra: &[&str]) -> Self {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let mut last_error = String::new();
        // a port found free can be taken before the server binds it: try a few
        for _ in 0..5 {
            let dir = TempDir::new("sluice-redis");
            let port = free_port();
            match launch(port, &dir, &extra) {
                Ok(process) => return Self { process, port, extra, dir },
                Err(e) => last_error = e,
            }
        }
        panic!("{last_error}")
    }

    /// Starts the server again on the same port (after [`RedisServer::kill`]), empty.
    pub fn restart(&mut self) {
        self.process.kill();
        self.process = launch(self.port, &self.dir, &self.extra).unwrap_or_else(|e| panic!("restart: {e}"));
    }

    /// A replica of `primary`, returned once its replication link is up and in sync.
    pub fn replica_of(primary: &RedisServer) -> Self {
        let replica = Self::start_with(&["--replicaof", "127.0.0.1", &primary.port().to_string()]);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let info = replica.command("INFO replication").unwrap_or_default();
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
        let stats = self.command("INFO commandstats").unwrap_or_default();
        stats
            .lines()
            .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_evalsha_ro:"))
            .filter_map(|l| l.split("calls=").nth(1)?.split(',').next()?.parse::<u64>().ok())
            .sum()
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

    /// Sends a command (inline protocol) and returns the raw reply.
    pub fn command(&self, line: &str) -> std::io::Result<String> {
        send(self.port, line)
    }

    /// Kills the server now.
    pub fn kill(&mut self) {
        self.process.kill();
    }
}

/// Starts redis-server on `port` and waits (up to 10 s) until it answers PING.
fn launch(port: u16, dir: &TempDir, extra: &[String]) -> Result<Process, String> {
    let bin = require("redis-server", "redis-server");
    let mut cmd = Command::new(&bin);
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(["--daemonize", "no", "--protected-mode", "yes"])
        .arg("--dir")
        .arg(dir.path())
        .args(extra);
    let mut process = Process::spawn(&mut cmd).map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && !process.exited() {
        if ping(port).is_ok() {
            return Ok(process);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(format!("redis-server on port {port} did not answer PING"))
}

fn send(port: u16, line: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], port)), Duration::from_secs(1))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(format!("{line}\r\n").as_bytes())?;
    let mut buf = vec![0u8; 64 * 1024];
    let n = s.read(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// PINGs a Redis on `port`.
pub fn ping(port: u16) -> std::io::Result<()> {
    let reply = send(port, "PING")?;
    if reply.starts_with("+PONG") {
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
