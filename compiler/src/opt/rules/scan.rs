//! Scan fusion: causal linear attention written with prefix sums,
//! `sum(q[.., :, None] * cumsum(k[.., :, None] * v[.., None, :], S), D)`, becomes one
//! `prefix_attention(q, k, v)`: the `[.., S, D, Dv]` prefix sums are never formed, and the
//! backends keep one `D × Dv` state per batch item (Katharopoulos et al. 2020, eqs. 16–18).

use super::{Build, EG, ENode, Rule, nodes_where, ty};
use crate::ir::{BinaryOp, Dim, Op, ReduceOp, ScanOp};
use egg::Id;

/// The rule.
#[derive(Clone)]
pub struct PrefixAttention;

impl Rule for PrefixAttention {
    rule_head!("fusion/prefix-attention", Op::Reduce { op: ReduceOp::Sum, keepdim: false, .. });

    fn rewrite_node(&self, eg: &EG, _class: Id, sum: &ENode, out: &mut Vec<Build>) {
        let Op::Reduce { axes, .. } = sum.op() else { return };
        let prod = sum.args()[0];
        let Some(rank) = ty(eg, prod).map(|t| t.rank()) else { return };
        // `[.., S, D, Dv]` summed over D.
        if rank < 3 || axes.as_slice() != [rank - 2] {
            return;
        }
        for mul in nodes_where(eg, prod, |op| matches!(op, Op::Binary(BinaryOp::Mul))) {
            let (a, b) = (mul.args()[0], mul.args()[1]);
            for (q_col, prefix) in [(a, b), (b, a)] {
                let Some(q) = unsqueezed(eg, q_col, rank - 1) else { continue };
                for scan in nodes_where(eg, prefix, |op| matches!(op, Op::Scan { op: ScanOp::Sum, .. })) {
                    let Op::Scan { axis, reverse, .. } = scan.op() else { continue };
                    if *axis != rank - 3 {
                        continue;
                    }
                    for outer in nodes_where(eg, scan.args()[0], |op| matches!(op, Op::Binary(BinaryOp::Mul))) {
                        let (c, d) = (outer.args()[0], outer.args()[1]);
                        for (k_col, v_row) in [(c, d), (d, c)] {
                            let (Some(k), Some(v)) = (unsqueezed(eg, k_col, rank - 1), unsqueezed(eg, v_row, rank - 2)) else {
                                continue;
                            };
                            // The op's shape rule (checked when the node is added) makes q
                            // and k match and v share their leading axes.
                            out.push(Build::op(
                                Op::PrefixAttention { reverse: *reverse },
                                vec![Build::Class(q), Build::Class(k), Build::Class(v)],
                            ));
                        }
                    }
                }
            }
        }
    }
}

/// The operand of a reshape in `class` that inserts one axis of size 1 at `axis` (an
/// `unsqueeze`), if there is one.
fn unsqueezed(eg: &EG, class: Id, axis: usize) -> Option<Id> {
    let shape = &ty(eg, class)?.shape;
    if shape.get(axis) != Some(&Dim::constant(1)) {
        return None;
    }
    let mut without = shape.clone();
    without.remove(axis);
    nodes_where(eg, class, |op| matches!(op, Op::Reshape)).map(|n| n.args()[0]).find(|x| ty(eg, *x).is_some_and(|t| t.shape == without))
}

#[cfg(test)]
mod tests {
    use super::PrefixAttention;
    use crate::opt::tests::check_rule;
    use std::sync::Arc;

    const BEFORE: &str = "graph f {
  %0 = param[name=q] : f32[H, S, D]
  %1 = param[name=k] : f32[H, S, D]
  %2 = param[name=v] : f32[H, S, E]
  %3 = reshape %0 : f32[H, S, D, 1]
  %4 = reshape %1 : f32[H, S, D, 1]
  %5 = reshape %2 : f32[H, S, 1, E]
  %6 = mul %4, %5 : f32[H, S, D, E]
  %7 = cumsum[axis=1, reverse=AXIS] %6 : f32[H, S, D, E]
  %8 = mul %3, %7 : f32[H, S, D, E]
  %9 = reduce_sum[axes=[SUM], keepdim=false] %8 : f32[H, S, E]
  output out = %9
}";

    fn graph(reverse: bool, sum: usize) -> String {
        let out = if sum == 2 { "f32[H, S, E]" } else { "f32[H, S, D]" };
        BEFORE
            .replace("AXIS", &reverse.to_string())
            .replace("SUM", &sum.to_string())
            .replace("f32[H, S, E]\n  output", &format!("{out}\n  output"))
    }

    #[test]
    fn prefix_sums_of_outer_products_become_prefix_attention() {
        for reverse in [false, true] {
            let after = format!(
                "graph f {{
  %0 = param[name=q] : f32[H, S, D]
  %1 = param[name=k] : f32[H, S, D]
  %2 = param[name=v] : f32[H, S, E]
  %3 = prefix_attention[reverse={reverse}] %0, %1, %2 : f32[H, S, E]
  output out = %3
}}"
            );
            check_rule(Arc::new(PrefixAttention), &graph(reverse, 2), &after);
        }
    }

    #[test]
    fn other_sums_are_left_alone() {
        // Summed over the value axis instead of the key axis: not this contraction.
        let g = graph(false, 3);
        check_rule(Arc::new(PrefixAttention), &g, &crate::ir::Graph::parse(&g).expect("parses").to_string());
    }
}
