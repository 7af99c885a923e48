//! What every target shares to execute a graph, below the interpreter and the backends: binding
//! the dims from the input shapes ([`bind_dims`]), checking the inputs against the parameters
//! ([`check_inputs`]), the element limit ([`MAX_ELEMENTS`]), and [`ExecError`], the one error
//! type every target reports for inputs that do not fit and for faults found while running (an
//! index out of range). The interpreter, the schedule's `prepare` and both backends use it; it
//! uses only the IR.

mod bind;
mod error;

pub use bind::bind_dims;
pub(crate) use bind::{eval_dim, eval_shape, node_label};
pub use error::ExecError;

use crate::ir::{Graph, Node, Op};
use crate::tensor::{Tensor, TensorData};

/// The most elements any one tensor may have, on every target. Guards against absurd sizes (a
/// typo in `--dim`, a broadcast of two long vectors) turning into an out-of-memory abort.
pub const MAX_ELEMENTS: usize = 1 << 31;

/// Element count of `shape`, or `TooLarge` above [`MAX_ELEMENTS`] (`what` says which tensor).
pub fn element_count(shape: &[usize], what: &str) -> Result<usize, ExecError> {
    let too_large = || ExecError::TooLarge { what: what.to_string(), shape: shape.to_vec(), limit: MAX_ELEMENTS };
    if shape.contains(&0) {
        return Ok(0);
    }
    let n = shape.iter().try_fold(1usize, |acc, d| acc.checked_mul(*d)).ok_or_else(too_large)?;
    if n > MAX_ELEMENTS { Err(too_large()) } else { Ok(n) }
}

/// Adds to a run's `env` the value of each 0-d i32 input (in parameter order) under
/// [`crate::ir::scalar_param_key`], so that a mask reading it (a window size) classifies its
/// tiles by it when the run is prepared ([`crate::schedule::prepare()`]).
pub fn add_scalar_inputs(inputs: &[Tensor], env: &mut std::collections::HashMap<String, i64>) {
    for (i, t) in inputs.iter().enumerate() {
        if let (true, crate::tensor::TensorData::I32(v)) = (t.shape.is_empty(), &t.data)
            && let [x] = v.as_slice()
        {
            env.insert(crate::ir::scalar_param_key(i), i64::from(*x));
        }
    }
}

/// The values of the inputs whose values classify flash tiles (`mask_params`, from
/// [`crate::schedule::mask_data_params`]: i32 ids and lengths, bool masks), for
/// [`crate::schedule::prepare_with`], each also named in `env` by its table's content key
/// ([`crate::ir::data_param_key`]) so that a reused plan is one of the same values.
pub fn mask_data_inputs(
    mask_params: &[usize],
    inputs: &[Tensor],
    env: &mut std::collections::HashMap<String, i64>,
) -> std::collections::HashMap<usize, std::sync::Arc<crate::ir::RangeTable>> {
    let mut out = std::collections::HashMap::new();
    for &i in mask_params {
        let table = match inputs.get(i).map(|t| (&t.data, &t.shape)) {
            Some((crate::tensor::TensorData::I32(v), shape)) => crate::ir::RangeTable::of_operand(v, shape),
            Some((crate::tensor::TensorData::Bool(v), shape)) => crate::ir::RangeTable::of_bools(v, shape),
            _ => continue,
        };
        env.insert(crate::ir::data_param_key(i), table.content_key());
        out.insert(i, std::sync::Arc::new(table));
    }
    out
}

/// A 64-bit hash of an input's values (a run's `env` names the values that classify tiles by
/// it, [`crate::ir::data_param_key`]).
pub fn content_hash(values: &[i32]) -> i64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    values.hash(&mut h);
    h.finish() as i64
}

/// Inputs must match the parameters in count, dtype and stored element count (shapes are
/// checked by [`bind_dims`]). Every backend validates its inputs with this.
pub fn check_inputs(graph: &Graph, inputs: &[Tensor]) -> Result<(), ExecError> {
    let params = graph.params();
    if inputs.len() != params.len() {
        return Err(ExecError::input_count(graph, inputs.len()));
    }
    for (p, t) in params.iter().zip(inputs) {
        check_input(graph.node(*p), t)?;
    }
    Ok(())
}

/// An input must have its parameter's dtype and as many stored elements as its shape says (the
/// shape itself is checked by [`bind_dims`]).
fn check_input(node: &Node, t: &Tensor) -> Result<(), ExecError> {
    let param = match &node.op {
        Op::Param(name) => name.clone(),
        other => return Err(ExecError::Internal(format!("a parameter is a `{}` node", other.name()))),
    };
    if t.dtype != node.ty.dtype {
        return Err(ExecError::InputDType { param, expected: node.ty.dtype, actual: t.dtype });
    }
    let stored = match &t.data {
        TensorData::F32(v) => v.len(),
        TensorData::I32(v) => v.len(),
        TensorData::Bool(v) => v.len(),
    };
    let expected = t.shape.iter().try_fold(1usize, |acc, d| acc.checked_mul(*d));
    if expected != Some(stored) {
        return Err(ExecError::InputData { param, shape: t.shape.clone(), expected: expected.unwrap_or(usize::MAX), actual: stored });
    }
    Ok(())
}
