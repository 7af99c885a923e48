//! Built-in functions: element-wise math, reductions, normalisations, shape manipulation and
//! positions. `x.f(a)` arrives here as `f(x, a)`.

use super::{Cx, Frame, LResult, Reported, Val, codes, literal};
use crate::ir::{BinaryOp, DType, Dim, Op, ReduceOp, ScanOp, TensorType, UnaryOp, Value};
use attn_dsl::ast::{Arg, Expr, ExprKind, Ident};
use attn_dsl::{Diagnostic, Span};

/// The arguments of one call, split into positional and keyword ones.
pub(super) struct Call<'e> {
    pub(super) name: &'e str,
    pub(super) pos: Vec<&'e Expr>,
    named: Vec<(&'e Ident, &'e Expr)>,
    pub(super) span: Span,
}

impl<'e> Call<'e> {
    pub(super) fn kw(&self, key: &str) -> Option<&'e Expr> {
        self.named.iter().find(|(k, _)| k.name == key).map(|(_, e)| *e)
    }
}

/// Every built-in, for "unknown function" help.
pub(crate) const BUILTINS: &[&str] = &[
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "tanh",
    "sigmoid",
    "relu",
    "gelu",
    "silu",
    "elu",
    "abs",
    "floor",
    "sin",
    "cos",
    "neg",
    "min",
    "max",
    "minimum",
    "maximum",
    "pow",
    "atan2",
    "clamp",
    "where",
    "cast",
    "sum",
    "mean",
    "logsumexp",
    "softmax",
    "cumsum",
    "cumprod",
    "scan",
    "layernorm",
    "rmsnorm",
    "transpose",
    "permute",
    "reshape",
    "unsqueeze",
    "squeeze",
    "concat",
    "split_heads",
    "merge_heads",
    "take_along",
    "argsort",
    "scatter_add",
    "paged",
    "dropout",
    "sort",
    "topk",
    "matmul",
    "indices",
    "arange",
    "stack",
    "broadcast_to",
    "expand",
];

impl Cx<'_, '_> {
    /// Lowers a call to a built-in; `receiver` is the `x` of `x.f(...)`.
    pub(crate) fn builtin(&mut self, frame: &Frame, name: &Ident, receiver: Vec<&Expr>, args: &[Arg], span: Span) -> LResult<Val> {
        let mut call = Call { name: &name.name, pos: receiver, named: Vec::new(), span };
        for a in args {
            match &a.name {
                Some(k) => call.named.push((k, &a.value)),
                None => call.pos.push(&a.value),
            }
        }
        let n = name.name.as_str();
        if let Some(u) = UnaryOp::from_name(n).filter(|u| *u != UnaryOp::Not) {
            self.arity(&call, 1, 1, &[])?;
            let x = self.tensor(frame, call.pos[0])?;
            return self.add(Op::Unary(u), None, &[(x, call.pos[0].span)], span).map(Val::T);
        }
        if n == "indices" {
            return self.indices(frame, &call);
        }
        if n == "topk" {
            return self.topk(frame, &call);
        }
        let families = [Self::arith_builtin, Self::norm_builtin, Self::shape_builtin, Self::construct_builtin, Self::order_builtin];
        for family in families {
            if let Some(v) = family(self, frame, &call)? {
                return Ok(Val::T(v));
            }
        }
        Err(self.unknown_function(name))
    }

