//! The CPU target against the reference interpreter: every example at many sizes and thread
//! counts, random score modifications and masks, memory bounds for fused attention, typed
//! errors.

use attn_compiler::interp;
use attn_compiler::ir::{BinaryOp, DType, Dim, FlashSpec, Graph, Op, ScoreExpr, TensorType, UnaryOp, Weights};
use attn_runtime::cpu::{CpuError, CpuOptions, CpuProgram, OutData, OutRef, TensorRef};
use attn_runtime::{Program, Tensor, TensorData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::path::PathBuf;

/// Every tolerance of this file.
mod tol {
    /// fp32 results: `max |got - want| ≤ FP32_REL · max |want|` (normwise relative error).
    pub const FP32_REL: f64 = 1e-4;
    /// The smallest `max |want|` the relative error is measured against (all-zero outputs).
    pub const FLOOR: f64 = 1e-6;
}

fn examples_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

/// Compares outputs: floats within [`tol`], integers and bools exactly; NaN matches NaN.
fn compare(got: &[Tensor], want: &[Tensor]) -> Result<f64, String> {
    attn_compiler::tensor::compare_outputs(got, want, tol::FP32_REL, tol::FLOOR)
}

/// Dims for an example at sequence length `s` and width `d` (only the dims the entry uses).
fn dims_for(program: &Program, entry: &str, s: i64, d: i64) -> HashMap<String, i64> {
    let mut dims = HashMap::new();
    for name in program.entry_dims(entry).expect("entry") {
        let v = match name.as_str() {
            "S" | "T" | "M" | "N" => s,
            "D" | "Dv" | "Dq" | "Dk" => d,
            "Dh" => (d / 8).max(1),
            "B" => 1,
            "H" | "G" | "R" => 2,
            "A" => 8,
            "F" => 16,
            "P" => 5,
            "C" => 4,
            "Hh" => s.max(1),
            "Ww" => 3,
            _ => 2,
        };
        dims.insert(name, v);
    }
    dims
}

struct Case {
    inputs: Vec<Tensor>,
    dims: HashMap<String, i64>,
    want: Vec<Tensor>,
}

fn case(program: &Program, entry: &str, s: i64, d: i64, seed: u64) -> Case {
    let dims = program.random_dims(entry, &dims_for(program, entry, s, d)).expect("dims");
    let inputs: Vec<Tensor> = program.random_inputs(entry, seed, &dims).expect("inputs").into_iter().map(|(_, t)| t).collect();
    let want = interp::run(program.graph(entry).expect("graph"), &inputs, &dims).expect("interpreter runs");
    Case { inputs, dims, want }
}

/// Runs `c` with 1 and 2 threads; both must match the interpreter and each other bit for bit.
/// The 2-thread run writes its results into the caller's buffers (`run_into`), filled with
/// NaN and `i32::MIN` first: no kernel may read a result's memory before writing it.
fn check(compiled: &mut CpuProgram, c: &Case, what: &str, failures: &mut Vec<String>) {
    let mut first: Option<Vec<Tensor>> = None;
    for threads in [1, 2] {
        compiled.set_threads(threads).expect("a valid thread count");
        let run = if threads == 1 { compiled.run_tensors(&c.inputs, &c.dims) } else { run_into_stale(compiled, c) };
        match run {
            Ok(got) => {
                if let Err(e) = compare(&got, &c.want) {
                    failures.push(format!("{what}, {threads} thread(s): {e}"));
                }
                match &first {
                    None => first = Some(got),
                    Some(f) if !same_bits(f, &got) => failures.push(format!("{what}: 1 and {threads} threads differ")),
                    Some(_) => {}
                }
            }
            Err(e) => failures.push(format!("{what}, {threads} thread(s): {e}")),
        }
    }
}

/// `c` run into buffers of the interpreter's result shapes that hold NaN (i32::MIN) first;
/// bool results come back as owned tensors.
fn run_into_stale(compiled: &CpuProgram, c: &Case) -> Result<Vec<Tensor>, CpuError> {
    let mut data: Vec<TensorData> = c
        .want
        .iter()
        .map(|t| match t.dtype {
            DType::I32 => TensorData::I32(vec![i32::MIN; t.len()]),
            DType::Bool => TensorData::Bool(Vec::new()),
            _ => TensorData::F32(vec![f32::NAN; t.len()]),
        })
        .collect();
    let refs: Vec<TensorRef> = c.inputs.iter().map(TensorRef::of).collect();
    let mut outs: Vec<Option<OutRef>> = data
        .iter_mut()
        .zip(&c.want)
        .map(|(d, t)| match d {
            TensorData::F32(v) => Some(OutRef { shape: &t.shape, data: OutData::F32(v) }),
            TensorData::I32(v) => Some(OutRef { shape: &t.shape, data: OutData::I32(v) }),
            TensorData::Bool(_) => None,
        })
        .collect();
    let owned = compiled.run_into(&refs, &c.dims, &mut outs)?;
    drop(outs);
    Ok(owned
        .into_iter()
        .zip(data)
        .zip(&c.want)
        .map(|((o, d), t)| o.unwrap_or_else(|| Tensor::new(t.dtype, t.shape.clone(), d).expect("a result of its own shape")))
        .collect())
}

/// Whether two runs' outputs are identical bit for bit (NaN included).
fn same_bits(a: &[Tensor], b: &[Tensor]) -> bool {
    let bits = |t: &Tensor| t.to_f64_vec().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.shape == y.shape && x.dtype == y.dtype && bits(x) == bits(y))
}

fn example_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(examples_dir())
        .expect("examples")
        .filter_map(|e| e.ok())
        .filter_map(|e| e.path().file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".attn")).map(str::to_string))
        .collect();
    names.sort();
    names
}

#[test]
fn every_example_matches_the_interpreter() {
    let names = example_names();
    assert!(names.len() >= 21, "found {} examples", names.len());
    let mut failures = Vec::new();
    for name in &names {
        let program = Program::from_file(examples_dir().join(format!("{name}.attn"))).expect("example compiles");
        for entry in program.entries() {
            let mut compiled = match program.compile_cpu(&entry.name, &CpuOptions { threads: 1 }) {
                Ok(c) => c,
                Err(e) => {
                    failures.push(format!("{name}/{}: {e}", entry.name));
                    continue;
                }
            };
            let mut sizes: Vec<(i64, i64)> = Vec::new();
            for s in [1, 7, 63, 64, 65, 130] {
                for d in [16, 64, 128] {
                    sizes.push((s, d));
                }
            }
            for (n, (s, d)) in sizes.into_iter().enumerate() {
                let c = case(&program, &entry.name, s, d, n as u64);
                check(&mut compiled, &c, &format!("{name}/{} S={s} D={d}", entry.name), &mut failures);
            }
        }
    }
    assert!(failures.is_empty(), "{} failure(s):\n  {}", failures.len(), failures.join("\n  "));
}

