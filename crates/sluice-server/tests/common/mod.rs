//! Starting the real `sluice` binary for a test.

#![allow(dead_code)]

use sluice_testkit::{Process, TempDir};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Tests that start whole clusters or drive load take this lock, so they do not run at
/// once: on a 2-core machine their CPU contention would push decisions past the store
/// deadline, and the failure policy (correctly) would decide them instead.
pub async fn heavy() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// A running `sluice serve`, killed on drop.
pub struct Sluice {
    pub process: Process,
    pub base: String,
    /// `127.0.0.1:PORT` of the gRPC (Envoy rate limit service) listener.
    pub grpc: String,
    pub dir: TempDir,
}

/// The binary under test.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_sluice")
}

/// Starts `sluice serve` with `domains_yaml` as the `domains:` section, on a free port.
pub fn start(domains_yaml: &str) -> Sluice {
    start_with("", domains_yaml)
}

/// Starts `sluice serve` with more top-level config (`store:`, `limiter:` ...) before
/// the `domains:` section, and waits until `/readyz` says its store answers, as a load
/// balancer would before sending traffic.
pub fn start_with(sections: &str, domains_yaml: &str) -> Sluice {
    let s = start_unready(sections, domains_yaml);
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while status_of(&s.base, "/readyz") != Some(200) {
        assert!(std::time::Instant::now() < deadline, "sluice at {} never became ready", s.base);
        std::thread::sleep(Duration::from_millis(25));
    }
    s
}

