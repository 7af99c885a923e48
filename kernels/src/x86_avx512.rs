//! The AVX-512F path: micro-tiles of up to 12 rows × 32 columns (24 zmm accumulators, two
//! panel vectors per `k` step, each `A` element broadcast from memory).
//!
//! Per `k` step a 12-row tile issues 24 FMAs against 2 panel loads and 12 broadcast loads,
//! which keeps both FMA ports busy without saturating the load ports; 24 independent
//! accumulators cover the FMA latency (4 cycles × 2 ports). On L1-resident data the tile runs
//! at ~99% of the FMA loop's rate, with 8, 12 or 14 rows alike, and 14 rows gained nothing on
//! the benchmark shapes. Unrolling `k` by hand made LLVM hoist the broadcasts and spill, so
//! the loop is left plain.

use super::gemm::{Kernel, Layout, Tile, by_rows, pack_generic};
use std::arch::x86_64::*;

/// AVX-512F micro-tiles.
pub(super) struct Avx512;

impl Kernel for Avx512 {
    const NR: usize = 32;
    const MR: usize = 12;

    unsafe fn pack(layout: Layout, b: *const f32, ldb: usize, kc: usize, nc: usize, out: *mut f32) {
        // SAFETY: forwarded; this path runs only where AVX-512F is supported.
        unsafe { pack(layout, b, ldb, kc, nc, out) }
    }

    unsafe fn tile(kc: usize, a: *const f32, lda: usize, panel: *const f32, ldp: usize, t: &Tile) {
        // SAFETY: forwarded; this path runs only where AVX-512F is supported.
        unsafe { by_rows!(t.rows, [12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2], _ => 1, micro(kc, a, lda, panel, ldp, t)) }
    }
}

/// Packs `B` panels: copies for `Nn` (compiled for AVX-512), 16×16 register transposes for
/// `Nt`. A scalar transpose costs ~1 cycle per element, which made packing 25% of a 64-row
/// `Q·Kᵀ` tile; the register transposes bring it to ~9%.
#[target_feature(enable = "avx512f")]
unsafe fn pack(layout: Layout, b: *const f32, ldb: usize, kc: usize, nc: usize, out: *mut f32) {
    if layout == Layout::Nn {
        // SAFETY: forwarded.
        return unsafe { pack_generic::<32>(layout, b, ldb, kc, nc, out) };
    }
    for (jr, j0) in (0..nc).step_by(32).enumerate() {
        for half in 0..2 {
            // Rows of `B` (columns of the panel) in this 16-wide half; the rest are zero.
            let rows = (nc - j0).saturating_sub(16 * half).min(16);
            let dst = out.wrapping_add(jr * kc * 32 + 16 * half);
            for p0 in (0..kc).step_by(16) {
                let src = b.wrapping_add((j0 + 16 * half) * ldb + p0);
                let dst = dst.wrapping_add(p0 * 32);
                // SAFETY: the block covers `rows` rows of `kc - p0` elements from `src`, and
                // the panel `kc` rows of 32 from `dst - 16·half`.
                unsafe {
                    if rows == 16 && kc - p0 >= 16 {
                        transpose_full(src, ldb, dst);
                    } else {
                        transpose_part(src, ldb, rows, kc - p0, dst);
                    }
                }
            }
        }
    }
}

