//! The helpers every emitted program starts with. The source includes no header (NVRTC needs
//! none of the CUDA toolkit's): half-precision conversions and tensor-core products are inline
//! PTX, warp exchanges and barriers are the built-in intrinsics, and everything the kernels use
//! from the device goes through a helper here, so that a test can swap this block for a host
//! C++ emulation (the text between the two marker lines).

/// First line of the replaceable helper block.
pub const PRELUDE_BEGIN: &str = "// ---- attnc prelude begin ----";
/// Last line of the replaceable helper block.
pub const PRELUDE_END: &str = "// ---- attnc prelude end ----";

/// Types every emitted program uses, before (and outside) the replaceable block.
pub(super) const TYPES: &str = "\
typedef long long i64;
typedef unsigned short u16;
typedef unsigned char u8;
";

/// The device helpers (between the markers).
pub(super) const PRELUDE: &str = r#"#define ATTNC_DEV __device__ __forceinline__
#define ATTNC_INF __int_as_float(0x7f800000)
#define ATTNC_NAN __int_as_float(0x7fffffff)
#define ATTNC_DINF __longlong_as_double(0x7ff0000000000000LL)
#define ATTNC_DNAN __longlong_as_double(0x7ff8000000000000LL)
#define ATTNC_LOG2E 1.4426950408889634f
ATTNC_DEV float attnc_h2f(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
ATTNC_DEV u16 attnc_f2h(float f) { u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
ATTNC_DEV float attnc_b2f(u16 h) { return __uint_as_float(((unsigned)h) << 16); }
ATTNC_DEV u16 attnc_f2b(float f) { u16 h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
ATTNC_DEV float attnc_rh(float x) { return attnc_h2f(attnc_f2h(x)); }
ATTNC_DEV float attnc_rb(float x) { return attnc_b2f(attnc_f2b(x)); }
// Two floats packed as f16x2 / bf16x2: `lo` in the low half (the lower column of a fragment).
ATTNC_DEV unsigned attnc_pack_h(float lo, float hi) { unsigned r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r; }
ATTNC_DEV unsigned attnc_pack_b(float lo, float hi) { unsigned r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r; }
ATTNC_DEV unsigned attnc_pack_u16(u16 lo, u16 hi) { return (unsigned)lo | ((unsigned)hi << 16); }
ATTNC_DEV unsigned attnc_ld_u32(const u16* p) { return *(const unsigned*)p; }
// D = A * B + D for one warp: m16n8k16, A row-major f16/bf16 (4 regs), B column-major (2 regs),
// f32 accumulators (4 regs). Fragment layouts: PTX ISA, "mma.m16n8k16" matrix fragments.
ATTNC_DEV void attnc_mma_h(float* c, const unsigned* a, const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
ATTNC_DEV void attnc_mma_b(float* c, const unsigned* a, const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// A generic pointer into shared memory as a shared-window address (for ldmatrix, cp.async;
// computed once per kernel, then offset in bytes).
ATTNC_DEV unsigned attnc_saddr(const void* p) { unsigned a; asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p)); return a; }
// ldmatrix.m8n8.x4 at shared address `a`: lane L gives the address of row L % 8 of matrix L / 8
// (16 bytes each); reg i gets matrix i's row L / 4, columns 2 (L % 4) and 2 (L % 4) + 1
// (transposed: rows 2 (L % 4) and 2 (L % 4) + 1 of column L / 4). Low half first.
ATTNC_DEV void attnc_ldsm_x4(unsigned* r, unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}
ATTNC_DEV void attnc_ldsm_x4_t(unsigned* r, unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}
// 16 bytes from global memory to shared address `dst`, asynchronously; zeros when `ok` is false
// (nothing is read then). Visible after attnc_cp_commit, attnc_cp_wait_all and a barrier.
ATTNC_DEV void attnc_cp16(unsigned dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
ATTNC_DEV void attnc_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
ATTNC_DEV void attnc_cp_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
// Every committed group but the newest is in (a prefetch may still be on its way).
ATTNC_DEV void attnc_cp_wait_1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
// 2^x on the special-function unit (about 2 ulp; flash softmax weights only).
ATTNC_DEV float attnc_exp2_fast(float x) { float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
ATTNC_DEV float attnc_exp_fast(float x) { return attnc_exp2_fast(x * ATTNC_LOG2E); }
ATTNC_DEV float attnc_shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
ATTNC_DEV double attnc_shfl_xor_d(double v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
ATTNC_DEV long long attnc_shfl_xor_ll(long long v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
// Lane 0's value in every lane: a value the compiler then knows to be the same across the warp
// (a branch on it is warp-uniform).
ATTNC_DEV int attnc_warp_uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }
// a * b + c in double, rounded after each step (never contracted into an FMA): scans.
ATTNC_DEV bool attnc_any(bool p) { return __any_sync(0xffffffffu, p); }
ATTNC_DEV int attnc_sync_or(int p) { return __syncthreads_or(p); }
// 1/x on the special-function unit (about 1 ulp; additive flash scores only).
ATTNC_DEV float attnc_rcp_fast(float x) { float r; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
ATTNC_DEV double attnc_dmuladd(double a, double b, double c) { return __dadd_rn(__dmul_rn(a, b), c); }
ATTNC_DEV void attnc_sync() { __syncthreads(); }
ATTNC_DEV void attnc_syncwarp() { __syncwarp(); }
ATTNC_DEV int attnc_cas(int* p, int expected, int value) { return atomicCAS(p, expected, value); }
// An atomic add whose old value is not wanted (a `red` instruction).
ATTNC_DEV void attnc_red_add(float* p, float v) { atomicAdd(p, v); }
// Four neighbouring adds (p 16-byte aligned): one vector `red` on sm_90.
ATTNC_DEV void attnc_red_add4(float* p, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
#else
  atomicAdd(p, a); atomicAdd(p + 1, b); atomicAdd(p + 2, c); atomicAdd(p + 3, d);
#endif
}
#define ATTNC_SHARED __shared__
#define ATTNC_DYN_SMEM extern __shared__ __align__(16) unsigned char attnc_smem[]
#define ATTNC_KERNEL extern "C" __global__
"#;

/// Scalar maths of [`attn_compiler::ir::semantics`] (after the replaceable block: plain C on top of the
/// helpers, identical on the device and in a host emulation).
pub(super) const MATH: &str = r#"struct __align__(16) attnc_u4 { unsigned x, y, z, w; };  // 8 halves, one 16-byte access
ATTNC_DEV float attnc_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
ATTNC_DEV float attnc_silu(float x) { return x * attnc_sigmoid(x); }
// x/2 * erfc(-x/sqrt 2): no cancellation in the negative tail.
ATTNC_DEV float attnc_gelu(float x) { return (x * 0.5f) * erfcf(-x * 0.70710678118654752f); }
ATTNC_DEV float attnc_elu(float x) { return x >= 0.0f ? x : expm1f(x); }
ATTNC_DEV float attnc_relu(float x) { return x != x ? x : (x > 0.0f ? x : 0.0f); }
// min/max propagate NaN and order -0 < +0 (for equal values the and/or of the bits).
ATTNC_DEV float attnc_fmax(float a, float b) {
  return (a != a || b != b) ? ATTNC_NAN : (a > b ? a : (b > a ? b : __int_as_float(__float_as_int(a) & __float_as_int(b))));
}
ATTNC_DEV float attnc_fmin(float a, float b) {
  return (a != a || b != b) ? ATTNC_NAN : (a < b ? a : (b < a ? b : __int_as_float(__float_as_int(a) | __float_as_int(b))));
}
// Whether a (at index ia) sorts before b (at ib): ascending, or descending when `desc`, NaN above
// every number, -0 == +0, ties by index (ir::semantics::sorts_before).
ATTNC_DEV int attnc_sorts_before(double a, i64 ia, double b, i64 ib, int desc) {
  int na = a != a, nb = b != b;
  double ka = (na || a == 0.0) ? 0.0 : a, kb = (nb || b == 0.0) ? 0.0 : b;
  int n1 = desc ? nb : na, n2 = desc ? na : nb;
  double k1 = desc ? kb : ka, k2 = desc ? ka : kb;
  if (n1 != n2) return n1 < n2;
  if (k1 != k2) return k1 < k2;
  return ia < ib;
}
ATTNC_DEV double attnc_dmin(double a, double b) { return (a != a || b != b) ? ATTNC_DNAN : (a < b ? a : b); }
ATTNC_DEV double attnc_dmax(double a, double b) { return (a != a || b != b) ? ATTNC_DNAN : (a > b ? a : b); }
// `%` with the sign of the divisor (Python): NaN for a float zero divisor; 0 for an integer one
// and for INT_MIN % -1.
ATTNC_DEV float attnc_frem(float a, float b) { float r = fmodf(a, b); return (r != 0.0f && ((r < 0.0f) != (b < 0.0f))) ? r + b : r; }
ATTNC_DEV int attnc_irem(int a, int b) { if (b == 0 || b == -1) return 0; int r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
// Integer arithmetic wraps modulo 2^32.
ATTNC_DEV int attnc_iadd(int a, int b) { return (int)((unsigned)a + (unsigned)b); }
ATTNC_DEV int attnc_isub(int a, int b) { return (int)((unsigned)a - (unsigned)b); }
ATTNC_DEV int attnc_imul(int a, int b) { return (int)((unsigned)a * (unsigned)b); }
ATTNC_DEV int attnc_ineg(int a) { return (int)(0u - (unsigned)a); }
ATTNC_DEV int attnc_iabs(int a) { return a < 0 ? attnc_ineg(a) : a; }
ATTNC_DEV int attnc_wrap(i64 x) { return (int)(unsigned)(unsigned long long)x; }
// Float to int: truncates toward zero, saturates, NaN is 0.
ATTNC_DEV int attnc_f2i(float x) { return x != x ? 0 : (x >= 2147483647.0f ? 2147483647 : (x <= -2147483648.0f ? (-2147483647 - 1) : (int)x)); }
ATTNC_DEV int attnc_d2i(double x) { return x != x ? 0 : (x >= 2147483647.0 ? 2147483647 : (x <= -2147483648.0 ? (-2147483647 - 1) : (int)x)); }
// Philox4x32-10 of the counter (c0, i, batch, 0) under the key (seed, 0): four words into w.
ATTNC_DEV void attnc_philox4(int seed, int batch, int i, unsigned c0, unsigned* w) {
  unsigned c1 = (unsigned)i, c2 = (unsigned)batch, c3 = 0u, k0 = (unsigned)seed, k1 = 0u;
  for (int r = 0; r < 10; ++r) {
    if (r > 0) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
    const unsigned long long p0 = 0xD2511F53ull * (unsigned long long)c0, p1 = 0xCD9E8D57ull * (unsigned long long)c2;
    const unsigned n0 = (unsigned)(p1 >> 32) ^ c1 ^ k0, n2 = (unsigned)(p0 >> 32) ^ c3 ^ k1;
    c1 = (unsigned)p1; c3 = (unsigned)p0; c0 = n0; c2 = n2;
  }
  w[0] = c0; w[1] = c1; w[2] = c2; w[3] = c3;
}
// Dropout's 24 random bits of element (batch, i, j) under seed: key j = 64 b + 16 w + l takes
// word w of counter (16 b + l, i, batch, 0) (ir::semantics::dropout_bits).
ATTNC_DEV int attnc_dropout_bits(int seed, int batch, int i, int j) {
  const unsigned ju = (unsigned)j;
  unsigned w[4];
  attnc_philox4(seed, batch, i, ((ju >> 6) << 4) | (ju & 15u), w);
  return (int)(w[(ju >> 4) & 3u] >> 8);
}
// An index clamped into [0, n - 1] (flash loads, whose indices are proven in range).
ATTNC_DEV i64 attnc_clampi(i64 x, i64 n) { return x < 0 ? 0 : (x >= n ? n - 1 : x); }
// A gather's or scatter-add's index: out of [0, n) it is recorded in the fault record `rec`
// (site + 1, axis, index, size; the first fault wins) and the result clamped.
ATTNC_DEV i64 attnc_checki(i64 x, i64 n, void* rec, int site, int axis) {
  if (x < 0 || x >= n) {
    int* r = (int*)rec;
    if (attnc_cas(r, 0, site + 1) == 0) { r[1] = axis; r[2] = (int)x; r[3] = (int)n; }
  }
  return attnc_clampi(x, n);
}
ATTNC_DEV float attnc_warp_sum(float v) { for (int m = 16; m > 0; m >>= 1) v += attnc_shfl_xor(v, m); return v; }
ATTNC_DEV double attnc_warp_sum_d(double v) { for (int m = 16; m > 0; m >>= 1) v += attnc_shfl_xor_d(v, m); return v; }
// A double kept in two floats (high part, then the rest): `p += x` in double (the flash
// backward's partial sums of a bias's gradient, where the terms cancel).
ATTNC_DEV void attnc_acc2(float* p, double x) {
  const double v = (double)p[0] + (double)p[1] + x;
  const float h = (float)v;
  p[0] = h;
  p[1] = (float)(v - (double)h);
}
ATTNC_DEV long long attnc_warp_sum_ll(long long v) { for (int m = 16; m > 0; m >>= 1) v += attnc_shfl_xor_ll(v, m); return v; }
// Warp maxima and minima propagate NaN.
ATTNC_DEV float attnc_warp_max(float v) { for (int m = 16; m > 0; m >>= 1) v = attnc_fmax(v, attnc_shfl_xor(v, m)); return v; }
ATTNC_DEV double attnc_warp_max_d(double v) { for (int m = 16; m > 0; m >>= 1) v = attnc_dmax(v, attnc_shfl_xor_d(v, m)); return v; }
ATTNC_DEV double attnc_warp_min_d(double v) { for (int m = 16; m > 0; m >>= 1) v = attnc_dmin(v, attnc_shfl_xor_d(v, m)); return v; }
"#;

/// The whole preamble of an emitted program.
pub(super) fn preamble() -> String {
    format!("{TYPES}{PRELUDE_BEGIN}\n{PRELUDE}{}{PRELUDE_END}\n{MATH}", warpgroup())
}

/// Hopper's warpgroup products (`wgmma.mma_async`, sm_90a only: NVRTC defines
/// `__CUDA_ARCH_FEAT_SM90_ALL` there, and `ATTNC_WGMMA` says whether they exist). Each helper
/// is one product of a warpgroup (4 warps, 128 threads): `D[64 × N] (+)= A[64 × 16] · B[16 × N]`,
/// f32 accumulators in the `mma.sync` C-fragment layout per warp (warp `w` of the group holds
/// rows `16 w ..`, element `4 t + e` of a thread is row `g + 8 (e >> 1)`, column
/// `8 t + 2 (lane % 4) + (e & 1)`). `ss`: A and B from shared memory, both K-major (B = Kᵀ
/// of a `[keys][width]` tile). `rs_t`: A from registers (the `mma.sync` A-fragment layout of
/// the warp's 16 rows), B from shared memory MN-major (`imm-trans-b` = 1: V of a
/// `[keys][width]` tile). Operand tiles are 128-byte swizzled (a row of 64 halves is 8
/// chunks of 16 bytes, chunk `c` of row `r` stored at `c ^ (r % 8)`, in 1024-byte aligned
/// sub-tiles of 64 columns); a descriptor ([`attnc_wg_desc`]) gives its start, the byte
/// offset between sub-tiles along MN (`lbo`, MN-major only) and between groups of 8 rows
/// (`sbo`). Layouts checked on an H100 (docs/gpu/2026-11-28-h100-wgmma/probe.txt).
fn warpgroup() -> String {
    use std::fmt::Write as _;
    let mut s = String::from(
        "#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTNC_WGMMA 1
ATTNC_DEV unsigned long long attnc_wg_desc(unsigned addr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((addr >> 4) & 0x3fff) | ((unsigned long long)((lbo >> 4) & 0x3fff) << 16)
       | ((unsigned long long)((sbo >> 4) & 0x3fff) << 32) | (1ull << 62);
}
ATTNC_DEV void attnc_wg_fence() { asm volatile(\"wgmma.fence.sync.aligned;\" ::: \"memory\"); }
ATTNC_DEV void attnc_wg_commit() { asm volatile(\"wgmma.commit_group.sync.aligned;\" ::: \"memory\"); }
ATTNC_DEV void attnc_wg_wait0() { asm volatile(\"wgmma.wait_group.sync.aligned 0;\" ::: \"memory\"); }
ATTNC_DEV void attnc_wg_wait1() { asm volatile(\"wgmma.wait_group.sync.aligned 1;\" ::: \"memory\"); }
// After a wait: the accumulators' uses stay below it (the compiler sees them written by the
// product's asm, not by the wait's, and could otherwise move a read above the wait).
template <int N> ATTNC_DEV void attnc_wg_hold(float* d) {
  #pragma unroll
  for (int i = 0; i < N; ++i) asm volatile(\"\" : \"+f\"(d[i]) :: \"memory\");
}
// After a wait: a product's A registers stay live until here (else ptxas may give their
// registers to other values while the product still reads them, and wait for it there).
template <int N> ATTNC_DEV void attnc_wg_keep(unsigned* a) {
  #pragma unroll
  for (int i = 0; i < N; ++i) asm volatile(\"\" : \"+r\"(a[i]) :: \"memory\");
}
// Generic-proxy writes to shared memory (stores, cp.async) made visible to wgmma's reads.
ATTNC_DEV void attnc_fence_proxy() { asm volatile(\"fence.proxy.async.shared::cta;\" ::: \"memory\"); }
// The warp-specialised block: mbarriers in shared memory (`a`: a shared address), arrived on
// with release and waited for with acquire semantics (the CTA's scope), named barriers of `n`
// threads (id 0 is __syncthreads'), and the warpgroup's register budget (setmaxnreg).
ATTNC_DEV void attnc_mbar_init(unsigned a, unsigned n) { asm volatile(\"mbarrier.init.shared::cta.b64 [%0], %1;\" :: \"r\"(a), \"r\"(n) : \"memory\"); }
ATTNC_DEV void attnc_mbar_arrive(unsigned a) {
  asm volatile(\"{\\n.reg .b64 st;\\nmbarrier.arrive.shared::cta.b64 st, [%0];\\n}\\n\" :: \"r\"(a) : \"memory\");
}
// Arrives on mbarrier `a` once every cp.async this thread has issued has landed, and returns at
// once (`.noinc`: the arrival is one of the barrier's init count, as a plain arrive's is).
ATTNC_DEV void attnc_cp_mbar_arrive(unsigned a) { asm volatile(\"cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\" :: \"r\"(a) : \"memory\"); }
// Until the phase of parity `parity` has completed.
ATTNC_DEV void attnc_mbar_wait(unsigned a, unsigned parity) {
  asm volatile(\"{\\n.reg .pred p;\\nWAIT:\\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\\n@!p bra WAIT;\\n}\\n\" :: \"r\"(a), \"r\"(parity) : \"memory\");
}
ATTNC_DEV void attnc_bar_sync(int id, int n) { asm volatile(\"bar.sync %0, %1;\" :: \"r\"(id), \"r\"(n) : \"memory\"); }
ATTNC_DEV void attnc_bar_arrive(int id, int n) { asm volatile(\"bar.arrive %0, %1;\" :: \"r\"(id), \"r\"(n) : \"memory\"); }
template <int N> ATTNC_DEV void attnc_regs_inc() { asm volatile(\"setmaxnreg.inc.sync.aligned.u32 %0;\" :: \"n\"(N)); }
template <int N> ATTNC_DEV void attnc_regs_dec() { asm volatile(\"setmaxnreg.dec.sync.aligned.u32 %0;\" :: \"n\"(N)); }
",
    );
    for (ty, t) in [("f16", 'h'), ("bf16", 'b')] {
        for (n, ss) in [(32, true), (64, true), (64, false), (128, false)] {
            let regs = n / 2;
            let outs: Vec<String> = (0..regs).map(|i| format!("%{i}")).collect();
            let cons: Vec<String> = (0..regs).map(|i| format!("\"+f\"(d[{i}])")).collect();
            let shape = format!("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty}");
            if ss {
                let _ = write!(
                    s,
                    "ATTNC_DEV void attnc_wg_ss_{t}{n}(float* d, unsigned long long da, unsigned long long db, int scale) {{\n  asm volatile(\"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{}, 0;\\n{shape} {{{}}}, %{}, %{}, p, 1, 1, 0, 0;\\n}}\\n\"\n    : {} : \"l\"(da), \"l\"(db), \"r\"(scale));\n}}\n",
                    regs + 2,
                    outs.join(","),
                    regs,
                    regs + 1,
                    cons.join(", ")
                );
            } else {
                let _ = write!(
                    s,
                    "ATTNC_DEV void attnc_wg_rs_{t}{n}_t(float* d, const unsigned* a, unsigned long long db, int scale) {{\n  asm volatile(\"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{}, 0;\\n{shape} {{{}}}, {{%{},%{},%{},%{}}}, %{}, p, 1, 1, 1;\\n}}\\n\"\n    : {} : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"l\"(db), \"r\"(scale));\n}}\n",
                    regs + 5,
                    outs.join(","),
                    regs,
                    regs + 1,
                    regs + 2,
                    regs + 3,
                    regs + 4,
                    cons.join(", ")
                );
            }
        }
    }
    s.push_str(&tma());
    s.push_str("#else\n#define ATTNC_WGMMA 0\n#endif\n");
    s
}

/// Hopper's TMA (inside [`warpgroup`]'s sm_90a section): a tensor map the host wrote into
/// global memory, acquired for the tensormap proxy; the arrival on a stage's mbarrier that also
/// expects the copies' bytes; the tiled copies (`rank` 2 to 5 coordinates, innermost first)
/// that complete those bytes on it.
fn tma() -> String {
    use std::fmt::Write as _;
    let mut s = String::from(
        "ATTNC_DEV void attnc_tmap_acquire(const void* m) { asm volatile(\"fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\" :: \"l\"(m) : \"memory\"); }
ATTNC_DEV void attnc_mbar_expect_tx(unsigned a, unsigned bytes) {
  asm volatile(\"mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\" :: \"r\"(a), \"r\"(bytes) : \"memory\");
}
",
    );
    for rank in 2..=5usize {
        let params: Vec<String> = (0..rank).map(|i| format!("int c{i}")).collect();
        let slots: Vec<String> = (0..rank).map(|i| format!("%{}", i + 2)).collect();
        let args: Vec<String> = (0..rank).map(|i| format!("\"r\"(c{i})")).collect();
        let _ = write!(
            s,
            "ATTNC_DEV void attnc_tma_load_{rank}d(unsigned dst, const void* m, {}, unsigned mbar) {{\n  asm volatile(\"cp.async.bulk.tensor.{rank}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {{{}}}], [%{}];\"\n    :: \"r\"(dst), \"l\"(m), {}, \"r\"(mbar) : \"memory\");\n}}\n",
            params.join(", "),
            slots.join(", "),
            rank + 2,
            args.join(", ")
        );
    }
    s
}
