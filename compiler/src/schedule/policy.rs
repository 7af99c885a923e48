//! Per-target choices, in one place: which kernel variant computes a matrix product or a flash
//! op, how a step's work splits into work items, and the block sizes of the tiled kernels. The
//! schedule records the variants ([`Variant`]); [`super::prepare()`] applies the rest per run
//! shape. Every choice is a function of the shape and the target only (never of the thread
//! count), so results are identical for any number of threads.
//!
//! What one work item is, per kernel:
//!
//! | kernel | CPU | CUDA |
//! |---|---|---|
//! | element-wise | a row (all axes but the last) | [`CUDA_ELEMENTS`] consecutive elements, one per thread |
//! | matmul | `MatMulRows` rows of `C` of one batch index | a [`CUDA_MATMUL_TILE`]² tile of `C` |
//! | reduce | one output element | one output element (a warp) |
//! | softmax, norm | one row | one row (a warp) |
//! | flash | (batch index, query block, key split) | the same |
//! | flash merge | (batch index, query block) | the same |

use super::{Kernel, Tuning};
use crate::ir::DType;

/// Which kind of machine a schedule is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// Native code through Cranelift plus the dense microkernels.
    Cpu,
    /// CUDA kernels for NVIDIA GPUs.
    Cuda,
}

impl Target {
    /// The target's name (as `--target` spells it).
    pub fn name(self) -> &'static str {
        match self {
            Target::Cpu => "cpu",
            Target::Cuda => "cuda",
        }
    }
}

/// How a target computes a tiled kernel (matmul, flash).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// The CPU's tiles on the SGEMM microkernels (few-row products for decode shapes).
    Tiled,
    /// CUDA f32 SIMT kernels (any storage types).
    Simt,
    /// CUDA tensor cores (`mma.sync.m16n8k16`, f32 accumulation): f16 or bf16 operands.
    TensorCore,
    /// CUDA split-KV decode: warps split the keys of a few query rows; a merge combines them.
    SplitKv,
}

impl Variant {
    /// The variant's name in listings.
    pub fn name(self) -> &'static str {
        match self {
            Variant::Tiled => "tiled",
            Variant::Simt => "simt",
            Variant::TensorCore => "tensor-core",
            Variant::SplitKv => "split-kv",
        }
    }
}

/// The vector extension the CPU kernels use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpuIsa {
    /// 512-bit vectors.
    Avx512,
    /// 256-bit vectors with FMA.
    Avx2,
    /// Plain Rust for any target.
    Portable,
}

/// The CPU's block policy. The overrides are tuning knobs (`ATTNC_FLASH_BLOCKS`,
/// `ATTNC_MATMUL_ROWS`, read by the runtime); every choice computes the same result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuPolicy {
    /// The kernels' ISA.
    pub isa: CpuIsa,
    /// Query rows and keys per flash tile for prefill shapes, instead of the defaults.
    pub flash_blocks: Option<(i64, i64)>,
    /// Rows per matmul work item, instead of the default.
    pub matmul_rows: Option<i64>,
    /// Query rows per tile and keys per block of the flash backward, instead of the defaults.
    pub flash_bwd_blocks: Option<(i64, i64)>,
    /// Heads a paged decode's work item walks together, where it may group them, instead of
    /// [`CpuPolicy::flash_head_group`]'s choice (1: one head per item).
    pub head_group: Option<i64>,
}

impl Default for CpuPolicy {
    fn default() -> CpuPolicy {
        CpuPolicy { isa: CpuIsa::Avx512, flash_blocks: None, matmul_rows: None, flash_bwd_blocks: None, head_group: None }
    }
}

