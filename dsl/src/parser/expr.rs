//! Statements and expressions (precedence climbing).
//!
//! Precedence, loosest first: `||`, `&&`, comparisons (non-associative), `+ -`, `* / % @`,
//! prefix `- !`, `**` (right-associative), postfix (call, `.name`, `.name(...)`, `[...]`).

use super::{MAX_DEPTH, PResult, Parser, Recover, codes};
use crate::ast::{Arg, BinOp, Expr, ExprKind, Ident, IndexItem, Stmt, UnOp};
use crate::diagnostic::Diagnostic;
use crate::token::Token;

impl Parser<'_> {
    pub(super) fn stmt(&mut self) -> PResult<Stmt> {
        match self.peek() {
            Token::Let => {
                let start = self.bump();
                let mut names = Vec::new();
                let open = self.span();
                if self.eat(Token::LParen) {
                    loop {
                        names.push(self.ident("in a `let (a, b) = ...` pattern")?);
                        if !self.eat(Token::Comma) {
                            break;
                        }
                    }
                    self.close(Token::RParen, open, "to close the pattern")?;
                } else {
                    names.push(self.ident("after `let`")?);
                }
                let ty = if self.eat(Token::Colon) { Some(self.type_expr()?) } else { None };
                self.require(Token::Assign, "in a `let` binding")?;
                let value = self.expr()?;
                self.eat(Token::Semi);
                Ok(Stmt::Let { span: start.to(value.span), names, ty, value })
            }
            Token::Return => {
                let start = self.bump();
                let mut values = vec![self.expr()?];
                while self.eat(Token::Comma) {
                    values.push(self.expr()?);
                }
                self.eat(Token::Semi);
                let end = self.prev_span();
                Ok(Stmt::Return { values, span: start.to(end) })
            }
            _ => Err(self.unexpected("expected `let` or `return` at the start of a statement")),
        }
    }

    /// Parses one expression.
    pub(crate) fn expr(&mut self) -> PResult<Expr> {
        let mark = self.depth;
        let r = self.nest().and_then(|()| self.binary(0));
        self.depth = mark;
        r
    }

    /// One more level of the tree being built: every operator, call, index, method and
    /// bracket counts, so a chain `a + b + …` of N terms is N levels deep, as its tree is.
    /// Past [`MAX_DEPTH`] the expression is refused (E0005), which bounds every recursion
    /// over the tree later on. The caller restores `depth` when it finishes the node.
    fn nest(&mut self) -> PResult<()> {
        self.depth += 1;
        if self.depth <= MAX_DEPTH {
            return Ok(());
        }
        let d = Diagnostic::error(codes::TOO_DEEP, format!("expression nests more than {MAX_DEPTH} levels deep"), self.span(), "here")
            .with_help("long chains of operators or method calls nest one level per operator: split the expression with `let`");
        self.diags.push(d);
        Err(Recover)
    }

    fn binary(&mut self, min_level: u8) -> PResult<Expr> {
        let mark = self.depth;
        let r = self.binary_chain(min_level);
        self.depth = mark;
        r
    }

    /// A left-associative chain: each operator nests the chain so far one level deeper.
    fn binary_chain(&mut self, min_level: u8) -> PResult<Expr> {
        let mut lhs = self.prefix()?;
        while let Some((op, level)) = binop(self.peek()) {
            if level < min_level {
                break;
            }
            self.nest()?;
            self.bump();
            // Comparisons are non-associative: `a < b < c` is rejected by parsing the right side
            // one level tighter and checking below.
            let rhs = self.binary(level + 1)?;
            let span = lhs.span.to(rhs.span);
            lhs = Expr { kind: ExprKind::Binary(op, Box::new(lhs), Box::new(rhs)), span };
            if level == COMPARE && binop(self.peek()).is_some_and(|(_, l)| l == COMPARE) {
                let d = Diagnostic::error(codes::UNEXPECTED, "comparisons cannot be chained", self.span(), "second comparison")
                    .with_help("write `a < b && b < c`");
                self.diags.push(d);
                return Err(Recover);
            }
        }
        Ok(lhs)
    }

    fn prefix(&mut self) -> PResult<Expr> {
        let op = match self.peek() {
            Token::Minus => UnOp::Neg,
            Token::Bang => UnOp::Not,
            _ => return self.power(),
        };
        let start = self.bump();
        let mark = self.depth;
        let operand = self.nest().and_then(|()| self.prefix());
        self.depth = mark;
        let operand = operand?;
        let span = start.to(operand.span);
        Ok(Expr { kind: ExprKind::Unary(op, Box::new(operand)), span })
    }

    fn power(&mut self) -> PResult<Expr> {
        let base = self.postfix()?;
        if self.eat(Token::StarStar) {
            // Right-associative, and binds tighter than a prefix minus on its left: -x**2 = -(x**2).
            let mark = self.depth;
            let exp = self.nest().and_then(|()| self.prefix());
            self.depth = mark;
            let exp = exp?;
            let span = base.span.to(exp.span);
            return Ok(Expr { kind: ExprKind::Binary(BinOp::Pow, Box::new(base), Box::new(exp)), span });
        }
        Ok(base)
    }

    fn postfix(&mut self) -> PResult<Expr> {
        let mark = self.depth;
        let r = self.postfix_chain();
        self.depth = mark;
        r
    }

    /// An atom and its `.method(…)`, `.field` and `[…]` suffixes, each one level deeper.
    fn postfix_chain(&mut self) -> PResult<Expr> {
        let mut e = self.atom()?;
        loop {
            if matches!(self.peek(), Token::Dot | Token::LBracket) {
                self.nest()?;
            }
            match self.peek() {
                Token::Dot => {
                    self.bump();
                    let name = self.ident("after `.`")?;
                    if self.eat(Token::LParen) {
                        let args = self.args()?;
                        let span = e.span.to(self.prev_span());
                        e = Expr { kind: ExprKind::Method(Box::new(e), name, args), span };
                    } else {
                        let span = e.span.to(name.span);
                        e = Expr { kind: ExprKind::Field(Box::new(e), name), span };
                    }
                }
                Token::LBracket => {
                    self.bump();
                    let items = self.index_items()?;
                    let span = e.span.to(self.prev_span());
                    e = Expr { kind: ExprKind::Index(Box::new(e), items), span };
                }
                _ => break,
            }
        }
        Ok(e)
    }

    fn atom(&mut self) -> PResult<Expr> {
        let span = self.span();
        let kind = match self.peek() {
            Token::Int => {
                let text = self.text();
                let Ok(v) = text.parse::<i64>() else {
                    let d = Diagnostic::error(codes::BAD_NUMBER, format!("integer `{text}` is too large"), span, "does not fit in 64 bits");
                    self.diags.push(d);
                    self.bump();
                    return Ok(Expr { kind: ExprKind::Error, span });
                };
                self.bump();
                ExprKind::Int(v)
            }
            Token::Float => {
                let v = self.text().parse::<f64>().unwrap_or(f64::NAN);
                self.bump();
                ExprKind::Float(v)
            }
            Token::True | Token::False => {
                let v = self.peek() == Token::True;
                self.bump();
                ExprKind::Bool(v)
            }
            Token::Ident => {
                let ident = self.ident("")?;
                if self.eat(Token::LParen) {
                    let args = self.args()?;
                    let span = ident.span.to(self.prev_span());
                    return Ok(Expr { kind: ExprKind::Call(ident, args), span });
                }
                ExprKind::Name(ident.name)
            }
            Token::LParen => {
                let open = self.bump();
                let inner = self.expr()?;
                let end = self.close(Token::RParen, open, "to close the parenthesis")?;
                return Ok(Expr { kind: inner.kind, span: span.to(end) });
            }
            Token::LBracket => {
                let open = self.bump();
                let mut elems = Vec::new();
                while self.peek() != Token::RBracket {
                    elems.push(self.expr()?);
                    if !self.eat(Token::Comma) {
                        break;
                    }
                }
                let end = self.close(Token::RBracket, open, "to close the list")?;
                return Ok(Expr { kind: ExprKind::List(elems), span: span.to(end) });
            }
            // `.5`: a number needs a digit before its point.
            Token::Dot if self.peek_at(1) == Token::Int && self.toks.get(self.pos + 1).is_some_and(|t| t.1.start == span.end) => {
                let digits = self.toks.get(self.pos + 1).and_then(|t| self.src.get(t.1.range())).unwrap_or("5");
                let d = Diagnostic::error(
                    codes::UNEXPECTED,
                    "a number needs a digit before its point",
                    span.to(self.toks[self.pos + 1].1),
                    "here",
                )
                .with_help(format!("write `0.{digits}`"));
                self.diags.push(d);
                return Err(Recover);
            }
            _ => return Err(self.unexpected("expected an expression")),
        };
        Ok(Expr { kind, span })
    }

    /// Call arguments after `(`, up to and including `)`.
    fn args(&mut self) -> PResult<Vec<Arg>> {
        let open = self.prev_span();
        let mut args = Vec::new();
        while self.peek() != Token::RParen {
            // `dim` is a keyword only at the top level: `softmax(s, dim = -1)` names an argument.
            let name = if matches!(self.peek(), Token::Ident | Token::Dim) && self.peek_at(1) == Token::Assign {
                let n = Ident { name: self.text().to_string(), span: self.bump() };
                self.bump();
                Some(n)
            } else {
                None
            };
            let value = self.expr()?;
            args.push(Arg { name, value });
            if !self.eat(Token::Comma) {
                break;
            }
        }
        self.close(Token::RParen, open, "to close the argument list")?;
        Ok(args)
    }

    /// Index items after `[`, up to and including `]`.
    fn index_items(&mut self) -> PResult<Vec<IndexItem>> {
        let mut items = Vec::new();
        while self.peek() != Token::RBracket {
            let start = self.span();
            let lo = if self.peek() == Token::Colon { None } else { Some(self.expr()?) };
            let item = if self.eat(Token::Colon) {
                let hi = if matches!(self.peek(), Token::Comma | Token::RBracket | Token::Colon) { None } else { Some(self.expr()?) };
                let step = if self.eat(Token::Colon) { Some(self.expr()?) } else { None };
                IndexItem::Slice { lo, hi, step, span: start.to(self.prev_span()) }
            } else {
                match lo {
                    Some(e) => IndexItem::Expr(e),
                    None => return Err(self.unexpected("expected an index or a slice")),
                }
            };
            items.push(item);
            if !self.eat(Token::Comma) {
                break;
            }
        }
        self.require(Token::RBracket, "to close the index")?;
        Ok(items)
    }
}

const COMPARE: u8 = 2;

/// Binary operator and its precedence level (higher binds tighter).
fn binop(tok: Token) -> Option<(BinOp, u8)> {
    Some(match tok {
        Token::OrOr => (BinOp::Or, 0),
        Token::AndAnd => (BinOp::And, 1),
        Token::EqEq => (BinOp::Eq, COMPARE),
        Token::NotEq => (BinOp::Ne, COMPARE),
        Token::Lt => (BinOp::Lt, COMPARE),
        Token::Le => (BinOp::Le, COMPARE),
        Token::Gt => (BinOp::Gt, COMPARE),
        Token::Ge => (BinOp::Ge, COMPARE),
        Token::Plus => (BinOp::Add, 3),
        Token::Minus => (BinOp::Sub, 3),
        Token::Star => (BinOp::Mul, 4),
        Token::Slash => (BinOp::Div, 4),
        Token::Percent => (BinOp::Rem, 4),
        Token::At => (BinOp::MatMul, 4),
        _ => return None,
    })
}
