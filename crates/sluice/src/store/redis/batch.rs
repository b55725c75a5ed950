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
//! passed) before the batch left is not sent, and a batch waiting on the wire is dropped
//! once all its callers gave up: had it run when the node came back, it would charge
//! decisions the failure policy had already made without it. A queue holds at most [`MAX_QUEUED`]
//! calls: while Redis stalls, the batches on the wire wait and the queue would grow with
//! the arrival rate, each call kept until its batch leaves though its caller gave up; a
//! call past the bound fails at once (the failure policy decides it, and the breaker
//! counts it).
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
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::{Semaphore, mpsc, oneshot, watch};

/// Batches on the wire at once per node and runtime.
const IN_FLIGHT: usize = 2;

/// Calls per batch at most (a bound on one script's run: a few hundred microseconds).
const MAX_CALLS: usize = 128;

/// Calls queued at most per node and runtime: at the limiter's deadline (100 ms by
/// default), more than a node answers in that time even at its best (docs/benchmarks.md).
const MAX_QUEUED: usize = 20_000;

type Answer = Result<Vec<Decision>, StoreError>;

/// A queue's sending side, and how many calls wait in it.
#[derive(Clone)]
struct Queue {
    calls: mpsc::UnboundedSender<Pending>,
    queued: Arc<AtomicUsize>,
}

impl Queue {
    /// A queue, and the task that drains it until `alive` changes.
    fn start(writer: Arc<Writer>, alive: watch::Receiver<()>) -> Self {
        let (calls, receiver) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        tokio::spawn(drain(writer, (receiver, queued.clone()), alive));
        Self { calls, queued }
    }

    /// Queues `pending`, unless [`MAX_QUEUED`] calls wait already.
    fn send(&self, pending: Pending) -> Result<(), StoreError> {
        if self.queued.fetch_add(1, Ordering::Relaxed) >= MAX_QUEUED {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            return Err(StoreError::unavailable(format!(
                "{MAX_QUEUED} calls already wait for this redis node (it is not answering as fast as they come)"
            )));
        }
        self.calls.send(pending).map_err(|_| StoreError::unavailable("the redis store is shutting down"))
    }
}

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
        let alive = watch::Sender::new(());
        let queue = Queue::start(writer.clone(), alive.subscribe());
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
        match self.local() {
            true => QUEUES.with(|q| self.local_queue(&mut q.borrow_mut()).send(pending)),
            false => self.queue.send(pending),
        }?;
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
        queues.retain(|(_, q)| !q.calls.is_closed());
        queues.push((self.id, Queue::start(self.writer.clone(), self.alive.subscribe())));
        &queues[queues.len() - 1].1
    }
}

/// Sends what is queued, at most [`IN_FLIGHT`] batches at a time, until the store is
/// dropped (`alive` then changes).
async fn drain(
    writer: Arc<Writer>,
    (mut calls, queued): (mpsc::UnboundedReceiver<Pending>, Arc<AtomicUsize>),
    mut alive: watch::Receiver<()>,
) {
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
        queued.fetch_sub(batch.len(), Ordering::Relaxed);
        batch.retain(|p| !p.done.is_closed());
        let writer = writer.clone();
        tokio::spawn(async move {
            let (calls, mut done): (Vec<Call>, Vec<oneshot::Sender<Answer>>) =
                batch.into_iter().map(|p| (p.call, p.done)).unzip();
            let refs: Vec<&Call> = calls.iter().collect();
            let answers = {
                let gone = futures_util::future::join_all(done.iter_mut().map(|d| d.closed()));
                tokio::select! {
                    answers = writer.apply(&refs) => Some(answers),
                    _ = gone => None,
                }
            };
            drop(permit);
            // every caller gave up (the store stalled past their deadline, and the
            // failure policy decided them): the batch is dropped unsent, where it would
            // have run once the node answered (waiting for a connection, say), charging
            // decisions already made without it
            let Some(answers) = answers else { return };
            for (done, answer) in done.into_iter().zip(answers) {
                let _ = done.send(answer);
            }
        });
    }
}
