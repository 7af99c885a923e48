//! How to snapshot-test what attnc makes of your own model, with insta.
//!
//! `attn_runtime::emit(source, stage)` returns the canonical text of a stage (the AST, the IR,
//! the optimised IR, ...): stable, diff-friendly, and the same text `attnc build --emit` prints.
//! Snapshot it in your own tests to see in review exactly how a model change (or an attnc
//! upgrade) changes the compiled program.

use attn_runtime::{Stage, emit};

/// A model as a user would keep it in their own repository.
const MY_MODEL: &str = r#"
# Attention with a learned per-head temperature and a causal mask.
fn my_attention(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D], temperature: f32[H]) -> f32[B, H, S, D] {
    let s = q @ k.T / sqrt(D)
    let (b, h, i, j) = indices(s)
    let s = s * temperature[h]
    return softmax(where(j <= i, s, -inf), axis = -1) @ v
}
"#;

#[test]
fn my_model_ir() {
    let ir = emit(MY_MODEL, Stage::Ir).expect("the model compiles");
    insta::assert_snapshot!(ir);
}

/// The optimised IR shows the attention fused into one flash op, with the temperature folded
/// into its score modification and the mask as its predicate.
#[test]
fn my_model_optimized() {
    let opt = emit(MY_MODEL, Stage::Opt).expect("the model compiles");
    assert!(opt.contains("flash["), "attention should fuse:\n{opt}");
    insta::assert_snapshot!(opt);
}
