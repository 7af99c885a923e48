//! The schedule: how a verified, optimised graph runs, decided once for every backend.
//!
//! The optimizer decides *what* is computed (flash ops, algebra); the schedule decides *how*:
//! which values live in memory and which are computed inline by their users, the strided views
//! that make transposes, slices and reshapes free, the kernels and the order of the steps that
//! run them, the flash ops with their score analyses ([`FlashAnalysis`]), and the per-target
//! choices of [`policy`] (kernel variants; block sizes and work decompositions, resolved per
//! run by [`prepare()`]). The Cranelift and CUDA code generators only render a schedule; the
//! runtimes only [`prepare()`] it for the run's dims and launch it.
//!
//! Everything here is symbolic: sizes and strides are [`Dim`] polynomials and per-run choices
//! are [`Tuning`] values, gathered in one integer table ([`Schedule::ints`]) that generated code
//! reads at run time. Nothing is recompiled when a size changes.
//!
//! A schedule is made by four passes, each checked by the verifier ([`verify`]) before the next
//! runs: `place` (placement and inlining: which values are stored, which computed inside their
//! users, which nodes one step computes together), `form` (kernel formation: buffers, views and
//! steps in order; `form_attention` for flash ops and their gradients), `liveness` (each step's
//! reads and writes), `ints` (the integer table). Beside them: `analysis` (a flash op's score
//! analyses), `policy` (per-target choices), `prepare` (dims → launch-time plan), `tile_table`
//! (the tile-table format), `render` (the one dispatch of kernel kinds to a renderer), `text` (the
//! text form `attnc build --emit schedule` prints).

mod analysis;
mod form;
mod form_attention;
mod ints;
mod legalize;
mod liveness;
mod place;
pub mod policy;
mod prepare;
pub mod render;
mod text;
pub mod tile_table;
pub mod verify;

pub use analysis::{
    BwdLinear, FlashAnalysis, Level, Separated, StagedScore, dims_of, level, reads_score, score_factor, separate, split_scale, tanh_staged,
};
pub use place::{MAX_INLINE_DEPTH, MAX_SHARED_OPS};
pub use policy::{CpuIsa, CpuPolicy, CudaPolicy, Policy, Target, Variant};
pub use prepare::{
    FlashBwdScratch, FlashScratch, PrepareError, Prepared, TMA_BOX_COLS, TmaMap, eval, flash_bwd_scratch, flash_scratch, id_data_params,
    mask_data_params, prepare, prepare_with, tma_axes, tma_map,
};
pub use render::{KernelRenderer, render_kernel};
pub use verify::{VerifyError, verify};

use crate::ir::{BinaryOp, DType, Dim, FlashSpec, Graph, ReduceOp, ScanOp, ScoreExpr, UnaryOp};
use attn_dsl::Span;
use thiserror::Error;

/// Why a graph could not be scheduled.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ScheduleError {
    /// The graph does not verify, or has a cycle (only verified graphs are scheduled).
    #[error("graph `{graph}` is not valid IR: {reason}")]
    Invalid {
        /// The graph.
        graph: String,
        /// The verifier's findings.
        reason: String,
    },
    /// A pass produced a schedule that breaks one of its invariants (a compiler bug).
    #[error("graph `{graph}`: the schedule after {pass} fails verification: {}", findings.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Unverified {
        /// The graph.
        graph: String,
        /// The pass (`kernel formation`, `liveness`, `the integer table`).
        pass: &'static str,
        /// What the verifier found.
        findings: Vec<VerifyError>,
    },
    /// A node no kernel can compute as it stands.
    #[error("graph `{graph}`: %{value} ({op}): {reason}")]
    Unsupported {
        /// The graph.
        graph: String,
        /// The source expression of the node, when known.
        span: Option<Span>,
        /// The node's `%N`.
        value: usize,
        /// The op's name.
        op: String,
        /// Why.
        reason: String,
    },
}

/// Index of a buffer in [`Schedule::buffers`]; generated code finds its address by this index.
pub type BufSlot = usize;

/// Index of an integer in [`Schedule::ints`]; generated code reads it from the integer table.
pub type IntSlot = usize;

/// A run-time integer: a symbolic dim, or a value [`prepare()`] chooses per run shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum IntValue {
    /// A dim polynomial evaluated in the run's dim environment.
    Dim(Dim),
    /// A tuning value of step `step`, chosen per run shape by the target's [`Policy`].
    Tuning {
        /// The step it belongs to.
        step: usize,
        /// Which value.
        param: Tuning,
    },
}

