//! Dropout in the flash kernels: the random bits of one element (Philox4x32-10 under the seed;
//! key `j = 64·b + 16·w + l` takes word `w` of counter `(16·b + l, i, batch, 0)`; defined in
//! `attn_compiler::ir::semantics::dropout_bits`, which the tests hold these to) and the keep
//! mask applied to a tile of weights in place: sixteen generator calls side by side (one
//! vector each step) give 64 consecutive keys of a row, or one key of each of sixteen rows.

use super::Isa;

/// Generator calls side by side.
const L: usize = 16;

/// Philox4x32-10 of `N` counters `(c0[l], c1[l], batch, 0)` under key `(seed, 0)`, written
/// lane-wise so that each step is one vector operation (`N` = [`L`]; 1 for one element).
#[inline(always)]
fn philox<const N: usize>(c0: [u32; N], c1: [u32; N], batch: u32, seed: u32) -> [[u32; N]; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    let mut c = [c0, c1, [batch; N], [0u32; N]];
    let (mut k0, mut k1) = (seed, 0u32);
    for round in 0..10 {
        if round > 0 {
            k0 = k0.wrapping_add(0x9E37_79B9);
            k1 = k1.wrapping_add(0xBB67_AE85);
        }
        let mut n = [[0u32; N]; 4];
        for l in 0..N {
            let p0 = M0 * u64::from(c[0][l]);
            let p1 = M1 * u64::from(c[2][l]);
            n[0][l] = (p1 >> 32) as u32 ^ c[1][l] ^ k0;
            n[1][l] = p1 as u32;
            n[2][l] = (p0 >> 32) as u32 ^ c[3][l] ^ k1;
            n[3][l] = p0 as u32;
        }
        c = n;
    }
    c
}

/// The 24 random bits of dropout element `(batch, i, j)` under `seed`.
pub(crate) fn bits(seed: u32, batch: u32, i: u32, j: u32) -> u32 {
    let counter = ((j >> 6) << 4) | (j & 15);
    philox([counter], [i], batch, seed)[((j >> 4) & 3) as usize][0] >> 8
}

/// Where a tile sits among the scores, and the dropout it gets.
#[derive(Clone, Copy, Debug)]
pub struct DropoutTile {
    /// The score position of the tile's first row and column: `(i0, j0)`, or `(j0, i0)` when
    /// `keys_on_rows` (a transposed tile of the backward pass: key rows, query columns).
    pub r0: u32,
    /// See `r0`.
    pub c0: u32,
    /// Rows are keys and columns queries.
    pub keys_on_rows: bool,
    /// The seed and the batch index (row-major over the score's batch axes).
    pub seed: u32,
    /// See `seed`.
    pub batch: u32,
    /// Kept when the bits are at least this.
    pub threshold: u32,
    /// The factor on kept elements.
    pub scale: f32,
}

impl DropoutTile {
    /// The factors of sixteen elements whose generator words are `w`.
    #[inline(always)]
    fn factors(&self, w: &[u32; L]) -> [f32; L] {
        let mut f = [0.0f32; L];
        for (f, w) in f.iter_mut().zip(w) {
            *f = if w >> 8 >= self.threshold { self.scale } else { 0.0 };
        }
        f
    }
}

/// Each `x` times its factor: 0 where dropped (even for a non-finite `x`).
#[inline(always)]
fn times(xs: &mut [f32], fs: &[f32]) {
    for (x, f) in xs.iter_mut().zip(fs) {
        *x = if *f != 0.0 { *x * f } else { 0.0 };
    }
}

