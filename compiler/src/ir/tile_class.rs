//! Compile-time block sparsity: classify a (query-block, key-block) tile of a flash op's mask by
//! interval analysis of the predicate over the tile's index ranges.
//!
//! Every sub-expression is bounded by an interval (numbers) or a three-valued truth (bools).
//! Positions range over the tile; batch positions over their whole axis; loads and the score are
//! unknown. A tile whose predicate is surely false is skipped, surely true runs without the mask
//! test, anything else is partial. For predicates built from differences of positions (causal,
//! sliding window, prefix-LM) the bounds are attained, so the classification is exact.

use super::flash_spec::{ScoreExpr, int_literal};
use super::op::{BinaryOp, UnaryOp};
use super::semantics::{self, Class, Scalar};
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

/// The bounds of a value and its class ([`semantics`]).
#[derive(Clone, Copy, Debug)]
struct Bound {
    iv: Iv,
    class: Class,
}

impl Bound {
    fn new(iv: Iv, class: Class) -> Bound {
        // An integer interval outside the i32 range could have wrapped: nothing is known.
        let wraps = class == Class::Int && (iv.lo < f64::from(i32::MIN) || iv.hi > f64::from(i32::MAX));
        Bound { iv: if wraps { ANY } else { iv }, class }
    }

    fn any(class: Class) -> Bound {
        Bound { iv: ANY, class }
    }

    fn truth(t: Option<bool>) -> Bound {
        Bound { iv: Iv::from_truth(t), class: Class::Bool }
    }

    /// The interval as values of `class`: int endpoints become f32 (rounding is monotone, so
    /// the rounded endpoints bound the rounded values).
    fn as_class(self, class: Class) -> Iv {
        if class == Class::Float && self.class != Class::Float {
            let f = |v: f64| if v.is_finite() { Scalar::I(v as i32).as_f() } else { v };
            Iv { lo: f(self.iv.lo), hi: f(self.iv.hi) }
        } else {
            self.iv
        }
    }
}

/// Bounds an expression given an inclusive range per score position. Endpoints are computed
/// with the expression's own semantics (f32 rounding, which is monotone), so the bounds hold
/// for the values the backends compute.
fn bound(e: &ScoreExpr, ranges: &[(i64, i64)], known: &Known) -> Bound {
    let (env, data) = (known.env, known.data);
    let int = |v: i64| Bound::new(Iv::point(v as f64), Class::Int);
    match e {
        ScoreExpr::Score => Bound::any(Class::Float),
        // A 0-d i32 operand whose value the run gave (a window size, a prefix length).
        ScoreExpr::Load { input, index } if index.is_empty() => {
            env.get(&scalar_load_key(*input)).map_or(Bound::any(Class::Float), |v| int(*v))
        }
        // An i32 or bool operand whose values the run gave (segment ids, a dense mask): the
        // range of the values at the indices the index expressions can take (clamped into
        // range, as loads are).
        ScoreExpr::Load { input, index } => {
            // The indices an index expression can take along an axis of `n`, clamped as loads are.
            let span = |e: &ScoreExpr, n: usize| {
                let b = bound(e, ranges, known);
                let last = n as f64 - 1.0;
                (b.class == Class::Int && n > 0 && b.iv.lo.is_finite() && b.iv.hi.is_finite())
                    .then(|| (b.iv.lo.clamp(0.0, last) as usize, b.iv.hi.clamp(0.0, last) as usize))
            };
            let found = data.get(input).and_then(|t| {
                let spans: Option<Vec<(usize, usize)>> = index.iter().zip(t.shape()).map(|(e, n)| span(e, *n)).collect();
                t.min_max_spans(&spans?)
            });
            let class = if data.get(input).is_some_and(|t| t.is_bool()) { Class::Bool } else { Class::Int };
            found.map_or(Bound::any(Class::Float), |(min, max)| Bound::new(Iv { lo: f64::from(min), hi: f64::from(max) }, class))
        }
        ScoreExpr::Pos(k) => {
            ranges.get(*k).map_or(Bound::any(Class::Int), |(lo, hi)| Bound::new(Iv { lo: *lo as f64, hi: *hi as f64 }, Class::Int))
        }
        ScoreExpr::Float(v) => Bound::new(Iv::point(Scalar::float(*v).as_f()), Class::Float),
        ScoreExpr::Int(v) => match int_literal(*v) {
            Scalar::I(i) => int(i64::from(i)),
            other => Bound::new(Iv::point(other.as_f()), Class::Float),
        },
        ScoreExpr::Dim(d) => d.eval(env).map_or(Bound::any(Class::Int), int),
        ScoreExpr::Unary(u, a) => bound_unary(*u, bound(a, ranges, known)),
        ScoreExpr::Binary(b, x, y) => bound_binary(*b, bound(x, ranges, known), bound(y, ranges, known)),
        ScoreExpr::Select(c, a, b) => {
            let (a, b) = (bound(a, ranges, known), bound(b, ranges, known));
            let class = semantics::select_class(a.class, b.class);
            match bound(c, ranges, known).iv.truth() {
                Some(true) => Bound::new(a.as_class(class), class),
                Some(false) => Bound::new(b.as_class(class), class),
                None => Bound::new(Iv::hull(a.as_class(class), b.as_class(class)), class),
            }
        }
    }
}

