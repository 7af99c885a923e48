//! The graph IR: ops, types, symbolic dims, the graph, shape rules and the verifier.
//!
//! This module knows no backend and no surface syntax.

mod dim;
mod dot;
mod flash;
pub mod grad;
mod graph;
mod infer;
mod op;
pub mod semantics;
mod text;
mod tiles;
mod types;
mod verify;

pub use dim::{Dim, DimError, Monomial};
pub use dot::to_dot;
pub use flash::{FlashSpec, Pair, ScoreExpr, ShowExpr, Weights, int_literal, parse_expr, position_names};
pub use graph::{Graph, Module, Node, Value};
pub use infer::infer;
pub use op::{Arity, Attr, BinaryOp, FlashWrt, Op, ReduceOp, ScanOp, UnaryOp};
pub use text::{ParseIrError, print_order, value_numbers};
pub use tiles::{TileClass, TileGrid, classify_tile, grid_size, tile_census, tile_grid};
pub use types::{DType, TensorType, broadcast_shapes};
pub use verify::{VerifyError, verify, verify_module};
