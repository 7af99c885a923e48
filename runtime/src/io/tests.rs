//! Round trips, corrupt files and dtype conversion of the tensor file readers and writers.

use super::*;
use attn_compiler::tensor::TensorData;

/// A fresh directory under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("attn-runtime-io-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn f32_tensor() -> Tensor {
    Tensor::f32(vec![2, 3], vec![1.0, -2.5, 3.25, 0.0, 1e-8, -7.0]).unwrap()
}

/// `.npy` bytes with the given header dict and data, as numpy writes them (v1, padded to 64).
fn npy_bytes(dict: &str, data: &[u8]) -> Vec<u8> {
    let mut header = dict.to_string();
    while !(10 + header.len() + 1).is_multiple_of(64) {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

#[test]
fn npy_f32_round_trip_and_npyz_reads_it() {
    let t = f32_tensor();
    let bytes = encode_npy(&t).unwrap();
    let back = decode_npy(&bytes).unwrap();
    assert_eq!(back.dtype, FileDType::F32);
    assert_eq!(convert("x", back, DType::F32).unwrap(), t);
    // Cross-check the writer against an independent reader.
    let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
    assert_eq!(npy.shape(), &[2, 3]);
    assert_eq!(npy.into_vec::<f32>().unwrap(), vec![1.0, -2.5, 3.25, 0.0, 1e-8, -7.0]);
}

#[test]
fn npy_f16_round_trip() {
    let t = Tensor::new(DType::F16, vec![3], TensorData::F32(vec![0.1, 65504.0, -3.0])).unwrap();
    let bytes = encode_npy(&t).unwrap();
    let back = decode_npy(&bytes).unwrap();
    assert_eq!(back.dtype, FileDType::F16);
    assert_eq!(convert("x", back.clone(), DType::F16).unwrap(), t);
    // f16 widens to f32 exactly.
    let wide = convert("x", back, DType::F32).unwrap();
    assert_eq!(wide.dtype, DType::F32);
    assert_eq!(wide.to_f64_vec(), t.to_f64_vec());
}

#[test]
fn npy_i32_bool_and_scalar_round_trip() {
    let i = Tensor::i32(vec![2, 2], vec![0, -1, i32::MAX, i32::MIN]).unwrap();
    assert_eq!(convert("i", decode_npy(&encode_npy(&i).unwrap()).unwrap(), DType::I32).unwrap(), i);
    let b = Tensor::new(DType::Bool, vec![3], TensorData::Bool(vec![true, false, true])).unwrap();
    assert_eq!(convert("b", decode_npy(&encode_npy(&b).unwrap()).unwrap(), DType::Bool).unwrap(), b);
    let s = Tensor::f32(vec![], vec![4.5]).unwrap();
    assert_eq!(convert("s", decode_npy(&encode_npy(&s).unwrap()).unwrap(), DType::F32).unwrap(), s);
}

#[test]
fn npy_bf16_is_written_as_f32() {
    let t = Tensor::new(DType::BF16, vec![2], TensorData::F32(vec![1.5, -0.25])).unwrap();
    let back = decode_npy(&encode_npy(&t).unwrap()).unwrap();
    assert_eq!(back.dtype, FileDType::F32);
    assert_eq!(back.data, FileData::F32(vec![1.5, -0.25]));
}

#[test]
fn npy_f64_and_i64_as_numpy_writes_them() {
    let data: Vec<u8> = [1.5f64, -2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    let f = decode_npy(&npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", &data)).unwrap();
    assert_eq!(f.dtype, FileDType::F64);
    assert_eq!(convert("x", f, DType::F32).unwrap().to_f64_vec(), vec![1.5, -2.0]);

    let data: Vec<u8> = [3i64, -4].iter().flat_map(|x| x.to_le_bytes()).collect();
    let i = decode_npy(&npy_bytes("{'descr': '<i8', 'fortran_order': False, 'shape': (1, 2), }", &data)).unwrap();
    assert_eq!(convert("seg", i, DType::I32).unwrap(), Tensor::i32(vec![1, 2], vec![3, -4]).unwrap());
}

#[test]
fn npy_big_endian_is_read() {
    let data: Vec<u8> = [1.25f32, -3.0].iter().flat_map(|x| x.to_be_bytes()).collect();
    let f = decode_npy(&npy_bytes("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", &data)).unwrap();
    assert_eq!(f.data, FileData::F32(vec![1.25, -3.0]));
}

#[test]
fn npy_fortran_order_is_rejected() {
    let data = [0u8; 16];
    let err = decode_npy(&npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", &data)).unwrap_err();
    assert!(matches!(err, IoErrorKind::FortranOrder), "{err}");
    assert!(err.to_string().contains("Fortran"));
}

#[test]
fn npy_unsupported_dtypes() {
    for descr in ["<u2", "<c8", "|S3", "<M8[s]"] {
        let err =
            decode_npy(&npy_bytes(&format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': (1,), }}"), &[0; 16])).unwrap_err();
        assert!(matches!(&err, IoErrorKind::UnsupportedDType(d) if d == descr), "{descr}: {err}");
    }
    let err =
        decode_npy(&npy_bytes("{'descr': [('a', '<f4'), ('b', '<i4')], 'fortran_order': False, 'shape': (1,), }", &[0; 8])).unwrap_err();
    assert!(matches!(err, IoErrorKind::UnsupportedDType(_)), "{err}");
}

#[test]
fn npy_truncated_at_every_length_is_an_error() {
    let bytes = encode_npy(&f32_tensor()).unwrap();
    for cut in 0..bytes.len() {
        let err = decode_npy(&bytes[..cut]).unwrap_err();
        assert!(matches!(err, IoErrorKind::Truncated(_) | IoErrorKind::NotNpy(_)), "cut at {cut}: {err}");
    }
    // Cutting into the data section is reported as truncation, with the sizes.
    let err = decode_npy(&bytes[..bytes.len() - 1]).unwrap_err();
    assert!(matches!(&err, IoErrorKind::Truncated(m) if m.contains("24")), "{err}");
}

#[test]
fn npy_garbage_is_an_error_not_a_panic() {
    assert!(matches!(decode_npy(b"hello world, not numpy"), Err(IoErrorKind::NotNpy(_))));
    let cases = [
        "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999, 99999999999, 99999999999), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': ('a',), }",
        "{'descr': '<f4', 'fortran_order': 3, 'shape': (1,), }",
        "{'descr': '<f4', 'shape': (1,), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1,)",
        "((((((((((((((((((((((((((((((((((((((((",
        "{'descr: '<f4'}",
        "[1, 2, 3]",
        "",
    ];
    for dict in cases {
        let err = decode_npy(&npy_bytes(dict, &[0; 8])).unwrap_err();
        assert!(matches!(err, IoErrorKind::NotNpy(_)), "{dict}: {err}");
    }
    // A header length pointing past the end.
    let mut bytes = b"\x93NUMPY\x02\x00".to_vec();
    bytes.extend(u32::MAX.to_le_bytes());
    assert!(matches!(decode_npy(&bytes), Err(IoErrorKind::Truncated(_))));
    assert!(matches!(decode_npy(b"\x93NUMPY\x09\x00"), Err(IoErrorKind::NotNpy(_))));
}

#[test]
fn npy_every_single_byte_corruption_is_handled() {
    let bytes = encode_npy(&f32_tensor()).unwrap();
    for i in 0..bytes.len() {
        for v in [0u8, b'(', b'\'', 0xff] {
            let mut b = bytes.clone();
            b[i] = v;
            let _ = decode_npy(&b);
        }
    }
}

#[test]
fn safetensors_multi_tensor_round_trip() {
    let dir = TempDir::new("st");
    let path = dir.path("weights.safetensors");
    let q = f32_tensor();
    let seg = Tensor::i32(vec![4], vec![0, 0, 1, 2]).unwrap();
    let h = Tensor::new(DType::F16, vec![2], TensorData::F32(vec![0.5, 2.0])).unwrap();
    let b = Tensor::new(DType::BF16, vec![1, 2], TensorData::F32(vec![1.0, -8.0])).unwrap();
    let m = Tensor::new(DType::Bool, vec![2], TensorData::Bool(vec![false, true])).unwrap();
    write_safetensors(&path, &[("q", &q), ("seg", &seg), ("h", &h), ("b", &b), ("m", &m)]).unwrap();
    let all = read_safetensors(&path).unwrap();
    let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["b", "h", "m", "q", "seg"]);
    let declared = [DType::BF16, DType::F16, DType::Bool, DType::F32, DType::I32];
    let expected = [&b, &h, &m, &q, &seg];
    for (((name, ft), dt), want) in all.into_iter().zip(declared).zip(expected) {
        assert_eq!(&convert(&name, ft, dt).unwrap(), want, "{name}");
    }
    let one = read_safetensors_tensor(&path, "seg").unwrap();
    assert_eq!(one.dtype, FileDType::I32);
    let err = read_safetensors_tensor(&path, "k").unwrap_err();
    assert!(matches!(&err.kind, IoErrorKind::MissingTensor { name, .. } if name == "k"));
    assert!(err.to_string().contains("b, h, m, q, seg"), "{err}");
}

#[test]
fn safetensors_f64_and_i64_are_read() {
    let f: Vec<u8> = [0.5f64, 1.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    let i: Vec<u8> = [7i64, 1 << 40].iter().flat_map(|x| x.to_le_bytes()).collect();
    let views = vec![
        ("f", ::safetensors::tensor::TensorView::new(::safetensors::Dtype::F64, vec![2], &f).unwrap()),
        ("i", ::safetensors::tensor::TensorView::new(::safetensors::Dtype::I64, vec![2], &i).unwrap()),
    ];
    let bytes = ::safetensors::serialize(views, None).unwrap();
    let all = decode_safetensors(&bytes).unwrap();
    assert_eq!(all[0].1.data, FileData::F64(vec![0.5, 1.0]));
    let err = convert("idx", all[1].1.clone(), DType::I32).unwrap_err();
    assert_eq!(err, ConvertError::OutOfRange { param: "idx".into(), value: 1 << 40 });
}

#[test]
fn safetensors_corrupt_files() {
    let q = f32_tensor();
    let bytes = encode_safetensors(&[("q", &q)]).unwrap();
    for cut in 0..bytes.len() {
        let err = decode_safetensors(&bytes[..cut]).unwrap_err();
        assert!(matches!(err, IoErrorKind::Truncated(_) | IoErrorKind::NotSafetensors(_)), "cut at {cut}: {err}");
    }
    assert!(matches!(decode_safetensors(b"garbage!garbage!garbage!"), Err(IoErrorKind::NotSafetensors(_))));
    let mut b = 12u64.to_le_bytes().to_vec();
    b.extend(b"{\"a\": 3}    ");
    assert!(matches!(decode_safetensors(&b), Err(IoErrorKind::NotSafetensors(_))));
    for i in 0..bytes.len() {
        let mut b = bytes.clone();
        b[i] ^= 0x5a;
        let _ = decode_safetensors(&b);
    }
}

#[test]
fn dtype_conversion_errors_name_param_and_dtypes() {
    let f = decode_npy(&encode_npy(&f32_tensor()).unwrap()).unwrap();
    let err = convert("q", f.clone(), DType::F16).unwrap_err();
    assert_eq!(err, ConvertError::DType { param: "q".into(), file: FileDType::F32, declared: DType::F16 });
    let text = err.to_string();
    assert!(text.contains("`q`") && text.contains("f16") && text.contains("f32"), "{text}");
    assert!(text.contains(".astype"), "{text}");
    // numpy cannot make bf16 data: the advice for a bf16 parameter names what works instead.
    let text = convert("q", f.clone(), DType::BF16).unwrap_err().to_string();
    assert!(!text.contains(".astype") && text.contains("safetensors"), "{text}");
    assert!(convert("q", f, DType::I32).is_err());
    let i = decode_npy(&encode_npy(&Tensor::i32(vec![1], vec![1]).unwrap()).unwrap()).unwrap();
    assert!(matches!(convert("seg", i.clone(), DType::F32), Err(ConvertError::DType { file: FileDType::I32, .. })));
    assert!(matches!(convert("seg", i, DType::Bool), Err(ConvertError::DType { .. })));
}

#[test]
fn file_errors_name_the_path() {
    let dir = TempDir::new("paths");
    let missing = dir.path("nope.npy");
    let err = read_npy(&missing).unwrap_err();
    assert!(matches!(err.kind, IoErrorKind::Unreadable(_)));
    assert!(err.to_string().contains("nope.npy"), "{err}");

    let unwritable = dir.path("no-such-dir/out.npy");
    let err = write_npy(&unwritable, &f32_tensor()).unwrap_err();
    assert!(matches!(err.kind, IoErrorKind::Unwritable(_)), "{err}");

    assert!(matches!(Format::of_path(Path::new("x.csv")), Err(IoError { kind: IoErrorKind::UnknownFormat, .. })));
    assert_eq!(Format::of_path(Path::new("X.NPY")).unwrap(), Format::Npy);

    let path = dir.path("out.npy");
    write_tensor(&path, "out", &f32_tensor()).unwrap();
    assert_eq!(convert("out", read_npy(&path).unwrap(), DType::F32).unwrap(), f32_tensor());
    let path = dir.path("out.safetensors");
    write_tensor(&path, "out", &f32_tensor()).unwrap();
    assert_eq!(read_safetensors(&path).unwrap()[0].0, "out");
}
