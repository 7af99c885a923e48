//! Layout rules: transposes and reshapes fold and cancel, so head split/merge chains become a
//! single strided view (or nothing).

use super::{Build, EG, ENode, Rule, nodes_where, ty};
use crate::ir::Op;
use egg::Id;

/// `transpose(transpose(x, p), q) = transpose(x, p∘q)`, and `transpose(x, id) = x`.
#[derive(Clone)]
pub struct TransposeFold;

impl Rule for TransposeFold {
    rule_head!("layout/transpose-fold", Op::Transpose { .. });

    fn rewrite_node(&self, eg: &EG, _class: Id, n: &ENode, out: &mut Vec<Build>) {
        let Op::Transpose { perm: outer } = n.op() else { return };
        if outer.iter().enumerate().all(|(k, p)| k == *p) {
            out.push(Build::Class(n.args()[0]));
            return;
        }
        for inner in nodes_where(eg, n.args()[0], |op| matches!(op, Op::Transpose { .. })) {
            let Op::Transpose { perm: first } = inner.op() else { continue };
            // Output axis k of the outer is its input axis outer[k] = axis first[outer[k]] of x.
            let perm: Vec<usize> = outer.iter().map(|p| first[*p]).collect();
            out.push(if perm.iter().enumerate().all(|(k, p)| k == *p) {
                Build::Class(inner.args()[0])
            } else {
                Build::op(Op::Transpose { perm }, vec![Build::Class(inner.args()[0])])
            });
        }
    }
}

/// `reshape(reshape(x)) = reshape(x)`, and a reshape to the same shape is `x`.
#[derive(Clone)]
pub struct ReshapeFold;

impl Rule for ReshapeFold {
    rule_head!("layout/reshape-fold", Op::Reshape);

    fn rewrite_node(&self, eg: &EG, class: Id, n: &ENode, out: &mut Vec<Build>) {
        let Some(target) = ty(eg, class) else { return };
        let x = n.args()[0];
        if ty(eg, x) == Some(target) {
            out.push(Build::Class(x));
            return;
        }
        for inner in nodes_where(eg, x, |op| matches!(op, Op::Reshape)) {
            let src = inner.args()[0];
            out.push(if ty(eg, src) == Some(target) {
                Build::Class(src)
            } else {
                Build::Node(Op::Reshape, Some(target.clone()), vec![Build::Class(src)])
            });
        }
    }
}
