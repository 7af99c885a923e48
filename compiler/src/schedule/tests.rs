//! Scheduling decisions, checked on small programs: what is fused, what is a view, what the
//! flash analyses find, and that every example schedules for both targets.

use super::*;
use crate::ir::{ScoreExpr, ShowExpr, parse_expr};
use std::collections::HashMap;

fn examples() -> Vec<(String, String)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut out: Vec<(String, String)> = std::fs::read_dir(&dir)
        .expect("examples dir")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "attn"))
        .map(|p| (p.display().to_string(), std::fs::read_to_string(&p).expect("readable")))
        .collect();
    out.sort();
    out
}

/// A causal softmax flash op over q, k, v of `dtype[B, H, S, width]`, with `score`, as the
/// optimizer makes it.
fn causal_flash(dtype: &str, width: &str, score: &str) -> Graph {
    let ty = format!("{dtype}[B, H, S, {width}]");
    format!(
        "graph attn {{
  %0 = param[name=q] : {ty}
  %1 = param[name=k] : {ty}
  %2 = param[name=v] : {ty}
  %3 = flash[rank=4, weights=softmax, score=\"{score}\", mask=\"j <= i\"] %0, %1, %2 : {ty}
  output out = %3
}}"
    )
    .parse()
    .expect("parses")
}

/// The kernel kinds of the last graph's steps, and how many temporaries the schedule holds.
fn plan_of(src: &str, optimise: bool) -> (Vec<&'static str>, usize) {
    let compiled = crate::check(src).expect("compiles");
    let module = if optimise { crate::opt::optimize_module(&compiled.module).0 } else { compiled.module };
    let g = module.graphs.last().expect("a graph");
    let s = schedule(g, &Policy::default()).expect("schedules");
    let kinds = s.steps.iter().map(|s| s.kernel.name()).collect();
    let temps = s.buffers.iter().filter(|b| b.kind == BufferKind::Temp).count();
    (kinds, temps)
}

#[test]
fn every_example_schedules_for_every_target() {
    for (name, src) in examples() {
        let compiled = crate::check(&src).unwrap_or_else(|_| panic!("{name} compiles"));
        let (opt, _) = crate::opt::optimize_module(&compiled.module);
        for g in compiled.module.graphs.iter().chain(&opt.graphs) {
            for policy in [Policy::Cpu(CpuPolicy::default()), Policy::Cuda(CudaPolicy::default())] {
                let s = schedule(g, &policy).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(s.outputs.len(), g.outputs().len(), "{name}");
                assert!(s.steps.iter().all(|st| s.ints.get(st.work).is_some()), "{name}: a step without work items");
                assert!(s.to_string().starts_with(&format!("schedule {} for", g.name)));
            }
        }
    }
}

#[test]
fn fused_attention_is_one_kernel_without_temporaries() {
    let src = "fn f(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D]) -> f32[B, H, S, D] {
        return softmax(q @ k.T / sqrt(D), axis = -1) @ v }";
    // The query scale folds into the Q·Kᵀ product: no scaled copy of q.
    assert_eq!(plan_of(src, true), (vec!["flash", "flash_merge"], 0));
    // Unfused: matmul with K read transposed in place, the scale fused into the softmax input.
    assert_eq!(plan_of(src, false), (vec!["matmul", "elementwise", "softmax", "matmul"], 3));
}

#[test]
fn reductions_compute_their_operand_and_cheap_shared_values_are_recomputed() {
    // Location attention's window: the distance feeds two products (recomputed: one op), and
    // the sum over K computes its operand, so nothing of [B, K, U] is stored.
    let src = "fn f(kappa: f32[B, K, 1], beta: f32[B, K, 1], u: f32[U]) -> f32[B, 1, U] {
        let d = kappa - u
        return sum(exp(-beta * d * d), axis = 1, keepdim = true) }";
    assert_eq!(plan_of(src, false), (vec!["reduce"], 0));
    // Over the last axis too.
    let src = "fn f(x: f32[N, M]) -> f32[N] { return sum(exp(x), axis = -1) }";
    assert_eq!(plan_of(src, false), (vec!["reduce"], 0));
    // A value that is also an output is stored, and the reduction reads it.
    let src = "fn f(x: f32[N, M]) -> (e: f32[N, M], s: f32[N]) {
        let e = exp(x)
        return e, sum(e, axis = -1) }";
    assert_eq!(plan_of(src, false), (vec!["elementwise", "reduce"], 0));
    // An `exp` with two users is stored once, not computed by each.
    let src = "fn f(x: f32[N, M]) -> (a: f32[N, M], b: f32[N, M]) {
        let e = exp(x)
        return e + 1.0, e * 2.0 }";
    assert_eq!(plan_of(src, false), (vec!["elementwise"; 3], 1));
}

#[test]
fn element_wise_chains_fuse_and_layout_ops_are_views() {
    let src = "fn f(x: f32[N, M], y: f32[M]) -> f32[M, N] {
        return transpose(exp(x * 2.0 + y) - 1.0, 0, 1) }";
    let (kinds, _) = plan_of(src, false);
    // One loop for the whole chain, and the transpose read as a strided view by the output copy.
    assert_eq!(kinds, ["elementwise", "elementwise"]);
}

#[test]
fn concatenated_parts_of_one_shape_are_one_pass() {
    // RoPE's halves: one step computes both, over shared loads of x's two halves.
    let src = "fn f(x: f32[S, 2*D], c: f32[S, D], s: f32[S, D]) -> f32[S, 2*D] {
        let a = x[:, 0:D]
        let b = x[:, D:2*D]
        return concat([a * c - b * s, b * c + a * s], axis = -1) }";
    let compiled = crate::check(src).expect("compiles");
    let g = compiled.module.graphs.last().expect("a graph");
    let plan = schedule(g, &Policy::default()).expect("schedules");
    let parts: Vec<(usize, usize)> = plan
        .steps
        .iter()
        .filter_map(|st| match &st.kernel {
            Kernel::Elementwise { inputs, more, .. } => Some((inputs.len(), more.len())),
            _ => None,
        })
        .collect();
    assert_eq!(parts, [(4, 1)], "one step, two outputs, four shared loads:\n{plan}");
    // Parts of different shapes stay a pass each.
    let (kinds, _) = plan_of("fn f(x: f32[N, 2], y: f32[N, 3]) -> f32[N, 5] { return concat([x * 2.0, y + 1.0], axis = -1) }", false);
    assert_eq!(kinds, ["elementwise", "elementwise"]);
}

