//! Derivative rules against central differences, one op at a time, on the interpreter.

use super::*;
use crate::interp;
use crate::tensor::Tensor;
use std::collections::HashMap;

/// `Σ d_out · f(x)` for the forward outputs `outs`.
fn loss(outs: &[Tensor], cot: &[Tensor]) -> f64 {
    outs.iter().zip(cot).map(|(o, c)| o.to_f64_vec().iter().zip(c.to_f64_vec()).map(|(a, b)| a * b).sum::<f64>()).sum()
}

fn values(n: usize, seed: u64, lo: f64, hi: f64) -> Vec<f32> {
    // A small LCG: deterministic and dependency-free.
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let u = (s >> 11) as f64 / (1u64 << 53) as f64;
            (lo + (hi - lo) * u) as f32
        })
        .collect()
}

/// Inputs drawn from [-1, 1].
const UNIT: (f64, f64) = (-1.0, 1.0);

/// Seeded inputs for `graph`'s parameters at `shapes`: floats drawn from `range`, integers
/// ids (`k / 3` at element `k`).
fn inputs_for(graph: &Graph, shapes: &[&[usize]], (lo, hi): (f64, f64)) -> Vec<Tensor> {
    let params = graph.params();
    assert_eq!(params.len(), shapes.len(), "one shape per parameter");
    shapes
        .iter()
        .zip(params)
        .enumerate()
        .map(|(k, (s, p))| {
            let n = s.iter().product();
            if graph.node(*p).ty.dtype == DType::I32 {
                Tensor::new(DType::I32, s.to_vec(), crate::tensor::TensorData::I32((0..n as i32).map(|x| x / 3).collect())).unwrap()
            } else {
                Tensor::f32(s.to_vec(), values(n, k as u64, lo, hi)).unwrap()
            }
        })
        .collect()
}

/// Checks every float parameter's gradient that `derived` (the derivative of `graph`) gives
/// against a central difference of the loss along a random direction, with seeded
/// cotangents, running both on the interpreter with `env`. `what` names the case.
fn check_derivative(what: &str, graph: &Graph, derived: &Graph, inputs: &[Tensor], env: &HashMap<String, i64>) {
    let run = |g: &Graph, xs: &[Tensor]| interp::run(g, xs, env).unwrap();
    let fwd = run(graph, inputs);
    let cot: Vec<Tensor> = fwd
        .iter()
        .enumerate()
        .map(|(k, o)| Tensor::f32(o.shape.clone(), values(o.shape.iter().product(), 100 + k as u64, -1.0, 1.0)).unwrap())
        .collect();
    let mut all = inputs.to_vec();
    all.extend(cot.iter().cloned());
    let outs = run(derived, &all);
    let grads = &outs[fwd.len()..];
    let floats: Vec<usize> =
        graph.params().iter().enumerate().filter(|(_, p)| graph.node(**p).ty.dtype.is_float()).map(|(k, _)| k).collect();
    assert_eq!(grads.len(), floats.len());
    for (k, g) in floats.into_iter().zip(grads) {
        let x = &inputs[k];
        let dir = values(x.shape.iter().product(), 200 + k as u64, -1.0, 1.0);
        let analytic: f64 = g.to_f64_vec().iter().zip(&dir).map(|(a, b)| a * f64::from(*b)).sum();
        let h = 1e-3;
        let shifted = |sign: f64| {
            let mut xs = inputs.to_vec();
            let v: Vec<f32> = x.to_f64_vec().iter().zip(&dir).map(|(a, d)| (a + sign * h * f64::from(*d)) as f32).collect();
            xs[k] = Tensor::f32(x.shape.clone(), v).unwrap();
            loss(&run(graph, &xs), &cot)
        };
        let numeric = (shifted(1.0) - shifted(-1.0)) / (2.0 * h);
        let scale: f64 = g.to_f64_vec().iter().map(|a| a.abs()).sum::<f64>().max(1e-3);
        assert!((numeric - analytic).abs() <= 2e-2 * scale, "{what}\nparam {k}: finite difference {numeric}, gradient {analytic}");
    }
}

