//! The portable path's hot kernels on an explicit 4-lane vector ([`F4`]: SSE2 on x86-64, NEON
//! on AArch64 with fused multiply-adds, an array elsewhere): the softmax `exp` ([`exp_sum`]),
//! the GEMM micro-tile ([`micro`], with [`splat4`] and [`pack_nt`] laying out its operands) and
//! the flash backward's rows ([`flash_bwd_row`]).
//!
//! The lane loops of [`super::lanes`] leave vectorising to LLVM's SLP pass, which split the
//! softmax step's `exp` into 2-lane halves on both baseline targets: on x86-64 SSE2 the step
//! ran at 245 ns per 256-score row and stalled on partial stack reloads, and on AArch64 every
//! operation was a 64-bit `.2s` NEON instruction, half the register. On [`F4`] the loop is
//! 4-wide by construction, and it takes the SIMD paths' bounded form (no clamps, the flush by
//! the input, see [`super::exp`]) and their degree-4 polynomial, which in the lane code made
//! the SLP pass reverse lanes. Method and constants are [`super::exp`]'s; the range reduction
//! keeps two steps (`ln 2` split) everywhere: without a fused multiply-add one step is 16 ulp
//! off near the flush.
//!
//! The micro-tile is the lane form's 6 × 8 loop with one change SSE2 needs: its two-operand
//! multiply overwrites an operand, so each product loads its multiplier afresh instead of
//! copying it between registers ([`F4::load_again`]; 4% more multiply-adds per second on Zen 5,
//! `kernel_bench --sse-ceiling`). [`splat4`] lays out the splatted strip.

use super::exp::{EXP_HI, EXP_LO, EXP_P, FLUSH_BELOW, FLUSH_X, LN2_HI, LN2_LO, LOG2E, RESCALE_SLACK, ROUND, TANH_BIG, TANH_P, TANH_SMALL};

#[cfg(target_arch = "aarch64")]
use std::arch::aarch64::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Evaluates baseline-ISA intrinsics: SSE2 on x86-64 and NEON on AArch64 are enabled in every
/// build for those targets.
macro_rules! base {
    ($e:expr) => {
        // SAFETY: the intrinsic needs only the target's baseline features (see above).
        unsafe { $e }
    };
}

/// Lanes per vector, and so the copies of each element of `A` in [`micro`]'s splatted strip.
pub(super) const W: usize = 4;
/// Columns of [`micro`]'s tile: two vectors.
pub(super) const NR: usize = 2 * W;

#[cfg(target_arch = "x86_64")]
type Repr = __m128;
#[cfg(target_arch = "aarch64")]
type Repr = float32x4_t;
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
type Repr = [f32; W];

/// Four `f32` lanes in one baseline vector register. A mask is an `F4` whose lanes are all ones
/// (true) or all zeros (false).
#[derive(Clone, Copy)]
struct F4(Repr);

