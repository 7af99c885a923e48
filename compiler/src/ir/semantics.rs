//! The meaning of every scalar operation, with its edge cases, defined once.
//!
//! The reference interpreter evaluates element-wise nodes with these functions, and so does
//! the fused flash op's score modification and mask ([`super::ScoreExpr::eval`]). The CPU and
//! CUDA code generators emit code that computes the same values; a table-driven test runs every
//! op over edge values on the interpreter, the CPU target and the CUDA source (host emulation)
//! and demands the same bits (`runtime/src/semantics_tests.rs`). `docs/language.md` ("Numerics")
//! states the same rules for users.
//!
//! A value has one of three classes ([`Class`]): a float (f32), an integer (i32) or a truth
//! value. The rules:
//!
//! - **Floats are f32.** Every float op computes its exact result and rounds it to f32 once
//!   (`+ - * /`, `sqrt`, `floor`, `abs`, `%`, `min`, `max` are therefore bit-exact in every
//!   backend). `rsqrt(x)` is `1 / sqrt(x)` with both steps rounded, `sigmoid(x)` is
//!   `1 / (1 + exp(-x))` and `silu(x)` is `x · sigmoid(x)`, step by step. The transcendental
//!   functions (`exp`, `log`, `tanh`, `pow`, `gelu(x) = x/2 · erfc(-x/√2)`, and `expm1`
//!   inside `elu`) are defined as the f32 nearest the exact value (computed in f64 here);
//!   backends use approximations on ordinary finite values (documented bounds in
//!   `docs/language.md`) and give exactly these results on the special values (±0, ±inf,
//!   NaN, subnormals, overflow and underflow).
//! - **NaN**: `min`/`max` return NaN if either side is NaN, and order `-0 < +0`; comparisons
//!   with NaN are false except `!=`; `relu(NaN)` is NaN; NaN converted to bool is true and to
//!   i32 is 0.
//! - **Integers wrap** modulo 2³² (as Rust's `wrapping_*`, Cranelift and CUDA do): `+ - *`,
//!   `neg`, `abs(i32::MIN) = i32::MIN`. `/` and `**` of integers are float ops.
//! - **Remainder** has the sign of the divisor (Python): `fmod(x, y)`, plus `y` when the signs
//!   differ and the result is not 0. Float `x % 0` is NaN; integer `x % 0` is 0 (so is
//!   `i32::MIN % -1`).
//! - **Conversions**: int → float rounds to nearest (ties to even); float → int truncates toward
//!   zero and saturates at the i32 range (NaN → 0); anything → bool is `!= 0`; bool → number is
//!   0 or 1.
//! - **Classes of results**: comparisons, `&&`, `||`, `!` give truth values; `/`, `**` and the
//!   transcendental functions give floats; `+ - * % min max neg abs relu floor` give integers
//!   when every operand is an integer (or truth value) and floats otherwise.
//!
//! Softmax over a row (fused or not) is `exp(x - max) / Σ exp(x - max)` over the kept entries,
//! where `max` is the NaN-propagating maximum: a kept NaN or `+inf` score makes the row NaN, and
//! a row with no kept entry or only `-inf` entries is 0.
//!
//! Sorts (`argsort`, and `sort`/`topk` built on it) order by [`sorts_before`]: NaN above every
//! number, `-0 = +0`, ties by index (stable).
//!
//! Scans (`cumsum`, `cumprod`, `scan(a, b)`) accumulate along their axis in order (from the end
//! when reversed), in f64 for floats (`h = a·h + b` as a product, then a sum, each rounded in
//! f64: never an FMA) and in wrapping 64-bit integers for i32, each output rounded to its type
//! once.

use super::op::{BinaryOp, UnaryOp};
use super::types::DType;

/// What kind of number a value is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Class {
    /// f32.
    Float,
    /// i32.
    Int,
    /// A truth value.
    Bool,
}

impl Class {
    /// The class values of `dtype` compute in (f16 and bf16 compute as f32).
    pub fn of(dtype: DType) -> Class {
        match dtype {
            DType::F32 | DType::F16 | DType::BF16 => Class::Float,
            DType::I32 => Class::Int,
            DType::Bool => Class::Bool,
        }
    }

    /// The common class of two operands of arithmetic: float if either is, else int.
    fn join(self, other: Class) -> Class {
        if self == Class::Float || other == Class::Float { Class::Float } else { Class::Int }
    }
}

