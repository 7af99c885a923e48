//! The AST's canonical text: the program printed back as source, one statement a line, every
//! compound sub-expression parenthesised so that precedence is visible. It parses back to the
//! same tree (up to spans).

use crate::ast::{Arg, ConstDef, Expr, ExprKind, File, FnDef, IndexItem, Item, Param, Ret, Stmt, TypeExpr, UnOp};
use std::fmt::{self, Display, Formatter, Write};

impl Display for File {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        for (n, item) in self.items.iter().enumerate() {
            if n > 0 {
                f.write_char('\n')?;
            }
            match item {
                Item::Fn(def) => write!(f, "{def}")?,
                Item::Dim(c) => write_const(f, "dim", c)?,
                Item::Const(c) => write_const(f, "const", c)?,
            }
        }
        Ok(())
    }
}

fn write_const(f: &mut Formatter<'_>, kw: &str, c: &ConstDef) -> fmt::Result {
    writeln!(f, "{kw} {} = {}", c.name.name, c.value)
}

impl Display for FnDef {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "fn {}(", self.name.name)?;
        write_params(f, &self.params)?;
        f.write_str(") -> ")?;
        match &self.ret {
            Ret::Single(t) => write!(f, "{t}")?,
            Ret::Named(ps) => {
                f.write_char('(')?;
                write_params(f, ps)?;
                f.write_char(')')?;
            }
        }
        f.write_str(" {\n")?;
        for stmt in &self.body {
            writeln!(f, "    {stmt}")?;
        }
        f.write_str("}\n")
    }
}

fn write_params(f: &mut Formatter<'_>, ps: &[Param]) -> fmt::Result {
    for (n, p) in ps.iter().enumerate() {
        if n > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{}: {}", p.name.name, p.ty)?;
    }
    Ok(())
}

impl Display for TypeExpr {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        f.write_str(&self.dtype.name)?;
        if !self.dims.is_empty() {
            f.write_char('[')?;
            comma_list(f, &self.dims)?;
            f.write_char(']')?;
        }
        Ok(())
    }
}

impl Display for Stmt {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match self {
            Stmt::Let { names, ty, value, .. } => {
                f.write_str("let ")?;
                if names.len() == 1 {
                    f.write_str(&names[0].name)?;
                } else {
                    let joined: Vec<&str> = names.iter().map(|n| n.name.as_str()).collect();
                    write!(f, "({})", joined.join(", "))?;
                }
                if let Some(t) = ty {
                    write!(f, ": {t}")?;
                }
                write!(f, " = {value}")
            }
            Stmt::Return { values, .. } => {
                f.write_str("return ")?;
                comma_list(f, values)
            }
        }
    }
}

fn comma_list(f: &mut Formatter<'_>, es: &[Expr]) -> fmt::Result {
    for (n, e) in es.iter().enumerate() {
        if n > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{e}")?;
    }
    Ok(())
}

fn write_args(f: &mut Formatter<'_>, args: &[Arg]) -> fmt::Result {
    for (n, a) in args.iter().enumerate() {
        if n > 0 {
            f.write_str(", ")?;
        }
        if let Some(name) = &a.name {
            write!(f, "{} = ", name.name)?;
        }
        write!(f, "{}", a.value)?;
    }
    Ok(())
}

impl Display for Expr {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match &self.kind {
            ExprKind::Name(n) => f.write_str(n),
            ExprKind::Int(v) => write!(f, "{v}"),
            ExprKind::Float(v) => {
                if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e15 {
                    write!(f, "{v:.1}")
                } else {
                    write!(f, "{v:e}")
                }
            }
            ExprKind::Bool(b) => write!(f, "{b}"),
            ExprKind::Unary(op, e) => {
                let sym = match op {
                    UnOp::Neg => "-",
                    UnOp::Not => "!",
                };
                write!(f, "({sym}{e})")
            }
            ExprKind::Binary(op, a, b) => write!(f, "({a} {} {b})", op.symbol()),
            ExprKind::Call(name, args) => {
                write!(f, "{}(", name.name)?;
                write_args(f, args)?;
                f.write_char(')')
            }
            ExprKind::Method(recv, name, args) => {
                write!(f, "{recv}.{}(", name.name)?;
                write_args(f, args)?;
                f.write_char(')')
            }
            ExprKind::Field(recv, name) => write!(f, "{recv}.{}", name.name),
            ExprKind::Index(base, items) => {
                write!(f, "{base}[")?;
                for (n, item) in items.iter().enumerate() {
                    if n > 0 {
                        f.write_str(", ")?;
                    }
                    match item {
                        IndexItem::Expr(e) => write!(f, "{e}")?,
                        IndexItem::Slice { lo, hi, step, .. } => {
                            if let Some(lo) = lo {
                                write!(f, "{lo}")?;
                            }
                            f.write_char(':')?;
                            if let Some(hi) = hi {
                                write!(f, "{hi}")?;
                            }
                            if let Some(step) = step {
                                write!(f, ":{step}")?;
                            }
                        }
                    }
                }
                f.write_char(']')
            }
            ExprKind::List(es) => {
                f.write_char('[')?;
                comma_list(f, es)?;
                f.write_char(']')
            }
            ExprKind::Error => f.write_str("<error>"),
        }
    }
}
