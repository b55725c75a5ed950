//! `sluice bench`: a load generator. Against a running server over HTTP (keep-alive
//! connections, one per worker) or gRPC (`--grpc`: Envoy's ShouldRateLimit, one HTTP/2
//! channel), or in process against the store a config names. Prints
//! decisions per second and latency percentiles; `--json` for machines.
//!
//! The HTTP client is a few lines over a TCP stream on purpose: the tool should measure
//! the server, not an HTTP library.

use crate::config::load::{DEFAULT_CONFIG, Loaded, load_file, load_str};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use serde::Serialize;
use sluice::{Descriptor, Entry, Outcome, Request};
use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

mod probes;

use probes::{Probes, host_port};

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The server to load (`host:port` or `http://host:port`).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub target: String,
    /// What to ask the server for.
    #[arg(long, value_enum, default_value = "ratelimit")]
    pub endpoint: Endpoint,
    /// Call the engine in this process instead, on the store of `--config`.
    #[arg(long)]
    pub in_process: bool,
    /// Call Envoy's rate limit service (gRPC ShouldRateLimit) at `--target` instead of
    /// the HTTP API.
    #[arg(long, conflicts_with = "in_process")]
    pub grpc: bool,
    /// Config for `--in-process` (default: the built-in one).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Requests in flight at once (one connection each over HTTP).
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// How long to run, like 10s.
    #[arg(long, default_value = "10s", value_parser = sluice::config::Duration::parse)]
    pub duration: sluice::config::Duration,
    /// Decisions a second over all workers (paced: each worker sends on a schedule of
    /// its own), instead of as fast as answers come. A request sent late because the
    /// previous answer was slow is timed from when it was due, so a server that falls
    /// behind shows it (no coordinated omission). For latency at a given load, e.g.
    /// half the peak.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Distinct clients to spread the requests over.
    #[arg(long, default_value_t = 1000)]
    pub clients: u64,
    /// The number of the first client (`client-N`): runs one after another then name
    /// clients apart (a flood of clients never seen, in slices).
    #[arg(long, default_value_t = 0)]
    pub first_client: u64,
    /// Stop after this many decisions in all (or at `--duration`, whichever comes first).
    #[arg(long)]
    pub requests: Option<u64>,
    /// Domain of the requests.
    #[arg(long, default_value = "demo")]
    pub domain: String,
    /// Descriptor key of the requests; values are `client-N`.
    #[arg(long, default_value = "user")]
    pub key: String,
    /// A data-plane token (`server.api_tokens`) to send: `Authorization: Bearer` over
    /// HTTP, metadata `authorization` over gRPC. Default: the SLUICE_API_TOKEN variable.
    #[arg(long)]
    pub token: Option<String>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Where the server's `/metrics` is (`host:port`), to read its
    /// `process_cpu_seconds_total` before and after and report CPU per decision.
    /// Default: the target, over HTTP; give the HTTP address with `--grpc`.
    #[arg(long)]
    pub metrics: Option<String>,
    /// A Redis (`host:port`) whose CPU time (`INFO cpu`) to read before and after, to
    /// report Redis CPU per decision.
    #[arg(long)]
    pub redis_cpu: Option<String>,
    /// With `--in-process`: first store this many overrides in the requests' domain and
    /// key, for clients other than those the requests name (so decisions stay the same
    /// and each pays the lookup), to measure what a large override set costs a decision.
    #[arg(long, default_value_t = 0, requires = "in_process")]
    pub overrides: u64,
    /// Print the Lua apply script Sluice runs on Redis, and nothing else (for
    /// `redis-cli SCRIPT LOAD`: the ceiling in `scripts/bench`).
    #[arg(long)]
    pub print_apply_script: bool,
}

