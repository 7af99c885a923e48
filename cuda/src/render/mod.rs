//! The CUDA renderer: a [`Schedule`] for the CUDA target in, one self-contained CUDA
//! translation unit out ([`CudaProgram`]), one kernel per step. It decides nothing the schedule
//! has not decided: buffers, views, what is computed inline, kernel variants and work items come
//! from the schedule, block sizes from [`attn_compiler::schedule::policy`] and the integer table. Pure:
//! no IO, no device, no NVRTC.
//!
//! Every kernel has the same parameters: the buffers (`b0`, `b1`, ...), then the schedule's
//! integer table (`t0`, `t1`, ... as 64-bit integers), so sizes, strides and block choices are
//! run-time values and a new sequence length recompiles nothing. The flash kernels' padded head
//! width (and the tensor-core key tile) are compile-time macros (`ATTNC_HD_{step}`,
//! `ATTNC_BN_{step}`) that [`attn_compiler::schedule::prepare()`] computes from the dims: a new head
//! width compiles the source again.
//!
//! Each kernel loops over its step's work items (`for (w_ = blockIdx.x; w_ < items; w_ +=
//! gridDim.x)`, or one item per warp), so any grid size is correct; [`launches`] sizes the grid
//! from the prepared work items.
//!
//! Files: `cexpr` (C text: integers, literals, loads and stores), `ops` (the scalar ops of
//! [`attn_compiler::ir::semantics`] as C), `score` (flash score expressions), one renderer per kernel
//! kind (`elementwise`, `matmul`, `rows`, `flash`), `prelude` (device helpers), `launch`.

mod cexpr;
mod elementwise;
mod flash;
mod flash_bwd;
mod flash_bwd_mma;
mod launch;
mod matmul;
mod ops;
mod prelude;

/// The preamble of every emitted program (types and helpers), for tests that compile their own
/// kernels on top of it.
#[cfg(test)]
pub(crate) fn preamble_for_tests() -> String {
    prelude::preamble()
}
mod rows;
mod score;

#[cfg(test)]
mod tests;

use attn_compiler::ir::{ReduceOp, ScanOp};
use attn_compiler::schedule::policy::CUDA_WS_THREADS;
use attn_compiler::schedule::{
    BufferKind, Expr, FlashBwdKernel, FlashKernel, Fused, Kernel, KernelRenderer, Schedule, Target, Variant, View, render_kernel,
};
use attn_compiler::{RenderError, Renderer, Stage};
use cexpr::Ints;
use std::fmt::Write as _;
use thiserror::Error;

pub use cexpr::storage_bytes;
pub use launch::{DeviceLimits, LaunchError, ReadyLaunch, buffer_bytes, launches};
pub use prelude::{PRELUDE_BEGIN, PRELUDE_END};

/// Why a schedule could not be rendered as CUDA.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum CudaEmitError {
    /// The schedule is not for CUDA.
    #[error("schedule `{graph}` is for {target}, not the cuda target")]
    Target {
        /// The graph.
        graph: String,
        /// The schedule's target.
        target: String,
    },
    /// A step that could not be rendered (a renderer bug): which, and why.
    #[error("graph `{graph}`{}: {reason}", step.map_or(String::new(), |s| format!(", step {s}")))]
    Render {
        /// The graph.
        graph: String,
        /// The step, when known.
        step: Option<usize>,
        /// The source expression of the step's node, when known.
        span: Option<attn_dsl::Span>,
        /// What was missing.
        reason: String,
    },
}

impl From<CudaEmitError> for RenderError {
    fn from(e: CudaEmitError) -> RenderError {
        let span = match &e {
            CudaEmitError::Render { span, .. } => *span,
            CudaEmitError::Target { .. } => None,
        };
        RenderError { target: Target::Cuda, span, message: e.to_string() }
    }
}

/// The CUDA renderer as the pipeline's `cuda` stage: each schedule's translation unit under a
/// `// ===== graph NAME =====` line.
#[derive(Clone, Copy, Debug, Default)]
pub struct CudaText;

