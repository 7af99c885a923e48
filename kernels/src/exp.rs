//! Vectorised `exp` for the online softmax: `y = exp(x - shift)` and the sum of `y`.
//!
//! Method (Cephes `expf`): `n = round(x·log2 e)`, `r = x − n·ln 2` in two FMA steps (ln 2 split
//! into an exact high part and a low correction; one step in the softmax's bounded forms, whose
//! results are within 1 ulp down to `e⁻²⁰` and 2 ulp below), `exp(r) = 1 + r + r²·P(r)` with a degree-4
//! polynomial on `|r| ≤ ln2/2` (relative error 3·10⁻⁹, a twentieth of an ulp; evaluated by
//! Estrin's scheme, whose short dependency chain made the softmax step faster), then scaling
//! by `2ⁿ`. Inputs are clamped to
//! `[-42, 89]` first: results below [`FLUSH_BELOW`] (`e^-41.6`) are 0 (so `exp(-inf) = 0`, and
//! no step ever makes a subnormal); above, the result overflows to `inf`. The clamp keeps NaN
//! (the NaN operand is the one `max`/`min` return).
//! AVX-512 scales with `vscalefps` (one rounding, exact into subnormals); AVX2 multiplies by
//! `2^⌊n/2⌋` (exact, normal) then by `2^⌈n/2⌉`, so the single rounding is the last multiply.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::Isa;

/// Inputs below this give 0 (their `exp` is below [`FLUSH_BELOW`]); clamping them keeps every
/// intermediate normal.
pub(super) const EXP_LO: f32 = -42.0;
/// The kernels' `exp` results below this are 0 (2⁻⁶⁰ ≈ 8.7e-19). Softmax probabilities that
/// small are far below f32 resolution against any softmax sum, and GELU's `erfc` tail that small
/// is far below its approximation error; kept, they lead to subnormal products in the next
/// matrix product, each a microcode assist on x86 (heavily biased attention ran 2.5× slower).
pub(super) const FLUSH_BELOW: f32 = 8.673_617e-19;
/// `ln(FLUSH_BELOW)`: the bounded forms flush by the input, `x < FLUSH_X` giving 0, which
/// takes the clamp and the compare off the chain from `x` to the result.
pub(super) const FLUSH_X: f32 = -41.588_83;
/// Above this every `exp` overflows.
pub(super) const EXP_HI: f32 = 89.0;
pub(super) const LOG2E: f32 = std::f32::consts::LOG2_E;
/// High part of ln 2 (few mantissa bits, so `n · LN2_HI` is exact for `|n| ≤ 150`).
pub(super) const LN2_HI: f32 = 0.693_359_4;
/// `ln 2 − LN2_HI`.
pub(super) const LN2_LO: f32 = -2.121_944_4e-4;
/// `P` of `exp(r) − 1 = r + r²·P(r)`, highest degree first: fitted for the least maximum
/// relative error of `exp` on `|r| ≤ ln2/2` (3.1·10⁻⁹). Cephes `expf` uses one degree more
/// (5·10⁻¹¹), which f32 cannot show: over `[-41, 8]` both give results within 1 ulp of the
/// correctly rounded `exp`, and this one costs one multiply-add less per lane.
pub(super) const EXP_P: [f32; 5] = [0.001_381_447_2, 0.008_368_677, 0.041_668_385, 0.166_665_21, 0.499_999_94];
/// Cephes `expf`'s `P`, one degree higher, for the lane kernels' `exp` (sigmoid, GELU, `tanh`
/// and the flash backward's rows; see `lanes::expm1_reduced`).
pub(super) const EXP_P_CEPHES: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];

/// `y[i] = exp(scale·x[i] + bias[i] - shift)` for `i < n` on `isa` (no bias term when `bias`
/// is null), returning the sum.
///
/// # Safety
/// `x` and `y` address `n` elements (they may be the same buffer), and so does `bias` unless it
/// is null; `isa` is supported.
pub(super) unsafe fn exp_sum(isa: Isa, x: *const f32, scale: f32, bias: *const f32, y: *mut f32, n: usize, shift: f32) -> f32 {
    // SAFETY: forwarded.
    unsafe { exp_sum_with::<false, false>(isa, x, scale, bias, y, n, shift).0 }
}

