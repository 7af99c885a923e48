//! Dense microkernels that JIT-generated CPU code calls by symbol name: the tile products of
//! attention (Q·Kᵀ, P·V) and of matmuls, and the vectorised `exp` of the online softmax.
//!
//! Cranelift emits 128-bit SIMD only, about a quarter of this machine's 512-bit FMA peak, so the
//! generated code owns the loop nest, fusion, masking and softmax bookkeeping, and calls these
//! few kernels for the dense inner work. Each kernel has a stable C ABI entry point
//! (`attnc_*`, listed by [`symbols`] for the JIT to register) and a bounds-checked safe wrapper
//! for Rust callers and tests.
//!
//! The instruction set is chosen once at run time ([`isa`]): AVX-512F, AVX2+FMA, or portable
//! Rust. `ATTNC_ISA=avx512|avx2|portable` forces a lower path (never a higher one than the CPU
//! has). Kernels are single-threaded; callers parallelise over tiles.
//!
//! For callers choosing tile sizes (numbers from `examples/kernel_bench.rs` on the 2-core
//! AVX-512 development machine): `Nn` products run at ~88–93% of the FMA peak from `m = 64`
//! up; `Nt` transposes its `B` block on every call, which costs ~9% of a 64-row product and
//! ~4% of a 128-row one, so 128-row query blocks amortise a key block best. Each call packs
//! into a per-thread buffer that is allocated once and reused.

mod additive;
mod dropout;
mod exp;
mod f4;
mod gemm;
mod gemv;
mod heads;
mod lanes;
mod peak;
mod portable;
mod prefix;
mod rows;
mod vector;
#[cfg(target_arch = "x86_64")]
mod x86_avx2;
#[cfg(target_arch = "x86_64")]
mod x86_avx512;

#[cfg(test)]
mod tests;

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;
use thiserror::Error;

pub use gemm::Layout;
pub use gemv::PagedRows;
pub use heads::HeadGroup;
pub use peak::{PEAK_RUNS, one_run as peak_run, peak_gflops};
pub use prefix::prefix_attention;

/// An instruction-set path of the kernels, ordered from the most portable to the widest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust, compiled for the baseline target (the only path off x86-64).
    Portable,
    /// 256-bit AVX2 with FMA.
    Avx2,
    /// 512-bit AVX-512F.
    Avx512,
}

impl Isa {
    /// The name used by `ATTNC_ISA` and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Whether this CPU can run the path.
    pub fn is_supported(self) -> bool {
        self <= detected()
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl FromStr for Isa {
    type Err = KernelError;

    fn from_str(s: &str) -> Result<Isa, KernelError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "portable" => Ok(Isa::Portable),
            "avx2" => Ok(Isa::Avx2),
            "avx512" => Ok(Isa::Avx512),
            _ => Err(KernelError::UnknownIsa(s.to_string())),
        }
    }
}

/// The widest path this CPU supports.
pub fn widest() -> Isa {
    detected()
}

/// The CPU's model name as the OS reports it (`/proc/cpuinfo` on Linux), or the architecture.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name") || l.starts_with("Model") || l.starts_with("CPU part"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| format!("unknown {} CPU", std::env::consts::ARCH))
}

/// The widest path this CPU supports (detected once).
fn detected() -> Isa {
    static DETECTED: OnceLock<Isa> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    })
}

/// The path the `attnc_*` entry points use: the widest the CPU supports, lowered by
/// `ATTNC_ISA` if set (an unknown value or a path wider than the CPU's is ignored). Chosen once.
pub fn isa() -> Isa {
    static CHOSEN: OnceLock<Isa> = OnceLock::new();
    *CHOSEN.get_or_init(|| choose(detected(), std::env::var("ATTNC_ISA").ok().as_deref()))
}

/// The path for a CPU whose best is `best`, given the value of `ATTNC_ISA`.
fn choose(best: Isa, forced: Option<&str>) -> Isa {
    match forced.and_then(|s| s.parse::<Isa>().ok()) {
        Some(forced) => forced.min(best),
        None => best,
    }
}

/// Every path this CPU can run, most portable first (tests and benchmarks iterate it).
pub fn available_isas() -> Vec<Isa> {
    [Isa::Portable, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.is_supported()).collect()
}

