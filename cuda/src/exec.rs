//! The device side: opening the GPU once per process, compiled and loaded programs, reused
//! buffers, uploads, launches and downloads.

use super::{CudaError, host, nvrtc};
use crate::render::{CudaProgram, DeviceLimits, ReadyLaunch, Smem, buffer_bytes, launches};
use attn_compiler::Compiler;
use attn_compiler::exec::{ExecError, bind_dims};
use attn_compiler::ir::{DType, Graph};
use attn_compiler::schedule::{CudaPolicy, Policy, PrepareError, Prepared, Schedule};
use attn_compiler::tensor::Tensor;
use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The GPU the CUDA target uses (device 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's name.
    pub name: String,
    /// The architecture kernels are compiled for (`sm_80`, `sm_90a`, ...).
    pub arch: String,
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// Largest dynamic shared memory per block, in bytes (opt-in maximum).
    pub max_smem_per_block: u32,
    /// Where NVRTC was loaded from, and its version.
    pub nvrtc: (String, (i32, i32)),
}

/// The process-wide GPU state.
pub(super) struct Gpu {
    pub info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    cache: nvrtc::Cache,
    programs: Mutex<HashMap<String, Arc<Mutex<Exec>>>>,
}

/// `-D` head-width macros and their values: one compiled module per distinct list.
type Defines = Vec<(String, i64)>;

/// One graph on the device: its schedule and rendered program, loaded modules (per head-width
/// specialisation), and the buffers kept between runs.
struct Exec {
    schedule: Schedule,
    program: CudaProgram,
    modules: HashMap<Defines, Loaded>,
    buffers: Vec<Option<CudaSlice<u8>>>,
    /// The (defines, integer table) the tile tables on the device were computed for.
    tables_for: Option<(Defines, Vec<i64>)>,
    /// The last run's TMA tensor maps on the device (`attnc_tmaps`), 128 bytes each, and their
    /// bytes (a run whose maps encode alike uploads nothing).
    tmaps: Option<(CudaSlice<u8>, Vec<u8>)>,
}

struct Loaded {
    _module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
}

fn driver(what: &str) -> impl Fn(cudarc::driver::DriverError) -> CudaError + '_ {
    move |e| CudaError::Driver { what: what.to_string(), error: format!("{e:?}") }
}

/// The GPU, opened on first use; the outcome (including "not available") is kept.
pub(super) fn gpu() -> Result<&'static Gpu, CudaError> {
    static GPU: OnceLock<Result<Gpu, CudaError>> = OnceLock::new();
    GPU.get_or_init(open).as_ref().map_err(Clone::clone)
}

fn open() -> Result<Gpu, CudaError> {
    let unavailable = |why: String| CudaError::Unavailable(why);
    // SAFETY: only tries to open the driver library by its standard names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(unavailable("no NVIDIA driver was found (libcuda.so could not be loaded)".into()));
    }
    let count = CudaContext::device_count().map_err(|e| unavailable(format!("the NVIDIA driver reports no usable device ({e:?})")))?;
    if count < 1 {
        return Err(unavailable("no CUDA device is visible".into()));
    }
    let nvrtc_path = nvrtc::available().map_err(unavailable)?;
    let ctx = CudaContext::new(0).map_err(driver("creating a context on device 0"))?;
    let name = ctx.name().unwrap_or_else(|_| "device 0".to_string());
    let (major, minor) = ctx.compute_capability().map_err(driver("reading the compute capability"))?;
    if major < 8 {
        return Err(unavailable(format!("{name} is sm_{major}{minor}; the generated kernels need sm_80 or newer")));
    }
    let attr = |a: CUdevice_attribute, what: &str| ctx.attribute(a).map_err(driver(what));
    let sm_count = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "reading the SM count")?;
    let smem = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, "reading the shared memory limit")?;
    // One stream orders everything; cudarc's per-buffer events would only add overhead.
    // SAFETY: every buffer is used on `stream` only.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
    let info = DeviceInfo {
        name,
        arch: crate::nvrtc_arch(major, minor, crate::wgmma_knob()),
        sm_count: u32::try_from(sm_count).unwrap_or(1),
        max_smem_per_block: u32::try_from(smem).unwrap_or(48 * 1024),
        nvrtc: (nvrtc_path, nvrtc::version()),
    };
    Ok(Gpu { info, ctx, stream, cache: nvrtc::Cache::new(), programs: Mutex::new(HashMap::new()) })
}

