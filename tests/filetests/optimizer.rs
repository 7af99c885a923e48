//! The optimizer preserves meaning: the interpreter gives the same results on the original and
//! the optimised graph (the interpreter implements `flash` by its definition).

use crate::snapshot::Snapshots;
use attn_compiler::interp;
use attn_compiler::ir::{Graph, Op};
use attn_compiler::opt::{OptOptions, OptReport, Optimized, optimize};
use attn_runtime::{Program, Tensor};
use attn_tests::normwise_error;
use proptest::prelude::*;
use std::collections::HashMap;

/// Sequence lengths the optimised graphs are checked at: odd sizes and tile edges.
const SIZES: &[i64] = &[1, 7, 64, 65, 130];
/// Normwise error allowed between fused and unfused f32 results (the fused form rounds the
/// scale into q and sums in another order).
const TOLERANCE: f64 = attn_tests::F32_TOLERANCE;

/// Dims for one check: sequence-like dims (S, N, M, T…) at `size`, the rest small.
fn dims_for(program: &Program, entry: &str, size: i64) -> HashMap<String, i64> {
    let names = program.entry_dims(entry).unwrap_or_default();
    names
        .into_iter()
        .filter(|n| !program.fixed_dims().iter().any(|(f, _)| f == n))
        .map(|n| {
            let v = if n.starts_with(['S', 'N', 'M', 'T', 'L']) { size } else { 4 };
            (n, v)
        })
        .collect()
}

fn compare(graph: &Graph, optimized: &Graph, inputs: &[Tensor], dims: &HashMap<String, i64>) -> Result<f64, String> {
    let a = interp::run(graph, inputs, dims).map_err(|e| format!("original: {e}"))?;
    let b = interp::run(optimized, inputs, dims).map_err(|e| format!("optimised: {e}"))?;
    Ok(a.iter().zip(&b).map(|(x, y)| normwise_error(&y.to_f64_vec(), &x.to_f64_vec())).fold(0.0, f64::max))
}

/// For every entry of an example and every size: same outputs before and after optimisation.
pub fn original_matches_optimized(source: &str, name: &str, snaps: &mut Snapshots) {
    let program = match Program::from_source(source, name) {
        Ok(p) => p,
        Err(e) => return snaps.fail(format!("{name}: {e}")),
    };
    let Some(entry) = program.default_entry() else { return snaps.fail(format!("{name}: no entry")) };
    let Ok(graph) = program.graph(&entry.name) else { return snaps.fail(format!("{name}: no graph")) };
    let Optimized { graph: optimized, report } = optimize(graph, &OptOptions::default());
    if let Err(e) = never_costlier(&report) {
        snaps.fail(format!("{name}: {e}"));
    }
    for &size in SIZES {
        let dims = dims_for(&program, &entry.name, size);
        let run = program.random_inputs(&entry.name, size as u64, &dims).and_then(|inputs| {
            let all = program.random_dims(&entry.name, &dims)?;
            Ok((inputs, all))
        });
        let (inputs, all) = match run {
            Ok(x) => x,
            Err(e) => return snaps.fail(format!("{name}: inputs at S={size}: {e}")),
        };
        let tensors: Vec<Tensor> = inputs.into_iter().map(|(_, t)| t).collect();
        match compare(graph, &optimized, &tensors, &all) {
            Ok(err) if err <= TOLERANCE => {}
            Ok(err) => snaps.fail(format!("{name}: optimised graph differs at S={size}: normwise error {err:e}")),
            Err(e) => snaps.fail(format!("{name}: S={size}: {e}")),
        }
    }
}

/// The optimizer's own cost model never rates its result costlier than its input.
fn never_costlier(report: &OptReport) -> Result<(), String> {
    let (before, after) = report.cost;
    if after <= before * (1.0 + 1e-9) {
        Ok(())
    } else {
        Err(format!("the optimizer made the program costlier: {before:.4e} -> {after:.4e}"))
    }
}

/// One score modification or mask, as source text over `s`, `b`, `h`, `i`, `j`, with a
/// parameter drawn by proptest.
fn modification(kind: u8, c: f64) -> String {
    match kind % 10 {
        0 => format!("s * {c:.3}"),
        1 => format!("s + slope[h] * (j - i) * {c:.3}"),
        2 => format!("{:.3} * tanh(s / {:.3})", 5.0 + c * 10.0, 5.0 + c * 10.0),
        3 => "where(j <= i, s, -inf)".to_string(),
        4 => format!("where(abs(i - j) <= {}, s, -inf)", 1 + (c * 10.0) as i64),
        5 => format!("where(j <= i || j < {}, s, -inf)", (c * 8.0) as i64),
        6 => "s + bias".to_string(),
        7 => format!("s + where(i - j >= {}, 0.0, -inf)", (c * 5.0) as i64 - 2),
        8 => format!("s - abs(i - j) * {c:.3}"),
        _ => format!("max(s, {:.3})", -c),
    }
}

fn chain_program(mods: &[(u8, f64)]) -> String {
    let mut body = String::from("    let s = q @ k.T / sqrt(D)\n    let (b, h, i, j) = indices(s)\n");
    for (kind, c) in mods {
        body.push_str(&format!("    let s = {}\n", modification(*kind, *c)));
    }
    format!(
        "fn chain(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D], slope: f32[H], bias: f32[S, S]) -> f32[B, H, S, D] {{\n{body}    return softmax(s, axis = -1) @ v\n}}\n"
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random chains of score modifications and masks fuse into one flash op, and the fused
    /// graph computes what the original does.
    #[test]
    fn random_score_mod_chains_fuse_and_agree(mods in proptest::collection::vec((any::<u8>(), 0.05f64..1.0), 1..5), size in 1i64..40) {
        let source = chain_program(&mods);
        let program = Program::from_source(&source, "chain.attn").map_err(|e| TestCaseError::fail(e.render(false)))?;
        let graph = program.graph("chain").map_err(|e| TestCaseError::fail(e.to_string()))?;
        let Optimized { graph: optimized, report } = optimize(graph, &OptOptions::default());
        never_costlier(&report).map_err(TestCaseError::fail)?;
        let flashes = optimized.values().filter(|v| matches!(optimized.node(*v).op, Op::Flash(_))).count();
        prop_assert_eq!(flashes, 1, "not fused:\n{}\n{}", source, optimized);
        let softmaxes = optimized.values().filter(|v| matches!(optimized.node(*v).op, Op::Softmax { .. })).count();
        prop_assert_eq!(softmaxes, 0, "softmax left in\n{}", optimized);
        let dims: HashMap<String, i64> = [("S".to_string(), size), ("B".to_string(), 1), ("H".to_string(), 2), ("D".to_string(), 4)].into();
        let inputs = program.random_inputs("chain", size as u64, &dims).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let tensors: Vec<Tensor> = inputs.into_iter().map(|(_, t)| t).collect();
        let err = compare(graph, &optimized, &tensors, &dims).map_err(TestCaseError::fail)?;
        prop_assert!(err <= TOLERANCE, "normwise error {err:e} for\n{source}");
    }
}
