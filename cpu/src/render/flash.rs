//! The flash-attention kernel, generated per flash op, and the merge step for split keys.
//!
//! It renders the schedule's [`FlashKernel`] with its analyses ([`attn_compiler::schedule::FlashAnalysis`]:
//! the scale on the Q·Kᵀ product, separable terms, staged `tanh`, per-item factor), block sizes
//! and scratch layout from the integer table. Work item = (batch index, query block of `BlockM`
//! rows, key split). For each key tile of `BlockN` keys in the split whose class (from the
//! per-run tile table) is not Skip:
//!
//! 1. `S = alpha · Q_blk · K_tileᵀ` by the SGEMM microkernel into scratch (the few-rows
//!    kernel, which streams K in place, for blocks of at most four rows: decode);
//! 2. per row: the score modification and (for Partial tiles only) the mask, compiled inline,
//!    four scores at a time, tracking the tile's row max; hoisted parts of the expressions
//!    (per batch index, per row) are computed once outside the loop;
//! 3. online softmax: new running max, `P = exp(S - max)` and its row sum by the exp
//!    microkernel, the running sum and accumulator rescaled by `exp(old max - new max)`.
//!    Sigmoid weights instead: `P = keep ? sigmoid(score) : 0`;
//! 4. `acc += P · V_tile` by the SGEMM microkernel (or the few-rows kernel).
//!
//! Finally each row is divided by its sum (rows with no kept key give 0), or, when keys are
//! split, the partial state (max, sum, acc) is stored for [`emit_merge`]. Sizes, strides and
//! block sizes are run-time integers: nothing is recompiled per shape. K and V batch axes of
//! size 1 have stride 0 (grouped-query and multi-query attention read the shared head).

use super::builder::StepBuilder;
use super::matmul::batch_strides;
use super::ops::Typed;
use super::score::{self, Env, Extra, Hoisted};
use crate::abi;
use attn_compiler::ir::semantics::Class;
use attn_compiler::ir::{DType, Dim, Pair, ScoreExpr, Weights};
use attn_compiler::schedule::tile_table::{CHUNK_COLS, CHUNK_ROWS};
use attn_compiler::schedule::{FlashKernel, Level, Paging, Tuning, View};
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{InstBuilder, MemFlagsData, StackSlotData, StackSlotKind, Value, types};
use std::collections::HashMap;

/// Query blocks of at most this many rows (decode) use the few-rows products, which stream K
/// and V in place instead of packing them.
const FEW_ROWS: i64 = attn_compiler::schedule::policy::CPU_FEW_ROWS;

/// Values of the prologue both kernels share.
struct Common {
    bdims: Vec<Value>,
    m: Value,
    dv: Value,
    bm: Value,
    nqb: Value,
    splits: Value,
    out: Value,
    out_bs: Vec<Value>,
    out_rs: Value,
    partials: Value,
    /// Floats per partial row: `Dv + 2`.
    prow: Value,
    /// The log-sum-exp result, when the step writes one: its base, batch strides and row
    /// stride.
    lse: Option<(Value, Vec<Value>, Value)>,
}

fn common(fx: &mut StepBuilder, f: &FlashKernel) -> Common {
    let r = f.q.shape.len();
    let batch = &f.out.shape[..r - 2];
    let bdims = fx.dims(batch);
    let (out, ost) = fx.view_base(&f.out);
    let out_bs = batch_strides(fx, &f.out, &ost, batch);
    let m = fx.dim(&f.q.shape[r - 2]);
    let dv = fx.dim(&f.v.shape[r - 1]);
    let bm = fx.tuning(f.step, Tuning::BlockM);
    let nqb = fx.tuning(f.step, Tuning::QueryBlocks);
    let splits = fx.tuning(f.step, Tuning::Splits);
    let partials = fx.buf(f.partials);
    let two = fx.i64(2);
    let prow = fx.add(dv, two);
    let lse = f.lse.as_ref().map(|view| {
        let (base, st) = fx.view_base(view);
        let bs = batch_strides_of(fx, view, &st, batch);
        (base, bs, st[r - 2])
    });
    Common { bdims, m, dv, bm, nqb, splits, out, out_bs, out_rs: ost[r - 2], partials, prow, lse }
}

/// The strides of a `[..b, M]` view's batch axes aligned to `batch` (broadcast axes step 0).
fn batch_strides_of(fx: &mut StepBuilder, view: &attn_compiler::schedule::View, strides: &[Value], batch: &[Dim]) -> Vec<Value> {
    let lead = batch.len().saturating_sub(view.shape.len().saturating_sub(1));
    (0..batch.len())
        .map(|t| match t.checked_sub(lead) {
            Some(a) if view.shape[a].as_const() != Some(1) => strides[a],
            _ => fx.i64(0),
        })
        .collect()
}

/// Stores row `i`'s log-sum-exp `max + ln(sum)` (`-inf` when no key was kept, NaN for a NaN
/// row) when the step writes one.
fn store_lse(fx: &mut StepBuilder, c: &Common, bidx: &[Value], i: Value, max: Value, sum: Value) {
    let Some((base, bs, rs)) = &c.lse else { return };
    let zero = fx.i64(0);
    let off = fx.dot(zero, bidx, bs);
    let row = fx.mul(i, *rs);
    let off = fx.add(off, row);
    let addr = fx.elem_addr(*base, off);
    let wide = fx.b.ins().fpromote(types::F64, sum);
    let ln = fx.call(abi::LOG, &[wide])[0];
    let ln = fx.b.ins().fdemote(types::F32, ln);
    let lse = fx.b.ins().fadd(max, ln);
    fx.store(lse, addr);
}

/// One query block of a flash op, from its index over (batch index, query block).
struct QueryBlock {
    /// Query block number.
    qblk: Value,
    /// Flat batch index.
    bflat: Value,
    /// Batch position per batch axis.
    bidx: Vec<Value>,
    /// First query row.
    i0: Value,
    /// Rows in the block (the last one may be short).
    rows: Value,
}

fn query_block(fx: &mut StepBuilder, c: &Common, t: Value) -> QueryBlock {
    let qblk = fx.b.ins().urem(t, c.nqb);
    let bi = fx.b.ins().udiv(t, c.nqb);
    let bidx = fx.unravel(bi, &c.bdims);
    let i0 = fx.mul(qblk, c.bm);
    let left = fx.sub(c.m, i0);
    let rows = fx.min(c.bm, left);
    QueryBlock { qblk, bflat: bi, bidx, i0, rows }
}

/// Whether the work items run split-major (`w = split · T + t` over the `T` (batch index, query
/// block) pairs) rather than split-minor: for a paged K or V, so that the threads read the same
/// pages for consecutive heads (adjacent rows in memory for the NHD layout) at about the same
/// time, instead of each head's whole sequence in turn.
fn split_major(f: &FlashKernel) -> bool {
    f.paged()
}

/// The (batch index, query block) pairs of a flash step: `T`.
fn query_items(fx: &mut StepBuilder, c: &Common) -> Value {
    let mut t = c.nqb;
    for d in &c.bdims {
        t = fx.mul(t, *d);
    }
    t
}

/// Work item `w`'s key split and (batch index, query block) pair.
fn split_of(fx: &mut StepBuilder, c: &Common, f: &FlashKernel, w: Value) -> (Value, Value) {
    if split_major(f) {
        let t = query_items(fx, c);
        (fx.b.ins().udiv(w, t), fx.b.ins().urem(w, t))
    } else {
        (fx.b.ins().urem(w, c.splits), fx.b.ins().udiv(w, c.splits))
    }
}

/// Address of the `Dv + 2` floats of partial row `r` of flash work item `w`.
fn partial_row(fx: &mut StepBuilder, c: &Common, w: Value, r: Value) -> Value {
    let t = fx.mul(w, c.bm);
    let t = fx.add(t, r);
    let t = fx.mul(t, c.prow);
    fx.elem_addr(c.partials, t)
}

/// Loads f32 lanes at `p`.
fn ldp(fx: &mut StepBuilder, p: Value) -> Value {
    let ty = fx.ty(Class::Float);
    fx.b.ins().load(ty, MemFlagsData::new().with_notrap(), p, 0)
}

