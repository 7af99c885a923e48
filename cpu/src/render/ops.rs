//! Per-element arithmetic on typed values, shared by element-wise kernels and the flash score
//! expressions: conversions, unary and binary ops, `where`, rounding to a storage type, and the
//! transcendental functions (exp, tanh, GELU's erfc, expm1 inline; log and pow through helpers).
//!
//! A value is a number (`F`: f32), an integer (`I`: i32) or a truth value (`B`). With
//! [`StepBuilder::lanes`] = 1 they are scalars (`B` is an `i8` 0/1); with 4 they are 128-bit vectors
//! (`B` is an `i32x4` lane mask), which is how element-wise loops and the flash score loop run
//! four elements at a time. Operations without a vector form run lane by lane.

use super::builder::StepBuilder;
use crate::abi::{self, Import};
use attn_compiler::ir::semantics::Class;
use attn_compiler::ir::{BinaryOp, DType, UnaryOp};
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{Endianness, InstBuilder, MemFlagsData, Type, Value, types};

/// A typed per-element value.
#[derive(Clone, Copy, Debug)]
pub struct Typed {
    /// The Cranelift value.
    pub v: Value,
    /// Its class.
    pub k: Class,
}

/// Where an index out of range is recorded: the fault record's buffer slot and the site.
#[derive(Clone, Copy)]
pub struct Checked {
    /// The slot of [`attn_compiler::schedule::BufferKind::Fault`].
    pub record: usize,
    /// The indexing site ([`attn_compiler::schedule::Schedule::sites`]).
    pub site: usize,
}

/// `x[idx...]` of a strided tensor, lane by lane when `fx` is vectorised; bool tensors come back
/// as masks. With `check`, an index outside `[0, size)` is recorded as a fault (a gather's
/// semantics: the run then fails) and the element read is a zero of the fault record; without
/// (the flash loads, whose indices the optimizer proved in range) indices are clamped into
/// their axes. Either way no read leaves the tensor.
pub fn clamped_load(
    fx: &mut StepBuilder,
    dtype: DType,
    base: Value,
    strides: &[Value],
    sizes: &[Value],
    idx: &[Value],
    check: Option<Checked>,
) -> Typed {
    let mem_kind = if Class::of(dtype) == Class::Float { Class::Float } else { Class::Int };
    let one = |fx: &mut StepBuilder, idx: &[Value]| -> Value {
        let mut off = fx.i64(0);
        let mut any_bad = None;
        for (axis, ((i, s), n)) in idx.iter().zip(strides).zip(sizes).enumerate() {
            let i = fx.b.ins().sextend(types::I64, *i);
            let i = if let Some(c) = check {
                // Unsigned: a negative index is out of range too (and every index of an empty
                // axis).
                let bad = fx.b.ins().icmp(IntCC::UnsignedGreaterThanOrEqual, i, *n);
                fx.if_then(bad, |fx| fault(fx, c, axis, i, *n));
                any_bad = Some(any_bad.map_or(bad, |a| fx.b.ins().bor(a, bad)));
                i
            } else {
                let (zero, one) = (fx.i64(0), fx.i64(1));
                let top = fx.sub(*n, one);
                let top = fx.max(top, zero);
                let i = fx.min(i, top);
                fx.max(i, zero)
            };
            let t = fx.mul(i, *s);
            off = fx.add(off, t);
        }
        let mut addr = fx.elem_addr(base, off);
        if let (Some(c), Some(bad)) = (check, any_bad) {
            // A bad index reads the (zeroed) fault record instead: a value, never a wild read.
            let record = fx.buf(c.record);
            addr = fx.b.ins().select(bad, record, addr);
        }
        fx.load(if mem_kind == Class::Float { types::F32 } else { types::I32 }, addr)
    };
    let v = if fx.lanes == 1 {
        one(fx, idx)
    } else {
        let lanes = fx.lanes;
        let mut out = if mem_kind == Class::Float { fx.fconst(0.0) } else { fx.iconst(0) };
        for lane in 0..lanes {
            let xs: Vec<Value> = idx.iter().map(|i| fx.b.ins().extractlane(*i, lane)).collect();
            fx.lanes = 1;
            let r = one(fx, &xs);
            fx.lanes = lanes;
            out = fx.b.ins().insertlane(out, r, lane);
        }
        out
    };
    let t = Typed { v, k: mem_kind };
    if Class::of(dtype) == Class::Bool { Typed { v: fx.cvt_b(t), k: Class::Bool } } else { t }
}

