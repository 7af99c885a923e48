//! The table-driven test of op meaning ([`attn_compiler::ir::semantics`]): every scalar op, over
//! edge values (±0, ±inf, NaN, subnormals, the f32 and i32 limits, zero divisors), on every
//! class of operands, unfused and inside a flash op's score modification and mask, on the
//! interpreter, the CPU target and the CUDA source (host emulation). Results must have the
//! bits the semantics give, NaN-ness included. The transcendental primitives (`exp`, `tanh`,
//! `sigmoid`, `silu`, `gelu`, `elu`) are polynomial approximations on the CPU and libm calls on
//! CUDA: on ordinary finite values they may differ by a few ulp ([`APPROX_ULPS`]); on every edge
//! value (a special input or a special result) they must be exact too.

use crate::cpu::{CpuOptions, CpuProgram};
use crate::cuda::emulate::{Device, compiler_or_skip, device_graph, emulate_schedule};
use attn_compiler::interp;
use attn_compiler::ir::semantics::{self, Class, FLOAT_EDGES, INT_EDGES, Scalar};
use attn_compiler::ir::{BinaryOp, DType, Dim, FlashSpec, Graph, Op, ScoreExpr, TensorType, UnaryOp, Value, Weights, infer};
use attn_compiler::tensor::{Tensor, TensorData};
use std::collections::HashMap;

/// How far (in ulp) an approximated transcendental result may be from the reference on ordinary
/// finite values.
pub(crate) const APPROX_ULPS: u32 = 8;

const UNARY: [UnaryOp; 16] = [
    UnaryOp::Neg,
    UnaryOp::Not,
    UnaryOp::Exp,
    UnaryOp::Log,
    UnaryOp::Sqrt,
    UnaryOp::Rsqrt,
    UnaryOp::Tanh,
    UnaryOp::Sigmoid,
    UnaryOp::Relu,
    UnaryOp::Gelu,
    UnaryOp::Silu,
    UnaryOp::Elu,
    UnaryOp::Abs,
    UnaryOp::Floor,
    UnaryOp::Sin,
    UnaryOp::Cos,
];

const BINARY: [BinaryOp; 17] = [
    BinaryOp::Add,
    BinaryOp::Sub,
    BinaryOp::Mul,
    BinaryOp::Div,
    BinaryOp::Rem,
    BinaryOp::Pow,
    BinaryOp::Atan2,
    BinaryOp::Min,
    BinaryOp::Max,
    BinaryOp::Lt,
    BinaryOp::Le,
    BinaryOp::Gt,
    BinaryOp::Ge,
    BinaryOp::Eq,
    BinaryOp::Ne,
    BinaryOp::And,
    BinaryOp::Or,
];

/// Whether `op`'s float result is an approximation in the backends.
fn approximated(op: Option<UnaryOp>) -> bool {
    matches!(op, Some(UnaryOp::Exp | UnaryOp::Tanh | UnaryOp::Sigmoid | UnaryOp::Silu | UnaryOp::Gelu | UnaryOp::Elu))
}

/// The operands of one family of cases: every pair of edge values of two classes.
#[derive(Clone, Debug)]
pub(crate) struct Pairs {
    pub x: Vec<Scalar>,
    pub y: Vec<Scalar>,
}

fn edges(class: Class) -> Vec<Scalar> {
    match class {
        Class::Float => FLOAT_EDGES.iter().map(|v| Scalar::F(f64::from(*v))).collect(),
        Class::Int => INT_EDGES.iter().map(|v| Scalar::I(*v)).collect(),
        Class::Bool => vec![Scalar::B(false), Scalar::B(true)],
    }
}

/// Every pair of edge values of classes `a` and `b`.
pub(crate) fn pairs(a: Class, b: Class) -> Pairs {
    let (xs, ys) = (edges(a), edges(b));
    let mut p = Pairs { x: Vec::new(), y: Vec::new() };
    for x in &xs {
        for y in &ys {
            p.x.push(*x);
            p.y.push(*y);
        }
    }
    p
}