/// A kernel call that cannot be made as asked.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// A leading dimension shorter than the row it strides over.
    #[error("leading dimension of {operand} is {ld}, less than its row length {row}")]
    LeadingDim {
        /// `"a"`, `"b"` or `"c"`.
        operand: &'static str,
        /// The leading dimension given.
        ld: usize,
        /// The row length it must cover.
        row: usize,
    },
    /// A slice too short for the shape and leading dimension.
    #[error("{operand} has {len} elements, the shape needs {need}")]
    TooShort {
        /// `"a"`, `"b"`, `"c"`, `"x"` or `"y"`.
        operand: &'static str,
        /// Elements given.
        len: usize,
        /// Elements the call reads or writes.
        need: usize,
    },
    /// A path this CPU cannot run.
    #[error("instruction set {0} is not supported by this CPU")]
    Unsupported(Isa),
    /// A name that is no instruction-set path.
    #[error("unknown instruction set `{0}` (known: portable, avx2, avx512)")]
    UnknownIsa(String),
}

/// A row-major matrix product `C (+)= alpha · A · op(B)` as the safe wrappers take it.
///
/// `A` is `m × k` with row stride `lda`; `B` is `n × k` (stride `ldb`) for [`Layout::Nt`] or
/// `k × n` for [`Layout::Nn`]; `C` is `m × n` with stride `ldc`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    /// Rows of `A` and `C`.
    pub m: usize,
    /// Columns of `C`.
    pub n: usize,
    /// The reduction length.
    pub k: usize,
    /// Row stride of `A` (≥ `k`).
    pub lda: usize,
    /// Row stride of `B` (≥ `k` for `Nt`, ≥ `n` for `Nn`).
    pub ldb: usize,
    /// Row stride of `C` (≥ `n`).
    pub ldc: usize,
    /// Scale of the product.
    pub alpha: f32,
    /// Add into `C` rather than overwrite it (an overwritten `C` is never read).
    pub accumulate: bool,
    /// The path to run; [`isa`] unless set.
    pub isa: Isa,
}

impl Gemm {
    /// A densely packed product (`lda = k`, `ldb` = row length of `B` in `layout`, `ldc = n`),
    /// `alpha = 1`, overwriting `C`, on the [`isa`] path.
    pub fn dense(layout: Layout, m: usize, n: usize, k: usize) -> Gemm {
        let ldb = match layout {
            Layout::Nt => k,
            Layout::Nn => n,
        };
        Gemm { m, n, k, lda: k, ldb, ldc: n, alpha: 1.0, accumulate: false, isa: isa() }
    }

    /// Checks strides and slice lengths for `layout`.
    fn check(&self, layout: Layout, a: &[f32], b: &[f32], c: &[f32]) -> Result<(), KernelError> {
        if !self.isa.is_supported() {
            return Err(KernelError::Unsupported(self.isa));
        }
        let (b_rows, b_row) = match layout {
            Layout::Nt => (self.n, self.k),
            Layout::Nn => (self.k, self.n),
        };
        check_matrix("a", a.len(), self.m, self.k, self.lda)?;
        check_matrix("b", b.len(), b_rows, b_row, self.ldb)?;
        check_matrix("c", c.len(), self.m, self.n, self.ldc)
    }
}

/// Checks that a `rows × cols` matrix with stride `ld` fits in `len` elements.
fn check_matrix(operand: &'static str, len: usize, rows: usize, cols: usize, ld: usize) -> Result<(), KernelError> {
    if ld < cols {
        return Err(KernelError::LeadingDim { operand, ld, row: cols });
    }
    let need = if rows == 0 || cols == 0 { 0 } else { (rows - 1) * ld + cols };
    if len < need {
        return Err(KernelError::TooShort { operand, len, need });
    }
    Ok(())
}

/// A blocked or few-rows product driver (`gemm::run`, `gemv::run`).
type Driver = unsafe fn(&Gemm, Layout, *const f32, *const f32, *mut f32);

/// Checks `g`'s strides and the slices for `layout`, then runs `driver` on them.
fn checked_product(driver: Driver, g: &Gemm, layout: Layout, a: &[f32], b: &[f32], c: &mut [f32]) -> Result<(), KernelError> {
    g.check(layout, a, b, c)?;
    // SAFETY: `check` proved every index the kernel touches is inside the slices.
    unsafe { driver(g, layout, a.as_ptr(), b.as_ptr(), c.as_mut_ptr()) };
    Ok(())
}

