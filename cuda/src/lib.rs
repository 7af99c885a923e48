//! The CUDA target: runs a graph on an NVIDIA GPU (sm_80 or newer) through cudarc.
//!
//! A graph is compiled by the pipeline for the CUDA target (optimised, scheduled with the
//! device's block policy, rendered as CUDA C++ by [`render`]), compiled
//! by NVRTC to a cubin for the device's
//! architecture (cached in memory and on disk, see [`nvrtc`]), loaded, and launched kernel by
//! kernel on one stream. Per process and per graph the device buffers are kept and reused
//! across runs (grown when a run needs more); host↔device copies happen only for the inputs
//! and outputs. Each run's dims prepare the schedule ([`attn_compiler::schedule::prepare()`]):
//! the integer table the kernels read, split-KV counts, tile tables and launch grids, so a new
//! sequence length recompiles nothing (a new head width does: it is a compile-time constant of
//! the flash kernels, see docs/cuda.md).
//!
//! Everything is loaded dynamically: without a driver, a device or NVRTC, [`device_info`] and
//! [`run`] return [`CudaError::Unavailable`] (checked before any driver or NVRTC call, so this
//! never panics).

mod exec;
mod host;
pub mod nvrtc;
pub mod render;

pub mod emulate;
#[cfg(test)]
mod emulate_tests;
#[cfg(test)]
mod gpu_tests;
#[cfg(test)]
mod tests;

use attn_compiler::PipelineError;
use attn_compiler::exec::ExecError;
use attn_compiler::ir::Graph;
use attn_compiler::schedule::{PrepareError, ScheduleError};
use attn_compiler::tensor::Tensor;
use render::{CudaEmitError, LaunchError};
use std::collections::HashMap;
use thiserror::Error;

pub use exec::{DeviceInfo, DeviceTensor, output_shapes, run_device};
pub use render::{CudaProgram, CudaText};

/// The tuning knob `ATTNC_CUDA_MMA_ROWS` (query rows per block of the tensor-core flash
/// kernel, 64 or 128; every choice computes the same result), when set to a number.
pub(crate) fn mma_rows_knob() -> Option<i64> {
    std::env::var("ATTNC_CUDA_MMA_ROWS").ok().and_then(|s| s.trim().parse::<i64>().ok())
}

/// `ATTNC_CUDA_KV_STAGES=1|2`: the tensor-core flash forward's K/V stages on Hopper, instead of
/// the policy's choice (for comparing; see `CudaPolicy::mma_kv_stages`).
pub(crate) fn kv_stages_knob() -> Option<i64> {
    std::env::var("ATTNC_CUDA_KV_STAGES").ok().and_then(|s| s.trim().parse::<i64>().ok())
}

/// `ATTNC_CUDA_WS=0`: the tensor-core flash forward on Hopper in one warpgroup with two K/V
/// stages instead of the warp-specialised block (for comparing; see
/// `CudaPolicy::mma_warp_specialized`).
pub(crate) fn warp_specialize_knob() -> bool {
    std::env::var("ATTNC_CUDA_WS").map_or(true, |s| s.trim() != "0")
}

/// `ATTNC_CUDA_TMA=0`: the warp-specialised flash forward's producer copies K/V tiles with its
/// threads' `cp.async` instead of TMA loads (for comparing the two; `CudaPolicy::tma`).
pub(crate) fn tma_knob() -> bool {
    std::env::var("ATTNC_CUDA_TMA").map_or(true, |s| s.trim() != "0")
}

/// `ATTNC_CUDA_BWD=simt`: every flash backward on the SIMT kernel (for comparing it with the
/// tensor-core one).
pub(crate) fn simt_backward_knob() -> bool {
    std::env::var("ATTNC_CUDA_BWD").is_ok_and(|s| s.trim() == "simt")
}

