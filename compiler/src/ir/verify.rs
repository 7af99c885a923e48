//! The IR verifier: checks a graph's structure and re-derives every node's type from its
//! operands with [`infer`], so that a pass which records a wrong shape is caught right after it
//! runs. It reports every problem at once. Values are named `%N` as in the text form
//! ([`super::value_numbers`]), so messages can be read against the printed graph.

use super::graph::{Graph, Module};
use super::infer::infer;
use super::op::{Arity, Op};
use super::text::{ArityText, arity_accepts, print_order, value_numbers};
use super::types::TensorType;
use std::collections::HashSet;

/// One problem found by [`verify`]; each names its graph.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum VerifyError {
    /// The graph has a cycle (values are then numbered in insertion order).
    #[error("graph `{graph}` has a cycle")]
    Cycle {
        /// Graph name.
        graph: String,
    },
    /// A node has the wrong number of operands for its op.
    #[error("graph `{graph}`: %{value} = {op} takes {} operand(s), has {found}", ArityText(*.expected))]
    Arity {
        /// Graph name.
        graph: String,
        /// The node's `%N`.
        value: usize,
        /// The op's name.
        op: String,
        /// What the op takes.
        expected: Arity,
        /// What the node has.
        found: usize,
    },
    /// The shape rules reject the node's operands (or its recorded type, for ops that take it).
    #[error("graph `{graph}`: %{value} = {op}: {message}")]
    IllTyped {
        /// Graph name.
        graph: String,
        /// The node's `%N`.
        value: usize,
        /// The op's name.
        op: String,
        /// The shape rules' explanation.
        message: String,
    },
    /// The node's recorded type differs from the one its operands give.
    #[error("graph `{graph}`: %{value} = {op} is recorded as {recorded}, but its operands give {inferred}")]
    TypeMismatch {
        /// Graph name.
        graph: String,
        /// The node's `%N`.
        value: usize,
        /// The op's name.
        op: String,
        /// The node's type.
        recorded: TensorType,
        /// What [`infer`] computes.
        inferred: TensorType,
    },
    /// An entry of the parameter list is not a `param` node.
    #[error("graph `{graph}`: parameter {position} is %{value} = {op}, not a param")]
    NotAParam {
        /// Graph name.
        graph: String,
        /// Position in the parameter list.
        position: usize,
        /// The node's `%N`.
        value: usize,
        /// The op's name.
        op: String,
    },
    /// A `param` node that is missing from the parameter list (so no input can feed it).
    #[error("graph `{graph}`: %{value} = param `{name}` is not in the parameter list")]
    UnlistedParam {
        /// Graph name.
        graph: String,
        /// The node's `%N`.
        value: usize,
        /// The parameter's name.
        name: String,
    },
    /// Two parameters share a name.
    #[error("graph `{graph}`: two parameters are named `{name}`")]
    DuplicateParam {
        /// Graph name.
        graph: String,
        /// The repeated name.
        name: String,
    },
    /// An output refers to a node the graph does not have.
    #[error("graph `{graph}`: output `{name}` refers to node {index}, but the graph has {len} nodes")]
    DanglingOutput {
        /// Graph name.
        graph: String,
        /// Output name.
        name: String,
        /// The missing node's index.
        index: usize,
        /// Number of nodes.
        len: usize,
    },
    /// Two outputs share a name.
    #[error("graph `{graph}`: two outputs are named `{name}`")]
    DuplicateOutput {
        /// Graph name.
        graph: String,
        /// The repeated name.
        name: String,
    },
    /// Two graphs of a module share a name.
    #[error("two graphs are named `{name}`")]
    DuplicateGraph {
        /// The repeated name.
        name: String,
    },
}

/// Checks one graph: acyclic; operand counts; every node's type equals what [`infer`] gives for
/// its operands; parameter list and `param` nodes agree and have distinct names; outputs refer
/// to existing nodes and have distinct names. Returns every problem found.
pub fn verify(graph: &Graph) -> Result<(), Vec<VerifyError>> {
    let mut errors = Vec::new();
    let name = || graph.name.clone();
    if graph.topo_order().is_none() {
        errors.push(VerifyError::Cycle { graph: name() });
    }
    let numbers = value_numbers(graph);
    for v in print_order(graph) {
        let node = graph.node(v);
        let (value, op) = (numbers[v.index()], node.op.name().to_string());
        let args = graph.operands(v);
        if !arity_accepts(node.op.arity(), args.len()) {
            errors.push(VerifyError::Arity { graph: name(), value, op, expected: node.op.arity(), found: args.len() });
            continue;
        }
        let tys: Vec<&TensorType> = args.iter().map(|a| &graph.node(*a).ty).collect();
        match infer(&node.op, &tys, Some(&node.ty)) {
            Ok(inferred) if inferred == node.ty => {}
            Ok(inferred) => errors.push(VerifyError::TypeMismatch { graph: name(), value, op, recorded: node.ty.clone(), inferred }),
            Err(message) => errors.push(VerifyError::IllTyped { graph: name(), value, op, message }),
        }
        if let Op::Param(param) = &node.op
            && !graph.params().contains(&v)
        {
            errors.push(VerifyError::UnlistedParam { graph: name(), value, name: param.clone() });
        }
    }
    let mut param_names = HashSet::new();
    for (position, p) in graph.params().iter().enumerate() {
        match &graph.node(*p).op {
            Op::Param(param) => {
                if !param_names.insert(param) {
                    errors.push(VerifyError::DuplicateParam { graph: name(), name: param.clone() });
                }
            }
            other => {
                let (value, op) = (numbers[p.index()], other.name().to_string());
                errors.push(VerifyError::NotAParam { graph: name(), position, value, op });
            }
        }
    }
    let mut output_names = HashSet::new();
    for (output, v) in graph.outputs() {
        if v.index() >= graph.len() {
            errors.push(VerifyError::DanglingOutput { graph: name(), name: output.clone(), index: v.index(), len: graph.len() });
        }
        if !output_names.insert(output) {
            errors.push(VerifyError::DuplicateOutput { graph: name(), name: output.clone() });
        }
    }
    if errors.is_empty() { Ok(()) } else { Err(errors) }
}

