//! `flash` by its definition: scores row by row, score modification and mask by the scalar
//! semantics of [`crate::ir::semantics`], softmax (or sigmoid) and the weighted sum of values
//! in f64. It never materialises more than one row of scores. A key whose weight is 0 adds
//! nothing, even where its value is inf or NaN.

use super::InterpError;
use super::value::{Val, element_count, filled, row_major_strides};
use crate::ir::semantics::{Scalar, max_f, unary_f};
use crate::ir::{DType, FlashSpec, UnaryOp, Weights};
use std::collections::HashMap;

/// The `load` of a flash op's score and mask expressions: element `idx` of extra operand
/// `input`, each index clamped into its axis (like gather); NaN for a missing operand or an
/// empty axis.
pub(super) fn extra_loader<'a>(extras: &'a [&'a Val]) -> impl Fn(usize, &[i64]) -> Scalar + 'a {
    let strides: Vec<Vec<usize>> = extras.iter().map(|x| row_major_strides(&x.shape)).collect();
    move |input: usize, idx: &[i64]| -> Scalar {
        let Some(x) = extras.get(input) else { return Scalar::F(f64::NAN) };
        let mut off = 0;
        for (axis, ix) in idx.iter().enumerate() {
            let size = x.shape.get(axis).copied().unwrap_or(1);
            if size == 0 {
                return Scalar::F(f64::NAN);
            }
            off += (*ix).clamp(0, size as i64 - 1) as usize * strides[input].get(axis).copied().unwrap_or(0);
        }
        Scalar::load(x.dtype, x.data.get(off).copied().unwrap_or(f64::NAN))
    }
}

pub(super) fn flash(spec: &FlashSpec, args: &[&Val], dtype: DType, env: &HashMap<String, i64>, label: &str) -> Result<Val, InterpError> {
    let bad = |reason: String| InterpError::BadNode { node: label.to_string(), reason };
    let [q, k, v, extras @ ..] = args else { return Err(bad("flash needs q, k, v".into())) };
    let r = q.shape.len();
    if r < 2 || k.shape.len() != r || v.shape.len() != r {
        return Err(bad("q, k and v must have the same rank".into()));
    }
    let (m, d) = (q.shape[r - 2], q.shape[r - 1]);
    let (n, dv) = (k.shape[r - 2], v.shape[r - 1]);
    if k.shape[r - 1] != d || v.shape[r - 2] != n {
        return Err(bad(format!("q {:?}, k {:?}, v {:?} do not fit", q.shape, k.shape, v.shape)));
    }
    let batch = &q.shape[..r - 2];
    let batch_count: usize = batch.iter().product();
    let mut out = filled(element_count(&[batch_count, m, dv], label)?, 0.0, label)?;
    let (kst, vst) = (row_major_strides(&k.shape), row_major_strides(&v.shape));
    let load = extra_loader(extras);
    let mut pos = vec![0i64; r];
    let mut scores = filled(n, 0.0, label)?;
    let mut keep = filled(n, true, label)?;
    for b in 0..batch_count {
        // Batch multi-index, and the offsets of k and v with size-1 batch axes broadcast.
        let (mut rest, mut koff, mut voff) = (b, 0, 0);
        for axis in (0..r - 2).rev() {
            let ix = rest % batch[axis];
            rest /= batch[axis];
            pos[axis] = ix as i64;
            if k.shape[axis] != 1 {
                koff += ix * kst[axis];
            }
            if v.shape[axis] != 1 {
                voff += ix * vst[axis];
            }
        }
        for i in 0..m {
            pos[r - 2] = i as i64;
            let qrow = &q.data[(b * m + i) * d..(b * m + i + 1) * d];
            for j in 0..n {
                pos[r - 1] = j as i64;
                let krow = &k.data[koff + j * kst[r - 2]..koff + j * kst[r - 2] + d];
                let s: f64 = qrow.iter().zip(krow).map(|(a, c)| a * c).sum();
                // The unfused graph stores the raw scores as f32; so does the reference.
                let s = DType::F32.round(s);
                scores[j] = spec.score.eval(s, &pos, env, &load).as_f();
                keep[j] = spec.mask.as_ref().is_none_or(|mk| mk.eval(s, &pos, env, &load).as_b());
            }
            let orow = &mut out[(b * m + i) * dv..(b * m + i + 1) * dv];
            let weights: Vec<f64> = match spec.weights {
                Weights::Softmax => {
                    // NaN-propagating: a kept NaN (or +inf) score makes the row NaN.
                    let max = (0..n).filter(|j| keep[*j]).map(|j| scores[j]).fold(f64::NEG_INFINITY, max_f);
                    if max == f64::NEG_INFINITY {
                        continue;
                    }
                    let e: Vec<f64> = (0..n).map(|j| if keep[j] { (scores[j] - max).exp() } else { 0.0 }).collect();
                    let z: f64 = e.iter().sum();
                    e.into_iter().map(|x| x / z).collect()
                }
                Weights::Sigmoid => (0..n).map(|j| if keep[j] { unary_f(UnaryOp::Sigmoid, scores[j]) } else { 0.0 }).collect(),
            };
            for (j, w) in weights.iter().enumerate() {
                if *w == 0.0 {
                    continue;
                }
                let vrow = &v.data[voff + j * vst[r - 2]..voff + j * vst[r - 2] + dv];
                for (o, x) in orow.iter_mut().zip(vrow) {
                    *o += w * x;
                }
            }
        }
    }
    let mut shape = batch.to_vec();
    shape.extend([m, dv]);
    Ok(Val::new(dtype, shape, out))
}
