//! The calling contract between generated functions and the runtime: the signature of every
//! step function and the external symbols (microkernels and scalar helpers) they call.
//!
//! Generated code names its callees by symbol (`ExternalName::testcase`), which reads well in
//! `--emit clif`; the runtime resolves each name against the addresses it registers and checks
//! that every name in [`IMPORTS`] is provided.

use cranelift_codegen::ir::{AbiParam, Signature, types};
use cranelift_codegen::isa::CallConv;

/// An external function generated code may call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Import {
    /// Symbol name.
    pub name: &'static str,
    /// Parameter types, in order.
    pub params: &'static [cranelift_codegen::ir::Type],
    /// Result types.
    pub returns: &'static [cranelift_codegen::ir::Type],
}

const I64: cranelift_codegen::ir::Type = types::I64;
const I32: cranelift_codegen::ir::Type = types::I32;
const F32: cranelift_codegen::ir::Type = types::F32;
const F64: cranelift_codegen::ir::Type = types::F64;

/// `C[m×n] (+)= alpha·A[m×k]·B[n×k]ᵀ`: `(m, n, k, a, lda, b, ldb, c, ldc, alpha, accumulate)`.
pub const SGEMM_NT: Import =
    Import { name: "attnc_sgemm_nt", params: &[I64, I64, I64, I64, I64, I64, I64, I64, I64, F32, I32], returns: &[] };
/// `C[m×n] (+)= alpha·A[m×k]·B[k×n]`: same parameters as [`SGEMM_NT`].
pub const SGEMM_NN: Import =
    Import { name: "attnc_sgemm_nn", params: &[I64, I64, I64, I64, I64, I64, I64, I64, I64, F32, I32], returns: &[] };
/// [`SGEMM_NT`] for a few rows of `A` (streams `B` in place): same parameters.
pub const GEMV_NT: Import = Import { name: "attnc_gemv_nt", params: SGEMM_NT.params, returns: &[] };
/// [`SGEMM_NN`] for a few rows of `A`: same parameters.
pub const GEMV_NN: Import = Import { name: "attnc_gemv_nn", params: SGEMM_NN.params, returns: &[] };
/// Additive scores `C[r, c] = alpha · Σ_a w[a]·tanh(A[r, a] + B[c, a])` for `r < m`, `c < n`,
/// `a < k`: `(m, n, k, a, lda, b, ldb, c, ldc, alpha, w)` (see the runtime's
/// `attnc_additive_nt`).
pub const ADDITIVE_NT: Import =
    Import { name: "attnc_additive_nt", params: &[I64, I64, I64, I64, I64, I64, I64, I64, I64, F32, I64], returns: &[] };
/// `y[i] = exp(x[i] - shift)`, returns `Σ y`: `(x, y, n, shift) -> sum`.
pub const EXP_SUM: Import = Import { name: "attnc_exp_sum_f32", params: &[I64, I64, I64, F32], returns: &[F32] };
/// One online-softmax step over a row of scores `factor·x` (plus an optional key bias): updates
/// the row's running max and sum and returns the accumulator's scale:
/// `(x, factor, bias|0, y, n, &max, &sum) -> scale`.
pub const SOFTMAX_STEP: Import = Import { name: "attnc_softmax_step_f32", params: &[I64, F32, I64, I64, I64, I64, I64], returns: &[F32] };
/// Softmax of one dense f32 row: `(x, y, n)`.
pub const SOFTMAX_ROW: Import = Import { name: "attnc_softmax_row_f32", params: &[I64, I64, I64], returns: &[] };
/// `y[i] = tanh(x[i])`: `(x, y, n)`.
pub const TANH: Import = Import { name: "attnc_tanh_f32", params: &[I64, I64, I64], returns: &[] };
/// `dst[c·ldd + r] = src[r·lds + c]` for `r < rows`, `c < cols`: `(src, lds, rows, cols, dst,
/// ldd)`.
pub const TRANSPOSE: Import = Import { name: "attnc_transpose_f32", params: &[I64, I64, I64, I64, I64, I64], returns: &[] };
/// One key row of a flash backward tile: `(s, dp, lse|0, delta|0, rbias|0, n, alpha, factor,
/// cbias, flags, df|0, w|0, sums)` (see the runtime's `attnc_flash_bwd_row`).
pub const FLASH_BWD_ROW: Import =
    Import { name: "attnc_flash_bwd_row", params: &[I64, I64, I64, I64, I64, I64, F32, F32, F32, I32, I64, I64, I64], returns: &[] };
