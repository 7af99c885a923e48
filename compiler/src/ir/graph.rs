//! The graph IR: a petgraph DAG whose nodes are ops with their result type and whose edges carry
//! operand slots. One [`Graph`] per entry function; a [`Module`] holds them all.

use super::op::Op;
use super::types::TensorType;
use attn_dsl::Span;
use petgraph::Direction;
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::EdgeRef;
use std::collections::BTreeSet;

/// A value: the result of one node.
pub type Value = NodeIndex;

/// An operation, the type of its result, and where in the source it comes from.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// What it computes.
    pub op: Op,
    /// Shape and dtype of the result.
    pub ty: TensorType,
    /// The source expression it was lowered from (kept through optimisation where the
    /// optimizer's result has an equivalent in the input), for messages; not part of the text
    /// form.
    pub span: Option<Span>,
}

/// One function's dataflow graph. Edges point from operand to user; an edge's weight is the
/// operand's slot in the user.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    /// Function name (the entry point's name).
    pub name: String,
    g: DiGraph<Node, u32>,
    params: Vec<Value>,
    outputs: Vec<(String, Value)>,
}

impl Graph {
    /// An empty graph.
    pub fn new(name: impl Into<String>) -> Graph {
        Graph { name: name.into(), ..Graph::default() }
    }

    /// An empty graph with room for `nodes` nodes and `edges` operand edges.
    pub fn with_capacity(name: impl Into<String>, nodes: usize, edges: usize) -> Graph {
        Graph { name: name.into(), g: DiGraph::with_capacity(nodes, edges), ..Graph::default() }
    }

    /// Adds a node with the given operands (in slot order). A `Param` node is also appended to
    /// the parameter list.
    pub fn add(&mut self, op: Op, ty: TensorType, args: &[Value]) -> Value {
        let is_param = matches!(op, Op::Param(_));
        let v = self.g.add_node(Node { op, ty, span: None });
        for (slot, a) in args.iter().enumerate() {
            self.g.add_edge(*a, v, slot as u32);
        }
        if is_param {
            self.params.push(v);
        }
        v
    }

    /// Records the source span of a value's node.
    pub fn set_span(&mut self, v: Value, span: Option<Span>) {
        self.g[v].span = span;
    }

    /// A copy of the graph whose outputs are `outputs` instead (for evaluating inner values).
    pub fn with_outputs(&self, outputs: Vec<(String, Value)>) -> Graph {
        Graph { outputs, ..self.clone() }
    }

    /// The name of a parameter node (its op's name for any other node).
    pub fn param_name(&self, v: Value) -> &str {
        match &self.g[v].op {
            Op::Param(n) => n,
            other => other.name(),
        }
    }

    /// Makes every user of `old` (and every output naming it) use `new` instead, in the same
    /// operand slots. `old` is left without users.
    pub fn replace_uses(&mut self, old: Value, new: Value) {
        let uses: Vec<(Value, u32)> = self.g.edges_directed(old, Direction::Outgoing).map(|e| (e.target(), *e.weight())).collect();
        self.g.retain_edges(|g, e| g.edge_endpoints(e).is_none_or(|(s, _)| s != old));
        for (user, slot) in uses {
            self.g.add_edge(new, user, slot);
        }
        for (_, v) in &mut self.outputs {
            if *v == old {
                *v = new;
            }
        }
    }

    /// Declares a named output.
    pub fn add_output(&mut self, name: impl Into<String>, v: Value) {
        self.outputs.push((name.into(), v));
    }

    /// The node of a value.
    pub fn node(&self, v: Value) -> &Node {
        &self.g[v]
    }

    /// Mutable access to a node (its op and type; not its operands).
    pub fn node_mut(&mut self, v: Value) -> &mut Node {
        &mut self.g[v]
    }

    /// Operands of a value, in slot order.
    pub fn operands(&self, v: Value) -> Vec<Value> {
        let mut es: Vec<(u32, Value)> = self.g.edges_directed(v, Direction::Incoming).map(|e| (*e.weight(), e.source())).collect();
        es.sort_unstable();
        es.into_iter().map(|(_, s)| s).collect()
    }

    /// Values that use `v` (each once, in index order).
    pub fn users(&self, v: Value) -> Vec<Value> {
        let set: BTreeSet<Value> = self.g.neighbors_directed(v, Direction::Outgoing).collect();
        set.into_iter().collect()
    }

    /// Parameters in signature order.
    pub fn params(&self) -> &[Value] {
        &self.params
    }

    /// Each parameter's name and declared type, in signature order.
    pub fn param_types(&self) -> Vec<(String, TensorType)> {
        self.params
            .iter()
            .map(|p| {
                let n = self.node(*p);
                let name = if let Op::Param(name) = &n.op { name.clone() } else { String::new() };
                (name, n.ty.clone())
            })
            .collect()
    }