/// [`exp_sum`], returning the sum and how many elements were done (`n` unless `KEEP`).
///
/// - `BOUNDED`: the caller guarantees `scale·x + bias - shift ≤ RESCALE_SLACK` (or NaN) for
///   every element, as the online-softmax step does, and the SIMD paths use
///   [`exp8_bounded`]/[`exp16_bounded`].
/// - `KEEP` (with `BOUNDED`): the caller does not know; the pass stops before the first vector
///   with an element past the slack, leaving it and everything after untouched, and returns
///   its start. That is the online-softmax step's usual case fused into one pass: the shift
///   kept, the row's max checked on the way instead of by a pass of its own.
///
/// # Safety
/// As [`exp_sum`].
#[allow(clippy::too_many_arguments)] // One pointer or scalar per operand, as the C ABI.
unsafe fn exp_sum_with<const BOUNDED: bool, const KEEP: bool>(
    isa: Isa,
    x: *const f32,
    scale: f32,
    bias: *const f32,
    y: *mut f32,
    n: usize,
    shift: f32,
) -> (f32, usize) {
    // SAFETY: forwarded; each arm runs only where its ISA is supported.
    unsafe {
        match (isa, bias.is_null()) {
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, true) => exp_sum_avx512::<false, BOUNDED, KEEP>(x, scale, bias, y, n, shift),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, false) => exp_sum_avx512::<true, BOUNDED, KEEP>(x, scale, bias, y, n, shift),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, true) => exp_sum_avx2::<false, BOUNDED, KEEP>(x, scale, bias, y, n, shift),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, false) => exp_sum_avx2::<true, BOUNDED, KEEP>(x, scale, bias, y, n, shift),
            (_, true) => super::f4::exp_sum::<BOUNDED, KEEP, false>(x, scale, bias, y, n, shift),
            (_, false) => super::f4::exp_sum::<BOUNDED, KEEP, true>(x, scale, bias, y, n, shift),
        }
    }
}

/// Adding then subtracting this (1.5·2²³) rounds an `f32` of magnitude below 2²² to an integer;
/// the sum's low mantissa bits are that integer.
pub(super) const ROUND: f32 = 12_582_912.0;

/// How far a tile's max may exceed the running max before the shift moves: below this the
/// old shift is kept, so the accumulator needs no rescaling; `exp` of the excess stays below
/// `e^8 ≈ 3000` per term, far from f32 overflow even summed over millions of keys.
pub(super) const RESCALE_SLACK: f32 = 8.0;

/// One online-softmax step over a row of `n` scores `scale·x[i] (+ bias[i])`: picks the row's shift
/// (`max`, kept unless the row's max passes it by [`RESCALE_SLACK`]), writes the unnormalised
/// probabilities `y = exp(scale·x + bias - shift)`, updates `max` and `sum`, and returns the factor the
/// row's accumulator must be multiplied by (1 when the shift did not move, 0 on a first tile).
/// A row with every score `-inf` (and no earlier kept key) gives `y = 0` and factor 1.
///
/// # Safety
/// As [`exp_sum`]; `max` and `sum` are valid for reads and writes.
#[allow(clippy::too_many_arguments)] // Mirrors the C ABI entry point.
pub(super) unsafe fn softmax_step(
    isa: Isa,
    x: *const f32,
    scale: f32,
    bias: *const f32,
    y: *mut f32,
    n: usize,
    max: *mut f32,
    sum: *mut f32,
) -> f32 {
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        let old = *max;
        if old != f32::NEG_INFINITY {
            // Usually the shift stays: one pass, checking the slack on the way.
            let (t, done) = exp_sum_with::<true, true>(isa, x, scale, bias, y, n, old);
            if done == n {
                *sum += t;
                return 1.0;
            }
            return moved_step(isa, (x, scale, bias, y, n), done, t, max, sum);
        }
        let tmax = row_max(isa, x, scale, bias, n);
        let new = if old == f32::NEG_INFINITY || tmax > old + RESCALE_SLACK { tmax.max(old) } else { old };
        if new == f32::NEG_INFINITY {
            // No score above -inf: the row stays empty unless a NaN score makes it NaN (the
            // maximum passes NaN over; the semantics make a row with a kept NaN score NaN).
            let mut nan = false;
            for i in 0..n {
                let v = scale * *x.add(i) + if bias.is_null() { 0.0 } else { *bias.add(i) };
                nan |= v.is_nan();
                *y.add(i) = if v.is_nan() { v } else { 0.0 };
            }
            if nan {
                *sum = f32::NAN;
            }
            return 1.0;
        }
        // Every `scale·x + bias - new` is at most `RESCALE_SLACK`: `new` is within the slack of
        // this row's max, or above it.
        let (t, _) = exp_sum_with::<true, false>(isa, x, scale, bias, y, n, new);
        // A factor below `FLUSH_BELOW` is 0: the old terms weigh nothing against the new.
        let scale = if new == old { 1.0 } else { exp_flushed(old - new) };
        *max = new;
        *sum = *sum * scale + t;
        scale
    }
}

/// The rest of a [`softmax_step`] whose one-pass try stopped at element `done`, where a score
/// passed the running max by more than the slack: `y[..done]` hold `exp(· − old)` and sum to
/// `t`. The shift moves to the max of the rest (above every earlier score by the slack), the
/// rest is computed with it, and the first part is rescaled as the accumulator is.
///
/// # Safety
/// As [`softmax_step`]; `done < n`.
unsafe fn moved_step(
    isa: Isa,
    row: (*const f32, f32, *const f32, *mut f32, usize),
    done: usize,
    t: f32,
    max: *mut f32,
    sum: *mut f32,
) -> f32 {
    let (x, scale, bias, y, n) = row;
    // SAFETY: the caller's contract; every offset is below `n`.
    unsafe {
        let at = |p: *const f32| if p.is_null() { p } else { p.add(done) };
        let old = *max;
        let new = row_max(isa, x.add(done), scale, at(bias), n - done).max(old);
        let factor = exp_flushed(old - new);
        for i in 0..done {
            let v = *y.add(i) * factor;
            *y.add(i) = if v < FLUSH_BELOW { 0.0 } else { v };
        }
        let (rest, _) = exp_sum_with::<true, false>(isa, x.add(done), scale, at(bias), y.add(done), n - done, new);
        *max = new;
        *sum = (*sum + t) * factor + rest;
        factor
    }
}