#[inline(always)]
unsafe fn apply_body(p: *mut f32, ld: usize, rows: usize, cols: usize, t: DropoutTile) {
    if rows == 0 || cols == 0 {
        return;
    }
    let lanes: [u32; L] = std::array::from_fn(|l| l as u32);
    if !t.keys_on_rows {
        // Query rows, key columns: per row, 64 keys (sixteen calls, four words) at a time.
        let (j_lo, j_hi) = (u64::from(t.c0), u64::from(t.c0) + cols as u64);
        for r in 0..rows {
            // SAFETY: row `r` of the tile, `cols` elements (the caller's contract).
            let row = unsafe { std::slice::from_raw_parts_mut(p.add(r * ld), cols) };
            let i = t.r0.wrapping_add(r as u32);
            for b in (j_lo >> 6)..j_hi.div_ceil(64) {
                let counters = lanes.map(|l| ((b as u32) << 4) | l);
                let words = philox::<L>(counters, [i; L], t.batch, t.seed);
                for (w, word) in words.iter().enumerate() {
                    let first = b * 64 + 16 * w as u64;
                    let (lo, hi) = (first.max(j_lo), (first + L as u64).min(j_hi));
                    if lo < hi {
                        let f = t.factors(word);
                        times(&mut row[(lo - j_lo) as usize..(hi - j_lo) as usize], &f[(lo - first) as usize..(hi - first) as usize]);
                    }
                }
            }
        }
    } else {
        // Key rows, query columns: the four key rows one call serves (16 apart), sixteen
        // queries at a time.
        let (j_lo, j_hi) = (u64::from(t.r0), u64::from(t.r0) + rows as u64);
        for b in (j_lo >> 6)..j_hi.div_ceil(64) {
            for l in 0..L as u64 {
                let live: [bool; 4] = std::array::from_fn(|w| (j_lo..j_hi).contains(&(b * 64 + 16 * w as u64 + l)));
                if !live.contains(&true) {
                    continue;
                }
                let counter = ((b as u32) << 4) | l as u32;
                let mut c = 0;
                while c < cols {
                    let n = L.min(cols - c);
                    let queries = lanes.map(|k| t.c0.wrapping_add(c as u32 + k));
                    let words = philox::<L>([counter; L], queries, t.batch, t.seed);
                    for w in (0..4).filter(|w| live[*w]) {
                        let r = (b * 64 + 16 * w as u64 + l - j_lo) as usize;
                        // SAFETY: row `r`, columns `c .. c + n` of the tile.
                        let row = unsafe { std::slice::from_raw_parts_mut(p.add(r * ld + c), n) };
                        times(row, &t.factors(&words[w])[..n]);
                    }
                    c += n;
                }
            }
        }
    }
}

/// Multiplies each element of the `rows × cols` tile at `p` (rows `ld` apart) by its keep
/// factor: `scale` where dropout keeps it, else 0.
///
/// # Safety
/// `p` addresses `(rows-1)·ld + cols` valid elements when `rows` and `cols` are non-zero; `isa`
/// is supported.
pub(crate) unsafe fn apply(isa: Isa, p: *mut f32, ld: usize, rows: usize, cols: usize, t: DropoutTile) {
    /// The AVX-512 instance: sixteen generator calls in one register.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn avx512(p: *mut f32, ld: usize, rows: usize, cols: usize, t: DropoutTile) {
        // SAFETY: forwarded.
        unsafe { x86::apply(p, ld, rows, cols, t) }
    }
    /// The AVX2 instance.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2(p: *mut f32, ld: usize, rows: usize, cols: usize, t: DropoutTile) {
        // SAFETY: forwarded.
        unsafe { apply_body(p, ld, rows, cols, t) }
    }
    // SAFETY: forwarded; each arm runs only where its ISA is supported.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => avx512(p, ld, rows, cols, t),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => avx2(p, ld, rows, cols, t),
            _ => apply_body(p, ld, rows, cols, t),
        }
    }
}

