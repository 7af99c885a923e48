//! Reverse-mode differentiation of a graph: the derivative rule of every differentiable op,
//! defined once, beside the ops' meaning ([`super::semantics`]) and types ([`super::infer`]).
//!
//! [`differentiate`] turns an entry point `f(params) -> results` into
//! `f_grad(params, d_<result>...) -> (results, d_<param>...)`: one cotangent input per float
//! result, one gradient output per float parameter (or per parameter named in `wrt`). The
//! derived graph is an ordinary graph of the same ops, so every backend runs it and the
//! optimizer fuses its forward part as usual.
//!
//! Non-differentiable points take the usual subgradients: `relu`, `abs` and comparisons
//! at 0 give 0; `min`/`max` (element-wise) send the gradient to the left operand on ties, and
//! reductions `max`/`min` share it evenly between tied elements; `floor` has gradient 0; a
//! `where` sends the gradient to the branch it took and none to the condition. Integer and bool
//! values carry no gradient. A gather's table gradient is a scatter-add into the flattened
//! table.

use super::dim::Dim;
use super::flash_spec::{FlashSpec, Weights};
use super::graph::{Graph, Value};
use super::infer::infer;
use super::op::{BinaryOp, FlashWrt, Op, ReduceOp, ScanOp, UnaryOp};
use super::semantics::Class;
use super::types::{DType, TensorType};
use std::collections::{HashMap, HashSet};
use thiserror::Error;

mod rules;
mod saved;
pub use saved::split_saved;
mod score;

use rules::Algebra;
pub use score::{LoadGrad, ScoreGrad, score_grad};

/// Why a graph could not be differentiated.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum GradError {
    /// An op on the path from a parameter to a result has no derivative rule.
    #[error("`{graph}`: `{op}` has no derivative rule")]
    Unsupported {
        /// The entry point.
        graph: String,
        /// The op.
        op: String,
    },
    /// A `wrt` name that is no float parameter.
    #[error("`{graph}`: cannot differentiate with respect to `{name}`: {reason}")]
    Wrt {
        /// The entry point.
        graph: String,
        /// The name given.
        name: String,
        /// Why not.
        reason: String,
    },
    /// A derived name (`d_x`) that is already a parameter or result name.
    #[error("`{graph}`: the derived program would have two values named `{name}`; rename the parameter or result")]
    NameClash {
        /// The entry point.
        graph: String,
        /// The name.
        name: String,
    },
    /// A flash op's derivative cannot be fused (a reason the fused backward does not cover);
    /// [`crate::Compiler::differentiate`] then differentiates the unfused program.
    #[error("`{graph}`: the flash backward cannot be fused: {reason}")]
    Unfused {
        /// The entry point.
        graph: String,
        /// Why not.
        reason: String,
    },
    /// The graph has a cycle, or a derived node did not type-check (a bug).
    #[error("`{graph}`: internal error while differentiating: {reason}")]
    Internal {
        /// The entry point.
        graph: String,
        /// What went wrong.
        reason: String,
    },
}

/// The cotangent input for result `name`.
pub fn cotangent_name(result: &str) -> String {
    format!("d_{result}")
}

