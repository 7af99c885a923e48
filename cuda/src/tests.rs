//! CUDA target tests that need no GPU: NVRTC compiles of every example's kernels (as written
//! and optimised) for sm_80 and sm_90, every padded head width of the flash kernels, and the
//! clean "not available" error. With `ATTNC_GPU_TESTS=1` on a machine with a GPU, every example
//! also runs on the device and is compared with the interpreter.
//!
//! NVRTC comes from `ATTNC_NVRTC_LIB` or the folder `.ci/run` installs it into. Without it the
//! compile tests print that they skipped and why, except under `CI=true`, where they fail.

use super::{CudaError, nvrtc};
use crate::render::{CudaProgram, render};
use attn_compiler::Compiler;
use attn_compiler::ir::{DType, Graph};
use attn_compiler::schedule::{CudaPolicy, Kernel, Policy, Schedule, Variant, schedule};
use std::path::{Path, PathBuf};

const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

/// NVRTC, or `None` after printing why the test skips (panics under `CI=true`).
fn nvrtc_or_skip(test: &str) -> Option<()> {
    match nvrtc::available() {
        Ok(_) => Some(()),
        Err(why) => {
            if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
                panic!("{test}: NVRTC is required in CI but unavailable: {why}");
            }
            eprintln!("{test}: skipped: {why}");
            None
        }
    }
}

/// The example programs, sorted.
pub(super) fn examples() -> Vec<PathBuf> {
    // ATTNC_EXAMPLES_DIR: for a test binary built on one machine and run on another (a GPU's).
    let dir =
        std::env::var_os("ATTNC_EXAMPLES_DIR").map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples"), PathBuf::from);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|rd| rd.filter_map(Result::ok).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "attn")).collect())
        .unwrap_or_default();
    files.sort();
    files
}

fn cuda() -> Policy {
    Policy::Cuda(CudaPolicy::default())
}

/// A graph scheduled for CUDA as written and rendered.
fn render_as_written(g: &Graph) -> (Schedule, CudaProgram) {
    let s = schedule(g, &cuda()).unwrap_or_else(|e| panic!("{}: {e}", g.name));
    let p = render(&s).unwrap_or_else(|e| panic!("{}: {e}", g.name));
    (s, p)
}

/// Every graph of every example, as written and compiled by the pipeline, with a label.
fn example_programs() -> Vec<(String, CudaProgram)> {
    let compiler = Compiler::new(cuda());
    let mut out = Vec::new();
    for path in examples() {
        let src = std::fs::read_to_string(&path).expect("readable example");
        let stem = path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
        let compiled = compiler.check(&src).unwrap_or_else(|d| panic!("{stem}: {}", d[0]));
        for g in &compiled.module.graphs {
            out.push((format!("{stem}/{}", g.name), render_as_written(g).1));
            let planned = compiler.plan(g).unwrap_or_else(|e| panic!("{stem}: {e}"));
            out.push((
                format!("{stem}/{} (optimised)", g.name),
                render(&planned.schedule).unwrap_or_else(|e| panic!("{stem} optimised: {e}")),
            ));
        }
    }
    out
}

/// A compile job: label, source, `-D` defines.
type Job = (String, String, Vec<(String, i64)>);

/// Compiles each job for both architectures (by default, each for one of them in turn: see
/// [`attn_tests::full_matrix`]) on two threads; returns the failures and the ptxas reports of
/// kernels that spill.
fn compile_all(jobs: Vec<Job>) -> (Vec<String>, Vec<String>) {
    let full = attn_tests::full_matrix();
    let jobs: Vec<(Job, &str)> = jobs
        .into_iter()
        .enumerate()
        .flat_map(|(n, j)| {
            ARCHS.into_iter().enumerate().filter(move |(a, _)| full || n % ARCHS.len() == *a).map(move |(_, a)| (j.clone(), a))
        })
        .collect();
    compile_on(jobs)
}

