//! Additive (Bahdanau) attention scores for one flash tile:
//! `C[r, c] = alpha · Σ_a w[a] · tanh(A[r, a] + B[c, a])`.
//!
//! `tanh(x + y) = 1 − 2 / (1 + e^{2x} · e^{2y})`, so with the exponentials of every query and
//! key element computed once per call (`m·k + n·k` of them for `m·n·k` terms), a score is
//! `alpha · (Σ_a w[a] − Σ_a 2·w[a] / (1 + E_q[a]·E_k[a]))`: an FMA, a reciprocal (an estimate
//! refined by one Newton step on x86) and an FMA per term, where a `tanh` costs about 25 vector
//! operations. The absolute error per term is a few f32 ulp of 1, which is what a sum of
//! weighted terms sees.
//!
//! Three forms, chosen per tile and per query row:
//! - **narrow** (every input within [`BOUND`]): `E = e^{2x}` as one f32 each;
//! - **wide** (every input finite): `e^{2x} = m·2ⁿ` kept as the pair
//!   `(m ∈ [0.7, 1.5], n)`, and the product formed as `m_q·m_k·2^{clamp(n_q + n_k)}`, so no
//!   factor overflows or underflows whatever the magnitudes (the clamp only touches sums whose
//!   `tanh` is ±1 in f32);
//! - **direct** (an infinity or NaN, or a weight that is not finite): `tanh(A + B)` per term,
//!   as the scalar semantics.
//!
//! Keys run along the vector lanes: the call packs `B`'s tile transposed (`k × n`, padded to 16
//! keys) into a per-thread buffer.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::cell::Cell;

use super::Isa;
use super::exp::{LN2_HI, LN2_LO, LOG2E};

/// Inputs up to this magnitude take the narrow form: `e^{±40}` and products of two such
/// factors (`e^{±80}`) are normal f32 values, away from the exponential's flush threshold.
pub(super) const BOUND: f32 = 20.0;

/// The wide form clamps `n_q + n_k` into `±EXP2_LIMIT`: beyond it `|x + y| > 34`, where
/// `tanh` is ±1 in f32, and `2^{±100}` keeps every intermediate normal and finite.
const EXP2_LIMIT: f32 = 100.0;

/// Keys per packed row are padded to a multiple of this (the widest vector).
const PAD: usize = 16;

/// Adding then subtracting this rounds an `f32` of magnitude below 2²² to the nearest integer.
const ROUND: f32 = 12_582_912.0;

