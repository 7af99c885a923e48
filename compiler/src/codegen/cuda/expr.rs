//! Values computed in place: the C statements that compute one element of a value at a given
//! multi-index, inlining every op that is not materialised in a buffer (element-wise maths,
//! constants, iota, dim values, casts, and the movement ops: transpose, reshape, slice,
//! concat, gather). This is how element-wise chains fuse into their consumer: a softmax reads
//! `exp(x - m)` of `scale * (q @ k.T) + bias[h]` straight from the matmul's buffer.
//!
//! Each computed node becomes one `const` local, memoised per (node, index), so a value used
//! twice at the same index is computed once.

use super::cexpr::{cdim, convert, ctype, float_lit, int_lit, is_one, load, offset, round_to, row_major, to_float, to_int};
use super::view::reshape_groups;
use crate::ir::{BinaryOp, DType, Dim, Graph, Op, UnaryOp, Value};
use std::collections::HashMap;

/// Statement generator for one scope of one kernel.
pub(super) struct Gen<'a> {
    g: &'a Graph,
    bufs: &'a HashMap<Value, usize>,
    /// Statements emitted so far (caller indents them).
    pub lines: Vec<String>,
    memo: HashMap<(Value, Vec<String>), String>,
    prefix: String,
    next: usize,
}

