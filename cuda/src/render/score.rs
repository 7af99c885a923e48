//! Flash score modifications and mask predicates as C, with the classes and meaning of
//! [`attn_compiler::ir::semantics`] (as [`ScoreExpr::eval`] and the CPU renderer have them): positions,
//! integer literals and dims are ints, loads have their operand's class and clamp their
//! indices.

use super::CudaEmitError;
use super::cexpr::{Ints, float_lit, load};
use super::ops::{self, CVal, Lines};
use attn_compiler::ir::semantics::{Class, Scalar};
use attn_compiler::ir::{ScoreExpr, int_literal};
use attn_compiler::schedule::View;

/// What a score expression refers to in a kernel.
pub(super) struct ScoreCtx<'a> {
    /// The integer table.
    pub ints: &'a Ints<'a>,
    /// The score `s` (a float expression), where the expression may read it.
    pub s: Option<&'a str>,
    /// One `i64` expression per score axis (batch axes, then `i`, then `j`).
    pub pos: &'a [String],
    /// The extra operands.
    pub extras: &'a [View],
}

impl ScoreCtx<'_> {
    fn fail(&self, reason: String) -> CudaEmitError {
        self.ints.fail(reason)
    }

    /// The value of `e` (statements into `l`).
    pub fn eval(&self, l: &mut Lines, e: &ScoreExpr) -> Result<CVal, CudaEmitError> {
        Ok(match e {
            ScoreExpr::Score => CVal::float(self.s.ok_or_else(|| self.fail("the score `s` is read where no score exists".into()))?),
            ScoreExpr::Pos(k) => {
                let p = self.pos.get(*k).ok_or_else(|| self.fail(format!("position {k} is not known here")))?;
                CVal::int(format!("attnc_wrap({p})"))
            }
            ScoreExpr::Float(v) => CVal::float(float_lit(*v)),
            ScoreExpr::Int(v) => match int_literal(*v) {
                Scalar::I(i) => Lines::constant(f64::from(i), Class::Int),
                other => CVal::float(float_lit(other.as_f())),
            },
            ScoreExpr::Dim(d) => CVal::int(format!("attnc_wrap({})", self.ints.dim(d)?)),
            ScoreExpr::Load { input, index } => {
                let x = self.extras.get(*input).ok_or_else(|| self.fail(format!("extra operand x{input} does not exist")))?;
                let mut idx = Vec::new();
                for (k, ie) in index.iter().enumerate() {
                    let i = self.eval(l, ie)?;
                    let size = x.shape.get(k).map_or(Ok("1LL".to_string()), |d| self.ints.dim(d))?;
                    idx.push(format!("attnc_clampi((i64){}, {size})", ops::convert(&i, Class::Int)));
                }
                l.bind(load(x.buf, x.dtype, &self.ints.offset(x, &idx)?), Class::of(x.dtype))
            }
            ScoreExpr::Unary(u, a) => {
                let a = self.eval(l, a)?;
                ops::unary(l, *u, &a)
            }
            ScoreExpr::Binary(b, x, y) => {
                let (x, y) = (self.eval(l, x)?, self.eval(l, y)?);
                ops::binary(l, *b, &x, &y)
            }
            ScoreExpr::Select(c, a, b) => {
                let (c, a, b) = (self.eval(l, c)?, self.eval(l, a)?, self.eval(l, b)?);
                ops::select(l, &c, &a, &b)
            }
        })
    }
}

/// Statements defining `sc_` (the modified score, float) and, for a partial tile of a masked
/// op, narrowing `keep_` (which must already hold whether the key exists). `cls_` is the tile's
/// class.
pub(super) fn score_lines(cx: &ScoreCtx, score: &ScoreExpr, mask: Option<&ScoreExpr>, prefix: &str) -> Result<Vec<String>, CudaEmitError> {
    let mut l = Lines::new(prefix);
    let sc = cx.eval(&mut l, score)?;
    let mut out = l.lines;
    out.push(format!("const float sc_ = {};", ops::convert(&sc, Class::Float)));
    if let Some(mask) = mask {
        let mut l = Lines::new(&format!("{prefix}m"));
        let keep = cx.eval(&mut l, mask)?;
        out.push("if (cls_ == 2 && keep_) {".into());
        out.extend(l.lines.iter().map(|s| format!("  {s}")));
        out.push(format!("  keep_ = {};", ops::convert(&keep, Class::Bool)));
        out.push("}".into());
    }
    Ok(out)
}
