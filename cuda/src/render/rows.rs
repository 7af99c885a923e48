//! Row kernels: reductions, softmax, layer norm and RMS norm. A work item is one output element
//! (reductions) or one row (softmax, norms), taken by one warp ([`CUDA_ROW_WARPS`] per block);
//! the lanes stride over the row's elements through the operand's strided view and combine with
//! warp shuffles. Float sums and statistics accumulate in double, as the interpreter does in
//! f64; integer sums in 64 bits, wrapped to i32 at the end.

use super::cexpr::{Ints, delinearize, double_lit, indent, load, round_to, store};
use super::ops::{self, CVal};
use super::{CudaEmitError, KernelSource, Smem};
use attn_compiler::ir::semantics::Class;
use attn_compiler::ir::{DType, Dim, ReduceOp, ScanOp};
use attn_compiler::schedule::policy::{CUDA_ROW_WARPS, CUDA_THREADS};
use attn_compiler::schedule::{Fused, View};

/// The loop over a row kernel's work items, one per warp, around `item`.
fn rows(items: &str, item: Vec<String>) -> KernelSource {
    let mut body = vec![
        "const int lane_ = threadIdx.x & 31;".to_string(),
        format!(
            "for (i64 w_ = (i64)blockIdx.x * {CUDA_ROW_WARPS} + (threadIdx.x >> 5); w_ < {items}; w_ += (i64)gridDim.x * {CUDA_ROW_WARPS}) {{"
        ),
    ];
    body.extend(indent(&item, 2));
    body.push("}".into());
    KernelSource { threads: CUDA_THREADS, items_per_block: CUDA_ROW_WARPS, smem: Smem::None, body }
}

/// `x` at the full index whose `outer` axes come from the item and `inner` axes from element
/// `e_` of the row.
struct Row<'a> {
    ints: &'a Ints<'a>,
    x: &'a View,
    outer: Vec<usize>,
    outer_idx: Vec<String>,
    inner: Vec<usize>,
}

impl Row<'_> {
    /// Statements binding element `e_`'s value (as float, or int for integer reductions) to
    /// `v_`; the loop over the row's `n_` elements is the caller's.
    fn element(&self, class: Class) -> Result<Vec<String>, CudaEmitError> {
        let mut lines = Vec::new();
        let shape: Vec<Dim> = self.inner.iter().map(|a| self.x.shape[*a].clone()).collect();
        let inner_idx = if shape.len() == 1 { vec!["e_".to_string()] } else { delinearize(self.ints, &mut lines, "e_", &shape, "r")? };
        let mut idx = vec!["0LL".to_string(); self.x.shape.len()];
        for (k, a) in self.outer.iter().enumerate() {
            idx[*a] = self.outer_idx[k].clone();
        }
        for (k, a) in self.inner.iter().enumerate() {
            idx[*a] = inner_idx[k].clone();
        }
        let raw = CVal { text: load(self.x.buf, self.x.dtype, &self.ints.offset(self.x, &idx)?), class: Class::of(self.x.dtype) };
        lines.push(format!("const {} v_ = {};", super::cexpr::ctype(class), ops::convert(&raw, class)));
        Ok(lines)
    }

    /// The offset in `v` (a view with the row's outer axes) of element `at` along `axis`.
    fn offset_in(&self, v: &View, axis: usize, at: &str) -> Result<String, CudaEmitError> {
        let mut idx = vec!["0LL".to_string(); v.shape.len()];
        for (k, a) in self.outer.iter().enumerate() {
            idx[*a] = self.outer_idx[k].clone();
        }
        idx[axis] = at.to_string();
        self.ints.offset(v, &idx)
    }

    /// `for (e_ over the row) { v_ = x[...]; each }` with lanes striding the row.
    fn pass(&self, class: Class, each: &str) -> Result<Vec<String>, CudaEmitError> {
        let mut out = vec!["for (i64 e_ = lane_; e_ < n_; e_ += 32) {".to_string()];
        out.extend(indent(&self.element(class)?, 2));
        out.push(format!("  {each}"));
        out.push("}".into());
        Ok(out)
    }
}

/// Splits `x`'s axes into the item's (`outer`) and the row's (`inner`), and binds the item's
/// index from `w_`.
fn row<'a>(ints: &'a Ints<'a>, x: &'a View, inner: Vec<usize>, item: &mut Vec<String>) -> Result<Row<'a>, CudaEmitError> {
    let (outer, outer_idx) = split(ints, &x.shape, &inner, item)?;
    Ok(Row { ints, x, outer, outer_idx, inner })
}