/// `graph` with its gradients: see the module documentation. `wrt` names the parameters to
/// differentiate with respect to (`None`: every float parameter). The derived graph is named
/// `<name>_grad`.
pub fn differentiate(graph: &Graph, wrt: Option<&[String]>) -> Result<Graph, GradError> {
    let name = graph.name.clone();
    let internal = |reason: String| GradError::Internal { graph: name.clone(), reason };
    let params: Vec<(String, Value, TensorType)> =
        graph.params().iter().map(|p| (graph.param_name(*p).to_string(), *p, graph.node(*p).ty.clone())).collect();
    let targets = targets(&name, &params, wrt)?;
    let order = graph.topo_order().ok_or_else(|| internal("the graph has a cycle".into()))?;

    // Values that depend on a target parameter: only their adjoints are needed.
    let mut needs: HashSet<Value> = targets.iter().map(|(_, v, _)| *v).collect();
    for v in &order {
        if graph.node(*v).ty.dtype.is_float() && graph.operands(*v).iter().any(|o| needs.contains(o)) {
            needs.insert(*v);
        }
    }

    let mut b = Builder { g: graph.clone(), name: name.clone() };
    b.g.name = format!("{name}_grad");
    let mut taken: HashSet<String> = params.iter().map(|(n, _, _)| n.clone()).collect();
    taken.extend(graph.outputs().iter().map(|(n, _)| n.clone()));
    let mut adjoint: HashMap<Value, Value> = HashMap::new();
    for (out_name, v) in graph.outputs() {
        let ty = graph.node(*v).ty.clone();
        if !ty.dtype.is_float() {
            continue;
        }
        let d = cotangent_name(out_name);
        if !taken.insert(d.clone()) {
            return Err(GradError::NameClash { graph: name.clone(), name: d });
        }
        let seed = b.g.add(Op::Param(d), ty, &[]);
        if needs.contains(v) {
            b.accumulate(&mut adjoint, *v, seed)?;
        }
    }
    // A flash op and its log-sum-exp (same spec and operands) are differentiated together, at
    // whichever comes first in `order` (both adjoints are complete there).
    let twins = lse_twins(graph);
    let position: HashMap<Value, usize> = order.iter().enumerate().map(|(i, v)| (*v, i)).collect();
    for v in order.iter().rev() {
        if !needs.contains(v) {
            continue;
        }
        let (node, contributions) = match twins.get(v) {
            Some(t) if position.get(t) < position.get(v) => continue,
            Some(t) => {
                let pair = if matches!(graph.node(*v).op, Op::Flash(_)) { (*v, *t) } else { (*t, *v) };
                let adjoints = (adjoint.get(&pair.0).copied(), adjoint.get(&pair.1).copied());
                match b.flash_pair(graph, pair, adjoints, &needs)? {
                    Some(c) => (pair.0, c),
                    None => continue,
                }
            }
            None => {
                let Some(g) = adjoint.get(v).copied() else { continue };
                (*v, b.rule(graph, *v, &graph.operands(*v), g, &needs)?)
            }
        };
        let operands = graph.operands(node);
        for (slot, contribution) in contributions {
            let operand = operands[slot];
            if needs.contains(&operand) {
                let c = b.unbroadcast(contribution, &graph.node(operand).ty)?;
                b.accumulate(&mut adjoint, operand, c)?;
            }
        }
    }
    for (pname, p, ty) in targets {
        let d = cotangent_name(pname);
        if !taken.insert(d.clone()) {
            return Err(GradError::NameClash { graph: name.clone(), name: d });
        }
        let grad = match adjoint.get(p) {
            Some(g) => *g,
            None => b.zeros(&ty.shape, ty.dtype)?,
        };
        b.g.add_output(d, grad);
    }
    // Rules build both operands' gradients; drop those no output uses.
    Ok(b.g.compact())
}

/// The parameters whose gradients are asked for: `wrt` (each once, in its order), or every float
/// parameter.
fn targets<'p>(
    graph: &str,
    params: &'p [(String, Value, TensorType)],
    wrt: Option<&[String]>,
) -> Result<Vec<&'p (String, Value, TensorType)>, GradError> {
    let Some(names) = wrt else { return Ok(params.iter().filter(|(_, _, t)| t.dtype.is_float()).collect()) };
    let mut out: Vec<&(String, Value, TensorType)> = Vec::new();
    for n in names {
        let wrong = |reason: String| GradError::Wrt { graph: graph.to_string(), name: n.clone(), reason };
        let Some(p) = params.iter().find(|(pn, _, _)| pn == n) else {
            let known: Vec<&str> = params.iter().map(|(pn, _, _)| pn.as_str()).collect();
            return Err(wrong(format!("no parameter has that name (its parameters: {})", known.join(", "))));
        };
        if !p.2.dtype.is_float() {
            return Err(wrong(format!("it is {}, and only floating-point parameters have gradients", p.2)));
        }
        if !out.iter().any(|q| q.0 == *n) {
            out.push(p);
        }
    }
    Ok(out)
}

/// Each softmax flash op paired with a `flash_lse` of the same spec and operands, both ways.
fn lse_twins(graph: &Graph) -> HashMap<Value, Value> {
    let mut out = HashMap::new();
    for v in graph.values() {
        let Op::FlashLse(spec) = &graph.node(v).op else { continue };
        let operands = graph.operands(v);
        let Some(first) = operands.first() else { continue };
        let twin = graph.users(*first).into_iter().find(|u| {
            matches!(&graph.node(*u).op, Op::Flash(f) if **f == **spec) && graph.operands(*u) == operands && !out.contains_key(u)
        });
        if let Some(f) = twin {
            out.insert(f, v);
            out.insert(v, f);
        }
    }
    out
}

