//! `sluice serve`: builds the engine from a config and runs the HTTP API and Envoy's
//! gRPC rate limit service until SIGINT or SIGTERM.

pub mod reload;

use crate::app::build::{BuildError, build};
use crate::app::{AppState, Metrics};
use crate::config::load::{ConfigError, DEFAULT_CONFIG, Loaded, Source, load, load_str};
use crate::config::{Config, StoreConfig};
use crate::http::listen::Bounds;
use crate::http::router;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use sluice::config::DEFAULT_KEY_SECRET;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Config file (YAML). Without it, the built-in config (`sluice config default`).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Read envoyproxy/ratelimit's environment variables (REDIS_URL, RUNTIME_ROOT, ...)
    /// instead of a config file: a drop-in for their image (docs/envoy.md).
    #[arg(long, conflicts_with = "config")]
    pub ratelimit_env: bool,
    /// Listen for HTTP on this address instead of `server.http`.
    #[arg(long, value_name = "ADDR")]
    pub http: Option<SocketAddr>,
    /// Listen for gRPC (Envoy's rate limit service) on this address instead of
    /// `server.grpc`.
    #[arg(long, value_name = "ADDR")]
    pub grpc: Option<SocketAddr>,
    /// Once both listeners are bound, write their addresses to this file
    /// (`http=ADDR` and `grpc=ADDR` lines, and `metrics=ADDR` with `server.metrics`,
    /// written whole): with port 0 in the config, how
    /// a supervisor or a test learns the ports the system chose.
    #[arg(long, value_name = "FILE")]
    pub ready_file: Option<PathBuf>,
    /// Log level: error, warn, info, debug or trace. Overrides `RUST_LOG` and the
    /// config's `log.level` (default: `info`).
    #[arg(long, value_name = "LEVEL")]
    pub log_level: Option<tracing::Level>,
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
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    #[error("{0}")]
    Io(#[source] std::io::Error),
    #[error("{0}")]
    Log(String),
    #[error("store: {0}")]
    Store(String),
    #[error("{0}")]
    Telemetry(String),
    #[error("{0}")]
    Env(String),
    #[error("cannot listen on server.grpc_uds {}: {source}", path.display())]
    Socket {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Runs the service.
pub async fn serve(args: Args) -> Result<(), ServeError> {
    let (source, without_effect) = source(&args)?;
    // first: rules register their counters when they are compiled
    let metrics = install_metrics()?;
    let Loaded { config, rules, warnings } = match &source {
        Some(source) => load(source)?,
        None => load_str(DEFAULT_CONFIG, "<built-in config>")?,
    };
    crate::logs::init(args.log_level, &config.log).map_err(ServeError::Log)?;
    crate::config::env::note(&without_effect);
    warnings.iter().for_each(|w| tracing::warn!("config: {w}"));
    // the bytes that gave this config, for the reload watcher (read before the TLS files)
    let loaded_bytes = source.as_ref().and_then(|s| reload::watched(s, &config).ok()).unwrap_or_default();
    warn_if_default_secret(&config, args.ratelimit_env);
    let tls = config.server.tls.as_ref().map(crate::tls::Tls::load).transpose()?.map(Arc::new);
    let state = Arc::new(state_of(&config, rules, metrics, tls.clone()).await?);
    crate::app::history::start_sampling(&state);
    let addr = args.http.unwrap_or(config.server.http);
    let listener = listen(addr)?;
    let grpc_listener = grpc_socket(&args, &config.server)?;
    let [metrics_listener, debug_listener] = side_listeners(&config.server)?;
    // the addresses bound (a port 0 in the config is the system's choice)
    let (addr, grpc_addr) = (bound(&listener)?, grpc_listener.at().map_err(ServeError::Io)?);
    warn_if_open(&config, addr, grpc_listener.local(), args.ratelimit_env);
    let side = [metrics_listener.as_ref().map(bound).transpose()?, debug_listener.as_ref().map(bound).transpose()?];
    let (stopping, stop) = tokio::sync::watch::channel(false);
    let grpc = crate::grpc::serve(grpc_listener, state.clone(), &config.server, stop).map_err(ServeError::Io)?;
    announce(&args, (addr, grpc_addr), side, &state.engine.load().limiter)?;
    let server = config.server.clone();
    start_clients(&config, &state);
    reload::watch(source, config, loaded_bytes, state.clone());
    room_for_connections(server.max_connections);
    let bounds = Bounds::of(&server);
    let routers =
        [crate::http::metrics_router(state.clone(), &server.metrics_path), crate::http::debug_router(state.clone())];
    for (listener, router) in [metrics_listener, debug_listener].into_iter().zip(routers) {
        if let Some(l) = listener {
            serve_side(l, router, bounds, stopping.subscribe());
        }
    }
    // `server.tls.http: false`: gRPC's alone
    let http_tls = tls.filter(|_| server.tls.as_ref().is_some_and(|t| t.http));
    let dropped = crate::http::listen::serve(listener, router(state.clone()), bounds, http_tls, async {
        shutdown().await;
        let _ = stopping.send(true);
    })
    .await
    .map_err(ServeError::Io)?;
    // gRPC stops on the same signal, within the same grace
    let grpc_dropped = tokio::time::timeout(bounds.shutdown_grace, grpc).await.is_err();
    return_grants(&state.engine.load().limiter, bounds.shutdown_grace).await;
    if let Some(tracer) = &state.tracer {
        // the last spans, sent within the same grace
        tracer.flush(bounds.shutdown_grace).await;
    }
    tracing::info!(dropped_http_connections = dropped, grpc_cut_off = grpc_dropped, "stopped");
    Ok(())
}

/// Starts what calls other servers on its own: the xDS client of the rules, StatsD.
fn start_clients(config: &Config, state: &Arc<AppState>) {
    if let Some(xds) = &config.xds {
        crate::xds::start(xds.clone(), state.clone());
    }
    if let Some(statsd) = &config.telemetry.statsd {
        crate::statsd::start(statsd.clone(), state.clone());
    }
}

/// Warns when a listener is reachable beyond this host and nothing guards the data plane;
/// under `--ratelimit-env` (`env`), saying what their environment cannot set and what
/// to do instead.
fn warn_if_open(config: &Config, http: SocketAddr, grpc_local: bool, env: bool) {
    if (http.ip().is_loopback() && grpc_local) || !config.server.api_tokens.is_empty() {
        return;
    }
    match env {
        true => tracing::warn!(
            "a listener is not on loopback, and envoyproxy/ratelimit's environment has no variable for \
             server.api_tokens: anyone who reaches it can spend or refund any client's quota, as with theirs; let \
             only Envoy reach it (a NetworkPolicy), or run from a config file with server.api_tokens"
        ),
        false => tracing::warn!(
            "a listener is not on loopback and server.api_tokens is empty: anyone who reaches it can spend or refund any client's quota"
        ),
    }
}

/// gRPC's socket: `server.grpc_uds` when set, else TCP (`--grpc` or `server.grpc`).
fn grpc_socket(args: &Args, server: &crate::config::ServerConfig) -> Result<crate::grpc::Socket, ServeError> {
    match &server.grpc_uds {
        Some(path) => {
            crate::grpc::Socket::unix(path).map_err(|source| ServeError::Socket { path: path.clone(), source })
        }
        None => Ok(crate::grpc::Socket::Tcp(listen(args.grpc.unwrap_or(server.grpc))?)),
    }
}

/// The listeners of their own (`server.metrics`, `server.debug`), bound when set.
fn side_listeners(server: &crate::config::ServerConfig) -> Result<[Option<tokio::net::TcpListener>; 2], ServeError> {
    let [metrics, debug] = [server.metrics, server.debug].map(|a| a.map(listen).transpose());
    Ok([metrics?, debug?])
}

/// Serves a listener of its own (`server.metrics`: scrapes alone; `server.debug`:
/// envoyproxy/ratelimit's debug endpoints) with `router`, until `stopping` turns true.
fn serve_side(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    bounds: Bounds,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) {
    let stop = async move {
        let _ = stopping.wait_for(|s| *s).await;
    };
    tokio::spawn(crate::http::listen::serve(listener, router, bounds, None, stop));
}

/// Where the config comes from: `--config`, the environment (`--ratelimit-env`: the
/// config their variables describe, with the notes to log), or none (the built-in one).
fn source(args: &Args) -> Result<(Option<Source>, Vec<String>), ServeError> {
    if args.ratelimit_env {
        let (source, notes) = crate::config::env::source().map_err(ServeError::Env)?;
        return Ok((Some(source), notes));
    }
    Ok((args.config.clone().map(Source::File), Vec::new()))
}

/// The engine `config` describes, with its tracer; refused when the store answers but
/// cannot run the decisions (a Redis too old).
async fn state_of(
    config: &Config,
    rules: sluice::rules::Rules,
    metrics: Metrics,
    tls: Option<Arc<crate::tls::Tls>>,
) -> Result<AppState, ServeError> {
    let mut state = AppState::new(build(config, rules)?, &config.server, Some(metrics), tls);
    state.ui = config.server.ui.then(Default::default);
    state.xds = crate::app::xds::XdsState::new(config).map(Arc::new);
    state.tracer =
        config.telemetry.otlp.as_ref().map(crate::otel::Tracer::start).transpose().map_err(ServeError::Telemetry)?;
    state.engine.load().limiter.store().preflight().await.map_err(|e| match e {
        sluice::store::StoreError::Protocol { what, .. } => ServeError::Store(what),
        other => ServeError::Store(other.to_string()),
    })?;
    Ok(state)
}

/// The accept queue asked of the kernel (which caps it at `net.core.somaxconn`).
/// Connections a burst opens past the queue have their SYN dropped and retried by the
/// client a second later: with tokio's default of 1,024, 2,000 clients connecting at
/// once saw a p99 of 380 ms and a p99.9 of 1.4 s that were all SYN retries.
const ACCEPT_QUEUE: u32 = 8_192;

fn listen(addr: SocketAddr) -> Result<tokio::net::TcpListener, ServeError> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    };
    let bound = socket.and_then(|s| {
        s.set_reuseaddr(true)?;
        s.bind(addr)?;
        s.listen(ACCEPT_QUEUE)
    });
    bound.map_err(|source| ServeError::Listen { addr, source })
}