    /// Element-wise maths, reductions, products, `where` and `cast`.
    fn arith_builtin(&mut self, frame: &Frame, call: &Call<'_>) -> LResult<Option<Value>> {
        let (n, span) = (call.name, call.span);
        Ok(Some(match n {
            "min" | "max" if call.pos.len() == 2 => {
                self.arity(call, 2, 2, &[])?;
                let op = if n == "min" { BinaryOp::Min } else { BinaryOp::Max };
                self.binary(frame, call, op)?
            }
            "min" | "max" | "sum" | "mean" | "logsumexp" => {
                let op = match n {
                    "min" => ReduceOp::Min,
                    "max" => ReduceOp::Max,
                    "sum" => ReduceOp::Sum,
                    "logsumexp" => ReduceOp::LogSumExp,
                    _ => ReduceOp::Mean,
                };
                self.reduce(frame, call, op)?
            }
            "minimum" | "maximum" | "pow" | "atan2" => {
                self.arity(call, 2, 2, &[])?;
                let op = match n {
                    "minimum" => BinaryOp::Min,
                    "maximum" => BinaryOp::Max,
                    "atan2" => BinaryOp::Atan2,
                    _ => BinaryOp::Pow,
                };
                self.binary(frame, call, op)?
            }
            "matmul" => {
                self.arity(call, 2, 2, &[])?;
                let (a, b) = (self.tensor(frame, call.pos[0])?, self.tensor(frame, call.pos[1])?);
                self.add(Op::MatMul, None, &[(a, call.pos[0].span), (b, call.pos[1].span)], span)?
            }
            "clamp" => {
                self.arity(call, 3, 3, &[])?;
                let x = self.tensor(frame, call.pos[0])?;
                let lo = self.tensor(frame, call.pos[1])?;
                let hi = self.tensor(frame, call.pos[2])?;
                let m = self.add(Op::Binary(BinaryOp::Max), None, &[(x, call.pos[0].span), (lo, call.pos[1].span)], span)?;
                self.add(Op::Binary(BinaryOp::Min), None, &[(m, span), (hi, call.pos[2].span)], span)?
            }
            "where" => {
                self.arity(call, 3, 3, &[])?;
                let mut ops = Vec::new();
                for e in &call.pos {
                    ops.push((self.tensor(frame, e)?, e.span));
                }
                self.add(Op::Select, None, &ops, span)?
            }
            "cast" => {
                self.arity(call, 2, 2, &[])?;
                let x = self.tensor(frame, call.pos[0])?;
                let dtype = match &call.pos[1].kind {
                    ExprKind::Name(d) => self.dtype(&Ident { name: d.clone(), span: call.pos[1].span })?,
                    _ => return Err(self.bad_args(call, "the second argument of `cast` is an element type, e.g. `cast(x, f16)`")),
                };
                let shape = self.ty(x).shape.clone();
                self.add(Op::Cast, Some(TensorType::new(dtype, shape)), &[(x, call.pos[0].span)], span)?
            }
            _ => return Ok(None),
        }))
    }

    /// `take_along(x, idx, axis)`: a gather with `idx` along `axis` and positions elsewhere.
    fn take_along(&mut self, call: &Call<'_>, (x, xspan): (Value, Span), (idx, ispan): (Value, Span), axis: usize) -> LResult<Value> {
        let (xt, it) = (self.ty(x).clone(), self.ty(idx).clone());
        if it.rank() != xt.rank() {
            let msg = format!("the index {it} must have as many axes as {xt}");
            return Err(self.bad_args(call, &msg));
        }
        let one = Dim::constant(1);
        let mut operands = vec![(x, xspan)];
        for k in 0..xt.rank() {
            if k == axis {
                operands.push((idx, ispan));
                continue;
            }
            let (a, b) = (&xt.shape[k], &it.shape[k]);
            let n = if b == &one { a.clone() } else { b.clone() };
            if a != b && a != &one && b != &one {
                let msg = format!("axis {k} of the index ({b}) does not broadcast with that of {xt} ({a})");
                return Err(self.bad_args(call, &msg));
            }
            let mut shape = vec![one.clone(); xt.rank()];
            shape[k] = n;
            let iota = self.add(Op::Iota { axis: k }, Some(TensorType::new(DType::I32, shape)), &[], call.span)?;
            operands.push((iota, call.span));
        }
        self.add(Op::Gather, None, &operands, call.span)
    }

