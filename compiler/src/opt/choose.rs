//! Choosing the result: one e-node per class, under the cost the program will really pay.
//!
//! [`super::extract`] finds each class's cheapest node under the *tree* cost (`own + Σ
//! operands`), which counts a value used k times k times. A program that uses one attention
//! result three times (`z @ w1 + z @ w2 + z @ w3`) then looks cheaper with three attentions
//! folded into three products than with `z` once. The program pays the *DAG* cost: the own
//! cost of every class the outputs reach, each once. This module compares whole selections
//! by that cost:
//!
//! - the tree extraction's;
//! - the input's own nodes (each input value's node, found again in its class), with the tree
//!   extraction's choice for classes rewriting added;
//!
//! each improved by single switches (one class's node for another of the class, kept when the
//! DAG cost drops) within a work budget, and keeps the cheaper. The input is one of the
//! candidates, so the result never costs more than the input by the model.

use super::cost::Cost;
use super::extract::Extracted;
use super::lang::{Classes, ENode};
use crate::ir::{Graph, Value};
use egg::Id;

/// Class visits the switching search may spend (each candidate costs one walk of the
/// selection): tens of milliseconds at most; past it the selection stands as it is.
const SEARCH_BUDGET: usize = 4_000_000;

/// Selections reaching more classes than this are compared but not searched.
const SEARCH_MAX_CLASSES: usize = 2_000;

/// One node per class: `pick[class]` indexes the class's nodes.
#[derive(Clone, Debug)]
pub struct Selection {
    pick: Vec<usize>,
}

impl Selection {
    /// The tree extraction's choice for every class.
    pub fn from_tree(classes: &Classes<'_>, tree: &Extracted<'_>) -> Selection {
        let mut pick = vec![0; classes.slots()];
        for id in classes.ids() {
            let nodes = classes.get(id).nodes;
            if let Some(best) = tree.find_best_node(id) {
                pick[usize::from(id)] = nodes.iter().position(|n| std::ptr::eq(n, best)).unwrap_or(0);
            }
        }
        Selection { pick }
    }

    /// `base` with each input value's own node in its class (found again by op, declared type
    /// and operand classes; `order` is the graph's topological order); `None` when one is not found (a class can hold only one of two
    /// input nodes that became equal: the first stands).
    pub fn of_input(graph: &Graph, order: &[Value], classes: &Classes<'_>, class_of: &[Id], base: &Selection) -> Option<Selection> {
        let mut pick = base.pick.clone();
        let mut set = vec![false; pick.len()];
        for &v in order {
            let class = classes.find(*class_of.get(v.index())?);
            let k = usize::from(class);
            if *set.get(k)? {
                continue;
            }
            let node = graph.node(v);
            let args: Vec<Id> =
                graph.operands(v).iter().map(|a| class_of.get(a.index()).map(|c| classes.find(*c))).collect::<Option<_>>()?;
            let found = classes.get(class).nodes.iter().position(|n| {
                n.op() == &node.op
                    && n.ty().is_none_or(|t| *t == node.ty)
                    && n.args().len() == args.len()
                    && n.args().iter().zip(&args).all(|(a, b)| classes.find(*a) == *b)
            })?;
            pick[k] = found;
            set[k] = true;
        }
        Some(Selection { pick })
    }

