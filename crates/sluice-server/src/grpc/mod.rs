//! Envoy's gRPC services on their own port: the rate limit service (RLS, `rls.rs`) and
//! the rate limit quota service (RLQS, `rlqs.rs`), on connections bounded as
//! `listen.rs` says, served by threads of their own.

pub mod kuadrant;
pub mod listen;
pub mod rlqs;
pub mod rls;
pub mod unary;

use crate::app::AppState;
use crate::config::ServerConfig;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
use rls::Rls;
use std::sync::Arc;

/// Envoy's rate limit service, on its own port, sharing the engine, until `stop` turns
/// true: then it answers the calls in flight and ends (the returned task ends when every
/// thread has).
///
/// Served by `server.grpc_threads` threads, each a single-threaded runtime accepting on
/// the same socket, not by the multi-threaded runtime: hyper runs each HTTP/2 stream as
/// a task of its own, and on the multi-threaded runtime every call woke another thread
/// to run it and again to answer (measured: six times Limitador's system calls for the
/// same load). A connection stays on the thread that accepted it, so a call never
/// crosses threads: server CPU per decision 24.3 -> 15.1 us (docs/benchmarks.md).
pub fn serve(
    listener: Socket,
    state: Arc<AppState>,
    server: &ServerConfig,
    stop: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = listener.into_std()?;
    let gate = listen::Gate::new(listen::Bounds {
        max_connections: server.max_connections,
        first_call: server.header_timeout.to_std(),
        idle: server.grpc_idle_timeout.to_std(),
    });
    let mut ended = Vec::new();
    let times = Times {
        ping: server.header_timeout.to_std(),
        age: server.grpc_max_connection_age.map(|d| d.to_std()),
        grace: server.grpc_max_connection_age_grace.map(|d| d.to_std()),
    };
    for i in 0..grpc_threads(server) {
        let (listener, state, stop) = (listener.try_clone()?, state.clone(), stop.clone());
        let gate = gate.clone();
        let runtime =
            tokio::runtime::Builder::new_current_thread().enable_all().on_thread_park(crate::alloc::on_park).build()?;
        let (done, end) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new().name(format!("sluice-grpc-{i}")).spawn(move || {
            runtime.block_on(grpc_thread(listener, gate, state, times, stop));
            let _ = done.send(());
        })?;
        ended.push(end);
    }
    Ok(tokio::spawn(async move {
        for end in ended {
            let _ = end.await;
        }
    }))
}

/// Where the gRPC service listens: TCP (`server.grpc`), or a Unix socket instead
/// (`server.grpc_uds`, envoyproxy/ratelimit's `GRPC_UDS`), with the same connection
/// bounds; TLS is TCP's alone.
pub enum Socket {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener, std::path::PathBuf),
}

/// [`Socket`] as each gRPC thread takes it.
enum StdSocket {
    Tcp(std::net::TcpListener),
    Unix(std::os::unix::net::UnixListener),
}

impl Socket {
    /// Binds the Unix socket at `path`: a socket file left by a process before is
    /// replaced, any other file is not.
    pub fn unix(path: &std::path::Path) -> std::io::Result<Self> {
        use std::os::unix::fs::FileTypeExt;
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)?,
            Ok(_) => {
                let why = format!("{} exists and is not a socket: remove it, or name another path", path.display());
                return Err(std::io::Error::new(std::io::ErrorKind::AlreadyExists, why));
            }
            Err(_) => {}
        }
        Ok(Self::Unix(tokio::net::UnixListener::bind(path)?, path.to_path_buf()))
    }

    /// Where it listens, as `--ready-file` and the start's line say it: `127.0.0.1:8081`,
    /// or `unix:/path`.
    pub fn at(&self) -> std::io::Result<String> {
        match self {
            Socket::Tcp(l) => Ok(l.local_addr()?.to_string()),
            Socket::Unix(_, path) => Ok(format!("unix:{}", path.display())),
        }
    }

    /// Whether only this host can reach it (loopback, or a socket file).
    pub fn local(&self) -> bool {
        match self {
            Socket::Tcp(l) => l.local_addr().is_ok_and(|a| a.ip().is_loopback()),
            Socket::Unix(..) => true,
        }
    }

    fn into_std(self) -> std::io::Result<StdSocket> {
        Ok(match self {
            Socket::Tcp(l) => StdSocket::Tcp(l.into_std()?),
            Socket::Unix(l, _) => StdSocket::Unix(l.into_std()?),
        })
    }
}