#[cfg(target_arch = "x86_64")]
impl F4 {
    #[inline(always)]
    fn splat(v: f32) -> F4 {
        F4(base!(_mm_set1_ps(v)))
    }
    /// # Safety
    /// `p` addresses 4 floats.
    #[inline(always)]
    unsafe fn load(p: *const f32) -> F4 {
        // SAFETY: forwarded; `loadu` needs no alignment.
        F4(unsafe { _mm_loadu_ps(p) })
    }
    /// # Safety
    /// `p` addresses 4 floats.
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: forwarded; `storeu` needs no alignment.
        unsafe { _mm_storeu_ps(p, self.0) }
    }
    /// [`F4::load`] that is never merged with another load of `p`: SSE2's two-operand
    /// multiply overwrites its operand, and loading a multiplier once per product runs the
    /// micro-tile faster than copying it between registers (see [`micro`]).
    ///
    /// # Safety
    /// `p` addresses 4 floats.
    #[inline(always)]
    unsafe fn load_again(p: *const f32) -> F4 {
        /// A vector at any address (a packed struct has alignment 1).
        #[repr(C, packed)]
        #[derive(Clone, Copy)]
        struct Unaligned(__m128);
        // SAFETY: forwarded; a volatile read of a packed struct is one `movups`.
        F4(unsafe { std::ptr::read_volatile(p as *const Unaligned) }.0)
    }
    #[inline(always)]
    fn add(self, o: F4) -> F4 {
        F4(base!(_mm_add_ps(self.0, o.0)))
    }
    #[inline(always)]
    fn sub(self, o: F4) -> F4 {
        F4(base!(_mm_sub_ps(self.0, o.0)))
    }
    #[inline(always)]
    fn mul(self, o: F4) -> F4 {
        F4(base!(_mm_mul_ps(self.0, o.0)))
    }
    /// `self·b + c`, fused where the target has FMA.
    #[inline(always)]
    fn madd(self, b: F4, c: F4) -> F4 {
        #[cfg(target_feature = "fma")]
        return F4(base!(_mm_fmadd_ps(self.0, b.0, c.0)));
        #[cfg(not(target_feature = "fma"))]
        self.mul(b).add(c)
    }
    /// `c − self·b`, fused where the target has FMA.
    #[inline(always)]
    fn nmadd(self, b: F4, c: F4) -> F4 {
        #[cfg(target_feature = "fma")]
        return F4(base!(_mm_fnmadd_ps(self.0, b.0, c.0)));
        #[cfg(not(target_feature = "fma"))]
        c.sub(self.mul(b))
    }
    /// `lo` where `self < lo`; NaN stays NaN.
    #[inline(always)]
    fn at_least(self, lo: F4) -> F4 {
        // `maxps` returns its second operand when either is NaN.
        F4(base!(_mm_max_ps(lo.0, self.0)))
    }
    /// `hi` where `self > hi`; NaN stays NaN.
    #[inline(always)]
    fn at_most(self, hi: F4) -> F4 {
        F4(base!(_mm_min_ps(hi.0, self.0)))
    }
    /// The mask of `self < o` (false for NaN).
    #[inline(always)]
    fn lt(self, o: F4) -> F4 {
        F4(base!(_mm_cmplt_ps(self.0, o.0)))
    }
    /// Whether any lane of `self > o`.
    #[inline(always)]
    fn any_gt(self, o: F4) -> bool {
        base!(_mm_movemask_ps(_mm_cmpgt_ps(self.0, o.0))) != 0
    }
    /// 0 where `mask`, else `self`.
    #[inline(always)]
    fn zero_where(self, mask: F4) -> F4 {
        F4(base!(_mm_andnot_ps(mask.0, self.0)))
    }
    /// `2ⁿ` from `t = x·log2 e + ROUND` (whose low mantissa bits are `n`), with the exponent
    /// bias `bias` (`n + bias` must be a normal exponent).
    #[inline(always)]
    fn pow2_of_round(t: F4, bias: i32) -> F4 {
        let b = base!(_mm_set1_epi32(bias - ROUND.to_bits() as i32));
        F4(base!(_mm_castsi128_ps(_mm_slli_epi32::<23>(_mm_add_epi32(_mm_castps_si128(t.0), b)))))
    }
    #[inline(always)]
    fn div(self, o: F4) -> F4 {
        F4(base!(_mm_div_ps(self.0, o.0)))
    }
    /// The mask of `self == o` (false for NaN).
    #[inline(always)]
    fn eq(self, o: F4) -> F4 {
        F4(base!(_mm_cmpeq_ps(self.0, o.0)))
    }
    /// `a` where `mask`, else `b`.
    #[inline(always)]
    fn select(mask: F4, a: F4, b: F4) -> F4 {
        F4(base!(_mm_or_ps(_mm_and_ps(mask.0, a.0), _mm_andnot_ps(mask.0, b.0))))
    }
    /// The sign bits of `self` (all else 0).
    #[inline(always)]
    fn sign(self) -> F4 {
        F4(base!(_mm_and_ps(self.0, _mm_set1_ps(-0.0))))
    }
    #[inline(always)]
    fn abs(self) -> F4 {
        F4(base!(_mm_andnot_ps(_mm_set1_ps(-0.0), self.0)))
    }
    /// The bits of `self` or `o`.
    #[inline(always)]
    fn or(self, o: F4) -> F4 {
        F4(base!(_mm_or_ps(self.0, o.0)))
    }
    /// The 4 × 4 transpose of rows `r`.
    #[inline(always)]
    fn transpose(r: [F4; 4]) -> [F4; 4] {
        let (t0, t1) = (base!(_mm_unpacklo_ps(r[0].0, r[1].0)), base!(_mm_unpacklo_ps(r[2].0, r[3].0)));
        let (t2, t3) = (base!(_mm_unpackhi_ps(r[0].0, r[1].0)), base!(_mm_unpackhi_ps(r[2].0, r[3].0)));
        [
            F4(base!(_mm_movelh_ps(t0, t1))),
            F4(base!(_mm_movehl_ps(t1, t0))),
            F4(base!(_mm_movelh_ps(t2, t3))),
            F4(base!(_mm_movehl_ps(t3, t2))),
        ]
    }
    /// Lane `Q` in every lane.
    #[inline(always)]
    fn lane<const Q: i32>(self) -> F4 {
        match Q {
            0 => F4(base!(_mm_shuffle_ps::<0x00>(self.0, self.0))),
            1 => F4(base!(_mm_shuffle_ps::<0x55>(self.0, self.0))),
            2 => F4(base!(_mm_shuffle_ps::<0xaa>(self.0, self.0))),
            _ => F4(base!(_mm_shuffle_ps::<0xff>(self.0, self.0))),
        }
    }
    #[inline(always)]
    fn sum(self) -> f32 {
        let half = base!(_mm_add_ps(self.0, _mm_movehl_ps(self.0, self.0)));
        base!(_mm_cvtss_f32(_mm_add_ss(half, _mm_shuffle_ps::<1>(half, half))))
    }
}

