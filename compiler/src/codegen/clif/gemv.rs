//! Inline tile products for query blocks of a few rows (decode). With one to four query rows
//! the products are matrix-vector work that streams K and V once from memory; the SGEMM
//! microkernel would first copy each K tile into its packed layout, tripling the traffic.
//! These loops read K and V in place, four lanes at a time. Pointers are loop variables, which
//! keeps address arithmetic out of the inner loops.

use super::builder::Fx;
use cranelift_codegen::ir::{InstBuilder, MemFlagsData, Value, types};
use cranelift_frontend::Variable;

/// Most query rows a work item may have for the inline products.
pub const MAX_ROWS: i64 = 4;

fn vload(fx: &mut Fx, p: Value, offset: i32) -> Value {
    fx.b.ins().load(types::F32X4, MemFlagsData::new().with_notrap(), p, offset)
}

/// `var += by` (i64).
fn bump(fx: &mut Fx, var: Variable, by: Value) {
    let p = fx.b.use_var(var);
    let p = fx.b.ins().iadd(p, by);
    fx.b.def_var(var, p);
}

/// `var += by` (i64 immediate).
fn bump_imm(fx: &mut Fx, var: Variable, by: i64) {
    let p = fx.b.use_var(var);
    let p = fx.b.ins().iadd_imm_s(p, by);
    fx.b.def_var(var, p);
}

/// `S[r, c] = alpha · q_r · k_c` for `r < rows`, `c < cols`; rows of `S` are `bn` apart.
#[allow(clippy::too_many_arguments)]
pub fn scores(
    fx: &mut Fx,
    rows: Value,
    cols: Value,
    d: Value,
    q: Value,
    ldq: Value,
    k: Value,
    ldk: Value,
    s: Value,
    bn: Value,
    alpha: Value,
) {
    let zero = fx.i64(0);
    let m16 = fx.i64(-16);
    let d16 = fx.b.ins().band(d, m16);
    let m4 = fx.i64(-4);
    let d4 = fx.b.ins().band(d, m4);
    let kstep = fx.b.ins().ishl_imm_s(ldk, 2);
    let qstep = fx.b.ins().ishl_imm_s(ldq, 2);
    let sstep = fx.b.ins().ishl_imm_s(bn, 2);
    let kv = fx.var(types::I64, k);
    let sv = fx.var(types::I64, s);
    fx.for_range(zero, cols, |fx, _| {
        let krow = fx.b.use_var(kv);
        let scol = fx.b.use_var(sv);
        let qv = fx.var(types::I64, q);
        let spv = fx.var(types::I64, scol);
        fx.for_range(zero, rows, |fx, _| {
            let qrow = fx.b.use_var(qv);
            let z = fx.f32(0.0);
            let vz = fx.b.ins().splat(types::F32X4, z);
            let accs: Vec<Variable> = (0..4).map(|_| fx.var(types::F32X4, vz)).collect();
            let qa = fx.var(types::I64, qrow);
            let ka = fx.var(types::I64, krow);
            // Four independent sums so the adds' latency does not serialise the loop.
            fx.for_step(zero, d16, 16, |fx, _| {
                let (qp, kp) = (fx.b.use_var(qa), fx.b.use_var(ka));
                for (n, acc) in accs.iter().enumerate() {
                    let off = 16 * n as i32;
                    let (a, b) = (vload(fx, qp, off), vload(fx, kp, off));
                    let t = fx.b.use_var(*acc);
                    let t = fx.fmadd(a, b, t);
                    fx.b.def_var(*acc, t);
                }
                bump_imm(fx, qa, 64);
                bump_imm(fx, ka, 64);
            });
            fx.for_step(d16, d4, 4, |fx, _| {
                let (qp, kp) = (fx.b.use_var(qa), fx.b.use_var(ka));
                let (a, b) = (vload(fx, qp, 0), vload(fx, kp, 0));
                let t = fx.b.use_var(accs[0]);
                let t = fx.fmadd(a, b, t);
                fx.b.def_var(accs[0], t);
                bump_imm(fx, qa, 16);
                bump_imm(fx, ka, 16);
            });
            let v: Vec<Value> = accs.iter().map(|a| fx.b.use_var(*a)).collect();
            let s01 = fx.b.ins().fadd(v[0], v[1]);
            let s23 = fx.b.ins().fadd(v[2], v[3]);
            let sv4 = fx.b.ins().fadd(s01, s23);
            let mut total = fx.b.ins().extractlane(sv4, 0);
            for lane in 1..4u8 {
                let x = fx.b.ins().extractlane(sv4, lane);
                total = fx.b.ins().fadd(total, x);
            }
            let sum = fx.var(types::F32, total);
            fx.for_range(d4, d, |fx, _| {
                let (qp, kp) = (fx.b.use_var(qa), fx.b.use_var(ka));
                let (a, b) = (fx.load(types::F32, qp), fx.load(types::F32, kp));
                let p = fx.b.ins().fmul(a, b);
                let t = fx.b.use_var(sum);
                let t = fx.b.ins().fadd(t, p);
                fx.b.def_var(sum, t);
                bump_imm(fx, qa, 4);
                bump_imm(fx, ka, 4);
            });
            let t = fx.b.use_var(sum);
            let t = fx.b.ins().fmul(t, alpha);
            let sp = fx.b.use_var(spv);
            fx.store(t, sp);
            bump(fx, qv, qstep);
            bump(fx, spv, sstep);
        });
        bump(fx, kv, kstep);
        bump_imm(fx, sv, 4);
    });
}