/// Values [`prepare()`] chooses per run shape; generated code handles any choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tuning {
    /// Work items of the step (what one item is depends on the kernel and target: [`policy`]).
    Items,
    /// Query rows per flash work item (≥ 1).
    BlockM,
    /// Keys per flash tile (≥ 1).
    BlockN,
    /// Key splits per query block (≥ 1; > 1 writes partial states that the merge combines).
    Splits,
    /// Keys per split, a multiple of `BlockN`.
    KeysPerSplit,
    /// Query blocks: `ceil(M / BlockM)`.
    QueryBlocks,
    /// Key tiles: `ceil(N / BlockN)` (the tile table's row length).
    KeyBlocks,
    /// Bytes per tile-table entry ([`tile_table::entry_bytes`] of `BlockM`).
    TileEntryBytes,
    /// Consecutive flat batch indices that share one tile table: index `b` reads table
    /// `b / TileBatchDiv`, each `QueryBlocks × KeyBlocks` entries (the whole batch where the
    /// mask's data does not differ per batch index).
    TileBatchDiv,
    /// Byte offset of the flash output accumulator in a thread's scratch (CPU).
    ScratchAcc,
    /// Byte offset of the running row maxima in a thread's scratch (CPU).
    ScratchMax,
    /// Byte offset of the running row sums in a thread's scratch (CPU).
    ScratchSum,
    /// Byte offset of the key-position bias vector in a thread's scratch (CPU).
    ScratchBias,
    /// Byte offset of a paged K and V's key tile gathered dense in a thread's scratch (CPU).
    ScratchKv,
    /// Heads of the last batch axis that one work item of a flash step over a paged K and V
    /// walks together, page by page ([`policy::CpuPolicy::flash_head_group`]; CPU; 1: one head
    /// per item). Its rows take `HeadGroup · BlockM` rows of the thread's scratch.
    HeadGroup,
    /// Rows of `C` per matmul work item (CPU).
    MatMulRows,
    /// Byte offset of a flash backward's `dSᵀ` rows (`BlockN × RowStride` f32) in a thread's
    /// scratch (CPU; its `Pᵀ` rows are at 0).
    ScratchGradS,
    /// Byte offset of a flash backward's `dQᵀ` accumulator (`D × RowStride`) (CPU).
    ScratchGradQ,
    /// Byte offset of a flash backward's `dK` of one key block (CPU).
    ScratchGradK,
    /// Byte offset of a flash backward's `dV` of one key block (CPU).
    ScratchGradV,
    /// Byte offset of a flash backward's `Kᵀ` of one key block (CPU).
    ScratchKeysT,
    /// Byte offset of a flash backward's row vectors (CPU): a key row's `dF`, the separable row
    /// terms of the queries, the rows' `delta = Σ d_out ∘ out`, the row terms of a summed load's
    /// derivative (`RowStride` f32 each), and two sums.
    ScratchGradRow,
    /// Floats between a flash backward's rows of `Pᵀ`, `dSᵀ` and `dQᵀ` (CPU): `M` rounded up,
    /// plus 16, so that no two rows share cache sets when `M` is a power of two.
    RowStride,
}

/// What a buffer holds and who provides its memory.
#[derive(Clone, Debug, PartialEq)]
pub enum BufferKind {
    /// Input `i` (the caller's memory, read only).
    Param(usize),
    /// Output `i` (returned to the caller).
    Output(usize),
    /// An intermediate, placed in the per-shape arena.
    Temp,
    /// A flash step's tile table ([`tile_table`]), filled by [`prepare()`].
    TileTable {
        /// The flash step.
        step: usize,
    },
    /// A flash step's partial softmax states when keys are split: per work item and row,
    /// `max, sum, acc[Dv]` as f32; a flash backward step's per-item sums of its extra operands'
    /// gradients (f32, every gradient's elements in turn, per work item).
    Partials {
        /// The flash step.
        step: usize,
    },
    /// The run's fault record, four i32 ([`FAULT_WORDS`]): `site + 1` of the first index found
    /// out of range (0: none), its axis, the index and the axis' size. Zeroed before each run
    /// and read after it ([`Schedule::fault_error`]); kernels record into it and read clamped.
    Fault,
}

/// The i32 words of the fault record ([`BufferKind::Fault`]).
pub const FAULT_WORDS: i64 = 4;

/// An indexing op whose indices are checked at run time (a gather or a scatter-add), named in
/// the error a bad index gives.
#[derive(Clone, Debug, PartialEq)]
pub struct Site {
    /// `%N op`.
    pub label: String,
    /// Where it is written, when known.
    pub span: Option<Span>,
}

/// One buffer. Its element count is symbolic, except for tile tables and partial states, which
/// [`prepare()`] sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct Buffer {
    /// Who provides it.
    pub kind: BufferKind,
    /// Element type (tile tables are bytes, partial states f32).
    pub dtype: DType,
    /// Element count.
    pub elems: Dim,
    /// The IR value it holds (`%N`), for messages and listings.
    pub value: usize,
}

/// A strided window onto a buffer: element `(i0, i1, ...)` is at
/// `offset + Σ i_k · strides[k]` (in elements).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct View {
    /// The buffer.
    pub buf: BufSlot,
    /// Element type.
    pub dtype: DType,
    /// First element.
    pub offset: Dim,
    /// Size per axis.
    pub shape: Vec<Dim>,
    /// Element stride per axis.
    pub strides: Vec<Dim>,
}

impl View {
    /// A dense row-major view of a whole buffer.
    pub fn contiguous(buf: BufSlot, dtype: DType, shape: Vec<Dim>) -> View {
        let strides = row_major(&shape);
        View { buf, dtype, offset: Dim::constant(0), shape, strides }
    }

    /// True when the strides are the row-major strides of the shape (axes of size 1 excepted).
    pub fn is_contiguous(&self) -> bool {
        let dense = row_major(&self.shape);
        self.strides.iter().zip(&dense).zip(&self.shape).all(|((s, d), n)| s == d || n.as_const() == Some(1))
    }

