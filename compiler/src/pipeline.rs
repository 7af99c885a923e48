//! One pipeline, one word per stage:
//!
//! ```text
//! source ─parse─► AST ─lower─► IR ─verify─► IR ─optimize─► IR ─schedule─► Schedule ─render─► Cranelift IR | CUDA C++
//!        └────────────── check ──────────────┘    └──────────── plan ───────────┘
//! ```
//!
//! *Compiling* means running all of it; *checking* is the front end alone (what `attnc check`
//! does), *planning* the middle. [`Compiler`] carries every option (optimizer limits, target
//! and block policy) and runs each stage once; the command line, the runtime, the tests and
//! the benchmarks all go through it. The runtime then *loads* the rendered code (Cranelift's
//! JIT or NVRTC makes machine code), *prepares* the schedule for the run's dims
//! ([`crate::schedule::prepare()`]) and *runs* it.

use crate::ir::grad::{GradError, differentiate};
use crate::ir::{FlashTileMap, Graph, MAP_TILE, Module, Op, TileMapError, block_summary, flash_tile_maps, verify_module};
use crate::opt::{OptOptions, OptReport, Optimized, optimize};
use crate::schedule::{CpuPolicy, CudaPolicy, Policy, Schedule, ScheduleError, Target, schedule};
use attn_dsl::{Diagnostic, Span};
use std::collections::HashMap;
use std::fmt::{self, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;

/// A program through the front end (parse, lower, verify): its syntax tree and IR.
#[derive(Clone, Debug)]
pub struct Checked {
    /// The syntax tree.
    pub ast: attn_dsl::ast::File,
    /// One IR graph per function.
    pub module: Module,
    /// Warnings (see [`crate::lower::lint`]): the program is accepted; drivers print them, and
    /// `--deny-warnings` turns them into errors.
    pub warnings: Vec<Diagnostic>,
}

/// A stage of the pipeline whose canonical text [`Compiler::emit`] returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// The syntax tree, printed back as fully parenthesised source.
    Ast,
    /// The graph IR of every function, before optimisation.
    Ir,
    /// The optimised graph IR (flash ops fused), with each flash op's block classification as
    /// comments.
    Opt,
    /// The schedule of every optimised graph for the compiler's target.
    Schedule,
    /// The Cranelift IR of every step the CPU target renders, headed by its integer table.
    Clif,
    /// The CUDA C++ source of every optimised graph (one translation unit per function).
    Cuda,
}

