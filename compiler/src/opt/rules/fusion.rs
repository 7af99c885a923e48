//! Flash fusion: `matmul(softmax(F(matmul(q, kᵀ))), v)` becomes one `flash` op.
//!
//! Additive scores fuse the same way: `reduce_sum(tanh(q′ + k′) * w, last axis)` with `q′` of
//! shape `[…b, M, 1, A]`, `k′` of `[…b, 1, N, A]` and `w` of `[A]` or `[…b, 1, 1, A]` (Bahdanau's
//! `vᵀ tanh(W qᵢ + U kⱼ)`) is the raw score of a flash op with [`Pair::Additive`]: the kernels
//! evaluate it tile by tile from the two projected matrices, never forming the `M×N×A` tensor.
//!
//! `F` is any chain of element-wise ops on the scores whose other operands are scalars, tensors
//! that broadcast along the score axes, positions (`iota`), dims and gathers from tables. It is
//! translated into the op's score modification ([`ScoreExpr`]); `where(p, s, -inf)` and
//! additive `where(p, 0, -inf)` masks become the mask predicate. Other tensors become extra
//! operands read by index (`x0[h]`), never copied to S×S. `sigmoid` in place of `softmax`
//! gives the un-normalised sigmoid variant.
//!
//! The rule refuses, with a reason `attnc explain` reports, when the weights are needed
//! elsewhere (an output, another user): fusing would compute the scores twice.

use super::{Build, EG, Rule, konst, ty};
use crate::ir::{BinaryOp, DType, Dim, Dropout, FlashSpec, Op, Pair, ReduceOp, ScoreExpr, TensorType, UnaryOp, Weights};
use egg::Id;
use std::collections::HashSet;

/// The fusion rule. `pinned` are the classes of weights that other nodes or outputs use.
#[derive(Clone)]
pub struct FuseAttention {
    /// Weight classes that must stay materialised.
    pub pinned: HashSet<Id>,
}

impl Rule for FuseAttention {
    rule_head!("fusion/flash-attention", Op::MatMul);

    fn rewrite(&self, eg: &EG, class: Id) -> Vec<Build> {
        self.fuse(eg, class).into_iter().filter_map(Result::ok).collect()
    }
}

impl FuseAttention {
    /// One result per `matmul(weights, v)` node of the class: the fused tree, or why not.
    pub fn fuse(&self, eg: &EG, class: Id) -> Vec<Result<Build, String>> {
        let mut out = Vec::new();
        for n in eg[class].nodes.iter().filter(|n| matches!(n.op(), Op::MatMul)) {
            let (p, v) = (n.args()[0], n.args()[1]);
            // The weights, or dropout of them: `dropout(softmax(s), seed) @ v`.
            let mut candidates = vec![(p, None)];
            for dn in eg[p].nodes.iter() {
                if let Op::Dropout { rate } = dn.op() {
                    candidates.push((dn.args()[0], Some((*rate, dn.args()[1]))));
                }
            }
            for (p, dropout) in candidates {
                for pn in eg[p].nodes.iter() {
                    let weights = match pn.op() {
                        Op::Softmax { axis } if ty(eg, p).is_some_and(|t| *axis + 1 == t.rank()) => Weights::Softmax,
                        Op::Softmax { .. } => {
                            out.push(Err("softmax is not over the key axis (the last one)".into()));
                            continue;
                        }
                        Op::Unary(UnaryOp::Sigmoid) => Weights::Sigmoid,
                        _ => continue,
                    };
                    if self.pinned.contains(&eg.find(p)) {
                        out.push(Err(
                            "the attention weights are used elsewhere (an output or another op), so they must be materialised".into()
                        ));
                        continue;
                    }
                    out.push(fuse_one(eg, weights, pn.args()[0], v, ty(eg, class).cloned(), dropout));
                }
            }
        }
        out
    }
}

/// `logsumexp(scores, last axis)` → `flash_lse(q, k, v, extras…)` where the program also
/// computes `softmax(scores) @ v` over the same scores (the case of returning the log-sum-exp
/// with the attention, or of attention sinks): the flash op that the attention fuses into
/// ([`FuseAttention`]) then writes the log-sum-exp too, and neither needs the score matrix.
/// The log-sum-exp of scores that no attention uses stays a reduction (it needs no `v`, which
/// a flash op has), and so does one whose attention cannot fuse (its weights are `pinned`:
/// used elsewhere), since a flash op of its own would compute the scores again.
#[derive(Clone)]
pub struct FuseLogSumExp {
    /// Weight classes that must stay materialised ([`FuseAttention::pinned`]).
    pub pinned: HashSet<Id>,
}