/// Stores f32 lanes at `p`.
fn stp(fx: &mut StepBuilder, x: Value, p: Value) {
    fx.b.ins().store(MemFlagsData::new().with_notrap(), x, p, 0);
}

/// Loads f32 lanes at element `c` of `base`.
fn ld(fx: &mut StepBuilder, base: Value, c: Value) -> Value {
    let addr = fx.elem_addr(base, c);
    let ty = fx.ty(Class::Float);
    fx.b.ins().load(ty, MemFlagsData::new().with_notrap(), addr, 0)
}

/// Stores f32 lanes at element `c` of `base`.
fn st(fx: &mut StepBuilder, x: Value, base: Value, c: Value) {
    let addr = fx.elem_addr(base, c);
    fx.b.ins().store(MemFlagsData::new().with_notrap(), x, addr, 0);
}

/// A flash operand (q, k or v) in the prologue.
struct Operand {
    /// Its first element.
    base: Value,
    /// Element stride between rows.
    row: Value,
    /// Element strides of the batch axes.
    batch: Vec<Value>,
}

fn operand(fx: &mut StepBuilder, view: &attn_compiler::schedule::View, batch: &[Dim]) -> Operand {
    let r = view.shape.len();
    let (base, strides) = fx.view_base(view);
    let batch = batch_strides(fx, view, &strides, batch);
    Operand { base, row: strides[r - 2], batch }
}

/// The scratch regions of a thread (the layout [`attn_compiler::schedule::prepare()`] computes),
/// or of one head of a grouped work item.
#[derive(Clone, Copy)]
struct Scratch {
    tile: Value,
    acc: Value,
    max: Value,
    sum: Value,
    bias: Value,
}

/// Everything the flash kernel's loops read, loaded in the prologue.
struct Prologue<'f> {
    f: &'f FlashKernel,
    c: Common,
    q: Operand,
    k: Operand,
    v: Operand,
    /// Keys, q/k width, and the leading dimensions of q, k, v for the products.
    n: Value,
    d: Value,
    lda: Value,
    ldk: Value,
    ldv: Value,
    bn: Value,
    kps: Value,
    nkb: Value,
    tiles: Value,
    entry_bytes: Value,
    /// Flat batch indices per tile table ([`Tuning::TileBatchDiv`]).
    tile_div: Value,
    extras: Vec<Extra>,
    dims: HashMap<Dim, Value>,
    /// The scale of the Q·Kᵀ product.
    alpha: Value,
    /// Additive scores: the weight vector's first element and batch strides.
    weight: Option<(Value, Vec<Value>)>,
    scratch: Scratch,
    lane_iota: Value,
    /// K and V read from pages through a block table.
    k_pages: Option<Pages>,
    v_pages: Option<Pages>,
    /// Dropout of the weights: the seed (i32), the keep threshold (i32) and the factor (f32).
    dropout: Option<[Value; 3]>,
}

/// A paged K or V ([`attn_compiler::schedule::Paging`]), loaded in the prologue.
struct Pages {
    /// The block table's first element and its row and column strides.
    table: Value,
    rs: Value,
    cs: Value,
    /// The score batch axis whose index picks the table row.
    axis: usize,
    /// Rows per page, the last page id of the pool, and the elements from page to page.
    page: Value,
    last: Value,
    stride: Value,
    /// The table's columns (pages per sequence).
    cols: Value,
}

fn pages(fx: &mut StepBuilder, view: &attn_compiler::schedule::View, paging: Option<&Paging>, batch: &[Dim]) -> Option<Pages> {
    let p = paging?;
    let (table, st) = fx.view_base(&p.table);
    let lead = batch.len().saturating_sub(view.shape.len().saturating_sub(2));
    let (page, np, stride) = (fx.dim(&p.page), fx.dim(&p.pages), fx.dim(&p.stride));
    let one = fx.i64(1);
    let last = fx.sub(np, one);
    let cols = fx.dim(&p.table.shape[1]);
    Some(Pages { table, rs: st[0], cs: st[1], axis: lead + p.axis, page, last, stride, cols })
}

/// Calls `body(c, n, ptr)` for each run of a paged operand's rows `j..j + n` inside one page
/// (`c` its first row counted from `j`, `ptr` that row's address, from the batch offset
/// `off`): one per page the rows touch, its page id read from the work item's table row `trow`
/// and clamped into the pool.
fn runs(
    fx: &mut StepBuilder,
    op: &Operand,
    (pg, trow): (&Pages, Value),
    (off, j, n): (Value, Value, Value),
    body: &mut dyn FnMut(&mut StepBuilder, Value, Value, Value),
) {
    let end = fx.add(j, n);
    let m0 = fx.b.ins().udiv(j, pg.page);
    let m1 = fx.ceil_div(end, pg.page);
    // The address of row `r` of the batch index's page `m`.
    let row_of = |fx: &mut StepBuilder, m: Value, r: Value| {
        let t = fx.mul(m, pg.cs);
        let ta = fx.elem_addr(trow, t);
        let id = fx.load(types::I32, ta);
        let id = fx.b.ins().sextend(types::I64, id);
        let zero = fx.i64(0);
        let id = fx.max(id, zero);
        let id = fx.min(id, pg.last);
        let o = fx.mul(id, pg.stride);
        let o = fx.add(off, o);
        let r = fx.mul(r, op.row);
        let o = fx.add(o, r);
        fx.elem_addr(op.base, o)
    };
    fx.for_range(m0, m1, |fx, m| {
        let first = fx.mul(m, pg.page);
        let lo = fx.max(first, j);
        let next = fx.add(first, pg.page);
        let hi = fx.min(next, end);
        let len = fx.sub(hi, lo);
        let c = fx.sub(lo, j);
        let within = fx.sub(lo, first);
        let ptr = row_of(fx, m, within);
        body(fx, c, len, ptr);
    });
}

/// Fills a `kernels::PagedRows` on the stack for the operand's rows from key `first` on (the
/// batch index's offset `off`, its table row `trow`) and returns its address: what the paged
/// few-rows products read.
fn paged_rows(fx: &mut StepBuilder, op: &Operand, (pg, trow): (&Pages, Value), off: Value, first: Value) -> Value {
    let slot = fx.b.create_sized_stack_slot(StackSlotData::new(StackSlotKind::ExplicitSlot, 72, 3));
    let base = fx.elem_addr(op.base, off);
    let pages = fx.b.ins().iadd_imm_s(pg.last, 1);
    for (k, v) in [base, op.row, pg.stride, pg.page, pages, trow, pg.cs, pg.cols, first].into_iter().enumerate() {
        fx.b.ins().stack_store(types::I64, v, slot, 8 * k as i32);
    }
    fx.b.ins().stack_addr(types::I64, slot, 0)
}

fn prologue<'f>(fx: &mut StepBuilder, f: &'f FlashKernel) -> Prologue<'f> {
    let c = common(fx, f);
    let batch = f.batch().to_vec();
    let (q, k, v) = (operand(fx, &f.q, &batch), operand(fx, &f.k, &batch), operand(fx, &f.v, &batch));
    let (_, n, d, _) = f.sizes();
    let (n, d) = (fx.dim(&n), fx.dim(&d));
    let (lda, ldk, ldv) = (fx.max(q.row, d), fx.max(k.row, d), fx.max(v.row, c.dv));
    let step = f.step;
    let [bn, kps, nkb, entry_bytes] =
        [Tuning::BlockN, Tuning::KeysPerSplit, Tuning::KeyBlocks, Tuning::TileEntryBytes].map(|t| fx.tuning(step, t));
    let tiles = fx.buf(f.tiles);
    let tile_div = fx.tuning(step, Tuning::TileBatchDiv);
    let extras = Extra::of_views(fx, &f.extras);
    let dims = score::dim_values(fx, attn_compiler::schedule::score_dims(f));
    let alpha = score::step_scalar(fx, f.analysis.alpha.as_ref(), &dims, &extras);
    let base = fx.scratch();
    let [acc, max, sum, bias] = [Tuning::ScratchAcc, Tuning::ScratchMax, Tuning::ScratchSum, Tuning::ScratchBias].map(|t| {
        let off = fx.tuning(step, t);
        fx.add(base, off)
    });
    let scratch = Scratch { tile: base, acc, max, sum, bias };
    let lane_iota = fx.lane_iota();
    let weight = match f.spec.pair {
        Pair::Dot => None,
        Pair::Additive { weight } => f.extras.get(weight).map(|view| {
            let (base, strides) = fx.view_base(view);
            let bs = batch_strides_of(fx, view, &strides, &batch);
            (base, bs)
        }),
    };
    let k_pages = pages(fx, &f.k, f.k_paging.as_ref(), &batch);
    let v_pages = pages(fx, &f.v, f.v_paging.as_ref(), &batch);
    let dropout = f.spec.dropout.as_ref().and_then(|d| dropout_values(fx, d, &extras));
    Prologue {
        f,
        c,
        q,
        k,
        v,
        n,
        d,
        lda,
        ldk,
        ldv,
        bn,
        kps,
        nkb,
        tiles,
        entry_bytes,
        tile_div,
        extras,
        dims,
        alpha,
        weight,
        scratch,
        lane_iota,
        k_pages,
        v_pages,
        dropout,
    }
}

