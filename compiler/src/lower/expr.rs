//! Expressions: names, literals, operators, `.T`, method sugar and indexing.

use super::{Cx, Frame, LResult, Reported, Val, codes, literal};
use crate::ir::{BinaryOp, DType, Dim, Op, TensorType, UnaryOp, Value};
use attn_dsl::ast::{self, BinOp, Expr, ExprKind, IndexItem, UnOp};
use attn_dsl::{Diagnostic, Span};

impl Cx<'_, '_> {
    /// Lowers an expression that must be one tensor.
    pub(crate) fn tensor(&mut self, frame: &Frame, e: &Expr) -> LResult<Value> {
        match self.expr(frame, e)? {
            Val::T(v) => Ok(v),
            Val::Tuple(vs) => Err(self.error(
                Diagnostic::error(codes::NOT_A_TENSOR, format!("expected one tensor, found {} values", vs.len()), e.span, "several values")
                    .with_help("bind them first: `let (a, b) = ...`"),
            )),
        }
    }

    /// An integer literal: an i32 constant, or an error (E0117) outside the i32 range.
    fn int_literal(&mut self, v: i64, span: Span) -> LResult<Value> {
        if i32::try_from(v).is_ok() {
            return Ok(self.constant(v as f64, DType::I32));
        }
        Err(self.error(Diagnostic::error(codes::INT_RANGE, format!("integer {v} does not fit in i32"), span, "out of range").with_help(
            format!("integers in expressions are i32 ({} to {}); write a float (`{v}.0`) for a larger value", i32::MIN, i32::MAX),
        )))
    }

    /// Lowers any expression.
    pub(crate) fn expr(&mut self, frame: &Frame, e: &Expr) -> LResult<Val> {
        let v = match &e.kind {
            ExprKind::Int(v) => self.int_literal(*v, e.span)?,
            ExprKind::Float(v) => self.constant(*v, DType::F32),
            ExprKind::Bool(b) => self.constant(f64::from(u8::from(*b)), DType::Bool),
            ExprKind::Name(n) => self.name(frame, n, e.span)?,
            ExprKind::Unary(op, inner) => {
                if let (UnOp::Neg, Some((v, is_int))) = (op, literal(inner)) {
                    if is_int { self.int_literal(-v as i64, e.span)? } else { self.constant(-v, DType::F32) }
                } else {
                    let x = self.tensor(frame, inner)?;
                    let u = match op {
                        UnOp::Neg => UnaryOp::Neg,
                        UnOp::Not => UnaryOp::Not,
                    };
                    self.add(Op::Unary(u), None, &[(x, inner.span)], e.span)?
                }
            }
            ExprKind::Binary(op, a, b) => {
                let x = self.tensor(frame, a);
                let y = self.tensor(frame, b);
                let (x, y) = (x?, y?);
                let ir_op = match op {
                    BinOp::MatMul => Op::MatMul,
                    other => Op::Binary(binary(*other)),
                };
                self.add(ir_op, None, &[(x, a.span), (y, b.span)], e.span)?
            }
            ExprKind::Call(name, args) => {
                if let Some(def) = self.globals.fns.get(name.name.as_str()).copied() {
                    return self.call_user(frame, def, args, e.span);
                }
                let positional: Vec<&Expr> = Vec::new();
                return self.builtin(frame, name, positional, args, e.span);
            }
            ExprKind::Method(recv, name, args) => {
                if let Some(def) = self.globals.fns.get(name.name.as_str()).copied() {
                    let mut all = vec![ast::Arg { name: None, value: (**recv).clone() }];
                    all.extend(args.iter().cloned());
                    return self.call_user(frame, def, &all, e.span);
                }
                return self.builtin(frame, name, vec![recv.as_ref()], args, e.span);
            }
            ExprKind::Field(recv, field) => {
                if field.name != "T" {
                    return Err(self.error(
                        Diagnostic::error(codes::UNKNOWN_NAME, format!("unknown field `.{}`", field.name), field.span, "no such field")
                            .with_help("`.T` swaps the last two axes; methods need parentheses, e.g. `x.reshape([...])`"),
                    ));
                }
                let x = self.tensor(frame, recv)?;
                self.swap_last_two(x, recv.span, e.span)?
            }
            ExprKind::Index(base, items) => self.index(frame, base, items, e.span)?,
            ExprKind::List(_) => {
                return Err(self.error(
                    Diagnostic::error(codes::NOT_A_TENSOR, "a list is not a tensor", e.span, "list")
                        .with_help("lists are arguments of reshape, permute, concat and `axis =`"),
                ));
            }
            ExprKind::Error => return Err(Reported),
        };
        Ok(Val::T(v))
    }

