//! A host emulation of the emitted CUDA, for the tests of every target: the prelude block of the
//! source is swapped for C++ that runs every CUDA thread of a block as a fiber of one OS thread
//! (blocks one after another), switched only where a thread waits: at `__syncthreads` and at
//! each warp exchange (shuffles, votes, `ldmatrix`, and `mma.sync.m16n8k16`, computed from its
//! documented fragment layouts). The rest of the source — every kernel as emitted — is compiled
//! unchanged by the host C++ compiler with AddressSanitizer, and driven by a generic `main`
//! that reads the [`Prepared`] launch plan the CUDA runtime uses (buffers, integer table,
//! launches) from a file. So indexing, tiling, online softmax, masking, tile skipping, split-KV
//! and the launch arithmetic are all executed and checked against the interpreter without a
//! GPU. What it cannot check: real hardware timing, memory ordering beyond barriers, and the
//! PTX instructions themselves (conversions and `mma` are emulated from their specifications).
//!
//! A program is compiled once per source and `-D` defines ([`binary`]): runs at other sizes or on
//! other inputs reuse it, in this process and (by content hash, in the temporary directory)
//! in later ones.

use super::host;
use crate::nvrtc::content_hash;
use crate::render::{CudaProgram, DeviceLimits, PRELUDE_BEGIN, PRELUDE_END, ReadyLaunch, buffer_bytes, launches, render};
use attn_compiler::Compiler;
use attn_compiler::ir::Graph;
use attn_compiler::schedule::{CudaPolicy, Policy, Prepared, Schedule};
use attn_compiler::tensor::Tensor;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The C++ that replaces the CUDA prelude.
const HOST_PRELUDE: &str = r#"#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <sys/mman.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define ATTNC_EMU_UNPOISON(p, n) __asan_unpoison_memory_region((p), (n))
#else
#define ATTNC_EMU_UNPOISON(p, n) ((void)0)
#endif
#define __device__
#define __forceinline__ inline
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(n)
#define ATTNC_DEV static inline
#define ATTNC_KERNEL extern "C"
#define ATTNC_SHARED static
#define ATTNC_DYN_SMEM unsigned char* attnc_smem = attnc_emu::dyn_smem
struct attnc_dim3 { unsigned x = 0, y = 0, z = 0; };
// Every CUDA thread of a block is a fiber of one OS thread, switched only where it waits at a
// barrier (__syncthreads, and each warp exchange); blocks run one after another.
namespace attnc_emu {
struct Barrier { unsigned n = 0, count = 0; unsigned long gen = 0; };
struct Fiber { void* sp = nullptr; unsigned char* stack = nullptr; attnc_dim3 tid, bid; const Barrier* wait = nullptr; unsigned long gen = 0; bool done = false, yielded = false; };
struct Warp { Barrier bar; const unsigned short* p[32]; float f[32]; double d[32]; long long ll[32]; float fa[32][8]; float fb[32][4]; };
inline attnc_dim3 grid, block;
inline unsigned char* dyn_smem = nullptr;
inline Barrier block_bar;
inline Warp* warps = nullptr;
inline Fiber* fibers = nullptr;
inline unsigned nfibers = 0, cur = 0;
inline void* sched_sp = nullptr;
inline void (*body)(void*) = nullptr;
inline void* body_arg = nullptr;
#if defined(__SANITIZE_ADDRESS__)
inline const void* sched_stack = nullptr;
inline size_t sched_stack_size = 0;
#endif
const size_t STACK = 1 << 20;
}
#define threadIdx (attnc_emu::fibers[attnc_emu::cur].tid)
#define blockIdx (attnc_emu::fibers[attnc_emu::cur].bid)
#define gridDim attnc_emu::grid
#define blockDim attnc_emu::block
// The context switch: callee-saved registers on the old stack, then the new stack's.
extern "C" void attnc_emu_switch(void** from, void* to);
#if defined(__x86_64__)
asm(".text\n.globl attnc_emu_switch\n.type attnc_emu_switch,@function\nattnc_emu_switch:\n"
    " pushq %rbp\n pushq %rbx\n pushq %r12\n pushq %r13\n pushq %r14\n pushq %r15\n"
    " movq %rsp, (%rdi)\n movq %rsi, %rsp\n"
    " popq %r15\n popq %r14\n popq %r13\n popq %r12\n popq %rbx\n popq %rbp\n ret\n");
#elif defined(__aarch64__)
asm(".text\n.globl attnc_emu_switch\n.type attnc_emu_switch,%function\nattnc_emu_switch:\n"
    " sub sp, sp, #176\n stp x19, x20, [sp, #0]\n stp x21, x22, [sp, #16]\n stp x23, x24, [sp, #32]\n stp x25, x26, [sp, #48]\n"
    " stp x27, x28, [sp, #64]\n stp x29, x30, [sp, #80]\n stp d8, d9, [sp, #96]\n stp d10, d11, [sp, #112]\n stp d12, d13, [sp, #128]\n"
    " stp d14, d15, [sp, #144]\n mov x9, sp\n str x9, [x0]\n mov sp, x1\n"
    " ldp x19, x20, [sp, #0]\n ldp x21, x22, [sp, #16]\n ldp x23, x24, [sp, #32]\n ldp x25, x26, [sp, #48]\n"
    " ldp x27, x28, [sp, #64]\n ldp x29, x30, [sp, #80]\n ldp d8, d9, [sp, #96]\n ldp d10, d11, [sp, #112]\n ldp d12, d13, [sp, #128]\n"
    " ldp d14, d15, [sp, #144]\n add sp, sp, #176\n ret\n");