impl Gpu {
    /// Sources compiled by NVRTC in this process (cache misses).
    #[cfg(test)]
    pub(super) fn compiles(&self) -> usize {
        self.cache.compiles()
    }

    /// The block policy for this device.
    fn policy(&self) -> Policy {
        Policy::Cuda(CudaPolicy {
            sm_count: self.info.sm_count,
            max_smem_per_block: self.limits().max_smem_per_block,
            mma_rows: super::mma_rows_knob(),
            simt_backward: super::simt_backward_knob(),
            deterministic_backward: super::deterministic_backward_knob(),
            wgmma: self.info.arch == "sm_90a",
            kv_stages: super::kv_stages_knob(),
            warp_specialize: super::warp_specialize_knob(),
            tma: super::tma_knob(),
        })
    }

    /// Launch limits: dynamic shared memory leaves 1 KiB for the kernels' static arrays (the
    /// SIMT flash kernel has 512 bytes).
    fn limits(&self) -> DeviceLimits {
        DeviceLimits { max_smem_per_block: self.info.max_smem_per_block.saturating_sub(1024) }
    }

    /// The executable for a graph (compiled by the pipeline on first use), keyed by its IR text.
    fn exec_for(&self, graph: &Graph) -> Result<Arc<Mutex<Exec>>, CudaError> {
        let key = graph.to_string();
        let mut programs = self.programs.lock().map_err(|_| poisoned())?;
        if let Some(e) = programs.get(&key) {
            return Ok(e.clone());
        }
        let compiler = Compiler::new(self.policy());
        let planned = compiler.plan(graph).map_err(CudaError::from)?;
        let program = crate::render::render(&planned.schedule)?;
        let buffers = planned.schedule.buffers.iter().map(|_| None).collect();
        let exec = Arc::new(Mutex::new(Exec {
            schedule: planned.schedule,
            program,
            modules: HashMap::new(),
            buffers,
            tables_for: None,
            tmaps: None,
        }));
        programs.insert(key, exec.clone());
        Ok(exec)
    }
}

fn poisoned() -> CudaError {
    CudaError::Driver { what: "locking the program cache".into(), error: "a previous run panicked".into() }
}

