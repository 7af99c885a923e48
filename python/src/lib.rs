//! `attnc._attnc`: the native half of attnc's Python package.
//!
//! The Python layer (`python/attnc/`) hands over NumPy arrays and DLPack capsules (torch
//! tensors, through `torch.utils.dlpack.to_dlpack`; anything else through `numpy.asarray`)
//! and wraps results back; everything else is here: compiling (cached per source, file name,
//! entry, target and threads), binding positional and named arguments to parameters, reading
//! arguments ([`tensors`]: dense f32/i32/bool in place, any other strides or float type copied
//! once), running with the GIL released, and turning every failure into one of the exception
//! classes of `attnc._errors` with the rendered diagnostic.
//!
//! Nothing here panics on user input: every error is a Python exception.

use attn_compiler::ir::grad::GradError;
use attn_dsl::{Diagnostic, Severity, line_col};
use attn_runtime::cpu::{CpuOptions, DataRef, TensorRef, cpu_compiler};
use attn_runtime::{CompileError, DType, EntryInfo, Program, RunError, RunOptions, Stage, Target, Tensor, TensorData};
use numpy::ndarray::{Array, IxDyn};
use numpy::{IntoPyArray, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

mod tensors;

/// How many compiled programs the per-process cache keeps (the oldest is dropped first).
const CACHE_CAPACITY: usize = 64;

/// What a compiled program is cached by: source, file name, entry, target, threads, and for a
/// derived program ([`Compiled::grad`]) the parameters it differentiates with respect to.
type Key = (String, String, Option<String>, Target, usize, Option<Vec<String>>);

/// Compiled programs by key, and the keys oldest first.
type Cache = (Vec<(Key, Arc<Inner>)>, VecDeque<Key>);

/// The per-process cache of compiled programs.
static CACHE: Mutex<Cache> = Mutex::new((Vec::new(), VecDeque::new()));

/// The exception classes, from `attnc._errors`.
static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// A program compiled for one entry point and target.
struct Inner {
    program: Program,
    entry: EntryInfo,
    /// The entry's parameter names, in order (for binding arguments on every call).
    param_names: Vec<String>,
    target: Target,
    cpu: CpuOptions,
}

/// One compiled entry point of a program, for one target (`attnc.Program` wraps it).
#[pyclass(frozen, module = "attnc._attnc", name = "Compiled")]
struct Compiled {
    inner: Arc<Inner>,
}

/// One argument, bound to its parameter: its data, and the object that owns the memory an
/// in-place read borrows (a NumPy array or a DLPack capsule), held for the call.
struct Input<'py> {
    dtype: DType,
    shape: Vec<usize>,
    data: tensors::Data,
    /// The bytes the caller's buffer spans (a result's buffer must not overlap it).
    span: (usize, usize),
    _owner: Bound<'py, PyAny>,
}

impl Input<'_> {
    fn view(&self) -> TensorRef<'_> {
        // SAFETY: `_owner` keeps an in-place buffer alive for as long as `self` is borrowed.
        let data = unsafe { self.data.data_ref(self.dtype) };
        TensorRef { dtype: self.dtype, shape: &self.shape, data }
    }
}

/// `compile(source, file_name, entry, target, threads)`: the program's `entry` (its last
/// function when `None`) compiled for `target`, from the cache when it was compiled before.
#[pyfunction]
#[pyo3(signature = (source, file_name, entry=None, target="cpu", threads=None))]
fn compile(py: Python<'_>, source: &str, file_name: &str, entry: Option<&str>, target: &str, threads: Option<usize>) -> PyResult<Compiled> {
    let target: Target = target.parse().map_err(|e: attn_runtime::TargetError| error(py, "ArgumentError", e.to_string(), vec![]))?;
    let threads = threads.unwrap_or(0);
    let key: Key = (source.to_string(), file_name.to_string(), entry.map(str::to_string), target, threads, None);
    cached_or_built(py, key, || build(source, file_name, entry, target, threads))
}

/// The program cached under `key`, or built by `make` without the GIL and cached.
fn cached_or_built(py: Python<'_>, key: Key, make: impl FnOnce() -> Result<Inner, Failure> + Send) -> PyResult<Compiled> {
    if let Some(inner) = cached(&key) {
        return Ok(Compiled { inner });
    }
    let inner = Arc::new(py.detach(make).map_err(|e| e.into_py(py))?);
    if let Ok(mut cache) = CACHE.lock() {
        let (entries, order) = &mut *cache;
        if entries.len() >= CACHE_CAPACITY
            && let Some(oldest) = order.pop_front()
        {
            entries.retain(|(k, _)| *k != oldest);
        }
        entries.push((key.clone(), inner.clone()));
        order.push_back(key);
    }
    Ok(Compiled { inner })
}

fn cached(key: &Key) -> Option<Arc<Inner>> {
    let cache = CACHE.lock().ok()?;
    cache.0.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
}

