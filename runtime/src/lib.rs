//! attnc's runtime: compile `.attn` programs and run them ([`Program`]), read and write tensor
//! files ([`io`]), make seeded random inputs ([`random`]) and render diagnostics and results for
//! people ([`report`]). The `attnc` command line is built on this crate.
//!
//! Depend on this crate only: the compiler's entry points ([`Compiler`], [`emit`], [`Stage`])
//! and the tensor type ([`Tensor`]) are re-exported here.

pub mod cpu;
pub mod cuda;
pub mod io;
pub mod kernels;
pub mod pictures;
mod program;
pub mod random;
pub mod report;
#[cfg(test)]
mod semantics_tests;
mod target;

pub use attn_compiler::ir::{DType, TensorType};
pub use attn_compiler::tensor::{Tensor, TensorData, TensorError};
pub use attn_compiler::{Compiler, Stage, emit};
pub use attn_dsl::Diagnostic;
pub use program::{CompileError, EntryInfo, LoadError, Program, RunError, RunOptions, suggest};
pub use target::{TARGET_NAMES, Target, TargetError};