#[test]
fn long_sequences_match_the_interpreter() {
    // S = 1000 for every example at every head width (by default, each example at one of them
    // in turn; one head keeps the oracle's time sane).
    let mut failures = Vec::new();
    let cases = example_names()
        .into_iter()
        .enumerate()
        .flat_map(|(e, n)| attn_tests::matrix([16, 64, 128], |k| k == e % 3).into_iter().map(move |d| (n.clone(), d)).collect::<Vec<_>>());
    for (name, d) in cases {
        let name = name.as_str();
        let program = Program::from_file(examples_dir().join(format!("{name}.attn"))).expect("example compiles");
        let entry = program.default_entry().expect("entry").name;
        let mut compiled = program.compile_cpu(&entry, &CpuOptions { threads: 1 }).expect("compiles");
        let mut dims = dims_for(&program, &entry, 1000, d);
        // One head (where the entry has a free head count) keeps the oracle's time sane.
        if program.entry_dims(&entry).expect("dims").iter().any(|n| n == "H") && !program.fixed_dims().iter().any(|(n, _)| n == "H") {
            dims.insert("H".into(), 1);
        }
        let dims = program.random_dims(&entry, &dims).expect("dims");
        let inputs: Vec<Tensor> = program.random_inputs(&entry, 7, &dims).expect("inputs").into_iter().map(|(_, t)| t).collect();
        let want = interp::run(program.graph(&entry).expect("graph"), &inputs, &dims).expect("interpreter");
        check(&mut compiled, &Case { inputs, dims, want }, &format!("{name} S=1000 D={d}"), &mut failures);
    }
    assert!(failures.is_empty(), "{} failure(s):\n  {}", failures.len(), failures.join("\n  "));
}

/// Multi-head additive attention with a scale and a causal mask (one weight vector), and with
/// a weight vector per head: each fuses into one flash op with additive scores, holds no M×N×A
/// temporary (nothing beyond the projections), and matches the interpreter on the three forms
/// of the score kernel (inputs scaled small, as given, and with an infinity).
#[test]
fn masked_additive_attention_fuses_and_matches_the_interpreter() {
    let shared =
        "fn additive(q: f32[B, H, M, Dq], k: f32[B, H, N, Dk], w_q: f32[Dq, A], w_k: f32[Dk, A], v_a: f32[A]) -> f32[B, H, M, Dk] {
    let qa = unsqueeze(q @ w_q, 3)
    let ka = unsqueeze(k @ w_k, 2)
    let scores = sum(tanh(qa + ka) * v_a, axis = A) * 0.5
    let (b, h, i, j) = indices(scores)
    return softmax(where(j <= i + 3, scores, -inf), axis = -1) @ k
}";
    let per_head =
        "fn additive(q: f32[B, H, M, Dq], k: f32[B, H, N, Dk], w_q: f32[Dq, A], w_k: f32[Dk, A], v_a: f32[H, A]) -> f32[B, H, M, Dk] {
    let qa = unsqueeze(q @ w_q, 3)
    let ka = unsqueeze(k @ w_k, 2)
    return softmax(sum(unsqueeze(unsqueeze(v_a, 1), 1) * tanh(qa + ka), axis = A), axis = -1) @ k
}";
    let mut failures = Vec::new();
    for (name, source) in [("shared weight", shared), ("weight per head", per_head)] {
        let program = Program::from_source(source, "additive.attn").expect("compiles");
        let mut compiled = program.compile_cpu("additive", &CpuOptions { threads: 1 }).expect("compiles");
        let graph = compiled.graph();
        let fused = graph.values().filter(|v| matches!(&graph.node(*v).op, Op::Flash(f) if f.pair != attn_compiler::ir::Pair::Dot)).count();
        assert_eq!(fused, 1, "{name}: not fused:\n{graph}");
        for (n, (m, scale)) in [(1, 1.0f32), (65, 0.05), (130, 1.0), (77, f32::INFINITY)].into_iter().enumerate() {
            let dims = HashMap::from([
                ("B".into(), 2),
                ("H".into(), 2),
                ("M".into(), m),
                ("N".into(), m + 5),
                ("Dq".into(), 24),
                ("Dk".into(), 16),
                ("A".into(), 40),
            ]);
            let mut inputs: Vec<Tensor> =
                program.random_inputs("additive", n as u64, &dims).expect("inputs").into_iter().map(|(_, t)| t).collect();
            if scale.is_finite() {
                let data: Vec<f32> = inputs[2].to_f64_vec().iter().map(|x| *x as f32 * scale).collect();
                inputs[2] = Tensor::f32(inputs[2].shape.clone(), data).expect("tensor");
            } else {
                // One infinite query element: its row takes the direct form.
                let mut data: Vec<f32> = inputs[0].to_f64_vec().iter().map(|x| *x as f32).collect();
                data[5] = f32::INFINITY;
                inputs[0] = Tensor::f32(inputs[0].shape.clone(), data).expect("tensor");
            }
            let want = interp::run(program.graph("additive").expect("graph"), &inputs, &dims).expect("interpreter");
            check(
                &mut compiled,
                &Case { inputs: inputs.clone(), dims: dims.clone(), want },
                &format!("{name} M={m} x{scale}"),
                &mut failures,
            );
            let stats = compiled.prepare(&inputs.iter().map(TensorRef::of).collect::<Vec<_>>(), &dims).expect("plans");
            // Nothing larger than the key projection `[B, H, N, A]`.
            assert!(stats.largest_temp_bytes <= (2 * 2 * (m + 5) * 40 * 4) as usize, "{name} M={m}: {stats:?}");
        }
        // Wider than the score kernel's buffers are sized for: a typed error, not an abort.
        let dims = dim_map(&[("B", 1), ("H", 1), ("M", 2), ("N", 2), ("Dq", 2), ("Dk", 2), ("A", 9000)]);
        let inputs: Vec<Tensor> = program.random_inputs("additive", 1, &dims).expect("inputs").into_iter().map(|(_, t)| t).collect();
        match compiled.run_tensors(&inputs, &dims) {
            Err(e @ CpuError::Unsupported(_)) => assert!(e.to_string().contains("additive scores of width 9000"), "{e}"),
            other => panic!("{name}: expected the width limit, got {other:?}"),
        }
    }
    // In f16 (stored as f32 on the CPU, rounded per op): within an f16 rounding or two of the
    // interpreter.
    let program = Program::from_source(&shared.replace("f32", "f16"), "additive16.attn").expect("compiles");
    let compiled = program.compile_cpu("additive", &CpuOptions { threads: 2 }).expect("compiles");
    let dims = dim_map(&[("B", 2), ("H", 2), ("M", 65), ("N", 70), ("Dq", 24), ("Dk", 16), ("A", 40)]);
    let inputs: Vec<Tensor> = program.random_inputs("additive", 3, &dims).expect("inputs").into_iter().map(|(_, t)| t).collect();
    let want = interp::run(program.graph("additive").expect("graph"), &inputs, &dims).expect("interpreter")[0].to_f64_vec();
    let got = compiled.run_tensors(&inputs, &dims).expect("runs")[0].to_f64_vec();
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let err = got.iter().zip(&want).fold(0.0f64, |m, (a, b)| m.max((a - b).abs())) / scale;
    assert!(err < 4e-3, "f16: max|diff|/max|ref| = {err:e}");
    assert!(failures.is_empty(), "{} failure(s):\n  {}", failures.len(), failures.join("\n  "));
}

