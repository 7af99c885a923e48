//! The e-graph language: one e-node per IR op, and an analysis carrying each class's type.
//!
//! An [`ENode`] is an [`OpKey`] plus its operand classes. The key is the [`Op`] and, for ops
//! whose result the operands do not determine (param, const, reshape, cast, iota, flash), the
//! result type. Identity is the key's canonical text plus the children, so two nodes are equal
//! exactly when they print alike. Keys are interned per e-graph ([`Types::key`]): an e-node is
//! a shared pointer and its operands, small enough that a long program's e-graph (egg keeps
//! three copies of every node) stays in cache.

use crate::ir::{Graph, Op, TensorType, Value, infer};
use attn_dsl::Span;
use egg::{Analysis, DidMerge, EGraph, Id, Language};
use smallvec::SmallVec;
use std::borrow::Borrow;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// What identifies an e-node apart from its operands: its op and, for ops that carry one, its
/// declared result type. One shared copy per e-graph of each ([`Types::key`]).
#[derive(Debug)]
pub struct OpKey {
    /// The operation.
    pub op: Op,
    /// The declared result type, for ops that carry one.
    pub ty: Option<Arc<TensorType>>,
    /// The canonical text: name, attributes, declared type. Equal texts are equal keys.
    text: Box<str>,
    /// Its number in the e-graph's [`Types`] (the e-node's discriminant).
    id: usize,
}

/// One e-node.
#[derive(Clone, Debug)]
pub struct ENode {
    key: Arc<OpKey>,
    /// Inline up to three operands: most ops have at most three.
    children: SmallVec<[Id; 3]>,
}

impl ENode {
    /// A node; `ty` is kept only for ops whose result type the operands do not determine. Its
    /// key is shared through `types` (see [`Types::key`]).
    pub fn new(types: &mut Types, op: Op, ty: Option<TensorType>, children: Vec<Id>) -> ENode {
        ENode { key: types.key(op, ty), children: children.into() }
    }

    /// The operation.
    pub fn op(&self) -> &Op {
        &self.key.op
    }

    /// The declared result type, for ops that carry one.
    pub fn ty(&self) -> Option<&TensorType> {
        self.key.ty.as_deref()
    }

    /// The operand classes.
    pub fn args(&self) -> &[Id] {
        &self.children
    }

    /// Whether the two keys are equal: interned keys are equal when they are the same copy.
    fn same_key(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.key, &other.key) || self.key.text == other.key.text
    }
}

/// Ops whose result type is part of their identity (a flash op's, because its result may be
/// wider than its inputs: f16 q, k, v with an f32 bias give f32 attention, as the unfused
/// graph does).
fn carries_type(op: &Op) -> bool {
    matches!(op, Op::Param(_) | Op::Const(_) | Op::Reshape | Op::Cast | Op::Iota { .. } | Op::Flash(_))
}

/// Whether an op has no attributes: its text is its name.
fn plain(op: &Op) -> bool {
    matches!(op, Op::Unary(_) | Op::Binary(_) | Op::Select | Op::Cast | Op::MatMul | Op::Reshape | Op::Gather | Op::Paged)
}

/// An op's canonical text: its name, its attributes and its declared type.
fn key_text(op: &Op, ty: Option<&TensorType>) -> String {
    use std::fmt::Write as _;
    let mut key = op.name().to_string();
    let attrs = op.attrs();
    if !attrs.is_empty() {
        let parts: Vec<String> = attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = write!(key, "[{}]", parts.join(", "));
    }
    if let Some(t) = ty {
        let _ = write!(key, " : {t}");
    }
    key
}

impl PartialEq for ENode {
    fn eq(&self, other: &Self) -> bool {
        self.same_key(other) && self.children == other.children
    }
}

impl Eq for ENode {}

impl Hash for ENode {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.key.text.hash(state);
        self.children.hash(state);
    }
}

impl PartialOrd for ENode {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ENode {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        let keys = if self.same_key(other) { std::cmp::Ordering::Equal } else { self.key.text.cmp(&other.key.text) };
        keys.then_with(|| self.children.cmp(&other.children))
    }
}

impl fmt::Display for ENode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.key.text)
    }
}

impl Language for ENode {
    /// The key's number in its e-graph.
    type Discriminant = usize;

    fn discriminant(&self) -> Self::Discriminant {
        self.key.id
    }

    fn matches(&self, other: &Self) -> bool {
        self.same_key(other) && self.children.len() == other.children.len()
    }

    fn children(&self) -> &[Id] {
        &self.children
    }