/// `clear_cache()`: forgets every compiled program.
#[pyfunction]
fn clear_cache() {
    if let Ok(mut cache) = CACHE.lock() {
        cache.0.clear();
        cache.1.clear();
    }
}

/// `share_openmp(path)`: multi-threaded CPU runs go to the team of the OpenMP runtime at `path`,
/// already loaded in this process (PyTorch's `libgomp`), instead of attnc's own threads; `None`
/// goes back to them. A library that is not loaded raises `OSError` and changes nothing.
#[pyfunction]
#[pyo3(signature = (path=None))]
fn share_openmp(path: Option<std::path::PathBuf>) -> PyResult<()> {
    attn_runtime::cpu::openmp::share(path.as_deref()).map_err(|e| pyo3::exceptions::PyOSError::new_err(e.to_string()))
}

/// `shared_openmp()`: the OpenMP runtime whose team runs multi-threaded CPU runs, or `None`.
#[pyfunction]
fn shared_openmp() -> Option<std::path::PathBuf> {
    attn_runtime::cpu::openmp::shared_path()
}

/// A failure found without the GIL, raised once it is held again.
enum Failure {
    Compile(CompileError),
    Run(Box<(Program, String, RunError)>),
    Argument(String),
}

impl Failure {
    fn into_py(self, py: Python<'_>) -> PyErr {
        match self {
            Failure::Compile(e) => compile_error(py, &e),
            Failure::Run(run) => run_error(py, &run.0, &run.1, &run.2, &[]),
            Failure::Argument(msg) => error(py, "ArgumentError", msg, vec![]),
        }
    }
}

fn build(source: &str, file_name: &str, entry: Option<&str>, target: Target, threads: usize) -> Result<Inner, Failure> {
    let program = Program::from_source(source, file_name).map_err(Failure::Compile)?;
    let info = match entry {
        Some(name) => program.entry(name),
        None => program.default_entry().ok_or(RunError::NoEntry),
    };
    let info = match info {
        Ok(info) => info,
        Err(e) => return Err(Failure::Argument(e.to_string())),
    };
    prepared(program, info, target, CpuOptions { threads })
}

/// Compiles the entry ahead for the CPU target.
fn prepared(program: Program, entry: EntryInfo, target: Target, cpu: CpuOptions) -> Result<Inner, Failure> {
    if target == Target::Cpu
        && let Err(e) = program.prepare_cpu(&entry.name, &cpu)
    {
        let name = entry.name.clone();
        return Err(Failure::Run(Box::new((program, name, e))));
    }
    let param_names = entry.params.iter().map(|(n, _)| n.clone()).collect();
    Ok(Inner { program, entry, param_names, target, cpu })
}

#[pymethods]
impl Compiled {
    /// The entry point's name.
    #[getter]
    fn entry(&self) -> &str {
        &self.inner.entry.name
    }

    /// Every function of the program, in source order.
    #[getter]
    fn entries(&self) -> Vec<String> {
        self.inner.program.entries().into_iter().map(|e| e.name).collect()
    }

    /// `name(q: f32[B, S, D], ...) -> (out: f32[B, S, D])`.
    #[getter]
    fn signature(&self) -> String {
        self.inner.entry.to_string()
    }

    /// `[(name, dtype, [dim, ...]), ...]` for the parameters.
    #[getter]
    fn params(&self) -> Vec<(String, String, Vec<String>)> {
        described(&self.inner.entry.params)
    }

    /// `[(name, dtype, [dim, ...]), ...]` for the results.
    #[getter]
    fn outputs(&self) -> Vec<(String, String, Vec<String>)> {
        described(&self.inner.entry.outputs)
    }

