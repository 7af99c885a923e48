//! Matrix-product re-association, guarded: only chains whose regrouping type-checks, and the
//! cost model (FLOPs and bytes at representative sizes) picks the grouping. This is what turns
//! `(φ(Q) φ(K)ᵀ) V` into `φ(Q) (φ(K)ᵀ V)` (no S×S matrix) and chooses between Luong's
//! `(Q W) Kᵀ` and `Q (W Kᵀ)`.

use super::{Build, EG, ENode, Rule, nodes_where};
use crate::ir::Op;
use egg::Id;

/// `(a @ b) @ c = a @ (b @ c)` in both directions.
#[derive(Clone)]
pub struct MatMulAssoc;

impl Rule for MatMulAssoc {
    rule_head!("assoc/matmul", Op::MatMul);

    fn rewrite_node(&self, eg: &EG, _class: Id, n: &ENode, out: &mut Vec<Build>) {
        let (l, r) = (n.args()[0], n.args()[1]);
        for inner in nodes_where(eg, l, |op| matches!(op, Op::MatMul)) {
            let (a, b) = (inner.args()[0], inner.args()[1]);
            let bc = Build::op(Op::MatMul, vec![Build::Class(b), Build::Class(r)]);
            out.push(Build::op(Op::MatMul, vec![Build::Class(a), bc]));
        }
        for inner in nodes_where(eg, r, |op| matches!(op, Op::MatMul)) {
            let (b, c) = (inner.args()[0], inner.args()[1]);
            let ab = Build::op(Op::MatMul, vec![Build::Class(l), Build::Class(b)]);
            out.push(Build::op(Op::MatMul, vec![ab, Build::Class(c)]));
        }
    }
}
