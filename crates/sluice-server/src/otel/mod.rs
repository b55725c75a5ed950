//! OpenTelemetry tracing (`telemetry.otlp`): a span per decision, a child span per store
//! call, exported to a collector over OTLP/gRPC; and the trace id in every log line
//! about a request.
//!
//! A request that carries a W3C `traceparent` (an HTTP header, or gRPC metadata from
//! Envoy) continues that trace: the decision's span is a child of the caller's, and it
//! is recorded when the caller's sampled flag says so. A request without one starts a
//! trace, recorded for `sampling_ratio` of them (chosen by trace id, as OpenTelemetry's
//! ratio sampler does, so every service that uses the same rule agrees on a trace).
//!
//! Off by default, and then free: a request pays one header lookup. On, an unsampled
//! request pays the sampling decision; a sampled one pays for its spans on its own task
//! and hands them to the exporter's queue, which sends batches of up to
//! [`BATCH`] spans every [`EXPORT_EVERY`] and drops (and counts) what does not fit:
//! a slow collector never slows a decision.
//!
//! What a span says: the domain, the outcome, the store, its latency and whether the
//! failure policy decided; the names of the policies, never a descriptor's values (a
//! user id, a token) unless `detailed: true`.

use crate::otlp::{self, KeyValue};
use axum::http::{HeaderMap, HeaderName};
use serde::{Deserialize, Deserializer, de};
use sluice::algo::grant::{Granted, Open};
use sluice::algo::{ConcurrencyState, Decision, Lease, Limit, Op};
use sluice::config::Duration as ConfigDuration;
use sluice::store::{
    Commit, GiveBack, GrantAsk, Hold, Refund, RegistryOp, RegistryReply, Reservation, Settled, Store, StoreError,
};
use sluice::tag::Tag;
use sluice::time::{Clock, Millis, SystemClock, Throttle};
use sluice::{CheckError, Limiter, Outcome, Request, Verdict};
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tracing::Instrument;

mod context;
mod store;

use context::*;
pub use context::{Hex, Parent};
pub use store::TracedStore;

/// `telemetry.otlp`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OtlpConfig {
    /// The collector's address: `http://host:4317` (OTLP/gRPC), or `http://host:4318`
    /// with `protocol: http`.
    #[serde(deserialize_with = "endpoint")]
    pub endpoint: String,
    /// The share of traces started here (requests without a `traceparent`) that are
    /// recorded, 0 to 1 (default 1). A request with one follows its sampled flag.
    #[serde(default = "always", deserialize_with = "ratio")]
    pub sampling_ratio: f64,
    /// Put each descriptor's entries (`key=value`) on the decision's span. Off by
    /// default: values are user ids and tokens.
    #[serde(default)]
    pub detailed: bool,
    /// The resource's `service.name` (default `sluice`).
    #[serde(default = "service_name")]
    pub service_name: String,
    /// How long one export may take (default 10 s).
    #[serde(default = "export_timeout")]
    pub timeout: ConfigDuration,
    /// `grpc` (OTLP/gRPC, the default) or `http` (OTLP/HTTP with protobuf bodies, to
    /// `endpoint` + `/v1/traces`).
    #[serde(default)]
    pub protocol: OtlpProtocol,
    /// The resource's `service.namespace`, when set.
    #[serde(default)]
    pub service_namespace: Option<String>,
    /// The resource's `service.instance.id`, when set (a pod's name).
    #[serde(default)]
    pub service_instance_id: Option<String>,
}

/// `telemetry.otlp.protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OtlpProtocol {
    #[default]
    Grpc,
    Http,
}

fn always() -> f64 {
    1.0
}

fn service_name() -> String {
    "sluice".into()
}

fn export_timeout() -> ConfigDuration {
    ConfigDuration(10_000)
}

fn endpoint<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let text = String::deserialize(d)?;
    let uri: axum::http::Uri = text.parse().map_err(|e| de::Error::custom(format!("'{text}' is not a URL: {e}")))?;
    match (uri.scheme_str(), uri.host(), uri.port_u16()) {
        (Some("http"), Some(_), Some(_)) => Ok(text),
        (Some("https"), ..) => Err(de::Error::custom(format!(
            "'{text}': TLS to the collector is not supported; send to a collector agent on this host or pod (http://127.0.0.1:4317) and let it forward over TLS"
        ))),
        _ => Err(de::Error::custom(format!(
            "'{text}' is not a collector address: write http://host:port (OTLP/gRPC, usually port 4317)"
        ))),
    }
}

fn ratio<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    let r = f64::deserialize(d)?;
    match (0.0..=1.0).contains(&r) {
        true => Ok(r),
        false => Err(de::Error::custom(format!("sampling_ratio {r} is not a share: write 0 to 1 (0.01 is 1%)"))),
    }
}