#[test]
fn decode_splits_keys_and_merges_deterministically() {
    // M = 1 with a long key range splits the keys (split-KV); any thread count gives the same bits.
    let program = Program::from_file(examples_dir().join("decode.attn")).expect("compiles");
    let dims = HashMap::from([("B".into(), 1), ("H".into(), 3), ("T".into(), 9000), ("D".into(), 16)]);
    let inputs: Vec<Tensor> = program.random_inputs("decode", 3, &dims).expect("inputs").into_iter().map(|(_, t)| t).collect();
    let want = interp::run(program.graph("decode").expect("graph"), &inputs, &dims).expect("interpreter");
    let mut compiled = program.compile_cpu("decode", &CpuOptions { threads: 1 }).expect("compiles");
    let mut failures = Vec::new();
    check(&mut compiled, &Case { inputs: inputs.clone(), dims: dims.clone(), want: want.clone() }, "decode T=9000", &mut failures);
    compiled.set_threads(3).expect("a valid thread count");
    let three = compiled.run_tensors(&inputs, &dims).expect("runs");
    compiled.set_threads(1).expect("a valid thread count");
    assert_eq!(three, compiled.run_tensors(&inputs, &dims).expect("runs"), "3 threads differ from 1");
    assert!(compiled.alloc_stats().expect("stats").partial_bytes > 0, "the keys were not split");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Attention whose result is returned in transformers' `[B, S, H, D]` layout: the flash
/// kernels write it there (no output copy), in the tiled, few-rows (decode) and split-KV
/// paths, causal or not, and it matches the interpreter.
#[test]
fn a_permuted_attention_result_is_written_in_place() {
    let source = "fn attn(q: f32[B, S, H, D], k: f32[B, T, H, D], v: f32[B, T, H, D]) -> (out: f32[B, S, H, D], causal: f32[B, S, H, D]) {
    let qh = permute(q, [0, 2, 1, 3])
    let kh = permute(k, [0, 2, 1, 3])
    let vh = permute(v, [0, 2, 1, 3])
    let scores = qh @ kh.T / sqrt(D)
    let (b, h, i, j) = indices(scores)
    let plain = softmax(scores, axis = -1) @ vh
    let masked = softmax(where(j <= i + T - S, scores, -inf), axis = -1) @ vh
    return permute(plain, [0, 2, 1, 3]), permute(masked, [0, 2, 1, 3])
}";
    let program = Program::from_source(source, "seq_major.attn").expect("compiles");
    let mut compiled = program.compile_cpu("attn", &CpuOptions { threads: 1 }).expect("compiles");
    let steps: Vec<&str> = compiled.schedule().steps.iter().map(|s| s.label.as_str()).collect();
    assert!(!steps.iter().any(|l| l.contains("output copy")), "{steps:?}");
    let mut failures = Vec::new();
    for (s, t) in [(1, 9000), (3, 40), (64, 64), (130, 200)] {
        let dims = HashMap::from([("B".into(), 2), ("S".into(), s), ("T".into(), t), ("H".into(), 3), ("D".into(), 16)]);
        let inputs: Vec<Tensor> = program.random_inputs("attn", s as u64, &dims).expect("inputs").into_iter().map(|(_, t)| t).collect();
        let want = interp::run(program.graph("attn").expect("graph"), &inputs, &dims).expect("interpreter");
        check(&mut compiled, &Case { inputs, dims, want }, &format!("S={s} T={t}"), &mut failures);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Builds `flash(q, k, v, x0, x1)` with q `[B, H, M, D]`, k/v `[Bk, Hk, N, D]` (Bk, Hk: B/H
/// or 1), x0 `f32[H]` and x1 `i32[B, N]`.
fn flash_graph(spec: FlashSpec, kv_batch: (bool, bool)) -> Graph {
    let d = |s: &str| Dim::sym(s);
    let one = Dim::constant(1);
    let mut g = Graph::new("f");
    let f32t = |shape: Vec<Dim>| TensorType::new(DType::F32, shape);
    let q = g.add(Op::Param("q".into()), f32t(vec![d("B"), d("H"), d("M"), d("D")]), &[]);
    let kb = if kv_batch.0 { d("B") } else { one.clone() };
    let kh = if kv_batch.1 { d("H") } else { one.clone() };
    let k = g.add(Op::Param("k".into()), f32t(vec![kb.clone(), kh.clone(), d("N"), d("D")]), &[]);
    let v = g.add(Op::Param("v".into()), f32t(vec![kb, kh, d("N"), d("D")]), &[]);
    let x0 = g.add(Op::Param("x0".into()), f32t(vec![d("H")]), &[]);
    let x1 = g.add(Op::Param("x1".into()), TensorType::new(DType::I32, vec![d("B"), d("N")]), &[]);
    let out = g.add(Op::Flash(Box::new(spec)), f32t(vec![d("B"), d("H"), d("M"), d("D")]), &[q, k, v, x0, x1]);
    g.add_output("out", out);
    g
}

/// A random integer-valued position expression.
fn int_expr(rng: &mut StdRng, depth: u32) -> ScoreExpr {
    let leaf = |rng: &mut StdRng| match rng.random_range(0..5) {
        0 => ScoreExpr::Pos(2),
        1 => ScoreExpr::Pos(3),
        2 => ScoreExpr::Int(rng.random_range(-20..40)),
        3 => ScoreExpr::Load { input: 1, index: vec![ScoreExpr::Pos(0), ScoreExpr::Pos(rng.random_range(2..4))] },
        _ => ScoreExpr::Pos(1),
    };
    if depth == 0 || rng.random_bool(0.3) {
        return leaf(rng);
    }
    let op = [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Min, BinaryOp::Max, BinaryOp::Rem][rng.random_range(0..6)];
    let e = ScoreExpr::bin(op, int_expr(rng, depth - 1), int_expr(rng, depth - 1));
    if rng.random_bool(0.2) { ScoreExpr::Unary(UnaryOp::Abs, Box::new(e)) } else { e }
}

/// A random mask predicate over positions and the i32 extra.
fn mask_expr(rng: &mut StdRng, depth: u32) -> ScoreExpr {
    if depth == 0 || rng.random_bool(0.4) {
        let op = [BinaryOp::Lt, BinaryOp::Le, BinaryOp::Gt, BinaryOp::Ge, BinaryOp::Eq, BinaryOp::Ne][rng.random_range(0..6)];
        return ScoreExpr::bin(op, int_expr(rng, 2), int_expr(rng, 2));
    }
    match rng.random_range(0..3) {
        0 => ScoreExpr::bin(BinaryOp::And, mask_expr(rng, depth - 1), mask_expr(rng, depth - 1)),
        1 => ScoreExpr::bin(BinaryOp::Or, mask_expr(rng, depth - 1), mask_expr(rng, depth - 1)),
        _ => ScoreExpr::Unary(UnaryOp::Not, Box::new(mask_expr(rng, depth - 1))),
    }
}

/// A random score modification of `s`.
fn score_expr(rng: &mut StdRng, depth: u32) -> ScoreExpr {
    if depth == 0 || rng.random_bool(0.25) {
        return match rng.random_range(0..6) {
            0 | 1 => ScoreExpr::Score,
            2 => ScoreExpr::Float(rng.random_range(-2.0..2.0)),
            3 => ScoreExpr::Load { input: 0, index: vec![ScoreExpr::Pos(1)] },
            4 => ScoreExpr::bin(BinaryOp::Div, int_expr(rng, 1), ScoreExpr::Float(16.0)),
            _ => ScoreExpr::Dim(Dim::sym("D")),
        };
    }
    match rng.random_range(0..8) {
        0 => ScoreExpr::Unary(
            [UnaryOp::Tanh, UnaryOp::Sigmoid, UnaryOp::Abs, UnaryOp::Neg, UnaryOp::Relu][rng.random_range(0..5)],
            Box::new(score_expr(rng, depth - 1)),
        ),
        1 => ScoreExpr::Select(Box::new(mask_expr(rng, 1)), Box::new(score_expr(rng, depth - 1)), Box::new(score_expr(rng, depth - 1))),
        n => {
            let op = [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Min, BinaryOp::Max, BinaryOp::Add][n as usize - 2];
            ScoreExpr::bin(op, score_expr(rng, depth - 1), score_expr(rng, depth - 1))
        }
    }
}

fn random_tensor(rng: &mut StdRng, shape: Vec<usize>) -> Tensor {
    let n = shape.iter().product();
    Tensor::f32(shape, (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()).expect("tensor")
}

#[test]
fn random_score_mods_and_masks_match_the_interpreter() {
    let mut rng = StdRng::seed_from_u64(2024);
    let mut failures = Vec::new();
    for case in 0..120 {
        let s = ScoreExpr::bin(BinaryOp::Mul, ScoreExpr::Score, ScoreExpr::Float(0.3));
        let score = if rng.random_bool(0.8) { ScoreExpr::bin(BinaryOp::Add, s, score_expr(&mut rng, 3)) } else { s };
        let mask = if rng.random_bool(0.8) { Some(mask_expr(&mut rng, 2)) } else { None };
        let weights = if rng.random_bool(0.8) { Weights::Softmax } else { Weights::Sigmoid };
        let spec = FlashSpec { rank: 4, weights, score, mask, pair: attn_compiler::ir::Pair::Dot, dropout: None };
        let kv_batch = (rng.random_bool(0.5), rng.random_bool(0.5));
        let g = flash_graph(spec.clone(), kv_batch);
        let (b, h) = (rng.random_range(1..3usize), rng.random_range(1..4usize));
        let (m, n, d) = (rng.random_range(1..150usize), rng.random_range(1..150usize), [1usize, 3, 16, 33][rng.random_range(0..4)]);
        let kvs = vec![if kv_batch.0 { b } else { 1 }, if kv_batch.1 { h } else { 1 }, n, d];
        let seg: Vec<i32> = (0..b * n).map(|i| ((i % n) / 17) as i32).collect();
        let inputs = vec![
            random_tensor(&mut rng, vec![b, h, m, d]),
            random_tensor(&mut rng, kvs.clone()),
            random_tensor(&mut rng, kvs),
            random_tensor(&mut rng, vec![h]),
            Tensor::i32(vec![b, n], seg).expect("seg"),
        ];
        let dims = HashMap::new();
        let want = match interp::run(&g, &inputs, &dims) {
            Ok(w) => w,
            Err(e) => panic!("case {case}: the interpreter fails: {e}"),
        };
        let what = format!(
            "case {case}: {} m={m} n={n} d={d} b={b} h={h} kv={kv_batch:?}",
            Op::Flash(Box::new(spec)).attrs().iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")
        );
        match CpuProgram::compile_graph(&g, &CpuOptions { threads: 1 + case % 2 }) {
            Ok(mut c) => check(&mut c, &Case { inputs, dims, want }, &what, &mut failures),
            Err(e) => failures.push(format!("{what}: {e}")),
        }
    }
    assert!(failures.is_empty(), "{} failure(s):\n  {}", failures.len(), failures.join("\n  "));
}

#[test]
fn fused_attention_allocates_no_score_matrix() {
    let program = Program::from_file(examples_dir().join("sdpa.attn")).expect("compiles");
    let s = 8192usize;
    let dims = HashMap::from([("B".into(), 1), ("H".into(), 1), ("S".into(), s as i64), ("D".into(), 16)]);
    let inputs: Vec<Tensor> = program.random_inputs("sdpa", 1, &dims).expect("inputs").into_iter().map(|(_, t)| t).collect();
    let fused = program.compile_cpu("sdpa", &CpuOptions { threads: 2 }).expect("compiles");
    let out = fused.run_tensors(&inputs, &dims).expect("runs");
    assert_eq!(out[0].shape, [1, 1, s, 16]);
    let stats = fused.alloc_stats().expect("stats");
    let score_matrix = s * s * 4;
    assert!(stats.largest_temp_bytes < score_matrix / 64, "{stats:?}");
    assert!(stats.extra_bytes(2) < 2 << 20, "more than 2 MiB beyond inputs and outputs: {stats:?}");
    // The unfused graph does need the matrix: the statistics see it.
    let unfused = CpuProgram::compile_graph(program.graph("sdpa").expect("graph"), &CpuOptions { threads: 1 }).expect("compiles");
    let stats = unfused.prepare(&inputs.iter().map(TensorRef::of).collect::<Vec<_>>(), &dims).expect("plans");
    assert!(stats.largest_temp_bytes >= score_matrix, "{stats:?}");
}

#[test]
fn mismatched_inputs_are_typed_errors() {
    let program = Program::from_file(examples_dir().join("alibi.attn")).expect("compiles");
    let c = program.compile_cpu("alibi", &CpuOptions::default()).expect("compiles");
    let shape = [1usize, 2, 5, 4];
    let data = vec![0.5f32; 40];
    let slopes = vec![0.1f32; 2];
    let ok = [TensorRef::f32(&shape, &data), TensorRef::f32(&shape, &data), TensorRef::f32(&shape, &data), TensorRef::f32(&[2], &slopes)];
    assert!(c.run(&ok, &HashMap::new()).is_ok());
    let input = |r: Result<Vec<Tensor>, CpuError>| match r {
        Err(CpuError::Input(e)) => e,
        other => panic!("expected an input error, got {other:?}"),
    };
    assert!(matches!(input(c.run(&ok[..3], &HashMap::new())), attn_compiler::exec::ExecError::InputCount { expected: 4, actual: 3, .. }));
    let ints = vec![1i32; 40];
    let wrong_dtype = [ok[0], TensorRef::i32(&shape, &ints), ok[2], ok[3]];
    assert!(matches!(input(c.run(&wrong_dtype, &HashMap::new())), attn_compiler::exec::ExecError::InputDType { .. }));
    let short = [ok[0], TensorRef::f32(&shape, &data[..39]), ok[2], ok[3]];
    assert!(matches!(input(c.run(&short, &HashMap::new())), attn_compiler::exec::ExecError::InputData { .. }));
    let other = [1usize, 2, 4, 5];
    let mismatch = [ok[0], TensorRef::f32(&other, &data), ok[2], ok[3]];
    assert!(matches!(input(c.run(&mismatch, &HashMap::new())), attn_compiler::exec::ExecError::DimMismatch { .. }));
    let rank = [1usize, 2, 20];
    let bad_rank = [ok[0], TensorRef::f32(&rank, &data), ok[2], ok[3]];
    assert!(matches!(input(c.run(&bad_rank, &HashMap::new())), attn_compiler::exec::ExecError::InputRank { .. }));
    let three = [3usize];
    let slopes3 = vec![0.0f32; 3];
    let wrong_h = [ok[0], ok[1], ok[2], TensorRef::f32(&three, &slopes3)];
    assert!(matches!(input(c.run(&wrong_h, &HashMap::new())), attn_compiler::exec::ExecError::DimMismatch { .. }));
    // Owned tensors through the program API report the interpreter's errors too.
    let t = Tensor::new(DType::F32, vec![2], TensorData::F32(vec![0.0; 2])).expect("tensor");
    assert!(program.run("alibi", [("q", t)], &attn_runtime::RunOptions::default()).is_err());
}

#[test]
fn compiled_programs_can_be_shared_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<CpuProgram>();
    send_sync::<Program>();
    // Two threads running one compiled entry at once take turns and both get the right answer.
    let program = Program::from_file(examples_dir().join("sdpa.attn")).expect("compiles");
    let compiled = program.compile_cpu("sdpa", &CpuOptions { threads: 1 }).expect("compiles");
    let c = case(&program, "sdpa", 33, 16, 5);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let got = compiled.run_tensors(&c.inputs, &c.dims).expect("runs");
                compare(&got, &c.want).expect("matches");
            });
        }
    });
}