    fn children_mut(&mut self) -> &mut [Id] {
        &mut self.children
    }
}

/// What is known about a class: its type, and its value when it is a scalar constant.
#[derive(Clone, Debug, PartialEq)]
pub struct Facts {
    /// Result type (`None` only if a rule built an ill-typed node, which rules avoid), shared
    /// between the classes that have it ([`Types`] interns them).
    pub ty: Option<Arc<TensorType>>,
    /// The constant value of a scalar constant class.
    pub konst: Option<f64>,
}

/// The e-graph analysis: types via [`infer`], and scalar constants. Types are interned: a
/// long program has a few distinct types across thousands of classes, and one shared copy
/// each keeps the e-graph small enough to stay in cache (each type holds several heap-allocated
/// symbolic dims). So are e-node keys.
#[derive(Clone, Debug, Default)]
pub struct Types {
    interned: HashMap<TensorType, Arc<TensorType>>,
    /// The inferred type of an e-node by its key and its children's interned types (by
    /// address; the interned copies live as long as the e-graph): a long program repeats a few
    /// (op, operand types) pairs, and each is inferred once.
    inferred: HashMap<MemoKey, Option<Arc<TensorType>>>,
    /// One shared copy of each e-node key, found by its text.
    keys: HashSet<ByText>,
    /// The key of each scalar constant by its value's bits and its type (by address): a long
    /// program repeats a few constants, and printing each one's text to find its key cost
    /// more than the rest of loading it.
    consts: HashMap<(u64, usize), Arc<OpKey>>,
}

/// An interned key, hashed and compared by its text (so a key is found from its text).
#[derive(Clone, Debug)]
struct ByText(Arc<OpKey>);

impl Borrow<str> for ByText {
    fn borrow(&self) -> &str {
        &self.0.text
    }
}

impl PartialEq for ByText {
    fn eq(&self, other: &Self) -> bool {
        self.0.text == other.0.text
    }
}

impl Eq for ByText {}

impl Hash for ByText {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.text.hash(state);
    }
}

/// An e-node's key number and its children's interned types, by address.
type MemoKey = (usize, [usize; MEMO_ARITY]);

/// E-nodes with at most this many children have their inferred types memoised.
const MEMO_ARITY: usize = 4;

impl Types {
    /// The shared key of `op` with declared type `ty` (kept only for ops that carry one).
    pub fn key(&mut self, op: Op, ty: Option<TensorType>) -> Arc<OpKey> {
        if !carries_type(&op) {
            // An op without attributes is its name: no text to build.
            if plain(&op)
                && let Some(shared) = self.keys.get(op.name())
            {
                return shared.0.clone();
            }
            return self.key_by_text(op, None);
        }
        let ty = ty.map(|t| self.intern(t));
        let Op::Const(v) = op else { return self.key_by_text(op, ty) };
        let bits = (v.to_bits(), ty.as_ref().map_or(0, |t| Arc::as_ptr(t) as usize));
        if let Some(shared) = self.consts.get(&bits) {
            return shared.clone();
        }
        let key = self.key_by_text(op, ty);
        self.consts.insert(bits, key.clone());
        key
    }

    /// The shared key of `op` with declared type `ty`, found by its text.
    fn key_by_text(&mut self, op: Op, ty: Option<Arc<TensorType>>) -> Arc<OpKey> {
        let text = key_text(&op, ty.as_deref());
        if let Some(shared) = self.keys.get(text.as_str()) {
            return shared.0.clone();
        }
        let id = self.keys.len();
        let key = Arc::new(OpKey { op, ty, text: text.into_boxed_str(), id });
        self.keys.insert(ByText(key.clone()));
        key
    }

    /// The shared copy of `ty`.
    fn intern(&mut self, ty: TensorType) -> Arc<TensorType> {
        if let Some(shared) = self.interned.get(&ty) {
            return shared.clone();
        }
        let shared = Arc::new(ty.clone());
        self.interned.insert(ty, shared.clone());
        shared
    }
}

/// The e-graph type used by the optimizer.
pub type EG = EGraph<ENode, Types>;

impl Analysis<ENode> for Types {
    type Data = Facts;

