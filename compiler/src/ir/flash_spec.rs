//! The fused attention op's payload: the per-score expression (score modification), the mask
//! predicate, and how weights are formed.
//!
//! `flash(q, k, v, x0, x1, ...)` computes, for every batch index `b…`, query row `i` and key
//! row `j` of the score tensor `[…batch, M, N]`:
//!
//! ```text
//! s      = q[b…, i, :] · k[b…, j, :]          (k is not transposed; batch dims broadcast)
//!          or Σ_a w[b…, a] · tanh(q[b…, i, a] + k[b…, j, a])   (additive pairing, [`Pair`])
//! score  = F(s, b…, i, j, x0[…], x1[…], …)     the score modification
//! keep   = P(b…, i, j, x…)                      the mask predicate (absent: keep all)
//! w      = softmax_j(keep ? score : -inf)       or sigmoid(score)·keep without normalisation
//! out[b…, i, :] = Σ_j w_ij · z_ij · v[b…, j, :]   z = dropout's factor ([`Dropout`]), else 1
//! ```
//!
//! A row with every key masked gives 0. The expressions print as readable infix text
//! (`s * 0.125 + x0[h] * (j - i)`, `j <= i`) and parse back.

use super::dim::Dim;
use super::op::{BinaryOp, UnaryOp};
use super::semantics::{self, Class, Scalar};
use std::collections::HashMap;
use std::fmt;

/// How attention weights are formed from scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Weights {
    /// `softmax` over the keys (flash attention with online softmax).
    Softmax,
    /// `sigmoid(score)` with no normalisation (sigmoid attention).
    Sigmoid,
}

impl Weights {
    /// Name in the IR text.
    pub fn name(self) -> &'static str {
        match self {
            Weights::Softmax => "softmax",
            Weights::Sigmoid => "sigmoid",
        }
    }
}

/// How a query row and a key row form the raw score `s`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pair {
    /// `s = q_i · k_j` (dot-product attention).
    Dot,
    /// `s = Σ_a w[a] · tanh(q_i[a] + k_j[a])` (additive attention, Bahdanau et al. 2014), with
    /// `w` the extra operand `weight` (`[…b″, D]`, its batch axes right-aligned with the
    /// score's and broadcasting). Printed `additive(x0)`.
    Additive {
        /// Which extra operand holds `w`.
        weight: usize,
    },
}

impl Pair {
    /// The spelling in the IR text (`None` for the default, [`Pair::Dot`]).
    pub fn text(self) -> Option<String> {
        match self {
            Pair::Dot => None,
            Pair::Additive { weight } => Some(format!("additive(x{weight})")),
        }
    }

    /// Inverse of [`Pair::text`].
    pub fn parse(text: &str) -> Option<Pair> {
        let n = text.trim().strip_prefix("additive(x")?.strip_suffix(')')?;
        n.parse().ok().map(|weight| Pair::Additive { weight })
    }

    /// The raw score of one query row and key row by the scalar semantics (`w(a)` reads the
    /// weight), in f64: the reference every backend follows.
    pub fn eval(self, q: &[f64], k: &[f64], w: &dyn Fn(usize) -> f64) -> f64 {
        match self {
            Pair::Dot => q.iter().zip(k).map(|(a, c)| a * c).sum(),
            Pair::Additive { .. } => q.iter().zip(k).enumerate().map(|(a, (x, y))| w(a) * semantics::unary_f(UnaryOp::Tanh, x + y)).sum(),
        }
    }
}

/// A scalar expression evaluated per score element.
#[derive(Clone, Debug, PartialEq)]
pub enum ScoreExpr {
    /// The raw dot product `q_i · k_j`, printed `s`.
    Score,
    /// Index along axis `k` of the score tensor (`i`, `j`, `h`, `b`, …).
    Pos(usize),
    /// A float constant.
    Float(f64),
    /// An integer constant.
    Int(i64),
    /// The run-time size of a dimension (i32), printed `dim(D)`.
    Dim(Dim),
    /// Element of extra operand `input` (0-based among the operands after q, k, v) at the given
    /// indices (clamped into range, like gather), printed `x0[h]`.
    Load {
        /// Which extra operand.
        input: usize,
        /// One index expression per axis of that operand.
        index: Vec<ScoreExpr>,
    },
    /// Element-wise unary op.
    Unary(UnaryOp, Box<ScoreExpr>),
    /// Element-wise binary op.
    Binary(BinaryOp, Box<ScoreExpr>, Box<ScoreExpr>),
    /// `where(c, a, b)`
    Select(Box<ScoreExpr>, Box<ScoreExpr>, Box<ScoreExpr>),
}

