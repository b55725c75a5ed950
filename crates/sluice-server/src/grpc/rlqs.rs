//! Envoy's Rate Limit Quota Service (RLQS),
//! `envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas`: what
//! an Envoy's `envoy.filters.http.rate_limit_quota` filter streams its usage reports to,
//! on the gRPC listener beside RLS (same port, TLS and tokens).
//!
//! Each stream is one Envoy; the filter's `domain` names the Sluice domain, and each
//! bucket id (a map) the entries of a descriptor, arranged to walk the domain's rules
//! (`Limiter::quota_target`). Each bucket's share is a [`sluice::rlqs::Share`]: on every
//! report, when its window restarts, and when the window's last piece is sent again to
//! last to the window's end ([`Share::due`]), the share takes what its next assignment may
//! admit from the shared window as a grant, then the assignment is sent. A bucket that
//! matches no limit is sent nothing (the filter's `no_assignment_behavior` stands; the
//! reason is logged once); one whose rule went away by a reload is sent an
//! `AbandonAction`. An unknown domain ends the stream with `NOT_FOUND`.

use crate::app::AppState;
use crate::app::rlqs::BucketKey;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    self, AbandonAction, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt32Value};
use sluice::rlqs::{Assignment, QuotaError, Share};
use sluice::time::Millis;
use std::collections::HashMap;
use std::sync::Arc;
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

    /// Their help texts.
    pub fn describe() {
        use metrics::{describe_counter, describe_gauge};
        describe_gauge!(STREAMS, "Envoy RLQS streams open (domain empty until a stream's first report).");
        describe_gauge!(BUCKETS, "RLQS buckets the open streams report.");
        describe_counter!(ASSIGNMENTS, "RLQS assignments sent, by action.");
        describe_counter!(REPORTS, "RLQS usage reports received.");
        describe_counter!(REPORTED, "Requests the Envoys reported deciding under their assignments, by outcome.");
        describe_counter!(GRANTED, "Units taken from the shared windows for Envoys' assignments.");
        describe_counter!(UNSPENT, "Units held for an Envoy and not reported admitted when their window ended.");
        describe_counter!(RESUMED, "RLQS buckets an Envoy brought from another stream.");
        describe_counter!(UNMATCHED, "RLQS buckets that match no single fixed-window limit.");
    }
}

/// The service.
#[derive(Clone)]
pub struct Rlqs {
    pub state: Arc<AppState>,
    /// Turns true when the server stops: every stream ends (UNAVAILABLE), so its Envoy
    /// moves to another instance.
    pub stop: tokio::sync::watch::Receiver<bool>,
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
        let peer = request.extensions().get::<crate::grpc::listen::Peer>().and_then(|p| p.addr);
        if !self.state.api_token_matches(given, "grpc", peer) {
            return Err(Status::unauthenticated("send metadata authorization: Bearer <one of server.api_tokens>"));
        }
        self.state.rlqs.open_stream(peer.map(|a| a.ip()))?;
        let (tx, rx) = mpsc::channel(16);
        let stream = Stream::new(self.state.clone(), peer, tx);
        tokio::spawn(stream.run(request.into_inner(), self.stop.clone()));
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
    peer: Option<std::net::SocketAddr>,
    domain: Option<String>,
    buckets: HashMap<BucketKey, Bucket>,
    out: Outbound,
}

/// How often a stream logs that the store failed its shares, at most.
const LOG_EVERY: Millis = 10_000;

/// The most a report counts of a bucket's requests (allowed, denied), and of its time:
/// an Envoy reports every few seconds, so more is a broken or hostile client, and
/// counted as it was it wrapped the counters and overflowed the assignment's TTL.
const MOST_REQUESTS: u64 = u32::MAX as u64;
const MOST_SECONDS: i64 = 3_600;

/// What a report says of one bucket.
struct Usage {
    key: BucketKey,
    id: BucketId,
    allowed: u64,
    denied: u64,
    elapsed: u64,
}

impl Stream {
    fn new(state: Arc<AppState>, peer: Option<std::net::SocketAddr>, out: Outbound) -> Self {
        let id = state.rlqs.next_id();
        // counted from its opening, under no domain until its first report names one
        metrics::gauge!(names::STREAMS, "domain" => "").increment(1.0);
        Self { state, id, peer, domain: None, buckets: HashMap::new(), out }
    }

