//! Front end of attnc: the `.attn` language's lexer ([`token`]), parser ([`parse`]), syntax tree
//! ([`ast`]) and diagnostics ([`Diagnostic`]).
//!
//! This crate knows nothing of the IR or any backend. It never panics on input: bad bytes become
//! error tokens, bad syntax becomes diagnostics, and the parser recovers to report several errors.

pub mod ast;
mod diagnostic;
mod parser;
mod print;
mod span;
pub mod token;

pub use diagnostic::{Diagnostic, Label, Severity, render_all};
pub use parser::{codes, parse};
pub use span::{Span, line_col};
