//! Flash attention kernels for one `flash` node: online softmax (or sigmoid weights) over key
//! tiles staged in shared memory, the score modification and mask inlined, fully masked tiles
//! skipped through a host-filled tile table, K/V batch axes of size 1 read with stride 0 (GQA
//! and MQA without copies). Three shapes:
//!
//! - `mma`: q, k, v all f16 or all bf16. 4 warps, 64 query rows per block (16 per warp), key
//!   tiles of 64 (32 above head width 128); S = QKᵀ and O += PV on tensor cores with
//!   `mma.sync.m16n8k16` (f32 accumulation), P rounded to the input type as FlashAttention-2
//!   does; row statistics in registers, reduced over the 4 lanes that share a row.
//! - `simt`: any other dtypes, computed in f32. 4 warps × 4 query rows, key tiles of 32 (one
//!   key per lane); each warp keeps its rows' O in registers (lane `l` owns columns `l + 32t`).
//! - `decode` (query length a constant ≤ 4): split-KV. Each warp takes a contiguous range of
//!   key chunks for all query rows, reading K/V rows coalesced; partial (O, max, sum) go to a
//!   scratch buffer and a merge kernel combines them. The split count is a run-time scalar.
//!
//! Head widths are padded to `HD_` (a macro per flash op, a multiple of 32 up to 256); loads
//! beyond the real width read 0.

use super::cexpr::{cdim, is_one, load_ptr, offset, ptr, store, to_float};
use super::expr::Gen;
use super::pointwise::delinearize;
use super::score::{Extra, ScoreCtx, mask_c, score_c};
use super::view::{View, view_of};
use super::{BufferSize, Builder, Grid, HeadDim, Launch, Smem, SplitKv, TileSize, TileTable, pad_head_dim};
use crate::ir::{DType, Dim, FlashSpec, Value, Weights};

/// The largest constant query length that uses the split-KV decode kernel.
const DECODE_MAX_ROWS: i64 = 4;

/// Everything the three kernel shapes share.
struct Common<'a> {
    v: Value,
    spec: &'a FlashSpec,
    q: Value,
    kview: View,
    vview: View,
    kdt: DType,
    vdt: DType,
    extras: Vec<Extra>,
    batch: Vec<Dim>,
    m: Dim,
    n: Dim,
    d: Dim,
    dv: Dim,
    out_dt: DType,
    out_buf: usize,
    hd: usize,
    table: Option<usize>,
}

/// Emits the kernels of flash node `v` into buffer `buf`.
pub(super) fn emit(b: &mut Builder, v: Value, buf: usize, spec: &FlashSpec) -> Result<(), String> {
    let g = b.g;
    let ops = g.operands(v);
    let [q, k, vv, extra_ops @ ..] = ops.as_slice() else { return Err("flash needs q, k and v".into()) };
    let view =
        |w: Value| view_of(g, w, &b.bufs).map_err(|x| format!("operand %{} is not a strided view of a buffer (%{})", w.index(), x.index()));
    let (kview, vview) = (view(*k)?, view(*vv)?);
    let mut extras = Vec::new();
    for x in extra_ops {
        let node = g.node(*x);
        extras.push(Extra { view: view(*x)?, shape: node.ty.shape.clone(), dtype: node.ty.dtype });
    }
    let qt = &g.node(*q).ty;
    let r = qt.rank();
    if r < 2 {
        return Err("flash needs rank 2 or more".into());
    }
    let (kt, vt) = (&g.node(*k).ty, &g.node(*vv).ty);
    let (d, dv) = (qt.shape[r - 1].clone(), vt.shape[r - 1].clone());
    for w in [&d, &dv] {
        if let Some(c) = w.as_const()
            && pad_head_dim(c).is_none()
        {
            return Err(format!("head width {c} is above the 256 the CUDA kernels support"));
        }
    }
    let hd = b.head_dims.len();
    b.head_dims.push(HeadDim { macro_name: format!("ATTNC_HD_{hd}"), qk: d.clone(), v: dv.clone(), node: b.label(v) });
    let m = qt.shape[r - 2].clone();
    let mut c = Common {
        v,
        spec,
        q: *q,
        kview,
        vview,
        kdt: kt.dtype,
        vdt: vt.dtype,
        extras,
        batch: qt.shape[..r - 2].to_vec(),
        m: m.clone(),
        n: kt.shape[r - 2].clone(),
        d,
        dv,
        out_dt: g.node(v).ty.dtype,
        out_buf: buf,
        hd,
        table: None,
    };
    // Broadcast batch axes of k and v read with stride 0.
    for (view, shape) in [(&mut c.kview, &kt.shape), (&mut c.vview, &vt.shape)] {
        for (stride, size) in view.strides.iter_mut().zip(&shape[..r - 2]) {
            if is_one(size) {
                *stride = Dim::constant(0);
            }
        }
    }
    let decode = m.as_const().is_some_and(|rows| (1..=DECODE_MAX_ROWS).contains(&rows));
    let mma = !decode && qt.dtype == kt.dtype && kt.dtype == vt.dtype && matches!(kt.dtype, DType::F16 | DType::BF16);
    let (tile_rows, tile_cols) = if decode {
        (TileSize::Fixed(m.as_const().unwrap_or(1) as u32), TileSize::Fixed(32))
    } else if mma {
        (TileSize::Fixed(64), TileSize::ByHeadDim { head_dim: hd, narrow: 64, wide: 32 })
    } else {
        (TileSize::Fixed(16), TileSize::Fixed(32))
    };
    if let Some(mask) = &spec.mask {
        let n_table = b.tables.len();
        b.tables.push(TileTable { mask: mask.clone(), batch: c.batch.clone(), rows: c.m.clone(), cols: c.n.clone(), tile_rows, tile_cols });
        c.table = Some(b.add_buffer(DType::Bool, BufferSize::Table(n_table), format!("{} tile table", b.label(v))));
    }
    if decode {
        emit_decode(b, &c);
    } else if mma {
        emit_mma(b, &c, tile_rows);
    } else {
        emit_simt(b, &c, tile_rows);
    }
    Ok(())
}

