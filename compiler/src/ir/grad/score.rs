//! The derivative of a flash op's score modification `F(s, positions, x0[…], x1[…], …)`:
//! `∂F/∂s`, and `∂F/∂x` for every load of a float extra operand, as score expressions. They are
//! built by reverse mode over the expression with the element-wise rules of [`super::rules`],
//! the same rules the graph's derivative uses, so a fused backward and an unfused one agree.

use super::rules::{self, Algebra};
use crate::ir::flash_spec::{FlashSpec, ScoreExpr};
use crate::ir::op::{BinaryOp, UnaryOp};
use crate::ir::semantics::Class;

/// The largest derivative expression built (in nodes): reverse mode repeats sub-expressions, and
/// a derivative this large would be slower to evaluate per score than the products around it.
pub const MAX_GRAD_NODES: usize = 4096;

/// The partial derivatives of a score modification.
#[derive(Clone, Debug, PartialEq)]
pub struct ScoreGrad {
    /// `∂F/∂s`; `0.0` when `F` does not read the score.
    pub ds: ScoreExpr,
    /// One entry per load of a float extra operand in `F`, in expression order.
    pub loads: Vec<LoadGrad>,
}

/// The partial derivative of a score modification with respect to one load `x<input>[index]`.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadGrad {
    /// Which extra operand.
    pub input: usize,
    /// The load's indices (clamped into range when evaluated, as the load is).
    pub index: Vec<ScoreExpr>,
    /// `∂F/∂x<input>[index]`.
    pub d: ScoreExpr,
}

/// The derivatives of `spec`'s score modification; `extra` gives each extra operand's class.
/// Fails when a derivative would exceed `MAX_GRAD_NODES` (4096) nodes.
pub fn score_grad(spec: &FlashSpec, extra: &dyn Fn(usize) -> Class) -> Result<ScoreGrad, String> {
    let mut b = Exprs { extra };
    let mut ds = Vec::new();
    let mut loads = Vec::new();
    b.back(&spec.score, ScoreExpr::Float(1.0), &mut ds, &mut loads)?;
    let mut total = ScoreExpr::Float(0.0);
    for term in ds {
        total = b.binary(BinaryOp::Add, total, term)?;
    }
    let grad = ScoreGrad { ds: total, loads };
    let size = nodes(&grad.ds) + grad.loads.iter().map(|l| nodes(&l.d)).sum::<usize>();
    if size > MAX_GRAD_NODES {
        return Err(format!("the score modification's derivative has {size} operations (at most {MAX_GRAD_NODES} are fused)"));
    }
    Ok(grad)
}

fn nodes(e: &ScoreExpr) -> usize {
    let mut n = 0;
    e.visit(&mut |_| n += 1);
    n
}

/// Score expressions as an [`Algebra`], folding the identities that the seed `1.0` creates.
struct Exprs<'a> {
    extra: &'a dyn Fn(usize) -> Class,
}

impl Exprs<'_> {
    fn class(&self, e: &ScoreExpr) -> Class {
        e.class(self.extra)
    }

    /// Adds the adjoint `g` of `e` to its leaves: `s` into `ds`, float loads into `loads`.
    /// Integer and bool sub-expressions carry no gradient.
    fn back(&mut self, e: &ScoreExpr, g: ScoreExpr, ds: &mut Vec<ScoreExpr>, loads: &mut Vec<LoadGrad>) -> Result<(), String> {
        if self.class(e) != Class::Float {
            return Ok(());
        }
        match e {
            ScoreExpr::Score => ds.push(g),
            ScoreExpr::Load { input, index } => loads.push(LoadGrad { input: *input, index: index.clone(), d: g }),
            ScoreExpr::Unary(u, a) => {
                if let Some(d) = rules::unary(self, *u, (**a).clone(), e.clone(), g)? {
                    self.back(a, d, ds, loads)?;
                }
            }
            ScoreExpr::Binary(op, a, b) => {
                for (slot, d) in rules::binary(self, *op, (**a).clone(), (**b).clone(), e.clone(), g)? {
                    self.back(if slot == 0 { a } else { b }, d, ds, loads)?;
                }
            }
            ScoreExpr::Select(c, a, b) => {
                for (slot, d) in rules::select(self, (**c).clone(), g)? {
                    self.back(if slot == 1 { a } else { b }, d, ds, loads)?;
                }
            }
            ScoreExpr::Pos(_) | ScoreExpr::Float(_) | ScoreExpr::Int(_) | ScoreExpr::Dim(_) => {}
        }
        Ok(())
    }
}

impl Algebra for Exprs<'_> {
    type V = ScoreExpr;
    type E = String;

    fn unary(&mut self, op: UnaryOp, a: ScoreExpr) -> Result<ScoreExpr, String> {
        Ok(match (op, a) {
            (UnaryOp::Neg, ScoreExpr::Float(c)) => ScoreExpr::Float(-c),
            (op, a) => ScoreExpr::Unary(op, Box::new(a)),
        })
    }

    fn binary(&mut self, op: BinaryOp, a: ScoreExpr, b: ScoreExpr) -> Result<ScoreExpr, String> {
        // `x * 1 = x` and `x + 0 = x` hold bit for bit for a float `x` (NaN and -0 included
        // for the product; `-0 + 0` is `+0`, which only the sign of a zero gradient sees).
        let float = |e: &ScoreExpr, s: &Self| s.class(e) == Class::Float;
        Ok(match (op, a, b) {
            (BinaryOp::Mul, ScoreExpr::Float(c), x) | (BinaryOp::Mul, x, ScoreExpr::Float(c)) if c == 1.0 && float(&x, self) => x,
            (BinaryOp::Add, ScoreExpr::Float(c), x) | (BinaryOp::Add, x, ScoreExpr::Float(c)) if c == 0.0 && float(&x, self) => x,
            (op, a, b) => ScoreExpr::bin(op, a, b),
        })
    }

    fn select(&mut self, c: ScoreExpr, a: ScoreExpr, b: ScoreExpr) -> Result<ScoreExpr, String> {
        Ok(ScoreExpr::Select(Box::new(c), Box::new(a), Box::new(b)))
    }

    fn float(&mut self, c: f64, _like: &ScoreExpr) -> Result<ScoreExpr, String> {
        Ok(ScoreExpr::Float(c))
    }

    fn zero_of(&mut self, x: &ScoreExpr) -> Result<ScoreExpr, String> {
        Ok(if self.class(x) == Class::Int { ScoreExpr::Int(0) } else { ScoreExpr::Float(0.0) })
    }
}
