//! The optimizer: equality saturation over the graph IR with egg.
//!
//! A graph is loaded into an e-graph ([`lang`]), rewritten by named rules ([`rules`]: layout,
//! algebra, association, flash fusion) under iteration, node and time limits, and extracted
//! with a cost model ([`cost`], [`extract`]) back into a verified graph. A run that hits a limit still yields
//! a valid graph; a result that fails verification falls back to the input (and says so).
//! [`OptReport`] records what happened for `attnc explain`.

pub mod choose;
pub mod cost;
pub mod extract;
pub mod lang;
pub mod rules;

#[cfg(test)]
pub(crate) mod tests;

use crate::ir::{BinaryOp, Graph, Module, Op, representative, verify};
use cost::Cost;
use egg::{Id, Runner, SimpleScheduler};
use extract::Extracted;
use lang::{Classes, ENode, load, unload};
use rules::fusion::FuseAttention;
use rules::{Rule, to_rewrite};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Limits and sizes for one optimisation.
#[derive(Clone, Debug)]
pub struct OptOptions {
    /// Maximum saturation iterations.
    pub iter_limit: usize,
    /// Maximum e-nodes: at least this many, and at least [`Self::nodes_per_input`] per node of
    /// the input, so that a large program still has room to be rewritten.
    pub node_limit: usize,
    /// E-nodes allowed per input node (see [`Self::node_limit`]).
    pub nodes_per_input: usize,
    /// Wall-clock limit (a safety net; the node and iteration limits keep runs deterministic).
    pub time_limit: Duration,
    /// Dim sizes for the cost model; names not given use [`representative`] sizes.
    pub sizes: HashMap<String, i64>,
}

impl Default for OptOptions {
    fn default() -> Self {
        OptOptions { iter_limit: 12, node_limit: 20_000, nodes_per_input: 4, time_limit: Duration::from_secs(2), sizes: HashMap::new() }
    }
}

/// What happened to one `weights @ v` site of the input.
#[derive(Clone, Debug, PartialEq)]
pub struct FusionNote {
    /// `%N` of the softmax (or sigmoid) in the input graph's text.
    pub weights: usize,
    /// The flash op's text when fused, or why not.
    pub outcome: Result<String, String>,
}

/// What the optimizer did to one graph.
#[derive(Clone, Debug, Default)]
pub struct OptReport {
    /// The graph's name.
    pub graph: String,
    /// Saturation iterations run.
    pub iterations: usize,
    /// Why saturation stopped (`saturated`, or the limit hit).
    pub stop_reason: String,
    /// E-graph size at the end.
    pub egraph_nodes: usize,
    /// E-classes at the end.
    pub egraph_classes: usize,
    /// Rule name → times it applied.
    pub applied: BTreeMap<String, usize>,
    /// One note per attention site.
    pub fusions: Vec<FusionNote>,
    /// Cost-model decisions worth telling (association choices).
    pub decisions: Vec<String>,
    /// Cost of the input and of the result, at the model's sizes.
    pub cost: (f64, f64),
    /// Set when the result failed verification and the input was kept.
    pub fallback: Option<String>,
    /// Rules that could not be built and were skipped (a compiler bug; tests treat it as an
    /// error).
    pub warnings: Vec<String>,
    /// Wall time of the whole optimisation.
    pub elapsed: Duration,
}

/// An optimised graph and its report.
#[derive(Clone, Debug)]
pub struct Optimized {
    /// The result (verified).
    pub graph: Graph,
    /// What happened.
    pub report: OptReport,
}

/// Optimises every graph of a module with default options.
pub fn optimize_module(module: &Module) -> (Module, Vec<OptReport>) {
    let mut out = Module::default();
    let mut reports = Vec::new();
    for g in &module.graphs {
        let o = optimize(g, &OptOptions::default());
        out.graphs.push(o.graph);
        reports.push(o.report);
    }
    (out, reports)
}

/// The rules, in the order they are tried.
pub fn all_rules(pinned: HashSet<Id>) -> Vec<Arc<dyn Rule>> {
    vec![
        Arc::new(rules::layout::TransposeFold),
        Arc::new(rules::layout::ReshapeFold),
        Arc::new(rules::layout::TransposeThrough),
        Arc::new(rules::algebra::FoldConstants),
        Arc::new(rules::algebra::Identities),
        Arc::new(rules::algebra::DivToMul),
        Arc::new(rules::algebra::ScaleIntoQuery),
        Arc::new(rules::assoc::MatMulAssoc),
        Arc::new(rules::algebra::DistributeMatMul),
        Arc::new(FuseAttention { pinned: pinned.clone() }),
        Arc::new(rules::fusion::FuseLogSumExp { pinned }),
        Arc::new(rules::fusion::CastIntoFlash),
        Arc::new(rules::scan::PrefixAttention),
    ]
}

