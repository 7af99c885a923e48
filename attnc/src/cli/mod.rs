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

/// The exit codes' help text, as a literal both help texts below are built from.
macro_rules! exit_codes {
    () => {
        "\
Exit codes:
  0  success
  1  the program has errors (diagnostics are printed on stderr)
  2  bad command line (unknown option or value; an entry, input, output or dim name that does not exist; a missing input)
  3  an input or output file cannot be read, decoded or written (or holds the wrong dtype)
  4  run-time error (input shapes that do not fit the declared dims, an unbound dim, ...)
  5  the requested target is not available in this build"
    };
}

const EXIT_CODES: &str = exit_codes!();

const TOP_HELP: &str = concat!(
    "\
Examples:
  attnc check examples/causal.attn
  attnc build examples/causal.attn --emit ir
  attnc run examples/causal.attn --random-inputs --dim S=16 --out-dir out/
  attnc run examples/causal.attn --input q=q.npy --input k=k.npy --input v=v.npy

",
    exit_codes!()
);

/// attnc: compile and run attention programs written in the .attn language.
#[derive(Debug, Parser)]
#[command(name = "attnc", version, after_help = TOP_HELP, propagate_version = true)]
pub struct Cli {
    /// When to colour diagnostics.
    #[arg(long, global = true, value_enum, default_value_t = ColorChoice::Auto)]
    pub color: ColorChoice,
    /// Treat warnings (W codes: unused names, names shadowing built-ins) as errors: exit 1.
    #[arg(long, global = true)]
    pub deny_warnings: bool,
    /// Print on stderr how long each compile stage takes for every function (check, optimize
    /// with the e-graph's stop reason and size, schedule, render and load for the CPU). Compiles
    /// each function once more to time it.
    #[arg(long, global = true)]
    pub timings: bool,
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
    /// Check a program (parse, lower with type and shape checking, verify); print diagnostics on error.
    #[command(after_help = EXIT_CODES)]
    Check(CheckArgs),
    /// Compile a program and print (or write) one of its intermediate forms, or a picture of its graph.
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

/// `attnc explain FILE [--entry NAME] [--grad [--wrt a,b]] [--dim NAME=N …] [--tile-size MxN] [--tiles OUT.png] [--timing]`
#[derive(Debug, Args)]
pub struct ExplainArgs {
    /// The .attn program.
    pub file: PathBuf,
    /// Only this function (default: every function in the file).
    #[arg(long, value_name = "NAME")]
    pub entry: Option<String>,
    /// Gradients (`--grad [--wrt a,b]`): explain the entry's derived program, and say which
    /// attention's backward pass is fused (and why not where it is not).
    #[command(flatten)]
    pub grad: GradArgs,
    /// The size of a dim for the tile maps (others take representative sizes: 1024 for S, N,
    /// M, T, L; 8 for H, G; 2 for B; 64 for the rest). A name the entry does not use (without
    /// --entry: that no function uses) is an error, as for `run`. Repeatable.
    #[arg(long = "dim", value_name = "NAME=N", value_parser = run::parse_dim)]
    pub dims: Vec<(String, i64)>,
    /// Tile size of the maps: query rows x keys.
    #[arg(long, value_name = "MxN", default_value = "64x64", value_parser = parse_tile_size)]
    pub tile_size: (i64, i64),
    /// Also draw every flash op's tile map (full, partial and skipped tiles) into this PNG.
    #[arg(long, value_name = "OUT.png")]
    pub tiles: Option<PathBuf>,
    /// Classify the tiles of masks that read tensors (segment ids, padding) from this input
    /// data: NAME=PATH or PATH.safetensors, as for `run`. Needs one entry (--entry or the last
    /// function). Repeatable.
    #[arg(long = "input", value_name = "[NAME=]PATH", value_parser = run::parse_named_path)]
    pub inputs: Vec<run::NamedPath>,
    /// Like --input, with seeded random inputs for the parameters no --input gives (i32 inputs
    /// are sorted segment ids, so a document mask shows its documents).
    #[arg(long)]
    pub random_inputs: bool,
    /// Seed for --random-inputs.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub seed: u64,
    /// Also measure the optimizer: median wall time of 15 runs per function, and e-graph size.
    #[arg(long)]
    pub timing: bool,
}

/// Parses `MxN` (e.g. `64x64`), each side 1 to 65536.
fn parse_tile_size(s: &str) -> Result<(i64, i64), String> {
    let (m, n) = s.split_once(['x', 'X']).ok_or("expected MxN, e.g. 64x64")?;
    let side = |t: &str| -> Result<i64, String> {
        let v: i64 = t.trim().parse().map_err(|_| format!("`{t}` is not a tile side"))?;
        if !(1..=65536).contains(&v) {
            return Err(format!("a tile side must be 1 to 65536, not {v}"));
        }
        Ok(v)
    };
    Ok((side(m)?, side(n)?))
}

/// `attnc check FILE`
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The .attn program.
    pub file: PathBuf,
}