    /// `topk(x, k, axis = -1)`: the `k` largest elements along `axis` and their indices (largest
    /// first; ties by index), as a pair.
    fn topk(&mut self, frame: &Frame, call: &Call<'_>) -> LResult<Val> {
        self.arity(call, 2, 3, &["axis"])?;
        let x = self.tensor(frame, call.pos[0])?;
        let xt = self.ty(x).clone();
        let axis = match call.pos.get(2).copied().or(call.kw("axis")) {
            Some(e) => self.axis(frame, e, &xt)?,
            None => self.last_axis(&xt, call.span)?,
        };
        let size = xt.shape[axis].clone();
        let k = self.bound(call.pos[1], &size, &frame.dims)?;
        if let (Some(k), Some(n)) = (k.as_const(), size.as_const())
            && (k < 0 || k > n)
        {
            let msg = format!("`topk` asks for {k} of the {n} elements along axis {axis}");
            return Err(self.bad_args(call, &msg));
        }
        let order = self.add(Op::ArgSort { axis, descending: true }, None, &[(x, call.pos[0].span)], call.span)?;
        let top = if k == size {
            order
        } else {
            self.add(Op::Slice { axis, start: Dim::constant(0), end: k }, None, &[(order, call.span)], call.span)?
        };
        let values = self.take_along(call, (x, call.pos[0].span), (top, call.span), axis)?;
        Ok(Val::Tuple(vec![values, top]))
    }

    /// Softmax, running accumulations (scans) and the normalisations.
    fn norm_builtin(&mut self, frame: &Frame, call: &Call<'_>) -> LResult<Option<Value>> {
        let (n, span) = (call.name, call.span);
        Ok(Some(match n {
            "softmax" => {
                self.arity(call, 1, 2, &["axis"])?;
                let x = self.tensor(frame, call.pos[0])?;
                let ty = self.ty(x).clone();
                let axis = match call.pos.get(1).copied().or(call.kw("axis")) {
                    Some(e) => self.axis(frame, e, &ty)?,
                    None => self.last_axis(&ty, span)?,
                };
                self.add(Op::Softmax { axis }, None, &[(x, call.pos[0].span)], span)?
            }
            "cumsum" | "cumprod" | "scan" => {
                let op = ScanOp::from_name(n).ok_or_else(|| self.bad_args(call, "unknown scan"))?;
                let n_in = if op == ScanOp::Linear { 2 } else { 1 };
                self.arity(call, n_in, n_in + 1, &["axis", "reverse"])?;
                let mut ops = Vec::new();
                for e in &call.pos[..n_in] {
                    ops.push((self.tensor(frame, e)?, e.span));
                }
                // The axis counts in the result's shape (for `scan`, the broadcast of a and b).
                let shape = if op == ScanOp::Linear {
                    let (a, b) = (self.ty(ops[0].0).shape.clone(), self.ty(ops[1].0).shape.clone());
                    crate::ir::broadcast_shapes(&a, &b).unwrap_or(a)
                } else {
                    self.ty(ops[0].0).shape.clone()
                };
                let ty = TensorType::new(self.ty(ops[0].0).dtype, shape);
                let axis = match call.pos.get(n_in).copied().or(call.kw("axis")) {
                    Some(e) => self.axis(frame, e, &ty)?,
                    None => self.last_axis(&ty, span)?,
                };
                let reverse = self.flag(call, "reverse")?;
                self.add(Op::Scan { op, axis, reverse }, None, &ops, span)?
            }
            "layernorm" | "rmsnorm" => {
                let n_in = if n == "layernorm" { 3 } else { 2 };
                self.arity(call, n_in, n_in, &["eps"])?;
                let default = if n == "layernorm" { 1e-5 } else { 1e-6 };
                let eps = match call.kw("eps") {
                    Some(e) => literal(e).map(|(v, _)| v).ok_or_else(|| self.bad_args(call, "`eps` must be a number literal"))?,
                    None => default,
                };
                let mut ops = Vec::new();
                for e in &call.pos {
                    ops.push((self.tensor(frame, e)?, e.span));
                }
                let op = if n == "layernorm" { Op::LayerNorm { eps } } else { Op::RmsNorm { eps } };
                self.add(op, None, &ops, span)?
            }
            _ => return Ok(None),
        }))
    }

