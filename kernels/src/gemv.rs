//! Products with a few rows of `A` (decode: one to four query rows against a key or value tile),
//! which are matrix-vector work bound by how fast `B` streams from memory. `B` is read once, in
//! place (packing it would triple the traffic), 16 lanes at a time, with software prefetch a
//! few rows ahead so that the loads of a single core keep more cache lines in flight than the
//! hardware prefetcher alone does.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::Gemm;
#[cfg(target_arch = "x86_64")]
use super::Isa;
use super::gemm::{Layout, by_rows};
#[cfg(target_arch = "x86_64")]
use super::x86_avx512::lanes;

/// Rows of `A` handled together (accumulators: `ROWS` per key pair for `Nt`, `ROWS · 4` for
/// `Nn`).
const ROWS: usize = 4;
/// How many rows of `B` ahead the prefetches run (16 rows of 512 bytes: 8 KiB in flight).
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 16;

/// Where each row of `B` is: rows `ldb` apart ([`Dense`]), or a paged cache's rows found
/// through its block table ([`Paged`]). `row` may be asked for rows past `B` only by
/// [`Rows::prefetch`], which forms addresses with wrapping arithmetic and reads nothing.
pub(super) trait Rows {
    /// The first element of row `j` (`j` inside `B`).
    fn row(&mut self, j: usize) -> *const f32;
    /// Prefetches `count` rows of `bytes` bytes each from row `j` on, where they exist.
    fn prefetch(&mut self, j: usize, count: usize, bytes: usize);
}

/// Rows `ldb` elements apart from `b`.
pub(super) struct Dense {
    b: *const f32,
    ldb: usize,
}

impl Rows for Dense {
    fn row(&mut self, j: usize) -> *const f32 {
        self.b.wrapping_add(j * self.ldb)
    }

    fn prefetch(&mut self, j: usize, count: usize, bytes: usize) {
        prefetch_lines::<INTO_L1>(self.row(j), bytes * count);
    }
}

/// `B`'s rows read in place from a paged KV cache: row `j` is key `first + j` of a sequence,
/// row `(first + j) % page` of page `clamp(table[(first + j) / page · table_stride], 0,
/// pages − 1)`. The layout generated code fills for [`super::attnc_gemv_nt_paged`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PagedRows {
    /// Page 0's first element (the batch index's offset included).
    pub base: *const f32,
    /// Elements between the rows of a page.
    pub row_stride: usize,
    /// Elements between pages.
    pub page_stride: usize,
    /// Rows per page (≥ 1).
    pub page: usize,
    /// Pages in the pool (≥ 1).
    pub pages: usize,
    /// The sequence's row of the block table.
    pub table: *const i32,
    /// Elements between the table's entries.
    pub table_stride: usize,
    /// Entries in the table's row.
    pub table_len: usize,
    /// The key of `B`'s row 0.
    pub first: usize,
}

/// The page holding key `t` of a [`PagedRows`]: its first key and its first row, when the table
/// has an entry for it.
pub(super) fn page_of(d: &PagedRows, t: usize) -> Option<(usize, *const f32)> {
    let m = t / d.page.max(1);
    if m >= d.table_len {
        return None;
    }
    // SAFETY: entry `m < table_len` of the table's row, which the caller's contract makes
    // readable.
    let id = unsafe { *d.table.add(m * d.table_stride) };
    let id = (id.max(0) as usize).min(d.pages.saturating_sub(1));
    Some((m * d.page, d.base.wrapping_add(id * d.page_stride)))
}

/// A cursor over a [`PagedRows`]' rows (all inside its table): the page of the last row asked
/// for is kept, so that a row of the same page costs a compare and a multiply-add. What follows
/// a page in memory is not the next page, so prefetching follows the table, at two distances:
/// on entering a page, the first rows of the page about [`PAGED_AHEAD`] rows on, into L2 (`T1`;
/// on Zen 4 with pages of 16 rows, `bench/paged_decode.sh` measured two pages ahead at 82% of
/// the contiguous decode's bandwidth, four at 81–91%, eight at 71%; without it 53%), and the
/// kernels' own prefetches (rows [`AHEAD`] on, into L1, `T0`) found through the table by a
/// second cursor: with both, the HND decode went from 42.1–48.8 to 36.6–46.2 ms in one
/// interleaved run (both alone: 57–60 ms without the `T1` ones).
pub(super) struct Paged<'d> {
    d: &'d PagedRows,
    /// The page of the rows asked for.
    at: PageAt,
    /// Bytes of a row.
    row_bytes: usize,
    /// The page of the kernels' own prefetches (rows [`AHEAD`] on, into L1, through the table).
    pf: PageAt,
}

/// A cursor's cached page: its first key (`usize::MAX`: none yet) and first row.
#[derive(Clone, Copy)]
pub(super) struct PageAt {
    lo: usize,
    start: *const f32,
}