fn bound_unary(u: UnaryOp, a: Bound) -> Bound {
    let class = semantics::unary_class(u, a.class);
    let x = a.as_class(class);
    let iv = match u {
        UnaryOp::Not => return Bound::truth(a.iv.truth().map(|t| !t)),
        UnaryOp::Neg => Iv { lo: -x.hi, hi: -x.lo },
        UnaryOp::Abs => {
            if x.lo >= 0.0 {
                x
            } else if x.hi <= 0.0 {
                Iv { lo: -x.hi, hi: -x.lo }
            } else {
                Iv { lo: 0.0, hi: x.hi.max(-x.lo) }
            }
        }
        // Monotone non-decreasing functions map endpoints to endpoints.
        UnaryOp::Exp | UnaryOp::Tanh | UnaryOp::Sigmoid | UnaryOp::Relu | UnaryOp::Floor | UnaryOp::Elu | UnaryOp::Sqrt | UnaryOp::Log => {
            let f = |v: f64| semantics::unary(u, if class == Class::Float { Scalar::F(v) } else { Scalar::I(v as i32) }).as_f();
            let (lo, hi) = (f(x.lo), f(x.hi));
            if lo.is_nan() || hi.is_nan() { ANY } else { Iv { lo, hi } }
        }
        // Bounded whatever the argument (NaN aside, which the interval's truth ignores).
        UnaryOp::Sin | UnaryOp::Cos if class == Class::Float => Iv { lo: -1.0, hi: 1.0 },
        _ => ANY,
    };
    Bound::new(iv, class)
}

fn bound_binary(b: BinaryOp, x: Bound, y: Bound) -> Bound {
    if b.is_logical() {
        return Bound::truth(match (b, x.iv.truth(), y.iv.truth()) {
            (BinaryOp::And, Some(false), _) | (BinaryOp::And, _, Some(false)) => Some(false),
            (BinaryOp::And, Some(true), Some(true)) => Some(true),
            (BinaryOp::Or, Some(true), _) | (BinaryOp::Or, _, Some(true)) => Some(true),
            (BinaryOp::Or, Some(false), Some(false)) => Some(false),
            _ => None,
        });
    }
    let operands = if x.class == Class::Float || y.class == Class::Float { Class::Float } else { Class::Int };
    let (p, q) = (x.as_class(operands), y.as_class(operands));
    if b.is_comparison() {
        return Bound::truth(compare(b, p, q));
    }
    let class = semantics::binary_class(b, x.class, y.class);
    // Integer endpoints are exact in f64 (and checked against wrapping by `Bound::new`); float
    // endpoints follow the op's f32 rounding.
    let apply = |v: f64, w: f64| if class == Class::Float { semantics::binary_f(b, v, w) } else { exact(b, v, w) };
    let iv = match b {
        BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Min | BinaryOp::Max => Iv::corners(p, q, apply),
        BinaryOp::Div if q.lo > 0.0 || q.hi < 0.0 => Iv::corners(p, q, apply),
        // An angle, whatever the operands (NaN aside); π rounded to f32 is a little above π.
        BinaryOp::Atan2 => {
            let pi = f64::from(std::f64::consts::PI as f32);
            Iv { lo: -pi, hi: pi }
        }
        _ => ANY,
    };
    Bound::new(iv, class)
}

