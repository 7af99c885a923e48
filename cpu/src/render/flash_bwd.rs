//! The flash backward kernel, generated per differentiated flash op, and the sum of its extra
//! operands' gradients.
//!
//! It renders the schedule's [`FlashBwdKernel`] (FlashAttention-2's backward, key blocks outer):
//! work item = one batch index, which owns its `dQ` rows, so no two threads add into one value
//! and the result does not depend on the thread count. For each key block of `BlockN` keys:
//!
//! 1. the span of query rows the tile table leaves live for it (first to last live query
//!    block); for that span, `Sᵀ = K_blk · Qᵀ` and `dPᵀ = V_blk · dOᵀ` by the SGEMM microkernel
//!    into scratch (keys along rows, queries along columns), each one product;
//! 2. per key row ([`super::flash_bwd_rows`]), query block by query block: skipped blocks are
//!    zeroed, unmasked blocks of a linear score go to the row kernel (weights, `dF`, `dS` at
//!    the ISA's full width), the rest evaluate the score modification, mask and derivatives per
//!    element; each extra operand's gradient `dF · ∂F/∂x` is added at the index it loads;
//! 3. `dV_blk = Pᵀ · dO`, `dK_blk = dSᵀ · Q`, `dQᵀ += Kᵀ_blk · dSᵀ`, each one product over the
//!    span (`Kᵀ_blk` transposed once).
//!
//! Then the key block's `dK` and `dV` rows are written, and after the last key block `dQ`
//! (transposed back). Nothing of the size of the scores exists: scratch holds one key block's
//! `Pᵀ`, `dSᵀ`, `dK`, `dV`, `Kᵀ` and the batch index's `dQᵀ`, all O(S).

use super::builder::StepBuilder;
use super::matmul::batch_strides;
use super::ops::Typed;
use super::score::{self, Env, Extra, Hoisted};
use crate::abi;
use attn_compiler::ir::semantics::Class;
use attn_compiler::ir::{DType, Dim, ScoreExpr};
use attn_compiler::schedule::{FlashBwdKernel, Tuning, View};
use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::{InstBuilder, MemFlagsData, Value, types};
use cranelift_frontend::Variable;
use std::collections::HashMap;

/// Rows of `Kᵀ` per `dQᵀ` product: the microkernel reads its `B` (`dSᵀ`) rows in place for
/// products of at most 64 rows.
const DQ_SLICE: i64 = 64;

/// A `[..b', rows, width]` operand: its base, the strides of the score's batch axes, its row
/// stride (the microkernels' leading dimension).
pub(super) struct Operand {
    base: Value,
    batch: Vec<Value>,
    pub(super) row: Value,
}

fn operand(fx: &mut StepBuilder, view: &View, batch: &[Dim], width: Value) -> Operand {
    let r = view.shape.len();
    let (base, strides) = fx.view_base(view);
    let bs = batch_strides(fx, view, &strides, batch);
    let row = fx.max(strides[r - 2], width);
    Operand { base, batch: bs, row }
}

/// A `[..b, M]` row statistic (the log-sum-exp): base, batch strides, element stride.
pub(super) struct RowStat {
    base: Value,
    batch: Vec<Value>,
    pub(super) step: Value,
}

