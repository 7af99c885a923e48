//! Embedding attnc in a Rust program: compile an attention program once, look at its entry
//! points, and run it many times on data that stays in your own buffers.
//!
//! ```text
//! cargo run --release -p attn-examples --example embed
//! ```

use attn_runtime::cpu::{CpuOptions, OutData, OutRef, TensorRef};
use attn_runtime::{Program, RunOptions, Tensor, io};
use std::collections::HashMap;

/// Causal attention with ALiBi biases (examples/alibi.attn). Any `.attn` file works:
/// `Program::from_file("examples/alibi.attn")` reads one from disk.
const SOURCE: &str = "
fn alibi(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D], slopes: f32[H]) -> f32[B, H, S, D] {
    let scores = q @ k.T / sqrt(D)
    let (b, h, i, j) = indices(scores)
    let biased = scores + slopes[h] * (j - i)
    return softmax(where(j <= i, biased, -inf), axis = -1) @ v
}
";

/// Deterministic test data (any `&[f32]` of the right length will do).
fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2000) as f32 / 1000.0 - 1.0).collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // 1. Compile once: parse, type-check and lower to IR. Errors carry rendered diagnostics.
    let program = Program::from_source(SOURCE, "alibi.attn")?;

    // 2. Inspect the entry points and their parameter shapes (symbolic dims).
    for entry in program.entries() {
        println!("entry: {entry}");
        for (name, ty) in &entry.params {
            println!("  param {name}: {ty}");
        }
    }

    // 3. Generate native code for one entry (optimised: the attention becomes one fused
    //    flash kernel). Threads: 0 = one per core.
    let alibi = program.compile_cpu("alibi", &CpuOptions { threads: 0 })?;
    println!("compiled in {:.1} ms, {} step(s)", alibi.compile_time().as_secs_f64() * 1e3, alibi.schedule().steps.len());

    // 4. Run it many times. Inputs are borrowed (`TensorRef`), never copied; every size is
    //    accepted without recompiling (dims are read off the input shapes).
    let (b, h, d) = (1, 8, 64);
    let slopes: Vec<f32> = (1..=h).map(|k| 2f32.powf(-8.0 * k as f32 / h as f32)).collect();
    for s in [16, 100, 1000] {
        let shape = [b, h, s, d];
        let (q, k, v) = (data(b * h * s * d, 1), data(b * h * s * d, 2), data(b * h * s * d, 3));
        let inputs = [
            TensorRef::f32(&shape, &q),
            TensorRef::f32(&shape, &k),
            TensorRef::f32(&shape, &v),
            TensorRef::f32(std::slice::from_ref(&h), &slopes),
        ];
        let outputs = alibi.run(&inputs, &HashMap::new())?;
        let out = &outputs[0];
        let stats = alibi.alloc_stats().unwrap_or_default();
        println!(
            "S = {s:4}: out {:?}, out[0..3] = {:?}, extra memory {} KiB",
            out.shape,
            &out.to_f64_vec()[..3],
            stats.extra_bytes(alibi.threads()) / 1024
        );
    }

    // 5. Results can go into your own buffers too: `run_into` writes them where you say (here
    //    one buffer reused for every call), checked against the result's shape first.
    let shape = [b, h, 100, d];
    let (q, k, v) = (data(b * h * 100 * d, 1), data(b * h * 100 * d, 2), data(b * h * 100 * d, 3));
    let inputs = [
        TensorRef::f32(&shape, &q),
        TensorRef::f32(&shape, &k),
        TensorRef::f32(&shape, &v),
        TensorRef::f32(std::slice::from_ref(&h), &slopes),
    ];
    let mut mine = vec![0.0f32; b * h * 100 * d];
    alibi.run_into(&inputs, &HashMap::new(), &mut [Some(OutRef { shape: &shape, data: OutData::F32(&mut mine) })])?;
    println!("into my buffer: out[0..3] = {:?}", &mine[..3]);

    // 6. Mismatched inputs are typed errors, not panics.
    let bad = [1usize, 8, 10, 64];
    let short = vec![0.0f32; 10];
    match alibi.run(&[TensorRef::f32(&bad, &short)], &HashMap::new()) {
        Err(e) => println!("as expected: {e}"),
        Ok(_) => println!("unexpectedly accepted"),
    }

    // 7. Owned tensors and files work too: `Program::run` takes named tensors (any order),
    //    `io::read_npy` / `io::read_safetensors` load them from disk.
    let dir = std::env::temp_dir().join("attnc-embed-example");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("slopes.npy");
    io::write_npy(&path, &Tensor::f32(vec![h], slopes.clone())?)?;
    let from_file = io::convert("slopes", io::read_npy(&path)?, attn_runtime::DType::F32)?;
    let shape = vec![b, h, 8, d];
    let n = b * h * 8 * d;
    let named = [
        ("q", Tensor::f32(shape.clone(), data(n, 1))?),
        ("k", Tensor::f32(shape.clone(), data(n, 2))?),
        ("v", Tensor::f32(shape, data(n, 3))?),
        ("slopes", from_file),
    ];
    let outputs = program.run("alibi", named, &RunOptions::default())?;
    println!("Program::run: {} = {:?}", outputs[0].0, outputs[0].1.shape);
    Ok(())
}