/// A scalar value with its class. A float holds an f32 value (kept in an `f64`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    /// An f32 value.
    F(f64),
    /// An i32 value.
    I(i32),
    /// A truth value.
    B(bool),
}

impl Scalar {
    /// A float, rounded to f32.
    pub fn float(x: f64) -> Scalar {
        Scalar::F(round_f32(x))
    }

    /// The class of the value.
    pub fn class(self) -> Class {
        match self {
            Scalar::F(_) => Class::Float,
            Scalar::I(_) => Class::Int,
            Scalar::B(_) => Class::Bool,
        }
    }

    /// An element of `dtype` (as the interpreter holds it, an f64) as a value of the dtype's
    /// class; a value the dtype cannot hold is first rounded as storing it would.
    pub fn load(dtype: DType, stored: f64) -> Scalar {
        match Class::of(dtype) {
            Class::Float => Scalar::F(dtype.round(stored)),
            Class::Int => Scalar::I(to_i32(stored)),
            Class::Bool => Scalar::B(stored != 0.0),
        }
    }

    /// The value as a float (ints rounded to the nearest f32, truth values 0 or 1).
    pub fn as_f(self) -> f64 {
        match self {
            Scalar::F(x) => x,
            Scalar::I(i) => round_f32(f64::from(i)),
            Scalar::B(b) => f64::from(u8::from(b)),
        }
    }

    /// The value as an i32 (floats truncated toward zero and saturated, NaN is 0).
    pub fn as_i(self) -> i32 {
        match self {
            Scalar::F(x) => to_i32(x),
            Scalar::I(i) => i,
            Scalar::B(b) => i32::from(b),
        }
    }

    /// The value as a truth value (`!= 0`; NaN is true).
    pub fn as_b(self) -> bool {
        match self {
            Scalar::F(x) => x != 0.0,
            Scalar::I(i) => i != 0,
            Scalar::B(b) => b,
        }
    }

    /// Converts to `class`.
    pub fn to(self, class: Class) -> Scalar {
        match class {
            Class::Float => Scalar::F(self.as_f()),
            Class::Int => Scalar::I(self.as_i()),
            Class::Bool => Scalar::B(self.as_b()),
        }
    }

    /// The value stored as an element of `dtype`: converted to the dtype's class and rounded to
    /// what the dtype holds (f16/bf16 round to nearest even), as an f64.
    pub fn store(self, dtype: DType) -> f64 {
        match dtype {
            DType::F32 | DType::F16 | DType::BF16 => dtype.round(self.as_f()),
            DType::I32 => f64::from(self.as_i()),
            DType::Bool => f64::from(u8::from(self.as_b())),
        }
    }
}

/// Rounds to the nearest f32 (ties to even).
pub fn round_f32(x: f64) -> f64 {
    f64::from(x as f32)
}

/// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the
/// generator FlashAttention and cuRAND use): ten rounds over the counter `ctr` under the key
/// `key`, bumped by the Weyl constants between rounds. Counter-based: any element's random bits
/// come from its counter alone, so a kernel can draw them in any order, and a backward pass
/// draws the same bits again instead of storing them.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    let (mut c, mut k) = (ctr, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(0x9E37_79B9), k[1].wrapping_add(0xBB67_AE85)];
        }
        let p0 = M0 * u64::from(c[0]);
        let p1 = M1 * u64::from(c[2]);
        c = [(p1 >> 32) as u32 ^ c[1] ^ k[0], p1 as u32, (p0 >> 32) as u32 ^ c[3] ^ k[1], p0 as u32];
    }
    c
}

/// Dropout (`dropout(x, rate, seed)`, fused or not): element `(batch, i, j)` of a tensor (`j` its
/// last index, `i` the one before, 0 for a vector, `batch` the row-major index over the axes
/// before those, modulo 2³²) is kept when [`dropout_bits`] of it is at least
/// [`dropout_threshold`]`(rate)`, and then scaled by [`dropout_scale`]`(rate)` (the product
/// rounded once); else it is 0. The chance of keeping is `1 − rate` to within 2⁻²⁴.
pub fn dropout_keeps(seed: i32, batch: u32, i: u32, j: u32, rate: f64) -> bool {
    dropout_bits(seed, batch, i, j) >= dropout_threshold(rate)
}

