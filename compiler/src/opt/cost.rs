//! The cost model: FLOPs plus bytes moved, with symbolic dims evaluated at representative
//! sizes. A flash op moves O(S·D) bytes (no score matrix); the unfused chain moves O(S²).
//!
//! Representative sizes ([`crate::ir::representative`]), unless the caller gives real ones:
//! dims named like sequence lengths (first letter S, N, M, T or L) are 1024, batch-like `B` 2,
//! head counts `H`/`G` 8, everything else (head widths, feature sizes, prefixes) 64. Only the
//! ordering of costs matters.

use super::lang::{Classes, ENode};
use crate::ir::{BinaryOp, Dim, Op, ScoreExpr, TensorType, infer};
use egg::{CostFunction, Id, Language};
use std::cell::RefCell;
use std::collections::HashMap;

/// Bytes per element moved (f32), and how many FLOPs one byte is worth.
const BYTES: f64 = 4.0;
const FLOPS_PER_BYTE: f64 = 1.0;

/// The cost function of extraction (also egg's [`CostFunction`]).
pub struct Cost<'a> {
    /// The e-graph's classes (for operand types).
    classes: &'a Classes<'a>,
    /// Dim sizes to evaluate shapes at.
    env: HashMap<String, i64>,
    /// [`Self::own_in`] by the node's key and its types (interned: by address): a long program
    /// repeats a few (op, types) pairs, and evaluating their symbolic sizes is most of a cost.
    known: RefCell<HashMap<OwnKey, f64>>,
}

/// An e-node's key number, and the addresses of its result type and its operands' types.
type OwnKey = (usize, usize, [usize; OWN_ARITY]);

/// E-nodes with at most this many operands have their own costs memoised.
const OWN_ARITY: usize = 3;

