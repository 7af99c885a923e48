//! The CPU target: an entry point compiled by the pipeline ([`attn_compiler::Compiler`]:
//! optimised, scheduled for the CPU, rendered as Cranelift IR), JIT-compiled once, and run many
//! times on the caller's memory with a thread pool. Each new run shape is prepared once
//! ([`attn_compiler::schedule::prepare()`]) and reused.
//!
//! ```no_run
//! use attn_runtime::Program;
//! use attn_runtime::cpu::{CpuOptions, TensorRef};
//! use std::collections::HashMap;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let program = Program::from_file("examples/sdpa.attn")?;
//! let sdpa = program.compile_cpu("sdpa", &CpuOptions::default())?;
//! let (b, h, s, d) = (1, 8, 128, 64);
//! let q = vec![0.5f32; b * h * s * d];
//! let shape = [b, h, s, d];
//! let inputs = [TensorRef::f32(&shape, &q), TensorRef::f32(&shape, &q), TensorRef::f32(&shape, &q)];
//! let out = sdpa.run(&inputs, &HashMap::new())?;
//! assert_eq!(out[0].shape, shape);
//! # Ok(())
//! # }
//! ```
//!
//! Files: `render/` (the renderer: schedule → Cranelift IR), `abi` (the one table of functions
//! generated code calls), `jit` (Cranelift JIT), `shape` (the prepared schedule and the memory
//! of one run shape), `exec` (the thread pool), `helpers` (scalar helper functions).

pub mod abi;
mod exec;
mod helpers;
mod jit;
pub mod render;
mod shape;

pub use attn_kernels as kernels;
pub use exec::openmp;
pub use render::{ClifText, CodegenError, CpuModule, Features, TEXT_FEATURES};
pub use shape::AllocStats;

use attn_compiler::exec::{ExecError, bind_dims};
use attn_compiler::ir::{DType, Graph, Op, TensorType};
use attn_compiler::schedule::{BufferKind, CpuIsa, CpuPolicy, Policy, Schedule, ScheduleError};
use attn_compiler::tensor::{Tensor, TensorData, TensorError};
use attn_compiler::{Compiler, PipelineError, Planned};
use render as clif;
use shape::{AlignedBuf, ShapeState};
use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use thiserror::Error;

/// Why the CPU target could not compile or run an entry point.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum CpuError {
    /// The inputs do not fit the entry (count, dtype, shape, dims), with the interpreter's
    /// messages.
    #[error(transparent)]
    Input(ExecError),
    /// The graph cannot be scheduled.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// The code generator cannot render the schedule.
    #[error(transparent)]
    Codegen(#[from] CodegenError),
    /// Cranelift could not build or finalise the machine code.
    #[error("JIT compilation failed: {0}")]
    Jit(String),
    /// A buffer could not be allocated.
    #[error("cannot allocate {bytes} bytes")]
    OutOfMemory {
        /// The request.
        bytes: usize,
    },
    /// More threads than [`MAX_THREADS`] were asked for.
    #[error("{requested} threads asked for; at most {MAX_THREADS} are supported (0 means one per core)")]
    TooManyThreads {
        /// The request.
        requested: usize,
    },
    /// The operating system refused to start a thread.
    #[error("cannot start {threads} threads: {reason}")]
    Spawn {
        /// The threads the run needed.
        threads: usize,
        /// The operating system's reason.
        reason: String,
    },
    /// The schedule cannot run at these sizes or with these operands (a kernel's limit, an
    /// empty table a score reads), though the inputs fit the entry.
    #[error(transparent)]
    Unsupported(attn_compiler::schedule::PrepareError),
    /// The buffers given for the results ([`CpuProgram::run_into`]) are not one per result.
    #[error("{given} result buffer(s) given for {expected} result(s)")]
    OutputCount {
        /// The results of the entry.
        expected: usize,
        /// The buffers given.
        given: usize,
    },
    /// A buffer given for a result does not fit it (its shape or element type).
    #[error("the buffer given for result `{name}` is {given}, but the result is {expected}")]
    OutputBuffer {
        /// The result's name.
        name: String,
        /// What was given.
        given: String,
        /// The result's type at these sizes.
        expected: String,
    },
    /// An inconsistency inside the backend (a bug).
    #[error("internal error in the CPU backend: {0}")]
    Internal(String),
}