/// The 24 random bits of dropout element `(batch, i, j)` under `seed`: the top 24 bits of word
/// `w` of [`philox4x32_10`] with counter `(c, i, batch, 0)` and key `(seed, 0)`, where key `j` is
/// `64·b + 16·w + l` (`l < 16`) and `c = 16·b + l`. One generator call serves four keys, 16
/// apart: sixteen calls side by side (a vector of them) give 64 consecutive keys, word by word.
pub fn dropout_bits(seed: i32, batch: u32, i: u32, j: u32) -> u32 {
    philox4x32_10([dropout_counter(j), i, batch, 0], [seed as u32, 0])[((j >> 4) & 3) as usize] >> 8
}

/// The generator counter of key `j` ([`dropout_bits`]): `16·⌊j / 64⌋ + j mod 16`.
pub fn dropout_counter(j: u32) -> u32 {
    ((j >> 6) << 4) | (j & 15)
}

/// The smallest 24-bit value dropout keeps at `rate` (in `[0, 1)`): `⌈rate · 2²⁴⌉`, so that a
/// uniform `u = bits · 2⁻²⁴` is kept exactly when `u ≥ rate`.
pub fn dropout_threshold(rate: f64) -> u32 {
    (rate.clamp(0.0, 1.0) * f64::from(1u32 << 24)).ceil() as u32
}

/// The factor on kept elements: `1 / (1 − rate)` rounded to f32.
pub fn dropout_scale(rate: f64) -> f64 {
    round_f32(1.0 / (1.0 - rate))
}

/// Float to i32: truncates toward zero, saturates, NaN is 0 (Rust's `as`, Cranelift's
/// `fcvt_to_sint_sat`).
pub fn to_i32(x: f64) -> i32 {
    x as i32
}

/// A run-time size or position (i64) as an i32 value: wraps, as every backend's 32-bit
/// integers do.
pub fn wrap_i32(x: i64) -> i32 {
    x as i32
}

/// The class of `op`'s result for an operand of class `x`.
pub fn unary_class(op: UnaryOp, x: Class) -> Class {
    match op {
        UnaryOp::Not => Class::Bool,
        UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Relu | UnaryOp::Floor if x != Class::Float => Class::Int,
        _ => Class::Float,
    }
}

/// The class of `op`'s result for operands of classes `x` and `y`.
pub fn binary_class(op: BinaryOp, x: Class, y: Class) -> Class {
    if op.is_comparison() || op.is_logical() {
        Class::Bool
    } else if op.is_always_float() {
        Class::Float
    } else {
        x.join(y)
    }
}

/// The class of `where(c, a, b)` for branches of classes `a` and `b`.
pub fn select_class(a: Class, b: Class) -> Class {
    if a == Class::Bool && b == Class::Bool { Class::Bool } else { a.join(b) }
}

/// A unary op.
pub fn unary(op: UnaryOp, x: Scalar) -> Scalar {
    match unary_class(op, x.class()) {
        Class::Bool => Scalar::B(!x.as_b()),
        Class::Int => Scalar::I(unary_i(op, x.as_i())),
        Class::Float => Scalar::F(unary_f(op, x.as_f())),
    }
}

/// A unary op on an i32 (the ops whose integer form stays an integer).
fn unary_i(op: UnaryOp, x: i32) -> i32 {
    match op {
        UnaryOp::Neg => x.wrapping_neg(),
        UnaryOp::Abs => x.wrapping_abs(),
        UnaryOp::Relu => x.max(0),
        _ => x,
    }
}

/// A unary op on an f32 value.
pub fn unary_f(op: UnaryOp, x: f64) -> f64 {
    let r = round_f32;
    match op {
        UnaryOp::Neg => -x,
        UnaryOp::Not => f64::from(u8::from(x == 0.0)),
        UnaryOp::Abs => x.abs(),
        UnaryOp::Floor => x.floor(),
        UnaryOp::Relu => max_f(x, 0.0),
        UnaryOp::Sqrt => r(x.sqrt()),
        UnaryOp::Rsqrt => r(1.0 / r(x.sqrt())),
        UnaryOp::Exp => r(x.exp()),
        UnaryOp::Log => r(x.ln()),
        // f64 sine and cosine rounded once: ±inf and NaN give NaN.
        UnaryOp::Sin => r(x.sin()),
        UnaryOp::Cos => r(x.cos()),
        UnaryOp::Tanh => r(x.tanh()),
        UnaryOp::Sigmoid => sigmoid(x),
        UnaryOp::Silu => r(x * sigmoid(x)),
        UnaryOp::Gelu => r(0.5 * x * libm::erfc(-x * std::f64::consts::FRAC_1_SQRT_2)),
        UnaryOp::Elu => {
            if x > 0.0 {
                x
            } else {
                r(x.exp_m1())
            }
        }
    }
}

