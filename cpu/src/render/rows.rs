//! Kernels that combine many elements: reductions, softmax (when not fused into flash), layer
//! and RMS norm. Sums accumulate in f64 like the reference interpreter; each work item walks
//! its row in a fixed order, so results do not depend on how items are spread over threads.

use super::builder::StepBuilder;
use super::ops::Typed;
use crate::abi;
use attn_compiler::ir::semantics::Class;
use attn_compiler::ir::{DType, ReduceOp, ScanOp};
use attn_compiler::schedule::{Fused, View};
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{InstBuilder, Value, types};
use cranelift_frontend::Variable;

/// Loads element `off` (i64 elements from `base`) of a buffer of `dtype` as f32 or i32.
fn load(fx: &mut StepBuilder, dtype: DType, base: Value, off: Value) -> Typed {
    let addr = fx.elem_addr(base, off);
    let k = if Class::of(dtype) == Class::Float { Class::Float } else { Class::Int };
    let ty = if k == Class::Float { types::F32 } else { types::I32 };
    Typed { v: fx.load(ty, addr), k }
}

/// Rounds `x` to `dtype` and stores it as element `off` of `base`.
fn store(fx: &mut StepBuilder, x: Typed, dtype: DType, base: Value, off: Value) {
    let x = fx.round_to(x, dtype);
    let v = if x.k == Class::Float { x.v } else { fx.cvt_i(x) };
    let addr = fx.elem_addr(base, off);
    fx.store(v, addr);
}

/// `out[w] = reduce(x[w, ...])` over `axes`, one output element per work item. Where the
/// innermost kept axis has a multiple of [`GROUP`] elements, aligned runs of that many items
/// walk the reduced axes together, one accumulator each: the same order per element (so the
/// same bits), but independent chains and shared addressing. A reduction over a leading axis
/// (`sum(x, axis = S)` of `[B, S, R]`) otherwise waits on one f64 add per element.
pub fn emit_reduce(fx: &mut StepBuilder, x: &View, op: ReduceOp, axes: &[usize], out: &View) {
    let rank = x.shape.len();
    let (xb, xs) = fx.view_base(x);
    let dims = fx.dims(&x.shape);
    let (ob, _) = fx.view_base(out);
    let kept: Vec<usize> = (0..rank).filter(|a| !axes.contains(a)).collect();
    let kept_dims: Vec<Value> = kept.iter().map(|a| dims[*a]).collect();
    let kept_strides: Vec<Value> = kept.iter().map(|a| xs[*a]).collect();
    let count = {
        let mut c = fx.i64(1);
        for a in axes {
            c = fx.mul(c, dims[*a]);
        }
        c
    };
    let r = Reduce { x, xb, xs: &xs, dims: &dims, axes, op, int: Class::of(x.dtype) == Class::Int, count, ob, out };
    let (lo, hi) = (fx.lo(), fx.hi());
    let items = |fx: &mut StepBuilder, from: Value, to: Value| {
        fx.for_range(from, to, |fx, w| {
            let idx = fx.unravel(w, &kept_dims);
            let zero = fx.i64(0);
            let base = fx.dot(zero, &idx, &kept_strides);
            r.items(fx, w, base, zero, 1);
        });
    };
    let (Some(&inner), Some(&step)) = (kept_dims.last(), kept_strides.last()) else {
        return items(fx, lo, hi);
    };
    in_groups(fx, inner, (lo, hi), &items, &|fx, w| {
        let idx = fx.unravel(w, &kept_dims);
        let zero = fx.i64(0);
        let base = fx.dot(zero, &idx, &kept_strides);
        r.items(fx, w, base, step, GROUP);
    });
}

/// `out = reduce(x)` over `axes` of an element-wise expression, each element computed as it is
/// read, walked over the reduced axes in the interpreter's order with one accumulator per output
/// (the same bits as storing the operand and reducing it). Where the last axis is kept, a work
/// item is a row of outputs along it and four neighbouring outputs' elements are one vector of
/// the expression (where its inputs allow); where it is reduced, a work item is one output and
/// four consecutive elements along it are one vector, combined lane by lane in order.
pub fn emit_reduce_of(fx: &mut StepBuilder, x: &Fused, op: ReduceOp, axes: &[usize], out: &View) {
    let e = super::elementwise::expression(fx, &x.shape, &x.inputs, &x.expr);
    let rank = x.shape.len();
    let sizes = e.sizes().to_vec();
    let Some(&inner) = sizes.last() else {
        fx.fail("a fused reduction of a scalar".to_string());
        return;
    };
    let items = Items::new(fx, &sizes, axes, x.dtype);
    if axes.contains(&(rank - 1)) {
        return reduce_of_along_last(fx, &e, &items, op, axes, out);
    }
    let (ob, _) = fx.view_base(out);
    let (int, count) = (items.int, items.count);
    let (lo, hi) = (fx.lo(), fx.hi());
    fx.for_range(lo, hi, |fx, w| {
        let (outer, rows) = items.first(fx, &e, w);
        let row_out = fx.mul(w, inner);
        along_last(fx, inner, e.vectorized(), &|fx, j, lanes| {
            let acc = Lanes::new(fx, op, int, lanes);
            walk(fx, &e, axes, &sizes, (&outer, &rows), &mut |fx, outer, rows| {
                let v = e.value(fx, outer, (j, lanes), rows);
                acc.add(fx, v.v);
            });
            for (l, a) in acc.results(fx).into_iter().enumerate() {
                let result = finish(fx, op, int, a, count);
                let o = fx.add(row_out, j);
                let o = fx.b.ins().iadd_imm_s(o, l as i64);
                store(fx, result, out.dtype, ob, o);
            }
        });
    });
}

