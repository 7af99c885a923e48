//! Element-wise kernels: a work item is [`CUDA_ELEMENTS`] consecutive output elements, one per
//! thread; each thread computes its element's whole expression from the inputs' strided views
//! (broadcast axes read with stride 0) and stores it.

use super::cexpr::{Ints, delinearize, load};
use super::ops::{self, CVal, Lines};
use super::{CudaEmitError, KernelSource};
use attn_compiler::ir::semantics::Class;
use attn_compiler::ir::{DType, Dim};
use attn_compiler::schedule::policy::{CUDA_ELEMENTS, CUDA_THREADS};
use attn_compiler::schedule::{Expr, View};

/// The kernel of an element-wise step.
pub(super) fn emit(
    ints: &Ints,
    items: &str,
    out: &View,
    inputs: &[View],
    expr: &Expr,
    more: &[(View, Expr)],
) -> Result<KernelSource, CudaEmitError> {
    let mut body = vec![format!("const i64 n_ = {};", ints.dim(&Dim::product(&out.shape))?)];
    body.push(format!("for (i64 w_ = blockIdx.x; w_ < {items}; w_ += gridDim.x) {{"));
    body.push(format!("  const i64 e_ = w_ * {CUDA_ELEMENTS}LL + threadIdx.x;"));
    body.push("  if (e_ >= n_) continue;".into());
    let mut inner = Vec::new();
    // Dense views of one shape and an expression that reads no index: every view is one axis,
    // read at the element's number (no division per axis).
    let flat = linear(out, inputs, expr, more).then(|| {
        let n = Dim::product(&out.shape);
        move |v: &View| View { shape: vec![n.clone()], strides: vec![Dim::constant(1)], ..v.clone() }
    });
    let (out, inputs, more): (View, Vec<View>, Vec<(View, Expr)>) = match &flat {
        Some(f) => (f(out), inputs.iter().map(f).collect(), more.iter().map(|(o, e)| (f(o), e.clone())).collect()),
        None => (out.clone(), inputs.to_vec(), more.to_vec()),
    };
    let idx = delinearize(ints, &mut inner, "e_", &out.shape, "i")?;
    // Every output at the same index (they share the shape): one thread, one pass.
    let mut l = Lines::new("x");
    let mut stores = Vec::new();
    let inputs = &inputs[..];
    for (o, e) in std::iter::once((&out, expr)).chain(more.iter().map(|(o, e)| (o, e))) {
        let value = Eval { ints, inputs, idx: &idx }.eval(&mut l, e)?;
        stores.push(super::cexpr::store(o.buf, o.dtype, &ints.offset(o, &idx)?, &ops::store_value(&value, o.dtype)));
    }
    inner.extend(l.lines);
    inner.extend(stores);
    body.extend(super::cexpr::indent(&inner, 2));
    body.push("}".into());
    Ok(KernelSource { threads: CUDA_THREADS, items_per_block: 1, smem: super::Smem::None, body })
}

/// Whether an element-wise step's views are all dense with the output's shape and its
/// expressions read no index (no iota, no gather): then it runs over one flat axis.
fn linear(out: &View, inputs: &[View], expr: &Expr, more: &[(View, Expr)]) -> bool {
    let dense = |v: &View| v.shape == out.shape && v.is_contiguous();
    let mut indexless = true;
    for e in std::iter::once(expr).chain(more.iter().map(|(_, e)| e)) {
        e.visit(&mut |x| indexless &= !matches!(x, Expr::Iota { .. } | Expr::Gather(..) | Expr::DropoutBits(_)));
    }
    indexless && dense(out) && inputs.iter().all(dense) && more.iter().all(|(o, _)| dense(o))
}

/// Evaluates an element-wise expression at the kernel's index.
pub(super) struct Eval<'a> {
    pub(super) ints: &'a Ints<'a>,
    pub(super) inputs: &'a [View],
    /// The output's index, one expression per axis.
    pub(super) idx: &'a [String],
}

