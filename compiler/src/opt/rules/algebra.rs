//! Scalar algebra: constant folding, identities, and moving a scalar scale from the scores into
//! the queries.

use super::{Build, EG, ENode, Rule, konst, nodes_where, ty};
use crate::ir::semantics::{self, Scalar};
use crate::ir::{BinaryOp, DType, Op, TensorType, UnaryOp};
use egg::Id;

/// `op(c1, c2) = c` for scalar constants (`0.5 * 2 = 1`, `sqrt(64) = 8`).
#[derive(Clone)]
pub struct FoldConstants;

impl Rule for FoldConstants {
    fn name(&self) -> &'static str {
        "algebra/fold-constants"
    }

    fn rewrite(&self, eg: &EG, class: Id) -> Vec<Build> {
        let Some(t) = ty(eg, class) else { return vec![] };
        if t.rank() != 0 || konst(eg, class).is_some() {
            return vec![];
        }
        for n in eg[class].nodes.iter() {
            // Each constant as a value of its own type's class.
            let vals: Option<Vec<Scalar>> = n.args().iter().map(|a| Some(Scalar::load(ty(eg, *a)?.dtype, konst(eg, *a)?))).collect();
            let Some(vals) = vals else { continue };
            let v = match (n.op(), vals.as_slice()) {
                (Op::Unary(u), [x]) => semantics::unary(*u, *x),
                (Op::Binary(b), [x, y]) => semantics::binary(*b, *x, *y),
                (Op::Cast, [x]) => *x,
                _ => continue,
            };
            let v = v.store(t.dtype);
            return vec![Build::Node(Op::Const(v), Some(TensorType::scalar(t.dtype)), vec![])];
        }
        vec![]
    }
}

/// `x * 1 = x`, `x / 1 = x`, `x + 0 = x`, `x - 0 = x` (when the result has `x`'s type).
#[derive(Clone)]
pub struct Identities;

impl Rule for Identities {
    rule_head!("algebra/identities", Op::Binary(_));

    fn rewrite_node(&self, eg: &EG, class: Id, n: &ENode, out: &mut Vec<Build>) {
        let Op::Binary(b) = n.op() else { return };
        let (x, y) = (n.args()[0], n.args()[1]);
        let t = ty(eg, class);
        let keep = |v: Id, other: Id, unit: f64| konst(eg, other) == Some(unit) && ty(eg, v) == t;
        match b {
            BinaryOp::Mul if keep(x, y, 1.0) => out.push(Build::Class(x)),
            BinaryOp::Mul if keep(y, x, 1.0) => out.push(Build::Class(y)),
            BinaryOp::Div if keep(x, y, 1.0) => out.push(Build::Class(x)),
            BinaryOp::Add if keep(x, y, 0.0) => out.push(Build::Class(x)),
            BinaryOp::Add if keep(y, x, 0.0) => out.push(Build::Class(y)),
            BinaryOp::Sub if keep(x, y, 0.0) => out.push(Build::Class(x)),
            _ => {}
        }
    }
}

/// `x / c = x * (1/c)` for a scalar constant `c`, and `x / sqrt(y) = x * rsqrt(y)` for a
/// scalar `y`: a multiply is what the score modification and the backends want.
#[derive(Clone)]
pub struct DivToMul;

impl Rule for DivToMul {
    rule_head!("algebra/div-to-mul", Op::Binary(BinaryOp::Div));

    fn rewrite_node(&self, eg: &EG, _class: Id, n: &ENode, out: &mut Vec<Build>) {
        let (x, y) = (n.args()[0], n.args()[1]);
        let Some(yt) = ty(eg, y) else { return };
        if yt.rank() != 0 || !ty(eg, x).is_some_and(|t| t.dtype.is_float()) {
            return;
        }
        if let Some(c) = konst(eg, y).filter(|c| *c != 0.0 && c.is_finite()) {
            let inv = Build::Node(Op::Const(1.0 / c), Some(TensorType::scalar(DType::F32)), vec![]);
            out.push(Build::op(Op::Binary(BinaryOp::Mul), vec![Build::Class(x), inv]));
        }
        for s in nodes_where(eg, y, |op| matches!(op, Op::Unary(UnaryOp::Sqrt))) {
            let r = Build::op(Op::Unary(UnaryOp::Rsqrt), vec![Build::Class(s.args()[0])]);
            out.push(Build::op(Op::Binary(BinaryOp::Mul), vec![Build::Class(x), r]));
        }
    }
}

/// `(q @ kt) * c = (q * c) @ kt` for a scalar `c`: scaling the queries costs M·D multiplies
/// instead of M·N. The cost model decides which form to keep.
#[derive(Clone)]
pub struct ScaleIntoQuery;

impl Rule for ScaleIntoQuery {
    rule_head!("algebra/scale-into-query", Op::Binary(BinaryOp::Mul));

    fn rewrite_node(&self, eg: &EG, _class: Id, n: &ENode, out: &mut Vec<Build>) {
        for (m, c) in [(n.args()[0], n.args()[1]), (n.args()[1], n.args()[0])] {
            if ty(eg, c).is_none_or(|t| t.rank() != 0) {
                continue;
            }
            for mm in nodes_where(eg, m, |op| matches!(op, Op::MatMul)) {
                let scaled = Build::op(Op::Binary(BinaryOp::Mul), vec![Build::Class(mm.args()[0]), Build::Class(c)]);
                out.push(Build::op(Op::MatMul, vec![scaled, Build::Class(mm.args()[1])]));
            }
        }
    }
}

/// `(a ± b) @ v = a @ v ± b @ v` and `(c · a) @ v = c · (a @ v)` for a scalar `c`, on float
/// operands: a difference of attention weights times the values (differential attention,
/// `(softmax(s₁) − λ softmax(s₂)) @ v`) becomes attentions the fusion rule takes one by one. The
/// types decide where it applies: a term the product cannot take (one broadcast along the
/// contracted axis) does not type-check, and nothing is added.
#[derive(Clone)]
pub struct DistributeMatMul;

impl Rule for DistributeMatMul {
    rule_head!("algebra/distribute-matmul", Op::MatMul);

    fn rewrite_node(&self, eg: &EG, _class: Id, n: &ENode, out: &mut Vec<Build>) {
        let (l, r) = (n.args()[0], n.args()[1]);
        if !ty(eg, l).is_some_and(|t| t.dtype.is_float()) {
            return;
        }
        let product = |a: Id| Build::op(Op::MatMul, vec![Build::Class(a), Build::Class(r)]);
        let scalar = |c: Id| ty(eg, c).is_some_and(|t| t.rank() == 0);
        for inner in nodes_where(eg, l, |op| matches!(op, Op::Binary(BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul))) {
            let (Op::Binary(b), [x, y]) = (inner.op(), inner.args()) else { continue };
            match b {
                BinaryOp::Mul if scalar(*x) => out.push(Build::op(Op::Binary(BinaryOp::Mul), vec![Build::Class(*x), product(*y)])),
                BinaryOp::Mul if scalar(*y) => out.push(Build::op(Op::Binary(BinaryOp::Mul), vec![product(*x), Build::Class(*y)])),
                BinaryOp::Mul => {}
                _ => out.push(Build::op(Op::Binary(*b), vec![product(*x), product(*y)])),
            }
        }
    }
}
