//! The example programs of attnc (`examples/*.attn`) and runnable examples of its Rust API.
//!
//! - `tests/snapshot_your_model.rs`: how to snapshot-test the IR attnc emits for your own model
//!   with insta (`attn_runtime::emit`).
//!
//! This crate has no code of its own.