/// The CUDA device's limits that choices depend on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaPolicy {
    /// Streaming multiprocessors (sizes the split-KV count).
    pub sm_count: u32,
    /// Largest dynamic shared memory one block may use, in bytes.
    pub max_smem_per_block: u32,
    /// Query rows per block of the tensor-core flash kernel (64 or 128), instead of
    /// [`CudaPolicy::mma_row_tiles`]'s choice: a tuning knob (`ATTNC_CUDA_MMA_ROWS`, read by the
    /// runtime); every choice computes the same result.
    pub mma_rows: Option<i64>,
    /// Every flash backward on the SIMT kernel, tensor cores or not: a knob for comparing the
    /// two (`ATTNC_CUDA_BWD=simt`, read by the runtime); both compute the same gradients up to
    /// rounding.
    pub simt_backward: bool,
    /// The tensor-core flash backward in its deterministic mode: `dQ` from query items of its
    /// own (two more products per tile pair), so that every sum runs in a fixed order and two
    /// runs give the same bits. Off: the key items add `dQ` atomically ([`Policy::flash_bwd_atomic_dq`]).
    /// `ATTNC_CUDA_BWD=deterministic`, read by the runtime.
    pub deterministic_backward: bool,
    /// The kernels are compiled with Hopper's warpgroup products (`sm_90a`), so the tensor-core
    /// flash forward can take K/V stages of its own ([`CudaPolicy::mma_kv_stages`]).
    pub wgmma: bool,
    /// K/V stages of the tensor-core flash forward on Hopper (1 or 2), instead of
    /// [`CudaPolicy::mma_kv_stages`]'s choice: a knob for comparing (`ATTNC_CUDA_KV_STAGES`,
    /// read by the runtime); every choice computes the same result.
    pub kv_stages: Option<i64>,
    /// Where Hopper's two K/V stages run ([`CudaPolicy::mma_kv_stages`] is 2), the flash
    /// forward's block is warp-specialised ([`CudaPolicy::mma_warp_specialized`]): off, the
    /// one-warpgroup staged kernel instead. A knob for comparing (`ATTNC_CUDA_WS=0`, read by
    /// the runtime); both compute the same result.
    pub warp_specialize: bool,
    /// The warp-specialised block's producer loads K/V tiles by TMA (`cp.async.bulk.tensor`
    /// from a tensor map the launch encodes, [`super::TmaMap`]) where the views allow
    /// ([`super::tma_map`]): one thread issues a tile's copies, the swizzle is done in
    /// hardware. Off: its threads' `cp.async` copies. A knob for comparing (`ATTNC_CUDA_TMA=0`,
    /// read by the runtime); both compute the same result.
    pub tma: bool,
}

impl Default for CudaPolicy {
    /// An A100-like device (108 SMs, 163 KiB of shared memory per block).
    fn default() -> CudaPolicy {
        CudaPolicy {
            sm_count: 108,
            max_smem_per_block: 166_912,
            mma_rows: None,
            simt_backward: false,
            deterministic_backward: false,
            wgmma: false,
            kv_stages: None,
            warp_specialize: true,
            tma: true,
        }
    }
}

/// A target and its block policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// The CPU.
    Cpu(CpuPolicy),
    /// A CUDA GPU.
    Cuda(CudaPolicy),
}

impl Default for Policy {
    fn default() -> Policy {
        Policy::Cpu(CpuPolicy::default())
    }
}

impl Policy {
    /// The target.
    pub fn target(&self) -> Target {
        match self {
            Policy::Cpu(_) => Target::Cpu,
            Policy::Cuda(_) => Target::Cuda,
        }
    }

    /// The variant of a matrix product of operands of these dtypes.
    pub fn matmul_variant(&self, a: DType, b: DType) -> Variant {
        match self {
            Policy::Cpu(_) => Variant::Tiled,
            Policy::Cuda(_) if a == b && matches!(a, DType::F16 | DType::BF16) => Variant::TensorCore,
            Policy::Cuda(_) => Variant::Simt,
        }
    }

    /// The variant of a flash op with q, k, v of these dtypes and `rows` query rows when that is
    /// a constant. Additive scores (`dot` false) run on the SIMT kernel on CUDA: they are sums
    /// of `tanh`, not products for the tensor cores.
    pub fn flash_variant(&self, dtypes: [DType; 3], rows: Option<i64>, dot: bool) -> Variant {
        match self {
            Policy::Cpu(_) => Variant::Tiled,
            Policy::Cuda(_) if !dot => Variant::Simt,
            Policy::Cuda(_) if rows.is_some_and(|m| (1..=CUDA_DECODE_MAX_ROWS).contains(&m)) => Variant::SplitKv,
            Policy::Cuda(_) if dtypes.iter().all(|d| *d == dtypes[0]) && matches!(dtypes[0], DType::F16 | DType::BF16) => {
                Variant::TensorCore
            }
            Policy::Cuda(_) => Variant::Simt,
        }
    }

