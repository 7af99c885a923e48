//! Ops that combine many elements: reductions, softmax, layer and RMS normalisation, and the
//! batched matrix product. All sums accumulate in f64.

use super::value::{Val, broadcast, broadcast_strides, element_count, filled, room, row_major_strides, split_at_axis, walk};
use crate::exec::ExecError;
use crate::ir::semantics::{max_f, min_f, sorts_before, wrap_i32};
use crate::ir::{DType, ReduceOp, ScanOp};

fn bad(node: &str, reason: String) -> ExecError {
    ExecError::BadNode { node: node.to_string(), reason }
}

/// Reduces `axes` (sorted, distinct). An empty reduction gives 0 for sum and mean (mean is
/// defined as 0 there rather than NaN), `-inf` for max, log-sum-exp and `inf` for min. Max,
/// min and log-sum-exp propagate NaN.
pub(super) fn reduce(x: &Val, op: ReduceOp, axes: &[usize], keepdim: bool, dtype: DType, node: &str) -> Result<Val, ExecError> {
    let rank = x.shape.len();
    if axes.is_empty() || axes.windows(2).any(|w| w[0] >= w[1]) || axes.iter().any(|a| *a >= rank) {
        return Err(bad(node, format!("bad reduction axes {axes:?} for rank {rank}")));
    }
    // Reduce into the keepdim shape; dropping its size-1 axes afterwards does not move data.
    let kept: Vec<usize> = x.shape.iter().enumerate().map(|(k, d)| if axes.contains(&k) { 1 } else { *d }).collect();
    let n = element_count(&kept, node)?;
    let mut strides = row_major_strides(&kept);
    for a in axes {
        strides[*a] = 0;
    }
    let init = match op {
        ReduceOp::Sum | ReduceOp::Mean => 0.0,
        ReduceOp::Max | ReduceOp::LogSumExp => f64::NEG_INFINITY,
        ReduceOp::Min => f64::INFINITY,
    };
    let combine: fn(f64, f64) -> f64 = match op {
        ReduceOp::Sum | ReduceOp::Mean => |acc, v| acc + v,
        ReduceOp::Max | ReduceOp::LogSumExp => max_f,
        ReduceOp::Min => min_f,
    };
    let mut acc = filled(n, init, node)?;
    let mut i = 0;
    walk(&x.shape, [&strides], |[o]| {
        acc[o] = combine(acc[o], x.data[i]);
        i += 1;
    });
    if op == ReduceOp::LogSumExp {
        // m + log Σ exp(x - m) with m the maximum (taken as 0 where it is infinite: a row of
        // -inf gives -inf, one with +inf gives +inf).
        let m: Vec<f64> = acc.iter().map(|m| if m.is_infinite() { 0.0 } else { *m }).collect();
        let mut sums = filled(n, 0.0, node)?;
        let mut i = 0;
        walk(&x.shape, [&strides], |[o]| {
            sums[o] += (x.data[i] - m[o]).exp();
            i += 1;
        });
        for ((a, s), m) in acc.iter_mut().zip(&sums).zip(&m) {
            *a = m + s.ln();
        }
    }
    if op == ReduceOp::Mean {
        let count: usize = axes.iter().map(|a| x.shape[*a]).product();
        for v in &mut acc {
            *v = if count == 0 { 0.0 } else { *v / count as f64 };
        }
    }
    if dtype == DType::I32 && op == ReduceOp::Sum {
        // Integer sums wrap, like every integer op (exact in f64 below 2^53).
        for v in &mut acc {
            *v = f64::from(wrap_i32(*v as i64));
        }
    }
    let shape = if keepdim { kept } else { x.shape.iter().enumerate().filter(|(k, _)| !axes.contains(k)).map(|(_, d)| *d).collect() };
    Ok(Val::new(dtype, shape, acc))
}