impl Exec {
    /// The module compiled with these head widths, compiled (or read from the cache) and
    /// loaded on first use.
    fn module(&mut self, gpu: &Gpu, defines: &[(String, i64)]) -> Result<&Loaded, CudaError> {
        if !self.modules.contains_key(defines) {
            let arch = gpu.info.arch.clone();
            let (image, _) =
                gpu.cache.get(&self.program.source, &arch, defines).map_err(|log| CudaError::Compile { arch: arch.clone(), log })?;
            let module = gpu.ctx.load_module(Ptx::from_binary(image.as_ref().clone())).map_err(driver("loading the compiled module"))?;
            let mut functions = HashMap::new();
            for l in &self.program.kernels {
                if functions.contains_key(&l.name) {
                    continue;
                }
                let f = module.load_function(&l.name).map_err(driver("finding a kernel in the module"))?;
                if l.smem != Smem::None {
                    // Dynamic plus static shared memory may not exceed the opt-in limit.
                    let fixed = f.shared_size_bytes().map_err(driver("reading a kernel's static shared memory"))?;
                    let max = i32::try_from(gpu.info.max_smem_per_block).unwrap_or(i32::MAX).saturating_sub(fixed.max(0));
                    f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, max)
                        .map_err(driver("allowing a kernel its shared memory"))?;
                }
                functions.insert(l.name.clone(), f);
            }
            self.modules.insert(defines.to_vec(), Loaded { _module: module, functions });
        }
        self.modules.get(defines).ok_or_else(poisoned)
    }

    /// Buffers at least as large as this run needs (kept and reused across runs).
    fn ensure_buffers(&mut self, gpu: &Gpu, bytes: &[usize]) -> Result<(), CudaError> {
        for (slot, need) in self.buffers.iter_mut().zip(bytes) {
            if slot.as_ref().is_none_or(|b| b.len() < *need) {
                *slot = None;
                *slot = Some(gpu.stream.alloc_zeros::<u8>(*need).map_err(driver("allocating device memory"))?);
            }
        }
        Ok(())
    }

    /// The tile tables of `prep` on the device (unless they are there from the last run), and
    /// the fault record of checked indices zeroed (every run starts without a fault).
    fn upload_tables(&mut self, gpu: &Gpu, prep: &Prepared) -> Result<(), CudaError> {
        let table_key = (prep.defines.clone(), prep.ints.clone());
        if self.tables_for.as_ref() != Some(&table_key) {
            for (buf, bytes) in &prep.tables {
                if bytes.is_empty() {
                    continue;
                }
                let slot = self.buffers.get_mut(*buf).and_then(Option::as_mut).ok_or_else(poisoned)?;
                gpu.stream.memcpy_htod(bytes, slot).map_err(driver("copying a tile table to the device"))?;
            }
            self.tables_for = Some(table_key);
        }
        if let Some(f) = self.schedule.fault {
            let slot = self.buffers.get_mut(f).and_then(Option::as_mut).ok_or_else(poisoned)?;
            gpu.stream.memcpy_htod(&[0u8; 16], slot).map_err(driver("clearing the fault record"))?;
        }
        Ok(())
    }

    /// The run's TMA tensor maps ([`Prepared::tma`]) encoded by the driver for the buffers'
    /// addresses (`at`: the caller's tensors) and copied to the device (nothing when it has none).
    fn upload_tmaps(&mut self, gpu: &Gpu, prep: &Prepared, at: &HashMap<usize, u64>) -> Result<(), CudaError> {
        if prep.tma.is_empty() {
            return Ok(());
        }
        let ptrs = self.pointers(gpu, at)?;
        let mut bytes = Vec::with_capacity(128 * prep.tma.len());
        for m in &prep.tma {
            let base = ptrs.get(m.buf).copied().ok_or_else(poisoned)?;
            bytes.extend_from_slice(&encode_tmap(m, base)?);
        }
        match &mut self.tmaps {
            Some((_, last)) if *last == bytes => {}
            Some((slot, last)) if slot.len() >= bytes.len() => {
                gpu.stream.memcpy_htod(&bytes, slot).map_err(driver("copying the tensor maps to the device"))?;
                *last = bytes;
            }
            _ => {
                self.tmaps = None;
                let mut slot = gpu.stream.alloc_zeros::<u8>(bytes.len()).map_err(driver("allocating the tensor maps"))?;
                gpu.stream.memcpy_htod(&bytes, &mut slot).map_err(driver("copying the tensor maps to the device"))?;
                self.tmaps = Some((slot, bytes));
            }
        }
        Ok(())
    }

    /// Every buffer's device address, or the caller's (`at`) where given.
    fn pointers(&self, gpu: &Gpu, at: &HashMap<usize, u64>) -> Result<Vec<u64>, CudaError> {
        let mut ptrs = Vec::with_capacity(self.buffers.len());
        for i in 0..self.buffers.len() {
            if let Some(p) = at.get(&i) {
                ptrs.push(*p);
                continue;
            }
            let (p, _guard) = self.buffer(i)?.device_ptr(&gpu.stream);
            ptrs.push(p);
        }
        Ok(ptrs)
    }

    /// After the launches: the first index fault the kernels recorded, as an input error
    /// (waits for the kernels; nothing to do when the program checks no index).
    fn check_fault(&self, gpu: &Gpu) -> Result<(), CudaError> {
        let Some(f) = self.schedule.fault else { return Ok(()) };
        let mut record = [0u8; 16];
        let src = self
            .buffer(f)?
            .try_slice(0..16)
            .ok_or_else(|| CudaError::Driver { what: "reading the fault record".into(), error: "it holds fewer than 16 bytes".into() })?;
        gpu.stream.memcpy_dtoh(&src, &mut record).map_err(driver("copying the fault record to the host"))?;
        gpu.stream.synchronize().map_err(driver("running the kernels"))?;
        match self.schedule.fault_error(super::host::fault_words(&record)) {
            Some(e) => Err(CudaError::Input(e)),
            None => Ok(()),
        }
    }

    fn buffer(&self, index: usize) -> Result<&CudaSlice<u8>, CudaError> {
        self.buffers
            .get(index)
            .and_then(Option::as_ref)
            .ok_or_else(|| CudaError::Driver { what: format!("using buffer b{index}"), error: "it was never allocated".into() })
    }

    /// Launches every kernel of the prepared run, in order, on the stream.
    fn launch_all(&self, gpu: &Gpu, loaded: &Loaded, prep: &Prepared, ready: &[ReadyLaunch]) -> Result<(), CudaError> {
        self.launch_with(gpu, loaded, prep, ready, &HashMap::new())
    }

    /// [`Self::launch_all`] with some buffers at other device addresses (a caller's tensors).
    fn launch_with(
        &self,
        gpu: &Gpu,
        loaded: &Loaded,
        prep: &Prepared,
        ready: &[ReadyLaunch],
        at: &HashMap<usize, u64>,
    ) -> Result<(), CudaError> {
        let ptrs = self.pointers(gpu, at)?;
        // The tensor maps, where the run has any (else a null pointer the kernels never read).
        let tmaps = match (&self.tmaps, prep.tma.is_empty()) {
            (Some((b, _)), false) => b.device_ptr(&gpu.stream).0,
            _ => 0u64,
        };
        for l in ready {
            let f = loaded
                .functions
                .get(&l.kernel)
                .ok_or_else(|| CudaError::Driver { what: format!("launching `{}`", l.kernel), error: "not in the module".into() })?;
            let mut args = gpu.stream.launch_builder(f);
            for p in &ptrs {
                args.arg(p);
            }
            for t in &prep.ints {
                args.arg(t);
            }
            args.arg(&tmaps);
            let cfg = LaunchConfig {
                grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
                block_dim: (l.block[0], l.block[1], l.block[2]),
                shared_mem_bytes: l.smem_bytes,
            };
            // SAFETY: the arguments are exactly the kernels' `ATTNC_ARGS` (one device pointer per
            // buffer, the integer table as 64-bit integers, then the tensor maps' address, which
            // `upload_tmaps` filled for this run's addresses), and every buffer is at least
            // as large as `prepare` computed for these dims, which bounds every index the
            // kernels form.
            unsafe { args.launch(cfg) }.map_err(driver("launching a kernel"))?;
        }
        Ok(())
    }
}

