//! Small pieces of C text: integers of the schedule's table, literals, storage types, loads,
//! stores, and offsets of strided views.
//!
//! Values compute in the C type of their class ([`attn_compiler::ir::semantics::Class`]): `float` for
//! every float dtype (f16/bf16 results are rounded back to their storage precision when
//! stored), `int` for i32 (with wrapping arithmetic helpers), `bool` for truth values. Offsets
//! and sizes are `i64`.

use super::CudaEmitError;
use attn_compiler::ir::semantics::Class;
use attn_compiler::ir::{DType, Dim};
use attn_compiler::schedule::{IntValue, Schedule, Tuning, View};

/// Integers of a schedule as C expressions over the kernel parameters `t0, t1, ...` (the
/// integer table).
pub(super) struct Ints<'s> {
    pub schedule: &'s Schedule,
}

impl Ints<'_> {
    /// A dim as an `i64` expression: a literal, its table entry, or a polynomial of its
    /// symbols' entries.
    pub fn dim(&self, d: &Dim) -> Result<String, CudaEmitError> {
        if let Some(c) = d.as_const() {
            return Ok(int_lit(c));
        }
        if let Some(slot) = self.schedule.slot(&IntValue::Dim(d.clone())) {
            return Ok(format!("t{slot}"));
        }
        let mut terms = Vec::new();
        for (mono, coef) in d.terms() {
            let mut factors = Vec::new();
            for name in mono {
                let slot = self.schedule.slot(&IntValue::Dim(Dim::sym(name))).ok_or_else(|| self.missing(format!("dim `{name}`")))?;
                factors.push(format!("t{slot}"));
            }
            if mono.is_empty() || coef != 1 {
                factors.insert(0, int_lit(coef));
            }
            terms.push(factors.join(" * "));
        }
        Ok(format!("({})", terms.join(" + ")))
    }

    /// A tuning value of a step.
    pub fn tuning(&self, step: usize, param: Tuning) -> Result<String, CudaEmitError> {
        let slot = self.schedule.tuning(step, param).ok_or_else(|| self.missing(format!("{param:?} of step {step}")))?;
        Ok(format!("t{slot}"))
    }

    fn missing(&self, what: String) -> CudaEmitError {
        self.fail(format!("the schedule has no integer for {what}"))
    }

    /// A render error in this schedule (the step and span are added by the caller).
    pub fn fail(&self, reason: String) -> CudaEmitError {
        CudaEmitError::Render { graph: self.schedule.name.clone(), step: None, span: None, reason }
    }

    /// `Σ idx[a] · strides[a]` (+ the view's offset) as an `i64` expression over the view's
    /// axes, skipping axes of stride 0 or size 1.
    pub fn offset(&self, view: &View, idx: &[String]) -> Result<String, CudaEmitError> {
        let mut terms = Vec::new();
        if view.offset.as_const() != Some(0) {
            terms.push(self.dim(&view.offset)?);
        }
        for ((i, s), n) in idx.iter().zip(&view.strides).zip(&view.shape) {
            if s.as_const() == Some(0) || n.as_const() == Some(1) || i == "0LL" {
                continue;
            }
            terms.push(if s.as_const() == Some(1) { i.clone() } else { format!("{i} * {}", self.dim(s)?) });
        }
        Ok(if terms.is_empty() { "0LL".to_string() } else { terms.join(" + ") })
    }
}

/// An `i64` literal.
pub(super) fn int_lit(v: i64) -> String {
    signed_lit(v == i64::MIN, v < 0, &format!("{v}LL"), "(-9223372036854775807LL - 1LL)")
}

/// An integer literal: parenthesised when negative, and the type's minimum (which C cannot
/// write as one literal) spelled as `min`.
fn signed_lit(is_min: bool, negative: bool, text: &str, min: &str) -> String {
    if is_min {
        min.to_string()
    } else if negative {
        format!("({text})")
    } else {
        text.to_string()
    }
}

/// A `float` literal (the value rounded to f32; infinities and NaN through the prelude's macros).
pub(super) fn float_lit(v: f64) -> String {
    let x = v as f32;
    if x.is_nan() {
        "ATTNC_NAN".to_string()
    } else if x.is_infinite() {
        if x > 0.0 { "ATTNC_INF".to_string() } else { "(-ATTNC_INF)".to_string() }
    } else if x < 0.0 || (x == 0.0 && x.is_sign_negative()) {
        format!("({:e}f)", x)
    } else {
        format!("{:e}f", x)
    }
}

/// An `int` literal (an i32 value).
pub(super) fn i32_lit(v: i32) -> String {
    signed_lit(v == i32::MIN, v < 0, &v.to_string(), "(-2147483647 - 1)")
}

