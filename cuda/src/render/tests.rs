//! Unit tests of the CUDA renderer: every example (as written and optimised) renders, kernel
//! variants follow the schedule, and the launch arithmetic is right.

use super::*;
use attn_compiler::Compiler;
use attn_compiler::ir::Graph;
use attn_compiler::schedule::{CudaPolicy, Policy, Variant, prepare, schedule};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn examples() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("examples dir")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "attn"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| (p.file_stem().unwrap().to_string_lossy().to_string(), std::fs::read_to_string(&p).expect("readable")))
        .collect()
}

fn cuda() -> Policy {
    Policy::Cuda(CudaPolicy::default())
}

/// `flash(q, k, v)` with the given dtype, shapes and expressions.
fn flash_graph(dtype: &str, q: &str, kv: &str, score: &str, mask: Option<&str>, weights: &str) -> Graph {
    let mask = mask.map_or(String::new(), |m| format!(", mask=\"{m}\""));
    let out = q.to_string();
    format!(
        "graph attn {{
  %0 = param[name=q] : {dtype}[{q}]
  %1 = param[name=k] : {dtype}[{kv}]
  %2 = param[name=v] : {dtype}[{kv}]
  %3 = flash[rank=4, weights={weights}, score=\"{score}\"{mask}] %0, %1, %2 : {dtype}[{out}]
  output out = %3
}}"
    )
    .parse()
    .expect("parses")
}

#[test]
fn every_example_renders() {
    let compiler = Compiler::new(cuda());
    for (name, src) in examples() {
        let compiled = compiler.check(&src).unwrap_or_else(|d| panic!("{name}: {}", d[0]));
        for g in &compiled.module.graphs {
            for s in [
                schedule(g, &cuda()).unwrap_or_else(|e| panic!("{name}: {e}")),
                compiler.plan(g).unwrap_or_else(|e| panic!("{name}: {e}")).schedule,
            ] {
                let p = render(&s).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(p.kernels.len(), s.steps.len(), "{name}");
                assert!(p.source.contains("ATTNC_KERNEL"), "{name}: no kernel");
            }
        }
    }
}

#[test]
fn kernels_follow_the_schedules_variants() {
    let variant_of = |g: &Graph| {
        let s = schedule(g, &cuda()).expect("schedules");
        let p = render(&s).expect("renders");
        (
            s.steps.iter().find_map(|st| if let attn_compiler::schedule::Kernel::Flash(f) = &st.kernel { Some(f.variant) } else { None }),
            p.source,
        )
    };
    let (v, src) = variant_of(&flash_graph("f16", "B, H, S, 64", "B, H, S, 64", "s * 0.125", Some("j <= i"), "softmax"));
    assert_eq!(v, Some(Variant::TensorCore));
    assert!(src.contains("attnc_mma_h") && src.contains("ATTNC_BN_0"));
    let (v, src) = variant_of(&flash_graph("bf16", "B, H, S, 128", "B, H, S, 128", "s", None, "softmax"));
    assert_eq!(v, Some(Variant::TensorCore));
    assert!(src.contains("attnc_mma_b"));
    let (v, src) = variant_of(&flash_graph("f32", "B, H, S, D", "B, H, S, D", "s * 0.125", None, "sigmoid"));
    assert_eq!(v, Some(Variant::Simt));
    assert!(src.contains("attnc_sigmoid(sc_)"));
    let (v, src) = variant_of(&flash_graph("f16", "B, H, 1, 128", "B, H, T, 128", "s", None, "softmax"));
    assert_eq!(v, Some(Variant::SplitKv));
    assert!(src.contains("flash_merge"));
    // Too wide a head is refused when constant.
    let wide = flash_graph("f16", "B, H, S, 512", "B, H, S, 512", "s", None, "softmax");
    assert!(schedule(&wide, &cuda()).is_err());
}

