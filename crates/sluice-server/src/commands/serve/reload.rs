//! Hot reload: the config file is read again when it changes, and every section takes
//! effect for the next request, or the whole file is refused.
//!
//! Every 500 ms the watcher looks at the metadata of each file the config is made of
//! (the file, the domain files of its `domains_from` directory, its `server.tls` files
//! and secret files; following symlinks): device, inode, size, modification and change
//! times, a `stat` each whatever their size, on a blocking thread (a hung file system
//! holds that thread, not a runtime worker). Only when those moved, and stayed so for a
//! moment (a file being written is read once it is whole), are the files read, and only
//! when their bytes differ from what is in force is the config parsed and reloaded;
//! SIGHUP reloads at once. (It read and parsed the whole file every poll before: 13% of a core idle at
//! 1.1 MB, all of it at 11 MB.) Looking at metadata sees the three ways configs change
//! alike: an edit in place, a new file renamed over the old one, and a symlink swapped
//! to another target (how Kubernetes updates a mounted ConfigMap), where file-event
//! APIs are easy to get wrong.
//!
//! A config file that cannot be read (deleted, unreadable, a directory, a symlink loop)
//! is logged and counted as a failed reload once each time that changes, and on every
//! SIGHUP, so `SluiceReloadFailed` fires; the last good config keeps serving.
//!
//! What a reload does with each section:
//! - `domains`, `domains_from`, `headers`: new rules, in force for the next request;
//! - `limiter`: the deadline and breaker are retuned on the running store; the clock, the
//!   near-cache and the rule settings (`failure`, `shadow_mode`, `near_limit_ratio`)
//!   come with the new engine;
//! - `store`: a changed store is built and connected (requests in flight finish on the
//!   engine they started with); a changed migration percentage alone moves clients live;
//! - `server`: listeners and tokens need a restart; a reload that changes them says so;
//! - `limiter.key_secret` (or its file, watched too): kept until a restart, said at each
//!   reload (a new secret re-keys every client: all start afresh).
//!
//! A file that does not validate, or whose rules the store cannot run, is refused whole:
//! the last good config stays, and the error is logged (with file:line:col) and counted.

use crate::app::AppState;
use crate::app::build::{self, BuildError};
use crate::config::load::{ConfigError, Loaded, Source, domain_files, load};
use crate::config::{Config, StoreConfig};
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
    #[error(
        "the new store ({kind}) did not answer within {:?}: check its address and that it is up; the last good store keeps serving",
        NEW_STORE_DEADLINE
    )]
    StoreUnreachable { kind: &'static str },
    #[error("the new store cannot run Sluice's decisions: {0}")]
    StoreUnfit(String),
}

/// How long a reload waits for a new store to answer before it is refused.
pub const NEW_STORE_DEADLINE: Duration = Duration::from_secs(3);

/// How long a changed file must stay unchanged before it is read: an editor that
/// truncates a file and then writes it, or a copy in progress, is read once it is whole.
const SETTLE: Duration = Duration::from_millis(250);

/// Watches `source` (already loaded as `config` from `bytes`, as [`watched`] read them)
/// until the process ends, and reloads it when it changes, when one of its domain files
/// or `server.tls` files changes (a rotated certificate), or when the process gets
/// SIGHUP (as nginx, Prometheus and HAProxy do). Without a source (the built-in config)
/// SIGHUP is logged and ignored.
pub fn watch(source: Option<Source>, mut config: Config, mut bytes: Vec<u8>, state: Arc<AppState>) {
    let ok = metrics::counter!(names::CONFIG_RELOADS, "result" => "ok");
    let failed = metrics::counter!(names::CONFIG_RELOADS, "result" => "failed");
    let mut hangups = hangups();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(POLL);
        // none seen yet: the first look reads the files, and finds the bytes in force
        // unless they changed since they were loaded
        let mut seen = Stamp::default();
        loop {
            let hangup = tokio::select! {
                _ = tick.tick() => false,
                Some(()) = hangups.recv() => true,
            };
            let Some(source) = &source else {
                if hangup {
                    tracing::info!("SIGHUP: no config file to reload (serving the built-in config)");
                }
                continue;
            };
            let files = Files::of(source, &config);
            let now = files.look().await;
            if hangup {
                tracing::info!(file = %source.name(), "SIGHUP: reloading the config");
            } else if now == seen || !settled(&files, &now).await {
                continue;
            }
            seen = now;
            match files.read(source).await {
                Ok(now) if now == bytes && !hangup => continue,
                Ok(now) => bytes = now,
                Err(e) => {
                    failed.increment(1);
                    state.service_stats.config_loaded(false);
                    tracing::error!(error = %e, "config file cannot be read; the last good config stays");
                    continue;
                }
            }
            match reload(source, &config, &state).await {
                Ok(next) => {
                    config = next;
                    ok.increment(1);
                    state.service_stats.config_loaded(true);
                }
                Err(e) => {
                    failed.increment(1);
                    state.service_stats.config_loaded(false);
                    tracing::error!(error = %e, "config reload refused; the last good config stays");
                }
            }
        }
    });
}