/// The axes of `shape` not in `inner` (the item's) and their index bound from `w_`, with the
/// row's length bound to `n_`.
fn split(ints: &Ints, shape: &[Dim], inner: &[usize], item: &mut Vec<String>) -> Result<(Vec<usize>, Vec<String>), CudaEmitError> {
    let outer: Vec<usize> = (0..shape.len()).filter(|a| !inner.contains(a)).collect();
    let outer_shape: Vec<Dim> = outer.iter().map(|a| shape[*a].clone()).collect();
    let inner_shape: Vec<Dim> = inner.iter().map(|a| shape[*a].clone()).collect();
    item.push(format!("const i64 n_ = {};", ints.dim(&Dim::product(&inner_shape))?));
    let outer_idx = delinearize(ints, item, "w_", &outer_shape, "o")?;
    Ok((outer, outer_idx))
}

/// The kernel of a reduction step: one output element per item.
pub(super) fn reduce(ints: &Ints, items: &str, x: &View, op: ReduceOp, axes: &[usize], out: &View) -> Result<KernelSource, CudaEmitError> {
    let mut item = Vec::new();
    let r = row(ints, x, axes.to_vec(), &mut item)?;
    let int = Class::of(x.dtype) == Class::Int;
    let (acc_ty, init, combine, finish, class) = reduction(op, int);
    item.push(format!("{acc_ty} acc_ = {init};"));
    item.extend(r.pass(class, combine)?);
    reduced(ints, item, items, (op, int, finish), out)
}

/// The kernel of a reduction of an element-wise expression: [`reduce`], each element computed
/// at its index instead of loaded.
pub(super) fn reduce_of(
    ints: &Ints,
    items: &str,
    x: &Fused,
    op: ReduceOp,
    axes: &[usize],
    out: &View,
) -> Result<KernelSource, CudaEmitError> {
    let mut item = Vec::new();
    let (outer, outer_idx) = split(ints, &x.shape, axes, &mut item)?;
    let inner_shape: Vec<Dim> = axes.iter().map(|a| x.shape[*a].clone()).collect();
    let int = Class::of(x.dtype) == Class::Int;
    let (acc_ty, init, combine, finish, class) = reduction(op, int);
    item.push(format!("{acc_ty} acc_ = {init};"));
    let mut element = Vec::new();
    let inner_idx = delinearize(ints, &mut element, "e_", &inner_shape, "r")?;
    let mut idx = vec!["0LL".to_string(); x.shape.len()];
    for (k, a) in outer.iter().enumerate() {
        idx[*a] = outer_idx[k].clone();
    }
    for (k, a) in axes.iter().enumerate() {
        idx[*a] = inner_idx[k].clone();
    }
    let mut l = ops::Lines::new("x");
    let value = super::elementwise::Eval { ints, inputs: &x.inputs, idx: &idx }.eval(&mut l, &x.expr)?;
    element.extend(l.lines);
    element.push(format!("const {} v_ = {};", super::cexpr::ctype(class), ops::convert(&value, class)));
    element.push(combine.to_string());
    item.push("for (i64 e_ = lane_; e_ < n_; e_ += 32) {".to_string());
    item.extend(indent(&element, 2));
    item.push("}".into());
    reduced(ints, item, items, (op, int, finish), out)
}

/// A reduction's accumulator type, initial value, combining and warp-combining statements, and
/// the class its elements are read as.
fn reduction(op: ReduceOp, int: bool) -> (&'static str, &'static str, &'static str, &'static str, Class) {
    let (acc_ty, init, combine, finish, class) = match (op, int) {
        (ReduceOp::Sum | ReduceOp::Mean, true) => ("long long", "0", "acc_ += v_;", "acc_ = attnc_warp_sum_ll(acc_);", Class::Int),
        (ReduceOp::Sum | ReduceOp::Mean, false) => ("double", "0.0", "acc_ += (double)v_;", "acc_ = attnc_warp_sum_d(acc_);", Class::Float),
        // A log-sum-exp never reaches a kernel (the schedule expands it into max, exp, sum, log).
        (ReduceOp::Max | ReduceOp::LogSumExp, _) => {
            ("double", "(-ATTNC_DINF)", "acc_ = attnc_dmax(acc_, (double)v_);", "acc_ = attnc_warp_max_d(acc_);", Class::Float)
        }
        (ReduceOp::Min, _) => {
            ("double", "ATTNC_DINF", "acc_ = attnc_dmin(acc_, (double)v_);", "acc_ = attnc_warp_min_d(acc_);", Class::Float)
        }
    };
    // Integer max and min are exact in double.
    let class = if int && matches!(op, ReduceOp::Max | ReduceOp::Min) { Class::Int } else { class };
    (acc_ty, init, combine, finish, class)
}

