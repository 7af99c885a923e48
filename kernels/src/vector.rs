//! One register of `f32` lanes as a trait ([`Vector`]), so that a kernel whose instruction-set
//! paths differ only in width is written once over it and instantiated per path, as `pulp` and
//! `std::simd` do: `__m512` (AVX-512F) and `__m256` (AVX2 with FMA) here, and
//! [`super::f4::F4`] (SSE2 on x86-64, NEON on AArch64, an array elsewhere) in `f4.rs`, beside
//! its other operations.
//!
//! Every method is `#[inline(always)]`, and so are the generic kernels; each kernel is
//! instantiated inside a thin `#[target_feature]` wrapper of its instruction set. The
//! intrinsics carry their target feature, so LLVM can inline them only into a function that
//! has it: they inline into the wrapper once the generic code has been inlined there. (An
//! intrinsic left as a call would pass every vector through memory; `kernel_bench`'s binary is
//! checked for such calls.) For the same reason the kernels keep vector operations out of
//! closures, which are functions of their own, compiled without the wrapper's features.
//!
//! Where a path needs a different algorithm, not only a different width, the difference is a
//! method ([`Vector::round_log2e`], [`Vector::scale_exp`] and [`Vector::madd_pow2`], which
//! AVX-512 does with `vrndscaleps` and `vscalefps`; [`Vector::recip`] and
//! [`Vector::div_est_add`], an estimate or a division) or an associated constant
//! ([`Vector::FMA`], [`Vector::UNROLL`], [`Vector::CHEAP_ALL`], [`Vector::RECIP_EST`]), not a
//! second copy of the kernel.
//!
//! The methods are `unsafe`: they run their path's instructions, which the CPU must support.
//! The kernels call them only inside a wrapper of that path, and the dispatch by `Isa` calls a
//! wrapper only where its path is supported. The memory methods also need valid pointers.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::exp::{LOG2E, ROUND};

/// Defines `$name(isa, args…)`, a kernel written once over [`Vector`] and run on `isa`: the
/// expression `$call`, with the type `$V` standing for the path's vector (`__m512`, `__m256` or
/// [`super::f4::F4`]), inside a thin `#[target_feature]` wrapper per x86 path (see the module
/// docs) and directly on the portable path. The wrappers take the function's const generics and
/// arguments; the docs given are the dispatcher's, whose `# Safety` must ask that `isa` be
/// supported.
macro_rules! isa_dispatch {
    (
        $(#[$doc:meta])*
        $vis:vis unsafe fn $name:ident<$V:ident $(, const $c:ident: $ct:ty)*>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?
            => $call:expr
    ) => {
        $(#[$doc])*
        $vis unsafe fn $name<$(const $c: $ct),*>(isa: $crate::Isa, $($arg: $ty),*) $(-> $ret)? {
            /// The AVX-512F instance.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            unsafe fn avx512<$(const $c: $ct),*>($($arg: $ty),*) $(-> $ret)? {
                type $V = std::arch::x86_64::__m512;
                // SAFETY: forwarded; AVX-512F is enabled here.
                unsafe { $call }
            }
            /// The AVX2 instance.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2<$(const $c: $ct),*>($($arg: $ty),*) $(-> $ret)? {
                type $V = std::arch::x86_64::__m256;
                // SAFETY: forwarded; AVX2 and FMA are enabled here.
                unsafe { $call }
            }
            // SAFETY: forwarded; each arm runs only where its path is supported.
            unsafe {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    $crate::Isa::Avx512 => avx512::<$($c),*>($($arg),*),
                    #[cfg(target_arch = "x86_64")]
                    $crate::Isa::Avx2 => avx2::<$($c),*>($($arg),*),
                    _ => {
                        type $V = $crate::f4::F4;
                        $call
                    }
                }
            }
        }
    };
}
pub(super) use isa_dispatch;