/// `a op b` exactly (integer endpoints).
fn exact(b: BinaryOp, a: f64, c: f64) -> f64 {
    match b {
        BinaryOp::Add => a + c,
        BinaryOp::Sub => a - c,
        BinaryOp::Mul => a * c,
        BinaryOp::Min => a.min(c),
        _ => a.max(c),
    }
}

/// Whether `x op y` holds for all (`Some(true)`), none (`Some(false)`) or some values.
fn compare(b: BinaryOp, x: Iv, y: Iv) -> Option<bool> {
    let point_eq = x.lo == x.hi && y.lo == y.hi && x.lo == y.lo;
    let apart = x.hi < y.lo || y.hi < x.lo;
    match b {
        BinaryOp::Lt => {
            if x.hi < y.lo {
                Some(true)
            } else if x.lo >= y.hi {
                Some(false)
            } else {
                None
            }
        }
        BinaryOp::Le => {
            if x.hi <= y.lo {
                Some(true)
            } else if x.lo > y.hi {
                Some(false)
            } else {
                None
            }
        }
        BinaryOp::Gt => {
            if x.lo > y.hi {
                Some(true)
            } else if x.hi <= y.lo {
                Some(false)
            } else {
                None
            }
        }
        BinaryOp::Ge => {
            if x.lo >= y.hi {
                Some(true)
            } else if x.hi < y.lo {
                Some(false)
            } else {
                None
            }
        }
        BinaryOp::Eq => {
            if point_eq {
                Some(true)
            } else if apart {
                Some(false)
            } else {
                None
            }
        }
        _ => {
            if apart {
                Some(true)
            } else if point_eq {
                Some(false)
            } else {
                None
            }
        }
    }
}

/// The name under which a classification's `env` holds the value of the flash op's extra
/// operand `input` when it is a 0-d i32 value known at run time: the mask's `x<input>[]` is then
/// that number, and tiles classify as they do for a constant (a window size given as an input
/// keeps its tile skipping). No dimension can have this name.
pub fn scalar_load_key(input: usize) -> String {
    format!("\u{1}x{input}")
}

/// The name under which a run's `env` holds the value of parameter `param` when it is a 0-d
/// i32 input ([`scalar_load_key`] is its name as a flash op's operand).
pub fn scalar_param_key(param: usize) -> String {
    format!("\u{1}p{param}")
}

/// The values of an i32 or bool operand a run gave, for the range of its values over any box
/// of indices: what a mask reading segment ids (`x0[i] == x0[j]`, a packed ragged batch;
/// `x0[b, i]`, a batch of packed documents) or a dense mask (`x0[b, 0, i, j]`, transformers'
/// padding and packing masks) needs to classify its tiles from the data.
///
/// Up to [`RangeTable::MAX_VALUES`] values of a 1-d or 2-d i32 operand: exact, in constant time
/// per row (sparse tables of minima and maxima per row). Larger operands, any of three axes or
/// more, and bools: the minimum and maximum of each block of [`RangeTable::BLOCK`] ×
/// [`RangeTable::BLOCK`] values over the last two axes (one value in 32 of memory, built in one
/// pass), exact for boxes on block boundaries (tiles and their chunks are) and a bound that
/// still holds for any other.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RangeTable {
    /// The operand's shape.
    shape: Vec<usize>,
    /// Exact tables: per row (the first axis of a 2-d operand), level `k` holds the minimum and
    /// maximum of each span of `2^k` values.
    rows: Vec<Vec<(Vec<i32>, Vec<i32>)>>,
    /// Or block bounds (shared by the tables of one operand read in other shapes).
    blocks: Option<std::sync::Arc<Blocks>>,
    /// Whether the values are bools (0 and 1).
    bools: bool,
}

/// Per leading index (every axis but the last two, row-major) and per block of the last two
/// axes (row-major), the minimum and maximum.
#[derive(Clone, Debug, PartialEq, Hash)]
struct Blocks {
    /// Leading indices.
    lead: usize,
    /// Blocks down and across.
    grid: (usize, usize),
    min: Vec<i32>,
    max: Vec<i32>,
}

