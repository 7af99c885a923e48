//! The AVX2+FMA path: micro-tiles of up to 6 rows × 16 columns (12 ymm accumulators, two panel
//! vectors and a broadcast: 15 of the 16 ymm registers), the classic Haswell-class blocking.

use super::gemm::{Kernel, Layout, Tile, by_rows, pack_generic};
use std::arch::x86_64::*;

/// AVX2+FMA micro-tiles.
pub(super) struct Avx2;

impl Kernel for Avx2 {
    const NR: usize = 16;
    const MR: usize = 6;
    const KC: usize = 256;
    const NC: usize = 256;

    unsafe fn pack(layout: Layout, b: *const f32, ldb: usize, kc: usize, nc: usize, out: *mut f32) {
        // SAFETY: forwarded; this path runs only where AVX2 and FMA are supported.
        unsafe { pack(layout, b, ldb, kc, nc, out) }
    }

    unsafe fn tile(kc: usize, a: *const f32, lda: usize, panel: *const f32, ldp: usize, t: &Tile) {
        // SAFETY: forwarded; this path runs only where AVX2 and FMA are supported.
        unsafe { by_rows!(t.rows, [6, 5, 4, 3, 2], _ => 1, micro(kc, a, lda, panel, ldp, t)) }
    }
}

/// Packs `B` panels: copies for `Nn` (compiled for AVX2), 8×8 register transposes for the
/// full blocks of `Nt` (scalar for the edges), as on the AVX-512 path.
#[target_feature(enable = "avx2,fma")]
unsafe fn pack(layout: Layout, b: *const f32, ldb: usize, kc: usize, nc: usize, out: *mut f32) {
    if layout == Layout::Nn {
        // SAFETY: forwarded.
        return unsafe { pack_generic::<16>(layout, b, ldb, kc, nc, out) };
    }
    for (jr, j0) in (0..nc).step_by(16).enumerate() {
        for eighth in 0..2 {
            let rows = (nc - j0).saturating_sub(8 * eighth).min(8);
            let dst = out.wrapping_add(jr * kc * 16 + 8 * eighth);
            for p0 in (0..kc).step_by(8) {
                let (src, dst) = (b.wrapping_add((j0 + 8 * eighth) * ldb + p0), dst.wrapping_add(p0 * 16));
                let len = (kc - p0).min(8);
                // SAFETY: `rows` rows of `len` floats from `src` lie in the block; `len` panel
                // rows of 8 from `dst` lie in the panel.
                unsafe {
                    if rows == 8 && len == 8 {
                        transpose_full(src, ldb, dst);
                    } else {
                        for p in 0..len {
                            for t in 0..8 {
                                *dst.add(p * 16 + t) = if t < rows { *src.add(t * ldb + p) } else { 0.0 };
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Transposes the full 8×8 block at `src` into 8 rows of 8 at `dst` (stride 16): register `g`
/// of half `h` holds 4-float pieces of rows `g` and `g + 4` (a load and an insert from
/// memory), then a 4×4 transpose inside each 128-bit lane makes whole columns.
///
/// # Safety
/// `src` addresses 8 rows (stride `ldb`) of 8 floats; `dst` 8 rows (stride 16) of 8.
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose_full(src: *const f32, ldb: usize, dst: *mut f32) {
    for h in 0..2 {
        let mut r = [_mm256_setzero_ps(); 4];
        for (g, v) in r.iter_mut().enumerate() {
            // SAFETY: rows `g, g + 4 < 8`, columns `4h..4h+4 ≤ 8`.
            unsafe {
                let lo = _mm256_castps128_ps256(_mm_loadu_ps(src.add(g * ldb + 4 * h)));
                *v = _mm256_insertf128_ps::<1>(lo, _mm_loadu_ps(src.add((g + 4) * ldb + 4 * h)));
            }
        }
        let (t0, t1) = (_mm256_castps_pd(_mm256_unpacklo_ps(r[0], r[1])), _mm256_castps_pd(_mm256_unpackhi_ps(r[0], r[1])));
        let (t2, t3) = (_mm256_castps_pd(_mm256_unpacklo_ps(r[2], r[3])), _mm256_castps_pd(_mm256_unpackhi_ps(r[2], r[3])));
        let cols = [_mm256_unpacklo_pd(t0, t2), _mm256_unpackhi_pd(t0, t2), _mm256_unpacklo_pd(t1, t3), _mm256_unpackhi_pd(t1, t3)];
        for (c, v) in cols.into_iter().enumerate() {
            // SAFETY: panel row `4h + c < 8`.
            unsafe { _mm256_storeu_ps(dst.add((4 * h + c) * 16), _mm256_castpd_ps(v)) };
        }
    }
}

/// Lane mask (all ones in the first `n` of 8 lanes) for masked loads and stores.
#[target_feature(enable = "avx2,fma")]
pub(super) fn lanes(n: usize) -> __m256i {
    let n = n.min(8) as i32;
    _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
}

/// `MR × 16` micro-tile: `C (+)= alpha · A[MR × kc] · panel[kc × 16]`.
#[target_feature(enable = "avx2,fma")]
unsafe fn micro<const MR: usize>(kc: usize, a: *const f32, lda: usize, panel: *const f32, ldp: usize, t: &Tile) {
    let mut lo = [_mm256_setzero_ps(); MR];
    let mut hi = [_mm256_setzero_ps(); MR];
    let rows: [*const f32; MR] = std::array::from_fn(|i| a.wrapping_add(i * lda));
    // SAFETY (whole loop): rows `< MR` of `A` hold `kc` elements; the panel `kc × 16`.
    for p in 0..kc {
        let (b0, b1) = unsafe { (_mm256_loadu_ps(panel.add(p * ldp)), _mm256_loadu_ps(panel.add(p * ldp + 8))) };
        for i in 0..MR {
            let ai = _mm256_set1_ps(unsafe { *rows[i].add(p) });
            lo[i] = _mm256_fmadd_ps(ai, b0, lo[i]);
            hi[i] = _mm256_fmadd_ps(ai, b1, hi[i]);
        }
    }
    let alpha = _mm256_set1_ps(t.alpha);
    if t.cols == 16 {
        // Full tiles store whole vectors: a masked store is microcoded on AMD cores (~20
        // cycles each on Zen 2/3), which made the 12 of a 6-row tile a third of a k = 64 call.
        for i in 0..MR {
            let c0 = t.c.wrapping_add(i * t.ldc);
            let c1 = c0.wrapping_add(8);
            // SAFETY: row `i` of the tile holds 16 elements.
            unsafe {
                let (v0, v1) = if t.accumulate {
                    (_mm256_fmadd_ps(lo[i], alpha, _mm256_loadu_ps(c0)), _mm256_fmadd_ps(hi[i], alpha, _mm256_loadu_ps(c1)))
                } else {
                    (_mm256_mul_ps(lo[i], alpha), _mm256_mul_ps(hi[i], alpha))
                };
                _mm256_storeu_ps(c0, v0);
                _mm256_storeu_ps(c1, v1);
            }
        }
        return;
    }
    let (m0, m1) = (lanes(t.cols), lanes(t.cols.saturating_sub(8)));
    for i in 0..MR {
        let c0 = t.c.wrapping_add(i * t.ldc);
        let c1 = c0.wrapping_add(8);
        // SAFETY: masked lanes stay inside row `i` of the tile; masked-off lanes are not touched.
        unsafe {
            let (v0, v1) = if t.accumulate {
                (_mm256_fmadd_ps(lo[i], alpha, _mm256_maskload_ps(c0, m0)), _mm256_fmadd_ps(hi[i], alpha, _mm256_maskload_ps(c1, m1)))
            } else {
                (_mm256_mul_ps(lo[i], alpha), _mm256_mul_ps(hi[i], alpha))
            };
            _mm256_maskstore_ps(c0, m0, v0);
            _mm256_maskstore_ps(c1, m1, v1);
        }
    }
}
