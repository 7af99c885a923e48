//! The flash backward kernel (SIMT, f32 compute) and the sum of its extra operands' gradients,
//! rendered from the schedule's [`FlashBwdKernel`]. A block has [`CUDA_BWD_KEYS`] threads and
//! one of two kinds of work item, so that no two blocks add into one value and every sum runs
//! in a fixed order:
//!
//! 1. A key chunk of one batch index (items `0 .. batch · key blocks`): one key per thread,
//!    holding its `k`, `v`, `dK` and `dV` rows; for every query row of every query tile of
//!    [`CUDA_BWD_ROWS`] rows the tile table does not skip, the row's `q`, `d_out`, `lse` and
//!    `delta` are staged in shared memory and each thread forms its score, weight, `dF` and
//!    `dS`, adding into `dK`, `dV` and the extra operands' gradients (partial sums per item,
//!    which [`emit_reduce`] adds in item order; contributions whose index depends on the
//!    positions are added by one thread in key order).
//! 2. A query tile of one batch index (the next `batch · query blocks` items, when `dQ` is
//!    asked for): `dQ` row by row, the row's `dS` against each key chunk (recomputed), staged
//!    in shared memory, then `dQ[i, c] = Σ_j dS_ij k_j[c]` with threads over columns.
//!
//! This is the correctness-first kernel (no tensor cores, `k`/`v` rows in thread-local
//! arrays); it is checked under the host emulation and compiled by NVRTC.

use super::cexpr::{Ints, delinearize, indent, load, ptr, round_to, store};
use super::ops;
use super::score::{ScoreCtx, score_lines};
use super::{CudaEmitError, KernelSource, Smem};
use attn_compiler::ir::semantics::Class;
use attn_compiler::ir::{DType, Dim, Weights};
use attn_compiler::schedule::policy::{CUDA_BWD_KEYS, CUDA_BWD_ROWS, CUDA_THREADS};
use attn_compiler::schedule::{FlashBwdKernel, Tuning, View};

/// The backward kernel of a flash backward step.
pub(super) fn emit(ints: &Ints, items: &str, f: &FlashBwdKernel) -> Result<KernelSource, CudaEmitError> {
    if f.dq_accum.is_some() {
        return Err(ints.fail("the SIMT flash backward writes dQ itself (no atomic sum)".into()));
    }
    let step = f.step;
    let keys = CUDA_BWD_KEYS;
    let mut body = vec![
        format!("constexpr int HD_ = ATTNC_HD_{step}, KT_ = {keys}, QR_ = {CUDA_BWD_ROWS}, T2_ = (HD_ + KT_ - 1) / KT_;"),
        "ATTNC_SHARED float Qs_[HD_], Ds_[HD_];  // the query row and its d_out".into(),
        "ATTNC_SHARED float st_[2];  // the row's lse and delta".into(),
        "ATTNC_SHARED float red_[KT_];  // one value per thread: dS, or a contribution to add".into(),
        "ATTNC_SHARED i64 at_[KT_];  // where each thread's contribution goes (-1: nowhere)".into(),
        "ATTNC_SHARED double wsum_[KT_ / 32];  // one sum per warp".into(),
        "const int tid_ = threadIdx.x;".into(),
    ];
    body.extend(sizes_head(ints, f)?);
    body.push("(void)nkb_; (void)red_; (void)at_; (void)st_; (void)wsum_;".into());
    let offsets = partials_head(ints, f, &mut body)?;
    let (mut it, p) = items_head(ints, f, items, &mut body)?;
    it.extend(item_start(f, "KT_"));
    let item_sums = f.item_sums();
    let cx = Cx { ints, f, p: &p, offsets: &offsets, item_sums: &item_sums };
    it.push("if (keys_) {".into());
    let mut key_lines = cx.keys_phase()?;
    key_lines.extend(cx.flush_sums()?);
    it.extend(indent(&key_lines, 2));
    it.push("}".into());
    if f.dq.is_some() {
        it.push("else {".into());
        it.extend(indent(&cx.query_phase()?, 2));
        it.push("}".into());
    }
    body.extend(indent(&it, 2));
    body.push("}".into());
    let _ = CUDA_THREADS;
    Ok(KernelSource { threads: keys as u32, items_per_block: 1, smem: Smem::None, body })
}

