//! The HTTP listener: hyper connections with the bounds a server on an open network
//! needs, and a stop that answers what it has received and then ends, whatever clients
//! do.
//!
//! - A request head must arrive within `server.header_timeout`; the same timeout closes
//!   a keep-alive connection that sends no next request (hyper starts it again after
//!   each response). A client sending a byte a second is closed when it runs out.
//! - A body must arrive within `server.body_timeout` (`http.rs`).
//! - Health probes and metrics scrapes have a front door: a thread of its own accepts
//!   every connection, and one whose first bytes are `GET /healthz` or `GET /metrics`
//!   is answered there, so neither waits behind decisions, however many are queued;
//!   every other connection goes on to the main runtime. (At 2,000 connections of load,
//!   probes waited 128 ms at the median behind decisions before; see
//!   docs/benchmarks.md.) With `server.tls`, only a plain `GET /healthz` is answered
//!   there (a kubelet cannot present a client certificate under mTLS, and "ok" tells
//!   nothing); every other connection must complete its TLS handshake within the header
//!   timeout.
//! - At most `server.max_connections` connections are served as usual. Past that, a new
//!   connection is still answered (a load balancer's `/healthz` probe must get through)
//!   but gets one request with a short head timeout and is closed: hogs cannot starve
//!   the file descriptors. Reaching the limit is logged (at most every 10 s) and
//!   counted. At start the process raises its open-file limit as far as it may, and
//!   warns when the connection limit does not fit under it.
//! - A connection that closes with bytes the client sent unread (the rest of a body
//!   refused with a 413) lingers: it reads and discards what the client still sends,
//!   for at most 2 s from its first pause and 16 MiB, so the client reads the 413 instead of a reset
//!   ([`Lingering`]).
//! - Memory a burst of connections took is given back to the system once they close
//!   (an idle allocator keeps it otherwise: 3,000 closed connections left 55 MB; see
//!   `alloc.rs`).
//! - On SIGTERM the listener closes and the connections drain: for a moment
//!   ([`DRAIN`]) every response says `Connection: close`, so a keep-alive client that has
//!   already written its next request gets it answered and then opens no more; then
//!   every connection finishes the request it is serving and is closed, and after
//!   `server.shutdown_grace` whatever is left is dropped, counted in the log.

use crate::logs::Sometimes;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// The bounds of the HTTP listener (`server` section).
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub header_timeout: Duration,
    pub max_connections: usize,
    pub shutdown_grace: Duration,
    /// Each request is told its connection's peer ([`PeerAddr`]): only when something
    /// reads it (the log line of a call refused for its credentials, with
    /// `server.api_tokens`), since the first extension of a request costs an allocation.
    pub peers: bool,
}

impl Bounds {
    /// The bounds `server` sets.
    pub fn of(server: &crate::config::ServerConfig) -> Self {
        Self {
            header_timeout: server.header_timeout.to_std(),
            max_connections: server.max_connections,
            shutdown_grace: server.shutdown_grace.to_std(),
            peers: !server.api_tokens.is_empty(),
        }
    }
}

/// How long a connection over the limit may take to send its one request head.
const OVER_LIMIT_HEAD: Duration = Duration::from_secs(1);

/// How long connections keep being served, each response closing its connection, after
/// the stop: closing an idle keep-alive connection at once would reset a request the
/// client had just written on it.
const DRAIN: Duration = Duration::from_millis(500);