/// Shared kernel head: sizes, batch loop opening, batch index and K/V offsets.
fn head(c: &Common, body: &mut Vec<String>) -> Vec<String> {
    body.push(format!("const i64 M_ = {}, N_ = {}, D_ = {}, DV_ = {};", cdim(&c.m), cdim(&c.n), cdim(&c.d), cdim(&c.dv)));
    body.push(format!("const i64 nb_ = {};", cdim(&Dim::product(&c.batch))));
    body.push(format!("const {}* __restrict__ K_ = {};", super::cexpr::storage(c.kdt), ptr(c.kview.buf, c.kdt, false)));
    body.push(format!("const {}* __restrict__ V_ = {};", super::cexpr::storage(c.vdt), ptr(c.vview.buf, c.vdt, false)));
    if let Some(t) = c.table {
        body.push(format!("const u8* __restrict__ tbl_ = {};", ptr(t, DType::Bool, false)));
    }
    body.push("for (i64 bz_ = blockIdx.y; bz_ < nb_; bz_ += gridDim.y) {".into());
    let p = delinearize(body, "bz_", &c.batch, "p");
    let kb = &c.kview.strides[..c.batch.len()];
    let vb = &c.vview.strides[..c.batch.len()];
    body.push(format!("  const i64 koff_ = {};", offset(&p, kb, &c.kview.offset)));
    body.push(format!("  const i64 voff_ = {};", offset(&p, vb, &c.vview.offset)));
    p
}

/// `K_` / `V_` element loads (as float) at key row `j` and column `col`.
fn kv_load(c: &Common, which: char, j: &str, col: &str) -> String {
    let (view, dt, base, p) = if which == 'k' { (&c.kview, c.kdt, "koff_", "K_") } else { (&c.vview, c.vdt, "voff_", "V_") };
    let r = view.strides.len();
    let off = format!("{base} + {}", offset(&[j.to_string(), col.to_string()], &view.strides[r - 2..], &Dim::constant(0)));
    to_float(&load_ptr(p, dt, &off), dt)
}

/// Raw K/V element (storage type) for the tensor-core path, which copies halves unconverted.
fn kv_raw(c: &Common, which: char, j: &str, col: &str) -> String {
    let (view, base, p) = if which == 'k' { (&c.kview, "koff_", "K_") } else { (&c.vview, "voff_", "V_") };
    let r = view.strides.len();
    format!("{p}[{base} + {}]", offset(&[j.to_string(), col.to_string()], &view.strides[r - 2..], &Dim::constant(0)))
}

/// Statements loading q at (batch, row, col) as a float into `x_` when in range.
fn q_load(b: &Builder, c: &Common, p: &[String], row: &str, col: &str, indent: &str) -> Vec<String> {
    let mut idx = p.to_vec();
    idx.push(row.to_string());
    idx.push(col.to_string());
    let mut sg = Gen::new(b.g, &b.bufs, "q");
    let x = sg.value(c.q, &idx);
    let qdt = b.g.node(c.q).ty.dtype;
    let mut out = vec![format!("{indent}float x_ = 0.0f;"), format!("{indent}if ({row} < M_ && {col} < D_) {{")];
    out.extend(sg.lines.iter().map(|l| format!("{indent}  {l}")));
    out.push(format!("{indent}  x_ = {};", to_float(&x, qdt)));
    out.push(format!("{indent}}}"));
    out
}

/// The score and mask of element (i, j) as statements defining `sc_` and updating `keep_`
/// (which must already hold `j_ < N_`); `cls` is the tile class variable.
fn score_lines(c: &Common, p: &[String], i: &str, j: &str, s: &str, indent: &str) -> Vec<String> {
    let mut pos = p.to_vec();
    pos.push(i.to_string());
    pos.push(j.to_string());
    let cx = ScoreCtx { s, pos: &pos, extras: &c.extras };
    let mut out = vec![format!("{indent}const float sc_ = {};", score_c(&c.spec.score, &cx))];
    if let Some(mask) = &c.spec.mask {
        out.push(format!("{indent}if (cls_ == 2 && keep_) keep_ = {};", mask_c(mask, &cx)));
    }
    out
}

fn class_line(c: &Common, index: &str) -> String {
    match c.table {
        Some(_) => format!("const int cls_ = tbl_[{index}];"),
        None => "const int cls_ = 1;".to_string(),
    }
}

