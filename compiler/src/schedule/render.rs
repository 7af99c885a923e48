//! What a renderer implements: one method per kernel kind ([`KernelRenderer`]), and the one
//! place that dispatches a [`Kernel`] to them ([`render_kernel`]). A new kernel kind is a new
//! variant and a new method, which every renderer must then implement.

use super::{FlashBwdKernel, FlashKernel, Fused, Kernel, Variant, View};
use crate::ir::{ReduceOp, ScanOp};

/// A renderer of the schedule's kernels, one method per kind (see [`Kernel`] for what each
/// computes); `Output` is what rendering one step gives the renderer.
#[allow(clippy::too_many_arguments)] // Each method takes its kernel's fields.
pub trait KernelRenderer {
    /// What one rendered step is.
    type Output;
    /// [`Kernel::Elementwise`].
    fn elementwise(&mut self, out: &View, inputs: &[View], expr: &super::Expr, more: &[(View, super::Expr)]) -> Self::Output;
    /// [`Kernel::MatMul`] of step `step`.
    fn matmul(&mut self, step: usize, a: &View, b: &View, c: &View, b_transposed: bool, variant: Variant) -> Self::Output;
    /// [`Kernel::Reduce`].
    fn reduce(&mut self, x: &View, op: ReduceOp, axes: &[usize], out: &View) -> Self::Output;
    /// [`Kernel::ReduceOf`].
    fn reduce_of(&mut self, x: &Fused, op: ReduceOp, axes: &[usize], out: &View) -> Self::Output;
    /// [`Kernel::Softmax`].
    fn softmax(&mut self, x: &View, axis: usize, out: &View) -> Self::Output;
    /// [`Kernel::Scan`].
    fn scan(&mut self, op: ScanOp, a: Option<&View>, x: &View, axis: usize, reverse: bool, out: &View) -> Self::Output;
    /// [`Kernel::PrefixAttention`].
    fn prefix_attention(&mut self, q: &View, k: &View, v: &View, reverse: bool, out: &View) -> Self::Output;
    /// [`Kernel::ScatterAdd`].
    fn scatter_add(&mut self, base: &View, idx: &View, src: &View, axis: usize, out: &View, site: usize) -> Self::Output;
    /// [`Kernel::ArgSort`].
    fn argsort(&mut self, x: &View, axis: usize, descending: bool, out: &View, scratch: Option<&View>, limit: Option<i64>) -> Self::Output;
    /// [`Kernel::Norm`].
    fn norm(&mut self, x: &View, gamma: &View, beta: Option<&View>, eps: f64, out: &View) -> Self::Output;
    /// [`Kernel::Dropout`].
    fn dropout(&mut self, x: &View, seed: &View, rate: f64, out: &View) -> Self::Output;
    /// [`Kernel::Flash`].
    fn flash(&mut self, f: &FlashKernel) -> Self::Output;
    /// [`Kernel::FlashMerge`].
    fn flash_merge(&mut self, f: &FlashKernel) -> Self::Output;
    /// [`Kernel::FlashBwd`].
    fn flash_bwd(&mut self, f: &FlashBwdKernel) -> Self::Output;
    /// [`Kernel::FlashBwdReduce`].
    fn flash_bwd_reduce(&mut self, f: &FlashBwdKernel) -> Self::Output;
}

/// Renders step `step`'s `kernel` with `r`: the one dispatch by kernel kind.
pub fn render_kernel<R: KernelRenderer + ?Sized>(r: &mut R, step: usize, kernel: &Kernel) -> R::Output {
    match kernel {
        Kernel::Elementwise { out, inputs, expr, more } => r.elementwise(out, inputs, expr, more),
        Kernel::MatMul { a, b, c, b_transposed, variant } => r.matmul(step, a, b, c, *b_transposed, *variant),
        Kernel::Reduce { x, op, axes, out } => r.reduce(x, *op, axes, out),
        Kernel::ReduceOf { x, op, axes, out } => r.reduce_of(x, *op, axes, out),
        Kernel::Softmax { x, axis, out } => r.softmax(x, *axis, out),
        Kernel::Scan { op, a, x, axis, reverse, out } => r.scan(*op, a.as_ref(), x, *axis, *reverse, out),
        Kernel::PrefixAttention { q, k, v, reverse, out } => r.prefix_attention(q, k, v, *reverse, out),
        Kernel::ScatterAdd { base, idx, src, axis, out, site } => r.scatter_add(base, idx, src, *axis, out, *site),
        Kernel::ArgSort { x, axis, descending, out, scratch, limit } => r.argsort(x, *axis, *descending, out, scratch.as_ref(), *limit),
        Kernel::Norm { x, gamma, beta, eps, out } => r.norm(x, gamma, beta.as_ref(), *eps, out),
        Kernel::Dropout { x, seed, rate, out } => r.dropout(x, seed, *rate, out),
        Kernel::Flash(f) => r.flash(f),
        Kernel::FlashMerge(f) => r.flash_merge(f),
        Kernel::FlashBwd(f) => r.flash_bwd(f),
        Kernel::FlashBwdReduce(f) => r.flash_bwd_reduce(f),
    }
}
