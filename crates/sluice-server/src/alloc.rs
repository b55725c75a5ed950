//! The allocator, and giving memory back after a burst.
//!
//! Sluice allocates through mimalloc: a decision allocates a few dozen small blocks
//! (buffers, JSON, headers), and with glibc's malloc those cost about 13% of the HTTP
//! decision path's CPU (measured with `scripts/bench-ab`: 13% less CPU a decision over HTTP).
//!
//! mimalloc keeps pages per thread, and a thread frees its empty pages back to the
//! system only when it next runs the allocator. After a burst of connections the worker
//! threads go idle and would sit on that memory (3,000 closed connections: 55 MB kept).
//! So the listener calls [`give_back`] when connections have closed, and every runtime
//! thread, the next time it parks (goes idle, which is when collecting costs nobody
//! anything), collects its own pages: [`on_park`], installed on every runtime. Pages are
//! returned at once rather than 10 ms later ([`init`]): a parked thread would not come
//! back to return them later (measured: no CPU cost at full load).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

unsafe extern "C" {
    /// mimalloc's own: frees the calling thread's empty pages back to the system
    /// (`force`: all of them, now).
    fn mi_collect(force: bool);
    fn mi_option_set(option: i32, value: std::ffi::c_long);
}

/// `mi_option_purge_delay` in mimalloc 3's `mimalloc.h` (the version Cargo.lock pins).
const PURGE_DELAY: i32 = 15;

/// Sets mimalloc's options; the first thing `main` does.
pub fn init() {
    // SAFETY: mi_option_set only stores the value; purging then happens without delay
    unsafe { mi_option_set(PURGE_DELAY, 0) }
}

/// Bumped by [`give_back`]; each thread collects once per bump.
static ROUND: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static SEEN: Cell<u64> = const { Cell::new(0) };
}

/// Asks every runtime thread to return its free memory when it next parks.
pub fn give_back() {
    ROUND.fetch_add(1, Ordering::Relaxed);
}

/// The runtimes' park hook: one atomic load when there is nothing to do.
pub fn on_park() {
    let round = ROUND.load(Ordering::Relaxed);
    if SEEN.with(|s| s.replace(round)) != round {
        // SAFETY: mi_collect has no preconditions; it only releases free pages
        unsafe { mi_collect(true) }
    }
}
