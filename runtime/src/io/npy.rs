//! The `.npy` format (numpy's single-array file).
//!
//! Reading is done here rather than with npyz: npyz multiplies the header's shape without an
//! overflow check and trusts it for sizes, so a corrupt header could panic or ask for absurd
//! allocations. The header is a tiny Python dict literal, parsed below with a depth limit, and the
//! data section's length is checked against the shape before any element is decoded. Writing uses
//! npyz, whose output numpy reads.

use super::{FileDType, FileData, FileTensor, IoErrorKind};
use attn_compiler::ir::DType;
use attn_compiler::tensor::{Tensor, TensorData};
use npyz::WriterBuilder;

const MAGIC: &[u8] = b"\x93NUMPY";

/// Parses the bytes of a `.npy` file.
pub fn decode_npy(bytes: &[u8]) -> Result<FileTensor, IoErrorKind> {
    let not_npy = |m: &str| IoErrorKind::NotNpy(m.to_string());
    if bytes.is_empty() {
        return Err(IoErrorKind::Truncated("the file is empty".into()));
    }
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return Err(if MAGIC.starts_with(bytes) {
            IoErrorKind::Truncated("the file ends inside the .npy magic string".into())
        } else {
            not_npy("it does not start with the .npy magic string")
        });
    }
    let (major, len_bytes) = match bytes.get(6) {
        Some(1) => (1, 2),
        Some(2 | 3) => (bytes[6], 4),
        Some(v) => return Err(IoErrorKind::NotNpy(format!("unknown format version {v}"))),
        None => return Err(IoErrorKind::Truncated("the file ends before the format version".into())),
    };
    let header_start = 8 + len_bytes;
    let Some(len_field) = bytes.get(8..header_start) else {
        return Err(IoErrorKind::Truncated("the file ends before the header length".into()));
    };
    let header_len = len_field.iter().rev().fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
    let data_start = header_start.checked_add(header_len).ok_or_else(|| not_npy("the header length is too large"))?;
    let Some(header) = bytes.get(header_start..data_start) else {
        return Err(IoErrorKind::Truncated(format!("the header announces {header_len} bytes but the file ends before")));
    };
    // Versions 1 and 2 use latin-1; only ASCII is meaningful in the dict keys and values we read.
    let header_text: String = if major == 3 {
        std::str::from_utf8(header).map_err(|_| not_npy("the header is not UTF-8"))?.to_string()
    } else {
        header.iter().map(|b| char::from(*b)).collect()
    };
    let info = parse_header(&header_text)?;
    let data = &bytes[data_start..];
    let count = info.shape.iter().try_fold(1usize, |acc, d| acc.checked_mul(*d)).ok_or_else(|| not_npy("the shape is too large"))?;
    let needed = count.checked_mul(info.item_size).ok_or_else(|| not_npy("the shape is too large"))?;
    if data.len() < needed {
        return Err(IoErrorKind::Truncated(format!(
            "shape {:?} needs {needed} data bytes but only {} are present",
            info.shape,
            data.len()
        )));
    }
    let data = &data[..needed];
    let big = info.big_endian;
    let tensor_data = match info.dtype {
        FileDType::F32 => FileData::F32(chunks(data, big, f32::from_le_bytes, f32::from_be_bytes)),
        FileDType::F16 => FileData::F32(
            chunks(data, big, u16::from_le_bytes, u16::from_be_bytes).into_iter().map(|b| half::f16::from_bits(b).to_f32()).collect(),
        ),
        FileDType::F64 => FileData::F64(chunks(data, big, f64::from_le_bytes, f64::from_be_bytes)),
        FileDType::I32 => FileData::I64(chunks(data, big, i32::from_le_bytes, i32::from_be_bytes).into_iter().map(i64::from).collect()),
        FileDType::I64 => FileData::I64(chunks(data, big, i64::from_le_bytes, i64::from_be_bytes)),
        FileDType::Bool => FileData::Bool(data.iter().map(|b| *b != 0).collect()),
        // `parse_descr` never yields bf16 (numpy has none).
        FileDType::BF16 => return Err(IoErrorKind::UnsupportedDType("bf16".into())),
    };
    Ok(FileTensor { dtype: info.dtype, shape: info.shape, data: tensor_data })
}