/// `1 / (1 + exp(-x))`, each step rounded to f32.
fn sigmoid(x: f64) -> f64 {
    let r = round_f32;
    r(1.0 / r(1.0 + r((-x).exp())))
}

/// A binary op.
pub fn binary(op: BinaryOp, x: Scalar, y: Scalar) -> Scalar {
    let class = x.class().join(y.class());
    if op.is_logical() {
        let (a, b) = (x.as_b(), y.as_b());
        return Scalar::B(if op == BinaryOp::And { a && b } else { a || b });
    }
    if op.is_comparison() {
        return Scalar::B(if class == Class::Float { compare(op, x.as_f(), y.as_f()) } else { compare(op, x.as_i(), y.as_i()) });
    }
    match binary_class(op, x.class(), y.class()) {
        Class::Int => Scalar::I(binary_i(op, x.as_i(), y.as_i())),
        _ => Scalar::F(binary_f(op, x.as_f(), y.as_f())),
    }
}

fn compare<T: PartialOrd>(op: BinaryOp, a: T, b: T) -> bool {
    match op {
        BinaryOp::Lt => a < b,
        BinaryOp::Le => a <= b,
        BinaryOp::Gt => a > b,
        BinaryOp::Ge => a >= b,
        BinaryOp::Eq => a == b,
        _ => a != b,
    }
}

/// An arithmetic op on two i32 values (wrapping).
fn binary_i(op: BinaryOp, a: i32, b: i32) -> i32 {
    match op {
        BinaryOp::Add => a.wrapping_add(b),
        BinaryOp::Sub => a.wrapping_sub(b),
        BinaryOp::Mul => a.wrapping_mul(b),
        BinaryOp::Min => a.min(b),
        BinaryOp::Max => a.max(b),
        _ => rem_i(a, b),
    }
}

/// An arithmetic op on two f32 values.
pub fn binary_f(op: BinaryOp, a: f64, b: f64) -> f64 {
    let r = round_f32;
    match op {
        BinaryOp::Add => r(a + b),
        BinaryOp::Sub => r(a - b),
        BinaryOp::Mul => r(a * b),
        BinaryOp::Div => r(a / b),
        BinaryOp::Rem => rem_f(a, b),
        BinaryOp::Pow => r(a.powf(b)),
        // f64 atan2 rounded once (IEEE's special cases: atan2(±0, -0) = ±π, atan2(±inf, ±inf) =
        // ±π/4 or ±3π/4, NaN in gives NaN).
        BinaryOp::Atan2 => r(a.atan2(b)),
        BinaryOp::Min => min_f(a, b),
        BinaryOp::Max => max_f(a, b),
        _ => f64::from(u8::from(compare(op, a, b))),
    }
}

/// Whether element `a` (at index `ia`) comes before `b` (at `ib`) in a sort along an axis:
/// ascending (or `descending`) by value with NaN above every number and `-0 = +0`, ties by
/// index, so sorts are stable and every backend gives the same order.
pub fn sorts_before(a: f64, ia: i64, b: f64, ib: i64, descending: bool) -> bool {
    let key = |x: f64| if x.is_nan() { (1u8, 0.0) } else { (0u8, if x == 0.0 { 0.0 } else { x }) };
    let (ka, kb) = (key(a), key(b));
    let (first, second) = if descending { (kb, ka) } else { (ka, kb) };
    if first.0 != second.0 {
        return first.0 < second.0;
    }
    if first.1 != second.1 {
        return first.1 < second.1;
    }
    ia < ib
}

