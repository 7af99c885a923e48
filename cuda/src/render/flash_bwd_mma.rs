//! The flash backward on tensor cores (FlashAttention-2's backward with `mma.sync.m16n8k16`,
//! f32 accumulation), for f16/bf16 `q`, `k`, `v` (and `d_out` of their type or f32, rounded to
//! it on staging: an f32 bias makes the op's result f32), with the extra operands' gradients:
//! one sum per work item (ALiBi's slopes') in registers, scattered ones (a bias table's, by
//! relative position) added atomically into the key item's partial sums, in the fast mode only
//! ([`Variant::TensorCore`](attn_compiler::schedule::Variant) of a [`FlashBwdKernel`]).
//! A block has four warps. In the fast mode (the default) every work item is a key block
//! (1. below) that also adds its share of `dQ` into an f32 buffer by atomic adds
//! ([`FlashBwdKernel::dq_accum`]: zeroed by the step before, rounded into `dQ` by the step
//! after): five products per tile pair, FlashAttention-2's backward. In the deterministic mode
//! (`ATTNC_CUDA_BWD=deterministic`) there are two kinds of work item, each owning what it
//! writes, so every sum runs in a fixed order (seven products per tile pair):
//!
//! 1. A block of [`CUDA_MMA_BWD_BLOCK`] keys of one batch index (items `0 .. batch · key
//!    blocks`); warp `w` owns keys `16w .. 16w + 16` and their `dK` and `dV` rows in
//!    registers. K and V stay in shared memory; for each query tile the tile table does not skip,
//!    half a tile (32 rows) at a time, Q, `d_out` (copied while the previous half tile is
//!    worked on: two buffers) and the rows' `lse` and `delta` are staged,
//!    and `Sᵀ = K Qᵀ`, `dPᵀ = V d_outᵀ` (tensor cores), the weights and `dSᵀ` (per element,
//!    through the score modification and the mask), then `dV += Pᵀ d_out` and `dK += dSᵀ Q`
//!    (tensor cores, P and dS rounded to the operands' type). In the fast mode, `dS` of the
//!    half tile then goes to shared memory and `dQ += dS K` is added atomically.
//! 2. A tile of [`CUDA_MMA_BWD_BLOCK`] query rows (the next `batch · query blocks` items, when
//!    `dQ` is asked for): warp `w` owns rows `16w .. 16w + 16` and their `dQ` in registers; for
//!    each live key tile, half at a time, `S = Q Kᵀ`, `dP = d_out Vᵀ`, `dS`, then `dQ += dS K`.
//!
//! Fragment layouts and `ldmatrix` addressing are the forward kernel's (`flash.rs`).

use super::cexpr::{Ints, indent, load, ptr, round_to, store};
use super::flash_bwd::{df_term, flat_index, flush_item_sums, item_start, items_head, partials_head, row_col, sizes_head, weight_and_ds};
use super::score::ScoreCtx;
use super::{CudaEmitError, KernelSource, Smem};
use attn_compiler::ir::{DType, Dim};
use attn_compiler::schedule::policy::{CUDA_FLASH_THREADS, CUDA_MMA_BWD_BLOCK};
use attn_compiler::schedule::{FlashBwdKernel, View};

