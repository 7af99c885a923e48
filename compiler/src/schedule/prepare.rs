//! From a schedule and one set of dim values to the launch-time plan ([`Prepared`]): the
//! integer table's values (dims, block sizes, work items, scratch layout), buffer sizes, tile
//! tables, the placement of intermediates in one arena, and the CUDA kernels' compile-time
//! values. Pure arithmetic on the host, shared by the CPU and CUDA runtimes and the tests.

use super::policy::{
    CUDA_BWD_KEYS, CUDA_BWD_ROWS, CUDA_ELEMENTS, CUDA_LANE_KEYS, CUDA_MATMUL_TILE, CUDA_MMA_BWD_BLOCK, CUDA_MMA_ROWS, CUDA_SIMT_ROWS,
    CpuPolicy, CudaPolicy, Policy, cuda_mma_keys, cuda_pad_head,
};
use super::{BufSlot, BufferKind, FlashBwdKernel, FlashKernel, IntValue, Kernel, Paging, Schedule, Tuning, Variant, View, tile_table};
use crate::exec::MAX_ELEMENTS;
use crate::ir::{DType, Dim, DimError, Known, RangeTable};
use std::collections::HashMap;
use std::sync::Arc;
use thiserror::Error;

/// The widest additive (Bahdanau) score a flash op takes: the CPU kernel's per-thread buffers
/// hold about `4 · width · 256` floats (32 MiB at this width).
pub const MAX_ADDITIVE_WIDTH: i64 = 8192;

/// Why a schedule cannot run with these dims on this target.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PrepareError {
    /// A dim the schedule uses has no value.
    #[error("dimension `{0}` has no value")]
    UnboundDim(String),
    /// A dim evaluates to a negative size.
    #[error("`{dim}` evaluates to {value}, a negative size")]
    Negative {
        /// The dim.
        dim: String,
        /// Its value.
        value: i64,
    },
    /// A dim expression overflows 64-bit arithmetic.
    #[error("{0} overflows")]
    Overflow(String),
    /// A slice reaches outside its axis.
    #[error("{node}: the slice {start}..{end} of axis {axis} is outside 0..{size}")]
    OutOfRange {
        /// `%N slice`.
        node: String,
        /// Where the slice is written in the source, when known.
        span: Option<attn_dsl::Span>,
        /// The axis.
        axis: usize,
        /// First index.
        start: i64,
        /// One past the last.
        end: i64,
        /// The axis' size.
        size: i64,
    },
    /// A flash op's extra operand (a table its score reads) is empty while the op has scores:
    /// every index into it is out of range.
    #[error("flash step {step}: its extra operand x{operand} is empty, so no index into it is in range")]
    EmptyOperand {
        /// The flash step.
        step: usize,
        /// Which extra operand.
        operand: usize,
    },
    /// Additive scores wider than the score kernels' per-thread tile buffers are sized for.
    #[error("flash step {step}: additive scores of width {width} (the limit is {limit})")]
    AdditiveWidth {
        /// The flash step.
        step: usize,
        /// The attention width (q's and k's last axis).
        width: i64,
        /// `MAX_ADDITIVE_WIDTH` (8192).
        limit: i64,
    },
    /// A buffer with more elements than any target holds.
    #[error("{what} would have {elements} elements (the limit is {limit})")]
    TooLarge {
        /// The buffer.
        what: String,
        /// Its element count.
        elements: i64,
        /// The limit.
        limit: usize,
    },
    /// A flash op whose head is wider than the CUDA kernels support.
    #[error("flash step {step}: head width {width} is above the 256 the CUDA kernels support")]
    HeadDim {
        /// The flash step.
        step: usize,
        /// The width.
        width: i64,
    },
    /// The schedule lacks a value its kernels read (a compiler bug).
    #[error("internal error: {0}")]
    Internal(String),
}

/// A schedule made concrete for one set of dims.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prepared {
    /// The dims it was prepared for, sorted (a cache key).
    pub key: Vec<(String, i64)>,
    /// The integer table's values, in [`Schedule::ints`] order.
    pub ints: Vec<i64>,
    /// Elements of each buffer (bytes for tile tables, floats for partial states).
    pub elems: Vec<usize>,
    /// The tile tables to upload: (buffer, contents).
    pub tables: Vec<(BufSlot, Vec<u8>)>,
    /// Byte offset of each temporary in one arena of [`Prepared::arena_bytes`] (4-byte
    /// elements, 64-byte aligned, placed by lifetime); `None` for other buffers.
    pub arena: Vec<Option<usize>>,
    /// Bytes of the arena.
    pub arena_bytes: usize,
    /// Scratch bytes each CPU thread needs (the largest flash tile).
    pub scratch_bytes: usize,
    /// CUDA: the kernels' compile-time values (`-D` macros): padded head widths and key tiles.
    pub defines: Vec<(String, i64)>,
    /// CUDA: the tensor maps the launch encodes and hands to every kernel (`attnc_tmaps`, 128
    /// bytes each, in this order): a TMA-loading flash step `s` reads K's at
    /// `ATTNC_TMA_{s} - 1` and V's after it.
    pub tma: Vec<TmaMap>,
}