fn dtype_of(class: Class) -> DType {
    match class {
        Class::Float => DType::F32,
        Class::Int => DType::I32,
        Class::Bool => DType::Bool,
    }
}

/// A tensor holding scalars of one class.
pub(crate) fn tensor(shape: Vec<usize>, class: Class, values: &[Scalar]) -> Tensor {
    let data = match class {
        Class::Float => TensorData::F32(values.iter().map(|v| v.as_f() as f32).collect()),
        Class::Int => TensorData::I32(values.iter().map(|v| v.as_i()).collect()),
        Class::Bool => TensorData::Bool(values.iter().map(|v| v.as_b()).collect()),
    };
    Tensor::new(dtype_of(class), shape, data).expect("a consistent tensor")
}

/// Whether `got` is what the semantics give (`want`): the same bits, NaN-ness included; for an
/// approximated op, within [`APPROX_ULPS`] where input and result are ordinary finite values.
pub(crate) fn agrees(want: Scalar, got: f64, op: Option<UnaryOp>, input: Scalar) -> bool {
    let w = match want {
        Scalar::I(i) => return f64::from(i) == got,
        Scalar::B(b) => return f64::from(u8::from(b)) == got,
        Scalar::F(w) => w,
    };
    if w.is_nan() || got.is_nan() {
        return w.is_nan() && got.is_nan();
    }
    if w.to_bits() == got.to_bits() {
        return true;
    }
    let ordinary = |v: f64| v.is_finite() && v.abs() >= f64::from(f32::MIN_POSITIVE);
    if !(approximated(op) && ordinary(w) && ordinary(got) && ordinary(input.as_f())) {
        return false;
    }
    let (a, b) = ((w as f32).to_bits() as i64, (got as f32).to_bits() as i64);
    let ulps = (a - b).unsigned_abs();
    // GELU's erfc (Abramowitz & Stegun 7.1.26) has an absolute error below 1.5e-7, which is
    // many ulp of the tiny results in the far negative tail.
    ulps <= u64::from(APPROX_ULPS) || (op == Some(UnaryOp::Gelu) && (w - got).abs() <= GELU_ABS * input.as_f().abs().max(1.0))
}

/// The bound on GELU's absolute error per unit of `|x|` on the CPU.
pub(crate) const GELU_ABS: f64 = 2e-7;

/// One output of the unfused table: what it computes, and on which pairs.
pub(crate) struct Case {
    pub name: String,
    pub op: Option<UnaryOp>,
    pub inputs: Pairs,
    pub expected: Vec<Scalar>,
}