    /// The same elements seen with `shape` (a reshape) without moving them, where the strides
    /// allow: each run of axes that `shape` splits or merges must be dense within itself (as
    /// NumPy's no-copy reshape). Sizes are matched symbolically (`Hk*G` splits into `Hk` and
    /// `G`), so the view is right for every binding of the dims; `None` asks for a copy.
    pub fn reshaped(&self, shape: &[Dim]) -> Option<View> {
        let one = Dim::constant(1);
        let old: Vec<usize> = (0..self.shape.len()).filter(|&a| self.shape[a] != one).collect();
        let new: Vec<usize> = (0..shape.len()).filter(|&a| shape[a] != one).collect();
        // Axes of size 1 step nowhere.
        let mut strides = vec![Dim::constant(0); shape.len()];
        let (mut i, mut j) = (0, 0);
        while i < old.len() && j < new.len() {
            let (i0, j0) = (i, j);
            let (mut po, mut pn) = (self.shape[old[i]].clone(), shape[new[j]].clone());
            while po != pn {
                if po.div_exact(&pn).is_some() && j + 1 < new.len() {
                    j += 1;
                    pn = pn.mul(&shape[new[j]]);
                } else if pn.div_exact(&po).is_some() && i + 1 < old.len() {
                    i += 1;
                    po = po.mul(&self.shape[old[i]]);
                } else {
                    return None;
                }
            }
            // The old run must be dense within itself to be re-split.
            for w in old[i0..=i].windows(2) {
                if self.strides[w[0]] != self.strides[w[1]].mul(&self.shape[w[1]]) {
                    return None;
                }
            }
            let mut step = self.strides[old[i]].clone();
            for &a in new[j0..=j].iter().rev() {
                strides[a] = step.clone();
                step = step.mul(&shape[a]);
            }
            i += 1;
            j += 1;
        }
        (i == old.len() && j == new.len()).then(|| View { shape: shape.to_vec(), strides, ..self.clone() })
    }

    /// True when stepping along `axis` moves one element (or the axis has size 1).
    pub fn unit_stride(&self, axis: usize) -> bool {
        self.strides[axis].as_const() == Some(1) || self.shape[axis].as_const() == Some(1)
    }

    /// The strides of the view's batch axes (all but the last two) aligned to `batch`
    /// (right-aligned; broadcast and size-1 axes step 0).
    pub fn batch_strides(&self, batch: &[Dim]) -> Vec<Dim> {
        let own = self.shape.len().saturating_sub(2);
        let lead = batch.len().saturating_sub(own);
        (0..batch.len())
            .map(|t| match t.checked_sub(lead) {
                Some(a) if self.shape[a].as_const() != Some(1) => self.strides[a].clone(),
                _ => Dim::constant(0),
            })
            .collect()
    }
}

/// Row-major strides of a shape.
pub fn row_major(shape: &[Dim]) -> Vec<Dim> {
    let mut strides = vec![Dim::constant(1); shape.len()];
    for k in (0..shape.len().saturating_sub(1)).rev() {
        strides[k] = strides[k + 1].mul(&shape[k + 1]);
    }
    strides
}

/// A scalar expression evaluated per element of an element-wise kernel's output, with the
/// meaning of [`crate::ir::semantics`].
///
/// Sub-expressions of lower rank broadcast numpy-style (aligned at the right); a size-1 axis
/// does not depend on its index.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// An element of input `k` of the kernel ([`Kernel::Elementwise::inputs`]).
    Load(usize),
    /// A constant of the given type.
    Const(f64, DType),
    /// The run-time size of a dim, as i32.
    Dim(Dim),
    /// The index along `axis` of a node of `rank` axes (`one`: that axis has size 1, so 0).
    Iota {
        /// Axis of the node.
        axis: usize,
        /// Rank of the node.
        rank: usize,
        /// The axis has size 1.
        one: bool,
    },
    /// Element-wise unary op; the result has type `.2`.
    Unary(UnaryOp, Box<Expr>, DType),
    /// Element-wise binary op; the result has type `.3`.
    Binary(BinaryOp, Box<Expr>, Box<Expr>, DType),
    /// `where(c, a, b)` of type `.3`.
    Select(Box<Expr>, Box<Expr>, Box<Expr>, DType),
    /// Conversion to a type.
    Cast(Box<Expr>, DType),
    /// `table[idx...]`; `table` is input `.0`. An index out of range is recorded as a fault of
    /// site `.3` ([`Schedule::sites`]) and read clamped.
    Gather(usize, Vec<Expr>, DType, usize),
    /// The 24 random bits of dropout ([`crate::ir::semantics::dropout_bits`]) under the seed
    /// `.0[0]` for the counter `(batch, i, j)` = `.0[1..]` (i32 values, read as u32), as an i32.
    DropoutBits(Box<[Expr; 4]>),
}

impl Expr {
    /// The dtype of the expression's value; `input` gives each input's dtype.
    pub fn dtype(&self, input: &dyn Fn(usize) -> DType) -> DType {
        match self {
            Expr::Load(k) => input(*k),
            Expr::Const(_, t) | Expr::Unary(_, _, t) | Expr::Binary(_, _, _, t) | Expr::Select(_, _, _, t) | Expr::Cast(_, t) => *t,
            Expr::Gather(_, _, t, _) => *t,
            Expr::Dim(_) | Expr::Iota { .. } | Expr::DropoutBits(_) => DType::I32,
        }
    }

