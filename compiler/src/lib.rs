//! attnc's compiler: the graph IR ([`ir`]), the lowering of checked `.attn` programs into it
//! ([`lower`]), and the reference interpreter ([`interp`]) that defines what every IR program
//! computes. It does no IO.

pub mod interp;
pub mod ir;
pub mod lower;
pub mod tensor;

pub use attn_dsl::Diagnostic;