/// A TMA tensor map of a K or V view, as `cuTensorMapEncodeTiled` takes it (16-bit elements,
/// 128-byte swizzle, zeros outside the tensor): dims innermost first (the row's columns, the
/// rows, then the batch axes the view moves along, last first: [`tma_axes`]), the box one key
/// tile of [`TMA_BOX_COLS`] columns. A copy at coordinates (column, row, batch indices...)
/// lands as the 128-byte swizzled sub-tile the warpgroup products read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TmaMap {
    /// The buffer.
    pub buf: BufSlot,
    /// Bytes from the buffer's start to the view's first element (a multiple of 16).
    pub offset_bytes: u64,
    /// Elements per dim, innermost first.
    pub dims: Vec<u64>,
    /// Bytes from one index to the next of dims 1.. (multiples of 16).
    pub strides: Vec<u64>,
    /// The box: elements per dim.
    pub boxes: Vec<u32>,
}

/// Columns of a TMA box: one 128-byte row of 16-bit elements, the swizzle's span.
pub const TMA_BOX_COLS: i64 = 64;

/// The batch axes (indices into `batch`) along which `view` moves: a tensor map's dims past
/// the row, in the coordinates' order (the last batch axis first). Broadcast axes stay out.
pub fn tma_axes(view: &View, batch: &[Dim]) -> Vec<usize> {
    moving_axes(&view.batch_strides(batch))
}

/// [`tma_axes`] from the view's batch strides.
fn moving_axes(strides: &[Dim]) -> Vec<usize> {
    (0..strides.len()).rev().filter(|a| strides[*a].as_const() != Some(0)).collect()
}

/// The tensor map of a K or V `view` (`[batch..., rows, width]`) for key tiles of `rows` rows,
/// or `None` where TMA cannot load it: elements other than 16-bit, columns not unit-strided, a
/// first element or a stride not a multiple of 16 bytes, more than 3 batch axes, sizes past
/// 32-bit coordinates.
pub fn tma_map(view: &View, batch: &[Dim], rows: i64, env: &HashMap<String, i64>) -> Option<TmaMap> {
    if !matches!(view.dtype, DType::F16 | DType::BF16) || view.shape.len() < 2 {
        return None;
    }
    let r = view.shape.len();
    let strides = view.batch_strides(batch);
    let axes = moving_axes(&strides);
    if axes.len() > 3 {
        return None;
    }
    let get = |d: &Dim| eval(d, env).ok();
    let (width, n, col, row) = (get(&view.shape[r - 1])?, get(&view.shape[r - 2])?, get(&view.strides[r - 1])?, get(&view.strides[r - 2])?);
    let offset = get(&view.offset)?;
    let mut dims = vec![width, n];
    let mut steps = vec![row];
    for a in &axes {
        dims.push(get(&batch[*a])?);
        steps.push(get(&strides[*a])?);
    }
    let coordinate = |x: i64| (1..=i64::from(i32::MAX)).contains(&x);
    let aligned = |x: i64| x > 0 && x % 8 == 0 && x < 1 << 39;
    let ok = col == 1
        && offset >= 0
        && offset % 8 == 0
        && row >= width
        && dims.iter().all(|d| coordinate(*d))
        && steps.iter().all(|s| aligned(*s))
        && (1..=256).contains(&rows);
    ok.then(|| {
        let mut boxes = vec![TMA_BOX_COLS as u32, rows as u32];
        boxes.resize(dims.len(), 1);
        TmaMap {
            buf: view.buf,
            offset_bytes: offset as u64 * 2,
            dims: dims.iter().map(|d| *d as u64).collect(),
            strides: steps.iter().map(|s| *s as u64 * 2).collect(),
            boxes,
        }
    })
}

impl Prepared {
    /// Work items of each step.
    pub fn work(&self, schedule: &Schedule) -> Vec<i64> {
        schedule.steps.iter().map(|s| self.ints.get(s.work).copied().unwrap_or(0)).collect()
    }
}

/// Evaluates a dim with checked arithmetic.
pub fn eval(d: &Dim, env: &HashMap<String, i64>) -> Result<i64, PrepareError> {
    d.eval(env).map_err(|e| match e {
        DimError::Unbound(name) => PrepareError::UnboundDim(name),
        DimError::Overflow(what) => PrepareError::Overflow(format!("dimension {what}")),
    })
}

/// A size: a non-negative dim.
fn size(d: &Dim, env: &HashMap<String, i64>) -> Result<i64, PrepareError> {
    let v = eval(d, env)?;
    if v < 0 {
        return Err(PrepareError::Negative { dim: d.to_string(), value: v });
    }
    Ok(v)
}

fn product(dims: &[Dim], env: &HashMap<String, i64>) -> Result<i64, PrepareError> {
    dims.iter()
        .try_fold(1i64, |acc, d| acc.checked_mul(size(d, env)?).ok_or_else(|| PrepareError::Overflow(format!("the product of {dims:?}"))))
}

fn count(n: i64, what: &str) -> Result<usize, PrepareError> {
    match usize::try_from(n) {
        Ok(v) if v <= MAX_ELEMENTS => Ok(v),
        _ => Err(PrepareError::TooLarge { what: what.to_string(), elements: n, limit: MAX_ELEMENTS }),
    }
}

fn ceil_div(a: i64, b: i64) -> i64 {
    if a <= 0 { 0 } else { (a + b.max(1) - 1) / b.max(1) }
}

