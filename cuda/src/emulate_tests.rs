//! The emitted kernels executed on the host ([`super::emulate`]) against the interpreter: every
//! example as written and optimised at odd sizes, and the f16/bf16 tensor-core, sigmoid, GQA
//! and split-KV decode flash kernels of [`super::tests::FLASH_GRAPHS`] at several head widths.
//! Skips (printing why) without a host C++20 compiler, except under `CI=true`.

use super::emulate::{
    Device, compiler_or_skip, deterministic_device_graph, device_graph, emulate_edited, emulate_schedule, emulate_schedule_with,
};
use super::tests::{EVERY_OP, FLASH_GRAPHS, examples, flash_graphs};
use crate::render::render;
use attn_compiler::exec::bind_dims;
use attn_compiler::interp::run as interp_run;
use attn_compiler::ir::{DType, Graph};
use attn_compiler::random::random_inputs;
use attn_compiler::schedule::Schedule;
use attn_compiler::tensor::Tensor;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// Odd sizes for the dims the examples use (not multiples of any tile), 8 for the rest.
const EMULATED_SIZES: &[(&str, i64)] =
    &[("B", 2), ("H", 3), ("S", 37), ("T", 70), ("M", 19), ("N", 29), ("D", 24), ("Dv", 20), ("Dh", 6), ("G", 2), ("R", 2)];

fn sizes(graph: &Graph, over: &[(&str, i64)]) -> HashMap<String, i64> {
    dims_with(graph, EMULATED_SIZES, over)
}

/// A size for every dim of `graph`'s parameters: `over`, else `base`, else 8. Shared with the
/// device tests, which use larger sizes.
pub(super) fn dims_with(graph: &Graph, base: &[(&str, i64)], over: &[(&str, i64)]) -> HashMap<String, i64> {
    let mut names = BTreeSet::new();
    for p in graph.params() {
        for d in &graph.node(*p).ty.shape {
            names.extend(d.symbols());
        }
    }
    names
        .into_iter()
        .map(|n| {
            let v = over.iter().chain(base).find(|(k, _)| *k == n).map_or(8, |(_, v)| *v);
            (n, v)
        })
        .collect()
}

/// Largest `|a - e| / max(|e|, floor)`, NaNs and infinities equal to themselves, a NaN against
/// a number an infinite error ([`attn_tests::max_rel_error`]).
pub(super) fn max_rel(actual: &Tensor, expected: &Tensor, floor: f64) -> f64 {
    attn_tests::max_rel_error(&actual.to_f64_vec(), &expected.to_f64_vec(), floor)
}

/// Seeded random inputs for `graph`'s parameters, and the interpreter's outputs on them.
pub(super) fn reference_run(graph: &Graph, env: &HashMap<String, i64>, seed: u64) -> Result<(Vec<Tensor>, Vec<Tensor>), String> {
    let inputs: Vec<Tensor> =
        random_inputs(&graph.param_types(), seed, env).map_err(|e| e.to_string())?.into_iter().map(|(_, t)| t).collect();
    let expected = interp_run(graph, &inputs, env).map_err(|e| format!("interpreter: {e}"))?;
    Ok((inputs, expected))
}

/// Runs `device`'s kernels on the host and the interpreter on `reference`; returns the largest
/// relative error over the outputs.
fn check(
    label: &str,
    reference: &Graph,
    device: Result<Schedule, String>,
    env: &HashMap<String, i64>,
    seed: u64,
    dir: &Path,
    defines: &[(String, i64)],
) -> Result<f64, String> {
    // The flash backward cases (labelled so): their extra operands' gradients bounded below.
    let backward = label.contains("(backward");
    let (inputs, expected) = reference_run(reference, env, seed)?;
    let shapes: Vec<Vec<usize>> = inputs.iter().map(|t| t.shape.clone()).collect();
    let env = bind_dims(reference, &shapes, env).map_err(|e| e.to_string())?;
    let got = emulate_schedule_with(&device, &inputs, &env, dir, defines).map_err(|e| format!("{label}: {e}"))?;
    let mut worst = 0.0f64;
    for ((got, exp), (name, _)) in got.iter().zip(&expected).zip(reference.outputs()) {
        // Relative per element, with a floor of a tenth of the tensor's largest magnitude (and
        // at least 1): an element that cancels to near zero carries the absolute rounding
        // error of its large terms (chained products at width 48 reach magnitudes of 100).
        // A flash backward's extra operands' gradients (ALiBi's slopes) are bounded by
        // max|diff| / max|ref|, as on the device: each element sums a term of every score, of
        // both signs, and with f16 operands the SIMT, mma.sync and wgmma kernels all land
        // 7.8e-2 from the f64 interpreter element-wise at width 64 (0.1 floor).
        let scale = exp.to_f64_vec().iter().filter(|x| x.is_finite()).fold(0.0f64, |m, x| m.max(x.abs()));
        let extra = backward && name.starts_with("d_") && !["d_q", "d_k", "d_v"].contains(&name.as_str());
        let floor = if extra { scale.max(1.0) } else { (0.1 * scale).max(1.0) };
        worst = worst.max(max_rel(got, exp, floor));
    }
    Ok(worst)
}

fn work_dir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("attnc-emu-{}-{name}", std::process::id()))
}

/// Runs jobs on two threads (the machine is shared); returns failures.
fn run_jobs(jobs: Vec<Box<dyn FnOnce() -> Result<(), String> + Send>>) -> Vec<String> {
    let queue = std::sync::Mutex::new(jobs);
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                loop {
                    let job = queue.lock().ok().and_then(|mut q| q.pop());
                    let Some(job) = job else { break };
                    if let Err(e) = job()
                        && let Ok(mut f) = failures.lock()
                    {
                        f.push(e);
                    }
                }
            });
        }
    });
    failures.into_inner().unwrap_or_default()
}

