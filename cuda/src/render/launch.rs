//! Launch configurations of a rendered program for one prepared run: grids from the prepared
//! work items, blocks and shared memory from each kernel's shape. Pure host arithmetic, shared
//! by the CUDA runtime and the host emulation.

use super::{CudaProgram, Smem, storage_bytes};
use attn_compiler::schedule::policy::{CUDA_LANE_KEYS, CUDA_MMA_BWD_BLOCK, CUDA_SIMT_ROWS, CUDA_WS_THREADS};
use attn_compiler::schedule::{Prepared, Schedule};
use thiserror::Error;

/// What the device allows (from its attributes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Largest dynamic shared memory one block may opt into, in bytes.
    pub max_smem_per_block: u32,
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

/// Why a prepared run cannot be launched on this device.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum LaunchError {
    /// A kernel needs more shared memory than the device allows per block.
    #[error("kernel `{kernel}` needs {needed} bytes of shared memory; the device allows {available}")]
    SharedMemory {
        /// The kernel.
        kernel: String,
        /// Bytes needed.
        needed: u64,
        /// Bytes allowed.
        available: u32,
    },
    /// The program and the prepared run disagree (a bug).
    #[error("internal error: {0}")]
    Internal(String),
}

/// The largest grid the loops need; more blocks would only find no work.
const MAX_GRID: i64 = i32::MAX as i64;

/// The launches of one prepared run, in step order; steps without work launch nothing.
pub fn launches(
    program: &CudaProgram,
    schedule: &Schedule,
    prepared: &Prepared,
    limits: &DeviceLimits,
) -> Result<Vec<ReadyLaunch>, LaunchError> {
    let work = prepared.work(schedule);
    if work.len() != program.kernels.len() {
        return Err(LaunchError::Internal(format!("{} kernels for {} steps", program.kernels.len(), work.len())));
    }
    // A compile-time value of step `s` that `prepare` set (`ATTNC_{name}_{s}`).
    let define = |name: &str, s: usize, what: &str| {
        let key = format!("ATTNC_{name}_{s}");
        prepared
            .defines
            .iter()
            .find(|(n, _)| *n == key)
            .map(|(_, v)| *v)
            .ok_or_else(|| LaunchError::Internal(format!("no {what} for step {s}")))
    };
    let mut out = Vec::new();
    for (k, items) in program.kernels.iter().zip(work) {
        if items <= 0 {
            continue;
        }
        let smem: i64 = match k.smem {
            Smem::None => 0,
            Smem::FlashSimt(s) | Smem::FlashSimtAdditive(s) => {
                let hd = define("HD", s, "head width")?;
                let (rows, keys) = (CUDA_SIMT_ROWS, CUDA_LANE_KEYS);
                // Q, K (rows skewed by one), V; additive scores add e^(2q), e^(2k) and the weight.
                let tiles = rows * hd + keys * (hd + 1) + keys * hd;
                let additive = if matches!(k.smem, Smem::FlashSimtAdditive(_)) { rows * hd + keys * (hd + 1) + hd } else { 0 };
                (tiles + additive) * 4
            }
            Smem::FlashBwdMma(s, ds) => {
                let (hd, b) = (define("HD", s, "head width")?, CUDA_MMA_BWD_BLOCK);
                // Two blocks, two double-buffered half tiles; the rows' statistics; when dQ is
                // added atomically, a half tile's dS and its dQ (f32).
                4 * b * (hd + 8) * 2 + 2 * b * 4 + if ds { b / 2 * (b + 8) * 2 + b / 2 * (hd + 4) * 4 } else { 0 }
            }
            Smem::FlashMma(s) => {
                let (hd, bn, mt) = (define("HD", s, "head width")?, define("BN", s, "key tile")?, define("MT", s, "m-tiles")?);
                attn_compiler::schedule::policy::mma_smem_bytes(hd, bn, mt, define("KS", s, "K/V stages")?)
            }
        };
        if smem > i64::from(limits.max_smem_per_block) {
            return Err(LaunchError::SharedMemory { kernel: k.name.clone(), needed: smem as u64, available: limits.max_smem_per_block });
        }
        // The warp-specialised flash forward: a producer warpgroup and two consumers.
        let threads = match k.smem {
            Smem::FlashMma(s) if define("WS", s, "warp specialisation")? != 0 => CUDA_WS_THREADS,
            _ => k.threads,
        };
        let blocks = ((items + k.items_per_block - 1) / k.items_per_block).clamp(1, MAX_GRID);
        out.push(ReadyLaunch { kernel: k.name.clone(), grid: [blocks as u32, 1, 1], block: [threads, 1, 1], smem_bytes: smem as u32 });
    }
    Ok(out)
}

/// The device bytes of every buffer of a prepared run (at least 1, so that every buffer has an
/// address): its elements times its dtype's storage size.
pub fn buffer_bytes(schedule: &Schedule, prepared: &Prepared) -> Result<Vec<usize>, LaunchError> {
    schedule
        .buffers
        .iter()
        .zip(&prepared.elems)
        .map(|(b, n)| {
            n.checked_mul(storage_bytes(b.dtype))
                .map(|x| x.max(1))
                .ok_or_else(|| LaunchError::Internal(format!("buffer of %{} overflows", b.value)))
        })
        .collect()
}
