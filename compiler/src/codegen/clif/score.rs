//! Compiles a flash op's score modification and mask predicate ([`ScoreExpr`]) to Cranelift
//! instructions, evaluated per score element (or four at a time) inside the flash kernel's
//! tile loop: no interpreter and no callback per element.
//!
//! Classes follow the reference semantics ([`ScoreExpr::eval`]): positions, integer constants
//! and dims are integers, arithmetic on two integers stays integral, `/` and `**` are floats,
//! comparisons and logic are truth values, loads have their operand's class.

use super::builder::Fx;
use super::ops::{Kind, RemMode, Tv, clamped_load};
use crate::ir::{BinaryOp, DType, Dim, ScoreExpr, UnaryOp};
use cranelift_codegen::ir::{InstBuilder, Value, types};
use std::collections::HashMap;

/// An extra operand as the expressions read it.
pub struct Extra {
    /// Element type.
    pub dtype: DType,
    /// Address of its first element.
    pub base: Value,
    /// Element stride per axis (i64).
    pub strides: Vec<Value>,
    /// Size per axis (i64).
    pub sizes: Vec<Value>,
}

/// How often a sub-expression changes inside the flash kernel's loops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Once per work item: constants, dims, batch positions and loads indexed by them.
    Item,
    /// Once per query row: also the row position `i`.
    Row,
    /// Per score: the score `s` or the key position `j`.
    Elem,
}

/// The level of `e` in a score tensor of rank `rank`.
pub fn level(e: &ScoreExpr, rank: usize) -> Level {
    match e {
        ScoreExpr::Score => Level::Elem,
        ScoreExpr::Pos(k) if *k + 1 == rank => Level::Elem,
        ScoreExpr::Pos(k) if *k + 2 == rank => Level::Row,
        ScoreExpr::Pos(_) | ScoreExpr::Float(_) | ScoreExpr::Int(_) | ScoreExpr::Dim(_) => Level::Item,
        ScoreExpr::Load { index, .. } => index.iter().map(|x| level(x, rank)).max().unwrap_or(Level::Item),
        ScoreExpr::Unary(_, a) => level(a, rank),
        ScoreExpr::Binary(_, a, b) => level(a, rank).max(level(b, rank)),
        ScoreExpr::Select(c, a, b) => level(c, rank).max(level(a, rank)).max(level(b, rank)),
    }
}

/// Values of sub-expressions computed outside the score loop (scalars), by node address.
pub type Hoisted = HashMap<*const ScoreExpr, Tv>;

/// Evaluates (as scalars) every maximal sub-expression of `exprs` whose level is at most `at`
/// and that is worth hoisting (not a bare constant or position), adding them to `env`'s cache.
pub fn hoist(fx: &mut Fx, exprs: &[&ScoreExpr], rank: usize, at: Level, env: &Env, out: &mut Hoisted) {
    fn walk(fx: &mut Fx, e: &ScoreExpr, rank: usize, at: Level, env: &Env, out: &mut Hoisted) {
        let leaf = matches!(e, ScoreExpr::Score | ScoreExpr::Pos(_) | ScoreExpr::Float(_) | ScoreExpr::Int(_) | ScoreExpr::Dim(_));
        if leaf || env.hoisted.contains_key(&(e as *const ScoreExpr)) {
            return;
        }
        if level(e, rank) <= at {
            let saved = fx.lanes;
            fx.lanes = 1;
            let v = eval(fx, e, env);
            fx.lanes = saved;
            out.insert(e as *const ScoreExpr, v);
            return;
        }
        match e {
            ScoreExpr::Load { index, .. } => index.iter().for_each(|x| walk(fx, x, rank, at, env, out)),
            ScoreExpr::Unary(_, a) => walk(fx, a, rank, at, env, out),
            ScoreExpr::Binary(_, a, b) => {
                walk(fx, a, rank, at, env, out);
                walk(fx, b, rank, at, env, out);
            }
            ScoreExpr::Select(c, a, b) => {
                walk(fx, c, rank, at, env, out);
                walk(fx, a, rank, at, env, out);
                walk(fx, b, rank, at, env, out);
            }
            _ => {}
        }
    }
    for e in exprs {
        walk(fx, e, rank, at, env, out);
    }
}

/// Everything an expression can read at one score element.
pub struct Env<'e> {
    /// The raw (or alpha-scaled) score, if the expression may read it.
    pub s: Option<Tv>,
    /// Position per score axis (i32, at the current lane count).
    pub pos: &'e [Value],
    /// Dims the expressions mention, as i32 scalars (loaded in the prologue).
    pub dims: &'e HashMap<Dim, Value>,
    /// Extra operands.
    pub extras: &'e [Extra],
    /// Sub-expressions already computed outside the loop (scalars, broadcast when read).
    pub hoisted: &'e Hoisted,
}

