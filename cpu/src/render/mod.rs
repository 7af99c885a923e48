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

use attn_compiler::ir::{ReduceOp, ScanOp};
use attn_compiler::schedule::{
    Expr, FlashBwdKernel, FlashKernel, Fused, IntValue, KernelRenderer, Schedule, Target, Variant, View, render_kernel,
};
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
        render_kernel(&mut Kernels(&mut fx), s, &step.kernel);
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

/// The CPU's kernel kinds: each renders into the step function being built (a case it cannot
/// render is recorded in the builder's failures).
struct Kernels<'b, 'a>(&'b mut StepBuilder<'a>);

impl KernelRenderer for Kernels<'_, '_> {
    type Output = ();
    fn elementwise(&mut self, out: &View, inputs: &[View], expr: &Expr, more: &[(View, Expr)]) {
        elementwise::emit(self.0, out, inputs, expr, more)
    }
    fn matmul(&mut self, step: usize, a: &View, b: &View, c: &View, b_transposed: bool, _variant: Variant) {
        matmul::emit(self.0, step, a, b, c, b_transposed)
    }
    fn reduce(&mut self, x: &View, op: ReduceOp, axes: &[usize], out: &View) {
        rows::emit_reduce(self.0, x, op, axes, out)
    }
    fn reduce_of(&mut self, x: &Fused, op: ReduceOp, axes: &[usize], out: &View) {
        rows::emit_reduce_of(self.0, x, op, axes, out)
    }
    fn softmax(&mut self, x: &View, axis: usize, out: &View) {
        rows::emit_softmax(self.0, x, axis, out)
    }
    fn scan(&mut self, op: ScanOp, a: Option<&View>, x: &View, axis: usize, reverse: bool, out: &View) {
        rows::emit_scan(self.0, op, a, x, axis, reverse, out)
    }
    fn prefix_attention(&mut self, q: &View, k: &View, v: &View, reverse: bool, out: &View) {
        rows::emit_prefix_attention(self.0, q, k, v, reverse, out)
    }
    fn scatter_add(&mut self, base: &View, idx: &View, src: &View, axis: usize, out: &View, site: usize) {
        rows::emit_scatter_add(self.0, base, idx, src, axis, out, site)
    }
    fn argsort(&mut self, x: &View, axis: usize, descending: bool, out: &View, _scratch: Option<&View>, limit: Option<i64>) {
        rows::emit_argsort(self.0, x, axis, descending, out, limit)
    }
    fn norm(&mut self, x: &View, gamma: &View, beta: Option<&View>, eps: f64, out: &View) {
        rows::emit_norm(self.0, x, gamma, beta, eps, out)
    }
    fn dropout(&mut self, x: &View, seed: &View, rate: f64, out: &View) {
        flash::emit_dropout(self.0, x, seed, rate, out)
    }
    fn flash(&mut self, f: &FlashKernel) {
        flash::emit(self.0, f)
    }
    fn flash_merge(&mut self, f: &FlashKernel) {
        flash::emit_merge(self.0, f)
    }
    fn flash_bwd(&mut self, f: &FlashBwdKernel) {
        flash_bwd::emit(self.0, f)
    }
    fn flash_bwd_reduce(&mut self, f: &FlashBwdKernel) {
        flash_bwd::emit_reduce(self.0, f)
    }
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