struct Builder {
    g: Graph,
    name: String,
}

impl Algebra for Builder {
    type V = Value;
    type E = GradError;

    fn unary(&mut self, op: UnaryOp, a: Value) -> Result<Value, GradError> {
        self.un(op, a)
    }

    fn binary(&mut self, op: BinaryOp, a: Value, b: Value) -> Result<Value, GradError> {
        self.bin(op, a, b)
    }

    fn select(&mut self, c: Value, a: Value, b: Value) -> Result<Value, GradError> {
        self.add(Op::Select, &[c, a, b], None)
    }

    fn float(&mut self, c: f64, like: &Value) -> Result<Value, GradError> {
        self.fconst(c, *like)
    }

    fn zero_of(&mut self, x: &Value) -> Result<Value, GradError> {
        self.konst(0.0, self.ty(*x).dtype)
    }
}

impl Builder {
    fn internal(&self, reason: String) -> GradError {
        GradError::Internal { graph: self.name.clone(), reason }
    }

    /// Adds a node typed by [`infer`].
    fn add(&mut self, op: Op, args: &[Value], declared: Option<TensorType>) -> Result<Value, GradError> {
        let tys: Vec<&TensorType> = args.iter().map(|a| &self.g.node(*a).ty).collect();
        let ty = infer(&op, &tys, declared.as_ref()).map_err(|e| self.internal(format!("{}: {e}", op.name())))?;
        Ok(self.g.add(op, ty, args))
    }

    fn ty(&self, v: Value) -> &TensorType {
        &self.g.node(v).ty
    }

    fn konst(&mut self, c: f64, dtype: DType) -> Result<Value, GradError> {
        self.add(Op::Const(c), &[], Some(TensorType::scalar(dtype)))
    }

    /// A float constant in `like`'s dtype.
    fn fconst(&mut self, c: f64, like: Value) -> Result<Value, GradError> {
        let dtype = self.ty(like).dtype;
        self.konst(c, if dtype.is_float() { dtype } else { DType::F32 })
    }

    fn bin(&mut self, op: BinaryOp, a: Value, b: Value) -> Result<Value, GradError> {
        self.add(Op::Binary(op), &[a, b], None)
    }

    fn un(&mut self, op: UnaryOp, a: Value) -> Result<Value, GradError> {
        self.add(Op::Unary(op), &[a], None)
    }

    fn sum(&mut self, x: Value, axes: Vec<usize>, keepdim: bool) -> Result<Value, GradError> {
        if axes.is_empty() {
            return Ok(x);
        }
        self.add(Op::Reduce { op: ReduceOp::Sum, axes, keepdim }, &[x], None)
    }

    fn reshape(&mut self, x: Value, shape: &[Dim]) -> Result<Value, GradError> {
        if self.ty(x).shape == shape {
            return Ok(x);
        }
        let ty = TensorType::new(self.ty(x).dtype, shape.to_vec());
        self.add(Op::Reshape, &[x], Some(ty))
    }

    fn cast(&mut self, x: Value, dtype: DType) -> Result<Value, GradError> {
        if self.ty(x).dtype == dtype {
            return Ok(x);
        }
        let ty = TensorType::new(dtype, self.ty(x).shape.clone());
        self.add(Op::Cast, &[x], Some(ty))
    }

    /// Zeros of a shape (a scalar constant cannot have one: `cast(iota * 0)`).
    fn zeros(&mut self, shape: &[Dim], dtype: DType) -> Result<Value, GradError> {
        if shape.is_empty() {
            return self.konst(0.0, dtype);
        }
        let iota = self.add(Op::Iota { axis: 0 }, &[], Some(TensorType::new(DType::I32, shape.to_vec())))?;
        let zero = self.konst(0.0, DType::I32)?;
        let z = self.mul(iota, zero)?;
        self.cast(z, dtype)
    }

    /// `x` broadcast to `shape` (which it broadcasts into).
    fn broadcast(&mut self, x: Value, shape: &[Dim]) -> Result<Value, GradError> {
        if self.ty(x).shape == shape {
            return Ok(x);
        }
        let z = self.zeros(shape, self.ty(x).dtype)?;
        self.bin(BinaryOp::Add, x, z)
    }

