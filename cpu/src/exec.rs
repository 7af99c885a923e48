//! Runs a schedule's steps on a scoped thread pool: every thread walks the steps in order, claims
//! chunks of each step's work items from a shared counter, and waits at a barrier before the
//! next step. A work item's result never depends on which thread runs it or how items are
//! chunked, so outputs are bit-identical for any thread count.

use super::jit::StepFn;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Barrier, Condvar, Mutex};

/// Raw pointers handed to generated code, shareable across the pool's threads.
#[derive(Clone, Copy)]
pub struct Args {
    /// Buffer addresses, one per plan buffer.
    pub bufs: *const *mut u8,
    /// The integer table.
    pub ints: *const i64,
    /// Scratch memory: `threads × scratch_bytes`.
    pub scratch: *mut u8,
    /// Scratch bytes per thread.
    pub scratch_bytes: usize,
}

// SAFETY: the pointers address memory that outlives the scoped threads; generated code writes
// disjoint parts of it per work item (and scratch per thread), and steps are separated by a
// barrier.
unsafe impl Send for Args {}
// SAFETY: as above.
unsafe impl Sync for Args {}

impl Args {
    /// Runs items `lo..hi` of `f` on thread `t`'s scratch.
    fn call(&self, f: StepFn, lo: i64, hi: i64, t: usize) {
        // SAFETY: each thread's scratch slice lies within the `threads × scratch_bytes` block;
        // the rest as for `Args`.
        unsafe {
            let scratch = self.scratch.add(t * self.scratch_bytes);
            f(self.bufs, self.ints, lo, hi, scratch)
        }
    }
}

/// Work items per chunk: about four chunks per thread, so faster threads take more.
fn chunk(items: i64, threads: usize) -> i64 {
    (items / (threads as i64 * 4)).max(1)
}

/// The threads a run with `threads` uses: no more than the largest step has work items.
pub fn used_threads(items: &[i64], threads: usize) -> usize {
    let most = items.iter().copied().max().unwrap_or(0);
    threads.clamp(1, usize::try_from(most).unwrap_or(1).max(1))
}

/// Runs every step (`funcs[s]` over `items[s]` work items, in order) with `threads` threads
/// (≥ 1). When the operating system refuses a thread, nothing runs and the error is returned
/// (the threads already started are released first, so nothing waits forever).
pub fn run(items: &[i64], funcs: &[StepFn], args: Args, threads: usize) -> std::io::Result<()> {
    let threads = used_threads(items, threads);
    if threads == 1 {
        for (f, n) in funcs.iter().zip(items) {
            if *n > 0 {
                args.call(*f, 0, *n, 0);
            }
        }
        return Ok(());
    }
    let counters: Vec<AtomicI64> = items.iter().map(|_| AtomicI64::new(0)).collect();
    let barrier = Barrier::new(threads);
    let gate = Gate::default();
    let worker = |t: usize| {
        for (s, f) in funcs.iter().enumerate() {
            let n = items[s];
            if n > 0 {
                let size = chunk(n, threads);
                loop {
                    let lo = counters[s].fetch_add(size, Ordering::Relaxed);
                    if lo >= n {
                        break;
                    }
                    let hi = (lo + size).min(n);
                    args.call(*f, lo, hi, t);
                }
            }
            barrier.wait();
        }
    };
    std::thread::scope(|scope| {
        for t in 1..threads {
            let (w, gate) = (&worker, &gate);
            let spawned = std::thread::Builder::new().spawn_scoped(scope, move || {
                if gate.wait() {
                    w(t);
                }
            });
            if let Err(e) = spawned {
                gate.open(false);
                return Err(e);
            }
        }
        gate.open(true);
        worker(0);
        Ok(())
    })
}

/// Holds the workers until every one has started: then they all run (`true`), or, when a
/// thread could not be started, they all return (`false`).
#[derive(Default)]
struct Gate {
    state: Mutex<Option<bool>>,
    opened: Condvar,
}

impl Gate {
    fn open(&self, run: bool) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = Some(run);
        self.opened.notify_all();
    }

    fn wait(&self) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(run) = *state {
                return run;
            }
            state = self.opened.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }
}