/// The extra operands' per-item partial sums (`part_`, `per_item_` floats' worth per item, the
/// gradients in turn): their lines into `body`; returns where each gradient starts.
pub(super) fn partials_head(ints: &Ints, f: &FlashBwdKernel, body: &mut Vec<String>) -> Result<Vec<String>, CudaEmitError> {
    body.push(format!("float* __restrict__ part_ = {};", ptr(f.partials, DType::F32, true)));
    body.push("(void)part_;".into());
    let mut per_item = Vec::new();
    let mut offsets = Vec::new();
    for (_, x) in &f.dx {
        offsets.push(if per_item.is_empty() { "0LL".to_string() } else { format!("({})", per_item.join(" + ")) });
        per_item.push(ints.dim(&Dim::product(&x.shape))?);
    }
    body.push(format!("const i64 per_item_ = {};", if per_item.is_empty() { "0LL".to_string() } else { per_item.join(" + ") }));
    Ok(offsets)
}

/// At a work item's start (`threads` the block's threads): a key item's partial sums zeroed
/// (`mine_`; each a double kept in two floats, `attnc_acc2`) and the item-level register sums
/// (`sum_`, one per load whose index depends on batch positions only; in double: a bias's
/// gradient sums every score of the item, with much cancellation).
pub(super) fn item_start(f: &FlashBwdKernel, threads: &str) -> Vec<String> {
    let n = f.item_sums().len().max(1);
    vec![
        "float* __restrict__ mine_ = part_ + (keys_ ? w_ : 0) * 2 * per_item_;  // this item's partial sums".into(),
        format!("if (keys_) for (i64 e_ = tid_; e_ < 2 * per_item_; e_ += {threads}) mine_[e_] = 0.0f;"),
        format!("double sum_[{n}];"),
        format!("for (int l_ = 0; l_ < {n}; ++l_) sum_[l_] = 0.0;"),
        "(void)mine_; (void)sum_;".into(),
    ]
}

/// Adds a key item's register sums (`sum_`) into its partial sums, in a fixed order: each warp's
/// by a shuffle tree, then the `warps` warps' (`wsum_`, shared) by thread 0.
pub(super) fn flush_item_sums(
    ints: &Ints,
    f: &FlashBwdKernel,
    p: &[String],
    offsets: &[String],
    warps: &str,
) -> Result<Vec<String>, CudaEmitError> {
    let mut out = Vec::new();
    let mut pos = p.to_vec();
    pos.extend(["0LL".to_string(), "0LL".to_string()]);
    let cx = ScoreCtx { ints, s: None, pos: &pos, extras: &f.extras };
    for (k, (l, item)) in f.grad.loads.iter().zip(f.item_sums()).enumerate() {
        if !item {
            continue;
        }
        let Some(slot) = f.dx.iter().position(|(x, _)| *x == l.input) else { continue };
        let mut il = ops::Lines::new(&format!("z{k}"));
        let flat = flat_index(ints, f, &cx, &mut il, l)?;
        out.push("attnc_sync();".into());
        out.push(format!("{{ const double w_sum_ = attnc_warp_sum_d(sum_[{k}]); if (tid_ % 32 == 0) wsum_[tid_ / 32] = w_sum_; }}"));
        out.push("attnc_sync();".into());
        out.push("if (tid_ == 0) {".into());
        out.extend(indent(&il.lines, 2));
        out.push("  double t_ = 0.0;".into());
        out.push(format!("  for (int u_ = 0; u_ < {warps}; ++u_) t_ += wsum_[u_];"));
        out.push(format!("  attnc_acc2(mine_ + 2 * ({} + {}), t_);", offsets[slot], flat.join(" + ")));
        out.push("}".into());
    }
    out.push("attnc_sync();  // the next item reuses the shared arrays".into());
    Ok(out)
}

