//! The graph IR: ops, types, symbolic dims, the graph, shape rules and the verifier.
//!
//! This module knows no backend and no surface syntax.

mod dim;
mod dot;
mod flash_spec;
pub mod grad;
mod graph;
mod infer;
mod op;
pub mod paged;
pub mod semantics;
mod text;
mod tile_class;
mod tile_map;
mod types;
mod verify;

pub use dim::{Dim, DimError, Monomial};
pub use dot::to_dot;
pub use flash_spec::{Dropout, FlashSpec, Pair, ScoreExpr, ShowExpr, Weights, int_literal, parse_expr, position_names};
pub use graph::{Graph, Module, Node, Value};
pub use infer::infer;
pub use op::{Arity, Attr, BinaryOp, FlashWrt, Op, ReduceOp, ScanOp, UnaryOp};
pub use text::{ParseIrError, print_order, value_numbers};
pub use tile_class::{
    Known, PER_BATCH, RangeTable, TileClass, TileGrid, classify_tile, classify_tile_in, classify_tile_known, data_param_key, grid_size,
    reads_position, scalar_load_key, scalar_param_key, tile_census, tile_grid,
};
pub use tile_map::{FlashTileMap, MAP_TILE, MAX_MAP_TILES, MAX_TEXT_SIDE, TileMapError, block_summary, flash_tile_maps, representative};
pub use types::{DType, TensorType, broadcast_shapes};
pub use verify::{VerifyError, verify, verify_module};