impl Eval<'_> {
    /// The index of a view of lower or equal rank broadcast to the kernel's index (aligned at
    /// the right; size-1 axes read at 0).
    fn broadcast(&self, view: &View) -> Vec<String> {
        let lead = self.idx.len().saturating_sub(view.shape.len());
        view.shape
            .iter()
            .enumerate()
            .map(|(a, d)| if d.as_const() == Some(1) { "0LL".into() } else { self.idx[a + lead].clone() })
            .collect()
    }

    fn input(&self, k: usize) -> Result<&View, CudaEmitError> {
        self.inputs.get(k).ok_or_else(|| self.ints.fail(format!("the expression reads input {k}, which the kernel lacks")))
    }

    pub(super) fn eval(&self, l: &mut Lines, e: &Expr) -> Result<CVal, CudaEmitError> {
        Ok(match e {
            Expr::Load(k) => {
                let v = self.input(*k)?;
                let off = self.ints.offset(v, &self.broadcast(v))?;
                l.bind(load(v.buf, v.dtype, &off), Class::of(v.dtype))
            }
            Expr::Const(c, dtype) => Lines::constant(dtype.round(*c), Class::of(*dtype)),
            Expr::Dim(d) => CVal::int(format!("attnc_wrap({})", self.ints.dim(d)?)),
            Expr::Iota { axis, rank, one } => {
                let k = (axis + self.idx.len()).checked_sub(*rank);
                match k.and_then(|k| self.idx.get(k)) {
                    Some(i) if !*one => CVal::int(format!("((int){i})")),
                    _ => CVal::int("0"),
                }
            }
            Expr::Unary(op, a, dtype) => {
                let a = self.eval(l, a)?;
                let r = ops::unary(l, *op, &a);
                stored(l, &r, *dtype)
            }
            Expr::Binary(op, a, b, dtype) => {
                let (a, b) = (self.eval(l, a)?, self.eval(l, b)?);
                let r = ops::binary(l, *op, &a, &b);
                stored(l, &r, *dtype)
            }
            Expr::Select(c, a, b, dtype) => {
                let (c, a, b) = (self.eval(l, c)?, self.eval(l, a)?, self.eval(l, b)?);
                let r = ops::select(l, &c, &a, &b);
                stored(l, &r, *dtype)
            }
            Expr::Cast(a, dtype) => {
                let a = self.eval(l, a)?;
                stored(l, &a, *dtype)
            }
            Expr::Gather(t, idx, _, site) => {
                let table = self.input(*t)?;
                let fault = self.ints.schedule.fault.ok_or_else(|| self.ints.fail("a checked gather without a fault record".into()))?;
                let mut sub = Vec::new();
                let mut sizes = Vec::new();
                for (k, e) in idx.iter().enumerate() {
                    let i = self.eval(l, e)?;
                    let size = table.shape.get(k).map_or(Ok("1LL".to_string()), |d| self.ints.dim(d))?;
                    sub.push(format!("attnc_checki((i64){}, {size}, b{fault}, {site}, {k})", ops::convert(&i, Class::Int)));
                    sizes.push(format!("{size} == 0"));
                }
                let off = self.ints.offset(table, &sub)?;
                // An empty axis has no element to read (the fault is recorded either way).
                let value = if sizes.is_empty() {
                    load(table.buf, table.dtype, &off)
                } else {
                    let zero = if Class::of(table.dtype) == Class::Float { "0.0f" } else { "0" };
                    format!("(({}) ? {zero} : {})", sizes.join(" || "), load(table.buf, table.dtype, &off))
                };
                l.bind(value, Class::of(table.dtype))
            }
            Expr::DropoutBits(a) => {
                let mut args = Vec::new();
                for e in a.iter() {
                    let x = self.eval(l, e)?;
                    args.push(ops::convert(&x, Class::Int));
                }
                l.bind(format!("attnc_dropout_bits({})", args.join(", ")), Class::Int)
            }
        })
    }
}

/// A node's value as stored in its dtype (rounded to f16/bf16, converted to its class).
fn stored(l: &mut Lines, x: &CVal, dtype: DType) -> CVal {
    let class = Class::of(dtype);
    if x.class == class && !matches!(dtype, DType::F16 | DType::BF16) {
        return x.clone();
    }
    l.bind(ops::store_value(x, dtype), class)
}
