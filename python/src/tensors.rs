//! Arguments as they come: NumPy arrays and DLPack capsules (PyTorch tensors, through
//! `torch.utils.dlpack.to_dlpack`, without a NumPy array in between), in any strides and in
//! the element types a parameter can take.
//!
//! Both kinds become a [`Raw`] view (address, element type, shape, byte strides). A view
//! whose element type is the parameter's storage and whose strides are row-major and aligned
//! is read in place; any other (a transposed view, a stride-0 broadcast, f16, bf16, f64) is
//! copied once into a dense buffer of the parameter's storage here, in Rust.

use attn_runtime::DType;
use attn_runtime::cpu::{DataRef, OutData, OutRef};
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyCapsuleMethods};
use std::ffi::{CStr, c_void};

/// An element type a caller's buffer can hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F32,
    F64,
    F16,
    BF16,
    I32,
    Bool,
}

impl Elem {
    pub fn size(self) -> usize {
        match self {
            Elem::F64 => 8,
            Elem::F32 | Elem::I32 => 4,
            Elem::F16 | Elem::BF16 => 2,
            Elem::Bool => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Elem::F32 => "float32",
            Elem::F64 => "float64",
            Elem::F16 => "float16",
            Elem::BF16 => "bfloat16",
            Elem::I32 => "int32",
            Elem::Bool => "bool",
        }
    }
}

/// A caller's buffer as it lies in host memory: valid for as long as the object it came from
/// (held beside it) is alive and unchanged.
pub struct Raw {
    ptr: *const u8,
    pub elem: Elem,
    pub shape: Vec<usize>,
    /// Byte strides, one per axis (any sign; 0 for a broadcast axis).
    strides: Vec<isize>,
    /// Whether its owner forbids writes (a read-only NumPy array, a DLPack 1.x tensor flagged
    /// read-only).
    read_only: bool,
}

impl Raw {
    /// The bytes its elements lie in, `[first, end)` (empty for no elements).
    pub fn span(&self) -> (usize, usize) {
        if self.shape.contains(&0) {
            return (0, 0);
        }
        let (mut low, mut high) = (self.ptr as isize, self.ptr as isize);
        for (&n, &s) in self.shape.iter().zip(&self.strides) {
            let reach = (n as isize - 1).saturating_mul(s);
            if reach < 0 { low = low.saturating_add(reach) } else { high = high.saturating_add(reach) }
        }
        (low as usize, (high as usize).saturating_add(self.elem.size()))
    }

    /// Whether no two of its elements share a byte: with the axes of more than one element
    /// ordered by stride, each stride steps past everything the inner axes reach.
    fn distinct(&self) -> bool {
        let mut axes: Vec<(usize, usize)> =
            self.shape.iter().zip(&self.strides).filter(|(n, _)| **n > 1).map(|(&n, &s)| (n, s.unsigned_abs())).collect();
        axes.sort_by_key(|&(_, s)| s);
        let mut reach = self.elem.size();
        for (n, s) in axes {
            if s < reach {
                return false;
            }
            reach = s.saturating_mul(n - 1).saturating_add(reach);
        }
        true
    }
}

/// Why an argument cannot be read: its type (`DTypeError`) or its memory (`LayoutError`).
pub enum Refusal {
    DType(String),
    Layout(String),
}

/// The element type of a NumPy dtype, `None` for one a parameter cannot take.
/// A NumPy dtype's descriptor, made on demand.
type Descr = for<'py> fn(Python<'py>) -> Bound<'py, numpy::PyArrayDescr>;

fn numpy_elem(py: Python<'_>, array: &Bound<'_, PyUntypedArray>) -> Option<Elem> {
    let dtype = array.dtype();
    // Checked lazily, most common first (each descriptor is a lookup).
    let candidates: [(Elem, Descr); 5] = [
        (Elem::F32, numpy::dtype::<f32>),
        (Elem::F64, numpy::dtype::<f64>),
        (Elem::F16, numpy::dtype::<half::f16>),
        (Elem::I32, numpy::dtype::<i32>),
        (Elem::Bool, numpy::dtype::<bool>),
    ];
    candidates.into_iter().find(|(_, descr)| dtype.is_equiv_to(&descr(py))).map(|(e, _)| e)
}

