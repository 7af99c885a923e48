//! The front end and type checker return (errors allowed) on any input: never a panic, never a
//! hang.

use attn_dsl::token::Token;
use proptest::prelude::*;

/// Fragments that make token soups close to real programs.
const WORDS: &[&str] = &[
    "fn",
    "let",
    "return",
    "dim",
    "const",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    ",",
    ":",
    ";",
    ".",
    "->",
    "=",
    "+",
    "-",
    "*",
    "**",
    "/",
    "%",
    "@",
    "==",
    "<",
    "<=",
    "&&",
    "||",
    "!",
    "q",
    "k",
    "v",
    "s",
    "B",
    "S",
    "D",
    "f32",
    "f16",
    "i32",
    "bool",
    "softmax",
    "where",
    "indices",
    "reshape",
    "split_heads",
    "sum",
    "axis",
    "1",
    "0",
    "-1",
    "2.5",
    "1e-5",
    "inf",
    "T",
    "#c\n",
    "\n",
];

fn check(source: &str) {
    let (_, _) = attn_dsl::parse(source);
    let _ = attn_compiler::compile(source);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        check(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn token_soup_never_panics(words in proptest::collection::vec(proptest::sample::select(WORDS), 0..80)) {
        check(&words.join(" "));
    }

    #[test]
    fn mutated_examples_never_panic(which in 0usize..21, cut in 0usize..2000, insert in proptest::sample::select(WORDS)) {
        let files = attn_tests::attn_files(&attn_tests::repo_root().join("examples"));
        let source = std::fs::read_to_string(&files[which % files.len()]).unwrap_or_default();
        let mut at = cut.min(source.len());
        while !source.is_char_boundary(at) { at -= 1; }
        check(&format!("{}{insert}{}", &source[..at], &source[at..]));
    }
}

/// Deep nesting is an error, not a stack overflow.
#[test]
fn deep_nesting_is_an_error() {
    let source = format!("fn f(x: f32[N]) -> f32[N] {{ return {}x{} }}", "(".repeat(5000), ")".repeat(5000));
    assert!(attn_compiler::compile(&source).is_err());
    let source = format!("fn f(x: f32[N]) -> f32[N] {{ return {}x }}", "-".repeat(5000));
    assert!(attn_compiler::compile(&source).is_err());
}

/// The lexer maps unknown characters to error tokens.
#[test]
fn unknown_characters_are_error_tokens() {
    let toks = attn_dsl::token::lex("let $ = ¤");
    assert!(toks.iter().filter(|(t, _)| *t == Token::Error).count() == 2);
}
