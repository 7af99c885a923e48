//! Where everything goes. `layout-rs` ranks the graph, adds label and bend points to the edges,
//! orders each rank to reduce crossings, sets the rows' heights and draws boxes and curves; the
//! x coordinates are assigned here.
//!
//! Why not `VisualGraph::do_it`: its coordinate pass (Brandes–Köpf, then an edge straightener)
//! asserts invariants it does not keep, and panics on ordinary graphs (two labelled edges side
//! by side into a node that both get straightened: `edge_fixer.rs`, "loc.x >= leftmost"). So
//! this module runs the same lowering, asks the placer only for rows, and places each row itself:
//! a few sweeps that pull every node towards the mean of its neighbours in the row above (then
//! below), each row solved exactly under its order and spacing (isotonic regression, so nodes
//! keep their order and never overlap).

use layout::adt::dag::NodeHandle;
use layout::core::format::{RenderBackend, Renderable, Visible};
use layout::std_shapes::render::render_arrow;
use layout::std_shapes::shapes::{Arrow, Element};
use layout::topo::layout::VisualGraph;
use layout::topo::placer::Placer;

/// Down-and-up sweeps of the x placement; more change little.
const SWEEPS: usize = 8;
/// The weight of a node's current place when it has no neighbours on the side being swept:
/// small, so such a node moves aside for the others.
const FREE_WEIGHT: f64 = 1e-3;

/// An edge as it was added to the graph: from operand to user, in `add_edge` order.
#[derive(Clone, Copy, Debug)]
pub(super) struct EdgeEnds {
    /// The operand's box.
    pub from: NodeHandle,
    /// The user's box.
    pub to: NodeHandle,
}

/// Lays out `vg` (whose first `boxes` nodes are the boxes and whose labelled `edges` were added
/// in this order, none from a box to itself) and draws it on `canvas`, each edge as `arrow`.
pub(super) fn draw(mut vg: VisualGraph, boxes: usize, edges: &[EdgeEnds], arrow: &Arrow, canvas: &mut dyn RenderBackend) {
    if vg.num_nodes() == 0 {
        return;
    }
    // The DAG's self-check after every edge makes lowering cubic; it checks layout-rs, not us.
    vg.dag.set_validate(false);
    vg.to_valid_dag();
    // Each labelled edge gets a label node, numbered after the boxes in edge order.
    vg.split_text_edges();
    // Edges over several ranks get bend points (numbered after the labels); ranks get ordered.
    vg.split_long_edges(false);
    for h in vg.iter_nodes() {
        vg.element_mut(h).resize();
    }
    // Rows and their heights only (`true` skips the coordinate pass that panics).
    Placer::new(&mut vg).layout(true);
    assign_x(&mut vg);
    for h in vg.iter_nodes() {
        vg.element(h).render(false, canvas);
    }
    let first_bend = boxes + edges.len();
    for (k, e) in edges.iter().enumerate() {
        if let Some(path) = edge_path(&vg, NodeHandle::new(boxes + k), boxes, first_bend, *e) {
            let elements: Vec<Element> = path.iter().map(|h| vg.element(*h).clone()).collect();
            render_arrow(canvas, false, &elements, arrow);
        }
    }
}

/// The nodes one edge runs through, from `e.from` through its label to `e.to`; `None` if the
/// lowered graph does not have that shape (then the edge is not drawn rather than drawn wrong).
fn edge_path(vg: &VisualGraph, label: NodeHandle, boxes: usize, first_bend: usize, e: EdgeEnds) -> Option<Vec<NodeHandle>> {
    if label.get_index() >= vg.num_nodes() {
        return None;
    }
    // Follow single links through bend points until a box.
    let walk = |forward: bool| -> Option<Vec<NodeHandle>> {
        let mut nodes = Vec::new();
        let mut at = label;
        for _ in 0..vg.num_nodes() {
            let next = if forward { vg.dag.successors(at) } else { vg.dag.predecessors(at) };
            let [n] = next.as_slice() else { return None };
            nodes.push(*n);
            match n.get_index() {
                i if i < boxes => return Some(nodes),
                i if i >= first_bend => at = *n,
                _ => return None,
            }
        }
        None
    };
    let mut path = walk(false)?;
    path.reverse();
    path.push(label);
    path.extend(walk(true)?);
    let (first, last) = (path.first()?.get_index(), path.last()?.get_index());
    if (first, last) == (e.to.get_index(), e.from.get_index()) {
        // layout-rs turned this edge round to break a cycle (only a corrupt graph has one).
        path.reverse();
    }
    ((path.first()?.get_index(), path.last()?.get_index()) == (e.from.get_index(), e.to.get_index())).then_some(path)
}