/// The tensor-core backward kernel of a flash backward step.
pub(super) fn emit(ints: &Ints, items: &str, f: &FlashBwdKernel) -> Result<KernelSource, CudaEmitError> {
    if !f.extra_grads_are_item_sums() && f.dq_accum.is_none() {
        return Err(
            ints.fail("the tensor-core flash backward's deterministic mode adds only extra gradients that are one sum per item".into())
        );
    }
    let step = f.step;
    let bf16 = f.k.dtype == DType::BF16;
    let (mma, pack, conv) = if bf16 { ("attnc_mma_b", "attnc_pack_b", "attnc_f2b") } else { ("attnc_mma_h", "attnc_pack_h", "attnc_f2h") };
    let blk = CUDA_MMA_BWD_BLOCK;
    let half = blk / 2;
    let mut body = vec![
        "ATTNC_DYN_SMEM;".to_string(),
        format!(
            "constexpr int HD_ = ATTNC_HD_{step}, LD_ = HD_ + 8, DT_ = HD_ / 8, KS_ = HD_ / 16;  // head width (padded); shared row stride (halves)"
        ),
        format!("constexpr int BL_ = {blk}, HB_ = {half};  // rows of a block, of half a tile"),
        // Hopper (sm_90a) takes the warpgroup products at widths 64 and 128 (the compile
        // option -DATTNC_NO_WGMMA_BWD keeps mma.sync, for comparing).
        format!("#if ATTNC_WGMMA && !defined(ATTNC_NO_WGMMA_BWD) && ATTNC_HD_{step} % 64 == 0 && ATTNC_HD_{step} <= 128"),
        format!("#define ATTNC_WGB_{step} 1"),
        "// The tiles 128-byte swizzled (prelude: attnc_wg_desc) from a 1024-byte aligned shared".into(),
        "// address (the launch's shared memory has the skew's bytes to spare); element (r, c) of a".into(),
        format!("// tile of `rows` rows is ATTNC_BOFF_{step}(rows, r, c) halves in."),
        "constexpr int LT_ = HD_;  // a tile's row stride (halves)".into(),
        "const unsigned sb_ = attnc_saddr(attnc_smem), sa_ = (sb_ + 1023u) & ~1023u;".into(),
        "u16* A_ = (u16*)(attnc_smem + (sa_ - sb_));".into(),
        format!(
            "#define ATTNC_BOFF_{step}(rows, r, c) (((((c) >> 6) * (rows) + (r)) << 6) + (((((c) >> 3) & 7) ^ ((r) & 7)) << 3) + ((c) & 7))"
        ),
        "#else".into(),
        format!("#define ATTNC_WGB_{step} 0"),
        "constexpr int LT_ = LD_;".into(),
        "u16* A_ = (u16*)attnc_smem;".into(),
        format!("#define ATTNC_BOFF_{step}(rows, r, c) ((r) * LD_ + (c))"),
        "#endif".into(),
        "// A_ [BL_][LT_]: K (key items) or Q (query items)".into(),
        "u16* B_ = A_ + BL_ * LT_;     // [BL_][LT_]: V or d_out".into(),
        "u16* C_ = B_ + BL_ * LT_;     // [2][HB_][LT_]: Q or K, half a tile, two buffers".into(),
        "u16* E_ = C_ + 2 * HB_ * LT_; // [2][HB_][LT_]: d_out or V".into(),
        "float* L_ = (float*)(E_ + 2 * HB_ * LT_);  // [BL_]: the rows' log-sum-exp".into(),
        "float* G_ = L_ + BL_;                  // [BL_]: the rows' delta = Σ d_out ∘ out".into(),
        "constexpr int LS_ = BL_ + 8;  // the row stride of S_ (halves)".into(),
        "u16* S_ = (u16*)(G_ + BL_);   // [HB_][LS_]: a half tile's dS (queries × the block's keys), when dQ is added atomically".into(),
        "constexpr int LQ_ = HD_ + 4;  // the row stride of Q_ (floats)".into(),
        "float* Q_ = (float*)(S_ + HB_ * LS_);  // [HB_][LQ_]: the half tile's dQ, then added to global memory".into(),
        "(void)Q_;".into(),
        "const int tid_ = threadIdx.x, lane_ = tid_ & 31, warp_ = tid_ >> 5, g_ = lane_ >> 2, tg_ = lane_ & 3;".into(),
        "const int lr_ = lane_ & 7, lm_ = lane_ >> 3;  // ldmatrix: this lane addresses row lr_ of matrix lm_".into(),
        "// The row this lane gives ldmatrix (elements from a 16 x 16 corner): an A fragment or".into(),
        "// transposed B fragments (rows (lm_ & 1) * 8, columns (lm_ >> 1) * 8), B fragments of two".into(),
        "// n-tiles (rows (lm_ >> 1) * 8, columns (lm_ & 1) * 8).".into(),
        "const int fa_ = ((lm_ & 1) * 8 + lr_) * LD_ + (lm_ >> 1) * 8;".into(),
        "const int fb_ = ((lm_ >> 1) * 8 + lr_) * LD_ + (lm_ & 1) * 8;".into(),
        "const int fs_ = ((lm_ & 1) * 8 + lr_) * LS_ + (lm_ >> 1) * 8;  // fa_ in S_".into(),
        "const unsigned As_ = attnc_saddr(A_), Bs_ = attnc_saddr(B_), Cs_ = attnc_saddr(C_), Es_ = attnc_saddr(E_), Ss_ = attnc_saddr(S_);"
            .into(),
        "(void)fs_; (void)Ss_;".into(),
    ];
    body.extend(sizes_head(ints, f)?);
    // The extra operands' gradients (ALiBi's slopes): per key item, register sums of
    // `dF · ∂F/∂x` flushed into its partial sums, which the reduce step adds in item order.
    let offsets = partials_head(ints, f, &mut body)?;
    body.push("ATTNC_SHARED double wsum_[4];  // one sum per warp".into());
    body.push("(void)wsum_;".into());
    let (mut it, p) = items_head(ints, f, items, &mut body)?;
    it.extend(item_start(f, &CUDA_FLASH_THREADS.to_string()));
    it.push("attnc_cp_wait_all();  // the previous item's copies (all of its tiles may have been skipped)".into());
    it.push("attnc_sync();  // the previous item is done with shared memory".into());
    let cx = Cx { ints, f, p: &p, mma, pack, conv, wg: if bf16 { 'b' } else { 'h' }, offsets: &offsets };
    it.push(cx.vec_line()?);
    it.push("if (keys_) {".into());
    it.extend(indent(&cx.key_block()?, 2));
    it.push("}".into());
    if f.dq.is_some() {
        it.push("else {".into());
        it.extend(indent(&cx.query_tile()?, 2));
        it.push("}".into());
    }
    body.extend(indent(&it, 2));
    body.push("}".into());
    Ok(KernelSource { threads: CUDA_FLASH_THREADS, items_per_block: 1, smem: Smem::FlashBwdMma(step, f.dq_accum.is_some()), body })
}

/// Copies a half tile into a buffer: (the buffer's index expression, the first row).
type Stage<'a> = dyn Fn(&str, &str) -> Result<Vec<String>, CudaEmitError> + 'a;

/// An item's half tiles: how many, and expressions of a half tile `@`: whether it is worked on,
/// its tile's class, its first row.
#[derive(Clone, Copy)]
struct Walk<'a> {
    count: &'a str,
    live: &'a str,
    class: &'a str,
    first: &'a str,
}

