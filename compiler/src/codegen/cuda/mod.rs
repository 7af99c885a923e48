//! CUDA C++ source emission: a verified graph in, one self-contained CUDA translation unit and
//! the plan that runs it out ([`CudaProgram`]). Pure: no IO, no device, no NVRTC.
//!
//! How a graph becomes kernels:
//! - Values are either *materialised* (a device buffer: parameters, outputs, and the results
//!   of matmul, reductions, softmax, layer/RMS norm and flash) or *inlined*: element-wise ops
//!   and the movement ops (transpose, reshape, slice, concat, gather, iota, casts) are computed
//!   in place by whichever kernel reads them ([`expr`]), so element-wise chains fuse into their
//!   consumer. A tiled kernel (matmul, flash K/V) reads its operands as strided views
//!   ([`view`]); an operand that is not a view is materialised first.
//! - One kernel per materialised value, launched in topological order on one stream. Every
//!   kernel has the same parameter list: all buffers, then every symbolic dim (so sizes are
//!   run-time values and nothing is recompiled when a sequence length changes), then run-time
//!   scalars (split-KV counts).
//! - Flash attention ([`flash`]): tensor cores (`mma.sync` m16n8k16, f32 accumulation) when q, k
//!   and v are all f16 or all bf16; a SIMT f32 kernel otherwise; a split-KV decode kernel plus a
//!   merge kernel when the query length is a constant of at most 16. The head width is a
//!   compile-time macro (`ATTNC_HD_n`, padded to a multiple of 32, at most 256) the runtime
//!   defines from the run's dims. The score modification and mask are inlined C expressions;
//!   fully masked tiles are skipped from a per-launch tile table the host fills with
//!   [`crate::ir::classify_tile`].
//!
//! [`CudaProgram::prepare`] turns the plan into concrete buffer sizes, launch configurations and
//! tile tables for one set of dims.

mod cexpr;
mod expr;
mod flash;
mod matmul;
mod pointwise;
mod prelude;
mod prepare;
mod rows;
mod score;
mod view;

#[cfg(test)]
mod tests;

use crate::ir::{DType, Dim, Graph, Module, Op, ScoreExpr, Value, verify};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use thiserror::Error;

pub use cexpr::storage_bytes;
pub use prelude::{PRELUDE_BEGIN, PRELUDE_END};
pub use prepare::{DeviceLimits, PrepareError, Prepared, ReadyLaunch};

/// Why a graph could not be turned into CUDA source.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum CudaEmitError {
    /// The graph fails the IR verifier (or has a cycle).
    #[error("graph `{graph}` is not valid IR: {reason}")]
    Invalid {
        /// The graph.
        graph: String,
        /// The first problem found.
        reason: String,
    },
    /// A construct this backend does not handle.
    #[error("graph `{graph}`: {reason}")]
    Unsupported {
        /// The graph.
        graph: String,
        /// What and why.
        reason: String,
    },
}

/// One graph compiled to CUDA: the source and everything needed to run it.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaProgram {
    /// The graph's (entry point's) name.
    pub graph: String,
    /// The CUDA C++ translation unit (no includes; compile with NVRTC for sm_80 or newer).
    pub source: String,
    /// Dim names, in kernel-parameter order (`d_NAME` in the source).
    pub dims: Vec<String>,
    /// Device buffers, in kernel-parameter order (`b0`, `b1`, ...).
    pub buffers: Vec<Buffer>,
    /// The buffer each parameter is copied into, in parameter order.
    pub inputs: Vec<usize>,
    /// Each output's name and the buffer it is read back from, in output order.
    pub outputs: Vec<(String, usize)>,
    /// Kernel launches, in order.
    pub launches: Vec<Launch>,
    /// Compile-time head widths (`-D` macros), one per flash op.
    pub head_dims: Vec<HeadDim>,
    /// Tile tables the host fills per launch shape.
    pub tables: Vec<TileTable>,
    /// Split-KV decodes; scalar parameter `s{n}` is the split count of decode `n`.
    pub splits: Vec<SplitKv>,
}

/// A device buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct Buffer {
    /// Element type (tables are [`DType::Bool`]-sized bytes, partials f32).
    pub dtype: DType,
    /// How many elements.
    pub size: BufferSize,
    /// What it holds, for messages (`param q`, `%7 matmul`, ...).
    pub what: String,
}

/// The element count of a buffer.
#[derive(Clone, Debug, PartialEq)]
pub enum BufferSize {
    /// A symbolic element count.
    Elements(Dim),
    /// The bytes of tile table `n` (one per tile).
    Table(usize),
    /// Partial results of split-KV decode `n`: `batch * rows * splits * (width + 2)` floats.
    Partials(usize),
}