    /// `cpu`, `interp` or `cuda`.
    #[getter]
    fn target(&self) -> &'static str {
        self.inner.target.name()
    }

    /// Threads for the CPU target (0: one per core).
    #[getter]
    fn threads(&self) -> usize {
        self.inner.cpu.threads
    }

    /// The program text.
    #[getter]
    fn source(&self) -> &str {
        self.inner.program.source()
    }

    /// The warnings the program compiled with, rendered.
    #[getter]
    fn warnings(&self) -> String {
        self.inner.program.render_warnings(false)
    }

    /// Runs the entry: `args` are arrays in parameter order, `named` arrays by parameter name,
    /// `dims` the sizes of dims the shapes do not determine. Returns the results in order.
    /// `outs`, one entry per result, gives buffers (arrays or DLPack capsules, any strides) to
    /// write results into: `None` comes back in their place (see [`Compiled::run_into`]).
    #[pyo3(signature = (args, named=None, dims=None, outs=None))]
    fn run<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        named: Option<&Bound<'py, PyDict>>,
        dims: Option<HashMap<String, i64>>,
        outs: Option<&Bound<'py, PyTuple>>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let inputs = self.bind(py, args, named)?;
        let inner = &*self.inner;
        let opts = RunOptions { dims: dims.unwrap_or_default(), target: inner.target };
        if let Some(outs) = outs {
            return self.run_into(py, &inputs, &opts, outs);
        }
        let views = views(&inputs);
        let result = py.detach(|| inner.program.run_borrowed(&inner.entry.name, &views, &opts, &inner.cpu));
        match result {
            Ok(outputs) => outputs.into_iter().map(|(_, t)| to_numpy(py, t)).collect(),
            Err(e) => Err(self.run_error(py, &inputs, &e)),
        }
    }

    /// The entry with its gradients (`Program::grad`): inputs are the entry's plus `d_<result>`
    /// per float result; results are the entry's plus `d_<param>` per float parameter (or per
    /// name in `wrt`). Cached like `compile`.
    #[pyo3(signature = (wrt=None))]
    fn grad(&self, py: Python<'_>, wrt: Option<Vec<String>>) -> PyResult<Compiled> {
        let inner = &*self.inner;
        let key: Key = (
            inner.program.source().to_string(),
            inner.program.file_name().to_string(),
            Some(inner.entry.name.clone()),
            inner.target,
            inner.cpu.threads,
            Some(wrt.clone().unwrap_or_default()),
        );
        cached_or_built(py, key, || {
            let fail = |e| Failure::Run(Box::new((inner.program.clone(), inner.entry.name.clone(), e)));
            let derived = inner.program.grad(&inner.entry.name, wrt.as_deref()).map_err(fail)?;
            let name = format!("{}_grad", inner.entry.name);
            let entry = derived.entry(&name).map_err(fail)?;
            prepared(derived, entry, inner.target, inner.cpu.clone())
        })
    }

    /// The gradients split for autograd (`Program::grad_split`): the compiled entries
    /// `<entry>_fwd` (results, then each fused flash op's saved result and log-sum-exp) and
    /// `<entry>_bwd` (inputs, cotangents, saved values → gradients), or `None` when the
    /// backward is not fused. Cached like `grad`.
    #[pyo3(signature = (wrt=None))]
    fn grad_split(&self, py: Python<'_>, wrt: Option<Vec<String>>) -> PyResult<Option<(Compiled, Compiled)>> {
        let inner = &*self.inner;
        let name = &inner.entry.name;
        let key = |suffix: &str| -> Key {
            (
                inner.program.source().to_string(),
                inner.program.file_name().to_string(),
                // Not an entry name any program can have (a control character).
                Some(format!("{name}\u{1f}{suffix}")),
                inner.target,
                inner.cpu.threads,
                Some(wrt.clone().unwrap_or_default()),
            )
        };
        if let (Some(fwd), Some(bwd)) = (cached(&key("fwd")), cached(&key("bwd"))) {
            return Ok(Some((Compiled { inner: fwd }, Compiled { inner: bwd })));
        }
        // Differentiated once for both halves.
        let split = py.detach(|| inner.program.grad_split(name, wrt.as_deref()));
        let Some(program) = split.map_err(|e| run_error(py, &inner.program, name, &e, &[]))? else { return Ok(None) };
        let half = |suffix: &str| {
            cached_or_built(py, key(suffix), || {
                let fail = |e| Failure::Run(Box::new((program.clone(), name.clone(), e)));
                let entry = program.entry(&format!("{name}_{suffix}")).map_err(fail)?;
                prepared(program.clone(), entry, inner.target, inner.cpu.clone())
            })
        };
        Ok(Some((half("fwd")?, half("bwd")?)))
    }

    /// Seeded random inputs for every parameter, as `attnc run --random-inputs` makes them:
    /// floats from N(0, 1), i32 inputs as sorted segment ids, bools as coin flips; every dim
    /// not in `dims` (nor fixed by the program) is 8. A dict by parameter name.
    #[pyo3(signature = (seed=0, dims=None))]
    fn random_inputs<'py>(&self, py: Python<'py>, seed: u64, dims: Option<HashMap<String, i64>>) -> PyResult<Bound<'py, PyDict>> {
        let inner = &*self.inner;
        let entry = &inner.entry.name;
        let made =
            inner.program.random_dims(entry, &dims.unwrap_or_default()).and_then(|dims| inner.program.random_inputs(entry, seed, &dims));
        let inputs = made.map_err(|e| run_error(py, &inner.program, entry, &e, &[]))?;
        let dict = PyDict::new(py);
        for (name, t) in inputs {
            dict.set_item(name, to_numpy(py, t)?)?;
        }
        Ok(dict)
    }

    /// The size of every dim of the entry: `dims`, the program's fixed dims, and 8 for the rest
    /// (the sizes `random_inputs` uses).
    #[pyo3(signature = (dims=None))]
    fn random_dims(&self, py: Python<'_>, dims: Option<HashMap<String, i64>>) -> PyResult<HashMap<String, i64>> {
        let inner = &*self.inner;
        inner
            .program
            .random_dims(&inner.entry.name, &dims.unwrap_or_default())
            .map_err(|e| run_error(py, &inner.program, &inner.entry.name, &e, &[]))
    }

    /// The data addresses the program would read for these arguments (what the zero-copy test
    /// compares with the arrays' own).
    #[pyo3(signature = (args, named=None))]
    fn _input_addresses<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        named: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Vec<usize>> {
        let inputs = self.bind(py, args, named)?;
        let views = views(&inputs);
        Ok(views
            .iter()
            .map(|v| match v.data {
                DataRef::F32(d) => d.as_ptr() as usize,
                DataRef::I32(d) => d.as_ptr() as usize,
                DataRef::Bool(d) => d.as_ptr() as usize,
            })
            .collect())
    }

    /// Identifies the compiled program behind this object (equal for two `compile` calls
    /// the cache answered with the same program).
    #[getter]
    fn _identity(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// Times `iters` runs on the same arguments entirely in Rust (no Python per run): seconds
    /// per run, best and mean. For the overhead benchmark (`python/bench/overhead.py`).
    #[pyo3(signature = (args, iters, dims=None))]
    fn _bench_native<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        iters: usize,
        dims: Option<HashMap<String, i64>>,
    ) -> PyResult<(f64, f64)> {
        let inputs = self.bind(py, args, None)?;
        let inner = &*self.inner;
        let views = views(&inputs);
        let opts = RunOptions { dims: dims.unwrap_or_default(), target: inner.target };
        let timed = py.detach(|| {
            let mut best = f64::INFINITY;
            let mut total = 0.0;
            for _ in 0..iters.max(1) {
                let start = Instant::now();
                let out = inner.program.run_borrowed(&inner.entry.name, &views, &opts, &inner.cpu)?;
                drop(out);
                let t = start.elapsed().as_secs_f64();
                best = best.min(t);
                total += t;
            }
            Ok((best, total / iters.max(1) as f64))
        });
        timed.map_err(|e: RunError| run_error(py, &inner.program, &inner.entry.name, &e, &[]))
    }

    /// The results' `(dtype name, shape)` for inputs of these shapes (and `dims`): what to
    /// allocate for [`Compiled::_run_cuda`].
    #[pyo3(signature = (shapes, dims=None))]
    fn _output_shapes(
        &self,
        py: Python<'_>,
        shapes: Vec<Vec<usize>>,
        dims: Option<HashMap<String, i64>>,
    ) -> PyResult<Vec<(String, Vec<usize>)>> {
        let inner = &*self.inner;
        let opts = RunOptions { dims: dims.unwrap_or_default(), target: inner.target };
        let out = inner.program.output_shapes(&inner.entry.name, &shapes, &opts);
        out.map(|v| v.into_iter().map(|(d, s)| (d.to_string(), s)).collect())
            .map_err(|e| run_error(py, &inner.program, &inner.entry.name, &e, &[]))
    }

    /// Runs a program compiled for `cuda` on device tensors, each `(address, dtype name,
    /// shape)` dense in row-major order on device 0, writing the results into `outputs`,
    /// ordered on the caller's CUDA `stream` (a `CUstream` as an integer; 0 the legacy default
    /// stream). The caller (`attnc.torch`) keeps every tensor alive and allocated for the call.
    /// `known`: host copies (int32 arrays) of inputs by position, equal to the device tensors,
    /// where the caller has them (sizes, ids that classify tiles: no copy back then).
    #[pyo3(signature = (inputs, outputs, stream, dims=None, known=None))]
    fn _run_cuda(
        &self,
        py: Python<'_>,
        inputs: Vec<(u64, String, Vec<usize>)>,
        outputs: Vec<(u64, String, Vec<usize>)>,
        stream: u64,
        dims: Option<HashMap<String, i64>>,
        known: Option<HashMap<usize, numpy::PyReadonlyArrayDyn<'_, i32>>>,
    ) -> PyResult<()> {
        let inner = &*self.inner;
        if inner.target != Target::Cuda {
            return Err(error(
                py,
                "ArgumentError",
                format!("device tensors need a program compiled for `cuda`, not `{}`", inner.target.name()),
                vec![],
            ));
        }
        let tensors = |list: Vec<(u64, String, Vec<usize>)>| -> PyResult<Vec<attn_runtime::cuda::DeviceTensor>> {
            list.into_iter()
                .map(|(ptr, dtype, shape)| {
                    let dtype = DType::from_name(&dtype).ok_or_else(|| {
                        error(py, "DTypeError", format!("`{dtype}` is not an attnc dtype (f32, f16, bf16, i32, bool)"), vec![])
                    })?;
                    Ok(attn_runtime::cuda::DeviceTensor { ptr, dtype, shape })
                })
                .collect()
        };
        let (ins, outs) = (tensors(inputs)?, tensors(outputs)?);
        let opts = RunOptions { dims: dims.unwrap_or_default(), target: inner.target };
        // SAFETY: attnc.torch passes the addresses of live, dense CUDA tensors of device 0 that it
        // holds for the call (outputs freshly allocated), and the current stream's handle.
        let known: HashMap<usize, Tensor> = known
            .unwrap_or_default()
            .into_iter()
            .map(|(i, a)| {
                let shape = a.shape().to_vec();
                let data = a.as_array().iter().copied().collect();
                (i, Tensor { dtype: DType::I32, shape, data: TensorData::I32(data) })
            })
            .collect();
        let done = py.detach(|| unsafe { inner.program.run_cuda_device(&inner.entry.name, &ins, &outs, &opts, stream, &known) });
        done.map_err(|e| {
            let given: Vec<(String, DType, Vec<usize>)> =
                inner.entry.params.iter().zip(&ins).map(|((n, _), i)| (n.clone(), i.dtype, i.shape.clone())).collect();
            run_error(py, &inner.program, &inner.entry.name, &e, &given)
        })
    }

    /// The text of one pipeline stage for this entry: `ast`, `ir`, `opt`, `schedule`, `clif`
    /// or `cuda`.
    fn emit(&self, py: Python<'_>, stage: &str) -> PyResult<String> {
        let stage = match stage {
            "ast" => Stage::Ast,
            "ir" => Stage::Ir,
            "opt" => Stage::Opt,
            "schedule" => Stage::Schedule,
            "clif" => Stage::Clif,
            "cuda" => Stage::Cuda,
            other => {
                return Err(error(
                    py,
                    "ArgumentError",
                    format!("unknown stage `{other}` (known: ast, ir, opt, schedule, clif, cuda)"),
                    vec![],
                ));
            }
        };
        let inner = &*self.inner;
        let compiler = attn_runtime::compiler(match inner.target {
            Target::Cuda => attn_compiler::schedule::Target::Cuda,
            _ => attn_compiler::schedule::Target::Cpu,
        });
        let text = py.detach(|| compiler.emit(inner.program.checked(), stage, Some(&inner.entry.name)));
        text.map_err(|e| {
            compile_error(
                py,
                &CompileError {
                    diagnostics: vec![e.diagnostic()],
                    source_text: inner.program.source().to_string(),
                    file_name: inner.program.file_name().to_string(),
                },
            )
        })
    }

    /// What the optimizer did to this entry and why, with each flash op's tile map at `dims`
    /// (representative sizes for the others).
    #[pyo3(signature = (dims=None))]
    fn explain(&self, py: Python<'_>, dims: Option<HashMap<String, i64>>) -> PyResult<String> {
        let inner = &*self.inner;
        let dims = dims.unwrap_or_default();
        let explained = py.detach(|| cpu_compiler().explain_at(inner.program.checked(), Some(&inner.entry.name), &dims, (64, 64)));
        match explained {
            Ok(list) => Ok(list.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n")),
            Err(e) => Err(error(py, "ShapeError", e.to_string(), vec![])),
        }
    }
}

