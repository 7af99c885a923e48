//! Tensor files: `.npy` (one tensor) and `.safetensors` (named tensors).
//!
//! Reading gives a [`FileTensor`]: the data exactly as the file holds it, with the file's own
//! dtype (which may be one attnc has no [`DType`] for, such as f64 or i64). [`convert`] then turns
//! it into a [`Tensor`] of a parameter's declared dtype, accepting only the same dtype, a
//! lossless widening, or numpy's default types (f64, i64) for f32/i32, so that a wrong file is
//! reported instead of silently rounded.
//!
//! Nothing here panics on a corrupt file: every malformed header, short data section or odd dtype
//! becomes an [`IoError`] naming the path.

mod npy;
mod safetensors;

pub use npy::{decode_npy, encode_npy};
pub use safetensors::{decode_safetensors, encode_safetensors};

use attn_compiler::ir::DType;
use attn_compiler::tensor::{Tensor, TensorData, TensorError};
use std::fmt;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Element type of a tensor as stored in a file. A superset of [`DType`]: numpy's default float
/// and int types (f64, i64) can be read and converted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FileDType {
    /// 32-bit float.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16 (safetensors only: numpy has no bf16).
    BF16,
    /// 64-bit float (numpy's default); read as f32.
    F64,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer (numpy's default); read as i32 when every value fits.
    I64,
    /// Boolean, one byte per element.
    Bool,
}

impl FileDType {
    /// The short name (`f32`, `i64`, ...), as in `.attn` types.
    pub fn name(self) -> &'static str {
        match self {
            FileDType::F32 => "f32",
            FileDType::F16 => "f16",
            FileDType::BF16 => "bf16",
            FileDType::F64 => "f64",
            FileDType::I32 => "i32",
            FileDType::I64 => "i64",
            FileDType::Bool => "bool",
        }
    }

    /// The file dtype a tensor of `dtype` is stored as.
    pub fn of(dtype: DType) -> FileDType {
        match dtype {
            DType::F32 => FileDType::F32,
            DType::F16 => FileDType::F16,
            DType::BF16 => FileDType::BF16,
            DType::I32 => FileDType::I32,
            DType::Bool => FileDType::Bool,
        }
    }
}

impl fmt::Display for FileDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Element storage of a [`FileTensor`], wide enough to hold every supported file dtype exactly.
#[derive(Clone, Debug, PartialEq)]
pub enum FileData {
    /// f32, f16 and bf16 values (all exactly representable in f32).
    F32(Vec<f32>),
    /// f64 values.
    F64(Vec<f64>),
    /// i32 and i64 values.
    I64(Vec<i64>),
    /// bool values.
    Bool(Vec<bool>),
}

/// A tensor as read from a file, before conversion to a parameter's dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct FileTensor {
    /// The dtype stored in the file.
    pub dtype: FileDType,
    /// Row-major shape.
    pub shape: Vec<usize>,
    /// The elements (their count is the product of `shape`).
    pub data: FileData,
}

/// Why a file could not be read or written. Always names the file.
#[derive(Debug, Error)]
#[error("{}: {kind}", path.display())]
pub struct IoError {
    /// The file.
    pub path: PathBuf,
    /// What went wrong.
    #[source]
    pub kind: IoErrorKind,
}

