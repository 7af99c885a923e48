//! The reference interpreter against values derived by hand, independently of the code under
//! test.

use attn_runtime::{Program, RunOptions, Target, Tensor};
use attn_tests::{max_rel_error, repo_root};
use std::collections::HashMap;

fn run(source: &str, inputs: Vec<(&str, Tensor)>) -> Vec<(String, Tensor)> {
    let program = Program::from_source(source, "test.attn").unwrap_or_else(|e| panic!("{}", e.render(false)));
    let entry = program.default_entry().expect("an entry").name;
    let opts = RunOptions { dims: HashMap::new(), target: Target::Interp };
    program.run(&entry, inputs, &opts).expect("runs")
}

fn example(name: &str) -> String {
    std::fs::read_to_string(repo_root().join("examples").join(name)).expect("example exists")
}

fn f32t(shape: &[usize], data: &[f32]) -> Tensor {
    Tensor::f32(shape.to_vec(), data.to_vec()).expect("valid tensor")
}

fn assert_close(actual: &Tensor, expected: &[f64], tol: f64) {
    let err = max_rel_error(&actual.to_f64_vec(), expected, 1e-6);
    assert!(err <= tol, "relative error {err:e} > {tol:e}\nactual:   {:?}\nexpected: {expected:?}", actual.to_f64_vec());
}

/// "je t' aime" aligned to "I love you": one-hot keys scaled so each target word scores 2 on
/// its source word and 0 elsewhere. Weights row = softmax([2, 0, 0]) permuted:
/// a = e²/(e²+2), b = 1/(e²+2). je→I, t'→you, aime→love.
#[test]
fn alignment_matrix_i_love_you() {
    let source = "fn align(q: f32[M, D], k: f32[N, D], v: f32[N, E]) -> (context: f32[M, E], weights: f32[M, N]) {
        let w = softmax(q @ k.T, axis = -1)
        return w @ v, w
    }";
    let e2 = 2f64.exp();
    let (a, b) = (e2 / (e2 + 2.0), 1.0 / (e2 + 2.0));
    // Source words I, love, you are one-hot keys; targets je, t', aime point at I, you, love.
    let k = f32t(&[3, 3], &[1., 0., 0., 0., 1., 0., 0., 0., 1.]);
    let q = f32t(&[3, 3], &[2., 0., 0., 0., 0., 2., 0., 2., 0.]);
    let v = f32t(&[3, 2], &[1., 0., 0., 1., 1., 1.]);
    let out = run(source, vec![("q", q), ("k", k), ("v", v)]);
    let weights = [a, b, b, b, b, a, b, a, b];
    assert_close(&out[1].1, &weights, 1e-6);
    // context = weights @ v, by hand: row je = a·v0 + b·v1 + b·v2, row t' = b·v0 + b·v1 + a·v2,
    // row aime = b·v0 + a·v1 + b·v2.
    let context = [a + b, 2. * b, a + b, a + b, 2. * b, a + b];
    assert_close(&out[0].1, &context, 1e-6);
    // Rows of an attention matrix sum to 1.
    for row in out[1].1.to_f64_vec().chunks(3) {
        assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-6);
    }
}

/// Equal scores give every key the same weight, so the output is the mean of V.
#[test]
fn uniform_scores_give_the_mean_of_v() {
    let (b, h, s, d) = (1, 2, 5, 3);
    let n = b * h * s * d;
    let q = f32t(&[b, h, s, d], &vec![0.0; n]);
    let k = f32t(&[b, h, s, d], &(0..n).map(|x| (x as f32 * 0.37).sin()).collect::<Vec<_>>());
    let vdata: Vec<f32> = (0..n).map(|x| (x as f32 * 0.71).cos()).collect();
    let v = f32t(&[b, h, s, d], &vdata);
    let out = run(&example("sdpa.attn"), vec![("q", q), ("k", k), ("v", v)]);
    let mut expected = Vec::new();
    for head in 0..h {
        let rows = &vdata[head * s * d..(head + 1) * s * d];
        let mean: Vec<f64> = (0..d).map(|c| (0..s).map(|r| f64::from(rows[r * d + c])).sum::<f64>() / s as f64).collect();
        for _ in 0..s {
            expected.extend(&mean);
        }
    }
    assert_close(&out[0].1, &expected, 1e-6);
}

