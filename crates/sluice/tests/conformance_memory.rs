//! The memory store against the conformance suite.
sluice::conformance_suite!(memory, async { (sluice::store::MemoryStore::new(100_000), ()) });
