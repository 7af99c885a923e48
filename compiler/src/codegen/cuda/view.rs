//! Strided views: which values are a buffer read with an offset and one stride per axis
//! (transposes, slices, and reshapes that only split or merge contiguous axes), so that the
//! tiled kernels (matmul, flash) can read their operands in place, and how a reshape maps
//! indices between its two shapes.

use super::cexpr::{is_one, row_major};
use crate::ir::{Dim, Graph, Op, Value};
use std::collections::HashMap;

/// A value read from a buffer: element `idx` is at `offset + Σ idx[a] * strides[a]`.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct View {
    /// The buffer.
    pub buf: usize,
    /// Element offset of index 0.
    pub offset: Dim,
    /// One stride per axis of the value (0 for size-1 axes, which are never stepped).
    pub strides: Vec<Dim>,
}

/// The view of `v` over the materialised values (`bufs`), or the value that must be
/// materialised for `v` to be a view (`v` itself, or a non-movement op under it).
pub(super) fn view_of(g: &Graph, v: Value, bufs: &HashMap<Value, usize>) -> Result<View, Value> {
    if let Some(buf) = bufs.get(&v) {
        let shape = &g.node(v).ty.shape;
        return Ok(View { buf: *buf, offset: Dim::constant(0), strides: row_major(shape) });
    }
    let node = g.node(v);
    let operands = g.operands(v);
    let inner = || operands.first().copied().ok_or(v);
    match &node.op {
        Op::Transpose { perm } => {
            let base = view_of(g, inner()?, bufs)?;
            let strides = perm.iter().map(|p| base.strides.get(*p).cloned().unwrap_or_else(|| Dim::constant(0))).collect();
            Ok(View { strides, ..base })
        }
        Op::Slice { axis, start, .. } => {
            let base = view_of(g, inner()?, bufs)?;
            let step = base.strides.get(*axis).cloned().unwrap_or_else(|| Dim::constant(0));
            Ok(View { offset: base.offset.add(&start.mul(&step)), ..base })
        }
        Op::Reshape => {
            let x = inner()?;
            let base = view_of(g, x, bufs)?;
            let from = &g.node(x).ty.shape;
            match reshape_strides(from, &base.strides, &node.ty.shape) {
                Some(strides) => Ok(View { strides, ..base }),
                None => Err(v),
            }
        }
        _ => Err(v),
    }
}

/// Groups of axes that a reshape maps onto each other: `(old axes, new axes)` ranges whose
/// products are equal, size-1 axes excluded (they map to index 0 / any stride). Returns the
/// non-unit axes of each side too. `None` when the products never line up (cannot happen for
/// a verified reshape, whose total sizes agree).
pub(super) fn reshape_groups(from: &[Dim], to: &[Dim]) -> Option<Vec<(Vec<usize>, Vec<usize>)>> {
    let old: Vec<usize> = (0..from.len()).filter(|a| !is_one(&from[*a])).collect();
    let new: Vec<usize> = (0..to.len()).filter(|a| !is_one(&to[*a])).collect();
    let prefix = |shape: &[Dim], axes: &[usize]| -> Vec<Dim> {
        let mut p = vec![Dim::constant(1)];
        for a in axes {
            let last = p.last().cloned().unwrap_or_else(|| Dim::constant(1));
            p.push(last.mul(&shape[*a]));
        }
        p
    };
    let (po, pn) = (prefix(from, &old), prefix(to, &new));
    let mut groups = Vec::new();
    let (mut i0, mut j0) = (0usize, 0usize);
    // Every (i, j) with equal prefix products is a boundary; prefix products strictly grow on
    // each side (no unit axes), so boundaries are found by scanning in order.
    let mut i = 1;
    while i <= old.len() {
        if let Some(j) = (j0 + 1..=new.len()).find(|j| pn[*j] == po[i]) {
            groups.push((old[i0..i].to_vec(), new[j0..j].to_vec()));
            i0 = i;
            j0 = j;
        }
        i += 1;
    }
    if i0 != old.len() || j0 != new.len() {
        if old.is_empty() && new.is_empty() {
            return Some(groups);
        }
        return None;
    }
    Some(groups)
}

/// Strides of the reshaped view when every group's old axes are contiguous with each other.
fn reshape_strides(from: &[Dim], strides: &[Dim], to: &[Dim]) -> Option<Vec<Dim>> {
    let groups = reshape_groups(from, to)?;
    let mut out = vec![Dim::constant(0); to.len()];
    for (old, new) in groups {
        // Old axes must step like one row-major block: stride[a] == stride[a+1] * size[a+1].
        for w in old.windows(2) {
            if strides[w[0]] != strides[w[1]].mul(&from[w[1]]) {
                return None;
            }
        }
        let mut acc = old.last().map(|a| strides[*a].clone())?;
        for b in new.iter().rev() {
            out[*b] = acc.clone();
            acc = acc.mul(&to[*b]);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(text: &[&str]) -> Vec<Dim> {
        text.iter().map(|t| Dim::parse(t).unwrap()).collect()
    }

    #[test]
    fn reshape_splits_and_merges() {
        let from = dims(&["B", "G*R", "S", "D"]);
        let to = dims(&["B", "G", "R*S", "D"]);
        let groups = reshape_groups(&from, &to).unwrap();
        assert_eq!(groups, vec![(vec![0], vec![0]), (vec![1, 2], vec![1, 2]), (vec![3], vec![3])]);
        let strides = reshape_strides(&from, &row_major(&from), &to).unwrap();
        assert_eq!(strides, row_major(&to));
        // Heads split off a contiguous width, then merged after a transpose: not a view.
        let from = dims(&["B", "S", "8", "Dh"]);
        let tstrides = {
            let s = row_major(&from);
            vec![s[0].clone(), s[2].clone(), s[1].clone(), s[3].clone()]
        };
        let tshape = dims(&["B", "8", "S", "Dh"]);
        assert!(reshape_strides(&tshape, &tstrides, &dims(&["B", "8*S", "Dh"])).is_none());
        assert!(reshape_strides(&tshape, &tstrides, &dims(&["B", "8", "S", "1", "Dh"])).is_some());
    }

    #[test]
    fn unit_axes_are_free() {
        let groups = reshape_groups(&dims(&["1", "S", "1"]), &dims(&["S"])).unwrap();
        assert_eq!(groups, vec![(vec![1], vec![0])]);
        assert_eq!(reshape_groups(&dims(&["1"]), &dims(&["1", "1"])).unwrap(), vec![]);
    }
}
