//! The flash-attention kernel, generated per flash op, and the merge step for split keys.
//!
//! Work item = (batch index, query block of `BlockM` rows, key split). For each key tile of
//! `BlockN` keys in the split whose class (from the per-run tile table) is not Skip:
//!
//! 1. `S = alpha · Q_blk · K_tileᵀ` by the SGEMM microkernel into scratch (inline
//!    matrix-vector loops in `gemv` for blocks of at most four rows: decode);
//! 2. per row: the score modification and (for Partial tiles only) the mask, compiled inline,
//!    four scores at a time, tracking the tile's row max; hoisted parts of the expressions
//!    (per batch index, per row) are computed once outside the loop;
//! 3. online softmax: new running max, `P = exp(S - max)` and its row sum by the exp
//!    microkernel, the running sum and accumulator rescaled by `exp(old max - new max)`.
//!    Plain unmasked scores after a row's first tile skip the max entirely (`exp(S - running
//!    max)`, see [`Tile::unmasked_row`]). Sigmoid weights instead: `P = keep ? sigmoid(score)
//!    : 0`;
//! 4. `acc += P · V_tile` by the SGEMM microkernel (or `gemv`).
//!
//! Finally each row is divided by its sum (rows with no kept key give 0), or, when keys are
//! split, the partial state (max, sum, acc) is stored for [`emit_merge`]. Sizes, strides and
//! block sizes are run-time integers: nothing is recompiled per shape. K and V batch axes of
//! size 1 have stride 0 (grouped-query and multi-query attention read the shared head).

use super::abi;
use super::builder::Fx;
use super::gemv;
use super::matmul::batch_strides;
use super::ops::{Kind, Tv};
use super::plan::{FlashKernel, Tuning};
use super::score::{self, Env, Extra, Hoisted, Level};
use crate::ir::{DType, Dim, ScoreExpr, Weights};
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{InstBuilder, MemFlagsData, Value, types};
use std::collections::HashMap;

/// Byte offsets of the regions of a flash kernel's per-thread scratch, and its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashScratch {
    /// The score/probability tile, `BlockM × BlockN` f32.
    pub tile: usize,
    /// The output accumulator, `BlockM × Dv` f32.
    pub acc: usize,
    /// Running row maxima, `BlockM` f32.
    pub max: usize,
    /// Running row sums, `BlockM` f32.
    pub sum: usize,
    /// Total bytes.
    pub total: usize,
}

fn round64(x: usize) -> usize {
    x.div_ceil(64) * 64
}

/// The scratch layout for block sizes `bm × bn` and value width `dv` (the generated code
/// computes the same offsets).
pub fn flash_scratch(bm: usize, bn: usize, dv: usize) -> FlashScratch {
    let acc = round64(bm * bn * 4);
    let max = acc + round64(bm * dv * 4);
    let sum = max + round64(bm * 4);
    FlashScratch { tile: 0, acc, max, sum, total: sum + round64(bm * 4) }
}

/// Values of the prologue both kernels share.
struct Common {
    bdims: Vec<Value>,
    m: Value,
    dv: Value,
    bm: Value,
    nqb: Value,
    splits: Value,
    out: Value,
    out_bs: Vec<Value>,
    out_rs: Value,
    partials: Value,
    /// Floats per partial row: `Dv + 2`.
    prow: Value,
}

fn common(fx: &mut Fx, f: &FlashKernel) -> Common {
    let r = f.q.shape.len();
    let batch = &f.out.shape[..r - 2];
    let bdims = fx.dims(batch);
    let (out, ost) = fx.view_base(&f.out);
    let out_bs = batch_strides(fx, &f.out, &ost, batch);
    let m = fx.dim(&f.q.shape[r - 2]);
    let dv = fx.dim(&f.v.shape[r - 1]);
    let bm = fx.tuning(f.step, Tuning::BlockM);
    let nqb = fx.tuning(f.step, Tuning::QueryBlocks);
    let splits = fx.tuning(f.step, Tuning::Splits);
    let partials = fx.buf(f.partials);
    let two = fx.i64(2);
    let prow = fx.add(dv, two);
    Common { bdims, m, dv, bm, nqb, splits, out, out_bs, out_rs: ost[r - 2], partials, prow }
}

