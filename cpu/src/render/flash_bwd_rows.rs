//! The weights and adjoints of one key row of a flash backward's live span
//! ([`super::flash_bwd`]), query block by query block: skipped blocks are zeroed; unmasked
//! blocks of a linear score (consecutive ones merged) go to the row kernel, which forms the
//! weights, `dF` and `dS` at the ISA's full width; the rest evaluate the score modification,
//! mask and derivatives per element, four queries at a time. Each extra operand's gradient
//! `dF · ∂F/∂x` is added at the index it loads.

use super::builder::StepBuilder;
use super::flash_bwd::{Item, Prologue, Span, scatter_add, tile_class, zero_floats};
use super::ops::Typed;
use super::score::{self, Env};
use crate::abi;
use attn_compiler::ir::semantics::Class;
use attn_compiler::ir::{ScoreExpr, Weights};
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{InstBuilder, MemFlagsData, Value, types};

/// The span's row terms `sep(i, j0) - sep(r0, j0)` of a separable expression into the vector at
/// `into`; returns whether they (and `sep(r0, j0)`) are all finite, which the split needs.
pub(super) fn row_terms(fx: &mut StepBuilder, p: &Prologue, it: &Item, s: &Span, sep: &ScoreExpr, into: Value) -> Value {
    let j32 = fx.b.ins().ireduce(types::I32, s.j0);
    let r0_32 = fx.b.ins().ireduce(types::I32, s.r0);
    let at_pos = |fx: &mut StepBuilder, i: Value| -> Value {
        let mut pos = it.b_pos.clone();
        pos.extend([i, j32]);
        let env = Env { s: None, pos: &pos, dims: &p.dims, extras: &p.extras, hoisted: &it.hoisted };
        let x = score::eval(fx, sep, &env);
        fx.cvt_f(x)
    };
    let base = at_pos(fx, r0_32);
    let yes = fx.b.ins().iconst(types::I8, 1);
    let ok = fx.var(types::I8, yes);
    let zero = fx.i64(0);
    fx.for_range(zero, s.len, |fx, r| {
        let i = fx.add(s.r0, r);
        let i = fx.b.ins().ireduce(types::I32, i);
        let x = at_pos(fx, i);
        let d = fx.b.ins().fsub(x, base);
        let addr = fx.elem_addr(into, r);
        fx.store(d, addr);
        fx.and_finite(ok, d);
    });
    fx.b.use_var(ok)
}

