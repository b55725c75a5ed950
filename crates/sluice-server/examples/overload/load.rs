//! The open-loop load generator: requests are sent when they are due, whatever the
//! answers (a closed loop would slow down with the service and hide its overload),
//! over a few HTTP/2 connections, each with a timeout. One CSV line a request:
//! `sent_us,class,status,latency_us` (status 0: no answer within the timeout; 1: the
//! connection failed).

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::io::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What to offer.
pub struct Plan {
    pub target: String,
    /// The service's capacity, requests a second.
    pub capacity: f64,
    /// Load (a multiple of capacity) and how long, seconds.
    pub schedule: Vec<(f64, f64)>,
    pub timeout: Duration,
}

/// Stripe's four classes in every ten requests: test mode 2, GETs 5, POSTs 2,
/// critical 1.
const CLASSES: [usize; 10] = [1, 0, 1, 2, 1, 3, 1, 0, 2, 1];
const CONNECTIONS: usize = 16;

struct Record {
    sent_us: u64,
    class: usize,
    status: u16,
    latency_us: u64,
}

async fn connect(target: &str) -> SendRequest<Empty<Bytes>> {
    let stream =
        tokio::net::TcpStream::connect(target).await.unwrap_or_else(|e| super::fail(&format!("{target}: {e}")));
    let _ = stream.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(1 << 20)
        .handshake(TokioIo::new(stream))
        .await
        .unwrap_or_else(|e| super::fail(&format!("HTTP/2 to {target}: {e}")));
    tokio::spawn(conn);
    sender
}

fn request(class: usize, authority: &str) -> http::Request<Empty<Bytes>> {
    let b = http::Request::builder().uri(format!("http://{authority}/"));
    let b = match class {
        0 => b.method("GET").header("x-test-mode", "1"),
        1 => b.method("GET"),
        2 => b.method("POST"),
        _ => b.method("POST").header("x-sluice-priority", "critical"),
    };
    b.body(Empty::new()).unwrap()
}

/// One request: its answer's status and when it ended, within the timeout.
async fn one(mut sender: SendRequest<Empty<Bytes>>, req: http::Request<Empty<Bytes>>, timeout: Duration) -> u16 {
    let exchange = async move {
        let Ok(response) = sender.send_request(req).await else { return 1 };
        let status = response.status().as_u16();
        match response.into_body().collect().await {
            Ok(_) => status,
            Err(_) => 1,
        }
    };
    tokio::time::timeout(timeout, exchange).await.unwrap_or(0)
}

/// Offers the plan and writes every request's record to `out`.
pub async fn run(plan: &Plan, out: &str) {
    let mut senders = Vec::new();
    for _ in 0..CONNECTIONS {
        senders.push(connect(&plan.target).await);
    }
    let records = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let (mut tasks, mut due, mut last, mut n) = (Vec::new(), 0.0, 0.0, 0usize);
    let mut end = 0.0;
    for &(load, seconds) in &plan.schedule {
        end += seconds;
        while start.elapsed().as_secs_f64() < end {
            tokio::time::sleep(Duration::from_millis(1)).await;
            let now = start.elapsed().as_secs_f64().min(end);
            due += load * plan.capacity * (now - last);
            last = now;
            while due >= 1.0 {
                due -= 1.0;
                n += 1;
                let class = CLASSES[n % CLASSES.len()];
                let (sender, records, timeout) = (senders[n % CONNECTIONS].clone(), records.clone(), plan.timeout);
                let req = request(class, &plan.target);
                tasks.push(tokio::spawn(async move {
                    let sent = start.elapsed();
                    let status = one(sender, req, timeout).await;
                    let latency_us = (start.elapsed() - sent).as_micros() as u64;
                    let r = Record { sent_us: sent.as_micros() as u64, class, status, latency_us };
                    records.lock().unwrap().push(r);
                }));
            }
        }
    }
    for t in tasks {
        let _ = t.await;
    }
    let records = records.lock().unwrap();
    let mut file = std::io::BufWriter::new(std::fs::File::create(out).unwrap());
    writeln!(file, "sent_us,class,status,latency_us").unwrap();
    for r in records.iter() {
        writeln!(file, "{},{},{},{}", r.sent_us, r.class, r.status, r.latency_us).unwrap();
    }
}