/// `body(j, lanes)` over the last axis's `inner` indices: four lanes at a time while they fit
/// (when `vectorized`), then one.
fn along_last(fx: &mut StepBuilder, inner: Value, vectorized: bool, body: &dyn Fn(&mut StepBuilder, Value, u8)) {
    let mut start = fx.i64(0);
    if vectorized {
        let mask = fx.i64(-4);
        let end = fx.b.ins().band(inner, mask);
        fx.for_step(start, end, 4, |fx, j| body(fx, j, 4));
        start = end;
    }
    fx.for_range(start, inner, |fx, j| body(fx, j, 1));
}

/// The work items of a fused reduction: the kept axes before the last and their sizes, and
/// how many elements each output reduces.
struct Items {
    kept: Vec<usize>,
    kept_dims: Vec<Value>,
    sizes: Vec<Value>,
    count: Value,
    int: bool,
}

impl Items {
    fn new(fx: &mut StepBuilder, sizes: &[Value], axes: &[usize], dtype: DType) -> Items {
        let kept: Vec<usize> = (0..sizes.len().saturating_sub(1)).filter(|a| !axes.contains(a)).collect();
        let kept_dims = kept.iter().map(|a| sizes[*a]).collect();
        let mut count = fx.i64(1);
        for a in axes {
            count = fx.mul(count, sizes[*a]);
        }
        Items { kept, kept_dims, sizes: sizes.to_vec(), count, int: Class::of(dtype) == Class::Int }
    }

    /// Work item `w`'s first element: its outer index (the reduced axes at 0) and the inputs'
    /// rows there, which the walk moves along each reduced axis.
    fn first(&self, fx: &mut StepBuilder, e: &super::elementwise::Kernel, w: Value) -> (Vec<Value>, Vec<Option<Value>>) {
        let kept_idx = fx.unravel(w, &self.kept_dims);
        let zero = fx.i64(0);
        let mut outer = vec![zero; self.sizes.len().saturating_sub(1)];
        for (a, i) in self.kept.iter().zip(&kept_idx) {
            outer[*a] = *i;
        }
        let rows = e.rows(fx, &outer);
        (outer, rows)
    }
}

/// [`emit_reduce_of`] where the last axis is reduced: one output per work item.
fn reduce_of_along_last(fx: &mut StepBuilder, e: &super::elementwise::Kernel, items: &Items, op: ReduceOp, axes: &[usize], out: &View) {
    let sizes = &items.sizes;
    let rank = sizes.len();
    let inner = sizes[rank - 1];
    // The reduced axes before the last one, walked outside it.
    let outer_axes: Vec<usize> = axes.iter().copied().filter(|a| *a + 1 < rank).collect();
    let (ob, _) = fx.view_base(out);
    let (int, count) = (items.int, items.count);
    let vectorized = e.vectorized();
    let (lo, hi) = (fx.lo(), fx.hi());
    fx.for_range(lo, hi, |fx, w| {
        let (outer, rows) = items.first(fx, e, w);
        let (acc_ty, init) = accumulator(fx, op, int);
        let acc = fx.var(acc_ty, init);
        walk(fx, e, &outer_axes, sizes, (&outer, &rows), &mut |fx, outer, rows| {
            along_last(fx, inner, vectorized, &|fx, j, lanes| {
                let v = e.value(fx, outer, (j, lanes), rows);
                for l in 0..lanes {
                    let s = if lanes > 1 { fx.b.ins().extractlane(v.v, l) } else { v.v };
                    let a = fx.b.use_var(acc);
                    let r = combine(fx, op, int, a, s);
                    fx.b.def_var(acc, r);
                }
            });
        });
        let a = fx.b.use_var(acc);
        let result = finish(fx, op, int, a, count);
        store(fx, result, out.dtype, ob, w);
    });
}

/// The accumulators of `lanes` neighbouring outputs of a fused reduction. Float sums are two
/// f64x2 vectors (lanes 0–1 and 2–3 promoted), float max and min one f32x4: lane by lane the
/// same operations in the same order as one scalar accumulator per output. Integer reductions
/// (and single lanes) keep one scalar accumulator per lane.
enum Lanes {
    Sum(Variable, Variable),
    MaxMin(Variable, bool),
    Each(Vec<Variable>, ReduceOp, bool),
}

impl Lanes {
    fn new(fx: &mut StepBuilder, op: ReduceOp, int: bool, lanes: u8) -> Lanes {
        match (op, int, lanes) {
            (ReduceOp::Sum | ReduceOp::Mean, false, 4) => {
                let z = fx.f64(0.0);
                let z = fx.b.ins().splat(types::F64X2, z);
                Lanes::Sum(fx.var(types::F64X2, z), fx.var(types::F64X2, z))
            }
            (ReduceOp::Max | ReduceOp::Min, false, 4) => {
                let max = op == ReduceOp::Max;
                let init = fx.f32(if max { f32::NEG_INFINITY } else { f32::INFINITY });
                let init = fx.b.ins().splat(types::F32X4, init);
                Lanes::MaxMin(fx.var(types::F32X4, init), max)
            }
            _ => {
                let (ty, init) = accumulator(fx, op, int);
                Lanes::Each((0..lanes).map(|_| fx.var(ty, init)).collect(), op, int)
            }
        }
    }