/// Load `k`'s contribution to its operand's gradient at one score, `dF · ∂F/∂x` (`df_` in
/// scope): the statements, then the expression.
pub(super) fn df_term(cx: &ScoreCtx, k: usize, l: &attn_compiler::ir::grad::LoadGrad) -> Result<(Vec<String>, String), CudaEmitError> {
    let mut lines = ops::Lines::new(&format!("x{k}"));
    let d = cx.eval(&mut lines, &l.d)?;
    Ok((lines.lines, format!("df_ * {}", ops::convert(&d, Class::Float))))
}

/// The row-major offset of a load's clamped indices within its operand (its gradient's
/// element), as terms to add; statements into `il`.
pub(super) fn flat_index(
    ints: &Ints,
    f: &FlashBwdKernel,
    cx: &ScoreCtx,
    il: &mut ops::Lines,
    l: &attn_compiler::ir::grad::LoadGrad,
) -> Result<Vec<String>, CudaEmitError> {
    let x = &f.extras[l.input];
    let mut flat = Vec::new();
    let mut stride = "1LL".to_string();
    for (axis, e) in l.index.iter().enumerate().rev() {
        let v = cx.eval(il, e)?;
        let size = ints.dim(&x.shape[axis])?;
        flat.push(format!("attnc_clampi((i64){}, {size}) * {stride}", ops::convert(&v, Class::Int)));
        stride = format!("{stride} * {size}");
    }
    Ok(flat)
}

/// The sizes `M_`, `N_`, `D_`, `DV_`, the tile table `tbl_` and its shape (`nqb_` query blocks,
/// `nkb_` key blocks, `entry_` bytes per entry): both backward kernels' first constants.
pub(super) fn sizes_head(ints: &Ints, f: &FlashBwdKernel) -> Result<Vec<String>, CudaEmitError> {
    let (m, n, d, dv) = f.sizes();
    let tuning = |t| ints.tuning(f.step, t);
    let mut out = vec![
        format!("const i64 M_ = {}, N_ = {}, D_ = {}, DV_ = {};", ints.dim(&m)?, ints.dim(&n)?, ints.dim(&d)?, ints.dim(&dv)?),
        format!(
            "const i64 nqb_ = {}, nkb_ = {}, entry_ = {};",
            tuning(Tuning::QueryBlocks)?,
            tuning(Tuning::KeyBlocks)?,
            tuning(Tuning::TileEntryBytes)?
        ),
        // The tile tables, one per `tdiv_` consecutive batch indices (items_head picks the
        // item's as `tbl_`).
        format!("const u8* __restrict__ tbl0_ = {};", ptr(f.tiles, DType::Bool, false)),
        format!("const i64 tdiv_ = {};", tuning(Tuning::TileBatchDiv)?),
    ];
    out.extend(super::flash::dropout_head(ints, f.spec.dropout.as_ref(), &f.extras)?);
    Ok(out)
}

