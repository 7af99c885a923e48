//! The closed set of IR operations, with their names and attributes in the text form.

use super::dim::Dim;
use super::flash_spec::{Dropout, FlashSpec, Pair, ShowExpr, Weights, parse_expr};
use std::fmt;

/// One-operand element-wise operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum UnaryOp {
    /// `-x`
    Neg,
    /// logical not (bool)
    Not,
    /// `e^x`
    Exp,
    /// natural log
    Log,
    /// square root
    Sqrt,
    /// `1/sqrt(x)`
    Rsqrt,
    /// hyperbolic tangent
    Tanh,
    /// `1/(1+e^-x)`
    Sigmoid,
    /// `max(x, 0)`
    Relu,
    /// `x/2 * (1 + erf(x/sqrt(2)))` (exact, as PyTorch's default)
    Gelu,
    /// `x * sigmoid(x)`
    Silu,
    /// `x` if `x > 0` else `e^x - 1`
    Elu,
    /// `|x|`
    Abs,
    /// round toward negative infinity
    Floor,
    /// sine (radians)
    Sin,
    /// cosine (radians)
    Cos,
}

/// Two-operand element-wise operations (operands broadcast numpy-style).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BinaryOp {
    /// `a + b`
    Add,
    /// `a - b`
    Sub,
    /// `a * b`
    Mul,
    /// `a / b` (true division: integer operands give f32)
    Div,
    /// `a % b` (result has the sign of `b`, as Python)
    Rem,
    /// `a ** b`
    Pow,
    /// element-wise minimum
    Min,
    /// element-wise maximum
    Max,
    /// `atan2(a, b)`: the angle of the point (b, a) in radians, in [-π, π] (integer operands
    /// give f32)
    Atan2,
    /// `a < b`
    Lt,
    /// `a <= b`
    Le,
    /// `a > b`
    Gt,
    /// `a >= b`
    Ge,
    /// `a == b`
    Eq,
    /// `a != b`
    Ne,
    /// logical and (bool)
    And,
    /// logical or (bool)
    Or,
}

impl BinaryOp {
    /// Comparisons produce bool.
    pub fn is_comparison(self) -> bool {
        matches!(self, BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge | BinaryOp::Eq | BinaryOp::Ne)
    }

    /// Ops whose result is a float even for integer operands (`/`, `**`, `atan2`).
    pub fn is_always_float(self) -> bool {
        matches!(self, BinaryOp::Div | BinaryOp::Pow | BinaryOp::Atan2)
    }

    /// `and`/`or` take and produce bool.
    pub fn is_logical(self) -> bool {
        matches!(self, BinaryOp::And | BinaryOp::Or)
    }

    /// The infix spelling shared by flash expression text and C (`None` for `**`, `min`,
    /// `max`, which are calls).
    pub fn symbol(self) -> Option<&'static str> {
        Some(match self {
            BinaryOp::Or => "||",
            BinaryOp::And => "&&",
            BinaryOp::Eq => "==",
            BinaryOp::Ne => "!=",
            BinaryOp::Lt => "<",
            BinaryOp::Le => "<=",
            BinaryOp::Gt => ">",
            BinaryOp::Ge => ">=",
            BinaryOp::Add => "+",
            BinaryOp::Sub => "-",
            BinaryOp::Mul => "*",
            BinaryOp::Div => "/",
            BinaryOp::Rem => "%",
            BinaryOp::Pow | BinaryOp::Min | BinaryOp::Max | BinaryOp::Atan2 => return None,
        })
    }
}

/// Reductions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReduceOp {
    /// sum (accumulated in f64 by the interpreter)
    Sum,
    /// maximum (`-inf` for an empty axis)
    Max,
    /// minimum (`inf` for an empty axis)
    Min,
    /// arithmetic mean
    Mean,
    /// `log Σ exp(x)`, computed as `m + log Σ exp(x - m)` with `m` the maximum (`-inf` for an
    /// empty axis or one of only `-inf`; float operands only). Of attention scores over the key
    /// axis it is the softmax's normaliser, which a flash op computes with its result
    /// ([`Op::FlashLse`]).
    LogSumExp,
}