/// Stores `args.overrides` overrides in the limiter's store, then reads them once. One in
/// ten is a prefix (`other-N*`: several prefix lengths, as a real set holds), none names
/// a client the load sends.
async fn load_overrides(limiter: &sluice::Limiter, args: &Args) -> Result<(), BenchError> {
    let mut all = Vec::new();
    for i in 0..args.overrides {
        let value = match i % 10 {
            0 => format!("other-{i}*"),
            _ => format!("client-{}", args.clients + i),
        };
        let o = serde_json::json!({
            "id": format!("bench-{i}"),
            "domain": args.domain,
            "entries": [{"key": args.key, "value": value}],
            "limit": 1_000_000,
            "reason": "bench",
        });
        all.push(serde_json::from_value(o).map_err(|e| BenchError::Overrides(e.to_string()))?);
    }
    if args.overrides > 0 {
        limiter.overrides().put_all(&all, u64::MAX).await.map_err(|e| BenchError::Overrides(e.to_string()))?;
    }
    Ok(())
}

/// What one run measured.
#[derive(Debug, Serialize)]
pub struct Report {
    pub target: String,
    pub concurrency: usize,
    pub clients: u64,
    pub seconds: f64,
    pub requests: u64,
    pub errors: u64,
    /// Why the first call that failed did (a wrong port, a refused token ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
    pub per_second: f64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
    /// Responses by HTTP status (in process: 200, 429, 503 as the HTTP API would answer).
    pub statuses: BTreeMap<u16, u64>,
    /// The server's CPU time (user + system) over the run, per decision answered, in
    /// microseconds: from its `/metrics`, when it could be read.
    pub server_cpu_us: Option<f64>,
    /// Redis's CPU time over the run per decision, in microseconds (`--redis-cpu`).
    pub redis_cpu_us: Option<f64>,
}

