//! `flash` by its definition: scores row by row, score modification and mask by the scalar
//! semantics of [`crate::ir::semantics`], softmax (or sigmoid) and the weighted sum of values
//! in f64. It never materialises more than one row of scores. A key whose weight is 0 adds
//! nothing, even where its value is inf or NaN.

use super::value::{Val, element_count, filled, row_major_strides};
use crate::exec::ExecError;
use crate::ir::grad::score_grad;
use crate::ir::semantics::{Class, Scalar, max_f, unary_f};
use crate::ir::{DType, FlashSpec, FlashWrt, Pair, UnaryOp, Weights};
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

/// The shapes of a flash op's operands, checked, and the walk over its batch indices.
struct Geometry {
    r: usize,
    m: usize,
    d: usize,
    n: usize,
    dv: usize,
    batch: Vec<usize>,
    kst: Vec<usize>,
    vst: Vec<usize>,
    /// The extra operands' ranks.
    extra_ranks: Vec<usize>,
}

impl Geometry {
    fn of(q: &Val, k: &Val, v: &Val, extras: &[&Val], bad: &dyn Fn(String) -> ExecError) -> Result<Geometry, ExecError> {
        let r = q.shape.len();
        if r < 2 || k.shape.len() != r || v.shape.len() != r {
            return Err(bad("q, k and v must have the same rank".into()));
        }
        let (m, d) = (q.shape[r - 2], q.shape[r - 1]);
        let (n, dv) = (k.shape[r - 2], v.shape[r - 1]);
        if k.shape[r - 1] != d || v.shape[r - 2] != n {
            return Err(bad(format!("q {:?}, k {:?}, v {:?} do not fit", q.shape, k.shape, v.shape)));
        }
        let (kst, vst) = (row_major_strides(&k.shape), row_major_strides(&v.shape));
        let extra_ranks = extras.iter().map(|x| x.shape.len()).collect();
        Ok(Geometry { r, m, d, n, dv, batch: q.shape[..r - 2].to_vec(), kst, vst, extra_ranks })
    }

    fn batch_count(&self) -> usize {
        self.batch.iter().product()
    }

    /// Batch index `b`'s positions (written into `pos`), and the offsets of its k and v heads
    /// (size-1 batch axes broadcast).
    fn head(&self, b: usize, k: &Val, v: &Val, pos: &mut [i64]) -> (usize, usize) {
        let (mut rest, mut koff, mut voff) = (b, 0, 0);
        for axis in (0..self.r - 2).rev() {
            let ix = rest % self.batch[axis];
            rest /= self.batch[axis];
            pos[axis] = ix as i64;
            if k.shape[axis] != 1 {
                koff += ix * self.kst[axis];
            }
            if v.shape[axis] != 1 {
                voff += ix * self.vst[axis];
            }
        }
        (koff, voff)
    }

    /// Row `j` of k (of width `d`) at head offset `koff`.
    fn krow<'k>(&self, k: &'k Val, koff: usize, j: usize) -> &'k [f64] {
        let at = koff + j * self.kst[self.r - 2];
        &k.data[at..at + self.d]
    }

    /// Row `j` of v (of width `dv`) at head offset `voff`.
    fn vrow<'v>(&self, v: &'v Val, voff: usize, j: usize) -> &'v [f64] {
        let at = voff + j * self.vst[self.r - 2];
        &v.data[at..at + self.dv]
    }
}