/// Running accumulations along an axis ([`Op::Scan`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ScanOp {
    /// `out_i = x_0 + ... + x_i` (`cumsum`)
    Sum,
    /// `out_i = x_0 · ... · x_i` (`cumprod`)
    Prod,
    /// The linear recurrence `h_i = a_i · h_(i-1) + b_i`, `h_(-1) = 0` (`scan(a, b)`: EMAs)
    Linear,
}

const SCAN: [(ScanOp, &str); 3] = [(ScanOp::Sum, "cumsum"), (ScanOp::Prod, "cumprod"), (ScanOp::Linear, "scan")];

impl ScanOp {
    /// Name in the IR text (also the `.attn` built-in's name).
    pub fn name(self) -> &'static str {
        SCAN.iter().find(|(o, _)| *o == self).map_or("?", |(_, n)| n)
    }

    /// Inverse of [`ScanOp::name`].
    pub fn from_name(name: &str) -> Option<ScanOp> {
        SCAN.iter().find(|(_, n)| *n == name).map(|(o, _)| *o)
    }
}

/// An IR operation. The node's [`super::TensorType`] carries the result shape and dtype, so ops
/// whose result is fully described by it (reshape, cast, iota's shape) carry no other data.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// A program input, by name; params come first in the graph, in signature order.
    Param(String),
    /// A scalar constant (the node's dtype says which kind). May be `inf`/`-inf`.
    Const(f64),
    /// The run-time size of a symbolic dimension, as an i32 scalar (`sqrt(D)`, `mean`).
    DimValue(Dim),
    /// The index along `axis` of each element of the node's (broadcastable) shape, as i32.
    Iota {
        /// Which axis counts.
        axis: usize,
    },
    /// Element-wise, one operand.
    Unary(UnaryOp),
    /// Element-wise, two broadcast operands.
    Binary(BinaryOp),
    /// `where(cond, a, b)`: three broadcast operands.
    Select,
    /// Converts to the node's dtype.
    Cast,
    /// Batched matrix product over the last two axes; leading axes broadcast.
    MatMul,
    /// Permutes axes: output axis `k` is input axis `perm[k]`.
    Transpose {
        /// The permutation.
        perm: Vec<usize>,
    },
    /// Same elements in row-major order, the node's shape.
    Reshape,
    /// `x[..., start:end, ...]` on one axis.
    Slice {
        /// Which axis.
        axis: usize,
        /// First index kept.
        start: Dim,
        /// One past the last index kept.
        end: Dim,
    },
    /// Joins operands along `axis` (other dims equal).
    Concat {
        /// Which axis.
        axis: usize,
    },
    /// `table[i0, i1, ...]`: one i32 index tensor per table axis, broadcast together; the
    /// result has the broadcast index shape. Indices are clamped into range.
    Gather,
    /// `paged(pages, table)`: a paged KV cache read through its block table (vLLM's
    /// PagedAttention). `pages` is `[NP, P, R…]` (NP pages of P rows), `table` is i32 `[B, MP]`
    /// (each sequence's pages in order); the result is `[B, MP·P, R…]` with
    /// `out[b, t, r…] = pages[table[b, t / P], t % P, r…]`, the page id clamped into `[0, NP)`
    /// like a gather's index. A flash op reads it in place (no copy of the cache).
    Paged,
    /// `dropout(x, seed)`: each element of `x` kept and scaled by `1 / (1 − rate)`, or zeroed,
    /// by the counter-based generator of [`super::semantics::dropout_keeps`] under the i32
    /// scalar `seed` and the element's position (last index, the one before, and the row-major
    /// index over the rest). A pure function of its operands and the element's position: the
    /// same seed drops the same elements in every backend, fused into a flash op or not, and in
    /// the backward pass, which drops the cotangent the same way.
    Dropout {
        /// The chance of dropping an element, in `[0, 1)`.
        rate: f64,
    },
    /// Reduces `axes` (sorted, distinct).
    Reduce {
        /// Which reduction.
        op: ReduceOp,
        /// Reduced axes of the operand.
        axes: Vec<usize>,
        /// Keep reduced axes as size 1.
        keepdim: bool,
    },
    /// `exp(x - max) / sum(exp(x - max))` along `axis`; a row that is all `-inf` gives 0s.
    Softmax {
        /// Normalised axis.
        axis: usize,
    },
    /// `(x - mean) / sqrt(var + eps) * gamma + beta` over the last axis (biased variance).
    LayerNorm {
        /// Added to the variance.
        eps: f64,
    },
    /// A running accumulation along `axis` (from the end when `reverse`): every output element
    /// is the accumulation of the elements up to it. Sums and products run in f64 (i64 for
    /// integers, wrapping) and each output is rounded once. `Linear` takes `a` and `b`.
    Scan {
        /// Which accumulation.
        op: ScanOp,
        /// Along which axis.
        axis: usize,
        /// From the last element to the first.
        reverse: bool,
    },
    /// Causal linear attention, `prefix_attention(q, k, v)`: `out[.., i, :] = Σ_{j ≤ i} (q_i ·
    /// k_j) v_j` along the second-to-last axis (`j ≥ i` when `reverse`), for `q`, `k` of
    /// `[.., S, D]` and `v` of `[.., S, Dv]`. It is `sum(q ⊗ cumsum(k ⊗ v), D)` without the
    /// `[.., S, D, Dv]` prefix sums: O(S·D·Dv) time and O(D·Dv) state. Accumulated in f64 per
    /// output element in order of `j`, each output rounded once.
    PrefixAttention {
        /// Each position attends to itself and the later ones.
        reverse: bool,
    },
    /// The indices (i32) that sort `x` along `axis`, ascending or descending, stable
    /// ([`super::semantics::sorts_before`]).
    ArgSort {
        /// Along which axis.
        axis: usize,
        /// Largest first.
        descending: bool,
    },
    /// `scatter_add(base, idx, src)`: `base` with every `src` element added at the position
    /// along `axis` that `idx` (src's shape, i32, clamped into range) names, in order, each sum
    /// rounded to the element type. Other axes match.
    ScatterAdd {
        /// Along which axis.
        axis: usize,
    },
    /// `x / sqrt(mean(x^2) + eps) * gamma` over the last axis.
    RmsNorm {
        /// Added to the mean square.
        eps: f64,
    },
    /// Fused attention `flash(q, k, v, extras...)`: scores, score modification, mask, online
    /// softmax (or sigmoid) and the weighted sum of values, without materialising the scores.
    /// See [`FlashSpec`].
    Flash(Box<FlashSpec>),
    /// The per-row log-sum-exp of a softmax flash op's kept scores, `flash_lse(q, k, v,
    /// extras...)` with the operands of the flash op it belongs to: `f32[..batch, M]`, `-inf` for
    /// a row with every key masked. What the flash backward recomputes the weights from
    /// ([`Op::FlashGrad`]); backends compute it with its flash op when both are live.
    FlashLse(Box<FlashSpec>),
    /// One gradient of a flash op: `flash_grad(q, k, v, d_out, [lse, out,] extras...)`, where
    /// `d_out` is the cotangent of the flash op's result, and for softmax weights `lse` is
    /// [`Op::FlashLse`] and `out` the flash op's result, whose per-row `delta = Σ d_out ∘ out`
    /// the weights' adjoint needs. With `P` the weights and
    /// `dP = d_out · vᵀ`, the score's adjoint is `dF = P (dP - delta)` (softmax) or
    /// `dF = dP · P (1 - P)` (sigmoid), zero wherever `P` is; its chain rule through the score
    /// modification gives `dS = dF · ∂F/∂s`. The result is, by [`FlashWrt`]: `dS · k`
    /// (`q`'s type); `dSᵀ · q` or `Pᵀ · d_out` over the score's batch axes (k's or v's head
    /// shape, unsummed over broadcast batch axes); or an extra operand's gradient, `dF · ∂F/∂x`
    /// added at every index the score modification loads. Backends compute every gradient of one
    /// flash op in one kernel. With `lse_grad`, a further operand after `out`, `d_lse`
    /// (`f32[..batch, M]`), is the cotangent of the op's log-sum-exp (a program that returns
    /// it, or adds attention sinks through it): since `∂lse/∂s = P`, it joins as
    /// `dF = P (dP - (delta - d_lse))`, so it costs nothing per score.
    FlashGrad {
        /// The flash op differentiated.
        spec: Box<FlashSpec>,
        /// Which operand's gradient.
        wrt: FlashWrt,
        /// Whether the log-sum-exp's cotangent `d_lse` is an operand (softmax weights only).
        lse_grad: bool,
    },
}

