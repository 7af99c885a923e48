//! Element-wise ops and the ops that make values from nothing: constants, dim values, iota,
//! unary and binary maths, comparisons and logic, `where`, casts.
//!
//! Operands enter the f64 arithmetic exactly as stored; only the result is rounded (to the
//! node's dtype, by [`Val::new`]). Bools are 0/1; any non-zero operand counts as true.

use super::InterpError;
use super::value::{Val, broadcast, broadcast_strides, element_count, nan_max, nan_min, row_major_strides, walk};
use crate::ir::{BinaryOp, DType, UnaryOp};

/// A tensor of the given shape with every element `value` (constants and dim values).
pub(super) fn fill(dtype: DType, shape: Vec<usize>, value: f64, node: &str) -> Result<Val, InterpError> {
    let n = element_count(&shape, node)?;
    Ok(Val::new(dtype, shape, vec![value; n]))
}

/// Each element's index along `axis`.
pub(super) fn iota(dtype: DType, shape: Vec<usize>, axis: usize, node: &str) -> Result<Val, InterpError> {
    if axis >= shape.len() {
        return Err(InterpError::BadNode {
            node: node.to_string(),
            reason: format!("iota axis {axis} is out of range for rank {}", shape.len()),
        });
    }
    let n = element_count(&shape, node)?;
    let inner: usize = shape[axis + 1..].iter().product();
    let size = shape[axis];
    let data = (0..n).map(|i| ((i / inner) % size) as f64).collect();
    Ok(Val::new(dtype, shape, data))
}

/// The scalar function of a unary op.
fn unary_fn(op: UnaryOp) -> fn(f64) -> f64 {
    match op {
        UnaryOp::Neg => |x| -x,
        UnaryOp::Not => |x| truth(x == 0.0),
        UnaryOp::Exp => f64::exp,
        UnaryOp::Log => f64::ln,
        UnaryOp::Sqrt => f64::sqrt,
        UnaryOp::Rsqrt => |x| 1.0 / x.sqrt(),
        UnaryOp::Tanh => f64::tanh,
        UnaryOp::Sigmoid => sigmoid,
        // NaN stays NaN (as in PyTorch) instead of becoming 0.
        UnaryOp::Relu => |x| if x.is_nan() { x } else { x.max(0.0) },
        UnaryOp::Gelu => |x| 0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2)),
        UnaryOp::Silu => |x| x * sigmoid(x),
        UnaryOp::Elu => |x| if x > 0.0 { x } else { x.exp_m1() },
        UnaryOp::Abs => f64::abs,
        UnaryOp::Floor => f64::floor,
    }
}

/// A bool as 0/1.
fn truth(b: bool) -> f64 {
    f64::from(u8::from(b))
}

/// The logistic function `1 / (1 + e^-x)`.
fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `a % b` with the sign of `b`, as Python. A zero divisor gives NaN (0 once stored as i32).
fn python_rem(a: f64, b: f64) -> f64 {
    let r = a % b;
    if r != 0.0 && (r < 0.0) != (b < 0.0) { r + b } else { r }
}

/// The scalar function of a binary op.
fn binary_fn(op: BinaryOp) -> fn(f64, f64) -> f64 {
    match op {
        BinaryOp::Add => |a, b| a + b,
        BinaryOp::Sub => |a, b| a - b,
        BinaryOp::Mul => |a, b| a * b,
        BinaryOp::Div => |a, b| a / b,
        BinaryOp::Rem => python_rem,
        BinaryOp::Pow => f64::powf,
        BinaryOp::Min => nan_min,
        BinaryOp::Max => nan_max,
        BinaryOp::Lt => |a, b| truth(a < b),
        BinaryOp::Le => |a, b| truth(a <= b),
        BinaryOp::Gt => |a, b| truth(a > b),
        BinaryOp::Ge => |a, b| truth(a >= b),
        BinaryOp::Eq => |a, b| truth(a == b),
        BinaryOp::Ne => |a, b| truth(a != b),
        BinaryOp::And => |a, b| truth(a != 0.0 && b != 0.0),
        BinaryOp::Or => |a, b| truth(a != 0.0 || b != 0.0),
    }
}

/// Applies `f` to every element of `x`.
pub(super) fn unary(op: UnaryOp, x: &Val, dtype: DType) -> Val {
    let f = unary_fn(op);
    Val::new(dtype, x.shape.clone(), x.data.iter().map(|v| f(*v)).collect())
}

/// Applies a binary op to two broadcast operands.
pub(super) fn binary(op: BinaryOp, a: &Val, b: &Val, dtype: DType, node: &str) -> Result<Val, InterpError> {
    let f = binary_fn(op);
    broadcast_map([a, b], dtype, node, |[x, y]| f(x, y))
}

/// `where(cond, a, b)` over three broadcast operands.
pub(super) fn select(cond: &Val, a: &Val, b: &Val, dtype: DType, node: &str) -> Result<Val, InterpError> {
    broadcast_map([cond, a, b], dtype, node, |[c, x, y]| if c != 0.0 { x } else { y })
}

/// Converts to `dtype` (rounding does it all: float to i32 truncates, to bool is `!= 0`).
pub(super) fn cast(x: &Val, dtype: DType) -> Val {
    Val::new(dtype, x.shape.clone(), x.data.clone())
}

/// Broadcasts `N` operands numpy-style and applies `f` element by element.
fn broadcast_map<const N: usize>(args: [&Val; N], dtype: DType, node: &str, f: impl Fn([f64; N]) -> f64) -> Result<Val, InterpError> {
    let mut shape = Vec::new();
    for a in args {
        shape = broadcast(&shape, &a.shape).ok_or_else(|| {
            let shapes: Vec<String> = args.iter().map(|a| format!("{:?}", a.shape)).collect();
            InterpError::BadNode { node: node.to_string(), reason: format!("operand shapes {} do not broadcast", shapes.join(", ")) }
        })?;
    }
    let n = element_count(&shape, node)?;
    let strides: [Vec<usize>; N] = args.map(|a| broadcast_strides(&a.shape, &row_major_strides(&a.shape), &shape));
    let stride_refs: [&[usize]; N] = std::array::from_fn(|k| strides[k].as_slice());
    let mut out = Vec::with_capacity(n);
    walk(&shape, stride_refs, |offsets| out.push(f(std::array::from_fn(|k| args[k].data[offsets[k]]))));
    Ok(Val::new(dtype, shape, out))
}
