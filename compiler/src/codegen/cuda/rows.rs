//! Row kernels: reductions, softmax, layer norm and RMS norm. One warp per row (8 rows per
//! block, grid-stride over rows); the lanes stride over the row's elements, which are read
//! through the inlined producer expression (so `softmax(scale * s + bias)` reads `s` only),
//! and combine with warp shuffles. Sums and statistics accumulate in double, as the
//! interpreter does in f64.

use super::cexpr::{cdim, double_lit, from_double, is_one, store, to_double, to_float};
use super::expr::Gen;
use super::pointwise::delinearize;
use super::{Builder, Grid, Launch, Smem};
use crate::ir::{DType, Dim, Op, ReduceOp, Value};

/// Emits the kernel of a reduce, softmax, layernorm or rmsnorm node.
pub(super) fn emit(b: &mut Builder, v: Value, buf: usize) {
    let node = b.g.node(v).clone();
    let ops = b.g.operands(v);
    let x = ops[0];
    let in_shape = b.g.node(x).ty.shape.clone();
    let in_dt = b.g.node(x).ty.dtype;
    let rank = in_shape.len();
    // Which input axes form a row, and which index the rows.
    let inner_axes: Vec<usize> = match &node.op {
        Op::Reduce { axes, .. } => axes.clone(),
        Op::Softmax { axis } => vec![*axis],
        _ => vec![rank.saturating_sub(1)],
    };
    let outer_axes: Vec<usize> = (0..rank).filter(|a| !inner_axes.contains(a)).collect();
    let outer_shape: Vec<Dim> = outer_axes.iter().map(|a| in_shape[*a].clone()).collect();
    let inner_shape: Vec<Dim> = inner_axes.iter().map(|a| in_shape[*a].clone()).collect();
    let rows = Dim::product(&outer_shape);
    let count = Dim::product(&inner_shape);
    let out_dt = node.ty.dtype;

    let mut body = vec![
        "const int lane_ = threadIdx.x & 31;".to_string(),
        format!("const i64 rows_ = {};", cdim(&rows)),
        format!("const i64 n_ = {};", cdim(&count)),
        "for (i64 row_ = (i64)blockIdx.x * 8 + (threadIdx.x >> 5); row_ < rows_; row_ += (i64)gridDim.x * 8) {".to_string(),
    ];
    let outer_idx = delinearize(&mut body, "row_", &outer_shape, "o");
    // The full input index for element `e_` of the row.
    let full_index = |body: &mut Vec<String>, indent: &str| -> Vec<String> {
        let mut inner = Vec::new();
        let mut lines = Vec::new();
        if inner_shape.len() == 1 {
            inner.push("e_".to_string());
        } else {
            inner = delinearize(&mut lines, "e_", &inner_shape, "r");
        }
        body.extend(lines.into_iter().map(|l| format!("{indent}{l}")));
        let mut idx = vec!["0LL".to_string(); rank];
        for (k, a) in outer_axes.iter().enumerate() {
            idx[*a] = if is_one(&in_shape[*a]) { "0LL".into() } else { outer_idx[k].clone() };
        }
        for (k, a) in inner_axes.iter().enumerate() {
            idx[*a] = inner[k].clone();
        }
        idx
    };
    // One pass over the row: `each(x)` is the statement run for every element value.
    let pass = |body: &mut Vec<String>, prefix: &str, extra: &[Value], each: &dyn Fn(&str, &[String]) -> String| {
        body.push("  for (i64 e_ = lane_; e_ < n_; e_ += 32) {".to_string());
        let idx = full_index(body, "  ");
        let mut sg = Gen::new(b.g, &b.bufs, prefix);
        let xv = sg.value(x, &idx);
        let mut extras = Vec::new();
        for w in extra {
            extras.push(sg.value(*w, &["e_".to_string()]));
        }
        body.extend(sg.lines.iter().map(|l| format!("    {l}")));
        body.push(format!("    {}", each(&xv, &extras)));
        body.push("  }".to_string());
    };

    match &node.op {
        Op::Reduce { op, .. } => {
            let (init, combine, fin) = match op {
                ReduceOp::Sum | ReduceOp::Mean => ("0.0", "acc_ += {x};", "attnc_warp_sum_d(acc_)"),
                ReduceOp::Max => ("(-ATTNC_DINF)", "acc_ = attnc_dmax(acc_, {x});", "attnc_warp_max_d(acc_)"),
                ReduceOp::Min => ("ATTNC_DINF", "acc_ = attnc_dmin(acc_, {x});", "attnc_warp_min_d(acc_)"),
            };
            body.push(format!("  double acc_ = {init};"));
            pass(&mut body, "a", &[], &|xv, _| combine.replace("{x}", &to_double(xv, in_dt)));
            body.push(format!("  acc_ = {fin};"));
            if *op == ReduceOp::Mean {
                body.push("  acc_ = n_ == 0 ? 0.0 : acc_ / (double)n_;".to_string());
            }
            body.push(format!("  if (lane_ == 0) {{ {} }}", store(buf, out_dt, "row_", &from_double("acc_", out_dt))));
        }
        Op::Softmax { .. } => {
            body.push("  float mx_ = -ATTNC_INF;".to_string());
            pass(&mut body, "a", &[], &|xv, _| format!("mx_ = attnc_fmax(mx_, {});", to_float(xv, in_dt)));
            body.push("  mx_ = attnc_warp_max_n(mx_);".to_string());
            body.push("  float sum_ = 0.0f;".to_string());
            body.push("  if (mx_ != -ATTNC_INF) {".to_string());
            pass(&mut body, "b", &[], &|xv, _| format!("sum_ += expf({} - mx_);", to_float(xv, in_dt)));
            body.push("  }".to_string());
            body.push("  sum_ = attnc_warp_sum(sum_);".to_string());
            let out = out_index(&mut body, &outer_axes, &inner_axes, &in_shape);
            let write = |xv: &str, _: &[String]| {
                let y = format!("(mx_ == -ATTNC_INF ? 0.0f : expf({} - mx_) / sum_)", to_float(xv, in_dt));
                store(buf, out_dt, &out, &from_float(&y, out_dt))
            };
            pass(&mut body, "c", &[], &write);
        }
        Op::LayerNorm { eps } | Op::RmsNorm { eps } => {
            let layer = matches!(node.op, Op::LayerNorm { .. });
            body.push("  double s_ = 0.0;".to_string());
            if layer {
                pass(&mut body, "a", &[], &|xv, _| format!("s_ += {};", to_double(xv, in_dt)));
                body.push("  const double mean_ = attnc_warp_sum_d(s_) / (double)n_;".to_string());
                body.push("  double q_ = 0.0;".to_string());
                pass(&mut body, "b", &[], &|xv, _| format!("{{ const double d_ = {} - mean_; q_ += d_ * d_; }}", to_double(xv, in_dt)));
                body.push(format!("  const double den_ = sqrt(attnc_warp_sum_d(q_) / (double)n_ + {});", double_lit(*eps)));
            } else {
                pass(&mut body, "a", &[], &|xv, _| format!("{{ const double d_ = {}; s_ += d_ * d_; }}", to_double(xv, in_dt)));
                body.push(format!("  const double den_ = sqrt(attnc_warp_sum_d(s_) / (double)n_ + {});", double_lit(*eps)));
            }
            let params: Vec<Value> = ops[1..].to_vec();
            let pdt: Vec<DType> = params.iter().map(|p| b.g.node(*p).ty.dtype).collect();
            let write = |xv: &str, ps: &[String]| {
                let xd = to_double(xv, in_dt);
                let y = if layer {
                    format!("({xd} - mean_) / den_ * {} + {}", to_double(&ps[0], pdt[0]), to_double(&ps[1], pdt[1]))
                } else {
                    format!("{xd} / den_ * {}", to_double(&ps[0], pdt[0]))
                };
                store(buf, out_dt, "row_ * n_ + e_", &from_double(&y, out_dt))
            };
            pass(&mut body, "c", &params, &write);
        }
        _ => {}
    }
    body.push("}".to_string());
    let name = b.kernel_name(v, node.op.name());
    let text = format!(
        "// {} = {} : {} (one warp per row)\nATTNC_KERNEL void __launch_bounds__(256) {name}(ATTNC_ARGS) {{\n{}\n}}\n",
        b.label(v),
        node.op.name(),
        node.ty,
        body.iter().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n")
    );
    b.kernels.push(text);
    b.launches.push(Launch { kernel: name, grid: Grid::Rows(rows), block: 256, smem: Smem::None });
}

/// The output offset of element `e_` of a softmax row: the input's row-major position (the
/// output has the input's shape). Emits `out_` and returns its name.
fn out_index(body: &mut Vec<String>, outer: &[usize], inner: &[usize], shape: &[Dim]) -> String {
    // offset = Σ idx[a] * stride[a] with idx[outer] from the row and idx[axis] = e_.
    let strides = super::cexpr::row_major(shape);
    let mut terms = Vec::new();
    for (k, a) in outer.iter().enumerate() {
        if !is_one(&shape[*a]) {
            terms.push(format!("o{k} * {}", cdim(&strides[*a])));
        }
    }
    let base = if terms.is_empty() { "0LL".to_string() } else { terms.join(" + ") };
    body.push(format!("  const i64 base_ = {base};"));
    let axis = inner.first().copied().unwrap_or(0);
    format!("base_ + e_ * {}", cdim(&strides[axis]))
}

/// Rounds a float expression to a float dtype's storage precision.
fn from_float(x: &str, to: DType) -> String {
    super::cexpr::round_to(to, x)
}