#[test]
fn runs_on_several_threads_at_once_share_the_pool_or_start_their_own() {
    // Two programs of three threads each, run at the same time from two threads, many times:
    // one holds the process's worker pool while the other starts threads of its own; every run
    // gives the single-threaded bits.
    let program = Program::from_file(examples_dir().join("causal.attn")).expect("compiles");
    let c = case(&program, "causal_attention", 150, 16, 9);
    let alone = program.compile_cpu("causal_attention", &CpuOptions { threads: 1 }).expect("compiles");
    let want = alone.run_tensors(&c.inputs, &c.dims).expect("runs");
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let compiled = program.compile_cpu("causal_attention", &CpuOptions { threads: 3 }).expect("compiles");
                for _ in 0..40 {
                    assert_eq!(compiled.run_tensors(&c.inputs, &c.dims).expect("runs"), want, "3 threads differ from 1");
                }
            });
        }
    });
}

#[test]
fn scores_jumping_far_above_the_running_max_are_handled() {
    // Keys past the first tiles score ~100 higher than the early ones: the online softmax
    // must move its shift (it keeps it while a tile's max stays within the slack) and rescale.
    let program = Program::from_file(examples_dir().join("sdpa.attn")).expect("compiles");
    for (s, threads) in [(700usize, 1usize), (1300, 2)] {
        let dims = HashMap::from([("B".into(), 1), ("H".into(), 2), ("S".into(), s as i64), ("D".into(), 16)]);
        let mut inputs: Vec<Tensor> = program.random_inputs("sdpa", 11, &dims).expect("inputs").into_iter().map(|(_, t)| t).collect();
        if let TensorData::F32(k) = &mut inputs[1].data {
            for (n, x) in k.iter_mut().enumerate() {
                let j = (n / 16) % s;
                if j >= 300 {
                    *x = *x * 60.0 + 3.0;
                }
            }
        }
        if let TensorData::F32(q) = &mut inputs[0].data {
            q.iter_mut().for_each(|x| *x = x.abs() + 0.5);
        }
        let want = interp::run(program.graph("sdpa").expect("graph"), &inputs, &dims).expect("interpreter");
        let mut compiled = program.compile_cpu("sdpa", &CpuOptions { threads }).expect("compiles");
        let mut failures = Vec::new();
        check(&mut compiled, &Case { inputs, dims, want }, &format!("jumping scores S={s}"), &mut failures);
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}

/// Separable score terms (ALiBi's `x0[h] · (j - i)`, a key bias, a row-only term) take the
/// key-vector path only where the row part is finite: infinite and NaN slopes must give what
/// the interpreter gives (NaN where it has NaN), through the whole-expression fallback.
#[test]
fn separable_score_terms_with_non_finite_parts_match_the_interpreter() {
    let parse = |t: &str| attn_compiler::ir::parse_expr(t, 4).expect("parses");
    let slopes = [0.5f32, f32::INFINITY, f32::NAN, f32::NEG_INFINITY, -0.25];
    let mut failures = Vec::new();
    for (score, mask) in [
        ("s + x0[h] * (j - i)", Some("j <= i")),
        ("s * 0.5 + x0[h] * j - x0[h] * i", None),
        ("s + x0[h] * i", Some("j <= i")),
        ("s - x0[h] * (i + j) + x1[b, j]", None),
    ] {
        let spec = FlashSpec {
            rank: 4,
            weights: Weights::Softmax,
            score: parse(score),
            mask: mask.map(parse),
            pair: attn_compiler::ir::Pair::Dot,
            dropout: None,
        };
        let g = flash_graph(spec, (true, true));
        let mut rng = StdRng::seed_from_u64(5);
        let (b, h, m, n, d) = (1, slopes.len(), 70, 90, 16);
        let seg: Vec<i32> = (0..b * n).map(|i| (i % 7) as i32).collect();
        let inputs = vec![
            random_tensor(&mut rng, vec![b, h, m, d]),
            random_tensor(&mut rng, vec![b, h, n, d]),
            random_tensor(&mut rng, vec![b, h, n, d]),
            Tensor::f32(vec![h], slopes.to_vec()).expect("slopes"),
            Tensor::i32(vec![b, n], seg).expect("seg"),
        ];
        let dims = HashMap::new();
        let want = interp::run(&g, &inputs, &dims).expect("interpreter");
        let mut c = CpuProgram::compile_graph(&g, &CpuOptions { threads: 1 }).expect("compiles");
        check(&mut c, &Case { inputs, dims, want }, score, &mut failures);
    }
    assert!(failures.is_empty(), "{} failure(s):\n  {}", failures.len(), failures.join("\n  "));
}

/// Dim sizes by name.
fn dim_map(sizes: &[(&str, i64)]) -> HashMap<String, i64> {
    sizes.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// The bit-for-bit cases (`tests/cases/bit_exact/*.attn`): each file's `# entry:` function at
/// each of its `# sizes:` (seeds 1, 2, … in order), [`same_bits_as_interpreter`]. Scans,
/// transposing copies, reductions (stored and fused operands), sorts and scatter-adds, whose
/// CPU kernels compute exactly what the interpreter does.
#[test]
fn bit_exact_cases_match_the_interpreter_bit_for_bit() {
    let files = attn_tests::attn_files(&attn_tests::repo_root().join("tests/cases/bit_exact"));
    assert!(files.len() >= 6, "{} bit-exact cases", files.len());
    for path in files {
        let src = std::fs::read_to_string(&path).expect("readable");
        let header =
            |key: &str| src.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_else(|| panic!("{}: no `{key}` line", path.display()));
        let sizes: Vec<Vec<(&str, i64)>> = header("# sizes: ")
            .split(';')
            .map(|case| {
                case.split_whitespace()
                    .map(|kv| {
                        kv.split_once('=')
                            .and_then(|(k, v)| Some((k, v.parse().ok()?)))
                            .unwrap_or_else(|| panic!("{}: bad size {kv}", path.display()))
                    })
                    .collect()
            })
            .collect();
        let cases: Vec<(u64, &[(&str, i64)])> = sizes.iter().zip(1..).map(|(s, seed)| (seed, s.as_slice())).collect();
        same_bits_as_interpreter(&src, header("# entry: ").trim(), &cases);
    }
}

#[test]
fn fused_reductions_compute_their_operands_inside() {
    // Reductions of element-wise expressions compute each element as they read it (no stored
    // operand); `bit_exact_cases_match_the_interpreter_bit_for_bit` checks their values.
    let program = Program::from_source(include_str!("../../tests/cases/bit_exact/fused_reductions.attn"), "test.attn").expect("compiles");
    let graph = program.graph("fr").expect("graph");
    let schedule = attn_compiler::schedule::schedule(graph, &Default::default()).expect("schedules").to_string();
    assert!(!schedule.contains("elementwise"), "every operand is computed inside its reduction:\n{schedule}");
}

/// Compiles `entry` of `src` for the CPU and checks it against the interpreter bit for bit on
/// seeded random inputs at each `(seed, dims)`, with 1 and 2 threads.
fn same_bits_as_interpreter(src: &str, entry: &str, cases: &[(u64, &[(&str, i64)])]) {
    let program = Program::from_source(src, "test.attn").expect("compiles");
    let mut compiled = program.compile_cpu(entry, &CpuOptions { threads: 1 }).expect("cpu");
    for (seed, sizes) in cases {
        let given: HashMap<String, i64> = sizes.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        let dims = program.random_dims(entry, &given).expect("dims");
        let inputs: Vec<Tensor> = program.random_inputs(entry, *seed, &dims).expect("inputs").into_iter().map(|(_, t)| t).collect();
        let want = interp::run(program.graph(entry).expect("graph"), &inputs, &dims).expect("interpreter");
        for threads in [1, 2] {
            compiled.set_threads(threads).expect("threads");
            let got = compiled.run_tensors(&inputs, &dims).expect("cpu runs");
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    same_bits(std::slice::from_ref(g), std::slice::from_ref(w)),
                    "{entry} {sizes:?}, {threads} thread(s): output {k} differs from the interpreter"
                );
            }
        }
    }
}