fn wrap(b: &Builder, c: &Common, name: &str, launch_bound: u32, what: &str, body: &[String]) -> String {
    let node = b.g.node(c.v);
    let mask = c.spec.mask.as_ref().map_or(String::new(), |m| format!(", mask {}", crate::ir::ShowExpr { expr: m, rank: c.spec.rank }));
    format!(
        "// {} = flash ({what}) : {}; weights {}, score {}{mask}\nATTNC_KERNEL void __launch_bounds__({launch_bound}) {name}(ATTNC_ARGS) {{\n{}\n}}\n",
        b.label(c.v),
        node.ty,
        c.spec.weights.name(),
        crate::ir::ShowExpr { expr: &c.spec.score, rank: c.spec.rank },
        body.iter().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n")
    )
}

/// The SIMT kernel (f32 compute, any storage types).
fn emit_simt(b: &mut Builder, c: &Common, tile_rows: TileSize) {
    let name = b.kernel_name(c.v, "flash_simt");
    let softmax = c.spec.weights == Weights::Softmax;
    let mut body = vec![
        "ATTNC_DYN_SMEM;".to_string(),
        "ATTNC_SHARED float Ps_[4][32];  // one row of weights per warp, read back as broadcasts".into(),
        format!("constexpr int HD_ = ATTNC_HD_{};", c.hd),
        "constexpr int HDP_ = HD_ + 1;".into(),
        "constexpr int T_ = HD_ / 32;".into(),
        "float* Qs_ = (float*)attnc_smem;  // [16][HD_]".into(),
        "float* Ks_ = Qs_ + 16 * HD_;      // [32][HD_ + 1]".into(),
        "float* Vs_ = Ks_ + 32 * HDP_;     // [32][HD_]".into(),
        "const int tid_ = threadIdx.x, lane_ = tid_ & 31, warp_ = tid_ >> 5;".into(),
    ];
    let p = head(c, &mut body);
    body.push("  const i64 ntn_ = (N_ + 31) / 32;".into());
    body.push("  const i64 q0_ = (i64)blockIdx.x * 16;".into());
    body.push("  attnc_sync();".into());
    body.push("  for (int e_ = tid_; e_ < 16 * HD_; e_ += 128) {".into());
    body.push("    const i64 qi_ = q0_ + e_ / HD_, qc_ = e_ % HD_;".into());
    body.extend(q_load(b, c, &p, "qi_", "qc_", "    "));
    body.push("    Qs_[e_] = x_;".into());
    body.push("  }".into());
    body.push("  float o_[4][T_], m_[4], l_[4];".into());
    body.push("  #pragma unroll".into());
    body.push("  for (int rr_ = 0; rr_ < 4; ++rr_) {".into());
    body.push("    m_[rr_] = -ATTNC_INF; l_[rr_] = 0.0f;".into());
    body.push("    #pragma unroll".into());
    body.push("    for (int t_ = 0; t_ < T_; ++t_) o_[rr_][t_] = 0.0f;".into());
    body.push("  }".into());
    body.push("  for (i64 kt_ = 0; kt_ < ntn_; ++kt_) {".into());
    body.push(format!("    {}", class_line(c, "(i64)blockIdx.x * ntn_ + kt_")));
    body.push("    if (cls_ == 0) continue;  // fully masked tile (the same for the whole block)".into());
    body.push("    const i64 k0_ = kt_ * 32;".into());
    body.push("    attnc_sync();".into());
    body.push("    for (int e_ = tid_; e_ < 32 * HD_; e_ += 128) {".into());
    body.push("      const int r_ = e_ / HD_, cc_ = e_ % HD_;".into());
    body.push("      const i64 jr_ = k0_ + r_, c64_ = cc_;".into());
    body.push("      const bool in_ = jr_ < N_;".into());
    body.push(format!("      Ks_[r_ * HDP_ + cc_] = (in_ && c64_ < D_) ? {} : 0.0f;", kv_load(c, 'k', "jr_", "c64_")));
    body.push(format!("      Vs_[r_ * HD_ + cc_] = (in_ && c64_ < DV_) ? {} : 0.0f;", kv_load(c, 'v', "jr_", "c64_")));
    body.push("    }".into());
    body.push("    attnc_sync();".into());
    body.push("    const i64 j_ = k0_ + lane_;".into());
    body.push("    #pragma unroll".into());
    body.push("    for (int rr_ = 0; rr_ < 4; ++rr_) {".into());
    body.push("      const int r_ = warp_ * 4 + rr_;".into());
    body.push("      const i64 i_ = q0_ + r_;".into());
    body.push("      float s_ = 0.0f;".into());
    body.push("      #pragma unroll 8".into());
    body.push("      for (int cc_ = 0; cc_ < HD_; ++cc_) s_ += Qs_[r_ * HD_ + cc_] * Ks_[lane_ * HDP_ + cc_];".into());
    body.push("      bool keep_ = j_ < N_;".into());
    body.extend(score_lines(c, &p, "i_", "j_", "s_", "      "));
    if softmax {
        body.push("      const float x_ = keep_ ? sc_ : -ATTNC_INF;".into());
        body.push("      const float mn_ = fmaxf(m_[rr_], attnc_warp_max(x_));".into());
        body.push("      const float scale_ = mn_ == -ATTNC_INF ? 1.0f : expf(m_[rr_] - mn_);".into());
        body.push("      const float p_ = (keep_ && mn_ != -ATTNC_INF) ? expf(x_ - mn_) : 0.0f;".into());
        body.push("      l_[rr_] = l_[rr_] * scale_ + p_;".into());
        body.push("      m_[rr_] = mn_;".into());
        body.push("      #pragma unroll".into());
        body.push("      for (int t_ = 0; t_ < T_; ++t_) o_[rr_][t_] *= scale_;".into());
    } else {
        body.push("      const float p_ = keep_ ? attnc_sigmoid(sc_) : 0.0f;".into());
    }
    body.push("      Ps_[warp_][lane_] = p_;".into());
    body.push("      attnc_syncwarp();".into());
    body.push("      for (int jj_ = 0; jj_ < 32; ++jj_) {".into());
    body.push("        const float pj_ = Ps_[warp_][jj_];".into());
    body.push("        if (pj_ == 0.0f) continue;  // masked keys contribute nothing, even against inf/NaN values".into());
    body.push("        #pragma unroll".into());
    body.push("        for (int t_ = 0; t_ < T_; ++t_) o_[rr_][t_] += pj_ * Vs_[jj_ * HD_ + lane_ + 32 * t_];".into());
    body.push("      }".into());
    body.push("      attnc_syncwarp();  // before the next row overwrites Ps_".into());
    body.push("    }".into());
    body.push("  }".into());
    body.push("  #pragma unroll".into());
    body.push("  for (int rr_ = 0; rr_ < 4; ++rr_) {".into());
    body.push("    const i64 i_ = q0_ + warp_ * 4 + rr_;".into());
    if softmax {
        body.push("    const float lt_ = attnc_warp_sum(l_[rr_]);".into());
        body.push("    const float inv_ = lt_ == 0.0f ? 0.0f : 1.0f / lt_;".into());
    } else {
        body.push("    const float inv_ = 1.0f;".into());
    }
    body.push("    #pragma unroll".into());
    body.push("    for (int t_ = 0; t_ < T_; ++t_) {".into());
    body.push("      const i64 col_ = lane_ + 32 * t_;".into());
    let st = store(c.out_buf, c.out_dt, "(bz_ * M_ + i_) * DV_ + col_", &super::cexpr::round_to(c.out_dt, "(o_[rr_][t_] * inv_)"));
    body.push(format!("      if (i_ < M_ && col_ < DV_) {st}"));
    body.push("    }".into());
    body.push("  }".into());
    body.push("}".into());
    let text = wrap(b, c, &name, 128, "SIMT f32", &body);
    b.kernels.push(text);
    b.launches.push(Launch {
        kernel: name,
        grid: Grid::Flash { batch: Dim::product(&c.batch), m: c.m.clone(), tile_rows },
        block: 128,
        smem: Smem::FlashSimt(c.hd),
    });
}

