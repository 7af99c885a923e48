//! Vectorised `exp` for the online softmax (`y = exp(x - shift)` and the sum of `y`, and the
//! row's maximum), `tanh` and the flash backward's rows, each written once over [`Vector`] and
//! instantiated for AVX-512 (`__m512`), AVX2 (`__m256`) and the portable path ([`F4`]) in thin
//! `#[target_feature]` wrappers.
//!
//! Method (Cephes `expf`): `n = round(x·log2 e)` (by adding and subtracting [`ROUND`]),
//! `r = x − n·ln 2` in two steps (ln 2 split into an exact high part and a low correction; one
//! fused step in the softmax's bounded forms, whose results are within 1 ulp down to `e⁻²⁰` and
//! 2 ulp below), `exp(r) = 1 + r + r²·P(r)` with a degree-4 polynomial on `|r| ≤ ln2/2`
//! (relative error 3·10⁻⁹, a twentieth of an ulp; evaluated by Estrin's scheme, whose short
//! dependency chain made the softmax step faster), then scaling by `2ⁿ`. Inputs are clamped to
//! `[-42, 89]` first: results below [`FLUSH_BELOW`] (`e^-41.6`) are 0 (so `exp(-inf) = 0`, and
//! no step ever makes a subnormal); above, the result overflows to `inf`. The clamp keeps NaN
//! (the NaN operand is the one `max`/`min` return). AVX-512 scales with `vscalefps` (exact);
//! the other paths multiply by `2ⁿ⁻²` (normal) then by 4, both exact
//! ([`Vector::scale_exp`]).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::Isa;
use super::vector::{Vector, isa_dispatch};

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
    unsafe { exp_sum_with::<false, false>(isa, Scores { x, scale, bias, y, n }, shift).0 }
}

/// A row of `n` scores `scale·x[i] + bias[i]` (no bias term when `bias` is null) and the row
/// `y` that a pass over them writes (it may be `x`).
#[derive(Clone, Copy)]
pub(super) struct Scores {
    pub x: *const f32,
    pub scale: f32,
    pub bias: *const f32,
    pub y: *mut f32,
    pub n: usize,
}

impl Scores {
    /// The rest of the row from element `i` on.
    ///
    /// # Safety
    /// `i ≤ n`, and the rows are valid for `n` elements.
    unsafe fn from(self, i: usize) -> Scores {
        // SAFETY: the caller's contract.
        unsafe {
            let bias = if self.bias.is_null() { self.bias } else { self.bias.add(i) };
            Scores { x: self.x.add(i), bias, y: self.y.add(i), n: self.n - i, ..self }
        }
    }
}

/// [`exp_sum`], returning the sum and how many elements were done (`n` unless `KEEP`).
///
/// - `BOUNDED`: the caller guarantees `scale·x + bias - shift ≤ RESCALE_SLACK` (or NaN) for
///   every element, as the online-softmax step does, and the pass uses [`exp_bounded_vec`].
/// - `KEEP` (with `BOUNDED`): the caller does not know; the pass stops before the first vector
///   with an element past the slack, leaving it and everything after untouched, and returns
///   its start. That is the online-softmax step's usual case fused into one pass: the shift
///   kept, the row's max checked on the way instead of by a pass of its own.
///
/// # Safety
/// As [`exp_sum`], for the rows of `row`.
unsafe fn exp_sum_with<const BOUNDED: bool, const KEEP: bool>(isa: Isa, row: Scores, shift: f32) -> (f32, usize) {
    // SAFETY: forwarded.
    unsafe {
        let Scores { x, scale, bias, y, n } = row;
        if bias.is_null() {
            exp_sum_isa::<false, BOUNDED, KEEP>(isa, x, scale, bias, y, n, shift)
        } else {
            exp_sum_isa::<true, BOUNDED, KEEP>(isa, x, scale, bias, y, n, shift)
        }
    }
}