/// What both backward kernels start with: the query's folded scale `qscale_` (q stands for
/// `qscale_ · q`) and the one the graph applies to dQ, `dqscale_`, then the loop over work
/// items, into `body`. Returns the work item's first statements (its batch index `item_`, its key
/// chunk or query tile `blk_` by `keys_`, the operands' batch offsets) and the batch positions.
pub(super) fn items_head(
    ints: &Ints,
    f: &FlashBwdKernel,
    items: &str,
    body: &mut Vec<String>,
) -> Result<(Vec<String>, Vec<String>), CudaEmitError> {
    let batch = f.batch().to_vec();
    for (name, c) in [("qscale_", &f.q_scale), ("dqscale_", &f.dq_scale)] {
        let value = match c {
            Some(c) => {
                let mut l = ops::Lines::new(name.trim_end_matches('_'));
                let cx = ScoreCtx { ints, s: None, pos: &[], extras: &f.extras };
                let v = cx.eval(&mut l, c)?;
                body.extend(l.lines);
                ops::convert(&v, Class::Float)
            }
            None => "1.0f".to_string(),
        };
        body.push(format!("const float {name} = {value};"));
    }
    let nb = if batch.is_empty() { "1LL".to_string() } else { ints.dim(&Dim::product(&batch))? };
    body.push(format!("const i64 kitems_ = {nb} * nkb_;  // key-chunk items; query-tile items follow"));
    body.push(format!("for (i64 w_ = blockIdx.x; w_ < {items}; w_ += gridDim.x) {{"));
    let mut it = vec![
        "const bool keys_ = w_ < kitems_;".to_string(),
        "const i64 item_ = keys_ ? w_ / nkb_ : (w_ - kitems_) / nqb_;  // the batch index".into(),
        "const i64 blk_ = keys_ ? w_ % nkb_ : (w_ - kitems_) % nqb_;  // its key chunk or query tile".into(),
        "const u8* __restrict__ tbl_ = tbl0_ + (item_ / tdiv_) * (nqb_ * nkb_ * entry_);  // its tile table".into(),
    ];
    let p = delinearize(ints, &mut it, "item_", &batch, "p")?;
    for (name, view) in [("qoff_", &f.q), ("koff_", &f.k), ("voff_", &f.v), ("dooff_", &f.d_out)] {
        it.push(format!("const i64 {name} = {};", batch_offset(ints, view, &batch, &p)?));
    }
    if let Some((l, _)) = &f.lse {
        it.push(format!("const i64 loff_ = {};", stat_offset(ints, l, &batch, &p)?));
    }
    for (name, view) in [("dqoff_", &f.dq), ("dqaoff_", &f.dq_accum), ("dkoff_", &f.dk), ("dvoff_", &f.dv)] {
        if let Some(view) = view {
            it.push(format!("const i64 {name} = {};", batch_offset(ints, view, &batch, &p)?));
        }
    }
    Ok((it, p))
}

/// The chain rule at one score, shared by both backward kernels: the score (`sc_`, narrowing
/// `keep_`, which must hold whether the key exists) from the raw product `cx.s`, the weight
/// `p_`, `dF` `df_` and `dS` `ds_` (floats the caller declares, 0) from `dP` (`dp`) and the
/// row's `(lse, delta)` (softmax weights; sigmoid weights need neither). `fast`: the weight's
/// exponential on the special-function unit (the tensor-core kernel's f16/bf16 weights, as the
/// forward's), else `expf`.
pub(super) fn weight_and_ds(
    cx: &ScoreCtx,
    f: &FlashBwdKernel,
    dp: &str,
    (lse, delta): (&str, &str),
    fast: bool,
) -> Result<Vec<String>, CudaEmitError> {
    let mut out = score_lines(cx, &f.spec.score, f.spec.mask.as_ref(), "sc")?;
    // Dropout: `dP` is `z · d_out · v`, and the values' gradient takes `z · p` (`p_` on return).
    let (dz, dp) = match (&f.spec.dropout, cx.pos) {
        (Some(_), [.., i, j]) => {
            out.push(format!("const float dz_ = {};", super::flash::dropout_factor("item_", i, j)));
            (true, format!("(dz_ * {dp})"))
        }
        _ => (false, dp.to_string()),
    };
    if f.spec.weights == Weights::Softmax {
        let exp = if fast { format!("attnc_exp2_fast((sc_ - {lse}) * ATTNC_LOG2E)") } else { format!("expf(sc_ - {lse})") };
        out.push(format!("p_ = (keep_ && {lse} != -ATTNC_INF) ? {exp} : 0.0f;"));
        out.push(format!("df_ = p_ * ({dp} - {delta});"));
    } else {
        out.push("p_ = keep_ ? attnc_sigmoid(sc_) : 0.0f;".into());
        out.push(format!("df_ = {dp} * p_ * (1.0f - p_);"));
    }
    if dz {
        out.push("p_ *= dz_;".into());
    }
    out.push("if (df_ != 0.0f) {  // where dF is 0 nothing flows, even through an inf or NaN derivative".into());
    let mut l = ops::Lines::new("g");
    let dsv = cx.eval(&mut l, &f.grad.ds)?;
    out.extend(indent(&l.lines, 2));
    out.push(format!("  ds_ = df_ * {};", ops::convert(&dsv, Class::Float)));
    out.push("}".into());
    Ok(out)
}

