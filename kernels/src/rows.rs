//! Whole-row kernels for the unfused element-wise and normalisation steps that dominate a
//! transformer block outside its matmuls: GELU (a vectorised `erfc`: 16 lanes on AVX-512, the lane kernel elsewhere) and layer
//! / RMS norm (f64 sums, as the reference interpreter); and sigmoid rows (sigmoid attention's
//! weights).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::Isa;

/// Defines `$name(isa, x, y, n)`, `y[i] = $name(x[i])` for `i < n` on `isa`: on AVX-512 the
/// 16-lane function `$vec16` (`__m512 → __m512`) over full vectors, then one masked vector for
/// the tail; elsewhere the lane kernel `lanes::$name`, compiled for AVX2 and FMA on that path.
/// The docs given are the function's.
macro_rules! lane_row {
    ($(#[$doc:meta])* $name:ident, $vec16:ident) => {
        $(#[$doc])*
        pub(super) unsafe fn $name(isa: Isa, x: *const f32, y: *mut f32, n: usize) {
            /// The AVX-512 instance.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            unsafe fn avx512(x: *const f32, y: *mut f32, n: usize) {
                super::x86_avx512::map16!($vec16, x, y, n)
            }
            /// The lane kernel compiled for AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2(x: *const f32, y: *mut f32, n: usize) {
                // SAFETY: forwarded.
                unsafe { super::lanes::$name::<true>(x, y, n) }
            }
            // SAFETY: forwarded; each arm runs only where its ISA is supported.
            unsafe {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => avx512(x, y, n),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => avx2(x, y, n),
                    _ => super::lanes::$name::<{ super::lanes::HAS_FMA }>(x, y, n),
                }
            }
        }
    };
}

lane_row!(
    /// `y[i] = sigmoid(x[i]) = 1 / (1 + exp(-x[i]))` for `i < n` on `isa`, with the kernels' `exp`
    /// (0 where `x ≤ -88.7`, NaN stays NaN).
    ///
    /// # Safety
    /// `x` and `y` address `n` elements (they may be the same buffer); `isa` is supported.
    sigmoid,
    sigmoid16
);

/// Sigmoid of 16 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn sigmoid16(x: __m512) -> __m512 {
    let one = _mm512_set1_ps(1.0);
    let e = super::exp::exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    _mm512_div_ps(one, _mm512_add_ps(one, e))
}

/// Abramowitz & Stegun 7.1.26: `erfc(z) ≈ t·P(t)·e^{-z²}`, `t = 1/(1 + p·z)` for `z ≥ 0`
/// (absolute error below 1.5e-7).
pub(super) const ERFC_P: f32 = 0.327_591_1;
/// Its polynomial, highest degree first (`P(t) = a1 + a2 t + … + a5 t⁴`).
pub(super) const ERFC_A: [f32; 5] = [1.061_405_4, -1.453_152_1, 1.421_413_8, -0.284_496_74, 0.254_829_6];
pub(super) const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;

lane_row!(
    /// `y[i] = gelu(x[i]) = x/2 · (1 + erf(x/√2))` for `i < n` on `isa`. Negative inputs use
    /// `1 + erf(-z) = erfc(z)` directly, so the far negative tail keeps its relative accuracy.
    ///
    /// # Safety
    /// `x` and `y` address `n` elements (they may be the same buffer); `isa` is supported.
    gelu,
    gelu16
);

/// GELU of 16 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn gelu16(x: __m512) -> __m512 {
    let z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(FRAC_1_SQRT_2));
    let t = _mm512_div_ps(_mm512_set1_ps(1.0), _mm512_fmadd_ps(z, _mm512_set1_ps(ERFC_P), _mm512_set1_ps(1.0)));
    let mut p = _mm512_set1_ps(ERFC_A[0]);
    for a in &ERFC_A[1..] {
        p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(*a));
    }
    let e = super::exp::exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), z), z));
    let erfc = _mm512_mul_ps(_mm512_mul_ps(t, p), e);
    let negative = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_setzero_ps());
    let one_plus_erf = _mm512_mask_blend_ps(negative, _mm512_sub_ps(_mm512_set1_ps(2.0), erfc), erfc);
    _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5), x), one_plus_erf)
}

/// Sums `f(x[i])` over a row in f64 with eight independent accumulators (so the adds
/// pipeline and the compiler can vectorise them).
fn sum8(x: &[f32], f: impl Fn(f64) -> f64) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += f(f64::from(*v));
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|v| f(f64::from(*v))).sum();
    acc.iter().sum::<f64>() + tail
}

/// Layer norm (`rms = false`: `(x - mean) / sqrt(var + eps) · gamma + beta`) or RMS norm
/// (`rms = true`: `x / sqrt(mean(x²) + eps) · gamma`, `beta` unused) of one row of `n`
/// elements, in f64 as the reference interpreter; `beta` may be null for no shift.
///
/// # Safety
/// `x`, `gamma` and `y` address `n` elements (`x` may be `y`), and so does `beta` unless null.
pub(super) unsafe fn norm_row(x: *const f32, gamma: *const f32, beta: *const f32, y: *mut f32, n: usize, eps: f64, rms: bool) {
    if n == 0 {
        return;
    }
    // SAFETY: the caller's contract; the slice is last used before anything is written.
    let xs = unsafe { std::slice::from_raw_parts(x, n) };
    let count = n as f64;
    let mean = if rms { 0.0 } else { sum8(xs, |v| v) / count };
    let var = sum8(xs, |v| (v - mean) * (v - mean)) / count;
    // One division per row: `(x - mean) · (1/σ)` is within an f64 ulp of `(x - mean) / σ`.
    let inv = 1.0 / (var + eps).sqrt();
    for i in 0..n {
        // SAFETY: `i < n` for every pointer; `x[i]` is read before `y[i]` is written.
        unsafe {
            let mut v = (f64::from(*x.add(i)) - mean) * inv * f64::from(*gamma.add(i));
            if !beta.is_null() {
                v += f64::from(*beta.add(i));
            }
            *y.add(i) = v as f32;
        }
    }
}