/// Serves `router` on `listener` until `stop` resolves, then stops as the module says.
/// Returns how many connections the grace period cut off.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    bounds: Bounds,
    tls: Option<Arc<crate::tls::Tls>>,
    stop: impl Future<Output = ()>,
) -> std::io::Result<usize> {
    let (stopping, stop_rx) = watch::channel(false);
    let router = closing(router, stop_rx.clone());
    let (tx, mut accepted) = tokio::sync::mpsc::channel(1_024);
    // connections open, counted from their accept: those still at the front door too
    let open = Arc::new(AtomicUsize::new(0));
    let closed = Arc::new(AtomicUsize::new(0));
    let door = Door {
        router: router.clone(),
        bounds,
        main: tx,
        open: open.clone(),
        closed: closed.clone(),
        over: Arc::default(),
        tls: tls.is_some(),
    };
    let front = front_door(listener.into_std()?, door, stop_rx.clone())?;
    let trimmer = tokio::spawn(give_back_memory(closed.clone()));
    let mut connections = JoinSet::new();
    tokio::pin!(stop);
    loop {
        let (stream, full) = tokio::select! {
            Some((stream, full)) = accepted.recv() => match tokio::net::TcpStream::from_std(stream) {
                Ok(s) => (s, full),
                Err(e) => {
                    tracing::warn!(error = %e, "a connection could not be handed over");
                    continue;
                }
            },
            () = &mut stop => break,
        };
        // reap finished connections so the set does not grow
        while connections.try_join_next().is_some() {}
        let (router, open, closed, stop_rx, tls) =
            (router.clone(), open.clone(), closed.clone(), stop_rx.clone(), tls.clone());
        let peer = bounds.peers.then(|| PeerAddr(stream.peer_addr().ok()));
        connections.spawn(async move {
            match tls {
                None => connection(stream, router, peer, bounds, full, stop_rx).await,
                // boxed: a TLS connection's future is several times a plain one's, and
                // every plain connection's task would be allocated at its size
                Some(tls) => Box::pin(secure_connection(stream, &tls, router, peer, bounds, full, stop_rx)).await,
            }
            open.fetch_sub(1, Ordering::Relaxed);
            closed.fetch_add(1, Ordering::Relaxed);
        });
    }
    trimmer.abort();
    let _ = stopping.send(true);
    drop(accepted);
    let dropped = finish(connections, bounds.shutdown_grace).await;
    let _ = tokio::task::spawn_blocking(move || front.join()).await;
    Ok(dropped)
}

/// The address a request's connection came from, in its extensions (for the log line of
/// a call refused for its credentials).
#[derive(Debug, Clone, Copy)]
pub struct PeerAddr(pub Option<std::net::SocketAddr>);

/// Counts a connection over `server.max_connections`, and says so at most every 10 s.
fn over_limit(log: &Sometimes, max_connections: usize) {
    metrics::counter!(sluice::metric_names::HTTP_OVER_LIMIT).increment(1);
    if log.due() {
        tracing::warn!(max_connections, "HTTP connection limit reached; connections over it get one request each");
    }
}

/// What the front door needs.
#[derive(Clone)]
struct Door {
    router: Router,
    bounds: Bounds,
    /// Where every connection that is not a health probe goes, and whether it came over
    /// the connection limit.
    main: tokio::sync::mpsc::Sender<(std::net::TcpStream, bool)>,
    /// Connections open; the door counts each at its accept, and uncounts those it
    /// closes itself.
    open: Arc<AtomicUsize>,
    /// Connections closed (the memory they took is given back).
    closed: Arc<AtomicUsize>,
    /// The connection limit's log line.
    over: Arc<Sometimes>,
    /// Whether the listener speaks TLS (then only `/healthz` is answered in the clear).
    tls: bool,
}

/// The front door (see the module's doc): a thread with a runtime of its own accepts
/// connections until the server stops, answers health probes, and sends every other
/// connection on. A connection that sends nothing within the header timeout (one second
/// when it came over the connection limit) is closed here.
fn front_door(
    listener: std::net::TcpListener,
    door: Door,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().on_thread_park(crate::alloc::on_park).build()?;
    std::thread::Builder::new().name("sluice-front-door".into()).spawn(move || {
        runtime.block_on(async move {
            let listener = match TcpListener::from_std(listener) {
                Ok(l) => l,
                Err(e) => return tracing::error!(error = %e, "the HTTP listener cannot be used"),
            };
            let refused = Sometimes::default();
            loop {
                let stream = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(e) => {
                            // out of file descriptors, most likely: wait a moment, never spin
                            if refused.due() {
                                tracing::warn!(error = %e, "cannot accept connections (logged at most every 10 s)");
                            }
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                    _ = stop.wait_for(|stopping| *stopping) => return,
                };
                let full = door.open.fetch_add(1, Ordering::Relaxed) >= door.bounds.max_connections;
                if full {
                    over_limit(&door.over, door.bounds.max_connections);
                }
                tokio::spawn(door.clone().sort(stream, full));
            }
        })
    })
}