/// What went wrong with a tensor file.
#[derive(Debug, Error)]
pub enum IoErrorKind {
    /// The file could not be opened or read.
    #[error("cannot read the file: {0}")]
    Unreadable(#[source] std::io::Error),
    /// The file ends before the data its header announces.
    #[error("the file is truncated: {0}")]
    Truncated(String),
    /// The bytes are not a `.npy` file (bad magic, unreadable header).
    #[error("not a valid .npy file: {0}")]
    NotNpy(String),
    /// The bytes are not a `.safetensors` file.
    #[error("not a valid .safetensors file: {0}")]
    NotSafetensors(String),
    /// The element type is not one attnc reads.
    #[error("unsupported dtype `{0}` (supported: f32, f16, bf16, f64, i32, i64, bool)")]
    UnsupportedDType(String),
    /// A `.npy` array stored column-major.
    #[error("the array is stored in Fortran (column-major) order; save it in C order (numpy.ascontiguousarray)")]
    FortranOrder,
    /// A name asked for is not in a `.safetensors` file.
    #[error("no tensor named `{name}` in the file (it holds: {})", list_or_none(available))]
    MissingTensor {
        /// The name asked for.
        name: String,
        /// The names the file holds, sorted.
        available: Vec<String>,
    },
    /// The extension is neither `.npy` nor `.safetensors`.
    #[error("unknown tensor file type: the name must end in .npy or .safetensors")]
    UnknownFormat,
    /// The output could not be created or written.
    #[error("cannot write the file: {0}")]
    Unwritable(#[source] std::io::Error),
    /// A tensor cannot be stored in the chosen format.
    #[error("cannot encode the tensor: {0}")]
    Unencodable(String),
}

fn list_or_none(names: &[String]) -> String {
    if names.is_empty() { "no tensors".to_string() } else { names.join(", ") }
}

impl IoError {
    /// An error about `path`.
    pub fn new(path: impl Into<PathBuf>, kind: IoErrorKind) -> IoError {
        IoError { path: path.into(), kind }
    }
}

/// How to produce data of `declared`: numpy converts with `.astype`, but has no bf16.
fn convert_advice(declared: DType) -> &'static str {
    match declared {
        DType::BF16 => {
            "numpy has no bf16, so write bf16 data as .safetensors (e.g. torch's \
             safetensors.torch.save_file), or pass f32 data and declare the parameter f32"
        }
        _ => "convert it first (e.g. numpy's .astype)",
    }
}

/// A file's data could not be used for a parameter.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ConvertError {
    /// The file's dtype is not the declared one and not one [`convert`] accepts for it.
    #[error(
        "input `{param}` is declared {declared} but the file holds {file}; {}: \
         only the same dtype, f16/bf16/f64 -> f32 or i64 -> i32 is accepted",
        convert_advice(*declared)
    )]
    DType {
        /// The parameter.
        param: String,
        /// The dtype in the file.
        file: FileDType,
        /// The parameter's declared dtype.
        declared: DType,
    },
    /// An i64 value does not fit in i32.
    #[error("input `{param}` is declared i32 but the file holds the i64 value {value}, which does not fit in i32")]
    OutOfRange {
        /// The parameter.
        param: String,
        /// The first value out of range.
        value: i64,
    },
    /// The converted data did not make a valid tensor (element count and shape disagree).
    #[error("input `{param}`: {source}")]
    Tensor {
        /// The parameter.
        param: String,
        /// Why.
        #[source]
        source: TensorError,
    },
}

/// Converts file data to a tensor of the parameter's `declared` dtype.
///
/// Accepted: the same dtype; f16 or bf16 to f32 (exact); f64 to f32 (numpy's default float type,
/// rounded to f32 as the interpreter would); i64 to i32 when every value fits. Anything else is a
/// [`ConvertError::DType`] naming `param`, so that e.g. f32 data for an f16 parameter is not
/// rounded without the user asking.
pub fn convert(param: &str, file: FileTensor, declared: DType) -> Result<Tensor, ConvertError> {
    let mismatch = |file_dtype| ConvertError::DType { param: param.to_string(), file: file_dtype, declared };
    let data = match (file.dtype, declared, file.data) {
        (FileDType::F32 | FileDType::F16 | FileDType::BF16, DType::F32, FileData::F32(v))
        | (FileDType::F16, DType::F16, FileData::F32(v))
        | (FileDType::BF16, DType::BF16, FileData::F32(v)) => TensorData::F32(v),
        (FileDType::F64, DType::F32, FileData::F64(v)) => TensorData::F32(v.into_iter().map(|x| x as f32).collect()),
        (FileDType::I32 | FileDType::I64, DType::I32, FileData::I64(v)) => {
            let mut out = Vec::with_capacity(v.len());
            for x in v {
                out.push(i32::try_from(x).map_err(|_| ConvertError::OutOfRange { param: param.to_string(), value: x })?);
            }
            TensorData::I32(out)
        }
        (FileDType::Bool, DType::Bool, FileData::Bool(v)) => TensorData::Bool(v),
        (from, _, _) => return Err(mismatch(from)),
    };
    Tensor::new(declared, file.shape, data).map_err(|source| ConvertError::Tensor { param: param.to_string(), source })
}

/// The tensor file formats attnc reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// numpy's `.npy`: one unnamed tensor.
    Npy,
    /// Hugging Face `.safetensors`: several named tensors.
    Safetensors,
}

impl Format {
    /// The format a path's extension names (case-insensitive).
    pub fn of_path(path: &Path) -> Result<Format, IoError> {
        let ext = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("npy") => Ok(Format::Npy),
            Some("safetensors") => Ok(Format::Safetensors),
            _ => Err(IoError::new(path, IoErrorKind::UnknownFormat)),
        }
    }
}

/// The path that stands for standard input in `--input NAME=-`.
pub const STDIN: &str = "-";

/// A tensor file read into memory once: from a path, or from standard input for [`STDIN`]
/// (whose format is told by its first bytes: `.npy` magic, else `.safetensors`).
#[derive(Debug)]
pub struct InputFile {
    /// The path as shown in errors (`<stdin>` for standard input).
    pub path: PathBuf,
    /// How the bytes are decoded.
    pub format: Format,
    bytes: Vec<u8>,
}

