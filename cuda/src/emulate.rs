//! A host emulation of the emitted CUDA (tests only): the prelude block of the source is
//! swapped for C++ that runs every CUDA thread of a block as an OS thread (blocks one after
//! another), with barriers for `__syncthreads`, per-warp exchanges for shuffles, and
//! `mma.sync.m16n8k16` computed from its documented fragment layouts. The rest of the source —
//! every kernel as emitted — is compiled unchanged by the host C++ compiler with
//! AddressSanitizer, and driven by a `main` generated from the same [`Prepared`] launch plan
//! the CUDA runtime uses. So indexing, tiling, online softmax, masking, tile skipping, split-KV
//! and the launch arithmetic are all executed and checked against the interpreter without a
//! GPU. What it cannot check: real hardware timing, memory ordering beyond barriers, and the
//! PTX instructions themselves (conversions and `mma` are emulated from their specifications).

use super::host;
use attn_compiler::Compiler;
use crate::render::{CudaProgram, DeviceLimits, PRELUDE_BEGIN, PRELUDE_END, ReadyLaunch, buffer_bytes, launches, render};
use attn_compiler::ir::Graph;
use attn_compiler::schedule::{CudaPolicy, Policy, Prepared, Schedule, prepare, schedule};
use attn_compiler::tensor::Tensor;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// The C++ that replaces the CUDA prelude.
const HOST_PRELUDE: &str = r#"#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <thread>
#include <barrier>
#include <atomic>
#include <vector>
#include <memory>
#define __device__
#define __forceinline__ inline
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(n)
#define ATTNC_DEV static inline
#define ATTNC_KERNEL extern "C"
#define ATTNC_SHARED static
#define ATTNC_DYN_SMEM unsigned char* attnc_smem = attnc_emu::dyn_smem
struct attnc_dim3 { unsigned x = 0, y = 0, z = 0; };
namespace attnc_emu {
struct Warp { std::barrier<>* bar; const unsigned short* p[32]; float f[32]; double d[32]; long long ll[32]; unsigned a[32][4]; unsigned b[32][2]; };
inline attnc_dim3 grid, block;
inline thread_local attnc_dim3 tid, bid;
inline unsigned char* dyn_smem = nullptr;
inline std::barrier<>* block_bar = nullptr;
inline Warp* warps = nullptr;
}
#define threadIdx attnc_emu::tid
#define blockIdx attnc_emu::bid
#define gridDim attnc_emu::grid
#define blockDim attnc_emu::block
#define ATTNC_INF (std::numeric_limits<float>::infinity())
#define ATTNC_NAN (std::numeric_limits<float>::quiet_NaN())
#define ATTNC_DINF (std::numeric_limits<double>::infinity())
#define ATTNC_DNAN (std::numeric_limits<double>::quiet_NaN())
#define ATTNC_LOG2E 1.4426950408889634f
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
static inline double __longlong_as_double(long long u) { double f; std::memcpy(&f, &u, 8); return f; }
ATTNC_DEV float attnc_h2f(u16 h) { _Float16 x; std::memcpy(&x, &h, 2); return (float)x; }
ATTNC_DEV u16 attnc_f2h(float f) { _Float16 x = (_Float16)f; u16 h; std::memcpy(&h, &x, 2); return h; }
ATTNC_DEV float attnc_b2f(u16 h) { return __uint_as_float(((unsigned)h) << 16); }
ATTNC_DEV u16 attnc_f2b(float f) {
  unsigned u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (u16)(u >> 16);
}
ATTNC_DEV float attnc_rh(float x) { return attnc_h2f(attnc_f2h(x)); }
ATTNC_DEV float attnc_rb(float x) { return attnc_b2f(attnc_f2b(x)); }
ATTNC_DEV unsigned attnc_pack_h(float lo, float hi) { return (unsigned)attnc_f2h(lo) | ((unsigned)attnc_f2h(hi) << 16); }
ATTNC_DEV unsigned attnc_pack_b(float lo, float hi) { return (unsigned)attnc_f2b(lo) | ((unsigned)attnc_f2b(hi) << 16); }
ATTNC_DEV unsigned attnc_pack_u16(u16 lo, u16 hi) { return (unsigned)lo | ((unsigned)hi << 16); }
ATTNC_DEV unsigned attnc_ld_u32(const u16* p) { unsigned u; std::memcpy(&u, p, 4); return u; }
static inline attnc_emu::Warp& attnc_emu_warp() { return attnc_emu::warps[attnc_emu::tid.x / 32]; }
static inline int attnc_emu_lane() { return (int)(attnc_emu::tid.x % 32); }
ATTNC_DEV float attnc_shfl_xor(float v, int m) {
  auto& w = attnc_emu_warp(); int l = attnc_emu_lane();
  w.f[l] = v; w.bar->arrive_and_wait(); float r = w.f[l ^ m]; w.bar->arrive_and_wait(); return r;
}
ATTNC_DEV double attnc_shfl_xor_d(double v, int m) {
  auto& w = attnc_emu_warp(); int l = attnc_emu_lane();
  w.d[l] = v; w.bar->arrive_and_wait(); double r = w.d[l ^ m]; w.bar->arrive_and_wait(); return r;
}
ATTNC_DEV long long attnc_shfl_xor_ll(long long v, int m) {
  auto& w = attnc_emu_warp(); int l = attnc_emu_lane();
  w.ll[l] = v; w.bar->arrive_and_wait(); long long r = w.ll[l ^ m]; w.bar->arrive_and_wait(); return r;
}
ATTNC_DEV bool attnc_any(bool p) {
  auto& w = attnc_emu_warp(); int l = attnc_emu_lane();
  w.ll[l] = p ? 1 : 0; w.bar->arrive_and_wait(); bool r = false;
  for (int i = 0; i < 32; ++i) r = r || w.ll[i] != 0;
  w.bar->arrive_and_wait(); return r;
}
ATTNC_DEV double attnc_dmuladd(double a, double b, double c) { volatile double m = a * b; return m + c; }
ATTNC_DEV void attnc_sync() { attnc_emu::block_bar->arrive_and_wait(); }
ATTNC_DEV int attnc_sync_or(int p) {
  static std::atomic<int> acc{0};
  if (p) acc.fetch_or(1);
  attnc_emu::block_bar->arrive_and_wait();
  const int r = acc.load();
  attnc_emu::block_bar->arrive_and_wait();
  if (attnc_emu::tid.x == 0) acc.store(0);
  attnc_emu::block_bar->arrive_and_wait();
  return r;
}
ATTNC_DEV float attnc_rcp_fast(float x) { return 1.0f / x; }
ATTNC_DEV void attnc_syncwarp() { attnc_emu_warp().bar->arrive_and_wait(); }
ATTNC_DEV int attnc_cas(int* p, int expected, int value) {
  __atomic_compare_exchange_n(p, &expected, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); return expected;
}
// mma.sync.m16n8k16.row.col: lane L (g = L / 4, t = L % 4) holds A rows g and g+8, columns
// 2t, 2t+1 (regs 0, 1) and 2t+8, 2t+9 (regs 2, 3); B rows 2t, 2t+1 (reg 0) and 2t+8, 2t+9
// (reg 1) of column g; C/D rows g (0, 1) and g+8 (2, 3), columns 2t, 2t+1. Low half first.
static inline void attnc_emu_mma(float* c, const unsigned* a, const unsigned* b, bool bf) {
  auto& w = attnc_emu_warp(); int l = attnc_emu_lane();
  std::memcpy(w.a[l], a, 16); std::memcpy(w.b[l], b, 8);
  w.bar->arrive_and_wait();
  auto h = [bf](unsigned u, int hi) { u16 x = (u16)(hi ? (u >> 16) : (u & 0xffffu)); return bf ? attnc_b2f(x) : attnc_h2f(x); };
  float A[16][16], B[16][8];
  for (int L = 0; L < 32; ++L) {
    int g = L >> 2, t = L & 3;
    A[g][2 * t] = h(w.a[L][0], 0); A[g][2 * t + 1] = h(w.a[L][0], 1);
    A[g + 8][2 * t] = h(w.a[L][1], 0); A[g + 8][2 * t + 1] = h(w.a[L][1], 1);
    A[g][2 * t + 8] = h(w.a[L][2], 0); A[g][2 * t + 9] = h(w.a[L][2], 1);
    A[g + 8][2 * t + 8] = h(w.a[L][3], 0); A[g + 8][2 * t + 9] = h(w.a[L][3], 1);
    B[2 * t][g] = h(w.b[L][0], 0); B[2 * t + 1][g] = h(w.b[L][0], 1);
    B[2 * t + 8][g] = h(w.b[L][1], 0); B[2 * t + 9][g] = h(w.b[L][1], 1);
  }
  w.bar->arrive_and_wait();
  int g = l >> 2, t = l & 3;
  for (int e = 0; e < 4; ++e) {
    int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
    float acc = c[e];
    for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
    c[e] = acc;
  }
}
ATTNC_DEV void attnc_mma_h(float* c, const unsigned* a, const unsigned* b) { attnc_emu_mma(c, a, b, false); }
// Shared addresses are offsets into the block's dynamic shared memory.
static inline unsigned attnc_saddr(const void* p) { return (unsigned)((const unsigned char*)p - attnc_emu::dyn_smem); }
// ldmatrix.m8n8.x4: lane L addresses row L % 8 of matrix L / 8; reg i gets matrix i's row L / 4,
// columns 2 (L % 4) and +1, or transposed, rows 2 (L % 4) and +1 of column L / 4.
static inline void attnc_emu_ldsm(unsigned* r, unsigned a, bool trans) {
  auto& w = attnc_emu_warp(); int l = attnc_emu_lane();
  w.p[l] = (const u16*)(attnc_emu::dyn_smem + a); w.bar->arrive_and_wait();
  for (int i = 0; i < 4; ++i) {
    u16 lo, hi;
    if (trans) { lo = w.p[8 * i + 2 * (l & 3)][l >> 2]; hi = w.p[8 * i + 2 * (l & 3) + 1][l >> 2]; }
    else { lo = w.p[8 * i + (l >> 2)][2 * (l & 3)]; hi = w.p[8 * i + (l >> 2)][2 * (l & 3) + 1]; }
    r[i] = (unsigned)lo | ((unsigned)hi << 16);
  }
  w.bar->arrive_and_wait();
}
ATTNC_DEV void attnc_ldsm_x4(unsigned* r, unsigned a) { attnc_emu_ldsm(r, a, false); }
ATTNC_DEV void attnc_ldsm_x4_t(unsigned* r, unsigned a) { attnc_emu_ldsm(r, a, true); }
// cp.async emulated as a synchronous copy (the kernels wait and sync before reading anyway).
ATTNC_DEV void attnc_cp16(unsigned dst, const void* src, bool ok) {
  if (ok) std::memcpy(attnc_emu::dyn_smem + dst, src, 16); else std::memset(attnc_emu::dyn_smem + dst, 0, 16);
}
ATTNC_DEV void attnc_cp_commit() {}
ATTNC_DEV void attnc_cp_wait_all() {}
ATTNC_DEV void attnc_cp_wait_1() {}
ATTNC_DEV float attnc_exp2_fast(float x) { return std::exp2(x); }
ATTNC_DEV float attnc_exp_fast(float x) { return std::exp2(x * ATTNC_LOG2E); }
ATTNC_DEV void attnc_mma_b(float* c, const unsigned* a, const unsigned* b) { attnc_emu_mma(c, a, b, true); }
template <class F> static void attnc_emu_launch(unsigned gx, unsigned gy, unsigned gz, unsigned bx, size_t smem, F kernel) {
  attnc_emu::grid = {gx, gy, gz};
  attnc_emu::block = {bx, 1, 1};
  std::vector<unsigned char> dyn(smem > 0 ? smem : 1);
  attnc_emu::dyn_smem = dyn.data();
  std::barrier<> bar(bx);
  attnc_emu::block_bar = &bar;
  std::vector<attnc_emu::Warp> warps(bx / 32);
  std::vector<std::unique_ptr<std::barrier<>>> wbars;
  for (auto& w : warps) { wbars.push_back(std::make_unique<std::barrier<>>(32)); w.bar = wbars.back().get(); }
  attnc_emu::warps = warps.data();
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < bx; ++t) {
    threads.emplace_back([&, t] {
      attnc_emu::tid = {t, 0, 0};
      for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
          for (unsigned x = 0; x < gx; ++x) {
            attnc_emu::bid = {x, y, z};
            kernel();
            bar.arrive_and_wait();
          }
    });
  }
  for (auto& th : threads) th.join();
}
"#;

