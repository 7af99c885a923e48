//! `attnc`: the command line of the attnc compiler.
//!
//! ```text
//! attnc check FILE.attn                       type-check; diagnostics on stderr
//! attnc build FILE.attn --emit ast|ir|dot     print (or -o write) an intermediate form
//! attnc run FILE.attn [--input NAME=PATH]... [--random-inputs] [--dim NAME=N]... [--out-dir DIR]
//! ```
//!
//! Exit codes: 0 success; 1 the program has errors (diagnostics printed); 2 bad command line
//! (clap's errors, and entry/input/output/dim names that match nothing, missing inputs); 3 an
//! input or output file cannot be read, decoded or written; 4 run-time error (shape or dim
//! mismatch, unbound dim); 5 the target is not available in this build. Every failure prints
//! one `error: ...` line on stderr.

/// mimalloc instead of the system allocator: compiling a large program allocates millions of
/// small nodes, which glibc's allocator serves about 1.3× slower.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    attnc::cli::main()
}
