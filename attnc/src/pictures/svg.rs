//! The IR graph of one function as an SVG picture, laid out by `layout-rs` (no Graphviz).
//!
//! One box per value, labelled as in the text form (`%N op[attrs]`); parameters, outputs and
//! fused flash ops are filled distinctly, and a flash op shows its score and mask on lines of
//! their own. Every edge runs from operand to user and is labelled with the type flowing along
//! it (`f32[B, H, S, D]`; `1: f32[...]` names the operand slot of a user with several). The
//! picture depends only on the graph and the title, so it can be snapshot-tested.
//!
//! `layout-rs` ranks the graph, orders the ranks and routes the edges; `place` assigns the x
//! coordinates (layout-rs's own pass panics on ordinary graphs; see there), and this module
//! draws the result (the `Canvas` below is layout-rs's render backend), so the markup, fonts and
//! escaping are ours: monospace text, one CSS class per kind of box, and no hash-map order.

mod canvas;
mod place;

use super::{PictureError, Result};
use attn_compiler::ir::{Attr, Graph, Op, print_order, value_numbers};
use canvas::{Canvas, EDGE_UNIT, line_height};
use layout::core::base::Orientation;
use layout::core::color::Color;
use layout::core::geometry::Point;
use layout::core::style::StyleAttr;
use layout::std_shapes::shapes::{Arrow, Element, ShapeKind};
use layout::topo::layout::VisualGraph;
use place::EdgeEnds;

/// The most boxes and edge labels (values, outputs and edges) a picture lays out. Laying out
/// grows faster than quadratically with their number (layout-rs's ranking and crossing
/// reduction): eight stacked transformer blocks (330 values, 691 items) take about 1.4 s.
pub const MAX_ITEMS: usize = 700;

/// The layout unit of box text (see [`canvas::font_px`]).
const BOX_UNIT: usize = 7;
/// Padding inside a box, in pixels.
const BOX_PAD: f64 = 8.0;

/// What a box shows, which picks its fill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Param,
    Op,
    Flash,
    Output,
}

impl Kind {
    /// CSS class, legend text, fill and stroke.
    fn style(self) -> (&'static str, &'static str, u32, u32) {
        match self {
            Kind::Param => ("param", "parameter", 0xdbe8fb, 0x4a6fa5),
            Kind::Op => ("op", "op", 0xffffff, 0x333333),
            Kind::Flash => ("flash", "fused flash op", 0xffc48a, 0xd35400),
            Kind::Output => ("output", "output", 0xdcf2d8, 0x3c8d40),
        }
    }

    fn look(self) -> StyleAttr {
        let (_, _, fill, stroke) = self.style();
        let width = if self == Kind::Flash { 3 } else { 1 };
        StyleAttr::new(rgb(stroke), width, Some(rgb(fill)), 4, BOX_UNIT)
    }
}

/// The colour of the fused flash ops' boxes (`Kind::Flash`), for tests and docs.
pub const FLASH_FILL: &str = "#ffc48a";

/// The legend: text, fill and stroke of each kind of box.
fn legend() -> Vec<(&'static str, u32, u32)> {
    [Kind::Param, Kind::Op, Kind::Flash, Kind::Output]
        .into_iter()
        .map(|k| k.style())
        .map(|(_, text, fill, stroke)| (text, fill, stroke))
        .collect()
}

fn rgb(hex: u32) -> Color {
    Color::new((hex << 8) | 0xff)
}

/// The SVG of `graph`, headed by `title`. Refuses graphs over [`MAX_ITEMS`] boxes and edges.
pub fn graph_svg(graph: &Graph, title: &str) -> Result<String> {
    let edges: usize = graph.values().map(|v| graph.operands(v).len()).sum::<usize>() + graph.outputs().len();
    let items = graph.len() + graph.outputs().len() + edges;
    if items > MAX_ITEMS {
        return Err(PictureError::TooLarge {
            what: format!("the graph of `{}`", graph.name),
            detail: format!(
                "{}, {} and {}: {items} boxes and labels to lay out, over the limit of {MAX_ITEMS} (--emit dot has no limit)",
                count(graph.len(), "value"),
                count(graph.outputs().len(), "output"),
                count(edges, "edge")
            ),
        });
    }
    let (vg, boxes, edges) = visual_graph(graph);
    let mut canvas = Canvas::default();
    let mut arrow = Arrow::simple("");
    arrow.look = edge_look();
    place::draw(vg, boxes, &edges, &arrow, &mut canvas);
    Ok(canvas.finish(title, &legend()))
}