/// `exp(x - max) / sum(exp(x - max))` along `axis`. A row whose max is `-inf` (fully masked)
/// gives all zeros rather than NaN.
pub(super) fn softmax(x: &Val, axis: usize, dtype: DType, node: &str) -> Result<Val, ExecError> {
    if axis >= x.shape.len() {
        return Err(bad(node, format!("softmax axis {axis} is out of range for rank {}", x.shape.len())));
    }
    let (outer, n, inner) = split_at_axis(&x.shape, axis);
    let mut out = filled(x.data.len(), 0.0, node)?;
    for o in 0..outer {
        for j in 0..inner {
            let at = |i: usize| (o * n + i) * inner + j;
            let max = (0..n).fold(f64::NEG_INFINITY, |m, i| max_f(m, x.data[at(i)]));
            if max == f64::NEG_INFINITY {
                continue;
            }
            let sum: f64 = (0..n).map(|i| (x.data[at(i)] - max).exp()).sum();
            for i in 0..n {
                out[at(i)] = (x.data[at(i)] - max).exp() / sum;
            }
        }
    }
    Ok(Val::new(dtype, x.shape.clone(), out))
}

/// Checks that a scale or shift operand has shape `[d]`.
fn check_param(p: &Val, d: usize, what: &str, node: &str) -> Result<(), ExecError> {
    if p.shape != [d] {
        return Err(bad(node, format!("{what} has shape {:?}, but the normalised axis has size {d}", p.shape)));
    }
    Ok(())
}

/// The size of the last axis of a normalised operand.
fn last_axis(x: &Val, node: &str) -> Result<usize, ExecError> {
    x.shape.last().copied().ok_or_else(|| bad(node, "cannot normalise a scalar".into()))
}

/// `(x - mean) / sqrt(var + eps) * gamma + beta` over the last axis, biased variance.
pub(super) fn layer_norm(x: &Val, gamma: &Val, beta: &Val, eps: f64, dtype: DType, node: &str) -> Result<Val, ExecError> {
    let d = last_axis(x, node)?;
    check_param(gamma, d, "gamma", node)?;
    check_param(beta, d, "beta", node)?;
    let mut out = room(x.data.len(), node)?;
    for row in x.data.chunks(d.max(1)) {
        let mean = row.iter().sum::<f64>() / d as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
        let denom = (var + eps).sqrt();
        out.extend(row.iter().enumerate().map(|(k, v)| (v - mean) / denom * gamma.data[k] + beta.data[k]));
    }
    Ok(Val::new(dtype, x.shape.clone(), out))
}

/// `x / sqrt(mean(x^2) + eps) * gamma` over the last axis.
pub(super) fn rms_norm(x: &Val, gamma: &Val, eps: f64, dtype: DType, node: &str) -> Result<Val, ExecError> {
    let d = last_axis(x, node)?;
    check_param(gamma, d, "gamma", node)?;
    let mut out = room(x.data.len(), node)?;
    for row in x.data.chunks(d.max(1)) {
        let mean_square = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
        let denom = (mean_square + eps).sqrt();
        out.extend(row.iter().enumerate().map(|(k, v)| v / denom * gamma.data[k]));
    }
    Ok(Val::new(dtype, x.shape.clone(), out))
}

/// Batched `a @ b` over the last two axes; the leading (batch) axes broadcast.
pub(super) fn matmul(a: &Val, b: &Val, dtype: DType, node: &str) -> Result<Val, ExecError> {
    let (ra, rb) = (a.shape.len(), b.shape.len());
    if ra < 2 || rb < 2 {
        return Err(bad(node, format!("matmul needs at least 2 axes on each side, got {:?} @ {:?}", a.shape, b.shape)));
    }
    let (m, k) = (a.shape[ra - 2], a.shape[ra - 1]);
    let (k2, n) = (b.shape[rb - 2], b.shape[rb - 1]);
    let batch = broadcast(&a.shape[..ra - 2], &b.shape[..rb - 2]);
    let Some(batch) = batch.filter(|_| k == k2) else {
        return Err(bad(node, format!("cannot multiply {:?} @ {:?}", a.shape, b.shape)));
    };
    let mut shape = batch.clone();
    shape.extend([m, n]);
    let total = element_count(&shape, node)?;
    // Batch strides taken from the full operands' strides, so they step whole matrices.
    let a_strides = broadcast_strides(&a.shape[..ra - 2], &row_major_strides(&a.shape)[..ra - 2], &batch);
    let b_strides = broadcast_strides(&b.shape[..rb - 2], &row_major_strides(&b.shape)[..rb - 2], &batch);
    let mut out = room(total, node)?;
    let mut row = vec![0.0f64; n];
    walk(&batch, [&a_strides, &b_strides], |[ao, bo]| {
        for i in 0..m {
            row.fill(0.0);
            for p in 0..k {
                let aip = a.data[ao + i * k + p];
                let b_row = &b.data[bo + p * n..bo + (p + 1) * n];
                for (acc, bpj) in row.iter_mut().zip(b_row) {
                    *acc += aip * bpj;
                }
            }
            out.extend_from_slice(&row);
        }
    });
    Ok(Val::new(dtype, shape, out))
}

