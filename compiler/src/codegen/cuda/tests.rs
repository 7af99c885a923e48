//! Unit tests of the CUDA emitter: every example (as written and optimised) emits, hand-built
//! flash graphs pick the right kernel shape, and the launch arithmetic is right.

use super::*;
use crate::ir::{DType, Dim, FlashSpec, Graph, Op, ScoreExpr, TensorType, Weights, parse_expr};
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

fn ty(dtype: DType, shape: &[&str]) -> TensorType {
    TensorType::new(dtype, shape.iter().map(|d| Dim::parse(d).expect("dim")).collect())
}

/// `flash(q, k, v, extras...)` with the given shapes and expressions.
pub(crate) fn flash_graph(dtype: DType, q: &[&str], kv: &[&str], score: &str, mask: Option<&str>, weights: Weights) -> Graph {
    let rank = q.len();
    let mut g = Graph::new("attn");
    let qv = g.add(Op::Param("q".into()), ty(dtype, q), &[]);
    let kv_v = g.add(Op::Param("k".into()), ty(dtype, kv), &[]);
    let vv = g.add(Op::Param("v".into()), ty(dtype, kv), &[]);
    let mut args = vec![qv, kv_v, vv];
    let score = parse_expr(score, rank).expect("score");
    let mask = mask.map(|m| parse_expr(m, rank).expect("mask"));
    let mut uses_x0 = false;
    score.visit(&mut |e| uses_x0 |= matches!(e, ScoreExpr::Load { .. }));
    if let Some(m) = &mask {
        m.visit(&mut |e| uses_x0 |= matches!(e, ScoreExpr::Load { .. }));
    }
    if uses_x0 {
        let x0 = g.add(Op::Param("slopes".into()), ty(DType::F32, &[q[1]]), &[]);
        args.push(x0);
    }
    let mut out_shape: Vec<&str> = q[..rank - 1].to_vec();
    out_shape.push(kv[rank - 1]);
    let out = g.add(Op::Flash(Box::new(FlashSpec { rank, weights, score, mask })), ty(dtype, &out_shape), &args);
    g.add_output("out", out);
    g
}

#[test]
fn every_example_emits() {
    for (name, src) in examples() {
        let compiled = crate::compile(&src).unwrap_or_else(|d| panic!("{name}: {}", d[0]));
        for g in &compiled.module.graphs {
            let p = emit_graph(g).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(p.source.contains("ATTNC_KERNEL"), "{name}: no kernel");
            assert_eq!(p.inputs.len(), g.params().len());
            let opt = crate::opt::optimize(g, &crate::opt::OptOptions::default()).graph;
            let po = emit_graph(&opt).unwrap_or_else(|e| panic!("{name} (optimised): {e}"));
            assert_eq!(po.outputs.len(), g.outputs().len());
        }
    }
}

#[test]
fn kernel_shapes_follow_dtype_and_rows() {
    let s = "s * 0.125";
    let g = flash_graph(DType::F16, &["B", "H", "S", "64"], &["B", "H", "S", "64"], s, Some("j <= i"), Weights::Softmax);
    let p = emit_graph(&g).unwrap();
    assert!(p.source.contains("flash_mma") && p.source.contains("attnc_mma_h"));
    assert_eq!(p.tables.len(), 1);
    let g = flash_graph(DType::BF16, &["B", "H", "S", "128"], &["B", "H", "S", "128"], s, None, Weights::Softmax);
    assert!(emit_graph(&g).unwrap().source.contains("attnc_mma_b"));
    let g = flash_graph(DType::F32, &["B", "H", "S", "D"], &["B", "H", "S", "D"], s, None, Weights::Sigmoid);
    let p = emit_graph(&g).unwrap();
    assert!(p.source.contains("flash_simt") && p.source.contains("attnc_sigmoid(sc_)"));
    assert!(p.source.contains("#define ATTNC_HD_0 128"));
    let g = flash_graph(DType::F16, &["B", "H", "1", "128"], &["B", "H", "T", "128"], s, None, Weights::Softmax);
    let p = emit_graph(&g).unwrap();
    assert!(p.source.contains("flash_decode") && p.source.contains("flash_merge"));
    assert_eq!(p.splits.len(), 1);
    // GQA: k/v with one head broadcast over the query heads read with stride 0.
    let g = flash_graph(DType::F16, &["B", "H", "S", "64"], &["B", "1", "S", "64"], s, None, Weights::Softmax);
    let p = emit_graph(&g).unwrap();
    assert!(p.source.contains("const i64 koff_ = p0 * (64LL * d_S);"), "{}", p.source);
    // Too wide a head is refused at emission when constant.
    let g = flash_graph(DType::F16, &["B", "H", "S", "512"], &["B", "H", "S", "512"], s, None, Weights::Softmax);
    assert!(matches!(emit_graph(&g), Err(CudaEmitError::Unsupported { .. })));
}

