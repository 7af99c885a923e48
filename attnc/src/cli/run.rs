//! `attnc run`: load or generate inputs, run an entry point, summarise and write the outputs.

use super::{Exit, Failure, eprint_line, load, print_line};
use crate::pictures::heatmap::{Labels, heatmap_png};
use attn_runtime::cpu::MAX_THREADS;
use attn_runtime::io::{self, Format, IoError};
use attn_runtime::report::summarize;
use attn_runtime::{EntryInfo, RunError, RunOptions, Target, TargetError, Tensor, suggest};
use clap::{Args, ValueEnum};
use std::collections::HashMap;
use std::io::Write as _;
use std::path::PathBuf;

/// The long help of `attnc run`.
pub const LONG_ABOUT: &str = "\
Run an entry point of a program and print one summary line per output:
  name: f32[2, 4, 16, 8] min=-1.234 max=2.345 mean=0.0123

Inputs come from files: --input NAME=PATH with a .npy or .safetensors file, or --input
PATH.safetensors alone to take every tensor of the file whose name is a parameter. File data must
have the parameter's dtype, or be f16/bf16/f64 for an f32 parameter (f64 is rounded to f32) or
i64 for an i32 parameter (every value must fit).

With --random-inputs, the parameters no --input gives are generated from --seed: floats ~ N(0, 1);
i32 inputs are segment ids, non-decreasing along the last axis with values in [0, 4); bools are
fair coin flips. Their dims are the ones given with --dim, the ones the file inputs determine,
and 8 for every other dim (a dim written as an expression, such as H*Dh, follows from its names).

The default entry is the last function in the file.";

/// `attnc run FILE [options]`
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The .attn program.
    pub file: PathBuf,
    /// The function to run (default: the last one in the file).
    #[arg(long, value_name = "NAME")]
    pub entry: Option<String>,
    /// An input: NAME=PATH (.npy or .safetensors), or PATH.safetensors for every tensor in the
    /// file named like a parameter. PATH `-` reads standard input (.npy or .safetensors, told
    /// by its first bytes; one input at most). Repeatable.
    #[arg(long = "input", value_name = "[NAME=]PATH", value_parser = parse_named_path)]
    pub inputs: Vec<NamedPath>,
    /// The size of a dim the inputs do not determine (or a check of one they do). Repeatable.
    #[arg(long = "dim", value_name = "NAME=N", value_parser = parse_dim)]
    pub dims: Vec<(String, i64)>,
    /// Generate the inputs no --input gives (seeded; unset dims default to 8).
    #[arg(long)]
    pub random_inputs: bool,
    /// Seed for --random-inputs.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub seed: u64,
    /// Write an output: NAME=PATH (.npy or .safetensors; outputs sharing a .safetensors path go
    /// into one file), or PATH.safetensors alone for all outputs. Repeatable.
    #[arg(long = "output", value_name = "[NAME=]PATH", value_parser = parse_named_path, conflicts_with = "out_dir")]
    pub outputs: Vec<NamedPath>,
    /// Write every output as DIR/NAME.npy (the directory is created).
    #[arg(long, value_name = "DIR")]
    pub out_dir: Option<PathBuf>,
    /// Where to run.
    #[arg(long, value_enum, default_value_t = TargetArg::Cpu)]
    pub target: TargetArg,
    /// Threads for the cpu target: 1 to 4096, or 0 for one per available core.
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = parse_threads)]
    pub threads: usize,
    /// Draw an output as a heatmap: NAME=OUT.png. Its last two axes are the rows and columns
    /// (viridis colours, a colour bar); each index of the leading axes is a panel, 16 at most.
    /// Repeatable.
    #[arg(long = "heatmap", value_name = "NAME=OUT.png", value_parser = parse_heatmap)]
    pub heatmaps: Vec<(String, PathBuf)>,
    /// Label the heatmaps' rows and columns with tokens: ROWS.txt,COLS.txt, one token a line
    /// (as many as the output has rows and columns).
    #[arg(long, value_name = "ROWS.txt,COLS.txt", requires = "heatmaps")]
    pub labels: Option<String>,
    /// Gradients (`--grad [--wrt a,b]`).
    #[command(flatten)]
    pub grad: super::GradArgs,
}

