//! Lowering: type-checks a parsed `.attn` file and builds one IR [`Graph`] per function.
//!
//! Every function is an entry point; calls between functions are inlined, binding the callee's
//! symbolic dims from the argument shapes. All shape and dtype rules come from [`infer`]; this
//! module only turns their complaints into diagnostics that point at the source, with a label on
//! each operand saying what its type is.
//!
//! Split by construct: this file (driver, scopes, functions and calls), `expr` (expressions,
//! operators, indexing) and `builtins` (built-in functions). [`lint`] finds the warnings.

mod builtins;
mod construct;
mod expr;
pub mod lint;

use crate::ir::{DType, Dim, Graph, Module, Op, TensorType, Value, infer};
use attn_dsl::ast::{self, ExprKind, FnDef, Item, Ret, Stmt, TypeExpr};
use attn_dsl::{Diagnostic, Span};
use std::collections::{BTreeMap, HashMap};

/// Diagnostic codes of the type checker (see `docs/diagnostics.md`).
pub mod codes {
    /// A name that is not defined.
    pub const UNKNOWN_NAME: &str = "E0101";
    /// Shapes or dtypes that do not fit the operation.
    pub const TYPE_MISMATCH: &str = "E0102";
    /// Wrong number or kind of arguments.
    pub const BAD_ARGS: &str = "E0103";
    /// A call to a function that does not exist.
    pub const UNKNOWN_FUNCTION: &str = "E0104";
    /// An axis that does not exist or is ambiguous.
    pub const BAD_AXIS: &str = "E0105";
    /// Something used as a dimension that is not one.
    pub const NOT_A_DIM: &str = "E0106";
    /// Returned values do not match the declared results.
    pub const BAD_RETURN: &str = "E0107";
    /// A name defined twice.
    pub const DUPLICATE: &str = "E0108";
    /// A function that calls itself.
    pub const RECURSION: &str = "E0109";
    /// An unknown element type.
    pub const UNKNOWN_DTYPE: &str = "E0110";
    /// Destructuring into the wrong number of names.
    pub const BAD_PATTERN: &str = "E0111";
    /// A function without `return`.
    pub const MISSING_RETURN: &str = "E0112";
    /// A dimension bound to two different sizes.
    pub const DIM_CONFLICT: &str = "E0113";
    /// A tuple where a tensor is needed, or the reverse.
    pub const NOT_A_TENSOR: &str = "E0114";
    /// A statement after `return`.
    pub const UNREACHABLE: &str = "E0115";
    /// Dimension arithmetic that does not fit in a 64-bit integer.
    pub const DIM_OVERFLOW: &str = "E0116";
    /// An integer literal outside the i32 range.
    pub const INT_RANGE: &str = "E0117";
    /// A function whose graph has more than [`super::MAX_GRAPH_NODES`] operations.
    pub const TOO_LARGE: &str = "E0118";
}

/// The most operations one function's graph may have (calls inlined). Each costs about 1 KB
/// through the optimizer and the CPU renderer, so this bounds a compile to a few hundred MB and
/// refuses a program that would exhaust memory, with a diagnostic instead of an abort.
pub const MAX_GRAPH_NODES: usize = 250_000;

/// Lowers a parsed file. Either every function lowers cleanly, or all diagnostics are returned.
pub fn lower(file: &ast::File) -> Result<Module, Vec<Diagnostic>> {
    let mut diags = Vec::new();
    let globals = Globals::collect(file, &mut diags);
    let mut module = Module::default();
    for item in &file.items {
        if let Item::Fn(def) = item {
            let mut cx =
                Cx { g: Graph::new(def.name.name.clone()), globals: &globals, diags: &mut diags, stack: Vec::new(), too_large: false };
            if cx.lower_entry(def).is_ok() {
                module.graphs.push(cx.g.compact());
            }
        }
    }
    if module.graphs.is_empty() && diags.is_empty() {
        diags.push(Diagnostic::error(codes::MISSING_RETURN, "the file defines no function", Span::default(), "expected at least one `fn`"));
    }
    if diags.is_empty() { Ok(module) } else { Err(diags) }
}

/// File-level definitions.
pub(crate) struct Globals<'a> {
    fns: HashMap<&'a str, &'a FnDef>,
    /// `dim H = 8`
    fixed_dims: HashMap<String, i64>,
    /// `const W = 256`: value and whether it was written as an integer.
    consts: HashMap<String, (f64, bool)>,
}

