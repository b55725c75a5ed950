//! What Envoy's RLQS streams hold on this instance (`grpc/rlqs.rs` serves them): the
//! open streams as `GET /v1/admin/rlqs` shows them, and their counts against
//! `server.rlqs`'s bounds, which every stream's admission and fair parts read.

use crate::config::RlqsBounds;
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use tonic::Status;

/// The streams open on this instance, as `GET /v1/admin/rlqs` shows them, and what they
/// hold against `server.rlqs`'s bounds.
pub struct Streams {
    open: Mutex<BTreeMap<u64, serde_json::Value>>,
    next: AtomicU64,
    bounds: RlqsBounds,
    /// How long a stream may take to send its first report.
    first_report: std::time::Duration,
    held: Mutex<Held>,
}

/// What every stream holds together.
#[derive(Default)]
struct Held {
    streams: usize,
    by_peer: HashMap<Option<IpAddr>, usize>,
    buckets: usize,
    /// Streams holding each bucket (domain, entries) whose share [contends](sluice::rlqs::Share::contends):
    /// how many a fair part is split in.
    contending: HashMap<(String, BucketKey), u64>,
}

/// A bucket id's entries, sorted.
pub type BucketKey = Vec<(String, String)>;

impl Streams {
    pub fn new(bounds: RlqsBounds, first_report: std::time::Duration) -> Self {
        Self { open: Default::default(), next: AtomicU64::new(0), bounds, first_report, held: Default::default() }
    }

    /// An id for a new stream.
    pub fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// How long a stream may take to send its first report.
    pub fn first_report(&self) -> std::time::Duration {
        self.first_report
    }

    /// Every open stream: its domain, peer and buckets with their shares.
    pub fn view(&self) -> serde_json::Value {
        let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        serde_json::json!({ "streams": open.values().collect::<Vec<_>>() })
    }

    pub(crate) fn set(&self, id: u64, view: serde_json::Value) {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).insert(id, view);
    }

    pub(crate) fn remove(&self, id: u64) {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new stream from `peer`, within the bounds; [`Streams::close_stream`] ends it.
    pub(crate) fn open_stream(&self, peer: Option<IpAddr>) -> Result<(), Status> {
        let mut held = self.held();
        let b = &self.bounds;
        if held.streams >= b.max_streams {
            return Err(Status::resource_exhausted(format!(
                "this instance serves server.rlqs.max_streams ({}) RLQS streams already; try another instance",
                b.max_streams
            )));
        }
        let from_peer = held.by_peer.entry(peer).or_default();
        if *from_peer >= b.max_streams_per_peer {
            return Err(Status::resource_exhausted(format!(
                "this peer has server.rlqs.max_streams_per_peer ({}) RLQS streams open already",
                b.max_streams_per_peer
            )));
        }
        *from_peer += 1;
        held.streams += 1;
        Ok(())
    }

    pub(crate) fn close_stream(&self, peer: Option<IpAddr>) {
        let mut held = self.held();
        held.streams -= 1;
        if let Some(n) = held.by_peer.get_mut(&peer) {
            *n -= 1;
            if *n == 0 {
                held.by_peer.remove(&peer);
            }
        }
    }

    /// Takes `new` buckets of `domain` for a stream holding `has`: all, or none when a
    /// bound would be passed.
    pub(crate) fn add_buckets(&self, domain: &str, has: usize, new: &[&BucketKey]) -> Result<(), Status> {
        let b = &self.bounds;
        if has + new.len() > b.max_buckets_per_stream {
            return Err(Status::resource_exhausted(format!(
                "the stream would hold {} buckets, more than server.rlqs.max_buckets_per_stream ({})",
                has + new.len(),
                b.max_buckets_per_stream
            )));
        }
        let mut held = self.held();
        if held.buckets + new.len() > b.max_buckets {
            return Err(Status::resource_exhausted(format!(
                "this instance holds server.rlqs.max_buckets ({}) RLQS buckets already; try another instance",
                b.max_buckets
            )));
        }
        held.buckets += new.len();
        for key in new {
            // a new share contends until its demand is known
            *held.contending.entry((domain.to_string(), (*key).clone())).or_default() += 1;
        }
        Ok(())
    }

    /// A share of the bucket started or stopped contending (or went, when `from` was true
    /// and `to` is false).
    pub(crate) fn contends(&self, domain: &str, key: &[(String, String)], from: bool, to: bool) {
        if from == to {
            return;
        }
        let mut held = self.held();
        let k = (domain.to_string(), key.to_vec());
        let n = held.contending.entry(k.clone()).or_default();
        if to {
            *n += 1;
        } else {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.contending.remove(&k);
            }
        }
    }

    pub(crate) fn remove_bucket(&self, domain: &str, key: &[(String, String)], contending: bool) {
        self.contends(domain, key, contending, false);
        self.held().buckets -= 1;
    }

    /// How many streams of this instance hold the bucket and contend for a fair part.
    pub(crate) fn contenders(&self, domain: &str, key: &BucketKey) -> u64 {
        self.held().contending.get(&(domain.to_string(), key.clone())).copied().unwrap_or(1)
    }
}