impl<'a> Gen<'a> {
    /// A generator whose locals are named `v{prefix}{n}` (the prefix keeps names unique when a
    /// kernel has several generated scopes; the `v` keeps them apart from the parameters `b{n}`,
    /// `d_{name}`, `s{n}`).
    pub fn new(g: &'a Graph, bufs: &'a HashMap<Value, usize>, prefix: &str) -> Gen<'a> {
        Gen { g, bufs, lines: Vec::new(), memo: HashMap::new(), prefix: prefix.to_string(), next: 0 }
    }

    fn fresh(&mut self) -> String {
        self.next += 1;
        format!("v{}{}", self.prefix, self.next)
    }

    fn bind(&mut self, key: (Value, Vec<String>), dtype: DType, expr: String) -> String {
        let name = self.fresh();
        self.lines.push(format!("const {} {name} = {expr};", ctype(dtype)));
        self.memo.insert(key, name.clone());
        name
    }

    fn int_var(&mut self, expr: String) -> String {
        let name = self.fresh();
        self.lines.push(format!("const i64 {name} = {expr};"));
        name
    }

    /// The value of `v` at `idx` (one index expression per axis), in `v`'s compute type: a
    /// load if `v` is in a buffer, else its op computed in place.
    pub fn value(&mut self, v: Value, idx: &[String]) -> String {
        match self.bufs.get(&v) {
            Some(buf) => {
                let key = (v, idx.to_vec());
                if let Some(name) = self.memo.get(&key) {
                    return name.clone();
                }
                let node = self.g.node(v);
                let off = offset(idx, &row_major(&node.ty.shape), &Dim::constant(0));
                let text = load(*buf, node.ty.dtype, &off);
                self.bind(key, node.ty.dtype, text)
            }
            None => self.define(v, idx),
        }
    }

    /// `v`'s own op computed at `idx` from its operands (even when `v` has a buffer: this is
    /// how the kernel that fills the buffer computes it).
    pub fn define(&mut self, v: Value, idx: &[String]) -> String {
        let key = (v, idx.to_vec());
        if let Some(name) = self.memo.get(&key) {
            return name.clone();
        }
        let node = self.g.node(v);
        let dtype = node.ty.dtype;
        let ops = self.g.operands(v);
        let dt = |w: Value| self.g.node(w).ty.dtype;
        let text = match &node.op {
            Op::Const(c) => match dtype {
                DType::I32 => int_lit(DType::I32.round(*c) as i64),
                DType::Bool => (if *c != 0.0 { "true" } else { "false" }).to_string(),
                _ => float_lit(dtype.round(*c)),
            },
            Op::DimValue(d) => cdim(d),
            Op::Iota { axis } => idx.get(*axis).cloned().unwrap_or_else(|| "0LL".into()),
            Op::Unary(u) => {
                let x = self.operand_at(ops[0], idx);
                unary(*u, &x, dt(ops[0]), dtype)
            }
            Op::Binary(b) => {
                let x = self.operand_at(ops[0], idx);
                let y = self.operand_at(ops[1], idx);
                binary(*b, &x, dt(ops[0]), &y, dt(ops[1]), dtype)
            }
            Op::Select => {
                let c = self.operand_at(ops[0], idx);
                let a = self.operand_at(ops[1], idx);
                let b = self.operand_at(ops[2], idx);
                format!("({c} ? {} : {})", convert(&a, dt(ops[1]), dtype), convert(&b, dt(ops[2]), dtype))
            }
            Op::Cast => {
                let x = self.operand_at(ops[0], idx);
                convert(&x, dt(ops[0]), dtype)
            }
            Op::Transpose { perm } => {
                let mut sub = vec!["0LL".to_string(); perm.len()];
                for (k, p) in perm.iter().enumerate() {
                    if let (Some(slot), Some(i)) = (sub.get_mut(*p), idx.get(k)) {
                        *slot = i.clone();
                    }
                }
                self.value(ops[0], &sub)
            }
            Op::Slice { axis, start, .. } => {
                let mut sub = idx.to_vec();
                if let Some(i) = sub.get_mut(*axis)
                    && start.as_const() != Some(0)
                {
                    *i = format!("({i} + {})", cdim(start));
                }
                self.value(ops[0], &sub)
            }
            Op::Reshape => {
                let sub = self.reshape_index(ops[0], &node.ty.shape, idx);
                self.value(ops[0], &sub)
            }
            Op::Concat { axis } => return self.concat(v, &ops, *axis, idx),
            Op::Gather => {
                let table_shape = self.g.node(ops[0]).ty.shape.clone();
                let mut sub = Vec::new();
                for (k, w) in ops[1..].iter().enumerate() {
                    let i = self.operand_at(*w, idx);
                    let i = to_int(&i, dt(*w));
                    let size = table_shape.get(k).map_or_else(|| "1LL".to_string(), cdim);
                    sub.push(self.int_var(format!("attnc_clampi({i}, {size})")));
                }
                self.value(ops[0], &sub)
            }
            // Params and the ops that always have a buffer are read, never recomputed.
            Op::Param(_)
            | Op::MatMul
            | Op::Reduce { .. }
            | Op::Softmax { .. }
            | Op::LayerNorm { .. }
            | Op::RmsNorm { .. }
            | Op::Flash(_) => match self.bufs.get(&v) {
                Some(buf) => {
                    let off = offset(idx, &row_major(&node.ty.shape), &Dim::constant(0));
                    load(*buf, dtype, &off)
                }
                None => format!("/* %{} has no buffer */ 0", v.index()),
            },
        };
        self.bind(key, dtype, text)
    }

    /// Operand `w` of an element-wise node read at the node's index `idx` (numpy broadcast:
    /// missing leading axes dropped, size-1 axes read at 0).
    fn operand_at(&mut self, w: Value, idx: &[String]) -> String {
        let shape = self.g.node(w).ty.shape.clone();
        let sub = broadcast_index(idx, &shape);
        self.value(w, &sub)
    }

    /// The operand index of a reshape: linearise within each group of axes whose products
    /// match, then split into the operand's axes (no division for a group of one axis).
    fn reshape_index(&mut self, x: Value, to: &[Dim], idx: &[String]) -> Vec<String> {
        let from = self.g.node(x).ty.shape.clone();
        let groups = reshape_groups(&from, to).unwrap_or_else(|| {
            let old: Vec<usize> = (0..from.len()).filter(|a| !is_one(&from[*a])).collect();
            let new: Vec<usize> = (0..to.len()).filter(|a| !is_one(&to[*a])).collect();
            vec![(old, new)]
        });
        let mut sub = vec!["0LL".to_string(); from.len()];
        for (old, new) in groups {
            let lin = match new.as_slice() {
                [b] => idx[*b].clone(),
                _ => {
                    let mut inner = Dim::constant(1);
                    let mut terms = Vec::new();
                    for b in new.iter().rev() {
                        terms.push(if inner.as_const() == Some(1) { idx[*b].clone() } else { format!("{} * {}", idx[*b], cdim(&inner)) });
                        inner = inner.mul(&to[*b]);
                    }
                    let sum = if terms.is_empty() { "0LL".to_string() } else { terms.join(" + ") };
                    self.int_var(sum)
                }
            };
            match old.as_slice() {
                [a] => sub[*a] = lin,
                _ => {
                    for (k, a) in old.iter().enumerate() {
                        let inner = Dim::product(old[k + 1..].iter().map(|o| &from[*o]));
                        let div = if inner.as_const() == Some(1) { lin.clone() } else { format!("({lin} / {})", cdim(&inner)) };
                        let expr = if k == 0 { div } else { format!("({div} % {})", cdim(&from[*a])) };
                        sub[*a] = self.int_var(expr);
                    }
                }
            }
        }
        sub
    }

    /// Concat: only the operand that owns the index is read (the others would read out of
    /// range), so each operand's statements go in their own branch.
    fn concat(&mut self, v: Value, ops: &[Value], axis: usize, idx: &[String]) -> String {
        let dtype = self.g.node(v).ty.dtype;
        let name = self.fresh();
        self.lines.push(format!("{} {name};", ctype(dtype)));
        let mut start = Dim::constant(0);
        for (t, w) in ops.iter().enumerate() {
            let size = self.g.node(*w).ty.shape.get(axis).cloned().unwrap_or_else(|| Dim::constant(0));
            let end = start.add(&size);
            let mut sub = idx.to_vec();
            if let Some(i) = sub.get_mut(axis)
                && start.as_const() != Some(0)
            {
                *i = format!("({i} - {})", cdim(&start));
            }
            let outer_lines = std::mem::take(&mut self.lines);
            let outer_memo = self.memo.clone();
            let x = self.value(*w, &sub);
            let x = convert(&x, self.g.node(*w).ty.dtype, dtype);
            self.lines.push(format!("{name} = {x};"));
            let body = std::mem::replace(&mut self.lines, outer_lines);
            self.memo = outer_memo;
            let last = t + 1 == ops.len();
            let head = match (t, last) {
                (0, true) => "{".to_string(),
                (0, false) => format!("if ({} < {}) {{", idx[axis], cdim(&end)),
                (_, true) => "} else {".to_string(),
                (_, false) => format!("}} else if ({} < {}) {{", idx[axis], cdim(&end)),
            };
            self.lines.push(head);
            self.lines.extend(body.into_iter().map(|l| format!("  {l}")));
            start = end;
        }
        self.lines.push("}".to_string());
        self.memo.insert((v, idx.to_vec()), name.clone());
        name
    }
}

