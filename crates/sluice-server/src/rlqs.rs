//! Envoy's Rate Limit Quota Service (RLQS),
//! `envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas`: what
//! an Envoy's `envoy.filters.http.rate_limit_quota` filter streams its usage reports to,
//! on the gRPC listener beside RLS (same port, TLS and tokens).
//!
//! Each stream is one Envoy; the filter's `domain` names the Sluice domain, and each
//! bucket id (a map) the entries of a descriptor, arranged to walk the domain's rules
//! (`Limiter::quota_target`). Each bucket's share is a [`sluice::quota::Share`]: on every
//! report, when its window restarts, and when the window's last piece is sent again to
//! last to the window's end ([`Share::due`]), the share takes what its next assignment may
//! admit from the shared window as a grant, then the assignment is sent. A bucket that
//! matches no limit is sent nothing (the filter's `no_assignment_behavior` stands; the
//! reason is logged once); one whose rule went away by a reload is sent an
//! `AbandonAction`. An unknown domain ends the stream with `NOT_FOUND`.

use crate::state::AppState;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    self, AbandonAction, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt32Value};
use sluice::quota::{Assignment, QuotaError, Share};
use sluice::time::Millis;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

/// Metric names (docs/operations.md).
pub mod names {
    pub const STREAMS: &str = "sluice_rlqs_streams";
    pub const BUCKETS: &str = "sluice_rlqs_buckets";
    pub const ASSIGNMENTS: &str = "sluice_rlqs_assignments_total";
    pub const REPORTS: &str = "sluice_rlqs_reports_total";
    pub const REPORTED: &str = "sluice_rlqs_requests_reported_total";
    pub const GRANTED: &str = "sluice_rlqs_units_granted_total";
    pub const UNSPENT: &str = "sluice_rlqs_units_unspent_total";
    pub const RESUMED: &str = "sluice_rlqs_buckets_resumed_total";
    pub const UNMATCHED: &str = "sluice_rlqs_buckets_unmatched_total";
}

/// The service.
#[derive(Clone)]
pub struct Rlqs {
    pub state: Arc<AppState>,
    /// Turns true when the server stops: every stream ends (UNAVAILABLE), so its Envoy
    /// moves to another instance.
    pub stop: tokio::sync::watch::Receiver<bool>,
}

/// The streams open on this instance, as `GET /v1/admin/rlqs` shows them.
#[derive(Default)]
pub struct Streams {
    open: Mutex<BTreeMap<u64, serde_json::Value>>,
    next: AtomicU64,
}

impl Streams {
    /// Every open stream: its domain, peer and buckets with their shares.
    pub fn view(&self) -> serde_json::Value {
        let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        serde_json::json!({ "streams": open.values().collect::<Vec<_>>() })
    }

    fn set(&self, id: u64, view: serde_json::Value) {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).insert(id, view);
    }

    fn remove(&self, id: u64) {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
    }
}

type Outbound = mpsc::Sender<Result<RateLimitQuotaResponse, Status>>;

#[tonic::async_trait]
impl RateLimitQuotaService for Rlqs {
    type StreamRateLimitQuotasStream =
        std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send + 'static>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let given = request.metadata().get("authorization").map(|v| v.as_bytes());
        if !self.state.api_token_matches(given) {
            return Err(Status::unauthenticated("send metadata authorization: Bearer <one of server.api_tokens>"));
        }
        let peer = request
            .extensions()
            .get::<crate::grpc_listen::Peer>()
            .and_then(|p| p.addr)
            .map(|a| a.to_string())
            .unwrap_or_default();
        let (tx, rx) = mpsc::channel(16);
        let stream = Stream::new(self.state.clone(), peer);
        tokio::spawn(stream.run(request.into_inner(), tx, self.stop.clone()));
        let out = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        Ok(Response::new(Box::pin(out)))
    }
}

/// One bucket of a stream.
struct Bucket {
    id: BucketId,
    share: Share,
    /// It gets no share, and why was logged.
    refused: bool,
}

/// One Envoy's stream.
struct Stream {
    state: Arc<AppState>,
    id: u64,
    peer: String,
    domain: Option<String>,
    buckets: HashMap<Vec<(String, String)>, Bucket>,
}

/// How often a stream logs that the store failed its shares, at most.
const LOG_EVERY: Millis = 10_000;

impl Stream {
    fn new(state: Arc<AppState>, peer: String) -> Self {
        let id = state.rlqs.next.fetch_add(1, Relaxed);
        Self { state, id, peer, domain: None, buckets: HashMap::new() }
    }

