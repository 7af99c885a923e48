//! The Cranelift CPU backend's code generator: a verified [`Graph`] becomes an execution
//! [`Plan`] (buffers, an integer table, ordered steps) plus one Cranelift IR [`Function`] per
//! step. It does no IO and owns no executable memory: the runtime JIT-compiles the functions,
//! provides the microkernel and helper symbols ([`abi::IMPORTS`]), sizes buffers per run shape
//! and calls the steps from its thread pool.
//!
//! Files: `plan` (the data model), `lower` (graph → plan: fusion, views, outputs), `builder`
//! (function scaffolding, loops), `ops` (typed per-element arithmetic and math), and one
//! emitter per kernel kind: `elementwise`, `reduce`, `matmul`, `flash` (with `score`, the
//! score-expression compiler).

pub mod abi;
mod builder;
mod elementwise;
mod flash;
mod lower;
mod matmul;
mod ops;
pub mod plan;
mod reduce;
mod score;

pub use flash::{CHUNK_COLS, CHUNK_ROWS, FlashScratch, flash_scratch, tile_entry_bytes};
pub use plan::{Buffer, BufferKind, Check, IntValue, Kernel, Plan, Step, Tuning, View};

use crate::ir::{Graph, Module};
use builder::{Fx, new_function};
use cranelift_codegen::ir::Function;
use cranelift_codegen::isa::CallConv;
use cranelift_codegen::settings;
use cranelift_frontend::FunctionBuilderContext;
use std::fmt::Write;
use thiserror::Error;

/// Why a graph could not be compiled for the CPU.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum CodegenError {
    /// The graph has a cycle.
    #[error("graph `{graph}` has a cycle")]
    Cycle {
        /// The graph.
        graph: String,
    },
    /// The graph does not verify (the code generator only takes verified graphs).
    #[error("graph `{graph}` is not valid IR: {errors}")]
    Invalid {
        /// The graph.
        graph: String,
        /// The verifier's findings.
        errors: String,
    },
    /// A node the backend cannot lower as it stands.
    #[error("graph `{graph}`: %{value} ({op}): {reason}")]
    Unsupported {
        /// The graph.
        graph: String,
        /// The node's `%N`.
        value: usize,
        /// The op's name.
        op: String,
        /// Why.
        reason: String,
    },
    /// A generated function failed Cranelift's verifier (a code generator bug).
    #[error("graph `{graph}`: generated function `{function}` is invalid: {errors}")]
    Verify {
        /// The graph.
        graph: String,
        /// The function.
        function: String,
        /// The verifier's report.
        errors: String,
    },
}

/// A graph compiled to a plan and Cranelift IR.
#[derive(Clone, Debug)]
pub struct CpuModule {
    /// What to run, in what order, on which buffers.
    pub plan: Plan,
    /// One function per step (`plan.steps[i].func` indexes this).
    pub functions: Vec<Function>,
}

/// What the code generator may assume about the machine the code runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features {
    /// The calling convention of step functions (the host's default).
    pub call_conv: CallConv,
}

/// The features [`emit_text`] assumes: System V calls (x86-64 Linux), so the listing is the
/// same on every machine.
pub const TEXT_FEATURES: Features = Features { call_conv: CallConv::SystemV };

