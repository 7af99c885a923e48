//! The CPU target on the team of an OpenMP runtime already in the process
//! (`attn_runtime::cpu::openmp`), as `attnc.torch` runs it on PyTorch's: the same bits as one
//! thread, a library that is not loaded refused, and back to attnc's own pool. A test binary of
//! its own: the choice is process-wide. Uses the system's GNU `libgomp.so.1` (there wherever a
//! C compiler is; skipped without it, except under `CI=true`).

use attn_runtime::cpu::CpuOptions;
use attn_runtime::cpu::openmp::{self, OpenMpError};
use attn_runtime::{Program, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples").join(name)
}

#[test]
fn runs_on_an_openmp_team_give_the_single_threaded_bits() {
    // SAFETY: loading libgomp runs its initialisers, which start no thread and touch nothing of
    // ours; the handle keeps it loaded for the test.
    let gomp = match unsafe { libloading::Library::new("libgomp.so.1") } {
        Ok(lib) => lib,
        Err(e) => {
            let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
            assert!(!ci, "libgomp.so.1 is required in CI: {e}");
            eprintln!("runs_on_an_openmp_team_give_the_single_threaded_bits: skipped: no libgomp.so.1 ({e})");
            return;
        }
    };
    // Asking for a runtime that is not loaded is an error and changes nothing.
    let missing = openmp::share(Some(Path::new("libattnc-no-such-openmp.so")));
    assert!(matches!(missing, Err(OpenMpError::NotLoaded { .. })), "{missing:?}");
    assert_eq!(openmp::shared_path(), None);

    let program = Program::from_file(example("causal.attn")).expect("compiles");
    let dims = program
        .random_dims("causal_attention", &HashMap::from([("B".into(), 2), ("H".into(), 3), ("S".into(), 150), ("D".into(), 16)]))
        .expect("dims");
    let inputs: Vec<Tensor> = program.random_inputs("causal_attention", 9, &dims).expect("inputs").into_iter().map(|(_, t)| t).collect();
    let alone = program.compile_cpu("causal_attention", &CpuOptions { threads: 1 }).expect("compiles");
    let want = alone.run_tensors(&inputs, &dims).expect("runs");

    openmp::share(Some(Path::new("libgomp.so.1"))).expect("libgomp is loaded");
    assert_eq!(openmp::shared_path().as_deref(), Some(Path::new("libgomp.so.1")));
    // Teams of 2 and 3, and two runs at once from two threads (two teams).
    for threads in [2, 3] {
        let compiled = program.compile_cpu("causal_attention", &CpuOptions { threads }).expect("compiles");
        for _ in 0..10 {
            assert_eq!(compiled.run_tensors(&inputs, &dims).expect("runs"), want, "{threads} OpenMP threads differ from 1");
        }
    }
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let compiled = program.compile_cpu("causal_attention", &CpuOptions { threads: 3 }).expect("compiles");
                for _ in 0..20 {
                    assert_eq!(compiled.run_tensors(&inputs, &dims).expect("runs"), want, "concurrent OpenMP teams differ from 1 thread");
                }
            });
        }
    });
    // Back to attnc's own pool.
    openmp::share(None).expect("always possible");
    assert_eq!(openmp::shared_path(), None);
    let compiled = program.compile_cpu("causal_attention", &CpuOptions { threads: 3 }).expect("compiles");
    assert_eq!(compiled.run_tensors(&inputs, &dims).expect("runs"), want);
    drop(gomp);
}
