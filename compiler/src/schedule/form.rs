//! Pass 2 of the schedule, kernel formation: walks the graph in topological order and gives
//! every stored value a buffer and a [`View`], and every computation a [`Step`] holding one
//! [`Kernel`], in execution order. It decides nothing about placement (pass 1, [`Placement`])
//! and leaves each step's reads, writes and integer slots to passes 3 and 4.
//!
//! - Transpose and slice are views; reshape is a view of a dense operand and a copy otherwise.
//! - Matmul and flash read their operands in place when the inner axis has unit stride
//!   (transposed K of `q @ k.T` included); otherwise a dense copy is made first.
//! - An output is written by the step that computes it when that step's buffer is dense and
//!   wholly the output's; otherwise it is copied.
//!
//! Flash ops and their gradients are formed in `form_attention.rs`.

use super::place::{Placement, is_elementwise, reduces_inline};
use super::policy::{Policy, Target};
use super::{Buffer, BufferKind, Check, Expr, Fused, Kernel, Paging, Schedule, ScheduleError, Step, View, row_major};
use crate::ir::{DType, Dim, Graph, Op, ReduceOp, Value, value_numbers};

/// Where a value lives.
#[derive(Clone, Debug)]
pub(super) enum Place {
    /// In memory, as a view.
    View(View),
    /// Computed inside its users' kernels.
    Inline,
    /// A paged cache seen through its block table (a `paged` node, or transposes of one),
    /// which only flash ops read, as their K or V (`legalize` expands every other): the view of
    /// one page ([`Paging`]), the paging, and the view's token axis.
    Paged(View, Paging, usize),
}

/// The state of kernel formation over one graph.
pub(super) struct Formation<'g> {
    pub g: &'g Graph,
    pub policy: &'g Policy,
    pub placement: Placement,
    pub plan: Schedule,
    pub place: Vec<Option<Place>>,
    numbers: Vec<usize>,
}

/// Forms the buffers, views and steps of `g` (which must verify) under `placement`.
pub(super) fn form(g: &Graph, policy: &Policy, placement: Placement) -> Result<Schedule, ScheduleError> {
    let order = g.topo_order().ok_or_else(|| ScheduleError::Invalid { graph: g.name.clone(), reason: "the graph has a cycle".into() })?;
    let mut f = Formation {
        g,
        policy,
        placement,
        plan: Schedule::new(&g.name, policy.target()),
        place: vec![None; g.len()],
        numbers: value_numbers(g),
    };
    for (i, p) in g.params().iter().enumerate() {
        let node = g.node(*p);
        let buf = f.buffer(BufferKind::Param(i), node.ty.dtype, Dim::product(&node.ty.shape), *p);
        f.plan.params.push(buf);
        f.place[p.index()] = Some(Place::View(View::contiguous(buf, node.ty.dtype, node.ty.shape.clone())));
    }
    for v in order {
        if !f.placement.live[v.index()] || f.place[v.index()].is_some() {
            continue;
        }
        if f.placement.computed_by_users(v) {
            f.place[v.index()] = Some(Place::Inline);
            continue;
        }
        if let Some(paged) = f.paged(v)? {
            f.place[v.index()] = Some(paged);
            continue;
        }
        let view = f.node(v)?;
        f.place[v.index()] = Some(Place::View(view));
    }
    f.outputs()?;
    Ok(f.plan)
}