/// Runs (and optionally times) a graph; see [`super::run`] and [`super::bench`].
pub(super) fn run(
    graph: &Graph,
    inputs: &[Tensor],
    given: &HashMap<String, i64>,
    timing: Option<(usize, usize)>,
) -> Result<(Vec<Tensor>, Vec<f64>), CudaError> {
    let gpu = gpu()?;
    attn_compiler::exec::check_inputs(graph, inputs)?;
    let shapes: Vec<Vec<usize>> = inputs.iter().map(|t| t.shape.clone()).collect();
    let mut env = bind_dims(graph, &shapes, given)?;
    attn_compiler::exec::add_scalar_inputs(inputs, &mut env);
    let exec = gpu.exec_for(graph)?;
    let mut ex = exec.lock().map_err(|_| poisoned())?;
    let data = attn_compiler::exec::mask_data_inputs(&attn_compiler::schedule::mask_data_params(&ex.schedule), inputs, &mut env);
    let prep = attn_compiler::schedule::prepare_with(&ex.schedule, &env, &gpu.policy(), &data).map_err(slice_fault)?;
    let bytes = buffer_bytes(&ex.schedule, &prep)?;
    let ready = launches(&ex.program, &ex.schedule, &prep, &gpu.limits())?;
    ex.ensure_buffers(gpu, &bytes)?;
    ex.module(gpu, &prep.defines)?;

    // Inputs in, at the program's boundary.
    for (t, buf) in inputs.iter().zip(ex.schedule.params.clone()) {
        let bytes = host::to_bytes(t);
        if bytes.is_empty() {
            continue;
        }
        let slot = ex.buffers.get_mut(buf).and_then(Option::as_mut).ok_or_else(poisoned)?;
        gpu.stream.memcpy_htod(&bytes, slot).map_err(driver("copying an input to the device"))?;
    }
    ex.upload_tables(gpu, &prep)?;
    ex.upload_tmaps(gpu, &prep, &HashMap::new())?;
    let loaded = ex.modules.get(&prep.defines).ok_or_else(poisoned)?;
    ex.launch_all(gpu, loaded, &prep, &ready)?;
    ex.check_fault(gpu)?;

    // Outputs out.
    let mut outputs = Vec::new();
    for ((_, v), buf) in graph.outputs().iter().zip(&ex.schedule.outputs) {
        let ty = &graph.node(*v).ty;
        let shape =
            ty.shape.iter().map(|d| d.eval(&env).map(|x| x.max(0) as usize)).collect::<Result<Vec<_>, _>>().map_err(ExecError::from)?;
        let n: usize = shape.iter().product::<usize>() * crate::render::storage_bytes(ty.dtype);
        let mut bytes = vec![0u8; n];
        if n > 0 {
            let src = ex.buffer(*buf)?.try_slice(0..n).ok_or_else(|| CudaError::Driver {
                what: format!("reading output buffer b{buf}"),
                error: format!("it holds fewer than {n} bytes"),
            })?;
            gpu.stream.memcpy_dtoh(&src, &mut bytes).map_err(driver("copying an output to the host"))?;
        }
        gpu.stream.synchronize().map_err(driver("running the kernels"))?;
        let t = host::from_bytes(ty.dtype, shape, &bytes)
            .map_err(|e| CudaError::Driver { what: "reading an output".into(), error: e.to_string() })?;
        outputs.push(t);
    }
    gpu.stream.synchronize().map_err(driver("running the kernels"))?;

    let mut times = Vec::new();
    if let Some((warmup, iters)) = timing {
        for _ in 0..warmup {
            ex.launch_all(gpu, loaded, &prep, &ready)?;
        }
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        for _ in 0..iters {
            let start = gpu.ctx.new_event(flags).map_err(driver("creating an event"))?;
            let end = gpu.ctx.new_event(flags).map_err(driver("creating an event"))?;
            start.record(&gpu.stream).map_err(driver("recording an event"))?;
            ex.launch_all(gpu, loaded, &prep, &ready)?;
            end.record(&gpu.stream).map_err(driver("recording an event"))?;
            end.synchronize().map_err(driver("running the kernels"))?;
            times.push(f64::from(start.elapsed_ms(&end).map_err(driver("reading an event"))?));
        }
    }
    Ok((outputs, times))
}

