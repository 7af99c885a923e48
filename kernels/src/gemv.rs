//! Products with a few rows of `A` (decode: one to four query rows against a key or value tile),
//! which are matrix-vector work bound by how fast `B` streams from memory. `B` is read once, in
//! place (packing it would triple the traffic), 16 lanes at a time, with software prefetch a
//! few rows ahead so that the loads of a single core keep more cache lines in flight than the
//! hardware prefetcher alone does.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::Gemm;
#[cfg(target_arch = "x86_64")]
use super::Isa;
use super::gemm::{Layout, by_rows};
#[cfg(target_arch = "x86_64")]
use super::x86_avx512::lanes;

/// Rows of `A` handled together (accumulators: `ROWS` per key pair for `Nt`, `ROWS · 4` for
/// `Nn`).
const ROWS: usize = 4;
/// How many rows of `B` ahead the prefetches run (16 rows of 512 bytes: 8 KiB in flight).
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 16;

/// `C (+)= alpha · A · op(B)` for any shape, fastest for `m ≤ 4`.
///
/// # Safety
/// As [`super::attnc_sgemm_nt`] / [`super::attnc_sgemm_nn`]; `g.isa` is supported.
pub(super) unsafe fn run(g: &Gemm, layout: Layout, a: *const f32, b: *const f32, c: *mut f32) {
    if g.m == 0 || g.n == 0 {
        return;
    }
    for r0 in (0..g.m).step_by(ROWS) {
        let rows = ROWS.min(g.m - r0);
        // SAFETY: row block `r0..r0 + rows` of `A` and `C` lies within the caller's shapes.
        unsafe {
            let (a, c) = (a.add(r0 * g.lda), c.add(r0 * g.ldc));
            match (g.isa, layout) {
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512, Layout::Nt) => by_rows!(rows, [1, 2, 3], _ => 4, nt_avx512(g, a, b, c)),
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512, Layout::Nn) => by_rows!(rows, [1, 2, 3], _ => 4, nn_avx512(g, a, b, c)),
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx2, Layout::Nt) => nt_avx2(g, rows, a, b, c),
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx2, Layout::Nn) => nn_avx2(g, rows, a, b, c),
                (_, Layout::Nt) => nt_portable(g, rows, a, b, c),
                (_, Layout::Nn) => nn_portable(g, rows, a, b, c),
            }
        }
    }
}

/// Writes `alpha · sum` to `*c`, adding the old value when accumulating.
///
/// # Safety
/// `c` is valid for reads and writes.
unsafe fn put(g: &Gemm, c: *mut f32, sum: f32) {
    // SAFETY: the caller's contract.
    unsafe { *c = if g.accumulate { g.alpha * sum + *c } else { g.alpha * sum } };
}

/// [`nt_portable`] compiled for AVX2 (256-bit lanes; these products are bound by memory).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn nt_avx2(g: &Gemm, rows: usize, a: *const f32, b: *const f32, c: *mut f32) {
    // SAFETY: forwarded.
    unsafe { nt_portable(g, rows, a, b, c) }
}

/// [`nn_portable`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn nn_avx2(g: &Gemm, rows: usize, a: *const f32, b: *const f32, c: *mut f32) {
    // SAFETY: forwarded.
    unsafe { nn_portable(g, rows, a, b, c) }
}

/// `Nt` in plain Rust: one dot product per `(row, key)`, in eight interleaved partial sums
/// (which the compiler vectorises).
///
/// # Safety
/// As [`run`], for `rows` rows at `a` and `c`.
#[inline(always)]
unsafe fn nt_portable(g: &Gemm, rows: usize, a: *const f32, b: *const f32, c: *mut f32) {
    for j in 0..g.n {
        // SAFETY: key row `j < n` of `B` holds `k` elements.
        let key = unsafe { std::slice::from_raw_parts(b.add(j * g.ldb), g.k) };
        for r in 0..rows {
            // SAFETY: row `r < m` of `A` holds `k` elements.
            let q = unsafe { std::slice::from_raw_parts(a.add(r * g.lda), g.k) };
            let mut part = [0.0f32; 8];
            let (qc, kc) = (q.chunks_exact(8), key.chunks_exact(8));
            let tail: f32 = qc.remainder().iter().zip(kc.remainder()).map(|(x, y)| x * y).sum();
            for (x, y) in qc.zip(kc) {
                for t in 0..8 {
                    part[t] += x[t] * y[t];
                }
            }
            // SAFETY: `(r, j)` is inside `C`.
            unsafe { put(g, c.add(r * g.ldc + j), part.iter().sum::<f32>() + tail) };
        }
    }
}

