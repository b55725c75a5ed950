//! The xDS client of the rules (`xds:` in the config; envoyproxy/ratelimit's
//! `CONFIG_TYPE=GRPC_XDS_SOTW`): one Aggregated Discovery Service stream to the
//! management server, state of the world, subscribed to every `RateLimitConfig`
//! resource for this node, as Envoy Gateway serves them.
//!
//! The protocol, as Envoy follows it: the first request names the node (and the version
//! held, after a reconnect); each response is the whole set of resources. A set that
//! reads and compiles is put in force for the next decision and ACKed (a request with
//! the response's version and nonce). One that does not is NACKed (the version in force
//! and the response's nonce, with an `error_detail` naming the resource and the problem)
//! and the rules in force stay. A lost stream is opened again after a wait that starts
//! at `xds.retry`, doubles up to `xds.max_retry`, is jittered, and starts over once a
//! stream delivered; the rules in force stay meanwhile.
//!
//! Before the first push the rules in force are pending (`Rules::pending`, set by
//! `config::load`): every decision is refused `NoRules`, which gRPC answers
//! `UNAVAILABLE` (service.rs) and HTTP 503; the instance is not ready unless
//! `xds.start_without_config`.

pub mod proto;

use crate::app::AppState;
use crate::app::build;
use crate::config::XdsConfig;
use crate::config::load::with_domains;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::protobuf::{Struct, Value as PbValue, value::Kind};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use std::sync::Arc;
use std::time::Duration;

/// Pushes answered, by result: `ok` (in force, ACKed) or `refused` (NACKed).
pub const PUSHES: &str = "sluice_xds_pushes_total";
/// Streams that sent nothing within `xds.initial_fetch_timeout`, before any push.
pub const FETCH_TIMEOUTS: &str = "sluice_xds_initial_fetch_timeouts_total";

/// Describes the client's metrics (the stream's state is rendered by
/// [`crate::app::xds::XdsState::exposition`]).
pub fn describe_metrics() {
    metrics::describe_counter!(PUSHES, "xDS pushes of rules, by result: ok (in force, ACKed) or refused (NACKed).");
    metrics::describe_counter!(
        FETCH_TIMEOUTS,
        "xDS streams that sent no push within xds.initial_fetch_timeout, before the first push (opened again)."
    );
    metrics::describe_counter!(
        crate::app::xds::WITHOUT_RULES,
        "Calls answered without a decision because no rules were pushed yet (gRPC UNAVAILABLE, HTTP 503)."
    );
}

/// How long connecting to the management server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs the client until the process ends.
pub fn start(config: XdsConfig, state: Arc<AppState>) {
    tokio::spawn(async move {
        let pushes = metrics::counter!(PUSHES, "result" => "ok");
        let refused = metrics::counter!(PUSHES, "result" => "refused");
        let mut wait = config.retry.to_std();
        let mut version = String::new();
        loop {
            let mut delivered = false;
            let ended = session(&config, &state, &mut version, &mut |ok| {
                delivered = true;
                if ok { pushes.increment(1) } else { refused.increment(1) }
            })
            .await;
            if delivered {
                wait = config.retry.to_std();
            }
            let error = ended.err().unwrap_or_else(|| "the server ended the stream".into());
            tracing::warn!(server = %config.server, %error, retry_in = ?wait, "xDS stream lost; the rules in force stay");
            tokio::time::sleep(jittered(wait)).await;
            wait = (wait * 2).min(config.max_retry.to_std());
        }
    });
}

/// `wait`, between half and the whole of it, so a fleet does not reconnect at once.
fn jittered(wait: Duration) -> Duration {
    let mut b = [0u8; 2];
    let _ = getrandom::fill(&mut b);
    wait.mul_f64(0.5 + f64::from(u16::from_le_bytes(b)) / f64::from(u16::MAX) / 2.0)
}