#[test]
fn variants_follow_the_target_and_dtypes() {
    let g = causal_flash("f16", "64", "s * 0.125");
    let variant = |policy: &Policy| match &schedule(&g, policy).expect("schedules").steps[0].kernel {
        Kernel::Flash(f) => f.variant,
        other => panic!("{}", other.name()),
    };
    assert_eq!(variant(&Policy::default()), Variant::Tiled);
    assert_eq!(variant(&Policy::Cuda(CudaPolicy::default())), Variant::TensorCore);
    let decode: Graph = g
        .to_string()
        .replace("S, 64]\n  %1", "1, 64]\n  %1")
        .replace("f16[B, H, S, 64]\n  output", "f16[B, H, 1, 64]\n  output")
        .parse()
        .expect("parses");
    let s = schedule(&decode, &Policy::Cuda(CudaPolicy::default())).expect("schedules");
    assert!(matches!(&s.steps[0].kernel, Kernel::Flash(f) if f.variant == Variant::SplitKv));
}

#[test]
fn the_cuda_backward_takes_tensor_cores_for_half_operands_and_their_extra_gradients() {
    // `dtype` of q, k, v; `result` of the op (an f32 bias may widen it to f32).
    let text = |dtype: &str, result: &str| {
        format!(
            "graph attn {{
  %0 = param[name=q] : {dtype}[B, H, S, 64]
  %1 = param[name=k] : {dtype}[B, H, S, 64]
  %2 = param[name=v] : {dtype}[B, H, S, 64]
  %3 = param[name=slopes] : f32[H]
  %4 = flash[rank=4, weights=softmax, score=\"s * 0.125 + x0[h] * (j - i)\", mask=\"j <= i\"] %0, %1, %2, %3 : {result}[B, H, S, 64]
  output out = %4
}}"
        )
    };
    let variant = |dtype: &str, wrt: Option<&[String]>, policy: &Policy| {
        let (dtype, result) = dtype.split_once('>').unwrap_or((dtype, dtype));
        let g: Graph = text(dtype, result).parse().expect("parses");
        let derived = crate::ir::grad::differentiate(&g, wrt).expect("differentiates");
        let s = schedule(&derived, policy).expect("schedules");
        let found = s.steps.iter().find_map(|st| match &st.kernel {
            Kernel::FlashBwd(f) => Some(f.variant),
            _ => None,
        });
        found.expect("a flash backward step")
    };
    let qkv: Vec<String> = ["q", "k", "v"].map(String::from).to_vec();
    let cuda = Policy::Cuda(CudaPolicy::default());
    assert_eq!(variant("f16", Some(&qkv), &cuda), Variant::TensorCore);
    assert_eq!(variant("bf16", Some(&qkv), &cuda), Variant::TensorCore);
    // An f32 result (so an f32 d_out) is rounded to the operands' type on staging.
    assert_eq!(variant("f16>f32", Some(&qkv), &cuda), Variant::TensorCore);
    // The slopes' gradient is one sum per item (its index is the head's): tensor cores too.
    assert_eq!(variant("f16", None, &cuda), Variant::TensorCore);
    // A gradient scattered over its operand (a bias by relative position): tensor cores, which
    // add it atomically, except in the deterministic mode (SIMT). f32 operands take SIMT.
    let scattered: Graph =
        text("f16", "f16").replace("f32[H]", "f32[H, R]").replace("x0[h]", "x0[h, (j - i) % dim(R)]").parse().expect("parses");
    let derived = crate::ir::grad::differentiate(&scattered, None).expect("differentiates");
    for (policy, want) in [
        (CudaPolicy::default(), Variant::TensorCore),
        (CudaPolicy { deterministic_backward: true, ..CudaPolicy::default() }, Variant::Simt),
    ] {
        let s = schedule(&derived, &Policy::Cuda(policy)).expect("schedules");
        let f = s.steps.iter().find_map(|st| match &st.kernel {
            Kernel::FlashBwd(f) => Some(f),
            _ => None,
        });
        let f = f.expect("a flash backward step");
        assert!(!f.extra_grads_are_item_sums(), "the bias's gradient is scattered");
        assert_eq!(f.variant, want, "{policy:?}");
    }
    assert_eq!(variant("f32", Some(&qkv), &cuda), Variant::Simt);
    assert_eq!(variant("f16", Some(&qkv), &Policy::default()), Variant::Tiled);
    // The comparison knob.
    assert_eq!(variant("f16", Some(&qkv), &Policy::Cuda(CudaPolicy { simt_backward: true, ..CudaPolicy::default() })), Variant::Simt);
}

