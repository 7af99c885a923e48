//! Ops the kernels do not have, rewritten into ones they do before kernel formation: a
//! log-sum-exp reduction that no flash op computes (`logsumexp(x)` of something other than
//! attention scores, or unoptimised) becomes `m + log Σ exp(x - m)` with `m` its maximum, taken
//! as 0 where it is infinite ([`ReduceOp::LogSumExp`]'s definition, which the interpreter
//! evaluates directly). A paged cache read other than by flash ops as their K or V in place
//! (through transposes only, token axis second-to-last, table axis a batch axis), or on a target
//! that does not read pages in place, becomes the gather [`crate::ir::paged`] writes: a copy.

use crate::ir::paged::AddNode as _;
use crate::ir::{BinaryOp, Graph, Op, ReduceOp, TensorType, UnaryOp, Value, infer};
use std::borrow::Cow;

/// `graph`, or a copy with its log-sum-exp reductions and its paged reads that no flash op
/// reads in place (all of them unless `paged_in_place`) expanded (new nodes appended; the
/// expanded nodes left without users).
pub(super) fn expand(graph: &Graph, paged_in_place: bool) -> Result<Cow<'_, Graph>, String> {
    let lse: Vec<Value> = graph.values().filter(|v| matches!(graph.node(*v).op, Op::Reduce { op: ReduceOp::LogSumExp, .. })).collect();
    let paged: Vec<Value> =
        graph.values().filter(|v| graph.node(*v).op == Op::Paged && !(paged_in_place && read_in_place(graph, *v))).collect();
    if lse.is_empty() && paged.is_empty() {
        return Ok(Cow::Borrowed(graph));
    }
    let mut g = graph.clone();
    for v in paged {
        let (ty, span) = (g.node(v).ty.clone(), g.node(v).span);
        let [pages, table] = g.operands(v)[..] else { return Err("a paged read without its two operands".into()) };
        let (pt, tt) = (g.node(pages).ty.clone(), g.node(table).ty.clone());
        let r = crate::ir::paged::expand(&mut Adding { g: &mut g, span, what: "a paged read" }, (pages, &pt), (table, &tt), &ty)?;
        g.replace_uses(v, r);
    }
    for v in lse {
        let Op::Reduce { axes, keepdim, .. } = g.node(v).op.clone() else { continue };
        let (ty, span) = (g.node(v).ty.clone(), g.node(v).span);
        let x = *g.operands(v).first().ok_or("a log-sum-exp without an operand")?;
        let dtype = g.node(x).ty.dtype;
        let mut a = Adding { g: &mut g, span, what: "a log-sum-exp" };
        let m = a.node(Op::Reduce { op: ReduceOp::Max, axes: axes.clone(), keepdim: true }, &[x], None)?;
        let inf = a.node(Op::Const(f64::INFINITY), &[], Some(TensorType::scalar(dtype)))?;
        let zero = a.node(Op::Const(0.0), &[], Some(TensorType::scalar(dtype)))?;
        let size = a.node(Op::Unary(UnaryOp::Abs), &[m], None)?;
        let finite = a.node(Op::Binary(BinaryOp::Lt), &[size, inf], None)?;
        let safe = a.node(Op::Select, &[finite, m, zero], None)?;
        let shifted = a.node(Op::Binary(BinaryOp::Sub), &[x, safe], None)?;
        let e = a.node(Op::Unary(UnaryOp::Exp), &[shifted], None)?;
        let s = a.node(Op::Reduce { op: ReduceOp::Sum, axes, keepdim: true }, &[e], None)?;
        let l = a.node(Op::Unary(UnaryOp::Log), &[s], None)?;
        let mut r = a.node(Op::Binary(BinaryOp::Add), &[l, safe], None)?;
        if !keepdim {
            r = a.node(Op::Reshape, &[r], Some(ty))?;
        }
        g.replace_uses(v, r);
    }
    Ok(Cow::Owned(g))
}

/// Adds typed nodes with one source span (the expanded node's); `what` names the expanded op in
/// errors.
struct Adding<'g> {
    g: &'g mut Graph,
    span: Option<attn_dsl::Span>,
    what: &'static str,
}

impl crate::ir::paged::AddNode for Adding<'_> {
    type Error = String;
    fn node(&mut self, op: Op, args: &[Value], declared: Option<TensorType>) -> Result<Value, String> {
        let tys: Vec<&TensorType> = args.iter().map(|a| &self.g.node(*a).ty).collect();
        let t = infer(&op, &tys, declared.as_ref()).map_err(|e| format!("expanding {}: {e}", self.what))?;
        let n = self.g.add(op, t, args);
        self.g.set_span(n, self.span);
        Ok(n)
    }
}

/// Whether every use of the paged read `v` is a flash op's K or V, reached through transposes
/// only, with the token axis second-to-last, the table axis a batch axis and the pages' last
/// axis last, and `v` no output; and its pages a parameter, or transposes of one that keep its
/// last axis last (so that rows have unit stride: `[NP, H, P, D]` pages permuted to
/// `[NP, P, H, D]`, FlashInfer's HND layout, read in place too).
fn read_in_place(g: &Graph, v: Value) -> bool {
    let Some(mut pages) = g.operands(v).first().copied() else { return false };
    // The axis of `pages` that is the parameter's last.
    let mut last = g.node(pages).ty.rank().saturating_sub(1);
    while let Op::Transpose { perm } = &g.node(pages).op {
        let Some(p) = perm.get(last) else { return false };
        last = *p;
        let Some(x) = g.operands(pages).first().copied() else { return false };
        pages = x;
    }
    if !matches!(g.node(pages).op, Op::Param(_)) || last + 1 != g.node(pages).ty.rank() {
        return false;
    }
    let rank = g.node(v).ty.rank();
    // (value, where the token axis, the table axis and the last axis of `v` are in it)
    let mut stack = vec![(v, 1, 0, rank - 1)];
    while let Some((x, token, table, last)) = stack.pop() {
        if g.outputs().iter().any(|(_, o)| *o == x) {
            return false;
        }
        for u in g.users(x) {
            match &g.node(u).op {
                Op::Transpose { perm } => {
                    let at = |old: usize| perm.iter().position(|p| *p == old);
                    match (at(token), at(table), at(last)) {
                        (Some(t), Some(b), Some(l)) => stack.push((u, t, b, l)),
                        _ => return false,
                    }
                }
                Op::Flash(_) | Op::FlashLse(_) => {
                    let as_kv = g.operands(u).iter().enumerate().all(|(k, a)| *a != x || k == 1 || k == 2);
                    if !(as_kv && token + 2 == rank && table + 2 < rank && last + 1 == rank) {
                        return false;
                    }
                }
                _ => return false,
            }
        }
    }
    true
}