/// Softmax of one dense row, as `ir::semantics` defines it: `y = exp(x - max) / Σ exp(x - max)`;
/// a row with no element above `-inf` is 0, and a NaN or `+inf` element makes the row NaN.
/// The sum is in f32 lanes (the interpreter's is f64: a few ulp apart), then one reciprocal.
///
/// # Safety
/// `x` and `y` address `n` elements (they may be the same buffer); `isa` is supported.
pub(super) unsafe fn softmax_row(isa: Isa, x: *const f32, y: *mut f32, n: usize) {
    // SAFETY: the caller's contract; `x[i]` is read before `y[i]` is written in each pass.
    unsafe {
        let max = row_max(isa, x, 1.0, std::ptr::null(), n);
        if max == f32::NEG_INFINITY {
            // The max passes NaN over: a NaN here is the row's only non-`-inf` element.
            let nan = (0..n).any(|i| (*x.add(i)).is_nan());
            let fill = if nan { f32::NAN } else { 0.0 };
            for i in 0..n {
                *y.add(i) = fill;
            }
            return;
        }
        // Every `x - max` is at most 0 (or NaN: `+inf - +inf` too), within the bounded form.
        let (sum, _) = exp_sum_with::<true, false>(isa, x, 1.0, std::ptr::null(), y, n, max);
        let inv = 1.0 / sum;
        for i in 0..n {
            *y.add(i) *= inv;
        }
    }
}

/// `e^x`, or 0 where that is below [`FLUSH_BELOW`] (computed without subnormal steps).
pub(super) fn exp_flushed(x: f32) -> f32 {
    if x < EXP_LO {
        return 0.0;
    }
    let e = x.exp();
    if e < FLUSH_BELOW { 0.0 } else { e }
}

/// `max(scale·x[i] + bias[i])` (no bias when null), `-inf` for `n = 0`; NaN scores are passed over
/// (they propagate through the `exp` pass instead).
///
/// # Safety
/// As [`exp_sum`].
unsafe fn row_max(isa: Isa, x: *const f32, scale: f32, bias: *const f32, n: usize) -> f32 {
    // SAFETY: forwarded; each arm runs only where its ISA is supported.
    unsafe {
        match (isa, bias.is_null()) {
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, true) => row_max_avx512::<false>(x, scale, bias, n),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, false) => row_max_avx512::<true>(x, scale, bias, n),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, true) => row_max_avx2::<false>(x, scale, bias, n),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, false) => row_max_avx2::<true>(x, scale, bias, n),
            _ => super::lanes::row_max(x, scale, bias, n),
        }
    }
}

/// AVX-512 [`row_max`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn row_max_avx512<const BIAS: bool>(x: *const f32, scale: f32, bias: *const f32, n: usize) -> f32 {
    let sc = _mm512_set1_ps(scale);
    let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i < n {
        let k = super::x86_avx512::lanes(n - i);
        // SAFETY: only the valid lanes of `i..n` are read.
        unsafe {
            let mut v = _mm512_mask_mul_ps(_mm512_set1_ps(f32::NEG_INFINITY), k, _mm512_maskz_loadu_ps(k, x.add(i)), sc);
            if BIAS {
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias.add(i)));
            }
            // `max_ps` returns the second operand when either is NaN: the running max.
            m = _mm512_max_ps(v, m);
        }
        i += 16;
    }
    _mm512_reduce_max_ps(m)
}

/// `scale·x[i..] (+ bias[i..])` in the lanes `m` selects (the others read 0 before scaling).
///
/// # Safety
/// The selected lanes of `x` (and of `bias` when `BIAS`) from `i` are valid.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn masked_scores8<const BIAS: bool>(x: *const f32, sc: __m256, bias: *const f32, i: usize, m: __m256i) -> __m256 {
    // SAFETY: the caller's contract; masked-off lanes are not read.
    unsafe {
        let v = _mm256_mul_ps(_mm256_maskload_ps(x.add(i), m), sc);
        if BIAS { _mm256_add_ps(v, _mm256_maskload_ps(bias.add(i), m)) } else { v }
    }
}