/// Why planning or rendering failed on a graph that passed the check.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum PipelineError {
    /// No function of that name.
    #[error("no function named `{name}` (the program has: {})", available.join(", "))]
    UnknownEntry {
        /// The name asked for.
        name: String,
        /// The functions the program has.
        available: Vec<String>,
    },
    /// The graph could not be scheduled.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// A renderer failed.
    #[error(transparent)]
    Render(#[from] RenderError),
    /// No renderer for that stage was given to the compiler ([`Compiler::with_renderer`]).
    #[error("no renderer for the `{0:?}` stage was registered with this compiler")]
    NoRenderer(Stage),
    /// A tile map asked for is too large to make.
    #[error(transparent)]
    TileMap(#[from] TileMapError),
}

impl PipelineError {
    /// The source expression the failure is about, when known.
    pub fn span(&self) -> Option<Span> {
        match self {
            PipelineError::Schedule(ScheduleError::Unsupported { span, .. }) => *span,
            PipelineError::Render(e) => e.span,
            _ => None,
        }
    }

    /// The failure as a diagnostic with its code (`E0901` CPU renderer, `E0902` CUDA renderer,
    /// `E0903` scheduling, `E0904` no such entry), pointing at the op's source expression when
    /// known.
    pub fn diagnostic(&self) -> Diagnostic {
        let (code, what) = match self {
            PipelineError::UnknownEntry { .. } => ("E0904", "no such function"),
            PipelineError::Schedule(_) => ("E0903", "this cannot be scheduled"),
            PipelineError::Render(RenderError { target: Target::Cpu, .. }) => ("E0901", "the CPU renderer cannot render this"),
            PipelineError::Render(RenderError { target: Target::Cuda, .. }) => ("E0902", "the CUDA renderer cannot render this"),
            PipelineError::NoRenderer(_) => ("E0906", "no renderer for this stage"),
            PipelineError::TileMap(_) => ("E0905", "this tile map is too large"),
        };
        Diagnostic::error(code, self.to_string(), self.span().unwrap_or(Span::new(0, 0)), what)
    }
}

/// One entry point through the middle: optimised and scheduled.
#[derive(Clone, Debug)]
pub struct Planned {
    /// The optimised graph and what the optimizer did.
    pub optimized: Optimized,
    /// How it runs on the compiler's target.
    pub schedule: Schedule,
    /// How long scheduling took (the optimizer's own time is in its report).
    pub schedule_time: Duration,
}

/// An entry point with its gradients ([`Compiler::differentiate`]).
#[derive(Clone, Debug)]
pub struct Derived {
    /// `<entry>_grad`: the entry's inputs plus a cotangent per float result; its results plus a
    /// gradient per parameter differentiated.
    pub graph: Graph,
    /// How the backward pass was built: the flash ops whose derivative is fused (`Ok`, as
    /// `%N` of the optimised forward graph with the gradients they give), or why the program
    /// was differentiated unfused (`Err`).
    pub fused: Result<Vec<String>, String>,
}

/// Why a renderer could not render a schedule (a case it cannot render: a renderer bug), with
/// the step and its source expression when known. Each backend crate turns its own error into
/// this one for the pipeline's diagnostics (E0901 cpu, E0902 cuda).
#[derive(Debug, Error, Clone, PartialEq)]
#[error("{message}")]
pub struct RenderError {
    /// The renderer's target.
    pub target: Target,
    /// The source expression of the step that failed, when known.
    pub span: Option<Span>,
    /// What failed (graph, step, reason).
    pub message: String,
}

/// A backend's renderer as the pipeline's text stages see it (`--emit clif`, `--emit cuda`). The
/// backend crates implement it; the compiler knows none of them.
pub trait Renderer: fmt::Debug + Send + Sync {
    /// The stage whose text it writes ([`Stage::Clif`], [`Stage::Cuda`]).
    fn stage(&self) -> Stage;
    /// The target whose schedules it renders.
    fn target(&self) -> Target;
    /// The text of one schedule: one function's part of the stage's text.
    fn render_text(&self, schedule: &Schedule) -> Result<String, RenderError>;
}

/// The pipeline and its options.
#[derive(Clone, Debug, Default)]
pub struct Compiler {
    /// The optimizer's limits and cost-model sizes.
    pub opt: OptOptions,
    /// The target and its block policy.
    pub policy: Policy,
    /// The renderers [`Compiler::emit`] prints the rendered stages with.
    pub renderers: Vec<Arc<dyn Renderer>>,
}

impl Compiler {
    /// A compiler for `policy`'s target with default optimizer options.
    pub fn new(policy: Policy) -> Compiler {
        Compiler { opt: OptOptions::default(), policy, renderers: Vec::new() }
    }

    /// This compiler, printing `renderer`'s stage with it.
    pub fn with_renderer(mut self, renderer: Arc<dyn Renderer>) -> Compiler {
        self.renderers.retain(|r| r.stage() != renderer.stage());
        self.renderers.push(renderer);
        self
    }

    /// A compiler for `target` with its default policy.
    pub fn for_target(target: Target) -> Compiler {
        Compiler::new(match target {
            Target::Cpu => Policy::Cpu(CpuPolicy::default()),
            Target::Cuda => Policy::Cuda(CudaPolicy::default()),
        })
    }

    /// The target schedules are made for.
    pub fn target(&self) -> Target {
        self.policy.target()
    }

    /// Checks a program (the front end): parse, lower (type and shape checking) and verify. On failure every
    /// diagnostic found is returned (parse errors first; type errors only when the file parsed).
    pub fn check(&self, source: &str) -> Result<Checked, Vec<Diagnostic>> {
        let (ast, diags) = attn_dsl::parse(source);
        if !diags.is_empty() {
            return Err(diags);
        }
        let module = crate::lower::lower(&ast)?;
        if let Err(errors) = verify_module(&module) {
            let what = errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ");
            return Err(vec![Diagnostic::error(
                "E0900",
                format!("internal error: the lowered IR does not verify: {what}"),
                Span::new(0, 0),
                "while lowering",
            )]);
        }
        let warnings = crate::lower::lint::lint(&ast);
        Ok(Checked { ast, module, warnings })
    }

    /// Optimises one graph.
    pub fn optimize(&self, graph: &Graph) -> Optimized {
        optimize(graph, &self.opt)
    }

    /// Schedules `graph` as it is, for the compiler's target: the graph of a program already
    /// optimised, or one run op by op (the unfused reference the tests compare with).
    pub fn schedule(&self, graph: &Graph) -> Result<Schedule, PipelineError> {
        Ok(schedule(graph, &self.policy)?)
    }

    /// The middle for one graph: optimize, then schedule for the compiler's target.
    pub fn plan(&self, graph: &Graph) -> Result<Planned, PipelineError> {
        let optimized = self.optimize(graph);
        let start = Instant::now();
        let schedule = self.schedule(&optimized.graph)?;
        Ok(Planned { optimized, schedule, schedule_time: start.elapsed() })
    }

    /// `graph` with its gradients ([`crate::ir::grad`]). The forward graph is optimised first and
    /// the optimised graph differentiated, so every fused flash op gets a fused backward
    /// (`flash_lse` saved by the forward, `flash_grad` recomputing the weights tile by tile: no
    /// score-sized buffer). Where a flash op's derivative cannot be fused
    /// ([`GradError::Unfused`]), the unoptimised graph is differentiated instead, op by op, and
    /// [`Derived::fused`] says why.
    pub fn differentiate(&self, graph: &Graph, wrt: Option<&[String]>) -> Result<Derived, GradError> {
        let optimized = self.optimize(graph);
        match differentiate(&optimized.graph, wrt) {
            Ok(derived) => {
                let fused = backward_groups(&derived);
                Ok(Derived { graph: derived, fused: Ok(fused) })
            }
            Err(GradError::Unfused { reason, .. }) => Ok(Derived { graph: differentiate(graph, wrt)?, fused: Err(reason) }),
            Err(e) => Err(e),
        }
    }

    /// The graphs `entry` names: that function, or every function.
    fn graphs<'m>(module: &'m Module, entry: Option<&str>) -> Result<Vec<&'m Graph>, PipelineError> {
        match entry {
            None => Ok(module.graphs.iter().collect()),
            Some(name) => match module.graphs.iter().find(|g| g.name == name) {
                Some(g) => Ok(vec![g]),
                None => Err(PipelineError::UnknownEntry {
                    name: name.to_string(),
                    available: module.graphs.iter().map(|g| g.name.clone()).collect(),
                }),
            },
        }
    }

    /// The canonical text of one stage, for every function or the `entry` one: what
    /// `attnc build --emit` prints and what users snapshot-test. `Clif` and `Cuda` are written
    /// by the renderer registered for them ([`Compiler::with_renderer`]), for its own target
    /// whatever the compiler's.
    pub fn emit(&self, compiled: &Checked, stage: Stage, entry: Option<&str>) -> Result<String, PipelineError> {
        let graphs = Compiler::graphs(&compiled.module, entry)?;
        let mut out = String::new();
        match stage {
            Stage::Ast => out = compiled.ast.to_string(),
            Stage::Ir => {
                for (n, g) in graphs.iter().enumerate() {
                    let _ = writeln!(out, "{}{g}", if n > 0 { "\n" } else { "" });
                }
            }
            Stage::Opt => {
                for (n, g) in graphs.iter().enumerate() {
                    let o = self.optimize(g);
                    let _ = write!(out, "{}{}\n{}", if n > 0 { "\n" } else { "" }, o.graph, block_summary(&o.graph));
                }
            }
            Stage::Schedule => {
                for (n, g) in graphs.iter().enumerate() {
                    let _ = write!(out, "{}{}", if n > 0 { "\n" } else { "" }, self.plan(g)?.schedule);
                }
            }
            Stage::Clif | Stage::Cuda => {
                let renderer = self.renderers.iter().find(|r| r.stage() == stage).ok_or(PipelineError::NoRenderer(stage))?;
                let compiler = self.retarget(renderer.target());
                for (n, g) in graphs.iter().enumerate() {
                    let text = renderer.render_text(&compiler.plan(g)?.schedule)?;
                    let _ = write!(out, "{}{text}", if n > 0 { "\n" } else { "" });
                }
            }
        }
        Ok(out)
    }

    /// This compiler's options for `target` (its own policy when it is for that target).
    pub fn retarget(&self, target: Target) -> Compiler {
        if self.target() == target {
            self.clone()
        } else {
            Compiler { opt: self.opt.clone(), renderers: self.renderers.clone(), ..Compiler::for_target(target) }
        }
    }

    /// What the optimizer did to every function (or the `entry` one) and why: rules fired,
    /// fusions made or refused (with the reason), cost-model decisions, and each flash op's tile
    /// map at representative sizes. What `attnc explain` prints.
    pub fn explain(&self, compiled: &Checked, entry: Option<&str>) -> Result<String, PipelineError> {
        let explained = self.explain_at(compiled, entry, &HashMap::new(), (MAP_TILE, MAP_TILE))?;
        Ok(explained.iter().map(Explanation::to_string).collect::<Vec<_>>().join("\n"))
    }

    /// [`Compiler::explain`] as data, with the tile maps at `dims` (others at representative
    /// sizes) in `tile`-sized tiles.
    pub fn explain_at(
        &self,
        compiled: &Checked,
        entry: Option<&str>,
        dims: &HashMap<String, i64>,
        tile: (i64, i64),
    ) -> Result<Vec<Explanation>, PipelineError> {
        let graphs = Compiler::graphs(&compiled.module, entry)?;
        let mut out = Vec::with_capacity(graphs.len());
        for g in graphs {
            let optimized = self.optimize(g);
            let tile_maps = flash_tile_maps(&optimized.graph, dims, tile)?;
            out.push(Explanation { report: optimized.report, tile_maps, graph: optimized.graph });
        }
        Ok(out)
    }
}

