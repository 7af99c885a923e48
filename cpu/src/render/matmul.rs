//! Batched matrix products: the generated code walks (batch, row block) work items, computes
//! each operand's address from its (broadcast) batch strides, and calls the runtime's SGEMM
//! microkernel for the block. A transposed right operand (`k.T` of `q @ k.T`) is read in place
//! through the `nt` kernel.

use super::builder::StepBuilder;
use super::ops::Typed;
use crate::abi;
use attn_compiler::ir::semantics::Class;
use attn_compiler::ir::{DType, Dim};
use attn_compiler::schedule::{Tuning, View};
use cranelift_codegen::ir::{InstBuilder, Value, types};

/// Strides of `view`'s batch axes (all but the last two) aligned to `batch` (right-aligned;
/// broadcast axes step 0).
pub fn batch_strides(fx: &mut StepBuilder, view: &View, strides: &[Value], batch: &[Dim]) -> Vec<Value> {
    let own = view.shape.len().saturating_sub(2);
    let lead = batch.len().saturating_sub(own);
    (0..batch.len())
        .map(|t| match t.checked_sub(lead) {
            Some(a) if view.shape[a].as_const() != Some(1) => strides[a],
            _ => fx.i64(0),
        })
        .collect()
}

/// Emits `C = A @ B` over (batch, row block) work items.
pub fn emit(fx: &mut StepBuilder, step: usize, a: &View, b: &View, c: &View, b_transposed: bool) {
    let rc = c.shape.len();
    let batch = &c.shape[..rc - 2];
    let (ra, rb) = (a.shape.len(), b.shape.len());
    let (ab, ast) = fx.view_base(a);
    let (bb, bst) = fx.view_base(b);
    let (cb, cst) = fx.view_base(c);
    let bdims = fx.dims(batch);
    let abs = batch_strides(fx, a, &ast, batch);
    let bbs = batch_strides(fx, b, &bst, batch);
    let m = fx.dim(&c.shape[rc - 2]);
    let n = fx.dim(&c.shape[rc - 1]);
    let k = fx.dim(&a.shape[ra - 1]);
    let lda = fx.max(ast[ra - 2], k);
    let ldb = if b_transposed { fx.max(bst[rb - 1], k) } else { fx.max(bst[rb - 2], n) };
    let mb = fx.tuning(step, Tuning::MatMulRows);
    let nrb = fx.ceil_div(m, mb);
    let one = fx.f32(1.0);
    let overwrite = fx.b.ins().iconst(types::I32, 0);
    let kernel = if b_transposed { abi::SGEMM_NT } else { abi::SGEMM_NN };
    let (lo, hi) = (fx.lo(), fx.hi());
    fx.for_range(lo, hi, |fx, w| {
        let blk = fx.b.ins().urem(w, nrb);
        let bi = fx.b.ins().udiv(w, nrb);
        let idx = fx.unravel(bi, &bdims);
        let zero = fx.i64(0);
        let r0 = fx.mul(blk, mb);
        let left = fx.sub(m, r0);
        let rows = fx.min(mb, left);
        let aoff = fx.dot(zero, &idx, &abs);
        let arow = fx.mul(r0, ast[ra - 2]);
        let aoff = fx.add(aoff, arow);
        let boff = fx.dot(zero, &idx, &bbs);
        let coff = fx.dot(zero, &idx, &cst[..rc - 2]);
        let crow = fx.mul(r0, cst[rc - 2]);
        let coff = fx.add(coff, crow);
        let (ap, bp, cp) = (fx.elem_addr(ab, aoff), fx.elem_addr(bb, boff), fx.elem_addr(cb, coff));
        let ldc = cst[rc - 2];
        fx.call(kernel, &[rows, n, k, ap, lda, bp, ldb, cp, ldc, one, overwrite]);
        if matches!(c.dtype, DType::F16 | DType::BF16) {
            let total = fx.mul(rows, n);
            fx.for_range(zero, total, |fx, i| {
                let addr = fx.elem_addr(cp, i);
                let v = fx.load(types::F32, addr);
                let r = fx.round_to(Typed { v, k: Class::Float }, c.dtype);
                fx.store(r.v, addr);
            });
        }
    });
}
