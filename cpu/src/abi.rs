//! The calling contract between generated functions and the code they call, declared once: the
//! signature of every step function, and one table ([`IMPORTS`]) of the external functions
//! (microkernels of `attn-kernels`, scalar helpers of [`crate::helpers`]) with their Cranelift
//! signature and their address.
//!
//! The renderer names a callee by its table entry (`abi::SGEMM_NT`), the JIT declares every
//! entry of the table and binds it to the entry's address: both read the same row, so an import
//! and its symbol cannot drift apart. A symbol's name is the Rust function's own name.
//!
//! Generated code names its callees by symbol (`ExternalName::testcase`), which reads well in
//! `--emit clif`; the JIT re-points each call at its declaration.

use crate::helpers;
use attn_kernels as kernels;
use cranelift_codegen::ir::{AbiParam, Signature, Type, types};
use cranelift_codegen::isa::CallConv;

/// An external function generated code may call.
#[derive(Clone, Copy, Debug)]
pub struct Import {
    /// Symbol name (the Rust function's name).
    pub name: &'static str,
    /// Parameter types, in order.
    pub params: &'static [Type],
    /// Result types.
    pub returns: &'static [Type],
    /// The function's address.
    address: fn() -> *const u8,
}

impl Import {
    /// The Cranelift signature under `call_conv`.
    pub fn signature(&self, call_conv: CallConv) -> Signature {
        let mut sig = Signature::new(call_conv);
        sig.params.extend(self.params.iter().map(|t| AbiParam::new(*t)));
        sig.returns.extend(self.returns.iter().map(|t| AbiParam::new(*t)));
        sig
    }

    /// The address the JIT binds the symbol to.
    pub fn address(&self) -> *const u8 {
        (self.address)()
    }
}

const I64: Type = types::I64;
const I32: Type = types::I32;
const F32: Type = types::F32;
const F64: Type = types::F64;

