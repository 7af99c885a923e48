//! Ops the kernels do not have, rewritten into ones they do before kernel formation: a
//! log-sum-exp reduction that no flash op computes (`logsumexp(x)` of something other than
//! attention scores, or unoptimised) becomes `m + log Σ exp(x - m)` with `m` its maximum, taken
//! as 0 where it is infinite ([`ReduceOp::LogSumExp`]'s definition, which the interpreter
//! evaluates directly).

use crate::ir::{BinaryOp, Graph, Op, ReduceOp, TensorType, UnaryOp, Value, infer};
use std::borrow::Cow;

/// `graph`, or a copy with its log-sum-exp reductions expanded (new nodes appended; the
/// reductions left without users).
pub(super) fn expand(graph: &Graph) -> Result<Cow<'_, Graph>, String> {
    let lse: Vec<Value> = graph.values().filter(|v| matches!(graph.node(*v).op, Op::Reduce { op: ReduceOp::LogSumExp, .. })).collect();
    if lse.is_empty() {
        return Ok(Cow::Borrowed(graph));
    }
    let mut g = graph.clone();
    for v in lse {
        let Op::Reduce { axes, keepdim, .. } = g.node(v).op.clone() else { continue };
        let (ty, span) = (g.node(v).ty.clone(), g.node(v).span);
        let x = *g.operands(v).first().ok_or("a log-sum-exp without an operand")?;
        let dtype = g.node(x).ty.dtype;
        let add = |g: &mut Graph, op: Op, args: &[Value], declared: Option<TensorType>| -> Result<Value, String> {
            let tys: Vec<&TensorType> = args.iter().map(|a| &g.node(*a).ty).collect();
            let t = infer(&op, &tys, declared.as_ref()).map_err(|e| format!("expanding a log-sum-exp: {e}"))?;
            let n = g.add(op, t, args);
            g.set_span(n, span);
            Ok(n)
        };
        let m = add(&mut g, Op::Reduce { op: ReduceOp::Max, axes: axes.clone(), keepdim: true }, &[x], None)?;
        let inf = add(&mut g, Op::Const(f64::INFINITY), &[], Some(TensorType::scalar(dtype)))?;
        let zero = add(&mut g, Op::Const(0.0), &[], Some(TensorType::scalar(dtype)))?;
        let size = add(&mut g, Op::Unary(UnaryOp::Abs), &[m], None)?;
        let finite = add(&mut g, Op::Binary(BinaryOp::Lt), &[size, inf], None)?;
        let safe = add(&mut g, Op::Select, &[finite, m, zero], None)?;
        let shifted = add(&mut g, Op::Binary(BinaryOp::Sub), &[x, safe], None)?;
        let e = add(&mut g, Op::Unary(UnaryOp::Exp), &[shifted], None)?;
        let s = add(&mut g, Op::Reduce { op: ReduceOp::Sum, axes, keepdim: true }, &[e], None)?;
        let l = add(&mut g, Op::Unary(UnaryOp::Log), &[s], None)?;
        let mut r = add(&mut g, Op::Binary(BinaryOp::Add), &[l, safe], None)?;
        if !keepdim {
            r = add(&mut g, Op::Reshape, &[r], Some(ty))?;
        }
        g.replace_uses(v, r);
    }
    Ok(Cow::Owned(g))
}
