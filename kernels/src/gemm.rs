//! The GEMM driver shared by every path: cache blocking, packing of `B` into panels, and the
//! walk over micro-tiles. Each path supplies a [`Kernel`]: a register-blocked micro-tile
//! product of up to `MR` rows of `A` against one `kc × NR` panel of `B`.
//!
//! Loop nest (GotoBLAS order, adapted to row-major `C` with vectors along `n`):
//! `k` in blocks of `KC` → `n` in blocks of `NC` (pack that `B` block: `KC·NC` floats sized to
//! sit in L2) → rows of `A` in `≤ MR` blocks (the `mr × kc` strip stays in L1 while it meets
//! every panel) → panels. `A` is read in place: the attention tiles this serves have small `n`,
//! where packing `A` would cost as much as it saves (the microkernel runs at ~99% of peak on
//! unpacked rows when they are in L1).
//!
//! `B` is packed because `Nt` needs a transpose anyway, and because panels at a fixed stride
//! avoid cache-set conflicts when `ldb` is a large power of two. For a small `Nn` product
//! (`m ≤ 64`, `ldb ≤ 256`, e.g. `P·V` on one query block) full panels are read in place: the
//! copy is not amortised over enough row blocks there (measured ~5% of the call).

use super::Gemm;
#[cfg(target_arch = "x86_64")]
use super::Isa;
use std::cell::Cell;

/// How `B` is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// `B` is `n × k` (rows are keys): `C = A · Bᵀ`.
    Nt,
    /// `B` is `k × n`: `C = A · B`.
    Nn,
}

/// Where and how a micro-tile's result goes.
#[derive(Clone, Copy)]
pub(super) struct Tile {
    /// Top-left element of the tile in `C`.
    pub c: *mut f32,
    /// Row stride of `C`.
    pub ldc: usize,
    /// Rows in the tile (`1..=MR`).
    pub rows: usize,
    /// Valid columns (`1..=NR`); the panel is zero-padded past them.
    pub cols: usize,
    /// Scale of the product.
    pub alpha: f32,
    /// Add into `C` (else overwrite without reading it).
    pub accumulate: bool,
}

/// One instruction-set path's register-blocked micro-tile product and `B` packing.
pub(super) trait Kernel {
    /// Columns per packed panel (a whole number of vectors).
    const NR: usize;
    /// Most rows per micro-tile (accumulators: `MR · NR / lanes`).
    const MR: usize;
    /// Depth of a `k` block.
    const KC: usize = 512;
    /// Width of a packed `B` block (a multiple of `NR`): `KC · NC` floats = 1 MiB, half of L2.
    const NC: usize = 512;
    /// Copies of each `A` element in a packed strip, or 0 to read `A` in place. A path without
    /// a broadcast load (SSE2) packs each `rows × kc` strip once per `B` block as `kc` groups
    /// of `rows` vectors of `A_SPLAT` equal lanes (element `(i, p)` at
    /// `(p · rows + i) · A_SPLAT`), so its micro-tile loop multiplies by loaded vectors and
    /// spends no shuffle per element; [`Kernel::tile`] then gets the packed strip.
    const A_SPLAT: usize = 0;

    /// Packs the `kc × nc` block of `B` at `b` (element `(p, j)` at `b[j·ldb + p]` for `Nt`,
    /// `b[p·ldb + j]` for `Nn`) into `⌈nc/NR⌉` panels of `kc × NR`, zero past `nc`.
    ///
    /// # Safety
    /// `b` addresses the whole block; `out` has room for the panels.
    unsafe fn pack(layout: Layout, b: *const f32, ldb: usize, kc: usize, nc: usize, out: *mut f32);

    /// `tile (+)= alpha · A[rows × kc] · panel` with `A` rows at `a + i·lda` (or the packed
    /// strip of [`Kernel::A_SPLAT`], `lda` unused) and panel rows (`NR` floats each) at
    /// `panel + p·ldp`.
    ///
    /// # Safety
    /// `a`, `panel` and the tile of `C` are valid for the sizes given.
    unsafe fn tile(kc: usize, a: *const f32, lda: usize, panel: *const f32, ldp: usize, t: &Tile);
}

/// `$f::<R>$args` for the run-time row count `$rows` (`$f` a function in scope): each listed
/// count `R` has an instance of its own (a const generic, so that the accumulators stay in
/// registers), and any other count runs the one of `$other`.
macro_rules! by_rows {
    ($rows:expr, [$($r:literal),+], _ => $other:literal, $f:ident $args:tt) => {
        match $rows {
            $($r => $f::<$r> $args,)+
            _ => $f::<$other> $args,
        }
    };
}
pub(super) use by_rows;