/// Which operand of a flash op an [`Op::FlashGrad`] is the gradient of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FlashWrt {
    /// The queries.
    Q,
    /// The keys.
    K,
    /// The values.
    V,
    /// Extra operand `n` (0-based after q, k, v), which the score modification loads.
    Extra(usize),
}

impl FlashWrt {
    /// The name in the IR text: `q`, `k`, `v`, `x0`, `x1`, ….
    pub fn name(self) -> String {
        match self {
            FlashWrt::Q => "q".into(),
            FlashWrt::K => "k".into(),
            FlashWrt::V => "v".into(),
            FlashWrt::Extra(n) => format!("x{n}"),
        }
    }

    /// Inverse of [`FlashWrt::name`].
    pub fn from_name(name: &str) -> Option<FlashWrt> {
        match name {
            "q" => Some(FlashWrt::Q),
            "k" => Some(FlashWrt::K),
            "v" => Some(FlashWrt::V),
            _ => name.strip_prefix('x').and_then(|n| n.parse().ok()).map(FlashWrt::Extra),
        }
    }
}

impl FlashSpec {
    /// Operands of an [`Op::FlashGrad`] of this op before its extras: q, k, v, d_out, and for
    /// softmax weights lse and the forward's result, then with `lse_grad` the log-sum-exp's
    /// cotangent.
    pub fn grad_fixed_operands(&self, lse_grad: bool) -> usize {
        match self.weights {
            Weights::Softmax => 6 + usize::from(lse_grad),
            Weights::Sigmoid => 4,
        }
    }
}