impl Rule for FuseLogSumExp {
    rule_head!("fusion/flash-logsumexp", Op::Reduce { op: ReduceOp::LogSumExp, .. });

    fn rewrite(&self, eg: &EG, class: Id) -> Vec<Build> {
        let Some(target) = ty(eg, class).cloned() else { return Vec::new() };
        let mut out = Vec::new();
        for n in eg[class].nodes.iter() {
            let Op::Reduce { op: ReduceOp::LogSumExp, axes, keepdim } = n.op() else { continue };
            let scores = eg.find(n.args()[0]);
            let Some(rank) = ty(eg, scores).map(TensorType::rank) else { continue };
            // f32 over the scores' rows: the reduction's type after a cast and, with `keepdim`, a
            // reshape; anything else (broadcast rows) is left alone.
            if axes.as_slice() != [rank - 1] || (*keepdim && target.shape.last().and_then(Dim::as_const) != Some(1)) {
                continue;
            }
            let rows = &target.shape[..if *keepdim { rank - 1 } else { target.rank() }];
            for (v, dropout) in attention_values(eg, scores, &self.pinned) {
                // With dropout, the same spec as the attention's flash op (the log-sum-exp is
                // over the weights before dropout either way), so that one step writes both.
                let Ok(Build::Node(Op::Flash(spec), _, args)) = fuse_one(eg, Weights::Softmax, scores, v, None, dropout) else { continue };
                let lse = Build::Node(Op::FlashLse(spec), None, args);
                let lse = Build::Node(Op::Reshape, Some(TensorType::new(DType::F32, rows.to_vec())), vec![lse]);
                let lse = if target.dtype == DType::F32 {
                    lse
                } else {
                    Build::Node(Op::Cast, Some(TensorType::new(target.dtype, rows.to_vec())), vec![lse])
                };
                out.push(if *keepdim { Build::Node(Op::Reshape, Some(target.clone()), vec![lse]) } else { lse });
            }
        }
        out
    }
}

/// The `v` of every `matmul(softmax(scores, last axis), v)` in the e-graph whose weights are
/// not `pinned`, or of `matmul(dropout(softmax(…), seed), v)` with the dropout's rate and seed.
fn attention_values(eg: &EG, scores: Id, pinned: &HashSet<Id>) -> Vec<(Id, Option<(f64, Id)>)> {
    let mut out = Vec::new();
    let users = |child: Id| -> Vec<(Id, &super::super::lang::ENode)> {
        eg[child]
            .parents()
            .map(|p| eg.find(p))
            .flat_map(|c| eg[c].nodes.iter().map(move |n| (c, n)))
            .filter(|(_, n)| n.args().iter().any(|a| eg.find(*a) == child))
            .collect()
    };
    for (p, n) in users(scores) {
        let last = ty(eg, p).is_some_and(|t| matches!(n.op(), Op::Softmax { axis } if *axis + 1 == t.rank()));
        if !last || pinned.contains(&eg.find(p)) {
            continue;
        }
        let mut weights = vec![(p, None)];
        for (d, n) in users(p) {
            if let Op::Dropout { rate } = n.op()
                && eg.find(n.args()[0]) == p
            {
                weights.push((d, Some((*rate, eg.find(n.args()[1])))));
            }
        }
        for (w, dropout) in weights {
            for (_, m) in users(w) {
                let found = (eg.find(m.args()[1]), dropout);
                if matches!(m.op(), Op::MatMul) && eg.find(m.args()[0]) == w && !out.contains(&found) {
                    out.push(found);
                }
            }
        }
    }
    out
}

/// `cast(flash : f32) : t` → `flash : t` when `t` is a float type at least as wide as the flash
/// op's inputs (`promote(q, v)`): the op accumulates in f32 and rounds its result once either
/// way, so the cast's extra pass over the output disappears. This undoes the widening that an
/// f32 bias over f16/bf16 attention brings when the program returns f16/bf16.
#[derive(Clone)]
pub struct CastIntoFlash;

impl Rule for CastIntoFlash {
    rule_head!("fusion/cast-into-flash", Op::Cast);

    fn rewrite(&self, eg: &EG, class: Id) -> Vec<Build> {
        let Some(target) = ty(eg, class).filter(|t| t.dtype.is_float()).cloned() else { return Vec::new() };
        let mut out = Vec::new();
        for n in eg[class].nodes.iter().filter(|n| matches!(n.op(), Op::Cast)) {
            for f in eg[n.args()[0]].nodes.iter() {
                let Op::Flash(spec) = f.op() else { continue };
                let args = f.args();
                let (Some(q), Some(v)) = (ty(eg, args[0]), ty(eg, args[2])) else { continue };
                if q.dtype.promote(v.dtype).promote(target.dtype) == target.dtype {
                    out.push(Build::Node(Op::Flash(spec.clone()), Some(target.clone()), args.iter().map(|a| Build::Class(*a)).collect()));
                }
            }
        }
        out
    }
}

