//! Vectorised `exp` for the online softmax: `y = exp(x - shift)` and the sum of `y`.
//!
//! Method (Cephes `expf`): `n = round(x·log2 e)`, `r = x − n·ln 2` in two FMA steps (ln 2 split
//! into an exact high part and a low correction), `exp(r) = 1 + r + r²·P(r)` with a degree-5
//! polynomial on `|r| ≤ ln2/2` (≈1 ulp), then scaling by `2ⁿ`. Inputs are clamped to
//! `[-104, 89]` first: below, the result rounds to 0 (so `exp(-inf) = 0`); above, it overflows
//! to `inf`. The clamp keeps NaN (the NaN operand is the one `max`/`min` return).
//! AVX-512 scales with `vscalefps` (one rounding, exact into subnormals); AVX2 multiplies by
//! `2^⌊n/2⌋` (exact, normal) then by `2^⌈n/2⌉`, so the single rounding is the last multiply.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::Isa;

/// Below this every `exp` rounds to 0.
const LO: f32 = -104.0;
/// Above this every `exp` overflows.
const HI: f32 = 89.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// High part of ln 2 (few mantissa bits, so `n · LN2_HI` is exact for `|n| ≤ 150`).
const LN2_HI: f32 = 0.693_359_4;
/// `ln 2 − LN2_HI`.
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes `expf` polynomial, highest degree first.
const P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];

/// `y[i] = exp(x[i] - shift)` for `i < n` on `isa`, returning the sum.
///
/// # Safety
/// `x` and `y` address `n` elements (they may be the same buffer); `isa` is supported.
pub(super) unsafe fn exp_sum(isa: Isa, x: *const f32, y: *mut f32, n: usize, shift: f32) -> f32 {
    // SAFETY: forwarded; each arm runs only where its ISA is supported.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => exp_sum_avx512(x, y, n, shift),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => exp_sum_avx2(x, y, n, shift),
            _ => super::portable::exp_sum(x, y, n, shift),
        }
    }
}

/// `exp` of 16 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn exp16(x: __m512) -> __m512 {
    let x = _mm512_min_ps(_mm512_set1_ps(HI), _mm512_max_ps(_mm512_set1_ps(LO), x));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(P[0]);
    for c in &P[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
    }
    let e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0));
    _mm512_scalef_ps(e, n)
}

/// AVX-512 `exp_sum`: full vectors, then one masked vector for the tail.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_sum_avx512(x: *const f32, y: *mut f32, n: usize, shift: f32) -> f32 {
    let s = _mm512_set1_ps(shift);
    let mut sum = _mm512_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: `i + 16 ≤ n`.
        unsafe {
            let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x.add(i)), s));
            _mm512_storeu_ps(y.add(i), e);
            sum = _mm512_add_ps(sum, e);
        }
        i += 16;
    }
    if i < n {
        let m = ((1u32 << (n - i)) - 1) as __mmask16;
        // SAFETY: only the `n - i` valid lanes are read or written.
        unsafe {
            let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x.add(i)), s));
            _mm512_mask_storeu_ps(y.add(i), m, e);
            sum = _mm512_mask_add_ps(sum, m, sum, e);
        }
    }
    _mm512_reduce_add_ps(sum)
}

/// `2^n` for integer lanes `n` in the normal exponent range.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn pow2i(n: __m256i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n, _mm256_set1_epi32(127))))
}

/// `exp` of 8 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(_mm256_set1_ps(HI), _mm256_max_ps(_mm256_set1_ps(LO), x));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let mut p = _mm256_set1_ps(P[0]);
    for c in &P[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
    }
    let e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
    // n ∈ [-150, 129]: both halves are normal exponents. A NaN lane has a NaN `e`, which any
    // scale keeps NaN.
    let ni = _mm256_cvtps_epi32(n);
    let n1 = _mm256_srai_epi32::<1>(ni);
    let n2 = _mm256_sub_epi32(ni, n1);
    _mm256_mul_ps(_mm256_mul_ps(e, pow2i(n1)), pow2i(n2))
}

/// AVX2 `exp_sum`: full vectors, then one masked vector for the tail.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sum_avx2(x: *const f32, y: *mut f32, n: usize, shift: f32) -> f32 {
    let s = _mm256_set1_ps(shift);
    let mut sum = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 ≤ n`.
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x.add(i)), s));
            _mm256_storeu_ps(y.add(i), e);
            sum = _mm256_add_ps(sum, e);
        }
        i += 8;
    }
    if i < n {
        let m = super::x86_avx2::lanes(n - i);
        // SAFETY: only the `n - i` valid lanes are read or written.
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_maskload_ps(x.add(i), m), s));
            _mm256_maskstore_ps(y.add(i), m, e);
            sum = _mm256_add_ps(sum, _mm256_and_ps(e, _mm256_castsi256_ps(m)));
        }
    }
    let half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps::<1>(sum));
    let quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(quad, _mm_shuffle_ps::<1>(quad, quad)))
}
