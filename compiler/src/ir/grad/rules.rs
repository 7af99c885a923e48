//! The derivative rules of the element-wise ops, written once over any [`Algebra`]: the graph
//! builder of [`super::differentiate`] builds them as IR nodes, and a flash op's derivative
//! ([`super::score`]) builds them as score expressions, so the two can never disagree.

use crate::ir::op::{BinaryOp, UnaryOp};
use std::f64::consts::PI;

/// What a derivative rule builds with: values of some kind and the element-wise ops on them.
pub(crate) trait Algebra {
    /// A value (an IR node, a score expression).
    type V: Clone;
    /// Why building failed.
    type E;

    /// `op(a)`.
    fn unary(&mut self, op: UnaryOp, a: Self::V) -> Result<Self::V, Self::E>;
    /// `a op b`.
    fn binary(&mut self, op: BinaryOp, a: Self::V, b: Self::V) -> Result<Self::V, Self::E>;
    /// `where(c, a, b)`.
    fn select(&mut self, c: Self::V, a: Self::V, b: Self::V) -> Result<Self::V, Self::E>;
    /// The float constant `c`, in `like`'s float type (f32 when `like` is not float).
    fn float(&mut self, c: f64, like: &Self::V) -> Result<Self::V, Self::E>;
    /// 0 in `x`'s own type, to compare `x` with.
    fn zero_of(&mut self, x: &Self::V) -> Result<Self::V, Self::E>;

    /// `a * b`.
    fn mul(&mut self, a: Self::V, b: Self::V) -> Result<Self::V, Self::E> {
        self.binary(BinaryOp::Mul, a, b)
    }

    /// `a * c`.
    fn scale(&mut self, a: Self::V, c: f64) -> Result<Self::V, Self::E> {
        let k = self.float(c, &a)?;
        self.mul(a, k)
    }

    /// `where(cond, g, 0)`.
    fn keep(&mut self, cond: Self::V, g: Self::V) -> Result<Self::V, Self::E> {
        let zero = self.float(0.0, &g)?;
        self.select(cond, g, zero)
    }

    /// `g` split by `cond`: `(where(cond, g, 0), where(cond, 0, g))`.
    fn route(&mut self, cond: Self::V, g: Self::V) -> Result<(Self::V, Self::V), Self::E> {
        let zero = self.float(0.0, &g)?;
        Ok((self.select(cond.clone(), g.clone(), zero.clone())?, self.select(cond, zero, g)?))
    }

    /// `x op 0`.
    fn cmp0(&mut self, op: BinaryOp, x: Self::V) -> Result<Self::V, Self::E> {
        let zero = self.zero_of(&x)?;
        self.binary(op, x, zero)
    }
}

/// The gradient of `a` for `y = u(a)` with adjoint `g`; `None` for ops with none (`!`, `floor`).
pub(crate) fn unary<A: Algebra>(al: &mut A, u: UnaryOp, a: A::V, y: A::V, g: A::V) -> Result<Option<A::V>, A::E> {
    Ok(Some(match u {
        UnaryOp::Not | UnaryOp::Floor => return Ok(None),
        UnaryOp::Neg => al.unary(UnaryOp::Neg, g)?,
        UnaryOp::Exp => al.mul(g, y)?,
        UnaryOp::Log => al.binary(BinaryOp::Div, g, a)?,
        UnaryOp::Sqrt => {
            // d sqrt(x) = 1 / (2 sqrt(x))
            let half = al.scale(g, 0.5)?;
            al.binary(BinaryOp::Div, half, y)?
        }
        UnaryOp::Rsqrt => {
            // d x^(-1/2) = -x^(-1/2) / (2x)
            let t = al.mul(g, y)?;
            let t = al.binary(BinaryOp::Div, t, a)?;
            al.scale(t, -0.5)?
        }
        UnaryOp::Tanh => {
            let yy = al.mul(y.clone(), y.clone())?;
            let one = al.float(1.0, &y)?;
            let d = al.binary(BinaryOp::Sub, one, yy)?;
            al.mul(g, d)?
        }
        UnaryOp::Sigmoid => {
            let one = al.float(1.0, &y)?;
            let c = al.binary(BinaryOp::Sub, one, y.clone())?;
            let d = al.mul(y, c)?;
            al.mul(g, d)?
        }
        UnaryOp::Relu => {
            let pos = al.cmp0(BinaryOp::Gt, a)?;
            al.keep(pos, g)?
        }
        UnaryOp::Silu => {
            // s + x s (1 - s), s = sigmoid(x)
            let s = al.unary(UnaryOp::Sigmoid, a.clone())?;
            let one = al.float(1.0, &s)?;
            let c = al.binary(BinaryOp::Sub, one.clone(), s.clone())?;
            let xc = al.mul(a, c)?;
            let t = al.binary(BinaryOp::Add, one, xc)?;
            let d = al.mul(s, t)?;
            al.mul(g, d)?
        }
        UnaryOp::Elu => {
            // 1 for x > 0, e^x = y + 1 otherwise
            let pos = al.cmp0(BinaryOp::Gt, a)?;
            let one = al.float(1.0, &y)?;
            let e = al.binary(BinaryOp::Add, y, one)?;
            let ge = al.mul(g.clone(), e)?;
            al.select(pos, g, ge)?
        }
        UnaryOp::Abs => {
            let pos = al.cmp0(BinaryOp::Gt, a.clone())?;
            let neg = al.cmp0(BinaryOp::Lt, a)?;
            let ng = al.unary(UnaryOp::Neg, g.clone())?;
            let n = al.keep(neg, ng)?;
            al.select(pos, g, n)?
        }
        UnaryOp::Gelu => {
            // Φ(x) + x φ(x), with Φ(x) = gelu(x) / x (1/2 at 0)
            let is0 = al.cmp0(BinaryOp::Eq, a.clone())?;
            let half = al.float(0.5, &y)?;
            let ratio = al.binary(BinaryOp::Div, y, a.clone())?;
            let cdf = al.select(is0, half, ratio)?;
            let xx = al.mul(a.clone(), a.clone())?;
            let e = al.scale(xx, -0.5)?;
            let e = al.unary(UnaryOp::Exp, e)?;
            let pdf = al.scale(e, 1.0 / (2.0 * PI).sqrt())?;
            let xp = al.mul(a, pdf)?;
            let d = al.binary(BinaryOp::Add, cdf, xp)?;
            al.mul(g, d)?
        }
        UnaryOp::Sin => {
            let c = al.unary(UnaryOp::Cos, a)?;
            al.mul(g, c)?
        }
        UnaryOp::Cos => {
            let s = al.unary(UnaryOp::Sin, a)?;
            let s = al.mul(g, s)?;
            al.unary(UnaryOp::Neg, s)?
        }
    }))
}