/// A flash op's dropout as the kernels take it: the seed (loaded from its extra operand), the
/// keep threshold and the factor on kept weights.
pub(super) fn dropout_values(fx: &mut StepBuilder, d: &attn_compiler::ir::Dropout, extras: &[Extra]) -> Option<[Value; 3]> {
    use attn_compiler::ir::semantics;
    let seed = extras.get(d.seed)?;
    let seed = fx.load(types::I32, seed.base);
    let threshold = fx.b.ins().iconst(types::I32, i64::from(semantics::dropout_threshold(d.rate)));
    let scale = fx.f32(semantics::dropout_scale(d.rate) as f32);
    Some([seed, threshold, scale])
}

/// Dropout of a dense f32 tensor, one row (its last axis) per work item: the row copied from `x`
/// into `out`, then dropped in place by the tile kernel the flash kernels use (its position:
/// row `i` of batch index `b`, keys from 0).
pub fn emit_dropout(fx: &mut StepBuilder, x: &View, seed: &View, rate: f64, out: &View) {
    use attn_compiler::ir::semantics;
    let r = out.shape.len();
    let cols = if r >= 1 { fx.dim(&out.shape[r - 1]) } else { fx.i64(1) };
    let per = if r >= 2 { fx.dim(&out.shape[r - 2]) } else { fx.i64(1) };
    let ((xb, _), (ob, _), (sb, _)) = (fx.view_base(x), fx.view_base(out), fx.view_base(seed));
    let seed = fx.load(types::I32, sb);
    let threshold = fx.b.ins().iconst(types::I32, i64::from(semantics::dropout_threshold(rate)));
    let scale = fx.f32(semantics::dropout_scale(rate) as f32);
    let rows_are_queries = fx.b.ins().iconst(types::I32, 0);
    let (one, zero) = (fx.i64(1), fx.i64(0));
    let (lo, hi) = (fx.lo(), fx.hi());
    fx.for_range(lo, hi, |fx, row| {
        let off = fx.mul(row, cols);
        let (src, dst) = (fx.elem_addr(xb, off), fx.elem_addr(ob, off));
        fx.call(abi::COPY_ROWS, &[src, cols, one, cols, dst, cols]);
        let batch = fx.b.ins().udiv(row, per);
        let i = fx.b.ins().urem(row, per);
        fx.call(abi::DROPOUT_TILE, &[dst, cols, one, cols, i, zero, rows_are_queries, seed, batch, threshold, scale]);
    });
}

/// The row-major index over the score's batch axes of a batch position (dropout's counter).
pub(super) fn flat_batch(fx: &mut StepBuilder, bidx: &[Value], bdims: &[Value]) -> Value {
    let mut flat = fx.i64(0);
    for (x, n) in bidx.iter().zip(bdims) {
        let t = fx.mul(flat, *n);
        flat = fx.add(t, *x);
    }
    flat
}

/// One work item: a query block's rows against one key split.
struct Item {
    block: QueryBlock,
    /// The query block's first row of q.
    qp: Value,
    /// The batch index's additive weight vector.
    wp: Option<Value>,
    /// Offsets of the batch index's k and v.
    koff: Value,
    voff: Value,
    /// The batch index's block-table rows of a paged k and v.
    k_trow: Option<Value>,
    v_trow: Option<Value>,
    /// The split's keys.
    kstart: Value,
    kend: Value,
    /// Batch positions (i32).
    b_pos: Vec<Value>,
    /// Score and mask parts computed once per work item.
    hoisted: Hoisted,
    /// Whether the separable split holds for every row of the block.
    sep_ok: Value,
    /// The per-item factors of the staged score and of the separated rest.
    factor: Option<Value>,
    rest_factor: Option<Value>,
    /// The item's scores, accumulator and running state (its head's, in a grouped item).
    scratch: Scratch,
}

/// Emits the flash kernel: work item = (batch index, query block of `BlockM` rows, key
/// split); for each key tile of the split that the tile table does not skip, Q·Kᵀ, the
/// weights, and P·V into the running state; then the rows (or the split's partial state).
pub fn emit(fx: &mut StepBuilder, f: &FlashKernel) {
    let p = prologue(fx, f);
    let (lo, hi) = (fx.lo(), fx.hi());
    let group = p.k_pages.is_some().then(|| fx.tuning(f.step, Tuning::HeadGroup));
    fx.for_range(lo, hi, |fx, w| match group {
        Some(g) => {
            let grouped = fx.b.ins().icmp_imm_s(IntCC::SignedGreaterThan, g, 1);
            fx.if_else(grouped, |fx| grouped_item(fx, &p, g, w), |fx| one_item(fx, &p, w));
        }
        None => one_item(fx, &p, w),
    });
}

/// Work item `w` of one (batch index, query block, key split).
fn one_item(fx: &mut StepBuilder, p: &Prologue, w: Value) {
    let (sp, t) = split_of(fx, &p.c, p.f, w);
    let item = item(fx, p, (sp, t), p.scratch);
    start_rows(fx, p, &item.scratch, item.block.rows);
    let kb0 = fx.b.ins().udiv(item.kstart, p.bn);
    let kb1 = fx.ceil_div(item.kend, p.bn);
    fx.for_range(kb0, kb1, |fx, kbi| key_tile(fx, p, &item, kbi));
    finish(fx, p, &item, w);
}

/// The running state of `rows` rows of scratch: maxima `-inf`, sums and accumulators 0.
fn start_rows(fx: &mut StepBuilder, p: &Prologue, scratch: &Scratch, rows: Value) {
    let ninf = fx.f32(f32::NEG_INFINITY);
    let fzero = fx.f32(0.0);
    let zero = fx.i64(0);
    fx.for_range(zero, rows, |fx, rr| {
        st(fx, ninf, scratch.max, rr);
        st(fx, fzero, scratch.sum, rr);
    });
    let acc_n = fx.mul(rows, p.c.dv);
    fx.rows(acc_n, &[scratch.acc], &|fx, _, ptr| {
        let z = fx.fconst(0.0);
        stp(fx, z, ptr[0]);
    });
}