impl RangeTable {
    /// The table of a 1-d operand's `values` (O(n log n)).
    pub fn new(values: &[i32]) -> RangeTable {
        RangeTable::of_operand(values, &[values.len()])
    }

    /// The table of a 2-d operand: `values` in rows of `width`.
    pub fn of_rows(values: &[i32], width: usize) -> RangeTable {
        let rows = values.len().checked_div(width).unwrap_or(0);
        RangeTable::of_operand(values, &[rows, width])
    }

    /// Whether an i32 operand of `shape` gets exact tables (else block bounds).
    pub fn is_exact(shape: &[usize]) -> bool {
        match shape {
            [n] => *n <= Self::MAX_VALUES,
            [r, w] => r.checked_mul(*w).is_some_and(|n| n <= Self::MAX_VALUES),
            _ => false,
        }
    }

    /// The table of an i32 operand of `shape` (row-major `values`): exact for 1-d and 2-d
    /// operands up to [`RangeTable::MAX_VALUES`] values, block bounds otherwise. Values that do
    /// not fill the shape give an empty table (nothing is classified from them).
    pub fn of_operand(values: &[i32], shape: &[usize]) -> RangeTable {
        if shape.iter().try_fold(1usize, |a, n| a.checked_mul(*n)) != Some(values.len()) || values.is_empty() {
            return RangeTable::default();
        }
        match shape {
            [_] if Self::is_exact(shape) => RangeTable { shape: shape.to_vec(), rows: vec![levels(values)], ..RangeTable::default() },
            [_, w] if Self::is_exact(shape) => {
                RangeTable { shape: shape.to_vec(), rows: values.chunks_exact(*w).map(levels).collect(), ..RangeTable::default() }
            }
            _ => RangeTable::of_blocks(shape, values, |run: &[i32]| {
                run.iter().fold((i32::MAX, i32::MIN), |(lo, hi), v| (lo.min(*v), hi.max(*v)))
            }),
        }
    }

    /// The table of a bool operand of `shape` (false 0, true 1): block bounds at every rank.
    pub fn of_bools(values: &[bool], shape: &[usize]) -> RangeTable {
        if shape.iter().try_fold(1usize, |a, n| a.checked_mul(*n)) != Some(values.len()) || values.is_empty() {
            return RangeTable::default();
        }
        let table = RangeTable::of_blocks(shape, values, |run: &[bool]| {
            // A sum (which vectorises) rather than short-circuiting `any`/`all`.
            let trues: u32 = run.iter().map(|b| u32::from(*b)).sum();
            (i32::from(trues as usize == run.len()), i32::from(trues > 0))
        });
        RangeTable { bools: true, ..table }
    }

    /// Block bounds of `values` of `shape` (at least one value), `range` giving the minimum and
    /// maximum of a run of at most [`RangeTable::BLOCK`] values of one row.
    fn of_blocks<T>(shape: &[usize], values: &[T], range: impl Fn(&[T]) -> (i32, i32)) -> RangeTable {
        let (h, w) = match shape {
            [n] => (1, *n),
            [.., h, w] => (*h, *w),
            [] => (1, 1),
        };
        let lead = values.len() / (h * w).max(1);
        let grid = (h.div_ceil(Self::BLOCK), w.div_ceil(Self::BLOCK));
        let cells = lead * grid.0 * grid.1;
        let (mut min, mut max) = (vec![i32::MAX; cells], vec![i32::MIN; cells]);
        for (r, row) in values.chunks_exact(w.max(1)).enumerate() {
            let (l, y) = (r / h.max(1), (r % h.max(1)) / Self::BLOCK);
            let base = (l * grid.0 + y) * grid.1;
            for (x, run) in row.chunks(Self::BLOCK).enumerate() {
                let (lo, hi) = range(run);
                min[base + x] = min[base + x].min(lo);
                max[base + x] = max[base + x].max(hi);
            }
        }
        RangeTable {
            shape: shape.to_vec(),
            rows: Vec::new(),
            blocks: Some(std::sync::Arc::new(Blocks { lead, grid, min, max })),
            bools: false,
        }
    }

    /// The most values an exact table holds (2^18: at most about 40 MiB of tables, 8 bytes
    /// per value and level); larger operands get block bounds.
    pub const MAX_VALUES: usize = 1 << 18;