/// Declares each import as a constant whose name and address come from the one function path,
/// and [`IMPORTS`], the table of all of them.
macro_rules! imports {
    ($($(#[$doc:meta])* $konst:ident = $module:ident :: $func:ident ($($param:expr),*) -> ($($ret:expr),*);)*) => {
        $(
            $(#[$doc])*
            pub const $konst: Import = Import {
                name: stringify!($func),
                params: &[$($param),*],
                returns: &[$($ret),*],
                address: || $module::$func as *const u8,
            };
        )*
        /// Every function generated code may call: what the renderer imports and the JIT binds.
        pub const IMPORTS: &[Import] = &[$($konst),*];
    };
}

imports! {
    /// `C[m×n] (+)= alpha·A[m×k]·B[n×k]ᵀ`: `(m, n, k, a, lda, b, ldb, c, ldc, alpha, accumulate)`.
    SGEMM_NT = kernels::attnc_sgemm_nt(I64, I64, I64, I64, I64, I64, I64, I64, I64, F32, I32) -> ();
    /// `C[m×n] (+)= alpha·A[m×k]·B[k×n]`: same parameters as [`SGEMM_NT`].
    SGEMM_NN = kernels::attnc_sgemm_nn(I64, I64, I64, I64, I64, I64, I64, I64, I64, F32, I32) -> ();
    /// [`SGEMM_NT`] for a few rows of `A` (streams `B` in place): same parameters.
    GEMV_NT = kernels::attnc_gemv_nt(I64, I64, I64, I64, I64, I64, I64, I64, I64, F32, I32) -> ();
    /// [`SGEMM_NN`] for a few rows of `A`: same parameters.
    GEMV_NN = kernels::attnc_gemv_nn(I64, I64, I64, I64, I64, I64, I64, I64, I64, F32, I32) -> ();
    /// [`GEMV_NT`] with `B`'s key rows read in place from a paged cache: `(m, n, k, a, lda,
    /// rows, c, ldc, alpha, accumulate)`, `rows` the address of a `kernels::PagedRows`.
    GEMV_NT_PAGED = kernels::attnc_gemv_nt_paged(I64, I64, I64, I64, I64, I64, I64, I64, F32, I32) -> ();
    /// [`GEMV_NN`] with `B`'s value rows read in place from a paged cache, as [`GEMV_NT_PAGED`].
    GEMV_NN_PAGED = kernels::attnc_gemv_nn_paged(I64, I64, I64, I64, I64, I64, I64, I64, F32, I32) -> ();
    /// [`GEMV_NT_PAGED`] for a group of heads, every head's rows of a page read together:
    /// `(m, n, k, a, lda, rows, group, c, ldc, alpha, accumulate)`, `group` the address of a
    /// `kernels::HeadGroup`.
    GEMV_NT_PAGED_HEADS = kernels::attnc_gemv_nt_paged_heads(I64, I64, I64, I64, I64, I64, I64, I64, I64, F32, I32) -> ();
    /// [`GEMV_NN_PAGED`] for a group of heads, as [`GEMV_NT_PAGED_HEADS`].
    GEMV_NN_PAGED_HEADS = kernels::attnc_gemv_nn_paged_heads(I64, I64, I64, I64, I64, I64, I64, I64, I64, F32, I32) -> ();
    /// Additive scores `C[r, c] = alpha · Σ_a w[a]·tanh(A[r, a] + B[c, a])` for `r < m`, `c < n`,
    /// `a < k`: `(m, n, k, a, lda, b, ldb, c, ldc, alpha, w)`.
    ADDITIVE_NT = kernels::attnc_additive_nt(I64, I64, I64, I64, I64, I64, I64, I64, I64, F32, I64) -> ();
    /// `y[i] = exp(x[i] - shift)`, returns `Σ y`: `(x, y, n, shift) -> sum`.
    EXP_SUM = kernels::attnc_exp_sum_f32(I64, I64, I64, F32) -> (F32);
    /// One online-softmax step over a row of scores `factor·x` (plus an optional key bias):
    /// updates the row's running max and sum and returns the accumulator's scale:
    /// `(x, factor, bias|0, y, n, &max, &sum) -> scale`.
    SOFTMAX_STEP = kernels::attnc_softmax_step_f32(I64, F32, I64, I64, I64, I64, I64) -> (F32);
    /// Softmax of one dense f32 row: `(x, y, n)`.
    SOFTMAX_ROW = kernels::attnc_softmax_row_f32(I64, I64, I64) -> ();
    /// `y[i] = tanh(x[i])`: `(x, y, n)`.
    TANH = kernels::attnc_tanh_f32(I64, I64, I64) -> ();
    /// `dst[c·ldd + r] = src[r·lds + c]` for `r < rows`, `c < cols`: `(src, lds, rows, cols, dst,
    /// ldd)`.
    TRANSPOSE = kernels::attnc_transpose_f32(I64, I64, I64, I64, I64, I64) -> ();
    /// `dst[r·ldd + c] = src[r·lds + c]` for `r < rows`, `c < cols`: `(src, lds, rows, cols,
    /// dst, ldd)`.
    COPY_ROWS = kernels::attnc_copy_rows(I64, I64, I64, I64, I64, I64) -> ();
    /// Dropout's 24 random bits: `(seed, batch, i, j) -> bits`.
    DROPOUT_BITS = kernels::attnc_dropout_bits(I32, I32, I32, I32) -> (I32);
    /// Dropout applied to a tile of weights in place: `(p, ld, rows, cols, r0, c0, keys_on_rows,
    /// seed, batch, threshold, scale)`.
    DROPOUT_TILE = kernels::attnc_dropout_tile(I64, I64, I64, I64, I64, I64, I32, I32, I64, I32, F32) -> ();

    /// One key row of a flash backward tile: `(s, dp, lse|0, delta|0, rbias|0, n, alpha, factor,
    /// cbias, flags, df|0, w|0, sums)`.
    FLASH_BWD_ROW = kernels::attnc_flash_bwd_row(I64, I64, I64, I64, I64, I64, F32, F32, F32, I32, I64, I64, I64) -> ();
    /// `y[i] = gelu(x[i])`: `(x, y, n)`.
    GELU = kernels::attnc_gelu_f32(I64, I64, I64) -> ();
    /// `y[i] = sigmoid(x[i])`: `(x, y, n)`.
    SIGMOID = kernels::attnc_sigmoid_f32(I64, I64, I64) -> ();
    /// Layer/RMS norm of one dense f32 row in f64: `(x, gamma, beta|0, y, n, eps, rms)`.
    NORM_ROW = kernels::attnc_norm_row_f32(I64, I64, I64, I64, I64, F64, I32) -> ();
    /// Natural log in f64.
    LOG = helpers::attnc_log_f64(F64) -> (F64);
    /// Sine in f64 (rounded to f32 by the caller, as `ir::semantics` does).
    SIN = helpers::attnc_sin_f64(F64) -> (F64);
    /// Cosine in f64.
    COS = helpers::attnc_cos_f64(F64) -> (F64);
    /// `atan2(y, x)` in f64.
    ATAN2 = helpers::attnc_atan2_f64(F64, F64) -> (F64);
    /// `x ** y` in f64.
    POW = helpers::attnc_pow_f64(F64, F64) -> (F64);
    /// Float `a % b` (`ir::semantics::rem_f`: the sign of `b`, NaN for `b = 0`).
    REM = helpers::attnc_rem_f64(F64, F64) -> (F64);
    /// Rounds an f32 to the nearest f16 value (returned as f32).
    ROUND_F16 = helpers::attnc_round_f16(F32) -> (F32);
    /// The stable sorting permutation of one strided row (f32, or i32 with flag bit 1; descending
    /// with bit 0), its first `places` entries: `(x, x_stride, n, out, out_stride, flags,
    /// places)`, strides in elements.
    ARGSORT_ROW = helpers::attnc_argsort_row(I64, I64, I64, I64, I64, I32, I64) -> ();
    /// Causal linear attention of one batch index: `(q, k, v, out, s, d, dv, block, reverse)`,
    /// dense f32.
    PREFIX_ATTENTION = helpers::attnc_prefix_attention(I64, I64, I64, I64, I64, I64, I64, I64, I32) -> ();
    /// Records an index out of range in the run's fault record (the first one wins): `(record,
    /// site, axis, index, size)`.
    INDEX_FAULT = helpers::attnc_index_fault(I64, I64, I64, I64, I64) -> ();
}

/// The signature of every step function:
/// `fn(bufs: *const *mut u8, ints: *const i64, lo: i64, hi: i64, scratch: *mut u8)`.
///
/// `bufs[b]` is buffer `b`'s address, `ints[i]` the integer table, `lo..hi` the work items to
/// run, `scratch` this thread's scratch memory (at least the size the runtime computes for the
/// step, 64-byte aligned).
pub fn step_signature(call_conv: CallConv) -> Signature {
    let mut sig = Signature::new(call_conv);
    sig.params.extend([AbiParam::new(I64); 5]);
    sig
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_import_has_a_distinct_name_and_an_address() {
        for (n, i) in IMPORTS.iter().enumerate() {
            assert!(!i.address().is_null(), "{}", i.name);
            assert!(i.name.starts_with("attnc_"), "{}", i.name);
            assert!(IMPORTS[..n].iter().all(|j| j.name != i.name && j.address() != i.address()), "{} twice", i.name);
        }
    }

    /// The kernels' dropout (its bits, and a tile in place, either orientation, on every ISA
    /// this machine runs) is the semantics' definition, at edge seeds and counters.
    #[test]
    fn kernel_dropout_is_the_semantics_definition() {
        use attn_compiler::ir::semantics::{dropout_bits, dropout_scale, dropout_threshold};
        let edges = [0, 1, -1, 7, 63, 64, 65, i32::MAX, i32::MIN, 123_456_789];
        for seed in edges {
            for batch in edges {
                for i in edges {
                    for j in edges {
                        let want = dropout_bits(seed, batch as u32, i as u32, j as u32) as i32;
                        assert_eq!(kernels::attnc_dropout_bits(seed, batch, i, j), want, "({seed}, {batch}, {i}, {j})");
                    }
                }
            }
        }
        let (rows, cols, ld, rate) = (7usize, 37usize, 40usize, 0.3);
        for isa in [kernels::Isa::Avx512, kernels::Isa::Avx2, kernels::Isa::Portable].into_iter().filter(|i| i.is_supported()) {
            for keys_on_rows in [false, true] {
                let mut p: Vec<f32> = (0..rows * ld).map(|x| x as f32 + 0.5).collect();
                let before = p.clone();
                let t = kernels::DropoutTile {
                    r0: 1000,
                    c0: 61,
                    keys_on_rows,
                    seed: (-5i32) as u32,
                    batch: 3,
                    threshold: dropout_threshold(rate),
                    scale: dropout_scale(rate) as f32,
                };
                kernels::dropout_tile(isa, &mut p, ld, (rows, cols), t).expect("tile fits");
                for r in 0..rows {
                    for c in 0..ld {
                        let (x, got) = (before[r * ld + c], p[r * ld + c]);
                        if c >= cols {
                            assert_eq!(got, x, "a column past the tile changed");
                            continue;
                        }
                        let (a, b) = (1000 + r as u32, 61 + c as u32);
                        let (i, j) = if keys_on_rows { (b, a) } else { (a, b) };
                        let keep = dropout_bits(-5, 3, i, j) >= dropout_threshold(rate);
                        let want = if keep { x * dropout_scale(rate) as f32 } else { 0.0 };
                        assert_eq!(got, want, "{isa:?} at ({r}, {c}), keys on rows {keys_on_rows}");
                    }
                }
            }
        }
    }
}
