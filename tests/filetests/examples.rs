//! Every example: AST and IR snapshots, IR round trip and verifier, and an interpreter run.

use crate::snapshot::Snapshots;
use attn_compiler::ir::{Module, verify_module};
use attn_runtime::{Program, RunOptions, Target};
use attn_runtime::{Stage, emit};
use attn_tests::{attn_files, checks, repo_root};
use std::collections::HashMap;

const DEFAULT_CHECKS: &[&str] = &["ast", "ir", "opt", "schedule", "explain", "grad", "roundtrip", "run", "opt-numerics"];

#[test]
fn examples() {
    let files = attn_files(&repo_root().join("examples"));
    assert!(files.len() >= 21, "expected the 21 examples, found {}", files.len());
    let mut snaps = Snapshots::default();
    for path in &files {
        let source = std::fs::read_to_string(path).expect("readable example");
        let name = path.display().to_string();
        for check in checks(&source, DEFAULT_CHECKS) {
            match check.as_str() {
                "ast" | "ir" => {
                    let stage = if check == "ast" { Stage::Ast } else { Stage::Ir };
                    match emit(&source, stage) {
                        Ok(text) => snaps.check(path, &check, &text),
                        Err(d) => snaps.fail(format!("{name}: does not compile: {}", d[0])),
                    }
                }
                "opt" | "schedule" => {
                    let stage = if check == "opt" { Stage::Opt } else { Stage::Schedule };
                    match emit(&source, stage) {
                        Ok(text) => snaps.check(path, &check, &text),
                        Err(d) => snaps.fail(format!("{name}: does not compile: {}", d[0])),
                    }
                }
                "explain" => match attn_compiler::explain(&source) {
                    Ok(text) => snaps.check(path, "explain", &text),
                    Err(d) => snaps.fail(format!("{name}: does not compile: {}", d[0])),
                },
                "grad" => match grad_text(&source) {
                    Ok(text) => snaps.check(path, "grad", &text),
                    Err(e) => snaps.fail(format!("{name}: {e}")),
                },
                "opt-numerics" => crate::optimizer::original_matches_optimized(&source, &name, &mut snaps),
                "roundtrip" => roundtrip(&source, &name, &mut snaps),
                "run" => run_interp(&source, &name, &mut snaps),
                other => snaps.fail(format!("{name}: unknown check `{other}`")),
            }
        }
    }
    snaps.finish();
}

/// Every function with its gradients (`attnc build --grad --emit opt`): how its backward pass
/// was built (which flash ops have a fused backward, or why not), then the derived program
/// optimised.
fn grad_text(source: &str) -> Result<String, String> {
    let compiler = attn_compiler::Compiler::default();
    let checked = compiler.check(source).map_err(|d| format!("does not compile: {}", d[0]))?;
    let mut out = String::new();
    for g in &checked.module.graphs {
        match compiler.differentiate(g, None) {
            Ok(derived) => {
                match &derived.fused {
                    Ok(lines) if lines.is_empty() => out.push_str("# backward: no fused attention; every op by its rule\n"),
                    Ok(lines) => lines.iter().for_each(|l| out.push_str(&format!("# backward: {l}\n"))),
                    Err(reason) => out.push_str(&format!("# backward not fused: {reason}\n")),
                }
                out.push_str(&format!("{}\n\n", compiler.optimize(&derived.graph).graph));
            }
            Err(e) => out.push_str(&format!("# {}: no derived program: {e}\n\n", g.name)),
        }
    }
    Ok(out)
}

/// `print(parse(print(ir))) == print(ir)`, and the verifier accepts every graph.
fn roundtrip(source: &str, name: &str, snaps: &mut Snapshots) {
    let Ok(compiled) = attn_compiler::check(source) else { return snaps.fail(format!("{name}: does not compile")) };
    if let Err(errors) = verify_module(&compiled.module) {
        snaps.fail(format!("{name}: verifier: {errors:?}"));
    }
    let (optimized, _) = attn_compiler::opt::optimize_module(&compiled.module);
    for (stage, module) in [("IR", &compiled.module), ("optimised IR", &optimized)] {
        let text = module.to_string();
        match text.parse::<Module>() {
            Ok(back) => {
                if back.to_string() != text {
                    snaps.fail(format!("{name}: {stage} text does not round-trip"));
                }
            }
            Err(e) => snaps.fail(format!("{name}: {stage} text does not parse back: {e}")),
        }
    }
}

/// Runs the default entry on seeded random inputs; outputs must be finite.
fn run_interp(source: &str, name: &str, snaps: &mut Snapshots) {
    let program = match Program::from_source(source, name) {
        Ok(p) => p,
        Err(e) => return snaps.fail(format!("{name}: {e}")),
    };
    let Some(entry) = program.default_entry() else { return snaps.fail(format!("{name}: no entry")) };
    let dims = HashMap::new();
    let result = program.random_inputs(&entry.name, 7, &dims).and_then(|inputs| {
        let opts = RunOptions { dims: program.random_dims(&entry.name, &dims)?, target: Target::Interp };
        program.run(&entry.name, inputs, &opts)
    });
    match result {
        Ok(outputs) => {
            for (out, t) in outputs {
                if t.to_f64_vec().iter().any(|v| !v.is_finite()) {
                    snaps.fail(format!("{name}: output `{out}` has non-finite values"));
                }
            }
        }
        Err(e) => snaps.fail(format!("{name}: run failed: {e}")),
    }
}
