//! Hot reload: the config file is read again when it changes, and every section takes
//! effect for the next request, or the whole file is refused.
//!
//! The file (and the domain files of its `domains_from` directory) is polled (every
//! 500 ms, following symlinks) and reloaded when its bytes change and have stayed so for
//! a moment (a file being written is read once it is whole), and on SIGHUP. Polling sees
//! the three ways configs change in the same way: an edit in place, a new file renamed
//! over the old one, and a symlink swapped to another target (how Kubernetes updates a
//! mounted ConfigMap), where file-event APIs are easy to get wrong.
//!
//! What a reload does with each section:
//! - `domains`, `domains_from`, `headers`: new rules, in force for the next request;
//! - `limiter`: the deadline and breaker are retuned on the running store; the clock, the
//!   near-cache and the rule settings (`key_secret`, `failure`, `shadow_mode`,
//!   `near_limit_ratio`) come with the new engine;
//! - `store`: a changed store is built and connected (requests in flight finish on the
//!   engine they started with); a changed migration percentage alone moves clients live;
//! - `server`: listeners and tokens need a restart; a reload that changes them says so.
//!
//! A file that does not validate, or whose rules the store cannot run, is refused whole:
//! the last good config stays, and the error is logged (with file:line:col) and counted.

use crate::build::{self, BuildError};
use crate::config::{Config, StoreConfig};
use crate::load::{ConfigError, Loaded, fingerprint, load_file};
use crate::state::AppState;
use sluice::metric_names as names;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// How often the file is looked at.
const POLL: Duration = Duration::from_millis(500);

/// Why a changed config was not put in force.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
}

/// How long a changed file must stay unchanged before it is read: an editor that
/// truncates a file and then writes it, or a copy in progress, is read once it is whole.
const SETTLE: Duration = Duration::from_millis(250);

/// Watches `path` (already loaded as `config` from `bytes`, as [`watched`] saw them) until the process ends, and
/// reloads it when it changes, when one of its `server.tls` files changes (a rotated
/// certificate), or when the process gets SIGHUP (as nginx, Prometheus and HAProxy do).
/// Without a path (the built-in config) SIGHUP is logged and ignored.
pub fn watch(path: Option<PathBuf>, mut config: Config, mut bytes: Vec<u8>, state: Arc<AppState>) {
    let ok = metrics::counter!(names::CONFIG_RELOADS, "result" => "ok");
    let failed = metrics::counter!(names::CONFIG_RELOADS, "result" => "failed");
    let mut hangups = hangups();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(POLL);
        loop {
            let hangup = tokio::select! {
                _ = tick.tick() => false,
                Some(()) = hangups.recv() => true,
            };
            let Some(path) = &path else {
                if hangup {
                    tracing::info!("SIGHUP: no config file to reload (serving the built-in config)");
                }
                continue;
            };
            // a file between writes, or a symlink mid-swap, is just looked at again later
            let Some(now) = watched(path, &config) else { continue };
            if hangup {
                tracing::info!(file = %path.display(), "SIGHUP: reloading the config");
            } else if now == bytes || !settled(|| watched(path, &config), &now).await {
                continue;
            }
            bytes = now;
            match reload(path, &config, &state) {
                Ok(next) => {
                    config = next;
                    ok.increment(1);
                }
                Err(e) => {
                    failed.increment(1);
                    tracing::error!(error = %e, "config reload refused; the last good config stays");
                }
            }
        }
    });
}

/// Whether the files still read `seen` after [`SETTLE`].
async fn settled(look: impl Fn() -> Option<Vec<u8>>, seen: &[u8]) -> bool {
    tokio::time::sleep(SETTLE).await;
    look().is_some_and(|again| again == seen)
}

/// What the watcher compares: the config file's bytes, then those of its `server.tls`
/// files (those that can be read), so that a certificate rotated on disk counts as a
/// change. None while the config file cannot be read.
pub fn watched(path: &Path, config: &Config) -> Option<Vec<u8>> {
    let mut bytes = fingerprint(path)?;
    if let Some(tls) = &config.server.tls {
        let files = [Some(&tls.cert_file), Some(&tls.key_file), tls.client_ca_file.as_ref()];
        bytes.extend(files.into_iter().flatten().filter_map(|f| std::fs::read(f).ok()).flatten());
    }
    Some(bytes)
}

