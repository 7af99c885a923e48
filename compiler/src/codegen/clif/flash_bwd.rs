//! The flash backward kernel, generated per differentiated flash op, and the sum of its extra
//! operands' gradients.
//!
//! It renders the schedule's [`FlashBwdKernel`] (FlashAttention-2's backward, key blocks outer):
//! work item = one batch index, which owns its `dQ` rows, so no two threads add into one value
//! and the result does not depend on the thread count. For each key block of `BlockN` keys, and
//! each query block of `BlockM` rows whose tile the tile table does not skip:
//!
//! 1. `Sᵀ = K_blk · Q_blkᵀ` and `dPᵀ = V_blk · dO_blkᵀ` by the SGEMM microkernel, into scratch
//!    (keys along rows, queries along columns);
//! 2. per key row, four queries at a time: the score modification and (partial tiles) the mask,
//!    the weight `P = exp(F - lse)` (or `sigmoid(F)`), the score's adjoint
//!    `dF = P (dP - delta)` (or `dP · P (1 - P)`), `dS = dF · ∂F/∂s`, and each extra operand's
//!    gradient `dF · ∂F/∂x` added at the index it loads; `Pᵀ` and `dSᵀ` overwrite the tiles;
//! 3. `dV_blk += Pᵀ · dO_blk`, `dK_blk += dSᵀ · Q_blk`, `dQᵀ += Kᵀ_blk · dSᵀ` by the microkernel
//!    (`Kᵀ_blk` transposed once per key block).
//!
//! Then the key block's `dK` and `dV` rows are written, and after the last key block `dQ`
//! (transposed back). Nothing of the size of the scores exists: scratch holds two tiles, `dQᵀ`
//! of one batch index and one key block's `dK`, `dV`, `Kᵀ`.

use super::abi;
use super::builder::Fx;
use super::matmul::batch_strides;
use super::ops::{Kind, Tv};
use super::score::{self, Env, Extra, Hoisted};
use crate::ir::{DType, Dim, ScoreExpr, Weights};
use crate::schedule::{FlashBwdKernel, Level, Tuning, View};
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{InstBuilder, MemFlagsData, Value, types};
use cranelift_frontend::Variable;
use std::collections::HashMap;

/// Rows of `Kᵀ` per `dQᵀ` product: the microkernel reads its `B` (`dSᵀ`) in place for products
/// of at most 64 rows.
const DQ_SLICE: i64 = 64;

/// A `[..b', rows, width]` operand: its base, the strides of the score's batch axes, its row
/// stride (the microkernels' leading dimension).
struct Operand {
    base: Value,
    batch: Vec<Value>,
    row: Value,
}

fn operand(fx: &mut Fx, view: &View, batch: &[Dim], width: Value) -> Operand {
    let r = view.shape.len();
    let (base, strides) = fx.view_base(view);
    let bs = batch_strides(fx, view, &strides, batch);
    let row = fx.max(strides[r - 2], width);
    Operand { base, batch: bs, row }
}

/// A `[..b, M]` row statistic (lse, delta): base, batch strides, element stride.
struct RowStat {
    base: Value,
    batch: Vec<Value>,
    step: Value,
}

fn row_stat(fx: &mut Fx, view: &View, batch: &[Dim]) -> RowStat {
    let (base, strides) = fx.view_base(view);
    let lead = batch.len().saturating_sub(view.shape.len().saturating_sub(1));
    let bs = (0..batch.len())
        .map(|t| match t.checked_sub(lead) {
            Some(a) if view.shape[a].as_const() != Some(1) => strides[a],
            _ => fx.i64(0),
        })
        .collect();
    let step = strides.last().copied().unwrap_or_else(|| fx.i64(1));
    RowStat { base, batch: bs, step }
}

/// An extra operand's gradient: where its per-item partial sums start within an item's block,
/// and its sizes (the result's shape, row-major).
struct Target {
    input: usize,
    offset: Value,
    sizes: Vec<Value>,
}

/// Everything the loops read, loaded in the prologue.
struct Prologue<'f> {
    f: &'f FlashBwdKernel,
    bdims: Vec<Value>,
    m: Value,
    n: Value,
    d: Value,
    dv: Value,
    bm: Value,
    bn: Value,
    nqb: Value,
    nkb: Value,
    entry_bytes: Value,
    tiles: Value,
    q: Operand,
    k: Operand,
    v: Operand,
    d_out: Operand,
    stats: Option<(RowStat, RowStat)>,
    extras: Vec<Extra>,
    targets: Vec<Target>,
    /// Floats of partial sums per work item.
    per_item: Value,
    partials: Value,
    dims: HashMap<Dim, Value>,
    /// Scratch: the `Sᵀ`/`Pᵀ` tile, the `dPᵀ`/`dSᵀ` tile, `dQᵀ`, `dK`, `dV`, `Kᵀ`.
    p_tile: Value,
    ds_tile: Value,
    dq_acc: Value,
    dk_acc: Value,
    dv_acc: Value,
    kt: Value,
    /// A key row's `dF` and the block's separable row terms (`BlockM` f32 each).
    df_row: Value,
    rb_row: Value,
    /// `Qᵀ` and `dOᵀ` of the item, one `width × BlockM` panel per query block.
    q_t: Value,
    do_t: Value,
    /// The scale of `s` in unmasked tiles of a linear score (1 otherwise).
    alpha: Value,
    lane_iota: Value,
}

