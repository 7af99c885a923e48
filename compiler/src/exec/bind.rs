//! Binding symbolic dims to sizes: from the input shapes (solving expressions such as `H*D`)
//! and from explicitly given values, plus checked evaluation of dims under the bindings.

use super::ExecError;
use crate::ir::{Dim, Graph, Op};
use std::collections::{BTreeSet, HashMap};

/// One input axis still to be matched against its declared dim.
struct Axis<'g> {
    param: &'g str,
    axis: usize,
    dim: &'g Dim,
    size: i64,
}

/// Binds every symbolic dim of `graph` from the concrete shapes of its inputs (one per param, in
/// order) plus dims given explicitly (`given`, e.g. from `--dim`). Fixed dims are checked, a
/// plain name is bound to its axis' size, an expression is checked once its names are bound or
/// solved (`Dim::solve`) when exactly one is unknown; this repeats until nothing changes. Every
/// dim the graph mentions (node types, `DimValue`, slice bounds) must end up bound, and no
/// node's size may evaluate to a negative number. Given names the graph does not use are ignored.
pub fn bind_dims(graph: &Graph, input_shapes: &[Vec<usize>], given: &HashMap<String, i64>) -> Result<HashMap<String, i64>, ExecError> {
    let params = graph.params();
    if input_shapes.len() != params.len() {
        return Err(ExecError::input_count(graph, input_shapes.len()));
    }
    let mut env: HashMap<String, i64> = HashMap::new();
    // Where each binding came from, for error messages.
    let mut origin: HashMap<String, String> = HashMap::new();
    let mut given_sorted: Vec<(&String, &i64)> = given.iter().collect();
    given_sorted.sort();
    for (name, value) in given_sorted {
        if *value < 0 || *value > i64::from(i32::MAX) {
            return Err(ExecError::GivenDim { name: name.clone(), value: *value });
        }
        env.insert(name.clone(), *value);
        origin.insert(name.clone(), "given by --dim".to_string());
    }
    let pending = param_axes(graph, input_shapes)?;
    solve(pending, &mut env, &mut origin)?;
    for name in graph_symbols(graph) {
        if !env.contains_key(&name) {
            return Err(ExecError::UnboundDim { name });
        }
    }
    for v in graph.values() {
        let node = graph.node(v);
        for d in &node.ty.shape {
            let value = eval_dim(d, &env)?;
            if value < 0 {
                return Err(ExecError::NegativeDim { node: node_label(graph, v), span: node.span, dim: d.to_string(), value });
            }
        }
    }
    Ok(env)
}

/// The axes of the inputs whose dims are symbolic, with their sizes; axes of constant dims are
/// checked here.
fn param_axes<'g>(graph: &'g Graph, input_shapes: &[Vec<usize>]) -> Result<Vec<Axis<'g>>, ExecError> {
    let mut pending = Vec::new();
    for (p, shape) in graph.params().iter().zip(input_shapes) {
        let node = graph.node(*p);
        let param = match &node.op {
            Op::Param(name) => name.as_str(),
            other => return Err(ExecError::Internal(format!("parameter %{} is a `{}` node", p.index(), other.name()))),
        };
        if shape.len() != node.ty.rank() {
            return Err(ExecError::InputRank {
                param: param.to_string(),
                expected: node.ty.rank(),
                actual: shape.len(),
                declared: node.ty.to_string(),
            });
        }
        for (axis, (dim, size)) in node.ty.shape.iter().zip(shape).enumerate() {
            let size = i64::try_from(*size).map_err(|_| ExecError::TooLarge {
                what: format!("input `{param}`"),
                shape: shape.clone(),
                limit: super::MAX_ELEMENTS,
            })?;
            if let Some(expected) = dim.as_const() {
                if expected != size {
                    return Err(ExecError::FixedDim {
                        param: param.to_string(),
                        axis,
                        expected,
                        actual: shape[axis],
                        declared: node.ty.to_string(),
                    });
                }
                continue;
            }
            pending.push(Axis { param, axis, dim, size });
        }
    }
    Ok(pending)
}

/// Binds the dims of `pending` axes by fixpoint: settle every axis that needs no solving; when
/// stuck, solve one expression (its binding may unblock others) and go round again. Plain
/// bindings go first so that a conflict is reported between two direct observations where
/// possible.
fn solve(mut pending: Vec<Axis>, env: &mut HashMap<String, i64>, origin: &mut HashMap<String, String>) -> Result<(), ExecError> {
    loop {
        let mut i = 0;
        let mut progressed = false;
        while i < pending.len() {
            if settle(&pending[i], env, origin)? {
                pending.remove(i);
                progressed = true;
            } else {
                i += 1;
            }
        }
        if progressed {
            continue;
        }
        let mut solved = None;
        for (i, a) in pending.iter().enumerate() {
            if solve_one(a, env, origin)? {
                solved = Some(i);
                break;
            }
        }
        match solved {
            Some(i) => {
                pending.remove(i);
            }
            None => break,
        }
    }
    match pending.first() {
        Some(a) => {
            let unknown: Vec<String> = a.dim.symbols().into_iter().filter(|s| !env.contains_key(s)).collect();
            let first = unknown.first().cloned().unwrap_or_default();
            Err(ExecError::Unsolvable {
                param: a.param.to_string(),
                axis: a.axis,
                dim: a.dim.to_string(),
                reason: format!("{} = {} cannot be solved for {}; pass --dim {first}=N", a.dim, a.size, unknown.join(" and ")),
            })
        }
        None => Ok(()),
    }
}