/// A tensor in device memory of the CUDA target's context (device 0's primary context, the one
/// PyTorch and the runtime API use): its address, dtype and shape, its elements dense in
/// row-major order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceTensor {
    /// The device address of the first element.
    pub ptr: u64,
    /// The element type (f16/bf16 two bytes, f32/i32 four, bool one).
    pub dtype: DType,
    /// The shape.
    pub shape: Vec<usize>,
}

/// Runs a graph on tensors already on the device, writing its results into `outputs` (their
/// shapes as [`output_shapes`] gives them), ordered after the work queued on `stream` (a
/// caller's `CUstream`, 0 for the legacy default stream) and before what is queued there
/// next: no host copies, and no wait on the host unless the graph reads an input's values
/// on the host (0-d sizes, ids that classify tiles) that `known` (host copies of inputs by
/// parameter index, equal to the device tensors, as the caller holds them) does not give, or
/// checks indices.
///
/// # Safety
/// Every `ptr` must address a live allocation of this context holding its tensor's elements
/// densely (row-major), the outputs must not overlap the inputs or each other, and `stream`
/// must be a live stream of this context (or 0).
pub unsafe fn run_device(
    graph: &Graph,
    inputs: &[DeviceTensor],
    outputs: &[DeviceTensor],
    given: &HashMap<String, i64>,
    stream: u64,
    known: &HashMap<usize, Tensor>,
) -> Result<(), CudaError> {
    let gpu = gpu()?;
    let mut env = checked_dims(graph, inputs, outputs, given)?;
    let ext = stream as cudarc::driver::sys::CUstream;
    let exec = gpu.exec_for(graph)?;
    let mut ex = exec.lock().map_err(|_| poisoned())?;
    // Only ids and lengths come to the host to classify tiles from; a dense mask stays on the
    // device (its tiles are all partial), where copying it would cost a copy per run.
    let on_host = attn_compiler::schedule::id_data_params(&ex.schedule);
    // SAFETY: forwarded from the caller's contract.
    let host_inputs = unsafe { host_values(inputs, &on_host, known, ext) }?;
    attn_compiler::exec::add_scalar_inputs(&host_inputs, &mut env);
    let data = attn_compiler::exec::mask_data_inputs(&on_host, &host_inputs, &mut env);
    let mut prep = attn_compiler::schedule::prepare_with(&ex.schedule, &env, &gpu.policy(), &data).map_err(slice_fault)?;
    // The caller's tensors stand for the parameters' and results' buffers (ours shrink to one
    // byte there).
    let mut at = HashMap::new();
    for (buf, t) in ex.schedule.params.iter().zip(inputs) {
        at.insert(*buf, t.ptr);
    }
    for (buf, t) in ex.schedule.outputs.iter().zip(outputs) {
        if at.insert(*buf, t.ptr).is_some() {
            return Err(CudaError::Device("a result that is an input unchanged needs no device run; pass it through".into()));
        }
    }
    // TMA reads from 16-byte aligned addresses only: a caller's tensor elsewhere (a view at an
    // odd element offset) takes the threads' copies.
    if prep.tma.iter().any(|m| at.get(&m.buf).is_some_and(|p| p.wrapping_add(m.offset_bytes) % 16 != 0)) {
        let Policy::Cuda(c) = gpu.policy() else { return Err(poisoned()) };
        prep = attn_compiler::schedule::prepare_with(&ex.schedule, &env, &Policy::Cuda(CudaPolicy { tma: false, ..c }), &data)
            .map_err(slice_fault)?;
    }
    let mut bytes = buffer_bytes(&ex.schedule, &prep)?;
    for buf in at.keys() {
        if let Some(b) = bytes.get_mut(*buf) {
            *b = 1;
        }
    }
    let ready = launches(&ex.program, &ex.schedule, &prep, &gpu.limits())?;
    ex.ensure_buffers(gpu, &bytes)?;
    ex.module(gpu, &prep.defines)?;
    ex.upload_tables(gpu, &prep)?;
    ex.upload_tmaps(gpu, &prep, &at)?;
    let loaded = ex.modules.get(&prep.defines).ok_or_else(poisoned)?;
    // SAFETY: forwarded from the caller's contract.
    unsafe { on_callers_stream(gpu, ext, || ex.launch_with(gpu, loaded, &prep, &ready, &at)) }?;
    ex.check_fault(gpu)?;
    Ok(())
}