/// Compiles each job for its architecture on two threads: NVRTC failures, then the kernels
/// that spill.
fn compile_on(jobs: Vec<(Job, &str)>) -> (Vec<String>, Vec<String>) {
    let results: Vec<(Vec<String>, Vec<String>)> = std::thread::scope(|scope| {
        let chunks: Vec<_> = jobs.chunks(jobs.len().div_ceil(2).max(1)).collect();
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|chunk| {
                scope.spawn(move || {
                    let (mut failures, mut spills) = (Vec::new(), Vec::new());
                    for ((label, src, defines), arch) in chunk {
                        match nvrtc::compile(src, arch, defines, &["--ptxas-options=-v"]) {
                            Ok(c) => spills.extend(spill_report(&c.log).into_iter().map(|s| format!("{label} {arch}: {s}"))),
                            Err(log) => failures.push(format!("{label} ({arch}, {defines:?}):\n{log}")),
                        }
                    }
                    (failures, spills)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("compile thread")).collect()
    });
    results.into_iter().fold((Vec::new(), Vec::new()), |(mut f, mut s), (f2, s2)| {
        f.extend(f2);
        s.extend(s2);
        (f, s)
    })
}

/// Compiles the jobs ([`compile_all`]), printing the kernels that spill registers, and fails
/// with every NVRTC failure.
fn assert_compiles(jobs: Vec<Job>) {
    let (failures, spills) = compile_all(jobs);
    if !spills.is_empty() {
        eprintln!("kernels that spill registers:\n  {}", spills.join("\n  "));
    }
    assert!(failures.is_empty(), "{} NVRTC failure(s):\n{}", failures.len(), failures.join("\n\n"));
}

/// Kernels whose ptxas report shows spill stores beyond a few words.
fn spill_report(log: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = "";
    for line in log.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            current = rest.trim();
        }
        if let Some(pos) = line.find(" bytes spill stores") {
            let n: usize = line[..pos].rsplit(' ').next().and_then(|s| s.parse().ok()).unwrap_or(0);
            if n > 64 {
                out.push(format!("{current}: {}", line.trim()));
            }
        }
    }
    out
}

#[test]
fn every_example_compiles_with_nvrtc() {
    if nvrtc_or_skip("every_example_compiles_with_nvrtc").is_none() {
        return;
    }
    let mut jobs: Vec<_> = example_programs().into_iter().map(|(l, p)| (l, p.source, Vec::new())).collect();
    assert!(jobs.len() >= 42, "expected every example twice, got {}", jobs.len());
    let every_op = attn_compiler::check(EVERY_OP).unwrap_or_else(|d| panic!("{}", d[0]));
    jobs.push(("every op".to_string(), render_as_written(&every_op.module.graphs[0]).1.source, Vec::new()));
    assert_compiles(jobs);
}

