//! The schedule's text form: what `attnc build --emit schedule` prints and the snapshots pin.
//!
//! ```text
//! schedule sdpa for cpu
//!   ints:
//!     t0 = items of step 0
//!     t1 = S
//!   buffers:
//!     b0 = param 0: %0 f32[D*H*S*B]
//!   step 0: %4 flash over t0 items
//!     flash tiled, weights softmax, score "s", mask "j <= i", alpha "0.125"
//!       q = b0 f32 +0 [B, H, S, D] / [D*H*S, D*S, D, 1]
//! ```

use super::{BufferKind, Expr, FlashKernel, IntValue, Kernel, Schedule, View};
use crate::ir::ShowExpr;
use std::fmt::{self, Write};

impl fmt::Display for View {
    /// `b3 f32 +S*D [B, S, D] / [D*S, D, 1]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |ds: &[crate::ir::Dim]| ds.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ");
        write!(f, "b{} {} +{} [{}] / [{}]", self.buf, self.dtype, self.offset, list(&self.shape), list(&self.strides))
    }
}

impl fmt::Display for Expr {
    /// Infix, fully parenthesised: `exp((in0 * 2.0:f32))`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::Load(k) => write!(f, "in{k}"),
            Expr::Const(v, t) => write!(f, "{v:?}:{t}"),
            Expr::Dim(d) => write!(f, "dim({d})"),
            Expr::Iota { axis, rank, one } => write!(f, "iota({axis} of {rank}{})", if *one { ", size 1" } else { "" }),
            Expr::Unary(u, a, _) => write!(f, "{}({a})", u.name()),
            Expr::Binary(b, x, y, _) => match b.symbol() {
                Some(s) => write!(f, "({x} {s} {y})"),
                None => write!(f, "{}({x}, {y})", b.name()),
            },
            Expr::Select(c, a, b, _) => write!(f, "where({c}, {a}, {b})"),
            Expr::Cast(a, t) => write!(f, "cast({a}, {t})"),
            Expr::Gather(t, idx, ..) => {
                let idx: Vec<String> = idx.iter().map(|e| e.to_string()).collect();
                write!(f, "in{t}[{}]", idx.join(", "))
            }
            Expr::DropoutBits(a) => write!(f, "dropout_bits({}, {}, {}, {})", a[0], a[1], a[2], a[3]),
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "schedule {} for {}", self.name, self.target.name())?;
        writeln!(f, "  ints:")?;
        for (i, v) in self.ints.iter().enumerate() {
            match v {
                IntValue::Dim(d) => writeln!(f, "    t{i} = {d}")?,
                IntValue::Tuning { step, param } => writeln!(f, "    t{i} = {param:?} of step {step}")?,
            }
        }
        writeln!(f, "  buffers:")?;
        for (i, b) in self.buffers.iter().enumerate() {
            let kind = match &b.kind {
                BufferKind::Param(k) => format!("param {k}"),
                BufferKind::Output(k) => format!("output {k}"),
                BufferKind::Temp => "temp".to_string(),
                BufferKind::TileTable { step } => format!("tile table of step {step}"),
                BufferKind::Partials { step } => format!("partial states of step {step}"),
                BufferKind::Fault => "fault record (index checks)".to_string(),
            };
            match b.kind {
                BufferKind::TileTable { .. } | BufferKind::Partials { .. } => {
                    writeln!(f, "    b{i} = {kind}: %{}, sized per run", b.value)?
                }
                _ => writeln!(f, "    b{i} = {kind}: %{} {}[{}]", b.value, b.dtype, b.elems)?,
            }
        }
        for c in &self.checks {
            writeln!(f, "  check {}: {} <= {} <= {} on axis {}", c.node, c.start, c.end, c.size, c.axis)?;
        }
        for (i, s) in self.steps.iter().enumerate() {
            writeln!(f, "  step {i}: {} over t{} items", s.label, s.work)?;
            let mut body = String::new();
            kernel(&mut body, &s.kernel)?;
            for line in body.lines() {
                writeln!(f, "    {line}")?;
            }
        }
        Ok(())
    }
}