/// One register of [`Vector::LANES`] `f32` lanes and the operations the kernels written over
/// it need (see the module docs). A [`Vector::Mask`] holds one condition per lane.
///
/// NaN: comparisons are ordered (false where either operand is NaN); [`Vector::at_least`] and
/// [`Vector::at_most`] keep a NaN of `self`, so clamps pass NaN on.
pub(super) trait Vector: Copy {
    /// Lanes per register.
    const LANES: usize;
    /// Whether [`Vector::madd`] and [`Vector::nmadd`] are fused (rounded once): kernels choose
    /// forms by it where an unfused multiply-add loses accuracy or costs an operation.
    const FMA: bool;
    /// Vectors per step of a streaming kernel (`exp::exp_sum_on`): independent chains enough to
    /// hide the latency of one `exp`.
    const UNROLL: usize;
    /// Whether [`Vector::all`] is cheap enough for a kernel to branch on it per vector to skip
    /// work: a `kortest` of a mask register on AVX-512. Elsewhere it is a move to a general
    /// register and a compare, which made AVX2's `tanh` 4% slower on rows where no vector
    /// could skip.
    const CHEAP_ALL: bool;
    /// Whether [`Vector::recip`] is an estimate refined by a Newton step (AVX-512) rather than
    /// a division. The step makes NaN of an infinite operand, so callers keep it finite.
    const RECIP_EST: bool;
    /// One condition per lane: a bit mask on AVX-512, all-ones or all-zeros lanes elsewhere.
    type Mask: Copy;

    /// Every lane `v`.
    unsafe fn splat(v: f32) -> Self;
    /// The [`Vector::LANES`] floats at `p` (any alignment).
    unsafe fn load(p: *const f32) -> Self;
    /// Stores the lanes at `p` (any alignment).
    unsafe fn store(self, p: *mut f32);
    /// The `n` floats at `p` in the first lanes, 0 in the rest (`1 ≤ n ≤ LANES`); nothing past
    /// them is read.
    unsafe fn load_part(p: *const f32, n: usize) -> Self;
    /// Stores the first `n` lanes at `p` (`1 ≤ n ≤ LANES`); nothing past them is written.
    unsafe fn store_part(self, p: *mut f32, n: usize);
    /// The mask of the first `n` lanes (`n ≤ LANES`).
    unsafe fn first(n: usize) -> Self::Mask;

    /// `self + o`.
    unsafe fn add(self, o: Self) -> Self;
    /// `self − o`.
    unsafe fn sub(self, o: Self) -> Self;
    /// `self · o`.
    unsafe fn mul(self, o: Self) -> Self;
    /// `self / o`, correctly rounded.
    unsafe fn div(self, o: Self) -> Self;
    /// `self·b + c`, fused where [`Vector::FMA`].
    unsafe fn madd(self, b: Self, c: Self) -> Self;
    /// `c − self·b`, fused where [`Vector::FMA`].
    unsafe fn nmadd(self, b: Self, c: Self) -> Self;
    /// `lo` where `self < lo`; NaN stays NaN.
    unsafe fn at_least(self, lo: Self) -> Self;
    /// `hi` where `self > hi`; NaN stays NaN.
    unsafe fn at_most(self, hi: Self) -> Self;
    /// The larger of `self` and `m` in each lane, `m` where `self` is NaN (a running maximum
    /// that passes NaN over; `m` is never NaN).
    unsafe fn max_skip_nan(self, m: Self) -> Self;
    /// `|self|` (the sign bit cleared).
    unsafe fn abs(self) -> Self;
    /// `self` (non-negative) with the sign bit of `of`: `|r|` given the sign of `x`, so that an
    /// odd function keeps `f(−0) = −0`.
    unsafe fn or_sign(self, of: Self) -> Self;

    /// `self < o` (false for NaN).
    unsafe fn lt(self, o: Self) -> Self::Mask;
    /// `self > o` (false for NaN).
    unsafe fn gt(self, o: Self) -> Self::Mask;
    /// `self == o` (false for NaN).
    unsafe fn eq(self, o: Self) -> Self::Mask;
    /// Whether any lane of `m` holds.
    unsafe fn any(m: Self::Mask) -> bool;
    /// Whether every lane of `m` holds.
    unsafe fn all(m: Self::Mask) -> bool;
    /// `a` where `m`, else `b`.
    unsafe fn select(m: Self::Mask, a: Self, b: Self) -> Self;
    /// 0 where `m`, else `self`.
    unsafe fn zero_where(self, m: Self::Mask) -> Self;
    /// 0 where `x < lo`, else `self` (a NaN `x` keeps `self`): the `exp` flushes. One method,
    /// so that AVX-512 tests `x ≥ lo or unordered` and keeps `self` under that mask, where a
    /// mask of `x < lo` would need inverting.
    unsafe fn zero_where_lt(self, x: Self, lo: Self) -> Self;
    /// The sum of the lanes.
    unsafe fn sum(self) -> f32;
    /// The largest lane (none is NaN).
    unsafe fn max_lanes(self) -> f32;