    fn swap_last(&mut self, x: Value) -> Result<Value, GradError> {
        let r = self.ty(x).rank();
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(r - 2, r - 1);
        self.add(Op::Transpose { perm }, &[x], None)
    }

    /// Sums a gradient of a broadcast result down to the operand's type.
    fn unbroadcast(&mut self, g: Value, to: &TensorType) -> Result<Value, GradError> {
        let from = self.ty(g).shape.clone();
        let extra = from.len().checked_sub(to.rank()).ok_or_else(|| self.internal(format!("gradient {from:?} is smaller than {to}")))?;
        let mut g = self.sum(g, (0..extra).collect(), false)?;
        let one = Dim::constant(1);
        let axes: Vec<usize> = (0..to.rank()).filter(|k| to.shape[*k] == one && from[extra + k] != one).collect();
        g = self.sum(g, axes, true)?;
        if self.ty(g).shape != to.shape {
            return Err(self.internal(format!("gradient of shape {:?} for an operand {to}", self.ty(g).shape)));
        }
        if to.dtype.is_float() { self.cast(g, to.dtype) } else { Ok(g) }
    }

    fn accumulate(&mut self, adjoint: &mut HashMap<Value, Value>, v: Value, g: Value) -> Result<(), GradError> {
        let total = match adjoint.get(&v) {
            Some(prev) => self.bin(BinaryOp::Add, *prev, g)?,
            None => g,
        };
        adjoint.insert(v, total);
        Ok(())
    }

    /// The contributions of a flash op `f` and its log-sum-exp `l` (`pair`) to the flash op's
    /// operands, from their adjoints (either may be absent: the flash op's is then zero), as
    /// [`Builder::rule`] gives them; `None` when neither has an adjoint.
    fn flash_pair(
        &mut self,
        graph: &Graph,
        (f, l): (Value, Value),
        adjoints: (Option<Value>, Option<Value>),
        needs: &HashSet<Value>,
    ) -> Result<Option<Vec<(usize, Value)>>, GradError> {
        let (gf, gl) = match adjoints {
            (None, None) => return Ok(None),
            (Some(g), gl) => (g, gl),
            (None, gl) => {
                let t = graph.node(f).ty.clone();
                (self.zeros(&t.shape, t.dtype)?, gl)
            }
        };
        let Op::Flash(spec) = &graph.node(f).op else { return Err(self.internal("a log-sum-exp's twin is not a flash op".into())) };
        self.flash(spec, &graph.operands(f), (f, Some(l)), (gf, gl), needs).map(Some)
    }