/// Address of the `Dv + 2` floats of partial row `r` of flash work item `w`.
fn partial_row(fx: &mut Fx, c: &Common, w: Value, r: Value) -> Value {
    let t = fx.mul(w, c.bm);
    let t = fx.add(t, r);
    let t = fx.mul(t, c.prow);
    fx.elem_addr(c.partials, t)
}

/// Loads f32 lanes at `p`.
fn ldp(fx: &mut Fx, p: Value) -> Value {
    let ty = fx.ty(Kind::F);
    fx.b.ins().load(ty, MemFlagsData::new().with_notrap(), p, 0)
}

/// Stores f32 lanes at `p`.
fn stp(fx: &mut Fx, x: Value, p: Value) {
    fx.b.ins().store(MemFlagsData::new().with_notrap(), x, p, 0);
}

/// `max(a, b)` as a compare and a select (the row max ignores NaN ordering subtleties; the
/// NaN-propagating `fmax` costs several instructions per vector).
fn max_fast(fx: &mut Fx, a: Value, b: Value) -> Value {
    let gt = fx.b.ins().fcmp(FloatCC::GreaterThan, a, b);
    fx.select_raw(gt, a, b)
}

/// Loads f32 lanes at element `c` of `base`.
fn ld(fx: &mut Fx, base: Value, c: Value) -> Value {
    let addr = fx.elem_addr(base, c);
    let ty = fx.ty(Kind::F);
    fx.b.ins().load(ty, MemFlagsData::new().with_notrap(), addr, 0)
}

/// [`st`] under another name (for scopes where `st` is a variable).
fn st_(fx: &mut Fx, x: Value, base: Value, c: Value) {
    st(fx, x, base, c);
}

/// Stores f32 lanes at element `c` of `base`.
fn st(fx: &mut Fx, x: Value, base: Value, c: Value) {
    let addr = fx.elem_addr(base, c);
    fx.b.ins().store(MemFlagsData::new().with_notrap(), x, addr, 0);
}

