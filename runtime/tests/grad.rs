//! Gradients of every example: the interpreter against central differences, and the cpu target
//! against the interpreter at odd sizes.

use attn_runtime::cpu::CpuOptions;
use attn_runtime::{DType, EntryInfo, Program, RunOptions, Target, Tensor};
use std::collections::HashMap;
use std::path::PathBuf;

fn examples() -> Vec<(String, Program)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("examples")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "attn"))
        .collect();
    paths.sort();
    assert!(paths.len() >= 21, "found {} examples", paths.len());
    paths
        .into_iter()
        .map(|p| (p.file_stem().and_then(|s| s.to_str()).unwrap_or("?").to_string(), Program::from_file(&p).expect("example compiles")))
        .collect()
}

/// Calls `f` with each example's name, program and entry.
fn each_entry(mut f: impl FnMut(&str, &Program, &EntryInfo)) {
    for (name, program) in examples() {
        for entry in program.entries() {
            f(&name, &program, &entry);
        }
    }
}

/// Sizes for the entry's dims: `s` for sequence-like dims, `d` for head widths, small others.
fn dims_for(program: &Program, entry: &str, s: i64, d: i64) -> HashMap<String, i64> {
    let mut dims = HashMap::new();
    for name in program.entry_dims(entry).expect("entry") {
        let v = match name.as_str() {
            "S" | "T" | "N" => s,
            "M" => s + 2,
            "D" | "Dv" | "Dq" | "Dk" => d,
            "Dh" => (d / 8).max(1),
            "B" => 1,
            "A" => 4,
            "F" => 6,
            "P" => 3,
            "Hh" => 3,
            _ => 2,
        };
        dims.insert(name, v);
    }
    dims
}

fn dot(a: &Tensor, b: &Tensor) -> f64 {
    a.to_f64_vec().iter().zip(b.to_f64_vec()).map(|(x, y)| x * y).sum()
}

/// The inputs of `grad` (the entry's, then one cotangent per float result). Weight matrices
/// (float rank-2 inputs `[K, N]`) are scaled by 1/√K, as models initialise them: N(0, 1)
/// weights make stacked attention layers needlessly ill-conditioned.
fn grad_inputs(program: &Program, grad: &Program, entry: &str, dims: &HashMap<String, i64>, seed: u64) -> Vec<(String, Tensor)> {
    let mut inputs = program.random_inputs(entry, seed, dims).expect("inputs");
    for (_, t) in inputs.iter_mut() {
        if t.dtype.is_float() && t.shape.len() == 2 {
            let scale = 1.0 / (t.shape[0].max(1) as f64).sqrt();
            let v: Vec<f32> = t.to_f64_vec().iter().map(|x| (x * scale) as f32).collect();
            *t = Tensor::new(t.dtype, t.shape.clone(), attn_runtime::TensorData::F32(v)).expect("tensor");
        }
    }
    let all = grad.random_inputs(&format!("{entry}_grad"), seed + 1, dims).expect("cotangents");
    inputs.extend(all.into_iter().filter(|(n, _)| n.starts_with("d_")));
    inputs
}