/// An attribute value in the IR text form.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    /// `name=q`
    Name(String),
    /// `value=0.125`, `eps=1e-5`
    Float(f64),
    /// `axis=3`
    Int(usize),
    /// `perm=[0, 2, 1, 3]`
    List(Vec<usize>),
    /// `start=0`, `value=D*H`
    Dim(Dim),
    /// `keepdim=true`
    Bool(bool),
}

impl fmt::Display for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attr::Name(s) => f.write_str(s),
            Attr::Float(v) => write!(f, "{v:?}"),
            Attr::Int(v) => write!(f, "{v}"),
            Attr::List(vs) => {
                let parts: Vec<String> = vs.iter().map(|v| v.to_string()).collect();
                write!(f, "[{}]", parts.join(", "))
            }
            Attr::Dim(d) => write!(f, "{d}"),
            Attr::Bool(b) => write!(f, "{b}"),
        }
    }
}

const UNARY: [(UnaryOp, &str); 16] = [
    (UnaryOp::Neg, "neg"),
    (UnaryOp::Not, "not"),
    (UnaryOp::Exp, "exp"),
    (UnaryOp::Log, "log"),
    (UnaryOp::Sqrt, "sqrt"),
    (UnaryOp::Rsqrt, "rsqrt"),
    (UnaryOp::Tanh, "tanh"),
    (UnaryOp::Sigmoid, "sigmoid"),
    (UnaryOp::Relu, "relu"),
    (UnaryOp::Gelu, "gelu"),
    (UnaryOp::Silu, "silu"),
    (UnaryOp::Elu, "elu"),
    (UnaryOp::Abs, "abs"),
    (UnaryOp::Floor, "floor"),
    (UnaryOp::Sin, "sin"),
    (UnaryOp::Cos, "cos"),
];