/// The gradients of `a` (slot 0) and `b` (slot 1) for `y = a op b` with adjoint `g`, before
/// broadcasting is undone; none for comparisons and logic.
pub(crate) fn binary<A: Algebra>(al: &mut A, op: BinaryOp, a: A::V, b: A::V, y: A::V, g: A::V) -> Result<Vec<(usize, A::V)>, A::E> {
    Ok(match op {
        BinaryOp::Add => vec![(0, g.clone()), (1, g)],
        BinaryOp::Sub => vec![(0, g.clone()), (1, al.unary(UnaryOp::Neg, g)?)],
        BinaryOp::Mul => vec![(0, al.mul(g.clone(), b)?), (1, al.mul(g, a)?)],
        BinaryOp::Div => {
            let ga = al.binary(BinaryOp::Div, g, b)?;
            let t = al.mul(ga.clone(), y)?;
            vec![(0, ga), (1, al.unary(UnaryOp::Neg, t)?)]
        }
        BinaryOp::Pow => {
            // d a^b = b a^(b-1) da + a^b ln(a) db
            let one = al.float(1.0, &y)?;
            let bm1 = al.binary(BinaryOp::Sub, b.clone(), one)?;
            let p = al.binary(BinaryOp::Pow, a.clone(), bm1)?;
            let p = al.mul(p, b)?;
            let ga = al.mul(g.clone(), p)?;
            let ln = al.unary(UnaryOp::Log, a)?;
            let t = al.mul(y, ln)?;
            vec![(0, ga), (1, al.mul(g, t)?)]
        }
        BinaryOp::Rem => {
            // a % b = a - b floor(a / b)
            let q = al.binary(BinaryOp::Div, a, b)?;
            let q = al.unary(UnaryOp::Floor, q)?;
            let t = al.mul(g.clone(), q)?;
            vec![(0, g), (1, al.unary(UnaryOp::Neg, t)?)]
        }
        BinaryOp::Min | BinaryOp::Max => {
            let cmp = if op == BinaryOp::Min { BinaryOp::Le } else { BinaryOp::Ge };
            let left = al.binary(cmp, a, b)?;
            let (ga, gb) = al.route(left, g)?;
            vec![(0, ga), (1, gb)]
        }
        BinaryOp::Atan2 => {
            // atan2(a, b): da = b / (a² + b²), db = -a / (a² + b²)
            let aa = al.mul(a.clone(), a.clone())?;
            let b2 = al.mul(b.clone(), b.clone())?;
            let r = al.binary(BinaryOp::Add, aa, b2)?;
            let gr = al.binary(BinaryOp::Div, g, r)?;
            let ga = al.mul(gr.clone(), b)?;
            let t = al.mul(gr, a)?;
            vec![(0, ga), (1, al.unary(UnaryOp::Neg, t)?)]
        }
        BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge | BinaryOp::Eq | BinaryOp::Ne | BinaryOp::And | BinaryOp::Or => vec![],
    })
}

/// The gradients of the branches (slots 1 and 2) of `where(c, a, b)` with adjoint `g`: the
/// branch taken gets it, the other and the condition none.
pub(crate) fn select<A: Algebra>(al: &mut A, c: A::V, g: A::V) -> Result<Vec<(usize, A::V)>, A::E> {
    let (ga, gb) = al.route(c, g)?;
    Ok(vec![(1, ga), (2, gb)])
}
