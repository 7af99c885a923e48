//! Pass 1 of the schedule, placement and inlining: which values the outputs need, which are
//! computed inside their users' kernels instead of stored, and which nodes one step computes
//! together (a flash op and its log-sum-exp; the gradients of one flash op; scalings that ride
//! on a flash op's products). Pure analysis of the graph: no buffer or step exists yet.
//!
//! Rules:
//! - Element-wise ops (unary, binary, select, cast, constants, dim values, iota, gather) are
//!   inlined into their user when they have one user that is itself element-wise (or a concat,
//!   or a reduction: [`Kernel::ReduceOf`](super::Kernel::ReduceOf) computes each element as it
//!   reads it); constants, dim values, iota and subtrees of at most [`MAX_SHARED_OPS`] cheap ops
//!   are inlined into any number of such users. The rest are kernel roots whose result is
//!   stored, and so is every [`MAX_INLINE_DEPTH`]-th op of a longer chain.
//! - `q * c` with a scalar `c`, read only as flash ops' query, is not computed at all: the scale
//!   rides on the Q·Kᵀ product ([`Placement::folded`]).

use crate::ir::{BinaryOp, FlashWrt, Graph, Op, ScoreExpr, Value};
use std::collections::HashMap;

/// Where the values of a graph go, before any buffer exists.
pub(super) struct Placement {
    /// Values the outputs depend on.
    pub live: Vec<bool>,
    /// Live values computed inside their users' kernels.
    pub inline: Vec<bool>,
    /// Query scalings folded into flash ops: `(unscaled operand, scale)` (see [`folded_scales`]).
    pub folded: Vec<Option<(Value, ScoreExpr)>>,
    /// Flash ops and the `flash_lse` of the same op, which their step writes too.
    pub lse_of: HashMap<Value, Value>,
    /// The other way.
    pub flash_of: HashMap<Value, Value>,
    /// The `flash_grad` nodes of one flash op, which one step computes, by any member.
    pub grads: HashMap<Value, Vec<Value>>,
    /// A query gradient read only by scalings `g * c …`: the products and the scale, which the
    /// backward step applies to its `dQ` products (see [`scaled_grads`]).
    pub scaled: HashMap<Value, (Vec<Value>, ScoreExpr)>,
}

impl Placement {
    /// The placement of `g`'s values.
    pub fn of(g: &Graph) -> Placement {
        let live = live_values(g);
        let inline = inline_set(g, &live);
        let folded = folded_scales(g, &live);
        let lse_of = lse_partners(g, &live);
        let flash_of = lse_of.iter().map(|(f, s)| (*s, *f)).collect();
        let grads = grad_groups(g, &live);
        let scaled = scaled_grads(g, &live);
        Placement { live, inline, folded, lse_of, flash_of, grads, scaled }
    }

    /// Whether `v` is computed inside its users (inlined, or a scaling folded into a flash op).
    pub fn computed_by_users(&self, v: Value) -> bool {
        self.inline[v.index()] || self.folded[v.index()].is_some()
    }
}

/// Scalar IR expressions (constants, dims and element-wise ops of them) as score expressions.
fn scalar_expr(g: &Graph, v: Value) -> Option<ScoreExpr> {
    let node = g.node(v);
    if node.ty.shape.iter().any(|d| d.as_const() != Some(1)) {
        return None;
    }
    let args = g.operands(v);
    Some(match &node.op {
        Op::Const(c) => ScoreExpr::Float(node.ty.dtype.round(*c)),
        Op::DimValue(d) => ScoreExpr::Dim(d.clone()),
        Op::Unary(u) => ScoreExpr::Unary(*u, Box::new(scalar_expr(g, args[0])?)),
        Op::Binary(b) if !b.is_comparison() && !b.is_logical() => ScoreExpr::bin(*b, scalar_expr(g, args[0])?, scalar_expr(g, args[1])?),
        _ => return None,
    })
}

/// `q * c` (or `c * q`) feeding only flash ops' queries (a flash op, its log-sum-exp, its
/// gradients), with `c` a scalar expression: the scale rides on the Q·Kᵀ product (and the
/// backward's `dK` product) instead of a scaled copy of q. Maps such products to
/// (the unscaled operand, the scale).
fn folded_scales(g: &Graph, live: &[bool]) -> Vec<Option<(Value, ScoreExpr)>> {
    g.values()
        .map(|v| {
            let node = g.node(v);
            if !live[v.index()] || node.op != Op::Binary(BinaryOp::Mul) || !node.ty.dtype.is_float() {
                return None;
            }
            // Read only as the query of flash-family ops (a flash op, its log-sum-exp and its
            // gradients), once each.
            let users: Vec<Value> = g.users(v).into_iter().filter(|u| live[u.index()]).collect();
            let only_query = !users.is_empty() && users.iter().all(|u| {
                // A scale of an additive score's query does not factor out of the `tanh`.
                matches!(&g.node(*u).op, Op::Flash(f) | Op::FlashLse(f) | Op::FlashGrad { spec: f, .. } if f.pair == crate::ir::Pair::Dot)
                    && g.operands(*u).iter().position(|a| *a == v) == Some(0)
                    && g.operands(*u).iter().filter(|a| **a == v).count() == 1
            }) && !g.outputs().iter().any(|(_, o)| *o == v);
            if !only_query {
                return None;
            }
            let (x, e) = scaled(g, v)?;
            Some(scale_chain(g, live, x, e))
        })
        .collect()
}