impl Renderer for CudaText {
    fn stage(&self) -> Stage {
        Stage::Cuda
    }

    fn target(&self) -> Target {
        Target::Cuda
    }

    fn render_text(&self, schedule: &Schedule) -> Result<String, RenderError> {
        let program = render(schedule)?;
        Ok(format!("// ===== graph {} =====\n{}", program.graph, program.source))
    }
}

/// Dynamic shared memory of a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Smem {
    /// None (static arrays only).
    None,
    /// The SIMT flash kernel of a step: `(16·HD + 32·(HD+1) + 32·HD)` floats.
    FlashSimt(usize),
    /// The SIMT flash kernel with additive scores: also `e^{2q}`, `e^{2k}` and the weight,
    /// `(2·(16·HD + 32·(HD+1)) + 32·HD + HD)` floats.
    FlashSimtAdditive(usize),
    /// The tensor-core flash kernel of a step: `(64·MT + 2·BN)·(HD+8)` halves.
    FlashMma(usize),
    /// The tensor-core flash backward of a step: `4·64·(HD+8)` halves and `2·64` floats, and
    /// when `dQ` is added atomically (the flag) a half tile's `dS` and `dQ`, `32·72` halves and
    /// `32·(HD+4)` floats.
    FlashBwdMma(usize, bool),
}

/// One step's kernel: its name and how it is launched.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaKernel {
    /// The `extern "C"` kernel name.
    pub name: String,
    /// Threads per block (the warp-specialised flash forward launches
    /// [`CUDA_WS_THREADS`] where its run sets `ATTNC_WS_{step}`).
    pub threads: u32,
    /// Work items one block takes (per pass of its loop).
    pub items_per_block: i64,
    /// Dynamic shared memory.
    pub smem: Smem,
}

/// A schedule rendered as CUDA C++.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaProgram {
    /// The graph's (entry point's) name.
    pub graph: String,
    /// The CUDA C++ translation unit (no includes; compile with NVRTC for sm_80 or newer).
    pub source: String,
    /// One kernel per step of the schedule, in order.
    pub kernels: Vec<CudaKernel>,
    /// How many buffer parameters every kernel takes (`b0`, `b1`, ...).
    pub buffers: usize,
    /// How many integer-table parameters every kernel takes after them (`t0`, `t1`, ...).
    pub ints: usize,
}

/// A rendered kernel body and its launch shape.
struct KernelSource {
    threads: u32,
    items_per_block: i64,
    smem: Smem,
    body: Vec<String>,
}

/// Renders a CUDA schedule.
pub fn render(schedule: &Schedule) -> Result<CudaProgram, CudaEmitError> {
    if schedule.target != Target::Cuda {
        return Err(CudaEmitError::Target { graph: schedule.name.clone(), target: schedule.target.name().to_string() });
    }
    let ints = Ints { schedule };
    let mut kernels = Vec::new();
    let mut text = String::new();
    for (s, step) in schedule.steps.iter().enumerate() {
        let items = format!("t{}", step.work);
        let at_step = |e: CudaEmitError| match e {
            CudaEmitError::Render { graph, step: None, reason, .. } => {
                CudaEmitError::Render { graph, step: Some(s), span: step.span, reason: format!("{}: {reason}", step.label) }
            }
            e => e,
        };
        let src = render_kernel(&mut Kernels { ints: &ints, items: &items }, s, &step.kernel).map_err(at_step)?;
        let name = format!("attnc_s{s}_{}", step.kernel.name());
        let variant = match &step.kernel {
            Kernel::MatMul { variant, .. } => format!(" ({})", variant.name()),
            Kernel::Flash(f) => format!(" ({})", f.variant.name()),
            Kernel::FlashBwd(f) => format!(" ({})", f.variant.name()),
            _ => String::new(),
        };
        let _ = writeln!(text, "\n// step {s}: {}{variant}", step.label);
        // The tensor-core flash forward's block size is chosen per run (`ATTNC_WS_{s}`: the
        // warp-specialised block); one block per SM there, so that `setmaxnreg` knows the
        // registers at entry.
        let bounds = match src.smem {
            Smem::FlashMma(s) => {
                let _ = writeln!(
                    text,
                    "#if ATTNC_WS_{s}\n#define ATTNC_BOUNDS_{s} {CUDA_WS_THREADS}, 1\n#else\n#define ATTNC_BOUNDS_{s} {}\n#endif",
                    src.threads
                );
                format!("ATTNC_BOUNDS_{s}")
            }
            _ => src.threads.to_string(),
        };
        let _ = writeln!(text, "ATTNC_KERNEL void __launch_bounds__({bounds}) {name}(ATTNC_ARGS) {{");
        for line in &src.body {
            let _ = writeln!(text, "  {line}");
        }
        text.push_str("}\n");
        kernels.push(CudaKernel { name, threads: src.threads, items_per_block: src.items_per_block, smem: src.smem });
    }
    Ok(CudaProgram {
        graph: schedule.name.clone(),
        source: preamble(schedule) + &text,
        kernels,
        buffers: schedule.buffers.len(),
        ints: schedule.ints.len(),
    })
}