impl Compiled {
    /// [`Compiled::run`] writing results into the caller's buffers `outs` (one entry per
    /// result, `None` for a fresh result). A dense buffer of the result's storage type that
    /// overlaps no input is written by the kernels directly; any other (strides, float16,
    /// bfloat16, float64, or one overlapping an input) is written once, natively, after the
    /// run. Every buffer is checked (type, memory, and against the result's shape) before the
    /// run, so a refused one is left as it was.
    fn run_into<'py>(
        &self,
        py: Python<'py>,
        inputs: &[Input<'py>],
        opts: &RunOptions,
        outs: &Bound<'py, PyTuple>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let inner = &*self.inner;
        let results = &inner.entry.outputs;
        if outs.len() != results.len() {
            let names: Vec<&str> = results.iter().map(|(n, _)| n.as_str()).collect();
            let msg = format!("out= takes one buffer (or None) per result ({}), but {} were given", names.join(", "), outs.len());
            return Err(error(py, "ArgumentError", msg, vec![]));
        }
        let spans: Vec<(usize, usize)> = inputs.iter().map(|i| i.span).collect();
        let mut given: Vec<Option<(tensors::Raw, tensors::Sink)>> = Vec::with_capacity(results.len());
        for ((name, ty), value) in results.iter().zip(outs.iter()) {
            if value.is_none() {
                given.push(None);
                continue;
            }
            let raw = match tensors::from_capsule(&value) {
                Some(raw) => raw,
                None => match value.cast::<PyUntypedArray>() {
                    Ok(array) => tensors::from_numpy(py, array),
                    Err(_) => {
                        let type_name = value.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string());
                        return Err(error(
                            py,
                            "DTypeError",
                            format!("out for result `{name}` must be an array, but a {type_name} was given"),
                            vec![],
                        ));
                    }
                },
            };
            let sink = raw.and_then(|raw| tensors::sink(&raw, ty.dtype, &spans).map(|sink| (raw, sink))).map_err(|r| match r {
                tensors::Refusal::DType(got) => {
                    let msg = format!("result `{name}` is {ty}; a {got} buffer cannot hold it (float results go into float32, float16, bfloat16 or float64 buffers)");
                    error(py, "DTypeError", msg, vec![])
                }
                tensors::Refusal::Layout(why) => error(py, "LayoutError", format!("the buffer given for result `{name}` cannot be written: {why}"), vec![]),
            })?;
            let span = sink.0.span();
            let clash = results.iter().zip(&given).find(|(_, g)| {
                g.as_ref().is_some_and(|(r, _)| {
                    let (a, b) = r.span();
                    a < span.1 && span.0 < b
                })
            });
            if let Some(((other, _), _)) = clash {
                return Err(error(py, "LayoutError", format!("the buffers given for results `{other}` and `{name}` overlap"), vec![]));
            }
            given.push(Some(sink));
        }
        let shapes: Vec<Vec<usize>> = given.iter().map(|g| g.as_ref().map_or_else(Vec::new, |(raw, _)| raw.shape.clone())).collect();
        let result = {
            let views = views(inputs);
            let mut refs: Vec<_> =
                given.iter_mut().zip(&shapes).map(|(g, shape)| g.as_mut().and_then(|(_, sink)| sink.out_ref(shape))).collect();
            py.detach(|| inner.program.run_borrowed_into(&inner.entry.name, &views, &mut refs, opts, &inner.cpu))
        };
        let written = result.map_err(|e| self.run_error(py, inputs, &e))?;
        let mut back = Vec::with_capacity(written.len());
        for ((name, tensor), g) in written.into_iter().zip(given) {
            let Some((raw, sink)) = g else {
                let Some(tensor) = tensor else {
                    return Err(error(py, "RunError", format!("internal error: result `{name}` was not returned"), vec![]));
                };
                back.push(to_numpy(py, tensor)?);
                continue;
            };
            let (values, shape) = match &tensor {
                Some(Tensor { data: TensorData::Bool(v), shape, .. }) => (Some(v.as_slice()), Some(shape.as_slice())),
                _ => (None, None),
            };
            // SAFETY: `raw` was checked writable by `sink`; its owner is in `outs`, held.
            unsafe { sink.finish(&raw, values, shape) }.map_err(|got| {
                let msg = format!("the buffer given for result `{name}` has shape {:?}, but the result is {got}", raw.shape);
                error(py, "ShapeError", msg, vec![])
            })?;
            back.push(py.None().into_bound(py));
        }
        Ok(back)
    }

    /// A run's error as a Python exception, with the inputs' dtypes and shapes for the
    /// diagnostic.
    fn run_error(&self, py: Python<'_>, inputs: &[Input<'_>], e: &RunError) -> PyErr {
        let inner = &*self.inner;
        let given: Vec<(String, DType, Vec<usize>)> =
            inner.entry.params.iter().zip(inputs).map(|((n, _), i)| (n.clone(), i.dtype, i.shape.clone())).collect();
        run_error(py, &inner.program, &inner.entry.name, e, &given)
    }

    /// Binds positional then named arguments to the parameters, in parameter order.
    fn bind<'py>(&self, py: Python<'py>, args: &Bound<'py, PyTuple>, named: Option<&Bound<'py, PyDict>>) -> PyResult<Vec<Input<'py>>> {
        let entry = &self.inner.entry;
        let params = &self.inner.param_names;
        if args.len() > params.len() {
            let msg = format!(
                "`{}` takes {} input{} ({}) but {} were given",
                entry.name,
                params.len(),
                if params.len() == 1 { "" } else { "s" },
                params.join(", "),
                args.len()
            );
            return Err(error(py, "ArgumentError", msg, vec![]));
        }
        let mut slots: Vec<Option<Bound<'py, PyAny>>> = params.iter().map(|_| None).collect();
        for (slot, arg) in slots.iter_mut().zip(args.iter()) {
            *slot = Some(arg);
        }
        if let Some(named) = named {
            for (key, value) in named.iter() {
                let name: String = key.extract()?;
                let Some(index) = params.iter().position(|p| *p == name) else {
                    let e = RunError::UnexpectedInput {
                        entry: entry.name.clone(),
                        suggestion: attn_runtime::suggest(&name, params),
                        name,
                        params: params.clone(),
                    };
                    return Err(error(py, "ArgumentError", e.to_string(), vec![]));
                };
                if slots[index].is_some() {
                    return Err(error(py, "ArgumentError", RunError::DuplicateInput { name }.to_string(), vec![]));
                }
                slots[index] = Some(value);
            }
        }
        let missing: Vec<String> = params.iter().zip(&slots).filter(|(_, s)| s.is_none()).map(|(n, _)| n.clone()).collect();
        if !missing.is_empty() {
            let e = RunError::MissingInputs { entry: entry.name.clone(), names: missing, signature: entry.to_string() };
            return Err(error(py, "ArgumentError", e.to_string(), vec![]));
        }
        entry.params.iter().zip(slots.into_iter().flatten()).map(|((name, ty), value)| read(py, name, ty, &value)).collect()
    }
}

