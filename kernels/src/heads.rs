//! The few-rows products of a group of heads against a paged KV cache, walked in the order the
//! cache lies in memory: decode against a paged cache reads, page after page, every head's rows
//! of the page together, where one head at a time would read a scattered slice of each page
//! (8 KiB per page and head in FlashInfer's HND layout, 512-byte rows 16 KiB apart in vLLM's
//! NHD one), which the hardware prefetchers cannot follow.
//!
//! Within a page the walk takes one step per (row, head): `Nt` writes that head's scores for
//! the row, `Nn` adds the row, weighted, into that head's rows of `C` (which stay in L1). Where a
//! head's rows lie together (HND), the heads go outer and the rows inner, so each page is read
//! front to back. Where the heads lie inside each row (NHD: a row of every head, then the next
//! row), the heads go in blocks covering about 4 KiB of a row ([`BLOCK_BYTES`]): per block the
//! rows outer and its heads inner, so each row is read in 4 KiB runs. Prefetches run ahead in the
//! same order: [`NEAR_BYTES`] of rows on into L1, and the same row two pages on (through the
//! table) into L2.
//!
//! Measured (`attnc bench examples/paged_decode.attn`, H=32, D=128, 32768 keys in pages of 16,
//! Zen 4, rounds interleaved): NHD with 4 KiB blocks 48.6 ms on one thread against 61.5 ms for
//! the heads outer one at a time, and 47.6–51.0 ms for 2–16 KiB blocks; the rows outer and all
//! heads inner (the page's own order) 56.6 against 52.8 heads outer. The prefetch distances,
//! 2 KiB into L1 and two pages into L2, were within 5% of 8 KiB and four pages.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::Isa;
use super::gemm::Layout;
use super::gemv::{INTO_L1, INTO_L2, PageAt, PagedRows, dot8, page_of, prefetch_lines};

/// The heads of a grouped product: head `h` takes `A`'s rows from `a + h·a_stride`, `B`'s rows
/// from the pages at `h·b_stride` on (elements), and writes `C`'s rows from `c + h·c_stride`.
/// The layout generated code fills for [`super::attnc_gemv_nt_paged_heads`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HeadGroup {
    /// Heads in the group.
    pub heads: usize,
    /// Elements from one head's rows of `A` to the next's.
    pub a_stride: usize,
    /// Elements from one head's rows of `B` to the next's, inside each page.
    pub b_stride: usize,
    /// Elements from one head's rows of `C` to the next's.
    pub c_stride: usize,
}

/// The shape of a grouped product, per head: `C[m×n] (+)= alpha · A[m×k] · op(B)`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldc: usize,
    pub alpha: f32,
    pub accumulate: bool,
}

/// Runs a grouped product on `isa`: for every head, `C_h (+)= alpha · A_h · op(B_h)` with
/// `B_h`'s rows (the keys `first..first + n` for `Nt`, `first..first + k` for `Nn`) read through
/// the table.
///
/// # Safety
/// `d` as [`super::attnc_gemv_nt_paged`] says, with its rows inside the table; every head's
/// rows (at `h·b_stride` from each page's) inside its page; `A_h` and `C_h` as
/// [`super::attnc_gemv_nt`] says for each head, `C` not overlapping `A` or `B`.
pub(super) unsafe fn run(isa: Isa, layout: Layout, s: &Shape, a: *const f32, d: &PagedRows, g: &HeadGroup, c: *mut f32) {
    if s.m == 0 || g.heads == 0 {
        return;
    }
    // SAFETY: forwarded; each path runs only where `isa` says the CPU has it.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => walk_avx512(layout, s, a, d, g, c),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => walk_avx2(layout, s, a, d, g, c),
            _ => walk::<Plain>(layout, s, a, d, g, c),
        }
    }
}

/// The arithmetic of one step.
trait Ops {
    /// `Σ x[i]·y[i]` over `k` elements.
    unsafe fn dot(x: *const f32, y: *const f32, k: usize) -> f32;
    /// `c[i] += w·x[i]` over `n` elements.
    unsafe fn axpy(w: f32, x: *const f32, c: *mut f32, n: usize);
}

/// Plain Rust: the dot product in eight interleaved partial sums ([`dot8`]; vectorised by the compiler for the target, or
/// for AVX2 inside [`walk_avx2`]).
struct Plain;