/// Builds the flash op for `weights(scores) @ v`, typed as that product (`out`): wider than q,
/// k and v when a bias widened the scores. With `dropout` (its rate and the seed's class), for
/// `dropout(weights(scores), seed) @ v`.
fn fuse_one(eg: &EG, weights: Weights, scores: Id, v: Id, out: Option<TensorType>, dropout: Option<(f64, Id)>) -> Result<Build, String> {
    let st = ty(eg, scores).ok_or("untyped scores")?.clone();
    let rank = st.rank();
    if rank < 2 || !st.dtype.is_float() {
        return Err("the scores are not a float matrix".into());
    }
    let mut cx = Cx { eg, shape: st.shape.clone(), leaf: None, extras: Vec::new(), budget: 400, path: Vec::new() };
    let expr = cx.convert(scores, 0).ok_or("the scores are not an element-wise function of one q @ kᵀ")?;
    let leaf = cx.leaf.ok_or("no q @ kᵀ product (or additive score sum(tanh(q + k) * w)) feeds the scores")?;
    if !expr.uses_score() {
        return Err("the scores do not depend on q @ kᵀ".into());
    }
    let (q, k, pair) = match leaf {
        Leaf::Dot(q, kt) => (query_of_rank(eg, q, &st.shape)?, key_of_rank(eg, kt, rank)?, Pair::Dot),
        Leaf::Additive { q, k, w } => {
            let weight = cx.extras.iter().position(|e| *e == w).ok_or("the additive weight is not an operand")?;
            (squeeze(eg, q, rank - 1), squeeze(eg, k, rank - 2), Pair::Additive { weight })
        }
    };
    let v = lift(eg, v, rank).ok_or("v has more axes than the scores")?;
    let (score, preds) = split_mask(expr);
    let mask = preds.into_iter().reduce(|a, b| ScoreExpr::bin(BinaryOp::And, a, b));
    let dropout = dropout.map(|(rate, seed)| Dropout { rate, seed: cx.extra(seed) });
    let spec = FlashSpec { rank, weights, score, mask, pair, dropout };
    let mut args = vec![q, k, v];
    args.extend(cx.extras.iter().map(|e| Build::Class(*e)));
    if let (Leaf::Additive { w, .. }, Pair::Additive { weight }) = (leaf, pair)
        && let Some(t) = ty(eg, w).filter(|t| t.rank() >= 2)
    {
        // The weight without the size-1 axes aligned with the query and key axes (the two
        // before its last, where it has them): `[…b″, A]`.
        let r = t.rank();
        let shape = t.shape.iter().enumerate().filter(|(x, _)| *x + 3 < r || *x + 1 == r).map(|(_, d)| d.clone()).collect();
        args[3 + weight] = Build::Node(Op::Reshape, Some(TensorType::new(t.dtype, shape)), vec![Build::Class(w)]);
    }
    Ok(Build::Node(Op::Flash(Box::new(spec)), out, args))
}

/// Where the raw score `s` of a fused op comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Leaf {
    /// `matmul(q, kᵀ)`: the classes of `q` and `kᵀ`.
    Dot(Id, Id),
    /// `reduce_sum(tanh(q′ + k′) * w)`: the classes of `q′` (`[…b, M, 1, A]`), `k′`
    /// (`[…b′, 1, N, A]`) and `w` (`[A]`, or `[…b″, 1, 1, A]` per batch index; an extra
    /// operand, without its size-1 axes).
    Additive { q: Id, k: Id, w: Id },
}

/// `class` without its size-1 axis `axis`: the operand of a reshape that inserted it if there
/// is one (`unsqueeze(q @ w_q, 2)`), else a reshape.
fn squeeze(eg: &EG, class: Id, axis: usize) -> Build {
    let Some(t) = ty(eg, class) else { return Build::Class(class) };
    let mut shape = t.shape.clone();
    if axis < shape.len() {
        shape.remove(axis);
    }
    for n in eg[class].nodes.iter().filter(|n| matches!(n.op(), Op::Reshape)) {
        if ty(eg, n.args()[0]).is_some_and(|a| a.shape == shape) {
            return Build::Class(n.args()[0]);
        }
    }
    Build::Node(Op::Reshape, Some(TensorType::new(t.dtype, shape)), vec![Build::Class(class)])
}