/// On CUDA the rows' `delta` is a reduction step just before the backward, into a buffer of the
/// log-sum-exp's layout that the backward reads; the CPU's backward forms it per row.
#[test]
fn the_cuda_backward_reads_delta_from_the_step_before() {
    let g = causal_flash("f16", "64", "s * 0.125");
    let derived = crate::ir::grad::differentiate(&g, None).expect("differentiates");
    let backward = |s: &Schedule| {
        s.steps.iter().enumerate().find_map(|(n, st)| match &st.kernel {
            Kernel::FlashBwd(f) => Some((n, f.clone())),
            _ => None,
        })
    };
    let s = schedule(&derived, &Policy::Cuda(CudaPolicy::default())).expect("schedules");
    let (n, f) = backward(&s).expect("a flash backward step");
    let delta = f.delta.as_ref().expect("CUDA reads delta from a buffer");
    let (lse, out) = f.lse.as_ref().expect("softmax weights");
    assert_eq!(delta.strides, lse.strides);
    // (Between them, the step zeroing the atomic dQ: see the next test.)
    let Kernel::ReduceOf { x, op, axes, out: sums } = &s.steps[n - 2].kernel else {
        panic!("the step two before is {:?}", s.steps[n - 2].kernel)
    };
    assert_eq!((*op, axes.as_slice(), sums.buf), (ReduceOp::Sum, &[3][..], delta.buf));
    assert_eq!(x.inputs.iter().map(|v| v.buf).collect::<Vec<_>>(), vec![f.d_out.buf, out.buf]);
    assert!(s.steps[n].reads.contains(&delta.buf), "the backward's reads name the delta buffer");
    let cpu = schedule(&derived, &Policy::default()).expect("schedules");
    let (n, f) = backward(&cpu).expect("a flash backward step");
    assert!(f.delta.is_none());
    assert!(!matches!(cpu.steps[n - 1].kernel, Kernel::ReduceOf { .. }));
}

/// CUDA's tensor-core backward adds dQ atomically into an f32 buffer that the step before
/// zeroes and the step after rounds into the query gradient; the deterministic mode, the SIMT
/// kernel and the CPU write dQ themselves.
#[test]
fn the_cuda_tensor_core_backward_sums_dq_atomically_unless_deterministic() {
    let g = causal_flash("f16", "64", "s * 0.125");
    let derived = crate::ir::grad::differentiate(&g, None).expect("differentiates");
    let backward = |policy: CudaPolicy| {
        let s = schedule(&derived, &Policy::Cuda(policy)).expect("schedules");
        let found = s.steps.iter().enumerate().find_map(|(n, st)| match &st.kernel {
            Kernel::FlashBwd(f) => Some((n, f.clone())),
            _ => None,
        });
        let (n, f) = found.expect("a flash backward step");
        (s, n, f)
    };
    let (s, n, f) = backward(CudaPolicy::default());
    assert_eq!(f.variant, Variant::TensorCore);
    assert!(f.dq.is_none(), "no query items");
    let acc = f.dq_accum.as_ref().expect("dQ is summed atomically");
    assert_eq!((acc.dtype, acc.shape.clone()), (DType::F32, f.q.shape.clone()));
    let Kernel::Elementwise { out, inputs, expr: Expr::Const(c, _), .. } = &s.steps[n - 1].kernel else {
        panic!("the step before is {:?}", s.steps[n - 1].kernel)
    };
    assert_eq!((out.buf, inputs.len(), *c), (acc.buf, 0, 0.0));
    assert!(s.steps[n].writes.contains(&acc.buf));
    let Kernel::Elementwise { out: dq, inputs, expr: Expr::Cast(_, t), .. } = &s.steps[n + 1].kernel else {
        panic!("the step after is {:?}", s.steps[n + 1].kernel)
    };
    assert_eq!((inputs[0].buf, dq.dtype, *t), (acc.buf, DType::F16, DType::F16));
    for policy in
        [CudaPolicy { deterministic_backward: true, ..CudaPolicy::default() }, CudaPolicy { simt_backward: true, ..CudaPolicy::default() }]
    {
        let (_, _, f) = backward(policy);
        assert!(f.dq.is_some() && f.dq_accum.is_none(), "{policy:?}");
    }
}

#[test]
fn score_scales_split_from_positions() {
    let e = |t: &str| parse_expr(t, 4).expect("parses");
    assert_eq!(split_scale(&e("s * 0.125")), (ScoreExpr::Score, Some(ScoreExpr::Float(0.125))));
    let (s, a) = split_scale(&e("s / dim(D)"));
    assert_eq!(s, ScoreExpr::Score);
    assert!(a.is_some());
    // A position-dependent factor stays in the per-element code.
    assert_eq!(split_scale(&e("s * (j - i)")), (e("s * (j - i)"), None));
    // Soft-capping: the division inside tanh rides on the product, and tanh(s) can be staged.
    let (s, a) = split_scale(&e("50.0 * tanh(s / 50.0)"));
    assert_eq!(s, e("50.0 * tanh(s)"));
    assert_eq!(a, Some(e("1.0 / 50.0")));
    assert_eq!(tanh_staged(&s), Some(e("50.0 * s")));
    // Every use at the one scale, in a select and a bias too.
    assert_eq!(split_scale(&e("where(s * 2.0 > 0.0, s * 2.0, 0.0) + x0[h]")), (e("where(s > 0.0, s, 0.0) + x0[h]"), Some(e("2.0"))));
    // The score also read bare, at two scales, or scaled by a position: nothing splits.
    for t in ["tanh(s / 50.0) + s", "tanh(s / 50.0) + s * 2.0", "tanh(s / 50.0) * (s * j)", "tanh(s / j)"] {
        assert_eq!(split_scale(&e(t)), (e(t), None), "{t}");
    }
}

#[test]
fn separable_score_terms_split_from_the_rest() {
    let e = |t: &str| parse_expr(t, 4).expect("parses");
    let show = |x: &ScoreExpr| ShowExpr { expr: x, rank: 4 }.to_string();
    let split = |t: &str| separate(&e(t), 4).map(|x| (show(&x.rest), show(&x.sep)));
    // ALiBi: the bias term is separable as written (slope · j − slope · i).
    assert_eq!(split("s + x0[h] * (j - i)"), Some(("s".into(), "x0[h] * (j - i)".into())));
    // Key-padding bias and a row-only term; the relative-position gather is not separable.
    assert_eq!(split("x0[b, j] - s * 2.0 + i"), Some(("-(s * 2.0)".into(), "x0[b, j] + i".into())));
    assert_eq!(split("s + x0[h, min(max(j - i, -16), 16) + 16]"), None);
    assert_eq!(split("s + (j - i) * (j - i)"), None);
    assert_eq!(split("s"), None);
    // Dividing by a position-free factor keeps separability; by a position, not.
    assert!(split("s + (j - i) / dim(S)").is_some());
    assert_eq!(split("s + (j - i) / j"), None);
}

