//! An OTLP/gRPC collector for the tests: it keeps every export request, decoded with
//! OpenTelemetry's own definitions (`opentelemetry-proto`), so a field Sluice encodes
//! wrongly fails the test that reads it.

#![allow(dead_code)]

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// An OTLP/gRPC collector on a free loopback port that keeps every request.
#[derive(Clone, Default)]
pub struct Collector {
    received: Arc<Mutex<Vec<ExportTraceServiceRequest>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.received.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

impl Collector {
    /// Starts one; returns it and its `http://127.0.0.1:PORT`.
    pub async fn start() -> (Self, String) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let collector = Self::default();
        let service = TraceServiceServer::new(collector.clone());
        tokio::spawn(async move {
            let incoming = tonic::transport::server::TcpIncoming::from(listener);
            tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming).await.unwrap();
        });
        (collector, format!("http://{addr}"))
    }

    /// Starts one that speaks OTLP/HTTP instead: `POST /v1/traces` with a protobuf body
    /// (anything else is refused, so a wrong path or content type fails the test); returns
    /// it and its `http://127.0.0.1:PORT`.
    pub async fn start_http() -> (Self, String) {
        use axum::http::{HeaderMap, StatusCode};
        use prost::Message;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let collector = Self::default();
        let kept = collector.clone();
        let export = move |headers: HeaderMap, body: axum::body::Bytes| async move {
            let protobuf = headers.get("content-type").is_some_and(|v| v == "application/x-protobuf");
            match ExportTraceServiceRequest::decode(body) {
                Ok(r) if protobuf => {
                    kept.received.lock().unwrap().push(r);
                    (StatusCode::OK, ExportTraceServiceResponse { partial_success: None }.encode_to_vec())
                }
                _ => (StatusCode::BAD_REQUEST, b"not an OTLP/HTTP protobuf export".to_vec()),
            }
        };
        let app = axum::Router::new().route("/v1/traces", axum::routing::post(export));
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (collector, format!("http://{addr}"))
    }

    /// The attributes of the resource spans of `service` were sent with.
    pub fn resource_of(&self, service: &str) -> Vec<(String, Option<Value>)> {
        let received = self.received.lock().unwrap();
        let resources = received.iter().flat_map(|r| &r.resource_spans).filter_map(|rs| rs.resource.as_ref());
        let attributes = |r: &opentelemetry_proto::tonic::resource::v1::Resource| -> Vec<(String, Option<Value>)> {
            r.attributes.iter().map(|a| (a.key.clone(), a.value.as_ref().and_then(|v| v.value.clone()))).collect()
        };
        let named = |a: &[(String, Option<Value>)]| {
            a.iter().any(|(k, v)| k == "service.name" && v.as_ref().and_then(text).as_deref() == Some(service))
        };
        resources.map(attributes).find(|a| named(a)).unwrap_or_default()
    }

    /// Every span received so far from the service named `service` (the resource's
    /// `service.name`).
    pub fn spans_of(&self, service: &str) -> Vec<Span> {
        let received = self.received.lock().unwrap();
        let resource_spans = received.iter().flat_map(|r| &r.resource_spans).filter(|rs| {
            let name = rs.resource.as_ref().and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"));
            name.and_then(|a| text(a.value.as_ref()?.value.as_ref()?)).as_deref() == Some(service)
        });
        resource_spans.flat_map(|rs| &rs.scope_spans).flat_map(|ss| ss.spans.clone()).collect()
    }

    /// Every span Sluice sent.
    pub fn spans(&self) -> Vec<Span> {
        self.spans_of("sluice")
    }

    /// The spans of trace `id`, once `n` of them have arrived (waiting at most 10 s).
    pub async fn trace(&self, id: &str, n: usize, log: impl Fn() -> String) -> Vec<Span> {
        let started = Instant::now();
        loop {
            let spans: Vec<Span> = self.spans().into_iter().filter(|sp| hex(&sp.trace_id) == id).collect();
            if spans.len() >= n {
                assert_eq!(spans.len(), n, "trace {id}: {spans:#?}");
                return spans;
            }
            assert!(started.elapsed() < Duration::from_secs(10), "trace {id}: {spans:#?}\n{}", log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn text(v: &Value) -> Option<String> {
    match v {
        Value::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}