/// `base` plus every `src` element at the position `idx` names along `axis`, in order, each sum
/// rounded to the element type ([`Op::ScatterAdd`](crate::ir::Op::ScatterAdd)); a position
/// outside the axis is an error ([`ExecError::IndexOutOfRange`]).
pub(super) fn scatter_add(base: &Val, idx: &Val, src: &Val, axis: usize, dtype: DType, node: &str) -> Result<Val, ExecError> {
    if axis >= base.shape.len() || src.shape.len() != base.shape.len() || idx.shape != src.shape {
        return Err(bad(node, format!("scatter_add shapes {:?}, {:?}, {:?} do not fit", base.shape, idx.shape, src.shape)));
    }
    let (outer, n, inner) = split_at_axis(&base.shape, axis);
    let (_, m, inner_src) = split_at_axis(&src.shape, axis);
    if inner_src != inner {
        return Err(bad(node, format!("scatter_add values {:?} do not match {:?}", src.shape, base.shape)));
    }
    let mut out = base.data.clone();
    for o in 0..outer {
        for j in 0..inner {
            for i in 0..m {
                let at = (o * m + i) * inner + j;
                let t = idx.data[at] as i64;
                if t < 0 || t >= n as i64 {
                    return Err(ExecError::IndexOutOfRange { node: node.to_string(), span: None, axis, index: t, size: n });
                }
                let t = t as usize;
                let to = (o * n + t) * inner + j;
                out[to] = dtype.round(out[to] + src.data[at]);
            }
        }
    }
    Ok(Val::new(dtype, base.shape.clone(), out))
}

/// The stable sorting permutation along `axis` ([`sorts_before`]).
pub(super) fn argsort(x: &Val, axis: usize, descending: bool, node: &str) -> Result<Val, ExecError> {
    if axis >= x.shape.len() {
        return Err(bad(node, format!("argsort axis {axis} is out of range for rank {}", x.shape.len())));
    }
    let (outer, n, inner) = split_at_axis(&x.shape, axis);
    let mut out = filled(x.data.len(), 0.0, node)?;
    let mut order: Vec<usize> = room(n, node)?;
    for o in 0..outer {
        for j in 0..inner {
            let at = |i: usize| (o * n + i) * inner + j;
            order.clear();
            order.extend(0..n);
            order.sort_by(|&a, &b| {
                if a == b {
                    std::cmp::Ordering::Equal
                } else if sorts_before(x.data[at(a)], a as i64, x.data[at(b)], b as i64, descending) {
                    std::cmp::Ordering::Less
                } else {
                    std::cmp::Ordering::Greater
                }
            });
            for (rank, i) in order.iter().enumerate() {
                out[at(rank)] = *i as f64;
            }
        }
    }
    Ok(Val::new(DType::I32, x.shape.clone(), out))
}

