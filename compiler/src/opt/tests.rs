//! The optimizer's tests, and one-line equivalence checks for single rules; the rules' own
//! cases are files (`tests/cases/rules/*.ir`, [`rule_cases_rewrite_as_their_files_say`]).

use super::{OptOptions, optimize_with_rules};
use crate::ir::Graph;
use crate::opt::lang::load;
use crate::opt::rules::Rule;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

/// Runs one rule on `before` (IR text), extracts with the cost model, and compares the result's
/// canonical text with `after`.
pub(crate) fn check_rule(rule: Arc<dyn Rule>, before: &str, after: &str) {
    let graph = Graph::parse(before).unwrap_or_else(|e| panic!("bad test input: {e}"));
    let loaded = load(&graph);
    let name = rule.name();
    let out = optimize_with_rules(&graph, &OptOptions::default(), loaded, HashSet::new(), &[rule], Instant::now());
    assert!(out.report.fallback.is_none(), "fallback: {:?}", out.report.fallback);
    let (cost_before, cost_after) = out.report.cost;
    assert!(cost_after <= cost_before * (1.0 + 1e-9), "rule {name}: the cost went from {cost_before:e} to {cost_after:e}");
    assert_eq!(out.graph.to_string(), after, "rule {name} did not give the expected graph");
}

/// The rules' filetests: each `tests/cases/rules/*.ir` names a rule (`# rule: topic/name`), then
/// holds a graph and, after a `# after:` line, the graph that rule alone makes of it
/// ([`check_rule`]).
#[test]
fn rule_cases_rewrite_as_their_files_say() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/cases/rules");
    let mut files: Vec<_> = std::fs::read_dir(&dir).expect("the rule cases").filter_map(Result::ok).map(|e| e.path()).collect();
    files.retain(|p| p.extension().is_some_and(|x| x == "ir"));
    files.sort();
    assert!(files.len() >= 14, "{} rule cases in {}", files.len(), dir.display());
    let rules = super::all_rules(HashSet::new());
    for path in files {
        let text = std::fs::read_to_string(&path).expect("readable");
        let name = text.lines().find_map(|l| l.strip_prefix("# rule: ")).unwrap_or_else(|| panic!("{}: no `# rule:` line", path.display()));
        let rule = rules.iter().find(|r| r.name() == name.trim()).unwrap_or_else(|| panic!("{}: no rule `{name}`", path.display()));
        let (before, after) = text.split_once("\n# after:\n").unwrap_or_else(|| panic!("{}: no `# after:` line", path.display()));
        check_rule(rule.clone(), before, after.trim_end());
    }
}

/// The IR of `examples/causal.attn` (its text is the example's `.ir` snapshot).
fn causal() -> String {
    let source = include_str!("../../../examples/causal.attn");
    crate::check(source).unwrap_or_else(|d| panic!("{}", d[0])).module.graphs[0].to_string()
}

#[test]
fn optimisation_is_deterministic() {
    let g = Graph::parse(&causal()).unwrap();
    let first = super::optimize(&g, &OptOptions::default()).graph.to_string();
    for _ in 0..5 {
        assert_eq!(super::optimize(&g, &OptOptions::default()).graph.to_string(), first);
    }
    assert!(first.contains("flash["), "{first}");
}

/// `x * 1 = x` puts `mul(c, 1)` into class `c` itself: the fusion rule must not spend its
/// budget going round that loop (it once left a causal mask followed by `* 1.0` unfused).
#[test]
fn identity_loops_in_the_scores_still_fuse() {
    let text = causal().replace(
        "  %13 = softmax[axis=3] %12 : f32[B, H, S, S]\n  %14 = matmul %13, %2",
        "  %13 = const[value=1.0] : f32[]\n  %14 = mul %12, %13 : f32[B, H, S, S]\n  %15 = softmax[axis=3] %14 : f32[B, H, S, S]\n  %16 = matmul %15, %2",
    );
    let text = text.replace("output out = %14", "output out = %16");
    let g = Graph::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let out = super::optimize(&g, &OptOptions::default()).graph.to_string();
    assert!(out.contains("flash[rank=4, weights=softmax, score=s, mask=\"j <= i\"]"), "{out}");
}