#[test]
fn leading_index_gathers_and_take_along_pick_the_right_elements() {
    let src = "fn g(emb: f32[V, E], tokens: i32[S], x: f32[S, K], idx: i32[S, J]) -> (e: f32[S, E], t: f32[S, J]) {
    return emb[tokens], take_along(x, idx, axis = 1)
}";
    let program = Program::from_source(src, "g.attn").expect("compiles");
    let f = |shape: Vec<usize>, v: Vec<f32>| Tensor::f32(shape, v).expect("tensor");
    let inputs = [
        ("emb", f(vec![3, 2], vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0])),
        ("tokens", Tensor::i32(vec![4], vec![2, 0, 1, 2]).expect("tensor")),
        ("x", f(vec![4, 3], (0..12).map(|v| v as f32).collect())),
        ("idx", Tensor::i32(vec![4, 2], vec![2, 0, 1, 1, 0, 2, 2, 2]).expect("tensor")),
    ];
    for target in [attn_runtime::Target::Interp, attn_runtime::Target::Cpu] {
        let opts = attn_runtime::RunOptions { target, ..Default::default() };
        let out = program.run("g", inputs.clone(), &opts).expect("runs");
        assert_eq!(out[0].1.shape, vec![4, 2]);
        assert_eq!(out[0].1.to_f64_vec(), vec![20.0, 21.0, 0.0, 1.0, 10.0, 11.0, 20.0, 21.0], "{target}");
        assert_eq!(out[1].1.to_f64_vec(), vec![2.0, 0.0, 4.0, 4.0, 6.0, 8.0, 11.0, 11.0], "{target}");
    }
}