/// `1 edge`, `2 edges`.
fn count(n: usize, noun: &str) -> String {
    if n == 1 { format!("1 {noun}") } else { format!("{n} {noun}s") }
}

fn edge_look() -> StyleAttr {
    StyleAttr::new(rgb(0x666666), 1, None, 0, EDGE_UNIT)
}

/// The graph as `layout-rs` boxes (values in print order, then outputs) and labelled arrows,
/// with the number of boxes and the arrows' ends in the order they were added.
fn visual_graph(graph: &Graph) -> (VisualGraph, usize, Vec<EdgeEnds>) {
    let mut vg = VisualGraph::new(Orientation::TopToBottom);
    let numbers = value_numbers(graph);
    let order = print_order(graph);
    let mut handles = vec![None; graph.len()];
    for &v in &order {
        let node = graph.node(v);
        let kind = match &node.op {
            Op::Param(_) => Kind::Param,
            Op::Flash(_) => Kind::Flash,
            _ => Kind::Op,
        };
        let lines = op_lines(&format!("%{} ", numbers[v.index()]), &node.op);
        handles[v.index()] = Some(vg.add_node(element(&lines, kind)));
    }
    let outputs: Vec<_> =
        graph.outputs().iter().map(|(name, v)| (vg.add_node(element(&[format!("output {name}")], Kind::Output)), *v)).collect();
    let boxes = vg.num_nodes();
    let mut edges = Vec::new();
    let mut add = |vg: &mut VisualGraph, label: String, from: Option<&Option<_>>, to| {
        // An operand or output pointing at a missing node (a corrupt graph) gets no edge, and a
        // node that is its own operand (a cycle) none either: layout-rs draws those differently.
        if let Some(Some(from)) = from
            && *from != to
        {
            let mut arrow = Arrow::simple(&label);
            arrow.look = edge_look();
            vg.add_edge(arrow, *from, to);
            edges.push(EdgeEnds { from: *from, to });
        }
    };
    for &v in &order {
        let operands = graph.operands(v);
        for (slot, a) in operands.iter().enumerate() {
            let ty = &graph.node(*a).ty;
            let label = if operands.len() > 1 { format!("{slot}: {ty}") } else { ty.to_string() };
            if let Some(Some(to)) = handles.get(v.index()) {
                add(&mut vg, label, handles.get(a.index()), *to);
            }
        }
    }
    for (out, v) in outputs {
        let label = handles.get(v.index()).map(|_| graph.node(v).ty.to_string()).unwrap_or_default();
        add(&mut vg, label, handles.get(v.index()), out);
    }
    (vg, boxes, edges)
}

/// The box text of an op: `prefix name[attrs]`, and for a flash op its score and mask on lines
/// below. Attributes print as in the text form, names quoted unless they are plain words.
fn op_lines(prefix: &str, op: &Op) -> Vec<String> {
    let mut attrs = Vec::new();
    let mut below = Vec::new();
    for (key, value) in op.attrs() {
        match value {
            Attr::Name(text) if matches!(op, Op::Flash(_)) && (key == "score" || key == "mask") => {
                below.push(format!("{key}: {text}"));
            }
            Attr::Name(name) if !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.') => {
                attrs.push(format!("{key}={name}"));
            }
            Attr::Name(name) => attrs.push(format!("{key}={name:?}")),
            other => attrs.push(format!("{key}={other}")),
        }
    }
    let head = if attrs.is_empty() { format!("{prefix}{}", op.name()) } else { format!("{prefix}{}[{}]", op.name(), attrs.join(", ")) };
    std::iter::once(head).chain(below).collect()
}