    /// The side of a block of block bounds, in values (a tile's rows and keys, and a chunk's,
    /// are multiples of it).
    pub const BLOCK: usize = 16;

    /// The operand's shape (empty for an empty table).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Values along the last axis (0 for an empty table).
    pub fn len(&self) -> usize {
        self.shape.last().copied().unwrap_or(0)
    }

    /// Whether the values are bools.
    pub fn is_bool(&self) -> bool {
        self.bools
    }

    /// Whether the table holds no values.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty() && self.blocks.is_none()
    }

    /// Whether the values differ along an axis before the ones a tile spans (rows of a 2-d
    /// operand, leading axes of block bounds): each batch index then has data of its own.
    pub fn per_batch(&self) -> bool {
        self.rows.len() > 1 || self.blocks.as_ref().is_some_and(|b| b.lead > 1)
    }

    /// A content key of what classification reads: equal keys classify every tile alike (for
    /// block bounds, the bounds themselves, so two masks of the same blocks share a plan).
    pub fn content_key(&self) -> i64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.shape.hash(&mut h);
        self.bools.hash(&mut h);
        match &self.blocks {
            Some(b) => b.hash(&mut h),
            None => {
                for row in &self.rows {
                    row.first().map(|(values, _)| values).hash(&mut h);
                }
            }
        }
        h.finish() as i64
    }

    /// The table as an operand of `shape` reads it, where that is the same values: the same
    /// shape, or for block bounds one of the same last two axes and element count (a mask
    /// `[B, 1, L, S]` read as `[B, 1, 1, L, S]` by grouped-query attention). `None` otherwise.
    pub fn reshaped(&self, shape: &[usize]) -> Option<RangeTable> {
        if shape == self.shape.as_slice() {
            return Some(self.clone());
        }
        let count = |s: &[usize]| s.iter().try_fold(1usize, |a, n| a.checked_mul(*n));
        let last_two = |s: &[usize]| s.len() >= 2 && s[s.len() - 2..] == self.shape[self.shape.len().saturating_sub(2)..];
        (self.blocks.is_some() && self.shape.len() >= 2 && last_two(shape) && count(shape) == count(&self.shape))
            .then(|| RangeTable { shape: shape.to_vec(), ..self.clone() })
    }

    /// The minimum and maximum of the values at indices `lo ..= hi` (`lo ≤ hi < len`) of the
    /// first row.
    pub fn min_max(&self, lo: usize, hi: usize) -> (i32, i32) {
        let spans = if self.shape.len() == 1 { vec![(lo, hi)] } else { vec![(0, 0), (lo, hi)] };
        self.min_max_spans(&spans).unwrap_or((i32::MIN, i32::MAX))
    }

    /// The minimum and maximum over the box of inclusive index spans `spans`, one per axis, each
    /// in range; `None` for a box of the wrong rank or out of range, or an empty table.
    pub fn min_max_spans(&self, spans: &[(usize, usize)]) -> Option<(i32, i32)> {
        if self.is_empty() || spans.len() != self.shape.len() || spans.iter().zip(&self.shape).any(|((lo, hi), n)| lo > hi || hi >= n) {
            return None;
        }
        if let Some(b) = &self.blocks {
            return Some(b.min_max(&self.shape, spans));
        }
        let ((r0, r1), (lo, hi)) = match spans {
            [cols] => ((0, 0), *cols),
            [rows, cols] => (*rows, *cols),
            _ => return None,
        };
        let span = hi - lo + 1;
        let k = (usize::BITS - 1 - span.leading_zeros()) as usize;
        let j = hi + 1 - (1 << k);
        Some(self.rows.get(r0..=r1)?.iter().fold((i32::MAX, i32::MIN), |(a, b), row| {
            let (mins, maxs) = &row[k];
            (a.min(mins[lo]).min(mins[j]), b.max(maxs[lo]).max(maxs[j]))
        }))
    }
}