/// A key whose unsigned order, ties broken by index, is [`sorts_before`]'s order: sorting
/// `(sort_key(x, descending), index)` pairs gives the same permutation, faster than comparing
/// through `sorts_before`. NaN is the largest key ascending and the smallest descending;
/// `-0` and `+0` share one key.
pub fn sort_key(x: f64, descending: bool) -> u64 {
    if x.is_nan() {
        return if descending { 0 } else { u64::MAX };
    }
    let v = if x == 0.0 {
        0.0
    } else if descending {
        -x
    } else {
        x
    };
    let bits = v.to_bits();
    // Negative numbers: flip every bit; others: set the sign bit. Never 0 or u64::MAX for a
    // number (the largest is +inf's 0xfff0...0, the smallest -inf's 0x000f...f).
    if bits >> 63 == 1 { !bits } else { bits | (1 << 63) }
}

/// `a % b` with the sign of `b`; NaN for `b = 0`.
pub fn rem_f(a: f64, b: f64) -> f64 {
    let m = a % b;
    if m != 0.0 && (m < 0.0) != (b < 0.0) { round_f32(m + b) } else { m }
}

/// `a % b` with the sign of `b`; 0 for `b = 0` and for `i32::MIN % -1`.
pub fn rem_i(a: i32, b: i32) -> i32 {
    if b == 0 || b == -1 {
        return 0;
    }
    let m = a % b;
    if m != 0 && (m < 0) != (b < 0) { m + b } else { m }
}

/// The larger of two floats: NaN if either is NaN; `+0` is larger than `-0`.
pub fn max_f(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else if a == b {
        // Only ±0 differ among equal values: +0 wins.
        if a.is_sign_negative() { b } else { a }
    } else {
        a.max(b)
    }
}

/// The smaller of two floats: NaN if either is NaN; `-0` is smaller than `+0` (the mirror of
/// [`max_f`]).
pub fn min_f(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() { f64::NAN } else { -max_f(-a, -b) }
}

/// `where(c, a, b)`: the chosen branch in the common class of both.
pub fn select(c: Scalar, a: Scalar, b: Scalar) -> Scalar {
    let class = select_class(a.class(), b.class());
    if c.as_b() { a.to(class) } else { b.to(class) }
}

/// Edge values every float op is tested on: signed zeros, infinities, NaN, the smallest
/// subnormal and normal, the largest finite value, ±1, halves, and the i32 limits as floats.
pub const FLOAT_EDGES: &[f32] = &[
    0.0,
    -0.0,
    f32::INFINITY,
    f32::NEG_INFINITY,
    f32::NAN,
    1e-45,
    -1e-45,
    f32::MIN_POSITIVE,
    f32::MAX,
    -f32::MAX,
    1.0,
    -1.0,
    0.5,
    -2.5,
    3.0,
    2147483648.0,
    -2147483648.0,
];