    fn name(&mut self, frame: &Frame, n: &str, span: Span) -> LResult<Value> {
        if let Some((v, _)) = frame.vars.get(n) {
            return Ok(*v);
        }
        if frame.poisoned.contains(n) {
            return Err(Reported);
        }
        if let Some((v, is_int)) = self.globals.consts.get(n).copied() {
            return if is_int { self.int_literal(v as i64, span) } else { Ok(self.constant(v, DType::F32)) };
        }
        if let Some(d) = frame.dims.get(n).cloned() {
            return Ok(match d.as_const() {
                Some(c) => self.constant(c as f64, DType::I32),
                None => self.g.add(Op::DimValue(d), TensorType::scalar(DType::I32), &[]),
            });
        }
        if n == "inf" {
            return Ok(self.constant(f64::INFINITY, DType::F32));
        }
        let mut d = Diagnostic::error(codes::UNKNOWN_NAME, format!("unknown name `{n}`"), span, "not defined");
        if self.globals.fns.contains_key(n) {
            d = d.with_help(format!("`{n}` is a function: call it with `{n}(...)`"));
        } else {
            let candidates = frame.vars.keys().chain(frame.dims.keys()).chain(self.globals.consts.keys());
            // Short names are too close to everything to suggest anything useful.
            let len = n.chars().count();
            let limit = if len <= 2 { 0 } else { len.div_ceil(2).min(2) };
            if let Some(best) = candidates.filter(|c| edit_distance(c, n) <= limit).min_by_key(|c| (edit_distance(c, n), c.to_string())) {
                d = d.with_help(format!("did you mean `{best}`?"));
            }
        }
        Err(self.error(d))
    }

    /// `x.T`: swaps the last two axes.
    pub(crate) fn swap_last_two(&mut self, x: Value, xspan: Span, span: Span) -> LResult<Value> {
        let rank = self.ty(x).rank();
        if rank < 2 {
            return Err(self.error(Diagnostic::error(
                codes::BAD_AXIS,
                format!("`.T` needs at least 2 axes, found {}", self.ty(x)),
                span,
                "transposed here",
            )));
        }
        let mut perm: Vec<usize> = (0..rank).collect();
        perm.swap(rank - 2, rank - 1);
        self.add(Op::Transpose { perm }, None, &[(x, xspan)], span)
    }

    /// `x[...]`: slicing when any item is a slice or all items are integer literals; otherwise
    /// a gather with one i32 index tensor per axis.
    fn index(&mut self, frame: &Frame, base: &Expr, items: &[IndexItem], span: Span) -> LResult<Value> {
        let x = self.tensor(frame, base)?;
        let rank = self.ty(x).rank();
        // Static items (integers, dims, integer constants) select; tensor items gather.
        let all_static = items.iter().all(|it| match it {
            IndexItem::Slice { .. } => true,
            IndexItem::Expr(e) => self.is_static_index(frame, e),
        });
        if items.len() > rank {
            return Err(self.error(Diagnostic::error(
                codes::BAD_AXIS,
                format!("{} indices for a tensor with {rank} axes ({})", items.len(), self.ty(x)),
                span,
                "too many indices",
            )));
        }
        if !all_static {
            if items.iter().any(|it| matches!(it, IndexItem::Slice { .. })) {
                return Err(self.error(
                    Diagnostic::error(codes::BAD_ARGS, "slices and tensor indices cannot be mixed", span, "mixed index")
                        .with_help("slice first, then gather: `t[a:b][i]`"),
                ));
            }
            let mut operands = vec![(x, base.span)];
            for it in items {
                if let IndexItem::Expr(e) = it {
                    operands.push((self.tensor(frame, e)?, e.span));
                }
            }
            return self.gather(operands, span);
        }
        let mut cur = x;
        let mut dropped = Vec::new();
        for (axis, it) in items.iter().enumerate() {
            let size = self.ty(cur).shape[axis].clone();
            let (start, end) = match it {
                IndexItem::Slice { lo, hi, step, .. } => {
                    let start = match lo {
                        Some(e) => self.bound(e, &size, &frame.dims)?,
                        None => Dim::constant(0),
                    };
                    let end = match hi {
                        Some(e) => self.bound(e, &size, &frame.dims)?,
                        None => size.clone(),
                    };
                    if let Some(step) = step {
                        cur = self.strided(cur, axis, (start, end), step, &frame.dims, (base.span, span))?;
                        continue;
                    }
                    (start, end)
                }
                IndexItem::Expr(e) => {
                    let k = self.bound(e, &size, &frame.dims)?;
                    dropped.push(axis);
                    let end = k.add(&Dim::constant(1));
                    (k, end)
                }
            };
            if start == Dim::constant(0) && end == size {
                continue;
            }
            cur = self.add(Op::Slice { axis, start, end }, None, &[(cur, base.span)], span)?;
        }
        if dropped.is_empty() {
            return Ok(cur);
        }
        let ty = self.ty(cur).clone();
        let shape = ty.shape.iter().enumerate().filter(|(k, _)| !dropped.contains(k)).map(|(_, d)| d.clone()).collect();
        self.add(Op::Reshape, Some(TensorType::new(ty.dtype, shape)), &[(cur, base.span)], span)
    }

