//! Ops that move elements without arithmetic: transpose, reshape, slice, concat, gather, paged.

use super::value::{Val, broadcast, broadcast_strides, element_count, filled, room, row_major_strides, walk};
use crate::exec::ExecError;
use crate::ir::DType;

fn bad(node: &str, reason: String) -> ExecError {
    ExecError::BadNode { node: node.to_string(), reason }
}

/// Output axis `k` is input axis `perm[k]`.
pub(super) fn transpose(x: &Val, perm: &[usize], dtype: DType, node: &str) -> Result<Val, ExecError> {
    let rank = x.shape.len();
    let mut seen = vec![false; rank];
    if perm.len() != rank || perm.iter().any(|p| *p >= rank || std::mem::replace(&mut seen[*p], true)) {
        return Err(bad(node, format!("{perm:?} is not a permutation of {rank} axes")));
    }
    let in_strides = row_major_strides(&x.shape);
    let shape: Vec<usize> = perm.iter().map(|p| x.shape[*p]).collect();
    let strides: Vec<usize> = perm.iter().map(|p| in_strides[*p]).collect();
    let mut out = room(x.data.len(), node)?;
    walk(&shape, [&strides], |[o]| out.push(x.data[o]));
    Ok(Val::new(dtype, shape, out))
}

/// The same elements in row-major order under the node's shape.
pub(super) fn reshape(x: &Val, shape: Vec<usize>, dtype: DType, node: &str) -> Result<Val, ExecError> {
    let n = element_count(&shape, node)?;
    if n != x.data.len() {
        return Err(bad(node, format!("cannot reshape {:?} ({} elements) to {shape:?} ({n} elements)", x.shape, x.data.len())));
    }
    Ok(Val::new(dtype, shape, x.data.clone()))
}

/// `x[..., start:end, ...]` on `axis`; the bounds must lie within the axis.
pub(super) fn slice(x: &Val, axis: usize, start: i64, end: i64, dtype: DType, node: &str) -> Result<Val, ExecError> {
    let Some(&size) = x.shape.get(axis) else {
        return Err(bad(node, format!("slice axis {axis} is out of range for rank {}", x.shape.len())));
    };
    let in_range = 0 <= start && start <= end && usize::try_from(end).is_ok_and(|e| e <= size);
    if !in_range {
        return Err(ExecError::OutOfRange { node: node.to_string(), span: None, axis, start, end, size });
    }
    // In range, so both bounds are non-negative and at most `size`.
    let (start, end) = (start as usize, end as usize);
    let strides = row_major_strides(&x.shape);
    let mut shape = x.shape.clone();
    shape[axis] = end - start;
    let base = start * strides[axis];
    let mut out = room(element_count(&shape, node)?, node)?;
    walk(&shape, [&strides], |[o]| out.push(x.data[base + o]));
    Ok(Val::new(dtype, shape, out))
}

/// Joins the operands along `axis`; all other dims must agree.
pub(super) fn concat(args: &[&Val], axis: usize, dtype: DType, node: &str) -> Result<Val, ExecError> {
    let first = args.first().ok_or_else(|| bad(node, "concat needs at least one operand".into()))?;
    if axis >= first.shape.len() {
        return Err(bad(node, format!("concat axis {axis} is out of range for rank {}", first.shape.len())));
    }
    let mut shape = first.shape.clone();
    shape[axis] = 0;
    for a in args {
        let fits =
            a.shape.len() == first.shape.len() && a.shape.iter().zip(&first.shape).enumerate().all(|(k, (x, y))| k == axis || x == y);
        if !fits {
            return Err(bad(node, format!("concat operands {:?} and {:?} differ off axis {axis}", first.shape, a.shape)));
        }
        shape[axis] += a.shape[axis];
    }
    let n = element_count(&shape, node)?;
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let mut out = room(n, node)?;
    for o in 0..outer {
        for a in args {
            let chunk = a.shape[axis] * inner;
            out.extend_from_slice(&a.data[o * chunk..(o + 1) * chunk]);
        }
    }
    Ok(Val::new(dtype, shape, out))
}

/// `table[i0, i1, ...]`: one index tensor per table axis, broadcast together; an index outside
/// `[0, size)` of its axis is an error ([`ExecError::IndexOutOfRange`]).
pub(super) fn gather(table: &Val, indices: &[&Val], dtype: DType, node: &str) -> Result<Val, ExecError> {
    if indices.len() != table.shape.len() {
        return Err(bad(
            node,
            format!("a table of rank {} needs {} index tensors, got {}", table.shape.len(), table.shape.len(), indices.len()),
        ));
    }
    let mut shape = Vec::new();
    for idx in indices {
        shape = broadcast(&shape, &idx.shape).ok_or_else(|| bad(node, "index shapes do not broadcast".into()))?;
    }
    let n = element_count(&shape, node)?;
    let table_strides = row_major_strides(&table.shape);
    // Offset into the table of each output element, accumulated one axis at a time.
    let mut offsets = filled(n, 0usize, node)?;
    for (axis, idx) in indices.iter().enumerate() {
        let size = table.shape[axis];
        let strides = broadcast_strides(&idx.shape, &row_major_strides(&idx.shape), &shape);
        let mut pos = 0;
        let mut bad = None;
        walk(&shape, [&strides], |[o]| {
            let i = idx.data[o];
            // A NaN index (only possible in an ill-typed graph) is out of range too.
            if !(i >= 0.0 && i < size as f64) {
                bad = bad.or(Some(i));
            } else {
                offsets[pos] += i as usize * table_strides[axis];
            }
            pos += 1;
        });
        if let Some(i) = bad {
            return Err(ExecError::IndexOutOfRange { node: node.to_string(), span: None, axis, index: i as i64, size });
        }
    }
    let out = offsets.iter().map(|o| table.data[*o]).collect();
    Ok(Val::new(dtype, shape, out))
}

/// `paged(pages, table)` ([`crate::ir::Op::Paged`]): `out[b, t, r…] = pages[table[b, t / P], t %
/// P, r…]` for `pages` `[NP, P, R…]` and `table` `[B, MP]`, the page id clamped into `[0, NP)`.
pub(super) fn paged(pages: &Val, table: &Val, dtype: DType, node: &str) -> Result<Val, ExecError> {
    let (&[np, p, ..], &[b, mp]) = (pages.shape.as_slice(), table.shape.as_slice()) else {
        return Err(bad(node, format!("paged needs pages [NP, P, …] and a table [B, MP], got {:?} and {:?}", pages.shape, table.shape)));
    };
    let row: usize = pages.shape[2..].iter().product();
    let mut shape = vec![b, mp.checked_mul(p).ok_or_else(|| bad(node, "too many rows".into()))?];
    shape.extend_from_slice(&pages.shape[2..]);
    let mut out = room(element_count(&shape, node)?, node)?;
    if np == 0 {
        return Err(bad(node, "paged reads from a pool of no pages".into()));
    }
    for bi in 0..b {
        for m in 0..mp {
            let id = table.data[bi * mp + m];
            // Clamped into the pool (NaN only in an ill-typed graph: page 0).
            let page = if id >= 0.0 { (id as usize).min(np.saturating_sub(1)) } else { 0 };
            let start = page * p * row;
            out.extend_from_slice(&pages.data[start..start + p * row]);
        }
    }
    Ok(Val::new(dtype, shape, out))
}