#[cfg(target_arch = "aarch64")]
impl F4 {
    #[inline(always)]
    fn splat(v: f32) -> F4 {
        F4(base!(vdupq_n_f32(v)))
    }
    /// # Safety
    /// `p` addresses 4 floats.
    #[inline(always)]
    unsafe fn load(p: *const f32) -> F4 {
        // SAFETY: forwarded; `ld1` needs the alignment of `f32` only.
        F4(unsafe { vld1q_f32(p) })
    }
    /// # Safety
    /// `p` addresses 4 floats.
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: as `load`.
        unsafe { vst1q_f32(p, self.0) }
    }
    #[inline(always)]
    fn add(self, o: F4) -> F4 {
        F4(base!(vaddq_f32(self.0, o.0)))
    }
    #[inline(always)]
    fn sub(self, o: F4) -> F4 {
        F4(base!(vsubq_f32(self.0, o.0)))
    }
    #[inline(always)]
    fn mul(self, o: F4) -> F4 {
        F4(base!(vmulq_f32(self.0, o.0)))
    }
    /// `self·b + c`, fused.
    #[inline(always)]
    fn madd(self, b: F4, c: F4) -> F4 {
        F4(base!(vfmaq_f32(c.0, self.0, b.0)))
    }
    /// `c − self·b`, fused.
    #[inline(always)]
    fn nmadd(self, b: F4, c: F4) -> F4 {
        F4(base!(vfmsq_f32(c.0, self.0, b.0)))
    }
    /// `lo` where `self < lo`; NaN stays NaN (`fmax` propagates it).
    #[inline(always)]
    fn at_least(self, lo: F4) -> F4 {
        F4(base!(vmaxq_f32(self.0, lo.0)))
    }
    /// `hi` where `self > hi`; NaN stays NaN.
    #[inline(always)]
    fn at_most(self, hi: F4) -> F4 {
        F4(base!(vminq_f32(self.0, hi.0)))
    }
    /// The mask of `self < o` (false for NaN).
    #[inline(always)]
    fn lt(self, o: F4) -> F4 {
        F4(base!(vreinterpretq_f32_u32(vcltq_f32(self.0, o.0))))
    }
    /// Whether any lane of `self > o`.
    #[inline(always)]
    fn any_gt(self, o: F4) -> bool {
        base!(vmaxvq_u32(vcgtq_f32(self.0, o.0))) != 0
    }
    /// 0 where `mask`, else `self`.
    #[inline(always)]
    fn zero_where(self, mask: F4) -> F4 {
        F4(base!(vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(self.0), vreinterpretq_u32_f32(mask.0)))))
    }
    /// As the x86-64 form.
    #[inline(always)]
    fn pow2_of_round(t: F4, bias: i32) -> F4 {
        let b = base!(vdupq_n_s32(bias - ROUND.to_bits() as i32));
        F4(base!(vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(vreinterpretq_s32_f32(t.0), b)))))
    }
    #[inline(always)]
    fn div(self, o: F4) -> F4 {
        F4(base!(vdivq_f32(self.0, o.0)))
    }
    /// The mask of `self == o` (false for NaN).
    #[inline(always)]
    fn eq(self, o: F4) -> F4 {
        F4(base!(vreinterpretq_f32_u32(vceqq_f32(self.0, o.0))))
    }
    /// `a` where `mask`, else `b`.
    #[inline(always)]
    fn select(mask: F4, a: F4, b: F4) -> F4 {
        F4(base!(vbslq_f32(vreinterpretq_u32_f32(mask.0), a.0, b.0)))
    }
    /// The sign bits of `self` (all else 0).
    #[inline(always)]
    fn sign(self) -> F4 {
        F4(base!(vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(self.0), vdupq_n_u32(1 << 31)))))
    }
    #[inline(always)]
    fn abs(self) -> F4 {
        F4(base!(vabsq_f32(self.0)))
    }
    /// The bits of `self` or `o`.
    #[inline(always)]
    fn or(self, o: F4) -> F4 {
        F4(base!(vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(self.0), vreinterpretq_u32_f32(o.0)))))
    }
    /// The 4 × 4 transpose of rows `r`.
    #[inline(always)]
    fn transpose(r: [F4; 4]) -> [F4; 4] {
        let d = |v: float32x4_t| base!(vreinterpretq_f64_f32(v));
        let f = |v: float64x2_t| F4(base!(vreinterpretq_f32_f64(v)));
        let (t0, t1) = (base!(vzip1q_f32(r[0].0, r[1].0)), base!(vzip1q_f32(r[2].0, r[3].0)));
        let (t2, t3) = (base!(vzip2q_f32(r[0].0, r[1].0)), base!(vzip2q_f32(r[2].0, r[3].0)));
        [
            f(base!(vzip1q_f64(d(t0), d(t1)))),
            f(base!(vzip2q_f64(d(t0), d(t1)))),
            f(base!(vzip1q_f64(d(t2), d(t3)))),
            f(base!(vzip2q_f64(d(t2), d(t3)))),
        ]
    }
    /// Lane `Q` in every lane.
    #[inline(always)]
    fn lane<const Q: i32>(self) -> F4 {
        F4(base!(vdupq_laneq_f32::<Q>(self.0)))
    }
    #[inline(always)]
    fn sum(self) -> f32 {
        base!(vaddvq_f32(self.0))
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
impl F4 {
    #[inline(always)]
    fn splat(v: f32) -> F4 {
        F4([v; W])
    }
    #[inline(always)]
    fn map2(self, o: F4, f: impl Fn(f32, f32) -> f32) -> F4 {
        F4(std::array::from_fn(|l| f(self.0[l], o.0[l])))
    }
    /// # Safety
    /// `p` addresses 4 floats.
    #[inline(always)]
    unsafe fn load(p: *const f32) -> F4 {
        // SAFETY: forwarded.
        F4(unsafe { (p as *const [f32; W]).read_unaligned() })
    }
    /// # Safety
    /// `p` addresses 4 floats.
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: forwarded.
        unsafe { (p as *mut [f32; W]).write_unaligned(self.0) }
    }
    #[inline(always)]
    fn add(self, o: F4) -> F4 {
        self.map2(o, |a, b| a + b)
    }
    #[inline(always)]
    fn sub(self, o: F4) -> F4 {
        self.map2(o, |a, b| a - b)
    }
    #[inline(always)]
    fn mul(self, o: F4) -> F4 {
        self.map2(o, |a, b| a * b)
    }
    #[inline(always)]
    fn madd(self, b: F4, c: F4) -> F4 {
        self.mul(b).add(c)
    }
    #[inline(always)]
    fn nmadd(self, b: F4, c: F4) -> F4 {
        c.sub(self.mul(b))
    }
    #[inline(always)]
    fn at_least(self, lo: F4) -> F4 {
        self.map2(lo, |a, lo| if lo > a { lo } else { a })
    }
    #[inline(always)]
    fn at_most(self, hi: F4) -> F4 {
        self.map2(hi, |a, hi| if a > hi { hi } else { a })
    }
    #[inline(always)]
    fn lt(self, o: F4) -> F4 {
        self.map2(o, |a, b| f32::from_bits(if a < b { u32::MAX } else { 0 }))
    }
    #[inline(always)]
    fn any_gt(self, o: F4) -> bool {
        (0..W).any(|l| self.0[l] > o.0[l])
    }
    #[inline(always)]
    fn zero_where(self, mask: F4) -> F4 {
        self.map2(mask, |a, m| f32::from_bits(a.to_bits() & !m.to_bits()))
    }
    #[inline(always)]
    fn pow2_of_round(t: F4, bias: i32) -> F4 {
        F4(t.0.map(|t| f32::from_bits((t.to_bits() as i32).wrapping_add(bias - ROUND.to_bits() as i32).wrapping_shl(23) as u32)))
    }
    #[inline(always)]
    fn div(self, o: F4) -> F4 {
        self.map2(o, |a, b| a / b)
    }
    #[inline(always)]
    fn eq(self, o: F4) -> F4 {
        self.map2(o, |a, b| f32::from_bits(if a == b { u32::MAX } else { 0 }))
    }
    #[inline(always)]
    fn select(mask: F4, a: F4, b: F4) -> F4 {
        F4(std::array::from_fn(|l| f32::from_bits((a.0[l].to_bits() & mask.0[l].to_bits()) | (b.0[l].to_bits() & !mask.0[l].to_bits()))))
    }
    #[inline(always)]
    fn sign(self) -> F4 {
        F4(self.0.map(|a| f32::from_bits(a.to_bits() & (1 << 31))))
    }
    #[inline(always)]
    fn abs(self) -> F4 {
        F4(self.0.map(f32::abs))
    }
    #[inline(always)]
    fn or(self, o: F4) -> F4 {
        self.map2(o, |a, b| f32::from_bits(a.to_bits() | b.to_bits()))
    }
    /// The 4 × 4 transpose of rows `r`.
    #[inline(always)]
    fn transpose(r: [F4; 4]) -> [F4; 4] {
        std::array::from_fn(|q| F4(std::array::from_fn(|l| r[l].0[q])))
    }
    /// Lane `Q` in every lane.
    #[inline(always)]
    fn lane<const Q: i32>(self) -> F4 {
        F4([self.0[Q as usize]; W])
    }
    #[inline(always)]
    fn sum(self) -> f32 {
        self.0.iter().sum()
    }
}

