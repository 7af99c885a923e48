//! Extraction: the cheapest node of every e-class under the tree cost `own + Σ children`.
//!
//! egg's `Extractor` sweeps every class until nothing changes, in hash order: a chain of N lets
//! takes about N sweeps, so extraction was quadratic in program size (4 s for 2k lets). This one
//! computes each node's own cost once, visits classes in id order (children first, as the graph
//! was loaded), and revisits a class only when one of its children got cheaper: linear for the
//! DAGs rewriting produces, and it ends on cycles because a cost only ever decreases strictly.
//! Ties keep the first node of the class, as egg does.

use super::cost::Cost;
use super::lang::{EG, ENode};
use egg::Id;
use std::collections::{HashMap, VecDeque};

/// The best node and its cost, per canonical class.
pub struct Extracted<'a> {
    eg: &'a EG,
    best: HashMap<Id, (f64, usize)>,
}

impl<'a> Extracted<'a> {
    /// Finds the cheapest node of every class of `eg` that has one of finite or infinite cost
    /// (a class all of whose nodes need an uncosted class has none; [`Self::find_best_node`]
    /// then returns its first node).
    pub fn new(eg: &'a EG, cost: &Cost<'_>) -> Extracted<'a> {
        let mut ids: Vec<Id> = eg.classes().map(|c| c.id).collect();
        ids.sort();
        // Each node's own cost, once; and for each class, the classes whose nodes use it.
        let mut own: HashMap<Id, Vec<f64>> = HashMap::with_capacity(ids.len());
        let mut users: HashMap<Id, Vec<Id>> = HashMap::with_capacity(ids.len());
        for &id in &ids {
            let nodes = &eg[id].nodes;
            own.insert(id, nodes.iter().map(|n| not_nan(cost.own_in(n, id))).collect());
            for n in nodes {
                for child in n.args() {
                    users.entry(eg.find(*child)).or_default().push(id);
                }
            }
        }
        let mut best: HashMap<Id, (f64, usize)> = HashMap::with_capacity(ids.len());
        let mut queued: HashMap<Id, bool> = ids.iter().map(|id| (*id, true)).collect();
        let mut queue: VecDeque<Id> = ids.iter().copied().collect();
        while let Some(id) = queue.pop_front() {
            queued.insert(id, false);
            let Some(own) = own.get(&id) else { continue };
            let mut found: Option<(f64, usize)> = None;
            for (i, n) in eg[id].nodes.iter().enumerate() {
                let total = n.args().iter().try_fold(own[i], |acc, c| best.get(&eg.find(*c)).map(|(b, _)| acc + b));
                if let Some(total) = total.map(not_nan)
                    && found.is_none_or(|(f, _)| total < f)
                {
                    found = Some((total, i));
                }
            }
            let Some((total, i)) = found else { continue };
            if best.get(&id).is_some_and(|(old, _)| total >= *old) {
                continue;
            }
            best.insert(id, (total, i));
            for user in users.get(&id).into_iter().flatten() {
                if let Some(q) = queued.get_mut(user)
                    && !*q
                {
                    *q = true;
                    queue.push_back(*user);
                }
            }
        }
        Extracted { eg, best }
    }

    /// The cheapest node of `class`.
    pub fn find_best_node(&self, class: Id) -> &'a ENode {
        let class = self.eg.find(class);
        let i = self.best.get(&class).map_or(0, |(_, i)| *i);
        &self.eg[class].nodes[i]
    }

    /// The tree cost of `class`'s cheapest node (infinite when it has none).
    pub fn find_best_cost(&self, class: Id) -> f64 {
        self.best.get(&self.eg.find(class)).map_or(f64::INFINITY, |(c, _)| *c)
    }
}

/// Costs are compared with `<`: a NaN (0 · ∞ in a product of sizes) counts as infinite.
fn not_nan(c: f64) -> f64 {
    if c.is_nan() { f64::INFINITY } else { c }
}
