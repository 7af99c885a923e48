//! Compiles a flash op's score modification and mask predicate ([`ScoreExpr`]) to Cranelift
//! instructions, evaluated per score element (or four at a time) inside the flash kernel's
//! tile loop: no interpreter and no callback per element. Sub-expressions that change less
//! often than per score (by [`attn_compiler::schedule::level`]) are hoisted out of the loop.
//!
//! Classes follow [`attn_compiler::ir::semantics`] (as [`ScoreExpr::eval`] does): positions, integer
//! constants and dims are integers, arithmetic on two integers stays integral, `/` and `**`
//! are floats, comparisons and logic are truth values, loads have their operand's class.

use super::builder::StepBuilder;
use super::ops::{Typed, clamped_load};
use attn_compiler::ir::semantics::Class;
use attn_compiler::ir::{DType, Dim, ScoreExpr};
use attn_compiler::schedule::{Level, level};
use cranelift_codegen::ir::{InstBuilder, Value};
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

impl Extra {
    /// Every extra operand of a flash kernel as the expressions read it (loaded now, in the
    /// prologue).
    pub fn of_views(fx: &mut StepBuilder, views: &[attn_compiler::schedule::View]) -> Vec<Extra> {
        views
            .iter()
            .map(|x| {
                let (base, strides) = fx.view_base(x);
                let sizes = fx.dims(&x.shape);
                Extra { dtype: x.dtype, base, strides, sizes }
            })
            .collect()
    }
}

/// Values of sub-expressions computed outside the score loop (scalars), by node address.
pub type Hoisted = HashMap<*const ScoreExpr, Typed>;

/// Evaluates (as scalars) every maximal sub-expression of `exprs` whose level is at most `at`
/// and that is worth hoisting (not a bare constant or position), adding them to `env`'s cache.
pub fn hoist(fx: &mut StepBuilder, exprs: &[&ScoreExpr], rank: usize, at: Level, env: &Env, out: &mut Hoisted) {
    fn walk(fx: &mut StepBuilder, e: &ScoreExpr, rank: usize, at: Level, env: &Env, out: &mut Hoisted) {
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
    pub s: Option<Typed>,
    /// Position per score axis (i32, at the current lane count).
    pub pos: &'e [Value],
    /// Dims the expressions mention, as i32 scalars (loaded in the prologue).
    pub dims: &'e HashMap<Dim, Value>,
    /// Extra operands.
    pub extras: &'e [Extra],
    /// Sub-expressions already computed outside the loop (scalars, broadcast when read).
    pub hoisted: &'e Hoisted,
}

/// The positions of a work item's first score: its batch positions, then query and key 0.
pub fn item_positions(fx: &mut StepBuilder, batch: &[Value]) -> Vec<Value> {
    let mut pos = batch.to_vec();
    let z = fx.b.ins().iconst(cranelift_codegen::ir::types::I32, 0);
    pos.extend([z, z]);
    pos
}

/// The parts of `exprs` that are the same for a whole work item (batch positions `batch`, of a
/// score tensor of rank `rank`), computed once for it.
pub fn hoist_item(
    fx: &mut StepBuilder,
    exprs: &[&ScoreExpr],
    rank: usize,
    batch: &[Value],
    dims: &HashMap<Dim, Value>,
    extras: &[Extra],
) -> Hoisted {
    let pos = item_positions(fx, batch);
    let none = Hoisted::new();
    let env = Env { s: None, pos: &pos, dims, extras, hoisted: &none };
    let mut hoisted = Hoisted::new();
    hoist(fx, exprs, rank, Level::Item, &env, &mut hoisted);
    hoisted
}

/// Every dim of `dims` as the i32 scalar score expressions compute with (read from the integer
/// table once, in a step's prologue).
pub fn dim_values(fx: &mut StepBuilder, dims: Vec<Dim>) -> HashMap<Dim, Value> {
    let mut out = HashMap::new();
    for d in dims {
        let x = fx.dim(&d);
        let x = fx.b.ins().ireduce(cranelift_codegen::ir::types::I32, x);
        out.insert(d, x);
    }
    out
}

/// A position-free scale (`alpha`, a folded query scale) as an f32 scalar, evaluated once per
/// step; 1 without one.
pub fn step_scalar(fx: &mut StepBuilder, c: Option<&ScoreExpr>, dims: &HashMap<Dim, Value>, extras: &[Extra]) -> Value {
    match c {
        Some(c) => {
            let none = Hoisted::new();
            let env = Env { s: None, pos: &[], dims, extras, hoisted: &none };
            let t = eval(fx, c, &env);
            fx.cvt_f(t)
        }
        None => fx.f32(1.0),
    }
}

/// Evaluates `e` at the current lane count.
pub fn eval(fx: &mut StepBuilder, e: &ScoreExpr, env: &Env) -> Typed {
    if let Some(t) = env.hoisted.get(&(e as *const ScoreExpr)) {
        return Typed { v: fx.splat(t.k, t.v), k: t.k };
    }
    match e {
        ScoreExpr::Score => env.s.unwrap_or_else(|| fx.fail("the score `s` read where no score exists")),
        ScoreExpr::Pos(k) => match env.pos.get(*k) {
            Some(v) => Typed { v: *v, k: Class::Int },
            None => fx.fail(format!("position {k} read where it is not known")),
        },
        ScoreExpr::Float(x) => Typed { v: fx.fconst(*x as f32), k: Class::Float },
        ScoreExpr::Int(x) => match i32::try_from(*x) {
            Ok(i) => Typed { v: fx.iconst(i64::from(i)), k: Class::Int },
            // Too wide for i32: keep the magnitude as a float.
            Err(_) => Typed { v: fx.fconst(*x as f32), k: Class::Float },
        },
        ScoreExpr::Dim(d) => match env.dims.get(d) {
            Some(v) => Typed { v: fx.splat(Class::Int, *v), k: Class::Int },
            None => fx.fail(format!("dim {d} was not loaded")),
        },
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
                None => fx.fail(format!("extra operand x{input} does not exist")),
            }
        }
        ScoreExpr::Unary(op, a) => {
            let a = eval(fx, a, env);
            fx.unary(*op, a)
        }
        ScoreExpr::Binary(op, a, b) => {
            let a = eval(fx, a, env);
            let b = eval(fx, b, env);
            fx.binary(*op, a, b)
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
fn load(fx: &mut StepBuilder, x: &Extra, idx: &[Value]) -> Typed {
    clamped_load(fx, x.dtype, x.base, &x.strides, &x.sizes, idx, None)
}