#[test]
fn interpreter_gradients_match_central_differences() {
    let mut failures = Vec::new();
    let mut checked = 0;
    each_entry(|name, program, entry| {
        let grad = match program.grad(&entry.name, None) {
            Ok(g) => g,
            Err(e) => {
                failures.push(format!("{name}/{}: {e}", entry.name));
                return;
            }
        };
        let dims = program.random_dims(&entry.name, &dims_for(program, &entry.name, 5, 4)).expect("dims");
        let inputs = grad_inputs(program, &grad, &entry.name, &dims, 3);
        let opts = RunOptions { dims: dims.clone(), target: Target::Interp };
        let outs = grad.run(&format!("{}_grad", entry.name), inputs.clone(), &opts).expect("grad runs");
        let cot: HashMap<&str, &Tensor> = inputs.iter().filter_map(|(n, t)| n.strip_prefix("d_").map(|r| (r, t))).collect();
        let fwd_inputs: Vec<(String, Tensor)> = inputs.iter().filter(|(n, _)| entry.params.iter().any(|(p, _)| p == n)).cloned().collect();
        let loss = |xs: Vec<(String, Tensor)>| -> f64 {
            let o = program.run(&entry.name, xs, &opts).expect("forward runs");
            o.iter().filter_map(|(n, t)| cot.get(n.as_str()).map(|c| dot(t, c))).sum()
        };
        for (param, ty) in entry.params.iter().filter(|(_, t)| t.dtype.is_float()) {
            let Some((_, g)) = outs.iter().find(|(n, _)| *n == format!("d_{param}")) else {
                failures.push(format!("{name}/{}: no d_{param}", entry.name));
                continue;
            };
            let (_, x) = fwd_inputs.iter().find(|(n, _)| n == param).expect("input");
            let dir = program.random_inputs(&entry.name, 99, &dims).expect("direction");
            let (_, u) = dir.iter().find(|(n, _)| n == param).expect("direction input");
            let analytic = dot(g, u);
            let shifted = |sign: f64, h: f64| {
                let v: Vec<f32> = x.to_f64_vec().iter().zip(u.to_f64_vec()).map(|(a, d)| (a + sign * h * d) as f32).collect();
                let mut xs = fwd_inputs.clone();
                for (n, t) in xs.iter_mut() {
                    if n == param {
                        *t = Tensor::new(ty.dtype, x.shape.clone(), attn_runtime::TensorData::F32(v.clone())).expect("tensor");
                    }
                }
                loss(xs)
            };
            checked += 1;
            let scale: f64 = g.to_f64_vec().iter().zip(u.to_f64_vec()).map(|(a, b)| (a * b).abs()).sum::<f64>().max(1e-2);
            // A step may cross a kink (relu, max, a mask edge): a smaller one usually does
            // not, while staying above f32 rounding.
            let numerics: Vec<f64> = [1e-2, 3e-3].iter().map(|h| (shifted(1.0, *h) - shifted(-1.0, *h)) / (2.0 * h)).collect();
            let numeric = numerics.iter().copied().min_by(|a, b| (a - analytic).abs().total_cmp(&(b - analytic).abs())).unwrap_or(f64::NAN);
            if (numeric - analytic).abs() > 3e-2 * scale || !analytic.is_finite() {
                failures.push(format!("{name}/{} d_{param}: finite difference {numeric:.6}, gradient {analytic:.6}", entry.name));
            }
        }
    });
    assert!(failures.is_empty(), "{} failure(s):\n  {}", failures.len(), failures.join("\n  "));
    assert!(checked >= 60, "only {checked} gradients were checked");
}