const BINARY: [(BinaryOp, &str); 17] = [
    (BinaryOp::Add, "add"),
    (BinaryOp::Sub, "sub"),
    (BinaryOp::Mul, "mul"),
    (BinaryOp::Div, "div"),
    (BinaryOp::Rem, "rem"),
    (BinaryOp::Pow, "pow"),
    (BinaryOp::Atan2, "atan2"),
    (BinaryOp::Min, "min"),
    (BinaryOp::Max, "max"),
    (BinaryOp::Lt, "lt"),
    (BinaryOp::Le, "le"),
    (BinaryOp::Gt, "gt"),
    (BinaryOp::Ge, "ge"),
    (BinaryOp::Eq, "eq"),
    (BinaryOp::Ne, "ne"),
    (BinaryOp::And, "and"),
    (BinaryOp::Or, "or"),
];

const REDUCE: [(ReduceOp, &str); 5] = [
    (ReduceOp::Sum, "reduce_sum"),
    (ReduceOp::Max, "reduce_max"),
    (ReduceOp::Min, "reduce_min"),
    (ReduceOp::Mean, "reduce_mean"),
    (ReduceOp::LogSumExp, "reduce_logsumexp"),
];

impl UnaryOp {
    /// Name in the IR text (also the `.attn` built-in's name).
    pub fn name(self) -> &'static str {
        UNARY.iter().find(|(o, _)| *o == self).map_or("?", |(_, n)| n)
    }

    /// Inverse of [`UnaryOp::name`].
    pub fn from_name(name: &str) -> Option<UnaryOp> {
        UNARY.iter().find(|(_, n)| *n == name).map(|(o, _)| *o)
    }
}

impl BinaryOp {
    /// Name in the IR text.
    pub fn name(self) -> &'static str {
        BINARY.iter().find(|(o, _)| *o == self).map_or("?", |(_, n)| n)
    }

    /// Inverse of [`BinaryOp::name`].
    pub fn from_name(name: &str) -> Option<BinaryOp> {
        BINARY.iter().find(|(_, n)| *n == name).map(|(o, _)| *o)
    }
}

/// How many operands an op takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arity {
    /// Exactly this many.
    Exact(usize),
    /// At least this many.
    AtLeast(usize),
}

