//! Batched matrix products from the schedule's strided views (transposed operands and broadcast
//! batch axes read in place). A work item is a [`CUDA_MATMUL_TILE`]² tile of `C` of one batch
//! index. Two variants:
//!
//! - SIMT: k-steps of 16 staged in shared memory, 256 threads with a 4×4 register block each,
//!   f32 accumulation. Any operand dtypes.
//! - Tensor cores (both operands f16, or both bf16): k-steps of 32, 4 warps of 16 rows each,
//!   `mma.sync.m16n8k16` with f32 accumulation.

use super::cexpr::{Ints, delinearize, indent, load_ptr, ptr, round_to, storage, store};
use super::{CudaEmitError, KernelSource, Smem};
use attn_compiler::ir::{DType, Dim};
use attn_compiler::schedule::policy::{CUDA_FLASH_THREADS, CUDA_MATMUL_TILE, CUDA_THREADS};
use attn_compiler::schedule::{Variant, View};

/// The kernel of a matmul step.
pub(super) fn emit(ints: &Ints, items: &str, a: &View, b: &View, c: &View, variant: Variant) -> Result<KernelSource, CudaEmitError> {
    let rank = c.shape.len();
    let batch: Vec<Dim> = c.shape[..rank - 2].to_vec();
    let (m, n) = (ints.dim(&c.shape[rank - 2])?, ints.dim(&c.shape[rank - 1])?);
    let k = ints.dim(&a.shape[a.shape.len() - 1])?;
    let mma = variant == Variant::TensorCore;
    let tile = CUDA_MATMUL_TILE;
    let mut body = Vec::new();
    if mma {
        body.push("ATTNC_SHARED __align__(16) u16 As_[64][40];  // [m][k], 8 halves of skew".to_string());
        body.push("ATTNC_SHARED __align__(16) u16 Bs_[64][40];  // [n][k]: B transposed".to_string());
        body.push("const int tid_ = threadIdx.x, lane_ = tid_ & 31, warp_ = tid_ >> 5, g_ = lane_ >> 2, tg_ = lane_ & 3;".to_string());
    } else {
        body.push("ATTNC_SHARED float As_[16][68];  // [k][m]".to_string());
        body.push("ATTNC_SHARED float Bs_[16][68];  // [k][n]".to_string());
        body.push("const int tid_ = threadIdx.x, tx_ = tid_ & 15, ty_ = tid_ >> 4;".to_string());
    }
    body.push(format!("const i64 M_ = {m}, N_ = {n}, K_ = {k};"));
    body.push(format!("const i64 nrt_ = (M_ + {tile} - 1) / {tile}, nct_ = (N_ + {tile} - 1) / {tile};"));
    body.push(format!("const {}* __restrict__ A_ = {};", storage(a.dtype), ptr(a.buf, a.dtype, false)));
    body.push(format!("const {}* __restrict__ B_ = {};", storage(b.dtype), ptr(b.buf, b.dtype, false)));
    body.push(format!("for (i64 w_ = blockIdx.x; w_ < {items}; w_ += gridDim.x) {{"));
    let mut item = vec![
        "const i64 tiles_ = nrt_ * nct_, bz_ = w_ / tiles_, rest_ = w_ % tiles_;".to_string(),
        format!("const i64 row0_ = (rest_ / nct_) * {tile}, col0_ = (rest_ % nct_) * {tile};"),
    ];
    let p = delinearize(ints, &mut item, "bz_", &batch, "p")?;
    let offset = |v: &View| -> Result<String, CudaEmitError> {
        let strides = v.batch_strides(&batch);
        let bview = View { shape: batch.clone(), strides, ..v.clone() };
        ints.offset(&bview, &p)
    };
    item.push(format!("const i64 aoff_ = {};", offset(a)?));
    item.push(format!("const i64 boff_ = {};", offset(b)?));
    item.push(format!("const i64 coff_ = {};", offset(c)?));
    let (ar, br) = (a.shape.len(), b.shape.len());
    let (ars, acs) = (ints.dim(&a.strides[ar - 2])?, ints.dim(&a.strides[ar - 1])?);
    let (brs, bcs) = (ints.dim(&b.strides[br - 2])?, ints.dim(&b.strides[br - 1])?);
    let (crs, ccs) = (ints.dim(&c.strides[rank - 2])?, ints.dim(&c.strides[rank - 1])?);
    let at = |base: &str, r: &str, col: &str, rs: &str, cs: &str| format!("{base} + {r} * {rs} + {col} * {cs}");
    let a_at = at("aoff_", "ar_", "ac_", &ars, &acs);
    let b_at = at("boff_", "br_", "bc_", &brs, &bcs);
    let c_at = at("coff_", "r_", "c_", &crs, &ccs);
    if mma {
        item.extend(tensor_core_tile(a.dtype, c, &a_at, &b_at, &c_at));
    } else {
        item.extend(simt_tile(a.dtype, b.dtype, c, &a_at, &b_at, &c_at));
    }
    body.extend(indent(&item, 2));
    body.push("}".to_string());
    let threads = if mma { CUDA_FLASH_THREADS } else { CUDA_THREADS };
    Ok(KernelSource { threads, items_per_block: 1, smem: Smem::None, body })
}