/// AVX2 [`row_max`]: two vectors per step (two independent `max` chains), then a masked tail.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_max_avx2<const BIAS: bool>(x: *const f32, scale: f32, bias: *const f32, n: usize) -> f32 {
    let sc = _mm256_set1_ps(scale);
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    let (mut m0, mut m1) = (ninf, ninf);
    let mut i = 0;
    // SAFETY (whole function): only elements `< n` of `x` and `bias` are read.
    while i + 16 <= n {
        unsafe {
            let (mut v0, mut v1) = (_mm256_mul_ps(_mm256_loadu_ps(x.add(i)), sc), _mm256_mul_ps(_mm256_loadu_ps(x.add(i + 8)), sc));
            if BIAS {
                v0 = _mm256_add_ps(v0, _mm256_loadu_ps(bias.add(i)));
                v1 = _mm256_add_ps(v1, _mm256_loadu_ps(bias.add(i + 8)));
            }
            // `max_ps` returns the second operand when either is NaN: the running max.
            m0 = _mm256_max_ps(v0, m0);
            m1 = _mm256_max_ps(v1, m1);
        }
        i += 16;
    }
    while i < n {
        let k = super::x86_avx2::lanes(n - i);
        unsafe {
            // Lanes past `n` read 0: replace them by -inf.
            let v = _mm256_blendv_ps(ninf, masked_scores8::<BIAS>(x, sc, bias, i, k), _mm256_castsi256_ps(k));
            m0 = _mm256_max_ps(v, m0);
        }
        i += 8;
    }
    let m = _mm256_max_ps(m0, m1);
    let half = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let quad = _mm_max_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_max_ss(quad, _mm_shuffle_ps::<1>(quad, quad)))
}

/// `y[i] = tanh(x[i])` for `i < n` on `isa`.
///
/// # Safety
/// `x` and `y` address `n` elements (they may be the same buffer); `isa` is supported.
pub(super) unsafe fn tanh(isa: Isa, x: *const f32, y: *mut f32, n: usize) {
    // SAFETY: forwarded; each arm runs only where its ISA is supported.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => tanh_avx512(x, y, n),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => tanh_avx2(x, y, n),
            _ => super::f4::tanh_row(x, y, n),
        }
    }
}

/// [`expm1_reduced8`] on 16 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn expm1_reduced16(r: __m512) -> __m512 {
    let c = |i: usize| _mm512_set1_ps(EXP_P[i]);
    let r2 = _mm512_mul_ps(r, r);
    let a = _mm512_fmadd_ps(c(1), r, c(2));
    let b = _mm512_fmadd_ps(c(3), r, c(4));
    let p = _mm512_fmadd_ps(_mm512_fmadd_ps(c(0), r2, a), r2, b);
    _mm512_fmadd_ps(p, r2, r)
}

/// `exp` of 16 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) fn exp16(x: __m512) -> __m512 {
    let x = _mm512_min_ps(_mm512_set1_ps(EXP_HI), _mm512_max_ps(_mm512_set1_ps(EXP_LO), x));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let e = _mm512_add_ps(expm1_reduced16(r), _mm512_set1_ps(1.0));
    flush16(_mm512_scalef_ps(e, n))
}

/// Lanes below [`FLUSH_BELOW`] become 0 (NaN stays).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn flush16(y: __m512) -> __m512 {
    _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_NLT_UQ>(y, _mm512_set1_ps(FLUSH_BELOW)), y)
}

/// [`exp16`] of lanes that are at most [`RESCALE_SLACK`] (or NaN), as [`exp8_bounded`]: no
/// clamps, `n` from the rounding constant's bits, and `2ⁿ·q + 2ⁿ` in one FMA instead of
/// `vscalefps`, masked to 0 below [`FLUSH_X`] (`2ⁿ` is normal for `n ∈ [-61, 12]`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn exp16_bounded(x: __m512) -> __m512 {
    // Lanes below `FLUSH_X` (`-inf` included) give 0 whatever the steps below make of them;
    // NaN compares unordered and stays NaN.
    let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(FLUSH_X));
    let t = _mm512_fmadd_ps(x, _mm512_set1_ps(LOG2E), _mm512_set1_ps(ROUND));
    let n = _mm512_sub_ps(t, _mm512_set1_ps(ROUND));
    // One step with ln 2 rounded to f32: its error (1.9·10⁻⁹) times `|n| ≤ 61` moves results
    // by at most an ulp more, on results below e⁻²⁰ only (checked by the kernels' tests).
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(std::f32::consts::LN_2), x);
    let q = expm1_reduced16(r);
    let bias = _mm512_set1_epi32(127 - ROUND.to_bits() as i32);
    let pow2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_castps_si512(t), bias)));
    _mm512_maskz_fmadd_ps(keep, q, pow2, pow2)
}