/// The most threads a program runs with.
pub const MAX_THREADS: usize = 4096;

/// The range table of an i32 or bool input a flash mask reads ([`attn_compiler::ir::RangeTable`]).
fn data_table(t: &TensorRef) -> Option<attn_compiler::ir::RangeTable> {
    match t.data {
        DataRef::I32(v) => Some(attn_compiler::ir::RangeTable::of_operand(v, t.shape)),
        DataRef::Bool(v) => Some(attn_compiler::ir::RangeTable::of_bools(v, t.shape)),
        DataRef::F32(_) => None,
    }
}

/// `threads` (0: one per available core), checked against [`MAX_THREADS`].
fn thread_count(threads: usize) -> Result<usize, CpuError> {
    match threads {
        0 => Ok(default_threads()),
        n if n > MAX_THREADS => Err(CpuError::TooManyThreads { requested: n }),
        n => Ok(n),
    }
}

/// How to compile and run on the CPU.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CpuOptions {
    /// Threads to run with; 0 means one per available core.
    pub threads: usize,
}

impl From<PipelineError> for CpuError {
    fn from(e: PipelineError) -> CpuError {
        match e {
            PipelineError::Schedule(e) => CpuError::Schedule(e),
            other => CpuError::Internal(other.to_string()),
        }
    }
}

/// The CPU's block policy on this machine: the kernels' ISA, and the tuning knobs
/// `ATTNC_FLASH_BLOCKS=BM,BN`, `ATTNC_FLASH_BWD_BLOCKS=BM,BN` (the flash backward's),
/// `ATTNC_MATMUL_ROWS=N` and `ATTNC_HEAD_GROUP=N` (heads a paged decode's work item walks
/// together; 1: one) when set (every choice computes the same result up to rounding).
pub fn cpu_policy() -> CpuPolicy {
    let isa = match kernels::isa() {
        kernels::Isa::Avx512 => CpuIsa::Avx512,
        kernels::Isa::Avx2 => CpuIsa::Avx2,
        kernels::Isa::Portable => CpuIsa::Portable,
    };
    let pair = |var: &str| {
        std::env::var(var).ok().and_then(|s| {
            let (a, b) = s.split_once(',')?;
            Some((a.trim().parse::<i64>().ok()?, b.trim().parse::<i64>().ok()?))
        })
    };
    let int = |var: &str| std::env::var(var).ok().and_then(|s| s.trim().parse::<i64>().ok());
    CpuPolicy {
        isa,
        flash_blocks: pair("ATTNC_FLASH_BLOCKS"),
        matmul_rows: int("ATTNC_MATMUL_ROWS"),
        flash_bwd_blocks: pair("ATTNC_FLASH_BWD_BLOCKS"),
        head_group: int("ATTNC_HEAD_GROUP"),
    }
}

/// The pipeline for this machine's CPU.
pub fn cpu_compiler() -> Compiler {
    Compiler::new(Policy::Cpu(cpu_policy()))
}

