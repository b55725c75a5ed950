//! `sluice serve`: builds the store and engine from a config and runs the HTTP API until
//! SIGINT or SIGTERM.

use crate::cli::ServeArgs;
use crate::http::{AppState, router};
use crate::load::{DEFAULT_CONFIG, Loaded, load_file, load_str};
use crate::rls::Rls;
use arc_swap::{ArcSwap, ArcSwapOption};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use sluice::Limiter;
use sluice::config::{
    ClockKind, Config, DEFAULT_KEY_SECRET, LimiterConfig, RedisConnectionConfig, StoreConfig, TlsConfig,
};
use sluice::rules::Rules;
use sluice::store::redis::{RedisOptions, RedisStore, ShardedRedisStore, Tls};
use sluice::store::{MemcachedStore, MemoryStore, MigratingStore, Resilience, Resilient, Store, StoreError};
use sluice::telemetry;
use sluice::time::{Clock, CoarseClock, SystemClock};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Runs the service. Returns an error message for a config or address that cannot be used.
pub async fn serve(args: ServeArgs) -> Result<(), String> {
    // first: rules register their counters when they are compiled
    let metrics = install_metrics()?;
    let Loaded { config, rules } = match &args.config {
        Some(path) => load_file(path),
        None => load_str(DEFAULT_CONFIG, "<built-in config>"),
    }
    .map_err(|e| e.to_string())?;
    // what the reload watcher compares against: the bytes that gave this config
    let loaded_bytes = match &args.config {
        Some(path) => crate::load::fingerprint(path).unwrap_or_default(),
        None => Vec::new(),
    };
    if config.limiter.key_secret == DEFAULT_KEY_SECRET && !matches!(config.store, StoreConfig::Memory { .. }) {
        tracing::warn!("limiter.key_secret is the default: set your own so clients cannot predict their tags");
    }
    let (limiter, migration) = build_limiter(&config, rules)?;
    let state = Arc::new(AppState {
        limiter: ArcSwap::from_pointee(limiter),
        migration: ArcSwapOption::new(migration),
        admin_token: config.server.admin_token.clone(),
        max_body_bytes: config.server.max_body_bytes,
        metrics: Some(metrics),
    });

    let addr = args.http.unwrap_or(config.server.http);
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    // Envoy's rate limit service, on its own port, sharing the engine
    let grpc_addr = args.grpc.unwrap_or(config.server.grpc);
    let grpc_listener =
        tokio::net::TcpListener::bind(grpc_addr).await.map_err(|e| format!("cannot listen on {grpc_addr}: {e}"))?;
    let rls = RateLimitServiceServer::new(Rls { state: state.clone() });
    tokio::spawn(async move {
        // no Nagle: a small reply held back for a delayed ACK costs every call ~40 ms
        let incoming = tonic::transport::server::TcpIncoming::from(grpc_listener).with_nodelay(Some(true));
        if let Err(e) = tonic::transport::Server::builder().add_service(rls).serve_with_incoming(incoming).await {
            tracing::error!(error = %e, "the gRPC server stopped");
        }
    });
    tracing::info!(http = %addr, grpc = %grpc_addr, store = state.limiter.load().store().kind(), "sluice is serving");
    if let Some(path) = args.config.clone() {
        crate::reload::watch(path, config, loaded_bytes, state.clone());
    }
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown())
        .await
        .map_err(|e| format!("HTTP server failed: {e}"))?;
    tracing::info!("stopped");
    Ok(())
}

/// The engine a config describes: its clock, its store (remote stores behind the
/// deadline and breaker, with the near-cache), its rules; and the migrating store's
/// handle, when the store is one.
pub fn build_limiter(config: &Config, rules: Rules) -> Result<(Limiter, Option<Arc<MigratingStore>>), String> {
    check_store_supports(&config.store, &rules)?;
    let clock: Arc<dyn Clock> = match config.limiter.clock {
        ClockKind::System => Arc::new(SystemClock),
        ClockKind::Coarse => Arc::new(CoarseClock),
    };
    let mut migration = None;
    let store = build_store(&config.store, &config.limiter, clock.clone(), &mut migration)?;
    let remote = !matches!(config.store, StoreConfig::Memory { .. });
    let mut limiter = Limiter::new(Arc::new(rules), store, clock);
    if remote && config.limiter.near_cache > 0 {
        limiter = limiter.with_near_cache(config.limiter.near_cache);
    }
    Ok((limiter, migration))
}

/// Memcached runs fixed windows only: a config that asks it for more is refused when it
/// is loaded, not when the first request fails.
fn check_store_supports(store: &StoreConfig, rules: &Rules) -> Result<(), String> {
    match store {
        StoreConfig::Memcached { .. } => {
            let other: Vec<&str> = rules.algorithms().into_iter().filter(|a| *a != "fixed_window").collect();
            if other.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "store memcached runs fixed windows only, but the rules use {}: use a redis store",
                    other.join(", ")
                ))
            }
        }
        StoreConfig::Migrating { from, to, .. } => {
            check_store_supports(from, rules)?;
            check_store_supports(to, rules)
        }
        _ => Ok(()),
    }
}