/// A box sized for `lines` of monospace text.
fn element(lines: &[String], kind: Kind) -> Element {
    let chars = lines.iter().map(|l| l.chars().count()).max().unwrap_or(0).max(4);
    let size = Point::new(chars as f64 * BOX_UNIT as f64 + 2.0 * BOX_PAD, lines.len() as f64 * line_height(BOX_UNIT) + 2.0 * BOX_PAD);
    let mut e = Element::create(ShapeKind::new_box(&lines.join("\n")), kind.look(), Orientation::TopToBottom, size);
    e.properties = Some(kind.style().0.to_string());
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Graph {
        Graph::parse(text).unwrap()
    }

    /// The IR of an example, optimised or as written (their text is the examples' snapshots).
    fn example(name: &str, optimise: bool) -> Graph {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples").join(format!("{name}.attn"));
        let source = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let compiler = attn_compiler::Compiler::default();
        let graph = compiler.check(&source).unwrap_or_else(|d| panic!("{}", d[0])).module.graphs.remove(0);
        if optimise { compiler.optimize(&graph).graph } else { graph }
    }

    /// The SVG of `g`, checked to parse as XML; returns the text.
    fn svg(g: &Graph) -> String {
        let s = graph_svg(g, &format!("graph {}", g.name)).unwrap();
        if let Err(e) = roxmltree::Document::parse(&s) {
            panic!("not XML: {e}\n{s}");
        }
        s
    }

    /// The texts of elements with `class`.
    fn texts(svg: &str, class: &str) -> Vec<String> {
        let doc = roxmltree::Document::parse(svg).unwrap();
        doc.descendants()
            .filter(|n| n.attribute("class") == Some(class))
            .map(|n| n.descendants().filter(|t| t.is_text()).filter_map(|t| t.text()).collect::<Vec<_>>().join("\n"))
            .collect()
    }

    #[test]
    fn one_box_per_value_and_output_and_typed_edges() {
        let s = svg(&example("sdpa", false));
        assert_eq!(texts(&s, "param").len(), 3);
        assert_eq!(texts(&s, "op").len(), 7);
        assert_eq!(texts(&s, "output").len(), 1);
        assert_eq!(texts(&s, "flash").len(), 0);
        // 9 operand edges + 1 output edge, each labelled with its type.
        assert_eq!(s.matches("<path class=\"edge\"").count(), 10);
        let edges = texts(&s, "edge");
        assert!(edges.contains(&"1: f32[B, H, D, S]".to_string()), "{edges:?}");
        assert!(edges.contains(&"f32[B, H, S, S]".to_string()), "{edges:?}");
        let labels = texts(&s, "label");
        assert!(labels.contains(&"%3 transpose[perm=[0, 1, 3, 2]]".to_string()), "{labels:?}");
        assert!(labels.contains(&"%0 param[name=q]".to_string()), "{labels:?}");
        assert!(labels.contains(&"output out".to_string()), "{labels:?}");
        assert_eq!(texts(&s, "title"), ["graph sdpa"]);
    }

    #[test]
    fn flash_ops_are_highlighted_with_score_and_mask() {
        let s = svg(&example("causal", true));
        let doc = roxmltree::Document::parse(&s).unwrap();
        let fills: Vec<_> = doc.descendants().filter(|n| n.attribute("class") == Some("flash")).map(|n| n.attribute("fill")).collect();
        assert_eq!(fills, [Some(FLASH_FILL)]);
        let labels = texts(&s, "label");
        assert!(labels.contains(&"%6 flash[rank=4, weights=softmax]\nscore: s\nmask: j <= i".to_string()), "{labels:?}");
        assert!(s.contains("mask: j &lt;= i"));
        assert!(texts(&svg(&example("sdpa", false)), "flash").is_empty());
    }

    #[test]
    fn text_is_escaped() {
        let g = parse("graph \"a<b & 'c'\" {\n  %0 = param[name=\"x<y&z\"] : f32[N]\n  output \"<out>\" = %0\n}");
        let s = svg(&g);
        assert_eq!(texts(&s, "title"), ["graph a<b & 'c'"]);
        assert!(texts(&s, "label").contains(&"%0 param[name=\"x<y&z\"]".to_string()), "{s}");
        assert!(texts(&s, "label").contains(&"output <out>".to_string()), "{s}");
        assert_eq!(canvas::escape("a\u{1}b\"&"), "a\u{fffd}b&quot;&amp;");
    }

    #[test]
    fn awkward_shapes_lay_out() {
        for text in [
            // No values at all.
            "graph empty {\n}",
            // One value, no edges.
            "graph one {\n  %0 = param[name=x] : f32[N]\n}",
            // Values without edges, one of them output twice.
            "graph apart {\n  %0 = param[name=x] : f32[N]\n  %1 = param[name=y] : f32[N]\n  output a = %0\n  output b = %0\n}",
            // One value used twice by one user, and output twice.
            "graph square {\n  %0 = param[name=x] : f32[N]\n  %1 = mul %0, %0 : f32[N]\n  output a = %1\n  output b = %1\n}",
            // layout-rs's own coordinate pass (`VisualGraph::do_it`) panics on this one.
            "graph g124 {\n  %0 = param[name=x] : f32[N]\n  %1 = add %0, %0 : f32[N]\n  %2 = param[name=p2] : f32[N]\n  %3 = exp %1 : f32[N]
  %4 = exp %1 : f32[N]\n  %5 = add %3, %2 : f32[N]\n  %6 = add %0, %1 : f32[N]\n  %7 = add %0, %6 : f32[N]\n  %8 = add %2, %7 : f32[N]
  %9 = add %6, %2 : f32[N]\n  %10 = add %1, %2 : f32[N]\n  %11 = exp %5 : f32[N]\n  %12 = select %0, %3, %0 : f32[N]
  %13 = add %10, %6 : f32[N]\n  %14 = exp %1 : f32[N]\n  %15 = add %14, %14 : f32[N]\n  %16 = exp %9 : f32[N]
  %17 = param[name=p17] : f32[N]\n  %18 = param[name=p18] : f32[N]\n  %19 = add %6, %8 : f32[N]
  output o0 = %1\n  output o1 = %6\n  output o2 = %7\n}",
            // A value used by a user on the next rank and one far below.
            "graph skip {\n  %0 = param[name=x] : f32[N]\n  %1 = exp %0 : f32[N]\n  %2 = exp %1 : f32[N]\n  %3 = exp %2 : f32[N]\n  %4 = add %0, %3 : f32[N]\n  output o = %4\n}",
        ] {
            let g = parse(text);
            let s = svg(&g);
            assert_eq!(texts(&s, "op").len() + texts(&s, "param").len(), g.len(), "{text}");
        }
    }

    /// Random DAGs (a fixed generator, so the test is repeatable: unused values, parameters anywhere,
    /// repeated operands, no or repeated outputs) lay out without panicking, every edge drawn.
    #[test]
    fn random_dags_lay_out() {
        let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for case in 0..60 {
            let n = 1 + next(40);
            let mut text = format!("graph g{case} {{\n  %0 = param[name=x] : f32[N]\n");
            for v in 1..n {
                match next(5) {
                    0 => text.push_str(&format!("  %{v} = exp %{} : f32[N]\n", next(v))),
                    1 => text.push_str(&format!("  %{v} = param[name=p{v}] : f32[N]\n")),
                    2 => text.push_str(&format!("  %{v} = select %{}, %{}, %{} : f32[N]\n", next(v), next(v), next(v))),
                    _ => text.push_str(&format!("  %{v} = add %{}, %{} : f32[N]\n", next(v), next(v))),
                }
            }
            for k in 0..next(4) {
                text.push_str(&format!("  output o{k} = %{}\n", next(n)));
            }
            text.push('}');
            let g = parse(&text);
            let s = svg(&g);
            // Every operand and output edge is drawn.
            let edges = g.values().map(|v| g.operands(v).len()).sum::<usize>() + g.outputs().len();
            assert_eq!(s.matches("<path class=\"edge\"").count(), edges, "{text}");
        }
    }

    #[test]
    fn same_graph_same_bytes() {
        assert_eq!(svg(&example("causal", true)), svg(&example("causal", true)));
    }

    #[test]
    fn large_graphs_are_refused() {
        // A chain of 350 values has 349 edges: 699 items, which fit; an output adds two more.
        let mut text = String::from("graph long {\n  %0 = param[name=x] : f32[N]\n");
        for v in 1..350 {
            text.push_str(&format!("  %{v} = exp %{} : f32[N]\n", v - 1));
        }
        assert_eq!(MAX_ITEMS, 700);
        let fits = svg(&parse(&format!("{text}}}")));
        assert_eq!(texts(&fits, "op").len(), 349);
        match graph_svg(&parse(&format!("{text}  output o = %349\n}}")), "t") {
            Err(PictureError::TooLarge { what, detail }) => {
                assert!(what.contains("`long`") && detail.contains("701 boxes and labels") && detail.contains("700"), "{what}: {detail}");
            }
            other => panic!("{other:?}"),
        }
    }
}
