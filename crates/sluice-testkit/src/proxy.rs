//! A TCP proxy on loopback that stands for a link between regions: every byte arrives
//! `one_way` after it was sent, in each direction, and the link can be cut and healed.
//!
//! Cut, it is a partition rather than a refusal: connections open are closed on both
//! sides, and a new one is accepted and then answered nothing (a client waits for its
//! own timeout, as across a real cut) until the link heals; then those held are closed,
//! so their clients connect again.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// A delaying proxy to `upstream`; stopped when dropped.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

struct Shared {
    upstream: SocketAddr,
    one_way: Duration,
    cut: AtomicBool,
    stop: AtomicBool,
    /// Bumped by each cut and heal: a connection of an older epoch is closed.
    epoch: AtomicU64,
    /// Every socket the proxy holds, to close at a cut, a heal or the end.
    sockets: Mutex<Vec<TcpStream>>,
}

impl Proxy {
    /// Listens on a port of 127.0.0.1 the system chooses.
    pub fn start(upstream: SocketAddr, one_way: Duration) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            upstream,
            one_way,
            cut: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            sockets: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        thread::spawn(move || {
            for client in listener.incoming() {
                if s.stop.load(Ordering::SeqCst) {
                    break;
                }
                if let Ok(client) = client {
                    s.accept(client);
                }
            }
        });
        Proxy { addr, shared }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Cuts the link: connections close, new ones hang.
    pub fn cut(&self) {
        self.shared.cut.store(true, Ordering::SeqCst);
        self.shared.close_all();
    }

    /// Heals the link: the connections that hung close, new ones pass again.
    pub fn heal(&self) {
        self.shared.cut.store(false, Ordering::SeqCst);
        self.shared.close_all();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.close_all();
        let _ = TcpStream::connect(self.addr);
    }
}

impl Shared {
    fn close_all(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        for s in self.sockets.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn hold(&self, s: &TcpStream) {
        if let Ok(s) = s.try_clone() {
            self.sockets.lock().unwrap().push(s);
        }
    }

    fn accept(self: &Arc<Self>, client: TcpStream) {
        self.hold(&client);
        if self.cut.load(Ordering::SeqCst) {
            return; // held, answered nothing, closed at the heal
        }
        let Ok(server) = TcpStream::connect(self.upstream) else {
            let _ = client.shutdown(Shutdown::Both);
            return;
        };
        self.hold(&server);
        let _ = (client.set_nodelay(true), server.set_nodelay(true));
        let epoch = self.epoch.load(Ordering::SeqCst);
        for (from, to) in [(&client, &server), (&server, &client)] {
            let (from, to) = (from.try_clone().unwrap(), to.try_clone().unwrap());
            let shared = self.clone();
            thread::spawn(move || shared.pump(from, to, epoch));
        }
    }

    /// Copies `from` to `to`, each chunk `one_way` after it was read, until either ends
    /// or the link is cut.
    fn pump(self: Arc<Self>, mut from: TcpStream, to: TcpStream, epoch: u64) {
        let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
        let shared = self.clone();
        let mut writer = to.try_clone().unwrap();
        let writing = thread::spawn(move || {
            for (due, chunk) in rx {
                thread::sleep(due.saturating_duration_since(Instant::now()));
                if shared.epoch.load(Ordering::SeqCst) != epoch || writer.write_all(&chunk).is_err() {
                    break;
                }
            }
            let _ = writer.shutdown(Shutdown::Write);
        });
        let mut buf = [0u8; 16 * 1024];
        while let Ok(n @ 1..) = from.read(&mut buf) {
            if tx.send((Instant::now() + self.one_way, buf[..n].to_vec())).is_err() {
                break;
            }
        }
        drop(tx);
        let _ = writing.join();
        let _ = to.shutdown(Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upstream that echoes each connection's bytes.
    fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        thread::spawn(move || {
            for mut c in listener.incoming().flatten() {
                thread::spawn(move || {
                    let mut buf = [0u8; 1024];
                    while let Ok(n @ 1..) = c.read(&mut buf) {
                        if c.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    fn round_trip(addr: SocketAddr) -> std::io::Result<Duration> {
        let mut c = TcpStream::connect(addr)?;
        c.set_read_timeout(Some(Duration::from_millis(500)))?;
        let started = Instant::now();
        c.write_all(b"ping")?;
        let mut got = [0u8; 4];
        c.read_exact(&mut got)?;
        assert_eq!(&got, b"ping");
        Ok(started.elapsed())
    }

    #[test]
    fn bytes_arrive_late_each_way_and_a_cut_link_answers_nothing() {
        let proxy = Proxy::start(echo(), Duration::from_millis(40));
        let took = round_trip(proxy.addr()).unwrap();
        assert!(took >= Duration::from_millis(80), "a round trip of {took:?}");
        let mut open = TcpStream::connect(proxy.addr()).unwrap();
        open.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
        open.write_all(b"x").unwrap();
        open.read_exact(&mut [0u8; 1]).unwrap();
        proxy.cut();
        assert!(round_trip(proxy.addr()).is_err(), "answered across a cut");
        match open.read(&mut [0u8; 1]) {
            Ok(n) => assert_eq!(n, 0, "the connection open at the cut is closed"),
            Err(e) => assert!(!matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)),
        }
        proxy.heal();
        assert!(round_trip(proxy.addr()).unwrap() >= Duration::from_millis(80), "healed");
    }
}