/// One stream: connects, subscribes, and answers every response until the stream ends.
/// `version` is the version in force, kept across streams; `answered` hears each push,
/// put in force or refused.
async fn session(
    config: &XdsConfig,
    state: &AppState,
    version: &mut String,
    answered: &mut (dyn FnMut(bool) + Send),
) -> Result<(), String> {
    let channel = channel(config).await?;
    let mut client = AggregatedDiscoveryServiceClient::new(channel).max_decoding_message_size(config.max_message_bytes);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<DiscoveryRequest>(4);
    let first = DiscoveryRequest {
        version_info: version.clone(),
        node: Some(node(config)),
        type_url: proto::TYPE_URL.into(),
        ..Default::default()
    };
    tx.send(first).await.map_err(|e| e.to_string())?;
    let outgoing = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
    let mut request = tonic::Request::new(outgoing);
    for (key, value) in config.metadata()? {
        request.metadata_mut().insert(key, value);
    }
    let mut responses = client.stream_aggregated_resources(request).await.map_err(status)?.into_inner();
    tracing::info!(server = %config.server, node = %config.node_id, "xDS stream open");
    let xds = state.xds.as_ref();
    if let Some(x) = xds {
        x.set_connected(true);
    }
    let _closed = Disconnected(xds);
    let mut next = first_response(config, xds.is_some_and(|x| !x.loaded()), &mut responses).await?;
    while let Some(response) = next {
        let answer = match apply(state, &response).await {
            Ok(()) => {
                *version = response.version_info.clone();
                answered(true);
                None
            }
            Err(e) => {
                // a deep or wide push's reason can be kilobytes: the NACK and the log quote a part
                let e = crate::config::load::excerpt(&e).into_owned();
                tracing::error!(version = %response.version_info, error = %e, "xDS push refused (NACK); the rules in force stay");
                answered(false);
                Some(RpcStatus { code: tonic::Code::InvalidArgument as i32, message: e, details: vec![] })
            }
        };
        let ack = DiscoveryRequest {
            version_info: version.clone(),
            response_nonce: response.nonce,
            type_url: proto::TYPE_URL.into(),
            error_detail: answer,
            ..Default::default()
        };
        tx.send(ack).await.map_err(|e| e.to_string())?;
        next = responses.message().await.map_err(status)?;
    }
    Ok(())
}

/// The stream's first response; before the first push (`initial`), a server silent past
/// `xds.initial_fetch_timeout` ends the stream with why.
async fn first_response(
    config: &XdsConfig,
    initial: bool,
    responses: &mut tonic::Streaming<DiscoveryResponse>,
) -> Result<Option<DiscoveryResponse>, String> {
    let limit = config.initial_fetch_timeout.to_std();
    if !initial || limit.is_zero() {
        return responses.message().await.map_err(status);
    }
    match tokio::time::timeout(limit, responses.message()).await {
        Ok(first) => first.map_err(status),
        Err(_) => Err(silent(config)),
    }
}

/// Says the stream is closed when dropped, however the session ends.
struct Disconnected<'a>(Option<&'a Arc<crate::app::xds::XdsState>>);

impl Drop for Disconnected<'_> {
    fn drop(&mut self) {
        if let Some(x) = self.0 {
            x.set_connected(false);
        }
    }
}

/// A stream silent past `xds.initial_fetch_timeout` before any push: counted, and why it
/// is usually so.
fn silent(config: &XdsConfig) -> String {
    metrics::counter!(FETCH_TIMEOUTS).increment(1);
    format!(
        "the server accepted the stream but sent no rules within {} (xds.initial_fetch_timeout): a management server \
         answers nothing to a node it has no configuration for (check that xds.node_id, `{}`, is the one it serves; \
         Envoy Gateway's is envoy-ratelimit), or it has no rate limit configuration yet",
        config.initial_fetch_timeout, config.node_id
    )
}

