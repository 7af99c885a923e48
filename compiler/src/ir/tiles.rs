//! Compile-time block sparsity: classify a (query-block, key-block) tile of a flash op's mask by
//! interval analysis of the predicate over the tile's index ranges.
//!
//! Every sub-expression is bounded by an interval (numbers) or a three-valued truth (bools).
//! Positions range over the tile; batch positions over their whole axis; loads and the score are
//! unknown. A tile whose predicate is surely false is skipped, surely true runs without the mask
//! test, anything else is partial. For predicates built from differences of positions (causal,
//! sliding window, prefix-LM) the bounds are attained, so the classification is exact.

use super::flash::{ScoreExpr, binary};
use super::op::{BinaryOp, UnaryOp};
use std::collections::HashMap;

/// What a tile needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TileClass {
    /// Every element is masked: skip the tile.
    Skip,
    /// No element is masked: run it without evaluating the mask.
    Full,
    /// Some may be masked: evaluate the mask per element.
    Partial,
}

/// A closed interval of values; `lo > hi` never happens.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Iv {
    lo: f64,
    hi: f64,
}

const ANY: Iv = Iv { lo: f64::NEG_INFINITY, hi: f64::INFINITY };

impl Iv {
    fn point(v: f64) -> Iv {
        if v.is_nan() { ANY } else { Iv { lo: v, hi: v } }
    }

    fn hull(a: Iv, b: Iv) -> Iv {
        Iv { lo: a.lo.min(b.lo), hi: a.hi.max(b.hi) }
    }

    /// The hull of `f` at the corners, for operations monotone in each argument.
    fn corners(a: Iv, b: Iv, f: impl Fn(f64, f64) -> f64) -> Iv {
        let vals = [f(a.lo, b.lo), f(a.lo, b.hi), f(a.hi, b.lo), f(a.hi, b.hi)];
        if vals.iter().any(|v| v.is_nan()) {
            return ANY;
        }
        Iv { lo: vals.iter().copied().fold(f64::INFINITY, f64::min), hi: vals.iter().copied().fold(f64::NEG_INFINITY, f64::max) }
    }

    /// As a truth value: 0 is false, anything else true.
    fn truth(self) -> Option<bool> {
        if self.lo == 0.0 && self.hi == 0.0 {
            Some(false)
        } else if self.lo > 0.0 || self.hi < 0.0 {
            Some(true)
        } else {
            None
        }
    }

    fn from_truth(t: Option<bool>) -> Iv {
        match t {
            Some(b) => Iv::point(f64::from(u8::from(b))),
            None => Iv { lo: 0.0, hi: 1.0 },
        }
    }
}

