//! The portable path: kernels for the baseline target (SSE2 on x86-64, NEON on AArch64), with a
//! fused multiply-add only where the baseline has one ([`super::lanes::HAS_FMA`]). The dense
//! micro-tile is written on [`super::f4`]'s explicit 4-lane vector, and the softmax `exp` and
//! row maximum, `tanh`, the flash backward's rows and the additive scores are the kernels
//! written over [`super::vector::Vector`] instantiated on it; sigmoid and GELU are the lane
//! loops of [`super::lanes`]. It is also the reference the SIMD paths are compared with in
//! tests, besides the f64 oracle.

use super::f4::{self, micro};
use super::gemm::{Kernel, Layout, Tile, by_rows, pack_generic};

/// Micro-tiles of up to 6 rows × 8 columns: 12 accumulators of 128 bits and two panel vectors
/// take 14 of the 16 SSE registers (NEON has 32). `A` comes splatted into 4-lane groups: SSE2
/// has no broadcast load, and a shuffle per element of `A` (6 per 24 multiplies and adds) held
/// the loop at 68% of the multiply-add peak.
pub(super) struct Portable;

impl Kernel for Portable {
    const NR: usize = f4::NR;
    const MR: usize = 6;
    const KC: usize = 256;
    const NC: usize = 256;
    const A_SPLAT: usize = f4::W;

    unsafe fn pack(layout: Layout, b: *const f32, ldb: usize, kc: usize, nc: usize, out: *mut f32) {
        // SAFETY: forwarded.
        unsafe {
            match layout {
                Layout::Nt => f4::pack_nt(b, ldb, kc, nc, out),
                Layout::Nn => pack_generic::<{ f4::NR }>(layout, b, ldb, kc, nc, out),
            }
        }
    }

    unsafe fn tile(kc: usize, a: *const f32, _lda: usize, panel: *const f32, ldp: usize, t: &Tile) {
        // SAFETY: forwarded; `rows` selects the instance with that many rows.
        unsafe { by_rows!(t.rows, [6, 5, 4, 3, 2], _ => 1, micro(kc, a, panel, ldp, t)) }
    }
}