/// A NumPy array's buffer; `Err` names a dtype no parameter takes.
pub fn from_numpy(py: Python<'_>, array: &Bound<'_, PyUntypedArray>) -> Result<Raw, Refusal> {
    let Some(elem) = numpy_elem(py, array) else {
        let given = array.dtype().str().map_or_else(|_| "?".to_string(), |s| s.to_string());
        return Err(Refusal::DType(given));
    };
    // SAFETY: `as_array_ptr` is this live array's object; `data` is its first element.
    let ptr = unsafe { (*array.as_array_ptr()).fields.data } as *const u8;
    // SAFETY: as above; NPY_ARRAY_WRITEABLE is 0x0400.
    let read_only = unsafe { (*array.as_array_ptr()).fields.flags } & 0x0400 == 0;
    Ok(Raw { ptr, elem, shape: array.shape().to_vec(), strides: array.strides().to_vec(), read_only })
}

// The DLPack ABI (dlpack.h, versions 0.8 and 1.x).

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: [u32; 2],
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

const DLTENSOR: &CStr = c"dltensor";
const DLTENSOR_VERSIONED: &CStr = c"dltensor_versioned";
/// Device types whose memory the CPU reads: kDLCPU, kDLCUDAHost (pinned), kDLCUDAManaged.
const HOST_DEVICES: [i32; 3] = [1, 3, 13];
/// The largest rank a capsule may claim.
const MAX_RANK: i32 = 64;

/// A DLPack capsule's tensor, `None` when `value` is not a capsule. The capsule is read, not
/// consumed: its producer still frees the tensor when the capsule goes (so it must be held
/// for as long as the view is used).
pub fn from_capsule(value: &Bound<'_, PyAny>) -> Option<Result<Raw, Refusal>> {
    let capsule = value.cast::<PyCapsule>().ok()?;
    let mut read_only = false;
    let tensor: *const DLTensor = if let Ok(p) = capsule.pointer_checked(Some(DLTENSOR)) {
        // SAFETY: a "dltensor" capsule holds a DLManagedTensor (the DLPack protocol).
        unsafe { &raw const (*p.cast::<DLManagedTensor>().as_ptr()).dl_tensor }
    } else if let Ok(p) = capsule.pointer_checked(Some(DLTENSOR_VERSIONED)) {
        // SAFETY: a "dltensor_versioned" capsule holds a DLManagedTensorVersioned, whose
        // major version 1 fixes this layout.
        let managed = p.cast::<DLManagedTensorVersioned>().as_ptr();
        if unsafe { (*managed).version[0] } != 1 {
            return Some(Err(Refusal::Layout(format!(
                "a DLPack capsule of version {} was given; attnc reads versions 0.8 and 1",
                unsafe { (*managed).version[0] }
            ))));
        }
        // DLPACK_FLAG_BITMASK_READ_ONLY.
        read_only = unsafe { (*managed).flags } & 1 != 0;
        unsafe { &raw const (*managed).dl_tensor }
    } else {
        return Some(Err(Refusal::Layout("a capsule that is not an unused DLPack tensor (\"dltensor\") was given".to_string())));
    };
    // SAFETY: the capsule is alive (borrowed from the caller) and its producer owns `tensor`.
    Some(unsafe { read_dl(&*tensor) }.map(|raw| Raw { read_only, ..raw }))
}

