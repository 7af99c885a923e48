//! The canonical text form of the IR: what users read, what snapshot tests compare, and what
//! hand-written IR tests are read from.
//!
//! ```text
//! graph sdpa {
//!   %0 = param[name=q] : f32[B, H, S, D]
//!   %1 = param[name=k] : f32[B, H, S, D]
//!   %2 = transpose[perm=[0, 2, 1, 3]] %1 : f32[B, S, H, D]
//!   %3 = dim[value=D] : i32[]
//!   output out = %2
//! }
//! ```
//!
//! Printing numbers values `%0, %1, ...` in [`Graph::topo_order`] order (parameters first), so
//! the text depends only on the graph, never on how a pass happened to insert nodes. Floats are
//! printed shortest-round-trip (`{:?}`), so `print(parse(text)) == text` for printed text and a
//! printed graph reads back to the same graph.
//!
//! The reader accepts that form with free whitespace, line breaks and `#` comments. It checks
//! syntax, references (operands must be defined earlier), op names, attributes and operand
//! counts, and keeps every recorded type as written: run [`super::verify`] to check the types.
//! Hand-written text may name values freely (`%q`, `%scores`); printing renumbers them. Names
//! that are not plain words (`[A-Za-z0-9_.]+`) are printed as quoted strings.

use super::dim::Dim;
use super::graph::{Graph, Module, Value};
use super::op::{Arity, Attr, Op};
use super::types::{DType, TensorType};
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

/// The order in which values are printed and numbered: [`Graph::topo_order`], or insertion order
/// for a graph with a cycle (which has no topological order, but must still print).
pub fn print_order(graph: &Graph) -> Vec<Value> {
    graph.topo_order().unwrap_or_else(|| graph.values().collect())
}

/// The printed number `N` of `%N` for every value, indexed by `Value::index()`; the same numbers
/// the verifier and the DOT export use, so all three can be read side by side.
pub fn value_numbers(graph: &Graph) -> Vec<usize> {
    let mut numbers = vec![0; graph.len()];
    for (n, v) in print_order(graph).into_iter().enumerate() {
        numbers[v.index()] = n;
    }
    numbers
}

/// A name as printed: bare when it is a plain word, else a quoted string (so any name reads back).
struct NameText<'a>(&'a str);

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '.'
}

impl fmt::Display for NameText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.0.is_empty() && self.0.chars().all(is_word_char) { f.write_str(self.0) } else { write!(f, "{:?}", self.0) }
    }
}

/// An op with its attributes as printed: `transpose[perm=[0, 1, 3, 2]]`, `matmul`.
pub(super) struct OpText<'a>(pub(super) &'a Op);

impl fmt::Display for OpText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.name())?;
        let attrs = self.0.attrs();
        if attrs.is_empty() {
            return Ok(());
        }
        f.write_str("[")?;
        for (n, (key, value)) in attrs.iter().enumerate() {
            if n > 0 {
                f.write_str(", ")?;
            }
            match value {
                Attr::Name(name) => write!(f, "{key}={}", NameText(name))?,
                other => write!(f, "{key}={other}")?,
            }
        }
        f.write_str("]")
    }
}

/// An operand count in words: `2`, `at least 1`.
pub(super) struct ArityText(pub(super) Arity);

impl fmt::Display for ArityText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Arity::Exact(n) => write!(f, "{n}"),
            Arity::AtLeast(n) => write!(f, "at least {n}"),
        }
    }
}

/// Whether `n` operands satisfy an arity.
pub(super) fn arity_accepts(arity: Arity, n: usize) -> bool {
    match arity {
        Arity::Exact(k) => n == k,
        Arity::AtLeast(k) => n >= k,
    }
}

impl fmt::Display for Graph {
    /// The canonical text, without a trailing newline.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "graph {} {{", NameText(&self.name))?;
        if self.topo_order().is_none() {
            writeln!(f, "  # this graph has a cycle: values are listed in insertion order")?;
        }
        let numbers = value_numbers(self);
        for v in print_order(self) {
            let node = self.node(v);
            write!(f, "  %{} = {}", numbers[v.index()], OpText(&node.op))?;
            for (n, a) in self.operands(v).iter().enumerate() {
                write!(f, "{}%{}", if n == 0 { " " } else { ", " }, numbers[a.index()])?;
            }
            writeln!(f, " : {}", node.ty)?;
        }
        for (name, v) in self.outputs() {
            match numbers.get(v.index()) {
                Some(n) => writeln!(f, "  output {} = %{n}", NameText(name))?,
                // Only a corrupted graph gets here; print something the reader rejects.
                None => writeln!(f, "  output {} = <missing node {}>", NameText(name), v.index())?,
            }
        }
        f.write_str("}")
    }
}

