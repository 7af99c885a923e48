//! The interpreter's values (f64 elements, a concrete shape, a dtype) and the index arithmetic
//! every op shares: row-major strides, broadcasting, and a strided walk over a shape.

use crate::exec::ExecError;
pub(super) use crate::exec::element_count;
use crate::ir::DType;

/// A computed tensor. Elements are f64 holding values already rounded to `dtype` (bool as 0/1).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Val {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

impl Val {
    /// A value from unrounded f64 results: rounds each element to `dtype`, the one place where
    /// node results get their storage precision.
    pub fn new(dtype: DType, shape: Vec<usize>, mut data: Vec<f64>) -> Val {
        for x in &mut data {
            *x = dtype.round(*x);
        }
        Val { dtype, shape, data }
    }
}

/// An empty vector with room for `n` elements, allocated fallibly: memory the machine refuses
/// is an [`ExecError::OutOfMemory`] naming `what`, not an abort.
pub(super) fn room<T>(n: usize, what: &str) -> Result<Vec<T>, ExecError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| ExecError::OutOfMemory { what: what.to_string(), bytes: n.saturating_mul(size_of::<T>()) })?;
    Ok(v)
}

/// `n` copies of `value`, allocated fallibly (see [`room`]).
pub(super) fn filled<T: Clone>(n: usize, value: T, what: &str) -> Result<Vec<T>, ExecError> {
    let mut v = room(n, what)?;
    v.resize(n, value);
    Ok(v)
}

/// Row-major strides: the last axis has stride 1.
pub(super) fn row_major_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for k in (0..shape.len().saturating_sub(1)).rev() {
        strides[k] = strides[k + 1] * shape[k + 1];
    }
    strides
}

/// Numpy broadcast of two concrete shapes (aligned at the right; a 1 stretches), or `None`.
pub(super) fn broadcast(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    let get = |s: &[usize], axis: usize| (axis + s.len()).checked_sub(rank).map_or(1, |i| s[i]);
    (0..rank)
        .map(|axis| match (get(a, axis), get(b, axis)) {
            (x, y) if x == y || y == 1 => Some(x),
            (1, y) => Some(y),
            _ => None,
        })
        .collect()
}

/// Strides that read an operand of shape `src` (with element strides `src_strides`) as if it
/// were broadcast to `out`: axes the operand lacks or has as size 1 get stride 0. `src` must
/// broadcast to `out`.
pub(super) fn broadcast_strides(src: &[usize], src_strides: &[usize], out: &[usize]) -> Vec<usize> {
    let lead = out.len() - src.len();
    (0..out.len()).map(|axis| if axis < lead || src[axis - lead] == 1 { 0 } else { src_strides[axis - lead] }).collect()
}

/// Calls `f` once per element of `shape`, in row-major order, with the offset of that element
/// in each of `N` operands described by their strides (one stride per axis of `shape`).
pub(super) fn walk<const N: usize>(shape: &[usize], strides: [&[usize]; N], mut f: impl FnMut([usize; N])) {
    if shape.contains(&0) {
        return;
    }
    let total: usize = shape.iter().product();
    let mut index = vec![0usize; shape.len()];
    let mut offsets = [0usize; N];
    for _ in 0..total {
        f(offsets);
        // Odometer increment: bump the last axis; on wrap-around, rewind it and carry.
        for axis in (0..shape.len()).rev() {
            index[axis] += 1;
            for (off, s) in offsets.iter_mut().zip(&strides) {
                *off += s[axis];
            }
            if index[axis] < shape[axis] {
                break;
            }
            for (off, s) in offsets.iter_mut().zip(&strides) {
                *off -= s[axis] * shape[axis];
            }
            index[axis] = 0;
        }
    }
}

/// Splits `shape` around `axis` into (product before, size of, product after), the loop bounds
/// of ops that work along one axis: element `(o, i, j)` is at `(o * n + i) * inner + j`.
pub(super) fn split_at_axis(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    let outer = shape[..axis].iter().product();
    let inner = shape[axis + 1..].iter().product();
    (outer, shape[axis], inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_broadcast_and_walk() {
        assert_eq!(row_major_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(row_major_strides(&[]), Vec::<usize>::new());
        assert_eq!(broadcast(&[2, 1, 3], &[4, 1]), Some(vec![2, 4, 3]));
        assert_eq!(broadcast(&[2, 3], &[4]), None);
        let s = broadcast_strides(&[3, 1], &row_major_strides(&[3, 1]), &[2, 3, 4]);
        assert_eq!(s, vec![0, 1, 0]);
        // A transposed walk of a 2x3 matrix visits columns first.
        let mut seen = Vec::new();
        walk(&[3, 2], [&[1, 3]], |[o]| seen.push(o));
        assert_eq!(seen, vec![0, 3, 1, 4, 2, 5]);
        let mut count = 0;
        walk(&[], [], |[]| count += 1);
        assert_eq!(count, 1);
        walk(&[2, 0], [], |[]| count += 1);
        assert_eq!(count, 1);
    }

    #[test]
    fn element_count_guards() {
        assert_eq!(element_count(&[2, 3], "x"), Ok(6));
        assert_eq!(element_count(&[usize::MAX, 0], "x"), Ok(0));
        assert!(matches!(element_count(&[1 << 20, 1 << 20], "x"), Err(ExecError::TooLarge { .. })));
        assert!(matches!(element_count(&[usize::MAX, 3], "x"), Err(ExecError::TooLarge { .. })));
    }
}