impl Door {
    /// Answers a health probe here; hands any other connection on (which then
    /// uncounts it when it ends).
    async fn sort(self, stream: tokio::net::TcpStream, full: bool) {
        let _ = stream.set_nodelay(true);
        let first_bytes = if full { OVER_LIMIT_HEAD } else { self.bounds.header_timeout };
        match tokio::time::timeout(first_bytes, is_health_probe(&stream, !self.tls)).await {
            Ok(true) => health(stream, self.router).await,
            Ok(false) => {
                if let Ok(stream) = stream.into_std()
                    && self.main.send((stream, full)).await.is_ok()
                {
                    return;
                }
            }
            Err(_) => {} // nothing arrived in time: closed
        }
        self.open.fetch_sub(1, Ordering::Relaxed);
        self.closed.fetch_add(1, Ordering::Relaxed);
    }
}

/// Whether the connection's first bytes are the request line of a health probe, or of
/// a metrics scrape when `metrics` (an operator's view must not go dark when the server
/// is busiest; over TLS, metrics are only served inside it). Waits for the first bytes;
/// a request line that arrives in pieces goes the usual way.
async fn is_health_probe(stream: &tokio::net::TcpStream, metrics: bool) -> bool {
    let mut first = [0u8; 13];
    match stream.peek(&mut first).await {
        Ok(13) => {
            let path = first.starts_with(b"GET /healthz") || (metrics && first.starts_with(b"GET /metrics"));
            path && matches!(first[12], b' ' | b'?')
        }
        _ => false,
    }
}

/// Answers one health probe, on the front door.
async fn health(stream: tokio::net::TcpStream, router: Router) {
    let mut builder = http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(OVER_LIMIT_HEAD).keep_alive(false);
    let _ = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(router)).await;
}

/// Serves one connection (TCP, or TLS over it) until it ends or the server stops.
async fn connection<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static>(
    stream: S,
    router: Router,
    peer: Option<PeerAddr>,
    bounds: Bounds,
    over_limit: bool,
    mut stop: watch::Receiver<bool>,
) {
    let mut builder = http1::Builder::new();
    builder.timer(TokioTimer::new());
    if over_limit {
        builder.header_read_timeout(OVER_LIMIT_HEAD).keep_alive(false);
    } else {
        builder.header_read_timeout(bounds.header_timeout);
    }
    let stream = Lingering { io: stream, shut: false, until: None, discarded: 0 };
    let service = hyper::service::service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
        if let Some(peer) = peer {
            request.extensions_mut().insert(peer);
        }
        tower::ServiceExt::oneshot(router.clone(), request)
    });
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => return,
        _ = stop.wait_for(|stopping| *stopping) => {}
    }
    // drain: serve on; every response now closes its connection
    if tokio::time::timeout(DRAIN, conn.as_mut()).await.is_ok() {
        return;
    }
    // answer the request in progress, if any, then close
    conn.as_mut().graceful_shutdown();
    let _ = conn.await;
}

/// [`connection`] once a TLS handshake is done, within the time a request head has.
async fn secure_connection(
    stream: tokio::net::TcpStream,
    tls: &crate::tls::Tls,
    router: Router,
    peer: Option<PeerAddr>,
    bounds: Bounds,
    over_limit: bool,
    stop: watch::Receiver<bool>,
) {
    match tokio::time::timeout(bounds.header_timeout, tls.http().accept(stream)).await {
        Ok(Ok(stream)) => connection(stream, router, peer, bounds, over_limit, stop).await,
        Ok(Err(e)) => tracing::debug!(error = %e, "HTTP TLS handshake refused"),
        Err(_) => tracing::debug!("HTTP TLS handshake timed out"),
    }
}

/// `router`, telling a client when its connection closes (one layer for both reasons).
fn closing(router: Router, stopping: watch::Receiver<bool>) -> Router {
    router.layer(axum::middleware::from_fn_with_state(stopping, close_when_due))
}

/// Adds `Connection: close` to a response when the connection closes after it: once the
/// server is stopping, and after a response given before its request's body was read to
/// its end (a 413, a 401, a 408, a 404 to a POST): hyper closes such a connection, and a
/// keep-alive client not told so sends its next request into it and loses it. (What
/// the client still sends of the unread body is read as the connection closes:
/// [`Lingering`].)
async fn close_when_due(
    axum::extract::State(stopping): axum::extract::State<watch::Receiver<bool>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use http_body::Body as _;
    let read = (!request.body().is_end_stream()).then(|| Arc::new(std::sync::atomic::AtomicBool::new(false)));
    let request = match &read {
        Some(read) => request.map(|body| axum::body::Body::new(Tracked { body, read: read.clone() })),
        None => request,
    };
    let mut response = next.run(request).await;
    let unread = read.is_some_and(|read| !read.load(Ordering::Relaxed));
    if unread || *stopping.borrow() {
        response.headers_mut().insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
    }
    response
}

