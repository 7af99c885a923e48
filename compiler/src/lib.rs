//! attnc's compiler: the graph IR ([`ir`]), the lowering of checked `.attn` programs into it,
//! and the reference interpreter that defines what every IR program computes.

pub mod ir;
