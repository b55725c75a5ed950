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
use sluice::algo::grant::Granted;
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

/// `telemetry`: what the server reports besides `/metrics`.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Traces, sent to an OpenTelemetry collector; off without it.
    #[serde(default)]
    pub otlp: Option<OtlpConfig>,
    /// The `rate_limit:` rules' hits, sent to StatsD as envoyproxy/ratelimit sends them
    /// (`statsd.rs`); off without it.
    #[serde(default)]
    pub statsd: Option<StatsdConfig>,
}

/// `telemetry.statsd` (sent by `statsd.rs`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatsdConfig {
    /// The StatsD server, `host:port` (a name is resolved at each connect).
    pub address: String,
    /// `tcp` (theirs: gostats' TCP sink) or `udp`.
    #[serde(default)]
    pub protocol: Protocol,
    /// `lyft` (tags folded into the name, as their gostats writes) or `dogstatsd`.
    #[serde(default)]
    pub format: Format,
    /// How often the counters are sent (theirs: `STATS_FLUSH_INTERVAL`, 10 s).
    #[serde(default = "ten_seconds")]
    pub flush_interval: ConfigDuration,
    /// Tags on every stat (their `EXTRA_TAGS`).
    #[serde(default)]
    pub tags: std::collections::BTreeMap<String, String>,
    /// With `format: dogstatsd`: stat names rewritten into a name and tags, the first
    /// whose `pattern` matches (their `USE_DOG_STATSD_MOGRIFIERS`).
    #[serde(default)]
    pub mogrifiers: Vec<Mogrifier>,
}

/// One mogrifier: a stat whose name matches `pattern` (a regular expression) is sent as
/// `name`, with `tags`; `$0`, `$1`... in either are the match and its groups.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mogrifier {
    pub pattern: String,
    pub name: String,
    #[serde(default)]
    pub tags: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    #[default]
    Tcp,
    Udp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    #[default]
    Lyft,
    Dogstatsd,
}

fn ten_seconds() -> ConfigDuration {
    ConfigDuration(10_000)
}

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

/// A W3C trace context, from a `traceparent` (and `tracestate`) header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
    pub state: String,
}

impl Parent {
    /// The context `headers` carry, if a valid one: an invalid `traceparent` is ignored,
    /// as W3C Trace Context asks (the request starts a trace of its own).
    pub fn from_headers(headers: &HeaderMap) -> Option<Self> {
        const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
        let (trace_id, span_id, flags) = traceparent(headers.get(TRACEPARENT)?.as_bytes())?;
        let state = headers.get("tracestate").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        Some(Self { trace_id, span_id, sampled: flags & 1 == 1, state })
    }
}

/// Parses `version-traceid-parentid-flags` (lowercase hex; version `ff` is invalid;
/// a version after 00 may add fields after the flags; all-zero ids are invalid).
fn traceparent(v: &[u8]) -> Option<([u8; 16], [u8; 8], u8)> {
    let version = hex::<1>(v.get(0..2)?)?[0];
    let well_formed = match version {
        0 => v.len() == 55,
        0xff => false,
        _ => v.len() == 55 || (v.len() > 55 && v[55] == b'-'),
    };
    if !well_formed || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let trace_id = hex::<16>(&v[3..35])?;
    let span_id = hex::<8>(&v[36..52])?;
    let flags = hex::<1>(&v[53..55])?[0];
    (trace_id != [0; 16] && span_id != [0; 8]).then_some((trace_id, span_id, flags))
}

/// `N` bytes from `2N` lowercase hex digits.
fn hex<const N: usize>(s: &[u8]) -> Option<[u8; N]> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0; N];
    for (i, pair) in s.chunks(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

/// Lowercase hex, for trace ids in log lines.
pub struct Hex<'a>(pub &'a [u8]);

impl std::fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// Random ids: a per-thread xorshift generator seeded from the system (ids must be
/// unique, not secret).
fn random_u64() -> u64 {
    thread_local! {
        static STATE: Cell<u64> = Cell::new({
            let mut seed = [0u8; 8];
            let _ = getrandom::fill(&mut seed);
            u64::from_le_bytes(seed) | 1
        });
    }
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        x
    })
}

fn span_id() -> [u8; 8] {
    random_u64().to_be_bytes()
}

fn trace_id() -> [u8; 16] {
    let mut id = [0; 16];
    id[..8].copy_from_slice(&random_u64().to_be_bytes());
    id[8..].copy_from_slice(&random_u64().to_be_bytes());
    id
}