/// AVX-512 `exp_sum` (with the bias term when `BIAS`; [`exp16_bounded`] when `BOUNDED`; see
/// [`exp_sum_with`] for `KEEP`): full vectors, then one masked vector for the tail.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_sum_avx512<const BIAS: bool, const BOUNDED: bool, const KEEP: bool>(
    x: *const f32,
    scale: f32,
    bias: *const f32,
    y: *mut f32,
    n: usize,
    shift: f32,
) -> (f32, usize) {
    let exp16 = |v: __m512| if BOUNDED { exp16_bounded(v) } else { exp16(v) };
    let sc = _mm512_set1_ps(scale);
    let s = _mm512_set1_ps(shift);
    let slack = _mm512_set1_ps(RESCALE_SLACK);
    let mut sum = _mm512_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: `i + 16 ≤ n`.
        unsafe {
            let v = if BIAS {
                _mm512_sub_ps(_mm512_fmadd_ps(_mm512_loadu_ps(x.add(i)), sc, _mm512_loadu_ps(bias.add(i))), s)
            } else {
                _mm512_fmsub_ps(_mm512_loadu_ps(x.add(i)), sc, s)
            };
            if KEEP && _mm512_cmp_ps_mask::<_CMP_GT_OQ>(v, slack) != 0 {
                return (_mm512_reduce_add_ps(sum), i);
            }
            let e = exp16(v);
            _mm512_storeu_ps(y.add(i), e);
            sum = _mm512_add_ps(sum, e);
        }
        i += 16;
    }
    if i < n {
        let m = super::x86_avx512::lanes(n - i);
        // SAFETY: only the `n - i` valid lanes are read or written.
        unsafe {
            let x = _mm512_maskz_loadu_ps(m, x.add(i));
            let v = if BIAS {
                _mm512_sub_ps(_mm512_fmadd_ps(x, sc, _mm512_maskz_loadu_ps(m, bias.add(i))), s)
            } else {
                _mm512_fmsub_ps(x, sc, s)
            };
            if KEEP && _mm512_mask_cmp_ps_mask::<_CMP_GT_OQ>(m, v, slack) != 0 {
                return (_mm512_reduce_add_ps(sum), i);
            }
            let e = exp16(v);
            _mm512_mask_storeu_ps(y.add(i), m, e);
            sum = _mm512_mask_add_ps(sum, m, sum, e);
        }
    }
    (_mm512_reduce_add_ps(sum), n)
}

/// `2^n` for integer lanes `n` in the normal exponent range.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn pow2i(n: __m256i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n, _mm256_set1_epi32(127))))
}

/// `exp(r) − 1 = r + r²·P(r)` of 8 reduced arguments (`|r| ≤ ln2/2`), `P` by Estrin's scheme:
/// three dependent steps instead of Horner's four, the same operation count.
/// The shorter chain is what counts: the softmax step ran 11% faster per row than with Horner.
/// (Grouping it as `(r + r²·b) + r⁴·(a + c₀r²)`, a step shorter for one multiply more, was 2%
/// slower.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn expm1_reduced8(r: __m256) -> __m256 {
    let c = |i: usize| _mm256_set1_ps(EXP_P[i]);
    let r2 = _mm256_mul_ps(r, r);
    let a = _mm256_fmadd_ps(c(1), r, c(2));
    let b = _mm256_fmadd_ps(c(3), r, c(4));
    let p = _mm256_fmadd_ps(_mm256_fmadd_ps(c(0), r2, a), r2, b);
    _mm256_fmadd_ps(p, r2, r)
}

/// `exp` of 8 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(_mm256_set1_ps(EXP_HI), _mm256_max_ps(_mm256_set1_ps(EXP_LO), x));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let e = _mm256_add_ps(expm1_reduced8(r), _mm256_set1_ps(1.0));
    // n ∈ [-61, 129]: both halves are normal exponents. A NaN lane has a NaN `e`, which any
    // scale keeps NaN.
    let ni = _mm256_cvtps_epi32(n);
    let n1 = _mm256_srai_epi32::<1>(ni);
    let n2 = _mm256_sub_epi32(ni, n1);
    let y = _mm256_mul_ps(_mm256_mul_ps(e, pow2i(n1)), pow2i(n2));
    // Below `FLUSH_BELOW`: 0, as [`flush16`].
    _mm256_and_ps(y, _mm256_cmp_ps::<_CMP_NLT_UQ>(y, _mm256_set1_ps(FLUSH_BELOW)))
}

/// `exp` of 8 lanes that are at most [`RESCALE_SLACK`] (or NaN): no clamps, `n` from the
/// rounding constant's bits and the scaling folded into the last step (`2ⁿ·q + 2ⁿ`, one
/// rounding), lanes below [`FLUSH_X`] masked to 0 at the end (what the steps make of them
/// before, `inf` or NaN included, is discarded; no step makes a subnormal, so none costs a
/// microcode assist). Results within 2 ulp of the correctly rounded `exp`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn exp8_bounded(x: __m256) -> __m256 {
    // Lanes below `FLUSH_X` (`-inf` included) give 0 whatever the steps below make of them;
    // NaN compares unordered and stays NaN.
    let keep = _mm256_cmp_ps::<_CMP_NLT_UQ>(x, _mm256_set1_ps(FLUSH_X));
    let t = _mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), _mm256_set1_ps(ROUND));
    let n = _mm256_sub_ps(t, _mm256_set1_ps(ROUND));
    // One step with ln 2 rounded to f32: its error (1.9·10⁻⁹) times `|n| ≤ 61` moves results
    // by at most an ulp more, on results below e⁻²⁰ only (checked by the kernels' tests).
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(std::f32::consts::LN_2), x);
    let q = expm1_reduced8(r);
    // bits(t) - bits(ROUND) = n; adding the exponent bias and shifting makes 2ⁿ.
    let bias = _mm256_set1_epi32(127 - ROUND.to_bits() as i32);
    let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_castps_si256(t), bias)));
    // 2ⁿ·(1 + q) with one rounding.
    _mm256_and_ps(_mm256_fmadd_ps(q, pow2, pow2), keep)
}

