//! Code generation checks that need no JIT: every example's schedule renders to functions that
//! pass Cranelift's verifier, before and after optimisation.

use super::*;
use attn_compiler::schedule::{Policy, schedule};

#[test]
fn every_example_generates_valid_functions() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut files: Vec<_> = std::fs::read_dir(&dir).expect("examples dir").filter_map(|e| e.ok()).map(|e| e.path()).collect();
    files.retain(|p| p.extension().is_some_and(|x| x == "attn"));
    files.sort();
    for path in files {
        let name = path.display().to_string();
        let compiled =
            attn_compiler::check(&std::fs::read_to_string(&path).expect("readable")).unwrap_or_else(|_| panic!("{name} compiles"));
        let (opt, _) = attn_compiler::opt::optimize_module(&compiled.module);
        for g in compiled.module.graphs.iter().chain(&opt.graphs) {
            let s = schedule(g, &Policy::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
            let m = render(&s, &TEXT_FEATURES).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(m.functions.len(), s.steps.len(), "{name}");
        }
    }
}

#[test]
fn a_cuda_schedule_is_refused() {
    let g: attn_compiler::ir::Graph =
        "graph f {\n  %0 = param[name=x] : f32[N]\n  %1 = exp %0 : f32[N]\n  output out = %1\n}".parse().expect("parses");
    let s = schedule(&g, &Policy::Cuda(Default::default())).expect("schedules");
    assert!(matches!(render(&s, &TEXT_FEATURES), Err(CodegenError::Target { .. })));
}