impl Op {
    /// The op's name in the IR text.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Param(_) => "param",
            Op::Const(_) => "const",
            Op::DimValue(_) => "dim",
            Op::Iota { .. } => "iota",
            Op::Unary(u) => u.name(),
            Op::Binary(b) => b.name(),
            Op::Select => "select",
            Op::Cast => "cast",
            Op::MatMul => "matmul",
            Op::Transpose { .. } => "transpose",
            Op::Reshape => "reshape",
            Op::Slice { .. } => "slice",
            Op::Concat { .. } => "concat",
            Op::Gather => "gather",
            Op::Paged => "paged",
            Op::Dropout { .. } => "dropout",
            Op::Reduce { op, .. } => REDUCE.iter().find(|(o, _)| o == op).map_or("?", |(_, n)| n),
            Op::Softmax { .. } => "softmax",
            Op::Scan { op, .. } => op.name(),
            Op::ArgSort { .. } => "argsort",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::PrefixAttention { .. } => "prefix_attention",
            Op::LayerNorm { .. } => "layernorm",
            Op::RmsNorm { .. } => "rmsnorm",
            Op::Flash(_) => "flash",
            Op::FlashLse(_) => "flash_lse",
            Op::FlashGrad { .. } => "flash_grad",
        }
    }

    /// The op's attributes, in text order.
    pub fn attrs(&self) -> Vec<(&'static str, Attr)> {
        match self {
            Op::Param(n) => vec![("name", Attr::Name(n.clone()))],
            Op::Const(v) => vec![("value", Attr::Float(*v))],
            Op::DimValue(d) => vec![("value", Attr::Dim(d.clone()))],
            Op::Iota { axis } | Op::Concat { axis } | Op::Softmax { axis } | Op::ScatterAdd { axis } => vec![("axis", Attr::Int(*axis))],
            Op::Transpose { perm } => vec![("perm", Attr::List(perm.clone()))],
            Op::Slice { axis, start, end } => {
                vec![("axis", Attr::Int(*axis)), ("start", Attr::Dim(start.clone())), ("end", Attr::Dim(end.clone()))]
            }
            Op::Reduce { axes, keepdim, .. } => vec![("axes", Attr::List(axes.clone())), ("keepdim", Attr::Bool(*keepdim))],
            Op::LayerNorm { eps } | Op::RmsNorm { eps } => vec![("eps", Attr::Float(*eps))],
            Op::Dropout { rate } => vec![("rate", Attr::Float(*rate))],
            Op::Scan { axis, reverse, .. } => vec![("axis", Attr::Int(*axis)), ("reverse", Attr::Bool(*reverse))],
            Op::ArgSort { axis, descending } => vec![("axis", Attr::Int(*axis)), ("descending", Attr::Bool(*descending))],
            Op::PrefixAttention { reverse } => vec![("reverse", Attr::Bool(*reverse))],
            Op::Flash(spec) | Op::FlashLse(spec) => flash_attrs(spec),
            Op::FlashGrad { spec, wrt, lse_grad } => {
                let mut attrs = vec![("wrt", Attr::Name(wrt.name()))];
                if *lse_grad {
                    attrs.push(("lse_grad", Attr::Bool(true)));
                }
                attrs.extend(flash_attrs(spec));
                attrs
            }
            Op::Unary(_) | Op::Binary(_) | Op::Select | Op::Cast | Op::MatMul | Op::Reshape | Op::Gather | Op::Paged => Vec::new(),
        }
    }

    /// Builds an op from its text name and attributes (the IR reader's half of
    /// [`Op::name`]/[`Op::attrs`]). Attribute values must have the kind `attrs` gives them.
    pub fn from_parts(name: &str, attrs: &[(String, Attr)]) -> Result<Op, String> {
        let a = Attrs { op: name, attrs };
        if let Some(u) = UnaryOp::from_name(name) {
            return Ok(Op::Unary(u));
        }
        if let Some(b) = BinaryOp::from_name(name) {
            return Ok(Op::Binary(b));
        }
        if let Some(op) = ScanOp::from_name(name) {
            return Ok(Op::Scan { op, axis: a.int("axis")?, reverse: a.boolean("reverse")? });
        }
        if let Some((op, _)) = REDUCE.iter().find(|(_, n)| *n == name) {
            return Ok(Op::Reduce { op: *op, axes: a.list("axes")?, keepdim: a.boolean("keepdim")? });
        }
        Ok(match name {
            "param" => match a.get("name")? {
                Attr::Name(n) => Op::Param(n.clone()),
                other => return Err(format!("`name` must be a name, found `{other}`")),
            },
            "const" => Op::Const(a.float("value")?),
            "dim" => Op::DimValue(a.dim("value")?),
            "iota" => Op::Iota { axis: a.int("axis")? },
            "select" => Op::Select,
            "cast" => Op::Cast,
            "matmul" => Op::MatMul,
            "transpose" => Op::Transpose { perm: a.list("perm")? },
            "reshape" => Op::Reshape,
            "slice" => Op::Slice { axis: a.int("axis")?, start: a.dim("start")?, end: a.dim("end")? },
            "concat" => Op::Concat { axis: a.int("axis")? },
            "gather" => Op::Gather,
            "paged" => Op::Paged,
            "dropout" => Op::Dropout { rate: a.float("rate")? },
            "scatter_add" => Op::ScatterAdd { axis: a.int("axis")? },
            "argsort" => Op::ArgSort { axis: a.int("axis")?, descending: a.boolean("descending")? },
            "prefix_attention" => Op::PrefixAttention { reverse: a.boolean("reverse")? },
            "softmax" => Op::Softmax { axis: a.int("axis")? },
            "layernorm" => Op::LayerNorm { eps: a.float("eps")? },
            "rmsnorm" => Op::RmsNorm { eps: a.float("eps")? },
            "flash" | "flash_lse" | "flash_grad" => flash_from_parts(&a)?,
            _ => return Err(format!("unknown op `{name}`")),
        })
    }

    /// Operand count.
    pub fn arity(&self) -> Arity {
        match self {
            Op::Param(_) | Op::Const(_) | Op::DimValue(_) | Op::Iota { .. } => Arity::Exact(0),
            Op::Unary(_) | Op::Cast | Op::Transpose { .. } | Op::Reshape | Op::Slice { .. } | Op::Reduce { .. } | Op::Softmax { .. } => {
                Arity::Exact(1)
            }
            Op::Scan { op: ScanOp::Linear, .. } => Arity::Exact(2),
            Op::Scan { .. } | Op::ArgSort { .. } => Arity::Exact(1),
            Op::Binary(_) | Op::MatMul | Op::RmsNorm { .. } | Op::Paged | Op::Dropout { .. } => Arity::Exact(2),
            Op::Select | Op::LayerNorm { .. } | Op::ScatterAdd { .. } | Op::PrefixAttention { .. } => Arity::Exact(3),
            Op::Concat { .. } => Arity::AtLeast(1),
            Op::Gather => Arity::AtLeast(2),
            Op::Flash(_) | Op::FlashLse(_) => Arity::AtLeast(3),
            Op::FlashGrad { spec, lse_grad, .. } => Arity::AtLeast(spec.grad_fixed_operands(*lse_grad)),
        }
    }
}

