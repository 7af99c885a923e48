//! Code generation checks that need no JIT: every example lowers to functions that pass
//! Cranelift's verifier, before and after optimisation.

use super::*;

fn examples() -> Vec<(String, String)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut out: Vec<(String, String)> = std::fs::read_dir(&dir)
        .expect("examples dir")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "attn"))
        .map(|p| (p.display().to_string(), std::fs::read_to_string(&p).expect("readable")))
        .collect();
    out.sort();
    out
}

#[test]
fn every_example_generates_valid_functions() {
    for (name, src) in examples() {
        let compiled = crate::compile(&src).unwrap_or_else(|_| panic!("{name} compiles"));
        let text = emit_text(&compiled.module).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(text.contains("function %"), "{name}");
        let (opt, _) = crate::opt::optimize_module(&compiled.module);
        emit_text(&opt).unwrap_or_else(|e| panic!("{name} (optimised): {e}"));
    }
}

/// The kernel kinds of a graph's steps, and how many temporaries the plan holds.
fn plan_of(src: &str, optimise: bool) -> (Vec<&'static str>, usize) {
    let compiled = crate::compile(src).expect("compiles");
    let module = if optimise { crate::opt::optimize_module(&compiled.module).0 } else { compiled.module };
    let g = module.graphs.last().expect("a graph");
    let m = compile(g, &TEXT_FEATURES).expect("generates");
    let kinds = m.plan.steps.iter().map(|s| kernel_name(&s.kernel)).collect();
    let temps = m.plan.buffers.iter().filter(|b| b.kind == BufferKind::Temp).count();
    (kinds, temps)
}

#[test]
fn fused_attention_is_one_kernel_without_temporaries() {
    let src = "fn f(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D]) -> f32[B, H, S, D] {
        return softmax(q @ k.T / sqrt(D), axis = -1) @ v }";
    // The query scale folds into the Q·Kᵀ product: no scaled copy of q.
    assert_eq!(plan_of(src, true), (vec!["flash", "flash_merge"], 0));
    // Unfused: matmul with K read transposed in place, the scale fused into the softmax input.
    assert_eq!(plan_of(src, false), (vec!["matmul", "elementwise", "softmax", "matmul"], 3));
}

#[test]
fn element_wise_chains_fuse_and_layout_ops_are_views() {
    let src = "fn f(x: f32[N, M], y: f32[M]) -> f32[M, N] {
        return transpose(exp(x * 2.0 + y) - 1.0, 0, 1) }";
    let (kinds, _) = plan_of(src, false);
    // One loop for the whole chain, and the transpose read as a strided view by the output copy.
    assert_eq!(kinds, ["elementwise", "elementwise"]);
}

#[test]
fn score_scales_split_from_positions() {
    use crate::ir::{ScoreExpr, parse_expr};
    let e = |t: &str| parse_expr(t, 4).expect("parses");
    let (s, a) = lower::split_scale(&e("s * 0.125"));
    assert_eq!((s, a), (ScoreExpr::Score, Some(ScoreExpr::Float(0.125))));
    let (s, a) = lower::split_scale(&e("s / dim(D)"));
    assert_eq!(s, ScoreExpr::Score);
    assert!(a.is_some());
    // A position-dependent factor stays in the per-element code.
    let (s, a) = lower::split_scale(&e("s * (j - i)"));
    assert_eq!((s, a), (e("s * (j - i)"), None));
}

#[test]
fn separable_score_terms_split_from_the_rest() {
    use crate::ir::parse_expr;
    let e = |t: &str| parse_expr(t, 4).expect("parses");
    let show = |x: &crate::ir::ScoreExpr| crate::ir::ShowExpr { expr: x, rank: 4 }.to_string();
    let split = |t: &str| score::separate(&e(t), 4).map(|x| (show(&x.rest), show(&x.sep)));
    // ALiBi: the bias term is separable as written (slope · j − slope · i).
    assert_eq!(split("s + x0[h] * (j - i)"), Some(("s".into(), "x0[h] * (j - i)".into())));
    // Key-padding bias and a row-only term; the relative-position gather is not separable.
    assert_eq!(split("x0[b, j] - s * 2.0 + i"), Some(("-(s * 2.0)".into(), "x0[b, j] + i".into())));
    assert_eq!(split("s + x0[h, min(max(j - i, -16), 16) + 16]"), None);
    assert_eq!(split("s + (j - i) * (j - i)"), None);
    assert_eq!(split("s"), None);
    // Dividing by a position-free factor keeps separability; by a position, not.
    assert!(split("s + (j - i) / dim(S)").is_some());
    assert_eq!(split("s + (j - i) / j"), None);
}

#[test]
fn soft_capping_stages_tanh() {
    use crate::ir::parse_expr;
    let e = |t: &str| parse_expr(t, 4).expect("parses");
    assert_eq!(score::tanh_staged(&e("50.0 * tanh(s)")), Some(e("50.0 * s")));
    assert_eq!(score::tanh_staged(&e("tanh(s) + x0[h] * j")), Some(e("s + x0[h] * j")));
    // The raw score read elsewhere, or tanh of something else: no staging.
    assert_eq!(score::tanh_staged(&e("tanh(s) + s")), None);
    assert_eq!(score::tanh_staged(&e("tanh(s * 2.0)")), None);
    assert_eq!(score::tanh_staged(&e("s")), None);
}