/// Ops the examples do not reach: concat, slice, rmsnorm, max/min/mean reductions, i32
/// arithmetic with `%` and clamps, casts between every type, gather with computed indices,
/// f16 element-wise maths, f16/bf16 matmuls on tensor cores, integer, reversed, f16 and
/// broadcast-coefficient scans, `take_along` and a gather by leading index, and sorts (top-k
/// along a strided axis with ties, a descending integer argsort), a scatter-add with
/// repeated positions (indices out of range are errors: `index_faults_*`), and dropout unfused
/// (element-wise, inside a reduction, on f16).
pub(crate) const EVERY_OP: &str = "
fn everyop(x: f32[B, S, E], g: f32[E], w: f32[E, F], idx: i32[B, S], h: f16[B, S, E], seed: i32)
    -> (a: f32[B, 2*S, E], r: f32[B, S, E], mx: f32[B, E], mn: i32[B, S], c: f16[B, S, E],
        k: bool[B, S], z: f32[B, S], p: bf16[B, S, F], q: f16[B, S, F], cp: i32[B, S], sc: f32[B, S, E],
        tk: f32[B, S, 1], lg: f32[B, S, F], tv: f32[B, 2, E], ti: i32[B, 2, E], ao: i32[B, S],
        sa: f32[B, S, E], dr: f32[B, S]) {
    let a = concat([x, relu(x) - 1.0], axis = 1)
    let r = rmsnorm(x, g) + x[:, :, 0:1]
    let mx = max(x, axis = 1) * min(x, axis = 1)
    let ii = idx * 3 - 7
    let mn = ii % 4 + clamp(ii, -2, 5)
    let c = cast(tanh(h) * cast(pow(abs(x) + 1.0, 0.5), f16), f16)
    let k = cast(idx, bool) && (sum(x, axis = -1) > 0.0)
    let (b, s) = indices(idx)
    let z = x[b, s, idx % E] + floor(mean(x, axis = -1) * 3.0) + cast(b - s, f32)
    let p = cast(h, bf16) @ cast(w, bf16)
    let q = h @ cast(w, f16)
    let cp = cumprod(idx % 3 + 1, axis = 1, reverse = true) + cumsum(idx, axis = 0)
    let sc = scan(sigmoid(g), x, axis = 1) + cumsum(h, axis = -1)
    let tk = take_along(x, unsqueeze(idx, -1) % E, axis = 2)
    let lg = w[idx % E]
    let (tv, ti) = topk(floor(x * 2.0), 2, axis = 1)
    let ao = argsort(idx % 3, axis = 1, descending = true)
    let sa = scatter_add(x, unsqueeze(idx % 5, -1) + cast(x * 0.0, i32), x * 2.0, axis = 1)
    let dr = sum(dropout(x * 2.0, seed, p = 0.5), axis = -1) + mean(cast(dropout(h, seed, p = 0.25), f32), axis = -1)
    return a, r, mx, mn, c, k, z, p, q, cp, sc, tk, lg, tv, ti, ao, sa, dr
}
";

/// Hand-written flash graphs covering the kernel shapes the examples (all f32) do not reach:
/// tensor cores in f16 and bf16 with GQA broadcast, a data-dependent mask and an extra
/// operand, sigmoid weights, split-KV decode, additive scores with a weight per head, and K/V
/// read through a block table, dropout of the weights, and q/k/v and the result in
/// transformers' sequence-major layout (strided rows, the result written in place). The
/// graphs are files (`tests/cases/flash/`, their header saying why each is there), compiled in
/// so that a test binary carried to a GPU machine has them.
pub(crate) const FLASH_GRAPHS: &[(&str, &str)] = &[
    ("f16 plain scaled scores", include_str!("../../tests/cases/flash/f16_plain_scaled_scores.ir")),
    ("f16 negative scale", include_str!("../../tests/cases/flash/f16_negative_scale.ir")),
    ("f16 causal alibi gqa", include_str!("../../tests/cases/flash/f16_causal_alibi_gqa.ir")),
    ("bf16 with an f32 bias, f32 result", include_str!("../../tests/cases/flash/bf16_with_an_f32_bias_f32_result.ir")),
    ("bf16 document mask", include_str!("../../tests/cases/flash/bf16_document_mask.ir")),
    ("f16 sigmoid window", include_str!("../../tests/cases/flash/f16_sigmoid_window.ir")),
    ("f16 decode", include_str!("../../tests/cases/flash/f16_decode.ir")),
    ("f16 window as an input", include_str!("../../tests/cases/flash/f16_window_as_an_input.ir")),
    ("f32 wide mixed", include_str!("../../tests/cases/flash/f32_wide_mixed.ir")),
    (
        "f32 additive scores with a weight per head, causal, shared K/V heads",
        include_str!("../../tests/cases/flash/f32_additive_per_head_causal_gqa.ir"),
    ),
    ("f16 additive scores", include_str!("../../tests/cases/flash/f16_additive_scores.ir")),
    ("f16 paged KV", include_str!("../../tests/cases/flash/f16_paged_kv.ir")),
    ("f32 paged decode", include_str!("../../tests/cases/flash/f32_paged_decode.ir")),
    ("f16 causal dropout gqa", include_str!("../../tests/cases/flash/f16_causal_dropout_gqa.ir")),
    ("f32 decode dropout", include_str!("../../tests/cases/flash/f32_decode_dropout.ir")),
    ("f16 sequence-major", include_str!("../../tests/cases/flash/f16_sequence_major.ir")),
];

