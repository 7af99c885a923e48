//! Throughput of the dense microkernels on every instruction-set path this CPU runs, against
//! the measured FMA peak. A benchmark, not a test:
//!
//! ```text
//! cargo run --release -p attn-runtime --example kernel_bench [-- --quick] [--rows]
//! cargo run --release -p attn-runtime --example kernel_bench --features bench-gemm [-- --quick]
//! ```
//!
//! With `bench-gemm`, each shape is also run through the `gemm` crate (faer's products, which
//! dispatch to AVX2, AVX-512 or NEON at run time), one thread, on the same data.
//!
//! The peak comes from a loop of independent FMAs (12 chains, enough to cover latency on two
//! ports). Each shape reports the median of many short (~1 ms) timed batches on one thread,
//! and the median ratio to the peak loop timed right after each batch. The machine is
//! shared: batches shorter than a scheduler time slice are mostly not preempted, so their
//! median measures the kernel rather than the share of the CPU it got, and a peak taken next
//! to each batch sees the same clock.

use attn_runtime::kernels::{
    Gemm, Isa, KernelError, Layout, PEAK_RUNS, available_isas, exp_sum, peak_gflops, peak_run, sgemm_nn, sgemm_nt, softmax_step,
};
use std::hint::black_box;
use std::time::Instant;

/// Calls per batch so that one batch of `f` lasts about `batch_s`.
fn calibrate(batch_s: f64, f: &mut impl FnMut()) -> usize {
    f();
    let start = Instant::now();
    f();
    let once = start.elapsed().as_secs_f64().max(1e-9);
    ((batch_s / once) as usize).clamp(1, 1_000_000)
}

/// Seconds per call over one batch of `reps` calls.
fn batch(reps: usize, f: &mut impl FnMut()) -> f64 {
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    t.elapsed().as_secs_f64() / reps as f64
}

/// Median of a sample.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The path whose peak percentages refer to: the widest this CPU runs.
fn reference_isa() -> Isa {
    available_isas().last().copied().unwrap_or(Isa::Portable)
}

/// Median GFLOP/s of `f` (doing `flops` per call) and its median ratio to the FMA peak
/// measured right after each batch, so both see the same load on this shared machine.
fn measure(batches: usize, flops: f64, mut f: impl FnMut()) -> (f64, Option<f64>) {
    let reps = calibrate(0.001, &mut f);
    let mut rates = Vec::new();
    let mut ratios = Vec::new();
    for _ in 0..batches {
        let rate = flops / batch(reps, &mut f) / 1e9;
        rates.push(rate);
        ratios.push(rate / peak_run(reference_isa()));
    }
    let ratio = Some(median(ratios));
    (median(rates), ratio)
}

/// GFLOP/s of one product shape on `isa`, and its fraction of the peak.
fn gemm_rate(isa: Isa, layout: Layout, (m, n, k): (usize, usize, usize), batches: usize) -> Result<(f64, Option<f64>), KernelError> {
    let mut g = Gemm::dense(layout, m, n, k);
    g.isa = isa;
    let a: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01 - 0.08).collect();
    let b: Vec<f32> = (0..n * k).map(|i| (i % 13) as f32 * 0.01 - 0.06).collect();
    let mut c = vec![0.0f32; m * n];
    let run = match layout {
        Layout::Nt => sgemm_nt,
        Layout::Nn => sgemm_nn,
    };
    run(&g, &a, &b, &mut c)?;
    Ok(measure(batches, 2.0 * (m * n * k) as f64, || {
        let _ = run(&g, black_box(&a), black_box(&b), black_box(&mut c));
    }))
}

/// GFLOP/s of one product shape through the `gemm` crate, and its fraction of the peak.
#[cfg(feature = "bench-gemm")]
fn gemm_crate_rate(layout: Layout, (m, n, k): (usize, usize, usize), batches: usize) -> (f64, Option<f64>) {
    let a: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01 - 0.08).collect();
    let b: Vec<f32> = (0..n * k).map(|i| (i % 13) as f32 * 0.01 - 0.06).collect();
    let mut c = vec![0.0f32; m * n];
    // Row-major C and A; B is k × n row-major for Nn, n × k row-major (so column stride k) for Nt.
    let (rhs_cs, rhs_rs) = match layout {
        Layout::Nn => (1, n as isize),
        Layout::Nt => (k as isize, 1),
    };
    measure(batches, 2.0 * (m * n * k) as f64, || {
        // SAFETY: every stride stays inside the three buffers for these shapes.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                black_box(c.as_mut_ptr()),
                1,
                n as isize,
                false,
                black_box(a.as_ptr()),
                1,
                k as isize,
                black_box(b.as_ptr()),
                rhs_cs,
                rhs_rs,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        }
    })
}