/// The end of a reduction's item (`acc_` holds the lane's part): the warp's combination, and
/// the result stored by lane 0.
fn reduced(
    ints: &Ints,
    mut item: Vec<String>,
    items: &str,
    (op, int, finish): (ReduceOp, bool, &str),
    out: &View,
) -> Result<KernelSource, CudaEmitError> {
    item.push(finish.to_string());
    let value = match (op, int, out.dtype) {
        (ReduceOp::Mean, _, _) => CVal::float("(float)(n_ == 0 ? 0.0 : (double)acc_ / (double)n_)"),
        (ReduceOp::Sum, true, _) => CVal::int("attnc_wrap(acc_)"),
        (_, true, _) => CVal::int("(int)acc_"),
        (_, false, _) => CVal::float("(float)acc_"),
    };
    let off = ints.offset(out, &delinearize(ints, &mut item, "w_", &out.shape, "q")?)?;
    item.push(format!("if (lane_ == 0) {{ {} }}", store(out.buf, out.dtype, &off, &ops::store_value(&value, out.dtype))));
    Ok(rows(items, item))
}

/// The kernel of a softmax step: one row per item; a row whose max is `-inf` gives zeros; the
/// max propagates NaN.
pub(super) fn softmax(ints: &Ints, items: &str, x: &View, axis: usize, out: &View) -> Result<KernelSource, CudaEmitError> {
    let mut item = Vec::new();
    let r = row(ints, x, vec![axis], &mut item)?;
    item.push("float mx_ = -ATTNC_INF;".into());
    item.extend(r.pass(Class::Float, "mx_ = attnc_fmax(mx_, v_);")?);
    item.push("mx_ = attnc_warp_max(mx_);".into());
    item.push("float sum_ = 0.0f;".into());
    item.push("if (mx_ != -ATTNC_INF) {".into());
    item.extend(indent(&r.pass(Class::Float, "sum_ += expf(v_ - mx_);")?, 2));
    item.push("}".into());
    item.push("sum_ = attnc_warp_sum(sum_);".into());
    // The output has x's shape: the same index on out's view.
    let o = Row { ints, x: out, outer: r.outer.clone(), outer_idx: r.outer_idx.clone(), inner: r.inner.clone() };
    let y = round_to(out.dtype, "(mx_ == -ATTNC_INF ? 0.0f : expf(v_ - mx_) / sum_)");
    item.push("for (i64 e_ = lane_; e_ < n_; e_ += 32) {".into());
    item.extend(indent(&r.element(Class::Float)?, 2));
    item.push(format!("  {}", store_at(&o, out.dtype, &y)?));
    item.push("}".into());
    Ok(rows(items, item))
}

