//! attnc's compiler: the graph IR ([`ir`]), the lowering of checked `.attn` programs into it
//! ([`lower`]), and the reference interpreter ([`interp`]) that defines what every IR program
//! computes. It does no IO.

pub mod codegen;
pub mod interp;
pub mod ir;
pub mod lower;
pub mod opt;
pub mod tensor;

pub use attn_dsl::Diagnostic;

/// A program that parsed and type-checked.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The syntax tree.
    pub ast: attn_dsl::ast::File,
    /// One IR graph per function.
    pub module: ir::Module,
}

/// Parses and type-checks a program and lowers it to IR. On failure every diagnostic found is
/// returned (parse errors first; type errors only when the file parsed).
pub fn compile(source: &str) -> Result<Compiled, Vec<Diagnostic>> {
    let (ast, diags) = attn_dsl::parse(source);
    if !diags.is_empty() {
        return Err(diags);
    }
    let module = lower::lower(&ast)?;
    Ok(Compiled { ast, module })
}

/// A stage of the pipeline whose canonical text [`emit`] returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// The syntax tree, printed back as fully parenthesised source.
    Ast,
    /// The graph IR of every function, before optimisation.
    Ir,
    /// The optimised graph IR (flash ops fused), with each flash op's block classification as
    /// comments.
    Opt,
    /// The Cranelift IR of every function the CPU backend generates for the optimised graphs,
    /// each graph headed by its execution plan as comments.
    Clif,
    /// The CUDA C++ source the GPU backend emits for the optimised graphs (one translation
    /// unit per function).
    Cuda,
}

/// The canonical text of one stage for a program: what `attnc build --emit` prints, and what
/// users snapshot-test.
pub fn emit(source: &str, stage: Stage) -> Result<String, Vec<Diagnostic>> {
    let compiled = compile(source)?;
    Ok(match stage {
        Stage::Ast => compiled.ast.to_string(),
        Stage::Ir => compiled.module.to_string(),
        Stage::Opt => opt::optimized_text(&compiled.module).0,
        Stage::Clif => codegen::clif::emit_text(&opt::optimize_module(&compiled.module).0)
            .map_err(|e| vec![Diagnostic::error("E0901", e.to_string(), attn_dsl::Span::new(0, 0), "while generating CPU code")])?,
        Stage::Cuda => codegen::cuda::emit_module(&opt::optimize_module(&compiled.module).0)
            .map_err(|e| vec![Diagnostic::error("E0902", e.to_string(), attn_dsl::Span::new(0, 0), "while generating CUDA code")])?,
    })
}

/// What the optimizer did to a program and why: rules fired, fusions made or refused (with the
/// reason), cost-model decisions. The text `attnc explain` prints.
pub fn explain(source: &str) -> Result<String, Vec<Diagnostic>> {
    let compiled = compile(source)?;
    Ok(opt::explain_text(&compiled.module))
}
