//! `attnc build`: print or write one intermediate form of a program.

use super::{Exit, Failure, load, print_line};
use attn_compiler::{PipelineError, Stage};
use attn_runtime::{CompileError, Program, RunError, Target};
use clap::{Args, ValueEnum};
use std::path::PathBuf;

/// `attnc build FILE --emit KIND [-o OUT] [--entry NAME] [--target cpu|cuda]`
///
/// `--emit svg` and `--emit svg-opt` draw one function's graph (before or after the optimizer)
/// as an SVG picture, laid out without Graphviz.
#[derive(Debug, Args)]
pub struct BuildArgs {
    /// The .attn program.
    pub file: PathBuf,
    /// What to produce.
    #[arg(long, value_enum, default_value_t = Emit::Ir)]
    pub emit: Emit,
    /// Write to this file instead of stdout.
    #[arg(short, long, value_name = "OUT")]
    pub output: Option<PathBuf>,
    /// Only this function (every form but `ast`; `dot`, `svg` and `svg-opt` default to the last
    /// function in the file, the others to every function).
    #[arg(long, value_name = "NAME")]
    pub entry: Option<String>,
    /// The target `--emit schedule` schedules for: cpu or cuda (`clif` is always cpu, `cuda`
    /// always cuda).
    #[arg(long, default_value = "cpu", value_name = "TARGET")]
    pub target: String,
    /// Gradients (`--grad [--wrt a,b]`): emit the entry's derived program.
    #[command(flatten)]
    pub grad: super::GradArgs,
}

/// The forms `attnc build` can emit: one per stage of the pipeline (parse, lower, optimize,
/// schedule, render), plus a picture of the graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Emit {
    /// The syntax tree, printed back as fully parenthesised source (always the whole file).
    Ast,
    /// The graph IR in its canonical text form.
    Ir,
    /// The optimised IR (softmax/matmul chains fused into flash ops), with each flash op's
    /// block classification as comments.
    Opt,
    /// The schedule of the optimised IR for --target: buffers, views, steps, kernel variants,
    /// the flash ops' analyses, and the integer table generated code reads.
    Schedule,
    /// One function's IR graph in Graphviz dot format.
    Dot,
    /// One function's IR graph as an SVG picture (laid out here, no Graphviz needed): a box per
    /// value, edges labelled with the type they carry.
    Svg,
    /// One function's optimised IR graph as an SVG picture, fused flash ops highlighted with
    /// their score and mask.
    SvgOpt,
    /// The Cranelift IR the cpu target renders from its schedule, each function headed by its
    /// integer table.
    Clif,
    /// The CUDA C++ source the cuda target renders from its schedule and compiles with NVRTC.
    Cuda,
}

/// Runs `attnc build`.
pub fn build(args: &BuildArgs, ui: super::Ui) -> Result<(), Failure> {
    if args.grad.grad && args.emit == Emit::Ast {
        return Err(Failure::new(Exit::Usage, "--grad has no AST form: the derived program exists from the IR on (try --emit ir)"));
    }
    let (program, entry) = args.grad.apply(load(&args.file, ui)?, args.entry.as_deref())?;
    let text = emit(&program, args, entry.as_deref(), ui.color)?;
    match &args.output {
        Some(path) if attn_runtime::io::same_file(path, &args.file) => {
            Err(Failure::new(Exit::Usage, format!("-o {} is the program being built; refusing to overwrite it", path.display())))
        }
        Some(path) => attn_runtime::io::write_atomic(path, text.as_bytes())
            .map_err(|e| Failure::new(Exit::File, format!("cannot write {}: {e}", path.display()))),
        None => {
            print_line(text.trim_end_matches('\n'));
            Ok(())
        }
    }
}

/// The text of one form.
fn emit(program: &Program, args: &BuildArgs, entry: Option<&str>, color: bool) -> Result<String, Failure> {
    let stage = match args.emit {
        Emit::Ast if entry.is_some() => {
            return Err(Failure::new(Exit::Usage, "--entry cannot be used with --emit ast: the AST is always the whole file"));
        }
        Emit::Dot | Emit::Svg | Emit::SvgOpt => {
            let name = match entry {
                Some(name) => name.to_string(),
                None => program.default_entry().map(|e| e.name).ok_or_else(|| Failure::new(Exit::Program, RunError::NoEntry))?,
            };
            let graph = program.graph(&name).map_err(|e| Failure::new(Exit::Usage, e))?;
            return match args.emit {
                Emit::Svg => svg(graph, &format!("{name}: IR graph")),
                Emit::SvgOpt => {
                    let optimized = attn_runtime::cpu::cpu_compiler().optimize(graph);
                    svg(&optimized.graph, &format!("{name}: optimised IR graph (flash ops in orange)"))
                }
                _ => Ok(attn_compiler::ir::to_dot(graph)),
            };
        }
        Emit::Ast => Stage::Ast,
        Emit::Ir => Stage::Ir,
        Emit::Opt => Stage::Opt,
        Emit::Schedule => Stage::Schedule,
        Emit::Clif => Stage::Clif,
        Emit::Cuda => Stage::Cuda,
    };
    let target: Target = args.target.parse().map_err(|e| Failure::new(Exit::Usage, e))?;
    let compiler = attn_runtime::compiler(match target {
        Target::Cuda => attn_compiler::schedule::Target::Cuda,
        Target::Cpu => attn_compiler::schedule::Target::Cpu,
        other => return Err(Failure::new(Exit::Usage, format!("--target {other} has no schedule (use cpu or cuda)"))),
    });
    compiler.emit(program.checked(), stage, entry).map_err(|e| match e {
        PipelineError::UnknownEntry { .. } => Failure::new(Exit::Usage, e),
        e => super::compile_failure(
            &CompileError {
                diagnostics: vec![e.diagnostic()],
                source_text: program.source().to_string(),
                file_name: program.file_name().to_string(),
            },
            color,
        ),
    })
}

/// The SVG picture of one graph; a graph too large to lay out is a usage error (dot still works).
fn svg(graph: &attn_compiler::ir::Graph, title: &str) -> Result<String, Failure> {
    crate::pictures::svg::graph_svg(graph, title).map_err(|e| Failure::new(Exit::Usage, e))
}