/// The kernel of a scan step: one row per item, walked in order by the warp's first lane (the
/// accumulation is sequential, as the interpreter's), in double (64-bit integers, wrapping).
pub(super) fn scan(
    ints: &Ints,
    items: &str,
    (op, axis, reverse): (ScanOp, usize, bool),
    a: Option<&View>,
    x: &View,
    out: &View,
) -> Result<KernelSource, CudaEmitError> {
    let mut item = Vec::new();
    let r = row(ints, x, vec![axis], &mut item)?;
    let int = Class::of(x.dtype) == Class::Int;
    let (acc_ty, init) = match (op, int) {
        (ScanOp::Prod, true) => ("long long", "1LL"),
        (_, true) => ("long long", "0LL"),
        (ScanOp::Prod, false) => ("double", "1.0"),
        (_, false) => ("double", "0.0"),
    };
    item.push("if (lane_ == 0) {".into());
    item.push(format!("  {acc_ty} acc_ = {init};"));
    item.push("  for (i64 s_ = 0; s_ < n_; ++s_) {".into());
    let mut body = vec![format!("const i64 e_ = {};", if reverse { "n_ - 1 - s_" } else { "s_" })];
    if let Some(a) = a {
        let ra = Row { ints, x: a, outer: r.outer.clone(), outer_idx: r.outer_idx.clone(), inner: r.inner.clone() };
        body.push("double c_;".into());
        body.push("{".into());
        body.extend(indent(&ra.element(Class::Float)?, 2));
        body.push("  c_ = (double)v_;".into());
        body.push("}".into());
    }
    body.extend(r.element(if int { Class::Int } else { Class::Float })?);
    body.push(
        match (op, int) {
            (ScanOp::Prod, true) => "acc_ = (long long)((unsigned long long)acc_ * (unsigned long long)(long long)v_);",
            (_, true) => "acc_ = (long long)((unsigned long long)acc_ + (unsigned long long)(long long)v_);",
            (ScanOp::Sum, false) => "acc_ = acc_ + (double)v_;",
            (ScanOp::Prod, false) => "acc_ = acc_ * (double)v_;",
            (ScanOp::Linear, false) => "acc_ = attnc_dmuladd(c_, acc_, (double)v_);",
        }
        .to_string(),
    );
    let value = if int { CVal::int("attnc_wrap(acc_)") } else { CVal::float("(float)acc_") };
    let o = Row { ints, x: out, outer: r.outer.clone(), outer_idx: r.outer_idx.clone(), inner: r.inner.clone() };
    body.push(store_at(&o, out.dtype, &ops::store_value(&value, out.dtype))?);
    item.extend(indent(&body, 4));
    item.push("  }".into());
    item.push("}".into());
    Ok(rows(items, item))
}

/// The kernel of a scatter-add step: one row per item, copied from `base` then accumulated in
/// order by the warp's first lane (each sum rounded to the element type, as the interpreter).
pub(super) fn scatter_add(
    ints: &Ints,
    items: &str,
    (base, idx, src): (&View, &View, &View),
    axis: usize,
    out: &View,
    site: usize,
) -> Result<KernelSource, CudaEmitError> {
    let fault = ints.schedule.fault.ok_or_else(|| ints.fail("a checked scatter_add without a fault record".into()))?;
    let mut item = Vec::new();
    let r = row(ints, out, vec![axis], &mut item)?;
    let at = |v: &View, pos: &str| r.offset_in(v, axis, pos);
    let m = ints.dim(&src.shape[axis])?;
    item.push("if (lane_ == 0) {".into());
    let mut body = vec!["for (i64 e_ = 0; e_ < n_; ++e_) {".to_string()];
    body.push(format!("  {}", store(out.buf, out.dtype, &at(out, "e_")?, &load(base.buf, base.dtype, &at(base, "e_")?))));
    body.push("}".into());
    body.push(format!("for (i64 j_ = 0; j_ < {m}; ++j_) {{"));
    body.push(format!("  i64 t_ = (i64){};", load(idx.buf, DType::I32, &at(idx, "j_")?)));
    // Out of range: recorded, and skipped.
    body.push(format!("  if (t_ < 0 || t_ >= n_) {{ attnc_checki(t_, n_, b{fault}, {site}, {axis}); continue; }}"));
    let sum =
        round_to(out.dtype, &format!("({} + {})", load(out.buf, out.dtype, &at(out, "t_")?), load(src.buf, src.dtype, &at(src, "j_")?)));
    body.push(format!("  {}", store(out.buf, out.dtype, &at(out, "t_")?, &sum)));
    body.push("}".into());
    item.extend(indent(&body, 2));
    item.push("}".into());
    Ok(rows(items, item))
}