/// The sum of 8 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn sum8(v: __m256) -> f32 {
    let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(quad, _mm_shuffle_ps::<1>(quad, quad)))
}

/// AVX2 `exp_sum` (with the bias term when `BIAS`; [`exp8_bounded`] when `BOUNDED`; see
/// [`exp_sum_with`] for `KEEP`): full vectors, then one masked vector for the tail.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sum_avx2<const BIAS: bool, const BOUNDED: bool, const KEEP: bool>(
    x: *const f32,
    scale: f32,
    bias: *const f32,
    y: *mut f32,
    n: usize,
    shift: f32,
) -> (f32, usize) {
    let sc = _mm256_set1_ps(scale);
    let s = _mm256_set1_ps(shift);
    let slack = _mm256_set1_ps(RESCALE_SLACK);
    let exp = |v: __m256| if BOUNDED { exp8_bounded(v) } else { exp8(v) };
    let mut sum = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 ≤ n`.
        unsafe {
            let v = if BIAS {
                _mm256_sub_ps(_mm256_fmadd_ps(_mm256_loadu_ps(x.add(i)), sc, _mm256_loadu_ps(bias.add(i))), s)
            } else {
                _mm256_fmsub_ps(_mm256_loadu_ps(x.add(i)), sc, s)
            };
            if KEEP && _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(v, slack)) != 0 {
                return (sum8(sum), i);
            }
            let e = exp(v);
            _mm256_storeu_ps(y.add(i), e);
            sum = _mm256_add_ps(sum, e);
        }
        i += 8;
    }
    if i < n {
        let m = super::x86_avx2::lanes(n - i);
        // SAFETY: only the `n - i` valid lanes are read or written.
        unsafe {
            let v = _mm256_sub_ps(masked_scores8::<BIAS>(x, sc, bias, i, m), s);
            // Lanes past `n` (read as 0) do not count.
            let over = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(v, slack), _mm256_castsi256_ps(m));
            if KEEP && _mm256_movemask_ps(over) != 0 {
                return (sum8(sum), i);
            }
            let e = exp(v);
            _mm256_maskstore_ps(y.add(i), m, e);
            sum = _mm256_add_ps(sum, _mm256_and_ps(e, _mm256_castsi256_ps(m)));
        }
    }
    (sum8(sum), n)
}

/// Beyond this `|x|`, `tanh(x)` rounds to `±1` in f32.
pub(super) const TANH_BIG: f32 = 9.5;
/// Below this `|x|`, `tanh` is the odd polynomial (the `exp` form would cancel).
pub(super) const TANH_SMALL: f32 = 0.625;
/// Odd polynomial for `tanh` on `|x| < 0.625` (Cephes `tanhf`), highest degree first:
/// `tanh(x) ≈ x + x·z·P(z)` with `z = x²`.
pub(super) const TANH_P: [f32; 5] = [-5.704_988_7e-3, 2.063_909e-2, -5.373_971_6e-2, 1.333_144_2e-1, -3.333_328e-1];

/// `tanh` of 16 lanes: the odd polynomial near 0, `1 - 2/(e^{2|x|} + 1)` with the sign of `x`
/// elsewhere (saturating to ±1; NaN stays NaN).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn tanh16(x: __m512) -> __m512 {
    let ax = _mm512_abs_ps(x);
    let z = _mm512_mul_ps(ax, ax);
    let mut p = _mm512_set1_ps(TANH_P[0]);
    for c in &TANH_P[1..] {
        p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(*c));
    }
    let small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), ax, ax);
    let is_small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(ax, _mm512_set1_ps(TANH_SMALL));
    // Soft-capped scores are mostly well inside the polynomial's range: skip the `exp` path
    // when every lane is (NaN lanes compare false and take it).
    let abs = if is_small == 0xffff {
        small
    } else {
        // Past |x| = 9.5, tanh rounds to 1 in f32; clamping keeps `e` finite for the
        // reciprocal. (`min_ps` returns its second operand for NaN: the NaN.)
        let e = exp16(_mm512_min_ps(_mm512_set1_ps(2.0 * TANH_BIG), _mm512_add_ps(ax, ax)));
        // 2 / (e + 1) by the 14-bit reciprocal estimate and one Newton step (≈ 1 ulp; a
        // division costs ten times as much here).
        let d = _mm512_add_ps(e, _mm512_set1_ps(1.0));
        let r = _mm512_rcp14_ps(d);
        let r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.0)), r);
        let big = _mm512_fnmadd_ps(_mm512_set1_ps(2.0), r, _mm512_set1_ps(1.0));
        _mm512_mask_blend_ps(is_small, big, small)
    };
    // |tanh| with x's sign bit (so tanh(-0) = -0).
    let sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(i32::MIN));
    _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(abs), sign))
}

/// AVX-512 `tanh`: full vectors, then one masked vector for the tail.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tanh_avx512(x: *const f32, y: *mut f32, n: usize) {
    super::x86_avx512::map16!(tanh16, x, y, n)
}

/// `tanh` of 8 lanes, as [`tanh16`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn tanh8(x: __m256) -> __m256 {
    let signbit = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
    let ax = _mm256_andnot_ps(signbit, x);
    let e = exp8(_mm256_add_ps(ax, ax));
    let big = _mm256_sub_ps(_mm256_set1_ps(1.0), _mm256_div_ps(_mm256_set1_ps(2.0), _mm256_add_ps(e, _mm256_set1_ps(1.0))));
    let z = _mm256_mul_ps(ax, ax);
    let mut p = _mm256_set1_ps(TANH_P[0]);
    for c in &TANH_P[1..] {
        p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(*c));
    }
    let small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), ax, ax);
    let is_small = _mm256_cmp_ps::<_CMP_LT_OQ>(ax, _mm256_set1_ps(TANH_SMALL));
    // |tanh| with x's sign bit (so tanh(-0) = -0).
    _mm256_or_ps(_mm256_blendv_ps(big, small, is_small), _mm256_and_ps(x, signbit))
}

/// AVX2 `tanh`: full vectors, then one masked vector for the tail.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tanh_avx2(x: *const f32, y: *mut f32, n: usize) {
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 ≤ n`.
        unsafe { _mm256_storeu_ps(y.add(i), tanh8(_mm256_loadu_ps(x.add(i)))) };
        i += 8;
    }
    if i < n {
        let m = super::x86_avx2::lanes(n - i);
        // SAFETY: only the `n - i` valid lanes are read or written.
        unsafe { _mm256_maskstore_ps(y.add(i), m, tanh8(_mm256_maskload_ps(x.add(i), m))) };
    }
}