/// `arange`, `stack`, strided slices and `broadcast_to` give NumPy's values, on the interpreter
/// and the CPU target.
#[test]
fn constructors_and_strided_slices_give_numpys_values() {
    let src = "fn c(x: f32[S, 2*Dh], y: f32[S, 2*Dh], r: f32[Dh]) -> (a: i32[S], st: f32[S, 2, 2*Dh], ev: f32[S, Dh], od: f32[S, Dh], b: f32[S, Dh], m: f32[S, Dh]) {
    return arange(S), stack([x, y], axis = 1), x[:, 0::2], x[:, 1::2], broadcast_to(r, [S, Dh]), x[:, 1:2*Dh:2] - y[:, ::2]
}";
    let program = Program::from_source(src, "c.attn").expect("compiles");
    let f = |shape: Vec<usize>, v: Vec<f32>| Tensor::f32(shape, v).expect("tensor");
    let inputs = [
        ("x", f(vec![2, 4], (0..8).map(|v| v as f32).collect())),
        ("y", f(vec![2, 4], (0..8).map(|v| 10.0 * v as f32).collect())),
        ("r", f(vec![2], vec![-1.0, -0.0])),
    ];
    for target in [attn_runtime::Target::Interp, attn_runtime::Target::Cpu] {
        let opts = attn_runtime::RunOptions { target, ..Default::default() };
        let out = program.run("c", inputs.clone(), &opts).expect("runs");
        let values = |k: usize| out[k].1.to_f64_vec();
        assert_eq!(values(0), vec![0.0, 1.0], "{target}");
        assert_eq!(out[1].1.shape, vec![2, 2, 4], "{target}");
        assert_eq!(values(1), vec![0., 1., 2., 3., 0., 10., 20., 30., 4., 5., 6., 7., 40., 50., 60., 70.], "{target}");
        assert_eq!(values(2), vec![0.0, 2.0, 4.0, 6.0], "{target}");
        assert_eq!(values(3), vec![1.0, 3.0, 5.0, 7.0], "{target}");
        assert_eq!(values(4), vec![-1.0, 0.0, -1.0, 0.0], "{target}");
        assert!(values(4)[1].is_sign_negative(), "{target}: -0 stays -0");
        assert_eq!(values(5), vec![1.0, -17.0, -35.0, -53.0], "{target}");
    }
}

