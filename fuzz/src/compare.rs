//! Checks shared by the targets: file tensors (`npy`, `safetensors`) and run outputs
//! (`differential`).

use attn_runtime::io::{FileData, FileTensor, convert, decode_npy, decode_safetensors, encode_npy, encode_safetensors};
use attn_runtime::{DType, Tensor};

/// Normwise relative tolerance of `differential`: `max |cpu - interp| ≤ REL · max |interp|`
/// (the test suite's f32 tolerance, `attn_tests::F32_TOLERANCE`).
pub const REL: f64 = 1e-4;

/// The smallest `max |interp|` the error is measured against (all-zero outputs).
pub const FLOOR: f64 = 1e-6;

/// Every dtype a parameter can be declared with.
const DTYPES: [DType; 5] = [DType::F32, DType::F16, DType::BF16, DType::I32, DType::Bool];

/// A tensor a reader returned: its element count must match its shape; converting it to any
/// declared dtype returns a tensor or a typed error; a converted tensor written as `.npy` and as
/// `.safetensors` reads back with the same shape and values.
pub fn check_file_tensor(name: &str, tensor: FileTensor) {
    let len = match &tensor.data {
        FileData::F32(v) => v.len(),
        FileData::F64(v) => v.len(),
        FileData::I64(v) => v.len(),
        FileData::Bool(v) => v.len(),
    };
    let count = tensor.shape.iter().try_fold(1usize, |acc, d| acc.checked_mul(*d));
    assert_eq!(count, Some(len), "a reader returned shape {:?} with {len} elements", tensor.shape);
    for dtype in DTYPES {
        let Ok(t) = convert(name, tensor.clone(), dtype) else { continue };
        assert_eq!(t.dtype, dtype);
        round_trip(name, &t);
    }
}

/// Writes `t` as `.npy` and as `.safetensors` and reads it back.
fn round_trip(name: &str, t: &Tensor) {
    if let Ok(bytes) = encode_npy(t) {
        let back = decode_npy(&bytes).unwrap_or_else(|e| panic!("a .npy file attnc wrote does not read back: {e}"));
        // `.npy` has no bf16: it is written as f32.
        let dtype = if t.dtype == DType::BF16 { DType::F32 } else { t.dtype };
        let back = convert(name, back, dtype).unwrap_or_else(|e| panic!("a .npy file attnc wrote does not convert back: {e}"));
        assert_same(t, &back, ".npy");
    }
    if let Ok(bytes) = encode_safetensors(&[(name, t)]) {
        let back = decode_safetensors(&bytes).unwrap_or_else(|e| panic!("a .safetensors file attnc wrote does not read back: {e}"));
        assert_eq!(back.len(), 1, "one tensor written, {} read back", back.len());
        let (back_name, back) = back.into_iter().next().unwrap_or_else(|| unreachable!());
        assert_eq!(back_name, name);
        let back = convert(name, back, t.dtype).unwrap_or_else(|e| panic!("a .safetensors file attnc wrote does not convert back: {e}"));
        assert_same(t, &back, ".safetensors");
    }
}

/// Same shape and values (NaN equals NaN, whatever its payload).
fn assert_same(want: &Tensor, got: &Tensor, format: &str) {
    assert_eq!(want.shape, got.shape, "{format} round trip changed the shape");
    let (w, g) = (want.to_f64_vec(), got.to_f64_vec());
    for (i, (a, b)) in w.iter().zip(&g).enumerate() {
        let same = (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits();
        assert!(same, "{format} round trip changed element {i} of a {} tensor: {a:e} became {b:e}", want.dtype);
    }
}

/// [`attn_compiler::tensor::compare_outputs`] within [`REL`] of the interpreter's.
pub fn compare_outputs(got: &[Tensor], want: &[Tensor]) -> Result<f64, String> {
    attn_compiler::tensor::compare_outputs(got, want, REL, FLOOR)
}