/// Edge values every integer op is tested on.
pub const INT_EDGES: &[i32] = &[0, 1, -1, 2, -3, 7, i32::MAX, i32::MIN, i32::MAX - 1, i32::MIN + 1, 65536];

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known-answer vectors for Philox4x32-10.
    #[test]
    fn philox_matches_the_known_answers() {
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]);
        assert_eq!(
            philox4x32_10([0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344], [0xa409_3822, 0x299f_31d0]),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    /// The keep rate is `1 - rate` and the thresholds are exact at the ends.
    #[test]
    fn dropout_keeps_one_minus_rate() {
        assert_eq!(dropout_threshold(0.0), 0);
        assert_eq!(dropout_threshold(0.5), 1 << 23);
        for rate in [0.1, 0.5, 0.9] {
            let n = 200_000u32;
            let kept = (0..n).filter(|&j| dropout_keeps(7, 3, j / 1000, j % 1000, rate)).count() as f64;
            let p = 1.0 - rate;
            // Five standard deviations of a binomial count.
            let sd = (f64::from(n) * p * rate).sqrt();
            assert!((kept - f64::from(n) * p).abs() < 5.0 * sd, "rate {rate}: kept {kept} of {n}");
        }
    }

    /// `sort_key` with index ties orders exactly as `sorts_before`, over edge values.
    #[test]
    fn sort_keys_order_as_sorts_before() {
        let values =
            [f64::NAN, -f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, 1.0, -1.0, 1e-310, -1e-310, 3.5, -3.5, f64::MAX, f64::MIN];
        for descending in [false, true] {
            for (ia, &a) in values.iter().enumerate() {
                for (ib, &b) in values.iter().enumerate() {
                    if ia == ib {
                        continue;
                    }
                    let by_key = (sort_key(a, descending), ia) < (sort_key(b, descending), ib);
                    assert_eq!(
                        by_key,
                        sorts_before(a, ia as i64, b, ib as i64, descending),
                        "{a} at {ia} vs {b} at {ib}, descending {descending}"
                    );
                }
            }
        }
    }

    fn f(x: f64) -> Scalar {
        Scalar::F(x)
    }

    fn bits(s: Scalar) -> (u64, bool) {
        match s {
            Scalar::F(x) => (if x.is_nan() { 0 } else { x.to_bits() }, x.is_nan()),
            Scalar::I(i) => (i as u64, false),
            Scalar::B(b) => (u64::from(b), false),
        }
    }

    #[test]
    fn edge_cases_are_decided() {
        // Remainder: sign of the divisor, NaN / 0 for a zero divisor.
        assert_eq!(binary(BinaryOp::Rem, f(-7.0), f(3.0)), f(2.0));
        assert!(binary_f(BinaryOp::Rem, 1.0, 0.0).is_nan());
        assert_eq!(binary(BinaryOp::Rem, Scalar::I(7), Scalar::I(0)), Scalar::I(0));
        assert_eq!(binary(BinaryOp::Rem, Scalar::I(i32::MIN), Scalar::I(-1)), Scalar::I(0));
        assert_eq!(binary(BinaryOp::Rem, Scalar::I(-7), Scalar::I(3)), Scalar::I(2));
        // Integers wrap.
        assert_eq!(binary(BinaryOp::Add, Scalar::I(i32::MAX), Scalar::I(1)), Scalar::I(i32::MIN));
        assert_eq!(binary(BinaryOp::Mul, Scalar::I(65536), Scalar::I(65536)), Scalar::I(0));
        assert_eq!(unary(UnaryOp::Abs, Scalar::I(i32::MIN)), Scalar::I(i32::MIN));
        // Integer division is a float op of the operands converted to f32.
        assert_eq!(binary(BinaryOp::Div, Scalar::I(7), Scalar::I(2)), f(3.5));
        // NaN through min, max, comparisons; signed zeros ordered.
        assert!(matches!(binary(BinaryOp::Max, f(f64::NAN), f(1.0)), Scalar::F(x) if x.is_nan()));
        assert_eq!(bits(binary(BinaryOp::Max, f(-0.0), f(0.0))), bits(f(0.0)));
        assert_eq!(bits(binary(BinaryOp::Min, f(0.0), f(-0.0))), bits(f(-0.0)));
        assert_eq!(binary(BinaryOp::Lt, f(f64::NAN), f(1.0)), Scalar::B(false));
        assert_eq!(binary(BinaryOp::Ne, f(f64::NAN), f(f64::NAN)), Scalar::B(true));
        assert_eq!(bits(unary(UnaryOp::Relu, f(-0.0))), bits(f(0.0)));
        // Conversions.
        assert_eq!(f(f64::NAN).as_i(), 0);
        assert_eq!(f(3e10).as_i(), i32::MAX);
        assert_eq!(f(-2.7).as_i(), -2);
        assert!(f(f64::NAN).as_b());
        assert_eq!(Scalar::I(16_777_217).as_f(), 16_777_216.0);
        // Classes.
        assert_eq!(binary(BinaryOp::Add, Scalar::I(1), f(0.5)), f(1.5));
        assert_eq!(select(Scalar::B(true), Scalar::I(2), f(0.5)), f(2.0));
        assert_eq!(unary(UnaryOp::Neg, Scalar::B(true)), Scalar::I(-1));
    }

    #[test]
    fn float_results_are_f32_values() {
        for &x in FLOAT_EDGES {
            for &y in FLOAT_EDGES {
                for op in [BinaryOp::Add, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Rem, BinaryOp::Pow] {
                    let v = binary_f(op, f64::from(x), f64::from(y));
                    assert!(v.is_nan() || v == round_f32(v), "{op:?}({x}, {y}) = {v}");
                }
            }
            for op in [UnaryOp::Exp, UnaryOp::Gelu, UnaryOp::Sigmoid, UnaryOp::Rsqrt] {
                let v = unary_f(op, f64::from(x));
                assert!(v.is_nan() || v == round_f32(v), "{op:?}({x}) = {v}");
            }
        }
    }
}