/// A flash op's compile-time head width: `macro_name` is defined to the larger of its q/k and
/// v widths, rounded up to a multiple of 32 (the kernels zero-pad), at most 256.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadDim {
    /// The macro (`ATTNC_HD_0`).
    pub macro_name: String,
    /// The q/k width.
    pub qk: Dim,
    /// The v width.
    pub v: Dim,
    /// The flash node, for messages (`%7`).
    pub node: String,
}

/// Tile rows or columns: fixed, or chosen by the padded head width (wide heads use smaller
/// key tiles to stay within registers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileSize {
    /// Always this many.
    Fixed(u32),
    /// `narrow` when head dim `head_dim` pads to at most 128, else `wide`.
    ByHeadDim {
        /// Index into [`CudaProgram::head_dims`].
        head_dim: usize,
        /// Size for head widths up to 128.
        narrow: u32,
        /// Size above 128.
        wide: u32,
    },
}

/// A table of [`crate::ir::TileClass`] bytes (0 skip, 1 full, 2 partial), row-major over
/// (query tile, key tile), for one flash op's mask.
#[derive(Clone, Debug, PartialEq)]
pub struct TileTable {
    /// The mask predicate.
    pub mask: ScoreExpr,
    /// Sizes of the score's batch axes.
    pub batch: Vec<Dim>,
    /// Query rows.
    pub rows: Dim,
    /// Keys.
    pub cols: Dim,
    /// Query rows per tile.
    pub tile_rows: TileSize,
    /// Keys per tile.
    pub tile_cols: TileSize,
}

/// A split-KV decode: the run-time split count is chosen from these sizes and the device.
#[derive(Clone, Debug, PartialEq)]
pub struct SplitKv {
    /// Product of the batch axes.
    pub batch: Dim,
    /// Query rows (a constant).
    pub rows: Dim,
    /// Keys.
    pub keys: Dim,
    /// Value width.
    pub width: Dim,
}

/// One kernel launch.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// The `extern "C"` kernel name.
    pub kernel: String,
    /// How the grid follows from the dims.
    pub grid: Grid,
    /// Threads per block.
    pub block: u32,
    /// Dynamic shared memory.
    pub smem: Smem,
}

/// Grid shapes.
#[derive(Clone, Debug, PartialEq)]
pub enum Grid {
    /// One thread per element (grid-stride loop; capped grid).
    Elements(Dim),
    /// One warp per row, 8 rows per block.
    Rows(Dim),
    /// Matmul output tiles: x over columns, y over rows, z over the batch.
    MatMul {
        /// Batch size.
        batch: Dim,
        /// Rows.
        m: Dim,
        /// Columns.
        n: Dim,
        /// Tile edge (rows and columns).
        tile: u32,
    },
    /// Flash query tiles: x over tiles, y over the batch.
    Flash {
        /// Batch size.
        batch: Dim,
        /// Query rows.
        m: Dim,
        /// Rows per tile.
        tile_rows: TileSize,
    },
    /// Split-KV decode: x over groups of four splits (one warp each), y over the batch.
    Decode {
        /// Batch size.
        batch: Dim,
        /// Index into [`CudaProgram::splits`].
        split: usize,
    },
}

/// Dynamic shared memory of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Smem {
    /// None (static arrays only).
    None,
    /// SIMT flash tiles for head dim `n`: `(16*HD + 32*(HD+1) + 32*HD)` floats.
    FlashSimt(usize),
    /// Tensor-core flash tiles for head dim `n`: `(64 + BN)*(HD+8) + BN*(HD+8)` halves.
    FlashMma(usize),
}

/// CUDA source for every function of a module (what `attnc build --emit cuda` prints).
pub fn emit_module(module: &Module) -> Result<String, CudaEmitError> {
    let mut out = String::new();
    for (n, g) in module.graphs.iter().enumerate() {
        if n > 0 {
            out.push('\n');
        }
        let p = emit_graph(g)?;
        let _ = writeln!(out, "// ===== graph {} =====", p.graph);
        out.push_str(&p.source);
    }
    Ok(out)
}

/// Emits one graph.
pub fn emit_graph(graph: &Graph) -> Result<CudaProgram, CudaEmitError> {
    let invalid = |reason: String| CudaEmitError::Invalid { graph: graph.name.clone(), reason };
    verify(graph).map_err(|errs| invalid(errs.first().map_or_else(|| "unknown".to_string(), |e| e.to_string())))?;
    let g = graph.compact();
    let order = g.topo_order().ok_or_else(|| invalid("the graph has a cycle".into()))?;
    let mut b = Builder::new(&g);
    b.plan(&order);
    b.emit_kernels(&order)?;
    Ok(b.finish())
}

