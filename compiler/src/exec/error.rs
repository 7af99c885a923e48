//! Why a graph could not run on some inputs, on any target.

use crate::ir::{DType, DimError};
use thiserror::Error;

/// An error from [`super::bind_dims`], [`super::check_inputs`], the interpreter's
/// [`crate::interp::run`] or a backend's run. Input problems (count, dtype, rank, sizes, dimension
/// bindings) name the parameter and axis; problems found while evaluating a node name the node as
/// `%INDEX (op)`; an index or slice out of range and a negative size also have the source span of
/// the expression that made the node, when known ([`ExecError::span`]).
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ExecError {
    /// Wrong number of inputs.
    #[error("the graph takes {expected} input(s), but {actual} were given{}", missing_list(missing))]
    InputCount {
        /// Number of parameters.
        expected: usize,
        /// Number of inputs given.
        actual: usize,
        /// The parameters without an input (inputs go to parameters in order), empty when there
        /// are too many inputs.
        missing: Vec<String>,
    },
    /// An input whose dtype differs from its parameter's.
    #[error("input `{param}` must be {expected}, but a {actual} tensor was given")]
    InputDType {
        /// Parameter name.
        param: String,
        /// The parameter's dtype.
        expected: DType,
        /// The input's dtype.
        actual: DType,
    },
    /// An input with the wrong number of axes.
    #[error("input `{param}` has {actual} axes, but its type {declared} has {expected}")]
    InputRank {
        /// Parameter name.
        param: String,
        /// The parameter's rank.
        expected: usize,
        /// The input's rank.
        actual: usize,
        /// The parameter's type, e.g. `f32[B, S, D]`.
        declared: String,
    },
    /// An input tensor whose storage does not hold as many elements as its shape says.
    #[error("input `{param}` has shape {shape:?} ({expected} elements) but stores {actual} elements")]
    InputData {
        /// Parameter name.
        param: String,
        /// The input's shape.
        shape: Vec<usize>,
        /// Elements the shape needs (saturated at `usize::MAX`).
        expected: usize,
        /// Elements stored.
        actual: usize,
    },
    /// An input axis whose type is a fixed size that the input does not have.
    #[error("input `{param}` axis {axis} must have size {expected} (its type is {declared}), but has {actual}")]
    FixedDim {
        /// Parameter name.
        param: String,
        /// The axis.
        axis: usize,
        /// The size fixed by the type.
        expected: i64,
        /// The input's size.
        actual: usize,
        /// The parameter's type.
        declared: String,
    },
    /// An input axis whose symbolic size already has another value.
    #[error("`{param}` axis {axis} has size {actual}, but {dim} = {expected} ({bound_from})")]
    DimMismatch {
        /// Parameter name.
        param: String,
        /// The axis.
        axis: usize,
        /// The axis' symbolic size, e.g. `S` or `D*H`.
        dim: String,
        /// What the dim evaluates to under the bindings made so far.
        expected: i64,
        /// The input's size.
        actual: usize,
        /// Where those bindings came from, e.g. "bound by `q` axis 2".
        bound_from: String,
    },
    /// An input axis whose size expression cannot be solved for its unknown dims.
    #[error("cannot bind the dims of `{param}` axis {axis} ({dim}): {reason}")]
    Unsolvable {
        /// Parameter name.
        param: String,
        /// The axis.
        axis: usize,
        /// The axis' symbolic size.
        dim: String,
        /// Why not, with a hint.
        reason: String,
    },
    /// A dim the graph uses that neither the inputs nor the given dims determine.
    #[error("dimension `{name}` is not determined by the input shapes; pass --dim {name}=N")]
    UnboundDim {
        /// The dim's name.
        name: String,
    },
    /// A given dim value that is negative or does not fit an i32.
    #[error("--dim {name}={value}: a dimension must be between 0 and {}", i32::MAX)]
    GivenDim {
        /// The dim's name.
        name: String,
        /// The value given.
        value: i64,
    },
    /// A symbolic size that evaluates to a negative number (e.g. `S-4` with `S = 2`).
    #[error("{node}: size {dim} evaluates to {value}, which is negative")]
    NegativeDim {
        /// The node whose type mentions it.
        node: String,
        /// Where the node is written in the source, when known.
        span: Option<attn_dsl::Span>,
        /// The dim.
        dim: String,
        /// Its value.
        value: i64,
    },
    /// Slice bounds outside the sliced axis.
    #[error("{node}: slice {start}:{end} is out of range for axis {axis} of size {size}")]
    OutOfRange {
        /// The slice node.
        node: String,
        /// Where the slice is written in the source, when known.
        span: Option<attn_dsl::Span>,
        /// The sliced axis.
        axis: usize,
        /// First index kept.
        start: i64,
        /// One past the last index kept.
        end: i64,
        /// The axis' size.
        size: usize,
    },
    /// An index outside its axis, in a gather (`table[idx]`, `take_along`, …) or a
    /// `scatter_add`: never clamped, never read out of bounds.
    #[error("{node}: index {index} is out of range for axis {axis} of size {size}")]
    IndexOutOfRange {
        /// The indexing node (`%N (gather)`).
        node: String,
        /// Where the indexing is written in the source, when known.
        span: Option<attn_dsl::Span>,
        /// The indexed axis of the table (gather) or the result (scatter_add).
        axis: usize,
        /// The index given.
        index: i64,
        /// The axis' size.
        size: usize,
    },
    /// Integer overflow while evaluating a symbolic dim.
    #[error("integer overflow evaluating {what}")]
    Overflow {
        /// What was being evaluated.
        what: String,
    },
    /// A tensor with more elements than any target allows (see [`super::MAX_ELEMENTS`]).
    #[error("{what}: shape {shape:?} has more than {limit} elements")]
    TooLarge {
        /// What the tensor is.
        what: String,
        /// Its shape.
        shape: Vec<usize>,
        /// The limit.
        limit: usize,
    },
    /// The machine refused memory for a tensor (a memory limit, or a size it cannot hold).
    #[error("{what}: cannot allocate {bytes} bytes for its elements")]
    OutOfMemory {
        /// What the tensor is.
        what: String,
        /// The allocation that failed.
        bytes: usize,
    },
    /// A node that breaks its op's rules (wrong operand count, bad axis, shapes that do not fit).
    /// A verified graph never has one.
    #[error("{node}: {reason}")]
    BadNode {
        /// The node.
        node: String,
        /// What is wrong.
        reason: String,
    },
    /// A node whose computed shape differs from its type's shape under the dim bindings.
    /// A verified graph never has one.
    #[error("{node}: computed shape {actual:?}, but its type says {expected:?}")]
    ShapeMismatch {
        /// The node.
        node: String,
        /// The type's shape, evaluated.
        expected: Vec<usize>,
        /// The computed shape.
        actual: Vec<usize>,
    },
    /// A broken invariant of the interpreter itself.
    #[error("internal interpreter error: {0}")]
    Internal(String),
}