fn bound(listener: &tokio::net::TcpListener) -> Result<SocketAddr, ServeError> {
    listener.local_addr().map_err(ServeError::Io)
}

/// Writes the bound addresses to `file`, whole: a reader never sees half of it.
fn ready_file(
    file: &std::path::Path,
    http: SocketAddr,
    grpc: &str,
    [metrics, debug]: [Option<SocketAddr>; 2],
) -> Result<(), ServeError> {
    let tmp = file.with_extension("tmp");
    let metrics = metrics.map(|m| format!("metrics={m}\n")).unwrap_or_default();
    let debug = debug.map(|d| format!("debug={d}\n")).unwrap_or_default();
    std::fs::write(&tmp, format!("http={http}\ngrpc={grpc}\n{metrics}{debug}")).map_err(ServeError::Io)?;
    std::fs::rename(&tmp, file).map_err(ServeError::Io)
}

/// Raises the process's soft open-file limit to its hard limit (each connection is a
/// file descriptor; Debian's default soft limit is 1,024), and warns when
/// `max_connections` and a reserve for the store's connections do not fit under it.
fn room_for_connections(max_connections: usize) {
    #[cfg(target_os = "linux")]
    {
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit and setrlimit only read and write the struct passed
        let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
        if got && limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
                limit = raised;
            }
        }
        // HTTP and gRPC each have `max_connections`
        let needed = 2 * max_connections as u64 + 256;
        if got && limit.rlim_cur < needed {
            tracing::warn!(
                open_files = limit.rlim_cur,
                max_connections,
                "twice server.max_connections (HTTP and gRPC each), plus 256 for the store and the rest, does not fit under the open-file limit; raise `ulimit -n` or lower it"
            );
        }
    }
}