/// The unfused table: one graph whose outputs are every unary op, binary op, cast and `where`
/// on every class of operands the type rules allow, each over every pair of edge values.
pub(crate) fn unfused_table() -> (Graph, Vec<Tensor>, Vec<Case>) {
    let families = [(Class::Float, Class::Float), (Class::Int, Class::Int), (Class::Int, Class::Float), (Class::Bool, Class::Bool)];
    let mut g = Graph::new("semantics");
    let mut inputs = Vec::new();
    let mut params: Vec<(Value, Value, Pairs)> = Vec::new();
    for (k, (a, b)) in families.iter().enumerate() {
        let p = pairs(*a, *b);
        let n = p.x.len();
        let ty = |c: Class| TensorType::new(dtype_of(c), vec![Dim::constant(n as i64)]);
        let x = g.add(Op::Param(format!("x{k}")), ty(*a), &[]);
        let y = g.add(Op::Param(format!("y{k}")), ty(*b), &[]);
        inputs.push(tensor(vec![n], *a, &p.x));
        inputs.push(tensor(vec![n], *b, &p.y));
        params.push((x, y, p));
    }
    let mut cases = Vec::new();
    let mut add = |g: &mut Graph,
                   name: String,
                   op: Op,
                   args: &[Value],
                   declared: Option<TensorType>,
                   pairs: &Pairs,
                   eval: &dyn Fn(Scalar, Scalar) -> Scalar| {
        let tys: Vec<&TensorType> = args.iter().map(|a| &g.node(*a).ty).collect();
        let Ok(ty) = infer(&op, &tys, declared.as_ref()) else { return };
        let unary = if let Op::Unary(u) = op { Some(u) } else { None };
        let dtype = ty.dtype;
        let v = g.add(op, ty, args);
        g.add_output(name.clone(), v);
        let expected = pairs.x.iter().zip(&pairs.y).map(|(x, y)| Scalar::load(dtype, eval(*x, *y).store(dtype))).collect();
        cases.push(Case { name, op: unary, inputs: pairs.clone(), expected });
    };
    for (x, y, p) in &params {
        let t = format!("{}{}", tag(p.x[0].class()), tag(p.y[0].class()));
        for u in UNARY {
            add(&mut g, format!("{}_{t}", u.name()), Op::Unary(u), &[*x], None, p, &|a, _| semantics::unary(u, a));
        }
        for b in BINARY {
            add(&mut g, format!("{}_{t}", b.name()), Op::Binary(b), &[*x, *y], None, p, &|a, c| semantics::binary(b, a, c));
        }
        for to in [DType::F32, DType::F16, DType::BF16, DType::I32, DType::Bool] {
            let shape = g.node(*x).ty.shape.clone();
            let declared = TensorType::new(to, shape);
            add(&mut g, format!("cast_{t}_{to}"), Op::Cast, &[*x], Some(declared), p, &|a, _| a);
        }
    }
    // `where` over a bool condition and each pair of branches.
    for (x, y, p) in &params[..3] {
        let n = p.x.len();
        let cond: Vec<Scalar> = (0..n).map(|k| Scalar::B(k % 3 == 1)).collect();
        let cv = g.add(Op::Param(format!("c{}", g.params().len())), TensorType::new(DType::Bool, vec![Dim::constant(n as i64)]), &[]);
        inputs.push(tensor(vec![n], Class::Bool, &cond));
        let tys = [&g.node(cv).ty, &g.node(*x).ty, &g.node(*y).ty];
        let Ok(ty) = infer(&Op::Select, &tys, None) else { continue };
        let dtype = ty.dtype;
        let v = g.add(Op::Select, ty, &[cv, *x, *y]);
        let name = format!("where_{}", g.outputs().len());
        g.add_output(name.clone(), v);
        let expected = (0..n).map(|k| Scalar::load(dtype, semantics::select(cond[k], p.x[k], p.y[k]).store(dtype))).collect();
        cases.push(Case { name, op: None, inputs: p.clone(), expected });
    }
    (g, inputs, cases)
}

/// Compares one backend's outputs with the expected values; returns the mismatches.
pub(crate) fn mismatches(backend: &str, cases: &[Case], outputs: &[Tensor]) -> Vec<String> {
    let mut out = Vec::new();
    for (case, t) in cases.iter().zip(outputs) {
        let got = t.to_f64_vec();
        for (k, (want, g)) in case.expected.iter().zip(&got).enumerate() {
            if !agrees(*want, *g, case.op, case.inputs.x[k]) {
                out.push(format!(
                    "{backend}: {}({:?}, {:?}) = {g:e} ({:#x}), expected {:?}",
                    case.name,
                    case.inputs.x[k],
                    case.inputs.y[k],
                    (*g as f32).to_bits(),
                    want
                ));
            }
        }
    }
    out
}

#[test]
fn every_scalar_op_means_the_same_on_every_backend_unfused() {
    let (g, inputs, cases) = unfused_table();
    assert!(cases.len() > 100, "only {} cases", cases.len());
    on_every_backend("unfused_semantics", &g, &inputs, |backend, got| mismatches(backend, &cases, got));
}