    /// Gathers along an axis, scatter-adds, paged reads and sorts.
    fn order_builtin(&mut self, frame: &Frame, call: &Call<'_>) -> LResult<Option<Value>> {
        let (n, span) = (call.name, call.span);
        Ok(Some(match n {
            "take_along" => {
                self.arity(call, 2, 3, &["axis"])?;
                let (x, idx) = (self.tensor(frame, call.pos[0])?, self.tensor(frame, call.pos[1])?);
                let xt = self.ty(x).clone();
                let axis_expr =
                    call.pos.get(2).copied().or(call.kw("axis")).ok_or_else(|| self.bad_args(call, "`take_along` needs `axis`"))?;
                let axis = self.axis(frame, axis_expr, &xt)?;
                self.take_along(call, (x, call.pos[0].span), (idx, call.pos[1].span), axis)?
            }
            "scatter_add" => {
                self.arity(call, 3, 4, &["axis"])?;
                let mut ops = Vec::new();
                for e in &call.pos[..3] {
                    ops.push((self.tensor(frame, e)?, e.span));
                }
                let bt = self.ty(ops[0].0).clone();
                let axis_expr =
                    call.pos.get(3).copied().or(call.kw("axis")).ok_or_else(|| self.bad_args(call, "`scatter_add` needs `axis`"))?;
                let axis = self.axis(frame, axis_expr, &bt)?;
                self.add(Op::ScatterAdd { axis }, None, &ops, span)?
            }
            "paged" => {
                self.arity(call, 2, 2, &[])?;
                let mut ops = Vec::new();
                for e in &call.pos[..2] {
                    ops.push((self.tensor(frame, e)?, e.span));
                }
                self.add(Op::Paged, None, &ops, span)?
            }
            // `dropout(x, seed, p = rate)`: the rate a literal in [0, 1), the seed an i32 scalar.
            "dropout" => {
                self.arity(call, 2, 3, &["p"])?;
                let rate_expr =
                    call.pos.get(2).copied().or(call.kw("p")).ok_or_else(|| self.bad_args(call, "`dropout` needs its rate `p`"))?;
                let rate = literal(rate_expr)
                    .map(|(v, _)| v)
                    .filter(|v| (0.0..1.0).contains(v))
                    .ok_or_else(|| self.bad_args(call, "the dropout rate `p` must be a number literal in [0, 1)"))?;
                let mut ops = Vec::new();
                for e in &call.pos[..2] {
                    ops.push((self.tensor(frame, e)?, e.span));
                }
                self.add(Op::Dropout { rate }, None, &ops, span)?
            }
            "argsort" | "sort" => {
                self.arity(call, 1, 2, &["axis", "descending"])?;
                let x = self.tensor(frame, call.pos[0])?;
                let xt = self.ty(x).clone();
                let axis = match call.pos.get(1).copied().or(call.kw("axis")) {
                    Some(e) => self.axis(frame, e, &xt)?,
                    None => self.last_axis(&xt, span)?,
                };
                let descending = self.flag(call, "descending")?;
                let order = self.add(Op::ArgSort { axis, descending }, None, &[(x, call.pos[0].span)], span)?;
                if n == "sort" { self.take_along(call, (x, call.pos[0].span), (order, span), axis)? } else { order }
            }
            _ => return Ok(None),
        }))
    }

