//! The portable path's explicit 4-lane vector ([`F4`]: SSE2 on x86-64, NEON on AArch64 with
//! fused multiply-adds, an array elsewhere) and the GEMM micro-tile on it ([`micro`], with
//! [`splat4`] and [`pack_nt`] laying out its operands). [`F4`] implements [`Vector`], on which
//! the portable path's softmax `exp` and row maximum, `tanh` and flash backward rows
//! ([`super::exp`]) and its additive scores ([`super::additive`]) are instantiated, as the AVX2
//! and AVX-512 paths' are.
//!
//! The lane loops of [`super::lanes`] leave vectorising to LLVM's SLP pass, which split the
//! softmax step's `exp` into 2-lane halves on both baseline targets: on x86-64 SSE2 the step
//! ran at 245 ns per 256-score row and stalled on partial stack reloads, and on AArch64 every
//! operation was a 64-bit `.2s` NEON instruction, half the register; its backward rows came
//! out mostly scalar. On [`F4`] the loops are 4-wide by construction. The range reduction of
//! the softmax's bounded `exp` keeps two steps (`ln 2` split) where [`F4::madd`] is not fused
//! ([`Vector::FMA`]): without a fused multiply-add one step is 16 ulp off near the flush.
//!
//! The micro-tile is the lane form's 6 × 8 loop with one change SSE2 needs: its two-operand
//! multiply overwrites an operand, so each product loads its multiplier afresh instead of
//! copying it between registers ([`F4::load_again`]; 4% more multiply-adds per second on Zen 5,
//! `kernel_bench --sse-ceiling`). [`splat4`] lays out the splatted strip.

