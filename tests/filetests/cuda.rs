//! The CUDA source the GPU target emits (from the optimised IR), snapshotted beside a few
//! examples (`examples/snapshots/<name>.cuda.snap`): plain attention, causal attention with a
//! position-dependent score modification (ALiBi), grouped-query attention, and single-token
//! decode (the split-KV kernel and its merge). NVRTC compiles and host-emulated runs of every
//! example's kernels live in `cuda/src/` (`tests.rs`, `emulate_tests.rs`).

use crate::snapshot::Snapshots;
use attn_runtime::{Stage, emit};
use attn_tests::repo_root;

/// Examples whose generated CUDA is snapshotted.
const CUDA_SNAPSHOTS: &[&str] = &["sdpa", "alibi", "gqa", "decode"];

#[test]
fn generated_cuda_snapshots() {
    let mut snaps = Snapshots::default();
    for name in CUDA_SNAPSHOTS {
        let path = repo_root().join("examples").join(format!("{name}.attn"));
        let source = std::fs::read_to_string(&path).expect("readable example");
        match emit(&source, Stage::Cuda) {
            Ok(text) => {
                assert!(text.contains("ATTNC_KERNEL void"), "{name}: no kernel in the source");
                assert!(text.contains("flash"), "{name}: the attention was not fused into a flash kernel");
                snaps.check(&path, "cuda", &text);
            }
            Err(d) => snaps.fail(format!("{name}: {}", d[0])),
        }
    }
    snaps.finish();
}