/// The kernel of an argsort step: one row per item, taken by a whole block, as a merge sort of
/// index permutations between `out` and `scratch`. Pass `w` merges sorted runs of `w` into runs
/// of `2w`: every thread places its elements at their rank within their own run plus the count
/// of the partner run's elements that sort before them (a binary search). The order of
/// `attnc_sorts_before` is total (ties by index), so ranks never collide and the sort is
/// stable. O(n log² n) comparisons per row, spread over the block's threads.
pub(super) fn argsort(
    ints: &Ints,
    items: &str,
    x: &View,
    axis: usize,
    descending: bool,
    out: &View,
    scratch: Option<&View>,
) -> Result<KernelSource, CudaEmitError> {
    let scratch = scratch.ok_or_else(|| ints.fail("the CUDA argsort needs a scratch permutation".to_string()))?;
    let mut item = Vec::new();
    let r = row(ints, x, vec![axis], &mut item)?;
    let class = if Class::of(x.dtype) == Class::Int { Class::Int } else { Class::Float };
    // Element `at` of the input row as a double, into `into`.
    let value_of = |lines: &mut Vec<String>, at: &str, into: &str| -> Result<(), CudaEmitError> {
        lines.push("{".into());
        lines.push(format!("  const i64 e_ = {at};"));
        lines.extend(indent(&r.element(class)?, 2));
        lines.push(format!("  {into} = (double)v_;"));
        lines.push("}".into());
        Ok(())
    };
    // Element `at` of the row of a permutation view (`out` or `scratch`).
    let off = |v: &View, at: &str| r.offset_in(v, axis, at);
    let (o, t) = (out, scratch);
    let load_perm = |from_out: &str, at: &str| -> Result<String, CudaEmitError> {
        Ok(format!("({from_out} ? {} : {})", load(o.buf, DType::I32, &off(o, at)?), load(t.buf, DType::I32, &off(t, at)?)))
    };
    let store_perm = |to_out: &str, at: &str, value: &str| -> Result<String, CudaEmitError> {
        Ok(format!(
            "if ({to_out}) {} else {}",
            store(o.buf, DType::I32, &off(o, at)?, value),
            store(t.buf, DType::I32, &off(t, at)?, value)
        ))
    };
    let threads = CUDA_THREADS;
    item.push(format!("for (i64 e_ = threadIdx.x; e_ < n_; e_ += {threads}) {}", store(o.buf, DType::I32, &off(o, "e_")?, "(int)e_")));
    item.push("int in_out_ = 1;  // which permutation holds the sorted runs".into());
    item.push("for (i64 w2_ = 1; w2_ < n_; w2_ *= 2) {".into());
    let mut pass = vec!["attnc_sync();".to_string(), format!("for (i64 i_ = threadIdx.x; i_ < n_; i_ += {threads}) {{")];
    let mut el = vec![format!("const int me_ = {};", load_perm("in_out_", "i_")?), "double vme_;".into()];
    value_of(&mut el, "(i64)me_", "vme_")?;
    el.extend([
        "const i64 run_ = i_ / w2_, start_ = run_ * w2_, base_ = (run_ & ~(i64)1) * w2_;".to_string(),
        "const i64 ps_ = (run_ ^ 1) * w2_, pe_ = ps_ + w2_ < n_ ? ps_ + w2_ : n_;".into(),
        "i64 lo_ = 0, hi_ = ps_ < n_ ? pe_ - ps_ : 0;".into(),
        "while (lo_ < hi_) {".into(),
        "  const i64 mid_ = (lo_ + hi_) / 2;".into(),
    ]);
    let mut search = vec![format!("const int other_ = {};", load_perm("in_out_", "(ps_ + mid_)")?), "double vo_;".into()];
    value_of(&mut search, "(i64)other_", "vo_")?;
    search.push(format!(
        "if (attnc_sorts_before(vo_, (i64)other_, vme_, (i64)me_, {})) lo_ = mid_ + 1; else hi_ = mid_;",
        i32::from(descending)
    ));
    el.extend(indent(&search, 2));
    el.push("}".into());
    el.push(store_perm("!in_out_", "(base_ + (i_ - start_) + lo_)", "me_")?);
    pass.extend(indent(&el, 2));
    pass.push("}".into());
    pass.push("in_out_ = !in_out_;".into());
    item.extend(indent(&pass, 2));
    item.push("}".into());
    item.push("attnc_sync();".into());
    item.push("if (!in_out_) {".into());
    item.push(format!(
        "  for (i64 e_ = threadIdx.x; e_ < n_; e_ += {threads}) {}",
        store(o.buf, DType::I32, &off(o, "e_")?, &load(t.buf, DType::I32, &off(t, "e_")?))
    ));
    item.push("}".into());
    item.push("attnc_sync();  // before the next row reuses the permutations' rows".into());
    let mut body = vec![format!("for (i64 w_ = blockIdx.x; w_ < {items}; w_ += gridDim.x) {{")];
    body.extend(indent(&item, 2));
    body.push("}".into());
    Ok(KernelSource { threads, items_per_block: 1, smem: Smem::None, body })
}