/// Decodes fixed-size elements; `data.len()` is a multiple of `N` (checked by the caller).
fn chunks<T, const N: usize>(data: &[u8], big_endian: bool, le: fn([u8; N]) -> T, be: fn([u8; N]) -> T) -> Vec<T> {
    data.chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            if big_endian { be(a) } else { le(a) }
        })
        .collect()
}

/// Encodes one tensor as `.npy` bytes (C order, little-endian). bf16 is written as f32, whose
/// values are the same: numpy has no bf16.
pub fn encode_npy(tensor: &Tensor) -> Result<Vec<u8>, IoErrorKind> {
    let shape: Vec<u64> = tensor.shape.iter().map(|d| *d as u64).collect();
    let mut buf = Vec::new();
    let io = |e: std::io::Error| IoErrorKind::Unencodable(e.to_string());
    match (&tensor.data, tensor.dtype) {
        (TensorData::F32(v), DType::F16) => write_all(&mut buf, &shape, v.iter().map(|x| half::f16::from_f32(*x))).map_err(io)?,
        (TensorData::F32(v), _) => write_all(&mut buf, &shape, v.iter().copied()).map_err(io)?,
        (TensorData::I32(v), _) => write_all(&mut buf, &shape, v.iter().copied()).map_err(io)?,
        (TensorData::Bool(v), _) => write_all(&mut buf, &shape, v.iter().copied()).map_err(io)?,
    }
    Ok(buf)
}

fn write_all<T: npyz::AutoSerialize>(buf: &mut Vec<u8>, shape: &[u64], items: impl Iterator<Item = T>) -> std::io::Result<()> {
    let mut w = npyz::WriteOptions::new().default_dtype().shape(shape).writer(buf).begin_nd()?;
    for item in items {
        w.push(&item)?;
    }
    w.finish()
}

/// What the header says.
struct HeaderInfo {
    dtype: FileDType,
    item_size: usize,
    big_endian: bool,
    shape: Vec<usize>,
}

fn parse_header(text: &str) -> Result<HeaderInfo, IoErrorKind> {
    let bad = |m: &str| IoErrorKind::NotNpy(format!("bad header: {m}"));
    let mut p = Parser { s: text.as_bytes(), pos: 0 };
    let value = p.value(0)?;
    let PyValue::Dict(entries) = value else {
        return Err(bad("it is not a dict"));
    };
    let get = |key: &str| {
        entries
            .iter()
            .find(|(k, _)| matches!(k, PyValue::Str(s) if s == key))
            .map(|(_, v)| v)
            .ok_or_else(|| bad(&format!("no '{key}' key")))
    };
    let descr = match get("descr")? {
        PyValue::Str(s) => s.clone(),
        PyValue::List(fields) => return Err(IoErrorKind::UnsupportedDType(format!("structured dtype with {} fields", fields.len()))),
        _ => return Err(bad("'descr' is not a string")),
    };
    match get("fortran_order")? {
        PyValue::Bool(false) => {}
        PyValue::Bool(true) => return Err(IoErrorKind::FortranOrder),
        _ => return Err(bad("'fortran_order' is not True or False")),
    }
    let shape = match get("shape")? {
        PyValue::Tuple(items) => items
            .iter()
            .map(|v| match v {
                PyValue::Int(n) => usize::try_from(*n).map_err(|_| bad("a dimension is negative or too large")),
                _ => Err(bad("'shape' holds something other than integers")),
            })
            .collect::<Result<Vec<_>, _>>()?,
        _ => return Err(bad("'shape' is not a tuple")),
    };
    let (dtype, item_size, big_endian) = parse_descr(&descr)?;
    Ok(HeaderInfo { dtype, item_size, big_endian, shape })
}

