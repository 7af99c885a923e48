//! Warnings: programs that check but probably do not say what their author meant.
//!
//! - W0001: a `let` whose names are never used (in `let (a, b) = …`, only when none is);
//! - W0002: a parameter the function never uses;
//! - W0003: a parameter or `let` named like a built-in function or `inf`.
//!
//! Names starting with `_` are never reported as unused. The pass reads the syntax tree only,
//! once per function as written (calls are inlined later, but a warning is about the source).
//! Its walk over expressions uses an explicit stack, so it needs no depth limit of its own.

use super::builtins::BUILTINS;
use attn_dsl::ast::{self, Expr, ExprKind, FnDef, IndexItem, Item, Stmt};
use attn_dsl::{Diagnostic, Span};
use std::collections::HashMap;

/// Warning codes (see `docs/diagnostics.md`).
pub mod codes {
    /// A `let` whose names are never used.
    pub const UNUSED_LET: &str = "W0001";
    /// A parameter that is never used.
    pub const UNUSED_PARAM: &str = "W0002";
    /// A name that shadows a built-in.
    pub const SHADOWS_BUILTIN: &str = "W0003";
}

/// The warnings for every function of `file`, in source order.
pub fn lint(file: &ast::File) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    for item in &file.items {
        if let Item::Fn(def) = item {
            lint_fn(def, &mut out);
        }
    }
    out
}

/// One binding: a parameter, or all the names of one `let`.
struct Binding<'a> {
    names: Vec<&'a ast::Ident>,
    used: bool,
    param: bool,
    span: Span,
}

fn lint_fn(def: &FnDef, out: &mut Vec<Diagnostic>) {
    let mut bindings: Vec<Binding<'_>> = Vec::new();
    // Name → index of the binding that defines it now.
    let mut scope: HashMap<&str, usize> = HashMap::new();
    for p in &def.params {
        shadows(&p.name, "parameter", out);
        scope.insert(&p.name.name, bindings.len());
        bindings.push(Binding { names: vec![&p.name], used: false, param: true, span: p.name.span });
    }
    for stmt in &def.body {
        let values: Vec<&Expr> = match stmt {
            Stmt::Let { value, .. } => vec![value],
            Stmt::Return { values, .. } => values.iter().collect(),
        };
        for name in used_names(&values) {
            if let Some(&b) = scope.get(name) {
                bindings[b].used = true;
            }
        }
        if let Stmt::Let { names, span, .. } = stmt {
            for n in names {
                shadows(n, "`let`", out);
                scope.insert(&n.name, bindings.len());
            }
            bindings.push(Binding { names: names.iter().collect(), used: false, param: false, span: *span });
        }
    }
    for b in bindings {
        if b.used || b.names.iter().all(|n| n.name.starts_with('_')) {
            continue;
        }
        let listed: Vec<String> = b.names.iter().map(|n| format!("`{}`", n.name)).collect();
        let d = if b.param {
            Diagnostic::warning(codes::UNUSED_PARAM, format!("parameter {} is never used", listed.join(", ")), b.span, "unused")
                .with_help("remove it, or name it with a leading `_` if callers must still pass it")
        } else {
            let what = if b.names.len() == 1 { "is" } else { "are" };
            Diagnostic::warning(
                codes::UNUSED_LET,
                format!("{} {what} never used", listed.join(", ")),
                b.span,
                "this value is computed for nothing",
            )
            .with_help("remove the `let`, or prefix the name with `_`")
        };
        out.push(d);
    }
}

/// W0003 for `name` when it is a built-in function or `inf`.
fn shadows(name: &ast::Ident, what: &str, out: &mut Vec<Diagnostic>) {
    let n = name.name.as_str();
    if n == "inf" || BUILTINS.contains(&n) {
        let kind = if n == "inf" { "the constant" } else { "the built-in function" };
        out.push(
            Diagnostic::warning(codes::SHADOWS_BUILTIN, format!("{what} `{n}` shadows {kind} `{n}`"), name.span, "shadows a built-in")
                .with_help("rename it: readers (and a later edit) will take it for the built-in"),
        );
    }
}

/// Every variable name read in `roots` (names of calls and methods are functions, not reads).
fn used_names<'e>(roots: &[&'e Expr]) -> Vec<&'e str> {
    let mut names = Vec::new();
    let mut stack: Vec<&Expr> = roots.to_vec();
    while let Some(e) = stack.pop() {
        match &e.kind {
            ExprKind::Name(n) => names.push(n.as_str()),
            ExprKind::Int(_) | ExprKind::Float(_) | ExprKind::Bool(_) | ExprKind::Error => {}
            ExprKind::Unary(_, x) | ExprKind::Field(x, _) => stack.push(x),
            ExprKind::Binary(_, a, b) => {
                stack.push(a);
                stack.push(b);
            }
            ExprKind::Call(_, args) => stack.extend(args.iter().map(|a| &a.value)),
            ExprKind::Method(x, _, args) => {
                stack.push(x);
                stack.extend(args.iter().map(|a| &a.value));
            }
            ExprKind::Index(x, items) => {
                stack.push(x);
                for item in items {
                    match item {
                        IndexItem::Expr(e) => stack.push(e),
                        IndexItem::Slice { lo, hi, step, .. } => stack.extend(lo.iter().chain(hi.iter()).chain(step.iter())),
                    }
                }
            }
            ExprKind::List(xs) => stack.extend(xs.iter()),
        }
    }
    names
}