/// Every dim an expression mentions.
pub fn dims_of(e: &ScoreExpr, out: &mut Vec<Dim>) {
    e.visit(&mut |x| {
        if let ScoreExpr::Dim(d) = x
            && !out.contains(d)
        {
            out.push(d.clone());
        }
    });
}

/// Evaluates `e` at the current lane count.
pub fn eval(fx: &mut Fx, e: &ScoreExpr, env: &Env) -> Tv {
    if let Some(t) = env.hoisted.get(&(e as *const ScoreExpr)) {
        return Tv { v: fx.splat(t.k, t.v), k: t.k };
    }
    match e {
        ScoreExpr::Score => env.s.unwrap_or_else(|| Tv { v: fx.fconst(f32::NAN), k: Kind::F }),
        ScoreExpr::Pos(k) => match env.pos.get(*k) {
            Some(v) => Tv { v: *v, k: Kind::I },
            None => Tv { v: fx.iconst(0), k: Kind::I },
        },
        ScoreExpr::Float(x) => Tv { v: fx.fconst(*x as f32), k: Kind::F },
        ScoreExpr::Int(x) => match i32::try_from(*x) {
            Ok(i) => Tv { v: fx.iconst(i64::from(i)), k: Kind::I },
            // Too wide for i32: keep the magnitude as a float.
            Err(_) => Tv { v: fx.fconst(*x as f32), k: Kind::F },
        },
        ScoreExpr::Dim(d) => {
            let s = match env.dims.get(d) {
                Some(v) => *v,
                None => fx.b.ins().iconst(types::I32, 0),
            };
            Tv { v: fx.splat(Kind::I, s), k: Kind::I }
        }
        ScoreExpr::Load { input, index } => {
            let idx: Vec<Value> = index
                .iter()
                .map(|x| {
                    let t = eval(fx, x, env);
                    fx.cvt_i(t)
                })
                .collect();
            match env.extras.get(*input) {
                Some(x) => load(fx, x, &idx),
                None => Tv { v: fx.fconst(f32::NAN), k: Kind::F },
            }
        }
        ScoreExpr::Unary(op, a) => {
            let a = eval(fx, a, env);
            fx.unary(*op, a)
        }
        ScoreExpr::Binary(op, a, b) => {
            let a = eval(fx, a, env);
            let b = eval(fx, b, env);
            fx.binary(*op, a, b, RemMode::Floor)
        }
        ScoreExpr::Select(c, a, b) => {
            let c = eval(fx, c, env);
            let a = eval(fx, a, env);
            let b = eval(fx, b, env);
            fx.select(c, a, b)
        }
    }
}

/// `x[idx...]` with every index clamped into its axis (lane by lane for vectors).
fn load(fx: &mut Fx, x: &Extra, idx: &[Value]) -> Tv {
    clamped_load(fx, x.dtype, x.base, &x.strides, &x.sizes, idx)
}

/// A softmax score modification split as `score = rest + sep`, where `sep` (no `s`) is a sum
/// of terms that each depend on the query position `i` or the key position `j` but never on
/// both (after distributing products by factors free of both): `sep(i, j) = c(j) + r(i)`.
///
/// Softmax does not change when a row is shifted, so the flash kernel computes
/// `rest + sep(i0, j)` with `i0` a fixed row of the query block: `sep(i0, j)` is one vector per
/// key tile instead of an expression per score, and the row's shift `r(i) - r(i0)` drops out.
/// That holds while `r` is finite, which the kernel checks per query block (falling back to the
/// whole expression where it is not).
#[derive(Clone, Debug, PartialEq)]
pub struct Separated {
    /// The terms that read the score or depend on both positions.
    pub rest: ScoreExpr,
    /// The separable terms, as written (evaluated at `i = i0`).
    pub sep: ScoreExpr,
}

/// Splits `score` (of a score tensor of rank `rank`) into [`Separated`] parts, or `None` when no
/// top-level additive term is separable.
pub fn separate(score: &ScoreExpr, rank: usize) -> Option<Separated> {
    let mut terms = Vec::new();
    flatten(score, false, &mut terms);
    let (sep, rest): (Vec<_>, Vec<_>) = terms.into_iter().partition(|(_, t)| !reads_score(t) && separable(t, rank));
    let sep = rebuild(sep)?;
    let rest = rebuild(rest).unwrap_or(ScoreExpr::Float(0.0));
    Some(Separated { rest, sep })
}