/// The HTTP status of `GET path`, over a plain TCP connection.
fn status_of(base: &str, path: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let addr = base.trim_start_matches("http://");
    let mut c = std::net::TcpStream::connect(addr).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(c, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").ok()?;
    let mut head = [0u8; 64];
    let n = c.read(&mut head).ok()?;
    std::str::from_utf8(&head[..n]).ok()?.split(' ').nth(1)?.parse().ok()
}

/// As [`start_with`], without waiting for the store.
pub fn start_unready(sections: &str, domains_yaml: &str) -> Sluice {
    let dir = TempDir::new("sluice-test");
    let config = dir.path().join("sluice.yaml");
    // further `server:` keys given in `sections` (indented) continue this block
    std::fs::write(&config, format!("{SERVER}{sections}domains:\n{domains_yaml}")).unwrap();
    let (process, http, grpc) = spawn(&config, dir.path());
    Sluice { process, base: format!("http://{http}"), grpc, dir }
}

/// The `server:` section of every test config: ports chosen by the system, so no test
/// can take another's (`spawn` reads them back).
pub const SERVER: &str = "server:\n  http: 127.0.0.1:0\n  grpc: 127.0.0.1:0\n";

/// Starts `sluice serve --config FILE` logging to `dir/sluice.log`, and waits until it
/// has bound its listeners; returns the process and its HTTP and gRPC addresses, read
/// from its `--ready-file`. A server that exits or does not start in 15 s fails the test
/// with its log.
pub fn spawn(config: &Path, dir: &Path) -> (Process, String, String) {
    let mut cmd = Command::new(bin());
    cmd.arg("serve").arg("--config").arg(config);
    spawn_command(cmd, dir)
}

/// [`spawn`] for a `sluice serve` command made ready by the caller (other arguments, an
/// environment).
pub fn spawn_command(mut cmd: Command, dir: &Path) -> (Process, String, String) {
    let (ready, log) = (dir.join("ready"), dir.join("sluice.log"));
    cmd.arg("--ready-file").arg(&ready);
    let mut process = Process::spawn_logging(&mut cmd, &log).expect("start sluice");
    let started = Instant::now();
    let text = loop {
        if let Ok(text) = std::fs::read_to_string(&ready) {
            break text;
        }
        let log = || std::fs::read_to_string(&log).unwrap_or_default();
        assert!(!process.exited(), "sluice exited at start:\n{}", log());
        assert!(started.elapsed() < Duration::from_secs(15), "sluice did not start in 15 s:\n{}", log());
        std::thread::sleep(Duration::from_millis(10));
    };
    let addr = |name: &str| text.lines().find_map(|l| l.strip_prefix(name)).expect("a ready file line").to_string();
    (process, addr("http="), addr("grpc="))
}

impl Sluice {
    /// The server's exit code, waiting at most `limit` for it to exit (after a signal).
    pub fn exit_code_within(&mut self, limit: Duration) -> i32 {
        let started = Instant::now();
        loop {
            if let Some(code) = self.process.exit_code() {
                return code;
            }
            assert!(started.elapsed() < limit, "still running {limit:?} after SIGTERM:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What the server has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sluice.log")).unwrap_or_default()
    }
}

/// POSTs one descriptor to `/v1/ratelimit`.
pub async fn hit(client: &reqwest::Client, base: &str, domain: &str, entries: &[(&str, &str)]) -> reqwest::Response {
    client.post(format!("{base}/v1/ratelimit")).json(&body(domain, entries)).send().await.unwrap()
}

/// The server's `/metrics` text.
pub async fn metrics(client: &reqwest::Client, base: &str) -> String {
    client.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap()
}

/// A rate limit request body for one descriptor.
pub fn body(domain: &str, entries: &[(&str, &str)]) -> serde_json::Value {
    let entries: Vec<_> = entries.iter().map(|(k, v)| serde_json::json!({"key": k, "value": v})).collect();
    serde_json::json!({"domain": domain, "descriptors": [{"entries": entries}]})
}

/// A header as a string ("" when absent).
pub fn header(r: &reqwest::Response, name: &str) -> String {
    r.headers().get(name).map(|v| v.to_str().unwrap().to_string()).unwrap_or_default()
}

/// A header as a number.
pub fn num(r: &reqwest::Response, name: &str) -> u64 {
    header(r, name).parse().unwrap_or_else(|_| panic!("header {name} is not a number: {:?}", header(r, name)))
}

/// Sends `n` requests for one client all at once, round robin over `bases`; returns how
/// many were admitted and how many were decided by the failure policy.
pub async fn burst(bases: &[String], domain: &str, user: &str, n: usize) -> (u32, u32) {
    let client = reqwest::Client::new();
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (client, base) = (client.clone(), bases[i % bases.len()].clone());
            let (domain, user) = (domain.to_string(), user.to_string());
            tokio::spawn(async move {
                let r = hit(&client, &base, &domain, &[("user", &user)]).await;
                (r.status().as_u16(), header(&r, "x-sluice-degraded"))
            })
        })
        .collect();
    let (mut ok, mut degraded) = (0, 0);
    for t in tasks {
        let (status, d) = t.await.unwrap();
        ok += (status == 200) as u32;
        degraded += !d.is_empty() as u32;
    }
    (ok, degraded)
}

/// The `domains:` section of one domain `d` allowing each `user` `limit` an hour.
pub fn rule(limit: u64) -> String {
    format!(
        "  - domain: d\n    descriptors:\n      - key: user\n        rate_limit: {{unit: hour, requests_per_unit: {limit}}}\n"
    )
}

/// A process's resident memory as the system reports it (`VmRSS`), in bytes.
pub fn rss_of(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).unwrap();
    kb.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() * 1024
}

/// A codec that sends and receives raw bytes, to send what no generated client would.
#[derive(Debug, Clone, Copy, Default)]
pub struct Raw;

impl tonic::codec::Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl tonic::codec::Encoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        let v = bytes::Buf::chunk(src).to_vec();
        bytes::Buf::advance(src, v.len());
        Ok(Some(v))
    }
}

/// `n` domains `d0` .. `d{n-1}`, each with one rule (`user`, `limit` an hour), as the
/// `domains:` section of a config: a large config.
pub fn many_domains(n: usize, limit: u64) -> String {
    (0..n)
        .map(|i| {
            format!("  - domain: d{i}\n    descriptors:\n      - key: user\n        rate_limit: {{unit: hour, requests_per_unit: {limit}}}\n")
        })
        .collect()
}