    /// Calls `f` on every sub-expression, parents first.
    pub fn visit(&self, f: &mut dyn FnMut(&Expr)) {
        f(self);
        match self {
            Expr::Unary(_, a, _) | Expr::Cast(a, _) => a.visit(f),
            Expr::Binary(_, a, b, _) => {
                a.visit(f);
                b.visit(f);
            }
            Expr::Select(c, a, b, _) => {
                c.visit(f);
                a.visit(f);
                b.visit(f);
            }
            Expr::Gather(_, idx, ..) => idx.iter().for_each(|e| e.visit(f)),
            Expr::DropoutBits(a) => a.iter().for_each(|e| e.visit(f)),
            Expr::Load(_) | Expr::Const(..) | Expr::Dim(_) | Expr::Iota { .. } => {}
        }
    }
}

/// Dropout of `x` (an expression of a value of `shape` and `dtype`) under `seed` as an
/// element-wise expression: `where(bits(seed, batch, i, j) >= threshold, x · scale, 0)` at the
/// value's own position (its last two indices, and the row-major index over the rest), by
/// [`crate::ir::semantics::dropout_bits`].
pub fn dropout_expr(shape: &[Dim], rate: f64, dtype: DType, x: Expr, seed: Expr) -> Expr {
    use crate::ir::{BinaryOp, semantics};
    let rank = shape.len();
    let at = |axis: usize| Expr::Iota { axis, rank, one: shape[axis].as_const() == Some(1) };
    let int = |b: BinaryOp, x: Expr, y: Expr| Expr::Binary(b, Box::new(x), Box::new(y), DType::I32);
    let zero = || Expr::Const(0.0, DType::I32);
    let j = if rank >= 1 { at(rank - 1) } else { zero() };
    let i = if rank >= 2 { at(rank - 2) } else { zero() };
    let batch =
        (0..rank.saturating_sub(2)).fold(zero(), |acc, a| int(BinaryOp::Add, int(BinaryOp::Mul, acc, Expr::Dim(shape[a].clone())), at(a)));
    let bits = Expr::DropoutBits(Box::new([seed, batch, i, j]));
    let threshold = Expr::Const(f64::from(semantics::dropout_threshold(rate)), DType::I32);
    let keep = Expr::Binary(BinaryOp::Ge, Box::new(bits), Box::new(threshold), DType::Bool);
    let scale = Expr::Const(semantics::dropout_scale(rate), DType::F32);
    let kept = Expr::Binary(BinaryOp::Mul, Box::new(x), Box::new(scale), dtype);
    Expr::Select(Box::new(keep), Box::new(kept), Box::new(Expr::Const(0.0, dtype)), dtype)
}

/// An element-wise expression over `shape` that a kernel evaluates where it would read a
/// stored operand.
#[derive(Clone, Debug, PartialEq)]
pub struct Fused {
    /// The loads the expression refers to, each broadcast to `shape`.
    pub inputs: Vec<View>,
    /// The expression.
    pub expr: Expr,
    /// The operand's shape.
    pub shape: Vec<Dim>,
    /// The operand's dtype.
    pub dtype: DType,
}