/// Hitting a limit is a stop reason, not an error: the result is still a verified graph.
#[test]
fn limits_still_give_a_valid_graph() {
    let g = Graph::parse(&causal()).unwrap();
    for opts in [
        OptOptions { iter_limit: 1, ..OptOptions::default() },
        OptOptions { node_limit: 18, nodes_per_input: 0, ..OptOptions::default() },
        OptOptions { time_limit: std::time::Duration::ZERO, ..OptOptions::default() },
    ] {
        let o = super::optimize(&g, &opts);
        assert!(crate::ir::verify(&o.graph).is_ok());
        assert!(o.report.fallback.is_none());
        assert_ne!(o.report.stop_reason, "saturated", "{opts:?}");
    }
}

/// egg runs on a clock that the runner's hook moves (no counter calibration): its time limit
/// still stops a run, and a generous one does not.
#[test]
fn the_time_limit_holds_on_the_replaced_clock() {
    let g = Graph::parse(&causal()).unwrap();
    let o = super::optimize(&g, &OptOptions { time_limit: std::time::Duration::ZERO, ..OptOptions::default() });
    assert!(o.report.stop_reason.starts_with("time limit"), "{}", o.report.stop_reason);
    let o = super::optimize(&g, &OptOptions::default());
    assert_eq!(o.report.stop_reason, "saturated");
}

/// Scaled attention through a double transpose and a reshape: a root for every rule.
const MIXED: &str = "graph mixed {
  %0 = param[name=q] : f32[B, H, S, D]
  %1 = param[name=k] : f32[B, H, S, D]
  %2 = param[name=v] : f32[B, H, S, D]
  %3 = transpose[perm=[0, 1, 3, 2]] %1 : f32[B, H, D, S]
  %4 = transpose[perm=[0, 1, 3, 2]] %3 : f32[B, H, S, D]
  %5 = transpose[perm=[0, 1, 3, 2]] %4 : f32[B, H, D, S]
  %6 = matmul %0, %5 : f32[B, H, S, S]
  %7 = dim[value=D] : i32[]
  %8 = sqrt %7 : f32[]
  %9 = div %6, %8 : f32[B, H, S, S]
  %10 = const[value=1] : f32[]
  %11 = mul %9, %10 : f32[B, H, S, S]
  %12 = softmax[axis=3] %11 : f32[B, H, S, S]
  %13 = matmul %12, %2 : f32[B, H, S, D]
  %14 = reshape %13 : f32[B, H, S, D]
  %15 = reshape %14 : f32[B, H, S, D]
  output out = %15
}";

/// The search visits only classes with a node a rule `wants`: no class where a rule finds a
/// rewrite may lack one.
#[test]
fn rules_want_every_class_they_rewrite() {
    let mut fired = std::collections::BTreeSet::new();
    for text in [causal().as_str(), MIXED] {
        let g = Graph::parse(text).unwrap();
        let loaded = super::lang::load(&g);
        let mut runner = egg::Runner::default().with_egraph(loaded.egraph);
        let rules = super::all_rules(std::collections::HashSet::new());
        let rewrites: Vec<_> = rules.iter().map(|r| super::rules::to_rewrite(r.clone()).unwrap()).collect();
        runner = runner.with_iter_limit(4).run(&rewrites);
        let eg = &runner.egraph;
        for rule in &rules {
            for class in eg.classes() {
                if !rule.rewrite(eg, class.id).is_empty() {
                    fired.insert(rule.name());
                    assert!(
                        class.nodes.iter().any(|n| rule.wants(n.op())),
                        "{} rewrites class {} but wants none of its nodes",
                        rule.name(),
                        class.id
                    );
                }
            }
        }
    }
    // Every rule but constant folding and re-association (no constant expression and no chain
    // of products here; their own tests cover them) was checked on a rewrite.
    assert!(fired.len() >= 6, "{fired:?}");
}

/// Weights that are an output stay materialised; `explain` says why.
#[test]
fn weights_that_are_outputs_are_not_fused() {
    let text = causal().replace("  output out = %14", "  output out = %14\n  output weights = %13");
    let g = Graph::parse(&text).unwrap();
    let o = super::optimize(&g, &OptOptions::default());
    assert!(!o.graph.to_string().contains("flash["));
    let report = o.report.to_string();
    assert!(report.contains("not fused: the attention weights are used elsewhere"), "{report}");
}

#[test]
fn every_rule_builds() {
    for rule in super::all_rules(Default::default()) {
        assert!(super::rules::to_rewrite(rule.clone()).is_ok(), "rule `{}` does not build", rule.name());
    }
}

