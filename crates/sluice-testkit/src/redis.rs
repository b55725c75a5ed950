//! `redis-server` processes: one node (with a password, persistence or replicas), started
//! on a free port (tried again when another process took it first), and the few lines of
//! RESP the harness speaks to them.

use crate::*;

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

/// The script calls (`EVALSHA`, `EVALSHA_RO`) an `INFO commandstats` reply counts.
pub(crate) fn script_calls(stats: &str) -> u64 {
    stats
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_evalsha_ro:"))
        .filter_map(|l| l.split("calls=").nth(1)?.split(',').next()?.parse::<u64>().ok())
        .sum()
}

/// `redis-cli -p PORT [-a PASSWORD] ARGS...`, its output.
pub(crate) fn cli(port: u16, password: Option<&str>, args: &[&str]) -> String {
    let mut cmd = Command::new(require("redis-cli", "redis-tools"));
    cmd.args(["-p", &port.to_string()]);
    if let Some(p) = password {
        cmd.args(["-a", p, "--no-auth-warning"]);
    }
    let out = cmd.args(args).output().expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Starts redis-server on `port` and waits (up to 10 s) until it answers PING.
pub(crate) fn launch(bin: &Path, port: u16, dir: &TempDir, extra: &[String]) -> Result<Process, String> {
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
pub(crate) fn answers_as(port: u16, process: &mut Process) -> bool {
    match send(port, "INFO server") {
        Ok(info) if info.starts_with("-NOAUTH") => {
            std::thread::sleep(Duration::from_millis(200));
            !process.exited()
        }
        Ok(info) => info.contains(&format!("process_id:{}\r", process.pid())),
        Err(_) => false,
    }
}

pub(crate) fn send(port: u16, line: &str) -> std::io::Result<String> {
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
pub(crate) fn whole(reply: &[u8]) -> bool {
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
pub(crate) fn resp_end(reply: &[u8], at: usize) -> Option<usize> {
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