/// An index error's axis, index and the axis' size.
type Fault = Option<(usize, i64, usize)>;

/// The (axis, index, size) of an index error, or `None` for another outcome.
fn index_fault(r: &Result<Vec<Tensor>, attn_compiler::exec::ExecError>) -> Fault {
    match r {
        Err(attn_compiler::exec::ExecError::IndexOutOfRange { axis, index, size, span: Some(_), .. }) => Some((*axis, *index, *size)),
        _ => None,
    }
}

#[test]
fn indices_out_of_range_are_errors_like_the_interpreters() {
    // A gather, take_along, scatter_add, and a score lookup the optimizer cannot prove in range
    // (`i - j` is negative above the diagonal), which must fail even though the flash kernel
    // skips the masked tiles.
    let src = "
fn g(t: f32[N, E], i: i32[M], x: f32[M, E], j: i32[M, 1]) -> f32[M, E] {
    return t[i] + take_along(x, j, axis = 1)
}
fn s(b: f32[N, E], i: i32[M, E], v: f32[M, E]) -> f32[N, E] {
    return scatter_add(b, i, v, axis = 0)
}
fn a(q: f32[H, S, D], k: f32[H, S, D], v: f32[H, S, D], rel: f32[H, S]) -> f32[H, S, D] {
    let sc = q @ k.T
    let (h, i, j) = indices(sc)
    return softmax(where(j <= i, sc + rel[h, i - j], -inf), axis = -1) @ v
}";
    let program = Program::from_source(src, "ix.attn").expect("compiles");
    // The attention still fuses, but its lookup is not folded into the flash loads: it is
    // materialised by a checked gather over every (h, i, j), masked or not.
    let optimized = attn_compiler::opt::optimize_module(program.module()).0;
    let a = optimized.graphs.iter().find(|g| g.name == "a").expect("graph");
    assert!(a.values().any(|v| matches!(a.node(v).op, Op::Gather)), "the unproven lookup stays a gather:\n{a}");
    let f = |shape: Vec<usize>, v: Vec<f32>| Tensor::f32(shape, v).expect("tensor");
    let int = |shape: Vec<usize>, v: Vec<i32>| Tensor::i32(shape, v).expect("tensor");
    let table = f(vec![3, 2], (0..6).map(|v| v as f32).collect());
    let x = f(vec![4, 2], (0..8).map(|v| v as f32).collect());
    let cases: Vec<(&str, Vec<Tensor>, Fault)> = vec![
        ("g", vec![table.clone(), int(vec![4], vec![0, 2, 1, 2]), x.clone(), int(vec![4, 1], vec![0, 1, 1, 0])], None),
        ("g", vec![table.clone(), int(vec![4], vec![0, 3, 1, 2]), x.clone(), int(vec![4, 1], vec![0, 1, 1, 0])], Some((0, 3, 3))),
        ("g", vec![table.clone(), int(vec![4], vec![0, 2, 1, 2]), x.clone(), int(vec![4, 1], vec![0, 1, -1, 0])], Some((1, -1, 2))),
        ("s", vec![table.clone(), int(vec![4, 2], vec![0, 2, 1, 2, 0, 0, 1, 1]), x.clone()], None),
        ("s", vec![table.clone(), int(vec![4, 2], vec![0, 2, 1, 5, 0, 0, 1, 1]), x.clone()], Some((0, 5, 3))),
    ];
    for (entry, inputs, fault) in cases {
        let dims = HashMap::new();
        let want = interp::run(program.graph(entry).expect("graph"), &inputs, &dims);
        assert_eq!(index_fault(&want), fault, "{entry}: interpreter");
        for threads in [1, 2] {
            let cpu = program.compile_cpu(entry, &CpuOptions { threads }).expect("cpu");
            let got = cpu.run_tensors(&inputs, &dims).map_err(|e| match e {
                CpuError::Input(e) => e,
                e => panic!("{entry}: {e}"),
            });
            assert_eq!(index_fault(&got), fault, "{entry}, {threads} thread(s): cpu");
            if let (Ok(got), Ok(want)) = (&got, &want) {
                assert!(same_bits(got, want), "{entry}: cpu differs");
            }
        }
    }
    // The attention's lookup: position (i, j) reads rel[h, i - j], negative above the diagonal.
    let g = program.graph("a").expect("graph");
    let dims: HashMap<String, i64> = [("H", 2), ("S", 5), ("D", 4)].into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    let inputs: Vec<Tensor> = program.random_inputs("a", 3, &dims).expect("inputs").into_iter().map(|(_, t)| t).collect();
    assert_eq!(index_fault(&interp::run(g, &inputs, &dims)), Some((1, -1, 5)));
    let cpu = program.compile_cpu("a", &CpuOptions { threads: 1 }).expect("cpu");
    let got = cpu.run_tensors(&inputs, &dims).map_err(|e| match e {
        CpuError::Input(e) => e,
        e => panic!("a: {e}"),
    });
    assert_eq!(index_fault(&got), Some((1, -1, 5)));
}