/// Byte offsets of the regions of a CPU flash kernel's per-thread scratch, and its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashScratch {
    /// The score/probability tile, `BlockM × BlockN` f32.
    pub tile: usize,
    /// The output accumulator, `BlockM × Dv` f32.
    pub acc: usize,
    /// Running row maxima, `BlockM` f32.
    pub max: usize,
    /// Running row sums, `BlockM` f32.
    pub sum: usize,
    /// The key-position part of a separable score, `BlockN` f32.
    pub bias: usize,
    /// A key tile of a paged K and V gathered dense (`kv_floats`: `BlockN × (D + Dv)` f32 when
    /// K or V is paged, else none).
    pub kv: usize,
    /// Total bytes.
    pub total: usize,
}

/// The scratch layout for blocks of `bm × bn`, value width `dv` and `kv_floats` floats of
/// gathered key tile (64-byte aligned regions).
pub fn flash_scratch(bm: usize, bn: usize, dv: usize, kv_floats: usize) -> FlashScratch {
    let round = |x: usize| x.div_ceil(64) * 64;
    let acc = round(bm * bn * 4);
    let max = acc + round(bm * dv * 4);
    let sum = max + round(bm * 4);
    let bias = sum + round(bm * 4);
    let kv = bias + round(bn * 4);
    FlashScratch { tile: 0, acc, max, sum, bias, kv, total: kv + round(kv_floats * 4) }
}

/// Byte offsets of the regions of a CPU flash backward's per-thread scratch, and its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashBwdScratch {
    /// Floats between rows of `Pᵀ`, `dSᵀ` and `dQᵀ`: `M` rounded up to 16, plus 16.
    pub stride: usize,
    /// `Sᵀ`, then `Pᵀ`, of one key block against every query: `BlockN × stride` f32, at 0.
    pub p: usize,
    /// `dPᵀ`, then `dSᵀ`: `BlockN × stride` f32.
    pub ds: usize,
    /// `dQᵀ` of the whole batch index: `D × stride` f32.
    pub dq: usize,
    /// `dK` of one key block: `BlockN × D` f32.
    pub dk: usize,
    /// `dV` of one key block: `BlockN × Dv` f32.
    pub dv: usize,
    /// `Kᵀ` of one key block: `D × BlockN` f32.
    pub kt: usize,
    /// A key row's `dF`, the queries' separable row terms, the rows' `delta`, the row terms of
    /// a summed load's derivative (`4 × stride` f32), then two sums.
    pub row: usize,
    /// Total bytes.
    pub total: usize,
}

/// The backward's scratch layout for key blocks of `bn`, `m` query rows, widths `d` and `dv`
/// (64-byte aligned regions; sizes saturate, and [`prepare()`] refuses absurd totals).
pub fn flash_bwd_scratch(bn: usize, m: usize, d: usize, dv: usize) -> FlashBwdScratch {
    let round = |x: usize| x.saturating_mul(4).div_ceil(64).saturating_mul(64);
    let stride = m.div_ceil(16).saturating_mul(16).saturating_add(16);
    let ds = round(bn.saturating_mul(stride));
    let dq = ds.saturating_add(round(bn.saturating_mul(stride)));
    let dk = dq.saturating_add(round(d.saturating_mul(stride)));
    let dvo = dk.saturating_add(round(bn.saturating_mul(d)));
    let kt = dvo.saturating_add(round(bn.saturating_mul(dv)));
    let row = kt.saturating_add(round(d.saturating_mul(bn)));
    FlashBwdScratch {
        stride,
        p: 0,
        ds,
        dq,
        dk,
        dv: dvo,
        kt,
        row,
        total: row.saturating_add(round(stride.saturating_mul(4).saturating_add(16))),
    }
}

/// What a flash step works on, per run.
struct FlashBlocks {
    bm: i64,
    bn: i64,
    splits: i64,
    kps: i64,
    nqb: i64,
    nkb: i64,
    batch: i64,
}

/// Everything one run of `schedule` with dims `env` needs on `policy`'s target.
pub fn prepare(schedule: &Schedule, env: &HashMap<String, i64>, policy: &Policy) -> Result<Prepared, PrepareError> {
    prepare_with(schedule, env, policy, &HashMap::new())
}

/// The parameters (by index) whose values classify flash tiles when a run gives them
/// ([`prepare_with`]): i32 and bool parameters of one axis or more that a flash op reads as an
/// extra operand (segment ids, per-sequence lengths, a dense mask such as transformers'
/// `[B, 1, L, S]` padding and packing masks).
pub fn mask_data_params(schedule: &Schedule) -> Vec<usize> {
    mask_params_where(schedule, |x| matches!(x.dtype, crate::ir::DType::I32 | crate::ir::DType::Bool))
}

/// The [`mask_data_params`] that are 1-d or 2-d i32 ids or lengths: small next to the tensors
/// (what the CUDA target copies to the host to classify from, where a dense mask would cost a
/// copy of its own per run).
pub fn id_data_params(schedule: &Schedule) -> Vec<usize> {
    mask_params_where(schedule, |x| x.dtype == crate::ir::DType::I32 && x.shape.len() <= 2)
}

