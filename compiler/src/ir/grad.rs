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
use super::graph::{Graph, Value};
use super::infer::infer;
use super::op::{BinaryOp, Op, ReduceOp, ScanOp, UnaryOp};
use super::types::{DType, TensorType};
use std::collections::{HashMap, HashSet};
use std::f64::consts::PI;
use thiserror::Error;

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
    let targets: Vec<&(String, Value, TensorType)> = match wrt {
        None => params.iter().filter(|(_, _, t)| t.dtype.is_float()).collect(),
        Some(names) => {
            let mut out = Vec::new();
            for n in names {
                let Some(p) = params.iter().find(|(pn, _, _)| pn == n) else {
                    let known: Vec<&str> = params.iter().map(|(pn, _, _)| pn.as_str()).collect();
                    return Err(GradError::Wrt {
                        graph: name.clone(),
                        name: n.clone(),
                        reason: format!("no parameter has that name (its parameters: {})", known.join(", ")),
                    });
                };
                if !p.2.dtype.is_float() {
                    return Err(GradError::Wrt {
                        graph: name.clone(),
                        name: n.clone(),
                        reason: format!("it is {}, and only floating-point parameters have gradients", p.2),
                    });
                }
                if !out.iter().any(|q: &&(String, Value, TensorType)| q.0 == *n) {
                    out.push(p);
                }
            }
            out
        }
    };
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
    for v in order.iter().rev() {
        if !needs.contains(v) {
            continue;
        }
        let Some(g) = adjoint.get(v).copied() else { continue };
        let operands = graph.operands(*v);
        for (slot, contribution) in b.rule(graph, *v, &operands, g)? {
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

struct Builder {
    g: Graph,
    name: String,
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

    fn mul(&mut self, a: Value, b: Value) -> Result<Value, GradError> {
        self.bin(BinaryOp::Mul, a, b)
    }

    fn scale(&mut self, a: Value, c: f64) -> Result<Value, GradError> {
        let k = self.fconst(c, a)?;
        self.mul(a, k)
    }

    fn select(&mut self, c: Value, a: Value, b: Value) -> Result<Value, GradError> {
        self.add(Op::Select, &[c, a, b], None)
    }

    /// `where(cond, g, 0)`.
    fn keep(&mut self, cond: Value, g: Value) -> Result<Value, GradError> {
        let zero = self.fconst(0.0, g)?;
        self.select(cond, g, zero)
    }

    /// `g` split by `cond`: `(where(cond, g, 0), where(cond, 0, g))`.
    fn route(&mut self, cond: Value, g: Value) -> Result<(Value, Value), GradError> {
        let zero = self.fconst(0.0, g)?;
        Ok((self.select(cond, g, zero)?, self.select(cond, zero, g)?))
    }

    /// Compares `x` with 0.
    fn cmp0(&mut self, op: BinaryOp, x: Value) -> Result<Value, GradError> {
        let zero = self.konst(0.0, self.ty(x).dtype)?;
        self.bin(op, x, zero)
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

    /// The contributions of `v`'s adjoint `g` to its operands, as (slot, gradient of the
    /// node's shape or the operand's): the derivative rule of `v`'s op.
    fn rule(&mut self, graph: &Graph, v: Value, x: &[Value], g: Value) -> Result<Vec<(usize, Value)>, GradError> {
        let node = graph.node(v);
        let y = v;
        let unsupported = || GradError::Unsupported { graph: self.name.clone(), op: node.op.name().to_string() };
        Ok(match &node.op {
            // An order is an integer: no gradient flows through it (sorted values are gathers).
            Op::Param(_) | Op::Const(_) | Op::DimValue(_) | Op::Iota { .. } | Op::ArgSort { .. } => vec![],
            Op::Unary(u) => {
                let a = x[0];
                let d = match u {
                    UnaryOp::Not | UnaryOp::Floor => return Ok(vec![]),
                    UnaryOp::Neg => self.un(UnaryOp::Neg, g)?,
                    UnaryOp::Exp => self.mul(g, y)?,
                    UnaryOp::Log => self.bin(BinaryOp::Div, g, a)?,
                    UnaryOp::Sqrt => {
                        // d sqrt(x) = 1 / (2 sqrt(x))
                        let half = self.scale(g, 0.5)?;
                        self.bin(BinaryOp::Div, half, y)?
                    }
                    UnaryOp::Rsqrt => {
                        // d x^(-1/2) = -x^(-1/2) / (2x)
                        let t = self.mul(g, y)?;
                        let t = self.bin(BinaryOp::Div, t, a)?;
                        self.scale(t, -0.5)?
                    }
                    UnaryOp::Tanh => {
                        let yy = self.mul(y, y)?;
                        let one = self.fconst(1.0, y)?;
                        let d = self.bin(BinaryOp::Sub, one, yy)?;
                        self.mul(g, d)?
                    }
                    UnaryOp::Sigmoid => {
                        let one = self.fconst(1.0, y)?;
                        let c = self.bin(BinaryOp::Sub, one, y)?;
                        let d = self.mul(y, c)?;
                        self.mul(g, d)?
                    }
                    UnaryOp::Relu => {
                        let pos = self.cmp0(BinaryOp::Gt, a)?;
                        self.keep(pos, g)?
                    }
                    UnaryOp::Silu => {
                        // s + x s (1 - s), s = sigmoid(x)
                        let s = self.un(UnaryOp::Sigmoid, a)?;
                        let one = self.fconst(1.0, s)?;
                        let c = self.bin(BinaryOp::Sub, one, s)?;
                        let xc = self.mul(a, c)?;
                        let t = self.bin(BinaryOp::Add, one, xc)?;
                        let d = self.mul(s, t)?;
                        self.mul(g, d)?
                    }
                    UnaryOp::Elu => {
                        // 1 for x > 0, e^x = y + 1 otherwise
                        let pos = self.cmp0(BinaryOp::Gt, a)?;
                        let one = self.fconst(1.0, y)?;
                        let e = self.bin(BinaryOp::Add, y, one)?;
                        let ge = self.mul(g, e)?;
                        self.select(pos, g, ge)?
                    }
                    UnaryOp::Abs => {
                        let pos = self.cmp0(BinaryOp::Gt, a)?;
                        let neg = self.cmp0(BinaryOp::Lt, a)?;
                        let ng = self.un(UnaryOp::Neg, g)?;
                        let n = self.keep(neg, ng)?;
                        self.select(pos, g, n)?
                    }
                    UnaryOp::Gelu => {
                        // Φ(x) + x φ(x), with Φ(x) = gelu(x) / x (1/2 at 0)
                        let is0 = self.cmp0(BinaryOp::Eq, a)?;
                        let half = self.fconst(0.5, y)?;
                        let ratio = self.bin(BinaryOp::Div, y, a)?;
                        let cdf = self.select(is0, half, ratio)?;
                        let xx = self.mul(a, a)?;
                        let e = self.scale(xx, -0.5)?;
                        let e = self.un(UnaryOp::Exp, e)?;
                        let pdf = self.scale(e, 1.0 / (2.0 * PI).sqrt())?;
                        let xp = self.mul(a, pdf)?;
                        let d = self.bin(BinaryOp::Add, cdf, xp)?;
                        self.mul(g, d)?
                    }
                    UnaryOp::Sin => {
                        let c = self.un(UnaryOp::Cos, a)?;
                        self.mul(g, c)?
                    }
                    UnaryOp::Cos => {
                        let s = self.un(UnaryOp::Sin, a)?;
                        let s = self.mul(g, s)?;
                        self.un(UnaryOp::Neg, s)?
                    }
                };
                vec![(0, d)]
            }
            Op::Binary(op) => {
                let (a, bb) = (x[0], x[1]);
                match op {
                    BinaryOp::Add => vec![(0, g), (1, g)],
                    BinaryOp::Sub => vec![(0, g), (1, self.un(UnaryOp::Neg, g)?)],
                    BinaryOp::Mul => vec![(0, self.mul(g, bb)?), (1, self.mul(g, a)?)],
                    BinaryOp::Div => {
                        let ga = self.bin(BinaryOp::Div, g, bb)?;
                        let t = self.mul(ga, y)?;
                        vec![(0, ga), (1, self.un(UnaryOp::Neg, t)?)]
                    }
                    BinaryOp::Pow => {
                        // d a^b = b a^(b-1) da + a^b ln(a) db
                        let one = self.fconst(1.0, y)?;
                        let bm1 = self.bin(BinaryOp::Sub, bb, one)?;
                        let p = self.bin(BinaryOp::Pow, a, bm1)?;
                        let p = self.mul(p, bb)?;
                        let ga = self.mul(g, p)?;
                        let ln = self.un(UnaryOp::Log, a)?;
                        let t = self.mul(y, ln)?;
                        vec![(0, ga), (1, self.mul(g, t)?)]
                    }
                    BinaryOp::Rem => {
                        // a % b = a - b floor(a / b)
                        let q = self.bin(BinaryOp::Div, a, bb)?;
                        let q = self.un(UnaryOp::Floor, q)?;
                        let t = self.mul(g, q)?;
                        vec![(0, g), (1, self.un(UnaryOp::Neg, t)?)]
                    }
                    BinaryOp::Min | BinaryOp::Max => {
                        let cmp = if *op == BinaryOp::Min { BinaryOp::Le } else { BinaryOp::Ge };
                        let left = self.bin(cmp, a, bb)?;
                        let (ga, gb) = self.route(left, g)?;
                        vec![(0, ga), (1, gb)]
                    }
                    BinaryOp::Atan2 => {
                        // atan2(a, b): da = b / (a² + b²), db = -a / (a² + b²)
                        let aa = self.mul(a, a)?;
                        let b2 = self.mul(bb, bb)?;
                        let r = self.bin(BinaryOp::Add, aa, b2)?;
                        let gr = self.bin(BinaryOp::Div, g, r)?;
                        let ga = self.mul(gr, bb)?;
                        let t = self.mul(gr, a)?;
                        vec![(0, ga), (1, self.un(UnaryOp::Neg, t)?)]
                    }
                    _ => vec![],
                }
            }
            Op::Select => {
                let (ga, gb) = self.route(x[0], g)?;
                vec![(1, ga), (2, gb)]
            }
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
            Op::Slice { axis, start, end } => {
                let xt = graph.node(x[0]).ty.clone();
                let mut parts = Vec::new();
                if start.as_const() != Some(0) {
                    let mut s = xt.shape.clone();
                    s[*axis] = start.clone();
                    parts.push(self.zeros(&s, self.ty(g).dtype)?);
                }
                parts.push(g);
                if *end != xt.shape[*axis] {
                    let mut s = xt.shape.clone();
                    s[*axis] = xt.shape[*axis].sub(end);
                    parts.push(self.zeros(&s, self.ty(g).dtype)?);
                }
                let padded = if parts.len() == 1 { g } else { self.add(Op::Concat { axis: *axis }, &parts, None)? };
                vec![(0, padded)]
            }
            Op::Concat { axis } => {
                let mut out = Vec::new();
                let mut offset = Dim::constant(0);
                for (slot, operand) in x.iter().enumerate() {
                    let len = graph.node(*operand).ty.shape[*axis].clone();
                    let end = offset.add(&len);
                    let piece = self.add(Op::Slice { axis: *axis, start: offset.clone(), end: end.clone() }, &[g], None)?;
                    out.push((slot, piece));
                    offset = end;
                }
                out
            }
            Op::Gather => vec![(0, self.gather_table(graph, x, g)?)],
            Op::Reduce { op, axes, .. } => {
                let xt = graph.node(x[0]).ty.clone();
                let kept: Vec<Dim> =
                    xt.shape.iter().enumerate().map(|(k, d)| if axes.contains(&k) { Dim::constant(1) } else { d.clone() }).collect();
                let gk = self.reshape(g, &kept)?;
                let d = match op {
                    ReduceOp::Sum => self.broadcast(gk, &xt.shape)?,
                    ReduceOp::Mean => {
                        let n = Dim::product(axes.iter().map(|a| &xt.shape[*a]));
                        let n = self.add(Op::DimValue(n), &[], None)?;
                        let gm = self.bin(BinaryOp::Div, gk, n)?;
                        self.broadcast(gm, &xt.shape)?
                    }
                    ReduceOp::Max | ReduceOp::Min => {
                        let yk = self.reshape(y, &kept)?;
                        let hit = self.bin(BinaryOp::Eq, x[0], yk)?;
                        let one = self.fconst(1.0, g)?;
                        let ones = self.keep(hit, one)?;
                        let ties = self.sum(ones, axes.clone(), true)?;
                        let share = self.bin(BinaryOp::Div, gk, ties)?;
                        self.keep(hit, share)?
                    }
                };
                vec![(0, d)]
            }
            Op::Softmax { axis } => {
                // y (g - Σ g y)
                let gy = self.mul(g, y)?;
                let s = self.sum(gy, vec![*axis], true)?;
                let c = self.bin(BinaryOp::Sub, g, s)?;
                vec![(0, self.mul(y, c)?)]
            }
            Op::Scan { op, axis, reverse } => {
                let back =
                    |b: &mut Builder, op: ScanOp, args: &[Value]| b.add(Op::Scan { op, axis: *axis, reverse: !*reverse }, args, None);
                match op {
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
                        let a_next = self.shift(a, *axis, !*reverse)?;
                        let lambda = back(self, ScanOp::Linear, &[a_next, g])?;
                        let h_prev = self.shift(y, *axis, *reverse)?;
                        vec![(0, self.mul(lambda, h_prev)?), (1, lambda)]
                    }
                }
            }
            // The values' gradient is the result's gradient where each was added (the same
            // clamped position: a gather); the base's passes through.
            Op::ScatterAdd { axis } => {
                let src = graph.node(x[2]).ty.clone();
                let mut operands = vec![g];
                for k in 0..src.rank() {
                    if k == *axis {
                        operands.push(x[1]);
                        continue;
                    }
                    let mut shape = vec![Dim::constant(1); src.rank()];
                    shape[k] = src.shape[k].clone();
                    operands.push(self.add(Op::Iota { axis: k }, &[], Some(TensorType::new(DType::I32, shape)))?);
                }
                vec![(0, g), (2, self.add(Op::Gather, &operands, None)?)]
            }
            Op::LayerNorm { eps } => self.layer_norm(graph, x, g, *eps, true)?,
            Op::RmsNorm { eps } => self.layer_norm(graph, x, g, *eps, false)?,
            Op::Flash(_) => return Err(unsupported()),
        })
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

#[cfg(test)]
mod tests;
