//! Scaffolding shared by every kernel emitter: the step function's signature and arguments,
//! integer-table and buffer-address loads, structured loops and branches, and external calls.
//!
//! Emitters load every integer and address they need in the entry block (the "prologue")
//! before opening loops, so those values dominate every use; [`StepBuilder::int`] only caches values
//! loaded there. Every integer comes from the schedule's integer table; a value the table lacks
//! is a code generator bug, recorded by [`StepBuilder::fail`] and reported by the caller.

use super::ops::Typed;
use crate::abi::{Import, step_signature};
use attn_compiler::ir::Dim;
use attn_compiler::ir::semantics::Class;
use attn_compiler::schedule::{IntValue, Schedule, Tuning, View};
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{
    Block, ExtFuncData, ExternalName, FuncRef, Function, InstBuilder, MemFlagsData, Type, UserFuncName, Value, types,
};
use cranelift_codegen::isa::{CallConv, TargetFrontendConfig};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext, Variable};
use std::collections::HashMap;
use target_lexicon::PointerWidth;

/// Memory flags of every access generated code makes: in bounds and aligned by construction.
pub fn mem() -> MemFlagsData {
    MemFlagsData::trusted()
}

/// Builds one step function.
pub struct StepBuilder<'a> {
    /// The Cranelift builder.
    pub b: FunctionBuilder<'a>,
    /// The schedule being rendered.
    pub schedule: &'a Schedule,
    /// What could not be rendered (a code generator bug when not empty).
    pub failures: Vec<String>,
    call_conv: CallConv,
    entry: Block,
    /// `bufs`, `ints`, `lo`, `hi`, `scratch`.
    args: [Value; 5],
    ints: HashMap<usize, Value>,
    bufs: HashMap<usize, Value>,
    funcs: HashMap<&'static str, FuncRef>,
    /// Lanes per value in [`super::ops`]: 1 (scalars) or 4 (128-bit vectors).
    pub lanes: u8,
}

/// Starts a step function named `name`.
pub fn new_function(name: &str, call_conv: CallConv) -> Function {
    Function::with_name_signature(UserFuncName::testcase(name), step_signature(call_conv))
}