fn unix_nanos() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// Whether the trace `id` is recorded at `ratio`: its last 8 bytes against the ratio's
/// share of 2^63 (OpenTelemetry's `TraceIdRatioBased` rule).
fn sampled_at(bound: u64, id: &[u8; 16]) -> bool {
    let low = u64::from_be_bytes(id[8..].try_into().expect("8 bytes"));
    (low >> 1) < bound
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

/// A store whose calls made while a sampled request is decided become spans
/// (installed only when tracing is on).
pub struct TracedStore(pub Arc<dyn Store>);

#[async_trait::async_trait]
impl Store for TracedStore {
    async fn apply(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
        store_call("apply", self.0.apply(tag, ops, now)).await
    }

    async fn peek(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<Vec<Decision>, StoreError> {
        store_call("peek", self.0.peek(tag, ops, now)).await
    }

    async fn release(&self, tag: Tag, keys: &[u64], lease: Lease, now: Millis) -> Result<bool, StoreError> {
        store_call("release", self.0.release(tag, keys, lease, now)).await
    }

    async fn leases(&self, tag: Tag, key: u64, ttl: Millis, now: Millis) -> Result<ConcurrencyState, StoreError> {
        store_call("leases", self.0.leases(tag, key, ttl, now)).await
    }

    async fn refund(&self, tag: Tag, refunds: &[Refund], now: Millis) -> Result<(), StoreError> {
        store_call("refund", self.0.refund(tag, refunds, now)).await
    }

    async fn reset(&self, tag: Tag, ops: &[Op], now: Millis) -> Result<(), StoreError> {
        store_call("reset", self.0.reset(tag, ops, now)).await
    }

    fn grants(&self) -> bool {
        self.0.grants()
    }

    async fn grant(&self, tag: Tag, ask: GrantAsk, now: Millis) -> Result<Granted, StoreError> {
        store_call("grant", self.0.grant(tag, ask, now)).await
    }

    async fn give_back(&self, tag: Tag, back: GiveBack, now: Millis) -> Result<u64, StoreError> {
        store_call("give_back", self.0.give_back(tag, back, now)).await
    }

    fn reservations(&self) -> bool {
        self.0.reservations()
    }

    async fn reserve(&self, tag: Tag, ops: &[Op], r: Reservation, now: Millis) -> Result<Vec<Decision>, StoreError> {
        store_call("reserve", self.0.reserve(tag, ops, r, now)).await
    }

    async fn commit(&self, tag: Tag, id: u64, commits: &[Commit], now: Millis) -> Result<Vec<Settled>, StoreError> {
        store_call("commit", self.0.commit(tag, id, commits, now)).await
    }

    async fn holds(&self, tag: Tag, key: u64, limit: &Limit, now: Millis) -> Result<Vec<Hold>, StoreError> {
        store_call("holds", self.0.holds(tag, key, limit, now)).await
    }

    fn keeps_registry(&self) -> bool {
        self.0.keeps_registry()
    }

    async fn registry(&self, op: RegistryOp) -> Result<RegistryReply, StoreError> {
        self.0.registry(op).await
    }

    async fn preflight(&self) -> Result<(), StoreError> {
        self.0.preflight().await
    }

    async fn ready(&self) -> bool {
        self.0.ready().await
    }

    fn kind(&self) -> &'static str {
        self.0.kind()
    }
}

/// Times a store call into the request being traced (just the call when none is).
async fn store_call<T>(op: &'static str, call: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
    if RECORDING.try_with(|_| ()).is_err() {
        return call.await;
    }
    let start = unix_nanos();
    let result = call.await;
    let end = unix_nanos();
    let error = result.as_ref().err().map(|e| e.to_string());
    let _ = RECORDING.try_with(|r| r.borrow_mut().calls.push(StoreCall { op, start, end, error }));
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_valid_and_not() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let (t, s, f) = traceparent(good.as_bytes()).expect("valid");
        assert_eq!(Hex(&t).to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(Hex(&s).to_string(), "00f067aa0ba902b7");
        assert_eq!(f, 1);
        // a later version may carry more after the flags
        assert!(traceparent(format!("01{}-extra", &good[2..]).as_bytes()).is_some());
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
        ] {
            assert_eq!(traceparent(bad.as_bytes()), None, "{bad:?}");
        }
    }

    /// The ratio sampler records about its share of random trace ids, none at 0 and
    /// every one at 1.
    #[test]
    fn sampling_follows_the_ratio() {
        let share = |ratio: f64| {
            let bound = (ratio * (1u64 << 63) as f64) as u64;
            (0..100_000).filter(|_| sampled_at(bound, &trace_id())).count()
        };
        assert_eq!(share(0.0), 0);
        assert_eq!(share(1.0), 100_000);
        let quarter = share(0.25);
        assert!((24_000..26_000).contains(&quarter), "{quarter} of 100,000 at 0.25");
    }

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