/// One key row of a flash backward tile on `isa`, queries along the row (see
/// [`super::attnc_flash_bwd_row`]): weights into `s`, the scores' adjoints into `dp`, `dF`
/// into `df` unless it is null, and `Σ dF`, `Σ dF·w` into `sums` unless `w` is null.
///
/// # Safety
/// `s`, `dp` address `n` elements, and so do `lse`, `delta` (unless sigmoid), `rbias`, `df`
/// and `w` (unless null); `sums` holds two floats when `w` is not null; `isa` is supported.
#[allow(clippy::too_many_arguments)] // Mirrors the C ABI entry point.
pub(super) unsafe fn flash_bwd_row(
    isa: Isa,
    s: *mut f32,
    dp: *mut f32,
    lse: *const f32,
    delta: *const f32,
    rbias: *const f32,
    n: usize,
    scalars: (f32, f32, f32),
    flags: u32,
    outs: (*mut f32, *const f32, *mut f32),
) {
    // SAFETY: forwarded; each arm runs only where its ISA is supported.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => flash_bwd_row_avx512(s, dp, lse, delta, rbias, n, scalars, flags, outs),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => flash_bwd_row_avx2(s, dp, lse, delta, rbias, n, scalars, flags, outs),
            _ => super::f4::flash_bwd_row(s, dp, lse, delta, rbias, n, scalars, flags, outs),
        }
    }
}

/// AVX2 [`flash_bwd_row`]: masked vectors, as [`flash_bwd_row_avx512`]. (The lane loop the
/// AVX2 and portable paths shared came out mostly scalar: its per-lane tail loops and operand
/// tests kept LLVM from vectorising it, and it took 18% of an AVX2 forward-and-backward run.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn flash_bwd_row_avx2(
    s: *mut f32,
    dp: *mut f32,
    lse: *const f32,
    delta: *const f32,
    rbias: *const f32,
    n: usize,
    (alpha, factor, cbias): (f32, f32, f32),
    flags: u32,
    (df, w, sums): (*mut f32, *const f32, *mut f32),
) {
    let (tanh, sigmoid) = (flags & 1 != 0, flags & 2 != 0);
    let (al, fac, cb, ds, one, ninf) = (
        _mm256_set1_ps(alpha),
        _mm256_set1_ps(factor),
        _mm256_set1_ps(cbias),
        _mm256_set1_ps(alpha * factor),
        _mm256_set1_ps(1.0),
        _mm256_set1_ps(f32::NEG_INFINITY),
    );
    let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i < n {
        let m = super::x86_avx2::lanes(n - i);
        // Masked-off lanes are neither read (they load as 0) nor written.
        // SAFETY (both closures): the valid lanes from `i` lie inside the row.
        let load = |p: *const f32| unsafe { _mm256_maskload_ps(p.add(i), m) };
        let store = |p: *mut f32, v: __m256| unsafe { _mm256_maskstore_ps(p.add(i), m, v) };
        let mut uv = _mm256_mul_ps(al, load(s));
        if tanh {
            uv = tanh8(uv);
        }
        let pv = load(dp);
        let bias = if rbias.is_null() { cb } else { _mm256_add_ps(cb, load(rbias)) };
        let x = _mm256_fmadd_ps(fac, uv, bias);
        let (wt, dfv) = if sigmoid {
            let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            let wt = _mm256_div_ps(one, _mm256_add_ps(one, e));
            (wt, _mm256_mul_ps(_mm256_mul_ps(pv, wt), _mm256_sub_ps(one, wt)))
        } else {
            let lv = load(lse);
            let e = exp8(_mm256_sub_ps(x, lv));
            // A row with no kept key (lse = -inf) has no weights.
            let wt = _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(lv, ninf), e);
            (wt, _mm256_mul_ps(wt, _mm256_sub_ps(pv, load(delta))))
        };
        // Lanes past `n` hold what the zeroed loads made: keep them out of the sums.
        let dfv = _mm256_and_ps(dfv, _mm256_castsi256_ps(m));
        let d = if tanh { _mm256_mul_ps(ds, _mm256_fnmadd_ps(uv, uv, one)) } else { ds };
        store(s, wt);
        store(dp, _mm256_mul_ps(dfv, d));
        if !df.is_null() {
            store(df, dfv);
        }
        if !w.is_null() {
            s0 = _mm256_add_ps(s0, dfv);
            s1 = _mm256_fmadd_ps(dfv, load(w), s1);
        }
        i += 8;
    }
    if !w.is_null() {
        // SAFETY: `sums` holds two floats when `w` is given.
        unsafe {
            *sums = sum8(s0);
            *sums.add(1) = sum8(s1);
        }
    }
}

