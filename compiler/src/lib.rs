//! attnc's compiler: the graph IR ([`ir`]) with the one definition of every op's meaning
//! ([`ir::semantics`]), the lowering of checked `.attn` programs into it ([`lower`]), the
//! optimizer ([`opt`]), the backend-neutral [`schedule`], the reference interpreter
//! ([`interp`]), and the [`pipeline`] that runs them once each. It does no IO and knows no
//! backend: the renderers live in the backend crates (`attn-cpu`, `attn-cuda`) and plug into
//! the pipeline's text stages through [`Renderer`].

pub mod exec;
pub mod interp;
pub mod ir;
pub mod lower;
pub mod opt;
pub mod random;
pub mod schedule;
pub mod tensor;

pub mod pipeline;

pub use attn_dsl::Diagnostic;
pub use pipeline::{Checked, Compiler, Derived, Explanation, PipelineError, Planned, RenderError, Renderer, Stage};

/// The front end with default options ([`Compiler::check`]): parse, lower and verify.
pub fn check(source: &str) -> Result<Checked, Vec<Diagnostic>> {
    Compiler::default().check(source)
}

/// The canonical text of one stage of every function, with default options
/// ([`Compiler::emit`]): what `attnc build --emit` prints, and what users snapshot-test. The
/// rendered stages (`Clif`, `Cuda`) need their renderers: `attn_runtime::emit` has them.
pub fn emit(source: &str, stage: Stage) -> Result<String, Vec<Diagnostic>> {
    let compiler = Compiler::default();
    let compiled = compiler.check(source)?;
    compiler.emit(&compiled, stage, None).map_err(|e| vec![e.diagnostic()])
}

/// What the optimizer did to every function and why ([`Compiler::explain`]).
pub fn explain(source: &str) -> Result<String, Vec<Diagnostic>> {
    let compiler = Compiler::default();
    let compiled = compiler.check(source)?;
    compiler.explain(&compiled, None).map_err(|e| vec![e.diagnostic()])
}