thread_local! {
    /// Per-thread buffer of the packed key tile and per-row values, reused across calls.
    static SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Which form a tile or row takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Form {
    Narrow,
    Wide,
    Direct,
}

/// `e^{2x} = m·2ⁿ` of each element: `r = 2x − n·ln 2` (Cody–Waite) into `m`, `n` into `n`, then
/// `m = e^r` on `isa`. Only finite inputs give meaningful values (the loops have no branches,
/// so they vectorise).
///
/// # Safety
/// `x` addresses `len` elements; `m` and `n` hold `len`; `isa` is supported.
unsafe fn split_exp(isa: Isa, x: *const f32, len: usize, m: &mut [f32], n: &mut [f32]) {
    // SAFETY: the caller's contract.
    let x = unsafe { std::slice::from_raw_parts(x, len) };
    for ((x, m), n) in x.iter().zip(m.iter_mut()).zip(n.iter_mut()) {
        let u = 2.0 * x;
        let k = (u * LOG2E + ROUND) - ROUND;
        *n = k;
        *m = (u - k * LN2_HI) - k * LN2_LO;
    }
    // SAFETY: `m` holds `len` elements; `isa` is supported (the caller's contract).
    unsafe { super::exp::exp_sum(isa, m.as_ptr(), 1.0, std::ptr::null(), m.as_mut_ptr(), len, 0.0) };
}

/// `m·2ⁿ` for an integral `|n| ≤ 126` (the narrow form's `n` are within ±58), from the bits of
/// `n + 1.5·2²³`.
fn scaled(m: f32, n: f32) -> f32 {
    m * f32::from_bits((n + ROUND).to_bits().wrapping_sub(ROUND.to_bits().wrapping_sub(127)) << 23)
}

/// The form the values `x` allow, from the largest magnitude as integer bits (ordered like the
/// magnitudes; infinities and NaN above every finite value), in lanes so that it vectorises.
fn form_of(x: &[f32]) -> Form {
    const L: usize = 16;
    let mut big = [0u32; L];
    let mut chunks = x.chunks_exact(L);
    for c in &mut chunks {
        for (b, v) in big.iter_mut().zip(c) {
            *b = (*b).max(v.to_bits() & 0x7fff_ffff);
        }
    }
    let top = chunks.remainder().iter().map(|v| v.to_bits() & 0x7fff_ffff).chain(big).max().unwrap_or(0);
    if top >= f32::INFINITY.to_bits() {
        Form::Direct
    } else if top > BOUND.to_bits() {
        Form::Wide
    } else {
        Form::Narrow
    }
}

/// `C[r·ldc + c] = alpha · Σ_a w[a]·tanh(A[r·lda + a] + B[c·ldb + a])` for `r < m`, `c < n`,
/// `a < k`, on `isa`.
///
/// # Safety
/// For non-empty shapes `a`, `b` and `c` address `(m-1)·lda + k`, `(n-1)·ldb + k` and
/// `(m-1)·ldc + n` valid elements and `w` addresses `k`; `C` overlaps none of them; `isa` is
/// supported.
#[allow(clippy::too_many_arguments)] // Mirrors the C ABI entry point.
pub(super) unsafe fn additive_nt(
    isa: Isa,
    (m, n, k): (usize, usize, usize),
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    alpha: f32,
    w: *const f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    let npad = n.div_ceil(PAD) * PAD;
    let tile_len = k * npad;
    // raw keys | their e^{2x} | its m | its n (each k × npad) | a row's e^{2x}, m, n | −2·w
    // (each k) | a row (npad)
    let len = 4 * tile_len + 4 * k + npad;
    let mut buf = SCRATCH.try_with(Cell::take).unwrap_or_default();
    if buf.len() < len {
        buf = vec![0.0; len];
    }
    let (raw, rest) = buf.split_at_mut(tile_len);
    let (ek, rest) = rest.split_at_mut(tile_len);
    let (mk, rest) = rest.split_at_mut(tile_len);
    let (nk, rest) = rest.split_at_mut(tile_len);
    let (eq, rest) = rest.split_at_mut(k);
    let (mq, rest) = rest.split_at_mut(k);
    let (nq, rest) = rest.split_at_mut(k);
    let (wn2, rest) = rest.split_at_mut(k);
    let row = &mut rest[..npad];
    let mut wsum = 0.0f32;
    // SAFETY: the caller's contract covers every read of `a`, `b`, `w` and write of `c`; the
    // buffer slices have the lengths the loops use.
    unsafe {
        // B's tile transposed (blocked), the padding keys 0.
        super::rows::transpose(b, ldb, n, k, raw.as_mut_ptr(), npad);
        for x in 0..k {
            raw[x * npad + n..(x + 1) * npad].fill(0.0);
        }
        let tile = form_of(raw);
        let weights = std::slice::from_raw_parts(w, k);
        let tile = if weights.iter().all(|x| x.is_finite()) { tile } else { Form::Direct };
        for (wx, n2) in weights.iter().zip(wn2.iter_mut()) {
            wsum += wx;
            *n2 = -2.0 * wx;
        }
        if tile != Form::Direct {
            split_exp(isa, raw.as_ptr(), tile_len, mk, nk);
        }
        if tile == Form::Narrow {
            for ((e, m), n) in ek.iter_mut().zip(mk.iter()).zip(nk.iter()) {
                *e = scaled(*m, *n);
            }
        }
        for r in 0..m {
            let q = a.add(r * lda);
            let out = c.add(r * ldc);
            let form = form_of(std::slice::from_raw_parts(q, k)).max(tile);
            let dims = (k, npad, n);
            match form {
                Form::Narrow => {
                    split_exp(isa, q, k, mq, nq);
                    for ((e, m), n) in eq.iter_mut().zip(mq.iter()).zip(nq.iter()) {
                        *e = scaled(*m, *n);
                    }
                    let terms =
                        Terms { row: (eq.as_ptr(), eq.as_ptr()), keys: (ek.as_ptr(), ek.as_ptr()), wn2: wn2.as_ptr(), dims, alpha, wsum };
                    product_row::<false>(isa, &terms, out);
                }
                Form::Wide => {
                    split_exp(isa, q, k, mq, nq);
                    let terms =
                        Terms { row: (mq.as_ptr(), nq.as_ptr()), keys: (mk.as_ptr(), nk.as_ptr()), wn2: wn2.as_ptr(), dims, alpha, wsum };
                    product_row::<true>(isa, &terms, out);
                }
                Form::Direct => direct_row(isa, q, raw, w, dims, row, out, alpha),
            }
        }
    }
    // Fails only while the thread is being torn down; the buffer is then simply dropped.
    let _ = SCRATCH.try_with(|s| s.set(buf));
}

/// One row by the direct form: `tanh(q[a] + key)` over the packed raw keys.
///
/// # Safety
/// `q` and `w` address `k` elements, `out` `n`; `raw` holds `k × npad` and `row` `npad`.
#[allow(clippy::too_many_arguments)]
unsafe fn direct_row(
    isa: Isa,
    q: *const f32,
    raw: &[f32],
    w: *const f32,
    (k, npad, n): (usize, usize, usize),
    row: &mut [f32],
    out: *mut f32,
    alpha: f32,
) {
    let mut acc = vec![0.0f32; npad];
    // SAFETY: as the caller's contract.
    unsafe {
        for x in 0..k {
            let qx = *q.add(x);
            for (t, key) in row.iter_mut().zip(&raw[x * npad..(x + 1) * npad]) {
                *t = qx + key;
            }
            super::exp::tanh(isa, row.as_ptr(), row.as_mut_ptr(), npad);
            let wx = *w.add(x);
            for (s, t) in acc.iter_mut().zip(row.iter()) {
                *s += wx * t;
            }
        }
        for (col, s) in acc.iter().take(n).enumerate() {
            *out.add(col) = alpha * s;
        }
    }
}

/// One row's inputs to the product forms: the row's values and the packed keys' (narrow:
/// `e^{2x}` in the first of each pair; wide: `(m, n)`), `−2·w`, `(k, npad, n)`, the scale and
/// `Σ w`.
struct Terms {
    row: (*const f32, *const f32),
    keys: (*const f32, *const f32),
    wn2: *const f32,
    dims: (usize, usize, usize),
    alpha: f32,
    wsum: f32,
}

/// One row by a product form (`WIDE`: the wide one) on `isa`.
///
/// # Safety
/// The row's values and `wn2` address `k` elements, the keys' `k × npad`, `out` `n`; `isa` is
/// supported.
unsafe fn product_row<const WIDE: bool>(isa: Isa, t: &Terms, out: *mut f32) {
    // SAFETY: forwarded; each arm runs only where its ISA is supported.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => row_avx512::<WIDE>(t, out),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => row_avx2::<WIDE>(t, out),
            _ => row_portable::<WIDE>(t, out),
        }
    }
}