    /// Adds the element(s) `v` (f32 or i32, `lanes` of them).
    fn add(&self, fx: &mut StepBuilder, v: Value) {
        match self {
            Lanes::Sum(lo, hi) => {
                // Lanes 2 and 3 moved down for the second promotion.
                let bytes: Vec<u8> = (8..16).chain(8..16).collect();
                let mask = fx.b.func.dfg.immediates.push(bytes.into());
                let flags = cranelift_codegen::ir::MemFlagsData::new().with_endianness(cranelift_codegen::ir::Endianness::Little);
                let b = fx.b.ins().bitcast(types::I8X16, flags, v);
                let b = fx.b.ins().shuffle(b, b, mask);
                let upper = fx.b.ins().bitcast(types::F32X4, flags, b);
                for (acc, x) in [(lo, v), (hi, upper)] {
                    let w = fx.b.ins().fvpromote_low(x);
                    let a = fx.b.use_var(*acc);
                    let r = fx.b.ins().fadd(a, w);
                    fx.b.def_var(*acc, r);
                }
            }
            Lanes::MaxMin(acc, max) => {
                let a = fx.b.use_var(*acc);
                let r = if *max { fx.b.ins().fmax(a, v) } else { fx.b.ins().fmin(a, v) };
                fx.b.def_var(*acc, r);
            }
            Lanes::Each(accs, op, int) => {
                for (l, acc) in accs.iter().enumerate() {
                    let s = if accs.len() > 1 { fx.b.ins().extractlane(v, l as u8) } else { v };
                    let a = fx.b.use_var(*acc);
                    let r = combine(fx, *op, *int, a, s);
                    fx.b.def_var(*acc, r);
                }
            }
        }
    }

    /// Each lane's accumulator, in the scalar form [`finish`] takes.
    fn results(&self, fx: &mut StepBuilder) -> Vec<Value> {
        match self {
            Lanes::Sum(lo, hi) => {
                let (lo, hi) = (fx.b.use_var(*lo), fx.b.use_var(*hi));
                (0..4u8).map(|l| fx.b.ins().extractlane(if l < 2 { lo } else { hi }, l % 2)).collect()
            }
            Lanes::MaxMin(acc, _) => {
                let a = fx.b.use_var(*acc);
                (0..4u8).map(|l| fx.b.ins().extractlane(a, l)).collect()
            }
            Lanes::Each(accs, ..) => accs.iter().map(|a| fx.b.use_var(*a)).collect(),
        }
    }
}

/// What a fused reduction does per element: given its outer index and the inputs' row
/// addresses there.
type ElementFn<'a> = dyn FnMut(&mut StepBuilder, &[Value], &[Option<Value>]) + 'a;

/// Nested loops over the reduced `axes` (in order), calling `body` with the outer index and the
/// inputs' row addresses of each element.
fn walk(
    fx: &mut StepBuilder,
    e: &super::elementwise::Kernel,
    axes: &[usize],
    sizes: &[Value],
    (outer, rows): (&[Value], &[Option<Value>]),
    body: &mut ElementFn,
) {
    match axes.split_first() {
        None => body(fx, outer, rows),
        Some((a, rest)) => {
            let zero = fx.i64(0);
            fx.for_range(zero, sizes[*a], |fx, i| {
                let moved = e.rows_along(fx, rows, *a, i);
                let mut outer = outer.to_vec();
                outer[*a] = i;
                walk(fx, e, rest, sizes, (&outer, &moved), body);
            });
        }
    }
}

/// The accumulator type and initial value of a reduction.
fn accumulator(fx: &mut StepBuilder, op: ReduceOp, int: bool) -> (types::Type, Value) {
    match (op, int) {
        (ReduceOp::Sum | ReduceOp::Mean, false) => (types::F64, fx.f64(0.0)),
        (ReduceOp::Sum | ReduceOp::Mean, true) => (types::I64, fx.i64(0)),
        // A log-sum-exp never reaches a kernel (the schedule expands it into max, exp, sum, log).
        (ReduceOp::Max | ReduceOp::LogSumExp, false) => (types::F32, fx.f32(f32::NEG_INFINITY)),
        (ReduceOp::Min, false) => (types::F32, fx.f32(f32::INFINITY)),
        (ReduceOp::Max | ReduceOp::LogSumExp, true) => (types::I32, fx.b.ins().iconst(types::I32, i64::from(i32::MIN))),
        (ReduceOp::Min, true) => (types::I32, fx.b.ins().iconst(types::I32, i64::from(i32::MAX))),
    }
}

/// The accumulator `a` combined with the element `v` (f32 or i32).
fn combine(fx: &mut StepBuilder, op: ReduceOp, int: bool, a: Value, v: Value) -> Value {
    match (op, int) {
        (ReduceOp::Sum | ReduceOp::Mean, false) => {
            let w = fx.b.ins().fpromote(types::F64, v);
            fx.b.ins().fadd(a, w)
        }
        (ReduceOp::Sum | ReduceOp::Mean, true) => {
            let w = fx.b.ins().sextend(types::I64, v);
            fx.b.ins().iadd(a, w)
        }
        (ReduceOp::Max | ReduceOp::LogSumExp, false) => fx.b.ins().fmax(a, v),
        (ReduceOp::Min, false) => fx.b.ins().fmin(a, v),
        (ReduceOp::Max | ReduceOp::LogSumExp, true) => fx.b.ins().smax(a, v),
        (ReduceOp::Min, true) => fx.b.ins().smin(a, v),
    }
}