    /// Serves the stream until the Envoy ends it, it breaks, or the server stops.
    async fn run(
        mut self,
        mut inbound: Streaming<RateLimitQuotaUsageReports>,
        tx: Outbound,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let failures = sluice::time::Throttle::default();
        loop {
            let wake = self.next_due();
            let sleep = tokio::time::sleep(wake);
            let actions = tokio::select! {
                message = inbound.message() => match message {
                    Ok(Some(report)) => self.report(report, &failures).await,
                    Ok(None) | Err(_) => break,
                },
                _ = sleep => Ok(self.tick_due(&failures).await),
                _ = async { let _ = stop.wait_for(|s| *s).await; } => {
                    let _ = tx.send(Err(Status::unavailable("the server is stopping; reconnect to another instance"))).await;
                    break;
                }
            };
            let actions = match actions {
                Ok(actions) => actions,
                Err(status) => {
                    let _ = tx.send(Err(status)).await;
                    break;
                }
            };
            self.publish();
            if !actions.is_empty() && tx.send(Ok(RateLimitQuotaResponse { bucket_action: actions })).await.is_err() {
                break;
            }
        }
        self.close();
    }

    /// Until a bucket's share is due to tick without a report (a minute when none is):
    /// its window's last piece sent again, or its window restarted.
    fn next_due(&self) -> std::time::Duration {
        let now = self.engine_now();
        let next = self.buckets.values().map(|b| b.share.due()).filter(|&w| w > 0).min();
        // a little past it, so the store sees a window over
        let ms = next.map_or(60_000, |w| w.saturating_sub(now) + 5);
        std::time::Duration::from_millis(ms)
    }

    fn engine_now(&self) -> Millis {
        self.state.engine.load().limiter.now()
    }

    /// One usage report: each bucket's share is brought up to date, and sent.
    async fn report(
        &mut self,
        report: RateLimitQuotaUsageReports,
        failures: &sluice::time::Throttle,
    ) -> Result<Vec<BucketAction>, Status> {
        if report.domain.is_empty() {
            return Err(Status::invalid_argument("the usage report names no domain (the filter's `domain`)"));
        }
        match &self.domain {
            Some(d) if *d != report.domain => {
                return Err(Status::invalid_argument(format!(
                    "the stream reported for domain '{d}' and now '{}'; one stream serves one domain",
                    report.domain.escape_debug()
                )));
            }
            Some(_) => {}
            None => {
                let engine = self.state.engine.load();
                // a bucket of no entries matches no rule: this only asks for the domain
                if let Err(e @ QuotaError::UnknownDomain { .. }) = engine.limiter.quota_target(&report.domain, &[]) {
                    return Err(Status::not_found(e.to_string()));
                }
                metrics::gauge!(names::STREAMS, "domain" => report.domain.clone()).increment(1.0);
                self.domain = Some(report.domain.clone());
            }
        }
        let domain = report.domain;
        metrics::counter!(names::REPORTS, "domain" => domain.clone()).increment(1);
        let mut keys = Vec::with_capacity(report.bucket_quota_usages.len());
        for usage in report.bucket_quota_usages {
            let Some(id) = usage.bucket_id.filter(|b| !b.bucket.is_empty()) else { continue };
            let mut key: Vec<(String, String)> = id.bucket.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            key.sort();
            let elapsed = usage.time_elapsed.map_or(0, |d| d.seconds.max(0) as u64);
            let (allowed, denied) = (usage.num_requests_allowed, usage.num_requests_denied);
            metrics::counter!(names::REPORTED, "domain" => domain.clone(), "outcome" => "allowed").increment(allowed);
            metrics::counter!(names::REPORTED, "domain" => domain.clone(), "outcome" => "denied").increment(denied);
            let bucket = self.buckets.entry(key.clone()).or_insert_with(|| {
                metrics::gauge!(names::BUCKETS, "domain" => domain.clone()).increment(1.0);
                if elapsed > 0 {
                    // a bucket the Envoy had before this stream: its last share was held
                    // elsewhere (an instance gone), and lapses there unspent
                    metrics::counter!(names::RESUMED, "domain" => domain.clone()).increment(1);
                }
                Bucket { id, share: Share::default(), refused: false }
            });
            bucket.share.report(allowed, denied, elapsed);
            keys.push(key);
        }
        Ok(self.tick(&keys, failures).await)
    }

    /// The buckets due ([`Share::due`]): their window's last piece sent again, or their
    /// window over and the bucket brought into the next one.
    async fn tick_due(&mut self, failures: &sluice::time::Throttle) -> Vec<BucketAction> {
        let now = self.engine_now();
        let due: Vec<_> =
            self.buckets.iter().filter(|(_, b)| (1..=now).contains(&b.share.due())).map(|(k, _)| k.clone()).collect();
        self.tick(&due, failures).await
    }