#[test]
fn cpu_gradients_match_the_interpreter_at_odd_sizes() {
    let mut failures = Vec::new();
    let mut compared = 0;
    each_entry(|name, program, entry| {
        let Ok(grad) = program.grad(&entry.name, None) else { return };
        let gname = format!("{}_grad", entry.name);
        for (s, d) in [(7, 16), (65, 72)] {
            let dims = program.random_dims(&entry.name, &dims_for(program, &entry.name, s, d)).expect("dims");
            let inputs = grad_inputs(program, &grad, &entry.name, &dims, 5);
            let interp = grad.run(&gname, inputs.clone(), &RunOptions { dims: dims.clone(), target: Target::Interp }).expect("interp");
            let cpu = grad.run_with(&gname, inputs, &RunOptions { dims: dims.clone(), target: Target::Cpu }, &CpuOptions { threads: 2 });
            let cpu = match cpu {
                Ok(c) => c,
                Err(e) => {
                    failures.push(format!("{name}/{gname} S={s} D={d}: {e}"));
                    continue;
                }
            };
            // A gradient that is exactly zero (a softmax is blind to a shift shared by every
            // key) is compared against the program's largest value, not its own rounding.
            let largest = interp.iter().flat_map(|(_, t)| t.to_f64_vec()).filter(|v| v.is_finite()).fold(0.0f64, |m, v| m.max(v.abs()));
            for ((n, want), (_, got)) in interp.iter().zip(&cpu) {
                let (w, g) = (want.to_f64_vec(), got.to_f64_vec());
                if want.dtype != DType::F32 && want.dtype.is_float() || g.iter().any(|v| v.is_nan()) != w.iter().any(|v| v.is_nan()) {
                    failures.push(format!("{name}/{gname} S={s} D={d} {n}: dtype or NaN mismatch"));
                    continue;
                }
                let scale = w.iter().filter(|v| v.is_finite()).fold(0.0f64, |m, v| m.max(v.abs())).max(1e-3 * largest).max(1e-6);
                let worst = w.iter().zip(&g).filter(|(a, _)| a.is_finite()).fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
                compared += 1;
                // Such a zero is what is left of f32 sums of terms as large as the program's
                // values, so its rounding is measured against those: up to 8 f32 epsilons of
                // the largest (Mega's `d_mk` is 0.92 of one on the AVX2 path, where 1e-4 of
                // the 1e-3 floor allows 0.84).
                let allowed = (1e-4 * scale).max(8.0 * f64::from(f32::EPSILON) * largest);
                if worst > allowed {
                    failures.push(format!("{name}/{gname} S={s} D={d} {n}: error {worst:.3e} of scale {scale:.3e}"));
                }
            }
        }
    });
    assert!(failures.is_empty(), "{} failure(s):\n  {}", failures.len(), failures.join("\n  "));
    assert!(compared >= 150, "only {compared} outputs were compared");
}

/// Flash programs whose backward is fused, each on the interpreter and the cpu target at sizes
/// that span several 64 x 64 tiles with ragged edges (S = 150, a cross length of 97, D = 72):
/// causal (skipped and diagonal tiles), ALiBi slopes and a relative-bias table (extra operands'
/// gradients by per-item sums and by index), soft-capping, sigmoid weights over a window,
/// grouped-query K/V, a mask that keeps no key for the first rows (their gradients are 0), and
/// the log-sum-exp as a value (attention sinks, a second result) whose cotangent joins `delta`.
const FUSED: &[(&str, &str)] = &[
    (
        "causal",
        "fn f(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D]) -> f32[B, H, S, D] {
            let s = q @ k.T / sqrt(D)
            let (b, h, i, j) = indices(s)
            return softmax(where(j <= i, s, -inf), axis = -1) @ v }",
    ),
    (
        "alibi gqa",
        "fn f(q: f32[B, H, S, D], k: f32[B, 1, S, D], v: f32[B, 1, S, D], slopes: f32[H]) -> f32[B, H, S, D] {
            let s = q @ k.T / sqrt(D)
            let (b, h, i, j) = indices(s)
            return softmax(where(j <= i, s + slopes[h] * (j - i), -inf), axis = -1) @ v }",
    ),
    (
        "relative bias, cross",
        "fn f(q: f32[B, H, M, D], k: f32[B, H, N, D], v: f32[B, H, N, D], table: f32[H, R]) -> f32[B, H, M, D] {
            let s = q @ k.T / sqrt(D)
            let (b, h, i, j) = indices(s)
            return softmax(s + table[h, (j - i) % R], axis = -1) @ v }",
    ),
    (
        "soft-capping",
        "fn f(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D]) -> f32[B, H, S, D] {
            let s = q @ k.T / sqrt(D)
            let (b, h, i, j) = indices(s)
            return softmax(where(j <= i, 30.0 * tanh(s / 30.0), -inf), axis = -1) @ v }",
    ),
    (
        "sigmoid window",
        "fn f(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D]) -> f32[B, H, S, D] {
            let s = q @ k.T / sqrt(D)
            let (b, h, i, j) = indices(s)
            return sigmoid(where(abs(i - j) <= 40, s - 2.0, -inf)) @ v }",
    ),
    (
        "rows without keys",
        "fn f(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D]) -> f32[B, H, S, D] {
            let s = q @ k.T / sqrt(D)
            let (b, h, i, j) = indices(s)
            return softmax(where(i >= 70 && j <= i, s, -inf), axis = -1) @ v }",
    ),
    (
        "sinks (the log-sum-exp's cotangent)",
        "fn f(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D], sink: f32[H]) -> f32[B, H, S, D] {
            let s = q @ k.T / sqrt(D)
            let (b, h, i, j) = indices(s)
            let c = where(j <= i, s, -inf)
            return (softmax(c, axis = -1) @ v) * unsqueeze(sigmoid(logsumexp(c, axis = -1) - unsqueeze(sink, 1)), 3) }",
    ),
    (
        "log-sum-exp returned, alibi",
        "fn f(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D], slopes: f32[H]) -> (out: f32[B, H, S, D], lse: f32[B, H, S]) {
            let s = q @ k.T / sqrt(D)
            let (b, h, i, j) = indices(s)
            let c = where(i - j < 90, s + slopes[h] * (j - i), -inf)
            return softmax(c, axis = -1) @ v, logsumexp(c, axis = -1) }",
    ),
];