fn prologue<'f>(fx: &mut Fx, f: &'f FlashBwdKernel) -> Prologue<'f> {
    let batch = f.batch().to_vec();
    let r = f.q.shape.len();
    let bdims = fx.dims(&batch);
    let (m, n, d, dv) = f.sizes();
    let (m, n, d, dv) = (fx.dim(&m), fx.dim(&n), fx.dim(&d), fx.dim(&dv));
    let step = f.step;
    let [bm, bn, nqb, nkb, entry_bytes] =
        [Tuning::BlockM, Tuning::BlockN, Tuning::QueryBlocks, Tuning::KeyBlocks, Tuning::TileEntryBytes].map(|t| fx.tuning(step, t));
    let tiles = fx.buf(f.tiles);
    let q = operand(fx, &f.q, &batch, d);
    let k = operand(fx, &f.k, &batch, d);
    let v = operand(fx, &f.v, &batch, dv);
    let d_out = operand(fx, &f.d_out, &batch, dv);
    let stats = f.lse.as_ref().map(|(l, dl)| (row_stat(fx, l, &batch), row_stat(fx, dl, &batch)));
    let extras: Vec<Extra> = f
        .extras
        .iter()
        .map(|x| {
            let (base, strides) = fx.view_base(x);
            let sizes = fx.dims(&x.shape);
            Extra { dtype: x.dtype, base, strides, sizes }
        })
        .collect();
    let mut per_item = fx.i64(0);
    let mut targets = Vec::new();
    for (input, view) in &f.dx {
        let sizes = fx.dims(&view.shape);
        targets.push(Target { input: *input, offset: per_item, sizes });
        let elems = fx.dim(&Dim::product(&view.shape));
        per_item = fx.add(per_item, elems);
    }
    let partials = fx.buf(f.partials);
    let mut dims = HashMap::new();
    for dd in crate::schedule::bwd_dims(f) {
        let x = fx.dim(&dd);
        let x = fx.b.ins().ireduce(types::I32, x);
        dims.insert(dd, x);
    }
    let base = fx.scratch();
    let [ds_tile, dq_acc, dk_acc, dv_acc, kt, df_row, q_t, do_t] = [
        Tuning::ScratchGradS,
        Tuning::ScratchGradQ,
        Tuning::ScratchGradK,
        Tuning::ScratchGradV,
        Tuning::ScratchKeysT,
        Tuning::ScratchGradRow,
        Tuning::ScratchQueriesT,
        Tuning::ScratchGradOutT,
    ]
    .map(|t| {
        let off = fx.tuning(step, t);
        fx.add(base, off)
    });
    let rb_row = fx.elem_addr(df_row, bm);
    let alpha = match f.linear.as_ref().and_then(|l| l.alpha.as_ref()) {
        Some(a) => {
            let none = Hoisted::new();
            let env = Env { s: None, pos: &[], dims: &dims, extras: &extras, hoisted: &none };
            let t = score::eval(fx, a, &env);
            fx.cvt_f(t)
        }
        None => fx.f32(1.0),
    };
    let lane_iota = fx.lane_iota();
    let _ = r;
    Prologue {
        f,
        bdims,
        m,
        n,
        d,
        dv,
        bm,
        bn,
        nqb,
        nkb,
        entry_bytes,
        tiles,
        q,
        k,
        v,
        d_out,
        stats,
        extras,
        targets,
        per_item,
        partials,
        dims,
        p_tile: base,
        ds_tile,
        dq_acc,
        dk_acc,
        dv_acc,
        kt,
        df_row,
        rb_row,
        q_t,
        do_t,
        alpha,
        lane_iota,
    }
}

/// One work item (batch index): its operands' addresses and the parts of the expressions
/// computed once for it.
struct Item {
    bidx: Vec<Value>,
    b_pos: Vec<Value>,
    q: Value,
    k: Value,
    v: Value,
    d_out: Value,
    stats: Option<(Value, Value)>,
    /// This item's block of partial sums.
    partial: Value,
    hoisted: Hoisted,
    /// A linear score's per-item factor and `∂F/∂s'` scale (`alpha · factor`).
    factor: Value,
    dscale: Value,
    /// Running sums of extra gradients whose index is the same for the whole item (by load):
    /// a four-lane and a one-lane f32 accumulator per tile, added after each tile into an f64
    /// total for the item (the terms largely cancel: softmax's `dF` sums to 0 along a row).
    sums: Vec<Option<Sum>>,
}

/// See [`Item::sums`].
#[derive(Clone, Copy)]
struct Sum {
    lanes: Variable,
    one: Variable,
    total: Variable,
}

fn addr_of(fx: &mut Fx, o: &Operand, bidx: &[Value]) -> Value {
    let zero = fx.i64(0);
    let off = fx.dot(zero, bidx, &o.batch);
    fx.elem_addr(o.base, off)
}

