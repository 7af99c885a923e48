//! Op semantics.

use super::*;
use crate::ir::{BinaryOp, ReduceOp, UnaryOp};

#[test]
fn matmul_broadcasts_batch() {
    let g = one_op(&[("a", f32ty(&["2", "2", "3"])), ("b", f32ty(&["3", "2"]))], Op::MatMul);
    let a_data = [1., 2., 3., 4., 5., 6., 1., 0., 0., 0., 1., 0.];
    let out = run1(&g, &[tf(&[2, 2, 3], &a_data), tf(&[3, 2], &[1., 2., 3., 4., 5., 6.])]);
    assert_eq!(out.shape, vec![2, 2, 2]);
    assert_eq!(out.to_f64_vec(), vec![22., 28., 49., 64., 1., 2., 3., 4.]);
}

#[test]
fn matmul_broadcasts_both_batches() {
    // [2, 1, 2, 2] @ [3, 2, 2] -> [2, 3, 2, 2]: out[i, j] = a[i, 0] @ b[j].
    let g = one_op(&[("a", f32ty(&["2", "1", "2", "2"])), ("b", f32ty(&["3", "2", "2"]))], Op::MatMul);
    let a_data: Vec<f32> = (1..=8).map(|x| x as f32).collect();
    let b_data: Vec<f32> = (0..12).map(|x| (x % 5) as f32 - 1.0).collect();
    let out = run1(&g, &[tf(&[2, 1, 2, 2], &a_data), tf(&[3, 2, 2], &b_data)]);
    assert_eq!(out.shape, vec![2, 3, 2, 2]);
    let mut expected = Vec::new();
    for i in 0..2 {
        for j in 0..3 {
            for r in 0..2 {
                for c in 0..2 {
                    let dot: f32 = (0..2).map(|p| a_data[i * 4 + r * 2 + p] * b_data[j * 4 + p * 2 + c]).sum();
                    expected.push(f64::from(dot));
                }
            }
        }
    }
    assert_eq!(out.to_f64_vec(), expected);
    // Spot check by hand: a[1, 0] = [[5, 6], [7, 8]], b[2] = [[2, 3], [-1, 0]] -> [[4, 15], [6, 21]].
    assert_eq!(&out.to_f64_vec()[20..24], &[4., 15., 6., 21.]);
}

#[test]
fn softmax_rows_sum_to_one_and_masked_rows_are_zero() {
    let g = one_op(&[("x", f32ty(&["2", "3"]))], Op::Softmax { axis: 1 });
    let ninf = f32::NEG_INFINITY;
    let out = run1(&g, &[tf(&[2, 3], &[1., 2., 3., ninf, ninf, ninf])]).to_f64_vec();
    assert_close(&out[..3], &[0.09003057317038046, 0.24472847105479764, 0.6652409557748219], 1e-6);
    assert!((out[..3].iter().sum::<f64>() - 1.0).abs() < 1e-6);
    assert_eq!(&out[3..], &[0., 0., 0.]);
}

#[test]
fn softmax_along_a_leading_axis() {
    let g = one_op(&[("x", f32ty(&["2", "2"]))], Op::Softmax { axis: 0 });
    let out = run1(&g, &[tf(&[2, 2], &[0., 0., 3f32.ln(), f32::NEG_INFINITY])]).to_f64_vec();
    assert_close(&out, &[0.25, 1.0, 0.75, 0.0], 1e-6);
}

