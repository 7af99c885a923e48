//! Gradients of an attention program: derive `f` with its backward pass from the same source,
//! run it, and check one gradient against a finite difference.
//!
//! ```text
//! cargo run --release -p attn-examples --example grad
//! ```

use attn_runtime::{Program, RunOptions, Tensor};
use std::collections::HashMap;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Causal attention with ALiBi biases whose slopes are learnable.
    let program = Program::from_file(concat!(env!("CARGO_MANIFEST_DIR"), "/alibi.attn"))?;

    // The derived program: alibi's inputs plus the cotangent `d_out` (the gradient of the loss
    // with respect to the result), returning `out` plus `d_q`, `d_k`, `d_v` and `d_slopes`.
    // `Some(&["slopes".into()])` would ask for the slopes' gradient only.
    let grad = program.grad("alibi", None)?;
    let entry = grad.entry("alibi_grad")?;
    println!("{entry}");

    // Seeded inputs (and cotangent) at B=1, H=4, S=64, D=32.
    let given: HashMap<String, i64> = [("B", 1), ("H", 4), ("S", 64), ("D", 32)].into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    let dims = grad.random_dims("alibi_grad", &given)?;
    let inputs = grad.random_inputs("alibi_grad", 7, &dims)?;
    let opts = RunOptions { dims: dims.clone(), ..RunOptions::default() };
    let outputs = grad.run("alibi_grad", inputs.clone(), &opts)?;
    for (name, t) in &outputs {
        println!("{name}: {:?}", t.shape);
    }

    // Check d_slopes[0] against a central difference of loss = Σ d_out · alibi(...).
    let d_out = &inputs.iter().find(|(n, _)| n == "d_out").ok_or("no d_out")?.1;
    let forward: Vec<(String, Tensor)> = inputs.iter().filter(|(n, _)| n != "d_out").cloned().collect();
    let loss = |slope0: f32| -> Result<f64, Box<dyn std::error::Error>> {
        let mut xs = forward.clone();
        for (n, t) in &mut xs {
            if n == "slopes" {
                let mut v: Vec<f32> = t.to_f64_vec().iter().map(|x| *x as f32).collect();
                v[0] = slope0;
                *t = Tensor::f32(t.shape.clone(), v)?;
            }
        }
        let out = program.run("alibi", xs, &opts)?;
        Ok(out[0].1.to_f64_vec().iter().zip(d_out.to_f64_vec()).map(|(a, b)| a * b).sum())
    };
    let slopes = &forward.iter().find(|(n, _)| n == "slopes").ok_or("no slopes")?.1;
    let s0 = slopes.to_f64_vec()[0] as f32;
    let h = 1e-3f32;
    let numeric = (loss(s0 + h)? - loss(s0 - h)?) / (2.0 * f64::from(h));
    let analytic = outputs.iter().find(|(n, _)| n == "d_slopes").ok_or("no d_slopes")?.1.to_f64_vec()[0];
    println!("d_slopes[0]: derived {analytic:.5}, central difference {numeric:.5}");
    Ok(())
}