/// `(t, q)`: `t = x·log2 e + ROUND`, whose low mantissa bits are `n = round(x·log2 e)`, and
/// `q = exp(r) − 1 = r + r²·P(r)` by Estrin's scheme, for `r = x − n·ln 2` in two steps.
#[inline(always)]
fn reduce(x: F4) -> (F4, F4) {
    let c = F4::splat;
    let t = x.madd(c(LOG2E), c(ROUND));
    let n = t.sub(c(ROUND));
    let r = n.nmadd(c(LN2_HI), x);
    let r = n.nmadd(c(LN2_LO), r);
    let r2 = r.mul(r);
    let a = c(EXP_P[1]).madd(r, c(EXP_P[2]));
    let b = c(EXP_P[3]).madd(r, c(EXP_P[4]));
    let p = c(EXP_P[0]).madd(r2, a).madd(r2, b);
    (t, p.madd(r2, r))
}

/// `exp` of lanes that are at most [`RESCALE_SLACK`] (or NaN), as the SIMD paths' bounded form:
/// no clamps, lanes below [`FLUSH_X`] (`-inf` included) masked to 0 at the end, NaN stays NaN.
#[inline(always)]
fn exp_bounded(x: F4) -> F4 {
    let (t, q) = reduce(x);
    // `n ∈ [-61, 12]` for the lanes kept: `2ⁿ` is normal.
    let pow2 = F4::pow2_of_round(t, 127);
    q.madd(pow2, pow2).zero_where(x.lt(F4::splat(FLUSH_X)))
}

