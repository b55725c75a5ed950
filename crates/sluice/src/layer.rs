//! The tower middleware: all of Sluice in front of a service, the way GitHub and Stripe
//! apply it inside their APIs.
//!
//! For each request, in order:
//! 1. **worker utilization shedder** (local, no IO): Stripe's controller
//!    ([`crate::algo::shedder`]) fed by the layer's own in-flight count over a worker
//!    capacity, or by a gauge the application supplies; drops by priority class, never
//!    the critical class. 503.
//! 2. **fleet usage shedder**: a fleet-wide concurrency limit that only non-critical
//!    traffic passes through, so critical traffic keeps its reserved share. 503.
//! 3. **concurrency and rate limits** of the request's descriptors, in one store call per
//!    client ([`Mode::Admit`]). 429.
//!
//! Refusals answer `application/problem+json` with the rate limit headers and
//! `Retry-After`. Leases (and the in-flight count) are given back when the response body
//! is finished or dropped. A response whose status is in `refund_on` (default: 304 Not
//! Modified) gives its charges back: GitHub's rule, charged at the start so a client
//! cannot exceed its limit while its last request is in flight.

use crate::algo::shedder::{Shedder, ShedderParams};
use crate::engine::{Descriptor, Entry, LeaseId, Mode, Request, Verdict};
use crate::time::{Clock, SystemClock};
use crate::{Limiter, config::HeadersConfig};
use crate::{headers, telemetry};
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

/// A function that reads a descriptor entry's value from a request.
pub type ExtractFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

/// Where a descriptor entry's value comes from.
#[derive(Clone)]
pub enum Extract {
    /// A request header (requests without it are not limited by this descriptor).
    Header(http::HeaderName),
    /// The method (`GET`).
    Method,
    /// The path (`/repos/x/y`).
    Path,
    /// Anything: an authenticated identity from the request extensions, the remote
    /// address, a header with a fallback.
    Custom(ExtractFn),
}

impl Extract {
    fn value(&self, parts: &Parts) -> Option<String> {
        match self {
            Extract::Header(h) => parts.headers.get(h)?.to_str().ok().map(str::to_string),
            Extract::Method => Some(parts.method.as_str().to_string()),
            Extract::Path => Some(parts.uri.path().to_string()),
            Extract::Custom(f) => f(parts),
        }
    }
}

/// A request's priority class: 0 is the least important; the last class is critical.
pub type Classifier = Arc<dyn Fn(&Parts) -> usize + Send + Sync>;

/// Stripe's order, four classes: test-mode traffic (header `x-test-mode`), reads
/// (GET, HEAD), writes, and critical (header `x-sluice-priority: critical`).
pub fn default_classifier() -> Classifier {
    Arc::new(|p: &Parts| {
        if p.headers.get("x-sluice-priority").is_some_and(|v| v == "critical") {
            3
        } else if p.headers.contains_key("x-test-mode") {
            0
        } else if p.method == http::Method::GET || p.method == http::Method::HEAD {
            1
        } else {
            2
        }
    })
}

/// Where the worker utilization shedder reads utilization from.
#[derive(Clone)]
pub enum Utilization {
    /// Requests in flight through this layer over this many workers.
    InFlight(usize),
    /// A gauge the application supplies, from 0 to 1.
    Gauge(Arc<dyn Fn() -> f64 + Send + Sync>),
}

struct WorkerShedder {
    controller: Mutex<Shedder>,
    source: Utilization,
}

struct Fleet {
    limiter: Arc<Limiter>,
    domain: String,
}

struct State {
    limiter: Arc<Limiter>,
    domain: String,
    descriptors: Vec<Vec<(String, Extract)>>,
    classifier: Classifier,
    classes: usize,
    worker: Option<WorkerShedder>,
    fleet: Option<Fleet>,
    refund_on: Vec<StatusCode>,
    headers: HeadersConfig,
    clock: Arc<dyn Clock>,
    in_flight: Arc<AtomicUsize>,
    rng: AtomicU64,
}

/// The layer. Build it, then `.layer(service)` or use it in a tower/axum stack.
#[derive(Clone)]
pub struct SluiceLayer {
    state: Arc<State>,
}

impl SluiceLayer {
    /// A layer deciding through `limiter` in `domain`. Add descriptors with
    /// [`SluiceLayer::descriptor`].
    pub fn new(limiter: Arc<Limiter>, domain: impl Into<String>) -> Self {
        let headers = limiter.rules().headers;
        Self {
            state: Arc::new(State {
                limiter,
                domain: domain.into(),
                descriptors: Vec::new(),
                classifier: default_classifier(),
                classes: 4,
                worker: None,
                fleet: None,
                refund_on: vec![StatusCode::NOT_MODIFIED],
                headers,
                clock: Arc::new(SystemClock),
                in_flight: Arc::new(AtomicUsize::new(0)),
                rng: AtomicU64::new(0x9e37_79b9_7f4a_7c15),
            }),
        }
    }