#[test]
fn soft_capping_stages_tanh() {
    let e = |t: &str| parse_expr(t, 4).expect("parses");
    assert_eq!(tanh_staged(&e("50.0 * tanh(s)")), Some(e("50.0 * s")));
    assert_eq!(tanh_staged(&e("tanh(s) + x0[h] * j")), Some(e("s + x0[h] * j")));
    // The raw score read elsewhere, or tanh of something else: no staging.
    assert_eq!(tanh_staged(&e("tanh(s) + s")), None);
    assert_eq!(tanh_staged(&e("tanh(s * 2.0)")), None);
    assert_eq!(tanh_staged(&e("s")), None);
}

#[test]
fn prepare_sizes_blocks_tables_and_scratch() {
    let g = causal_flash("f32", "D", "s");
    let env: std::collections::HashMap<String, i64> = [("B", 2), ("H", 3), ("S", 300), ("D", 64)].map(|(k, v)| (k.to_string(), v)).into();
    let cpu = Policy::default();
    let s = schedule(&g, &cpu).expect("schedules");
    let p = prepare(&s, &env, &cpu).expect("prepares");
    let get = |t| p.ints[s.tuning(0, t).expect("in the table")];
    // Masked, S = 300: 128 × 128 blocks; 3 × 3 tiles per head; lower triangle runs.
    assert_eq!((get(Tuning::BlockM), get(Tuning::BlockN), get(Tuning::QueryBlocks), get(Tuning::KeyBlocks)), (128, 128, 3, 3));
    assert_eq!(get(Tuning::Items), 2 * 3 * 3);
    let entry = get(Tuning::TileEntryBytes) as usize;
    assert_eq!(entry, 1 + 2 * 4);
    let (buf, table) = &p.tables[0];
    let classes: Vec<u8> = table.chunks(entry).map(|e| e[0]).collect();
    assert_eq!(
        (*buf, classes),
        (s.buffers.iter().position(|b| b.kind == BufferKind::TileTable { step: 0 }).expect("a table"), vec![2, 0, 0, 1, 2, 0, 1, 1, 2])
    );
    let layout = flash_scratch(128, 128, 64, 0);
    assert_eq!((get(Tuning::ScratchAcc), p.scratch_bytes), (layout.acc as i64, layout.total));
    // CUDA: f32 runs the SIMT kernel, 16 × 32 tiles, the head width padded as a define.
    let cuda = Policy::Cuda(CudaPolicy::default());
    let s = schedule(&g, &cuda).expect("schedules");
    let p = prepare(&s, &env, &cuda).expect("prepares");
    assert_eq!(p.defines, vec![("ATTNC_HD_0".to_string(), 64)]);
    assert_eq!(p.ints[s.tuning(0, Tuning::Items).expect("items")], 2 * 3 * 19);
    // A slice outside its axis and a negative size are errors.
    let bad: std::collections::HashMap<String, i64> = [("B", 1), ("H", 1), ("S", -1), ("D", 4)].map(|(k, v)| (k.to_string(), v)).into();
    assert!(matches!(prepare(&schedule(&g, &cpu).expect("schedules"), &bad, &cpu), Err(PrepareError::Negative { .. })));
}

/// How many tiles of flash step `step`'s table are skipped, full and partial.
fn class_counts(s: &Schedule, p: &super::Prepared, step: usize) -> [usize; 3] {
    let entry = p.ints[s.tuning(step, Tuning::TileEntryBytes).expect("entry")] as usize;
    let Kernel::Flash(f) = &s.steps[step].kernel else { panic!("step {step} is not a flash step") };
    let table = &p.tables.iter().find(|(b, _)| *b == f.tiles).expect("the table").1;
    table.chunks(entry).fold([0; 3], |mut c, e| {
        c[e[0] as usize] += 1;
        c
    })
}

/// A window size given as a 0-d i32 input folds into the fused mask as `x0[]`, and a run that
/// gives its value (`scalar_param_key`) classifies tiles by it as it would a constant; without
/// the value every tile is partial (evaluated per element, still correct).
#[test]
fn a_window_given_as_an_input_classifies_tiles_by_its_value() {
    let src = include_str!("../../../tests/cases/flash/window_as_an_input.attn");
    let compiled = crate::check(src).expect("compiles");
    let g = crate::opt::optimize_module(&compiled.module).0.graphs.remove(0);
    let cpu = Policy::default();
    let s = schedule(&g, &cpu).expect("schedules");
    let Kernel::Flash(f) = &s.steps[0].kernel else { panic!("{:?}", s.steps[0].kernel) };
    assert!(f.spec.mask.as_ref().is_some_and(|m| ShowExpr { expr: m, rank: 4 }.to_string().contains("x0[]")), "{:?}", f.spec.mask);
    let classes = |w: Option<i64>| {
        let mut env: std::collections::HashMap<String, i64> =
            [("B", 1), ("H", 1), ("S", 1024), ("D", 64)].map(|(k, v)| (k.to_string(), v)).into();
        if let Some(w) = w {
            env.insert(crate::ir::scalar_param_key(3), w);
        }
        let p = prepare(&s, &env, &cpu).expect("prepares");
        class_counts(&s, &p, 0)
    };
    // 8 × 8 tiles of 128: a window of 100 keeps the diagonal and the one below it.
    assert_eq!(classes(Some(100)), [64 - 15, 0, 15]);
    assert_eq!(classes(Some(4096)), [28, 28, 8], "as causal");
    assert_eq!(classes(None), [28, 0, 36], "the diagonal's upper triangle is skipped either way");
}

