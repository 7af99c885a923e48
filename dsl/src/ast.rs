//! The syntax tree of a `.attn` file, close to what was written.
//!
//! [`std::fmt::Display`] prints it back as fully parenthesised source (the AST's canonical text,
//! which the parser reads back to the same tree).

use crate::span::Span;

/// A name with its location.
#[derive(Clone, Debug, PartialEq)]
pub struct Ident {
    /// The name.
    pub name: String,
    /// Where it was written.
    pub span: Span,
}

/// A whole source file.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct File {
    /// Top-level items in source order.
    pub items: Vec<Item>,
}

/// A top-level item.
#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    /// `fn name(params) -> ret { body }`
    Fn(FnDef),
    /// `dim H = 8`: a dimension fixed for the whole file.
    Dim(ConstDef),
    /// `const W = 256`: a named scalar constant.
    Const(ConstDef),
}

/// `dim NAME = value` or `const NAME = value`.
#[derive(Clone, Debug, PartialEq)]
pub struct ConstDef {
    /// The name.
    pub name: Ident,
    /// The value (a literal expression, possibly negated).
    pub value: Expr,
    /// The whole item.
    pub span: Span,
}

/// A function: an entry point, and callable from other functions (calls are inlined).
#[derive(Clone, Debug, PartialEq)]
pub struct FnDef {
    /// The name.
    pub name: Ident,
    /// Typed parameters.
    pub params: Vec<Param>,
    /// Declared results.
    pub ret: Ret,
    /// Statements; the last one is a `return`.
    pub body: Vec<Stmt>,
    /// The whole function.
    pub span: Span,
}

/// `name: f32[B, S, D]`
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    /// The name.
    pub name: Ident,
    /// The declared type.
    pub ty: TypeExpr,
}

/// A tensor type as written: a dtype and a list of dimension expressions.
#[derive(Clone, Debug, PartialEq)]
pub struct TypeExpr {
    /// `f32`, `f16`, `bf16`, `i32` or `bool`.
    pub dtype: Ident,
    /// Dimension expressions: names, integers, `+`, `-`, `*` of those.
    pub dims: Vec<Expr>,
    /// The whole type.
    pub span: Span,
}

/// What a function returns.
#[derive(Clone, Debug, PartialEq)]
pub enum Ret {
    /// `-> f32[...]`: one result, named `out`.
    Single(TypeExpr),
    /// `-> (ctx: f32[...], weights: f32[...])`: named results.
    Named(Vec<Param>),
}

/// A statement.
#[derive(Clone, Debug, PartialEq)]
pub enum Stmt {
    /// `let x = e`, `let x: T = e`, `let (a, b) = e`
    Let {
        /// Bound names (more than one for tuple destructuring).
        names: Vec<Ident>,
        /// Optional type annotation (single name only).
        ty: Option<TypeExpr>,
        /// The value.
        value: Expr,
        /// The whole statement.
        span: Span,
    },
    /// `return e` or `return a, b`
    Return {
        /// Returned values, one per declared result.
        values: Vec<Expr>,
        /// The whole statement.
        span: Span,
    },
}

/// An expression with its location.
#[derive(Clone, Debug, PartialEq)]
pub struct Expr {
    /// What it is.
    pub kind: ExprKind,
    /// Where it was written.
    pub span: Span,
}

/// Binary operators, by precedence group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinOp {
    /// `||`
    Or,
    /// `&&`
    And,
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
    /// `+`
    Add,
    /// `-`
    Sub,
    /// `*`
    Mul,
    /// `/`
    Div,
    /// `%`
    Rem,
    /// `@`
    MatMul,
    /// `**`
    Pow,
}

impl BinOp {
    /// The operator as written.
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Or => "||",
            BinOp::And => "&&",
            BinOp::Eq => "==",
            BinOp::Ne => "!=",
            BinOp::Lt => "<",
            BinOp::Le => "<=",
            BinOp::Gt => ">",
            BinOp::Ge => ">=",
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::Rem => "%",
            BinOp::MatMul => "@",
            BinOp::Pow => "**",
        }
    }
}

/// Prefix operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnOp {
    /// `-x`
    Neg,
    /// `!x`
    Not,
}

/// A call argument, optionally named (`axis = -1`).
#[derive(Clone, Debug, PartialEq)]
pub struct Arg {
    /// The keyword, if any.
    pub name: Option<Ident>,
    /// The value.
    pub value: Expr,
}

/// One item between the brackets of `x[...]`.
#[derive(Clone, Debug, PartialEq)]
pub enum IndexItem {
    /// An expression: a gathered index tensor, or a constant integer in a slice.
    Expr(Expr),
    /// `lo:hi` or `lo:hi:step` with either bound and the step optional.
    Slice {
        /// Start (default 0).
        lo: Option<Expr>,
        /// End (default: the axis' size).
        hi: Option<Expr>,
        /// Every `step`-th element from `lo` (default 1).
        step: Option<Expr>,
        /// The whole slice.
        span: Span,
    },
}

/// The kinds of expression.
#[derive(Clone, Debug, PartialEq)]
pub enum ExprKind {
    /// A variable, parameter, dimension, constant or `inf`.
    Name(String),
    /// An integer literal.
    Int(i64),
    /// A float literal.
    Float(f64),
    /// `true` / `false`.
    Bool(bool),
    /// `-x`, `!x`
    Unary(UnOp, Box<Expr>),
    /// `a op b`
    Binary(BinOp, Box<Expr>, Box<Expr>),
    /// `f(args)`
    Call(Ident, Vec<Arg>),
    /// `x.f(args)`: sugar for `f(x, args)`.
    Method(Box<Expr>, Ident, Vec<Arg>),
    /// `x.T` (the only field: swap the last two axes).
    Field(Box<Expr>, Ident),
    /// `x[items]`
    Index(Box<Expr>, Vec<IndexItem>),
    /// `[a, b, c]`: shapes, permutations, axis lists, concat operands.
    List(Vec<Expr>),
    /// Stands where the parser recovered from an error.
    Error,
}