/// One emulated run checked against the interpreter: a graph (as written or compiled by the
/// pipeline) at its sizes (others from [`sizes`]) on seeded inputs, within a relative tolerance.
struct Case {
    label: String,
    graph: Graph,
    optimise: bool,
    sizes: Vec<(&'static str, i64)>,
    seed: u64,
    tol: f64,
    /// The work directory's name.
    dir: String,
    /// The tensor-core flash backward's deterministic mode instead of the atomic `dQ`.
    deterministic: bool,
    /// The kernels' Hopper paths (`ATTNC_WGMMA` 1: the emulated warpgroup products).
    wgmma: bool,
    /// With `wgmma`: the forward's unpipelined tile (`ATTNC_WG_SYNC`).
    wg_sync: bool,
    /// With `wgmma`: the forward's warp-specialised block where it runs (else one warpgroup).
    ws: bool,
    /// With `ws`: its TMA loads where the views allow (else its threads' `cp.async`).
    tma: bool,
    /// Without `tma`: the producer waits for each stage's copies before arriving
    /// (`ATTNC_WS_CP_WAIT`) instead of arriving as they land.
    cp_wait: bool,
}

/// Runs the cases on two threads; fails with every failure.
fn run_cases(cases: Vec<Case>) {
    let jobs: Vec<Box<dyn FnOnce() -> Result<(), String> + Send>> = cases
        .into_iter()
        .map(|c| {
            Box::new(move || {
                let wd = work_dir(&c.dir);
                let env = sizes(&c.graph, &c.sizes);
                let device = if c.optimise { Device::Compiled(&c.graph) } else { Device::AsWritten(&c.graph) };
                let schedule = if c.deterministic { deterministic_device_graph(device) } else { device_graph(device) };
                let mut defines = if c.wgmma { vec![("ATTNC_WGMMA".to_string(), 1)] } else { Vec::new() };
                if c.wg_sync {
                    defines.push(("ATTNC_WG_SYNC".to_string(), 1));
                }
                if c.wgmma && !c.ws {
                    defines.push(("ATTNC_CUDA_WS".to_string(), 0));
                }
                if !c.tma {
                    defines.push(("ATTNC_CUDA_TMA".to_string(), 0));
                }
                if c.cp_wait {
                    defines.push(("ATTNC_WS_CP_WAIT".to_string(), 1));
                }
                let err = check(&c.label, &c.graph, schedule, &env, c.seed, &wd, &defines)?;
                let _ = std::fs::remove_dir_all(&wd);
                if err > c.tol {
                    return Err(format!("{}: max relative error {err:e} > {:e}", c.label, c.tol));
                }
                eprintln!("{}: ok (max relative error {err:.1e})", c.label);
                Ok(())
            }) as Box<dyn FnOnce() -> Result<(), String> + Send>
        })
        .collect();
    let failures = run_jobs(jobs);
    assert!(failures.is_empty(), "{} failure(s):\n{}", failures.len(), failures.join("\n"));
}

/// A case per graph of `graphs` (label, graph, tolerance) and per head width `d` that
/// `widths(n, graph)` gives the n-th graph, with a tag for its work directory
/// (`{dir}{n}-{tag}`); each at `sizes(d)`, on inputs seeded `seed + n`, as written.
fn width_cases(
    graphs: Vec<(String, Graph, f64)>,
    dir: &str,
    seed: u64,
    widths: impl Fn(usize, &Graph) -> Vec<(usize, i64)>,
    sizes: impl Fn(i64) -> Vec<(&'static str, i64)>,
) -> Vec<Case> {
    let mut cases = Vec::new();
    for (n, (label, g, tol)) in graphs.into_iter().enumerate() {
        for (tag, d) in widths(n, &g) {
            let (label, dir) = (format!("{label} D={d}"), format!("{dir}{n}-{tag}"));
            cases.push(Case {
                label,
                graph: g.clone(),
                optimise: false,
                sizes: sizes(d),
                seed: seed + n as u64,
                tol,
                dir,
                deterministic: false,
                wgmma: false,
                wg_sync: false,
                tma: true,
                cp_wait: false,
                ws: true,
            });
        }
    }
    cases
}

#[test]
fn every_example_runs_emulated_like_the_interpreter() {
    if !compiler_or_skip("every_example_runs_emulated_like_the_interpreter").unwrap_or_else(|e| panic!("{e}")) {
        return;
    }
    let mut cases = Vec::new();
    for path in examples() {
        let stem = path.file_stem().unwrap().to_string_lossy().to_string();
        let compiled = attn_compiler::check(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for g in compiled.module.graphs {
            for optimise in [false, true] {
                let kind = if optimise { "opt" } else { "ir" };
                // f32 throughout; sums in a different order than the f64 reference.
                let (label, dir) = (format!("{stem}/{} ({kind})", g.name), format!("{stem}-{}-{kind}", g.name));
                cases.push(Case {
                    label,
                    graph: g.clone(),
                    optimise,
                    sizes: Vec::new(),
                    seed: 11,
                    tol: 1e-4,
                    dir,
                    deterministic: false,
                    wgmma: false,
                    wg_sync: false,
                    tma: true,
                    cp_wait: false,
                    ws: true,
                });
            }
        }
    }
    run_cases(cases);
}

#[test]
fn flash_kernels_run_emulated_like_the_interpreter() {
    if !compiler_or_skip("flash_kernels_run_emulated_like_the_interpreter").unwrap_or_else(|e| panic!("{e}")) {
        return;
    }
    let graphs = flash_graphs().into_iter().map(|(label, g, tol)| (label.to_string(), g, tol)).collect();
    // Head widths below, at and between the padded sizes (by default two, in turn), tagged by
    // their place in the list; 70 keys = 2 tiles and a ragged one.
    let widths = |n: usize, _: &Graph| attn_tests::matrix([24i64, 64, 100, 160].into_iter().enumerate(), |k| k % 2 == n % 2);
    let sizes = |d| vec![("D", d), ("E", d - 8), ("S", 70), ("T", 150), ("M", 67), ("N", 45)];
    run_cases(width_cases(graphs, "flash", 5, widths, sizes));
}

/// The tensor-core backward's Hopper path (`wgmma` at widths 64 and 128) on the emulated
/// warpgroup products, in both modes: the f16/bf16 backward cases, each at one of the widths
/// in turn (the forward's own Hopper path included), half of them deterministic.
#[test]
fn flash_backward_kernels_run_emulated_on_hoppers_warpgroup_products() {
    if !compiler_or_skip("flash_backward_kernels_run_emulated_on_hoppers_warpgroup_products").unwrap_or_else(|e| panic!("{e}")) {
        return;
    }
    let graphs: Vec<(String, Graph, f64)> = backward_cases()
        .into_iter()
        .filter(|(_, g, _)| g.node(g.params()[0]).ty.dtype != DType::F32)
        .map(|(label, g, tol)| (format!("{label} (wgmma)"), g, tol))
        .collect();
    let widths = |n: usize, _: &Graph| attn_tests::matrix([64i64, 128].into_iter().enumerate(), |k| k % 2 == n % 2);
    // 150 keys are three key blocks, one ragged; 67 query rows three half tiles and a ragged one.
    let sizes = |_| vec![("E", 16), ("S", 70), ("T", 150), ("M", 67), ("N", 150), ("R", 9)];
    let mut cases = width_cases(graphs, "flash-bwd-wgmma", 23, widths, |d| {
        let mut v = sizes(d);
        v.push(("D", d));
        v
    });
    for (n, c) in cases.iter_mut().enumerate() {
        c.wgmma = true;
        c.deterministic = (n / 2) % 2 == 1;
        if c.deterministic {
            c.label.push_str(" deterministic");
        }
    }
    run_cases(cases);
}

/// The tensor-core forward's Hopper path (`wgmma`, where widths are 64 or 128) on the emulated
/// warpgroup products: the f16/bf16 flash graphs, each at one of the two widths in turn.
#[test]
fn flash_kernels_run_emulated_on_hoppers_warpgroup_products() {
    if !compiler_or_skip("flash_kernels_run_emulated_on_hoppers_warpgroup_products").unwrap_or_else(|e| panic!("{e}")) {
        return;
    }
    let graphs: Vec<(String, Graph, f64)> = flash_graphs()
        .into_iter()
        .filter(|(_, g, _)| matches!(g.node(g.params()[0]).ty.dtype, attn_compiler::ir::DType::F16 | attn_compiler::ir::DType::BF16))
        .map(|(label, g, tol)| (format!("{label} (wgmma)"), g, tol))
        .collect();
    let sizes = |d| vec![("D", d), ("E", d - 8), ("S", 150), ("T", 150), ("M", 67), ("N", 45)];
    // The warp-specialised block at 5 key tiles: its ring of 3 stages wraps.
    let ws_sizes = |d| vec![("D", d), ("E", d - 8), ("S", 260), ("T", 260), ("M", 67), ("N", 260)];
    // Every graph on the warp-specialised block at one width, and at the other in one
    // warpgroup: in turn its pipelined tile (two K/V stages, pipelined m-tiles) and its
    // unpipelined one (one K/V stage's loop, products waited at once).
    let width =
        |flip: usize| move |n: usize, _: &Graph| attn_tests::matrix([64i64, 128].into_iter().enumerate(), |k| k % 2 == (n + flip) % 2);
    let mut cases = width_cases(graphs.clone(), "flash-wgmma-ws", 5, width(0), ws_sizes);
    // In turn with TMA loads, with the producer's `cp.async` copies arriving as they land, and
    // with its waiting for them (`ATTNC_WS_CP_WAIT`).
    for (n, c) in cases.iter_mut().enumerate() {
        c.wgmma = true;
        c.tma = n % 3 == 0;
        c.cp_wait = n % 3 == 2;
        c.label.push_str([" warp-specialised, TMA", " warp-specialised, cp.async", " warp-specialised, cp.async waited"][n % 3]);
        c.dir.push_str(["-tma", "-cp", "-cpw"][n % 3]);
    }
    let mut others = width_cases(graphs, "flash-wgmma", 5, width(1), sizes);
    for (n, c) in others.iter_mut().enumerate() {
        c.wgmma = true;
        c.ws = false;
        c.wg_sync = n % 2 == 1;
        c.label.push_str([" one warpgroup", " unpipelined"][n % 2]);
        c.dir.push_str(["-wg", "-sync"][n % 2]);
    }
    cases.extend(others);
    run_cases(cases);
}

/// The emulation holds Hopper's kernels to the rules of asynchronous warpgroup products and of
/// their barriers: the forward's pipelined tile with a wait taken out (m-tile 0's scores read
/// while in flight; the products of `O += P V` left running past the tile, over the next tile's
/// copies) fails, and so does the warp-specialised block without one of its waits (a consumer
/// that does not wait for its stage's copies, a producer that does not wait for the stage to be
/// free, a producer that arrives on a stage before its copies have landed, by TMA or by its
/// threads' copies) or without the hand-over of the consumers' turn (a deadlock), where the kernels as
/// emitted pass ([`flash_kernels_run_emulated_on_hoppers_warpgroup_products`]).
#[test]
fn wgmma_products_read_before_their_wait_fail_emulated() {
    if !compiler_or_skip("wgmma_products_read_before_their_wait_fail_emulated").unwrap_or_else(|e| panic!("{e}")) {
        return;
    }
    let Some((label, graph, tol)) = flash_graphs().into_iter().find(|(l, _, _)| *l == "f16 plain scaled scores") else {
        panic!("no f16 plain flash graph")
    };
    // 5 key tiles: the warp-specialised block's ring of 3 stages wraps.
    let env = sizes(&graph, &[("D", 64), ("S", 260), ("T", 260)]);
    let (inputs, expected) = reference_run(&graph, &env, 3).unwrap_or_else(|e| panic!("{e}"));
    let shapes: Vec<Vec<usize>> = inputs.iter().map(|t| t.shape.clone()).collect();
    let env = bind_dims(&graph, &shapes, &env).unwrap_or_else(|e| panic!("{e}"));
    let schedule = device_graph(Device::AsWritten(&graph));
    let source = render(schedule.as_ref().unwrap_or_else(|e| panic!("{e}"))).unwrap_or_else(|e| panic!("{e}")).source;
    let one_warpgroup = vec![("ATTNC_WGMMA".to_string(), 1), ("ATTNC_CUDA_WS".to_string(), 0)];
    let specialised = vec![("ATTNC_WGMMA".to_string(), 1)];
    let copies = vec![("ATTNC_WGMMA".to_string(), 1), ("ATTNC_CUDA_TMA".to_string(), 0)];
    // TMA copies landing at their issue: a producer that does not wait for a free stage shows.
    let early = vec![("ATTNC_WGMMA".to_string(), 1), ("ATTNC_EMU_TMA_EARLY".to_string(), 1)];
    // Each call commented out (its comment kept), or replaced: the producer's arrival on a
    // stage made at once instead of once its copies have landed.
    let out = |wait: &str| wait.replacen("attnc_", "// attnc_", 1);
    let broken = [
        ("attnc_wg_wait1();  // m-tile 0's scores", out("attnc_wg_wait1();  // m-tile 0's scores"), &one_warpgroup),
        ("attnc_wg_wait0();  // before V(kt)", out("attnc_wg_wait0();  // before V(kt)"), &one_warpgroup),
        ("attnc_mbar_wait(full_ + 8u * st_, ph_);", out("attnc_mbar_wait(full_ + 8u * st_, ph_);"), &specialised),
        ("attnc_mbar_wait(empty_ + 8u * st_, ph_ ^ 1u);", out("attnc_mbar_wait(empty_ + 8u * st_, ph_ ^ 1u);"), &early),
        ("attnc_mbar_wait(empty_ + 8u * st_, ph_ ^ 1u);", out("attnc_mbar_wait(empty_ + 8u * st_, ph_ ^ 1u);"), &copies),
        ("attnc_bar_arrive(2 - cw_, 256);", out("attnc_bar_arrive(2 - cw_, 256);"), &specialised),
        ("attnc_mbar_wait(full_ + 8u * st_, ph_);", out("attnc_mbar_wait(full_ + 8u * st_, ph_);"), &copies),
        ("if (vec_) attnc_cp_mbar_arrive(", "if (vec_) attnc_mbar_arrive(".to_string(), &copies),
        // TMA: the arrival on a stage made without expecting the copies' bytes.
        (
            "attnc_mbar_expect_tx(full_ + 8u * st_, 2u * (HD_ / 64) * BN_ * 128u);",
            "attnc_mbar_arrive(full_ + 8u * st_);".to_string(),
            &specialised,
        ),
    ];
    let jobs: Vec<Box<dyn FnOnce() -> Result<(), String> + Send>> = broken
        .into_iter()
        .enumerate()
        .map(|(n, (wait, without, defines))| {
            assert!(source.contains(wait), "the Hopper kernels have no `{wait}`");
            let (graph, schedule, inputs, expected, env, defines) =
                (graph.clone(), schedule.clone(), inputs.clone(), expected.clone(), env.clone(), defines.clone());
            Box::new(move || {
                let wd = work_dir(&format!("wg-broken-{n}"));
                let got = emulate_edited(&schedule, &inputs, &env, &wd, &defines, &|s| s.replace(wait, &without));
                let _ = std::fs::remove_dir_all(&wd);
                let _ = graph;
                match got {
                    Err(e) if e.contains("g++ failed") => Err(format!("{label} without `{wait}` does not compile: {e}")),
                    Err(e) => {
                        eprintln!("{label} without `{wait}`: fails as it should ({e})");
                        Ok(())
                    }
                    Ok(got) => {
                        let err = got.iter().zip(&expected).map(|(g, e)| max_rel(g, e, 1.0)).fold(0.0, f64::max);
                        if err > tol {
                            eprintln!("{label} without `{wait}`: fails as it should (error {err:e})");
                            Ok(())
                        } else {
                            Err(format!("{label} without `{wait}` passed (error {err:e})"))
                        }
                    }
                }
            }) as Box<dyn FnOnce() -> Result<(), String> + Send>
        })
        .collect();
    let failures = run_jobs(jobs);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_op_runs_emulated_like_the_interpreter() {
    if !compiler_or_skip("every_op_runs_emulated_like_the_interpreter").unwrap_or_else(|e| panic!("{e}")) {
        return;
    }
    let compiled = attn_compiler::check(EVERY_OP).unwrap_or_else(|d| panic!("{}", d[0]));
    let g = compiled.module.graphs[0].clone();
    let env = sizes(&g, &[("S", 45), ("E", 40), ("F", 72)]);
    let wd = work_dir("everyop");
    let params = g.param_types();
    let inputs: Vec<Tensor> = random_inputs(&params, 9, &env).unwrap().into_iter().map(|(_, t)| t).collect();
    let expected = interp_run(&g, &inputs, &env).unwrap();
    let shapes: Vec<Vec<usize>> = inputs.iter().map(|t| t.shape.clone()).collect();
    let env = bind_dims(&g, &shapes, &env).unwrap();
    let s = device_graph(Device::AsWritten(&g));
    let source = render(s.as_ref().unwrap()).unwrap().source;
    assert!(source.contains("attnc_mma_b") && source.contains("attnc_mma_h"));
    let got = emulate_schedule(&s, &inputs, &env, &wd).unwrap_or_else(|e| panic!("{e}"));
    let _ = std::fs::remove_dir_all(&wd);
    for (((name, v), got), exp) in g.outputs().iter().zip(&got).zip(&expected) {
        let dtype = g.node(*v).ty.dtype;
        let scale = exp.to_f64_vec().iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let err = max_rel(got, exp, (0.1 * scale).max(1.0));
        // Integers and booleans exactly; f16 within a rounding of the output (2^-11 relative,
        // with f32 products in between); bf16 (8 bits) and f32 as in the other tests.
        let tol = match dtype {
            DType::I32 | DType::Bool => 0.0,
            DType::F16 => 2e-3,
            DType::BF16 => 4e-2,
            DType::F32 => 1e-4,
        };
        assert!(err <= tol, "output {name} ({dtype}): max relative error {err:e} > {tol:e}");
    }
}

/// f32 flash ops whose score modifications load extra operands with gradients: per batch
/// index (ALiBi slopes, summed in registers) and per position (a relative-bias table, added
/// one contribution at a time), with grouped-query K/V; and attention sinks through the
/// log-sum-exp (its cotangent subtracted from `delta` by a step of its own), f32 and f16.
const BACKWARD_GRAPHS: &[(&str, &str)] = &[
    ("f32 causal alibi gqa", include_str!("../../tests/cases/flash_backward/f32_causal_alibi_gqa.ir")),
    (
        "f32 scaled query (folded into the products)",
        include_str!("../../tests/cases/flash_backward/f32_scaled_query_folded_into_the_product.ir"),
    ),
    ("f32 relative bias table", include_str!("../../tests/cases/flash_backward/f32_relative_bias_table.ir")),
    ("f32 sinks", include_str!("../../tests/cases/flash_backward/f32_sinks_through_the_log_sum_exp.ir")),
    ("f16 sinks", include_str!("../../tests/cases/flash_backward/f16_sinks_through_the_log_sum_exp.ir")),
];

/// The derivatives the flash backward tests run (here and on the device): every flash graph
/// but the additive ones (no fused backward: their derivative is the unfused graph's), with
/// its label and tolerance. Every gradient of the flash op, the forward writing its
/// log-sum-exp; with f16/bf16 inputs only q, k and v: an f32 bias's gradient sums `dF`
/// weighted by positions over every score, which amplifies the rounding of the forward's
/// output (through `delta`) far beyond the type's precision; the f32 graphs check it.
pub(super) fn backward_cases() -> Vec<(String, Graph, f64)> {
    FLASH_GRAPHS
        .iter()
        .chain(BACKWARD_GRAPHS)
        .filter(|(_, t)| !t.contains("additive("))
        .map(|(label, text)| {
            let g: Graph = text.parse().unwrap();
            let dtype = g.node(g.params()[0]).ty.dtype;
            // (Of those the graph has: a paged graph's K and V are pages, differentiated in f32.)
            let names: Vec<String> = g.param_types().into_iter().map(|(n, _)| n).collect();
            let wrt: Option<Vec<String>> = (dtype != DType::F32)
                .then(|| ["q", "k", "v"].into_iter().filter(|n| names.iter().any(|p| p == n)).map(String::from).collect());
            let derived = attn_compiler::ir::grad::differentiate(&g, wrt.as_deref()).unwrap_or_else(|e| panic!("{label}: {e}"));
            // f16/bf16 results are rounded to their type, and the forward's output (rounded,
            // with P rounded by the tensor cores) feeds delta: a few roundings of the type.
            let tol = match dtype {
                DType::F16 => 1e-2,
                DType::BF16 => 8e-2,
                _ => 1e-4,
            };
            (format!("{label} (backward)"), derived, tol)
        })
        .chain(
            // ALiBi's slopes' gradient on the tensor-core backward (one sum per item). Each
            // slope's gradient sums dF · (j − i) over every score of its heads, terms of both
            // signs from f16 operands: 1.2e-2 max|diff|/max|ref| at D=20 against the f64
            // interpreter (7.3e-3 at D=24, 7.9e-3 at 64), so twice the f16 bound.
            FLASH_GRAPHS.iter().filter(|(label, _)| *label == "f16 causal alibi gqa").map(|(label, text)| {
                let g: Graph = text.parse().unwrap();
                let derived = attn_compiler::ir::grad::differentiate(&g, None).unwrap_or_else(|e| panic!("{label}: {e}"));
                (format!("{label} (backward, slopes)"), derived, 2e-2)
            }),
        )
        .chain(
            // A bias table's gradient, scattered over the table by relative position: added
            // atomically by the tensor-core backward's key items (the SIMT kernel's in its
            // deterministic mode). Each entry sums dF over one diagonal, terms of both signs from
            // f16 operands: bounded as the slopes are.
            [("f16 relative bias table", include_str!("../../tests/cases/flash_backward/f16_relative_bias_table.ir"))].into_iter().map(
                |(label, text)| {
                    let g: Graph = text.parse().unwrap();
                    let derived = attn_compiler::ir::grad::differentiate(&g, None).unwrap_or_else(|e| panic!("{label}: {e}"));
                    (format!("{label} (backward, table)"), derived, 2e-2)
                },
            ),
        )
        .collect()
}

#[test]
fn flash_backward_kernels_run_emulated_like_the_interpreter() {
    if !compiler_or_skip("flash_backward_kernels_run_emulated_like_the_interpreter").unwrap_or_else(|e| panic!("{e}")) {
        return;
    }
    // Half-typed operands take the tensor-core backward, which copies rows 16 bytes at a time
    // when the width is a multiple of 8 halves (24) and element by element otherwise (20). Each
    // width is tagged by itself.
    let widths = |_: usize, derived: &Graph| {
        let half = derived.node(derived.params()[0]).ty.dtype != DType::F32;
        let widths: &[i64] = if half { &[24, 20] } else { &[24] };
        widths.iter().map(|&d| (d as usize, d)).collect()
    };
    // 70 keys are one key chunk of the backward, 150 two; 70 query rows three query tiles, one
    // ragged.
    let sizes = |d| vec![("D", d), ("E", 16), ("S", 70), ("T", 150), ("M", 67), ("N", 150), ("R", 9)];
    let mut cases = width_cases(backward_cases(), "flash-bwd", 21, widths, sizes);
    // The tensor-core backward's deterministic mode (dQ from query items, no atomic adds) too,
    // at the 16-byte-copy width.
    let half: Vec<Case> = cases
        .iter()
        .filter(|c| c.graph.node(c.graph.params()[0]).ty.dtype != DType::F32 && c.label.ends_with("D=24"))
        .map(|c| Case {
            label: format!("{} deterministic", c.label),
            dir: format!("{}-det", c.dir),
            deterministic: true,
            graph: c.graph.clone(),
            sizes: c.sizes.clone(),
            ..*c
        })
        .collect();
    cases.extend(half);
    run_cases(cases);
}

/// Gathers (`t[i]`, `take_along`) and scatter-adds record an index out of range in the fault
/// record, and the run gives the interpreter's error; in range, the results are the
/// interpreter's.
#[test]
fn index_faults_are_errors_like_the_interpreters() {
    if !compiler_or_skip("index_faults_are_errors_like_the_interpreters").unwrap_or_else(|e| panic!("{e}")) {
        return;
    }
    let src = "
fn g(t: f32[N, E], i: i32[M], x: f32[M, E], j: i32[M, 1]) -> f32[M, E] {
    return t[i] + take_along(x, j, axis = 1)
}
fn s(b: f32[N, E], i: i32[M, E], v: f32[M, E]) -> f32[N, E] {
    return scatter_add(b, i, v, axis = 0)
}";
    let compiled = attn_compiler::check(src).unwrap_or_else(|d| panic!("{}", d[0]));
    let f = |shape: Vec<usize>, v: Vec<f32>| Tensor::f32(shape, v).unwrap();
    let int = |shape: Vec<usize>, v: Vec<i32>| Tensor::i32(shape, v).unwrap();
    let table = f(vec![3, 2], (0..6).map(|v| v as f32).collect());
    let x = f(vec![4, 2], (0..8).map(|v| v as f32).collect());
    let cases = [
        (0, vec![table.clone(), int(vec![4], vec![0, 2, 1, 2]), x.clone(), int(vec![4, 1], vec![0, 1, 1, 0])], None),
        (
            0,
            vec![table.clone(), int(vec![4], vec![0, 3, 1, 2]), x.clone(), int(vec![4, 1], vec![0, 1, 1, 0])],
            Some("index 3 is out of range for axis 0 of size 3"),
        ),
        (
            0,
            vec![table.clone(), int(vec![4], vec![0, 2, 1, 2]), x.clone(), int(vec![4, 1], vec![0, 1, -1, 0])],
            Some("index -1 is out of range for axis 1 of size 2"),
        ),
        (1, vec![table.clone(), int(vec![4, 2], vec![0, 2, 1, 2, 0, 0, 1, 1]), x.clone()], None),
        (
            1,
            vec![table.clone(), int(vec![4, 2], vec![0, 2, 1, 5, 0, 0, 1, 1]), x.clone()],
            Some("index 5 is out of range for axis 0 of size 3"),
        ),
    ];
    for (n, (graph, inputs, fault)) in cases.into_iter().enumerate() {
        let g = &compiled.module.graphs[graph];
        let shapes: Vec<Vec<usize>> = inputs.iter().map(|t| t.shape.clone()).collect();
        let env = bind_dims(g, &shapes, &HashMap::new()).unwrap();
        let want = interp_run(g, &inputs, &env);
        let got = emulate_schedule(&device_graph(Device::AsWritten(g)), &inputs, &env, &work_dir(&format!("faults{n}")));
        match (fault, want, got) {
            (None, Ok(want), Ok(got)) => {
                // The emulation returns flat buffers.
                let flat = |ts: &[Tensor]| ts.iter().map(|t| t.to_f64_vec()).collect::<Vec<_>>();
                assert_eq!(flat(&want), flat(&got), "case {n}");
            }
            (Some(msg), Err(want), Err(got)) => {
                assert!(want.to_string().contains(msg), "case {n}: interpreter: {want}");
                assert!(got.contains(msg), "case {n}: emulated CUDA: {got}");
            }
            (fault, want, got) => panic!("case {n}: expected {fault:?}, interpreter {want:?}, emulated {got:?}"),
        }
    }
}

/// Argsorts longer than a block's threads (each thread places several elements per merge pass,
/// the last run of each pass without a partner), with many ties (stable: by index), both
/// directions, a NaN-free float key and an integer one, exactly like the interpreter; and
/// top-k, selected (k ≤ 16) or merge-sorted (k = 20), along either axis.
#[test]
fn long_argsorts_run_emulated_like_the_interpreter() {
    if !compiler_or_skip("long_argsorts_run_emulated_like_the_interpreter").unwrap_or_else(|e| panic!("{e}")) {
        return;
    }
    let source = "fn sorts(x: f32[B, N], k: i32[B, N]) -> (a: i32[B, N], d: i32[B, N], c: i32[B, N]) {
    return argsort(floor(x * 4.0)), argsort(k % 7, descending = true), argsort(x, axis = 0)
}";
    let compiled = attn_compiler::check(source).unwrap_or_else(|d| panic!("{}", d[0]));
    let g = compiled.module.graphs[0].clone();
    for n in [1, 2, 257, 700] {
        let env = sizes(&g, &[("B", 3), ("N", n)]);
        let wd = work_dir(&format!("argsort-{n}"));
        let err =
            check(&format!("argsort N={n}"), &g, device_graph(Device::AsWritten(&g)), &env, 5, &wd, &[]).unwrap_or_else(|e| panic!("{e}"));
        let _ = std::fs::remove_dir_all(&wd);
        assert_eq!(err, 0.0, "N={n}: the permutations differ");
    }
    // Top-k: a few places selected (one pass each), more merge-sorted; ties by index.
    let source = "fn tops(x: f32[B, N], k: i32[B, N]) -> (a: i32[B, 1], b: i32[B, 3], c: i32[B, 20], d: f32[3, N]) {
    let (va, a) = topk(floor(x * 4.0), 1)
    let (vb, b) = topk(cast(k % 5, f32), 3)
    let (vc, c) = topk(floor(x * 2.0), 20)
    let (d, ib) = topk(-floor(x * 3.0), 3, axis = 0)
    return a, b, c, d
}";
    let compiled = attn_compiler::check(source).unwrap_or_else(|d| panic!("{}", d[0]));
    let g = compiled.module.graphs[0].clone();
    for n in [20, 257, 700] {
        let env = sizes(&g, &[("B", 4), ("N", n)]);
        let wd = work_dir(&format!("topk-{n}"));
        let err =
            check(&format!("topk N={n}"), &g, device_graph(Device::AsWritten(&g)), &env, 6, &wd, &[]).unwrap_or_else(|e| panic!("{e}"));
        let _ = std::fs::remove_dir_all(&wd);
        assert_eq!(err, 0.0, "N={n}: the top-k differ");
    }
}

/// Additive scores take the product form `1 − 2/(1 + e^{2q}·e^{2k})` only where the item's q
/// and the tile's k lie within ±20, else `tanhf` per term: queries and keys scaled past it,
/// and one infinite key (its tile direct, the others product, within the same rows), give the
/// interpreter's results too.
#[test]
fn additive_scores_take_both_forms_emulated() {
    if !compiler_or_skip("additive_scores_take_both_forms_emulated").unwrap_or_else(|e| panic!("{e}")) {
        return;
    }
    let (_, text) = FLASH_GRAPHS.iter().find(|(l, _)| l.starts_with("f32 additive")).expect("an f32 additive graph");
    let g: Graph = text.parse().unwrap();
    let env = sizes(&g, &[("D", 24), ("E", 16), ("S", 70)]);
    let (inputs, _) = reference_run(&g, &env, 41).unwrap();
    let shapes: Vec<Vec<usize>> = inputs.iter().map(|t| t.shape.clone()).collect();
    let env = bind_dims(&g, &shapes, &env).unwrap();
    let map = |t: &Tensor, f: &dyn Fn(usize, f64) -> f64| {
        let v: Vec<f64> = t.to_f64_vec().into_iter().enumerate().map(|(i, x)| f(i, x)).collect();
        Tensor::from_f64(t.dtype, t.shape.clone(), &v).unwrap()
    };
    let cases: [(&str, Vec<Tensor>); 3] = [
        ("within ±20", inputs.clone()),
        // `e^{2q}·e^{2k}` would be `inf · 0` or overflow where `q + k` is moderate.
        (
            "queries and keys × 40",
            vec![map(&inputs[0], &|_, x| 40.0 * x), map(&inputs[1], &|_, x| 40.0 * x), inputs[2].clone(), inputs[3].clone()],
        ),
        (
            "one infinite key",
            vec![inputs[0].clone(), map(&inputs[1], &|i, x| if i == 3 { f64::INFINITY } else { x }), inputs[2].clone(), inputs[3].clone()],
        ),
    ];
    let schedule = device_graph(Device::AsWritten(&g));
    let mut failures = Vec::new();
    for (n, (label, inputs)) in cases.iter().enumerate() {
        let expected = interp_run(&g, inputs, &env).unwrap();
        let wd = work_dir(&format!("additive-forms{n}"));
        let got = emulate_schedule(&schedule, inputs, &env, &wd).unwrap_or_else(|e| panic!("{label}: {e}"));
        let _ = std::fs::remove_dir_all(&wd);
        let scale = expected[0].to_f64_vec().iter().filter(|x| x.is_finite()).fold(0.0f64, |m, x| m.max(x.abs()));
        let err = max_rel(&got[0], &expected[0], (0.1 * scale).max(1.0));
        eprintln!("{label}: max relative error {err:.1e}");
        if err.is_nan() || err > 1e-4 {
            failures.push(format!("{label}: max relative error {err:e} > 1e-4"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A window size given as an input: the run's tile table is classified by its value (skipped
/// and full tiles included), and the emulated kernels give the interpreter's result for a
/// window of one key, of some, and of every key.
#[test]
fn a_window_given_as_an_input_classifies_by_its_value_emulated() {
    if !compiler_or_skip("a_window_given_as_an_input_classifies_by_its_value_emulated").unwrap_or_else(|e| panic!("{e}")) {
        return;
    }
    let g: Graph = include_str!("../../tests/cases/flash/f16_window_as_an_input.ir").parse().unwrap();
    let env = sizes(&g, &[("B", 1), ("H", 2), ("S", 200), ("D", 32)]);
    let schedule = device_graph(Device::AsWritten(&g));
    let mut inputs: Vec<Tensor> = random_inputs(&g.param_types(), 4, &env).unwrap().into_iter().map(|(_, t)| t).collect();
    for w in [0, 37, 500] {
        inputs[3] = Tensor::i32(vec![], vec![w]).unwrap();
        let want = interp_run(&g, &inputs, &env).unwrap();
        let wd = work_dir(&format!("window{w}"));
        let got = emulate_schedule(&schedule, &inputs, &env, &wd).unwrap_or_else(|e| panic!("w = {w}: {e}"));
        let _ = std::fs::remove_dir_all(&wd);
        let err = max_rel(&got[0], &want[0], 1.0);
        assert!(err <= 5e-3, "w = {w}: max relative error {err:e}");
    }
}

/// A dense bool mask (`tests/cases/flash/dense_bool_mask.attn`) classifies its tiles from its
/// values, one tile table per batch index: batch index 0 left-padded past a whole tile (its
/// table skips key tiles that batch index 1 runs). The forward (f32 SIMT, f16 tensor cores) and
/// the backward (f16 tensor cores) emulated against the interpreter.
#[test]
fn a_dense_bool_mask_classifies_tiles_per_batch_index_emulated() {
    if !compiler_or_skip("a_dense_bool_mask_classifies_tiles_per_batch_index_emulated").unwrap_or_else(|e| panic!("{e}")) {
        return;
    }
    let src = include_str!("../../tests/cases/flash/dense_bool_mask.attn");
    let (n, pad) = (200usize, [150usize, 0]);
    let keep: Vec<bool> = (0..2 * n * n).map(|x| (x % n) <= (x / n % n) && ((x % n) >= pad[x / (n * n)] || x % n == x / n % n)).collect();
    let mask = Tensor::new(DType::Bool, vec![2, 1, n, n], attn_compiler::tensor::TensorData::Bool(keep)).unwrap();
    for (dtype, tol) in [("f32", 1e-4), ("f16", 1e-2)] {
        // Optimised first, so that attention is one flash op and its gradient the fused backward.
        let module = attn_compiler::check(&src.replace("f32", dtype)).unwrap().module;
        let g = attn_compiler::opt::optimize_module(&module).0.graphs.into_iter().next().unwrap();
        let env = sizes(&g, &[("B", 2), ("H", 2), ("L", n as i64), ("S", n as i64), ("D", 32)]);
        let mut inputs: Vec<Tensor> = random_inputs(&g.param_types(), 8, &env).unwrap().into_iter().map(|(_, t)| t).collect();
        inputs[3] = mask.clone();
        let forward = (g.clone(), inputs.clone());
        let derived = attn_compiler::ir::grad::differentiate(&g, Some(&["q".to_string(), "k".to_string(), "v".to_string()])).unwrap();
        let mut grad_inputs: Vec<Tensor> =
            random_inputs(&derived.param_types(), 9, &sizes(&derived, &[("B", 2), ("H", 2), ("L", n as i64), ("S", n as i64), ("D", 32)]))
                .unwrap()
                .into_iter()
                .map(|(_, t)| t)
                .collect();
        grad_inputs[..4].clone_from_slice(&inputs);
        let runs = if dtype == "f16" { vec![forward, (derived, grad_inputs)] } else { vec![forward] };
        for (n_run, (graph, inputs)) in runs.into_iter().enumerate() {
            let env = sizes(&graph, &[("B", 2), ("H", 2), ("L", n as i64), ("S", n as i64), ("D", 32)]);
            let want = interp_run(&graph, &inputs, &env).unwrap();
            let wd = work_dir(&format!("dense-mask-{dtype}-{n_run}"));
            let got = emulate_schedule(&device_graph(Device::AsWritten(&graph)), &inputs, &env, &wd)
                .unwrap_or_else(|e| panic!("{dtype} {n_run}: {e}"));
            let _ = std::fs::remove_dir_all(&wd);
            for (a, b) in got.iter().zip(&want) {
                let err = max_rel(a, b, 1.0);
                assert!(err <= tol, "{dtype} run {n_run}: max relative error {err:e}");
            }
        }
    }
}