/// `class` with size-1 axes in front up to `rank` (as broadcasting aligns it), itself when it
/// has `rank` axes; `None` when it has more.
fn lift(eg: &EG, class: Id, rank: usize) -> Option<Build> {
    let t = ty(eg, class)?;
    if t.rank() > rank {
        return None;
    }
    if t.rank() == rank {
        return Some(Build::Class(class));
    }
    let mut shape = vec![Dim::constant(1); rank - t.rank()];
    shape.extend(t.shape.iter().cloned());
    Some(Build::Node(Op::Reshape, Some(TensorType::new(t.dtype, shape)), vec![Build::Class(class)]))
}

/// The query operand for scores of shape `scores`: lifted to their rank, and, where its batch
/// axes are 1 and the scores' are not (a query shared by the batch: Perceiver's latents
/// against `[B, N, C]` inputs), repeated along them by an exact select (`broadcast_to`): the
/// flash op takes its batch from the query, and the copy is the query's size, not the scores'.
fn query_of_rank(eg: &EG, q: Id, scores: &[Dim]) -> Result<Build, String> {
    let rank = scores.len();
    let t = ty(eg, q).ok_or("untyped q")?.clone();
    let lifted = lift(eg, q, rank).ok_or("q has more axes than the scores")?;
    if t.rank() < 2 {
        return Err("q has fewer than two axes".into());
    }
    let lifted_batch: Vec<Dim> =
        std::iter::repeat_n(Dim::constant(1), rank - t.rank()).chain(t.shape[..t.rank() - 2].iter().cloned()).collect();
    if lifted_batch == scores[..rank - 2] {
        return Ok(lifted);
    }
    let mut shape: Vec<Dim> = scores[..rank - 2].to_vec();
    shape.extend(t.shape[t.rank() - 2..].iter().cloned());
    let position = Build::Node(Op::Iota { axis: 0 }, Some(TensorType::new(DType::I32, shape)), vec![]);
    let zero = Build::Node(Op::Const(0.0), Some(TensorType::scalar(DType::I32)), vec![]);
    let always = Build::op(Op::Binary(BinaryOp::Ge), vec![position, zero]);
    Ok(Build::op(Op::Select, vec![always, lifted.clone(), lifted]))
}

/// `k` for scores of rank `rank` from the class of `kᵀ`, lifted to that rank (K broadcasts
/// its batch axes into the query's).
fn key_of_rank(eg: &EG, kt: Id, rank: usize) -> Result<Build, String> {
    let r = ty(eg, kt).ok_or("untyped kᵀ")?.rank();
    if r < 2 || r > rank {
        return Err("kᵀ has fewer than two axes or more than the scores".into());
    }
    let k = untranspose(eg, kt, r);
    if r == rank {
        return Ok(k);
    }
    let t = ty(eg, kt).ok_or("untyped kᵀ")?;
    let mut shape = vec![Dim::constant(1); rank - r];
    shape.extend(t.shape[..r - 2].iter().cloned());
    shape.extend([t.shape[r - 1].clone(), t.shape[r - 2].clone()]);
    Ok(Build::Node(Op::Reshape, Some(TensorType::new(t.dtype, shape)), vec![k]))
}

/// `k` from `kᵀ`: the operand of a last-two-axes transpose if there is one, else a transpose.
fn untranspose(eg: &EG, kt: Id, rank: usize) -> Build {
    let mut swap: Vec<usize> = (0..rank).collect();
    swap.swap(rank - 2, rank - 1);
    for n in eg[kt].nodes.iter() {
        if let Op::Transpose { perm } = n.op()
            && *perm == swap
        {
            return Build::Class(n.args()[0]);
        }
    }
    Build::op(Op::Transpose { perm: swap }, vec![Build::Class(kt)])
}

/// Translates score classes into a [`ScoreExpr`].
struct Cx<'a> {
    eg: &'a EG,
    /// Shape of the score tensor.
    shape: Vec<Dim>,
    /// The source of the raw score once found.
    leaf: Option<Leaf>,
    /// Classes read by `Load`.
    extras: Vec<Id>,
    /// Bounds the work on deep or shared sub-graphs.
    budget: usize,
    /// Classes being converted, outermost first. Rewrites such as `x * 1 = x` put a node in
    /// the class it reads (`mul(c, 1)` in class `c`); such a node has no finite expression, so
    /// it fails at once instead of spending the budget that its class's other nodes need.
    path: Vec<Id>,
}

