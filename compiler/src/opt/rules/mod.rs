//! Rewrite rules, one file per topic. Each rule is a named Rust function from an e-class to
//! equivalent node trees ([`Build`]); [`to_rewrite`] adapts it to egg's searcher and applier.
//! Every new node is type-checked with the IR's shape rules before it is added, so a rule can
//! never put an ill-typed node into the e-graph.
//!
//! Following Cranelift's mid-end: no general commutativity or associativity; the one
//! re-association rule (`assoc`) is guarded by types and decided by the cost model.

/// A rule's name and the ops that can root its matches ([`Rule::name`], [`Rule::wants`]), in
/// its `impl Rule` block: `rule_head!("topic/name", pattern)`.
macro_rules! rule_head {
    ($name:literal, $root:pat) => {
        fn name(&self) -> &'static str {
            $name
        }

        fn wants(&self, op: &Op) -> bool {
            matches!(op, $root)
        }
    };
}

pub mod algebra;
pub mod assoc;
pub mod fusion;
pub mod layout;
pub mod scan;

use super::lang::{EG, ENode, Types};
use crate::ir::{Op, TensorType, infer};
use egg::{Applier, Id, PatternAst, Rewrite, SearchMatches, Searcher, Subst, Symbol, Var};
use std::sync::Arc;

/// A tree of nodes to add: existing classes at the leaves.
#[derive(Clone, Debug)]
pub enum Build {
    /// A class already in the e-graph.
    Class(Id),
    /// A new node over built operands; `ty` for ops that carry their result type.
    Node(Op, Option<TensorType>, Vec<Build>),
}

impl Build {
    /// A new node without a declared type.
    pub fn op(op: Op, args: Vec<Build>) -> Build {
        Build::Node(op, None, args)
    }
}

/// A rewrite rule: proposes trees equal to `class`. Most rules say which ops root a match
/// ([`Rule::wants`]) and what one such node of the class proposes ([`Rule::rewrite_node`]); a
/// rule that looks at the class as a whole overrides [`Rule::rewrite`] instead.
pub trait Rule: Send + Sync {
    /// `topic/name`, as reported by `attnc explain`.
    fn name(&self) -> &'static str;

    /// Whether a node with this op can be the root of a match: the search visits only classes
    /// that hold such a node, so a rule about transposes never looks at the thousands of
    /// classes of a long chain of arithmetic. True for every op `rewrite` starts from.
    fn wants(&self, _op: &Op) -> bool {
        true
    }

    /// The trees equivalent to `class` that its node `n` (one whose op the rule
    /// [`wants`](Rule::wants)) gives, pushed to `out`.
    fn rewrite_node(&self, _eg: &EG, _class: Id, _n: &ENode, _out: &mut Vec<Build>) {}

    /// Trees equivalent to the class (empty: the rule does not apply): by default, what each
    /// node the rule wants gives ([`Rule::rewrite_node`]).
    fn rewrite(&self, eg: &EG, class: Id) -> Vec<Build> {
        let mut out = Vec::new();
        for n in nodes_where(eg, class, |op| self.wants(op)) {
            self.rewrite_node(eg, class, n, &mut out);
        }
        out
    }
}

/// The type of a class.
pub fn ty(eg: &EG, class: Id) -> Option<&TensorType> {
    eg[class].data.ty.as_deref()
}

/// The scalar constant value of a class, if it is one.
pub fn konst(eg: &EG, class: Id) -> Option<f64> {
    eg[class].data.konst
}

/// Adds a tree, checking every new node's type; `None` (and nothing new is unioned) when a node
/// would be ill-typed.
fn add_build(eg: &mut EG, b: &Build) -> Option<Id> {
    match b {
        Build::Class(id) => Some(eg.find(*id)),
        Build::Node(op, declared, args) => {
            let mut ids = Vec::with_capacity(args.len());
            for a in args {
                ids.push(add_build(eg, a)?);
            }
            let tys: Option<Vec<&TensorType>> = ids.iter().map(|c| eg[*c].data.ty.as_deref()).collect();
            infer(op, &tys?, declared.as_ref()).ok()?;
            let enode = ENode::new(&mut eg.analysis, op.clone(), declared.clone(), ids);
            Some(eg.add(enode))
        }
    }
}

struct Adapter(Arc<dyn Rule>);

impl Searcher<ENode, Types> for Adapter {
    fn search_eclass_with_limit(&self, eg: &EG, eclass: Id, limit: usize) -> Option<SearchMatches<'_, ENode>> {
        if limit == 0 || self.0.rewrite(eg, eclass).is_empty() {
            return None;
        }
        Some(SearchMatches { eclass, substs: vec![Subst::default()], ast: None })
    }

    /// Every class with a node the rule wants, visited in the e-graph's own storage order (one
    /// pass over the classes, no look-up by id for the others).
    fn search_with_limit(&self, eg: &EG, limit: usize) -> Vec<SearchMatches<'_, ENode>> {
        let mut out = Vec::new();
        for class in eg.classes() {
            if out.len() >= limit {
                break;
            }
            if class.nodes.iter().any(|n| self.0.wants(n.op())) && !self.0.rewrite(eg, class.id).is_empty() {
                out.push(SearchMatches { eclass: class.id, substs: vec![Subst::default()], ast: None });
            }
        }
        out
    }

    fn vars(&self) -> Vec<Var> {
        Vec::new()
    }
}

impl Applier<ENode, Types> for Adapter {
    fn apply_one(&self, eg: &mut EG, eclass: Id, _: &Subst, _: Option<&PatternAst<ENode>>, _: Symbol) -> Vec<Id> {
        let mut changed = Vec::new();
        for b in self.0.rewrite(eg, eclass) {
            // Never union classes of different types: a rule bug must not corrupt the graph.
            if let Some(new) = add_build(eg, &b)
                && eg[new].data.ty == eg[eclass].data.ty
                && eg.union(eclass, new)
            {
                changed.push(eclass);
            }
        }
        changed
    }
}

/// An egg rewrite from a rule.
pub fn to_rewrite(rule: Arc<dyn Rule>) -> Result<Rewrite<ENode, Types>, String> {
    let name = rule.name();
    Rewrite::new(name, Adapter(rule.clone()), Adapter(rule))
}

/// The nodes of a class whose op satisfies `f`.
pub fn nodes_where<'a>(eg: &'a EG, class: Id, f: impl Fn(&Op) -> bool + 'a) -> impl Iterator<Item = &'a ENode> + 'a {
    eg[class].nodes.iter().filter(move |n| f(n.op()))
}