/// The emitted source with its device prelude replaced by [`HOST_PRELUDE`].
fn host_source(program: &CudaProgram) -> Result<String, String> {
    let src = &program.source;
    let begin = src.find(PRELUDE_BEGIN).ok_or("no prelude begin marker")?;
    let end = src.find(PRELUDE_END).ok_or("no prelude end marker")?;
    Ok(format!("{}{}{}", &src[..begin], HOST_PRELUDE, &src[end + PRELUDE_END.len()..]))
}

/// A prepared run to emulate: the buffers' bytes, the launches, the uploads (inputs and tile
/// tables as (buffer, bytes)) and the buffers to read back.
pub struct Run<'a> {
    /// The prepared run.
    pub prep: &'a Prepared,
    pub buffer_bytes: &'a [usize],
    pub launches: &'a [ReadyLaunch],
    pub uploads: Vec<(usize, Vec<u8>)>,
    pub outputs: &'a [usize],
}

/// Runs a prepared program on the host. Work happens in `dir`. Returns the bytes of each output
/// buffer.
pub fn emulate(program: &CudaProgram, run: &Run, dir: &Path) -> Result<Vec<Vec<u8>>, String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let mut src = host_source(program)?;
    let defines: String = run.prep.defines.iter().map(|(k, v)| format!("#define {k} {v}\n")).collect();
    src = format!("{defines}{src}");
    let _ = writeln!(src, "\nint main(int argc, char** argv) {{\n  if (argc < 2) return 2;\n  std::string dir = argv[1];");
    let _ = writeln!(src, "  std::vector<std::vector<unsigned char>> mem;");
    for bytes in run.buffer_bytes {
        let _ = writeln!(src, "  mem.emplace_back({bytes});");
    }
    for (buf, bytes) in &run.uploads {
        std::fs::write(dir.join(format!("b{buf}.in")), bytes).map_err(|e| e.to_string())?;
        let _ = writeln!(
            src,
            "  {{ FILE* f = std::fopen((dir + \"/b{buf}.in\").c_str(), \"rb\"); if (!f) return 3; if (std::fread(mem[{buf}].data(), 1, {n}, f) != {n}) return 4; std::fclose(f); }}",
            n = bytes.len()
        );
    }
    let mut args: Vec<String> = (0..run.buffer_bytes.len()).map(|b| format!("(void*)mem[{b}].data()")).collect();
    args.extend(run.prep.ints.iter().map(|t| format!("(i64){t}LL")));
    let args = args.join(", ");
    for l in run.launches {
        let _ = writeln!(
            src,
            "  attnc_emu_launch({}, {}, {}, {}, {}, [&] {{ {}({args}); }});",
            l.grid[0], l.grid[1], l.grid[2], l.block[0], l.smem_bytes, l.kernel
        );
    }
    for buf in run.outputs {
        let _ = writeln!(
            src,
            "  {{ FILE* f = std::fopen((dir + \"/b{buf}.out\").c_str(), \"wb\"); if (!f) return 5; std::fwrite(mem[{buf}].data(), 1, mem[{buf}].size(), f); std::fclose(f); }}"
        );
    }
    let _ = writeln!(src, "  return 0;\n}}");
    src = format!("#include <string>\n{src}");
    let cpp = dir.join("program.cpp");
    let exe = dir.join("program");
    std::fs::write(&cpp, &src).map_err(|e| e.to_string())?;
    let out = Command::new("g++")
        .args([
            "-std=c++20",
            "-O1",
            "-g0",
            "-pthread",
            "-fsanitize=address",
            "-fno-omit-frame-pointer",
            "-Wno-unknown-pragmas",
            "-fno-strict-aliasing",
            "-o",
        ])
        .arg(&exe)
        .arg(&cpp)
        .output()
        .map_err(|e| format!("running g++: {e}"))?;
    if !out.status.success() {
        return Err(format!("g++ failed on {}:\n{}", cpp.display(), String::from_utf8_lossy(&out.stderr)));
    }
    let mut child = Command::new(&exe).arg(dir).env("ASAN_OPTIONS", "detect_leaks=0").spawn().map_err(|e| e.to_string())?;
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            break s;
        }
        if start.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            return Err(format!("{} did not finish in 300 s (a barrier deadlock?)", exe.display()));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if !status.success() {
        return Err(format!("{} failed ({status}); AddressSanitizer's report is above", exe.display()));
    }
    run.outputs.iter().map(|b| std::fs::read(dir.join(format!("b{b}.out"))).map_err(|e| e.to_string())).collect()
}