#else
#error "the CUDA emulation switches fibers on x86-64 and AArch64 only"
#endif
namespace attnc_emu {
// To fiber `f` from the scheduler, and back.
static inline void enter(unsigned f) {
  cur = f;
#if defined(__SANITIZE_ADDRESS__)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, fibers[f].stack, STACK);
  attnc_emu_switch(&sched_sp, fibers[f].sp);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  attnc_emu_switch(&sched_sp, fibers[f].sp);
#endif
}
static inline void leave() {
  Fiber& me = fibers[cur];
#if defined(__SANITIZE_ADDRESS__)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(me.done ? nullptr : &fake, sched_stack, sched_stack_size);
  attnc_emu_switch(&me.sp, sched_sp);
  __sanitizer_finish_switch_fiber(fake, &sched_stack, &sched_stack_size);
#else
  attnc_emu_switch(&me.sp, sched_sp);
#endif
}
static void entry() {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(nullptr, &sched_stack, &sched_stack_size);
#endif
  body(body_arg);
  fibers[cur].done = true;
  leave();
  __builtin_trap();
}
// Holds this fiber until `b` completes its current phase.
static inline void until_next_phase(Barrier& b) {
  Fiber& me = fibers[cur];
  me.wait = &b; me.gen = b.gen;
  leave();
}
// Arrives at `b` without waiting.
static inline void arrive(Barrier& b) { if (++b.count == b.n) { b.count = 0; ++b.gen; } }
// Arrives at `b` and waits until all `b.n` fibers have.
static inline void wait(Barrier& b) {
  const unsigned long gen = b.gen;
  arrive(b);
  if (b.gen == gen) until_next_phase(b);
}
// Lets every other fiber run on until it waits; this one goes on then.
static inline void yield() { fibers[cur].yielded = true; leave(); }
// Runs `n` fibers of `fn(arg)` to the end, switching at barriers; a round in which no fiber can
// go on is a deadlock. Each round runs the fibers from the last thread down, so that warpgroup 0
// (the warp-specialised block's producer) runs after its consumers: one that read a stage
// without waiting for its copies would read it before them.
static void run(unsigned n, void (*fn)(void*), void* arg) {
  body = fn; body_arg = arg; nfibers = n;
  fibers = new Fiber[n];
  for (unsigned t = 0; t < n; ++t) {
    unsigned char* s = (unsigned char*)mmap(nullptr, STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (s == MAP_FAILED) { std::fprintf(stderr, "emulation: cannot map a fiber stack\n"); std::exit(7); }
    // A fiber's frames keep their redzones when it ends without returning: a new stack at the
    // same address starts clean.
    ATTNC_EMU_UNPOISON(s, STACK);
    mprotect(s, 4096, PROT_NONE);  // a guard page below the stack
    void** top = (void**)(s + STACK);
    *--top = nullptr;                 // entry's return address: never used
    *--top = (void*)&entry;           // where the first switch returns to
    for (int r = 0; r < 6; ++r) *--top = nullptr;  // callee-saved registers
    fibers[t].stack = s; fibers[t].sp = top; fibers[t].tid = {t, 0, 0};
  }
  unsigned live = n;
  while (live > 0) {
    bool moved = false;
    for (unsigned t = n; t-- > 0;) {
      Fiber& f = fibers[t];
      if (f.done || f.yielded || (f.wait && f.wait->gen == f.gen)) continue;
      f.wait = nullptr;
      enter(t);
      moved = true;
      if (f.done) --live;
    }
    // Fibers that yielded go on once no other can.
    for (unsigned t = n; !moved && t-- > 0;) {
      Fiber& f = fibers[t];
      if (!f.yielded) continue;
      f.yielded = false;
      enter(t);
      moved = true;
      if (f.done) --live;
    }
    if (!moved) { std::fprintf(stderr, "emulation: deadlock, %u threads wait at a barrier\n", live); std::exit(6); }
  }
  for (unsigned t = 0; t < n; ++t) { ATTNC_EMU_UNPOISON(fibers[t].stack, STACK); munmap(fibers[t].stack, STACK); }
  delete[] fibers; fibers = nullptr;
}
}
#define ATTNC_INF __builtin_inff()
#define ATTNC_NAN __builtin_nanf("")
#define ATTNC_DINF __builtin_inf()
#define ATTNC_DNAN __builtin_nan("")
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
static inline attnc_emu::Warp& attnc_emu_warp() { return attnc_emu::warps[threadIdx.x / 32]; }
static inline int attnc_emu_lane() { return (int)(threadIdx.x % 32); }
ATTNC_DEV float attnc_shfl_xor(float v, int m) {
  auto& w = attnc_emu_warp(); int l = attnc_emu_lane();
  w.f[l] = v; attnc_emu::wait(w.bar); float r = w.f[l ^ m]; attnc_emu::wait(w.bar); return r;
}
ATTNC_DEV double attnc_shfl_xor_d(double v, int m) {
  auto& w = attnc_emu_warp(); int l = attnc_emu_lane();
  w.d[l] = v; attnc_emu::wait(w.bar); double r = w.d[l ^ m]; attnc_emu::wait(w.bar); return r;
}
ATTNC_DEV long long attnc_shfl_xor_ll(long long v, int m) {
  auto& w = attnc_emu_warp(); int l = attnc_emu_lane();
  w.ll[l] = v; attnc_emu::wait(w.bar); long long r = w.ll[l ^ m]; attnc_emu::wait(w.bar); return r;
}
ATTNC_DEV int attnc_warp_uniform(int v) {
  auto& w = attnc_emu_warp(); int l = attnc_emu_lane();
  w.ll[l] = v; attnc_emu::wait(w.bar); const int r = (int)w.ll[0]; attnc_emu::wait(w.bar); return r;
}
ATTNC_DEV bool attnc_any(bool p) {
  auto& w = attnc_emu_warp(); int l = attnc_emu_lane();
  w.ll[l] = p ? 1 : 0; attnc_emu::wait(w.bar); bool r = false;
  for (int i = 0; i < 32; ++i) r = r || w.ll[i] != 0;
  attnc_emu::wait(w.bar); return r;
}
ATTNC_DEV double attnc_dmuladd(double a, double b, double c) { volatile double m = a * b; return m + c; }
ATTNC_DEV void attnc_sync() { attnc_emu::wait(attnc_emu::block_bar); }
ATTNC_DEV int attnc_sync_or(int p) {
  static int acc = 0;
  if (p) acc = 1;
  attnc_emu::wait(attnc_emu::block_bar);
  const int r = acc;
  attnc_emu::wait(attnc_emu::block_bar);
  if (threadIdx.x == 0) acc = 0;
  attnc_emu::wait(attnc_emu::block_bar);
  return r;
}
ATTNC_DEV float attnc_rcp_fast(float x) { return 1.0f / x; }
ATTNC_DEV void attnc_syncwarp() { attnc_emu::wait(attnc_emu_warp().bar); }
// Blocks run one after another on one OS thread: an atomic add is an add.
ATTNC_DEV void attnc_red_add(float* p, float v) { *p += v; }
ATTNC_DEV void attnc_red_add4(float* p, float a, float b, float c, float d) { p[0] += a; p[1] += b; p[2] += c; p[3] += d; }
ATTNC_DEV int attnc_cas(int* p, int expected, int value) {
  __atomic_compare_exchange_n(p, &expected, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); return expected;
}
// mma.sync.m16n8k16.row.col: lane L (g = L / 4, t = L % 4) holds A rows g and g+8, columns
// 2t, 2t+1 (regs 0, 1) and 2t+8, 2t+9 (regs 2, 3); B rows 2t, 2t+1 (reg 0) and 2t+8, 2t+9
// (reg 1) of column g; C/D rows g (0, 1) and g+8 (2, 3), columns 2t, 2t+1. Low half first.
static inline void attnc_emu_mma(float* c, const unsigned* a, const unsigned* b, bool bf) {
  auto& w = attnc_emu_warp(); int l = attnc_emu_lane();
  auto h = [bf](unsigned u, int hi) { u16 x = (u16)(hi ? (u >> 16) : (u & 0xffffu)); return bf ? attnc_b2f(x) : attnc_h2f(x); };
  for (int r = 0; r < 4; ++r) { w.fa[l][2 * r] = h(a[r], 0); w.fa[l][2 * r + 1] = h(a[r], 1); }
  for (int r = 0; r < 2; ++r) { w.fb[l][2 * r] = h(b[r], 0); w.fb[l][2 * r + 1] = h(b[r], 1); }
  attnc_emu::wait(w.bar);
  // A[row][k] is lane (row % 8) * 4 + (k % 8) / 2, register (row >= 8) + 2 (k >= 8), half k % 2;
  // B[k][col] is lane col * 4 + (k % 8) / 2, register k >= 8, half k % 2.
  int g = l >> 2, t = l & 3;
  float out[4];
  for (int e = 0; e < 4; ++e) {
    int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
    float acc = c[e];
    for (int k = 0; k < 16; ++k) {
      float av = w.fa[(row & 7) * 4 + (k & 7) / 2][2 * ((row >= 8) + 2 * (k >= 8)) + (k & 1)];
      float bv = w.fb[col * 4 + (k & 7) / 2][2 * (k >= 8) + (k & 1)];
      acc += av * bv;
    }
    out[e] = acc;
  }
  attnc_emu::wait(w.bar);
  for (int e = 0; e < 4; ++e) c[e] = out[e];
}
ATTNC_DEV void attnc_mma_h(float* c, const unsigned* a, const unsigned* b) { attnc_emu_mma(c, a, b, false); }
// Shared addresses are offsets into the block's dynamic shared memory.
static inline unsigned attnc_saddr(const void* p) { return (unsigned)((const unsigned char*)p - attnc_emu::dyn_smem); }
// ldmatrix.m8n8.x4: lane L addresses row L % 8 of matrix L / 8; reg i gets matrix i's row L / 4,
// columns 2 (L % 4) and +1, or transposed, rows 2 (L % 4) and +1 of column L / 4.
static inline void attnc_emu_ldsm(unsigned* r, unsigned a, bool trans) {
  auto& w = attnc_emu_warp(); int l = attnc_emu_lane();
  w.p[l] = (const u16*)(attnc_emu::dyn_smem + a); attnc_emu::wait(w.bar);
  for (int i = 0; i < 4; ++i) {
    u16 lo, hi;
    if (trans) { lo = w.p[8 * i + 2 * (l & 3)][l >> 2]; hi = w.p[8 * i + 2 * (l & 3) + 1][l >> 2]; }
    else { lo = w.p[8 * i + (l >> 2)][2 * (l & 3)]; hi = w.p[8 * i + (l >> 2)][2 * (l & 3) + 1]; }
    r[i] = (unsigned)lo | ((unsigned)hi << 16);
  }
  attnc_emu::wait(w.bar);
}
ATTNC_DEV void attnc_ldsm_x4(unsigned* r, unsigned a) { attnc_emu_ldsm(r, a, false); }
ATTNC_DEV void attnc_ldsm_x4_t(unsigned* r, unsigned a) { attnc_emu_ldsm(r, a, true); }
// cp.async, as late as the rules allow: a copy's 16 bytes are read at its issue and land in
// shared memory only at the cp.async.wait_group that retires its commit group, after the waiting
// thread has let every other thread run on until it waits too (attnc_emu::yield). So a thread
// that reads a tile without the wait and the barrier reads it before the copies.
namespace attnc_emu {
struct Cp { unsigned dst; unsigned group; unsigned char bytes[16]; };
struct CpQueue { Cp cps[512]; unsigned len = 0, next = 1; };
inline CpQueue* cpq = nullptr;  // one per thread of the block
}
ATTNC_DEV void attnc_cp16(unsigned dst, const void* src, bool ok) {
  attnc_emu::CpQueue& q = attnc_emu::cpq[attnc_emu::cur];
  if (q.len == 512) { std::fprintf(stderr, "emulation: more than 512 cp.async copies in flight\n"); std::abort(); }
  attnc_emu::Cp& c = q.cps[q.len++];
  c.dst = dst; c.group = 0;
  if (ok) std::memcpy(c.bytes, src, 16); else std::memset(c.bytes, 0, 16);
}
ATTNC_DEV void attnc_cp_commit() {
  attnc_emu::CpQueue& q = attnc_emu::cpq[attnc_emu::cur];
  for (unsigned i = 0; i < q.len; ++i) if (q.cps[i].group == 0) q.cps[i].group = q.next;
  ++q.next;
}
// Lands every copy of the commit groups before the newest `left` (uncommitted ones too: they
// end in a commit before any wait in the kernels).
static inline void attnc_emu_cp_wait(unsigned left) {
  attnc_emu::CpQueue& q = attnc_emu::cpq[attnc_emu::cur];
  if (q.len == 0) return;
  attnc_emu::yield();
  const unsigned keep_from = q.next > left ? q.next - left : 0;
  unsigned kept = 0;
  for (unsigned i = 0; i < q.len; ++i) {
    attnc_emu::Cp& c = q.cps[i];
    if (c.group != 0 && c.group >= keep_from) { if (kept != i) q.cps[kept] = c; ++kept; continue; }
    std::memcpy(attnc_emu::dyn_smem + c.dst, c.bytes, 16);
  }
  q.len = kept;
}
ATTNC_DEV void attnc_cp_wait_all() { attnc_emu_cp_wait(0); }
ATTNC_DEV void attnc_cp_wait_1() { attnc_emu_cp_wait(1); }
ATTNC_DEV float attnc_exp2_fast(float x) { return std::exp2(x); }
ATTNC_DEV float attnc_exp_fast(float x) { return std::exp2(x * ATTNC_LOG2E); }
ATTNC_DEV void attnc_mma_b(float* c, const unsigned* a, const unsigned* b) { attnc_emu_mma(c, a, b, true); }
// Hopper's warpgroup products (prelude: attnc_wg_*), emulated from the PTX ISA's matrix
// descriptor and canonical layouts (the 128-byte swizzle only: address bits 4-6 XOR bits 7-9)
// when a test defines ATTNC_WGMMA 1. Each thread forms its own accumulators: A from shared
// memory (K-major) or from its warp's registers (the mma.sync A layout, exchanged), B from
// shared memory, K-major or (trans) MN-major.
// The products are asynchronous, as on the device: an issued product is formed at the
// `wgmma.wait_group` that retires its commit group (attnc_wg_wait0/1), not before. Until then
// its accumulators read NaN (reading them early is undefined on the device) and a write to
// them is lost; its A registers are taken by value at the issue (PTX registers the code no
// longer names); its shared-memory operands are read both at the issue and at the wait, and
// must not have changed in between (the device reads them at some point between the two).
// A product still in flight when its thread's block ends is an error.
#ifndef ATTNC_WGMMA
#define ATTNC_WGMMA 0
#endif
static inline unsigned long long attnc_wg_desc(unsigned addr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((addr >> 4) & 0x3fff) | ((unsigned long long)((lbo >> 4) & 0x3fff) << 16)
       | ((unsigned long long)((sbo >> 4) & 0x3fff) << 32) | (1ull << 62);
}
ATTNC_DEV void attnc_wg_fence() {}
ATTNC_DEV void attnc_fence_proxy() {}
template <int N> static inline void attnc_wg_hold(float*) {}
template <int N> static inline void attnc_wg_keep(unsigned*) {}
// The shared byte address of element (mn, k) of an operand: K-major, 8-row groups `sbo` apart,
// rows of 128 bytes; MN-major, 64-element groups `lbo` apart, 8-row (k) groups `sbo` apart.
static inline unsigned attnc_emu_wg_addr(unsigned long long desc, int mn, int k, bool mn_major) {
  if ((desc >> 62) != 1 || ((desc >> 49) & 7) != 0) { std::fprintf(stderr, "emulated wgmma: only 128-byte swizzled canonical layouts\n"); std::abort(); }
  const unsigned start = (unsigned)(desc & 0x3fff) << 4, lbo = (unsigned)((desc >> 16) & 0x3fff) << 4, sbo = (unsigned)((desc >> 32) & 0x3fff) << 4;
  const unsigned a = mn_major ? start + (mn / 64) * lbo + (mn % 64) * 2 + (k % 8) * 128 + (k / 8) * sbo
                              : start + (mn / 8) * sbo + (mn % 8) * 128 + k * 2;
  return a ^ (((a >> 7) & 7) << 4);
}
// This thread's part of the product A · B (no accumulator): `out[n / 2]`. `a`: the warp's A
// registers (every lane of the warp calls this together), or null for A in shared memory.
static inline void attnc_emu_wg_product(float* out, int n, const unsigned* a, unsigned long long da, unsigned long long db, bool trans_b, bool bf) {
  auto& w = attnc_emu_warp(); int l = attnc_emu_lane();
  auto h = [bf](u16 x) { return bf ? attnc_b2f(x) : attnc_h2f(x); };
  auto ld = [&](unsigned addr) { u16 x; std::memcpy(&x, attnc_emu::dyn_smem + addr, 2); return h(x); };
  if (a) {
    for (int r = 0; r < 4; ++r) { w.fa[l][2 * r] = h((u16)(a[r] & 0xffffu)); w.fa[l][2 * r + 1] = h((u16)(a[r] >> 16)); }
    attnc_emu::wait(w.bar);
  }
  const int wg = (int)(threadIdx.x >> 5) & 3, g = l >> 2, t = l & 3;
  for (int i = 0; i < n / 2; ++i) {
    const int row = g + 8 * ((i & 3) >> 1), col = 8 * (i >> 2) + 2 * t + (i & 1);
    float acc = 0.0f;
    for (int k = 0; k < 16; ++k) {
      const float av = a ? w.fa[(row & 7) * 4 + (k & 7) / 2][2 * ((row >= 8) + 2 * (k >= 8)) + (k & 1)] : ld(attnc_emu_wg_addr(da, 16 * wg + row, k, false));
      acc += av * ld(attnc_emu_wg_addr(db, col, k, trans_b));
    }
    out[i] = acc;
  }
  if (a) attnc_emu::wait(w.bar);
}
namespace attnc_emu {
// A product in flight: its operands, the accumulators it was issued on (`first`: no earlier
// product in flight had them; `shadow` then keeps their values), its commit group (0: not yet
// committed) and its product as formed at the issue.
struct WgOp { float* d; int n; bool has_a; unsigned a[4]; unsigned long long da, db; bool trans, bf; int scale; bool first; unsigned group; float shadow[64]; float early[64]; };
struct WgQueue { WgOp ops[64]; unsigned len = 0, groups = 0, next = 1; };
inline WgQueue* wg = nullptr;  // one per thread of the block
}
static inline void attnc_emu_wg(float* d, int n, const unsigned* a, unsigned long long da, unsigned long long db, bool trans_b, int scale, bool bf) {
  attnc_emu::WgQueue& q = attnc_emu::wg[attnc_emu::cur];
  if (q.len == 64) { std::fprintf(stderr, "emulated wgmma: more than 64 products in flight\n"); std::abort(); }
  attnc_emu::WgOp& op = q.ops[q.len++];
  op.d = d; op.n = n; op.has_a = a != nullptr; op.da = da; op.db = db; op.trans = trans_b; op.bf = bf; op.scale = scale; op.group = 0;
  if (a) std::memcpy(op.a, a, sizeof op.a);
  op.first = true;
  for (unsigned o = 0; o + 1 < q.len; ++o) if (q.ops[o].d == d) op.first = false;
  if (op.first) for (int i = 0; i < n / 2; ++i) { op.shadow[i] = d[i]; d[i] = ATTNC_NAN; }
  attnc_emu_wg_product(op.early, n, a ? op.a : nullptr, da, db, trans_b, bf);
}
ATTNC_DEV void attnc_wg_commit() {
  attnc_emu::WgQueue& q = attnc_emu::wg[attnc_emu::cur];
  bool any = false;
  for (unsigned o = 0; o < q.len; ++o) if (q.ops[o].group == 0) { q.ops[o].group = q.next; any = true; }
  if (any) { ++q.next; ++q.groups; }
}
// Retires the oldest commit groups until at most `left` are in flight.
static inline void attnc_emu_wg_wait(unsigned left) {
  attnc_emu::WgQueue& q = attnc_emu::wg[attnc_emu::cur];
  while (q.groups > left) {
    const unsigned group = q.ops[0].group;
    unsigned kept = 0;
    for (unsigned o = 0; o < q.len; ++o) {
      attnc_emu::WgOp& op = q.ops[o];
      if (op.group != group) { if (kept != o) q.ops[kept] = op; ++kept; continue; }
      float late[64];
      attnc_emu_wg_product(late, op.n, op.has_a ? op.a : nullptr, op.da, op.db, op.trans, op.bf);
      if (std::memcmp(late, op.early, sizeof(float) * (op.n / 2)) != 0) {
        std::fprintf(stderr, "emulated wgmma: a shared-memory operand changed while its product was in flight (thread %u)\n", attnc_emu::cur);
        std::abort();
      }
      if (op.first) for (int i = 0; i < op.n / 2; ++i) op.d[i] = op.shadow[i];
      for (int i = 0; i < op.n / 2; ++i) op.d[i] = op.scale ? op.d[i] + late[i] : late[i];
    }
    q.len = kept;
    --q.groups;
  }
}
ATTNC_DEV void attnc_wg_wait0() { attnc_emu_wg_wait(0); }
ATTNC_DEV void attnc_wg_wait1() { attnc_emu_wg_wait(1); }
// At the end of a block: nothing may be left in flight.
static inline void attnc_emu_wg_done() {
  if (attnc_emu::wg && attnc_emu::wg[attnc_emu::cur].len != 0) {
    std::fprintf(stderr, "emulated wgmma: thread %u ended its block with %u products in flight\n", attnc_emu::cur, attnc_emu::wg[attnc_emu::cur].len);
    std::abort();
  }
}
ATTNC_DEV void attnc_wg_ss_h32(float* d, unsigned long long da, unsigned long long db, int scale) { attnc_emu_wg(d, 32, nullptr, da, db, false, scale, false); }
ATTNC_DEV void attnc_wg_ss_b32(float* d, unsigned long long da, unsigned long long db, int scale) { attnc_emu_wg(d, 32, nullptr, da, db, false, scale, true); }
ATTNC_DEV void attnc_wg_ss_h64(float* d, unsigned long long da, unsigned long long db, int scale) { attnc_emu_wg(d, 64, nullptr, da, db, false, scale, false); }
ATTNC_DEV void attnc_wg_ss_b64(float* d, unsigned long long da, unsigned long long db, int scale) { attnc_emu_wg(d, 64, nullptr, da, db, false, scale, true); }
ATTNC_DEV void attnc_wg_rs_h64_t(float* d, const unsigned* a, unsigned long long db, int scale) { attnc_emu_wg(d, 64, a, 0, db, true, scale, false); }
ATTNC_DEV void attnc_wg_rs_b64_t(float* d, const unsigned* a, unsigned long long db, int scale) { attnc_emu_wg(d, 64, a, 0, db, true, scale, true); }
ATTNC_DEV void attnc_wg_rs_h128_t(float* d, const unsigned* a, unsigned long long db, int scale) { attnc_emu_wg(d, 128, a, 0, db, true, scale, false); }
ATTNC_DEV void attnc_wg_rs_b128_t(float* d, const unsigned* a, unsigned long long db, int scale) { attnc_emu_wg(d, 128, a, 0, db, true, scale, true); }
// The warp-specialised block's barriers. An mbarrier (kept beside shared memory, by its
// address) is a barrier of `n` arrivals whose phase parity is its generation's: a wait for
// parity `p` holds the fiber while the phase of that parity is the current one. Named barriers
// (ids 1-15) count `n` arrivals, of which `bar.sync` waits for the phase to end and `bar.arrive`
// does not. Both start over with each block, as on the device.
namespace attnc_emu {
struct MBar { unsigned addr; Barrier b; long long tx; };
inline MBar mbars[32];
inline unsigned nmbars = 0;
inline Barrier named[16];
inline long long barrier_block = -1;  // the block whose barriers these are
static inline MBar* find_mbar(unsigned a) {
  for (unsigned i = 0; i < nmbars; ++i) if (mbars[i].addr == a) return &mbars[i];
  return nullptr;
}
static inline MBar& mbar_at(unsigned a) {
  if (MBar* m = find_mbar(a)) return *m;
  std::fprintf(stderr, "emulation: mbarrier at shared address %u used before its init\n", a); std::abort();
}
static inline Barrier& mbar(unsigned a) { return mbar_at(a).b; }
// A phase completes once all its arrivals are in and no transaction bytes are pending.
static inline void mbar_complete(MBar& m) {
  if (m.b.count == m.b.n && m.tx == 0) { m.b.count = 0; ++m.b.gen; }
}
static inline void mbar_arrive(unsigned a) { MBar& m = mbar_at(a); ++m.b.count; mbar_complete(m); }
static inline Barrier& named_bar(int id, int n) {
  if (id <= 0 || id >= 16 || n <= 0 || n % 32 != 0) { std::fprintf(stderr, "emulation: named barrier %d of %d threads\n", id, n); std::abort(); }
  Barrier& b = named[id];
  if (b.count != 0 && b.n != (unsigned)n) { std::fprintf(stderr, "emulation: named barrier %d used with %u and %d threads\n", id, b.n, n); std::abort(); }
  b.n = (unsigned)n;
  return b;
}
}
ATTNC_DEV void attnc_mbar_init(unsigned a, unsigned n) {
  using namespace attnc_emu;
  if (MBar* m = find_mbar(a)) { m->b = Barrier{n}; m->tx = 0; return; }
  if (nmbars == 32) { std::fprintf(stderr, "emulation: more than 32 mbarriers\n"); std::abort(); }
  mbars[nmbars++] = MBar{a, Barrier{n}, 0};
}
ATTNC_DEV void attnc_mbar_arrive(unsigned a) { attnc_emu::mbar_arrive(a); }
// The arrival once this thread's copies have landed: they land as late as at a wait (after every
// other thread has run on until it waits), then the thread arrives. A consumer that read the
// stage before the barrier's phase completed would read it before the copies.
ATTNC_DEV void attnc_cp_mbar_arrive(unsigned a) {
  attnc_emu_cp_wait(0);
  attnc_emu::mbar_arrive(a);
}
// TMA. A tensor map as the emulation's launch writes it (`Prepared::tma`, 128 bytes apart): the
// first element's address, the rank, elements per dim (innermost first), byte strides of dims
// 1.., the box. The arrival that expects bytes adds them to the phase's pending count; a tiled
// copy lands as late as a wait would (after every other thread has run on until it waits),
// 128-byte swizzled by its shared address (bits 4-6 XOR bits 7-9, as the products read it),
// zeros where a coordinate is outside the tensor, then completes its bytes. With
// ATTNC_EMU_TMA_EARLY it lands and completes at its issue instead, so a producer that does not
// wait for a free stage runs ahead and overwrites stages still being read.
struct AttncEmuTmap { const unsigned char* base; unsigned rank; unsigned long long dims[5]; unsigned long long strides[5]; unsigned box[5]; };
static_assert(sizeof(AttncEmuTmap) <= 128, "a tensor map takes 128 bytes");
ATTNC_DEV void attnc_tmap_acquire(const void*) {}
ATTNC_DEV void attnc_mbar_expect_tx(unsigned a, unsigned bytes) {
  attnc_emu::MBar& m = attnc_emu::mbar_at(a);
  m.tx += bytes;
  attnc_emu::mbar_arrive(a);
}
static inline void attnc_emu_tma(unsigned dst, const void* map, const int* c, unsigned rank, unsigned mbar) {
  const AttncEmuTmap& m = *(const AttncEmuTmap*)map;
  if (m.rank != rank) { std::fprintf(stderr, "emulation: a %u-d copy from a %u-d tensor map\n", rank, m.rank); std::abort(); }
  if (dst % 1024 != 0) { std::fprintf(stderr, "emulation: a swizzled TMA copy to shared address %u (not 1024-byte aligned)\n", dst); std::abort(); }
#ifndef ATTNC_EMU_TMA_EARLY
  attnc_emu::yield();
#endif
  unsigned long long total = 1;
  for (unsigned r = 0; r < rank; ++r) total *= m.box[r];
  for (unsigned long long e = 0; e < total; ++e) {
    unsigned long long rest = e, at = 0;
    bool in = true;
    for (unsigned r = 0; r < rank; ++r) {
      const long long g = (long long)c[r] + (long long)(rest % m.box[r]);
      rest /= m.box[r];
      if (g < 0 || (unsigned long long)g >= m.dims[r]) in = false;
      else at += r == 0 ? (unsigned long long)g * 2 : (unsigned long long)g * m.strides[r - 1];
    }
    u16 v = 0;
    if (in) std::memcpy(&v, m.base + at, 2);
    unsigned o = dst + (unsigned)(2 * e);
    o ^= ((o >> 7) & 7) << 4;
    std::memcpy(attnc_emu::dyn_smem + o, &v, 2);
  }
  attnc_emu::MBar& b = attnc_emu::mbar_at(mbar);
  b.tx -= (long long)(2 * total);
  attnc_emu::mbar_complete(b);
}
ATTNC_DEV void attnc_tma_load_2d(unsigned dst, const void* m, int c0, int c1, unsigned mbar) { const int c[] = {c0, c1}; attnc_emu_tma(dst, m, c, 2, mbar); }
ATTNC_DEV void attnc_tma_load_3d(unsigned dst, const void* m, int c0, int c1, int c2, unsigned mbar) { const int c[] = {c0, c1, c2}; attnc_emu_tma(dst, m, c, 3, mbar); }
ATTNC_DEV void attnc_tma_load_4d(unsigned dst, const void* m, int c0, int c1, int c2, int c3, unsigned mbar) { const int c[] = {c0, c1, c2, c3}; attnc_emu_tma(dst, m, c, 4, mbar); }
ATTNC_DEV void attnc_tma_load_5d(unsigned dst, const void* m, int c0, int c1, int c2, int c3, int c4, unsigned mbar) { const int c[] = {c0, c1, c2, c3, c4}; attnc_emu_tma(dst, m, c, 5, mbar); }
ATTNC_DEV void attnc_mbar_wait(unsigned a, unsigned parity) {
  attnc_emu::Barrier& b = attnc_emu::mbar(a);
  while ((b.gen & 1) == (parity & 1)) attnc_emu::until_next_phase(b);
}
ATTNC_DEV void attnc_bar_sync(int id, int n) { attnc_emu::wait(attnc_emu::named_bar(id, n)); }
ATTNC_DEV void attnc_bar_arrive(int id, int n) { attnc_emu::arrive(attnc_emu::named_bar(id, n)); }
template <int N> static inline void attnc_regs_inc() {}
template <int N> static inline void attnc_regs_dec() {}
// At the start of each block (the first of its fibers to get there): fresh barriers.
static inline void attnc_emu_block_barriers(long long block) {
  if (attnc_emu::barrier_block == block) return;
  attnc_emu::barrier_block = block;
  attnc_emu::nmbars = 0;
  for (auto& b : attnc_emu::named) b = attnc_emu::Barrier{};
}
// One launch: `bx` fibers, each running the kernel for every block in turn.
template <class F> static void attnc_emu_launch(unsigned gx, unsigned gy, unsigned gz, unsigned bx, size_t smem, F kernel) {
  attnc_emu::grid = {gx, gy, gz};
  attnc_emu::block = {bx, 1, 1};
  unsigned char* dyn = (unsigned char*)std::calloc(smem > 0 ? smem : 1, 1);
  attnc_emu::dyn_smem = dyn;
  attnc_emu::block_bar = attnc_emu::Barrier{bx};
  attnc_emu::Warp* warps = new attnc_emu::Warp[(bx + 31) / 32];
  for (unsigned w = 0; w < (bx + 31) / 32; ++w) warps[w].bar = attnc_emu::Barrier{32};
  attnc_emu::warps = warps;
  attnc_emu::wg = ATTNC_WGMMA ? new attnc_emu::WgQueue[bx] : nullptr;
  attnc_emu::cpq = new attnc_emu::CpQueue[bx];
  attnc_emu::barrier_block = -1;
  struct Body { F* kernel; unsigned gx, gy, gz; };
  Body b{&kernel, gx, gy, gz};
  attnc_emu::run(bx, [](void* arg) {
    Body& b = *(Body*)arg;
    for (unsigned z = 0; z < b.gz; ++z)
      for (unsigned y = 0; y < b.gy; ++y)
        for (unsigned x = 0; x < b.gx; ++x) {
          blockIdx = {x, y, z};
          attnc_emu_block_barriers(((long long)z * b.gy + y) * b.gx + x);
          (*b.kernel)();
          attnc_emu_wg_done();
          attnc_emu::cpq[attnc_emu::cur].len = 0;  // copies never waited for land nowhere
          attnc_emu::wait(attnc_emu::block_bar);
        }
  }, &b);
  delete[] warps;
  delete[] attnc_emu::wg;
  attnc_emu::wg = nullptr;
  delete[] attnc_emu::cpq;
  attnc_emu::cpq = nullptr;
  std::free(dyn);
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
    /// The prepared run: its integer table and `-D` defines.
    pub prep: &'a Prepared,
    /// The bytes of every buffer.
    pub buffer_bytes: &'a [usize],
    /// The launches, in order.
    pub launches: &'a [ReadyLaunch],
    /// The buffers to fill before the launches: (buffer, bytes).
    pub uploads: Vec<(usize, Vec<u8>)>,
    /// The buffers to read back afterwards.
    pub outputs: &'a [usize],
}

/// The host program of `program`: its kernels under [`HOST_PRELUDE`], `defines` first, and a
/// `main` that reads a launch plan (see [`plan`]) from the directory it is given.
fn host_program(program: &CudaProgram, defines: &[(String, i64)]) -> Result<String, String> {
    let mut src: String = defines.iter().map(|(k, v)| format!("#define {k} {v}\n")).collect();
    src.push_str(&host_source(program)?);
    // Every kernel takes the same parameters (ATTNC_ARGS): the buffers, then the integer table.
    let (nb, nt) = (program.buffers, program.ints);
    let mut args: Vec<String> = (0..nb).map(|b| format!("b[{b}]")).collect();
    args.extend((0..nt).map(|t| format!("t[{t}]")));
    args.push("maps".into());
    let _ = writeln!(src, "\nstatic void attnc_emu_call(int k, void* const* b, const i64* t, const void* maps) {{\n  switch (k) {{");
    for (k, kernel) in program.kernels.iter().enumerate() {
        let _ = writeln!(src, "    case {k}: {}({}); break;", kernel.name, args.join(", "));
    }
    let _ = writeln!(src, "  }}\n}}");
    src.push_str(EMULATION_MAIN);
    Ok(src)
}

/// The `main` of every host program: `program DIR` reads `DIR/plan` (see [`plan`]), fills the
/// buffers from `DIR/bN.in`, runs the launches and writes `DIR/bN.out`.
const EMULATION_MAIN: &str = r#"
static i64 attnc_emu_next(FILE* f) { long long v = 0; if (std::fscanf(f, "%lld", &v) != 1) { std::fprintf(stderr, "emulation: bad plan\n"); std::exit(3); } return v; }
static FILE* attnc_emu_open(const char* dir, const char* name, long long buf, const char* mode) {
  char path[4096]; std::snprintf(path, sizeof path, "%s/b%lld.%s", dir, buf, name);
  FILE* f = std::fopen(path, mode); if (!f) { std::fprintf(stderr, "emulation: cannot open %s\n", path); std::exit(4); } return f;
}
int main(int argc, char** argv) {
  if (argc < 2) return 2;
  const char* dir = argv[1];
  char path[4096]; std::snprintf(path, sizeof path, "%s/plan", dir);
  FILE* plan = std::fopen(path, "r"); if (!plan) return 3;
  const i64 nb = attnc_emu_next(plan);
  void** b = (void**)std::calloc(nb > 0 ? nb : 1, sizeof(void*));
  i64* bytes = (i64*)std::calloc(nb > 0 ? nb : 1, sizeof(i64));
  for (i64 i = 0; i < nb; ++i) { bytes[i] = attnc_emu_next(plan); b[i] = std::calloc(bytes[i] > 0 ? bytes[i] : 1, 1); }
  const i64 nt = attnc_emu_next(plan);
  i64* t = (i64*)std::calloc(nt > 0 ? nt : 1, sizeof(i64));
  for (i64 i = 0; i < nt; ++i) t[i] = attnc_emu_next(plan);
  // The tensor maps: buffer, byte offset, rank, then per dim its size, stride (dims 1..) and box.
  const i64 nm = attnc_emu_next(plan);
  unsigned char* maps = (unsigned char*)std::calloc(nm > 0 ? nm : 1, 128);
  for (i64 i = 0; i < nm; ++i) {
    AttncEmuTmap* m = (AttncEmuTmap*)(maps + 128 * i);
    const i64 buf = attnc_emu_next(plan), off = attnc_emu_next(plan);
    m->base = (const unsigned char*)b[buf] + off;
    m->rank = (unsigned)attnc_emu_next(plan);
    for (unsigned r = 0; r < m->rank; ++r) m->dims[r] = attnc_emu_next(plan);
    for (unsigned r = 1; r < m->rank; ++r) m->strides[r - 1] = attnc_emu_next(plan);
    for (unsigned r = 0; r < m->rank; ++r) m->box[r] = (unsigned)attnc_emu_next(plan);
  }
  for (i64 n = attnc_emu_next(plan); n > 0; --n) {
    const i64 buf = attnc_emu_next(plan), len = attnc_emu_next(plan);
    FILE* f = attnc_emu_open(dir, "in", buf, "rb");
    if ((i64)std::fread(b[buf], 1, len, f) != len) return 5;
    std::fclose(f);
  }
  for (i64 n = attnc_emu_next(plan); n > 0; --n) {
    const int k = (int)attnc_emu_next(plan);
    const unsigned gx = attnc_emu_next(plan), gy = attnc_emu_next(plan), gz = attnc_emu_next(plan), bx = attnc_emu_next(plan);
    const size_t smem = attnc_emu_next(plan);
    attnc_emu_launch(gx, gy, gz, bx, smem, [&] { attnc_emu_call(k, b, t, nm > 0 ? maps : nullptr); });
  }
  for (i64 n = attnc_emu_next(plan); n > 0; --n) {
    const i64 buf = attnc_emu_next(plan);
    FILE* f = attnc_emu_open(dir, "out", buf, "wb");
    std::fwrite(b[buf], 1, bytes[buf], f);
    std::fclose(f);
  }
  return 0;
}
"#;

/// The launch plan a host program reads: numbers separated by white space, in order: the buffer
/// count and each buffer's bytes; the integer table's length and values; the tensor maps' count
/// and each map (buffer, byte offset, rank, dims, strides of dims 1.., box); the uploads' count and
/// (buffer, bytes) of each; the launches' count and (kernel, grid x, y, z, threads, dynamic shared
/// bytes) of each; the outputs' count and their buffers.
fn plan(program: &CudaProgram, run: &Run) -> Result<String, String> {
    let mut p = String::new();
    let _ = writeln!(p, "{}", run.buffer_bytes.len());
    let _ = writeln!(p, "{}", run.buffer_bytes.iter().map(usize::to_string).collect::<Vec<_>>().join(" "));
    let _ = writeln!(p, "{}", run.prep.ints.len());
    let _ = writeln!(p, "{}", run.prep.ints.iter().map(i64::to_string).collect::<Vec<_>>().join(" "));
    let _ = writeln!(p, "{}", run.prep.tma.len());
    for m in &run.prep.tma {
        let nums = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(" ");
        let boxes: Vec<String> = m.boxes.iter().map(u32::to_string).collect();
        let _ = writeln!(p, "{} {} {} {} {} {}", m.buf, m.offset_bytes, m.dims.len(), nums(&m.dims), nums(&m.strides), boxes.join(" "));
    }
    let _ = writeln!(p, "{}", run.uploads.len());
    for (buf, bytes) in &run.uploads {
        let _ = writeln!(p, "{buf} {}", bytes.len());
    }
    let _ = writeln!(p, "{}", run.launches.len());
    for l in run.launches {
        let k = program.kernels.iter().position(|k| k.name == l.kernel).ok_or_else(|| format!("no kernel `{}`", l.kernel))?;
        let _ = writeln!(p, "{k} {} {} {} {} {}", l.grid[0], l.grid[1], l.grid[2], l.block[0], l.smem_bytes);
    }
    let _ = writeln!(p, "{}", run.outputs.len());
    let _ = writeln!(p, "{}", run.outputs.iter().map(usize::to_string).collect::<Vec<_>>().join(" "));
    Ok(p)
}

/// The flags every host program is compiled with.
const CXX_FLAGS: &[&str] =
    &["-std=c++20", "-O1", "-g0", "-fsanitize=address", "-fno-omit-frame-pointer", "-Wno-unknown-pragmas", "-fno-strict-aliasing"];

/// The compiled host program of `program` with `defines`: built once per source (per process in
/// memory; across processes in `$TMPDIR/attnc-emulate`, by a hash of the source, the flags and
/// the compiler's version).
pub fn binary(program: &CudaProgram, defines: &[(String, i64)]) -> Result<PathBuf, String> {
    type Slot = Arc<OnceLock<Result<PathBuf, String>>>;
    static BUILT: OnceLock<Mutex<HashMap<u128, Slot>>> = OnceLock::new();
    let source = host_program(program, defines)?;
    let key = content_hash(&[source.as_bytes(), CXX_FLAGS.join(" ").as_bytes(), compiler_version().as_bytes()]);
    let slot = {
        let mut built = BUILT.get_or_init(Default::default).lock().map_err(|_| "emulation cache poisoned".to_string())?;
        built.entry(key).or_default().clone()
    };
    slot.get_or_init(|| compile(&source, key)).clone()
}

/// Compiles a host program into the cache directory (unless a previous process did).
fn compile(source: &str, key: u128) -> Result<PathBuf, String> {
    let dir = std::env::temp_dir().join("attnc-emulate");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let exe = dir.join(format!("{key:032x}"));
    if exe.is_file() {
        return Ok(exe);
    }
    // Written under names of this process, then renamed: concurrent builders never see a half
    // written program.
    let tmp = dir.join(format!("{key:032x}.{}", std::process::id()));
    let cpp = tmp.with_extension("cpp");
    std::fs::write(&cpp, source).map_err(|e| format!("{}: {e}", cpp.display()))?;
    let out = Command::new("g++").args(CXX_FLAGS).arg("-o").arg(&tmp).arg(&cpp).output().map_err(|e| format!("running g++: {e}"))?;
    if !out.status.success() {
        return Err(format!("g++ failed on {}:\n{}", cpp.display(), String::from_utf8_lossy(&out.stderr)));
    }
    let _ = std::fs::remove_file(&cpp);
    std::fs::rename(&tmp, &exe).map_err(|e| format!("{}: {e}", exe.display()))?;
    Ok(exe)
}

/// `g++ --version`'s first line (part of the cache key: a new compiler builds anew).
fn compiler_version() -> String {
    static VERSION: OnceLock<String> = OnceLock::new();
    VERSION
        .get_or_init(|| {
            Command::new("g++")
                .arg("--version")
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or_default().to_string())
                .unwrap_or_default()
        })
        .clone()
}