/// The number of threads `threads = 0` stands for: the available cores.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Borrowed input data.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DataRef<'a> {
    /// f32 (also f16/bf16 tensors, as f32 values).
    F32(&'a [f32]),
    /// i32.
    I32(&'a [i32]),
    /// bool.
    Bool(&'a [bool]),
}

/// An input tensor borrowed from the caller: read in place, never copied (except bool and
/// f16/bf16 inputs, which are converted into small per-run buffers).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TensorRef<'a> {
    /// Element type.
    pub dtype: DType,
    /// Size of each axis.
    pub shape: &'a [usize],
    /// Row-major elements.
    pub data: DataRef<'a>,
}

impl<'a> TensorRef<'a> {
    /// An f32 tensor.
    pub fn f32(shape: &'a [usize], data: &'a [f32]) -> TensorRef<'a> {
        TensorRef { dtype: DType::F32, shape, data: DataRef::F32(data) }
    }

    /// An i32 tensor.
    pub fn i32(shape: &'a [usize], data: &'a [i32]) -> TensorRef<'a> {
        TensorRef { dtype: DType::I32, shape, data: DataRef::I32(data) }
    }

    /// A view of an owned tensor.
    pub fn of(t: &'a Tensor) -> TensorRef<'a> {
        let data = match &t.data {
            TensorData::F32(v) => DataRef::F32(v),
            TensorData::I32(v) => DataRef::I32(v),
            TensorData::Bool(v) => DataRef::Bool(v),
        };
        TensorRef { dtype: t.dtype, shape: &t.shape, data }
    }

    /// An owned copy.
    pub fn to_tensor(&self) -> Result<Tensor, TensorError> {
        let data = match self.data {
            DataRef::F32(v) => TensorData::F32(v.to_vec()),
            DataRef::I32(v) => TensorData::I32(v.to_vec()),
            DataRef::Bool(v) => TensorData::Bool(v.to_vec()),
        };
        Tensor::new(self.dtype, self.shape.to_vec(), data)
    }

    fn len(&self) -> usize {
        match self.data {
            DataRef::F32(v) => v.len(),
            DataRef::I32(v) => v.len(),
            DataRef::Bool(v) => v.len(),
        }
    }
}

/// A caller's buffer that a run writes one result into, in place
/// ([`CpuProgram::run_into`]): dense, row-major, of the result's shape and storage type.
#[derive(Debug)]
pub struct OutRef<'a> {
    /// Size of each axis: the result's.
    pub shape: &'a [usize],
    /// The elements, overwritten.
    pub data: OutData<'a>,
}

/// The elements of an [`OutRef`]: f32 for an f32, f16 or bf16 result (the narrow ones hold
/// values already rounded to their type), i32 for an i32 result. Bool results have no in-place
/// form: the kernels store them as i32.
#[derive(Debug)]
pub enum OutData<'a> {
    /// f32 storage.
    F32(&'a mut [f32]),
    /// i32 storage.
    I32(&'a mut [i32]),
}

impl OutRef<'_> {
    /// Whether this buffer fits result `name` of `dtype` and `shape`: that shape, as many
    /// elements, and the storage type of `dtype`.
    pub fn check(&self, name: &str, dtype: DType, shape: &[usize]) -> Result<(), CpuError> {
        let (storage, fits) = match self.data {
            OutData::F32(_) => ("f32", matches!(dtype, DType::F32 | DType::F16 | DType::BF16)),
            OutData::I32(_) => ("i32", dtype == DType::I32),
        };
        let elems = shape.iter().try_fold(1usize, |a, d| a.checked_mul(*d));
        if fits && self.shape == shape && elems == Some(self.data.len()) {
            return Ok(());
        }
        Err(CpuError::OutputBuffer {
            name: name.to_string(),
            given: format!("{storage}{:?} ({} elements)", self.shape, self.data.len()),
            expected: format!("{dtype}{shape:?}"),
        })
    }
}

impl OutData<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            OutData::F32(v) => v.len(),
            OutData::I32(v) => v.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn ptr(&mut self) -> *mut u8 {
        match self {
            OutData::F32(v) => v.as_mut_ptr().cast(),
            OutData::I32(v) => v.as_mut_ptr().cast(),
        }
    }
}

/// Inputs checked against the parameters: converted copies of those not read in place (bools,
/// f16/bf16), and the dim bindings.
type Bound = (Vec<Option<Vec<u32>>>, HashMap<String, i64>);

/// Input shapes and given dims (sorted), and the dims [`bind_dims`] bound from them.
type BindKey = (Vec<Vec<usize>>, Vec<(String, i64)>, HashMap<String, i64>);

/// One entry point compiled to native code.
pub struct CpuProgram {
    graph: Graph,
    module: CpuModule,
    policy: Policy,
    code: jit::Code,
    threads: usize,
    state: Mutex<Option<ShapeState>>,
    /// The last run's input shapes and given dims, and the dims they bound (binding walks the
    /// graph; a serving loop repeats shapes).
    last_bind: Mutex<Option<BindKey>>,
    scratch: Mutex<Option<AlignedBuf>>,
    compile_time: Duration,
    /// Parameters whose values classify flash tiles (1-d i32 segment ids a mask reads).
    mask_params: Vec<usize>,
}