impl Ops for Plain {
    #[inline(always)]
    unsafe fn dot(x: *const f32, y: *const f32, k: usize) -> f32 {
        // SAFETY: the caller's `k` elements each.
        unsafe { dot8(std::slice::from_raw_parts(x, k), std::slice::from_raw_parts(y, k)) }
    }

    #[inline(always)]
    unsafe fn axpy(w: f32, x: *const f32, c: *mut f32, n: usize) {
        // SAFETY: the caller's `n` elements each, not overlapping.
        let (x, c) = unsafe { (std::slice::from_raw_parts(x, n), std::slice::from_raw_parts_mut(c, n)) };
        for (c, x) in c.iter_mut().zip(x) {
            *c += w * x;
        }
    }
}

/// AVX-512: two chains of 16 lanes, masked tails.
#[cfg(target_arch = "x86_64")]
struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Ops for Avx512 {
    #[inline(always)]
    unsafe fn dot(x: *const f32, y: *const f32, k: usize) -> f32 {
        use super::x86_avx512::lanes;
        // SAFETY: the caller's `k` elements each; the masked loads read only those; the caller
        // runs inside an `avx512f` function.
        unsafe {
            let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let mut p = 0;
            while p + 32 <= k {
                s0 = _mm512_fmadd_ps(_mm512_loadu_ps(x.add(p)), _mm512_loadu_ps(y.add(p)), s0);
                s1 = _mm512_fmadd_ps(_mm512_loadu_ps(x.add(p + 16)), _mm512_loadu_ps(y.add(p + 16)), s1);
                p += 32;
            }
            while p < k {
                let m = lanes(k - p);
                s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x.add(p)), _mm512_maskz_loadu_ps(m, y.add(p)), s0);
                p += 16;
            }
            _mm512_reduce_add_ps(_mm512_add_ps(s0, s1))
        }
    }

    #[inline(always)]
    unsafe fn axpy(w: f32, x: *const f32, c: *mut f32, n: usize) {
        use super::x86_avx512::lanes;
        // SAFETY: as `dot`.
        unsafe {
            let w = _mm512_set1_ps(w);
            let mut p = 0;
            while p < n {
                let m = lanes(n - p);
                let y = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, x.add(p)), _mm512_maskz_loadu_ps(m, c.add(p)));
                _mm512_mask_storeu_ps(c.add(p), m, y);
                p += 16;
            }
        }
    }
}

/// [`walk`] on AVX-512.
///
/// # Safety
/// As [`run`], on a CPU with AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn walk_avx512(layout: Layout, s: &Shape, a: *const f32, d: &PagedRows, g: &HeadGroup, c: *mut f32) {
    // SAFETY: forwarded.
    unsafe { walk::<Avx512>(layout, s, a, d, g, c) }
}

/// [`walk`] with [`Plain`] compiled for AVX2 and FMA.
///
/// # Safety
/// As [`run`], on a CPU with AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn walk_avx2(layout: Layout, s: &Shape, a: *const f32, d: &PagedRows, g: &HeadGroup, c: *mut f32) {
    // SAFETY: forwarded.
    unsafe { walk::<Plain>(layout, s, a, d, g, c) }
}

/// Bytes ahead, in the walk's order, of the `T0` prefetches (4 rows of a head of width 128).
const NEAR_BYTES: usize = 2048;

/// Bytes of each row that a block of heads covers when a page's heads lie inside its rows (one
/// 4 KiB memory page: the hardware prefetchers' reach).
const BLOCK_BYTES: usize = 4096;

/// Keys ahead (two pages, at least this many) that the `T1` prefetches run.
const FAR_KEYS: usize = 32;