/// An op's attributes as the IR reader found them, read by kind.
struct Attrs<'a> {
    /// The op's name (for messages).
    op: &'a str,
    attrs: &'a [(String, Attr)],
}

impl Attrs<'_> {
    fn get(&self, key: &str) -> Result<&Attr, String> {
        self.attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v).ok_or_else(|| format!("`{}` needs attribute `{key}`", self.op))
    }

    fn int(&self, key: &str) -> Result<usize, String> {
        match self.get(key)? {
            Attr::Int(v) => Ok(*v),
            Attr::Dim(d) => d.as_const().and_then(|v| usize::try_from(v).ok()).ok_or_else(|| format!("`{key}` must be an integer")),
            other => Err(format!("`{key}` must be an integer, found `{other}`")),
        }
    }

    fn float(&self, key: &str) -> Result<f64, String> {
        match self.get(key)? {
            Attr::Float(v) => Ok(*v),
            Attr::Int(v) => Ok(*v as f64),
            Attr::Dim(d) => d.as_const().map(|v| v as f64).ok_or_else(|| format!("`{key}` must be a number")),
            other => Err(format!("`{key}` must be a number, found `{other}`")),
        }
    }

    fn dim(&self, key: &str) -> Result<Dim, String> {
        match self.get(key)? {
            Attr::Dim(d) => Ok(d.clone()),
            Attr::Int(v) => Ok(Dim::constant(*v as i64)),
            Attr::Name(n) => Dim::parse(n).ok_or_else(|| format!("`{key}` must be a dimension")),
            other => Err(format!("`{key}` must be a dimension, found `{other}`")),
        }
    }

    fn list(&self, key: &str) -> Result<Vec<usize>, String> {
        match self.get(key)? {
            Attr::List(v) => Ok(v.clone()),
            other => Err(format!("`{key}` must be a list, found `{other}`")),
        }
    }

    fn boolean(&self, key: &str) -> Result<bool, String> {
        match self.get(key)? {
            Attr::Bool(b) => Ok(*b),
            other => Err(format!("`{key}` must be true or false, found `{other}`")),
        }
    }

    /// An optional true/false attribute.
    fn flag(&self, key: &str) -> Result<Option<bool>, String> {
        match self.attrs.iter().any(|(k, _)| k == key) {
            true => self.boolean(key).map(Some),
            false => Ok(None),
        }
    }

    /// A quoted expression attribute, if present.
    fn text(&self, key: &str) -> Result<Option<String>, String> {
        match self.attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v) {
            None => Ok(None),
            Some(Attr::Name(t)) => Ok(Some(t.clone())),
            Some(other) => Err(format!("`{key}` must be an expression in quotes, found `{other}`")),
        }
    }
}