impl<'a> Cost<'a> {
    /// The cost model over `classes`, with dims evaluated at `env`.
    pub fn new(classes: &'a Classes<'a>, env: HashMap<String, i64>) -> Cost<'a> {
        Cost { classes, env, known: RefCell::new(HashMap::new()) }
    }

    fn elems(&self, shape: &[Dim]) -> f64 {
        shape.iter().map(|d| d.eval(&self.env).unwrap_or(64).max(0) as f64).product()
    }

    /// The node's own cost (without its operands).
    pub fn own(&self, n: &ENode) -> f64 {
        let tys: Option<Vec<&TensorType>> = n.args().iter().map(|c| self.classes.get(*c).ty).collect();
        let Some(tys) = tys else { return f64::INFINITY };
        let Ok(out) = infer(n.op(), &tys, n.ty()) else { return f64::INFINITY };
        self.own_typed(n, &tys, &out)
    }

    /// [`Self::own`] for a node of the class `class`, whose type the e-graph already knows
    /// (every node of a class has it): no type inference, so extraction stays cheap.
    pub fn own_in(&self, n: &ENode, class: Id) -> f64 {
        let Some(out) = self.classes.get(class).ty else { return f64::INFINITY };
        let mut key: OwnKey = (n.discriminant(), std::ptr::from_ref(out) as usize, [0; OWN_ARITY]);
        if n.args().len() <= OWN_ARITY {
            for (slot, c) in key.2.iter_mut().zip(n.args()) {
                let Some(ty) = self.classes.get(*c).ty else { return f64::INFINITY };
                *slot = std::ptr::from_ref(ty) as usize;
            }
            if let Some(known) = self.known.borrow().get(&key) {
                return *known;
            }
        }
        let tys: Option<Vec<&TensorType>> = n.args().iter().map(|c| self.classes.get(*c).ty).collect();
        let Some(tys) = tys else { return f64::INFINITY };
        let own = self.own_typed(n, &tys, out);
        if n.args().len() <= OWN_ARITY {
            self.known.borrow_mut().insert(key, own);
        }
        own
    }

    fn own_typed(&self, n: &ENode, tys: &[&TensorType], out: &TensorType) -> f64 {
        let out_elems = self.elems(&out.shape);
        let moved = |extra: f64| (out_elems + extra) * BYTES * FLOPS_PER_BYTE;
        let ins: f64 = tys.iter().map(|t| self.elems(&t.shape)).sum();
        match n.op() {
            Op::Param(_) | Op::Const(_) | Op::DimValue(_) => 0.0,
            // Read in place by the flash op (a block-table view of the pages).
            Op::Iota { .. } | Op::Reshape | Op::Paged => 1.0,
            // A strided view for the backends, but not free: folding transposes must pay.
            Op::Transpose { .. } => 1.0 + out_elems * 0.25,
            // Division is several times slower than multiplication on every target.
            Op::Binary(BinaryOp::Div | BinaryOp::Rem) => 4.0 * out_elems + moved(ins),
            Op::Unary(_) | Op::Binary(_) | Op::Select | Op::Cast | Op::Gather | Op::Slice { .. } | Op::Concat { .. } => {
                out_elems + moved(ins)
            }
            Op::MatMul => {
                let k = tys[0].shape.last().map_or(1.0, |d| self.elems(std::slice::from_ref(d)));
                2.0 * out_elems * k + moved(ins)
            }
            Op::Reduce { .. } | Op::Softmax { .. } | Op::Scan { .. } => 5.0 * ins + moved(ins),
            Op::ArgSort { .. } => 20.0 * ins + moved(ins),
            // The state update k ⊗ v and the read q · state per position.
            Op::PrefixAttention { .. } => {
                let d = tys[0].shape.last().map_or(1.0, |d| self.elems(std::slice::from_ref(d)));
                4.0 * out_elems * d + moved(ins)
            }
            Op::ScatterAdd { .. } => 2.0 * ins + moved(ins),
            // Ten Philox rounds per element.
            Op::Dropout { .. } => 20.0 * out_elems + moved(ins),
            Op::LayerNorm { .. } | Op::RmsNorm { .. } => 8.0 * out_elems + moved(ins),
            // Products per score: Q·Kᵀ and P·V (forward), and the backward's five (Q·Kᵀ, dO·Vᵀ,
            // dV, dK, dQ), for each gradient a share of them. A log-sum-exp comes with its flash
            // op (`fusion/flash-logsumexp` builds it where the same scores' attention fuses; the
            // backends' flash step writes both), so it costs no products, only the score
            // modification: that term makes it choose the same form as its flash op (a scale
            // folded into q, or into the score), which pairs the two.
            Op::Flash(spec) | Op::FlashLse(spec) | Op::FlashGrad { spec, .. } => {
                let q = &tys[0].shape;
                let r = q.len();
                let n_keys = self.elems(&tys[1].shape[r - 2..r - 1]);
                let width = self.elems(&q[r - 1..]);
                let rows = self.elems(&q[..r - 1]);
                let per_score = expr_ops(&spec.score) + spec.mask.as_ref().map_or(0.0, expr_ops);
                let products = match n.op() {
                    Op::FlashLse(_) => 0.0,
                    Op::FlashGrad { .. } => 3.0,
                    _ => 2.0,
                };
                // An additive score costs a `tanh` (about ten operations) and an add and an FMA
                // per width element where a dot product costs one FMA.
                let pair = match spec.pair {
                    crate::ir::Pair::Dot => 0.0,
                    crate::ir::Pair::Additive { .. } => 10.0 * width,
                };
                let live = self.live_share(spec.mask.as_ref(), q, n_keys);
                live * (2.0 * products * rows * n_keys * width + rows * n_keys * (pair + per_score + 4.0)) + moved(ins)
            }
        }
    }
}

impl Cost<'_> {
    /// The share of a flash op's scores in tiles its mask does not skip (the kernels skip the
    /// rest unread): a 16 × 16 grid of tiles over the `[…b, M, N]` scores, classified at the
    /// model's sizes as the kernels' tile tables are (`ir::tile_grid`). 1 without a mask.
    fn live_share(&self, mask: Option<&ScoreExpr>, q: &[Dim], n_keys: f64) -> f64 {
        let Some(mask) = mask else { return 1.0 };
        let r = q.len();
        let size = |d: &Dim| d.eval(&self.env).unwrap_or(64).max(0);
        let (m, n) = (q.get(r.wrapping_sub(2)).map_or(1, size), n_keys as i64);
        let batch: Vec<i64> = q[..r.saturating_sub(2)].iter().map(size).collect();
        let tile = ((m + 15) / 16, (n + 15) / 16);
        1.0 - crate::ir::tile_grid(Some(mask), &batch, (m, n), tile, &self.env).skipped_share()
    }
}

/// Operation count of a score expression.
fn expr_ops(e: &ScoreExpr) -> f64 {
    let mut n = 0.0;
    e.visit(&mut |s| {
        if matches!(s, ScoreExpr::Unary(..) | ScoreExpr::Binary(..) | ScoreExpr::Select(..) | ScoreExpr::Load { .. }) {
            n += 1.0;
        }
    });
    n
}

impl CostFunction<ENode> for Cost<'_> {
    type Cost = f64;

    fn cost<C>(&mut self, enode: &ENode, mut costs: C) -> f64
    where
        C: FnMut(Id) -> f64,
    {
        let own = self.own(enode);
        enode.args().iter().fold(own, |acc, c| acc + costs(*c))
    }
}