    fn make(egraph: &mut EG, enode: &ENode, _id: Id) -> Facts {
        let tys: Option<Vec<&Arc<TensorType>>> = enode.children.iter().map(|c| egraph[*c].data.ty.as_ref()).collect();
        let memo_key = tys.as_ref().filter(|t| t.len() <= MEMO_ARITY).map(|t| {
            let mut addrs = [0usize; MEMO_ARITY];
            for (a, ty) in addrs.iter_mut().zip(t) {
                *a = Arc::as_ptr(ty) as usize;
            }
            (enode.key.id, addrs)
        });
        let known = memo_key.as_ref().and_then(|k| egraph.analysis.inferred.get(k)).cloned();
        let ty = match known {
            Some(ty) => ty,
            None => {
                let ty = tys.and_then(|tys| {
                    let tys: Vec<&TensorType> = tys.into_iter().map(|t| &**t).collect();
                    infer(enode.op(), &tys, enode.ty()).ok()
                });
                let ty = ty.map(|t| egraph.analysis.intern(t));
                if let Some(k) = memo_key {
                    egraph.analysis.inferred.insert(k, ty.clone());
                }
                ty
            }
        };
        let konst = match enode.op() {
            Op::Const(v) => Some(*v),
            _ => None,
        };
        Facts { ty, konst }
    }

    fn merge(&mut self, a: &mut Facts, b: Facts) -> DidMerge {
        let mut changed_a = false;
        if a.ty.is_none() && b.ty.is_some() {
            a.ty = b.ty.clone();
            changed_a = true;
        }
        if a.konst.is_none() && b.konst.is_some() {
            a.konst = b.konst;
            changed_a = true;
        }
        DidMerge(changed_a, a.ty != b.ty || a.konst != b.konst)
    }
}

/// An e-class as the walks after saturation read it: its nodes and its type.
#[derive(Clone, Copy, Debug, Default)]
pub struct ClassView<'a> {
    /// The class's e-nodes (empty for an id that is no class).
    pub nodes: &'a [ENode],
    /// Its type (see [`Facts::ty`]).
    pub ty: Option<&'a TensorType>,
}

/// The e-graph's classes in a table indexed by class id. egg keeps its classes in a hash map,
/// and the walks over a saturated e-graph (costs, extraction, unloading, the report) look
/// classes up by id again and again: on a long program the map is larger than the cache and
/// nearly every probe missed it. One pass over the map, in its storage order, fills the table.
pub struct Classes<'a> {
    eg: &'a EG,
    by_id: Vec<ClassView<'a>>,
}

impl<'a> Classes<'a> {
    /// The table of `eg`'s classes.
    pub fn new(eg: &'a EG) -> Classes<'a> {
        let mut by_id = Vec::new();
        for c in eg.classes() {
            let k = usize::from(c.id);
            if by_id.len() <= k {
                by_id.resize(k + 1, ClassView::default());
            }
            by_id[k] = ClassView { nodes: &c.nodes, ty: c.data.ty.as_deref() };
        }
        Classes { eg, by_id }
    }

    /// The class of `id` (any id of it).
    pub fn get(&self, id: Id) -> ClassView<'a> {
        self.by_id.get(usize::from(self.eg.find(id))).copied().unwrap_or_default()
    }

    /// The canonical id of `id`'s class.
    pub fn find(&self, id: Id) -> Id {
        self.eg.find(id)
    }

    /// The canonical class ids, in increasing order.
    pub fn ids(&self) -> impl Iterator<Item = Id> + '_ {
        self.by_id.iter().enumerate().filter(|(_, c)| !c.nodes.is_empty()).map(|(k, _)| Id::from(k))
    }

    /// One more than the largest class id: the length of a table indexed by class.
    pub fn slots(&self) -> usize {
        self.by_id.len()
    }
}

/// A graph loaded into an e-graph.
pub struct Loaded {
    /// The e-graph.
    pub egraph: EG,
    /// Class of every graph value (indexed by `Value::index()`).
    pub class_of: Vec<Id>,
}

/// Adds every node of `graph` to a fresh e-graph (not yet rebuilt: see [`EGraph::rebuild`]).
pub fn load(graph: &Graph) -> Loaded {
    let mut egraph = EG::default();
    let mut class_of = vec![Id::from(0usize); graph.len()];
    for v in graph.topo_order().unwrap_or_default() {
        let node = graph.node(v);
        let children = graph.operands(v).iter().map(|a| class_of[a.index()]).collect();
        // Only ops whose type is part of their identity keep it (cloning a type is several
        // allocations per node).
        let declared = carries_type(&node.op).then(|| node.ty.clone());
        let enode = ENode::new(&mut egraph.analysis, node.op.clone(), declared, children);
        class_of[v.index()] = egraph.add(enode);
    }
    // No rebuild: nothing was merged, so every class holds its one node, canonical, and the
    // runner rebuilds before its first search (each rebuild is a pass over the whole e-graph).
    Loaded { egraph, class_of }
}