/// A grouped work item ([`Tuning::HeadGroup`] `g > 1`, a paged K and V, one query block of at
/// most [`FEW_ROWS`] rows): up to `g` consecutive heads of the last batch axis, one key split.
/// Each key tile's products run once for the whole group (`attnc_gemv_*_paged_heads`, which
/// read every head's rows of a page together), the weights head by head, each head in its own
/// scratch rows; each head then finishes as its own item would.
fn grouped_item(fx: &mut StepBuilder, p: &Prologue, g: Value, w: Value) {
    let c = &p.c;
    let Some(&last) = c.bdims.last() else { return };
    let t_all = query_items(fx, c);
    let per_outer = fx.ceil_div(last, g);
    let outer_n = fx.b.ins().udiv(t_all, last);
    let per_split = fx.mul(outer_n, per_outer);
    let sp = fx.b.ins().udiv(w, per_split);
    let rest = fx.b.ins().urem(w, per_split);
    let outer = fx.b.ins().udiv(rest, per_outer);
    let gi = fx.b.ins().urem(rest, per_outer);
    let h0 = fx.mul(gi, g);
    let left = fx.sub(last, h0);
    let heads = fx.min(g, left);
    let t0 = fx.mul(outer, last);
    let t0 = fx.add(t0, h0);
    let grp = Group { sp, t0, heads };
    let zero = fx.i64(0);
    let first = grp.item(fx, p, zero);
    let rows = fx.mul(heads, first.block.rows);
    start_rows(fx, p, &first.scratch, rows);
    let kb0 = fx.b.ins().udiv(first.kstart, p.bn);
    let kb1 = fx.ceil_div(first.kend, p.bn);
    fx.for_range(kb0, kb1, |fx, kbi| {
        let (j0, cols, taddr, class) = tile_class(fx, p, &first, kbi);
        let run = fx.b.ins().icmp_imm_s(IntCC::NotEqual, class, 0);
        fx.if_then(run, |fx| {
            let partial = fx.b.ins().icmp_imm_s(IntCC::Equal, class, 2);
            spans(fx, p, first.block.rows, cols, (partial, taddr), &|fx, r, k, masked| {
                grouped_span(fx, p, &grp, &first, (j0, cols), (r, k), masked);
            });
        });
    });
    fx.for_range(zero, heads, |fx, x| {
        let it = grp.item(fx, p, x);
        let wx = fx.mul(sp, t_all);
        let t = fx.add(t0, x);
        let wx = fx.add(wx, t);
        finish(fx, p, &it, wx);
    });
}

/// A grouped work item's split `sp`, first (batch index, query block) pair `t0` (its first
/// head) and heads.
struct Group {
    sp: Value,
    t0: Value,
    heads: Value,
}

impl Group {
    /// The item of head `x` of the group, its scratch rows from the group's `x`-th block on (the
    /// first head's: the whole group's).
    fn item(&self, fx: &mut StepBuilder, p: &Prologue, x: Value) -> Item {
        let t = fx.add(self.t0, x);
        let rows = fx.mul(x, p.c.bm);
        let s = &p.scratch;
        let tile_rows = fx.mul(rows, p.bn);
        let acc_rows = fx.mul(rows, p.c.dv);
        let scratch = Scratch {
            tile: fx.elem_addr(s.tile, tile_rows),
            acc: fx.elem_addr(s.acc, acc_rows),
            max: fx.elem_addr(s.max, rows),
            sum: fx.elem_addr(s.sum, rows),
            bias: s.bias,
        };
        item(fx, p, (self.sp, t), scratch)
    }
}

/// Rows `r0..r0 + rc` against keys `c0..c0 + cc` of key tile `(j0, cols)` for every head of a
/// grouped item: `S` of every head by one grouped product, each head's weights in its scratch
/// rows, then `P·V` of every head by one grouped product.
fn grouped_span(
    fx: &mut StepBuilder,
    p: &Prologue,
    grp: &Group,
    first: &Item,
    (j0, cols): (Value, Value),
    ((r0, rc), (c0, cc)): ((Value, Value), (Value, Value)),
    masked: bool,
) {
    let (Some(pk), Some(pv), Some(kt), Some(vt)) = (p.k_pages.as_ref(), p.v_pages.as_ref(), first.k_trow, first.v_trow) else {
        return;
    };
    let head_stride = |op: &Operand| op.batch.last().copied();
    let (Some(qs), Some(ks), Some(vs)) = (head_stride(&p.q), head_stride(&p.k), head_stride(&p.v)) else { return };
    let [qrow, srow, arow] = span_rows(fx, p, first, r0, c0);
    let tile_floats = fx.mul(p.c.bm, p.bn);
    let acc_floats = fx.mul(p.c.bm, p.c.dv);
    let j = fx.add(j0, c0);
    let rows = paged_rows(fx, &p.k, (pk, kt), first.koff, j);
    let heads = head_group(fx, grp.heads, [qs, ks, tile_floats]);
    let overwrite = fx.b.ins().iconst(types::I32, 0);
    fx.call(abi::GEMV_NT_PAGED_HEADS, &[rc, cc, p.d, qrow, p.lda, rows, heads, srow, p.bn, p.alpha, overwrite]);
    let zero = fx.i64(0);
    fx.for_range(zero, grp.heads, |fx, x| {
        let it = grp.item(fx, p, x);
        let tile = tile_of(p, &it, j0, cols);
        variants(fx, p, &it, &tile, &|fx, tile| weights(fx, p, &it, tile, (r0, rc), (c0, cc), masked));
    });
    let rows = paged_rows(fx, &p.v, (pv, vt), first.voff, j);
    let heads = head_group(fx, grp.heads, [tile_floats, vs, acc_floats]);
    let one = fx.f32(1.0);
    let accumulate = fx.b.ins().iconst(types::I32, 1);
    fx.call(abi::GEMV_NN_PAGED_HEADS, &[rc, p.c.dv, cc, srow, p.bn, rows, heads, arow, p.c.dv, one, accumulate]);
}

/// A span's first query row, its scores (row `r0`, column `c0` of the item's tile) and its
/// accumulator row.
fn span_rows(fx: &mut StepBuilder, p: &Prologue, it: &Item, r0: Value, c0: Value) -> [Value; 3] {
    let qoff = fx.mul(r0, p.lda);
    let qrow = fx.elem_addr(it.qp, qoff);
    let soff = fx.mul(r0, p.bn);
    let soff = fx.add(soff, c0);
    let srow = fx.elem_addr(it.scratch.tile, soff);
    let aoff = fx.mul(r0, p.c.dv);
    let arow = fx.elem_addr(it.scratch.acc, aoff);
    [qrow, srow, arow]
}

/// Fills a `kernels::HeadGroup` on the stack (`heads`, and the element strides from head to
/// head of `A`, of `B` inside a page, and of `C`) and returns its address.
fn head_group(fx: &mut StepBuilder, heads: Value, strides: [Value; 3]) -> Value {
    let slot = fx.b.create_sized_stack_slot(StackSlotData::new(StackSlotKind::ExplicitSlot, 32, 3));
    for (k, v) in std::iter::once(heads).chain(strides).enumerate() {
        fx.b.ins().stack_store(types::I64, v, slot, 8 * k as i32);
    }
    fx.b.ins().stack_addr(types::I64, slot, 0)
}

/// Decodes the item of split `sp` and (batch index, query block) pair `t`, hoists its
/// item-level score parts and checks the separable split.
fn item(fx: &mut StepBuilder, p: &Prologue, (sp, t): (Value, Value), scratch: Scratch) -> Item {
    let (f, r) = (p.f, p.f.spec.rank);
    let block = query_block(fx, &p.c, t);
    let zero = fx.i64(0);
    let qoff = fx.dot(zero, &block.bidx, &p.q.batch);
    let qrow = fx.mul(block.i0, p.q.row);
    let qoff = fx.add(qoff, qrow);
    let qp = fx.elem_addr(p.q.base, qoff);
    let wp = p.weight.as_ref().map(|(base, bs)| {
        let off = fx.dot(zero, &block.bidx, bs);
        fx.elem_addr(*base, off)
    });
    let koff = fx.dot(zero, &block.bidx, &p.k.batch);
    let voff = fx.dot(zero, &block.bidx, &p.v.batch);
    let kstart = fx.mul(sp, p.kps);
    let kend = fx.add(kstart, p.kps);
    let kend = fx.min(kend, p.n);
    let b_pos: Vec<Value> = block.bidx.iter().map(|x| fx.b.ins().ireduce(types::I32, *x)).collect();
    let mut exprs: Vec<&ScoreExpr> = std::iter::once(&f.analysis.score).chain(f.spec.mask.as_ref()).collect();
    exprs.extend(f.analysis.separated.as_ref().map(|(x, _)| &x.sep));
    let hoisted = score::hoist_item(fx, &exprs, r, &b_pos, &p.dims, &p.extras);
    let sep_ok = separable_ok(fx, p, &block, &b_pos, &hoisted);
    // The factor `c` of a score `c · s` (1 for `s`), for the whole work item.
    let factor_of = |fx: &mut StepBuilder, staged: &attn_compiler::schedule::StagedScore| {
        staged.factor.as_ref().map(|c| match c {
            Some(c) => {
                let env = Env { s: None, pos: &b_pos, dims: &p.dims, extras: &p.extras, hoisted: &hoisted };
                let t = score::eval(fx, c, &env);
                fx.cvt_f(t)
            }
            None => fx.f32(1.0),
        })
    };
    let factor = factor_of(fx, &f.analysis.staged);
    let rest_factor = f.analysis.separated.as_ref().and_then(|(_, rest)| factor_of(fx, rest));
    let trow = |fx: &mut StepBuilder, pg: &Option<Pages>| {
        pg.as_ref().map(|pg| {
            let r = fx.mul(block.bidx[pg.axis], pg.rs);
            fx.elem_addr(pg.table, r)
        })
    };
    let (k_trow, v_trow) = (trow(fx, &p.k_pages), trow(fx, &p.v_pages));
    Item { block, qp, wp, koff, voff, k_trow, v_trow, kstart, kend, b_pos, hoisted, sep_ok, factor, rest_factor, scratch }
}

