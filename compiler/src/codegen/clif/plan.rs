//! The execution plan of one graph on the CPU: buffers, the integer table every generated
//! function reads its sizes and strides from, and the ordered steps (one generated function
//! each, run over a range of work items).
//!
//! Everything here is symbolic ([`Dim`] polynomials): the runtime evaluates the integer table
//! once per run shape, sizes the buffers, and calls the functions. Nothing is recompiled when a
//! size changes.

use crate::ir::{BinaryOp, DType, Dim, FlashSpec, ReduceOp, ScoreExpr, UnaryOp};

/// Index of a buffer in [`Plan::buffers`]; generated code reads its address from `bufs[slot]`.
pub type BufSlot = usize;

/// Index of an integer in [`Plan::ints`]; generated code reads it from `ints[slot]`.
pub type IntSlot = usize;

/// A run-time integer: a symbolic dim, or a size the runtime chooses per run shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum IntValue {
    /// A dim polynomial evaluated in the run's dim environment.
    Dim(Dim),
    /// A tuning value of step `step`, chosen by the runtime (block sizes, key splits).
    Tuning {
        /// The step it belongs to.
        step: usize,
        /// Which value.
        param: Tuning,
    },
}

/// Values the runtime chooses per run shape; every generated function handles any choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tuning {
    /// Query rows per flash work item (≥ 1).
    BlockM,
    /// Keys per flash tile (≥ 1).
    BlockN,
    /// Key splits per query block (≥ 1; > 1 writes partial states that a merge step combines).
    Splits,
    /// Keys per split, a multiple of `BlockN`.
    KeysPerSplit,
    /// Query blocks: `ceil(M / BlockM)`.
    QueryBlocks,
    /// Key tiles: `ceil(N / BlockN)` (the tile table's row length).
    KeyBlocks,
    /// Work items of the step (flash: batch × query blocks × splits; merge: batch × query blocks).
    Items,
    /// Rows of `C` per matmul work item.
    MatMulRows,
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
    /// A flash step's tile classes (`u8` per query block × key tile: 0 skip, 1 full, 2 partial).
    TileTable {
        /// The flash step.
        step: usize,
    },
    /// A flash step's partial softmax states when keys are split (`f32`, sized by the runtime).
    Partials {
        /// The flash step.
        step: usize,
    },
}

/// One buffer. Elements are 4 bytes: f32 (f16/bf16 stored as f32 values already rounded to
/// their type), i32, and bool as i32 0/1.
#[derive(Clone, Debug, PartialEq)]
pub struct Buffer {
    /// Who provides it.
    pub kind: BufferKind,
    /// Element type.
    pub dtype: DType,
    /// Element count (unused for tile tables and partials, which the runtime sizes).
    pub elems: Dim,
    /// The IR value it holds (`%N`), for messages and stats.
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