/// `x * c` (or `c * x`) with `c` a scalar expression and `x` of the product's type: `(x, c)`.
fn scaled(g: &Graph, v: Value) -> Option<(Value, ScoreExpr)> {
    let node = g.node(v);
    if node.op != Op::Binary(BinaryOp::Mul) || !node.ty.dtype.is_float() {
        return None;
    }
    let args = g.operands(v);
    let (x, c) = (args[0], args[1]);
    let same = |a: Value| g.node(a).ty == node.ty;
    if same(x)
        && let Some(e) = scalar_expr(g, c)
    {
        return Some((x, e));
    }
    if same(c)
        && let Some(e) = scalar_expr(g, x)
    {
        return Some((c, e));
    }
    None
}

/// `(x, c)` with `x` itself a scaled value read only here (`x = y * c'`, not an output)
/// followed down to `(y, c' · c)`, and so on: a chain of scales folds into one.
fn scale_chain(g: &Graph, live: &[bool], mut x: Value, mut c: ScoreExpr) -> (Value, ScoreExpr) {
    loop {
        let users = g.users(x).into_iter().filter(|u| live[u.index()]).count();
        let output = g.outputs().iter().any(|(_, o)| *o == x);
        match scaled(g, x) {
            Some((y, c2)) if users == 1 && !output => {
                x = y;
                c = ScoreExpr::bin(BinaryOp::Mul, c2, c);
            }
            _ => return (x, c),
        }
    }
}

/// Every live flash op with a live `flash_lse` of the same op (spec and operands), which its
/// step then writes too.
fn lse_partners(g: &Graph, live: &[bool]) -> HashMap<Value, Value> {
    let mut out = HashMap::new();
    for v in g.values().filter(|v| live[v.index()]) {
        let Op::FlashLse(spec) = &g.node(v).op else { continue };
        let operands = g.operands(v);
        let Some(first) = operands.first() else { continue };
        let twin = g.users(*first).into_iter().find(|u| {
            live[u.index()] && matches!(&g.node(*u).op, Op::Flash(f) if **f == **spec) && g.operands(*u) == operands && !out.contains_key(u)
        });
        if let Some(f) = twin {
            out.insert(f, v);
        }
    }
    out
}

/// The live `flash_grad` nodes grouped by flash op (spec and operands): each member maps to the
/// whole group, in graph order.
fn grad_groups(g: &Graph, live: &[bool]) -> HashMap<Value, Vec<Value>> {
    let mut groups: Vec<Vec<Value>> = Vec::new();
    for v in g.values().filter(|v| live[v.index()]) {
        let Op::FlashGrad { spec, .. } = &g.node(v).op else { continue };
        let operands = g.operands(v);
        let same = |u: &Value| matches!(&g.node(*u).op, Op::FlashGrad { spec: s, .. } if s == spec) && g.operands(*u) == operands;
        match groups.iter_mut().find(|grp| grp.first().is_some_and(same)) {
            Some(grp) => grp.push(v),
            None => groups.push(vec![v]),
        }
    }
    groups.into_iter().flat_map(|grp| grp.clone().into_iter().map(move |v| (v, grp.clone()))).collect()
}

/// Query gradients (`flash_grad` with `wrt=q`) read only by a chain of scalings `g * c1 * c2 …`
/// with scalar `c`s (the derivative of a query the schedule scaled): maps each to the chain's
/// products (the last one holds the value) and the product of the scales, so that the backward
/// step writes the last product directly.
fn scaled_grads(g: &Graph, live: &[bool]) -> HashMap<Value, (Vec<Value>, ScoreExpr)> {
    let mut out = HashMap::new();
    for v in g.values().filter(|v| live[v.index()]) {
        if !matches!(g.node(v).op, Op::FlashGrad { wrt: FlashWrt::Q, .. }) {
            continue;
        }
        let (mut at, mut chain, mut scale) = (v, Vec::new(), None::<ScoreExpr>);
        loop {
            let users: Vec<Value> = g.users(at).into_iter().filter(|u| live[u.index()]).collect();
            if g.outputs().iter().any(|(_, o)| *o == at) {
                break;
            }
            let [m] = users[..] else { break };
            match scaled(g, m) {
                Some((x, c)) if x == at && g.operands(m).iter().filter(|a| **a == at).count() == 1 => {
                    scale = Some(match scale {
                        Some(s) => ScoreExpr::bin(BinaryOp::Mul, s, c),
                        None => c,
                    });
                    chain.push(m);
                    at = m;
                }
                _ => break,
            }
        }
        if let Some(s) = scale {
            out.insert(v, (chain, s));
        }
    }
    out
}

