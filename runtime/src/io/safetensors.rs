//! The `.safetensors` format: a JSON header of named tensors followed by their little-endian data.
//!
//! The `safetensors` crate validates the header (offsets, sizes, overflow) before anything is
//! read, so a corrupt file becomes an error, never a panic.

use super::{FileDType, FileData, FileTensor, IoErrorKind};
use attn_compiler::ir::DType;
use attn_compiler::tensor::{Tensor, TensorData};
use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors, TensorView};

/// Parses the bytes of a `.safetensors` file; the tensors come sorted by name.
pub fn decode_safetensors(bytes: &[u8]) -> Result<Vec<(String, FileTensor)>, IoErrorKind> {
    let file = SafeTensors::deserialize(bytes).map_err(|e| read_error(e, bytes.len()))?;
    let mut out = Vec::new();
    for (name, view) in file.tensors() {
        let data = view.data();
        let (dtype, values) = match view.dtype() {
            Dtype::F32 => (FileDType::F32, FileData::F32(le(data, f32::from_le_bytes))),
            Dtype::F16 => (FileDType::F16, FileData::F32(le(data, |b| half::f16::from_le_bytes(b).to_f32()))),
            Dtype::BF16 => (FileDType::BF16, FileData::F32(le(data, |b| half::bf16::from_le_bytes(b).to_f32()))),
            Dtype::F64 => (FileDType::F64, FileData::F64(le(data, f64::from_le_bytes))),
            Dtype::I32 => (FileDType::I32, FileData::I64(le(data, |b| i64::from(i32::from_le_bytes(b))))),
            Dtype::I64 => (FileDType::I64, FileData::I64(le(data, i64::from_le_bytes))),
            Dtype::BOOL => (FileDType::Bool, FileData::Bool(data.iter().map(|b| *b != 0).collect())),
            other => return Err(IoErrorKind::UnsupportedDType(format!("{other:?} (tensor `{name}`)"))),
        };
        out.push((name, FileTensor { dtype, shape: view.shape().to_vec(), data: values }));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Decodes little-endian elements; the crate has checked that the length fits the shape.
fn le<T, const N: usize>(data: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
    data.chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            f(a)
        })
        .collect()
}

/// Sorts the crate's errors into "truncated" and "not a safetensors file".
fn read_error(e: SafeTensorError, file_len: usize) -> IoErrorKind {
    match e {
        SafeTensorError::HeaderTooSmall => IoErrorKind::Truncated(format!("{file_len} bytes is too short for a .safetensors header")),
        SafeTensorError::MetadataIncompleteBuffer => IoErrorKind::Truncated("the data section is not the size the header announces".into()),
        SafeTensorError::InvalidHeaderLength => {
            IoErrorKind::NotSafetensors("the header length is larger than the file (truncated or not a .safetensors file)".into())
        }
        other => IoErrorKind::NotSafetensors(other.to_string()),
    }
}

/// Encodes named tensors as `.safetensors` bytes, each in its own dtype.
pub fn encode_safetensors(tensors: &[(&str, &Tensor)]) -> Result<Vec<u8>, IoErrorKind> {
    let mut names = std::collections::HashSet::new();
    let mut encoded: Vec<(&str, Dtype, &[usize], Vec<u8>)> = Vec::new();
    for (name, t) in tensors {
        if !names.insert(*name) {
            return Err(IoErrorKind::Unencodable(format!("two tensors are named `{name}`")));
        }
        let (dtype, bytes): (Dtype, Vec<u8>) = match (&t.data, t.dtype) {
            (TensorData::F32(v), DType::F16) => (Dtype::F16, v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect()),
            (TensorData::F32(v), DType::BF16) => (Dtype::BF16, v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect()),
            (TensorData::F32(v), _) => (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            (TensorData::I32(v), _) => (Dtype::I32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            (TensorData::Bool(v), _) => (Dtype::BOOL, v.iter().map(|b| u8::from(*b)).collect()),
        };
        encoded.push((name, dtype, &t.shape, bytes));
    }
    let mut views = Vec::with_capacity(encoded.len());
    for (name, dtype, shape, bytes) in &encoded {
        let view = TensorView::new(*dtype, shape.to_vec(), bytes).map_err(|e| IoErrorKind::Unencodable(format!("`{name}`: {e}")))?;
        views.push((*name, view));
    }
    safetensors::serialize(views, None).map_err(|e| IoErrorKind::Unencodable(e.to_string()))
}