/// The raw scores of query row `qrow` against every key (rounded to f32, as the unfused graph
/// stores them), their modified values and whether each key is kept. `pos` holds the batch
/// positions and the row `i`; its key position is set per key.
#[allow(clippy::too_many_arguments)]
fn score_row(
    spec: &FlashSpec,
    g: &Geometry,
    qrow: &[f64],
    k: &Val,
    koff: usize,
    pos: &mut [i64],
    env: &HashMap<String, i64>,
    load: &dyn Fn(usize, &[i64]) -> Scalar,
    (raw, scores, keep): (&mut [f64], &mut [f64], &mut [bool]),
) {
    let r = g.r;
    // The additive weight's row for this batch index: its axes right-aligned with the score's
    // batch axes (size-1 axes read index 0 by the loader's clamp).
    let w: Vec<f64> = match spec.pair {
        Pair::Dot => Vec::new(),
        Pair::Additive { weight } => {
            let rank = g.extra_ranks.get(weight).copied().unwrap_or(1).max(1);
            let mut idx: Vec<i64> = pos[(r - 2 + 1).saturating_sub(rank)..r - 2].to_vec();
            idx.push(0);
            (0..g.d)
                .map(|a| {
                    idx[rank - 1] = a as i64;
                    load(weight, &idx).as_f()
                })
                .collect()
        }
    };
    let weight = |a: usize| w.get(a).copied().unwrap_or(f64::NAN);
    for j in 0..g.n {
        pos[r - 1] = j as i64;
        let s = DType::F32.round(spec.pair.eval(qrow, g.krow(k, koff, j), &weight));
        raw[j] = s;
        scores[j] = spec.score.eval(s, pos, env, load).as_f();
        keep[j] = spec.mask.as_ref().is_none_or(|mk| mk.eval(s, pos, env, load).as_b());
    }
}

/// The value of a flash op's dropout seed (`None` without dropout).
fn dropout_seed(spec: &FlashSpec, extras: &[&Val], bad: &dyn Fn(String) -> ExecError) -> Result<Option<i32>, ExecError> {
    let Some(d) = &spec.dropout else { return Ok(None) };
    match extras.get(d.seed).map(|x| x.data.as_slice()) {
        Some([s]) => Ok(Some(Scalar::load(DType::I32, *s).as_i())),
        _ => Err(bad(format!("the dropout seed x{} is not a scalar", d.seed))),
    }
}

/// The softmax statistics of a row's kept scores: `(max, Σ exp(score - max))`, NaN-propagating
/// (a kept NaN or +inf score makes the row NaN); `max = -inf` when no key is kept.
fn row_stats(scores: &[f64], keep: &[bool]) -> (f64, f64) {
    let max = (0..scores.len()).filter(|j| keep[*j]).map(|j| scores[j]).fold(f64::NEG_INFINITY, max_f);
    if max == f64::NEG_INFINITY {
        return (max, 0.0);
    }
    let z = (0..scores.len()).filter(|j| keep[*j]).map(|j| (scores[j] - max).exp()).sum();
    (max, z)
}

pub(super) fn flash(spec: &FlashSpec, args: &[&Val], dtype: DType, env: &HashMap<String, i64>, label: &str) -> Result<Val, ExecError> {
    let bad = |reason: String| ExecError::BadNode { node: label.to_string(), reason };
    let [q, k, v, extras @ ..] = args else { return Err(bad("flash needs q, k, v".into())) };
    let g = Geometry::of(q, k, v, extras, &bad)?;
    let (r, m, d, n, dv) = (g.r, g.m, g.d, g.n, g.dv);
    let batch_count = g.batch_count();
    let mut out = filled(element_count(&[batch_count, m, dv], label)?, 0.0, label)?;
    let load = extra_loader(extras);
    let seed = dropout_seed(spec, extras, &bad)?;
    let mut pos = vec![0i64; r];
    let (mut raw, mut scores, mut keep) = (filled(n, 0.0, label)?, filled(n, 0.0, label)?, filled(n, true, label)?);
    for b in 0..batch_count {
        let (koff, voff) = g.head(b, k, v, &mut pos);
        for i in 0..m {
            pos[r - 2] = i as i64;
            let qrow = &q.data[(b * m + i) * d..(b * m + i + 1) * d];
            score_row(spec, &g, qrow, k, koff, &mut pos, env, &load, (&mut raw, &mut scores, &mut keep));
            let orow = &mut out[(b * m + i) * dv..(b * m + i + 1) * dv];
            let drop = |j: usize| spec.dropout.zip(seed).map_or(1.0, |(dr, s)| dr.factor(s, b as u64, i as u64, j as u64));
            let weights: Vec<f64> = match spec.weights {
                Weights::Softmax => {
                    let (max, z) = row_stats(&scores, &keep);
                    if max == f64::NEG_INFINITY {
                        continue;
                    }
                    (0..n).map(|j| if keep[j] { (scores[j] - max).exp() / z } else { 0.0 }).collect()
                }
                Weights::Sigmoid => (0..n).map(|j| if keep[j] { unary_f(UnaryOp::Sigmoid, scores[j]) } else { 0.0 }).collect(),
            };
            for (j, w) in weights.iter().enumerate() {
                let w = w * drop(j);
                if w == 0.0 {
                    continue;
                }
                for (o, x) in orow.iter_mut().zip(g.vrow(v, voff, j)) {
                    *o += w * x;
                }
            }
        }
    }
    let mut shape = g.batch.clone();
    shape.extend([m, dv]);
    Ok(Val::new(dtype, shape, out))
}

