//! [`Op::Paged`] written with gathers: the one expansion that the schedule uses where no flash
//! op reads the pages in place, and that the derivative rule differentiates (a gather's
//! gradient is a scatter-add into its table).
//!
//! `paged(pages, table)` with `pages` `[NP, P, R…]` and `table` `[B, MP]` is
//! `reshape(gather(pages, page, row, r…), [B, MP·P, R…])` where, over `[B, MP, P, R…]`,
//! `page = clamp(table[b, m], 0, NP − 1)`, `row = p` and `r…` are iotas: no division, so
//! exact for any size.

use super::{BinaryOp, DType, Dim, Op, TensorType, Value};

/// Adds one node (op, operands, declared type) to a graph under construction.
pub trait AddNode {
    /// The error of the graph being built.
    type Error;
    /// Adds `op` over `args` (typed by [`super::infer`], with `declared` for the ops that need
    /// it) and returns its value.
    fn node(&mut self, op: Op, args: &[Value], declared: Option<TensorType>) -> Result<Value, Self::Error>;
}

/// The index tensors of the gather over `pages` (typed `pages`) that lays out
/// `paged(pages, table)` (with `table` typed `table`) as `[B, MP, P, R…]`.
pub fn gather_indices<A: AddNode>(g: &mut A, pages: &TensorType, table: (Value, &TensorType)) -> Result<Vec<Value>, A::Error> {
    let (table, tty) = table;
    let rank = pages.rank() + 1;
    let (b, mp) = (tty.shape[0].clone(), tty.shape[1].clone());
    let one = Dim::constant(1);
    // An i32 iota along `axis` of a shape that is 1 elsewhere, `rank` axes.
    let iota = |g: &mut A, axis: usize, size: Dim, rank: usize| {
        let mut shape = vec![one.clone(); rank];
        shape[axis] = size;
        g.node(Op::Iota { axis }, &[], Some(TensorType::new(DType::I32, shape)))
    };
    let bi = iota(g, 0, b.clone(), 2)?;
    let mi = iota(g, 1, mp.clone(), 2)?;
    let page = g.node(Op::Gather, &[table, bi, mi], None)?;
    let zero = g.node(Op::Const(0.0), &[], Some(TensorType::scalar(DType::I32)))?;
    let unit = g.node(Op::Const(1.0), &[], Some(TensorType::scalar(DType::I32)))?;
    let np = g.node(Op::DimValue(pages.shape[0].clone()), &[], None)?;
    let last = g.node(Op::Binary(BinaryOp::Sub), &[np, unit], None)?;
    let page = g.node(Op::Binary(BinaryOp::Max), &[page, zero], None)?;
    let page = g.node(Op::Binary(BinaryOp::Min), &[page, last], None)?;
    let mut shape = vec![b, mp];
    shape.resize(rank, one.clone());
    let page = g.node(Op::Reshape, &[page], Some(TensorType::new(DType::I32, shape)))?;
    let mut idx = vec![page];
    for (k, size) in pages.shape[1..].iter().enumerate() {
        idx.push(iota(g, k + 2, size.clone(), rank)?);
    }
    Ok(idx)
}

/// The shape of the gather laid out by [`gather_indices`]: `[B, MP, P, R…]`.
pub fn gathered_shape(pages: &TensorType, table: &TensorType) -> Vec<Dim> {
    let mut shape = vec![table.shape[0].clone(), table.shape[1].clone()];
    shape.extend(pages.shape[1..].iter().cloned());
    shape
}

/// `paged(pages, table)` as a reshaped gather ([`gather_indices`]).
pub fn expand<A: AddNode>(
    g: &mut A,
    pages: (Value, &TensorType),
    table: (Value, &TensorType),
    out: &TensorType,
) -> Result<Value, A::Error> {
    let idx = gather_indices(g, pages.1, table)?;
    let mut args = vec![pages.0];
    args.extend(idx);
    let gathered = g.node(Op::Gather, &args, None)?;
    g.node(Op::Reshape, &[gathered], Some(out.clone()))
}