/// What a step computes.
#[derive(Clone, Debug, PartialEq)]
pub enum Kernel {
    /// `out[idx] = expr(idx)` over `out`'s shape, and `o[idx] = e(idx)` for each `(o, e)` of
    /// `more` in the same pass (the parts of a concatenation of equal shapes: RoPE's two
    /// rotated halves read each input row once).
    Elementwise {
        /// Where results go (any strides).
        out: View,
        /// The loads the expressions refer to, each broadcast to `out`'s shape.
        inputs: Vec<View>,
        /// The expression.
        expr: Expr,
        /// Further outputs of `out`'s shape and their expressions, over the same inputs.
        more: Vec<(View, Expr)>,
    },
    /// Batched `C = A @ B` with broadcast batch axes.
    MatMul {
        /// `[..., M, K]`, unit stride along K.
        a: View,
        /// `[..., K, N]`, unit stride along N (`nn`) or along K (`nt`).
        b: View,
        /// `[batch..., M, N]`, dense.
        c: View,
        /// B is read transposed: unit stride along K.
        b_transposed: bool,
        /// How the target computes the product.
        variant: Variant,
    },
    /// A reduction over `axes` of `x` into dense `out` (keepdim layout).
    Reduce {
        /// The operand.
        x: View,
        /// Which reduction.
        op: ReduceOp,
        /// Reduced axes.
        axes: Vec<usize>,
        /// Dense result.
        out: View,
    },
    /// A reduction over `axes` (in increasing order) of an element-wise expression, each
    /// element computed as the reduction reads it: the operand is never stored. The CPU
    /// computes four elements along the last axis as one vector: four neighbouring outputs'
    /// where that axis is kept, four consecutive elements of one output where it is reduced.
    ReduceOf {
        /// The operand.
        x: Fused,
        /// Which reduction.
        op: ReduceOp,
        /// Reduced axes.
        axes: Vec<usize>,
        /// Dense result.
        out: View,
    },
    /// Softmax along `axis`.
    Softmax {
        /// The operand.
        x: View,
        /// Normalised axis.
        axis: usize,
        /// Dense result, `x`'s shape.
        out: View,
    },
    /// A running accumulation along `axis` ([`crate::ir::Op::Scan`]), one row per work item;
    /// `a` is the coefficient of the linear recurrence. Operands have `out`'s shape.
    Scan {
        /// Which accumulation.
        op: ScanOp,
        /// The recurrence's coefficient (`ScanOp::Linear` only).
        a: Option<View>,
        /// The accumulated operand (`b` of the recurrence).
        x: View,
        /// Along which axis.
        axis: usize,
        /// From the last element to the first.
        reverse: bool,
        /// Dense result.
        out: View,
    },
    /// Causal linear attention ([`crate::ir::Op::PrefixAttention`]) in blocks of
    /// [`PREFIX_BLOCK`] positions, one batch index per work item: per block, the products of the
    /// block with the `D × Dv` state of the earlier blocks and within the block, then the state
    /// update. `q`, `k`, `v` and `out` are dense f32, `[.., S, D]` and `[.., S, Dv]`.
    PrefixAttention {
        /// Queries.
        q: View,
        /// Keys.
        k: View,
        /// Values.
        v: View,
        /// Each position attends to itself and the later ones.
        reverse: bool,
        /// Dense f32 result.
        out: View,
    },
    /// The stable sorting permutation of `x` along `axis` (i32), one row per work item.
    ArgSort {
        /// The operand.
        x: View,
        /// Along which axis.
        axis: usize,
        /// Largest first.
        descending: bool,
        /// Dense result, `x`'s shape.
        out: View,
        /// A second permutation of `out`'s shape that a merge sort ping-pongs with (CUDA).
        scratch: Option<View>,
        /// Only the first `limit` places of each row are read (`topk`'s slice of an argsort):
        /// a target may select them instead of sorting the row and leave the rest unwritten.
        limit: Option<i64>,
    },
    /// `base` with `src` added at `idx`'s positions along `axis` ([`crate::ir::Op::ScatterAdd`]),
    /// one row (every axis but `axis`) per work item.
    ScatterAdd {
        /// The tensor added into (copied into `out` first).
        base: View,
        /// i32 positions along `axis`, `src`'s shape.
        idx: View,
        /// The values.
        src: View,
        /// Along which axis.
        axis: usize,
        /// Dense result, `base`'s shape.
        out: View,
        /// The site a position out of range is recorded as ([`Schedule::sites`]).
        site: usize,
    },
    /// Layer norm (`beta` given) or RMS norm over the last axis.
    Norm {
        /// The operand.
        x: View,
        /// Scale, `[D]`.
        gamma: View,
        /// Shift, `[D]` (layer norm only).
        beta: Option<View>,
        /// Added to the variance (or mean square).
        eps: f64,
        /// Dense result.
        out: View,
    },
    /// Dropout of a dense f32 tensor ([`crate::ir::Op::Dropout`]), one row (last axis) per work
    /// item: the row copied from `x` and dropped in place by the keep bits of each element
    /// (the CPU's vectorised generator). Other targets and types compute dropout element-wise
    /// ([`dropout_expr`]).
    Dropout {
        /// The operand, dense.
        x: View,
        /// The i32 scalar seed.
        seed: View,
        /// The chance of dropping an element.
        rate: f64,
        /// Dense result, `x`'s shape.
        out: View,
    },
    /// Fused attention.
    Flash(Box<FlashKernel>),
    /// Combines the partial states of a split flash step.
    FlashMerge(Box<FlashKernel>),
    /// Every gradient of one flash op in one pass (FlashAttention-2's backward).
    FlashBwd(Box<FlashBwdKernel>),
    /// Sums a flash backward step's per-item gradients of extra operands into their results.
    FlashBwdReduce(Box<FlashBwdKernel>),
}

impl Kernel {
    /// A short name for the kernel kind (part of generated function names).
    pub fn name(&self) -> &'static str {
        match self {
            Kernel::Elementwise { .. } => "elementwise",
            Kernel::MatMul { .. } => "matmul",
            Kernel::Reduce { .. } | Kernel::ReduceOf { .. } => "reduce",
            Kernel::Softmax { .. } => "softmax",
            Kernel::Scan { op, .. } => op.name(),
            Kernel::ArgSort { .. } => "argsort",
            Kernel::PrefixAttention { .. } => "prefix_attention",
            Kernel::ScatterAdd { .. } => "scatter_add",
            Kernel::Norm { .. } => "norm",
            Kernel::Dropout { .. } => "dropout",
            Kernel::Flash(_) => "flash",
            Kernel::FlashMerge(_) => "flash_merge",
            Kernel::FlashBwd(_) => "flash_bwd",
            Kernel::FlashBwdReduce(_) => "flash_bwd_reduce",
        }
    }
}

/// Positions per block of a [`Kernel::PrefixAttention`] step (the CPU's products; CUDA runs
/// position by position).
pub const PREFIX_BLOCK: i64 = 64;