/// Whether a host C++20 compiler is available (`g++`).
fn have_compiler() -> bool {
    Command::new("g++").arg("--version").output().is_ok_and(|o| o.status.success())
}

/// Whether the emulation can run: `Ok(true)` with a host C++20 compiler (`g++`); without one,
/// `Ok(false)` after printing why (the caller skips), except under `CI=true`, where its absence is
/// an error.
pub fn compiler_or_skip(test: &str) -> Result<bool, String> {
    if have_compiler() {
        return Ok(true);
    }
    if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
        return Err(format!("{test}: g++ (C++20) is required in CI to emulate the CUDA kernels"));
    }
    eprintln!("{test}: skipped: no g++ to emulate the CUDA kernels on the host");
    Ok(false)
}

/// The device policy of the emulation (a small device: few SMs, so decodes split little;
/// `ATTNC_CUDA_MMA_ROWS` as on the device).
fn policy() -> Policy {
    Policy::Cuda(CudaPolicy {
        sm_count: 2,
        max_smem_per_block: 232_448,
        mma_rows: super::mma_rows_knob(),
        simt_backward: super::simt_backward_knob(),
    })
}

/// A graph as the device runs it: scheduled as written, or compiled by the pipeline.
pub enum Device<'a> {
    /// Scheduled without optimisation.
    AsWritten(&'a Graph),
    /// Optimised and scheduled by the pipeline.
    Compiled(&'a Graph),
}

pub fn device_graph(d: Device) -> Result<Schedule, String> {
    match d {
        Device::AsWritten(g) => schedule(g, &policy()).map_err(|e| e.to_string()),
        Device::Compiled(g) => Compiler::new(policy()).plan(g).map(|p| p.schedule).map_err(|e| e.to_string()),
    }
}

/// Runs a schedule's kernels on the host on `inputs` (in parameter order) with dims `env`;
/// returns the outputs in output order.
pub fn emulate_schedule(
    s: &Result<Schedule, String>,
    inputs: &[Tensor],
    env: &HashMap<String, i64>,
    dir: &Path,
) -> Result<Vec<Tensor>, String> {
    let s = s.as_ref().map_err(Clone::clone)?;
    let program = render(s).map_err(|e| e.to_string())?;
    let prep = prepare(s, env, &policy()).map_err(|e| e.to_string())?;
    let bytes = buffer_bytes(s, &prep).map_err(|e| e.to_string())?;
    let ready = launches(&program, s, &prep, &DeviceLimits { max_smem_per_block: 232_448 }).map_err(|e| e.to_string())?;
    let mut uploads: Vec<(usize, Vec<u8>)> = s.params.iter().zip(inputs).map(|(b, t)| (*b, host::to_bytes(t))).collect();
    uploads.extend(prep.tables.iter().cloned());
    // The fault record is read back after the outputs (the buffers start zeroed).
    let read: Vec<usize> = s.outputs.iter().copied().chain(s.fault).collect();
    let mut raw = emulate(&program, &Run { prep: &prep, buffer_bytes: &bytes, launches: &ready, uploads, outputs: &read }, dir)?;
    if s.fault.is_some() {
        let record = raw.pop().unwrap_or_default();
        if let Some(e) = s.fault_error(super::host::fault_words(&record)) {
            return Err(e.to_string());
        }
    }
    s.outputs
        .iter()
        .zip(raw)
        .map(|(b, raw)| host::from_bytes(s.buffers[*b].dtype, output_shape(s, *b, env)?, &raw).map_err(|e| e.to_string()))
        .collect()
}

/// The (flat) shape of an output buffer under `env`.
fn output_shape(s: &Schedule, buf: usize, env: &HashMap<String, i64>) -> Result<Vec<usize>, String> {
    let elems = attn_compiler::schedule::eval(&s.buffers[buf].elems, env).map_err(|e| e.to_string())?;
    Ok(vec![usize::try_from(elems).map_err(|e| e.to_string())?])
}
