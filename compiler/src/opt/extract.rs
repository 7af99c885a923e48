//! Extraction: the cheapest node of every e-class under the tree cost `own + Σ children`.
//!
//! egg's `Extractor` sweeps every class until nothing changes, in hash order: a chain of N lets
//! takes about N sweeps, so extraction was quadratic in program size (4 s for 2k lets). This one
//! computes each node's own cost once, visits classes in id order (children first, as the graph
//! was loaded), and revisits a class only when one of its children got cheaper: linear for the
//! DAGs rewriting produces, and it ends on cycles because a cost only ever decreases strictly.
//! Ties keep the first node of the class, as egg does.

use super::cost::Cost;
use super::lang::{Classes, ENode};
use egg::Id;
use std::collections::VecDeque;

/// The best node and its cost, per canonical class.
pub struct Extracted<'a> {
    classes: &'a Classes<'a>,
    /// Indexed by class id (ids are dense: egg numbers classes as it adds nodes).
    best: Vec<Option<(f64, usize)>>,
}

impl<'a> Extracted<'a> {
    /// Finds the cheapest node of every class that has one of finite or infinite cost (a
    /// class all of whose nodes need an uncosted class has none; [`Self::find_best_node`]
    /// then returns its first node). Tables are flat vectors indexed by class id, not hash
    /// maps or a vector per class: every step looks up a class's children, and a long program
    /// has tens of thousands.
    pub fn new(classes: &'a Classes<'a>, cost: &Cost<'_>) -> Extracted<'a> {
        let ids: Vec<Id> = classes.ids().collect();
        let slots = classes.slots();
        // Each node's own cost, once: class `k`'s are `own[first[k]..]`, one per node.
        let mut first: Vec<usize> = vec![0; slots];
        let mut own: Vec<f64> = Vec::new();
        // For each class, the classes whose nodes use it (once per use), as one table:
        // class `k`'s users are `users[user_start[k]..user_start[k + 1]]`.
        let mut user_start: Vec<usize> = vec![0; slots + 1];
        for &id in &ids {
            let nodes = classes.get(id).nodes;
            first[usize::from(id)] = own.len();
            own.extend(nodes.iter().map(|n| not_nan(cost.own_in(n, id))));
            for n in nodes {
                for child in n.args() {
                    let c = usize::from(classes.find(*child));
                    if c < slots {
                        user_start[c + 1] += 1;
                    }
                }
            }
        }
        for k in 0..slots {
            user_start[k + 1] += user_start[k];
        }
        let mut users: Vec<Id> = vec![Id::from(0usize); user_start[slots]];
        let mut filled: Vec<usize> = user_start[..slots].to_vec();
        for &id in &ids {
            for n in classes.get(id).nodes {
                for child in n.args() {
                    if let Some(at) = filled.get_mut(usize::from(classes.find(*child))) {
                        users[*at] = id;
                        *at += 1;
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
            let nodes = classes.get(id).nodes;
            let own = &own[first[k]..first[k] + nodes.len()];
            let mut found: Option<(f64, usize)> = None;
            for (i, (n, &own_cost)) in nodes.iter().zip(own).enumerate() {
                let total = n
                    .args()
                    .iter()
                    .try_fold(own_cost, |acc, c| best.get(usize::from(classes.find(*c))).copied().flatten().map(|(b, _)| acc + b));
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
            for user in &users[user_start[k]..user_start[k + 1]] {
                let q = &mut queued[usize::from(*user)];
                if !*q {
                    *q = true;
                    queue.push_back(*user);
                }
            }
        }
        Extracted { classes, best }
    }

    /// The best entry of a class.
    fn best_of(&self, class: Id) -> Option<(f64, usize)> {
        self.best.get(usize::from(self.classes.find(class))).copied().flatten()
    }

    /// The cheapest node of `class` (`None` only for an id that is no class).
    pub fn find_best_node(&self, class: Id) -> Option<&'a ENode> {
        let i = self.best_of(class).map_or(0, |(_, i)| i);
        self.classes.get(class).nodes.get(i)
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
