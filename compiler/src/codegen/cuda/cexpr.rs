//! Small pieces of C text: dims as 64-bit integer expressions, literals, storage and compute
//! types, loads, stores and conversions between the compute types.
//!
//! Compute types: every float dtype computes in `float` (f16/bf16 results are rounded back to
//! their storage precision after each node, as the interpreter does), `i32` computes in `i64`
//! (saturated to the i32 range after each node, as the interpreter's rounding does), `bool` is
//! `bool`.

use crate::ir::{DType, Dim};

/// The C name of a dim symbol (a kernel parameter).
pub(super) fn dim_var(name: &str) -> String {
    format!("d_{name}")
}

/// A dim polynomial as an `i64` C expression over the dim parameters.
pub(super) fn cdim(d: &Dim) -> String {
    if let Some(c) = d.as_const() {
        return int_lit(c);
    }
    let mut terms = Vec::new();
    for (mono, coef) in d.terms() {
        let mut factors: Vec<String> = mono.iter().map(|n| dim_var(n)).collect();
        if mono.is_empty() || coef != 1 {
            factors.insert(0, int_lit(coef));
        }
        terms.push(factors.join(" * "));
    }
    format!("({})", terms.join(" + "))
}

/// An `i64` literal.
pub(super) fn int_lit(v: i64) -> String {
    if v == i64::MIN {
        "(-9223372036854775807LL - 1LL)".to_string()
    } else if v < 0 {
        format!("({v}LL)")
    } else {
        format!("{v}LL")
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

/// A `double` literal (finite values only; used for epsilons).
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

/// The C type a value of `dtype` is computed in.
pub(super) fn ctype(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => "float",
        DType::I32 => "i64",
        DType::Bool => "bool",
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

/// Loads element `offset` of buffer `buf` (stored as `dtype`) into its compute type.
pub(super) fn load(buf: usize, dtype: DType, offset: &str) -> String {
    load_ptr(&ptr(buf, dtype, false), dtype, offset)
}

/// Loads element `offset` through a typed pointer expression into its compute type.
pub(super) fn load_ptr(p: &str, dtype: DType, offset: &str) -> String {
    match dtype {
        DType::F32 => format!("{p}[{offset}]"),
        DType::F16 => format!("attnc_h2f({p}[{offset}])"),
        DType::BF16 => format!("attnc_b2f({p}[{offset}])"),
        DType::I32 => format!("((i64){p}[{offset}])"),
        DType::Bool => format!("({p}[{offset}] != 0)"),
    }
}

/// Stores a compute-type value (already rounded to `dtype`) at element `offset` of `buf`.
pub(super) fn store(buf: usize, dtype: DType, offset: &str, value: &str) -> String {
    store_ptr(&ptr(buf, dtype, true), dtype, offset, value)
}

/// Stores through a typed pointer expression.
pub(super) fn store_ptr(p: &str, dtype: DType, offset: &str, value: &str) -> String {
    match dtype {
        DType::F32 => format!("{p}[{offset}] = {value};"),
        DType::F16 => format!("{p}[{offset}] = attnc_f2h({value});"),
        DType::BF16 => format!("{p}[{offset}] = attnc_f2b({value});"),
        DType::I32 => format!("{p}[{offset}] = (int)({value});"),
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

/// Converts a compute-type expression of dtype `from` to the compute type of `to`, rounding as
/// the interpreter's store would (float→int truncates and saturates, NaN→0; →bool is `!= 0`).
pub(super) fn convert(x: &str, from: DType, to: DType) -> String {
    use DType::*;
    match (from, to) {
        (a, b) if a == b => x.to_string(),
        (F32 | F16 | BF16, F32 | F16 | BF16) => round_to(to, x),
        (I32, F32 | F16 | BF16) => round_to(to, &format!("((float)({x}))")),
        (Bool, F32 | F16 | BF16) => format!("(({x}) ? 1.0f : 0.0f)"),
        (F32 | F16 | BF16, I32) => format!("attnc_f2i({x})"),
        (Bool, I32) => format!("((i64)({x}))"),
        (F32 | F16 | BF16, Bool) => format!("(({x}) != 0.0f)"),
        (I32, Bool) => format!("(({x}) != 0LL)"),
        _ => x.to_string(),
    }
}

/// Converts a compute-type expression to `float` (for arithmetic in float).
pub(super) fn to_float(x: &str, from: DType) -> String {
    match from {
        DType::F32 | DType::F16 | DType::BF16 => x.to_string(),
        DType::I32 => format!("((float)({x}))"),
        DType::Bool => format!("(({x}) ? 1.0f : 0.0f)"),
    }
}

/// Converts a compute-type expression to `double` (reductions accumulate in double).
pub(super) fn to_double(x: &str, from: DType) -> String {
    match from {
        DType::Bool => format!("(({x}) ? 1.0 : 0.0)"),
        _ => format!("((double)({x}))"),
    }
}

/// Converts a `double` to the compute type of `to`, rounding to its storage.
pub(super) fn from_double(x: &str, to: DType) -> String {
    match to {
        DType::F32 => format!("((float)({x}))"),
        DType::F16 => format!("attnc_rh((float)({x}))"),
        DType::BF16 => format!("attnc_rb((float)({x}))"),
        DType::I32 => format!("attnc_d2i({x})"),
        DType::Bool => format!("(({x}) != 0.0)"),
    }
}

/// Converts a compute-type expression to `i64` (bool as 0/1).
pub(super) fn to_int(x: &str, from: DType) -> String {
    match from {
        DType::I32 => x.to_string(),
        DType::Bool => format!("((i64)({x}))"),
        _ => format!("attnc_f2i({x})"),
    }
}

/// Row-major strides of a symbolic shape.
pub(super) fn row_major(shape: &[Dim]) -> Vec<Dim> {
    let mut strides = vec![Dim::constant(1); shape.len()];
    for k in (0..shape.len().saturating_sub(1)).rev() {
        strides[k] = strides[k + 1].mul(&shape[k + 1]);
    }
    strides
}

/// `Σ idx[a] * strides[a]` (+ `base`) as an `i64` expression, dropping zero terms.
pub(super) fn offset(idx: &[String], strides: &[Dim], base: &Dim) -> String {
    let mut terms = Vec::new();
    if base.as_const() != Some(0) {
        terms.push(cdim(base));
    }
    for (i, s) in idx.iter().zip(strides) {
        if s.as_const() == Some(0) || i == "0" || i == "0LL" {
            continue;
        }
        if s.as_const() == Some(1) {
            terms.push(i.clone());
        } else {
            terms.push(format!("{i} * {}", cdim(s)));
        }
    }
    if terms.is_empty() { "0LL".to_string() } else { terms.join(" + ") }
}

/// True for a dim that is the constant 1 (a broadcast axis).
pub(super) fn is_one(d: &Dim) -> bool {
    d.as_const() == Some(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dims_and_literals() {
        assert_eq!(cdim(&Dim::constant(8)), "8LL");
        assert_eq!(cdim(&Dim::parse("H*D").unwrap()), "(d_D * d_H)");
        assert_eq!(cdim(&Dim::parse("2*S+1").unwrap()), "(1LL + 2LL * d_S)");
        assert_eq!(float_lit(0.125), "1.25e-1f");
        assert_eq!(float_lit(-2.0), "(-2e0f)");
        assert_eq!(float_lit(f64::NEG_INFINITY), "(-ATTNC_INF)");
        assert_eq!(int_lit(-3), "(-3LL)");
        assert_eq!(double_lit(1e-5), "1e-5");
        let shape = [Dim::sym("B"), Dim::sym("S"), Dim::constant(4)];
        let strides = row_major(&shape);
        assert_eq!(strides[0], Dim::parse("4*S").unwrap());
        let idx = ["i0".to_string(), "i1".to_string(), "i2".to_string()];
        assert_eq!(offset(&idx, &strides, &Dim::constant(0)), "i0 * (4LL * d_S) + i1 * 4LL + i2");
    }
}