/// `softmax(q @ k^T * 0.5 [masked causally]) @ v` with q, k, v: f32[S, D].
fn attention(causal: bool) -> Graph {
    let mut g = Graph::new("attn");
    let q = param(&mut g, "q", f32ty(&["S", "D"]));
    let k = param(&mut g, "k", f32ty(&["S", "D"]));
    let v = param(&mut g, "v", f32ty(&["S", "D"]));
    let kt = node(&mut g, Op::Transpose { perm: vec![1, 0] }, &[k]);
    let scores = node(&mut g, Op::MatMul, &[q, kt]);
    let half = scalar(&mut g, 0.5, DType::F32);
    let mut scores = node(&mut g, Op::Binary(BinaryOp::Mul), &[scores, half]);
    if causal {
        let row = node_as(&mut g, Op::Iota { axis: 0 }, &[], ty(DType::I32, &["S", "S"]));
        let col = node_as(&mut g, Op::Iota { axis: 1 }, &[], ty(DType::I32, &["S", "S"]));
        let keep = node(&mut g, Op::Binary(BinaryOp::Le), &[col, row]);
        let ninf = scalar(&mut g, f64::NEG_INFINITY, DType::F32);
        scores = node(&mut g, Op::Select, &[keep, scores, ninf]);
    }
    let p = node(&mut g, Op::Softmax { axis: 1 }, &[scores]);
    let o = node(&mut g, Op::MatMul, &[p, v]);
    g.add_output("out", o);
    g
}

const Q: [f32; 6] = [0.1, -0.3, 0.7, 0.2, -0.5, 0.4];
const K: [f32; 6] = [0.3, 0.8, -0.2, 0.5, 0.9, -0.6];
const V: [f32; 6] = [1., 2., 3., 4., 5., 6.];

#[test]
fn causal_attention_row_zero_is_first_value() {
    let out = run1(&attention(true), &[tf(&[3, 2], &Q), tf(&[3, 2], &K), tf(&[3, 2], &V)]);
    assert_eq!(out.shape, vec![3, 2]);
    assert_close(&out.to_f64_vec()[..2], &[1., 2.], 1e-6);
    // Later rows mix several values, so they differ from V's rows.
    assert!((out.to_f64_vec()[2] - 3.0).abs() > 1e-3);
}

#[test]
fn uniform_scores_average_the_values() {
    let q = tf(&[3, 2], &[0.; 6]);
    let out = run1(&attention(false), &[q.clone(), tf(&[3, 2], &K), tf(&[3, 2], &V)]);
    assert_close(&out.to_f64_vec(), &[3., 4., 3., 4., 3., 4.], 1e-6);
    // Causally, row i averages the first i + 1 values.
    let out = run1(&attention(true), &[q, tf(&[3, 2], &K), tf(&[3, 2], &V)]);
    assert_close(&out.to_f64_vec(), &[1., 2., 2., 3., 3., 4.], 1e-6);
}

#[test]
fn gather_rejects_indices_out_of_range() {
    let mut g = Graph::new("gather");
    let table = param(&mut g, "t", f32ty(&["3", "2"]));
    let i0 = param(&mut g, "i0", ty(DType::I32, &["4"]));
    let i1 = param(&mut g, "i1", ty(DType::I32, &["1"]));
    let out = node(&mut g, Op::Gather, &[table, i0, i1]);
    g.add_output("out", out);
    let table = tf(&[3, 2], &[0., 1., 2., 3., 4., 5.]);
    let res = run1(&g, &[table.clone(), ti(&[4], &[2, 1, 0, 2]), ti(&[1], &[1])]);
    assert_eq!(res.shape, vec![4]);
    assert_eq!(res.to_f64_vec(), vec![5., 3., 1., 5.]);
    // Never clamped: each axis' first bad index, with the axis and its size.
    for (rows, col, axis, index, size) in [(vec![0, 1, -5, 2], 1, 0, -5, 3), (vec![0, 1, 2, 3], 1, 0, 3, 3), (vec![0, 1, 2, 0], 9, 1, 9, 2)]
    {
        let err = run(&g, &[table.clone(), ti(&[4], &rows), ti(&[1], &[col])], &HashMap::new()).unwrap_err();
        match err {
            ExecError::IndexOutOfRange { axis: a, index: i, size: n, .. } => assert_eq!((a, i, n), (axis, index, size)),
            e => panic!("expected an index error, got {e}"),
        }
    }
    // An empty table has no index in range.
    let checked = crate::check("fn f(t: f32[N, D], i: i32[M]) -> f32[M, D] { return t[i] }").unwrap();
    let err = run(&checked.module.graphs[0], &[tf(&[0, 2], &[]), ti(&[4], &[0; 4])], &HashMap::new()).unwrap_err();
    assert!(matches!(err, ExecError::IndexOutOfRange { axis: 0, index: 0, size: 0, span: Some(_), .. }), "{err}");
}