/// The first query of causal attention sees only the first key, so it returns V[0].
#[test]
fn causal_row_zero_returns_v0() {
    let (s, d) = (6, 4);
    let n = s * d;
    let wave = |k: f32| (0..n).map(|x| (x as f32 * k).sin()).collect::<Vec<_>>();
    let vdata = wave(0.9);
    let out = run(
        &example("causal.attn"),
        vec![("q", f32t(&[1, 1, s, d], &wave(0.3))), ("k", f32t(&[1, 1, s, d], &wave(0.5))), ("v", f32t(&[1, 1, s, d], &vdata))],
    );
    let got = out[0].1.to_f64_vec();
    let expected: Vec<f64> = vdata[..d].iter().map(|x| f64::from(*x)).collect();
    assert!(max_rel_error(&got[..d], &expected, 1e-6) < 1e-6, "row 0: {:?} vs {expected:?}", &got[..d]);
}

/// A row whose keys are all masked gives 0, never NaN (the IR's definition).
#[test]
fn fully_masked_rows_are_zero() {
    let source = "fn f(q: f32[S, D], k: f32[S, D], v: f32[S, D]) -> f32[S, D] {
        let s = q @ k.T
        let (i, j) = indices(s)
        return softmax(where(j < i, s, -inf)) @ v
    }";
    let data: Vec<f32> = (0..6).map(|x| x as f32 + 1.0).collect();
    let out = run(source, vec![("q", f32t(&[3, 2], &data)), ("k", f32t(&[3, 2], &data)), ("v", f32t(&[3, 2], &data))]);
    let got = out[0].1.to_f64_vec();
    assert_eq!(&got[..2], &[0.0, 0.0], "row 0 has no visible key");
    // Row 1 sees only key 0: returns v[0].
    assert_eq!(&got[2..4], &[1.0, 2.0]);
}

/// Decode: one query against a cache, checked against softmax computed here in f64.
#[test]
fn decode_matches_a_hand_softmax() {
    let (t, d) = (5, 2);
    let q = [0.5f32, -1.0];
    let k: Vec<f32> = (0..t * d).map(|x| (x as f32 * 0.4).cos()).collect();
    let v: Vec<f32> = (0..t * d).map(|x| x as f32 * 0.1).collect();
    let out =
        run(&example("decode.attn"), vec![("q", f32t(&[1, 1, 1, d], &q)), ("k", f32t(&[1, 1, t, d], &k)), ("v", f32t(&[1, 1, t, d], &v))]);
    let scores: Vec<f64> =
        (0..t).map(|j| (0..d).map(|c| f64::from(q[c]) * f64::from(k[j * d + c])).sum::<f64>() / (d as f64).sqrt()).collect();
    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
    let expected: Vec<f64> = (0..d).map(|c| (0..t).map(|j| (scores[j] - m).exp() / z * f64::from(v[j * d + c])).sum()).collect();
    assert_close(&out[0].1, &expected, 1e-5);
}

/// LayerNorm output has mean 0 and variance 1 per row (gamma 1, beta 0).
#[test]
fn layernorm_normalises_rows() {
    let source = "fn f(x: f32[N, E], g: f32[E], b: f32[E]) -> f32[N, E] { return layernorm(x, g, b, eps = 0.0) }";
    let x: Vec<f32> = (0..12).map(|i| (i * i) as f32 * 0.5 - 3.0).collect();
    let out = run(source, vec![("x", f32t(&[3, 4], &x)), ("g", f32t(&[4], &[1.0; 4])), ("b", f32t(&[4], &[0.0; 4]))]);
    for row in out[0].1.to_f64_vec().chunks(4) {
        let mean = row.iter().sum::<f64>() / 4.0;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 4.0;
        assert!(mean.abs() < 1e-6 && (var - 1.0).abs() < 1e-5, "mean {mean}, var {var}");
    }
}