/// Values the outputs depend on.
fn live_values(g: &Graph) -> Vec<bool> {
    let mut live = vec![false; g.len()];
    let mut stack: Vec<Value> = g.outputs().iter().map(|(_, v)| *v).collect();
    while let Some(v) = stack.pop() {
        if !std::mem::replace(&mut live[v.index()], true) {
            stack.extend(g.operands(v));
        }
    }
    live
}

/// Ops computed per element from their operands' elements at the same (broadcast) index.
/// (Dropout is one too, but it is always stored: its generator is worth a kernel of its own on
/// the CPU, `form`'s choice.)
pub(super) fn is_elementwise(op: &Op) -> bool {
    matches!(op, Op::Const(_) | Op::DimValue(_) | Op::Iota { .. } | Op::Unary(_) | Op::Binary(_) | Op::Select | Op::Cast | Op::Gather)
}

/// The deepest expression tree an element-wise kernel computes: a chain of element-wise ops
/// longer than this is stored every this many ops. It bounds the recursion of every pass over
/// an expression (building, rendering, emulating) whatever the program's length.
pub const MAX_INLINE_DEPTH: usize = 64;

/// The most operations an element-wise value with several users may take to be recomputed by
/// each of them instead of stored: a subtraction and a cast recomputed beat a write and reads of
/// a tensor that can be far larger than its operands (`κ - u` broadcast to `[B, T, K, U]` in
/// `examples/location_attention.attn`).
pub const MAX_SHARED_OPS: usize = 4;

/// What computing `op` once costs, in [`MAX_SHARED_OPS`] units: `None` for the ops too
/// expensive to compute twice (transcendental functions, division, powers, and gathers, whose
/// scattered reads cost more than a stored copy's: `examples/reformer.attn` ran 45% slower
/// with its sorted queries gathered by each of their three users).
fn shared_cost(op: &Op) -> Option<usize> {
    use crate::ir::{BinaryOp as B, UnaryOp as U};
    match op {
        Op::Const(_) | Op::DimValue(_) | Op::Iota { .. } => Some(0),
        Op::Cast | Op::Select => Some(1),
        Op::Unary(U::Neg | U::Not | U::Relu | U::Abs | U::Floor) => Some(1),
        Op::Binary(B::Div | B::Rem | B::Pow) => None,
        Op::Binary(_) => Some(1),
        _ => None,
    }
}

/// Whether `op` (a user of `v`) is a reduction that computes `v` per element as it reads it
/// ([`Kernel::ReduceOf`]): any reduction of a tensor whose reduced axes are listed in order
/// (the order its elements are combined in).
pub(super) fn reduces_inline(g: &Graph, v: Value, op: &Op) -> bool {
    let rank = g.node(v).ty.rank();
    matches!(op, Op::Reduce { axes, .. } if rank >= 1 && axes.windows(2).all(|w| w[0] < w[1]) && axes.iter().all(|a| *a < rank))
}

/// Which live values are computed inline by their users.
fn inline_set(g: &Graph, live: &[bool]) -> Vec<bool> {
    let mut is_output = vec![false; g.len()];
    for (_, v) in g.outputs() {
        is_output[v.index()] = true;
    }
    let mut inline = vec![false; g.len()];
    // Depth of the expression tree rooted at each value when it is computed inline, and its
    // cost (`None`: too expensive to compute more than once).
    let mut depth = vec![0usize; g.len()];
    let mut cost: Vec<Option<usize>> = vec![None; g.len()];
    for v in g.topo_order().unwrap_or_default() {
        let op = &g.node(v).op;
        if !live[v.index()] || is_output[v.index()] || !is_elementwise(op) {
            continue;
        }
        let users: Vec<Value> = g.users(v).into_iter().filter(|u| live[u.index()]).collect();
        // A gather's table is read at computed indices, so it must be in memory.
        let fits = |u: &Value| {
            let uop = &g.node(*u).op;
            let as_table = matches!(uop, Op::Gather) && g.operands(*u).first() == Some(&v);
            (is_elementwise(uop) || matches!(uop, Op::Concat { .. }) || reduces_inline(g, v, uop)) && !as_table
        };
        let cheap = matches!(op, Op::Const(_) | Op::DimValue(_) | Op::Iota { .. });
        depth[v.index()] = 1 + g.operands(v).iter().filter(|a| inline[a.index()]).map(|a| depth[a.index()]).max().unwrap_or(0);
        cost[v.index()] = shared_cost(op)
            .and_then(|own| g.operands(v).iter().filter(|a| inline[a.index()]).try_fold(own, |c, a| Some(c + cost[a.index()]?)));
        let shared = users.len() == 1 || cheap || cost[v.index()].is_some_and(|c| c <= MAX_SHARED_OPS);
        inline[v.index()] = !users.is_empty() && users.iter().all(fits) && shared && depth[v.index()] < MAX_INLINE_DEPTH;
    }
    inline
}