/// `ATTNC_CUDA_WGMMA=0`: an sm_90 device compiles for plain `sm_90` (the `mma.sync` kernels)
/// instead of `sm_90a` (Hopper's warpgroup products where a kernel has them), for comparing
/// the two.
pub(crate) fn wgmma_knob() -> bool {
    std::env::var("ATTNC_CUDA_WGMMA").map_or(true, |s| s.trim() != "0")
}

/// The NVRTC architecture for a device of compute capability `major.minor`: `sm_90a` on
/// Hopper (its architecture-specific instructions: `wgmma`), unless the knob says no.
pub(crate) fn nvrtc_arch(major: i32, minor: i32, wgmma: bool) -> String {
    if major == 9 && minor == 0 && wgmma { "sm_90a".to_string() } else { format!("sm_{major}{minor}") }
}

/// `ATTNC_CUDA_BWD=deterministic`: the tensor-core flash backward in its deterministic mode
/// (`dQ` from query items of its own, no atomic adds: the same bits on every run).
pub(crate) fn deterministic_backward_knob() -> bool {
    std::env::var("ATTNC_CUDA_BWD").is_ok_and(|s| s.trim() == "deterministic")
}

/// Why the CUDA target could not run a graph.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum CudaError {
    /// No driver, no device, no NVRTC, or a GPU older than sm_80.
    #[error("the CUDA target is not available: {0}")]
    Unavailable(String),
    /// The graph could not be scheduled for the GPU.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// The schedule could not be rendered as CUDA source.
    #[error(transparent)]
    Emit(#[from] CudaEmitError),
    /// These dims cannot run (a head too wide, a slice outside its axis, ...).
    #[error("cannot run on the GPU: {0}")]
    Prepare(#[from] PrepareError),
    /// These dims cannot be launched on this device (too much shared memory).
    #[error("cannot run on the GPU: {0}")]
    Launch(#[from] LaunchError),
    /// The inputs do not fit the graph (count, dtype, shape, dims).
    #[error(transparent)]
    Input(#[from] ExecError),
    /// NVRTC rejected the generated source (a compiler bug: please report it).
    #[error("NVRTC could not compile the generated CUDA source for {arch}: {log}")]
    Compile {
        /// The architecture (`sm_90`).
        arch: String,
        /// The compiler's log.
        log: String,
    },
    /// Device tensors given to [`run_device`] that do not fit the graph's results (their count,
    /// dtypes or shapes), or a graph that cannot run on them.
    #[error("device tensors: {0}")]
    Device(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver error while {what}: {error}")]
    Driver {
        /// What was being done.
        what: String,
        /// The driver's error.
        error: String,
    },
}

impl From<PipelineError> for CudaError {
    fn from(e: PipelineError) -> CudaError {
        match e {
            PipelineError::Schedule(e) => CudaError::Schedule(e),
            other => CudaError::Driver { what: "compiling".into(), error: other.to_string() },
        }
    }
}

/// The device the CUDA target would use, or why there is none. Cheap after the first call.
pub fn device_info() -> Result<DeviceInfo, CudaError> {
    exec::gpu().map(|g| g.info.clone())
}

/// Runs `graph` on the GPU: inputs in parameter order, dims not determined by the input shapes
/// in `given`. Returns the outputs in `graph.outputs()` order, with the interpreter's dtypes.
pub fn run(graph: &Graph, inputs: &[Tensor], given: &HashMap<String, i64>) -> Result<Vec<Tensor>, CudaError> {
    exec::run(graph, inputs, given, None).map(|(out, _)| out)
}

/// Times `graph` on the GPU: one untimed run (compile, upload), `warmup` untimed launches of
/// the kernels, then `iters` timed ones (CUDA events around the kernels only; inputs stay on
/// the device). Returns the milliseconds of each timed run and the outputs of the first run.
pub fn bench(
    graph: &Graph,
    inputs: &[Tensor],
    given: &HashMap<String, i64>,
    warmup: usize,
    iters: usize,
) -> Result<(Vec<f64>, Vec<Tensor>), CudaError> {
    exec::run(graph, inputs, given, Some((warmup, iters.max(1)))).map(|(out, times)| (times, out))
}
