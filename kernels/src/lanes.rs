//! Kernels written once as fixed-width lane loops (`[f32; 8]` values, no intrinsics), which
//! LLVM turns into whatever vectors the function they are inlined into may use: SSE2 or NEON on
//! the portable path, 256-bit AVX2+FMA where a `#[target_feature]` wrapper instantiates them.
//! The kernels the portable path spends its time in (the micro-tile, the softmax step's `exp`
//! and row maximum, `tanh`, the flash backward's rows, the additive scores) are written on
//! explicit vectors instead ([`super::f4`], [`super::vector`]): LLVM's SLP vectoriser split the
//! lane form of that `exp` into 2-lane halves and left the backward rows mostly scalar.
//!
//! The `FMA` parameter chooses `a·b + c` as one fused operation (`f32::mul_add`) or as a
//! multiply and an add. It must be `true` only where the target has a fused multiply-add
//! instruction: elsewhere `mul_add` is a libm call per element. [`HAS_FMA`] is the portable
//! path's value.
//!
//! `exp` uses the same method and constants as the SIMD paths (see [`super::exp`]) with two
//! substitutions that vectorise without SSE4.1: rounding to an integer by adding and subtracting
//! `1.5·2²³`, and `2ⁿ` built from the exponent bits; and the polynomial one degree higher
//! (see [`expm1_reduced`]).

use super::exp::{EXP_HI, EXP_LO, EXP_P_CEPHES, FLUSH_BELOW, LN2_HI, LN2_LO, LOG2E, ROUND};

/// Lanes per value.
pub(super) const L: usize = 8;
/// One vector's worth of lanes.
type V = [f32; L];

/// Whether the portable build has a fused multiply-add instruction (AArch64 always; x86-64
/// only when built for a CPU with FMA, e.g. `-C target-cpu=native`).
pub(super) const HAS_FMA: bool = cfg!(any(target_arch = "aarch64", target_feature = "fma"));

/// `a·b + c`, fused when `FMA`.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// `exp(r) − 1 = r + r²·P(r)` for a reduced argument `|r| ≤ ln2/2`, `P` evaluated by Estrin's
/// scheme (three dependent steps instead of Horner's five; the same polynomial). `P` is Cephes'
/// degree 5, not the SIMD paths' degree 4 ([`super::exp::EXP_P`]): with one term less, LLVM's
/// SLP vectoriser reversed lanes with shuffles and the SSE2 softmax step took 390 ns per
/// 256-score row against 266 (both within 1 ulp).
#[inline(always)]
fn expm1_reduced<const FMA: bool>(r: f32) -> f32 {
    let r2 = r * r;
    let a = madd::<FMA>(EXP_P_CEPHES[0], r, EXP_P_CEPHES[1]);
    let b = madd::<FMA>(EXP_P_CEPHES[2], r, EXP_P_CEPHES[3]);
    let d = madd::<FMA>(EXP_P_CEPHES[4], r, EXP_P_CEPHES[5]);
    let p = madd::<FMA>(madd::<FMA>(a, r2, b), r2, d);
    madd::<FMA>(p, r2, r)
}

/// `exp` of every lane: 0 below [`FLUSH_BELOW`], `inf` past `f32::MAX`, NaN stays NaN.
#[inline(always)]
fn exp_v<const FMA: bool>(x: V) -> V {
    let mut y = [0.0; L];
    for l in 0..L {
        // Written so that NaN passes both clamps (a comparison with NaN is false).
        let v = if EXP_LO > x[l] { EXP_LO } else { x[l] };
        let v = if v > EXP_HI { EXP_HI } else { v };
        let t = madd::<FMA>(v, LOG2E, ROUND);
        let n = t - ROUND;
        let r = madd::<FMA>(-n, LN2_HI, v);
        let r = madd::<FMA>(-n, LN2_LO, r);
        let e = expm1_reduced::<FMA>(r) + 1.0;
        // `n ∈ [-61, 129]` (garbage for NaN, whose `e` is NaN anyway): `2ⁿ⁻²` is normal there,
        // and both products are exact (or overflow, as `e·2ⁿ` does), so `e·2ⁿ⁻²·4` is `e·2ⁿ`
        // rounded once, in 4 vector operations where two normal halves took 8.
        let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
        let e = e * f32::from_bits((ni.wrapping_add(127 - 2) as u32) << 23) * 4.0;
        y[l] = if e < FLUSH_BELOW { 0.0 } else { e };
    }
    y
}