/// Sets every node's x: rows keep layout-rs's order and spacing, nodes move towards their
/// neighbours.
fn assign_x(vg: &mut VisualGraph) {
    let n = vg.num_nodes();
    let rows: Vec<Vec<NodeHandle>> = (0..vg.dag.num_levels()).map(|r| vg.dag.row(r).clone()).collect();
    let mut x: Vec<f64> = (0..n).map(|i| vg.pos(NodeHandle::new(i)).center().x).collect();
    let width: Vec<f64> = (0..n).map(|i| vg.pos(NodeHandle::new(i)).size(true).x).collect();
    let preds: Vec<Vec<usize>> = (0..n).map(|i| vg.preds(NodeHandle::new(i)).iter().map(|h| h.get_index()).collect()).collect();
    let succs: Vec<Vec<usize>> = (0..n).map(|i| vg.succ(NodeHandle::new(i)).iter().map(|h| h.get_index()).collect()).collect();
    let both: Vec<Vec<usize>> = (0..n).map(|i| preds[i].iter().chain(&succs[i]).copied().collect()).collect();
    for _ in 0..SWEEPS {
        for row in rows.iter().skip(1) {
            place_row(row, &preds, &width, &mut x);
        }
        for row in rows.iter().rev().skip(1) {
            place_row(row, &succs, &width, &mut x);
        }
    }
    for row in &rows {
        place_row(row, &both, &width, &mut x);
    }
    for (i, x) in x.into_iter().enumerate() {
        vg.pos_mut(NodeHandle::new(i)).set_x(x);
    }
}

/// Places one row: each node as near as it can to the mean x of its `neighbours`, in order, with
/// adjacent centres at least half their widths apart. Minimises the squared displacement
/// exactly: with `o_k` the least offset of node `k` from the first, `x_k - o_k` must not
/// decrease, which is isotonic regression (pool adjacent violators).
fn place_row(row: &[NodeHandle], neighbours: &[Vec<usize>], width: &[f64], x: &mut [f64]) {
    // (weighted sum, weight, nodes) of each pooled block.
    let mut blocks: Vec<(f64, f64, usize)> = Vec::with_capacity(row.len());
    let mut offsets = Vec::with_capacity(row.len());
    let mut offset = 0.0;
    for (k, h) in row.iter().enumerate() {
        let i = h.get_index();
        if k > 0 {
            offset += (width[row[k - 1].get_index()] + width[i]) / 2.0;
        }
        offsets.push(offset);
        let near = &neighbours[i];
        let (target, weight) = if near.is_empty() {
            (x[i], FREE_WEIGHT)
        } else {
            (near.iter().map(|&j| x[j]).sum::<f64>() / near.len() as f64, near.len() as f64)
        };
        blocks.push((weight * (target - offset), weight, 1));
        while let [.., (s0, w0, n0), (s1, w1, n1)] = blocks[..] {
            if s0 / w0 <= s1 / w1 {
                break;
            }
            blocks.truncate(blocks.len() - 2);
            blocks.push((s0 + s1, w0 + w1, n0 + n1));
        }
    }
    let mut k = 0;
    for (sum, weight, count) in blocks {
        for _ in 0..count {
            if let (Some(h), Some(o)) = (row.get(k), offsets.get(k)) {
                x[h.get_index()] = sum / weight + o;
            }
            k += 1;
        }
    }
}
