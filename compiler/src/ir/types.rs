//! Element types and tensor types.

use super::dim::Dim;
use std::fmt;

/// Element type of a tensor. `f16`/`bf16` are storage types: values are rounded to them when
/// stored, arithmetic is done in f32 (the reference interpreter accumulates sums in f64).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// IEEE single precision (the default).
    F32,
    /// IEEE half precision (storage).
    F16,
    /// bfloat16 (storage).
    BF16,
    /// 32-bit signed integer: indices, positions, segment ids.
    I32,
    /// Result of comparisons; operand of `where`.
    Bool,
}

impl DType {
    /// The name used in source and IR text.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::Bool => "bool",
        }
    }

    /// Inverse of [`DType::name`].
    pub fn from_name(name: &str) -> Option<DType> {
        Some(match name {
            "f32" => DType::F32,
            "f16" => DType::F16,
            "bf16" => DType::BF16,
            "i32" => DType::I32,
            "bool" => DType::Bool,
            _ => return None,
        })
    }

    /// f32, f16 or bf16.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// The type of arithmetic between two numeric operands: equal float types stay, mixed
    /// floats widen to f32, int with float gives the float, int with int stays int.
    pub fn promote(self, other: DType) -> DType {
        match (self, other) {
            (a, b) if a == b => a,
            (DType::I32 | DType::Bool, f) | (f, DType::I32 | DType::Bool) if f.is_float() => f,
            (DType::I32, DType::Bool) | (DType::Bool, DType::I32) => DType::I32,
            _ => DType::F32,
        }
    }

    /// Rounds an f64 value to what this type can store.
    pub fn round(self, v: f64) -> f64 {
        match self {
            DType::F32 => v as f32 as f64,
            DType::F16 => half::f16::from_f64(v).to_f64(),
            DType::BF16 => half::bf16::from_f64(v).to_f64(),
            DType::I32 => {
                if v.is_nan() {
                    0.0
                } else {
                    v.trunc().clamp(i32::MIN as f64, i32::MAX as f64)
                }
            }
            DType::Bool => f64::from(u8::from(v != 0.0)),
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A tensor's element type and symbolic shape. A scalar has an empty shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// One symbolic dim per axis.
    pub shape: Vec<Dim>,
}

impl TensorType {
    /// A type from parts.
    pub fn new(dtype: DType, shape: Vec<Dim>) -> TensorType {
        TensorType { dtype, shape }
    }

    /// A scalar of the given type.
    pub fn scalar(dtype: DType) -> TensorType {
        TensorType { dtype, shape: Vec::new() }
    }

    /// Number of axes.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
}

impl fmt::Display for TensorType {
    /// `f32[B, H, S, D]`; a scalar prints as `f32[]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (n, d) in self.shape.iter().enumerate() {
            if n > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// Broadcasts two shapes numpy-style (aligned at the right; a dim of 1 stretches).
/// Returns `None` when two dims differ and neither is 1.
pub fn broadcast_shapes(a: &[Dim], b: &[Dim]) -> Option<Vec<Dim>> {
    let rank = a.len().max(b.len());
    let one = Dim::constant(1);
    let mut out = Vec::with_capacity(rank);
    for axis in 0..rank {
        let da = (axis + a.len()).checked_sub(rank).map_or(&one, |i| &a[i]);
        let db = (axis + b.len()).checked_sub(rank).map_or(&one, |i| &b[i]);
        out.push(if da == db || *db == one {
            da.clone()
        } else if *da == one {
            db.clone()
        } else {
            return None;
        });
    }
    Some(out)
}