/// `sigmoid(x) = 1 / (1 + exp(-x))` of every element (0 for `-inf` and below -88.7, 1 above
/// 41.6 where `exp(-x)` flushes to 0, NaN stays NaN).
///
/// # Safety
/// `x` and `y` address `n` elements (they may be the same buffer).
#[inline(always)]
pub(super) unsafe fn sigmoid<const FMA: bool>(x: *const f32, y: *mut f32, n: usize) {
    let row = |v: V| {
        let e = exp_v::<FMA>(v.map(|x| -x));
        e.map(|e| 1.0 / (1.0 + e))
    };
    let mut i = 0;
    while i + L <= n {
        // SAFETY: `i + L ≤ n`; `read_unaligned`/`write_unaligned` need no alignment.
        unsafe { (y.add(i) as *mut V).write_unaligned(row((x.add(i) as *const V).read_unaligned())) };
        i += L;
    }
    if i < n {
        let mut v = [0.0f32; L];
        for (l, out) in v.iter_mut().enumerate().take(n - i) {
            // SAFETY: `i + l < n`.
            *out = unsafe { *x.add(i + l) };
        }
        for (l, s) in row(v).iter().enumerate().take(n - i) {
            // SAFETY: `i + l < n`.
            unsafe { *y.add(i + l) = *s };
        }
    }
}

/// GELU of every lane (see [`gelu`]). A function, not a closure: it must be inlined into the
/// `#[target_feature]` wrapper, where a closure compiled on its own made each fused
/// multiply-add a libm call.
#[inline(always)]
fn gelu_v<const FMA: bool>(v: V) -> V {
    use super::rows::{ERFC_A, ERFC_P, FRAC_1_SQRT_2};
    let mut z = [0.0f32; L];
    let mut negz2 = [0.0f32; L];
    for l in 0..L {
        z[l] = v[l].abs() * FRAC_1_SQRT_2;
        negz2[l] = -z[l] * z[l];
    }
    let e = exp_v::<FMA>(negz2);
    let mut out = [0.0f32; L];
    for l in 0..L {
        let t = 1.0 / madd::<FMA>(z[l], ERFC_P, 1.0);
        let mut p = ERFC_A[0];
        for a in &ERFC_A[1..] {
            p = madd::<FMA>(p, t, *a);
        }
        let erfc = t * p * e[l];
        let one_plus_erf = if v[l] < 0.0 { erfc } else { 2.0 - erfc };
        out[l] = 0.5 * v[l] * one_plus_erf;
    }
    out
}

/// `gelu(x) = x/2 · (1 + erf(x/√2))` of every element, as [`super::rows`] computes it on
/// AVX-512 (`erfc` by Abramowitz & Stegun 7.1.26 with the vectorised `exp`). Whole vectors
/// only, the tail through one padded vector: per-lane loops up to a run-time length kept LLVM
/// from vectorising half the work (1.5 µs per 1000 elements on AVX2, 5.6× AVX-512's time).
///
/// # Safety
/// `x` and `y` address `n` elements (they may be the same buffer).
#[inline(always)]
pub(super) unsafe fn gelu<const FMA: bool>(x: *const f32, y: *mut f32, n: usize) {
    let mut i = 0;
    while i + L <= n {
        // SAFETY: `i + L ≤ n`; `read_unaligned`/`write_unaligned` need no alignment.
        unsafe { (y.add(i) as *mut V).write_unaligned(gelu_v::<FMA>((x.add(i) as *const V).read_unaligned())) };
        i += L;
    }
    if i < n {
        let mut v = [0.0f32; L];
        for (l, out) in v.iter_mut().enumerate().take(n - i) {
            // SAFETY: `i + l < n`.
            *out = unsafe { *x.add(i + l) };
        }
        for (l, g) in gelu_v::<FMA>(v).iter().enumerate().take(n - i) {
            // SAFETY: `i + l < n`.
            unsafe { *y.add(i + l) = *g };
        }
    }
}