/// The forward flash graphs parsed, with their label and the tolerance of a run against the
/// interpreter by the graph's type: f16 rounds P and the output (2^-11 relative each) over f32
/// accumulation, 5e-3 of the output scale; bf16 keeps 8 significant bits, 4e-2; f32 1e-4.
pub(crate) fn flash_graphs() -> Vec<(&'static str, Graph, f64)> {
    FLASH_GRAPHS
        .iter()
        .map(|(label, text)| {
            let g: Graph = text.parse().unwrap_or_else(|e| panic!("{label}: {e}"));
            let tol = match g.node(g.params()[0]).ty.dtype {
                DType::F16 => 5e-3,
                DType::BF16 => 4e-2,
                _ => 1e-4,
            };
            (*label, g, tol)
        })
        .collect()
}

/// The compile-time values of every flash step (forward and backward) of `s` at head width
/// `hd`, with `tiles` query m-tiles per warp for the tensor-core forward (one K/V stage).
fn head_defines(s: &Schedule, hd: i64, tiles: i64) -> Vec<(String, i64)> {
    staged_head_defines(s, hd, tiles, 1, false, false)
}

/// [`head_defines`] with `stages` K/V stages for the tensor-core forward.
fn staged_head_defines(s: &Schedule, hd: i64, tiles: i64, stages: i64, ws: bool, tma: bool) -> Vec<(String, i64)> {
    let mut defines = Vec::new();
    for (n, step) in s.steps.iter().enumerate() {
        match &step.kernel {
            Kernel::FlashBwd(_) => defines.push((format!("ATTNC_HD_{n}"), hd)),
            Kernel::Flash(f) => {
                defines.push((format!("ATTNC_HD_{n}"), hd));
                if f.variant == Variant::TensorCore {
                    defines.push((format!("ATTNC_BN_{n}"), attn_compiler::schedule::policy::cuda_mma_keys(hd)));
                    defines.push((format!("ATTNC_MT_{n}"), tiles));
                    defines.push((format!("ATTNC_KS_{n}"), stages));
                    defines.push((format!("ATTNC_WS_{n}"), i64::from(ws)));
                    defines.push((format!("ATTNC_TMA_{n}"), i64::from(tma)));
                }
            }
            _ => {}
        }
    }
    defines
}

#[test]
fn flash_kernels_compile_for_every_head_width() {
    if nvrtc_or_skip("flash_kernels_compile_for_every_head_width").is_none() {
        return;
    }
    let mut jobs = Vec::new();
    for (label, text) in FLASH_GRAPHS {
        let g: Graph = text.parse().unwrap_or_else(|e| panic!("{label}: {e}"));
        let (s, p) = render_as_written(&g);
        // Every head width with its default m-tiles per warp, and 64 and 128 with one m-tile too
        // (`ATTNC_CUDA_MMA_ROWS=64`); by default the smallest, one between the padded sizes, the
        // largest, and 128 with one m-tile.
        let all = (32..=256).step_by(32).map(|hd| (hd, None)).chain([(64, Some(64)), (128, Some(64))]);
        let widths = attn_tests::matrix(all, |n| [0, 4, 7, 9].contains(&n));
        for (hd, rows) in widths {
            let tiles = CudaPolicy { mma_rows: rows, ..CudaPolicy::default() }.mma_row_tiles(hd);
            jobs.push((format!("{label} HD={hd} MT={tiles}"), p.source.clone(), head_defines(&s, hd, tiles)));
        }
    }
    assert_compiles(jobs);
}