    /// The contributions of `v`'s adjoint `g` to its operands, as (slot, gradient of the
    /// node's shape or the operand's): the derivative rule of `v`'s op.
    fn rule(&mut self, graph: &Graph, v: Value, x: &[Value], g: Value, needs: &HashSet<Value>) -> Result<Vec<(usize, Value)>, GradError> {
        let node = graph.node(v);
        let y = v;
        let unsupported = || GradError::Unsupported { graph: self.name.clone(), op: node.op.name().to_string() };
        Ok(match &node.op {
            // An order is an integer: no gradient flows through it (sorted values are gathers).
            Op::Param(_) | Op::Const(_) | Op::DimValue(_) | Op::Iota { .. } | Op::ArgSort { .. } => vec![],
            Op::Unary(u) => match rules::unary(self, *u, x[0], y, g)? {
                Some(d) => vec![(0, d)],
                None => vec![],
            },
            Op::Binary(op) => rules::binary(self, *op, x[0], x[1], y, g)?,
            Op::Select => rules::select(self, x[0], g)?,
            Op::Cast => vec![(0, g)],
            Op::MatMul => {
                let (a, bb) = (x[0], x[1]);
                let bt = self.swap_last(bb)?;
                let at = self.swap_last(a)?;
                vec![(0, self.add(Op::MatMul, &[g, bt], None)?), (1, self.add(Op::MatMul, &[at, g], None)?)]
            }
            Op::Transpose { perm } => {
                let mut inv = vec![0; perm.len()];
                for (k, p) in perm.iter().enumerate() {
                    inv[*p] = k;
                }
                vec![(0, self.add(Op::Transpose { perm: inv }, &[g], None)?)]
            }
            Op::Reshape => {
                let shape = graph.node(x[0]).ty.shape.clone();
                vec![(0, self.reshape(g, &shape)?)]
            }
            Op::Slice { axis, start, end } => vec![(0, self.slice_grad(graph, x[0], g, *axis, (start, end))?)],
            Op::Concat { axis } => self.concat_grad(graph, x, g, *axis)?,
            Op::Gather => vec![(0, self.gather_table(graph, x, g)?)],
            // The pages' gradient: the expansion's gather, scattered back (the table is an
            // integer: none).
            Op::Paged => {
                let (pages, table) = (graph.node(x[0]).ty.clone(), graph.node(x[1]).ty.clone());
                let mut args = vec![x[0]];
                args.extend(super::paged::gather_indices(self, &pages, (x[1], &table))?);
                let g = self.reshape(g, &super::paged::gathered_shape(&pages, &table))?;
                vec![(0, self.gather_table(graph, &args, g)?)]
            }
            // The same elements dropped from the cotangent, scaled alike (the seed is an integer).
            Op::Dropout { rate } => vec![(0, self.add(Op::Dropout { rate: *rate }, &[g, x[1]], None)?)],
            Op::Reduce { op, axes, .. } => vec![(0, self.reduce_grad(graph, x[0], y, g, *op, axes)?)],
            Op::Softmax { axis } => {
                // y (g - Σ g y)
                let gy = self.mul(g, y)?;
                let s = self.sum(gy, vec![*axis], true)?;
                let c = self.bin(BinaryOp::Sub, g, s)?;
                vec![(0, self.mul(y, c)?)]
            }
            Op::PrefixAttention { reverse } => {
                // out_i = Σ_{j ≤ i} (q_i·k_j) v_j: dq_i = Σ_{j ≤ i} (g_i·v_j) k_j; dk_j =
                // Σ_{i ≥ j} (v_j·g_i) q_i; dv_j = Σ_{i ≥ j} (k_j·q_i) g_i (the other direction).
                let (q, k, v) = (x[0], x[1], x[2]);
                let same = Op::PrefixAttention { reverse: *reverse };
                let other = Op::PrefixAttention { reverse: !*reverse };
                vec![
                    (0, self.add(same, &[g, v, k], None)?),
                    (1, self.add(other.clone(), &[v, g, q], None)?),
                    (2, self.add(other, &[k, q, g], None)?),
                ]
            }
            Op::Scan { op, axis, reverse } => self.scan_grad(x, y, g, *op, *axis, *reverse)?,
            Op::ScatterAdd { axis } => self.scatter_add_grad(graph, x, g, *axis)?,
            Op::LayerNorm { eps } => self.layer_norm(graph, x, g, *eps, true)?,
            Op::RmsNorm { eps } => self.layer_norm(graph, x, g, *eps, false)?,
            Op::Flash(spec) => self.flash(spec, x, (y, None), (g, None), needs)?,
            // With its flash op, the pair is differentiated at once (`differentiate`); alone, the
            // unfused graph is.
            Op::FlashLse(_) => {
                return Err(GradError::Unfused {
                    graph: self.name.clone(),
                    reason: "a log-sum-exp without its attention (no flash op of the same scores) has no fused derivative".into(),
                });
            }
            Op::FlashGrad { .. } => return Err(unsupported()),
        })
    }

    /// A slice's gradient: `g` padded with zeros back to the operand's axis.
    fn slice_grad(&mut self, graph: &Graph, x: Value, g: Value, axis: usize, (start, end): (&Dim, &Dim)) -> Result<Value, GradError> {
        let xt = graph.node(x).ty.clone();
        let mut parts = Vec::new();
        if start.as_const() != Some(0) {
            let mut s = xt.shape.clone();
            s[axis] = start.clone();
            parts.push(self.zeros(&s, self.ty(g).dtype)?);
        }
        parts.push(g);
        if *end != xt.shape[axis] {
            let mut s = xt.shape.clone();
            s[axis] = xt.shape[axis].sub(end);
            parts.push(self.zeros(&s, self.ty(g).dtype)?);
        }
        if parts.len() == 1 { Ok(g) } else { self.add(Op::Concat { axis }, &parts, None) }
    }