/// Emits the flash kernel.
pub fn emit(fx: &mut Fx, f: &FlashKernel) {
    let r = f.q.shape.len();
    let c = common(fx, f);
    let batch: Vec<Dim> = f.out.shape[..r - 2].to_vec();
    let (qb, qst) = fx.view_base(&f.q);
    let (kb, kst) = fx.view_base(&f.k);
    let (vb, vst) = fx.view_base(&f.v);
    let q_bs = batch_strides(fx, &f.q, &qst, &batch);
    let k_bs = batch_strides(fx, &f.k, &kst, &batch);
    let v_bs = batch_strides(fx, &f.v, &vst, &batch);
    let n = fx.dim(&f.k.shape[r - 2]);
    let d = fx.dim(&f.q.shape[r - 1]);
    let (q_rs, k_rs, v_rs) = (qst[r - 2], kst[r - 2], vst[r - 2]);
    let lda = fx.max(q_rs, d);
    let ldk = fx.max(k_rs, d);
    let ldv = fx.max(v_rs, c.dv);
    let bn = fx.tuning(f.step, Tuning::BlockN);
    let kps = fx.tuning(f.step, Tuning::KeysPerSplit);
    let nkb = fx.tuning(f.step, Tuning::KeyBlocks);
    let tiles = fx.buf(f.tiles);
    let extras: Vec<Extra> = f
        .extras
        .iter()
        .map(|x| {
            let (base, strides) = fx.view_base(x);
            let sizes = fx.dims(&x.shape);
            Extra { dtype: x.dtype, base, strides, sizes }
        })
        .collect();
    let mut dim_list = Vec::new();
    score::dims_of(&f.spec.score, &mut dim_list);
    if let Some(m) = &f.spec.mask {
        score::dims_of(m, &mut dim_list);
    }
    if let Some(a) = &f.alpha {
        score::dims_of(a, &mut dim_list);
    }
    let mut dims = HashMap::new();
    for dd in dim_list {
        let v = fx.dim(&dd);
        let v = fx.b.ins().ireduce(types::I32, v);
        dims.insert(dd, v);
    }
    let alpha = match &f.alpha {
        Some(a) => {
            let none = Hoisted::new();
            let env = Env { s: None, pos: &[], dims: &dims, extras: &extras, hoisted: &none };
            let t = score::eval(fx, a, &env);
            fx.cvt_f(t)
        }
        None => fx.f32(1.0),
    };
    // Scratch regions, as `flash_scratch` lays them out.
    let scratch = fx.scratch();
    let round = |fx: &mut Fx, x: Value| {
        let t = fx.b.ins().iadd_imm_s(x, 63);
        fx.b.ins().band_imm_s(t, -64)
    };
    let tile_bytes = fx.mul(c.bm, bn);
    let tile_bytes = fx.b.ins().ishl_imm_s(tile_bytes, 2);
    let acc_off = round(fx, tile_bytes);
    let acc_bytes = fx.mul(c.bm, c.dv);
    let acc_bytes = fx.b.ins().ishl_imm_s(acc_bytes, 2);
    let acc_bytes = round(fx, acc_bytes);
    let max_off = fx.add(acc_off, acc_bytes);
    let row_bytes = fx.b.ins().ishl_imm_s(c.bm, 2);
    let row_bytes = round(fx, row_bytes);
    let sum_off = fx.add(max_off, row_bytes);
    let s_tile = scratch;
    let acc = fx.add(scratch, acc_off);
    let rmax = fx.add(scratch, max_off);
    let rsum = fx.add(scratch, sum_off);
    let lane_iota = {
        let mut v = fx.b.ins().iconst(types::I32, 0);
        v = fx.b.ins().splat(types::I32X4, v);
        for lane in 1..4u8 {
            let x = fx.b.ins().iconst(types::I32, i64::from(lane));
            v = fx.b.ins().insertlane(v, x, lane);
        }
        v
    };
    let overwrite = fx.b.ins().iconst(types::I32, 0);
    let accumulate = fx.b.ins().iconst(types::I32, 1);
    let one = fx.f32(1.0);
    let softmax = f.spec.weights == Weights::Softmax;
    let plain_score = f.spec.score == ScoreExpr::Score;

    let (lo, hi) = (fx.lo(), fx.hi());
    fx.for_range(lo, hi, |fx, w| {
        let sp = fx.b.ins().urem(w, c.splits);
        let t = fx.b.ins().udiv(w, c.splits);
        let qblk = fx.b.ins().urem(t, c.nqb);
        let bi = fx.b.ins().udiv(t, c.nqb);
        let bidx = fx.unravel(bi, &c.bdims);
        let zero = fx.i64(0);
        let i0 = fx.mul(qblk, c.bm);
        let left = fx.sub(c.m, i0);
        let rows = fx.min(c.bm, left);
        let qoff = fx.dot(zero, &bidx, &q_bs);
        let qrow = fx.mul(i0, q_rs);
        let qoff = fx.add(qoff, qrow);
        let qp = fx.elem_addr(qb, qoff);
        let koff = fx.dot(zero, &bidx, &k_bs);
        let voff = fx.dot(zero, &bidx, &v_bs);
        let kstart = fx.mul(sp, kps);
        let kend = fx.add(kstart, kps);
        let kend = fx.min(kend, n);
        let b_pos: Vec<Value> = bidx.iter().map(|x| fx.b.ins().ireduce(types::I32, *x)).collect();
        // Parts of the score and mask that depend on the batch position only.
        let mut item = Hoisted::new();
        {
            let mut pos = b_pos.clone();
            let z = fx.b.ins().iconst(types::I32, 0);
            pos.extend([z, z]);
            let none = Hoisted::new();
            let env = Env { s: None, pos: &pos, dims: &dims, extras: &extras, hoisted: &none };
            let exprs: Vec<&ScoreExpr> = std::iter::once(&f.spec.score).chain(f.spec.mask.as_ref()).collect();
            score::hoist(fx, &exprs, r, Level::Item, &env, &mut item);
        }
        // Fresh running state.
        let ninf = fx.f32(f32::NEG_INFINITY);
        let fzero = fx.f32(0.0);
        fx.for_range(zero, rows, |fx, rr| {
            st(fx, ninf, rmax, rr);
            st(fx, fzero, rsum, rr);
        });
        let acc_n = fx.mul(rows, c.dv);
        fx.rows(acc_n, &[acc], &|fx, _, p| {
            let z = fx.fconst(0.0);
            stp(fx, z, p[0]);
        });
        let kb0 = fx.b.ins().udiv(kstart, bn);
        let kb1 = fx.ceil_div(kend, bn);
        fx.for_range(kb0, kb1, |fx, kbi| {
            let j0 = fx.mul(kbi, bn);
            let kleft = fx.sub(kend, j0);
            let cols = fx.min(bn, kleft);
            let tix = fx.mul(qblk, nkb);
            let tix = fx.add(tix, kbi);
            let taddr = fx.add(tiles, tix);
            let class = fx.b.ins().uload8(types::I32, MemFlagsData::trusted(), taddr, 0);
            let run = fx.b.ins().icmp_imm_s(IntCC::NotEqual, class, 0);
            fx.if_then(run, |fx| {
                let krow = fx.mul(j0, k_rs);
                let kk = fx.add(koff, krow);
                let kp = fx.elem_addr(kb, kk);
                let few = fx.b.ins().icmp_imm_s(IntCC::SignedLessThanOrEqual, rows, gemv::MAX_ROWS);
                fx.if_else(
                    few,
                    |fx| gemv::scores(fx, rows, cols, d, qp, lda, kp, ldk, s_tile, bn, alpha),
                    |fx| {
                        fx.call(abi::SGEMM_NT, &[rows, cols, d, qp, lda, kp, ldk, s_tile, bn, alpha, overwrite]);
                    },
                );
                let partial = fx.b.ins().icmp_imm_s(IntCC::Equal, class, 2);
                let qk = Recompute { q: qp, ldq: lda, k: kp, ldk, d, alpha };
                let tile = Tile { f, s_tile, bn, cols, j0, i0, b_pos: &b_pos, dims: &dims, extras: &extras, lane_iota, item: &item };
                fx.for_range(zero, rows, |fx, rr| {
                    if softmax {
                        let state = Running { max: rmax, sum: rsum, acc, dv: c.dv };
                        if f.spec.mask.is_some() {
                            fx.if_else(
                                partial,
                                |fx| tile.softmax_row(fx, rr, true, &state),
                                |fx| tile.unmasked_row(fx, rr, plain_score, &state, &qk),
                            );
                        } else {
                            tile.unmasked_row(fx, rr, plain_score, &state, &qk);
                        }
                    } else {
                        if f.spec.mask.is_some() {
                            fx.if_else(partial, |fx| tile.sigmoid(fx, rr, true), |fx| tile.sigmoid(fx, rr, false));
                        } else {
                            tile.sigmoid(fx, rr, false);
                        }
                    }
                });
                let vrow = fx.mul(j0, v_rs);
                let vv = fx.add(voff, vrow);
                let vp = fx.elem_addr(vb, vv);
                fx.if_else(
                    few,
                    |fx| gemv::values(fx, rows, cols, c.dv, s_tile, bn, vp, ldv, acc),
                    |fx| {
                        fx.call(abi::SGEMM_NN, &[rows, c.dv, cols, s_tile, bn, vp, ldv, acc, c.dv, one, accumulate]);
                    },
                );
            });
        });
        // Results: final rows, or the partial state for the merge step.
        let single = fx.b.ins().icmp_imm_s(IntCC::Equal, c.splits, 1);
        fx.if_else(
            single,
            |fx| {
                let ooff = fx.dot(zero, &bidx, &c.out_bs);
                fx.for_range(zero, rows, |fx, rr| {
                    let i = fx.add(i0, rr);
                    let orow = fx.mul(i, c.out_rs);
                    let orow = fx.add(ooff, orow);
                    let op = fx.elem_addr(c.out, orow);
                    let arow = fx.mul(rr, c.dv);
                    let ap = fx.elem_addr(acc, arow);
                    let lsum = ld(fx, rsum, rr);
                    write_row(fx, ap, op, c.dv, if softmax { Some(lsum) } else { None }, f.out.dtype);
                });
            },
            |fx| {
                fx.for_range(zero, rows, |fx, rr| {
                    let pr = partial_row(fx, &c, w, rr);
                    let mx = ld(fx, rmax, rr);
                    let sm = ld(fx, rsum, rr);
                    fx.store(mx, pr);
                    let one_e = fx.i64(1);
                    st(fx, sm, pr, one_e);
                    let two = fx.i64(2);
                    let dst = fx.elem_addr(pr, two);
                    let arow = fx.mul(rr, c.dv);
                    let ap = fx.elem_addr(acc, arow);
                    fx.rows(c.dv, &[ap, dst], &|fx, _, p| {
                        let x = ldp(fx, p[0]);
                        stp(fx, x, p[1]);
                    });
                });
            },
        );
    });
}

