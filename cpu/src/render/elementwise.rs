//! Fused element-wise kernels: one loop nest computes a whole chain of element-wise ops per
//! output element, reading each input once and storing only the result.
//!
//! Work item = one row (every axis but the last). Inside a row the inner axis runs four
//! elements at a time when every input steps by one element (or is broadcast) along it and the
//! output is dense along it, with a scalar loop for the tail.

use super::builder::StepBuilder;
use super::ops::{Typed, clamped_load};
use crate::abi;
use attn_compiler::ir::semantics::Class;
use attn_compiler::ir::{DType, Dim, UnaryOp};
use attn_compiler::schedule::{Expr, View};
use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::{InstBuilder, MemFlagsData, Value, types};
use std::collections::HashMap;

/// How an input moves along the kernel's inner axis.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Inner {
    /// Broadcast: the same element for the whole row.
    Zero,
    /// Dense.
    One,
    /// A run-time stride (elements).
    Stride(Value),
}

/// An input read at the kernel's (broadcast) index.
struct Operand {
    dtype: DType,
    base: Value,
    /// Stride per outer kernel axis (`None`: broadcast).
    outer: Vec<Option<Value>>,
    inner: Inner,
}

/// A gather table: read at computed, clamped indices.
struct Table {
    dtype: DType,
    base: Value,
    strides: Vec<Value>,
    sizes: Vec<Value>,
}

/// What the expression evaluator sees at one element (or four).
struct At<'c> {
    /// Kernel index per outer axis (i64).
    outer: &'c [Value],
    /// Inner index (i64) of the first lane.
    j: Value,
    /// Row addresses of the operands (`None` for gather tables).
    rows: &'c [Option<Value>],
}

/// An element-wise expression over a shape, with everything loop-invariant loaded: a kernel of
/// its own ([`emit`]) or the operand another kernel computes as it reads it
/// ([`super::rows::emit_reduce_of`]).
pub(super) struct Kernel<'k> {
    rank: usize,
    operands: Vec<Option<Operand>>,
    tables: Vec<Option<Table>>,
    dims: HashMap<Dim, Value>,
    lane_iota: Option<Value>,
    expr: &'k Expr,
    /// The output's dtype, first element and strides.
    out_dtype: DType,
    out_base: Value,
    out_strides: Vec<Value>,
    /// The size of each axis.
    sizes: Vec<Value>,
    /// A whole-row kernel computing the expression from input `.1`, when one does.
    row_kernel: Option<(abi::Import, usize)>,
}

/// Emits the kernel `out[idx] = expr(idx)`: one row (every axis but the last) per work item.
pub fn emit(fx: &mut StepBuilder, out: &View, inputs: &[View], expr: &Expr, more: &[(View, Expr)]) {
    if let (Expr::Load(0), [input], []) = (expr, inputs, more)
        && is_transpose(out, input)
    {
        return emit_transpose(fx, out, input);
    }
    let k = prologue(fx, out, inputs, expr);
    // Further outputs of the same shape: their rows follow the first's at the same index, so
    // each input row is read from memory once.
    let parts: Vec<Kernel> = more.iter().map(|(o, e)| prologue(fx, o, inputs, e)).collect();
    let rank = k.rank;
    let (lo, hi) = (fx.lo(), fx.hi());
    // The outer index is unravelled once per call and then stepped like an odometer, which
    // keeps divisions out of the row loop.
    let first = fx.unravel(lo, &k.sizes[..rank - 1]);
    let index: Vec<_> = first.iter().map(|i| fx.var(types::I64, *i)).collect();
    fx.for_range(lo, hi, |fx, _| {
        let outer: Vec<Value> = index.iter().map(|v| fx.b.use_var(*v)).collect();
        k.row(fx, &outer);
        for p in &parts {
            p.row(fx, &outer);
        }
        // Next row: bump the last outer axis, carrying into earlier ones.
        let mut carry = fx.i64(1);
        for a in (0..rank - 1).rev() {
            let t = fx.add(outer[a], carry);
            let wrap = fx.b.ins().icmp(IntCC::Equal, t, k.sizes[a]);
            let zero = fx.i64(0);
            let next = fx.b.ins().select(wrap, zero, t);
            fx.b.def_var(index[a], next);
            carry = fx.b.ins().uextend(types::I64, wrap);
        }
    });
}