/// Checks every float parameter's gradient of `src`'s only function (see [`check_derivative`]).
/// Inputs are drawn from `range`.
fn check(src: &str, shapes: &[&[usize]], range: (f64, f64)) {
    let checked = crate::check(src).unwrap();
    let graph = &checked.module.graphs[0];
    let derived = differentiate(graph, None).unwrap();
    super::super::verify(&derived).unwrap();
    check_derivative(src, graph, &derived, &inputs_for(graph, shapes, range), &HashMap::new());
}

/// A source, its parameters' shapes, and the range its inputs are drawn from.
type Case<'a> = (&'a str, &'a [&'a [usize]], (f64, f64));

/// [`check`] for each case.
fn check_each(cases: &[Case]) {
    for (src, shapes, range) in cases {
        check(src, shapes, *range);
    }
}

#[test]
fn unary_rules() {
    for op in [
        "-x",
        "exp(x)",
        "log(x)",
        "sqrt(x)",
        "rsqrt(x)",
        "tanh(x)",
        "sigmoid(x)",
        "relu(x)",
        "gelu(x)",
        "silu(x)",
        "elu(x)",
        "abs(x)",
        "sin(x)",
        "cos(x)",
        "floor(x) + x",
    ] {
        let (lo, hi) = if op.contains("log") || op.contains("sqrt") { (0.5, 2.0) } else { (-2.0, 2.0) };
        check(&format!("fn f(x: f32[N]) -> f32[N] {{ return {op} }}"), &[&[7]], (lo, hi));
    }
}

#[test]
fn binary_rules_with_broadcasting() {
    for op in ["x + y", "x - y", "x * y", "x / y", "x ** y", "min(x, y)", "max(x, y)", "atan2(x, y)", "x % y"] {
        let (lo, hi) = if op.contains("**") || op.contains("/") || op.contains("%") { (0.5, 2.0) } else { (-2.0, 2.0) };
        check(&format!("fn f(x: f32[M, N], y: f32[N]) -> f32[M, N] {{ return {op} }}"), &[&[3, 5], &[5]], (lo, hi));
    }
}

#[test]
fn matmul_softmax_reductions_and_layout() {
    check_each(&[
        ("fn f(a: f32[B, M, K], b: f32[K, N]) -> f32[B, M, N] { return a @ b }", &[&[2, 3, 4], &[4, 5]], UNIT),
        ("fn f(x: f32[M, N]) -> f32[M, N] { return softmax(x, axis = -1) }", &[&[3, 6]], (-2.0, 2.0)),
        ("fn f(x: f32[M, N]) -> f32[N, M] { return x.T * 2.0 }", &[&[3, 4]], UNIT),
        ("fn f(x: f32[M, N]) -> f32[M] { return sum(x, axis = -1) }", &[&[3, 4]], UNIT),
        ("fn f(x: f32[M, N]) -> f32[N] { return mean(x, axis = 0) }", &[&[3, 4]], UNIT),
        ("fn f(x: f32[M, N]) -> f32[M] { return max(x, axis = -1) }", &[&[3, 4]], UNIT),
        ("fn f(x: f32[M, N]) -> f32[M] { return logsumexp(x, axis = -1) }", &[&[3, 4]], (-3.0, 3.0)),
        ("fn f(x: f32[M, N]) -> f32[M, 1] { return logsumexp(x * 2.0, axis = 1, keepdim = true) }", &[&[3, 4]], UNIT),
    ]);
}

#[test]
fn where_masks_and_norms() {
    check_each(&[
        (
            "fn f(x: f32[N, N]) -> f32[N, N] { let (i, j) = indices(x)\n return softmax(where(j <= i, x, -inf), axis = -1) }",
            &[&[5, 5]],
            UNIT,
        ),
        ("fn f(x: f32[S, E], g: f32[E], b: f32[E]) -> f32[S, E] { return layernorm(x, g, b) }", &[&[3, 6], &[6], &[6]], UNIT),
        ("fn f(x: f32[S, E], g: f32[E]) -> f32[S, E] { return rmsnorm(x, g) }", &[&[3, 6], &[6]], UNIT),
    ]);
}