/// Runs `g` on the interpreter, the CPU target and the CUDA source, and fails with every
/// mismatch `check` finds in any of their outputs.
fn on_every_backend(test: &str, g: &Graph, inputs: &[Tensor], check: impl Fn(&str, &[Tensor]) -> Vec<String>) {
    let mut failures = Vec::new();
    let want = interp::run(g, inputs, &HashMap::new()).expect("the interpreter runs the table");
    failures.extend(check("interp", &want));
    let cpu = CpuProgram::compile_graph(g, &CpuOptions { threads: 1 }).expect("compiles for the CPU");
    let got = cpu.run_tensors(inputs, &HashMap::new()).expect("runs on the CPU");
    failures.extend(check("cpu", &got));
    if let Some(got) = cuda(test, g, inputs) {
        failures.extend(check("cuda", &got));
    }
    assert!(failures.is_empty(), "{} mismatch(es):\n{}", failures.len(), failures.join("\n"));
}

/// The CUDA source of `g` run in the host emulation (unless there is no host compiler outside
/// CI, when the CUDA part of a test is skipped).
fn cuda(test: &str, g: &Graph, inputs: &[Tensor]) -> Option<Vec<Tensor>> {
    if !compiler_or_skip(test).unwrap_or_else(|e| panic!("{e}")) {
        return None;
    }
    let dir = std::env::temp_dir().join(format!("attnc-emu-{}-{test}", std::process::id()));
    let out =
        emulate_schedule(&device_graph(Device::AsWritten(g)), inputs, &HashMap::new(), &dir).unwrap_or_else(|e| panic!("{test}: {e}"));
    let _ = std::fs::remove_dir_all(&dir);
    Some(out)
}

/// One flash op of the fused table: the ops of its rows, the cases of its columns.
pub(crate) struct FusedCase {
    /// `ff_score`, `ii_mask`, ...
    pub name: String,
    /// Op name per row.
    pub rows: Vec<String>,
    /// The operands per column.
    pub inputs: Pairs,
}

/// Keys per chunk of the fused table (cases are laid out as chunks of this many keys).
const CHUNK: usize = 32;