impl fmt::Display for Module {
    /// The graphs separated by blank lines, ending with a newline (nothing for an empty module).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, g) in self.graphs.iter().enumerate() {
            if n > 0 {
                f.write_str("\n")?;
            }
            writeln!(f, "{g}")?;
        }
        Ok(())
    }
}

/// Why IR text could not be read: where (1-based line and column, in characters) and what.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}, column {col}: {message}")]
pub struct ParseIrError {
    /// 1-based line.
    pub line: usize,
    /// 1-based column, counted in characters.
    pub col: usize,
    /// What is wrong, naming the offending text.
    pub message: String,
}

impl Module {
    /// Reads the text form of a module: zero or more graphs.
    pub fn parse(text: &str) -> Result<Module, ParseIrError> {
        let graphs = Parser { src: text, pos: 0 }.module()?;
        Ok(Module { graphs: graphs.into_iter().map(|(_, g)| g).collect() })
    }
}

impl FromStr for Module {
    type Err = ParseIrError;

    fn from_str(text: &str) -> Result<Module, ParseIrError> {
        Module::parse(text)
    }
}

impl Graph {
    /// Reads the text form of exactly one graph.
    pub fn parse(text: &str) -> Result<Graph, ParseIrError> {
        let mut parser = Parser { src: text, pos: 0 };
        let mut graphs = parser.module()?;
        match graphs.len() {
            1 => Ok(graphs.remove(0).1),
            0 => Err(parser.error(text.len(), "expected a graph, found none")),
            n => Err(parser.error(graphs[1].0, format!("expected exactly one graph, found {n}"))),
        }
    }
}

impl FromStr for Graph {
    type Err = ParseIrError;

    fn from_str(text: &str) -> Result<Graph, ParseIrError> {
        Graph::parse(text)
    }
}

/// How an attribute's value is read. Keyed by op and attribute name so that e.g. a param named
/// `inf` stays a name; must agree with [`Op::attrs`] (the round-trip tests cover every op).
#[derive(Clone, Copy)]
enum AttrKind {
    Name,
    Int,
    Float,
    Dim,
    List,
    Bool,
    /// A key the table does not know: guessed from the text (`from_parts` then judges it).
    Any,
}

fn attr_kind(op: &str, key: &str) -> AttrKind {
    match (op, key) {
        ("const", "value") | (_, "eps" | "rate") | ("flash" | "flash_lse" | "flash_grad", "dropout") => AttrKind::Float,
        ("dim", "value") | (_, "start" | "end") => AttrKind::Dim,
        (_, "name") => AttrKind::Name,
        (_, "axis") => AttrKind::Int,
        (_, "perm" | "axes") => AttrKind::List,
        (_, "keepdim") => AttrKind::Bool,
        ("flash" | "flash_lse" | "flash_grad", "rank") => AttrKind::Int,
        ("flash" | "flash_lse" | "flash_grad", _) => AttrKind::Name,
        _ => AttrKind::Any,
    }
}

fn is_dim_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '*' | '+' | '-' | ' ' | '\t' | '(' | ')' | '/')
}

fn is_number_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '+' | '-')
}

/// A cursor over the text; every method first skips whitespace and comments.
struct Parser<'a> {
    src: &'a str,
    pos: usize,
}

type PResult<T> = Result<T, ParseIrError>;

impl<'a> Parser<'a> {
    fn error(&self, at: usize, message: impl Into<String>) -> ParseIrError {
        let before = &self.src[..at.min(self.src.len())];
        let line = before.matches('\n').count() + 1;
        let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        ParseIrError { line, col, message: message.into() }
    }