/// Compiles a verified graph for a machine with `features`.
pub fn compile(graph: &Graph, features: &Features) -> Result<CpuModule, CodegenError> {
    let call_conv = features.call_conv;
    if let Err(errors) = crate::ir::verify(graph) {
        let errors: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
        return Err(CodegenError::Invalid { graph: graph.name.clone(), errors: errors.join("; ") });
    }
    let mut plan = lower::lower(graph)?;
    let mut ctx = FunctionBuilderContext::new();
    let flags = settings::Flags::new(settings::builder());
    let mut functions = Vec::with_capacity(plan.steps.len());
    for s in 0..plan.steps.len() {
        let kernel = plan.steps[s].kernel.clone();
        let name = format!("{}_{s}_{}", graph.name, kernel_name(&kernel));
        let mut func = new_function(&name, call_conv);
        {
            let mut fx = Fx::new(&mut func, &mut ctx, &mut plan, call_conv);
            match &kernel {
                Kernel::Elementwise { out, inputs, expr } => elementwise::emit(&mut fx, out, inputs, expr),
                Kernel::MatMul { a, b, c, b_transposed } => matmul::emit(&mut fx, s, a, b, c, *b_transposed),
                Kernel::Reduce { x, op, axes, out } => reduce::emit_reduce(&mut fx, x, *op, axes, out),
                Kernel::Softmax { x, axis, out } => reduce::emit_softmax(&mut fx, x, *axis, out),
                Kernel::Norm { x, gamma, beta, eps, out } => reduce::emit_norm(&mut fx, x, gamma, beta.as_ref(), *eps, out),
                Kernel::Flash(f) => flash::emit(&mut fx, f),
                Kernel::FlashMerge(f) => flash::emit_merge(&mut fx, f),
            }
            fx.finish();
        }
        if let Err(errors) = cranelift_codegen::verify_function(&func, &flags) {
            return Err(CodegenError::Verify { graph: graph.name.clone(), function: name, errors: errors.to_string() });
        }
        functions.push(func);
    }
    Ok(CpuModule { plan, functions })
}

/// A short name for a kernel kind (part of function names).
pub fn kernel_name(k: &Kernel) -> &'static str {
    match k {
        Kernel::Elementwise { .. } => "elementwise",
        Kernel::MatMul { .. } => "matmul",
        Kernel::Reduce { .. } => "reduce",
        Kernel::Softmax { .. } => "softmax",
        Kernel::Norm { .. } => "norm",
        Kernel::Flash(_) => "flash",
        Kernel::FlashMerge(_) => "flash_merge",
    }
}

/// The Cranelift IR text of every generated function of every graph of `module`, each graph
/// headed by its plan (integer table, buffers, steps) as comments: what `attnc build --emit
/// clif` prints.
pub fn emit_text(module: &Module) -> Result<String, CodegenError> {
    let mut out = String::new();
    for g in &module.graphs {
        let m = compile(g, &TEXT_FEATURES)?;
        write_module(&mut out, &m);
    }
    Ok(out)
}

/// Appends one compiled graph's listing to `out`.
pub fn write_module(out: &mut String, m: &CpuModule) {
    let p = &m.plan;
    let _ = writeln!(out, "; graph {}", p.name);
    for (i, v) in p.ints.iter().enumerate() {
        let text = match v {
            IntValue::Dim(d) => d.to_string(),
            IntValue::Tuning { step, param } => format!("{param:?} of step {step}"),
        };
        let _ = writeln!(out, ";   ints[{i}] = {text}");
    }
    for (i, b) in p.buffers.iter().enumerate() {
        let kind = match &b.kind {
            BufferKind::Param(k) => format!("param {k}"),
            BufferKind::Output(k) => format!("output {k}"),
            BufferKind::Temp => "temp".to_string(),
            BufferKind::TileTable { step } => format!("tile table of step {step}"),
            BufferKind::Partials { step } => format!("partial states of step {step}"),
        };
        match b.kind {
            BufferKind::TileTable { .. } | BufferKind::Partials { .. } => {
                let _ = writeln!(out, ";   bufs[{i}] = {kind} (%{}), sized per run", b.value);
            }
            _ => {
                let _ = writeln!(out, ";   bufs[{i}] = {kind}: %{} {}[{}]", b.value, b.dtype, b.elems);
            }
        }
    }
    for (i, s) in p.steps.iter().enumerate() {
        let _ = writeln!(out, ";   step {i}: {} over ints[{}] items", s.label, s.work);
    }
    for f in &m.functions {
        let _ = writeln!(out, "\n{}", f.display());
    }
}

#[cfg(test)]
mod tests;
