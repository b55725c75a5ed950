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
//!    client ([`Limiter::admit`]). 429.
//! 4. **a budget** whose cost the response tells (an LLM's tokens), when set
//!    ([`SluiceLayerBuilder::budget`]): the request's estimate is reserved
//!    ([`Limiter::reserve`]), 429 when it does not fit; the response's [`Actual`] (an
//!    extension, or an `x-sluice-actual` header or trailer) is committed when the
//!    response is done, and the estimate when it names none.
//! 5. **the adaptive stage**, when set ([`SluiceLayerBuilder::adaptive`]): a concurrency
//!    limit learned from the service's latency ([`crate::algo::overload`]), spent most
//!    important class first, with a bounded wait. 503. It is last, around the service,
//!    because it measures the service: a request refused earlier never holds a slot,
//!    and a slot is held until the response body ends. It stands beside the worker
//!    utilization shedder rather than replacing it: that one reads a utilization the
//!    application may supply (a pool the layer does not see) and acts in minutes; this
//!    one learns from latency and acts within a few of the service's latencies, needing
//!    no threshold. Use one or the other for one resource.
//!
//! Refusals answer `application/problem+json` with the rate limit headers and
//! `Retry-After`. Leases (and the in-flight count) are given back when the response body
//! is finished or dropped. A response whose status is in `refund_on` (default: 304 Not
//! Modified) gives its charges back: GitHub's rule, charged at the start so a client
//! cannot exceed its limit while its last request is in flight.

mod adaptive;
mod body;

pub use body::SluiceBody;
use body::{Guard, refusal};

use crate::algo::overload::{GradientError, GradientParams};
use crate::algo::shedder::{Shedder, ShedderParams};
use crate::headers::{self, HeadersConfig};
use crate::request::{Descriptor, Entry, Request};
use crate::time::{Clock, SystemClock};
use crate::verdict::{Outcome, Verdict};
use crate::{Limiter, telemetry};
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Response, StatusCode};
use http_body::Body;
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

/// A budget's estimate of a request's cost, read from the request (its `max_tokens`, say).
pub type EstimateFn = Arc<dyn Fn(&Parts) -> u64 + Send + Sync>;

/// What a response cost a layer's budget: put it in the response's extensions (or send
/// it as the header or trailer [`ACTUAL_HEADER`]); the layer commits it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Actual(pub u64);

/// The response header or trailer that carries what a response cost, when it has no
/// [`Actual`] extension. The layer takes it off the response.
pub const ACTUAL_HEADER: &str = "x-sluice-actual";

/// A budget: the descriptor its rules match, the estimate to hold, and how long at most.
struct Budget {
    descriptor: Vec<(String, Extract)>,
    estimate: EstimateFn,
    ttl: crate::time::Millis,
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

/// Everything a layer's services share.
struct Shared {
    limiter: Arc<Limiter>,
    domain: String,
    descriptors: Vec<Vec<(String, Extract)>>,
    classifier: Classifier,
    classes: usize,
    worker: Option<WorkerShedder>,
    fleet: Option<Fleet>,
    refund_on: Vec<StatusCode>,
    budget: Option<Budget>,
    adaptive: Option<adaptive::Adaptive>,
    headers: HeadersConfig,
    clock: Arc<dyn Clock>,
    in_flight: Arc<AtomicUsize>,
    rng: AtomicU64,
}

/// The layer: `.layer(service)`, or put it in a tower or axum stack. Made by
/// [`SluiceLayer::builder`]; once built it cannot be changed, so every clone of it
/// behaves the same.
///
/// ```
/// use sluice::layer::{Extract, SluiceLayer};
/// use sluice::{DomainBuilder, Limiter, RulesBuilder};
/// use std::{sync::Arc, time::Duration};
///
/// let rules = RulesBuilder::new()
///     .domain(DomainBuilder::new("api").rule([("user", None)], |r| {
///         r.fixed_window("per_minute", 100, Duration::from_secs(60))
///             .concurrency("inflight", 10, Duration::from_secs(30))
///     }))
///     .build()
///     .unwrap();
/// let layer = SluiceLayer::builder(Arc::new(Limiter::in_memory(rules)), "api")
///     .descriptor(vec![("user", Extract::Header("x-user".parse().unwrap()))])
///     .build();
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct SluiceLayer {
    shared: Arc<Shared>,
}

/// Configures a [`SluiceLayer`].
pub struct SluiceLayerBuilder {
    shared: Shared,
}

impl SluiceLayer {
    /// A layer deciding through `limiter` in `domain`. Add descriptors with
    /// [`SluiceLayerBuilder::descriptor`], then [`SluiceLayerBuilder::build`].
    pub fn builder(limiter: Arc<Limiter>, domain: impl Into<String>) -> SluiceLayerBuilder {
        SluiceLayerBuilder {
            shared: Shared {
                limiter,
                domain: domain.into(),
                descriptors: Vec::new(),
                classifier: default_classifier(),
                classes: 4,
                worker: None,
                fleet: None,
                refund_on: vec![StatusCode::NOT_MODIFIED],
                budget: None,
                adaptive: None,
                headers: HeadersConfig::default(),
                clock: Arc::new(SystemClock),
                in_flight: Arc::new(AtomicUsize::new(0)),
                rng: AtomicU64::new(0x9e37_79b9_7f4a_7c15),
            },
        }
    }
}

impl SluiceLayerBuilder {
    /// Adds a descriptor: entries `(key, where its value comes from)`, in order. A
    /// request lacking any entry's value does not carry this descriptor.
    pub fn descriptor(mut self, entries: Vec<(&str, Extract)>) -> Self {
        let d = entries.into_iter().map(|(k, e)| (k.to_string(), e)).collect();
        self.shared.descriptors.push(d);
        self
    }