#[test]
fn launches_follow_the_prepared_work() {
    let g = flash_graph("f16", "B, H, S, D", "B, H, S, D", "s", Some("j <= i"), "softmax");
    let s = schedule(&g, &cuda()).expect("schedules");
    let p = render(&s).expect("renders");
    let env: HashMap<String, i64> = [("B", 2), ("H", 3), ("S", 130), ("D", 80)].map(|(k, v)| (k.to_string(), v)).into();
    let limits = DeviceLimits { max_smem_per_block: 232_448 };
    // Head width 96: two m-tiles per warp by default (128 query rows per block), one when
    // `ATTNC_CUDA_MMA_ROWS=64` asks.
    for (rows, tiles) in [(None, 2), (Some(64), 1)] {
        let policy = Policy::Cuda(CudaPolicy { mma_rows: rows, ..CudaPolicy::default() });
        let prep = prepare(&s, &env, &policy).expect("prepares");
        let defines =
            [("ATTNC_HD_0", 96), ("ATTNC_BN_0", 64), ("ATTNC_MT_0", tiles), ("ATTNC_KS_0", 1), ("ATTNC_WS_0", 0), ("ATTNC_TMA_0", 0)]
                .map(|(k, v)| (k.to_string(), v));
        assert_eq!(prep.defines, defines.to_vec());
        let ready = launches(&p, &s, &prep, &limits).expect("launches");
        // 6 batch indices × the query blocks; the merge has no work (no split).
        assert_eq!(ready.len(), 1);
        let bm = 64 * tiles;
        assert_eq!(ready[0].grid, [6 * (130 + bm as u32 - 1) / bm as u32, 1, 1]);
        assert_eq!(ready[0].smem_bytes, (bm as u32 + 128) * (96 + 8) * 2);
        // Key tiles of 64: blocks below the diagonal full, on it partial, above it skipped.
        let entry = attn_compiler::schedule::tile_table::entry_bytes(bm as usize);
        let classes: Vec<u8> = prep.tables[0].1.chunks(entry).map(|e| e[0]).collect();
        let want: &[u8] = if tiles == 2 { &[2, 2, 0, 1, 1, 2] } else { &[2, 0, 0, 1, 2, 0, 1, 1, 2] };
        assert_eq!(classes, want);
        // Too little shared memory is an error, not a failed launch.
        assert!(matches!(launches(&p, &s, &prep, &DeviceLimits { max_smem_per_block: 1024 }), Err(LaunchError::SharedMemory { .. })));
    }
    // Empty tensors launch nothing.
    let empty: HashMap<String, i64> = [("B", 0), ("H", 3), ("S", 5), ("D", 8)].map(|(k, v)| (k.to_string(), v)).into();
    assert!(launches(&p, &s, &prepare(&s, &empty, &cuda()).expect("prepares"), &limits).expect("launches").is_empty());
}

#[test]
fn mma_row_tiles_follow_the_head_width_and_the_knob() {
    let with = |rows| CudaPolicy { mma_rows: rows, ..CudaPolicy::default() };
    assert_eq!([32, 64, 128, 160, 256].map(|hd| with(None).mma_row_tiles(hd)), [2, 2, 2, 1, 1]);
    assert_eq!([64, 128, 256].map(|hd| with(Some(64)).mma_row_tiles(hd)), [1, 1, 1]);
    // More rows than the width allows, or an odd request, is clamped, never an error.
    assert_eq!([64, 256].map(|hd| with(Some(128)).mma_row_tiles(hd)), [2, 1]);
    assert_eq!([with(Some(1)).mma_row_tiles(64), with(Some(4096)).mma_row_tiles(64)], [1, 2]);
}

