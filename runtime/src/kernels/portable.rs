//! The portable path: the lane kernels of [`super::lanes`] compiled for the baseline target
//! (SSE2 on x86-64, NEON on AArch64), with a fused multiply-add only where the baseline has one
//! ([`HAS_FMA`]). It is also the reference the SIMD paths are compared with in tests, besides
//! the f64 oracle.

use super::gemm::{Kernel, Layout, Tile, pack_generic};
use super::lanes::{self, HAS_FMA};

/// Micro-tiles of up to 6 rows × 8 columns: 12 accumulators of 128 bits, two panel vectors and
/// a multiplier fill 15 of the 16 SSE registers (NEON has 32). `A` comes splatted into 4-lane
/// groups: SSE2 has no broadcast load, and a shuffle per element of `A` (6 per 24 multiplies
/// and adds) held the loop at 68% of the multiply-add peak.
pub(super) struct Portable;

impl Kernel for Portable {
    const NR: usize = lanes::L;
    const MR: usize = 6;
    const KC: usize = 256;
    const NC: usize = 256;
    const A_SPLAT: usize = lanes::SPLAT;

    unsafe fn pack(layout: Layout, b: *const f32, ldb: usize, kc: usize, nc: usize, out: *mut f32) {
        // SAFETY: forwarded.
        unsafe { pack_generic::<{ lanes::L }>(layout, b, ldb, kc, nc, out) }
    }

    unsafe fn tile(kc: usize, a: *const f32, _lda: usize, panel: *const f32, ldp: usize, t: &Tile) {
        // SAFETY: forwarded; `rows` selects the instance with that many rows.
        unsafe {
            match t.rows {
                6 => lanes::micro::<6, HAS_FMA>(kc, a, panel, ldp, t),
                5 => lanes::micro::<5, HAS_FMA>(kc, a, panel, ldp, t),
                4 => lanes::micro::<4, HAS_FMA>(kc, a, panel, ldp, t),
                3 => lanes::micro::<3, HAS_FMA>(kc, a, panel, ldp, t),
                2 => lanes::micro::<2, HAS_FMA>(kc, a, panel, ldp, t),
                _ => lanes::micro::<1, HAS_FMA>(kc, a, panel, ldp, t),
            }
        }
    }
}