/// The AVX-512 kernel: the rounds on sixteen 32-bit lanes, the 32×32→64-bit products of even
/// and odd lanes by `vpmuludq`, the halves blended back into lanes.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{DropoutTile, L};
    use std::arch::x86_64::*;

    /// `(hi, lo)` of `m · x` per 32-bit lane.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn mulhilo(x: __m512i, m: __m512i) -> (__m512i, __m512i) {
        let even = _mm512_mul_epu32(x, m);
        let odd = _mm512_mul_epu32(_mm512_srli_epi64::<32>(x), m);
        let hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64::<32>(even), odd);
        let lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64::<32>(odd));
        (hi, lo)
    }

    /// Philox4x32-10 of the counters `(c0, c1, batch, 0)` under key `(seed, 0)`, lane by lane.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn philox16(c0: __m512i, c1: __m512i, batch: u32, seed: u32) -> [__m512i; 4] {
        let (m0, m1) = (_mm512_set1_epi64(0xD251_1F53), _mm512_set1_epi64(0xCD9E_8D57));
        let mut c = [c0, c1, _mm512_set1_epi32(batch as i32), _mm512_setzero_si512()];
        let (mut k0, mut k1) = (seed, 0u32);
        for round in 0..10 {
            if round > 0 {
                k0 = k0.wrapping_add(0x9E37_79B9);
                k1 = k1.wrapping_add(0xBB67_AE85);
            }
            let (hi0, lo0) = mulhilo(c[0], m0);
            let (hi1, lo1) = mulhilo(c[2], m1);
            c = [
                _mm512_xor_si512(_mm512_xor_si512(hi1, c[1]), _mm512_set1_epi32(k0 as i32)),
                lo1,
                _mm512_xor_si512(_mm512_xor_si512(hi0, c[3]), _mm512_set1_epi32(k1 as i32)),
                lo0,
            ];
        }
        c
    }

    /// The lanes of `word` that dropout keeps.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn kept(word: __m512i, threshold: __m512i) -> __mmask16 {
        _mm512_cmpge_epu32_mask(_mm512_srli_epi32::<8>(word), threshold)
    }

    /// The 16 floats at `at` (lanes `live`) times `scale` where `keep`, else 0.
    ///
    /// # Safety
    /// The live lanes of `at` are valid.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn scale_lanes(at: *mut f32, live: __mmask16, keep: __mmask16, scale: __m512) {
        // SAFETY: only the live lanes are read and written.
        unsafe {
            let x = _mm512_maskz_loadu_ps(live, at);
            _mm512_mask_storeu_ps(at, live, _mm512_maskz_mul_ps(keep, x, scale));
        }
    }

    /// Lanes `l` with `lo ≤ first + l < hi`.
    fn lanes_in(first: u64, lo: u64, hi: u64) -> __mmask16 {
        let mut m = 0u16;
        for l in 0..L as u64 {
            if (lo..hi).contains(&(first + l)) {
                m |= 1 << l;
            }
        }
        m
    }

    /// [`super::apply`] on AVX-512.
    ///
    /// # Safety
    /// As [`super::apply`]'s.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn apply(p: *mut f32, ld: usize, rows: usize, cols: usize, t: DropoutTile) {
        if rows == 0 || cols == 0 {
            return;
        }
        let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let threshold = _mm512_set1_epi32(t.threshold as i32);
        let scale = _mm512_set1_ps(t.scale);
        if !t.keys_on_rows {
            let (j_lo, j_hi) = (u64::from(t.c0), u64::from(t.c0) + cols as u64);
            for r in 0..rows {
                let row = p.wrapping_add(r * ld);
                let i = _mm512_set1_epi32(t.r0.wrapping_add(r as u32) as i32);
                for b in (j_lo >> 6)..j_hi.div_ceil(64) {
                    let counters = _mm512_or_si512(_mm512_set1_epi32(((b as u32) << 4) as i32), lane);
                    let words = philox16(counters, i, t.batch, t.seed);
                    for (w, word) in words.iter().enumerate() {
                        let first = b * 64 + 16 * w as u64;
                        let live = lanes_in(first, j_lo, j_hi);
                        if live != 0 {
                            // Lanes before the row's first key are masked off (never touched).
                            let at = row.wrapping_add(first as usize).wrapping_sub(j_lo as usize);
                            // SAFETY: the live lanes are columns of row `r` of the tile.
                            unsafe { scale_lanes(at, live, kept(*word, threshold), scale) };
                        }
                    }
                }
            }
        } else {
            let (j_lo, j_hi) = (u64::from(t.r0), u64::from(t.r0) + rows as u64);
            for b in (j_lo >> 6)..j_hi.div_ceil(64) {
                for l in 0..L as u64 {
                    let live_rows: [bool; 4] = std::array::from_fn(|w| (j_lo..j_hi).contains(&(b * 64 + 16 * w as u64 + l)));
                    if !live_rows.contains(&true) {
                        continue;
                    }
                    let counter = _mm512_set1_epi32((((b as u32) << 4) | l as u32) as i32);
                    let mut c = 0;
                    while c < cols {
                        let n = L.min(cols - c);
                        let live = if n == L { 0xFFFF } else { (1u16 << n) - 1 };
                        let queries = _mm512_add_epi32(_mm512_set1_epi32(t.c0.wrapping_add(c as u32) as i32), lane);
                        let words = philox16(counter, queries, t.batch, t.seed);
                        for (w, word) in words.iter().enumerate().filter(|(w, _)| live_rows[*w]) {
                            let r = (b * 64 + 16 * w as u64 + l - j_lo) as usize;
                            // SAFETY: row `r`, columns `c .. c + n` of the tile.
                            unsafe { scale_lanes(p.wrapping_add(r * ld + c), live, kept(*word, threshold), scale) };
                        }
                        c += n;
                    }
                }
            }
        }
    }
}