/// The dims of a device run, after its tensors' dtypes (the parameters') and its outputs'
/// dtypes and shapes (the results', at these dims) are checked.
fn checked_dims(
    graph: &Graph,
    inputs: &[DeviceTensor],
    outputs: &[DeviceTensor],
    given: &HashMap<String, i64>,
) -> Result<HashMap<String, i64>, CudaError> {
    let params = graph.param_types();
    if inputs.len() != params.len() {
        return Err(CudaError::Input(ExecError::input_count(graph, inputs.len())));
    }
    for ((param, ty), t) in params.into_iter().zip(inputs) {
        if t.dtype != ty.dtype {
            return Err(CudaError::Input(ExecError::InputDType { param, expected: ty.dtype, actual: t.dtype }));
        }
    }
    let shapes: Vec<Vec<usize>> = inputs.iter().map(|t| t.shape.clone()).collect();
    let env = bind_dims(graph, &shapes, given)?;
    let expected = output_shapes_in(graph, &env)?;
    if outputs.len() != expected.len() {
        return Err(CudaError::Device(format!("{} output tensors given for {} results", outputs.len(), expected.len())));
    }
    for (n, (t, (dtype, shape))) in outputs.iter().zip(&expected).enumerate() {
        if t.dtype != *dtype || &t.shape != shape {
            return Err(CudaError::Device(format!("output {n} is {} {:?}; the result is {dtype} {shape:?}", t.dtype, t.shape)));
        }
    }
    Ok(env)
}

