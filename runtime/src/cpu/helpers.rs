//! Scalar helpers generated code calls for the rare operations that have no Cranelift
//! instruction and are not worth inlining (log, sin, cos, pow, Python's `%`, f16 rounding). The hot
//! transcendental functions (exp, tanh, sigmoid, erf) are inlined instead; the dense tile products
//! and the softmax exp pass are the microkernels of [`crate::kernels`].

use attn_compiler::ir::semantics;

/// Natural log.
pub extern "C" fn attnc_log_f64(x: f64) -> f64 {
    x.ln()
}

/// Sine, in f64 (the caller rounds to f32).
pub extern "C" fn attnc_sin_f64(x: f64) -> f64 {
    x.sin()
}

/// Cosine, in f64.
pub extern "C" fn attnc_cos_f64(x: f64) -> f64 {
    x.cos()
}

/// `atan2(y, x)`, in f64.
pub extern "C" fn attnc_atan2_f64(y: f64, x: f64) -> f64 {
    y.atan2(x)
}

/// `x ** y`.
pub extern "C" fn attnc_pow_f64(x: f64, y: f64) -> f64 {
    x.powf(y)
}

/// Float `a % b`: [`semantics::rem_f`] (the sign of `b`, NaN for `b = 0`).
pub extern "C" fn attnc_rem_f64(a: f64, b: f64) -> f64 {
    semantics::rem_f(a, b)
}

/// The nearest f16 value of `x`, as f32.
pub extern "C" fn attnc_round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// The helpers as `(symbol name, address)`, for the JIT to register.
pub fn symbols() -> Vec<(&'static str, *const u8)> {
    vec![
        ("attnc_log_f64", attnc_log_f64 as *const u8),
        ("attnc_sin_f64", attnc_sin_f64 as *const u8),
        ("attnc_cos_f64", attnc_cos_f64 as *const u8),
        ("attnc_atan2_f64", attnc_atan2_f64 as *const u8),
        ("attnc_pow_f64", attnc_pow_f64 as *const u8),
        ("attnc_rem_f64", attnc_rem_f64 as *const u8),
        ("attnc_round_f16", attnc_round_f16 as *const u8),
    ]
}