/// Runs a prepared program on the host. Work happens in `dir`. Returns the bytes of each output
/// buffer.
pub fn emulate(program: &CudaProgram, run: &Run, dir: &Path) -> Result<Vec<Vec<u8>>, String> {
    let exe = binary(program, &run.prep.defines)?;
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("plan"), plan(program, run)?).map_err(|e| e.to_string())?;
    for (buf, bytes) in &run.uploads {
        std::fs::write(dir.join(format!("b{buf}.in")), bytes).map_err(|e| e.to_string())?;
    }
    let mut child = Command::new(&exe).arg(dir).env("ASAN_OPTIONS", "detect_leaks=0").spawn().map_err(|e| e.to_string())?;
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            break s;
        }
        if start.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            return Err(format!("{} did not finish in 300 s", exe.display()));
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    if !status.success() {
        return Err(format!("{} {} failed ({status}); AddressSanitizer's report is above", exe.display(), dir.display()));
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
/// `ATTNC_CUDA_MMA_ROWS` and the other knobs as on the device).
fn policy() -> Policy {
    policy_for(false, true, true)
}

/// [`policy`] for kernels compiled with Hopper's warpgroup products (`ATTNC_WGMMA` 1) or not,
/// with the warp-specialised flash forward where it runs, or (`ws` false) not, and its TMA
/// loads where they run, or (`tma` false) not.
fn policy_for(wgmma: bool, ws: bool, tma: bool) -> Policy {
    Policy::Cuda(CudaPolicy {
        sm_count: 2,
        max_smem_per_block: 232_448,
        mma_rows: super::mma_rows_knob(),
        simt_backward: super::simt_backward_knob(),
        deterministic_backward: super::deterministic_backward_knob(),
        wgmma,
        kv_stages: super::kv_stages_knob(),
        warp_specialize: ws && super::warp_specialize_knob(),
        tma: tma && super::tma_knob(),
    })
}

/// A graph as the device runs it: scheduled as written, or compiled by the pipeline.
pub enum Device<'a> {
    /// Scheduled without optimisation.
    AsWritten(&'a Graph),
    /// Optimised and scheduled by the pipeline.
    Compiled(&'a Graph),
}

/// The schedule the emulated device runs for `d`.
pub fn device_graph(d: Device) -> Result<Schedule, String> {
    device_graph_in(d, policy())
}

/// [`device_graph`] with the tensor-core flash backward in its deterministic mode (no atomic
/// adds), whatever `ATTNC_CUDA_BWD` says.
pub fn deterministic_device_graph(d: Device) -> Result<Schedule, String> {
    let Policy::Cuda(c) = policy() else { return Err("the emulation's policy is not CUDA's".into()) };
    device_graph_in(d, Policy::Cuda(CudaPolicy { deterministic_backward: true, ..c }))
}

fn device_graph_in(d: Device, policy: Policy) -> Result<Schedule, String> {
    match d {
        Device::AsWritten(g) => Compiler::new(policy).schedule(g).map_err(|e| e.to_string()),
        Device::Compiled(g) => Compiler::new(policy).plan(g).map(|p| p.schedule).map_err(|e| e.to_string()),
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
    emulate_schedule_with(s, inputs, env, dir, &[])
}

/// [`emulate_schedule`] with more `-D` defines for the host program (e.g. `ATTNC_WGMMA` 1:
/// the kernels' Hopper paths, on the emulated warpgroup products; `ATTNC_CUDA_WS` 0: the flash
/// forward's one-warpgroup block instead of the warp-specialised one, as the runtime's knob;
/// `ATTNC_CUDA_TMA` 0: the warp-specialised block's `cp.async` copies instead of TMA loads).
pub fn emulate_schedule_with(
    s: &Result<Schedule, String>,
    inputs: &[Tensor],
    env: &HashMap<String, i64>,
    dir: &Path,
    defines: &[(String, i64)],
) -> Result<Vec<Tensor>, String> {
    emulate_edited(s, inputs, env, dir, defines, &|source| source)
}

/// [`emulate_schedule_with`] on the rendered source as `edit` changes it (the tests of the
/// emulation's own checks run deliberately broken kernels).
pub(crate) fn emulate_edited(
    s: &Result<Schedule, String>,
    inputs: &[Tensor],
    env: &HashMap<String, i64>,
    dir: &Path,
    defines: &[(String, i64)],
    edit: &dyn Fn(String) -> String,
) -> Result<Vec<Tensor>, String> {
    let s = s.as_ref().map_err(Clone::clone)?;
    let mut program = render(s).map_err(|e| e.to_string())?;
    program.source = edit(std::mem::take(&mut program.source));
    let mut run_env = env.clone();
    attn_compiler::exec::add_scalar_inputs(inputs, &mut run_env);
    let data = attn_compiler::exec::mask_data_inputs(&attn_compiler::schedule::mask_data_params(s), inputs, &mut run_env);
    let wgmma = defines.iter().any(|(n, v)| n == "ATTNC_WGMMA" && *v != 0);
    // `ATTNC_CUDA_WS` 0 among the defines: the runtime's knob of that name, for this run.
    let off = |knob: &str| defines.iter().any(|(n, v)| n == knob && *v == 0);
    let (ws, tma) = (!off("ATTNC_CUDA_WS"), !off("ATTNC_CUDA_TMA"));
    let mut prep = attn_compiler::schedule::prepare_with(s, &run_env, &policy_for(wgmma, ws, tma), &data).map_err(|e| e.to_string())?;
    prep.defines.extend(defines.iter().cloned());
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
