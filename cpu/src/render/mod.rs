//! The Cranelift CPU backend's code generator: it renders a [`Schedule`] for the CPU as one
//! Cranelift IR [`Function`] per step, and decides nothing the schedule has not decided. It does
//! no IO and owns no executable memory: the runtime JIT-compiles the functions, provides the
//! microkernel and helper symbols ([`abi::IMPORTS`]), prepares the schedule per run shape
//! ([`attn_compiler::schedule::prepare()`]) and calls the steps from its thread pool.
//!
//! Files: `builder` (function scaffolding, loops, the integer table), `ops` (typed per-element
//! arithmetic and math, following [`attn_compiler::ir::semantics`]), and one renderer per kernel kind:
//! `elementwise`, `reduce`, `matmul`, `flash` (with `score`, the score-expression compiler).

mod builder;
mod elementwise;
mod flash;
mod flash_bwd;
mod flash_bwd_rows;
mod matmul;
mod ops;
mod rows;
mod score;

use attn_compiler::schedule::{IntValue, Kernel, Schedule, Target};
use attn_compiler::{RenderError, Renderer, Stage};
use builder::{StepBuilder, new_function};
use cranelift_codegen::ir::Function;
use cranelift_codegen::isa::CallConv;
use cranelift_codegen::settings;
use cranelift_frontend::FunctionBuilderContext;
use std::fmt::Write;
use thiserror::Error;

/// Why a schedule could not be rendered for the CPU.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum CodegenError {
    /// The schedule is not for the CPU.
    #[error("schedule `{graph}` is for {target}, not the cpu target")]
    Target {
        /// The graph.
        graph: String,
        /// The schedule's target.
        target: String,
    },
    /// A step that could not be rendered (a code generator bug): which, and why.
    #[error("graph `{graph}`: step {step} ({label}): {reason}")]
    Render {
        /// The graph.
        graph: String,
        /// The step.
        step: usize,
        /// The step's label (`%N op`).
        label: String,
        /// The source expression of the step's node, when known.
        span: Option<attn_dsl::Span>,
        /// What was missing.
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

impl From<CodegenError> for RenderError {
    fn from(e: CodegenError) -> RenderError {
        let span = match &e {
            CodegenError::Render { span, .. } => *span,
            _ => None,
        };
        RenderError { target: Target::Cpu, span, message: e.to_string() }
    }
}

/// The CPU renderer as the pipeline's `clif` stage: each schedule's listing
/// ([`write_module`]) for [`TEXT_FEATURES`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ClifText;

impl Renderer for ClifText {
    fn stage(&self) -> Stage {
        Stage::Clif
    }

    fn target(&self) -> Target {
        Target::Cpu
    }

    fn render_text(&self, schedule: &Schedule) -> Result<String, RenderError> {
        let mut out = String::new();
        write_module(&mut out, &render(schedule, &TEXT_FEATURES)?);
        Ok(out)
    }
}

/// A schedule rendered as Cranelift IR.
#[derive(Clone, Debug)]
pub struct CpuModule {
    /// What to run, in what order, on which buffers.
    pub schedule: Schedule,
    /// One function per step, in step order.
    pub functions: Vec<Function>,
}

/// What the code generator may assume about the machine the code runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features {
    /// The calling convention of step functions (the host's default).
    pub call_conv: CallConv,
}

/// The features listings (`--emit clif`, snapshots) assume: System V calls (x86-64 Linux), so a listing is the
/// same on every machine.
pub const TEXT_FEATURES: Features = Features { call_conv: CallConv::SystemV };

/// Renders a CPU schedule as one function per step for a machine with `features`.
pub fn render(schedule: &Schedule, features: &Features) -> Result<CpuModule, CodegenError> {
    if schedule.target != Target::Cpu {
        return Err(CodegenError::Target { graph: schedule.name.clone(), target: schedule.target.name().to_string() });
    }
    let call_conv = features.call_conv;
    let mut ctx = FunctionBuilderContext::new();
    let flags = settings::Flags::new(settings::builder());
    let mut functions = Vec::with_capacity(schedule.steps.len());
    for (s, step) in schedule.steps.iter().enumerate() {
        let name = format!("{}_{s}_{}", schedule.name, step.kernel.name());
        let mut func = new_function(&name, call_conv);
        let mut fx = StepBuilder::new(&mut func, &mut ctx, schedule, call_conv);
        match &step.kernel {
            Kernel::Elementwise { out, inputs, expr, more } => elementwise::emit(&mut fx, out, inputs, expr, more),
            Kernel::MatMul { a, b, c, b_transposed, .. } => matmul::emit(&mut fx, s, a, b, c, *b_transposed),
            Kernel::Reduce { x, op, axes, out } => rows::emit_reduce(&mut fx, x, *op, axes, out),
            Kernel::ReduceOf { x, op, axes, out } => rows::emit_reduce_of(&mut fx, x, *op, axes, out),
            Kernel::Softmax { x, axis, out } => rows::emit_softmax(&mut fx, x, *axis, out),
            Kernel::Scan { op, a, x, axis, reverse, out } => rows::emit_scan(&mut fx, *op, a.as_ref(), x, *axis, *reverse, out),
            Kernel::PrefixAttention { q, k, v, reverse, out } => rows::emit_prefix_attention(&mut fx, q, k, v, *reverse, out),
            Kernel::ScatterAdd { base, idx, src, axis, out, site } => rows::emit_scatter_add(&mut fx, base, idx, src, *axis, out, *site),
            Kernel::ArgSort { x, axis, descending, out, limit, .. } => rows::emit_argsort(&mut fx, x, *axis, *descending, out, *limit),
            Kernel::Norm { x, gamma, beta, eps, out } => rows::emit_norm(&mut fx, x, gamma, beta.as_ref(), *eps, out),
            Kernel::Flash(f) => flash::emit(&mut fx, f),
            Kernel::FlashMerge(f) => flash::emit_merge(&mut fx, f),
            Kernel::FlashBwd(f) => flash_bwd::emit(&mut fx, f),
            Kernel::FlashBwdReduce(f) => flash_bwd::emit_reduce(&mut fx, f),
        }
        let failures = std::mem::take(&mut fx.failures);
        fx.finish();
        if !failures.is_empty() {
            return Err(CodegenError::Render {
                graph: schedule.name.clone(),
                step: s,
                label: step.label.clone(),
                span: step.span,
                reason: failures.join("; "),
            });
        }
        if let Err(errors) = cranelift_codegen::verify_function(&func, &flags) {
            return Err(CodegenError::Verify { graph: schedule.name.clone(), function: name, errors: errors.to_string() });
        }
        functions.push(func);
    }
    Ok(CpuModule { schedule: schedule.clone(), functions })
}

/// The listing of one rendered schedule, headed by its integer table and buffers as comments:
/// what `attnc build --emit clif` prints per function.
pub fn write_module(out: &mut String, m: &CpuModule) {
    let p = &m.schedule;
    let _ = writeln!(out, "; graph {}", p.name);
    for (i, v) in p.ints.iter().enumerate() {
        let text = match v {
            IntValue::Dim(d) => d.to_string(),
            IntValue::Tuning { step, param } => format!("{param:?} of step {step}"),
        };
        let _ = writeln!(out, ";   ints[{i}] = {text}");
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