#[test]
fn layernorm_and_rmsnorm() {
    let mut g = Graph::new("norm");
    let x = param(&mut g, "x", f32ty(&["1", "4"]));
    let gamma = param(&mut g, "g", f32ty(&["4"]));
    let beta = param(&mut g, "b", f32ty(&["4"]));
    let ln = node(&mut g, Op::LayerNorm { eps: 0.0 }, &[x, gamma, beta]);
    let rms = node(&mut g, Op::RmsNorm { eps: 0.5 }, &[x, gamma]);
    g.add_output("ln", ln);
    g.add_output("rms", rms);
    let inputs = [tf(&[1, 4], &[1., 2., 3., 4.]), tf(&[4], &[1., 1., 2., 2.]), tf(&[4], &[0., 1., 0., 1.])];
    let out = run(&g, &inputs, &HashMap::new()).unwrap();
    // mean 2.5, biased variance 1.25.
    let r = 1.25f64.sqrt();
    assert_close(&out[0].to_f64_vec(), &[-1.5 / r, -0.5 / r + 1.0, 2.0 * 0.5 / r, 2.0 * 1.5 / r + 1.0], 1e-6);
    // mean square 7.5, plus eps 0.5 -> 8.
    let r = 8f64.sqrt();
    assert_close(&out[1].to_f64_vec(), &[1.0 / r, 2.0 / r, 6.0 / r, 8.0 / r], 1e-6);
}

#[test]
fn reductions_with_and_without_keepdim() {
    let mut g = Graph::new("red");
    let x = param(&mut g, "x", f32ty(&["2", "3"]));
    let reduce = |op, axes: &[usize], keepdim| Op::Reduce { op, axes: axes.to_vec(), keepdim };
    let sum = node(&mut g, reduce(ReduceOp::Sum, &[1], true), &[x]);
    let mean = node(&mut g, reduce(ReduceOp::Mean, &[0], false), &[x]);
    let max = node(&mut g, reduce(ReduceOp::Max, &[0, 1], false), &[x]);
    let min = node(&mut g, reduce(ReduceOp::Min, &[0], true), &[x]);
    for (name, v) in [("sum", sum), ("mean", mean), ("max", max), ("min", min)] {
        g.add_output(name, v);
    }
    let out = run(&g, &[tf(&[2, 3], &[1., 5., 3., 4., 2., 6.])], &HashMap::new()).unwrap();
    let shapes: Vec<Vec<usize>> = out.iter().map(|t| t.shape.clone()).collect();
    assert_eq!(shapes, vec![vec![2, 1], vec![3], vec![], vec![1, 3]]);
    assert_eq!(out[0].to_f64_vec(), vec![9., 12.]);
    assert_eq!(out[1].to_f64_vec(), vec![2.5, 3.5, 4.5]);
    assert_eq!(out[2].to_f64_vec(), vec![6.]);
    assert_eq!(out[3].to_f64_vec(), vec![1., 2., 3.]);
}

#[test]
fn empty_reductions() {
    let mut g = Graph::new("red");
    let x = param(&mut g, "x", f32ty(&["2", "N"]));
    let mut outs = Vec::new();
    for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
        outs.push(node(&mut g, Op::Reduce { op, axes: vec![1], keepdim: false }, &[x]));
    }
    for v in outs {
        g.add_output("r", v);
    }
    let out = run(&g, &[tf(&[2, 0], &[])], &HashMap::new()).unwrap();
    let values: Vec<Vec<f64>> = out.iter().map(|t| t.to_f64_vec()).collect();
    let inf = f64::INFINITY;
    assert_eq!(values, vec![vec![0., 0.], vec![0., 0.], vec![-inf, -inf], vec![inf, inf]]);
}