/// The fused table: for each family of operand classes, one flash op per way an expression is
/// used (score modification, mask) over a score tensor `[chunks, ops, CHUNK]`. Row `i` computes
/// op `i` on the pair of case `b·CHUNK + j` (the extra operands `x0[b, j]`, `x1[b, j]`),
/// compares the result with the bits the semantics give (`x2[b, i, j]` for float and truth
/// results, `x3[b, i, j]` for integers; `x4` says NaN, checked as `r != r`; signed zeros
/// through `1 / r`) and keeps the key only where they agree (or where `x5` says an approximated
/// op need not be exact). Sigmoid weights over `V = I` per chunk make `out[b, i, j] = 0.5`
/// exactly where op `i` agrees on its case, and 0 where it does not.
pub(crate) fn fused_table() -> (Graph, Vec<Tensor>, Vec<FusedCase>) {
    let families = [(Class::Float, Class::Float), (Class::Int, Class::Int), (Class::Int, Class::Float), (Class::Float, Class::Int)];
    let mut g = Graph::new("fused_semantics");
    let mut inputs = Vec::new();
    let mut cases = Vec::new();
    for (a, b) in families {
        let mut p = pairs(a, b);
        while !p.x.len().is_multiple_of(CHUNK) {
            p.x.push(p.x[0]);
            p.y.push(p.y[0]);
        }
        let (tag, c) = (format!("{}{}", tag(a), tag(b)), p.x.len() / CHUNK);
        let mut rows: Vec<(String, ScoreExpr, Vec<Option<Scalar>>)> = Vec::new();
        let ld = |k: usize| ScoreExpr::Load { input: k, index: vec![ScoreExpr::Pos(0), ScoreExpr::Pos(2)] };
        for u in UNARY {
            let want = p.x.iter().map(|x| exact_case(Some(u), *x, semantics::unary(u, *x))).collect();
            rows.push((u.name().to_string(), ScoreExpr::Unary(u, Box::new(ld(0))), want));
        }
        for op in BINARY {
            let want = p.x.iter().zip(&p.y).map(|(x, y)| Some(semantics::binary(op, *x, *y))).collect();
            rows.push((op.name().to_string(), ScoreExpr::bin(op, ld(0), ld(1)), want));
        }
        let m = rows.len();
        // Cell (b, i, j) of an expected table: op i on case b·CHUNK + j.
        let cell = |f: &dyn Fn(Option<Scalar>) -> Scalar| -> Vec<Scalar> {
            (0..c).flat_map(|bb| rows.iter().flat_map(move |r| (0..CHUNK).map(move |j| r.2[bb * CHUNK + j]))).map(f).collect()
        };
        let floats = cell(&|v| Scalar::F(v.map_or(0.0, |v| v.as_f())));
        let ints = cell(&|v| Scalar::I(v.map_or(0, |v| v.as_i())));
        let nans = cell(&|v| Scalar::B(v.is_some_and(|v| v.as_f().is_nan())));
        // Cases an approximated op need not be exact on are kept regardless.
        let skip = cell(&|v| Scalar::B(v.is_none()));
        let mut pred = ScoreExpr::Int(0);
        for (k, row) in rows.iter().enumerate().rev() {
            let class = row.2.iter().flatten().next().map_or(Class::Float, |v| v.class());
            let this_row = ScoreExpr::bin(BinaryOp::Eq, ScoreExpr::Pos(1), ScoreExpr::Int(k as i64));
            pred = ScoreExpr::Select(Box::new(this_row), Box::new(agreement(&row.1, class)), Box::new(pred));
        }
        let shape = |dims: &[usize]| dims.iter().map(|d| Dim::constant(*d as i64)).collect::<Vec<_>>();
        let mut param = |g: &mut Graph, name: &str, class: Class, dims: &[usize], values: &[Scalar]| {
            inputs.push(tensor(dims.to_vec(), class, values));
            g.add(Op::Param(format!("{tag}_{name}")), TensorType::new(dtype_of(class), shape(dims)), &[])
        };
        let zeros = |k: usize| vec![Scalar::F(0.0); k];
        let eye: Vec<Scalar> =
            (0..c * CHUNK * CHUNK).map(|k| Scalar::F(if (k / CHUNK) % CHUNK == k % CHUNK { 1.0 } else { 0.0 })).collect();
        let q = param(&mut g, "q", Class::Float, &[c, m, 1], &zeros(c * m));
        let k = param(&mut g, "k", Class::Float, &[c, CHUNK, 1], &zeros(c * CHUNK));
        let v = param(&mut g, "v", Class::Float, &[c, CHUNK, CHUNK], &eye);
        let x0 = param(&mut g, "x0", a, &[c, CHUNK], &p.x);
        let x1 = param(&mut g, "x1", b, &[c, CHUNK], &p.y);
        let cells = [c, m, CHUNK];
        let x2 = param(&mut g, "x2", Class::Float, &cells, &floats);
        let x3 = param(&mut g, "x3", Class::Int, &cells, &ints);
        let x4 = param(&mut g, "x4", Class::Bool, &cells, &nans);
        let x5 = param(&mut g, "x5", Class::Bool, &cells, &skip);
        let here = vec![ScoreExpr::Pos(0), ScoreExpr::Pos(1), ScoreExpr::Pos(2)];
        let keep = ScoreExpr::bin(BinaryOp::Or, ScoreExpr::Load { input: 5, index: here }, pred);
        let minus_inf = ScoreExpr::Float(f64::NEG_INFINITY);
        let as_score = ScoreExpr::Select(Box::new(keep.clone()), Box::new(ScoreExpr::Float(0.0)), Box::new(minus_inf));
        for (use_, score, mask) in [("score", as_score, None), ("mask", ScoreExpr::Score, Some(keep))] {
            let spec = FlashSpec { rank: 3, weights: Weights::Sigmoid, score, mask, pair: attn_compiler::ir::Pair::Dot, dropout: None };
            let out = g.add(Op::Flash(Box::new(spec)), TensorType::new(DType::F32, shape(&cells)), &[q, k, v, x0, x1, x2, x3, x4, x5]);
            let name = format!("{tag}_{use_}");
            g.add_output(name.clone(), out);
            cases.push(FusedCase { name, rows: rows.iter().map(|r| r.0.clone()).collect(), inputs: p.clone() });
        }
    }
    (g, inputs, cases)
}