impl InputFile {
    /// Reads `path` (or standard input for `-`).
    pub fn read(path: &Path) -> Result<InputFile, IoError> {
        if path.as_os_str() == STDIN {
            let shown = PathBuf::from("<stdin>");
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut std::io::stdin().lock(), &mut bytes)
                .map_err(|e| IoError::new(&shown, IoErrorKind::Unreadable(e)))?;
            let format = if bytes.starts_with(b"\x93NUMPY") { Format::Npy } else { Format::Safetensors };
            return Ok(InputFile { path: shown, format, bytes });
        }
        let format = Format::of_path(path)?;
        Ok(InputFile { path: path.to_path_buf(), format, bytes: read_bytes(path)? })
    }

    /// The one tensor of a `.npy` file.
    pub fn npy(&self) -> Result<FileTensor, IoError> {
        decode_npy(&self.bytes).map_err(|kind| IoError::new(&self.path, kind))
    }

    /// Every tensor of a `.safetensors` file, sorted by name.
    pub fn safetensors(&self) -> Result<Vec<(String, FileTensor)>, IoError> {
        decode_safetensors(&self.bytes).map_err(|kind| IoError::new(&self.path, kind))
    }

    /// The tensor named `name` of a `.safetensors` file.
    pub fn safetensors_tensor(&self, name: &str) -> Result<FileTensor, IoError> {
        let all = self.safetensors()?;
        let available: Vec<String> = all.iter().map(|(n, _)| n.clone()).collect();
        all.into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
            .ok_or_else(|| IoError::new(&self.path, IoErrorKind::MissingTensor { name: name.to_string(), available }))
    }
}

fn read_bytes(path: &Path) -> Result<Vec<u8>, IoError> {
    std::fs::read(path).map_err(|e| IoError::new(path, IoErrorKind::Unreadable(e)))
}

fn write_bytes(path: &Path, bytes: &[u8]) -> Result<(), IoError> {
    write_atomic(path, bytes).map_err(|e| IoError::new(path, IoErrorKind::Unwritable(e)))
}

/// Writes `bytes` to `path` whole or not at all: into a temporary file beside it, then renamed
/// over it, so a failed write never leaves a truncated file (and an existing one stays).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let name = path.file_name().ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name"))?;
    let mut temp_name = std::ffi::OsString::from(".");
    temp_name.push(name);
    temp_name.push(format!(".attnc-{}.tmp", std::process::id()));
    let temp = path.with_file_name(temp_name);
    let written = std::fs::File::create(&temp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    match written.and_then(|()| std::fs::rename(&temp, path)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&temp);
            Err(e)
        }
    }
}

/// Whether two paths name the same existing file (through links and `..`); false when either
/// does not exist.
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// Reads a `.npy` file.
pub fn read_npy(path: &Path) -> Result<FileTensor, IoError> {
    decode_npy(&read_bytes(path)?).map_err(|kind| IoError::new(path, kind))
}

/// Reads every tensor of a `.safetensors` file, sorted by name.
pub fn read_safetensors(path: &Path) -> Result<Vec<(String, FileTensor)>, IoError> {
    decode_safetensors(&read_bytes(path)?).map_err(|kind| IoError::new(path, kind))
}

/// Reads one named tensor of a `.safetensors` file.
pub fn read_safetensors_tensor(path: &Path, name: &str) -> Result<FileTensor, IoError> {
    InputFile { path: path.to_path_buf(), format: Format::Safetensors, bytes: read_bytes(path)? }.safetensors_tensor(name)
}

/// Writes one tensor as `.npy` (bf16 is written as f32: numpy has no bf16; the values are exact).
pub fn write_npy(path: &Path, tensor: &Tensor) -> Result<(), IoError> {
    let bytes = encode_npy(tensor).map_err(|kind| IoError::new(path, kind))?;
    write_bytes(path, &bytes)
}

/// Writes named tensors as one `.safetensors` file (each in its own dtype).
pub fn write_safetensors(path: &Path, tensors: &[(&str, &Tensor)]) -> Result<(), IoError> {
    let bytes = encode_safetensors(tensors).map_err(|kind| IoError::new(path, kind))?;
    write_bytes(path, &bytes)
}

/// Writes one tensor in the format `path`'s extension names (a `.safetensors` file then holds the
/// one tensor under `name`).
pub fn write_tensor(path: &Path, name: &str, tensor: &Tensor) -> Result<(), IoError> {
    match Format::of_path(path)? {
        Format::Npy => write_npy(path, tensor),
        Format::Safetensors => write_safetensors(path, &[(name, tensor)]),
    }
}

#[cfg(test)]
mod tests;
