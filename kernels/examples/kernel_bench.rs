//! Throughput of the dense microkernels on every instruction-set path this CPU runs, against
//! the measured FMA peak. A benchmark, not a test:
//!
//! ```text
//! cargo run --release -p attn-kernels --example kernel_bench [-- --quick] [--rows]
//! cargo run --release -p attn-kernels --example kernel_bench -- --flash-bwd-row [--quick]
//! cargo run --release -p attn-kernels --example kernel_bench --features bench-gemm [-- --quick]
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
//!
//! `--flash-bwd-row` times the flash backward's row kernel on the dispatched path only (it has
//! only a C ABI entry point, which dispatches by `ATTNC_ISA`); `--rows` runs it once per path
//! in a child process of this binary with `ATTNC_ISA` set.

use attn_kernels::{
    Gemm, Isa, KernelError, Layout, PEAK_RUNS, additive_nt, attnc_flash_bwd_row, available_isas, exp_sum, gelu, peak_gflops, peak_run,
    sgemm_nn, sgemm_nt, sigmoid, softmax_row, softmax_step, tanh,
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

/// One SSE2 loop in assembly, timed (best of 5 runs of 20 M iterations of 96 flops), printed
/// under `$name`.
#[cfg(target_arch = "x86_64")]
macro_rules! variant {
    ($name:expr, $($body:literal),* $(,)?) => {{
        let buf = vec![1.0f32; 1024];
        let p = buf.as_ptr();
        let iters: u64 = 20_000_000;
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            // SAFETY: the loop reads `buf` (4 KiB) and writes only the registers it lists.
            unsafe {
                std::arch::asm!(
                    "xorps xmm0, xmm0", "xorps xmm1, xmm1", "xorps xmm2, xmm2", "xorps xmm3, xmm3",
                    "xorps xmm4, xmm4", "xorps xmm5, xmm5", "xorps xmm6, xmm6", "xorps xmm7, xmm7",
                    "xorps xmm8, xmm8", "xorps xmm9, xmm9", "xorps xmm10, xmm10", "xorps xmm11, xmm11",
                    "movups xmm12, [{p}]", "movups xmm13, [{p}+16]",
                    "2:",
                    $($body,)*
                    "dec {n}",
                    "jnz 2b",
                    p = in(reg) p, n = inout(reg) iters => _,
                    out("xmm0") _, out("xmm1") _, out("xmm2") _, out("xmm3") _, out("xmm4") _, out("xmm5") _,
                    out("xmm6") _, out("xmm7") _, out("xmm8") _, out("xmm9") _, out("xmm10") _, out("xmm11") _,
                    out("xmm12") _, out("xmm13") _, out("xmm14") _, out("xmm15") _,
                    options(nostack, readonly),
                );
            }
            best = best.min(t.elapsed().as_secs_f64() / iters as f64);
        }
        println!("  {:<44} {:6.1} GFLOP/s", $name, 96.0 / best * 1e-9);
    }};
}

/// The portable path's 6 × 8 SSE2 micro-tile loop, written in assembly in four forms (96
/// flops per iteration, 12 accumulators, L1-resident operands): as LLVM compiled the lane
/// form of the micro-tile (2 panel loads, 6 splat loads, 6 register copies, 12 `mulps`, 12
/// `addps`), with a load per product instead of the copies (the form `f4::micro` now
/// compiles to), with VEX three-operand forms, and with no loads at all. GFLOP/s, best of 5 runs of 20 M iterations: what the baseline x86-64 target
/// can reach with this shape.
#[cfg(target_arch = "x86_64")]
fn sse_ceiling() {
    println!("\nSSE2 6 × 8 micro-tile loop (assembly):");
    sse_lane_form();
    sse_load_per_product();
    sse_no_loads();
}

/// The lane form of the micro-tile as LLVM compiled it: 8 loads and 6 register copies.
#[cfg(target_arch = "x86_64")]
fn sse_lane_form() {
    variant!(
        "lane form (8 loads, 6 copies)",
        "movups xmm13, [{p}]",
        "movups xmm12, [{p}+16]",
        "movups xmm14, [{p}+64]",
        "movaps xmm15, xmm13",
        "mulps xmm15, xmm14",
        "addps xmm0, xmm15",
        "mulps xmm14, xmm12",
        "addps xmm1, xmm14",
        "movups xmm14, [{p}+80]",
        "movaps xmm15, xmm13",
        "mulps xmm15, xmm14",
        "addps xmm2, xmm15",
        "mulps xmm14, xmm12",
        "addps xmm3, xmm14",
        "movups xmm14, [{p}+96]",
        "movaps xmm15, xmm13",
        "mulps xmm15, xmm14",
        "addps xmm4, xmm15",
        "mulps xmm14, xmm12",
        "addps xmm5, xmm14",
        "movups xmm14, [{p}+112]",
        "movaps xmm15, xmm13",
        "mulps xmm15, xmm14",
        "addps xmm6, xmm15",
        "mulps xmm14, xmm12",
        "addps xmm7, xmm14",
        "movups xmm14, [{p}+128]",
        "movaps xmm15, xmm13",
        "mulps xmm15, xmm14",
        "addps xmm8, xmm15",
        "mulps xmm14, xmm12",
        "addps xmm9, xmm14",
        "movups xmm14, [{p}+144]",
        "movaps xmm15, xmm13",
        "mulps xmm15, xmm14",
        "addps xmm10, xmm15",
        "mulps xmm14, xmm12",
        "addps xmm11, xmm14",
    );
}