/// `flash_lse`: per row `max + ln Σ exp(score - max)` over the kept keys; `-inf` for a row with
/// none kept.
pub(super) fn flash_lse(spec: &FlashSpec, args: &[&Val], env: &HashMap<String, i64>, label: &str) -> Result<Val, ExecError> {
    let bad = |reason: String| ExecError::BadNode { node: label.to_string(), reason };
    let [q, k, v, extras @ ..] = args else { return Err(bad("flash_lse needs q, k, v".into())) };
    let g = Geometry::of(q, k, v, extras, &bad)?;
    let (r, m, d, n) = (g.r, g.m, g.d, g.n);
    let batch_count = g.batch_count();
    let mut out = filled(element_count(&[batch_count, m], label)?, 0.0, label)?;
    let load = extra_loader(extras);
    let mut pos = vec![0i64; r];
    let (mut raw, mut scores, mut keep) = (filled(n, 0.0, label)?, filled(n, 0.0, label)?, filled(n, true, label)?);
    for b in 0..batch_count {
        let (koff, _) = g.head(b, k, v, &mut pos);
        for i in 0..m {
            pos[r - 2] = i as i64;
            let qrow = &q.data[(b * m + i) * d..(b * m + i + 1) * d];
            score_row(spec, &g, qrow, k, koff, &mut pos, env, &load, (&mut raw, &mut scores, &mut keep));
            let (max, z) = row_stats(&scores, &keep);
            out[b * m + i] = if max == f64::NEG_INFINITY { max } else { max + z.ln() };
        }
    }
    let mut shape = g.batch.clone();
    shape.push(m);
    Ok(Val::new(DType::F32, shape, out))
}