/// A key-block item's walk over the query half tiles of its column of the tile table.
const QUERY_HALVES: Walk<'static> = Walk {
    count: "2 * nqb_",
    live: "tbl_[((@ >> 1) * nkb_ + blk_) * entry_] != 0 && (@ >> 1) * BL_ + (@ & 1) * HB_ < M_",
    class: "tbl_[((@ >> 1) * nkb_ + blk_) * entry_]",
    first: "(@ >> 1) * BL_ + (@ & 1) * HB_",
};

/// A query-tile item's walk over the key half tiles of its row of the tile table.
const KEY_HALVES: Walk<'static> = Walk {
    count: "2 * nkb_",
    live: "tbl_[(blk_ * nkb_ + (@ >> 1)) * entry_] != 0 && (@ >> 1) * BL_ + (@ & 1) * HB_ < N_",
    class: "tbl_[(blk_ * nkb_ + (@ >> 1)) * entry_]",
    first: "(@ >> 1) * BL_ + (@ & 1) * HB_",
};

/// What the two kinds of work item share.
struct Cx<'a> {
    ints: &'a Ints<'a>,
    f: &'a FlashBwdKernel,
    p: &'a [String],
    mma: &'a str,
    pack: &'a str,
    /// f32 to the operand type (an f32 `d_out` is rounded to it on staging).
    conv: &'a str,
    /// The warpgroup helpers' type letter (`h`, `b`).
    wg: char,
    /// Where each extra gradient starts in an item's partial sums.
    offsets: &'a [String],
}