impl Formation<'_> {
    pub fn label(&self, v: Value) -> String {
        format!("%{} {}", self.numbers[v.index()], self.g.node(v).op.name())
    }

    pub fn unsupported(&self, v: Value, reason: impl Into<String>) -> ScheduleError {
        ScheduleError::Unsupported {
            graph: self.g.name.clone(),
            span: self.g.node(v).span,
            value: self.numbers[v.index()],
            op: self.g.node(v).op.name().to_string(),
            reason: reason.into(),
        }
    }

    /// A new checked indexing site for node `v`, and the fault record it reports into.
    fn site(&mut self, v: Value) -> usize {
        if self.plan.fault.is_none() {
            let b = self.buffer(BufferKind::Fault, DType::I32, Dim::constant(super::FAULT_WORDS), v);
            self.plan.fault = Some(b);
        }
        let site = super::Site { label: format!("%{} ({})", self.numbers[v.index()], self.g.node(v).op.name()), span: self.g.node(v).span };
        self.plan.sites.push(site);
        self.plan.sites.len() - 1
    }

    pub fn buffer(&mut self, kind: BufferKind, dtype: DType, elems: Dim, v: Value) -> usize {
        self.plan.buffers.push(Buffer { kind, dtype, elems, value: self.numbers[v.index()] });
        self.plan.buffers.len() - 1
    }

    /// A dense temporary for the value `v` with the given type.
    pub fn temp(&mut self, v: Value, dtype: DType, shape: &[Dim]) -> View {
        let buf = self.buffer(BufferKind::Temp, dtype, Dim::product(shape), v);
        View::contiguous(buf, dtype, shape.to_vec())
    }

    /// Appends a step running `kernel` for node `v`; its reads, writes and work slot are filled
    /// in by the later passes.
    pub fn step(&mut self, kernel: Kernel, label: String, v: Value) -> usize {
        let span = self.g.node(v).span;
        self.plan.steps.push(Step { work: 0, kernel, label, span, reads: Vec::new(), writes: Vec::new() });
        self.plan.steps.len() - 1
    }

    /// The view of a value that is in memory, materialising an inline value if needed.
    pub fn view(&mut self, v: Value) -> Result<View, ScheduleError> {
        match &self.place[v.index()] {
            Some(Place::View(view)) => Ok(view.clone()),
            Some(Place::Inline) => {
                let view = self.elementwise_root(v)?;
                self.place[v.index()] = Some(Place::View(view.clone()));
                Ok(view)
            }
            Some(Place::Paged(..)) => Err(self.unsupported(v, "a paged cache read other than as a flash op's K or V")),
            None => Err(self.unsupported(v, "operand used before it is computed")),
        }
    }

    /// The place of a `paged` node, or of a transpose of one; `None` for other nodes.
    fn paged(&mut self, v: Value) -> Result<Option<Place>, ScheduleError> {
        let args = self.g.operands(v);
        match &self.g.node(v).op {
            Op::Paged => {
                let (pages, table) = (self.view(args[0])?, self.view(args[1])?);
                if pages.shape.len() < 2 || table.shape.len() != 2 {
                    return Err(self.unsupported(v, "paged needs pages [NP, P, …] and a table [B, MP]"));
                }
                let shape = self.g.node(v).ty.shape.clone();
                let mut strides = vec![Dim::constant(0), pages.strides[1].clone()];
                strides.extend(pages.strides[2..].iter().cloned());
                let paging = Paging {
                    table,
                    axis: 0,
                    page: pages.shape[1].clone(),
                    pages: pages.shape[0].clone(),
                    stride: pages.strides[0].clone(),
                };
                // Page ids are clamped into the pool, which must then hold a page.
                let (node, span) = (format!("{} (a pool of no pages)", self.label(v)), self.g.node(v).span);
                let (zero, one) = (Dim::constant(0), Dim::constant(1));
                self.plan.checks.push(Check { node, span, axis: 0, start: zero, end: one, size: paging.pages.clone() });
                Ok(Some(Place::Paged(View { shape, strides, ..pages }, paging, 1)))
            }
            Op::Transpose { perm } => {
                let Some(Place::Paged(view, paging, token)) = self.place[args[0].index()].clone() else { return Ok(None) };
                let rank = view.shape.len();
                if perm.len() != rank || perm.iter().any(|p| *p >= rank) {
                    return Err(self.unsupported(v, "bad permutation"));
                }
                let at = |old: usize| perm.iter().position(|p| *p == old).unwrap_or(old);
                let view = View {
                    shape: perm.iter().map(|p| view.shape[*p].clone()).collect(),
                    strides: perm.iter().map(|p| view.strides[*p].clone()).collect(),
                    ..view
                };
                Ok(Some(Place::Paged(view, Paging { axis: at(paging.axis), ..paging }, at(token))))
            }
            _ => Ok(None),
        }
    }

    /// `a`'s view and paging when it is a paged cache whose token axis is its second-to-last
    /// and its table axis a batch axis (a flash op's K or V read in place); `None` otherwise.
    pub fn paged_operand(&self, a: Value) -> Option<(View, Paging)> {
        match &self.place[a.index()] {
            Some(Place::Paged(view, paging, token)) => {
                let r = view.shape.len();
                (r >= 2 && *token == r - 2 && paging.axis < r - 2 && view.unit_stride(r - 1)).then(|| (view.clone(), paging.clone()))
            }
            _ => None,
        }
    }

    /// `view`, copied into a dense temporary (of type `dtype`) unless `keep` accepts it.
    pub fn dense_if(&mut self, v: Value, view: View, dtype: DType, keep: impl Fn(&View) -> bool) -> View {
        if view.dtype == dtype && keep(&view) {
            return view;
        }
        let out = self.temp(v, dtype, &view.shape);
        let expr = if view.dtype == dtype { Expr::Load(0) } else { Expr::Cast(Box::new(Expr::Load(0)), dtype) };
        let label = format!("{} (copy)", self.label(v));
        self.step(Kernel::Elementwise { out: out.clone(), inputs: vec![view], expr, more: Vec::new() }, label, v);
        out
    }

    /// `a`'s view, dense along its last axis (copied if not), in its own type.
    pub fn unit_last(&mut self, v: Value, a: Value) -> Result<View, ScheduleError> {
        let x = self.view(a)?;
        let last = x.shape.len().saturating_sub(1);
        let dtype = x.dtype;
        Ok(self.dense_if(v, x, dtype, |x| x.unit_stride(last)))
    }

    /// Builds the expression of `v` for a kernel, adding its loads to `inputs`.
    fn expr(&mut self, v: Value, inputs: &mut Vec<View>) -> Result<Expr, ScheduleError> {
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
        let sub = |l: &mut Self, k: usize, inputs: &mut Vec<View>| -> Result<Box<Expr>, ScheduleError> {
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
                Expr::Gather(t, idx, dtype, self.site(v))
            }
            Op::Dropout { rate } => {
                let (x, seed) = (*sub(self, 0, inputs)?, *sub(self, 1, inputs)?);
                super::dropout_expr(&node.ty.shape, *rate, dtype, x, seed)
            }
            _ => {
                let view = self.view(v)?;
                Expr::Load(load(view, inputs))
            }
        })
    }

    /// Dropout, stored: on the CPU an f32 tensor gets the row kernel ([`Kernel::Dropout`]: the
    /// generator vectorised), elsewhere the element-wise expression ([`super::dropout_expr`]).
    fn dropout(&mut self, v: Value, rate: f64, args: &[Value]) -> Result<View, ScheduleError> {
        let ty = self.g.node(v).ty.clone();
        if !matches!(self.policy, Policy::Cpu(_)) || ty.dtype != DType::F32 {
            return self.elementwise_root(v);
        }
        let x = self.view(args[0])?;
        let x = self.dense_if(v, x, DType::F32, View::is_contiguous);
        let seed = self.view(args[1])?;
        let out = self.temp(v, DType::F32, &ty.shape);
        self.step(Kernel::Dropout { x, seed, rate, out: out.clone() }, self.label(v), v);
        Ok(out)
    }

    /// Stores an element-wise value in a new dense temporary.
    fn elementwise_root(&mut self, v: Value) -> Result<View, ScheduleError> {
        let ty = self.g.node(v).ty.clone();
        // Compute the expression as if `v` were inline, whatever its place says.
        self.place[v.index()] = Some(Place::Inline);
        let mut inputs = Vec::new();
        let expr = self.expr(v, &mut inputs)?;
        let out = self.temp(v, ty.dtype, &ty.shape);
        let label = self.label(v);
        self.step(Kernel::Elementwise { out: out.clone(), inputs, expr, more: Vec::new() }, label, v);
        Ok(out)
    }

    /// Lowers one materialised node; returns where its value is.
    fn node(&mut self, v: Value) -> Result<View, ScheduleError> {
        let op = self.g.node(v).op.clone();
        let args = self.g.operands(v);
        match &op {
            Op::Param(_) => Err(self.unsupported(v, "a parameter outside the parameter list")),
            op if is_elementwise(op) => self.elementwise_root(v),
            Op::Dropout { rate } => self.dropout(v, *rate, &args),
            Op::Transpose { .. } | Op::Reshape | Op::Slice { .. } => self.layout(v, &op, args[0]),
            Op::Concat { axis } => self.concat(v, *axis, &args),
            Op::MatMul => self.matmul(v, args[0], args[1]),
            Op::Reduce { .. } => self.reduce(v, &op, args[0]),
            Op::Softmax { axis } => {
                let x = self.view(args[0])?;
                let ty = self.g.node(v).ty.clone();
                let out = self.temp(v, ty.dtype, &ty.shape);
                self.step(Kernel::Softmax { x, axis: *axis, out: out.clone() }, self.label(v), v);
                Ok(out)
            }
            Op::Scan { .. } | Op::PrefixAttention { .. } => self.scan(v, &op, &args),
            Op::ScatterAdd { axis } => {
                let (base, idx, src) = (self.view(args[0])?, self.view(args[1])?, self.view(args[2])?);
                let ty = self.g.node(v).ty.clone();
                let out = self.temp(v, ty.dtype, &ty.shape);
                let site = self.site(v);
                self.step(Kernel::ScatterAdd { base, idx, src, axis: *axis, out: out.clone(), site }, self.label(v), v);
                Ok(out)
            }
            Op::ArgSort { axis, descending } => self.argsort(v, *axis, *descending, args[0]),
            Op::LayerNorm { eps } | Op::RmsNorm { eps } => {
                let x = self.view(args[0])?;
                let gamma = self.view(args[1])?;
                let beta = if matches!(op, Op::LayerNorm { .. }) { Some(self.view(args[2])?) } else { None };
                let out = self.temp(v, self.g.node(v).ty.dtype, &self.g.node(v).ty.shape.clone());
                self.step(Kernel::Norm { x, gamma, beta, eps: *eps, out: out.clone() }, self.label(v), v);
                Ok(out)
            }
            Op::Flash(spec) => {
                let lse = self.placement.lse_of.get(&v).copied();
                self.flash(v, spec, &args, lse)
            }
            // With its flash op: that op's step writes it. Alone: a flash step whose result is
            // discarded computes it.
            Op::FlashLse(spec) => {
                match self.placement.flash_of.get(&v).copied() {
                    Some(f) => {
                        self.view_of(f)?;
                    }
                    None => {
                        self.flash(v, spec, &args, Some(v))?;
                    }
                }
                self.placed(v)
            }
            Op::FlashGrad { .. } => self.flash_grad(v),
            other => Err(self.unsupported(v, format!("no lowering for `{}`", other.name()))),
        }
    }

    /// A transpose or a slice (views of `x`), or a reshape (a view of `x`, copied dense first
    /// unless it is).
    fn layout(&mut self, v: Value, op: &Op, x: Value) -> Result<View, ScheduleError> {
        let x = self.view(x)?;
        match op {
            Op::Transpose { perm } => {
                if perm.len() != x.shape.len() || perm.iter().any(|p| *p >= x.shape.len()) {
                    return Err(self.unsupported(v, "bad permutation"));
                }
                Ok(View {
                    shape: perm.iter().map(|p| x.shape[*p].clone()).collect(),
                    strides: perm.iter().map(|p| x.strides[*p].clone()).collect(),
                    ..x
                })
            }
            Op::Slice { axis, start, end } => {
                let size = x.shape.get(*axis).cloned().ok_or_else(|| self.unsupported(v, "slice axis out of range"))?;
                let (node, span) = (self.label(v), self.g.node(v).span);
                self.plan.checks.push(Check { node, span, axis: *axis, start: start.clone(), end: end.clone(), size });
                let mut out = x;
                out.offset = out.offset.add(&start.mul(&out.strides[*axis]));
                out.shape[*axis] = end.sub(start);
                Ok(out)
            }
            _ => {
                let ty = self.g.node(v).ty.clone();
                // A dense view keeps its row-major strides; another is re-split in place where
                // its strides allow.
                if x.dtype == ty.dtype
                    && !x.is_contiguous()
                    && let Some(view) = x.reshaped(&ty.shape)
                {
                    return Ok(view);
                }
                let x = self.dense_if(v, x, ty.dtype, View::is_contiguous);
                Ok(View { strides: row_major(&ty.shape), shape: ty.shape, ..x })
            }
        }
    }

    /// A concatenation: parts of one shape are one pass (shared loads, each input row read
    /// once); others a pass each.
    fn concat(&mut self, v: Value, axis: usize, args: &[Value]) -> Result<View, ScheduleError> {
        let ty = self.g.node(v).ty.clone();
        let label = self.label(v);
        let out = self.temp(v, ty.dtype, &ty.shape);
        let one_pass = args.windows(2).all(|w| self.g.node(w[0]).ty.shape == self.g.node(w[1]).ty.shape);
        // Groups of (inputs, parts), one step per group.
        let mut groups: Vec<(Vec<View>, Parts)> = Vec::new();
        let mut at = Dim::constant(0);
        for a in args {
            let part = self.g.node(*a).ty.shape.clone();
            let mut dst = out.clone();
            dst.offset = at.mul(&out.strides[axis]);
            at = at.add(&part[axis]);
            dst.shape = part;
            if !one_pass || groups.is_empty() {
                groups.push((Vec::new(), Vec::new()));
            }
            let Some((inputs, parts)) = groups.last_mut() else { continue };
            let expr = self.expr(*a, inputs)?;
            let expr = if self.g.node(*a).ty.dtype == ty.dtype { expr } else { Expr::Cast(Box::new(expr), ty.dtype) };
            parts.push((dst, expr));
        }
        for (inputs, parts) in groups {
            let mut parts = parts.into_iter();
            if let Some((dst, expr)) = parts.next() {
                self.step(Kernel::Elementwise { out: dst, inputs, expr, more: parts.collect() }, label.clone(), v);
            }
        }
        Ok(out)
    }

    /// A batched matrix product, with `b` read transposed in place where that is dense.
    fn matmul(&mut self, v: Value, a: Value, b: Value) -> Result<View, ScheduleError> {
        let ty = self.g.node(v).ty.clone();
        let float = |d: DType| if d.is_float() { d } else { DType::F32 };
        let a = self.view(a)?;
        let rank_a = a.shape.len();
        let a_float = float(a.dtype);
        let a = self.dense_if(v, a, a_float, |x| x.unit_stride(rank_a - 1));
        let b = self.view(b)?;
        let rank_b = b.shape.len();
        let b_float = float(b.dtype);
        let b_transposed = b.dtype == b_float && !b.unit_stride(rank_b - 1) && b.unit_stride(rank_b - 2);
        let b = if b_transposed { b } else { self.dense_if(v, b, b_float, |x| x.unit_stride(rank_b - 1)) };
        let c = self.temp(v, float(ty.dtype), &ty.shape);
        let variant = self.policy.matmul_variant(a.dtype, b.dtype);
        self.step(Kernel::MatMul { a, b, c: c.clone(), b_transposed, variant }, self.label(v), v);
        Ok(c)
    }

    /// A reduction, computing an inline operand as it reads it ([`Kernel::ReduceOf`]).
    fn reduce(&mut self, v: Value, op: &Op, x: Value) -> Result<View, ScheduleError> {
        let Op::Reduce { op: which, axes, .. } = op else { return Err(self.unsupported(v, "not a reduction")) };
        if *which == ReduceOp::LogSumExp {
            return Err(self.unsupported(v, "a log-sum-exp reaches no kernel (it is expanded before kernel formation)"));
        }
        let ty = self.g.node(v).ty.clone();
        // The result in keepdim layout: the reduced axes of the operand's shape at 1.
        let x_ty = self.g.node(x).ty.clone();
        let kept: Vec<Dim> =
            x_ty.shape.iter().enumerate().map(|(k, d)| if axes.contains(&k) { Dim::constant(1) } else { d.clone() }).collect();
        let (which, axes) = (*which, axes.clone());
        let (kernel, out) = if matches!(self.place[x.index()], Some(Place::Inline)) && reduces_inline(self.g, x, op) {
            let mut inputs = Vec::new();
            let expr = self.expr(x, &mut inputs)?;
            let x = Fused { inputs, expr, shape: x_ty.shape, dtype: x_ty.dtype };
            let out = self.temp(v, ty.dtype, &kept);
            (Kernel::ReduceOf { x, op: which, axes, out: out.clone() }, out.buf)
        } else {
            let x = self.view(x)?;
            let out = self.temp(v, ty.dtype, &kept);
            (Kernel::Reduce { x, op: which, axes, out: out.clone() }, out.buf)
        };
        self.step(kernel, self.label(v), v);
        Ok(View::contiguous(out, ty.dtype, ty.shape))
    }

    /// A scan (its operands broadcast to the result's shape first), or causal linear attention
    /// (dense f32 operands).
    fn scan(&mut self, v: Value, op: &Op, args: &[Value]) -> Result<View, ScheduleError> {
        let ty = self.g.node(v).ty.clone();
        let label = self.label(v);
        if let Op::PrefixAttention { reverse } = op {
            let mut dense = Vec::new();
            for a in &args[..3] {
                let view = self.view(*a)?;
                dense.push(self.dense_if(v, view, DType::F32, View::is_contiguous));
            }
            let [q, k, vv]: [View; 3] = dense.try_into().map_err(|_| self.unsupported(v, "prefix_attention needs q, k, v"))?;
            let out = self.temp(v, DType::F32, &ty.shape);
            self.step(Kernel::PrefixAttention { q, k, v: vv, reverse: *reverse, out: out.clone() }, label, v);
            return Ok(if ty.dtype == DType::F32 { out } else { self.dense_if(v, out, ty.dtype, |_| true) });
        }
        let Op::Scan { op, axis, reverse } = op else { return Err(self.unsupported(v, "not a scan")) };
        let mut views = Vec::with_capacity(args.len());
        for a in args {
            views.push(self.dense_as(*a, &ty.shape, v, &label)?);
        }
        let x = views.pop().ok_or_else(|| self.unsupported(v, "a scan without an operand"))?;
        let a = views.pop();
        let out = self.temp(v, ty.dtype, &ty.shape);
        self.step(Kernel::Scan { op: *op, a, x, axis: *axis, reverse: *reverse, out: out.clone() }, label, v);
        Ok(out)
    }

    /// An argsort; CUDA merges sorted runs in parallel, from one permutation into another
    /// (unless it selects a few leading places).
    fn argsort(&mut self, v: Value, axis: usize, descending: bool, x: Value) -> Result<View, ScheduleError> {
        let ty = self.g.node(v).ty.clone();
        let x = self.view(x)?;
        let out = self.temp(v, ty.dtype, &ty.shape);
        let limit = self.sort_limit(v, axis);
        let merges = limit.is_none_or(|k| k > super::policy::CUDA_SELECT_MAX);
        let scratch = (self.policy.target() == Target::Cuda && merges).then(|| self.temp(v, ty.dtype, &ty.shape));
        self.step(Kernel::ArgSort { x, axis, descending, out: out.clone(), scratch, limit }, self.label(v), v);
        Ok(out)
    }

    /// Lowers `v` now if it is not placed yet (a node another node's step also computes), and
    /// returns its view.
    pub fn view_of(&mut self, v: Value) -> Result<View, ScheduleError> {
        if self.place[v.index()].is_none() {
            let view = self.node(v)?;
            self.place[v.index()] = Some(Place::View(view));
        }
        self.view(v)
    }

    /// The view a node's step already placed it at.
    pub fn placed(&self, v: Value) -> Result<View, ScheduleError> {
        match &self.place[v.index()] {
            Some(Place::View(view)) => Ok(view.clone()),
            _ => Err(self.unsupported(v, "the step computing this value did not place it")),
        }
    }

    /// How many leading places along `axis` the users of the sort `v` read, when every user is
    /// a slice `[0, k)` along that axis with a constant `k` (`topk`) and `v` is no output.
    fn sort_limit(&self, v: Value, axis: usize) -> Option<i64> {
        if self.g.outputs().iter().any(|(_, o)| *o == v) {
            return None;
        }
        let zero = Dim::constant(0);
        let mut limit = None;
        for u in self.g.users(v) {
            match &self.g.node(u).op {
                Op::Slice { axis: a, start, end } if *a == axis && *start == zero => {
                    let k = end.as_const()?;
                    limit = Some(limit.map_or(k, |l: i64| l.max(k)));
                }
                _ => return None,
            }
        }
        limit
    }

    /// `a`'s view with exactly `shape`: its own view when it has that shape, else a copy broadcast
    /// into a new buffer (for kernels that walk rows of several operands in step).
    fn dense_as(&mut self, a: Value, shape: &[Dim], v: Value, label: &str) -> Result<View, ScheduleError> {
        let view = self.view(a)?;
        if view.shape == shape {
            return Ok(view);
        }
        let out = self.temp(v, view.dtype, shape);
        self.step(
            Kernel::Elementwise { out: out.clone(), inputs: vec![view], expr: Expr::Load(0), more: Vec::new() },
            format!("{label} (broadcast)"),
            v,
        );
        Ok(out)
    }

    /// Makes every output a dense buffer of its own.
    fn outputs(&mut self) -> Result<(), ScheduleError> {
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
            self.step(Kernel::Elementwise { out, inputs: vec![view], expr: Expr::Load(0), more: Vec::new() }, label, v);
            self.plan.outputs.push(buf);
        }
        Ok(())
    }
}

/// The outputs of one element-wise pass and their expressions.
type Parts = Vec<(View, Expr)>;