/// A `flash`, `flash_lse` or `flash_grad` op from its attributes.
fn flash_from_parts(a: &Attrs) -> Result<Op, String> {
    let rank = a.int("rank")?;
    let weights = match a.text("weights")?.as_deref() {
        Some("softmax") => Weights::Softmax,
        Some("sigmoid") => Weights::Sigmoid,
        other => return Err(format!("`weights` must be softmax or sigmoid, found {other:?}")),
    };
    let score = parse_expr(&a.text("score")?.ok_or("`flash` needs attribute `score`")?, rank).map_err(|e| format!("score: {e}"))?;
    let mask = match a.text("mask")? {
        Some(t) => Some(parse_expr(&t, rank).map_err(|e| format!("mask: {e}"))?),
        None => None,
    };
    let pair = match a.text("pair")? {
        None => Pair::Dot,
        Some(t) => Pair::parse(&t).ok_or_else(|| format!("`pair` must be additive(x<N>), found `{t}`"))?,
    };
    let dropout = match a.attrs.iter().any(|(k, _)| k == "dropout") {
        false => None,
        true => {
            let rate = a.float("dropout")?;
            if !(0.0..1.0).contains(&rate) {
                return Err(format!("`dropout` must be in [0, 1), found {rate}"));
            }
            let seed = match a.text("seed")? {
                Some(t) => t.strip_prefix('x').and_then(|n| n.parse().ok()).ok_or_else(|| format!("`seed` must be x<N>, found `{t}`"))?,
                None => return Err("`dropout` needs attribute `seed`".into()),
            };
            Some(Dropout { rate, seed })
        }
    };
    let spec = Box::new(FlashSpec { rank, weights, score, mask, pair, dropout });
    Ok(match a.op {
        "flash_lse" if spec.weights != Weights::Softmax => return Err("`flash_lse` needs softmax weights".into()),
        "flash_lse" => Op::FlashLse(spec),
        "flash_grad" => {
            let wrt = match a.text("wrt")? {
                Some(w) => FlashWrt::from_name(&w).ok_or_else(|| format!("`wrt` must be q, k, v or x<N>, found `{w}`"))?,
                None => return Err("`flash_grad` needs attribute `wrt`".into()),
            };
            let lse_grad = a.flag("lse_grad")?.unwrap_or(false);
            if lse_grad && spec.weights != Weights::Softmax {
                return Err("`lse_grad` needs softmax weights".into());
            }
            Op::FlashGrad { spec, wrt, lse_grad }
        }
        _ => Op::Flash(spec),
    })
}

/// The attributes of a flash-family op's [`FlashSpec`], in text order.
fn flash_attrs(spec: &FlashSpec) -> Vec<(&'static str, Attr)> {
    let mut attrs = vec![
        ("rank", Attr::Int(spec.rank)),
        ("weights", Attr::Name(spec.weights.name().to_string())),
        ("score", Attr::Name(ShowExpr { expr: &spec.score, rank: spec.rank }.to_string())),
    ];
    if let Some(mask) = &spec.mask {
        attrs.push(("mask", Attr::Name(ShowExpr { expr: mask, rank: spec.rank }.to_string())));
    }
    if let Some(pair) = spec.pair.text() {
        attrs.push(("pair", Attr::Name(pair)));
    }
    if let Some(d) = &spec.dropout {
        attrs.push(("dropout", Attr::Float(d.rate)));
        attrs.push(("seed", Attr::Name(format!("x{}", d.seed))));
    }
    attrs
}