/// Key row `c` of the span, query block by query block.
pub(super) fn key_row(fx: &mut StepBuilder, p: &Prologue, it: &Item, s: &Span, c: Value, sep_ok: Value) {
    let f = p.f;
    let off = fx.mul(c, p.stride);
    let srow = fx.elem_addr(p.p_rows, off);
    let drow = fx.elem_addr(p.ds_rows, off);
    let j = fx.add(s.j0, c);
    let j32 = fx.b.ins().ireduce(types::I32, j);
    let row = Row { srow, drow, j32 };
    let linear = f.linear.is_some();
    // A run of consecutive unmasked blocks waiting for the row kernel: its first row (from
    // the span's start) and its end (-1: no run).
    let none = fx.i64(-1);
    let run_start = fx.var(types::I64, none);
    let run_end = fx.var(types::I64, none);
    let flush = |fx: &mut StepBuilder| {
        let a = fx.b.use_var(run_start);
        let open = fx.b.ins().icmp_imm_s(IntCC::SignedGreaterThanOrEqual, a, 0);
        fx.if_then(open, |fx| {
            let b = fx.b.use_var(run_end);
            let n = fx.sub(b, a);
            linear_run(fx, p, it, s, &row, a, n);
        });
        let none = fx.i64(-1);
        fx.b.def_var(run_start, none);
    };
    let one = fx.i64(1);
    let end = fx.add(s.last, one);
    fx.for_range(s.first, end, |fx, qb| {
        let class = tile_class(fx, p, it, qb, s.kb);
        let i0 = fx.mul(qb, p.bm);
        let left = fx.sub(p.m, i0);
        let rows = fx.min(p.bm, left);
        let at = fx.sub(i0, s.r0);
        let full = fx.b.ins().icmp_imm_s(IntCC::Equal, class, 1);
        let fast = if linear { fx.b.ins().band(full, sep_ok) } else { fx.b.ins().iconst(types::I8, 0) };
        fx.if_else(
            fast,
            |fx| {
                let a = fx.b.use_var(run_start);
                let fresh = fx.b.ins().icmp_imm_s(IntCC::SignedLessThan, a, 0);
                let a = fx.b.ins().select(fresh, at, a);
                fx.b.def_var(run_start, a);
                let b = fx.add(at, rows);
                fx.b.def_var(run_end, b);
            },
            |fx| {
                flush(fx);
                let skip = fx.b.ins().icmp_imm_s(IntCC::Equal, class, 0);
                let partial = fx.b.ins().icmp_imm_s(IntCC::Equal, class, 2);
                fx.if_else(
                    skip,
                    |fx| {
                        for base in [srow, drow] {
                            let to = fx.elem_addr(base, at);
                            zero_floats(fx, to, rows);
                        }
                    },
                    |fx| {
                        if f.spec.mask.is_some() {
                            fx.if_else(
                                partial,
                                |fx| general(fx, p, it, &row, (i0, at, rows), true),
                                |fx| general(fx, p, it, &row, (i0, at, rows), false),
                            );
                        } else {
                            general(fx, p, it, &row, (i0, at, rows), false);
                        }
                    },
                );
            },
        );
    });
    flush(fx);
}

/// A key row: its `Sᵀ`/`Pᵀ` and `dPᵀ`/`dSᵀ` rows (element 0 is the span's first query) and
/// its key position.
struct Row {
    srow: Value,
    drow: Value,
    j32: Value,
}

/// Queries `at .. at + n` of the span (consecutive unmasked blocks of a linear score) by the
/// row kernel, then their extra gradients from `dF`.
fn linear_run(fx: &mut StepBuilder, p: &Prologue, it: &Item, s: &Span, row: &Row, at: Value, n: Value) {
    let f = p.f;
    let Some(lin) = &f.linear else { return };
    let srow = fx.elem_addr(row.srow, at);
    let drow = fx.elem_addr(row.drow, at);
    let r0_32 = fx.b.ins().ireduce(types::I32, s.r0);
    let cb = match &lin.sep {
        Some(sep) => {
            let mut pos = it.b_pos.clone();
            pos.extend([r0_32, row.j32]);
            let env = Env { s: None, pos: &pos, dims: &p.dims, extras: &p.extras, hoisted: &it.hoisted };
            let x = score::eval(fx, sep, &env);
            fx.cvt_f(x)
        }
        None => fx.f32(0.0),
    };
    let null = fx.i64(0);
    let rb = if lin.sep.is_some() { fx.elem_addr(p.rb_row, at) } else { null };
    let i0 = fx.add(s.r0, at);
    let (lse, delta, sigmoid) = stats_at(fx, p, it, i0);
    // A load whose gradient the kernel sums (`c(j) Σ dF + Σ dF r(i)`): the others, if any, are
    // added from `dF` after it.
    let summed = lin.sum_load.filter(|k| it.sums.get(*k).is_some_and(Option::is_some));
    let rest = p.f.grad.loads.iter().enumerate().any(|(k, l)| Some(k) != summed && p.targets.iter().any(|t| t.input == l.input));
    let df = if rest { fx.elem_addr(p.df_row, at) } else { null };
    let w = if summed.is_some() { fx.elem_addr(p.w_row, at) } else { null };
    let flags = fx.b.ins().iconst(types::I32, i64::from(lin.tanh) | sigmoid);
    fx.call(abi::FLASH_BWD_ROW, &[srow, drow, lse, delta, rb, n, p.alpha, it.factor, cb, flags, df, w, p.sums]);
    if let (Some(k), Some(Some(sum))) = (summed, summed.map(|k| it.sums[k])) {
        // This key row's share: c(j) Σ dF + Σ dF r(i), with c(j) the derivative at (r0, j).
        let mut pos = it.b_pos.clone();
        pos.extend([r0_32, row.j32]);
        let env = Env { s: None, pos: &pos, dims: &p.dims, extras: &p.extras, hoisted: &it.hoisted };
        let c = score::eval(fx, &p.f.grad.loads[k].d, &env);
        let c = fx.cvt_f(c);
        let s0 = fx.load(types::F32, p.sums);
        let second = fx.i64(1);
        let s1_at = fx.elem_addr(p.sums, second);
        let s1 = fx.load(types::F32, s1_at);
        let share = fx.b.ins().fmul(c, s0);
        let share = fx.b.ins().fadd(share, s1);
        let wide = fx.b.ins().fpromote(types::F64, share);
        let total = fx.b.use_var(sum.total);
        let total = fx.b.ins().fadd(total, wide);
        fx.b.def_var(sum.total, total);
    }
    if rest {
        fx.rows(n, &[df], &|fx, r, ptr| {
            let fty = fx.ty(Class::Float);
            let dfv = fx.b.ins().load(fty, MemFlagsData::new().with_notrap(), ptr[0], 0);
            let pos = positions(fx, p, it, i0, row.j32, r);
            let env = Env { s: None, pos: &pos, dims: &p.dims, extras: &p.extras, hoisted: &it.hoisted };
            let z = fx.fconst(0.0);
            let live = fx.b.ins().fcmp(FloatCC::NotEqual, dfv, z);
            extra_gradients(fx, p, it, &env, dfv, live, summed);
        });
    }
}