/// The vector operations the product forms need, for one register width. Implementations are
/// inlined into a `#[target_feature]` function of their instruction set.
#[cfg(target_arch = "x86_64")]
trait Simd {
    /// Lanes per vector.
    const L: usize;
    type V: Copy;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// `a·b + c`, fused.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// `x` clamped into `±EXP2_LIMIT`.
    unsafe fn clamp(x: Self::V) -> Self::V;
    /// `1 + p·2ᵉ` for integral `e` within `±EXP2_LIMIT`.
    unsafe fn one_plus_scaled(p: Self::V, e: Self::V) -> Self::V;
    /// `1/t`: the instruction's estimate refined by one Newton step.
    unsafe fn recip(t: Self::V) -> Self::V;
    /// Stores the first `n` lanes (`n ≥ 1`).
    unsafe fn store(p: *mut f32, x: Self::V, n: usize);
}

#[cfg(target_arch = "x86_64")]
struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Simd for Avx512 {
    const L: usize = 16;
    type V = __m512;
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        // SAFETY: the caller's 16 floats.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn clamp(x: __m512) -> __m512 {
        unsafe { _mm512_min_ps(_mm512_set1_ps(EXP2_LIMIT), _mm512_max_ps(_mm512_set1_ps(-EXP2_LIMIT), x)) }
    }
    #[inline(always)]
    unsafe fn one_plus_scaled(p: __m512, e: __m512) -> __m512 {
        unsafe { _mm512_add_ps(_mm512_scalef_ps(p, e), _mm512_set1_ps(1.0)) }
    }
    #[inline(always)]
    unsafe fn recip(t: __m512) -> __m512 {
        // The 14-bit estimate and one Newton step.
        unsafe {
            let r = _mm512_rcp14_ps(t);
            _mm512_fmadd_ps(r, _mm512_fnmadd_ps(t, r, _mm512_set1_ps(1.0)), r)
        }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, x: __m512, n: usize) {
        // SAFETY: the caller's `n` floats.
        unsafe { _mm512_mask_storeu_ps(p, super::x86_avx512::lanes(n), x) }
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Simd for Avx2 {
    const L: usize = 8;
    type V = __m256;
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        // SAFETY: the caller's 8 floats.
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn clamp(x: __m256) -> __m256 {
        unsafe { _mm256_min_ps(_mm256_set1_ps(EXP2_LIMIT), _mm256_max_ps(_mm256_set1_ps(-EXP2_LIMIT), x)) }
    }
    #[inline(always)]
    unsafe fn one_plus_scaled(p: __m256, e: __m256) -> __m256 {
        // 2ᵉ from its exponent bits.
        unsafe {
            let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(e), _mm256_set1_epi32(127))));
            _mm256_fmadd_ps(p, pow2, _mm256_set1_ps(1.0))
        }
    }
    #[inline(always)]
    unsafe fn recip(t: __m256) -> __m256 {
        // The 12-bit estimate and one Newton step.
        unsafe {
            let r = _mm256_rcp_ps(t);
            _mm256_fmadd_ps(r, _mm256_fnmadd_ps(t, r, _mm256_set1_ps(1.0)), r)
        }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, x: __m256, n: usize) {
        // SAFETY: the caller's `n` floats.
        unsafe { _mm256_maskstore_ps(p, super::x86_avx2::lanes(n), x) }
    }
}