/// The options every subcommand shares.
#[derive(Clone, Copy, Debug)]
pub struct Ui {
    /// Colour diagnostics.
    pub color: bool,
    /// Warnings fail the command (exit 1).
    pub deny_warnings: bool,
    /// Print compile-stage timings on stderr.
    pub timings: bool,
}

/// Parses the command line, runs it, prints any error, and returns the exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let ui = Ui { color: cli.color.enabled(), deny_warnings: cli.deny_warnings, timings: cli.timings };
    let result = match &cli.command {
        Command::Check(args) => check(args, ui),
        Command::Build(args) => build::build(args, ui),
        Command::Explain(args) => explain(args, ui),
        Command::Run(args) => run::run(args, ui),
        Command::Bench(args) => bench::bench(args, ui),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprint_line(&format!("error: {}", failure.message));
            ExitCode::from(failure.exit as u8)
        }
    }
}

fn check(args: &CheckArgs, ui: Ui) -> Result<(), Failure> {
    let program = load(&args.file, ui)?;
    let n = program.entries().len();
    print_line(&format!("ok: {n} function{}", if n == 1 { "" } else { "s" }));
    Ok(())
}

fn explain(args: &ExplainArgs, ui: Ui) -> Result<(), Failure> {
    if let Some(path) = &args.tiles {
        run::check_writable(path)?;
        if attn_runtime::io::same_file(path, &args.file) {
            return Err(Failure::new(Exit::Usage, format!("--tiles {} is the program; refusing to overwrite it", path.display())));
        }
    }
    let (program, grad_entry) = args.grad.apply(load(&args.file, ui)?, args.entry.as_deref())?;
    if let Some(backward) = program.backward() {
        print_line(&backward_summary(grad_entry.as_deref().unwrap_or("?"), backward));
    }
    let compiler = attn_runtime::cpu::cpu_compiler();
    let entry = grad_entry.as_deref();
    let mut dims = run::given_dims(&args.dims)?;
    // As `run` does: a dim the program does not use is a mistake, not something to ignore.
    program.check_given_dims(entry, &dims).map_err(run::run_failure)?;
    let data = if args.random_inputs || !args.inputs.is_empty() {
        let info = match entry {
            Some(name) => program.entry(name).map_err(run::run_failure)?,
            None => program.default_entry().ok_or_else(|| run::run_failure(attn_runtime::RunError::NoEntry))?,
        };
        let (inputs, bound) = run::gather_inputs(&program, &info, &args.inputs, args.random_inputs.then_some(args.seed), dims)?;
        dims = bound;
        Some((info, inputs))
    } else {
        None
    };
    let data_entry = data.as_ref().map(|(info, _)| info.name.clone());
    let entry = data_entry.as_deref().or(entry);
    let mut explained = compiler.explain_at(program.checked(), entry, &dims, args.tile_size).map_err(|e| match e {
        attn_compiler::PipelineError::UnknownEntry { .. } => Failure::new(Exit::Usage, e),
        e => Failure::new(Exit::Usage, format!("{e} [{}]", e.diagnostic().code)),
    })?;
    if let (Some((info, inputs)), Some(explanation)) = (data, explained.first_mut()) {
        data_tile_maps(&info, inputs, &dims, args.tile_size, explanation)?;
    }
    let text: Vec<String> = explained.iter().map(ToString::to_string).collect();
    print_line(text.join("\n").trim_end_matches('\n'));
    if let Some(path) = &args.tiles {
        let maps: Vec<(&str, &attn_compiler::ir::FlashTileMap)> =
            explained.iter().flat_map(|e| e.tile_maps.iter().map(|m| (e.report.graph.as_str(), m))).collect();
        let picture = crate::pictures::tile_map::tile_map_png(&maps).map_err(|e| Failure::new(Exit::Usage, e))?;
        attn_runtime::io::write_atomic(path, &picture.png)
            .map_err(|e| Failure::new(Exit::File, format!("cannot write {}: {e}", path.display())))?;
        print_line(&format!("wrote {} ({} tile map{})", path.display(), maps.len(), if maps.len() == 1 { "" } else { "s" }));
    }
    if args.timing {
        for g in program.module().graphs.iter().filter(|g| entry.is_none_or(|e| g.name == e)) {
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

/// What `explain --grad` says first: how the derived program's backward pass was built.
fn backward_summary(entry: &str, backward: &Result<Vec<String>, String>) -> String {
    match backward {
        Ok(lines) if lines.is_empty() => {
            format!("backward of `{entry}`: no attention was fused in the forward pass, so every op is differentiated by its own rule")
        }
        Ok(lines) => {
            let flash = lines.iter().filter(|l| l.starts_with("flash backward")).count();
            let mut out = if flash == 0 {
                format!("backward of `{entry}`: fused")
            } else {
                format!(
                    "backward of `{entry}`: fused ({flash} flash backward{}; each recomputes the weights tile by tile from q, k and the log-sum-exp the forward saves: no score-sized buffer)",
                    if flash == 1 { "" } else { "s" }
                )
            };
            for l in lines {
                out.push_str(&format!("\n  {l}"));
            }
            out
        }
        Err(reason) => format!(
            "backward of `{entry}`: not fused: {reason}\n  every op is differentiated by its own rule (the scores are materialised)"
        ),
    }
}

/// Replaces the explanation's compile-time tile maps by ones classified from input data.
fn data_tile_maps(
    info: &attn_runtime::EntryInfo,
    mut inputs: Vec<(String, attn_runtime::Tensor)>,
    dims: &std::collections::HashMap<String, i64>,
    tile: (i64, i64),
    explanation: &mut attn_compiler::Explanation,
) -> Result<(), Failure> {
    let mut ordered = Vec::with_capacity(info.params.len());
    for (name, _) in &info.params {
        let Some(k) = inputs.iter().position(|(n, _)| n == name) else {
            return Err(Failure::new(Exit::Usage, format!("missing input `{name}`; pass --input {name}=PATH or --random-inputs")));
        };
        ordered.push(inputs.swap_remove(k).1);
    }
    let grids =
        attn_compiler::interp::data_tile_grids(&explanation.graph, &ordered, dims, tile).map_err(|e| Failure::new(Exit::Runtime, e))?;
    for map in &mut explanation.tile_maps {
        if let Some((_, grid)) = grids.iter().find(|(v, _)| *v == map.value) {
            map.grid = grid.clone();
            map.from_data = true;
        }
    }
    Ok(())
}

/// `--grad [--wrt a,b]`: run, build or bench the entry's derived program (its results and
/// gradients) instead of the entry.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct GradArgs {
    /// Use the entry with its gradients: inputs are the entry's plus a cotangent `d_<result>`
    /// for each float result; outputs are the results plus `d_<param>` for each float
    /// parameter (see docs/language.md, "Differentiation").
    #[arg(long)]
    pub grad: bool,
    /// With --grad: only these parameters' gradients (comma-separated).
    #[arg(long, value_name = "NAME,...", value_delimiter = ',', requires = "grad")]
    pub wrt: Vec<String>,
}

impl GradArgs {
    /// `program` and `entry` as given, or with `--grad` the derived program and its entry
    /// (`<entry>_grad`).
    pub fn apply(&self, program: Program, entry: Option<&str>) -> Result<(Program, Option<String>), Failure> {
        if !self.grad {
            return Ok((program, entry.map(str::to_string)));
        }
        let name = match entry {
            Some(name) => name.to_string(),
            None => program.default_entry().map(|e| e.name).ok_or_else(|| run::run_failure(attn_runtime::RunError::NoEntry))?,
        };
        let wrt = (!self.wrt.is_empty()).then_some(self.wrt.as_slice());
        let derived = program.grad(&name, wrt).map_err(|e| match e {
            attn_runtime::RunError::Grad(attn_compiler::ir::grad::GradError::Wrt { .. }) | attn_runtime::RunError::UnknownEntry { .. } => {
                Failure::new(Exit::Usage, e)
            }
            e => Failure::new(Exit::Program, e),
        })?;
        Ok((derived, Some(format!("{name}_grad"))))
    }
}

/// Reads and checks a program. On errors prints the rendered diagnostics first; prints its
/// warnings (failing under `--deny-warnings`), and the compile-stage timings under `--timings`.
pub fn load(path: &std::path::Path, ui: Ui) -> Result<Program, Failure> {
    let start = std::time::Instant::now();
    let program = match Program::from_file(path) {
        Ok(p) => p,
        Err(LoadError::Unreadable { path, source }) => {
            return Err(Failure::new(Exit::File, format!("cannot read {}: {source}", path.display())));
        }
        Err(LoadError::Compile(err)) => return Err(compile_failure(&err, ui.color)),
    };
    let check_time = start.elapsed();
    let warnings = program.warnings();
    if !warnings.is_empty() {
        let _ = write!(std::io::stderr().lock(), "{}", program.render_warnings(ui.color));
        if ui.deny_warnings {
            let n = warnings.len();
            let s = if n == 1 { "" } else { "s" };
            return Err(Failure::new(Exit::Program, format!("{} has {n} warning{s}, and --deny-warnings is set", program.file_name())));
        }
    }
    if ui.timings {
        stage_timings(&program, check_time);
    }
    Ok(program)
}

/// `--timings`: each stage of each function, compiled once more for the CPU, on stderr.
fn stage_timings(program: &Program, check_time: std::time::Duration) {
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    eprint_line(&format!("timings: check {:.1} ms (parse, lower, verify; every function)", ms(check_time)));
    let compiler = attn_runtime::cpu::cpu_compiler();
    for g in &program.module().graphs {
        let planned = match compiler.plan(g) {
            Ok(planned) => planned,
            Err(e) => {
                eprint_line(&format!("timings {}: planning failed: {e}", g.name));
                continue;
            }
        };
        let r = &planned.optimized.report;
        let mut line = format!(
            "timings {}: optimize {:.1} ms ({} iterations, stopped: {}; e-graph {} nodes in {} classes), schedule {:.1} ms",
            g.name,
            ms(r.elapsed),
            r.iterations,
            r.stop_reason,
            r.egraph_nodes,
            r.egraph_classes,
            ms(planned.schedule_time)
        );
        let start = std::time::Instant::now();
        match attn_runtime::cpu::CpuProgram::from_planned(&compiler, planned, &attn_runtime::cpu::CpuOptions::default(), start) {
            Ok(_) => line.push_str(&format!(", render and load (cpu) {:.1} ms", ms(start.elapsed()))),
            Err(e) => line.push_str(&format!(", render failed: {e}")),
        }
        eprint_line(&line);
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
