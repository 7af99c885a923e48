//! Batched matrix products. Operands are strided views (transposed operands and broadcast batch
//! axes are read in place). Two kernels:
//!
//! - SIMT: 64×64 output tiles, k-steps of 16 staged in shared memory, 256 threads with a 4×4
//!   register block each, f32 accumulation. Any operand dtypes.
//! - Tensor cores (both operands f16, or both bf16): 64×64 tiles, k-steps of 32, 4 warps of
//!   16 rows each, `mma.sync.m16n8k16` with f32 accumulation.

use super::cexpr::{cdim, is_one, load_ptr, offset, ptr, round_to, storage, store, to_float};
use super::pointwise::delinearize;
use super::view::{View, view_of};
use super::{Builder, Grid, Launch, Smem};
use crate::ir::{DType, Dim, Value};

/// Emits the kernel of matmul node `v` into buffer `buf`.
pub(super) fn emit(b: &mut Builder, v: Value, buf: usize) {
    let g = b.g;
    let node = g.node(v).clone();
    let ops = g.operands(v);
    let (a, bb) = (ops[0], ops[1]);
    let (at, bt) = (g.node(a).ty.clone(), g.node(bb).ty.clone());
    let rank = node.ty.rank();
    let batch: Vec<Dim> = node.ty.shape[..rank - 2].to_vec();
    let (m, n) = (node.ty.shape[rank - 2].clone(), node.ty.shape[rank - 1].clone());
    let k = at.shape[at.rank() - 1].clone();
    let dummy = |w: Value| View { buf: usize::MAX, offset: Dim::constant(0), strides: vec![Dim::constant(0); g.node(w).ty.rank()] };
    let av = view_of(g, a, &b.bufs).unwrap_or_else(|_| dummy(a));
    let bv = view_of(g, bb, &b.bufs).unwrap_or_else(|_| dummy(bb));
    let mma = at.dtype == bt.dtype && matches!(at.dtype, DType::F16 | DType::BF16);
    let name = b.kernel_name(v, if mma { "matmul_mma" } else { "matmul_simt" });

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
    body.push(format!("const i64 M_ = {}, N_ = {}, K_ = {}, nb_ = {};", cdim(&m), cdim(&n), cdim(&k), cdim(&Dim::product(&batch))));
    body.push(format!("const {}* __restrict__ A_ = {};", storage(at.dtype), ptr(av.buf, at.dtype, false)));
    body.push(format!("const {}* __restrict__ B_ = {};", storage(bt.dtype), ptr(bv.buf, bt.dtype, false)));
    body.push("for (i64 bz_ = blockIdx.z; bz_ < nb_; bz_ += gridDim.z) {".to_string());
    body.push("for (i64 by_ = blockIdx.y; by_ * 64 < M_; by_ += gridDim.y) {".to_string());
    let p = delinearize(&mut body, "bz_", &batch, "p");
    let batch_strides = |t: &crate::ir::TensorType, view: &View| -> Vec<Dim> {
        let lead = batch.len() - (t.rank() - 2);
        (0..batch.len())
            .map(|ax| if ax < lead || is_one(&t.shape[ax - lead]) { Dim::constant(0) } else { view.strides[ax - lead].clone() })
            .collect()
    };
    body.push(format!("  const i64 aoff_ = {};", offset(&p, &batch_strides(&at, &av), &av.offset)));
    body.push(format!("  const i64 boff_ = {};", offset(&p, &batch_strides(&bt, &bv), &bv.offset)));
    body.push("  const i64 row0_ = by_ * 64, col0_ = (i64)blockIdx.x * 64;".to_string());
    let (ars, acs) = (&av.strides[at.rank() - 2], &av.strides[at.rank() - 1]);
    let (brs, bcs) = (&bv.strides[bt.rank() - 2], &bv.strides[bt.rank() - 1]);
    let elem = |base: &str, r: &str, c: &str, rs: &Dim, cs: &Dim| {
        format!("{base} + {}", offset(&[r.to_string(), c.to_string()], &[rs.clone(), cs.clone()], &Dim::constant(0)))
    };
    let out_off = "(bz_ * M_ + r_) * N_ + c_";
    if mma {
        let mma_fn = if at.dtype == DType::BF16 { "attnc_mma_b" } else { "attnc_mma_h" };
        body.push("  float acc_[8][4];".to_string());
        body.push("  #pragma unroll".to_string());
        body.push(
            "  for (int t_ = 0; t_ < 8; ++t_) { acc_[t_][0] = 0.0f; acc_[t_][1] = 0.0f; acc_[t_][2] = 0.0f; acc_[t_][3] = 0.0f; }"
                .to_string(),
        );
        body.push("  for (i64 k0_ = 0; k0_ < K_; k0_ += 32) {".to_string());
        body.push("    for (int e_ = tid_; e_ < 64 * 32; e_ += 128) {".to_string());
        body.push("      const int mi_ = e_ >> 5, ki_ = e_ & 31;   // A: consecutive threads walk k".to_string());
        body.push("      const i64 ar_ = row0_ + mi_, ac_ = k0_ + ki_;".to_string());
        body.push(format!("      As_[mi_][ki_] = (ar_ < M_ && ac_ < K_) ? A_[{}] : (u16)0;", elem("aoff_", "ar_", "ac_", ars, acs)));
        body.push("      const int ni_ = e_ & 63, kj_ = e_ >> 6;   // B: consecutive threads walk n".to_string());
        body.push("      const i64 br_ = k0_ + kj_, bc_ = col0_ + ni_;".to_string());
        body.push(format!("      Bs_[ni_][kj_] = (br_ < K_ && bc_ < N_) ? B_[{}] : (u16)0;", elem("boff_", "br_", "bc_", brs, bcs)));
        body.push("    }".to_string());
        body.push("    attnc_sync();".to_string());
        body.push("    #pragma unroll".to_string());
        body.push("    for (int ks_ = 0; ks_ < 32; ks_ += 16) {".to_string());
        body.push("      const u16* pa_ = &As_[warp_ * 16 + g_][ks_ + tg_ * 2];".to_string());
        body.push("      const unsigned a_[4] = {attnc_ld_u32(pa_), attnc_ld_u32(pa_ + 8 * 40), attnc_ld_u32(pa_ + 8), attnc_ld_u32(pa_ + 8 * 40 + 8)};".to_string());
        body.push("      #pragma unroll".to_string());
        body.push("      for (int t_ = 0; t_ < 8; ++t_) {".to_string());
        body.push("        const u16* pb_ = &Bs_[t_ * 8 + g_][ks_ + tg_ * 2];".to_string());
        body.push("        const unsigned b_[2] = {attnc_ld_u32(pb_), attnc_ld_u32(pb_ + 8)};".to_string());
        body.push(format!("        {mma_fn}(acc_[t_], a_, b_);"));
        body.push("      }".to_string());
        body.push("    }".to_string());
        body.push("    attnc_sync();".to_string());
        body.push("  }".to_string());
        body.push("  #pragma unroll".to_string());
        body.push("  for (int t_ = 0; t_ < 8; ++t_) {".to_string());
        body.push("    #pragma unroll".to_string());
        body.push("    for (int e_ = 0; e_ < 4; ++e_) {".to_string());
        body.push("      const i64 r_ = row0_ + warp_ * 16 + g_ + (e_ < 2 ? 0 : 8), c_ = col0_ + t_ * 8 + tg_ * 2 + (e_ & 1);".to_string());
        body.push(format!(
            "      if (r_ < M_ && c_ < N_) {}",
            store(buf, node.ty.dtype, out_off, &round_to(node.ty.dtype, "acc_[t_][e_]"))
        ));
        body.push("    }".to_string());
        body.push("  }".to_string());
    } else {
        body.push("  float acc_[4][4];".to_string());
        body.push("  #pragma unroll".to_string());
        body.push(
            "  for (int i_ = 0; i_ < 4; ++i_) { acc_[i_][0] = 0.0f; acc_[i_][1] = 0.0f; acc_[i_][2] = 0.0f; acc_[i_][3] = 0.0f; }"
                .to_string(),
        );
        body.push("  for (i64 k0_ = 0; k0_ < K_; k0_ += 16) {".to_string());
        body.push("    for (int e_ = tid_; e_ < 64 * 16; e_ += 256) {".to_string());
        body.push("      const int mi_ = e_ >> 4, ki_ = e_ & 15;   // A: consecutive threads walk k".to_string());
        body.push("      const i64 ar_ = row0_ + mi_, ac_ = k0_ + ki_;".to_string());
        let la = to_float(&load_ptr("A_", at.dtype, &elem("aoff_", "ar_", "ac_", ars, acs)), at.dtype);
        body.push(format!("      As_[ki_][mi_] = (ar_ < M_ && ac_ < K_) ? {la} : 0.0f;"));
        body.push("      const int ni_ = e_ & 63, kj_ = e_ >> 6;   // B: consecutive threads walk n".to_string());
        body.push("      const i64 br_ = k0_ + kj_, bc_ = col0_ + ni_;".to_string());
        let lb = to_float(&load_ptr("B_", bt.dtype, &elem("boff_", "br_", "bc_", brs, bcs)), bt.dtype);
        body.push(format!("      Bs_[kj_][ni_] = (br_ < K_ && bc_ < N_) ? {lb} : 0.0f;"));
        body.push("    }".to_string());
        body.push("    attnc_sync();".to_string());
        body.push("    #pragma unroll".to_string());
        body.push("    for (int kk_ = 0; kk_ < 16; ++kk_) {".to_string());
        body.push("      float a_[4], b_[4];".to_string());
        body.push("      #pragma unroll".to_string());
        body.push(
            "      for (int i_ = 0; i_ < 4; ++i_) { a_[i_] = As_[kk_][ty_ + 16 * i_]; b_[i_] = Bs_[kk_][tx_ + 16 * i_]; }".to_string(),
        );
        body.push("      #pragma unroll".to_string());
        body.push("      for (int i_ = 0; i_ < 4; ++i_) {".to_string());
        body.push("        #pragma unroll".to_string());
        body.push("        for (int j_ = 0; j_ < 4; ++j_) acc_[i_][j_] += a_[i_] * b_[j_];".to_string());
        body.push("      }".to_string());
        body.push("    }".to_string());
        body.push("    attnc_sync();".to_string());
        body.push("  }".to_string());
        body.push("  #pragma unroll".to_string());
        body.push("  for (int i_ = 0; i_ < 4; ++i_) {".to_string());
        body.push("    #pragma unroll".to_string());
        body.push("    for (int j_ = 0; j_ < 4; ++j_) {".to_string());
        body.push("      const i64 r_ = row0_ + ty_ + 16 * i_, c_ = col0_ + tx_ + 16 * j_;".to_string());
        body.push(format!(
            "      if (r_ < M_ && c_ < N_) {}",
            store(buf, node.ty.dtype, out_off, &round_to(node.ty.dtype, "acc_[i_][j_]"))
        ));
        body.push("    }".to_string());
        body.push("  }".to_string());
    }
    body.push("}".to_string());
    body.push("}".to_string());
    let text = format!(
        "// {} = matmul : {} ({})\nATTNC_KERNEL void __launch_bounds__({}) {name}(ATTNC_ARGS) {{\n{}\n}}\n",
        b.label(v),
        node.ty,
        if mma { "tensor cores" } else { "SIMT f32" },
        if mma { 128 } else { 256 },
        body.iter().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n")
    );
    b.kernels.push(text);
    b.launches.push(Launch {
        kernel: name,
        grid: Grid::MatMul { batch: Dim::product(&batch), m, n, tile: 64 },
        block: if mma { 128 } else { 256 },
        smem: Smem::None,
    });
}