impl<'a> Globals<'a> {
    fn collect(file: &'a ast::File, diags: &mut Vec<Diagnostic>) -> Globals<'a> {
        let mut g = Globals { fns: HashMap::new(), fixed_dims: HashMap::new(), consts: HashMap::new() };
        let mut seen: HashMap<&str, Span> = HashMap::new();
        for item in &file.items {
            let name = match item {
                Item::Fn(d) => &d.name,
                Item::Dim(c) | Item::Const(c) => &c.name,
            };
            if let Some(first) = seen.insert(&name.name, name.span) {
                diags.push(
                    Diagnostic::error(codes::DUPLICATE, format!("`{}` is defined twice", name.name), name.span, "defined again here")
                        .with_label(first, "first defined here"),
                );
                continue;
            }
            match item {
                Item::Fn(d) => {
                    g.fns.insert(&d.name.name, d);
                }
                Item::Dim(c) => match literal(&c.value) {
                    Some((v, true)) if v >= 0.0 => {
                        g.fixed_dims.insert(c.name.name.clone(), v as i64);
                    }
                    _ => diags.push(Diagnostic::error(
                        codes::NOT_A_DIM,
                        format!("dimension `{}` must be a non-negative integer", c.name.name),
                        c.value.span,
                        "not a non-negative integer literal",
                    )),
                },
                Item::Const(c) => match literal(&c.value) {
                    Some(v) => {
                        g.consts.insert(c.name.name.clone(), v);
                    }
                    None => diags.push(Diagnostic::error(
                        codes::TYPE_MISMATCH,
                        format!("constant `{}` must be a number", c.name.name),
                        c.value.span,
                        "not a number literal",
                    )),
                },
            }
        }
        g
    }
}

/// A literal number (possibly negated, or `inf`): value and whether it is an integer.
fn literal(e: &ast::Expr) -> Option<(f64, bool)> {
    match &e.kind {
        ExprKind::Int(v) => Some((*v as f64, true)),
        ExprKind::Float(v) => Some((*v, false)),
        ExprKind::Name(n) if n == "inf" => Some((f64::INFINITY, false)),
        ExprKind::Unary(ast::UnOp::Neg, inner) => literal(inner).map(|(v, i)| (-v, i)),
        _ => None,
    }
}

/// The result of lowering an expression.
#[derive(Clone, Debug)]
pub(crate) enum Val {
    /// One tensor.
    T(Value),
    /// Several (from `indices(...)` or a multi-result call); only `let (a, b) = ...` takes them.
    Tuple(Vec<Value>),
}

/// An error has been reported; the caller stops lowering this statement.
#[derive(Debug)]
pub(crate) struct Reported;

pub(crate) type LResult<T> = Result<T, Reported>;

/// Names visible in one function body (an entry, or an inlined call).
#[derive(Default)]
pub(crate) struct Frame {
    vars: HashMap<String, (Value, Span)>,
    /// Names whose `let` failed: uses are skipped silently (the error is already reported).
    poisoned: std::collections::HashSet<String>,
    /// The function's dimension names, as dims of the graph being built.
    dims: HashMap<String, Dim>,
}

/// Lowering state for one entry graph.
pub(crate) struct Cx<'a, 'd> {
    pub(crate) g: Graph,
    globals: &'a Globals<'a>,
    diags: &'d mut Vec<Diagnostic>,
    /// Functions being inlined, to reject recursion.
    stack: Vec<String>,
    /// The graph passed [`MAX_GRAPH_NODES`] (reported once).
    too_large: bool,
}

impl Cx<'_, '_> {
    pub(crate) fn error(&mut self, d: Diagnostic) -> Reported {
        self.diags.push(d);
        Reported
    }

    /// The type of a value.
    pub(crate) fn ty(&self, v: Value) -> &TensorType {
        &self.g.node(v).ty
    }

