//! Host tensors: the values the reference interpreter computes on and the runtime reads/writes.

use crate::ir::DType;
use thiserror::Error;

/// Element storage. `f16`/`bf16` tensors are stored as f32 values already rounded to their
/// storage type (the tensor's [`DType`] says which).
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    /// f32, f16 and bf16 tensors.
    F32(Vec<f32>),
    /// i32 tensors.
    I32(Vec<i32>),
    /// bool tensors.
    Bool(Vec<bool>),
}

/// A dense row-major tensor with a concrete shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Element type.
    pub dtype: DType,
    /// Size of each axis.
    pub shape: Vec<usize>,
    /// The elements, `shape.iter().product()` of them.
    pub data: TensorData,
}

/// Why a tensor could not be built.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum TensorError {
    /// Element count does not match the shape.
    #[error("shape {shape:?} needs {expected} elements, got {actual}")]
    Length {
        /// The shape.
        shape: Vec<usize>,
        /// Its element count.
        expected: usize,
        /// Elements given.
        actual: usize,
    },
    /// Storage kind does not match the dtype.
    #[error("{dtype} data cannot be stored as {storage}")]
    Storage {
        /// The dtype asked for.
        dtype: DType,
        /// What the data was.
        storage: &'static str,
    },
}

impl Tensor {
    /// A tensor from parts, checking the element count and that the storage fits the dtype
    /// (f16/bf16 values are rounded to their storage type).
    pub fn new(dtype: DType, shape: Vec<usize>, data: TensorData) -> Result<Tensor, TensorError> {
        let expected: usize = shape.iter().product();
        let (actual, storage) = match &data {
            TensorData::F32(v) => (v.len(), "f32"),
            TensorData::I32(v) => (v.len(), "i32"),
            TensorData::Bool(v) => (v.len(), "bool"),
        };
        if actual != expected {
            return Err(TensorError::Length { shape, expected, actual });
        }
        let fits = matches!(
            (dtype, &data),
            (DType::F32 | DType::F16 | DType::BF16, TensorData::F32(_))
                | (DType::I32, TensorData::I32(_))
                | (DType::Bool, TensorData::Bool(_))
        );
        if !fits {
            return Err(TensorError::Storage { dtype, storage });
        }
        let data = match (dtype, data) {
            (DType::F16 | DType::BF16, TensorData::F32(v)) => {
                TensorData::F32(v.into_iter().map(|x| dtype.round(f64::from(x)) as f32).collect())
            }
            (_, d) => d,
        };
        Ok(Tensor { dtype, shape, data })
    }

    /// An f32 tensor.
    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Result<Tensor, TensorError> {
        Tensor::new(DType::F32, shape, TensorData::F32(data))
    }

    /// An i32 tensor.
    pub fn i32(shape: Vec<usize>, data: Vec<i32>) -> Result<Tensor, TensorError> {
        Tensor::new(DType::I32, shape, TensorData::I32(data))
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` (row-major) as f64.
    pub fn get_f64(&self, i: usize) -> f64 {
        match &self.data {
            TensorData::F32(v) => f64::from(v[i]),
            TensorData::I32(v) => f64::from(v[i]),
            TensorData::Bool(v) => f64::from(u8::from(v[i])),
        }
    }

    /// Every element as f64 (convenient for tests and summaries).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        (0..self.len()).map(|i| self.get_f64(i)).collect()
    }

    /// A tensor of `dtype` from f64 values, rounding each to the dtype.
    pub fn from_f64(dtype: DType, shape: Vec<usize>, values: &[f64]) -> Result<Tensor, TensorError> {
        let data = match dtype {
            DType::F32 | DType::F16 | DType::BF16 => TensorData::F32(values.iter().map(|v| dtype.round(*v) as f32).collect()),
            DType::I32 => TensorData::I32(values.iter().map(|v| DType::I32.round(*v) as i32).collect()),
            DType::Bool => TensorData::Bool(values.iter().map(|v| *v != 0.0).collect()),
        };
        Tensor::new(dtype, shape, data)
    }
}

/// How far the outputs of one run (`got`) are from another's (`want`, usually the reference
/// interpreter's): same count, shapes and dtypes; floats within `rel` normwise (`max |got − want|
/// ≤ rel · max |want|`, the maximum taken at least `floor`; NaN matches NaN, an infinity must match
/// exactly), integers and bools exactly. `Ok` is the largest normwise error; `Err` describes the
/// first output out of tolerance and its worst element.
pub fn compare_outputs(got: &[Tensor], want: &[Tensor], rel: f64, floor: f64) -> Result<f64, String> {
    if got.len() != want.len() {
        return Err(format!("{} outputs, expected {}", got.len(), want.len()));
    }
    let mut worst_rel = 0.0f64;
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        if g.shape != w.shape || g.dtype != w.dtype {
            return Err(format!("output {k}: {} {:?}, expected {} {:?}", g.dtype, g.shape, w.dtype, w.shape));
        }
        let (gv, wv) = (g.to_f64_vec(), w.to_f64_vec());
        if !w.dtype.is_float() {
            if let Some(i) = (0..gv.len()).find(|i| gv[*i] != wv[*i]) {
                return Err(format!("output {k}: element {i} is {}, expected {}", gv[i], wv[i]));
            }
            continue;
        }
        let scale = wv.iter().filter(|x| x.is_finite()).fold(0.0f64, |m, x| m.max(x.abs())).max(floor);
        let mut worst = (0.0f64, 0usize);
        for (i, (a, b)) in gv.iter().zip(&wv).enumerate() {
            let err = if (a.is_nan() && b.is_nan()) || a == b {
                0.0
            } else if a.is_nan() || b.is_nan() || a.is_infinite() || b.is_infinite() {
                f64::INFINITY
            } else {
                (a - b).abs()
            };
            if err > worst.0 {
                worst = (err, i);
            }
        }
        let err = worst.0 / scale;
        worst_rel = worst_rel.max(err);
        if err > rel {
            let i = worst.1;
            return Err(format!(
                "output {k} ({} {:?}): element {i} is {:e}, expected {:e} (error {err:.3e} of max |expected| = {scale:.3e})",
                w.dtype, w.shape, gv[i], wv[i]
            ));
        }
    }
    Ok(worst_rel)
}