/// The CUDA kernel kinds of one step: `items` is the C expression of its work-item count.
struct Kernels<'a> {
    ints: &'a Ints<'a>,
    items: &'a str,
}

impl KernelRenderer for Kernels<'_> {
    type Output = Result<KernelSource, CudaEmitError>;
    fn elementwise(&mut self, out: &View, inputs: &[View], expr: &Expr, more: &[(View, Expr)]) -> Self::Output {
        elementwise::emit(self.ints, self.items, out, inputs, expr, more)
    }
    fn matmul(&mut self, _step: usize, a: &View, b: &View, c: &View, _b_transposed: bool, variant: Variant) -> Self::Output {
        matmul::emit(self.ints, self.items, a, b, c, variant)
    }
    fn reduce(&mut self, x: &View, op: ReduceOp, axes: &[usize], out: &View) -> Self::Output {
        rows::reduce(self.ints, self.items, x, op, axes, out)
    }
    fn reduce_of(&mut self, x: &Fused, op: ReduceOp, axes: &[usize], out: &View) -> Self::Output {
        rows::reduce_of(self.ints, self.items, x, op, axes, out)
    }
    fn softmax(&mut self, x: &View, axis: usize, out: &View) -> Self::Output {
        rows::softmax(self.ints, self.items, x, axis, out)
    }
    fn scan(&mut self, op: ScanOp, a: Option<&View>, x: &View, axis: usize, reverse: bool, out: &View) -> Self::Output {
        rows::scan(self.ints, self.items, (op, axis, reverse), a, x, out)
    }
    fn prefix_attention(&mut self, q: &View, k: &View, v: &View, reverse: bool, out: &View) -> Self::Output {
        rows::prefix_attention(self.ints, self.items, q, k, v, reverse, out)
    }
    fn scatter_add(&mut self, base: &View, idx: &View, src: &View, axis: usize, out: &View, site: usize) -> Self::Output {
        rows::scatter_add(self.ints, self.items, (base, idx, src), axis, out, site)
    }
    fn argsort(&mut self, x: &View, axis: usize, descending: bool, out: &View, scratch: Option<&View>, limit: Option<i64>) -> Self::Output {
        match limit {
            Some(k) if k <= attn_compiler::schedule::policy::CUDA_SELECT_MAX => {
                rows::argselect(self.ints, self.items, x, axis, descending, out, k)
            }
            _ => rows::argsort(self.ints, self.items, x, axis, descending, out, scratch),
        }
    }
    fn norm(&mut self, x: &View, gamma: &View, beta: Option<&View>, eps: f64, out: &View) -> Self::Output {
        rows::norm(self.ints, self.items, x, gamma, beta, eps, out)
    }
    fn dropout(&mut self, _x: &View, _seed: &View, _rate: f64, _out: &View) -> Self::Output {
        // The CUDA schedule computes dropout element-wise (`schedule::dropout_expr`).
        Err(self.ints.fail("a dropout row step, which only the CPU's schedule has".into()))
    }
    fn flash(&mut self, f: &FlashKernel) -> Self::Output {
        flash::emit(self.ints, self.items, f)
    }
    fn flash_merge(&mut self, f: &FlashKernel) -> Self::Output {
        flash::emit_merge(self.ints, self.items, f)
    }
    fn flash_bwd(&mut self, f: &FlashBwdKernel) -> Self::Output {
        match f.variant {
            Variant::TensorCore => flash_bwd_mma::emit(self.ints, self.items, f),
            _ => flash_bwd::emit(self.ints, self.items, f),
        }
    }
    fn flash_bwd_reduce(&mut self, f: &FlashBwdKernel) -> Self::Output {
        flash_bwd::emit_reduce(self.ints, self.items, f)
    }
}