    /// Adds a node after checking it with [`infer`]. On failure the diagnostic points at `span`
    /// and labels each operand (`operands` pairs values with where they were written).
    pub(crate) fn add(&mut self, op: Op, declared: Option<TensorType>, operands: &[(Value, Span)], span: Span) -> LResult<Value> {
        if self.g.len() >= MAX_GRAPH_NODES {
            if std::mem::replace(&mut self.too_large, true) {
                return Err(Reported);
            }
            let d = Diagnostic::error(
                codes::TOO_LARGE,
                format!("`{}` has more than {MAX_GRAPH_NODES} operations (calls inlined)", self.g.name),
                span,
                "the limit is reached here",
            )
            .with_help("split the program into several functions run one after another");
            return Err(self.error(d));
        }
        let tys: Vec<&TensorType> = operands.iter().map(|(v, _)| &self.g.node(*v).ty).collect();
        match infer(&op, &tys, declared.as_ref()) {
            Ok(ty) if ty.shape.iter().any(Dim::is_overflow) => Err(self.dim_overflow(span)),
            Ok(ty) => {
                let args: Vec<Value> = operands.iter().map(|(v, _)| *v).collect();
                let v = self.g.add(op, ty, &args);
                self.g.set_span(v, Some(span));
                Ok(v)
            }
            Err(msg) => {
                let mut d = Diagnostic::error(codes::TYPE_MISMATCH, msg, span, format!("in this `{}`", op_label(&op)));
                let mut seen = Vec::new();
                for (v, s) in operands {
                    if *s != span && !seen.contains(s) {
                        seen.push(*s);
                        d = d.with_label(*s, format!("this is {}", self.ty(*v)));
                    }
                }
                Err(self.error(d))
            }
        }
    }

    /// A scalar constant.
    pub(crate) fn constant(&mut self, v: f64, dtype: DType) -> Value {
        self.g.add(Op::Const(v), TensorType::scalar(dtype), &[])
    }

    fn lower_entry(&mut self, def: &FnDef) -> LResult<()> {
        let mut frame = Frame::default();
        for (name, v) in &self.globals.fixed_dims {
            frame.dims.insert(name.clone(), Dim::constant(*v));
        }
        declare_quotients(def, &mut frame.dims, self.globals);
        let mut params_ok = true;
        let mut seen: HashMap<&str, Span> = HashMap::new();
        for p in &def.params {
            if let Some(first) = seen.insert(&p.name.name, p.name.span) {
                self.error(
                    Diagnostic::error(
                        codes::DUPLICATE,
                        format!("parameter `{}` is declared twice", p.name.name),
                        p.name.span,
                        "again here",
                    )
                    .with_label(first, "first here"),
                );
                params_ok = false;
                continue;
            }
            match self.declare_type(&p.ty, &mut frame.dims) {
                Ok(ty) => {
                    let v = self.g.add(Op::Param(p.name.name.clone()), ty, &[]);
                    self.g.set_span(v, Some(p.name.span));
                    frame.vars.insert(p.name.name.clone(), (v, p.ty.span));
                }
                Err(Reported) => params_ok = false,
            }
        }
        let rets = self.declared_results(def, &mut frame.dims);
        if !params_ok {
            return Err(Reported);
        }
        let rets = rets?;
        let values = self.lower_body(def, &mut frame)?;
        for ((name, ty, span), (v, vspan)) in rets.into_iter().zip(values) {
            let v = self.coerce_result(v, vspan, &ty, span)?;
            self.g.add_output(name, v);
        }
        Ok(())
    }

    /// Declared results as (name, type, where declared).
    fn declared_results(&mut self, def: &FnDef, dims: &mut HashMap<String, Dim>) -> LResult<Vec<(String, TensorType, Span)>> {
        match &def.ret {
            Ret::Single(t) => Ok(vec![("out".to_string(), self.declare_type(t, dims)?, t.span)]),
            Ret::Named(ps) => {
                let mut out = Vec::new();
                let mut failed = false;
                for p in ps {
                    if out.iter().any(|(n, _, _): &(String, TensorType, Span)| *n == p.name.name) {
                        self.error(Diagnostic::error(
                            codes::DUPLICATE,
                            format!("result `{}` is declared twice", p.name.name),
                            p.name.span,
                            "again here",
                        ));
                        failed = true;
                        continue;
                    }
                    match self.declare_type(&p.ty, dims) {
                        Ok(ty) => out.push((p.name.name.clone(), ty, p.ty.span)),
                        Err(Reported) => failed = true,
                    }
                }
                if failed { Err(Reported) } else { Ok(out) }
            }
        }
    }

