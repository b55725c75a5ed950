//! Test harness: real servers on free loopback ports, stopped by PID.
//!
//! Tests talk to real `redis-server` processes, never to mocks of Redis behaviour. A
//! server that cannot be found is an error that says how to install it: a test that
//! needs a server fails without one, it never passes silently.
//!
//! Here: processes stopped on drop, scratch directories, ports; beside it, one file a kind
//! of server (`redis`, `tls`, `memcached`, `sentinel`, `cluster`) and the delaying link
//! (`proxy`).

mod cluster;
mod memcached;
mod proxy;
mod redis;
mod sentinel;
mod tls;

pub use cluster::RedisCluster;
pub use memcached::MemcachedServer;
pub use proxy::Proxy;
pub use redis::RedisServer;
use redis::{cli, script_calls, send};
pub use sentinel::{RedisSentinels, SentinelServer};
pub use tls::{TlsRedisServer, make_certs};

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A port on 127.0.0.1 that was free a moment ago, for a server that cannot bind port 0
/// and say what it bound (redis-server, memcached, redis-sentinel: their port 0 turns TCP
/// off). Another process may take it first, so every caller here starts its server on a
/// fresh one when the first cannot bind (five tries). Sluice itself binds port 0 and the
/// tests read the address back from its log.
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
