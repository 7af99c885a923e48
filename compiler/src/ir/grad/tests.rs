//! Derivative rules against central differences, one op at a time, on the interpreter.

use super::*;
use crate::interp;
use crate::tensor::Tensor;
use std::collections::HashMap;

/// `Σ d_out · f(x)` for the forward graph.
fn loss(graph: &Graph, inputs: &[Tensor], cot: &[Tensor]) -> f64 {
    let outs = interp::run(graph, inputs, &HashMap::new()).unwrap();
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

/// Checks every float parameter's gradient of `src`'s only function against a central
/// difference of the loss along a random direction. Inputs are drawn from [lo, hi].
fn check(src: &str, shapes: &[Vec<usize>], lo: f64, hi: f64) {
    let checked = crate::check(src).unwrap();
    let graph = &checked.module.graphs[0];
    let derived = differentiate(graph, None).unwrap();
    super::super::verify(&derived).unwrap();
    let inputs: Vec<Tensor> =
        shapes.iter().enumerate().map(|(k, s)| Tensor::f32(s.clone(), values(s.iter().product(), k as u64, lo, hi)).unwrap()).collect();
    let fwd = interp::run(graph, &inputs, &HashMap::new()).unwrap();
    let cot: Vec<Tensor> = fwd
        .iter()
        .enumerate()
        .map(|(k, o)| Tensor::f32(o.shape.clone(), values(o.shape.iter().product(), 100 + k as u64, -1.0, 1.0)).unwrap())
        .collect();
    let mut all = inputs.clone();
    all.extend(cot.iter().cloned());
    let outs = interp::run(&derived, &all, &HashMap::new()).unwrap();
    let grads = &outs[fwd.len()..];
    assert_eq!(grads.len(), inputs.len());
    for (k, (x, g)) in inputs.iter().zip(grads).enumerate() {
        let dir = values(x.shape.iter().product(), 200 + k as u64, -1.0, 1.0);
        let analytic: f64 = g.to_f64_vec().iter().zip(&dir).map(|(a, b)| a * f64::from(*b)).sum();
        let h = 1e-3;
        let shifted = |sign: f64| {
            let mut xs = inputs.clone();
            let v: Vec<f32> = x.to_f64_vec().iter().zip(&dir).map(|(a, d)| (a + sign * h * f64::from(*d)) as f32).collect();
            xs[k] = Tensor::f32(x.shape.clone(), v).unwrap();
            loss(graph, &xs, &cot)
        };
        let numeric = (shifted(1.0) - shifted(-1.0)) / (2.0 * h);
        let scale: f64 = g.to_f64_vec().iter().map(|a| a.abs()).sum::<f64>().max(1e-3);
        assert!((numeric - analytic).abs() <= 2e-2 * scale, "{src}\\nparam {k}: finite difference {numeric}, gradient {analytic}");
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
        check(&format!("fn f(x: f32[N]) -> f32[N] {{ return {op} }}"), &[vec![7]], lo, hi);
    }
}

#[test]
fn binary_rules_with_broadcasting() {
    for op in ["x + y", "x - y", "x * y", "x / y", "x ** y", "min(x, y)", "max(x, y)", "atan2(x, y)", "x % y"] {
        let (lo, hi) = if op.contains("**") || op.contains("/") || op.contains("%") { (0.5, 2.0) } else { (-2.0, 2.0) };
        check(&format!("fn f(x: f32[M, N], y: f32[N]) -> f32[M, N] {{ return {op} }}"), &[vec![3, 5], vec![5]], lo, hi);
    }
}

#[test]
fn matmul_softmax_reductions_and_layout() {
    check("fn f(a: f32[B, M, K], b: f32[K, N]) -> f32[B, M, N] { return a @ b }", &[vec![2, 3, 4], vec![4, 5]], -1.0, 1.0);
    check("fn f(x: f32[M, N]) -> f32[M, N] { return softmax(x, axis = -1) }", &[vec![3, 6]], -2.0, 2.0);
    check("fn f(x: f32[M, N]) -> f32[N, M] { return x.T * 2.0 }", &[vec![3, 4]], -1.0, 1.0);
    check("fn f(x: f32[M, N]) -> f32[M] { return sum(x, axis = -1) }", &[vec![3, 4]], -1.0, 1.0);
    check("fn f(x: f32[M, N]) -> f32[N] { return mean(x, axis = 0) }", &[vec![3, 4]], -1.0, 1.0);
    check("fn f(x: f32[M, N]) -> f32[M] { return max(x, axis = -1) }", &[vec![3, 4]], -1.0, 1.0);
}

#[test]
fn where_masks_and_norms() {
    check(
        "fn f(x: f32[N, N]) -> f32[N, N] { let (i, j) = indices(x)\n return softmax(where(j <= i, x, -inf), axis = -1) }",
        &[vec![5, 5]],
        -1.0,
        1.0,
    );
    check(
        "fn f(x: f32[S, E], g: f32[E], b: f32[E]) -> f32[S, E] { return layernorm(x, g, b) }",
        &[vec![3, 6], vec![6], vec![6]],
        -1.0,
        1.0,
    );
    check("fn f(x: f32[S, E], g: f32[E]) -> f32[S, E] { return rmsnorm(x, g) }", &[vec![3, 6], vec![6]], -1.0, 1.0);
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
    check("fn f(x: f32[M, N]) -> f32[M, N] { return cumsum(x, axis = 1) }", &[vec![3, 5]], -1.0, 1.0);
    check("fn f(x: f32[M, N]) -> f32[M, N] { return cumsum(x, axis = 0, reverse = true) }", &[vec![3, 5]], -1.0, 1.0);
    check("fn f(x: f32[M, N]) -> f32[M, N] { return cumprod(x, axis = 1) }", &[vec![3, 5]], 0.5, 1.5);
    check("fn f(a: f32[N], b: f32[M, N]) -> f32[M, N] { return scan(a, b, axis = 1) }", &[vec![5], vec![3, 5]], -1.0, 1.0);
    check(
        "fn f(a: f32[M, N], b: f32[M, N]) -> f32[M, N] { return scan(a, b, axis = 0, reverse = true) }",
        &[vec![4, 2], vec![4, 2]],
        -1.0,
        1.0,
    );
}

#[test]
fn gather_rule() {
    check(
        "fn f(t: f32[K], s: f32[K, N]) -> f32[K, N] { let (h, n) = indices(s)\n return s * t[h] + t[(n + h) % K] }",
        &[vec![3], vec![3, 4]],
        -1.0,
        1.0,
    );
}

#[test]
fn gathers_along_an_axis_and_by_leading_index() {
    check(
        "fn f(e: f32[V, E], x: f32[M, E]) -> f32[M, E] { let (m, c) = indices(x)\n return e[reshape(m, [M]) % V] * x }",
        &[vec![3, 4], vec![5, 4]],
        -1.0,
        1.0,
    );
    check(
        "fn f(x: f32[M, N], w: f32[M, 2]) -> f32[M, 2] { let (m, c) = indices(w)\n return take_along(x, (c * 2 + m) % N, axis = 1) * w }",
        &[vec![3, 5], vec![3, 2]],
        -1.0,
        1.0,
    );
}

#[test]
fn sorted_values_and_top_k_carry_gradients() {
    check("fn f(x: f32[M, N]) -> f32[M, N] { return sort(x, axis = 1) }", &[vec![3, 5]], -1.0, 1.0);
    check("fn f(x: f32[M, N]) -> f32[M, 2] { let (v, i) = topk(x, 2)\n return v * 2.0 }", &[vec![3, 5]], -1.0, 1.0);
}

#[test]
fn scatter_add_rule() {
    check(
        "fn f(b: f32[N, E], s: f32[M, E]) -> f32[N, E] { let (m, e) = indices(s)\n return scatter_add(b, (m * 2 + e) % N + 0 * e, s * s, axis = 0) }",
        &[vec![3, 2], vec![5, 2]],
        -1.0,
        1.0,
    );
}
