//! The graph IR: ops, types, symbolic dims, the graph, shape rules and the verifier.
//!
//! This module knows no backend and no surface syntax.

mod dim;
mod graph;
mod infer;
mod op;
mod types;

pub use dim::{Dim, Monomial};
pub use graph::{Graph, Module, Node, Value};
pub use infer::infer;
pub use op::{Arity, Attr, BinaryOp, Op, ReduceOp, UnaryOp};
pub use types::{DType, TensorType, broadcast_shapes};