/// Whether copying `input` into `out` transposes matrices: f32 both, the same shape, `out`
/// dense along its last axis, and `input` dense along the one before instead (a transposed
/// operand materialised for a matrix product, `x.T @ y`). Element by element such a copy reads
/// one strided column per output row.
fn is_transpose(out: &View, input: &View) -> bool {
    let rank = out.shape.len();
    let stride_is = |v: &View, axis: usize, want: i64| v.strides[axis].as_const() == Some(want);
    let wide = |axis: usize| out.shape[axis].as_const().is_none_or(|d| d > 1);
    rank >= 2
        && out.dtype == DType::F32
        && input.dtype == DType::F32
        && input.shape == out.shape
        && input.strides.len() == rank
        && out.strides.len() == rank
        && stride_is(out, rank - 1, 1)
        && stride_is(input, rank - 2, 1)
        && !stride_is(input, rank - 1, 1)
        && wide(rank - 1)
        && wide(rank - 2)
}

/// [`is_transpose`]'s copy by the runtime's blocked transpose: the work items are output rows,
/// and each run of them inside one matrix is one call (`rows` of the input's matrix become the
/// call's columns).
fn emit_transpose(fx: &mut StepBuilder, out: &View, input: &View) {
    let rank = out.shape.len();
    let sizes = fx.dims(&out.shape);
    let (ob, os) = fx.view_base(out);
    let (ib, is) = fx.view_base(input);
    let (r, n) = (sizes[rank - 2], sizes[rank - 1]);
    let (lo, hi) = (fx.lo(), fx.hi());
    let any = fx.b.ins().icmp_imm_s(IntCC::SignedGreaterThan, r, 0);
    fx.if_then(any, |fx| {
        let first = fx.b.ins().udiv(lo, r);
        let end = fx.ceil_div(hi, r);
        fx.for_range(first, end, |fx, m| {
            let row0 = fx.mul(m, r);
            let from = fx.sub(lo, row0);
            let zero = fx.i64(0);
            let r0 = fx.max(from, zero);
            let to = fx.sub(hi, row0);
            let r1 = fx.min(to, r);
            let cols = fx.sub(r1, r0);
            let some = fx.b.ins().icmp_imm_s(IntCC::SignedGreaterThan, cols, 0);
            fx.if_then(some, |fx| {
                let idx = fx.unravel(m, &sizes[..rank - 2]);
                let zero = fx.i64(0);
                let ioff = fx.dot(zero, &idx, &is[..rank - 2]);
                let ioff = fx.add(ioff, r0);
                let ooff = fx.dot(zero, &idx, &os[..rank - 2]);
                let orow = fx.mul(r0, os[rank - 2]);
                let ooff = fx.add(ooff, orow);
                let src = fx.elem_addr(ib, ioff);
                let dst = fx.elem_addr(ob, ooff);
                fx.call(abi::TRANSPOSE, &[src, is[rank - 1], n, cols, dst, os[rank - 2]]);
            });
        });
    });
}

/// Everything loop-invariant: sizes, the output, the inputs' strides, the dims the expression
/// reads, and whether rows run four lanes at a time (or by a row kernel).
fn prologue<'k>(fx: &mut StepBuilder, out: &View, inputs: &[View], expr: &'k Expr) -> Kernel<'k> {
    // A scalar kernel runs as one row of one element.
    let shape: Vec<Dim> = if out.shape.is_empty() { vec![Dim::constant(1)] } else { out.shape.clone() };
    let out_strides: Vec<Dim> = if out.strides.is_empty() { vec![Dim::constant(0)] } else { out.strides.clone() };
    let out_view = View { shape: shape.clone(), strides: out_strides, ..out.clone() };
    build(fx, &shape, Some(&out_view), inputs, expr)
}

/// The expression `expr` over `shape` (rank ≥ 1) with no output of its own: its inputs'
/// strides, tables and dims loaded, and four lanes along the last axis where every input
/// steps by one element (or is broadcast) along it.
pub(super) fn expression<'k>(fx: &mut StepBuilder, shape: &[Dim], inputs: &[View], expr: &'k Expr) -> Kernel<'k> {
    build(fx, shape, None, inputs, expr)
}

