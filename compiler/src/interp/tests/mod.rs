//! Unit tests of the reference interpreter on small hand-built graphs with hand-computed results.
//! Node types come from `ir::infer`, so the graphs are well-typed.

mod binding;
mod ops;

use super::*;
pub(super) use crate::exec::{ExecError, MAX_ELEMENTS, bind_dims};
use crate::ir::{DType, Dim, Graph, Op, TensorType, Value, infer};
use crate::tensor::Tensor;
use std::collections::HashMap;

/// A type from dim texts (`"S"`, `"H*D"`, `"3"`).
fn ty(dtype: DType, shape: &[&str]) -> TensorType {
    TensorType::new(dtype, shape.iter().map(|s| Dim::parse(s).unwrap()).collect())
}

fn f32ty(shape: &[&str]) -> TensorType {
    ty(DType::F32, shape)
}

fn param(g: &mut Graph, name: &str, t: TensorType) -> Value {
    g.add(Op::Param(name.into()), t, &[])
}

/// Adds a node whose type `infer` derives from its operands.
fn node(g: &mut Graph, op: Op, args: &[Value]) -> Value {
    let tys: Vec<TensorType> = args.iter().map(|a| g.node(*a).ty.clone()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let t = infer(&op, &refs, None).unwrap();
    g.add(op, t, args)
}

/// Adds a node whose type is declared (const, iota, reshape, cast), checked by `infer`.
fn node_as(g: &mut Graph, op: Op, args: &[Value], declared: TensorType) -> Value {
    let tys: Vec<TensorType> = args.iter().map(|a| g.node(*a).ty.clone()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let t = infer(&op, &refs, Some(&declared)).unwrap();
    g.add(op, t, args)
}

/// A graph of one node, `op` over the parameters `params` in order, with output `out`.
fn one_op(params: &[(&str, TensorType)], op: Op) -> Graph {
    let mut g = Graph::new("one_op");
    let args: Vec<Value> = params.iter().map(|(name, t)| param(&mut g, name, t.clone())).collect();
    let out = node(&mut g, op, &args);
    g.add_output("out", out);
    g
}

/// A graph with one parameter `x: f32[shape]` whose output is the value of the dim `dim`.
fn dim_value(shape: &[&str], dim: Dim) -> Graph {
    let mut g = Graph::new("dim_value");
    param(&mut g, "x", f32ty(shape));
    let d = node(&mut g, Op::DimValue(dim), &[]);
    g.add_output("d", d);
    g
}

fn scalar(g: &mut Graph, v: f64, dtype: DType) -> Value {
    g.add(Op::Const(v), TensorType::scalar(dtype), &[])
}

fn dims(pairs: &[(&str, i64)]) -> HashMap<String, i64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

fn tf(shape: &[usize], data: &[f32]) -> Tensor {
    Tensor::f32(shape.to_vec(), data.to_vec()).unwrap()
}

fn ti(shape: &[usize], data: &[i32]) -> Tensor {
    Tensor::i32(shape.to_vec(), data.to_vec()).unwrap()
}

/// Runs a graph with one output and no given dims.
fn run1(g: &Graph, inputs: &[Tensor]) -> Tensor {
    let mut out = run(g, inputs, &HashMap::new()).unwrap();
    assert_eq!(out.len(), 1);
    out.remove(0)
}

#[track_caller]
fn assert_close(actual: &[f64], expected: &[f64], tol: f64) {
    assert_eq!(actual.len(), expected.len(), "{actual:?} vs {expected:?}");
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        let ok = (a - e).abs() <= tol * (1.0 + e.abs()) || (a == e);
        assert!(ok, "element {i}: {a} vs {e} (all: {actual:?})");
    }
}