impl<'a> StepBuilder<'a> {
    /// Opens the entry block of `func`.
    pub fn new(
        func: &'a mut Function,
        ctx: &'a mut FunctionBuilderContext,
        schedule: &'a Schedule,
        call_conv: CallConv,
    ) -> StepBuilder<'a> {
        let mut b = FunctionBuilder::new(func, ctx);
        let entry = b.create_block();
        b.append_block_params_for_function_params(entry);
        b.switch_to_block(entry);
        b.seal_block(entry);
        let p = b.block_params(entry);
        let args = [p[0], p[1], p[2], p[3], p[4]];
        StepBuilder {
            b,
            schedule,
            failures: Vec::new(),
            call_conv,
            entry,
            args,
            ints: HashMap::new(),
            bufs: HashMap::new(),
            funcs: HashMap::new(),
            lanes: 1,
        }
    }

    /// Returns and finishes the function.
    pub fn finish(mut self) {
        self.b.ins().return_(&[]);
        self.b.finalize(TargetFrontendConfig {
            default_call_conv: self.call_conv,
            pointer_width: PointerWidth::U64,
            page_size_align_log2: 12,
        });
    }

    /// First work item.
    pub fn lo(&self) -> Value {
        self.args[2]
    }

    /// One past the last work item.
    pub fn hi(&self) -> Value {
        self.args[3]
    }

    /// This thread's scratch memory.
    pub fn scratch(&self) -> Value {
        self.args[4]
    }

    fn in_entry(&self) -> bool {
        self.b.current_block() == Some(self.entry)
    }

    /// Records that something could not be rendered; returns a placeholder value of class F
    /// (the function is discarded: [`super::compile`] reports the failure).
    pub fn fail(&mut self, what: impl Into<String>) -> Typed {
        self.failures.push(what.into());
        Typed { v: self.fconst(0.0), k: Class::Float }
    }

    /// Loads slot `slot` of the integer table (i64).
    fn slot(&mut self, slot: usize) -> Value {
        if let Some(x) = self.ints.get(&slot) {
            return *x;
        }
        let offset = i32::try_from(slot * 8).unwrap_or(i32::MAX);
        let x = self.b.ins().load(types::I64, mem().with_readonly(), self.args[1], offset);
        if self.in_entry() {
            self.ints.insert(slot, x);
        }
        x
    }

    /// An entry of the integer table (i64). A dim the table lacks is formed from its symbols'
    /// entries.
    pub fn int(&mut self, v: IntValue) -> Value {
        if let Some(slot) = self.schedule.slot(&v) {
            return self.slot(slot);
        }
        match v {
            IntValue::Dim(d) => self.dim_from_symbols(&d),
            IntValue::Tuning { step, param } => {
                self.failures.push(format!("the schedule has no {param:?} for step {step}"));
                self.b.ins().iconst(types::I64, 0)
            }
        }
    }

    /// `Σ coef · Π symbol` from the symbols' table entries.
    fn dim_from_symbols(&mut self, d: &Dim) -> Value {
        let mut total = self.b.ins().iconst(types::I64, 0);
        for (mono, coef) in d.terms() {
            let mut term = self.b.ins().iconst(types::I64, coef);
            for name in mono {
                let Some(slot) = self.schedule.slot(&IntValue::Dim(Dim::sym(name))) else {
                    self.failures.push(format!("the schedule has no entry for dim `{name}`"));
                    continue;
                };
                let x = self.slot(slot);
                term = self.b.ins().imul(term, x);
            }
            total = self.b.ins().iadd(total, term);
        }
        total
    }

    /// A dim's run-time value (i64).
    pub fn dim(&mut self, d: &Dim) -> Value {
        match d.as_const() {
            Some(c) => self.b.ins().iconst(types::I64, c),
            None => self.int(IntValue::Dim(d.clone())),
        }
    }

    /// A tuning value of a step (i64).
    pub fn tuning(&mut self, step: usize, param: Tuning) -> Value {
        self.int(IntValue::Tuning { step, param })
    }

    /// A buffer's address.
    pub fn buf(&mut self, slot: usize) -> Value {
        if let Some(x) = self.bufs.get(&slot) {
            return *x;
        }
        let offset = i32::try_from(slot * 8).unwrap_or(i32::MAX);
        let x = self.b.ins().load(types::I64, mem().with_readonly(), self.args[0], offset);
        if self.in_entry() {
            self.bufs.insert(slot, x);
        }
        x
    }

    /// The address of a view's first element and its strides (i64 elements), loaded now.
    pub fn view_base(&mut self, v: &View) -> (Value, Vec<Value>) {
        let buf = self.buf(v.buf);
        let off = self.dim(&v.offset);
        let base = self.elem_addr(buf, off);
        let strides = v.strides.iter().map(|s| self.dim(s)).collect();
        (base, strides)
    }

    /// The sizes of a view's axes (i64), loaded now.
    pub fn dims(&mut self, shape: &[Dim]) -> Vec<Value> {
        shape.iter().map(|d| self.dim(d)).collect()
    }

    /// `base + 4·index`: the address of a 4-byte element.
    pub fn elem_addr(&mut self, base: Value, index: Value) -> Value {
        let bytes = self.b.ins().ishl_imm_s(index, 2);
        self.b.ins().iadd(base, bytes)
    }

    /// An i64 constant.
    pub fn i64(&mut self, v: i64) -> Value {
        self.b.ins().iconst(types::I64, v)
    }

    /// An f32 constant.
    pub fn f32(&mut self, v: f32) -> Value {
        self.b.ins().f32const(v)
    }

    /// An f64 constant.
    pub fn f64(&mut self, v: f64) -> Value {
        self.b.ins().f64const(v)
    }

    /// `a * b` (i64).
    pub fn mul(&mut self, a: Value, b: Value) -> Value {
        self.b.ins().imul(a, b)
    }

    /// `a + b` (i64).
    pub fn add(&mut self, a: Value, b: Value) -> Value {
        self.b.ins().iadd(a, b)
    }

    /// `a - b` (i64).
    pub fn sub(&mut self, a: Value, b: Value) -> Value {
        self.b.ins().isub(a, b)
    }

    /// `min(a, b)` (signed i64).
    pub fn min(&mut self, a: Value, b: Value) -> Value {
        self.b.ins().smin(a, b)
    }

    /// `max(a, b)` (signed i64).
    pub fn max(&mut self, a: Value, b: Value) -> Value {
        self.b.ins().smax(a, b)
    }

    /// `ceil(a / b)` for `a ≥ 0`, `b > 0`.
    pub fn ceil_div(&mut self, a: Value, b: Value) -> Value {
        let one = self.b.ins().iconst(types::I64, 1);
        let bm1 = self.b.ins().isub(b, one);
        let t = self.b.ins().iadd(a, bm1);
        self.b.ins().udiv(t, b)
    }

    /// Loads a 4-byte element of type `ty` at `addr`.
    pub fn load(&mut self, ty: Type, addr: Value) -> Value {
        self.b.ins().load(ty, mem(), addr, 0)
    }

    /// Stores `x` at `addr`.
    pub fn store(&mut self, x: Value, addr: Value) {
        self.b.ins().store(mem(), x, addr, 0);
    }

    /// A mutable i64 variable starting at `init`.
    pub fn var(&mut self, ty: Type, init: Value) -> Variable {
        let v = self.b.declare_var(ty);
        self.b.def_var(v, init);
        v
    }

    /// `ok &= (x is finite)` for an i8 flag variable: `x - x` is 0 exactly when `x` is finite.
    pub fn and_finite(&mut self, ok: Variable, x: Value) {
        let d = self.b.ins().fsub(x, x);
        let z = self.f32(0.0);
        let finite = self.b.ins().fcmp(FloatCC::Equal, d, z);
        let prev = self.b.use_var(ok);
        let both = self.b.ins().band(prev, finite);
        self.b.def_var(ok, both);
    }

    /// Emits `for i in start..end { body(i) }` (signed i64 bounds, step 1).
    pub fn for_range(&mut self, start: Value, end: Value, body: impl FnOnce(&mut Self, Value)) {
        self.for_step(start, end, 1, body);
    }

    /// Emits `for (i = start; i < end; i += step) { body(i) }`.
    pub fn for_step(&mut self, start: Value, end: Value, step: i64, body: impl FnOnce(&mut Self, Value)) {
        let header = self.b.create_block();
        let body_block = self.b.create_block();
        let exit = self.b.create_block();
        let i = self.b.declare_var(types::I64);
        self.b.def_var(i, start);
        self.b.ins().jump(header, &[]);
        self.b.switch_to_block(header);
        let iv = self.b.use_var(i);
        let go = self.b.ins().icmp(IntCC::SignedLessThan, iv, end);
        self.b.ins().brif(go, body_block, &[], exit, &[]);
        self.b.switch_to_block(body_block);
        self.b.seal_block(body_block);
        body(self, iv);
        let iv = self.b.use_var(i);
        let next = self.b.ins().iadd_imm_s(iv, step);
        self.b.def_var(i, next);
        self.b.ins().jump(header, &[]);
        self.b.seal_block(header);
        self.b.switch_to_block(exit);
        self.b.seal_block(exit);
    }

    /// Walks `0..n` elements of f32 rows, four at a time (with [`StepBuilder::lanes`] = 4) and then one
    /// at a time, calling `body(fx, index, pointers)` with one pointer per base advancing with
    /// the index. Pointers are loop variables so the code generator keeps their loop-invariant
    /// parts out of the loop.
    pub fn rows(&mut self, n: Value, bases: &[Value], body: &dyn Fn(&mut Self, Value, &[Value])) {
        let vars: Vec<Variable> = bases.iter().map(|b| self.var(types::I64, *b)).collect();
        let zero = self.i64(0);
        let mask = self.i64(-4);
        let vec_end = self.b.ins().band(n, mask);
        let advance = |fx: &mut Self, bytes: i64| {
            for v in &vars {
                let p = fx.b.use_var(*v);
                let p = fx.b.ins().iadd_imm_s(p, bytes);
                fx.b.def_var(*v, p);
            }
        };
        self.for_step(zero, vec_end, 4, |fx, c| {
            fx.lanes = 4;
            let ps: Vec<Value> = vars.iter().map(|v| fx.b.use_var(*v)).collect();
            body(fx, c, &ps);
            fx.lanes = 1;
            advance(fx, 16);
        });
        self.for_range(vec_end, n, |fx, c| {
            let ps: Vec<Value> = vars.iter().map(|v| fx.b.use_var(*v)).collect();
            body(fx, c, &ps);
            advance(fx, 4);
        });
    }

    /// Emits `if cond { then() }` (`cond` is any integer; non-zero is true).
    pub fn if_then(&mut self, cond: Value, then: impl FnOnce(&mut Self)) {
        let then_block = self.b.create_block();
        let join = self.b.create_block();
        self.b.ins().brif(cond, then_block, &[], join, &[]);
        self.b.switch_to_block(then_block);
        self.b.seal_block(then_block);
        then(self);
        self.b.ins().jump(join, &[]);
        self.b.switch_to_block(join);
        self.b.seal_block(join);
    }

    /// Emits `if cond { then() } else { other() }`.
    pub fn if_else(&mut self, cond: Value, then: impl FnOnce(&mut Self), other: impl FnOnce(&mut Self)) {
        let then_block = self.b.create_block();
        let else_block = self.b.create_block();
        let join = self.b.create_block();
        self.b.ins().brif(cond, then_block, &[], else_block, &[]);
        self.b.switch_to_block(then_block);
        self.b.seal_block(then_block);
        then(self);
        self.b.ins().jump(join, &[]);
        self.b.switch_to_block(else_block);
        self.b.seal_block(else_block);
        other(self);
        self.b.ins().jump(join, &[]);
        self.b.switch_to_block(join);
        self.b.seal_block(join);
    }

    /// Calls an imported function; returns its results.
    pub fn call(&mut self, import: Import, args: &[Value]) -> Vec<Value> {
        let f = match self.funcs.get(import.name) {
            Some(f) => *f,
            None => {
                let sig = self.b.import_signature(import.signature(self.call_conv));
                let f = self.b.import_function(ExtFuncData {
                    name: ExternalName::testcase(import.name),
                    signature: sig,
                    colocated: false,
                    patchable: false,
                });
                self.funcs.insert(import.name, f);
                f
            }
        };
        let inst = self.b.ins().call(f, args);
        self.b.inst_results(inst).to_vec()
    }

    /// The i32x4 vector `[0, 1, 2, 3]` (lane offsets of a four-lane loop).
    pub fn lane_iota(&mut self) -> Value {
        let mut v = self.b.ins().iconst(types::I32, 0);
        v = self.b.ins().splat(types::I32X4, v);
        for lane in 1..4u8 {
            let x = self.b.ins().iconst(types::I32, i64::from(lane));
            v = self.b.ins().insertlane(v, x, lane);
        }
        v
    }

    /// `x == y` on f32 values.
    pub fn feq(&mut self, x: Value, y: Value) -> Value {
        self.b.ins().fcmp(FloatCC::Equal, x, y)
    }

    /// Splits a linear index into per-axis indices of `dims` (row-major; the last axis varies
    /// fastest). Returns one i64 per axis.
    pub fn unravel(&mut self, mut index: Value, dims: &[Value]) -> Vec<Value> {
        let mut out = vec![index; dims.len()];
        for k in (0..dims.len()).rev() {
            if k == 0 {
                out[0] = index;
                break;
            }
            out[k] = self.b.ins().urem(index, dims[k]);
            index = self.b.ins().udiv(index, dims[k]);
        }
        out
    }

    /// `Σ idx[k] · strides[k]` added to `base` (an element offset, i64).
    pub fn dot(&mut self, base: Value, idx: &[Value], strides: &[Value]) -> Value {
        let mut acc = base;
        for (i, s) in idx.iter().zip(strides) {
            let t = self.b.ins().imul(*i, *s);
            acc = self.b.ins().iadd(acc, t);
        }
        acc
    }
}