/// Additive (Bahdanau) scores fuse over projections of any float type (the kernels compute in
/// f32).
#[test]
fn additive_scores_fuse_for_every_float_type() {
    for t in ["f32", "f16", "bf16"] {
        let source = format!(
            "fn bahdanau(q: {t}[B, M, D], k: {t}[B, N, D], w_q: {t}[D, A], w_k: {t}[D, A], v_a: {t}[A]) -> {t}[B, M, D] {{
    let scores = sum(tanh(unsqueeze(q @ w_q, 2) + unsqueeze(k @ w_k, 1)) * v_a, axis = A)
    return softmax(scores, axis = -1) @ k
}}"
        );
        let checked = crate::check(&source).unwrap_or_else(|d| panic!("{}", d[0]));
        let o = super::optimize(&checked.module.graphs[0], &OptOptions::default());
        assert!(o.graph.to_string().contains("pair=\"additive(x0)\""), "{t}:\n{}", o.graph);
    }
}

/// A value used three times is computed once: extraction compares whole programs by the cost
/// they pay (each value once), not each use's tree cost, which would fold the attention into
/// three products (`P @ (x @ (wv @ w_i))`) and cost more than the input.
#[test]
fn a_shared_value_is_computed_once() {
    let src =
        "fn f(lat: f32[L, E], x: f32[B, N, C], wk: f32[C, E], wv: f32[C, E], w1: f32[E, E], w2: f32[E, E], w3: f32[E, E]) -> f32[B, L, E] {
    let z = softmax(lat @ (x @ wk).T / sqrt(E), axis = -1) @ (x @ wv)
    return z @ w1 + z @ w2 + z @ w3
}";
    let checked = crate::check(src).expect("checks");
    let graph = &checked.module.graphs[0];
    let sizes = [("B", 2), ("L", 512), ("N", 1024), ("C", 64), ("E", 64)].map(|(n, v)| (n.to_string(), v)).into();
    let out = super::optimize(graph, &OptOptions { sizes, ..OptOptions::default() });
    let (before, after) = out.report.cost;
    assert!(after <= before, "cost {before:e} -> {after:e}");
    // The attention is computed once (fused: the latents are a query shared by the batch), not
    // once per use of z.
    let g = &out.graph;
    let weighted = g
        .values()
        .filter(|v| g.node(*v).op == crate::ir::Op::MatMul && matches!(g.node(g.operands(*v)[0]).op, crate::ir::Op::Softmax { .. }))
        .count();
    assert_eq!((weighted, flash_ops(g)), (0, 1), "{g}");
}

/// The optimised graph of the first function of `src`, and its report.
fn optimized(src: &str) -> super::Optimized {
    let checked = crate::check(src).unwrap_or_else(|d| panic!("{}", d[0].message));
    super::optimize(&checked.module.graphs[0], &OptOptions::default())
}

fn flash_ops(g: &Graph) -> usize {
    g.values().filter(|v| matches!(g.node(*v).op, crate::ir::Op::Flash(_))).count()
}

/// Differential attention as its paper writes it, `(softmax(s₁) − λ softmax(s₂)) @ v`: the
/// product distributes over the difference and each map fuses, with a note for each softmax.
#[test]
fn a_difference_of_attention_maps_fuses_into_two_flash_ops() {
    let out = optimized(include_str!("../../../examples/differential_attention.attn"));
    assert_eq!(flash_ops(&out.graph), 2, "{}", out.graph);
    assert_eq!(out.report.fusions.len(), 2);
    assert!(out.report.fusions.iter().all(|n| n.outcome.is_ok()), "{:?}", out.report.fusions);
}

/// Transposed weights, as the decomposable-attention paper writes them: `softmax(e, axis =
/// 1).T @ a` and `softmax(e.T, axis = -1) @ a` both reach `softmax(q @ kᵀ) @ v`.
#[test]
fn transposed_weights_fuse() {
    for body in ["softmax(e, axis = 1).T @ a", "softmax(e.T, axis = -1) @ a"] {
        let src = format!("fn f(a: f32[B, M, E], b: f32[B, N, E]) -> f32[B, N, E] {{\n    let e = a @ b.T\n    return {body}\n}}");
        let out = optimized(&src);
        assert_eq!(flash_ops(&out.graph), 1, "{body}:\n{}", out.graph);
    }
}