/// Bounds an expression given an inclusive range per score position.
fn bound(e: &ScoreExpr, ranges: &[(i64, i64)], env: &HashMap<String, i64>) -> Iv {
    match e {
        ScoreExpr::Score | ScoreExpr::Load { .. } => ANY,
        ScoreExpr::Pos(k) => ranges.get(*k).map_or(ANY, |(lo, hi)| Iv { lo: *lo as f64, hi: *hi as f64 }),
        ScoreExpr::Float(v) => Iv::point(*v),
        ScoreExpr::Int(v) => Iv::point(*v as f64),
        ScoreExpr::Dim(d) => d.eval(env).map_or(ANY, |v| Iv::point(v as f64)),
        ScoreExpr::Unary(u, a) => {
            let a = bound(a, ranges, env);
            match u {
                UnaryOp::Neg => Iv { lo: -a.hi, hi: -a.lo },
                UnaryOp::Not => Iv::from_truth(a.truth().map(|t| !t)),
                UnaryOp::Abs => {
                    if a.lo >= 0.0 {
                        a
                    } else if a.hi <= 0.0 {
                        Iv { lo: -a.hi, hi: -a.lo }
                    } else {
                        Iv { lo: 0.0, hi: a.hi.max(-a.lo) }
                    }
                }
                // Monotone non-decreasing functions map endpoints to endpoints.
                UnaryOp::Exp
                | UnaryOp::Tanh
                | UnaryOp::Sigmoid
                | UnaryOp::Relu
                | UnaryOp::Floor
                | UnaryOp::Elu
                | UnaryOp::Sqrt
                | UnaryOp::Log => {
                    let f = |x: f64| super::flash::unary(*u, x);
                    let (lo, hi) = (f(a.lo), f(a.hi));
                    if lo.is_nan() || hi.is_nan() { ANY } else { Iv { lo, hi } }
                }
                _ => ANY,
            }
        }
        ScoreExpr::Binary(b, x, y) => {
            let (x, y) = (bound(x, ranges, env), bound(y, ranges, env));
            let truth = |t: Option<bool>| Iv::from_truth(t);
            match b {
                BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Min | BinaryOp::Max => Iv::corners(x, y, |p, q| binary(*b, p, q)),
                BinaryOp::Div => {
                    if y.lo > 0.0 || y.hi < 0.0 {
                        Iv::corners(x, y, |p, q| p / q)
                    } else {
                        ANY
                    }
                }
                BinaryOp::Lt => truth(if x.hi < y.lo {
                    Some(true)
                } else if x.lo >= y.hi {
                    Some(false)
                } else {
                    None
                }),
                BinaryOp::Le => truth(if x.hi <= y.lo {
                    Some(true)
                } else if x.lo > y.hi {
                    Some(false)
                } else {
                    None
                }),
                BinaryOp::Gt => truth(if x.lo > y.hi {
                    Some(true)
                } else if x.hi <= y.lo {
                    Some(false)
                } else {
                    None
                }),
                BinaryOp::Ge => truth(if x.lo >= y.hi {
                    Some(true)
                } else if x.hi < y.lo {
                    Some(false)
                } else {
                    None
                }),
                BinaryOp::Eq => truth(if x.lo == x.hi && y.lo == y.hi && x.lo == y.lo {
                    Some(true)
                } else if x.hi < y.lo || y.hi < x.lo {
                    Some(false)
                } else {
                    None
                }),
                BinaryOp::Ne => truth(if x.hi < y.lo || y.hi < x.lo {
                    Some(true)
                } else if x.lo == x.hi && y.lo == y.hi && x.lo == y.lo {
                    Some(false)
                } else {
                    None
                }),
                BinaryOp::And => truth(match (x.truth(), y.truth()) {
                    (Some(false), _) | (_, Some(false)) => Some(false),
                    (Some(true), Some(true)) => Some(true),
                    _ => None,
                }),
                BinaryOp::Or => truth(match (x.truth(), y.truth()) {
                    (Some(true), _) | (_, Some(true)) => Some(true),
                    (Some(false), Some(false)) => Some(false),
                    _ => None,
                }),
                BinaryOp::Rem | BinaryOp::Pow => ANY,
            }
        }
        ScoreExpr::Select(c, a, b) => match bound(c, ranges, env).truth() {
            Some(true) => bound(a, ranges, env),
            Some(false) => bound(b, ranges, env),
            None => Iv::hull(bound(a, ranges, env), bound(b, ranges, env)),
        },
    }
}

/// Classifies the tile of query rows `rows` and key rows `cols` (half-open ranges) of a mask
/// predicate for a score tensor with `batch_sizes` leading axes. `None` (no mask) is always
/// [`TileClass::Full`]. Empty ranges are [`TileClass::Skip`].
pub fn classify_tile(
    mask: Option<&ScoreExpr>,
    batch_sizes: &[i64],
    rows: (i64, i64),
    cols: (i64, i64),
    env: &HashMap<String, i64>,
) -> TileClass {
    if rows.0 >= rows.1 || cols.0 >= cols.1 {
        return TileClass::Skip;
    }
    let Some(mask) = mask else { return TileClass::Full };
    let mut ranges: Vec<(i64, i64)> = batch_sizes.iter().map(|n| (0, (n - 1).max(0))).collect();
    ranges.push((rows.0, rows.1 - 1));
    ranges.push((cols.0, cols.1 - 1));
    match bound(mask, &ranges, env).truth() {
        Some(true) => TileClass::Full,
        Some(false) => TileClass::Skip,
        None => TileClass::Partial,
    }
}

