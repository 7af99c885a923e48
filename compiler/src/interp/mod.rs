//! The reference interpreter: the numerical oracle that defines what every IR program computes
//! and that every backend is checked against. It favours obvious correctness over speed.
//!
//! Semantics:
//! - Tensors are row-major; element-wise ops broadcast numpy-style.
//! - Every scalar op (element-wise nodes, and a flash op's score modification and mask) is
//!   [`crate::ir::semantics`]' definition: elements compute as f32, i32 or truth values, and
//!   each node's result is stored in the node's dtype (f32, f16 or bf16 rounding; i32; 0/1).
//! - Sums, means, norms, softmax denominators and matmul accumulate in f64 on the stored values.
//! - Softmax is `exp(x - max) / sum` with the NaN-propagating max; a row whose max is `-inf`
//!   gives all zeros.
//! - Reductions over an empty axis: sum 0, mean 0 (not NaN), max `-inf`, min `inf`. Max and
//!   min (reductions and the binary ops) propagate NaN.
//! - Gather clamps each index into its axis; slicing outside an axis is an error.
//!
//! Dims: [`crate::exec::bind_dims`] binds every symbolic dim from the input shapes and given
//! values; [`run`] then evaluates the nodes the outputs need in topological order, freeing
//! values after their last use. No tensor may exceed [`crate::exec::MAX_ELEMENTS`] elements.
//! Errors are [`crate::exec::ExecError`]s, the ones every backend reports too.
//!
//! Files: `eval` (driver and op dispatch), `elementwise`,
//! `shape_ops`, `reduce` (reductions, softmax, norms, matmul), `value` (index arithmetic).

mod data_tiles;
mod elementwise;
mod eval;
mod flash_eval;
mod reduce;
mod shape_ops;
mod value;

#[cfg(test)]
mod tests;

pub use data_tiles::{MAX_MASK_EVALS, data_tile_grids};
pub use eval::run;
