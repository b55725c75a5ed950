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

use super::{Call, Writer};
use crate::algo::Decision;
use crate::store::StoreError;
use std::sync::Arc;
use tokio::sync::{Semaphore, mpsc, oneshot};

/// Batches on the wire at once per node.
const IN_FLIGHT: usize = 2;

/// Calls per batch at most (a bound on one script's run: a few hundred microseconds).
const MAX_CALLS: usize = 128;

type Answer = Result<Vec<Decision>, StoreError>;

struct Pending {
    call: Call,
    done: oneshot::Sender<Answer>,
}

/// The queue of one node's apply calls. Its task ends when the store is dropped.
pub(super) struct Batcher {
    queue: mpsc::UnboundedSender<Pending>,
}

impl Batcher {
    /// Starts the node's task; None outside a Tokio runtime (calls then go one by one).
    pub fn start(writer: Arc<Writer>) -> Option<Self> {
        tokio::runtime::Handle::try_current().ok()?;
        let (queue, calls) = mpsc::unbounded_channel();
        tokio::spawn(drain(writer, calls));
        Some(Self { queue })
    }

    /// Applies one call in the next batch.
    pub async fn apply(&self, call: Call) -> Answer {
        let stopped = || StoreError::unavailable("the redis store is shutting down");
        let (done, answer) = oneshot::channel();
        self.queue.send(Pending { call, done }).map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

/// Sends what is queued, at most [`IN_FLIGHT`] batches at a time.
async fn drain(writer: Arc<Writer>, mut calls: mpsc::UnboundedReceiver<Pending>) {
    let wire = Arc::new(Semaphore::new(IN_FLIGHT));
    while let Some(first) = calls.recv().await {
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
