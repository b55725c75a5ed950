//! The in-process stores against the conformance suite: the memory store, and the
//! stores made of stores (a migration half way, and the deadline and breaker wrapper),
//! which must answer exactly as what they wrap.

use sluice::store::{MemoryStore, MigratingStore, Resilience, Resilient};
use std::sync::Arc;

sluice::conformance_suite!(memory, async { (MemoryStore::new(100_000), ()) });

// half the clients on each side: a client's calls all go to one side
sluice::conformance_suite!(migrating, async {
    let (from, to) = (Arc::new(MemoryStore::new(100_000)), Arc::new(MemoryStore::new(100_000)));
    (MigratingStore::new(from, to, 50), ())
});

sluice::conformance_suite!(resilient, async { (Resilient::new(MemoryStore::new(100_000), Resilience::default()), ()) });
