//! The embedding API: compile a `.attn` program once, list its entry points, run them.
//!
//! ```
//! use attn_runtime::{Program, RunOptions, Tensor};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let program = Program::from_source("fn double(x: f32[N]) -> f32[N] { return x * 2 }", "double.attn")?;
//! let x = Tensor::f32(vec![3], vec![1.0, 2.0, 3.0])?;
//! let outputs = program.run("double", [("x", x)], &RunOptions::default())?;
//! assert_eq!(outputs[0].0, "out");
//! assert_eq!(outputs[0].1.to_f64_vec(), vec![2.0, 4.0, 6.0]);
//! # Ok(())
//! # }
//! ```

use crate::cpu::{CpuError, CpuOptions, CpuProgram, OutData, OutRef, TensorRef};
use crate::random::{self, DEFAULT_DIM, RandomError};
use crate::report::render_diagnostics;
use crate::target::Target;
use attn_compiler::exec::ExecError;
use attn_compiler::interp;
use attn_compiler::ir::grad::GradError;
use attn_compiler::ir::{Attr, DType, Dim, Graph, Module, Op, TensorType, verify};
use attn_compiler::tensor::{Tensor, TensorData, TensorError};
use attn_compiler::{Checked, Compiler, Derived, check};
use attn_dsl::ast::{ExprKind, Item, UnOp};
use attn_dsl::{Diagnostic, Severity};
use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use thiserror::Error;

/// A program that did not compile: its diagnostics, with the source they point into.
#[derive(Debug, Clone, Error)]
#[error("{file_name}: {}", summary(diagnostics))]
pub struct CompileError {
    /// Every problem found (parse errors, or type errors once the file parses).
    pub diagnostics: Vec<Diagnostic>,
    /// The program text the spans index into.
    pub source_text: String,
    /// The name shown in rendered diagnostics.
    pub file_name: String,
}

fn summary(diags: &[Diagnostic]) -> String {
    let errors = diags.iter().filter(|d| d.severity == Severity::Error).count();
    let first = diags.first().map_or(String::new(), |d| format!(" (first: {d})"));
    format!("{errors} error{} in the program{first}", if errors == 1 { "" } else { "s" })
}

impl CompileError {
    /// The diagnostics as boxed, labelled snippets (see [`render_diagnostics`]).
    pub fn render(&self, color: bool) -> String {
        render_diagnostics(&self.diagnostics, &self.file_name, &self.source_text, color)
    }
}

/// Why [`Program::from_file`] failed.
#[derive(Debug, Error)]
pub enum LoadError {
    /// The file could not be read (or is not UTF-8).
    #[error("cannot read {}: {source}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file was read but does not compile.
    #[error(transparent)]
    Compile(#[from] CompileError),
}

/// The signature of one entry point.
#[derive(Clone, Debug, PartialEq)]
pub struct EntryInfo {
    /// The function's name.
    pub name: String,
    /// Parameters in order, with their declared types.
    pub params: Vec<(String, TensorType)>,
    /// Results in order (`out` for a single unnamed result), with their types.
    pub outputs: Vec<(String, TensorType)>,
}

impl fmt::Display for EntryInfo {
    /// `name(q: f32[B, S, D], seg: i32[B, S]) -> (out: f32[B, S, D])`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |items: &[(String, TensorType)]| items.iter().map(|(n, t)| format!("{n}: {t}")).collect::<Vec<_>>().join(", ");
        write!(f, "{}({}) -> ({})", self.name, list(&self.params), list(&self.outputs))
    }
}

/// How to run an entry point.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunOptions {
    /// Sizes of dims the inputs do not determine (`--dim NAME=N`); may also repeat dims the
    /// inputs determine, which are then checked.
    pub dims: HashMap<String, i64>,
    /// Where to run.
    pub target: Target,
}