/// `dst[c] = src[c] / sum` (or `src[c]` when `sum` is `None`), 0 where `sum` is 0, rounded to
/// `dtype`.
fn write_row(fx: &mut Fx, src: Value, dst: Value, n: Value, sum: Option<Value>, dtype: DType) {
    fx.rows(n, &[src, dst], &|fx, _, p| {
        let x = ldp(fx, p[0]);
        let y = match sum {
            Some(s) => {
                let s = fx.splat(Kind::F, s);
                let q = fx.b.ins().fdiv(x, s);
                let z = fx.fconst(0.0);
                let empty = fx.b.ins().fcmp(FloatCC::Equal, s, z);
                fx.select_raw(empty, z, q)
            }
            None => x,
        };
        let y = fx.round_to(Tv { v: y, k: Kind::F }, dtype).v;
        stp(fx, y, p[1]);
    });
}

/// One Q·Kᵀ tile in scratch, and what its expressions need.
struct Tile<'t> {
    f: &'t FlashKernel,
    s_tile: Value,
    bn: Value,
    cols: Value,
    j0: Value,
    i0: Value,
    b_pos: &'t [Value],
    /// Score and mask parts computed once per work item.
    item: &'t Hoisted,
    dims: &'t HashMap<Dim, Value>,
    extras: &'t [Extra],
    lane_iota: Value,
}