impl Cx<'_> {
    fn convert(&mut self, class: Id, depth: usize) -> Option<ScoreExpr> {
        let class = self.eg.find(class);
        if depth > 32 || self.budget == 0 || self.path.contains(&class) {
            return None;
        }
        self.budget -= 1;
        self.path.push(class);
        let e = self.convert_class(class, depth);
        self.path.pop();
        e
    }

    fn convert_class(&mut self, class: Id, depth: usize) -> Option<ScoreExpr> {
        let eg = self.eg;
        let t = ty(eg, class)?.clone();
        // The q @ kᵀ product itself, or an additive score.
        if t.shape == self.shape {
            let dots = eg[class].nodes.iter().filter(|n| matches!(n.op(), Op::MatMul));
            let found = dots.map(|n| Leaf::Dot(eg.find(n.args()[0]), eg.find(n.args()[1]))).chain(self.additive(class));
            for leaf in found.collect::<Vec<_>>() {
                match self.leaf {
                    None => {
                        if let Leaf::Additive { w, .. } = leaf {
                            self.extra(w);
                        }
                        self.leaf = Some(leaf);
                        return Some(ScoreExpr::Score);
                    }
                    Some(l) if l == leaf => return Some(ScoreExpr::Score),
                    Some(_) => {}
                }
            }
        }
        if let Some(c) = konst(eg, class) {
            return Some(if t.dtype.is_float() { ScoreExpr::Float(c) } else { ScoreExpr::Int(c as i64) });
        }
        for n in eg[class].nodes.iter() {
            let snapshot = (self.leaf, self.extras.len());
            if let Some(e) = self.convert_node(n, &t, depth) {
                return Some(e);
            }
            // A failed alternative must not leave a half-recorded leaf or extras behind.
            (self.leaf, _) = (snapshot.0, ());
            self.extras.truncate(snapshot.1);
        }
        self.load_whole(class, &t)
    }

    fn convert_node(&mut self, n: &super::super::lang::ENode, t: &TensorType, depth: usize) -> Option<ScoreExpr> {
        let a = n.args();
        Some(match n.op() {
            Op::DimValue(d) => ScoreExpr::Dim(d.clone()),
            Op::Iota { axis } => ScoreExpr::Pos(self.aligned(t, *axis)?),
            Op::Unary(u) => ScoreExpr::Unary(*u, Box::new(self.convert(a[0], depth + 1)?)),
            Op::Binary(b) => {
                let x = self.convert(a[0], depth + 1)?;
                let y = self.convert(a[1], depth + 1)?;
                // Integer division in the graph is true division; keep the semantics exact.
                ScoreExpr::bin(*b, x, y)
            }
            Op::Select => ScoreExpr::Select(
                Box::new(self.convert(a[0], depth + 1)?),
                Box::new(self.convert(a[1], depth + 1)?),
                Box::new(self.convert(a[2], depth + 1)?),
            ),
            Op::Cast if t.dtype == DType::F32 => self.convert(a[0], depth + 1)?,
            Op::Gather => {
                let table = self.eg.find(a[0]);
                let sizes = ty(self.eg, table)?.shape.clone();
                let mut index = Vec::new();
                for (ix, size) in a[1..].iter().zip(&sizes) {
                    let e = self.convert(*ix, depth + 1)?;
                    // A gather's out-of-range index is a run-time error, and the flash kernels
                    // skip masked tiles without evaluating them: only indices proven in range
                    // at every score position fold into the loads.
                    if e.uses_score() || !in_range(&e, &self.shape, size) {
                        return None;
                    }
                    index.push(e);
                }
                ScoreExpr::Load { input: self.extra(table), index }
            }
            _ => return None,
        })
    }

    /// The additive scores `reduce_sum(tanh(q′ + k′) * w)` over the last axis in `class`, if
    /// it has them: `q′` spans the query axis and has size 1 on the key axis, `k′` the reverse,
    /// both with the score's batch axes (`k′`'s may be 1), `w` is a float vector over the summed
    /// axis (the kernels compute in f32 whatever the storage type).
    fn additive(&self, class: Id) -> Option<Leaf> {
        let eg = self.eg;
        let r = self.shape.len();
        let one = Dim::constant(1);
        let float_ty = |c: Id| ty(eg, c).filter(|t| t.dtype.is_float());
        for n in eg[class].nodes.iter() {
            let Op::Reduce { op: ReduceOp::Sum, axes, keepdim: false } = n.op() else { continue };
            if axes.as_slice() != [r] {
                continue;
            }
            let Some(width) = float_ty(n.args()[0]).filter(|t| t.rank() == r + 1).map(|t| t.shape[r].clone()) else { continue };
            for m in eg[n.args()[0]].nodes.iter().filter(|m| matches!(m.op(), Op::Binary(BinaryOp::Mul))) {
                for (t, w) in [(m.args()[0], m.args()[1]), (m.args()[1], m.args()[0])] {
                    // `w` over the summed axis, per batch index or shared: `[…b″, 1, 1, A]`
                    // right-aligned (or `[A]`), with no extent along the query or key axis.
                    let one_at = |wt: &TensorType, axis: usize| {
                        let off = (r + 1).saturating_sub(wt.rank());
                        axis < off || wt.shape[axis - off] == one
                    };
                    let fits = |wt: &TensorType| {
                        let off = (r + 1).saturating_sub(wt.rank());
                        wt.rank() <= r + 1
                            && wt.shape.last() == Some(&width)
                            && one_at(wt, r - 2)
                            && one_at(wt, r - 1)
                            && (off..r - 2).all(|x| wt.shape[x - off] == one || wt.shape[x - off] == self.shape[x])
                    };
                    if float_ty(w).is_none_or(|wt| !fits(wt)) {
                        continue;
                    }
                    for th in eg[t].nodes.iter().filter(|x| matches!(x.op(), Op::Unary(UnaryOp::Tanh))) {
                        for add in eg[th.args()[0]].nodes.iter().filter(|x| matches!(x.op(), Op::Binary(BinaryOp::Add))) {
                            let (a, b) = (add.args()[0], add.args()[1]);
                            let side = |c: Id, query: bool| {
                                float_ty(c).is_some_and(|t| {
                                    let (along, flat) = if query { (r - 2, r - 1) } else { (r - 1, r - 2) };
                                    t.rank() == r + 1
                                        && t.shape[along] == self.shape[along]
                                        && t.shape[flat] == one
                                        && t.shape[r] == width
                                        && (0..r - 2).all(|x| t.shape[x] == self.shape[x] || (!query && t.shape[x] == one))
                                })
                            };
                            for (q, k) in [(a, b), (b, a)] {
                                if side(q, true) && side(k, false) {
                                    return Some(Leaf::Additive { q: eg.find(q), k: eg.find(k), w: eg.find(w) });
                                }
                            }
                        }
                    }
                }
            }
        }
        None
    }

    /// A tensor that broadcasts along the score axes, read per element (a 0-d one, such as a
    /// window size or a temperature given as an input, is one value for every score).
    fn load_whole(&mut self, class: Id, t: &TensorType) -> Option<ScoreExpr> {
        if t.rank() > self.shape.len() {
            return None;
        }
        let offset = self.shape.len() - t.rank();
        let one = Dim::constant(1);
        let mut index = Vec::new();
        for (k, d) in t.shape.iter().enumerate() {
            if *d == one {
                index.push(ScoreExpr::Int(0));
            } else if *d == self.shape[offset + k] {
                index.push(ScoreExpr::Pos(offset + k));
            } else {
                return None;
            }
        }
        Some(ScoreExpr::Load { input: self.extra(class), index })
    }

    /// Score axis of axis `axis` of a tensor of type `t` broadcast against the scores, if it
    /// spans that axis.
    fn aligned(&self, t: &TensorType, axis: usize) -> Option<usize> {
        let offset = self.shape.len().checked_sub(t.rank())?;
        (t.shape.get(axis)? == &self.shape[offset + axis]).then_some(offset + axis)
    }

    fn extra(&mut self, class: Id) -> usize {
        match self.extras.iter().position(|e| *e == class) {
            Some(k) => k,
            None => {
                self.extras.push(class);
                self.extras.len() - 1
            }
        }
    }
}