/// Whether the separable split holds for every row of the block: `sep(i, i0)` finite for each
/// row `i` (then its row part is finite at `i` and at `i0`). False without a split.
fn separable_ok(fx: &mut StepBuilder, p: &Prologue, block: &QueryBlock, b_pos: &[Value], hoisted: &Hoisted) -> Value {
    let Some((x, _)) = &p.f.analysis.separated else { return fx.b.ins().iconst(types::I8, 0) };
    let yes = fx.b.ins().iconst(types::I8, 1);
    let ok = fx.var(types::I8, yes);
    let i0_32 = fx.b.ins().ireduce(types::I32, block.i0);
    let zero = fx.i64(0);
    fx.for_range(zero, block.rows, |fx, rr| {
        let i = fx.add(block.i0, rr);
        let mut pos = b_pos.to_vec();
        pos.extend([fx.b.ins().ireduce(types::I32, i), i0_32]);
        let env = Env { s: None, pos: &pos, dims: &p.dims, extras: &p.extras, hoisted };
        let t = score::eval(fx, &x.sep, &env);
        let t = fx.cvt_f(t);
        fx.and_finite(ok, t);
    });
    fx.b.use_var(ok)
}

/// Key tile `kbi` of a work item: its first key, its keys, its tile-table entry's address and
/// its class (0 skip, 1 full, 2 partial).
fn tile_class(fx: &mut StepBuilder, p: &Prologue, it: &Item, kbi: Value) -> (Value, Value, Value, Value) {
    let j0 = fx.mul(kbi, p.bn);
    let kleft = fx.sub(it.kend, j0);
    let cols = fx.min(p.bn, kleft);
    // The item's table (per batch index where the mask's data differs per batch index).
    let table = fx.b.ins().udiv(it.block.bflat, p.tile_div);
    let tix = fx.mul(table, p.c.nqb);
    let tix = fx.add(tix, it.block.qblk);
    let tix = fx.mul(tix, p.nkb);
    let tix = fx.add(tix, kbi);
    let tix = fx.mul(tix, p.entry_bytes);
    let taddr = fx.add(p.tiles, tix);
    let class = fx.b.ins().uload8(types::I32, MemFlagsData::trusted(), taddr, 0);
    (j0, cols, taddr, class)
}

/// The key tile `kbi` of a work item, unless the tile table skips it.
fn key_tile(fx: &mut StepBuilder, p: &Prologue, it: &Item, kbi: Value) {
    let (j0, cols, taddr, class) = tile_class(fx, p, it, kbi);
    let run = fx.b.ins().icmp_imm_s(IntCC::NotEqual, class, 0);
    fx.if_then(run, |fx| {
        let krow = fx.mul(j0, p.k.row);
        let kk = fx.add(it.koff, krow);
        let kp = fx.elem_addr(p.k.base, kk);
        let vrow = fx.mul(j0, p.v.row);
        let vv = fx.add(it.voff, vrow);
        let vp = fx.elem_addr(p.v.base, vv);
        let partial = fx.b.ins().icmp_imm_s(IntCC::Equal, class, 2);
        let tile = tile_of(p, it, j0, cols);
        let (kp, vp, ldk, ldv, gathered) = tile_operands(fx, p, it, (j0, cols), (kp, vp));
        let at = TileAt { kp, vp, ldk, ldv, gathered };
        variants(fx, p, it, &tile, &|fx, tile| {
            spans(fx, p, it.block.rows, tile.cols, (partial, taddr), &|fx, r, k, masked| span(fx, p, it, tile, &at, r, k, masked));
        });
    });
}

/// The tile of keys `j0..j0 + cols` of a work item, with the op's (staged) score.
fn tile_of<'t>(p: &'t Prologue, it: &'t Item, j0: Value, cols: Value) -> Tile<'t> {
    let a = &p.f.analysis;
    Tile {
        f: p.f,
        score: &a.staged.expr,
        tanh: a.staged.tanh,
        factor: it.factor,
        bias: None,
        s_tile: it.scratch.tile,
        bn: p.bn,
        cols,
        j0,
        i0: it.block.i0,
        b_pos: &it.b_pos,
        dims: &p.dims,
        extras: &p.extras,
        lane_iota: p.lane_iota,
        item: &it.hoisted,
    }
}

/// Runs `body` on the tile as the item evaluates it: with a separated score, the rest and the
/// key-position vector (computed into scratch) where the item's split holds, else the whole.
fn variants(fx: &mut StepBuilder, p: &Prologue, it: &Item, tile: &Tile, body: &dyn Fn(&mut StepBuilder, &Tile)) {
    let a = &p.f.analysis;
    match &a.separated {
        Some((x, rest)) => fx.if_else(
            it.sep_ok,
            |fx| {
                let bias = a.key_bias.then(|| {
                    tile.key_bias(fx, &x.sep, it.scratch.bias);
                    it.scratch.bias
                });
                let rest_tile = Tile { score: &rest.expr, tanh: rest.tanh, factor: it.rest_factor, bias, ..*tile };
                body(fx, &rest_tile);
            },
            |fx| body(fx, tile),
        ),
        None => body(fx, tile),
    }
}

/// The tile's K and V rows for the products, from its rows in place `(kp, vp)`: `(kp, vp, ldk,
/// ldv, gathered)` ([`TileAt`]'s). In place unless paged; a paged K or V is gathered into a dense
/// tile of the thread's scratch (one copy per run of rows in a page), shared by every row of
/// the block, when the block has more than [`FEW_ROWS`] rows or the scores are additive; else the
/// paged few-rows products read it through the table (`gathered` zero).
fn tile_operands(
    fx: &mut StepBuilder,
    p: &Prologue,
    it: &Item,
    (j0, cols): (Value, Value),
    (mut kp, mut vp): (Value, Value),
) -> (Value, Value, Value, Value, Value) {
    let (mut ldk, mut ldv) = (p.ldk, p.ldv);
    if !p.f.paged() {
        let no = fx.b.ins().iconst(types::I8, 0);
        return (kp, vp, ldk, ldv, no);
    }
    let gathered = match it.wp {
        Some(_) => fx.b.ins().iconst(types::I8, 1),
        None => fx.b.ins().icmp_imm_s(IntCC::SignedGreaterThan, it.block.rows, FEW_ROWS),
    };
    let base = fx.scratch();
    let off = fx.tuning(p.f.step, Tuning::ScratchKv);
    let kbuf = fx.add(base, off);
    let kfloats = fx.mul(p.bn, p.d);
    let vbuf = fx.elem_addr(kbuf, kfloats);
    for (op, pages, trow, buf, width, which) in
        [(&p.k, &p.k_pages, it.k_trow, kbuf, p.d, 'k'), (&p.v, &p.v_pages, it.v_trow, vbuf, p.c.dv, 'v')]
    {
        let (Some(pg), Some(trow)) = (pages, trow) else { continue };
        let boff = if which == 'k' { it.koff } else { it.voff };
        fx.if_then(gathered, |fx| {
            runs(fx, op, (pg, trow), (boff, j0, cols), &mut |fx, c, n, src| {
                let o = fx.mul(c, width);
                let dst = fx.elem_addr(buf, o);
                fx.call(abi::COPY_ROWS, &[src, op.row, n, width, dst, width]);
            });
        });
        let (ptr, ld) = if which == 'k' { (&mut kp, &mut ldk) } else { (&mut vp, &mut ldv) };
        *ptr = fx.b.ins().select(gathered, buf, *ptr);
        *ld = fx.b.ins().select(gathered, width, *ld);
    }
    (kp, vp, ldk, ldv, gathered)
}