/// Largest `m` for which an `Nn` product reads `B` in place (see the module docs).
const DIRECT_MAX_M: usize = 64;
/// Largest `ldb` for which an `Nn` product reads `B` in place: longer rows risk the set
/// conflicts packing avoids (measured 20% slower in place at `ldb = 4096`).
const DIRECT_MAX_LDB: usize = 256;

/// Runs `C (+)= alpha · A · op(B)` on `g.isa`.
///
/// # Safety
/// The pointers address what [`super::attnc_sgemm_nt`] documents, and `g.isa` is supported.
pub(super) unsafe fn run(g: &Gemm, layout: Layout, a: *const f32, b: *const f32, c: *mut f32) {
    if g.m == 0 || g.n == 0 {
        return;
    }
    if g.k == 0 {
        if !g.accumulate {
            for i in 0..g.m {
                // SAFETY: row `i` of `C` holds `n` elements.
                unsafe { std::ptr::write_bytes(c.add(i * g.ldc), 0, g.n) };
            }
        }
        return;
    }
    // SAFETY: forwarded; each arm runs only where `g.isa` is supported.
    unsafe {
        match g.isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => drive::<super::x86_avx512::Avx512>(g, layout, a, b, c),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => drive::<super::x86_avx2::Avx2>(g, layout, a, b, c),
            _ => drive::<super::portable::Portable>(g, layout, a, b, c),
        }
    }
}

/// The blocked loop nest for kernel `K` (non-empty shapes).
unsafe fn drive<K: Kernel>(g: &Gemm, layout: Layout, a: *const f32, b: *const f32, c: *mut f32) {
    let (m, n, k) = (g.m, g.n, g.k);
    let panel_len = K::KC.min(k) * K::NC.min(n).next_multiple_of(K::NR);
    // The splatted `A` strip follows the panels, 64-byte aligned.
    let strip_at = panel_len.next_multiple_of(16);
    let strip_len = if K::A_SPLAT > 0 { K::KC.min(k) * K::MR * K::A_SPLAT } else { 0 };
    with_scratch(strip_at + strip_len, |packed| {
        let strip = packed.wrapping_add(strip_at);
        let blocks = m.div_ceil(K::MR);
        for pc in (0..k).step_by(K::KC) {
            let kc = K::KC.min(k - pc);
            for jc in (0..n).step_by(K::NC) {
                let nc = K::NC.min(n - jc);
                let b_block = match layout {
                    Layout::Nt => b.wrapping_add(jc * g.ldb + pc),
                    Layout::Nn => b.wrapping_add(pc * g.ldb + jc),
                };
                // Columns `< full` are read in place; the rest are packed.
                let direct = layout == Layout::Nn && m <= DIRECT_MAX_M && g.ldb <= DIRECT_MAX_LDB;
                let full = if direct { nc / K::NR * K::NR } else { 0 };
                if full < nc {
                    // SAFETY: the block lies inside `B`; `packed` holds `kc · ⌈nc/NR⌉·NR` floats.
                    unsafe { K::pack(layout, b_block.wrapping_add(full), g.ldb, kc, nc - full, packed) };
                }
                // Row blocks as even as possible, so a tail never runs with few accumulators.
                let mut i0 = 0;
                for blk in 0..blocks {
                    let rows = (m - i0).div_ceil(blocks - blk);
                    let mut a_strip = a.wrapping_add(i0 * g.lda + pc);
                    if K::A_SPLAT > 0 {
                        // SAFETY: the strip lies inside `A`; `strip` holds `KC · MR · A_SPLAT`
                        // floats.
                        unsafe { splat_strip::<K>(a_strip, g.lda, rows, kc, strip) };
                        a_strip = strip;
                    }
                    for j0 in (0..nc).step_by(K::NR) {
                        let t = Tile {
                            c: c.wrapping_add(i0 * g.ldc + jc + j0),
                            ldc: g.ldc,
                            rows,
                            cols: K::NR.min(nc - j0),
                            alpha: g.alpha,
                            accumulate: g.accumulate || pc > 0,
                        };
                        let (panel, ldp) = if j0 < full {
                            (b_block.wrapping_add(j0), g.ldb)
                        } else {
                            (packed.wrapping_add((j0 - full) * kc) as *const f32, K::NR)
                        };
                        // SAFETY: the strip, the panel and the tile are in bounds.
                        unsafe { K::tile(kc, a_strip, g.lda, panel, ldp, &t) };
                    }
                    i0 += rows;
                }
            }
        }
    });
}