/// The result of a reduction from its accumulator (`count` elements reduced).
fn finish(fx: &mut StepBuilder, op: ReduceOp, int: bool, a: Value, count: Value) -> Typed {
    match (op, int) {
        (ReduceOp::Sum, false) => Typed { v: fx.b.ins().fdemote(types::F32, a), k: Class::Float },
        // Integer sums wrap, like every integer op.
        (ReduceOp::Sum, true) => Typed { v: fx.b.ins().ireduce(types::I32, a), k: Class::Int },
        (ReduceOp::Mean, _) => {
            let s = if int { fx.b.ins().fcvt_from_sint(types::F64, a) } else { a };
            let n = fx.b.ins().fcvt_from_sint(types::F64, count);
            let m = fx.b.ins().fdiv(s, n);
            let zero = fx.f64(0.0);
            let empty = fx.b.ins().fcmp(FloatCC::Equal, n, zero);
            let m = fx.b.ins().select(empty, zero, m);
            Typed { v: fx.b.ins().fdemote(types::F32, m), k: Class::Float }
        }
        (_, false) => Typed { v: a, k: Class::Float },
        (_, true) => Typed { v: a, k: Class::Int },
    }
}

/// Work items `lo..hi`, where neighbours `w, w + 1, …` step along an axis of `inner` elements:
/// when `inner` is a multiple of [`GROUP`], the aligned groups inside the range by `group(w)`
/// (never across the axis's end) and the items before and after them by `single(from, to)`;
/// otherwise all by `single`.
fn in_groups(
    fx: &mut StepBuilder,
    inner: Value,
    (lo, hi): (Value, Value),
    single: &dyn Fn(&mut StepBuilder, Value, Value),
    group: &dyn Fn(&mut StepBuilder, Value),
) {
    let rem = fx.b.ins().band_imm_s(inner, GROUP as i64 - 1);
    let grouped = fx.b.ins().icmp_imm_s(IntCC::Equal, rem, 0);
    fx.if_else(
        grouped,
        |fx| {
            let up = fx.b.ins().iadd_imm_s(lo, GROUP as i64 - 1);
            let start = fx.b.ins().band_imm_s(up, -(GROUP as i64));
            let start = fx.min(start, hi);
            let end = fx.b.ins().band_imm_s(hi, -(GROUP as i64));
            let end = fx.max(end, start);
            single(fx, lo, start);
            fx.for_step(start, end, GROUP as i64, |fx, w| group(fx, w));
            single(fx, end, hi);
        },
        |fx| single(fx, lo, hi),
    );
}

/// Items a reduction's work runs together where it can (see [`emit_reduce`]).
const GROUP: usize = 4;

/// One reduction step's operands, for [`Reduce::items`].
struct Reduce<'a> {
    x: &'a View,
    xb: Value,
    xs: &'a [Value],
    dims: &'a [Value],
    axes: &'a [usize],
    op: ReduceOp,
    int: bool,
    count: Value,
    ob: Value,
    out: &'a View,
}

impl Reduce<'_> {
    /// Items `w .. w + n`, whose elements start at `base + l·step` for `l < n`.
    fn items(&self, fx: &mut StepBuilder, w: Value, base: Value, step: Value, n: usize) {
        let (op, int) = (self.op, self.int);
        let (acc_ty, init) = accumulator(fx, op, int);
        let accs: Vec<Variable> = (0..n).map(|_| fx.var(acc_ty, init)).collect();
        nest(fx, self.axes, self.dims, self.xs, base, &mut |fx, off| {
            let mut at = off;
            for (l, acc) in accs.iter().enumerate() {
                if l > 0 {
                    at = fx.add(at, step);
                }
                let v = load(fx, self.x.dtype, self.xb, at);
                let a = fx.b.use_var(*acc);
                let r = combine(fx, op, int, a, v.v);
                fx.b.def_var(*acc, r);
            }
        });
        for (l, acc) in accs.iter().enumerate() {
            let a = fx.b.use_var(*acc);
            let result = finish(fx, op, int, a, self.count);
            let o = fx.b.ins().iadd_imm_s(w, l as i64);
            store(fx, result, self.out.dtype, self.ob, o);
        }
    }
}

/// Nested loops over `axes` (in order), calling `body` with each element's offset.
fn nest(
    fx: &mut StepBuilder,
    axes: &[usize],
    dims: &[Value],
    strides: &[Value],
    base: Value,
    body: &mut dyn FnMut(&mut StepBuilder, Value),
) {
    match axes.split_first() {
        None => body(fx, base),
        Some((a, rest)) => {
            let zero = fx.i64(0);
            let (n, s) = (dims[*a], strides[*a]);
            fx.for_range(zero, n, |fx, i| {
                let t = fx.mul(i, s);
                let off = fx.add(base, t);
                nest(fx, rest, dims, strides, off, body);
            });
        }
    }
}