/// The tensor-core kernel (q, k, v all f16 or all bf16).
fn emit_mma(b: &mut Builder, c: &Common, tile_rows: TileSize) {
    let name = b.kernel_name(c.v, "flash_mma");
    let softmax = c.spec.weights == Weights::Softmax;
    let (mma, conv, pack) =
        if c.kdt == DType::BF16 { ("attnc_mma_b", "attnc_f2b", "attnc_pack_b") } else { ("attnc_mma_h", "attnc_f2h", "attnc_pack_h") };
    let mut body = vec![
        "ATTNC_DYN_SMEM;".to_string(),
        format!("constexpr int HD_ = ATTNC_HD_{};", c.hd),
        "constexpr int BN_ = HD_ <= 128 ? 64 : 32;  // keys per tile".into(),
        "constexpr int LD_ = HD_ + 8;               // shared row stride (halves), skews banks".into(),
        "constexpr int NT_ = BN_ / 8, DT_ = HD_ / 8;".into(),
        "u16* Qs_ = (u16*)attnc_smem;  // [64][LD_]".into(),
        "u16* Ks_ = Qs_ + 64 * LD_;    // [BN_][LD_]".into(),
        "u16* Vs_ = Ks_ + BN_ * LD_;   // [BN_][LD_]".into(),
        "const int tid_ = threadIdx.x, lane_ = tid_ & 31, warp_ = tid_ >> 5, g_ = lane_ >> 2, tg_ = lane_ & 3;".into(),
    ];
    let p = head(c, &mut body);
    body.push("  const i64 ntn_ = (N_ + BN_ - 1) / BN_;".into());
    body.push("  const i64 q0_ = (i64)blockIdx.x * 64;".into());
    {
        let (kr, vr) = (c.kview.strides.len() - 2, c.vview.strides.len() - 2);
        let aligned = |s: &Dim| format!("{} % 8 == 0", cdim(s));
        body.push(format!(
            "  const bool vec_ = D_ % 8 == 0 && DV_ % 8 == 0 && koff_ % 8 == 0 && voff_ % 8 == 0 && {} && {};",
            aligned(&c.kview.strides[kr]),
            aligned(&c.vview.strides[vr])
        ));
        body.push("  (void)vec_;".into());
    }
    body.push("  const i64 ri0_ = q0_ + warp_ * 16 + g_, ri1_ = ri0_ + 8;  // this lane's two rows".into());
    body.push("  attnc_sync();".into());
    body.push("  for (int e_ = tid_; e_ < 64 * HD_; e_ += 128) {".into());
    body.push("    const i64 qi_ = q0_ + e_ / HD_, qc_ = e_ % HD_;".into());
    body.extend(q_load(b, c, &p, "qi_", "qc_", "    "));
    body.push(format!("    Qs_[(e_ / HD_) * LD_ + e_ % HD_] = {conv}(x_);"));
    body.push("  }".into());
    body.push("  float o_[DT_][4];".into());
    body.push("  #pragma unroll".into());
    body.push("  for (int t_ = 0; t_ < DT_; ++t_) { o_[t_][0] = 0.0f; o_[t_][1] = 0.0f; o_[t_][2] = 0.0f; o_[t_][3] = 0.0f; }".into());
    body.push("  float m0_ = -ATTNC_INF, m1_ = -ATTNC_INF, l0_ = 0.0f, l1_ = 0.0f;".into());
    body.push("  for (i64 kt_ = 0; kt_ < ntn_; ++kt_) {".into());
    body.push(format!("    {}", class_line(c, "(i64)blockIdx.x * ntn_ + kt_")));
    body.push("    if (cls_ == 0) continue;  // fully masked tile (the same for the whole block)".into());
    body.push("    const i64 k0_ = kt_ * BN_;".into());
    body.push("    attnc_sync();".into());
    let (kr, vr) = (c.kview.strides.len() - 2, c.vview.strides.len() - 2);
    let contiguous = c.kview.strides[kr + 1].as_const() == Some(1) && c.vview.strides[vr + 1].as_const() == Some(1);
    if contiguous {
        // Rows contiguous in memory: 16-byte loads when every row start is 16-byte aligned.
        body.push("    if (vec_) {".into());
        body.push("      for (int e_ = tid_; e_ < BN_ * (HD_ / 8); e_ += 128) {".into());
        body.push("        const int r_ = e_ / (HD_ / 8), cc_ = (e_ % (HD_ / 8)) * 8;".into());
        body.push("        const i64 jr_ = k0_ + r_, c64_ = cc_;".into());
        body.push("        attnc_u4 kz_ = {0u, 0u, 0u, 0u}, vz_ = {0u, 0u, 0u, 0u};".into());
        body.push(format!("        if (jr_ < N_ && c64_ < D_) kz_ = *(const attnc_u4*)&{};", kv_raw(c, 'k', "jr_", "c64_")));
        body.push(format!("        if (jr_ < N_ && c64_ < DV_) vz_ = *(const attnc_u4*)&{};", kv_raw(c, 'v', "jr_", "c64_")));
        body.push("        *(attnc_u4*)(Ks_ + r_ * LD_ + cc_) = kz_;".into());
        body.push("        *(attnc_u4*)(Vs_ + r_ * LD_ + cc_) = vz_;".into());
        body.push("      }".into());
        body.push("    } else {".into());
    }
    body.push("    for (int e_ = tid_; e_ < BN_ * HD_; e_ += 128) {".into());
    body.push("      const int r_ = e_ / HD_, cc_ = e_ % HD_;".into());
    body.push("      const i64 jr_ = k0_ + r_, c64_ = cc_;".into());
    body.push("      const bool in_ = jr_ < N_;".into());
    body.push(format!("      Ks_[r_ * LD_ + cc_] = (in_ && c64_ < D_) ? {} : (u16)0;", kv_raw(c, 'k', "jr_", "c64_")));
    body.push(format!("      Vs_[r_ * LD_ + cc_] = (in_ && c64_ < DV_) ? {} : (u16)0;", kv_raw(c, 'v', "jr_", "c64_")));
    body.push("    }".into());
    if contiguous {
        body.push("    }".into());
    }
    body.push("    attnc_sync();".into());
    body.push("    float s_[NT_][4];".into());
    body.push("    #pragma unroll".into());
    body.push(
        "    for (int nt_ = 0; nt_ < NT_; ++nt_) { s_[nt_][0] = 0.0f; s_[nt_][1] = 0.0f; s_[nt_][2] = 0.0f; s_[nt_][3] = 0.0f; }".into(),
    );
    body.push("    #pragma unroll".into());
    body.push("    for (int ks_ = 0; ks_ < HD_ / 16; ++ks_) {".into());
    body.push("      const u16* qa_ = Qs_ + (warp_ * 16 + g_) * LD_ + ks_ * 16 + tg_ * 2;".into());
    body.push("      const unsigned a_[4] = {attnc_ld_u32(qa_), attnc_ld_u32(qa_ + 8 * LD_), attnc_ld_u32(qa_ + 8), attnc_ld_u32(qa_ + 8 * LD_ + 8)};".into());
    body.push("      #pragma unroll".into());
    body.push("      for (int nt_ = 0; nt_ < NT_; ++nt_) {".into());
    body.push("        const u16* kb_ = Ks_ + (nt_ * 8 + g_) * LD_ + ks_ * 16 + tg_ * 2;".into());
    body.push("        const unsigned bb_[2] = {attnc_ld_u32(kb_), attnc_ld_u32(kb_ + 8)};".into());
    body.push(format!("        {mma}(s_[nt_], a_, bb_);"));
    body.push("      }".into());
    body.push("    }".into());
    body.push("    // Accumulator element e of n-tile nt: row e < 2 ? ri0_ : ri1_, key k0_ + 8 nt + 2 tg_ + (e & 1).".into());
    body.push("    float mx0_ = -ATTNC_INF, mx1_ = -ATTNC_INF;".into());
    body.push("    #pragma unroll".into());
    body.push("    for (int nt_ = 0; nt_ < NT_; ++nt_) {".into());
    body.push("      #pragma unroll".into());
    body.push("      for (int e_ = 0; e_ < 4; ++e_) {".into());
    body.push("        const i64 i_ = e_ < 2 ? ri0_ : ri1_;".into());
    body.push("        const i64 j_ = k0_ + nt_ * 8 + tg_ * 2 + (e_ & 1);".into());
    body.push("        const float s_e_ = s_[nt_][e_];".into());
    body.push("        bool keep_ = j_ < N_;".into());
    body.extend(score_lines(c, &p, "i_", "j_", "s_e_", "        "));
    if softmax {
        body.push("        const float x_ = keep_ ? sc_ : -ATTNC_INF;".into());
        body.push("        s_[nt_][e_] = x_;".into());
        body.push("        if (e_ < 2) mx0_ = fmaxf(mx0_, x_); else mx1_ = fmaxf(mx1_, x_);".into());
    } else {
        body.push("        s_[nt_][e_] = keep_ ? attnc_sigmoid(sc_) : 0.0f;".into());
    }
    body.push("      }".into());
    body.push("    }".into());
    if softmax {
        body.push("    // Row maxima over the 4 lanes sharing a row (lanes differ in tg_, the low two bits).".into());
        body.push("    mx0_ = fmaxf(mx0_, attnc_shfl_xor(mx0_, 1)); mx0_ = fmaxf(mx0_, attnc_shfl_xor(mx0_, 2));".into());
        body.push("    mx1_ = fmaxf(mx1_, attnc_shfl_xor(mx1_, 1)); mx1_ = fmaxf(mx1_, attnc_shfl_xor(mx1_, 2));".into());
        body.push("    const float mn0_ = fmaxf(m0_, mx0_), mn1_ = fmaxf(m1_, mx1_);".into());
        body.push("    const float sc0_ = mn0_ == -ATTNC_INF ? 1.0f : expf(m0_ - mn0_);".into());
        body.push("    const float sc1_ = mn1_ == -ATTNC_INF ? 1.0f : expf(m1_ - mn1_);".into());
        body.push("    m0_ = mn0_; m1_ = mn1_; l0_ *= sc0_; l1_ *= sc1_;".into());
        body.push("    #pragma unroll".into());
        body.push("    for (int nt_ = 0; nt_ < NT_; ++nt_) {".into());
        body.push("      #pragma unroll".into());
        body.push("      for (int e_ = 0; e_ < 4; ++e_) {".into());
        body.push("        const float mn_ = e_ < 2 ? mn0_ : mn1_;".into());
        body.push("        const float x_ = s_[nt_][e_];".into());
        body.push("        const float p_ = (x_ == -ATTNC_INF || mn_ == -ATTNC_INF) ? 0.0f : expf(x_ - mn_);".into());
        body.push("        s_[nt_][e_] = p_;".into());
        body.push("        if (e_ < 2) l0_ += p_; else l1_ += p_;".into());
        body.push("      }".into());
        body.push("    }".into());
        body.push("    #pragma unroll".into());
        body.push(
            "    for (int t_ = 0; t_ < DT_; ++t_) { o_[t_][0] *= sc0_; o_[t_][1] *= sc0_; o_[t_][2] *= sc1_; o_[t_][3] *= sc1_; }".into(),
        );
    }
    body.push("    // O += P V: P's accumulator layout is the A-fragment layout of two adjacent n-tiles.".into());
    body.push("    #pragma unroll".into());
    body.push("    for (int kk_ = 0; kk_ < BN_ / 16; ++kk_) {".into());
    body.push(format!("      const unsigned pa_[4] = {{{pack}(s_[2 * kk_][0], s_[2 * kk_][1]), {pack}(s_[2 * kk_][2], s_[2 * kk_][3]),"));
    body.push(format!(
        "                               {pack}(s_[2 * kk_ + 1][0], s_[2 * kk_ + 1][1]), {pack}(s_[2 * kk_ + 1][2], s_[2 * kk_ + 1][3])}};"
    ));
    body.push("      #pragma unroll".into());
    body.push("      for (int t_ = 0; t_ < DT_; ++t_) {".into());
    body.push("        const u16* vb_ = Vs_ + (kk_ * 16 + tg_ * 2) * LD_ + t_ * 8 + g_;".into());
    body.push("        const unsigned bb_[2] = {attnc_pack_u16(vb_[0], vb_[LD_]), attnc_pack_u16(vb_[8 * LD_], vb_[9 * LD_])};".into());
    body.push(format!("        {mma}(o_[t_], pa_, bb_);"));
    body.push("      }".into());
    body.push("    }".into());
    body.push("  }".into());
    if softmax {
        body.push("  l0_ += attnc_shfl_xor(l0_, 1); l0_ += attnc_shfl_xor(l0_, 2);".into());
        body.push("  l1_ += attnc_shfl_xor(l1_, 1); l1_ += attnc_shfl_xor(l1_, 2);".into());
        body.push("  const float inv0_ = l0_ == 0.0f ? 0.0f : 1.0f / l0_, inv1_ = l1_ == 0.0f ? 0.0f : 1.0f / l1_;".into());
    } else {
        body.push("  const float inv0_ = 1.0f, inv1_ = 1.0f;".into());
    }
    body.push("  #pragma unroll".into());
    body.push("  for (int t_ = 0; t_ < DT_; ++t_) {".into());
    body.push("    #pragma unroll".into());
    body.push("    for (int e_ = 0; e_ < 4; ++e_) {".into());
    body.push("      const i64 i_ = e_ < 2 ? ri0_ : ri1_;".into());
    body.push("      const i64 col_ = t_ * 8 + tg_ * 2 + (e_ & 1);".into());
    let st = store(
        c.out_buf,
        c.out_dt,
        "(bz_ * M_ + i_) * DV_ + col_",
        &super::cexpr::round_to(c.out_dt, "(o_[t_][e_] * (e_ < 2 ? inv0_ : inv1_))"),
    );
    body.push(format!("      if (i_ < M_ && col_ < DV_) {st}"));
    body.push("    }".into());
    body.push("  }".into());
    body.push("}".into());
    let what = if c.kdt == DType::BF16 { "tensor cores, bf16" } else { "tensor cores, f16" };
    let text = wrap(b, c, &name, 128, what, &body);
    b.kernels.push(text);
    b.launches.push(Launch {
        kernel: name,
        grid: Grid::Flash { batch: Dim::product(&c.batch), m: c.m.clone(), tile_rows },
        block: 128,
        smem: Smem::FlashMma(c.hd),
    });
}