/// The operands, layout and analyses of a flash step (shared by its merge step).
#[derive(Clone, Debug, PartialEq)]
pub struct FlashKernel {
    /// The op as the graph has it: score modification, mask, weights.
    pub spec: FlashSpec,
    /// `[..b, M, D]`, unit stride along D.
    pub q: View,
    /// `[..b', N, D]`, unit stride along D.
    pub k: View,
    /// `[..b', N, Dv]`, unit stride along Dv.
    pub v: View,
    /// Extra operands the expressions load from.
    pub extras: Vec<View>,
    /// `[..b, M, Dv]` result, unit-strided along `Dv` (dense, or laid out for the axis
    /// permutation that returns it: rows `H·Dv` apart in `[B, S, H, Dv]`).
    pub out: View,
    /// Dense `[..b, M]` f32 log-sum-exp of each row's kept scores, written too when the graph
    /// asks for it ([`crate::ir::Op::FlashLse`]); `-inf` for rows with no kept key.
    pub lse: Option<View>,
    /// The step index of the flash step (its tuning values are keyed by it).
    pub step: usize,
    /// Tile classes ([`tile_table`]).
    pub tiles: BufSlot,
    /// Partial states when keys are split.
    pub partials: BufSlot,
    /// How the target computes it.
    pub variant: Variant,
    /// What the score modification allows.
    pub analysis: FlashAnalysis,
    /// K read from pages through a block table (`k` is then the view of page rows).
    pub k_paging: Option<Paging>,
    /// V read from pages through a block table.
    pub v_paging: Option<Paging>,
}

/// A flash operand (K or V, `[..b, N, D]`) read in place from a paged cache through its block
/// table ([`crate::ir::Op::Paged`]). The operand's view then describes one page: its token axis
/// (N) steps rows inside a page and its table axis has stride 0. Key row `j` of batch index
/// `b…` is that view's element `(b…, j mod P)` plus `clamp(table[b_axis, j / P], 0, NP − 1)`
/// pages of `stride` elements.
#[derive(Clone, Debug, PartialEq)]
pub struct Paging {
    /// The block table, i32 `[B, MP]`.
    pub table: View,
    /// The operand's batch axis that indexes the table's rows.
    pub axis: usize,
    /// Rows per page (P).
    pub page: Dim,
    /// Pages in the pool (NP); page ids are clamped into `[0, NP)`.
    pub pages: Dim,
    /// Elements from one page to the next.
    pub stride: Dim,
}

impl Paging {
    /// The elements a paged operand `view` can reach: its view over one page (token axis of P
    /// rows) with an axis of `NP` pages added. What the bounds verifier checks.
    pub fn reach(&self, view: &View) -> View {
        let mut r = view.clone();
        if let Some(t) = r.shape.len().checked_sub(2) {
            r.shape[t] = self.page.clone();
        }
        r.shape.push(self.pages.clone());
        r.strides.push(self.stride.clone());
        r
    }
}

impl FlashKernel {
    /// The batch axes of the score tensor (the output's).
    pub fn batch(&self) -> &[Dim] {
        let r = self.out.shape.len();
        &self.out.shape[..r.saturating_sub(2)]
    }

    /// Whether K or V is read from a paged cache through its block table.
    pub fn paged(&self) -> bool {
        self.k_paging.is_some() || self.v_paging.is_some()
    }

    /// Query rows, keys, q/k width and v width.
    pub fn sizes(&self) -> (Dim, Dim, Dim, Dim) {
        let r = self.q.shape.len();
        (self.q.shape[r - 2].clone(), self.k.shape[r - 2].clone(), self.q.shape[r - 1].clone(), self.v.shape[r - 1].clone())
    }
}

