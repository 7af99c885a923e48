//! The corpus of bad programs: each file's rendered diagnostics (as `attnc check` prints them,
//! without colour) is a snapshot. Every file must produce at least one error.

use crate::snapshot::Snapshots;
use attn_runtime::report::render_diagnostics;
use attn_tests::{attn_files, repo_root};

#[test]
fn bad_programs() {
    let files = attn_files(&repo_root().join("tests/cases/errors"));
    assert!(files.len() >= 20, "the error corpus is missing files");
    let mut snaps = Snapshots::default();
    for path in &files {
        let source = std::fs::read_to_string(path).expect("readable case");
        let file_name = format!("tests/cases/errors/{}", path.file_name().and_then(|n| n.to_str()).unwrap_or("?"));
        match attn_compiler::compile(&source) {
            Ok(_) => snaps.fail(format!("{file_name}: compiled, but it is in the error corpus")),
            Err(diags) => snaps.check(path, "diagnostics", &render_diagnostics(&diags, &file_name, &source, false)),
        }
    }
    snaps.finish();
}