impl fmt::Debug for CpuProgram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CpuProgram").field("entry", &self.graph.name).field("steps", &self.module.schedule.steps.len()).finish()
    }
}

impl CpuProgram {
    /// Compiles `graph` with this machine's pipeline ([`cpu_compiler`]: optimize, schedule,
    /// render) and JIT-compiles it.
    pub fn compile(graph: &Graph, opts: &CpuOptions) -> Result<CpuProgram, CpuError> {
        let start = Instant::now();
        let compiler = cpu_compiler();
        let planned = compiler.plan(graph)?;
        CpuProgram::from_planned(&compiler, planned, opts, start)
    }

    /// JIT-compiles an entry the pipeline `compiler` (for the CPU) has planned.
    pub fn from_planned(compiler: &Compiler, planned: Planned, opts: &CpuOptions, start: Instant) -> Result<CpuProgram, CpuError> {
        let Planned { optimized, schedule, .. } = planned;
        CpuProgram::jit(optimized.graph, schedule, compiler.policy, opts, start)
    }

    /// Schedules and renders `graph` as it is (no optimisation) and JIT-compiles it.
    pub fn compile_graph(graph: &Graph, opts: &CpuOptions) -> Result<CpuProgram, CpuError> {
        let compiler = cpu_compiler();
        let schedule = compiler.schedule(graph)?;
        CpuProgram::jit(graph.clone(), schedule, compiler.policy, opts, Instant::now())
    }

    fn jit(graph: Graph, schedule: Schedule, policy: Policy, opts: &CpuOptions, start: Instant) -> Result<CpuProgram, CpuError> {
        let threads = thread_count(opts.threads)?;
        let isa = jit::host_isa()?;
        let module = clif::render(&schedule, &jit::features(&isa))?;
        let code = jit::load(isa, &module)?;
        let mask_params = attn_compiler::schedule::mask_data_params(&schedule);
        Ok(CpuProgram {
            mask_params,
            graph,
            module,
            policy,
            code,
            threads,
            state: Mutex::new(None),
            last_bind: Mutex::new(None),
            scratch: Mutex::new(None),
            compile_time: start.elapsed(),
        })
    }

    /// The graph that was compiled (after optimisation).
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The schedule the code renders.
    pub fn schedule(&self) -> &Schedule {
        &self.module.schedule
    }

    /// The generated code, as [`attnc build --emit clif`] prints it.
    pub fn clif_text(&self) -> String {
        let mut s = String::new();
        clif::write_module(&mut s, &self.module);
        s
    }

    /// Parameters in order, with their declared types.
    pub fn params(&self) -> Vec<(String, TensorType)> {
        self.graph.param_types()
    }

    /// Outputs in order, with their declared types.
    pub fn outputs(&self) -> Vec<(String, TensorType)> {
        self.graph.outputs().iter().map(|(n, v)| (n.clone(), self.graph.node(*v).ty.clone())).collect()
    }

    /// Threads runs use.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Sets the threads later runs use (0: one per available core; at most [`MAX_THREADS`]).
    pub fn set_threads(&mut self, threads: usize) -> Result<(), CpuError> {
        self.threads = thread_count(threads)?;
        Ok(())
    }

    /// Time from source graph to ready-to-run code.
    pub fn compile_time(&self) -> Duration {
        self.compile_time
    }

    /// What the last run's shape allocated (`None` before the first run).
    pub fn alloc_stats(&self) -> Option<AllocStats> {
        self.state.lock().ok().and_then(|s| s.as_ref().map(|s| s.stats.clone()))
    }

    /// Runs on owned tensors (one per parameter, in order).
    pub fn run_tensors(&self, inputs: &[Tensor], dims: &HashMap<String, i64>) -> Result<Vec<Tensor>, CpuError> {
        let refs: Vec<TensorRef> = inputs.iter().map(TensorRef::of).collect();
        self.run(&refs, dims)
    }