    /// Axis and shape changes: transposes, reshapes, concatenation, heads.
    fn shape_builtin(&mut self, frame: &Frame, call: &Call<'_>) -> LResult<Option<Value>> {
        let (n, span) = (call.name, call.span);
        Ok(Some(match n {
            "transpose" => {
                self.arity(call, 3, 3, &[])?;
                let x = self.tensor(frame, call.pos[0])?;
                let ty = self.ty(x).clone();
                let (a, b) = (self.axis(frame, call.pos[1], &ty)?, self.axis(frame, call.pos[2], &ty)?);
                let mut perm: Vec<usize> = (0..ty.rank()).collect();
                perm.swap(a, b);
                self.add(Op::Transpose { perm }, None, &[(x, call.pos[0].span)], span)?
            }
            "permute" => {
                self.arity(call, 2, 2, &[])?;
                let x = self.tensor(frame, call.pos[0])?;
                let ty = self.ty(x).clone();
                let perm = self.axis_list(frame, call.pos[1], &ty)?;
                self.add(Op::Transpose { perm }, None, &[(x, call.pos[0].span)], span)?
            }
            "reshape" => {
                self.arity(call, 2, 2, &[])?;
                let x = self.tensor(frame, call.pos[0])?;
                let shape = self.shape_arg(frame, call, "`reshape(x, [B, S, H, Dh])`")?;
                let dtype = self.ty(x).dtype;
                self.add(Op::Reshape, Some(TensorType::new(dtype, shape)), &[(x, call.pos[0].span)], span)?
            }
            "unsqueeze" | "squeeze" => {
                self.arity(call, 2, 2, &[])?;
                let x = self.tensor(frame, call.pos[0])?;
                let ty = self.ty(x).clone();
                let mut shape = ty.shape.clone();
                if n == "unsqueeze" {
                    let widened = TensorType::new(ty.dtype, vec![Dim::constant(1); ty.rank() + 1]);
                    let axis = self.axis(frame, call.pos[1], &widened)?;
                    shape.insert(axis, Dim::constant(1));
                } else {
                    let axis = self.axis(frame, call.pos[1], &ty)?;
                    if shape[axis] != Dim::constant(1) {
                        return Err(self.bad_args(call, &format!("axis {axis} of {ty} has size {}, not 1", shape[axis])));
                    }
                    shape.remove(axis);
                }
                self.add(Op::Reshape, Some(TensorType::new(ty.dtype, shape)), &[(x, call.pos[0].span)], span)?
            }
            "concat" => {
                self.arity(call, 1, 1, &["axis"])?;
                let ops = self.tensor_list(frame, call, "concat([a, b], axis = 1)")?;
                let ty = self.ty(ops[0].0).clone();
                let axis = match call.kw("axis") {
                    Some(e) => self.axis(frame, e, &ty)?,
                    None => return Err(self.bad_args(call, "concat needs `axis = ...`")),
                };
                self.add(Op::Concat { axis }, None, &ops, span)?
            }
            "split_heads" => {
                self.arity(call, 2, 2, &[])?;
                let x = self.tensor(frame, call.pos[0])?;
                let heads = self.dim_expr(call.pos[1], &frame.dims)?;
                self.split_heads(x, call.pos[0].span, heads, span)?
            }
            "merge_heads" => {
                self.arity(call, 1, 1, &[])?;
                let x = self.tensor(frame, call.pos[0])?;
                self.merge_heads(x, call.pos[0].span, span)?
            }
            _ => return Ok(None),
        }))
    }

    /// `indices(x)`: the position along each axis of `x`, one tensor per axis.
    fn indices(&mut self, frame: &Frame, call: &Call<'_>) -> LResult<Val> {
        let span = call.span;
        self.arity(call, 1, 1, &[])?;
        let x = self.tensor(frame, call.pos[0])?;
        let ty = self.ty(x).clone();
        let mut out = Vec::new();
        for axis in 0..ty.rank() {
            let shape = (0..ty.rank()).map(|k| if k == axis { ty.shape[k].clone() } else { Dim::constant(1) }).collect();
            out.push(self.add(Op::Iota { axis }, Some(TensorType::new(DType::I32, shape)), &[], span)?);
        }
        Ok(if out.len() == 1 { Val::T(out[0]) } else { Val::Tuple(out) })
    }

    /// The error for a call of a name that is no built-in.
    fn unknown_function(&mut self, name: &Ident) -> Reported {
        let n = name.name.as_str();
        let mut d = Diagnostic::error(
            codes::UNKNOWN_FUNCTION,
            format!("unknown function `{n}`"),
            name.span,
            "not a built-in or a `fn` of this file",
        );
        let near: Vec<&str> = BUILTINS.iter().copied().filter(|b| b.starts_with(&n[..n.len().min(3)])).collect();
        if !near.is_empty() {
            d = d.with_help(format!("built-ins with a similar name: {}", near.join(", ")));
        }
        self.error(d)
    }

    fn binary(&mut self, frame: &Frame, call: &Call<'_>, op: BinaryOp) -> LResult<Value> {
        let (a, b) = (self.tensor(frame, call.pos[0])?, self.tensor(frame, call.pos[1])?);
        self.add(Op::Binary(op), None, &[(a, call.pos[0].span), (b, call.pos[1].span)], call.span)
    }

    fn reduce(&mut self, frame: &Frame, call: &Call<'_>, op: ReduceOp) -> LResult<Value> {
        self.arity(call, 1, 2, &["axis", "keepdim"])?;
        let x = self.tensor(frame, call.pos[0])?;
        let ty = self.ty(x).clone();
        let mut axes = match call.pos.get(1).copied().or(call.kw("axis")) {
            Some(e) => self.axis_list(frame, e, &ty)?,
            None => (0..ty.rank()).collect(),
        };
        axes.sort_unstable();
        axes.dedup();
        let keepdim = self.flag(call, "keepdim")?;
        if axes.is_empty() {
            return Ok(x);
        }
        self.add(Op::Reduce { op, axes, keepdim }, None, &[(x, call.pos[0].span)], call.span)
    }