fn mask_params_where(schedule: &Schedule, keep: impl Fn(&super::View) -> bool) -> Vec<usize> {
    let mut out = Vec::new();
    for step in &schedule.steps {
        let extras = match &step.kernel {
            Kernel::Flash(f) => &f.extras,
            Kernel::FlashBwd(f) => &f.extras,
            _ => continue,
        };
        for x in extras {
            if let Some(&BufferKind::Param(i)) = schedule.buffers.get(x.buf).map(|b| &b.kind)
                && !x.shape.is_empty()
                && keep(x)
                && !out.contains(&i)
            {
                out.push(i);
            }
        }
    }
    out
}

/// [`prepare`] with the values of i32 and bool parameters that flash masks read (by parameter
/// index, [`mask_data_params`]): their tiles are classified from the data (segment ids of a
/// packed ragged batch skip every tile across two sequences; a dense mask skips the tiles it
/// masks whole). `env` must name the data too (its
/// [`data_param_key`]), since a prepared run is reused for an equal `env`.
pub fn prepare_with(
    schedule: &Schedule,
    env: &HashMap<String, i64>,
    policy: &Policy,
    data: &HashMap<usize, Arc<RangeTable>>,
) -> Result<Prepared, PrepareError> {
    let mut key: Vec<(String, i64)> = env.iter().map(|(k, v)| (k.clone(), *v)).collect();
    key.sort();
    for c in &schedule.checks {
        let (start, end, size) = (eval(&c.start, env)?, eval(&c.end, env)?, eval(&c.size, env)?);
        if !(0 <= start && start <= end && end <= size) {
            return Err(PrepareError::OutOfRange { node: c.node.clone(), span: c.span, axis: c.axis, start, end, size });
        }
    }
    let mut p = Preparing { env, data, schedule, policy, tuning: HashMap::new(), prepared: Prepared::default_for(key, schedule) };
    for (s, step) in schedule.steps.iter().enumerate() {
        let items = p.step(s, &step.kernel)?;
        p.tuning.insert((s, Tuning::Items), items);
    }
    let mut ints = Vec::with_capacity(schedule.ints.len());
    for v in &schedule.ints {
        ints.push(match v {
            IntValue::Dim(d) => eval(d, env)?,
            IntValue::Tuning { step, param } => p
                .tuning
                .get(&(*step, *param))
                .copied()
                .ok_or_else(|| PrepareError::Internal(format!("no {param:?} chosen for step {step}")))?,
        });
    }
    let mut prepared = p.prepared;
    prepared.ints = ints;
    for (b, buf) in schedule.buffers.iter().enumerate() {
        if !matches!(buf.kind, BufferKind::TileTable { .. } | BufferKind::Partials { .. }) {
            prepared.elems[b] = count(size(&buf.elems, env)?, &format!("buffer of %{}", buf.value))?;
        }
    }
    (prepared.arena, prepared.arena_bytes) = place(schedule, &prepared.elems);
    Ok(prepared)
}

/// The most bytes of tile tables per batch index a flash step keeps (64 MiB); above it, one
/// table serves the whole batch.
const MAX_BATCH_TABLE_BYTES: i64 = 1 << 26;

/// The tile tables of a flash step and how work items find theirs: flat batch index `b` reads
/// table `b / div` ([`Tuning::TileBatchDiv`]). With `per_group` (not for a paged step, whose
/// CPU head groups walk several batch indices per item), where the
/// data a mask reads differs per batch index (per-batch ids, a `[B, 1, L, S]` mask) one table
/// per index of the leading batch axes the mask reads (up to [`crate::ir::PER_BATCH`] of them):
/// each batch index skips its own masked tiles (a padded row of the batch its padding), where
/// one table for all must keep a tile that any of them keeps. Else (or above
/// [`MAX_BATCH_TABLE_BYTES`] of tables) one table for the whole batch (`div` the batch size).
fn tile_tables(
    mask: Option<&crate::ir::ScoreExpr>,
    batch_sizes: &[i64],
    mn: (i64, i64),
    blocks: (i64, i64),
    spans: bool,
    known: &Known,
    per_group: bool,
) -> (Vec<u8>, i64) {
    let whole: Vec<(i64, i64)> = batch_sizes.iter().map(|n| (0, (n - 1).max(0))).collect();
    let lead = match mask {
        Some(mask) if per_group && known.data.values().any(|t| t.per_batch()) => {
            (0..batch_sizes.len()).rev().find(|k| crate::ir::reads_position(mask, *k)).map_or(0, |k| k + 1)
        }
        _ => 0,
    };
    let groups = batch_sizes[..lead].iter().try_fold(1i64, |a, n| a.checked_mul(*n)).unwrap_or(i64::MAX);
    // One table's bytes; the tables per batch index stay within `MAX_BATCH_TABLE_BYTES`.
    let (bm, bn) = (blocks.0.max(1), blocks.1.max(1));
    let one =
        ceil_div(mn.0.max(0), bm).saturating_mul(ceil_div(mn.1.max(0), bn)).saturating_mul(tile_table::entry_bytes(bm as usize) as i64);
    if lead == 0 || !(2..=crate::ir::PER_BATCH).contains(&groups) || one.saturating_mul(groups) > MAX_BATCH_TABLE_BYTES {
        let div = batch_sizes.iter().try_fold(1i64, |a, n| a.checked_mul(*n)).unwrap_or(i64::MAX).max(1);
        return (tile_table::table(mask, &whole, mn, blocks, spans, known), div);
    }
    let div = batch_sizes[lead..].iter().try_fold(1i64, |a, n| a.checked_mul(*n)).unwrap_or(i64::MAX).max(1);
    let mut out = Vec::new();
    for g in 0..groups {
        let mut ranges = whole.clone();
        let mut rest = g;
        for k in (0..lead).rev() {
            let n = batch_sizes[k].max(1);
            ranges[k] = (rest % n, rest % n);
            rest /= n;
        }
        out.extend(tile_table::table(mask, &ranges, mn, blocks, spans, known));
    }
    (out, div)
}