    /// `(n, t)` for the unbounded `exp`: `n = round(x·log2 e)` and `t`, from which
    /// [`Vector::scale_exp`] builds `2ⁿ`. By default `t = x·log2 e + ROUND`, whose low mantissa
    /// bits are `n`, and `n = t − ROUND`.
    #[inline(always)]
    unsafe fn round_log2e(x: Self) -> (Self, Self) {
        // SAFETY: the caller's contract.
        unsafe {
            let t = x.madd(Self::splat(LOG2E), Self::splat(ROUND));
            (t.sub(Self::splat(ROUND)), t)
        }
    }
    /// `2ⁿ⁺ᵇⁱᵃˢ⁻¹²⁷` from `t = n + ROUND` (whose low mantissa bits are the integer `n`), by
    /// integer operations on the bits: `n + bias` must be a normal exponent (`1..=254`).
    unsafe fn pow2_of_round(t: Self, bias: i32) -> Self;
    /// `self·2ⁿ` for the unbounded `exp`: `n` integral in `[-61, 129]`, `t` from
    /// [`Vector::round_log2e`], `self` in `[0.7, 1.5]`; the result is exact (or `inf` past
    /// `f32::MAX`). By default
    /// `self·2ⁿ⁻²·4`: `2ⁿ⁻²` is normal over that range, and both products are exact (or
    /// overflow, as `self·2ⁿ` does), in 4 operations where two normal halves of `2ⁿ` took 8.
    #[inline(always)]
    unsafe fn scale_exp(self, _n: Self, t: Self) -> Self {
        // SAFETY: the caller's contract.
        unsafe { self.mul(Self::pow2_of_round(t, 125)).mul(Self::splat(4.0)) }
    }
    /// `self·2ᵉ + c` for an integral `e` with `|e| ≤ 126`, `2ᵉ` from the bits of `e + ROUND`
    /// (integer lanes: SSE2 has no saturating float-to-int conversion).
    #[inline(always)]
    unsafe fn madd_pow2(self, e: Self, c: Self) -> Self {
        // SAFETY: the caller's contract.
        unsafe { self.madd(Self::pow2_of_round(e.add(Self::splat(ROUND)), 127), c) }
    }
    /// `1/self` within about an ulp, as `tanh` needs: a reciprocal estimate refined by one
    /// Newton step where the estimate has 14 bits (AVX-512), else a division (a 12-bit
    /// estimate keeps about 2⁻²³ of relative error after one step, NEON's 8-bit one more).
    unsafe fn recip(self) -> Self;
    /// `self/d + c`, the quotient within about 2⁻²² relative (the additive scores' terms need
    /// no more): the reciprocal estimate refined by one Newton step and a multiply-add where
    /// the estimate is precise enough for one step and the multiply-add fused, else a
    /// division and an add (faster on SSE2 than the estimate's five unfused steps).
    unsafe fn div_est_add(self, d: Self, c: Self) -> Self;
}