/// Whether the files still look like `seen` after [`SETTLE`].
async fn settled(files: &Files, seen: &Stamp) -> bool {
    tokio::time::sleep(SETTLE).await;
    files.look().await == *seen
}

/// The files a config is made of, by path: the config file, its `domains_from`
/// directory (listed at each look), its `server.tls` and secret files. Looking at them
/// and reading them happen on a blocking thread: a file system that hangs (a stale
/// network mount) holds up that thread, not a runtime worker deciding requests.
#[derive(Clone, Default)]
struct Files {
    config: Option<PathBuf>,
    dir: Option<PathBuf>,
    other: Vec<PathBuf>,
}

impl Files {
    fn of(source: &Source, config: &Config) -> Self {
        let other = tls_files(config).chain(secret_files(config)).cloned().collect();
        Self { config: source.path().map(Path::to_path_buf), dir: domains_dir(source, config), other }
    }

    /// Their stamp now.
    async fn look(&self) -> Stamp {
        let files = self.clone();
        tokio::task::spawn_blocking(move || Stamp::of(&files)).await.unwrap_or_default()
    }

    /// Their bytes now ([`watched`]).
    async fn read(&self, source: &Source) -> Result<Vec<u8>, String> {
        let (files, source) = (self.clone(), source.clone());
        let read = tokio::task::spawn_blocking(move || files.bytes(&source)).await;
        read.unwrap_or_else(|e| Err(format!("the files could not be read: {e}")))
    }

    /// The config's bytes, the names and bytes of its domain files, then the bytes of the
    /// other files (those that can be read: a reload says why one cannot).
    fn bytes(&self, source: &Source) -> Result<Vec<u8>, String> {
        let read = |p: &Path| std::fs::read(p).map_err(|e| format!("{}: cannot read it: {e}", p.display()));
        let mut bytes = match source {
            Source::File(path) => read(path)?,
            Source::Text { text, .. } => text.clone().into_bytes(),
        };
        if let Some(dir) = &self.dir {
            for f in domain_files(dir).map_err(|e| e.to_string())?.0 {
                bytes.extend(f.display().to_string().bytes());
                bytes.extend(read(&f)?);
            }
        }
        bytes.extend(self.other.iter().filter_map(|f| std::fs::read(f).ok()).flatten());
        Ok(bytes)
    }
}

/// What the watcher looks at every poll: for each file the config is made of, its
/// identity and change times, or why it cannot be looked at.
#[derive(Debug, Default, PartialEq)]
struct Stamp(Vec<(PathBuf, Result<[i64; 7], std::io::ErrorKind>)>);

impl Stamp {
    fn of(files: &Files) -> Self {
        use std::os::unix::fs::MetadataExt;
        let look = |p: PathBuf| {
            let m = std::fs::metadata(&p)
                .map(|m| {
                    [
                        m.dev() as i64,
                        m.ino() as i64,
                        m.size() as i64,
                        m.mtime(),
                        m.mtime_nsec(),
                        m.ctime(),
                        m.ctime_nsec(),
                    ]
                })
                .map_err(|e| e.kind());
            (p, m)
        };
        let mut stamp: Vec<_> = files.config.iter().map(|p| look(p.clone())).collect();
        if let Some(dir) = &files.dir {
            // the directory's own times move when a file is added, removed or renamed
            stamp.push(look(dir.clone()));
            stamp.extend(domain_files(dir).into_iter().flat_map(|(files, _)| files).map(look));
        }
        stamp.extend(files.other.iter().cloned().map(look));
        Self(stamp)
    }
}

/// The `domains_from` directory of `config` (loaded from `source`).
fn domains_dir(source: &Source, config: &Config) -> Option<PathBuf> {
    config.domains_from.as_ref().map(|dir| source.dir().join(dir))
}

/// The `server.tls` files of `config`.
fn tls_files(config: &Config) -> impl Iterator<Item = &PathBuf> {
    let tls = config.server.tls.as_ref();
    let files = tls.map(|t| [Some(&t.cert_file), Some(&t.key_file), t.client_ca_file.as_ref()]);
    files.into_iter().flatten().flatten()
}

