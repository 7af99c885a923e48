//! `attnc bench`: time an entry point on seeded random inputs (or given ones) and report the median time,
//! useful GFLOP/s and the fraction of this machine's FMA peak.
//!
//! Useful FLOPs count the dense products the program needs: `2·M·N·D + 2·M·N·Dv` per batch
//! index for each attention (flash) op, scaled by the fraction of score tiles its mask keeps
//! (full tiles count whole, partially masked tiles half: about half for causal), plus
//! `2·M·N·K` per matrix product. The peak is that of the kernels' instruction-set path
//! ([`attn_runtime::kernels::peak_gflops`]: fused multiply-adds for AVX-512 and AVX2, the
//! baseline multiply-add for the portable path), measured on every thread at once (or given
//! with `--peak`); the report names the CPU model and the path.

use super::{Exit, Failure, load, print_line};
use attn_compiler::ir::{FlashWrt, Graph, Op, tile_census};
use attn_runtime::cpu::{CpuOptions, TensorRef, default_threads};
use attn_runtime::{RunOptions, Target, Tensor};
use clap::Args;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// `attnc bench FILE [options]`
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The .attn program.
    pub file: PathBuf,
    /// The function to time (default: the last one in the file).
    #[arg(long, value_name = "NAME")]
    pub entry: Option<String>,
    /// Time on these inputs instead of random ones: NAME=PATH (.npy or .safetensors), or
    /// PATH.safetensors for every tensor named like a parameter; the parameters none gives are
    /// random. (Most programs take the same time on any values; additive attention's score
    /// kernel picks its form from the magnitudes.) Repeatable.
    #[arg(long = "input", value_name = "[NAME=]PATH", value_parser = super::run::parse_named_path)]
    pub inputs: Vec<super::run::NamedPath>,
    /// The size of a dim (unset dims are 8). Repeatable.
    #[arg(long = "dim", value_name = "NAME=N", value_parser = super::run::parse_dim)]
    pub dims: Vec<(String, i64)>,
    /// Threads for the cpu target: 1 to 4096, or 0 for one per available core.
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = super::run::parse_threads)]
    pub threads: usize,
    /// Where to run: cpu, cuda (an NVIDIA GPU), or interp (slow, for reference).
    #[arg(long, default_value = "cpu", value_name = "TARGET")]
    pub target: String,
    /// Timed runs, at least 1 (the median is reported).
    #[arg(long, default_value_t = 10, value_name = "N", value_parser = parse_iters)]
    pub iters: usize,
    /// Untimed runs first.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub warmup: usize,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub seed: u64,
    /// The peak in GFLOP/s for the thread count (default: measured on the kernels' ISA path).
    #[arg(long, value_name = "GFLOPS")]
    pub peak: Option<f64>,
    /// Also print one line of JSON (for scripts such as bench/compare.py).
    #[arg(long)]
    pub json: bool,
    /// Write the inputs as DIR/NAME.npy (so other frameworks can be timed on the same data).
    #[arg(long, value_name = "DIR")]
    pub save_inputs: Option<PathBuf>,
    /// Gradients (`--grad [--wrt a,b]`): time the forward and backward pass together.
    #[command(flatten)]
    pub grad: super::GradArgs,
}