    /// `table[i0, ..., ik-1]` with k index tensors for the leading k axes of the table: the
    /// result has the indices' broadcast shape followed by the axes not indexed (taken whole),
    /// like NumPy's `table[idx]` (`emb[tokens]`: `[V, E]` by `[B, S]` gives `[B, S, E]`). With
    /// one index per axis it is the plain gather.
    fn gather(&mut self, operands: Vec<(Value, Span)>, span: Span) -> LResult<Value> {
        let table = self.ty(operands[0].0).clone();
        let k = operands.len() - 1;
        let mut bcast: Option<Vec<Dim>> = Some(Vec::new());
        for (v, _) in &operands[1..] {
            bcast = bcast.and_then(|b| crate::ir::broadcast_shapes(&b, &self.ty(*v).shape));
        }
        // Every axis indexed, or shapes the gather's own check will report: nothing to add.
        let (Some(p), true) = (bcast, k < table.rank() && k > 0) else {
            return self.add(Op::Gather, None, &operands, span);
        };
        let rest = &table.shape[k..];
        let mut full = vec![operands[0]];
        for (v, vspan) in &operands[1..] {
            let ty = self.ty(*v).clone();
            let mut shape = ty.shape.clone();
            shape.extend(rest.iter().map(|_| Dim::constant(1)));
            full.push((self.add(Op::Reshape, Some(TensorType::new(ty.dtype, shape)), &[(*v, *vspan)], span)?, *vspan));
        }
        for (t, d) in rest.iter().enumerate() {
            let mut shape = vec![Dim::constant(1); p.len() + rest.len()];
            shape[p.len() + t] = d.clone();
            let iota = self.add(Op::Iota { axis: p.len() + t }, Some(TensorType::new(DType::I32, shape)), &[], span)?;
            full.push((iota, span));
        }
        self.add(Op::Gather, None, &full, span)
    }

    /// True for an index that is a dimension expression: integer literals, dims and integer
    /// constants (not shadowed by a variable), and `+`, `-`, `*` of them.
    fn is_static_index(&self, frame: &Frame, e: &Expr) -> bool {
        match &e.kind {
            ExprKind::Int(_) => true,
            ExprKind::Name(n) => {
                !frame.vars.contains_key(n) && (frame.dims.contains_key(n) || matches!(self.globals.consts.get(n), Some((_, true))))
            }
            ExprKind::Unary(UnOp::Neg, a) => self.is_static_index(frame, a),
            ExprKind::Binary(BinOp::Add | BinOp::Sub | BinOp::Mul, a, b) => {
                self.is_static_index(frame, a) && self.is_static_index(frame, b)
            }
            _ => false,
        }
    }