impl StdSocket {
    fn try_clone(&self) -> std::io::Result<Self> {
        Ok(match self {
            StdSocket::Tcp(l) => StdSocket::Tcp(l.try_clone()?),
            StdSocket::Unix(l) => StdSocket::Unix(l.try_clone()?),
        })
    }
}

/// The times a gRPC connection is held to: its HTTP/2 pings (and a call's length), and
/// its age and the grace after it (`server.grpc_max_connection_age`, `_grace`).
#[derive(Debug, Clone, Copy)]
struct Times {
    ping: std::time::Duration,
    age: Option<std::time::Duration>,
    grace: Option<std::time::Duration>,
}

/// The largest RLQS message read: about 20 times a report of
/// `server.rlqs.max_buckets_per_stream` (1,000) buckets of short ids.
const RLQS_MESSAGE_BYTES: usize = 1 << 20;

/// `server.grpc_threads`, or one a core.
fn grpc_threads(server: &ServerConfig) -> usize {
    server.grpc_threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1)
}

/// One gRPC thread's server, on the shared socket, until `stop`; its connections are
/// bounded as `listen.rs` says.
async fn grpc_thread(
    listener: StdSocket,
    gate: Arc<listen::Gate>,
    state: Arc<AppState>,
    times: Times,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let ping = times.ping;
    let tls = state.tls.clone();
    let rlqs = rlqs::Rlqs { state: state.clone(), stop: stop.clone() };
    let stopped = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    let mut builder = tonic::transport::Server::builder();
    if let Some(age) = times.age {
        builder = builder.max_connection_age(age);
    }
    if let Some(grace) = times.grace {
        builder = builder.max_connection_age_grace(grace);
    }
    let router = builder
        .layer(listen::CountCallsLayer)
        // a peer that stops answering HTTP/2 pings is gone: close its connection
        .http2_keepalive_interval(Some(ping))
        .http2_keepalive_timeout(Some(ping))
        .max_concurrent_streams(Some(1_024))
        // a call that takes longer than a request head may is answered DEADLINE_EXCEEDED
        .timeout(ping)
        .add_service(kuadrant::Kuadrant { state: state.clone() })
        .add_service(Rls { state })
        // a report of the most buckets a stream may hold fits many times over; one of
        // 100,000 (2.4 MB) is refused as it arrives
        .add_service(RateLimitQuotaServiceServer::new(rlqs).max_decoding_message_size(RLQS_MESSAGE_BYTES));
    let served = match listener {
        StdSocket::Tcp(l) => match (tokio::net::TcpListener::from_std(l), tls) {
            (Ok(l), Some(tls)) => {
                router.serve_with_incoming_shutdown(listen::secure(l, gate, tls, ping), stopped).await
            }
            (Ok(l), None) => router.serve_with_incoming_shutdown(listen::plain(l, gate), stopped).await,
            (Err(e), _) => return tracing::error!(error = %e, "the gRPC listener cannot be used"),
        },
        StdSocket::Unix(l) => match tokio::net::UnixListener::from_std(l) {
            Ok(l) => router.serve_with_incoming_shutdown(listen::unix(l, gate), stopped).await,
            Err(e) => return tracing::error!(error = %e, "the gRPC socket cannot be used"),
        },
    };
    if let Err(e) = served {
        tracing::error!(error = %e, "the gRPC server stopped");
    }
}