/// Optimises one graph.
pub fn optimize(graph: &Graph, opts: &OptOptions) -> Optimized {
    let start = Instant::now();
    with_egg_clock(|| {
        let loaded = load(graph);
        let pinned = pinned_weights(graph, &loaded.class_of);
        let rules = all_rules(pinned.clone());
        optimize_with_rules(graph, opts, loaded, pinned, &rules, start)
    })
}

/// Runs `f` with egg's clock replaced. egg times its phases with the `quanta` crate, whose
/// first reading in a process calibrates the CPU's time-stamp counter against the OS clock: on
/// a busy or virtual machine that takes up to 200 ms (its cap), which every `attnc` command
/// that optimises paid once. Under the replacement (a quanta mock clock, for this thread
/// only) egg reads no counter; [`clock_hook`] moves it to the real elapsed time before each
/// iteration, so the runner's time limit still holds, checked per iteration.
fn with_egg_clock<T>(f: impl FnOnce() -> T) -> T {
    EGG_CLOCK.with(|(clock, _)| quanta::with_clock(clock, f))
}

thread_local! {
    /// This thread's replacement clock for egg and its hand.
    static EGG_CLOCK: (quanta::Clock, Arc<quanta::Mock>) = quanta::Clock::mock();
}

/// A runner hook that moves egg's clock on by the real time since the hook was made.
fn clock_hook() -> impl FnMut(&mut Runner<lang::ENode, lang::Types>) -> Result<(), String> + 'static {
    let start = Instant::now();
    let base = EGG_CLOCK.with(|(_, hand)| hand.value());
    move |_| {
        let elapsed = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let target = base.saturating_add(elapsed);
        EGG_CLOCK.with(|(_, hand)| {
            let shown = hand.value();
            if target > shown {
                hand.increment(target - shown);
            }
        });
        Ok(())
    }
}

/// Optimises with a given rule set (tests use single rules).
pub(crate) fn optimize_with_rules(
    graph: &Graph,
    opts: &OptOptions,
    loaded: lang::Loaded,
    pinned: HashSet<Id>,
    rules: &[Arc<dyn Rule>],
    start: Instant,
) -> Optimized {
    let mut report = OptReport { graph: graph.name.clone(), ..OptReport::default() };
    let mut rewrites = Vec::with_capacity(rules.len());
    for r in rules {
        match to_rewrite(r.clone()) {
            Ok(rw) => rewrites.push(rw),
            Err(e) => report.warnings.push(format!("rule `{}` could not be built and was skipped: {e}", r.name())),
        }
    }
    let env = cost_sizes(graph, opts);
    // The input's cost, on the e-graph as loaded (each value's class holds just its node).
    let input_cost = {
        let classes = Classes::new(&loaded.egraph);
        let cost = Cost::new(&classes, env.clone());
        graph
            .values()
            .map(|v| {
                let class = loaded.class_of[v.index()];
                classes.get(class).nodes.first().map_or(0.0, |n| cost.own_in(n, class))
            })
            .sum()
    };
    let class_of = loaded.class_of;
    let node_limit = opts.node_limit.max(opts.nodes_per_input.saturating_mul(loaded.egraph.total_number_of_nodes()));
    let runner = Runner::default()
        .with_hook(clock_hook())
        .with_scheduler(SimpleScheduler)
        .with_iter_limit(opts.iter_limit)
        .with_node_limit(node_limit)
        .with_time_limit(opts.time_limit)
        .with_egraph(loaded.egraph)
        .run(&rewrites);
    report.iterations = runner.iterations.len();
    report.stop_reason = stop_reason(runner.stop_reason.as_ref());
    for it in &runner.iterations {
        for (name, n) in &it.applied {
            *report.applied.entry(name.to_string()).or_insert(0) += n;
        }
    }
    let eg = &runner.egraph;
    report.egraph_nodes = eg.total_number_of_nodes();
    report.egraph_classes = eg.number_of_classes();

    let classes = Classes::new(eg);
    let cost = Cost::new(&classes, env);
    let extractor = Extracted::new(&classes, &cost);
    let params: Vec<Id> = graph.params().iter().map(|p| class_of[p.index()]).collect();
    let outputs: Vec<(String, Id)> = graph.outputs().iter().map(|(n, v)| (n.clone(), class_of[v.index()])).collect();
    // The input's topological order, for the walks below (a long program's is worth computing
    // once).
    let order = graph.topo_order().unwrap_or_default();
    let spans = lang::class_spans(graph, &order, &classes, &class_of);
    let roots: Vec<Id> = outputs.iter().map(|(_, c)| *c).collect();
    let (chosen, chosen_cost) = choose::choose((graph, &order), &classes, &cost, &extractor, &class_of, &roots);
    report.cost = (input_cost, chosen_cost);
    let optimized = if chosen_cost > input_cost * (1.0 + 1e-9) {
        // The input is a candidate, so this takes a program the search could not walk (a
        // cycle, an uncosted class): never return one the model rates costlier.
        let why = format!("the best result found costs {chosen_cost:.3e}, more than the input's {input_cost:.3e}");
        fallback(&mut report, graph, why)
    } else {
        let result = unload(&graph.name, &classes, &params, &outputs, &|c| chosen.node(&classes, c), &spans).map(|g| g.compact());
        match result {
            Ok(g) => match verify(&g) {
                Ok(()) if same_signature(graph, &g) => g,
                Ok(()) => fallback(&mut report, graph, "the result changed the signature".into()),
                Err(errors) => fallback(&mut report, graph, format!("the result failed verification: {}", errors[0])),
            },
            Err(e) => fallback(&mut report, graph, e),
        }
    };
    if report.fallback.is_some() {
        report.cost.1 = input_cost;
    }
    report.fusions = fusion_notes(graph, &order, eg, &class_of, (&chosen, &classes, &roots), FuseAttention { pinned });
    report.decisions = association_decisions(graph, &order, &classes, &class_of, (&extractor, &chosen));
    report.elapsed = start.elapsed();
    Optimized { graph: optimized, report }
}