/// `V` vectors of keys from column `c0` of one row: `alpha·(Σ w + Σ_a (−2w[a]) / t)` with
/// `t = 1 + E_q[a]·E_k[a]` (narrow) or `1 + m_q·m_k·2^{clamp(n_q + n_k)}` (`WIDE`).
///
/// # Safety
/// `c0 + L·V ≤ npad`; [`Terms`]' contract.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block<S: Simd, const V: usize, const WIDE: bool>(t: &Terms, c0: usize, out: *mut f32) {
    let (k, npad, n) = t.dims;
    // SAFETY: every load is inside the row's `k` values or the keys' `k × npad`; stores inside `n`.
    unsafe {
        let one = S::splat(1.0);
        let mut acc = [S::splat(0.0); V];
        for x in 0..k {
            let (r0, r1) = (S::splat(*t.row.0.add(x)), S::splat(*t.row.1.add(x)));
            let wx = S::splat(*t.wn2.add(x));
            let (k0, k1) = (t.keys.0.add(x * npad + c0), t.keys.1.add(x * npad + c0));
            for (v, s) in acc.iter_mut().enumerate() {
                let d = if WIDE {
                    let p = S::mul(r0, S::load(k0.add(S::L * v)));
                    S::one_plus_scaled(p, S::clamp(S::add(r1, S::load(k1.add(S::L * v)))))
                } else {
                    S::fma(r0, S::load(k0.add(S::L * v)), one)
                };
                *s = S::fma(wx, S::recip(d), *s);
            }
        }
        let (al, ws) = (S::splat(t.alpha), S::splat(t.wsum));
        for (v, s) in acc.iter().enumerate() {
            let col = c0 + S::L * v;
            if col < n {
                S::store(out.add(col), S::mul(al, S::add(ws, *s)), n - col);
            }
        }
    }
}