/// A row's running softmax state in scratch.
struct Running {
    max: Value,
    sum: Value,
    acc: Value,
    dv: Value,
}

/// What recomputing a row of the Q·Kᵀ tile needs.
struct Recompute {
    q: Value,
    ldq: Value,
    k: Value,
    ldk: Value,
    d: Value,
    alpha: Value,
}

/// Largest sum of one tile row's `exp(s - running max)` the lazy path accepts without
/// taking the tile's max (2^64: far from f32 overflow in the accumulator).
const LAZY_LIMIT: f32 = 1.844_674_4e19;

impl Tile<'_> {
    /// Row `rr` the standard way: scores (mask applied when `masked`) and their max, then the
    /// online-softmax update.
    fn softmax_row(&self, fx: &mut Fx, rr: Value, masked: bool, st: &Running) {
        let plain = self.f.spec.score == ScoreExpr::Score;
        let tmax = self.scores(fx, rr, masked, plain);
        self.online_softmax(fx, rr, tmax, st.max, st.sum, st.acc, st.dv);
    }

    /// Row `rr` of a tile without masked scores. For plain scores after the row's first tile,
    /// the tile's max is not taken: probabilities are `exp(s - running max)` (softmax does
    /// not depend on the shift), which skips a pass over the row. If a score exceeds the
    /// running max so much that the row sum passes [`LAZY_LIMIT`], the row's scores are
    /// recomputed and it takes the standard path.
    fn unmasked_row(&self, fx: &mut Fx, rr: Value, plain: bool, st: &Running, qk: &Recompute) {
        if !plain {
            return self.softmax_row(fx, rr, false, st);
        }
        let old = ld(fx, st.max, rr);
        let ninf = fx.f32(f32::NEG_INFINITY);
        let first = fx.feq(old, ninf);
        fx.if_else(
            first,
            |fx| self.softmax_row(fx, rr, false, st),
            |fx| {
                let row = self.row(fx, rr);
                let sum = fx.call(abi::EXP_SUM, &[row, row, self.cols, old])[0];
                let limit = fx.f32(LAZY_LIMIT);
                let ok = fx.b.ins().fcmp(FloatCC::LessThanOrEqual, sum, limit);
                fx.if_else(
                    ok,
                    |fx| {
                        let l = ld(fx, st.sum, rr);
                        let l = fx.b.ins().fadd(l, sum);
                        st_(fx, l, st.sum, rr);
                    },
                    |fx| {
                        let one = fx.i64(1);
                        let qoff = fx.mul(rr, qk.ldq);
                        let qrow = fx.elem_addr(qk.q, qoff);
                        gemv::scores(fx, one, self.cols, qk.d, qrow, qk.ldq, qk.k, qk.ldk, row, self.bn, qk.alpha);
                        self.softmax_row(fx, rr, false, st);
                    },
                );
            },
        );
    }

    /// The row's scores in place: score modification, and the mask when `masked`
    /// (excluded scores become `-inf`). Returns the row's max.
    fn scores(&self, fx: &mut Fx, rr: Value, masked: bool, plain: bool) -> Value {
        let row = self.row(fx, rr);
        let ninf = fx.f32(f32::NEG_INFINITY);
        let vninf = fx.b.ins().splat(types::F32X4, ninf);
        let vacc = fx.var(types::F32X4, vninf);
        let sacc = fx.var(types::F32, ninf);
        let mut start = fx.i64(0);
        if !masked && plain {
            // Scores stay as they are: only the max, 16 at a time with four independent
            // accumulators so the max's latency does not serialise the loop.
            let accs: Vec<_> = (0..4).map(|_| fx.var(types::F32X4, vninf)).collect();
            let m16 = fx.i64(-16);
            let n16 = fx.b.ins().band(self.cols, m16);
            let bytes = fx.b.ins().ishl_imm_s(n16, 2);
            let end = fx.add(row, bytes);
            fx.for_step(row, end, 64, |fx, p| {
                fx.lanes = 4;
                for (k, acc) in accs.iter().enumerate() {
                    let x = fx.b.ins().load(types::F32X4, MemFlagsData::new().with_notrap(), p, 16 * k as i32);
                    let a = fx.b.use_var(*acc);
                    let m = max_fast(fx, a, x);
                    fx.b.def_var(*acc, m);
                }
                fx.lanes = 1;
            });
            let vals: Vec<Value> = accs.iter().map(|a| fx.b.use_var(*a)).collect();
            fx.lanes = 4;
            let m01 = max_fast(fx, vals[0], vals[1]);
            let m23 = max_fast(fx, vals[2], vals[3]);
            let m = max_fast(fx, m01, m23);
            fx.lanes = 1;
            fx.b.def_var(vacc, m);
            start = n16;
        }
        let mask = fx.i64(-4);
        let vec_end = fx.b.ins().band(self.cols, mask);
        let hoisted = if masked || !plain { self.row_hoisted(fx, rr) } else { Hoisted::new() };
        // The element pointer is a loop variable (see `Fx::rows`).
        let first = fx.elem_addr(row, start);
        let pv = fx.var(types::I64, first);
        let body = |fx: &mut Fx, c: Value| -> Value {
            let p = fx.b.use_var(pv);
            let s = ldp(fx, p);
            let x = if masked || !plain {
                let x = self.modified(fx, rr, c, s, masked, &hoisted);
                stp(fx, x, p);
                x
            } else {
                s
            };
            let next = fx.b.ins().iadd_imm_s(p, 4 * i64::from(fx.lanes));
            fx.b.def_var(pv, next);
            x
        };
        fx.for_step(start, vec_end, 4, |fx, c| {
            fx.lanes = 4;
            let x = body(fx, c);
            let m = fx.b.use_var(vacc);
            let m = max_fast(fx, m, x);
            fx.b.def_var(vacc, m);
            fx.lanes = 1;
        });
        fx.for_range(vec_end, self.cols, |fx, c| {
            let x = body(fx, c);
            let m = fx.b.use_var(sacc);
            let m = max_fast(fx, m, x);
            fx.b.def_var(sacc, m);
        });
        let mut m = fx.b.use_var(sacc);
        let v = fx.b.use_var(vacc);
        for lane in 0..4u8 {
            let x = fx.b.ins().extractlane(v, lane);
            m = max_fast(fx, m, x);
        }
        m
    }

    /// The address of row `rr` of the tile.
    fn row(&self, fx: &mut Fx, rr: Value) -> Value {
        let off = fx.mul(rr, self.bn);
        fx.elem_addr(self.s_tile, off)
    }

    /// The modified score of the element(s) at column `c`, `-inf` where masked out.
    /// The score and mask parts that depend on the row at most, computed for row `rr`.
    fn row_hoisted(&self, fx: &mut Fx, rr: Value) -> Hoisted {
        let mut pos = self.b_pos.to_vec();
        let i = fx.add(self.i0, rr);
        pos.push(fx.b.ins().ireduce(types::I32, i));
        pos.push(fx.b.ins().iconst(types::I32, 0));
        let env = Env { s: None, pos: &pos, dims: self.dims, extras: self.extras, hoisted: self.item };
        let exprs: Vec<&ScoreExpr> = std::iter::once(&self.f.spec.score).chain(self.f.spec.mask.as_ref()).collect();
        let mut out = self.item.clone();
        score::hoist(fx, &exprs, self.f.q.shape.len(), Level::Row, &env, &mut out);
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn modified(&self, fx: &mut Fx, rr: Value, c: Value, s: Value, masked: bool, hoisted: &Hoisted) -> Value {
        let mut pos: Vec<Value> = self.b_pos.iter().map(|b| fx.splat(Kind::I, *b)).collect();
        let i = fx.add(self.i0, rr);
        let i = fx.b.ins().ireduce(types::I32, i);
        pos.push(fx.splat(Kind::I, i));
        let j = fx.add(self.j0, c);
        let j = fx.b.ins().ireduce(types::I32, j);
        let mut j = fx.splat(Kind::I, j);
        if fx.lanes > 1 {
            j = fx.b.ins().iadd(j, self.lane_iota);
        }
        pos.push(j);
        let env = Env { s: Some(Tv { v: s, k: Kind::F }), pos: &pos, dims: self.dims, extras: self.extras, hoisted };
        let x = score::eval(fx, &self.f.spec.score, &env);
        let x = fx.cvt_f(x);
        match (&self.f.spec.mask, masked) {
            (Some(m), true) => {
                let keep = score::eval(fx, m, &env);
                let keep = fx.cvt_b(keep);
                let ninf = fx.fconst(f32::NEG_INFINITY);
                fx.select_raw(keep, x, ninf)
            }
            _ => x,
        }
    }

    /// Online-softmax update of row `rr` with the tile's scores (max `tmax`): the tile row
    /// becomes its probabilities, the running sum and accumulator are rescaled.
    #[allow(clippy::too_many_arguments)]
    fn online_softmax(&self, fx: &mut Fx, rr: Value, tmax: Value, rmax: Value, rsum: Value, acc: Value, dv: Value) {
        let row = self.row(fx, rr);
        let old = ld(fx, rmax, rr);
        let new = fx.b.ins().fmax(old, tmax);
        let ninf = fx.f32(f32::NEG_INFINITY);
        let empty = fx.feq(new, ninf);
        fx.if_else(
            empty,
            |fx| {
                // Nothing kept yet: this row contributes no weight.
                fx.rows(self.cols, &[row], &|fx, _, p| {
                    let z = fx.fconst(0.0);
                    stp(fx, z, p[0]);
                });
            },
            |fx| {
                let sum = fx.call(abi::EXP_SUM, &[row, row, self.cols, new])[0];
                let delta = fx.b.ins().fsub(old, new);
                let scale = fx.exp(delta);
                let l = ld(fx, rsum, rr);
                let l = fx.b.ins().fmul(l, scale);
                let l = fx.b.ins().fadd(l, sum);
                st(fx, l, rsum, rr);
                st(fx, new, rmax, rr);
                let one = fx.f32(1.0);
                let rescale = fx.b.ins().fcmp(FloatCC::NotEqual, scale, one);
                fx.if_then(rescale, |fx| {
                    let off = fx.mul(rr, dv);
                    let arow = fx.elem_addr(acc, off);
                    fx.rows(dv, &[arow], &|fx, _, p| {
                        let x = ldp(fx, p[0]);
                        let s = fx.splat(Kind::F, scale);
                        let y = fx.b.ins().fmul(x, s);
                        stp(fx, y, p[0]);
                    });
                });
            },
        );
    }

    /// Sigmoid weights of row `rr` in place: `keep ? sigmoid(score) : 0`.
    fn sigmoid(&self, fx: &mut Fx, rr: Value, masked: bool) {
        let row = self.row(fx, rr);
        let hoisted = self.row_hoisted(fx, rr);
        fx.rows(self.cols, &[row], &|fx, c, p| {
            let s = ldp(fx, p[0]);
            let x = self.modified(fx, rr, c, s, masked, &hoisted);
            let w = fx.sigmoid(x);
            stp(fx, w, p[0]);
        });
    }
}