/// One output tile on tensor cores.
fn tensor_core_tile(dtype: DType, c: &View, a_at: &str, b_at: &str, c_at: &str) -> Vec<String> {
    let mma_fn = if dtype == DType::BF16 { "attnc_mma_b" } else { "attnc_mma_h" };
    let mut out = vec![
        "float acc_[8][4];".to_string(),
        "#pragma unroll".into(),
        "for (int t_ = 0; t_ < 8; ++t_) { acc_[t_][0] = 0.0f; acc_[t_][1] = 0.0f; acc_[t_][2] = 0.0f; acc_[t_][3] = 0.0f; }".into(),
        "for (i64 k0_ = 0; k0_ < K_; k0_ += 32) {".into(),
        "  for (int e_ = tid_; e_ < 64 * 32; e_ += 128) {".into(),
        "    const int mi_ = e_ >> 5, ki_ = e_ & 31;   // A: consecutive threads walk k".into(),
        "    const i64 ar_ = row0_ + mi_, ac_ = k0_ + ki_;".into(),
        format!("    As_[mi_][ki_] = (ar_ < M_ && ac_ < K_) ? A_[{a_at}] : (u16)0;"),
        "    const int ni_ = e_ & 63, kj_ = e_ >> 6;   // B: consecutive threads walk n".into(),
        "    const i64 br_ = k0_ + kj_, bc_ = col0_ + ni_;".into(),
        format!("    Bs_[ni_][kj_] = (br_ < K_ && bc_ < N_) ? B_[{b_at}] : (u16)0;"),
        "  }".into(),
        "  attnc_sync();".into(),
        "  #pragma unroll".into(),
        "  for (int ks_ = 0; ks_ < 32; ks_ += 16) {".into(),
        "    const u16* pa_ = &As_[warp_ * 16 + g_][ks_ + tg_ * 2];".into(),
        "    const unsigned a_[4] = {attnc_ld_u32(pa_), attnc_ld_u32(pa_ + 8 * 40), attnc_ld_u32(pa_ + 8), attnc_ld_u32(pa_ + 8 * 40 + 8)};".into(),
        "    #pragma unroll".into(),
        "    for (int t_ = 0; t_ < 8; ++t_) {".into(),
        "      const u16* pb_ = &Bs_[t_ * 8 + g_][ks_ + tg_ * 2];".into(),
        "      const unsigned b_[2] = {attnc_ld_u32(pb_), attnc_ld_u32(pb_ + 8)};".into(),
        format!("      {mma_fn}(acc_[t_], a_, b_);"),
        "    }".into(),
        "  }".into(),
        "  attnc_sync();".into(),
        "}".into(),
        "#pragma unroll".into(),
        "for (int t_ = 0; t_ < 8; ++t_) {".into(),
        "  #pragma unroll".into(),
        "  for (int e_ = 0; e_ < 4; ++e_) {".into(),
        "    const i64 r_ = row0_ + warp_ * 16 + g_ + (e_ < 2 ? 0 : 8), c_ = col0_ + t_ * 8 + tg_ * 2 + (e_ & 1);".into(),
    ];
    out.push(format!("    if (r_ < M_ && c_ < N_) {}", store(c.buf, c.dtype, c_at, &round_to(c.dtype, "acc_[t_][e_]"))));
    out.push("  }".into());
    out.push("}".into());
    out
}

