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
    let _ = attn_compiler::check(source);
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

/// The diagnostic codes `check` gives for `source` (which must fail).
fn error_codes(source: &str) -> Vec<&'static str> {
    match attn_compiler::check(source) {
        Ok(_) => panic!("accepted: {}…", &source[..source.len().min(120)]),
        Err(diags) => diags.iter().map(|d| d.code).collect(),
    }
}

/// Deep nesting is a diagnostic (E0005), not a stack overflow: brackets, prefix operators, and
/// the long chains that parse in a loop but build a tree as deep as they are long (issue 13's
/// reproducers: `x ** x ** …`, `x + x + …`, `.exp().exp()…`, and a dim `S + S + …`).
#[test]
fn deep_nesting_is_an_error() {
    let body = |e: String| format!("fn f(x: f32[N]) -> f32[N] {{ return {e}; }}");
    let cases = [
        ("brackets", body(format!("{}x{}", "(".repeat(5000), ")".repeat(5000)))),
        ("prefix minus", body(format!("{}x", "-".repeat(5000)))),
        ("power chain", body(vec!["x"; 5700].join(" ** "))),
        ("sum chain", body(vec!["x"; 5700].join(" + "))),
        ("method chain", body(format!("x{}", ".exp()".repeat(3500)))),
        ("dim chain", format!("fn f(x: f32[{}]) -> f32[N] {{ return x; }}", vec!["S"; 12900].join(" + "))),
    ];
    for (what, source) in cases {
        // The limit is promised on a main thread's default 8 MiB stack (test threads get 2 MiB).
        let checked = std::thread::Builder::new().stack_size(8 << 20).spawn(move || {
            let start = std::time::Instant::now();
            (error_codes(&source), start.elapsed())
        });
        let (codes, took) = checked.expect("spawns").join().expect("does not crash");
        assert!(codes.contains(&"E0005"), "{what}: {codes:?}");
        assert!(took.as_secs_f64() < 5.0, "{what}: took {took:?}");
    }
}

/// Chains up to the limit are accepted and go through the whole pipeline (their trees are 256
/// levels deep: every recursive pass must fit the stack of a test thread).
#[test]
fn long_chains_below_the_limit_compile() {
    let chain = vec!["x"; 250].join(" + ");
    let source = format!("fn f(x: f32[N]) -> f32[N] {{ return {chain}; }}");
    let checked = attn_compiler::check(&source).unwrap_or_else(|d| panic!("{}", d[0]));
    let compiler = attn_compiler::Compiler::default();
    compiler.plan(&checked.module.graphs[0]).expect("plans");
}

/// The lexer maps unknown characters to error tokens.
#[test]
fn unknown_characters_are_error_tokens() {
    let toks = attn_dsl::token::lex("let $ = ¤");
    assert!(toks.iter().filter(|(t, _)| *t == Token::Error).count() == 2);
}

/// A long chain of lets compiles through every stage with no recursion as deep as the chain
/// (issue 13: 10k lets took 243 s and overflowed the stack in scheduling): the element-wise
/// chain is cut into kernels of at most `MAX_INLINE_DEPTH` ops, on a test thread's 2 MiB stack.
#[test]
fn a_long_let_chain_compiles_in_linear_time() {
    let mut source = String::from("fn chain(x: f32[S, D]) -> f32[S, D] {\n");
    let mut prev = "x".to_string();
    for i in 0..3000 {
        source.push_str(&format!("    let t{i} = {prev} * 0.5 + x\n"));
        prev = format!("t{i}");
    }
    source.push_str(&format!("    return {prev}\n}}\n"));
    let checked = attn_compiler::check(&source).unwrap_or_else(|d| panic!("{}", d[0]));
    let compiler = attn_compiler::Compiler::default();
    let planned = compiler.plan(&checked.module.graphs[0]).expect("plans");
    assert_eq!(planned.optimized.report.stop_reason, "saturated");
    let kernels = planned.schedule.steps.len();
    assert!(kernels >= 6000 / attn_compiler::schedule::MAX_INLINE_DEPTH, "{kernels} kernels");
    attn_runtime::cpu::render::render(&planned.schedule, &attn_runtime::cpu::TEXT_FEATURES).expect("renders");
}

/// A function too large to compile is a diagnostic (E0118), not an out-of-memory abort:
/// here calls inlined 8⁶ times over.
#[test]
fn a_program_too_large_is_an_error() {
    let mut source = String::from("fn f0(x: f32[N]) -> f32[N] { return x * 2.0 + 1.0 }\n");
    for level in 1..=6 {
        let calls: Vec<String> = (0..8).map(|_| format!("f{}(x)", level - 1)).collect();
        source.push_str(&format!("fn f{level}(x: f32[N]) -> f32[N] {{ return {} }}\n", calls.join(" + ")));
    }
    let start = std::time::Instant::now();
    let codes = error_codes(&source);
    assert!(codes.contains(&"E0118"), "{codes:?}");
    assert!(start.elapsed().as_secs_f64() < 60.0, "took {:?}", start.elapsed());
}