/// Emits the backward kernel over work items (batch indices).
pub fn emit(fx: &mut Fx, f: &FlashBwdKernel) {
    let p = prologue(fx, f);
    let (lo, hi) = (fx.lo(), fx.hi());
    fx.for_range(lo, hi, |fx, w| {
        let it = item(fx, &p, w);
        let zero = fx.i64(0);
        if f.dq.is_some() {
            let len = fx.mul(p.d, p.nqb);
            let len = fx.mul(len, p.bm);
            zero_floats(fx, p.dq_acc, len);
        }
        if !p.targets.is_empty() {
            zero_floats(fx, it.partial, p.per_item);
        }
        // Qᵀ and dOᵀ in panels once per item: the products with them then read them in place.
        fx.for_range(zero, p.nqb, |fx, qb| {
            let i0 = fx.mul(qb, p.bm);
            let left = fx.sub(p.m, i0);
            let rows = fx.min(p.bm, left);
            for (src, o, width, dst) in [(it.q, &p.q, p.d, p.q_t), (it.d_out, &p.d_out, p.dv, p.do_t)] {
                let off = fx.mul(i0, o.row);
                let from = fx.elem_addr(src, off);
                let panel = fx.mul(qb, width);
                let panel = fx.mul(panel, p.bm);
                let to = fx.elem_addr(dst, panel);
                fx.call(abi::TRANSPOSE, &[from, o.row, rows, width, to, p.bm]);
            }
        });
        fx.for_range(zero, p.nkb, |fx, kb| key_block(fx, &p, &it, kb));
        flush_sums(fx, &p, &it);
        if let Some(dq) = &f.dq {
            write_dq(fx, &p, &it, dq);
        }
    });
}

/// `n` zeros from `at`.
fn zero_floats(fx: &mut Fx, at: Value, n: Value) {
    fx.rows(n, &[at], &|fx, _, ptr| {
        let z = fx.fconst(0.0);
        fx.b.ins().store(MemFlagsData::new().with_notrap(), z, ptr[0], 0);
    });
}

/// Decodes work item `w` and hoists its item-level expression parts.
fn item(fx: &mut Fx, p: &Prologue, w: Value) -> Item {
    let f = p.f;
    let bidx = fx.unravel(w, &p.bdims);
    let (q, k, v, d_out) = (addr_of(fx, &p.q, &bidx), addr_of(fx, &p.k, &bidx), addr_of(fx, &p.v, &bidx), addr_of(fx, &p.d_out, &bidx));
    let stats = p.stats.as_ref().map(|(l, dl)| {
        let zero = fx.i64(0);
        let lo = fx.dot(zero, &bidx, &l.batch);
        let dlo = fx.dot(zero, &bidx, &dl.batch);
        (fx.elem_addr(l.base, lo), fx.elem_addr(dl.base, dlo))
    });
    let poff = fx.mul(w, p.per_item);
    let partial = fx.elem_addr(p.partials, poff);
    let b_pos: Vec<Value> = bidx.iter().map(|x| fx.b.ins().ireduce(types::I32, *x)).collect();
    let mut hoisted = Hoisted::new();
    {
        let mut pos = b_pos.clone();
        let z = fx.b.ins().iconst(types::I32, 0);
        pos.extend([z, z]);
        let none = Hoisted::new();
        let env = Env { s: None, pos: &pos, dims: &p.dims, extras: &p.extras, hoisted: &none };
        let mut exprs: Vec<&ScoreExpr> = vec![&f.spec.score, &f.grad.ds];
        exprs.extend(f.spec.mask.as_ref());
        for l in &f.grad.loads {
            exprs.push(&l.d);
            exprs.extend(&l.index);
        }
        if let Some(sep) = f.linear.as_ref().and_then(|l| l.sep.as_ref()) {
            exprs.push(sep);
        }
        score::hoist(fx, &exprs, f.spec.rank, Level::Item, &env, &mut hoisted);
    }
    let (factor, dscale) = match f.linear.as_ref().and_then(|l| l.factor.as_ref()) {
        Some(c) => {
            let mut pos = b_pos.clone();
            let z = fx.b.ins().iconst(types::I32, 0);
            pos.extend([z, z]);
            let env = Env { s: None, pos: &pos, dims: &p.dims, extras: &p.extras, hoisted: &hoisted };
            let t = score::eval(fx, c, &env);
            let c = fx.cvt_f(t);
            (c, fx.b.ins().fmul(c, p.alpha))
        }
        None => (fx.f32(1.0), p.alpha),
    };
    let rank = f.spec.rank;
    let sums = f
        .grad
        .loads
        .iter()
        .map(|l| {
            let item_level = l.index.iter().all(|e| crate::schedule::level(e, rank) == Level::Item);
            (item_level && p.targets.iter().any(|t| t.input == l.input)).then(|| {
                let z1 = fx.f32(0.0);
                let z4 = fx.b.ins().splat(types::F32X4, z1);
                let z64 = fx.f64(0.0);
                Sum { lanes: fx.var(types::F32X4, z4), one: fx.var(types::F32, z1), total: fx.var(types::F64, z64) }
            })
        })
        .collect();
    Item { bidx, b_pos, q, k, v, d_out, stats, partial, hoisted, factor, dscale, sums }
}