    /// A concatenation's gradients: each operand's slice of `g`.
    fn concat_grad(&mut self, graph: &Graph, x: &[Value], g: Value, axis: usize) -> Result<Vec<(usize, Value)>, GradError> {
        let mut out = Vec::new();
        let mut offset = Dim::constant(0);
        for (slot, operand) in x.iter().enumerate() {
            let len = graph.node(*operand).ty.shape[axis].clone();
            let end = offset.add(&len);
            let piece = self.add(Op::Slice { axis, start: offset.clone(), end: end.clone() }, &[g], None)?;
            out.push((slot, piece));
            offset = end;
        }
        Ok(out)
    }

    /// A reduction's gradient: `g` broadcast back (divided by the count for a mean; shared
    /// among the tied elements for a max or min; weighted by the softmax for a log-sum-exp).
    fn reduce_grad(&mut self, graph: &Graph, x: Value, y: Value, g: Value, op: ReduceOp, axes: &[usize]) -> Result<Value, GradError> {
        let xt = graph.node(x).ty.clone();
        let kept: Vec<Dim> =
            xt.shape.iter().enumerate().map(|(k, d)| if axes.contains(&k) { Dim::constant(1) } else { d.clone() }).collect();
        let gk = self.reshape(g, &kept)?;
        match op {
            ReduceOp::Sum => self.broadcast(gk, &xt.shape),
            ReduceOp::Mean => {
                let n = Dim::product(axes.iter().map(|a| &xt.shape[*a]));
                let n = self.add(Op::DimValue(n), &[], None)?;
                let gm = self.bin(BinaryOp::Div, gk, n)?;
                self.broadcast(gm, &xt.shape)
            }
            // The softmax of x over the axes times g; 0 where every element was -inf.
            ReduceOp::LogSumExp => {
                let yk = self.reshape(y, &kept)?;
                let shifted = self.bin(BinaryOp::Sub, x, yk)?;
                let w = self.un(UnaryOp::Exp, shifted)?;
                let ninf = self.fconst(f64::NEG_INFINITY, y)?;
                let live = self.bin(BinaryOp::Ne, yk, ninf)?;
                let w = self.keep(live, w)?;
                self.bin(BinaryOp::Mul, w, gk)
            }
            ReduceOp::Max | ReduceOp::Min => {
                let yk = self.reshape(y, &kept)?;
                let hit = self.bin(BinaryOp::Eq, x, yk)?;
                let one = self.fconst(1.0, g)?;
                let ones = self.keep(hit, one)?;
                let ties = self.sum(ones, axes.to_vec(), true)?;
                let share = self.bin(BinaryOp::Div, gk, ties)?;
                self.keep(hit, share)
            }
        }
    }

    /// A scan's gradients: scans the other way.
    fn scan_grad(
        &mut self,
        x: &[Value],
        y: Value,
        g: Value,
        op: ScanOp,
        axis: usize,
        reverse: bool,
    ) -> Result<Vec<(usize, Value)>, GradError> {
        let back = |b: &mut Builder, op: ScanOp, args: &[Value]| b.add(Op::Scan { op, axis, reverse: !reverse }, args, None);
        Ok(match op {
            // Each x_i feeds every later output: the gradient is the reverse running sum.
            ScanOp::Sum => vec![(0, back(self, ScanOp::Sum, &[g])?)],
            // ∂y_k/∂x_i = y_k / x_i for k ≥ i (x_i ≠ 0).
            ScanOp::Prod => {
                let gy = self.mul(g, y)?;
                let t = back(self, ScanOp::Sum, &[gy])?;
                vec![(0, self.bin(BinaryOp::Div, t, x[0])?)]
            }
            // h_i = a_i h_(i-1) + b_i: λ_i = g_i + a_(i+1) λ_(i+1) (a scan the other way
            // over a shifted by one), db = λ, da_i = λ_i h_(i-1).
            ScanOp::Linear => {
                let shape = self.ty(y).shape.clone();
                let a = self.broadcast(x[0], &shape)?;
                let a_next = self.shift(a, axis, !reverse)?;
                let lambda = back(self, ScanOp::Linear, &[a_next, g])?;
                let h_prev = self.shift(y, axis, reverse)?;
                vec![(0, self.mul(lambda, h_prev)?), (1, lambda)]
            }
        })
    }