/// The payload of [`super::Op::Flash`].
#[derive(Clone, Debug, PartialEq)]
pub struct FlashSpec {
    /// Rank of the score tensor (batch axes + 2); names the positions in the text form.
    pub rank: usize,
    /// Softmax or sigmoid weights.
    pub weights: Weights,
    /// The modified score, a float expression of `s`, positions and loads.
    pub score: ScoreExpr,
    /// Keys where this is false are excluded; `None` keeps every key.
    pub mask: Option<ScoreExpr>,
    /// How `s` is formed from a query row and a key row.
    pub pair: Pair,
    /// Dropout on the weights after the softmax (or sigmoid), before the sum of values.
    pub dropout: Option<Dropout>,
}

/// Dropout of a flash op's weights: `out[b…, i, :] = Σ_j w_ij · z_ij · v[b…, j, :]` with `z_ij`
/// the factor [`super::semantics::dropout_keeps`] gives score element `(batch, i, j)` (`batch` the
/// row-major index over the score's batch axes): `1 / (1 − rate)` or 0. The softmax's
/// normalisation (and the log-sum-exp) is over the weights before dropout, exactly as
/// `dropout(softmax(s)) @ v`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    /// The chance of dropping a weight, in `[0, 1)`.
    pub rate: f64,
    /// The extra operand holding the i32 scalar seed.
    pub seed: usize,
}

impl Dropout {
    /// The factor on weight `(batch, i, j)` under the seed's value.
    pub fn factor(&self, seed: i32, batch: u64, i: u64, j: u64) -> f64 {
        if semantics::dropout_keeps(seed, batch as u32, i as u32, j as u32, self.rate) { semantics::dropout_scale(self.rate) } else { 0.0 }
    }
}

/// Position names for a score tensor of the given rank: `i`, `j` last; batch axes `b`, `h`
/// (rank 3: `b`; rank 4: `b`, `h`; higher: `b0`, `b1`, …).
pub fn position_names(rank: usize) -> Vec<String> {
    let batch = rank.saturating_sub(2);
    let mut names: Vec<String> = match batch {
        0 => vec![],
        1 => vec!["b".into()],
        2 => vec!["b".into(), "h".into()],
        n => (0..n).map(|k| format!("b{k}")).collect(),
    };
    names.push("i".into());
    names.push("j".into());
    names
}

impl ScoreExpr {
    /// `a op b`
    pub fn bin(op: BinaryOp, a: ScoreExpr, b: ScoreExpr) -> ScoreExpr {
        ScoreExpr::Binary(op, Box::new(a), Box::new(b))
    }

    /// True if the expression reads the raw score `s`.
    pub fn uses_score(&self) -> bool {
        self.any(&|e| matches!(e, ScoreExpr::Score))
    }

    /// True if any sub-expression satisfies `f`.
    pub fn any(&self, f: &dyn Fn(&ScoreExpr) -> bool) -> bool {
        f(self)
            || match self {
                ScoreExpr::Load { index, .. } => index.iter().any(|e| e.any(f)),
                ScoreExpr::Unary(_, a) => a.any(f),
                ScoreExpr::Binary(_, a, b) => a.any(f) || b.any(f),
                ScoreExpr::Select(c, a, b) => c.any(f) || a.any(f) || b.any(f),
                _ => false,
            }
    }

    /// Calls `f` on every sub-expression, parents first.
    pub fn visit(&self, f: &mut dyn FnMut(&ScoreExpr)) {
        f(self);
        match self {
            ScoreExpr::Load { index, .. } => index.iter().for_each(|e| e.visit(f)),
            ScoreExpr::Unary(_, a) => a.visit(f),
            ScoreExpr::Binary(_, a, b) => {
                a.visit(f);
                b.visit(f);
            }
            ScoreExpr::Select(c, a, b) => {
                c.visit(f);
                a.visit(f);
                b.visit(f);
            }
            _ => {}
        }
    }