/// The views of the arguments (they borrow `inputs`).
fn views<'a>(inputs: &'a [Input<'_>]) -> Vec<TensorRef<'a>> {
    inputs.iter().map(Input::view).collect()
}

/// Reads one argument (a NumPy array, a DLPack capsule, or an object that is neither) for a
/// parameter declared `ty`.
fn read<'py>(py: Python<'py>, param: &str, ty: &attn_runtime::TensorType, value: &Bound<'py, PyAny>) -> PyResult<Input<'py>> {
    let declared = ty.dtype;
    let raw = if let Some(raw) = tensors::from_capsule(value) {
        raw
    } else if let Ok(array) = value.cast::<PyUntypedArray>() {
        tensors::from_numpy(py, array)
    } else {
        let type_name = value.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string());
        let msg = format!("input `{param}` must be an array, but a {type_name} was given");
        return Err(error(py, "DTypeError", msg, vec![("param", py_str(py, param))]));
    };
    // SAFETY: `value` (the array, or the capsule that keeps its tensor) is held in the Input.
    let read = raw.and_then(|raw| unsafe { tensors::data(&raw, declared) }.map(|data| (raw.span(), raw.shape, data)));
    let (span, shape, data) = read.map_err(|refusal| match refusal {
        tensors::Refusal::DType(given) => {
            let hint = match declared {
                DType::F32 => "; convert it with x.astype(numpy.float32) (or x.float() for torch)",
                DType::F16 => "; convert it with x.astype(numpy.float16) (or x.half() for torch)",
                DType::BF16 => "; pass a torch.bfloat16 tensor (NumPy has no bfloat16)",
                DType::I32 => "; convert it with x.astype(numpy.int32) (or x.int() for torch)",
                DType::Bool => "; convert it with x.astype(bool) (or x.bool() for torch)",
            };
            let msg = format!("input `{param}` is declared {ty} but a {given} array was given{hint}");
            error(py, "DTypeError", msg, vec![("param", py_str(py, param))])
        }
        tensors::Refusal::Layout(why) => layout_error(py, param, &why),
    })?;
    Ok(Input { dtype: declared, shape, data, span, _owner: value.clone() })
}

