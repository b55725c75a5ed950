//! `sluice serve`: builds the engine from a config and runs the HTTP API and Envoy's
//! gRPC rate limit service until SIGINT or SIGTERM.

use crate::build::{BuildError, build};
use crate::config::StoreConfig;
use crate::http::router;
use crate::load::{ConfigError, DEFAULT_CONFIG, Loaded, load_file, load_str};
use crate::rls::Rls;
use crate::state::AppState;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use sluice::config::DEFAULT_KEY_SECRET;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Config file (YAML). Without it, the built-in config (`sluice config default`).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Listen for HTTP on this address instead of `server.http`.
    #[arg(long, value_name = "ADDR")]
    pub http: Option<SocketAddr>,
    /// Listen for gRPC (Envoy's rate limit service) on this address instead of
    /// `server.grpc`.
    #[arg(long, value_name = "ADDR")]
    pub grpc: Option<SocketAddr>,
    /// Log level: error, warn, info, debug or trace.
    #[arg(long, default_value = "info", value_name = "LEVEL")]
    pub log_level: tracing::Level,
}

/// Why the service could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("metrics: {0}")]
    Metrics(#[from] metrics_exporter_prometheus::BuildError),
    #[error("HTTP server failed: {0}")]
    Http(#[source] std::io::Error),
}

/// Runs the service.
pub async fn serve(args: Args) -> Result<(), ServeError> {
    // first: rules register their counters when they are compiled
    let metrics = install_metrics()?;
    let Loaded { config, rules } = match &args.config {
        Some(path) => load_file(path)?,
        None => load_str(DEFAULT_CONFIG, "<built-in config>")?,
    };
    // what the reload watcher compares against: the bytes that gave this config
    let loaded_bytes = args.config.as_deref().and_then(crate::load::fingerprint).unwrap_or_default();
    if config.limiter.key_secret == DEFAULT_KEY_SECRET && !matches!(config.store, StoreConfig::Memory { .. }) {
        tracing::warn!("limiter.key_secret is the default: set your own so clients cannot predict their tags");
    }
    let state = Arc::new(AppState::new(build(&config, rules)?, &config.server, Some(metrics)));
    let addr = args.http.unwrap_or(config.server.http);
    let listener = listen(addr).await?;
    let grpc_addr = args.grpc.unwrap_or(config.server.grpc);
    serve_grpc(listen(grpc_addr).await?, state.clone());
    tracing::info!(http = %addr, grpc = %grpc_addr, store = state.engine.load().limiter.store().kind(), "sluice is serving");
    if let Some(path) = args.config.clone() {
        crate::reload::watch(path, config, loaded_bytes, state.clone());
    }
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown()).await.map_err(ServeError::Http)?;
    tracing::info!("stopped");
    Ok(())
}

async fn listen(addr: SocketAddr) -> Result<tokio::net::TcpListener, ServeError> {
    tokio::net::TcpListener::bind(addr).await.map_err(|source| ServeError::Listen { addr, source })
}

/// Envoy's rate limit service, on its own port, sharing the engine.
fn serve_grpc(listener: tokio::net::TcpListener, state: Arc<AppState>) {
    let rls = RateLimitServiceServer::new(Rls { state });
    tokio::spawn(async move {
        // no Nagle: a small reply held back for a delayed ACK costs every call ~40 ms
        let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        if let Err(e) = tonic::transport::Server::builder().add_service(rls).serve_with_incoming(incoming).await {
            tracing::error!(error = %e, "the gRPC server stopped");
        }
    });
}

/// Installs the Prometheus recorder that `/metrics` renders. Store latencies are
/// histograms with buckets from 0.5 ms to 1 s.
fn install_metrics() -> Result<PrometheusHandle, ServeError> {
    let buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];
    let store_calls = Matcher::Full(sluice::metric_names::STORE_CALL_SECONDS.into());
    Ok(PrometheusBuilder::new().set_buckets_for_metric(store_calls, &buckets)?.install_recorder()?)
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("shutting down: finishing requests in flight");
}