/// Why an entry point could not be run.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum RunError {
    /// No function of that name.
    #[error("no function named `{name}` (the program has: {})", available.join(", "))]
    UnknownEntry {
        /// The name asked for.
        name: String,
        /// The functions the program has.
        available: Vec<String>,
    },
    /// The program has no function at all.
    #[error("the program defines no function to run")]
    NoEntry,
    /// Inputs the entry needs that were not given.
    #[error("missing input{} for `{entry}`: {} (the entry is {signature})", plural(names), quoted(names))]
    MissingInputs {
        /// The entry.
        entry: String,
        /// The parameters without an input, in order.
        names: Vec<String>,
        /// The entry's signature.
        signature: String,
    },
    /// An input whose name is no parameter of the entry.
    #[error("`{entry}` has no parameter named `{name}`{} (its parameters: {})", suggestion.as_ref().map_or(String::new(), |s| format!("; did you mean `{s}`?")), params.join(", "))]
    UnexpectedInput {
        /// The entry.
        entry: String,
        /// The name given.
        name: String,
        /// The entry's parameter names.
        params: Vec<String>,
        /// A parameter with a similar name.
        suggestion: Option<String>,
    },
    /// The same input given twice.
    #[error("input `{name}` is given more than once")]
    DuplicateInput {
        /// The parameter.
        name: String,
    },
    /// An input tensor whose dtype is neither the declared one nor losslessly widenable to it.
    #[error("input `{param}` is declared {declared} but a {given} tensor was given")]
    InputDType {
        /// The parameter.
        param: String,
        /// The tensor's dtype.
        given: DType,
        /// The declared dtype.
        declared: DType,
    },
    /// A given dim the entry does not use.
    #[error("`{entry}` has no dimension named `{name}` (its dimensions: {})", if known.is_empty() { "none".to_string() } else { known.join(", ") })]
    UnknownDim {
        /// The entry.
        entry: String,
        /// The name given.
        name: String,
        /// The dims the entry uses, sorted.
        known: Vec<String>,
    },
    /// A given dim that no function of the program uses (a check of the whole program,
    /// [`Program::check_given_dims`] without an entry).
    #[error("no function of the program has a dimension named `{name}` (their dimensions: {})", if known.is_empty() { "none".to_string() } else { known.join(", ") })]
    UnknownProgramDim {
        /// The name given.
        name: String,
        /// The dims the functions use, sorted.
        known: Vec<String>,
    },
    /// A given dim that contradicts `dim NAME = N` in the file.
    #[error("dimension `{name}` is fixed to {fixed} by `dim {name} = {fixed}` in the program, but {given} was given")]
    FixedDim {
        /// The dim.
        name: String,
        /// The size given.
        given: i64,
        /// The size the file fixes.
        fixed: i64,
    },
    /// A given dim that the signature divides (`D/2`) but the size given does not divide.
    #[error("dimension `{name}` is divided by {divisor} in the signature ({name} = {divisor}*({name}/{divisor})), but {given} was given")]
    IndivisibleDim {
        /// The dim.
        name: String,
        /// The size given.
        given: i64,
        /// The divisor (the least common multiple of the signature's divisors of the name).
        divisor: i64,
    },
    /// Random inputs could not be made.
    #[error(transparent)]
    Random(#[from] RandomError),
    /// The interpreter rejected the inputs or failed while running. (The CPU target reports
    /// input and dim mismatches with these errors too.)
    #[error(transparent)]
    Interp(#[from] ExecError),
    /// The CPU target could not compile or run the entry.
    #[error(transparent)]
    Cpu(CpuError),
    /// The CUDA target is unavailable here (no driver, device or NVRTC), or could not compile
    /// or run the entry.
    #[error(transparent)]
    Cuda(crate::cuda::CudaError),
    /// The entry cannot be differentiated ([`Program::grad`]).
    #[error(transparent)]
    Grad(#[from] GradError),
    /// The buffers given for the results ([`Program::run_borrowed_into`]) are not one per
    /// result, or one does not fit its result.
    #[error(transparent)]
    Output(CpuError),
}

impl RunError {
    /// The parameter an input error is about.
    pub fn param(&self) -> Option<&str> {
        match self {
            RunError::InputDType { param, .. } => Some(param),
            RunError::Interp(e) => e.param(),
            _ => None,
        }
    }
}

/// The code of a run-time error shown against the source (see `docs/diagnostics.md`).
pub const INPUT_MISMATCH: &str = "E0401";
/// The code of an index out of range at run time (a gather, `take_along`, `scatter_add`).
pub const INDEX_OUT_OF_RANGE: &str = "E0402";
/// The code of a slice whose bounds lie outside its axis at run time.
pub const SLICE_OUT_OF_RANGE: &str = "E0403";
/// The code of a size that evaluates to a negative number at run time (`S - 4` with `S = 2`).
pub const NEGATIVE_SIZE: &str = "E0404";

impl From<crate::cuda::CudaError> for RunError {
    /// Input problems become [`RunError::Interp`], as on the interpreter.
    fn from(e: crate::cuda::CudaError) -> RunError {
        match e {
            crate::cuda::CudaError::Input(e) => RunError::Interp(e),
            e => RunError::Cuda(e),
        }
    }
}

impl From<CpuError> for RunError {
    /// Input problems become [`RunError::Interp`], as on the interpreter.
    fn from(e: CpuError) -> RunError {
        match e {
            CpuError::Input(e) => RunError::Interp(e),
            e @ (CpuError::OutputCount { .. } | CpuError::OutputBuffer { .. }) => RunError::Output(e),
            e => RunError::Cpu(e),
        }
    }
}

fn plural(items: &[String]) -> &'static str {
    if items.len() == 1 { "" } else { "s" }
}

fn quoted(items: &[String]) -> String {
    items.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
}

/// Entries compiled for the CPU target, by name and thread count (shared by clones).
type CpuCache = Arc<Mutex<HashMap<(String, usize), Arc<CpuProgram>>>>;

/// Per entry: its dims ([`Program::entry_dims`]) and signature, formed once (a run's fixed
/// cost at small sizes is mostly this bookkeeping).
type EntryCache = Arc<Mutex<HashMap<String, EntryMeta>>>;

/// One entry's dims and signature, shared by its runs.
type EntryMeta = Arc<(Vec<String>, EntryInfo)>;

/// A compiled program, ready to run any of its entry points.
#[derive(Clone, Debug)]
pub struct Program {
    checked: Checked,
    source: String,
    file_name: String,
    fixed_dims: Vec<(String, i64)>,
    /// Entries compiled for the CPU target by [`Program::run`], by name and thread count.
    cpu: CpuCache,
    /// Each run entry's dims and signature.
    entries: EntryCache,
    /// For a program made by [`Program::grad`]: how its backward pass was built
    /// ([`attn_compiler::Derived::fused`]).
    backward: Option<Result<Vec<String>, String>>,
}

impl Program {
    /// Compiles `source`; `file_name` is only used when rendering diagnostics.
    pub fn from_source(source: &str, file_name: &str) -> Result<Program, CompileError> {
        let checked = check(source).map_err(|diagnostics| CompileError {
            diagnostics,
            source_text: source.to_string(),
            file_name: file_name.to_string(),
        })?;
        let fixed_dims = checked
            .ast
            .items
            .iter()
            .filter_map(|item| match item {
                Item::Dim(c) => int_literal(&c.value.kind).map(|v| (c.name.name.clone(), v)),
                _ => None,
            })
            .collect();
        Ok(Program {
            checked,
            source: source.to_string(),
            file_name: file_name.to_string(),
            fixed_dims,
            cpu: Arc::default(),
            entries: Arc::default(),
            backward: None,
        })
    }

    /// Reads and compiles a `.attn` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Program, LoadError> {
        let path = path.as_ref();
        let source = std::fs::read_to_string(path).map_err(|source| LoadError::Unreadable { path: path.to_path_buf(), source })?;
        Ok(Program::from_source(&source, &path.display().to_string())?)
    }

    /// The program text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The name diagnostics use for the file.
    pub fn file_name(&self) -> &str {
        &self.file_name
    }

    /// The warnings the checker found (the program is accepted; see `docs/diagnostics.md`).
    pub fn warnings(&self) -> &[Diagnostic] {
        &self.checked.warnings
    }

    /// The warnings as boxed, labelled snippets (see [`render_diagnostics`]).
    pub fn render_warnings(&self, color: bool) -> String {
        render_diagnostics(&self.checked.warnings, &self.file_name, &self.source, color)
    }

    /// The syntax tree and IR.
    pub fn checked(&self) -> &Checked {
        &self.checked
    }

    /// The IR of every function.
    pub fn module(&self) -> &Module {
        &self.checked.module
    }

    /// Dims fixed for the whole file by `dim NAME = N`.
    pub fn fixed_dims(&self) -> &[(String, i64)] {
        &self.fixed_dims
    }

    /// The IR graph of one function.
    pub fn graph(&self, entry: &str) -> Result<&Graph, RunError> {
        self.checked.module.graphs.iter().find(|g| g.name == entry).ok_or_else(|| RunError::UnknownEntry {
            name: entry.to_string(),
            available: self.checked.module.graphs.iter().map(|g| g.name.clone()).collect(),
        })
    }

    /// For a run error about an input of `entry`: a diagnostic (E0401) pointing at the
    /// parameter's declaration with its declared type, and the given tensor's dtype and shape
    /// when `given` (name, dtype, shape of each input) holds it. `None` when the error is about
    /// no parameter.
    pub fn run_error_diagnostic(&self, entry: &str, err: &RunError, given: &[(String, DType, Vec<usize>)]) -> Option<Diagnostic> {
        if let RunError::Interp(fault) = err
            && let Some(span) = fault.span()
        {
            match fault {
                ExecError::IndexOutOfRange { index, axis, size, .. } => {
                    let what = format!("index {index} is out of range for axis {axis} of size {size}");
                    return Some(
                        Diagnostic::error(INDEX_OUT_OF_RANGE, what, span, format!("indexed here: every index must lie in 0..{size}"))
                            .with_help("indices are never clamped or wrapped; `clamp(i, 0, n - 1)` in the program clamps them explicitly"),
                    );
                }
                ExecError::OutOfRange { axis, start, end, size, .. } => {
                    let what = format!("slice {start}:{end} is out of range for axis {axis} of size {size}");
                    return Some(
                        Diagnostic::error(SLICE_OUT_OF_RANGE, what, span, format!("sliced here: the bounds must lie in 0..={size}"))
                            .with_help("the axis' size depends on the dims of this run; bounds written with dims follow them"),
                    );
                }
                ExecError::NegativeDim { dim, value, .. } => {
                    let what = format!("size {dim} evaluates to {value}, which is negative");
                    return Some(
                        Diagnostic::error(NEGATIVE_SIZE, what, span, format!("this has an axis of size {dim}"))
                            .with_help("the dims of this run make this size negative; pass dims (or inputs) for which it is at least 0"),
                    );
                }
                _ => {}
            }
        }
        let param = err.param()?;
        let graph = self.graph(entry).ok()?;
        let node = graph.params().iter().map(|p| graph.node(*p)).find(|n| matches!(&n.op, Op::Param(name) if name == param))?;
        let span = node.span?;
        let mut d = Diagnostic::error(INPUT_MISMATCH, err.to_string(), span, format!("`{param}` is declared {} here", node.ty));
        if let Some((_, dtype, shape)) = given.iter().find(|(n, _, _)| n == param) {
            d = d.with_help(format!("the input given for `{param}` is {dtype}{shape:?}"));
        }
        Some(d)
    }

    /// Every function, in source order, with its signature.
    pub fn entries(&self) -> Vec<EntryInfo> {
        self.checked.module.graphs.iter().map(entry_info).collect()
    }

    /// The signature of one function.
    pub fn entry(&self, name: &str) -> Result<EntryInfo, RunError> {
        self.graph(name).map(entry_info)
    }

    /// The entry `attnc run` uses without `--entry`: the last function in the file.
    pub fn default_entry(&self) -> Option<EntryInfo> {
        self.checked.module.graphs.last().map(entry_info)
    }

    /// The dim names an entry uses (in its types, dim values and slice bounds), sorted. Dims
    /// fixed by `dim NAME = N` are already numbers in the IR and are not listed.
    pub fn entry_dims(&self, entry: &str) -> Result<Vec<String>, RunError> {
        let graph = self.graph(entry)?;
        let mut names = BTreeSet::new();
        for v in graph.values() {
            let node = graph.node(v);
            names.extend(node.ty.shape.iter().flat_map(|d| d.symbols()));
            for (_, attr) in node.op.attrs() {
                if let Attr::Dim(d) = attr {
                    names.extend(d.symbols());
                }
            }
        }
        Ok(names.into_iter().collect())
    }

    /// Checks given dims as [`Program::run`] does: each must be a dim `entry` uses, or one the
    /// file fixes (`dim NAME = N`) given that size. Without an entry (every function), each must
    /// be used by some function ([`RunError::UnknownProgramDim`] otherwise).
    pub fn check_given_dims(&self, entry: Option<&str>, given: &HashMap<String, i64>) -> Result<(), RunError> {
        let graphs = &self.checked.module.graphs;
        let entry = match (entry, graphs.as_slice()) {
            (Some(entry), _) => entry,
            (None, [only]) => only.name.as_str(),
            (None, _) => {
                let mut known = BTreeSet::new();
                for g in graphs {
                    known.extend(self.entry_dims(&g.name)?);
                }
                let mut sorted: Vec<(&String, &i64)> = given.iter().collect();
                sorted.sort();
                for (name, value) in sorted {
                    match self.fixed_dims.iter().find(|(n, _)| n == name) {
                        Some((_, fixed)) if fixed != value => {
                            return Err(RunError::FixedDim { name: name.clone(), given: *value, fixed: *fixed });
                        }
                        Some(_) => {}
                        None if known.contains(name) || quotient_of(name, known.iter()).is_some() => {}
                        None => return Err(RunError::UnknownProgramDim { name: name.clone(), known: known.into_iter().collect() }),
                    }
                }
                return Ok(());
            }
        };
        self.check_dims(entry, given, &self.entry_dims(entry)?).map(drop)
    }

    /// The dims [`Program::random_inputs`] uses: `given`, plus [`DEFAULT_DIM`] (8) for every
    /// other dim the entry uses (dims written as expressions such as `H*Dh` follow from their
    /// names). Passing them as [`RunOptions::dims`] runs the entry on those inputs.
    pub fn random_dims(&self, entry: &str, given: &HashMap<String, i64>) -> Result<HashMap<String, i64>, RunError> {
        let known = self.entry_dims(entry)?;
        let given = self.check_dims(entry, given, &known)?;
        let mut env = given.clone();
        for name in known {
            env.entry(name).or_insert(DEFAULT_DIM);
        }
        Ok(env)
    }

    /// Seeded random inputs for `entry`, in parameter order: floats ~ N(0, 1), i32 inputs are
    /// segment ids (non-decreasing along the last axis, in `[0, 4)`), bools fair coin flips.
    /// Dims as [`Program::random_dims`]: given ones, else 8. The same seed and dims always give
    /// the same tensors.
    pub fn random_inputs(&self, entry: &str, seed: u64, dims: &HashMap<String, i64>) -> Result<Vec<(String, Tensor)>, RunError> {
        let env = self.random_dims(entry, dims)?;
        let info = self.entry(entry)?;
        Ok(random::random_inputs(&info.params, seed, &env)?)
    }

    /// Runs `entry` on named inputs (one per parameter, any order) and returns the named
    /// outputs in declaration order.
    ///
    /// An input's dtype must be the parameter's, or widen losslessly to it (an f16 or bf16
    /// tensor for an f32 parameter). Missing, unknown or repeated input names are errors that
    /// name them; so are given dims the entry does not use or that contradict a `dim` item.
    pub fn run<S: AsRef<str>>(
        &self,
        entry: &str,
        inputs: impl IntoIterator<Item = (S, Tensor)>,
        opts: &RunOptions,
    ) -> Result<Vec<(String, Tensor)>, RunError> {
        self.run_with(entry, inputs, opts, &CpuOptions::default())
    }

    /// [`Program::run`] with CPU options (thread count) for [`Target::Cpu`].
    pub fn run_with<S: AsRef<str>>(
        &self,
        entry: &str,
        inputs: impl IntoIterator<Item = (S, Tensor)>,
        opts: &RunOptions,
        cpu: &CpuOptions,
    ) -> Result<Vec<(String, Tensor)>, RunError> {
        let (graph, meta, dims) = self.begin_run(entry, opts)?;
        let info = &meta.1;
        let params: Vec<String> = info.params.iter().map(|(n, _)| n.clone()).collect();
        let mut slots: Vec<Option<Tensor>> = vec![None; params.len()];
        for (name, tensor) in inputs {
            let name = name.as_ref();
            let Some(index) = params.iter().position(|p| p == name) else {
                return Err(RunError::UnexpectedInput {
                    entry: entry.to_string(),
                    name: name.to_string(),
                    suggestion: suggest(name, &params),
                    params,
                });
            };
            if slots[index].is_some() {
                return Err(RunError::DuplicateInput { name: name.to_string() });
            }
            slots[index] = Some(widen(name, tensor, info.params[index].1.dtype)?);
        }
        let missing: Vec<String> = params.iter().zip(&slots).filter(|(_, s)| s.is_none()).map(|(n, _)| n.clone()).collect();
        if !missing.is_empty() {
            return Err(RunError::MissingInputs { entry: entry.to_string(), names: missing, signature: info.to_string() });
        }
        let tensors: Vec<Tensor> = slots.into_iter().flatten().collect();
        let results = match opts.target {
            Target::Interp => interp::run(graph, &tensors, &dims)?,
            Target::Cpu => self.cpu_entry(entry, cpu)?.run_tensors(&tensors, &dims)?,
            Target::Cuda => crate::cuda::run(graph, &tensors, &dims)?,
        };
        Ok(info.outputs.iter().map(|(n, _)| n.clone()).zip(results).collect())
    }

    /// Runs `entry` on borrowed inputs, one per parameter in order (the zero-copy door the
    /// Python package uses). On [`Target::Cpu`], f32 and i32 data are read in place; the other
    /// targets copy the inputs into owned tensors first. Dims are checked as in
    /// [`Program::run`]; each input's dtype must be its parameter's.
    pub fn run_borrowed(
        &self,
        entry: &str,
        inputs: &[TensorRef],
        opts: &RunOptions,
        cpu: &CpuOptions,
    ) -> Result<Vec<(String, Tensor)>, RunError> {
        let (graph, meta, dims) = self.begin_run(entry, opts)?;
        let info = &meta.1;
        check_borrowed(graph, entry, info, inputs)?;
        let results = match opts.target {
            Target::Cpu => self.cpu_entry(entry, cpu)?.run(inputs, &dims)?,
            target => {
                let mut owned = Vec::with_capacity(inputs.len());
                for ((name, _), t) in info.params.iter().zip(inputs) {
                    owned.push(t.to_tensor().map_err(|e| match e {
                        TensorError::Length { shape, expected, actual } => {
                            RunError::Interp(ExecError::InputData { param: name.clone(), shape, expected, actual })
                        }
                        TensorError::Storage { .. } => {
                            RunError::Interp(ExecError::InputDType { param: name.clone(), expected: t.dtype, actual: t.dtype })
                        }
                    })?);
                }
                match target {
                    Target::Interp => interp::run(graph, &owned, &dims)?,
                    _ => crate::cuda::run(graph, &owned, &dims)?,
                }
            }
        };
        Ok(info.outputs.iter().map(|(n, _)| n.clone()).zip(results).collect())
    }

    /// [`Program::run_borrowed`], writing each result that `outputs` gives a buffer for into
    /// that buffer: `None` in the returned list where it did. On [`Target::Cpu`] the kernels
    /// write into the buffers directly (each checked against its result's shape and storage
    /// type before anything runs); the other targets copy their results in. A buffer is only
    /// written, never read, so it must not overlap an input.
    pub fn run_borrowed_into(
        &self,
        entry: &str,
        inputs: &[TensorRef],
        outputs: &mut [Option<OutRef<'_>>],
        opts: &RunOptions,
        cpu: &CpuOptions,
    ) -> Result<Vec<(String, Option<Tensor>)>, RunError> {
        let names = self.entry(entry)?.outputs.into_iter().map(|(n, _)| n);
        if opts.target == Target::Cpu {
            // The checks of `run_borrowed`, then the CPU writes in place.
            let (graph, meta, dims) = self.begin_run(entry, opts)?;
            check_borrowed(graph, entry, &meta.1, inputs)?;
            let results = self.cpu_entry(entry, cpu)?.run_into(inputs, &dims, outputs)?;
            return Ok(names.zip(results).collect());
        }
        if outputs.len() != self.entry(entry)?.outputs.len() {
            return Err(RunError::Output(CpuError::OutputCount { expected: self.entry(entry)?.outputs.len(), given: outputs.len() }));
        }
        let results = self.run_borrowed(entry, inputs, opts, cpu)?;
        let mut written = Vec::with_capacity(results.len());
        for ((name, tensor), out) in results.into_iter().zip(outputs.iter_mut()) {
            let Some(out) = out else {
                written.push((name, Some(tensor)));
                continue;
            };
            out.check(&name, tensor.dtype, &tensor.shape).map_err(RunError::Output)?;
            match (&mut out.data, &tensor.data) {
                (OutData::F32(o), TensorData::F32(v)) => o.copy_from_slice(v),
                (OutData::I32(o), TensorData::I32(v)) => o.copy_from_slice(v),
                _ => return Err(RunError::Cpu(CpuError::Internal(format!("result `{name}` is not stored as its dtype says")))),
            }
            written.push((name, None));
        }
        Ok(written)
    }

    /// The dtypes and shapes of `entry`'s results for inputs of these shapes (and `opts`'s
    /// dims): what a caller allocates for [`Program::run_cuda_device`].
    pub fn output_shapes(&self, entry: &str, shapes: &[Vec<usize>], opts: &RunOptions) -> Result<Vec<(DType, Vec<usize>)>, RunError> {
        let (graph, _, dims) = self.begin_run(entry, opts)?;
        Ok(crate::cuda::output_shapes(graph, shapes, &dims)?)
    }

    /// Runs `entry` on the CUDA target on tensors already in device memory, writing its results
    /// into `outputs`, ordered on the caller's `stream`; `known` gives host copies of inputs
    /// (sizes, ids) the caller holds (see [`crate::cuda::run_device`]).
    ///
    /// # Safety
    /// As [`crate::cuda::run_device`]: live, dense, non-overlapping device allocations of
    /// device 0's primary context, and a live stream of it (or 0).
    pub unsafe fn run_cuda_device(
        &self,
        entry: &str,
        inputs: &[crate::cuda::DeviceTensor],
        outputs: &[crate::cuda::DeviceTensor],
        opts: &RunOptions,
        stream: u64,
        known: &HashMap<usize, Tensor>,
    ) -> Result<(), RunError> {
        let (graph, meta, dims) = self.begin_run(entry, opts)?;
        let info = &meta.1;
        if inputs.len() < info.params.len() {
            let names = info.params[inputs.len()..].iter().map(|(n, _)| n.clone()).collect();
            return Err(RunError::MissingInputs { entry: entry.to_string(), names, signature: info.to_string() });
        }
        // SAFETY: the caller's contract, passed on.
        Ok(unsafe { crate::cuda::run_device(graph, inputs, outputs, &dims, stream, known) }?)
    }

    /// `entry` with its gradients, as a program of one entry point, `<entry>_grad`: it takes
    /// `entry`'s inputs plus a cotangent `d_<result>` for each float result, and returns the
    /// results plus `d_<param>` for each float parameter (or each one named in `wrt`). Run it
    /// like any entry; its forward part is fused as usual. See
    /// [`attn_compiler::ir::grad`] for the rules and subgradients.
    pub fn grad(&self, entry: &str, wrt: Option<&[String]>) -> Result<Program, RunError> {
        let Derived { graph: derived, fused } = Compiler::default().differentiate(self.graph(entry)?, wrt)?;
        if let Err(errors) = verify(&derived) {
            let reason = errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ");
            return Err(RunError::Grad(GradError::Internal { graph: entry.to_string(), reason }));
        }
        let mut checked = self.checked.clone();
        checked.module.graphs = vec![derived];
        Ok(Program { checked, cpu: Arc::default(), entries: Arc::default(), backward: Some(fused), ..self.clone() })
    }

    /// The entry's gradients in two halves, for autograd integrations that run the forward and
    /// the backward at different times: entry `<entry>_fwd` returns the entry's results, then
    /// `saved_out<n>` and `saved_lse<n>` (each fused flash op's result and per-row log-sum-exp);
    /// entry `<entry>_bwd` takes the inputs, a cotangent `d_<result>` per float result, and
    /// those saved values, and returns the gradients as [`Program::grad`] does, without running
    /// the flash forward again. `None` when the backward is not fused (nothing to save): use
    /// [`Program::grad`].
    pub fn grad_split(&self, entry: &str, wrt: Option<&[String]>) -> Result<Option<Program>, RunError> {
        let graph = self.graph(entry)?;
        let Derived { graph: derived, fused } = Compiler::default().differentiate(graph, wrt)?;
        let Ok(fused) = fused else { return Ok(None) };
        let Some((fwd, bwd)) = attn_compiler::ir::grad::split_saved(&derived, graph.params().len(), graph.outputs().len(), entry) else {
            return Ok(None);
        };
        for g in [&fwd, &bwd] {
            if let Err(errors) = verify(g) {
                let reason = errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ");
                return Err(RunError::Grad(GradError::Internal { graph: entry.to_string(), reason }));
            }
        }
        let mut checked = self.checked.clone();
        checked.module.graphs = vec![fwd, bwd];
        Ok(Some(Program { checked, cpu: Arc::default(), entries: Arc::default(), backward: Some(Ok(fused)), ..self.clone() }))
    }

    /// For a program made by [`Program::grad`], how its backward pass was built: one line per
    /// fused flash backward (`Ok`), or why the program was differentiated op by op, unfused
    /// (`Err`). `None` for other programs.
    pub fn backward(&self) -> Option<&Result<Vec<String>, String>> {
        self.backward.as_ref()
    }

    /// Compiles `entry` for [`Target::Cpu`] with `opts` now, so that the first
    /// [`Program::run_with`] or [`Program::run_borrowed`] does not pay for it (and a schedule or
    /// code-generation failure shows up here).
    pub fn prepare_cpu(&self, entry: &str, opts: &CpuOptions) -> Result<(), RunError> {
        self.cpu_entry(entry, opts).map(|_| ())
    }

    /// Compiles an entry point to native code for the CPU (optimised, JIT-compiled): compile
    /// once, then [`CpuProgram::run`] it many times on borrowed data.
    pub fn compile_cpu(&self, entry: &str, opts: &CpuOptions) -> Result<CpuProgram, RunError> {
        Ok(CpuProgram::compile(self.graph(entry)?, opts)?)
    }

    /// The entry compiled for [`Target::Cpu`] with `opts`, compiled on first use.
    fn cpu_entry(&self, entry: &str, opts: &CpuOptions) -> Result<Arc<CpuProgram>, RunError> {
        let mut cache = self.cpu.lock().map_err(|_| RunError::Cpu(CpuError::Internal("a previous compile panicked".into())))?;
        let key = (entry.to_string(), opts.threads);
        if let Some(c) = cache.get(&key) {
            return Ok(c.clone());
        }
        let c = Arc::new(self.compile_cpu(entry, opts)?);
        cache.insert(key, c.clone());
        Ok(c)
    }

    /// The entry's graph and signature, and the given dims checked ([`Program::check_dims`]).
    fn begin_run(&self, entry: &str, opts: &RunOptions) -> Result<(&Graph, EntryMeta, HashMap<String, i64>), RunError> {
        let graph = self.graph(entry)?;
        let cached = self.entries.lock().ok().and_then(|c| c.get(entry).cloned());
        let meta = match cached {
            Some(m) => m,
            None => {
                let m = Arc::new((self.entry_dims(entry)?, entry_info(graph)));
                if let Ok(mut c) = self.entries.lock() {
                    c.insert(entry.to_string(), m.clone());
                }
                m
            }
        };
        let dims = if opts.dims.is_empty() { HashMap::new() } else { self.check_dims(entry, &opts.dims, &meta.0)? };
        Ok((graph, meta, dims))
    }

    /// Checks given dims against the entry and the file's `dim` items; returns the ones to pass
    /// on (a dim fixed by the file is already a number in the IR).
    fn check_dims(&self, entry: &str, given: &HashMap<String, i64>, known: &[String]) -> Result<HashMap<String, i64>, RunError> {
        let mut sorted: Vec<(&String, &i64)> = given.iter().collect();
        sorted.sort();
        let mut out = HashMap::new();
        for (name, value) in sorted {
            if let Some((_, fixed)) = self.fixed_dims.iter().find(|(n, _)| n == name) {
                if fixed != value {
                    return Err(RunError::FixedDim { name: name.clone(), given: *value, fixed: *fixed });
                }
            } else if known.contains(name) {
                out.insert(name.clone(), *value);
            } else if let Some((q, divisor)) = quotient_of(name, known.iter()) {
                // `--dim D=64` where the signature divides D: D is `divisor · (D/divisor)`.
                if value % divisor != 0 {
                    return Err(RunError::IndivisibleDim { name: name.clone(), given: *value, divisor });
                }
                out.insert(q.clone(), value / divisor);
            } else {
                return Err(RunError::UnknownDim { entry: entry.to_string(), name: name.clone(), known: known.to_vec() });
            }
        }
        Ok(out)
    }
}

/// The quotient dim (`D/2`) among `known` that stands for the name `name` divided, with its
/// divisor.
fn quotient_of<'a>(name: &str, known: impl IntoIterator<Item = &'a String>) -> Option<(&'a String, i64)> {
    known.into_iter().find_map(|k| match Dim::quotient_parts(k) {
        Some((n, d)) if n == name => Some((k, d)),
        _ => None,
    })
}