fn status(s: tonic::Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

/// This instance as a node: its id and metadata.
fn node(config: &XdsConfig) -> Node {
    let string = |v: &String| PbValue { kind: Some(Kind::StringValue(v.clone())) };
    let fields = config.node_metadata.iter().map(|(k, v)| (k.clone(), string(v))).collect();
    Node { id: config.node_id.clone(), metadata: Some(Struct { fields }), ..Default::default() }
}

/// Reads a response's resources and puts their rules in force, or says why not.
async fn apply(state: &AppState, response: &DiscoveryResponse) -> Result<(), String> {
    if response.type_url != proto::TYPE_URL {
        return Err(format!(
            "type_url {} is not {}: the only type this client asks for",
            response.type_url,
            proto::TYPE_URL
        ));
    }
    let mut domains = Vec::with_capacity(response.resources.len());
    for (i, any) in response.resources.iter().enumerate() {
        if any.type_url != proto::TYPE_URL {
            return Err(format!("resource {i}: type_url {} is not {}", any.type_url, proto::TYPE_URL));
        }
        let c = proto::decode(any.value.as_slice()).map_err(|e| format!("resource {i}: {e}"))?;
        let name = if c.name.is_empty() { format!("resource {i}") } else { format!("RateLimitConfig '{}'", c.name) };
        let domain = c.domain().map_err(|e| format!("{name} (domain '{}'): {e}", c.domain))?;
        domains.push((name, domain));
    }
    let Some(xds) = &state.xds else { return Err("xDS is not configured".into()) };
    let mut pushed = xds.turn.lock().await;
    let (domains, rules) = with_domains(&pushed, domains).map_err(|e| e.to_string())?;
    let names: Vec<String> = domains.iter().map(|d| d.domain.0.clone()).collect();
    let mut config = pushed.clone();
    config.domains = domains;
    let current = state.engine.load();
    let store = current.limiter.store().clone();
    let next = build::engine(&config, rules, store, build::clock(&config.limiter), Some(&current.limiter));
    state.engine.store(Arc::new(next));
    *pushed = config;
    xds.pushed(&response.version_info);
    if names.is_empty() {
        tracing::warn!(version = %response.version_info, "xDS push in force: no domain (every request is for an unknown domain)");
    } else {
        let (count, digest) = (names.len(), digest(&names));
        tracing::info!(version = %response.version_info, domains = count, digest = %digest, first = %names.iter().take(FIRST_NAMES).cloned().collect::<Vec<_>>().join(", "), "xDS push in force");
    }
    Ok(())
}

/// How many domain names a push's log line shows (the count and digest stand for all).
const FIRST_NAMES: usize = 5;

/// A short digest of a push's domain names, the same on every instance that holds the
/// same set (compare instances by it; a 10,000-domain push's names were 69 KB a line).
fn digest(names: &[String]) -> String {
    let mut sorted: Vec<&String> = names.iter().collect();
    sorted.sort();
    // FNV-1a, 64 bits: stable across builds and processes, unlike the std hasher
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in sorted.iter().flat_map(|n| n.bytes().chain([0])) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// A channel to the management server, over TLS when `xds.tls` is set.
async fn channel(config: &XdsConfig) -> Result<tonic::transport::Channel, String> {
    // http even under TLS: the connector below speaks TLS, tonic sees a stream
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", config.server))
        .map_err(|e| format!("xds.server {}: {e}", config.server))?
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10));
    let connected = match &config.tls {
        None => endpoint.connect().await,
        Some(tls) => {
            let host = config.server.rsplit_once(':').map_or(config.server.as_str(), |(h, _)| h);
            let name = tls
                .server_name
                .clone()
                .unwrap_or_else(|| host.trim_start_matches('[').trim_end_matches(']').to_string());
            let connector = crate::tls::client_connector(tls, &name).map_err(|e| format!("xds.tls: {e}"))?;
            endpoint.connect_with_connector(connector).await
        }
    };
    connected.map_err(|e| format!("cannot connect to {}: {e}", config.server))
}
