//! The gRPC listener's connections, with the bounds the HTTP listener has (`http/listen.rs`):
//! a connection that never speaks cannot hold a file descriptor for long, and no number
//! of them can starve the process.
//!
//! - At most `server.max_connections` gRPC connections are open at once, counted over
//!   every gRPC thread; a connection past that is closed as soon as it is accepted,
//!   counted, and logged at most every 10 s. (HTTP has its own count of the same size,
//!   and its front door answers `/healthz` past its own; the two together fit under the
//!   open-file limit the process raises at start.)
//! - A connection must open its first call within `server.header_timeout` of its accept:
//!   the HTTP/2 preface, the settings and a request's headers. A peer that connects and
//!   sends nothing, or only the preface, is closed then (20,000 such connections were all
//!   still open 15 s later before, and took the process to its file limit).
//! - A connection with no call open for `server.grpc_idle_timeout` is closed. A call in
//!   progress (an RLQS stream that reports once a minute, a slow unary call) keeps its
//!   connection whatever the clock says; pings do not count as activity, so a peer that
//!   answers pings and never calls is closed too.
//!
//! How: each accepted socket is wrapped in [`Conn`], which owns a timer and the
//! connection's [`Activity`] (the number of calls open and when the last one ended).
//! The gRPC service is wrapped by [`CountCalls`], which finds the connection's activity
//! in the request (tonic puts what [`Connected::connect_info`] returns into every
//! request's extensions) and counts the call open until its request body is dropped:
//! after the message is decoded for a unary call, when the stream ends for a streaming
//! one. When the socket has nothing to read and the timer has passed the deadline, the
//! read fails and hyper drops the connection.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::Connected;

/// The bounds of the gRPC listener (`server` section).
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub max_connections: usize,
    /// From the accept to the first call's headers.
    pub first_call: Duration,
    /// With no call open.
    pub idle: Duration,
}

/// The open connections of every gRPC thread, against the limit.
pub struct Gate {
    open: AtomicUsize,
    bounds: Bounds,
    log: crate::logs::Sometimes,
}

impl Gate {
    pub fn new(bounds: Bounds) -> Arc<Self> {
        Arc::new(Self { open: AtomicUsize::new(0), bounds, log: Default::default() })
    }

    /// A place for a connection just accepted, or None when the listener is full (the
    /// caller closes it).
    pub fn enter(self: &Arc<Self>) -> Option<Ticket> {
        let open = self.open.fetch_add(1, Ordering::Relaxed) + 1;
        if open > self.bounds.max_connections {
            self.open.fetch_sub(1, Ordering::Relaxed);
            metrics::counter!(sluice::metric_names::GRPC_OVER_LIMIT).increment(1);
            if self.log.due() {
                tracing::warn!(
                    max_connections = self.bounds.max_connections,
                    "gRPC connection limit reached; connections over it are closed at once"
                );
            }
            return None;
        }
        metrics::gauge!(sluice::metric_names::GRPC_CONNECTIONS).increment(1.0);
        Some(Ticket(self.clone()))
    }
}

/// One connection's place under the limit, given back when dropped.
pub struct Ticket(Arc<Gate>);

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
        metrics::gauge!(sluice::metric_names::GRPC_CONNECTIONS).decrement(1.0);
    }
}

/// What a connection has been doing: read by its [`Conn`], written by [`CountCalls`].
#[derive(Debug)]
pub struct Activity {
    born: Instant,
    calls: AtomicUsize,
    called: AtomicBool,
    /// When the last call ended, in ms after `born`.
    last_end_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Self { born: Instant::now(), calls: AtomicUsize::new(0), called: AtomicBool::new(false), last_end_ms: 0.into() }
    }

    /// When the connection is to be closed if nothing happens before: None while a call
    /// is open. The second value says which deadline it is.
    fn deadline(&self, bounds: &Bounds) -> Option<(Instant, &'static str)> {
        if self.calls.load(Ordering::Acquire) > 0 {
            return None;
        }
        Some(match self.called.load(Ordering::Acquire) {
            false => (self.born + bounds.first_call, "first_call"),
            true => {
                let ended = self.born + Duration::from_millis(self.last_end_ms.load(Ordering::Acquire));
                (ended + bounds.idle, "idle")
            }
        })
    }
}

/// A call open on a connection; ends it when dropped.
pub struct Call(Arc<Activity>);

impl Call {
    fn start(activity: Arc<Activity>) -> Self {
        activity.called.store(true, Ordering::Release);
        activity.calls.fetch_add(1, Ordering::AcqRel);
        Self(activity)
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        let a = &self.0;
        a.last_end_ms.store(a.born.elapsed().as_millis() as u64, Ordering::Release);
        a.calls.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a request learns of its connection (in its extensions).
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: Option<SocketAddr>,
    activity: Arc<Activity>,
}

/// An accepted connection under the module's deadlines.
pub struct Conn<IO> {
    io: IO,
    addr: Option<SocketAddr>,
    activity: Arc<Activity>,
    timer: Pin<Box<Sleep>>,
    /// Its place under the limit, and the bounds.
    ticket: Ticket,
}

impl<IO> Conn<IO> {
    pub fn new(io: IO, addr: Option<SocketAddr>, ticket: Ticket) -> Self {
        let bounds = ticket.0.bounds;
        let activity = Arc::new(Activity::new());
        // the first look at the earlier of the two deadlines: once a call has come and
        // gone the idle one applies, and it may be the nearer (a call ending only ever
        // moves a deadline later after that)
        let timer = Box::pin(tokio::time::sleep_until(activity.born + bounds.first_call.min(bounds.idle)));
        Self { io, addr, activity, timer, ticket }
    }

