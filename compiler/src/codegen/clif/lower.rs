//! Graph → [`Plan`]: decides which values live in memory and which are computed inline,
//! turns layout ops into views, groups element-wise chains into one kernel each, and lists the
//! steps in order.
//!
//! Rules:
//! - Element-wise ops (unary, binary, select, cast, constants, dim values, iota, gather) are
//!   inlined into their user when they have one user that is itself element-wise (or a concat);
//!   constants, dim values and iota are inlined into any number of element-wise users. The rest
//!   are kernel roots whose result is stored.
//! - Transpose and slice are views; reshape is a view of a dense operand and a copy otherwise.
//! - Matmul and flash read their operands in place when the inner axis has unit stride
//!   (transposed K of `q @ k.T` included); otherwise a dense copy is made first.
//! - An output is written by the step that computes it when that step's buffer is dense and
//!   wholly the output's; otherwise it is copied.

use super::CodegenError;
use super::plan::{Buffer, BufferKind, Check, Expr, FlashKernel, Kernel, Plan, Step, Tuning, View, row_major};
use crate::ir::{BinaryOp, DType, Dim, FlashSpec, Graph, Op, ScoreExpr, Value, value_numbers};

/// Where a value lives.
#[derive(Clone, Debug)]
enum Place {
    /// In memory, as a view.
    View(View),
    /// Computed inside its users' kernels.
    Inline,
}

struct Lowering<'g> {
    g: &'g Graph,
    plan: Plan,
    place: Vec<Option<Place>>,
    numbers: Vec<usize>,
    /// Query scalings folded into flash ops (see [`folded_scales`]).
    folded: Vec<Option<(Value, ScoreExpr)>>,
}

/// Builds the plan of a graph (which must verify).
pub fn lower(g: &Graph) -> Result<Plan, CodegenError> {
    let order = g.topo_order().ok_or_else(|| CodegenError::Cycle { graph: g.name.clone() })?;
    let mut l = Lowering {
        g,
        plan: Plan { name: g.name.clone(), ..Plan::default() },
        place: vec![None; g.len()],
        numbers: value_numbers(g),
        folded: Vec::new(),
    };
    let live = live_values(g);
    let inline = inline_set(g, &live);
    l.folded = folded_scales(g, &live);
    for (i, p) in g.params().iter().enumerate() {
        let node = g.node(*p);
        let buf = l.buffer(BufferKind::Param(i), node.ty.dtype, Dim::product(&node.ty.shape), *p);
        l.plan.params.push(buf);
        l.place[p.index()] = Some(Place::View(View::contiguous(buf, node.ty.dtype, node.ty.shape.clone())));
    }
    for v in order {
        if !live[v.index()] || l.place[v.index()].is_some() {
            continue;
        }
        if inline[v.index()] || l.folded[v.index()].is_some() {
            l.place[v.index()] = Some(Place::Inline);
            continue;
        }
        let view = l.node(v)?;
        l.place[v.index()] = Some(Place::View(view));
    }
    l.outputs()?;
    Ok(l.plan)
}

/// Scalar IR expressions (constants, dims and element-wise ops of them) as score expressions.
fn scalar_expr(g: &Graph, v: Value) -> Option<ScoreExpr> {
    let node = g.node(v);
    if node.ty.shape.iter().any(|d| d.as_const() != Some(1)) {
        return None;
    }
    let args = g.operands(v);
    Some(match &node.op {
        Op::Const(c) => ScoreExpr::Float(node.ty.dtype.round(*c)),
        Op::DimValue(d) => ScoreExpr::Dim(d.clone()),
        Op::Unary(u) => ScoreExpr::Unary(*u, Box::new(scalar_expr(g, args[0])?)),
        Op::Binary(b) if !b.is_comparison() && !b.is_logical() => ScoreExpr::bin(*b, scalar_expr(g, args[0])?, scalar_expr(g, args[1])?),
        _ => return None,
    })
}