/// One line per fused flash backward of a derived graph (its `flash_grad` ops grouped by their
/// operands): which gradients it gives, of which score modification and mask; and one line for
/// its `prefix_attention` ops (causal linear attention, whose gradients are three more).
fn backward_groups(g: &Graph) -> Vec<String> {
    let mut groups: Vec<(Vec<crate::ir::Value>, &crate::ir::FlashSpec, Vec<String>)> = Vec::new();
    for v in g.values() {
        if let Op::FlashGrad { spec, wrt, .. } = &g.node(v).op {
            let operands = g.operands(v);
            match groups.iter_mut().find(|(o, s, _)| *o == operands && *s == &**spec) {
                Some((_, _, wrts)) => wrts.push(wrt.name()),
                None => groups.push((operands, spec, vec![wrt.name()])),
            }
        }
    }
    let mut lines: Vec<String> = groups
        .into_iter()
        .map(|(_, spec, wrts)| {
            let show = |e| crate::ir::ShowExpr { expr: e, rank: spec.rank }.to_string();
            let mask = spec.mask.as_ref().map(|m| format!(", mask \"{}\"", show(m))).unwrap_or_default();
            format!("flash backward (score \"{}\"{mask}): d{} in one pass", show(&spec.score), wrts.join(", d"))
        })
        .collect();
    let prefix = g.values().filter(|v| matches!(g.node(*v).op, Op::PrefixAttention { .. })).count();
    if prefix > 0 {
        lines.push(format!(
            "causal linear attention: {prefix} prefix_attention op{} (forward and gradients), each with one D × Dv state, no prefix sums of k ⊗ v",
            if prefix == 1 { "" } else { "s" }
        ));
    }
    lines
}

/// What the optimizer did to one function, and the tile maps of its flash ops.
#[derive(Clone, Debug)]
pub struct Explanation {
    /// Rules fired, fusions, decisions.
    pub report: OptReport,
    /// One map per flash op of the optimised graph.
    pub tile_maps: Vec<FlashTileMap>,
    /// The optimised graph the maps were made from.
    pub graph: Graph,
}

impl fmt::Display for Explanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.report)?;
        for map in &self.tile_maps {
            write!(f, "{map}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rendered stages need a renderer: without one, a diagnostic says so (E0906).
    #[test]
    fn a_rendered_stage_without_its_renderer_is_an_error() {
        let compiler = Compiler::default();
        let checked = compiler.check("fn f(x: f32[N]) -> f32[N] { return x * 2.0 }").unwrap_or_else(|d| panic!("{}", d[0]));
        for stage in [Stage::Clif, Stage::Cuda] {
            let err = compiler.emit(&checked, stage, None).expect_err("no renderer registered");
            assert_eq!(err, PipelineError::NoRenderer(stage));
            assert_eq!(err.diagnostic().code, "E0906");
        }
        assert!(compiler.emit(&checked, Stage::Schedule, None).is_ok_and(|t| t.starts_with("schedule f for cpu")));
    }
}