    /// True when stepping along `axis` moves one element (or the axis has size 1).
    pub fn unit_stride(&self, axis: usize) -> bool {
        self.strides[axis].as_const() == Some(1) || self.shape[axis].as_const() == Some(1)
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

/// A scalar expression evaluated per element of an element-wise kernel's output.
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
    /// `table[idx...]` with clamped indices; `table` is input `.0`.
    Gather(usize, Vec<Expr>, DType),
}

/// What a step's function computes.
#[derive(Clone, Debug, PartialEq)]
pub enum Kernel {
    /// `out[idx] = expr(idx)` over `out`'s shape; one work item per row (all axes but the last).
    Elementwise {
        /// Where results go (any strides).
        out: View,
        /// The loads the expression refers to, each broadcast to `out`'s shape.
        inputs: Vec<View>,
        /// The expression.
        expr: Expr,
    },
    /// Batched `C = A @ B` with broadcast batch axes; one work item per (batch, row block).
    MatMul {
        /// `[..., M, K]`, unit stride along K.
        a: View,
        /// `[..., K, N]`, unit stride along N (`nn`) or along K (`nt`).
        b: View,
        /// `[batch..., M, N]`, dense.
        c: View,
        /// B is read transposed: unit stride along K.
        b_transposed: bool,
    },
    /// A reduction over `axes` of `x` into dense `out` (keepdim layout); one item per output.
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
    /// Softmax along `axis`; one item per row.
    Softmax {
        /// The operand.
        x: View,
        /// Normalised axis.
        axis: usize,
        /// Dense result, `x`'s shape.
        out: View,
    },
    /// Layer norm (`beta` given) or RMS norm over the last axis; one item per row.
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
    /// Fused attention; one item per (batch, query block, key split).
    Flash(Box<FlashKernel>),
    /// Combines the partial states of a split flash step; one item per (batch, query block).
    FlashMerge(Box<FlashKernel>),
}

/// The operands and layout of a flash step (shared by its merge step).
#[derive(Clone, Debug, PartialEq)]
pub struct FlashKernel {
    /// Score modification, mask, weights.
    pub spec: FlashSpec,
    /// `[..b, M, D]`, unit stride along D.
    pub q: View,
    /// `[..b', N, D]`, unit stride along D.
    pub k: View,
    /// `[..b', N, Dv]`, unit stride along Dv.
    pub v: View,
    /// Extra operands the expressions load from.
    pub extras: Vec<View>,
    /// Dense `[..b, M, Dv]` result.
    pub out: View,
    /// The step index of the flash step (its tuning values are keyed by it).
    pub step: usize,
    /// Tile classes, `[QueryBlocks × KeyBlocks]` bytes.
    pub tiles: BufSlot,
    /// Partial states when keys are split.
    pub partials: BufSlot,
    /// The score is `s · scale` for a position-independent `scale`, folded into the Q·Kᵀ
    /// product's `alpha` (then the per-element score code is the identity).
    pub alpha: Option<ScoreExpr>,
}

/// A bound the runtime checks before running (slices must lie inside their axis).
#[derive(Clone, Debug, PartialEq)]
pub struct Check {
    /// `%N (slice)`.
    pub node: String,
    /// The axis.
    pub axis: usize,
    /// First index.
    pub start: Dim,
    /// One past the last.
    pub end: Dim,
    /// The axis' size.
    pub size: Dim,
}

/// One step: a generated function run over `0..ints[work]` work items.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    /// Index into [`super::CpuModule::functions`].
    pub func: usize,
    /// The slot holding the number of work items.
    pub work: IntSlot,
    /// What it computes.
    pub kernel: Kernel,
    /// `%N op`, for listings.
    pub label: String,
    /// Buffers it reads.
    pub reads: Vec<BufSlot>,
    /// Buffers it writes.
    pub writes: Vec<BufSlot>,
}

/// The plan of one graph.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// The entry point's name.
    pub name: String,
    /// Every buffer.
    pub buffers: Vec<Buffer>,
    /// The integer table.
    pub ints: Vec<IntValue>,
    /// Steps in execution order.
    pub steps: Vec<Step>,
    /// The buffer of each output, in output order.
    pub outputs: Vec<BufSlot>,
    /// The buffer of each parameter, in parameter order.
    pub params: Vec<BufSlot>,
    /// Bounds to check per run shape.
    pub checks: Vec<Check>,
}

impl Plan {
    /// The slot of an integer, adding it if new.
    pub fn int(&mut self, v: IntValue) -> IntSlot {
        if let Some(i) = self.ints.iter().position(|x| *x == v) {
            return i;
        }
        self.ints.push(v);
        self.ints.len() - 1
    }

    /// The slot of a dim.
    pub fn dim(&mut self, d: &Dim) -> IntSlot {
        self.int(IntValue::Dim(d.clone()))
    }

    /// The slot of a tuning value of `step`.
    pub fn tuning(&mut self, step: usize, param: Tuning) -> IntSlot {
        self.int(IntValue::Tuning { step, param })
    }

    /// For each temporary buffer, the first and last step that touches it (inclusive); `None`
    /// for buffers no step touches and for non-temporaries.
    pub fn lifetimes(&self) -> Vec<Option<(usize, usize)>> {
        let mut out: Vec<Option<(usize, usize)>> = vec![None; self.buffers.len()];
        for (s, step) in self.steps.iter().enumerate() {
            for b in step.reads.iter().chain(&step.writes) {
                if self.buffers[*b].kind != BufferKind::Temp {
                    continue;
                }
                out[*b] = Some(match out[*b] {
                    None => (s, s),
                    Some((a, _)) => (a, s),
                });
            }
        }
        out
    }
}
