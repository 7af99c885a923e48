//! Seeded random inputs for an entry point, so that a program can be run without data files.
//!
//! Dims: every dim name not given (by `--dim` / `RunOptions::dims` of the runtime) gets
//! [`DEFAULT_DIM`] (8); dims written as expressions (`H*Dh`, `S+1`) are then computed from their
//! names. Values: floats are N(0, 1); i32 inputs are segment ids, non-decreasing along the last
//! axis with values in `[0, 4)` (so document masks see sorted segments, and any gather stays in
//! range after clamping); bools are, in each matrix of the last two axes, true on one span per
//! row that moves by 0 or 1 per row (causal, window, padding and constant masks: whole blocks
//! true or false, so that a mask read from data classifies some tiles as skipped or full) and
//! false elsewhere, one row in eight with a bit flipped (ragged edges). The same seed, entry and dims always give the same
//! tensors.

use crate::ir::{DType, TensorType};
use crate::tensor::{Tensor, TensorData, TensorError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use std::collections::HashMap;
use thiserror::Error;

/// The size given to every dim that is neither given nor fixed in the file.
pub const DEFAULT_DIM: i64 = 8;

/// Segment ids of random i32 inputs lie in `[0, SEGMENTS)`.
pub const SEGMENTS: i32 = 4;

/// Largest tensor (in elements) random inputs will allocate; larger dims are surely a typo.
pub const MAX_ELEMENTS: usize = 1 << 28;

/// Why random inputs could not be made.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum RandomError {
    /// A dim expression of a parameter evaluates below zero (e.g. `S-10` with `S = 8`).
    #[error("input `{param}` has dim `{dim}` = {value} under the chosen dims; give larger dims with --dim")]
    NegativeDim {
        /// The parameter.
        param: String,
        /// The dim as written.
        dim: String,
        /// Its value.
        value: i64,
    },
    /// The tensor would be unreasonably large.
    #[error("input `{param}` would have shape {shape:?}, more than {MAX_ELEMENTS} elements")]
    TooLarge {
        /// The parameter.
        param: String,
        /// Its shape.
        shape: Vec<u64>,
    },
    /// Internal: the generated data did not fit the shape.
    #[error("input `{param}`: {source}")]
    Tensor {
        /// The parameter.
        param: String,
        /// Why.
        #[source]
        source: TensorError,
    },
}

/// The dims random inputs use: `given`, plus [`DEFAULT_DIM`] for every other name in a
/// parameter's shape.
pub fn choose_dims(params: &[(String, TensorType)], given: &HashMap<String, i64>) -> HashMap<String, i64> {
    let mut env = given.clone();
    for (_, ty) in params {
        for dim in &ty.shape {
            for name in dim.symbols() {
                env.entry(name).or_insert(DEFAULT_DIM);
            }
        }
    }
    env
}

/// Concrete shapes of the parameters under `env` (which must bind every name, as
/// [`choose_dims`] makes it).
pub fn concrete_shapes(params: &[(String, TensorType)], env: &HashMap<String, i64>) -> Result<Vec<Vec<usize>>, RandomError> {
    params
        .iter()
        .map(|(name, ty)| {
            let mut shape = Vec::with_capacity(ty.shape.len());
            for dim in &ty.shape {
                // `choose_dims` bound every name, so an unbound one only comes from a caller's env;
                // treat it as the default rather than failing.
                let value = dim.eval(env).unwrap_or(DEFAULT_DIM);
                let size =
                    usize::try_from(value).map_err(|_| RandomError::NegativeDim { param: name.clone(), dim: dim.to_string(), value })?;
                shape.push(size);
            }
            let total = shape.iter().try_fold(1usize, |acc, d| acc.checked_mul(*d));
            if total.is_none_or(|t| t > MAX_ELEMENTS) {
                return Err(RandomError::TooLarge { param: name.clone(), shape: shape.iter().map(|d| *d as u64).collect() });
            }
            Ok(shape)
        })
        .collect()
}

/// Random inputs for `params` (see the module docs for the distributions and dims).
pub fn random_inputs(
    params: &[(String, TensorType)],
    seed: u64,
    given: &HashMap<String, i64>,
) -> Result<Vec<(String, Tensor)>, RandomError> {
    let env = choose_dims(params, given);
    let shapes = concrete_shapes(params, &env)?;
    let mut out = Vec::with_capacity(params.len());
    for (index, ((name, ty), shape)) in params.iter().zip(shapes).enumerate() {
        // One stream per parameter, so changing one input's shape leaves the others' values alone.
        let mut rng = StdRng::seed_from_u64(seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let len: usize = shape.iter().product();
        let data = match ty.dtype {
            DType::F32 | DType::F16 | DType::BF16 => TensorData::F32((0..len).map(|_| StandardNormal.sample(&mut rng)).collect()),
            DType::I32 => TensorData::I32(segment_ids(&mut rng, len, shape.last().copied().unwrap_or(1))),
            DType::Bool => {
                let (rows, width) = match shape.as_slice() {
                    [.., r, w] => (*r, *w),
                    [w] => (1, *w),
                    [] => (1, 1),
                };
                TensorData::Bool(mask_rows(&mut rng, len, (rows, width)))
            }
        };
        let tensor = Tensor::new(ty.dtype, shape, data).map_err(|source| RandomError::Tensor { param: name.clone(), source })?;
        out.push((name.clone(), tensor));
    }
    Ok(out)
}

/// `len` bools in matrices of `rows × width` (the last two axes): in each, row `i` true on
/// `[lo + a·i, hi + b·i)` (clamped; `a`, `b` 0 or 1, so causal, window, padding and constant
/// spans) and false elsewhere, and one row in eight with one value flipped.
fn mask_rows(rng: &mut StdRng, len: usize, (rows, width): (usize, usize)) -> Vec<bool> {
    let (rows, width) = (rows.max(1), width.max(1));
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let (lo, hi) = (rng.random_range(0..=width), rng.random_range(0..=width));
        let (a, b) = (usize::from(rng.random_bool(0.5)), usize::from(rng.random_bool(0.5)));
        for i in 0..rows {
            let (l, h) = ((lo + a * i).min(width), (hi + b * i).min(width));
            let flip = if rng.random_bool(1.0 / 8.0) { Some(rng.random_range(0..width)) } else { None };
            for x in 0..width {
                if out.len() == len {
                    return out;
                }
                out.push((l <= x && x < h) != (flip == Some(x)));
            }
        }
    }
    out
}