/// One output tile in f32 SIMT.
fn simt_tile(at: DType, bt: DType, c: &View, a_at: &str, b_at: &str, c_at: &str) -> Vec<String> {
    let la = super::ops::convert(
        &super::ops::CVal { text: load_ptr("A_", at, a_at), class: attn_compiler::ir::semantics::Class::of(at) },
        attn_compiler::ir::semantics::Class::Float,
    );
    let lb = super::ops::convert(
        &super::ops::CVal { text: load_ptr("B_", bt, b_at), class: attn_compiler::ir::semantics::Class::of(bt) },
        attn_compiler::ir::semantics::Class::Float,
    );
    let mut out = vec![
        "float acc_[4][4];".to_string(),
        "#pragma unroll".into(),
        "for (int i_ = 0; i_ < 4; ++i_) { acc_[i_][0] = 0.0f; acc_[i_][1] = 0.0f; acc_[i_][2] = 0.0f; acc_[i_][3] = 0.0f; }".into(),
        "for (i64 k0_ = 0; k0_ < K_; k0_ += 16) {".into(),
        "  for (int e_ = tid_; e_ < 64 * 16; e_ += 256) {".into(),
        "    const int mi_ = e_ >> 4, ki_ = e_ & 15;   // A: consecutive threads walk k".into(),
        "    const i64 ar_ = row0_ + mi_, ac_ = k0_ + ki_;".into(),
        format!("    As_[ki_][mi_] = (ar_ < M_ && ac_ < K_) ? {la} : 0.0f;"),
        "    const int ni_ = e_ & 63, kj_ = e_ >> 6;   // B: consecutive threads walk n".into(),
        "    const i64 br_ = k0_ + kj_, bc_ = col0_ + ni_;".into(),
        format!("    Bs_[kj_][ni_] = (br_ < K_ && bc_ < N_) ? {lb} : 0.0f;"),
        "  }".into(),
        "  attnc_sync();".into(),
        "  #pragma unroll".into(),
        "  for (int kk_ = 0; kk_ < 16; ++kk_) {".into(),
        "    float a_[4], b_[4];".into(),
        "    #pragma unroll".into(),
        "    for (int i_ = 0; i_ < 4; ++i_) { a_[i_] = As_[kk_][ty_ + 16 * i_]; b_[i_] = Bs_[kk_][tx_ + 16 * i_]; }".into(),
        "    #pragma unroll".into(),
        "    for (int i_ = 0; i_ < 4; ++i_) {".into(),
        "      #pragma unroll".into(),
        "      for (int j_ = 0; j_ < 4; ++j_) acc_[i_][j_] += a_[i_] * b_[j_];".into(),
        "    }".into(),
        "  }".into(),
        "  attnc_sync();".into(),
        "}".into(),
        "#pragma unroll".into(),
        "for (int i_ = 0; i_ < 4; ++i_) {".into(),
        "  #pragma unroll".into(),
        "  for (int j_ = 0; j_ < 4; ++j_) {".into(),
        "    const i64 r_ = row0_ + ty_ + 16 * i_, c_ = col0_ + tx_ + 16 * j_;".into(),
    ];
    out.push(format!("    if (r_ < M_ && c_ < N_) {}", store(c.buf, c.dtype, c_at, &round_to(c.dtype, "acc_[i_][j_]"))));
    out.push("  }".into());
    out.push("}".into());
    out
}