/// The index of an operand of shape `shape` broadcast to an index of higher or equal rank.
pub(super) fn broadcast_index(idx: &[String], shape: &[Dim]) -> Vec<String> {
    let lead = idx.len().saturating_sub(shape.len());
    shape
        .iter()
        .enumerate()
        .map(|(a, d)| if is_one(d) { "0LL".to_string() } else { idx.get(a + lead).cloned().unwrap_or_else(|| "0LL".into()) })
        .collect()
}

/// A unary op on a compute-type operand `x` of dtype `from`, giving dtype `to`.
pub(super) fn unary(u: UnaryOp, x: &str, from: DType, to: DType) -> String {
    if to == DType::I32 {
        let x = to_int(x, from);
        return match u {
            UnaryOp::Neg => format!("attnc_sat32(-{x})"),
            UnaryOp::Abs => format!("attnc_sat32(attnc_iabs({x}))"),
            UnaryOp::Relu => format!("({x} > 0LL ? {x} : 0LL)"),
            _ => x,
        };
    }
    if to == DType::Bool {
        return format!("(!{x})");
    }
    let f = to_float(x, from);
    let text = match u {
        UnaryOp::Neg => format!("(-{f})"),
        UnaryOp::Not => format!("(({f}) == 0.0f ? 1.0f : 0.0f)"),
        UnaryOp::Exp => format!("expf({f})"),
        UnaryOp::Log => format!("logf({f})"),
        UnaryOp::Sqrt => format!("sqrtf({f})"),
        UnaryOp::Rsqrt => format!("attnc_rsqrt({f})"),
        UnaryOp::Tanh => format!("tanhf({f})"),
        UnaryOp::Sigmoid => format!("attnc_sigmoid({f})"),
        UnaryOp::Relu => format!("attnc_relu({f})"),
        UnaryOp::Gelu => format!("attnc_gelu({f})"),
        UnaryOp::Silu => format!("attnc_silu({f})"),
        UnaryOp::Elu => format!("attnc_elu({f})"),
        UnaryOp::Abs => format!("fabsf({f})"),
        UnaryOp::Floor => format!("floorf({f})"),
    };
    round_to(to, &text)
}

/// A binary op on compute-type operands, giving dtype `to` (comparisons compare in the
/// promoted type of the operands).
pub(super) fn binary(b: BinaryOp, x: &str, xt: DType, y: &str, yt: DType, to: DType) -> String {
    let op = b.symbol().unwrap_or_default();
    if b.is_logical() {
        return format!("({} {op} {})", convert(x, xt, DType::Bool), convert(y, yt, DType::Bool));
    }
    if b.is_comparison() {
        let p = xt.promote(yt);
        return if p.is_float() {
            format!("({} {op} {})", to_float(x, xt), to_float(y, yt))
        } else {
            format!("({} {op} {})", to_int(x, xt), to_int(y, yt))
        };
    }
    if to == DType::I32 {
        let (a, c) = (to_int(x, xt), to_int(y, yt));
        return match b {
            BinaryOp::Add => format!("attnc_sat32({a} + {c})"),
            BinaryOp::Sub => format!("attnc_sat32({a} - {c})"),
            BinaryOp::Mul => format!("attnc_sat32({a} * {c})"),
            BinaryOp::Rem => format!("attnc_irem({a}, {c})"),
            BinaryOp::Min => format!("({a} < {c} ? {a} : {c})"),
            BinaryOp::Max => format!("({a} > {c} ? {a} : {c})"),
            // Division and powers of integers are float ops (the type rules say f32).
            _ => format!("attnc_f2i({})", binary(b, x, xt, y, yt, DType::F32)),
        };
    }
    let (a, c) = (to_float(x, xt), to_float(y, yt));
    let text = match b {
        BinaryOp::Add => format!("({a} + {c})"),
        BinaryOp::Sub => format!("({a} - {c})"),
        BinaryOp::Mul => format!("({a} * {c})"),
        BinaryOp::Div => format!("({a} / {c})"),
        BinaryOp::Rem => format!("attnc_frem({a}, {c})"),
        BinaryOp::Pow => format!("powf({a}, {c})"),
        BinaryOp::Min => format!("attnc_fmin({a}, {c})"),
        BinaryOp::Max => format!("attnc_fmax({a}, {c})"),
        _ => "0.0f".to_string(),
    };
    if to == DType::Bool { format!("({text} != 0.0f)") } else { round_to(to, &text) }
}