/// AVX-512F: 16 lanes, bit-mask conditions, `vscalefps` for the scalings.
#[cfg(target_arch = "x86_64")]
impl Vector for __m512 {
    const LANES: usize = 16;
    const FMA: bool = true;
    // Four vectors per step: `exp_sum` 4% and `softmax_row` (`row_max`) 5% faster than one
    // (`kernel_bench --rows` on Zen 4).
    const UNROLL: usize = 4;
    const CHEAP_ALL: bool = true;
    const RECIP_EST: bool = true;
    type Mask = __mmask16;

    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller's 16 floats.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller's 16 floats.
        unsafe { _mm512_storeu_ps(p, self) }
    }
    #[inline(always)]
    unsafe fn load_part(p: *const f32, n: usize) -> Self {
        // SAFETY: the caller's `n` floats; masked-off lanes are not read.
        unsafe { _mm512_maskz_loadu_ps(super::x86_avx512::lanes(n), p) }
    }
    #[inline(always)]
    unsafe fn store_part(self, p: *mut f32, n: usize) {
        // SAFETY: the caller's `n` floats; masked-off lanes are not written.
        unsafe { _mm512_mask_storeu_ps(p, super::x86_avx512::lanes(n), self) }
    }
    #[inline(always)]
    unsafe fn first(n: usize) -> __mmask16 {
        super::x86_avx512::lanes(n)
    }
    #[inline(always)]
    unsafe fn add(self, o: Self) -> Self {
        unsafe { _mm512_add_ps(self, o) }
    }
    #[inline(always)]
    unsafe fn sub(self, o: Self) -> Self {
        unsafe { _mm512_sub_ps(self, o) }
    }
    #[inline(always)]
    unsafe fn mul(self, o: Self) -> Self {
        unsafe { _mm512_mul_ps(self, o) }
    }
    #[inline(always)]
    unsafe fn div(self, o: Self) -> Self {
        unsafe { _mm512_div_ps(self, o) }
    }
    #[inline(always)]
    unsafe fn madd(self, b: Self, c: Self) -> Self {
        unsafe { _mm512_fmadd_ps(self, b, c) }
    }
    #[inline(always)]
    unsafe fn nmadd(self, b: Self, c: Self) -> Self {
        unsafe { _mm512_fnmadd_ps(self, b, c) }
    }
    #[inline(always)]
    unsafe fn at_least(self, lo: Self) -> Self {
        // `maxps` returns its second operand when either is NaN.
        unsafe { _mm512_max_ps(lo, self) }
    }
    #[inline(always)]
    unsafe fn at_most(self, hi: Self) -> Self {
        // `minps` returns its second operand when either is NaN.
        unsafe { _mm512_min_ps(hi, self) }
    }
    #[inline(always)]
    unsafe fn max_skip_nan(self, m: Self) -> Self {
        // `maxps` returns its second operand when either is NaN.
        unsafe { _mm512_max_ps(self, m) }
    }
    #[inline(always)]
    unsafe fn abs(self) -> Self {
        unsafe { _mm512_abs_ps(self) }
    }
    #[inline(always)]
    unsafe fn or_sign(self, of: Self) -> Self {
        unsafe {
            let sign = _mm512_and_si512(_mm512_castps_si512(of), _mm512_set1_epi32(i32::MIN));
            _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(self), sign))
        }
    }
    #[inline(always)]
    unsafe fn lt(self, o: Self) -> __mmask16 {
        unsafe { _mm512_cmp_ps_mask::<_CMP_LT_OQ>(self, o) }
    }
    #[inline(always)]
    unsafe fn gt(self, o: Self) -> __mmask16 {
        unsafe { _mm512_cmp_ps_mask::<_CMP_GT_OQ>(self, o) }
    }
    #[inline(always)]
    unsafe fn eq(self, o: Self) -> __mmask16 {
        unsafe { _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(self, o) }
    }
    #[inline(always)]
    unsafe fn any(m: __mmask16) -> bool {
        m != 0
    }
    #[inline(always)]
    unsafe fn all(m: __mmask16) -> bool {
        m == 0xffff
    }
    #[inline(always)]
    unsafe fn select(m: __mmask16, a: Self, b: Self) -> Self {
        // `blend` takes its second operand where the mask is set.
        unsafe { _mm512_mask_blend_ps(m, b, a) }
    }
    #[inline(always)]
    unsafe fn zero_where(self, m: __mmask16) -> Self {
        unsafe { _mm512_mask_mov_ps(self, m, _mm512_setzero_ps()) }
    }
    #[inline(always)]
    unsafe fn zero_where_lt(self, x: Self, lo: Self) -> Self {
        // Folds into the instruction that makes `self` (a zero-masked FMA in the bounded `exp`).
        unsafe { _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, lo), self) }
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        unsafe { _mm512_reduce_add_ps(self) }
    }
    #[inline(always)]
    unsafe fn max_lanes(self) -> f32 {
        unsafe { _mm512_reduce_max_ps(self) }
    }
    /// `vrndscaleps` of `x·log2 e`, and `t = n`: [`Vector::scale_exp`] scales by `n` itself.
    #[inline(always)]
    unsafe fn round_log2e(x: Self) -> (Self, Self) {
        unsafe {
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)));
            (n, n)
        }
    }
    #[inline(always)]
    unsafe fn pow2_of_round(t: Self, bias: i32) -> Self {
        unsafe {
            let b = _mm512_set1_epi32(bias - ROUND.to_bits() as i32);
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_castps_si512(t), b)))
        }
    }
    /// `vscalefps`: one instruction, exact (into subnormals too).
    #[inline(always)]
    unsafe fn scale_exp(self, n: Self, _t: Self) -> Self {
        unsafe { _mm512_scalef_ps(self, n) }
    }
    /// `vscalefps` and an add: two instructions where the integer form takes four.
    #[inline(always)]
    unsafe fn madd_pow2(self, e: Self, c: Self) -> Self {
        unsafe { _mm512_add_ps(_mm512_scalef_ps(self, e), c) }
    }
    /// The 14-bit estimate and one Newton step (≈ 1 ulp; a division costs ten times as much).
    #[inline(always)]
    unsafe fn recip(self) -> Self {
        unsafe {
            let r = _mm512_rcp14_ps(self);
            _mm512_fmadd_ps(r, _mm512_fnmadd_ps(self, r, _mm512_set1_ps(1.0)), r)
        }
    }
    #[inline(always)]
    unsafe fn div_est_add(self, d: Self, c: Self) -> Self {
        // SAFETY: forwarded.
        unsafe { self.madd(d.recip(), c) }
    }
}