/// The sizes the cost model evaluates `graph`'s dims at: the options' where given, else
/// representative ones.
fn cost_sizes(graph: &Graph, opts: &OptOptions) -> HashMap<String, i64> {
    let mut env: HashMap<String, i64> = HashMap::new();
    for v in graph.values() {
        for d in &graph.node(v).ty.shape {
            for s in d.symbols() {
                let size = opts.sizes.get(&s).copied().unwrap_or_else(|| representative(&s));
                env.insert(s, size);
            }
        }
    }
    env
}

/// Why the e-graph stopped growing, as the report says it.
fn stop_reason(reason: Option<&egg::StopReason>) -> String {
    match reason {
        Some(egg::StopReason::Saturated) => "saturated".into(),
        Some(egg::StopReason::IterationLimit(n)) => format!("iteration limit ({n})"),
        Some(egg::StopReason::NodeLimit(n)) => format!("node limit ({n})"),
        Some(egg::StopReason::TimeLimit(s)) => format!("time limit ({s} s)"),
        Some(egg::StopReason::Other(s)) => s.clone(),
        None => "not run".into(),
    }
}

/// What became of each attention weights of the input (every softmax, and each sigmoid that
/// weights a product), once each: fused into a flash op, or the reason it was not. Its products
/// are the e-graph's matmuls whose weights are its class or a transpose of it (a rewrite may
/// have moved the product through sums and transposes).
fn fusion_notes(
    graph: &Graph,
    order: &[crate::ir::Value],
    eg: &lang::EG,
    class_of: &[Id],
    (chosen, classes, roots): (&choose::Selection, &Classes<'_>, &[Id]),
    fuse: FuseAttention,
) -> Vec<FusionNote> {
    let sites = attention_sites(graph, order);
    if sites.is_empty() {
        return Vec::new();
    }
    let reached = chosen.reached(classes, roots);
    let numbers = crate::ir::value_numbers(graph);
    // Product classes by their weights' class, and transposes (and dropouts: they fuse with
    // the weights) by their operand's class.
    let mut products: HashMap<Id, Vec<Id>> = HashMap::new();
    let mut transposes: HashMap<Id, Vec<Id>> = HashMap::new();
    for c in eg.classes() {
        for n in &c.nodes {
            match n.op() {
                Op::MatMul => products.entry(eg.find(n.args()[0])).or_default().push(c.id),
                Op::Transpose { .. } | Op::Dropout { .. } => transposes.entry(eg.find(n.args()[0])).or_default().push(c.id),
                _ => {}
            }
        }
    }
    sites
        .into_iter()
        .map(|w| {
            let class = eg.find(class_of[w.index()]);
            let weights = std::iter::once(class).chain(transposes.get(&class).into_iter().flatten().copied());
            let mut uses: Vec<Id> = weights.flat_map(|c| products.get(&c).into_iter().flatten().copied()).collect();
            uses.sort();
            uses.dedup();
            let computed = |c: &Id| reached.get(usize::from(classes.find(*c))).copied().unwrap_or(false);
            let fused =
                uses.iter().filter(|c| computed(c)).find_map(|c| chosen.node(classes, *c).filter(|n| matches!(n.op(), Op::Flash(_))));
            let outcome = match fused {
                Some(flash) => Ok(flash.to_string()),
                None if uses.is_empty() => Err(not_a_product(graph, w)),
                None => {
                    // A fused form that exists but was not chosen is the cost model's decision;
                    // else the first reason no form exists.
                    let tries: Vec<Result<_, String>> = uses.iter().flat_map(|c| fuse.fuse(eg, *c)).collect();
                    let reason = if tries.iter().any(Result::is_ok) { None } else { tries.into_iter().find_map(Result::err) };
                    Err(reason.unwrap_or_else(|| "the cost model kept the unfused form".into()))
                }
            };
            FusionNote { weights: numbers[w.index()], outcome }
        })
        .collect()
}

/// Why weights `w` with no product of them in the e-graph do not fuse: what uses them.
fn not_a_product(graph: &Graph, w: crate::ir::Value) -> String {
    let mut users: Vec<&str> = graph.users(w).iter().map(|u| graph.node(*u).op.name()).collect();
    users.sort_unstable();
    users.dedup();
    if graph.outputs().iter().any(|(_, v)| *v == w) {
        users.push("an output");
    }
    let used = if users.is_empty() { "nothing".to_string() } else { users.join(", ") };
    format!(
        "the weights are never multiplied by values (`weights @ v`, or through sums, scalar multiples and transposes); they are used by {used}"
    )
}

fn fallback(report: &mut OptReport, graph: &Graph, why: String) -> Graph {
    report.fallback = Some(why);
    graph.clone()
}

fn same_signature(a: &Graph, b: &Graph) -> bool {
    let sig = |g: &Graph| -> Vec<String> {
        g.params().iter().chain(g.outputs().iter().map(|(_, v)| v)).map(|v| g.node(*v).ty.to_string()).collect()
    };
    sig(a) == sig(b) && a.outputs().iter().map(|(n, _)| n).eq(b.outputs().iter().map(|(n, _)| n))
}

/// Softmax/sigmoid weights whose value other nodes or outputs need, as e-classes: all but those
/// whose one use is as the weights of a product, directly or through sums, differences and
/// scalar multiples that `algebra/distribute-matmul` moves the product into.
fn pinned_weights(graph: &Graph, class_of: &[Id]) -> HashSet<Id> {
    let outputs: HashSet<_> = graph.outputs().iter().map(|(_, v)| *v).collect();
    graph
        .values()
        .filter(|v| is_weights(&graph.node(*v).op))
        .filter(|v| !weights_only(graph, *v, &outputs, 0))
        .map(|v| class_of[v.index()])
        .collect()
}

/// Whether `v`'s one use is as the left operand of a product, or as a term of a sum,
/// difference or scalar multiple, or the operand of a dropout, whose one use is (at most
/// `DISTRIBUTED` deep).
fn weights_only(graph: &Graph, v: crate::ir::Value, outputs: &HashSet<crate::ir::Value>, depth: usize) -> bool {
    const DISTRIBUTED: usize = 4;
    let users = graph.users(v);
    let [u] = users.as_slice() else { return false };
    if outputs.contains(&v) || depth > DISTRIBUTED {
        return false;
    }
    let ops = graph.operands(*u);
    match graph.node(*u).op {
        Op::MatMul => ops[0] == v && ops[1] != v,
        Op::Binary(BinaryOp::Add | BinaryOp::Sub) => ops[0] != ops[1] && weights_only(graph, *u, outputs, depth + 1),
        Op::Binary(BinaryOp::Mul) => {
            let other = if ops[0] == v { ops[1] } else { ops[0] };
            graph.node(other).ty.rank() == 0 && weights_only(graph, *u, outputs, depth + 1)
        }
        // Dropout of the weights fuses with them (`dropout(softmax(s), seed) @ v`).
        Op::Dropout { .. } => ops[0] == v && weights_only(graph, *u, outputs, depth + 1),
        _ => false,
    }
}

fn is_weights(op: &Op) -> bool {
    matches!(op, Op::Softmax { .. } | Op::Unary(crate::ir::UnaryOp::Sigmoid))
}

/// The input's attention weights: every softmax, and every sigmoid of rank 2 or more that is
/// the left operand of a product (sigmoid attention; not e.g. a gate), in `order`.
fn attention_sites(graph: &Graph, order: &[crate::ir::Value]) -> Vec<crate::ir::Value> {
    order
        .iter()
        .copied()
        .filter(|&w| match graph.node(w).op {
            Op::Softmax { .. } => true,
            Op::Unary(crate::ir::UnaryOp::Sigmoid) => {
                graph.node(w).ty.rank() >= 2
                    && graph
                        .users(w)
                        .iter()
                        .any(|u| matches!(graph.node(*u).op, Op::MatMul | Op::Dropout { .. }) && graph.operands(*u)[0] == w)
            }
            _ => false,
        })
        .collect()
}

/// For every matmul of the input with a matmul operand: which grouping was kept, with each
/// grouping's tree cost (`ex`'s), and, where the whole program's choice (`chosen`) is not the
/// tree-cheapest, that it shares a value.
fn association_decisions(
    graph: &Graph,
    order: &[crate::ir::Value],
    classes: &Classes<'_>,
    class_of: &[Id],
    (ex, chosen): (&Extracted<'_>, &choose::Selection),
) -> Vec<String> {
    let mut numbers: Option<Vec<usize>> = None;
    let mut out = Vec::new();
    for &v in order {
        if !matches!(graph.node(v).op, Op::MatMul) {
            continue;
        }
        let ops = graph.operands(v);
        let chain = ops.iter().any(|o| matches!(graph.node(*o).op, Op::MatMul));
        if !chain {
            continue;
        }
        let class = classes.find(class_of[v.index()]);
        let alternatives: Vec<&ENode> = classes.get(class).nodes.iter().filter(|n| matches!(n.op(), Op::MatMul)).collect();
        if alternatives.len() < 2 {
            continue;
        }
        let Some(picked) = chosen.node(classes, class) else { continue };
        let shared = ex.find_best_node(class).is_some_and(|t| describe_node(classes, t) != describe_node(classes, picked));
        let describe = |n: &ENode| describe_node(classes, n);
        let cost_of = |n: &ENode| ex.find_best_cost(n.args()[0]) + ex.find_best_cost(n.args()[1]);
        let mut options: Vec<String> = alternatives
            .iter()
            .map(|n| format!("{} costs {:.3e}", describe(n), cost_of(n) + Cost::new(classes, HashMap::new()).own(n)))
            .collect();
        options.dedup();
        let numbers = numbers.get_or_insert_with(|| crate::ir::value_numbers(graph));
        let why = if shared { "; kept over the tree-cheapest: it reuses a value the program computes once" } else { "" };
        out.push(format!("matmul %{}: kept {} ({}{why})", numbers[v.index()], describe(picked), options.join(", ")));
    }
    out
}

/// Which grouping a matmul node of a chain is.
fn describe_node(classes: &Classes<'_>, n: &ENode) -> &'static str {
    let left_is_product = classes.get(n.args()[0]).nodes.iter().any(|m| matches!(m.op(), Op::MatMul));
    if left_is_product { "(a @ b) @ c" } else { "a @ (b @ c)" }
}

impl fmt::Display for OptReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "graph {}:", self.graph)?;
        writeln!(
            f,
            "  e-graph: {} iterations, stopped: {}; {} nodes in {} classes",
            self.iterations, self.stop_reason, self.egraph_nodes, self.egraph_classes
        )?;
        if self.applied.is_empty() {
            writeln!(f, "  rules fired: none")?;
        } else {
            let fired: Vec<String> = self.applied.iter().map(|(r, n)| format!("{r} ×{n}")).collect();
            writeln!(f, "  rules fired: {}", fired.join(", "))?;
        }
        for note in &self.fusions {
            match &note.outcome {
                Ok(flash) => writeln!(f, "  weights %{}: fused into {}", note.weights, flash)?,
                Err(why) => writeln!(f, "  weights %{}: not fused: {}", note.weights, why)?,
            }
        }
        for d in &self.decisions {
            writeln!(f, "  {d}")?;
        }
        writeln!(f, "  cost (model units): {:.3e} before, {:.3e} after", self.cost.0, self.cost.1)?;
        if let Some(why) = &self.fallback {
            writeln!(f, "  kept the input graph: {why}")?;
        }
        for w in &self.warnings {
            writeln!(f, "  warning: {w}")?;
        }
        Ok(())
    }
}
