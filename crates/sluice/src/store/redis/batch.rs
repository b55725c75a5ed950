//! Coalescing: the decisions in flight at once for one Redis node go in one script call.
//!
//! Redis spends most of a small script call on everything around the script: reading
//! and parsing the command, setting up the script's arguments and its library of
//! functions, writing the reply. One call that applies 30 clients' decisions pays that
//! once (docs/benchmarks.md: Redis CPU per decision).
//!
//! How: callers queue their call and wait; one task per node takes the queue. When a
//! call arrives and fewer than [`IN_FLIGHT`] batches are on the wire, it goes at once,
//! with whatever else is queued at that moment. So a lone request is never delayed
//! waiting for company (no timer), and under load the queue fills while batches are on
//! the wire. A batch runs its calls one after another, each all or nothing, exactly as
//! separate script calls in that order would (a property test holds it to that); one
//! call failing answers that call only. A call whose caller gave up (its deadline
//! passed) before the batch left is not sent.
//!
//! A queue per runtime: calls made on another thread's single-threaded runtime (the
//! gRPC threads, `serve.rs`) are queued and sent from that thread, by a task of its
//! own, which ends when the store is dropped. Queued to the runtime that started the
//! store, every call and every answer crossed threads, each crossing a wake-up of the
//! other thread (a system call): the gRPC path on Redis cost the server 29.5 us a
//! decision, 21.7 with its own queue, and its batches doubled (9.1 to 21.2 calls a
//! script call, as the thread queues all the calls of what it read before its task
//! sends them).

use super::{Call, Writer};
use crate::algo::Decision;
use crate::store::StoreError;
use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::{Semaphore, mpsc, oneshot, watch};

/// Batches on the wire at once per node and runtime.
const IN_FLIGHT: usize = 2;

/// Calls per batch at most (a bound on one script's run: a few hundred microseconds).
const MAX_CALLS: usize = 128;

type Answer = Result<Vec<Decision>, StoreError>;
type Queue = mpsc::UnboundedSender<Pending>;

struct Pending {
    call: Call,
    done: oneshot::Sender<Answer>,
}

/// The queues of one node's apply calls.
pub(super) struct Batcher {
    /// The queue of the runtime that started the store (and of every multi-threaded one).
    queue: Queue,
    writer: Arc<Writer>,
    /// Identifies this batcher's queues on other threads.
    id: u64,
    /// The thread that started the store.
    home: std::thread::ThreadId,
    /// Dropped with the store: ends the task of every queue.
    alive: watch::Sender<()>,
}

thread_local! {
    /// On a single-threaded runtime's thread, its queue for each batcher used there.
    static QUEUES: RefCell<Vec<(u64, Queue)>> = const { RefCell::new(Vec::new()) };
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

impl Batcher {
    /// Starts the node's task; None outside a Tokio runtime (calls then go one by one).
    pub fn start(writer: Arc<Writer>) -> Option<Self> {
        Handle::try_current().ok()?;
        let (queue, calls) = mpsc::unbounded_channel();
        let alive = watch::Sender::new(());
        tokio::spawn(drain(writer.clone(), calls, alive.subscribe()));
        Some(Self {
            queue,
            writer,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            home: std::thread::current().id(),
            alive,
        })
    }

    /// Applies one call in the next batch of this runtime.
    pub async fn apply(&self, call: Call) -> Answer {
        let stopped = || StoreError::unavailable("the redis store is shutting down");
        let (done, answer) = oneshot::channel();
        let pending = Pending { call, done };
        let sent = match self.local() {
            true => QUEUES.with(|q| self.local_queue(&mut q.borrow_mut()).send(pending)),
            false => self.queue.send(pending),
        };
        sent.map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }

    /// Whether calls from here get a queue of this thread's own: on a single-threaded
    /// runtime other than the one that started the store.
    fn local(&self) -> bool {
        Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::CurrentThread)
            && std::thread::current().id() != self.home
    }

    /// This thread's queue (started with its task on first use; queues of dropped
    /// stores are forgotten then).
    fn local_queue<'q>(&self, queues: &'q mut Vec<(u64, Queue)>) -> &'q Queue {
        if let Some(i) = queues.iter().position(|(id, _)| *id == self.id) {
            return &queues[i].1;
        }
        queues.retain(|(_, q)| !q.is_closed());
        let (queue, calls) = mpsc::unbounded_channel();
        tokio::spawn(drain(self.writer.clone(), calls, self.alive.subscribe()));
        queues.push((self.id, queue));
        &queues[queues.len() - 1].1
    }
}

/// Sends what is queued, at most [`IN_FLIGHT`] batches at a time, until the store is
/// dropped (`alive` then changes).
async fn drain(writer: Arc<Writer>, mut calls: mpsc::UnboundedReceiver<Pending>, mut alive: watch::Receiver<()>) {
    let wire = Arc::new(Semaphore::new(IN_FLIGHT));
    loop {
        let first = tokio::select! {
            p = calls.recv() => p,
            _ = alive.changed() => None,
        };
        let Some(first) = first else { return };
        let Ok(permit) = wire.clone().acquire_owned().await else { return };
        let mut batch = vec![first];
        while batch.len() < MAX_CALLS {
            match calls.try_recv() {
                Ok(p) => batch.push(p),
                Err(_) => break,
            }
        }
        batch.retain(|p| !p.done.is_closed());
        let writer = writer.clone();
        tokio::spawn(async move {
            let refs: Vec<&Call> = batch.iter().map(|p| &p.call).collect();
            let answers = writer.apply(&refs).await;
            drop(permit);
            for (p, answer) in batch.into_iter().zip(answers) {
                let _ = p.done.send(answer);
            }
        });
    }
}
