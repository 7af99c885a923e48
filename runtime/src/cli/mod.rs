//! The `attnc` command line: argument definitions (clap derive), dispatch, and the mapping of
//! every failure to one `error: ...` line and an exit code ([`Exit`]).

mod bench;
mod build;
mod run;

use attn_runtime::{CompileError, LoadError, Program};
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

/// Process exit codes (also listed in `attnc --help`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// The program has errors (diagnostics were printed).
    Program = 1,
    /// Bad command line: clap's own errors, and names that match nothing (entry, input, dim,
    /// output).
    Usage = 2,
    /// An input or output file could not be read, decoded or written.
    File = 3,
    /// The program failed while running (shapes or dims that do not fit, ...).
    Runtime = 4,
    /// The requested target is not available in this build.
    Target = 5,
}

/// A failure: the exit code and the one-sentence message printed as `error: ...`.
#[derive(Debug)]
pub struct Failure {
    /// How the process exits.
    pub exit: Exit,
    /// What went wrong.
    pub message: String,
}

impl Failure {
    /// A failure with the given exit code.
    pub fn new(exit: Exit, message: impl std::fmt::Display) -> Failure {
        Failure { exit, message: message.to_string() }
    }
}

const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  the program has errors (diagnostics are printed on stderr)
  2  bad command line (unknown option or value; an entry, input, output or dim name that does not exist; a missing input)
  3  an input or output file cannot be read, decoded or written (or holds the wrong dtype)
  4  run-time error (input shapes that do not fit the declared dims, an unbound dim, ...)
  5  the requested target is not available in this build";

const TOP_HELP: &str = "\
Examples:
  attnc check examples/causal.attn
  attnc build examples/causal.attn --emit ir
  attnc run examples/causal.attn --random-inputs --dim S=16 --out-dir out/
  attnc run examples/causal.attn --input q=q.npy --input k=k.npy --input v=v.npy

Exit codes:
  0  success
  1  the program has errors (diagnostics are printed on stderr)
  2  bad command line (unknown option or value; an entry, input, output or dim name that does not exist; a missing input)
  3  an input or output file cannot be read, decoded or written (or holds the wrong dtype)
  4  run-time error (input shapes that do not fit the declared dims, an unbound dim, ...)
  5  the requested target is not available in this build";

/// attnc: compile and run attention programs written in the .attn language.
#[derive(Debug, Parser)]
#[command(name = "attnc", version, after_help = TOP_HELP, propagate_version = true)]
pub struct Cli {
    /// When to colour diagnostics.
    #[arg(long, global = true, value_enum, default_value_t = ColorChoice::Auto)]
    pub color: ColorChoice,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// When to use colours.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ColorChoice {
    /// When stderr is a terminal and NO_COLOR is not set.
    Auto,
    /// Always.
    Always,
    /// Never.
    Never,
}

impl ColorChoice {
    fn enabled(self) -> bool {
        match self {
            ColorChoice::Always => true,
            ColorChoice::Never => false,
            ColorChoice::Auto => std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
        }
    }
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Parse and type-check a program; print diagnostics on error.
    #[command(after_help = EXIT_CODES)]
    Check(CheckArgs),
    /// Compile a program and print (or write) one of its intermediate forms.
    #[command(after_help = EXIT_CODES)]
    Build(build::BuildArgs),
    /// Explain what the optimizer does to a program: rules fired, attention fused or not and why,
    /// cost-model choices.
    #[command(after_help = EXIT_CODES)]
    Explain(ExplainArgs),
    /// Run an entry point on inputs from files or on seeded random inputs.
    #[command(long_about = run::LONG_ABOUT, after_help = EXIT_CODES)]
    Run(run::RunArgs),
    /// Time an entry point on random inputs: median time, GFLOP/s, fraction of FMA peak.
    #[command(after_help = EXIT_CODES)]
    Bench(bench::BenchArgs),
}

/// `attnc explain FILE [--timing]`
#[derive(Debug, Args)]
pub struct ExplainArgs {
    /// The .attn program.
    pub file: PathBuf,
    /// Also measure the optimizer: median wall time of 15 runs per function, and e-graph size.
    #[arg(long)]
    pub timing: bool,
}

/// `attnc check FILE`
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The .attn program.
    pub file: PathBuf,
}

/// Parses the command line, runs it, prints any error, and returns the exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let color = cli.color.enabled();
    let result = match &cli.command {
        Command::Check(args) => check(args, color),
        Command::Build(args) => build::build(args, color),
        Command::Explain(args) => explain(args, color),
        Command::Run(args) => run::run(args, color),
        Command::Bench(args) => bench::bench(args, color),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprint_line(&format!("error: {}", failure.message));
            ExitCode::from(failure.exit as u8)
        }
    }
}

fn check(args: &CheckArgs, color: bool) -> Result<(), Failure> {
    let program = load(&args.file, color)?;
    let n = program.entries().len();
    print_line(&format!("ok: {n} function{}", if n == 1 { "" } else { "s" }));
    Ok(())
}

fn explain(args: &ExplainArgs, color: bool) -> Result<(), Failure> {
    let program = load(&args.file, color)?;
    let compiler = attn_runtime::cpu::cpu_compiler();
    print_line(compiler.explain(program.compiled(), None).map_err(|e| Failure::new(Exit::Usage, e))?.trim_end_matches('\n'));
    if args.timing {
        for g in &program.module().graphs {
            let mut times = Vec::new();
            let mut report = None;
            for _ in 0..15 {
                let start = std::time::Instant::now();
                let o = compiler.optimize(g);
                times.push(start.elapsed());
                report = Some(o.report);
            }
            times.sort();
            let r = report.unwrap_or_default();
            print_line(&format!(
                "timing {}: median {:.2} ms over {} runs (min {:.2}, max {:.2}); e-graph {} nodes, {} classes",
                g.name,
                times[times.len() / 2].as_secs_f64() * 1e3,
                times.len(),
                times[0].as_secs_f64() * 1e3,
                times[times.len() - 1].as_secs_f64() * 1e3,
                r.egraph_nodes,
                r.egraph_classes
            ));
        }
    }
    Ok(())
}

/// Reads and compiles a program; on compile errors prints the rendered diagnostics first.
pub fn load(path: &std::path::Path, color: bool) -> Result<Program, Failure> {
    match Program::from_file(path) {
        Ok(p) => Ok(p),
        Err(LoadError::Unreadable { path, source }) => Err(Failure::new(Exit::File, format!("cannot read {}: {source}", path.display()))),
        Err(LoadError::Compile(err)) => Err(compile_failure(&err, color)),
    }
}

pub(crate) fn compile_failure(err: &CompileError, color: bool) -> Failure {
    let mut stderr = std::io::stderr().lock();
    // Ignore write errors: a closed stderr must not turn into a panic.
    let _ = write!(stderr, "{}", err.render(color));
    let n = err.diagnostics.len();
    Failure::new(Exit::Program, format!("{} has {n} error{}", err.file_name, if n == 1 { "" } else { "s" }))
}

/// Writes a line to stdout, ignoring a closed pipe (`attnc run ... | head` must not panic).
pub fn print_line(line: &str) {
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}

/// Writes a line to stderr, ignoring errors.
pub fn eprint_line(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}