    /// Lowers the statements of a function; returns the returned values with their spans.
    fn lower_body(&mut self, def: &FnDef, frame: &mut Frame) -> LResult<Vec<(Value, Span)>> {
        let mut failed = false;
        for stmt in &def.body {
            match stmt {
                Stmt::Let { names, ty, value, span } => {
                    if let Err(Reported) = self.lower_let(frame, names, ty.as_ref(), value, *span) {
                        failed = true;
                        for n in names {
                            frame.vars.remove(&n.name);
                            frame.poisoned.insert(n.name.clone());
                        }
                    }
                }
                Stmt::Return { values, span } => {
                    if let Some(after) = def.body.iter().skip_while(|s| !std::ptr::eq(*s, stmt)).nth(1) {
                        let after_span = match after {
                            Stmt::Let { span, .. } | Stmt::Return { span, .. } => *span,
                        };
                        self.error(
                            Diagnostic::error(codes::UNREACHABLE, "statement after `return`", after_span, "never runs")
                                .with_label(*span, "the function returns here")
                                .with_help("`return` must be the last statement of a function"),
                        );
                        failed = true;
                    }
                    let n_declared = match &def.ret {
                        Ret::Single(_) => 1,
                        Ret::Named(ps) => ps.len(),
                    };
                    if values.len() != n_declared {
                        return Err(self.error(
                            Diagnostic::error(
                                codes::BAD_RETURN,
                                format!("`{}` declares {n_declared} result(s) but returns {}", def.name.name, values.len()),
                                *span,
                                "this return",
                            )
                            .with_label(def.name.span, "declared here"),
                        ));
                    }
                    let mut out = Vec::new();
                    for e in values {
                        match self.tensor(frame, e) {
                            Ok(v) => out.push((v, e.span)),
                            Err(Reported) => failed = true,
                        }
                    }
                    return if failed { Err(Reported) } else { Ok(out) };
                }
            }
        }
        if !failed {
            self.error(
                Diagnostic::error(codes::MISSING_RETURN, format!("`{}` has no `return`", def.name.name), def.span, "this function")
                    .with_help("end the body with `return <value>`"),
            );
        }
        Err(Reported)
    }

    fn lower_let(&mut self, frame: &mut Frame, names: &[ast::Ident], ty: Option<&TypeExpr>, value: &ast::Expr, span: Span) -> LResult<()> {
        let val = self.expr(frame, value)?;
        let values = match (val, names.len()) {
            (Val::T(v), 1) => vec![v],
            (Val::Tuple(vs), n) if vs.len() == n && n > 1 => vs,
            (val, n) => {
                let got = match &val {
                    Val::T(_) => 1,
                    Val::Tuple(vs) => vs.len(),
                };
                return Err(self.error(Diagnostic::error(
                    codes::BAD_PATTERN,
                    format!("{n} name(s) bound to {got} value(s)"),
                    span,
                    format!("this gives {got} value(s)"),
                )));
            }
        };
        if let (Some(t), [v]) = (ty, values.as_slice()) {
            let want = self.resolve_type(t, &frame.dims)?;
            let got = self.ty(*v).clone();
            if want != got {
                return Err(self.error(
                    Diagnostic::error(
                        codes::TYPE_MISMATCH,
                        format!("declared {want} but the value is {got}"),
                        value.span,
                        format!("this is {got}"),
                    )
                    .with_label(t.span, "declared here"),
                ));
            }
        }
        for (name, v) in names.iter().zip(values) {
            frame.poisoned.remove(&name.name);
            frame.vars.insert(name.name.clone(), (v, value.span));
        }
        Ok(())
    }

    /// A returned value checked against its declared type. Float values are rounded to a
    /// different declared float storage type with a cast; anything else must match exactly.
    fn coerce_result(&mut self, v: Value, vspan: Span, want: &TensorType, declared_at: Span) -> LResult<Value> {
        let got = self.ty(v).clone();
        if got.shape == want.shape && got.dtype == want.dtype {
            return Ok(v);
        }
        if got.shape == want.shape && got.dtype.is_float() && want.dtype.is_float() {
            return Ok(self.g.add(Op::Cast, want.clone(), &[v]));
        }
        Err(self.error(
            Diagnostic::error(
                codes::BAD_RETURN,
                format!("returns {got} but the result is declared {want}"),
                vspan,
                format!("this is {got}"),
            )
            .with_label(declared_at, "declared here"),
        ))
    }