/// `acc[r, :] += Σ_c P[r, c] · v_c` for `r < rows`, `c < cols`; rows of `P` are `bn` apart,
/// rows of `acc` `dv`.
///
/// Key-major: each V row is read once, front to back, and added into the accumulator rows
/// (which stay in L1), so V streams from memory in order.
#[allow(clippy::too_many_arguments)]
pub fn values(fx: &mut Fx, rows: Value, cols: Value, dv: Value, p: Value, bn: Value, v: Value, ldv: Value, acc: Value) {
    let zero = fx.i64(0);
    let m16 = fx.i64(-16);
    let d16 = fx.b.ins().band(dv, m16);
    let vstep = fx.b.ins().ishl_imm_s(ldv, 2);
    let astep = fx.b.ins().ishl_imm_s(dv, 2);
    let pstep = fx.b.ins().ishl_imm_s(bn, 2);
    let flags = MemFlagsData::new().with_notrap();
    let vv = fx.var(types::I64, v);
    let pc = fx.var(types::I64, p);
    fx.for_range(zero, cols, |fx, _| {
        let vrow = fx.b.use_var(vv);
        let pcol = fx.b.use_var(pc);
        let av = fx.var(types::I64, acc);
        let pv = fx.var(types::I64, pcol);
        fx.for_range(zero, rows, |fx, _| {
            let arow = fx.b.use_var(av);
            let pp = fx.b.use_var(pv);
            let w = fx.load(types::F32, pp);
            let wv = fx.b.ins().splat(types::F32X4, w);
            let ap = fx.var(types::I64, arow);
            let vp = fx.var(types::I64, vrow);
            fx.for_step(zero, d16, 16, |fx, _| {
                let (a0, v0) = (fx.b.use_var(ap), fx.b.use_var(vp));
                for k in 0..4 {
                    let off = 16 * k;
                    let a = fx.b.ins().load(types::F32X4, flags, a0, off);
                    let b = fx.b.ins().load(types::F32X4, flags, v0, off);
                    let t = fx.fmadd(wv, b, a);
                    fx.b.ins().store(flags, t, a0, off);
                }
                bump_imm(fx, ap, 64);
                bump_imm(fx, vp, 64);
            });
            let (a0, v0) = (fx.b.use_var(ap), fx.b.use_var(vp));
            let rest = fx.sub(dv, d16);
            fx.rows(rest, &[a0, v0], &|fx, _, ptr| {
                let ty = fx.ty(super::ops::Kind::F);
                let a = fx.b.ins().load(ty, flags, ptr[0], 0);
                let b = fx.b.ins().load(ty, flags, ptr[1], 0);
                let wl = fx.splat(super::ops::Kind::F, w);
                let t = fx.fmadd(wl, b, a);
                fx.b.ins().store(flags, t, ptr[0], 0);
            });
            bump(fx, av, astep);
            bump(fx, pv, pstep);
        });
        bump(fx, vv, vstep);
        bump_imm(fx, pc, 4);
    });
}