#[test]
fn prepare_sizes_grids_and_tables() {
    let g = flash_graph(DType::F16, &["B", "H", "S", "D"], &["B", "H", "S", "D"], "s", Some("j <= i"), Weights::Softmax);
    let p = emit_graph(&g).unwrap();
    let env: HashMap<String, i64> = [("B", 2), ("H", 3), ("S", 130), ("D", 80)].map(|(k, v)| (k.to_string(), v)).into();
    let ready = p.prepare(&env, &DeviceLimits::default()).unwrap();
    assert_eq!(ready.defines, vec![("ATTNC_HD_0".to_string(), 96)]);
    assert_eq!(ready.launches.len(), 1);
    assert_eq!(ready.launches[0].grid, [3, 6, 1]);
    assert_eq!(ready.launches[0].smem_bytes, (64 + 128) * (96 + 8) * 2);
    // 3 x 3 tiles of 64: lower triangle full, diagonal partial, upper skipped.
    assert_eq!(ready.tables, vec![(4, vec![2, 0, 0, 1, 2, 0, 1, 1, 2])]);
    assert_eq!(ready.buffer_bytes[0], 2 * 3 * 130 * 80 * 2);
    // Wider than 256 fails with a clear error; an unknown dim too.
    let wide: HashMap<String, i64> = [("B", 1), ("H", 1), ("S", 4), ("D", 300)].map(|(k, v)| (k.to_string(), v)).into();
    assert!(matches!(p.prepare(&wide, &DeviceLimits::default()), Err(PrepareError::HeadDim { width: 300, .. })));
    assert!(matches!(p.prepare(&HashMap::new(), &DeviceLimits::default()), Err(PrepareError::UnboundDim(_))));
    // Empty tensors launch nothing.
    let empty: HashMap<String, i64> = [("B", 0), ("H", 3), ("S", 5), ("D", 8)].map(|(k, v)| (k.to_string(), v)).into();
    assert!(p.prepare(&empty, &DeviceLimits::default()).unwrap().launches.is_empty());
}

#[test]
fn decode_splits_follow_the_device() {
    let g = flash_graph(DType::F32, &["B", "H", "1", "D"], &["B", "H", "T", "D"], "s", None, Weights::Softmax);
    let p = emit_graph(&g).unwrap();
    let env: HashMap<String, i64> = [("B", 1), ("H", 8), ("T", 32768), ("D", 128)].map(|(k, v)| (k.to_string(), v)).into();
    let limits = DeviceLimits { sm_count: 132, max_smem_per_block: 232_448 };
    let ready = p.prepare(&env, &limits).unwrap();
    // 132 SMs x 32 warps over 8 (batch x heads) = 528 splits of the 1024 chunks of 32 keys.
    assert_eq!(ready.scalars, vec![528]);
    assert_eq!(ready.launches[0].grid, [132, 8, 1]);
    assert_eq!(ready.launches[1].grid, [1, 1, 1]);
    let partials = p.buffers.iter().position(|b| matches!(b.size, BufferSize::Partials(0))).unwrap();
    assert_eq!(ready.buffer_bytes[partials], 8 * 528 * (128 + 2) * 4);
}

#[test]
fn elementwise_chains_fuse_into_their_consumer() {
    let src = "fn f(x: f32[B, S], g: f32[S]) -> f32[B, S] { return softmax(x * 2.0 + g, axis = -1) }";
    let compiled = crate::compile(src).unwrap();
    let p = emit_graph(&compiled.module.graphs[0]).unwrap();
    // One kernel: the softmax reads x and g and computes the chain in place.
    assert_eq!(p.launches.len(), 1, "{}", p.source);
    assert_eq!(p.buffers.len(), 3);
}