#[test]
fn iota_counts_along_its_axis() {
    let mut g = Graph::new("iota");
    let a = node_as(&mut g, Op::Iota { axis: 1 }, &[], ty(DType::I32, &["2", "3"]));
    let b = node_as(&mut g, Op::Iota { axis: 0 }, &[], ty(DType::I32, &["2", "3"]));
    g.add_output("a", a);
    g.add_output("b", b);
    let out = run(&g, &[], &HashMap::new()).unwrap();
    assert_eq!(out[0], ti(&[2, 3], &[0, 1, 2, 0, 1, 2]));
    assert_eq!(out[1], ti(&[2, 3], &[0, 0, 0, 1, 1, 1]));
}

#[test]
fn unary_ops() {
    let mut g = Graph::new("unary");
    let x = param(&mut g, "x", f32ty(&["4"]));
    let ops = [UnaryOp::Neg, UnaryOp::Abs, UnaryOp::Floor, UnaryOp::Relu, UnaryOp::Elu, UnaryOp::Sigmoid, UnaryOp::Gelu, UnaryOp::Silu];
    for op in ops {
        let v = node(&mut g, Op::Unary(op), &[x]);
        g.add_output(op.name(), v);
    }
    let out = run(&g, &[tf(&[4], &[-1.5, 0.0, 2.0, 0.5])], &HashMap::new()).unwrap();
    let get = |i: usize| out[i].to_f64_vec();
    assert_eq!(get(0), vec![1.5, 0.0, -2.0, -0.5]);
    assert_eq!(get(1), vec![1.5, 0.0, 2.0, 0.5]);
    assert_eq!(get(2), vec![-2.0, 0.0, 2.0, 0.0]);
    assert_eq!(get(3), vec![0.0, 0.0, 2.0, 0.5]);
    assert_close(&get(4), &[(-1.5f64).exp() - 1.0, 0.0, 2.0, 0.5], 1e-6);
    assert_close(&get(5), &[0.18242552380635635, 0.5, 0.8807970779778823, 0.6224593312018546], 1e-6);
    // Exact gelu, x * Phi(x): Phi(-1.5) = 0.0668072, Phi(2) = 0.9772499, Phi(0.5) = 0.6914625.
    assert_close(&get(6), &[-0.1002108019, 0.0, 1.9544997361, 0.3457312306], 1e-6);
    assert_close(&get(7), &[-1.5 * 0.18242552380635635, 0.0, 2.0 * 0.8807970779778823, 0.5 * 0.6224593312018546], 1e-6);
}

#[test]
fn binary_ops_rem_pow_and_int_division() {
    let mut g = Graph::new("binary");
    let a = param(&mut g, "a", ty(DType::I32, &["4"]));
    let b = param(&mut g, "b", ty(DType::I32, &["4"]));
    let rem = node(&mut g, Op::Binary(BinaryOp::Rem), &[a, b]);
    let div = node(&mut g, Op::Binary(BinaryOp::Div), &[a, b]);
    let pow = node(&mut g, Op::Binary(BinaryOp::Pow), &[a, b]);
    let max = node(&mut g, Op::Binary(BinaryOp::Max), &[a, b]);
    for v in [rem, div, pow, max] {
        g.add_output("o", v);
    }
    let out = run(&g, &[ti(&[4], &[-7, 7, -7, 5]), ti(&[4], &[3, -3, -3, 0])], &HashMap::new()).unwrap();
    assert_eq!(out[0], ti(&[4], &[2, -2, -1, 0]), "python-style remainder; x % 0 is 0 for ints");
    assert_eq!(out[1].dtype, DType::F32);
    assert_close(&out[1].to_f64_vec(), &[-7.0 / 3.0, -7.0 / 3.0, 7.0 / 3.0, f64::INFINITY], 1e-6);
    assert_close(&out[2].to_f64_vec(), &[-343.0, 7f64.powi(-3), -1.0 / 343.0, 1.0], 1e-6);
    assert_eq!(out[3], ti(&[4], &[3, 7, -3, 5]));
}