    /// The chosen node of `class`.
    pub fn node<'a>(&self, classes: &Classes<'a>, class: Id) -> Option<&'a ENode> {
        let class = classes.find(class);
        classes.get(class).nodes.get(self.pick.get(usize::from(class)).copied().unwrap_or(0))
    }

    /// The canonical classes the program the selection builds for `roots` computes.
    pub fn reached(&self, classes: &Classes<'_>, roots: &[Id]) -> Vec<bool> {
        let mut seen = vec![false; self.pick.len()];
        let mut stack: Vec<Id> = roots.iter().map(|r| classes.find(*r)).collect();
        while let Some(c) = stack.pop() {
            let Some(s) = seen.get_mut(usize::from(c)) else { continue };
            if std::mem::replace(s, true) {
                continue;
            }
            if let Some(n) = self.node(classes, c) {
                stack.extend(n.args().iter().map(|a| classes.find(*a)));
            }
        }
        seen
    }

    /// The DAG cost of the program the selection builds for `roots`, and the classes it
    /// reaches; `None` when a chosen node needs its own class (a cycle).
    fn dag_cost(&self, t: &Table, roots: &[usize]) -> Option<(f64, Vec<usize>)> {
        #[derive(Clone, Copy, PartialEq)]
        enum Mark {
            New,
            Open,
            Done,
        }
        let mut mark = vec![Mark::New; self.pick.len()];
        let mut reached = Vec::new();
        let mut total = 0.0;
        // (class, whether its operands are listed)
        let mut stack: Vec<(usize, bool)> = roots.iter().map(|r| (*r, false)).collect();
        while let Some((k, listed)) = stack.pop() {
            match (*mark.get(k)?, listed) {
                (Mark::Done, _) => {}
                (Mark::Open, false) => return None,
                (_, true) => mark[k] = Mark::Done,
                (Mark::New, false) => {
                    mark[k] = Mark::Open;
                    let node = t.node(k, *self.pick.get(k)?)?;
                    total += t.own[node];
                    reached.push(k);
                    stack.push((k, true));
                    stack.extend(t.args(node).iter().map(|c| (*c as usize, false)).filter(|(c, _)| mark.get(*c) != Some(&Mark::Done)));
                }
            }
        }
        Some((if total.is_nan() { f64::INFINITY } else { total }, reached))
    }

    /// Switches one reached class's node at a time to another of its class, keeping a switch
    /// when the DAG cost drops, until a whole pass over the reached classes finds none or
    /// `budget` class visits are spent (each try walks the selection once). Returns the cost.
    fn improve(&mut self, t: &Table, roots: &[usize], budget: &mut usize) -> Option<f64> {
        let (mut best, mut reached) = self.dag_cost(t, roots)?;
        if reached.len() > SEARCH_MAX_CLASSES {
            return Some(best);
        }
        let (mut at, mut unchanged) = (0, 0);
        while unchanged < reached.len() && *budget > 0 {
            let k = reached[at % reached.len()];
            let kept = self.pick[k];
            let mut switched = false;
            for i in (0..t.count[k]).filter(|i| *i != kept) {
                self.pick[k] = i;
                *budget = budget.saturating_sub(reached.len());
                match self.dag_cost(t, roots) {
                    Some((c, now)) if c < best * (1.0 - 1e-9) => {
                        (best, reached, switched) = (c, now, true);
                        break;
                    }
                    _ => self.pick[k] = kept,
                }
            }
            unchanged = if switched { 0 } else { unchanged + 1 };
            at += 1;
        }
        Some(best)
    }
}

/// The cheapest selection by DAG cost among the candidates (see the module's doc), with its
/// cost (infinite when none could be walked).
pub fn choose(
    (graph, order): (&Graph, &[Value]),
    classes: &Classes<'_>,
    cost: &Cost<'_>,
    tree: &Extracted<'_>,
    class_of: &[Id],
    roots: &[Id],
) -> (Selection, f64) {
    let table = Table::new(classes, cost);
    let roots: Vec<usize> = roots.iter().map(|r| usize::from(classes.find(*r))).collect();
    let mut budget = SEARCH_BUDGET;
    let from_tree = Selection::from_tree(classes, tree);
    let input = Selection::of_input(graph, order, classes, class_of, &from_tree);
    let mut best: Option<(Selection, f64)> = None;
    for mut s in std::iter::once(from_tree).chain(input) {
        let Some(c) = s.improve(&table, &roots, &mut budget) else { continue };
        if best.as_ref().is_none_or(|(_, b)| c < *b) {
            best = Some((s, c));
        }
    }
    best.unwrap_or_else(|| (Selection::from_tree(classes, tree), f64::INFINITY))
}

/// The e-graph flattened for the walks above: per class slot its nodes (`first`, `count`),
/// per node its own cost and canonical operand classes. Lookups by id in the e-graph and in the
/// cost model's memo are hashing; a search walks the selection thousands of times.
struct Table {
    first: Vec<usize>,
    count: Vec<usize>,
    own: Vec<f64>,
    arg_start: Vec<usize>,
    args: Vec<u32>,
}

impl Table {
    fn new(classes: &Classes<'_>, cost: &Cost<'_>) -> Table {
        let slots = classes.slots();
        let mut t = Table { first: vec![0; slots], count: vec![0; slots], own: Vec::new(), arg_start: vec![0], args: Vec::new() };
        for id in classes.ids() {
            let k = usize::from(id);
            let nodes = classes.get(id).nodes;
            (t.first[k], t.count[k]) = (t.own.len(), nodes.len());
            for n in nodes {
                t.own.push(cost.own_in(n, id));
                t.args.extend(n.args().iter().map(|a| u32::try_from(usize::from(classes.find(*a))).unwrap_or(u32::MAX)));
                t.arg_start.push(t.args.len());
            }
        }
        t
    }

    /// The global index of node `i` of class `k`.
    fn node(&self, k: usize, i: usize) -> Option<usize> {
        (i < *self.count.get(k)?).then(|| self.first[k] + i)
    }

    /// The operand classes of node `node`.
    fn args(&self, node: usize) -> &[u32] {
        &self.args[self.arg_start[node]..self.arg_start[node + 1]]
    }
}