/// The operands, results and analyses of a flash backward step: the gradients an op's
/// [`crate::ir::Op::FlashGrad`] nodes ask for, computed together. Per key block (outer) and
/// query block (inner): `Sᵀ = K·Qᵀ`, the weights `Pᵀ` from the score modification, mask and
/// `lse`, `dPᵀ = V·dOᵀ`, the score's adjoint `dSᵀ`, then `dV += Pᵀ·dO`, `dK += dSᵀ·Q`,
/// `dQᵀ += Kᵀ·dSᵀ`, and the extra operands' gradients. Work item = one batch index (it owns
/// its `dQ` rows, so nothing is added from two threads).
#[derive(Clone, Debug, PartialEq)]
pub struct FlashBwdKernel {
    /// The flash op differentiated.
    pub spec: FlashSpec,
    /// `[..b, M, D]`, unit stride along D.
    pub q: View,
    /// The scale of the query the schedule folded in (the op's query is `q_scale · q`): it
    /// rides on the `Sᵀ` and `dK` products.
    pub q_scale: Option<ScoreExpr>,
    /// `[..b', N, D]`, unit stride along D.
    pub k: View,
    /// `[..b', N, Dv]`, unit stride along Dv.
    pub v: View,
    /// The cotangent of the result, `[..b, M, Dv]`, unit stride along Dv.
    pub d_out: View,
    /// Softmax weights: the forward's log-sum-exp (`[..b, M]` f32) and result (`[..b, M, Dv]`,
    /// unit stride along Dv), whose rows' `delta = Σ d_out ∘ out` the kernel forms.
    pub lse: Option<(View, View)>,
    /// The rows' `delta = Σ d_out ∘ out` (`[..b, M]` f32, `lse`'s layout), where the step
    /// before computes it once ([`Policy::flash_bwd_delta`](policy::Policy::flash_bwd_delta): on
    /// CUDA, whose key-chunk items would each form it again for every row); else the kernel
    /// forms each row's as it stages the row.
    pub delta: Option<View>,
    /// The cotangent of the log-sum-exp (`[..b, M]` f32, `lse`'s layout) when the graph
    /// differentiates it ([`Op::FlashGrad`](crate::ir::Op::FlashGrad)'s `lse_grad`): each
    /// row's `delta` less it. On CUDA the step after the delta step subtracts it (and this is
    /// `None`); the CPU kernel subtracts it as it forms `delta`.
    pub d_lse: Option<View>,
    /// Extra operands the expressions load from.
    pub extras: Vec<View>,
    /// Dense results, each present when the graph asks for it: `dQ` `[..b, M, D]`, `dK`
    /// `[..b, N, D]`, `dV` `[..b, N, Dv]`.
    pub dq: Option<View>,
    /// A scale the graph applies to `dQ` (the derivative of a scaled query), written with it.
    pub dq_scale: Option<ScoreExpr>,
    /// `dQ` summed in f32 by atomic adds from the key items (`[..b, M, D]`, dense), in the
    /// fast mode of the CUDA tensor-core kernel ([`Policy::flash_bwd_atomic_dq`](policy::Policy::flash_bwd_atomic_dq)):
    /// the step before zeroes it, the step after rounds it into the query gradient, and `dq`
    /// is then `None` here (no query items). Scaled by `dq_scale` as it is added.
    pub dq_accum: Option<View>,
    /// See `dq`.
    pub dk: Option<View>,
    /// See `dq`.
    pub dv: Option<View>,
    /// Dense gradients of extra operands: (which extra, result).
    pub dx: Vec<(usize, View)>,
    /// The score modification's derivatives.
    pub grad: crate::ir::grad::ScoreGrad,
    /// The score's linear form, when it has one ([`BwdLinear`]): unmasked tiles then use the
    /// row kernel.
    pub linear: Option<BwdLinear>,
    /// The step index of the backward step (its tuning values are keyed by it).
    pub step: usize,
    /// Tile classes ([`tile_table`]), as the forward's.
    pub tiles: BufSlot,
    /// Per-item sums of the extra operands' gradients.
    pub partials: BufSlot,
    /// How the target computes it.
    pub variant: Variant,
}

impl FlashBwdKernel {
    /// The batch axes of the score tensor.
    pub fn batch(&self) -> &[Dim] {
        let r = self.d_out.shape.len();
        &self.d_out.shape[..r.saturating_sub(2)]
    }

    /// Query rows, keys, q/k width and v width.
    pub fn sizes(&self) -> (Dim, Dim, Dim, Dim) {
        let r = self.q.shape.len();
        (self.q.shape[r - 2].clone(), self.k.shape[r - 2].clone(), self.q.shape[r - 1].clone(), self.v.shape[r - 1].clone())
    }

    /// Whether the score's adjoint `dS` is needed (for `dQ`, `dK` or an extra's gradient).
    pub fn needs_ds(&self) -> bool {
        self.dq.is_some() || self.dq_accum.is_some() || self.dk.is_some() || !self.dx.is_empty()
    }

    /// For each load of the score's derivative ([`crate::ir::grad::ScoreGrad::loads`]), whether
    /// its gradient is one sum per work item: the gradient of its operand is asked for and its
    /// index depends on batch positions only (ALiBi's slopes), so a renderer keeps the sum in
    /// registers and adds it once per item.
    pub fn item_sums(&self) -> Vec<bool> {
        let rank = self.spec.rank;
        self.grad.loads.iter().map(|l| self.dx.iter().any(|(x, _)| *x == l.input) && item_level(l, rank)).collect()
    }
}

/// Whether a load of the score's derivative has an index that depends on batch positions only
/// (its gradient is one sum per work item, as ALiBi's slopes).
pub(crate) fn item_level(l: &crate::ir::grad::LoadGrad, rank: usize) -> bool {
    l.index.iter().all(|e| level(e, rank) == Level::Item)
}

impl FlashBwdKernel {
    /// Whether every extra operand's gradient asked for is item sums ([`Self::item_sums`]):
    /// what the CUDA tensor-core backward computes in its deterministic mode (scattered ones,
    /// as bias tables', it adds atomically, so only where `dQ` is added atomically too).
    pub fn extra_grads_are_item_sums(&self) -> bool {
        let rank = self.spec.rank;
        self.grad.loads.iter().all(|l| !self.dx.iter().any(|(x, _)| *x == l.input) || item_level(l, rank))
    }
}

/// A bound checked before running (slices must lie inside their axis).
#[derive(Clone, Debug, PartialEq)]
pub struct Check {
    /// `%N (slice)`.
    pub node: String,
    /// Where the slice is written in the source, when known.
    pub span: Option<Span>,
    /// The axis.
    pub axis: usize,
    /// First index.
    pub start: Dim,
    /// One past the last.
    pub end: Dim,
    /// The axis' size.
    pub size: Dim,
}

/// One step: a kernel run over `0..ints[work]` work items.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    /// The slot holding the number of work items.
    pub work: IntSlot,
    /// What it computes.
    pub kernel: Kernel,
    /// `%N op`, for listings.
    pub label: String,
    /// The source expression of the step's node, when known (for messages).
    pub span: Option<Span>,
    /// Buffers it reads.
    pub reads: Vec<BufSlot>,
    /// Buffers it writes.
    pub writes: Vec<BufSlot>,
}

