//! The corpus of bad programs: each file's rendered diagnostics (as `attnc check` prints them,
//! without colour) is a snapshot. Every file must produce at least one error. The corpus of
//! accepted programs with warnings likewise snapshots their warnings.

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
        match attn_compiler::check(&source) {
            Ok(_) => snaps.fail(format!("{file_name}: compiled, but it is in the error corpus")),
            Err(diags) => snaps.check(path, "diagnostics", &render_diagnostics(&diags, &file_name, &source, false)),
        }
    }
    snaps.finish();
}

#[test]
fn warned_programs() {
    let files = attn_files(&repo_root().join("tests/cases/warnings"));
    assert!(!files.is_empty(), "the warning corpus is missing");
    let mut snaps = Snapshots::default();
    for path in &files {
        let source = std::fs::read_to_string(path).expect("readable case");
        let file_name = format!("tests/cases/warnings/{}", path.file_name().and_then(|n| n.to_str()).unwrap_or("?"));
        match attn_compiler::check(&source) {
            Ok(checked) if checked.warnings.is_empty() => snaps.fail(format!("{file_name}: no warnings, but it is in the warning corpus")),
            Ok(checked) => snaps.check(path, "warnings", &render_diagnostics(&checked.warnings, &file_name, &source, false)),
            Err(diags) => snaps.fail(format!("{file_name}: rejected: {}", diags[0].message)),
        }
    }
    snaps.finish();
}