    /// Evaluates the expression at one score element by the scalar semantics of
    /// [`super::semantics`] (the reference every backend follows). `s` is the raw score (an
    /// f32 value), `pos` the element's index along every score axis, `env` the dims, and
    /// `load(input, index)` reads an extra operand at indices already clamped by the caller.
    pub fn eval(&self, s: f64, pos: &[i64], env: &HashMap<String, i64>, load: &dyn Fn(usize, &[i64]) -> Scalar) -> Scalar {
        let ev = |e: &ScoreExpr| e.eval(s, pos, env, load);
        match self {
            ScoreExpr::Score => Scalar::F(s),
            ScoreExpr::Pos(k) => Scalar::I(semantics::wrap_i32(pos.get(*k).copied().unwrap_or(0))),
            ScoreExpr::Float(v) => Scalar::float(*v),
            ScoreExpr::Int(v) => int_literal(*v),
            ScoreExpr::Dim(d) => Scalar::I(semantics::wrap_i32(d.eval(env).unwrap_or(0))),
            ScoreExpr::Load { input, index } => {
                let idx: Vec<i64> = index.iter().map(|e| i64::from(ev(e).as_i())).collect();
                load(*input, &idx)
            }
            ScoreExpr::Unary(u, a) => semantics::unary(*u, ev(a)),
            ScoreExpr::Binary(b, x, y) => semantics::binary(*b, ev(x), ev(y)),
            ScoreExpr::Select(c, a, b) => semantics::select(ev(c), ev(a), ev(b)),
        }
    }

    /// The class of the expression's value; `load` gives each extra operand's class.
    pub fn class(&self, load: &dyn Fn(usize) -> Class) -> Class {
        match self {
            ScoreExpr::Score | ScoreExpr::Float(_) => Class::Float,
            ScoreExpr::Pos(_) | ScoreExpr::Dim(_) => Class::Int,
            ScoreExpr::Int(v) => int_literal(*v).class(),
            ScoreExpr::Load { input, .. } => load(*input),
            ScoreExpr::Unary(u, a) => semantics::unary_class(*u, a.class(load)),
            ScoreExpr::Binary(b, x, y) => semantics::binary_class(*b, x.class(load), y.class(load)),
            ScoreExpr::Select(_, a, b) => semantics::select_class(a.class(load), b.class(load)),
        }
    }
}

/// An integer literal of a score expression: an i32 when it fits, else the nearest f32.
pub fn int_literal(v: i64) -> Scalar {
    match i32::try_from(v) {
        Ok(i) => Scalar::I(i),
        Err(_) => Scalar::float(v as f64),
    }
}

// ---------------------------------------------------------------------------------------------
// Text form

/// The infix spelling and binding strength of `b` (higher binds tighter).
fn infix(b: BinaryOp) -> Option<(&'static str, u8)> {
    let prec = match b {
        BinaryOp::Or => 0,
        BinaryOp::And => 1,
        BinaryOp::Add | BinaryOp::Sub => 3,
        BinaryOp::Mul | BinaryOp::Div | BinaryOp::Rem => 4,
        _ => 2,
    };
    b.symbol().map(|s| (s, prec))
}

/// Displays a [`ScoreExpr`] with the position names of a score tensor of rank `rank`.
pub struct ShowExpr<'a> {
    /// The expression.
    pub expr: &'a ScoreExpr,
    /// Score rank, for position names.
    pub rank: usize,
}

impl fmt::Display for ShowExpr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_expr(f, self.expr, &position_names(self.rank), 0)
    }
}