/// Counts of each class over an `m × n` score matrix cut into `tile_m × tile_n` tiles.
pub fn tile_census(
    mask: Option<&ScoreExpr>,
    batch_sizes: &[i64],
    (m, n): (i64, i64),
    (tile_m, tile_n): (i64, i64),
    env: &HashMap<String, i64>,
) -> [usize; 3] {
    let mut counts = [0usize; 3];
    let (tile_m, tile_n) = (tile_m.max(1), tile_n.max(1));
    for r in (0..m).step_by(tile_m as usize) {
        for c in (0..n).step_by(tile_n as usize) {
            let class = classify_tile(mask, batch_sizes, (r, (r + tile_m).min(m)), (c, (c + tile_n).min(n)), env);
            counts[class as usize] += 1;
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::flash::parse_expr;

    /// Brute force: evaluates the mask on every element of the tile.
    fn brute(mask: &ScoreExpr, rows: (i64, i64), cols: (i64, i64), env: &HashMap<String, i64>) -> TileClass {
        let (mut any_true, mut any_false) = (false, false);
        for i in rows.0..rows.1 {
            for j in cols.0..cols.1 {
                let v = mask.eval(0.0, &[0, 0, i, j], env, &|_, _| 0.0) != 0.0;
                any_true |= v;
                any_false |= !v;
            }
        }
        match (any_true, any_false) {
            (true, false) => TileClass::Full,
            (false, true) => TileClass::Skip,
            _ => TileClass::Partial,
        }
    }

    fn check_exact(text: &str) {
        let mask = parse_expr(text, 4).expect("parses");
        let env: HashMap<String, i64> = [("P".to_string(), 37)].into();
        for (m, n) in [(130, 130), (65, 200), (7, 7)] {
            for (tm, tn) in [(1, 1), (16, 16), (64, 64), (32, 48), (7, 13)] {
                for r in (0..m).step_by(tm) {
                    for c in (0..n).step_by(tn) {
                        let rows = (r as i64, (r + tm).min(m) as i64);
                        let cols = (c as i64, (c + tn).min(n) as i64);
                        let got = classify_tile(Some(&mask), &[2, 3], rows, cols, &env);
                        assert_eq!(got, brute(&mask, rows, cols, &env), "{text}: tile {rows:?} x {cols:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn causal_is_exact() {
        check_exact("j <= i");
    }

    #[test]
    fn sliding_window_is_exact() {
        check_exact("abs(i - j) <= 20");
        check_exact("i - j <= 20 && j - i <= 20");
        check_exact("j <= i && i - j < 32");
    }

    #[test]
    fn prefix_lm_is_exact() {
        check_exact("j <= i || j < dim(P)");
    }

    #[test]
    fn data_dependent_masks_are_partial() {
        let mask = parse_expr("x0[b, i] == x0[b, j]", 4).expect("parses");
        let class = classify_tile(Some(&mask), &[2, 3], (0, 64), (0, 64), &HashMap::new());
        assert_eq!(class, TileClass::Partial);
    }

    #[test]
    fn census_counts_causal_tiles() {
        let mask = parse_expr("j <= i", 2).expect("parses");
        // 4x4 tiles of 64: 6 above the diagonal skipped, 4 on it partial, 6 below full.
        assert_eq!(tile_census(Some(&mask), &[], (256, 256), (64, 64), &HashMap::new()), [6, 6, 4]);
    }
}