fn row_stat(fx: &mut StepBuilder, view: &View, batch: &[Dim]) -> RowStat {
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
pub(super) struct Target {
    pub(super) input: usize,
    offset: Value,
    sizes: Vec<Value>,
}

/// Everything the loops read, loaded in the prologue.
pub(super) struct Prologue<'f> {
    pub(super) f: &'f FlashBwdKernel,
    bdims: Vec<Value>,
    pub(super) m: Value,
    n: Value,
    d: Value,
    dv: Value,
    pub(super) bm: Value,
    bn: Value,
    nqb: Value,
    pub(super) nkb: Value,
    pub(super) entry_bytes: Value,
    pub(super) tiles: Value,
    /// Flat batch indices per tile table ([`Tuning::TileBatchDiv`]).
    tile_div: Value,
    q: Operand,
    k: Operand,
    v: Operand,
    d_out: Operand,
    /// Softmax weights: the log-sum-exp, and the forward's result.
    pub(super) stats: Option<(RowStat, Operand)>,
    /// The log-sum-exp's cotangent, subtracted from each row's `delta`.
    d_lse: Option<RowStat>,
    pub(super) extras: Vec<Extra>,
    pub(super) targets: Vec<Target>,
    /// Floats of partial sums per work item.
    per_item: Value,
    partials: Value,
    pub(super) dims: HashMap<Dim, Value>,
    /// Floats between rows of `Pᵀ`, `dSᵀ` and `dQᵀ`.
    pub(super) stride: Value,
    /// Scratch: `Pᵀ` and `dSᵀ` rows of one key block, `dQᵀ`, `dK`, `dV`, `Kᵀ`.
    pub(super) p_rows: Value,
    pub(super) ds_rows: Value,
    dq_acc: Value,
    dk_acc: Value,
    dv_acc: Value,
    kt: Value,
    /// A key row's `dF`, the queries' separable row terms and the rows' `delta` (`stride` f32
    /// each).
    pub(super) df_row: Value,
    pub(super) rb_row: Value,
    pub(super) delta_row: Value,
    /// The row terms of a summed load's derivative (`stride` f32), and the row kernel's two
    /// sums.
    pub(super) w_row: Value,
    pub(super) sums: Value,
    /// The scale of `s` in a linear score (1 without one).
    pub(super) alpha: Value,
    /// The query's folded scale, and `dQ`'s (1 without one).
    q_scale: Value,
    dq_scale: Value,
    pub(super) lane_iota: Value,
    /// Dropout of the weights: seed, keep threshold, factor ([`super::flash::dropout_values`]).
    dropout: Option<[Value; 3]>,
}

/// Where each extra operand's gradient sits in a work item's partial sums: the targets, and the
/// floats one item holds.
fn gradient_targets(fx: &mut StepBuilder, f: &FlashBwdKernel) -> (Vec<Target>, Value) {
    let mut per_item = fx.i64(0);
    let mut targets = Vec::new();
    for (input, view) in &f.dx {
        let sizes = fx.dims(&view.shape);
        targets.push(Target { input: *input, offset: per_item, sizes });
        let elems = fx.dim(&Dim::product(&view.shape));
        per_item = fx.add(per_item, elems);
    }
    (targets, per_item)
}

fn prologue<'f>(fx: &mut StepBuilder, f: &'f FlashBwdKernel) -> Prologue<'f> {
    let batch = f.batch().to_vec();
    let bdims = fx.dims(&batch);
    let (m, n, d, dv) = f.sizes();
    let (m, n, d, dv) = (fx.dim(&m), fx.dim(&n), fx.dim(&d), fx.dim(&dv));
    let step = f.step;
    let [bm, bn, nqb, nkb, entry_bytes, stride, tile_div] = [
        Tuning::BlockM,
        Tuning::BlockN,
        Tuning::QueryBlocks,
        Tuning::KeyBlocks,
        Tuning::TileEntryBytes,
        Tuning::RowStride,
        Tuning::TileBatchDiv,
    ]
    .map(|t| fx.tuning(step, t));
    let tiles = fx.buf(f.tiles);
    let q = operand(fx, &f.q, &batch, d);
    let k = operand(fx, &f.k, &batch, d);
    let v = operand(fx, &f.v, &batch, dv);
    let d_out = operand(fx, &f.d_out, &batch, dv);
    let stats = f.lse.as_ref().map(|(l, o)| (row_stat(fx, l, &batch), operand(fx, o, &batch, dv)));
    let d_lse = f.d_lse.as_ref().map(|l| row_stat(fx, l, &batch));
    let extras = Extra::of_views(fx, &f.extras);
    let (targets, per_item) = gradient_targets(fx, f);
    let partials = fx.buf(f.partials);
    let dims = score::dim_values(fx, attn_compiler::schedule::bwd_dims(f));
    let base = fx.scratch();
    let [ds_rows, dq_acc, dk_acc, dv_acc, kt, df_row] = [
        Tuning::ScratchGradS,
        Tuning::ScratchGradQ,
        Tuning::ScratchGradK,
        Tuning::ScratchGradV,
        Tuning::ScratchKeysT,
        Tuning::ScratchGradRow,
    ]
    .map(|t| {
        let off = fx.tuning(step, t);
        fx.add(base, off)
    });
    let rb_row = fx.elem_addr(df_row, stride);
    let delta_row = fx.elem_addr(rb_row, stride);
    let w_row = fx.elem_addr(delta_row, stride);
    let sums = fx.elem_addr(w_row, stride);
    let alpha = score::step_scalar(fx, f.linear.as_ref().and_then(|l| l.alpha.as_ref()), &dims, &extras);
    let q_scale = score::step_scalar(fx, f.q_scale.as_ref(), &dims, &extras);
    let dq_scale = score::step_scalar(fx, f.dq_scale.as_ref(), &dims, &extras);
    let lane_iota = fx.lane_iota();
    let dropout = f.spec.dropout.as_ref().and_then(|d| super::flash::dropout_values(fx, d, &extras));
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
        tile_div,
        q,
        k,
        v,
        d_out,
        stats,
        d_lse,
        extras,
        targets,
        per_item,
        partials,
        dims,
        stride,
        p_rows: base,
        ds_rows,
        dq_acc,
        dk_acc,
        dv_acc,
        kt,
        df_row,
        rb_row,
        delta_row,
        w_row,
        sums,
        alpha,
        q_scale,
        dq_scale,
        lane_iota,
        dropout,
    }
}