fn tag(c: Class) -> &'static str {
    match c {
        Class::Float => "f",
        Class::Int => "i",
        Class::Bool => "b",
    }
}

/// The expected result of a case, or `None` where an approximated op may differ (an ordinary
/// input with an ordinary result).
fn exact_case(op: Option<UnaryOp>, input: Scalar, want: Scalar) -> Option<Scalar> {
    let ordinary = |v: f64| v.is_finite() && v.abs() >= f64::from(f32::MIN_POSITIVE);
    if approximated(op) && ordinary(input.as_f()) && ordinary(want.as_f()) { None } else { Some(want) }
}

/// `r` agrees with the expected value of its cell: NaN where `x4` says so, else equal to `x2`
/// (floats and truth values) or `x3` (integers), with the sign of a zero.
fn agreement(r: &ScoreExpr, class: Class) -> ScoreExpr {
    let at = |k: usize| ScoreExpr::Load { input: k, index: vec![ScoreExpr::Pos(0), ScoreExpr::Pos(1), ScoreExpr::Pos(2)] };
    let b = ScoreExpr::bin;
    let want = if class == Class::Int { at(3) } else { at(2) };
    let one = || ScoreExpr::Float(1.0);
    let same = b(BinaryOp::Eq, r.clone(), want.clone());
    let zero_sign = b(
        BinaryOp::Or,
        b(BinaryOp::Ne, r.clone(), ScoreExpr::Float(0.0)),
        b(BinaryOp::Eq, b(BinaryOp::Div, one(), r.clone()), b(BinaryOp::Div, one(), want)),
    );
    let is_nan = b(BinaryOp::Ne, r.clone(), r.clone());
    let not_nan = ScoreExpr::Unary(UnaryOp::Not, Box::new(at(4)));
    b(BinaryOp::Or, b(BinaryOp::And, at(4), is_nan), b(BinaryOp::And, not_nan, b(BinaryOp::And, same, zero_sign)))
}

/// The cells of the fused table's outputs that are not 0.5: (flash op, op, case).
pub(crate) fn fused_mismatches(backend: &str, cases: &[FusedCase], outputs: &[Tensor]) -> Vec<String> {
    let mut out = Vec::new();
    for (case, t) in cases.iter().zip(outputs) {
        let m = case.rows.len();
        for (cell, v) in t.to_f64_vec().iter().enumerate() {
            if *v != 0.5 {
                let (b, i, j) = (cell / (m * CHUNK), (cell / CHUNK) % m, cell % CHUNK);
                let k = b * CHUNK + j;
                out.push(format!(
                    "{backend}: {} row `{}` on ({:?}, {:?}): {v}",
                    case.name, case.rows[i], case.inputs.x[k], case.inputs.y[k]
                ));
            }
        }
    }
    out
}

#[test]
fn every_scalar_op_means_the_same_on_every_backend_fused() {
    let (g, inputs, cases) = fused_table();
    on_every_backend("fused_semantics", &g, &inputs, |backend, got| fused_mismatches(backend, &cases, got));
}

