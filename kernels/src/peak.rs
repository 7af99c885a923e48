//! The arithmetic peak of one core on each instruction-set path, measured: what `attnc bench`
//! and `examples/kernel_bench.rs` report percentages against.
//!
//! Each path's loop runs 12 independent multiply-add chains on its vectors (enough to cover
//! the latency on two pipes): fused 512-bit or 256-bit FMAs, or, on the portable path, the
//! multiply and add that the baseline target has (SSE2 on x86-64, fused on AArch64). A
//! measurement is the best of [`PEAK_RUNS`] short runs after a warm-up: the best is stable
//! where a median moves with the clock ramp and with neighbours on a shared machine.

use super::Isa;
use super::lanes::HAS_FMA;
#[cfg(target_arch = "x86_64")]
use super::vector::Vector;
use std::hint::black_box;
use std::time::Instant;

/// Short runs per measurement (each ~0.5–2 ms).
pub const PEAK_RUNS: usize = 15;
/// Rounds of 12 multiply-adds per run.
const ITERS: usize = 300_000;
/// How long the loop spins untimed first, so that the core has left its low-power clock.
const WARM_UP: std::time::Duration = std::time::Duration::from_millis(30);

/// The path's multiply-add throughput on one core in GFLOP/s: best of [`PEAK_RUNS`] runs.
/// `None` when this CPU cannot run the path.
pub fn peak_gflops(isa: Isa) -> Option<f64> {
    if !isa.is_supported() {
        return None;
    }
    let start = Instant::now();
    while start.elapsed() < WARM_UP {
        one_run(isa);
    }
    (0..PEAK_RUNS).map(|_| one_run(isa)).reduce(f64::max)
}

/// One timed run of the path's loop, in GFLOP/s (the path is supported).
pub fn one_run(isa: Isa) -> f64 {
    let start = Instant::now();
    let flops = match isa {
        // SAFETY (both x86 arms): callers pass only paths this CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { fma512(black_box(ITERS)) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { fma256(black_box(ITERS)) },
        _ => lanes4(black_box(ITERS)),
    };
    flops / start.elapsed().as_secs_f64().max(1e-9) / 1e9
}

/// `iters` rounds of 12 independent multiply-adds on `V`; returns the FLOPs done.
///
/// # Safety
/// `V`'s instructions are supported: called inside a wrapper of its path.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn fma_chains<V: Vector>(iters: usize) -> f64 {
    // SAFETY: the caller's contract.
    unsafe {
        let (m, c) = (V::splat(0.999_999), V::splat(1e-7));
        let mut acc = [V::splat(1.0); 12];
        for _ in 0..iters {
            for a in &mut acc {
                *a = a.madd(m, c);
            }
        }
        black_box(acc);
    }
    (2 * V::LANES * 12 * iters) as f64
}

/// `iters` rounds of 12 independent 512-bit FMAs; returns the FLOPs done.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fma512(iters: usize) -> f64 {
    // SAFETY: AVX-512F is enabled here.
    unsafe { fma_chains::<std::arch::x86_64::__m512>(iters) }
}

/// `iters` rounds of 12 independent 256-bit FMAs; returns the FLOPs done.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma256(iters: usize) -> f64 {
    // SAFETY: AVX2 and FMA are enabled here.
    unsafe { fma_chains::<std::arch::x86_64::__m256>(iters) }
}

/// `iters` rounds of 12 independent 4-lane multiply-adds in plain Rust, compiled for the
/// baseline target (128-bit vectors; fused only where [`HAS_FMA`]); returns the FLOPs done.
fn lanes4(iters: usize) -> f64 {
    let (m, c) = (0.999_999f32, 1e-7f32);
    let mut acc = [[1.0f32; 4]; 12];
    for _ in 0..iters {
        for a in &mut acc {
            for x in a.iter_mut() {
                *x = if HAS_FMA { x.mul_add(m, c) } else { *x * m + c };
            }
        }
    }
    black_box(acc);
    (2 * 4 * 12 * iters) as f64
}