/// Emits the merge of split-key partial states: one work item per (batch, query block).
pub fn emit_merge(fx: &mut Fx, f: &FlashKernel) {
    let c = common(fx, f);
    let softmax = f.spec.weights == Weights::Softmax;
    let (lo, hi) = (fx.lo(), fx.hi());
    fx.for_range(lo, hi, |fx, w| {
        let qblk = fx.b.ins().urem(w, c.nqb);
        let bi = fx.b.ins().udiv(w, c.nqb);
        let bidx = fx.unravel(bi, &c.bdims);
        let zero = fx.i64(0);
        let i0 = fx.mul(qblk, c.bm);
        let left = fx.sub(c.m, i0);
        let rows = fx.min(c.bm, left);
        let ooff = fx.dot(zero, &bidx, &c.out_bs);
        let first = fx.mul(w, c.splits);
        let end = fx.add(first, c.splits);
        fx.for_range(zero, rows, |fx, rr| {
            let i = fx.add(i0, rr);
            let orow = fx.mul(i, c.out_rs);
            let orow = fx.add(ooff, orow);
            let op = fx.elem_addr(c.out, orow);
            fx.rows(c.dv, &[op], &|fx, _, p| {
                let z = fx.fconst(0.0);
                stp(fx, z, p[0]);
            });
            let ninf = fx.f32(f32::NEG_INFINITY);
            let gmax = fx.var(types::F32, ninf);
            if softmax {
                fx.for_range(first, end, |fx, p| {
                    let pr = partial_row(fx, &c, p, rr);
                    let m = fx.load(types::F32, pr);
                    let g = fx.b.use_var(gmax);
                    let g = fx.b.ins().fmax(g, m);
                    fx.b.def_var(gmax, g);
                });
            }
            let g = fx.b.use_var(gmax);
            let fzero = fx.f32(0.0);
            let total = fx.var(types::F32, fzero);
            fx.for_range(first, end, |fx, p| {
                let pr = partial_row(fx, &c, p, rr);
                let wgt = if softmax {
                    let m = fx.load(types::F32, pr);
                    let dlt = fx.b.ins().fsub(m, g);
                    let e = fx.exp(dlt);
                    // Splits with no kept key (max -inf) weigh 0, also when every split is empty.
                    let ninf = fx.f32(f32::NEG_INFINITY);
                    let none = fx.feq(m, ninf);
                    let z = fx.f32(0.0);
                    let e = fx.b.ins().select(none, z, e);
                    let one_e = fx.i64(1);
                    let l = ld(fx, pr, one_e);
                    let t = fx.b.use_var(total);
                    let lw = fx.b.ins().fmul(l, e);
                    let t = fx.b.ins().fadd(t, lw);
                    fx.b.def_var(total, t);
                    e
                } else {
                    fx.f32(1.0)
                };
                let two = fx.i64(2);
                let src = fx.elem_addr(pr, two);
                fx.rows(c.dv, &[src, op], &|fx, _, p| {
                    let a = ldp(fx, p[0]);
                    let wv = fx.splat(Kind::F, wgt);
                    let o = ldp(fx, p[1]);
                    let y = fx.b.ins().fmul(a, wv);
                    let y = fx.b.ins().fadd(o, y);
                    stp(fx, y, p[1]);
                });
            });
            let t = fx.b.use_var(total);
            write_row(fx, op, op, c.dv, if softmax { Some(t) } else { None }, f.out.dtype);
        });
    });
}
