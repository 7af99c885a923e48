//! Runs a schedule's steps on a scoped thread pool: every thread walks the steps in order, claims
//! chunks of each step's work items from a shared counter, and waits at a barrier before the
//! next step. A work item's result never depends on which thread runs it or how items are
//! chunked, so outputs are bit-identical for any thread count.

use super::jit::StepFn;
use std::sync::Barrier;
use std::sync::atomic::{AtomicI64, Ordering};

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

/// Runs every step (`funcs[s]` over `items[s]` work items, in order) with `threads` threads
/// (≥ 1).
pub fn run(items: &[i64], funcs: &[StepFn], args: Args, threads: usize) {
    let most = items.iter().copied().max().unwrap_or(0);
    let threads = threads.clamp(1, most.max(1) as usize);
    if threads == 1 {
        for (f, n) in funcs.iter().zip(items) {
            if *n > 0 {
                args.call(*f, 0, *n, 0);
            }
        }
        return;
    }
    let counters: Vec<AtomicI64> = items.iter().map(|_| AtomicI64::new(0)).collect();
    let barrier = Barrier::new(threads);
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
            let w = &worker;
            scope.spawn(move || w(t));
        }
        worker(0);
    });
}