/// Host tensors standing for a device run's inputs where the plan reads values on the host (0-d
/// i32 sizes, and the ids of `on_host` that classify tiles): the caller's `known` copies, else
/// copied from the device after the caller's stream `ext` has produced them; every other input
/// an empty placeholder.
///
/// # Safety
/// As [`run_device`]'s, for `inputs` and `ext`.
unsafe fn host_values(
    inputs: &[DeviceTensor],
    on_host: &[usize],
    known: &HashMap<usize, Tensor>,
    ext: cudarc::driver::sys::CUstream,
) -> Result<Vec<Tensor>, CudaError> {
    use attn_compiler::tensor::TensorData;
    let mut out = Vec::with_capacity(inputs.len());
    for (i, t) in inputs.iter().enumerate() {
        let read = t.dtype == DType::I32 && (t.shape.is_empty() || on_host.contains(&i));
        if let Some(h) = known.get(&i) {
            if h.dtype != t.dtype || h.shape != t.shape {
                return Err(CudaError::Device(format!(
                    "input {i}'s host copy is {} {:?}, the device tensor {} {:?}",
                    h.dtype, h.shape, t.dtype, t.shape
                )));
            }
            out.push(h.clone());
        } else if read {
            let mut v = vec![0i32; t.shape.iter().product()];
            if !v.is_empty() {
                // SAFETY: the caller's stream and tensor are valid in this context (the caller's
                // contract), `v` holds the tensor's elements.
                unsafe {
                    cudarc::driver::result::stream::synchronize(ext).map_err(driver("waiting for the caller's stream"))?;
                    cudarc::driver::result::memcpy_dtoh_sync(&mut v, t.ptr).map_err(driver("reading an input's values"))?;
                }
            }
            out.push(Tensor { dtype: DType::I32, shape: t.shape.clone(), data: TensorData::I32(v) });
        } else {
            out.push(Tensor { dtype: DType::I32, shape: vec![0], data: TensorData::I32(Vec::new()) });
        }
    }
    Ok(out)
}