/// AVX-512 [`flash_bwd_row`]: full vectors, then one masked vector.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn flash_bwd_row_avx512(
    s: *mut f32,
    dp: *mut f32,
    lse: *const f32,
    delta: *const f32,
    rbias: *const f32,
    n: usize,
    (alpha, factor, cbias): (f32, f32, f32),
    flags: u32,
    (df, w, sums): (*mut f32, *const f32, *mut f32),
) {
    let (tanh, sigmoid) = (flags & 1 != 0, flags & 2 != 0);
    let (al, fac, cb, ds, one, ninf) = (
        _mm512_set1_ps(alpha),
        _mm512_set1_ps(factor),
        _mm512_set1_ps(cbias),
        _mm512_set1_ps(alpha * factor),
        _mm512_set1_ps(1.0),
        _mm512_set1_ps(f32::NEG_INFINITY),
    );
    let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut i = 0;
    while i < n {
        let m = if i + 16 <= n { 0xffff } else { super::x86_avx512::lanes(n - i) };
        // SAFETY: only the valid lanes of each row are read or written.
        unsafe {
            let mut uv = _mm512_mul_ps(al, _mm512_maskz_loadu_ps(m, s.add(i)));
            if tanh {
                uv = tanh16(uv);
            }
            let pv = _mm512_maskz_loadu_ps(m, dp.add(i));
            let mut bias = cb;
            if !rbias.is_null() {
                bias = _mm512_add_ps(bias, _mm512_maskz_loadu_ps(m, rbias.add(i)));
            }
            let x = _mm512_fmadd_ps(fac, uv, bias);
            let (wt, dfv) = if sigmoid {
                let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
                let wt = _mm512_div_ps(one, _mm512_add_ps(one, e));
                (wt, _mm512_mul_ps(_mm512_mul_ps(pv, wt), _mm512_sub_ps(one, wt)))
            } else {
                let lv = _mm512_maskz_loadu_ps(m, lse.add(i));
                let dv = _mm512_maskz_loadu_ps(m, delta.add(i));
                let e = exp16(_mm512_sub_ps(x, lv));
                // A row with no kept key (lse = -inf) has no weights.
                let empty = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(lv, ninf);
                let wt = _mm512_mask_mov_ps(e, empty, _mm512_setzero_ps());
                (wt, _mm512_mul_ps(wt, _mm512_sub_ps(pv, dv)))
            };
            // Lanes past `n` hold garbage from the zeroed loads: keep them out of the sums.
            let dfv = _mm512_maskz_mov_ps(m, dfv);
            let d = if tanh { _mm512_mul_ps(ds, _mm512_fnmadd_ps(uv, uv, one)) } else { ds };
            _mm512_mask_storeu_ps(s.add(i), m, wt);
            _mm512_mask_storeu_ps(dp.add(i), m, _mm512_mul_ps(dfv, d));
            if !df.is_null() {
                _mm512_mask_storeu_ps(df.add(i), m, dfv);
            }
            if !w.is_null() {
                s0 = _mm512_add_ps(s0, dfv);
                s1 = _mm512_fmadd_ps(dfv, _mm512_maskz_loadu_ps(m, w.add(i)), s1);
            }
        }
        i += 16;
    }
    if !w.is_null() {
        // SAFETY: `sums` holds two floats when `w` is given.
        unsafe {
            *sums = _mm512_reduce_add_ps(s0);
            *sums.add(1) = _mm512_reduce_add_ps(s1);
        }
    }
}
