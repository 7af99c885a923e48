//! Flash score modifications and mask predicates as C `float` expressions, with the scalar
//! semantics of [`crate::ir::ScoreExpr::eval`] (computed in f32, as the reference allows):
//! booleans are 0/1, loads from extra operands clamp their indices.

use super::cexpr::{cdim, float_lit, load, offset, to_float};
use super::view::View;
use crate::ir::{BinaryOp, DType, Dim, ScoreExpr, UnaryOp};

/// An extra operand of a flash op, as the score expressions read it.
pub(super) struct Extra {
    /// Where it lives.
    pub view: View,
    /// Its shape (for clamping).
    pub shape: Vec<Dim>,
    /// Its dtype.
    pub dtype: DType,
}

/// What a score expression refers to in the kernel.
pub(super) struct ScoreCtx<'a> {
    /// The raw score `s` (a float expression).
    pub s: &'a str,
    /// One `i64` expression per score axis (batch axes, then `i`, then `j`).
    pub pos: &'a [String],
    /// The extra operands.
    pub extras: &'a [Extra],
}

/// The expression as C text of type `float`.
pub(super) fn score_c(e: &ScoreExpr, cx: &ScoreCtx) -> String {
    let f = |x: &ScoreExpr| score_c(x, cx);
    let truth = |c: String| format!("(({c}) ? 1.0f : 0.0f)");
    match e {
        ScoreExpr::Score => cx.s.to_string(),
        ScoreExpr::Pos(k) => cx.pos.get(*k).map_or_else(|| "0.0f".to_string(), |p| format!("((float){p})")),
        ScoreExpr::Float(v) => float_lit(*v),
        ScoreExpr::Int(v) => float_lit(*v as f64),
        ScoreExpr::Dim(d) => format!("((float){})", cdim(d)),
        ScoreExpr::Load { input, index } => match cx.extras.get(*input) {
            None => "ATTNC_NAN".to_string(),
            Some(x) => {
                let idx: Vec<String> =
                    index.iter().zip(&x.shape).map(|(ie, size)| format!("attnc_cidx({}, {})", f(ie), cdim(size))).collect();
                let off = offset(&idx, &x.view.strides, &x.view.offset);
                to_float(&load(x.view.buf, x.dtype, &off), x.dtype)
            }
        },
        ScoreExpr::Unary(u, a) => {
            let a = f(a);
            match u {
                UnaryOp::Neg => format!("(-{a})"),
                UnaryOp::Not => truth(format!("{a} == 0.0f")),
                UnaryOp::Exp => format!("expf({a})"),
                UnaryOp::Log => format!("logf({a})"),
                UnaryOp::Sqrt => format!("sqrtf({a})"),
                UnaryOp::Rsqrt => format!("attnc_rsqrt({a})"),
                UnaryOp::Tanh => format!("tanhf({a})"),
                UnaryOp::Sigmoid => format!("attnc_sigmoid({a})"),
                UnaryOp::Relu => format!("attnc_relu({a})"),
                UnaryOp::Gelu => format!("attnc_gelu({a})"),
                UnaryOp::Silu => format!("attnc_silu({a})"),
                UnaryOp::Elu => format!("attnc_elu({a})"),
                UnaryOp::Abs => format!("fabsf({a})"),
                UnaryOp::Floor => format!("floorf({a})"),
            }
        }
        ScoreExpr::Binary(b, x, y) => {
            let (x, y) = (f(x), f(y));
            match b {
                BinaryOp::Add => format!("({x} + {y})"),
                BinaryOp::Sub => format!("({x} - {y})"),
                BinaryOp::Mul => format!("({x} * {y})"),
                BinaryOp::Div => format!("({x} / {y})"),
                BinaryOp::Rem => format!("attnc_srem({x}, {y})"),
                BinaryOp::Pow => format!("powf({x}, {y})"),
                BinaryOp::Min => format!("attnc_fmin({x}, {y})"),
                BinaryOp::Max => format!("attnc_fmax({x}, {y})"),
                BinaryOp::Lt => truth(format!("{x} < {y}")),
                BinaryOp::Le => truth(format!("{x} <= {y}")),
                BinaryOp::Gt => truth(format!("{x} > {y}")),
                BinaryOp::Ge => truth(format!("{x} >= {y}")),
                BinaryOp::Eq => truth(format!("{x} == {y}")),
                BinaryOp::Ne => truth(format!("{x} != {y}")),
                BinaryOp::And => truth(format!("{x} != 0.0f && {y} != 0.0f")),
                BinaryOp::Or => truth(format!("{x} != 0.0f || {y} != 0.0f")),
            }
        }
        ScoreExpr::Select(c, a, b) => format!("(({}) != 0.0f ? {} : {})", f(c), f(a), f(b)),
    }
}

/// A mask predicate as a C `bool` expression.
pub(super) fn mask_c(e: &ScoreExpr, cx: &ScoreCtx) -> String {
    // Comparisons and logic at the top level become C conditions directly (no 0/1 detour).
    let f = |x: &ScoreExpr| score_c(x, cx);
    match e {
        ScoreExpr::Binary(BinaryOp::And, x, y) => format!("({} && {})", mask_c(x, cx), mask_c(y, cx)),
        ScoreExpr::Binary(BinaryOp::Or, x, y) => format!("({} || {})", mask_c(x, cx), mask_c(y, cx)),
        ScoreExpr::Unary(UnaryOp::Not, x) => format!("(!{})", mask_c(x, cx)),
        ScoreExpr::Binary(b, x, y) if b.is_comparison() => format!("({} {} {})", f(x), b.symbol().unwrap_or_default(), f(y)),
        other => format!("({} != 0.0f)", f(other)),
    }
}
