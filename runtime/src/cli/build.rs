//! `attnc build`: print or write one intermediate form of a program.

use super::{Exit, Failure, load, print_line};
use attn_runtime::{Program, RunError};
use clap::{Args, ValueEnum};
use std::path::PathBuf;

/// `attnc build FILE --emit KIND [-o OUT] [--entry NAME]`
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
    /// Only this function (for `ir` and `dot`; `dot` defaults to the last function in the file).
    #[arg(long, value_name = "NAME")]
    pub entry: Option<String>,
}

/// The forms `attnc build` can emit. Later stages (optimised IR, Cranelift IR, CUDA source) are
/// new variants here plus an arm in [`emit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Emit {
    /// The syntax tree, printed back as fully parenthesised source (always the whole file).
    Ast,
    /// The graph IR in its canonical text form (every function, or the --entry one).
    Ir,
    /// The optimised IR (softmax/matmul chains fused into flash ops), with each flash op's
    /// block classification as comments.
    Opt,
    /// One function's IR graph in Graphviz dot format.
    Dot,
    /// The Cranelift IR the cpu target generates (every function, or the --entry one), each
    /// graph headed by its execution plan.
    Clif,
    /// The CUDA C++ source the cuda target compiles with NVRTC (every function, or the --entry
    /// one), from the optimised IR.
    Cuda,
}

/// Runs `attnc build`.
pub fn build(args: &BuildArgs, color: bool) -> Result<(), Failure> {
    let program = load(&args.file, color)?;
    let text = emit(&program, args.emit, args.entry.as_deref())?;
    match &args.output {
        Some(path) => std::fs::write(path, text).map_err(|e| Failure::new(Exit::File, format!("cannot write {}: {e}", path.display()))),
        None => {
            print_line(text.trim_end_matches('\n'));
            Ok(())
        }
    }
}

/// The text of one form.
fn emit(program: &Program, kind: Emit, entry: Option<&str>) -> Result<String, Failure> {
    let graph = |name: &str| program.graph(name).map_err(|e: RunError| Failure::new(Exit::Usage, e));
    Ok(match kind {
        Emit::Ast => {
            if entry.is_some() {
                return Err(Failure::new(Exit::Usage, "--entry cannot be used with --emit ast: the AST is always the whole file"));
            }
            program.compiled().ast.to_string()
        }
        Emit::Ir => match entry {
            Some(name) => graph(name)?.to_string(),
            None => program.module().to_string(),
        },
        Emit::Opt => match entry {
            Some(name) => {
                let g = graph(name)?;
                let o = attn_compiler::opt::optimize(g, &attn_compiler::opt::OptOptions::default());
                format!("{}\n{}", o.graph, attn_compiler::opt::block_summary(&o.graph))
            }
            None => attn_compiler::opt::optimized_text(program.module()).0,
        },
        Emit::Dot => {
            let name = match entry {
                Some(name) => name.to_string(),
                None => program.default_entry().map(|e| e.name).ok_or_else(|| Failure::new(Exit::Program, RunError::NoEntry))?,
            };
            attn_compiler::ir::to_dot(graph(&name)?)
        }
        Emit::Clif => {
            let names: Vec<String> = match entry {
                Some(name) => vec![graph(name)?.name.clone()],
                None => program.module().graphs.iter().map(|g| g.name.clone()).collect(),
            };
            use attn_compiler::codegen::clif;
            let mut text = String::new();
            for name in names {
                let optimized = attn_compiler::opt::optimize(graph(&name)?, &attn_compiler::opt::OptOptions::default()).graph;
                let module = clif::compile(&optimized, &clif::TEXT_FEATURES).map_err(|e| Failure::new(Exit::Program, e))?;
                clif::write_module(&mut text, &module);
                text.push('\n');
            }
            text
        }
        Emit::Cuda => {
            let mut module = attn_compiler::ir::Module::default();
            match entry {
                Some(name) => module.graphs.push(graph(name)?.clone()),
                None => module.graphs.extend(program.module().graphs.iter().cloned()),
            }
            let optimized = attn_compiler::opt::optimize_module(&module).0;
            attn_compiler::codegen::cuda::emit_module(&optimized).map_err(|e| Failure::new(Exit::Program, e))?
        }
    })
}