/// Packs the `rows × kc` strip of `A` at `a` (row stride `lda`) as [`Kernel::A_SPLAT`]
/// describes.
///
/// # Safety
/// `a` addresses the strip; `out` holds `kc · rows · K::A_SPLAT` floats.
#[inline(always)]
unsafe fn splat_strip<K: Kernel>(a: *const f32, lda: usize, rows: usize, kc: usize, out: *mut f32) {
    // The driver's even row blocks have `MR` or `MR - 1` rows (fewer only when `m < MR`): a
    // constant row count makes every store's offset a constant (with the count and the
    // addresses computed per element the splat took 1.9 cycles per element; see
    // docs/performance.md).
    // SAFETY (whole function): forwarded.
    unsafe {
        match rows {
            6 => splat_rows::<K, 6>(a, lda, rows, kc, out),
            5 => splat_rows::<K, 5>(a, lda, rows, kc, out),
            4 => splat_rows::<K, 4>(a, lda, rows, kc, out),
            _ => splat_rows::<K, 0>(a, lda, rows, kc, out),
        }
    }
}

/// [`splat_strip`] for `R` rows (`R = 0`: `rows`, known only at run time).
///
/// # Safety
/// As [`splat_strip`]; `R` is 0 or `rows`.
#[inline(always)]
unsafe fn splat_rows<K: Kernel, const R: usize>(a: *const f32, lda: usize, rows: usize, kc: usize, out: *mut f32) {
    // `f4::splat4` makes groups of 4 copies.
    const { assert!(K::A_SPLAT == 0 || K::A_SPLAT == 4) };
    let rows = if R > 0 { R } else { rows };
    // Four columns of a row per pass, each splatted to its group.
    let full = kc / 4 * 4;
    for p0 in (0..full).step_by(4) {
        // SAFETY: the caller's contract covers columns `p0..p0 + 4` of every row and the four
        // groups from `p0`.
        let (src, base) = unsafe { (a.add(p0), out.add(p0 * rows * K::A_SPLAT)) };
        for i in 0..rows {
            // SAFETY: as above, for row `i`.
            unsafe { super::f4::splat4(src.add(i * lda), |q| base.add((q * rows + i) * K::A_SPLAT)) };
        }
    }
    for p in full..kc {
        for i in 0..rows {
            // SAFETY: as above, for column `p`.
            unsafe {
                let v = *a.add(i * lda + p);
                let dst = out.add((p * rows + i) * K::A_SPLAT);
                for l in 0..K::A_SPLAT {
                    *dst.add(l) = v;
                }
            }
        }
    }
}

thread_local! {
    /// Per-thread packing buffer, reused across calls: attention calls the kernels once per
    /// tile, so allocating per call would cost more than small tiles take to multiply.
    static SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Runs `f` on a 64-byte aligned scratch area of `len` floats (contents unspecified).
fn with_scratch(len: usize, f: impl FnOnce(*mut f32)) {
    // `take` leaves an empty Vec behind, so a re-entrant call (none today) would just allocate.
    let mut buf = SCRATCH.try_with(Cell::take).unwrap_or_default();
    if buf.len() < len + 16 {
        buf = vec![0.0; len + 16];
    }
    let offset = buf.as_ptr().align_offset(64).min(16);
    f(buf[offset..].as_mut_ptr());
    // Fails only while the thread is being torn down; the buffer is then simply dropped.
    let _ = SCRATCH.try_with(|s| s.set(buf));
}

/// Plain-Rust packing, shared by the paths that have no faster one for a layout. Inlined into
/// each path's `#[target_feature]` wrapper so the copies vectorise for that path.
///
/// # Safety
/// As [`Kernel::pack`].
#[inline(always)]
pub(super) unsafe fn pack_generic<const NR: usize>(layout: Layout, b: *const f32, ldb: usize, kc: usize, nc: usize, out: *mut f32) {
    for (jr, j0) in (0..nc).step_by(NR).enumerate() {
        let cols = NR.min(nc - j0);
        // SAFETY: the caller's contract covers the block and `out`.
        unsafe {
            let panel = out.add(jr * kc * NR);
            match layout {
                Layout::Nn => {
                    for p in 0..kc {
                        let (src, dst) = (b.add(p * ldb + j0), panel.add(p * NR));
                        if cols == NR {
                            *(dst as *mut [f32; NR]) = *(src as *const [f32; NR]);
                        } else {
                            std::ptr::copy_nonoverlapping(src, dst, cols);
                            std::ptr::write_bytes(dst.add(cols), 0, NR - cols);
                        }
                    }
                }
                Layout::Nt => {
                    for jj in 0..NR {
                        if jj < cols {
                            let src = b.add((j0 + jj) * ldb);
                            for p in 0..kc {
                                *panel.add(p * NR + jj) = *src.add(p);
                            }
                        } else {
                            for p in 0..kc {
                                *panel.add(p * NR + jj) = 0.0;
                            }
                        }
                    }
                }
            }
        }
    }
}