/// The files `config` reads its secrets from: a rotated one is noticed (and a reload
/// says what it takes to put it in force).
fn secret_files(config: &Config) -> impl Iterator<Item = &PathBuf> {
    let (server, limiter) = (&config.server, &config.limiter);
    [&server.admin_token_file, &server.api_tokens_file, &limiter.key_secret_file].into_iter().flatten()
}

/// What the watcher compares once the files moved: the config's bytes, the names and
/// bytes of the domain files of `config`'s `domains_from`, then the bytes of its
/// `server.tls` files and its secret files (those that can be read: a reload says why
/// one cannot), so that a certificate or secret rotated on disk counts as a change. An
/// error names the config file or domain file that cannot be read, and why.
pub fn watched(source: &Source, config: &Config) -> Result<Vec<u8>, String> {
    Files::of(source, config).bytes(source)
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

/// Loads `source` and puts every section in force, or none. Returns the config now in
/// force. With `xds`, the rules stay the ones pushed (see `state/xds.rs`).
async fn reload(source: &Source, current: &Config, state: &AppState) -> Result<Config, ReloadError> {
    let (mut config, mut rules) = loaded(source, current)?;
    let mut pushed = if let Some(xds) = &state.xds { Some(xds.turn.lock().await) } else { None };
    // the pushed rules, once there are some (before, the pending ones load made)
    if let (Some(p), true) = (&pushed, state.xds.as_ref().is_some_and(|x| x.loaded())) {
        config.domains = p.domains.clone();
        rules = config.rules().map_err(|e| ConfigError { file: source.name(), at: None, message: e.to_string() })?;
    }
    let mut applied = vec!["rules (domains, headers)"];
    // read now, put in force last: a reload is applied whole or not at all
    let tls = match (&state.tls, &config.server.tls) {
        (Some(tls), Some(files)) => Some((tls, crate::tls::Tls::read(files)?)),
        _ => None,
    };
    if same_store(&config.store, &current.store) {
        if let (StoreConfig::Migrating { percent, .. }, Some(m)) = (&config.store, &*state.migration.load()) {
            if *percent != m.percent() {
                tracing::info!(from = m.percent(), to = percent, "config reload: migration percentage changed");
                applied.push("store.percent");
            }
            m.set_percent(*percent);
        }
        // the same store, retuned and under new rules: no reconnect, no state lost
        state.tuning.load().set(build::resilience(&config.limiter));
        let engine = state.engine.load();
        let (store, clock) = (engine.limiter.store().clone(), build::clock(&config.limiter));
        let next = build::engine(&config, rules, store.clone(), clock.clone(), Some(&engine.limiter));
        state.engine.store(Arc::new(regions_as(&config, current, next, (store, clock), &mut applied).await?));
    } else {
        let built = build::build(&config, rules)?;
        answers(built.engine.limiter.store().as_ref()).await?;
        // the grants held on the old store go back to it
        let old = state.engine.load_full();
        tokio::spawn(async move {
            let _ = old.limiter.return_grants().await;
        });
        state.install(built);
        applied.push("store (a new store, connected)");
    }
    if config.limiter != current.limiter {
        applied.push("limiter");
    }
    warn_dropped(current, &config);
    if let Some((tls, read)) = tls {
        tls.install(read);
        applied.push("server.tls (files read again)");
    }
    if crate::logs::reconfigure(&current.log, &config.log) {
        applied.push("log.level");
    }
    warn_restart(&config, current);
    tracing::info!(file = %source.name(), applied = %applied.join(", "), "config reloaded");
    if let Some(p) = &mut pushed {
        **p = config.clone();
    }
    Ok(config)
}

/// `next` with regions as `config` has them. When a reload turned them on, off or moved
/// them to another global store (`region` or `global_store` differ from `current`'s): a
/// new allocator, its global store connected and checked as a new `store` is (the old
/// allocator ends with the engine it served).
async fn regions_as(
    config: &Config,
    current: &Config,
    mut next: crate::app::Engine,
    (store, clock): (Arc<dyn sluice::store::Store>, Arc<dyn sluice::time::Clock>),
    applied: &mut Vec<&'static str>,
) -> Result<crate::app::Engine, ReloadError> {
    if (&config.region, &config.global_store) == (&current.region, &current.global_store) {
        return Ok(next);
    }
    // the overrides move with them: in the global store with regions, else in the store
    next.limiter = match &config.global_store {
        Some(global) => {
            let regions = build::regions((config.region.as_deref(), global), &config.limiter, store, clock.clone())?;
            answers(regions.global().as_ref()).await?;
            next.limiter.with_overrides(build::fleet_overrides(&regions, clock)).with_regions(regions)
        }
        None => {
            let overrides = sluice::overrides::Overrides::new(store, clock);
            overrides.watch(sluice::overrides::REFRESH);
            next.limiter.with_overrides(overrides).without_regions()
        }
    };
    applied.push("region, global_store (a new allocator, its store connected; the overrides read from there)");
    Ok(next)
}

/// `source` loaded (its warnings logged) under the key secret in force
/// ([`keep_key_secret`]).
fn loaded(source: &Source, current: &Config) -> Result<(Config, sluice::rules::Rules), ReloadError> {
    let Loaded { mut config, mut rules, warnings } = load(source)?;
    warnings.iter().for_each(|w| tracing::warn!("config reload: {w}"));
    if keep_key_secret(&mut config, current) {
        // the rules' tags come from the secret: made again under the one kept
        rules = config.rules().map_err(|e| ConfigError { file: source.name(), at: None, message: e.to_string() })?;
        if let Some(xds) = &config.xds {
            rules = rules.pending(xds.waiting());
        }
    }
    Ok((config, rules))
}

/// Keeps the key secret in force when `config` brings another, and says so: a new
/// secret gives every client a new tag, and so new windows started afresh (a client that
/// spent its limit gets it again), which only a restart should do. Said at every reload
/// until then (the file still holds the new one). Whether it kept it.
fn keep_key_secret(config: &mut Config, current: &Config) -> bool {
    if config.limiter.key_secret == current.limiter.key_secret {
        return false;
    }
    let from = config.limiter.key_secret_file.as_ref().map_or("limiter.key_secret".into(), |f| f.display().to_string());
    tracing::warn!(
        from = %from,
        "config reload: limiter.key_secret changed; kept the running one until a restart (a new secret re-keys every \
         client: each starts its windows afresh); the rest of the reload is applied"
    );
    config.limiter.key_secret.clone_from(&current.limiter.key_secret);
    true
}

/// Warns of the domains `current` had that `config` has not.
fn warn_dropped(current: &Config, config: &Config) {
    let dropped: Vec<&str> = current
        .domains
        .iter()
        .map(|d| d.domain.0.as_str())
        .filter(|name| !config.domains.iter().any(|d| d.domain.0 == *name))
        .collect();
    if !dropped.is_empty() {
        tracing::warn!(domains = %dropped.join(", "), "config reload: these domains are gone; their requests now get 400 unknown domain");
    }
}

/// Warns of the settings changed that only a restart puts in force.
fn warn_restart(config: &Config, current: &Config) {
    let restart = needs_restart(config, current);
    if !restart.is_empty() {
        tracing::warn!(keys = %restart.join(", "), "config reload: these settings need a restart to take effect");
    }
}

/// Whether a new store answers within [`NEW_STORE_DEADLINE`] and can run the decisions
/// (the version check made at start).
async fn answers(store: &dyn sluice::store::Store) -> Result<(), ReloadError> {
    let started = std::time::Instant::now();
    while !store.ready().await {
        if started.elapsed() >= NEW_STORE_DEADLINE {
            return Err(ReloadError::StoreUnreachable { kind: store.kind() });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    store.preflight().await.map_err(|e| ReloadError::StoreUnfit(e.to_string()))
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
        (
            "server.grpc_max_connection_age",
            (new.grpc_max_connection_age, new.grpc_max_connection_age_grace)
                != (old.grpc_max_connection_age, old.grpc_max_connection_age_grace),
        ),
        ("server.metrics_path", new.metrics_path != old.metrics_path),
        ("server.debug", new.debug != old.debug),
        ("server.grpc_uds", new.grpc_uds != old.grpc_uds),
        ("server.header_timeout", new.header_timeout != old.header_timeout),
        ("server.body_timeout", new.body_timeout != old.body_timeout),
        ("server.max_connections", new.max_connections != old.max_connections),
        ("server.grpc_idle_timeout", new.grpc_idle_timeout != old.grpc_idle_timeout),
        ("server.rlqs", new.rlqs != old.rlqs),
        ("server.shutdown_grace", new.shutdown_grace != old.shutdown_grace),
        ("server.tls (on or off, and its http)", new.tls.as_ref().map(|t| t.http) != old.tls.as_ref().map(|t| t.http)),
        ("server.metrics", new.metrics != old.metrics),
        ("xds", new_config.xds != old_config.xds),
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
