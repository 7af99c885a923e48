//! Additive (Bahdanau) attention scores for one flash tile:
//! `C[r, c] = alpha · Σ_a w[a] · tanh(A[r, a] + B[c, a])`.
//!
//! `tanh(x + y) = 1 − 2 / (1 + e^{2x} · e^{2y})`, so with the exponentials of every query and
//! key element computed once per call (`m·k + n·k` of them for `m·n·k` terms), a score is
//! `alpha · (Σ_a w[a] − Σ_a 2·w[a] / (1 + E_q[a]·E_k[a]))`: an FMA, a reciprocal (an estimate
//! refined by a Newton step, or a division on the portable path: [`Vector::div_est_add`]) and
//! an FMA per term, where a `tanh` costs about 25 vector operations. The absolute error per
//! term is a few f32 ulp of 1, which is what a sum of weighted terms sees.
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
//! keys) into a per-thread buffer. The product forms' rows are written once over [`Vector`]
//! ([`row`]) and instantiated per path.

use std::cell::Cell;

use super::exp::{LN2_HI, LN2_LO, LOG2E, ROUND};
use super::vector::{Vector, isa_dispatch};
use super::{Gemm, Isa};

/// Inputs up to this magnitude take the narrow form: `e^{±40}` and products of two such
/// factors (`e^{±80}`) are normal f32 values, away from the exponential's flush threshold.
pub(super) const BOUND: f32 = 20.0;

/// The wide form clamps `n_q + n_k` into `±EXP2_LIMIT`: beyond it `|x + y| > 34`, where
/// `tanh` is ±1 in f32, and `2^{±100}` keeps every intermediate normal and finite.
const EXP2_LIMIT: f32 = 100.0;

/// Keys per packed row are padded to a multiple of this (the widest vector).
const PAD: usize = 16;

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
/// `a < k`, with the shape, strides, scale and path of `g` (`B` laid out as for `Layout::Nt`;
/// `C` is overwritten, and `g.accumulate` is not read).
///
/// # Safety
/// For non-empty shapes `a`, `b` and `c` address `(m-1)·lda + k`, `(n-1)·ldb + k` and
/// `(m-1)·ldc + n` valid elements and `w` addresses `k`; `C` overlaps none of them; `g.isa` is
/// supported.
pub(super) unsafe fn additive_nt(g: &Gemm, a: *const f32, b: *const f32, c: *mut f32, w: *const f32) {
    let Gemm { m, n, k, lda, ldb, ldc, alpha, isa, .. } = *g;
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

isa_dispatch! {
    /// One row by a product form (`WIDE`: the wide one) on `isa`: [`row`].
    ///
    /// # Safety
    /// The row's values and `wn2` address `k` elements, the keys' `k × npad`, `out` `n`; `isa`
    /// is supported.
    unsafe fn product_row<V, const WIDE: bool>(t: &Terms, out: *mut f32) => row::<V, WIDE>(t, out)
}

/// `U` vectors of keys from column `c0` of one row: `alpha·(Σ w + Σ_a (−2w[a]) / t)` with
/// `t = 1 + E_q[a]·E_k[a]` (narrow) or `1 + m_q·m_k·2^{clamp(n_q + n_k)}` (`WIDE`), the
/// quotients by [`Vector::div_est_add`].
///
/// # Safety
/// `c0 + LANES·U ≤ npad`; [`Terms`]' contract; `V`'s instructions are supported.
#[inline(always)]
unsafe fn block<V: Vector, const U: usize, const WIDE: bool>(t: &Terms, c0: usize, out: *mut f32) {
    let (k, npad, n) = t.dims;
    let l = V::LANES;
    // SAFETY: every load is inside the row's `k` values or the keys' `k × npad`; stores inside
    // `n`; `V`'s instructions are supported (the caller's contract).
    unsafe {
        let (one, lo, hi) = (V::splat(1.0), V::splat(-EXP2_LIMIT), V::splat(EXP2_LIMIT));
        let mut acc = [V::splat(0.0); U];
        for x in 0..k {
            let (r0, r1) = (V::splat(*t.row.0.add(x)), V::splat(*t.row.1.add(x)));
            let wx = V::splat(*t.wn2.add(x));
            let (k0, k1) = (t.keys.0.add(x * npad + c0), t.keys.1.add(x * npad + c0));
            for (v, s) in acc.iter_mut().enumerate() {
                let d = if WIDE {
                    let p = r0.mul(V::load(k0.add(l * v)));
                    p.madd_pow2(r1.add(V::load(k1.add(l * v))).at_least(lo).at_most(hi), one)
                } else {
                    r0.madd(V::load(k0.add(l * v)), one)
                };
                *s = wx.div_est_add(d, *s);
            }
        }
        let (al, ws) = (V::splat(t.alpha), V::splat(t.wsum));
        for (v, s) in acc.iter().enumerate() {
            let col = c0 + l * v;
            let score = al.mul(ws.add(*s));
            if col + l <= n {
                score.store(out.add(col));
            } else if col < n {
                score.store_part(out.add(col), n - col);
            }
        }
    }
}

/// A row in blocks of 4 vectors, then single vectors to the padded width.
///
/// # Safety
/// [`Terms`]' contract; `npad` a multiple of `V::LANES`; `V`'s instructions are supported.
#[inline(always)]
unsafe fn row<V: Vector, const WIDE: bool>(t: &Terms, out: *mut f32) {
    let (npad, l) = (t.dims.1, V::LANES);
    let mut c0 = 0;
    // SAFETY: blocks stay inside `npad`.
    unsafe {
        while c0 + 4 * l <= npad {
            block::<V, 4, WIDE>(t, c0, out);
            c0 += 4 * l;
        }
        while c0 < npad {
            block::<V, 1, WIDE>(t, c0, out);
            c0 += l;
        }
    }
}