/// Rebuilds a graph from an e-graph: `choose` picks the e-node to use for a class. Parameters
/// come first in their original order; `outputs` name the classes to return.
/// `spans` gives the source span of each canonical class that has one ([`class_spans`]).
///
/// The classes to build are listed first, then the graph is made at its final size: a long
/// program's result graph is megabytes, and growing it by doubling touched twice that in
/// fresh memory.
pub fn unload<'a>(
    name: &str,
    classes: &Classes<'a>,
    params: &[Id],
    outputs: &[(String, Id)],
    choose: &dyn Fn(Id) -> Option<&'a ENode>,
    spans: &[Option<Span>],
) -> Result<Graph, String> {
    let mut walk = Walk { state: vec![Visit::New; classes.slots()], order: Vec::new() };
    for root in params.iter().chain(outputs.iter().map(|(_, id)| id)) {
        walk.visit(classes, classes.find(*root), choose)?;
    }
    let edges = walk.order.iter().map(|(_, node)| node.args().len()).sum();
    let mut g = Graph::with_capacity(name, walk.order.len(), edges);
    let mut value: Vec<Option<Value>> = vec![None; walk.state.len()];
    let mut args = Vec::new();
    for (class, node) in walk.order {
        args.clear();
        for c in node.args() {
            let v = value.get(usize::from(classes.find(*c))).copied().flatten();
            args.push(v.ok_or_else(|| format!("class {c} was not built"))?);
        }
        let ty = classes.get(class).ty.cloned().ok_or_else(|| format!("class {class} has no type"))?;
        let v = g.add(node.op().clone(), ty, &args);
        g.set_span(v, spans.get(usize::from(class)).copied().flatten());
        value[usize::from(class)] = Some(v);
    }
    for (out, id) in outputs {
        let v = value.get(usize::from(classes.find(*id))).copied().flatten();
        g.add_output(out.clone(), v.ok_or_else(|| format!("class {id} was not built"))?);
    }
    Ok(g)
}

/// The source span of every class of the loaded graph that has one (the first node's, in
/// `order`, the graph's topological order, of each class), indexed by canonical class id.
pub fn class_spans(graph: &Graph, order: &[Value], classes: &Classes<'_>, class_of: &[Id]) -> Vec<Option<Span>> {
    let mut out = vec![None; classes.slots()];
    for &v in order {
        if let Some(span) = graph.node(v).span
            && let Some(slot) = out.get_mut(usize::from(classes.find(class_of[v.index()])))
            && slot.is_none()
        {
            *slot = Some(span);
        }
    }
    out
}

/// Where a class stands in [`Walk`].
#[derive(Clone, Copy, PartialEq)]
enum Visit {
    New,
    /// Its operands are being listed.
    Open,
    Listed,
}

/// The classes to build, each after its operands, with their chosen nodes.
struct Walk<'a> {
    /// Indexed by class id.
    state: Vec<Visit>,
    order: Vec<(Id, &'a ENode)>,
}

impl<'a> Walk<'a> {
    /// Lists `root`'s class and everything it needs, operands first (in operand order, as a
    /// recursive walk would), with an explicit stack: extraction chains are as long as the
    /// program.
    fn visit(&mut self, classes: &Classes<'_>, root: Id, choose: &dyn Fn(Id) -> Option<&'a ENode>) -> Result<(), String> {
        // (class, its chosen node once its operands are queued)
        let mut stack: Vec<(Id, Option<&'a ENode>)> = vec![(root, None)];
        while let Some((class, chosen)) = stack.pop() {
            let state = self.state.get_mut(usize::from(class)).ok_or_else(|| format!("class {class} is not in the e-graph"))?;
            match (chosen, *state) {
                (_, Visit::Listed) => {}
                // A class met again while its operands are still being listed is its own operand.
                (None, Visit::Open) => return Err(format!("class {class} depends on itself")),
                (None, Visit::New) => {
                    *state = Visit::Open;
                    let node = choose(class).ok_or_else(|| format!("class {class} has no node"))?;
                    stack.push((class, Some(node)));
                    let first = stack.len();
                    for c in node.args() {
                        let c = classes.find(*c);
                        if self.state.get(usize::from(c)) != Some(&Visit::Listed) {
                            stack.push((c, None));
                        }
                    }
                    stack[first..].reverse();
                }
                (Some(node), _) => {
                    *state = Visit::Listed;
                    self.order.push((class, node));
                }
            }
        }
        Ok(())
    }
}