/// One work item (batch index): its operands' addresses and the parts of the expressions
/// computed once for it.
pub(super) struct Item {
    bidx: Vec<Value>,
    pub(super) b_pos: Vec<Value>,
    q: Value,
    k: Value,
    v: Value,
    d_out: Value,
    pub(super) stats: Option<(Value, Value)>,
    /// This item's log-sum-exp cotangent (row 0), when the graph differentiates the log-sum-exp.
    d_lse: Option<Value>,
    /// This item's block of partial sums.
    pub(super) partial: Value,
    /// Its forward result (softmax weights).
    out: Option<Value>,
    pub(super) hoisted: Hoisted,
    /// A linear score's per-item factor.
    pub(super) factor: Value,
    /// Running sums of extra gradients whose index is the same for the whole item (by load):
    /// four-lane and one-lane f32 accumulators per key row, added after each key row into an
    /// f64 total for the item (the terms largely cancel: softmax's `dF` sums to 0 along a row).
    pub(super) sums: Vec<Option<Sum>>,
    /// This item's tile table.
    tiles: Value,
}

/// See [`Item::sums`].
#[derive(Clone, Copy)]
pub(super) struct Sum {
    pub(super) lanes: Variable,
    pub(super) one: Variable,
    pub(super) total: Variable,
}

fn addr_of(fx: &mut StepBuilder, o: &Operand, bidx: &[Value]) -> Value {
    let zero = fx.i64(0);
    let off = fx.dot(zero, bidx, &o.batch);
    fx.elem_addr(o.base, off)
}

/// Emits the backward kernel over work items (batch indices).
pub fn emit(fx: &mut StepBuilder, f: &FlashBwdKernel) {
    let p = prologue(fx, f);
    let (lo, hi) = (fx.lo(), fx.hi());
    fx.for_range(lo, hi, |fx, w| {
        let it = item(fx, &p, w);
        let zero = fx.i64(0);
        if f.dq.is_some() {
            let len = fx.mul(p.d, p.stride);
            zero_floats(fx, p.dq_acc, len);
        }
        if !p.targets.is_empty() {
            zero_floats(fx, it.partial, p.per_item);
        }
        if let Some(out) = it.out {
            deltas(fx, &p, &it, out);
        }
        fx.for_range(zero, p.nkb, |fx, kb| key_block(fx, &p, &it, kb));
        flush_sums(fx, &p, &it);
        if let Some(dq) = &f.dq {
            write_dq(fx, &p, &it, dq);
        }
    });
}