/// `exp` of any lanes: 0 below [`FLUSH_BELOW`], `inf` past `f32::MAX`, NaN stays NaN.
#[inline(always)]
fn exp_any(x: F4) -> F4 {
    let x = x.at_least(F4::splat(EXP_LO)).at_most(F4::splat(EXP_HI));
    let (t, q) = reduce(x);
    // `n ∈ [-61, 129]`: `2ⁿ⁻²` is normal and both products exact (or overflowing, as `e·2ⁿ`
    // does), so `e·2ⁿ⁻²·4` is `e·2ⁿ` rounded once.
    let e = q.add(F4::splat(1.0)).mul(F4::pow2_of_round(t, 125)).mul(F4::splat(4.0));
    e.zero_where(e.lt(F4::splat(FLUSH_BELOW)))
}

/// The portable `exp_sum` (see `exp::exp_sum_with` for `BOUNDED` and `KEEP`): `y[i] =
/// exp(scale·x[i] + bias[i] − shift)` (the bias term only when `BIAS`), returning `Σ y` and how
/// many elements were done. Four vectors per step, so that independent `exp` chains overlap
/// (two measured 4% slower on Zen 5); the tail through one vector padded with `-inf` (whose
/// `exp` is 0).
///
/// # Safety
/// `x` and `y` address `n` elements (they may be the same buffer), and so does `bias` when
/// `BIAS`.
#[inline(always)]
pub(super) unsafe fn exp_sum<const BOUNDED: bool, const KEEP: bool, const BIAS: bool>(
    x: *const f32,
    scale: f32,
    bias: *const f32,
    y: *mut f32,
    n: usize,
    shift: f32,
) -> (f32, usize) {
    let (sc, sh, slack) = (F4::splat(scale), F4::splat(shift), F4::splat(RESCALE_SLACK));
    let exp = |v: F4| if BOUNDED { exp_bounded(v) } else { exp_any(v) };
    // SAFETY (for the closure's callers): `i + W ≤ n`.
    let scores = |i: usize| unsafe {
        let v = F4::load(x.add(i)).mul(sc);
        if BIAS { v.add(F4::load(bias.add(i))).sub(sh) } else { v.sub(sh) }
    };
    let (mut s0, mut s1) = (F4::splat(0.0), F4::splat(0.0));
    let mut i = 0;
    while i + 4 * W <= n {
        let (v0, v1, v2, v3) = (scores(i), scores(i + W), scores(i + 2 * W), scores(i + 3 * W));
        if KEEP && (v0.any_gt(slack) || v1.any_gt(slack) || v2.any_gt(slack) || v3.any_gt(slack)) {
            break;
        }
        let (e0, e1, e2, e3) = (exp(v0), exp(v1), exp(v2), exp(v3));
        // SAFETY: `i + 4W ≤ n`.
        unsafe {
            e0.store(y.add(i));
            e1.store(y.add(i + W));
            e2.store(y.add(i + 2 * W));
            e3.store(y.add(i + 3 * W));
        }
        s0 = s0.add(e0.add(e2));
        s1 = s1.add(e1.add(e3));
        i += 4 * W;
    }
    let mut sum = s0.add(s1);
    while i < n {
        let len = W.min(n - i);
        let v = if len == W {
            scores(i)
        } else {
            let mut pad = [f32::NEG_INFINITY; W];
            for (l, s) in pad.iter_mut().enumerate().take(len) {
                // SAFETY: `i + l < n`.
                *s = unsafe { scale * *x.add(i + l) + if BIAS { *bias.add(i + l) } else { 0.0 } - shift };
            }
            // SAFETY: `pad` holds 4 floats.
            unsafe { F4::load(pad.as_ptr()) }
        };
        if KEEP && v.any_gt(slack) {
            return (sum.sum(), i);
        }
        let e = exp(v);
        if len == W {
            // SAFETY: `i + W ≤ n`.
            unsafe { e.store(y.add(i)) };
        } else {
            let mut out = [0.0f32; W];
            // SAFETY: `out` holds 4 floats; `i + l < n` below.
            unsafe {
                e.store(out.as_mut_ptr());
                std::ptr::copy_nonoverlapping(out.as_ptr(), y.add(i), len);
            }
        }
        // Padding lanes are 0.
        sum = sum.add(e);
        i += len;
    }
    (sum.sum(), n)
}