/// `q * c` (or `c * q`) feeding only a flash op's query, with `c` a scalar expression: the
/// scale rides on the Q·Kᵀ product instead of a scaled copy of q. Maps such products to
/// (the unscaled operand, the scale).
fn folded_scales(g: &Graph, live: &[bool]) -> Vec<Option<(Value, ScoreExpr)>> {
    g.values()
        .map(|v| {
            let node = g.node(v);
            if !live[v.index()] || node.op != Op::Binary(BinaryOp::Mul) || !node.ty.dtype.is_float() {
                return None;
            }
            let users: Vec<Value> = g.users(v).into_iter().filter(|u| live[u.index()]).collect();
            let only_query = users.len() == 1
                && matches!(g.node(users[0]).op, Op::Flash(_))
                && g.operands(users[0]).iter().position(|a| *a == v) == Some(0)
                && g.operands(users[0]).iter().filter(|a| **a == v).count() == 1
                && !g.outputs().iter().any(|(_, o)| *o == v);
            if !only_query {
                return None;
            }
            let args = g.operands(v);
            let (x, c) = (args[0], args[1]);
            let same = |a: Value| g.node(a).ty == node.ty;
            if same(x)
                && let Some(e) = scalar_expr(g, c)
            {
                return Some((x, e));
            }
            if same(c)
                && let Some(e) = scalar_expr(g, x)
            {
                return Some((c, e));
            }
            None
        })
        .collect()
}

/// Values the outputs depend on.
fn live_values(g: &Graph) -> Vec<bool> {
    let mut live = vec![false; g.len()];
    let mut stack: Vec<Value> = g.outputs().iter().map(|(_, v)| *v).collect();
    while let Some(v) = stack.pop() {
        if !std::mem::replace(&mut live[v.index()], true) {
            stack.extend(g.operands(v));
        }
    }
    live
}

/// Ops computed per element from their operands' elements at the same (broadcast) index.
fn is_elementwise(op: &Op) -> bool {
    matches!(op, Op::Const(_) | Op::DimValue(_) | Op::Iota { .. } | Op::Unary(_) | Op::Binary(_) | Op::Select | Op::Cast | Op::Gather)
}

/// Which live values are computed inline by their users.
fn inline_set(g: &Graph, live: &[bool]) -> Vec<bool> {
    let mut is_output = vec![false; g.len()];
    for (_, v) in g.outputs() {
        is_output[v.index()] = true;
    }
    g.values()
        .map(|v| {
            let op = &g.node(v).op;
            if !live[v.index()] || is_output[v.index()] || !is_elementwise(op) {
                return false;
            }
            let users: Vec<Value> = g.users(v).into_iter().filter(|u| live[u.index()]).collect();
            // A gather's table is read at computed indices, so it must be in memory.
            let fits = |u: &Value| {
                let uop = &g.node(*u).op;
                let as_table = matches!(uop, Op::Gather) && g.operands(*u).first() == Some(&v);
                (is_elementwise(uop) || matches!(uop, Op::Concat { .. })) && !as_table
            };
            let cheap = matches!(op, Op::Const(_) | Op::DimValue(_) | Op::Iota { .. });
            !users.is_empty() && users.iter().all(fits) && (cheap || users.len() == 1)
        })
        .collect()
}