    /// Checks inputs against the parameters; returns the converted copies of the inputs that
    /// are not read in place (bools, f16/bf16) and the dim bindings.
    fn bind(&self, inputs: &[TensorRef], dims: &HashMap<String, i64>) -> Result<Bound, CpuError> {
        let params = self.graph.params();
        if inputs.len() != params.len() {
            return Err(CpuError::Input(ExecError::input_count(&self.graph, inputs.len())));
        }
        let mut owned: Vec<Option<Vec<u32>>> = vec![None; inputs.len()];
        for (i, (p, t)) in params.iter().zip(inputs).enumerate() {
            let node = self.graph.node(*p);
            let name = if let Op::Param(s) = &node.op { s.clone() } else { String::new() };
            let fits = matches!(
                (t.dtype, t.data),
                (DType::F32 | DType::F16 | DType::BF16, DataRef::F32(_)) | (DType::I32, DataRef::I32(_)) | (DType::Bool, DataRef::Bool(_))
            );
            if t.dtype != node.ty.dtype || !fits {
                return Err(CpuError::Input(ExecError::InputDType { param: name, expected: node.ty.dtype, actual: t.dtype }));
            }
            let expected = t.shape.iter().try_fold(1usize, |a, d| a.checked_mul(*d));
            if expected != Some(t.len()) {
                return Err(CpuError::Input(ExecError::InputData {
                    param: name,
                    shape: t.shape.to_vec(),
                    expected: expected.unwrap_or(usize::MAX),
                    actual: t.len(),
                }));
            }
            owned[i] = match (t.dtype, t.data) {
                (DType::Bool, DataRef::Bool(v)) => Some(v.iter().map(|b| u32::from(*b)).collect()),
                (DType::F16 | DType::BF16, DataRef::F32(v)) => {
                    Some(v.iter().map(|x| (t.dtype.round(f64::from(*x)) as f32).to_bits()).collect())
                }
                _ => None,
            };
        }
        let mut given: Vec<(String, i64)> = dims.iter().map(|(k, v)| (k.clone(), *v)).collect();
        given.sort();
        let same = |k: &BindKey| k.1 == given && k.0.len() == inputs.len() && k.0.iter().zip(inputs).all(|(a, t)| a.as_slice() == t.shape);
        let cached = self.last_bind.lock().ok().and_then(|last| last.as_ref().filter(|k| same(k)).map(|k| k.2.clone()));
        let mut env = match cached {
            Some(env) => env,
            None => {
                let shapes: Vec<Vec<usize>> = inputs.iter().map(|t| t.shape.to_vec()).collect();
                let env = bind_dims(&self.graph, &shapes, dims).map_err(CpuError::Input)?;
                if let Ok(mut last) = self.last_bind.lock() {
                    *last = Some((shapes, given, env.clone()));
                }
                env
            }
        };
        // 0-d i32 inputs by value: a mask that reads one (a window size) classifies its tiles by
        // it (`attn_compiler::ir::scalar_param_key`); the per-shape state is keyed by it too.
        for (i, (p, t)) in params.iter().zip(inputs).enumerate() {
            let ty = &self.graph.node(*p).ty;
            if ty.rank() == 0
                && ty.dtype == DType::I32
                && let DataRef::I32([v]) = t.data
            {
                env.insert(attn_compiler::ir::scalar_param_key(i), i64::from(*v));
            }
        }
        // i32 and bool inputs a flash mask reads (segment ids, a dense mask) classify its tiles
        // by their values: the per-shape state is keyed by what classification reads too (ids:
        // their values; block bounds: the bounds, one pass over the mask).
        for &i in &self.mask_params {
            let key = match inputs.get(i) {
                Some(TensorRef { data: DataRef::I32(v), shape, .. }) if attn_compiler::ir::RangeTable::is_exact(shape) => {
                    attn_compiler::exec::content_hash(v)
                }
                Some(t) => match data_table(t) {
                    Some(table) => table.content_key(),
                    None => continue,
                },
                None => continue,
            };
            env.insert(attn_compiler::ir::data_param_key(i), key);
        }
        Ok((owned, env))
    }

