//! What a flash op's score modification allows, worked out once for every backend
//! ([`FlashAnalysis`]): the position-free scale that rides on the Q·Kᵀ product, the split of a
//! softmax score into a part that needs every score and terms that depend on the query or the
//! key position only, soft-capping's `tanh(s)`, and a per-item score factor.
//!
//! Who reads what. Both renderers read the same analyses from the schedule; the forms that feed
//! the CPU's row kernels the CUDA renderer does not need, because its kernels evaluate each
//! score in a register as the tile is computed, where the whole expression costs a few
//! instructions next to the tile's loads and products, and there is no row kernel to feed:
//!
//! | analysis | cpu | cuda | why the CUDA renderer does not read it |
//! |---|---|---|---|
//! | [`FlashAnalysis::alpha`]: the scale on the Q·Kᵀ product | yes | yes | |
//! | [`FlashAnalysis::score`]: the score per element, scale split off | yes | yes | |
//! | [`FlashAnalysis::staged`]: `tanh(s)` applied to whole rows, a per-item factor | yes | no | they let the CPU's online-softmax row kernel (`attnc_softmax_step_f32`) take a whole row of raw scores; CUDA computes `tanh` and the factor per score in registers |
//! | [`FlashAnalysis::separated`], [`FlashAnalysis::key_bias`]: terms in `i` or `j` only | yes | no | they turn ALiBi-like terms into one key-bias vector per tile for that row kernel; per score in registers they are one multiply-add |
//! | [`BwdLinear`]: the backward's linear score form | yes | no | it feeds the CPU backward's row kernel (`attnc_flash_bwd_row`); CUDA's backward forms each weight and adjoint per score in registers |

use crate::ir::{BinaryOp, Dim, FlashSpec, ScoreExpr, UnaryOp, Weights};

/// How often a sub-expression of a score changes inside the flash loops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Once per work item: constants, dims, batch positions and loads indexed by them.
    Item,
    /// Once per query row: also the row position `i`.
    Row,
    /// Per score: the score `s` or the key position `j`.
    Elem,
}

/// The level of `e` in a score tensor of rank `rank`.
pub fn level(e: &ScoreExpr, rank: usize) -> Level {
    match e {
        ScoreExpr::Score => Level::Elem,
        ScoreExpr::Pos(k) if *k + 1 == rank => Level::Elem,
        ScoreExpr::Pos(k) if *k + 2 == rank => Level::Row,
        ScoreExpr::Pos(_) | ScoreExpr::Float(_) | ScoreExpr::Int(_) | ScoreExpr::Dim(_) => Level::Item,
        ScoreExpr::Load { index, .. } => index.iter().map(|x| level(x, rank)).max().unwrap_or(Level::Item),
        ScoreExpr::Unary(_, a) => level(a, rank),
        ScoreExpr::Binary(_, a, b) => level(a, rank).max(level(b, rank)),
        ScoreExpr::Select(c, a, b) => level(c, rank).max(level(a, rank)).max(level(b, rank)),
    }
}

/// Every dim an expression mentions, added to `out` once each.
pub fn dims_of(e: &ScoreExpr, out: &mut Vec<Dim>) {
    e.visit(&mut |x| {
        if let ScoreExpr::Dim(d) = x
            && !out.contains(d)
        {
            out.push(d.clone());
        }
    });
}

/// Whether `e` reads the score `s`.
pub fn reads_score(e: &ScoreExpr) -> bool {
    e.uses_score()
}

/// A softmax score split as `score = rest + sep`, where `sep` (no `s`) is a sum of terms that
/// each depend on the query position `i` or the key position `j` but never on both (after
/// distributing products by factors free of both): `sep(i, j) = c(j) + r(i)`.
///
/// Softmax does not change when a row is shifted, so a kernel may compute `rest + sep(i0, j)`
/// with `i0` a fixed row of the query block: `sep(i0, j)` is one vector per key tile instead of
/// an expression per score, and the row's shift `r(i) - r(i0)` drops out. That holds while `r`
/// is finite, which a kernel must check per query block (falling back to the whole expression
/// where it is not).
#[derive(Clone, Debug, PartialEq)]
pub struct Separated {
    /// The terms that read the score or depend on both positions.
    pub rest: ScoreExpr,
    /// The separable terms, as written (evaluated at `i = i0`).
    pub sep: ScoreExpr,
}

/// Splits `score` (of a score tensor of rank `rank`) into [`Separated`] parts, or `None` when no
/// top-level additive term is separable.
pub fn separate(score: &ScoreExpr, rank: usize) -> Option<Separated> {
    let mut terms = Vec::new();
    flatten(score, false, &mut terms);
    let (sep, rest): (Vec<_>, Vec<_>) = terms.into_iter().partition(|(_, t)| !reads_score(t) && separable(t, rank));
    let sep = rebuild(sep)?;
    let rest = rebuild(rest).unwrap_or(ScoreExpr::Float(0.0));
    Some(Separated { rest, sep })
}

