//! Graph → [`Schedule`]: decides which values live in memory and which are computed inline,
//! turns layout ops into views, groups element-wise chains into one kernel each, lists the
//! steps in order, picks each tiled kernel's variant for the target, analyses the flash ops,
//! and registers every integer a renderer reads.
//!
//! Rules:
//! - Element-wise ops (unary, binary, select, cast, constants, dim values, iota, gather) are
//!   inlined into their user when they have one user that is itself element-wise (or a concat,
//!   or a reduction: [`Kernel::ReduceOf`] computes each element as it reads it); constants, dim
//!   values, iota and subtrees of at most [`MAX_SHARED_OPS`] cheap ops are inlined into any
//!   number of such users. The rest are kernel roots whose result is stored, and so is every
//!   [`MAX_INLINE_DEPTH`]-th op of a longer chain.
//! - Transpose and slice are views; reshape is a view of a dense operand and a copy otherwise.
//! - Matmul and flash read their operands in place when the inner axis has unit stride
//!   (transposed K of `q @ k.T` included); otherwise a dense copy is made first.
//! - An output is written by the step that computes it when that step's buffer is dense and
//!   wholly the output's; otherwise it is copied.

use super::flash::FlashAnalysis;
use super::policy::{CUDA_MAX_HEAD, Policy, Target};
use super::{
    Buffer, BufferKind, Check, Expr, FlashBwdKernel, FlashKernel, Fused, IntValue, Kernel, Schedule, ScheduleError, Step, Tuning, View,
    row_major,
};
use crate::ir::semantics::Class;
use crate::ir::{BinaryOp, DType, Dim, FlashSpec, FlashWrt, Graph, Op, ScoreExpr, Value, value_numbers};
use std::collections::HashMap;

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
    policy: &'g Policy,
    plan: Schedule,
    place: Vec<Option<Place>>,
    numbers: Vec<usize>,
    /// Query scalings folded into flash ops (see [`folded_scales`]).
    folded: Vec<Option<(Value, ScoreExpr)>>,
    /// Flash ops and the `flash_lse` of the same op, which their step writes too.
    lse_of: HashMap<Value, Value>,
    /// The other way.
    flash_of: HashMap<Value, Value>,
    /// The `flash_grad` nodes of one flash op, which one step computes, by any member.
    grads: HashMap<Value, Vec<Value>>,
    /// A query gradient read only by scalings `g * c …`: the products and the scale, which the
    /// backward step applies to its `dQ` products (see [`scaled_grads`]).
    scaled: HashMap<Value, (Vec<Value>, ScoreExpr)>,
}

