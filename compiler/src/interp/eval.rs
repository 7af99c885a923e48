//! The driver: checks the inputs, binds dims, evaluates the live nodes in topological order
//! (freeing each value after its last use) and returns the outputs.

use super::value::Val;
use super::{elementwise as ew, reduce, shape_ops};
use crate::exec::ExecError;
use crate::exec::{bind_dims, check_inputs, eval_dim, eval_shape, node_label};
use crate::ir::semantics::{Scalar, wrap_i32};
use crate::ir::{Arity, Graph, Node, Op, Value};
use crate::tensor::Tensor;
use std::collections::HashMap;

/// Runs `graph` on `inputs` (one per parameter, in order), with dims not determined by the input
/// shapes taken from `given`. Returns the outputs in `graph.outputs()` order. Only nodes the
/// outputs depend on are evaluated.
pub fn run(graph: &Graph, inputs: &[Tensor], given: &HashMap<String, i64>) -> Result<Vec<Tensor>, ExecError> {
    check_inputs(graph, inputs)?;
    let shapes: Vec<Vec<usize>> = inputs.iter().map(|t| t.shape.clone()).collect();
    let env = bind_dims(graph, &shapes, given)?;
    let order = graph.topo_order().ok_or_else(|| ExecError::Internal("the graph has a cycle".into()))?;

    let n = graph.len();
    let mut live = vec![false; n];
    let mut stack: Vec<Value> = graph.outputs().iter().map(|(_, v)| *v).collect();
    while let Some(v) = stack.pop() {
        if !std::mem::replace(&mut live[v.index()], true) {
            stack.extend(graph.operands(v));
        }
    }
    // Position (in `order`) of each value's last live user; outputs are kept to the end.
    let mut last_use = vec![0usize; n];
    for (pos, v) in order.iter().enumerate() {
        if live[v.index()] {
            for o in graph.operands(*v) {
                last_use[o.index()] = pos;
            }
        }
    }
    let mut is_output = vec![false; n];
    for (_, v) in graph.outputs() {
        is_output[v.index()] = true;
    }
    let param_index: HashMap<Value, usize> = graph.params().iter().enumerate().map(|(i, p)| (*p, i)).collect();

    let mut vals: Vec<Option<Val>> = vec![None; n];
    for (pos, v) in order.iter().enumerate() {
        if !live[v.index()] {
            continue;
        }
        let node = graph.node(*v);
        let label = node_label(graph, *v);
        let operands = graph.operands(*v);
        let shape = eval_shape(&node.ty.shape, &env, &label).map_err(|e| e.or_span(node.span))?;
        let val = if let Some(i) = param_index.get(v) {
            let t = &inputs[*i];
            Val::new(node.ty.dtype, t.shape.clone(), t.to_f64_vec())
        } else {
            let args = operands
                .iter()
                .map(|o| vals[o.index()].as_ref().ok_or_else(|| ExecError::Internal(format!("{label}: operand %{} is missing", o.index()))))
                .collect::<Result<Vec<&Val>, ExecError>>()?;
            eval_node(node, &args, shape.clone(), &env, &label).map_err(|e| e.or_span(node.span))?
        };
        if val.shape != shape {
            return Err(ExecError::ShapeMismatch { node: label, expected: shape, actual: val.shape });
        }
        for o in operands {
            if last_use[o.index()] == pos && !is_output[o.index()] {
                vals[o.index()] = None;
            }
        }
        vals[v.index()] = Some(val);
    }

    graph
        .outputs()
        .iter()
        .map(|(name, v)| {
            let val = vals[v.index()].as_ref().ok_or_else(|| ExecError::Internal(format!("output `{name}` was not computed")))?;
            Tensor::from_f64(val.dtype, val.shape.clone(), &val.data).map_err(|e| ExecError::Internal(format!("output `{name}`: {e}")))
        })
        .collect()
}

/// Computes one non-parameter node from its operands' values. `shape` is the node type's shape
/// under the dim bindings (used by the ops whose result shape only the type gives).
fn eval_node(node: &Node, args: &[&Val], shape: Vec<usize>, env: &HashMap<String, i64>, label: &str) -> Result<Val, ExecError> {
    let arity_ok = match node.op.arity() {
        Arity::Exact(k) => args.len() == k,
        Arity::AtLeast(k) => args.len() >= k,
    };
    if !arity_ok {
        return Err(ExecError::BadNode {
            node: label.to_string(),
            reason: format!("{:?} operands but got {}", node.op.arity(), args.len()),
        });
    }
    let dtype = node.ty.dtype;
    match &node.op {
        Op::Param(_) => Err(ExecError::Internal(format!("{label}: a parameter outside the parameter list"))),
        Op::Const(c) => ew::fill(dtype, shape, *c, label),
        Op::DimValue(d) => ew::fill(dtype, shape, Scalar::I(wrap_i32(eval_dim(d, env)?)).store(dtype), label),
        Op::Iota { axis } => ew::iota(dtype, shape, *axis, label),
        Op::Unary(u) => Ok(ew::unary(*u, args[0], dtype)),
        Op::Binary(b) => ew::binary(*b, args[0], args[1], dtype, label),
        Op::Select => ew::select(args[0], args[1], args[2], dtype, label),
        Op::Cast => Ok(ew::cast(args[0], dtype)),
        Op::MatMul => reduce::matmul(args[0], args[1], dtype, label),
        Op::Transpose { perm } => shape_ops::transpose(args[0], perm, dtype, label),
        Op::Reshape => shape_ops::reshape(args[0], shape, dtype, label),
        Op::Slice { axis, start, end } => shape_ops::slice(args[0], *axis, eval_dim(start, env)?, eval_dim(end, env)?, dtype, label),
        Op::Concat { axis } => shape_ops::concat(args, *axis, dtype, label),
        Op::Gather => shape_ops::gather(args[0], &args[1..], dtype, label),
        Op::Paged => shape_ops::paged(args[0], args[1], dtype, label),
        Op::Dropout { rate } => ew::dropout(args[0], args[1], *rate, dtype, label),
        Op::Reduce { op, axes, keepdim } => reduce::reduce(args[0], *op, axes, *keepdim, dtype, label),
        Op::Softmax { axis } => reduce::softmax(args[0], *axis, dtype, label),
        Op::Scan { op, axis, reverse } => reduce::scan(*op, args, *axis, *reverse, dtype, label),
        Op::ScatterAdd { axis } => reduce::scatter_add(args[0], args[1], args[2], *axis, dtype, label),
        Op::ArgSort { axis, descending } => reduce::argsort(args[0], *axis, *descending, label),
        Op::PrefixAttention { reverse } => reduce::prefix_attention(args[0], args[1], args[2], *reverse, dtype, label),
        Op::LayerNorm { eps } => reduce::layer_norm(args[0], args[1], args[2], *eps, dtype, label),
        Op::RmsNorm { eps } => reduce::rms_norm(args[0], args[1], *eps, dtype, label),
        Op::Flash(spec) => super::flash_eval::flash(spec, args, dtype, env, label),
        Op::FlashLse(spec) => super::flash_eval::flash_lse(spec, args, env, label),
        Op::FlashGrad { spec, wrt, lse_grad } => super::flash_eval::flash_grad(spec, (*wrt, *lse_grad), args, dtype, shape, env, label),
    }
}
