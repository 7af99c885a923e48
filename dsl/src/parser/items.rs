//! Top-level items: functions, `dim` and `const` definitions, and tensor types.

use super::{PResult, Parser, Recover, codes};
use crate::ast::{ConstDef, FnDef, Ident, Item, Param, Ret, Stmt, TypeExpr};
use crate::diagnostic::Diagnostic;
use crate::token::Token;

impl Parser<'_> {
    pub(super) fn item(&mut self) -> PResult<Item> {
        match self.peek() {
            Token::Fn => self.fn_def().map(Item::Fn),
            Token::Dim => self.const_def().map(Item::Dim),
            Token::Const => self.const_def().map(Item::Const),
            _ => {
                let d = Diagnostic::error(
                    codes::BAD_ITEM,
                    format!("expected `fn`, `dim` or `const` at top level, found `{}`", self.text()),
                    self.span(),
                    "not a definition",
                )
                .with_help("a file is a list of `fn name(...) -> ... { ... }`, `dim NAME = N` and `const NAME = value`");
                self.diags.push(d);
                self.bump();
                Err(Recover)
            }
        }
    }

    pub(super) fn ident(&mut self, context: &str) -> PResult<Ident> {
        if self.peek() == Token::Ident {
            let name = self.text().to_string();
            let span = self.bump();
            Ok(Ident { name, span })
        } else {
            Err(self.unexpected(&format!("expected a name {context}")))
        }
    }

    fn const_def(&mut self) -> PResult<ConstDef> {
        let start = self.bump();
        let name = self.ident("after `dim`/`const`")?;
        self.require(Token::Assign, "after the name")?;
        let value = self.expr()?;
        self.eat(Token::Semi);
        Ok(ConstDef { span: start.to(value.span), name, value })
    }

    fn fn_def(&mut self) -> PResult<FnDef> {
        let start = self.bump();
        let name = self.ident("after `fn`")?;
        self.require(Token::LParen, "to start the parameter list")?;
        let params = self.params(Token::RParen)?;
        self.require(Token::Arrow, "and a result type after the parameters")?;
        let ret = if self.eat(Token::LParen) { Ret::Named(self.params(Token::RParen)?) } else { Ret::Single(self.type_expr()?) };
        self.require(Token::LBrace, "to start the function body")?;
        let body = self.block();
        let end = self.prev_span();
        Ok(FnDef { name, params, ret, body, span: start.to(end) })
    }

    /// `name: type, ...` up to and including `close`.
    fn params(&mut self, close: Token) -> PResult<Vec<Param>> {
        let mut params = Vec::new();
        while self.peek() != close {
            let name = self.ident("for a parameter")?;
            self.require(Token::Colon, "between a parameter's name and its type")?;
            let ty = self.type_expr()?;
            params.push(Param { name, ty });
            if !self.eat(Token::Comma) {
                break;
            }
        }
        self.require(close, "to close the list")?;
        Ok(params)
    }

    /// `f32[B, S, D]`; a bare dtype (`f32`) is a scalar.
    pub(super) fn type_expr(&mut self) -> PResult<TypeExpr> {
        let dtype = self.ident("for a dtype (f32, f16, bf16, i32, bool)")?;
        let mut dims = Vec::new();
        let mut span = dtype.span;
        if self.eat(Token::LBracket) {
            while self.peek() != Token::RBracket {
                dims.push(self.expr()?);
                if !self.eat(Token::Comma) {
                    break;
                }
            }
            span = span.to(self.require(Token::RBracket, "to close the shape")?);
        }
        Ok(TypeExpr { dtype, dims, span })
    }

    /// Statements up to and including `}`; recovers at statement boundaries.
    fn block(&mut self) -> Vec<Stmt> {
        let mut body = Vec::new();
        loop {
            match self.peek() {
                Token::RBrace => {
                    self.bump();
                    break;
                }
                Token::Eof => {
                    let _ = self.unexpected("expected `}` to close the function body");
                    break;
                }
                Token::Fn | Token::Const => {
                    let _ = self.unexpected("expected `}` to close the function body");
                    break;
                }
                Token::Dim if self.peek_at(1) == Token::Ident => {
                    let _ = self.unexpected("expected `}` to close the function body");
                    break;
                }
                _ => match self.stmt() {
                    Ok(s) => body.push(s),
                    Err(Recover) => {
                        if !matches!(self.peek(), Token::RBrace | Token::Fn | Token::Dim | Token::Const | Token::Let | Token::Return) {
                            self.bump();
                        }
                        self.skip_until(&[Token::Let, Token::Return, Token::RBrace, Token::Fn, Token::Const]);
                    }
                },
            }
        }
        body
    }
}
