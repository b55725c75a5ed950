//! Certificates made with `openssl` for the TLS tests, and a `redis-server` that speaks
//! only TLS.

use crate::*;

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