/// The tensor-core kernels' Hopper path: NVRTC for `sm_90a` defines `ATTNC_WGMMA` (and plain
/// `sm_90` does not), and every flash graph compiles there at the widths that take `wgmma`
/// (forward: 64 and 128, two m-tiles per warp with two K/V stages in the warp-specialised
/// block, 128 in one warpgroup with two stages, with one stage and with one m-tile; backward: 64
/// and 128), spills reported.
#[test]
fn flash_kernels_compile_for_hoppers_warpgroup_products() {
    if nvrtc_or_skip("flash_kernels_compile_for_hoppers_warpgroup_products").is_none() {
        return;
    }
    let probe = |arch: &str| {
        let src = format!(
            "{}extern \"C\" __global__ void k(int* x) {{ x[0] = ATTNC_WGMMA; }}\n#if ATTNC_WGMMA != {}\n#error wrong\n#endif\n",
            crate::render::preamble_for_tests(),
            i32::from(arch == "sm_90a")
        );
        nvrtc::compile(&src, arch, &[], &[])
    };
    probe("sm_90a").unwrap_or_else(|log| panic!("sm_90a has no ATTNC_WGMMA:\n{log}"));
    probe("sm_90").unwrap_or_else(|log| panic!("sm_90 claims ATTNC_WGMMA:\n{log}"));
    let mut jobs = Vec::new();
    for (label, text) in FLASH_GRAPHS {
        let g: Graph = text.parse().unwrap_or_else(|e| panic!("{label}: {e}"));
        let (s, p) = render_as_written(&g);
        // The warp-specialised block with TMA loads and with the threads' copies.
        let configs = [
            (64, 2, 3, true, true),
            (128, 2, 3, true, true),
            (128, 2, 3, true, false),
            (128, 2, 2, false, false),
            (128, 2, 1, false, false),
            (128, 1, 1, false, false),
        ];
        for (hd, tiles, stages, ws, tma) in configs {
            let defines = staged_head_defines(&s, hd, tiles, stages, ws, tma);
            jobs.push((
                format!("{label} HD={hd} MT={tiles} KS={stages} WS={} TMA={}", u8::from(ws), u8::from(tma)),
                p.source.clone(),
                defines,
            ));
        }
        // The backward too (additive scores have none fused).
        if !text.contains("additive(") {
            let derived = attn_compiler::ir::grad::differentiate(&g, None).unwrap_or_else(|e| panic!("{label}: {e}"));
            let (s, p) = render_as_written(&derived);
            for hd in [64, 128] {
                jobs.push((format!("{label} backward HD={hd}"), p.source.clone(), head_defines(&s, hd, 2)));
            }
        }
    }
    let (failures, spills) = compile_on(jobs.into_iter().map(|j| (j, "sm_90a")).collect());
    if !spills.is_empty() {
        eprintln!("kernels that spill registers:\n  {}", spills.join("\n  "));
    }
    assert!(failures.is_empty(), "{} NVRTC failure(s):\n{}", failures.len(), failures.join("\n\n"));
}

#[test]
fn flash_backward_kernels_compile_for_every_head_width() {
    if nvrtc_or_skip("flash_backward_kernels_compile_for_every_head_width").is_none() {
        return;
    }
    let mut jobs = Vec::new();
    // Additive scores have no fused backward (their derivative is the unfused graph's).
    for (label, text) in FLASH_GRAPHS.iter().filter(|(_, t)| !t.contains("additive(")) {
        let g: Graph = text.parse().unwrap_or_else(|e| panic!("{label}: {e}"));
        let derived = attn_compiler::ir::grad::differentiate(&g, None).unwrap_or_else(|e| panic!("{label}: {e}"));
        let (s, p) = render_as_written(&derived);
        for hd in attn_tests::matrix([32, 128, 256], |n| n == 1) {
            assert!(s.steps.iter().any(|st| matches!(st.kernel, Kernel::FlashBwd(_))), "{label}: no backward step");
            let defines = head_defines(&s, hd, CudaPolicy::default().mma_row_tiles(hd));
            jobs.push((format!("{label} backward HD={hd}"), p.source.clone(), defines));
        }
    }
    assert_compiles(jobs);
}