/// The walk: page by page through the table, the group's rows of each page in memory order,
/// one step per (row, head).
///
/// # Safety
/// As [`run`].
#[inline(always)]
unsafe fn walk<O: Ops>(layout: Layout, s: &Shape, a: *const f32, d: &PagedRows, g: &HeadGroup, c: *mut f32) {
    let nt = layout == Layout::Nt;
    let keys = if nt { s.n } else { s.k };
    if !nt && !s.accumulate {
        for h in 0..g.heads {
            for r in 0..s.m {
                // SAFETY: row `r` of `C_h` holds `n` elements.
                unsafe { std::ptr::write_bytes(c.add(h * g.c_stride + r * s.ldc), 0, s.n) };
            }
        }
    }
    let page = d.page.max(1);
    let width = if nt { s.k } else { s.n };
    let w = Walk {
        d,
        s,
        a,
        c,
        g,
        b_row: d.row_stride,
        near: (NEAR_BYTES / (width * 4).max(1)).max(1),
        width,
        first: d.first,
        far_keys: (2 * page).max(FAR_KEYS),
        nt,
    };
    let mut far = PageAt::NONE;
    // Heads whose rows of a page lie closer together than its rows (NHD): blocks of them
    // covering about 4 KiB of each row.
    let block = if g.b_stride < d.row_stride { (BLOCK_BYTES / (width * 4).max(1)).max(1) } else { 1 };
    let end = d.first + keys;
    let mut t0 = d.first;
    while t0 < end {
        let Some((lo, start)) = page_of(d, t0) else { return };
        let t1 = (lo + page).min(end);
        let at = (start, lo);
        // SAFETY: forwarded: keys `t0..t1` are inside the table and this page.
        unsafe {
            let mut h0 = 0;
            while h0 < g.heads {
                let hb = block.min(g.heads - h0);
                // The step `near` on in this block's order (rows outer, its heads inner): `dt`
                // rows and `dh` heads on, carrying a head past the block into the next row.
                let (dt, dh) = (w.near / hb, w.near % hb);
                for t in t0..t1 {
                    for h in h0..h0 + hb {
                        let (h2, t2) = if h - h0 + dh >= hb { (h + dh - hb, t + dt + 1) } else { (h + dh, t + dt) };
                        w.step::<O>(at, (h, t), (t2 < t1).then_some((h2, t2)), &mut far);
                    }
                }
                h0 += hb;
            }
        }
        t0 = t1;
    }
}

/// What every step of a walk reads.
struct Walk<'s> {
    d: &'s PagedRows,
    s: &'s Shape,
    a: *const f32,
    c: *mut f32,
    g: &'s HeadGroup,
    /// Elements between the rows of a page.
    b_row: usize,
    /// Steps ahead of the `T0` prefetches ([`NEAR_BYTES`] of rows).
    near: usize,
    /// Elements of a row of `B`.
    width: usize,
    /// The key of `B`'s row 0.
    first: usize,
    /// Keys ahead of the `T1` prefetches.
    far_keys: usize,
    nt: bool,
}

impl Walk<'_> {
    /// One step: head `h`'s row for key `t` of the page at `(start, lo)` (its head 0's row 0 and
    /// first key), prefetching head and key `near` (the step [`Walk::near`] on, when it is in
    /// this page) into L1.
    ///
    /// # Safety
    /// As [`run`], key `t` inside the table and the page.
    #[inline(always)]
    unsafe fn step<O: Ops>(
        &self,
        (start, lo): (*const f32, usize),
        (h, t): (usize, usize),
        near: Option<(usize, usize)>,
        far: &mut PageAt,
    ) {
        let (s, g) = (self.s, self.g);
        let at = |h: usize, t: usize| start.wrapping_add((t - lo) * self.b_row + h * g.b_stride);
        let row = at(h, t);
        let row_bytes = self.width * 4;
        if let Some((h2, t2)) = near {
            prefetch_lines::<INTO_L1>(at(h2, t2), row_bytes);
        }
        let tf = t + self.far_keys;
        if far.seek(self.d, tf).is_some() {
            prefetch_lines::<INTO_L2>(far.row(self.d, tf).wrapping_add(h * g.b_stride), row_bytes);
        }
        let j = t - self.first;
        let (ah, ch) = (self.a.wrapping_add(h * g.a_stride), self.c.wrapping_add(h * g.c_stride));
        for r in 0..s.m {
            // SAFETY: the caller's contract: key `t`'s row of head `h` holds `width` elements;
            // rows `r < m` of `A_h` and `C_h` are inside them, `j` inside `C_h`'s `n` columns
            // (`Nt`) or `A_h`'s `k` (`Nn`).
            unsafe {
                if self.nt {
                    let sum = s.alpha * O::dot(ah.add(r * s.lda), row, self.width);
                    let out = ch.add(r * s.ldc + j);
                    *out = if s.accumulate { sum + *out } else { sum };
                } else {
                    O::axpy(s.alpha * *ah.add(r * s.lda + j), row, ch.add(r * s.ldc), self.width);
                }
            }
        }
    }
}