impl Lowering<'_> {
    fn label(&self, v: Value) -> String {
        format!("%{} {}", self.numbers[v.index()], self.g.node(v).op.name())
    }

    fn unsupported(&self, v: Value, reason: impl Into<String>) -> CodegenError {
        CodegenError::Unsupported {
            graph: self.g.name.clone(),
            value: self.numbers[v.index()],
            op: self.g.node(v).op.name().to_string(),
            reason: reason.into(),
        }
    }

    fn buffer(&mut self, kind: BufferKind, dtype: DType, elems: Dim, v: Value) -> usize {
        self.plan.buffers.push(Buffer { kind, dtype, elems, value: self.numbers[v.index()] });
        self.plan.buffers.len() - 1
    }

    /// A dense temporary for the value `v` with the given type.
    fn temp(&mut self, v: Value, dtype: DType, shape: &[Dim]) -> View {
        let buf = self.buffer(BufferKind::Temp, dtype, Dim::product(shape), v);
        View::contiguous(buf, dtype, shape.to_vec())
    }

    /// Appends a step running `kernel`; its work count is `work` (a dim) or a tuning value.
    fn step(&mut self, kernel: Kernel, label: String, work: Result<Dim, Tuning>) -> usize {
        let index = self.plan.steps.len();
        let work = match work {
            Ok(d) => self.plan.dim(&d),
            Err(t) => self.plan.tuning(index, t),
        };
        let (reads, writes) = touches(&kernel);
        self.plan.steps.push(Step { func: index, work, kernel, label, reads, writes });
        index
    }

    /// The view of a value that is in memory, materialising an inline value if needed.
    fn view(&mut self, v: Value) -> Result<View, CodegenError> {
        match &self.place[v.index()] {
            Some(Place::View(view)) => Ok(view.clone()),
            Some(Place::Inline) => {
                let view = self.elementwise_root(v)?;
                self.place[v.index()] = Some(Place::View(view.clone()));
                Ok(view)
            }
            None => Err(self.unsupported(v, "operand used before it is computed")),
        }
    }

    /// `view`, copied into a dense temporary (of type `dtype`) unless `keep` accepts it.
    fn dense_if(&mut self, v: Value, view: View, dtype: DType, keep: impl Fn(&View) -> bool) -> View {
        if view.dtype == dtype && keep(&view) {
            return view;
        }
        let out = self.temp(v, dtype, &view.shape);
        let expr = if view.dtype == dtype { Expr::Load(0) } else { Expr::Cast(Box::new(Expr::Load(0)), dtype) };
        let rows = rows_of(&out.shape);
        let label = format!("{} (copy)", self.label(v));
        self.step(Kernel::Elementwise { out: out.clone(), inputs: vec![view], expr }, label, Ok(rows));
        out
    }

    /// Builds the expression of `v` for a kernel, adding its loads to `inputs`.
    fn expr(&mut self, v: Value, inputs: &mut Vec<View>) -> Result<Expr, CodegenError> {
        let load = |view: View, inputs: &mut Vec<View>| match inputs.iter().position(|x| *x == view) {
            Some(i) => i,
            None => {
                inputs.push(view);
                inputs.len() - 1
            }
        };
        if let Some(Place::View(view)) = &self.place[v.index()] {
            return Ok(Expr::Load(load(view.clone(), inputs)));
        }
        let node = self.g.node(v).clone();
        let args = self.g.operands(v);
        let dtype = node.ty.dtype;
        let sub = |l: &mut Self, k: usize, inputs: &mut Vec<View>| -> Result<Box<Expr>, CodegenError> {
            let a = *args.get(k).ok_or_else(|| l.unsupported(v, "missing operand"))?;
            Ok(Box::new(l.expr(a, inputs)?))
        };
        Ok(match &node.op {
            Op::Const(c) => Expr::Const(*c, dtype),
            Op::DimValue(d) => Expr::Dim(d.clone()),
            Op::Iota { axis } => {
                let one = node.ty.shape.get(*axis).and_then(Dim::as_const) == Some(1);
                Expr::Iota { axis: *axis, rank: node.ty.rank(), one }
            }
            Op::Unary(u) => Expr::Unary(*u, sub(self, 0, inputs)?, dtype),
            Op::Binary(b) => Expr::Binary(*b, sub(self, 0, inputs)?, sub(self, 1, inputs)?, dtype),
            Op::Select => Expr::Select(sub(self, 0, inputs)?, sub(self, 1, inputs)?, sub(self, 2, inputs)?, dtype),
            Op::Cast => Expr::Cast(sub(self, 0, inputs)?, dtype),
            Op::Gather => {
                let table = self.view(args[0])?;
                let t = load(table, inputs);
                let mut idx = Vec::new();
                for k in 1..args.len() {
                    idx.push(*sub(self, k, inputs)?);
                }
                Expr::Gather(t, idx, dtype)
            }
            _ => {
                let view = self.view(v)?;
                Expr::Load(load(view, inputs))
            }
        })
    }

    /// Stores an element-wise value in a new dense temporary.
    fn elementwise_root(&mut self, v: Value) -> Result<View, CodegenError> {
        let ty = self.g.node(v).ty.clone();
        // Compute the expression as if `v` were inline, whatever its place says.
        self.place[v.index()] = Some(Place::Inline);
        let mut inputs = Vec::new();
        let expr = self.expr(v, &mut inputs)?;
        let out = self.temp(v, ty.dtype, &ty.shape);
        let label = self.label(v);
        self.step(Kernel::Elementwise { out: out.clone(), inputs, expr }, label, Ok(rows_of(&ty.shape)));
        Ok(out)
    }

    /// Lowers one materialised node; returns where its value is.
    fn node(&mut self, v: Value) -> Result<View, CodegenError> {
        let node = self.g.node(v).clone();
        let args = self.g.operands(v);
        let ty = node.ty.clone();
        let label = self.label(v);
        match &node.op {
            Op::Param(_) => Err(self.unsupported(v, "a parameter outside the parameter list")),
            op if is_elementwise(op) => self.elementwise_root(v),
            Op::Transpose { perm } => {
                let x = self.view(args[0])?;
                if perm.len() != x.shape.len() || perm.iter().any(|p| *p >= x.shape.len()) {
                    return Err(self.unsupported(v, "bad permutation"));
                }
                Ok(View {
                    shape: perm.iter().map(|p| x.shape[*p].clone()).collect(),
                    strides: perm.iter().map(|p| x.strides[*p].clone()).collect(),
                    ..x
                })
            }
            Op::Reshape => {
                let x = self.view(args[0])?;
                let x = self.dense_if(v, x, ty.dtype, View::is_contiguous);
                Ok(View { strides: row_major(&ty.shape), shape: ty.shape.clone(), ..x })
            }
            Op::Slice { axis, start, end } => {
                let x = self.view(args[0])?;
                let size = x.shape.get(*axis).cloned().ok_or_else(|| self.unsupported(v, "slice axis out of range"))?;
                self.plan.checks.push(Check { node: label, axis: *axis, start: start.clone(), end: end.clone(), size });
                let mut out = x;
                out.offset = out.offset.add(&start.mul(&out.strides[*axis]));
                out.shape[*axis] = end.sub(start);
                Ok(out)
            }
            Op::Concat { axis } => {
                let out = self.temp(v, ty.dtype, &ty.shape);
                let mut at = Dim::constant(0);
                for a in args {
                    let part = self.g.node(a).ty.shape.clone();
                    let mut dst = out.clone();
                    dst.offset = at.mul(&out.strides[*axis]);
                    at = at.add(&part[*axis]);
                    dst.shape = part.clone();
                    let mut inputs = Vec::new();
                    let expr = self.expr(a, &mut inputs)?;
                    let expr = if self.g.node(a).ty.dtype == ty.dtype { expr } else { Expr::Cast(Box::new(expr), ty.dtype) };
                    self.step(Kernel::Elementwise { out: dst, inputs, expr }, label.clone(), Ok(rows_of(&part)));
                }
                Ok(out)
            }
            Op::MatMul => {
                let float = if ty.dtype.is_float() { ty.dtype } else { DType::F32 };
                let a = self.view(args[0])?;
                let rank_a = a.shape.len();
                let a_float = if a.dtype.is_float() { a.dtype } else { DType::F32 };
                let a = self.dense_if(v, a, a_float, |x| x.unit_stride(rank_a - 1));
                let b = self.view(args[1])?;
                let rank_b = b.shape.len();
                let b_float = if b.dtype.is_float() { b.dtype } else { DType::F32 };
                let b_transposed = b.dtype == b_float && !b.unit_stride(rank_b - 1) && b.unit_stride(rank_b - 2);
                let b = if b_transposed { b } else { self.dense_if(v, b, b_float, |x| x.unit_stride(rank_b - 1)) };
                let c = self.temp(v, float, &ty.shape);
                self.step(Kernel::MatMul { a, b, c: c.clone(), b_transposed }, label, Err(Tuning::Items));
                Ok(c)
            }
            Op::Reduce { op, axes, keepdim } => {
                let x = self.view(args[0])?;
                let kept: Vec<Dim> =
                    x.shape.iter().enumerate().map(|(k, d)| if axes.contains(&k) { Dim::constant(1) } else { d.clone() }).collect();
                let out = self.temp(v, ty.dtype, &kept);
                self.step(Kernel::Reduce { x, op: *op, axes: axes.clone(), out: out.clone() }, label, Ok(Dim::product(&kept)));
                let _ = keepdim;
                Ok(View::contiguous(out.buf, ty.dtype, ty.shape.clone()))
            }
            Op::Softmax { axis } => {
                let x = self.view(args[0])?;
                let out = self.temp(v, ty.dtype, &ty.shape);
                let rows: Vec<Dim> = ty.shape.iter().enumerate().filter(|(k, _)| k != axis).map(|(_, d)| d.clone()).collect();
                self.step(Kernel::Softmax { x, axis: *axis, out: out.clone() }, label, Ok(Dim::product(&rows)));
                Ok(out)
            }
            Op::LayerNorm { eps } | Op::RmsNorm { eps } => {
                let x = self.view(args[0])?;
                let gamma = self.view(args[1])?;
                let beta = if matches!(node.op, Op::LayerNorm { .. }) { Some(self.view(args[2])?) } else { None };
                let out = self.temp(v, ty.dtype, &ty.shape);
                let kernel = Kernel::Norm { x, gamma, beta, eps: *eps, out: out.clone() };
                self.step(kernel, label, Ok(rows_of(&ty.shape)));
                Ok(out)
            }
            Op::Flash(spec) => self.flash(v, spec, &args, label),
            other => Err(self.unsupported(v, format!("no CPU lowering for `{}`", other.name()))),
        }
    }

    fn flash(&mut self, v: Value, spec: &FlashSpec, args: &[Value], label: String) -> Result<View, CodegenError> {
        let ty = self.g.node(v).ty.clone();
        if args.len() < 3 {
            return Err(self.unsupported(v, "flash needs q, k and v"));
        }
        let mut qkv = Vec::new();
        let mut q_scale = None;
        for (n, a) in args[..3].iter().enumerate() {
            let a = match (n, self.folded[a.index()].clone()) {
                (0, Some((x, c))) => {
                    q_scale = Some(c);
                    x
                }
                _ => *a,
            };
            let x = self.view(a)?;
            let last = x.shape.len().saturating_sub(1);
            qkv.push(self.dense_if(v, x.clone(), x.dtype, |x| x.unit_stride(last)));
        }
        let mut extras = Vec::new();
        for a in &args[3..] {
            extras.push(self.view(*a)?);
        }
        let out = self.temp(v, ty.dtype, &ty.shape);
        let tiles = self.buffer(BufferKind::TileTable { step: self.plan.steps.len() }, DType::I32, Dim::constant(0), v);
        let partials = self.buffer(BufferKind::Partials { step: self.plan.steps.len() }, DType::F32, Dim::constant(0), v);
        let (score, alpha) = split_scale(&spec.score);
        let alpha = match (alpha, q_scale) {
            (Some(a), Some(c)) => Some(ScoreExpr::bin(BinaryOp::Mul, a, c)),
            (a, c) => a.or(c),
        };
        let [q, k, vv]: [View; 3] = qkv.try_into().map_err(|_| self.unsupported(v, "flash needs q, k and v"))?;
        let kernel = FlashKernel {
            spec: FlashSpec { score, ..spec.clone() },
            q,
            k,
            v: vv,
            extras,
            out: out.clone(),
            step: self.plan.steps.len(),
            tiles,
            partials,
            alpha,
        };
        self.step(Kernel::Flash(Box::new(kernel.clone())), label.clone(), Err(Tuning::Items));
        self.step(Kernel::FlashMerge(Box::new(kernel)), format!("{label} (merge)"), Err(Tuning::Items));
        Ok(out)
    }

    /// Makes every output a dense buffer of its own.
    fn outputs(&mut self) -> Result<(), CodegenError> {
        for (i, (_, v)) in self.g.outputs().to_vec().into_iter().enumerate() {
            let view = self.view(v)?;
            let ty = self.g.node(v).ty.clone();
            let buf = &self.plan.buffers[view.buf];
            let whole = view.is_contiguous() && view.offset.as_const() == Some(0) && buf.elems == Dim::product(&ty.shape);
            if buf.kind == BufferKind::Temp && whole && view.dtype == ty.dtype {
                self.plan.buffers[view.buf].kind = BufferKind::Output(i);
                self.plan.outputs.push(view.buf);
                continue;
            }
            let buf = self.buffer(BufferKind::Output(i), ty.dtype, Dim::product(&ty.shape), v);
            let out = View::contiguous(buf, ty.dtype, ty.shape.clone());
            let label = format!("{} (output copy)", self.label(v));
            self.step(Kernel::Elementwise { out, inputs: vec![view], expr: Expr::Load(0) }, label, Ok(rows_of(&ty.shape)));
            self.plan.outputs.push(buf);
        }
        Ok(())
    }
}