/// The row statistics' addresses at query `i0` (null for sigmoid weights), and the row
/// kernel's sigmoid flag.
fn stats_at(fx: &mut StepBuilder, p: &Prologue, it: &Item, i0: Value) -> (Value, Value, i64) {
    let null = fx.i64(0);
    match it.stats {
        Some((l, deltas)) => {
            let ls = p.stats.as_ref().map_or(null, |(a, _)| a.step);
            let lo = fx.mul(i0, ls);
            (fx.elem_addr(l, lo), fx.elem_addr(deltas, i0), 0)
        }
        None => (null, null, 2),
    }
}

/// The score positions of the lanes at query `i0 + r` and key `j`.
fn positions(fx: &mut StepBuilder, p: &Prologue, it: &Item, i0: Value, j32: Value, r: Value) -> Vec<Value> {
    let mut pos: Vec<Value> = it.b_pos.iter().map(|b| fx.splat(Class::Int, *b)).collect();
    let i0_32 = fx.b.ins().ireduce(types::I32, i0);
    let r32 = fx.b.ins().ireduce(types::I32, r);
    let i = fx.b.ins().iadd(i0_32, r32);
    let i = fx.splat(Class::Int, i);
    let i = if fx.lanes > 1 { fx.b.ins().iadd(i, p.lane_iota) } else { i };
    pos.push(i);
    pos.push(fx.splat(Class::Int, j32));
    pos
}

/// Each wanted load's `dF · ∂F/∂x` for these lanes (0 where `live` is false): into its
/// item-level sum, or added at the index it loads; but not the load `skip` (the row kernel
/// summed it).
fn extra_gradients(fx: &mut StepBuilder, p: &Prologue, it: &Item, env: &Env, df: Value, live: Value, skip: Option<usize>) {
    let z = fx.fconst(0.0);
    for (k, (l, sum)) in p.f.grad.loads.iter().zip(&it.sums).enumerate() {
        if Some(k) == skip {
            continue;
        }
        let Some(target) = p.targets.iter().find(|t| t.input == l.input) else { continue };
        let d = score::eval(fx, &l.d, env);
        let d = fx.cvt_f(d);
        let contrib = fx.b.ins().fmul(df, d);
        let contrib = fx.select_raw(live, contrib, z);
        match sum {
            Some(sum) => {
                let var = if fx.lanes > 1 { sum.lanes } else { sum.one };
                let acc = fx.b.use_var(var);
                let acc = fx.b.ins().fadd(acc, contrib);
                fx.b.def_var(var, acc);
            }
            None => {
                let idx: Vec<Value> = l
                    .index
                    .iter()
                    .map(|e| {
                        let x = score::eval(fx, e, env);
                        fx.cvt_i(x)
                    })
                    .collect();
                scatter_add(fx, it.partial, target, &idx, contrib);
            }
        }
    }
}