/// `C (+)= alpha · A · Bᵀ` with `B` given as `n × k` rows (keys), checked.
pub fn sgemm_nt(g: &Gemm, a: &[f32], b: &[f32], c: &mut [f32]) -> Result<(), KernelError> {
    checked_product(gemm::run, g, Layout::Nt, a, b, c)
}

/// `C (+)= alpha · A · B` with `B` given as `k × n`, checked.
pub fn sgemm_nn(g: &Gemm, a: &[f32], b: &[f32], c: &mut [f32]) -> Result<(), KernelError> {
    checked_product(gemm::run, g, Layout::Nn, a, b, c)
}

/// [`sgemm_nt`] by the few-rows kernel (any `m`; fastest for `m ≤ 4`, where it streams `B`).
pub fn gemv_nt(g: &Gemm, a: &[f32], b: &[f32], c: &mut [f32]) -> Result<(), KernelError> {
    checked_product(gemv::run, g, Layout::Nt, a, b, c)
}

/// [`sgemm_nn`] by the few-rows kernel, as [`gemv_nt`].
pub fn gemv_nn(g: &Gemm, a: &[f32], b: &[f32], c: &mut [f32]) -> Result<(), KernelError> {
    checked_product(gemv::run, g, Layout::Nn, a, b, c)
}

/// `y[i] = exp(x[i] - shift)` on `isa`, returning `Σ y` (accumulated in `f32`, lane-parallel).
///
/// `exp(-inf) = 0`, NaN stays NaN, results below the smallest subnormal are 0 and above
/// `f32::MAX` are `inf`; accurate to about 2 ulp.
pub fn exp_sum(isa: Isa, x: &[f32], y: &mut [f32], shift: f32) -> Result<f32, KernelError> {
    row_operands(isa, x, y)?;
    // SAFETY: `y` holds at least `x.len()` elements and the path is supported.
    Ok(unsafe { exp::exp_sum(isa, x.as_ptr(), 1.0, std::ptr::null(), y.as_mut_ptr(), x.len(), shift) })
}

/// A row kernel `(isa, x, y, n)` writing `y[i]` from `x[i]` for `i < n`.
type RowKernel = unsafe fn(Isa, *const f32, *mut f32, usize);

/// Checks a row kernel's operands ([`row_operands`]), then runs it on them.
fn checked_row(kernel: RowKernel, isa: Isa, x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    row_operands(isa, x, y)?;
    // SAFETY: `y` holds at least `x.len()` elements and the path is supported.
    unsafe { kernel(isa, x.as_ptr(), y.as_mut_ptr(), x.len()) };
    Ok(())
}

/// A row kernel's checks: `isa` runs here and `y` holds at least as many elements as `x`.
fn row_operands(isa: Isa, x: &[f32], y: &[f32]) -> Result<(), KernelError> {
    if !isa.is_supported() {
        return Err(KernelError::Unsupported(isa));
    }
    if y.len() < x.len() {
        return Err(KernelError::TooShort { operand: "y", len: y.len(), need: x.len() });
    }
    Ok(())
}

/// One online-softmax step over the row `scale·x (+ bias)` on `isa`, updating the running `(max, sum)`
/// and writing the unnormalised probabilities to `y`; returns the factor the row's accumulator
/// must be multiplied by. See [`attnc_softmax_step_f32`].
pub fn softmax_step(
    isa: Isa,
    x: &[f32],
    scale: f32,
    bias: Option<&[f32]>,
    y: &mut [f32],
    state: &mut (f32, f32),
) -> Result<f32, KernelError> {
    if !isa.is_supported() {
        return Err(KernelError::Unsupported(isa));
    }
    for (operand, len) in [("bias", bias.map_or(x.len(), <[f32]>::len)), ("y", y.len())] {
        if len < x.len() {
            return Err(KernelError::TooShort { operand, len, need: x.len() });
        }
    }
    let b = bias.map_or(std::ptr::null(), <[f32]>::as_ptr);
    let row = exp::Scores { x: x.as_ptr(), scale, bias: b, y: y.as_mut_ptr(), n: x.len() };
    // SAFETY: the slices hold `x.len()` elements, the path is supported, the state is two floats.
    Ok(unsafe { exp::softmax_step(isa, row, &mut state.0, &mut state.1) })
}