impl Prepared {
    fn default_for(key: Vec<(String, i64)>, schedule: &Schedule) -> Prepared {
        let n = schedule.buffers.len();
        Prepared {
            key,
            ints: Vec::new(),
            elems: vec![0; n],
            tables: Vec::new(),
            arena: vec![None; n],
            arena_bytes: 0,
            scratch_bytes: 0,
            defines: Vec::new(),
            tma: Vec::new(),
        }
    }
}

struct Preparing<'a> {
    env: &'a HashMap<String, i64>,
    data: &'a HashMap<usize, Arc<RangeTable>>,
    schedule: &'a Schedule,
    policy: &'a Policy,
    tuning: HashMap<(usize, Tuning), i64>,
    prepared: Prepared,
}

impl Preparing<'_> {
    /// What the run knows of a flash op's `extras`, for classifying its tiles: the bindings
    /// plus the value of each 0-d i32 input the run gave ([`crate::ir::scalar_param_key`]) as
    /// the mask's `x<n>[]` ([`crate::ir::scalar_load_key`]), and the range tables of the i32 and
    /// bool inputs it gave ([`prepare_with`]) by operand index `n`.
    fn run_values(&self, extras: &[super::View]) -> (HashMap<String, i64>, HashMap<usize, Arc<RangeTable>>) {
        let mut env = self.env.clone();
        let mut data = HashMap::new();
        for (n, x) in extras.iter().enumerate() {
            let Some(&BufferKind::Param(i)) = self.schedule.buffers.get(x.buf).map(|b| &b.kind) else { continue };
            if x.shape.is_empty()
                && x.dtype == crate::ir::DType::I32
                && let Some(v) = self.env.get(&crate::ir::scalar_param_key(i))
            {
                env.insert(crate::ir::scalar_load_key(n), *v);
            }
            // The operand as the mask reads it: the whole parameter, densely and row-major (an
            // axis of one element may have any stride), of the table's shape.
            let sizes: Option<Vec<i64>> = x.shape.iter().map(|d| size(d, self.env).ok()).collect();
            let dense = sizes.as_ref().is_some_and(|sizes| {
                let mut inner = 1i64;
                sizes.iter().zip(&x.strides).rev().all(|(n, stride)| {
                    let ok = *n == 1 || stride.eval(self.env).ok() == Some(inner);
                    inner = inner.saturating_mul(*n);
                    ok
                })
            });
            let shape: Option<Vec<usize>> = sizes.and_then(|sizes| sizes.iter().map(|n| usize::try_from(*n).ok()).collect());
            if dense
                && matches!(x.dtype, crate::ir::DType::I32 | crate::ir::DType::Bool)
                && x.offset.as_const() == Some(0)
                && let Some(t) = self.data.get(&i)
                && t.is_bool() == (x.dtype == crate::ir::DType::Bool)
                && let Some(shape) = shape
            {
                if shape == t.shape() {
                    data.insert(n, t.clone());
                } else if let Some(table) = t.reshaped(&shape) {
                    data.insert(n, Arc::new(table));
                }
            }
        }
        (env, data)
    }

    fn set(&mut self, step: usize, values: &[(Tuning, i64)]) {
        for (t, v) in values {
            self.tuning.insert((step, *t), *v);
        }
    }

    /// Sets step `s`'s tuning values; returns its work items.
    fn step(&mut self, s: usize, kernel: &Kernel) -> Result<i64, PrepareError> {
        let env = self.env;
        let rows = |shape: &[Dim]| product(&shape[..shape.len().saturating_sub(1)], env);
        Ok(match (kernel, self.policy) {
            (Kernel::Elementwise { out, .. }, Policy::Cpu(_)) => rows(&out.shape)?,
            (Kernel::Elementwise { out, .. }, Policy::Cuda(_)) => ceil_div(product(&out.shape, env)?, CUDA_ELEMENTS),
            (Kernel::MatMul { c, .. }, policy) => {
                let r = c.shape.len();
                let (m, n, batch) = (size(&c.shape[r - 2], env)?, size(&c.shape[r - 1], env)?, product(&c.shape[..r - 2], env)?);
                match policy {
                    Policy::Cpu(cpu) => {
                        let mb = cpu.matmul_rows(m);
                        self.set(s, &[(Tuning::MatMulRows, mb)]);
                        batch.saturating_mul(ceil_div(m, mb))
                    }
                    Policy::Cuda(_) => batch.saturating_mul(ceil_div(m, CUDA_MATMUL_TILE)).saturating_mul(ceil_div(n, CUDA_MATMUL_TILE)),
                }
            }
            // On the CPU, a row of outputs along a kept last axis per item (vectors along it).
            (Kernel::ReduceOf { x, axes, out, .. }, Policy::Cpu(_)) if !axes.contains(&x.shape.len().saturating_sub(1)) => {
                rows(&out.shape)?
            }
            (Kernel::Reduce { out, .. } | Kernel::ReduceOf { out, .. }, _) => product(&out.shape, env)?,
            (
                Kernel::Softmax { x, axis, .. }
                | Kernel::Scan { x, axis, .. }
                | Kernel::ArgSort { x, axis, .. }
                | Kernel::ScatterAdd { out: x, axis, .. },
                _,
            ) => {
                let others: Vec<Dim> = x.shape.iter().enumerate().filter(|(k, _)| k != axis).map(|(_, d)| d.clone()).collect();
                product(&others, env)?
            }
            (Kernel::Norm { out, .. } | Kernel::Dropout { out, .. }, _) => rows(&out.shape)?,
            // One batch index per item.
            (Kernel::PrefixAttention { out, .. }, _) => product(&out.shape[..out.shape.len().saturating_sub(2)], env)?,
            (Kernel::Flash(f), _) => self.flash(s, f)?,
            (Kernel::FlashMerge(f), _) => {
                // One item per (batch index, query block) of the flash step.
                let get = |t| self.tuning.get(&(f.step, t)).copied().unwrap_or(0);
                let (splits, blocks) = (get(Tuning::Splits), get(Tuning::QueryBlocks));
                if splits > 1 { product(f.batch(), env)?.saturating_mul(blocks) } else { 0 }
            }
            (Kernel::FlashBwd(f), _) => self.flash_bwd(s, f)?,
            // One item per element of the extra operands' gradients.
            (Kernel::FlashBwdReduce(f), _) => {
                f.dx.iter().try_fold(0i64, |acc, (_, x)| Ok::<i64, PrepareError>(acc.saturating_add(product(&x.shape, env)?)))?
            }
        })
    }

    /// Blocks, tile table, per-item partial sums and scratch of flash backward step `s`; its work
    /// items: on the CPU one per batch index; on CUDA one per key chunk of each batch index (their
    /// partial sums), then, when `dQ` is asked for, one per query tile of each.
    fn flash_bwd(&mut self, s: usize, f: &FlashBwdKernel) -> Result<i64, PrepareError> {
        let env = self.env;
        let (m, n, d, dv) = f.sizes();
        let (m, n, d, dv) = (size(&m, env)?, size(&n, env)?, size(&d, env)?, size(&dv, env)?);
        let batch_sizes: Vec<i64> = f.batch().iter().map(|x| size(x, env)).collect::<Result<_, _>>()?;
        let batch = product(f.batch(), env)?;
        let (bm, bn) = match self.policy {
            Policy::Cpu(cpu) => cpu.flash_bwd_blocks(m, n),
            Policy::Cuda(_) => {
                let head = cuda_pad_head(d.max(dv)).ok_or(PrepareError::HeadDim { step: s, width: d.max(dv) })?;
                self.prepared.defines.push((format!("ATTNC_HD_{s}"), head));
                if f.variant == Variant::TensorCore { (CUDA_MMA_BWD_BLOCK, CUDA_MMA_BWD_BLOCK) } else { (CUDA_BWD_ROWS, CUDA_BWD_KEYS) }
            }
        };
        let (nqb, nkb) = (ceil_div(m, bm), ceil_div(n, bn));
        let entry = tile_table::entry_bytes(bm as usize) as i64;
        self.set(
            s,
            &[
                (Tuning::BlockM, bm),
                (Tuning::BlockN, bn),
                (Tuning::QueryBlocks, nqb),
                (Tuning::KeyBlocks, nkb),
                (Tuning::TileEntryBytes, entry),
            ],
        );
        let (run_env, data) = self.run_values(&f.extras);
        let known = Known { env: &run_env, data: &data };
        let (table, div) = tile_tables(f.spec.mask.as_ref(), &batch_sizes, (m, n), (bm, bn), false, &known, true);
        self.set(s, &[(Tuning::TileBatchDiv, div)]);
        count(table.len() as i64, "a flash tile table")?;
        self.prepared.elems[f.tiles] = table.len();
        self.prepared.tables.push((f.tiles, table));
        let per_item = f.dx.iter().try_fold(0i64, |acc, (_, x)| {
            acc.checked_add(product(&x.shape, env)?).ok_or_else(|| PrepareError::Overflow("the extra operands' gradients".into()))
        })?;
        let overflow = || PrepareError::Overflow("flash backward work items".into());
        // (Items, floats per partial sum): CUDA keeps each sum as a double in two floats.
        let (items, summed) = match self.policy {
            Policy::Cpu(_) => (batch, batch),
            Policy::Cuda(_) => {
                let keys = batch.checked_mul(nkb).ok_or_else(overflow)?;
                let queries = if f.dq.is_some() { batch.checked_mul(nqb).ok_or_else(overflow)? } else { 0 };
                (keys.checked_add(queries).ok_or_else(overflow)?, keys.checked_mul(2).ok_or_else(overflow)?)
            }
        };
        let partials = summed.checked_mul(per_item).ok_or_else(|| PrepareError::Overflow("flash backward partial sums".into()))?;
        self.prepared.elems[f.partials] = count(partials, "flash backward partial sums")?;
        if let Policy::Cpu(_) = self.policy {
            let layout = flash_bwd_scratch(bn as usize, m as usize, d as usize, dv as usize);
            count((layout.total / 4) as i64, "a flash backward's scratch")?;
            self.set(
                s,
                &[
                    (Tuning::ScratchGradS, layout.ds as i64),
                    (Tuning::ScratchGradQ, layout.dq as i64),
                    (Tuning::ScratchGradK, layout.dk as i64),
                    (Tuning::ScratchGradV, layout.dv as i64),
                    (Tuning::ScratchKeysT, layout.kt as i64),
                    (Tuning::ScratchGradRow, layout.row as i64),
                    (Tuning::RowStride, layout.stride as i64),
                ],
            );
            self.prepared.scratch_bytes = self.prepared.scratch_bytes.max(layout.total);
        }
        Ok(items)
    }

    /// Block sizes, tile table, partial states and scratch of flash step `s`; its work items.
    fn flash(&mut self, s: usize, f: &FlashKernel) -> Result<i64, PrepareError> {
        let env = self.env;
        let (m, n, d, dv) = f.sizes();
        let (m, n, d, dv) = (size(&m, env)?, size(&n, env)?, size(&d, env)?, size(&dv, env)?);
        let batch_sizes: Vec<i64> = f.batch().iter().map(|x| size(x, env)).collect::<Result<_, _>>()?;
        let batch = product(f.batch(), env)?;
        // The CPU's additive score kernel packs a key tile's `4 · width · 256` floats per thread.
        if f.spec.pair != crate::ir::Pair::Dot && d > MAX_ADDITIVE_WIDTH {
            return Err(PrepareError::AdditiveWidth { step: s, width: d, limit: MAX_ADDITIVE_WIDTH });
        }
        // Loads read clamped indices the optimizer proved in range, for non-empty tables: an
        // empty one has none (the kernels would read outside it).
        if batch > 0 && m > 0 && n > 0 {
            for (operand, x) in f.extras.iter().enumerate() {
                if product(&x.shape, env)? == 0 {
                    return Err(PrepareError::EmptyOperand { step: s, operand });
                }
            }
        }
        let blocks = match self.policy {
            Policy::Cpu(cpu) => cpu_blocks(cpu, m, n, batch, f.spec.mask.is_some()),
            Policy::Cuda(cuda) => self.cuda_blocks(cuda, s, f, (m, n, d, dv), batch)?,
        };
        let FlashBlocks { bm, bn, splits, kps, nqb, nkb, batch } = blocks;
        let entry = tile_table::entry_bytes(bm as usize) as i64;
        self.set(
            s,
            &[
                (Tuning::BlockM, bm),
                (Tuning::BlockN, bn),
                (Tuning::Splits, splits),
                (Tuning::KeysPerSplit, kps),
                (Tuning::QueryBlocks, nqb),
                (Tuning::KeyBlocks, nkb),
                (Tuning::TileEntryBytes, entry),
            ],
        );
        let cpu = matches!(self.policy, Policy::Cpu(_));
        let (run_env, data) = self.run_values(&f.extras);
        let known = Known { env: &run_env, data: &data };
        // (A paged step's head groups walk several batch indices per item: one table.)
        let (table, div) = tile_tables(f.spec.mask.as_ref(), &batch_sizes, (m, n), (bm, bn), cpu, &known, !f.paged());
        self.set(s, &[(Tuning::TileBatchDiv, div)]);
        count(table.len() as i64, "a flash tile table")?;
        self.prepared.elems[f.tiles] = table.len();
        self.prepared.tables.push((f.tiles, table));
        let partial_floats = if splits > 1 { batch * nqb * splits * bm * (dv + 2) } else { 0 };
        self.prepared.elems[f.partials] = count(partial_floats, "flash partial states")?;
        let mut items = batch.saturating_mul(nqb).saturating_mul(splits);
        if let Policy::Cpu(cpu) = self.policy {
            // A paged K or V is gathered one key tile at a time for blocks of more than a few
            // rows (the products then run on dense tiles).
            let kv_floats = if f.paged() { (bn * (d + dv)) as usize } else { 0 };
            let group = match (f.paged(), batch_sizes.last()) {
                (true, Some(&last)) if groupable(f) => cpu.flash_head_group(bm, nqb, items, last),
                _ => 1,
            };
            if f.paged() {
                self.set(s, &[(Tuning::HeadGroup, group)]);
            }
            if let (true, Some(&last)) = (group > 1, batch_sizes.last()) {
                items = splits.saturating_mul(batch / last.max(1)).saturating_mul(ceil_div(last, group));
            }
            let layout = flash_scratch((bm * group) as usize, bn as usize, dv as usize, kv_floats);
            let offset = |x: usize| x as i64;
            self.set(
                s,
                &[
                    (Tuning::ScratchAcc, offset(layout.acc)),
                    (Tuning::ScratchMax, offset(layout.max)),
                    (Tuning::ScratchSum, offset(layout.sum)),
                    (Tuning::ScratchBias, offset(layout.bias)),
                    (Tuning::ScratchKv, offset(layout.kv)),
                ],
            );
            self.prepared.scratch_bytes = self.prepared.scratch_bytes.max(layout.total);
        }
        Ok(items)
    }

    /// The CUDA kernels' blocks, and their compile-time values (`ATTNC_HD_{step}`, the padded
    /// head width; `ATTNC_BN_{step}`, the tensor-core key tile; `ATTNC_MT_{step}`, its m-tiles
    /// per warp; `ATTNC_KS_{step}`, its K/V stages; `ATTNC_WS_{step}`, 1 when its block is
    /// warp-specialised).
    fn cuda_blocks(
        &mut self,
        cuda: &CudaPolicy,
        s: usize,
        f: &FlashKernel,
        (m, n, d, dv): (i64, i64, i64, i64),
        batch: i64,
    ) -> Result<FlashBlocks, PrepareError> {
        let width = d.max(dv);
        let head = cuda_pad_head(width).ok_or(PrepareError::HeadDim { step: s, width })?;
        self.prepared.defines.push((format!("ATTNC_HD_{s}"), head));
        let (bm, bn, splits) = match f.variant {
            Variant::TensorCore => {
                let bn = cuda_mma_keys(head);
                let tiles = cuda.mma_row_tiles(head);
                self.prepared.defines.push((format!("ATTNC_BN_{s}"), bn));
                self.prepared.defines.push((format!("ATTNC_MT_{s}"), tiles));
                let ws = cuda.mma_warp_specialized(head, bn, tiles);
                let stages = if ws { cuda.mma_ring_stages(head, bn, tiles) } else { cuda.mma_kv_stages(head, bn, tiles) };
                self.prepared.defines.push((format!("ATTNC_KS_{s}"), stages));
                self.prepared.defines.push((format!("ATTNC_WS_{s}"), i64::from(ws)));
                // TMA loads for the warp-specialised block, where both K and V allow them.
                let maps = (ws && cuda.tma && !f.paged())
                    .then(|| Some([tma_map(&f.k, f.batch(), bn, self.env)?, tma_map(&f.v, f.batch(), bn, self.env)?]))
                    .flatten();
                let first = maps.map_or(0, |pair| {
                    let at = self.prepared.tma.len() as i64 + 1;
                    self.prepared.tma.extend(pair);
                    at
                });
                self.prepared.defines.push((format!("ATTNC_TMA_{s}"), first));
                (CUDA_MMA_ROWS * tiles, bn, 1)
            }
            Variant::SplitKv => (m.max(1), CUDA_LANE_KEYS, cuda.decode_splits(batch, n)),
            _ => (CUDA_SIMT_ROWS, CUDA_LANE_KEYS, 1),
        };
        Ok(blocks(bm, bn, splits, m, n, batch))
    }
}