/// A row in blocks of 4 vectors, then single vectors to the padded width.
///
/// # Safety
/// [`Terms`]' contract; `npad` a multiple of `S::L`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn row<S: Simd, const WIDE: bool>(t: &Terms, out: *mut f32) {
    let npad = t.dims.1;
    let mut c0 = 0;
    // SAFETY: blocks stay inside `npad`.
    unsafe {
        while c0 + 4 * S::L <= npad {
            block::<S, 4, WIDE>(t, c0, out);
            c0 += 4 * S::L;
        }
        while c0 < npad {
            block::<S, 1, WIDE>(t, c0, out);
            c0 += S::L;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn row_avx512<const WIDE: bool>(t: &Terms, out: *mut f32) {
    // SAFETY: forwarded, AVX-512F enabled here.
    unsafe { row::<Avx512, WIDE>(t, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_avx2<const WIDE: bool>(t: &Terms, out: *mut f32) {
    // SAFETY: forwarded, AVX2 and FMA enabled here.
    unsafe { row::<Avx2, WIDE>(t, out) }
}

/// The product forms as lane loops with a true division (vectorised by LLVM for the baseline
/// target); the wide form's `2ⁿ` from the bits of `n + 1.5·2²³` (integer lanes, no
/// float-to-int conversion, which SSE2 has no saturating form of).
///
/// # Safety
/// [`Terms`]' contract; `npad` a multiple of 16.
unsafe fn row_portable<const WIDE: bool>(t: &Terms, out: *mut f32) {
    const L: usize = 16;
    let (k, npad, n) = t.dims;
    let bias = ROUND.to_bits().wrapping_sub(127);
    // SAFETY: the caller's contract: `k` row values and weights, `k × npad` key values.
    let (r0, r1, wn2) =
        unsafe { (std::slice::from_raw_parts(t.row.0, k), std::slice::from_raw_parts(t.row.1, k), std::slice::from_raw_parts(t.wn2, k)) };
    // SAFETY: as above.
    let (k0, k1) = unsafe { (std::slice::from_raw_parts(t.keys.0, k * npad), std::slice::from_raw_parts(t.keys.1, k * npad)) };
    for c0 in (0..npad).step_by(L) {
        let mut acc = [0.0f32; L];
        for x in 0..k {
            let at = x * npad + c0;
            let (a0, a1) = (&k0[at..at + L], &k1[at..at + L]);
            let mut d = [0.0f32; L];
            for l in 0..L {
                d[l] = if WIDE {
                    let e = r1[x] + a1[l];
                    let e = if e < -EXP2_LIMIT { -EXP2_LIMIT } else { e };
                    let e = if e > EXP2_LIMIT { EXP2_LIMIT } else { e };
                    1.0 + r0[x] * a0[l] * f32::from_bits((e + ROUND).to_bits().wrapping_sub(bias) << 23)
                } else {
                    1.0 + r0[x] * a0[l]
                };
            }
            for l in 0..L {
                acc[l] += wn2[x] / d[l];
            }
        }
        for (l, s) in acc.iter().enumerate() {
            if c0 + l < n {
                // SAFETY: `c0 + l < n`.
                unsafe { *out.add(c0 + l) = t.alpha * (t.wsum + s) };
            }
        }
    }
}