    /// `[..., S, H*Dh]` to `[..., H, S, Dh]`.
    fn split_heads(&mut self, x: Value, xspan: Span, heads: Dim, span: Span) -> LResult<Value> {
        let ty = self.ty(x).clone();
        let r = ty.rank();
        if r < 2 {
            return Err(self.error(Diagnostic::error(codes::BAD_AXIS, format!("split_heads needs [..., S, E], found {ty}"), span, "here")));
        }
        let Some(head_dim) = ty.shape[r - 1].div_exact(&heads) else {
            return Err(self.error(
                Diagnostic::error(
                    codes::TYPE_MISMATCH,
                    format!("the last dimension {} of {ty} is not a multiple of {heads}", ty.shape[r - 1]),
                    xspan,
                    format!("this is {ty}"),
                )
                .with_help(format!("declare the width as a product, e.g. `{heads}*Dh`")),
            ));
        };
        let mut shape = ty.shape[..r - 1].to_vec();
        shape.push(heads);
        shape.push(head_dim);
        let split = self.add(Op::Reshape, Some(TensorType::new(ty.dtype, shape)), &[(x, xspan)], span)?;
        // Move the head axis (r-1) before the sequence axis (r-2).
        let perm: Vec<usize> = (0..r + 1)
            .map(|k| {
                if k == r - 2 {
                    r - 1
                } else if k == r - 1 {
                    r - 2
                } else {
                    k
                }
            })
            .collect();
        self.add(Op::Transpose { perm }, None, &[(split, span)], span)
    }

    /// `[..., H, S, Dh]` to `[..., S, H*Dh]`.
    fn merge_heads(&mut self, x: Value, xspan: Span, span: Span) -> LResult<Value> {
        let ty = self.ty(x).clone();
        let r = ty.rank();
        if r < 3 {
            return Err(self.error(Diagnostic::error(
                codes::BAD_AXIS,
                format!("merge_heads needs [..., H, S, Dh], found {ty}"),
                span,
                "here",
            )));
        }
        let perm: Vec<usize> = (0..r)
            .map(|k| {
                if k == r - 3 {
                    r - 2
                } else if k == r - 2 {
                    r - 3
                } else {
                    k
                }
            })
            .collect();
        let t = self.add(Op::Transpose { perm }, None, &[(x, xspan)], span)?;
        let mut shape = ty.shape[..r - 3].to_vec();
        shape.push(ty.shape[r - 2].clone());
        shape.push(ty.shape[r - 3].mul(&ty.shape[r - 1]));
        self.add(Op::Reshape, Some(TensorType::new(ty.dtype, shape)), &[(t, span)], span)
    }

    fn last_axis(&mut self, ty: &TensorType, span: Span) -> LResult<usize> {
        ty.rank().checked_sub(1).ok_or_else(|| self.error(Diagnostic::error(codes::BAD_AXIS, "a scalar has no axes", span, "here")))
    }

    /// The call's second argument as a shape: a list of dimension expressions (`example` shows
    /// one in the error otherwise).
    pub(super) fn shape_arg(&mut self, frame: &Frame, call: &Call<'_>, example: &str) -> LResult<Vec<Dim>> {
        let ExprKind::List(items) = &call.pos[1].kind else {
            return Err(self.bad_args(call, &format!("the shape is a list of dimensions, e.g. {example}")));
        };
        let mut shape = Vec::new();
        for item in items {
            shape.push(self.dim_expr(item, &frame.dims)?);
        }
        Ok(shape)
    }