/// A load per product instead of the copies (the form `f4::micro` compiles to).
#[cfg(target_arch = "x86_64")]
fn sse_load_per_product() {
    variant!(
        "a load per product (14 loads; f4::micro)",
        "movups xmm13, [{p}]",
        "movups xmm12, [{p}+16]",
        "movups xmm14, [{p}+64]",
        "mulps xmm14, xmm13",
        "addps xmm0, xmm14",
        "movups xmm15, [{p}+80]",
        "mulps xmm15, xmm12",
        "addps xmm1, xmm15",
        "movups xmm14, [{p}+96]",
        "mulps xmm14, xmm13",
        "addps xmm2, xmm14",
        "movups xmm15, [{p}+112]",
        "mulps xmm15, xmm12",
        "addps xmm3, xmm15",
        "movups xmm14, [{p}+128]",
        "mulps xmm14, xmm13",
        "addps xmm4, xmm14",
        "movups xmm15, [{p}+144]",
        "mulps xmm15, xmm12",
        "addps xmm5, xmm15",
        "movups xmm14, [{p}+160]",
        "mulps xmm14, xmm13",
        "addps xmm6, xmm14",
        "movups xmm15, [{p}+176]",
        "mulps xmm15, xmm12",
        "addps xmm7, xmm15",
        "movups xmm14, [{p}+192]",
        "mulps xmm14, xmm13",
        "addps xmm8, xmm14",
        "movups xmm15, [{p}+208]",
        "mulps xmm15, xmm12",
        "addps xmm9, xmm15",
        "movups xmm14, [{p}+224]",
        "mulps xmm14, xmm13",
        "addps xmm10, xmm14",
        "movups xmm15, [{p}+240]",
        "mulps xmm15, xmm12",
        "addps xmm11, xmm15",
    );
}

/// Register operands only: no loads at all.
#[cfg(target_arch = "x86_64")]
fn sse_no_loads() {
    variant!(
        "no loads (register operands only)",
        "movaps xmm14, xmm13",
        "movaps xmm15, xmm13",
        "mulps xmm15, xmm14",
        "addps xmm0, xmm15",
        "mulps xmm14, xmm12",
        "addps xmm1, xmm14",
        "movaps xmm14, xmm13",
        "movaps xmm15, xmm13",
        "mulps xmm15, xmm14",
        "addps xmm2, xmm15",
        "mulps xmm14, xmm12",
        "addps xmm3, xmm14",
        "movaps xmm14, xmm13",
        "movaps xmm15, xmm13",
        "mulps xmm15, xmm14",
        "addps xmm4, xmm15",
        "mulps xmm14, xmm12",
        "addps xmm5, xmm14",
        "movaps xmm14, xmm13",
        "movaps xmm15, xmm13",
        "mulps xmm15, xmm14",
        "addps xmm6, xmm15",
        "mulps xmm14, xmm12",
        "addps xmm7, xmm14",
        "movaps xmm14, xmm13",
        "movaps xmm15, xmm13",
        "mulps xmm15, xmm14",
        "addps xmm8, xmm15",
        "mulps xmm14, xmm12",
        "addps xmm9, xmm14",
        "movaps xmm14, xmm13",
        "movaps xmm15, xmm13",
        "mulps xmm15, xmm14",
        "addps xmm10, xmm15",
        "mulps xmm14, xmm12",
        "addps xmm11, xmm14",
    );
}