/// # Safety
/// `t` is a DLPack tensor whose shape, strides and data are valid.
unsafe fn read_dl(t: &DLTensor) -> Result<Raw, Refusal> {
    if !HOST_DEVICES.contains(&t.device.device_type) {
        return Err(Refusal::Layout(format!(
            "a DLPack tensor on device type {} was given; the CPU reads host memory (for CUDA tensors, compile with target='cuda')",
            t.device.device_type
        )));
    }
    let elem = match (t.dtype.code, t.dtype.bits, t.dtype.lanes) {
        (2, 32, 1) => Elem::F32,
        (2, 64, 1) => Elem::F64,
        (2, 16, 1) => Elem::F16,
        (4, 16, 1) => Elem::BF16,
        (0, 32, 1) => Elem::I32,
        (6, 8, 1) => Elem::Bool,
        (code, bits, lanes) => {
            let kind = match code {
                0 => "int",
                1 => "uint",
                2 => "float",
                4 => "bfloat",
                5 => "complex",
                6 => "bool",
                _ => "type code ",
            };
            let lanes = if lanes == 1 { String::new() } else { format!("x{lanes}") };
            return Err(Refusal::DType(format!("{kind}{bits}{lanes}")));
        }
    };
    if !(0..=MAX_RANK).contains(&t.ndim) {
        return Err(Refusal::Layout(format!("a DLPack tensor of rank {} was given", t.ndim)));
    }
    let rank = t.ndim as usize;
    let dims: &[i64] = if rank == 0 || t.shape.is_null() { &[] } else { unsafe { std::slice::from_raw_parts(t.shape, rank) } };
    if dims.len() != rank || dims.iter().any(|&n| n < 0) {
        return Err(Refusal::Layout("a DLPack tensor with a negative or missing size was given".to_string()));
    }
    let shape: Vec<usize> = dims.iter().map(|&n| n as usize).collect();
    let size = elem.size() as isize;
    let strides: Vec<isize> = if t.strides.is_null() {
        row_major(&shape, size)
    } else {
        let s = unsafe { std::slice::from_raw_parts(t.strides, rank) };
        s.iter().map(|&x| (x as isize).saturating_mul(size)).collect()
    };
    let ptr = (t.data as *const u8).wrapping_add(t.byte_offset as usize);
    Ok(Raw { ptr, elem, shape, strides, read_only: false })
}

/// Row-major byte strides of `shape` for elements of `size` bytes.
fn row_major(shape: &[usize], size: isize) -> Vec<isize> {
    let mut strides = vec![0isize; shape.len()];
    let mut step = size;
    for (s, &n) in strides.iter_mut().zip(shape).rev() {
        *s = step;
        step = step.saturating_mul(n as isize);
    }
    strides
}

/// An argument's data for a parameter: read in place, or copied once into the parameter's
/// storage (f32 for the float types, i32, bool).
pub enum Data {
    InPlace { ptr: *const u8, len: usize },
    F32(Vec<f32>),
    I32(Vec<i32>),
    Bool(Vec<bool>),
}

impl Data {
    /// The elements as the CPU runtime takes them, for a parameter of dtype `declared`.
    ///
    /// # Safety
    /// An `InPlace` buffer must still be alive (its owner held).
    pub unsafe fn data_ref(&self, declared: DType) -> DataRef<'_> {
        match self {
            Data::InPlace { ptr, len } => match declared {
                DType::I32 => DataRef::I32(unsafe { std::slice::from_raw_parts(ptr.cast::<i32>(), *len) }),
                DType::Bool => DataRef::Bool(unsafe { std::slice::from_raw_parts(ptr.cast::<bool>(), *len) }),
                DType::F32 | DType::F16 | DType::BF16 => DataRef::F32(unsafe { std::slice::from_raw_parts(ptr.cast::<f32>(), *len) }),
            },
            Data::F32(v) => DataRef::F32(v),
            Data::I32(v) => DataRef::I32(v),
            Data::Bool(v) => DataRef::Bool(v),
        }
    }
}

