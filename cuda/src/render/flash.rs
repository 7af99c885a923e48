//! Flash attention kernels, rendered from the schedule's [`FlashKernel`] (its variant, views,
//! analyses) and the integer table: online softmax (or sigmoid weights) over key tiles staged
//! in shared memory, the score modification and mask inlined ([`super::score`]), fully masked
//! tiles skipped through the tile table, K/V batch axes of size 1 read with stride 0 (GQA and
//! MQA without copies), and the position-free scale applied to `q · k` (`alpha`). Work item =
//! (batch index, query block, key split), as on the CPU. Three variants:
//!
//! - `TensorCore`: q, k, v all f16 or all bf16. 4 warps, `16 · ATTNC_MT_{step}` query rows
//!   per warp (`ATTNC_MT_{step}` m-tiles: each K and V fragment read from shared memory feeds
//!   that many `mma`s), key tiles of `ATTNC_BN_{step}`; S = QKᵀ and O += PV with
//!   `mma.sync.m16n8k16` (f32 accumulation), P rounded to the input type as FlashAttention-2
//!   does; row statistics in registers, reduced over the 4 lanes that share a row.
//! - `Simt`: any other dtypes, in f32. 4 warps × 4 query rows, key tiles of 32 (one key per
//!   lane); each warp keeps its rows' O in registers (lane `l` owns columns `l + 32t`).
//! - `SplitKv` (constant query length ≤ 4): each warp takes one work item's key split for all
//!   query rows, reading K/V rows coalesced, and writes the rows (one split) or the split's
//!   partial state (`max, sum, acc`) that the merge kernel combines.
//!
//! Head widths are padded to `ATTNC_HD_{step}` (a multiple of 32 up to 256, set at compile
//! time from the run's dims); loads beyond the real width read 0.

use super::cexpr::{Ints, delinearize, indent, load_ptr, ptr, round_to, storage, store};
use super::ops::{self, Lines};
use super::score::{ScoreCtx, score_lines};
use super::{CudaEmitError, KernelSource, Smem};
use attn_compiler::ir::semantics::Class;
use attn_compiler::ir::{DType, Dim, Pair, Weights};
use attn_compiler::schedule::policy::{CUDA_FLASH_THREADS, CUDA_LANE_KEYS, CUDA_MMA_ROWS, CUDA_ROW_WARPS, CUDA_SIMT_ROWS, CUDA_THREADS};
use attn_compiler::schedule::{FlashKernel, Tuning, Variant, View};

/// What every flash kernel reads, as C names and expressions.
struct Flash<'a> {
    ints: &'a Ints<'a>,
    f: &'a FlashKernel,
    softmax: bool,
    batch: Vec<Dim>,
}