#[test]
fn fused_backward_matches_the_interpreter_across_tiles() {
    let mut failures = Vec::new();
    for (label, src) in FUSED {
        let program = Program::from_source(src, "fused.attn").expect("compiles");
        let grad = program.grad("f", None).expect("derives");
        match grad.backward() {
            Some(Ok(lines)) if !lines.is_empty() => {}
            other => failures.push(format!("{label}: the backward is not fused: {other:?}")),
        }
        let dims: HashMap<String, i64> =
            [("B", 1), ("H", 3), ("S", 150), ("M", 150), ("N", 97), ("D", 72), ("R", 9)].iter().map(|(k, v)| (k.to_string(), *v)).collect();
        let dims: HashMap<String, i64> =
            program.entry_dims("f").expect("dims").into_iter().filter_map(|n| dims.get(&n).map(|v| (n, *v))).collect();
        let inputs = grad_inputs(&program, &grad, "f", &dims, 7);
        let interp = grad.run("f_grad", inputs.clone(), &RunOptions { dims: dims.clone(), target: Target::Interp }).expect("interp");
        let cpu = grad.run_with("f_grad", inputs, &RunOptions { dims: dims.clone(), target: Target::Cpu }, &CpuOptions { threads: 2 });
        let cpu = match cpu {
            Ok(c) => c,
            Err(e) => {
                failures.push(format!("{label}: {e}"));
                continue;
            }
        };
        for ((n, want), (_, got)) in interp.iter().zip(&cpu) {
            let (w, g) = (want.to_f64_vec(), got.to_f64_vec());
            if g.iter().any(|v| !v.is_finite()) {
                failures.push(format!("{label} {n}: a non-finite value"));
                continue;
            }
            let scale = w.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-6);
            let worst = w.iter().zip(&g).fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
            if worst > 1e-4 * scale {
                failures.push(format!("{label} {n}: max|diff|/max|ref| = {:.2e}", worst / scale));
            }
        }
        if *label == "rows without keys" {
            // Rows 0..70 keep no key: zero output and zero query gradient (B = 1, so the first
            // head's first 70 rows of width 72).
            for (n, t) in cpu.iter().filter(|(n, _)| n == "out" || n == "d_q") {
                if t.to_f64_vec()[..70 * 72].iter().any(|v| *v != 0.0) {
                    failures.push(format!("{label} {n}: a masked row is not zero"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} failure(s):\n  {}", failures.len(), failures.join("\n  "));
}