/// Where a running key tile is: its class, its tile-table entry and its first K and V rows.
struct TileAt {
    kp: Value,
    vp: Value,
    /// Row strides at `kp` and `vp`.
    ldk: Value,
    ldv: Value,
    /// Non-zero when a paged K and V were gathered into dense tiles at `kp`/`vp` (blocks of more
    /// than [`FEW_ROWS`] rows, or additive scores); zero when the paged few-rows products read
    /// them through the table.
    gathered: Value,
}

/// A tile's spans of rows and keys: `body((r0, rc), (c0, cc), masked)` for rows `r0..r0 + rc`
/// of the `rows` against keys `c0..c0 + cc` of the `cols`. Partial tiles (`at`: whether it is,
/// and its tile-table entry) run in chunks of `CHUNK_ROWS` rows, each against only the span of
/// keys its rows can keep: a diagonal tile does about half the work of a full one, a window's
/// edge tiles only their band.
type SpanBody<'b> = dyn Fn(&mut StepBuilder, (Value, Value), (Value, Value), bool) + 'b;

fn spans(fx: &mut StepBuilder, p: &Prologue, rows: Value, cols: Value, (partial, taddr): (Value, Value), body: &SpanBody) {
    let zero = fx.i64(0);
    if p.f.spec.mask.is_none() {
        return body(fx, (zero, rows), (zero, cols), false);
    }
    fx.if_else(
        partial,
        |fx| {
            let chunk_rows = fx.i64(CHUNK_ROWS as i64);
            let chunks = fx.ceil_div(rows, chunk_rows);
            fx.for_range(zero, chunks, |fx, ch| {
                let r0 = fx.mul(ch, chunk_rows);
                let left = fx.sub(rows, r0);
                let rc = fx.min(chunk_rows, left);
                let two = fx.b.ins().ishl_imm_s(ch, 1);
                let e = fx.add(taddr, two);
                let lo = fx.b.ins().uload8(types::I64, MemFlagsData::trusted(), e, 1);
                let hi = fx.b.ins().uload8(types::I64, MemFlagsData::trusted(), e, 2);
                let c0 = fx.b.ins().imul_imm_s(lo, CHUNK_COLS);
                let c1 = fx.b.ins().imul_imm_s(hi, CHUNK_COLS);
                let c1 = fx.min(c1, cols);
                let cc = fx.sub(c1, c0);
                let any = fx.b.ins().icmp_imm_s(IntCC::SignedGreaterThan, cc, 0);
                fx.if_then(any, |fx| body(fx, (r0, rc), (c0, cc), true));
            });
        },
        |fx| body(fx, (zero, rows), (zero, cols), false),
    );
}

/// Rows `r0..r0 + rc` against the tile's keys `c0..c0 + cc`: Q·Kᵀ, the weights (the mask
/// tested when `masked`), P·V. Blocks of at most [`FEW_ROWS`] rows use the few-rows products.
#[allow(clippy::too_many_arguments)]
fn span(
    fx: &mut StepBuilder,
    p: &Prologue,
    it: &Item,
    tile: &Tile,
    at: &TileAt,
    (r0, rc): (Value, Value),
    (c0, cc): (Value, Value),
    masked: bool,
) {
    let few = fx.b.ins().icmp_imm_s(IntCC::SignedLessThanOrEqual, rc, FEW_ROWS);
    let [qrow, srow, arow] = span_rows(fx, p, it, r0, c0);
    let products = |fx: &mut StepBuilder, small: abi::Import, big: abi::Import, args: &[Value]| {
        fx.if_else(
            few,
            |fx| {
                fx.call(small, args);
            },
            |fx| {
                fx.call(big, args);
            },
        );
    };
    let overwrite = fx.b.ins().iconst(types::I32, 0);
    let accumulate = fx.b.ins().iconst(types::I32, 1);
    let one = fx.f32(1.0);
    // The span's keys: in place or gathered (dense rows at `at.kp`, `at.ldk` apart), or, for a
    // paged K or V not gathered, through the table by the paged few-rows products.
    let j = fx.add(tile.j0, c0);
    let scores = |fx: &mut StepBuilder| {
        let o = fx.mul(c0, at.ldk);
        let kp = fx.elem_addr(at.kp, o);
        match it.wp {
            // Additive scores: one kernel for any number of rows (the `tanh`s dominate).
            Some(wp) => {
                fx.call(abi::ADDITIVE_NT, &[rc, cc, p.d, qrow, p.lda, kp, at.ldk, srow, p.bn, p.alpha, wp]);
            }
            None => products(fx, abi::GEMV_NT, abi::SGEMM_NT, &[rc, cc, p.d, qrow, p.lda, kp, at.ldk, srow, p.bn, p.alpha, overwrite]),
        }
    };
    match p.k_pages.as_ref().zip(it.k_trow) {
        Some(pk) => fx.if_else(at.gathered, scores, |fx| {
            let rows = paged_rows(fx, &p.k, pk, it.koff, j);
            fx.call(abi::GEMV_NT_PAGED, &[rc, cc, p.d, qrow, p.lda, rows, srow, p.bn, p.alpha, overwrite]);
        }),
        None => scores(fx),
    }
    weights(fx, p, it, tile, (r0, rc), (c0, cc), masked);
    let values = |fx: &mut StepBuilder| {
        let o = fx.mul(c0, at.ldv);
        let vp = fx.elem_addr(at.vp, o);
        products(fx, abi::GEMV_NN, abi::SGEMM_NN, &[rc, p.c.dv, cc, srow, p.bn, vp, at.ldv, arow, p.c.dv, one, accumulate]);
    };
    match p.v_pages.as_ref().zip(it.v_trow) {
        Some(pv) => fx.if_else(at.gathered, values, |fx| {
            let rows = paged_rows(fx, &p.v, pv, it.voff, j);
            fx.call(abi::GEMV_NN_PAGED, &[rc, p.c.dv, cc, srow, p.bn, rows, arow, p.c.dv, one, accumulate]);
        }),
        None => values(fx),
    }
}

/// The weights of rows `r0..r0 + rc` against the tile's keys `c0..c0 + cc` in place of their
/// scores (the mask tested when `masked`), the running state updated, dropout applied.
fn weights(fx: &mut StepBuilder, p: &Prologue, it: &Item, tile: &Tile, (r0, rc): (Value, Value), (c0, cc): (Value, Value), masked: bool) {
    // The span as a tile of its own: keys from `j0 + c0`, scores from column `c0`.
    let t = Tile {
        cols: cc,
        j0: fx.add(tile.j0, c0),
        s_tile: fx.elem_addr(tile.s_tile, c0),
        bias: tile.bias.map(|b| fx.elem_addr(b, c0)),
        ..*tile
    };
    let state = Running { max: it.scratch.max, sum: it.scratch.sum, acc: it.scratch.acc, dv: p.c.dv };
    let softmax = p.f.spec.weights == Weights::Softmax;
    let r1 = fx.add(r0, rc);
    fx.for_range(r0, r1, |fx, rr| {
        if softmax {
            t.softmax_row(fx, rr, masked, &state);
        } else {
            t.sigmoid(fx, rr, masked);
        }
    });
    if let Some([seed, threshold, scale]) = p.dropout {
        let i = fx.add(it.block.i0, r0);
        let j = fx.add(tile.j0, c0);
        let batch = flat_batch(fx, &it.block.bidx, &p.c.bdims);
        let rows_are_queries = fx.b.ins().iconst(types::I32, 0);
        let row = fx.mul(r0, p.bn);
        let row = fx.add(row, c0);
        let srow = fx.elem_addr(tile.s_tile, row);
        fx.call(abi::DROPOUT_TILE, &[srow, p.bn, rc, cc, i, j, rows_are_queries, seed, batch, threshold, scale]);
    }
}