/// Segment ids given as a 1-d i32 input (a packed ragged batch, `examples/varlen.attn`) classify
/// tiles by their values when the run gives them (`prepare_with`): every tile across two
/// sequences is skipped, one inside a sequence below the diagonal is full. Without the values
/// only the causal half is skipped.
#[test]
fn segment_ids_given_at_run_time_classify_tiles_by_their_values() {
    let src = include_str!("../../../examples/varlen.attn");
    let compiled = crate::check(src).expect("compiles");
    let g = crate::opt::optimize_module(&compiled.module).0.graphs.remove(0);
    let cpu = Policy::default();
    let s = schedule(&g, &cpu).expect("schedules");
    assert_eq!(super::mask_data_params(&s), vec![3]);
    let (bm, t) = (128usize, 1024usize);
    // Four sequences of 256 tokens: with 128-row tiles, each sequence is 2 × 2 tiles.
    let ids: Vec<i32> = (0..t).map(|x| (x / 256) as i32).collect();
    let classes = |data: bool| {
        let mut env: std::collections::HashMap<String, i64> =
            [("H", 1), ("T", t as i64), ("D", 64)].map(|(k, v)| (k.to_string(), v)).into();
        let mut tables = std::collections::HashMap::new();
        if data {
            env.insert(crate::ir::data_param_key(3), 1);
            tables.insert(3, std::sync::Arc::new(crate::ir::RangeTable::new(&ids)));
        }
        let p = super::prepare_with(&s, &env, &cpu, &tables).expect("prepares");
        assert_eq!(p.ints[s.tuning(0, Tuning::BlockM).expect("bm")] as usize, bm);
        class_counts(&s, &p, 0)
    };
    // 8 × 8 tiles: per sequence one full tile below the diagonal and two diagonal (partial).
    assert_eq!(classes(true), [64 - 12, 4, 8]);
    assert_eq!(classes(false), [28, 0, 36]);
}

#[test]
fn range_tables_give_the_range_of_any_span() {
    let values = [5, -3, 8, 8, 0, 2, 7, -1, 4];
    let t = crate::ir::RangeTable::new(&values);
    for lo in 0..values.len() {
        for hi in lo..values.len() {
            let span = &values[lo..=hi];
            let want = (*span.iter().min().expect("nonempty"), *span.iter().max().expect("nonempty"));
            assert_eq!(t.min_max(lo, hi), want, "{lo}..={hi}");
        }
    }
    assert_eq!(crate::ir::RangeTable::new(&[]).len(), 0);
}

/// 2-d ids (`seg[b, i]`, a batch of packed documents, `examples/document_mask.attn`) classify
/// the tiles of each batch index on the CPU: one table per batch index (`TileBatchDiv` 1 with one
/// head), each skipping what its own documents leave.
#[test]
fn per_batch_segment_ids_classify_each_batch_indexs_tiles() {
    let src = include_str!("../../../examples/document_mask.attn");
    let compiled = crate::check(src).expect("compiles");
    let g = crate::opt::optimize_module(&compiled.module).0.graphs.remove(0);
    let cpu = Policy::default();
    let s = schedule(&g, &cpu).expect("schedules");
    assert_eq!(super::mask_data_params(&s), vec![3]);
    let t = 1024usize;
    // Batch index 0: documents of 256 tokens; 1: of 512.
    let ids: Vec<i32> = (0..t).map(|x| (x / 256) as i32).chain((0..t).map(|x| (x / 512) as i32)).collect();
    let mut env: std::collections::HashMap<String, i64> =
        [("B", 2), ("H", 1), ("S", t as i64), ("D", 64)].map(|(k, v)| (k.to_string(), v)).into();
    env.insert(crate::ir::data_param_key(3), 1);
    let tables = [(3, std::sync::Arc::new(crate::ir::RangeTable::of_rows(&ids, t)))].into();
    let p = super::prepare_with(&s, &env, &cpu, &tables).expect("prepares");
    let classes = class_counts(&s, &p, 0);
    assert_eq!(p.ints[s.tuning(0, Tuning::TileBatchDiv).expect("div")], 1);
    // Two tables of 8 × 8 tiles of 128. Batch index 0, four documents of 2 × 2 tiles: in each one
    // tile below the diagonal full, two on it partial, the rest of the table skipped (52, 4,
    // 8). Batch index 1, two documents of 4 × 4 tiles: in each 6 below the diagonal full, 4 on
    // it partial (44, 12, 8).
    assert_eq!(classes, [96, 16, 16]);
}

