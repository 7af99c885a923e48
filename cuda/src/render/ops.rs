//! Scalar ops as C, following [`attn_compiler::ir::semantics`]: one place for the CUDA spelling of
//! every op, used by element-wise kernels and by flash score modifications and masks alike.
//! Each result is bound to a `const` local, so a value is computed once however often it is
//! read.

use super::cexpr::{ctype, float_lit, i32_lit, round_to};
use attn_compiler::ir::semantics::{self, Class};
use attn_compiler::ir::{BinaryOp, DType, UnaryOp};

/// A C expression and the class of its value.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct CVal {
    /// The expression (usually a local's name).
    pub text: String,
    /// Its class.
    pub class: Class,
}

impl CVal {
    /// A float expression.
    pub fn float(text: impl Into<String>) -> CVal {
        CVal { text: text.into(), class: Class::Float }
    }

    /// An int expression.
    pub fn int(text: impl Into<String>) -> CVal {
        CVal { text: text.into(), class: Class::Int }
    }
}

/// Statements of one scope, with fresh local names `{prefix}{n}_`.
pub(super) struct Lines {
    /// The statements so far.
    pub lines: Vec<String>,
    prefix: String,
    next: usize,
}

impl Lines {
    /// An empty scope whose locals are named `{prefix}{n}_`.
    pub fn new(prefix: &str) -> Lines {
        Lines { lines: Vec::new(), prefix: prefix.to_string(), next: 0 }
    }

    /// Binds `text` (of `class`) to a fresh `const` local.
    pub fn bind(&mut self, text: String, class: Class) -> CVal {
        self.next += 1;
        let name = format!("{}{}_", self.prefix, self.next);
        self.lines.push(format!("const {} {name} = {text};", ctype(class)));
        CVal { text: name, class }
    }

    /// A constant of `class` (no local).
    pub fn constant(value: f64, class: Class) -> CVal {
        let text = match class {
            Class::Float => float_lit(value),
            Class::Int => i32_lit(semantics::to_i32(value)),
            Class::Bool => (if value != 0.0 { "true" } else { "false" }).to_string(),
        };
        CVal { text, class }
    }
}

/// `x` converted to `class` (floats to int truncate and saturate, NaN is 0; anything to bool
/// is `!= 0`).
pub(super) fn convert(x: &CVal, class: Class) -> String {
    let t = &x.text;
    match (x.class, class) {
        (a, b) if a == b => t.clone(),
        (Class::Int, Class::Float) => format!("((float){t})"),
        (Class::Bool, Class::Float) => format!("({t} ? 1.0f : 0.0f)"),
        (Class::Float, Class::Int) => format!("attnc_f2i({t})"),
        (Class::Bool, Class::Int) => format!("((int){t})"),
        (Class::Float, Class::Bool) => format!("({t} != 0.0f)"),
        (Class::Int, Class::Bool) => format!("({t} != 0)"),
        _ => t.clone(),
    }
}

/// `x` as stored in `dtype`: converted to its class and rounded to its precision.
pub(super) fn store_value(x: &CVal, dtype: DType) -> String {
    let c = convert(x, Class::of(dtype));
    if Class::of(dtype) == Class::Float { round_to(dtype, &c) } else { c }
}