/// Work items of an element-wise kernel: the product of all axes but the last.
fn rows_of(shape: &[Dim]) -> Dim {
    match shape.split_last() {
        Some((_, rest)) => Dim::product(rest),
        None => Dim::constant(1),
    }
}

/// Buffers a kernel reads and writes.
fn touches(k: &Kernel) -> (Vec<usize>, Vec<usize>) {
    let bufs = |views: &[&View]| views.iter().map(|v| v.buf).collect::<Vec<_>>();
    match k {
        Kernel::Elementwise { out, inputs, .. } => (inputs.iter().map(|v| v.buf).collect(), vec![out.buf]),
        Kernel::MatMul { a, b, c, .. } => (bufs(&[a, b]), vec![c.buf]),
        Kernel::Reduce { x, out, .. } | Kernel::Softmax { x, out, .. } => (vec![x.buf], vec![out.buf]),
        Kernel::Norm { x, gamma, beta, out, .. } => {
            let mut r = bufs(&[x, gamma]);
            r.extend(beta.iter().map(|b| b.buf));
            (r, vec![out.buf])
        }
        Kernel::Flash(f) | Kernel::FlashMerge(f) => {
            let mut r = bufs(&[&f.q, &f.k, &f.v]);
            r.extend(f.extras.iter().map(|x| x.buf));
            r.push(f.tiles);
            r.push(f.partials);
            (r, vec![f.out.buf, f.partials])
        }
    }
}

/// Splits a softmax score `s * c` (or `s / c`, `c * s`) with a position-free `c` into the
/// plain score and `c`, so the scale rides on the Q·Kᵀ product (for either kind of weights).
pub(super) fn split_scale(score: &ScoreExpr) -> (ScoreExpr, Option<ScoreExpr>) {
    let constant = |e: &ScoreExpr| !e.any(&|x| matches!(x, ScoreExpr::Score | ScoreExpr::Pos(_) | ScoreExpr::Load { .. }));
    match score {
        ScoreExpr::Binary(BinaryOp::Mul, a, b) if **a == ScoreExpr::Score && constant(b) => (ScoreExpr::Score, Some((**b).clone())),
        ScoreExpr::Binary(BinaryOp::Mul, a, b) if **b == ScoreExpr::Score && constant(a) => (ScoreExpr::Score, Some((**a).clone())),
        ScoreExpr::Binary(BinaryOp::Div, a, b) if **a == ScoreExpr::Score && constant(b) => {
            (ScoreExpr::Score, Some(ScoreExpr::bin(BinaryOp::Div, ScoreExpr::Float(1.0), (**b).clone())))
        }
        _ => (score.clone(), None),
    }
}