/// Whether a paged flash step's work items can walk the heads of its last batch axis together:
/// dot-product scores (additive ones gather their tiles), and K and V paged by another axis (the
/// heads of one table row, at a fixed stride from each other inside every page).
fn groupable(f: &FlashKernel) -> bool {
    let rank = f.batch().len();
    let by_last = |view: &View, paging: &Option<Paging>| {
        paging.as_ref().is_some_and(|p| rank.saturating_sub(view.shape.len().saturating_sub(2)) + p.axis + 1 == rank)
    };
    f.spec.pair == crate::ir::Pair::Dot && rank > 0 && !by_last(&f.k, &f.k_paging) && !by_last(&f.v, &f.v_paging)
}

/// The CPU's blocks for `m` query rows over `n` keys.
fn cpu_blocks(cpu: &CpuPolicy, m: i64, n: i64, batch: i64, masked: bool) -> FlashBlocks {
    let (bm, bn) = cpu.flash_blocks(m, batch, masked);
    blocks(bm, bn, cpu.flash_splits(m, n), m, n, batch)
}

/// Blocks of `bm × bn` with `splits` key splits (each a whole number of key tiles).
fn blocks(bm: i64, bn: i64, splits: i64, m: i64, n: i64, batch: i64) -> FlashBlocks {
    let kps = (ceil_div(ceil_div(n, splits), bn) * bn).max(bn);
    FlashBlocks { bm, bn, splits, kps, nqb: ceil_div(m, bm), nkb: ceil_div(n, bn), batch }
}