/// Every row's `delta = Σ d_out ∘ out` (less the log-sum-exp's cotangent, when there is one) of
/// the item into the delta vector.
fn deltas(fx: &mut StepBuilder, p: &Prologue, it: &Item, out: Value) {
    let Some((_, o)) = &p.stats else { return };
    let zero = fx.i64(0);
    fx.for_range(zero, p.m, |fx, i| {
        let z1 = fx.f32(0.0);
        let z4 = fx.b.ins().splat(types::F32X4, z1);
        let (acc4, acc1) = (fx.var(types::F32X4, z4), fx.var(types::F32, z1));
        let doff = fx.mul(i, p.d_out.row);
        let drow = fx.elem_addr(it.d_out, doff);
        let ooff = fx.mul(i, o.row);
        let orow = fx.elem_addr(out, ooff);
        fx.rows(p.dv, &[drow, orow], &|fx, _, ptr| {
            let fl = MemFlagsData::new().with_notrap();
            let fty = fx.ty(Class::Float);
            let a = fx.b.ins().load(fty, fl, ptr[0], 0);
            let b = fx.b.ins().load(fty, fl, ptr[1], 0);
            let var = if fx.lanes > 1 { acc4 } else { acc1 };
            let t = fx.b.use_var(var);
            let ab = fx.b.ins().fmul(a, b);
            let t = fx.b.ins().fadd(t, ab);
            fx.b.def_var(var, t);
        });
        let v4 = fx.b.use_var(acc4);
        let mut total = fx.b.use_var(acc1);
        for lane in 0..4u8 {
            let x = fx.b.ins().extractlane(v4, lane);
            total = fx.b.ins().fadd(total, x);
        }
        if let (Some(base), Some(l)) = (it.d_lse, &p.d_lse) {
            let off = fx.mul(i, l.step);
            let at = fx.elem_addr(base, off);
            let g = fx.load(types::F32, at);
            total = fx.b.ins().fsub(total, g);
        }
        let at = fx.elem_addr(p.delta_row, i);
        fx.store(total, at);
    });
}

/// `n` zeros from `at`.
pub(super) fn zero_floats(fx: &mut StepBuilder, at: Value, n: Value) {
    fx.rows(n, &[at], &|fx, _, ptr| {
        let z = fx.fconst(0.0);
        fx.b.ins().store(MemFlagsData::new().with_notrap(), z, ptr[0], 0);
    });
}

/// Decodes work item `w` and hoists its item-level expression parts.
fn item(fx: &mut StepBuilder, p: &Prologue, w: Value) -> Item {
    let f = p.f;
    let bidx = fx.unravel(w, &p.bdims);
    let (q, k, v, d_out) = (addr_of(fx, &p.q, &bidx), addr_of(fx, &p.k, &bidx), addr_of(fx, &p.v, &bidx), addr_of(fx, &p.d_out, &bidx));
    let stats = p.stats.as_ref().map(|(l, _)| {
        let zero = fx.i64(0);
        let lo = fx.dot(zero, &bidx, &l.batch);
        (fx.elem_addr(l.base, lo), p.delta_row)
    });
    let out = p.stats.as_ref().map(|(_, o)| addr_of(fx, o, &bidx));
    let d_lse = p.d_lse.as_ref().map(|l| {
        let zero = fx.i64(0);
        let lo = fx.dot(zero, &bidx, &l.batch);
        fx.elem_addr(l.base, lo)
    });
    let poff = fx.mul(w, p.per_item);
    let partial = fx.elem_addr(p.partials, poff);
    let b_pos: Vec<Value> = bidx.iter().map(|x| fx.b.ins().ireduce(types::I32, *x)).collect();
    let mut exprs: Vec<&ScoreExpr> = vec![&f.spec.score, &f.grad.ds];
    exprs.extend(f.spec.mask.as_ref());
    for l in &f.grad.loads {
        exprs.push(&l.d);
        exprs.extend(&l.index);
    }
    if let Some(sep) = f.linear.as_ref().and_then(|l| l.sep.as_ref()) {
        exprs.push(sep);
    }
    let hoisted = score::hoist_item(fx, &exprs, f.spec.rank, &b_pos, &p.dims, &p.extras);
    let factor = match f.linear.as_ref().and_then(|l| l.factor.as_ref()) {
        Some(c) => {
            let pos = score::item_positions(fx, &b_pos);
            let env = Env { s: None, pos: &pos, dims: &p.dims, extras: &p.extras, hoisted: &hoisted };
            let t = score::eval(fx, c, &env);
            fx.cvt_f(t)
        }
        None => fx.f32(1.0),
    };
    let sums = f
        .item_sums()
        .into_iter()
        .map(|summed| {
            summed.then(|| {
                let z1 = fx.f32(0.0);
                let z4 = fx.b.ins().splat(types::F32X4, z1);
                let z64 = fx.f64(0.0);
                Sum { lanes: fx.var(types::F32X4, z4), one: fx.var(types::F32, z1), total: fx.var(types::F64, z64) }
            })
        })
        .collect();
    // The item's tile table (per batch index where the mask's data differs per batch index).
    let table = fx.b.ins().udiv(w, p.tile_div);
    let size = fx.mul(p.nqb, p.nkb);
    let size = fx.mul(size, p.entry_bytes);
    let off = fx.mul(table, size);
    let tiles = fx.add(p.tiles, off);
    Item { bidx, b_pos, q, k, v, d_out, stats, d_lse, partial, out, hoisted, factor, sums, tiles }
}

