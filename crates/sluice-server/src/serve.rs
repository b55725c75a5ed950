//! `sluice serve`: builds the store and engine from a config and runs the HTTP API until
//! SIGINT or SIGTERM.

use crate::cli::ServeArgs;
use crate::http::{AppState, router};
use crate::load::{DEFAULT_CONFIG, Loaded, load_file, load_str};
use sluice::Limiter;
use sluice::config::{ClockKind, DEFAULT_KEY_SECRET, StoreConfig};
use sluice::store::{MemoryStore, Store};
use sluice::time::{Clock, CoarseClock, SystemClock};
use std::sync::Arc;
use std::time::Duration;

/// Runs the service. Returns an error message for a config or address that cannot be used.
pub async fn serve(args: ServeArgs) -> Result<(), String> {
    let Loaded { config, rules } = match &args.config {
        Some(path) => load_file(path),
        None => load_str(DEFAULT_CONFIG, "<built-in config>"),
    }
    .map_err(|e| e.to_string())?;
    if config.limiter.key_secret == DEFAULT_KEY_SECRET && !matches!(config.store, StoreConfig::Memory { .. }) {
        tracing::warn!("limiter.key_secret is the default: set your own so clients cannot predict their tags");
    }
    let clock: Arc<dyn Clock> = match config.limiter.clock {
        ClockKind::System => Arc::new(SystemClock),
        ClockKind::Coarse => Arc::new(CoarseClock),
    };
    let store = build_store(&config.store, clock.clone());
    let limiter = Limiter::new(Arc::new(rules), store, clock);
    let state = Arc::new(AppState { limiter, max_body_bytes: config.server.max_body_bytes });

    let addr = args.http.unwrap_or(config.server.http);
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    tracing::info!(http = %addr, store = state.limiter.store().kind(), "sluice is serving");
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown())
        .await
        .map_err(|e| format!("HTTP server failed: {e}"))?;
    tracing::info!("stopped");
    Ok(())
}

fn build_store(config: &StoreConfig, clock: Arc<dyn Clock>) -> Arc<dyn Store> {
    match *config {
        StoreConfig::Memory { max_keys } => {
            let store = Arc::new(MemoryStore::new(max_keys));
            let collector = Arc::downgrade(&store);
            // collect expired state in the background so memory follows active clients
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(10));
                loop {
                    tick.tick().await;
                    let Some(store) = collector.upgrade() else { return };
                    store.collect(clock.now());
                }
            });
            store
        }
    }
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