    /// The variant of a flash backward: the CPU's tiles; on CUDA tensor cores for dot-product
    /// scores whose `q`, `k` and `v` share f16 or bf16, whose `d_out` (`dtypes[3]`) has their
    /// type or f32 (an f32 bias widens the op's result); else the SIMT kernel. Extra operands'
    /// gradients that are one sum per work item (ALiBi's slopes) run on tensor cores in both
    /// modes; ones scattered over their operand (`scattered_grads`: a bias table's, by relative
    /// position) only in the default mode, where each key item adds them atomically into its
    /// partial sums (the deterministic mode keeps the SIMT kernel's ordered additions).
    pub fn flash_bwd_variant(&self, dtypes: [DType; 4], dot: bool, scattered_grads: bool) -> Variant {
        match self {
            Policy::Cpu(_) => Variant::Tiled,
            Policy::Cuda(c)
                if !c.simt_backward
                    && dot
                    && !(scattered_grads && c.deterministic_backward)
                    && dtypes[..3].iter().all(|d| *d == dtypes[0])
                    && matches!(dtypes[0], DType::F16 | DType::BF16)
                    && (dtypes[3] == dtypes[0] || dtypes[3] == DType::F32) =>
            {
                Variant::TensorCore
            }
            Policy::Cuda(_) => Variant::Simt,
        }
    }

    /// Whether a flash backward of `variant` sums `dQ` by atomic adds from its key items into
    /// an f32 buffer ([`FlashBwdKernel::dq_accum`](super::FlashBwdKernel::dq_accum)): on CUDA's
    /// tensor-core kernel unless the deterministic mode is asked for. Five products per tile
    /// pair instead of seven, at the price of a summation order that varies from run to run.
    pub fn flash_bwd_atomic_dq(&self, variant: Variant) -> bool {
        matches!(self, Policy::Cuda(c) if !c.deterministic_backward && variant == Variant::TensorCore)
    }

    /// Whether a flash backward's rows' `delta` is a reduction step of its own before the
    /// backward ([`FlashBwdKernel::delta`](super::FlashBwdKernel::delta)): on CUDA, where each
    /// key-chunk item visits every query row (forming it there costs a pass over `d_out` and
    /// `out` per key chunk); the CPU's items visit each row once.
    pub fn flash_bwd_delta(&self) -> bool {
        matches!(self, Policy::Cuda(_))
    }

    /// Whether the flash kernels read K and V from a paged cache in place, through its block
    /// table ([`crate::ir::Op::Paged`]); where not, the pages are gathered into a dense copy
    /// first. Both targets do; kept as a policy so that a target without it stays correct.
    pub fn paged_in_place(&self) -> bool {
        matches!(self, Policy::Cpu(_) | Policy::Cuda(_))
    }