/// One worker's tally.
#[derive(Default)]
struct Tally {
    latencies_us: Vec<u32>,
    statuses: BTreeMap<u16, u64>,
    errors: u64,
    /// Why the first error happened.
    first_error: Option<String>,
}

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Config(#[from] crate::config::load::ConfigError),
    #[error(transparent)]
    Build(#[from] crate::app::build::BuildError),
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("a bench worker failed: {0}")]
    Worker(#[from] tokio::task::JoinError),
    #[error("cannot write the report: {0}")]
    Report(#[from] serde_json::Error),
    #[error("cannot store the overrides: {0}")]
    Overrides(String),
}

/// Runs the benchmark and prints its report.
pub async fn bench(mut args: Args) -> Result<(), BenchError> {
    args.token = args.token.or_else(|| std::env::var("SLUICE_API_TOKEN").ok());
    if args.print_apply_script {
        print!("{}", sluice::store::redis::apply_script());
        return Ok(());
    }
    let deadline = Instant::now() + args.duration.to_std();
    let done = Arc::new(AtomicU64::new(0));
    let progress = (!args.json).then(|| spawn_progress(done.clone(), args.duration.0));
    let probes = Probes::of(&args);
    let cpu_before = probes.read().await;
    let started = Instant::now();
    let target;
    let tallies: Vec<Tally> = if args.in_process {
        let Loaded { config, rules, .. } = match &args.config {
            Some(p) => load_file(p)?,
            None => load_str(DEFAULT_CONFIG, "<built-in config>")?,
        };
        let limiter = Arc::new(crate::app::build::build(&config, rules)?.engine.limiter);
        load_overrides(&limiter, &args).await?;
        target = format!("in-process {} store, {} overrides", limiter.store().kind(), limiter.overrides().len());
        drive(&args, deadline, &done, |_| InProcess { limiter: limiter.clone(), args: args.clone() }).await?
    } else if args.grpc {
        let addr = host_port(&args.target);
        target = format!("grpc://{addr} ShouldRateLimit");
        let connect = |source| BenchError::Connect { addr: addr.clone(), source };
        let channel =
            tonic::transport::Endpoint::from_shared(format!("http://{addr}")).map_err(connect)?.connect().await;
        let channel = channel.map_err(connect)?;
        drive(&args, deadline, &done, |_| Grpc {
            client: RateLimitServiceClient::new(channel.clone()),
            args: args.clone(),
        })
        .await?
    } else {
        let addr = host_port(&args.target);
        target = format!("http://{addr}{}", args.endpoint.path());
        drive(&args, deadline, &done, |_| Http { addr: addr.clone(), conn: None, args: args.clone() }).await?
    };
    let seconds = started.elapsed().as_secs_f64();
    if let Some(p) = progress {
        p.abort();
        eprintln!();
    }
    let mut report = summarize(tallies, target, &args, seconds);
    let per_decision = |a: Option<f64>, b: Option<f64>| Some((b? - a?) * 1e6 / report.requests.max(1) as f64);
    let cpu_after = probes.read().await;
    report.server_cpu_us = per_decision(cpu_before.0, cpu_after.0);
    report.redis_cpu_us = per_decision(cpu_before.1, cpu_after.1);
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

/// One way of making a decision call: in process, over HTTP, over gRPC.
trait Caller: Send + 'static {
    /// Makes call number `i`; answers the HTTP status it stands for, or an error.
    fn call(&mut self, i: u64) -> impl std::future::Future<Output = Result<u16, String>> + Send;
}

struct InProcess {
    limiter: Arc<sluice::Limiter>,
    args: Args,
}

impl Caller for InProcess {
    async fn call(&mut self, i: u64) -> Result<u16, String> {
        let v = self.limiter.check(&request(&self.args, i)).await.map_err(|e| e.to_string())?;
        // the status the HTTP API would answer
        Ok(match v.outcome {
            Outcome::Allowed => 200,
            Outcome::OverLimit => 429,
            Outcome::Unavailable => 503,
        })
    }
}

struct Grpc {
    client: RateLimitServiceClient<tonic::transport::Channel>,
    args: Args,
}

impl Caller for Grpc {
    async fn call(&mut self, i: u64) -> Result<u16, String> {
        let mut request = tonic::Request::new(rls_request(&self.args, i));
        if let Some(token) = &self.args.token {
            let value =
                format!("Bearer {token}").parse().map_err(|_| "--token holds a character metadata cannot carry")?;
            request.metadata_mut().insert("authorization", value);
        }
        let r = self.client.should_rate_limit(request).await.map_err(|s| format!("{:?}: {}", s.code(), s.message()))?;
        Ok(if r.into_inner().overall_code == 1 { 200 } else { 429 })
    }
}

struct Http {
    addr: String,
    conn: Option<BufReader<TcpStream>>,
    args: Args,
}

impl Caller for Http {
    async fn call(&mut self, i: u64) -> Result<u16, String> {
        let payload = http_request(&self.args, &self.addr, i);
        exchange(&mut self.conn, &self.addr, &payload).await.map_err(|e| {
            // a broken connection is opened again by the next call
            self.conn = None;
            format!("{}: {e}", self.addr)
        })
    }
}

/// Runs `--concurrency` workers, each with its own caller (made by `caller(worker)`),
/// until `deadline`; client `i` is call `i`, spread round robin over the workers.
async fn drive<C: Caller>(
    args: &Args,
    deadline: Instant,
    done: &Arc<AtomicU64>,
    caller: impl Fn(usize) -> C,
) -> Result<Vec<Tally>, BenchError> {
    let workers: Vec<_> = (0..args.concurrency)
        .map(|w| {
            let (mut c, done, step) = (caller(w), done.clone(), args.concurrency as u64);
            let last = args.requests.unwrap_or(u64::MAX);
            // worker w's calls are due every `concurrency / rate`, offset by w / rate
            let pace = args.rate.map(|r| Duration::from_secs_f64(step as f64 / r));
            let mut due = Instant::now() + pace.map_or(Duration::ZERO, |p| p.mul_f64(w as f64 / step as f64));
            tokio::spawn(async move {
                let mut tally = Tally::default();
                let mut i = w as u64;
                while Instant::now() < deadline && i < last {
                    let t = match pace {
                        Some(p) => {
                            let at = due;
                            due += p;
                            if Instant::now() < at {
                                // on time: timed from when it is sent (tokio's timer
                                // wakes up to a millisecond late)
                                tokio::time::sleep_until(at.into()).await;
                                Instant::now()
                            } else {
                                // behind: the wait for the server counts from when it was due
                                at
                            }
                        }
                        None => Instant::now(),
                    };
                    if t >= deadline {
                        break;
                    }
                    match c.call(i).await {
                        Ok(status) => *tally.statuses.entry(status).or_default() += 1,
                        Err(why) => {
                            tally.errors += 1;
                            tally.first_error.get_or_insert(why);
                        }
                    }
                    tally.latencies_us.push(t.elapsed().as_micros().min(u32::MAX as u128) as u32);
                    done.fetch_add(1, Ordering::Relaxed);
                    i += step;
                }
                tally
            })
        })
        .collect();
    let mut out = Vec::new();
    for w in workers {
        out.push(w.await?);
    }
    Ok(out)
}

/// The client of iteration `i`.
fn client(args: &Args, i: u64) -> u64 {
    args.first_client + i % args.clients
}

/// The request for iteration `i`: its [`client`].
fn request(args: &Args, i: u64) -> Request {
    Request {
        domain: args.domain.clone(),
        descriptors: vec![Descriptor {
            entries: vec![Entry { key: args.key.clone(), value: format!("client-{}", client(args, i)) }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// The gRPC request for iteration `i`.
fn rls_request(args: &Args, i: u64) -> RateLimitRequest {
    RateLimitRequest {
        domain: args.domain.clone(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![rate_limit_descriptor::Entry {
                key: args.key.clone(),
                value: format!("client-{}", client(args, i)),
            }],
            ..Default::default()
        }],
        hits_addend: 0,
    }
}

fn http_request(args: &Args, addr: &str, i: u64) -> Vec<u8> {
    let auth = args.token.as_ref().map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    match args.endpoint {
        Endpoint::Readyz | Endpoint::Root => {
            format!("GET {} HTTP/1.1\r\nHost: {addr}\r\n{auth}\r\n", args.endpoint.path()).into_bytes()
        }
        Endpoint::Ratelimit => {
            let body = format!(
                r#"{{"domain":"{}","descriptors":[{{"entries":[{{"key":"{}","value":"client-{}"}}]}}]}}"#,
                args.domain,
                args.key,
                client(args, i)
            );
            format!(
                "POST /v1/ratelimit HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .into_bytes()
        }
    }
}

/// Sends one request on a kept-alive connection (opening it if needed) and reads the
/// response; returns its status.
async fn exchange(conn: &mut Option<BufReader<TcpStream>>, addr: &str, payload: &[u8]) -> std::io::Result<u16> {
    if conn.is_none() {
        let s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        *conn = Some(BufReader::new(s));
    }
    let Some(c) = conn.as_mut() else { unreachable!("connected above") };
    c.get_mut().write_all(payload).await?;
    let mut line = String::new();
    if c.read_line(&mut line).await? == 0 {
        return Err(std::io::Error::other("the server closed the connection"));
    }
    let status =
        line.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| std::io::Error::other("bad status line"))?;
    let mut length = 0usize;
    loop {
        line.clear();
        if c.read_line(&mut line).await? == 0 {
            return Err(std::io::Error::other("connection closed"));
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            length = v.trim().parse().map_err(|_| std::io::Error::other("bad content-length"))?;
        }
    }
    let mut body = vec![0u8; length];
    c.read_exact(&mut body).await?;
    Ok(status)
}

fn spawn_progress(done: Arc<AtomicU64>, total_ms: u64) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let start = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tick.tick().await;
            let elapsed = start.elapsed().as_millis() as u64;
            let frac = (elapsed as f64 / total_ms as f64).min(1.0);
            let bar = (frac * 30.0) as usize;
            let n = done.load(Ordering::Relaxed);
            let rate = n as f64 / start.elapsed().as_secs_f64().max(0.001);
            eprint!(
                "\r[{}{}] {:>5.1}s {:>10} decisions {:>10.0}/s",
                "#".repeat(bar),
                " ".repeat(30 - bar),
                elapsed as f64 / 1000.0,
                n,
                rate
            );
            let _ = std::io::stderr().flush();
        }
    })
}

fn summarize(tallies: Vec<Tally>, target: String, args: &Args, seconds: f64) -> Report {
    let mut lat = Vec::new();
    let mut statuses = BTreeMap::new();
    let (mut errors, mut first_error) = (0, None);
    for t in tallies {
        lat.extend(t.latencies_us);
        errors += t.errors;
        first_error = first_error.or(t.first_error);
        for (k, v) in t.statuses {
            *statuses.entry(k).or_default() += v;
        }
    }
    lat.sort_unstable();
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1))).copied().unwrap_or(0) as u64
    };
    Report {
        target,
        concurrency: args.concurrency,
        clients: args.clients,
        seconds,
        requests: lat.len() as u64,
        errors,
        first_error,
        per_second: lat.len() as f64 / seconds,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        p999_us: pct(0.999),
        max_us: lat.last().copied().unwrap_or(0) as u64,
        statuses,
        server_cpu_us: None,
        redis_cpu_us: None,
    }
}