/// [`prologue`] and [`expression`].
fn build<'k>(fx: &mut StepBuilder, shape: &[Dim], out: Option<&View>, inputs: &[View], expr: &'k Expr) -> Kernel<'k> {
    let rank = shape.len();
    let (mut as_load, mut as_table) = (vec![false; inputs.len()], vec![false; inputs.len()]);
    let mut dim_leaves = Vec::new();
    scan(expr, &mut as_load, &mut as_table, &mut dim_leaves);
    let sizes: Vec<Value> = shape.iter().map(|d| fx.dim(d)).collect();
    let (out_base, out_st) = match out {
        Some(out) => fx.view_base(out),
        None => (fx.i64(0), Vec::new()),
    };
    let mut operands = Vec::new();
    let mut tables = Vec::new();
    for (k, view) in inputs.iter().enumerate() {
        operands.push(as_load[k].then(|| operand(fx, view, shape)));
        tables.push(as_table[k].then(|| {
            let (base, strides) = fx.view_base(view);
            let sizes = fx.dims(&view.shape);
            Table { dtype: view.dtype, base, strides, sizes }
        }));
    }
    let mut dims = HashMap::new();
    for d in dim_leaves {
        let v = fx.dim(&d);
        let v = fx.b.ins().ireduce(types::I32, v);
        dims.insert(d, v);
    }
    let out_dense = out.is_none_or(|o| o.unit_stride(rank - 1));
    let vectorize = out_dense && operands.iter().flatten().all(|o| !matches!(o.inner, Inner::Stride(_)));
    let lane_iota = vectorize.then(|| fx.lane_iota());
    // A lone GELU or sigmoid of a dense f32 row (a transformer's FFN activation, a gate) calls
    // the row kernel: 16 lanes with a vectorised erfc or exp instead of four.
    let out_dtype = out.map_or(DType::F32, |o| o.dtype);
    let row_kernel = match expr {
        Expr::Unary(op @ (UnaryOp::Gelu | UnaryOp::Sigmoid), a, DType::F32) if out.is_some() && out_dtype == DType::F32 && vectorize => {
            match **a {
                Expr::Load(k) if inputs[k].dtype == DType::F32 && operands[k].as_ref().is_some_and(|o| o.inner == Inner::One) => {
                    Some((if *op == UnaryOp::Gelu { abi::GELU } else { abi::SIGMOID }, k))
                }
                _ => None,
            }
        }
        _ => None,
    };
    Kernel { rank, operands, tables, dims, lane_iota, expr, out_dtype, out_base, out_strides: out_st, sizes, row_kernel }
}

impl Kernel<'_> {
    /// The size of each axis.
    pub(super) fn sizes(&self) -> &[Value] {
        &self.sizes
    }

    /// Whether the expression runs four lanes at a time along the last axis.
    pub(super) fn vectorized(&self) -> bool {
        self.lane_iota.is_some()
    }

    /// The row addresses of the loaded inputs at outer index `outer` (every axis but the last).
    pub(super) fn rows(&self, fx: &mut StepBuilder, outer: &[Value]) -> Vec<Option<Value>> {
        self.operands
            .iter()
            .map(|o| {
                o.as_ref().map(|o| {
                    let mut off = fx.i64(0);
                    for (i, s) in outer.iter().zip(&o.outer) {
                        if let Some(s) = s {
                            let t = fx.mul(*i, *s);
                            off = fx.add(off, t);
                        }
                    }
                    fx.elem_addr(o.base, off)
                })
            })
            .collect()
    }

    /// `rows` moved along outer `axis` by `by` elements of its index.
    pub(super) fn rows_along(&self, fx: &mut StepBuilder, rows: &[Option<Value>], axis: usize, by: Value) -> Vec<Option<Value>> {
        self.operands
            .iter()
            .zip(rows)
            .map(|(o, r)| match (o, r) {
                (Some(o), Some(r)) => Some(match o.outer[axis] {
                    Some(s) => {
                        let t = fx.mul(by, s);
                        fx.elem_addr(*r, t)
                    }
                    None => *r,
                }),
                _ => *r,
            })
            .collect()
    }

    /// The expression at outer index `outer` and last-axis index `j` (`lanes` lanes from `j`),
    /// with the inputs' row addresses `rows` for that outer index; a truth value as i32 0/1.
    pub(super) fn value(&self, fx: &mut StepBuilder, outer: &[Value], (j, lanes): (Value, u8), rows: &[Option<Value>]) -> Typed {
        fx.lanes = lanes;
        let v = self.eval(fx, self.expr, &At { outer, j, rows });
        let v = if v.k == Class::Bool { Typed { v: fx.cvt_i(v), k: Class::Int } } else { v };
        fx.lanes = 1;
        v
    }

    /// One row at outer index `outer`: a row kernel, or four lanes at a time where the layout
    /// allows, then one at a time.
    fn row(&self, fx: &mut StepBuilder, outer: &[Value]) {
        let rank = self.rank;
        let rows = self.rows(fx, outer);
        let zero = fx.i64(0);
        let out_off = fx.dot(zero, outer, &self.out_strides[..rank - 1]);
        let out_row = fx.elem_addr(self.out_base, out_off);
        let inner = self.sizes[rank - 1];
        let mut start = fx.i64(0);
        if let Some((kernel_fn, k)) = self.row_kernel {
            // The whole dense row by a 16-lane kernel.
            if let Some(row) = rows[k] {
                fx.call(kernel_fn, &[row, out_row, inner]);
            }
            start = inner;
        } else if self.lane_iota.is_some() {
            let mask = fx.i64(-4);
            let vec_end = fx.b.ins().band(inner, mask);
            fx.for_step(start, vec_end, 4, |fx, j| {
                fx.lanes = 4;
                let x = self.element(fx, &At { outer, j, rows: &rows });
                let addr = fx.elem_addr(out_row, j);
                fx.b.ins().store(MemFlagsData::new().with_notrap(), x, addr, 0);
                fx.lanes = 1;
            });
            start = vec_end;
        }
        let out_inner = self.out_strides[rank - 1];
        fx.for_range(start, inner, |fx, j| {
            let x = self.element(fx, &At { outer, j, rows: &rows });
            let off = fx.mul(j, out_inner);
            let addr = fx.elem_addr(out_row, off);
            fx.store(x, addr);
        });
    }

    /// The expression at `at`, in its memory form.
    fn element(&self, fx: &mut StepBuilder, at: &At) -> Value {
        let x = self.eval(fx, self.expr, at);
        let x = fx.round_to(x, self.out_dtype);
        store_form(fx, x)
    }
}