/// `MR × 8` micro-tile of the portable GEMM: `C (+)= alpha · A[MR × kc] · panel[kc × 8]` in
/// `2·MR` accumulators (12 of the 16 SSE registers for `MR = 6`; NEON has 32). `A` comes
/// splatted (`gemm::Kernel::A_SPLAT`), so each multiplier is one loaded vector.
///
/// # Safety
/// `a` holds `kc` groups of `MR` splatted elements of 4 floats; the panel
/// `kc` rows of 8 (stride `ldp`); the tile of `C` is valid for `t.rows = MR` rows and
/// `t.cols` columns.
#[inline(always)]
pub(super) unsafe fn micro<const MR: usize>(kc: usize, a: *const f32, panel: *const f32, ldp: usize, t: &super::gemm::Tile) {
    let zero = F4::splat(0.0);
    let mut acc = [[zero; 2]; MR];
    for p in 0..kc {
        // SAFETY: panel row `p` holds 8 floats; group `p` of the strip `MR` vectors.
        unsafe {
            let row = panel.add(p * ldp);
            let (b0, b1) = (F4::load(row), F4::load(row.add(W)));
            for (i, c) in acc.iter_mut().enumerate() {
                let ai = a.add((p * MR + i) * W);
                // Without FMA the multiplier is loaded once per product, in program order (see
                // `F4::load_again`).
                #[cfg(all(target_arch = "x86_64", not(target_feature = "fma")))]
                let (a0, a1) = (F4::load_again(ai), F4::load_again(ai));
                #[cfg(not(all(target_arch = "x86_64", not(target_feature = "fma"))))]
                let (a0, a1) = (F4::load(ai), F4::load(ai));
                c[0] = a0.madd(b0, c[0]);
                c[1] = a1.madd(b1, c[1]);
            }
        }
    }
    let alpha = F4::splat(t.alpha);
    for (i, c) in acc.iter().enumerate() {
        // SAFETY: row `i` of the tile holds `t.cols ≤ 8` elements.
        unsafe {
            let dst = t.c.add(i * t.ldc);
            if t.cols == NR {
                for (h, v) in c.iter().enumerate() {
                    let d = dst.add(h * W);
                    let out = if t.accumulate { v.madd(alpha, F4::load(d)) } else { v.mul(alpha) };
                    out.store(d);
                }
            } else {
                let mut row = [0.0f32; NR];
                c[0].store(row.as_mut_ptr());
                c[1].store(row.as_mut_ptr().add(W));
                for (l, v) in row.iter().enumerate().take(t.cols) {
                    let d = dst.add(l);
                    *d = if t.accumulate { madd1(*v, t.alpha, *d) } else { *v * t.alpha };
                }
            }
        }
    }
}