/// Key block `kb`: its `Kᵀ`, every live query tile, then its `dK` and `dV` rows.
fn key_block(fx: &mut Fx, p: &Prologue, it: &Item, kb: Value) {
    let f = p.f;
    let j0 = fx.mul(kb, p.bn);
    let left = fx.sub(p.n, j0);
    let cols = fx.min(p.bn, left);
    let koff = fx.mul(j0, p.k.row);
    let kp = fx.elem_addr(it.k, koff);
    let voff = fx.mul(j0, p.v.row);
    let vp = fx.elem_addr(it.v, voff);
    if f.dk.is_some() {
        let len = fx.mul(cols, p.d);
        zero_floats(fx, p.dk_acc, len);
    }
    if f.dv.is_some() {
        let len = fx.mul(cols, p.dv);
        zero_floats(fx, p.dv_acc, len);
    }
    if f.dq.is_some() {
        fx.call(abi::TRANSPOSE, &[kp, p.k.row, cols, p.d, p.kt, p.bn]);
    }
    let zero = fx.i64(0);
    fx.for_range(zero, p.nqb, |fx, qb| {
        let tix = fx.mul(qb, p.nkb);
        let tix = fx.add(tix, kb);
        let tix = fx.mul(tix, p.entry_bytes);
        let taddr = fx.add(p.tiles, tix);
        let class = fx.b.ins().uload8(types::I32, MemFlagsData::trusted(), taddr, 0);
        let run = fx.b.ins().icmp_imm_s(IntCC::NotEqual, class, 0);
        fx.if_then(run, |fx| {
            let partial = fx.b.ins().icmp_imm_s(IntCC::Equal, class, 2);
            let tile = Tile { j0, cols, kp, vp, qb };
            if f.spec.mask.is_some() {
                fx.if_else(partial, |fx| query_tile(fx, p, it, &tile, true), |fx| query_tile(fx, p, it, &tile, false));
            } else {
                query_tile(fx, p, it, &tile, false);
            }
        });
    });
    let r = f.q.shape.len();
    for (acc, view, width) in [(p.dk_acc, &f.dk, p.d), (p.dv_acc, &f.dv, p.dv)] {
        let Some(view) = view else { continue };
        let (base, strides) = fx.view_base(view);
        let zero = fx.i64(0);
        let off = fx.dot(zero, &it.bidx, &strides[..r - 2]);
        let row = strides[r - 2];
        fx.for_range(zero, cols, |fx, c| {
            let j = fx.add(j0, c);
            let o = fx.mul(j, row);
            let o = fx.add(off, o);
            let dst = fx.elem_addr(base, o);
            let so = fx.mul(c, width);
            let src = fx.elem_addr(acc, so);
            copy_row(fx, src, dst, width, view.dtype);
        });
    }
}

/// `dst[c] = src[c]` rounded to `dtype`, for `c < n`.
fn copy_row(fx: &mut Fx, src: Value, dst: Value, n: Value, dtype: DType) {
    fx.rows(n, &[src, dst], &|fx, _, ptr| {
        let ty = fx.ty(Kind::F);
        let x = fx.b.ins().load(ty, MemFlagsData::new().with_notrap(), ptr[0], 0);
        let y = fx.round_to(Tv { v: x, k: Kind::F }, dtype).v;
        fx.b.ins().store(MemFlagsData::new().with_notrap(), y, ptr[1], 0);
    });
}

/// A running (key block, query block) tile.
struct Tile {
    j0: Value,
    cols: Value,
    kp: Value,
    vp: Value,
    qb: Value,
}

/// One (key block, query block) tile. Unmasked tiles of a linear score take the row kernel
/// (when the separable terms are finite on the block); every other tile evaluates the score
/// modification, mask and derivatives per element.
fn query_tile(fx: &mut Fx, p: &Prologue, it: &Item, t: &Tile, masked: bool) {
    let i0 = fx.mul(t.qb, p.bm);
    let left = fx.sub(p.m, i0);
    let rows = fx.min(p.bm, left);
    let at = At { i0, rows };
    match &p.f.linear {
        Some(lin) if !masked => {
            let ok = match &lin.sep {
                Some(sep) => row_terms(fx, p, it, t, &at, sep),
                None => fx.b.ins().iconst(types::I8, 1),
            };
            fx.if_else(
                ok,
                |fx| {
                    products_before(fx, p, it, t, &at, p.alpha);
                    let zero = fx.i64(0);
                    fx.for_range(zero, t.cols, |fx, c| linear_row(fx, p, it, t, &at, c));
                    products_after(fx, p, it, t, &at);
                },
                |fx| general_tile(fx, p, it, t, &at, false),
            );
        }
        _ => general_tile(fx, p, it, t, &at, masked),
    }
}

/// A query block's first row and row count.
struct At {
    i0: Value,
    rows: Value,
}

/// A tile by the general path: raw scores, per-element weights and adjoints.
fn general_tile(fx: &mut Fx, p: &Prologue, it: &Item, t: &Tile, at: &At, masked: bool) {
    let one = fx.f32(1.0);
    products_before(fx, p, it, t, at, one);
    let zero = fx.i64(0);
    fx.for_range(zero, t.cols, |fx, c| weights_row(fx, p, it, t, at.i0, at.rows, c, masked));
    products_after(fx, p, it, t, at);
}