    /// Replaces the priority classifier; `classes` classes, the last critical.
    pub fn priority(mut self, classes: usize, classifier: Classifier) -> Self {
        self.shared.classes = classes.max(2);
        self.shared.classifier = classifier;
        self
    }

    /// Turns the worker utilization shedder on.
    pub fn worker_shedder(mut self, params: ShedderParams, source: Utilization) -> Self {
        self.shared.worker = Some(WorkerShedder { controller: Mutex::new(Shedder::new(params)), source });
        self
    }

    /// Turns the fleet usage shedder on: non-critical requests take a lease on the
    /// concurrency policies of descriptor `[(fleet, all)]` in `domain` of `limiter`
    /// (configure one there, e.g. `{key: fleet, policies: [{name: fleet, concurrency:
    /// {limit: 80, lease_ttl: 60s}}]}`).
    pub fn fleet_shedder(mut self, limiter: Arc<Limiter>, domain: impl Into<String>) -> Self {
        self.shared.fleet = Some(Fleet { limiter, domain: domain.into() });
        self
    }

    /// Which rate limit headers responses carry (default: GitHub's and the IETF's).
    pub fn headers(mut self, headers: HeadersConfig) -> Self {
        self.shared.headers = headers;
        self
    }

    /// Meters a budget whose cost only the response knows (stage 4): each request with
    /// the descriptor `entries` reserves `estimate(request)` for at most `ttl`, and the
    /// response's [`Actual`] settles it (see [`crate::algo::reservation`]). The budget's
    /// rules are fixed windows of the layer's domain.
    pub fn budget(
        mut self,
        entries: Vec<(&str, Extract)>,
        estimate: impl Fn(&Parts) -> u64 + Send + Sync + 'static,
        ttl: std::time::Duration,
    ) -> Self {
        let descriptor = entries.into_iter().map(|(k, e)| (k.to_string(), e)).collect();
        let ttl = ttl.as_millis() as crate::time::Millis;
        self.shared.budget = Some(Budget { descriptor, estimate: Arc::new(estimate), ttl });
        self
    }

    /// Turns the adaptive stage on (stage 5, around the service): a concurrency limit
    /// learned from the service's latency, spent by priority class; refusals answer 503
    /// with `Retry-After`. See [`crate::algo::overload`]; `GradientParams::default()`
    /// needs no tuning. Set the classes ([`Self::priority`]) first.
    pub fn adaptive(mut self, params: GradientParams) -> Result<Self, GradientError> {
        params.validate()?;
        self.shared.adaptive = Some(adaptive::Adaptive::new(params, self.shared.classes));
        Ok(self)
    }

    /// Statuses whose charges are given back (default: 304).
    pub fn refund_on(mut self, statuses: Vec<StatusCode>) -> Self {
        self.shared.refund_on = statuses;
        self
    }

    /// The clock the shedder reads (a manual clock in tests).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.shared.clock = clock;
        self
    }