/// `a·b + c` for one lane, fused exactly where [`F4::madd`] is.
#[inline(always)]
fn madd1(a: f32, b: f32, c: f32) -> f32 {
    if super::lanes::HAS_FMA { a.mul_add(b, c) } else { a * b + c }
}

/// Stores each of the 4 floats at `src` as a vector of 4 copies at `dst(q)` (the splatted `A`
/// strip of [`micro`]; see `gemm::splat_strip`): one load and four shuffles.
///
/// # Safety
/// `src` addresses 4 floats, and each `dst(q)` 4.
#[inline(always)]
pub(super) unsafe fn splat4(src: *const f32, dst: impl Fn(usize) -> *mut f32) {
    // SAFETY: forwarded.
    unsafe {
        let v = F4::load(src);
        v.lane::<0>().store(dst(0));
        v.lane::<1>().store(dst(1));
        v.lane::<2>().store(dst(2));
        v.lane::<3>().store(dst(3));
    }
}

/// Packs the `kc × nc` block of `Bᵀ` at `b` (element `(p, j)` at `b[j·ldb + p]`) into panels
/// of `kc × 8`, zero past `nc`, as `gemm::pack_generic` does for `Nt`, but by 4 × 4 transposes
/// of 4 key rows (4 loads, 8 shuffles and 4 stores per 16 elements, where the generic loop
/// moves one element at a time); panels with fewer than 8 columns and the last `kc % 4` steps
/// element by element.
///
/// # Safety
/// As `gemm::Kernel::pack` with `Layout::Nt`.
#[inline(always)]
pub(super) unsafe fn pack_nt(b: *const f32, ldb: usize, kc: usize, nc: usize, out: *mut f32) {
    let full_k = kc / W * W;
    for (jr, j0) in (0..nc).step_by(NR).enumerate() {
        let cols = NR.min(nc - j0);
        // SAFETY: the caller's contract covers rows `j0..j0 + cols` of the block (`kc` each)
        // and the panel.
        unsafe {
            let panel = out.add(jr * kc * NR);
            let fast_k = if cols == NR { full_k } else { 0 };
            for g in (0..NR).step_by(W) {
                let rows: [*const f32; W] = std::array::from_fn(|l| b.add((j0 + g + l) * ldb));
                for p in (0..fast_k).step_by(W) {
                    let t = F4::transpose(rows.map(|r| F4::load(r.add(p))));
                    for (q, v) in t.iter().enumerate() {
                        v.store(panel.add((p + q) * NR + g));
                    }
                }
            }
            for jj in 0..NR {
                let src = b.add((j0 + jj) * ldb);
                for p in fast_k..kc {
                    *panel.add(p * NR + jj) = if jj < cols { *src.add(p) } else { 0.0 };
                }
            }
        }
    }
}

/// `tanh` of every lane as the SIMD paths compute it: the odd polynomial below
/// [`TANH_SMALL`], `1 − 2/(e^{2|x|} + 1)` above (`2|x|` clamped where `tanh` rounds to 1),
/// with the sign of `x`; NaN stays NaN.
#[inline(always)]
fn tanh(x: F4) -> F4 {
    let c = F4::splat;
    let ax = x.abs();
    let z = ax.mul(ax);
    let mut p = c(TANH_P[0]);
    for k in &TANH_P[1..] {
        p = p.madd(z, c(*k));
    }
    let small = p.mul(z).madd(ax, ax);
    let e = exp_any(ax.add(ax).at_most(c(2.0 * TANH_BIG)));
    let big = c(1.0).sub(c(2.0).div(e.add(c(1.0))));
    F4::select(ax.lt(c(TANH_SMALL)), small, big).or(x.sign())
}