    /// Resolves a type in a function signature, declaring new dimension names as symbols.
    fn declare_type(&mut self, t: &TypeExpr, dims: &mut HashMap<String, Dim>) -> LResult<TensorType> {
        for d in &t.dims {
            declare_dim_names(d, dims, self.globals);
        }
        self.resolve_type(t, dims)
    }

    /// Resolves a written type against known dimension names.
    pub(crate) fn resolve_type(&mut self, t: &TypeExpr, dims: &HashMap<String, Dim>) -> LResult<TensorType> {
        let dtype = self.dtype(&t.dtype)?;
        let mut shape = Vec::new();
        let mut failed = false;
        for d in &t.dims {
            match self.dim_expr(d, dims) {
                Ok(d) => shape.push(d),
                Err(Reported) => failed = true,
            }
        }
        if failed { Err(Reported) } else { Ok(TensorType::new(dtype, shape)) }
    }

    pub(crate) fn dtype(&mut self, name: &ast::Ident) -> LResult<DType> {
        DType::from_name(&name.name).ok_or_else(|| {
            self.error(
                Diagnostic::error(codes::UNKNOWN_DTYPE, format!("unknown element type `{}`", name.name), name.span, "not a dtype")
                    .with_help("element types are f32, f16, bf16, i32 and bool"),
            )
        })
    }

    /// A dimension whose arithmetic overflowed, written at `span`.
    fn dim_overflow(&mut self, span: Span) -> Reported {
        self.error(
            Diagnostic::error(codes::DIM_OVERFLOW, "dimension arithmetic overflows a 64-bit integer", span, "this size does not fit")
                .with_help("sizes are 64-bit integers; no tensor can have this many elements"),
        )
    }

    /// A dimension expression: names, integers, `+`, `-`, `*`, parentheses.
    pub(crate) fn dim_expr(&mut self, e: &ast::Expr, dims: &HashMap<String, Dim>) -> LResult<Dim> {
        let d = self.dim_expr_unchecked(e, dims)?;
        if d.is_overflow() { Err(self.dim_overflow(e.span)) } else { Ok(d) }
    }

    fn dim_expr_unchecked(&mut self, e: &ast::Expr, dims: &HashMap<String, Dim>) -> LResult<Dim> {
        match &e.kind {
            ExprKind::Int(v) => Ok(Dim::constant(*v)),
            ExprKind::Name(n) => {
                if let Some(d) = dims.get(n) {
                    Ok(d.clone())
                } else if let Some((v, true)) = self.globals.consts.get(n) {
                    Ok(Dim::constant(*v as i64))
                } else {
                    let mut known: Vec<&String> = dims.keys().collect();
                    known.sort();
                    let list: Vec<&str> = known.iter().map(|s| s.as_str()).collect();
                    Err(self.error(
                        Diagnostic::error(codes::NOT_A_DIM, format!("`{n}` is not a dimension here"), e.span, "unknown dimension")
                            .with_help(if list.is_empty() {
                                "dimensions are the names used in the parameter types".to_string()
                            } else {
                                format!("dimensions in scope: {}", list.join(", "))
                            }),
                    ))
                }
            }
            ExprKind::Unary(ast::UnOp::Neg, inner) => Ok(self.dim_expr(inner, dims)?.scale(-1)),
            ExprKind::Binary(op @ (ast::BinOp::Add | ast::BinOp::Sub | ast::BinOp::Mul), a, b) => {
                let (a, b) = (self.dim_expr(a, dims)?, self.dim_expr(b, dims)?);
                Ok(match op {
                    ast::BinOp::Add => a.add(&b),
                    ast::BinOp::Sub => a.sub(&b),
                    _ => a.mul(&b),
                })
            }
            ExprKind::Binary(ast::BinOp::Div, a, b) => {
                let (n, d) = (self.dim_expr(a, dims)?, self.dim_expr(b, dims)?);
                match n.div_exact(&d) {
                    Some(q) if d.as_const().is_none_or(|c| c > 0) => Ok(q),
                    _ => Err(self.error(
                        Diagnostic::error(
                            codes::NOT_A_DIM,
                            format!("{n} is not known to be a multiple of {d}"),
                            e.span,
                            "not a whole dimension",
                        )
                        .with_help(
                            "divide a name of the entry's signature by an integer (`D/2` makes D even, checked when the \
                             inputs bind it), or a product by one of its factors (`(H*Dh)/H`)",
                        ),
                    )),
                }
            }
            _ => Err(self.error(
                Diagnostic::error(codes::NOT_A_DIM, "expected a dimension expression", e.span, "not a dimension")
                    .with_help("dimensions are names, integers, and `+`, `-`, `*`, `/` of them"),
            )),
        }
    }