/// SIGHUPs, as a channel. Registering the handler also stops SIGHUP from killing the
/// process, which is its default action.
fn hangups() -> tokio::sync::mpsc::Receiver<()> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    #[cfg(unix)]
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(mut hup) => {
            tokio::spawn(async move {
                while hup.recv().await.is_some() {
                    // one pending reload is enough: later SIGHUPs fold into it
                    let _ = tx.try_send(());
                }
            });
        }
        Err(e) => tracing::warn!(error = %e, "cannot listen for SIGHUP; reload by editing the file"),
    }
    #[cfg(not(unix))]
    drop(tx);
    rx
}

/// Loads `path` and puts every section in force, or none. Returns the config now in
/// force.
fn reload(path: &Path, current: &Config, state: &AppState) -> Result<Config, ReloadError> {
    let Loaded { config, rules } = load_file(path)?;
    let mut applied = vec!["rules (domains, headers)"];
    // read now, put in force last: a reload is applied whole or not at all
    let tls = match (&state.tls, &config.server.tls) {
        (Some(tls), Some(files)) => Some((tls, crate::tls::Tls::read(files)?)),
        _ => None,
    };
    if same_store(&config.store, &current.store) {
        build::supports(&config.store, &rules)?;
        if let (StoreConfig::Migrating { percent, .. }, Some(m)) = (&config.store, &*state.migration.load()) {
            if *percent != m.percent() {
                tracing::info!(from = m.percent(), to = percent, "config reload: migration percentage changed");
                applied.push("store.percent");
            }
            m.set_percent(*percent);
        }
        // the same store, retuned and under new rules: no reconnect, no state lost
        state.tuning.load().set(build::resilience(&config.limiter));
        let current = state.engine.load();
        let store = current.limiter.store().clone();
        let next = build::engine(&config, rules, store, build::clock(&config.limiter), Some(&current.limiter));
        state.engine.store(Arc::new(next));
    } else {
        // the grants held on the old store go back to it
        let old = state.engine.load_full();
        tokio::spawn(async move {
            let _ = old.limiter.return_grants().await;
        });
        state.install(build::build(&config, rules)?);
        applied.push("store (a new store, connected)");
    }
    if config.limiter != current.limiter {
        applied.push("limiter");
    }
    let dropped: Vec<&str> = current
        .domains
        .iter()
        .map(|d| d.domain.0.as_str())
        .filter(|name| !config.domains.iter().any(|d| d.domain.0 == *name))
        .collect();
    if !dropped.is_empty() {
        tracing::warn!(domains = %dropped.join(", "), "config reload: these domains are gone; their requests now get 400 unknown domain");
    }
    if let Some((tls, read)) = tls {
        tls.install(read);
        applied.push("server.tls (files read again)");
    }
    if crate::logs::reconfigure(&current.log, &config.log) {
        applied.push("log.level");
    }
    let restart = needs_restart(&config, current);
    if !restart.is_empty() {
        tracing::warn!(keys = %restart.join(", "), "config reload: these settings need a restart to take effect");
    }
    tracing::info!(file = %path.display(), applied = %applied.join(", "), "config reloaded");
    Ok(config)
}

/// The keys set up once, at start, that differ: the listeners, their bounds and the
/// tokens, the log's format, the tracer.
fn needs_restart(new_config: &Config, old_config: &Config) -> Vec<&'static str> {
    let (new, old) = (&new_config.server, &old_config.server);
    let mut keys = Vec::new();
    for (key, changed) in [
        ("log.format", new_config.log.format != old_config.log.format),
        ("telemetry", new_config.telemetry != old_config.telemetry),
        ("server.http", new.http != old.http),
        ("server.grpc", new.grpc != old.grpc),
        ("server.max_body_bytes", new.max_body_bytes != old.max_body_bytes),
        ("server.admin_token", new.admin_token != old.admin_token),
        ("server.api_tokens", new.api_tokens != old.api_tokens),
        ("server.header_timeout", new.header_timeout != old.header_timeout),
        ("server.body_timeout", new.body_timeout != old.body_timeout),
        ("server.max_connections", new.max_connections != old.max_connections),
        ("server.grpc_idle_timeout", new.grpc_idle_timeout != old.grpc_idle_timeout),
        ("server.shutdown_grace", new.shutdown_grace != old.shutdown_grace),
        ("server.tls (on or off)", new.tls.is_some() != old.tls.is_some()),
    ] {
        if changed {
            keys.push(key);
        }
    }
    keys
}

/// Whether two store configs are the same store (a migrating store's percentage aside).
fn same_store(a: &StoreConfig, b: &StoreConfig) -> bool {
    match (a, b) {
        (StoreConfig::Migrating { from: f1, to: t1, .. }, StoreConfig::Migrating { from: f2, to: t2, .. }) => {
            f1 == f2 && t1 == t2
        }
        _ => a == b,
    }
}