/// How often histogram samples are folded into their buckets.
const METRICS_UPKEEP: Duration = Duration::from_secs(1);

/// Installs the Prometheus recorder that `/metrics` renders, and its upkeep. Store
/// latencies are histograms with buckets from 0.5 ms to 1 s, the round trips to a
/// global store from 1 ms to 2.5 s (without buckets, a summary: the dashboard's
/// `histogram_quantile` found no `_bucket` series). The recorder keeps every
/// histogram sample until it is folded into the buckets, which a scrape does, and the
/// upkeep does every second whether anyone scrapes or not: without it an unscraped
/// server on a remote store grows by about 16 bytes a decision, without end.
fn install_metrics() -> Result<Metrics, ServeError> {
    let buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];
    let store_calls = Matcher::Full(sluice::metric_names::STORE_CALL_SECONDS.into());
    let far = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];
    let global_calls = Matcher::Full(sluice::metric_names::REGION_GLOBAL_SECONDS.into());
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(store_calls, &buckets)?
        .set_buckets_for_metric(global_calls, &far)?
        .install_recorder()?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(METRICS_UPKEEP);
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    let process = metrics_process::Collector::default();
    process.describe();
    sluice::describe_metrics();
    crate::grpc::rlqs::names::describe();
    crate::otel::describe_metrics();
    crate::xds::describe_metrics();
    crate::app::credentials::describe();
    Ok(Metrics { recorder: handle, process, turn: Default::default() })
}

