//! An OTLP/gRPC trace receiver that counts what it is sent: for trying `telemetry.otlp`
//! without a collector, and for `scripts/bench-tracing`.
//!
//! `cargo run --release --example otlp_sink` listens on a free loopback port, prints
//! `listening on http://127.0.0.1:PORT`, and, every second that brought spans, the
//! totals so far (export requests, spans, and the spans' names by count).

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct Totals {
    requests: u64,
    spans: u64,
    names: BTreeMap<String, u64>,
}

#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Totals>>);

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut t = self.0.lock().unwrap();
        t.requests += 1;
        let spans = request.get_ref().resource_spans.iter().flat_map(|r| &r.scope_spans).flat_map(|s| &s.spans);
        for span in spans {
            t.spans += 1;
            *t.names.entry(span.name.clone()).or_default() += 1;
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
    println!("listening on http://{}", listener.local_addr().unwrap());
    let sink = Sink::default();
    let report = sink.clone();
    tokio::spawn(async move {
        let mut seen = 0;
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            let t = report.0.lock().unwrap();
            if t.spans != seen {
                seen = t.spans;
                println!("{} export requests, {} spans: {:?}", t.requests, t.spans, t.names);
            }
        }
    });
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let server = tonic::transport::Server::builder().add_service(TraceServiceServer::new(sink));
    server.serve_with_incoming(incoming).await.expect("serve");
}