fn write_expr(f: &mut fmt::Formatter<'_>, e: &ScoreExpr, names: &[String], min_level: u8) -> fmt::Result {
    match e {
        ScoreExpr::Score => f.write_str("s"),
        ScoreExpr::Pos(k) => f.write_str(names.get(*k).map_or("?", |s| s.as_str())),
        ScoreExpr::Float(v) => {
            if *v < 0.0 || (v.is_sign_negative() && *v == 0.0) {
                write!(f, "({v:?})")
            } else {
                write!(f, "{v:?}")
            }
        }
        ScoreExpr::Int(v) => {
            if *v < 0 {
                write!(f, "({v})")
            } else {
                write!(f, "{v}")
            }
        }
        ScoreExpr::Dim(d) => write!(f, "dim({d})"),
        ScoreExpr::Load { input, index } => {
            write!(f, "x{input}[")?;
            for (n, ix) in index.iter().enumerate() {
                if n > 0 {
                    f.write_str(", ")?;
                }
                write_expr(f, ix, names, 0)?;
            }
            f.write_str("]")
        }
        ScoreExpr::Unary(UnaryOp::Neg, a) => {
            let paren = min_level > 5;
            if paren {
                f.write_str("(")?;
            }
            f.write_str("-")?;
            write_expr(f, a, names, 6)?;
            if paren {
                f.write_str(")")?;
            }
            Ok(())
        }
        ScoreExpr::Unary(UnaryOp::Not, a) => {
            f.write_str("!")?;
            write_expr(f, a, names, 6)
        }
        ScoreExpr::Unary(u, a) => {
            write!(f, "{}(", u.name())?;
            write_expr(f, a, names, 0)?;
            f.write_str(")")
        }
        ScoreExpr::Binary(b, x, y) => match infix(*b) {
            Some((sym, level)) => {
                let paren = level < min_level;
                if paren {
                    f.write_str("(")?;
                }
                // Left-associative; comparisons do not chain, so both sides bind tighter.
                let left = if level == 2 { level + 1 } else { level };
                write_expr(f, x, names, left)?;
                write!(f, " {sym} ")?;
                write_expr(f, y, names, level + 1)?;
                if paren {
                    f.write_str(")")?;
                }
                Ok(())
            }
            None => {
                write!(f, "{}(", b.name())?;
                write_expr(f, x, names, 0)?;
                f.write_str(", ")?;
                write_expr(f, y, names, 0)?;
                f.write_str(")")
            }
        },
        ScoreExpr::Select(c, a, b) => {
            f.write_str("where(")?;
            write_expr(f, c, names, 0)?;
            f.write_str(", ")?;
            write_expr(f, a, names, 0)?;
            f.write_str(", ")?;
            write_expr(f, b, names, 0)?;
            f.write_str(")")
        }
    }
}

/// Parses the text form of a score or mask expression for a score tensor of rank `rank`.
pub fn parse_expr(text: &str, rank: usize) -> Result<ScoreExpr, String> {
    let mut p = ExprParser { s: text.as_bytes(), pos: 0, names: position_names(rank) };
    let e = p.expr(0)?;
    p.ws();
    if p.pos != p.s.len() {
        return Err(format!("unexpected `{}` at column {}", &text[p.pos..], p.pos + 1));
    }
    Ok(e)
}

struct ExprParser<'a> {
    s: &'a [u8],
    pos: usize,
    names: Vec<String>,
}

