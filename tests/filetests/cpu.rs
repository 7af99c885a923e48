//! The Cranelift IR the CPU target generates, snapshotted for a few examples beside them
//! (`examples/snapshots/<name>.clif.snap`). The list is independent of `# check:` headers: the
//! text is long and changes whenever the code generator does, so only a plain and a masked,
//! modified attention are pinned. (Numerical checks of the CPU target against the interpreter
//! live in `runtime/tests/cpu.rs`.)

use crate::snapshot::Snapshots;
use attn_runtime::{Stage, emit};
use attn_tests::repo_root;

/// Examples whose generated code is snapshotted: plain attention, and causal attention with a
/// position-dependent score modification (ALiBi).
const CLIF_SNAPSHOTS: &[&str] = &["sdpa", "alibi"];

#[test]
fn generated_code_snapshots() {
    let mut snaps = Snapshots::default();
    for name in CLIF_SNAPSHOTS {
        let path = repo_root().join("examples").join(format!("{name}.attn"));
        let source = std::fs::read_to_string(&path).expect("readable example");
        match emit(&source, Stage::Clif) {
            Ok(text) => {
                assert!(text.contains("function %"), "{name}: no function in the listing");
                snaps.check(&path, "clif", &text);
            }
            Err(d) => snaps.fail(format!("{name}: {}", d[0])),
        }
    }
    snaps.finish();
}