/// A store call made while a sampled request was decided.
struct StoreCall {
    op: &'static str,
    start: u64,
    end: u64,
    error: Option<String>,
}

/// What a sampled request's spans say, gathered while it is decided.
#[derive(Default)]
struct Recording {
    calls: Vec<StoreCall>,
    attributes: Vec<KeyValue>,
    outcome: Option<&'static str>,
    error: Option<String>,
    /// Whether descriptor values go on the span (`detailed`).
    detailed: bool,
}

tokio::task_local! {
    static RECORDING: RefCell<Recording>;
}

/// How a response ended, for the span: the protocol's status and whether it is an
/// error (a 5xx, a gRPC status other than OK).
pub struct Ended {
    pub attribute: KeyValue,
    pub error: bool,
}

impl Ended {
    /// An HTTP response's status: an error when 5xx.
    pub fn http(status: u16) -> Self {
        Self { attribute: KeyValue::int("http.response.status_code", i64::from(status)), error: status >= 500 }
    }

    /// A gRPC status code: an error when not OK (0).
    pub fn grpc(code: i32) -> Self {
        Self { attribute: KeyValue::int("rpc.grpc.status_code", i64::from(code)), error: code != 0 }
    }
}

/// What kind of call a span is for.
#[derive(Clone, Copy)]
pub enum Call {
    /// An HTTP API call: `METHOD /route`.
    Http(&'static str),
    /// A gRPC method: its path, `/package.Service/Method`.
    Grpc(&'static str),
}

/// The tracer: sampling and the exporter's queue.
pub struct Tracer {
    queue: tokio::sync::mpsc::Sender<Message>,
    /// `sampling_ratio` as a share of 2^63.
    bound: u64,
    detailed: bool,
    dropped: metrics::Counter,
}

enum Message {
    Spans(Vec<otlp::Span>),
    Flush(tokio::sync::oneshot::Sender<()>),
}

/// Spans sent together, at most.
pub const BATCH: usize = 512;
/// How often what is queued is sent.
pub const EXPORT_EVERY: Duration = Duration::from_secs(1);
/// Requests' spans waiting to be sent, at most; past it a request's spans are dropped.
const QUEUE: usize = 4_096;
/// How often a failing collector is named in the log.
const EXPORT_WARN_EVERY: Millis = 60_000;

/// Metric names.
pub const SPANS_DROPPED: &str = "sluice_trace_spans_dropped_total";
pub const EXPORTS: &str = "sluice_trace_exports_total";

/// The tracer's metrics' help texts.
pub fn describe_metrics() {
    metrics::describe_counter!(SPANS_DROPPED, "Spans dropped because the export queue was full.");
    metrics::describe_counter!(EXPORTS, "Span batches sent to the collector, by result.");
}

impl Tracer {
    /// Starts the exporter of `config` (a task on the current runtime).
    pub fn start(config: &OtlpConfig) -> Result<Arc<Self>, String> {
        let http = config.protocol == OtlpProtocol::Http;
        let client = otlp::Client::new(&config.endpoint, http, config.timeout.to_std())?;
        let (queue, rx) = tokio::sync::mpsc::channel(QUEUE);
        tokio::spawn(export(rx, client, resource(config)));
        Ok(Arc::new(Self {
            queue,
            bound: (config.sampling_ratio * (1u64 << 63) as f64) as u64,
            detailed: config.detailed,
            dropped: metrics::counter!(SPANS_DROPPED),
        }))
    }

    /// Sends what is queued, waiting at most `within` (at shutdown).
    pub async fn flush(&self, within: Duration) {
        let (done, wait) = tokio::sync::oneshot::channel();
        let flushed = async {
            if self.queue.send(Message::Flush(done)).await.is_ok() {
                let _ = wait.await;
            }
        };
        let _ = tokio::time::timeout(within, flushed).await;
    }

    fn record(&self, spans: Vec<otlp::Span>) {
        let n = spans.len() as u64;
        if self.queue.try_send(Message::Spans(spans)).is_err() {
            self.dropped.increment(n);
        }
    }
}

/// The resource every span is sent with.
fn resource(config: &OtlpConfig) -> otlp::Resource {
    let mut attributes = vec![
        KeyValue::str("service.name", config.service_name.as_str()),
        KeyValue::str("service.version", env!("CARGO_PKG_VERSION")),
        KeyValue::int("process.pid", i64::from(std::process::id())),
    ];
    let named =
        [("service.namespace", &config.service_namespace), ("service.instance.id", &config.service_instance_id)];
    attributes.extend(named.into_iter().filter_map(|(k, v)| v.as_deref().map(|v| KeyValue::str(k, v))));
    otlp::Resource { attributes }
}

/// The exporter: batches of queued spans to the collector, one call at a time.
async fn export(mut rx: tokio::sync::mpsc::Receiver<Message>, mut client: otlp::Client, resource: otlp::Resource) {
    let mut batch: Vec<otlp::Span> = Vec::new();
    let mut tick = tokio::time::interval(EXPORT_EVERY);
    let warned = Throttle::default();
    loop {
        let flushed = tokio::select! {
            m = rx.recv() => match m {
                Some(Message::Spans(spans)) => {
                    batch.extend(spans);
                    if batch.len() < BATCH {
                        continue;
                    }
                    None
                }
                Some(Message::Flush(done)) => Some(done),
                None => return,
            },
            _ = tick.tick() => None,
        };
        while !batch.is_empty() {
            let spans: Vec<_> = batch.drain(..batch.len().min(BATCH)).collect();
            send(&mut client, &resource, spans, &warned).await;
        }
        if let Some(done) = flushed {
            let _ = done.send(());
        }
    }
}

async fn send(client: &mut otlp::Client, resource: &otlp::Resource, spans: Vec<otlp::Span>, warned: &Throttle) {
    let n = spans.len();
    let scope = otlp::InstrumentationScope { name: "sluice".into(), version: env!("CARGO_PKG_VERSION").into() };
    let request = otlp::ExportTraceServiceRequest {
        resource_spans: vec![otlp::ResourceSpans {
            resource: Some(resource.clone()),
            scope_spans: vec![otlp::ScopeSpans { scope: Some(scope), spans }],
        }],
    };
    let result = client.export(request).await;
    metrics::counter!(EXPORTS, "result" => if result.is_ok() { "ok" } else { "error" }).increment(1);
    let problem = match result {
        Ok(0) => return,
        Ok(rejected) => format!("the collector rejected {rejected} of {n} spans"),
        Err(e) => format!("{n} spans not exported: {e}"),
    };
    if warned.due(Clock::now(&SystemClock), EXPORT_WARN_EVERY) {
        tracing::warn!(problem = %problem, "traces: export failed (said at most once a minute; counted in {EXPORTS})");
    }
}

/// Runs `work`, one request's handling, traced when it should be: continuing `parent`
/// (the caller's trace, [`Parent::from_headers`]) or starting a trace; the log lines
/// it writes carry the trace id when there is one. `ended` reads the response's status
/// for the span.
pub async fn around<R>(
    tracer: Option<&Tracer>,
    parent: Option<Parent>,
    call: Call,
    work: impl Future<Output = R>,
    ended: impl FnOnce(&R) -> Ended,
) -> R {
    if tracer.is_none() && parent.is_none() {
        return work.await;
    }
    // boxed: the state of a traced call is not carried by every untraced one
    Box::pin(async move {
        let (trace_id, sampled) = match &parent {
            Some(p) => (p.trace_id, p.sampled),
            None => {
                let id = trace_id();
                (id, tracer.is_some_and(|t| sampled_at(t.bound, &id)))
            }
        };
        // at level error, so every filter that lets a line through keeps its trace id
        let log = |id: &[u8; 16]| tracing::error_span!("request", trace_id = %Hex(id));
        let Some(tracer) = tracer.filter(|_| sampled) else {
            return match &parent {
                Some(p) => work.instrument(log(&p.trace_id)).await,
                None => work.await,
            };
        };
        let start = unix_nanos();
        let recording = Recording { detailed: tracer.detailed, ..Recording::default() };
        let (response, recording) = RECORDING
            .scope(RefCell::new(recording), async {
                let response = work.instrument(log(&trace_id)).await;
                (response, RECORDING.with(|r| r.take()))
            })
            .await;
        let end = unix_nanos();
        let context = Context { trace_id, parent: parent.as_ref(), start, end };
        tracer.record(spans(&context, call, recording, ended(&response)));
        response
    })
    .await
}

/// Where a request's spans sit in their trace.
struct Context<'a> {
    trace_id: [u8; 16],
    parent: Option<&'a Parent>,
    start: u64,
    end: u64,
}

/// A request's span and its store calls' spans.
fn spans(c: &Context<'_>, call: Call, rec: Recording, ended: Ended) -> Vec<otlp::Span> {
    let id = span_id();
    let (name, mut attributes) = match call {
        Call::Http(name) => {
            let (method, route) = name.split_once(' ').unwrap_or(("", name));
            (name.to_string(), vec![KeyValue::str("http.request.method", method), KeyValue::str("http.route", route)])
        }
        Call::Grpc(path) => {
            let name = path.trim_start_matches('/');
            let (service, method) = name.split_once('/').unwrap_or((name, ""));
            (
                name.to_string(),
                vec![
                    KeyValue::str("rpc.system", "grpc"),
                    KeyValue::str("rpc.service", service),
                    KeyValue::str("rpc.method", method),
                ],
            )
        }
    };
    attributes.push(ended.attribute);
    attributes.extend(rec.attributes);
    if let Some(outcome) = rec.outcome {
        attributes.push(KeyValue::str("sluice.outcome", outcome));
    }
    let store_time = rec.calls.iter().map(|s| s.start).min().zip(rec.calls.iter().map(|s| s.end).max());
    attributes.push(KeyValue::int("sluice.store.calls", rec.calls.len() as i64));
    if let Some((first, last)) = store_time {
        attributes.push(KeyValue::int("sluice.store.latency_us", (last.saturating_sub(first) / 1_000) as i64));
    }
    let error = ended.error.then(|| rec.error.clone().unwrap_or_default());
    let flags = otlp::FLAGS_SAMPLED | if c.parent.is_some() { otlp::FLAGS_PARENT_REMOTE } else { 0 };
    let mut out = Vec::with_capacity(1 + rec.calls.len());
    out.push(span(c, id.to_vec(), c.parent.map(|p| p.span_id.to_vec()), name, otlp::KIND_SERVER, attributes, error));
    for s in rec.calls {
        let attributes = vec![KeyValue::str("sluice.store.op", s.op)];
        let child = Context { start: s.start, end: s.end, ..*c };
        let mut store = span(
            &child,
            span_id().to_vec(),
            Some(id.to_vec()),
            format!("store {}", s.op),
            otlp::KIND_CLIENT,
            attributes,
            s.error,
        );
        store.flags = otlp::FLAGS_SAMPLED | otlp::FLAGS_PARENT_LOCAL;
        out.push(store);
    }
    out[0].flags = flags;
    out
}

fn span(
    c: &Context<'_>,
    id: Vec<u8>,
    parent: Option<Vec<u8>>,
    name: String,
    kind: i32,
    attributes: Vec<KeyValue>,
    error: Option<String>,
) -> otlp::Span {
    otlp::Span {
        trace_id: c.trace_id.to_vec(),
        span_id: id,
        trace_state: c.parent.map(|p| p.state.clone()).unwrap_or_default(),
        parent_span_id: parent.unwrap_or_default(),
        name,
        kind,
        start_time_unix_nano: c.start,
        end_time_unix_nano: c.end,
        attributes,
        status: error.map(|message| otlp::Status { message, code: otlp::STATUS_ERROR }),
        flags: otlp::FLAGS_SAMPLED,
    }
}

/// Notes what the engine decided on the request being traced (nothing when none is).
pub fn decided(limiter: &Limiter, req: &Request, decided: &Result<Verdict, CheckError>) {
    let _ = RECORDING.try_with(|r| {
        let mut r = r.borrow_mut();
        r.attributes.push(KeyValue::str("sluice.domain", req.domain.as_str()));
        r.attributes.push(KeyValue::str("sluice.store", limiter.store().kind()));
        match decided {
            Ok(v) => {
                r.outcome = Some(match v.outcome {
                    Outcome::Allowed => "allowed",
                    Outcome::OverLimit => "over_limit",
                    Outcome::Unavailable => "unavailable",
                });
                r.attributes.push(KeyValue::bool("sluice.degraded", v.degraded.is_some()));
                if let Some(f) = v.degraded {
                    r.attributes.push(KeyValue::str("sluice.failure", f.header_value()));
                }
                if let Some(p) = v.binding() {
                    r.attributes.push(KeyValue::str("sluice.policy", &*p.name));
                }
            }
            Err(e) => {
                r.outcome = Some(if matches!(e, CheckError::Request(_)) { "invalid_request" } else { "store_error" });
                r.error = Some(e.to_string());
            }
        }
        if r.detailed {
            let entries = req
                .descriptors
                .iter()
                .map(|d| d.entries.iter().map(|e| format!("{}={}", e.key, e.value)).collect::<Vec<_>>().join(","));
            r.attributes.push(KeyValue::strings("sluice.descriptors", entries));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_errors_say_what_to_write() {
        let parse = |yaml: &str| serde_norway::from_str::<OtlpConfig>(yaml).map_err(|e| e.to_string());
        let ok = parse("endpoint: http://127.0.0.1:4317").unwrap();
        assert_eq!((ok.sampling_ratio, ok.detailed, ok.service_name.as_str()), (1.0, false, "sluice"));
        for (yaml, says) in [
            ("endpoint: https://collector:4317", "TLS to the collector is not supported"),
            ("endpoint: collector:4317", "write http://host:port"),
            ("endpoint: http://collector", "write http://host:port"),
            ("{endpoint: 'http://c:4317', sampling_ratio: 1.5}", "write 0 to 1"),
            ("{endpoint: 'http://c:4317', sample: 1}", "unknown field"),
        ] {
            let e = parse(yaml).unwrap_err();
            assert!(e.contains(says), "{yaml}: {e}");
        }
    }
}