/// Runs `launch` (which queues work on our stream) ordered after the work queued on the
/// caller's stream `ext` and before what is queued there next: an event each way.
///
/// # Safety
/// `ext` is a live stream of this context (or 0).
unsafe fn on_callers_stream(
    gpu: &Gpu,
    ext: cudarc::driver::sys::CUstream,
    launch: impl FnOnce() -> Result<(), CudaError>,
) -> Result<(), CudaError> {
    let before = gpu.ctx.new_event(None).map_err(driver("creating an event"))?;
    // SAFETY: `ext` is live (the caller's contract); the event lives until the wait is queued.
    unsafe { cudarc::driver::result::event::record(before.cu_event(), ext) }
        .map_err(driver("recording an event on the caller's stream"))?;
    gpu.stream.wait(&before).map_err(driver("ordering after the caller's stream"))?;
    launch()?;
    let done = gpu.stream.record_event(None).map_err(driver("recording an event"))?;
    // SAFETY: as above.
    unsafe {
        cudarc::driver::result::stream::wait_event(ext, done.cu_event(), cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
    }
    .map_err(driver("ordering the caller's stream after the kernels"))
}

/// The results' dtypes and shapes for inputs of these shapes (dims not determined by them in
/// `given`): what [`run_device`] writes. Needs no device.
pub fn output_shapes(graph: &Graph, shapes: &[Vec<usize>], given: &HashMap<String, i64>) -> Result<Vec<(DType, Vec<usize>)>, CudaError> {
    let env = bind_dims(graph, shapes, given)?;
    output_shapes_in(graph, &env)
}

fn output_shapes_in(graph: &Graph, env: &HashMap<String, i64>) -> Result<Vec<(DType, Vec<usize>)>, CudaError> {
    graph
        .outputs()
        .iter()
        .map(|(_, v)| {
            let ty = &graph.node(*v).ty;
            let shape =
                ty.shape.iter().map(|d| d.eval(env).map(|x| x.max(0) as usize)).collect::<Result<Vec<_>, _>>().map_err(ExecError::from)?;
            Ok((ty.dtype, shape))
        })
        .collect()
}

/// A slice outside its axis is a fault of the program at these dims, reported like the CPU and
/// the interpreter report it (with the slice's source span); other preparation errors are the
/// GPU's limits.
fn slice_fault(e: PrepareError) -> CudaError {
    match e {
        PrepareError::OutOfRange { node, span, axis, start, end, size } => {
            CudaError::Input(ExecError::OutOfRange { node, span, axis, start, end, size: size.max(0) as usize })
        }
        e => CudaError::Prepare(e),
    }
}

/// `map` of a buffer at device address `base` as the driver's 128-byte tensor map
/// (`cuTensorMapEncodeTiled`: 16-bit elements, 128-byte swizzle, zeros outside the tensor).
fn encode_tmap(map: &attn_compiler::schedule::TmaMap, base: u64) -> Result<[u8; 128], CudaError> {
    use cudarc::driver::sys as cu;
    let what = "encoding a TMA tensor map";
    let address = base.checked_add(map.offset_bytes).filter(|a| a % 16 == 0).ok_or_else(|| CudaError::Driver {
        what: what.into(),
        error: format!("the tensor at {base:#x} + {} bytes is not 16-byte aligned", map.offset_bytes),
    })?;
    let rank = map.dims.len();
    if !(2..=5).contains(&rank) || map.strides.len() + 1 != rank || map.boxes.len() != rank {
        return Err(CudaError::Driver { what: what.into(), error: format!("a map of rank {rank} (2 to 5)") });
    }
    let element_strides = [1u32; 5];
    let mut out = cu::CUtensorMap { opaque: [0; 16] };
    // SAFETY: `out` is a writable tensor map; the arrays hold `rank` (strides: `rank - 1`) values;
    // `address` is a device address (the driver only records it).
    let r = unsafe {
        cu::cuTensorMapEncodeTiled(
            &mut out,
            cu::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
            rank as u32,
            address as *mut std::ffi::c_void,
            map.dims.as_ptr(),
            map.strides.as_ptr(),
            map.boxes.as_ptr(),
            element_strides.as_ptr(),
            cu::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            cu::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != cu::CUresult::CUDA_SUCCESS {
        return Err(CudaError::Driver {
            what: what.into(),
            error: format!("{r:?} (dims {:?}, strides {:?}, box {:?})", map.dims, map.strides, map.boxes),
        });
    }
    let mut bytes = [0u8; 128];
    for (chunk, word) in bytes.chunks_exact_mut(8).zip(out.opaque) {
        chunk.copy_from_slice(&word.to_le_bytes());
    }
    Ok(bytes)
}