/// A result as a NumPy array (f16 as float16; bf16, which NumPy lacks, as float32).
fn to_numpy(py: Python<'_>, t: Tensor) -> PyResult<Bound<'_, PyAny>> {
    let shape = IxDyn(&t.shape);
    let shaped = |e: numpy::ndarray::ShapeError| error(py, "RunError", format!("internal error: result has a bad shape: {e}"), vec![]);
    Ok(match (t.dtype, t.data) {
        (DType::F16, TensorData::F32(v)) => {
            Array::from_shape_vec(shape, v.into_iter().map(half::f16::from_f32).collect()).map_err(shaped)?.into_pyarray(py).into_any()
        }
        (_, TensorData::F32(v)) => Array::from_shape_vec(shape, v).map_err(shaped)?.into_pyarray(py).into_any(),
        (_, TensorData::I32(v)) => Array::from_shape_vec(shape, v).map_err(shaped)?.into_pyarray(py).into_any(),
        (_, TensorData::Bool(v)) => Array::from_shape_vec(shape, v).map_err(shaped)?.into_pyarray(py).into_any(),
    })
}

fn described(items: &[(String, attn_runtime::TensorType)]) -> Vec<(String, String, Vec<String>)> {
    items.iter().map(|(n, t)| (n.clone(), t.dtype.to_string(), t.shape.iter().map(ToString::to_string).collect())).collect()
}

/// An instance of `attnc._errors.<class>` with `message`, and `attrs` set on it (a
/// `RuntimeError` if the class cannot be found, which only a broken install causes).
fn error(py: Python<'_>, class: &str, message: String, attrs: Vec<(&str, Py<PyAny>)>) -> PyErr {
    let made = (|| -> PyResult<PyErr> {
        let module = ERRORS.get_or_try_init(py, || py.import("attnc._errors").map(Bound::unbind))?;
        let instance = module.bind(py).getattr(class)?.call1((message.clone(),))?;
        for (name, value) in attrs {
            instance.setattr(name, value)?;
        }
        Ok(PyErr::from_value(instance))
    })();
    made.unwrap_or_else(|e| pyo3::exceptions::PyRuntimeError::new_err(format!("{message} (and attnc._errors failed: {e})")))
}

fn layout_error(py: Python<'_>, param: &str, why: &str) -> PyErr {
    let attrs = vec![("param", py_str(py, param))];
    error(py, "LayoutError", format!("input `{param}` cannot be read in place: {why}"), attrs)
}

fn py_str(py: Python<'_>, s: &str) -> Py<PyAny> {
    PyString::new(py, s).into_any().unbind()
}

/// `attnc.CompileError`, its text the rendered diagnostics.
fn compile_error(py: Python<'_>, e: &CompileError) -> PyErr {
    let code = e.diagnostics.iter().find(|d| d.severity == Severity::Error).or(e.diagnostics.first()).map_or("", |d| d.code);
    let list = PyList::empty(py);
    for d in &e.diagnostics {
        if let Ok(item) = diagnostic_dict(py, d, &e.source_text) {
            let _ = list.append(item);
        }
    }
    let mut attrs = vec![("diagnostics", list.into_any().unbind())];
    attrs.push(("code", py_str(py, code)));
    error(py, "CompileError", e.render(false).trim_end().to_string(), attrs)
}

fn diagnostic_dict<'py>(py: Python<'py>, d: &Diagnostic, source: &str) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    let (line, column) = line_col(source, d.primary.span.start as usize);
    dict.set_item("code", d.code)?;
    dict.set_item("severity", if d.severity == Severity::Error { "error" } else { "warning" })?;
    dict.set_item("message", &d.message)?;
    dict.set_item("line", line)?;
    dict.set_item("column", column)?;
    dict.set_item("span", (d.primary.span.start, d.primary.span.end))?;
    dict.set_item("label", &d.primary.message)?;
    dict.set_item("help", d.help.as_deref())?;
    Ok(dict)
}