/// Runs `attnc bench`.
pub fn bench(args: &BenchArgs, ui: super::Ui) -> Result<(), Failure> {
    let target: Target = args.target.parse().map_err(|e| Failure::new(Exit::Target, e))?;
    let (program, entry) = args.grad.apply(load(&args.file, ui)?, args.entry.as_deref())?;
    let entry = match &entry {
        Some(name) => program.entry(name).map_err(|e| Failure::new(Exit::Usage, e))?,
        None => program.default_entry().ok_or_else(|| Failure::new(Exit::Program, "the program defines no function"))?,
    };
    let given = super::run::given_dims(&args.dims)?;
    let (mut inputs, dims) = super::run::gather_inputs(&program, &entry, &args.inputs, Some(args.seed), given)?;
    // In parameter order, as the timed runs pass them.
    inputs.sort_by_key(|(name, _)| entry.params.iter().position(|(p, _)| p == name));
    if let Some(dir) = &args.save_inputs {
        std::fs::create_dir_all(dir).map_err(|e| Failure::new(Exit::File, format!("cannot create {}: {e}", dir.display())))?;
        for (name, tensor) in &inputs {
            attn_runtime::io::write_npy(&dir.join(format!("{name}.npy")), tensor).map_err(|e| Failure::new(Exit::File, e))?;
        }
    }
    let threads = if args.threads == 0 { default_threads() } else { args.threads };
    let tensors: Vec<Tensor> = inputs.iter().map(|(_, t)| t.clone()).collect();
    let Measured { times, graph, compile, stats } = measure(&program, &entry.name, target, args, threads, &inputs, &dims)?;
    let runtime = |e: &dyn std::fmt::Display| Failure::new(Exit::Runtime, e.to_string());
    let mut sorted = times.clone();
    sorted.sort();
    let median = sorted[sorted.len() / 2];
    let shapes: Vec<Vec<usize>> = tensors.iter().map(|t| t.shape.clone()).collect();
    let env = attn_compiler::exec::bind_dims(&graph, &shapes, &dims).map_err(|e| runtime(&e))?;
    let flops = useful_flops(&graph, &env);
    let gflops = flops / median.as_secs_f64() / 1e9;
    let isa = attn_runtime::kernels::isa();
    let peak = match args.peak {
        Some(p) => p,
        None => peak_gflops(isa, threads),
    };
    let mut dim_list: Vec<(&String, &i64)> = dims.iter().collect();
    dim_list.sort();
    let dim_text: Vec<String> = dim_list.iter().map(|(k, v)| format!("{k}={v}")).collect();
    print_line(&format!("{} `{}` on {} with {threads} thread(s), {}", args.file.display(), entry.name, target, dim_text.join(" ")));
    let cpu = attn_runtime::kernels::cpu_model();
    if target == Target::Cpu {
        print_line(&format!("  machine:  {cpu}, kernels on the {isa} path (widest here: {})", attn_runtime::kernels::widest()));
    }
    if let Some(c) = compile {
        print_line(&format!("  compile:  {:.2} ms (source graph to native code)", ms(c)));
    }
    print_line(&format!("  median:   {:.3} ms  (min {:.3} ms, {} runs)", ms(median), ms(sorted[0]), sorted.len()));
    print_line(&format!("  useful:   {:.3} GFLOP -> {:.1} GFLOP/s", flops / 1e9, gflops));
    let source = if args.peak.is_some() { "given".to_string() } else { format!("{isa} {}", peak_kind(isa)) };
    print_line(&format!("  peak:     {:.1} GFLOP/s ({source}) on {threads} thread(s) -> {:.1}% of peak", peak, 100.0 * gflops / peak));
    let widest = attn_runtime::kernels::widest();
    if args.peak.is_none() && widest != isa {
        let wide = peak_gflops(widest, threads);
        print_line(&format!(
            "            {:.1} GFLOP/s ({widest} {}) -> {:.1}% of this CPU's widest path",
            wide,
            peak_kind(widest),
            100.0 * gflops / wide
        ));
    }
    if let Some(s) = &stats {
        print_line(&format!(
            "  memory:   {:.2} MiB intermediates ({} buffers, largest {:.2} MiB), {:.1} KiB scratch per thread, {:.1} KiB tile tables",
            s.arena_bytes as f64 / 1048576.0,
            s.temps,
            s.largest_temp_bytes as f64 / 1048576.0,
            s.scratch_bytes_per_thread as f64 / 1024.0,
            s.tile_table_bytes as f64 / 1024.0
        ));
    }
    if args.json {
        let extra = stats.as_ref().map_or(0, |s| s.extra_bytes(threads));
        print_line(&format!(
            "json: {{\"entry\": \"{}\", \"cpu\": \"{}\", \"isa\": \"{isa}\", \"threads\": {threads}, \"median_ms\": {:.6}, \"min_ms\": {:.6}, \"gflop\": {:.6}, \"gflops\": {:.3}, \"peak_gflops\": {:.3}, \"compile_ms\": {:.3}, \"extra_bytes\": {extra}}}",
            entry.name,
            cpu.replace(['"', '\\'], ""),
            ms(median),
            ms(sorted[0]),
            flops / 1e9,
            gflops,
            peak,
            compile.map_or(0.0, ms),
        ));
    }
    Ok(())
}