/// The top-level terms of a sum, with their signs (`true`: subtracted).
fn flatten(e: &ScoreExpr, neg: bool, out: &mut Vec<(bool, ScoreExpr)>) {
    match e {
        ScoreExpr::Binary(BinaryOp::Add, a, b) => {
            flatten(a, neg, out);
            flatten(b, neg, out);
        }
        ScoreExpr::Binary(BinaryOp::Sub, a, b) => {
            flatten(a, neg, out);
            flatten(b, !neg, out);
        }
        ScoreExpr::Unary(UnaryOp::Neg, a) => flatten(a, !neg, out),
        _ => out.push((neg, e.clone())),
    }
}

/// The sum of signed terms, or `None` for no terms.
fn rebuild(terms: Vec<(bool, ScoreExpr)>) -> Option<ScoreExpr> {
    let mut it = terms.into_iter();
    let (neg, first) = it.next()?;
    let first = if neg { ScoreExpr::Unary(UnaryOp::Neg, Box::new(first)) } else { first };
    Some(it.fold(first, |acc, (neg, t)| ScoreExpr::Binary(if neg { BinaryOp::Sub } else { BinaryOp::Add }, Box::new(acc), Box::new(t))))
}

/// Whether `e` reads the query position and whether it reads the key position.
fn positions(e: &ScoreExpr, rank: usize) -> (bool, bool) {
    let (mut i, mut j) = (false, false);
    e.visit(&mut |x| {
        if let ScoreExpr::Pos(k) = x {
            i |= *k + 2 == rank;
            j |= *k + 1 == rank;
        }
    });
    (i, j)
}

/// Whether `e` is a sum of parts that each depend on at most one of `i`, `j`.
fn separable(e: &ScoreExpr, rank: usize) -> bool {
    let free = |x: &ScoreExpr| positions(x, rank) == (false, false);
    match positions(e, rank) {
        (false, _) | (_, false) => true,
        _ => match e {
            ScoreExpr::Binary(BinaryOp::Add | BinaryOp::Sub, a, b) => separable(a, rank) && separable(b, rank),
            ScoreExpr::Unary(UnaryOp::Neg, a) => separable(a, rank),
            ScoreExpr::Binary(BinaryOp::Mul, a, b) if free(a) => separable(b, rank),
            ScoreExpr::Binary(BinaryOp::Mul | BinaryOp::Div, a, b) if free(b) => separable(a, rank),
            _ => false,
        },
    }
}

/// `e` with every `tanh(s)` replaced by `s`, when `e` reads the score only through `tanh(s)`
/// (soft-capping, `cap · tanh(s / cap)` with the division folded into the score scale): a
/// kernel may then apply `tanh` to whole rows first.
pub fn tanh_staged(e: &ScoreExpr) -> Option<ScoreExpr> {
    fn strip(e: &ScoreExpr, found: &mut bool) -> Option<ScoreExpr> {
        Some(match e {
            ScoreExpr::Unary(UnaryOp::Tanh, a) if **a == ScoreExpr::Score => {
                *found = true;
                ScoreExpr::Score
            }
            ScoreExpr::Score => return None,
            ScoreExpr::Pos(_) | ScoreExpr::Float(_) | ScoreExpr::Int(_) | ScoreExpr::Dim(_) => e.clone(),
            ScoreExpr::Load { input, index } => {
                ScoreExpr::Load { input: *input, index: index.iter().map(|x| strip(x, found)).collect::<Option<_>>()? }
            }
            ScoreExpr::Unary(op, a) => ScoreExpr::Unary(*op, Box::new(strip(a, found)?)),
            ScoreExpr::Binary(op, a, b) => ScoreExpr::Binary(*op, Box::new(strip(a, found)?), Box::new(strip(b, found)?)),
            ScoreExpr::Select(c, a, b) => {
                ScoreExpr::Select(Box::new(strip(c, found)?), Box::new(strip(a, found)?), Box::new(strip(b, found)?))
            }
        })
    }
    let mut found = false;
    let out = strip(e, &mut found)?;
    found.then_some(out)
}

/// `Some(None)` when `e` is the score itself, `Some(Some(c))` when it is `c · s` or `s · c` with
/// `c` the same for the whole work item (batch positions, dims, constants): a softmax kernel
/// may then read the raw scores and apply `c` itself.
pub fn score_factor(e: &ScoreExpr, rank: usize) -> Option<Option<ScoreExpr>> {
    match e {
        ScoreExpr::Score => Some(None),
        ScoreExpr::Binary(BinaryOp::Mul, a, b) => match (&**a, &**b) {
            (ScoreExpr::Score, c) | (c, ScoreExpr::Score) if level(c, rank) == Level::Item => Some(Some(c.clone())),
            _ => None,
        },
        _ => None,
    }
}