/// `Nn` in plain Rust, row by row of `B`.
///
/// # Safety
/// As [`run`], for `rows` rows at `a` and `c`.
#[inline(always)]
unsafe fn nn_portable(g: &Gemm, rows: usize, a: *const f32, b: *const f32, c: *mut f32) {
    let mut sums = vec![0.0f32; rows * g.n];
    for p in 0..g.k {
        for r in 0..rows {
            // SAFETY: `(r, p)` is inside `A`.
            let ap = unsafe { *a.add(r * g.lda + p) };
            for (j, s) in sums[r * g.n..(r + 1) * g.n].iter_mut().enumerate() {
                // SAFETY: `(p, j)` is inside `B`.
                *s += ap * unsafe { *b.add(p * g.ldb + j) };
            }
        }
    }
    for r in 0..rows {
        for j in 0..g.n {
            // SAFETY: `(r, j)` is inside `C`.
            unsafe { put(g, c.add(r * g.ldc + j), sums[r * g.n + j]) };
        }
    }
}

/// Prefetches the `bytes` bytes at `p` (which may lie past the end of `B`: prefetches never
/// fault, and the address is formed with wrapping arithmetic).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn prefetch(p: *const f32, bytes: usize) {
    let p = p.cast::<i8>();
    for off in (0..bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off));
    }
}

/// AVX-512 `Nt`: two keys at a time, `rows × 2` independent dot-product chains over `k` in
/// vectors of 16 (masked tail), reduced at the end of each key pair.
///
/// # Safety
/// As [`run`], for `R ≤ 4` rows at `a` and `c`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn nt_avx512<const R: usize>(g: &Gemm, a: *const f32, b: *const f32, c: *mut f32) {
    let row_bytes = g.k * 4;
    let mut j = 0;
    while j < g.n {
        let pair = (g.n - j).min(2);
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        prefetch(b.wrapping_add((j + AHEAD) * g.ldb), row_bytes * pair);
        let mut p = 0;
        while p < g.k {
            let m = lanes(g.k - p);
            // SAFETY: lanes `p..min(p + 16, k)` of key rows `j..j + pair` and of `A`'s rows.
            unsafe {
                let keys = [_mm512_maskz_loadu_ps(m, b.add(j * g.ldb + p)), _mm512_maskz_loadu_ps(m, b.add((j + pair - 1) * g.ldb + p))];
                for (r, acc) in acc.iter_mut().enumerate() {
                    let q = _mm512_maskz_loadu_ps(m, a.add(r * g.lda + p));
                    acc[0] = _mm512_fmadd_ps(q, keys[0], acc[0]);
                    acc[1] = _mm512_fmadd_ps(q, keys[1], acc[1]);
                }
            }
            p += 16;
        }
        for (r, acc) in acc.iter().enumerate() {
            for (t, sum) in acc.iter().enumerate().take(pair) {
                // SAFETY: `(r, j + t)` is inside `C`.
                unsafe { put(g, c.add(r * g.ldc + j + t), _mm512_reduce_add_ps(*sum)) };
            }
        }
        j += pair;
    }
}

/// AVX-512 `Nn`: `C` columns in chunks of 64 (four vectors, masked at the end), each chunk
/// accumulating `rows × 4` vectors over every row of `B`.
///
/// # Safety
/// As [`run`], for `R ≤ 4` rows at `a` and `c`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn nn_avx512<const R: usize>(g: &Gemm, a: *const f32, b: *const f32, c: *mut f32) {
    let alpha = _mm512_set1_ps(g.alpha);
    for j0 in (0..g.n).step_by(64) {
        let width = (g.n - j0).min(64);
        let masks = [lanes(width), lanes(width.saturating_sub(16)), lanes(width.saturating_sub(32)), lanes(width.saturating_sub(48))];
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        for p in 0..g.k {
            let brow = b.wrapping_add(p * g.ldb + j0);
            if j0 == 0 {
                prefetch(b.wrapping_add((p + AHEAD) * g.ldb), g.n * 4);
            }
            // SAFETY: row `p < k` of `B`, the chunk's valid lanes; `(r, p)` inside `A`.
            unsafe {
                let mut v = [_mm512_setzero_ps(); 4];
                for (q, v) in v.iter_mut().enumerate() {
                    if masks[q] != 0 {
                        *v = _mm512_maskz_loadu_ps(masks[q], brow.add(16 * q));
                    }
                }
                for (r, acc) in acc.iter_mut().enumerate() {
                    let w = _mm512_set1_ps(*a.add(r * g.lda + p));
                    for q in 0..4 {
                        acc[q] = _mm512_fmadd_ps(w, v[q], acc[q]);
                    }
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (q, sum) in acc.iter().enumerate() {
                if masks[q] == 0 {
                    continue;
                }
                // SAFETY: the chunk's valid lanes of row `r` of `C`.
                unsafe {
                    let dst = c.add(r * g.ldc + j0 + 16 * q);
                    let old = if g.accumulate { _mm512_maskz_loadu_ps(masks[q], dst) } else { _mm512_setzero_ps() };
                    _mm512_mask_storeu_ps(dst, masks[q], _mm512_fmadd_ps(alpha, *sum, old));
                }
            }
        }
    }
}