/// `raw`'s elements for a parameter declared `declared`: `Err` names why it cannot be (a
/// dtype the parameter does not take, or a size that does not fit in memory).
///
/// Takes: f32 ← f32, f16, bf16 (exact), f64 (rounded to nearest); f16 ← f16; bf16 ← bf16;
/// i32 ← i32; bool ← bool.
///
/// # Safety
/// `raw` describes live memory (its owner held for the call).
pub unsafe fn data(raw: &Raw, declared: DType) -> Result<Data, Refusal> {
    let takes = match declared {
        DType::F32 => matches!(raw.elem, Elem::F32 | Elem::F16 | Elem::BF16 | Elem::F64),
        DType::F16 => raw.elem == Elem::F16,
        DType::BF16 => raw.elem == Elem::BF16,
        DType::I32 => raw.elem == Elem::I32,
        DType::Bool => raw.elem == Elem::Bool,
    };
    if !takes {
        return Err(Refusal::DType(raw.elem.name().to_string()));
    }
    let len = raw
        .shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|n| n.checked_mul(raw.elem.size()).is_some_and(|b| b <= isize::MAX as usize));
    let Some(len) = len else {
        return Err(Refusal::Layout(format!("its shape {:?} does not fit in memory", raw.shape)));
    };
    let dense =
        raw.shape.iter().zip(&raw.strides).zip(row_major(&raw.shape, raw.elem.size() as isize)).all(|((&n, &s), r)| n == 1 || s == r);
    let aligned = (raw.ptr as usize).is_multiple_of(raw.elem.size());
    let stored = matches!((declared, raw.elem), (DType::F32, Elem::F32) | (DType::I32, Elem::I32) | (DType::Bool, Elem::Bool));
    if len == 0 {
        return Ok(match raw.elem {
            Elem::I32 => Data::I32(Vec::new()),
            Elem::Bool => Data::Bool(Vec::new()),
            _ => Data::F32(Vec::new()),
        });
    }
    if stored && dense && aligned {
        return Ok(Data::InPlace { ptr: raw.ptr, len });
    }
    // SAFETY (all three): every offset `gather` visits is one the view's shape and strides
    // name, inside the caller's buffer; unaligned reads are allowed.
    Ok(unsafe {
        match raw.elem {
            Elem::F32 => Data::F32(gather(raw, len, |p| p.cast::<f32>().read_unaligned())),
            Elem::F64 => Data::F32(gather(raw, len, |p| p.cast::<f64>().read_unaligned() as f32)),
            Elem::F16 => Data::F32(gather(raw, len, |p| half::f16::from_bits(p.cast::<u16>().read_unaligned()).to_f32())),
            Elem::BF16 => Data::F32(gather(raw, len, |p| half::bf16::from_bits(p.cast::<u16>().read_unaligned()).to_f32())),
            Elem::I32 => Data::I32(gather(raw, len, |p| p.cast::<i32>().read_unaligned())),
            Elem::Bool => Data::Bool(gather(raw, len, |p| p.read() != 0)),
        }
    })
}

/// The `len` elements of `raw` in row-major order, each read by `get` from its address.
///
/// # Safety
/// Every address the view's shape and strides name is readable by `get`.
unsafe fn gather<T>(raw: &Raw, len: usize, get: impl Fn(*const u8) -> T) -> Vec<T> {
    let mut out = Vec::with_capacity(len);
    let Some((&inner, outer)) = raw.shape.split_last() else {
        out.push(get(raw.ptr));
        return out;
    };
    let step = raw.strides[raw.shape.len() - 1];
    let mut index = vec![0usize; outer.len()];
    loop {
        let base = outer.iter().enumerate().fold(raw.ptr, |p, (a, _)| p.wrapping_offset(index[a] as isize * raw.strides[a]));
        for i in 0..inner {
            out.push(get(base.wrapping_offset(i as isize * step)));
        }
        // The next row: an odometer over the outer axes, last fastest.
        let mut axis = outer.len();
        loop {
            if axis == 0 {
                return out;
            }
            axis -= 1;
            index[axis] += 1;
            if index[axis] < outer[axis] {
                break;
            }
            index[axis] = 0;
        }
    }
}

/// Where one result goes: the caller's buffer itself, or a dense staging buffer of the
/// result's storage that [`Sink::finish`] copies into it after the run.
pub enum Sink {
    /// Dense, aligned, of the result's storage type (i32 where `int`, else f32), and apart
    /// from every input.
    InPlace { ptr: *mut u8, len: usize, int: bool },
    /// Staged as f32 (float results).
    F32(Vec<f32>),
    /// Staged as i32 (i32 results).
    I32(Vec<i32>),
    /// A bool result: the run returns it, and `finish` copies it in.
    Bool,
}