/// `Sᵀ = alpha · K_blk · Q_blkᵀ` and `dPᵀ = V_blk · dO_blkᵀ` into the tiles, from the query
/// block's `Qᵀ` and `dOᵀ` panels.
fn products_before(fx: &mut Fx, p: &Prologue, _it: &Item, t: &Tile, at: &At, alpha: Value) {
    let one = fx.f32(1.0);
    let overwrite = fx.b.ins().iconst(types::I32, 0);
    let qpan = fx.mul(t.qb, p.d);
    let qpan = fx.mul(qpan, p.bm);
    let qpan = fx.elem_addr(p.q_t, qpan);
    let dpan = fx.mul(t.qb, p.dv);
    let dpan = fx.mul(dpan, p.bm);
    let dpan = fx.elem_addr(p.do_t, dpan);
    fx.call(abi::SGEMM_NN, &[t.cols, at.rows, p.d, t.kp, p.k.row, qpan, p.bm, p.p_tile, p.bm, alpha, overwrite]);
    fx.call(abi::SGEMM_NN, &[t.cols, at.rows, p.dv, t.vp, p.v.row, dpan, p.bm, p.ds_tile, p.bm, one, overwrite]);
}

/// `dV += Pᵀ · dO_blk`, `dK += dSᵀ · Q_blk`, `dQᵀ += Kᵀ_blk · dSᵀ`; the item-level sums of
/// the extra gradients moved into their f64 totals.
fn products_after(fx: &mut Fx, p: &Prologue, it: &Item, t: &Tile, at: &At) {
    let f = p.f;
    let qoff = fx.mul(at.i0, p.q.row);
    let qp = fx.elem_addr(it.q, qoff);
    let dooff = fx.mul(at.i0, p.d_out.row);
    let dop = fx.elem_addr(it.d_out, dooff);
    let one = fx.f32(1.0);
    let accumulate = fx.b.ins().iconst(types::I32, 1);
    let rows = at.rows;
    if f.dv.is_some() {
        fx.call(abi::SGEMM_NN, &[t.cols, p.dv, rows, p.p_tile, p.bm, dop, p.d_out.row, p.dv_acc, p.dv, one, accumulate]);
    }
    if f.dk.is_some() {
        fx.call(abi::SGEMM_NN, &[t.cols, p.d, rows, p.ds_tile, p.bm, qp, p.q.row, p.dk_acc, p.d, one, accumulate]);
    }
    if f.dq.is_some() {
        // In slices of at most 64 rows of Kᵀ, which the microkernel runs reading dSᵀ in place.
        let zero = fx.i64(0);
        fx.for_step(zero, p.d, DQ_SLICE, |fx, d0| {
            let left = fx.sub(p.d, d0);
            let slice = fx.i64(DQ_SLICE);
            let h = fx.min(slice, left);
            let ko = fx.mul(d0, p.bn);
            let kt = fx.elem_addr(p.kt, ko);
            // The query block's own D x BlockM panel of dQᵀ: rows BlockM apart, not M (which
            // would put every row of a product in the same cache sets for power-of-two M).
            let qo = fx.mul(t.qb, p.d);
            let qo = fx.add(qo, d0);
            let qo = fx.mul(qo, p.bm);
            let dq = fx.elem_addr(p.dq_acc, qo);
            fx.call(abi::SGEMM_NN, &[h, rows, t.cols, kt, p.bn, p.ds_tile, p.bm, dq, p.bm, one, accumulate]);
        });
    }
    for sum in it.sums.iter().flatten() {
        let acc4 = fx.b.use_var(sum.lanes);
        let mut tile = fx.b.use_var(sum.one);
        for lane in 0..4u8 {
            let x = fx.b.ins().extractlane(acc4, lane);
            tile = fx.b.ins().fadd(tile, x);
        }
        let wide = fx.b.ins().fpromote(types::F64, tile);
        let total = fx.b.use_var(sum.total);
        let total = fx.b.ins().fadd(total, wide);
        fx.b.def_var(sum.total, total);
        let z1 = fx.f32(0.0);
        let z4 = fx.b.ins().splat(types::F32X4, z1);
        fx.b.def_var(sum.lanes, z4);
        fx.b.def_var(sum.one, z1);
    }
}