/// The span of live query blocks of key block `kb` by the tile table: `(first, last)`, with
/// `last < first` when every tile of the key block is skipped.
fn live_span(fx: &mut StepBuilder, p: &Prologue, it: &Item, kb: Value) -> (Value, Value) {
    let first = fx.var(types::I64, p.nqb);
    let none = fx.i64(-1);
    let last = fx.var(types::I64, none);
    let zero = fx.i64(0);
    fx.for_range(zero, p.nqb, |fx, qb| {
        let class = tile_class(fx, p, it, qb, kb);
        let live = fx.b.ins().icmp_imm_s(IntCC::NotEqual, class, 0);
        let f0 = fx.b.use_var(first);
        let f1 = fx.min(f0, qb);
        let f1 = fx.b.ins().select(live, f1, f0);
        fx.b.def_var(first, f1);
        let l0 = fx.b.use_var(last);
        let l1 = fx.max(l0, qb);
        let l1 = fx.b.ins().select(live, l1, l0);
        fx.b.def_var(last, l1);
    });
    (fx.b.use_var(first), fx.b.use_var(last))
}

/// The class (0 skip, 1 full, 2 partial) of tile (query block `qb`, key block `kb`) of item
/// `it`, i32.
pub(super) fn tile_class(fx: &mut StepBuilder, p: &Prologue, it: &Item, qb: Value, kb: Value) -> Value {
    let tix = fx.mul(qb, p.nkb);
    let tix = fx.add(tix, kb);
    let tix = fx.mul(tix, p.entry_bytes);
    let taddr = fx.add(it.tiles, tix);
    fx.b.ins().uload8(types::I32, MemFlagsData::trusted(), taddr, 0)
}

