//! Random well-typed attention programs (`attn_fuzz::generate`) run on the reference interpreter
//! and on the CPU target (optimized or not, with small forced tiles, 1 or 2 threads) on seeded
//! random inputs: the outputs must agree within the test suite's f32 tolerance (normwise 1e-4;
//! NaN matches NaN). A generated program that does not check is a generator bug and fails too.
//! `ATTN_FUZZ_SHOW=1` prints every program.

#![no_main]

use arbitrary::Unstructured;
use attn_compiler::interp;
use attn_compiler::schedule::{CpuPolicy, Policy};
use attn_fuzz::compare::compare_outputs;
use attn_fuzz::generate::{Case, generate};
use attn_runtime::cpu::{CpuOptions, CpuProgram, cpu_policy};
use attn_runtime::{Compiler, Program, Tensor};
use libfuzzer_sys::fuzz_target;
use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Instant;

fn show() -> bool {
    static SHOW: OnceLock<bool> = OnceLock::new();
    *SHOW.get_or_init(|| std::env::var_os("ATTN_FUZZ_SHOW").is_some())
}

fuzz_target!(|data: &[u8]| {
    let Ok(case) = generate(&mut Unstructured::new(data)) else { return };
    if show() {
        eprintln!("{case}");
    }
    run(&case);
});

fn run(case: &Case) {
    let program = Program::from_source(&case.source, "generated.attn")
        .unwrap_or_else(|e| panic!("generator bug: a generated program does not check\n{case}\n{}", e.render(false)));
    let graph = program.graph(&case.entry).unwrap_or_else(|e| panic!("generator bug: {e}\n{case}"));
    let used = program.entry_dims(&case.entry).unwrap_or_else(|e| panic!("{e}"));
    let dims: HashMap<String, i64> = case.dims.iter().filter(|(n, _)| used.contains(n)).cloned().collect();
    let inputs: Vec<Tensor> = program
        .random_inputs(&case.entry, case.seed, &dims)
        .unwrap_or_else(|e| panic!("generator bug: no random inputs: {e}\n{case}"))
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    let want = interp::run(graph, &inputs, &dims).unwrap_or_else(|e| panic!("the interpreter fails: {e}\n{case}"));

    let policy = Policy::Cpu(CpuPolicy { flash_blocks: case.flash_blocks, matmul_rows: case.matmul_rows, ..cpu_policy() });
    let compiler = Compiler::new(policy);
    let opts = CpuOptions { threads: case.threads };
    let compiled = if case.optimize {
        compiler
            .plan(graph)
            .map_err(|e| e.to_string())
            .and_then(|planned| {
                let (before, after) = planned.optimized.report.cost;
                assert!(after <= before * (1.0 + 1e-9), "the optimizer made the program costlier by its own model: {before:.4e} -> {after:.4e}\n{case}");
                CpuProgram::from_planned(&compiler, planned, &opts, Instant::now()).map_err(|e| e.to_string())
            })
    } else {
        CpuProgram::compile_graph(graph, &opts).map_err(|e| e.to_string())
    };
    let compiled = compiled.unwrap_or_else(|e| panic!("the CPU target cannot compile a program the interpreter runs: {e}\n{case}"));
    let got = compiled.run_tensors(&inputs, &dims).unwrap_or_else(|e| panic!("the CPU target fails to run: {e}\n{case}"));
    if let Err(e) = compare_outputs(&got, &want) {
        panic!("the CPU target disagrees with the interpreter: {e}\n{case}");
    }
}