    /// A scatter-add's gradients: the values' is the result's gradient where each was added (the
    /// same clamped position: a gather); the base's passes through.
    fn scatter_add_grad(&mut self, graph: &Graph, x: &[Value], g: Value, axis: usize) -> Result<Vec<(usize, Value)>, GradError> {
        let src = graph.node(x[2]).ty.clone();
        let mut operands = vec![g];
        for k in 0..src.rank() {
            if k == axis {
                operands.push(x[1]);
                continue;
            }
            let mut shape = vec![Dim::constant(1); src.rank()];
            shape[k] = src.shape[k].clone();
            operands.push(self.add(Op::Iota { axis: k }, &[], Some(TensorType::new(DType::I32, shape)))?);
        }
        Ok(vec![(0, g), (2, self.add(Op::Gather, &operands, None)?)])
    }

    /// The fused derivative of a flash op (FlashAttention-2's backward): its per-row
    /// log-sum-exp ([`Op::FlashLse`]) and its result for softmax weights, then one
    /// [`Op::FlashGrad`] per operand that needs a gradient (q, k, v, and the float extras the
    /// score modification loads). Backends compute all of them in one pass that recomputes the
    /// weights tile by tile, so no score-sized buffer exists. An extra operand whose gradient is
    /// as large as the scores (it has a query or key axis) is refused with
    /// [`GradError::Unfused`].
    fn flash(
        &mut self,
        spec: &FlashSpec,
        x: &[Value],
        (y, lse): (Value, Option<Value>),
        (g, d_lse): (Value, Option<Value>),
        needs: &HashSet<Value>,
    ) -> Result<Vec<(usize, Value)>, GradError> {
        let r = spec.rank;
        let unfused = |reason: String| GradError::Unfused { graph: self.name.clone(), reason };
        if spec.pair != crate::ir::Pair::Dot {
            return Err(unfused("additive scores have no fused derivative yet; the unfused graph is differentiated".into()));
        }
        let extras = &x[3..];
        let dtypes: Vec<DType> = extras.iter().map(|e| self.ty(*e).dtype).collect();
        let class = |n: usize| dtypes.get(n).map_or(Class::Float, |d| Class::of(*d));
        let derivative = score_grad(spec, &class).map_err(&unfused)?;
        let mut seq: Vec<String> = Vec::new();
        for v in [x[0], x[1]] {
            seq.extend(self.ty(v).shape.get(r - 2).map(Dim::symbols).unwrap_or_default());
        }
        let mut wanted = Vec::new();
        for (n, e) in extras.iter().enumerate() {
            if !needs.contains(e) || !dtypes[n].is_float() || !derivative.loads.iter().any(|l| l.input == n) {
                continue;
            }
            let t = self.ty(*e);
            if t.shape.iter().flat_map(Dim::symbols).any(|s| seq.contains(&s)) {
                return Err(unfused(format!(
                    "the flash op's operand x{n} ({t}) has a query or key axis, so its gradient is as large as the scores"
                )));
            }
            wanted.push((3 + n, FlashWrt::Extra(n)));
        }
        let mut operands = vec![x[0], x[1], x[2], g];
        let lse_grad = d_lse.is_some() && spec.weights == Weights::Softmax;
        if spec.weights == Weights::Softmax {
            // The forward's own log-sum-exp where it has one (so one step computes both).
            let lse = match lse {
                Some(l) => l,
                None => self.add(Op::FlashLse(Box::new(spec.clone())), x, None)?,
            };
            operands.extend([lse, y]);
            operands.extend(d_lse.filter(|_| lse_grad));
        }
        operands.extend_from_slice(extras);
        let mut out = Vec::new();
        let fixed = [(0, FlashWrt::Q), (1, FlashWrt::K), (2, FlashWrt::V)];
        for (slot, wrt) in fixed.into_iter().filter(|(slot, _)| needs.contains(&x[*slot])).chain(wanted) {
            out.push((slot, self.add(Op::FlashGrad { spec: Box::new(spec.clone()), wrt, lse_grad }, &operands, None)?));
        }
        Ok(out)
    }

    /// `x` moved one step along `axis`, zero-filled: towards the end (`out_i = x_(i-1)`), or
    /// towards the start (`out_i = x_(i+1)`) when `to_start`.
    fn shift(&mut self, x: Value, axis: usize, to_start: bool) -> Result<Value, GradError> {
        let shape = self.ty(x).shape.clone();
        let n = shape[axis].clone();
        let one = Dim::constant(1);
        let mut zshape = shape.clone();
        zshape[axis] = one.clone();
        let zero = self.zeros(&zshape, self.ty(x).dtype)?;
        let (start, end) = if to_start { (one.clone(), n.clone()) } else { (Dim::constant(0), n.sub(&one)) };
        let kept = self.add(Op::Slice { axis, start, end }, &[x], None)?;
        let parts = if to_start { [kept, zero] } else { [zero, kept] };
        self.add(Op::Concat { axis }, &parts, None)
    }