impl PageAt {
    pub(super) const NONE: PageAt = PageAt { lo: usize::MAX, start: std::ptr::null() };

    /// Moves to the page of key `t` unless it is the cached one: `Some(moved)`, or `None` when
    /// the table has no entry for it (the cached page is kept).
    #[inline(always)]
    pub(super) fn seek(&mut self, d: &PagedRows, t: usize) -> Option<bool> {
        if self.lo != usize::MAX && t.wrapping_sub(self.lo) < d.page {
            return Some(false);
        }
        let (lo, start) = page_of(d, t)?;
        *self = PageAt { lo, start };
        Some(true)
    }

    /// Key `t`'s row in the cached page (addresses formed with wrapping arithmetic).
    #[inline(always)]
    pub(super) fn row(&self, d: &PagedRows, t: usize) -> *const f32 {
        self.start.wrapping_add(t.wrapping_sub(self.lo) * d.row_stride)
    }
}

/// Rows ahead (in sequence order, across pages) that a paged product prefetches.
const PAGED_AHEAD: usize = 64;

impl<'d> Paged<'d> {
    pub(super) fn new(d: &'d PagedRows, row_bytes: usize) -> Paged<'d> {
        Paged { d, at: PageAt::NONE, row_bytes, pf: PageAt::NONE }
    }

    /// Prefetches `row_bytes` at `p` into L2.
    #[inline(always)]
    fn fetch(&self, p: *const f32) {
        prefetch_lines::<INTO_L2>(p, self.row_bytes);
    }
}

impl Rows for Paged<'_> {
    #[inline(always)]
    fn row(&mut self, j: usize) -> *const f32 {
        let t = self.d.first + j;
        if self.at.seek(self.d, t) != Some(false) {
            let page = self.d.page.max(1);
            let ahead = PAGED_AHEAD.div_ceil(page).max(1) * page;
            if let Some((_, next)) = page_of(self.d, self.at.lo.wrapping_add(ahead)) {
                for r in 0..page.min(AHEAD) {
                    self.fetch(next.wrapping_add(r * self.d.row_stride));
                }
            }
        }
        self.at.row(self.d, t)
    }

    #[inline(always)]
    fn prefetch(&mut self, j: usize, count: usize, bytes: usize) {
        for r in 0..count {
            let t = self.d.first + j + r;
            if self.pf.seek(self.d, t).is_none() {
                return;
            }
            prefetch_lines::<INTO_L1>(self.pf.row(self.d, t), bytes);
        }
    }
}

/// [`run`] with `B`'s rows read through a paged cache ([`PagedRows`], every row inside its
/// table), through a [`Paged`] cursor per block of rows of `A`.
///
/// # Safety
/// As [`run`] for `A` and `C`; `d`'s table row and pages as [`super::attnc_gemv_nt_paged`]
/// says, with rows `first..first + count` inside the table (`count` = `n` for `Nt`, `k` for
/// `Nn`).
pub(super) unsafe fn run_paged(g: &Gemm, layout: Layout, a: *const f32, d: &PagedRows, c: *mut f32) {
    let row_bytes = if layout == Layout::Nt { g.k * 4 } else { g.n * 4 };
    // SAFETY: forwarded.
    unsafe { run_rows(g, layout, a, || Paged::new(d, row_bytes), c) }
}

/// `C (+)= alpha · A · op(B)` for any shape, fastest for `m ≤ 4`.
///
/// # Safety
/// As [`super::attnc_sgemm_nt`] / [`super::attnc_sgemm_nn`]; `g.isa` is supported.
pub(super) unsafe fn run(g: &Gemm, layout: Layout, a: *const f32, b: *const f32, c: *mut f32) {
    // SAFETY: forwarded.
    unsafe { run_rows(g, layout, a, || Dense { b, ldb: g.ldb }, c) }
}

/// [`run`] with `B`'s rows from `rows` (one cursor per block of rows of `A`).
///
/// # Safety
/// As [`run`], with every row `rows` gives for `j <` `n` (`Nt`) or `k` (`Nn`) holding the
/// row's elements.
pub(super) unsafe fn run_rows<R: Rows>(g: &Gemm, layout: Layout, a: *const f32, rows_of: impl Fn() -> R, c: *mut f32) {
    if g.m == 0 || g.n == 0 {
        return;
    }
    for r0 in (0..g.m).step_by(ROWS) {
        let rows = ROWS.min(g.m - r0);
        // SAFETY: row block `r0..r0 + rows` of `A` and `C` lies within the caller's shapes.
        unsafe {
            let (a, c) = (a.add(r0 * g.lda), c.add(r0 * g.ldc));
            let b = rows_of();
            match (g.isa, layout) {
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512, Layout::Nt) => by_rows!(rows, [1, 2, 3], _ => 4, nt_avx512(g, a, b, c)),
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512, Layout::Nn) => by_rows!(rows, [1, 2, 3], _ => 4, nn_avx512(g, a, b, c)),
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx2, Layout::Nt) => nt_avx2(g, rows, a, b, c),
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx2, Layout::Nn) => nn_avx2(g, rows, a, b, c),
                (_, Layout::Nt) => nt_portable(g, rows, a, b, c),
                (_, Layout::Nn) => nn_portable(g, rows, a, b, c),
            }
        }
    }
}