/// Checks an axis whose dim has no unknown name, or binds a dim that is a single unknown name.
/// Returns whether the axis is done.
fn settle(a: &Axis, env: &mut HashMap<String, i64>, origin: &mut HashMap<String, String>) -> Result<bool, ExecError> {
    let unknown: Vec<String> = a.dim.symbols().into_iter().filter(|s| !env.contains_key(s)).collect();
    if unknown.is_empty() {
        let expected = eval_dim(a.dim, env)?;
        if expected != a.size {
            return Err(ExecError::DimMismatch {
                param: a.param.to_string(),
                axis: a.axis,
                dim: a.dim.to_string(),
                expected,
                actual: a.size as usize,
                bound_from: describe_bindings(a.dim, env, origin),
            });
        }
        return Ok(true);
    }
    if let Some(name) = a.dim.as_sym() {
        env.insert(name.to_string(), a.size);
        origin.insert(name.to_string(), format!("bound by `{}` axis {}", a.param, a.axis));
        return Ok(true);
    }
    Ok(false)
}

/// Solves an axis' dim for its one unknown name, if it has exactly one and appears linearly.
/// Returns whether it bound a name.
fn solve_one(a: &Axis, env: &mut HashMap<String, i64>, origin: &mut HashMap<String, String>) -> Result<bool, ExecError> {
    let unknown: Vec<String> = a.dim.symbols().into_iter().filter(|s| !env.contains_key(s)).collect();
    if unknown.len() != 1 {
        return Ok(false);
    }
    check_solvable_without_overflow(a, &unknown[0], env)?;
    match a.dim.solve(a.size, env) {
        Some(Ok((name, value))) => {
            origin.insert(name.clone(), format!("solved from `{}` axis {} ({} = {})", a.param, a.axis, a.dim, a.size));
            env.insert(name, value);
            Ok(true)
        }
        Some(Err(reason)) => Err(ExecError::Unsolvable { param: a.param.to_string(), axis: a.axis, dim: a.dim.to_string(), reason }),
        None => Ok(false),
    }
}

/// `Dim::solve` uses unchecked arithmetic; redo its sums with checked arithmetic first so that
/// huge bindings give an error instead of an overflow panic.
fn check_solvable_without_overflow(a: &Axis, unknown: &str, env: &HashMap<String, i64>) -> Result<(), ExecError> {
    let overflow = || ExecError::Overflow { what: format!("{} = {} (`{}` axis {})", a.dim, a.size, a.param, a.axis) };
    let (mut coef, mut rest) = (0i64, 0i64);
    for (mono, c) in a.dim.terms() {
        let mut known = c;
        let mut degree = 0;
        for name in mono {
            if name == unknown {
                degree += 1;
            } else {
                known = known.checked_mul(*env.get(name).ok_or_else(overflow)?).ok_or_else(overflow)?;
            }
        }
        match degree {
            0 => rest = rest.checked_add(known).ok_or_else(overflow)?,
            _ => coef = coef.checked_add(known).ok_or_else(overflow)?,
        }
    }
    let diff = a.size.checked_sub(rest).ok_or_else(overflow)?;
    if coef != 0 {
        diff.checked_rem(coef).ok_or_else(overflow)?;
    }
    Ok(())
}

/// "H = 8 bound by `q` axis 1; D = 65 solved from ..." for the names in `dim`.
fn describe_bindings(dim: &Dim, env: &HashMap<String, i64>, origin: &HashMap<String, String>) -> String {
    let describe = |name: &String| origin.get(name).cloned().unwrap_or_else(|| "bound".to_string());
    if let Some(name) = dim.as_sym() {
        return describe(&name.to_string());
    }
    let parts: Vec<String> =
        dim.symbols().iter().map(|n| format!("{n} = {} {}", env.get(n).copied().unwrap_or_default(), describe(n))).collect();
    parts.join("; ")
}

/// Every dim name the graph mentions: in node types, `DimValue` nodes and slice bounds.
pub(super) fn graph_symbols(graph: &Graph) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for v in graph.values() {
        let node = graph.node(v);
        for d in &node.ty.shape {
            names.extend(d.symbols());
        }
        match &node.op {
            Op::DimValue(d) => names.extend(d.symbols()),
            Op::Slice { start, end, .. } => {
                names.extend(start.symbols());
                names.extend(end.symbols());
            }
            _ => {}
        }
    }
    names
}

/// The value of `dim` under `env`, with checked arithmetic (an unbound name is `UnboundDim`).
pub(crate) fn eval_dim(dim: &Dim, env: &HashMap<String, i64>) -> Result<i64, ExecError> {
    Ok(dim.eval(env)?)
}

/// The concrete shape of a node's type, rejecting negative sizes.
pub(crate) fn eval_shape(shape: &[Dim], env: &HashMap<String, i64>, node: &str) -> Result<Vec<usize>, ExecError> {
    shape
        .iter()
        .map(|d| {
            let value = eval_dim(d, env)?;
            usize::try_from(value).map_err(|_| ExecError::NegativeDim { node: node.to_string(), span: None, dim: d.to_string(), value })
        })
        .collect()
}

/// How errors name a node: `%12 (softmax)`.
pub(crate) fn node_label(graph: &Graph, v: crate::ir::Value) -> String {
    format!("%{} ({})", v.index(), graph.node(v).op.name())
}