    /// Ticks the buckets `keys`, one after another; returns what to send.
    async fn tick(&mut self, keys: &[Vec<(String, String)>], failures: &sluice::time::Throttle) -> Vec<BucketAction> {
        let Some(domain) = self.domain.clone() else { return Vec::new() };
        let engine = self.state.engine.load_full();
        let limiter = &engine.limiter;
        let mut actions = Vec::new();
        for key in keys {
            let Some(bucket) = self.buckets.get_mut(key) else { continue };
            let entries: Vec<(&str, &str)> = key.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let now = limiter.now();
            let assignment = match limiter.quota_target(&domain, &entries) {
                Ok(target) => match bucket.share.tick(limiter, &target, now).await {
                    Ok(tick) => {
                        bucket.refused = false;
                        metrics::counter!(names::GRANTED, "domain" => domain.clone()).increment(tick.granted);
                        metrics::counter!(names::UNSPENT, "domain" => domain.clone()).increment(tick.unspent);
                        tick.assignment
                    }
                    Err(e) => {
                        // nothing sent: the assignment in force lapses, and the filter's
                        // expired-assignment behaviour decides (the failure policy)
                        if failures.due(now, LOG_EVERY) {
                            tracing::warn!(domain = %domain, error = %e, "RLQS: a share could not be taken from the store");
                        }
                        None
                    }
                },
                Err(QuotaError::Unlimited) => Some(bucket.share.allow_all(now)),
                Err(e) if bucket.share.assignment.is_some() => {
                    // it had a share: its rule is gone (a reload); the Envoy drops it
                    tracing::info!(domain = %domain, bucket = ?key, reason = %e, "RLQS: the bucket is abandoned");
                    actions.push(self.abandon(key, &domain));
                    continue;
                }
                Err(e) => {
                    if !std::mem::replace(&mut bucket.refused, true) {
                        metrics::counter!(names::UNMATCHED, "domain" => domain.clone()).increment(1);
                        tracing::warn!(domain = %domain, bucket = ?key, reason = %e, "RLQS: the bucket gets no assignment");
                    }
                    None
                }
            };
            let Some(assignment) = assignment else { continue };
            let kind = assignment.kind();
            metrics::counter!(names::ASSIGNMENTS, "domain" => domain.clone(), "action" => kind).increment(1);
            actions.push(action(bucket.id.clone(), assignment));
        }
        actions
    }

    /// Forgets bucket `key` (its share lapses), and the action that tells its Envoy to.
    fn abandon(&mut self, key: &[(String, String)], domain: &str) -> BucketAction {
        let mut bucket = self.buckets.remove(key).expect("the bucket abandoned is held");
        metrics::counter!(names::UNSPENT, "domain" => domain.to_string()).increment(bucket.share.close());
        metrics::counter!(names::ASSIGNMENTS, "domain" => domain.to_string(), "action" => "abandon").increment(1);
        metrics::gauge!(names::BUCKETS, "domain" => domain.to_string()).decrement(1.0);
        BucketAction {
            bucket_id: Some(bucket.id),
            bucket_action: Some(bucket_action::BucketAction::AbandonAction(AbandonAction {})),
        }
    }

    /// Shows the stream's buckets in the admin view.
    fn publish(&self) {
        let buckets: Vec<_> = self
            .buckets
            .values()
            .map(|b| serde_json::json!({ "bucket": b.id.bucket, "share": b.share, "committed": b.share.committed() }))
            .collect();
        let view = serde_json::json!({ "id": self.id, "peer": self.peer, "domain": self.domain, "buckets": buckets });
        self.state.rlqs.set(self.id, view);
    }

    /// The stream is over: its shares lapse.
    fn close(mut self) {
        self.state.rlqs.remove(self.id);
        let Some(domain) = self.domain.take() else { return };
        let unspent: u64 = self.buckets.values_mut().map(|b| b.share.close()).sum();
        metrics::counter!(names::UNSPENT, "domain" => domain.clone()).increment(unspent);
        metrics::gauge!(names::BUCKETS, "domain" => domain.clone()).decrement(self.buckets.len() as f64);
        metrics::gauge!(names::STREAMS, "domain" => domain).decrement(1.0);
    }
}

/// An assignment as Envoy's `BucketAction`.
fn action(id: BucketId, a: Assignment) -> BucketAction {
    let (strategy, ttl) = match a {
        Assignment::TokenBucket { rate, depth, ttl } => (
            Strategy::TokenBucket(TokenBucket {
                max_tokens: u32::try_from(depth).unwrap_or(u32::MAX),
                tokens_per_fill: Some(UInt32Value { value: u32::try_from(rate).unwrap_or(u32::MAX) }),
                fill_interval: Some(PbDuration { seconds: (sluice::quota::FILL / 1_000) as i64, nanos: 0 }),
            }),
            ttl,
        ),
        Assignment::DenyAll { ttl } => (Strategy::BlanketRule(BlanketRule::DenyAll as i32), ttl),
        Assignment::AllowAll { ttl } => (Strategy::BlanketRule(BlanketRule::AllowAll as i32), ttl),
    };
    BucketAction {
        bucket_id: Some(id),
        bucket_action: Some(bucket_action::BucketAction::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(PbDuration { seconds: ttl as i64, nanos: 0 }),
            rate_limit_strategy: Some(RateLimitStrategy { strategy: Some(strategy) }),
        })),
    }
}