#[test]
fn kv_stages_and_warp_specialisation_follow_hoppers_tiles_and_the_room() {
    let hopper = CudaPolicy { wgmma: true, max_smem_per_block: 232_448, ..CudaPolicy::default() };
    // Two stages where the pipelined tile runs (widths 64 and 128, keys 64, two m-tiles).
    assert_eq!([(64, 64, 2), (128, 64, 2)].map(|(h, k, t)| hopper.mma_kv_stages(h, k, t)), [2, 2]);
    // One elsewhere: other widths, one m-tile, no warpgroup products, too little room, the knob.
    assert_eq!([(96, 64, 2), (256, 32, 1), (128, 64, 1)].map(|(h, k, t)| hopper.mma_kv_stages(h, k, t)), [1, 1, 1]);
    assert_eq!(CudaPolicy { wgmma: false, ..hopper }.mma_kv_stages(128, 64, 2), 1);
    assert_eq!(CudaPolicy { max_smem_per_block: 99_000, ..hopper }.mma_kv_stages(128, 64, 2), 1);
    assert_eq!(CudaPolicy { kv_stages: Some(1), ..hopper }.mma_kv_stages(128, 64, 2), 1);
    assert_eq!(CudaPolicy { kv_stages: Some(7), ..hopper }.mma_kv_stages(64, 64, 2), 2);
    // The warp-specialised block wherever the two stages run, unless the knob says no.
    assert!(hopper.mma_warp_specialized(128, 64, 2) && hopper.mma_warp_specialized(64, 64, 2));
    assert!(!hopper.mma_warp_specialized(96, 64, 2) && !CudaPolicy { kv_stages: Some(1), ..hopper }.mma_warp_specialized(128, 64, 2));
    assert!(!CudaPolicy { warp_specialize: false, ..hopper }.mma_warp_specialized(128, 64, 2));
    // The launch gives the kernel the stages' bytes: Q's 128 rows and two K and V tiles at
    // width 128, plus 1024 for the swizzle's alignment and 64 for the ring's mbarriers; one
    // stage keeps the skewed rows. The warp-specialised block has 384 threads, the others 128.
    let g = flash_graph("f16", "B, H, S, D", "B, H, S, D", "s", None, "softmax");
    assert_eq!([hopper.mma_ring_stages(128, 64, 2), CudaPolicy { kv_stages: Some(2), ..hopper }.mma_ring_stages(128, 64, 2)], [3, 2]);
    assert_eq!(CudaPolicy { max_smem_per_block: 120_000, ..hopper }.mma_ring_stages(128, 64, 2), 2);
    let two = (128 + 4 * 64) * 128 * 2 + 1024 + 64;
    for (policy, bytes, threads) in [
        (hopper, (128 + 6 * 64) * 128 * 2 + 1024 + 64, 384),
        (CudaPolicy { kv_stages: Some(2), ..hopper }, two, 384),
        (CudaPolicy { warp_specialize: false, ..hopper }, two, 128),
        (CudaPolicy { kv_stages: Some(1), ..hopper }, (128 + 2 * 64) * 136 * 2, 128),
    ] {
        let policy = Policy::Cuda(policy);
        let s = schedule(&g, &policy).expect("schedules");
        let env: HashMap<String, i64> = [("B", 1), ("H", 2), ("S", 300), ("D", 128)].map(|(k, v)| (k.to_string(), v)).into();
        let prep = prepare(&s, &env, &policy).expect("prepares");
        let program = render(&s).expect("renders");
        let ready = launches(&program, &s, &prep, &DeviceLimits { max_smem_per_block: 232_448 }).expect("launches");
        assert_eq!(ready[0].smem_bytes, bytes as u32);
        assert_eq!(ready[0].block, [threads, 1, 1]);
    }
}

#[test]
fn decode_splits_follow_the_device() {
    let g = flash_graph("f32", "B, H, 1, D", "B, H, T, D", "s", None, "softmax");
    let policy = Policy::Cuda(CudaPolicy { sm_count: 132, max_smem_per_block: 232_448, ..CudaPolicy::default() });
    let s = schedule(&g, &policy).expect("schedules");
    let env: HashMap<String, i64> = [("B", 1), ("H", 8), ("T", 32768), ("D", 128)].map(|(k, v)| (k.to_string(), v)).into();
    let prep = prepare(&s, &env, &policy).expect("prepares");
    let get = |t| prep.ints[s.tuning(0, t).expect("in the table")];
    // 132 SMs × 32 warps over 8 (batch × heads) = 528 splits of the 1024 chunks of 32 keys.
    assert_eq!(get(attn_compiler::schedule::Tuning::Splits), 528);
    assert_eq!(get(attn_compiler::schedule::Tuning::Items), 8 * 528);
    assert_eq!(prep.ints[s.steps[1].work], 8);
    let partials = s.buffers.iter().position(|b| matches!(b.kind, BufferKind::Partials { .. })).expect("partials");
    assert_eq!(prep.elems[partials], 8 * 528 * (128 + 2));
}

#[test]
fn a_cpu_schedule_is_refused() {
    let g = flash_graph("f32", "B, H, S, D", "B, H, S, D", "s", None, "softmax");
    let s = schedule(&g, &Policy::default()).expect("schedules");
    assert!(matches!(render(&s), Err(CudaEmitError::Target { .. })));
}