/// The offset of a `[..b', rows, width]` view's batch index `p` (broadcast axes step 0).
pub(super) fn batch_offset(ints: &Ints, view: &View, batch: &[Dim], p: &[String]) -> Result<String, CudaEmitError> {
    let strides = view.batch_strides(batch);
    let bview = View { shape: batch.to_vec(), strides, ..view.clone() };
    ints.offset(&bview, p)
}

/// The offset of a `[..b, M]` row statistic's batch index `p`.
pub(super) fn stat_offset(ints: &Ints, view: &View, batch: &[Dim], p: &[String]) -> Result<String, CudaEmitError> {
    let nb = batch.len();
    let bview = View { shape: batch.to_vec(), strides: view.strides[..nb].to_vec(), ..view.clone() };
    ints.offset(&bview, p)
}

/// `base + row * stride + col * stride` of a `[.., rows, width]` view's element within the batch
/// index whose offset is `base`.
pub(super) fn row_col(ints: &Ints, view: &View, base: &str, row: &str, col: &str) -> Result<String, CudaEmitError> {
    let r = view.shape.len();
    let term = |i: &str, s: &Dim| -> Result<String, CudaEmitError> {
        Ok(if s.as_const() == Some(1) { i.to_string() } else { format!("{i} * {}", ints.dim(s)?) })
    };
    Ok(format!("{base} + {} + {}", term(row, &view.strides[r - 2])?, term(col, &view.strides[r - 1])?))
}

/// What the kernel's phases share.
struct Cx<'a> {
    ints: &'a Ints<'a>,
    f: &'a FlashBwdKernel,
    p: &'a [String],
    /// Where each extra gradient starts in an item's partial sums.
    offsets: &'a [String],
    /// Per load of the derivative: whether it sums per item in a register.
    item_sums: &'a [bool],
}