/// Offsets of the row a work item addresses: every axis but `axis`, for `x` and dense `out`.
fn row_offsets(fx: &mut StepBuilder, w: Value, axis: usize, dims: &[Value], xs: &[Value], os: &[Value]) -> (Value, Value) {
    let others: Vec<usize> = (0..dims.len()).filter(|a| *a != axis).collect();
    let od: Vec<Value> = others.iter().map(|a| dims[*a]).collect();
    let idx = fx.unravel(w, &od);
    let zero = fx.i64(0);
    let xo = fx.dot(zero, &idx, &others.iter().map(|a| xs[*a]).collect::<Vec<_>>());
    let oo = fx.dot(zero, &idx, &others.iter().map(|a| os[*a]).collect::<Vec<_>>());
    (xo, oo)
}

/// Softmax along `axis`, one row per work item; a row whose max is `-inf` gives zeros. Dense
/// f32 rows (the usual case) go to the row kernel; anything else runs [`softmax_loops`].
pub fn emit_softmax(fx: &mut StepBuilder, x: &View, axis: usize, out: &View) {
    let (xb, xs) = fx.view_base(x);
    let (ob, os) = fx.view_base(out);
    let dims = fx.dims(&x.shape);
    let (n, xstep, ostep) = (dims[axis], xs[axis], os[axis]);
    let dense = (x.dtype == DType::F32 && out.dtype == DType::F32).then(|| {
        let xd = fx.b.ins().icmp_imm_s(IntCC::Equal, xstep, 1);
        let od = fx.b.ins().icmp_imm_s(IntCC::Equal, ostep, 1);
        fx.b.ins().band(xd, od)
    });
    let (lo, hi) = (fx.lo(), fx.hi());
    fx.for_range(lo, hi, |fx, w| {
        let (xo, oo) = row_offsets(fx, w, axis, &dims, &xs, &os);
        let Some(dense) = dense else {
            return softmax_loops(fx, x, out, (xb, xo, xstep), (ob, oo, ostep), n);
        };
        fx.if_else(
            dense,
            |fx| {
                let xp = fx.elem_addr(xb, xo);
                let op = fx.elem_addr(ob, oo);
                fx.call(abi::SOFTMAX_ROW, &[xp, op, n]);
            },
            |fx| softmax_loops(fx, x, out, (xb, xo, xstep), (ob, oo, ostep), n),
        );
    });
}

/// One row of [`emit_softmax`] as scalar loops (any dtype, any strides), the sum in f64.
fn softmax_loops(
    fx: &mut StepBuilder,
    x: &View,
    out: &View,
    (xb, xo, xstep): (Value, Value, Value),
    (ob, oo, ostep): (Value, Value, Value),
    n: Value,
) {
    let zero = fx.i64(0);
    let ninf = fx.f32(f32::NEG_INFINITY);
    let max = fx.var(types::F32, ninf);
    let at = |fx: &mut StepBuilder, base: Value, step: Value, i: Value| {
        let t = fx.mul(i, step);
        fx.add(base, t)
    };
    fx.for_range(zero, n, |fx, i| {
        let off = at(fx, xo, xstep, i);
        let v = load(fx, x.dtype, xb, off);
        let v = fx.cvt_f(v);
        let m = fx.b.use_var(max);
        let m = fx.b.ins().fmax(m, v);
        fx.b.def_var(max, m);
    });
    let m = fx.b.use_var(max);
    let masked = fx.feq(m, ninf);
    fx.if_else(
        masked,
        |fx| {
            let z = fx.f32(0.0);
            fx.for_range(zero, n, |fx, i| {
                let off = at(fx, oo, ostep, i);
                store(fx, Typed { v: z, k: Class::Float }, out.dtype, ob, off);
            });
        },
        |fx| {
            let zero64 = fx.f64(0.0);
            let sum = fx.var(types::F64, zero64);
            fx.for_range(zero, n, |fx, i| {
                let off = at(fx, xo, xstep, i);
                let v = load(fx, x.dtype, xb, off);
                let v = fx.cvt_f(v);
                let d = fx.b.ins().fsub(v, m);
                let e = fx.exp(d);
                let ooff = at(fx, oo, ostep, i);
                let addr = fx.elem_addr(ob, ooff);
                fx.store(e, addr);
                let s = fx.b.use_var(sum);
                let e64 = fx.b.ins().fpromote(types::F64, e);
                let s = fx.b.ins().fadd(s, e64);
                fx.b.def_var(sum, s);
            });
            let s = fx.b.use_var(sum);
            let s32 = fx.b.ins().fdemote(types::F32, s);
            fx.for_range(zero, n, |fx, i| {
                let ooff = at(fx, oo, ostep, i);
                let addr = fx.elem_addr(ob, ooff);
                let e = fx.load(types::F32, addr);
                let p = fx.b.ins().fdiv(e, s32);
                store(fx, Typed { v: p, k: Class::Float }, out.dtype, ob, ooff);
            });
        },
    );
}

