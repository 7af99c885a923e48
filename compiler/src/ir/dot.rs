//! Graphviz DOT export, for looking at a graph (`dot -Tsvg`). Nodes are numbered `%N` as in the
//! text form; parameters and outputs are drawn distinctly and pinned to the top and bottom. The
//! output depends only on the graph, so it can be snapshot-tested.

use super::graph::Graph;
use super::text::{OpText, print_order, value_numbers};
use std::fmt::{self, Write};

/// Escapes text for a double-quoted DOT string; a line break becomes DOT's `\n`.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// The graph in DOT: one box per value labelled `%N op[attrs]` and its type, an edge per operand
/// (labelled with the operand slot when a node has several), and a node per output.
pub fn to_dot(graph: &Graph) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = write_dot(graph, &mut out);
    out
}

fn write_dot(graph: &Graph, out: &mut String) -> fmt::Result {
    let numbers = value_numbers(graph);
    writeln!(out, "digraph \"{}\" {{", escape(&graph.name))?;
    out.push_str("  node [shape=box, fontname=\"monospace\"];\n");
    for v in print_order(graph) {
        let n = numbers[v.index()];
        let node = graph.node(v);
        let label = escape(&format!("%{n} {}\n{}", OpText(&node.op), node.ty));
        let style = if graph.params().contains(&v) { ", shape=invhouse, style=filled, fillcolor=\"#dbe8fb\"" } else { "" };
        writeln!(out, "  v{n} [label=\"{label}\"{style}];")?;
        let operands = graph.operands(v);
        for (slot, a) in operands.iter().enumerate() {
            let label = if operands.len() > 1 { format!(" [label=\"{slot}\"]") } else { String::new() };
            writeln!(out, "  v{} -> v{n}{label};", numbers[a.index()])?;
        }
    }
    for (k, (name, v)) in graph.outputs().iter().enumerate() {
        writeln!(out, "  out{k} [label=\"{}\", shape=house, style=filled, fillcolor=\"#dcf2d8\"];", escape(&format!("output {name}")))?;
        // An output pointing at a missing node (a corrupt graph) gets no edge.
        if let Some(n) = numbers.get(v.index()) {
            writeln!(out, "  v{n} -> out{k};")?;
        }
    }
    let params: Vec<String> = graph.params().iter().filter_map(|p| numbers.get(p.index())).map(|n| format!("v{n}; ")).collect();
    if !params.is_empty() {
        writeln!(out, "  {{ rank=source; {}}}", params.concat())?;
    }
    let outputs: Vec<String> = (0..graph.outputs().len()).map(|k| format!("out{k}; ")).collect();
    if !outputs.is_empty() {
        writeln!(out, "  {{ rank=sink; {}}}", outputs.concat())?;
    }
    out.push_str("}\n");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::text::tests::sdpa;

    #[test]
    fn contains_nodes_edges_and_outputs() {
        let dot = to_dot(&sdpa());
        assert!(dot.starts_with("digraph \"sdpa\" {\n"), "{dot}");
        for line in [
            "  v0 [label=\"%0 param[name=q]\\nf32[B, H, S, D]\", shape=invhouse, style=filled, fillcolor=\"#dbe8fb\"];",
            "  v3 [label=\"%3 transpose[perm=[0, 1, 3, 2]]\\nf32[B, H, D, S]\"];",
            "  v1 -> v3;",
            "  v0 -> v4 [label=\"0\"];",
            "  v3 -> v4 [label=\"1\"];",
            "  out0 [label=\"output out\", shape=house, style=filled, fillcolor=\"#dcf2d8\"];",
            "  v9 -> out0;",
            "  { rank=source; v0; v1; v2; }",
            "  { rank=sink; out0; }",
        ] {
            assert!(dot.lines().any(|l| l == line), "missing {line}\n{dot}");
        }
        // 10 values + 1 output; 9 operand edges + 1 output edge.
        assert_eq!(dot.lines().filter(|l| l.contains("[label=\"%") || l.contains("[label=\"output")).count(), 11);
        assert_eq!(dot.lines().filter(|l| l.contains(" -> ")).count(), 10);
        assert_eq!(dot, to_dot(&sdpa()));
    }

    #[test]
    fn escapes_quotes() {
        let mut g = sdpa();
        g.name = "a \"b\"".into();
        assert!(to_dot(&g).starts_with("digraph \"a \\\"b\\\"\" {"));
    }
}
