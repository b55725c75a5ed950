//! Hot reload: the config file is read again when it changes, and the new rules take
//! effect for the next request.
//!
//! The file (and the domain files of its `domains_from` directory) is polled (every
//! 500 ms, following symlinks) and reloaded when its bytes change. Polling sees the three ways configs change in the same way: an edit in place,
//! a new file renamed over the old one, and a symlink swapped to another target (how
//! Kubernetes updates a mounted ConfigMap), where file-event APIs are easy to get wrong.
//! A file that does not validate is refused: the last good config stays, the error is
//! logged with file:line:col and counted. A changed `store:` section builds a new store;
//! requests in flight finish on the engine they started with, so none is dropped.

use crate::http::AppState;
use crate::load::{fingerprint, load_file};
use crate::serve::build_limiter;
use sluice::config::{Config, StoreConfig};
use sluice::telemetry::names;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How often the file is looked at.
const POLL: Duration = Duration::from_millis(500);

/// Watches `path` (already loaded as `config` from `bytes`) until the process ends.
pub fn watch(path: PathBuf, mut config: Config, mut bytes: Vec<u8>, state: Arc<AppState>) {
    let ok = metrics::counter!(names::CONFIG_RELOADS, "result" => "ok");
    let failed = metrics::counter!(names::CONFIG_RELOADS, "result" => "failed");
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(POLL);
        loop {
            tick.tick().await;
            // a file between writes, or a symlink mid-swap, is just looked at again later
            let Some(now) = fingerprint(&path) else { continue };
            if now == bytes {
                continue;
            }
            bytes = now;
            let loaded = match load_file(&path) {
                Ok(l) => l,
                Err(e) => {
                    failed.increment(1);
                    tracing::error!(error = %e, "config reload refused; the last good config stays");
                    continue;
                }
            };
            let next = if same_but_percent(&loaded.config.store, &config.store) {
                // the same store, perhaps another migration percentage: no reconnect
                if let (StoreConfig::Migrating { percent, .. }, Some(m)) =
                    (&loaded.config.store, &*state.migration.load())
                {
                    if *percent != m.percent() {
                        tracing::info!(from = m.percent(), to = percent, "config reload: migration percentage changed");
                    }
                    m.set_percent(*percent);
                }
                state.limiter.load().with_rules(Arc::new(loaded.rules))
            } else {
                match build_limiter(&loaded.config, loaded.rules) {
                    Ok((l, migration)) => {
                        tracing::info!("config reload: store changed, new store connected");
                        state.migration.store(migration);
                        l
                    }
                    Err(e) => {
                        failed.increment(1);
                        tracing::error!(error = %e, "config reload refused: the new store cannot be built");
                        continue;
                    }
                }
            };
            if loaded.config.server.http != config.server.http || loaded.config.server.grpc != config.server.grpc {
                tracing::warn!("config reload: server addresses changed; restart to listen on them");
            }
            state.limiter.store(Arc::new(next));
            config = loaded.config;
            ok.increment(1);
            tracing::info!(file = %path.display(), "config reloaded");
        }
    });
}

/// Whether two store configs are the same store (a migrating store's percentage aside).
fn same_but_percent(a: &StoreConfig, b: &StoreConfig) -> bool {
    match (a, b) {
        (StoreConfig::Migrating { from: f1, to: t1, .. }, StoreConfig::Migrating { from: f2, to: t2, .. }) => {
            f1 == f2 && t1 == t2
        }
        _ => a == b,
    }
}