impl ExprParser<'_> {
    fn ws(&mut self) {
        while self.pos < self.s.len() && self.s[self.pos].is_ascii_whitespace() {
            self.pos += 1;
        }
    }

    fn eat(&mut self, t: &str) -> bool {
        self.ws();
        if self.s[self.pos..].starts_with(t.as_bytes()) {
            self.pos += t.len();
            true
        } else {
            false
        }
    }

    fn require(&mut self, t: &str) -> Result<(), String> {
        if self.eat(t) { Ok(()) } else { Err(format!("expected `{t}` at column {}", self.pos + 1)) }
    }

    fn binop(&mut self) -> Option<(BinaryOp, u8, usize)> {
        self.ws();
        let rest = &self.s[self.pos..];
        const OPS: [(&str, BinaryOp); 13] = [
            ("||", BinaryOp::Or),
            ("&&", BinaryOp::And),
            ("==", BinaryOp::Eq),
            ("!=", BinaryOp::Ne),
            ("<=", BinaryOp::Le),
            (">=", BinaryOp::Ge),
            ("<", BinaryOp::Lt),
            (">", BinaryOp::Gt),
            ("+", BinaryOp::Add),
            ("-", BinaryOp::Sub),
            ("*", BinaryOp::Mul),
            ("/", BinaryOp::Div),
            ("%", BinaryOp::Rem),
        ];
        OPS.iter().find(|(t, _)| rest.starts_with(t.as_bytes())).and_then(|(t, op)| infix(*op).map(|(_, l)| (*op, l, t.len())))
    }

    fn expr(&mut self, min_level: u8) -> Result<ScoreExpr, String> {
        let mut lhs = self.unary()?;
        while let Some((op, level, len)) = self.binop() {
            if level < min_level {
                break;
            }
            self.pos += len;
            let rhs = self.expr(level + 1)?;
            lhs = ScoreExpr::bin(op, lhs, rhs);
        }
        Ok(lhs)
    }

    fn unary(&mut self) -> Result<ScoreExpr, String> {
        if self.eat("-") {
            let inner = self.unary()?;
            return Ok(match inner {
                ScoreExpr::Float(v) if v >= 0.0 => ScoreExpr::Float(-v),
                ScoreExpr::Int(v) if v >= 0 => ScoreExpr::Int(-v),
                other => ScoreExpr::Unary(UnaryOp::Neg, Box::new(other)),
            });
        }
        if self.eat("!") {
            return Ok(ScoreExpr::Unary(UnaryOp::Not, Box::new(self.unary()?)));
        }
        self.atom()
    }

    fn word(&mut self) -> String {
        self.ws();
        let start = self.pos;
        while self.pos < self.s.len() && (self.s[self.pos].is_ascii_alphanumeric() || matches!(self.s[self.pos], b'_' | b'.')) {
            self.pos += 1;
        }
        String::from_utf8_lossy(&self.s[start..self.pos]).into_owned()
    }

    fn args(&mut self) -> Result<Vec<ScoreExpr>, String> {
        self.require("(")?;
        let mut out = vec![self.expr(0)?];
        while self.eat(",") {
            out.push(self.expr(0)?);
        }
        self.require(")")?;
        Ok(out)
    }

    fn atom(&mut self) -> Result<ScoreExpr, String> {
        if self.eat("(") {
            let e = self.expr(0)?;
            self.require(")")?;
            return Ok(e);
        }
        let at = self.pos;
        let w = self.word();
        if w.is_empty() {
            return Err(format!("expected an expression at column {}", at + 1));
        }
        if w == "s" {
            return Ok(ScoreExpr::Score);
        }
        if let Some(k) = self.names.iter().position(|n| *n == w) {
            return Ok(ScoreExpr::Pos(k));
        }
        if w.starts_with(|c: char| c.is_ascii_digit()) || w == "inf" || w == "NaN" {
            if let Ok(v) = w.parse::<i64>() {
                return Ok(ScoreExpr::Int(v));
            }
            // `1e-5` stops at `-`: take the exponent's sign and digits too.
            let mut text = w.clone();
            if text.ends_with(['e', 'E']) && (self.eat("-") || self.eat("+")) {
                text.push(char::from(self.s[self.pos - 1]));
                text.push_str(&self.word());
            }
            return text.parse::<f64>().map(ScoreExpr::Float).map_err(|_| format!("bad number `{text}`"));
        }
        if let Some(n) = w.strip_prefix('x').and_then(|n| n.parse::<usize>().ok()) {
            self.require("[")?;
            // `x0[]`: a 0-d operand, one value for every score.
            if self.eat("]") {
                return Ok(ScoreExpr::Load { input: n, index: Vec::new() });
            }
            let mut index = vec![self.expr(0)?];
            while self.eat(",") {
                index.push(self.expr(0)?);
            }
            self.require("]")?;
            return Ok(ScoreExpr::Load { input: n, index });
        }
        if w == "dim" {
            self.require("(")?;
            self.ws();
            let start = self.pos;
            // Up to the matching `)`: a quotient dim is written `(D/2)`.
            let mut depth = 0usize;
            while self.pos < self.s.len() && (self.s[self.pos] != b')' || depth > 0) {
                match self.s[self.pos] {
                    b'(' => depth += 1,
                    b')' => depth -= 1,
                    _ => {}
                }
                self.pos += 1;
            }
            let text = String::from_utf8_lossy(&self.s[start..self.pos]).into_owned();
            self.require(")")?;
            return Dim::parse(&text).map(ScoreExpr::Dim).ok_or_else(|| format!("bad dimension `{text}`"));
        }
        if w == "where" {
            let a = self.args()?;
            return match <[ScoreExpr; 3]>::try_from(a) {
                Ok([c, x, y]) => Ok(ScoreExpr::Select(Box::new(c), Box::new(x), Box::new(y))),
                Err(_) => Err("`where` takes 3 arguments".into()),
            };
        }
        if let Some(u) = UnaryOp::from_name(&w) {
            let a = self.args()?;
            return match <[ScoreExpr; 1]>::try_from(a) {
                Ok([x]) => Ok(ScoreExpr::Unary(u, Box::new(x))),
                Err(_) => Err(format!("`{w}` takes 1 argument")),
            };
        }
        if let Some(b) = BinaryOp::from_name(&w) {
            let a = self.args()?;
            return match <[ScoreExpr; 2]>::try_from(a) {
                Ok([x, y]) => Ok(ScoreExpr::bin(b, x, y)),
                Err(_) => Err(format!("`{w}` takes 2 arguments")),
            };
        }
        Err(format!("unknown name `{w}` at column {}", at + 1))
    }
}