/// Where a result of dtype `declared` goes when `raw` is given for it, with `inputs` the spans
/// of the run's inputs. `Err` says why `raw` cannot take it: its element type (f32, f16, bf16
/// and f64 take a float result, rounded to nearest where narrower; int32 an i32 one; bool a
/// bool one), or its memory (read-only, elements that share bytes, a size that does not fit).
/// A buffer that overlaps an input is staged, so the inputs are read whole before it is
/// written.
pub fn sink(raw: &Raw, declared: DType, inputs: &[(usize, usize)]) -> Result<Sink, Refusal> {
    let takes = match declared {
        DType::F32 | DType::F16 | DType::BF16 => matches!(raw.elem, Elem::F32 | Elem::F16 | Elem::BF16 | Elem::F64),
        DType::I32 => raw.elem == Elem::I32,
        DType::Bool => raw.elem == Elem::Bool,
    };
    if !takes {
        return Err(Refusal::DType(raw.elem.name().to_string()));
    }
    if raw.read_only {
        return Err(Refusal::Layout("it is read-only".to_string()));
    }
    if !raw.distinct() {
        return Err(Refusal::Layout("some of its elements share memory (a broadcast or overlapping view)".to_string()));
    }
    let len = raw.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).filter(|n| n.checked_mul(raw.elem.size()).is_some());
    let Some(len) = len else {
        return Err(Refusal::Layout(format!("its shape {:?} does not fit in memory", raw.shape)));
    };
    let (low, high) = raw.span();
    let apart = inputs.iter().all(|&(a, b)| b <= low || high <= a || a == b || low == high);
    let dense =
        raw.shape.iter().zip(&raw.strides).zip(row_major(&raw.shape, raw.elem.size() as isize)).all(|((&n, &s), r)| n == 1 || s == r);
    let aligned = (raw.ptr as usize).is_multiple_of(raw.elem.size());
    let stored = matches!((declared, raw.elem), (DType::F32 | DType::F16 | DType::BF16, Elem::F32) | (DType::I32, Elem::I32));
    Ok(if stored && dense && aligned && apart {
        Sink::InPlace { ptr: raw.ptr as *mut u8, len, int: declared == DType::I32 }
    } else {
        match declared {
            DType::I32 => Sink::I32(vec![0; len]),
            DType::Bool => Sink::Bool,
            _ => Sink::F32(vec![0.0; len]),
        }
    })
}

impl Sink {
    /// The run's buffer for this result (`None`: the run returns it).
    pub fn out_ref<'a>(&'a mut self, shape: &'a [usize]) -> Option<OutRef<'a>> {
        let data = match self {
            // SAFETY: `sink` checked that the caller's buffer holds `len` elements of this type,
            // dense and aligned; its owner is held for the call.
            Sink::InPlace { ptr, len, int } => match (*len, *int) {
                (0, false) => OutData::F32(&mut []),
                (0, true) => OutData::I32(&mut []),
                (n, false) => OutData::F32(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<f32>(), n) }),
                (n, true) => OutData::I32(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<i32>(), n) }),
            },
            Sink::F32(v) => OutData::F32(v),
            Sink::I32(v) => OutData::I32(v),
            Sink::Bool => return None,
        };
        Some(OutRef { shape, data })
    }

    /// The result in the caller's buffer `raw`: staged values copied in (converted to its
    /// element type), a returned bool result checked against its shape and copied in.
    /// `Err` names a shape that does not fit (for bool results, known only after the run).
    ///
    /// # Safety
    /// `raw` describes live, writable memory (checked by [`sink`], its owner held).
    pub unsafe fn finish(self, raw: &Raw, returned: Option<&[bool]>, shape: Option<&[usize]>) -> Result<(), String> {
        // SAFETY (all): every row `scatter` hands over lies inside the caller's buffer, at the
        // addresses the view's shape and strides name; unaligned writes are allowed.
        unsafe {
            match self {
                Sink::InPlace { .. } => {}
                Sink::F32(v) => match raw.elem {
                    Elem::F32 => scatter(raw, &v, |p, to, row| {
                        if to == 4 {
                            std::ptr::copy_nonoverlapping(row.as_ptr().cast::<u8>(), p, row.len() * 4);
                        } else {
                            each(p, to, row, |q, x| q.cast::<f32>().write_unaligned(x));
                        }
                    }),
                    Elem::F64 => scatter(raw, &v, |p, to, row| each(p, to, row, |q, x| q.cast::<f64>().write_unaligned(f64::from(x)))),
                    Elem::F16 => scatter(raw, &v, |p, to, row| {
                        each(p, to, row, |q, x| q.cast::<u16>().write_unaligned(half::f16::from_f32(x).to_bits()));
                    }),
                    Elem::BF16 => scatter(raw, &v, |p, to, row| {
                        each(p, to, row, |q, x| q.cast::<u16>().write_unaligned(half::bf16::from_f32(x).to_bits()));
                    }),
                    Elem::I32 | Elem::Bool => return Err("a float result in an integer buffer".to_string()),
                },
                Sink::I32(v) => scatter(raw, &v, |p, to, row| each(p, to, row, |q, x| q.cast::<i32>().write_unaligned(x))),
                Sink::Bool => {
                    let (Some(values), Some(shape)) = (returned, shape) else {
                        return Err("the bool result was not returned".to_string());
                    };
                    if shape != raw.shape.as_slice() {
                        return Err(format!("bool{shape:?}"));
                    }
                    scatter(raw, values, |p, to, row| each(p, to, row, |q, x| q.write(u8::from(x))));
                }
            }
        }
        Ok(())
    }
}