use super::exp::ROUND;
use super::vector::Vector;

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
pub(super) struct F4(Repr);

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
    /// The larger of `self` and `m`, `m` where `self` is NaN.
    #[inline(always)]
    fn max_skip_nan(self, m: F4) -> F4 {
        // `maxps` returns its second operand when either is NaN.
        F4(base!(_mm_max_ps(self.0, m.0)))
    }
    /// The mask of `self < o` (false for NaN).
    #[inline(always)]
    fn lt(self, o: F4) -> F4 {
        F4(base!(_mm_cmplt_ps(self.0, o.0)))
    }
    /// The mask of `self > o` (false for NaN).
    #[inline(always)]
    fn gt(self, o: F4) -> F4 {
        F4(base!(_mm_cmpgt_ps(self.0, o.0)))
    }
    /// Whether any lane of the mask `self` is set.
    #[inline(always)]
    fn any(self) -> bool {
        base!(_mm_movemask_ps(self.0)) != 0
    }
    /// Whether every lane of the mask `self` is set.
    #[inline(always)]
    fn all(self) -> bool {
        base!(_mm_movemask_ps(self.0)) == 0xf
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
    /// The largest lane.
    #[inline(always)]
    fn max_lanes(self) -> f32 {
        let half = base!(_mm_max_ps(self.0, _mm_movehl_ps(self.0, self.0)));
        base!(_mm_cvtss_f32(_mm_max_ss(half, _mm_shuffle_ps::<1>(half, half))))
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
    /// The larger of `self` and `m`, `m` where `self` is NaN (`fmaxnm` takes the number).
    #[inline(always)]
    fn max_skip_nan(self, m: F4) -> F4 {
        F4(base!(vmaxnmq_f32(self.0, m.0)))
    }
    /// The mask of `self < o` (false for NaN).
    #[inline(always)]
    fn lt(self, o: F4) -> F4 {
        F4(base!(vreinterpretq_f32_u32(vcltq_f32(self.0, o.0))))
    }
    /// The mask of `self > o` (false for NaN).
    #[inline(always)]
    fn gt(self, o: F4) -> F4 {
        F4(base!(vreinterpretq_f32_u32(vcgtq_f32(self.0, o.0))))
    }
    /// Whether any lane of the mask `self` is set.
    #[inline(always)]
    fn any(self) -> bool {
        base!(vmaxvq_u32(vreinterpretq_u32_f32(self.0))) != 0
    }
    /// Whether every lane of the mask `self` is set.
    #[inline(always)]
    fn all(self) -> bool {
        base!(vminvq_u32(vreinterpretq_u32_f32(self.0))) != 0
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
    /// The largest lane.
    #[inline(always)]
    fn max_lanes(self) -> f32 {
        base!(vmaxvq_f32(self.0))
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
    fn max_skip_nan(self, m: F4) -> F4 {
        self.map2(m, |a, m| if a > m { a } else { m })
    }
    #[inline(always)]
    fn lt(self, o: F4) -> F4 {
        self.map2(o, |a, b| f32::from_bits(if a < b { u32::MAX } else { 0 }))
    }
    #[inline(always)]
    fn gt(self, o: F4) -> F4 {
        self.map2(o, |a, b| f32::from_bits(if a > b { u32::MAX } else { 0 }))
    }
    #[inline(always)]
    fn any(self) -> bool {
        self.0.iter().any(|m| m.to_bits() != 0)
    }
    #[inline(always)]
    fn all(self) -> bool {
        self.0.iter().all(|m| m.to_bits() != 0)
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
    #[inline(always)]
    fn max_lanes(self) -> f32 {
        self.0.iter().fold(f32::NEG_INFINITY, |a, b| if *b > a { *b } else { a })
    }
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

/// The [`Vector`] operations on [`F4`]: its own, and the partial loads and stores through a
/// 4-float buffer (neither SSE2 nor NEON has masked ones).
impl Vector for F4 {
    const LANES: usize = W;
    /// Where [`F4::madd`] is fused: always on AArch64, with `-C target-feature=+fma` on x86-64.
    const FMA: bool = cfg!(any(target_arch = "aarch64", all(target_arch = "x86_64", target_feature = "fma")));
    /// Four vectors per step, so that independent `exp` chains overlap (two measured 4% slower
    /// on Zen 5, and the softmax passes 6–9% slower on Zen 4).
    const UNROLL: usize = 4;
    const CHEAP_ALL: bool = false;
    const RECIP_EST: bool = false;
    type Mask = F4;

    #[inline(always)]
    unsafe fn splat(v: f32) -> F4 {
        F4::splat(v)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> F4 {
        // SAFETY: forwarded.
        unsafe { F4::load(p) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: forwarded.
        unsafe { F4::store(self, p) }
    }
    #[inline(always)]
    unsafe fn load_part(p: *const f32, n: usize) -> F4 {
        let mut a = [0.0f32; W];
        // SAFETY: the caller's `n ≤ 4` floats; `a` holds 4.
        unsafe {
            std::ptr::copy_nonoverlapping(p, a.as_mut_ptr(), n);
            F4::load(a.as_ptr())
        }
    }
    #[inline(always)]
    unsafe fn store_part(self, p: *mut f32, n: usize) {
        let mut a = [0.0f32; W];
        // SAFETY: `a` holds 4 floats; the caller's `n ≤ 4` at `p`.
        unsafe {
            F4::store(self, a.as_mut_ptr());
            std::ptr::copy_nonoverlapping(a.as_ptr(), p, n);
        }
    }
    #[inline(always)]
    unsafe fn first(n: usize) -> F4 {
        let lane = [0.0f32, 1.0, 2.0, 3.0];
        // SAFETY: `lane` holds 4 floats.
        unsafe { F4::load(lane.as_ptr()) }.lt(F4::splat(n as f32))
    }
    #[inline(always)]
    unsafe fn add(self, o: F4) -> F4 {
        F4::add(self, o)
    }
    #[inline(always)]
    unsafe fn sub(self, o: F4) -> F4 {
        F4::sub(self, o)
    }
    #[inline(always)]
    unsafe fn mul(self, o: F4) -> F4 {
        F4::mul(self, o)
    }
    #[inline(always)]
    unsafe fn div(self, o: F4) -> F4 {
        F4::div(self, o)
    }
    #[inline(always)]
    unsafe fn madd(self, b: F4, c: F4) -> F4 {
        F4::madd(self, b, c)
    }
    #[inline(always)]
    unsafe fn nmadd(self, b: F4, c: F4) -> F4 {
        F4::nmadd(self, b, c)
    }
    #[inline(always)]
    unsafe fn at_least(self, lo: F4) -> F4 {
        F4::at_least(self, lo)
    }
    #[inline(always)]
    unsafe fn at_most(self, hi: F4) -> F4 {
        F4::at_most(self, hi)
    }
    #[inline(always)]
    unsafe fn max_skip_nan(self, m: F4) -> F4 {
        F4::max_skip_nan(self, m)
    }
    #[inline(always)]
    unsafe fn abs(self) -> F4 {
        F4::abs(self)
    }
    #[inline(always)]
    unsafe fn or_sign(self, of: F4) -> F4 {
        self.or(of.sign())
    }
    #[inline(always)]
    unsafe fn lt(self, o: F4) -> F4 {
        F4::lt(self, o)
    }
    #[inline(always)]
    unsafe fn gt(self, o: F4) -> F4 {
        F4::gt(self, o)
    }
    #[inline(always)]
    unsafe fn eq(self, o: F4) -> F4 {
        F4::eq(self, o)
    }
    #[inline(always)]
    unsafe fn any(m: F4) -> bool {
        m.any()
    }
    #[inline(always)]
    unsafe fn all(m: F4) -> bool {
        m.all()
    }
    #[inline(always)]
    unsafe fn select(m: F4, a: F4, b: F4) -> F4 {
        F4::select(m, a, b)
    }
    #[inline(always)]
    unsafe fn zero_where(self, m: F4) -> F4 {
        F4::zero_where(self, m)
    }
    #[inline(always)]
    unsafe fn zero_where_lt(self, x: F4, lo: F4) -> F4 {
        self.zero_where(x.lt(lo))
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        F4::sum(self)
    }
    #[inline(always)]
    unsafe fn max_lanes(self) -> f32 {
        F4::max_lanes(self)
    }
    #[inline(always)]
    unsafe fn pow2_of_round(t: F4, bias: i32) -> F4 {
        F4::pow2_of_round(t, bias)
    }
    /// A division: the estimates (12 bits on SSE2, 8 on NEON) need more steps than it costs.
    #[inline(always)]
    unsafe fn recip(self) -> F4 {
        F4::splat(1.0).div(self)
    }
    /// A division: `rcpps` and a Newton step without FMA take five operations, which ran
    /// the additive scores 11% (narrow) and 40% (wide form) slower than dividing on Zen 4.
    #[inline(always)]
    unsafe fn div_est_add(self, d: F4, c: F4) -> F4 {
        c.add(self.div(d))
    }
}