/// Tiles classified from run-time tables are sound against the mask evaluated on every score
/// (a skipped tile keeps nothing, a full one masks nothing), for a ragged chunked prefill
/// (`examples/varlen_kv.attn`: sequence ids and positions for queries and keys, bottom-right
/// aligned), and the tables skip most of it.
#[test]
fn tiles_classified_from_tables_agree_with_the_mask_on_every_score() {
    use crate::ir::semantics::Scalar;
    use crate::ir::{Known, RangeTable, TileClass, classify_tile_known};
    let src = include_str!("../../../examples/varlen_kv.attn");
    let compiled = crate::check(src).expect("compiles");
    let g = crate::opt::optimize_module(&compiled.module).0.graphs.remove(0);
    let s = schedule(&g, &Policy::default()).expect("schedules");
    let Kernel::Flash(f) = &s.steps[0].kernel else { panic!("{:?}", s.steps[0].kernel) };
    let mask = f.spec.mask.clone().expect("a mask");
    let (q_lens, kv_lens) = ([100usize, 400, 3, 250], [300usize, 400, 700, 250]);
    let flat = |f: &dyn Fn(usize, usize) -> i32, lens: &[usize]| -> Vec<i32> {
        lens.iter().enumerate().flat_map(|(s, n)| (0..*n).map(move |x| f(s, x))).collect()
    };
    // The flash op's extras in operand order, as the mask names them (x0 ..): find each by the
    // parameter it reads.
    let by_param: std::collections::HashMap<usize, Vec<i32>> = [
        (3, flat(&|s, _| s as i32, &q_lens)),
        (4, flat(&|s, _| s as i32, &kv_lens)),
        (5, flat(&|s, x| (kv_lens[s] - q_lens[s] + x) as i32, &q_lens)),
        (6, flat(&|_, x| x as i32, &kv_lens)),
    ]
    .into();
    let extras: Vec<Vec<i32>> = f
        .extras
        .iter()
        .map(|x| match s.buffers[x.buf].kind {
            BufferKind::Param(i) => by_param[&i].clone(),
            ref other => panic!("{other:?}"),
        })
        .collect();
    let data = extras.iter().enumerate().map(|(n, v)| (n, std::sync::Arc::new(RangeTable::new(v)))).collect();
    let env = std::collections::HashMap::new();
    let known = Known { env: &env, data: &data };
    let load = |input: usize, idx: &[i64]| Scalar::I(extras[input][idx[0] as usize]);
    let (m, n, t) = (q_lens.iter().sum::<usize>() as i64, kv_lens.iter().sum::<usize>() as i64, 64);
    let (mut counts, mut skippable) = ([0usize; 3], 0);
    for r0 in (0..m).step_by(t as usize) {
        for c0 in (0..n).step_by(t as usize) {
            let (rows, cols) = ((r0, (r0 + t).min(m)), (c0, (c0 + t).min(n)));
            let class = classify_tile_known(Some(&mask), &[1], rows, cols, &known);
            counts[class as usize] += 1;
            let kept = |i: i64, j: i64| matches!(mask.eval(0.0, &[0, i, j], &env, &load), Scalar::B(true));
            let all: Vec<bool> = (rows.0..rows.1).flat_map(|i| (cols.0..cols.1).map(move |j| (i, j))).map(|(i, j)| kept(i, j)).collect();
            skippable += usize::from(all.iter().all(|k| !k));
            match class {
                TileClass::Skip => assert!(all.iter().all(|k| !k), "skipped tile {rows:?} × {cols:?} keeps a score"),
                TileClass::Full => assert!(all.iter().all(|k| *k), "full tile {rows:?} × {cols:?} masks a score"),
                TileClass::Partial => {}
            }
        }
    }
    // 12 × 26 tiles: every tile that keeps no score is skipped but those whose rows or keys
    // straddle two sequences (the ranges of ids then meet).
    assert!(counts[TileClass::Skip as usize] * 10 >= skippable * 9, "{counts:?} of which {skippable} keep nothing");
}

/// Above `MAX_VALUES`, and at three axes or more, a table keeps block bounds: small, exact on
/// block boundaries, and a bound that holds for any other box. Checked against every value of
/// random boxes of random i32 and bool operands.
#[test]
fn block_bounds_hold_for_every_box_and_are_exact_on_block_boundaries() {
    use crate::ir::RangeTable;
    let big = RangeTable::new(&vec![0; RangeTable::MAX_VALUES + 1]);
    assert!(!big.is_empty() && !RangeTable::is_exact(big.shape()));
    assert_eq!(big.min_max(5, RangeTable::MAX_VALUES), (0, 0));
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let shape = [3usize, 2, 37, 45];
    let total: usize = shape.iter().product();
    let ints: Vec<i32> = (0..total).map(|_| next(1000) as i32 - 500).collect();
    // Bools in runs, so that whole blocks of one value occur.
    let bools: Vec<bool> = (0..total).map(|x| (x / 45 % 37 / 16 + x % 45 / 16 + x / (37 * 45)) % 3 != 0 || x % 7 == 0).collect();
    let tables = [
        (RangeTable::of_operand(&ints, &shape), ints.clone()),
        (RangeTable::of_bools(&bools, &shape), bools.iter().map(|b| i32::from(*b)).collect()),
    ];
    for (table, values) in &tables {
        for round in 0..400 {
            let aligned = round % 2 == 0;
            let spans: Vec<(usize, usize)> = shape
                .iter()
                .enumerate()
                .map(|(a, n)| {
                    if aligned && a >= 2 {
                        let lo = next(n.div_ceil(16)) * 16;
                        (lo, (lo + 16 * (1 + next(3))).min(*n) - 1)
                    } else {
                        let (x, y) = (next(*n), next(*n));
                        (x.min(y), x.max(y))
                    }
                })
                .collect();
            let mut want = (i32::MAX, i32::MIN);
            for (x, v) in values.iter().enumerate() {
                let at = [x / (2 * 37 * 45), x / (37 * 45) % 2, x / 45 % 37, x % 45];
                if at.iter().zip(&spans).all(|(i, (lo, hi))| lo <= i && i <= hi) {
                    want = (want.0.min(*v), want.1.max(*v));
                }
            }
            let got = table.min_max_spans(&spans).expect("a box in range");
            if aligned {
                assert_eq!(got, want, "{spans:?}");
            } else {
                assert!(got.0 <= want.0 && got.1 >= want.1, "{spans:?}: {got:?} does not bound {want:?}");
            }
        }
        assert_eq!(table.min_max_spans(&[(0, 0), (0, 0), (0, 0)]), None, "a box of the wrong rank");
        assert_eq!(table.min_max_spans(&[(0, 0), (0, 2), (0, 0), (0, 0)]), None, "a box out of range");
    }
}