/// Layer norm (`beta` given) or RMS norm over the last axis, in f64, one row per work item.
pub fn emit_norm(fx: &mut StepBuilder, x: &View, gamma: &View, beta: Option<&View>, eps: f64, out: &View) {
    let rank = x.shape.len();
    let (xb, xs) = fx.view_base(x);
    let (ob, os) = fx.view_base(out);
    let (gb, gs) = fx.view_base(gamma);
    let bb = beta.map(|b| fx.view_base(b));
    let dims = fx.dims(&x.shape);
    let d = dims[rank - 1];
    let (xstep, ostep) = (xs[rank - 1], os[rank - 1]);
    let (lo, hi) = (fx.lo(), fx.hi());
    // Dense f32 rows (the usual case) go to the row kernel; anything else runs the loops below.
    let f32s = [Some(x), Some(gamma), beta, Some(out)].iter().flatten().all(|v| v.dtype == DType::F32);
    let dense = if f32s {
        let mut all = fx.b.ins().iconst(types::I8, 1);
        let steps = [Some(xstep), Some(ostep), Some(gs[0]), bb.as_ref().map(|(_, s)| s[0])];
        for s in steps.into_iter().flatten() {
            let one = fx.b.ins().icmp_imm_s(IntCC::Equal, s, 1);
            all = fx.b.ins().band(all, one);
        }
        Some(all)
    } else {
        None
    };
    let rms = fx.b.ins().iconst(types::I32, i64::from(beta.is_none()));
    fx.for_range(lo, hi, |fx, w| {
        let (xo, oo) = row_offsets(fx, w, rank - 1, &dims, &xs, &os);
        let zero = fx.i64(0);
        let Some(dense) = dense else {
            return norm_loops(fx, x, gamma, beta, eps, out, (xb, xo, xstep), (ob, oo, ostep), d, (gb, &gs), bb.as_ref());
        };
        fx.if_else(
            dense,
            |fx| {
                let xp = fx.elem_addr(xb, xo);
                let op = fx.elem_addr(ob, oo);
                let bp = bb.as_ref().map_or(zero, |(b, _)| *b);
                let e = fx.f64(eps);
                fx.call(abi::NORM_ROW, &[xp, gb, bp, op, d, e, rms]);
            },
            |fx| norm_loops(fx, x, gamma, beta, eps, out, (xb, xo, xstep), (ob, oo, ostep), d, (gb, &gs), bb.as_ref()),
        );
    });
}

/// One row of [`emit_norm`] as scalar f64 loops (any dtype, any strides).
#[allow(clippy::too_many_arguments)]
fn norm_loops(
    fx: &mut StepBuilder,
    x: &View,
    gamma: &View,
    beta: Option<&View>,
    eps: f64,
    out: &View,
    (xb, xo, xstep): (Value, Value, Value),
    (ob, oo, ostep): (Value, Value, Value),
    d: Value,
    (gb, gs): (Value, &[Value]),
    bb: Option<&(Value, Vec<Value>)>,
) {
    {
        let zero = fx.i64(0);
        let elem = |fx: &mut StepBuilder, i: Value| -> Value {
            let t = fx.mul(i, xstep);
            let off = fx.add(xo, t);
            let v = load(fx, x.dtype, xb, off);
            let v = fx.cvt_f(v);
            fx.b.ins().fpromote(types::F64, v)
        };
        let sum_of = |fx: &mut StepBuilder, f: &dyn Fn(&mut StepBuilder, Value) -> Value| -> Value {
            let z = fx.f64(0.0);
            let acc: Variable = fx.var(types::F64, z);
            fx.for_range(zero, d, |fx, i| {
                let v = f(fx, i);
                let a = fx.b.use_var(acc);
                let a = fx.b.ins().fadd(a, v);
                fx.b.def_var(acc, a);
            });
            fx.b.use_var(acc)
        };
        let n = fx.b.ins().fcvt_from_sint(types::F64, d);
        let mean = if beta.is_some() {
            let s = sum_of(fx, &|fx, i| elem(fx, i));
            fx.b.ins().fdiv(s, n)
        } else {
            fx.f64(0.0)
        };
        let var = sum_of(fx, &|fx, i| {
            let v = elem(fx, i);
            let c = fx.b.ins().fsub(v, mean);
            fx.b.ins().fmul(c, c)
        });
        let var = fx.b.ins().fdiv(var, n);
        let e = fx.f64(eps);
        let var = fx.b.ins().fadd(var, e);
        let denom = fx.b.ins().sqrt(var);
        fx.for_range(zero, d, |fx, i| {
            let v = elem(fx, i);
            let c = fx.b.ins().fsub(v, mean);
            let c = fx.b.ins().fdiv(c, denom);
            let goff = fx.mul(i, gs[0]);
            let g = load(fx, gamma.dtype, gb, goff);
            let g = fx.cvt_f(g);
            let g = fx.b.ins().fpromote(types::F64, g);
            let mut y = fx.b.ins().fmul(c, g);
            if let (Some(beta), Some((bb, bs))) = (beta, bb) {
                let boff = fx.mul(i, bs[0]);
                let bv = load(fx, beta.dtype, *bb, boff);
                let bv = fx.cvt_f(bv);
                let bv = fx.b.ins().fpromote(types::F64, bv);
                y = fx.b.ins().fadd(y, bv);
            }
            let y = fx.b.ins().fdemote(types::F32, y);
            let t = fx.mul(i, ostep);
            let ooff = fx.add(oo, t);
            store(fx, Typed { v: y, k: Class::Float }, out.dtype, ob, ooff);
        });
    }
}