#[test]
fn a_fully_masked_row_has_a_log_sum_exp_of_minus_infinity_and_zero_gradient() {
    let src = "fn f(x: f32[N, N]) -> f32[N] { let (i, j) = indices(x)\n return logsumexp(where(j < i, x, -inf), axis = -1) }";
    let checked = crate::check(src).unwrap();
    let derived = differentiate(&checked.module.graphs[0], None).unwrap();
    let x = Tensor::f32(vec![4, 4], values(16, 1, -1.0, 1.0)).unwrap();
    let d = Tensor::f32(vec![4], values(4, 2, -1.0, 1.0)).unwrap();
    let outs = interp::run(&derived, &[x, d], &HashMap::new()).unwrap();
    assert_eq!(outs[0].to_f64_vec()[0], f64::NEG_INFINITY);
    let dx = outs[1].to_f64_vec();
    assert!(dx.iter().all(|v| v.is_finite()), "{dx:?}");
    assert_eq!(&dx[..4], &[0.0; 4]);
}

#[test]
fn a_fully_masked_row_has_zero_gradient() {
    let src = "fn f(x: f32[N, N]) -> f32[N, N] { let (i, j) = indices(x)\n return softmax(where(j < i, x, -inf), axis = -1) }";
    let checked = crate::check(src).unwrap();
    let derived = differentiate(&checked.module.graphs[0], None).unwrap();
    let x = Tensor::f32(vec![4, 4], values(16, 1, -1.0, 1.0)).unwrap();
    let d = Tensor::f32(vec![4, 4], values(16, 2, -1.0, 1.0)).unwrap();
    let outs = interp::run(&derived, &[x, d], &HashMap::new()).unwrap();
    let dx = outs[1].to_f64_vec();
    assert!(dx.iter().all(|v| v.is_finite()), "{dx:?}");
    assert_eq!(&dx[..4], &[0.0; 4]);
}

#[test]
fn wrt_and_names() {
    let checked = crate::check("fn f(x: f32[N], n: i32[N], s: f32) -> f32[N] { return x * s + cast(n, f32) }").unwrap();
    let g = &checked.module.graphs[0];
    let d = differentiate(g, None).unwrap();
    assert_eq!(d.name, "f_grad");
    let outs: Vec<&str> = d.outputs().iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(outs, ["out", "d_x", "d_s"]);
    let d = differentiate(g, Some(&["s".to_string()])).unwrap();
    assert_eq!(d.outputs().len(), 2);
    assert!(matches!(differentiate(g, Some(&["n".to_string()])), Err(GradError::Wrt { .. })));
    assert!(matches!(differentiate(g, Some(&["z".to_string()])), Err(GradError::Wrt { .. })));
    let clash = crate::check("fn f(x: f32[N], d_out: f32[N]) -> f32[N] { return x + d_out }").unwrap();
    assert!(matches!(differentiate(&clash.module.graphs[0], None), Err(GradError::NameClash { .. })));
}

#[test]
fn scan_rules() {
    check_each(&[
        ("fn f(x: f32[M, N]) -> f32[M, N] { return cumsum(x, axis = 1) }", &[&[3, 5]], UNIT),
        ("fn f(x: f32[M, N]) -> f32[M, N] { return cumsum(x, axis = 0, reverse = true) }", &[&[3, 5]], UNIT),
        ("fn f(x: f32[M, N]) -> f32[M, N] { return cumprod(x, axis = 1) }", &[&[3, 5]], (0.5, 1.5)),
        ("fn f(a: f32[N], b: f32[M, N]) -> f32[M, N] { return scan(a, b, axis = 1) }", &[&[5], &[3, 5]], UNIT),
        ("fn f(a: f32[M, N], b: f32[M, N]) -> f32[M, N] { return scan(a, b, axis = 0, reverse = true) }", &[&[4, 2], &[4, 2]], UNIT),
    ]);
}