/// The work item's results: its rows divided by their sums (rows with no kept key give 0), or,
/// when keys are split, its partial state (`max, sum, acc`) for the merge step.
fn finish(fx: &mut StepBuilder, p: &Prologue, it: &Item, w: Value) {
    let (c, rows, zero) = (&p.c, it.block.rows, fx.i64(0));
    let softmax = p.f.spec.weights == Weights::Softmax;
    let single = fx.b.ins().icmp_imm_s(IntCC::Equal, c.splits, 1);
    fx.if_else(
        single,
        |fx| {
            let ooff = fx.dot(zero, &it.block.bidx, &c.out_bs);
            fx.for_range(zero, rows, |fx, rr| {
                let i = fx.add(it.block.i0, rr);
                let orow = fx.mul(i, c.out_rs);
                let orow = fx.add(ooff, orow);
                let op = fx.elem_addr(c.out, orow);
                let arow = fx.mul(rr, c.dv);
                let ap = fx.elem_addr(it.scratch.acc, arow);
                let lsum = ld(fx, it.scratch.sum, rr);
                write_row(fx, ap, op, c.dv, if softmax { Some(lsum) } else { None }, p.f.out.dtype);
                if softmax && c.lse.is_some() {
                    let lmax = ld(fx, it.scratch.max, rr);
                    let shift = row_shift(fx, p, it, i);
                    let lmax = fx.b.ins().fadd(lmax, shift);
                    store_lse(fx, c, &it.block.bidx, i, lmax, lsum);
                }
            });
        },
        |fx| {
            fx.for_range(zero, rows, |fx, rr| {
                let pr = partial_row(fx, c, w, rr);
                let mx = ld(fx, it.scratch.max, rr);
                // The log-sum-exp needs the row's true shift; the merge's weights do not mind
                // a shift shared by every split of the row.
                let mx = if softmax && c.lse.is_some() {
                    let i = fx.add(it.block.i0, rr);
                    let shift = row_shift(fx, p, it, i);
                    fx.b.ins().fadd(mx, shift)
                } else {
                    mx
                };
                let sm = ld(fx, it.scratch.sum, rr);
                fx.store(mx, pr);
                let one_e = fx.i64(1);
                st(fx, sm, pr, one_e);
                let two = fx.i64(2);
                let dst = fx.elem_addr(pr, two);
                let arow = fx.mul(rr, c.dv);
                let ap = fx.elem_addr(it.scratch.acc, arow);
                fx.rows(c.dv, &[ap, dst], &|fx, _, ptr| {
                    let x = ldp(fx, ptr[0]);
                    stp(fx, x, ptr[1]);
                });
            });
        },
    );
}

/// What the running max of row `i` lacks of the row's true scores: with a separated score
/// (`rest + sep`), the rows are computed as `rest + sep(i0, j)` (`i0` the block's first row), or
/// as `rest` alone when `sep` depends on the row only, so the true scores are higher by
/// `sep(i, j) - sep(i0, j)` (or `sep(i, j)`), the same for every key. 0 otherwise.
fn row_shift(fx: &mut StepBuilder, p: &Prologue, it: &Item, i: Value) -> Value {
    let a = &p.f.analysis;
    let Some((x, _)) = &a.separated else { return fx.f32(0.0) };
    let i0_32 = fx.b.ins().ireduce(types::I32, it.block.i0);
    let i32v = fx.b.ins().ireduce(types::I32, i);
    // Any key position does: `i0` is where `sep_ok` checked the row part finite.
    let at = |fx: &mut StepBuilder, row: Value| {
        let mut pos = it.b_pos.clone();
        pos.extend([row, i0_32]);
        let env = Env { s: None, pos: &pos, dims: &p.dims, extras: &p.extras, hoisted: &it.hoisted };
        let t = score::eval(fx, &x.sep, &env);
        fx.cvt_f(t)
    };
    let here = at(fx, i32v);
    let shift = if a.key_bias {
        let base = at(fx, i0_32);
        fx.b.ins().fsub(here, base)
    } else {
        here
    };
    let zero = fx.f32(0.0);
    fx.b.ins().select(it.sep_ok, shift, zero)
}

/// `dst[c] = src[c] / sum` (or `src[c]` when `sum` is `None`), 0 where `sum` is 0, rounded to
/// `dtype`.
fn write_row(fx: &mut StepBuilder, src: Value, dst: Value, n: Value, sum: Option<Value>, dtype: DType) {
    fx.rows(n, &[src, dst], &|fx, _, p| {
        let x = ldp(fx, p[0]);
        let y = match sum {
            Some(s) => {
                let s = fx.splat(Class::Float, s);
                let q = fx.b.ins().fdiv(x, s);
                let z = fx.fconst(0.0);
                let empty = fx.b.ins().fcmp(FloatCC::Equal, s, z);
                fx.select_raw(empty, z, q)
            }
            None => x,
        };
        let y = fx.round_to(Typed { v: y, k: Class::Float }, dtype).v;
        stp(fx, y, p[1]);
    });
}

/// One Q·Kᵀ tile in scratch, and what its expressions need.
#[derive(Clone, Copy)]
struct Tile<'t> {
    f: &'t FlashKernel,
    /// The score expression the rows evaluate: the op's, or the rest of a separated one (with
    /// `tanh(s)` read as `s` when `tanh`).
    score: &'t ScoreExpr,
    /// Whether rows get `s = tanh(s)` by the kernel before `score` is evaluated.
    tanh: bool,
    /// `c` when `score` is `c · s` or `s` (1): the softmax kernel then reads unmasked rows as
    /// they are and applies `c` itself.
    factor: Option<Value>,
    /// The tile's key-position vector `sep(i0, j)` (separated scores only), added to `score`.
    bias: Option<Value>,
    s_tile: Value,
    bn: Value,
    cols: Value,
    j0: Value,
    i0: Value,
    b_pos: &'t [Value],
    /// Score and mask parts computed once per work item.
    item: &'t Hoisted,
    dims: &'t HashMap<Dim, Value>,
    extras: &'t [Extra],
    lane_iota: Value,
}

/// A row's running softmax state in scratch.
struct Running {
    max: Value,
    sum: Value,
    acc: Value,
    dv: Value,
}