fn main() -> Result<(), KernelError> {
    let quick = std::env::args().any(|a| a == "--quick");
    // `--rows`: only the row kernels (softmax), not the products.
    let rows_only = std::env::args().any(|a| a == "--rows");
    let batches = if quick { 11 } else { 41 };
    let isas = available_isas();
    println!("dispatched path: {}", attn_runtime::kernels::isa());
    for isa in &isas {
        if let Some(best) = peak_gflops(*isa) {
            let kind = if *isa == Isa::Portable { "multiply-add, baseline target" } else { "FMA" };
            println!("peak {isa:>8}: {best:6.1} GFLOP/s (one core, {kind}, best of {PEAK_RUNS} runs)");
        }
    }
    let shapes: &[(&str, Layout, usize, usize, usize)] = &[
        ("Q·Kᵀ", Layout::Nt, 64, 64, 64),
        ("Q·Kᵀ", Layout::Nt, 64, 64, 128),
        ("Q·Kᵀ", Layout::Nt, 128, 64, 128),
        ("Q·Kᵀ", Layout::Nt, 128, 128, 64),
        ("Q·Kᵀ", Layout::Nt, 128, 128, 128),
        ("P·V", Layout::Nn, 64, 64, 64),
        ("P·V", Layout::Nn, 64, 128, 128),
        ("P·V", Layout::Nn, 128, 64, 256),
        ("P·V", Layout::Nn, 128, 128, 128),
        ("P·V", Layout::Nn, 128, 128, 1024),
        ("proj", Layout::Nn, 1024, 512, 512),
        ("proj", Layout::Nt, 1024, 512, 512),
    ];
    let peak_name = reference_isa().name();
    println!("\nmedians of {batches} batches; %peak: ratio to the {peak_name} peak loop timed right after each batch");
    println!("{:<6} {:>2} {:>5} {:>5} {:>5}  {:>8}  {:>9}  {:>7}", "op", "", "m", "n", "k", "isa", "GFLOP/s", "%peak");
    for &(name, layout, m, n, k) in shapes.iter().filter(|_| !rows_only) {
        for isa in isas.iter().rev() {
            let (rate, ratio) = gemm_rate(*isa, layout, (m, n, k), batches)?;
            let pct = ratio.map(|r| format!("{:6.1}%", 100.0 * r)).unwrap_or_default();
            let tag = if layout == Layout::Nt { "NT" } else { "NN" };
            println!("{name:<6} {tag:>2} {m:>5} {n:>5} {k:>5}  {isa:>8}  {rate:9.1}  {pct:>7}");
        }
        #[cfg(feature = "bench-gemm")]
        {
            let (rate, ratio) = gemm_crate_rate(layout, (m, n, k), batches);
            let pct = ratio.map(|r| format!("{:6.1}%", 100.0 * r)).unwrap_or_default();
            let tag = if layout == Layout::Nt { "NT" } else { "NN" };
            println!("{name:<6} {tag:>2} {m:>5} {n:>5} {k:>5}  {:>8}  {rate:9.1}  {pct:>7}", "gemm");
        }
    }
    println!("\nexp_sum (row of 128 scores):");
    let x: Vec<f32> = (0..128).map(|i| -(i as f32) * 0.1).collect();
    let mut y = vec![0.0f32; 128];
    for isa in isas.iter().rev() {
        let (rate, _) = measure(batches, 128.0, || {
            let _ = black_box(exp_sum(*isa, black_box(&x), &mut y, 0.5));
        });
        println!("  {isa:>8}: {:6.2} ns/row, {rate:5.2} Gelem/s", 128.0 / rate);
    }
    // The flash kernel's step: a row of 256 scaled scores (one key block) against a running
    // max that stays put, so only the max pass and the bounded `exp` run.
    println!("\nsoftmax_step (row of 256 scores, running max kept):");
    let x: Vec<f32> = (0..256).map(|i| ((i * 37) % 101) as f32 * 0.05 - 2.0).collect();
    let mut y = vec![0.0f32; 256];
    for isa in isas.iter().rev() {
        let (rate, _) = measure(batches, 256.0, || {
            let mut state = (3.0f32, 1.0f32);
            let _ = black_box(softmax_step(*isa, black_box(&x), 0.125, None, &mut y, &mut state));
        });
        println!("  {isa:>8}: {:6.2} ns/row, {rate:5.2} Gelem/s", 256.0 / rate);
    }
    Ok(())
}
