//! The example programs of attnc (`examples/*.attn`) and runnable examples of its Rust API.
//!
//! - `tests/snapshot_your_model.rs`: how to snapshot-test the IR attnc emits for your own model
//!   with insta (`attn_runtime::emit`).
//! - `embed.rs`: compile once, inspect entry points, run many times on borrowed buffers
//!   (`cargo run --release -p attn-examples --example embed`).
//!
//! This crate has no code of its own.