fn is_neg_inf(e: &ScoreExpr) -> bool {
    matches!(e, ScoreExpr::Float(v) if *v == f64::NEG_INFINITY)
}

fn is_zero(e: &ScoreExpr) -> bool {
    matches!(e, ScoreExpr::Float(v) if *v == 0.0) || matches!(e, ScoreExpr::Int(0))
}

/// Peels masks off the outside of a score expression: `where(p, e, -inf)`, `where(p, -inf, e)`
/// and `e + where(p, 0, -inf)`, for predicates that do not read the score, also from under a
/// constant scale or shift (`where(p, e, -inf) * c`).
pub fn split_mask(e: ScoreExpr) -> (ScoreExpr, Vec<ScoreExpr>) {
    match e {
        ScoreExpr::Select(p, a, b) if !p.uses_score() && is_neg_inf(&b) => {
            let (inner, mut preds) = split_mask(*a);
            preds.insert(0, *p);
            (inner, preds)
        }
        ScoreExpr::Select(p, a, b) if !p.uses_score() && is_neg_inf(&a) => {
            let (inner, mut preds) = split_mask(*b);
            preds.insert(0, ScoreExpr::Unary(UnaryOp::Not, p));
            (inner, preds)
        }
        // `-inf * c`, `-inf / c` and `-inf ± c` stay `-inf` for a finite constant `c > 0`
        // (any finite `c` for `±`), so a mask under a constant scale or shift still peels off.
        ScoreExpr::Binary(op @ (BinaryOp::Mul | BinaryOp::Div | BinaryOp::Add | BinaryOp::Sub), x, c) if keeps_neg_inf(op, &c) => {
            let (inner, preds) = split_mask(*x);
            (ScoreExpr::bin(op, inner, *c), preds)
        }
        ScoreExpr::Binary(op @ (BinaryOp::Mul | BinaryOp::Add), c, x) if keeps_neg_inf(op, &c) => {
            let (inner, preds) = split_mask(*x);
            (ScoreExpr::bin(op, *c, inner), preds)
        }
        ScoreExpr::Binary(BinaryOp::Add, x, y) => {
            let additive = |m: &ScoreExpr| matches!(m, ScoreExpr::Select(p, z, n) if !p.uses_score() && is_zero(z) && is_neg_inf(n));
            if additive(&y)
                && let ScoreExpr::Select(p, _, _) = *y
            {
                let (inner, mut preds) = split_mask(*x);
                preds.insert(0, *p);
                (inner, preds)
            } else if additive(&x)
                && let ScoreExpr::Select(p, _, _) = *x
            {
                let (inner, mut preds) = split_mask(*y);
                preds.insert(0, *p);
                (inner, preds)
            } else {
                (ScoreExpr::Binary(BinaryOp::Add, x, y), Vec::new())
            }
        }
        other => (other, Vec::new()),
    }
}

