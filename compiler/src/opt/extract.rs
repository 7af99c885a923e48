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
use std::collections::VecDeque;

/// The best node and its cost, per canonical class.
pub struct Extracted<'a> {
    eg: &'a EG,
    /// Indexed by class id (ids are dense: egg numbers classes as it adds nodes).
    best: Vec<Option<(f64, usize)>>,
}

impl<'a> Extracted<'a> {
    /// Finds the cheapest node of every class of `eg` that has one of finite or infinite cost
    /// (a class all of whose nodes need an uncosted class has none; [`Self::find_best_node`]
    /// then returns its first node). Tables are vectors indexed by class id, not hash maps:
    /// every step looks up a class's children, and a long program has tens of thousands.
    pub fn new(eg: &'a EG, cost: &Cost<'_>) -> Extracted<'a> {
        let mut ids: Vec<Id> = eg.classes().map(|c| c.id).collect();
        ids.sort();
        let slots = ids.last().map_or(0, |id| usize::from(*id) + 1);
        // Each node's own cost, once; and for each class, the classes whose nodes use it.
        let mut own: Vec<Vec<f64>> = vec![Vec::new(); slots];
        let mut users: Vec<Vec<Id>> = vec![Vec::new(); slots];
        for &id in &ids {
            let nodes = &eg[id].nodes;
            own[usize::from(id)] = nodes.iter().map(|n| not_nan(cost.own_in(n, id))).collect();
            for n in nodes {
                for child in n.args() {
                    if let Some(u) = users.get_mut(usize::from(eg.find(*child))) {
                        u.push(id);
                    }
                }
            }
        }
        let mut best: Vec<Option<(f64, usize)>> = vec![None; slots];
        let mut queued: Vec<bool> = vec![false; slots];
        for id in &ids {
            queued[usize::from(*id)] = true;
        }
        let mut queue: VecDeque<Id> = ids.iter().copied().collect();
        while let Some(id) = queue.pop_front() {
            let k = usize::from(id);
            queued[k] = false;
            let own = &own[k];
            let mut found: Option<(f64, usize)> = None;
            for (i, n) in eg[id].nodes.iter().enumerate() {
                let Some(&own_cost) = own.get(i) else { continue };
                let total = n
                    .args()
                    .iter()
                    .try_fold(own_cost, |acc, c| best.get(usize::from(eg.find(*c))).copied().flatten().map(|(b, _)| acc + b));
                if let Some(total) = total.map(not_nan)
                    && found.is_none_or(|(f, _)| total < f)
                {
                    found = Some((total, i));
                }
            }
            let Some((total, i)) = found else { continue };
            if best[k].is_some_and(|(old, _)| total >= old) {
                continue;
            }
            best[k] = Some((total, i));
            for user in &users[k] {
                let q = &mut queued[usize::from(*user)];
                if !*q {
                    *q = true;
                    queue.push_back(*user);
                }
            }
        }
        Extracted { eg, best }
    }

    /// The best entry of a class.
    fn best_of(&self, class: Id) -> Option<(f64, usize)> {
        self.best.get(usize::from(self.eg.find(class))).copied().flatten()
    }

    /// The cheapest node of `class`.
    pub fn find_best_node(&self, class: Id) -> &'a ENode {
        let i = self.best_of(class).map_or(0, |(_, i)| i);
        &self.eg[self.eg.find(class)].nodes[i]
    }

    /// The tree cost of `class`'s cheapest node (infinite when it has none).
    pub fn find_best_cost(&self, class: Id) -> f64 {
        self.best_of(class).map_or(f64::INFINITY, |(c, _)| c)
    }
}

/// Costs are compared with `<`: a NaN (0 · ∞ in a product of sizes) counts as infinite.
fn not_nan(c: f64) -> f64 {
    if c.is_nan() { f64::INFINITY } else { c }
}
