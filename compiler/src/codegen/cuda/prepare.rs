//! From a [`CudaProgram`] and one set of dim values to everything a launch needs: compile-time
//! head widths, kernel scalars, buffer sizes, grids, shared memory and the tile tables. Pure
//! host arithmetic, shared by the CUDA runtime and the tests.

use super::{BufferSize, CudaProgram, Grid, Smem, TileSize, pad_head_dim, storage_bytes};
use crate::ir::{Dim, TileClass, classify_tile};
use std::collections::HashMap;
use thiserror::Error;

/// What the device allows (from its attributes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Streaming multiprocessors (sizes the split-KV count).
    pub sm_count: u32,
    /// Largest dynamic shared memory one block may opt into, in bytes.
    pub max_smem_per_block: u32,
}

impl Default for DeviceLimits {
    /// An A100-like device (108 SMs, 163 KiB of shared memory per block).
    fn default() -> Self {
        DeviceLimits { sm_count: 108, max_smem_per_block: 166_912 }
    }
}

/// One launch, concrete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadyLaunch {
    /// Kernel name.
    pub kernel: String,
    /// Grid, in blocks.
    pub grid: [u32; 3],
    /// Block, in threads.
    pub block: [u32; 3],
    /// Dynamic shared memory in bytes.
    pub smem_bytes: u32,
}

/// A program made concrete for one set of dims.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prepared {
    /// `-D` macro values (head widths): part of the compile, and of its cache key.
    pub defines: Vec<(String, i64)>,
    /// Dim values in [`CudaProgram::dims`] order (kernel parameters).
    pub dims: Vec<i64>,
    /// Run-time scalars `s0`, `s1`, ... (split-KV counts).
    pub scalars: Vec<i64>,
    /// Bytes of every buffer (at least 1, so that every buffer has an address).
    pub buffer_bytes: Vec<usize>,
    /// Launches with work to do, in order (empty tensors launch nothing).
    pub launches: Vec<ReadyLaunch>,
    /// Tile tables to upload: (buffer, one class byte per tile).
    pub tables: Vec<(usize, Vec<u8>)>,
}

/// Why a program cannot run with these dims on this device.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PrepareError {
    /// A dim the program uses has no value.
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
    /// A flash op whose head is wider than the kernels support.
    #[error("flash {node}: head width {width} is above the 256 the CUDA kernels support")]
    HeadDim {
        /// The flash node (`%7`).
        node: String,
        /// The width.
        width: i64,
    },
    /// A kernel needs more shared memory than the device allows per block.
    #[error("kernel `{kernel}` needs {needed} bytes of shared memory; the device allows {available}")]
    SharedMemory {
        /// The kernel.
        kernel: String,
        /// Bytes needed.
        needed: u32,
        /// Bytes allowed.
        available: u32,
    },
    /// A grid or buffer beyond what the hardware or the host can address.
    #[error("{0} is too large for the device")]
    TooLarge(String),
}

const MAX_GRID_YZ: i64 = 65_535;
const MAX_GRID_X: i64 = i32::MAX as i64;

impl CudaProgram {
    /// The head-width macros for these dims (what the source must be compiled with).
    pub fn defines(&self, env: &HashMap<String, i64>) -> Result<Vec<(String, i64)>, PrepareError> {
        self.head_dims
            .iter()
            .map(|h| {
                let width = eval(&h.qk, env)?.max(eval(&h.v, env)?);
                let padded = pad_head_dim(width).ok_or_else(|| PrepareError::HeadDim { node: h.node.clone(), width })?;
                Ok((h.macro_name.clone(), padded))
            })
            .collect()
    }