/// Places every temporary in one arena: first fit by offset among the buffers whose lifetimes
/// overlap, 64-byte aligned, 4 bytes per element. Returns byte offsets and the arena's size.
fn place(schedule: &Schedule, elems: &[usize]) -> (Vec<Option<usize>>, usize) {
    let life = schedule.lifetimes();
    let mut order: Vec<usize> = (0..schedule.buffers.len()).filter(|b| life[*b].is_some()).collect();
    order.sort_by_key(|b| (life[*b].map(|l| l.0), std::cmp::Reverse(elems[*b])));
    let mut placed: Vec<(usize, usize, (usize, usize))> = Vec::new();
    let mut out = vec![None; schedule.buffers.len()];
    for b in order {
        let Some((first, last)) = life[b] else { continue };
        let size = (elems[b] * 4).div_ceil(64) * 64;
        let mut busy: Vec<(usize, usize)> =
            placed.iter().filter(|(_, _, (f, l))| *f <= last && first <= *l).map(|(o, s, _)| (*o, *s)).collect();
        busy.sort();
        let mut at = 0usize;
        for (o, s) in busy {
            if at + size <= o {
                break;
            }
            at = at.max(o + s);
        }
        placed.push((at, size, (first, last)));
        out[b] = Some(at);
    }
    let bytes = out.iter().zip(elems).filter_map(|(o, n)| o.map(|o| o + n * 4)).max().unwrap_or(0);
    (out, bytes)
}