/// `y[i] = sigmoid(x[i])`: `(x, y, n)`.
pub const SIGMOID: Import = Import { name: "attnc_sigmoid_f32", params: &[I64, I64, I64], returns: &[] };
/// `y[i] = gelu(x[i])`: `(x, y, n)`.
pub const GELU: Import = Import { name: "attnc_gelu_f32", params: &[I64, I64, I64], returns: &[] };
/// Layer/RMS norm of one dense f32 row in f64: `(x, gamma, beta|0, y, n, eps, rms)`.
pub const NORM_ROW: Import = Import { name: "attnc_norm_row_f32", params: &[I64, I64, I64, I64, I64, F64, I32], returns: &[] };
/// Natural log in f64.
pub const LOG: Import = Import { name: "attnc_log_f64", params: &[F64], returns: &[F64] };
/// Sine in f64 (rounded to f32 by the caller, as `ir::semantics` does).
pub const SIN: Import = Import { name: "attnc_sin_f64", params: &[F64], returns: &[F64] };
/// `atan2(y, x)` in f64.
pub const ATAN2: Import = Import { name: "attnc_atan2_f64", params: &[F64, F64], returns: &[F64] };
/// Cosine in f64.
pub const COS: Import = Import { name: "attnc_cos_f64", params: &[F64], returns: &[F64] };
/// `x ** y` in f64.
pub const POW: Import = Import { name: "attnc_pow_f64", params: &[F64, F64], returns: &[F64] };
/// Float `a % b` ([`crate::ir::semantics::rem_f`]: the sign of `b`, NaN for `b = 0`).
pub const REM: Import = Import { name: "attnc_rem_f64", params: &[F64, F64], returns: &[F64] };
/// Rounds an f32 to the nearest f16 value (returned as f32).
pub const ROUND_F16: Import = Import { name: "attnc_round_f16", params: &[F32], returns: &[F32] };

/// The stable sorting permutation of one strided row (f32, or i32 with flag bit 1; descending
/// with bit 0), its first `places` entries: `(x, x_stride, n, out, out_stride, flags, places)`,
/// strides in elements.
pub const ARGSORT_ROW: Import = Import { name: "attnc_argsort_row", params: &[I64, I64, I64, I64, I64, I32, I64], returns: &[] };

/// Causal linear attention of one batch index: `(q, k, v, out, s, d, dv, block, reverse)`, dense
/// f32 (see the runtime's `attnc_prefix_attention`).
pub const PREFIX_ATTENTION: Import =
    Import { name: "attnc_prefix_attention", params: &[I64, I64, I64, I64, I64, I64, I64, I64, I32], returns: &[] };

/// Records an index out of range in the run's fault record (the first one wins): `(record,
/// site, axis, index, size)` (see the runtime's `attnc_index_fault`).
pub const INDEX_FAULT: Import = Import { name: "attnc_index_fault", params: &[I64, I64, I64, I64, I64], returns: &[] };

/// Every symbol generated code may import.
pub const IMPORTS: &[Import] = &[
    SGEMM_NT,
    SGEMM_NN,
    GEMV_NT,
    GEMV_NN,
    ADDITIVE_NT,
    EXP_SUM,
    SOFTMAX_STEP,
    SOFTMAX_ROW,
    TANH,
    TRANSPOSE,
    FLASH_BWD_ROW,
    GELU,
    SIGMOID,
    NORM_ROW,
    LOG,
    SIN,
    COS,
    ATAN2,
    POW,
    REM,
    ROUND_F16,
    ARGSORT_ROW,
    PREFIX_ATTENTION,
    INDEX_FAULT,
];

impl Import {
    /// The Cranelift signature under `call_conv`.
    pub fn signature(&self, call_conv: CallConv) -> Signature {
        let mut sig = Signature::new(call_conv);
        sig.params.extend(self.params.iter().map(|t| AbiParam::new(*t)));
        sig.returns.extend(self.returns.iter().map(|t| AbiParam::new(*t)));
        sig
    }
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