/// The CPU time process `pid` has used, in clock ticks (1/100 s): user and system.
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
    // utime and stime, the 14th and 15th fields (12th and 13th after the name)
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// Envoy's RLS request for one descriptor of `entries` in `domain`, cost 1.
pub fn rls_request(
    domain: &str,
    entries: &[(&str, &str)],
) -> envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
        RateLimitDescriptor, rate_limit_descriptor::Entry,
    };
    envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest {
        domain: domain.into(),
        descriptors: vec![RateLimitDescriptor {
            entries: entries.iter().map(|(k, v)| Entry { key: (*k).into(), value: (*v).into() }).collect(),
            ..Default::default()
        }],
        hits_addend: 1,
    }
}

/// The value of the series `name` (with its labels, as written) in a scrape; 0 if absent.
pub fn series(scrape: &str, name: &str) -> f64 {
    scrape.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok()).unwrap_or(0.0)
}

/// The fenced block after `<!-- checked: NAME -->` in docs/`page`.
pub fn doc_example(page: &str, name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs").join(page);
    let doc = std::fs::read_to_string(path).unwrap();
    let marker = format!("<!-- checked: {name} -->\n```");
    let start = doc.find(&marker).unwrap_or_else(|| panic!("no `{marker}` in docs/{page}"));
    let body = &doc[start + marker.len()..];
    let body = &body[body.find('\n').unwrap() + 1..];
    body[..body.find("\n```").expect("a closed block")].to_string() + "\n"
}

/// The documents of deploy/kubernetes with every optional component of it on, as `kubectl
/// kustomize` renders them where kubectl is installed; else the files its
/// kustomization.yaml and its components list, each parsed, so that neither a machine
/// without kubectl nor one with it skips the checks.
pub fn kubernetes_documents() -> Vec<serde_json::Value> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes").canonicalize().unwrap();
    let parse = |text: &str| -> Vec<serde_json::Value> {
        text.split("\n---\n")
            .filter(|d| !d.trim().is_empty())
            .map(|d| serde_norway::from_str(d).unwrap_or_else(|e| panic!("not YAML ({e}):\n{d}")))
            .collect()
    };
    let yaml = |path: &Path| -> serde_json::Value {
        serde_norway::from_str(&std::fs::read_to_string(path.join("kustomization.yaml")).unwrap()).unwrap()
    };
    let mut components: Vec<PathBuf> =
        std::fs::read_dir(dir.join("components")).unwrap().map(|e| e.unwrap().path()).collect();
    components.sort();
    if Command::new("kubectl").arg("version").arg("--client").output().is_ok() {
        // kustomize takes relative paths only: a kustomization beside the target dir
        let at = TempDir::new("sluice-kustomize");
        let up = |p: &Path| relative(at.path(), p);
        let listed: Vec<String> = components.iter().map(|c| format!("  - {}\n", up(c))).collect();
        let text = format!("resources:\n  - {}\ncomponents:\n{}", up(&dir), listed.concat());
        std::fs::write(at.path().join("kustomization.yaml"), text).unwrap();
        let out = Command::new("kubectl").arg("kustomize").arg(at.path()).output().unwrap();
        assert!(out.status.success(), "kubectl kustomize: {}", String::from_utf8_lossy(&out.stderr));
        return parse(&String::from_utf8_lossy(&out.stdout));
    }
    let resources = |d: &Path| -> Vec<serde_json::Value> {
        let listed = yaml(d)["resources"].as_array().cloned().unwrap_or_default();
        listed.iter().flat_map(|f| parse(&std::fs::read_to_string(d.join(f.as_str().unwrap())).unwrap())).collect()
    };
    std::iter::once(&dir).chain(&components).flat_map(|d| resources(d)).collect()
}