/// The exception for a run failure: `ShapeError` for inputs and dims that do not fit,
/// `DTypeError`, `ArgumentError`, or `RunError` for failures of the run itself (no GPU, out of
/// memory, ...). Input errors carry the rendered diagnostic pointing at the parameter.
fn run_error(py: Python<'_>, program: &Program, entry: &str, e: &RunError, given: &[(String, DType, Vec<usize>)]) -> PyErr {
    use attn_compiler::exec::ExecError as I;
    let class = match e {
        RunError::InputDType { .. } | RunError::Interp(I::InputDType { .. }) => "DTypeError",
        RunError::Grad(GradError::Wrt { .. } | GradError::NameClash { .. })
        | RunError::UnknownEntry { .. }
        | RunError::NoEntry
        | RunError::MissingInputs { .. }
        | RunError::UnexpectedInput { .. }
        | RunError::DuplicateInput { .. }
        | RunError::Interp(I::InputCount { .. }) => "ArgumentError",
        RunError::UnknownDim { .. }
        | RunError::UnknownProgramDim { .. }
        | RunError::FixedDim { .. }
        | RunError::IndivisibleDim { .. }
        | RunError::Interp(
            I::InputRank { .. }
            | I::InputData { .. }
            | I::FixedDim { .. }
            | I::DimMismatch { .. }
            | I::Unsolvable { .. }
            | I::UnboundDim { .. }
            | I::GivenDim { .. }
            | I::NegativeDim { .. }
            | I::OutOfRange { .. },
        )
        | RunError::Output(_) => "ShapeError",
        _ => "RunError",
    };
    let message = python_dims(&e.to_string());
    let text = match program.run_error_diagnostic(entry, e, given) {
        Some(mut d) => {
            d.message = python_dims(&d.message);
            attn_runtime::report::render_diagnostics(&[d], program.file_name(), program.source(), false).trim_end().to_string()
        }
        None => message.clone(),
    };
    let mut attrs = Vec::new();
    attrs.push(("message", py_str(py, &message)));
    if let Some(p) = e.param() {
        attrs.push(("param", py_str(py, p)));
    }
    error(py, class, text, attrs)
}

/// Rewrites the command line's `--dim NAME=N` advice as the Python keyword `dims={'NAME': N}`.
fn python_dims(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find("--dim ") {
        out.push_str(&rest[..at]);
        let tail = &rest[at + "--dim ".len()..];
        let end = tail.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '=' || c == '-')).unwrap_or(tail.len());
        match tail[..end].split_once('=') {
            Some((name, value)) => out.push_str(&format!("dims={{'{name}': {value}}}")),
            None => out.push_str(&rest[at..at + "--dim ".len() + end]),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// The native module.
#[pymodule]
fn _attnc(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(compile, m)?)?;
    m.add_function(wrap_pyfunction!(clear_cache, m)?)?;
    m.add_function(wrap_pyfunction!(share_openmp, m)?)?;
    m.add_function(wrap_pyfunction!(shared_openmp, m)?)?;
    m.add_class::<Compiled>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