    /// Named outputs in declaration order.
    pub fn outputs(&self) -> &[(String, Value)] {
        &self.outputs
    }

    /// Points output `index` at another value.
    pub fn set_output(&mut self, index: usize, v: Value) {
        self.outputs[index].1 = v;
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.g.node_count()
    }

    /// True for a graph with no nodes.
    pub fn is_empty(&self) -> bool {
        self.g.node_count() == 0
    }

    /// Every node index, in insertion order.
    pub fn values(&self) -> impl Iterator<Item = Value> + '_ {
        self.g.node_indices()
    }

    /// The underlying petgraph graph (read-only), for algorithms and DOT export.
    pub fn petgraph(&self) -> &DiGraph<Node, u32> {
        &self.g
    }

    /// A deterministic topological order: parameters first (in order), then Kahn's algorithm
    /// taking the lowest-numbered ready node each time. `None` if the graph has a cycle.
    pub fn topo_order(&self) -> Option<Vec<Value>> {
        // Graphs built with `add` take operands that already exist, so every edge goes from a
        // lower index to a higher one. Then Kahn's order is the parameters, then every other
        // node by index: each is ready when its turn comes, and nothing lower is left. This
        // O(n) path is what programs take; the general one below stays for any other graph.
        if self.g.edge_references().all(|e| e.source().index() < e.target().index()) {
            let mut is_param = vec![false; self.g.node_count()];
            for p in &self.params {
                is_param[p.index()] = true;
            }
            let rest = (0..self.g.node_count()).filter(|&i| !is_param[i]).map(NodeIndex::new);
            return Some(self.params.iter().copied().chain(rest).collect());
        }
        self.kahn_order()
    }

    /// Kahn's algorithm taking the lowest-numbered ready node each time, parameters first.
    fn kahn_order(&self) -> Option<Vec<Value>> {
        let n = self.g.node_count();
        let mut indeg: Vec<usize> = (0..n).map(|i| self.g.edges_directed(NodeIndex::new(i), Direction::Incoming).count()).collect();
        let mut order = Vec::with_capacity(n);
        let mut ready: BTreeSet<(u8, usize)> = BTreeSet::new();
        let param_rank = |v: Value| self.params.iter().position(|p| *p == v);
        for (i, d) in indeg.iter().enumerate() {
            if *d == 0 {
                let v = NodeIndex::new(i);
                ready.insert(match param_rank(v) {
                    Some(r) => (0, r),
                    None => (1, i),
                });
            }
        }
        while let Some(first) = ready.iter().next().copied() {
            ready.remove(&first);
            let v = match first {
                (0, r) => self.params[r],
                (_, i) => NodeIndex::new(i),
            };
            order.push(v);
            for user in self.g.neighbors_directed(v, Direction::Outgoing) {
                let d = &mut indeg[user.index()];
                // neighbors_directed yields one entry per edge, so a node used twice is visited twice.
                *d -= 1;
                if *d == 0 {
                    ready.insert((1, user.index()));
                }
            }
        }
        (order.len() == n).then_some(order)
    }

    /// The graph keeping only nodes reachable from the outputs (and every parameter),
    /// renumbered in topological order. Consumes the graph: nodes are moved, not copied (a
    /// node's type is several allocations, and programs have tens of thousands of nodes).
    pub fn compact(self) -> Graph {
        if self.is_compact() {
            return self;
        }
        let mut live = vec![false; self.g.node_count()];
        let mut stack: Vec<Value> = self.outputs.iter().map(|(_, v)| *v).chain(self.params.iter().copied()).collect();
        while let Some(v) = stack.pop() {
            if !std::mem::replace(&mut live[v.index()], true) {
                stack.extend(self.operands(v));
            }
        }
        let order = self.topo_order().unwrap_or_default();
        let operands: Vec<Vec<Value>> = (0..self.g.node_count()).map(|i| self.operands(NodeIndex::new(i))).collect();
        let Graph { name, g, params: _, outputs } = self;
        let (nodes, _) = g.into_nodes_edges();
        let mut nodes: Vec<Option<Node>> = nodes.into_iter().map(|n| Some(n.weight)).collect();
        let mut out = Graph::new(name);
        let mut map = vec![None; nodes.len()];
        for v in order {
            if !live[v.index()] {
                continue;
            }
            let Some(node) = nodes[v.index()].take() else { continue };
            let args: Vec<Value> = operands[v.index()].iter().filter_map(|a| map[a.index()]).collect();
            let nv = out.add(node.op, node.ty, &args);
            out.set_span(nv, node.span);
            map[v.index()] = Some(nv);
        }
        for (name, v) in outputs {
            if let Some(nv) = map[v.index()] {
                out.add_output(name, nv);
            }
        }
        out
    }
    /// Whether [`Self::compact`] would return the graph unchanged: the parameters are its first
    /// nodes, in order; every edge goes from a lower index to a higher one (so the topological
    /// order is the index order); and every node is live. The optimizer's results are built
    /// that way, and a long program's graph is megabytes to copy.
    fn is_compact(&self) -> bool {
        let n = self.g.node_count();
        if self.params.iter().enumerate().any(|(i, p)| p.index() != i) {
            return false;
        }
        if !self.g.edge_references().all(|e| e.source().index() < e.target().index()) {
            return false;
        }
        // Users come after their operands: one backward pass marks everything live.
        let mut live = vec![false; n];
        for v in self.outputs.iter().map(|(_, v)| *v).chain(self.params.iter().copied()) {
            live[v.index()] = true;
        }
        for i in (0..n).rev() {
            if !live[i] {
                return false;
            }
            for e in self.g.edges_directed(NodeIndex::new(i), Direction::Incoming) {
                live[e.source().index()] = true;
            }
        }
        true
    }
}

