//! attnc's filetests: the one integration-test binary.
//!
//! - `examples`: every `examples/*.attn` — AST, IR, optimised IR and schedule text as insta
//!   snapshots beside the file, IR text round trip, verifier, and a run through the reference
//!   interpreter;
//! - `rendered`: the Cranelift IR and the CUDA source the renderers make for a few examples,
//!   as snapshots;
//! - `diagnostics`: every `tests/cases/errors/*.attn` — the rendered diagnostics as snapshots;
//! - `numerics`: the interpreter against values derived by hand;
//! - `optimizer`: optimised graphs agree with the originals, at odd sizes and on random
//!   score-modification and mask chains;
//! - `robustness`: random bytes and token soups never panic the front end.
//!
//! Bless new snapshots with `cargo insta review` (or `INSTA_UPDATE=always cargo test`).

mod diagnostics;
mod examples;
mod numerics;
mod optimizer;
mod rendered;
mod robustness;
mod snapshot;
