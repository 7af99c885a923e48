//! Element-wise ops and the ops that make values from nothing: constants, dim values, iota,
//! unary and binary maths, comparisons and logic, `where`, casts.
//!
//! Every scalar op is [`crate::ir::semantics`]' definition: each element is loaded as a value
//! of its dtype's class, the op computed there, and the result stored as the node's dtype.

use super::value::{Val, broadcast, broadcast_strides, element_count, filled, room, row_major_strides, walk};
use crate::exec::ExecError;
use crate::ir::semantics::{self, Scalar};
use crate::ir::{BinaryOp, DType, UnaryOp};

/// A tensor of the given shape with every element `value` (constants and dim values).
pub(super) fn fill(dtype: DType, shape: Vec<usize>, value: f64, node: &str) -> Result<Val, ExecError> {
    let n = element_count(&shape, node)?;
    Ok(Val::new(dtype, shape, filled(n, value, node)?))
}

/// Each element's index along `axis`.
pub(super) fn iota(dtype: DType, shape: Vec<usize>, axis: usize, node: &str) -> Result<Val, ExecError> {
    if axis >= shape.len() {
        return Err(ExecError::BadNode {
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

/// Applies `op` to every element of `x` by [`semantics::unary`], storing results as `dtype`.
pub(super) fn unary(op: UnaryOp, x: &Val, dtype: DType) -> Val {
    let data = x.data.iter().map(|v| semantics::unary(op, Scalar::load(x.dtype, *v)).store(dtype)).collect();
    Val::new(dtype, x.shape.clone(), data)
}

/// Applies a binary op to two broadcast operands by [`semantics::binary`].
pub(super) fn binary(op: BinaryOp, a: &Val, b: &Val, dtype: DType, node: &str) -> Result<Val, ExecError> {
    let (ta, tb) = (a.dtype, b.dtype);
    broadcast_map([a, b], dtype, node, |[x, y]| semantics::binary(op, Scalar::load(ta, x), Scalar::load(tb, y)).store(dtype))
}

/// `where(cond, a, b)` over three broadcast operands by [`semantics::select`].
pub(super) fn select(cond: &Val, a: &Val, b: &Val, dtype: DType, node: &str) -> Result<Val, ExecError> {
    let (tc, ta, tb) = (cond.dtype, a.dtype, b.dtype);
    broadcast_map([cond, a, b], dtype, node, |[c, x, y]| {
        semantics::select(Scalar::load(tc, c), Scalar::load(ta, x), Scalar::load(tb, y)).store(dtype)
    })
}

/// `dropout(x, seed)` by [`semantics::dropout_keeps`]: element `(batch, i, j)` of `x` (its last
/// two indices and the row-major index over the rest) kept and scaled, or 0.
pub(super) fn dropout(x: &Val, seed: &Val, rate: f64, dtype: DType, node: &str) -> Result<Val, ExecError> {
    let seed = match seed.data.as_slice() {
        [s] => Scalar::load(seed.dtype, *s).as_i(),
        _ => return Err(ExecError::BadNode { node: node.to_string(), reason: "the dropout seed is not a scalar".into() }),
    };
    let r = x.shape.len();
    let cols = if r >= 1 { x.shape[r - 1] } else { 1 };
    let rows = if r >= 2 { x.shape[r - 2] } else { 1 };
    let (threshold, scale) = (semantics::dropout_threshold(rate), semantics::dropout_scale(rate));
    let data = x
        .data
        .iter()
        .enumerate()
        .map(|(n, v)| {
            let (j, i, batch) = (n % cols.max(1), (n / cols.max(1)) % rows.max(1), n / (cols * rows).max(1));
            let bits = semantics::dropout_bits(seed, batch as u32, i as u32, j as u32);
            if bits >= threshold { v * scale } else { 0.0 }
        })
        .collect();
    Ok(Val::new(dtype, x.shape.clone(), data))
}

/// Converts to `dtype` (float to i32 truncates and saturates, to bool is `!= 0`).
pub(super) fn cast(x: &Val, dtype: DType) -> Val {
    let data = x.data.iter().map(|v| Scalar::load(x.dtype, *v).store(dtype)).collect();
    Val::new(dtype, x.shape.clone(), data)
}

/// Broadcasts `N` operands numpy-style and applies `f` element by element.
pub(super) fn broadcast_map<const N: usize>(
    args: [&Val; N],
    dtype: DType,
    node: &str,
    f: impl Fn([f64; N]) -> f64,
) -> Result<Val, ExecError> {
    let mut shape = Vec::new();
    for a in args {
        shape = broadcast(&shape, &a.shape).ok_or_else(|| {
            let shapes: Vec<String> = args.iter().map(|a| format!("{:?}", a.shape)).collect();
            ExecError::BadNode { node: node.to_string(), reason: format!("operand shapes {} do not broadcast", shapes.join(", ")) }
        })?;
    }
    let n = element_count(&shape, node)?;
    let strides: [Vec<usize>; N] = args.map(|a| broadcast_strides(&a.shape, &row_major_strides(&a.shape), &shape));
    let stride_refs: [&[usize]; N] = std::array::from_fn(|k| strides[k].as_slice());
    let mut out = room(n, node)?;
    walk(&shape, stride_refs, |offsets| out.push(f(std::array::from_fn(|k| args[k].data[offsets[k]]))));
    Ok(Val::new(dtype, shape, out))
}