/// A dense bool mask (`tests/cases/flash/dense_bool_mask.attn`, transformers' `[B, 1, L, S]`)
/// classifies the tiles every batch index shares from its block bounds: causal, with batch index
/// 0 left-padded by 100 keys.
#[test]
fn a_dense_bool_mask_classifies_tiles_from_its_block_bounds() {
    let src = include_str!("../../../tests/cases/flash/dense_bool_mask.attn");
    let compiled = crate::check(src).expect("compiles");
    // `masked`, then `masked_gqa` (which reads the mask as `[B, 1, 1, L, S]`).
    for g in crate::opt::optimize_module(&compiled.module).0.graphs {
        let cpu = Policy::default();
        let s = schedule(&g, &cpu).expect("schedules");
        assert_eq!(super::mask_data_params(&s), vec![3]);
        assert!(super::id_data_params(&s).is_empty(), "a dense mask is not copied to the host for the GPU");
        let (b, t) = (2usize, 1024usize);
        let pad = [100usize, 0];
        let values: Vec<bool> = (0..b * t * t).map(|x| (x % t) <= (x / t % t) && (x % t) >= pad[x / (t * t)]).collect();
        let classes = |data: bool| {
            let mut env: std::collections::HashMap<String, i64> =
                [("B", b as i64), ("H", 4), ("Hk", 2), ("G", 2), ("L", t as i64), ("S", t as i64), ("D", 64)]
                    .map(|(k, v)| (k.to_string(), v))
                    .into();
            let mut tables = std::collections::HashMap::new();
            if data {
                let table = crate::ir::RangeTable::of_bools(&values, &[b, 1, t, t]);
                env.insert(crate::ir::data_param_key(3), table.content_key());
                tables.insert(3, std::sync::Arc::new(table));
            }
            let p = super::prepare_with(&s, &env, &cpu, &tables).expect("prepares");
            assert_eq!(p.ints[s.tuning(0, Tuning::BlockM).expect("bm")], 128);
            (class_counts(&s, &p, 0), p.ints[s.tuning(0, Tuning::TileBatchDiv).expect("div")])
        };
        // One table per batch index (the 4 heads of each share it), 8 × 8 tiles of 128. Both:
        // the 28 above the diagonal skipped, the 8 on it partial. Below it, batch index 0 (its
        // first 100 keys masked): the 7 of key tile 0 partial, the other 21 full; batch index 1:
        // all 28 full.
        assert_eq!(classes(true), ([56, 49, 23], 4), "{}", g.name);
        // Without the mask's values, one table for the whole batch, every tile partial.
        assert_eq!(classes(false), ([0, 0, 64], 8));
    }
}

/// Per-sequence lengths given at run time (`lens[b]`, `examples/paged_decode.attn`) skip every
/// key tile past the longest sequence's end (the table all sequences share).
#[test]
fn lengths_given_at_run_time_skip_the_tiles_past_every_sequence() {
    let src = include_str!("../../../examples/paged_decode.attn");
    let compiled = crate::check(src).expect("compiles");
    let g = crate::opt::optimize_module(&compiled.module).0.graphs.remove(0);
    let cpu = Policy::default();
    let s = schedule(&g, &cpu).expect("schedules");
    let step = s.steps.iter().position(|st| matches!(st.kernel, Kernel::Flash(_))).expect("a flash step");
    let lens_param = 4;
    assert!(super::mask_data_params(&s).contains(&lens_param));
    // 64 pages of 16 per sequence: 1024 token slots; the sequences hold 100 and 300 tokens.
    let mut env: std::collections::HashMap<String, i64> =
        [("B", 2), ("H", 1), ("M", 1), ("D", 64), ("NP", 128), ("P", 16), ("MP", 64)].map(|(k, v)| (k.to_string(), v)).into();
    env.insert(crate::ir::data_param_key(lens_param), 1);
    let tables = [(lens_param, std::sync::Arc::new(crate::ir::RangeTable::new(&[100, 300])))].into();
    let p = super::prepare_with(&s, &env, &cpu, &tables).expect("prepares");
    let entry = p.ints[s.tuning(step, Tuning::TileEntryBytes).expect("entry")] as usize;
    let bn = p.ints[s.tuning(step, Tuning::BlockN).expect("bn")] as usize;
    let Kernel::Flash(f) = &s.steps[step].kernel else { unreachable!() };
    let table = &p.tables.iter().find(|(b, _)| *b == f.tiles).expect("the table").1;
    let classes: Vec<u8> = table.chunks(entry).map(|e| e[0]).collect();
    // One query row: one row of key tiles; a tile from key 300 on keeps nothing.
    let live = classes.iter().filter(|c| **c != 0).count();
    assert_eq!(live, 300usize.div_ceil(bn), "{classes:?} (tiles of {bn} keys)");
}

/// Decode against a paged cache walks the heads of a sequence together (`HeadGroup`), as many as
/// leave `MIN_ITEMS` work items (the merge still takes one item per head); prefill, or a group
/// forced to 1, takes one head per item.
#[test]
fn paged_decode_groups_heads_while_enough_items_are_left() {
    let src = include_str!("../../../examples/paged_decode.attn");
    let compiled = crate::check(src).expect("compiles");
    let g = crate::opt::optimize_module(&compiled.module).0.graphs.remove(0);
    let run = |policy: &Policy, (b, h, m, n): (i64, i64, i64, i64)| {
        let s = schedule(&g, policy).expect("schedules");
        let env: std::collections::HashMap<String, i64> =
            [("B", b), ("H", h), ("M", m), ("D", 64), ("NP", b * n / 16), ("P", 16), ("MP", n / 16)]
                .map(|(k, v)| (k.to_string(), v))
                .into();
        let p = prepare(&s, &env, policy).expect("prepares");
        let get = |step, t| p.ints[s.tuning(step, t).expect("in the table")];
        (get(0, Tuning::HeadGroup), get(0, Tuning::Items), get(1, Tuning::Items), p.scratch_bytes)
    };
    let cpu = Policy::default();
    // 32 heads, 32768 keys: 16 splits of the whole group.
    let (group, items, merge, bytes) = run(&cpu, (1, 32, 1, 32768));
    assert_eq!((group, items, merge), (32, 16, 32));
    assert_eq!(bytes, flash_scratch(32, 256, 64, 256 * 128).total);
    // 8 heads, no splits, 4 sequences: groups of 4 leave 8 items.
    let (group, items, ..) = run(&cpu, (4, 8, 1, 1024));
    assert_eq!((group, items), (4, 8));
    // More query rows than the few-rows products take: one head per item.
    assert_eq!(run(&cpu, (1, 32, 8, 32768)).0, 1);
    let one = Policy::Cpu(CpuPolicy { head_group: Some(1), ..CpuPolicy::default() });
    let (group, items, ..) = run(&one, (1, 32, 1, 32768));
    assert_eq!((group, items), (1, 512));
}

