//! Result types of ops: the one place that knows each op's shape and dtype rules. The lowering
//! uses it to type-check programs (turning its messages into diagnostics); the verifier uses it
//! to re-check every node of a graph.

use super::dim::Dim;
use super::op::{Arity, BinaryOp, Op, ReduceOp, ScanOp, UnaryOp};
use super::types::{DType, TensorType, broadcast_shapes};

fn shape_str(s: &[Dim]) -> String {
    let parts: Vec<String> = s.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

/// Promotion where a scalar (rank 0) operand is weakly typed, as in PyTorch: it does not widen
/// a tensor of its own kind (`f16_tensor * 0.5` stays f16, `i32_tensor + 1` stays i32), but an
/// integer tensor with a float scalar becomes f32. Tensors with axes promote by [`DType::promote`].
pub fn weak_promote(x: &TensorType, y: &TensorType) -> DType {
    let kind = |d: DType| match d {
        DType::Bool => 0,
        DType::I32 => 1,
        _ => 2,
    };
    match (x.rank(), y.rank()) {
        (0, r) if r > 0 && kind(x.dtype) <= kind(y.dtype) => y.dtype,
        (r, 0) if r > 0 && kind(y.dtype) <= kind(x.dtype) => x.dtype,
        _ => x.dtype.promote(y.dtype),
    }
}

fn numeric(t: &TensorType, what: &str) -> Result<(), String> {
    if t.dtype == DType::Bool { Err(format!("{what} must be a number, not bool")) } else { Ok(()) }
}

/// The result type of `op` applied to operands of types `args`. Ops whose result is described by
/// the node's own type (param, const, reshape, cast, iota) take it from `declared` and check it.
pub fn infer(op: &Op, args: &[&TensorType], declared: Option<&TensorType>) -> Result<TensorType, String> {
    match op.arity() {
        Arity::Exact(n) if args.len() != n => return Err(format!("`{}` takes {n} operand(s), got {}", op.name(), args.len())),
        Arity::AtLeast(n) if args.len() < n => return Err(format!("`{}` takes at least {n} operand(s), got {}", op.name(), args.len())),
        _ => {}
    }
    let declared_ty = || declared.cloned().ok_or_else(|| format!("`{}` needs its result type", op.name()));
    match op {
        Op::Param(_) => declared_ty(),
        Op::Const(_) => {
            let t = declared_ty()?;
            if t.rank() != 0 {
                return Err("a constant is a scalar".into());
            }
            Ok(t)
        }
        Op::DimValue(_) => Ok(TensorType::scalar(DType::I32)),
        Op::Iota { axis } => {
            let t = declared_ty()?;
            if *axis >= t.rank() {
                return Err(format!("iota axis {axis} is out of range for rank {}", t.rank()));
            }
            Ok(TensorType::new(DType::I32, t.shape))
        }
        Op::Unary(u) => unary(*u, args[0]),
        Op::Binary(b) => binary(*b, args[0], args[1]),
        Op::Select => select(args[0], args[1], args[2]),
        Op::Cast => cast(args[0], declared_ty()?),
        Op::MatMul => matmul(args[0], args[1]),
        Op::Transpose { perm } => transpose(args[0], perm),
        Op::Reshape => reshape(args[0], declared_ty()?),
        Op::Slice { axis, start, end } => slice(args[0], *axis, start, end),
        Op::Concat { axis } => concat(args, *axis),
        Op::Gather => gather(args),
        Op::Paged => paged(args[0], args[1]),
        Op::Dropout { rate } => dropout(args[0], args[1], *rate),
        Op::Reduce { op: r, axes, keepdim } => reduce(args[0], *r, axes, *keepdim),
        Op::Softmax { axis } => softmax(args[0], *axis),
        Op::Scan { op, axis, .. } => scan(*op, args, *axis),
        Op::ScatterAdd { axis } => scatter_add(args[0], args[1], args[2], *axis),
        Op::PrefixAttention { .. } => prefix_attention(args[0], args[1], args[2]),
        Op::ArgSort { axis, .. } => {
            numeric(args[0], "the operand of argsort")?;
            if *axis >= args[0].rank() {
                return Err(format!("`argsort` axis {axis} is out of range for rank {}", args[0].rank()));
            }
            Ok(TensorType::new(DType::I32, args[0].shape.clone()))
        }
        Op::Flash(spec) => flash(spec, args, declared),
        Op::FlashLse(spec) => flash_lse(spec, args),
        Op::FlashGrad { spec, wrt, lse_grad } => flash_grad(spec, *wrt, *lse_grad, args),
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => norm(args),
    }
}

fn unary(u: UnaryOp, x: &TensorType) -> Result<TensorType, String> {
    let dtype = match u {
        UnaryOp::Not => {
            if x.dtype != DType::Bool {
                return Err(format!("`!` needs bool, found {}", x.dtype));
            }
            DType::Bool
        }
        UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Relu | UnaryOp::Floor => {
            numeric(x, "the operand")?;
            x.dtype
        }
        _ => {
            numeric(x, "the operand")?;
            if x.dtype.is_float() { x.dtype } else { DType::F32 }
        }
    };
    Ok(TensorType::new(dtype, x.shape.clone()))
}

fn binary(b: BinaryOp, x: &TensorType, y: &TensorType) -> Result<TensorType, String> {
    let shape = broadcast_shapes(&x.shape, &y.shape)
        .ok_or_else(|| format!("shapes {} and {} do not broadcast", shape_str(&x.shape), shape_str(&y.shape)))?;
    let dtype = if b.is_logical() {
        if x.dtype != DType::Bool || y.dtype != DType::Bool {
            return Err(format!("`{}` needs bool operands, found {} and {}", b.name(), x.dtype, y.dtype));
        }
        DType::Bool
    } else if matches!(b, BinaryOp::Eq | BinaryOp::Ne) && x.dtype == DType::Bool && y.dtype == DType::Bool {
        // Equality of masks (and so their exclusive or) is well defined.
        DType::Bool
    } else {
        numeric(x, "the left operand")?;
        numeric(y, "the right operand")?;
        let p = weak_promote(x, y);
        if b.is_comparison() {
            DType::Bool
        } else if b.is_always_float() && !p.is_float() {
            DType::F32
        } else {
            p
        }
    };
    Ok(TensorType::new(dtype, shape))
}

fn select(c: &TensorType, a: &TensorType, b: &TensorType) -> Result<TensorType, String> {
    if c.dtype != DType::Bool {
        return Err(format!("the condition of `where` must be bool, found {}", c.dtype));
    }
    let s1 = broadcast_shapes(&a.shape, &b.shape)
        .ok_or_else(|| format!("branches {} and {} do not broadcast", shape_str(&a.shape), shape_str(&b.shape)))?;
    let shape = broadcast_shapes(&c.shape, &s1)
        .ok_or_else(|| format!("condition {} does not broadcast with branches {}", shape_str(&c.shape), shape_str(&s1)))?;
    let dtype = if a.dtype == DType::Bool && b.dtype == DType::Bool { DType::Bool } else { weak_promote(a, b) };
    Ok(TensorType::new(dtype, shape))
}

fn cast(x: &TensorType, t: TensorType) -> Result<TensorType, String> {
    if t.shape != x.shape {
        return Err("cast keeps the shape".into());
    }
    Ok(t)
}

fn matmul(a: &TensorType, b: &TensorType) -> Result<TensorType, String> {
    if a.rank() < 2 || b.rank() < 2 {
        return Err(format!(
            "`@` needs at least 2 axes on each side, found {} @ {} (use reshape or unsqueeze for vectors)",
            shape_str(&a.shape),
            shape_str(&b.shape)
        ));
    }
    numeric(a, "the left operand")?;
    numeric(b, "the right operand")?;
    let (m, k1) = (&a.shape[a.rank() - 2], &a.shape[a.rank() - 1]);
    let (k2, n) = (&b.shape[b.rank() - 2], &b.shape[b.rank() - 1]);
    if k1 != k2 {
        return Err(format!("inner dimensions differ: {} @ {} ({k1} vs {k2})", shape_str(&a.shape), shape_str(&b.shape)));
    }
    let batch = broadcast_shapes(&a.shape[..a.rank() - 2], &b.shape[..b.rank() - 2])
        .ok_or_else(|| format!("batch dimensions of {} and {} do not broadcast", shape_str(&a.shape), shape_str(&b.shape)))?;
    let mut shape = batch;
    shape.push(m.clone());
    shape.push(n.clone());
    let p = a.dtype.promote(b.dtype);
    Ok(TensorType::new(if p.is_float() { p } else { DType::F32 }, shape))
}

fn transpose(x: &TensorType, perm: &[usize]) -> Result<TensorType, String> {
    let mut seen = vec![false; x.rank()];
    if perm.len() != x.rank() || perm.iter().any(|p| *p >= x.rank() || std::mem::replace(&mut seen[*p], true)) {
        return Err(format!("{perm:?} is not a permutation of {} axes", x.rank()));
    }
    Ok(TensorType::new(x.dtype, perm.iter().map(|p| x.shape[*p].clone()).collect()))
}

fn reshape(x: &TensorType, t: TensorType) -> Result<TensorType, String> {
    let (from, to) = (Dim::product(&x.shape), Dim::product(&t.shape));
    if from != to {
        return Err(format!("cannot reshape {} ({from} elements) to {} ({to} elements)", shape_str(&x.shape), shape_str(&t.shape)));
    }
    Ok(TensorType::new(x.dtype, t.shape))
}

fn slice(x: &TensorType, axis: usize, start: &Dim, end: &Dim) -> Result<TensorType, String> {
    if axis >= x.rank() {
        return Err(format!("slice axis {axis} is out of range for rank {}", x.rank()));
    }
    let len = end.sub(start);
    if let Some(l) = len.as_const()
        && l < 0
    {
        return Err(format!("slice {start}:{end} is empty or reversed"));
    }
    if let (Some(e), Some(n)) = (end.as_const(), x.shape[axis].as_const())
        && e > n
    {
        return Err(format!("slice end {e} is past the axis' size {n}"));
    }
    let mut shape = x.shape.clone();
    shape[axis] = len;
    Ok(TensorType::new(x.dtype, shape))
}

fn concat(args: &[&TensorType], axis: usize) -> Result<TensorType, String> {
    if args.is_empty() {
        return Err("concat needs at least one operand".into());
    }
    let first = args[0];
    if axis >= first.rank() {
        return Err(format!("concat axis {axis} is out of range for rank {}", first.rank()));
    }
    let mut shape = first.shape.clone();
    for a in &args[1..] {
        if a.rank() != first.rank() || a.dtype != first.dtype {
            return Err(format!("concat operands differ: {first} and {a}"));
        }
        for (k, (d1, d2)) in first.shape.iter().zip(&a.shape).enumerate() {
            if k != axis && d1 != d2 {
                return Err(format!("concat operands differ on axis {k}: {first} and {a}"));
            }
        }
        shape[axis] = shape[axis].add(&a.shape[axis]);
    }
    Ok(TensorType::new(first.dtype, shape))
}

fn gather(args: &[&TensorType]) -> Result<TensorType, String> {
    let (table, idx) = args.split_first().ok_or("gather needs a table")?;
    if idx.len() != table.rank() {
        return Err(format!("{} has {} axes but {} indices were given", table, table.rank(), idx.len()));
    }
    let mut shape = Vec::new();
    for i in idx {
        if i.dtype != DType::I32 {
            return Err(format!("indices must be i32, found {}", i.dtype));
        }
        shape = broadcast_shapes(&shape, &i.shape).ok_or_else(|| "index shapes do not broadcast".to_string())?;
    }
    Ok(TensorType::new(table.dtype, shape))
}

fn paged(pages: &TensorType, table: &TensorType) -> Result<TensorType, String> {
    if pages.rank() < 2 {
        return Err(format!("the pages of `paged` need at least two axes [pages, rows per page, …], found {pages}"));
    }
    if table.dtype != DType::I32 || table.rank() != 2 {
        return Err(format!("the block table of `paged` must be i32 [sequences, pages per sequence], found {table}"));
    }
    let mut shape = vec![table.shape[0].clone(), table.shape[1].mul(&pages.shape[1])];
    shape.extend(pages.shape[2..].iter().cloned());
    Ok(TensorType::new(pages.dtype, shape))
}

fn dropout(x: &TensorType, seed: &TensorType, rate: f64) -> Result<TensorType, String> {
    if !x.dtype.is_float() {
        return Err(format!("dropout needs a float operand, found {x}"));
    }
    if seed.dtype != DType::I32 || seed.rank() != 0 {
        return Err(format!("the seed of dropout must be an i32 scalar, found {seed}"));
    }
    if !(0.0..1.0).contains(&rate) {
        return Err(format!("the dropout rate must be in [0, 1), found {rate}"));
    }
    Ok(x.clone())
}

fn reduce(x: &TensorType, r: ReduceOp, axes: &[usize], keepdim: bool) -> Result<TensorType, String> {
    numeric(x, "the operand of a reduction")?;
    if r == ReduceOp::LogSumExp && !x.dtype.is_float() {
        return Err(format!("logsumexp needs a float operand, found {x}"));
    }
    if axes.is_empty() || axes.windows(2).any(|w| w[0] >= w[1]) || axes.iter().any(|a| *a >= x.rank()) {
        return Err(format!("bad reduction axes {axes:?} for rank {}", x.rank()));
    }
    let mut shape = Vec::new();
    for (k, d) in x.shape.iter().enumerate() {
        if !axes.contains(&k) {
            shape.push(d.clone());
        } else if keepdim {
            shape.push(Dim::constant(1));
        }
    }
    let dtype = if r == ReduceOp::Mean && !x.dtype.is_float() { DType::F32 } else { x.dtype };
    Ok(TensorType::new(dtype, shape))
}

fn softmax(x: &TensorType, axis: usize) -> Result<TensorType, String> {
    if axis >= x.rank() {
        return Err(format!("softmax axis {axis} is out of range for rank {}", x.rank()));
    }
    numeric(x, "the operand of softmax")?;
    Ok(TensorType::new(if x.dtype.is_float() { x.dtype } else { DType::F32 }, x.shape.clone()))
}

fn scan(op: ScanOp, args: &[&TensorType], axis: usize) -> Result<TensorType, String> {
    let x = args[0];
    let (dtype, shape) = if op == ScanOp::Linear {
        let b = args[1];
        if !x.dtype.is_float() || !b.dtype.is_float() {
            return Err(format!("`scan` needs float operands, found {} and {}", x.dtype, b.dtype));
        }
        let shape = broadcast_shapes(&x.shape, &b.shape)
            .ok_or_else(|| format!("`scan`'s a {} and b {} do not broadcast", shape_str(&x.shape), shape_str(&b.shape)))?;
        (x.dtype.promote(b.dtype), shape)
    } else {
        numeric(x, "the operand")?;
        (x.dtype, x.shape.clone())
    };
    if axis >= shape.len() {
        return Err(format!("`{}` axis {axis} is out of range for rank {}", op.name(), shape.len()));
    }
    Ok(TensorType::new(dtype, shape))
}

fn scatter_add(base: &TensorType, idx: &TensorType, src: &TensorType, axis: usize) -> Result<TensorType, String> {
    if !base.dtype.is_float() || src.dtype != base.dtype {
        return Err(format!("`scatter_add` adds float values into a tensor of the same type, found {src} into {base}"));
    }
    if idx.dtype != DType::I32 || idx.shape != src.shape {
        return Err(format!("`scatter_add`'s index must be i32 with the values' shape {}, found {idx}", shape_str(&src.shape)));
    }
    if axis >= base.rank() || src.rank() != base.rank() {
        return Err(format!("`scatter_add` along axis {axis} needs values of {base}'s rank, found {src}"));
    }
    if (0..base.rank()).any(|k| k != axis && base.shape[k] != src.shape[k]) {
        return Err(format!("`scatter_add`'s values {src} must match {base} on every axis but {axis}"));
    }
    Ok(base.clone())
}

fn prefix_attention(q: &TensorType, k: &TensorType, v: &TensorType) -> Result<TensorType, String> {
    if !q.dtype.is_float() || k.dtype != q.dtype || v.dtype != q.dtype {
        return Err(format!("`prefix_attention` needs q, k and v of one float type, found {q}, {k} and {v}"));
    }
    let r = q.rank();
    if r < 2 || k.shape != q.shape || v.rank() != r || v.shape[..r - 1] != q.shape[..r - 1] {
        return Err(format!("`prefix_attention` needs q and k of [.., S, D] and v of [.., S, Dv], found {q}, {k} and {v}"));
    }
    let mut shape = q.shape.clone();
    shape[r - 1] = v.shape[r - 1].clone();
    Ok(TensorType::new(v.dtype, shape))
}

fn norm(args: &[&TensorType]) -> Result<TensorType, String> {
    let x = args.first().ok_or("normalisation needs an operand")?;
    let last = x.shape.last().ok_or("cannot normalise a scalar")?;
    if !x.dtype.is_float() {
        return Err(format!("normalisation needs a float tensor, found {}", x.dtype));
    }
    for p in &args[1..] {
        if p.shape.as_slice() != std::slice::from_ref(last) {
            return Err(format!("scale/shift must have shape [{last}] (the last axis of {x}), found {p}"));
        }
    }
    Ok(TensorType::new(x.dtype, x.shape.clone()))
}

/// `flash_lse(q, k, v, extras…)`: the operands of a softmax flash op; `f32[…b, M]`.
fn flash_lse(spec: &super::flash_spec::FlashSpec, args: &[&TensorType]) -> Result<TensorType, String> {
    if spec.weights != super::flash_spec::Weights::Softmax {
        return Err("flash_lse needs softmax weights".into());
    }
    let out = flash(spec, args, None)?;
    let r = out.rank();
    Ok(TensorType::new(DType::F32, out.shape[..r - 1].to_vec()))
}

/// `flash_grad(q, k, v, d_out, [lse, out, [d_lse,]] extras…)`: see [`Op::FlashGrad`]. The
/// gradient of q has q's type; of k and v, their dtype over the score's batch axes
/// (`[…b, N, D]`, `[…b, N, Dv]`); of an extra operand, its type (which must be float).
fn flash_grad(
    spec: &super::flash_spec::FlashSpec,
    wrt: super::op::FlashWrt,
    lse_grad: bool,
    args: &[&TensorType],
) -> Result<TensorType, String> {
    use super::op::FlashWrt;
    if spec.pair != super::flash_spec::Pair::Dot {
        return Err("flash_grad is defined for dot-product scores only (additive attention differentiates unfused)".into());
    }
    if lse_grad && spec.weights != super::flash_spec::Weights::Softmax {
        return Err("flash_grad's lse_grad needs softmax weights".into());
    }
    let fixed = spec.grad_fixed_operands(lse_grad);
    if args.len() < fixed {
        return Err(format!("flash_grad takes {fixed} operands before its extras, found {}", args.len()));
    }
    let [q, k, v, d_out, ..] = args else { return Err("flash_grad takes q, k, v, d_out and more operands".into()) };
    let extras = &args[fixed..];
    let mut forward: Vec<&TensorType> = vec![q, k, v];
    forward.extend(extras);
    let out = flash(spec, &forward, None)?;
    let r = out.rank();
    if d_out.shape != out.shape || !d_out.dtype.is_float() {
        return Err(format!("flash_grad's d_out must be a float tensor of the result's shape {}, found {d_out}", shape_str(&out.shape)));
    }
    if fixed >= 6 {
        let rows = &out.shape[..r - 1];
        if args[4].dtype != DType::F32 || args[4].shape != rows {
            return Err(format!("flash_grad's lse must be f32{}, found {}", shape_str(rows), args[4]));
        }
        if lse_grad && (args[6].dtype != DType::F32 || args[6].shape != rows) {
            return Err(format!("flash_grad's d_lse must be f32{}, found {}", shape_str(rows), args[6]));
        }
        if args[5].shape != out.shape || !args[5].dtype.is_float() {
            return Err(format!("flash_grad's out must be the flash op's result {}, found {}", shape_str(&out.shape), args[5]));
        }
    }
    let batch = &out.shape[..r - 2];
    let heads = |t: &TensorType| {
        let mut shape = batch.to_vec();
        shape.extend_from_slice(&t.shape[r - 2..]);
        TensorType::new(t.dtype, shape)
    };
    match wrt {
        FlashWrt::Q => Ok((*q).clone()),
        FlashWrt::K => Ok(heads(k)),
        FlashWrt::V => Ok(heads(v)),
        FlashWrt::Extra(n) => match extras.get(n) {
            Some(x) if x.dtype.is_float() => Ok((*x).clone()),
            Some(x) => Err(format!("x{n} is {x}: only float operands have gradients")),
            None => Err(format!("x{n} is not an operand ({} extra operands)", extras.len())),
        },
    }
}

/// `flash(q, k, v, extras…)`: q `[…b, M, D]`, k `[…b', N, D]`, v `[…b', N, Dv]` with `b'`
/// broadcasting into `b`; result `[…b, M, Dv]`.
/// A flash op's type: q's batch and row axes, v's width, and the promotion of q's and v's types,
/// or a declared float type at least that wide (the scores may have been widened by a bias).
fn flash(spec: &super::flash_spec::FlashSpec, args: &[&TensorType], declared: Option<&TensorType>) -> Result<TensorType, String> {
    use super::flash_spec::ScoreExpr;
    let [q, k, v, extras @ ..] = args else { return Err("flash takes q, k, v and extra operands".into()) };
    let r = q.rank();
    if r < 2 || k.rank() != r || v.rank() != r || spec.rank != r {
        return Err(format!("flash needs q, k, v of rank {} (found {q}, {k}, {v})", spec.rank));
    }
    if !q.dtype.is_float() || !k.dtype.is_float() || !v.dtype.is_float() {
        return Err(format!("flash needs float q, k, v (found {q}, {k}, {v})"));
    }
    if q.shape[r - 1] != k.shape[r - 1] {
        return Err(format!("q and k head widths differ: {q} and {k}"));
    }
    if let Some(d) = &spec.dropout {
        if !(0.0..1.0).contains(&d.rate) {
            return Err(format!("the dropout rate must be in [0, 1), found {}", d.rate));
        }
        match extras.get(d.seed) {
            Some(t) if t.dtype == DType::I32 && t.rank() == 0 => {}
            other => return Err(format!("flash's dropout seed x{} must be an i32 scalar, found {other:?}", d.seed)),
        }
    }
    if k.shape[r - 2] != v.shape[r - 2] {
        return Err(format!("k and v key counts differ: {k} and {v}"));
    }
    let one = Dim::constant(1);
    for t in [k, v] {
        for (a, b) in q.shape[..r - 2].iter().zip(&t.shape[..r - 2]) {
            if a != b && *b != one {
                return Err(format!("batch dims of {t} do not broadcast into {q}"));
            }
        }
    }
    let mut bad = None;
    let mut check = |e: &ScoreExpr| match e {
        ScoreExpr::Pos(p) if *p >= r => bad = Some(format!("position {p} is out of range for rank {r}")),
        ScoreExpr::Load { input, index } => match extras.get(*input) {
            None => bad = Some(format!("x{input} is not an operand ({} extra operands)", extras.len())),
            Some(t) if t.rank() != index.len() => bad = Some(format!("x{input} is {t} but has {} indices", index.len())),
            _ => {}
        },
        _ => {}
    };
    spec.score.visit(&mut check);
    if let Some(m) = &spec.mask {
        m.visit(&mut check);
        if m.uses_score() {
            bad = Some("the mask cannot depend on the score".into());
        }
    }
    if let Some(msg) = bad {
        return Err(msg);
    }
    if let super::flash_spec::Pair::Additive { weight } = spec.pair {
        let w =
            extras.get(weight).ok_or_else(|| format!("additive weight x{weight} is not an operand ({} extra operands)", extras.len()))?;
        let batch = &q.shape[..r - 2];
        let fits = w.rank() >= 1
            && w.rank() < r
            && w.shape[w.rank() - 1] == q.shape[r - 1]
            && w.shape[..w.rank() - 1].iter().zip(&batch[batch.len() + 1 - w.rank()..]).all(|(a, b)| a == b || *a == one);
        if !w.dtype.is_float() || !fits {
            return Err(format!(
                "additive weight x{weight} must be a float [.., {}] whose batch dims broadcast into {q}, found {w}",
                q.shape[r - 1]
            ));
        }
    }
    let mut shape = q.shape[..r - 1].to_vec();
    shape.push(v.shape[r - 1].clone());
    let natural = TensorType::new(q.dtype.promote(v.dtype), shape);
    match declared {
        None => Ok(natural),
        Some(t) if t.shape == natural.shape && t.dtype.is_float() && natural.dtype.promote(t.dtype) == t.dtype => Ok(t.clone()),
        Some(t) => Err(format!("a flash op over {q}, {k}, {v} gives {natural} or a wider float type, not {t}")),
    }
}
