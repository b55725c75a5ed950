//! The memcached store on a real memcached: the conformance checks that apply (fixed
//! windows), and its flaw, demonstrated: a small cache evicts live windows, and those
//! clients get a fresh limit.

use sluice::algo::{Limit, Op};
use sluice::store::{MemcachedStore, Store};
use sluice::tag::Tag;
use sluice_testkit::MemcachedServer;
use std::time::Duration;

fn store(m: &MemcachedServer) -> MemcachedStore {
    MemcachedStore::new(&[m.addr()], Duration::from_secs(2)).unwrap()
}

sluice::conformance_suite!(fixed_window_only memcached, async {
    let m = MemcachedServer::start();
    (store(&m), m)
});

#[tokio::test]
async fn other_algorithms_are_refused_clearly() {
    let m = MemcachedServer::start();
    let s = store(&m);
    let tb =
        Op { key: 1, limit: Limit::TokenBucket { rate: 1, per: 1000, burst: 1 }, cost: 1, lease: None, shadow: false };
    let e = s.apply(Tag(1), &[tb], sluice::store::conformance::t0()).await.unwrap_err();
    assert!(e.to_string().contains("fixed windows only"), "{e}");
}

/// GitHub's reason to leave Memcached: when the cache fills (here with other data, as a
/// shared cache does), it evicts live windows, and a client that had used its limit gets
/// a fresh one.
#[tokio::test]
async fn a_full_cache_forgets_live_windows() {
    // a small cache: 2 MB
    let m = MemcachedServer::start_with(&["-m", "2"]);
    let s = store(&m);
    let now = sluice::store::conformance::t0();
    let op = Op {
        key: 7,
        limit: Limit::FixedWindow { limit: 3, window: 3_600_000, aligned: false },
        cost: 1,
        lease: None,
        shadow: false,
    };
    let tag = Tag(0x5151_5151_5151_5151_0000_0000_0000_0001);
    for _ in 0..3 {
        assert!(s.apply(tag, &[op], now).await.unwrap()[0].allowed);
    }
    assert!(!s.apply(tag, &[op], now).await.unwrap()[0].allowed, "the limit holds while the window is cached");
    // another application fills the cache with items of the same size class (memcached
    // evicts within a slab class, least recently used first)
    {
        use std::io::Write;
        let mut c = std::net::TcpStream::connect(m.addr()).unwrap();
        let mut batch = String::new();
        // the sizes of a window's two items: a 30-byte key with a 13-digit reset, a 42-byte
        // key with a small count
        for i in 0..100_000 {
            batch.push_str(&format!("set junk:{i:08}:xxxxxxxxxxxxxxxxx 0 0 13 noreply\r\n1234567890123\r\n"));
            batch.push_str(&format!("set junk:{i:08}:xxxxxxxxxxxxxxxxxxxxxxxxxxxxx 0 0 1 noreply\r\n1\r\n"));
        }
        batch.push_str("version\r\n");
        c.write_all(batch.as_bytes()).unwrap();
        // the reply to `version`, after every set on this connection was processed
        let mut reply = Vec::new();
        let mut buf = [0u8; 256];
        while !String::from_utf8_lossy(&reply).contains("VERSION") {
            let n = std::io::Read::read(&mut c, &mut buf).unwrap();
            assert!(n > 0);
            reply.extend_from_slice(&buf[..n]);
        }
    }
    let stats = m.command("stats").unwrap();
    assert!(!stats.contains("STAT evictions 0\r"), "nothing was evicted: {stats}");
    let d = s.apply(tag, &[op], now + 1).await.unwrap()[0];
    assert!(d.allowed, "the live window was evicted: the client got a fresh limit");
    assert_eq!(d.used, 1);
}

/// The server list replaced (as a DNS SRV record names other servers): a client whose
/// server goes starts afresh on the one that takes it, the change is said to the
/// near-cache (`routing`), the same list again is no change, and an empty one is ignored.
#[tokio::test]
async fn the_server_list_can_change() {
    let (a, b) = (MemcachedServer::start(), MemcachedServer::start());
    let s = store(&a);
    let now = sluice::store::conformance::t0();
    let limit = Limit::FixedWindow { limit: 2, window: 60_000, aligned: false };
    let op = Op { key: 3, limit, cost: 1, lease: None, shadow: false };
    let used = |d: &[sluice::algo::Decision]| d[0].used;
    assert_eq!(used(&s.apply(Tag(9), &[op], now).await.unwrap()), 1);
    let before = s.routing();
    s.set_servers(&[]);
    s.set_servers(&[a.addr()]);
    assert_eq!(s.routing(), before, "an empty list, or the same one, changes nothing");
    assert_eq!(used(&s.apply(Tag(9), &[op], now).await.unwrap()), 2);
    s.set_servers(&[b.addr()]);
    assert_ne!(s.routing(), before);
    assert_eq!(s.address(), b.addr());
    assert_eq!(used(&s.apply(Tag(9), &[op], now).await.unwrap()), 1, "afresh on the new server");
}
