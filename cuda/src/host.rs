//! Host tensors to and from the device's storage bytes (f32, f16 and bf16 bit patterns, i32,
//! one byte per bool; little-endian, as every CUDA device is).

use attn_compiler::ir::DType;
use attn_compiler::tensor::{Tensor, TensorData, TensorError};

/// The bytes a tensor is stored as on the device.
pub(super) fn to_bytes(t: &Tensor) -> Vec<u8> {
    match (&t.data, t.dtype) {
        (TensorData::F32(v), DType::F16) => v.iter().flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes()).collect(),
        (TensorData::F32(v), DType::BF16) => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes()).collect(),
        (TensorData::F32(v), _) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        (TensorData::I32(v), _) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        (TensorData::Bool(v), _) => v.iter().map(|b| u8::from(*b)).collect(),
    }
}

/// A tensor from device storage bytes (at least as many as the shape needs).
pub(super) fn from_bytes(dtype: DType, shape: Vec<usize>, bytes: &[u8]) -> Result<Tensor, TensorError> {
    let n: usize = shape.iter().product();
    let data = match dtype {
        DType::F32 => TensorData::F32(bytes.chunks_exact(4).take(n).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
        DType::F16 => TensorData::F32(bytes.chunks_exact(2).take(n).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()),
        DType::BF16 => TensorData::F32(bytes.chunks_exact(2).take(n).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()),
        DType::I32 => TensorData::I32(bytes.chunks_exact(4).take(n).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
        DType::Bool => TensorData::Bool(bytes.iter().take(n).map(|b| *b != 0).collect()),
    };
    Tensor::new(dtype, shape, data)
}

/// The four i32 words of a fault record read back as bytes (zeros where short).
pub(crate) fn fault_words(bytes: &[u8]) -> [i32; 4] {
    let mut words = [0i32; 4];
    for (w, chunk) in words.iter_mut().zip(bytes.chunks_exact(4)) {
        *w = i32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let t = Tensor::new(dtype, vec![2, 2], TensorData::F32(vec![1.5, -2.25, 0.0, 65504.0])).unwrap();
            let back = from_bytes(dtype, vec![2, 2], &to_bytes(&t)).unwrap();
            assert_eq!(back, t, "{dtype}");
        }
        let t = Tensor::i32(vec![3], vec![-1, 7, i32::MAX]).unwrap();
        assert_eq!(from_bytes(DType::I32, vec![3], &to_bytes(&t)).unwrap(), t);
        let t = Tensor::new(DType::Bool, vec![2], TensorData::Bool(vec![true, false])).unwrap();
        assert_eq!(to_bytes(&t), vec![1, 0]);
        assert_eq!(from_bytes(DType::Bool, vec![2], &[1, 0]).unwrap(), t);
        // f16 bits: 1.0 is 0x3c00.
        let one = Tensor::new(DType::F16, vec![1], TensorData::F32(vec![1.0])).unwrap();
        assert_eq!(to_bytes(&one), vec![0x00, 0x3c]);
    }
}
