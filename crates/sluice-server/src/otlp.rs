//! OTLP: the messages of OpenTelemetry's trace export (`opentelemetry/proto/collector/
//! trace/v1/trace_service.proto` and the trace, common and resource protos it uses),
//! declared here with only the fields Sluice writes, and the exporter that sends
//! batches of spans to a collector, over gRPC or HTTP.
//!
//! Declared by hand rather than taken from a crate: the maintained one
//! (`opentelemetry-proto`) brings the OpenTelemetry SDK with its trace definitions, a
//! second tracing stack in the binary for some thirty lines of messages. The tests
//! decode what this module sends with that crate's definitions, so a field numbered
//! wrongly here fails them.

use std::time::Duration;

/// `ExportTraceServiceRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ExportTraceServiceRequest {
    #[prost(message, repeated, tag = "1")]
    pub resource_spans: Vec<ResourceSpans>,
}

/// `ExportTraceServiceResponse`: a collector that took only part of a batch says how
/// many spans it rejected, and why.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ExportTraceServiceResponse {
    #[prost(message, optional, tag = "1")]
    pub partial_success: Option<ExportTracePartialSuccess>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ExportTracePartialSuccess {
    #[prost(int64, tag = "1")]
    pub rejected_spans: i64,
    #[prost(string, tag = "2")]
    pub error_message: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ResourceSpans {
    #[prost(message, optional, tag = "1")]
    pub resource: Option<Resource>,
    #[prost(message, repeated, tag = "2")]
    pub scope_spans: Vec<ScopeSpans>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Resource {
    #[prost(message, repeated, tag = "1")]
    pub attributes: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ScopeSpans {
    #[prost(message, optional, tag = "1")]
    pub scope: Option<InstrumentationScope>,
    #[prost(message, repeated, tag = "2")]
    pub spans: Vec<Span>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct InstrumentationScope {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub version: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Span {
    /// 16 bytes.
    #[prost(bytes = "vec", tag = "1")]
    pub trace_id: Vec<u8>,
    /// 8 bytes.
    #[prost(bytes = "vec", tag = "2")]
    pub span_id: Vec<u8>,
    /// The W3C `tracestate` the span was started with.
    #[prost(string, tag = "3")]
    pub trace_state: String,
    /// 8 bytes, or empty for a root span.
    #[prost(bytes = "vec", tag = "4")]
    pub parent_span_id: Vec<u8>,
    #[prost(string, tag = "5")]
    pub name: String,
    /// `SpanKind`: 1 internal, 2 server, 3 client.
    #[prost(int32, tag = "6")]
    pub kind: i32,
    #[prost(fixed64, tag = "7")]
    pub start_time_unix_nano: u64,
    #[prost(fixed64, tag = "8")]
    pub end_time_unix_nano: u64,
    #[prost(message, repeated, tag = "9")]
    pub attributes: Vec<KeyValue>,
    #[prost(message, optional, tag = "15")]
    pub status: Option<Status>,
    /// W3C trace flags in the low byte (bit 0: sampled); bits 8 and 9 say whether the
    /// parent is remote.
    #[prost(fixed32, tag = "16")]
    pub flags: u32,
}

/// `SpanKind` values.
pub const KIND_SERVER: i32 = 2;
pub const KIND_CLIENT: i32 = 3;
/// `Span.flags`: sampled, and "whether the parent is remote" known (bit 8) and true
/// (bit 9).
pub const FLAGS_SAMPLED: u32 = 0x01;
pub const FLAGS_PARENT_REMOTE: u32 = 0x300;
pub const FLAGS_PARENT_LOCAL: u32 = 0x100;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Status {
    #[prost(string, tag = "2")]
    pub message: String,
    /// `StatusCode`: 0 unset, 1 ok, 2 error.
    #[prost(int32, tag = "3")]
    pub code: i32,
}

pub const STATUS_ERROR: i32 = 2;

#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(message, optional, tag = "2")]
    pub value: Option<AnyValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AnyValue {
    #[prost(oneof = "Value", tags = "1, 2, 3, 4, 5")]
    pub value: Option<Value>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Value {
    #[prost(string, tag = "1")]
    String(String),
    #[prost(bool, tag = "2")]
    Bool(bool),
    #[prost(int64, tag = "3")]
    Int(i64),
    #[prost(double, tag = "4")]
    Double(f64),
    #[prost(message, tag = "5")]
    Array(ArrayValue),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ArrayValue {
    #[prost(message, repeated, tag = "1")]
    pub values: Vec<AnyValue>,
}

impl KeyValue {
    pub fn new(key: &str, value: Value) -> Self {
        Self { key: key.to_string(), value: Some(AnyValue { value: Some(value) }) }
    }

    pub fn str(key: &str, value: impl Into<String>) -> Self {
        Self::new(key, Value::String(value.into()))
    }

    pub fn int(key: &str, value: i64) -> Self {
        Self::new(key, Value::Int(value))
    }

    pub fn bool(key: &str, value: bool) -> Self {
        Self::new(key, Value::Bool(value))
    }

    pub fn strings(key: &str, values: impl IntoIterator<Item = String>) -> Self {
        let values = values.into_iter().map(|s| AnyValue { value: Some(Value::String(s)) }).collect();
        Self::new(key, Value::Array(ArrayValue { values }))
    }
}

/// The gRPC method a collector answers.
const EXPORT: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// How spans reach a collector: OTLP/gRPC (port 4317) or OTLP/HTTP with protobuf bodies
/// (port 4318, `POST /v1/traces`: envoyproxy/ratelimit's default, which Envoy Gateway
/// sets).
#[derive(Clone)]
pub enum Client {
    Grpc { grpc: tonic::client::Grpc<tonic::transport::Channel>, timeout: Duration },
    Http { uri: axum::http::Uri, timeout: Duration },
}

impl Client {
    /// A client of the collector at `endpoint` (`http://host:port`, checked when the
    /// config was read), over gRPC, or over HTTP when `http`.
    pub fn new(endpoint: &str, http: bool, timeout: Duration) -> Result<Self, String> {
        if http {
            let uri = format!("{}/v1/traces", endpoint.trim_end_matches('/'));
            let uri = uri.parse().map_err(|e| format!("telemetry.otlp.endpoint {endpoint}: {e}"))?;
            return Ok(Self::Http { uri, timeout });
        }
        let channel = tonic::transport::Endpoint::from_shared(endpoint.to_string())
            .map_err(|e| format!("telemetry.otlp.endpoint {endpoint}: {e}"))?
            .connect_timeout(timeout)
            .timeout(timeout)
            .connect_lazy();
        Ok(Self::Grpc { grpc: tonic::client::Grpc::new(channel), timeout })
    }

    /// Sends one batch. Returns the spans the collector rejected (a partial success),
    /// or why the call failed.
    pub async fn export(&mut self, request: ExportTraceServiceRequest) -> Result<i64, String> {
        let timeout = match self {
            Self::Grpc { timeout, .. } | Self::Http { timeout, .. } => *timeout,
        };
        let answer = match self {
            Self::Grpc { grpc, .. } => tokio::time::timeout(timeout, export_grpc(grpc, request)).await,
            Self::Http { uri, .. } => tokio::time::timeout(timeout, export_http(uri, request)).await,
        };
        let answer = answer.map_err(|_| format!("the collector did not answer within {timeout:?}"))??;
        Ok(answer.partial_success.map_or(0, |p| p.rejected_spans))
    }
}

async fn export_grpc(
    grpc: &mut tonic::client::Grpc<tonic::transport::Channel>,
    request: ExportTraceServiceRequest,
) -> Result<ExportTraceServiceResponse, String> {
    grpc.ready().await.map_err(|e| format!("the collector cannot be reached: {e}"))?;
    let codec = tonic_prost::ProstCodec::<ExportTraceServiceRequest, ExportTraceServiceResponse>::default();
    let path = axum::http::uri::PathAndQuery::from_static(EXPORT);
    let answer = grpc.unary(tonic::Request::new(request), path, codec).await;
    answer
        .map(tonic::Response::into_inner)
        .map_err(|s| format!("the collector answered {:?}: {}", s.code(), s.message()))
}

/// One `POST /v1/traces` with a protobuf body, on a connection of its own (a batch is
/// sent every few seconds at most).
async fn export_http(
    uri: &axum::http::Uri,
    request: ExportTraceServiceRequest,
) -> Result<ExportTraceServiceResponse, String> {
    use http_body_util::BodyExt;
    use prost::Message;
    let (host, port) = (uri.host().unwrap_or_default(), uri.port_u16().unwrap_or(80));
    let tcp = tokio::net::TcpStream::connect((host.trim_start_matches('[').trim_end_matches(']'), port))
        .await
        .map_err(|e| format!("the collector cannot be reached: {e}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .map_err(|e| format!("the collector cannot be reached: {e}"))?;
    tokio::spawn(connection);
    let post = axum::http::Request::post(uri.clone())
        .header("host", uri.authority().map_or(host, |a| a.as_str()))
        .header("content-type", "application/x-protobuf")
        .body(http_body_util::Full::new(bytes::Bytes::from(request.encode_to_vec())))
        .map_err(|e| e.to_string())?;
    let response = sender.send_request(post).await.map_err(|e| format!("the collector did not answer: {e}"))?;
    let status = response.status();
    let body = response.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    if !status.is_success() {
        return Err(format!(
            "the collector answered HTTP {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        ));
    }
    Ok(ExportTraceServiceResponse::decode(body).unwrap_or_default())
}