    /// Inlines a call to a user function; returns its results.
    pub(crate) fn call_user(&mut self, frame: &Frame, def: &FnDef, args: &[ast::Arg], span: Span) -> LResult<Val> {
        if self.stack.contains(&def.name.name) || self.g.name == def.name.name {
            return Err(self.error(
                Diagnostic::error(codes::RECURSION, format!("`{}` calls itself", def.name.name), span, "recursive call")
                    .with_help("attention programs are inlined: functions cannot recurse"),
            ));
        }
        if args.len() != def.params.len() || args.iter().any(|a| a.name.is_some()) {
            return Err(self.error(
                Diagnostic::error(
                    codes::BAD_ARGS,
                    format!("`{}` takes {} positional argument(s), got {}", def.name.name, def.params.len(), args.len()),
                    span,
                    "this call",
                )
                .with_label(def.name.span, "defined here"),
            ));
        }
        let mut actual = Vec::new();
        for a in args {
            actual.push((self.tensor(frame, &a.value)?, a.value.span));
        }
        let mut callee = Frame::default();
        for (name, v) in &self.globals.fixed_dims {
            callee.dims.insert(name.clone(), Dim::constant(*v));
        }
        let mut bound_by = HashMap::new();
        for (p, (v, vspan)) in def.params.iter().zip(&actual) {
            let got = self.ty(*v).clone();
            self.unify_param(p, &got, *vspan, &mut callee.dims, &mut bound_by)?;
            callee.vars.insert(p.name.name.clone(), (*v, *vspan));
        }
        let rets = {
            let mut dims = callee.dims.clone();
            self.declared_results(def, &mut dims)?
        };
        self.stack.push(def.name.name.clone());
        let values = self.lower_body(def, &mut callee);
        self.stack.pop();
        let values = values?;
        let mut out = Vec::new();
        for ((_, ty, dspan), (v, vspan)) in rets.into_iter().zip(values) {
            out.push(self.coerce_result(v, vspan, &ty, dspan)?);
        }
        Ok(if out.len() == 1 { Val::T(out[0]) } else { Val::Tuple(out) })
    }