#[test]
fn gather_rule() {
    check(
        "fn f(t: f32[K], s: f32[K, N]) -> f32[K, N] { let (h, n) = indices(s)\n return s * t[h] + t[(n + h) % K] }",
        &[&[3], &[3, 4]],
        UNIT,
    );
}

#[test]
fn gathers_along_an_axis_and_by_leading_index() {
    check_each(&[
        (
            "fn f(e: f32[V, E], x: f32[M, E]) -> f32[M, E] { let (m, c) = indices(x)\n return e[reshape(m, [M]) % V] * x }",
            &[&[3, 4], &[5, 4]],
            UNIT,
        ),
        (
            "fn f(x: f32[M, N], w: f32[M, 2]) -> f32[M, 2] { let (m, c) = indices(w)\n return take_along(x, (c * 2 + m) % N, axis = 1) * w }",
            &[&[3, 5], &[3, 2]],
            UNIT,
        ),
    ]);
}

#[test]
fn sorted_values_and_top_k_carry_gradients() {
    check_each(&[
        ("fn f(x: f32[M, N]) -> f32[M, N] { return sort(x, axis = 1) }", &[&[3, 5]], UNIT),
        ("fn f(x: f32[M, N]) -> f32[M, 2] { let (v, i) = topk(x, 2)\n return v * 2.0 }", &[&[3, 5]], UNIT),
    ]);
}

#[test]
fn scatter_add_rule() {
    check(
        "fn f(b: f32[N, E], s: f32[M, E]) -> f32[N, E] { let (m, e) = indices(s)\n return scatter_add(b, (m * 2 + e) % N + 0 * e, s * s, axis = 0) }",
        &[&[3, 2], &[5, 2]],
        UNIT,
    );
}

/// [`check`] for a graph in IR text (a flash op as the optimizer makes it), which must derive a
/// fused backward: every float parameter's gradient against a central difference, with the
/// dims given.
fn check_graph(text: &str, shapes: &[&[usize]], dims: &[(&str, i64)]) {
    let graph: Graph = text.parse().unwrap_or_else(|e| panic!("{text}\n{e}"));
    let env: HashMap<String, i64> = dims.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    let derived = differentiate(&graph, None).unwrap_or_else(|e| panic!("{text}\n{e}"));
    super::super::verify(&derived).unwrap();
    assert!(derived.values().any(|v| matches!(derived.node(v).op, Op::FlashGrad { .. })), "{text}\nnot fused:\n{derived}");
    // A differentiated log-sum-exp joins its flash op's backward (no second pass, no lone lse).
    if text.contains("flash_lse") {
        assert!(derived.values().any(|v| matches!(derived.node(v).op, Op::FlashGrad { lse_grad: true, .. })), "{text}\n{derived}");
        let lse = derived.values().filter(|v| matches!(derived.node(*v).op, Op::FlashLse(_))).count();
        assert_eq!(lse, 1, "{derived}");
    }
    check_derivative(text, &graph, &derived, &inputs_for(&graph, shapes, UNIT), &env);
}

/// Flash ops as the optimizer makes them, with their parameters' shapes. The graphs are files
/// (`tests/cases/flash_gradient/`, their header saying what each covers).
const FLASH_CASES: &[(&str, &[&[usize]])] = &[
    (include_str!("../../../../tests/cases/flash_gradient/alibi_causal_gqa.ir"), &[&[2, 3, 5, 4], &[2, 1, 5, 4], &[2, 1, 5, 4], &[3]]),
    (include_str!("../../../../tests/cases/flash_gradient/soft_capped_sigmoid_cross.ir"), &[&[2, 4, 3], &[2, 6, 3], &[2, 6, 5]]),
    (
        include_str!("../../../../tests/cases/flash_gradient/relative_bias_document_mask.ir"),
        &[&[2, 6, 3], &[2, 6, 3], &[2, 6, 3], &[2, 5], &[6]],
    ),
    (include_str!("../../../../tests/cases/flash_gradient/sinks_lse_grad.ir"), &[&[2, 3, 5, 4], &[2, 3, 5, 4], &[2, 3, 5, 4], &[3]]),
    (include_str!("../../../../tests/cases/flash_gradient/lse_output_alibi.ir"), &[&[1, 2, 6, 4], &[1, 2, 6, 4], &[1, 2, 6, 4], &[2]]),
    (include_str!("../../../../tests/cases/flash_gradient/lse_alone.ir"), &[&[5, 3], &[5, 3], &[5, 3]]),
];

