//! Runs a plan's steps on a scoped thread pool: every thread walks the steps in order, claims
//! chunks of each step's work items from a shared counter, and waits at a barrier before the
//! next step. A work item's result never depends on which thread runs it or how items are
//! chunked, so outputs are bit-identical for any thread count.

use super::jit::StepFn;
use attn_compiler::codegen::clif::Plan;
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

/// Flushes subnormal results and inputs to zero on this thread until dropped (x86-64: the
/// MXCSR FTZ and DAZ bits). Softmax probabilities of far-away or heavily biased keys land in
/// the subnormal range, where every multiply takes a microcode assist (measured 5× slower
/// ALiBi attention); their contribution is below f32 resolution anyway.
struct FlushDenormals {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

impl FlushDenormals {
    fn new() -> FlushDenormals {
        #[cfg(target_arch = "x86_64")]
        {
            let mut saved = 0u32;
            // SAFETY: reads and writes this thread's MXCSR; only the FTZ (bit 15) and DAZ
            // (bit 6) bits change.
            unsafe {
                std::arch::asm!("stmxcsr [{}]", in(reg) &mut saved, options(nostack));
                let flushed = saved | (1 << 15) | (1 << 6);
                std::arch::asm!("ldmxcsr [{}]", in(reg) &flushed, options(nostack));
            }
            FlushDenormals { saved }
        }
        #[cfg(not(target_arch = "x86_64"))]
        FlushDenormals {}
    }
}

impl Drop for FlushDenormals {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: restores the value read in `new`.
        unsafe {
            std::arch::asm!("ldmxcsr [{}]", in(reg) &self.saved, options(nostack));
        }
    }
}

/// Runs every step of `plan` with `threads` threads (≥ 1).
pub fn run(plan: &Plan, funcs: &[StepFn], ints: &[i64], args: Args, threads: usize) {
    let _flush = FlushDenormals::new();
    let items: Vec<i64> = plan.steps.iter().map(|s| ints.get(s.work).copied().unwrap_or(0)).collect();
    let most = items.iter().copied().max().unwrap_or(0);
    let threads = threads.clamp(1, most.max(1) as usize);
    if threads == 1 {
        for (s, step) in plan.steps.iter().enumerate() {
            if items[s] > 0 {
                args.call(funcs[step.func], 0, items[s], 0);
            }
        }
        return;
    }
    let counters: Vec<AtomicI64> = items.iter().map(|_| AtomicI64::new(0)).collect();
    let barrier = Barrier::new(threads);
    let worker = |t: usize| {
        let _flush = FlushDenormals::new();
        for (s, step) in plan.steps.iter().enumerate() {
            let n = items[s];
            if n > 0 {
                let size = chunk(n, threads);
                loop {
                    let lo = counters[s].fetch_add(size, Ordering::Relaxed);
                    if lo >= n {
                        break;
                    }
                    let hi = (lo + size).min(n);
                    args.call(funcs[step.func], lo, hi, t);
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