/// The flash backward's row kernel (`attnc_flash_bwd_row`) on the dispatched path, a row of 250
/// queries (a tail on every path) with the column weights' sums: softmax weights, softmax of
/// `tanh`-capped scores, and sigmoid weights.
fn flash_bwd_rows(batches: usize) {
    const N: usize = 250;
    let isa = attn_kernels::isa();
    let s0: Vec<f32> = (0..N).map(|i| ((i * 37) % 101) as f32 * 0.08 - 4.0).collect();
    let dp0: Vec<f32> = (0..N).map(|i| ((i * 53) % 97) as f32 * 0.01 - 0.5).collect();
    let lse: Vec<f32> = (0..N).map(|i| ((i * 29) % 31) as f32 * 0.1 + 1.0).collect();
    let delta: Vec<f32> = (0..N).map(|i| ((i * 17) % 23) as f32 * 0.02 - 0.2).collect();
    let rbias: Vec<f32> = (0..N).map(|i| ((i * 11) % 13) as f32 * 0.05 - 0.3).collect();
    let w: Vec<f32> = (0..N).map(|i| ((i * 7) % 19) as f32 * 0.03 - 0.25).collect();
    let (mut s, mut dp, mut df, mut sums) = (s0.clone(), dp0.clone(), vec![0.0f32; N], [0.0f32; 2]);
    for (name, flags) in [("softmax", 0u32), ("tanh", 1), ("sigmoid", 2)] {
        let (rate, _) = measure(batches, N as f64, || {
            // Each call overwrites `s` and `dp`: restore them so every call sees the same row.
            s.copy_from_slice(&s0);
            dp.copy_from_slice(&dp0);
            // SAFETY: every row holds `N` floats and `sums` two.
            unsafe {
                attnc_flash_bwd_row(
                    black_box(s.as_mut_ptr()),
                    dp.as_mut_ptr(),
                    lse.as_ptr(),
                    delta.as_ptr(),
                    rbias.as_ptr(),
                    N,
                    0.3,
                    1.5,
                    -0.25,
                    flags,
                    df.as_mut_ptr(),
                    w.as_ptr(),
                    sums.as_mut_ptr(),
                )
            };
            black_box(&sums);
        });
        println!("  {isa:>8} {name:<8}: {:7.1} ns/row, {rate:5.2} Gelem/s", N as f64 / rate);
    }
}

/// Dropout on a 64 × 64 tile of weights, both orientations (the forward's query rows, the
/// backward's key rows), on every path this machine runs: nanoseconds per weight.
fn dropout_tiles(isas: &[Isa], batches: usize) -> Result<(), KernelError> {
    let mut p = vec![0.5f32; 64 * 64];
    for isa in isas {
        for keys_on_rows in [false, true] {
            let mut r0 = 0u32;
            let (rate, _) = measure(batches, 4096.0, || {
                r0 = r0.wrapping_add(64);
                let t = attn_kernels::DropoutTile { r0, c0: 128, keys_on_rows, seed: 3, batch: 1, threshold: 1 << 22, scale: 1.25 };
                let _ = attn_kernels::dropout_tile(*isa, black_box(&mut p), 64, (64, 64), t);
            });
            let what = if keys_on_rows { "key rows" } else { "query rows" };
            println!("  dropout {isa:>8} {what:<10}: {:5.2} ns/weight", 1.0 / rate);
        }
    }
    Ok(())
}

fn main() -> Result<(), KernelError> {
    let quick = std::env::args().any(|a| a == "--quick");
    if std::env::args().any(|a| a == "--dropout") {
        return dropout_tiles(&available_isas(), if quick { 11 } else { 41 });
    }
    if std::env::args().any(|a| a == "--flash-bwd-row") {
        flash_bwd_rows(if quick { 11 } else { 41 });
        return Ok(());
    }
    // `--sse-ceiling`: only the assembly forms of the portable micro-tile loop.
    #[cfg(target_arch = "x86_64")]
    if std::env::args().any(|a| a == "--sse-ceiling") {
        sse_ceiling();
        if let Some(best) = peak_gflops(Isa::Avx2) {
            println!("  (AVX2 FMA peak: {best:.1} GFLOP/s, best of {PEAK_RUNS} runs)");
        }
        return Ok(());
    }
    // `--rows`: only the row kernels (softmax), not the products.
    let rows_only = std::env::args().any(|a| a == "--rows");
    let batches = if quick { 11 } else { 41 };
    let isas = available_isas();
    println!("dispatched path: {}", attn_kernels::isa());
    for isa in &isas {
        if let Some(best) = peak_gflops(*isa) {
            let kind = if *isa == Isa::Portable { "multiply-add, baseline target" } else { "FMA" };
            println!("peak {isa:>8}: {best:6.1} GFLOP/s (one core, {kind}, best of {PEAK_RUNS} runs)");
        }
    }
    products(&isas, batches, rows_only)?;
    row_kernels(&isas, batches, quick)
}

/// The tile products on every path, against the peak loop timed after each batch (none with
/// `rows_only`, but the header).
fn products(isas: &[Isa], batches: usize, rows_only: bool) -> Result<(), KernelError> {
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
    Ok(())
}