/// The block's separable row terms `sep(i, j0) - sep(i0, j0)` into the row-term vector;
/// returns whether they (and `sep(i0, j0)`) are all finite, which the split needs.
fn row_terms(fx: &mut Fx, p: &Prologue, it: &Item, t: &Tile, at: &At, sep: &ScoreExpr) -> Value {
    let j32 = fx.b.ins().ireduce(types::I32, t.j0);
    let i0_32 = fx.b.ins().ireduce(types::I32, at.i0);
    let at_pos = |fx: &mut Fx, i: Value| -> Value {
        let mut pos = it.b_pos.clone();
        pos.extend([i, j32]);
        let env = Env { s: None, pos: &pos, dims: &p.dims, extras: &p.extras, hoisted: &it.hoisted };
        let x = score::eval(fx, sep, &env);
        fx.cvt_f(x)
    };
    let base = at_pos(fx, i0_32);
    let yes = fx.b.ins().iconst(types::I8, 1);
    let ok = fx.var(types::I8, yes);
    let zero = fx.i64(0);
    fx.for_range(zero, at.rows, |fx, r| {
        let i = fx.add(at.i0, r);
        let i = fx.b.ins().ireduce(types::I32, i);
        let x = at_pos(fx, i);
        let d = fx.b.ins().fsub(x, base);
        let addr = fx.elem_addr(p.rb_row, r);
        fx.store(d, addr);
        // Finite exactly when `d - d == 0`.
        let dd = fx.b.ins().fsub(d, d);
        let z = fx.f32(0.0);
        let finite = fx.b.ins().fcmp(FloatCC::Equal, dd, z);
        let prev = fx.b.use_var(ok);
        let both = fx.b.ins().band(prev, finite);
        fx.b.def_var(ok, both);
    });
    fx.b.use_var(ok)
}

/// Key row `c` of an unmasked tile of a linear score: the row kernel (after `tanh` of the row
/// for soft-capping), then the extra gradients from its `dF`.
fn linear_row(fx: &mut Fx, p: &Prologue, it: &Item, t: &Tile, at: &At, c: Value) {
    let f = p.f;
    let Some(lin) = &f.linear else { return };
    let off = fx.mul(c, p.bm);
    let srow = fx.elem_addr(p.p_tile, off);
    let drow = fx.elem_addr(p.ds_tile, off);
    if lin.tanh {
        fx.call(abi::TANH, &[srow, srow, at.rows]);
    }
    let j = fx.add(t.j0, c);
    let j32 = fx.b.ins().ireduce(types::I32, j);
    let i0_32 = fx.b.ins().ireduce(types::I32, at.i0);
    let cb = match &lin.sep {
        Some(sep) => {
            let mut pos = it.b_pos.clone();
            pos.extend([i0_32, j32]);
            let env = Env { s: None, pos: &pos, dims: &p.dims, extras: &p.extras, hoisted: &it.hoisted };
            let x = score::eval(fx, sep, &env);
            fx.cvt_f(x)
        }
        None => fx.f32(0.0),
    };
    let null = fx.i64(0);
    let rb = if lin.sep.is_some() { p.rb_row } else { null };
    let (lse, delta, sigmoid) = match it.stats {
        Some((l, dl)) => {
            let (ls, ds) = p.stats.as_ref().map(|(a, b)| (a.step, b.step)).unwrap_or((null, null));
            let lo = fx.mul(at.i0, ls);
            let dlo = fx.mul(at.i0, ds);
            (fx.elem_addr(l, lo), fx.elem_addr(dl, dlo), 0)
        }
        None => (null, null, 2),
    };
    let extras = !p.targets.is_empty();
    let df = if extras { p.df_row } else { null };
    let flags = fx.b.ins().iconst(types::I32, i64::from(lin.tanh) | sigmoid);
    fx.call(abi::FLASH_BWD_ROW, &[srow, drow, lse, delta, rb, at.rows, it.factor, cb, it.dscale, flags, df]);
    if extras {
        fx.rows(at.rows, &[p.df_row], &|fx, r, ptr| {
            let fty = fx.ty(Kind::F);
            let df = fx.b.ins().load(fty, MemFlagsData::new().with_notrap(), ptr[0], 0);
            let pos = positions(fx, p, it, at.i0, j32, r);
            let env = Env { s: None, pos: &pos, dims: &p.dims, extras: &p.extras, hoisted: &it.hoisted };
            let z = fx.fconst(0.0);
            let live = fx.b.ins().fcmp(FloatCC::NotEqual, df, z);
            extra_gradients(fx, p, it, &env, df, live);
        });
    }
}

/// The score positions of the lanes at query offset `r` of the block and key `j`.
fn positions(fx: &mut Fx, p: &Prologue, it: &Item, i0: Value, j32: Value, r: Value) -> Vec<Value> {
    let mut pos: Vec<Value> = it.b_pos.iter().map(|b| fx.splat(Kind::I, *b)).collect();
    let i0_32 = fx.b.ins().ireduce(types::I32, i0);
    let r32 = fx.b.ins().ireduce(types::I32, r);
    let i = fx.b.ins().iadd(i0_32, r32);
    let i = fx.splat(Kind::I, i);
    let i = if fx.lanes > 1 { fx.b.ins().iadd(i, p.lane_iota) } else { i };
    pos.push(i);
    pos.push(fx.splat(Kind::I, j32));
    pos
}

/// Each wanted load's `dF · ∂F/∂x` for these lanes (0 where `live` is false): into its
/// item-level sum, or added at the index it loads.
fn extra_gradients(fx: &mut Fx, p: &Prologue, it: &Item, env: &Env, df: Value, live: Value) {
    let z = fx.fconst(0.0);
    for (l, sum) in p.f.grad.loads.iter().zip(&it.sums) {
        let Some(target) = p.targets.iter().find(|t| t.input == l.input) else { continue };
        let d = score::eval(fx, &l.d, env);
        let d = fx.cvt_f(d);
        let contrib = fx.b.ins().fmul(df, d);
        let contrib = fx.select_raw(live, contrib, z);
        match sum {
            Some(sum) => {
                let var = if fx.lanes > 1 { sum.lanes } else { sum.one };
                let acc = fx.b.use_var(var);
                let acc = fx.b.ins().fadd(acc, contrib);
                fx.b.def_var(var, acc);
            }
            None => {
                let idx: Vec<Value> = l
                    .index
                    .iter()
                    .map(|e| {
                        let x = score::eval(fx, e, env);
                        fx.cvt_i(x)
                    })
                    .collect();
                scatter_add(fx, it.partial, target, &idx, contrib);
            }
        }
    }
}