fn kernel(out: &mut String, k: &Kernel) -> fmt::Result {
    match k {
        Kernel::Elementwise { out: o, inputs, expr, more } => {
            writeln!(out, "elementwise {expr}")?;
            writeln!(out, "  out = {o}")?;
            for (n, (o, e)) in more.iter().enumerate() {
                writeln!(out, "  and {e}")?;
                writeln!(out, "  out{} = {o}", n + 1)?;
            }
            for (n, v) in inputs.iter().enumerate() {
                writeln!(out, "  in{n} = {v}")?;
            }
        }
        Kernel::MatMul { a, b, c, b_transposed, variant } => {
            writeln!(out, "matmul {}{}", variant.name(), if *b_transposed { ", b transposed" } else { "" })?;
            writeln!(out, "  a = {a}\n  b = {b}\n  c = {c}")?;
        }
        Kernel::Reduce { x, op, axes, out: o } => writeln!(out, "reduce {op:?} over axes {axes:?}\n  x = {x}\n  out = {o}")?,
        Kernel::ReduceOf { x, op, axes, out: o } => {
            let shape: Vec<String> = x.shape.iter().map(|d| d.to_string()).collect();
            writeln!(out, "reduce {op:?} over axes {axes:?} of {} [{}] {}", x.dtype.name(), shape.join(", "), x.expr)?;
            writeln!(out, "  out = {o}")?;
            for (n, v) in x.inputs.iter().enumerate() {
                writeln!(out, "  in{n} = {v}")?;
            }
        }
        Kernel::Softmax { x, axis, out: o } => writeln!(out, "softmax over axis {axis}\n  x = {x}\n  out = {o}")?,
        Kernel::Dropout { x, seed, rate, out: o } => writeln!(out, "dropout rate {rate} by rows\n  x = {x}\n  seed = {seed}\n  out = {o}")?,
        Kernel::ScatterAdd { base, idx, src, axis, out: o, .. } => {
            writeln!(out, "scatter_add along axis {axis}\n  base = {base}\n  idx = {idx}\n  src = {src}\n  out = {o}")?
        }
        Kernel::PrefixAttention { q, k, v, reverse, out: o } => writeln!(
            out,
            "prefix_attention{} in blocks of {}\n  q = {q}\n  k = {k}\n  v = {v}\n  out = {o}",
            if *reverse { ", reverse" } else { "" },
            super::PREFIX_BLOCK
        )?,
        Kernel::ArgSort { x, axis, descending, out: o, scratch, limit } => {
            let first = limit.map_or(String::new(), |k| format!(", first {k} read"));
            writeln!(out, "argsort along axis {axis}{}{first}\n  x = {x}\n  out = {o}", if *descending { ", descending" } else { "" })?;
            if let Some(s) = scratch {
                writeln!(out, "  scratch = {s}")?;
            }
        }
        Kernel::Scan { op, a, x, axis, reverse, out: o } => {
            writeln!(out, "{} along axis {axis}{}", op.name(), if *reverse { ", reversed" } else { "" })?;
            if let Some(a) = a {
                writeln!(out, "  a = {a}")?;
            }
            writeln!(out, "  x = {x}\n  out = {o}")?
        }
        Kernel::Norm { x, gamma, beta, eps, out: o } => {
            writeln!(out, "{} eps {eps:?}\n  x = {x}\n  gamma = {gamma}", if beta.is_some() { "layernorm" } else { "rmsnorm" })?;
            if let Some(b) = beta {
                writeln!(out, "  beta = {b}")?;
            }
            writeln!(out, "  out = {o}")?;
        }
        Kernel::Flash(fk) => flash(out, fk)?,
        Kernel::FlashMerge(fk) => writeln!(out, "flash merge of step {} into b{}, partial states b{}", fk.step, fk.out.buf, fk.partials)?,
        Kernel::FlashBwd(fk) => flash_bwd(out, fk)?,
        Kernel::FlashBwdReduce(fk) => {
            let results: Vec<String> = fk.dx.iter().map(|(n, x)| format!("dx{n} = b{}", x.buf)).collect();
            writeln!(out, "flash backward sums of step {} from partial sums b{} into {}", fk.step, fk.partials, results.join(", "))?
        }
    }
    Ok(())
}