/// AVX2 with FMA: 8 lanes, conditions as all-ones lanes.
#[cfg(target_arch = "x86_64")]
impl Vector for __m256 {
    const LANES: usize = 8;
    const FMA: bool = true;
    // Four vectors per step: `exp_sum` 10% faster than one, `softmax_row` (`row_max`) as fast
    // as with the two chains it had and 8% faster than with one (`kernel_bench --rows` on
    // Zen 4). Four chains spill on 16 registers; what spills is sensitive to the code around.
    const UNROLL: usize = 4;
    const CHEAP_ALL: bool = false;
    const RECIP_EST: bool = false;
    type Mask = __m256;

    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        unsafe { _mm256_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller's 8 floats.
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller's 8 floats.
        unsafe { _mm256_storeu_ps(p, self) }
    }
    #[inline(always)]
    unsafe fn load_part(p: *const f32, n: usize) -> Self {
        // SAFETY: the caller's `n` floats; masked-off lanes are not read.
        unsafe { _mm256_maskload_ps(p, super::x86_avx2::lanes(n)) }
    }
    /// A masked store: microcoded on AMD cores, so the kernels use it for a row's last vector
    /// only.
    #[inline(always)]
    unsafe fn store_part(self, p: *mut f32, n: usize) {
        // SAFETY: the caller's `n` floats; masked-off lanes are not written.
        unsafe { _mm256_maskstore_ps(p, super::x86_avx2::lanes(n), self) }
    }
    #[inline(always)]
    unsafe fn first(n: usize) -> __m256 {
        unsafe { _mm256_castsi256_ps(super::x86_avx2::lanes(n)) }
    }
    #[inline(always)]
    unsafe fn add(self, o: Self) -> Self {
        unsafe { _mm256_add_ps(self, o) }
    }
    #[inline(always)]
    unsafe fn sub(self, o: Self) -> Self {
        unsafe { _mm256_sub_ps(self, o) }
    }
    #[inline(always)]
    unsafe fn mul(self, o: Self) -> Self {
        unsafe { _mm256_mul_ps(self, o) }
    }
    #[inline(always)]
    unsafe fn div(self, o: Self) -> Self {
        unsafe { _mm256_div_ps(self, o) }
    }
    #[inline(always)]
    unsafe fn madd(self, b: Self, c: Self) -> Self {
        unsafe { _mm256_fmadd_ps(self, b, c) }
    }
    #[inline(always)]
    unsafe fn nmadd(self, b: Self, c: Self) -> Self {
        unsafe { _mm256_fnmadd_ps(self, b, c) }
    }
    #[inline(always)]
    unsafe fn at_least(self, lo: Self) -> Self {
        // `maxps` returns its second operand when either is NaN.
        unsafe { _mm256_max_ps(lo, self) }
    }
    #[inline(always)]
    unsafe fn at_most(self, hi: Self) -> Self {
        // `minps` returns its second operand when either is NaN.
        unsafe { _mm256_min_ps(hi, self) }
    }
    #[inline(always)]
    unsafe fn max_skip_nan(self, m: Self) -> Self {
        // `maxps` returns its second operand when either is NaN.
        unsafe { _mm256_max_ps(self, m) }
    }
    #[inline(always)]
    unsafe fn abs(self) -> Self {
        unsafe { _mm256_andnot_ps(_mm256_set1_ps(-0.0), self) }
    }
    #[inline(always)]
    unsafe fn or_sign(self, of: Self) -> Self {
        unsafe { _mm256_or_ps(self, _mm256_and_ps(of, _mm256_set1_ps(-0.0))) }
    }
    #[inline(always)]
    unsafe fn lt(self, o: Self) -> __m256 {
        unsafe { _mm256_cmp_ps::<_CMP_LT_OQ>(self, o) }
    }
    #[inline(always)]
    unsafe fn gt(self, o: Self) -> __m256 {
        unsafe { _mm256_cmp_ps::<_CMP_GT_OQ>(self, o) }
    }
    #[inline(always)]
    unsafe fn eq(self, o: Self) -> __m256 {
        unsafe { _mm256_cmp_ps::<_CMP_EQ_OQ>(self, o) }
    }
    #[inline(always)]
    unsafe fn any(m: __m256) -> bool {
        unsafe { _mm256_movemask_ps(m) != 0 }
    }
    #[inline(always)]
    unsafe fn all(m: __m256) -> bool {
        unsafe { _mm256_movemask_ps(m) == 0xff }
    }
    #[inline(always)]
    unsafe fn select(m: __m256, a: Self, b: Self) -> Self {
        // `blendv` takes its second operand where the mask's sign bit is set.
        unsafe { _mm256_blendv_ps(b, a, m) }
    }
    #[inline(always)]
    unsafe fn zero_where(self, m: __m256) -> Self {
        unsafe { _mm256_andnot_ps(m, self) }
    }
    #[inline(always)]
    unsafe fn zero_where_lt(self, x: Self, lo: Self) -> Self {
        unsafe { _mm256_and_ps(self, _mm256_cmp_ps::<_CMP_NLT_UQ>(x, lo)) }
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        unsafe {
            let half = _mm_add_ps(_mm256_castps256_ps128(self), _mm256_extractf128_ps::<1>(self));
            let quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
            _mm_cvtss_f32(_mm_add_ss(quad, _mm_shuffle_ps::<1>(quad, quad)))
        }
    }
    #[inline(always)]
    unsafe fn max_lanes(self) -> f32 {
        unsafe {
            let half = _mm_max_ps(_mm256_castps256_ps128(self), _mm256_extractf128_ps::<1>(self));
            let quad = _mm_max_ps(half, _mm_movehl_ps(half, half));
            _mm_cvtss_f32(_mm_max_ss(quad, _mm_shuffle_ps::<1>(quad, quad)))
        }
    }
    #[inline(always)]
    unsafe fn pow2_of_round(t: Self, bias: i32) -> Self {
        unsafe {
            let b = _mm256_set1_epi32(bias - ROUND.to_bits() as i32);
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_castps_si256(t), b)))
        }
    }
    /// A division (see [`Vector::recip`]).
    #[inline(always)]
    unsafe fn recip(self) -> Self {
        unsafe { _mm256_div_ps(_mm256_set1_ps(1.0), self) }
    }
    /// The 12-bit estimate and one Newton step.
    #[inline(always)]
    unsafe fn div_est_add(self, d: Self, c: Self) -> Self {
        unsafe {
            let r = _mm256_rcp_ps(d);
            _mm256_fmadd_ps(self, _mm256_fmadd_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(1.0)), r), c)
        }
    }
}