fn missing_list(names: &[String]) -> String {
    if names.is_empty() {
        return String::new();
    }
    let quoted: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    format!("; missing: {}", quoted.join(", "))
}

impl ExecError {
    /// Wrong number of inputs for `graph`'s parameters, naming those left without one.
    pub fn input_count(graph: &crate::ir::Graph, actual: usize) -> ExecError {
        let params = graph.param_types();
        let missing = params.iter().skip(actual).map(|(name, _)| name.clone()).collect();
        ExecError::InputCount { expected: params.len(), actual, missing }
    }

    /// Where in the source a fault found while running lies (an index or slice out of range, a
    /// negative size), when known.
    pub fn span(&self) -> Option<attn_dsl::Span> {
        match self {
            ExecError::NegativeDim { span, .. } | ExecError::OutOfRange { span, .. } | ExecError::IndexOutOfRange { span, .. } => *span,
            _ => None,
        }
    }

    /// The error with `at` as its source span, if it is a fault that has one and does not know
    /// it yet (the interpreter's op functions know the node's label, not its span).
    pub fn or_span(mut self, at: Option<attn_dsl::Span>) -> ExecError {
        if let ExecError::NegativeDim { span, .. } | ExecError::OutOfRange { span, .. } | ExecError::IndexOutOfRange { span, .. } =
            &mut self
            && span.is_none()
        {
            *span = at;
        }
        self
    }

    /// The parameter an input error is about (drivers point at its declaration).
    pub fn param(&self) -> Option<&str> {
        match self {
            ExecError::InputDType { param, .. }
            | ExecError::InputRank { param, .. }
            | ExecError::InputData { param, .. }
            | ExecError::FixedDim { param, .. }
            | ExecError::DimMismatch { param, .. }
            | ExecError::Unsolvable { param, .. } => Some(param),
            _ => None,
        }
    }
}

impl From<DimError> for ExecError {
    fn from(e: DimError) -> Self {
        match e {
            DimError::Unbound(name) => ExecError::UnboundDim { name },
            DimError::Overflow(what) => ExecError::Overflow { what: format!("dimension {what}") },
        }
    }
}
