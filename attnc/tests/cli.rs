//! End-to-end tests of the `attnc` binary: exit codes, messages, and files written.

use attn_runtime::io::{self, FileDType};
use attn_runtime::{DType, Program, RunOptions, Stage, Tensor, TensorData, emit};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Causal attention plus a helper function; `attend` (the last one) is the default entry.
const SRC: &str = "\
fn scale(x: f32[N], s: f32) -> f32[N] {
    return x * s
}

fn attend(q: f32[B, S, D], k: f32[B, S, D], v: f32[B, S, D], seg: i32[B, S]) -> (out: f32[B, S, D], w: f32[B, S, S]) {
    let scores = q @ k.T / sqrt(D)
    let (b, i, j) = indices(scores)
    let w = softmax(where(seg[b, i] == seg[b, j] && j <= i, scores, -inf), axis = -1)
    return w @ v, w
}
";

const BAD: &str = "fn f(x: f32[N]) -> f32[N] {\n  return x + y\n}\n";

/// A fresh directory for one test, removed when dropped.
struct Dir(PathBuf);

impl Dir {
    fn new() -> Dir {
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let n = COUNT.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("attnc-cli-test-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("prog.attn"), SRC).unwrap();
        std::fs::write(dir.join("bad.attn"), BAD).unwrap();
        Dir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Runs attnc in this directory.
    fn attnc(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_attnc")).args(args).current_dir(&self.0).output().unwrap()
    }

    /// Runs attnc in this directory, which must exit with `want`; returns its stderr.
    #[track_caller]
    fn fails(&self, args: &[&str], want: i32) -> String {
        let o = self.attnc(args);
        let err = stderr(&o);
        assert_eq!(code(&o), want, "attnc {args:?}: {err}");
        err
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn f32_tensor(shape: Vec<usize>, seed: u32) -> Tensor {
    let n: usize = shape.iter().product();
    let data = (0..n).map(|i| (((i as u32 * 7 + seed * 13) % 17) as f32 - 8.0) / 4.0).collect();
    Tensor::f32(shape, data).unwrap()
}

fn inputs() -> Vec<(String, Tensor)> {
    vec![
        ("q".into(), f32_tensor(vec![2, 5, 3], 1)),
        ("k".into(), f32_tensor(vec![2, 5, 3], 2)),
        ("v".into(), f32_tensor(vec![2, 5, 3], 3)),
        ("seg".into(), Tensor::i32(vec![2, 5], vec![0, 0, 1, 1, 1, 0, 1, 2, 2, 3]).unwrap()),
    ]
}

fn read_f32(path: &Path) -> Tensor {
    io::convert("t", io::read_npy(path).unwrap(), DType::F32).unwrap()
}

#[test]
fn check_ok_and_errors() {
    let d = Dir::new();
    let ok = d.attnc(&["check", "prog.attn"]);
    assert_eq!(code(&ok), 0, "{}", stderr(&ok));
    assert_eq!(stdout(&ok).trim(), "ok: 2 functions");

    let bad = d.attnc(&["check", "bad.attn"]);
    assert_eq!(code(&bad), 1);
    let err = stderr(&bad);
    assert!(err.contains("bad.attn:2:14"), "{err}");
    assert!(err.contains(&format!("error[{}]", attn_compiler::lower::codes::UNKNOWN_NAME)), "{err}");
    assert!(err.contains("return x + y"), "{err}");
    assert!(err.trim_end().ends_with("error: bad.attn has 1 error"), "{err}");
    assert!(!err.contains('\u{1b}'), "colour when not a terminal: {err:?}");
    assert!(stdout(&bad).is_empty());

    let missing = d.attnc(&["check", "missing.attn"]);
    assert_eq!(code(&missing), 3);
    assert!(stderr(&missing).starts_with("error: cannot read missing.attn"), "{}", stderr(&missing));
}

#[test]
fn run_random_inputs_to_out_dir_is_deterministic() {
    let d = Dir::new();
    let run = |seed: &str, dir: &str| d.attnc(&["run", "prog.attn", "--random-inputs", "--seed", seed, "--dim", "S=6", "--out-dir", dir]);
    let a = run("1", "a/nested");
    assert_eq!(code(&a), 0, "{}", stderr(&a));
    let lines: Vec<String> = stdout(&a).lines().map(String::from).collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[0].starts_with("out: f32[8, 6, 8] min="), "{}", lines[0]);
    assert!(lines[1].starts_with("w: f32[8, 6, 6] min=0 max=1"), "{}", lines[1]);
    let out = read_f32(&d.path("a/nested/out.npy"));
    assert_eq!(out.shape, vec![8, 6, 8]);
    let w = read_f32(&d.path("a/nested/w.npy"));
    // Rows of softmax weights sum to 1 (each token sees at least itself).
    for row in w.to_f64_vec().chunks(6) {
        assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-5, "{row:?}");
    }
    let b = run("1", "b");
    assert_eq!(stdout(&a), stdout(&b));
    assert_eq!(std::fs::read(d.path("a/nested/out.npy")).unwrap(), std::fs::read(d.path("b/out.npy")).unwrap());
    let c = run("2", "c");
    assert_eq!(code(&c), 0);
    assert_ne!(std::fs::read(d.path("b/out.npy")).unwrap(), std::fs::read(d.path("c/out.npy")).unwrap());
}

#[test]
fn run_with_npy_inputs_matches_the_library() {
    let d = Dir::new();
    for (name, t) in inputs() {
        io::write_npy(&d.path(&format!("{name}.npy")), &t).unwrap();
    }
    let o = d.attnc(&[
        "run",
        "prog.attn",
        "--input",
        "q=q.npy",
        "--input",
        "k=k.npy",
        "--input",
        "v=v.npy",
        "--input",
        "seg=seg.npy",
        "--output",
        "out=result.npy",
        "--output",
        "w=all.safetensors",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let program = Program::from_source(SRC, "prog.attn").unwrap();
    let expected = program.run("attend", inputs(), &RunOptions::default()).unwrap();
    assert_eq!(read_f32(&d.path("result.npy")), expected[0].1);
    let st = io::read_safetensors(&d.path("all.safetensors")).unwrap();
    assert_eq!(st.len(), 1);
    assert_eq!(st[0].0, "w");
    assert_eq!(io::convert("w", st[0].1.clone(), DType::F32).unwrap(), expected[1].1);
    let summary = attn_runtime::report::summarize("out", &expected[0].1);
    assert_eq!(stdout(&o).lines().next(), Some(summary.as_str()));
}

#[test]
fn run_with_one_safetensors_file_for_all_inputs() {
    let d = Dir::new();
    let named = inputs();
    let mut refs: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let extra = Tensor::f32(vec![1], vec![0.0]).unwrap();
    refs.push(("unused", &extra));
    io::write_safetensors(&d.path("in.safetensors"), &refs).unwrap();
    let o = d.attnc(&["run", "prog.attn", "--input", "in.safetensors", "--output", "outs.safetensors"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stderr(&o).contains("ignoring tensors that are no parameter: unused"), "{}", stderr(&o));
    let outs = io::read_safetensors(&d.path("outs.safetensors")).unwrap();
    let names: Vec<&str> = outs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["out", "w"]);
    assert_eq!(outs[0].1.dtype, FileDType::F32);
}

#[test]
fn random_inputs_fill_only_what_files_do_not_give() {
    let d = Dir::new();
    io::write_npy(&d.path("q.npy"), &f32_tensor(vec![2, 5, 3], 1)).unwrap();
    let o = d.attnc(&["run", "prog.attn", "--input", "q=q.npy", "--random-inputs"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).starts_with("out: f32[2, 5, 3]"), "{}", stdout(&o));
}

#[test]
fn missing_and_unknown_inputs_are_command_line_errors() {
    let d = Dir::new();
    io::write_npy(&d.path("q.npy"), &f32_tensor(vec![2, 5, 3], 1)).unwrap();
    let err = d.fails(&["run", "prog.attn", "--input", "q=q.npy"], 2);
    assert!(err.starts_with("error: missing inputs for `attend`: `k`, `v`, `seg`"), "{err}");
    assert!(err.contains("--random-inputs"), "{err}");
    // What each message says ("" where only the exit code is checked).
    for (args, says) in [
        (&["run", "prog.attn", "--input", "query=q.npy"][..], "`attend` has no parameter named `query`"),
        (&["run", "prog.attn", "--entry", "nope", "--random-inputs"], "no function named `nope` (the program has: scale, attend)"),
        (&["run", "prog.attn", "--random-inputs", "--dim", "X=3"], ""),
        (&["run", "prog.attn", "--random-inputs", "--dim", "S"], ""),
        (&["run", "prog.attn", "--random-inputs", "--output", "nope=x.npy"], ""),
    ] {
        let err = d.fails(args, 2);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

#[test]
fn bad_input_files_are_file_errors() {
    let d = Dir::new();
    std::fs::write(d.path("garbage.npy"), b"this is not numpy").unwrap();
    let err = d.fails(&["run", "prog.attn", "--input", "q=garbage.npy", "--random-inputs"], 3);
    assert!(err.starts_with("error: garbage.npy: not a valid .npy file"), "{err}");

    let good = io::encode_npy(&f32_tensor(vec![2, 5, 3], 1)).unwrap();
    std::fs::write(d.path("short.npy"), &good[..good.len() - 4]).unwrap();
    io::write_npy(&d.path("ints.npy"), &Tensor::i32(vec![2, 5, 3], vec![1; 30]).unwrap()).unwrap();
    // What each message says ("" where only the exit code is checked).
    for (file, says) in
        [("short.npy", "truncated"), ("ints.npy", "`q` is declared f32 but the file holds i32"), ("absent.npy", ""), ("q.csv", "")]
    {
        let err = d.fails(&["run", "prog.attn", "--input", &format!("q={file}"), "--random-inputs"], 3);
        assert!(err.contains(says), "{file}: {err}");
    }
}

#[test]
fn shape_mismatch_is_a_runtime_error() {
    let d = Dir::new();
    io::write_npy(&d.path("q.npy"), &f32_tensor(vec![2, 5, 3], 1)).unwrap();
    io::write_npy(&d.path("k.npy"), &f32_tensor(vec![2, 4, 3], 1)).unwrap();
    let o = d.attnc(&["run", "prog.attn", "--input", "q=q.npy", "--input", "k=k.npy", "--random-inputs"]);
    assert_eq!(code(&o), 4, "{}", stderr(&o));
    // The declaration it contradicts (E0401), then the one `error:` line.
    let err = stderr(&o);
    assert!(err.contains("error[E0401]"), "{err}");
    assert!(err.lines().last().is_some_and(|l| l.starts_with("error: ")), "{err}");
    assert_eq!(err.lines().filter(|l| l.starts_with("error: ")).count(), 1, "{err}");
}

#[test]
fn unwritable_output_is_a_file_error() {
    let d = Dir::new();
    let o = d.attnc(&["run", "prog.attn", "--random-inputs", "--output", "out=no/such/dir/out.npy"]);
    assert_eq!(code(&o), 3);
    assert!(stderr(&o).contains("cannot write") && stderr(&o).contains("no/such/dir"), "{}", stderr(&o));
    // Checked before running: nothing was computed, so no summary line was printed.
    assert!(stdout(&o).is_empty(), "{}", stdout(&o));
    std::fs::write(d.path("plain"), b"").unwrap();
    let o = d.attnc(&["run", "prog.attn", "--random-inputs", "--out-dir", "plain"]);
    assert_eq!(code(&o), 3);
}

#[test]
fn unavailable_target() {
    let d = Dir::new();
    let o = d.attnc(&["run", "prog.attn", "--random-inputs", "--target", "cuda"]);
    if attn_runtime::cuda::device_info().is_err() {
        // No driver, device or NVRTC here: one sentence and the "target unavailable" code.
        assert_eq!(code(&o), 5, "{}", stderr(&o));
        assert!(stderr(&o).starts_with("error: the CUDA target is not available: "), "{}", stderr(&o));
        assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));
    } else {
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    }
    let o = d.attnc(&["run", "prog.attn", "--random-inputs", "--target", "tpu"]);
    assert_eq!(code(&o), 2);
}

#[test]
fn build_emits_the_library_text() {
    let d = Dir::new();
    let o = d.attnc(&["build", "prog.attn", "--emit", "ir"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o).trim_end(), emit(SRC, Stage::Ir).unwrap().trim_end());
    let o = d.attnc(&["build", "prog.attn", "--emit", "ast", "-o", "ast.txt"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(d.path("ast.txt")).unwrap(), emit(SRC, Stage::Ast).unwrap());
    let o = d.attnc(&["build", "prog.attn", "--emit", "dot", "--entry", "scale"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).starts_with("digraph"), "{}", stdout(&o));
    let o = d.attnc(&["build", "bad.attn"]);
    assert_eq!(code(&o), 1);
    let o = d.attnc(&["build", "prog.attn", "--emit", "clif"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).starts_with("; graph") && stdout(&o).contains("function %"), "{}", stdout(&o));
    let o = d.attnc(&["build", "prog.attn", "--emit", "mlir"]);
    assert_eq!(code(&o), 2);
}

#[test]
fn help_everywhere_lists_exit_codes() {
    let d = Dir::new();
    for args in [&["--help"][..], &["check", "--help"], &["build", "--help"], &["run", "--help"]] {
        let o = d.attnc(args);
        assert_eq!(code(&o), 0, "{args:?}");
        assert!(stdout(&o).contains("Exit codes:"), "{args:?}: {}", stdout(&o));
    }
    let o = d.attnc(&["run", "--help"]);
    assert!(stdout(&o).contains("8 for every other dim"), "{}", stdout(&o));
    let o = d.attnc(&["frobnicate"]);
    assert_eq!(code(&o), 2);
}

#[test]
fn bool_and_f16_outputs_are_written() {
    let d = Dir::new();
    std::fs::write(d.path("cmp.attn"), "fn cmp(x: f32[N]) -> (m: bool[N], h: f16[N]) {\n  return x > 0, cast(x, f16)\n}\n").unwrap();
    io::write_npy(&d.path("x.npy"), &Tensor::f32(vec![3], vec![-1.0, 0.5, 2.0]).unwrap()).unwrap();
    let o = d.attnc(&["run", "cmp.attn", "--input", "x.npy", "--out-dir", "o"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let m = io::read_npy(&d.path("o/m.npy")).unwrap();
    assert_eq!(io::convert("m", m, DType::Bool).unwrap().data, TensorData::Bool(vec![false, true, true]));
    let h = io::read_npy(&d.path("o/h.npy")).unwrap();
    assert_eq!(h.dtype, FileDType::F16);
}

/// Issue 13: outputs never overwrite what the run reads, and thread counts are checked.
#[test]
fn outputs_never_overwrite_inputs_and_threads_are_checked() {
    let dir = Dir::new();
    let before = std::fs::read_to_string(dir.path("prog.attn")).unwrap();
    let o = dir.attnc(&["build", "prog.attn", "--emit", "ir", "-o", "./prog.attn"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("refusing to overwrite"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(dir.path("prog.attn")).unwrap(), before);

    let q = dir.path("q.npy");
    io::write_npy(&q, &f32_tensor(vec![1, 4, 2], 1)).unwrap();
    let o = dir.attnc(&["run", "prog.attn", "--entry", "scale", "--input", "x=q.npy", "--random-inputs", "--output", "q.npy"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("also an input"), "{}", stderr(&o));
    assert_eq!(io::read_npy(&q).unwrap().shape, vec![1, 4, 2]);

    // `--out-dir` names its files after the outputs: `out.npy` here, which is an input.
    io::write_npy(&dir.path("out.npy"), &f32_tensor(vec![4], 1)).unwrap();
    let o = dir.attnc(&["run", "prog.attn", "--entry", "scale", "--input", "x=out.npy", "--random-inputs", "--out-dir", "."]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert_eq!(io::read_npy(&dir.path("out.npy")).unwrap().shape, vec![4]);

    for bad in ["100000", "-1", "many"] {
        let o = dir.attnc(&["run", "prog.attn", "--random-inputs", "--out-dir", "o", "--threads", bad]);
        assert_eq!(code(&o), 2, "--threads {bad}: {}", stderr(&o));
    }
    let o = dir.attnc(&["run", "prog.attn", "--random-inputs", "--out-dir", "o", "--threads", "4096"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

/// Warnings are printed and accepted; `--deny-warnings` makes them fail with exit 1.
#[test]
fn warnings_print_and_deny_warnings_fails() {
    let dir = Dir::new();
    std::fs::write(dir.path("warn.attn"), "fn f(x: f32[N], y: f32[N]) -> f32[N] {\n  return x\n}\n").unwrap();
    let o = dir.attnc(&["check", "warn.attn"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stderr(&o).contains("warning[W0002]"), "{}", stderr(&o));
    let o = dir.attnc(&["--deny-warnings", "check", "warn.attn"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("--deny-warnings"), "{}", stderr(&o));
    let o = dir.attnc(&["check", "prog.attn", "--deny-warnings", "--timings"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stderr(&o).contains("stopped: saturated"), "{}", stderr(&o));
}

/// `--input NAME=-` reads a `.npy` (or `.safetensors`) tensor from standard input.
#[test]
fn an_input_can_come_from_stdin() {
    use std::io::Write as _;
    let dir = Dir::new();
    let bytes = io::encode_npy(&f32_tensor(vec![4], 3)).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_attnc"))
        .args(["run", "prog.attn", "--entry", "scale", "--input", "x=-", "--random-inputs", "--output", "out=y.npy"])
        .current_dir(&dir.0)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(&bytes).unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(io::read_npy(&dir.path("y.npy")).unwrap().shape, vec![4]);

    let o = dir.attnc(&["run", "prog.attn", "--entry", "scale", "--input", "x=-", "--input", "s=-"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
}

/// An input that contradicts its declaration is shown against the source: E0401 at the
/// parameter, with the declared and the given type.
#[test]
fn input_errors_point_at_the_declaration() {
    let dir = Dir::new();
    io::write_npy(&dir.path("q.npy"), &f32_tensor(vec![1, 8, 4], 1)).unwrap();
    io::write_npy(&dir.path("k.npy"), &f32_tensor(vec![1, 9, 4], 2)).unwrap();
    for target in ["cpu", "interp"] {
        let o = dir.attnc(&["run", "prog.attn", "--input", "q=q.npy", "--input", "k=k.npy", "--random-inputs", "--target", target]);
        assert_eq!(code(&o), 4, "{}", stderr(&o));
        let err = stderr(&o);
        assert!(err.contains("error[E0401]") && err.contains("`k` is declared f32[B, S, D] here"), "{err}");
        assert!(err.contains("the input given for `k` is f32[1, 9, 4]"), "{err}");
    }
}

/// A slice that leaves its axis, or a size that turns negative, for some dims only (here after
/// `topk`, whose result is a slice of a sort) is shown at the expression on every target: E0403
/// and E0404, not an IR node number alone.
#[test]
fn run_time_faults_point_at_the_source() {
    let d = Dir::new();
    let slice = "fn f(x: f32[S, N]) -> f32[S, 2] {\n    let (v, _i) = topk(x, N - 4, axis = -1)\n    return v[:, 3:5]\n}\n";
    let negative = "fn f(x: f32[S, N]) -> f32[S, N - 6] {\n    let (v, _i) = topk(x, N - 6, axis = -1)\n    return v\n}\n";
    std::fs::write(d.path("slice.attn"), slice).unwrap();
    std::fs::write(d.path("negative.attn"), negative).unwrap();
    for target in ["cpu", "interp"] {
        let o = d.attnc(&["run", "slice.attn", "--random-inputs", "--dim", "S=2", "--dim", "N=10", "--target", target]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let err = d.fails(&["run", "slice.attn", "--random-inputs", "--dim", "S=2", "--dim", "N=8", "--target", target], 4);
        assert!(err.contains("error[E0403]: slice 3:5 is out of range for axis 1 of size 4"), "{target}: {err}");
        assert!(err.contains("slice.attn:3:12") && err.contains("sliced here"), "{target}: {err}");
        let err = d.fails(&["run", "negative.attn", "--random-inputs", "--dim", "S=2", "--dim", "N=4", "--target", target], 4);
        assert!(err.contains("error[E0404]: size N-6 evaluates to -2"), "{target}: {err}");
        assert!(err.contains("negative.attn:2:19") && err.contains("topk(x, N - 6, axis = -1)"), "{target}: {err}");
    }
}

// ---- pictures: explain's tile maps, run --heatmap ----

/// Decodes a PNG file: width, height and RGB bytes.
fn decode_png(path: &Path) -> (usize, usize, Vec<u8>) {
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    (info.width as usize, info.height as usize, buf)
}

/// A directory holding `causal.attn` from the examples.
fn causal_dir() -> Dir {
    let d = Dir::new();
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/causal.attn");
    std::fs::copy(example, d.path("causal.attn")).unwrap();
    d
}

#[test]
fn explain_prints_and_draws_tile_maps() {
    let d = causal_dir();
    let o = d.attnc(&["explain", "causal.attn", "--dim", "S=256", "--tile-size", "32x64"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("256x256 scores in 32x64 tiles (8x4)"), "{out}");
    // Query blocks down, key blocks across: the first row of tiles keeps only its first key tile.
    assert!(out.contains("\n    ▒···\n"), "{out}");
    let o = d.attnc(&["explain", "causal.attn", "--dim", "S=512", "--tiles", "map.png"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("wrote map.png (1 tile map)"), "{}", stdout(&o));
    let (w, h, _) = decode_png(&d.path("map.png"));
    assert!(w >= 256 && h >= 256, "{w}x{h}");
}

/// A mask that reads segment ids is partial below the diagonal at compile time; from the data,
/// tiles across documents are skipped and tiles inside one run in full.
#[test]
fn explain_classifies_data_masks_from_inputs() {
    let d = Dir::new();
    // `attend` keeps its weights, so it has no flash op; this one fuses.
    std::fs::write(
        d.path("doc.attn"),
        "fn doc(q: f32[B, S, D], k: f32[B, S, D], v: f32[B, S, D], seg: i32[B, S]) -> f32[B, S, D] {\n    let s = q @ k.T\n    let (b, i, j) = indices(s)\n    return softmax(where(seg[b, i] == seg[b, j] && j <= i, s, -inf), axis = -1) @ v\n}\n",
    )
    .unwrap();
    let o = d.attnc(&["explain", "doc.attn", "--dim", "S=256", "--dim", "B=1", "--tile-size", "16x16"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let compile_time = stdout(&o);
    assert!(compile_time.contains("0 full, 136 partial (mask tested), 120 skipped"), "{compile_time}");
    let o = d.attnc(&["explain", "doc.attn", "--dim", "S=256", "--dim", "B=1", "--tile-size", "16x16", "--random-inputs"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("(classified from the input data)"), "{out}");
    let line = out.lines().find(|l| l.contains("256x256 scores")).unwrap_or_default();
    let count = |what: &str| -> usize {
        let at = line.find(what).unwrap_or(0);
        line[..at].trim_end().rsplit([' ', ':']).next().and_then(|n| n.parse().ok()).unwrap_or(0)
    };
    assert!(count(" full") > 0 && count(" skipped") > 120, "{line}");
    // A missing input names itself.
    let o = d.attnc(&["explain", "doc.attn", "--input", "q=nope.npy"]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
}

/// `explain` rejects a dim the program does not use, with `run`'s message and exit code.
#[test]
fn explain_rejects_unknown_dims_like_run() {
    let d = causal_dir();
    for (file, entry) in [("causal.attn", None), ("prog.attn", Some("attend"))] {
        let entry: Vec<&str> = entry.map(|e| vec!["--entry", e]).unwrap_or_default();
        let run = d.fails(&[&["run", file, "--random-inputs", "--dim", "Q=64"], &entry[..]].concat(), 2);
        let explain = d.fails(&[&["explain", file, "--dim", "Q=64"], &entry[..]].concat(), 2);
        assert!(run.contains("has no dimension named `Q`"), "{run}");
        assert_eq!(explain, run);
    }
    // Every function at once: a dim none of them uses.
    let err = d.fails(&["explain", "prog.attn", "--dim", "Q=64"], 2);
    assert!(err.contains("no function of the program has a dimension named `Q` (their dimensions: B, D, N, S)"), "{err}");
    let o = d.attnc(&["explain", "prog.attn", "--dim", "N=64"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

#[test]
fn explain_tile_map_errors() {
    let d = causal_dir();
    // No flash op in `scale`.
    let o = d.attnc(&["explain", "prog.attn", "--entry", "scale", "--tiles", "map.png"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("no flash op"), "{}", stderr(&o));
    assert!(!d.path("map.png").exists());
    // A folder that does not exist: said before anything is computed.
    let o = d.attnc(&["explain", "prog.attn", "--tiles", "missing/map.png"]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert!(stderr(&o).contains("cannot write missing/map.png"), "{}", stderr(&o));
    // Too many tiles.
    let o = d.attnc(&["explain", "causal.attn", "--dim", "S=100000000", "--tile-size", "1x1"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("E0905") && stderr(&o).contains("use larger tiles"), "{}", stderr(&o));
    for bad in ["0x64", "64", "axb", "64x70000"] {
        let o = d.attnc(&["explain", "prog.attn", "--tile-size", bad]);
        assert_eq!(code(&o), 2, "--tile-size {bad}: {}", stderr(&o));
    }
    // The program itself is never overwritten.
    let o = d.attnc(&["explain", "prog.attn", "--tiles", "prog.attn"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(std::fs::read_to_string(d.path("prog.attn")).unwrap().starts_with("fn scale"));
}

#[test]
fn run_draws_heatmaps_with_labels() {
    let d = Dir::new();
    std::fs::write(d.path("rows.txt"), "a\nb\nc\nd\n").unwrap();
    std::fs::write(d.path("cols.txt"), "w\nx\ny\nz\n").unwrap();
    let args = ["run", "prog.attn", "--random-inputs", "--dim", "B=2", "--dim", "S=4", "--heatmap", "w=w.png"];
    let o = d.attnc(&[&args[..], &["--labels", "rows.txt,cols.txt"]].concat());
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("wrote w.png (heatmap of `w`: 2 panels)"), "{}", stdout(&o));
    let (w, h, _) = decode_png(&d.path("w.png"));
    assert!(w > 100 && h > 60, "{w}x{h}");
    // Labels that do not fit the output, an unknown output, and a missing labels file.
    std::fs::write(d.path("cols.txt"), "w\nx\n").unwrap();
    let o = d.attnc(&[&args[..], &["--labels", "rows.txt,cols.txt"]].concat());
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("4 row labels and 2 column labels for 4 rows and 4 columns"), "{}", stderr(&o));
    let o = d.attnc(&["run", "prog.attn", "--random-inputs", "--heatmap", "nosuch=x.png"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    let o = d.attnc(&[&args[..], &["--labels", "none.txt,cols.txt"]].concat());
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    let o = d.attnc(&["run", "prog.attn", "--random-inputs", "--heatmap", "w=missing/w.png"]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    let o = d.attnc(&["run", "prog.attn", "--random-inputs", "--heatmap", "w.png"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
}

/// Under a memory limit the interpreter reports the allocation it could not make (exit 4)
/// instead of aborting.
#[test]
fn the_interpreter_reports_memory_it_cannot_get() {
    let dir = Dir::new();
    std::fs::write(dir.path("big.attn"), "fn outer(x: f32[N, 1], y: f32[1, N]) -> f32[N, N] {\n  return x @ y\n}\n").unwrap();
    let bin = env!("CARGO_BIN_EXE_attnc");
    let script = format!("ulimit -v 2000000; exec {bin} run big.attn --target interp --random-inputs --dim N=40000");
    let o = Command::new("sh").args(["-c", &script]).current_dir(&dir.0).output().unwrap();
    assert_eq!(code(&o), 4, "{}", stderr(&o));
    assert!(stderr(&o).contains("cannot allocate"), "{}", stderr(&o));
}

#[test]
fn bench_names_the_machine_and_rejects_zero_iterations() {
    let d = Dir::new();
    let o = d.attnc(&["bench", "prog.attn", "--iters", "0"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("at least one timed run"), "{}", stderr(&o));
    let o = d.attnc(&["bench", "prog.attn", "--dim", "S=16", "--iters", "1", "--warmup", "0", "--threads", "1", "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = stdout(&o);
    let isa = attn_runtime::kernels::isa().name();
    assert!(out.contains(&format!("kernels on the {isa} path")), "{out}");
    assert!(out.contains(&format!("\"isa\": \"{isa}\"")), "{out}");
    let peak = out.lines().find(|l| l.trim_start().starts_with("peak:")).unwrap_or_default();
    assert!(peak.contains("GFLOP/s") && !peak.contains("inf"), "{out}");
}

#[test]
fn bench_times_given_inputs_and_derives_dims_from_them() {
    let d = Dir::new();
    let saved = d.path("saved");
    let save = d.attnc(&[
        "bench",
        "prog.attn",
        "--dim",
        "S=12",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--threads",
        "1",
        "--save-inputs",
        saved.to_str().unwrap(),
    ]);
    assert_eq!(code(&save), 0, "{}", stderr(&save));
    // q from a file fixes B, S and D; the other inputs are random at those dims.
    let q = format!("q={}", saved.join("q.npy").display());
    let o = d.attnc(&["bench", "prog.attn", "--input", &q, "--iters", "1", "--warmup", "0", "--threads", "1"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("S=12"), "{}", stdout(&o));
    let o = d.attnc(&["bench", "prog.attn", "--input", &q.replacen("q=", "qq=", 1), "--iters", "1"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("no parameter named `qq`"), "{}", stderr(&o));
}

// ---- build --emit svg ----

/// An example program's absolute path.
fn example(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples").join(name).display().to_string()
}

/// Parses an SVG file as XML; returns its text and the count of elements with each class.
fn read_svg(path: &Path, classes: &[&str]) -> (String, Vec<usize>) {
    let text = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("{} is not XML: {e}", path.display()));
    let counts = classes.iter().map(|c| doc.descendants().filter(|n| n.attribute("class") == Some(*c)).count()).collect();
    (text, counts)
}

#[test]
fn build_draws_the_graph_as_svg() {
    let d = Dir::new();
    let o = d.attnc(&["build", &example("sdpa.attn"), "--emit", "svg", "-o", "g.svg"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    // sdpa's IR: 3 parameters, 7 ops, 1 output, no flash op.
    let (text, counts) = read_svg(&d.path("g.svg"), &["param", "op", "output", "flash"]);
    assert_eq!(counts, [3, 7, 1, 0], "{text}");
    assert!(text.contains(">f32[B, H, S, D]</text>"), "{text}");
    assert!(text.contains("<title>sdpa: IR graph</title>"), "{text}");
    // Without -o the picture goes to stdout.
    let o = d.attnc(&["build", &example("sdpa.attn"), "--emit", "svg"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(roxmltree::Document::parse(&stdout(&o)).is_ok(), "{}", stdout(&o));
}

#[test]
fn build_draws_the_optimised_graph_as_svg_with_flash_ops() {
    let d = Dir::new();
    let o = d.attnc(&["build", &example("causal.attn"), "--emit", "svg-opt", "-o", "g.svg"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let (text, counts) = read_svg(&d.path("g.svg"), &["flash", "param", "output"]);
    assert_eq!(counts, [1, 3, 1], "{text}");
    let flash = text.lines().find(|l| l.starts_with("<rect class=\"flash\"")).unwrap_or_default();
    assert!(flash.contains(&format!("fill=\"{}\"", attnc::pictures::svg::FLASH_FILL)), "{text}");
    assert!(text.contains("<tspan") && text.contains(">mask: j &lt;= i</tspan>"), "{text}");
    assert!(text.contains("optimised"), "{text}");
    // The same program drawn twice gives the same bytes.
    let o = d.attnc(&["build", &example("causal.attn"), "--emit", "svg-opt", "-o", "again.svg"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(std::fs::read(d.path("g.svg")).unwrap(), std::fs::read(d.path("again.svg")).unwrap());
}

#[test]
fn build_svg_errors() {
    let d = Dir::new();
    let o = d.attnc(&["build", &example("sdpa.attn"), "--emit", "svg", "-o", "no/such/dir/g.svg"]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert!(stderr(&o).contains("cannot write") && stderr(&o).contains("g.svg"), "{}", stderr(&o));
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    let o = d.attnc(&["build", &example("causal.attn"), "--emit", "svg-opt", "--entry", "nosuch"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("nosuch"), "{}", stderr(&o));
    // A graph over the layout limit is refused with a usage error that points at dot.
    let body: String = (0..400).map(|k| format!("    let x{} = exp(x{k})\n", k + 1)).collect();
    std::fs::write(d.path("long.attn"), format!("fn long(x0: f32[N]) -> f32[N] {{\n{body}    return x400\n}}\n")).unwrap();
    let o = d.attnc(&["build", "long.attn", "--emit", "svg"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("too large to draw") && stderr(&o).contains("--emit dot"), "{}", stderr(&o));
}

#[test]
fn grad_runs_builds_and_benches_the_derived_program() {
    let d = Dir::new();
    // Two results, so two cotangents (d_out, d_w); seg is i32 and gets no gradient.
    let run = d.attnc(&["run", "prog.attn", "--grad", "--random-inputs", "--dim", "S=5", "--out-dir", "g"]);
    assert_eq!(code(&run), 0, "{}", stderr(&run));
    let names: Vec<String> = stdout(&run).lines().filter_map(|l| l.split(':').next()).map(String::from).collect();
    assert_eq!(names, ["out", "w", "d_q", "d_k", "d_v"]);
    assert_eq!(read_f32(&d.path("g/d_q.npy")).shape, vec![8, 5, 8]);

    let wrt = d.attnc(&["run", "prog.attn", "--grad", "--wrt", "v", "--random-inputs", "--dim", "S=5"]);
    assert_eq!(code(&wrt), 0, "{}", stderr(&wrt));
    assert_eq!(stdout(&wrt).lines().count(), 3, "{}", stdout(&wrt));
    let bad = d.attnc(&["run", "prog.attn", "--grad", "--wrt", "seg", "--random-inputs"]);
    assert_eq!(code(&bad), 2);
    assert!(stderr(&bad).contains("only floating-point parameters have gradients"), "{}", stderr(&bad));
    let missing = d.attnc(&["run", "prog.attn", "--wrt", "v", "--random-inputs"]);
    assert_eq!(code(&missing), 2, "--wrt needs --grad");

    let ir = d.attnc(&["build", "prog.attn", "--grad", "--entry", "scale", "--emit", "ir"]);
    assert_eq!(code(&ir), 0, "{}", stderr(&ir));
    let text = stdout(&ir);
    assert!(text.starts_with("graph scale_grad {") && text.contains("output d_s = "), "{text}");
    let ast = d.attnc(&["build", "prog.attn", "--grad", "--emit", "ast"]);
    assert_eq!(code(&ast), 2);

    let bench = d.attnc(&["bench", "prog.attn", "--grad", "--dim", "S=16", "--iters", "1", "--threads", "1"]);
    assert_eq!(code(&bench), 0, "{}", stderr(&bench));
    assert!(stdout(&bench).contains("attend_grad"), "{}", stdout(&bench));
}