/// Marks which inputs are loaded at the kernel index and which are gather tables, and collects
/// the dims the expression reads.
fn scan(e: &Expr, load: &mut [bool], table: &mut [bool], dims: &mut Vec<Dim>) {
    match e {
        Expr::Load(k) => load[*k] = true,
        Expr::Dim(d) => {
            if !dims.contains(d) {
                dims.push(d.clone());
            }
        }
        Expr::Const(..) | Expr::Iota { .. } => {}
        Expr::Unary(_, a, _) | Expr::Cast(a, _) => scan(a, load, table, dims),
        Expr::Binary(_, a, b, _) => {
            scan(a, load, table, dims);
            scan(b, load, table, dims);
        }
        Expr::Select(c, a, b, _) => {
            scan(c, load, table, dims);
            scan(a, load, table, dims);
            scan(b, load, table, dims);
        }
        Expr::Gather(t, idx, ..) => {
            table[*t] = true;
            for i in idx {
                scan(i, load, table, dims);
            }
        }
        Expr::DropoutBits(a) => a.iter().for_each(|x| scan(x, load, table, dims)),
    }
}

/// The strides of `view` along the kernel's axes (right-aligned broadcast).
fn operand(fx: &mut StepBuilder, view: &View, shape: &[Dim]) -> Operand {
    let (base, strides) = fx.view_base(view);
    let rank = shape.len();
    let lead = rank.saturating_sub(view.shape.len());
    let axis_stride = |k: usize| -> Option<Value> {
        let a = k.checked_sub(lead)?;
        if view.shape.get(a)?.as_const() == Some(1) { None } else { strides.get(a).copied() }
    };
    let outer = (0..rank - 1).map(axis_stride).collect();
    let inner = match axis_stride(rank - 1) {
        None => Inner::Zero,
        Some(s) => {
            let a = rank - 1 - lead;
            if view.strides.get(a).and_then(Dim::as_const) == Some(1) { Inner::One } else { Inner::Stride(s) }
        }
    };
    Operand { dtype: view.dtype, base, outer, inner }
}

/// The memory form of a value: f32, i32, or bool as i32 0/1.
fn store_form(fx: &mut StepBuilder, x: Typed) -> Value {
    match x.k {
        Class::Float => x.v,
        _ => fx.cvt_i(x),
    }
}

/// Loads one element (or four consecutive ones, or one broadcast to four) of `dtype`.
fn load_elem(fx: &mut StepBuilder, dtype: DType, addr: Value, dense_lanes: bool) -> Typed {
    let k = Class::of(dtype);
    let mem_kind = if k == Class::Float { Class::Float } else { Class::Int };
    let raw = if fx.lanes > 1 && dense_lanes {
        let ty = fx.ty(mem_kind);
        fx.b.ins().load(ty, MemFlagsData::new().with_notrap(), addr, 0)
    } else {
        let ty = if mem_kind == Class::Float { types::F32 } else { types::I32 };
        let s = fx.load(ty, addr);
        fx.splat(mem_kind, s)
    };
    let x = Typed { v: raw, k: mem_kind };
    if k == Class::Bool { Typed { v: fx.cvt_b(x), k: Class::Bool } } else { x }
}