/// A `double` literal (finite values; used for epsilons).
pub(super) fn double_lit(v: f64) -> String {
    if v.is_nan() {
        "ATTNC_DNAN".to_string()
    } else if v.is_infinite() {
        if v > 0.0 { "ATTNC_DINF".to_string() } else { "(-ATTNC_DINF)".to_string() }
    } else if v < 0.0 {
        format!("({:e})", v)
    } else {
        format!("{:e}", v)
    }
}

/// The C type values of a class compute in.
pub(super) fn ctype(class: Class) -> &'static str {
    match class {
        Class::Float => "float",
        Class::Int => "int",
        Class::Bool => "bool",
    }
}

/// The C type a value of `dtype` is stored as in device memory.
pub(super) fn storage(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float",
        DType::F16 | DType::BF16 => "u16",
        DType::I32 => "int",
        DType::Bool => "u8",
    }
}

/// Bytes per stored element.
pub fn storage_bytes(dtype: DType) -> usize {
    match dtype {
        DType::F32 | DType::I32 => 4,
        DType::F16 | DType::BF16 => 2,
        DType::Bool => 1,
    }
}

/// A typed pointer expression for kernel parameter `b{buf}`.
pub(super) fn ptr(buf: usize, dtype: DType, writable: bool) -> String {
    let konst = if writable { "" } else { "const " };
    format!("(({konst}{}*)b{buf})", storage(dtype))
}

/// Loads element `offset` through a typed pointer expression as a value of the dtype's class.
pub(super) fn load_ptr(p: &str, dtype: DType, offset: &str) -> String {
    match dtype {
        DType::F32 => format!("{p}[{offset}]"),
        DType::F16 => format!("attnc_h2f({p}[{offset}])"),
        DType::BF16 => format!("attnc_b2f({p}[{offset}])"),
        DType::I32 => format!("{p}[{offset}]"),
        DType::Bool => format!("({p}[{offset}] != 0)"),
    }
}

/// Loads element `offset` of buffer `buf` (stored as `dtype`) as a value of its class.
pub(super) fn load(buf: usize, dtype: DType, offset: &str) -> String {
    load_ptr(&ptr(buf, dtype, false), dtype, offset)
}

/// Stores a value of `dtype`'s class (already rounded to `dtype`) at element `offset` of `buf`.
pub(super) fn store(buf: usize, dtype: DType, offset: &str, value: &str) -> String {
    let p = ptr(buf, dtype, true);
    match dtype {
        DType::F32 | DType::I32 => format!("{p}[{offset}] = {value};"),
        DType::F16 => format!("{p}[{offset}] = attnc_f2h({value});"),
        DType::BF16 => format!("{p}[{offset}] = attnc_f2b({value});"),
        DType::Bool => format!("{p}[{offset}] = ({value}) ? 1 : 0;"),
    }
}

/// Rounds a `float` expression to the precision of a float dtype (identity for f32).
pub(super) fn round_to(dtype: DType, x: &str) -> String {
    match dtype {
        DType::F16 => format!("attnc_rh({x})"),
        DType::BF16 => format!("attnc_rb({x})"),
        _ => x.to_string(),
    }
}

/// Splits linear index `lin` into one index per axis of `shape` (row-major), pushing the
/// statements into `body` and returning the index names `{prefix}{axis}` (`0LL` for axes of
/// size 1).
pub(super) fn delinearize(
    ints: &Ints,
    body: &mut Vec<String>,
    lin: &str,
    shape: &[Dim],
    prefix: &str,
) -> Result<Vec<String>, CudaEmitError> {
    let rank = shape.len();
    if rank == 0 {
        return Ok(Vec::new());
    }
    let rest = format!("{prefix}r_");
    body.push(format!("i64 {rest} = {lin};"));
    let mut names = vec![String::new(); rank];
    for a in (1..rank).rev() {
        let n = format!("{prefix}{a}");
        if shape[a].as_const() == Some(1) {
            names[a] = "0LL".to_string();
            continue;
        }
        let size = ints.dim(&shape[a])?;
        body.push(format!("const i64 {n} = {rest} % {size}; {rest} /= {size};"));
        names[a] = n;
    }
    let n0 = format!("{prefix}0");
    body.push(format!("const i64 {n0} = {rest};"));
    names[0] = n0;
    Ok(names)
}

/// Indents every line by `n` spaces.
pub(super) fn indent(lines: &[String], n: usize) -> Vec<String> {
    let pad = " ".repeat(n);
    lines.iter().map(|l| if l.is_empty() { l.clone() } else { format!("{pad}{l}") }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals() {
        assert_eq!(float_lit(0.125), "1.25e-1f");
        assert_eq!(float_lit(-2.0), "(-2e0f)");
        assert_eq!(float_lit(f64::NEG_INFINITY), "(-ATTNC_INF)");
        assert_eq!(int_lit(-3), "(-3LL)");
        assert_eq!(i32_lit(i32::MIN), "(-2147483647 - 1)");
        assert_eq!(double_lit(1e-5), "1e-5");
    }
}
