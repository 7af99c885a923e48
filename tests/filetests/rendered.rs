//! The code each renderer makes, snapshotted beside a few examples
//! (`examples/snapshots/<name>.clif.snap`, `.cuda.snap`). The lists are independent of `# check:`
//! headers: the text is long and changes whenever a renderer does, so only a few are pinned.
//! (Numerical checks live with the backends: the CPU target against the interpreter in
//! `runtime/tests/cpu.rs`; NVRTC compiles and host-emulated runs of every example's kernels in
//! `cuda/src/` (`tests.rs`, `emulate_tests.rs`).)

use crate::snapshot::Snapshots;
use attn_runtime::{Stage, emit};
use attn_tests::repo_root;

/// The `stage` text of each of `names`' examples, snapshotted as `.<ext>.snap`; each must
/// contain every string of `expect` (with why).
fn rendered_snapshots(stage: Stage, ext: &str, names: &[&str], expect: &[(&str, &str)]) {
    let mut snaps = Snapshots::default();
    for name in names {
        let path = repo_root().join("examples").join(format!("{name}.attn"));
        let source = std::fs::read_to_string(&path).expect("readable example");
        match emit(&source, stage) {
            Ok(text) => {
                for (needle, what) in expect {
                    assert!(text.contains(needle), "{name}: {what}");
                }
                snaps.check(&path, ext, &text);
            }
            Err(d) => snaps.fail(format!("{name}: {}", d[0])),
        }
    }
    snaps.finish();
}

/// The Cranelift IR of plain attention, and of causal attention with a position-dependent score
/// modification (ALiBi).
#[test]
fn generated_code_snapshots() {
    rendered_snapshots(Stage::Clif, "clif", &["sdpa", "alibi"], &[("function %", "no function in the listing")]);
}

/// The CUDA source (from the optimised IR) of plain attention, causal attention with ALiBi,
/// grouped-query attention, and single-token decode (the split-KV kernel and its merge).
#[test]
fn generated_cuda_snapshots() {
    rendered_snapshots(
        Stage::Cuda,
        "cuda",
        &["sdpa", "alibi", "gqa", "decode"],
        &[("ATTNC_KERNEL void", "no kernel in the source"), ("flash", "the attention was not fused into a flash kernel")],
    );
}