/// Says where the server listens, every address as bound (a port 0 is the system's
/// choice): in the start's log line, and in `--ready-file` when asked; and, with
/// `region`, the region and its global store.
fn announce(
    args: &Args,
    (http, grpc): (SocketAddr, String),
    [metrics, debug]: [Option<SocketAddr>; 2],
    limiter: &sluice::Limiter,
) -> Result<(), ServeError> {
    let store = limiter.store().kind();
    if let Some(file) = &args.ready_file {
        ready_file(file, http, &grpc, [metrics, debug])?;
    }
    let metrics = metrics.map_or_else(|| "the http port".to_string(), |m| format!("{m} and the http port"));
    let debug_port = debug.map_or_else(|| "none".to_string(), |d| d.to_string());
    tracing::info!(%http, %grpc, %metrics, debug = %debug_port, store, "sluice is serving");
    if let Some(regions) = limiter.regions() {
        let (region, global_store) = (regions.name(), regions.global().kind());
        // the code its grants carry in the global store (`admin inspect` names the others by it)
        let code = format!("{:04x}", sluice::regions::region_code(region));
        tracing::info!(
            region,
            code,
            global_store,
            "global limits are shared with the other regions through the global store"
        );
    }
    Ok(())
}

/// A shared store with the default key secret: clients could predict their tags. Under
/// `--ratelimit-env` (`env`), the variable that sets it is named (their `CACHE_KEY_PREFIX`
/// is appended to the secret, so the default is known by the variable being unset).
fn warn_if_default_secret(config: &Config, env: bool) {
    if matches!(config.store, StoreConfig::Memory { .. }) {
        return;
    }
    if env && std::env::var_os("SLUICE_KEY_SECRET").is_none_or(|v| v.is_empty()) {
        tracing::warn!(
            "SLUICE_KEY_SECRET is not set: clients' tags are keyed by the built-in secret, so clients can predict them; set it from a Secret"
        );
    } else if !env && config.limiter.key_secret == DEFAULT_KEY_SECRET {
        tracing::warn!("limiter.key_secret is the default: set your own so clients cannot predict their tags");
    }
}

/// Gives back the quota grants not spent, within `grace`, so other instances can admit
/// them.
async fn return_grants(limiter: &sluice::Limiter, grace: std::time::Duration) {
    let held = limiter.grants().held_units();
    match tokio::time::timeout(grace, limiter.return_grants()).await {
        Ok(Ok(())) if held > 0 => tracing::info!(units = held, "quota grants given back"),
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "quota grants not given back (an under-admission until their windows end)")
        }
        Err(_) => tracing::warn!("quota grants not given back within the shutdown grace"),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The process's resident memory, in bytes.
    fn rss() -> u64 {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        statm.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 4096
    }

    /// Four million store-call samples (what four million decisions on a remote store
    /// record) over ten seconds, nobody scraping: the upkeep folds them away, so memory
    /// stays flat. Kept unfolded they take about 64 MB; the bound of 16 MB leaves room for
    /// what this binary's other tests, running beside it, allocate (2.3 MB seen in CI
    /// against a bound of 2 MB once). (This binary's only test that installs the global
    /// recorder.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn four_million_decisions_unscraped_do_not_grow_memory() {
        let _handle = install_metrics().unwrap();
        let h = metrics::histogram!(sluice::metric_names::STORE_CALL_SECONDS, "store" => "redis", "op" => "apply");
        let batch = |n: usize| (0..n).for_each(|i| h.record(0.0001 * (i % 50) as f64));
        // one batch first, so the allocator's pools and the recorder's tables exist
        batch(50_000);
        tokio::time::sleep(METRICS_UPKEEP * 2).await;
        let before = rss();
        for _ in 0..20 {
            batch(200_000);
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        tokio::time::sleep(METRICS_UPKEEP * 2).await;
        let grown = rss().saturating_sub(before);
        assert!(grown < 16 << 20, "four million unscraped samples grew memory by {grown} bytes");
    }
}