/// `<f4`, `|b1`, `>i8`, ... -> dtype, element size, big-endian?
fn parse_descr(descr: &str) -> Result<(FileDType, usize, bool), IoErrorKind> {
    let unsupported = || IoErrorKind::UnsupportedDType(descr.to_string());
    let (big_endian, rest) = match descr.as_bytes().first() {
        Some(b'<') => (false, &descr[1..]),
        Some(b'>') => (true, &descr[1..]),
        Some(b'|') => (false, &descr[1..]),
        Some(b'=') => (cfg!(target_endian = "big"), &descr[1..]),
        _ => (cfg!(target_endian = "big"), descr),
    };
    let (dtype, size) = match rest {
        "f4" => (FileDType::F32, 4),
        "f2" | "e" => (FileDType::F16, 2),
        "f8" | "d" => (FileDType::F64, 8),
        "i4" => (FileDType::I32, 4),
        "i8" => (FileDType::I64, 8),
        "b1" | "?" => (FileDType::Bool, 1),
        _ => return Err(unsupported()),
    };
    Ok((dtype, size, big_endian))
}

/// The subset of Python literals a `.npy` header uses.
#[derive(Debug, PartialEq)]
enum PyValue {
    Str(String),
    Int(i128),
    Bool(bool),
    None,
    Tuple(Vec<PyValue>),
    List(Vec<PyValue>),
    Dict(Vec<(PyValue, PyValue)>),
}

/// Deeper nesting than this is garbage, not a header; the limit keeps recursion bounded.
const MAX_DEPTH: usize = 16;

struct Parser<'a> {
    s: &'a [u8],
    pos: usize,
}

impl Parser<'_> {
    fn err(&self, what: &str) -> IoErrorKind {
        IoErrorKind::NotNpy(format!("bad header at byte {}: {what}", self.pos))
    }

    fn skip_ws(&mut self) {
        while self.s.get(self.pos).is_some_and(|c| c.is_ascii_whitespace()) {
            self.pos += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        self.skip_ws();
        if self.s.get(self.pos) == Some(&c) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Result<PyValue, IoErrorKind> {
        if depth > MAX_DEPTH {
            return Err(self.err("nested too deeply"));
        }
        self.skip_ws();
        match self.s.get(self.pos) {
            Some(b'{') => {
                self.pos += 1;
                let mut entries = Vec::new();
                while !self.eat(b'}') {
                    let k = self.value(depth + 1)?;
                    if !self.eat(b':') {
                        return Err(self.err("expected ':'"));
                    }
                    entries.push((k, self.value(depth + 1)?));
                    if !self.eat(b',') {
                        if self.eat(b'}') {
                            break;
                        }
                        return Err(self.err("expected ',' or '}'"));
                    }
                }
                Ok(PyValue::Dict(entries))
            }
            Some(open @ (b'(' | b'[')) => {
                let close = if *open == b'(' { b')' } else { b']' };
                let is_tuple = *open == b'(';
                self.pos += 1;
                let mut items = Vec::new();
                while !self.eat(close) {
                    items.push(self.value(depth + 1)?);
                    if !self.eat(b',') {
                        if self.eat(close) {
                            break;
                        }
                        return Err(self.err("expected ',' or a closing bracket"));
                    }
                }
                Ok(if is_tuple { PyValue::Tuple(items) } else { PyValue::List(items) })
            }
            Some(q @ (b'\'' | b'"')) => {
                let q = *q;
                let start = self.pos + 1;
                let len = self.s[start..].iter().position(|c| *c == q).ok_or_else(|| self.err("unterminated string"))?;
                self.pos = start + len + 1;
                Ok(PyValue::Str(String::from_utf8_lossy(&self.s[start..start + len]).into_owned()))
            }
            Some(c) if c.is_ascii_digit() || *c == b'-' => {
                let start = self.pos;
                self.pos += 1;
                while self.s.get(self.pos).is_some_and(|c| c.is_ascii_digit()) {
                    self.pos += 1;
                }
                // Python 2 era headers write longs as `3L`.
                let digits = std::str::from_utf8(&self.s[start..self.pos]).map_err(|_| self.err("bad number"))?;
                if self.s.get(self.pos) == Some(&b'L') {
                    self.pos += 1;
                }
                digits.parse::<i128>().map(PyValue::Int).map_err(|_| self.err("bad integer"))
            }
            Some(_) => {
                for (word, v) in [("True", PyValue::Bool(true)), ("False", PyValue::Bool(false)), ("None", PyValue::None)] {
                    if self.s[self.pos..].starts_with(word.as_bytes()) {
                        self.pos += word.len();
                        return Ok(v);
                    }
                }
                Err(self.err("unexpected character"))
            }
            None => Err(self.err("unexpected end")),
        }
    }
}