/// Softmax rows (fused into flash, and unfused) follow the semantics: a kept NaN or `+inf`
/// score makes the row NaN, a row whose keys are all masked or all `-inf` is 0, and a masked
/// NaN score is ignored.
#[test]
fn softmax_rows_with_non_finite_scores_mean_the_same_everywhere() {
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    // Per row: three key biases and which keys are kept.
    let rows: [([f32; 3], [bool; 3]); 6] = [
        ([nan, 1.0, 2.0], [true, false, false]),
        ([inf, 0.0, 5.0], [true, true, false]),
        ([1.0, 2.0, 3.0], [false, false, false]),
        ([-inf, -inf, 1.0], [true, true, false]),
        ([1.0, 2.0, nan], [true, true, false]),
        ([0.5, -1.0, 3.0], [true, true, true]),
    ];
    let (m, n) = (rows.len(), 3);
    let bias: Vec<f32> = rows.iter().flat_map(|r| r.0).collect();
    let keep: Vec<bool> = rows.iter().flat_map(|r| r.1).collect();
    let text = format!(
        "graph rows {{
  %0 = param[name=q] : f32[{m}, 1]
  %1 = param[name=k] : f32[{n}, 1]
  %2 = param[name=v] : f32[{n}, 2]
  %3 = param[name=bias] : f32[{m}, {n}]
  %4 = param[name=keep] : bool[{m}, {n}]
  %5 = flash[rank=2, weights=softmax, score=\"s + x0[i, j]\", mask=\"x1[i, j]\"] %0, %1, %2, %3, %4 : f32[{m}, 2]
  %6 = const[value=-inf] : f32[]
  %7 = select %4, %3, %6 : f32[{m}, {n}]
  %8 = softmax[axis=1] %7 : f32[{m}, {n}]
  %9 = matmul %8, %2 : f32[{m}, 2]
  output fused = %5
  output unfused = %9
}}"
    );
    let g: Graph = text.parse().expect("the IR parses");
    let t = |shape: Vec<usize>, data: TensorData| {
        Tensor::new(if matches!(data, TensorData::Bool(_)) { DType::Bool } else { DType::F32 }, shape, data).expect("tensor")
    };
    let inputs = vec![
        t(vec![m, 1], TensorData::F32(vec![0.0; m])),
        t(vec![n, 1], TensorData::F32(vec![0.0; n])),
        t(vec![n, 2], TensorData::F32(vec![1.0, -2.0, 3.0, 0.25, -1.5, 8.0])),
        t(vec![m, n], TensorData::F32(bias)),
        t(vec![m, n], TensorData::Bool(keep)),
    ];
    let want = interp::run(&g, &inputs, &HashMap::new()).expect("interpreter");
    let cpu =
        CpuProgram::compile_graph(&g, &CpuOptions { threads: 1 }).expect("compiles").run_tensors(&inputs, &HashMap::new()).expect("runs");
    let mut backends = vec![("interp", want.clone()), ("cpu", cpu)];
    backends.extend(cuda("softmax_rows", &g, &inputs).map(|t| ("cuda", t)));
    let expected_nan = [true, true, false, false, false, false];
    let expected_zero = [false, false, true, true, false, false];
    for (backend, outs) in &backends {
        for (name, out) in ["fused", "unfused"].iter().zip(outs.iter()) {
            let vals = out.to_f64_vec();
            for r in 0..m {
                let row = &vals[2 * r..2 * r + 2];
                let what = format!("{backend} {name} row {r}: {row:?}");
                assert_eq!(row.iter().all(|v| v.is_nan()), expected_nan[r], "{what}");
                assert_eq!(row.iter().all(|v| *v == 0.0), expected_zero[r], "{what}");
                if !expected_nan[r] {
                    let reference = &want[0].to_f64_vec()[2 * r..2 * r + 2];
                    assert!(row.iter().zip(reference).all(|(a, b)| (a - b).abs() <= 1e-6), "{what} vs {reference:?}");
                }
            }
        }
    }
}