impl Cx<'_> {
    /// The batch positions, then `i` and `j` (the score's position for [`ScoreCtx`]).
    fn positions(&self, i: &str, j: &str) -> Vec<String> {
        let mut pos = self.p.to_vec();
        pos.extend([i.to_string(), j.to_string()]);
        pos
    }

    /// `row * stride + col` of a view's element within its batch index.
    fn at(&self, view: &View, base: &str, row: &str, col: &str) -> Result<String, CudaEmitError> {
        row_col(self.ints, view, base, row, col)
    }

    /// A float element of a `[.., rows, width]` operand.
    fn elem(&self, view: &View, base: &str, row: &str, col: &str) -> Result<String, CudaEmitError> {
        let raw = ops::CVal { text: load(view.buf, view.dtype, &self.at(view, base, row, col)?), class: Class::of(view.dtype) };
        Ok(ops::convert(&raw, Class::Float))
    }

    /// Stages query row `i_` (its q and d_out, lse and `delta = Σ d_out ∘ out`) in shared
    /// memory.
    fn stage_row(&self) -> Result<Vec<String>, CudaEmitError> {
        let f = self.f;
        let mut out = vec![
            "attnc_sync();  // every thread is done with the previous row".into(),
            "for (int c_ = tid_; c_ < HD_; c_ += KT_) {".to_string(),
            format!("  Qs_[c_] = c_ < D_ ? qscale_ * {} : 0.0f;", self.elem(&f.q, "qoff_", "i_", "(i64)c_")?),
            format!("  Ds_[c_] = c_ < DV_ ? {} : 0.0f;", self.elem(&f.d_out, "dooff_", "i_", "(i64)c_")?),
            "}".into(),
        ];
        if let Some((l, _)) = &f.lse {
            let delta = f.delta.as_ref().ok_or_else(|| self.ints.fail("the flash backward's rows' delta has no step".into()))?;
            let s = &l.strides[l.strides.len() - 1];
            let off = if s.as_const() == Some(1) { "loff_ + i_".to_string() } else { format!("loff_ + i_ * {}", self.ints.dim(s)?) };
            // The row's lse, and its delta (the step before summed it).
            out.push("if (tid_ == 0) {".into());
            out.push(format!("  st_[0] = {};", load(l.buf, DType::F32, &off)));
            out.push(format!("  st_[1] = {};", load(delta.buf, DType::F32, &off)));
            out.push("}".into());
        }
        out.push("attnc_sync();".into());
        Ok(out)
    }

    /// Statements computing, for this thread's key `j_` (`kin_`: it exists) against the staged
    /// row `i_`: `p_` (the weight), `df_` and `ds_`, with the score `s_` from `sdot` and
    /// `dp_` from `pdot` (expressions).
    fn score_row(&self, sdot: &str, pdot: &str) -> Result<Vec<String>, CudaEmitError> {
        let f = self.f;
        let pos = self.positions("i_", "j_");
        let cx = ScoreCtx { ints: self.ints, s: Some("s_"), pos: &pos, extras: &f.extras };
        let mut out = vec![
            "float p_ = 0.0f, df_ = 0.0f, ds_ = 0.0f;".to_string(),
            "if (kin_) {".into(),
            format!("  const float s_ = {sdot};"),
            format!("  const float dp_ = {pdot};"),
            "  bool keep_ = true;".into(),
        ];
        out.extend(indent(&weight_and_ds(&cx, f, "dp_", ("st_[0]", "st_[1]"), false)?, 2));
        out.push("}".into());
        Ok(out)
    }

    /// Phase 1: `dK`, `dV` and the extra operands' gradients, key chunk by key chunk.
    fn keys_phase(&self) -> Result<Vec<String>, CudaEmitError> {
        let f = self.f;
        let mut out = vec![
            "{".to_string(),
            "  const i64 k0_ = blk_ * KT_;".into(),
            "  const i64 j_ = k0_ + tid_;".into(),
            "  const bool kin_ = j_ < N_;".into(),
            "  float kj_[HD_], vj_[HD_], dk_[HD_], dv_[HD_];".into(),
            "  for (int c_ = 0; c_ < HD_; ++c_) {".into(),
            format!("    kj_[c_] = (kin_ && c_ < D_) ? {} : 0.0f;", self.elem(&f.k, "koff_", "j_", "(i64)c_")?),
            format!("    vj_[c_] = (kin_ && c_ < DV_) ? {} : 0.0f;", self.elem(&f.v, "voff_", "j_", "(i64)c_")?),
            "    dk_[c_] = 0.0f; dv_[c_] = 0.0f;".into(),
            "  }".into(),
            "  for (i64 qt_ = 0; qt_ < nqb_; ++qt_) {".into(),
            "    const int cls_ = tbl_[(qt_ * nkb_ + k0_ / KT_) * entry_];".into(),
            "    if (cls_ == 0) continue;  // fully masked (the same for the whole block)".into(),
            "    for (int r_ = 0; r_ < QR_; ++r_) {".into(),
            "      const i64 i_ = qt_ * QR_ + r_;".into(),
            "      if (i_ >= M_) break;".into(),
        ];
        let mut row = self.stage_row()?;
        row.extend(self.score_row(
            "[&] { float t_ = 0.0f; for (int c_ = 0; c_ < HD_; ++c_) t_ += Qs_[c_] * kj_[c_]; return t_; }()",
            "[&] { float t_ = 0.0f; for (int c_ = 0; c_ < HD_; ++c_) t_ += Ds_[c_] * vj_[c_]; return t_; }()",
        )?);
        row.push("for (int c_ = 0; c_ < HD_; ++c_) { dv_[c_] += p_ * Ds_[c_]; dk_[c_] += ds_ * Qs_[c_]; }".into());
        row.extend(self.extra_contributions()?);
        out.extend(indent(&row, 6));
        out.push("    }".into());
        out.push("  }".into());
        for (acc, view, base, width) in [("dk_", &f.dk, "dkoff_", "D_"), ("dv_", &f.dv, "dvoff_", "DV_")] {
            if let Some(view) = view {
                let value = round_to(view.dtype, &format!("{acc}[c_]"));
                out.push(format!(
                    "  if (kin_) for (int c_ = 0; c_ < {width}; ++c_) {}",
                    store(view.buf, view.dtype, &self.at(view, base, "j_", "(i64)c_")?, &value)
                ));
            }
        }
        out.push("}".into());
        Ok(out)
    }

    /// Each load's `dF · ∂F/∂x` for this thread's score: into its register sum (item-level
    /// index), or staged and added by thread 0 in key order.
    fn extra_contributions(&self) -> Result<Vec<String>, CudaEmitError> {
        let f = self.f;
        let mut out = Vec::new();
        let pos = self.positions("i_", "j_");
        let cx = ScoreCtx { ints: self.ints, s: Some("s_"), pos: &pos, extras: &f.extras };
        for (k, l) in f.grad.loads.iter().enumerate() {
            let Some(slot) = f.dx.iter().position(|(x, _)| *x == l.input) else { continue };
            let (lines, contrib) = df_term(&cx, k, l)?;
            // Recompute the score for the expressions (`s_` lives inside the score block).
            let mut body = vec![format!(
                "const float s_ = [&] {{ float t_ = 0.0f; for (int c_ = 0; c_ < HD_; ++c_) t_ += Qs_[c_] * kj_[c_]; return t_; }}();"
            )];
            body.extend(lines);
            if self.item_sums[k] {
                out.push("if (kin_ && df_ != 0.0f) {".into());
                out.extend(indent(&body, 2));
                out.push(format!("  sum_[{k}] += (double)({contrib});"));
                out.push("}".into());
            } else {
                let mut il = ops::Lines::new(&format!("y{k}"));
                let flat = self.flat_index(&cx, &mut il, l)?;
                out.push("red_[tid_] = 0.0f; at_[tid_] = -1;".into());
                out.push("if (kin_ && df_ != 0.0f) {".into());
                out.extend(indent(&body, 2));
                out.extend(indent(&il.lines, 2));
                out.push(format!("  red_[tid_] = {contrib};"));
                out.push(format!("  at_[tid_] = {} + {};", self.offsets[slot], flat.join(" + ")));
                out.push("}".into());
                out.push("attnc_sync();".into());
                out.push(
                    "if (tid_ == 0) for (int t_ = 0; t_ < KT_; ++t_) if (at_[t_] >= 0) attnc_acc2(mine_ + 2 * at_[t_], (double)red_[t_]);"
                        .into(),
                );
                out.push("attnc_sync();".into());
            }
        }
        Ok(out)
    }

    /// Phase 2: each query row's `dQ`, its `dS` recomputed against every live key chunk.
    fn query_phase(&self) -> Result<Vec<String>, CudaEmitError> {
        let f = self.f;
        let Some(dq) = &f.dq else { return Ok(Vec::new()) };
        let mut out = vec![
            "{".to_string(),
            "  const i64 qt_ = blk_;".into(),
            "  for (int r_ = 0; r_ < QR_; ++r_) {".into(),
            "    const i64 i_ = qt_ * QR_ + r_;".into(),
            "    if (i_ >= M_) break;".into(),
        ];
        let mut row = self.stage_row()?;
        row.push("float dq_[T2_];".into());
        row.push("for (int t2_ = 0; t2_ < T2_; ++t2_) dq_[t2_] = 0.0f;".into());
        row.push("for (i64 k0_ = 0; k0_ < N_; k0_ += KT_) {".into());
        let mut chunk = vec![
            "const int cls_ = tbl_[(qt_ * nkb_ + k0_ / KT_) * entry_];".to_string(),
            "if (cls_ == 0) continue;".into(),
            "const i64 j_ = k0_ + tid_;".into(),
            "const bool kin_ = j_ < N_;".into(),
        ];
        let kdot = format!(
            "[&] {{ float t_ = 0.0f; for (int c_ = 0; c_ < D_; ++c_) t_ += Qs_[c_] * {}; return t_; }}()",
            self.elem(&f.k, "koff_", "j_", "(i64)c_")?
        );
        let vdot = format!(
            "[&] {{ float t_ = 0.0f; for (int c_ = 0; c_ < DV_; ++c_) t_ += Ds_[c_] * {}; return t_; }}()",
            self.elem(&f.v, "voff_", "j_", "(i64)c_")?
        );
        chunk.extend(self.score_row(&kdot, &vdot)?);
        chunk.push("red_[tid_] = ds_;".into());
        chunk.push("attnc_sync();".into());
        chunk.push("for (int t2_ = 0; t2_ < T2_; ++t2_) {".into());
        chunk.push("  const i64 c_ = tid_ + (i64)KT_ * t2_;".into());
        chunk.push("  if (c_ >= D_) continue;".into());
        chunk.push(format!(
            "  for (int t_ = 0; t_ < KT_ && k0_ + t_ < N_; ++t_) if (red_[t_] != 0.0f) dq_[t2_] += red_[t_] * {};",
            self.elem(&f.k, "koff_", "(k0_ + t_)", "c_")?
        ));
        chunk.push("}".into());
        chunk.push("attnc_sync();".into());
        row.extend(indent(&chunk, 2));
        row.push("}".into());
        row.push("for (int t2_ = 0; t2_ < T2_; ++t2_) {".into());
        row.push("  const i64 c_ = tid_ + (i64)KT_ * t2_;".into());
        let value = round_to(dq.dtype, "(dqscale_ * dq_[t2_])");
        row.push(format!("  if (c_ < D_) {}", store(dq.buf, dq.dtype, &self.at(dq, "dqoff_", "i_", "c_")?, &value)));
        row.push("}".into());
        out.extend(indent(&row, 4));
        out.push("  }".into());
        out.push("}".into());
        Ok(out)
    }

    /// [`flat_index`] of this kernel's step.
    fn flat_index(&self, cx: &ScoreCtx, il: &mut ops::Lines, l: &attn_compiler::ir::grad::LoadGrad) -> Result<Vec<String>, CudaEmitError> {
        flat_index(self.ints, self.f, cx, il, l)
    }

    /// [`flush_item_sums`] over the block's warps.
    fn flush_sums(&self) -> Result<Vec<String>, CudaEmitError> {
        flush_item_sums(self.ints, self.f, self.p, self.offsets, "KT_ / 32")
    }
}