    fn rest(&self) -> &'a str {
        &self.src[self.pos..]
    }

    fn skip_trivia(&mut self) {
        loop {
            let rest = self.rest();
            let trimmed = rest.trim_start();
            self.pos += rest.len() - trimmed.len();
            if !trimmed.starts_with('#') {
                return;
            }
            self.pos += trimmed.find('\n').unwrap_or(trimmed.len());
        }
    }

    fn peek(&mut self) -> Option<char> {
        self.skip_trivia();
        self.rest().chars().next()
    }

    fn eat(&mut self, c: char) -> bool {
        let hit = self.peek() == Some(c);
        if hit {
            self.pos += c.len_utf8();
        }
        hit
    }

    /// Describes what is at the cursor, for "expected X, found Y".
    fn found(&self) -> String {
        let rest = self.rest();
        match rest.chars().next() {
            None => "the end of the input".into(),
            Some(c) if is_word_char(c) => format!("`{}`", &rest[..rest.find(|c| !is_word_char(c)).unwrap_or(rest.len())]),
            Some(c) => format!("`{c}`"),
        }
    }

    fn expected(&self, what: &str) -> ParseIrError {
        self.error(self.pos, format!("expected {what}, found {}", self.found()))
    }

    fn require(&mut self, c: char, context: &str) -> PResult<()> {
        if self.eat(c) { Ok(()) } else { Err(self.expected(&format!("`{c}` {context}"))) }
    }

    /// The run of characters satisfying `keep` at the cursor, with its start; trailing blanks
    /// are trimmed off the text.
    fn take_while(&mut self, keep: impl Fn(char) -> bool) -> (usize, &'a str) {
        self.skip_trivia();
        let (start, rest) = (self.pos, self.rest());
        let len = rest.find(|c| !keep(c)).unwrap_or(rest.len());
        self.pos += len;
        (start, rest[..len].trim_end())
    }

    fn word(&mut self, what: &str) -> PResult<(usize, &'a str)> {
        let (at, w) = self.take_while(is_word_char);
        if w.is_empty() { Err(self.expected(what)) } else { Ok((at, w)) }
    }

    /// A bare word or a quoted string.
    fn name(&mut self, what: &str) -> PResult<String> {
        if self.peek() == Some('"') { self.quoted() } else { Ok(self.word(what)?.1.to_string()) }
    }

    /// A string in Rust's `{:?}` syntax (what [`NameText`] prints).
    fn quoted(&mut self) -> PResult<String> {
        let start = self.pos;
        self.pos += 1;
        let mut out = String::new();
        loop {
            let c = match self.rest().chars().next() {
                Some(c) if c != '\n' => c,
                _ => return Err(self.error(start, "unterminated string")),
            };
            let at = self.pos;
            self.pos += c.len_utf8();
            match c {
                '"' => return Ok(out),
                '\\' => out.push(self.escape(at)?),
                c => out.push(c),
            }
        }
    }

    fn escape(&mut self, at: usize) -> PResult<char> {
        let c = self.rest().chars().next().ok_or_else(|| self.error(at, "unterminated string"))?;
        self.pos += c.len_utf8();
        Ok(match c {
            'n' => '\n',
            't' => '\t',
            'r' => '\r',
            '0' => '\0',
            '\\' | '"' | '\'' => c,
            'u' => {
                let rest = self.rest();
                let hex = rest.strip_prefix('{').and_then(|r| r.split_once('}')).map(|(h, _)| h);
                let ch = hex.and_then(|h| u32::from_str_radix(h, 16).ok()).and_then(char::from_u32);
                match (hex, ch) {
                    (Some(h), Some(ch)) => {
                        self.pos += h.len() + 2;
                        ch
                    }
                    _ => return Err(self.error(at, "bad `\\u{...}` escape")),
                }
            }
            other => return Err(self.error(at, format!("unknown escape `\\{other}`"))),
        })
    }

    /// `%N` (or `%name`), returned with the `%`.
    fn value_ref(&mut self) -> PResult<(usize, &'a str)> {
        self.skip_trivia();
        let start = self.pos;
        if !self.rest().starts_with('%') {
            return Err(self.expected("a value such as `%3`"));
        }
        self.pos += 1;
        let rest = self.rest();
        let len = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
        if len == 0 {
            return Err(self.error(start, "expected a value number or name after `%`"));
        }
        self.pos += len;
        Ok((start, &self.src[start..self.pos]))
    }

    fn module(&mut self) -> PResult<Vec<(usize, Graph)>> {
        let mut graphs = Vec::new();
        while self.peek().is_some() {
            let at = self.pos;
            if self.take_while(is_word_char).1 != "graph" {
                self.pos = at;
                return Err(self.expected("`graph`"));
            }
            graphs.push((at, self.graph()?));
        }
        Ok(graphs)
    }

    fn graph(&mut self) -> PResult<Graph> {
        let name = self.name("a graph name")?;
        self.require('{', "after the graph name")?;
        let mut graph = Graph::new(name);
        let mut defs: HashMap<&'a str, Value> = HashMap::new();
        loop {
            match self.peek() {
                Some('}') => {
                    self.pos += 1;
                    return Ok(graph);
                }
                Some('%') => self.node(&mut graph, &mut defs)?,
                None => return Err(self.expected(&format!("`}}` to close graph `{}`", graph.name))),
                Some(_) => {
                    let at = self.pos;
                    if self.take_while(is_word_char).1 != "output" {
                        self.pos = at;
                        return Err(self.expected("`%N = ...`, `output NAME = %N` or `}`"));
                    }
                    let name = self.name("an output name")?;
                    self.require('=', &format!("after output `{name}`"))?;
                    let v = self.operand(&defs)?;
                    graph.add_output(name, v);
                }
            }
        }
    }

    fn operand(&mut self, defs: &HashMap<&'a str, Value>) -> PResult<Value> {
        let (at, id) = self.value_ref()?;
        defs.get(id).copied().ok_or_else(|| self.error(at, format!("`{id}` is not defined (values must be defined before they are used)")))
    }

    /// `%N = op[attrs] operands : type`
    fn node(&mut self, graph: &mut Graph, defs: &mut HashMap<&'a str, Value>) -> PResult<()> {
        let (at, id) = self.value_ref()?;
        if defs.contains_key(id) {
            return Err(self.error(at, format!("`{id}` is defined twice")));
        }
        self.require('=', &format!("after `{id}`"))?;
        let (op_at, op_name) = self.word("an op name")?;
        let mut attrs: Vec<(String, Attr)> = Vec::new();
        let mut key_at = Vec::new();
        if self.eat('[') && !self.eat(']') {
            loop {
                let (at, key) = self.word("an attribute name")?;
                if attrs.iter().any(|(k, _)| k == key) {
                    return Err(self.error(at, format!("attribute `{key}` is given twice")));
                }
                self.require('=', &format!("after attribute `{key}`"))?;
                attrs.push((key.to_string(), self.attr_value(op_name, key)?));
                key_at.push(at);
                if !self.eat(',') {
                    self.require(']', "to close the attributes")?;
                    break;
                }
            }
        }
        let mut args = Vec::new();
        if self.peek() == Some('%') {
            args.push(self.operand(defs)?);
            while self.eat(',') {
                args.push(self.operand(defs)?);
            }
        }
        self.require(':', "before the result type")?;
        let ty = self.tensor_type()?;
        let op = Op::from_parts(op_name, &attrs).map_err(|m| self.error(op_at, m))?;
        let known = op.attrs();
        for ((key, _), at) in attrs.iter().zip(key_at) {
            if !known.iter().any(|(k, _)| k == key) {
                return Err(self.error(at, format!("`{op_name}` has no attribute `{key}`")));
            }
        }
        if !arity_accepts(op.arity(), args.len()) {
            let message = format!("`{op_name}` takes {} operand(s), found {}", ArityText(op.arity()), args.len());
            return Err(self.error(op_at, message));
        }
        defs.insert(id, graph.add(op, ty, &args));
        Ok(())
    }

    /// `f32[B, H*D, S+1]`, `i32[]`
    fn tensor_type(&mut self) -> PResult<TensorType> {
        let (at, name) = self.word("a type such as `f32[B, S]`")?;
        let dtype = DType::from_name(name)
            .ok_or_else(|| self.error(at, format!("unknown element type `{name}` (expected f32, f16, bf16, i32 or bool)")))?;
        self.require('[', &format!("after `{name}`"))?;
        let mut shape = Vec::new();
        if !self.eat(']') {
            loop {
                shape.push(self.dim("a dimension")?);
                if !self.eat(',') {
                    self.require(']', "to close the shape")?;
                    break;
                }
            }
        }
        Ok(TensorType::new(dtype, shape))
    }

    fn dim(&mut self, what: &str) -> PResult<Dim> {
        let (at, text) = self.take_while(is_dim_char);
        if text.is_empty() {
            return Err(self.expected(what));
        }
        Dim::parse(text).ok_or_else(|| self.error(at, format!("`{text}` is not a dimension (expected e.g. `B`, `D*H`, `S+1`)")))
    }

    fn attr_value(&mut self, op: &str, key: &str) -> PResult<Attr> {
        Ok(match attr_kind(op, key) {
            AttrKind::Name => Attr::Name(self.name(&format!("a name for `{key}`"))?),
            AttrKind::Int => Attr::Int(self.int(&format!("a non-negative integer for `{key}`"))?),
            AttrKind::Float => {
                let (at, text) = self.take_while(is_number_char);
                if text.is_empty() {
                    return Err(self.expected(&format!("a number for `{key}`")));
                }
                let v = text.parse::<f64>();
                Attr::Float(v.map_err(|_| {
                    self.error(at, format!("`{key}` must be a number (e.g. `0.125`, `1e-5`, `-inf`, `NaN`), found `{text}`"))
                })?)
            }
            AttrKind::Dim => Attr::Dim(self.dim(&format!("a dimension for `{key}`"))?),
            AttrKind::List => Attr::List(self.list(key)?),
            AttrKind::Bool => {
                let (at, text) = self.word(&format!("`true` or `false` for `{key}`"))?;
                match text {
                    "true" => Attr::Bool(true),
                    "false" => Attr::Bool(false),
                    _ => return Err(self.error(at, format!("`{key}` must be `true` or `false`, found `{text}`"))),
                }
            }
            AttrKind::Any => match self.peek() {
                Some('[') => Attr::List(self.list(key)?),
                Some('"') => Attr::Name(self.quoted()?),
                _ => {
                    let (at, text) = self.take_while(|c| !matches!(c, ',' | ']' | '\n' | '#'));
                    if text.is_empty() {
                        self.pos = at;
                        return Err(self.expected(&format!("a value for `{key}`")));
                    } else if let Ok(b) = text.parse::<bool>() {
                        Attr::Bool(b)
                    } else if let Ok(i) = text.parse::<usize>() {
                        Attr::Int(i)
                    } else if let Ok(x) = text.parse::<f64>() {
                        Attr::Float(x)
                    } else if let Some(d) = Dim::parse(text) {
                        Attr::Dim(d)
                    } else {
                        return Err(self.error(at, format!("cannot read the value of `{key}`: `{text}`")));
                    }
                }
            },
        })
    }

    fn int(&mut self, what: &str) -> PResult<usize> {
        let (at, text) = self.take_while(is_number_char);
        if text.is_empty() {
            return Err(self.expected(what));
        }
        text.parse().map_err(|_| self.error(at, format!("expected {what}, found `{text}`")))
    }

    /// `[0, 2, 1]`
    fn list(&mut self, key: &str) -> PResult<Vec<usize>> {
        self.require('[', &format!("to start the list `{key}`"))?;
        let mut items = Vec::new();
        if !self.eat(']') {
            loop {
                items.push(self.int(&format!("a non-negative integer in `{key}`"))?);
                if !self.eat(',') {
                    self.require(']', &format!("to close the list `{key}`"))?;
                    break;
                }
            }
        }
        Ok(items)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::ir::{BinaryOp, ReduceOp, UnaryOp, infer};
    use proptest::prelude::*;

    pub(in crate::ir) fn ty(dtype: DType, dims: &[&str]) -> TensorType {
        TensorType::new(dtype, dims.iter().map(|d| Dim::parse(d).unwrap()).collect())
    }

    /// Adds a node whose type the shape rules compute (`declared` for ops that need one).
    pub(in crate::ir) fn add(g: &mut Graph, op: Op, args: &[Value], declared: Option<TensorType>) -> Value {
        let tys: Vec<TensorType> = args.iter().map(|a| g.node(*a).ty.clone()).collect();
        let refs: Vec<&TensorType> = tys.iter().collect();
        let t = infer(&op, &refs, declared.as_ref()).unwrap();
        g.add(op, t, args)
    }

    fn param(g: &mut Graph, name: &str, t: TensorType) -> Value {
        add(g, Op::Param(name.into()), &[], Some(t))
    }

    /// Scaled dot-product attention, built by hand.
    pub(in crate::ir) fn sdpa() -> Graph {
        let mut g = Graph::new("sdpa");
        let qkv = ty(DType::F32, &["B", "H", "S", "D"]);
        let q = param(&mut g, "q", qkv.clone());
        let k = param(&mut g, "k", qkv.clone());
        let v = param(&mut g, "v", qkv);
        let kt = add(&mut g, Op::Transpose { perm: vec![0, 1, 3, 2] }, &[k], None);
        let s = add(&mut g, Op::MatMul, &[q, kt], None);
        let d = add(&mut g, Op::DimValue(Dim::sym("D")), &[], None);
        let r = add(&mut g, Op::Unary(UnaryOp::Rsqrt), &[d], None);
        let scaled = add(&mut g, Op::Binary(BinaryOp::Mul), &[s, r], None);
        let p = add(&mut g, Op::Softmax { axis: 3 }, &[scaled], None);
        let out = add(&mut g, Op::MatMul, &[p, v], None);
        g.add_output("out", out);
        g
    }

    const SDPA: &str = "graph sdpa {
  %0 = param[name=q] : f32[B, H, S, D]
  %1 = param[name=k] : f32[B, H, S, D]
  %2 = param[name=v] : f32[B, H, S, D]
  %3 = transpose[perm=[0, 1, 3, 2]] %1 : f32[B, H, D, S]
  %4 = matmul %0, %3 : f32[B, H, S, S]
  %5 = dim[value=D] : i32[]
  %6 = rsqrt %5 : f32[]
  %7 = mul %4, %6 : f32[B, H, S, S]
  %8 = softmax[axis=3] %7 : f32[B, H, S, S]
  %9 = matmul %8, %2 : f32[B, H, S, D]
  output out = %9
}";

    /// Every op (every unary, binary and reduction too), odd floats, dims and names.
    pub(in crate::ir) fn every_op() -> Graph {
        let mut g = Graph::new("every op");
        let x = param(&mut g, "x", ty(DType::F32, &["B", "S", "D"]));
        let gamma = param(&mut g, "gamma", ty(DType::F32, &["D"]));
        let beta = param(&mut g, "beta", ty(DType::F32, &["D"]));
        let idx = param(&mut g, "idx", ty(DType::I32, &["S"]));
        let scalar = TensorType::scalar(DType::F32);
        let mut outs = Vec::new();
        for c in [f64::INFINITY, f64::NEG_INFINITY, f64::NAN, 1e-5, -0.125, 0.1, 1e300, -0.0] {
            outs.push(add(&mut g, Op::Const(c), &[], Some(scalar.clone())));
        }
        outs.push(add(&mut g, Op::Const(2.0), &[], Some(TensorType::scalar(DType::F16))));
        for d in ["D*H", "S+1", "2*S-1", "7"] {
            outs.push(add(&mut g, Op::DimValue(Dim::parse(d).unwrap()), &[], None));
        }
        outs.push(add(&mut g, Op::Iota { axis: 1 }, &[], Some(ty(DType::I32, &["1", "S"]))));
        let mask = add(&mut g, Op::Binary(BinaryOp::Gt), &[x, gamma], None);
        let unary =
            ["neg", "not", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "gelu", "silu", "elu", "abs", "floor", "sin", "cos"];
        for u in unary.map(|n| UnaryOp::from_name(n).unwrap()) {
            let arg = if u == UnaryOp::Not { mask } else { x };
            outs.push(add(&mut g, Op::Unary(u), &[arg], None));
        }
        let binary = ["add", "sub", "mul", "div", "rem", "pow", "atan2", "min", "max", "lt", "le", "gt", "ge", "eq", "ne", "and", "or"];
        for b in binary.map(|n| BinaryOp::from_name(n).unwrap()) {
            let arg = if b.is_logical() { mask } else { x };
            outs.push(add(&mut g, Op::Binary(b), &[arg, arg], None));
        }
        outs.push(add(&mut g, Op::Select, &[mask, x, outs[0]], None));
        outs.push(add(&mut g, Op::Cast, &[x], Some(ty(DType::BF16, &["B", "S", "D"]))));
        let xt = add(&mut g, Op::Transpose { perm: vec![0, 2, 1] }, &[x], None);
        outs.push(add(&mut g, Op::MatMul, &[x, xt], None));
        outs.push(add(&mut g, Op::Reshape, &[x], Some(ty(DType::F32, &["B", "S*D"]))));
        outs.push(add(&mut g, Op::Slice { axis: 1, start: Dim::constant(1), end: Dim::sym("S") }, &[x], None));
        outs.push(add(&mut g, Op::Slice { axis: 2, start: Dim::constant(0), end: Dim::parse("D-1").unwrap() }, &[x], None));
        outs.push(add(&mut g, Op::Concat { axis: 1 }, &[x, x, x], None));
        outs.push(add(&mut g, Op::Gather, &[x, idx, idx, idx], None));
        for (op, keepdim) in [(ReduceOp::Sum, true), (ReduceOp::Max, false), (ReduceOp::Min, true), (ReduceOp::Mean, false)] {
            outs.push(add(&mut g, Op::Reduce { op, axes: vec![1, 2], keepdim }, &[x], None));
        }
        outs.push(add(&mut g, Op::Softmax { axis: 2 }, &[x], None));
        outs.push(add(&mut g, Op::LayerNorm { eps: 1e-5 }, &[x, gamma, beta], None));
        outs.push(add(&mut g, Op::RmsNorm { eps: 1e-6 }, &[x, gamma], None));
        for (n, v) in outs.iter().enumerate() {
            g.add_output(if n == 3 { "needs \"quotes\"".to_string() } else { format!("o{n}") }, *v);
        }
        g
    }

    /// Structure as text: op (Debug, so NaN compares equal), type, operand numbers, outputs.
    fn structure(g: &Graph) -> Vec<String> {
        let nums = value_numbers(g);
        let mut lines: Vec<String> = print_order(g)
            .into_iter()
            .map(|v| {
                let args: Vec<usize> = g.operands(v).iter().map(|a| nums[a.index()]).collect();
                format!("{:?} {} {args:?}", g.node(v).op, g.node(v).ty)
            })
            .collect();
        lines.extend(g.outputs().iter().map(|(n, v)| format!("out {n} {}", nums[v.index()])));
        lines.extend(g.params().iter().map(|p| format!("param {}", nums[p.index()])));
        lines
    }

    #[test]
    fn prints_canonical_text() {
        assert_eq!(sdpa().to_string(), SDPA);
        assert_eq!(Graph::parse(SDPA).unwrap().to_string(), SDPA);
    }

    #[test]
    fn every_op_round_trips() {
        let g = every_op();
        let text = g.to_string();
        for name in ["iota[axis=1]", "const[value=NaN]", "const[value=-inf]", "const[value=1e-5]", "dim[value=D*H]", "dim[value=2*S-1]"] {
            assert!(text.contains(name), "{name} missing from\n{text}");
        }
        assert!(text.contains("slice[axis=2, start=0, end=D-1] %0 : f32[B, S, D-1]"), "{text}");
        assert!(text.contains("reduce_max[axes=[1, 2], keepdim=false] %0 : f32[B]"), "{text}");
        assert!(text.contains(r#"output "needs \"quotes\"" = "#), "{text}");
        assert!(text.starts_with("graph \"every op\" {\n"), "{text}");
        let back = Graph::parse(&text).unwrap();
        assert_eq!(back.to_string(), text);
        assert_eq!(structure(&back), structure(&g));
    }

    #[test]
    fn additive_flash_round_trips_and_checks_its_weight() {
        let text = "graph g {
  %0 = param[name=q] : f32[B, M, A]
  %1 = param[name=k] : f32[B, N, A]
  %2 = param[name=v] : f32[B, N, E]
  %3 = param[name=w] : f32[A]
  %4 = flash[rank=3, weights=softmax, score=\"s * 0.5\", pair=\"additive(x0)\"] %0, %1, %2, %3 : f32[B, M, E]
  output out = %4
}";
        let g = Graph::parse(text).unwrap();
        assert_eq!(g.to_string(), text);
        assert!(crate::ir::verify(&g).is_ok());
        let problem = |t: &str| match Graph::parse(t) {
            Err(e) => e.message,
            Ok(g) => crate::ir::verify(&g).err().map(|e| format!("{e:?}")).unwrap_or_default(),
        };
        let with = |w: &str, pair: &str| text.replace("f32[A]", w).replace("additive(x0)", pair);
        for (w, pair, message) in [
            ("f32[E]", "additive(x0)", "additive weight x0 must be a float [.., A]"),
            ("i32[A]", "additive(x0)", "additive weight x0 must be a float"),
            ("f32[A]", "additive(x1)", "additive weight x1 is not an operand"),
            ("f32[A]", "additive(y)", "`pair` must be additive(x<N>)"),
        ] {
            let e = problem(&with(w, pair));
            assert!(e.contains(message), "{w} {pair}: {e}");
        }
        // Its derivative is not a flash_grad: the unfused graph is differentiated instead.
        let grad = "graph g {
  %0 = param[name=q] : f32[M, A]
  %1 = param[name=k] : f32[N, A]
  %2 = param[name=v] : f32[N, E]
  %3 = param[name=d] : f32[M, E]
  %4 = param[name=w] : f32[A]
  %5 = flash_grad[rank=2, weights=sigmoid, score=s, pair=\"additive(x0)\", wrt=q] %0, %1, %2, %3, %4 : f32[M, A]
  output out = %5
}";
        assert!(problem(grad).contains("dot-product scores only"), "{}", problem(grad));
    }

    #[test]
    fn numbering_follows_topological_order() {
        let mut g = Graph::new("g");
        let c = add(&mut g, Op::Const(1.5), &[], Some(TensorType::scalar(DType::F32)));
        let x = param(&mut g, "x", ty(DType::F32, &["N"]));
        let y = add(&mut g, Op::Binary(BinaryOp::Add), &[x, c], None);
        g.add_output("y", y);
        let expected =
            "graph g {\n  %0 = param[name=x] : f32[N]\n  %1 = const[value=1.5] : f32[]\n  %2 = add %0, %1 : f32[N]\n  output y = %2\n}";
        assert_eq!(g.to_string(), expected);
    }

    #[test]
    fn tolerates_whitespace_comments_and_names() {
        let text = "# leading comment\n\n  graph   sdpa{\n%q=param [ name = q ]:f32[ B,H , S,D ]  # trailing\n %k = param[name=k] : f32[B, H, S, D]\n  \
                    %v = param[name=v] : f32[B, H, S, D]\n %kt = transpose[perm=[ 0,1, 3,2 ]] %k : f32[B, H, D, S]\n \
                    %s = matmul %q ,\n %kt : f32[B, H, S, S]\n %d = dim[value=D] : i32[]\n %r = rsqrt %d : f32[]\n \
                    %x = mul %s, %r : f32[B, H, S, S]\n %p = softmax[axis=3] %x : f32[B, H, S, S]\n \
                    %o = matmul %p, %v : f32[B, H, S, D]\n output   out=%o\n}\n";
        assert_eq!(Graph::parse(text).unwrap().to_string(), SDPA);
    }

    #[test]
    fn module_round_trips() {
        let m = Module { graphs: vec![sdpa(), every_op()] };
        let text = m.to_string();
        assert!(text.contains("}\n\ngraph \"every op\" {"));
        assert!(text.ends_with("}\n"));
        let back: Module = text.parse().unwrap();
        assert_eq!(back.graphs.len(), 2);
        assert_eq!(back.to_string(), text);
        assert_eq!(Module::parse("  # nothing\n").unwrap().graphs.len(), 0);
        assert_eq!(Module::default().to_string(), "");
    }

    fn err(text: &str) -> ParseIrError {
        match Module::parse(text) {
            Ok(m) => panic!("expected an error, read\n{m}"),
            Err(e) => e,
        }
    }

    #[test]
    fn reports_errors_precisely() {
        let head = "graph g {\n  %0 = param[name=x] : f32[N]\n";
        let cases: [(&str, usize, usize, &str); 14] = [
            ("  %1 = neg %7 : f32[N]\n}", 3, 12, "`%7` is not defined"),
            ("  %1 = frobnicate %0 : f32[N]\n}", 3, 8, "unknown op `frobnicate`"),
            ("  %1 = neg %0 : f33[N]\n}", 3, 17, "unknown element type `f33`"),
            ("  %1 = neg %0 : f32[N*]\n}", 3, 21, "`N*` is not a dimension"),
            ("  %1 = neg %0 : f32[N\n}", 4, 1, "expected `]` to close the shape, found `}`"),
            ("  %1 = slice[axis=0, start=0] %0 : f32[N]\n}", 3, 8, "`slice` needs attribute `end`"),
            ("  %1 = softmax[axis=0, flavour=2] %0 : f32[N]\n}", 3, 24, "`softmax` has no attribute `flavour`"),
            ("  %1 = softmax[axis=x] %0 : f32[N]\n}", 3, 21, "a non-negative integer for `axis`, found `x`"),
            ("  %1 = const[value=fast] : f32[]\n}", 3, 20, "`value` must be a number"),
            ("  %1 = matmul %0 : f32[N]\n}", 3, 8, "`matmul` takes 2 operand(s), found 1"),
            ("  %0 = neg %0 : f32[N]\n}", 3, 3, "`%0` is defined twice"),
            ("  %1 = neg %0 f32[N]\n}", 3, 15, "expected `:` before the result type, found `f32`"),
            ("  output y = %3\n}", 3, 14, "`%3` is not defined"),
            ("  %1 = neg %0 : f32[N]\n", 4, 1, "expected `}` to close graph `g`, found the end of the input"),
        ];
        for (body, line, col, message) in cases {
            let e = err(&format!("{head}{body}"));
            assert!(e.message.contains(message), "{body}: {e}");
            assert_eq!((e.line, e.col), (line, col), "{body}: {e}");
        }
        assert_eq!(err("grap g {}").message, "expected `graph`, found `grap`");
        assert!(err("graph \"g {}").message.contains("unterminated string"));
        let two = Graph::parse("graph a {}\ngraph b {}").unwrap_err();
        assert_eq!((two.line, two.col, two.message.as_str()), (2, 1, "expected exactly one graph, found 2"));
        assert!(Graph::parse("").is_err());
        assert_eq!(
            err("graph g {\n  %0 = const[value=1] %x : f32[]\n}").to_string(),
            "line 2, column 23: `%x` is not defined (values must be defined before they are used)"
        );
    }

    proptest! {
        #[test]
        fn floats_and_dims_round_trip(v in proptest::num::f64::ANY, a in -3i64..4, b in -5i64..6, sym in "[A-Z][a-z0-9_]{0,3}") {
            let mut g = Graph::new("p");
            let c = g.add(Op::Const(v), TensorType::scalar(DType::F32), &[]);
            let d = Dim::sym(&sym).scale(a).add(&Dim::sym("N").mul(&Dim::sym(&sym))).add(&Dim::constant(b));
            let x = g.add(Op::Param(sym.clone()), TensorType::new(DType::F32, vec![d.clone()]), &[]);
            g.add(Op::DimValue(d.clone()), TensorType::scalar(DType::I32), &[]);
            g.add(Op::Slice { axis: 0, start: Dim::constant(b), end: d.clone() }, TensorType::new(DType::F32, vec![d]), &[x]);
            g.add_output(sym, c);
            let text = g.to_string();
            let back = Graph::parse(&text).unwrap();
            prop_assert_eq!(back.to_string(), text.clone());
            prop_assert_eq!(structure(&back), structure(&g));
            match back.node(back.values().nth(1).unwrap()).op {
                Op::Const(w) => prop_assert!(w.to_bits() == v.to_bits() || (w.is_nan() && v.is_nan()), "{} vs {}", w, v),
                ref other => prop_assert!(false, "{:?}", other),
            }
        }
    }
}