    /// Whether the deadline has passed (then the connection is to be closed); otherwise
    /// the timer is set to wake the task at the next moment to look again.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        while self.timer.as_mut().poll(cx).is_ready() {
            let now = Instant::now();
            let bounds = self.ticket.0.bounds;
            match self.activity.deadline(&bounds) {
                Some((at, why)) if at <= now => {
                    metrics::counter!(sluice::metric_names::GRPC_CLOSED, "reason" => why).increment(1);
                    return true;
                }
                Some((at, _)) => self.timer.as_mut().reset(at),
                // a call is open: look again an idle period from now
                None => self.timer.as_mut().reset(now + bounds.idle),
            }
        }
        false
    }
}

impl<IO> Connected for Conn<IO> {
    type ConnectInfo = Peer;

    fn connect_info(&self) -> Peer {
        Peer { addr: self.addr, activity: self.activity.clone() }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Conn<IO> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Pending if this.expired(cx) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no gRPC call within the connection's deadline",
            ))),
            other => other,
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Conn<IO> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The plain (no TLS) connections of one gRPC thread, each under the gate.
pub fn plain(
    listener: tokio::net::TcpListener,
    gate: Arc<Gate>,
) -> impl futures_util::Stream<Item = Result<Conn<tokio::net::TcpStream>, std::io::Error>> {
    futures_util::stream::unfold((listener, gate), |(listener, gate)| async move {
        loop {
            let (stream, addr) = accept(&listener).await;
            let Some(ticket) = gate.enter() else { continue };
            // no Nagle: a small reply held back for a delayed ACK costs every call ~40 ms
            let _ = stream.set_nodelay(true);
            return Some((Ok(Conn::new(stream, Some(addr), ticket)), (listener, gate)));
        }
    })
}

/// The connections of one gRPC thread on a Unix socket (`server.grpc_uds`), each under
/// the gate; they have no peer address.
pub fn unix(
    listener: tokio::net::UnixListener,
    gate: Arc<Gate>,
) -> impl futures_util::Stream<Item = Result<Conn<tokio::net::UnixStream>, std::io::Error>> {
    futures_util::stream::unfold((listener, gate), |(listener, gate)| async move {
        let refused = crate::logs::Sometimes::default();
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    if refused.due() {
                        tracing::warn!(error = %e, "cannot accept gRPC connections (logged at most every 10 s)");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Some(ticket) = gate.enter() else { continue };
            return Some((Ok(Conn::new(stream, None, ticket)), (listener, gate)));
        }
    })
}

/// The next connection; an accept that fails (out of file descriptors, most likely) is
/// retried a moment later, never in a spin.
pub async fn accept(listener: &tokio::net::TcpListener) -> (tokio::net::TcpStream, SocketAddr) {
    let refused = crate::logs::Sometimes::default();
    loop {
        match listener.accept().await {
            Ok(accepted) => return accepted,
            Err(e) => {
                if refused.due() {
                    tracing::warn!(error = %e, "cannot accept gRPC connections (logged at most every 10 s)");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The layer that counts each call open on its connection (see the module's doc).
#[derive(Debug, Clone, Copy, Default)]
pub struct CountCallsLayer;

impl<S> tower::Layer<S> for CountCallsLayer {
    type Service = CountCalls<S>;

    fn layer(&self, inner: S) -> CountCalls<S> {
        CountCalls(inner)
    }
}

/// See [`CountCallsLayer`].
#[derive(Debug, Clone)]
pub struct CountCalls<S>(S);

impl<S> tower::Service<axum::http::Request<tonic::body::Body>> for CountCalls<S>
where
    S: tower::Service<axum::http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: axum::http::Request<tonic::body::Body>) -> Self::Future {
        let Some(peer) = request.extensions().get::<Peer>() else { return self.0.call(request) };
        let call = Call::start(peer.activity.clone());
        self.0.call(request.map(|body| tonic::body::Body::new(Counted { body, _call: call })))
    }
}

/// A request body that keeps its call counted open until it is dropped.
struct Counted {
    body: tonic::body::Body,
    _call: Call,
}

impl http_body::Body for Counted {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// The gRPC listener's connections, each under `gate` from its accept and passed on
/// once its TLS handshake is done (within `handshake`); a failed handshake (no client
/// certificate under mTLS, a scanner) is closed and never reaches the service.
pub fn secure(
    listener: tokio::net::TcpListener,
    gate: Arc<Gate>,
    tls: Arc<crate::tls::Tls>,
    handshake: std::time::Duration,
) -> impl futures_util::Stream<Item = Result<Conn<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>, std::io::Error>>
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (stream, addr) = tokio::select! {
                accepted = accept(&listener) => accepted,
                () = tx.closed() => return,
            };
            let Some(ticket) = gate.enter() else { continue };
            let _ = stream.set_nodelay(true);
            let (acceptor, tx) = (tls.grpc(), tx.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(handshake, acceptor.accept(stream)).await {
                    Ok(Ok(stream)) => drop(tx.send(Ok(Conn::new(stream, Some(addr), ticket))).await),
                    Ok(Err(e)) => tracing::debug!(error = %e, "gRPC TLS handshake refused"),
                    Err(_) => tracing::debug!("gRPC TLS handshake timed out"),
                }
            });
        }
    });
    futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) })
}