fn vec_flags() -> MemFlagsData {
    MemFlagsData::new().with_endianness(Endianness::Little)
}

impl StepBuilder<'_> {
    /// The Cranelift type of a class at the current lane count.
    pub fn ty(&self, k: Class) -> Type {
        match (k, self.lanes) {
            (Class::Float, 1) => types::F32,
            (Class::Int, 1) => types::I32,
            (Class::Bool, 1) => types::I8,
            (Class::Float, _) => types::F32X4,
            (Class::Int | Class::Bool, _) => types::I32X4,
        }
    }

    /// An f32 constant at the current lane count.
    pub fn fconst(&mut self, x: f32) -> Value {
        let s = self.b.ins().f32const(x);
        if self.lanes == 1 { s } else { self.b.ins().splat(types::F32X4, s) }
    }

    /// An i32 constant at the current lane count.
    pub fn iconst(&mut self, x: i64) -> Value {
        let s = self.b.ins().iconst(types::I32, x);
        if self.lanes == 1 { s } else { self.b.ins().splat(types::I32X4, s) }
    }

    /// A truth-value constant.
    pub fn bconst(&mut self, x: bool) -> Value {
        if self.lanes == 1 { self.b.ins().iconst(types::I8, i64::from(x)) } else { self.iconst(if x { -1 } else { 0 }) }
    }

    /// Broadcasts a scalar to the current lane count (identity for scalars).
    pub fn splat(&mut self, k: Class, scalar: Value) -> Value {
        if self.lanes == 1 {
            return scalar;
        }
        match k {
            Class::Float => self.b.ins().splat(types::F32X4, scalar),
            Class::Int => self.b.ins().splat(types::I32X4, scalar),
            Class::Bool => {
                let wide = self.b.ins().sextend(types::I32, scalar);
                let neg = self.b.ins().ineg(wide);
                self.b.ins().splat(types::I32X4, neg)
            }
        }
    }

    /// Converts to f32.
    pub fn cvt_f(&mut self, x: Typed) -> Value {
        match x.k {
            Class::Float => x.v,
            Class::Int => {
                let t = self.ty(Class::Float);
                self.b.ins().fcvt_from_sint(t, x.v)
            }
            Class::Bool => {
                let (one, zero) = (self.fconst(1.0), self.fconst(0.0));
                self.select_raw(x.v, one, zero)
            }
        }
    }

    /// Converts to i32 (floats truncate toward zero and saturate; NaN is 0).
    pub fn cvt_i(&mut self, x: Typed) -> Value {
        match x.k {
            Class::Float => {
                let t = self.ty(Class::Int);
                self.b.ins().fcvt_to_sint_sat(t, x.v)
            }
            Class::Int => x.v,
            Class::Bool => {
                if self.lanes == 1 {
                    self.b.ins().uextend(types::I32, x.v)
                } else {
                    let one = self.iconst(1);
                    self.b.ins().band(x.v, one)
                }
            }
        }
    }

    /// Converts to a truth value (non-zero is true; NaN is true).
    pub fn cvt_b(&mut self, x: Typed) -> Value {
        match x.k {
            Class::Float => {
                let z = self.fconst(0.0);
                self.b.ins().fcmp(FloatCC::NotEqual, x.v, z)
            }
            Class::Int => {
                let z = self.iconst(0);
                self.b.ins().icmp(IntCC::NotEqual, x.v, z)
            }
            Class::Bool => x.v,
        }
    }

    /// Converts to class `k`.
    pub fn cvt_kind(&mut self, x: Typed, k: Class) -> Typed {
        let v = match k {
            Class::Float => self.cvt_f(x),
            Class::Int => self.cvt_i(x),
            Class::Bool => self.cvt_b(x),
        };
        Typed { v, k }
    }

    /// Converts to `dtype`'s class and rounds to what `dtype` stores.
    pub fn round_to(&mut self, x: Typed, dtype: DType) -> Typed {
        let x = self.cvt_kind(x, Class::of(dtype));
        match dtype {
            DType::BF16 => Typed { v: self.round_bf16(x.v), k: Class::Float },
            DType::F16 => Typed { v: self.lanewise_f32(abi::ROUND_F16, &[x.v]), k: Class::Float },
            _ => x,
        }
    }

    /// `c ? a : b` on raw values of one type (`c` a truth value).
    pub fn select_raw(&mut self, c: Value, a: Value, b: Value) -> Value {
        if self.lanes == 1 {
            return self.b.ins().select(c, a, b);
        }
        let ty = self.b.func.dfg.value_type(a);
        let mask = if ty == types::I32X4 { c } else { self.b.ins().bitcast(ty, vec_flags(), c) };
        self.b.ins().bitselect(mask, a, b)
    }

    /// Calls a helper on every lane: f32 helpers directly, f64 helpers with widening.
    fn lanewise(&mut self, f: Import, args: &[Value]) -> Value {
        let wide = f.params.first() == Some(&types::F64);
        let one = |fx: &mut Self, xs: &[Value]| -> Value {
            let xs: Vec<Value> = xs.iter().map(|x| if wide { fx.b.ins().fpromote(types::F64, *x) } else { *x }).collect();
            let r = fx.call(f, &xs)[0];
            if wide { fx.b.ins().fdemote(types::F32, r) } else { r }
        };
        if self.lanes == 1 {
            return one(self, args);
        }
        let mut out = self.fconst(0.0);
        for lane in 0..self.lanes {
            let xs: Vec<Value> = args.iter().map(|a| self.b.ins().extractlane(*a, lane)).collect();
            let r = one(self, &xs);
            out = self.b.ins().insertlane(out, r, lane);
        }
        out
    }

    /// An i32 function of i32 arguments, lane by lane.
    pub fn lanewise_i32(&mut self, f: Import, args: &[Value]) -> Value {
        if self.lanes == 1 {
            return self.call(f, args)[0];
        }
        let mut out = self.iconst(0);
        for lane in 0..self.lanes {
            let xs: Vec<Value> = args.iter().map(|a| self.b.ins().extractlane(*a, lane)).collect();
            let r = self.call(f, &xs)[0];
            out = self.b.ins().insertlane(out, r, lane);
        }
        out
    }

    fn lanewise_f32(&mut self, f: Import, args: &[Value]) -> Value {
        self.lanewise(f, args)
    }

    /// Rounds f32 values to bf16 precision (nearest, ties to even; NaN stays NaN).
    fn round_bf16(&mut self, x: Value) -> Value {
        let ity = self.ty(Class::Int);
        let fl = if self.lanes == 1 { MemFlagsData::new() } else { vec_flags() };
        let bits = self.b.ins().bitcast(ity, fl, x);
        let shifted = self.b.ins().ushr_imm_s(bits, 16);
        let one = self.iconst(1);
        let lsb = self.b.ins().band(shifted, one);
        let bias = self.iconst(0x7FFF);
        let t = self.b.ins().iadd(bits, bias);
        let t = self.b.ins().iadd(t, lsb);
        let mask = self.iconst(0xFFFF_0000u32 as i32 as i64);
        let t = self.b.ins().band(t, mask);
        let fty = self.ty(Class::Float);
        let rounded = self.b.ins().bitcast(fty, fl, t);
        let nan = self.b.ins().fcmp(FloatCC::Unordered, x, x);
        self.select_raw(nan, x, rounded)
    }

    /// `e^x` (f32, ≈1 ulp; underflows to 0 below -87.3, `inf` above 88.7, NaN stays NaN).
    ///
    /// `n = round(x·log₂e)` by adding and subtracting `1.5·2²³` (the same round-to-nearest-even
    /// as `nearest`), and `2ⁿ` from the low bits of that sum: in range the same bits as clamping,
    /// rounding and converting, in 4 vector operations where those took about 23 (x86 lowers
    /// `fmin`, `fmax` and the saturating conversion to 7–8 instructions each). Out of range the
    /// lanes are garbage until the last three selects replace them.
    pub fn exp(&mut self, x: Value) -> Value {
        let (hi, lo) = (self.fconst(88.72283), self.fconst(-87.33654));
        let xc = x;
        let log2e = self.fconst(std::f32::consts::LOG2_E);
        let t = self.b.ins().fmul(xc, log2e);
        const ROUND: f32 = 12_582_912.0;
        let round = self.fconst(ROUND);
        let rounded = self.b.ins().fadd(t, round);
        let n = self.b.ins().fsub(rounded, round);
        let (c1, c2) = (self.fconst(0.693_359_4), self.fconst(-2.121_944_4e-4));
        let r = self.b.ins().fmul(n, c1);
        let r = self.b.ins().fsub(xc, r);
        let r2 = self.b.ins().fmul(n, c2);
        let r = self.b.ins().fsub(r, r2);
        let coeffs = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5e-1];
        let mut p = self.fconst(coeffs[0]);
        for c in &coeffs[1..] {
            let cv = self.fconst(*c);
            p = self.b.ins().fmul(p, r);
            p = self.b.ins().fadd(p, cv);
        }
        let rr = self.b.ins().fmul(r, r);
        p = self.b.ins().fmul(p, rr);
        p = self.b.ins().fadd(p, r);
        let one = self.fconst(1.0);
        p = self.b.ins().fadd(p, one);
        let ity = self.ty(Class::Int);
        let fl = if self.lanes == 1 { MemFlagsData::new() } else { vec_flags() };
        // bits(rounded) - bits(ROUND) = n; adding the exponent bias and shifting makes 2ⁿ.
        let bits = self.b.ins().bitcast(ity, fl, rounded);
        let bias = self.iconst(127 - ROUND.to_bits() as i64);
        let e = self.b.ins().iadd(bits, bias);
        let e = self.b.ins().ishl_imm_s(e, 23);
        let fty = self.ty(Class::Float);
        let scale = self.b.ins().bitcast(fty, fl, e);
        let y = self.b.ins().fmul(p, scale);
        // Outside the clamped range: 0 below, inf above; NaN fails both tests and stays NaN.
        let (inf, zero) = (self.fconst(f32::INFINITY), self.fconst(0.0));
        let over = self.b.ins().fcmp(FloatCC::GreaterThan, x, hi);
        let under = self.b.ins().fcmp(FloatCC::LessThan, x, lo);
        let y = self.select_raw(over, inf, y);
        let y = self.select_raw(under, zero, y);
        let nan = self.b.ins().fcmp(FloatCC::Unordered, x, x);
        self.select_raw(nan, x, y)
    }

    /// `1 / (1 + e^-x)`.
    pub fn sigmoid(&mut self, x: Value) -> Value {
        let nx = self.b.ins().fneg(x);
        let e = self.exp(nx);
        let one = self.fconst(1.0);
        let d = self.b.ins().fadd(one, e);
        self.b.ins().fdiv(one, d)
    }

    /// `x`'s sign bit on the non-negative `abs` (so that `f(-0) = -0` for odd `f`).
    fn with_sign_of(&mut self, abs: Value, x: Value) -> Value {
        let ity = self.ty(Class::Int);
        let fl = if self.lanes == 1 { MemFlagsData::new() } else { vec_flags() };
        let xb = self.b.ins().bitcast(ity, fl, x);
        let signmask = self.iconst(i64::from(i32::MIN));
        let sign = self.b.ins().band(xb, signmask);
        let ab = self.b.ins().bitcast(ity, fl, abs);
        let signed = self.b.ins().bor(ab, sign);
        let fty = self.ty(Class::Float);
        self.b.ins().bitcast(fty, fl, signed)
    }

    /// A polynomial in `x`, coefficients highest degree first (Horner).
    fn horner(&mut self, x: Value, coeffs: &[f32]) -> Value {
        let mut p = self.fconst(coeffs[0]);
        for c in &coeffs[1..] {
            let cv = self.fconst(*c);
            p = self.b.ins().fmul(p, x);
            p = self.b.ins().fadd(p, cv);
        }
        p
    }

    /// `tanh(x)`: an odd polynomial in `|x|` below 0.625, `1 - 2/(e^{2|x|} + 1)` above, with
    /// `x`'s sign on the result (so `tanh(-0) = -0`).
    pub fn tanh(&mut self, x: Value) -> Value {
        let ax = self.b.ins().fabs(x);
        let two = self.fconst(2.0);
        let t = self.b.ins().fmul(ax, two);
        let e = self.exp(t);
        let one = self.fconst(1.0);
        let d = self.b.ins().fadd(e, one);
        let q = self.b.ins().fdiv(two, d);
        let big = self.b.ins().fsub(one, q);
        let z = self.b.ins().fmul(ax, ax);
        let p = self.horner(z, &[-5.704_988_7e-3, 2.063_909e-2, -5.373_971_6e-2, 1.333_144_2e-1, -3.333_328e-1]);
        let p = self.b.ins().fmul(p, z);
        let p = self.b.ins().fmul(p, ax);
        let small = self.b.ins().fadd(p, ax);
        let limit = self.fconst(0.625);
        let is_small = self.b.ins().fcmp(FloatCC::LessThan, ax, limit);
        let abs = self.select_raw(is_small, small, big);
        self.with_sign_of(abs, x)
    }

    /// `erfc(z)` for `z ≥ 0` (Abramowitz & Stegun 7.1.26: `t·P(t)·e^{-z²}` with
    /// `t = 1/(1 + p·z)`), as the GELU row kernel computes it.
    fn erfc_pos(&mut self, z: Value) -> Value {
        let one = self.fconst(1.0);
        let p = self.fconst(0.327_591_1);
        let d = self.b.ins().fmul(z, p);
        let d = self.b.ins().fadd(one, d);
        let t = self.b.ins().fdiv(one, d);
        let poly = self.horner(t, &[1.061_405_4, -1.453_152_1, 1.421_413_8, -0.284_496_74, 0.254_829_6]);
        let poly = self.b.ins().fmul(poly, t);
        let z2 = self.b.ins().fmul(z, z);
        let nz2 = self.b.ins().fneg(z2);
        let e = self.exp(nz2);
        self.b.ins().fmul(poly, e)
    }

    /// `gelu(x) = x/2 · (1 + erf(x/√2))`, with `1 + erf(-z) = erfc(z)` taken directly for
    /// negative `x` so the far negative tail keeps its relative accuracy (as the row kernel).
    fn gelu(&mut self, x: Value) -> Value {
        let c = self.fconst(std::f32::consts::FRAC_1_SQRT_2);
        let ax = self.b.ins().fabs(x);
        let z = self.b.ins().fmul(ax, c);
        let erfc = self.erfc_pos(z);
        let two = self.fconst(2.0);
        let upper = self.b.ins().fsub(two, erfc);
        let zero = self.fconst(0.0);
        let negative = self.b.ins().fcmp(FloatCC::LessThan, x, zero);
        let one_plus_erf = self.select_raw(negative, erfc, upper);
        let half = self.fconst(0.5);
        let hx = self.b.ins().fmul(x, half);
        self.b.ins().fmul(hx, one_plus_erf)
    }

    /// `elu(x)`: `x` for `x ≥ 0` (so `elu(-0) = -0`), `expm1(x)` below: a Taylor polynomial
    /// for `x > -0.5` (no cancellation), `e^x - 1` further out.
    fn elu(&mut self, x: Value) -> Value {
        let e = self.exp(x);
        let one = self.fconst(1.0);
        let em1 = self.b.ins().fsub(e, one);
        let inv_fact = [1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5];
        let p = self.horner(x, &inv_fact);
        let x2 = self.b.ins().fmul(x, x);
        let p = self.b.ins().fmul(p, x2);
        let small = self.b.ins().fadd(p, x);
        let limit = self.fconst(-0.5);
        let near = self.b.ins().fcmp(FloatCC::GreaterThan, x, limit);
        let m1 = self.select_raw(near, small, em1);
        let zero = self.fconst(0.0);
        let keep = self.b.ins().fcmp(FloatCC::GreaterThanOrEqual, x, zero);
        self.select_raw(keep, x, m1)
    }

    /// A unary op in its natural class (floats for transcendental functions).
    pub fn unary(&mut self, op: UnaryOp, x: Typed) -> Typed {
        let int = x.k != Class::Float;
        match op {
            UnaryOp::Not => {
                let b = self.cvt_b(x);
                let t = self.bconst(true);
                Typed { v: self.b.ins().bxor(b, t), k: Class::Bool }
            }
            UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Relu | UnaryOp::Floor if int => {
                let v = self.cvt_i(x);
                let v = match op {
                    UnaryOp::Neg => self.b.ins().ineg(v),
                    UnaryOp::Abs => self.b.ins().iabs(v),
                    UnaryOp::Relu => {
                        let z = self.iconst(0);
                        self.b.ins().smax(v, z)
                    }
                    _ => v,
                };
                Typed { v, k: Class::Int }
            }
            _ => {
                let v = self.cvt_f(x);
                let r = match op {
                    UnaryOp::Neg => self.b.ins().fneg(v),
                    UnaryOp::Abs => self.b.ins().fabs(v),
                    UnaryOp::Floor => self.b.ins().floor(v),
                    UnaryOp::Relu => {
                        let z = self.fconst(0.0);
                        self.b.ins().fmax(v, z)
                    }
                    UnaryOp::Exp => self.exp(v),
                    UnaryOp::Log => self.lanewise(abi::LOG, &[v]),
                    UnaryOp::Sin => self.lanewise(abi::SIN, &[v]),
                    UnaryOp::Cos => self.lanewise(abi::COS, &[v]),
                    UnaryOp::Sqrt => self.b.ins().sqrt(v),
                    UnaryOp::Rsqrt => {
                        let s = self.b.ins().sqrt(v);
                        let one = self.fconst(1.0);
                        self.b.ins().fdiv(one, s)
                    }
                    UnaryOp::Tanh => self.tanh(v),
                    UnaryOp::Sigmoid => self.sigmoid(v),
                    UnaryOp::Silu => {
                        let s = self.sigmoid(v);
                        self.b.ins().fmul(v, s)
                    }
                    UnaryOp::Gelu => self.gelu(v),
                    UnaryOp::Elu => self.elu(v),
                    UnaryOp::Not => v,
                };
                Typed { v: r, k: Class::Float }
            }
        }
    }

    /// A binary op in its natural class: comparisons and logic give truth values, `/` and `**`
    /// floats, the rest integers when both sides are integers and floats otherwise.
    pub fn binary(&mut self, op: BinaryOp, a: Typed, b: Typed) -> Typed {
        let float = a.k == Class::Float || b.k == Class::Float;
        if op.is_logical() {
            let (x, y) = (self.cvt_b(a), self.cvt_b(b));
            let v = if op == BinaryOp::And { self.b.ins().band(x, y) } else { self.b.ins().bor(x, y) };
            return Typed { v, k: Class::Bool };
        }
        if op.is_comparison() {
            let v = if float {
                let (x, y) = (self.cvt_f(a), self.cvt_f(b));
                let cc = match op {
                    BinaryOp::Lt => FloatCC::LessThan,
                    BinaryOp::Le => FloatCC::LessThanOrEqual,
                    BinaryOp::Gt => FloatCC::GreaterThan,
                    BinaryOp::Ge => FloatCC::GreaterThanOrEqual,
                    BinaryOp::Eq => FloatCC::Equal,
                    _ => FloatCC::NotEqual,
                };
                self.b.ins().fcmp(cc, x, y)
            } else {
                let (x, y) = (self.cvt_i(a), self.cvt_i(b));
                let cc = match op {
                    BinaryOp::Lt => IntCC::SignedLessThan,
                    BinaryOp::Le => IntCC::SignedLessThanOrEqual,
                    BinaryOp::Gt => IntCC::SignedGreaterThan,
                    BinaryOp::Ge => IntCC::SignedGreaterThanOrEqual,
                    BinaryOp::Eq => IntCC::Equal,
                    _ => IntCC::NotEqual,
                };
                self.b.ins().icmp(cc, x, y)
            };
            return Typed { v, k: Class::Bool };
        }
        if float || op.is_always_float() {
            let (x, y) = (self.cvt_f(a), self.cvt_f(b));
            let v = match op {
                BinaryOp::Add => self.b.ins().fadd(x, y),
                BinaryOp::Sub => self.b.ins().fsub(x, y),
                BinaryOp::Mul => self.b.ins().fmul(x, y),
                BinaryOp::Div => self.b.ins().fdiv(x, y),
                BinaryOp::Min => self.b.ins().fmin(x, y),
                BinaryOp::Max => self.b.ins().fmax(x, y),
                BinaryOp::Pow => self.lanewise(abi::POW, &[x, y]),
                BinaryOp::Atan2 => self.lanewise(abi::ATAN2, &[x, y]),
                _ => self.lanewise(abi::REM, &[x, y]),
            };
            return Typed { v, k: Class::Float };
        }
        let (x, y) = (self.cvt_i(a), self.cvt_i(b));
        let v = match op {
            BinaryOp::Add => self.b.ins().iadd(x, y),
            BinaryOp::Sub => self.b.ins().isub(x, y),
            BinaryOp::Mul => self.b.ins().imul(x, y),
            BinaryOp::Min => self.b.ins().smin(x, y),
            BinaryOp::Max => self.b.ins().smax(x, y),
            _ => self.int_rem(x, y),
        };
        Typed { v, k: Class::Int }
    }

    /// Integer `%` with the sign of the divisor; 0 for a zero divisor and for `i32::MIN % -1`
    /// ([`attn_compiler::ir::semantics::rem_i`]).
    fn int_rem(&mut self, x: Value, y: Value) -> Value {
        if self.lanes > 1 {
            let mut out = self.iconst(0);
            let saved = self.lanes;
            for lane in 0..saved {
                let (xs, ys) = (self.b.ins().extractlane(x, lane), self.b.ins().extractlane(y, lane));
                self.lanes = 1;
                let r = self.int_rem(xs, ys);
                self.lanes = saved;
                out = self.b.ins().insertlane(out, r, lane);
            }
            return out;
        }
        // Divide by 1 instead of 0 or of -1 (which traps for i32::MIN); both give remainder 0.
        let zero = self.b.ins().iconst(types::I32, 0);
        let one = self.b.ins().iconst(types::I32, 1);
        let is_zero = self.b.ins().icmp_imm_s(IntCC::Equal, y, 0);
        let is_m1 = self.b.ins().icmp_imm_s(IntCC::Equal, y, -1);
        let bad = self.b.ins().bor(is_zero, is_m1);
        let safe = self.b.ins().select(bad, one, y);
        let r = self.b.ins().srem(x, safe);
        let r_neg = self.b.ins().icmp(IntCC::SignedLessThan, r, zero);
        let y_neg = self.b.ins().icmp(IntCC::SignedLessThan, y, zero);
        let differ = self.b.ins().bxor(r_neg, y_neg);
        let nonzero = self.b.ins().icmp(IntCC::NotEqual, r, zero);
        let fix = self.b.ins().band(differ, nonzero);
        let ry = self.b.ins().iadd(r, y);
        self.b.ins().select(fix, ry, r)
    }

    /// `where(c, a, b)` in the natural class of the branches.
    pub fn select(&mut self, c: Typed, a: Typed, b: Typed) -> Typed {
        let k = match (a.k, b.k) {
            (Class::Bool, Class::Bool) => Class::Bool,
            (Class::Float, _) | (_, Class::Float) => Class::Float,
            _ => Class::Int,
        };
        let c = self.cvt_b(c);
        let (x, y) = (self.cvt_kind(a, k), self.cvt_kind(b, k));
        Typed { v: self.select_raw(c, x.v, y.v), k }
    }
}

/// Records index `index` of `axis` (of size `size`) out of range at site `c` (cold path).
pub fn fault(fx: &mut StepBuilder, c: Checked, axis: usize, index: Value, size: Value) {
    let record = fx.buf(c.record);
    let site = fx.i64(c.site as i64);
    let axis = fx.i64(axis as i64);
    fx.call(crate::abi::INDEX_FAULT, &[record, site, axis, index, size]);
}