impl Kernel<'_> {
    fn eval(&self, fx: &mut StepBuilder, e: &Expr, at: &At) -> Typed {
        match e {
            Expr::Load(k) => {
                let (Some(o), Some(row)) = (&self.operands[*k], at.rows[*k]) else {
                    return fx.fail(format!("input {k} is read but was not loaded"));
                };
                match o.inner {
                    Inner::Zero => load_elem(fx, o.dtype, row, false),
                    Inner::One => {
                        let addr = fx.elem_addr(row, at.j);
                        load_elem(fx, o.dtype, addr, true)
                    }
                    Inner::Stride(s) => {
                        let off = fx.mul(at.j, s);
                        let addr = fx.elem_addr(row, off);
                        load_elem(fx, o.dtype, addr, false)
                    }
                }
            }
            Expr::Const(c, dtype) => {
                let c = dtype.round(*c);
                let v = match Class::of(*dtype) {
                    Class::Float => fx.fconst(c as f32),
                    Class::Int => fx.iconst(c as i64),
                    Class::Bool => fx.bconst(c != 0.0),
                };
                Typed { v, k: Class::of(*dtype) }
            }
            Expr::Dim(d) => match self.dims.get(d).copied() {
                Some(s) => Typed { v: fx.splat(Class::Int, s), k: Class::Int },
                None => fx.fail(format!("dim {d} was not loaded")),
            },
            Expr::Iota { axis, rank, one } => {
                let k = (axis + self.rank).checked_sub(*rank);
                let v = match k {
                    _ if *one => fx.iconst(0),
                    Some(k) if k + 1 == self.rank => {
                        let j = fx.b.ins().ireduce(types::I32, at.j);
                        let j = fx.splat(Class::Int, j);
                        match (fx.lanes > 1, self.lane_iota) {
                            (true, Some(l)) => fx.b.ins().iadd(j, l),
                            _ => j,
                        }
                    }
                    Some(k) if k < at.outer.len() => {
                        let i = fx.b.ins().ireduce(types::I32, at.outer[k]);
                        fx.splat(Class::Int, i)
                    }
                    _ => fx.iconst(0),
                };
                Typed { v, k: Class::Int }
            }
            Expr::Unary(op, a, dtype) => {
                let a = self.eval(fx, a, at);
                let r = fx.unary(*op, a);
                fx.round_to(r, *dtype)
            }
            Expr::Binary(op, a, b, dtype) => {
                let a = self.eval(fx, a, at);
                let b = self.eval(fx, b, at);
                let r = fx.binary(*op, a, b);
                fx.round_to(r, *dtype)
            }
            Expr::Select(c, a, b, dtype) => {
                let c = self.eval(fx, c, at);
                let a = self.eval(fx, a, at);
                let b = self.eval(fx, b, at);
                let r = fx.select(c, a, b);
                fx.round_to(r, *dtype)
            }
            Expr::Cast(a, dtype) => {
                let a = self.eval(fx, a, at);
                fx.round_to(a, *dtype)
            }
            Expr::Gather(t, idx, _, site) => {
                let idx: Vec<Value> = idx
                    .iter()
                    .map(|e| {
                        let x = self.eval(fx, e, at);
                        fx.cvt_i(x)
                    })
                    .collect();
                self.gather(fx, *t, &idx, *site)
            }
            Expr::DropoutBits(a) => {
                let args: Vec<Value> = a
                    .iter()
                    .map(|e| {
                        let x = self.eval(fx, e, at);
                        fx.cvt_i(x)
                    })
                    .collect();
                Typed { v: fx.lanewise_i32(crate::abi::DROPOUT_BITS, &args), k: Class::Int }
            }
        }
    }

    /// `table[idx...]`, an index out of range recorded as a fault of `site` (and read clamped);
    /// lane by lane for vectors. A gather's dtype is its table's (`ir::infer`), so the table's
    /// layout is all it needs.
    fn gather(&self, fx: &mut StepBuilder, t: usize, idx: &[Value], site: usize) -> Typed {
        let Some(table) = &self.tables[t] else { return fx.fail(format!("gather table {t} was not loaded")) };
        let Some(record) = fx.schedule.fault else { return fx.fail("a checked gather without a fault record".to_string()) };
        let check = Some(super::ops::Checked { record, site });
        clamped_load(fx, table.dtype, table.base, &table.strides, &table.sizes, idx, check)
    }
}