/// Checks every graph of a module (see [`verify`]) and that graph names are distinct.
pub fn verify_module(module: &Module) -> Result<(), Vec<VerifyError>> {
    let mut errors = Vec::new();
    let mut names = HashSet::new();
    for g in &module.graphs {
        if !names.insert(&g.name) {
            errors.push(VerifyError::DuplicateGraph { name: g.name.clone() });
        }
        errors.extend(verify(g).err().unwrap_or_default());
    }
    if errors.is_empty() { Ok(()) } else { Err(errors) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::text::tests::{every_op, sdpa, ty};
    use crate::ir::{DType, Dim, Value};

    #[test]
    fn good_graphs_pass() {
        assert_eq!(verify(&sdpa()), Ok(()));
        assert_eq!(verify(&every_op()), Ok(()));
        let m = Module { graphs: vec![sdpa(), every_op()] };
        assert_eq!(verify_module(&m), Ok(()));
        // Reading the printed text back keeps it valid.
        assert_eq!(verify_module(&Module::parse(&m.to_string()).unwrap()), Ok(()));
    }

    #[test]
    fn reports_every_problem_together() {
        let mut g = sdpa();
        let nodes: Vec<Value> = g.values().collect();
        // %9 = matmul %8, %2 recorded with the wrong last axis (no user depends on it).
        g.node_mut(nodes[9]).ty = ty(DType::F32, &["B", "H", "S", "S"]);
        // %6 = rsqrt %5 turned into a binary op: wrong arity.
        g.node_mut(nodes[6]).op = Op::MatMul;
        g.add_output("out", nodes[4]);
        let errors = verify(&g).unwrap_err();
        assert_eq!(
            errors,
            vec![
                VerifyError::Arity { graph: "sdpa".into(), value: 6, op: "matmul".into(), expected: Arity::Exact(2), found: 1 },
                VerifyError::TypeMismatch {
                    graph: "sdpa".into(),
                    value: 9,
                    op: "matmul".into(),
                    recorded: ty(DType::F32, &["B", "H", "S", "S"]),
                    inferred: ty(DType::F32, &["B", "H", "S", "D"]),
                },
                VerifyError::DuplicateOutput { graph: "sdpa".into(), name: "out".into() },
            ]
        );
        assert_eq!(errors[0].to_string(), "graph `sdpa`: %6 = matmul takes 2 operand(s), has 1");
        assert_eq!(
            errors[1].to_string(),
            "graph `sdpa`: %9 = matmul is recorded as f32[B, H, S, S], but its operands give f32[B, H, S, D]"
        );
    }

    #[test]
    fn structural_problems() {
        let mut g = Graph::new("g");
        let t = ty(DType::F32, &["N"]);
        let x = g.add(Op::Param("x".into()), t.clone(), &[]);
        let y = g.add(Op::Param("x".into()), t.clone(), &[]);
        let bad = g.add(Op::Binary(crate::ir::BinaryOp::And), t.clone(), &[x, y]);
        g.node_mut(y).op = Op::Const(1.0);
        let z = g.add(Op::Const(0.0), t.clone(), &[]);
        g.node_mut(z).op = Op::Param("x".into());
        // A node that uses itself.
        let looped = g.add(Op::Unary(crate::ir::UnaryOp::Neg), t, &[Value::new(g.len())]);
        g.add_output("o", Value::new(99));
        let errors = verify(&g).unwrap_err();
        let has = |f: &dyn Fn(&VerifyError) -> bool| errors.iter().any(f);
        assert!(has(&|e| matches!(e, VerifyError::Cycle { .. })), "{errors:?}");
        assert!(has(&|e| matches!(e, VerifyError::IllTyped { value: 2, message, .. } if message.contains("bool"))), "{errors:?}");
        assert!(has(&|e| matches!(e, VerifyError::IllTyped { op, .. } if op == "const")), "{errors:?}");
        assert!(has(&|e| matches!(e, VerifyError::NotAParam { position: 1, value: 1, .. })), "{errors:?}");
        assert!(has(&|e| matches!(e, VerifyError::UnlistedParam { value: 3, .. })), "{errors:?}");
        assert!(has(&|e| matches!(e, VerifyError::DanglingOutput { index: 99, len: 5, .. })), "{errors:?}");
        assert_eq!(looped.index(), 4);
        assert_eq!(bad.index(), 2);

        let mut dup = Graph::new("g");
        let a = dup.add(Op::Param("a".into()), ty(DType::I32, &[]), &[]);
        dup.add(Op::Param("a".into()), ty(DType::I32, &[]), &[]);
        dup.add(Op::DimValue(Dim::sym("N")), ty(DType::I32, &[]), &[]);
        dup.add_output("a", a);
        let errors = verify_module(&Module { graphs: vec![dup.clone(), dup] }).unwrap_err();
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert_eq!(errors[1], VerifyError::DuplicateGraph { name: "g".into() });
        assert_eq!(errors[0].to_string(), "graph `g`: two parameters are named `a`");
    }
}