/// `to` as a path relative to the directory `from` (both absolute).
fn relative(from: &Path, to: &Path) -> String {
    let (from, to) = (from.canonicalize().unwrap(), to.canonicalize().unwrap());
    let common = from.components().zip(to.components()).take_while(|(a, b)| a == b).count();
    let ups = from.components().count() - common;
    let rest: Vec<String> =
        to.components().skip(common).map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    let mut parts = vec![".."; ups].into_iter().map(String::from).collect::<Vec<_>>();
    parts.extend(rest);
    parts.join("/")
}

/// `sluice serve --ratelimit-env` with their environment: listeners on loopback (ports
/// the system chooses), no StatsD, the domain file `rule` under `RUNTIME_ROOT` in `dir`,
/// and `vars`; returns it and its gRPC address.
pub fn their_way(dir: &TempDir, rule: &str, vars: &[(&str, &str)]) -> (Process, String) {
    let files = dir.path().join("runtime/ratelimit/config");
    std::fs::create_dir_all(&files).unwrap();
    std::fs::write(files.join("api.yaml"), rule).unwrap();
    let runtime = dir.path().join("runtime").display().to_string();
    let mut cmd = std::process::Command::new(bin());
    cmd.args(["serve", "--ratelimit-env"]);
    let listeners = [("HOST", "127.0.0.1"), ("PORT", "0"), ("GRPC_HOST", "127.0.0.1"), ("GRPC_PORT", "0")];
    let runtime = [("USE_STATSD", "false"), ("RUNTIME_ROOT", runtime.as_str()), ("RUNTIME_SUBDIRECTORY", "ratelimit")];
    cmd.envs(listeners.iter().chain(&runtime).chain(vars).copied());
    let (process, _http, grpc) = spawn_command(cmd, dir.path());
    (process, grpc)
}

/// Waits until the clock's minute has more than 5 s left: under envoyproxy/ratelimit's
/// environment a minute's window ends on the minute, and a few requests that must share
/// one window must not straddle its end.
pub async fn clear_of_the_minutes_end() {
    while std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() % 60 >= 55 {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The overall codes of `n` calls of the rate limit service at `grpc`, each for `entries`
/// of `domain`, with the log of the server in `dir` to print beside them (sent clear of a
/// minute's end).
pub async fn overall_codes(
    grpc: &str,
    domain: &str,
    entries: &[(&str, &str)],
    n: usize,
    dir: &Path,
) -> (Vec<i32>, String) {
    let mut rls = rls(grpc).await;
    let mut codes = Vec::new();
    clear_of_the_minutes_end().await;
    for _ in 0..n {
        codes.push(rls.should_rate_limit(rls_request(domain, entries)).await.unwrap().into_inner().overall_code);
    }
    (codes, std::fs::read_to_string(dir.join("sluice.log")).unwrap_or_default())
}

/// `[OK, OK, OVER_LIMIT]`: three calls against a limit of two.
pub const TWO_THEN_OVER: [i32; 3] = {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    [Code::Ok as i32, Code::Ok as i32, Code::OverLimit as i32]
};

/// A client of Envoy's rate limit service at `grpc` (`host:port`).
pub async fn rls(
    grpc: &str,
) -> envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<
    tonic::transport::Channel,
> {
    envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::connect(format!(
        "http://{grpc}"
    ))
    .await
    .unwrap_or_else(|e| panic!("no gRPC at {grpc}: {e}"))
}

/// Runs headless Chromium on `url` with `args` (its JavaScript given 4 s of virtual time);
/// what it printed.
pub fn chromium(args: &[&str], url: &str) -> String {
    let program = sluice_testkit::require("chromium", "chromium");
    let profile = TempDir::new("sluice-chromium");
    let out = Command::new(program)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=4000"])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .arg(url)
        .output()
        .unwrap();
    assert!(out.status.success(), "chromium failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}