#[test]
fn flash_rule_against_central_differences() {
    for (text, shapes) in FLASH_CASES {
        check_graph(text, shapes, &[]);
    }
}

#[test]
fn score_derivatives_come_from_the_shared_rules() {
    let spec = |score: &str| FlashSpec {
        rank: 4,
        weights: Weights::Softmax,
        score: crate::ir::parse_expr(score, 4).unwrap(),
        mask: None,
        pair: crate::ir::Pair::Dot,
        dropout: None,
    };
    let show = |e: &crate::ir::ScoreExpr| crate::ir::ShowExpr { expr: e, rank: 4 }.to_string();
    let float = |_: usize| Class::Float;
    let g = score_grad(&spec("50.0 * tanh(s)"), &float).unwrap();
    assert_eq!(show(&g.ds), "50.0 * (1.0 - tanh(s) * tanh(s))");
    assert!(g.loads.is_empty());
    let g = score_grad(&spec("s * 0.125 + x0[h] * (j - i)"), &float).unwrap();
    assert_eq!(show(&g.ds), "0.125");
    assert_eq!(g.loads.len(), 1);
    // `1.0 *` stays: it makes the integer offset a float, as the product in the score does.
    assert_eq!(show(&g.loads[0].d), "1.0 * (j - i)");
    // An integer operand has no gradient; positions and comparisons carry none either.
    let g = score_grad(&spec("s + x0[h] * (j - i)"), &|_| Class::Int).unwrap();
    assert!(g.loads.is_empty());
}

#[test]
fn a_fully_masked_row_of_a_flash_op_has_zero_gradient() {
    let text = "graph g {
  %0 = param[name=q] : f32[S, D]
  %1 = param[name=k] : f32[S, D]
  %2 = param[name=v] : f32[S, D]
  %3 = flash[rank=2, weights=softmax, score=\"s\", mask=\"i >= 2 && j <= i\"] %0, %1, %2 : f32[S, D]
  output out = %3
}";
    let graph: Graph = text.parse().unwrap();
    let derived = differentiate(&graph, None).unwrap();
    let t = |seed| Tensor::f32(vec![5, 3], values(15, seed, -1.0, 1.0)).unwrap();
    let outs = interp::run(&derived, &[t(1), t(2), t(3), t(4)], &HashMap::new()).unwrap();
    for (name, g) in ["out", "d_q", "d_k", "d_v"].iter().zip(&outs) {
        let v = g.to_f64_vec();
        assert!(v.iter().all(|x| x.is_finite()), "{name}: {v:?}");
    }
    // Rows 0 and 1 keep no key: their output and query gradient are 0.
    assert!(outs[0].to_f64_vec()[..6].iter().all(|x| *x == 0.0));
    assert!(outs[1].to_f64_vec()[..6].iter().all(|x| *x == 0.0));
}

#[test]
fn stacks_broadcasts_and_strided_slices_carry_gradients() {
    check_each(&[
        ("fn f(x: f32[M, N], y: f32[M, N]) -> f32[M, 2, N] { return stack([x * y, y], axis = 1) }", &[&[3, 4], &[3, 4]], UNIT),
        ("fn f(x: f32[N], y: f32[M, N]) -> f32[M, N] { return broadcast_to(x, [M, N]) * y }", &[&[4], &[3, 4]], UNIT),
        ("fn f(x: f32[M, 2*D]) -> f32[M, D] { return x[:, 0::2] * x[:, 1::2] + cast(arange(D), f32) }", &[&[3, 6]], UNIT),
    ]);
}