    /// An axis: an integer (negative counts from the end) or a dimension name that occurs once
    /// in the shape.
    pub(super) fn axis(&mut self, frame: &Frame, e: &Expr, ty: &TensorType) -> LResult<usize> {
        let rank = ty.rank() as i64;
        if let Some((v, true)) = literal(e) {
            let k = v as i64;
            let norm = if k < 0 { k + rank } else { k };
            if (0..rank).contains(&norm) {
                return Ok(norm as usize);
            }
            return Err(self.error(Diagnostic::error(
                codes::BAD_AXIS,
                format!("axis {k} is out of range for {ty}"),
                e.span,
                "no such axis",
            )));
        }
        if let ExprKind::Name(n) = &e.kind
            && let Some(d) = frame.dims.get(n)
        {
            let hits: Vec<usize> = ty.shape.iter().enumerate().filter(|(_, s)| *s == d).map(|(k, _)| k).collect();
            return match hits.as_slice() {
                [k] => Ok(*k),
                [] => Err(self.error(Diagnostic::error(codes::BAD_AXIS, format!("{ty} has no axis of size {n}"), e.span, "no such axis"))),
                _ => Err(self.error(
                    Diagnostic::error(codes::BAD_AXIS, format!("{ty} has several axes of size {n}"), e.span, "ambiguous axis")
                        .with_help("use a number, e.g. `axis = -1`"),
                )),
            };
        }
        Err(self.error(
            Diagnostic::error(codes::BAD_AXIS, "expected an axis", e.span, "not an axis")
                .with_help("an axis is an integer (negative counts from the end) or a dimension name"),
        ))
    }

    /// A list of axes (`[0, 2]`) or a single axis.
    fn axis_list(&mut self, frame: &Frame, e: &Expr, ty: &TensorType) -> LResult<Vec<usize>> {
        match &e.kind {
            ExprKind::List(items) => {
                let mut out = Vec::new();
                for item in items {
                    out.push(self.axis(frame, item, ty)?);
                }
                Ok(out)
            }
            _ => Ok(vec![self.axis(frame, e, ty)?]),
        }
    }

    pub(super) fn arity(&mut self, call: &Call<'_>, min: usize, max: usize, keywords: &[&str]) -> LResult<()> {
        if let Some((k, _)) = call.named.iter().find(|(k, _)| !keywords.contains(&k.name.as_str())) {
            let allowed = if keywords.is_empty() { "none".to_string() } else { keywords.join(", ") };
            let help = if k.name == "dim" && keywords.contains(&"axis") {
                "attnc calls it `axis`: write `axis = ...`".to_string()
            } else {
                format!("keywords of `{}`: {allowed}", call.name)
            };
            return Err(self.error(
                Diagnostic::error(codes::BAD_ARGS, format!("`{}` has no argument `{}`", call.name, k.name), k.span, "unknown keyword")
                    .with_help(help),
            ));
        }
        if call.pos.len() < min || call.pos.len() > max {
            let want = if min == max { format!("{min}") } else { format!("{min} to {max}") };
            return Err(self.bad_args(call, &format!("`{}` takes {want} positional argument(s), got {}", call.name, call.pos.len())));
        }
        Ok(())
    }

    /// A `true`/`false` keyword argument (false when absent).
    fn flag(&mut self, call: &Call<'_>, key: &str) -> LResult<bool> {
        match call.kw(key).map(|e| &e.kind) {
            None => Ok(false),
            Some(ExprKind::Bool(b)) => Ok(*b),
            Some(_) => Err(self.bad_args(call, &format!("`{key}` is `true` or `false`"))),
        }
    }

    /// The call's first argument as a non-empty list of tensors with their spans (`concat`,
    /// `stack`); `usage` shows the call written right.
    pub(super) fn tensor_list(&mut self, frame: &Frame, call: &Call<'_>, usage: &str) -> LResult<Vec<(Value, Span)>> {
        let name = call.name;
        let ExprKind::List(items) = &call.pos[0].kind else {
            return Err(self.bad_args(call, &format!("{name} takes a list of tensors: `{usage}`")));
        };
        let mut xs = Vec::new();
        for e in items {
            xs.push((self.tensor(frame, e)?, e.span));
        }
        if xs.is_empty() {
            return Err(self.bad_args(call, &format!("{name} needs at least one tensor")));
        }
        Ok(xs)
    }

    pub(super) fn bad_args(&mut self, call: &Call<'_>, msg: &str) -> super::Reported {
        self.error(Diagnostic::error(codes::BAD_ARGS, msg.to_string(), call.span, format!("in this call to `{}`", call.name)))
    }
}
