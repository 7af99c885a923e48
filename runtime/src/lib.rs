//! attnc's embedding API: compile `.attn` programs and run them ([`Program`]) on the CPU
//! ([`cpu`], the `attn-cpu` crate), an NVIDIA GPU ([`cuda`], the `attn-cuda` crate) or the
//! reference interpreter; read and write tensor files ([`io`]); make seeded random inputs
//! ([`random`]); render diagnostics and results for people ([`report`]). The `attnc` command
//! line and the Python package are built on this crate.
//!
//! Depend on this crate only: the compiler's entry points ([`Compiler`], [`emit`], [`Stage`]),
//! the backends and the tensor type ([`Tensor`]) are re-exported here.

pub mod io;
mod program;
pub mod report;
#[cfg(test)]
mod semantics_tests;
mod target;

pub use attn_compiler::ir::{DType, TensorType};
pub use attn_compiler::random;
pub use attn_compiler::tensor::{Tensor, TensorData, TensorError};
pub use attn_compiler::{Compiler, Stage};
pub use attn_cpu as cpu;
pub use attn_cpu::kernels;
pub use attn_cuda as cuda;
pub use attn_dsl::Diagnostic;
pub use program::{CompileError, EntryInfo, LoadError, Program, RunError, RunOptions, suggest};
pub use target::{TARGET_NAMES, Target, TargetError};

use std::sync::Arc;

/// The pipeline for `target` with both renderers registered, so that [`Compiler::emit`] prints
/// every stage: this machine's CPU policy ([`cpu::cpu_compiler`]), or the default CUDA policy.
pub fn compiler(target: attn_compiler::schedule::Target) -> Compiler {
    let compiler = match target {
        attn_compiler::schedule::Target::Cpu => cpu::cpu_compiler(),
        attn_compiler::schedule::Target::Cuda => Compiler::for_target(target),
    };
    with_renderers(compiler)
}

/// `compiler` with the CPU and CUDA renderers registered for the `clif` and `cuda` stages.
pub fn with_renderers(compiler: Compiler) -> Compiler {
    compiler.with_renderer(Arc::new(cpu::ClifText)).with_renderer(Arc::new(cuda::CudaText))
}

/// The canonical text of one stage of every function, with default options (the same on every
/// machine): what `attnc build --emit` prints, and what users snapshot-test. Every stage,
/// rendered ones included.
pub fn emit(source: &str, stage: Stage) -> Result<String, Vec<Diagnostic>> {
    let compiler = with_renderers(Compiler::default());
    let compiled = compiler.check(source)?;
    compiler.emit(&compiled, stage, None).map_err(|e| vec![e.diagnostic()])
}
