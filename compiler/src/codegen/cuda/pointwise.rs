//! Element-wise kernels: one thread per output element (grid-stride loop), computing the value's
//! whole inlined expression tree and storing it. Used for materialised element-wise and
//! movement values and for outputs that are parameters (a copy).

use super::cexpr::{cdim, is_one, store};
use super::expr::Gen;
use super::{Builder, Grid, Launch, Smem};
use crate::ir::{Dim, Value};

/// Emits the kernel that fills `buf` with `v` (`copy`: read `v` from its own buffer rather than
/// computing its op; for parameters that are also outputs).
pub(super) fn emit(b: &mut Builder, v: Value, buf: usize, copy: bool) {
    let node = b.g.node(v).clone();
    let name = b.kernel_name(v, if copy { "copy" } else { node.op.name() });
    let shape = &node.ty.shape;
    let total = Dim::product(shape);
    let mut body = Vec::new();
    body.push(format!("const i64 n_ = {};", cdim(&total)));
    body.push("for (i64 e_ = (i64)blockIdx.x * blockDim.x + threadIdx.x; e_ < n_; e_ += (i64)gridDim.x * blockDim.x) {".into());
    let idx = delinearize(&mut body, "e_", shape, "i");
    let mut sg = Gen::new(b.g, &b.bufs, "t");
    let value = if copy { sg.value(v, &idx) } else { sg.define(v, &idx) };
    body.extend(sg.lines.iter().map(|l| format!("  {l}")));
    body.push(format!("  {}", store(buf, node.ty.dtype, "e_", &value)));
    body.push("}".into());
    let text = format!(
        "// {} = {} : {}\nATTNC_KERNEL void __launch_bounds__(256) {name}(ATTNC_ARGS) {{\n{}\n}}\n",
        b.label(v),
        node.op.name(),
        node.ty,
        body.iter().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n")
    );
    b.kernels.push(text);
    b.launches.push(Launch { kernel: name, grid: Grid::Elements(total), block: 256, smem: Smem::None });
}

/// Splits linear index `lin` into one index per axis of `shape` (row-major), pushing the
/// statements into `body` (indented by two) and returning the index names `{prefix}{axis}`.
pub(super) fn delinearize(body: &mut Vec<String>, lin: &str, shape: &[Dim], prefix: &str) -> Vec<String> {
    let rank = shape.len();
    if rank == 0 {
        return Vec::new();
    }
    let rest = format!("{prefix}r_");
    body.push(format!("  i64 {rest} = {lin};"));
    let mut names = vec![String::new(); rank];
    for a in (1..rank).rev() {
        let n = format!("{prefix}{a}");
        if is_one(&shape[a]) {
            body.push(format!("  const i64 {n} = 0;"));
        } else {
            let size = cdim(&shape[a]);
            body.push(format!("  const i64 {n} = {rest} % {size}; {rest} /= {size};"));
        }
        names[a] = n;
    }
    let n0 = format!("{prefix}0");
    body.push(format!("  const i64 {n0} = {rest};"));
    names[0] = n0;
    names
}