#[test]
fn comparisons_logic_select_and_cast() {
    let mut g = Graph::new("logic");
    let x = param(&mut g, "x", f32ty(&["2", "3"]));
    let t = param(&mut g, "t", f32ty(&["3"]));
    let gt = node(&mut g, Op::Binary(BinaryOp::Gt), &[x, t]);
    let zero = scalar(&mut g, 0.0, DType::F32);
    let pos = node(&mut g, Op::Binary(BinaryOp::Ge), &[x, zero]);
    let both = node(&mut g, Op::Binary(BinaryOp::And), &[gt, pos]);
    let either = node(&mut g, Op::Binary(BinaryOp::Or), &[gt, pos]);
    let not = node(&mut g, Op::Unary(UnaryOp::Not), &[both]);
    let sel = node(&mut g, Op::Select, &[gt, x, t]);
    let as_int = node_as(&mut g, Op::Cast, &[x], ty(DType::I32, &["2", "3"]));
    let as_bool = node_as(&mut g, Op::Cast, &[x], ty(DType::Bool, &["2", "3"]));
    for v in [gt, both, either, not, sel, as_int, as_bool] {
        g.add_output("o", v);
    }
    let out = run(&g, &[tf(&[2, 3], &[-1.5, 2.7, 0.0, 3.9, -0.2, 5.0]), tf(&[3], &[0.0, 3.0, -1.0])], &HashMap::new()).unwrap();
    let v = |i: usize| out[i].to_f64_vec();
    assert_eq!(out[0].dtype, DType::Bool);
    assert_eq!(v(0), vec![0., 0., 1., 1., 0., 1.]);
    assert_eq!(v(1), vec![0., 0., 1., 1., 0., 1.]);
    assert_eq!(v(2), vec![0., 1., 1., 1., 0., 1.]);
    assert_eq!(v(3), vec![1., 1., 0., 0., 1., 0.]);
    assert_close(&v(4), &[0.0, 3.0, 0.0, 3.9, 3.0, 5.0], 1e-6);
    assert_eq!(v(5), vec![-1., 2., 0., 3., 0., 5.], "casting truncates toward zero");
    assert_eq!(v(6), vec![1., 1., 0., 1., 1., 1.]);
}

#[test]
fn f16_nodes_round_to_f16() {
    let g = one_op(&[("a", ty(DType::F16, &["2"])), ("b", ty(DType::F16, &["2"]))], Op::Binary(BinaryOp::Add));
    let half_tensor = |v: &[f32]| Tensor::new(DType::F16, vec![2], crate::tensor::TensorData::F32(v.to_vec())).unwrap();
    // 2048 + 1 is not representable in f16 (spacing 2 there); ties round to even -> 2048.
    let out = run1(&g, &[half_tensor(&[2048.0, 0.1]), half_tensor(&[1.0, 0.2])]);
    assert_eq!(out.dtype, DType::F16);
    let expected = half::f16::from_f64(f64::from(half::f16::from_f32(0.1).to_f32()) + f64::from(half::f16::from_f32(0.2).to_f32()));
    assert_eq!(out.to_f64_vec(), vec![2048.0, expected.to_f64()]);
    // An f32 tensor is refused for an f16 parameter.
    let err = run(&g, &[tf(&[2], &[1., 2.]), half_tensor(&[1.0, 2.0])], &HashMap::new()).unwrap_err();
    assert!(matches!(err, ExecError::InputDType { expected: DType::F16, actual: DType::F32, .. }), "{err}");
}