/// Running sums, products or the linear recurrence `h_i = a_i h_(i-1) + b_i` along `axis`
/// ([`Op::Scan`](crate::ir::Op::Scan)). Float accumulations run in f64 and each output is
/// rounded once; integer ones wrap (i64 arithmetic, kept to 32 bits at every output).
pub(super) fn scan(op: ScanOp, args: &[&Val], axis: usize, reverse: bool, dtype: DType, node: &str) -> Result<Val, ExecError> {
    let (a, x) = match (op, args) {
        (ScanOp::Linear, [a, b]) => {
            let common = |v: &Val| super::elementwise::broadcast_map([v, a, b], v.dtype, node, |[s, _, _]| s);
            (Some(common(a)?), common(b)?)
        }
        (_, [x]) => (None, (*x).clone()),
        _ => return Err(bad(node, format!("`{}` got {} operands", op.name(), args.len()))),
    };
    if axis >= x.shape.len() {
        return Err(bad(node, format!("{} axis {axis} is out of range for rank {}", op.name(), x.shape.len())));
    }
    let (outer, n, inner) = split_at_axis(&x.shape, axis);
    let int = dtype == DType::I32;
    let mut out = filled(x.data.len(), 0.0, node)?;
    for o in 0..outer {
        for j in 0..inner {
            let at = |i: usize| (o * n + i) * inner + j;
            let (mut acc, mut iacc): (f64, i64) = if op == ScanOp::Prod { (1.0, 1) } else { (0.0, 0) };
            for step in 0..n {
                let i = if reverse { n - 1 - step } else { step };
                let v = x.data[at(i)];
                out[at(i)] = match (op, int) {
                    (ScanOp::Sum, true) => {
                        iacc = iacc.wrapping_add(v as i64);
                        f64::from(wrap_i32(iacc))
                    }
                    (ScanOp::Prod, true) => {
                        iacc = iacc.wrapping_mul(v as i64);
                        f64::from(wrap_i32(iacc))
                    }
                    (ScanOp::Sum, false) => {
                        acc += v;
                        acc
                    }
                    (ScanOp::Prod, false) => {
                        acc *= v;
                        acc
                    }
                    (ScanOp::Linear, _) => {
                        let coef = a.as_ref().map_or(1.0, |a| a.data[at(i)]);
                        acc = coef * acc + v;
                        acc
                    }
                };
            }
        }
    }
    Ok(Val::new(dtype, x.shape.clone(), out))
}

/// `out[.., i, :] = Σ_{j ≤ i} (q_i · k_j) v_j` (`j ≥ i` when `reverse`)
/// ([`Op::PrefixAttention`](crate::ir::Op::PrefixAttention)): the running state `Σ k_j ⊗ v_j`
/// in f64, each output rounded once.
pub(super) fn prefix_attention(q: &Val, k: &Val, v: &Val, reverse: bool, dtype: DType, node: &str) -> Result<Val, ExecError> {
    let r = q.shape.len();
    if r < 2 || k.shape != q.shape || v.shape.len() != r || v.shape[..r - 1] != q.shape[..r - 1] {
        return Err(bad(
            node,
            format!("prefix_attention needs q, k of [.., S, D] and v of [.., S, Dv], got {:?}, {:?}, {:?}", q.shape, k.shape, v.shape),
        ));
    }
    let (s, d, dv) = (q.shape[r - 2], q.shape[r - 1], v.shape[r - 1]);
    let batch: usize = q.shape[..r - 2].iter().product();
    let mut shape = q.shape.clone();
    shape[r - 1] = dv;
    let mut out = filled(element_count(&shape, node)?, 0.0, node)?;
    let mut state = filled(d * dv, 0.0, node)?;
    for b in 0..batch {
        state.fill(0.0);
        for step in 0..s {
            let i = if reverse { s - 1 - step } else { step };
            let (qi, vi) = ((b * s + i) * d, (b * s + i) * dv);
            for x in 0..d {
                let kx = k.data[qi + x];
                for (y, st) in state[x * dv..(x + 1) * dv].iter_mut().enumerate() {
                    *st += kx * v.data[vi + y];
                }
            }
            for y in 0..dv {
                out[vi + y] = (0..d).map(|x| q.data[qi + x] * state[x * dv + y]).sum();
            }
        }
    }
    Ok(Val::new(dtype, shape, out))
}