/// A unary op.
pub(super) fn unary(l: &mut Lines, op: UnaryOp, x: &CVal) -> CVal {
    let class = semantics::unary_class(op, x.class);
    let t = convert(x, class);
    let text = match (class, op) {
        (Class::Bool, _) => format!("(!{})", convert(x, Class::Bool)),
        (Class::Int, UnaryOp::Neg) => format!("attnc_ineg({t})"),
        (Class::Int, UnaryOp::Abs) => format!("attnc_iabs({t})"),
        (Class::Int, UnaryOp::Relu) => format!("({t} > 0 ? {t} : 0)"),
        (Class::Int, _) => t,
        (_, UnaryOp::Neg) => format!("(-{t})"),
        (_, UnaryOp::Abs) => format!("fabsf({t})"),
        (_, UnaryOp::Floor) => format!("floorf({t})"),
        (_, UnaryOp::Relu) => format!("attnc_relu({t})"),
        (_, UnaryOp::Sqrt) => format!("sqrtf({t})"),
        (_, UnaryOp::Rsqrt) => format!("(1.0f / sqrtf({t}))"),
        (_, UnaryOp::Exp) => format!("expf({t})"),
        (_, UnaryOp::Log) => format!("logf({t})"),
        // In double and rounded once, as `ir::semantics` defines them: sinf/cosf differ by
        // an ulp or two, and by far more under fast-math for large arguments.
        (_, UnaryOp::Sin) => format!("((float)sin((double){t}))"),
        (_, UnaryOp::Cos) => format!("((float)cos((double){t}))"),
        (_, UnaryOp::Tanh) => format!("tanhf({t})"),
        (_, UnaryOp::Sigmoid) => format!("attnc_sigmoid({t})"),
        (_, UnaryOp::Silu) => format!("attnc_silu({t})"),
        (_, UnaryOp::Gelu) => format!("attnc_gelu({t})"),
        (_, UnaryOp::Elu) => format!("attnc_elu({t})"),
        (_, UnaryOp::Not) => format!("({t} == 0.0f)"),
    };
    l.bind(text, class)
}

/// A binary op: one arm per op, so a new op cannot fall through to another's spelling.
pub(super) fn binary(l: &mut Lines, op: BinaryOp, x: &CVal, y: &CVal) -> CVal {
    let class = semantics::binary_class(op, x.class, y.class);
    // Comparisons compare in the operands' common class; everything else computes in its own.
    let operands = match class {
        Class::Bool if op.is_logical() => Class::Bool,
        Class::Bool if x.class == Class::Float || y.class == Class::Float => Class::Float,
        Class::Bool => Class::Int,
        other => other,
    };
    let (a, b) = (convert(x, operands), convert(y, operands));
    let int = operands == Class::Int;
    let text = match op {
        BinaryOp::Or => format!("({a} || {b})"),
        BinaryOp::And => format!("({a} && {b})"),
        BinaryOp::Eq => format!("({a} == {b})"),
        BinaryOp::Ne => format!("({a} != {b})"),
        BinaryOp::Lt => format!("({a} < {b})"),
        BinaryOp::Le => format!("({a} <= {b})"),
        BinaryOp::Gt => format!("({a} > {b})"),
        BinaryOp::Ge => format!("({a} >= {b})"),
        BinaryOp::Add if int => format!("attnc_iadd({a}, {b})"),
        BinaryOp::Sub if int => format!("attnc_isub({a}, {b})"),
        BinaryOp::Mul if int => format!("attnc_imul({a}, {b})"),
        BinaryOp::Rem if int => format!("attnc_irem({a}, {b})"),
        BinaryOp::Min if int => format!("({a} < {b} ? {a} : {b})"),
        BinaryOp::Max if int => format!("({a} > {b} ? {a} : {b})"),
        BinaryOp::Add => format!("({a} + {b})"),
        BinaryOp::Sub => format!("({a} - {b})"),
        BinaryOp::Mul => format!("({a} * {b})"),
        BinaryOp::Div => format!("({a} / {b})"),
        BinaryOp::Rem => format!("attnc_frem({a}, {b})"),
        BinaryOp::Pow => format!("powf({a}, {b})"),
        // In double and rounded once, as `ir::semantics` defines it.
        BinaryOp::Atan2 => format!("((float)atan2((double){a}, (double){b}))"),
        BinaryOp::Min => format!("attnc_fmin({a}, {b})"),
        BinaryOp::Max => format!("attnc_fmax({a}, {b})"),
    };
    l.bind(text, class)
}

/// `where(c, a, b)` in the common class of the branches.
pub(super) fn select(l: &mut Lines, c: &CVal, a: &CVal, b: &CVal) -> CVal {
    let class = semantics::select_class(a.class, b.class);
    let text = format!("({} ? {} : {})", convert(c, Class::Bool), convert(a, class), convert(b, class));
    l.bind(text, class)
}