#[test]
fn transpose_reshape_slice_concat() {
    let mut g = Graph::new("shape");
    let x = param(&mut g, "x", f32ty(&["2", "3"]));
    let xt = node(&mut g, Op::Transpose { perm: vec![1, 0] }, &[x]);
    let flat = node_as(&mut g, Op::Reshape, &[xt], f32ty(&["6"]));
    let cols = node(&mut g, Op::Slice { axis: 1, start: Dim::constant(1), end: Dim::constant(3) }, &[x]);
    let cat = node(&mut g, Op::Concat { axis: 1 }, &[x, cols]);
    for v in [xt, flat, cols, cat] {
        g.add_output("o", v);
    }
    let out = run(&g, &[tf(&[2, 3], &[1., 2., 3., 4., 5., 6.])], &HashMap::new()).unwrap();
    assert_eq!(out[0], tf(&[3, 2], &[1., 4., 2., 5., 3., 6.]));
    assert_eq!(out[1], tf(&[6], &[1., 4., 2., 5., 3., 6.]));
    assert_eq!(out[2], tf(&[2, 2], &[2., 3., 5., 6.]));
    assert_eq!(out[3], tf(&[2, 5], &[1., 2., 3., 2., 3., 4., 5., 6., 5., 6.]));
}

#[test]
fn symbolic_slice_bounds_are_checked() {
    let g = one_op(&[("x", f32ty(&["S"]))], Op::Slice { axis: 0, start: Dim::constant(1), end: Dim::parse("S+1").unwrap() });
    let err = run(&g, &[tf(&[3], &[1., 2., 3.])], &HashMap::new()).unwrap_err();
    assert_eq!(err, ExecError::OutOfRange { node: "%1 (slice)".into(), span: None, axis: 0, start: 1, end: 4, size: 3 });
}

#[test]
fn dim_values_and_scalar_outputs() {
    let g = dim_value(&["H*D"], Dim::parse("H*D+1").unwrap());
    let out = run(&g, &[tf(&[6], &[0.; 6])], &dims(&[("H", 2)])).unwrap();
    assert_eq!(out, vec![ti(&[], &[7])]);
}

#[test]
fn shared_values_survive_freeing() {
    // x feeds three users and is an output itself; y = x * x is used twice.
    let mut g = Graph::new("share");
    let x = param(&mut g, "x", f32ty(&["3"]));
    let e = node(&mut g, Op::Unary(UnaryOp::Neg), &[x]);
    let y = node(&mut g, Op::Binary(BinaryOp::Mul), &[x, x]);
    let z = node(&mut g, Op::Binary(BinaryOp::Add), &[y, e]);
    let w = node(&mut g, Op::Binary(BinaryOp::Sub), &[z, y]);
    g.add_output("w", w);
    g.add_output("x", x);
    g.add_output("w again", w);
    let out = run(&g, &[tf(&[3], &[1., 2., 3.])], &HashMap::new()).unwrap();
    assert_eq!(out, vec![tf(&[3], &[-1., -2., -3.]), tf(&[3], &[1., 2., 3.]), tf(&[3], &[-1., -2., -3.])]);
}

#[test]
fn dead_nodes_are_not_evaluated() {
    let mut g = Graph::new("dead");
    let x = param(&mut g, "x", f32ty(&["S"]));
    let _bad = node(&mut g, Op::Slice { axis: 0, start: Dim::constant(0), end: Dim::parse("S+1").unwrap() }, &[x]);
    let y = node(&mut g, Op::Unary(UnaryOp::Exp), &[x]);
    g.add_output("y", y);
    let out = run1(&g, &[tf(&[1], &[0.])]);
    assert_eq!(out.to_f64_vec(), vec![1.0]);
}

#[test]
fn huge_broadcasts_are_refused() {
    let mut g = Graph::new("big");
    let a = param(&mut g, "a", f32ty(&["N", "1"]));
    let b = param(&mut g, "b", f32ty(&["1", "N"]));
    let s = node(&mut g, Op::Binary(BinaryOp::Add), &[a, b]);
    g.add_output("s", s);
    let n = 1 << 16;
    let err = run(&g, &[tf(&[n, 1], &vec![0.; n]), tf(&[1, n], &vec![0.; n])], &HashMap::new()).unwrap_err();
    assert!(matches!(err, ExecError::TooLarge { limit: MAX_ELEMENTS, .. }), "{err}");
}