/// The helpers, the kernel parameter list and the head-width macros' defaults.
fn preamble(schedule: &Schedule) -> String {
    let mut src = String::new();
    let _ = writeln!(src, "// attnc: CUDA kernels of graph `{}` ({} steps)", schedule.name, schedule.steps.len());
    src.push_str(&prelude::preamble());
    let mut args: Vec<String> = (0..schedule.buffers.len()).map(|b| format!("void* const b{b}")).collect();
    args.extend((0..schedule.ints.len()).map(|t| format!("const i64 t{t}")));
    // The run's TMA tensor maps (128 bytes each; null when it has none): `Prepared::tma`.
    args.push("const void* const attnc_tmaps".into());
    let buffers: Vec<String> = schedule
        .buffers
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let what = match &b.kind {
                BufferKind::Param(k) => format!("param {k}"),
                BufferKind::Output(k) => format!("output {k}"),
                BufferKind::Temp => format!("%{}", b.value),
                BufferKind::TileTable { step } => format!("tiles of step {step}"),
                BufferKind::Partials { step } => format!("partials of step {step}"),
                BufferKind::Fault => "fault record".to_string(),
            };
            format!("b{i} = {what}")
        })
        .collect();
    let _ = writeln!(src, "// Buffers: {}", buffers.join(", "));
    let _ = writeln!(src, "#define ATTNC_ARGS {}", args.join(", "));
    for (s, step) in schedule.steps.iter().enumerate() {
        if let Kernel::FlashBwd(_) = &step.kernel {
            let _ =
                writeln!(src, "#ifndef ATTNC_HD_{s}\n#define ATTNC_HD_{s} 128 // padded head width of step {s}; set from the dims\n#endif");
        }
        if let Kernel::Flash(f) = &step.kernel {
            let _ =
                writeln!(src, "#ifndef ATTNC_HD_{s}\n#define ATTNC_HD_{s} 128 // padded head width of step {s}; set from the dims\n#endif");
            if f.variant == attn_compiler::schedule::Variant::TensorCore {
                let _ =
                    writeln!(src, "#ifndef ATTNC_BN_{s}\n#define ATTNC_BN_{s} 64 // keys per tile of step {s}; set from the dims\n#endif");
                let _ = writeln!(
                    src,
                    "#ifndef ATTNC_MT_{s}\n#define ATTNC_MT_{s} 2 // query m-tiles per warp of step {s}; set from the dims\n#endif"
                );
                let _ = writeln!(
                    src,
                    "#ifndef ATTNC_KS_{s}\n#define ATTNC_KS_{s} 1 // K/V stages of step {s} (2: Hopper's, when the launch has room)\n#endif"
                );
                let _ = writeln!(
                    src,
                    "#ifndef ATTNC_TMA_{s}\n#define ATTNC_TMA_{s} 0 // 1 + the first of step {s}'s TMA maps (K's, then V's); 0: no TMA\n#endif"
                );
            }
        }
    }
    src
}