/// Splits a score whose every use of `s` is `s * c`, `c * s` or `s / c`, with one and the same
/// position-free `c`, into the score with those uses read as plain `s` and the scale `c` (`1 / c`
/// for a division), so that the scale rides on the Q·Kᵀ product: `s * 0.125` gives `s` and
/// 0.125, soft-capping's `50 * tanh(s / 50)` gives `50 * tanh(s)` and `1 / 50` (one multiply of
/// the product instead of a division per score, and `tanh(s)` as a row kernel can stage it).
/// Anything else (`s` read bare anywhere, two different scales, a position-dependent one)
/// splits nothing.
pub fn split_scale(score: &ScoreExpr) -> (ScoreExpr, Option<ScoreExpr>) {
    let constant = |e: &ScoreExpr| !e.any(&|x| matches!(x, ScoreExpr::Score | ScoreExpr::Pos(_) | ScoreExpr::Load { .. }));
    // The scale of `e` when it is the score times a constant.
    let scaled = |e: &ScoreExpr| -> Option<ScoreExpr> {
        match e {
            ScoreExpr::Binary(BinaryOp::Mul, a, b) if **a == ScoreExpr::Score && constant(b) => Some((**b).clone()),
            ScoreExpr::Binary(BinaryOp::Mul, a, b) if **b == ScoreExpr::Score && constant(a) => Some((**a).clone()),
            ScoreExpr::Binary(BinaryOp::Div, a, b) if **a == ScoreExpr::Score && constant(b) => {
                Some(ScoreExpr::bin(BinaryOp::Div, ScoreExpr::Float(1.0), (**b).clone()))
            }
            _ => None,
        }
    };
    // `e` with its scaled uses of the score read as `s`, recording their one scale; `None` when
    // the score is read otherwise or at two scales. Bounded by the expression's depth, which the
    // parser and the optimizer bound.
    fn strip(e: &ScoreExpr, scaled: &dyn Fn(&ScoreExpr) -> Option<ScoreExpr>, scale: &mut Option<ScoreExpr>) -> Option<ScoreExpr> {
        if let Some(c) = scaled(e) {
            if scale.as_ref().is_some_and(|old| *old != c) {
                return None;
            }
            *scale = Some(c);
            return Some(ScoreExpr::Score);
        }
        Some(match e {
            ScoreExpr::Score => return None,
            ScoreExpr::Pos(_) | ScoreExpr::Float(_) | ScoreExpr::Int(_) | ScoreExpr::Dim(_) => e.clone(),
            ScoreExpr::Load { input, index } => {
                ScoreExpr::Load { input: *input, index: index.iter().map(|x| strip(x, scaled, scale)).collect::<Option<_>>()? }
            }
            ScoreExpr::Unary(op, a) => ScoreExpr::Unary(*op, Box::new(strip(a, scaled, scale)?)),
            ScoreExpr::Binary(op, a, b) => ScoreExpr::Binary(*op, Box::new(strip(a, scaled, scale)?), Box::new(strip(b, scaled, scale)?)),
            ScoreExpr::Select(c, a, b) => ScoreExpr::Select(
                Box::new(strip(c, scaled, scale)?),
                Box::new(strip(a, scaled, scale)?),
                Box::new(strip(b, scaled, scale)?),
            ),
        })
    }
    let mut scale = None;
    match strip(score, &scaled, &mut scale) {
        Some(rest) if scale.is_some() => (rest, scale),
        _ => (score.clone(), None),
    }
}

/// A score expression as a kernel evaluates it: after the scale split off into the Q·Kᵀ
/// product, with soft-capping's `tanh(s)` staged, and with its per-item factor.
#[derive(Clone, Debug, PartialEq)]
pub struct StagedScore {
    /// The expression per score element (`tanh(s)` read as `s` when `tanh`).
    pub expr: ScoreExpr,
    /// Whether rows get `s = tanh(s)` before `expr` is evaluated.
    pub tanh: bool,
    /// `Some(None)` when `expr` is `s`, `Some(Some(c))` when it is `c · s` with a per-item `c`.
    pub factor: Option<Option<ScoreExpr>>,
}

impl StagedScore {
    fn of(e: &ScoreExpr, allow_tanh: bool, rank: usize) -> StagedScore {
        let staged = if allow_tanh { tanh_staged(e) } else { None };
        let tanh = staged.is_some();
        let expr = staged.unwrap_or_else(|| e.clone());
        let factor = score_factor(&expr, rank);
        StagedScore { expr, tanh, factor }
    }
}