fn flash_bwd(out: &mut String, fk: &super::FlashBwdKernel) -> fmt::Result {
    let rank = fk.spec.rank;
    let show = |e: &crate::ir::ScoreExpr| ShowExpr { expr: e, rank }.to_string();
    write!(out, "flash backward {}, weights {}, score \"{}\"", fk.variant.name(), fk.spec.weights.name(), show(&fk.spec.score))?;
    if let Some(m) = &fk.spec.mask {
        write!(out, ", mask \"{}\"", show(m))?;
    }
    if let Some(d) = &fk.spec.dropout {
        write!(out, ", dropout {} (seed x{})", d.rate, d.seed)?;
    }
    writeln!(out, ", dscore \"{}\"", show(&fk.grad.ds))?;
    writeln!(out, "  q = {}\n  k = {}\n  v = {}\n  d_out = {}", fk.q, fk.k, fk.v, fk.d_out)?;
    if let Some(c) = &fk.q_scale {
        writeln!(out, "  q scaled by \"{}\"", show(c))?;
    }
    if let Some(c) = &fk.dq_scale {
        writeln!(out, "  dq scaled by \"{}\"", show(c))?;
    }
    if let Some((lse, fwd)) = &fk.lse {
        writeln!(out, "  lse = {lse}\n  out = {fwd}")?;
    }
    if let Some(delta) = &fk.delta {
        writeln!(out, "  delta = {delta}")?;
    }
    if let Some(d_lse) = &fk.d_lse {
        writeln!(out, "  delta less d_lse = {d_lse}")?;
    }
    for (n, x) in fk.extras.iter().enumerate() {
        writeln!(out, "  x{n} = {x}")?;
    }
    for (name, r) in [("dq", &fk.dq), ("dq summed atomically into", &fk.dq_accum), ("dk", &fk.dk), ("dv", &fk.dv)] {
        if let Some(r) = r {
            writeln!(out, "  {name} = {r}")?;
        }
    }
    for (n, x) in &fk.dx {
        writeln!(out, "  dx{n} = {x}")?;
    }
    for l in &fk.grad.loads {
        let index: Vec<String> = l.index.iter().map(&show).collect();
        writeln!(out, "  d x{}[{}] += dF * \"{}\"", l.input, index.join(", "), show(&l.d))?;
    }
    if let Some(lin) = &fk.linear {
        let mut t = String::from("  unmasked tiles by the row kernel:");
        if let Some(a) = &lin.alpha {
            t.push_str(&format!(" alpha \"{}\",", show(a)));
        }
        t.push_str(if lin.tanh { " u = tanh(alpha s)," } else { " u = alpha s," });
        t.push_str(&format!(" factor \"{}\"", lin.factor.as_ref().map_or("1".to_string(), &show)));
        if let Some(sep) = &lin.sep {
            t.push_str(&format!(", separable \"{}\"", show(sep)));
        }
        if let Some(k) = lin.sum_load {
            t.push_str(&format!(", summing d x{}", fk.grad.loads[k].input));
        }
        writeln!(out, "{t}")?;
    }
    writeln!(out, "  tiles = b{}, partial sums = b{}", fk.tiles, fk.partials)
}

fn flash(out: &mut String, fk: &FlashKernel) -> fmt::Result {
    let rank = fk.spec.rank;
    let show = |e: &crate::ir::ScoreExpr| ShowExpr { expr: e, rank }.to_string();
    let a = &fk.analysis;
    write!(out, "flash {}, weights {}, score \"{}\"", fk.variant.name(), fk.spec.weights.name(), show(&a.score))?;
    if let Some(m) = &fk.spec.mask {
        write!(out, ", mask \"{}\"", show(m))?;
    }
    if let Some(d) = &fk.spec.dropout {
        write!(out, ", dropout {} (seed x{})", d.rate, d.seed)?;
    }
    if let Some(al) = &a.alpha {
        write!(out, ", alpha \"{}\"", show(al))?;
    }
    writeln!(out)?;
    writeln!(out, "  q = {}\n  k = {}\n  v = {}", fk.q, fk.k, fk.v)?;
    for (name, p) in [("k", &fk.k_paging), ("v", &fk.v_paging)] {
        if let Some(p) = p {
            writeln!(
                out,
                "  {name} paged: table {} by axis {}, {} rows a page, {} pages {} apart",
                p.table, p.axis, p.page, p.pages, p.stride
            )?;
        }
    }
    for (n, x) in fk.extras.iter().enumerate() {
        writeln!(out, "  x{n} = {x}")?;
    }
    writeln!(out, "  out = {}\n  tiles = b{}, partial states = b{}", fk.out, fk.tiles, fk.partials)?;
    if let Some(lse) = &fk.lse {
        writeln!(out, "  lse = {lse}")?;
    }
    let staged = |s: &super::analysis::StagedScore| {
        let mut t = format!("\"{}\"", show(&s.expr));
        if s.tanh {
            t.push_str(" after tanh(s)");
        }
        match &s.factor {
            Some(Some(c)) => t.push_str(&format!(", factor \"{}\"", show(c))),
            Some(None) => t.push_str(", plain"),
            None => {}
        }
        t
    };
    if a.staged.tanh || a.staged.factor.is_some() {
        writeln!(out, "  evaluated as {}", staged(&a.staged))?;
    }
    if let Some((sep, rest)) = &a.separated {
        writeln!(
            out,
            "  separable: \"{}\" per {}; rest {}",
            show(&sep.sep),
            if a.key_bias { "key" } else { "row (drops out)" },
            staged(rest)
        )?;
    }
    Ok(())
}