#[test]
fn scans_accumulate_in_order() {
    let checked = crate::check(
        "fn f(x: f32[N], a: f32[N], k: i32[N]) -> (s: f32[N], r: f32[N], p: f32[N], h: f32[N], i: i32[N]) {
    return cumsum(x), cumsum(x, reverse = true), cumprod(x), scan(a, x), cumprod(k)
}",
    )
    .unwrap();
    let x = Tensor::f32(vec![4], vec![1.5, -2.0, 0.5, 3.0]).unwrap();
    let a = Tensor::f32(vec![4], vec![0.5, 0.5, -1.0, 2.0]).unwrap();
    let k = Tensor::i32(vec![4], vec![65536, 65536, 3, -1]).unwrap();
    let out = crate::interp::run(&checked.module.graphs[0], &[x, a, k], &HashMap::new()).unwrap();
    let v: Vec<Vec<f64>> = out.iter().map(|t| t.to_f64_vec()).collect();
    assert_eq!(v[0], [1.5, -0.5, 0.0, 3.0]);
    assert_eq!(v[1], [3.0, 1.5, 3.5, 3.0]);
    assert_eq!(v[2], [1.5, -3.0, -1.5, -4.5]);
    // h = a h + x from h = 0: 1.5, 0.75 - 2, 1.25 + 0.5, 3.5 + 3.
    assert_eq!(v[3], [1.5, -1.25, 1.75, 6.5]);
    // 65536² wraps to 0 in i32.
    assert_eq!(v[4], [65536.0, 0.0, 0.0, 0.0]);
}

#[test]
fn sorts_are_stable_with_nan_above_every_number() {
    let checked = crate::check(
        "fn f(x: f32[N]) -> (a: i32[N], d: i32[N], s: f32[N], v: f32[2], i: i32[2]) {
    let (v, i) = topk(x, 2)
    return argsort(x), argsort(x, descending = true), sort(x), v, i
}",
    )
    .unwrap();
    let nan = f32::NAN;
    let x = Tensor::f32(vec![6], vec![1.0, nan, -0.0, 0.0, 1.0, -3.0]).unwrap();
    let out = crate::interp::run(&checked.module.graphs[0], &[x], &HashMap::new()).unwrap();
    let v: Vec<Vec<f64>> = out.iter().map(|t| t.to_f64_vec()).collect();
    // -0 and +0 tie (index order), as do the two 1s; NaN sorts above every number.
    assert_eq!(v[0], [5.0, 2.0, 3.0, 0.0, 4.0, 1.0]);
    assert_eq!(v[1], [1.0, 0.0, 4.0, 2.0, 3.0, 5.0]);
    assert_eq!(&v[2][..5], &[-3.0, -0.0, 0.0, 1.0, 1.0]);
    assert!(v[2][5].is_nan());
    assert!(v[3][0].is_nan() && v[3][1] == 1.0);
    assert_eq!(v[4], [1.0, 0.0]);
}

#[test]
fn scatter_add_accumulates_in_order_and_rejects_positions_out_of_range() {
    let checked = crate::check("fn f(b: f32[N], i: i32[M], s: f32[M]) -> f32[N] { return scatter_add(b, i, s, axis = 0) }").unwrap();
    let b = Tensor::f32(vec![3], vec![1.0, 2.0, 3.0]).unwrap();
    let s = Tensor::f32(vec![5], vec![10.0, 20.0, 30.0, 40.0, 50.0]).unwrap();
    let g = &checked.module.graphs[0];
    let out = crate::interp::run(g, &[b.clone(), Tensor::i32(vec![5], vec![2, 0, 2, 0, 1]).unwrap(), s.clone()], &HashMap::new()).unwrap();
    assert_eq!(out[0].to_f64_vec(), [61.0, 52.0, 43.0]);
    for (bad, index) in [(-4, -4), (3, 3)] {
        let i = Tensor::i32(vec![5], vec![2, 0, bad, 0, 1]).unwrap();
        let err = crate::interp::run(g, &[b.clone(), i, s.clone()], &HashMap::new()).unwrap_err();
        assert!(matches!(err, ExecError::IndexOutOfRange { axis: 0, index: i, size: 3, span: Some(_), .. } if i == index), "{err}");
    }
}