/// Times `f`, a row kernel's call on a row of `elems` elements, on every path of `isas` (widest
/// first), and prints its time per row and elements per second.
fn row_rates(isas: &[Isa], batches: usize, elems: usize, mut f: impl FnMut(Isa)) {
    for isa in isas.iter().rev() {
        let (rate, _) = measure(batches, elems as f64, || f(*isa));
        println!("  {isa:>8}: {:7.2} ns/row, {rate:5.2} Gelem/s", elems as f64 / rate);
    }
}

/// The row kernels on every path: `exp_sum`, the online-softmax step, whole-row softmax, GELU,
/// `tanh` and sigmoid rows, additive score tiles, and the flash backward's row (in child
/// processes).
fn row_kernels(isas: &[Isa], batches: usize, quick: bool) -> Result<(), KernelError> {
    println!("\nexp_sum (row of 128 scores):");
    let x: Vec<f32> = (0..128).map(|i| -(i as f32) * 0.1).collect();
    let mut y = vec![0.0f32; 128];
    row_rates(isas, batches, 128, |isa| {
        let _ = black_box(exp_sum(isa, black_box(&x), &mut y, 0.5));
    });
    // The flash kernel's step: a row of 256 scaled scores (one key block) against a running
    // max that stays put, so the step's one pass runs (the bounded `exp`, the slack checked
    // per vector).
    println!("\nsoftmax_step (row of 256 scores, running max kept):");
    let x: Vec<f32> = (0..256).map(|i| ((i * 37) % 101) as f32 * 0.05 - 2.0).collect();
    let mut y = vec![0.0f32; 256];
    row_rates(isas, batches, 256, |isa| {
        let mut state = (3.0f32, 1.0f32);
        let _ = black_box(softmax_step(isa, black_box(&x), 0.125, None, &mut y, &mut state));
    });
    // A whole-row softmax (the row's max, then `exp` and the sum, then the scaling), a row of
    // 1000 scores.
    println!("\nsoftmax_row (row of 1000):");
    let x: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 * 0.08 - 4.0).collect();
    let mut y = vec![0.0f32; 1000];
    row_rates(isas, batches, 1000, |isa| {
        let _ = black_box(softmax_row(isa, black_box(&x), &mut y));
    });
    // The element-wise row kernels: GELU (unfused MLPs), staged `tanh` (soft-capping) and
    // sigmoid, over a row of 1000 (not a multiple of any vector width: the tail counts).
    let x: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 * 0.08 - 4.0).collect();
    let mut y = vec![0.0f32; 1000];
    type RowKernel = fn(Isa, &[f32], &mut [f32]) -> Result<(), KernelError>;
    for (name, f) in [("gelu", gelu as RowKernel), ("tanh", tanh), ("sigmoid", sigmoid)] {
        println!("\n{name} (row of 1000):");
        row_rates(isas, batches, 1000, |isa| {
            let _ = black_box(f(isa, black_box(&x), &mut y));
        });
    }
    // Additive scores of one flash tile, 64 queries × 64 keys × 64 features: the narrow form
    // (inputs within ±20) and the wide one (inputs up to ±30).
    for (form, spread) in [("narrow", 2.0f32), ("wide", 30.0)] {
        let (m, n, k) = (64, 64, 64);
        println!("\nadditive_nt {m}×{n}×{k}, {form} form:");
        let q: Vec<f32> = (0..m * k).map(|i| (((i * 37) % 101) as f32 / 50.0 - 1.0) * spread).collect();
        let kk: Vec<f32> = (0..n * k).map(|i| (((i * 53) % 97) as f32 / 48.0 - 1.0) * spread).collect();
        let w: Vec<f32> = (0..k).map(|i| ((i * 7) % 19) as f32 * 0.03 - 0.25).collect();
        let mut c = vec![0.0f32; m * n];
        let terms = (m * n * k) as f64;
        for isa in isas.iter().rev() {
            let (rate, _) = measure(batches, terms, || {
                let _ = black_box(additive_nt(*isa, (m, n, k), black_box(&q), black_box(&kk), &mut c, 0.5, &w));
            });
            println!("  {isa:>8}: {:7.2} µs/tile, {rate:5.2} Gterm/s", terms / rate * 1e-3);
        }
    }
    // The flash backward's row kernel, once per path in a child process (see the module docs).
    println!("\nflash_bwd_row (row of 250):");
    let exe = std::env::current_exe();
    for isa in isas.iter().rev() {
        let out = exe.as_ref().map_err(|e| e.to_string()).and_then(|exe| {
            let mut cmd = std::process::Command::new(exe);
            cmd.arg("--flash-bwd-row").env("ATTNC_ISA", isa.name());
            if quick {
                cmd.arg("--quick");
            }
            cmd.output().map_err(|e| e.to_string())
        });
        match out {
            Ok(out) => print!("{}", String::from_utf8_lossy(&out.stdout)),
            Err(e) => println!("  {isa:>8}: could not run the child process: {e}"),
        }
    }
    Ok(())
}