    /// The table gradient of `table[i0, i1, ...]`: every element of `g` added (scatter-add) at
    /// the flat position its clamped indices name in the flattened table. Memory is the index
    /// positions plus the table, never their product.
    fn gather_table(&mut self, graph: &Graph, x: &[Value], g: Value) -> Result<Value, GradError> {
        let table = graph.node(x[0]).ty.clone();
        let p = self.ty(g).shape.clone();
        let mut flat: Option<Value> = None;
        for (k, idx) in x[1..].iter().enumerate() {
            // Indices are clamped into range (the gather's meaning), then weighted by the
            // table's row-major stride.
            let lo = self.konst(0.0, DType::I32)?;
            let n = self.add(Op::DimValue(table.shape[k].clone()), &[], None)?;
            let one = self.konst(1.0, DType::I32)?;
            let hi = self.bin(BinaryOp::Sub, n, one)?;
            let i = self.bin(BinaryOp::Max, *idx, lo)?;
            let i = self.bin(BinaryOp::Min, i, hi)?;
            let stride = self.add(Op::DimValue(Dim::product(&table.shape[k + 1..])), &[], None)?;
            let term = self.mul(i, stride)?;
            flat = Some(match flat {
                Some(f) => self.bin(BinaryOp::Add, f, term)?,
                None => term,
            });
        }
        let flat = flat.ok_or_else(|| self.internal("gather without indices".into()))?;
        let positions = [Dim::product(&p)];
        let flat = self.broadcast(flat, &p)?;
        let flat = self.reshape(flat, &positions)?;
        let values = self.reshape(g, &positions)?;
        let zeros = self.zeros(&[Dim::product(&table.shape)], self.ty(g).dtype)?;
        let summed = self.add(Op::ScatterAdd { axis: 0 }, &[zeros, flat, values], None)?;
        self.reshape(summed, &table.shape)
    }

    /// Layer norm (`centered`) or RMS norm over the last axis: gradients of x, gamma (and
    /// beta).
    fn layer_norm(&mut self, graph: &Graph, x: &[Value], g: Value, eps: f64, centered: bool) -> Result<Vec<(usize, Value)>, GradError> {
        let xv = x[0];
        let last = graph.node(xv).ty.rank() - 1;
        let mean = |b: &mut Builder, v: Value| b.add(Op::Reduce { op: ReduceOp::Mean, axes: vec![last], keepdim: true }, &[v], None);
        let xc = if centered {
            let mu = mean(self, xv)?;
            self.bin(BinaryOp::Sub, xv, mu)?
        } else {
            xv
        };
        let sq = self.mul(xc, xc)?;
        let var = mean(self, sq)?;
        let e = self.fconst(eps, var)?;
        let var = self.bin(BinaryOp::Add, var, e)?;
        let rstd = self.un(UnaryOp::Rsqrt, var)?;
        let xhat = self.mul(xc, rstd)?;
        let dxhat = self.mul(g, x[1])?;
        // dx = rstd (dxhat - [mean(dxhat)] - xhat mean(dxhat xhat))
        let dx_xhat = self.mul(dxhat, xhat)?;
        let m2 = mean(self, dx_xhat)?;
        let t = self.mul(xhat, m2)?;
        let mut inner = self.bin(BinaryOp::Sub, dxhat, t)?;
        if centered {
            let m1 = mean(self, dxhat)?;
            inner = self.bin(BinaryOp::Sub, inner, m1)?;
        }
        let dx = self.mul(inner, rstd)?;
        let mut out = vec![(0, dx), (1, self.mul(g, xhat)?)];
        if x.len() > 2 {
            out.push((2, g));
        }
        Ok(out)
    }
}

impl super::paged::AddNode for Builder {
    type Error = GradError;
    fn node(&mut self, op: Op, args: &[Value], declared: Option<TensorType>) -> Result<Value, GradError> {
        self.add(op, args, declared)
    }
}

#[cfg(test)]
mod tests;
