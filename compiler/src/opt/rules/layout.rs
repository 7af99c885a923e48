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

#[cfg(test)]
mod tests {
    use crate::opt::tests::check_rule;

    #[test]
    fn transpose_of_transpose_cancels() {
        check_rule(
            &super::TransposeFold,
            "graph t {
               %0 = param[name=x] : f32[A, B, C]
               %1 = transpose[perm=[0, 2, 1]] %0 : f32[A, C, B]
               %2 = transpose[perm=[0, 2, 1]] %1 : f32[A, B, C]
               output out = %2
             }",
            "graph t {
  %0 = param[name=x] : f32[A, B, C]
  output out = %0
}",
        );
    }

    #[test]
    fn transposes_compose() {
        check_rule(
            &super::TransposeFold,
            "graph t {
               %0 = param[name=x] : f32[A, B, C]
               %1 = transpose[perm=[1, 0, 2]] %0 : f32[B, A, C]
               %2 = transpose[perm=[0, 2, 1]] %1 : f32[B, C, A]
               output out = %2
             }",
            "graph t {
  %0 = param[name=x] : f32[A, B, C]
  %1 = transpose[perm=[1, 2, 0]] %0 : f32[B, C, A]
  output out = %1
}",
        );
    }

    #[test]
    fn reshape_of_reshape_folds() {
        check_rule(
            &super::ReshapeFold,
            "graph t {
               %0 = param[name=x] : f32[A, B*C]
               %1 = reshape %0 : f32[A, B, C]
               %2 = reshape %1 : f32[A*B, C]
               output out = %2
             }",
            "graph t {
  %0 = param[name=x] : f32[A, B*C]
  %1 = reshape %0 : f32[A*B, C]
  output out = %1
}",
        );
    }
}