impl Blocks {
    /// The bounds over a box (in range, one span per axis of `shape`).
    fn min_max(&self, shape: &[usize], spans: &[(usize, usize)]) -> (i32, i32) {
        let ((y0, y1), (x0, x1)) = match spans {
            [cols] => ((0, 0), *cols),
            [.., rows, cols] => (*rows, *cols),
            [] => ((0, 0), (0, 0)),
        };
        let b = RangeTable::BLOCK;
        let (y0, y1, x0, x1) = (y0 / b, y1 / b, x0 / b, x1 / b);
        let lead_axes = spans.len().saturating_sub(2);
        let (mut lo, mut hi) = (i32::MAX, i32::MIN);
        // Every leading index in the box, row-major (an odometer over the leading spans).
        let mut at: Vec<usize> = spans[..lead_axes].iter().map(|s| s.0).collect();
        loop {
            let l = at.iter().zip(shape).fold(0usize, |acc, (i, n)| acc * n + i);
            for y in y0..=y1 {
                let base = (l * self.grid.0 + y) * self.grid.1;
                for x in x0..=x1 {
                    lo = lo.min(self.min[base + x]);
                    hi = hi.max(self.max[base + x]);
                }
            }
            let mut a = lead_axes;
            loop {
                if a == 0 {
                    return (lo, hi);
                }
                a -= 1;
                if at[a] < spans[a].1 {
                    at[a] += 1;
                    break;
                }
                at[a] = spans[a].0;
            }
        }
    }
}

/// A row's sparse tables: level `k` holds the minimum and maximum of each span of `2^k` values.
fn levels(values: &[i32]) -> Vec<(Vec<i32>, Vec<i32>)> {
    let mut levels = vec![(values.to_vec(), values.to_vec())];
    let mut width = 1;
    while width * 2 <= values.len() {
        let (lo, hi) = &levels[levels.len() - 1];
        let n = lo.len() - width;
        let next = ((0..n).map(|i| lo[i].min(lo[i + width])).collect(), (0..n).map(|i| hi[i].max(hi[i + width])).collect());
        levels.push(next);
        width *= 2;
    }
    levels
}

/// What a run knows when it classifies tiles: dims and 0-d i32 inputs by name (`env`, see
/// [`scalar_load_key`]), and 1-d i32 operands' values by the flash op's operand index.
#[derive(Clone, Copy)]
pub struct Known<'a> {
    /// Dims, and scalar operands' values.
    pub env: &'a HashMap<String, i64>,
    /// Run-time values of 1-d i32 extra operands (`x<n>`).
    pub data: &'a HashMap<usize, std::sync::Arc<RangeTable>>,
}