/// The warp-specialised Hopper forward loads K and V by TMA where their views allow: dense
/// `[B, H, S, D]` f16 operands get two maps (columns, rows, heads, batch; box 64 × the key tile)
/// and the step's `ATTNC_TMA` names the first; rows whose stride is not a multiple of 16 bytes,
/// f32 operands or the knob off take the threads' copies (no maps, `ATTNC_TMA` 0).
#[test]
fn hoppers_flash_forward_gets_tma_maps_where_the_views_allow() {
    let hopper = CudaPolicy { wgmma: true, max_smem_per_block: 232_448, ..CudaPolicy::default() };
    let env: HashMap<String, i64> = [("B", 2), ("H", 3), ("S", 200)].into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    let run = |dtype: &str, width: i64, policy: CudaPolicy| {
        let g = causal_flash(dtype, &width.to_string(), "s");
        let s = schedule(&g, &Policy::Cuda(policy)).expect("schedules");
        let p = prepare(&s, &env, &Policy::Cuda(policy)).expect("prepares");
        let define = p.defines.iter().find(|(n, _)| n == "ATTNC_TMA_0").map(|(_, v)| *v);
        (p.tma, define)
    };
    let (maps, define) = run("f16", 64, hopper);
    assert_eq!(define, Some(1));
    assert_eq!(maps.len(), 2, "K's and V's");
    for m in &maps {
        assert_eq!(m.dims, [64, 200, 3, 2]);
        assert_eq!(m.strides, [128, 200 * 128, 3 * 200 * 128]);
        assert_eq!(m.boxes, [64, 64, 1, 1]);
        assert_eq!(m.offset_bytes, 0);
    }
    // Rows of 60 halves (120 bytes): no TMA; nor for f32, nor with the knob off.
    assert_eq!(run("f16", 60, hopper), (Vec::new(), Some(0)));
    assert_eq!(run("f16", 64, CudaPolicy { tma: false, ..hopper }), (Vec::new(), Some(0)));
    assert!(run("f32", 64, hopper).0.is_empty());
}

/// A tensor map spans the batch axes its view moves along (a broadcast one, as K's head group
/// in grouped-query attention, stays out), innermost first, and refuses what TMA cannot read.
#[test]
fn tma_maps_follow_the_views_strides() {
    let d = |n: &str| Dim::sym(n);
    let c = Dim::constant;
    let env: HashMap<String, i64> =
        [("B", 2), ("Hk", 2), ("G", 4), ("S", 100), ("D", 128)].into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    // K as [B, S, Hk, D] in memory, seen as [B, Hk, 1, S, D] against a [B, Hk, G] batch.
    let k = View {
        buf: 1,
        dtype: DType::F16,
        offset: c(0),
        shape: vec![d("B"), d("Hk"), c(1), d("S"), d("D")],
        strides: vec![d("S").mul(&d("Hk")).mul(&d("D")), d("D"), c(0), d("Hk").mul(&d("D")), c(1)],
    };
    let batch = [d("B"), d("Hk"), d("G")];
    assert_eq!(tma_axes(&k, &batch), [1, 0]);
    let m = tma_map(&k, &batch, 64, &env).expect("a map");
    assert_eq!(
        (m.buf, m.dims.clone(), m.strides.clone(), m.boxes.clone()),
        (1, vec![128, 100, 2, 2], vec![512, 256, 100 * 512], vec![64, 64, 1, 1])
    );
    // An odd first element, non-unit columns, a 16-bit type only.
    assert!(tma_map(&View { offset: c(4), ..k.clone() }, &batch, 64, &env).is_none());
    let mut strided = k.clone();
    strided.strides[4] = c(2);
    assert!(tma_map(&strided, &batch, 64, &env).is_none());
    assert!(tma_map(&View { dtype: DType::F32, ..k.clone() }, &batch, 64, &env).is_none());
    assert!(tma_map(&View { offset: c(8), ..k }, &batch, 64, &env).is_some_and(|m| m.offset_bytes == 16));
}

#[test]
fn a_reshape_of_a_strided_view_is_a_view_where_its_axes_are_dense_among_themselves() {
    let d = |n: &str| Dim::sym(n);
    let c = Dim::constant;
    let dims = |names: &[&str]| names.iter().map(|n| Dim::parse(n).expect("a dim")).collect::<Vec<_>>();
    // q as transformers lays it out, [B, S, H*G, D], seen as [B, H*G, S, D].
    let hg = d("H").mul(&d("G"));
    let q = View {
        buf: 0,
        dtype: DType::F32,
        offset: c(0),
        shape: dims(&["B", "H*G", "S", "D"]),
        strides: vec![d("S").mul(&hg).mul(&d("D")), d("D"), hg.mul(&d("D")), c(1)],
    };
    // The heads split in place: H steps G heads, G one head.
    let split = q.reshaped(&dims(&["B", "H", "G", "S", "D"])).expect("a view");
    assert_eq!(split.strides, vec![q.strides[0].clone(), d("G").mul(&d("D")), d("D"), q.strides[2].clone(), c(1)]);
    // Merged back, and with a size-1 axis added (it steps nowhere).
    assert_eq!(split.reshaped(&q.shape).map(|v| v.strides), Some(q.strides.clone()));
    let unsqueezed = q.reshaped(&dims(&["B", "H*G", "1", "S", "D"])).expect("a view");
    assert_eq!(unsqueezed.strides[2], c(0));
    // Heads and positions are not dense with each other: merging them needs a copy.
    assert!(q.reshaped(&dims(&["B", "H*G*S", "D"])).is_none());
    // Sizes that only match for some dims (S into 2 × S/2) are not guessed.
    assert!(q.reshaped(&dims(&["B", "H*G", "2", "(S/2)", "D"])).is_none());
    assert!(q.reshaped(&dims(&["B", "H", "S", "D"])).is_none());
}