    /// The per-shape state for `env`, built unless the last run had the same dims.
    fn state<'s>(
        &self,
        guard: &'s mut Option<ShapeState>,
        env: &HashMap<String, i64>,
        inputs: &[TensorRef],
    ) -> Result<&'s ShapeState, CpuError> {
        let mut key: Vec<(String, i64)> = env.iter().map(|(k, v)| (k.clone(), *v)).collect();
        key.sort();
        if guard.as_ref().is_none_or(|s| s.prepared.key != key) {
            *guard = None;
            let data = self.mask_params.iter().filter_map(|&i| Some((i, std::sync::Arc::new(data_table(inputs.get(i)?)?)))).collect();
            *guard = Some(ShapeState::new(&self.module.schedule, env, &self.policy, &data)?);
        }
        guard.as_ref().ok_or_else(|| CpuError::Internal("no shape state".into()))
    }

    /// Plans the run of these inputs (sizes, tile tables, the intermediate arena) without
    /// running it, and reports what it allocates. A later run of the same shape reuses it.
    pub fn prepare(&self, inputs: &[TensorRef], dims: &HashMap<String, i64>) -> Result<AllocStats, CpuError> {
        let (_, env) = self.bind(inputs, dims)?;
        let mut guard = self.state.lock().map_err(|_| CpuError::Internal("a previous run panicked".into()))?;
        Ok(self.state(&mut guard, &env, inputs)?.stats.clone())
    }

    /// Runs on borrowed inputs (one per parameter, in order); `dims` gives sizes the inputs do
    /// not determine. Returns the outputs in order.
    ///
    /// Per-shape state (sizes, tile tables, the intermediate arena) is built on the first run
    /// of a shape and reused while the shape stays the same. Concurrent runs of one
    /// `CpuProgram` take turns.
    pub fn run(&self, inputs: &[TensorRef], dims: &HashMap<String, i64>) -> Result<Vec<Tensor>, CpuError> {
        let mut fresh: Vec<Option<OutRef<'_>>> = self.graph.outputs().iter().map(|_| None).collect();
        let results = self.run_into(inputs, dims, &mut fresh)?;
        results.into_iter().map(|t| t.ok_or_else(|| CpuError::Internal("a result was not returned".into()))).collect()
    }

    /// [`CpuProgram::run`], writing each result that `outputs` gives a buffer for into that
    /// buffer (the others are returned, as by `run`: `None` where written in place). Each
    /// buffer is checked against its result's shape and storage type before anything runs,
    /// and is only written, never read: what it held before does not matter.
    pub fn run_into(
        &self,
        inputs: &[TensorRef],
        dims: &HashMap<String, i64>,
        outputs: &mut [Option<OutRef<'_>>],
    ) -> Result<Vec<Option<Tensor>>, CpuError> {
        let (owned, env) = self.bind(inputs, dims)?;
        let results = self.graph.outputs();
        let shapes = self.result_shapes(&env, outputs)?;
        let mut guard = self.state.lock().map_err(|_| CpuError::Internal("a previous run panicked".into()))?;
        let state = self.state(&mut guard, &env, inputs)?;
        let plan = &self.module.schedule;
        let prepared = &state.prepared;

        // Outputs: the caller's buffers, or fresh memory per run, handed to the caller as is.
        let mut outs: Vec<Option<TensorData>> = Vec::with_capacity(plan.outputs.len());
        for (b, given) in plan.outputs.iter().zip(outputs.iter()) {
            outs.push(match given {
                Some(out) if out.data.len() < prepared.elems[*b] => {
                    return Err(CpuError::Internal(format!("result buffer b{b} needs {} elements", prepared.elems[*b])));
                }
                Some(_) => None,
                None => Some(match plan.buffers[*b].dtype {
                    DType::I32 | DType::Bool => TensorData::I32(vec![0; prepared.elems[*b]]),
                    _ => TensorData::F32(vec![0.0; prepared.elems[*b]]),
                }),
            });
        }
        // The fault record of checked indices: zero, then what the first bad index wrote.
        let mut fault = [0i32; 4];
        let mut bufs: Vec<*mut u8> = vec![std::ptr::null_mut(); plan.buffers.len()];
        for (b, buf) in plan.buffers.iter().enumerate() {
            bufs[b] = match buf.kind {
                BufferKind::Param(i) => match (&owned[i], inputs[i].data) {
                    (Some(v), _) => v.as_ptr() as *mut u8,
                    (None, DataRef::F32(v)) => v.as_ptr() as *mut u8,
                    (None, DataRef::I32(v)) => v.as_ptr() as *mut u8,
                    (None, DataRef::Bool(v)) => v.as_ptr() as *mut u8,
                },
                BufferKind::Output(i) => match (&mut outs[i], &mut outputs[i]) {
                    (Some(TensorData::F32(v)), _) => v.as_mut_ptr() as *mut u8,
                    (Some(TensorData::I32(v)), _) => v.as_mut_ptr() as *mut u8,
                    (Some(TensorData::Bool(v)), _) => v.as_mut_ptr() as *mut u8,
                    (None, Some(out)) => out.data.ptr(),
                    (None, None) => return Err(CpuError::Internal(format!("result buffer b{b} has no memory"))),
                },
                BufferKind::Temp => match prepared.arena[b] {
                    // SAFETY: `place` keeps every offset plus size within the arena.
                    Some(o) => unsafe { state.arena.as_ptr().add(o) },
                    None => state.arena.as_ptr(),
                },
                BufferKind::TileTable { .. } | BufferKind::Partials { .. } => {
                    state.side.get(&b).map_or(std::ptr::null_mut(), |m| m.as_ptr())
                }
                BufferKind::Fault => fault.as_mut_ptr() as *mut u8,
            };
        }
        let work = prepared.work(plan);
        // Per-thread scratch for the threads that will really run.
        let threads = exec::used_threads(&work, self.threads);
        let mut scratch = self.scratch.lock().map_err(|_| CpuError::Internal("a previous run panicked".into()))?;
        let need = prepared.scratch_bytes.checked_mul(threads).ok_or(CpuError::OutOfMemory { bytes: usize::MAX })?;
        if scratch.as_ref().is_none_or(|s| s.len() < need) {
            *scratch = Some(AlignedBuf::new(need)?);
        }
        let scratch_ptr = scratch.as_ref().map_or(std::ptr::null_mut(), |s| s.as_ptr());
        let args =
            exec::Args { bufs: bufs.as_ptr(), ints: prepared.ints.as_ptr(), scratch: scratch_ptr, scratch_bytes: prepared.scratch_bytes };
        exec::run(&work, &self.code.funcs, args, threads).map_err(|e| CpuError::Spawn { threads, reason: e.to_string() })?;
        if let Some(e) = plan.fault_error(fault) {
            return Err(CpuError::Input(e));
        }
        drop(scratch);
        drop(guard);

        results
            .iter()
            .zip(outs)
            .zip(shapes)
            .map(|(((_, v), data), shape)| {
                let Some(data) = data else { return Ok(None) };
                let dtype = self.graph.node(*v).ty.dtype;
                let data = match (dtype, data) {
                    (DType::Bool, TensorData::I32(v)) => TensorData::Bool(v.into_iter().map(|x| x != 0).collect()),
                    (_, d) => d,
                };
                Tensor::new(dtype, shape, data).map(Some).map_err(|e| CpuError::Internal(e.to_string()))
            })
            .collect()
    }

    /// Each result's shape at these sizes, with the buffers given for them (one entry per
    /// result) checked against it.
    fn result_shapes(&self, env: &HashMap<String, i64>, outputs: &[Option<OutRef<'_>>]) -> Result<Vec<Vec<usize>>, CpuError> {
        let results = self.graph.outputs();
        if outputs.len() != results.len() {
            return Err(CpuError::OutputCount { expected: results.len(), given: outputs.len() });
        }
        let mut shapes = Vec::with_capacity(results.len());
        for ((name, v), given) in results.iter().zip(outputs) {
            let ty = &self.graph.node(*v).ty;
            let shape: Vec<usize> = ty
                .shape
                .iter()
                .map(|d| env_eval(d, env))
                .collect::<Option<Vec<usize>>>()
                .ok_or_else(|| CpuError::Internal(format!("output shape {ty} does not evaluate")))?;
            if let Some(out) = given {
                out.check(name, ty.dtype, &shape)?;
            }
            shapes.push(shape);
        }
        Ok(shapes)
    }
}

fn env_eval(d: &attn_compiler::ir::Dim, env: &HashMap<String, i64>) -> Option<usize> {
    d.eval(env).ok().and_then(|v| usize::try_from(v).ok())
}