    /// Seeds the random source that decides drops (for deterministic tests).
    pub fn seed(mut self, seed: u64) -> Self {
        self.shared.rng = AtomicU64::new(seed | 1);
        self
    }

    /// The layer.
    pub fn build(self) -> SluiceLayer {
        SluiceLayer { shared: Arc::new(self.shared) }
    }
}

impl SluiceLayer {
    /// A layer of the adaptive stage alone, on its defaults and the default classes, in
    /// front of anything (no rate limits: it decides nothing else).
    pub fn adaptive_only() -> SluiceLayer {
        let rules = crate::RulesBuilder::new().build().expect("no rules are valid rules");
        let builder = SluiceLayer::builder(Arc::new(Limiter::in_memory(rules)), "");
        builder.adaptive(GradientParams::default()).expect("the defaults are valid").build()
    }

    /// The adaptive stage's limit, requests in flight and waiting, when it is on.
    pub fn adaptive_state(&self) -> Option<(u32, u32, u32)> {
        self.shared.adaptive.as_ref().map(adaptive::Adaptive::state)
    }
}

impl<S> tower::Layer<S> for SluiceLayer {
    type Service = SluiceService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        SluiceService { inner, shared: self.shared.clone() }
    }
}

/// The service the layer wraps around yours.
#[derive(Clone)]
pub struct SluiceService<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl Shared {
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
        (!descriptors.is_empty()).then(|| Request {
            domain: self.domain.clone(),
            descriptors,
            hits_addend: None,
            lenient: false,
        })
    }

    /// Stage 1, Stripe's worker utilization shedder: samples utilization and refuses
    /// with 503 when this request's class is dropped (never the critical class).
    fn worker_stage<B>(&self, class: usize) -> Option<Response<SluiceBody<B>>> {
        self.shed(class).then(|| {
            let detail = "this server is shedding load; retry later";
            refusal(StatusCode::SERVICE_UNAVAILABLE, "Overloaded", detail, vec![("retry-after", "1".into())])
        })
    }

    /// Stage 5, the adaptive concurrency limit, around the service: a slot (held in
    /// `guard` until the response ends), or 503 when none came within the wait allowed.
    async fn adaptive_stage<B>(&self, class: usize, guard: &mut Guard) -> Option<Response<SluiceBody<B>>> {
        let stage = self.adaptive.as_ref()?;
        match stage.enter(class).await {
            Some(slot) => {
                guard.slot = Some(slot);
                None
            }
            None => {
                adaptive::Adaptive::shed(class);
                let detail = "this service is at its concurrency limit; retry later";
                Some(refusal(StatusCode::SERVICE_UNAVAILABLE, "Overloaded", detail, vec![("retry-after", "1".into())]))
            }
        }
    }

    /// Stage 2, the fleet usage shedder: a non-critical request takes a lease on the
    /// fleet's concurrency policy, or is refused with 503. The lease goes in `guard`.
    async fn fleet_stage<B>(&self, class: usize, guard: &mut Guard) -> Option<Response<SluiceBody<B>>> {
        let fleet = self.fleet.as_ref().filter(|_| class + 1 < self.classes)?;
        let req = Request::new(fleet.domain.clone()).descriptor([("fleet", "all")]);
        match fleet.limiter.acquire(&req).await {
            Ok(v) if !v.allowed() => {
                telemetry::shed("fleet", class);
                let detail = "the fleet's share for this kind of request is in use; retry later";
                Some(refusal(StatusCode::SERVICE_UNAVAILABLE, "Overloaded", detail, vec![("retry-after", "1".into())]))
            }
            Ok(v) => {
                guard.leases.extend(v.lease.map(|l| (fleet.limiter.clone(), l)));
                None
            }
            // the store failed: fail open, as Stripe's limiters do
            Err(e) => {
                tracing::debug!(error = %e, "fleet shedder store call failed; allowing");
                None
            }
        }
    }

    /// Stage 3, the client's concurrency and rate limits in one store call per client:
    /// the verdict and its headers, or the refusal (429, or 503 when a fail-closed
    /// policy's store failed). Leases taken go in `guard`.
    async fn limit_stage<B>(
        &self,
        parts: &Parts,
        guard: &mut Guard,
    ) -> Result<Option<(Verdict, Vec<(&'static str, String)>)>, Response<SluiceBody<B>>> {
        let Some(req) = self.request(parts) else { return Ok(None) };
        let v = match self.limiter.admit(&req).await {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!(error = %e, "rate limit check failed; allowing");
                return Ok(None);
            }
        };
        let headers = headers::render(&v, &self.headers);
        let (status, title) = match v.outcome {
            Outcome::Allowed => {
                guard.leases.extend(v.lease.clone().map(|l| (self.limiter.clone(), l)));
                return Ok(Some((v, headers)));
            }
            Outcome::OverLimit => (StatusCode::TOO_MANY_REQUESTS, "Too Many Requests"),
            Outcome::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "Overloaded"),
        };
        let detail = match v.binding() {
            Some(b) => format!("over the limit of policy '{}'; see Retry-After", b.name),
            None => "the rate limiter's store is unavailable".into(),
        };
        Err(refusal(status, title, &detail, headers))
    }
}