#[test]
fn a_compile_error_is_reported_with_the_log() {
    if nvrtc_or_skip("a_compile_error_is_reported_with_the_log").is_none() {
        return;
    }
    let err = nvrtc::compile("extern \"C\" __global__ void k() { undeclared_thing(); }", "sm_80", &[], &[]).unwrap_err();
    assert!(err.contains("undeclared_thing"), "{err}");
    let ok = nvrtc::compile("extern \"C\" __global__ void k(float* x) { x[threadIdx.x] = 1.0f; }", "sm_90", &[], &[]).unwrap();
    assert!(!ok.image.is_empty());
}

#[test]
fn the_compile_cache_compiles_once() {
    if nvrtc_or_skip("the_compile_cache_compiles_once").is_none() {
        return;
    }
    let src = "extern \"C\" __global__ void k(float* x) { x[threadIdx.x] = 2.0f; }";
    let cache = nvrtc::Cache::in_memory();
    let (a, compiled_a) = cache.get(src, "sm_80", &[]).unwrap();
    let (b, compiled_b) = cache.get(src, "sm_80", &[]).unwrap();
    assert!(compiled_a && !compiled_b);
    assert_eq!(a, b);
    let (_, compiled_c) = cache.get(src, "sm_90", &[]).unwrap();
    assert!(compiled_c, "another architecture is another entry");
}

/// A causal f16 flash graph (keys and values of their own lengths and widths): the device
/// tensor tests' program.
pub(crate) const CAUSAL_F16: &str = "graph attn {
  %0 = param[name=q] : f16[B, H, S, D]
  %1 = param[name=k] : f16[B, H, T, D]
  %2 = param[name=v] : f16[B, H, T, E]
  %3 = flash[rank=4, weights=softmax, score=\"s\", mask=\"j <= i\"] %0, %1, %2 : f16[B, H, S, E]
  output out = %3
}";

#[test]
fn device_results_have_their_shapes_before_any_run() {
    let g: Graph = CAUSAL_F16.parse().unwrap();
    let out = super::output_shapes(&g, &[vec![2, 3, 5, 8], vec![2, 3, 7, 8], vec![2, 3, 7, 16]], &Default::default()).unwrap();
    assert_eq!(out, vec![(DType::F16, vec![2, 3, 5, 16])]);
    let err = super::output_shapes(&g, &[vec![2, 3, 5, 8], vec![2, 3, 7, 9], vec![2, 3, 7, 16]], &Default::default()).unwrap_err();
    assert!(matches!(err, CudaError::Input(_)), "{err:?}");
}

#[test]
fn without_a_gpu_the_target_is_unavailable_not_a_panic() {
    match super::device_info() {
        Ok(info) => eprintln!("a GPU is present ({} {}); the fallback path is not exercised", info.name, info.arch),
        Err(e) => {
            assert!(matches!(e, CudaError::Unavailable(_)), "{e:?}");
            let g: Graph = FLASH_GRAPHS[0].1.parse().unwrap();
            let err = super::run(&g, &[], &Default::default()).unwrap_err();
            assert!(matches!(err, CudaError::Unavailable(_)));
            let msg = err.to_string();
            assert!(msg.starts_with("the CUDA target is not available: "), "{msg}");
            assert!(!msg.contains('\n'), "one sentence: {msg}");
            // Device tensors too: no address is touched before the device is found.
            let t = |shape: &[usize]| super::DeviceTensor { ptr: 0, dtype: g.node(g.params()[0]).ty.dtype, shape: shape.to_vec() };
            let shapes = super::output_shapes(&g, &[vec![2, 3, 4, 8], vec![2, 3, 4, 8], vec![2, 3, 4, 8]], &Default::default());
            let outs: Vec<super::DeviceTensor> = shapes.unwrap_or_default().iter().map(|(_, s)| t(s)).collect();
            // SAFETY: without a device nothing is read or written.
            let err = unsafe {
                super::run_device(
                    &g,
                    &[t(&[2, 3, 4, 8]), t(&[2, 3, 4, 8]), t(&[2, 3, 4, 8])],
                    &outs,
                    &Default::default(),
                    0,
                    &Default::default(),
                )
            };
            assert!(matches!(err, Err(CudaError::Unavailable(_))), "{err:?}");
        }
    }
}
