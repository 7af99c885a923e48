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

/// A transpose moves inside a softmax, `transpose(softmax(x, a), p) = softmax(transpose(x, p), k)`
/// with `p[k] = a`, and, under a softmax, inside the product that makes its scores when it swaps
/// the last two axes only: `softmax((a @ b)ᵀ) = softmax(bᵀ @ aᵀ)`. The decomposable-attention
/// forms `softmax(e, axis = 1).T @ v` and `softmax(e.T, axis = -1) @ v` (with `e = f @ gᵀ`) then
/// reach the fusion rule's `softmax(q @ kᵀ) @ v`. Products elsewhere keep their transposes:
/// moving those would let re-association fold projections into each other (`q (W_q W_kᵀ) xᵀ`),
/// which changes the rounding of programs that fuse either way.
#[derive(Clone)]
pub struct TransposeThrough;

impl Rule for TransposeThrough {
    rule_head!("layout/transpose-through", Op::Transpose { .. } | Op::Softmax { .. });

    fn rewrite_node(&self, eg: &EG, _class: Id, n: &ENode, out: &mut Vec<Build>) {
        match n.op() {
            Op::Transpose { perm } => {
                for inner in nodes_where(eg, n.args()[0], |op| matches!(op, Op::Softmax { .. })) {
                    let Op::Softmax { axis } = inner.op() else { continue };
                    let Some(k) = perm.iter().position(|p| p == axis) else { continue };
                    let x = inner.args()[0];
                    out.push(Build::op(
                        Op::Softmax { axis: k },
                        vec![Build::op(Op::Transpose { perm: perm.clone() }, vec![Build::Class(x)])],
                    ));
                    for scores in transposed_products(eg, x, perm) {
                        out.push(Build::op(Op::Softmax { axis: k }, vec![scores]));
                    }
                }
            }
            Op::Softmax { axis } => {
                for t in nodes_where(eg, n.args()[0], |op| matches!(op, Op::Transpose { .. })) {
                    let Op::Transpose { perm } = t.op() else { continue };
                    for scores in transposed_products(eg, t.args()[0], perm) {
                        out.push(Build::op(Op::Softmax { axis: *axis }, vec![scores]));
                    }
                }
            }
            _ => {}
        }
    }
}

/// `bᵀ @ aᵀ` for each product `a @ b` of class `x`, when `perm` swaps the last two axes only
/// (each operand with its own swap: a batch axis may be broadcast).
fn transposed_products(eg: &EG, x: Id, perm: &[usize]) -> Vec<Build> {
    let r = perm.len();
    let swaps_last_two = r >= 2 && perm[r - 2] == r - 1 && perm[r - 1] == r - 2 && perm[..r - 2].iter().enumerate().all(|(k, p)| k == *p);
    if !swaps_last_two {
        return Vec::new();
    }
    let swapped = |c: Id| {
        let rank = ty(eg, c).map_or(0, |t| t.rank());
        (rank >= 2).then(|| {
            let mut p: Vec<usize> = (0..rank).collect();
            p.swap(rank - 2, rank - 1);
            Build::op(Op::Transpose { perm: p }, vec![Build::Class(c)])
        })
    };
    nodes_where(eg, x, |op| matches!(op, Op::MatMul))
        .filter_map(|m| Some(Build::op(Op::MatMul, vec![swapped(m.args()[1])?, swapped(m.args()[0])?])))
        .collect()
}