/// Ops that always get a buffer and a kernel of their own.
fn is_heavy(op: &Op) -> bool {
    matches!(op, Op::MatMul | Op::Reduce { .. } | Op::Softmax { .. } | Op::LayerNorm { .. } | Op::RmsNorm { .. } | Op::Flash(_))
}

/// Emission state for one graph.
pub(super) struct Builder<'g> {
    pub g: &'g Graph,
    pub bufs: HashMap<Value, usize>,
    pub buffers: Vec<Buffer>,
    pub launches: Vec<Launch>,
    pub kernels: Vec<String>,
    pub head_dims: Vec<HeadDim>,
    pub tables: Vec<TileTable>,
    pub splits: Vec<SplitKv>,
    copies: Vec<(Value, usize)>,
}

impl<'g> Builder<'g> {
    fn new(g: &'g Graph) -> Builder<'g> {
        Builder {
            g,
            bufs: HashMap::new(),
            buffers: Vec::new(),
            launches: Vec::new(),
            kernels: Vec::new(),
            head_dims: Vec::new(),
            tables: Vec::new(),
            splits: Vec::new(),
            copies: Vec::new(),
        }
    }

    /// `%N` of a value (its index in the compacted graph, which is in print order).
    pub fn label(&self, v: Value) -> String {
        format!("%{}", v.index())
    }

    /// Adds a buffer and returns its index.
    pub fn add_buffer(&mut self, dtype: DType, size: BufferSize, what: String) -> usize {
        self.buffers.push(Buffer { dtype, size, what });
        self.buffers.len() - 1
    }

    /// A unique kernel name for value `v`'s op.
    pub fn kernel_name(&self, v: Value, what: &str) -> String {
        format!("attnc_k{}_{what}_v{}", self.launches.len(), v.index())
    }

    /// Decides which values get buffers: parameters, heavy ops, outputs, operands of tiled
    /// kernels that are not strided views, and large shared sub-expressions.
    fn plan(&mut self, order: &[Value]) {
        let g = self.g;
        for (i, p) in g.params().iter().enumerate() {
            let name = match &g.node(*p).op {
                Op::Param(n) => n.clone(),
                _ => format!("param {i}"),
            };
            let node = g.node(*p);
            let b = self.add_buffer(node.ty.dtype, BufferSize::Elements(Dim::product(&node.ty.shape)), format!("param {name}"));
            self.bufs.insert(*p, b);
        }
        let mut mat: HashSet<Value> = order.iter().copied().filter(|v| is_heavy(&g.node(*v).op)).collect();
        for (_, v) in g.outputs() {
            if !matches!(g.node(*v).op, Op::Param(_)) {
                mat.insert(*v);
            }
        }
        // Tiled operands must be strided views; materialise whatever breaks that, until stable.
        loop {
            let placeholder: HashMap<Value, usize> =
                mat.iter().map(|v| (*v, usize::MAX)).chain(g.params().iter().map(|p| (*p, usize::MAX))).collect();
            let mut changed = false;
            for v in order {
                let ops = g.operands(*v);
                let tiled: Vec<Value> = match &g.node(*v).op {
                    Op::MatMul => ops.clone(),
                    Op::Flash(_) => ops.iter().skip(1).copied().collect(),
                    _ => Vec::new(),
                };
                for w in tiled {
                    if let Err(x) = view::view_of(g, w, &placeholder) {
                        changed |= mat.insert(x);
                    }
                }
            }
            if !changed {
                break;
            }
        }
        // Bound the work of inlining: a value used more than once whose inline expression is
        // large gets a buffer instead of being recomputed by each user.
        let mut size: HashMap<Value, usize> = HashMap::new();
        for v in order {
            let inline = !mat.contains(v) && !g.params().contains(v);
            let s = if inline { 1 + g.operands(*v).iter().map(|w| size.get(w).copied().unwrap_or(0)).sum::<usize>() } else { 0 };
            if inline && s > 48 && g.users(*v).len() > 1 {
                mat.insert(*v);
                size.insert(*v, 0);
            } else {
                size.insert(*v, s);
            }
        }
        for v in order {
            if mat.contains(v) && !self.bufs.contains_key(v) {
                let node = g.node(*v);
                let what = format!("{} {}", self.label(*v), node.op.name());
                let b = self.add_buffer(node.ty.dtype, BufferSize::Elements(Dim::product(&node.ty.shape)), what);
                self.bufs.insert(*v, b);
            }
        }
        for (name, v) in g.outputs() {
            if matches!(g.node(*v).op, Op::Param(_)) && !self.copies.iter().any(|(p, _)| p == v) {
                let node = g.node(*v);
                let b = self.add_buffer(node.ty.dtype, BufferSize::Elements(Dim::product(&node.ty.shape)), format!("output {name}"));
                self.copies.push((*v, b));
            }
        }
    }

    fn emit_kernels(&mut self, order: &[Value]) -> Result<(), CudaEmitError> {
        for v in order {
            let Some(buf) = self.bufs.get(v).copied() else { continue };
            let op = self.g.node(*v).op.clone();
            match &op {
                Op::Param(_) => {}
                Op::MatMul => matmul::emit(self, *v, buf),
                Op::Reduce { .. } | Op::Softmax { .. } | Op::LayerNorm { .. } | Op::RmsNorm { .. } => rows::emit(self, *v, buf),
                Op::Flash(spec) => flash::emit(self, *v, buf, spec).map_err(|reason| CudaEmitError::Unsupported {
                    graph: self.g.name.clone(),
                    reason: format!("{}: {reason}", self.label(*v)),
                })?,
                _ => pointwise::emit(self, *v, buf, false),
            }
        }
        for (p, buf) in self.copies.clone() {
            pointwise::emit(self, p, buf, true);
        }
        Ok(())
    }

    fn finish(self) -> CudaProgram {
        let g = self.g;
        let dims = collect_dims(g);
        let mut src = String::new();
        let _ = writeln!(src, "// attnc: CUDA kernels of graph `{}` ({} launches)", g.name, self.launches.len());
        src.push_str(&prelude::preamble());
        let mut args: Vec<String> = (0..self.buffers.len()).map(|b| format!("void* const b{b}")).collect();
        args.extend(dims.iter().map(|d| format!("const i64 {}", cexpr::dim_var(d))));
        args.extend((0..self.splits.len()).map(|s| format!("const i64 s{s}")));
        let _ = writeln!(
            src,
            "// Buffers: {}",
            self.buffers.iter().enumerate().map(|(i, b)| format!("b{i} = {}", b.what)).collect::<Vec<_>>().join(", ")
        );
        let _ = writeln!(src, "#define ATTNC_ARGS {}", args.join(", "));
        for h in &self.head_dims {
            let default = match (h.qk.as_const(), h.v.as_const()) {
                (Some(a), Some(b)) => pad_head_dim(a.max(b)).unwrap_or(256),
                _ => 128,
            };
            let _ = writeln!(
                src,
                "#ifndef {}\n#define {} {default} // head width of flash {}, padded; set by the runtime\n#endif",
                h.macro_name, h.macro_name, h.node
            );
        }
        for k in &self.kernels {
            src.push('\n');
            src.push_str(k);
        }
        let inputs = g.params().iter().filter_map(|p| self.bufs.get(p).copied()).collect();
        let outputs = g
            .outputs()
            .iter()
            .map(|(name, v)| {
                let buf = self.copies.iter().find(|(p, _)| p == v).map(|(_, b)| *b).or_else(|| self.bufs.get(v).copied()).unwrap_or(0);
                (name.clone(), buf)
            })
            .collect();
        CudaProgram {
            graph: g.name.clone(),
            source: src,
            dims,
            buffers: self.buffers,
            inputs,
            outputs,
            launches: self.launches,
            head_dims: self.head_dims,
            tables: self.tables,
            splits: self.splits,
        }
    }
}

/// A head width rounded up to a multiple of 32, or `None` above 256.
pub fn pad_head_dim(width: i64) -> Option<i64> {
    let padded = (width.max(1) + 31) / 32 * 32;
    (padded <= 256).then_some(padded)
}

/// Every dim name the graph mentions (shapes, attributes, flash expressions), sorted.
fn collect_dims(g: &Graph) -> Vec<String> {
    let mut names = BTreeSet::new();
    for v in g.values() {
        let node = g.node(v);
        names.extend(node.ty.shape.iter().flat_map(|d| d.symbols()));
        match &node.op {
            Op::DimValue(d) => names.extend(d.symbols()),
            Op::Slice { start, end, .. } => {
                names.extend(start.symbols());
                names.extend(end.symbols());
            }
            Op::Flash(spec) => {
                let mut visit = |e: &ScoreExpr| {
                    if let ScoreExpr::Dim(d) = e {
                        names.extend(d.symbols());
                    }
                };
                spec.score.visit(&mut visit);
                if let Some(m) = &spec.mask {
                    m.visit(&mut visit);
                }
            }
            _ => {}
        }
    }
    names.into_iter().collect()
}