/// Key row `c` of a tile, four queries at a time: `Pᵀ` and `dSᵀ` in place of `Sᵀ` and `dPᵀ`, and
/// the extra operands' gradients.
#[allow(clippy::too_many_arguments)]
fn weights_row(fx: &mut Fx, p: &Prologue, it: &Item, t: &Tile, i0: Value, rows: Value, c: Value, masked: bool) {
    let f = p.f;
    let off = fx.mul(c, p.bm);
    let srow = fx.elem_addr(p.p_tile, off);
    let drow = fx.elem_addr(p.ds_tile, off);
    let mut bases = vec![srow, drow];
    if let Some((l, dl)) = it.stats {
        let (ls, ds) = p.stats.as_ref().map(|(a, b)| (a.step, b.step)).unwrap_or((i0, i0));
        let lo = fx.mul(i0, ls);
        let dlo = fx.mul(i0, ds);
        bases.push(fx.elem_addr(l, lo));
        bases.push(fx.elem_addr(dl, dlo));
    }
    let j = fx.add(t.j0, c);
    let j32 = fx.b.ins().ireduce(types::I32, j);
    let softmax = f.spec.weights == Weights::Softmax;
    let needs_ds = f.needs_ds();
    fx.rows(rows, &bases, &|fx, r, ptr| {
        let fl = MemFlagsData::new().with_notrap();
        let fty = fx.ty(Kind::F);
        let s = fx.b.ins().load(fty, fl, ptr[0], 0);
        let dp = fx.b.ins().load(fty, fl, ptr[1], 0);
        let pos = positions(fx, p, it, i0, j32, r);
        let env = Env { s: Some(Tv { v: s, k: Kind::F }), pos: &pos, dims: &p.dims, extras: &p.extras, hoisted: &it.hoisted };
        let score = score::eval(fx, &f.spec.score, &env);
        let score = fx.cvt_f(score);
        let (w, df) = if softmax {
            let lse = fx.b.ins().load(fty, fl, ptr[2], 0);
            let delta = fx.b.ins().load(fty, fl, ptr[3], 0);
            let x = fx.b.ins().fsub(score, lse);
            let e = fx.exp(x);
            // A row with no kept key (lse = -inf) has no weights.
            let ninf = fx.fconst(f32::NEG_INFINITY);
            let empty = fx.b.ins().fcmp(FloatCC::Equal, lse, ninf);
            let z = fx.fconst(0.0);
            let w = fx.select_raw(empty, z, e);
            let t = fx.b.ins().fsub(dp, delta);
            (w, fx.b.ins().fmul(w, t))
        } else {
            let w = fx.sigmoid(score);
            let one = fx.fconst(1.0);
            let om = fx.b.ins().fsub(one, w);
            let t = fx.b.ins().fmul(w, om);
            (w, fx.b.ins().fmul(dp, t))
        };
        let (w, df) = if masked {
            let Some(m) = &f.spec.mask else { return };
            let keep = score::eval(fx, m, &env);
            let keep = fx.cvt_b(keep);
            let z = fx.fconst(0.0);
            (fx.select_raw(keep, w, z), fx.select_raw(keep, df, z))
        } else {
            (w, df)
        };
        fx.b.ins().store(fl, w, ptr[0], 0);
        // Where dF is 0 nothing flows, even if a derivative is inf or NaN there.
        let z = fx.fconst(0.0);
        let live = fx.b.ins().fcmp(FloatCC::NotEqual, df, z);
        if needs_ds {
            let d = score::eval(fx, &f.grad.ds, &env);
            let d = fx.cvt_f(d);
            let ds = fx.b.ins().fmul(df, d);
            let ds = fx.select_raw(live, ds, z);
            fx.b.ins().store(fl, ds, ptr[1], 0);
        }
        extra_gradients(fx, p, it, &env, df, live);
    });
}

/// Adds `x` (per lane) into the partial sums of `target` at the clamped indices `idx`.
fn scatter_add(fx: &mut Fx, partial: Value, target: &Target, idx: &[Value], x: Value) {
    let one = |fx: &mut Fx, idx: &[Value], x: Value| {
        let mut off = target.offset;
        let mut stride = fx.i64(1);
        for (k, i) in idx.iter().enumerate().rev() {
            let n = target.sizes[k];
            let i = fx.b.ins().sextend(types::I64, *i);
            let (zero, one) = (fx.i64(0), fx.i64(1));
            let top = fx.sub(n, one);
            let top = fx.max(top, zero);
            let i = fx.min(i, top);
            let i = fx.max(i, zero);
            let t = fx.mul(i, stride);
            off = fx.add(off, t);
            stride = fx.mul(stride, n);
        }
        let addr = fx.elem_addr(partial, off);
        let old = fx.load(types::F32, addr);
        let new = fx.b.ins().fadd(old, x);
        fx.store(new, addr);
    };
    if fx.lanes == 1 {
        return one(fx, idx, x);
    }
    let lanes = fx.lanes;
    for lane in 0..lanes {
        let xs: Vec<Value> = idx.iter().map(|i| fx.b.ins().extractlane(*i, lane)).collect();
        let v = fx.b.ins().extractlane(x, lane);
        fx.lanes = 1;
        one(fx, &xs, v);
        fx.lanes = lanes;
    }
}