    /// Binds a callee's dimension names from an argument's type and checks the rest.
    /// `bound_by` remembers which parameter bound each name, for the error message.
    fn unify_param(
        &mut self,
        p: &ast::Param,
        got: &TensorType,
        vspan: Span,
        dims: &mut HashMap<String, Dim>,
        bound_by: &mut HashMap<String, String>,
    ) -> LResult<()> {
        let dtype = self.dtype(&p.ty.dtype)?;
        let mismatch = |cx: &mut Self, msg: String| {
            cx.error(
                Diagnostic::error(codes::TYPE_MISMATCH, msg, vspan, format!("this is {got}"))
                    .with_label(p.ty.span, format!("`{}` is declared here", p.name.name)),
            )
        };
        if dtype != got.dtype || p.ty.dims.len() != got.rank() {
            return Err(mismatch(self, format!("argument `{}` must be {}, found {got}", p.name.name, p.ty)));
        }
        // Plain names first, then compound dims (which may need those names).
        let mut pending = Vec::new();
        for (e, actual) in p.ty.dims.iter().zip(&got.shape) {
            match &e.kind {
                ExprKind::Name(n) if !dims.contains_key(n) && !self.globals.consts.contains_key(n) => {
                    dims.insert(n.clone(), actual.clone());
                    bound_by.insert(n.clone(), p.name.name.clone());
                }
                ExprKind::Name(n) if bound_by.contains_key(n) && dims.get(n) != Some(actual) => {
                    let first = dims.get(n).map(Dim::to_string).unwrap_or_default();
                    let from = bound_by.get(n).cloned().unwrap_or_default();
                    return Err(mismatch(
                        self,
                        format!(
                            "argument `{}` must be {}, found {got}: `{n}` is {first} (from argument `{from}`) but {actual} here",
                            p.name.name, p.ty
                        ),
                    ));
                }
                _ => pending.push((e, actual)),
            }
        }
        for (e, actual) in pending {
            let mut names = HashMap::new();
            declare_dim_names(e, &mut names, self.globals);
            let unknown: Vec<String> = names.keys().filter(|n| !dims.contains_key(*n)).cloned().collect();
            if let [x] = unknown.as_slice() {
                // Solve `m * X == actual` for a single unknown name X with a known monomial m.
                let mut probe = dims.clone();
                probe.insert(x.clone(), Dim::constant(1));
                let m = self.dim_expr(e, &probe)?;
                match actual.div_exact(&m) {
                    Some(sol) if m.terms().count() == 1 => {
                        dims.insert(x.clone(), sol);
                    }
                    _ => {
                        return Err(mismatch(self, format!("cannot match {e} in `{}` against {actual}", p.name.name)));
                    }
                }
            }
            let want = self.dim_expr(e, dims)?;
            if want != *actual {
                return Err(mismatch(self, format!("argument `{}` must be {}, found {got} ({want} vs {actual})", p.name.name, p.ty)));
            }
        }
        Ok(())
    }
}

/// Declares every dimension name of a signature dim expression (not constants) as a symbol.
/// A name of the entry's signature that the signature divides by integers (`D/2`, `D/4`) is
/// `L · (D/L)` for the least common multiple `L` of the divisors: a new dimension `D/L` the
/// inputs bind, so that every division is exact and every dim stays a polynomial.
fn declare_quotients(def: &FnDef, dims: &mut HashMap<String, Dim>, globals: &Globals<'_>) {
    fn visit(e: &ast::Expr, out: &mut Vec<(String, i64)>) {
        match &e.kind {
            ExprKind::Binary(ast::BinOp::Div, a, b) => {
                if let (ExprKind::Name(n), ExprKind::Int(c)) = (&a.kind, &b.kind)
                    && *c > 1
                {
                    out.push((n.clone(), *c));
                }
                visit(a, out);
                visit(b, out);
            }
            ExprKind::Unary(_, a) => visit(a, out),
            ExprKind::Binary(_, a, b) => {
                visit(a, out);
                visit(b, out);
            }
            _ => {}
        }
    }
    let results: Vec<&TypeExpr> = match &def.ret {
        Ret::Single(t) => vec![t],
        Ret::Named(ps) => ps.iter().map(|p| &p.ty).collect(),
    };
    let mut found = Vec::new();
    for t in def.params.iter().map(|p| &p.ty).chain(results) {
        for d in &t.dims {
            visit(d, &mut found);
        }
    }
    let mut lcm: BTreeMap<String, i64> = BTreeMap::new();
    for (name, c) in found {
        if dims.contains_key(&name) || globals.consts.contains_key(&name) {
            continue;
        }
        let l = lcm.entry(name).or_insert(1);
        // Past i64 the division is left to `dim_expr`, which reports it.
        *l = l.checked_mul(c / gcd(*l, c)).unwrap_or(*l);
    }
    for (name, l) in lcm {
        dims.insert(name.clone(), Dim::sym(&Dim::quotient_name(&name, l)).scale(l));
    }
}

fn gcd(mut a: i64, mut b: i64) -> i64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn declare_dim_names(e: &ast::Expr, dims: &mut HashMap<String, Dim>, globals: &Globals<'_>) {
    match &e.kind {
        ExprKind::Name(n) if !dims.contains_key(n) && !globals.consts.contains_key(n) => {
            dims.insert(n.clone(), Dim::sym(n));
        }
        ExprKind::Unary(_, a) => declare_dim_names(a, dims, globals),
        ExprKind::Binary(_, a, b) => {
            declare_dim_names(a, dims, globals);
            declare_dim_names(b, dims, globals);
        }
        _ => {}
    }
}

/// How an op is named in "in this ..." labels.
fn op_label(op: &Op) -> &'static str {
    match op {
        Op::MatMul => "@",
        Op::Select => "where",
        other => other.name(),
    }
}