/// Transposes the full 16×16 block at `src` into 16 rows of 16 at `dst` (stride 32).
///
/// Register `g` of quadrant `q` gathers 4-float pieces of rows `g, g+4, g+8, g+12` with
/// inserts from memory (they run on the load ports and port 0), so only the 4×4 transposes
/// inside 128-bit lanes need shuffles (port 5): 32 shuffles instead of 64.
///
/// # Safety
/// `src` addresses 16 rows (stride `ldb`) of 16 floats; `dst` 16 rows (stride 32) of 16.
#[target_feature(enable = "avx512f")]
unsafe fn transpose_full(src: *const f32, ldb: usize, dst: *mut f32) {
    for q in 0..4 {
        let mut r = [_mm512_setzero_ps(); 4];
        for (g, v) in r.iter_mut().enumerate() {
            // SAFETY: rows `g + 4l < 16`, columns `4q..4q+4 ≤ 16`.
            unsafe {
                let piece = |l: usize| _mm_loadu_ps(src.add((g + 4 * l) * ldb + 4 * q));
                let x = _mm512_castps128_ps512(piece(0));
                let x = _mm512_insertf32x4::<1>(x, piece(1));
                let x = _mm512_insertf32x4::<2>(x, piece(2));
                *v = _mm512_insertf32x4::<3>(x, piece(3));
            }
        }
        // Lane `l` of `r[g]` is row `4l + g`: a 4×4 transpose per lane makes whole columns.
        let (t0, t1) = (_mm512_castps_pd(_mm512_unpacklo_ps(r[0], r[1])), _mm512_castps_pd(_mm512_unpackhi_ps(r[0], r[1])));
        let (t2, t3) = (_mm512_castps_pd(_mm512_unpacklo_ps(r[2], r[3])), _mm512_castps_pd(_mm512_unpackhi_ps(r[2], r[3])));
        let cols = [_mm512_unpacklo_pd(t0, t2), _mm512_unpackhi_pd(t0, t2), _mm512_unpacklo_pd(t1, t3), _mm512_unpackhi_pd(t1, t3)];
        for (c, v) in cols.into_iter().enumerate() {
            // SAFETY: panel row `4q + c < 16`.
            unsafe { _mm512_storeu_ps(dst.add((4 * q + c) * 32), _mm512_castpd_ps(v)) };
        }
    }
}

/// Transposes a partial block (`rows ≤ 16` rows of `len ≤ 16` floats; the rest read as 0)
/// into `len` rows of 16 at `dst` (stride 32).
///
/// # Safety
/// `src` addresses `rows` rows (stride `ldb`) of `len` floats; `dst` `len` rows of 16.
#[target_feature(enable = "avx512f")]
unsafe fn transpose_part(src: *const f32, ldb: usize, rows: usize, len: usize, dst: *mut f32) {
    let m = lanes(len);
    let mut r = [_mm512_setzero_ps(); 16];
    for (t, v) in r.iter_mut().enumerate().take(rows) {
        // SAFETY: row `t < rows`, `len` lanes.
        *v = unsafe { _mm512_maskz_loadu_ps(m, src.add(t * ldb)) };
    }
    transpose16(&mut r);
    for (p, v) in r.iter().enumerate().take(len) {
        // SAFETY: row `p < len` of `dst`.
        unsafe { _mm512_storeu_ps(dst.add(p * 32), *v) };
    }
}

/// Transposes a 16×16 block held as 16 row vectors (64 shuffles: pairs of 32-bit, then
/// 64-bit elements within 128-bit lanes, then 128-bit lanes twice). Only for partial blocks,
/// so the register pressure (it spills a little) does not matter.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16(r: &mut [__m512; 16]) {
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // After this loop `r[4i + c]`'s 128-bit lane `q` is column `4q + c` of rows `4i..4i+4`.
    for i in 0..4 {
        let (a0, a1) = (_mm512_castps_pd(t[4 * i]), _mm512_castps_pd(t[4 * i + 1]));
        let (b0, b1) = (_mm512_castps_pd(t[4 * i + 2]), _mm512_castps_pd(t[4 * i + 3]));
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, b0));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, b0));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, b1));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, b1));
    }
    // Gather lane `q` of `r[c], r[4+c], r[8+c], r[12+c]` into column `4q + c`.
    let s = *r;
    for c in 0..4 {
        let u0 = _mm512_shuffle_f32x4::<0x88>(s[c], s[4 + c]);
        let u1 = _mm512_shuffle_f32x4::<0xdd>(s[c], s[4 + c]);
        let v0 = _mm512_shuffle_f32x4::<0x88>(s[8 + c], s[12 + c]);
        let v1 = _mm512_shuffle_f32x4::<0xdd>(s[8 + c], s[12 + c]);
        r[c] = _mm512_shuffle_f32x4::<0x88>(u0, v0);
        r[4 + c] = _mm512_shuffle_f32x4::<0x88>(u1, v1);
        r[8 + c] = _mm512_shuffle_f32x4::<0xdd>(u0, v0);
        r[12 + c] = _mm512_shuffle_f32x4::<0xdd>(u1, v1);
    }
}

