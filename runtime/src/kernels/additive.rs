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
                    fast_row(isa, eq.as_ptr(), ek.as_ptr(), wn2.as_ptr(), dims, out, alpha, wsum);
                }
                Form::Wide => {
                    split_exp(isa, q, k, mq, nq);
                    wide_row(isa, (mq, nq), (mk, nk), wn2, dims, out, alpha, wsum);
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

/// One row by the product form on `isa`.
///
/// # Safety
/// `eq` and `wn2` address `k` elements, `ek` `k × npad`, `out` `n`; `isa` is supported.
#[allow(clippy::too_many_arguments)]
unsafe fn fast_row(
    isa: Isa,
    eq: *const f32,
    ek: *const f32,
    wn2: *const f32,
    dims: (usize, usize, usize),
    out: *mut f32,
    alpha: f32,
    wsum: f32,
) {
    // SAFETY: forwarded; each arm runs only where its ISA is supported.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => fast_row_avx512(eq, ek, wn2, dims, out, alpha, wsum),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => fast_row_avx2(eq, ek, wn2, dims, out, alpha, wsum),
            _ => fast_row_portable(eq, ek, wn2, dims, out, alpha, wsum),
        }
    }
}

/// `V` vectors of 16 keys from column `c0`: `alpha·(wsum + Σ_a wn2[a] / (1 + eq[a]·ek[a, c]))`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn block_avx512<const V: usize>(
    eq: *const f32,
    ek: *const f32,
    wn2: *const f32,
    (k, npad, n): (usize, usize, usize),
    c0: usize,
    out: *mut f32,
    alpha: f32,
    wsum: f32,
) {
    let one = _mm512_set1_ps(1.0);
    let mut acc = [_mm512_setzero_ps(); V];
    // SAFETY: `c0 + 16·V ≤ npad`, and the caller's contract covers the rest.
    unsafe {
        for x in 0..k {
            let e = _mm512_set1_ps(*eq.add(x));
            let wx = _mm512_set1_ps(*wn2.add(x));
            let keys = ek.add(x * npad + c0);
            for (v, s) in acc.iter_mut().enumerate() {
                let t = _mm512_fmadd_ps(e, _mm512_loadu_ps(keys.add(16 * v)), one);
                // 1/t by the 14-bit estimate and one Newton step.
                let r = _mm512_rcp14_ps(t);
                let r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(t, r, one), r);
                *s = _mm512_fmadd_ps(wx, r, *s);
            }
        }
        let (al, ws) = (_mm512_set1_ps(alpha), _mm512_set1_ps(wsum));
        for (v, s) in acc.iter().enumerate() {
            let col = c0 + 16 * v;
            if col < n {
                let m = super::x86_avx512::lanes(n - col);
                _mm512_mask_storeu_ps(out.add(col), m, _mm512_mul_ps(al, _mm512_add_ps(ws, *s)));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fast_row_avx512(
    eq: *const f32,
    ek: *const f32,
    wn2: *const f32,
    dims: (usize, usize, usize),
    out: *mut f32,
    alpha: f32,
    wsum: f32,
) {
    let npad = dims.1;
    let mut c0 = 0;
    // SAFETY: blocks stay inside `npad`; forwarded otherwise.
    unsafe {
        while c0 + 64 <= npad {
            block_avx512::<4>(eq, ek, wn2, dims, c0, out, alpha, wsum);
            c0 += 64;
        }
        while c0 < npad {
            block_avx512::<1>(eq, ek, wn2, dims, c0, out, alpha, wsum);
            c0 += 16;
        }
    }
}

/// [`block_avx512`] with 8-lane vectors (12-bit reciprocal estimate and one Newton step).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn block_avx2<const V: usize>(
    eq: *const f32,
    ek: *const f32,
    wn2: *const f32,
    (k, npad, n): (usize, usize, usize),
    c0: usize,
    out: *mut f32,
    alpha: f32,
    wsum: f32,
) {
    let one = _mm256_set1_ps(1.0);
    let mut acc = [_mm256_setzero_ps(); V];
    // SAFETY: `c0 + 8·V ≤ npad`, and the caller's contract covers the rest.
    unsafe {
        for x in 0..k {
            let e = _mm256_set1_ps(*eq.add(x));
            let wx = _mm256_set1_ps(*wn2.add(x));
            let keys = ek.add(x * npad + c0);
            for (v, s) in acc.iter_mut().enumerate() {
                let t = _mm256_fmadd_ps(e, _mm256_loadu_ps(keys.add(8 * v)), one);
                let r = _mm256_rcp_ps(t);
                let r = _mm256_fmadd_ps(r, _mm256_fnmadd_ps(t, r, one), r);
                *s = _mm256_fmadd_ps(wx, r, *s);
            }
        }
        let (al, ws) = (_mm256_set1_ps(alpha), _mm256_set1_ps(wsum));
        for (v, s) in acc.iter().enumerate() {
            let col = c0 + 8 * v;
            if col < n {
                let m = super::x86_avx2::lanes(n - col);
                _mm256_maskstore_ps(out.add(col), m, _mm256_mul_ps(al, _mm256_add_ps(ws, *s)));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fast_row_avx2(
    eq: *const f32,
    ek: *const f32,
    wn2: *const f32,
    dims: (usize, usize, usize),
    out: *mut f32,
    alpha: f32,
    wsum: f32,
) {
    let npad = dims.1;
    let mut c0 = 0;
    // SAFETY: blocks stay inside `npad`; forwarded otherwise.
    unsafe {
        while c0 + 32 <= npad {
            block_avx2::<4>(eq, ek, wn2, dims, c0, out, alpha, wsum);
            c0 += 32;
        }
        while c0 < npad {
            block_avx2::<1>(eq, ek, wn2, dims, c0, out, alpha, wsum);
            c0 += 8;
        }
    }
}

/// The narrow form as fixed-width lane loops with a true division (vectorised by LLVM for
/// the baseline target).
unsafe fn fast_row_portable(
    eq: *const f32,
    ek: *const f32,
    wn2: *const f32,
    (k, npad, n): (usize, usize, usize),
    out: *mut f32,
    alpha: f32,
    wsum: f32,
) {
    const L: usize = 16;
    // SAFETY: the caller's contract: `k` row values and weights, `k × npad` key values.
    let (eq, wn2, ek) =
        unsafe { (std::slice::from_raw_parts(eq, k), std::slice::from_raw_parts(wn2, k), std::slice::from_raw_parts(ek, k * npad)) };
    for c0 in (0..npad).step_by(L) {
        let mut acc = [0.0f32; L];
        for x in 0..k {
            let (e, wx) = (eq[x], wn2[x]);
            let keys = &ek[x * npad + c0..x * npad + c0 + L];
            let mut t = [0.0f32; L];
            for l in 0..L {
                t[l] = 1.0 + e * keys[l];
            }
            for l in 0..L {
                acc[l] += wx / t[l];
            }
        }
        for (l, s) in acc.iter().enumerate() {
            if c0 + l < n {
                // SAFETY: `c0 + l < n`.
                unsafe { *out.add(c0 + l) = alpha * (wsum + s) };
            }
        }
    }
}

/// One row by the wide form on `isa`: `(m_q, n_q)` of the row, `(m_k, n_k)` of the packed keys.
///
/// # Safety
/// As [`fast_row`], with each pair of slices holding `k` (row) and `k × npad` (keys).
#[allow(clippy::too_many_arguments)]
unsafe fn wide_row(
    isa: Isa,
    q: (&[f32], &[f32]),
    keys: (&[f32], &[f32]),
    wn2: &[f32],
    dims: (usize, usize, usize),
    out: *mut f32,
    alpha: f32,
    wsum: f32,
) {
    let (mq, nq, mk, nk) = (q.0.as_ptr(), q.1.as_ptr(), keys.0.as_ptr(), keys.1.as_ptr());
    let wn2 = wn2.as_ptr();
    // SAFETY: forwarded; each arm runs only where its ISA is supported.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => wide_row_avx512(mq, nq, mk, nk, wn2, dims, out, alpha, wsum),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => wide_row_avx2(mq, nq, mk, nk, wn2, dims, out, alpha, wsum),
            _ => wide_row_portable(mq, nq, mk, nk, wn2, dims, out, alpha, wsum),
        }
    }
}

/// [`block_avx512`] in the wide form: `t = 1 + m_q·m_k·2^{clamp(n_q + n_k)}`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn wide_block_avx512<const V: usize>(
    (mq, nq): (*const f32, *const f32),
    (mk, nk): (*const f32, *const f32),
    wn2: *const f32,
    (k, npad, n): (usize, usize, usize),
    c0: usize,
    out: *mut f32,
    alpha: f32,
    wsum: f32,
) {
    let (one, lo, hi) = (_mm512_set1_ps(1.0), _mm512_set1_ps(-EXP2_LIMIT), _mm512_set1_ps(EXP2_LIMIT));
    let mut acc = [_mm512_setzero_ps(); V];
    // SAFETY: `c0 + 16·V ≤ npad`, and the caller's contract covers the rest.
    unsafe {
        for x in 0..k {
            let (m, e) = (_mm512_set1_ps(*mq.add(x)), _mm512_set1_ps(*nq.add(x)));
            let wx = _mm512_set1_ps(*wn2.add(x));
            let (ms, ns) = (mk.add(x * npad + c0), nk.add(x * npad + c0));
            for (v, s) in acc.iter_mut().enumerate() {
                let p = _mm512_mul_ps(m, _mm512_loadu_ps(ms.add(16 * v)));
                let e2 = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_add_ps(e, _mm512_loadu_ps(ns.add(16 * v)))));
                let t = _mm512_add_ps(_mm512_scalef_ps(p, e2), one);
                let r = _mm512_rcp14_ps(t);
                let r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(t, r, one), r);
                *s = _mm512_fmadd_ps(wx, r, *s);
            }
        }
        let (al, ws) = (_mm512_set1_ps(alpha), _mm512_set1_ps(wsum));
        for (v, s) in acc.iter().enumerate() {
            let col = c0 + 16 * v;
            if col < n {
                let m = super::x86_avx512::lanes(n - col);
                _mm512_mask_storeu_ps(out.add(col), m, _mm512_mul_ps(al, _mm512_add_ps(ws, *s)));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn wide_row_avx512(
    mq: *const f32,
    nq: *const f32,
    mk: *const f32,
    nk: *const f32,
    wn2: *const f32,
    dims: (usize, usize, usize),
    out: *mut f32,
    alpha: f32,
    wsum: f32,
) {
    let npad = dims.1;
    let mut c0 = 0;
    // SAFETY: blocks stay inside `npad`; forwarded otherwise.
    unsafe {
        while c0 + 64 <= npad {
            wide_block_avx512::<4>((mq, nq), (mk, nk), wn2, dims, c0, out, alpha, wsum);
            c0 += 64;
        }
        while c0 < npad {
            wide_block_avx512::<1>((mq, nq), (mk, nk), wn2, dims, c0, out, alpha, wsum);
            c0 += 16;
        }
    }
}

/// [`wide_block_avx512`] with 8-lane vectors: `2^{n}` built from its exponent bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn wide_block_avx2<const V: usize>(
    (mq, nq): (*const f32, *const f32),
    (mk, nk): (*const f32, *const f32),
    wn2: *const f32,
    (k, npad, n): (usize, usize, usize),
    c0: usize,
    out: *mut f32,
    alpha: f32,
    wsum: f32,
) {
    let (one, lo, hi) = (_mm256_set1_ps(1.0), _mm256_set1_ps(-EXP2_LIMIT), _mm256_set1_ps(EXP2_LIMIT));
    let bias = _mm256_set1_epi32(127);
    let mut acc = [_mm256_setzero_ps(); V];
    // SAFETY: `c0 + 8·V ≤ npad`, and the caller's contract covers the rest.
    unsafe {
        for x in 0..k {
            let (m, e) = (_mm256_set1_ps(*mq.add(x)), _mm256_set1_ps(*nq.add(x)));
            let wx = _mm256_set1_ps(*wn2.add(x));
            let (ms, ns) = (mk.add(x * npad + c0), nk.add(x * npad + c0));
            for (v, s) in acc.iter_mut().enumerate() {
                let p = _mm256_mul_ps(m, _mm256_loadu_ps(ms.add(8 * v)));
                let e2 = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_add_ps(e, _mm256_loadu_ps(ns.add(8 * v)))));
                let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(e2), bias)));
                let t = _mm256_fmadd_ps(p, pow2, one);
                let r = _mm256_rcp_ps(t);
                let r = _mm256_fmadd_ps(r, _mm256_fnmadd_ps(t, r, one), r);
                *s = _mm256_fmadd_ps(wx, r, *s);
            }
        }
        let (al, ws) = (_mm256_set1_ps(alpha), _mm256_set1_ps(wsum));
        for (v, s) in acc.iter().enumerate() {
            let col = c0 + 8 * v;
            if col < n {
                let m = super::x86_avx2::lanes(n - col);
                _mm256_maskstore_ps(out.add(col), m, _mm256_mul_ps(al, _mm256_add_ps(ws, *s)));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn wide_row_avx2(
    mq: *const f32,
    nq: *const f32,
    mk: *const f32,
    nk: *const f32,
    wn2: *const f32,
    dims: (usize, usize, usize),
    out: *mut f32,
    alpha: f32,
    wsum: f32,
) {
    let npad = dims.1;
    let mut c0 = 0;
    // SAFETY: blocks stay inside `npad`; forwarded otherwise.
    unsafe {
        while c0 + 32 <= npad {
            wide_block_avx2::<4>((mq, nq), (mk, nk), wn2, dims, c0, out, alpha, wsum);
            c0 += 32;
        }
        while c0 < npad {
            wide_block_avx2::<1>((mq, nq), (mk, nk), wn2, dims, c0, out, alpha, wsum);
            c0 += 8;
        }
    }
}

/// The wide form as lane loops with a true division; `2ⁿ` from the bits of `n + 1.5·2²³`
/// (integer lanes, no float-to-int conversion, which SSE2 has no saturating form of).
#[allow(clippy::too_many_arguments)]
unsafe fn wide_row_portable(
    mq: *const f32,
    nq: *const f32,
    mk: *const f32,
    nk: *const f32,
    wn2: *const f32,
    (k, npad, n): (usize, usize, usize),
    out: *mut f32,
    alpha: f32,
    wsum: f32,
) {
    const L: usize = 16;
    let bias = ROUND.to_bits().wrapping_sub(127);
    // SAFETY: the caller's contract: `k` row values, `k × npad` key values, `n` outputs.
    let (mq, nq, wn2) =
        unsafe { (std::slice::from_raw_parts(mq, k), std::slice::from_raw_parts(nq, k), std::slice::from_raw_parts(wn2, k)) };
    // SAFETY: as above.
    let (mk, nk) = unsafe { (std::slice::from_raw_parts(mk, k * npad), std::slice::from_raw_parts(nk, k * npad)) };
    for c0 in (0..npad).step_by(L) {
        let mut acc = [0.0f32; L];
        for x in 0..k {
            let (m, e, wx) = (mq[x], nq[x], wn2[x]);
            let at = x * npad + c0;
            let (ms, ns) = (&mk[at..at + L], &nk[at..at + L]);
            let mut t = [0.0f32; L];
            for l in 0..L {
                let e2 = e + ns[l];
                let e2 = if e2 < -EXP2_LIMIT { -EXP2_LIMIT } else { e2 };
                let e2 = if e2 > EXP2_LIMIT { EXP2_LIMIT } else { e2 };
                t[l] = 1.0 + m * ms[l] * f32::from_bits((e2 + ROUND).to_bits().wrapping_sub(bias) << 23);
            }
            for l in 0..L {
                acc[l] += wx / t[l];
            }
        }
        for (l, s) in acc.iter().enumerate() {
            if c0 + l < n {
                // SAFETY: `c0 + l < n`.
                unsafe { *out.add(c0 + l) = alpha * (wsum + s) };
            }
        }
    }
}