    /// The tuning values a step of `kernel` reads (besides `Items`, which every step has): a
    /// flash step's blocks and splits on every target, and on the CPU also its per-thread
    /// scratch layout.
    pub fn tunings(&self, kernel: &Kernel) -> Vec<Tuning> {
        use Tuning::*;
        match (self, kernel) {
            (Policy::Cpu(_), Kernel::MatMul { .. }) => vec![MatMulRows],
            (_, Kernel::Flash(f)) => {
                let mut t = vec![BlockM, BlockN, Splits, KeysPerSplit, QueryBlocks, KeyBlocks, TileEntryBytes];
                if let Policy::Cpu(_) = self {
                    t.extend([ScratchAcc, ScratchMax, ScratchSum, ScratchBias, TileBatchDiv]);
                    if f.paged() {
                        t.extend([ScratchKv, HeadGroup]);
                    }
                } else {
                    t.push(TileBatchDiv);
                }
                t
            }
            (_, Kernel::FlashBwd(_)) => {
                let mut t = vec![BlockM, BlockN, QueryBlocks, KeyBlocks, TileEntryBytes];
                if let Policy::Cpu(_) = self {
                    t.extend([
                        ScratchGradS,
                        ScratchGradQ,
                        ScratchGradK,
                        ScratchGradV,
                        ScratchKeysT,
                        ScratchGradRow,
                        RowStride,
                        TileBatchDiv,
                    ]);
                } else {
                    t.push(TileBatchDiv);
                }
                t
            }
            _ => Vec::new(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The CPU's block sizes

/// Fewest work items (batch × query blocks) the large unmasked flash blocks must leave, so that
/// up to this many threads stay busy.
pub const MIN_ITEMS: i64 = 8;

/// Query rows per flash work item up to which the CPU's flash kernel runs the few-rows products
/// (decode), which stream K and V in place instead of packing them.
pub const CPU_FEW_ROWS: i64 = 4;

/// Scratch rows (heads × query rows) a grouped paged work item keeps at most
/// ([`CpuPolicy::flash_head_group`]): 64 rows of a 256-key tile are 64 KiB of scores.
pub const CPU_GROUP_ROWS: i64 = 64;

/// Keys per split for decode-like shapes (few query rows): splitting lets every thread work on
/// one head's long key range, and the merge is cheap.
pub const CPU_SPLIT_KEYS: i64 = 2048;

impl CpuPolicy {
    /// Query rows per flash work item and keys per tile. Without a mask, large tiles amortise
    /// the per-row softmax bookkeeping and the packing of each K tile (once per query block):
    /// 512-row blocks ran 5–8% faster than 128-row ones at S = 1024–4096 (`attnc bench
    /// examples/sdpa.attn`, D = 64 and 128, 1 and 2 threads, AVX-512), so they are used wherever
    /// they still leave at least [`MIN_ITEMS`] work items. With a mask, small tiles skip more of
    /// the masked area. Decode shapes (few query rows) take every row at once and long key tiles.
    /// On the AVX2 path (AMD EPYC Zen 3, 512 KiB L2) 512×256, 256×256, 128×256, 256×128 and
    /// 512×128 measured within noise of each other (best of 3 interleaved sweeps, sdpa D = 64
    /// and 128, S = 1024), so every path uses this one table; the per-path cache blocks of the
    /// products live with the kernels (`KC`, `NC`).
    pub fn flash_blocks(&self, m: i64, batch: i64, masked: bool) -> (i64, i64) {
        if m <= 16 {
            return (m.max(1), 256);
        }
        // Key tiles stay within what a chunk's key extent (one byte) can describe.
        let forced = self.flash_blocks.map(|(a, b)| (a.max(1), b.clamp(1, 255 * super::tile_table::CHUNK_COLS)));
        let items = |bm: i64| batch.saturating_mul((m + bm - 1) / bm);
        forced.unwrap_or(if masked {
            // Long masked rows: fewer K packs outweigh the larger diagonal tiles (7% at S = 4096,
            // D = 128; even at S = 2048, worse at 1024).
            if m >= 4096 && items(256) >= MIN_ITEMS { (256, 256) } else { (128, 128) }
        } else if m >= 512 && items(512) >= MIN_ITEMS {
            (512, 256)
        } else if m >= 128 {
            (128, 256)
        } else {
            (64, 256)
        })
    }

    /// Heads a work item of a flash step over a paged K and V walks together, page by page
    /// (`attnc_gemv_*_paged_heads`): every head's rows of a page are read together, in the
    /// order they lie in memory, where one head per item reads a scattered slice of each page.
    /// `bm` query rows per item in `nqb` blocks, `items` work items with one head each, the
    /// last batch axis of `last` heads. Grouped only for decode (one block of at most
    /// [`CPU_FEW_ROWS`] rows) and while at least [`MIN_ITEMS`] items are left: the group halves
    /// until they are. 1: one head per item. `ATTNC_HEAD_GROUP` forces a size (clamped).
    pub fn flash_head_group(&self, bm: i64, nqb: i64, items: i64, last: i64) -> i64 {
        if nqb != 1 || bm > CPU_FEW_ROWS || last < 2 {
            return 1;
        }
        if let Some(g) = self.head_group {
            return g.clamp(1, last.min(CPU_GROUP_ROWS / bm.max(1)).max(1));
        }
        let mut g = last.min(CPU_GROUP_ROWS / bm.max(1));
        while g > 1 && items / last * ((last + g - 1) / g) < MIN_ITEMS {
            g = (g + 1) / 2;
        }
        g.max(1)
    }

    /// Query rows per tile and keys per block of a flash backward. Key blocks are the outer
    /// loop: per key block one product each runs over the span of live query rows, so the key
    /// block is the row count of four of the five products (and of the scratch rows of `Pᵀ`
    /// and `dSᵀ`); query tiles only set how finely the mask is classified. Measured on the
    /// AVX-512 path (Zen 5, `attnc bench --grad`, interleaved, D = 128, S = 4096): 64 keys
    /// within noise of 48 and ahead of 96 and 128 (2–4%).
    pub fn flash_bwd_blocks(&self, m: i64, n: i64) -> (i64, i64) {
        let (bm, bn) = self.flash_bwd_blocks.unwrap_or((64, 64));
        (bm.clamp(1, m.max(1)), bn.clamp(1, (255 * super::tile_table::CHUNK_COLS).min(n.max(1))))
    }

    /// Key splits for `m` query rows over `n` keys.
    pub fn flash_splits(&self, m: i64, n: i64) -> i64 {
        if m <= 16 && n >= 2 * CPU_SPLIT_KEYS { (n + CPU_SPLIT_KEYS - 1) / CPU_SPLIT_KEYS } else { 1 }
    }

    /// Rows of C per matmul work item: half of the rows (two items per matrix, or more across a
    /// batch) but at least 64 and at most 512, so that `B`, which the microkernel packs per call,
    /// is packed a few times rather than once per 64 rows (512-row items made
    /// `transformer_block.attn` at S = 1024 7–8% faster than 256-row ones on 1 and 2 threads).
    pub fn matmul_rows(&self, m: i64) -> i64 {
        self.matmul_rows.unwrap_or(((m + 1) / 2).clamp(64, 512)).clamp(1, m.max(1))
    }
}

// ---------------------------------------------------------------------------------------------
// The CUDA kernels' shapes. The CUDA renderer builds its kernels around these numbers and
// `prepare` sizes launches, work items and tile tables with them.

/// Threads per block of every CUDA kernel except the flash ones.
pub const CUDA_THREADS: u32 = 256;
/// The most leading places of an argsort (`topk`) the CUDA kernel selects one by one (a pass
/// over the row each) rather than merge-sorting the row.
pub const CUDA_SELECT_MAX: i64 = 16;
/// Elements per work item (one per thread) of an element-wise kernel.
pub const CUDA_ELEMENTS: i64 = 256;
/// Rows and columns of `C` per matmul work item.
pub const CUDA_MATMUL_TILE: i64 = 64;
/// Warps per block of the row kernels (reduce, softmax, norm, flash merge): one row each.
pub const CUDA_ROW_WARPS: i64 = 8;
/// Threads per block of the flash kernels (4 warps).
pub const CUDA_FLASH_THREADS: u32 = 128;
/// Threads per block of the warp-specialised tensor-core flash forward
/// ([`CudaPolicy::mma_warp_specialized`]): a producer warpgroup and two consumers.
pub const CUDA_WS_THREADS: u32 = 384;
/// Query rows per block of the SIMT flash kernel (4 warps × 4 rows).
pub const CUDA_SIMT_ROWS: i64 = 16;
/// Keys per tile of the SIMT flash kernel and per chunk of the split-KV decode (one per lane).
pub const CUDA_LANE_KEYS: i64 = 32;
/// Query rows per block and m-tile of the tensor-core flash kernel: 4 warps × 16 rows
/// (`mma.m16n8k16`'s 16). A block has `CUDA_MMA_ROWS · tiles` rows
/// ([`CudaPolicy::mma_row_tiles`]).
pub const CUDA_MMA_ROWS: i64 = 64;
/// The largest constant query length that uses the split-KV decode kernel.
pub const CUDA_DECODE_MAX_ROWS: i64 = 4;
/// Query rows per tile of the CUDA flash backward (one per lane of a warp).
pub const CUDA_BWD_ROWS: i64 = 32;
/// Keys per block of the CUDA flash backward (one per thread of a block).
pub const CUDA_BWD_KEYS: i64 = 128;

/// Keys of a key block, and query rows of a query tile, of the tensor-core flash backward (four
/// warps of 16; each inner step takes half a block). Both are its tile table's block sizes.
pub const CUDA_MMA_BWD_BLOCK: i64 = 64;
/// The widest head the CUDA flash kernels hold in registers.
pub const CUDA_MAX_HEAD: i64 = 256;

/// A head width rounded up to a multiple of 32 (the CUDA kernels zero-pad), or `None` above
/// [`CUDA_MAX_HEAD`].
pub fn cuda_pad_head(width: i64) -> Option<i64> {
    let padded = (width.max(1) + 31) / 32 * 32;
    (padded <= CUDA_MAX_HEAD).then_some(padded)
}

/// Keys per tile of the tensor-core flash kernel for a padded head width: 64, or 32 above 128
/// (so that the tiles stay within registers and shared memory).
pub fn cuda_mma_keys(head: i64) -> i64 {
    if head <= 128 { 64 } else { 32 }
}

impl CudaPolicy {
    /// The tensor-core flash kernel's m-tiles per warp (16 query rows each; a block has
    /// `64 · tiles` rows) for a padded head width: 2 up to 128, as FlashAttention-2 gives each
    /// warp 32 rows (each K and V fragment loaded from shared memory feeds two `mma`s, and each
    /// K/V tile is copied once for 128 rows), 1 above (the accumulators would not fit in
    /// registers). `mma_rows` overrides it where the width allows.
    pub fn mma_row_tiles(&self, head: i64) -> i64 {
        let widest = if head <= 128 { 2 } else { 1 };
        match self.mma_rows {
            Some(r) if r >= CUDA_MMA_ROWS => (r / CUDA_MMA_ROWS).min(widest),
            Some(_) => 1,
            None => widest,
        }
    }

    /// The tensor-core flash forward's K/V stages in shared memory for a padded head width,
    /// `tiles` m-tiles per warp and key tiles of `keys`: 2 where Hopper's pipelined tile runs
    /// (warpgroup products at widths 64 and 128, keys 64, two m-tiles) and both stages fit in
    /// [`CudaPolicy::max_smem_per_block`] (the next tile's K and V are copied during a whole
    /// tile, one barrier per tile), else 1 (K and V copied in turn, two barriers per tile).
    /// `kv_stages` overrides it where 2 is possible.
    pub fn mma_kv_stages(&self, head: i64, keys: i64, tiles: i64) -> i64 {
        let possible = self.wgmma
            && head % 64 == 0
            && head <= 128
            && keys == 64
            && tiles == 2
            && mma_smem_bytes(head, keys, tiles, 2) <= i64::from(self.max_smem_per_block);
        match self.kv_stages {
            _ if !possible => 1,
            Some(k) => k.clamp(1, 2),
            None => 2,
        }
    }

    /// Whether the tensor-core flash forward runs warp-specialised (FlashAttention-3's block on
    /// Hopper: a producer warpgroup copies K/V tiles into a ring of [`CudaPolicy::mma_kv_stages`]
    /// stages, signalled through `mbarrier`s, while two consumer warpgroups of 64 query rows
    /// each run the products and the softmax, taking turns at the tensor cores; `setmaxnreg`
    /// moves registers from the producer to them): where the two stages run and
    /// [`CudaPolicy::warp_specialize`] allows.
    pub fn mma_warp_specialized(&self, head: i64, keys: i64, tiles: i64) -> bool {
        self.warp_specialize && self.mma_kv_stages(head, keys, tiles) == 2
    }

    /// The stages of the warp-specialised block's K/V ring: 3 where they fit in
    /// [`CudaPolicy::max_smem_per_block`] (a consumer holds two tiles, the one whose scores it
    /// forms and the one whose `O += P V` runs meanwhile, so the third is the one the producer
    /// fills), else 2. `kv_stages` of 2 or more asks for that many (up to 4) where they fit.
    pub fn mma_ring_stages(&self, head: i64, keys: i64, tiles: i64) -> i64 {
        let fits = |k: i64| mma_smem_bytes(head, keys, tiles, k) <= i64::from(self.max_smem_per_block);
        let want = match self.kv_stages {
            Some(k) if k >= 2 => k.min(4),
            _ => 3,
        };
        (2..=want).rev().find(|&k| fits(k)).unwrap_or(2)
    }

    /// Key splits of a split-KV decode: enough warps to cover the device about 8 times over,
    /// at most one per chunk of [`CUDA_LANE_KEYS`] keys.
    pub fn decode_splits(&self, batch: i64, n: i64) -> i64 {
        let chunks = (n + CUDA_LANE_KEYS - 1) / CUDA_LANE_KEYS;
        let target = i64::from(self.sm_count.max(1)) * 32;
        ((target + batch.max(1) - 1) / batch.max(1)).clamp(1, chunks.max(1))
    }
}

/// The dynamic shared memory of the tensor-core flash forward: Q's block of `64 · tiles` rows
/// and `stages` K and V tiles of `keys` rows, at the padded head width. One stage: rows skewed
/// by 8 halves (`mma.sync`; Hopper's swizzled tiles take the skew's bytes for their 1024-byte
/// alignment). Two (Hopper only): unskewed swizzled tiles, the alignment's 1024 bytes, and 64
/// bytes of `mbarrier`s for the warp-specialised block.
pub fn mma_smem_bytes(head: i64, keys: i64, tiles: i64, stages: i64) -> i64 {
    let rows = CUDA_MMA_ROWS * tiles;
    if stages >= 2 { (rows + 2 * stages * keys) * head * 2 + 1024 + 64 } else { (rows + 2 * keys) * (head + 8) * 2 }
}