/// ALiBi: with q = 0 the scores are just the bias slope·(j−i) on visible keys, so the weights
/// are a softmax of an arithmetic sequence, checked by hand.
#[test]
fn alibi_bias_is_added_to_scores() {
    let (s, d) = (3, 2);
    let slope = 0.5f32;
    let v: Vec<f32> = vec![1.0, 0.0, 0.0, 1.0, 2.0, 2.0];
    let out = run(
        &example("alibi.attn"),
        vec![
            ("q", f32t(&[1, 1, s, d], &[0.0; 6])),
            ("k", f32t(&[1, 1, s, d], &[1.0; 6])),
            ("v", f32t(&[1, 1, s, d], &v)),
            ("slopes", f32t(&[1], &[slope])),
        ],
    );
    // Row 2 sees keys 0, 1, 2 with biases -1, -0.5, 0.
    let w: Vec<f64> = [-1.0f64, -0.5, 0.0].iter().map(|b| b.exp()).collect();
    let z: f64 = w.iter().sum();
    let expected_row2: Vec<f64> = (0..d).map(|c| (0..s).map(|j| w[j] / z * f64::from(v[j * d + c])).sum()).collect();
    let got = out[0].1.to_f64_vec();
    assert!(max_rel_error(&got[4..6], &expected_row2, 1e-6) < 1e-6, "{:?} vs {expected_row2:?}", &got[4..6]);
}

/// Scalars are weakly typed: an f16 program stays f16 through `/ sqrt(D)` and `* 0.5`, and its
/// result equals the f32 program's result rounded through f16 storage at each node.
#[test]
fn f16_programs_stay_f16_and_round_through_storage() {
    let source = "fn f(q: f16[S, D], k: f16[S, D], v: f16[S, D]) -> f16[S, D] {
        let s = q @ k.T / sqrt(D) * 0.5
        return softmax(s) @ v
    }";
    let compiled = attn_compiler::check(source).expect("compiles");
    let ir = compiled.module.to_string();
    assert!(!ir.contains("f32[S"), "scalars must not widen f16 tensors:\n{ir}");
    let data: Vec<f32> = (0..12).map(|x| (x as f32 * 0.37).sin()).collect();
    let t = |d: &[f32]| Tensor::new(attn_runtime::DType::F16, vec![4, 3], attn_runtime::TensorData::F32(d.to_vec())).expect("f16 tensor");
    let out = run(source, vec![("q", t(&data)), ("k", t(&data)), ("v", t(&data))]);
    assert_eq!(out[0].1.dtype, attn_runtime::DType::F16);
    // Every stored value is an f16 value.
    for x in out[0].1.to_f64_vec() {
        assert_eq!(half::f16::from_f64(x).to_f64(), x);
    }
}

/// `!=` on masks is their exclusive or, and `x[:, S-1]` selects the last column.
#[test]
fn mask_xor_and_dim_expression_index() {
    let source = "fn f(x: f32[S, S]) -> (xor: f32[S, S], last: f32[S]) {
        let (i, j) = indices(x)
        let m = (j <= i) != (j >= i)
        return where(m, 1.0, 0.0), x[:, S-1]
    }";
    let x: Vec<f32> = (0..9).map(|v| v as f32).collect();
    let out = run(source, vec![("x", f32t(&[3, 3], &x))]);
    // j <= i xor j >= i: true off the diagonal.
    assert_eq!(out[0].1.to_f64_vec(), vec![0., 1., 1., 1., 0., 1., 1., 1., 0.]);
    assert_eq!(out[1].1.to_f64_vec(), vec![2., 5., 8.]);
}