/// The sum of a flash backward's per-item partial sums into its extra operands' gradients: one
/// thread per gradient element, items added in order.
pub(super) fn emit_reduce(ints: &Ints, items: &str, f: &FlashBwdKernel) -> Result<KernelSource, CudaEmitError> {
    let batch = f.batch().to_vec();
    let count = if batch.is_empty() { "1LL".to_string() } else { ints.dim(&Dim::product(&batch))? };
    let chunks = ints.tuning(f.step, Tuning::KeyBlocks)?;
    let mut body = vec![
        format!("const i64 nitems_ = {count} * {chunks};  // the key-chunk items"),
        format!("const float* __restrict__ part_ = {};", ptr(f.partials, DType::F32, false)),
    ];
    let mut start = "0LL".to_string();
    let mut ranges = Vec::new();
    for (_, x) in &f.dx {
        let n = ints.dim(&Dim::product(&x.shape))?;
        let end = format!("({start} + {n})");
        ranges.push((start.clone(), end.clone(), x));
        start = end;
    }
    body.push(format!("const i64 per_item_ = {start};"));
    body.push(format!(
        "for (i64 e_ = (i64)blockIdx.x * {CUDA_THREADS} + threadIdx.x; e_ < {items}; e_ += (i64)gridDim.x * {CUDA_THREADS}) {{"
    ));
    body.push("  double t_ = 0.0;".into());
    body.push("  for (i64 w_ = 0; w_ < nitems_; ++w_) {".into());
    body.push("    const float* h_ = part_ + 2 * (w_ * per_item_ + e_);  // a double in two floats".into());
    body.push("    t_ += (double)h_[0] + (double)h_[1];".into());
    body.push("  }".into());
    for (lo, hi, x) in ranges {
        let value = round_to(x.dtype, "(float)t_");
        body.push(format!("  if (e_ >= {lo} && e_ < {hi}) {}", store(x.buf, x.dtype, &format!("e_ - {lo}"), &value)));
    }
    body.push("}".into());
    Ok(KernelSource { threads: CUDA_THREADS, items_per_block: i64::from(CUDA_THREADS), smem: Smem::None, body })
}