    /// A slice bound: a dimension expression; a negative integer counts from the end.
    /// `x[..., start:end:k]` along `axis`: elements `start, start + k, …` below `end`. Written
    /// as a slice of an aligned window, a reshape of that axis to `[n, k]`, and column `r` of
    /// it (`x[1::2]` of an axis of `2*Dh` is column 1 of `[Dh, 2]`), so every backend and the
    /// derivative rules already know it. The window must be exact as polynomials: `n` elements
    /// (`(end − start + k − 1) / k` divides exactly), inside the axis.
    fn strided(
        &mut self,
        x: Value,
        axis: usize,
        (start, end): (Dim, Dim),
        step: &Expr,
        dims: &std::collections::HashMap<String, Dim>,
        (xspan, span): (Span, Span),
    ) -> LResult<Value> {
        let k = match self.dim_expr(step, dims)?.as_const() {
            Some(k) if k > 0 => k,
            _ => {
                return Err(self.error(Diagnostic::error(
                    codes::BAD_ARGS,
                    "a slice's step must be a positive integer",
                    step.span,
                    "this step",
                )));
            }
        };
        let ty = self.ty(x).clone();
        let size = ty.shape[axis].clone();
        let kd = Dim::constant(k);
        // The first element's place in its group of k (start − r is where an aligned window of
        // groups begins); a symbolic start is its own group's first.
        let r = start.as_const().map_or(0, |s| s.rem_euclid(k));
        let from = start.sub(&Dim::constant(r));
        // n = ceil((end − start) / k): the length's symbolic part must divide by k; its constant
        // part c adds ceil(c / k).
        let len = end.sub(&start);
        let zeros: std::collections::HashMap<String, i64> = len.symbols().into_iter().map(|s| (s, 0)).collect();
        let c = len.eval(&zeros).unwrap_or(0);
        let n = len.sub(&Dim::constant(c)).div_exact(&kd).map(|p| p.add(&Dim::constant((c + k - 1).div_euclid(k))));
        let fits = |n: &Dim| size.sub(&from.add(&n.mul(&kd))).as_const().is_some_and(|d| d >= 0) && from.as_const().is_none_or(|f| f >= 0);
        let Some(n) = n.filter(fits) else {
            let d = Diagnostic::error(
                codes::BAD_ARGS,
                format!("a step of {k} along an axis of {size} (from {start} to {end}) is not an exact number of elements"),
                span,
                "this strided slice",
            );
            return Err(self.error(
                d.with_help(format!(
                    "declare the axis as a multiple of the step: divide its name in the entry's signature (a `D/{k}` anywhere there makes D a multiple of {k}), or write it `{k}*Dh`, so that the slice has `Dh` elements"
                )),
            ));
        };
        let mut cur = x;
        let window_end = from.add(&n.mul(&kd));
        if from != Dim::constant(0) || window_end != size {
            cur = self.add(Op::Slice { axis, start: from, end: window_end }, None, &[(cur, xspan)], span)?;
        }
        let mut grouped = ty.shape.clone();
        grouped.splice(axis..=axis, [n.clone(), kd]);
        cur = self.add(Op::Reshape, Some(TensorType::new(ty.dtype, grouped)), &[(cur, xspan)], span)?;
        cur = self.add(Op::Slice { axis: axis + 1, start: Dim::constant(r), end: Dim::constant(r + 1) }, None, &[(cur, xspan)], span)?;
        let mut shape = ty.shape.clone();
        shape[axis] = n;
        self.add(Op::Reshape, Some(TensorType::new(ty.dtype, shape)), &[(cur, xspan)], span)
    }

    pub(crate) fn bound(&mut self, e: &Expr, size: &Dim, dims: &std::collections::HashMap<String, Dim>) -> LResult<Dim> {
        let d = self.dim_expr(e, dims)?;
        Ok(match d.as_const() {
            Some(c) if c < 0 => size.add(&d),
            _ => d,
        })
    }
}

fn binary(op: BinOp) -> BinaryOp {
    match op {
        BinOp::Or => BinaryOp::Or,
        BinOp::And => BinaryOp::And,
        BinOp::Eq => BinaryOp::Eq,
        BinOp::Ne => BinaryOp::Ne,
        BinOp::Lt => BinaryOp::Lt,
        BinOp::Le => BinaryOp::Le,
        BinOp::Gt => BinaryOp::Gt,
        BinOp::Ge => BinaryOp::Ge,
        BinOp::Add => BinaryOp::Add,
        BinOp::Sub => BinaryOp::Sub,
        BinOp::Mul => BinaryOp::Mul,
        BinOp::Div => BinaryOp::Div,
        BinOp::Rem => BinaryOp::Rem,
        BinOp::Pow => BinaryOp::Pow,
        // Not reached: `@` lowers to MatMul.
        BinOp::MatMul => BinaryOp::Mul,
    }
}

/// Levenshtein distance, for "did you mean" hints.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            cur.push((prev[j] + usize::from(ca != *cb)).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}
