//! The `source` target's driver: check a program, then plan and render every function for both
//! targets with small optimizer limits. Every step may fail with a diagnostic or a typed error;
//! none may panic.

use attn_compiler::opt::OptOptions;
use attn_compiler::schedule::{CpuPolicy, Policy, Target};
use attn_compiler::{Compiler, check};
use attn_runtime::{cpu, cuda};
use std::time::Duration;

/// Inputs longer than this are ignored: longer programs only slow the fuzzer down.
pub const MAX_SOURCE_BYTES: usize = 4096;

/// Small optimizer limits, so that one input takes milliseconds. The time limit is only a safety
/// net (the node and iteration limits keep runs deterministic).
pub fn small_limits() -> OptOptions {
    OptOptions { iter_limit: 4, node_limit: 2000, time_limit: Duration::from_millis(200), ..OptOptions::default() }
}

/// Checks `source`; for every function that checks, optimizes it once, then schedules and
/// renders it for the CPU (Cranelift IR text) and for CUDA (C++ source). Returns how many
/// functions got through every stage (for tests; the fuzzer only cares that nothing panics).
pub fn check_plan_render(source: &str) -> usize {
    let Ok(checked) = check(source) else { return 0 };
    let compiler = Compiler { opt: small_limits(), ..Compiler::new(Policy::Cpu(CpuPolicy::default())) };
    let gpu = compiler.retarget(Target::Cuda);
    let mut through = 0;
    for graph in &checked.module.graphs {
        let optimized = compiler.optimize(graph);
        let cpu_ok = compiler.schedule(&optimized.graph).is_ok_and(|s| cpu::render::render(&s, &cpu::TEXT_FEATURES).is_ok());
        let gpu_ok = gpu.schedule(&optimized.graph).is_ok_and(|s| cuda::render::render(&s).is_ok());
        through += usize::from(cpu_ok && gpu_ok);
    }
    through
}