/// The schedule of one graph for one target.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    /// The entry point's name.
    pub name: String,
    /// The target it is for.
    pub target: Target,
    /// Every buffer.
    pub buffers: Vec<Buffer>,
    /// The integer table: every dim and tuning value generated code reads.
    pub ints: Vec<IntValue>,
    /// Steps in execution order.
    pub steps: Vec<Step>,
    /// The buffer of each output, in output order.
    pub outputs: Vec<BufSlot>,
    /// The buffer of each parameter, in parameter order.
    pub params: Vec<BufSlot>,
    /// Bounds to check per run shape.
    pub checks: Vec<Check>,
    /// The fault record, when a kernel checks indices ([`BufferKind::Fault`]).
    pub fault: Option<BufSlot>,
    /// The checked indexing ops, by site number.
    pub sites: Vec<Site>,
}

impl Schedule {
    /// The error a fault record read back after a run describes, or `None` when it records no
    /// fault.
    pub fn fault_error(&self, record: [i32; 4]) -> Option<crate::exec::ExecError> {
        let site = usize::try_from(record[0]).ok()?.checked_sub(1)?;
        let (label, span) = self.sites.get(site).map_or(("?".to_string(), None), |s| (s.label.clone(), s.span));
        Some(crate::exec::ExecError::IndexOutOfRange {
            node: label,
            span,
            axis: usize::try_from(record[1]).unwrap_or(0),
            index: i64::from(record[2]),
            size: usize::try_from(record[3]).unwrap_or(0),
        })
    }

    /// An empty schedule.
    pub(super) fn new(name: &str, target: Target) -> Schedule {
        Schedule {
            name: name.to_string(),
            target,
            buffers: Vec::new(),
            ints: Vec::new(),
            steps: Vec::new(),
            outputs: Vec::new(),
            params: Vec::new(),
            checks: Vec::new(),
            fault: None,
            sites: Vec::new(),
        }
    }

    /// The slot of an integer, if the table has it.
    pub fn slot(&self, v: &IntValue) -> Option<IntSlot> {
        self.ints.iter().position(|x| x == v)
    }

    /// The slot of a tuning value of a step, if the table has it.
    pub fn tuning(&self, step: usize, param: Tuning) -> Option<IntSlot> {
        self.slot(&IntValue::Tuning { step, param })
    }

    /// The slot of an integer, adding it if new.
    pub(super) fn int(&mut self, v: IntValue) -> IntSlot {
        if let Some(i) = self.slot(&v) {
            return i;
        }
        self.ints.push(v);
        self.ints.len() - 1
    }
}

/// Schedules a verified graph for `policy`'s target: the four passes, each followed by the
/// verifier's checks of what it guarantees.
pub fn schedule(graph: &Graph, policy: &Policy) -> Result<Schedule, ScheduleError> {
    if let Err(errors) = crate::ir::verify(graph) {
        let reason: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
        return Err(ScheduleError::Invalid { graph: graph.name.clone(), reason: reason.join("; ") });
    }
    let checked = |plan: &Schedule, pass: &'static str, result: Result<(), Vec<VerifyError>>| {
        result.map_err(|findings| ScheduleError::Unverified { graph: plan.name.clone(), pass, findings })
    };
    let graph = &*legalize::expand(graph, policy.paged_in_place())
        .map_err(|reason| ScheduleError::Invalid { graph: graph.name.clone(), reason })?;
    let mut plan = form::form(graph, policy, place::Placement::of(graph))?;
    checked(&plan, "kernel formation", verify::formed(&plan))?;
    liveness::liveness(&mut plan);
    checked(&plan, "liveness", verify::live(&plan))?;
    ints::integer_table(&mut plan, policy);
    checked(&plan, "the integer table", verify::tables(&plan, policy))?;
    Ok(plan)
}

/// Every dim a score expression reads, for [`FlashKernel`]s.
pub fn score_dims(f: &FlashKernel) -> Vec<Dim> {
    let mut out = Vec::new();
    let exprs: Vec<&ScoreExpr> = std::iter::once(&f.spec.score).chain(f.spec.mask.as_ref()).chain(f.analysis.alpha.as_ref()).collect();
    for e in exprs {
        dims_of(e, &mut out);
    }
    out
}

/// Every dim a flash backward's expressions (score, mask, derivatives) read.
pub fn bwd_dims(f: &FlashBwdKernel) -> Vec<Dim> {
    let mut out = Vec::new();
    let mut exprs: Vec<&ScoreExpr> = vec![&f.spec.score, &f.grad.ds];
    exprs.extend(f.spec.mask.as_ref());
    for l in &f.grad.loads {
        exprs.push(&l.d);
        exprs.extend(&l.index);
    }
    if let Some(lin) = &f.linear {
        exprs.extend(lin.alpha.iter().chain(&lin.factor).chain(&lin.sep));
    }
    exprs.extend(f.q_scale.as_ref().into_iter().chain(&f.dq_scale));
    for e in exprs {
        dims_of(e, &mut out);
    }
    out
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod verify_tests;