/// `flash_grad` by its definition ([`crate::ir::Op::FlashGrad`]), one query row at a time:
/// weights from the scores and `lse` (or sigmoid), `dP = d_out · v`, the score's adjoint `dF`,
/// and its contribution to the gradient asked for. A score whose `dF` (for v: whose weight) is
/// 0 contributes nothing, even where the score modification's derivative is inf or NaN.
#[allow(clippy::too_many_arguments)]
pub(super) fn flash_grad(
    spec: &FlashSpec,
    (wrt, lse_grad): (FlashWrt, bool),
    args: &[&Val],
    dtype: DType,
    shape: Vec<usize>,
    env: &HashMap<String, i64>,
    label: &str,
) -> Result<Val, ExecError> {
    let bad = |reason: String| ExecError::BadNode { node: label.to_string(), reason };
    let fixed = spec.grad_fixed_operands(lse_grad);
    if args.len() < fixed {
        return Err(bad(format!("flash_grad needs {fixed} operands before its extras")));
    }
    let (q, k, v, d_out) = (args[0], args[1], args[2], args[3]);
    // The log-sum-exp and the forward's result (softmax weights), and the log-sum-exp's
    // cotangent.
    let stats = (fixed >= 6).then(|| (args[4], args[5]));
    let d_lse = lse_grad.then(|| args[6]);
    let extras = &args[fixed..];
    let g = Geometry::of(q, k, v, extras, &bad)?;
    let (r, m, d, n, dv) = (g.r, g.m, g.d, g.n, g.dv);
    let classes: Vec<Class> = extras.iter().map(|x| Class::of(x.dtype)).collect();
    let derivative =
        score_grad(spec, &|x| classes.get(x).copied().unwrap_or(Class::Float)).map_err(|e| bad(format!("no derivative: {e}")))?;
    let mut out = filled(element_count(&shape, label)?, 0.0, label)?;
    let load = extra_loader(extras);
    let mut pos = vec![0i64; r];
    let (mut raw, mut scores, mut keep) = (filled(n, 0.0, label)?, filled(n, 0.0, label)?, filled(n, true, label)?);
    let target = match wrt {
        FlashWrt::Extra(x) => Some(extras.get(x).ok_or_else(|| bad(format!("x{x} is not an operand")))?),
        _ => None,
    };
    let target_strides = target.map(|t| row_major_strides(&t.shape)).unwrap_or_default();
    let seed = dropout_seed(spec, extras, &bad)?;
    for b in 0..g.batch_count() {
        let (koff, voff) = g.head(b, k, v, &mut pos);
        for i in 0..m {
            pos[r - 2] = i as i64;
            let row = b * m + i;
            let qrow = &q.data[row * d..(row + 1) * d];
            let dorow = &d_out.data[row * dv..(row + 1) * dv];
            score_row(spec, &g, qrow, k, koff, &mut pos, env, &load, (&mut raw, &mut scores, &mut keep));
            // delta = Σ d_out ∘ out over the row, less the log-sum-exp's cotangent (∂lse/∂s = P).
            let delta = stats
                .map_or(0.0, |(_, out)| dorow.iter().zip(&out.data[row * dv..(row + 1) * dv]).map(|(a, b)| a * b).sum::<f64>())
                - d_lse.and_then(|x| x.data.get(row)).copied().unwrap_or(0.0);
            for j in 0..n {
                if !keep[j] {
                    continue;
                }
                let p = match stats {
                    Some((lse, _)) if lse.data[row] == f64::NEG_INFINITY => 0.0,
                    Some((lse, _)) => (scores[j] - lse.data[row]).exp(),
                    None => unary_f(UnaryOp::Sigmoid, scores[j]),
                };
                // Dropout's factor on the weight: the values see `p · z`, and `dP` is `z · d_out · v`.
                let z = spec.dropout.zip(seed).map_or(1.0, |(dr, s)| dr.factor(s, b as u64, i as u64, j as u64));
                let dp: f64 = z * dorow.iter().zip(g.vrow(v, voff, j)).map(|(a, c)| a * c).sum::<f64>();
                let df = match stats {
                    Some(_) => p * (dp - delta),
                    None => dp * p * (1.0 - p),
                };
                pos[r - 1] = j as i64;
                match wrt {
                    FlashWrt::V if p * z != 0.0 => {
                        let at = (b * n + j) * dv;
                        for (o, x) in out[at..at + dv].iter_mut().zip(dorow) {
                            *o += p * z * x;
                        }
                    }
                    FlashWrt::Q | FlashWrt::K if df != 0.0 => {
                        let ds = df * derivative.ds.eval(raw[j], &pos, env, &load).as_f();
                        let (at, other) = match wrt {
                            FlashWrt::Q => (row * d, g.krow(k, koff, j)),
                            _ => ((b * n + j) * d, qrow),
                        };
                        for (o, x) in out[at..at + d].iter_mut().zip(other) {
                            *o += ds * x;
                        }
                    }
                    FlashWrt::Extra(x) if df != 0.0 => {
                        let Some(t) = target else { continue };
                        let at_score = |e: &crate::ir::ScoreExpr| e.eval(raw[j], &pos, env, &load);
                        add_extra_gradient(&mut out, (t, &target_strides), derivative.loads.iter().filter(|l| l.input == x), df, &at_score);
                    }
                    _ => {}
                }
            }
        }
    }
    Ok(Val::new(dtype, shape, out))
}

/// Adds `dF · ∂F/∂x` of each of `loads` (loads of one extra operand `t`, row-major
/// `strides`) at the index it loads, evaluated at one score by `at_score`.
fn add_extra_gradient<'l>(
    out: &mut [f64],
    (t, strides): (&Val, &[usize]),
    loads: impl Iterator<Item = &'l crate::ir::grad::LoadGrad>,
    df: f64,
    at_score: &dyn Fn(&crate::ir::ScoreExpr) -> Scalar,
) {
    for l in loads {
        let mut at = 0;
        for (axis, e) in l.index.iter().enumerate() {
            let size = t.shape.get(axis).copied().unwrap_or(1).max(1);
            let ix = i64::from(at_score(e).as_i()).clamp(0, size as i64 - 1) as usize;
            at += ix * strides.get(axis).copied().unwrap_or(0);
        }
        if let Some(o) = out.get_mut(at) {
            *o += df * at_score(&l.d).as_f();
        }
    }
}