isa_dispatch! {
    /// [`exp_sum_on`] on `isa` (the bias term when `BIAS`).
    ///
    /// # Safety
    /// As [`exp_sum`].
    // The operands one by one, in registers: a `Scores` (passed by reference) made the AVX2
    // softmax step ~4% slower.
    #[allow(clippy::too_many_arguments)]
    unsafe fn exp_sum_isa<V, const BIAS: bool, const BOUNDED: bool, const KEEP: bool>(
        x: *const f32,
        scale: f32,
        bias: *const f32,
        y: *mut f32,
        n: usize,
        shift: f32,
    ) -> (f32, usize)
        => exp_sum_on::<V, { <V as Vector>::UNROLL }, BIAS, BOUNDED, KEEP>(x, scale, bias, y, n, shift)
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
pub(super) unsafe fn softmax_step(isa: Isa, row: Scores, max: *mut f32, sum: *mut f32) -> f32 {
    let Scores { x, scale, bias, y, n } = row;
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        let old = *max;
        if old != f32::NEG_INFINITY {
            // Usually the shift stays: one pass, checking the slack on the way.
            let (t, done) = exp_sum_with::<true, true>(isa, row, old);
            if done == n {
                *sum += t;
                return 1.0;
            }
            return moved_step(isa, row, done, t, max, sum);
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
        let (t, _) = exp_sum_with::<true, false>(isa, row, new);
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
unsafe fn moved_step(isa: Isa, row: Scores, done: usize, t: f32, max: *mut f32, sum: *mut f32) -> f32 {
    // SAFETY: the caller's contract; every offset is below `n`.
    unsafe {
        let rest = row.from(done);
        let old = *max;
        let new = row_max(isa, rest.x, rest.scale, rest.bias, rest.n).max(old);
        let factor = exp_flushed(old - new);
        for i in 0..done {
            let v = *row.y.add(i) * factor;
            *row.y.add(i) = if v < FLUSH_BELOW { 0.0 } else { v };
        }
        let (rest, _) = exp_sum_with::<true, false>(isa, rest, new);
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
        let (sum, _) = exp_sum_with::<true, false>(isa, Scores { x, scale: 1.0, bias: std::ptr::null(), y, n }, max);
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
    // SAFETY: forwarded.
    unsafe { if bias.is_null() { row_max_isa::<false>(isa, x, scale, bias, n) } else { row_max_isa::<true>(isa, x, scale, bias, n) } }
}

isa_dispatch! {
    /// [`row_max_on`] on `isa` (the bias term when `BIAS`).
    ///
    /// # Safety
    /// As [`exp_sum`].
    unsafe fn row_max_isa<V, const BIAS: bool>(x: *const f32, scale: f32, bias: *const f32, n: usize) -> f32
        => row_max_on::<V, { <V as Vector>::UNROLL }, BIAS>(x, scale, bias, n)
}

/// `x·scale (+ bias)` of the vector at `i`, a multiply and an add (when `PART`, lanes `..len`
/// and `-inf` in the rest).
///
/// # Safety
/// As [`scores`].
#[inline(always)]
unsafe fn scaled<V: Vector, const BIAS: bool, const PART: bool>(x: *const f32, bias: *const f32, i: usize, len: usize, sc: V) -> V {
    // SAFETY: the caller's contract.
    unsafe {
        let v = get::<V, PART>(x, i, len).mul(sc);
        let v = if BIAS { v.add(get::<V, PART>(bias, i, len)) } else { v };
        if PART { V::select(V::first(len), v, V::splat(f32::NEG_INFINITY)) } else { v }
    }
}

/// [`row_max`] on `V`: `U` independent `max` chains, then single vectors, then a partial one.
///
/// # Safety
/// As [`exp_sum`], with `V`'s instructions supported.
#[inline(always)]
unsafe fn row_max_on<V: Vector, const U: usize, const BIAS: bool>(x: *const f32, scale: f32, bias: *const f32, n: usize) -> f32 {
    let l = V::LANES;
    // SAFETY: every vector read lies inside the rows; `V`'s instructions are supported.
    unsafe {
        let sc = V::splat(scale);
        let mut m = [V::splat(f32::NEG_INFINITY); U];
        let mut i = 0;
        while U > 1 && i + U * l <= n {
            for (j, m) in m.iter_mut().enumerate() {
                *m = scaled::<V, BIAS, false>(x, bias, i + j * l, l, sc).max_skip_nan(*m);
            }
            i += U * l;
        }
        while i + l <= n {
            m[0] = scaled::<V, BIAS, false>(x, bias, i, l, sc).max_skip_nan(m[0]);
            i += l;
        }
        if i < n {
            m[0] = scaled::<V, BIAS, true>(x, bias, i, n - i, sc).max_skip_nan(m[0]);
        }
        let mut w = U;
        while w > 1 {
            let (lo, hi) = m[..w].split_at_mut(w / 2);
            for (a, b) in lo.iter_mut().zip(hi.iter()) {
                *a = b.max_skip_nan(*a);
            }
            w /= 2;
        }
        m[0].max_lanes()
    }
}

isa_dispatch! {
    /// `y[i] = tanh(x[i])` for `i < n` on `isa`.
    ///
    /// # Safety
    /// `x` and `y` address `n` elements (they may be the same buffer); `isa` is supported.
    pub(super) unsafe fn tanh<V>(x: *const f32, y: *mut f32, n: usize) => tanh_on::<V>(x, y, n)
}

/// `exp(r) − 1 = r + r²·P(r)` of reduced arguments (`|r| ≤ ln2/2`), `P` ([`EXP_P`]) by
/// Estrin's scheme: three dependent steps instead of Horner's four, the same operation count.
/// The shorter chain is what counts: the softmax step ran 11% faster per row than with Horner.
/// (Grouping it as `(r + r²·b) + r⁴·(a + c₀r²)`, a step shorter for one multiply more, was 2%
/// slower.)
///
/// # Safety
/// `V`'s instructions are supported (as for every function here generic over [`Vector`]).
#[inline(always)]
unsafe fn expm1_reduced<V: Vector>(r: V) -> V {
    // SAFETY: the caller's contract.
    unsafe {
        let c = V::splat;
        let r2 = r.mul(r);
        let a = c(EXP_P[1]).madd(r, c(EXP_P[2]));
        let b = c(EXP_P[3]).madd(r, c(EXP_P[4]));
        c(EXP_P[0]).madd(r2, a).madd(r2, b).madd(r2, r)
    }
}

/// `exp` of every lane: 0 below [`FLUSH_BELOW`], `inf` past `f32::MAX`, NaN stays NaN. The
/// input is clamped into `[EXP_LO, EXP_HI]` (so `n ∈ [-61, 129]`), `n` rounded by
/// [`Vector::round_log2e`] (adding and subtracting [`ROUND`] but on AVX-512), `r` in two steps
/// (the `ln 2` split), and the scaling by [`Vector::scale_exp`].
///
/// # Safety
/// As [`expm1_reduced`].
#[inline(always)]
unsafe fn exp_vec<V: Vector>(x: V) -> V {
    // SAFETY: the caller's contract.
    unsafe {
        let c = V::splat;
        let x = x.at_least(c(EXP_LO)).at_most(c(EXP_HI));
        let (n, t) = V::round_log2e(x);
        let r = n.nmadd(c(LN2_LO), n.nmadd(c(LN2_HI), x));
        // A NaN lane has a NaN `e`, which any scale keeps NaN.
        let y = expm1_reduced(r).add(c(1.0)).scale_exp(n, t);
        y.zero_where_lt(y, c(FLUSH_BELOW))
    }
}

/// `exp` of lanes that are at most [`RESCALE_SLACK`] (or NaN): no clamps, `2ⁿ` from the
/// rounding constant's bits (normal for the lanes kept, `n ∈ [-61, 12]`) and the scaling folded
/// into the last step (`2ⁿ·q + 2ⁿ`, one rounding), lanes below [`FLUSH_X`] (`-inf` included)
/// masked to 0 at the end (what the steps make of them before, `inf` or NaN included, is
/// discarded; no step makes a subnormal, so none costs a microcode assist). NaN compares
/// unordered and stays NaN. Results within 2 ulp of the correctly rounded `exp`.
///
/// # Safety
/// As [`expm1_reduced`].
#[inline(always)]
unsafe fn exp_bounded_vec<V: Vector>(x: V) -> V {
    // SAFETY: the caller's contract.
    unsafe {
        let c = V::splat;
        let t = x.madd(c(LOG2E), c(ROUND));
        let n = t.sub(c(ROUND));
        // Fused, one step with ln 2 rounded to f32: its error (1.9·10⁻⁹) times `|n| ≤ 61`
        // moves results by at most an ulp more, on results below e⁻²⁰ only (checked by the
        // kernels' tests). Unfused, that step is 16 ulp off near the flush: two steps.
        let r = if V::FMA { n.nmadd(c(std::f32::consts::LN_2), x) } else { n.nmadd(c(LN2_LO), n.nmadd(c(LN2_HI), x)) };
        let pow2 = V::pow2_of_round(t, 127);
        expm1_reduced(r).madd(pow2, pow2).zero_where_lt(x, c(FLUSH_X))
    }
}

/// [`exp_bounded_vec`] when `BOUNDED`, else [`exp_vec`].
///
/// # Safety
/// As [`expm1_reduced`].
#[inline(always)]
unsafe fn exp_of<V: Vector, const BOUNDED: bool>(x: V) -> V {
    // SAFETY: the caller's contract.
    unsafe { if BOUNDED { exp_bounded_vec(x) } else { exp_vec(x) } }
}

/// `exp` of 16 lanes, for the AVX-512 row kernels of `rows.rs`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) fn exp16(x: __m512) -> __m512 {
    // SAFETY: AVX-512F is enabled here.
    unsafe { exp_vec(x) }
}

/// The vector at `p + i`: whole, or (when `PART`) its lanes `..len` with the rest 0.
///
/// # Safety
/// The lanes read lie inside the row at `p`; as [`expm1_reduced`].
#[inline(always)]
unsafe fn get<V: Vector, const PART: bool>(p: *const f32, i: usize, len: usize) -> V {
    // SAFETY: the caller's contract.
    unsafe { if PART { V::load_part(p.add(i), len) } else { V::load(p.add(i)) } }
}

/// Stores `v` at `p + i`: whole, or (when `PART`) its lanes `..len`.
///
/// # Safety
/// The lanes written lie inside the row at `p`; as [`expm1_reduced`].
#[inline(always)]
unsafe fn put<V: Vector, const PART: bool>(p: *mut f32, i: usize, len: usize, v: V) {
    // SAFETY: the caller's contract.
    unsafe { if PART { v.store_part(p.add(i), len) } else { v.store(p.add(i)) } }
}

/// The scores `scale·x + bias − shift` of the vector at `i` (`sc` the splatted scale, `sh` the
/// shift and `nsh` its negation; the bias term only when `BIAS`). When `PART`, only lanes
/// `..len` are read and the rest are `-inf`, whose `exp` is 0 and which no slack check sees.
///
/// # Safety
/// The lanes read lie inside `x` (and `bias` when `BIAS`); as [`expm1_reduced`].
#[allow(clippy::too_many_arguments)] // Inlined: the operands stay in registers.
#[inline(always)]
unsafe fn scores<V: Vector, const BIAS: bool, const PART: bool>(
    x: *const f32,
    bias: *const f32,
    i: usize,
    len: usize,
    sc: V,
    sh: V,
    nsh: V,
) -> V {
    // SAFETY: the caller's contract.
    unsafe {
        let xv = get::<V, PART>(x, i, len);
        // Without the bias, `x·scale − shift` is one multiply-add where fused (the same value
        // as a multiply and a subtraction either way).
        let v = if BIAS { xv.madd(sc, get::<V, PART>(bias, i, len)).sub(sh) } else { xv.madd(sc, nsh) };
        if PART { V::select(V::first(len), v, V::splat(f32::NEG_INFINITY)) } else { v }
    }
}

/// `exp_sum` on `V` (the bias term when `BIAS`; [`exp_bounded_vec`] when `BOUNDED`; see
/// [`exp_sum_with`] for `KEEP`), returning `Σ y` and how many elements were done: `U` vectors
/// per step (`V::UNROLL`, independent `exp` chains) into two accumulators where `U > 1`, then
/// single vectors, then one partial vector whose lanes past `n` are `-inf`.
///
/// The single vectors share the function and the first accumulator with the unrolled steps.
/// As a body of their own with their own accumulator, the portable `softmax_row` was 3%
/// faster, but AVX2's 9% and the portable softmax step 3% slower (where to spill differs on
/// 16 registers; `kernel_bench --rows` on Zen 4).
///
/// # Safety
/// As [`exp_sum`], with `V`'s instructions supported.
#[inline(always)]
unsafe fn exp_sum_on<V: Vector, const U: usize, const BIAS: bool, const BOUNDED: bool, const KEEP: bool>(
    x: *const f32,
    scale: f32,
    bias: *const f32,
    y: *mut f32,
    n: usize,
    shift: f32,
) -> (f32, usize) {
    let l = V::LANES;
    // SAFETY: every vector read or written lies inside the rows (`i + U·l ≤ n`, `i + l ≤ n`,
    // or the partial vector's `n − i` lanes); `V`'s instructions are supported (the caller's
    // contract).
    unsafe {
        let (sc, sh, nsh, slack) = (V::splat(scale), V::splat(shift), V::splat(-shift), V::splat(RESCALE_SLACK));
        let mut acc = [V::splat(0.0); 2];
        let mut i = 0;
        // (With one vector per step, the single-vector loop below does it all.)
        while U > 1 && i + U * l <= n {
            let mut e = [sc; U];
            let mut over = false;
            for (j, e) in e.iter_mut().enumerate() {
                *e = scores::<V, BIAS, false>(x, bias, i + j * l, l, sc, sh, nsh);
                over |= KEEP && V::any(e.gt(slack));
            }
            if over {
                // The single vectors below find the one to stop at.
                break;
            }
            for (j, e) in e.iter_mut().enumerate() {
                *e = exp_of::<V, BOUNDED>(*e);
                e.store(y.add(i + j * l));
            }
            // Pairwise down to two vectors (`(e0 + e2, e1 + e3)` for four), one add into each
            // accumulator.
            let mut w = U;
            while w > 2 {
                let (lo, hi) = e[..w].split_at_mut(w / 2);
                for (a, b) in lo.iter_mut().zip(hi.iter()) {
                    *a = a.add(*b);
                }
                w /= 2;
            }
            for (a, e) in acc.iter_mut().zip(&e[..w]) {
                *a = a.add(*e);
            }
            i += U * l;
        }
        while i + l <= n {
            let v = scores::<V, BIAS, false>(x, bias, i, l, sc, sh, nsh);
            if KEEP && V::any(v.gt(slack)) {
                return (acc[0].add(acc[1]).sum(), i);
            }
            let e = exp_of::<V, BOUNDED>(v);
            e.store(y.add(i));
            acc[0] = acc[0].add(e);
            i += l;
        }
        if i < n {
            let len = n - i;
            let v = scores::<V, BIAS, true>(x, bias, i, len, sc, sh, nsh);
            if KEEP && V::any(v.gt(slack)) {
                return (acc[0].add(acc[1]).sum(), i);
            }
            // The padding lanes' `exp` is 0.
            let e = exp_of::<V, BOUNDED>(v);
            e.store_part(y.add(i), len);
            acc[0] = acc[0].add(e);
        }
        (acc[0].add(acc[1]).sum(), n)
    }
}

/// Beyond this `|x|`, `tanh(x)` rounds to `±1` in f32.
pub(super) const TANH_BIG: f32 = 9.5;
/// Below this `|x|`, `tanh` is the odd polynomial (the `exp` form would cancel).
pub(super) const TANH_SMALL: f32 = 0.625;
/// Odd polynomial for `tanh` on `|x| < 0.625` (Cephes `tanhf`), highest degree first:
/// `tanh(x) ≈ x + x·z·P(z)` with `z = x²`.
pub(super) const TANH_P: [f32; 5] = [-5.704_988_7e-3, 2.063_909e-2, -5.373_971_6e-2, 1.333_144_2e-1, -3.333_328e-1];

/// `tanh` of every lane: the odd polynomial near 0, `1 − 2/(e^{2|x|} + 1)` with the sign of
/// `x` elsewhere (saturating to ±1; NaN stays NaN).
///
/// # Safety
/// As [`expm1_reduced`].
#[inline(always)]
unsafe fn tanh_vec<V: Vector>(x: V) -> V {
    // SAFETY: the caller's contract.
    unsafe {
        let c = V::splat;
        let ax = x.abs();
        let z = ax.mul(ax);
        let mut p = c(TANH_P[0]);
        for k in &TANH_P[1..] {
            p = p.madd(z, c(*k));
        }
        let small = p.mul(z).madd(ax, ax);
        let is_small = ax.lt(c(TANH_SMALL));
        // Soft-capped scores are mostly well inside the polynomial's range: skip the `exp`
        // path when every lane is (NaN lanes compare false and take it), where that test is
        // cheap (`Vector::CHEAP_ALL`).
        let abs = if V::CHEAP_ALL && V::all(is_small) {
            small
        } else {
            // Past |x| = 9.5, tanh rounds to 1 in f32: clamping there keeps `e` finite for a
            // reciprocal estimate, which would make NaN of `inf` (the clamp keeps NaN). A
            // division takes `inf` to 0, and the clamp cost AVX2 3%.
            let arg = ax.add(ax);
            let e = exp_vec(if V::RECIP_EST { arg.at_most(c(2.0 * TANH_BIG)) } else { arg });
            let d = e.add(c(1.0));
            // `1 − 2·(1/d)` in one multiply-add where fused; else `1 − 2/d` saves the
            // multiply (the same value: scaling by 2 is exact).
            let big = if V::FMA { c(2.0).nmadd(d.recip(), c(1.0)) } else { c(1.0).sub(c(2.0).div(d)) };
            V::select(is_small, small, big)
        };
        // |tanh| with x's sign bit (so tanh(-0) = -0).
        abs.or_sign(x)
    }
}

/// `y[i] = tanh(x[i])` on `V`: full vectors, then one partial vector.
///
/// # Safety
/// As [`tanh`], with `V`'s instructions supported.
#[inline(always)]
unsafe fn tanh_on<V: Vector>(x: *const f32, y: *mut f32, n: usize) {
    // SAFETY: every vector lies inside the rows; `V`'s instructions are supported.
    unsafe {
        let mut i = 0;
        while i + V::LANES <= n {
            tanh_vec(V::load(x.add(i))).store(y.add(i));
            i += V::LANES;
        }
        if i < n {
            tanh_vec(V::load_part(x.add(i), n - i)).store_part(y.add(i), n - i);
        }
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
    let (df, w, sums) = outs;
    let row = BwdRow { s, dp, lse, delta, rbias, df, w };
    // SAFETY: forwarded.
    unsafe {
        let acc = bwd_row_isa(isa, &row, n, scalars, flags);
        if !w.is_null() {
            // `sums` holds two floats when `w` is given.
            *sums = acc.0;
            *sums.add(1) = acc.1;
        }
    }
}

/// The rows of [`flash_bwd_row`].
struct BwdRow {
    s: *mut f32,
    dp: *mut f32,
    lse: *const f32,
    delta: *const f32,
    rbias: *const f32,
    df: *mut f32,
    w: *const f32,
}

/// The splatted scalars of [`flash_bwd_row`]: `alpha`, `factor`, `cbias`, `alpha·factor`, 1
/// and `-inf`.
struct BwdConst<V> {
    al: V,
    fac: V,
    cb: V,
    ds: V,
    one: V,
    ninf: V,
}

/// [`flash_bwd_row`] of the vector at `i` (when `PART`, its lanes `..len`, the others loaded as
/// 0 and kept out of the stores and sums), `acc` the sums `(Σ dF, Σ dF·w)`.
///
/// # Safety
/// The lanes lie inside the rows; as [`expm1_reduced`].
#[inline(always)]
unsafe fn bwd_vec<V: Vector, const PART: bool>(r: &BwdRow, i: usize, len: usize, k: &BwdConst<V>, flags: u32, acc: &mut [V; 2]) {
    let (tanh_on, sigmoid) = (flags & 1 != 0, flags & 2 != 0);
    // SAFETY: the caller's contract.
    unsafe {
        let mut uv = k.al.mul(get::<V, PART>(r.s, i, len));
        if tanh_on {
            uv = tanh_vec(uv);
        }
        let pv = get::<V, PART>(r.dp, i, len);
        let bias = if r.rbias.is_null() { k.cb } else { k.cb.add(get::<V, PART>(r.rbias, i, len)) };
        let x = k.fac.madd(uv, bias);
        let (wt, dfv) = if sigmoid {
            let e = exp_vec(V::splat(0.0).sub(x));
            let wt = k.one.div(k.one.add(e));
            (wt, pv.mul(wt).mul(k.one.sub(wt)))
        } else {
            let lv = get::<V, PART>(r.lse, i, len);
            let e = exp_vec(x.sub(lv));
            // A row with no kept key (lse = -inf) has no weights.
            let wt = e.zero_where(lv.eq(k.ninf));
            (wt, wt.mul(pv.sub(get::<V, PART>(r.delta, i, len))))
        };
        // Lanes past `n` hold what the zeroed loads made: keep them out of the sums.
        let dfv = if PART { V::select(V::first(len), dfv, V::splat(0.0)) } else { dfv };
        let d = if tanh_on { k.ds.mul(uv.nmadd(uv, k.one)) } else { k.ds };
        put::<V, PART>(r.s, i, len, wt);
        put::<V, PART>(r.dp, i, len, dfv.mul(d));
        if !r.df.is_null() {
            put::<V, PART>(r.df, i, len, dfv);
        }
        if !r.w.is_null() {
            acc[0] = acc[0].add(dfv);
            acc[1] = dfv.madd(get::<V, PART>(r.w, i, len), acc[1]);
        }
    }
}

/// [`flash_bwd_row`] on `V`: full vectors, then one partial vector; returns `(Σ dF, Σ dF·w)`
/// (0 when `w` is null). Plain loads and stores but for the last vector: the lane loop the AVX2
/// and portable paths once shared came out mostly scalar, and masked stores on every vector,
/// microcoded on AMD cores, made AVX2 slower than the portable path.
///
/// # Safety
/// As [`flash_bwd_row`], with `V`'s instructions supported.
#[inline(always)]
unsafe fn flash_bwd_row_on<V: Vector>(r: &BwdRow, n: usize, (alpha, factor, cbias): (f32, f32, f32), flags: u32) -> (f32, f32) {
    // SAFETY: every vector lies inside the rows; `V`'s instructions are supported.
    unsafe {
        let c = V::splat;
        let k = BwdConst { al: c(alpha), fac: c(factor), cb: c(cbias), ds: c(alpha * factor), one: c(1.0), ninf: c(f32::NEG_INFINITY) };
        let mut acc = [c(0.0); 2];
        let mut i = 0;
        while i + V::LANES <= n {
            bwd_vec::<V, false>(r, i, V::LANES, &k, flags, &mut acc);
            i += V::LANES;
        }
        if i < n {
            bwd_vec::<V, true>(r, i, n - i, &k, flags, &mut acc);
        }
        (acc[0].sum(), acc[1].sum())
    }
}

isa_dispatch! {
    /// [`flash_bwd_row_on`] on `isa`.
    ///
    /// # Safety
    /// As [`flash_bwd_row`].
    unsafe fn bwd_row_isa<V>(r: &BwdRow, n: usize, scalars: (f32, f32, f32), flags: u32) -> (f32, f32)
        => flash_bwd_row_on::<V>(r, n, scalars, flags)
}
