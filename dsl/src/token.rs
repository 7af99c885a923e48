//! The token enum, derived with logos. Bad input becomes [`Token::Error`], never a crash.

use crate::span::Span;
use logos::Logos;

/// One lexical token of the `.attn` language.
#[derive(Logos, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[logos(skip r"[ \t\r\n\f]+")]
#[logos(skip(r"(#|//)[^\n]*", allow_greedy = true))]
pub enum Token {
    /// `fn`
    #[token("fn")]
    Fn,
    /// `let`
    #[token("let")]
    Let,
    /// `return`
    #[token("return")]
    Return,
    /// `dim`
    #[token("dim")]
    Dim,
    /// `const`
    #[token("const")]
    Const,
    /// `true`
    #[token("true")]
    True,
    /// `false`
    #[token("false")]
    False,
    /// An identifier.
    #[regex(r"[A-Za-z_][A-Za-z0-9_]*")]
    Ident,
    /// An integer literal.
    #[regex(r"[0-9]+")]
    Int,
    /// A float literal (`1.5`, `1e-5`, `2.0e3`).
    #[regex(r"[0-9]+\.[0-9]+([eE][+-]?[0-9]+)?")]
    #[regex(r"[0-9]+[eE][+-]?[0-9]+")]
    Float,
    /// `(`
    #[token("(")]
    LParen,
    /// `)`
    #[token(")")]
    RParen,
    /// `[`
    #[token("[")]
    LBracket,
    /// `]`
    #[token("]")]
    RBracket,
    /// `{`
    #[token("{")]
    LBrace,
    /// `}`
    #[token("}")]
    RBrace,
    /// `,`
    #[token(",")]
    Comma,
    /// `:`
    #[token(":")]
    Colon,
    /// `;`
    #[token(";")]
    Semi,
    /// `.`
    #[token(".")]
    Dot,
    /// `->`
    #[token("->")]
    Arrow,
    /// `=`
    #[token("=")]
    Assign,
    /// `+`
    #[token("+")]
    Plus,
    /// `-`
    #[token("-")]
    Minus,
    /// `*`
    #[token("*")]
    Star,
    /// `**`
    #[token("**")]
    StarStar,
    /// `/`
    #[token("/")]
    Slash,
    /// `%`
    #[token("%")]
    Percent,
    /// `@`
    #[token("@")]
    At,
    /// `==`
    #[token("==")]
    EqEq,
    /// `!=`
    #[token("!=")]
    NotEq,
    /// `<`
    #[token("<")]
    Lt,
    /// `<=`
    #[token("<=")]
    Le,
    /// `>`
    #[token(">")]
    Gt,
    /// `>=`
    #[token(">=")]
    Ge,
    /// `&&` or `and`
    #[token("&&")]
    #[token("and")]
    AndAnd,
    /// `||` or `or`
    #[token("||")]
    #[token("or")]
    OrOr,
    /// `!` or `not`
    #[token("!")]
    #[token("not")]
    Bang,
    /// Anything the lexer does not recognise.
    Error,
    /// End of input (synthesised by [`lex`]).
    Eof,
}

impl Token {
    /// How the token is named in "expected ..." messages.
    pub fn describe(self) -> &'static str {
        match self {
            Token::Fn => "`fn`",
            Token::Let => "`let`",
            Token::Return => "`return`",
            Token::Dim => "`dim`",
            Token::Const => "`const`",
            Token::True => "`true`",
            Token::False => "`false`",
            Token::Ident => "a name",
            Token::Int => "an integer",
            Token::Float => "a number",
            Token::LParen => "`(`",
            Token::RParen => "`)`",
            Token::LBracket => "`[`",
            Token::RBracket => "`]`",
            Token::LBrace => "`{`",
            Token::RBrace => "`}`",
            Token::Comma => "`,`",
            Token::Colon => "`:`",
            Token::Semi => "`;`",
            Token::Dot => "`.`",
            Token::Arrow => "`->`",
            Token::Assign => "`=`",
            Token::Plus => "`+`",
            Token::Minus => "`-`",
            Token::Star => "`*`",
            Token::StarStar => "`**`",
            Token::Slash => "`/`",
            Token::Percent => "`%`",
            Token::At => "`@`",
            Token::EqEq => "`==`",
            Token::NotEq => "`!=`",
            Token::Lt => "`<`",
            Token::Le => "`<=`",
            Token::Gt => "`>`",
            Token::Ge => "`>=`",
            Token::AndAnd => "`&&`",
            Token::OrOr => "`||`",
            Token::Bang => "`!`",
            Token::Error => "an unknown character",
            Token::Eof => "end of file",
        }
    }
}

/// Lexes the whole source; the result always ends with [`Token::Eof`].
pub fn lex(source: &str) -> Vec<(Token, Span)> {
    let mut out: Vec<(Token, Span)> =
        Token::lexer(source).spanned().map(|(tok, range)| (tok.unwrap_or(Token::Error), Span::from(range))).collect();
    out.push((Token::Eof, Span::new(source.len(), source.len())));
    out
}