fn print_report(r: &Report) {
    println!("target       {}", r.target);
    println!("load         {} workers, {} clients, {:.1} s", r.concurrency, r.clients, r.seconds);
    println!("decisions    {} ({} errors)   {:.0}/s", r.requests, r.errors, r.per_second);
    println!("latency      p50 {} us   p99 {} us   p99.9 {} us   max {} us", r.p50_us, r.p99_us, r.p999_us, r.max_us);
    let statuses: Vec<String> = r.statuses.iter().map(|(k, v)| format!("{k}: {v}")).collect();
    println!("statuses     {}", statuses.join(", "));
    if let Some(why) = &r.first_error {
        println!("errors       the first: {why}");
    }
    if r.statuses.contains_key(&401) {
        println!("             401: the server wants a data-plane token; pass --token (or SLUICE_API_TOKEN)");
    }
    if r.statuses.contains_key(&400) {
        println!("             400: the server refused the requests; is --domain (and --key) one of its config's?");
    }
    let cpu = |what: &str, us: Option<f64>| us.map(|us| format!("{what} {us:.1} us")).unwrap_or_default();
    if r.server_cpu_us.is_some() || r.redis_cpu_us.is_some() {
        println!("CPU/decision {}   {}", cpu("server", r.server_cpu_us), cpu("redis", r.redis_cpu_us));
    }
}

/// What `sluice bench` asks a server for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Endpoint {
    /// `POST /v1/ratelimit`, one descriptor.
    Ratelimit,
    /// `GET /readyz` (on the memory store): the HTTP stack alone, on the runtime that
    /// serves decisions; the ceiling. (`/healthz` is answered at the front door, one
    /// request per connection, as probes come.)
    Readyz,
    /// `GET /`: a proxy in front of an upstream, such as Envoy with its rate limit
    /// filter (`scripts/bench-envoy`); give `--metrics` the address of Sluice's HTTP
    /// listener to read Sluice's CPU per request.
    Root,
}

impl Endpoint {
    fn path(self) -> &'static str {
        match self {
            Endpoint::Ratelimit => "/v1/ratelimit",
            Endpoint::Readyz => "/readyz",
            Endpoint::Root => "/",
        }
    }
}