    fn edit(mut self, f: impl FnOnce(&mut State)) -> Self {
        f(Arc::get_mut(&mut self.state).expect("configure the layer before cloning it"));
        self
    }

    /// Adds a descriptor: entries `(key, where its value comes from)`, in order. A
    /// request lacking any entry's value does not carry this descriptor.
    pub fn descriptor(self, entries: Vec<(&str, Extract)>) -> Self {
        let d = entries.into_iter().map(|(k, e)| (k.to_string(), e)).collect();
        self.edit(|s| s.descriptors.push(d))
    }

    /// Replaces the priority classifier; `classes` classes, the last critical.
    pub fn priority(self, classes: usize, classifier: Classifier) -> Self {
        self.edit(|s| {
            s.classes = classes.max(2);
            s.classifier = classifier;
        })
    }

    /// Turns the worker utilization shedder on.
    pub fn worker_shedder(self, params: ShedderParams, source: Utilization) -> Self {
        self.edit(|s| s.worker = Some(WorkerShedder { controller: Mutex::new(Shedder::new(params)), source }))
    }

    /// Turns the fleet usage shedder on: non-critical requests take a lease on the
    /// concurrency policies of descriptor `[(fleet, all)]` in `domain` of `limiter`
    /// (configure one there, e.g. `{key: fleet, policies: [{name: fleet, concurrency:
    /// {limit: 80, lease_ttl: 60s}}]}`).
    pub fn fleet_shedder(self, limiter: Arc<Limiter>, domain: impl Into<String>) -> Self {
        let fleet = Fleet { limiter, domain: domain.into() };
        self.edit(|s| s.fleet = Some(fleet))
    }

    /// Statuses whose charges are given back (default: 304).
    pub fn refund_on(self, statuses: Vec<StatusCode>) -> Self {
        self.edit(|s| s.refund_on = statuses)
    }

    /// The clock the shedder reads (a manual clock in tests).
    pub fn clock(self, clock: Arc<dyn Clock>) -> Self {
        self.edit(|s| s.clock = clock)
    }

    /// Seeds the random source that decides drops (for deterministic tests).
    pub fn seed(self, seed: u64) -> Self {
        self.edit(|s| s.rng = AtomicU64::new(seed | 1))
    }
}

impl<S> tower::Layer<S> for SluiceLayer {
    type Service = SluiceService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        SluiceService { inner, state: self.state.clone() }
    }
}

/// The service the layer wraps around yours.
#[derive(Clone)]
pub struct SluiceService<S> {
    inner: S,
    state: Arc<State>,
}

/// What is given back when the response is done.
struct Guard {
    state: Arc<State>,
    leases: Vec<(Arc<Limiter>, LeaseId)>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.state.in_flight.fetch_sub(1, Ordering::Relaxed);
        for (limiter, lease) in self.leases.drain(..) {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = limiter.release(&lease).await;
                });
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// The response body: yours, or a problem+json refusal. Gives leases back when it
    /// ends or is dropped.
    pub struct SluiceBody<B> {
        #[pin]
        inner: Option<B>,
        refusal: Option<Bytes>,
        guard: Option<Guard>,
    }
}

impl<B: Body<Data = Bytes>> Body for SluiceBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        if let Some(b) = this.refusal.take() {
            return Poll::Ready(Some(Ok(Frame::data(b))));
        }
        let Some(inner) = this.inner.as_pin_mut() else { return Poll::Ready(None) };
        let polled = inner.poll_frame(cx);
        if let Poll::Ready(None) = polled {
            // the body is finished: give the leases back now, not when it is dropped
            this.guard.take();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.refusal.is_none() && self.inner.as_ref().is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.refusal, &self.inner) {
            (Some(b), _) => SizeHint::with_exact(b.len() as u64),
            (None, Some(i)) => i.size_hint(),
            (None, None) => SizeHint::with_exact(0),
        }
    }
}