impl Shared {
    /// Stage 4, the budget: reserves the request's estimate, or refuses with 429 when it
    /// does not fit. The reservation goes in `guard`; a store that fails lets the
    /// request through unmetered, as the other limits do.
    async fn budget_stage<B>(&self, parts: &Parts, guard: &mut Guard) -> Option<Response<SluiceBody<B>>> {
        let budget = self.budget.as_ref()?;
        let entries: Option<Vec<Entry>> =
            budget.descriptor.iter().map(|(k, e)| Some(Entry { key: k.clone(), value: e.value(parts)? })).collect();
        let estimate = (budget.estimate)(parts);
        let descriptor = Descriptor { entries: entries?, hits_addend: Some(estimate), limit: None };
        let req =
            Request { domain: self.domain.clone(), descriptors: vec![descriptor], hits_addend: None, lenient: false };
        // unique across the fleet: every instance's reservations share the store
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).ok()?;
        let id = u64::from_le_bytes(b).max(1);
        match self.limiter.reserve(&req, id, budget.ttl).await {
            Ok((_, Some(reserved))) => {
                guard.hold = Some((reserved, estimate, None));
                None
            }
            Ok((v, None)) => {
                let detail = "the request's estimate does not fit in its budget; see Retry-After";
                Some(refusal(
                    StatusCode::TOO_MANY_REQUESTS,
                    "Too Many Requests",
                    detail,
                    headers::render(&v, &self.headers),
                ))
            }
            Err(e) => {
                tracing::debug!(error = %e, "budget reservation failed; allowing");
                None
            }
        }
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
        let shared = self.shared.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let class = (shared.classifier)(&parts).min(shared.classes - 1);
            shared.in_flight.fetch_add(1, Ordering::Relaxed);
            let mut guard = Guard {
                shared: shared.clone(),
                leases: Vec::new(),
                hold: None,
                slot: None,
                status: StatusCode::OK,
                finished: false,
            };
            if let Some(refused) = shared.worker_stage(class) {
                return Ok(refused);
            }
            if let Some(refused) = shared.fleet_stage(class, &mut guard).await {
                return Ok(refused);
            }
            let verdict = match shared.limit_stage(&parts, &mut guard).await {
                Ok(v) => v,
                Err(refused) => return Ok(refused),
            };
            if let Some(refused) = shared.budget_stage(&parts, &mut guard).await {
                return Ok(refused);
            }
            if let Some(refused) = shared.adaptive_stage(class, &mut guard).await {
                return Ok(refused);
            }
            let response = inner.call(http::Request::from_parts(parts, body)).await?;
            let (mut head, body) = response.into_parts();
            guard.status = head.status;
            // an empty body is never polled: the response is whole as it stands
            guard.finished = body.is_end_stream();
            let told = head.extensions.get::<Actual>().map(|a| a.0);
            let header = head.headers.remove(ACTUAL_HEADER).and_then(|v| v.to_str().ok()?.parse().ok());
            if let Some(a) = told.or(header) {
                guard.told(a);
            }
            if let Some((v, headers)) = verdict {
                if shared.refund_on.contains(&head.status) {
                    // GitHub's rule: a 304 costs nothing
                    let _ = shared.limiter.refund(&v).await;
                }
                for (k, v) in headers {
                    if let Ok(v) = HeaderValue::from_str(&v) {
                        head.headers.insert(k, v);
                    }
                }
            }
            Ok(Response::from_parts(head, SluiceBody { inner: Some(body), refusal: None, guard: Some(guard) }))
        })
    }
}