/// Adds the item-level running sums into the item's partial sums at their (item-level) index.
fn flush_sums(fx: &mut Fx, p: &Prologue, it: &Item) {
    for (l, sum) in p.f.grad.loads.iter().zip(&it.sums) {
        let (Some(sum), Some(target)) = (sum, p.targets.iter().find(|t| t.input == l.input)) else { continue };
        let total = fx.b.use_var(sum.total);
        let total = fx.b.ins().fdemote(types::F32, total);
        let mut pos = it.b_pos.clone();
        let z = fx.b.ins().iconst(types::I32, 0);
        pos.extend([z, z]);
        let env = Env { s: None, pos: &pos, dims: &p.dims, extras: &p.extras, hoisted: &it.hoisted };
        let idx: Vec<Value> = l
            .index
            .iter()
            .map(|e| {
                let x = score::eval(fx, e, &env);
                fx.cvt_i(x)
            })
            .collect();
        scatter_add(fx, it.partial, target, &idx, total);
    }
}

/// `dQ` of the item from the panels of `dQᵀ`, rounded to its type.
fn write_dq(fx: &mut Fx, p: &Prologue, it: &Item, dq: &View) {
    let r = dq.shape.len();
    let (base, strides) = fx.view_base(dq);
    let zero = fx.i64(0);
    let off = fx.dot(zero, &it.bidx, &strides[..r - 2]);
    let dst = fx.elem_addr(base, off);
    fx.for_range(zero, p.nqb, |fx, qb| {
        let i0 = fx.mul(qb, p.bm);
        let left = fx.sub(p.m, i0);
        let rows = fx.min(p.bm, left);
        let po = fx.mul(qb, p.d);
        let po = fx.mul(po, p.bm);
        let panel = fx.elem_addr(p.dq_acc, po);
        let o = fx.mul(i0, strides[r - 2]);
        let to = fx.elem_addr(dst, o);
        fx.call(abi::TRANSPOSE, &[panel, p.bm, p.d, rows, to, strides[r - 2]]);
    });
    if matches!(dq.dtype, DType::F16 | DType::BF16) {
        fx.for_range(zero, p.m, |fx, i| {
            let o = fx.mul(i, strides[r - 2]);
            let row = fx.elem_addr(dst, o);
            copy_row(fx, row, row, p.d, dq.dtype);
        });
    }
}

/// Emits the sum of every work item's partial sums into the extra operands' gradients: work
/// item = one element of one gradient, summed over the backward's items in order.
pub fn emit_reduce(fx: &mut Fx, f: &FlashBwdKernel) {
    let batch = f.batch().to_vec();
    let bdims = fx.dims(&batch);
    let mut items = fx.i64(1);
    for x in &bdims {
        items = fx.mul(items, *x);
    }
    let partials = fx.buf(f.partials);
    let mut per_item = fx.i64(0);
    let mut targets = Vec::new();
    for (_, view) in &f.dx {
        let elems = fx.dim(&Dim::product(&view.shape));
        let (base, _) = fx.view_base(view);
        targets.push((per_item, elems, base, view.dtype));
        per_item = fx.add(per_item, elems);
    }
    let (lo, hi) = (fx.lo(), fx.hi());
    fx.for_range(lo, hi, |fx, e| {
        // Which gradient element `e` is: walk the gradients' element ranges.
        for (start, elems, base, dtype) in &targets {
            let end = fx.add(*start, *elems);
            let ge = fx.b.ins().icmp(IntCC::SignedGreaterThanOrEqual, e, *start);
            let lt = fx.b.ins().icmp(IntCC::SignedLessThan, e, end);
            let inside = fx.b.ins().band(ge, lt);
            let (start, base, dtype) = (*start, *base, *dtype);
            fx.if_then(inside, |fx| {
                let zero = fx.i64(0);
                let z = fx.f32(0.0);
                let acc = fx.var(types::F32, z);
                fx.for_range(zero, items, |fx, w| {
                    let o = fx.mul(w, per_item);
                    let o = fx.add(o, e);
                    let addr = fx.elem_addr(partials, o);
                    let x = fx.load(types::F32, addr);
                    let a = fx.b.use_var(acc);
                    let a = fx.b.ins().fadd(a, x);
                    fx.b.def_var(acc, a);
                });
                let a = fx.b.use_var(acc);
                let a = fx.round_to(Tv { v: a, k: Kind::F }, dtype).v;
                let local = fx.sub(e, start);
                let addr = fx.elem_addr(base, local);
                fx.store(a, addr);
            });
        }
    });
}