impl Cx<'_> {
    /// Copies rows `first ..` (`rows` of them) of a `[.., rows, width]` operand into shared
    /// buffer `buf` as raw halves, zero outside the matrix and beyond the width: 16 bytes at a
    /// time by `cp.async` when `vec_`, else element by element. The caller commits, waits and
    /// syncs before reading.
    fn stage(
        &self,
        buf: &str,
        rows: &str,
        (view, base): (&View, &str),
        first: &str,
        (limit, width): (&str, &str),
    ) -> Result<Vec<String>, CudaEmitError> {
        let step = self.f.step;
        let at = row_col(self.ints, view, base, "x_", "(i64)c_")?;
        let src = ptr(view.buf, view.dtype, false);
        if view.dtype == DType::F32 {
            return Ok(vec![
                format!("for (int e_ = tid_; e_ < {rows} * HD_; e_ += {CUDA_FLASH_THREADS}) {{"),
                "  const int r_ = e_ / HD_, c_ = e_ % HD_;".into(),
                format!("  const i64 x_ = {first} + r_;"),
                format!(
                    "  {buf}[ATTNC_BOFF_{step}({rows}, r_, c_)] = (x_ < {limit} && c_ < {width}) ? {}({src}[{at}]) : (u16)0;",
                    self.conv
                ),
            ]
            .into_iter()
            .chain(std::iter::once("}".to_string()))
            .collect());
        }
        let scalar = vec![
            format!("for (int e_ = tid_; e_ < {rows} * HD_; e_ += {CUDA_FLASH_THREADS}) {{"),
            "  const int r_ = e_ / HD_, c_ = e_ % HD_;".into(),
            format!("  const i64 x_ = {first} + r_;"),
            format!("  {buf}[ATTNC_BOFF_{step}({rows}, r_, c_)] = (x_ < {limit} && c_ < {width}) ? {src}[{at}] : (u16)0;"),
            "}".into(),
        ];
        if !self.unit_columns() {
            return Ok(scalar);
        }
        let mut out = vec![
            "if (vec_) {".to_string(),
            format!("  for (int e_ = tid_; e_ < {rows} * (HD_ / 8); e_ += {CUDA_FLASH_THREADS}) {{"),
            "    const int r_ = e_ / (HD_ / 8), c_ = (e_ % (HD_ / 8)) * 8;".into(),
            format!("    const i64 x_ = {first} + r_;"),
            format!("    const bool in_ = x_ < {limit} && c_ < {width};"),
            format!(
                "    attnc_cp16(attnc_saddr({buf}) + 2u * ATTNC_BOFF_{step}({rows}, r_, c_), in_ ? (const void*)&{src}[{at}] : (const void*){src}, in_);"
            ),
            "  }".into(),
            "} else {".into(),
        ];
        out.extend(indent(&scalar, 2));
        out.push("}".into());
        Ok(out)
    }

    /// The operands copied as raw halves (q, k, v, and d_out unless it is f32), with their
    /// batch offsets' names.
    fn halves(&self) -> Vec<(&View, &'static str)> {
        let f = self.f;
        let all = [(&f.q, "qoff_"), (&f.k, "koff_"), (&f.v, "voff_"), (&f.d_out, "dooff_")];
        all.into_iter().filter(|(view, _)| view.dtype != DType::F32).collect()
    }

    /// Whether the raw-half operands have unit column stride (known at emission): the condition
    /// for any 16-byte copy of their rows.
    fn unit_columns(&self) -> bool {
        self.halves().iter().all(|(view, _)| view.strides.last().and_then(Dim::as_const) == Some(1))
    }

    /// `const bool vec_`: whether this item's rows can be copied 16 bytes at a time (widths, row
    /// strides and offsets multiples of 8 halves, checked per run).
    fn vec_line(&self) -> Result<String, CudaEmitError> {
        if !self.unit_columns() {
            return Ok("const bool vec_ = false;".into());
        }
        let mut conds = vec!["D_ % 8 == 0".to_string(), "DV_ % 8 == 0".into()];
        for (view, base) in self.halves() {
            conds.push(format!("{base} % 8 == 0"));
            conds.push(format!("{} % 8 == 0", self.ints.dim(&view.strides[view.strides.len() - 2])?));
        }
        Ok(format!("const bool vec_ = {};  // 16-byte copies", conds.join(" && ")))
    }

    /// A half tile's two products from the resident operands (`A_`, `B_`, the warp's 16 rows)
    /// and the staged half tile (`Cb_`, `Eb_`), `s_` and `dp_`, then the weights and `dS` per
    /// element at `position` ([`Self::weights`]), after the comment `what`.
    fn scores(&self, what: &str, position: &str) -> Result<Vec<String>, CudaEmitError> {
        let mut out = vec![what.to_string()];
        out.extend(self.products([("s_", "As_", "Cb_"), ("dp_", "Bs_", "Eb_")], "warp_ * 16"));
        out.extend(self.weights(position)?);
        Ok(out)
    }

    /// [`Self::stage`] of two operands' rows `first ..` (of `limit`) into `bufs`: the first of
    /// width `D_` (q or k), the second of `DV_` (d_out or v).
    fn stage_pair(
        &self,
        bufs: [&str; 2],
        rows: &str,
        ops: [(&View, &str); 2],
        (first, limit): (&str, &str),
    ) -> Result<Vec<String>, CudaEmitError> {
        let mut out = self.stage(bufs[0], rows, ops[0], first, (limit, "D_"))?;
        out.extend(self.stage(bufs[1], rows, ops[1], first, (limit, "DV_"))?);
        Ok(out)
    }

    /// [`Self::stage_pair`] of a half tile into buffer `b` (0 or 1) of `C_` and `E_`.
    fn stage_half(&self, b: &str, ops: [(&View, &str); 2], at: (&str, &str)) -> Result<Vec<String>, CudaEmitError> {
        let bufs = [format!("(C_ + ({b}) * (HB_ * LT_))"), format!("(E_ + ({b}) * (HB_ * LT_))")];
        self.stage_pair([&bufs[0], &bufs[1]], "HB_", ops, at)
    }

    /// Each of rows `first ..` (`rows` of them) gets its log-sum-exp and `delta` (the step
    /// before summed it) in `L_` and `G_` (softmax weights), one thread per row.
    fn stage_stats(&self, rows: &str, first: &str) -> Result<Vec<String>, CudaEmitError> {
        let f = self.f;
        let Some((l, _)) = &f.lse else { return Ok(Vec::new()) };
        let delta = f.delta.as_ref().ok_or_else(|| self.ints.fail("the flash backward's rows' delta has no step".into()))?;
        let s = &l.strides[l.strides.len() - 1];
        let off = if s.as_const() == Some(1) { "loff_ + i_".to_string() } else { format!("loff_ + i_ * {}", self.ints.dim(s)?) };
        Ok(vec![
            format!("for (int r_ = tid_; r_ < {rows}; r_ += {CUDA_FLASH_THREADS}) {{"),
            format!("  const i64 i_ = {first} + r_;"),
            format!("  L_[r_] = i_ < M_ ? {} : 0.0f;", load(l.buf, DType::F32, &off)),
            format!("  G_[r_] = i_ < M_ ? {} : 0.0f;", load(delta.buf, DType::F32, &off)),
            "}".into(),
        ])
    }

    /// `acc[16 rows][32 columns] = X Yᵀ` over the padded head width for both `(acc, xs, ys)`:
    /// X's 16 rows from shared address `xs` (`xrow` the warp's first row), Y's 32 rows from
    /// `ys`. The two products share one loop over the width, so that eight independent
    /// accumulators (not four) hide the tensor cores' latency.
    fn products(&self, pair: [(&str, &str, &str); 2], xrow: &str) -> Vec<String> {
        let (mma, step, t) = (self.mma, self.f.step, self.wg);
        // Hopper: one 64-row `wgmma` per product and 16 columns of the width, X (the block's
        // 64 rows: warp w gets rows 16 w, its `xrow`) and Y (32 rows) K-major from their tiles.
        let mut out = vec![format!("#if ATTNC_WGB_{step}")];
        for (acc, _, _) in pair {
            out.push(format!("float {acc}[4][4];"));
        }
        out.push("attnc_wg_fence();".into());
        out.push("#pragma unroll".into());
        out.push("for (int ks_ = 0; ks_ < KS_; ++ks_) {".into());
        for (acc, xs, ys) in pair {
            out.push(format!(
                "  attnc_wg_ss_{t}32(&{acc}[0][0], attnc_wg_desc({xs} + (ks_ >> 2) * (BL_ * 128u) + 32u * (ks_ & 3), 16u, 1024u), attnc_wg_desc({ys} + (ks_ >> 2) * (HB_ * 128u) + 32u * (ks_ & 3), 16u, 1024u), ks_ > 0);"
            ));
        }
        out.push("}".into());
        out.push("attnc_wg_commit();".into());
        out.push("attnc_wg_wait0();".into());
        out.push("#else".into());
        for (acc, _, _) in pair {
            out.push(format!("float {acc}[4][4];"));
            out.push("#pragma unroll".into());
            out.push(format!(
                "for (int nt_ = 0; nt_ < 4; ++nt_) {{ {acc}[nt_][0] = 0.0f; {acc}[nt_][1] = 0.0f; {acc}[nt_][2] = 0.0f; {acc}[nt_][3] = 0.0f; }}"
            ));
        }
        out.push("#pragma unroll".into());
        out.push("for (int ks_ = 0; ks_ < KS_; ++ks_) {".into());
        for (acc, xs, ys) in pair {
            out.extend([
                "  {".to_string(),
                "    unsigned a_[4];".into(),
                format!("    attnc_ldsm_x4(a_, {xs} + 2u * (fa_ + ({xrow}) * LD_ + ks_ * 16));"),
                "    #pragma unroll".into(),
                "    for (int nt_ = 0; nt_ < 4; nt_ += 2) {".into(),
                "      unsigned b_[4];".into(),
                format!("      attnc_ldsm_x4(b_, {ys} + 2u * (fb_ + nt_ * 8 * LD_ + ks_ * 16));"),
                format!("      {mma}({acc}[nt_], a_, b_);"),
                format!("      {mma}({acc}[nt_ + 1], a_, b_ + 2);"),
                "    }".into(),
                "  }".into(),
            ]);
        }
        out.push("}".into());
        out.push("#endif".into());
        out
    }

    /// `lines` on Hopper's warpgroup path only.
    fn wg_lines(&self, lines: &[&str]) -> Vec<String> {
        let mut out = vec![format!("#if ATTNC_WGB_{}", self.f.step)];
        out.extend(lines.iter().map(|l| l.to_string()));
        out.push("#endif".into());
        out
    }

    /// `acc[16][HD_] += X Z` for X = the 16 × 32 accumulator `x` (rounded to the operand type)
    /// and Z's 32 rows in shared memory at `zs` (transposed `ldmatrix`).
    /// Hopper: two 64-row `wgmma`s (16 of Z's rows each), X from registers, Z MN-major from
    /// its tile; issued and committed, not waited for ([`Self::wg_lines`] `attnc_wg_wait0`
    /// after the item's last one).
    fn accumulate(&self, acc: &str, x: &str, zs: &str) -> Vec<String> {
        let (mma, pack, step, t) = (self.mma, self.pack, self.f.step, self.wg);
        vec![
            format!("#if ATTNC_WGB_{step}"),
            "{".into(),
            "  unsigned a_[2][4];".into(),
            "  #pragma unroll".into(),
            "  for (int kk_ = 0; kk_ < 2; ++kk_) {".into(),
            format!("    a_[kk_][0] = {pack}({x}[2 * kk_][0], {x}[2 * kk_][1]);"),
            format!("    a_[kk_][1] = {pack}({x}[2 * kk_][2], {x}[2 * kk_][3]);"),
            format!("    a_[kk_][2] = {pack}({x}[2 * kk_ + 1][0], {x}[2 * kk_ + 1][1]);"),
            format!("    a_[kk_][3] = {pack}({x}[2 * kk_ + 1][2], {x}[2 * kk_ + 1][3]);"),
            "  }".into(),
            "  attnc_wg_fence();".into(),
            "  #pragma unroll".into(),
            "  for (int kk_ = 0; kk_ < 2; ++kk_) {".into(),
            format!("    const unsigned long long zd_ = attnc_wg_desc({zs} + kk_ * 2048u, HB_ * 128u, 1024u);"),
            format!("    if constexpr (HD_ == 64) attnc_wg_rs_{t}64_t(&{acc}[0][0], a_[kk_], zd_, 1);"),
            format!("    else attnc_wg_rs_{t}128_t(&{acc}[0][0], a_[kk_], zd_, 1);"),
            "  }".into(),
            "  attnc_wg_commit();".into(),
            "}".into(),
            "#else".into(),
            "#pragma unroll".into(),
            "for (int kk_ = 0; kk_ < 2; ++kk_) {".into(),
            "  unsigned a_[4];".into(),
            format!("  a_[0] = {pack}({x}[2 * kk_][0], {x}[2 * kk_][1]);"),
            format!("  a_[1] = {pack}({x}[2 * kk_][2], {x}[2 * kk_][3]);"),
            format!("  a_[2] = {pack}({x}[2 * kk_ + 1][0], {x}[2 * kk_ + 1][1]);"),
            format!("  a_[3] = {pack}({x}[2 * kk_ + 1][2], {x}[2 * kk_ + 1][3]);"),
            "  #pragma unroll".into(),
            "  for (int t_ = 0; t_ < DT_; t_ += 2) {".into(),
            "    unsigned b_[4];".into(),
            format!("    attnc_ldsm_x4_t(b_, {zs} + 2u * (fa_ + kk_ * 16 * LD_ + t_ * 8));"),
            format!("    {mma}({acc}[t_], a_, b_);"),
            format!("    {mma}({acc}[t_ + 1], a_, b_ + 2);"),
            "  }".into(),
            "}".into(),
            "#endif".into(),
        ]
    }

    /// Per accumulator element (`nt_`, `e_`) at query `i_`, key `j_`, statistics row `sr_`: the
    /// weight into `s_` and `dS` into `dp_` (from the raw product `s_` and `dP` in `dp_`).
    fn weights(&self, position: &str) -> Result<Vec<String>, CudaEmitError> {
        let f = self.f;
        let mut pos = self.p.to_vec();
        pos.push("i_".into());
        pos.push("j_".into());
        let cx = ScoreCtx { ints: self.ints, s: Some("sv_"), pos: &pos, extras: &f.extras };
        let mut el = vec![position.to_string(), "const float sv_ = s_[nt_][e_] * qscale_, dpv_ = dp_[nt_][e_];".into()];
        el.push("float p_ = 0.0f, df_ = 0.0f, ds_ = 0.0f;".into());
        el.push("bool keep_ = i_ < M_ && j_ < N_;".into());
        el.extend(weight_and_ds(&cx, f, "dpv_", ("L_[sr_]", "G_[sr_]"), true)?);
        // A key item's extra gradients, dF · ∂F/∂x: one sum per item into `sum_`; scattered
        // over the operand (a bias table by relative position), added atomically into the
        // high word of the item's partial sum of the element (its low word stays 0; only in
        // the default mode, where dQ is added atomically too: the emission refuses otherwise).
        for (k, (l, item)) in f.grad.loads.iter().zip(f.item_sums()).enumerate() {
            let Some(slot) = f.dx.iter().position(|(x, _)| *x == l.input) else { continue };
            let (lines, contrib) = df_term(&cx, k, l)?;
            el.push("if (keys_ && df_ != 0.0f && i_ < M_ && j_ < N_) {".into());
            el.extend(indent(&lines, 2));
            if item {
                el.push(format!("  sum_[{k}] += (double)({contrib});"));
            } else {
                let mut il = super::ops::Lines::new(&format!("y{k}"));
                let flat = flat_index(self.ints, f, &cx, &mut il, l)?;
                el.extend(indent(&il.lines, 2));
                el.push(format!("  attnc_red_add(mine_ + 2 * ({} + {}), {contrib});", self.offsets[slot], flat.join(" + ")));
            }
            el.push("}".into());
        }
        el.push("s_[nt_][e_] = p_; dp_[nt_][e_] = ds_;".into());
        let mut out = vec![
            "#pragma unroll".to_string(),
            "for (int nt_ = 0; nt_ < 4; ++nt_) {".into(),
            "  #pragma unroll".into(),
            "  for (int e_ = 0; e_ < 4; ++e_) {".into(),
        ];
        out.extend(indent(&el, 4));
        out.push("  }".into());
        out.push("}".into());
        Ok(out)
    }

    /// Stores accumulator `acc` (`[DT_][4]`, rows `row` of the warp) times `scale` into a
    /// result's rows below `limit`, columns below `width`.
    fn store_rows(&self, acc: &str, view: &View, base: &str, scale: &str, limit: &str, width: &str) -> Result<Vec<String>, CudaEmitError> {
        let value = round_to(view.dtype, &format!("({scale} * {acc}[t_][e_])"));
        Ok(vec![
            "#pragma unroll".into(),
            "for (int t_ = 0; t_ < DT_; ++t_) {".into(),
            "  #pragma unroll".into(),
            "  for (int e_ = 0; e_ < 4; ++e_) {".into(),
            "    const i64 r_ = row0_ + g_ + (e_ >> 1) * 8, c_ = t_ * 8 + tg_ * 2 + (e_ & 1);".into(),
            format!(
                "    if (r_ < {limit} && c_ < {width}) {}",
                store(view.buf, view.dtype, &row_col(self.ints, view, base, "r_", "c_")?, &value)
            ),
            "  }".into(),
            "}".into(),
        ])
    }

    fn zero(acc: &str) -> Vec<String> {
        vec![
            format!("float {acc}[DT_][4];"),
            "#pragma unroll".into(),
            format!(
                "for (int t_ = 0; t_ < DT_; ++t_) {{ {acc}[t_][0] = 0.0f; {acc}[t_][1] = 0.0f; {acc}[t_][2] = 0.0f; {acc}[t_][3] = 0.0f; }}"
            ),
        ]
    }

    /// The loop over an item's live half tiles (`count` of them; `live`, `class` and `first`
    /// are expressions of a half tile `@`: whether it is worked on, its tile's class, its first
    /// row). Half tile `h_` is copied into
    /// buffer `cb_` while the previous one is worked on. Around `body`, which reads `x0_` (the
    /// first row), `cls_` and the buffers' shared addresses `Cb_`, `Eb_`; `stats` run before it
    /// (synchronously, after the next copies are on their way).
    fn half_tiles(&self, walk: &Walk, stage: &Stage, stats: Vec<String>, body: Vec<String>) -> Result<Vec<String>, CudaEmitError> {
        let Walk { count, live, class, first } = *walk;
        let at = |x: &str, h: &str| x.replace('@', h);
        // Copies half tile `h` (when there is one) into buffer `b`, asynchronously.
        let prefetch = |h: &str, b: &str| -> Result<Vec<String>, CudaEmitError> {
            let mut v = vec![format!("if ({h} < {count}) {{"), format!("  const i64 f0_ = {};", at(first, h))];
            v.extend(indent(&stage(b, "f0_")?, 2));
            v.extend(["  attnc_cp_commit();".to_string(), "}".into()]);
            Ok(v)
        };
        let mut out = vec![
            format!("auto live_ = [&](i64 h) -> bool {{ return {}; }};", at(live, "h")),
            "i64 h_ = 0;".into(),
            format!("while (h_ < {count} && !live_(h_)) ++h_;"),
            "int cb_ = 0;  // the buffer of half tile h_".into(),
        ];
        out.extend(prefetch("h_", "0")?);
        out.push(format!("while (h_ < {count}) {{"));
        let mut it = vec![
            "i64 hn_ = h_ + 1;".to_string(),
            format!("while (hn_ < {count} && !live_(hn_)) ++hn_;"),
            format!("const int cls_ = {};  // 0 skip, 1 full, 2 partial", at(class, "h_")),
            format!("const i64 x0_ = {};  // the half tile's first row", at(first, "h_")),
            "attnc_sync();  // every warp is done with the other buffer and with L_, G_".into(),
        ];
        it.extend(prefetch("hn_", "cb_ ^ 1")?);
        it.extend(stats);
        it.push(format!("if (hn_ < {count}) attnc_cp_wait_1(); else attnc_cp_wait_all();  // this half tile is in"));
        it.extend(self.wg_lines(&["attnc_fence_proxy();  // the copies, visible to the warpgroup products"]));
        it.push("attnc_sync();".into());
        it.push("const unsigned Cb_ = Cs_ + cb_ * (2u * HB_ * LT_), Eb_ = Es_ + cb_ * (2u * HB_ * LT_);".into());
        it.extend(body);
        it.push("cb_ ^= 1;".into());
        it.push("h_ = hn_;".into());
        out.extend(indent(&it, 2));
        out.push("}".into());
        Ok(out)
    }

    /// Work item 1: `dK` and `dV` of a key block.
    fn key_block(&self) -> Result<Vec<String>, CudaEmitError> {
        let f = self.f;
        let mut out = vec!["const i64 kb0_ = blk_ * BL_, row0_ = kb0_ + warp_ * 16;  // the block's keys; the warp's".to_string()];
        out.extend(self.stage_pair(["A_", "B_"], "BL_", [(&f.k, "koff_"), (&f.v, "voff_")], ("kb0_", "N_"))?);
        out.push("attnc_cp_commit();".into());
        out.extend(Self::zero("dk_"));
        out.extend(Self::zero("dv_"));
        let stage = |b: &str, row: &str| self.stage_half(b, [(&f.q, "qoff_"), (&f.d_out, "dooff_")], (row, "M_"));
        let mut body = self.scores(
            "// Sᵀ = K Qᵀ and dPᵀ = V d_outᵀ: rows are the warp's keys, columns the half tile's queries.",
            "const int sr_ = nt_ * 8 + tg_ * 2 + (e_ & 1); const i64 i_ = x0_ + sr_, j_ = row0_ + g_ + (e_ >> 1) * 8;",
        )?;
        body.push("// dV += Pᵀ d_out, dK += dSᵀ Q".into());
        body.extend(self.accumulate("dv_", "s_", "Eb_"));
        body.extend(self.accumulate("dk_", "dp_", "Cb_"));
        if let Some(acc) = &f.dq_accum {
            body.extend(self.dq_added(acc)?);
        }
        body.extend(self.wg_lines(&["attnc_wg_wait0();  // before the buffers are reused"]));
        out.extend(self.half_tiles(&QUERY_HALVES, &stage, self.stage_stats("HB_", "x0_")?, body)?);
        if let Some(dk) = &f.dk {
            out.extend(self.store_rows("dk_", dk, "dkoff_", "qscale_", "N_", "D_")?);
        }
        if let Some(dv) = &f.dv {
            out.extend(self.store_rows("dv_", dv, "dvoff_", "1.0f", "N_", "DV_")?);
        }
        if !f.dx.is_empty() {
            out.extend(flush_item_sums(self.ints, f, self.p, self.offsets, "4")?);
        }
        Ok(out)
    }

    /// `dQ += dS K` for the half tile's queries, added atomically into `acc` (the fast mode):
    /// each warp's `dSᵀ` goes to `S_` as `dS` (queries × the block's keys); warp `w` forms
    /// queries `16 (w & 1) ..` and columns `(w >> 1) HD_/2 ..` (32 at a time where the width
    /// allows: four independent accumulators, else 16) against K in `A_`
    /// into `Q_`; then the block adds `Q_` to global memory four neighbouring columns at a time
    /// (one vector `red` on sm_90) where the row is 16-byte aligned.
    fn dq_added(&self, acc: &View) -> Result<Vec<String>, CudaEmitError> {
        let (mma, conv, step) = (self.mma, self.conv, self.f.step);
        let dst = ptr(acc.buf, DType::F32, true);
        let at = row_col(self.ints, acc, "dqaoff_", "r_", "c_")?;
        Ok(vec![
            "// dQ += dS K, added atomically; dS of the warp's 16 keys to shared memory first.".into(),
            "#pragma unroll".into(),
            "for (int nt_ = 0; nt_ < 4; ++nt_) {".into(),
            "  #pragma unroll".into(),
            format!("  for (int e_ = 0; e_ < 4; ++e_) S_[(nt_ * 8 + tg_ * 2 + (e_ & 1)) * LS_ + warp_ * 16 + g_ + (e_ >> 1) * 8] = {conv}(dp_[nt_][e_]);"),
            "}".into(),
            "attnc_sync();  // every warp's dS is in".into(),
            "{".into(),
            "  const int qr_ = (warp_ & 1) * 16, c0_ = (warp_ >> 1) * (HD_ / 2);".into(),
            "  unsigned a_[4][4];".into(),
            "  #pragma unroll".into(),
            "  for (int kk_ = 0; kk_ < 4; ++kk_) attnc_ldsm_x4(a_[kk_], Ss_ + 2u * (fs_ + qr_ * LS_ + kk_ * 16));".into(),
            "  constexpr int TW_ = (HD_ / 2) % 32 == 0 ? 32 : 16;  // columns at a time: four independent accumulators where the width allows".into(),
            "  #pragma unroll".into(),
            "  for (int t_ = 0; t_ < HD_ / 2; t_ += TW_) {".into(),
            "    float q_[TW_ / 8][4];".into(),
            "    #pragma unroll".into(),
            "    for (int u_ = 0; u_ < TW_ / 8; ++u_) { q_[u_][0] = 0.0f; q_[u_][1] = 0.0f; q_[u_][2] = 0.0f; q_[u_][3] = 0.0f; }".into(),
            "    #pragma unroll".into(),
            "    for (int kk_ = 0; kk_ < 4; ++kk_) {".into(),
            "      #pragma unroll".into(),
            "      for (int u_ = 0; u_ < TW_; u_ += 16) {".into(),
            "        unsigned b_[4];".into(),
            format!("        attnc_ldsm_x4_t(b_, As_ + 2u * ATTNC_BOFF_{step}(BL_, (lm_ & 1) * 8 + lr_ + kk_ * 16, (lm_ >> 1) * 8 + c0_ + t_ + u_));"),
            format!("        {mma}(q_[u_ / 8], a_[kk_], b_);"),
            format!("        {mma}(q_[u_ / 8 + 1], a_[kk_], b_ + 2);"),
            "      }".into(),
            "    }".into(),
            "    #pragma unroll".into(),
            "    for (int e_ = 0; e_ < TW_ / 2; ++e_)".into(),
            "      Q_[(qr_ + g_ + ((e_ & 3) >> 1) * 8) * LQ_ + c0_ + t_ + (e_ >> 2) * 8 + tg_ * 2 + (e_ & 1)] = q_[e_ >> 2][e_ & 3];".into(),
            "  }".into(),
            "}".into(),
            "attnc_sync();  // the half tile's dQ is in Q_".into(),
            format!("for (int e_ = tid_; e_ < HB_ * (HD_ / 4); e_ += {CUDA_FLASH_THREADS}) {{"),
            "  const int rr_ = e_ / (HD_ / 4), c_ = (e_ % (HD_ / 4)) * 4;".into(),
            "  const i64 r_ = x0_ + rr_;".into(),
            "  if (r_ >= M_ || c_ >= D_) continue;".into(),
            "  const float* x_ = &Q_[rr_ * LQ_ + c_];".into(),
            format!("  float* y_ = &{dst}[{at}];"),
            "  if (c_ + 4 <= D_ && ((unsigned long long)y_ & 15) == 0) attnc_red_add4(y_, dqscale_ * x_[0], dqscale_ * x_[1], dqscale_ * x_[2], dqscale_ * x_[3]);".into(),
            "  else for (int u_ = 0; u_ < 4 && c_ + u_ < D_; ++u_) attnc_red_add(y_ + u_, dqscale_ * x_[u_]);".into(),
            "}".into(),
        ])
    }

    /// Work item 2: `dQ` of a query tile.
    fn query_tile(&self) -> Result<Vec<String>, CudaEmitError> {
        let f = self.f;
        let Some(dq) = &f.dq else { return Ok(Vec::new()) };
        let mut out = vec!["const i64 q0_ = blk_ * BL_, row0_ = q0_ + warp_ * 16;  // the tile's rows; the warp's".to_string()];
        out.extend(self.stage_pair(["A_", "B_"], "BL_", [(&f.q, "qoff_"), (&f.d_out, "dooff_")], ("q0_", "M_"))?);
        out.push("attnc_cp_commit();".into());
        out.extend(self.stage_stats("BL_", "q0_")?);
        out.extend(Self::zero("dq_"));
        let stage = |b: &str, row: &str| self.stage_half(b, [(&f.k, "koff_"), (&f.v, "voff_")], (row, "N_"));
        let mut body = self.scores(
            "// S = Q Kᵀ and dP = d_out Vᵀ: rows are the warp's queries, columns the half tile's keys.",
            "const int sr_ = warp_ * 16 + g_ + (e_ >> 1) * 8; const i64 i_ = q0_ + sr_, j_ = x0_ + nt_ * 8 + tg_ * 2 + (e_ & 1);",
        )?;
        body.push("// dQ += dS K".into());
        body.extend(self.accumulate("dq_", "dp_", "Cb_"));
        body.extend(self.wg_lines(&["attnc_wg_wait0();  // before the buffers are reused"]));
        out.extend(self.half_tiles(&KEY_HALVES, &stage, Vec::new(), body)?);
        out.extend(self.store_rows("dq_", dq, "dqoff_", "dqscale_", "M_", "D_")?);
        Ok(out)
    }
}
