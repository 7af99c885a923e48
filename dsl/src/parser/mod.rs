//! Recursive-descent parser with error recovery: returns the tree and every diagnostic found.
//!
//! One file per construct: [`items`] (functions, `dim`, `const`, types) and [`expr`]
//! (statements and expressions).

mod expr;
mod items;

use crate::ast::File;
use crate::diagnostic::Diagnostic;
use crate::span::Span;
use crate::token::{Token, lex};

/// Error codes of the parser (see `docs/diagnostics.md`).
pub mod codes {
    /// A character the language does not use.
    pub const UNKNOWN_CHAR: &str = "E0001";
    /// A token where another was expected.
    pub const UNEXPECTED: &str = "E0002";
    /// A number that does not fit.
    pub const BAD_NUMBER: &str = "E0003";
    /// Something other than a function, `dim` or `const` at top level.
    pub const BAD_ITEM: &str = "E0004";
    /// An expression nested deeper than `MAX_DEPTH` (256).
    pub const TOO_DEEP: &str = "E0005";
}

/// How deep an expression's tree may be (operators, calls, brackets, indexing, methods). Every
/// later pass that walks a tree recursively relies on this bound for its stack use.
pub const MAX_DEPTH: u32 = 256;

/// Parses a whole file. The tree is returned even when there are errors: parts that could not
/// be parsed are left out or replaced by [`crate::ast::ExprKind::Error`].
pub fn parse(source: &str) -> (File, Vec<Diagnostic>) {
    let mut p = Parser::new(source);
    let file = p.file();
    (file, p.diags)
}

pub(crate) struct Parser<'s> {
    src: &'s str,
    toks: Vec<(Token, Span)>,
    pos: usize,
    depth: u32,
    /// Where the lexer found characters it does not know; a parse error right after one is
    /// the same mistake and is not reported again.
    lex_errors: Vec<Span>,
    pub(crate) diags: Vec<Diagnostic>,
}

/// Raised to unwind to the nearest recovery point; the diagnostic is already recorded.
pub(crate) struct Recover;

pub(crate) type PResult<T> = Result<T, Recover>;

impl<'s> Parser<'s> {
    fn new(src: &'s str) -> Parser<'s> {
        let toks = lex(src);
        let mut diags = Vec::new();
        let mut lex_errors = Vec::new();
        let mut kept = Vec::with_capacity(toks.len());
        for (tok, span) in toks {
            if tok == Token::Error {
                diags.push(Diagnostic::error(
                    codes::UNKNOWN_CHAR,
                    format!("unknown character `{}`", &src[span.range()]),
                    span,
                    "not part of the language",
                ));
                lex_errors.push(span);
            } else {
                kept.push((tok, span));
            }
        }
        Parser { src, toks: kept, pos: 0, depth: 0, lex_errors, diags }
    }

    fn peek(&self) -> Token {
        self.toks[self.pos].0
    }

    fn peek_at(&self, n: usize) -> Token {
        self.toks.get(self.pos + n).map_or(Token::Eof, |t| t.0)
    }

    fn span(&self) -> Span {
        self.toks[self.pos].1
    }

    fn prev_span(&self) -> Span {
        if self.pos == 0 { self.span() } else { self.toks[self.pos - 1].1 }
    }

    fn text(&self) -> &'s str {
        &self.src[self.span().range()]
    }

    fn bump(&mut self) -> Span {
        let span = self.span();
        if self.peek() != Token::Eof {
            self.pos += 1;
        }
        span
    }

    fn eat(&mut self, tok: Token) -> bool {
        if self.peek() == tok {
            self.bump();
            true
        } else {
            false
        }
    }

    fn require(&mut self, tok: Token, context: &str) -> PResult<Span> {
        if self.peek() == tok { Ok(self.bump()) } else { Err(self.unexpected(&format!("expected {} {context}", tok.describe()))) }
    }

    /// [`Self::require`] for the bracket `tok` that closes the one at `open`. A missing one is
    /// reported with the opening bracket marked, and, when the next token is on a later line
    /// (the bracket was forgotten at a line's end), at the last token it should follow.
    fn close(&mut self, tok: Token, open: Span, context: &str) -> PResult<Span> {
        if self.peek() == tok {
            return Ok(self.bump());
        }
        let (prev, here) = (self.prev_span(), self.span());
        if self.lex_errors.iter().any(|e| e.start >= prev.end && e.end <= here.start) {
            return Err(Recover);
        }
        let found = if self.peek() == Token::Eof { "end of file".to_string() } else { format!("`{}`", self.text()) };
        let gap = self.src.get(prev.end as usize..here.start as usize).unwrap_or("");
        let (at, label) = if gap.contains('\n') || self.peek() == Token::Eof {
            (prev, format!("{} expected after this", tok.describe()))
        } else {
            (here, "unexpected here".to_string())
        };
        let opener = self.src.get(open.range()).unwrap_or("(");
        let d = Diagnostic::error(codes::UNEXPECTED, format!("expected {} {context}, found {found}", tok.describe()), at, label)
            .with_label(open, format!("this `{opener}` is not closed"));
        self.diags.push(d);
        Err(Recover)
    }

    /// Records "expected X, found Y" at the current token.
    fn unexpected(&mut self, expected: &str) -> Recover {
        let (lo, hi) = (self.prev_span().end, self.span().start);
        if self.lex_errors.iter().any(|e| e.start >= lo && e.end <= hi) {
            return Recover;
        }
        let found = self.peek();
        let found_text = if found == Token::Eof { "end of file".to_string() } else { format!("`{}`", self.text()) };
        let d = Diagnostic::error(codes::UNEXPECTED, format!("{expected}, found {found_text}"), self.span(), "unexpected here");
        self.diags.push(d);
        Recover
    }

    /// Skips tokens until one of `stops` (not consumed) or end of input.
    fn skip_until(&mut self, stops: &[Token]) {
        while self.peek() != Token::Eof && !stops.contains(&self.peek()) {
            self.bump();
        }
    }

    fn file(&mut self) -> File {
        let mut file = File::default();
        while self.peek() != Token::Eof {
            match self.item() {
                Ok(item) => file.items.push(item),
                Err(Recover) => self.skip_until(&[Token::Fn, Token::Dim, Token::Const]),
            }
        }
        file
    }
}