/// Builds the schedule of a graph (which must verify).
pub fn lower(g: &Graph, policy: &Policy) -> Result<Schedule, ScheduleError> {
    let order = g.topo_order().ok_or_else(|| ScheduleError::Invalid { graph: g.name.clone(), reason: "the graph has a cycle".into() })?;
    let mut l = Lowering {
        g,
        policy,
        plan: Schedule::new(&g.name, policy.target()),
        place: vec![None; g.len()],
        numbers: value_numbers(g),
        folded: Vec::new(),
        lse_of: HashMap::new(),
        flash_of: HashMap::new(),
        grads: HashMap::new(),
        scaled: HashMap::new(),
    };
    let live = live_values(g);
    let inline = inline_set(g, &live);
    l.folded = folded_scales(g, &live);
    l.lse_of = lse_partners(g, &live);
    l.flash_of = l.lse_of.iter().map(|(f, s)| (*s, *f)).collect();
    l.grads = grad_groups(g, &live);
    l.scaled = scaled_grads(g, &live);
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
    register_ints(&mut l.plan);
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

/// `q * c` (or `c * q`) feeding only flash ops' queries (a flash op, its log-sum-exp, its
/// gradients), with `c` a scalar expression: the scale rides on the Q·Kᵀ product (and the
/// backward's `dK` product) instead of a scaled copy of q. Maps such products to
/// (the unscaled operand, the scale).
fn folded_scales(g: &Graph, live: &[bool]) -> Vec<Option<(Value, ScoreExpr)>> {
    g.values()
        .map(|v| {
            let node = g.node(v);
            if !live[v.index()] || node.op != Op::Binary(BinaryOp::Mul) || !node.ty.dtype.is_float() {
                return None;
            }
            // Read only as the query of flash-family ops (a flash op, its log-sum-exp and its
            // gradients), once each.
            let users: Vec<Value> = g.users(v).into_iter().filter(|u| live[u.index()]).collect();
            let only_query = !users.is_empty() && users.iter().all(|u| {
                // A scale of an additive score's query does not factor out of the `tanh`.
                matches!(&g.node(*u).op, Op::Flash(f) | Op::FlashLse(f) | Op::FlashGrad { spec: f, .. } if f.pair == crate::ir::Pair::Dot)
                    && g.operands(*u).iter().position(|a| *a == v) == Some(0)
                    && g.operands(*u).iter().filter(|a| **a == v).count() == 1
            }) && !g.outputs().iter().any(|(_, o)| *o == v);
            if !only_query {
                return None;
            }
            let (x, e) = scaled(g, v)?;
            Some(scale_chain(g, live, x, e))
        })
        .collect()
}

/// `x * c` (or `c * x`) with `c` a scalar expression and `x` of the product's type: `(x, c)`.
fn scaled(g: &Graph, v: Value) -> Option<(Value, ScoreExpr)> {
    let node = g.node(v);
    if node.op != Op::Binary(BinaryOp::Mul) || !node.ty.dtype.is_float() {
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
}

/// `(x, c)` with `x` itself a scaled value read only here (`x = y * c'`, not an output)
/// followed down to `(y, c' · c)`, and so on: a chain of scales folds into one.
fn scale_chain(g: &Graph, live: &[bool], mut x: Value, mut c: ScoreExpr) -> (Value, ScoreExpr) {
    loop {
        let users = g.users(x).into_iter().filter(|u| live[u.index()]).count();
        let output = g.outputs().iter().any(|(_, o)| *o == x);
        match scaled(g, x) {
            Some((y, c2)) if users == 1 && !output => {
                x = y;
                c = ScoreExpr::bin(BinaryOp::Mul, c2, c);
            }
            _ => return (x, c),
        }
    }
}

/// Every live flash op with a live `flash_lse` of the same op (spec and operands), which its
/// step then writes too.
fn lse_partners(g: &Graph, live: &[bool]) -> HashMap<Value, Value> {
    let mut out = HashMap::new();
    for v in g.values().filter(|v| live[v.index()]) {
        let Op::FlashLse(spec) = &g.node(v).op else { continue };
        let operands = g.operands(v);
        let Some(first) = operands.first() else { continue };
        let twin = g.users(*first).into_iter().find(|u| {
            live[u.index()] && matches!(&g.node(*u).op, Op::Flash(f) if **f == **spec) && g.operands(*u) == operands && !out.contains_key(u)
        });
        if let Some(f) = twin {
            out.insert(f, v);
        }
    }
    out
}

/// The live `flash_grad` nodes grouped by flash op (spec and operands): each member maps to the
/// whole group, in graph order.
fn grad_groups(g: &Graph, live: &[bool]) -> HashMap<Value, Vec<Value>> {
    let mut groups: Vec<Vec<Value>> = Vec::new();
    for v in g.values().filter(|v| live[v.index()]) {
        let Op::FlashGrad { spec, .. } = &g.node(v).op else { continue };
        let operands = g.operands(v);
        let same = |u: &Value| matches!(&g.node(*u).op, Op::FlashGrad { spec: s, .. } if s == spec) && g.operands(*u) == operands;
        match groups.iter_mut().find(|grp| grp.first().is_some_and(same)) {
            Some(grp) => grp.push(v),
            None => groups.push(vec![v]),
        }
    }
    groups.into_iter().flat_map(|grp| grp.clone().into_iter().map(move |v| (v, grp.clone()))).collect()
}

/// Query gradients (`flash_grad` with `wrt=q`) read only by a chain of scalings `g * c1 * c2 …`
/// with scalar `c`s (the derivative of a query the schedule scaled): maps each to the chain's
/// products (the last one holds the value) and the product of the scales, so that the backward
/// step writes the last product directly.
fn scaled_grads(g: &Graph, live: &[bool]) -> HashMap<Value, (Vec<Value>, ScoreExpr)> {
    let mut out = HashMap::new();
    for v in g.values().filter(|v| live[v.index()]) {
        if !matches!(g.node(v).op, Op::FlashGrad { wrt: FlashWrt::Q, .. }) {
            continue;
        }
        let (mut at, mut chain, mut scale) = (v, Vec::new(), None::<ScoreExpr>);
        loop {
            let users: Vec<Value> = g.users(at).into_iter().filter(|u| live[u.index()]).collect();
            if g.outputs().iter().any(|(_, o)| *o == at) {
                break;
            }
            let [m] = users[..] else { break };
            match scaled(g, m) {
                Some((x, c)) if x == at && g.operands(m).iter().filter(|a| **a == at).count() == 1 => {
                    scale = Some(match scale {
                        Some(s) => ScoreExpr::bin(BinaryOp::Mul, s, c),
                        None => c,
                    });
                    chain.push(m);
                    at = m;
                }
                _ => break,
            }
        }
        if let Some(s) = scale {
            out.insert(v, (chain, s));
        }
    }
    out
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

/// The deepest expression tree an element-wise kernel computes: a chain of element-wise ops
/// longer than this is stored every this many ops. It bounds the recursion of every pass over
/// an expression (building, rendering, emulating) whatever the program's length.
pub const MAX_INLINE_DEPTH: usize = 64;

/// The most operations an element-wise value with several users may take to be recomputed by
/// each of them instead of stored: a subtraction and a cast recomputed beat a write and reads of
/// a tensor that can be far larger than its operands (`κ - u` broadcast to `[B, T, K, U]` in
/// `examples/location_attention.attn`).
pub const MAX_SHARED_OPS: usize = 4;

/// What computing `op` once costs, in [`MAX_SHARED_OPS`] units: `None` for the ops too
/// expensive to compute twice (transcendental functions, division, powers, and gathers, whose
/// scattered reads cost more than a stored copy's: `examples/reformer.attn` ran 45% slower
/// with its sorted queries gathered by each of their three users).
fn shared_cost(op: &Op) -> Option<usize> {
    use crate::ir::{BinaryOp as B, UnaryOp as U};
    match op {
        Op::Const(_) | Op::DimValue(_) | Op::Iota { .. } => Some(0),
        Op::Cast | Op::Select => Some(1),
        Op::Unary(U::Neg | U::Not | U::Relu | U::Abs | U::Floor) => Some(1),
        Op::Binary(B::Div | B::Rem | B::Pow) => None,
        Op::Binary(_) => Some(1),
        _ => None,
    }
}

/// Whether `op` (a user of `v`) is a reduction that computes `v` per element as it reads it
/// ([`Kernel::ReduceOf`]): any reduction of a tensor whose reduced axes are listed in order
/// (the order its elements are combined in).
fn reduces_inline(g: &Graph, v: Value, op: &Op) -> bool {
    let rank = g.node(v).ty.rank();
    matches!(op, Op::Reduce { axes, .. } if rank >= 1 && axes.windows(2).all(|w| w[0] < w[1]) && axes.iter().all(|a| *a < rank))
}

/// Which live values are computed inline by their users.
fn inline_set(g: &Graph, live: &[bool]) -> Vec<bool> {
    let mut is_output = vec![false; g.len()];
    for (_, v) in g.outputs() {
        is_output[v.index()] = true;
    }
    let mut inline = vec![false; g.len()];
    // Depth of the expression tree rooted at each value when it is computed inline, and its
    // cost (`None`: too expensive to compute more than once).
    let mut depth = vec![0usize; g.len()];
    let mut cost: Vec<Option<usize>> = vec![None; g.len()];
    for v in g.topo_order().unwrap_or_default() {
        let op = &g.node(v).op;
        if !live[v.index()] || is_output[v.index()] || !is_elementwise(op) {
            continue;
        }
        let users: Vec<Value> = g.users(v).into_iter().filter(|u| live[u.index()]).collect();
        // A gather's table is read at computed indices, so it must be in memory.
        let fits = |u: &Value| {
            let uop = &g.node(*u).op;
            let as_table = matches!(uop, Op::Gather) && g.operands(*u).first() == Some(&v);
            (is_elementwise(uop) || matches!(uop, Op::Concat { .. }) || reduces_inline(g, v, uop)) && !as_table
        };
        let cheap = matches!(op, Op::Const(_) | Op::DimValue(_) | Op::Iota { .. });
        depth[v.index()] = 1 + g.operands(v).iter().filter(|a| inline[a.index()]).map(|a| depth[a.index()]).max().unwrap_or(0);
        cost[v.index()] = shared_cost(op)
            .and_then(|own| g.operands(v).iter().filter(|a| inline[a.index()]).try_fold(own, |c, a| Some(c + cost[a.index()]?)));
        let shared = users.len() == 1 || cheap || cost[v.index()].is_some_and(|c| c <= MAX_SHARED_OPS);
        inline[v.index()] = !users.is_empty() && users.iter().all(fits) && shared && depth[v.index()] < MAX_INLINE_DEPTH;
    }
    inline
}

impl Lowering<'_> {
    fn label(&self, v: Value) -> String {
        format!("%{} {}", self.numbers[v.index()], self.g.node(v).op.name())
    }

    fn unsupported(&self, v: Value, reason: impl Into<String>) -> ScheduleError {
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

    fn buffer(&mut self, kind: BufferKind, dtype: DType, elems: Dim, v: Value) -> usize {
        self.plan.buffers.push(Buffer { kind, dtype, elems, value: self.numbers[v.index()] });
        self.plan.buffers.len() - 1
    }

    /// A dense temporary for the value `v` with the given type.
    fn temp(&mut self, v: Value, dtype: DType, shape: &[Dim]) -> View {
        let buf = self.buffer(BufferKind::Temp, dtype, Dim::product(shape), v);
        View::contiguous(buf, dtype, shape.to_vec())
    }

    /// Appends a step running `kernel`, with its work-item count and the tuning values the
    /// target's kernel reads in the integer table.
    fn step(&mut self, kernel: Kernel, label: String, v: Value) -> usize {
        let index = self.plan.steps.len();
        let span = self.g.node(v).span;
        let work = self.plan.int(IntValue::Tuning { step: index, param: Tuning::Items });
        for t in self.policy.tunings(&kernel) {
            self.plan.int(IntValue::Tuning { step: index, param: t });
        }
        let (reads, writes) = touches(&kernel);
        self.plan.steps.push(Step { work, kernel, label, span, reads, writes });
        index
    }

    /// The view of a value that is in memory, materialising an inline value if needed.
    fn view(&mut self, v: Value) -> Result<View, ScheduleError> {
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
        let label = format!("{} (copy)", self.label(v));
        self.step(Kernel::Elementwise { out: out.clone(), inputs: vec![view], expr, more: Vec::new() }, label, v);
        out
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
            _ => {
                let view = self.view(v)?;
                Expr::Load(load(view, inputs))
            }
        })
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
                // Parts of one shape are one pass (shared loads, each input row read once);
                // others a pass each: groups of (inputs, parts), one step per group.
                let one_pass = args.windows(2).all(|w| self.g.node(w[0]).ty.shape == self.g.node(w[1]).ty.shape);
                let mut groups: Vec<(Vec<View>, Parts)> = Vec::new();
                let mut at = Dim::constant(0);
                for a in args {
                    let part = self.g.node(a).ty.shape.clone();
                    let mut dst = out.clone();
                    dst.offset = at.mul(&out.strides[*axis]);
                    at = at.add(&part[*axis]);
                    dst.shape = part;
                    if !one_pass || groups.is_empty() {
                        groups.push((Vec::new(), Vec::new()));
                    }
                    let Some((inputs, parts)) = groups.last_mut() else { continue };
                    let expr = self.expr(a, inputs)?;
                    let expr = if self.g.node(a).ty.dtype == ty.dtype { expr } else { Expr::Cast(Box::new(expr), ty.dtype) };
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
                let variant = self.policy.matmul_variant(a.dtype, b.dtype);
                self.step(Kernel::MatMul { a, b, c: c.clone(), b_transposed, variant }, label, v);
                Ok(c)
            }
            Op::Reduce { op, axes, .. } => {
                // The result in keepdim layout: the reduced axes of the operand's shape at 1.
                let x_ty = self.g.node(args[0]).ty.clone();
                let kept: Vec<Dim> =
                    x_ty.shape.iter().enumerate().map(|(k, d)| if axes.contains(&k) { Dim::constant(1) } else { d.clone() }).collect();
                let (op, axes) = (*op, axes.clone());
                let (kernel, out) =
                    if matches!(self.place[args[0].index()], Some(Place::Inline)) && reduces_inline(self.g, args[0], &node.op) {
                        let mut inputs = Vec::new();
                        let expr = self.expr(args[0], &mut inputs)?;
                        let x = Fused { inputs, expr, shape: x_ty.shape, dtype: x_ty.dtype };
                        let out = self.temp(v, ty.dtype, &kept);
                        (Kernel::ReduceOf { x, op, axes, out: out.clone() }, out)
                    } else {
                        let x = self.view(args[0])?;
                        let out = self.temp(v, ty.dtype, &kept);
                        (Kernel::Reduce { x, op, axes, out: out.clone() }, out)
                    };
                self.step(kernel, label, v);
                Ok(View::contiguous(out.buf, ty.dtype, ty.shape.clone()))
            }
            Op::Softmax { axis } => {
                let x = self.view(args[0])?;
                let out = self.temp(v, ty.dtype, &ty.shape);
                self.step(Kernel::Softmax { x, axis: *axis, out: out.clone() }, label, v);
                Ok(out)
            }
            Op::Scan { op, axis, reverse } => {
                let mut views = Vec::with_capacity(args.len());
                for a in &args {
                    views.push(self.dense_as(*a, &ty.shape, v, &label)?);
                }
                let x = views.pop().ok_or_else(|| self.unsupported(v, "a scan without an operand"))?;
                let a = views.pop();
                let out = self.temp(v, ty.dtype, &ty.shape);
                self.step(Kernel::Scan { op: *op, a, x, axis: *axis, reverse: *reverse, out: out.clone() }, label, v);
                Ok(out)
            }
            Op::PrefixAttention { reverse } => {
                let dense = |l: &mut Self, a: Value| {
                    let view = l.view(a)?;
                    Ok::<View, ScheduleError>(l.dense_if(v, view, DType::F32, View::is_contiguous))
                };
                let (q, k, vv) = (dense(self, args[0])?, dense(self, args[1])?, dense(self, args[2])?);
                let out = self.temp(v, DType::F32, &ty.shape);
                self.step(Kernel::PrefixAttention { q, k, v: vv, reverse: *reverse, out: out.clone() }, label, v);
                Ok(if ty.dtype == DType::F32 { out } else { self.dense_if(v, out, ty.dtype, |_| true) })
            }
            Op::ScatterAdd { axis } => {
                let (base, idx, src) = (self.view(args[0])?, self.view(args[1])?, self.view(args[2])?);
                let out = self.temp(v, ty.dtype, &ty.shape);
                let site = self.site(v);
                self.step(Kernel::ScatterAdd { base, idx, src, axis: *axis, out: out.clone(), site }, label, v);
                Ok(out)
            }
            Op::ArgSort { axis, descending } => {
                let x = self.view(args[0])?;
                let out = self.temp(v, ty.dtype, &ty.shape);
                // CUDA merges sorted runs in parallel, from one permutation into another (unless
                // it selects a few leading places).
                let limit = self.sort_limit(v, *axis);
                let merges = limit.is_none_or(|k| k > super::policy::CUDA_SELECT_MAX);
                let scratch = (self.policy.target() == Target::Cuda && merges).then(|| self.temp(v, ty.dtype, &ty.shape));
                self.step(Kernel::ArgSort { x, axis: *axis, descending: *descending, out: out.clone(), scratch, limit }, label, v);
                Ok(out)
            }
            Op::LayerNorm { eps } | Op::RmsNorm { eps } => {
                let x = self.view(args[0])?;
                let gamma = self.view(args[1])?;
                let beta = if matches!(node.op, Op::LayerNorm { .. }) { Some(self.view(args[2])?) } else { None };
                let out = self.temp(v, ty.dtype, &ty.shape);
                let kernel = Kernel::Norm { x, gamma, beta, eps: *eps, out: out.clone() };
                self.step(kernel, label, v);
                Ok(out)
            }
            Op::Flash(spec) => {
                let lse = self.lse_of.get(&v).copied();
                self.flash(v, spec, &args, label, lse)
            }
            // With its flash op: that op's step writes it. Alone: a flash step whose result is
            // discarded computes it.
            Op::FlashLse(spec) => match self.flash_of.get(&v).copied() {
                Some(f) => {
                    self.view_of(f)?;
                    self.placed(v)
                }
                None => {
                    self.flash(v, spec, &args, label, Some(v))?;
                    self.placed(v)
                }
            },
            Op::FlashGrad { .. } => self.flash_grad(v),
            other => Err(self.unsupported(v, format!("no lowering for `{}`", other.name()))),
        }
    }

    /// Lowers `v` now if it is not placed yet (a node another node's step also computes), and
    /// returns its view.
    fn view_of(&mut self, v: Value) -> Result<View, ScheduleError> {
        if self.place[v.index()].is_none() {
            let view = self.node(v)?;
            self.place[v.index()] = Some(Place::View(view));
        }
        self.view(v)
    }

    /// The view a node's step already placed it at.
    fn placed(&self, v: Value) -> Result<View, ScheduleError> {
        match &self.place[v.index()] {
            Some(Place::View(view)) => Ok(view.clone()),
            _ => Err(self.unsupported(v, "the step computing this value did not place it")),
        }
    }

    /// A flash step (and its merge step); `lse` names the `flash_lse` node it also writes.
    fn flash(&mut self, v: Value, spec: &FlashSpec, args: &[Value], label: String, lse: Option<Value>) -> Result<View, ScheduleError> {
        let ty = self.g.node(v).ty.clone();
        let ty = match &self.g.node(v).op {
            // A lone log-sum-exp: the flash op's result goes to a temporary nobody reads.
            Op::FlashLse(_) => {
                crate::ir::infer(&Op::Flash(Box::new(spec.clone())), &self.operand_types(v), None).map_err(|e| self.unsupported(v, e))?
            }
            _ => ty,
        };
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
        let [q, k, vv]: [View; 3] = qkv.try_into().map_err(|_| self.unsupported(v, "flash needs q, k and v"))?;
        let r = q.shape.len();
        if let crate::ir::Pair::Additive { weight } = spec.pair {
            let w = extras.get(weight).cloned().ok_or_else(|| self.unsupported(v, "the additive weight is not an operand"))?;
            // Dense along its last axis (the kernels read it as a vector), in its own type.
            let (last, dtype) = (w.shape.len().saturating_sub(1), w.dtype);
            extras[weight] = self.dense_if(v, w, dtype, |x| x.unit_stride(last));
        }
        if self.policy.target() == Target::Cuda {
            for w in [&q.shape[r - 1], &vv.shape[r - 1]] {
                if let Some(c) = w.as_const().filter(|c| *c > CUDA_MAX_HEAD) {
                    return Err(self.unsupported(v, format!("head width {c} is above the {CUDA_MAX_HEAD} the CUDA kernels support")));
                }
            }
        }
        let out = self.temp(v, ty.dtype, &ty.shape);
        let lse = match lse {
            Some(s) => {
                let shape = ty.shape[..r - 1].to_vec();
                let view = self.temp(s, DType::F32, &shape);
                self.place[s.index()] = Some(Place::View(view.clone()));
                Some(view)
            }
            None => None,
        };
        let step = self.plan.steps.len();
        let tiles = self.buffer(BufferKind::TileTable { step }, DType::Bool, Dim::constant(0), v);
        let partials = self.buffer(BufferKind::Partials { step }, DType::F32, Dim::constant(0), v);
        let variant = self.policy.flash_variant([q.dtype, k.dtype, vv.dtype], q.shape[r - 2].as_const(), spec.pair == crate::ir::Pair::Dot);
        let analysis = FlashAnalysis::of(spec, q_scale);
        let kernel =
            FlashKernel { spec: spec.clone(), q, k, v: vv, extras, out: out.clone(), lse, step, tiles, partials, variant, analysis };
        self.step(Kernel::Flash(Box::new(kernel.clone())), label.clone(), v);
        self.step(Kernel::FlashMerge(Box::new(kernel)), format!("{label} (merge)"), v);
        Ok(out)
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

    fn operand_types(&self, v: Value) -> Vec<&crate::ir::TensorType> {
        self.g.operands(v).into_iter().map(|a| &self.g.node(a).ty).collect()
    }

    /// The step computing every gradient of the flash op whose `flash_grad` node `v` is one
    /// (each member placed at its result), and the merge of extra operands' gradients.
    fn flash_grad(&mut self, v: Value) -> Result<View, ScheduleError> {
        let members = self.grads.get(&v).cloned().unwrap_or_else(|| vec![v]);
        let Op::FlashGrad { spec, .. } = self.g.node(v).op.clone() else { return Err(self.unsupported(v, "not a flash_grad node")) };
        let args = self.g.operands(v);
        let fixed = spec.grad_fixed_operands();
        if args.len() < fixed {
            return Err(self.unsupported(v, format!("flash_grad needs {fixed} operands before its extras")));
        }
        let mut dense = Vec::new();
        let mut q_scale = None;
        for (n, a) in args[..4].iter().enumerate() {
            let a = match (n, self.folded[a.index()].clone()) {
                (0, Some((x, c))) => {
                    q_scale = Some(c);
                    x
                }
                _ => *a,
            };
            let x = self.view(a)?;
            let last = x.shape.len().saturating_sub(1);
            dense.push(self.dense_if(v, x.clone(), x.dtype, |x| x.unit_stride(last)));
        }
        let [q, k, vv, d_out]: [View; 4] = dense.try_into().map_err(|_| self.unsupported(v, "flash_grad needs q, k, v, d_out"))?;
        let r = q.shape.len();
        if self.policy.target() == Target::Cuda {
            for w in [&q.shape[r - 1], &vv.shape[r - 1]] {
                if let Some(c) = w.as_const().filter(|c| *c > CUDA_MAX_HEAD) {
                    return Err(self.unsupported(v, format!("head width {c} is above the {CUDA_MAX_HEAD} the CUDA kernels support")));
                }
            }
        }
        let lse = if fixed == 6 {
            let a = self.view(args[4])?;
            let a = self.dense_if(v, a, DType::F32, View::is_contiguous);
            let b = self.view(args[5])?;
            let last = b.shape.len().saturating_sub(1);
            let b = self.dense_if(v, b.clone(), b.dtype, |x| x.unit_stride(last));
            Some((a, b))
        } else {
            None
        };
        let mut extras = Vec::new();
        for a in &args[fixed..] {
            extras.push(self.view(*a)?);
        }
        let classes: Vec<Class> = extras.iter().map(|x| Class::of(x.dtype)).collect();
        let grad =
            crate::ir::grad::score_grad(&spec, &|x| classes.get(x).copied().unwrap_or(Class::Float)).map_err(|e| self.unsupported(v, e))?;
        let (mut dq, mut dk, mut dv, mut dx) = (None, None, None, Vec::new());
        let mut dq_scale = None;
        for m in &members {
            let Op::FlashGrad { wrt, .. } = &self.g.node(*m).op else { continue };
            let ty = self.g.node(*m).ty.clone();
            // A scaled query gradient: the step writes the last product's value in its place.
            let chain = match self.scaled.get(m) {
                Some((chain, c)) => {
                    dq_scale = Some(c.clone());
                    chain.clone()
                }
                None => Vec::new(),
            };
            let holder = chain.last().copied().unwrap_or(*m);
            let out = self.temp(holder, ty.dtype, &ty.shape);
            for x in std::iter::once(m).chain(&chain) {
                self.place[x.index()] = Some(Place::View(out.clone()));
            }
            match wrt {
                FlashWrt::Q => dq = Some(out),
                FlashWrt::K => dk = Some(out),
                FlashWrt::V => dv = Some(out),
                FlashWrt::Extra(n) => dx.push((*n, out)),
            }
        }
        let step = self.plan.steps.len();
        let tiles = self.buffer(BufferKind::TileTable { step }, DType::Bool, Dim::constant(0), v);
        let partials = self.buffer(BufferKind::Partials { step }, DType::F32, Dim::constant(0), v);
        let variant =
            self.policy.flash_bwd_variant([q.dtype, k.dtype, vv.dtype, d_out.dtype], spec.pair == crate::ir::Pair::Dot, !dx.is_empty());
        let wanted: Vec<usize> = dx.iter().map(|(n, _)| *n).collect();
        let linear = super::flash::BwdLinear::of(&spec, &grad, &wanted);
        let kernel = FlashBwdKernel {
            spec: *spec,
            q,
            q_scale,
            k,
            v: vv,
            d_out,
            lse,
            extras,
            dq,
            dq_scale,
            dk,
            dv,
            dx,
            grad,
            linear,
            step,
            tiles,
            partials,
            variant,
        };
        let label = self.label(v);
        let reduce = !kernel.dx.is_empty();
        self.step(Kernel::FlashBwd(Box::new(kernel.clone())), label.clone(), v);
        if reduce {
            self.step(Kernel::FlashBwdReduce(Box::new(kernel)), format!("{label} (extra gradients)"), v);
        }
        self.placed(v)
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

/// Buffers a kernel reads and writes.
fn touches(k: &Kernel) -> (Vec<usize>, Vec<usize>) {
    let bufs = |views: &[&View]| views.iter().map(|v| v.buf).collect::<Vec<_>>();
    match k {
        Kernel::Elementwise { out, inputs, more, .. } => {
            (inputs.iter().map(|v| v.buf).collect(), std::iter::once(out).chain(more.iter().map(|(o, _)| o)).map(|o| o.buf).collect())
        }
        Kernel::MatMul { a, b, c, .. } => (bufs(&[a, b]), vec![c.buf]),
        Kernel::Reduce { x, out, .. } | Kernel::Softmax { x, out, .. } => (vec![x.buf], vec![out.buf]),
        Kernel::ReduceOf { x, out, .. } => (x.inputs.iter().map(|v| v.buf).collect(), vec![out.buf]),
        Kernel::ArgSort { x, out, scratch, .. } => (vec![x.buf], std::iter::once(out).chain(scratch).map(|v| v.buf).collect()),
        Kernel::Scan { a, x, out, .. } => (a.iter().chain([x]).map(|v| v.buf).collect(), vec![out.buf]),
        Kernel::ScatterAdd { base, idx, src, out, .. } => (bufs(&[base, idx, src]), vec![out.buf]),
        Kernel::PrefixAttention { q, k, v, out, .. } => (bufs(&[q, k, v]), vec![out.buf]),
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
            let mut w = vec![f.out.buf, f.partials];
            w.extend(f.lse.iter().map(|x| x.buf));
            (r, w)
        }
        Kernel::FlashBwd(f) => {
            let mut r = bufs(&[&f.q, &f.k, &f.v, &f.d_out]);
            r.extend(f.lse.iter().flat_map(|(a, b)| [a.buf, b.buf]));
            r.extend(f.extras.iter().map(|x| x.buf));
            r.push(f.tiles);
            let mut w: Vec<usize> = [&f.dq, &f.dk, &f.dv].into_iter().flatten().map(|x| x.buf).collect();
            w.push(f.partials);
            (r, w)
        }
        Kernel::FlashBwdReduce(f) => (vec![f.partials], f.dx.iter().map(|(_, x)| x.buf).collect()),
    }
}

/// Registers every integer a renderer may read: the dims of every view, buffer, check and
/// expression, and every dim symbol on its own (so that any polynomial of them can be formed).
fn register_ints(plan: &mut Schedule) {
    let mut dims: Vec<Dim> = Vec::new();
    let mut add = |d: &Dim| {
        if d.as_const().is_none() && !dims.contains(d) {
            dims.push(d.clone());
        }
    };
    let view = |v: &View, add: &mut dyn FnMut(&Dim)| {
        add(&v.offset);
        v.shape.iter().chain(&v.strides).for_each(&mut *add);
    };
    for b in &plan.buffers {
        add(&b.elems);
    }
    for c in &plan.checks {
        for d in [&c.start, &c.end, &c.size] {
            add(d);
        }
    }
    for s in &plan.steps {
        match &s.kernel {
            Kernel::Elementwise { out, inputs, expr, more } => {
                view(out, &mut add);
                inputs.iter().for_each(|v| view(v, &mut add));
                for (o, e) in std::iter::once((out, expr)).chain(more.iter().map(|(o, e)| (o, e))) {
                    view(o, &mut add);
                    e.visit(&mut |e| {
                        if let Expr::Dim(d) = e {
                            add(d);
                        }
                    });
                }
            }
            Kernel::MatMul { a, b, c, .. } => [a, b, c].iter().for_each(|v| view(v, &mut add)),
            Kernel::Reduce { x, out, .. } | Kernel::Softmax { x, out, .. } => [x, out].iter().for_each(|v| view(v, &mut add)),
            Kernel::ReduceOf { x, out, .. } => {
                x.inputs.iter().chain([out]).for_each(|v| view(v, &mut add));
                x.shape.iter().for_each(&mut add);
                x.expr.visit(&mut |e| {
                    if let Expr::Dim(d) = e {
                        add(d);
                    }
                });
            }
            Kernel::ArgSort { x, out, scratch, .. } => {
                [Some(x), Some(out), scratch.as_ref()].into_iter().flatten().for_each(|v| view(v, &mut add))
            }
            Kernel::Scan { a, x, out, .. } => [a.as_ref(), Some(x), Some(out)].into_iter().flatten().for_each(|v| view(v, &mut add)),
            Kernel::ScatterAdd { base, idx, src, out, .. } => [base, idx, src, out].iter().for_each(|v| view(v, &mut add)),
            Kernel::PrefixAttention { q, k, v, out, .. } => [q, k, v, out].iter().for_each(|x| view(x, &mut add)),
            Kernel::Norm { x, gamma, beta, out, .. } => {
                [Some(x), Some(gamma), beta.as_ref(), Some(out)].into_iter().flatten().for_each(|v| view(v, &mut add))
            }
            Kernel::Flash(f) | Kernel::FlashMerge(f) => {
                [&f.q, &f.k, &f.v, &f.out].into_iter().chain(&f.extras).chain(&f.lse).for_each(|v| view(v, &mut add));
                super::score_dims(f).iter().for_each(&mut add);
            }
            Kernel::FlashBwd(f) | Kernel::FlashBwdReduce(f) => {
                let stats = f.lse.iter().flat_map(|(a, b)| [a, b]);
                let results = [&f.dq, &f.dk, &f.dv].into_iter().flatten().chain(f.dx.iter().map(|(_, x)| x));
                [&f.q, &f.k, &f.v, &f.d_out].into_iter().chain(stats).chain(&f.extras).chain(results).for_each(|v| view(v, &mut add));
                super::bwd_dims(f).iter().for_each(&mut add);
            }
        }
    }
    let mut symbols: Vec<String> = dims.iter().flat_map(|d| d.symbols()).collect();
    symbols.sort();
    symbols.dedup();
    for s in symbols {
        plan.int(IntValue::Dim(Dim::sym(&s)));
    }
    for d in dims {
        plan.int(IntValue::Dim(d));
    }
}