/// A query block of a key row by the general path (`(i0, at, rows)`: its first query, its
/// offset in the span, its length), four queries at a time: raw scores, the score
/// modification, the mask when `masked`, the weights and adjoints, the extra gradients.
fn general(fx: &mut StepBuilder, p: &Prologue, it: &Item, row: &Row, (i0, at, rows): (Value, Value, Value), masked: bool) {
    let f = p.f;
    let mut bases = vec![fx.elem_addr(row.srow, at), fx.elem_addr(row.drow, at)];
    let (lse, delta, _) = stats_at(fx, p, it, i0);
    if it.stats.is_some() {
        bases.extend([lse, delta]);
    }
    let softmax = f.spec.weights == Weights::Softmax;
    let needs_ds = f.needs_ds();
    let j32 = row.j32;
    fx.rows(rows, &bases, &|fx, r, ptr| {
        let fl = MemFlagsData::new().with_notrap();
        let fty = fx.ty(Class::Float);
        let s = fx.b.ins().load(fty, fl, ptr[0], 0);
        let dp = fx.b.ins().load(fty, fl, ptr[1], 0);
        let pos = positions(fx, p, it, i0, j32, r);
        let env = Env { s: Some(Typed { v: s, k: Class::Float }), pos: &pos, dims: &p.dims, extras: &p.extras, hoisted: &it.hoisted };
        let score = score::eval(fx, &f.spec.score, &env);
        let score = fx.cvt_f(score);
        let (w, df) = if softmax {
            let lse = fx.b.ins().load(fty, fl, ptr[2], 0);
            let delta = fx.b.ins().load(fty, fl, ptr[3], 0);
            let x = fx.b.ins().fsub(score, lse);
            let e = fx.exp(x);
            // A row with no kept key (lse = -inf) has no weights.
            let ninf = fx.fconst(f32::NEG_INFINITY);
            let empty = fx.b.ins().fcmp(FloatCC::Equal, lse, ninf);
            let z = fx.fconst(0.0);
            let w = fx.select_raw(empty, z, e);
            let t = fx.b.ins().fsub(dp, delta);
            (w, fx.b.ins().fmul(w, t))
        } else {
            let w = fx.sigmoid(score);
            let one = fx.fconst(1.0);
            let om = fx.b.ins().fsub(one, w);
            let t = fx.b.ins().fmul(w, om);
            (w, fx.b.ins().fmul(dp, t))
        };
        let (w, df) = if masked {
            let Some(m) = &f.spec.mask else { return };
            let keep = score::eval(fx, m, &env);
            let keep = fx.cvt_b(keep);
            let z = fx.fconst(0.0);
            (fx.select_raw(keep, w, z), fx.select_raw(keep, df, z))
        } else {
            (w, df)
        };
        fx.b.ins().store(fl, w, ptr[0], 0);
        // Where dF is 0 nothing flows, even if a derivative is inf or NaN there.
        let z = fx.fconst(0.0);
        let live = fx.b.ins().fcmp(FloatCC::NotEqual, df, z);
        let ds = if needs_ds {
            let d = score::eval(fx, &f.grad.ds, &env);
            let d = fx.cvt_f(d);
            let ds = fx.b.ins().fmul(df, d);
            fx.select_raw(live, ds, z)
        } else {
            z
        };
        fx.b.ins().store(fl, ds, ptr[1], 0);
        extra_gradients(fx, p, it, &env, df, live, None);
    });
}
