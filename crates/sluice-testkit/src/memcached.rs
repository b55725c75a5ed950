//! A `memcached` process on a free port.

use crate::*;

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