/// `y[i] = tanh(x[i])` by [`tanh`].
///
/// # Safety
/// `x` and `y` address `n` elements (they may be the same buffer).
#[inline(always)]
pub(super) unsafe fn tanh_row(x: *const f32, y: *mut f32, n: usize) {
    let mut i = 0;
    while i < n {
        let len = W.min(n - i);
        // SAFETY: lanes `i..i + len` lie inside both rows.
        unsafe { store_part(tanh(load_part(x.add(i), len)), y.add(i), len) };
        i += len;
    }
}

/// Lanes `..len` of `p` (the rest 0).
///
/// # Safety
/// `p` addresses `len ≤ 4` floats.
#[inline(always)]
unsafe fn load_part(p: *const f32, len: usize) -> F4 {
    if len == W {
        // SAFETY: forwarded.
        return unsafe { F4::load(p) };
    }
    let mut a = [0.0f32; W];
    // SAFETY: forwarded; `a` holds 4 floats.
    unsafe {
        std::ptr::copy_nonoverlapping(p, a.as_mut_ptr(), len);
        F4::load(a.as_ptr())
    }
}

/// Stores lanes `..len` of `v` at `p`.
///
/// # Safety
/// `p` addresses `len ≤ 4` floats.
#[inline(always)]
unsafe fn store_part(v: F4, p: *mut f32, len: usize) {
    // SAFETY: forwarded; `a` holds 4 floats.
    unsafe {
        if len == W {
            v.store(p);
        } else {
            let mut a = [0.0f32; W];
            v.store(a.as_mut_ptr());
            std::ptr::copy_nonoverlapping(a.as_ptr(), p, len);
        }
    }
}

/// The portable `exp::flash_bwd_row` (one key row of a flash backward tile), as its AVX-512
/// form computes it: the tail through one vector whose lanes past `n` load as 0 and are kept
/// out of the stores and sums.
///
/// # Safety
/// As `exp::flash_bwd_row`.
#[allow(clippy::too_many_arguments)] // Mirrors the C ABI entry point.
pub(super) unsafe fn flash_bwd_row(
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
    let (tanh_on, sigmoid) = (flags & 1 != 0, flags & 2 != 0);
    let c = F4::splat;
    let (al, fac, cb, ds, one, ninf) = (c(alpha), c(factor), c(cbias), c(alpha * factor), c(1.0), c(f32::NEG_INFINITY));
    let (mut s0, mut s1) = (c(0.0), c(0.0));
    let mut i = 0;
    while i < n {
        let len = W.min(n - i);
        // SAFETY (both closures): lanes `i..i + len` lie inside the row.
        let load = |p: *const f32| unsafe { load_part(p.add(i), len) };
        let store = |p: *mut f32, v: F4| unsafe { store_part(v, p.add(i), len) };
        let mut uv = al.mul(load(s));
        if tanh_on {
            uv = tanh(uv);
        }
        let pv = load(dp);
        let bias = if rbias.is_null() { cb } else { cb.add(load(rbias)) };
        let x = fac.madd(uv, bias);
        let (wt, dfv) = if sigmoid {
            let e = exp_any(c(0.0).sub(x));
            let wt = one.div(one.add(e));
            (wt, pv.mul(wt).mul(one.sub(wt)))
        } else {
            let lv = load(lse);
            let e = exp_any(x.sub(lv));
            // A row with no kept key (lse = -inf) has no weights.
            let wt = e.zero_where(lv.eq(ninf));
            (wt, wt.mul(pv.sub(load(delta))))
        };
        // Lanes past `n` hold what the zeroed loads made: keep them out of the sums.
        let dfv = if len == W { dfv } else { F4::select(first_lanes(len), dfv, c(0.0)) };
        let d = if tanh_on { ds.mul(uv.nmadd(uv, one)) } else { ds };
        store(s, wt);
        store(dp, dfv.mul(d));
        if !df.is_null() {
            store(df, dfv);
        }
        if !w.is_null() {
            s0 = s0.add(dfv);
            s1 = dfv.madd(load(w), s1);
        }
        i += len;
    }
    if !w.is_null() {
        // SAFETY: `sums` holds two floats when `w` is given.
        unsafe {
            *sums = s0.sum();
            *sums.add(1) = s1.sum();
        }
    }
}

/// The mask of lanes `..len`.
#[inline(always)]
fn first_lanes(len: usize) -> F4 {
    let lane = [0.0f32, 1.0, 2.0, 3.0];
    // SAFETY: `lane` holds 4 floats.
    unsafe { F4::load(lane.as_ptr()) }.lt(F4::splat(len as f32))
}
