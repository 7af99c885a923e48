//! Snapshots stored beside their input: `<dir>/snapshots/<stem>.<stage>.snap`.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

/// Collects snapshot mismatches over many files, so one run reports (and writes `.snap.new`
/// for) all of them instead of stopping at the first.
#[derive(Default)]
pub struct Snapshots {
    failures: Vec<String>,
}

impl Snapshots {
    /// Compares `text` with the snapshot of `input`'s `stage`.
    pub fn check(&mut self, input: &Path, stage: &str, text: &str) {
        let dir = input.parent().unwrap_or(Path::new(".")).join("snapshots");
        let stem = input.file_stem().and_then(|s| s.to_str()).unwrap_or("input").to_string();
        let mut settings = insta::Settings::clone_current();
        settings.set_snapshot_path(dir);
        settings.set_prepend_module_to_snapshot(false);
        settings.set_omit_expression(true);
        settings.set_input_file(input);
        let name = format!("{stem}.{stage}");
        let result = catch_unwind(AssertUnwindSafe(|| settings.bind(|| insta::assert_snapshot!(name.clone(), text))));
        if result.is_err() {
            self.failures.push(name);
        }
    }

    /// Records a failure that is not a snapshot mismatch.
    pub fn fail(&mut self, what: String) {
        self.failures.push(what);
    }

    /// Panics listing every failure, if any.
    pub fn finish(self) {
        assert!(self.failures.is_empty(), "{} filetest failure(s):\n  {}", self.failures.len(), self.failures.join("\n  "));
    }
}