/// Split-KV decode kernel plus the merge kernel.
fn emit_decode(b: &mut Builder, c: &Common) {
    let rows = c.m.as_const().unwrap_or(1);
    let softmax = c.spec.weights == Weights::Softmax;
    let split = b.splits.len();
    b.splits.push(SplitKv { batch: Dim::product(&c.batch), rows: c.m.clone(), keys: c.n.clone(), width: c.dv.clone() });
    let part = b.add_buffer(DType::F32, BufferSize::Partials(split), format!("{} split-KV partials", b.label(c.v)));
    let name = b.kernel_name(c.v, "flash_decode");
    let mut body = vec![
        format!("constexpr int HD_ = ATTNC_HD_{}, T_ = HD_ / 32, MR_ = {rows};", c.hd),
        "const int lane_ = threadIdx.x & 31, warp_ = threadIdx.x >> 5;".into(),
        format!("const i64 ns_ = s{split};  // warps splitting the keys"),
        "const i64 split_ = (i64)blockIdx.x * 4 + warp_;".into(),
        "if (split_ >= ns_) return;  // the whole warp; this kernel has no block barrier".into(),
        format!("float* __restrict__ part_ = {};", ptr(part, DType::F32, true)),
    ];
    let p = head(c, &mut body);
    body.push("  const i64 nch_ = (N_ + 31) / 32, per_ = (nch_ + ns_ - 1) / ns_;".into());
    body.push("  const i64 ch0_ = split_ * per_, ch1_ = ch0_ + per_ < nch_ ? ch0_ + per_ : nch_;".into());
    body.push("  float q_[MR_][T_], o_[MR_][T_], m_[MR_], l_[MR_];".into());
    body.push("  for (int r_ = 0; r_ < MR_; ++r_) {".into());
    body.push("    m_[r_] = -ATTNC_INF; l_[r_] = 0.0f;".into());
    body.push("    for (int t_ = 0; t_ < T_; ++t_) {".into());
    body.push("      const i64 qi_ = r_, qc_ = lane_ + 32 * t_;".into());
    body.extend(q_load(b, c, &p, "qi_", "qc_", "      "));
    body.push("      q_[r_][t_] = x_; o_[r_][t_] = 0.0f;".into());
    body.push("    }".into());
    body.push("  }".into());
    body.push("  for (i64 ch_ = ch0_; ch_ < ch1_; ++ch_) {".into());
    body.push(format!("    {}", class_line(c, "ch_")));
    body.push("    if (cls_ == 0) continue;".into());
    body.push("    for (int jj_ = 0; jj_ < 32; ++jj_) {".into());
    body.push("      const i64 j_ = ch_ * 32 + jj_;".into());
    body.push("      if (j_ >= N_) break;".into());
    body.push("      float k_[T_], v_[T_];".into());
    body.push("      #pragma unroll".into());
    body.push("      for (int t_ = 0; t_ < T_; ++t_) {".into());
    body.push("        const i64 c64_ = lane_ + 32 * t_;".into());
    body.push(format!("        k_[t_] = c64_ < D_ ? {} : 0.0f;", kv_load(c, 'k', "j_", "c64_")));
    body.push(format!("        v_[t_] = c64_ < DV_ ? {} : 0.0f;", kv_load(c, 'v', "j_", "c64_")));
    body.push("      }".into());
    body.push("      #pragma unroll".into());
    body.push("      for (int r_ = 0; r_ < MR_; ++r_) {".into());
    body.push("        float s_ = 0.0f;".into());
    body.push("        #pragma unroll".into());
    body.push("        for (int t_ = 0; t_ < T_; ++t_) s_ += q_[r_][t_] * k_[t_];".into());
    body.push("        s_ = attnc_warp_sum(s_);".into());
    body.push("        const i64 i_ = r_;".into());
    body.push("        bool keep_ = true;".into());
    body.extend(score_lines(c, &p, "i_", "j_", "s_", "        "));
    body.push("        if (!keep_) continue;".into());
    if softmax {
        body.push("        const float mn_ = fmaxf(m_[r_], sc_);".into());
        body.push("        if (mn_ == -ATTNC_INF) continue;".into());
        body.push("        const float scale_ = expf(m_[r_] - mn_), p_ = expf(sc_ - mn_);".into());
        body.push("        l_[r_] = l_[r_] * scale_ + p_;".into());
        body.push("        m_[r_] = mn_;".into());
        body.push("        #pragma unroll".into());
        body.push("        for (int t_ = 0; t_ < T_; ++t_) o_[r_][t_] = o_[r_][t_] * scale_ + p_ * v_[t_];".into());
    } else {
        body.push("        const float w_ = attnc_sigmoid(sc_);".into());
        body.push("        #pragma unroll".into());
        body.push("        for (int t_ = 0; t_ < T_; ++t_) o_[r_][t_] += w_ * v_[t_];".into());
    }
    body.push("      }".into());
    body.push("    }".into());
    body.push("  }".into());
    body.push("  // Partials: [batch, MR_, ns_, DV_ + 2] = (unnormalised O, running max, running sum).".into());
    body.push("  for (int r_ = 0; r_ < MR_; ++r_) {".into());
    body.push("    const i64 base_ = ((bz_ * MR_ + r_) * ns_ + split_) * (DV_ + 2);".into());
    body.push("    for (int t_ = 0; t_ < T_; ++t_) {".into());
    body.push("      const i64 col_ = lane_ + 32 * t_;".into());
    body.push("      if (col_ < DV_) part_[base_ + col_] = o_[r_][t_];".into());
    body.push("    }".into());
    body.push("    if (lane_ == 0) { part_[base_ + DV_] = m_[r_]; part_[base_ + DV_ + 1] = l_[r_]; }".into());
    body.push("  }".into());
    body.push("}".into());
    let text = wrap(b, c, &name, 128, "split-KV decode", &body);
    b.kernels.push(text);
    b.launches.push(Launch { kernel: name, grid: Grid::Decode { batch: Dim::product(&c.batch), split }, block: 128, smem: Smem::None });

    // Merge: one warp per (batch, row).
    let name = b.kernel_name(c.v, "flash_merge");
    let total_rows = Dim::product(&c.batch).mul(&c.m);
    let mut body = vec![
        "const int lane_ = threadIdx.x & 31;".to_string(),
        format!("const i64 DV_ = {}, ns_ = s{split}, rows_ = {};", cdim(&c.dv), cdim(&total_rows)),
        format!("const float* __restrict__ part_ = {};", ptr(part, DType::F32, false)),
        "for (i64 row_ = (i64)blockIdx.x * 8 + (threadIdx.x >> 5); row_ < rows_; row_ += (i64)gridDim.x * 8) {".into(),
        "  const float* pr_ = part_ + row_ * ns_ * (DV_ + 2);".into(),
    ];
    if softmax {
        body.push("  float mx_ = -ATTNC_INF;".into());
        body.push("  for (i64 s_ = lane_; s_ < ns_; s_ += 32) mx_ = fmaxf(mx_, pr_[s_ * (DV_ + 2) + DV_]);".into());
        body.push("  mx_ = attnc_warp_max(mx_);".into());
        body.push("  float L_ = 0.0f;".into());
        body.push("  if (mx_ != -ATTNC_INF) {".into());
        body.push("    for (i64 s_ = lane_; s_ < ns_; s_ += 32) {".into());
        body.push("      const float ms_ = pr_[s_ * (DV_ + 2) + DV_];".into());
        body.push("      if (ms_ != -ATTNC_INF) L_ += expf(ms_ - mx_) * pr_[s_ * (DV_ + 2) + DV_ + 1];".into());
        body.push("    }".into());
        body.push("  }".into());
        body.push("  L_ = attnc_warp_sum(L_);".into());
        body.push("  for (i64 col_ = lane_; col_ < DV_; col_ += 32) {".into());
        body.push("    float acc_ = 0.0f;".into());
        body.push("    if (mx_ != -ATTNC_INF) {".into());
        body.push("      for (i64 s_ = 0; s_ < ns_; ++s_) {".into());
        body.push("        const float ms_ = pr_[s_ * (DV_ + 2) + DV_];".into());
        body.push("        if (ms_ != -ATTNC_INF) acc_ += expf(ms_ - mx_) * pr_[s_ * (DV_ + 2) + col_];".into());
        body.push("      }".into());
        body.push("    }".into());
        let y = super::cexpr::round_to(c.out_dt, "(L_ == 0.0f ? 0.0f : acc_ / L_)");
        body.push(format!("    {}", store(c.out_buf, c.out_dt, "row_ * DV_ + col_", &y)));
        body.push("  }".into());
    } else {
        body.push("  for (i64 col_ = lane_; col_ < DV_; col_ += 32) {".into());
        body.push("    float acc_ = 0.0f;".into());
        body.push("    for (i64 s_ = 0; s_ < ns_; ++s_) acc_ += pr_[s_ * (DV_ + 2) + col_];".into());
        body.push(format!("    {}", store(c.out_buf, c.out_dt, "row_ * DV_ + col_", &super::cexpr::round_to(c.out_dt, "acc_"))));
        body.push("  }".into());
    }
    body.push("}".into());
    let text = format!(
        "// {} = flash: merge of the split-KV partials\nATTNC_KERNEL void __launch_bounds__(256) {name}(ATTNC_ARGS) {{\n{}\n}}\n",
        b.label(c.v),
        body.iter().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n")
    );
    b.kernels.push(text);
    b.launches.push(Launch { kernel: name, grid: Grid::Rows(total_rows), block: 256, smem: Smem::None });
}