impl<'a> Flash<'a> {
    fn new(ints: &'a Ints<'a>, f: &'a FlashKernel) -> Flash<'a> {
        Flash { ints, f, softmax: f.spec.weights == Weights::Softmax, batch: f.batch().to_vec() }
    }

    fn tuning(&self, t: Tuning) -> Result<String, CudaEmitError> {
        self.ints.tuning(self.f.step, t)
    }

    /// Sizes, the scale, the K/V/table pointers: before the work-item loop.
    fn head(&self) -> Result<Vec<String>, CudaEmitError> {
        let (m, n, d, dv) = self.f.sizes();
        let i = self.ints;
        let (k, v) = (&self.f.k, &self.f.v);
        let mut l = Lines::new("a");
        let ctx = ScoreCtx { ints: i, s: None, pos: &[], extras: &self.f.extras };
        let alpha = match &self.f.analysis.alpha {
            Some(a) => ops::convert(&ctx.eval(&mut l, a)?, Class::Float),
            None => "1.0f".to_string(),
        };
        let mut out = l.lines;
        out.push(format!("const i64 M_ = {}, N_ = {}, D_ = {}, DV_ = {};", i.dim(&m)?, i.dim(&n)?, i.dim(&d)?, i.dim(&dv)?));
        out.push(format!("const float alpha_ = {alpha};"));
        out.push(format!(
            "const i64 nqb_ = {}, nkb_ = {}, entry_ = {};",
            self.tuning(Tuning::QueryBlocks)?,
            self.tuning(Tuning::KeyBlocks)?,
            self.tuning(Tuning::TileEntryBytes)?
        ));
        out.push(format!("const i64 splits_ = {}, kps_ = {};", self.tuning(Tuning::Splits)?, self.tuning(Tuning::KeysPerSplit)?));
        out.push(format!("const {}* __restrict__ K_ = {};", storage(k.dtype), ptr(k.buf, k.dtype, false)));
        out.push(format!("const {}* __restrict__ V_ = {};", storage(v.dtype), ptr(v.buf, v.dtype, false)));
        // The tile tables, one per `tdiv_` consecutive batch indices (`item` picks the item's as
        // `tbl_`).
        out.push(format!("const u8* __restrict__ tbl0_ = {};", ptr(self.f.tiles, attn_compiler::ir::DType::Bool, false)));
        out.push(format!("const i64 tdiv_ = {};", self.tuning(Tuning::TileBatchDiv)?));
        out.extend(dropout_head(self.ints, self.f.spec.dropout.as_ref(), &self.f.extras)?);
        Ok(out)
    }

    /// The statement scaling the weight `p` of score `(i, j)` of batch index `bz_` by dropout's
    /// factor (none without dropout).
    fn drop(&self, p: &str, i: &str, j: &str) -> Vec<String> {
        if self.f.spec.dropout.is_none() {
            return Vec::new();
        }
        vec![format!("{p} *= {};", dropout_factor("bz_", i, j))]
    }

    /// Work item `w_` decoded: split `sp_`, query block `qb_`, batch position `p*`, and the
    /// batch offsets of q, k, v and the output.
    ///
    /// With `heavy_first`, query blocks run downwards within each batch index, so that under
    /// a causal mask the blocks with the most live key tiles start first. (The batch index stays
    /// the slowest: the blocks in flight together share K and V in L2.)
    fn item(&self, out: &mut Vec<String>, heavy_first: bool) -> Result<Vec<String>, CudaEmitError> {
        out.push(if heavy_first {
            "const i64 sp_ = w_ % splits_, t_ = w_ / splits_, qb_ = nqb_ - 1 - t_ % nqb_, bz_ = t_ / nqb_;".into()
        } else {
            "const i64 sp_ = w_ % splits_, t_ = w_ / splits_, qb_ = t_ % nqb_, bz_ = t_ / nqb_;".into()
        });
        out.push("const u8* __restrict__ tbl_ = tbl0_ + (bz_ / tdiv_) * (nqb_ * nkb_ * entry_);  // its tile table".into());
        let p = delinearize(self.ints, out, "bz_", &self.batch, "p")?;
        for (name, view) in [("qoff_", &self.f.q), ("koff_", &self.f.k), ("voff_", &self.f.v), ("ooff_", &self.f.out)] {
            let strides = view.batch_strides(&self.batch);
            let bview = View { shape: self.batch.clone(), strides, ..view.clone() };
            out.push(format!("const i64 {name} = {};", self.ints.offset(&bview, &p)?));
        }
        out.push("(void)sp_; (void)koff_; (void)voff_;".into());
        // A paged K or V: its batch index's row of the block table.
        for (name, view, paging) in [("ktab_", &self.f.k, &self.f.k_paging), ("vtab_", &self.f.v, &self.f.v_paging)] {
            let Some(pg) = paging else { continue };
            let lead = self.batch.len().saturating_sub(view.shape.len().saturating_sub(2));
            let mut idx = vec!["0LL".to_string(); 2];
            idx[0] = p
                .get(lead + pg.axis)
                .cloned()
                .ok_or_else(|| self.ints.fail("a paged operand's table axis is no batch axis".to_string()))?;
            let row = self.ints.offset(&pg.table, &idx)?;
            out.push(format!("const int* __restrict__ {name} = {} + {row};", ptr(pg.table.buf, DType::I32, false)));
        }
        if let Some(w) = self.weight() {
            // The additive weight's axes before its last are batch axes, right-aligned.
            let own = w.shape.len().saturating_sub(1);
            let lead = self.batch.len().saturating_sub(own);
            let strides = (0..self.batch.len())
                .map(|t| match t.checked_sub(lead) {
                    Some(a) if w.shape[a].as_const() != Some(1) => w.strides[a].clone(),
                    _ => Dim::constant(0),
                })
                .collect();
            let bview = View { shape: self.batch.clone(), strides, ..w.clone() };
            out.push(format!("const i64 woff_ = {};", self.ints.offset(&bview, &p)?));
        }
        out.extend(self.lse_offset(&p)?);
        Ok(p)
    }

    /// The additive weight vector (dense along its last axis), when the scores are additive.
    fn weight(&self) -> Option<&View> {
        match self.f.spec.pair {
            Pair::Dot => None,
            Pair::Additive { weight } => self.f.extras.get(weight),
        }
    }

    /// The statements adding row `r_`'s score against key row `lane_` to `s_`, from the staged
    /// Q and K tiles: a dot product, or the additive `Σ w·tanh(q + k)` (over the true width: the
    /// weight has no padding). Additive terms take the product form `1 − 2/(1 + e^{2q}·e^{2k})`
    /// (the exponentials staged once per row and per key: one fused multiply-add, one
    /// reciprocal and one more per term) when the item's Q and the tile's K lie within ±20,
    /// where the product cannot overflow; else `tanhf(q + k)` per term (wider, infinite or NaN
    /// inputs).
    fn raw_score(&self) -> Vec<String> {
        match self.weight() {
            None => vec![
                "#pragma unroll 8".into(),
                "for (int cc_ = 0; cc_ < HD_; ++cc_) s_ += Qs_[r_ * HD_ + cc_] * Ks_[lane_ * HDP_ + cc_];".into(),
            ],
            Some(_) => [
                "if (qn_ && kn_) {",
                "  #pragma unroll 8",
                "  for (int cc_ = 0; cc_ < (int)D_; ++cc_)",
                "    s_ += Ws_[cc_] * fmaf(-2.0f, attnc_rcp_fast(fmaf(Qe_[r_ * HD_ + cc_], Ke_[lane_ * HDP_ + cc_], 1.0f)), 1.0f);",
                "} else {",
                "  for (int cc_ = 0; cc_ < (int)D_; ++cc_) s_ += Ws_[cc_] * tanhf(Qs_[r_ * HD_ + cc_] + Ks_[lane_ * HDP_ + cc_]);",
                "}",
            ]
            .map(String::from)
            .to_vec(),
        }
    }

    /// The element offset of row `row`, column `col` of a view within the batch index whose
    /// offset is `base`.
    fn at(&self, view: &View, base: &str, row: &str, col: &str) -> Result<String, CudaEmitError> {
        let r = view.shape.len();
        let (rs, cs) = (&view.strides[r - 2], &view.strides[r - 1]);
        let term = |i: &str, s: &Dim| -> Result<String, CudaEmitError> {
            Ok(if s.as_const() == Some(1) { i.to_string() } else { format!("{i} * {}", self.ints.dim(s)?) })
        };
        Ok(format!("{base} + {} + {}", term(row, rs)?, term(col, cs)?))
    }

    /// The element offset of key row `j`, column `col` of K (`which` = 'k') or V: through the
    /// block table when paged (row `j % P` of page `clamp(table[j / P], 0, NP − 1)`).
    fn kv_at(&self, which: char, j: &str, col: &str) -> Result<(&View, &'static str, String), CudaEmitError> {
        let (view, base, p, paging, tab) = if which == 'k' {
            (&self.f.k, "koff_", "K_", &self.f.k_paging, "ktab_")
        } else {
            (&self.f.v, "voff_", "V_", &self.f.v_paging, "vtab_")
        };
        let Some(pg) = paging else { return Ok((view, p, self.at(view, base, j, col)?)) };
        let i = self.ints;
        let (page, pages, stride) = (i.dim(&pg.page)?, i.dim(&pg.pages)?, i.dim(&pg.stride)?);
        let cs = &pg.table.strides[1];
        let slot = if cs.as_const() == Some(1) { format!("({j}) / {page}") } else { format!("({j}) / {page} * {}", i.dim(cs)?) };
        let id = format!("attnc_clampi((i64){tab}[{slot}], {pages})");
        let base = format!("{base} + {id} * {stride}");
        Ok((view, p, self.at(view, &base, &format!("(({j}) % {page})"), col)?))
    }

    /// A K or V element (as float) at key row `j`, column `col`.
    fn kv(&self, which: char, j: &str, col: &str) -> Result<String, CudaEmitError> {
        let (view, p, at) = self.kv_at(which, j, col)?;
        let raw = ops::CVal { text: load_ptr(p, view.dtype, &at), class: Class::of(view.dtype) };
        Ok(ops::convert(&raw, Class::Float))
    }

    /// A raw K or V element (storage type) for the tensor-core path, which copies halves.
    fn kv_raw(&self, which: char, j: &str, col: &str) -> Result<String, CudaEmitError> {
        let (_, p, at) = self.kv_at(which, j, col)?;
        Ok(format!("{p}[{at}]"))
    }

    /// Whether K or V is read through a block table.
    fn paged(&self) -> bool {
        self.f.paged()
    }

    /// `x_ = q[row, col]` as a float, 0 outside the matrix.
    fn q(&self, row: &str, col: &str) -> Result<Vec<String>, CudaEmitError> {
        let q = &self.f.q;
        let raw = ops::CVal { text: super::cexpr::load(q.buf, q.dtype, &self.at(q, "qoff_", row, col)?), class: Class::of(q.dtype) };
        Ok(vec!["float x_ = 0.0f;".into(), format!("if ({row} < M_ && {col} < D_) x_ = {};", ops::convert(&raw, Class::Float))])
    }

    /// The score statements (`sc_`, `keep_`) at rows `i`, keys `j`, raw product `s`.
    fn score(&self, p: &[String], i: &str, j: &str, s: &str) -> Result<Vec<String>, CudaEmitError> {
        let mut pos = p.to_vec();
        pos.push(i.to_string());
        pos.push(j.to_string());
        let ctx = ScoreCtx { ints: self.ints, s: Some(s), pos: &pos, extras: &self.f.extras };
        score_lines(&ctx, &self.f.analysis.score, self.f.spec.mask.as_ref(), "sc")
    }

    /// The class of key tile `kt` of the query block (0 skip, 1 full, 2 partial).
    fn class_line(kt: &str) -> String {
        format!("const int cls_ = tbl_[(qb_ * nkb_ + {kt}) * entry_];")
    }

    /// Whether key tile `kt` of the query block is skipped (class 0).
    fn skipped(kt: &str) -> String {
        format!("tbl_[(qb_ * nkb_ + {kt}) * entry_] == 0")
    }

    /// `const i64 loff_ = ...;`, the batch offset of the log-sum-exp result, when the step
    /// writes one (`p` names the batch positions).
    fn lse_offset(&self, p: &[String]) -> Result<Vec<String>, CudaEmitError> {
        let Some(l) = &self.f.lse else { return Ok(Vec::new()) };
        let nb = self.batch.len();
        let bview = View { shape: self.batch.clone(), strides: l.strides[..nb].to_vec(), ..l.clone() };
        Ok(vec![format!("const i64 loff_ = {};", self.ints.offset(&bview, p)?)])
    }

    /// The statement storing `value` as row `i`'s log-sum-exp, when the step writes one.
    fn store_lse(&self, i: &str, value: &str) -> Result<Option<String>, CudaEmitError> {
        let Some(l) = &self.f.lse else { return Ok(None) };
        let step = &l.strides[l.strides.len() - 1];
        let row = if step.as_const() == Some(1) { i.to_string() } else { format!("{i} * {}", self.ints.dim(step)?) };
        Ok(Some(store(l.buf, attn_compiler::ir::DType::F32, &format!("loff_ + {row}"), value)))
    }

    /// Stores `value` (a float) at output row `i`, column `col` (rounded to the output's type).
    fn store_out(&self, i: &str, col: &str, value: &str) -> Result<String, CudaEmitError> {
        let o = &self.f.out;
        Ok(store(o.buf, o.dtype, &self.at(o, "ooff_", i, col)?, &round_to(o.dtype, value)))
    }

    /// The loop over work items, one per block, around `item` (which may use block barriers:
    /// every thread of a block takes the same items).
    fn blocks(&self, items: &str, pre: Vec<String>, item: Vec<String>) -> Vec<String> {
        let mut body = pre;
        body.push(format!("for (i64 w_ = blockIdx.x; w_ < {items}; w_ += gridDim.x) {{"));
        body.extend(indent(&item, 2));
        body.push("}".into());
        body
    }
}

/// The kernel of a flash step.
pub(super) fn emit(ints: &Ints, items: &str, f: &FlashKernel) -> Result<KernelSource, CudaEmitError> {
    let fl = Flash::new(ints, f);
    if f.spec.pair != Pair::Dot && f.variant != Variant::Simt {
        return Err(ints.fail(format!("additive scores run on the SIMT flash kernel, not the {} one", f.variant.name())));
    }
    match f.variant {
        Variant::TensorCore => tensor_core(&fl, items),
        Variant::SplitKv => split_kv(&fl, items),
        _ => simt(&fl, items),
    }
}

/// The SIMT kernel (f32 compute, any storage types).
fn simt(fl: &Flash, items: &str) -> Result<KernelSource, CudaEmitError> {
    let step = fl.f.step;
    let (rows, keys) = (CUDA_SIMT_ROWS, CUDA_LANE_KEYS);
    let mut pre = vec![
        "ATTNC_DYN_SMEM;".to_string(),
        "ATTNC_SHARED float Ps_[4][32];  // one row of weights per warp, read back as broadcasts".into(),
        format!("constexpr int HD_ = ATTNC_HD_{step}, HDP_ = HD_ + 1, T_ = HD_ / 32;"),
        format!("float* Qs_ = (float*)attnc_smem;  // [{rows}][HD_]"),
        format!("float* Ks_ = Qs_ + {rows} * HD_;      // [{keys}][HD_ + 1]"),
        format!("float* Vs_ = Ks_ + {keys} * HDP_;     // [{keys}][HD_]"),
        "const int tid_ = threadIdx.x, lane_ = tid_ & 31, warp_ = tid_ >> 5;".into(),
    ];
    let additive = fl.weight();
    if additive.is_some() {
        pre.push(format!("float* Qe_ = Vs_ + {keys} * HD_;     // e^(2q), [{rows}][HD_]"));
        pre.push(format!("float* Ke_ = Qe_ + {rows} * HD_;     // e^(2k), [{keys}][HD_ + 1]"));
        pre.push(format!("float* Ws_ = Ke_ + {keys} * HDP_;    // the additive weight, [HD_]"));
    }
    pre.extend(fl.head()?);
    let mut it = Vec::new();
    let p = fl.item(&mut it, false)?;
    it.push(format!("const i64 q0_ = qb_ * {rows};"));
    it.push("attnc_sync();".into());
    if additive.is_some() {
        it.push("int qw_ = 0;  // some q outside ±20, or not finite".into());
    }
    it.push(format!("for (int e_ = tid_; e_ < {rows} * HD_; e_ += {CUDA_FLASH_THREADS}) {{"));
    it.push("  const i64 qi_ = q0_ + e_ / HD_, qc_ = e_ % HD_;".into());
    it.extend(indent(&fl.q("qi_", "qc_")?, 2));
    it.push("  Qs_[e_] = x_;".into());
    if additive.is_some() {
        it.push("  Qe_[e_] = expf(2.0f * x_);".into());
        it.push("  qw_ |= !(fabsf(x_) <= 20.0f);".into());
    }
    it.push("}".into());
    if let Some(w) = additive {
        it.push(format!(
            "for (int c_ = tid_; c_ < HD_; c_ += {CUDA_FLASH_THREADS}) Ws_[c_] = c_ < D_ ? {} : 0.0f;",
            super::cexpr::load(w.buf, w.dtype, "woff_ + c_")
        ));
        it.push("const bool qn_ = !attnc_sync_or(qw_);  // the product form holds for this item's rows".into());
    }
    it.push("float o_[4][T_], m_[4], l_[4];".into());
    it.push("#pragma unroll".into());
    it.push(
        "for (int rr_ = 0; rr_ < 4; ++rr_) { m_[rr_] = -ATTNC_INF; l_[rr_] = 0.0f; for (int t_ = 0; t_ < T_; ++t_) o_[rr_][t_] = 0.0f; }"
            .into(),
    );
    it.push(format!("for (i64 kt_ = 0; kt_ < (N_ + {keys} - 1) / {keys}; ++kt_) {{"));
    it.extend(indent(&simt_tile(fl, &p, additive.is_some())?, 2));
    it.push("}".into());
    it.extend(simt_finish(fl)?);
    let body = fl.blocks(items, pre, it);
    let smem = if additive.is_some() { Smem::FlashSimtAdditive(fl.f.step) } else { Smem::FlashSimt(fl.f.step) };
    Ok(KernelSource { threads: CUDA_FLASH_THREADS, items_per_block: 1, smem, body })
}

/// One key tile of the SIMT kernel: K and V rows staged in shared memory, then each warp's four
/// rows of scores, weights and output updates.
fn simt_tile(fl: &Flash, p: &[String], additive: bool) -> Result<Vec<String>, CudaEmitError> {
    let keys = CUDA_LANE_KEYS;
    let mut tile = vec![
        Flash::class_line("kt_"),
        "if (cls_ == 0) continue;  // fully masked tile (the same for the whole block)".into(),
        format!("const i64 k0_ = kt_ * {keys};"),
        "attnc_sync();".into(),
        if additive { "int kw_ = 0;  // some k outside ±20, or not finite" } else { "// K and V rows of the tile" }.into(),
        format!("for (int e_ = tid_; e_ < {keys} * HD_; e_ += {CUDA_FLASH_THREADS}) {{"),
        "  const int r_ = e_ / HD_, cc_ = e_ % HD_;".into(),
        "  const i64 jr_ = k0_ + r_, c64_ = cc_;".into(),
        "  const bool in_ = jr_ < N_;".into(),
        format!("  const float kx_ = (in_ && c64_ < D_) ? {} : 0.0f;", fl.kv('k', "jr_", "c64_")?),
        "  Ks_[r_ * HDP_ + cc_] = kx_;".into(),
        format!("  Vs_[r_ * HD_ + cc_] = (in_ && c64_ < DV_) ? {} : 0.0f;", fl.kv('v', "jr_", "c64_")?),
    ];
    if additive {
        tile.push("  Ke_[r_ * HDP_ + cc_] = expf(2.0f * kx_);".into());
        tile.push("  kw_ |= !(fabsf(kx_) <= 20.0f);".into());
        tile.push("}".into());
        tile.push("const bool kn_ = !attnc_sync_or(kw_);  // the product form holds for this tile's keys".into());
    } else {
        tile.push("}".into());
        tile.push("attnc_sync();".into());
    }
    tile.extend([
        "const i64 j_ = k0_ + lane_;".into(),
        "#pragma unroll".into(),
        "for (int rr_ = 0; rr_ < 4; ++rr_) {".into(),
        "  const int r_ = warp_ * 4 + rr_;".into(),
        "  const i64 i_ = q0_ + r_;".into(),
        "  float s_ = 0.0f;".into(),
    ]);
    tile.extend(indent(&fl.raw_score(), 2));
    tile.extend(["  s_ *= alpha_;".into(), "  bool keep_ = j_ < N_;".into()]);
    tile.extend(indent(&fl.score(p, "i_", "j_", "s_")?, 2));
    tile.extend(indent(&simt_weights(fl.softmax, &fl.drop("pd_", "i_", "j_")), 2));
    tile.push("}".into());
    Ok(tile)
}

/// The SIMT kernel's end of a work item: each row normalised and stored (with its log-sum-exp).
fn simt_finish(fl: &Flash) -> Result<Vec<String>, CudaEmitError> {
    let mut it = Vec::new();
    it.push("#pragma unroll".into());
    it.push("for (int rr_ = 0; rr_ < 4; ++rr_) {".into());
    it.push("  const i64 i_ = q0_ + warp_ * 4 + rr_;".into());
    it.push(if fl.softmax {
        "  const float lt_ = attnc_warp_sum(l_[rr_]), inv_ = lt_ == 0.0f ? 0.0f : 1.0f / lt_;".into()
    } else {
        "  const float inv_ = 1.0f;".into()
    });
    if let Some(st) = fl.store_lse("i_", "m_[rr_] + logf(lt_)")? {
        it.push(format!("  if (lane_ == 0 && i_ < M_) {st}"));
    }
    it.push("  #pragma unroll".into());
    it.push("  for (int t_ = 0; t_ < T_; ++t_) {".into());
    it.push("    const i64 col_ = lane_ + 32 * t_;".into());
    it.push(format!("    if (i_ < M_ && col_ < DV_) {}", fl.store_out("i_", "col_", "(o_[rr_][t_] * inv_)")?));
    it.push("  }".into());
    it.push("}".into());
    Ok(it)
}

/// One row's weights and its update of the running state (SIMT); `drop` scales the weight
/// `pd_` the values see (dropout).
fn simt_weights(softmax: bool, drop: &[String]) -> Vec<String> {
    let mut out: Vec<String> = if softmax {
        [
            "const float x_ = keep_ ? sc_ : -ATTNC_INF;",
            "const float mn_ = attnc_fmax(m_[rr_], attnc_warp_max(x_));  // NaN-propagating: a kept NaN makes the row NaN",
            "const float scale_ = mn_ == -ATTNC_INF ? 1.0f : expf(m_[rr_] - mn_);",
            "const float p_ = (keep_ && mn_ != -ATTNC_INF) ? expf(x_ - mn_) : 0.0f;",
            "l_[rr_] = l_[rr_] * scale_ + p_;",
            "m_[rr_] = mn_;",
            "#pragma unroll",
            "for (int t_ = 0; t_ < T_; ++t_) o_[rr_][t_] *= scale_;",
        ]
        .map(String::from)
        .to_vec()
    } else {
        vec!["const float p_ = keep_ ? attnc_sigmoid(sc_) : 0.0f;".into()]
    };
    out.push("float pd_ = p_;".into());
    out.extend(drop.iter().cloned());
    out.extend(
        [
            "Ps_[warp_][lane_] = pd_;",
            "attnc_syncwarp();",
            "for (int jj_ = 0; jj_ < 32; ++jj_) {",
            "  const float pj_ = Ps_[warp_][jj_];",
            "  if (pj_ == 0.0f) continue;  // keys with no weight add nothing",
            "  #pragma unroll",
            "  for (int t_ = 0; t_ < T_; ++t_) o_[rr_][t_] += pj_ * Vs_[jj_ * HD_ + lane_ + 32 * t_];",
            "}",
            "attnc_syncwarp();  // before the next row overwrites Ps_",
        ]
        .map(String::from),
    );
    out
}

fn tensor_core(fl: &Flash, items: &str) -> Result<KernelSource, CudaEmitError> {
    let step = fl.f.step;
    let bf16 = fl.f.k.dtype == attn_compiler::ir::DType::BF16;
    let (mma, conv, pack) = if bf16 { ("attnc_mma_b", "attnc_f2b", "attnc_pack_b") } else { ("attnc_mma_h", "attnc_f2h", "attnc_pack_h") };
    let mut pre = mma_pre(step);
    pre.extend(fl.head()?);
    let mut it = Vec::new();
    // Causal-like masks give later query blocks more live tiles: start those first.
    let p = fl.item(&mut it, true)?;
    it.push("const i64 q0_ = qb_ * BM_;".into());
    it.push("const i64 rw_ = q0_ + warp_ * 16 + g_;  // this lane's rows: rw_ + 64 mt + 8 h (m-tile mt, half h)".into());
    it.push("const i64 nkt_ = (N_ + BN_ - 1) / BN_;".into());
    it.extend(mma_stage_setup(fl)?);
    it.push("attnc_sync();  // the previous item's last reads of Qs_, Ks_ and Vs_".into());
    it.extend(stage_q(fl, conv, "BM_", "0", "tid_")?);
    // Up to 128 columns of Q per warp (MT_ · HD_) its Q fragments stay in registers (32 at
    // most); more are read from shared memory for every key tile, to keep the kernel clear of
    // spills.
    it.extend(proxy_fence(step));
    it.push("attnc_sync();".into());
    it.push(format!("constexpr bool QR_ = !ATTNC_WG_{step} && MT_ * HD_ <= 128;"));
    it.push("unsigned qf_[QR_ ? MT_ : 1][QR_ ? HD_ / 16 : 1][4];".into());
    it.push("if constexpr (QR_) {".into());
    it.push("  #pragma unroll".into());
    it.push("  for (int mt_ = 0; mt_ < MT_; ++mt_)".into());
    it.push("    #pragma unroll".into());
    it.push("    for (int ks_ = 0; ks_ < HD_ / 16; ++ks_)".into());
    it.push("      attnc_ldsm_x4(qf_[mt_][ks_], qa_s_ + 128u * LD_ * mt_ + 32u * ks_);".into());
    it.push("}".into());
    it.extend(mma_accumulators("MT_"));
    it.push(format!("#if ATTNC_WGS_{step}"));
    it.extend(wg_staged_loop(fl, &p, pack, bf16)?);
    it.push("#else".into());
    // Pipelined as FlashAttention-2 does, one K and one V buffer: V(t) is copied while S(t) =
    // Q K(t)ᵀ and the softmax run, and K(next) while O += P V(t).
    it.extend(first_live_tile());
    it.push("if (kt_ < nkt_) {".into());
    it.extend(indent(&mma_stage(fl, 'k', "kt_ * BN_")?, 2));
    it.push("}".into());
    it.push("while (kt_ < nkt_) {".into());
    let mut tile = tile_top(step);
    tile.push("attnc_sync();  // K(kt) is in; every warp is done with V(previous)".into());
    tile.extend(mma_stage(fl, 'v', "k0_")?);
    // V(kt) in, K(kt) free: then K(next) is copied while the products with V(kt) run.
    let mut swap = vec!["attnc_cp_wait_all();".to_string()];
    swap.extend(proxy_fence(step));
    swap.push("attnc_sync();  // V(kt) is in; every warp is done with K(kt)".into());
    swap.push("if (nx_ < nkt_) {".into());
    swap.extend(indent(&mma_stage(fl, 'k', "nx_ * BN_")?, 2));
    swap.push("}".into());
    tile.push(format!("#if ATTNC_WGP_{step}"));
    tile.extend(wg_pipelined(fl, &p, &swap, "0u", pack, bf16)?);
    tile.push("#else".into());
    tile.extend(mma_scores(mma, step, bf16));
    tile.extend(mma_weights(fl, &p, ALL_MTS)?);
    tile.extend(swap);
    tile.extend(mma_pv(mma, pack, step, bf16));
    tile.push("#endif".into());
    tile.push("kt_ = nx_;".into());
    it.extend(indent(&tile, 2));
    it.push("}".into());
    it.push("#endif".into());
    it.extend(mma_finish(fl, ALL_MTS)?);
    let mut body = pre;
    body.push(format!("#if ATTNC_WS_{step}"));
    body.push("#if !ATTNC_WGMMA".into());
    body.push("#error \"the warp-specialised flash forward needs Hopper's warpgroup products (sm_90a)\"".into());
    body.push("#endif".into());
    body.extend(warp_specialized(fl, items, pack, bf16)?);
    body.push("#else".into());
    body.extend(fl.blocks(items, Vec::new(), it));
    body.push("#endif".into());
    Ok(KernelSource { threads: CUDA_FLASH_THREADS, items_per_block: 1, smem: Smem::FlashMma(step), body })
}

/// The warp-specialised block on Hopper (`ATTNC_WS_n`, launched with 384 threads; FlashAttention-3's
/// structure): warpgroup 0 is the producer ([`ws_producer`]), warpgroups 1 and 2 the consumers
/// of 64 query rows each ([`ws_consumer`]), synchronised through a ring of `ATTNC_KS_n` K/V
/// stages in shared memory, each with a `full` mbarrier (the producer's 128 threads arrive once
/// the stage's copies are in) and an `empty` one (the consumers' 256 threads arrive once they
/// are done with it). `setmaxnreg` leaves the producer 40 registers and gives each consumer 232
/// (40 + 2 · 232 = 3 · 168, the kernel's budget at one block of 384 threads per SM). Both sides
/// walk the same live tiles in the same order, so the ring's stage `st_` and the parity `ph_`
/// of its phase advance alike on both.
fn warp_specialized(fl: &Flash, items: &str, pack: &str, bf16: bool) -> Result<Vec<String>, CudaEmitError> {
    let step = fl.f.step;
    let mut out = vec![
        format!("constexpr int KS_ = ATTNC_KS_{step};  // stages of the K/V ring"),
        "// The ring's mbarriers past the tiles: KS_ `full` ones, then KS_ `empty` ones.".into(),
        "const unsigned full_ = sa_ + 2u * (BM_ + 2 * KS_ * BN_) * HD_, empty_ = full_ + 8u * KS_;".into(),
        "if (tid_ == 0) {".into(),
        "  // `full`: the producer's 128 threads arrive, or with TMA its first thread (and the bytes).".into(),
        format!(
            "  for (int st_ = 0; st_ < KS_; ++st_) {{ attnc_mbar_init(full_ + 8u * st_, ATTNC_TMA_{step} ? 1u : 128u); attnc_mbar_init(empty_ + 8u * st_, 256u); }}"
        ),
        "}".into(),
        "attnc_sync();  // the mbarriers are initialised: the block's last barrier of all its threads".into(),
        "int st_ = 0;  // the ring's next stage".into(),
        "unsigned ph_ = 0u;  // and the parity of its phase".into(),
        "// The warpgroup, warp-uniform to the compiler: without it ptxas sees the branch below as".into(),
        "// divergent, and waits for the products in flight at every shuffle of the softmax.".into(),
        "const int wgi_ = attnc_warp_uniform(tid_ >> 7);".into(),
        "if (wgi_ == 0) {".into(),
    ];
    out.extend(indent(&ws_producer(fl, items)?, 2));
    out.push("} else {".into());
    out.extend(indent(&ws_consumer(fl, items, pack, bf16)?, 2));
    out.push("}".into());
    Ok(out)
}

/// The warp-specialised block's producer: for every live key tile of every work item it waits
/// until the consumers have freed the ring's next stage, copies the tile's K and V into it
/// ([`stage_copies`]: 16-byte `cp.async` where the rows allow, zero-filled past the matrix)
/// and moves on: `cp.async.mbarrier.arrive.noinc` arrives on the stage's `full` for each thread
/// once its copies have landed, so the copies of several stages are in flight together (each
/// consumer fences for the async proxy after its wait). Where rows are copied element by
/// element (plain stores), each thread waits, fences and arrives itself.
fn ws_producer(fl: &Flash, items: &str) -> Result<Vec<String>, CudaEmitError> {
    let step = fl.f.step;
    let mut out = vec!["attnc_regs_dec<40>();".to_string(), format!("#if ATTNC_TMA_{step}")];
    out.extend(ws_tma_producer(fl, items)?);
    out.push("#else".into());
    out.extend(ws_copy_producer(fl, items)?);
    out.push("#endif".into());
    Ok(out)
}

/// The producer by TMA (`ATTNC_TMA_n`: 1 + the index of K's tensor map among the run's,
/// V's next; [`attn_compiler::schedule::tma_map`]): its first thread alone, per live key tile,
/// waits for the stage to be free, arrives on its `full` expecting the tile's bytes, and issues
/// one tiled copy per 64 columns of K and of V (the box: 64 columns × `BN_` rows, 128-byte
/// swizzled in hardware into the layout the products read, zeros past the tensor); the copies
/// complete those bytes on `full`. Coordinates: column, key row, then the batch indices the
/// view moves along ([`attn_compiler::schedule::tma_axes`]).
fn ws_tma_producer(fl: &Flash, items: &str) -> Result<Vec<String>, CudaEmitError> {
    let step = fl.f.step;
    let mut item = Vec::new();
    let p = fl.item(&mut item, true)?;
    // One copy of the tile's columns `64 c_..` of K or V into its sub-tile `c_` of the stage.
    let load = |which: &str, view: &View, map: &str| -> Result<String, CudaEmitError> {
        let mut c = vec!["c_ * 64".to_string(), "(int)(kt_ * BN_)".into()];
        for a in attn_compiler::schedule::tma_axes(view, fl.f.batch()) {
            let index = p.get(a).ok_or_else(|| fl.ints.fail(format!("batch axis {a} has no index")))?;
            c.push(format!("(int){index}"));
        }
        Ok(format!("    attnc_tma_load_{}d({which}n_s_ + c_ * (128u * BN_), {map}, {}, full_ + 8u * st_);", c.len(), c.join(", ")))
    };
    item.push("const i64 nkt_ = (N_ + BN_ - 1) / BN_;".into());
    item.extend(first_live_tile());
    item.push("while (kt_ < nkt_) {".into());
    item.push("  attnc_mbar_wait(empty_ + 8u * st_, ph_ ^ 1u);  // the consumers are done with stage st_".into());
    item.push("  attnc_mbar_expect_tx(full_ + 8u * st_, 2u * (HD_ / 64) * BN_ * 128u);  // K's and V's tiles".into());
    item.push("  const unsigned Kn_s_ = Ks_s_ + st_ * (4u * BN_ * HD_), Vn_s_ = Vs_s_ + st_ * (4u * BN_ * HD_);".into());
    item.push("  #pragma unroll".into());
    item.push("  for (int c_ = 0; c_ < HD_ / 64; ++c_) {".into());
    item.push(load("K", &fl.f.k, "km_")?);
    item.push(load("V", &fl.f.v, "vm_")?);
    item.push("  }".into());
    item.push("  if (++st_ == KS_) { st_ = 0; ph_ ^= 1u; }".into());
    item.push("  ++kt_;".into());
    item.push(format!("  while (kt_ < nkt_ && {}) ++kt_;", Flash::skipped("kt_")));
    item.push("}".into());
    let mut out = vec![
        "if (tid_ == 0) {".to_string(),
        format!("  const void* const km_ = (const unsigned char*)attnc_tmaps + 128 * (ATTNC_TMA_{step} - 1);"),
        "  const void* const vm_ = (const unsigned char*)km_ + 128;".into(),
        "  attnc_tmap_acquire(km_);".into(),
        "  attnc_tmap_acquire(vm_);".into(),
    ];
    out.extend(indent(&fl.blocks(items, Vec::new(), item), 2));
    out.push("}".into());
    Ok(out)
}

/// The producer by its threads' copies.
fn ws_copy_producer(fl: &Flash, items: &str) -> Result<Vec<String>, CudaEmitError> {
    let mut item = Vec::new();
    fl.item(&mut item, true)?;
    item.push("const i64 nkt_ = (N_ + BN_ - 1) / BN_;".into());
    item.extend(mma_stage_setup(fl)?);
    item.extend(first_live_tile());
    item.push("while (kt_ < nkt_) {".into());
    item.push("  attnc_mbar_wait(empty_ + 8u * st_, ph_ ^ 1u);  // the consumers are done with stage st_".into());
    item.push("  {".into());
    item.extend(indent(&stage_copies(fl, "kt_", "st_")?, 2));
    item.push("  }".into());
    // 16-byte copies: the stage's `full` counts this thread's arrival once they have landed, and
    // the producer goes on to the next stage at once (as many stages in flight as the ring has).
    // Element-by-element stores: made visible by this thread's own fence and arrival.
    // (`-DATTNC_WS_CP_WAIT`, a knob for comparing: every thread waits, fences and arrives.)
    item.push("#ifdef ATTNC_WS_CP_WAIT".into());
    item.push("  attnc_cp_wait_all(); attnc_fence_proxy(); attnc_mbar_arrive(full_ + 8u * st_);".into());
    item.push("#else".into());
    item.push("  if (vec_) attnc_cp_mbar_arrive(full_ + 8u * st_);".into());
    item.push("  else { attnc_cp_wait_all(); attnc_fence_proxy(); attnc_mbar_arrive(full_ + 8u * st_); }".into());
    item.push("#endif".into());
    item.push("  if (++st_ == KS_) { st_ = 0; ph_ ^= 1u; }".into());
    item.push("  ++kt_;".into());
    item.push(format!("  while (kt_ < nkt_ && {}) ++kt_;", Flash::skipped("kt_")));
    item.push("}".into());
    Ok(fl.blocks(items, Vec::new(), item))
}

/// A warp-specialised block's consumer `cw_` (m-tile `cw_` of the block): it copies its Q rows,
/// then runs the live key tiles ([`ws_consumer_tiles`]) and writes its rows. The two consumers
/// take turns at the tensor cores through named barriers 1 and 2 (each issues its products in
/// its turn, then hands the turn over, so that one's softmax runs while the other's products
/// do); barriers 3 and 4 are each consumer's own.
fn ws_consumer(fl: &Flash, items: &str, pack: &str, bf16: bool) -> Result<Vec<String>, CudaEmitError> {
    let conv = if bf16 { "attnc_f2b" } else { "attnc_f2h" };
    let mut out = vec![
        "attnc_regs_inc<232>();".to_string(),
        "const int cw_ = wgi_ - 1;  // this consumer: m-tile cw_ of the block".into(),
        "if (cw_ == 1) attnc_bar_arrive(1, 256);  // consumer 0 takes the first turn".into(),
    ];
    let mut item = Vec::new();
    let p = fl.item(&mut item, true)?;
    item.push("const i64 q0_ = qb_ * BM_;".into());
    item.push("const i64 rw_ = q0_ + 64 * cw_ + (warp_ & 3) * 16 + g_;  // this lane's rows: rw_ + 8 h (half h)".into());
    item.push("const i64 nkt_ = (N_ + BN_ - 1) / BN_;".into());
    item.push("attnc_bar_sync(3 + cw_, 128);  // this consumer's products of the previous item are done with its Q rows".into());
    item.extend(stage_q(fl, conv, "64", "64 * cw_", "(tid_ & 127)")?);
    item.push("attnc_fence_proxy();".into());
    item.push("attnc_bar_sync(3 + cw_, 128);".into());
    item.extend(mma_accumulators("1"));
    item.extend(ws_consumer_tiles(fl, &p, pack, bf16)?);
    item.extend(mma_finish(fl, Mts("0", "1"))?);
    out.extend(fl.blocks(items, Vec::new(), item));
    Ok(out)
}

/// A consumer's live key tiles, FlashAttention-3's intra-warpgroup overlap: each tile's
/// `S = Q Kᵀ` is issued together with the previous tile's `O += P V` (two commit groups), the
/// tile's weights are formed while the latter runs (`wgmma.wait_group 1`), then O is rescaled for
/// the new row maxima after its wait ([`mma_wait_rescale`]), the weights are packed for the next
/// tile's product, and the previous tile's stage is freed. The last tile's `P V` follows the loop.
fn ws_consumer_tiles(fl: &Flash, p: &[String], pack: &str, bf16: bool) -> Result<Vec<String>, CudaEmitError> {
    let t = if bf16 { 'b' } else { 'h' };
    // Tile kt_'s top: its class, the next live tile, its first key, the wait for its stage,
    // and this consumer's turn.
    let top = vec![
        Flash::class_line("kt_"),
        "i64 nx_ = kt_ + 1;".into(),
        format!("while (nx_ < nkt_ && {}) ++nx_;  // next live tile", Flash::skipped("nx_")),
        "const i64 k0_ = kt_ * BN_;".into(),
        "attnc_mbar_wait(full_ + 8u * st_, ph_);  // K(kt) and V(kt) are in stage st_".into(),
        "attnc_fence_proxy();  // the stage's copies, landed, made visible to this thread's wgmma".into(),
        "float s_[1][NT_][4], mx_[1][2];".into(),
        "mx_[0][0] = -ATTNC_INF; mx_[0][1] = -ATTNC_INF;".into(),
        "attnc_bar_sync(1 + cw_, 256);  // this consumer's turn at the tensor cores".into(),
        "attnc_wg_fence();".into(),
    ];
    let mut scores = wg_score_products_of(t, "0", "cw_", "(unsigned)st_ * (4u * BN_ * HD_)");
    scores.push("attnc_wg_commit();".into());
    let mut pv = wg_pv_products_packed(t, "0", "(unsigned)pst_ * (4u * BN_ * HD_)");
    pv.push("attnc_wg_commit();".into());
    // After a tile's weights are packed: its stage becomes the pending product's, and the ring
    // and the tile move on.
    let advance = ["pst_ = st_;".to_string(), "if (++st_ == KS_) { st_ = 0; ph_ ^= 1u; }".into(), "kt_ = nx_;".into()];
    let mut out = first_live_tile();
    out.push("unsigned pw_[1][BN_ / 16][4];  // the weights of the tile whose O += P V is pending".into());
    out.push("float rs_[1][2];  // the factors of O's rows once that product is done".into());
    out.push("int pst_ = 0;  // that tile's stage".into());
    out.push("if (kt_ < nkt_) {".into());
    // The first live tile: its scores and weights (O is 0: nothing to rescale).
    let mut first = top.clone();
    first.extend(scores.iter().cloned());
    first.push("attnc_bar_arrive(2 - cw_, 256);  // the other consumer's turn".into());
    first.push("attnc_wg_wait0();".into());
    first.push("attnc_wg_hold<NT_ * 4>(&s_[0][0][0]);".into());
    first.extend(mma_weights_deferred(fl, p, Mts("0", "1"))?);
    first.extend(wg_pack(pack, "0"));
    first.extend(advance.iter().cloned());
    // Every later live tile.
    first.push("while (kt_ < nkt_) {".into());
    let mut tile = top;
    tile.extend(scores);
    tile.extend(pv.iter().cloned());
    tile.push("attnc_bar_arrive(2 - cw_, 256);  // the other consumer's turn".into());
    tile.push("attnc_wg_wait1();  // S(kt); the previous tile's O += P V may still run".into());
    tile.push("attnc_wg_hold<NT_ * 4>(&s_[0][0][0]);".into());
    tile.extend(mma_weights_deferred(fl, p, Mts("0", "1"))?);
    // Its A registers (pw_) stay live until the wait, so that ptxas gives them to no other value.
    let wait = [
        "attnc_wg_wait0();  // O += P V of the previous tile".to_string(),
        "attnc_wg_hold<DT_ * 4>(&o_[0][0][0]);".into(),
        "attnc_wg_keep<BN_ / 16 * 4>(&pw_[0][0][0]);".into(),
    ];
    tile.extend(mma_wait_rescale(fl, &wait));
    tile.extend(wg_pack(pack, "0"));
    tile.push("attnc_mbar_arrive(empty_ + 8u * pst_);  // the previous tile's stage is free".into());
    tile.extend(advance);
    first.extend(indent(&tile, 2));
    first.push("}".into());
    // The last live tile's O += P V.
    first.push("attnc_wg_fence();".into());
    first.extend(pv);
    first.push("attnc_wg_wait0();".into());
    first.push("attnc_wg_hold<DT_ * 4>(&o_[0][0][0]);".into());
    first.push("attnc_mbar_arrive(empty_ + 8u * pst_);".into());
    out.extend(indent(&first, 2));
    out.push("}".into());
    Ok(out)
}

/// Q's rows `[row0, row0 + rows)` of the block staged into `Qs_` (rounded to the operands'
/// type by `conv`, zero past the matrix) by the 128 threads numbered `thread`.
fn stage_q(fl: &Flash, conv: &str, rows: &str, row0: &str, thread: &str) -> Result<Vec<String>, CudaEmitError> {
    let step = fl.f.step;
    let mut out = vec![
        format!("for (int e_ = {thread}; e_ < {rows} * HD_; e_ += {CUDA_FLASH_THREADS}) {{"),
        format!("  const int r_ = {row0} + e_ / HD_;"),
        "  const i64 qi_ = q0_ + r_, qc_ = e_ % HD_;".into(),
    ];
    out.extend(indent(&fl.q("qi_", "qc_")?, 2));
    out.push(format!("  Qs_[ATTNC_OFF_{step}(BM_, r_, e_ % HD_)] = {conv}(x_);"));
    out.push("}".into());
    Ok(out)
}

/// The tensor-core kernel's accumulators for `n` m-tiles, zeroed: `O`, the row maxima (in base
/// 2) and the row sums; and the scale in base 2.
fn mma_accumulators(n: &str) -> Vec<String> {
    vec![
        format!("float o_[{n}][DT_][4], m_[{n}][2], l_[{n}][2];  // row maxima in base 2"),
        "#pragma unroll".into(),
        format!("for (int mt_ = 0; mt_ < {n}; ++mt_) {{"),
        "  m_[mt_][0] = -ATTNC_INF; m_[mt_][1] = -ATTNC_INF; l_[mt_][0] = 0.0f; l_[mt_][1] = 0.0f;".into(),
        "  #pragma unroll".into(),
        "  for (int t_ = 0; t_ < DT_; ++t_) { o_[mt_][t_][0] = 0.0f; o_[mt_][t_][1] = 0.0f; o_[mt_][t_][2] = 0.0f; o_[mt_][t_][3] = 0.0f; }"
            .into(),
        "}".into(),
        "const float alpha2_ = alpha_ * ATTNC_LOG2E;".into(),
    ]
}

/// The tensor-core kernel's constants and shared tiles: skewed rows for `mma.sync`, 128-byte
/// swizzled sub-tiles for Hopper's warpgroup products (`ATTNC_WG_{step}`), and the rows each
/// lane gives `ldmatrix`.
fn mma_pre(step: usize) -> Vec<String> {
    vec![
        "ATTNC_DYN_SMEM;".to_string(),
        format!(
            "constexpr int HD_ = ATTNC_HD_{step}, BN_ = ATTNC_BN_{step}, MT_ = ATTNC_MT_{step};  // head width; keys per tile; m-tiles per warp"
        ),
        format!("constexpr int BM_ = {CUDA_MMA_ROWS} * MT_;  // query rows per block: m-tile mt of warp w has rows 64 mt + 16 w + [0, 16)"),
        "constexpr int LD_ = HD_ + 8, NT_ = BN_ / 8, DT_ = HD_ / 8;  // shared row stride (halves), skews banks".into(),
        // Hopper (sm_90a) takes the warpgroup products where the tiles are whole swizzled
        // sub-tiles (widths 64 and 128, keys 64): the 4 warps are one warpgroup, and m-tile mt
        // of the block is one `wgmma` of 64 rows.
        format!("#define ATTNC_WG_{step} (ATTNC_WGMMA && ATTNC_HD_{step} % 64 == 0 && ATTNC_HD_{step} <= 128 && ATTNC_BN_{step} == 64)"),
        // With two m-tiles the warpgroup pipelines them (wg_pipelined) unless ATTNC_WG_SYNC is
        // defined (through ATTNC_NVRTC_OPTIONS, to compare).
        format!("#if ATTNC_WG_{step} && ATTNC_MT_{step} == 2 && !defined(ATTNC_WG_SYNC)"),
        format!("#define ATTNC_WGP_{step} 1"),
        "#else".into(),
        format!("#define ATTNC_WGP_{step} 0"),
        "#endif".into(),
        // Pipelined, with two K/V stages when the launch gave it room (ATTNC_KS_n, from the
        // policy): wg_staged_loop.
        format!("#if ATTNC_WGP_{step} && ATTNC_KS_{step} == 2"),
        format!("#define ATTNC_WGS_{step} 1"),
        "#else".into(),
        format!("#define ATTNC_WGS_{step} 0"),
        "#endif".into(),
        format!("#if ATTNC_WG_{step}"),
        "// Q, K and V tiles 128-byte swizzled (prelude: attnc_wg_desc), from a 1024-byte aligned".into(),
        "// shared address (the launch's shared memory has the skew's bytes to spare). Element".into(),
        format!("// (r, c) of a tile of `rows` rows is ATTNC_OFF_{step}(rows, r, c) halves in."),
        "const unsigned sb_ = attnc_saddr(attnc_smem), sa_ = (sb_ + 1023u) & ~1023u;".into(),
        "u16* Qs_ = (u16*)(attnc_smem + (sa_ - sb_));  // [BM_][HD_]".into(),
        "u16* Ks_ = Qs_ + BM_ * HD_;  // [BN_][HD_]".into(),
        "u16* Vs_ = Ks_ + BN_ * HD_;  // [BN_][HD_]".into(),
        format!(
            "#define ATTNC_OFF_{step}(rows, r, c) (((((c) >> 6) * (rows) + (r)) << 6) + (((((c) >> 3) & 7) ^ ((r) & 7)) << 3) + ((c) & 7))"
        ),
        "#else".into(),
        "u16* Qs_ = (u16*)attnc_smem;  // [BM_][LD_]".into(),
        "u16* Ks_ = Qs_ + BM_ * LD_;   // [BN_][LD_]".into(),
        "u16* Vs_ = Ks_ + BN_ * LD_;   // [BN_][LD_]".into(),
        format!("#define ATTNC_OFF_{step}(rows, r, c) ((r) * LD_ + (c))"),
        "#endif".into(),
        "const unsigned Ks_s_ = attnc_saddr(Ks_), Vs_s_ = attnc_saddr(Vs_);  // their shared addresses".into(),
        "const int tid_ = threadIdx.x, lane_ = tid_ & 31, warp_ = tid_ >> 5, g_ = lane_ >> 2, tg_ = lane_ & 3;".into(),
        "const int lr_ = lane_ & 7, lm_ = lane_ >> 3;  // ldmatrix: this lane addresses row lr_ of matrix lm_".into(),
        "// Shared addresses (bytes) of the row this lane gives ldmatrix, at the first 16 x 16 step:".into(),
        "// Q's A fragment of the warp's first m-tile (rows (lm_ & 1) * 8, columns (lm_ >> 1) * 8),".into(),
        "// K's B fragments of two".into(),
        "// n-tiles (rows (lm_ >> 1) * 8, columns (lm_ & 1) * 8), V's transposed (rows (lm_ & 1) * 8,".into(),
        "// columns (lm_ >> 1) * 8). Every other step adds a compile-time constant.".into(),
        "const unsigned qa_s_ = attnc_saddr(Qs_) + 2u * ((warp_ * 16 + (lm_ & 1) * 8 + lr_) * LD_ + (lm_ >> 1) * 8);".into(),
        "const unsigned kb_s_ = attnc_saddr(Ks_) + 2u * (((lm_ >> 1) * 8 + lr_) * LD_ + (lm_ & 1) * 8);".into(),
        "const unsigned vb_s_ = attnc_saddr(Vs_) + 2u * (((lm_ & 1) * 8 + lr_) * LD_ + (lm_ >> 1) * 8);".into(),
    ]
}

/// The m-tiles `[lo, hi)` of a block's accumulators that a part of the tile's work covers.
#[derive(Clone, Copy)]
struct Mts(&'static str, &'static str);

/// Every m-tile of the block.
const ALL_MTS: Mts = Mts("0", "MT_");

impl Mts {
    /// `body` (lines using `mt_`) for each of these m-tiles, unrolled.
    fn each(self, body: &[String]) -> Vec<String> {
        let mut out = vec!["#pragma unroll".to_string(), format!("for (int mt_ = {}; mt_ < {}; ++mt_) {{", self.0, self.1)];
        out.extend(indent(body, 2));
        out.push("}".into());
        out
    }
}

/// The score modification, mask and weights of the accumulators `s_` of m-tiles `mts`, in a
/// scope of their own. Softmax keeps scores in base 2 (`x log2 e`, so that each weight is one
/// `ex2`), and takes a short path for tiles that need neither the mask nor the key bound
/// (class 1 and wholly inside `N_`): there a bare `q · k` costs one multiply per score.
fn mma_weights(fl: &Flash, p: &[String], mts: Mts) -> Result<Vec<String>, CudaEmitError> {
    let mut out = vec!["{".to_string()];
    out.extend(indent(&mma_weights_lines(fl, p, mts, false)?, 2));
    out.push("}".into());
    Ok(out)
}

/// [`mma_weights`] with the rescale of `O` deferred (its accumulators are in flight): each row's
/// factor is left in `rs_[mt][h]` (declared by the caller) for [`mma_rescale`].
fn mma_weights_deferred(fl: &Flash, p: &[String], mts: Mts) -> Result<Vec<String>, CudaEmitError> {
    let mut out = vec!["{".to_string()];
    out.extend(indent(&mma_weights_lines(fl, p, mts, true)?, 2));
    out.push("}".into());
    Ok(out)
}

/// `wait` (the wait for `O`'s product in flight and what follows it), then `O` of m-tile 0
/// rescaled by the factors [`mma_weights_deferred`] left in `rs_`. The wait goes into both arms
/// of the rescale's branch: ptxas moves a `wgmma.wait_group` to the top of its basic block, so
/// in the block of the softmax it would wait before the softmax instead of after it.
fn mma_wait_rescale(fl: &Flash, wait: &[String]) -> Vec<String> {
    if !fl.softmax {
        return wait.to_vec();
    }
    mma_rescale("0", ["rs_[0][0]", "rs_[0][1]"], wait)
}

/// `O` of m-tile `mt` rescaled by its two row halves' factors `sc` after a row maximum grew,
/// with `wait` (if any) first in both arms of the branch.
fn mma_rescale(mt: &str, sc: [&str; 2], wait: &[String]) -> Vec<String> {
    let mut out = vec![
        "// Once the row maxima settle (most tiles of a long row) no row of the warp rescales: skip".to_string(),
        "// the multiplies (a warp-uniform branch).".into(),
        format!("if (attnc_any({0} != 1.0f || {1} != 1.0f)) {{", sc[0], sc[1]),
    ];
    out.extend(indent(wait, 2));
    out.push("  #pragma unroll".into());
    out.push(format!(
        "  for (int t_ = 0; t_ < DT_; ++t_) {{ o_[{mt}][t_][0] *= {0}; o_[{mt}][t_][1] *= {0}; o_[{mt}][t_][2] *= {1}; o_[{mt}][t_][3] *= {1}; }}",
        sc[0], sc[1]
    ));
    if !wait.is_empty() {
        out.push("} else {".into());
        out.extend(indent(wait, 2));
    }
    out.push("}".into());
    out
}

fn mma_weights_lines(fl: &Flash, p: &[String], mts: Mts, defer: bool) -> Result<Vec<String>, CudaEmitError> {
    let elem = |body: Vec<String>| -> Vec<String> {
        let mut inner = vec![
            "#pragma unroll".into(),
            "for (int nt_ = 0; nt_ < NT_; ++nt_) {".into(),
            "  #pragma unroll".into(),
            "  for (int e_ = 0; e_ < 4; ++e_) {".into(),
        ];
        inner.extend(indent(&body, 4));
        inner.push("  }".into());
        inner.push("}".into());
        mts.each(&inner)
    };
    let position = "const i64 i_ = rw_ + mt_ * 64 + (e_ >> 1) * 8, j_ = k0_ + nt_ * 8 + tg_ * 2 + (e_ & 1);".to_string();
    let mut general = vec![position.clone(), "const float s_e_ = s_[mt_][nt_][e_] * alpha_;".into(), "bool keep_ = j_ < N_;".into()];
    general.extend(fl.score(p, "i_", "j_", "s_e_")?);
    // Dropout of the weights the values see (after the row sums took them whole). A lane's
    // keys of n-tiles nt, nt + 2, nt + 4, nt + 6 are 16 apart: one generator call gives all
    // four when the tile holds whole blocks of 64 keys (k0_ a multiple of 64).
    let position_of = position.clone();
    let dropout = |out: &mut Vec<String>| {
        if fl.f.spec.dropout.is_some() {
            out.push("if constexpr (BN_ % 64 == 0) {".into());
            out.extend(indent(&mts.each(&MMA_DROPOUT.lines().map(String::from).collect::<Vec<_>>()), 2));
            out.push("} else {".into());
            let mut body = vec![position_of.clone()];
            body.extend(fl.drop("s_[mt_][nt_][e_]", "i_", "j_"));
            out.extend(indent(&elem(body), 2));
            out.push("}".into());
        }
    };
    if !fl.softmax {
        general.push("s_[mt_][nt_][e_] = keep_ ? attnc_sigmoid(sc_) : 0.0f;".into());
        let mut out = elem(general);
        dropout(&mut out);
        return Ok(out);
    }
    general.push("const float x_ = keep_ ? sc_ * ATTNC_LOG2E : -ATTNC_INF;".into());
    general.push("s_[mt_][nt_][e_] = x_;".into());
    general.push("mx_[mt_][e_ >> 1] = fmaxf(mx_[mt_][e_ >> 1], x_);".into());
    // A bare `q · k` (plain scores, positive finite scale) stays unscaled on the short path: its
    // row maximum is the unscaled one times the scale (rounding is monotonic), and each weight
    // is then one fused multiply-add and one `ex2`, `2^(s · α log2 e − m)`. Other short paths
    // store scaled scores (`a2_` = 1).
    let plain = matches!(fl.f.analysis.score, attn_compiler::ir::ScoreExpr::Score);
    let fast = if plain {
        vec!["mx_[mt_][e_ >> 1] = fmaxf(mx_[mt_][e_ >> 1], s_[mt_][nt_][e_]);".to_string()]
    } else {
        let mut v = vec![position, "const float s_e_ = s_[mt_][nt_][e_] * alpha_;".into()];
        let ctx = {
            let mut pos = p.to_vec();
            pos.push("i_".into());
            pos.push("j_".into());
            pos
        };
        let sc = ScoreCtx { ints: fl.ints, s: Some("s_e_"), pos: &ctx, extras: &fl.f.extras };
        v.extend(score_lines(&sc, &fl.f.analysis.score, None, "sc")?);
        v.push("const float x_ = sc_ * ATTNC_LOG2E;".into());
        v.push("s_[mt_][nt_][e_] = x_;".into());
        v.push("mx_[mt_][e_ >> 1] = fmaxf(mx_[mt_][e_ >> 1], x_);".into());
        v
    };
    // fmaxf drops NaN from the row maximum; a NaN score still reaches the output through its
    // weight (2^NaN), as in the interpreter.
    let mut out = vec![
        if plain {
            "const bool fast_ = cls_ == 1 && k0_ + BN_ <= N_ && alpha2_ > 0.0f && alpha2_ < ATTNC_INF;  // no mask, no key beyond N_"
        } else {
            "const bool fast_ = cls_ == 1 && k0_ + BN_ <= N_;  // no mask, no key beyond N_"
        }
        .to_string(),
    ];
    out.push("if (fast_) {".into());
    out.extend(indent(&elem(fast), 2));
    if plain {
        out.extend(indent(&mts.each(&["mx_[mt_][0] *= alpha2_; mx_[mt_][1] *= alpha2_;".to_string()]), 2));
    }
    out.push("} else {".into());
    out.extend(indent(&elem(general), 2));
    out.push("}".into());
    out.push(
        if plain { "const float a2_ = fast_ ? alpha2_ : 1.0f;  // the scale still to apply" } else { "const float a2_ = 1.0f;" }.into(),
    );
    let mut softmax: Vec<String> = MMA_SOFTMAX.lines().map(String::from).collect();
    if defer {
        softmax.push("rs_[mt_][0] = sc_[0]; rs_[mt_][1] = sc_[1];".into());
    } else {
        softmax.extend(mma_rescale("mt_", ["sc_[0]", "sc_[1]"], &[]));
    }
    out.extend(mts.each(&softmax));
    dropout(&mut out);
    Ok(out)
}

/// Whether K's and V's columns have unit stride (known at emission): the condition for any
/// 16-byte copy of their rows.
fn kv_unit_columns(fl: &Flash) -> bool {
    [&fl.f.k, &fl.f.v].iter().all(|view| view.strides.last().and_then(Dim::as_const) == Some(1))
}

/// Whether the K and V rows of this work item can be copied 16 bytes at a time (`vec_`): unit
/// column stride (known at emission), and widths, row strides and offsets multiples of 8
/// halves (checked per run).
fn mma_stage_setup(fl: &Flash) -> Result<Vec<String>, CudaEmitError> {
    let (k, v) = (&fl.f.k, &fl.f.v);
    let (kr, vr) = (k.strides.len() - 2, v.strides.len() - 2);
    if !kv_unit_columns(fl) {
        return Ok(vec!["const bool vec_ = false;".into()]);
    }
    let aligned = |s: &Dim| -> Result<String, CudaEmitError> { Ok(format!("{} % 8 == 0", fl.ints.dim(s)?)) };
    let mut conds = vec![aligned(&k.strides[kr])?, aligned(&v.strides[vr])?];
    for pg in [&fl.f.k_paging, &fl.f.v_paging].into_iter().flatten() {
        conds.push(aligned(&pg.stride)?);
    }
    Ok(vec![format!("const bool vec_ = D_ % 8 == 0 && DV_ % 8 == 0 && koff_ % 8 == 0 && voff_ % 8 == 0 && {};", conds.join(" && "))])
}

/// Starts copying the K or V tile whose first key is `k0` into shared memory: asynchronous
/// 16-byte copies (zero-filled beyond the matrix) when `vec_`, element by element otherwise.
/// Both end in a commit, so `attnc_cp_wait_all` then a barrier make the tile visible.
fn mma_stage(fl: &Flash, which: char, k0: &str) -> Result<Vec<String>, CudaEmitError> {
    mma_stage_to(fl, which, k0, if which == 'k' { "Ks_" } else { "Vs_" })
}

/// [`mma_stage`] into the tile at `buf` (a `u16*`; `{buf}s_` its shared address).
fn mma_stage_to(fl: &Flash, which: char, k0: &str, buf: &str) -> Result<Vec<String>, CudaEmitError> {
    let step = fl.f.step;
    let contiguous = kv_unit_columns(fl);
    let (base, width) = if which == 'k' { ("K_", "D_") } else { ("V_", "DV_") };
    let mut out = Vec::new();
    if contiguous {
        // 16-byte chunks, HD_ / 8 per row. When they divide the block's threads, each thread
        // copies one column of rows tid_ / (HD_ / 8) + c * (128 / (HD_ / 8)): the loop unrolls
        // and the addresses step by constants.
        let src = fl.kv_raw(which, "jr_", "c64_")?;
        // The copy of chunk (r_, cc_), the same in both loops.
        let copy = [
            format!("      const bool in_ = jr_ < N_ && c64_ < {width};"),
            format!(
                "      attnc_cp16({buf}s_ + 2u * ATTNC_OFF_{step}(BN_, r_, cc_), in_ ? (const void*)&{src} : (const void*){base}, in_);"
            ),
        ];
        out.push("if (vec_) {".into());
        out.push(format!("  constexpr int CPR_ = HD_ / 8, RS_ = {CUDA_FLASH_THREADS} / CPR_;"));
        // One pointer stepped by rows: not across pages.
        let stepped = if fl.paged() { " && false" } else { "" };
        out.push(format!("  if constexpr ({CUDA_FLASH_THREADS} % CPR_ == 0{stepped}) {{"));
        // One pointer per thread, stepped by RS_ rows; one 32-bit bound per tile.
        let view = if which == 'k' { &fl.f.k } else { &fl.f.v };
        let row_stride = fl.ints.dim(&view.strides[view.strides.len() - 2])?;
        let first = fl.kv_raw(which, &format!("({k0} + r0_)"), "(i64)cc_")?;
        out.push("    const int r0_ = tid_ / CPR_, cc_ = (tid_ % CPR_) * 8;".into());
        out.push(format!("    const u16* src_ = &{first};"));
        out.push(format!("    const i64 step_ = (i64)RS_ * {row_stride};"));
        out.push(format!("    const i64 left64_ = N_ - ({k0} + r0_);  // rows of this thread's column inside the matrix"));
        out.push(format!("    const int left_ = cc_ < {width} ? (int)(left64_ < BN_ ? left64_ : BN_) : 0;"));
        out.push("    #pragma unroll".into());
        out.push("    for (int c_ = 0; c_ < BN_ / RS_; ++c_) {".into());
        out.push("      const bool in_ = c_ * RS_ < left_;".into());
        out.push(format!(
            "      attnc_cp16({buf}s_ + 2u * ATTNC_OFF_{step}(BN_, r0_ + c_ * RS_, cc_), in_ ? (const void*)src_ : (const void*){base}, in_);"
        ));
        out.push("      src_ += step_;".into());
        out.push("    }".into());
        out.push("  } else {".into());
        out.push(format!("    for (int e_ = tid_; e_ < BN_ * CPR_; e_ += {CUDA_FLASH_THREADS}) {{"));
        out.push("      const int r_ = e_ / CPR_, cc_ = (e_ % CPR_) * 8;".into());
        out.push(format!("      const i64 jr_ = {k0} + r_, c64_ = cc_;"));
        out.extend(copy.iter().cloned());
        out.push("    }".into());
        out.push("  }".into());
        out.push("} else {".into());
    }
    let body = vec![
        format!("for (int e_ = tid_; e_ < BN_ * HD_; e_ += {CUDA_FLASH_THREADS}) {{"),
        "  const int r_ = e_ / HD_, cc_ = e_ % HD_;".into(),
        format!("  const i64 jr_ = {k0} + r_, c64_ = cc_;"),
        format!("  {buf}[ATTNC_OFF_{step}(BN_, r_, cc_)] = (jr_ < N_ && c64_ < {width}) ? {} : (u16)0;", fl.kv_raw(which, "jr_", "c64_")?),
        "}".into(),
    ];
    if contiguous {
        out.extend(indent(&body, 2));
        out.push("}".into());
    } else {
        out.extend(body);
    }
    out.push("attnc_cp_commit();".into());
    Ok(out)
}

/// On Hopper's warpgroup path, the threads' copies into the swizzled tiles made visible to
/// `wgmma` (which reads shared memory through the async proxy): each thread fences after its
/// copies are complete and before the barrier.
fn proxy_fence(step: usize) -> Vec<String> {
    vec![format!("#if ATTNC_WG_{step}"), "attnc_fence_proxy();".into(), "#endif".into()]
}

/// `kt_`, the query block's first live key tile (`nkt_` when none is).
fn first_live_tile() -> Vec<String> {
    vec!["i64 kt_ = 0;".to_string(), format!("while (kt_ < nkt_ && {}) ++kt_;  // first live tile", Flash::skipped("kt_"))]
}

/// The top of key tile `kt_` in the tensor-core kernel: its class, the next live tile `nx_`,
/// its first key `k0_`, and the wait for the copies in flight (fenced for the warpgroup
/// products); a barrier follows.
fn tile_top(step: usize) -> Vec<String> {
    let mut out = vec![
        Flash::class_line("kt_"),
        "i64 nx_ = kt_ + 1;".into(),
        format!("while (nx_ < nkt_ && {}) ++nx_;  // next live tile", Flash::skipped("nx_")),
        "const i64 k0_ = kt_ * BN_;".into(),
        "attnc_cp_wait_all();".into(),
    ];
    out.extend(proxy_fence(step));
    out
}

/// The key tiles on Hopper with two K/V stages (`ATTNC_WGS_n`): stage `st_` holds the tile being
/// worked on while the next live tile's K and V are copied into the other, during the whole
/// tile. At the top of each tile, one wait for the copies and one barrier (the copies are in,
/// and every warp is done with the other stage, whose products were waited for in the tile
/// before), then the next tile's copies, then the pipelined tile ([`wg_pipelined`]). Stage `s`
/// is K then V at `2 s · BN_ · HD_` halves past stage 0 (`Ks_`, `Vs_`).
fn wg_staged_loop(fl: &Flash, p: &[String], pack: &str, bf16: bool) -> Result<Vec<String>, CudaEmitError> {
    let step = fl.f.step;
    let copies = |t: &str, st: &str| stage_copies(fl, t, st);
    let mut out = first_live_tile();
    out.push("int st_ = 0;  // the stage of tile kt_".into());
    out.push("if (kt_ < nkt_) {".into());
    out.extend(copies("kt_", "0")?);
    out.push("}".into());
    out.push("while (kt_ < nkt_) {".into());
    let mut tile = tile_top(step);
    tile.push("attnc_sync();  // K(kt) and V(kt) are in; every warp is done with the other stage".into());
    tile.push("if (nx_ < nkt_) {".into());
    tile.extend(copies("nx_", "st_ ^ 1")?);
    tile.push("}".into());
    tile.push("const unsigned kvo_ = (unsigned)st_ * (4u * BN_ * HD_);  // stage st_'s bytes past stage 0".into());
    tile.extend(wg_pipelined(fl, p, &[], "kvo_", pack, bf16)?);
    tile.push("st_ ^= 1;".into());
    tile.push("kt_ = nx_;".into());
    out.extend(indent(&tile, 2));
    out.push("}".into());
    Ok(out)
}

/// The copies of key tile `t`'s K and V into stage `st` (K then V at `2 st · BN_ · HD_` halves
/// past stage 0), in a scope of their own, indented.
fn stage_copies(fl: &Flash, t: &str, st: &str) -> Result<Vec<String>, CudaEmitError> {
    let k0 = format!("{t} * BN_");
    let mut v = vec![
        format!("u16* const Kn_ = Ks_ + ({st}) * (2 * BN_ * HD_);"),
        format!("u16* const Vn_ = Vs_ + ({st}) * (2 * BN_ * HD_);"),
        format!("const unsigned Kn_s_ = Ks_s_ + ({st}) * (4u * BN_ * HD_), Vn_s_ = Vs_s_ + ({st}) * (4u * BN_ * HD_);"),
    ];
    v.extend(mma_stage_to(fl, 'k', &k0, "Kn_")?);
    v.extend(mma_stage_to(fl, 'v', &k0, "Vn_")?);
    Ok(indent(&v, 2))
}

/// One key tile on Hopper with two m-tiles, pipelined within the warpgroup (FlashAttention-3's
/// overlap of softmax and products, between the block's two m-tiles): both score products are
/// issued, m-tile 0's weights are formed while m-tile 1's scores are still on the tensor
/// cores, then m-tile 0's `O += P V` is issued and m-tile 1's weights are formed while it runs.
/// Each wait is followed by `attnc_wg_hold` on the accumulators it made ready. `swap` (the
/// barrier after which K(kt) is free and K(next)'s copy starts; none with two stages) comes once
/// both score products are done. `kv`: the byte offset of the tile's K/V stage.
fn wg_pipelined(fl: &Flash, p: &[String], swap: &[String], kv: &str, pack: &str, bf16: bool) -> Result<Vec<String>, CudaEmitError> {
    let t = if bf16 { 'b' } else { 'h' };
    let scores = |mt: usize| {
        let mut v = wg_score_products(t, &mt.to_string(), kv);
        v.push("attnc_wg_commit();".into());
        v
    };
    let pv = |mt: usize| {
        let mut v = wg_pv_products(t, pack, &mt.to_string(), kv);
        v.push("attnc_wg_commit();".into());
        v
    };
    let mut out = vec![
        "float s_[MT_][NT_][4], mx_[MT_][2];".to_string(),
        "#pragma unroll".into(),
        "for (int mt_ = 0; mt_ < MT_; ++mt_) { mx_[mt_][0] = -ATTNC_INF; mx_[mt_][1] = -ATTNC_INF; }".into(),
        "// S = Q Kᵀ for both m-tiles, two commit groups (as in mma_scores).".into(),
        "attnc_wg_fence();".into(),
    ];
    out.extend(scores(0));
    out.extend(scores(1));
    out.push("attnc_wg_wait1();  // m-tile 0's scores; m-tile 1's may still run".into());
    out.push("attnc_wg_hold<NT_ * 4>(&s_[0][0][0]);".into());
    out.extend(mma_weights(fl, p, Mts("0", "1"))?);
    out.push("attnc_wg_wait0();  // m-tile 1's scores: K(kt) is no longer read".into());
    out.push("attnc_wg_hold<NT_ * 4>(&s_[1][0][0]);".into());
    out.extend(swap.iter().cloned());
    out.push("// O += P V for m-tile 0 (P packed first: the product in flight reads its registers),".into());
    out.push("// then m-tile 1's weights while it runs.".into());
    out.push("unsigned pw_[MT_][BN_ / 16][4];".into());
    out.extend(pv(0));
    out.extend(mma_weights(fl, p, Mts("1", "2"))?);
    out.extend(pv(1));
    out.push("attnc_wg_wait0();  // before V(kt) and the accumulators are touched again".into());
    out.push("attnc_wg_hold<DT_ * 4>(&o_[0][0][0]);".into());
    out.push("attnc_wg_hold<DT_ * 4>(&o_[1][0][0]);".into());
    Ok(out)
}

/// The warpgroup products `S = Q Kᵀ` of m-tile `mt` (16 columns of the head width each; Q's
/// sub-tile `ks >> 2` of 64 columns at rows `64 mt`, K-major, 32 bytes per step), K from the
/// stage `kv` bytes past stage 0; issued, not committed.
fn wg_score_products(t: char, mt: &str, kv: &str) -> Vec<String> {
    wg_score_products_of(t, mt, mt, kv)
}

/// [`wg_score_products`] into the accumulators of m-tile `acc` from the block's m-tile `mt` of Q.
fn wg_score_products_of(t: char, acc: &str, mt: &str, kv: &str) -> Vec<String> {
    vec![
        "#pragma unroll".into(),
        "for (int ks_ = 0; ks_ < HD_ / 16; ++ks_)".into(),
        format!("  attnc_wg_ss_{t}64(&s_[{acc}][0][0],"),
        format!("    attnc_wg_desc(sa_ + 2u * ((ks_ >> 2) * BM_ * 64 + ({mt}) * 64 * 64) + 32u * (ks_ & 3), 16u, 1024u),"),
        format!("    attnc_wg_desc(sa_ + {kv} + 2u * (BM_ * HD_ + (ks_ >> 2) * BN_ * 64) + 32u * (ks_ & 3), 16u, 1024u), ks_ > 0);"),
    ]
}

/// `O += P V` of m-tile `mt` as warpgroup products: its weights `s_` packed into `pw_` (a
/// product in flight reads those registers: they stay until its wait), then one product per 16
/// keys, V's rows `16 kk` of each 64-column sub-tile (BN_ rows apart), MN-major, from the stage
/// `kv` bytes past stage 0; issued, not committed.
fn wg_pv_products(t: char, pack: &str, mt: &str, kv: &str) -> Vec<String> {
    let mut out = wg_pack(pack, mt);
    out.push("attnc_wg_fence();".into());
    out.extend(wg_pv_products_packed(t, mt, kv));
    out
}

/// The weights `s_` of m-tile `mt` packed into `pw_`, the A operand of `O += P V` (the
/// accumulator layout of two adjacent n-tiles is the A-fragment layout).
fn wg_pack(pack: &str, mt: &str) -> Vec<String> {
    vec![
        "#pragma unroll".into(),
        "for (int kk_ = 0; kk_ < BN_ / 16; ++kk_) {".into(),
        format!("  pw_[{mt}][kk_][0] = {pack}(s_[{mt}][2 * kk_][0], s_[{mt}][2 * kk_][1]);"),
        format!("  pw_[{mt}][kk_][1] = {pack}(s_[{mt}][2 * kk_][2], s_[{mt}][2 * kk_][3]);"),
        format!("  pw_[{mt}][kk_][2] = {pack}(s_[{mt}][2 * kk_ + 1][0], s_[{mt}][2 * kk_ + 1][1]);"),
        format!("  pw_[{mt}][kk_][3] = {pack}(s_[{mt}][2 * kk_ + 1][2], s_[{mt}][2 * kk_ + 1][3]);"),
        "}".into(),
    ]
}

/// The warpgroup products `O += P V` of m-tile `mt` from weights already packed in `pw_`, V from
/// the stage `kv` bytes past stage 0 (one product per 16 keys, as [`wg_pv_products`]); issued,
/// not committed, after a `wgmma.fence` of the caller's.
fn wg_pv_products_packed(t: char, mt: &str, kv: &str) -> Vec<String> {
    vec![
        "#pragma unroll".into(),
        "for (int kk_ = 0; kk_ < BN_ / 16; ++kk_) {".into(),
        format!(
            "  const unsigned long long vd_ = attnc_wg_desc(sa_ + {kv} + 2u * (BM_ * HD_ + BN_ * HD_) + 2048u * kk_, 128u * BN_, 1024u);"
        ),
        format!("  if constexpr (HD_ == 64) attnc_wg_rs_{t}64_t(&o_[{mt}][0][0], pw_[{mt}][kk_], vd_, 1);"),
        format!("  else attnc_wg_rs_{t}128_t(&o_[{mt}][0][0], pw_[{mt}][kk_], vd_, 1);"),
        "}".into(),
    ]
}

/// S = Q Kᵀ for the warp's rows on tensor cores. `mma.sync`: Q and K fragments come from
/// shared memory through `ldmatrix` (four 8×8 matrices per load: Q's A fragment, or the B
/// fragments of two key n-tiles). Hopper: one `wgmma` per m-tile and 16 columns of the head
/// width, both operands read from the swizzled tiles; the accumulators land in the same layout.
fn mma_scores(mma: &str, step: usize, bf16: bool) -> Vec<String> {
    let t = if bf16 { 'b' } else { 'h' };
    let mut out = vec!["float s_[MT_][NT_][4];".to_string(), format!("#if ATTNC_WG_{step}"), "attnc_wg_fence();".into()];
    out.extend(ALL_MTS.each(&wg_score_products(t, "mt_", "0u")));
    out.extend(["attnc_wg_commit();".to_string(), "attnc_wg_wait0();".into()]);
    out.extend(
        format!(
            "#else
#pragma unroll
for (int mt_ = 0; mt_ < MT_; ++mt_)
  #pragma unroll
  for (int nt_ = 0; nt_ < NT_; ++nt_) {{ s_[mt_][nt_][0] = 0.0f; s_[mt_][nt_][1] = 0.0f; s_[mt_][nt_][2] = 0.0f; s_[mt_][nt_][3] = 0.0f; }}
#pragma unroll
for (int ks_ = 0; ks_ < HD_ / 16; ++ks_) {{
  // A of each m-tile: matrices (rows 0-7 | 8-15) x (columns 0-7 | 8-15) of its 16 rows.
  unsigned a_[MT_][4];
  #pragma unroll
  for (int mt_ = 0; mt_ < MT_; ++mt_) {{
    if constexpr (QR_) {{
      a_[mt_][0] = qf_[mt_][ks_][0]; a_[mt_][1] = qf_[mt_][ks_][1]; a_[mt_][2] = qf_[mt_][ks_][2]; a_[mt_][3] = qf_[mt_][ks_][3];
    }} else {{
      attnc_ldsm_x4(a_[mt_], qa_s_ + 128u * LD_ * mt_ + 32u * ks_);
    }}
  }}
  #pragma unroll
  for (int nt_ = 0; nt_ < NT_; nt_ += 2) {{
    // B of n-tiles nt, nt+1: key rows of the tile (lm_ >> 1), columns 0-7 | 8-15 (lm_ & 1).
    unsigned kb_[4];
    attnc_ldsm_x4(kb_, kb_s_ + 2u * (nt_ * 8 * LD_ + ks_ * 16));
    #pragma unroll
    for (int mt_ = 0; mt_ < MT_; ++mt_) {{
      {mma}(s_[mt_][nt_], a_[mt_], kb_);
      {mma}(s_[mt_][nt_ + 1], a_[mt_], kb_ + 2);
    }}
  }}
}}
#endif
// Accumulator element e of m-tile mt, n-tile nt: row rw_ + 16 mt + 8 (e >> 1), key
// k0_ + 8 nt + 2 tg_ + (e & 1).
float mx_[MT_][2];
#pragma unroll
for (int mt_ = 0; mt_ < MT_; ++mt_) {{ mx_[mt_][0] = -ATTNC_INF; mx_[mt_][1] = -ATTNC_INF; }}"
        )
        .lines()
        .map(String::from),
    );
    out
}

/// The online-softmax update of the tensor-core kernel for m-tile `mt_` (row maxima over the
/// 4 lanes of a row).
const MMA_SOFTMAX: &str = "float sc_[2], ml_[2];
#pragma unroll
for (int h_ = 0; h_ < 2; ++h_) {
  // Row maxima (base 2) over the 4 lanes sharing a row (lanes differ in tg_, the low two bits).
  float mx = mx_[mt_][h_];
  mx = fmaxf(mx, attnc_shfl_xor(mx, 1)); mx = fmaxf(mx, attnc_shfl_xor(mx, 2));
  const float mn_ = fmaxf(m_[mt_][h_], mx);
  sc_[h_] = mn_ == -ATTNC_INF ? 1.0f : attnc_exp2_fast(m_[mt_][h_] - mn_);
  m_[mt_][h_] = mn_; l_[mt_][h_] *= sc_[h_];
  ml_[h_] = mn_ == -ATTNC_INF ? 0.0f : mn_;
}
#pragma unroll
for (int nt_ = 0; nt_ < NT_; ++nt_) {
  #pragma unroll
  for (int e_ = 0; e_ < 4; ++e_) {
    const float p_ = attnc_exp2_fast(fmaf(s_[mt_][nt_][e_], a2_, -ml_[e_ >> 1]));
    s_[mt_][nt_][e_] = p_;
    l_[mt_][e_ >> 1] += p_;
  }
}";

/// Dropout of the tensor-core kernel's weights `s_` of m-tile `mt_`, one generator call per four of a lane's
/// elements: n-tile `8 nb + par + 2 w` of key block `nb` holds word `w` of the call for lane
/// position `8 par + 2 tg + (e & 1)` (docs/language.md's counter layout).
const MMA_DROPOUT: &str = "#pragma unroll
for (int e_ = 0; e_ < 4; ++e_) {
  const i64 i_ = rw_ + mt_ * 64 + (e_ >> 1) * 8;
  #pragma unroll
  for (int nb_ = 0; nb_ < NT_ / 8; ++nb_) {
    #pragma unroll
    for (int par_ = 0; par_ < 2; ++par_) {
      unsigned w_[4];
      attnc_philox4(dseed_, (int)bz_, (int)i_, (unsigned)(((k0_ >> 6) + nb_) << 4) | (unsigned)(par_ * 8 + tg_ * 2 + (e_ & 1)), w_);
      #pragma unroll
      for (int w = 0; w < 4; ++w) s_[mt_][nb_ * 8 + par_ + 2 * w][e_] *= (w_[w] >> 8) >= (unsigned)dthr_ ? dscale_ : 0.0f;
    }
  }
}";

/// O += P V on tensor cores: P's accumulator layout is the A-fragment layout of two adjacent
/// n-tiles. `mma.sync`: V's B fragments come transposed through `ldmatrix.trans` (two d-tiles
/// per load). Hopper: [`wg_pv_products`] for each m-tile, then one wait.
fn mma_pv(mma: &str, pack: &str, step: usize, bf16: bool) -> Vec<String> {
    let t = if bf16 { 'b' } else { 'h' };
    let mut out = vec![format!("#if ATTNC_WG_{step}"), "unsigned pw_[MT_][BN_ / 16][4];".into()];
    out.extend(ALL_MTS.each(&wg_pv_products(t, pack, "mt_", "0u")));
    out.extend(["attnc_wg_commit();".to_string(), "attnc_wg_wait0();".into()]);
    out.extend(
        format!(
            "#else
#pragma unroll
for (int kk_ = 0; kk_ < BN_ / 16; ++kk_) {{
  unsigned pa_[MT_][4];
  #pragma unroll
  for (int mt_ = 0; mt_ < MT_; ++mt_) {{
    pa_[mt_][0] = {pack}(s_[mt_][2 * kk_][0], s_[mt_][2 * kk_][1]);
    pa_[mt_][1] = {pack}(s_[mt_][2 * kk_][2], s_[mt_][2 * kk_][3]);
    pa_[mt_][2] = {pack}(s_[mt_][2 * kk_ + 1][0], s_[mt_][2 * kk_ + 1][1]);
    pa_[mt_][3] = {pack}(s_[mt_][2 * kk_ + 1][2], s_[mt_][2 * kk_ + 1][3]);
  }}
  #pragma unroll
  for (int t_ = 0; t_ < DT_; t_ += 2) {{
    // B of d-tiles t, t+1: keys 0-7 | 8-15 of the step (lm_ & 1), columns of the tile (lm_ >> 1).
    unsigned vb_[4];
    attnc_ldsm_x4_t(vb_, vb_s_ + 2u * (kk_ * 16 * LD_ + t_ * 8));
    #pragma unroll
    for (int mt_ = 0; mt_ < MT_; ++mt_) {{
      {mma}(o_[mt_][t_], pa_[mt_], vb_);
      {mma}(o_[mt_][t_ + 1], pa_[mt_], vb_ + 2);
    }}
  }}
}}
#endif"
        )
        .lines()
        .map(String::from),
    );
    out
}

/// The tensor-core kernel's rows: sums over the 4 lanes of a row, then the output.
fn mma_finish(fl: &Flash, mts: Mts) -> Result<Vec<String>, CudaEmitError> {
    let mut out = vec![
        "#pragma unroll".to_string(),
        format!("for (int mt_ = {}; mt_ < {}; ++mt_) {{", mts.0, mts.1),
        "  float inv_[2];".into(),
        "  #pragma unroll".into(),
        "  for (int h_ = 0; h_ < 2; ++h_) {".into(),
    ];
    if fl.softmax {
        out.push("    float l = l_[mt_][h_];".into());
        out.push("    l += attnc_shfl_xor(l, 1); l += attnc_shfl_xor(l, 2);".into());
        out.push("    inv_[h_] = l == 0.0f ? 0.0f : 1.0f / l;".into());
        // The row maxima are in base 2: ln Σ e^x = m · ln 2 + ln Σ 2^(x log2 e - m).
        if let Some(st) = fl.store_lse("ri_", "m_[mt_][h_] * 0.6931471805599453f + logf(l)")? {
            out.push("    const i64 ri_ = rw_ + mt_ * 64 + h_ * 8;".into());
            out.push(format!("    if (tg_ == 0 && ri_ < M_) {st}"));
        }
    } else {
        out.push("    inv_[h_] = 1.0f;".into());
    }
    out.push("  }".into());
    out.push("  #pragma unroll".into());
    out.push("  for (int t_ = 0; t_ < DT_; ++t_) {".into());
    out.push("    #pragma unroll".into());
    out.push("    for (int e_ = 0; e_ < 4; ++e_) {".into());
    out.push("      const i64 i_ = rw_ + mt_ * 64 + (e_ >> 1) * 8, col_ = t_ * 8 + tg_ * 2 + (e_ & 1);".into());
    out.push(format!("      if (i_ < M_ && col_ < DV_) {}", fl.store_out("i_", "col_", "(o_[mt_][t_][e_] * inv_[e_ >> 1])")?));
    out.push("    }".into());
    out.push("  }".into());
    out.push("}".into());
    Ok(out)
}

/// The split-KV decode kernel: one warp per work item (four per block).
fn split_kv(fl: &Flash, items: &str) -> Result<KernelSource, CudaEmitError> {
    let step = fl.f.step;
    let (m, _, _, _) = fl.f.sizes();
    let rows = m.as_const().filter(|r| *r >= 1).ok_or_else(|| fl.ints.fail(format!("split-KV needs a constant query count, not `{m}`")))?;
    let warps = i64::from(CUDA_FLASH_THREADS / 32);
    let mut body = vec![
        format!("constexpr int HD_ = ATTNC_HD_{step}, T_ = HD_ / 32, MR_ = {rows};"),
        "const int lane_ = threadIdx.x & 31;".into(),
        format!("float* __restrict__ part_ = {};", ptr(fl.f.partials, attn_compiler::ir::DType::F32, true)),
    ];
    body.extend(fl.head()?);
    body.push(format!("for (i64 w_ = (i64)blockIdx.x * {warps} + (threadIdx.x >> 5); w_ < {items}; w_ += (i64)gridDim.x * {warps}) {{"));
    let mut it = Vec::new();
    let p = fl.item(&mut it, false)?;
    it.push("const i64 j0_ = sp_ * kps_, j1_ = j0_ + kps_ < N_ ? j0_ + kps_ : N_;".into());
    it.push("float q_[MR_][T_], o_[MR_][T_], m_[MR_], l_[MR_];".into());
    it.push("for (int r_ = 0; r_ < MR_; ++r_) {".into());
    it.push("  m_[r_] = -ATTNC_INF; l_[r_] = 0.0f;".into());
    it.push("  for (int t_ = 0; t_ < T_; ++t_) {".into());
    it.push("    const i64 qi_ = qb_ * MR_ + r_, qc_ = lane_ + 32 * t_;".into());
    it.extend(indent(&fl.q("qi_", "qc_")?, 4));
    it.push("    q_[r_][t_] = x_; o_[r_][t_] = 0.0f;".into());
    it.push("  }".into());
    it.push("}".into());
    it.push(format!("for (i64 kc_ = j0_; kc_ < j1_; kc_ += {CUDA_LANE_KEYS}) {{"));
    let mut chunk = vec![
        Flash::class_line(&format!("kc_ / {CUDA_LANE_KEYS}")),
        "if (cls_ == 0) continue;".into(),
        format!("for (int jj_ = 0; jj_ < {CUDA_LANE_KEYS}; ++jj_) {{"),
        "  const i64 j_ = kc_ + jj_;".into(),
        "  if (j_ >= j1_) break;".into(),
        "  float k_[T_], v_[T_];".into(),
        "  #pragma unroll".into(),
        "  for (int t_ = 0; t_ < T_; ++t_) {".into(),
        "    const i64 c64_ = lane_ + 32 * t_;".into(),
        format!("    k_[t_] = c64_ < D_ ? {} : 0.0f;", fl.kv('k', "j_", "c64_")?),
        format!("    v_[t_] = c64_ < DV_ ? {} : 0.0f;", fl.kv('v', "j_", "c64_")?),
        "  }".into(),
        "  #pragma unroll".into(),
        "  for (int r_ = 0; r_ < MR_; ++r_) {".into(),
        "    float s_ = 0.0f;".into(),
        "    #pragma unroll".into(),
        "    for (int t_ = 0; t_ < T_; ++t_) s_ += q_[r_][t_] * k_[t_];".into(),
        "    s_ = attnc_warp_sum(s_) * alpha_;".into(),
        "    const i64 i_ = qb_ * MR_ + r_;".into(),
        "    bool keep_ = true;".into(),
    ];
    chunk.extend(indent(&fl.score(&p, "i_", "j_", "s_")?, 4));
    chunk.push("    if (!keep_) continue;".into());
    chunk.extend(indent(&decode_weights(fl.softmax, &fl.drop("pd_", "i_", "j_")), 4));
    chunk.push("  }".into());
    chunk.push("}".into());
    it.extend(indent(&chunk, 2));
    it.push("}".into());
    it.extend(decode_finish(fl)?);
    body.extend(indent(&it, 2));
    body.push("}".into());
    Ok(KernelSource { threads: CUDA_FLASH_THREADS, items_per_block: warps, smem: Smem::None, body })
}

/// One key's weight and its update of a decode row's state; `drop` scales the weight `pd_` the
/// values see (dropout).
fn decode_weights(softmax: bool, drop: &[String]) -> Vec<String> {
    let (weight, update): (&[&str], &str) = if softmax {
        (
            &[
                "const float mn_ = attnc_fmax(m_[r_], sc_);",
                "if (mn_ == -ATTNC_INF) continue;",
                "const float scale_ = expf(m_[r_] - mn_), p_ = expf(sc_ - mn_);",
                "l_[r_] = l_[r_] * scale_ + p_;",
                "m_[r_] = mn_;",
            ],
            "for (int t_ = 0; t_ < T_; ++t_) o_[r_][t_] = o_[r_][t_] * scale_ + pd_ * v_[t_];",
        )
    } else {
        (&["const float p_ = attnc_sigmoid(sc_);"], "for (int t_ = 0; t_ < T_; ++t_) o_[r_][t_] += pd_ * v_[t_];")
    };
    let mut out: Vec<String> = weight.iter().map(|s| s.to_string()).collect();
    out.push("float pd_ = p_;".into());
    out.extend(drop.iter().cloned());
    out.push("#pragma unroll".into());
    out.push(update.into());
    out
}

/// A flash op's dropout as its kernels read it: the seed (`dseed_`, from its extra operand),
/// the keep threshold (`dthr_`) and the factor on kept weights (`dscale_`). Nothing without
/// dropout.
pub(super) fn dropout_head(ints: &Ints, d: Option<&attn_compiler::ir::Dropout>, extras: &[View]) -> Result<Vec<String>, CudaEmitError> {
    use attn_compiler::ir::semantics;
    let Some(d) = d else { return Ok(Vec::new()) };
    let seed = extras.get(d.seed).ok_or_else(|| ints.fail(format!("the dropout seed x{} is not an operand", d.seed)))?;
    let at = ints.offset(seed, &[])?;
    Ok(vec![
        format!("const int dseed_ = {};", super::cexpr::load(seed.buf, seed.dtype, &at)),
        format!(
            "const int dthr_ = {}; const float dscale_ = {:?}f;  // dropout: kept when the bits reach dthr_",
            semantics::dropout_threshold(d.rate),
            semantics::dropout_scale(d.rate) as f32
        ),
    ])
}

/// Dropout's factor on score `(i, j)` of flat batch index `batch` (C expressions).
pub(super) fn dropout_factor(batch: &str, i: &str, j: &str) -> String {
    format!("(attnc_dropout_bits(dseed_, (int){batch}, (int)({i}), (int)({j})) >= dthr_ ? dscale_ : 0.0f)")
}

/// A decode item's rows (one split), or its partial state (`max, sum, acc` per row) for the
/// merge.
fn decode_finish(fl: &Flash) -> Result<Vec<String>, CudaEmitError> {
    let inv = if fl.softmax { "(l_[r_] == 0.0f ? 0.0f : 1.0f / l_[r_])" } else { "1.0f" };
    let mut out = vec![
        "for (int r_ = 0; r_ < MR_; ++r_) {".to_string(),
        "  const i64 i_ = qb_ * MR_ + r_;".into(),
        "  if (i_ >= M_) break;".into(),
        "  if (splits_ == 1) {".into(),
        format!("    const float inv_ = {inv};"),
        "    for (int t_ = 0; t_ < T_; ++t_) {".into(),
        "      const i64 col_ = lane_ + 32 * t_;".into(),
    ];
    out.push(format!("      if (col_ < DV_) {}", fl.store_out("i_", "col_", "(o_[r_][t_] * inv_)")?));
    out.push("    }".into());
    if fl.softmax
        && let Some(st) = fl.store_lse("i_", "m_[r_] + logf(l_[r_])")?
    {
        out.push(format!("    if (lane_ == 0) {st}"));
    }
    out.extend(
        [
            "    continue;",
            "  }",
            "  float* pr_ = part_ + (w_ * MR_ + r_) * (DV_ + 2);",
            "  for (int t_ = 0; t_ < T_; ++t_) {",
            "    const i64 col_ = lane_ + 32 * t_;",
            "    if (col_ < DV_) pr_[2 + col_] = o_[r_][t_];",
            "  }",
            "  if (lane_ == 0) { pr_[0] = m_[r_]; pr_[1] = l_[r_]; }",
            "}",
        ]
        .map(String::from),
    );
    Ok(out)
}

/// The merge of split-key partial states: one warp per (batch index, query block).
pub(super) fn emit_merge(ints: &Ints, items: &str, f: &FlashKernel) -> Result<KernelSource, CudaEmitError> {
    let fl = Flash::new(ints, f);
    let (m, _, _, dv) = f.sizes();
    let mut body = vec![
        "const int lane_ = threadIdx.x & 31;".to_string(),
        format!("const i64 M_ = {}, DV_ = {}, bm_ = {};", ints.dim(&m)?, ints.dim(&dv)?, fl.tuning(Tuning::BlockM)?),
        format!("const i64 nqb_ = {}, splits_ = {};", fl.tuning(Tuning::QueryBlocks)?, fl.tuning(Tuning::Splits)?),
        format!("const float* __restrict__ part_ = {};", ptr(f.partials, attn_compiler::ir::DType::F32, false)),
        format!(
            "for (i64 w_ = (i64)blockIdx.x * {CUDA_ROW_WARPS} + (threadIdx.x >> 5); w_ < {items}; w_ += (i64)gridDim.x * {CUDA_ROW_WARPS}) {{"
        ),
    ];
    let mut it = vec!["const i64 qb_ = w_ % nqb_, bz_ = w_ / nqb_;".to_string()];
    let p = delinearize(ints, &mut it, "bz_", &fl.batch, "p")?;
    let strides = f.out.batch_strides(&fl.batch);
    let bview = View { shape: fl.batch.clone(), strides, ..f.out.clone() };
    it.push(format!("const i64 ooff_ = {};", ints.offset(&bview, &p)?));
    it.extend(fl.lse_offset(&p)?);
    it.push("for (i64 r_ = 0; r_ < bm_ && qb_ * bm_ + r_ < M_; ++r_) {".into());
    it.push("  const i64 i_ = qb_ * bm_ + r_;".into());
    it.push("  const float* row_ = part_ + (w_ * splits_ * bm_ + r_) * (DV_ + 2);  // split s at row_ + s * bm_ * (DV_ + 2)".into());
    it.push("  const i64 ps_ = bm_ * (DV_ + 2);".into());
    let mut row = Vec::new();
    if fl.softmax {
        row.extend(
            [
                "float mx_ = -ATTNC_INF;",
                "for (i64 s_ = lane_; s_ < splits_; s_ += 32) mx_ = attnc_fmax(mx_, row_[s_ * ps_]);",
                "mx_ = attnc_warp_max(mx_);",
                "float L_ = 0.0f;",
                "for (i64 s_ = lane_; s_ < splits_; s_ += 32) {",
                "  const float ms_ = row_[s_ * ps_];",
                "  if (ms_ != -ATTNC_INF) L_ += expf(ms_ - mx_) * row_[s_ * ps_ + 1];",
                "}",
                "L_ = attnc_warp_sum(L_);",
                "for (i64 col_ = lane_; col_ < DV_; col_ += 32) {",
                "  float acc_ = 0.0f;",
                "  for (i64 s_ = 0; s_ < splits_; ++s_) {",
                "    const float ms_ = row_[s_ * ps_];",
                "    if (ms_ != -ATTNC_INF) acc_ += expf(ms_ - mx_) * row_[s_ * ps_ + 2 + col_];",
                "  }",
            ]
            .map(String::from),
        );
        row.push(format!("  {}", fl.store_out("i_", "col_", "(L_ == 0.0f ? 0.0f : acc_ / L_)")?));
        row.push("}".into());
        if let Some(st) = fl.store_lse("i_", "mx_ + logf(L_)")? {
            row.push(format!("if (lane_ == 0) {st}"));
        }
    } else {
        row.push("for (i64 col_ = lane_; col_ < DV_; col_ += 32) {".into());
        row.push("  float acc_ = 0.0f;".into());
        row.push("  for (i64 s_ = 0; s_ < splits_; ++s_) acc_ += row_[s_ * ps_ + 2 + col_];".into());
        row.push(format!("  {}", fl.store_out("i_", "col_", "acc_")?));
        row.push("}".into());
    }
    it.extend(indent(&row, 2));
    it.push("}".into());
    body.extend(indent(&it, 2));
    body.push("}".into());
    Ok(KernelSource { threads: CUDA_THREADS, items_per_block: CUDA_ROW_WARPS, smem: Smem::None, body })
}
