//! What `sluice bench` reads around a run: the server's CPU time (its `/metrics`) and
//! Redis's (`INFO cpu`), each over a plain TCP exchange, so a report can say what a
//! decision cost each.

use super::Args;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// `host:port` from an address given as `host:port` or `http://host:port/`.
pub(super) fn host_port(addr: &str) -> String {
    addr.trim_start_matches("http://").trim_end_matches('/').to_string()
}

/// Where the CPU time of the server and of Redis is read.
pub(super) struct Probes {
    metrics: Option<String>,
    redis: Option<String>,
}

impl Probes {
    pub(super) fn of(args: &Args) -> Self {
        let http = (!args.grpc && !args.in_process).then_some(&args.target);
        Self { metrics: args.metrics.as_ref().or(http).map(|a| host_port(a)), redis: args.redis_cpu.clone() }
    }

    /// CPU seconds used so far by the server and by Redis, where they could be read.
    pub(super) async fn read(&self) -> (Option<f64>, Option<f64>) {
        let server = match &self.metrics {
            Some(a) => ask(a, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await,
            None => None,
        };
        let redis = match &self.redis {
            Some(a) => ask(a, "INFO cpu\r\nQUIT\r\n").await,
            None => None,
        };
        (server.and_then(|m| sum_of(&m, &["process_cpu_seconds_total"])), redis.and_then(|i| redis_cpu(&i)))
    }
}

/// Sends `what` to `addr` and reads until the peer closes (at most 2 s).
async fn ask(addr: &str, what: &str) -> Option<String> {
    let talk = async {
        let mut s = TcpStream::connect(addr).await.ok()?;
        s.write_all(what.as_bytes()).await.ok()?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.ok()?;
        Some(String::from_utf8_lossy(&out).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(2), talk).await.ok().flatten()
}

/// The sum of the values of lines `name value` (Prometheus text, `INFO`'s `name:value`).
fn sum_of(text: &str, names: &[&str]) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter_map(|l| {
            let (name, value) = l.split_once([' ', ':'])?;
            names.contains(&name).then(|| value.trim().parse().ok())?
        })
        .collect();
    (values.len() == names.len()).then(|| values.iter().sum())
}

/// Redis's own CPU time from `INFO cpu`.
fn redis_cpu(info: &str) -> Option<f64> {
    sum_of(info, &["used_cpu_sys", "used_cpu_user"])
}