/// What a flash op's score modification allows, for every backend to use as it can.
#[derive(Clone, Debug, PartialEq)]
pub struct FlashAnalysis {
    /// The score per element, with the position-free scale split off into `alpha`.
    pub score: ScoreExpr,
    /// The scale of `s`, applied to the Q·Kᵀ product (a query scale the schedule folded in,
    /// times the score's own): the expressions see `s = alpha · (q · k)`.
    pub alpha: Option<ScoreExpr>,
    /// `score` staged for evaluation ([`StagedScore`]).
    pub staged: StagedScore,
    /// Softmax weights only: `score = rest + sep` ([`Separated`]), with `rest` staged.
    pub separated: Option<(Separated, StagedScore)>,
    /// Whether the separable part depends on the key position (otherwise it only shifts rows
    /// and drops out of the softmax).
    pub key_bias: bool,
}

impl FlashAnalysis {
    /// Analyses `spec` whose query is scaled by `q_scale` (folded from the graph).
    pub fn of(spec: &FlashSpec, q_scale: Option<ScoreExpr>) -> FlashAnalysis {
        let rank = spec.rank;
        // A mask that reads the score sees `s` as written: the scale stays in the score then.
        let (score, own) = if spec.mask.as_ref().is_some_and(reads_score) { (spec.score.clone(), None) } else { split_scale(&spec.score) };
        let alpha = match (own, q_scale) {
            (Some(a), Some(c)) => Some(ScoreExpr::bin(BinaryOp::Mul, a, c)),
            (a, c) => a.or(c),
        };
        // Rows may be replaced by `tanh(s)` only when nothing else reads the raw score.
        let allow_tanh = !spec.mask.as_ref().is_some_and(reads_score);
        let staged = StagedScore::of(&score, allow_tanh, rank);
        let separated = if spec.weights == Weights::Softmax { separate(&score, rank) } else { None };
        let key_bias = separated.as_ref().is_some_and(|x| level(&x.sep, rank) == Level::Elem);
        let separated = separated.map(|x| {
            let rest = StagedScore::of(&x.rest, allow_tanh, rank);
            (x, rest)
        });
        FlashAnalysis { score, alpha, staged, separated, key_bias }
    }
}

/// How a flash backward's unmasked tiles may form their weights and adjoints with one row
/// kernel: the score is `F = factor · u + sep(i, j)`, where `u` is the scaled score
/// `s' = alpha · s` (or `tanh(s')`, soft-capping), `factor` is the same for the whole work item
/// and `sep` separable (`c(j) + r(i)`). Then `∂F/∂s = alpha · factor` (times `1 - u²` after
/// `tanh`), and a key row's scores need only `c(j)` and the block's `r(i)`.
#[derive(Clone, Debug, PartialEq)]
pub struct BwdLinear {
    /// The position-free scale of `s`, applied to the `Sᵀ` product of such tiles.
    pub alpha: Option<ScoreExpr>,
    /// Whether `u = tanh(s')`.
    pub tanh: bool,
    /// `factor` (`None`: 1).
    pub factor: Option<ScoreExpr>,
    /// `sep(i, j)`, when the score has separable terms.
    pub sep: Option<ScoreExpr>,
    /// A load of an extra operand (its place in the derivative's loads) whose gradient the row
    /// kernel can sum: its index is the same for the whole work item and its derivative is
    /// separable, `∂F/∂x = c(j) + r(i)`, so a key row's share is `c(j) Σ dF + Σ dF r(i)`
    /// (ALiBi's slopes: `j - i`).
    pub sum_load: Option<usize>,
}

impl BwdLinear {
    /// The linear form of `spec`'s score, if it has one and the derivatives of its loads read no
    /// score (they are evaluated from positions after the row kernel ran). `wanted` lists the
    /// extra operands whose gradients are computed.
    pub fn of(spec: &FlashSpec, grad: &crate::ir::grad::ScoreGrad, wanted: &[usize]) -> Option<BwdLinear> {
        if grad.loads.iter().any(|l| l.d.uses_score() || l.index.iter().any(ScoreExpr::uses_score)) {
            return None;
        }
        let a = FlashAnalysis::of(spec, None);
        let (staged, sep) = match &a.separated {
            Some((x, rest)) => (rest, Some(x.sep.clone())),
            None => (&a.staged, None),
        };
        let factor = staged.factor.clone()?;
        let rank = spec.rank;
        let sum_load = grad.loads.iter().position(|l| {
            wanted.contains(&l.input)
                && l.index.iter().all(|e| level(e, rank) == Level::Item)
                && (positions(&l.d, rank) == (false, false) || separate(&l.d, rank).is_some_and(|x| x.rest == ScoreExpr::Float(0.0)))
        });
        Some(BwdLinear { alpha: a.alpha, tanh: staged.tanh, factor, sep, sum_load })
    }
}