/// A refusal: status, `application/problem+json` (RFC 9457) body, headers.
fn refusal<B>(
    status: StatusCode,
    title: &str,
    detail: &str,
    extra: Vec<(&'static str, String)>,
) -> Response<SluiceBody<B>> {
    let kind = if status == StatusCode::TOO_MANY_REQUESTS { "rate-limited" } else { "overloaded" };
    let body = format!(
        "{{\"type\":\"https://sluice.dev/problems/{kind}\",\"title\":{},\"status\":{},\"detail\":{}}}",
        json_string(title),
        status.as_u16(),
        json_string(detail)
    );
    let mut r = Response::new(SluiceBody { inner: None, refusal: Some(Bytes::from(body)), guard: None });
    *r.status_mut() = status;
    r.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
    for (k, v) in extra {
        if let Ok(v) = HeaderValue::from_str(&v) {
            r.headers_mut().insert(k, v);
        }
    }
    r
}

fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl State {
    fn random(&self) -> f64 {
        // xorshift64*: deterministic under a seed, good enough for drop decisions
        let mut x = self.rng.load(Ordering::Relaxed);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng.store(x, Ordering::Relaxed);
        (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Stripe's worker utilization shedder: samples utilization, and says whether this
    /// request is dropped.
    fn shed(&self, class: usize) -> bool {
        let Some(w) = &self.worker else { return false };
        let utilization = match &w.source {
            Utilization::InFlight(capacity) => {
                self.in_flight.load(Ordering::Relaxed) as f64 / (*capacity).max(1) as f64
            }
            Utilization::Gauge(g) => g(),
        };
        let p = {
            let mut c = w.controller.lock().unwrap_or_else(|e| e.into_inner());
            telemetry::shed_amount(c.update(utilization, self.clock.now()));
            c.drop_probability(class, self.classes)
        };
        let dropped = p > 0.0 && self.random() < p;
        if dropped {
            telemetry::shed("worker", class);
        }
        dropped
    }

    fn request(&self, parts: &Parts) -> Option<Request> {
        let descriptors: Vec<Descriptor> = self
            .descriptors
            .iter()
            .filter_map(|d| {
                let entries = d
                    .iter()
                    .map(|(k, e)| Some(Entry { key: k.clone(), value: e.value(parts)? }))
                    .collect::<Option<Vec<_>>>()?;
                Some(Descriptor { entries, ..Default::default() })
            })
            .collect();
        (!descriptors.is_empty()).then(|| Request { domain: self.domain.clone(), descriptors, hits_addend: None })
    }
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for SluiceService<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    ReqBody: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<SluiceBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        // the clone is ready only after poll_ready; keep the ready one (tower's rule)
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let state = self.state.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let class = (state.classifier)(&parts).min(state.classes - 1);
            let critical = class + 1 == state.classes;
            state.in_flight.fetch_add(1, Ordering::Relaxed);
            let mut guard = Guard { state: state.clone(), leases: Vec::new() };
            // 1. worker utilization shedder (every request samples it; the critical class
            // is never dropped)
            if state.shed(class) {
                return Ok(refusal(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Overloaded",
                    "this server is shedding load; retry later",
                    vec![("retry-after", "1".into())],
                ));
            }
            // 2. fleet usage shedder
            if let (Some(fleet), false) = (&state.fleet, critical) {
                let req = Request {
                    domain: fleet.domain.clone(),
                    descriptors: vec![Descriptor {
                        entries: vec![Entry { key: "fleet".into(), value: "all".into() }],
                        ..Default::default()
                    }],
                    hits_addend: None,
                };
                match fleet.limiter.run(&req, Mode::Acquire).await {
                    Ok(v) if !v.allowed => {
                        telemetry::shed("fleet", class);
                        return Ok(refusal(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "Overloaded",
                            "the fleet's share for this kind of request is in use; retry later",
                            vec![("retry-after", "1".into())],
                        ));
                    }
                    Ok(v) => guard.leases.extend(v.lease.map(|l| (fleet.limiter.clone(), l))),
                    // the store failed: fail open, as Stripe's limiters do
                    Err(e) => tracing::warn!(error = %e, "fleet shedder store call failed"),
                }
            }
            // 3. concurrency and rate limits, in one store call per client
            let verdict: Option<Verdict> = match state.request(&parts) {
                None => None,
                Some(req) => match state.limiter.run(&req, Mode::Admit).await {
                    Ok(v) => Some(v),
                    Err(e) => {
                        tracing::warn!(error = %e, "rate limit check failed; allowing");
                        None
                    }
                },
            };
            let mut extra = Vec::new();
            if let Some(v) = &verdict {
                extra = headers::render(v, &state.headers);
                if !v.allowed {
                    let (status, title) = match v.status {
                        503 => (StatusCode::SERVICE_UNAVAILABLE, "Overloaded"),
                        _ => (StatusCode::TOO_MANY_REQUESTS, "Too Many Requests"),
                    };
                    let detail = match v.binding() {
                        Some(b) => format!("over the limit of policy '{}'; see Retry-After", b.name),
                        None => "the rate limiter's store is unavailable".into(),
                    };
                    return Ok(refusal(status, title, &detail, extra));
                }
                guard.leases.extend(v.lease.clone().map(|l| (state.limiter.clone(), l)));
            }
            let response = inner.call(http::Request::from_parts(parts, body)).await?;
            if let Some(v) = &verdict
                && state.refund_on.contains(&response.status())
            {
                // GitHub's rule: a 304 costs nothing
                let _ = state.limiter.refund(v).await;
            }
            let (mut head, body) = response.into_parts();
            for (k, v) in extra {
                if let Ok(v) = HeaderValue::from_str(&v) {
                    head.headers.insert(k, v);
                }
            }
            Ok(Response::from_parts(head, SluiceBody { inner: Some(body), refusal: None, guard: Some(guard) }))
        })
    }
}