/// Softmax of the whole row `x` into `y` on `isa` (see [`attnc_softmax_row_f32`]).
pub fn softmax_row(isa: Isa, x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    checked_row(exp::softmax_row, isa, x, y)
}

/// `y[i] = tanh(x[i])` on `isa`; accurate to a few ulp, `±1` for large `|x|`, NaN stays NaN.
pub fn tanh(isa: Isa, x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    checked_row(exp::tanh, isa, x, y)
}

/// Defines a C ABI entry point over a product's operands, `fn(m, n, k, a, lda, b, ldb, c, ldc,
/// alpha, $last)`: the shape, strides and scale become a [`Gemm`] `$g` on the dispatched path
/// (`accumulate` from the expression `$acc`), and the entry point runs `$run`. The short form
/// `$name, $driver, $layout` takes `accumulate: u32` last and runs `$driver::run` with layout
/// `$layout`.
macro_rules! product_entry {
    ($(#[$doc:meta])* $name:ident($last:ident: $last_ty:ty), accumulate: $acc:expr, |$g:ident, $a:ident, $b:ident, $c:ident| $run:expr) => {
        $(#[$doc])*
        #[allow(clippy::too_many_arguments)] // The C ABI is the point: one register or stack slot each.
        pub unsafe extern "C" fn $name(
            m: usize,
            n: usize,
            k: usize,
            $a: *const f32,
            lda: usize,
            $b: *const f32,
            ldb: usize,
            $c: *mut f32,
            ldc: usize,
            alpha: f32,
            $last: $last_ty,
        ) {
            let $g = Gemm { m, n, k, lda, ldb, ldc, alpha, accumulate: $acc, isa: isa() };
            // SAFETY: forwarded from the caller's contract.
            unsafe { $run }
        }
    };
    ($(#[$doc:meta])* $name:ident, $driver:ident, $layout:expr) => {
        product_entry!(
            $(#[$doc])* $name(accumulate: u32), accumulate: accumulate != 0, |g, a, b, c| $driver::run(&g, $layout, a, b, c)
        );
    };
}

product_entry!(
    /// C ABI: `C[m×n] (+)= alpha · A[m×k] · B[n×k]ᵀ`, row-major with leading dimensions.
    ///
    /// `accumulate != 0` adds into `C`, otherwise `C` is overwritten without being read.
    ///
    /// # Safety
    /// For non-empty shapes the pointers must address `(m-1)·lda + k`, `(n-1)·ldb + k` and
    /// `(m-1)·ldc + n` valid elements, with `lda ≥ k`, `ldb ≥ k`, `ldc ≥ n`; `C` must not
    /// overlap `A` or `B`. Pointers are not read when the shape makes their operand empty.
    attnc_sgemm_nt,
    gemm,
    Layout::Nt
);

product_entry!(
    /// C ABI: `C[m×n] (+)= alpha · A[m×k] · B[k×n]`, row-major with leading dimensions.
    ///
    /// # Safety
    /// As [`attnc_sgemm_nt`], with `B` holding `(k-1)·ldb + n` elements and `ldb ≥ n`.
    attnc_sgemm_nn,
    gemm,
    Layout::Nn
);

product_entry!(
    /// C ABI: [`attnc_sgemm_nt`] for a few rows of `A` (decode's query rows against a key
    /// tile): `B` streamed once in place with prefetching, no packing.
    ///
    /// # Safety
    /// As [`attnc_sgemm_nt`].
    attnc_gemv_nt,
    gemv,
    Layout::Nt
);

product_entry!(
    /// C ABI: [`attnc_sgemm_nn`] for a few rows of `A` (decode's probabilities against a
    /// value tile), as [`attnc_gemv_nt`].
    ///
    /// # Safety
    /// As [`attnc_sgemm_nn`].
    attnc_gemv_nn,
    gemv,
    Layout::Nn
);

product_entry!(
    /// C ABI: additive attention scores `C[r, c] = alpha · Σ_a w[a]·tanh(A[r, a] + B[c, a])` for
    /// `r < m`, `c < n`, `a < k`, row-major with leading dimensions (`C` is overwritten).
    ///
    /// # Safety
    /// For non-empty shapes the pointers must address `(m-1)·lda + k`, `(n-1)·ldb + k` and
    /// `(m-1)·ldc + n` valid elements, and `w` `k`; `C` must not overlap the others.
    attnc_additive_nt(w: *const f32),
    accumulate: false,
    |g, a, b, c| additive::additive_nt(&g, a, b, c, w)
);

/// Additive attention scores on `isa` ([`attnc_additive_nt`]): `a` is `m × k`, `b` `n × k`,
/// `c` `m × n`, dense row-major, `w` of `k`.
pub fn additive_nt(
    isa: Isa,
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    alpha: f32,
    w: &[f32],
) -> Result<(), KernelError> {
    if !isa.is_supported() {
        return Err(KernelError::Unsupported(isa));
    }
    for (operand, len, need) in
        [("a", a.len(), m.saturating_mul(k)), ("b", b.len(), n.saturating_mul(k)), ("c", c.len(), m.saturating_mul(n)), ("w", w.len(), k)]
    {
        if len < need {
            return Err(KernelError::TooShort { operand, len, need });
        }
    }
    let g = Gemm { m, n, k, lda: k, ldb: k, ldc: n, alpha, accumulate: false, isa };
    // SAFETY: the slices hold the elements the shapes need and the path is supported.
    unsafe { additive::additive_nt(&g, a.as_ptr(), b.as_ptr(), c.as_mut_ptr(), w.as_ptr()) };
    Ok(())
}

/// C ABI: `y[i] = exp(x[i])` for `i < n` (`x` and `y` may be the same buffer).
///
/// # Safety
/// `x` and `y` must address `n` valid elements (unused when `n = 0`).
pub unsafe extern "C" fn attnc_exp_f32(x: *const f32, y: *mut f32, n: usize) {
    // SAFETY: forwarded from the caller's contract.
    unsafe { exp::exp_sum(isa(), x, 1.0, std::ptr::null(), y, n, 0.0) };
}

/// C ABI: `y[i] = exp(x[i] - shift)`, returning `Σ y`: one pass of the online softmax (scores
/// minus the running row max, and their sum), so the caller needs no separate subtract and sum
/// loops. `x` and `y` may be the same buffer.
///
/// # Safety
/// As [`attnc_exp_f32`]. A `shift` of `±inf` gives NaN for infinite `x` of the same sign; callers
/// skip rows whose max is `-inf` (fully masked).
pub unsafe extern "C" fn attnc_exp_sum_f32(x: *const f32, y: *mut f32, n: usize, shift: f32) -> f32 {
    // SAFETY: forwarded from the caller's contract.
    unsafe { exp::exp_sum(isa(), x, 1.0, std::ptr::null(), y, n, shift) }
}

/// C ABI: one online-softmax step over a row of scores `scale·x (+ bias)` (`bias` may be null):
/// updates the row's running `max` and `sum`, writes the unnormalised probabilities to `y`
/// (may be `x`), and returns the factor the row's accumulator must be scaled by. The shift
/// moves only when a score passes it by more than 8, so most tiles need no rescaling.
///
/// # Safety
/// As [`attnc_exp_f32`]; `bias` is null or addresses `n` elements; `max` and `sum` are valid.
#[allow(clippy::too_many_arguments)] // The C ABI is the point: one register or stack slot each.
pub unsafe extern "C" fn attnc_softmax_step_f32(
    x: *const f32,
    scale: f32,
    bias: *const f32,
    y: *mut f32,
    n: usize,
    max: *mut f32,
    sum: *mut f32,
) -> f32 {
    // SAFETY: forwarded from the caller's contract.
    unsafe { exp::softmax_step(isa(), exp::Scores { x, scale, bias, y, n }, max, sum) }
}

/// C ABI: softmax of one dense row of `n` elements, `y = exp(x - max) / Σ exp(x - max)` (`x`
/// may be `y`): 0 for a row with no element above `-inf`, NaN for a row with a NaN or `+inf`.
///
/// # Safety
/// As [`attnc_exp_f32`].
pub unsafe extern "C" fn attnc_softmax_row_f32(x: *const f32, y: *mut f32, n: usize) {
    // SAFETY: forwarded from the caller's contract.
    unsafe { exp::softmax_row(isa(), x, y, n) }
}

/// C ABI: `y[i] = tanh(x[i])` for `i < n` (`x` and `y` may be the same buffer).
///
/// # Safety
/// As [`attnc_exp_f32`].
pub unsafe extern "C" fn attnc_tanh_f32(x: *const f32, y: *mut f32, n: usize) {
    // SAFETY: forwarded from the caller's contract.
    unsafe { exp::tanh(isa(), x, y, n) }
}

/// C ABI: `y[i] = sigmoid(x[i])` for `i < n` (`x` may be `y`).
///
/// # Safety
/// As [`attnc_exp_f32`].
pub unsafe extern "C" fn attnc_sigmoid_f32(x: *const f32, y: *mut f32, n: usize) {
    // SAFETY: forwarded from the caller's contract.
    unsafe { rows::sigmoid(isa(), x, y, n) }
}

/// C ABI: `y[i] = gelu(x[i])` (the exact, erf form) for `i < n` (`x` may be `y`).
///
/// # Safety
/// As [`attnc_exp_f32`].
pub unsafe extern "C" fn attnc_gelu_f32(x: *const f32, y: *mut f32, n: usize) {
    // SAFETY: forwarded from the caller's contract.
    unsafe { rows::gelu(isa(), x, y, n) }
}

/// C ABI: layer norm (`rms = 0`) or RMS norm (`rms ≠ 0`) of one dense row of `n` elements,
/// in f64: `(x - mean) / sqrt(var + eps) · gamma (+ beta)`; `beta` may be null.
///
/// # Safety
/// `x`, `gamma` and `y` address `n` valid elements (`x` may be `y`), and so does a non-null `beta`.
pub unsafe extern "C" fn attnc_norm_row_f32(x: *const f32, gamma: *const f32, beta: *const f32, y: *mut f32, n: usize, eps: f64, rms: u32) {
    // SAFETY: forwarded from the caller's contract.
    unsafe { rows::norm_row(x, gamma, beta, y, n, eps, rms != 0) }
}

/// C ABI: one key row of a flash backward tile, its `n` queries along the row. With
/// `u = alpha·s[r]` (with `flags & 1`, `u = tanh(alpha·s[r])`, soft-capping) and
/// `x = factor·u + cbias + rbias[r]` (no `rbias` when null): the weight `p = exp(x - lse[r])`
/// (0 where `lse[r] = -inf`; with `flags & 2`, sigmoid weights `p = sigmoid(x)` and no `lse`,
/// `delta`), the score's adjoint `dF = p·(dp[r] - delta[r])` (sigmoid: `dp[r]·p·(1 - p)`), and
/// `dS = dF·∂x/∂s = dF·alpha·factor` (times `1 - u²` after `tanh`). Writes `p` over `s`, `dS`
/// over `dp`, `dF` to `df` unless it is null, and, unless `w` is null, `Σ dF` and `Σ dF·w[r]`
/// to `sums[0]`, `sums[1]` (a summed load's gradient).
///
/// # Safety
/// `s` and `dp` address `n` valid elements, and so do `lse` and `delta` (unless sigmoid),
/// `rbias`, `df` and `w` (unless null); `sums` holds two floats when `w` is not null; `df` and
/// `sums` do not overlap the others.
#[allow(clippy::too_many_arguments)] // The C ABI is the point: one register or stack slot each.
pub unsafe extern "C" fn attnc_flash_bwd_row(
    s: *mut f32,
    dp: *mut f32,
    lse: *const f32,
    delta: *const f32,
    rbias: *const f32,
    n: usize,
    alpha: f32,
    factor: f32,
    cbias: f32,
    flags: u32,
    df: *mut f32,
    w: *const f32,
    sums: *mut f32,
) {
    // SAFETY: forwarded from the caller's contract.
    unsafe { exp::flash_bwd_row(isa(), s, dp, lse, delta, rbias, n, (alpha, factor, cbias), flags, (df, w, sums)) }
}

/// Whether a paged product's rows of `B` (`n` keys for `Nt`, `k` for `Nn`, from `d.first`) lie
/// inside the table's row, and the pool holds a page.
fn rows_fit(d: &PagedRows, layout: gemm::Layout, n: usize, k: usize) -> bool {
    let count = if layout == gemm::Layout::Nt { n } else { k };
    d.page > 0 && d.pages > 0 && d.first.checked_add(count).is_some_and(|e| e <= d.table_len.saturating_mul(d.page))
}

/// The product of a few rows of `A` with `B` read in place from a paged KV cache
/// ([`PagedRows`]): the rows of `B` (`n` of them for `Nt`, `k` for `Nn`) must lie inside the
/// table's row and the pool hold a page, else nothing is done. With a `group` ([`HeadGroup`]),
/// the product of every head of the group: for head `h`, `A`, `C` and each page's rows offset by
/// the head's strides, the pages walked in memory order (`heads.rs`).
///
/// # Safety
/// `rows` points to a valid [`PagedRows`] whose table row holds `table_len` readable entries
/// and whose every page (of the clamped ids) holds its rows' elements; `A` and `C` as
/// [`attnc_sgemm_nt`]. With a group: `group` points to a valid [`HeadGroup`], and the above
/// holds for every head: head `h`'s rows lie at `h·b_stride` from each page's; `A_h` and `C_h`
/// (at `h·a_stride`, `h·c_stride`) as [`attnc_sgemm_nt`] says, no `C_h` overlapping another
/// head's `C` or any `A`.
unsafe fn gemv_paged(
    layout: gemm::Layout,
    shape: (usize, usize, usize),
    a: (*const f32, usize),
    (rows, group): (*const PagedRows, Option<*const HeadGroup>),
    c: (*mut f32, usize),
    alpha: f32,
    accumulate: u32,
) {
    let (m, n, k) = shape;
    // SAFETY: the caller's contract.
    let d = unsafe { *rows };
    if !rows_fit(&d, layout, n, k) {
        return;
    }
    match group {
        None => {
            let ldb = if layout == gemm::Layout::Nt { k } else { n };
            let g = Gemm { m, n, k, lda: a.1, ldb, ldc: c.1, alpha, accumulate: accumulate != 0, isa: isa() };
            // SAFETY: forwarded from the caller's contract; rows inside the table, as checked.
            unsafe { gemv::run_paged(&g, layout, a.0, &d, c.0) }
        }
        Some(group) => {
            // SAFETY: the caller's contract.
            let g = unsafe { *group };
            let s = heads::Shape { m, n, k, lda: a.1, ldc: c.1, alpha, accumulate: accumulate != 0 };
            // SAFETY: forwarded from the caller's contract; rows inside the table, as checked.
            unsafe { heads::run(isa(), layout, &s, a.0, &d, &g, c.0) }
        }
    }
}

/// Defines a C ABI entry point `fn(m, n, k, a, lda, rows, [group,] c, ldc, alpha, accumulate)`
/// of the paged few-rows product of layout `$layout` ([`gemv_paged`]), `rows` a [`PagedRows`];
/// with `group` (a [`HeadGroup`]), the grouped product.
macro_rules! paged_entry {
    ($(#[$doc:meta])* $name:ident, $layout:expr $(, $group:ident)?) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// As [`gemv_paged`].
        #[allow(clippy::too_many_arguments)] // The C ABI is the point: one register or stack slot each.
        pub unsafe extern "C" fn $name(
            m: usize,
            n: usize,
            k: usize,
            a: *const f32,
            lda: usize,
            rows: *const PagedRows,
            $($group: *const HeadGroup,)?
            c: *mut f32,
            ldc: usize,
            alpha: f32,
            accumulate: u32,
        ) {
            let groups: &[*const HeadGroup] = &[$($group)?];
            // SAFETY: forwarded.
            unsafe { gemv_paged($layout, (m, n, k), (a, lda), (rows, groups.first().copied()), (c, ldc), alpha, accumulate) }
        }
    };
}

paged_entry!(
    /// C ABI: [`attnc_gemv_nt`] with the key rows of `B` (`n` of them) read through a paged
    /// cache's block table.
    attnc_gemv_nt_paged,
    gemm::Layout::Nt
);

paged_entry!(
    /// C ABI: [`attnc_gemv_nn`] with the value rows of `B` (`k` of them) read through a paged
    /// cache's block table.
    attnc_gemv_nn_paged,
    gemm::Layout::Nn
);

paged_entry!(
    /// C ABI: [`attnc_gemv_nt_paged`] for a group of heads ([`HeadGroup`]), every head's key rows
    /// of a page read together.
    attnc_gemv_nt_paged_heads,
    gemm::Layout::Nt,
    group
);

paged_entry!(
    /// C ABI: [`attnc_gemv_nn_paged`] for a group of heads ([`HeadGroup`]), every head's value
    /// rows of a page read together.
    attnc_gemv_nn_paged_heads,
    gemm::Layout::Nn,
    group
);

/// C ABI: `dst[r·ldd + c] = src[r·lds + c]` for `r < rows`, `c < cols` (rows copied: a paged
/// cache's run of rows into a dense key tile).
///
/// # Safety
/// `src` addresses `(rows-1)·lds + cols` valid elements and `dst` `(rows-1)·ldd + cols`, not
/// overlapping; neither is read or written when `rows` or `cols` is 0.
pub unsafe extern "C" fn attnc_copy_rows(src: *const f32, lds: usize, rows: usize, cols: usize, dst: *mut f32, ldd: usize) {
    for r in 0..rows {
        // SAFETY: row `r` of each, `cols` elements, inside the caller's ranges.
        unsafe { std::ptr::copy_nonoverlapping(src.add(r * lds), dst.add(r * ldd), cols) };
    }
}

pub use dropout::DropoutTile;

/// C ABI: the 24 random bits of dropout element `(batch, i, j)` under `seed` (the integers read
/// as u32), as an i32: `attn_compiler::ir::semantics::dropout_bits`.
pub extern "C" fn attnc_dropout_bits(seed: i32, batch: i32, i: i32, j: i32) -> i32 {
    dropout::bits(seed as u32, batch as u32, i as u32, j as u32) as i32
}

/// C ABI: dropout applied in place to the `rows × cols` tile of weights at `p` (rows `ld`
/// apart) whose first element is score `(i0, j0) = (r0, c0)` (`(c0, r0)` when `keys_on_rows` is
/// non-zero: a transposed tile) of batch index `batch`: each element times `scale` where
/// [`attnc_dropout_bits`] is at least `threshold`, else 0.
///
/// # Safety
/// `p` addresses `(rows-1)·ld + cols` valid elements when `rows` and `cols` are non-zero.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn attnc_dropout_tile(
    p: *mut f32,
    ld: usize,
    rows: usize,
    cols: usize,
    r0: i64,
    c0: i64,
    keys_on_rows: i32,
    seed: i32,
    batch: i64,
    threshold: i32,
    scale: f32,
) {
    let t = DropoutTile {
        r0: r0 as u32,
        c0: c0 as u32,
        keys_on_rows: keys_on_rows != 0,
        seed: seed as u32,
        batch: batch as u32,
        threshold: threshold as u32,
        scale,
    };
    // SAFETY: forwarded from the caller's contract; `isa()` is supported by construction.
    unsafe { dropout::apply(isa(), p, ld, rows, cols, t) }
}

/// Dropout applied in place to the `rows × cols` tile of `p` (rows `ld` apart) on `isa` (see
/// [`attnc_dropout_tile`]).
pub fn dropout_tile(isa: Isa, p: &mut [f32], ld: usize, (rows, cols): (usize, usize), t: DropoutTile) -> Result<(), KernelError> {
    if !isa.is_supported() {
        return Err(KernelError::Unsupported(isa));
    }
    let need = if rows == 0 || cols == 0 { 0 } else { (rows - 1) * ld.max(cols) + cols };
    if p.len() < need || ld < cols {
        return Err(KernelError::TooShort { operand: "p", len: p.len(), need });
    }
    // SAFETY: checked above.
    unsafe { dropout::apply(isa, p.as_mut_ptr(), ld, rows, cols, t) };
    Ok(())
}

/// C ABI: `dst[c·ldd + r] = src[r·lds + c]` for `r < rows`, `c < cols` (a transposed copy).
///
/// # Safety
/// `src` addresses `(rows-1)·lds + cols` valid elements and `dst` `(cols-1)·ldd + rows`, not
/// overlapping; neither is read or written when `rows` or `cols` is 0.
pub unsafe extern "C" fn attnc_transpose_f32(src: *const f32, lds: usize, rows: usize, cols: usize, dst: *mut f32, ldd: usize) {
    // SAFETY: forwarded from the caller's contract.
    unsafe { rows::transpose(src, lds, rows, cols, dst, ldd) }
}

/// `y[i] = gelu(x[i])` on `isa`, the erf form within a few 1e-7 absolute of the exact one.
pub fn gelu(isa: Isa, x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    checked_row(rows::gelu, isa, x, y)
}

/// `y[i] = sigmoid(x[i]) = 1 / (1 + exp(-x[i]))` on `isa` (see [`attnc_sigmoid_f32`]).
pub fn sigmoid(isa: Isa, x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    checked_row(rows::sigmoid, isa, x, y)
}