/// `out = base`, then every `src` element added at its `idx` position along `axis`, in order,
/// each sum rounded to the element type; one row per work item. A position out of range is
/// recorded as a fault of `site` and skipped.
pub fn emit_scatter_add(fx: &mut StepBuilder, base: &View, idx: &View, src: &View, axis: usize, out: &View, site: usize) {
    let Some(record) = fx.schedule.fault else {
        fx.fail("a checked scatter_add without a fault record");
        return;
    };
    let check = super::ops::Checked { record, site };
    let (bb, bs) = fx.view_base(base);
    let (ib, is) = fx.view_base(idx);
    let (sb, ss) = fx.view_base(src);
    let (ob, os) = fx.view_base(out);
    let odims = fx.dims(&out.shape);
    let sdims = fx.dims(&src.shape);
    let (n, m) = (odims[axis], sdims[axis]);
    let (lo, hi) = (fx.lo(), fx.hi());
    fx.for_range(lo, hi, |fx, w| {
        let (bo, oo) = row_offsets(fx, w, axis, &odims, &bs, &os);
        let (io, so) = row_offsets(fx, w, axis, &odims, &is, &ss);
        let zero = fx.i64(0);
        fx.for_range(zero, n, |fx, i| {
            let t = fx.mul(i, bs[axis]);
            let off = fx.add(bo, t);
            let v = load(fx, base.dtype, bb, off);
            let t = fx.mul(i, os[axis]);
            let off = fx.add(oo, t);
            store(fx, v, out.dtype, ob, off);
        });
        fx.for_range(zero, m, |fx, j| {
            let t = fx.mul(j, is[axis]);
            let off = fx.add(io, t);
            let k = load(fx, DType::I32, ib, off);
            let k = fx.b.ins().sextend(types::I64, k.v);
            let bad = fx.b.ins().icmp(IntCC::UnsignedGreaterThanOrEqual, k, n);
            fx.if_else(
                bad,
                |fx| super::ops::fault(fx, check, axis, k, n),
                |fx| {
                    let t = fx.mul(k, os[axis]);
                    let ooff = fx.add(oo, t);
                    let cur = load(fx, out.dtype, ob, ooff);
                    let t = fx.mul(j, ss[axis]);
                    let soff = fx.add(so, t);
                    let v = load(fx, src.dtype, sb, soff);
                    let sum = fx.b.ins().fadd(cur.v, v.v);
                    store(fx, Typed { v: sum, k: Class::Float }, out.dtype, ob, ooff);
                },
            );
        });
    });
}

/// The sorting permutation along `axis`, one row per work item, by the runtime's
/// `attnc_argsort_row` ([`abi::ARGSORT_ROW`]).
pub fn emit_argsort(fx: &mut StepBuilder, x: &View, axis: usize, descending: bool, out: &View, limit: Option<i64>) {
    let (xb, xs) = fx.view_base(x);
    let (ob, os) = fx.view_base(out);
    let dims = fx.dims(&x.shape);
    let flags = i64::from(descending) | if Class::of(x.dtype) == Class::Int { 2 } else { 0 };
    let (lo, hi) = (fx.lo(), fx.hi());
    fx.for_range(lo, hi, |fx, w| {
        let (xo, oo) = row_offsets(fx, w, axis, &dims, &xs, &os);
        let xrow = fx.elem_addr(xb, xo);
        let orow = fx.elem_addr(ob, oo);
        let flags = fx.b.ins().iconst(types::I32, flags);
        // Places written: the row's length, or the leading ones the users read.
        let places = match limit {
            Some(k) => {
                let k = fx.i64(k);
                fx.min(k, dims[axis])
            }
            None => dims[axis],
        };
        fx.call(abi::ARGSORT_ROW, &[xrow, xs[axis], dims[axis], orow, os[axis], flags, places]);
    });
}

/// A running sum, product or linear recurrence along `axis`, one row per work item, in f64
/// (i64 for integers, wrapping), each output rounded once, as the interpreter computes it.
/// Aligned runs of [`GROUP`] rows that are neighbours along the innermost other axis run
/// together, one recurrence each (as [`emit_reduce`] groups its items).
pub fn emit_scan(fx: &mut StepBuilder, op: ScanOp, a: Option<&View>, x: &View, axis: usize, reverse: bool, out: &View) {
    let (xb, xs) = fx.view_base(x);
    let (ob, os) = fx.view_base(out);
    let a = a.map(|a| (a, fx.view_base(a)));
    let dims = fx.dims(&x.shape);
    let inner = (0..dims.len()).rev().find(|k| *k != axis);
    let a = a.as_ref().map(|(v, (b, s))| (*v, *b, s.as_slice()));
    let scan = Scan { op, a, x, xb, xs: &xs, out, ob, os: &os, dims: &dims, axis, inner, reverse };
    let (lo, hi) = (fx.lo(), fx.hi());
    let rows = |fx: &mut StepBuilder, from: Value, to: Value| fx.for_range(from, to, |fx, w| scan.rows(fx, w, 1));
    let Some(inner) = scan.inner else {
        return rows(fx, lo, hi);
    };
    in_groups(fx, dims[inner], (lo, hi), &rows, &|fx, w| scan.rows(fx, w, GROUP));
}

/// One scan step's operands, for [`Scan::rows`].
struct Scan<'a> {
    op: ScanOp,
    /// The linear recurrence's coefficients: view, base and strides.
    a: Option<(&'a View, Value, &'a [Value])>,
    x: &'a View,
    xb: Value,
    xs: &'a [Value],
    out: &'a View,
    ob: Value,
    os: &'a [Value],
    dims: &'a [Value],
    axis: usize,
    /// The innermost axis other than `axis`: neighbouring work items step along it.
    inner: Option<usize>,
    reverse: bool,
}