fn build_store(
    config: &StoreConfig,
    limiter: &LimiterConfig,
    clock: Arc<dyn Clock>,
    migration: &mut Option<Arc<MigratingStore>>,
) -> Result<Arc<dyn Store>, String> {
    let resilience = Resilience {
        deadline: Duration::from_millis(limiter.deadline.0),
        failures: limiter.breaker_failures.max(1),
        cooldown: Duration::from_millis(limiter.breaker_cooldown.0),
    };
    let options = |c: &RedisConnectionConfig| -> Result<RedisOptions, String> {
        Ok(RedisOptions {
            timeout: Duration::from_millis(c.timeout.0),
            replica_acks: c.replica_acks,
            tls: tls(c.tls.as_ref())?,
            buckets: c.buckets.0,
            ..RedisOptions::default()
        })
    };
    let redis_error = |e: StoreError| format!("store: {e}");

    Ok(match config {
        &StoreConfig::Memory { max_keys } => {
            let store = Arc::new(MemoryStore::new(max_keys));
            let collector = Arc::downgrade(&store);
            // collect expired state in the background so memory follows active clients
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(5));
                loop {
                    tick.tick().await;
                    let Some(store) = collector.upgrade() else { return };
                    store.collect(clock.now());
                    let stats = store.stats();
                    telemetry::memory_store(
                        store.len(),
                        stats.collected.load(Ordering::Relaxed),
                        stats.evicted_live.load(Ordering::Relaxed),
                    );
                }
            });
            store
        }
        StoreConfig::Redis { url, replicas, connection } => {
            let store = RedisStore::new(url, replicas, options(connection)?).map_err(redis_error)?;
            Arc::new(Resilient::new(store, resilience))
        }
        StoreConfig::RedisCluster { nodes, read_from_replicas, timeout, retries, tls: files, buckets: n } => {
            let options = RedisOptions {
                timeout: Duration::from_millis(timeout.0),
                cluster_retries: *retries,
                tls: tls(files.as_ref())?,
                buckets: n.0,
                ..RedisOptions::default()
            };
            let store = RedisStore::cluster(nodes, *read_from_replicas, options).map_err(redis_error)?;
            Arc::new(Resilient::new(store, resilience))
        }
        StoreConfig::Memcached { servers, timeout } => {
            let store = MemcachedStore::new(servers, Duration::from_millis(timeout.0)).map_err(redis_error)?;
            Arc::new(Resilient::new(store, resilience))
        }
        StoreConfig::Migrating { from, to, percent } => {
            if *percent > 100 {
                return Err(format!("store.percent is {percent}; write 0 to 100"));
            }
            let from = build_store(from, limiter, clock.clone(), &mut None)?;
            let to = build_store(to, limiter, clock, &mut None)?;
            let store = Arc::new(MigratingStore::new(from, to, *percent));
            *migration = Some(store.clone());
            store
        }
        StoreConfig::RedisSharded { shards, connection } => {
            if shards.is_empty() {
                return Err("store.shards is empty: list at least one {primary, replicas}".into());
            }
            let shards = shards
                .iter()
                .map(|s| RedisStore::new(&s.primary, &s.replicas, options(connection)?).map_err(redis_error))
                .collect::<Result<Vec<_>, String>>()?;
            Arc::new(Resilient::new(ShardedRedisStore::new(shards), resilience))
        }
    })
}

/// Reads the TLS files a store names.
fn tls(files: Option<&TlsConfig>) -> Result<Option<Tls>, String> {
    let Some(f) = files else { return Ok(None) };
    let read = |what: &str, p: &std::path::Path| {
        std::fs::read(p).map_err(|e| format!("cannot read store tls.{what} {}: {e}", p.display()))
    };
    let ca = f.ca_file.as_deref().map(|p| read("ca_file", p)).transpose()?;
    let client = match (&f.cert_file, &f.key_file) {
        (Some(c), Some(k)) => Some((read("cert_file", c)?, read("key_file", k)?)),
        (None, None) => None,
        _ => return Err("store tls: give both cert_file and key_file, or neither".into()),
    };
    Ok(Some(Tls { ca, client }))
}

/// Installs the Prometheus recorder that `/metrics` renders. Store latencies are
/// histograms with buckets from 0.5 ms to 1 s.
fn install_metrics() -> Result<PrometheusHandle, String> {
    let buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(telemetry::names::STORE_CALL_SECONDS.into()), &buckets)
        .map_err(|e| format!("metrics: {e}"))?
        .install_recorder()
        .map_err(|e| format!("metrics: {e}"))
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