/// Borrowed inputs checked against `entry`'s parameters: one each, of the declared dtype.
fn check_borrowed(graph: &Graph, entry: &str, info: &EntryInfo, inputs: &[TensorRef]) -> Result<(), RunError> {
    if inputs.len() < info.params.len() {
        let names = info.params[inputs.len()..].iter().map(|(n, _)| n.clone()).collect();
        return Err(RunError::MissingInputs { entry: entry.to_string(), names, signature: info.to_string() });
    }
    if inputs.len() > info.params.len() {
        return Err(RunError::Interp(ExecError::input_count(graph, inputs.len())));
    }
    for ((name, ty), t) in info.params.iter().zip(inputs) {
        if t.dtype != ty.dtype {
            return Err(RunError::InputDType { param: name.clone(), given: t.dtype, declared: ty.dtype });
        }
    }
    Ok(())
}

fn entry_info(graph: &Graph) -> EntryInfo {
    let params = graph.params().iter().map(|p| (graph.param_name(*p).to_string(), graph.node(*p).ty.clone())).collect();
    let outputs = graph.outputs().iter().map(|(n, v)| (n.clone(), graph.node(*v).ty.clone())).collect();
    EntryInfo { name: graph.name.clone(), params, outputs }
}

/// `dim H = 8` or `dim H = -8`: the integer, if the value is an integer literal.
fn int_literal(kind: &ExprKind) -> Option<i64> {
    match kind {
        ExprKind::Int(v) => Some(*v),
        ExprKind::Unary(UnOp::Neg, inner) => int_literal(&inner.kind).map(|v| -v),
        _ => None,
    }
}

/// Accepts the declared dtype, or an f16/bf16 tensor for an f32 parameter (exact).
fn widen(param: &str, tensor: Tensor, declared: DType) -> Result<Tensor, RunError> {
    match (tensor.dtype, declared) {
        (a, b) if a == b => Ok(tensor),
        (DType::F16 | DType::BF16, DType::F32) => Ok(Tensor { dtype: DType::F32, ..tensor }),
        (given, declared) => Err(RunError::InputDType { param: param.to_string(), given, declared }),
    }
}

/// The candidate closest to `name` by edit distance (ignoring case), if close enough to be a
/// likely typo: for "did you mean ...?" hints.
pub fn suggest(name: &str, candidates: &[String]) -> Option<String> {
    candidates
        .iter()
        .map(|c| (edit_distance(&name.to_lowercase(), &c.to_lowercase()), c))
        // Short names: one edit at most (and none for one-letter names, where any letter is one edit away).
        .filter(|(d, c)| *d <= [0, 0, 1, 1, 1].get(c.chars().count()).copied().unwrap_or(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c.clone())
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests;