/// `dst[c·ldd + r] = src[r·lds + c]` for `r < rows`, `c < cols`, in 8 × 8 blocks (each block's
/// reads and writes stay within eight cache lines), by register shuffles on AVX2 and AVX-512
/// machines.
///
/// # Safety
/// `src` addresses `(rows-1)·lds + cols` elements and `dst` `(cols-1)·ldd + rows`, not
/// overlapping; both unused when `rows` or `cols` is 0.
pub(super) unsafe fn transpose(src: *const f32, lds: usize, rows: usize, cols: usize, dst: *mut f32, ldd: usize) {
    #[cfg(target_arch = "x86_64")]
    if super::isa() >= super::Isa::Avx2 {
        // SAFETY: forwarded; the path is supported.
        return unsafe { transpose_avx(src, lds, rows, cols, dst, ldd) };
    }
    // SAFETY: forwarded.
    unsafe { transpose_blocks(src, lds, rows, cols, dst, ldd, 0, 0) }
}

/// The scalar transpose of the part of the matrix from row `r_from` or column `c_from` on
/// (the edges the 8 × 8 register blocks leave).
///
/// # Safety
/// As [`transpose`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn transpose_blocks(src: *const f32, lds: usize, rows: usize, cols: usize, dst: *mut f32, ldd: usize, r_from: usize, c_from: usize) {
    const B: usize = 8;
    for r0 in (0..rows).step_by(B) {
        for c0 in (0..cols).step_by(B) {
            if r0 + B <= r_from && c0 + B <= c_from {
                continue;
            }
            for r in r0..(r0 + B).min(rows) {
                for c in c0..(c0 + B).min(cols) {
                    // SAFETY: `r < rows`, `c < cols`: inside both matrices by the contract.
                    unsafe { *dst.add(c * ldd + r) = *src.add(r * lds + c) };
                }
            }
        }
    }
}

/// [`transpose`] with 8 × 8 blocks transposed in AVX registers; the edges by
/// [`transpose_blocks`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose_avx(src: *const f32, lds: usize, rows: usize, cols: usize, dst: *mut f32, ldd: usize) {
    use std::arch::x86_64::*;
    let (full_r, full_c) = (rows / 8 * 8, cols / 8 * 8);
    for r0 in (0..full_r).step_by(8) {
        for c0 in (0..full_c).step_by(8) {
            // SAFETY: the block's 8 rows and 8 columns lie inside both matrices.
            unsafe {
                let row = |k: usize| _mm256_loadu_ps(src.add((r0 + k) * lds + c0));
                let (a0, a1, a2, a3, a4, a5, a6, a7) = (row(0), row(1), row(2), row(3), row(4), row(5), row(6), row(7));
                let (t0, t1) = (_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
                let (t2, t3) = (_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
                let (t4, t5) = (_mm256_unpacklo_ps(a4, a5), _mm256_unpackhi_ps(a4, a5));
                let (t6, t7) = (_mm256_unpacklo_ps(a6, a7), _mm256_unpackhi_ps(a6, a7));
                let (u0, u1) = (_mm256_shuffle_ps::<0x44>(t0, t2), _mm256_shuffle_ps::<0xEE>(t0, t2));
                let (u2, u3) = (_mm256_shuffle_ps::<0x44>(t1, t3), _mm256_shuffle_ps::<0xEE>(t1, t3));
                let (u4, u5) = (_mm256_shuffle_ps::<0x44>(t4, t6), _mm256_shuffle_ps::<0xEE>(t4, t6));
                let (u6, u7) = (_mm256_shuffle_ps::<0x44>(t5, t7), _mm256_shuffle_ps::<0xEE>(t5, t7));
                let out = [
                    _mm256_permute2f128_ps::<0x20>(u0, u4),
                    _mm256_permute2f128_ps::<0x20>(u1, u5),
                    _mm256_permute2f128_ps::<0x20>(u2, u6),
                    _mm256_permute2f128_ps::<0x20>(u3, u7),
                    _mm256_permute2f128_ps::<0x31>(u0, u4),
                    _mm256_permute2f128_ps::<0x31>(u1, u5),
                    _mm256_permute2f128_ps::<0x31>(u2, u6),
                    _mm256_permute2f128_ps::<0x31>(u3, u7),
                ];
                for (k, v) in out.iter().enumerate() {
                    _mm256_storeu_ps(dst.add((c0 + k) * ldd + r0), *v);
                }
            }
        }
    }
    // SAFETY: forwarded; only what the blocks above did not cover.
    unsafe { transpose_blocks(src, lds, rows, cols, dst, ldd, full_r, full_c) }
}