/// The kernel of an argsort step whose users read only its first `k` places (`topk`): one
/// block per row picks them in order, each as the block-wide minimum (by `attnc_sorts_before`,
/// ties by index) of the elements that sort after the previous pick. `k` passes over the row
/// and a shared-memory reduction each; the places after `k` are not written (the schedule's
/// `limit`).
pub(super) fn argselect(
    ints: &Ints,
    items: &str,
    x: &View,
    axis: usize,
    descending: bool,
    out: &View,
    k: i64,
) -> Result<KernelSource, CudaEmitError> {
    let threads = CUDA_THREADS;
    let mut item = Vec::new();
    let r = row(ints, x, vec![axis], &mut item)?;
    let class = if Class::of(x.dtype) == Class::Int { Class::Int } else { Class::Float };
    let desc = i32::from(descending);
    item.push("double lv_ = 0.0; i64 li_ = -1;  // the previous pick".into());
    item.push(format!("for (i64 p_ = 0; p_ < {k} && p_ < n_; ++p_) {{"));
    let mut pass = vec!["double bv_ = 0.0; i64 bi_ = -1;".to_string(), format!("for (i64 e_ = threadIdx.x; e_ < n_; e_ += {threads}) {{")];
    let mut el = r.element(class)?;
    el.push("const double d_ = (double)v_;".into());
    el.push(format!("if (li_ >= 0 && !attnc_sorts_before(lv_, li_, d_, e_, {desc})) continue;  // picked already"));
    el.push(format!("if (bi_ < 0 || attnc_sorts_before(d_, e_, bv_, bi_, {desc})) {{ bv_ = d_; bi_ = e_; }}"));
    pass.extend(indent(&el, 2));
    pass.push("}".into());
    pass.extend([
        "sv_[threadIdx.x] = bv_; si_[threadIdx.x] = bi_;".to_string(),
        "attnc_sync();".into(),
        format!("for (int h_ = {} ; h_ > 0; h_ >>= 1) {{", threads / 2),
        "  if ((int)threadIdx.x < h_) {".into(),
        "    const double ov_ = sv_[threadIdx.x + h_]; const i64 oi_ = si_[threadIdx.x + h_];".into(),
        format!(
            "    if (oi_ >= 0 && (si_[threadIdx.x] < 0 || attnc_sorts_before(ov_, oi_, sv_[threadIdx.x], si_[threadIdx.x], {desc}))) {{"
        ),
        "      sv_[threadIdx.x] = ov_; si_[threadIdx.x] = oi_;".into(),
        "    }".into(),
        "  }".into(),
        "  attnc_sync();".into(),
        "}".into(),
        "lv_ = sv_[0]; li_ = si_[0];".into(),
        format!("if (threadIdx.x == 0) {}", store(out.buf, DType::I32, &r.offset_in(out, axis, "p_")?, "(int)li_")),
        "attnc_sync();  // before the next pass overwrites the reduction".into(),
    ]);
    item.extend(indent(&pass, 2));
    item.push("}".into());
    let mut body = vec![
        format!("ATTNC_SHARED double sv_[{threads}];  // each thread's best value, then the block's"),
        format!("ATTNC_SHARED i64 si_[{threads}];  // and its index (-1: none)"),
        format!("for (i64 w_ = blockIdx.x; w_ < {items}; w_ += gridDim.x) {{"),
    ];
    body.extend(indent(&item, 2));
    body.push("}".into());
    Ok(KernelSource { threads, items_per_block: 1, smem: Smem::None, body })
}

/// A store of `value` into `o`'s view at element `e_` of the row.
fn store_at(o: &Row, dtype: DType, value: &str) -> Result<String, CudaEmitError> {
    Ok(store(o.x.buf, dtype, &o.offset_in(o.x, o.inner[0], "e_")?, value))
}