impl Scan<'_> {
    /// Work items `w .. w + n` (neighbours along the innermost other axis when `n > 1`).
    fn rows(&self, fx: &mut StepBuilder, w: Value, n: usize) {
        let (op, axis, dims) = (self.op, self.axis, self.dims);
        let (xo, oo) = row_offsets(fx, w, axis, dims, self.xs, self.os);
        let ao = self.a.map(|(_, _, s)| row_offsets(fx, w, axis, dims, s, self.os).0);
        // Lane `l`'s offsets: the first row's plus `l` steps along the inner axis.
        let lane = |fx: &mut StepBuilder, base: Value, strides: &[Value], l: usize| match self.inner {
            Some(k) if l > 0 => {
                let t = fx.b.ins().imul_imm_s(strides[k], l as i64);
                fx.add(base, t)
            }
            _ => base,
        };
        let xls: Vec<Value> = (0..n).map(|l| lane(fx, xo, self.xs, l)).collect();
        let ols: Vec<Value> = (0..n).map(|l| lane(fx, oo, self.os, l)).collect();
        let als: Vec<Option<Value>> = (0..n).map(|l| ao.zip(self.a).map(|(ao, (_, _, s))| lane(fx, ao, s, l))).collect();
        let int = Class::of(self.x.dtype) == Class::Int;
        let (acc_ty, init) = match (op, int) {
            (ScanOp::Prod, true) => (types::I64, fx.i64(1)),
            (_, true) => (types::I64, fx.i64(0)),
            (ScanOp::Prod, false) => (types::F64, fx.f64(1.0)),
            (_, false) => (types::F64, fx.f64(0.0)),
        };
        let accs: Vec<Variable> = (0..n).map(|_| fx.var(acc_ty, init)).collect();
        let (count, xstep, ostep) = (dims[axis], self.xs[axis], self.os[axis]);
        let zero = fx.i64(0);
        fx.for_range(zero, count, |fx, step| {
            let i = if self.reverse {
                let one = fx.i64(1);
                let last = fx.b.ins().isub(count, one);
                fx.b.ins().isub(last, step)
            } else {
                step
            };
            let xt = fx.mul(i, xstep);
            let ot = fx.mul(i, ostep);
            let at = self.a.map(|(_, _, s)| fx.mul(i, s[axis]));
            for l in 0..n {
                let off = fx.add(xls[l], xt);
                let v = load(fx, self.x.dtype, self.xb, off);
                let prev = fx.b.use_var(accs[l]);
                let next = if int {
                    let v = fx.b.ins().sextend(types::I64, v.v);
                    if op == ScanOp::Prod { fx.b.ins().imul(prev, v) } else { fx.b.ins().iadd(prev, v) }
                } else {
                    let v = fx.b.ins().fpromote(types::F64, v.v);
                    match op {
                        ScanOp::Sum => fx.b.ins().fadd(prev, v),
                        ScanOp::Prod => fx.b.ins().fmul(prev, v),
                        ScanOp::Linear => {
                            let coef = match (self.a, als[l], at) {
                                (Some((av, ab, _)), Some(ao), Some(at)) => {
                                    let aoff = fx.add(ao, at);
                                    let c = load(fx, av.dtype, ab, aoff);
                                    let c = fx.cvt_f(c);
                                    fx.b.ins().fpromote(types::F64, c)
                                }
                                _ => fx.f64(1.0),
                            };
                            let m = fx.b.ins().fmul(coef, prev);
                            fx.b.ins().fadd(m, v)
                        }
                    }
                };
                fx.b.def_var(accs[l], next);
                let result = if int {
                    Typed { v: fx.b.ins().ireduce(types::I32, next), k: Class::Int }
                } else {
                    Typed { v: fx.b.ins().fdemote(types::F32, next), k: Class::Float }
                };
                let ooff = fx.add(ols[l], ot);
                store(fx, result, self.out.dtype, self.ob, ooff);
            }
        });
    }
}

/// Causal linear attention, one batch index per work item, by the runtime's
/// `attnc_prefix_attention` ([`abi::PREFIX_ATTENTION`]) on dense f32 views.
pub fn emit_prefix_attention(fx: &mut StepBuilder, q: &View, k: &View, v: &View, reverse: bool, out: &View) {
    let r = q.shape.len();
    let (qb, _) = fx.view_base(q);
    let (kb, _) = fx.view_base(k);
    let (vb, _) = fx.view_base(v);
    let (ob, _) = fx.view_base(out);
    let dims = fx.dims(&q.shape);
    let dv = fx.dim(&v.shape[r - 1]);
    let (s, d) = (dims[r - 2], dims[r - 1]);
    let qk_item = fx.mul(s, d);
    let v_item = fx.mul(s, dv);
    let block = fx.i64(attn_compiler::schedule::PREFIX_BLOCK);
    let (lo, hi) = (fx.lo(), fx.hi());
    fx.for_range(lo, hi, |fx, w| {
        let qk_off = fx.mul(w, qk_item);
        let v_off = fx.mul(w, v_item);
        let qp = fx.elem_addr(qb, qk_off);
        let kp = fx.elem_addr(kb, qk_off);
        let vp = fx.elem_addr(vb, v_off);
        let op = fx.elem_addr(ob, v_off);
        let reverse = fx.b.ins().iconst(types::I32, i64::from(reverse));
        fx.call(abi::PREFIX_ATTENTION, &[qp, kp, vp, op, s, d, dv, block, reverse]);
    });
}