/// All entry points of a program, in source order.
#[derive(Clone, Debug, Default)]
pub struct Module {
    /// One graph per function.
    pub graphs: Vec<Graph>,
}

impl Module {
    /// The graph of the entry point with this name.
    pub fn graph(&self, name: &str) -> Option<&Graph> {
        self.graphs.iter().find(|g| g.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{BinaryOp, DType};

    /// The linear-time order of a graph built with `add` is Kahn's, parameters declared late
    /// and unused nodes included.
    #[test]
    fn topo_order_of_built_graphs_is_kahns() {
        let scalar = TensorType { dtype: DType::F32, shape: vec![] };
        let mut g = Graph::new("g");
        let c = g.add(Op::Const(2.0), scalar.clone(), &[]);
        let unused = g.add(Op::Const(3.0), scalar.clone(), &[]);
        let x = g.add(Op::Param("x".into()), scalar.clone(), &[]);
        let m = g.add(Op::Binary(BinaryOp::Mul), scalar.clone(), &[x, c]);
        let y = g.add(Op::Param("y".into()), scalar.clone(), &[]);
        let s = g.add(Op::Binary(BinaryOp::Add), scalar.clone(), &[m, y]);
        let t = g.add(Op::Binary(BinaryOp::Mul), scalar, &[s, s]);
        g.add_output("out", t);
        let fast = g.topo_order();
        assert_eq!(fast, g.kahn_order());
        assert_eq!(fast, Some(vec![x, y, c, unused, m, s, t]));
        // compact keeps the order and drops nothing but the unused constant.
        let compacted = g.compact();
        assert_eq!(compacted.len(), 6);
        assert_eq!(compacted.topo_order(), compacted.kahn_order());
    }

    /// A graph that is already compact comes back as it is (no copy), and compacting it the
    /// long way gives the same graph.
    #[test]
    fn compact_graphs_are_kept() {
        let scalar = TensorType { dtype: DType::F32, shape: vec![] };
        let mut g = Graph::new("g");
        let x = g.add(Op::Param("x".into()), scalar.clone(), &[]);
        let y = g.add(Op::Param("y".into()), scalar.clone(), &[]);
        let c = g.add(Op::Const(2.0), scalar.clone(), &[]);
        let m = g.add(Op::Binary(BinaryOp::Mul), scalar.clone(), &[y, c]);
        let s = g.add(Op::Binary(BinaryOp::Sub), scalar, &[m, x]);
        g.add_output("out", s);
        assert!(g.is_compact());
        let text = g.to_string();
        // An unused node, then a param after other nodes: neither is compact.
        let mut dead = g.clone();
        dead.add(Op::Const(1.0), TensorType { dtype: DType::F32, shape: vec![] }, &[]);
        assert!(!dead.is_compact());
        assert_eq!(dead.compact().to_string(), text);
        let mut late = Graph::new("g");
        let c = late.add(Op::Const(2.0), TensorType { dtype: DType::F32, shape: vec![] }, &[]);
        let x = late.add(Op::Param("x".into()), TensorType { dtype: DType::F32, shape: vec![] }, &[]);
        let m = late.add(Op::Binary(BinaryOp::Mul), TensorType { dtype: DType::F32, shape: vec![] }, &[x, c]);
        late.add_output("out", m);
        assert!(!late.is_compact());
        let compacted = late.compact();
        assert!(compacted.is_compact());
        assert_eq!(compacted.params()[0].index(), 0);
        assert_eq!(g.compact().to_string(), text);
    }
}
