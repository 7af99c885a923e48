//! Tests on a real GPU, enabled with `ATTNC_GPU_TESTS=1` (they print that they skipped
//! otherwise; with the variable set, a missing device is a failure). Every example, as the
//! CUDA target runs it (optimised), against the interpreter at odd sizes; the f16/bf16 flash
//! kernels; and the compile cache (a second run compiles nothing).

use super::exec::gpu;
use super::tests::{FLASH_GRAPHS, examples};
use attn_compiler::ir::{DType, Graph};
use attn_compiler::tensor::Tensor;
use std::collections::HashMap;

fn enabled(test: &str) -> bool {
    if std::env::var("ATTNC_GPU_TESTS").is_ok_and(|v| v == "1") {
        if let Err(e) = super::device_info() {
            panic!("{test}: ATTNC_GPU_TESTS=1 but {e}");
        }
        return true;
    }
    eprintln!("{test}: skipped (set ATTNC_GPU_TESTS=1 on a machine with an NVIDIA GPU)");
    false
}

/// Sizes for the device tests: odd, and large enough to cross many tiles.
const DEVICE_SIZES: &[(&str, i64)] =
    &[("B", 2), ("H", 3), ("S", 130), ("T", 1000), ("M", 67), ("N", 129), ("D", 64), ("Dv", 40), ("Dh", 16), ("G", 2), ("R", 3)];

fn sizes(graph: &Graph, over: &[(&str, i64)]) -> HashMap<String, i64> {
    super::emulate_tests::dims_with(graph, DEVICE_SIZES, over)
}

/// Largest element-wise relative error, with a floor of a tenth of the tensor's largest
/// magnitude (at least 1), as in the emulation tests.
fn max_rel(actual: &Tensor, expected: &Tensor) -> f64 {
    let scale = expected.to_f64_vec().iter().filter(|x| x.is_finite()).fold(0.0f64, |m, x| m.max(x.abs()));
    super::emulate_tests::max_rel(actual, expected, (0.1 * scale).max(1.0))
}

fn compare(label: &str, graph: &Graph, env: &HashMap<String, i64>, seed: u64, tol: f64) -> Result<(), String> {
    let (inputs, expected) = super::emulate_tests::reference_run(graph, env, seed).map_err(|e| format!("{label}: {e}"))?;
    let got = super::run(graph, &inputs, env).map_err(|e| format!("{label}: {e}"))?;
    for (g, e) in got.iter().zip(&expected) {
        let err = max_rel(g, e);
        if err > tol {
            return Err(format!("{label}: max relative error {err:e} > {tol:e}"));
        }
        eprintln!("{label}: ok ({err:.1e})");
    }
    Ok(())
}

#[test]
fn every_example_on_the_gpu_matches_the_interpreter() {
    if !enabled("every_example_on_the_gpu_matches_the_interpreter") {
        return;
    }
    let files = examples();
    let mut failures = Vec::new();
    for path in files {
        let stem = path.file_stem().unwrap().to_string_lossy().to_string();
        let compiled = attn_compiler::check(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for g in &compiled.module.graphs {
            // f32 end to end: 1e-4 of the output's scale.
            if let Err(e) = compare(&format!("{stem}/{}", g.name), g, &sizes(g, &[]), 3, 1e-4) {
                failures.push(e);
            }
        }
    }
    assert!(failures.is_empty(), "{} failure(s):\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn flash_kernels_on_the_gpu_match_the_interpreter() {
    if !enabled("flash_kernels_on_the_gpu_match_the_interpreter") {
        return;
    }
    let mut failures = Vec::new();
    for (n, (label, text)) in FLASH_GRAPHS.iter().enumerate() {
        let g: Graph = text.parse().unwrap();
        let tol = match g.node(g.params()[0]).ty.dtype {
            // P and the output rounded to f16 (2^-11 each), f32 accumulation.
            DType::F16 => 5e-3,
            // bf16 keeps 8 significant bits (2^-8 = 3.9e-3 per rounding).
            DType::BF16 => 4e-2,
            _ => 1e-4,
        };
        for d in [32i64, 64, 80, 128, 256] {
            let env = sizes(&g, &[("D", d), ("E", d), ("S", 333), ("T", 4099), ("M", 190), ("N", 257)]);
            if let Err(e) = compare(&format!("{label} D={d}"), &g, &env, 17 + n as u64, tol) {
                failures.push(e);
            }
        }
    }
    assert!(failures.is_empty(), "{} failure(s):\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn a_second_run_compiles_nothing() {
    if !enabled("a_second_run_compiles_nothing") {
        return;
    }
    let g: Graph = FLASH_GRAPHS[0].1.parse().unwrap();
    let run = |s: i64| {
        let env = sizes(&g, &[("S", s), ("D", 64)]);
        compare("cache", &g, &env, 1, 5e-3).unwrap();
    };
    run(100);
    let gpu = gpu().unwrap();
    let before = gpu.compiles();
    // Same graph, another sequence length: launch shapes change, the module does not.
    run(257);
    run(100);
    assert_eq!(gpu.compiles(), before, "a new sequence length must not recompile");
}

#[test]
fn every_op_on_the_gpu_matches_the_interpreter() {
    if !enabled("every_op_on_the_gpu_matches_the_interpreter") {
        return;
    }
    let compiled = attn_compiler::check(super::tests::EVERY_OP).unwrap_or_else(|d| panic!("{}", d[0]));
    let g = compiled.module.graphs[0].clone();
    let env = sizes(&g, &[("S", 300), ("E", 72), ("F", 136)]);
    let (inputs, expected) = super::emulate_tests::reference_run(&g, &env, 9).unwrap();
    let got = super::run(&g, &inputs, &env).unwrap();
    for (((name, v), got), exp) in g.outputs().iter().zip(&got).zip(&expected) {
        let dtype = g.node(*v).ty.dtype;
        // As in the emulation test: integers and booleans exact, f16 2e-3, bf16 4e-2, f32 1e-4.
        let tol = match dtype {
            DType::I32 | DType::Bool => 0.0,
            DType::F16 => 2e-3,
            DType::BF16 => 4e-2,
            DType::F32 => 1e-4,
        };
        let err = max_rel(got, exp);
        assert!(err <= tol, "output {name} ({dtype}): max relative error {err:e} > {tol:e}");
    }
}