/// Whether `-inf op c` (and `c op -inf` for the commutative ops) is `-inf`.
fn keeps_neg_inf(op: BinaryOp, c: &ScoreExpr) -> bool {
    let v = match c {
        ScoreExpr::Float(v) => *v,
        ScoreExpr::Int(v) => *v as f64,
        _ => return false,
    };
    v.is_finite() && (v > 0.0 || matches!(op, BinaryOp::Add | BinaryOp::Sub))
}

/// Whether the integer score expression `e` lies in `[0, size)` at every position of a score
/// tensor of `shape`, for every value of the dims.
fn in_range(e: &ScoreExpr, shape: &[Dim], size: &Dim) -> bool {
    bounds(e, shape, 0).is_some_and(|(lo, hi)| nonneg(&lo) && nonneg(&size.sub(&Dim::constant(1)).sub(&hi)))
}

/// A dim provably ≥ 0 whatever the (non-negative) sizes: no negative coefficient.
fn nonneg(d: &Dim) -> bool {
    d.terms().all(|(_, c)| c >= 0)
}

/// Bounds `[lo, hi]` of an integer score expression over every score position, as dims;
/// `None` where they are not known (data, floats, unproven comparisons).
fn bounds(e: &ScoreExpr, shape: &[Dim], depth: usize) -> Option<(Dim, Dim)> {
    if depth > 64 {
        return None;
    }
    let b = |x: &ScoreExpr| bounds(x, shape, depth + 1);
    // Two dims as (smaller, larger) when their order is provable.
    let order = |a: &Dim, c: &Dim| {
        if nonneg(&a.sub(c)) {
            Some((c.clone(), a.clone()))
        } else if nonneg(&c.sub(a)) {
            Some((a.clone(), c.clone()))
        } else {
            None
        }
    };
    let larger = |a: &Dim, c: &Dim| order(a, c).map(|(_, hi)| hi);
    let smaller = |a: &Dim, c: &Dim| order(a, c).map(|(lo, _)| lo);
    Some(match e {
        ScoreExpr::Pos(k) => (Dim::constant(0), shape.get(*k)?.sub(&Dim::constant(1))),
        ScoreExpr::Int(c) => (Dim::constant(*c), Dim::constant(*c)),
        ScoreExpr::Dim(d) => (d.clone(), d.clone()),
        ScoreExpr::Unary(UnaryOp::Neg, x) => {
            let (lo, hi) = b(x)?;
            (Dim::constant(0).sub(&hi), Dim::constant(0).sub(&lo))
        }
        ScoreExpr::Binary(op, x, y) => {
            let ((xl, xh), (yl, yh)) = (b(x)?, b(y)?);
            match op {
                BinaryOp::Add => (xl.add(&yl), xh.add(&yh)),
                BinaryOp::Sub => (xl.sub(&yh), xh.sub(&yl)),
                // Products of non-negative ranges, or by a constant.
                BinaryOp::Mul => match (yl.as_const().filter(|_| yl == yh), xl.as_const().filter(|_| xl == xh)) {
                    (Some(c), _) | (None, Some(c)) => {
                        let (l, h) = if yl == yh { (xl, xh) } else { (yl, yh) };
                        let k = Dim::constant(c);
                        if c >= 0 { (l.mul(&k), h.mul(&k)) } else { (h.mul(&k), l.mul(&k)) }
                    }
                    _ if nonneg(&xl) && nonneg(&yl) => (xl.mul(&yl), xh.mul(&yh)),
                    _ => return None,
                },
                // max(a, b) ≥ both lower bounds, so either will do; its upper bound needs the
                // larger one (and min the other way round).
                // `x % y` takes the divisor's sign: in [0, y - 1] for y ≥ 1. A divisor that is a
                // size counts as ≥ 1: an empty table is refused when a run is prepared.
                BinaryOp::Rem => {
                    let size = matches!(**y, ScoreExpr::Dim(_));
                    if !(size || nonneg(&yl.sub(&Dim::constant(1)))) {
                        return None;
                    }
                    (Dim::constant(0), yh.sub(&Dim::constant(1)))
                }
                BinaryOp::Max => (larger(&xl, &yl).unwrap_or(if yl.as_const().is_some() { yl } else { xl }), larger(&xh, &yh)?),
                BinaryOp::Min => (smaller(&xl, &yl)?, smaller(&xh, &yh).unwrap_or(if yh.as_const().is_some() { yh } else { xh })),
                _ => return None,
            }
        }
        ScoreExpr::Select(_, x, y) => {
            let ((xl, xh), (yl, yh)) = (b(x)?, b(y)?);
            (smaller(&xl, &yl)?, larger(&xh, &yh)?)
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::super::Rule;
    use super::CastIntoFlash;

    /// A cast below the inputs' type is a real rounding of its own and stays.
    #[test]
    fn a_cast_below_the_inputs_type_stays() {
        let g = crate::ir::Graph::parse(
            "graph t {
  %0 = param[name=q] : f32[S, D]
  %1 = param[name=k] : f32[S, D]
  %2 = param[name=v] : f32[S, D]
  %3 = flash[rank=2, weights=softmax, score=\"s\"] %0, %1, %2 : f32[S, D]
  %4 = cast %3 : bf16[S, D]
  output out = %4
}",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let loaded = crate::opt::lang::load(&g);
        let eg = &loaded.egraph;
        let cast = eg.find(loaded.class_of[4]);
        assert!(CastIntoFlash.rewrite(eg, cast).is_empty());
    }

    #[test]
    fn lookups_fold_only_when_their_index_is_proven_in_range() {
        use super::in_range;
        use crate::ir::{BinaryOp, Dim, ScoreExpr};
        let shape = [Dim::sym("H"), Dim::sym("S"), Dim::sym("S")];
        let (h, i, j) = (ScoreExpr::Pos(0), ScoreExpr::Pos(1), ScoreExpr::Pos(2));
        let bin = ScoreExpr::bin;
        let rel = bin(BinaryOp::Sub, j.clone(), i.clone());
        // T5-style buckets: clamp(j - i, -16, 16) + 16 in a table of 33.
        let bucket = bin(
            BinaryOp::Add,
            bin(BinaryOp::Min, bin(BinaryOp::Max, rel.clone(), ScoreExpr::Int(-16)), ScoreExpr::Int(16)),
            ScoreExpr::Int(16),
        );
        assert!(in_range(&bucket, &shape, &Dim::constant(33)));
        assert!(!in_range(&bucket, &shape, &Dim::constant(32)));
        assert!(in_range(&h, &shape, &Dim::sym("H")));
        // j - i + S - 1 lies in [0, 2S - 2].
        let shifted = bin(BinaryOp::Add, rel.clone(), bin(BinaryOp::Sub, ScoreExpr::Dim(Dim::sym("S")), ScoreExpr::Int(1)));
        assert!(in_range(&shifted, &shape, &Dim::sym("S").mul(&Dim::constant(2)).sub(&Dim::constant(1))));
        // (j - i) % R in a table of R (the divisor's sign); % 0 is not a bucket.
        let wrapped = bin(BinaryOp::Rem, rel.clone(), ScoreExpr::Dim(Dim::sym("R")));
        assert!(in_range(&wrapped, &shape, &Dim::sym("R")));
        assert!(!in_range(&bin(BinaryOp::Rem, rel.clone(), ScoreExpr::Int(0)), &shape, &Dim::sym("R")));
        // Negative above (or below) the diagonal, and data-dependent indices: not proven.
        assert!(!in_range(&rel, &shape, &Dim::sym("S")));
        assert!(!in_range(&ScoreExpr::Load { input: 0, index: vec![i] }, &shape, &Dim::sym("S")));
    }
}