/// The top-level terms of a sum, with their signs (`true`: subtracted).
fn flatten(e: &ScoreExpr, neg: bool, out: &mut Vec<(bool, ScoreExpr)>) {
    match e {
        ScoreExpr::Binary(BinaryOp::Add, a, b) => {
            flatten(a, neg, out);
            flatten(b, neg, out);
        }
        ScoreExpr::Binary(BinaryOp::Sub, a, b) => {
            flatten(a, neg, out);
            flatten(b, !neg, out);
        }
        ScoreExpr::Unary(UnaryOp::Neg, a) => flatten(a, !neg, out),
        _ => out.push((neg, e.clone())),
    }
}

/// The sum of signed terms, or `None` for no terms.
fn rebuild(terms: Vec<(bool, ScoreExpr)>) -> Option<ScoreExpr> {
    let mut it = terms.into_iter();
    let (neg, first) = it.next()?;
    let first = if neg { ScoreExpr::Unary(UnaryOp::Neg, Box::new(first)) } else { first };
    Some(it.fold(first, |acc, (neg, t)| ScoreExpr::Binary(if neg { BinaryOp::Sub } else { BinaryOp::Add }, Box::new(acc), Box::new(t))))
}

/// Whether `e` reads the score `s`.
pub fn reads_score(e: &ScoreExpr) -> bool {
    let mut found = false;
    e.visit(&mut |x| found |= matches!(x, ScoreExpr::Score));
    found
}

/// Whether `e` reads the query position and whether it reads the key position.
fn positions(e: &ScoreExpr, rank: usize) -> (bool, bool) {
    let (mut i, mut j) = (false, false);
    e.visit(&mut |x| {
        if let ScoreExpr::Pos(k) = x {
            i |= *k + 2 == rank;
            j |= *k + 1 == rank;
        }
    });
    (i, j)
}

/// Whether `e` is a sum of parts that each depend on at most one of `i`, `j`.
fn separable(e: &ScoreExpr, rank: usize) -> bool {
    let free = |x: &ScoreExpr| positions(x, rank) == (false, false);
    match positions(e, rank) {
        (false, _) | (_, false) => true,
        _ => match e {
            ScoreExpr::Binary(BinaryOp::Add | BinaryOp::Sub, a, b) => separable(a, rank) && separable(b, rank),
            ScoreExpr::Unary(UnaryOp::Neg, a) => separable(a, rank),
            ScoreExpr::Binary(BinaryOp::Mul, a, b) if free(a) => separable(b, rank),
            ScoreExpr::Binary(BinaryOp::Mul | BinaryOp::Div, a, b) if free(b) => separable(a, rank),
            _ => false,
        },
    }
}

/// `e` with every `tanh(s)` replaced by `s`, when `e` reads the score only through `tanh(s)`
/// (soft-capping, `cap · tanh(s / cap)` with the division folded into the score scale): the
/// flash kernel then applies `tanh` to whole rows with a 16-lane kernel first.
pub fn tanh_staged(e: &ScoreExpr) -> Option<ScoreExpr> {
    fn strip(e: &ScoreExpr, found: &mut bool) -> Option<ScoreExpr> {
        Some(match e {
            ScoreExpr::Unary(UnaryOp::Tanh, a) if **a == ScoreExpr::Score => {
                *found = true;
                ScoreExpr::Score
            }
            ScoreExpr::Score => return None,
            ScoreExpr::Pos(_) | ScoreExpr::Float(_) | ScoreExpr::Int(_) | ScoreExpr::Dim(_) => e.clone(),
            ScoreExpr::Load { input, index } => {
                ScoreExpr::Load { input: *input, index: index.iter().map(|x| strip(x, found)).collect::<Option<_>>()? }
            }
            ScoreExpr::Unary(op, a) => ScoreExpr::Unary(*op, Box::new(strip(a, found)?)),
            ScoreExpr::Binary(op, a, b) => ScoreExpr::Binary(*op, Box::new(strip(a, found)?), Box::new(strip(b, found)?)),
            ScoreExpr::Select(c, a, b) => {
                ScoreExpr::Select(Box::new(strip(c, found)?), Box::new(strip(a, found)?), Box::new(strip(b, found)?))
            }
        })
    }
    let mut found = false;
    let out = strip(e, &mut found)?;
    found.then_some(out)
}

/// `Some(None)` when `e` is the score itself, `Some(Some(c))` when it is `c · s` or `s · c` with
/// `c` the same for the whole work item (batch positions, dims, constants): the softmax kernel
/// then reads the raw scores and applies `c` itself.
pub fn score_factor(e: &ScoreExpr, rank: usize) -> Option<Option<&ScoreExpr>> {
    match e {
        ScoreExpr::Score => Some(None),
        ScoreExpr::Binary(BinaryOp::Mul, a, b) => match (&**a, &**b) {
            (ScoreExpr::Score, c) | (c, ScoreExpr::Score) if level(c, rank) == Level::Item => Some(Some(c)),
            _ => None,
        },
        _ => None,
    }
}
