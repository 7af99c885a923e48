//! The portable path: plain Rust for any target (and the reference the SIMD paths are compared
//! with in tests besides the f64 oracle). The fixed-width inner loops let the compiler
//! vectorise with whatever the baseline target offers (SSE2 on x86-64).

use super::gemm::{Kernel, Layout, Tile, pack_generic};

/// Plain-Rust micro-tiles of up to 4 rows × 16 columns.
pub(super) struct Portable;

impl Kernel for Portable {
    const NR: usize = 16;
    const MR: usize = 4;

    unsafe fn pack(layout: Layout, b: *const f32, ldb: usize, kc: usize, nc: usize, out: *mut f32) {
        // SAFETY: forwarded.
        unsafe { pack_generic::<16>(layout, b, ldb, kc, nc, out) }
    }

    unsafe fn tile(kc: usize, a: *const f32, lda: usize, panel: *const f32, ldp: usize, t: &Tile) {
        let mut acc = [[0.0f32; 16]; 4];
        for p in 0..kc {
            // SAFETY: the panel holds `kc` rows of 16.
            let b = unsafe { &*(panel.add(p * ldp) as *const [f32; 16]) };
            for (i, row) in acc.iter_mut().enumerate().take(t.rows) {
                // SAFETY: row `i < rows` of `A` holds `kc` elements.
                let ai = unsafe { *a.add(i * lda + p) };
                for (r, bj) in row.iter_mut().zip(b) {
                    *r += ai * bj;
                }
            }
        }
        for (i, row) in acc.iter().enumerate().take(t.rows) {
            for (j, v) in row.iter().enumerate().take(t.cols) {
                // SAFETY: `(i, j)` is inside the tile.
                unsafe {
                    let dst = t.c.add(i * t.ldc + j);
                    *dst = if t.accumulate { t.alpha * v + *dst } else { t.alpha * v };
                }
            }
        }
    }
}

/// `y[i] = exp(scale·x[i] + bias[i] - shift)` (no bias when `bias` is null) with the standard
/// library's `exp`, returning the sum.
///
/// # Safety
/// `x` and `y` address `n` elements (they may be the same buffer), and so does `bias` unless it
/// is null.
pub(super) unsafe fn exp_sum(x: *const f32, scale: f32, bias: *const f32, y: *mut f32, n: usize, shift: f32) -> f32 {
    let mut sum = 0.0f32;
    for i in 0..n {
        // SAFETY: `i < n`.
        unsafe {
            let b = if bias.is_null() { 0.0 } else { *bias.add(i) };
            // Tiny probabilities are 0, as on the SIMD paths.
            let e = super::exp::exp_flushed(scale * *x.add(i) + b - shift);
            *y.add(i) = e;
            sum += e;
        }
    }
    sum
}

/// `y[i] = tanh(x[i])` with the standard library's `tanh`.
///
/// # Safety
/// `x` and `y` address `n` elements (they may be the same buffer).
pub(super) unsafe fn tanh(x: *const f32, y: *mut f32, n: usize) {
    for i in 0..n {
        // SAFETY: `i < n`.
        unsafe { *y.add(i) = (*x.add(i)).tanh() };
    }
}