/// A request body that notes when it has been read to its end.
struct Tracked {
    body: axum::body::Body,
    read: Arc<std::sync::atomic::AtomicBool>,
}

impl http_body::Body for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let frame = std::pin::Pin::new(&mut self.body).poll_frame(cx);
        if matches!(frame, std::task::Poll::Ready(None)) {
            self.read.store(true, Ordering::Relaxed);
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// Waits for the connections to finish, at most `grace`; drops the rest.
async fn finish(mut connections: JoinSet<()>, grace: Duration) -> usize {
    let started = Instant::now();
    let deadline = tokio::time::sleep(grace);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            next = connections.join_next() => if next.is_none() { break },
            () = &mut deadline => {
                let dropped = connections.len();
                connections.abort_all();
                tracing::warn!(dropped, grace_ms = grace.as_millis() as u64, "shutdown grace period over; connections dropped");
                return dropped;
            }
        }
    }
    tracing::info!(took_ms = started.elapsed().as_millis() as u64, "every connection finished");
    0
}

/// How often the listener looks whether connections closed.
const TRIM_TICK: Duration = Duration::from_secs(1);

/// While connections keep closing, memory is given back at least this many ticks apart.
const TRIM_BUSY_TICKS: u32 = 5;

/// Has every runtime thread return its free memory to the system ([`crate::alloc`]) once
/// connections closed and then a tick passed without a close (a burst has ended, and the
/// tasks of the last ones have been freed: a connection is counted closed just before
/// its task's memory goes), or every [`TRIM_BUSY_TICKS`] while they keep closing.
async fn give_back_memory(closed: Arc<AtomicUsize>) {
    let mut tick = tokio::time::interval(TRIM_TICK);
    // ticks since a close that no giving back has followed yet (0: none owed)
    let mut owed = 0u32;
    loop {
        tick.tick().await;
        let closing = closed.swap(0, Ordering::Relaxed) > 0;
        if owed > 0 && (!closing || owed >= TRIM_BUSY_TICKS) {
            crate::alloc::give_back();
            owed = 0;
            // a thread collects when it next parks, and an idle one is parked already:
            // a no-op task for each wakes them (tokio wakes a parked worker to take
            // tasks spawned while it sleeps)
            for _ in 0..tokio::runtime::Handle::current().metrics().num_workers() {
                tokio::spawn(tokio::task::yield_now());
            }
        }
        if closing {
            owed += 1;
        }
    }
}

/// How long a closing connection waits for more of a body it did not want from the
/// client's first pause, and how many bytes of it it reads and discards at most.
const LINGER: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 16 << 20;

/// A connection that, when it closes with bytes the client sent and nobody read (the
/// rest of a body refused with a 413), first shuts its write side (the response is out)
/// and then reads and discards what the client is still sending, until the client is
/// done, [`LINGER`] after it first pauses, or [`LINGER_BYTES`] went: a socket closed with unread
/// bytes in it is reset, and a client still writing its body then loses the response
/// that told it why (it sees a broken pipe instead of the 413). With nothing unread, it
/// closes at once.
struct Lingering<S> {
    io: S,
    /// The write side is shut.
    shut: bool,
    /// When a paused client is given up on (started at its first pause).
    until: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    discarded: usize,
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Lingering<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Lingering<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let this = &mut *self;
        if !this.shut {
            std::task::ready!(std::pin::Pin::new(&mut this.io).poll_shutdown(cx))?;
            this.shut = true;
        }
        let mut scratch = [0u8; 8192];
        while this.discarded < LINGER_BYTES {
            let mut buf = tokio::io::ReadBuf::new(&mut scratch);
            match std::pin::Pin::new(&mut this.io).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => this.discarded += buf.filled().len(),
                Poll::Ready(_) => return Poll::Ready(Ok(())), // the client is done, or gone
                Poll::Pending if this.discarded == 0 => return Poll::Ready(Ok(())), // nothing unread
                Poll::Pending => {
                    let until = this.until.get_or_insert_with(|| Box::pin(tokio::time::sleep(LINGER)));
                    return until.as_mut().poll(cx).map(Ok);
                }
            }
        }
        Poll::Ready(Ok(()))
    }
}
