//! A fused derivative split in two: the forward, which also returns what each flash op's
//! backward reads (its result and per-row log-sum-exp), and the backward, which takes them as
//! inputs instead of running the flash forward again. Autograd integrations (the Python
//! package's `torch.autograd.Function`) run the first in the forward pass and the second in the
//! backward pass.

use super::super::graph::{Graph, Value};
use super::super::op::Op;
use std::collections::HashMap;

/// The halves of a derived graph ([`super::differentiate`]) whose first `inputs` parameters are
/// the forward's (the rest cotangents) and whose first `results` outputs are the forward's
/// results (the rest gradients): `{name}_fwd` takes the inputs and returns the results, then
/// `saved_out<n>` and `saved_lse<n>` for each flash op with a fused derivative; `{name}_bwd`
/// takes the derived graph's parameters (inputs, then cotangents) followed by those saved
/// values, and returns the gradients. `None` when there is nothing to save (no fused flash
/// derivative), or when a saved value's name is taken.
pub fn split_saved(derived: &Graph, inputs: usize, results: usize, name: &str) -> Option<(Graph, Graph)> {
    let outputs = derived.outputs();
    if results > outputs.len() {
        return None;
    }
    // Each flash_lse and the flash op it belongs to (same spec, same operands).
    let mut pairs: Vec<(Value, Value)> = Vec::new();
    for v in derived.values() {
        let Op::FlashLse(spec) = &derived.node(v).op else { continue };
        let operands = derived.operands(v);
        let flash =
            derived.values().find(|u| matches!(&derived.node(*u).op, Op::Flash(s) if s == spec) && derived.operands(*u) == operands)?;
        pairs.push((flash, v));
    }
    if pairs.is_empty() {
        return None;
    }
    let saved: Vec<(String, Value)> =
        pairs.iter().enumerate().flat_map(|(n, (f, l))| [(format!("saved_out{n}"), *f), (format!("saved_lse{n}"), *l)]).collect();
    let taken = |s: &str| derived.params().iter().any(|p| derived.param_name(*p) == s) || outputs.iter().any(|(o, _)| o == s);
    if saved.iter().any(|(s, _)| taken(s)) {
        return None;
    }
    let fwd_outputs: Vec<(String, Value)> = outputs[..results].iter().cloned().chain(saved.iter().cloned()).collect();
    let fwd = copy(derived, &format!("{name}_fwd"), derived.params().get(..inputs)?, &[], &fwd_outputs)?;
    let bwd = copy(derived, &format!("{name}_bwd"), derived.params(), &saved, &outputs[results..])?;
    Some((fwd, bwd))
}

/// The part of `g` that computes `outputs`, as a graph named `name` whose parameters are
/// `params` (in order) followed by `as_params` (values of `g` that become parameters of these
/// names): `None` if an output needs a value that is neither.
fn copy(g: &Graph, name: &str, params: &[Value], as_params: &[(String, Value)], outputs: &[(String, Value)]) -> Option<Graph> {
    let mut out = Graph::new(name);
    let mut map: HashMap<Value, Value> = HashMap::new();
    for p in params {
        let node = g.node(*p);
        let nv = out.add(node.op.clone(), node.ty.clone(), &[]);
        out.set_span(nv, node.span);
        map.insert(*p, nv);
    }
    for (s, v) in as_params {
        map.insert(*v, out.add(Op::Param(s.clone()), g.node(*v).ty.clone(), &[]));
    }
    // Only what the outputs need, so that a missing parameter means a real dependence.
    let mut live = vec![false; g.len()];
    let mut stack: Vec<Value> = outputs.iter().map(|(_, v)| *v).collect();
    while let Some(v) = stack.pop() {
        if !std::mem::replace(&mut live[v.index()], true) && !map.contains_key(&v) {
            stack.extend(g.operands(v));
        }
    }
    for v in g.topo_order()? {
        if map.contains_key(&v) || !live[v.index()] {
            continue;
        }
        let node = g.node(v);
        if matches!(node.op, Op::Param(_)) {
            return None;
        }
        let args: Option<Vec<Value>> = g.operands(v).iter().map(|a| map.get(a).copied()).collect();
        let nv = out.add(node.op.clone(), node.ty.clone(), &args?);
        out.set_span(nv, node.span);
        map.insert(v, nv);
    }
    for (o, v) in outputs {
        out.add_output(o.clone(), *map.get(v)?);
    }
    Some(out.compact())
}
