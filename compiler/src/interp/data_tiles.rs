//! Tile maps at run-time data: a mask that reads tensors (segment ids, a padding mask) is
//! unknown at compile time, so [`crate::ir::classify_tile`] calls its tiles partial. Given the
//! inputs, the interpreter computes the tensors the mask reads and evaluates the mask on every
//! score of each such tile, with the same loads and scalar semantics as the flash op itself:
//! the map then shows what this data masks, e.g. the blocks of a document mask.

use super::eval::run;
use super::flash_eval::extra_loader;
use super::value::Val;
use crate::exec::ExecError;
use crate::exec::check_inputs;
use crate::exec::{bind_dims, eval_shape, node_label};
use crate::ir::{Graph, Op, ScoreExpr, TileClass, TileGrid, Value, tile_grid, value_numbers};
use crate::tensor::Tensor;
use std::collections::HashMap;

/// The most mask evaluations one call may make (about a second of work).
pub const MAX_MASK_EVALS: u64 = 1 << 27;

/// Every flash op's tile grid (with its value number), in value order, for these inputs (one
/// per parameter, in order) and dims. Tiles the compile-time analysis settles keep its class;
/// the partial ones of a mask that does not read the score are classified from the data, over
/// every batch position the mask reads.
pub fn data_tile_grids(
    graph: &Graph,
    inputs: &[Tensor],
    given: &HashMap<String, i64>,
    tile: (i64, i64),
) -> Result<Vec<(usize, TileGrid)>, ExecError> {
    check_inputs(graph, inputs)?;
    let shapes: Vec<Vec<usize>> = inputs.iter().map(|t| t.shape.clone()).collect();
    let env = bind_dims(graph, &shapes, given)?;
    let numbers = value_numbers(graph);
    let mut flashes: Vec<Value> = graph.values().filter(|v| matches!(graph.node(*v).op, Op::Flash(_))).collect();
    flashes.sort_by_key(|v| numbers[v.index()]);
    // The tensors the masks read, computed by the interpreter (and nothing else).
    let mut wanted = Vec::new();
    for (f, v) in flashes.iter().enumerate() {
        for (k, x) in graph.operands(*v).iter().skip(3).enumerate() {
            wanted.push((format!("flash{f}_x{k}"), *x));
        }
    }
    let computed = if wanted.is_empty() { Vec::new() } else { run(&graph.with_outputs(wanted.clone()), inputs, given)? };
    let mut computed = computed.into_iter();
    let mut grids = Vec::with_capacity(flashes.len());
    let mut budget = MAX_MASK_EVALS;
    for v in flashes {
        let Op::Flash(spec) = &graph.node(v).op else { continue };
        let ops = graph.operands(v);
        let label = node_label(graph, v);
        let r = spec.rank;
        let q = eval_shape(&graph.node(ops[0]).ty.shape, &env, &label)?;
        let k = eval_shape(&graph.node(ops[1]).ty.shape, &env, &label)?;
        let extras: Vec<Val> =
            computed.by_ref().take(ops.len().saturating_sub(3)).map(|t| Val::new(t.dtype, t.shape.clone(), t.to_f64_vec())).collect();
        let (Some(&m), Some(&n)) = (q.get(r - 2), k.get(r - 2)) else {
            return Err(ExecError::Internal(format!("{label}: q and k have fewer than two axes")));
        };
        let batch: Vec<i64> = q[..r - 2].iter().map(|&d| d as i64).collect();
        let mut grid = tile_grid(spec.mask.as_ref(), &batch, (m as i64, n as i64), tile, &env);
        if let Some(mask) = spec.mask.as_ref().filter(|m| !m.uses_score()) {
            let refs: Vec<&Val> = extras.iter().collect();
            refine(&mut grid, mask, &batch, &refs, &env, &mut budget, &label)?;
        }
        grids.push((numbers[v.index()], grid));
    }
    Ok(grids)
}

/// Classifies the partial tiles of `grid` by evaluating `mask` on each of their scores.
fn refine(
    grid: &mut TileGrid,
    mask: &ScoreExpr,
    batch: &[i64],
    extras: &[&Val],
    env: &HashMap<String, i64>,
    budget: &mut u64,
    label: &str,
) -> Result<(), ExecError> {
    let load = extra_loader(extras);
    let r = batch.len() + 2;
    // Batch axes the mask reads are iterated; the others are fixed at 0.
    let read: Vec<usize> = (0..batch.len()).filter(|&a| mask.any(&|e| matches!(e, ScoreExpr::Pos(p) if *p == a))).collect();
    let combos: u64 = read.iter().map(|&a| batch[a].max(0) as u64).product();
    let (m, n) = grid.size;
    let (tm, tn) = grid.tile;
    let mut pos = vec![0i64; r];
    for t in 0..grid.classes.len() {
        if grid.classes[t] != TileClass::Partial {
            continue;
        }
        let (tr, tc) = ((t / grid.cols) as i64, (t % grid.cols) as i64);
        let rows = tr * tm..((tr + 1) * tm).min(m);
        let cols = tc * tn..((tc + 1) * tn).min(n);
        let cost = combos.saturating_mul((rows.end - rows.start) as u64 * (cols.end - cols.start) as u64);
        *budget = budget.checked_sub(cost).ok_or_else(|| ExecError::BadNode {
            node: label.to_string(),
            reason: format!(
                "classifying the tiles from the data needs more than {MAX_MASK_EVALS} mask evaluations; use smaller dims or larger tiles"
            ),
        })?;
        let (mut any_true, mut any_false) = (false, false);
        'all: for combo in 0..combos {
            let mut rest = combo;
            for &a in read.iter().rev() {
                let size = batch[a].max(1) as u64;
                pos[a] = (rest % size) as i64;
                rest /= size;
            }
            for i in rows.clone() {
                pos[r - 2] = i;
                for j in cols.clone() {
                    pos[r - 1] = j;
                    if mask.eval(0.0, &pos, env, &load).as_b() {
                        any_true = true
                    } else {
                        any_false = true
                    }
                    if any_true && any_false {
                        break 'all;
                    }
                }
            }
        }
        grid.classes[t] = match (any_true, any_false) {
            (true, false) => TileClass::Full,
            (false, _) => TileClass::Skip,
            (true, true) => TileClass::Partial,
        };
    }
    Ok(())
}