/// What timing an entry gave.
struct Measured {
    /// The timed runs.
    times: Vec<Duration>,
    /// The graph that ran (optimised for the compiled targets), for counting useful FLOPs.
    graph: attn_compiler::ir::Graph,
    /// Source graph to native code (CPU).
    compile: Option<Duration>,
    /// What the run holds (CPU).
    stats: Option<attn_runtime::cpu::AllocStats>,
}

/// Times `entry` on `target`: `args.warmup` untimed runs, then `args.iters` timed ones.
fn measure(
    program: &attn_runtime::Program,
    entry: &str,
    target: Target,
    args: &BenchArgs,
    threads: usize,
    inputs: &[(String, Tensor)],
    dims: &HashMap<String, i64>,
) -> Result<Measured, Failure> {
    let iters = args.iters.max(1);
    let runtime = |e: &dyn std::fmt::Display| Failure::new(Exit::Runtime, e.to_string());
    let tensors: Vec<Tensor> = inputs.iter().map(|(_, t)| t.clone()).collect();
    let timed = |run: &mut dyn FnMut() -> Result<(), Failure>| -> Result<Vec<Duration>, Failure> {
        let mut times = Vec::with_capacity(iters);
        for n in 0..args.warmup + iters {
            let start = Instant::now();
            run()?;
            if n >= args.warmup {
                times.push(start.elapsed());
            }
        }
        Ok(times)
    };
    match target {
        Target::Cpu => {
            let compiled = program.compile_cpu(entry, &CpuOptions { threads }).map_err(|e| runtime(&e))?;
            let refs: Vec<TensorRef> = tensors.iter().map(TensorRef::of).collect();
            let times = timed(&mut || compiled.run(&refs, dims).map(|_| ()).map_err(|e| runtime(&e)))?;
            Ok(Measured { times, graph: compiled.graph().clone(), compile: Some(compiled.compile_time()), stats: compiled.alloc_stats() })
        }
        Target::Cuda => {
            // Kernel time only (CUDA events around the launches; inputs stay on the device), on
            // the optimised graph so that useful FLOPs count what the mask skips.
            let source = program.graph(entry).map_err(|e| runtime(&e))?;
            let unavailable = |e: attn_runtime::cuda::CudaError| match e {
                attn_runtime::cuda::CudaError::Unavailable(_) => Failure::new(Exit::Target, e),
                e => runtime(&e),
            };
            let (millis, _) = attn_runtime::cuda::bench(source, &tensors, dims, args.warmup, iters).map_err(unavailable)?;
            let times = millis.iter().map(|t| Duration::from_secs_f64(t / 1e3)).collect();
            let graph = attn_compiler::Compiler::for_target(attn_compiler::schedule::Target::Cuda).optimize(source).graph;
            Ok(Measured { times, graph, compile: None, stats: None })
        }
        _ => {
            let opts = RunOptions { dims: dims.clone(), target };
            let times = timed(&mut || program.run(entry, inputs.to_vec(), &opts).map(|_| ()).map_err(|e| runtime(&e)))?;
            let graph = program.graph(entry).map_err(|e| runtime(&e))?.clone();
            Ok(Measured { times, graph, compile: None, stats: None })
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Useful FLOPs of one run of `graph` under the dims `env`.
pub fn useful_flops(graph: &Graph, env: &HashMap<String, i64>) -> f64 {
    let size = |d: &attn_compiler::ir::Dim| d.eval(env).unwrap_or(0) as f64;
    let mut total = 0.0;
    // The operand lists of flash backward groups already counted.
    let mut counted: Vec<Vec<attn_compiler::ir::Value>> = Vec::new();
    for v in graph.values() {
        let node = graph.node(v);
        let args = graph.operands(v);
        match &node.op {
            Op::MatMul => {
                let a = &graph.node(args[0]).ty.shape;
                let out = &node.ty.shape;
                let r = out.len();
                let batch: f64 = out[..r - 2].iter().map(size).product();
                total += 2.0 * batch * size(&out[r - 2]) * size(&out[r - 1]) * size(&a[a.len() - 1]);
            }
            // Attention: the products of the scores it keeps. Forward: Q·Kᵀ and P·V. Backward
            // (one group of flash_grad nodes per flash op): the recomputed Q·Kᵀ and dO·Vᵀ once,
            // then dQ = dS·K, dK = dSᵀ·Q and dV = Pᵀ·dO for the gradients asked for.
            Op::Flash(spec) | Op::FlashGrad { spec, .. } => {
                let (q, k, vv) = (&graph.node(args[0]).ty.shape, &graph.node(args[1]).ty.shape, &graph.node(args[2]).ty.shape);
                let r = q.len();
                let batch_sizes: Vec<i64> = q[..r - 2].iter().map(|d| d.eval(env).unwrap_or(0)).collect();
                let batch: f64 = batch_sizes.iter().map(|b| *b as f64).product();
                let (m, n, d, dv) = (size(&q[r - 2]), size(&k[r - 2]), size(&q[r - 1]), size(&vv[r - 1]));
                // An additive score is four operations per width element (add, tanh, multiply,
                // add) where a dot product is two.
                let d = if spec.pair == attn_compiler::ir::Pair::Dot { d } else { 2.0 * d };
                let width = match &node.op {
                    Op::FlashGrad { wrt, .. } => {
                        let first = !counted.contains(&args);
                        if first {
                            counted.push(args.clone());
                        }
                        let own = match wrt {
                            FlashWrt::Q | FlashWrt::K => d,
                            FlashWrt::V => dv,
                            FlashWrt::Extra(_) => 0.0,
                        };
                        own + if first { d + dv } else { 0.0 }
                    }
                    _ => d + dv,
                };
                let kept = match &spec.mask {
                    None => 1.0,
                    Some(mask) => {
                        let [skip, full, partial] = tile_census(Some(mask), &batch_sizes, (m as i64, n as i64), (64, 64), env);
                        let all = (skip + full + partial).max(1) as f64;
                        (full as f64 + 0.5 * partial as f64) / all
                    }
                };
                total += 2.0 * batch * m * n * width * kept;
            }
            _ => {}
        }
    }
    total
}

/// Parses `--iters`: a count of at least 1.
fn parse_iters(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("at least one timed run is needed".to_string()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{s}` is not a count")),
    }
}

/// What a path's peak loop measures.
fn peak_kind(isa: attn_runtime::kernels::Isa) -> &'static str {
    if isa == attn_runtime::kernels::Isa::Portable { "multiply-add on the baseline target" } else { "FMA" }
}

/// The peak of `threads` threads running `isa`'s loop at once, in GFLOP/s: each thread's best
/// of [`attn_runtime::kernels::PEAK_RUNS`] short runs, summed.
pub fn peak_gflops(isa: attn_runtime::kernels::Isa, threads: usize) -> f64 {
    let per_thread: Vec<f64> = std::thread::scope(|s| {
        let handles: Vec<_> =
            (0..threads.max(1)).map(|_| s.spawn(move || attn_runtime::kernels::peak_gflops(isa).unwrap_or(0.0))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0.0)).collect()
    });
    per_thread.iter().sum()
}