/// Writes `values` (row-major) into `raw`'s elements, a row at a time: `put_row(address,
/// stride, row)` writes one row of the innermost axis (by memory order) at `address`, its
/// elements `stride` bytes apart. The rows are visited in the order they lie in the caller's
/// memory (axes by falling stride), so that its writes stream whatever order the values come
/// in.
///
/// # Safety
/// Every address the view's shape and strides name is writable by `put_row`.
unsafe fn scatter<T: Copy>(raw: &Raw, values: &[T], put_row: impl Fn(*mut u8, isize, &[T])) {
    // (One value per element, else nothing is written: `finish` checked the shape.)
    if raw.shape.contains(&0) || raw.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)) != Some(values.len()) {
        return;
    }
    // Each axis' step through `values` (row-major), and the axes of more than one element,
    // the one with the smallest stride in the caller's memory last.
    let steps = row_major(&raw.shape, 1);
    let mut axes: Vec<usize> = (0..raw.shape.len()).filter(|&a| raw.shape[a] > 1).collect();
    axes.sort_by_key(|&a| std::cmp::Reverse(raw.strides[a].unsigned_abs()));
    let Some(inner) = axes.pop() else {
        put_row(raw.ptr as *mut u8, 0, &values[..values.len().min(1)]);
        return;
    };
    let (n, to, from) = (raw.shape[inner], raw.strides[inner], steps[inner] as usize);
    let mut row: Vec<T> = Vec::with_capacity(if from == 1 { 0 } else { n });
    let mut index = vec![0usize; axes.len()];
    loop {
        let (mut at, mut first) = (raw.ptr, 0usize);
        for (&a, &i) in axes.iter().zip(&index) {
            at = at.wrapping_offset(i as isize * raw.strides[a]);
            first += i * steps[a] as usize;
        }
        if from == 1 {
            put_row(at as *mut u8, to, &values[first..first + n]);
        } else {
            row.clear();
            row.extend((0..n).map(|i| values[first + i * from]));
            put_row(at as *mut u8, to, &row);
        }
        // The next row: an odometer over the outer axes, last fastest.
        let mut axis = axes.len();
        loop {
            if axis == 0 {
                return;
            }
            axis -= 1;
            index[axis] += 1;
            if index[axis] < raw.shape[axes[axis]] {
                break;
            }
            index[axis] = 0;
        }
    }
}

/// Writes `row` at `at`, its elements `stride` bytes apart, each by `put`.
fn each<T: Copy>(at: *mut u8, stride: isize, row: &[T], put: impl Fn(*mut u8, T)) {
    for (i, &x) in row.iter().enumerate() {
        put(at.wrapping_offset(i as isize * stride), x);
    }
}