/// A dense bool mask (transformers' `[B, 1, L, S]`) classifies tiles from its values: the
/// interpreter's results as the mask changes between runs of one compiled program, whose plan
/// is keyed by the mask's block bounds. Causal with left padding that differs per batch index,
/// packed documents, the same block bounds with other values inside the partial blocks, rows
/// with every key masked, no key masked at all, and a pattern that leaves every block mixed.
#[test]
fn a_dense_bool_mask_matches_the_interpreter_as_it_changes() {
    let src = include_str!("../../tests/cases/flash/dense_bool_mask.attn");
    let program = Program::from_source(src, "mask.attn").expect("compiles");
    for entry in ["masked", "masked_gqa"] {
        let compiled = program.compile_cpu(entry, &CpuOptions { threads: 2 }).expect("cpu");
        let (b, l, s) = (2usize, 300usize, 300usize);
        let heads: &[(&str, i64)] = if entry == "masked" { &[("H", 2)] } else { &[("Hk", 1), ("G", 2)] };
        let dims = dim_map(&[&[("B", b as i64), ("L", l as i64), ("S", s as i64), ("D", 16)], heads].concat());
        let mut inputs: Vec<Tensor> = program.random_inputs(entry, 5, &dims).expect("inputs").into_iter().map(|(_, t)| t).collect();
        let graph = program.graph(entry).expect("graph");
        let grad = program.grad(entry, None).expect("derives");
        let mask = |keep: &dyn Fn(usize, usize, usize) -> bool| {
            let v: Vec<bool> = (0..b * l * s).map(|x| keep(x / (l * s), x / s % l, x % s)).collect();
            Tensor::new(DType::Bool, vec![b, 1, l, s], TensorData::Bool(v)).expect("mask")
        };
        let mut rng = StdRng::seed_from_u64(3);
        let noise: Vec<bool> = (0..b * l * s).map(|_| rng.random::<bool>()).collect();
        let pad = [150usize, 0];
        let doc = |x: usize| usize::from(x >= 70) + usize::from(x >= 230);
        let masks = [
            // Causal, batch index 0 left-padded by 150 tokens (its padded rows see no key): tiles its
            // table skips, batch index 1 runs.
            mask(&|bi, i, j| j <= i && j >= pad[bi] && i >= pad[bi]),
            // Packed documents of 70, 160 and 70 tokens, causal inside each.
            mask(&|_, i, j| doc(i) == doc(j) && j <= i),
            // Causal again, but inside the blocks on the diagonal other values (same block bounds).
            mask(&|bi, i, j| if i / 16 == j / 16 { j <= i && noise[(bi * l + i) * s + j] || j == i } else { j < i }),
            // Every key kept.
            mask(&|_, _, _| true),
            // Every block mixed (a dilated pattern): every tile partial.
            mask(&|_, i, j| (i + 2 * j) % 3 != 0),
            mask(&|bi, i, j| j <= i && j >= pad[bi] && i >= pad[bi]),
        ];
        for (n, m) in masks.into_iter().enumerate() {
            inputs[3] = m;
            let got = compiled.run_tensors(&inputs, &HashMap::new()).expect("runs");
            let env = attn_compiler::exec::bind_dims(graph, &inputs.iter().map(|t| t.shape.clone()).collect::<Vec<_>>(), &HashMap::new())
                .expect("dims");
            let reference = interp::run(graph, &inputs, &env).expect("interpreter");
            let err = compare(&got, &reference).unwrap_or_else(|e| panic!("{entry}, mask {n}: {e}"));
            assert!(err < 1e-4, "{entry}, mask {n}: differs from the interpreter by {err:e}");
            // The fused backward reads the same tables (one per batch index here).
            let mut named: Vec<(String, Tensor)> = grad.random_inputs(&format!("{entry}_grad"), 9, &dims).expect("inputs");
            for (name, t) in named.iter_mut() {
                if let Some(at) = ["q", "k", "v", "mask"].iter().position(|x| x == name) {
                    *t = inputs[at].clone();
                }
            }
            let run = |target| {
                let opts = attn_runtime::RunOptions { target, ..Default::default() };
                let out = grad.run(&format!("{entry}_grad"), named.clone(), &opts).expect("the gradient runs");
                out.into_iter().map(|(_, t)| t).collect::<Vec<_>>()
            };
            let (want, got) = (run(attn_runtime::Target::Interp), run(attn_runtime::Target::Cpu));
            let err = compare(&got, &want).unwrap_or_else(|e| panic!("{entry}, mask {n}, gradients: {e}"));
            assert!(err < 1e-4, "{entry}, mask {n}: gradients differ from the interpreter's by {err:e}");
        }
    }
}

/// A window size given as an input runs fused with tile skipping decided by its value: the same
/// bits as the program with that window written as a constant, and as the interpreter, for
/// windows that keep one key, some, and every key.
#[test]
fn a_window_given_as_an_input_matches_the_constant_window() {
    let with_input = include_str!("../../tests/cases/flash/window_as_an_input.attn");
    let program = Program::from_source(with_input, "win.attn").expect("compiles");
    let compiled = program.compile_cpu("win", &CpuOptions { threads: 2 }).expect("cpu");
    let dims: HashMap<String, i64> = dim_map(&[("B", 1), ("H", 2), ("S", 300), ("D", 16)]);
    let mut inputs: Vec<Tensor> = program.random_inputs("win", 3, &dims).expect("inputs").into_iter().map(|(_, t)| t).collect();
    for w in [0, 7, 130, 5000] {
        inputs[3] = Tensor::i32(vec![], vec![w]).expect("scalar");
        let got = compiled.run_tensors(&inputs, &HashMap::new()).expect("runs");
        let constant =
            Program::from_source(&with_input.replace(", w: i32)", ")").replace("<= w,", &format!("<= {w},")), "c.attn").expect("compiles");
        let want =
            constant.compile_cpu("win", &CpuOptions { threads: 2 }).expect("cpu").run_tensors(&inputs[..3], &HashMap::new()).expect("runs");
        assert!(same_bits(&got, &want), "w = {w}: the input window differs from the constant one");
        let env = attn_compiler::exec::bind_dims(
            program.graph("win").expect("graph"),
            &inputs.iter().map(|t| t.shape.clone()).collect::<Vec<_>>(),
            &HashMap::new(),
        )
        .expect("dims");
        let reference = interp::run(program.graph("win").expect("graph"), &inputs, &env).expect("interpreter");
        let err = compare(&got, &reference).unwrap_or_else(|e| panic!("w = {w}: {e}"));
        assert!(err < 1e-4, "w = {w}: differs from the interpreter by {err:e}");
    }
}