/// `len` ids in rows of `row` (the last axis), each row sorted, values in `[0, SEGMENTS)`.
fn segment_ids(rng: &mut StdRng, len: usize, row: usize) -> Vec<i32> {
    let mut ids: Vec<i32> = (0..len).map(|_| rng.random_range(0..SEGMENTS)).collect();
    if row > 0 {
        for chunk in ids.chunks_mut(row) {
            chunk.sort_unstable();
        }
    }
    ids
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Dim;

    fn ty(dtype: DType, dims: &[&str]) -> TensorType {
        TensorType::new(dtype, dims.iter().map(|d| Dim::parse(d).unwrap()).collect())
    }

    fn params() -> Vec<(String, TensorType)> {
        vec![
            ("x".to_string(), ty(DType::F32, &["B", "S", "H*Dh"])),
            ("seg".to_string(), ty(DType::I32, &["B", "S"])),
            ("m".to_string(), ty(DType::Bool, &["S", "S+1"])),
            ("h".to_string(), ty(DType::F16, &[])),
        ]
    }

    #[test]
    fn same_seed_same_tensors_other_seed_other_tensors() {
        let given = HashMap::from([("H".to_string(), 2)]);
        let a = random_inputs(&params(), 7, &given).unwrap();
        let b = random_inputs(&params(), 7, &given).unwrap();
        let c = random_inputs(&params(), 8, &given).unwrap();
        assert_eq!(a, b);
        assert_ne!(a[0].1, c[0].1);
    }

    #[test]
    fn shapes_use_given_dims_then_the_default() {
        let given = HashMap::from([("H".to_string(), 2), ("S".to_string(), 3)]);
        let inputs = random_inputs(&params(), 1, &given).unwrap();
        let shapes: Vec<Vec<usize>> = inputs.iter().map(|(_, t)| t.shape.clone()).collect();
        assert_eq!(shapes, vec![vec![8, 3, 16], vec![8, 3], vec![3, 4], vec![]]);
        let names: Vec<&str> = inputs.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["x", "seg", "m", "h"]);
    }

    #[test]
    fn bool_masks_have_whole_blocks_of_each_value_and_mixed_ones() {
        // Over a few seeds, 16 × 16 blocks that are all true, all false and mixed all occur, as
        // tile classification from data needs to be exercised.
        let p = vec![("m".to_string(), ty(DType::Bool, &["B", "L", "S"]))];
        let given = HashMap::from([("B".to_string(), 2), ("L".to_string(), 64), ("S".to_string(), 64)]);
        let mut seen = [false; 3];
        for seed in 0..8 {
            let inputs = random_inputs(&p, seed, &given).unwrap();
            let TensorData::Bool(v) = &inputs[0].1.data else { panic!("bools") };
            for (b, y, x) in (0..2).flat_map(|b| (0..4).flat_map(move |y| (0..4).map(move |x| (b, y, x)))) {
                let trues = (0..256).filter(|e| v[b * 4096 + (y * 16 + e / 16) * 64 + x * 16 + e % 16]).count();
                seen[if trues == 0 {
                    0
                } else if trues == 256 {
                    1
                } else {
                    2
                }] = true;
            }
        }
        assert_eq!(seen, [true; 3]);
    }

    #[test]
    fn floats_look_standard_normal() {
        let p = vec![("x".to_string(), ty(DType::F32, &["N"]))];
        let inputs = random_inputs(&p, 3, &HashMap::from([("N".to_string(), 20000)])).unwrap();
        let v = inputs[0].1.to_f64_vec();
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "var {var}");
    }

    #[test]
    fn segment_ids_are_sorted_per_row_and_in_range() {
        let inputs = random_inputs(&params(), 5, &HashMap::new()).unwrap();
        let seg = &inputs[1].1;
        let TensorData::I32(v) = &seg.data else { panic!("not i32") };
        for row in v.chunks(8) {
            assert!(row.windows(2).all(|w| w[0] <= w[1]), "{row:?}");
            assert!(row.iter().all(|x| (0..SEGMENTS).contains(x)), "{row:?}");
        }
        assert!(v.iter().any(|x| *x != v[0]), "all ids equal: {v:?}");
    }

    #[test]
    fn f16_inputs_are_rounded_to_f16() {
        let inputs = random_inputs(&params(), 5, &HashMap::new()).unwrap();
        let h = inputs[3].1.to_f64_vec()[0];
        assert_eq!(h, DType::F16.round(h));
    }

    #[test]
    fn negative_and_huge_dims_are_errors() {
        let p = vec![("x".to_string(), ty(DType::F32, &["S-10"]))];
        assert!(matches!(random_inputs(&p, 0, &HashMap::new()), Err(RandomError::NegativeDim { value: -2, .. })));
        let q = vec![("x".to_string(), ty(DType::F32, &["A", "A"]))];
        let given = HashMap::from([("A".to_string(), 1 << 20)]);
        assert!(matches!(random_inputs(&q, 0, &given), Err(RandomError::TooLarge { .. })));
    }
}