impl<'a> Known<'a> {
    /// Only `env` (no operand's values).
    pub fn env(env: &'a HashMap<String, i64>) -> Known<'a> {
        static NONE: std::sync::OnceLock<HashMap<usize, std::sync::Arc<RangeTable>>> = std::sync::OnceLock::new();
        Known { env, data: NONE.get_or_init(HashMap::new) }
    }
}

/// The name under which a run's `env` holds a content hash of parameter `param` when it is a
/// 1-d i32 input a flash mask reads (its values classify tiles, so a prepared run is reused
/// only for the same values).
pub fn data_param_key(param: usize) -> String {
    format!("\u{1}d{param}")
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
    classify_tile_known(mask, batch_sizes, rows, cols, &Known::env(env))
}

/// [`classify_tile`] also knowing 1-d i32 operands' values (segment ids given at run time).
pub fn classify_tile_known(mask: Option<&ScoreExpr>, batch_sizes: &[i64], rows: (i64, i64), cols: (i64, i64), known: &Known) -> TileClass {
    let batch: Vec<(i64, i64)> = batch_sizes.iter().map(|n| (0, (n - 1).max(0))).collect();
    classify_tile_in(mask, &batch, rows, cols, known)
}

/// [`classify_tile_known`] over the batch indices of `batch` (an inclusive range per batch
/// axis; one index fixes it), for a tile table of some batch indices only.
pub fn classify_tile_in(
    mask: Option<&ScoreExpr>,
    batch_ranges: &[(i64, i64)],
    rows: (i64, i64),
    cols: (i64, i64),
    known: &Known,
) -> TileClass {
    if rows.0 >= rows.1 || cols.0 >= cols.1 {
        return TileClass::Skip;
    }
    let Some(mask) = mask else { return TileClass::Full };
    let batch_sizes: Vec<i64> = batch_ranges.iter().map(|(lo, hi)| hi - lo + 1).collect();
    let mut ranges: Vec<(i64, i64)> = batch_ranges.to_vec();
    ranges.push((rows.0, rows.1 - 1));
    ranges.push((cols.0, cols.1 - 1));
    let class = |ranges: &[(i64, i64)]| match bound(mask, ranges, known).iv.truth() {
        Some(true) => TileClass::Full,
        Some(false) => TileClass::Skip,
        None => TileClass::Partial,
    };
    // With per-batch data (`seg[b, i]`, a mask `[B, 1, L, S]`), every load of one batch index
    // must see that index: bounding each load over all of them would lose that two loads share
    // it. Up to `PER_BATCH` indices of the batch axes the mask reads (not the heads a padding
    // mask broadcasts over), each is classified on its own and the classes merged.
    let read: Vec<bool> = (0..batch_sizes.len()).map(|k| reads_position(mask, k)).collect();
    let batch = batch_sizes.iter().zip(&read).filter(|(_, r)| **r).try_fold(1i64, |a, (n, _)| a.checked_mul(*n)).unwrap_or(i64::MAX);
    if known.data.values().any(|t| t.per_batch()) && (1..=PER_BATCH).contains(&batch) {
        let mut merged: Option<TileClass> = None;
        for at in 0..batch {
            let mut rest = at;
            for (k, n) in batch_sizes.iter().enumerate().rev().filter(|(k, _)| read[*k]) {
                let p = rest % n.max(&1);
                rest /= n.max(&1);
                ranges[k] = (batch_ranges[k].0 + p, batch_ranges[k].0 + p);
            }
            let c = class(&ranges);
            merged = Some(match merged {
                None => c,
                Some(m) if m == c => m,
                Some(_) => return TileClass::Partial,
            });
        }
        return merged.unwrap_or(TileClass::Skip);
    }
    class(&ranges)
}

/// Whether `e` reads score position `k` (the batch axis `k`, for `k` below the query axis).
pub fn reads_position(e: &ScoreExpr, k: usize) -> bool {
    match e {
        ScoreExpr::Pos(p) => *p == k,
        ScoreExpr::Score | ScoreExpr::Float(_) | ScoreExpr::Int(_) | ScoreExpr::Dim(_) => false,
        ScoreExpr::Load { index, .. } => index.iter().any(|x| reads_position(x, k)),
        ScoreExpr::Unary(_, a) => reads_position(a, k),
        ScoreExpr::Binary(_, a, b) => reads_position(a, k) || reads_position(b, k),
        ScoreExpr::Select(c, a, b) => reads_position(c, k) || reads_position(a, k) || reads_position(b, k),
    }
}

/// The most batch indices [`classify_tile_known`] classifies one by one when the data it knows
/// has rows (per batch index ids); above it, a load is bounded over all of them.
pub const PER_BATCH: i64 = 256;

/// The class of every tile of an `m × n` score matrix cut into `tile.0 × tile.1` tiles (the
/// last row and column of tiles may be smaller).
#[derive(Clone, Debug, PartialEq)]
pub struct TileGrid {
    /// Tiles down (query blocks).
    pub rows: usize,
    /// Tiles across (key blocks).
    pub cols: usize,
    /// Tile size in scores (query rows, keys).
    pub tile: (i64, i64),
    /// The score matrix's size (queries, keys).
    pub size: (i64, i64),
    /// `rows × cols` classes, row-major.
    pub classes: Vec<TileClass>,
}

impl TileGrid {
    /// The class of tile (`r`, `c`).
    pub fn get(&self, r: usize, c: usize) -> TileClass {
        self.classes.get(r * self.cols + c).copied().unwrap_or(TileClass::Skip)
    }

    /// Counts of each class, indexed by `TileClass as usize` (skip, full, partial).
    pub fn counts(&self) -> [usize; 3] {
        let mut counts = [0usize; 3];
        for c in &self.classes {
            counts[*c as usize] += 1;
        }
        counts
    }