/// Every softmax gets one note, also one whose weights never meet the values in a product.
#[test]
fn every_softmax_left_unfused_says_why() {
    let out = optimized("fn f(x: f32[S, S], v: f32[S, D]) -> f32[S, D] {\n    let w = softmax(x, axis = -1)\n    return exp(w) @ v\n}");
    let [note] = out.report.fusions.as_slice() else { panic!("{:?}", out.report.fusions) };
    let why = note.outcome.as_ref().expect_err("not fused");
    assert!(why.contains("never multiplied by values") && why.contains("exp"), "{why}");
}

/// A query shared by the batch (Perceiver's latents `[L, E]` against inputs `[B, N, E]`) fuses:
/// the query is repeated along the batch (its own size, not the scores'), and K and V broadcast
/// as before; a lower-rank value operand too.
#[test]
fn a_query_shared_by_the_batch_fuses() {
    let src = "fn f(lat: f32[L, E], x: f32[B, N, E], v: f32[N, E]) -> f32[B, L, E] {\n    return softmax(lat @ x.T, axis = -1) @ v\n}";
    let out = optimized(src);
    assert_eq!(flash_ops(&out.graph), 1, "{}", out.graph);
    assert!(out.report.fusions.iter().all(|n| n.outcome.is_ok()), "{:?}", out.report.fusions);
    // The same values as the unfused program.
    let checked = crate::check(src).expect("checks");
    let noise = |n: usize, k: usize| -> Vec<f32> { (0..n).map(|i| (((i * 7 + k * 13) % 17) as f32 - 8.0) / 8.0).collect() };
    let t = |shape: Vec<usize>, k: usize| crate::tensor::Tensor::f32(shape.clone(), noise(shape.iter().product(), k)).expect("tensor");
    let inputs = [t(vec![3, 4], 1), t(vec![2, 5, 4], 2), t(vec![5, 4], 3)];
    let dims = std::collections::HashMap::new();
    let want = crate::interp::run(&checked.module.graphs[0], &inputs, &dims).expect("runs")[0].to_f64_vec();
    let got = crate::interp::run(&out.graph, &inputs, &dims).expect("runs")[0].to_f64_vec();
    assert_eq!(want.len(), 2 * 3 * 4);
    assert!(want.iter().zip(&got).all(|(a, b)| (a - b).abs() <= 1e-5 * (1.0 + a.abs())), "{want:?}\n{got:?}");
}

/// `logsumexp` of the scores an attention fuses comes out of the same flash op (`flash_lse` of
/// its spec and operands, which one step computes); where the weights stay materialised (an
/// output), it stays a reduction of the materialised scores rather than a flash op of its own.
#[test]
fn a_log_sum_exp_pairs_with_its_attention_unless_the_weights_are_kept() {
    let optimized = |src: &str| {
        let checked = crate::check(src).unwrap_or_else(|d| panic!("{}", d[0]));
        super::optimize(&checked.module.graphs[0], &OptOptions::default()).graph
    };
    let g = optimized(
        "fn f(q: f32[S, D], k: f32[T, D], v: f32[T, D]) -> (out: f32[S, D], lse: f32[S]) {
            let s = q @ k.T / sqrt(D)
            return softmax(s, axis = -1) @ v, logsumexp(s, axis = -1) }",
    );
    let ops: Vec<&crate::ir::Op> = g.values().map(|v| &g.node(v).op).collect();
    let flash = g.values().find(|v| matches!(g.node(*v).op, crate::ir::Op::Flash(_))).expect("a flash op");
    let lse = g.values().find(|v| matches!(g.node(*v).op, crate::ir::Op::FlashLse(_))).unwrap_or_else(|| panic!("no flash_lse:\n{g}"));
    let (crate::ir::Op::Flash(a), crate::ir::Op::FlashLse(b)) = (&g.node(flash).op, &g.node(lse).op) else { unreachable!() };
    assert_eq!(a, b, "{g}");
    assert_eq!(g.operands(flash), g.operands(lse), "{g}");
    assert!(!ops.iter().any(|o| matches!(o, crate::ir::Op::Softmax { .. } | crate::ir::Op::Reduce { .. })), "{g}");
    let kept = optimized(
        "fn f(q: f32[S, D], k: f32[T, D], v: f32[T, D]) -> (out: f32[S, D], w: f32[S, T], lse: f32[S]) {
            let s = q @ k.T / sqrt(D)
            let w = softmax(s, axis = -1)
            return w @ v, w, logsumexp(s, axis = -1) }",
    );
    assert!(!kept.values().any(|v| matches!(kept.node(v).op, crate::ir::Op::FlashLse(_) | crate::ir::Op::Flash(_))), "{kept}");
}