/// Target names accepted on the command line, built or not (see [`Target`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TargetArg {
    /// The reference interpreter.
    Interp,
    /// Native code through Cranelift (the default).
    Cpu,
    /// NVIDIA GPUs (sm_80 or newer), through CUDA kernels compiled with NVRTC.
    Cuda,
}

/// `NAME=PATH` or `PATH`.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedPath {
    /// The tensor's name, if given.
    pub name: Option<String>,
    /// The file.
    pub path: PathBuf,
}

fn is_identifier(s: &str) -> bool {
    !s.is_empty() && !s.starts_with(|c: char| c.is_ascii_digit()) && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

pub(super) fn parse_named_path(s: &str) -> Result<NamedPath, String> {
    let named = s.split_once('=').filter(|(name, _)| is_identifier(name));
    let (name, path) = match named {
        Some((name, path)) => (Some(name.to_string()), path),
        None => (None, s),
    };
    if path.is_empty() {
        return Err("the path is empty".into());
    }
    Ok(NamedPath { name, path: PathBuf::from(path) })
}

/// Parses `NAME=PATH` for `--heatmap`.
fn parse_heatmap(s: &str) -> Result<(String, PathBuf), String> {
    match parse_named_path(s)? {
        NamedPath { name: Some(name), path } => Ok((name, path)),
        NamedPath { name: None, .. } => Err("expected NAME=OUT.png, naming the output to draw".into()),
    }
}

/// Reads `--labels ROWS.txt,COLS.txt`: one token a line, a final empty line ignored.
fn read_labels(spec: &str) -> Result<Labels, Failure> {
    let Some((rows, cols)) = spec.split_once(',') else {
        return Err(Failure::new(Exit::Usage, format!("--labels {spec}: expected ROWS.txt,COLS.txt")));
    };
    let read = |path: &str| -> Result<Vec<String>, Failure> {
        let text = std::fs::read_to_string(path).map_err(|e| Failure::new(Exit::File, format!("cannot read labels {path}: {e}")))?;
        Ok(text.lines().map(|l| l.trim_end_matches('\r').to_string()).collect())
    };
    Ok(Labels { rows: read(rows)?, cols: read(cols)? })
}

/// Checks `--heatmap` names and paths before the run, so that a typo costs nothing.
fn check_heatmaps(entry: &EntryInfo, args: &RunArgs) -> Result<(), Failure> {
    for (name, path) in &args.heatmaps {
        if !entry.outputs.iter().any(|(n, _)| n == name) {
            return Err(unknown_name("output", entry, name, &entry.outputs));
        }
        check_writable(path)?;
        let sources = std::iter::once(&args.file).chain(args.inputs.iter().map(|i| &i.path));
        if let Some(source) = sources.into_iter().find(|s| io::same_file(path, s)) {
            return Err(Failure::new(
                Exit::Usage,
                format!("--heatmap {} is also an input ({}); refusing to overwrite it", path.display(), source.display()),
            ));
        }
    }
    Ok(())
}

/// Draws and writes the `--heatmap`s.
fn write_heatmaps(args: &RunArgs, labels: Option<&Labels>, outputs: &[(String, Tensor)]) -> Result<(), Failure> {
    for (name, path) in &args.heatmaps {
        let Some((_, tensor)) = outputs.iter().find(|(n, _)| n == name) else { continue };
        let picture = heatmap_png(name, tensor, labels).map_err(|e| Failure::new(Exit::Usage, e))?;
        io::write_atomic(path, &picture.png).map_err(|e| Failure::new(Exit::File, format!("cannot write {}: {e}", path.display())))?;
        let (drawn, total) = (picture.panels.len(), picture.total_panels);
        let panels = if drawn < total { format!("the first {drawn} of {total} panels") } else { plural(drawn, "panel") };
        print_line(&format!("wrote {} (heatmap of `{name}`: {panels})", path.display()));
    }
    Ok(())
}

/// `1 panel`, `2 panels`.
fn plural(n: usize, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

/// Parses `NAME=N` (also used by `attnc bench`).
pub fn parse_dim(s: &str) -> Result<(String, i64), String> {
    let (name, value) = s.split_once('=').ok_or("expected NAME=N, e.g. S=128")?;
    if !is_identifier(name) {
        return Err(format!("`{name}` is not a dim name"));
    }
    let value: i64 = value.trim().parse().map_err(|_| format!("`{value}` is not an integer"))?;
    if !(0..=i64::from(i32::MAX)).contains(&value) {
        return Err(format!("{value} is out of range (0 to {})", i32::MAX));
    }
    Ok((name.to_string(), value))
}

/// Parses a thread count: 0 (one per core) to [`MAX_THREADS`] (also used by `attnc bench`).
pub fn parse_threads(s: &str) -> Result<usize, String> {
    let n: usize = s.trim().parse().map_err(|_| format!("`{s}` is not a thread count"))?;
    if n > MAX_THREADS {
        return Err(format!("{n} threads is more than the {MAX_THREADS} supported (0 means one per core)"));
    }
    Ok(n)
}

/// Runs `attnc run`.
pub fn run(args: &RunArgs, ui: super::Ui) -> Result<(), Failure> {
    let name = args.target.to_possible_value().map_or("interp".to_string(), |v| v.get_name().to_string());
    let target: Target = name.parse().map_err(|e: TargetError| Failure::new(Exit::Target, e))?;
    if target == Target::Cuda {
        // No driver, device or NVRTC: say so before reading any input.
        attn_runtime::cuda::device_info().map_err(|e| Failure::new(Exit::Target, e))?;
    }
    let (program, entry) = args.grad.apply(load(&args.file, ui)?, args.entry.as_deref())?;
    let entry = match &entry {
        Some(name) => program.entry(name).map_err(run_failure)?,
        None => program.default_entry().ok_or_else(|| run_failure(RunError::NoEntry))?,
    };
    let dims = given_dims(&args.dims)?;
    let plan = plan_outputs(&entry, args)?;
    check_heatmaps(&entry, args)?;
    let labels = args.labels.as_deref().map(read_labels).transpose()?;
    let (inputs, dims) = gather_inputs(&program, &entry, &args.inputs, args.random_inputs.then_some(args.seed), dims)?;
    let opts = RunOptions { dims, target };
    let cpu = attn_runtime::cpu::CpuOptions { threads: args.threads };
    let shapes: Vec<(String, attn_runtime::DType, Vec<usize>)> =
        inputs.iter().map(|(n, t)| (n.clone(), t.dtype, t.shape.clone())).collect();
    let outputs = program.run_with(&entry.name, inputs, &opts, &cpu).map_err(|e| match e {
        RunError::MissingInputs { .. } => Failure::new(Exit::Usage, format!("{e}; pass --input NAME=PATH or --random-inputs")),
        e => {
            // An input that does not fit its parameter: show the declaration it contradicts.
            if let Some(d) = program.run_error_diagnostic(&entry.name, &e, &shapes) {
                let text = attn_runtime::report::render_diagnostics(&[d], program.file_name(), program.source(), ui.color);
                let _ = write!(std::io::stderr().lock(), "{text}");
            }
            run_failure(e)
        }
    })?;
    for (name, tensor) in &outputs {
        print_line(&summarize(name, tensor));
    }
    write_outputs(&plan, &outputs)?;
    write_heatmaps(args, labels.as_ref(), &outputs)
}

/// Tensors with their parameter names.
pub(super) type NamedTensors = Vec<(String, Tensor)>;

/// `--dim`s as a map; the same name twice with different values is an error.
pub(super) fn given_dims(list: &[(String, i64)]) -> Result<HashMap<String, i64>, Failure> {
    let mut dims = HashMap::new();
    for (name, value) in list {
        if dims.insert(name.clone(), *value).is_some_and(|old| old != *value) {
            return Err(Failure::new(Exit::Usage, format!("--dim {name} is given twice with different values")));
        }
    }
    Ok(dims)
}

/// The inputs from `--input` files, plus seeded random ones for the rest when `random` has a
/// seed, and the dims they come with (for random inputs: every dim bound, unset ones 8).
pub(super) fn gather_inputs(
    program: &attn_runtime::Program,
    entry: &EntryInfo,
    specs: &[NamedPath],
    random: Option<u64>,
    mut dims: HashMap<String, i64>,
) -> Result<(NamedTensors, HashMap<String, i64>), Failure> {
    let mut inputs = load_inputs(entry, specs)?;
    if let Some(seed) = random {
        let derived = dims_from_inputs(entry, &inputs, &dims);
        dims = program.random_dims(&entry.name, &derived).map_err(run_failure)?;
        let given: Vec<String> = inputs.iter().map(|(n, _)| n.clone()).collect();
        let random = program.random_inputs(&entry.name, seed, &dims).map_err(run_failure)?;
        inputs.extend(random.into_iter().filter(|(n, _)| !given.contains(n)));
    }
    Ok((inputs, dims))
}

/// The exit code of a run error.
pub(super) fn run_failure(e: RunError) -> Failure {
    let exit = match &e {
        RunError::UnknownEntry { .. }
        | RunError::MissingInputs { .. }
        | RunError::UnexpectedInput { .. }
        | RunError::DuplicateInput { .. }
        | RunError::UnknownDim { .. }
        | RunError::UnknownProgramDim { .. }
        | RunError::FixedDim { .. }
        | RunError::IndivisibleDim { .. } => Exit::Usage,
        RunError::NoEntry => Exit::Program,
        RunError::InputDType { .. } => Exit::File,
        RunError::Cuda(attn_runtime::cuda::CudaError::Unavailable(_)) => Exit::Target,
        _ => Exit::Runtime,
    };
    Failure::new(exit, e)
}

fn io_failure(e: IoError) -> Failure {
    Failure::new(Exit::File, e)
}

fn unknown_name(kind: &str, entry: &EntryInfo, name: &str, known: &[(String, attn_runtime::TensorType)]) -> Failure {
    let names: Vec<String> = known.iter().map(|(n, _)| n.clone()).collect();
    let hint = suggest(name, &names).map_or(String::new(), |s| format!("; did you mean `{s}`?"));
    Failure::new(Exit::Usage, format!("`{}` has no {kind} named `{name}`{hint} (its {kind}s: {})", entry.name, names.join(", ")))
}

/// Reads every `--input`, converted to its parameter's dtype, in command-line order. The path
/// `-` reads standard input (once).
fn load_inputs(entry: &EntryInfo, specs: &[NamedPath]) -> Result<Vec<(String, Tensor)>, Failure> {
    if specs.iter().filter(|s| s.path.as_os_str() == io::STDIN).count() > 1 {
        return Err(Failure::new(Exit::Usage, "only one --input can read standard input (`-`)"));
    }
    let mut out = Vec::new();
    for spec in specs {
        let file = io::InputFile::read(&spec.path).map_err(io_failure)?;
        let shown = file.path.display();
        match (&spec.name, file.format) {
            (Some(name), _) => {
                let declared =
                    entry.params.iter().find(|(n, _)| n == name).ok_or_else(|| unknown_name("parameter", entry, name, &entry.params))?;
                let tensor = match file.format {
                    Format::Npy => file.npy().map_err(io_failure)?,
                    Format::Safetensors => {
                        let mut all = file.safetensors().map_err(io_failure)?;
                        // A file holding just one tensor may name it anything.
                        if all.len() == 1 && all[0].0 != *name {
                            all.remove(0).1
                        } else {
                            file.safetensors_tensor(name).map_err(io_failure)?
                        }
                    }
                };
                out.push((name.clone(), convert(name, tensor, &declared.1)?));
            }
            (None, Format::Safetensors) => {
                let all = file.safetensors().map_err(io_failure)?;
                let (used, unused): (Vec<_>, Vec<_>) = all.into_iter().partition(|(n, _)| entry.params.iter().any(|(p, _)| p == n));
                if used.is_empty() {
                    let names: Vec<&str> = entry.params.iter().map(|(n, _)| n.as_str()).collect();
                    return Err(Failure::new(
                        Exit::File,
                        format!("{shown}: no tensor is named like a parameter of `{}` ({})", entry.name, names.join(", ")),
                    ));
                }
                if !unused.is_empty() {
                    let names: Vec<&str> = unused.iter().map(|(n, _)| n.as_str()).collect();
                    eprint_line(&format!("note: {shown}: ignoring tensors that are no parameter: {}", names.join(", ")));
                }
                for (name, tensor) in used {
                    let declared = entry.params.iter().find(|(n, _)| *n == name).map(|(_, t)| t.clone());
                    if let Some(ty) = declared {
                        let tensor = convert(&name, tensor, &ty)?;
                        out.push((name, tensor));
                    }
                }
            }
            (None, Format::Npy) => {
                let [(name, ty)] = entry.params.as_slice() else {
                    return Err(Failure::new(
                        Exit::Usage,
                        format!(
                            "--input {} needs a parameter name (--input NAME={}): `{}` has {} parameters",
                            spec.path.display(),
                            spec.path.display(),
                            entry.name,
                            entry.params.len()
                        ),
                    ));
                };
                let tensor = file.npy().map_err(io_failure)?;
                out.push((name.clone(), convert(name, tensor, ty)?));
            }
        }
    }
    Ok(out)
}

fn convert(name: &str, file: io::FileTensor, ty: &attn_runtime::TensorType) -> Result<Tensor, Failure> {
    io::convert(name, file, ty.dtype).map_err(|e| Failure::new(Exit::File, e))
}

/// Dims the loaded inputs determine (plain names, and expressions with one unknown name), on top
/// of `given`. Contradictions are left for the interpreter to report with full context.
fn dims_from_inputs(entry: &EntryInfo, inputs: &[(String, Tensor)], given: &HashMap<String, i64>) -> HashMap<String, i64> {
    let mut env = given.clone();
    loop {
        let mut changed = false;
        for (name, tensor) in inputs {
            let Some((_, ty)) = entry.params.iter().find(|(n, _)| n == name) else { continue };
            if ty.rank() != tensor.shape.len() {
                continue;
            }
            for (dim, size) in ty.shape.iter().zip(&tensor.shape) {
                if dim.eval(&env).is_ok() {
                    continue;
                }
                let Ok(size) = i64::try_from(*size) else { continue };
                if let Some(Ok((sym, value))) = dim.solve(size, &env) {
                    env.insert(sym, value);
                    changed = true;
                }
            }
        }
        if !changed {
            return env;
        }
    }
}

/// Which outputs go to which file, checked before running so that a typo costs nothing.
struct OutputPlan {
    /// Each file with the outputs it receives.
    files: Vec<(PathBuf, Vec<String>)>,
    /// `--out-dir`.
    dir: Option<PathBuf>,
}

fn plan_outputs(entry: &EntryInfo, args: &RunArgs) -> Result<OutputPlan, Failure> {
    let mut files: Vec<(PathBuf, Vec<String>)> = Vec::new();
    for spec in &args.outputs {
        let format = Format::of_path(&spec.path).map_err(io_failure)?;
        let names: Vec<String> = match (&spec.name, format) {
            (Some(name), _) => {
                if !entry.outputs.iter().any(|(n, _)| n == name) {
                    return Err(unknown_name("output", entry, name, &entry.outputs));
                }
                vec![name.clone()]
            }
            (None, Format::Safetensors) => entry.outputs.iter().map(|(n, _)| n.clone()).collect(),
            (None, Format::Npy) => match entry.outputs.as_slice() {
                [(name, _)] => vec![name.clone()],
                _ => {
                    return Err(Failure::new(
                        Exit::Usage,
                        format!("--output {} needs an output name (NAME=PATH): `{}` has several outputs", spec.path.display(), entry.name),
                    ));
                }
            },
        };
        match files.iter_mut().find(|(p, _)| *p == spec.path) {
            Some((_, existing)) => existing.extend(names),
            None => files.push((spec.path.clone(), names)),
        }
    }
    for (path, names) in &mut files {
        let mut unique: Vec<String> = Vec::new();
        for n in names.drain(..) {
            if !unique.contains(&n) {
                unique.push(n);
            }
        }
        *names = unique;
        if names.len() > 1 && Format::of_path(path).ok() == Some(Format::Npy) {
            return Err(Failure::new(
                Exit::Usage,
                format!("{}: a .npy file holds one tensor, but several outputs are sent there", path.display()),
            ));
        }
    }
    for (path, _) in &files {
        check_writable(path)?;
    }
    if let Some(dir) = &args.out_dir {
        // Created before the run, so that a bad directory costs nothing.
        std::fs::create_dir_all(dir).map_err(|e| Failure::new(Exit::File, format!("cannot create directory {}: {e}", dir.display())))?;
    }
    let plan = OutputPlan { files, dir: args.out_dir.clone() };
    refuse_overwriting_inputs(&plan, entry, args)?;
    Ok(plan)
}

/// An output path whose directory is missing or read-only, or that names a directory, is
/// reported before the program runs (nothing is created or overwritten yet).
pub(super) fn check_writable(path: &std::path::Path) -> Result<(), Failure> {
    let fail = |why: &str| Err(Failure::new(Exit::File, format!("cannot write {}: {why}", path.display())));
    if path.is_dir() {
        return fail("it is a directory");
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    match std::fs::metadata(parent) {
        Ok(m) if !m.is_dir() => fail(&format!("{} is not a directory", parent.display())),
        Ok(m) if m.permissions().readonly() => fail(&format!("{} is read-only", parent.display())),
        Ok(_) => Ok(()),
        Err(e) => fail(&format!("{}: {e}", parent.display())),
    }
}

/// Fails when an output would overwrite the program or one of the input files.
fn refuse_overwriting_inputs(plan: &OutputPlan, entry: &EntryInfo, args: &RunArgs) -> Result<(), Failure> {
    let mut targets: Vec<PathBuf> = plan.files.iter().map(|(p, _)| p.clone()).collect();
    if let Some(dir) = &plan.dir {
        targets.extend(entry.outputs.iter().map(|(n, _)| dir.join(format!("{n}.npy"))));
    }
    let sources = std::iter::once(&args.file).chain(args.inputs.iter().map(|i| &i.path));
    for source in sources {
        if let Some(t) = targets.iter().find(|t| io::same_file(t, source)) {
            return Err(Failure::new(
                Exit::Usage,
                format!("output {} is also an input ({}); refusing to overwrite it", t.display(), source.display()),
            ));
        }
    }
    Ok(())
}

fn write_outputs(plan: &OutputPlan, outputs: &[(String, Tensor)]) -> Result<(), Failure> {
    let get = |name: &str| outputs.iter().find(|(n, _)| n == name).map(|(_, t)| t);
    if let Some(dir) = &plan.dir {
        std::fs::create_dir_all(dir).map_err(|e| Failure::new(Exit::File, format!("cannot create directory {}: {e}", dir.display())))?;
        for (name, tensor) in outputs {
            io::write_npy(&dir.join(format!("{name}.npy")), tensor).map_err(io_failure)?;
        }
    }
    for (path, names) in &plan.files {
        let tensors: Vec<(&str, &Tensor)> = names.iter().filter_map(|n| get(n).map(|t| (n.as_str(), t))).collect();
        match (Format::of_path(path).map_err(io_failure)?, tensors.as_slice()) {
            (Format::Npy, [(_, t)]) => io::write_npy(path, t).map_err(io_failure)?,
            (Format::Npy, _) => {}
            (Format::Safetensors, _) => io::write_safetensors(path, &tensors).map_err(io_failure)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_paths() {
        assert_eq!(parse_named_path("q=a/b.npy").unwrap(), NamedPath { name: Some("q".into()), path: "a/b.npy".into() });
        assert_eq!(parse_named_path("w.safetensors").unwrap(), NamedPath { name: None, path: "w.safetensors".into() });
        assert_eq!(parse_named_path("dir=x/a=b.npy").unwrap().name.as_deref(), Some("dir"));
        assert_eq!(parse_named_path("./a=b.npy").unwrap().name, None);
        assert!(parse_named_path("q=").is_err());
    }

    #[test]
    fn dims() {
        assert_eq!(parse_dim("S=128").unwrap(), ("S".to_string(), 128));
        assert!(parse_dim("S").is_err());
        assert!(parse_dim("S=-1").is_err());
        assert!(parse_dim("S=x").is_err());
        assert!(parse_dim("1S=3").is_err());
        assert!(parse_dim("S=99999999999").is_err());
    }
}