    /// The share of the scores that lie in skipped tiles, in `[0, 1]` (edge tiles weigh by
    /// their real size).
    pub fn skipped_share(&self) -> f64 {
        let (m, n) = self.size;
        if m <= 0 || n <= 0 {
            return 0.0;
        }
        let extent = |k: usize, step: i64, total: i64| (total - k as i64 * step).clamp(0, step) as f64;
        let mut skipped = 0.0;
        for r in 0..self.rows {
            for c in 0..self.cols {
                if self.get(r, c) == TileClass::Skip {
                    skipped += extent(r, self.tile.0, m) * extent(c, self.tile.1, n);
                }
            }
        }
        skipped / (m as f64 * n as f64)
    }
}

/// The number of tiles down and across an `m × n` score matrix in `tile_m × tile_n` tiles.
pub fn grid_size((m, n): (i64, i64), (tile_m, tile_n): (i64, i64)) -> (usize, usize) {
    let count = |len: i64, step: i64| usize::try_from((len.max(0) + step.max(1) - 1) / step.max(1)).unwrap_or(usize::MAX);
    (count(m, tile_m), count(n, tile_n))
}

/// Classifies every tile of an `m × n` score matrix ([`classify_tile`] per tile). The caller
/// bounds the work: the grid has [`grid_size`] tiles.
pub fn tile_grid(
    mask: Option<&ScoreExpr>,
    batch_sizes: &[i64],
    (m, n): (i64, i64),
    (tile_m, tile_n): (i64, i64),
    env: &HashMap<String, i64>,
) -> TileGrid {
    let (tile_m, tile_n) = (tile_m.max(1), tile_n.max(1));
    let (rows, cols) = grid_size((m, n), (tile_m, tile_n));
    let mut classes = Vec::with_capacity(rows.saturating_mul(cols));
    for r in 0..rows as i64 {
        for c in 0..cols as i64 {
            let (r0, c0) = (r * tile_m, c * tile_n);
            classes.push(classify_tile(mask, batch_sizes, (r0, (r0 + tile_m).min(m)), (c0, (c0 + tile_n).min(n)), env));
        }
    }
    TileGrid { rows, cols, tile: (tile_m, tile_n), size: (m, n), classes }
}

/// Counts of each class over an `m × n` score matrix cut into `tile_m × tile_n` tiles.
pub fn tile_census(
    mask: Option<&ScoreExpr>,
    batch_sizes: &[i64],
    size: (i64, i64),
    tile: (i64, i64),
    env: &HashMap<String, i64>,
) -> [usize; 3] {
    tile_grid(mask, batch_sizes, size, tile, env).counts()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::flash_spec::parse_expr;

    /// Brute force: evaluates the mask on every element of the tile.
    fn brute(mask: &ScoreExpr, rows: (i64, i64), cols: (i64, i64), env: &HashMap<String, i64>) -> TileClass {
        let (mut any_true, mut any_false) = (false, false);
        for i in rows.0..rows.1 {
            for j in cols.0..cols.1 {
                let v = mask.eval(0.0, &[0, 0, i, j], env, &|_, _| Scalar::F(0.0)).as_b();
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

    /// `sin` and `cos` are bounded whatever their argument: masks comparing them against
    /// constants outside [-1, 1] are settled per tile.
    #[test]
    fn sine_and_cosine_are_bounded() {
        let env = HashMap::new();
        let full = parse_expr("sin(i * 0.1) <= 1.0", 2).expect("parses");
        assert_eq!(classify_tile(Some(&full), &[], (0, 64), (0, 64), &env), TileClass::Full);
        let skip = parse_expr("cos(j) > 2.0", 2).expect("parses");
        assert_eq!(classify_tile(Some(&skip), &[], (0, 64), (0, 64), &env), TileClass::Skip);
        let angle = parse_expr("atan2(i, j) <= 3.1416", 2).expect("parses");
        assert_eq!(classify_tile(Some(&angle), &[], (0, 64), (0, 64), &env), TileClass::Full);
        let partial = parse_expr("sin(i) > 0.5", 2).expect("parses");
        assert_eq!(classify_tile(Some(&partial), &[], (0, 64), (0, 64), &env), TileClass::Partial);
    }

    #[test]
    fn census_counts_causal_tiles() {
        let mask = parse_expr("j <= i", 2).expect("parses");
        // 4x4 tiles of 64: 6 above the diagonal skipped, 4 on it partial, 6 below full.
        assert_eq!(tile_census(Some(&mask), &[], (256, 256), (64, 64), &HashMap::new()), [6, 6, 4]);
    }
}