/// Key block `kb`: its live span's products, every key row's weights and adjoints, the
/// gradient products, then its `dK` and `dV` rows.
fn key_block(fx: &mut StepBuilder, p: &Prologue, it: &Item, kb: Value) {
    let f = p.f;
    let j0 = fx.mul(kb, p.bn);
    let left = fx.sub(p.n, j0);
    let cols = fx.min(p.bn, left);
    let koff = fx.mul(j0, p.k.row);
    let kp = fx.elem_addr(it.k, koff);
    let voff = fx.mul(j0, p.v.row);
    let vp = fx.elem_addr(it.v, voff);
    let (first, last) = live_span(fx, p, it, kb);
    let any = fx.b.ins().icmp(IntCC::SignedLessThanOrEqual, first, last);
    fx.if_else(
        any,
        |fx| {
            let r0 = fx.mul(first, p.bm);
            let one = fx.i64(1);
            let end = fx.add(last, one);
            let r1 = fx.mul(end, p.bm);
            let r1 = fx.min(r1, p.m);
            let len = fx.sub(r1, r0);
            let span = Span { kb, j0, cols, r0, len, first, last };
            span_products(fx, p, it, &span, kp, vp);
        },
        |fx| {
            // No live tile: the key block's gradients are 0.
            for (acc, present, width) in [(p.dk_acc, f.dk.is_some(), p.d), (p.dv_acc, f.dv.is_some(), p.dv)] {
                if present {
                    let n = fx.mul(cols, width);
                    zero_floats(fx, acc, n);
                }
            }
        },
    );
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

/// A key block and the span of query rows it is live for.
pub(super) struct Span {
    pub(super) kb: Value,
    pub(super) j0: Value,
    cols: Value,
    /// First query row of the span, and its length.
    pub(super) r0: Value,
    pub(super) len: Value,
    /// First and last live query block.
    pub(super) first: Value,
    pub(super) last: Value,
}

/// The products of one key block over its live span, with the key rows' weights and adjoints
/// between them.
fn span_products(fx: &mut StepBuilder, p: &Prologue, it: &Item, s: &Span, kp: Value, vp: Value) {
    let f = p.f;
    let qoff = fx.mul(s.r0, p.q.row);
    let qp = fx.elem_addr(it.q, qoff);
    let dooff = fx.mul(s.r0, p.d_out.row);
    let dop = fx.elem_addr(it.d_out, dooff);
    let one = fx.f32(1.0);
    let overwrite = fx.b.ins().iconst(types::I32, 0);
    let accumulate = fx.b.ins().iconst(types::I32, 1);
    fx.call(abi::SGEMM_NT, &[s.cols, s.len, p.d, kp, p.k.row, qp, p.q.row, p.p_rows, p.stride, p.q_scale, overwrite]);
    fx.call(abi::SGEMM_NT, &[s.cols, s.len, p.dv, vp, p.v.row, dop, p.d_out.row, p.ds_rows, p.stride, one, overwrite]);
    // Whether the row kernel's split of the span's scores (and of the summed load's
    // derivative) into key and row terms holds: every term finite.
    let mut ok = fx.b.ins().iconst(types::I8, 1);
    if let Some(lin) = &f.linear {
        if let Some(sep) = &lin.sep {
            let t = super::flash_bwd_rows::row_terms(fx, p, it, s, sep, p.rb_row);
            ok = fx.b.ins().band(ok, t);
        }
        if let Some(k) = lin.sum_load {
            let t = super::flash_bwd_rows::row_terms(fx, p, it, s, &f.grad.loads[k].d, p.w_row);
            ok = fx.b.ins().band(ok, t);
        }
    }
    let sep_ok = ok;
    // Dropout: `dP = z ∘ (dO · Vᵀ)` before the adjoints, and the values' gradient from `z ∘ P`
    // after them (the adjoints need `P` itself).
    let drop = |fx: &mut StepBuilder, rows: Value| {
        let Some([seed, threshold, scale]) = p.dropout else { return };
        let batch = super::flash::flat_batch(fx, &it.bidx, &p.bdims);
        let keys_on_rows = fx.b.ins().iconst(types::I32, 1);
        fx.call(abi::DROPOUT_TILE, &[rows, p.stride, s.cols, s.len, s.j0, s.r0, keys_on_rows, seed, batch, threshold, scale]);
    };
    drop(fx, p.ds_rows);
    let zero = fx.i64(0);
    fx.for_range(zero, s.cols, |fx, c| {
        super::flash_bwd_rows::key_row(fx, p, it, s, c, sep_ok);
        flush_row_sums(fx, it);
    });
    if f.dv.is_some() {
        drop(fx, p.p_rows);
        fx.call(abi::SGEMM_NN, &[s.cols, p.dv, s.len, p.p_rows, p.stride, dop, p.d_out.row, p.dv_acc, p.dv, one, overwrite]);
    }
    if f.dk.is_some() {
        fx.call(abi::SGEMM_NN, &[s.cols, p.d, s.len, p.ds_rows, p.stride, qp, p.q.row, p.dk_acc, p.d, p.q_scale, overwrite]);
    }
    if f.dq.is_some() {
        fx.call(abi::TRANSPOSE, &[kp, p.k.row, s.cols, p.d, p.kt, p.bn]);
        // In slices of at most 64 rows of Kᵀ, which the microkernel runs reading dSᵀ in place.
        fx.for_step(zero, p.d, DQ_SLICE, |fx, d0| {
            let left = fx.sub(p.d, d0);
            let slice = fx.i64(DQ_SLICE);
            let h = fx.min(slice, left);
            let ko = fx.mul(d0, p.bn);
            let kt = fx.elem_addr(p.kt, ko);
            let qo = fx.mul(d0, p.stride);
            let qo = fx.add(qo, s.r0);
            let dq = fx.elem_addr(p.dq_acc, qo);
            fx.call(abi::SGEMM_NN, &[h, s.len, s.cols, kt, p.bn, p.ds_rows, p.stride, dq, p.stride, p.dq_scale, accumulate]);
        });
    }
}

/// Moves a key row's item-level sums (f32 lanes) into their f64 totals.
fn flush_row_sums(fx: &mut StepBuilder, it: &Item) {
    for sum in it.sums.iter().flatten() {
        let acc4 = fx.b.use_var(sum.lanes);
        let mut row = fx.b.use_var(sum.one);
        for lane in 0..4u8 {
            let x = fx.b.ins().extractlane(acc4, lane);
            row = fx.b.ins().fadd(row, x);
        }
        let wide = fx.b.ins().fpromote(types::F64, row);
        let total = fx.b.use_var(sum.total);
        let total = fx.b.ins().fadd(total, wide);
        fx.b.def_var(sum.total, total);
        let z1 = fx.f32(0.0);
        let z4 = fx.b.ins().splat(types::F32X4, z1);
        fx.b.def_var(sum.lanes, z4);
        fx.b.def_var(sum.one, z1);
    }
}

/// `dst[c] = src[c]` rounded to `dtype`, for `c < n`.
fn copy_row(fx: &mut StepBuilder, src: Value, dst: Value, n: Value, dtype: DType) {
    fx.rows(n, &[src, dst], &|fx, _, ptr| {
        let ty = fx.ty(Class::Float);
        let x = fx.b.ins().load(ty, MemFlagsData::new().with_notrap(), ptr[0], 0);
        let y = fx.round_to(Typed { v: x, k: Class::Float }, dtype).v;
        fx.b.ins().store(MemFlagsData::new().with_notrap(), y, ptr[1], 0);
    });
}

/// Adds `x` (per lane) into the partial sums of `target` at the clamped indices `idx`.
pub(super) fn scatter_add(fx: &mut StepBuilder, partial: Value, target: &Target, idx: &[Value], x: Value) {
    let one = |fx: &mut StepBuilder, idx: &[Value], x: Value| {
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

/// Adds the item-level totals into the item's partial sums at their (item-level) index.
fn flush_sums(fx: &mut StepBuilder, p: &Prologue, it: &Item) {
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

/// `dQ` of the item from `dQᵀ`, rounded to its type.
fn write_dq(fx: &mut StepBuilder, p: &Prologue, it: &Item, dq: &View) {
    let r = dq.shape.len();
    let (base, strides) = fx.view_base(dq);
    let zero = fx.i64(0);
    let off = fx.dot(zero, &it.bidx, &strides[..r - 2]);
    let dst = fx.elem_addr(base, off);
    fx.call(abi::TRANSPOSE, &[p.dq_acc, p.stride, p.d, p.m, dst, strides[r - 2]]);
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
pub fn emit_reduce(fx: &mut StepBuilder, f: &FlashBwdKernel) {
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
                let a = fx.round_to(Typed { v: a, k: Class::Float }, dtype).v;
                let local = fx.sub(e, start);
                let addr = fx.elem_addr(base, local);
                fx.store(a, addr);
            });
        }
    });
}