/// Writes `alpha · sum` to `*c`, adding the old value when accumulating.
///
/// # Safety
/// `c` is valid for reads and writes.
unsafe fn put(g: &Gemm, c: *mut f32, sum: f32) {
    // SAFETY: the caller's contract.
    unsafe { *c = if g.accumulate { g.alpha * sum + *c } else { g.alpha * sum } };
}

/// [`nt_portable`] compiled for AVX2 (256-bit lanes; these products are bound by memory).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn nt_avx2(g: &Gemm, rows: usize, a: *const f32, b: impl Rows, c: *mut f32) {
    // SAFETY: forwarded.
    unsafe { nt_portable(g, rows, a, b, c) }
}

/// [`nn_portable`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn nn_avx2(g: &Gemm, rows: usize, a: *const f32, b: impl Rows, c: *mut f32) {
    // SAFETY: forwarded.
    unsafe { nn_portable(g, rows, a, b, c) }
}

/// `Nt` in plain Rust: one dot product per `(row, key)`, in eight interleaved partial sums
/// (which the compiler vectorises).
///
/// # Safety
/// As [`run`], for `rows` rows at `a` and `c`.
#[inline(always)]
unsafe fn nt_portable(g: &Gemm, rows: usize, a: *const f32, mut b: impl Rows, c: *mut f32) {
    for j in 0..g.n {
        // SAFETY: key row `j < n` of `B` holds `k` elements.
        let key = unsafe { std::slice::from_raw_parts(b.row(j), g.k) };
        for r in 0..rows {
            // SAFETY: row `r < m` of `A` holds `k` elements.
            let q = unsafe { std::slice::from_raw_parts(a.add(r * g.lda), g.k) };
            // SAFETY: `(r, j)` is inside `C`.
            unsafe { put(g, c.add(r * g.ldc + j), dot8(q, key)) };
        }
    }
}

/// `Nn` in plain Rust, row by row of `B`.
///
/// # Safety
/// As [`run`], for `rows` rows at `a` and `c`.
#[inline(always)]
unsafe fn nn_portable(g: &Gemm, rows: usize, a: *const f32, mut b: impl Rows, c: *mut f32) {
    let mut sums = vec![0.0f32; rows * g.n];
    for p in 0..g.k {
        let brow = b.row(p);
        for r in 0..rows {
            // SAFETY: `(r, p)` is inside `A`.
            let ap = unsafe { *a.add(r * g.lda + p) };
            for (j, s) in sums[r * g.n..(r + 1) * g.n].iter_mut().enumerate() {
                // SAFETY: `(p, j)` is inside `B`.
                *s += ap * unsafe { *brow.add(j) };
            }
        }
    }
    for r in 0..rows {
        for j in 0..g.n {
            // SAFETY: `(r, j)` is inside `C`.
            unsafe { put(g, c.add(r * g.ldc + j), sums[r * g.n + j]) };
        }
    }
}

/// The hint of a prefetch into L1 ([`prefetch_lines`]; `_MM_HINT_T0`).
pub(super) const INTO_L1: i32 = 3;
/// The hint of a prefetch into L2 (`_MM_HINT_T1`).
pub(super) const INTO_L2: i32 = 2;