    /// Serves the stream until the Envoy ends it, it breaks, or the server stops; one
    /// that sends no report within `server.header_timeout` is ended.
    async fn run(
        mut self,
        mut inbound: Streaming<RateLimitQuotaUsageReports>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let failures = sluice::time::Throttle::default();
        let first_report = tokio::time::sleep(self.state.rlqs.first_report());
        tokio::pin!(first_report);
        loop {
            let wake = self.next_due();
            let sleep = tokio::time::sleep(wake);
            let actions = tokio::select! {
                message = inbound.message() => match message {
                    Ok(Some(report)) => self.report(report, &failures).await,
                    Ok(None) => break,
                    Err(e) if e.code() == tonic::Code::Cancelled => break,
                    Err(e) => Err(Status::invalid_argument(format!("the usage report could not be read: {}", e.message()))),
                },
                _ = sleep => Ok(self.tick_due(&failures).await),
                () = &mut first_report, if self.domain.is_none() => Err(Status::deadline_exceeded(format!(
                    "no usage report within {:?} of the stream's start (server.header_timeout)",
                    self.state.rlqs.first_report()
                ))),
                _ = async { let _ = stop.wait_for(|s| *s).await; } => {
                    Err(Status::unavailable("the server is stopping; reconnect to another instance"))
                }
            };
            let actions = match actions {
                Ok(actions) => actions,
                Err(status) => {
                    let _ = self.out.send(Err(status)).await;
                    break;
                }
            };
            self.publish();
            if !actions.is_empty()
                && self.out.send(Ok(RateLimitQuotaResponse { bucket_action: actions })).await.is_err()
            {
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

    /// The stream's domain, from its first report (one stream serves one domain).
    fn take_domain(&mut self, domain: &str) -> Result<(), Status> {
        if domain.is_empty() {
            return Err(Status::invalid_argument("the usage report names no domain (the filter's `domain`)"));
        }
        match &self.domain {
            Some(d) if d != domain => Err(Status::invalid_argument(format!(
                "the stream reported for domain '{d}' and now '{}'; one stream serves one domain",
                domain.escape_debug()
            ))),
            Some(_) => Ok(()),
            None => {
                let engine = self.state.engine.load();
                // a bucket of no entries matches no rule: this only asks for the domain
                if let Err(e @ QuotaError::UnknownDomain { .. }) = engine.limiter.quota_target(domain, &[]) {
                    return Err(Status::not_found(e.to_string()));
                }
                metrics::gauge!(names::STREAMS, "domain" => "").decrement(1.0);
                metrics::gauge!(names::STREAMS, "domain" => domain.to_string()).increment(1.0);
                self.domain = Some(domain.to_string());
                Ok(())
            }
        }
    }

    /// One usage report: each bucket's share is brought up to date, and sent.
    async fn report(
        &mut self,
        report: RateLimitQuotaUsageReports,
        failures: &sluice::time::Throttle,
    ) -> Result<Vec<BucketAction>, Status> {
        self.take_domain(&report.domain)?;
        let domain = report.domain;
        metrics::counter!(names::REPORTS, "domain" => domain.clone()).increment(1);
        let usages = usages(report.bucket_quota_usages);
        // the buckets new to the stream, taken against the bounds before any work
        let mut new: Vec<&BucketKey> =
            usages.iter().map(|u| &u.key).filter(|k| !self.buckets.contains_key(*k)).collect();
        new.sort();
        new.dedup();
        self.state.rlqs.add_buckets(&domain, self.buckets.len(), &new)?;
        if !new.is_empty() {
            metrics::gauge!(names::BUCKETS, "domain" => domain.clone()).increment(new.len() as f64);
        }
        let mut keys = Vec::with_capacity(usages.len());
        for Usage { key, id, allowed, denied, elapsed } in usages {
            metrics::counter!(names::REPORTED, "domain" => domain.clone(), "outcome" => "allowed").increment(allowed);
            metrics::counter!(names::REPORTED, "domain" => domain.clone(), "outcome" => "denied").increment(denied);
            let bucket = self.buckets.entry(key.clone()).or_insert_with(|| {
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
            if self.out.is_closed() {
                // the Envoy is gone: nothing it would read is worth a store call
                break;
            }
            let peers = self.state.rlqs.contenders(&domain, key);
            let Some(bucket) = self.buckets.get_mut(key) else { continue };
            bucket.share.set_peers(peers);
            let contended = bucket.share.contends();
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
            self.state.rlqs.contends(&domain, key, contended, bucket.share.contends());
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
        self.state.rlqs.remove_bucket(domain, key, bucket.share.contends());
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
        let peer = self.peer.map(|p| p.to_string()).unwrap_or_default();
        let view = serde_json::json!({ "id": self.id, "peer": peer, "domain": self.domain, "buckets": buckets });
        self.state.rlqs.set(self.id, view);
    }

    /// The stream is over: its shares lapse.
    fn close(mut self) {
        self.state.rlqs.remove(self.id);
        self.state.rlqs.close_stream(self.peer.map(|p| p.ip()));
        let Some(domain) = self.domain.take() else {
            metrics::gauge!(names::STREAMS, "domain" => "").decrement(1.0);
            return;
        };
        for (key, bucket) in &self.buckets {
            self.state.rlqs.remove_bucket(&domain, key, bucket.share.contends());
        }
        let unspent: u64 = self.buckets.values_mut().map(|b| b.share.close()).sum();
        metrics::counter!(names::UNSPENT, "domain" => domain.clone()).increment(unspent);
        metrics::gauge!(names::BUCKETS, "domain" => domain.clone()).decrement(self.buckets.len() as f64);
        metrics::gauge!(names::STREAMS, "domain" => domain).decrement(1.0);
    }
}

/// What a report says of each bucket it names, its counts and time capped.
fn usages(reported: Vec<BucketQuotaUsage>) -> Vec<Usage> {
    reported
        .into_iter()
        .filter_map(|usage| {
            let id = usage.bucket_id.filter(|b| !b.bucket.is_empty())?;
            let mut key: BucketKey = id.bucket.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            key.sort();
            let elapsed = usage.time_elapsed.map_or(0, |d| d.seconds.clamp(0, MOST_SECONDS) as u64);
            let (allowed, denied) =
                (usage.num_requests_allowed.min(MOST_REQUESTS), usage.num_requests_denied.min(MOST_REQUESTS));
            Some(Usage { key, id, allowed, denied, elapsed })
        })
        .collect()
}

/// An assignment as Envoy's `BucketAction`.
fn action(id: BucketId, a: Assignment) -> BucketAction {
    let (strategy, ttl) = match a {
        Assignment::TokenBucket { rate, depth, ttl } => (
            Strategy::TokenBucket(TokenBucket {
                max_tokens: u32::try_from(depth).unwrap_or(u32::MAX),
                tokens_per_fill: Some(UInt32Value { value: u32::try_from(rate).unwrap_or(u32::MAX) }),
                fill_interval: Some(PbDuration { seconds: (sluice::rlqs::FILL / 1_000) as i64, nanos: 0 }),
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
