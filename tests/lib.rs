//! Shared helpers of attnc's tests (the filetests here, and the unit and integration tests of
//! every crate, which take this crate as a dev-dependency): where the data lives, which checks a
//! file asks for, numeric comparison against the reference interpreter, and whether to run the
//! exhaustive test matrices.

use std::path::{Path, PathBuf};

/// Whether the exhaustive test matrices run (`ATTNC_TEST_FULL=1`, which CI sets): every head
/// width, sequence length and architecture of the matrices that `cargo test` otherwise samples,
/// each case still checked once by default.
pub fn full_matrix() -> bool {
    std::env::var("ATTNC_TEST_FULL").is_ok_and(|v| v == "1" || v == "true")
}

/// `items` for the exhaustive matrices, else the ones `sample` keeps (by position).
pub fn matrix<T>(items: impl IntoIterator<Item = T>, sample: impl Fn(usize) -> bool) -> Vec<T> {
    let full = full_matrix();
    items.into_iter().enumerate().filter(|(n, _)| full || sample(*n)).map(|(_, x)| x).collect()
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map_or_else(|| PathBuf::from(".."), Path::to_path_buf)
}

/// Every `.attn` file directly in `dir`, sorted by name.
pub fn attn_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(Result::ok).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "attn")).collect())
        .unwrap_or_default();
    files.sort();
    files
}

/// The checks a filetest asks for: the words after `# check:` in its header, or `default`.
pub fn checks(source: &str, default: &[&str]) -> Vec<String> {
    source
        .lines()
        .take_while(|l| l.starts_with('#') || l.trim().is_empty())
        .find_map(|l| l.strip_prefix("# check:"))
        .map(|rest| rest.split_whitespace().map(str::to_string).collect())
        .unwrap_or_else(|| default.iter().map(|s| s.to_string()).collect())
}

/// The largest relative error `|a - b| / max(|b|, floor)` over two equally long slices, with
/// matching infinities and NaNs counted as equal, and a NaN against a number (or a number
/// against a NaN) as an infinite error.
pub fn max_rel_error(actual: &[f64], expected: &[f64], floor: f64) -> f64 {
    assert_eq!(actual.len(), expected.len(), "length mismatch");
    actual.iter().zip(expected).map(|(a, b)| element_error(*a, *b, b.abs().max(floor))).fold(0.0, f64::max)
}

/// `|a - b| / scale`: 0 where `a` and `b` are equal or both NaN, infinite where exactly one is
/// NaN (`f64::max` would otherwise drop such an element from a maximum).
fn element_error(a: f64, b: f64, scale: f64) -> f64 {
    if a == b || (a.is_nan() && b.is_nan()) {
        0.0
    } else if a.is_nan() || b.is_nan() {
        f64::INFINITY
    } else {
        (a - b).abs() / scale
    }
}

/// Tolerance for comparing two f32 computations of the same program in different orders (fused
/// against unfused, a backend against the interpreter): normwise relative error, see
/// [`normwise_error`].
pub const F32_TOLERANCE: f64 = 1e-4;

/// `max |a - b| / max |b|`: the error relative to the output's magnitude. Element-wise relative
/// error is meaningless for outputs near zero (a weighted sum of random values), which is where
/// f32 results computed in different orders differ most in relative terms.
pub fn normwise_error(actual: &[f64], expected: &[f64]) -> f64 {
    assert_eq!(actual.len(), expected.len(), "length mismatch");
    let scale = expected.iter().filter(|x| x.is_finite()).fold(0.0f64, |m, x| m.max(x.abs()));
    let diff = actual.iter().zip(expected).map(|(a, b)| element_error(*a, *b, 1.0)).fold(0.0f64, f64::max);
    if diff == 0.0 { 0.0 } else { diff / scale.max(f64::MIN_POSITIVE) }
}