/// `y[i] = $f(x[i])` for `i < n` by a 16-lane function `$f` (`__m512 → __m512`): full vectors,
/// then one masked vector for the tail. A macro rather than a generic function, so that `$f` is
/// called (and inlined) inside the caller's `#[target_feature]` context.
///
/// # Safety
/// Expands to unsafe code: `x` and `y` address `n` elements (they may be the same buffer), and
/// the caller enables AVX-512F.
macro_rules! map16 {
    ($f:ident, $x:expr, $y:expr, $n:expr) => {{
        let (x, y, n): (*const f32, *mut f32, usize) = ($x, $y, $n);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 ≤ n`.
            unsafe { _mm512_storeu_ps(y.add(i), $f(_mm512_loadu_ps(x.add(i)))) };
            i += 16;
        }
        if i < n {
            let m = super::x86_avx512::lanes(n - i);
            // SAFETY: only the `n - i` valid lanes are read or written.
            unsafe { _mm512_mask_storeu_ps(y.add(i), m, $f(_mm512_maskz_loadu_ps(m, x.add(i)))) };
        }
    }};
}
pub(super) use map16;

/// Bit mask of the first `n` of 16 lanes (all for `n ≥ 16`).
#[inline(always)]
pub(super) fn lanes(n: usize) -> __mmask16 {
    if n >= 16 { 0xffff } else { ((1u32 << n) - 1) as __mmask16 }
}

/// `MR × 32` micro-tile: `C (+)= alpha · A[MR × kc] · panel[kc × 32]`.
#[target_feature(enable = "avx512f")]
unsafe fn micro<const MR: usize>(kc: usize, a: *const f32, lda: usize, panel: *const f32, ldp: usize, t: &Tile) {
    let mut lo = [_mm512_setzero_ps(); MR];
    let mut hi = [_mm512_setzero_ps(); MR];
    let rows: [*const f32; MR] = std::array::from_fn(|i| a.wrapping_add(i * lda));
    // SAFETY (whole loop): rows `< MR` of `A` hold `kc` elements; the panel `kc × 32`.
    for p in 0..kc {
        let (b0, b1) = unsafe { (_mm512_loadu_ps(panel.add(p * ldp)), _mm512_loadu_ps(panel.add(p * ldp + 16))) };
        for i in 0..MR {
            let ai = _mm512_set1_ps(unsafe { *rows[i].add(p) });
            lo[i] = _mm512_fmadd_ps(ai, b0, lo[i]);
            hi[i] = _mm512_fmadd_ps(ai, b1, hi[i]);
        }
    }
    let (m0, m1) = (lanes(t.cols), lanes(t.cols.saturating_sub(16)));
    let alpha = _mm512_set1_ps(t.alpha);
    for i in 0..MR {
        let c0 = t.c.wrapping_add(i * t.ldc);
        let c1 = c0.wrapping_add(16);
        // SAFETY: masked lanes stay inside row `i` of the tile; masked-off lanes are not touched.
        unsafe {
            let (v0, v1) = if t.accumulate {
                (_mm512_fmadd_ps(lo[i], alpha, _mm512_maskz_loadu_ps(m0, c0)), _mm512_fmadd_ps(hi[i], alpha, _mm512_maskz_loadu_ps(m1, c1)))
            } else {
                (_mm512_mul_ps(lo[i], alpha), _mm512_mul_ps(hi[i], alpha))
            };
            _mm512_mask_storeu_ps(c0, m0, v0);
            _mm512_mask_storeu_ps(c1, m1, v1);
        }
    }
}