    /// Everything one run with dims `env` needs.
    pub fn prepare(&self, env: &HashMap<String, i64>, limits: &DeviceLimits) -> Result<Prepared, PrepareError> {
        let defines = self.defines(env)?;
        let hd = |n: usize| defines.get(n).map_or(128, |(_, v)| *v);
        let tile = |t: TileSize| -> i64 {
            match t {
                TileSize::Fixed(v) => i64::from(v.max(1)),
                TileSize::ByHeadDim { head_dim, narrow, wide } => i64::from(if hd(head_dim) <= 128 { narrow } else { wide }.max(1)),
            }
        };
        let dims = self
            .dims
            .iter()
            .map(|d| env.get(d).copied().ok_or_else(|| PrepareError::UnboundDim(d.clone())))
            .collect::<Result<Vec<_>, _>>()?;

        // Split counts: enough warps to cover the device about 8 times over.
        let mut scalars = Vec::new();
        for s in &self.splits {
            let batch = eval(&s.batch, env)?.max(1);
            let chunks = (eval(&s.keys, env)? + 31) / 32;
            let target = i64::from(limits.sm_count.max(1)) * 32;
            scalars.push(((target + batch - 1) / batch).clamp(1, chunks.max(1)));
        }

        let mut buffer_bytes = Vec::new();
        for b in &self.buffers {
            let elements = match &b.size {
                BufferSize::Elements(d) => eval(d, env)?,
                BufferSize::Table(t) => {
                    let t = &self.tables[*t];
                    ceil_div(eval(&t.rows, env)?, tile(t.tile_rows)) * ceil_div(eval(&t.cols, env)?, tile(t.tile_cols))
                }
                BufferSize::Partials(s) => {
                    let sp = &self.splits[*s];
                    let per = eval(&sp.batch, env)?.saturating_mul(eval(&sp.rows, env)?).saturating_mul(scalars[*s]);
                    per.saturating_mul(eval(&sp.width, env)?.saturating_add(2))
                }
            };
            let bytes = usize::try_from(elements)
                .ok()
                .and_then(|e| e.checked_mul(storage_bytes(b.dtype)))
                .ok_or_else(|| PrepareError::TooLarge(format!("buffer `{}`", b.what)))?;
            buffer_bytes.push(bytes.max(1));
        }

        let mut tables = Vec::new();
        for (n, t) in self.tables.iter().enumerate() {
            let Some(buf) = self.buffers.iter().position(|b| b.size == BufferSize::Table(n)) else { continue };
            let (rows, cols) = (eval(&t.rows, env)?, eval(&t.cols, env)?);
            let (tr, tc) = (tile(t.tile_rows), tile(t.tile_cols));
            let batch = t.batch.iter().map(|d| eval(d, env)).collect::<Result<Vec<_>, _>>()?;
            let mut bytes = Vec::new();
            for r in 0..ceil_div(rows, tr) {
                for c in 0..ceil_div(cols, tc) {
                    let class =
                        classify_tile(Some(&t.mask), &batch, (r * tr, ((r + 1) * tr).min(rows)), (c * tc, ((c + 1) * tc).min(cols)), env);
                    bytes.push(match class {
                        TileClass::Skip => 0,
                        TileClass::Full => 1,
                        TileClass::Partial => 2,
                    });
                }
            }
            tables.push((buf, bytes));
        }

        let mut launches = Vec::new();
        for l in &self.launches {
            let too_large = || PrepareError::TooLarge(format!("the grid of `{}`", l.kernel));
            let grid: Option<[i64; 3]> = match &l.grid {
                Grid::Elements(total) => {
                    let total = eval(total, env)?;
                    (total > 0).then(|| [ceil_div(total, i64::from(l.block)).min(MAX_GRID_YZ), 1, 1])
                }
                Grid::Rows(rows) => {
                    let rows = eval(rows, env)?;
                    (rows > 0).then(|| [ceil_div(rows, 8).min(MAX_GRID_YZ), 1, 1])
                }
                Grid::MatMul { batch, m, n, tile } => {
                    let (batch, m, n) = (eval(batch, env)?, eval(m, env)?, eval(n, env)?);
                    let t = i64::from(*tile);
                    (batch > 0 && m > 0 && n > 0).then(|| [ceil_div(n, t), ceil_div(m, t).min(MAX_GRID_YZ), batch.min(MAX_GRID_YZ)])
                }
                Grid::Flash { batch, m, tile_rows } => {
                    let (batch, m) = (eval(batch, env)?, eval(m, env)?);
                    (batch > 0 && m > 0).then(|| [ceil_div(m, tile(*tile_rows)), batch.min(MAX_GRID_YZ), 1])
                }
                Grid::Decode { batch, split } => {
                    let batch = eval(batch, env)?;
                    (batch > 0).then(|| [ceil_div(scalars[*split], 4), batch.min(MAX_GRID_YZ), 1])
                }
            };
            let Some(grid) = grid else { continue };
            if grid[0] > MAX_GRID_X {
                return Err(too_large());
            }
            let smem: i64 = match l.smem {
                Smem::None => 0,
                Smem::FlashSimt(h) => {
                    let w = hd(h);
                    (16 * w + 32 * (w + 1) + 32 * w) * 4
                }
                Smem::FlashMma(h) => {
                    let w = hd(h);
                    let bn = if w <= 128 { 64 } else { 32 };
                    (64 + 2 * bn) * (w + 8) * 2
                }
            };
            let smem = u32::try_from(smem).map_err(|_| too_large())?;
            if smem > limits.max_smem_per_block {
                return Err(PrepareError::SharedMemory { kernel: l.kernel.clone(), needed: smem, available: limits.max_smem_per_block });
            }
            launches.push(ReadyLaunch { kernel: l.kernel.clone(), grid: grid.map(|g| g as u32), block: [l.block, 1, 1], smem_bytes: smem });
        }
        Ok(Prepared { defines, dims, scalars, buffer_bytes, launches, tables })
    }
}

fn eval(d: &Dim, env: &HashMap<String, i64>) -> Result<i64, PrepareError> {
    let v = d.eval(env).map_err(PrepareError::UnboundDim)?;
    if v < 0 {
        return Err(PrepareError::Negative { dim: d.to_string(), value: v });
    }
    Ok(v)
}

fn ceil_div(a: i64, b: i64) -> i64 {
    if a <= 0 { 0 } else { (a + b - 1) / b }
}