/// The kernel of a layer norm (`beta` given) or RMS norm step over the last axis, in double.
pub(super) fn norm(
    ints: &Ints,
    items: &str,
    x: &View,
    gamma: &View,
    beta: Option<&View>,
    eps: f64,
    out: &View,
) -> Result<KernelSource, CudaEmitError> {
    let last = x.shape.len() - 1;
    let mut item = Vec::new();
    let r = row(ints, x, vec![last], &mut item)?;
    item.push("double s_ = 0.0;".into());
    if beta.is_some() {
        item.extend(r.pass(Class::Float, "s_ += (double)v_;")?);
        item.push("const double mean_ = attnc_warp_sum_d(s_) / (double)n_;".into());
        item.push("double q_ = 0.0;".into());
        item.extend(r.pass(Class::Float, "{ const double d_ = (double)v_ - mean_; q_ += d_ * d_; }")?);
        item.push(format!("const double den_ = sqrt(attnc_warp_sum_d(q_) / (double)n_ + {});", double_lit(eps)));
    } else {
        item.push("const double mean_ = 0.0;".into());
        item.extend(r.pass(Class::Float, "{ const double d_ = (double)v_; s_ += d_ * d_; }")?);
        item.push(format!("const double den_ = sqrt(attnc_warp_sum_d(s_) / (double)n_ + {});", double_lit(eps)));
    }
    let param = |p: &View| -> Result<String, CudaEmitError> {
        let raw = CVal { text: load(p.buf, p.dtype, &ints.offset(p, &["e_".to_string()])?), class: Class::of(p.dtype) };
        Ok(format!("(double){}", ops::convert(&raw, Class::Float)))
    };
    let mut y = format!("((double)v_ - mean_) / den_ * {}", param(gamma)?);
    if let Some(b) = beta {
        y = format!("{y} + {}", param(b)?);
    }
    let o = Row { ints, x: out, outer: r.outer.clone(), outer_idx: r.outer_idx.clone(), inner: r.inner.clone() };
    item.push("for (i64 e_ = lane_; e_ < n_; e_ += 32) {".into());
    item.extend(indent(&r.element(Class::Float)?, 2));
    item.push(format!("  {}", store_at(&o, out.dtype, &round_to(out.dtype, &format!("(float)({y})")))?));
    item.push("}".into());
    Ok(rows(items, item))
}

/// The kernel of a causal linear attention step: one batch index per warp, lanes over the value
/// columns. For each key width index `x` a running `Σ_{j ≤ i} k_j[x] v_j[e]` (in double, from
/// the end when `reverse`) adds `q_i[x]` times itself into `out_i[e]`: O(S·D) per column, no
/// state beyond a register. Correctness first: the CPU runs the blocked products instead.
pub(super) fn prefix_attention(
    ints: &Ints,
    items: &str,
    q: &View,
    k: &View,
    v: &View,
    reverse: bool,
    out: &View,
) -> Result<KernelSource, CudaEmitError> {
    let r = q.shape.len();
    let (s, d, dv) = (ints.dim(&q.shape[r - 2])?, ints.dim(&q.shape[r - 1])?, ints.dim(&v.shape[r - 1])?);
    let at = |x: &View, item: &str| -> Result<String, CudaEmitError> { Ok(format!("{} + w_ * {item}", ints.dim(&x.offset)?)) };
    let item = vec![
        format!("const i64 s_ = {s}, d_ = {d}, dv_ = {dv};"),
        format!(
            "const i64 q0_ = {}, k0_ = {}, v0_ = {}, o0_ = {};",
            at(q, "s_ * d_")?,
            at(k, "s_ * d_")?,
            at(v, "s_ * dv_")?,
            at(out, "s_ * dv_")?
        ),
        "for (i64 e_ = lane_; e_ < dv_; e_ += 32) {".into(),
        "  for (i64 i_ = 0; i_ < s_; ++i_) {".into(),
        format!("    {}", store(out.buf, DType::F32, "o0_ + i_ * dv_ + e_", "0.0f")),
        "  }".into(),
        "  for (i64 x_ = 0; x_ < d_; ++x_) {".into(),
        "    double acc_ = 0.0;".into(),
        "    for (i64 t_ = 0; t_ < s_; ++t_) {".into(),
        format!("      const i64 i_ = {};", if reverse { "s_ - 1 - t_" } else { "t_" }),
        format!(
            "      acc_ += (double){} * (double){};",
            load(k.buf, DType::F32, "k0_ + i_ * d_ + x_"),
            load(v.buf, DType::F32, "v0_ + i_ * dv_ + e_")
        ),
        format!(
            "      {}",
            store(
                out.buf,
                DType::F32,
                "o0_ + i_ * dv_ + e_",
                &format!(
                    "{} + (float)((double){} * acc_)",
                    load(out.buf, DType::F32, "o0_ + i_ * dv_ + e_"),
                    load(q.buf, DType::F32, "q0_ + i_ * d_ + x_")
                )
            )
        ),
        "    }".into(),
        "  }".into(),
        "}".into(),
    ];
    Ok(rows(items, item))
}