/// Prefetches the `bytes` bytes at `p` into the cache level `HINT` says ([`INTO_L1`],
/// [`INTO_L2`]); nothing off x86-64. `p` may lie past the end of `B` or of any allocation:
/// prefetches read nothing and never fault, and the addresses are formed with wrapping
/// arithmetic.
#[inline(always)]
pub(super) fn prefetch_lines<const HINT: i32>(p: *const f32, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    for off in (0..bytes).step_by(64) {
        // SAFETY: a prefetch reads nothing and cannot fault; SSE is in the x86-64 baseline.
        unsafe { _mm_prefetch::<HINT>(p.cast::<i8>().wrapping_add(off)) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, bytes);
}

/// `Σ x[i]·y[i]` in eight interleaved partial sums (which the compiler vectorises).
#[inline(always)]
pub(super) fn dot8(x: &[f32], y: &[f32]) -> f32 {
    let mut part = [0.0f32; 8];
    let (xc, yc) = (x.chunks_exact(8), y.chunks_exact(8));
    let tail: f32 = xc.remainder().iter().zip(yc.remainder()).map(|(a, b)| a * b).sum();
    for (a, b) in xc.zip(yc) {
        for t in 0..8 {
            part[t] += a[t] * b[t];
        }
    }
    part.iter().sum::<f32>() + tail
}

/// AVX-512 `Nt`: two keys at a time, `rows × 2` independent dot-product chains over `k` in
/// vectors of 16 (masked tail), reduced at the end of each key pair.
///
/// # Safety
/// As [`run`], for `R ≤ 4` rows at `a` and `c`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn nt_avx512<const R: usize>(g: &Gemm, a: *const f32, mut b: impl Rows, c: *mut f32) {
    let row_bytes = g.k * 4;
    let mut j = 0;
    while j < g.n {
        let pair = (g.n - j).min(2);
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        b.prefetch(j + AHEAD, pair, row_bytes);
        let (k0, k1) = (b.row(j), b.row(j + pair - 1));
        let mut p = 0;
        while p < g.k {
            let m = lanes(g.k - p);
            // SAFETY: lanes `p..min(p + 16, k)` of key rows `j..j + pair` and of `A`'s rows.
            unsafe {
                let keys = [_mm512_maskz_loadu_ps(m, k0.add(p)), _mm512_maskz_loadu_ps(m, k1.add(p))];
                for (r, acc) in acc.iter_mut().enumerate() {
                    let q = _mm512_maskz_loadu_ps(m, a.add(r * g.lda + p));
                    acc[0] = _mm512_fmadd_ps(q, keys[0], acc[0]);
                    acc[1] = _mm512_fmadd_ps(q, keys[1], acc[1]);
                }
            }
            p += 16;
        }
        for (r, acc) in acc.iter().enumerate() {
            for (t, sum) in acc.iter().enumerate().take(pair) {
                // SAFETY: `(r, j + t)` is inside `C`.
                unsafe { put(g, c.add(r * g.ldc + j + t), _mm512_reduce_add_ps(*sum)) };
            }
        }
        j += pair;
    }
}

/// AVX-512 `Nn`: `C` columns in chunks of `16 · V` (`V` vectors, masked at the end), each chunk
/// accumulating `rows × V` vectors over every row of `B`. One or two rows take chunks of 128
/// columns (a head of width 128 in one pass over `B`), more rows chunks of 64 (the registers).
///
/// # Safety
/// As [`run`], for `R ≤ 4` rows at `a` and `c`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn nn_avx512<const R: usize>(g: &Gemm, a: *const f32, b: impl Rows, c: *mut f32) {
    // SAFETY: forwarded.
    unsafe { if R <= 2 { nn_avx512_chunks::<R, 8>(g, a, b, c) } else { nn_avx512_chunks::<R, 4>(g, a, b, c) } }
}

/// [`nn_avx512`] with chunks of `V` vectors.
///
/// # Safety
/// As [`nn_avx512`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn nn_avx512_chunks<const R: usize, const V: usize>(g: &Gemm, a: *const f32, mut b: impl Rows, c: *mut f32) {
    let alpha = _mm512_set1_ps(g.alpha);
    for j0 in (0..g.n).step_by(16 * V) {
        let width = (g.n - j0).min(16 * V);
        let masks: [__mmask16; V] = std::array::from_fn(|q| lanes(width.saturating_sub(16 * q)));
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        for p in 0..g.k {
            let brow = b.row(p).wrapping_add(j0);
            if j0 == 0 {
                b.prefetch(p + AHEAD, 1, g.n * 4);
            }
            // SAFETY: row `p < k` of `B`, the chunk's valid lanes; `(r, p)` inside `A`.
            unsafe {
                let mut v = [_mm512_setzero_ps(); V];
                for (q, v) in v.iter_mut().enumerate() {
                    if masks[q] != 0 {
                        *v = _mm512_maskz_loadu_ps(masks[q], brow.add(16 * q));
                    }
                }
                for (r, acc) in acc.iter_mut().enumerate() {
                    let w = _mm512_set1_ps(*a.add(r * g.lda + p));
                    for q in 0..V {
                        acc[q] = _mm512_fmadd_ps(w, v[q], acc[q]);
                    }
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (q, sum) in acc.iter().enumerate() {
                if masks[q] == 0 {
                    continue;
                }
                // SAFETY: the chunk's valid lanes of row `r` of `C`.
                unsafe {
                    let dst = c.add(r * g.ldc + j0 + 16 * q);
                    let old = if g.accumulate { _mm512_maskz_loadu_ps(masks[q], dst) } else { _mm512_setzero_ps() };
                    _mm512_mask_storeu_ps(dst, masks[q], _mm512_fmadd_ps(alpha, *sum, old));
                }
            }
        }
    }
}