impl Tile<'_> {
    /// `bias[c] = sep(i0, j0 + c)` for the tile's columns.
    fn key_bias(&self, fx: &mut StepBuilder, sep: &ScoreExpr, bias: Value) {
        fx.rows(self.cols, &[bias], &|fx, c, p| {
            let mut pos: Vec<Value> = self.b_pos.iter().map(|b| fx.splat(Class::Int, *b)).collect();
            let i = fx.b.ins().ireduce(types::I32, self.i0);
            pos.push(fx.splat(Class::Int, i));
            pos.push(self.key_pos(fx, c));
            let env = Env { s: None, pos: &pos, dims: self.dims, extras: self.extras, hoisted: self.item };
            let x = score::eval(fx, sep, &env);
            let x = fx.cvt_f(x);
            stp(fx, x, p[0]);
        });
    }

    /// The key position(s) `j0 + c` (one per lane), i32.
    fn key_pos(&self, fx: &mut StepBuilder, c: Value) -> Value {
        let j = fx.add(self.j0, c);
        let j = fx.b.ins().ireduce(types::I32, j);
        let j = fx.splat(Class::Int, j);
        if fx.lanes > 1 { fx.b.ins().iadd(j, self.lane_iota) } else { j }
    }

    /// Row `rr`: the score modification and, when `masked`, the mask applied in place (unmasked
    /// scores that are `s` or `c · s` are read as they are, the factor and the key bias applied
    /// by the kernel), then one online-softmax step by the kernel, and the accumulator row
    /// rescaled if its shift moved.
    fn softmax_row(&self, fx: &mut StepBuilder, rr: Value, masked: bool, st: &Running) {
        let row = self.row(fx, rr);
        self.stage(fx, row);
        let (factor, bias) = match self.factor {
            Some(factor) if !masked => (factor, self.bias.unwrap_or_else(|| fx.i64(0))),
            _ => {
                self.modify(fx, rr, masked);
                (fx.f32(1.0), fx.i64(0))
            }
        };
        let maxp = fx.elem_addr(st.max, rr);
        let sump = fx.elem_addr(st.sum, rr);
        let scale = fx.call(abi::SOFTMAX_STEP, &[row, factor, bias, row, self.cols, maxp, sump])[0];
        let one = fx.f32(1.0);
        let rescale = fx.b.ins().fcmp(FloatCC::NotEqual, scale, one);
        fx.if_then(rescale, |fx| {
            let off = fx.mul(rr, st.dv);
            let arow = fx.elem_addr(st.acc, off);
            fx.rows(st.dv, &[arow], &|fx, _, p| {
                let x = ldp(fx, p[0]);
                let s = fx.splat(Class::Float, scale);
                let y = fx.b.ins().fmul(x, s);
                stp(fx, y, p[0]);
            });
        });
    }

    /// The row-wide kernels the expression was staged with (`tanh`), in place on `row`.
    fn stage(&self, fx: &mut StepBuilder, row: Value) {
        if self.tanh {
            fx.call(abi::TANH, &[row, row, self.cols]);
        }
    }

    /// Row `rr`'s modified scores in place (`-inf` where masked out when `masked`).
    fn modify(&self, fx: &mut StepBuilder, rr: Value, masked: bool) {
        let row = self.row(fx, rr);
        let hoisted = self.row_hoisted(fx, rr);
        fx.rows(self.cols, &[row], &|fx, c, p| {
            let s = ldp(fx, p[0]);
            let x = self.modified(fx, rr, c, s, masked, &hoisted);
            stp(fx, x, p[0]);
        });
    }

    /// The address of row `rr` of the tile.
    fn row(&self, fx: &mut StepBuilder, rr: Value) -> Value {
        let off = fx.mul(rr, self.bn);
        fx.elem_addr(self.s_tile, off)
    }

    /// The modified score of the element(s) at column `c`, `-inf` where masked out.
    /// The score and mask parts that depend on the row at most, computed for row `rr`.
    fn row_hoisted(&self, fx: &mut StepBuilder, rr: Value) -> Hoisted {
        let mut pos = self.b_pos.to_vec();
        let i = fx.add(self.i0, rr);
        pos.push(fx.b.ins().ireduce(types::I32, i));
        pos.push(fx.b.ins().iconst(types::I32, 0));
        let env = Env { s: None, pos: &pos, dims: self.dims, extras: self.extras, hoisted: self.item };
        let exprs: Vec<&ScoreExpr> = std::iter::once(self.score).chain(self.f.spec.mask.as_ref()).collect();
        let mut out = self.item.clone();
        score::hoist(fx, &exprs, self.f.q.shape.len(), Level::Row, &env, &mut out);
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn modified(&self, fx: &mut StepBuilder, rr: Value, c: Value, s: Value, masked: bool, hoisted: &Hoisted) -> Value {
        let mut pos: Vec<Value> = self.b_pos.iter().map(|b| fx.splat(Class::Int, *b)).collect();
        let i = fx.add(self.i0, rr);
        let i = fx.b.ins().ireduce(types::I32, i);
        pos.push(fx.splat(Class::Int, i));
        pos.push(self.key_pos(fx, c));
        let env = Env { s: Some(Typed { v: s, k: Class::Float }), pos: &pos, dims: self.dims, extras: self.extras, hoisted };
        let x = score::eval(fx, self.score, &env);
        let mut x = fx.cvt_f(x);
        if let Some(b) = self.bias {
            let bc = ld(fx, b, c);
            x = fx.b.ins().fadd(x, bc);
        }
        match (&self.f.spec.mask, masked) {
            (Some(m), true) => {
                let keep = score::eval(fx, m, &env);
                let keep = fx.cvt_b(keep);
                let ninf = fx.fconst(f32::NEG_INFINITY);
                fx.select_raw(keep, x, ninf)
            }
            _ => x,
        }
    }

    /// Sigmoid weights of row `rr` in place: `keep ? sigmoid(score) : 0`: the modified scores
    /// (`-inf` where masked out) by generated code, then the sigmoid by the row kernel.
    fn sigmoid(&self, fx: &mut StepBuilder, rr: Value, masked: bool) {
        let row = self.row(fx, rr);
        self.stage(fx, row);
        self.modify(fx, rr, masked);
        fx.call(abi::SIGMOID, &[row, row, self.cols]);
    }
}

/// Emits the merge of split-key partial states: one work item per (batch, query block).
pub fn emit_merge(fx: &mut StepBuilder, f: &FlashKernel) {
    let c = common(fx, f);
    let softmax = f.spec.weights == Weights::Softmax;
    let (lo, hi) = (fx.lo(), fx.hi());
    fx.for_range(lo, hi, |fx, w| {
        let QueryBlock { bidx, i0, rows, .. } = query_block(fx, &c, w);
        let zero = fx.i64(0);
        let ooff = fx.dot(zero, &bidx, &c.out_bs);
        // The partial states of item `w`'s splits: `w·splits + s`, or `s·T + w` split-major.
        let (first, end, step) = match split_major(f) {
            false => {
                let first = fx.mul(w, c.splits);
                (first, fx.add(first, c.splits), None)
            }
            true => (zero, c.splits, Some(query_items(fx, &c))),
        };
        let at = move |fx: &mut StepBuilder, p: Value| match step {
            Some(t) => {
                let x = fx.mul(p, t);
                fx.add(x, w)
            }
            None => p,
        };
        fx.for_range(zero, rows, |fx, rr| {
            let i = fx.add(i0, rr);
            let orow = fx.mul(i, c.out_rs);
            let orow = fx.add(ooff, orow);
            let op = fx.elem_addr(c.out, orow);
            fx.rows(c.dv, &[op], &|fx, _, p| {
                let z = fx.fconst(0.0);
                stp(fx, z, p[0]);
            });
            let ninf = fx.f32(f32::NEG_INFINITY);
            let gmax = fx.var(types::F32, ninf);
            if softmax {
                fx.for_range(first, end, |fx, p| {
                    let p = at(fx, p);
                    let pr = partial_row(fx, &c, p, rr);
                    let m = fx.load(types::F32, pr);
                    let g = fx.b.use_var(gmax);
                    let g = fx.b.ins().fmax(g, m);
                    fx.b.def_var(gmax, g);
                });
            }
            let g = fx.b.use_var(gmax);
            let fzero = fx.f32(0.0);
            let total = fx.var(types::F32, fzero);
            fx.for_range(first, end, |fx, p| {
                let p = at(fx, p);
                let pr = partial_row(fx, &c, p, rr);
                let wgt = if softmax {
                    let m = fx.load(types::F32, pr);
                    let dlt = fx.b.ins().fsub(m, g);
                    let e = fx.exp(dlt);
                    // Splits with no kept key (max -inf) weigh 0, also when every split is empty.
                    let ninf = fx.f32(f32::NEG_INFINITY);
                    let none = fx.feq(m, ninf);
                    let z = fx.f32(0.0);
                    let e = fx.b.ins().select(none, z, e);
                    let one_e = fx.i64(1);
                    let l = ld(fx, pr, one_e);
                    let t = fx.b.use_var(total);
                    let lw = fx.b.ins().fmul(l, e);
                    let t = fx.b.ins().fadd(t, lw);
                    fx.b.def_var(total, t);
                    e
                } else {
                    fx.f32(1.0)
                };
                let two = fx.i64(2);
                let src = fx.elem_addr(pr, two);
                fx.rows(c.dv, &[src, op], &|fx, _, p| {
                    let a = ldp(fx, p[0]);
                    let wv = fx.splat(Class::Float, wgt);
                    let o = ldp(fx, p[1]);
                    let y = fx.b.ins().fmul(a, wv);
                    let y = fx.b.ins().fadd(o, y);
                    stp(fx, y, p[1]);
                });
            });
            let t = fx.b.use_var(total);
            write_row(fx, op, op, c.dv, if softmax { Some(t) } else { None }, f.out.dtype);
            if softmax {
                store_lse(fx, &c, &bidx, i, g, t);
            }
        });
    });
}
