//! The embedding API on small programs.

use super::*;
use attn_compiler::tensor::TensorData;
use attn_cpu::{OutData, OutRef};

const SRC: &str = "
dim H = 2

fn scale(x: f32[N], s: f32) -> f32[N] {
    return x * s
}

fn pick(x: f32[B, S, H*Dh], seg: i32[B, S], m: bool[S]) -> (y: f32[B, S, H*Dh], n: f32[S]) {
    return x + 1, where(m, cast(seg[0, :], f32), 0.0)
}
";

fn program() -> Program {
    Program::from_source(SRC, "t.attn").unwrap()
}

#[test]
fn doc_example_runs() {
    let program = Program::from_source("fn double(x: f32[N]) -> f32[N] { return x * 2 }", "double.attn").unwrap();
    let x = Tensor::f32(vec![3], vec![1.0, 2.0, 3.0]).unwrap();
    let outputs = program.run("double", [("x", x)], &RunOptions::default()).unwrap();
    assert_eq!(outputs[0].0, "out");
    assert_eq!(outputs[0].1.to_f64_vec(), vec![2.0, 4.0, 6.0]);
}

#[test]
fn entries_and_default_entry() {
    let p = program();
    let entries = p.entries();
    let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["scale", "pick"]);
    let pick = p.default_entry().unwrap();
    assert_eq!(pick.name, "pick");
    assert_eq!(pick.to_string(), "pick(x: f32[B, S, 2*Dh], seg: i32[B, S], m: bool[S]) -> (y: f32[B, S, 2*Dh], n: f32[S])");
    assert_eq!(p.fixed_dims(), &[("H".to_string(), 2)]);
    assert_eq!(p.entry_dims("pick").unwrap(), ["B", "Dh", "S"]);
}

#[test]
fn inputs_in_any_order_and_f16_widens() {
    let p = program();
    let x = Tensor::new(DType::F16, vec![2], TensorData::F32(vec![1.0, 2.0])).unwrap();
    let s = Tensor::f32(vec![], vec![3.0]).unwrap();
    let out = p.run("scale", vec![("s".to_string(), s), ("x".to_string(), x)], &RunOptions::default()).unwrap();
    assert_eq!(out[0].1.to_f64_vec(), vec![3.0, 6.0]);
}

#[test]
fn input_name_errors() {
    let p = program();
    let x = || Tensor::f32(vec![2], vec![1.0, 2.0]).unwrap();
    let s = || Tensor::f32(vec![], vec![3.0]).unwrap();
    let opts = RunOptions::default();
    match p.run("scale", [("x", x())], &opts) {
        Err(RunError::MissingInputs { names, .. }) => assert_eq!(names, ["s"]),
        other => panic!("{other:?}"),
    }
    match p.run("scale", [("x", x()), ("ss", s())], &opts) {
        Err(e @ RunError::UnexpectedInput { .. }) => assert!(e.to_string().contains("its parameters: x, s"), "{e}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(p.run("scale", [("x", x()), ("x", x())], &opts), Err(RunError::DuplicateInput { .. })));
    assert!(matches!(p.run("scal", [("x", x())], &opts), Err(RunError::UnknownEntry { .. })));
    let i = Tensor::i32(vec![2], vec![1, 2]).unwrap();
    assert!(matches!(p.run("scale", [("x", i), ("s", s())], &opts), Err(RunError::InputDType { .. })));
}

#[test]
fn dims_are_checked_against_the_entry_and_the_file() {
    let p = program();
    let mut opts = RunOptions::default();
    opts.dims.insert("Q".into(), 3);
    assert!(matches!(p.random_inputs("pick", 0, &opts.dims), Err(RunError::UnknownDim { .. })));
    let fixed = HashMap::from([("H".to_string(), 3)]);
    assert!(matches!(p.random_inputs("pick", 0, &fixed), Err(RunError::FixedDim { fixed: 2, given: 3, .. })));
    let same = HashMap::from([("H".to_string(), 2), ("S".to_string(), 5)]);
    let inputs = p.random_inputs("pick", 0, &same).unwrap();
    assert_eq!(inputs[0].1.shape, vec![8, 5, 16]);
}

/// A name the signature divides (`D/2`) is given by its own size: `D=6` binds `D/2` to 3, and
/// an odd `D` is refused, as is an input of odd width.
#[test]
fn a_divided_dim_is_given_whole() {
    let p = Program::from_source("fn h(x: f32[S, D], w: f32[D/2]) -> f32[S, D/2] {\n    return x[:, 0::2] * w\n}\n", "h.attn").unwrap();
    let inputs = p.random_inputs("h", 0, &HashMap::from([("S".to_string(), 2), ("D".to_string(), 6)])).unwrap();
    assert_eq!((inputs[0].1.shape.clone(), inputs[1].1.shape.clone()), (vec![2, 6], vec![3]));
    match p.random_inputs("h", 0, &HashMap::from([("S".to_string(), 2), ("D".to_string(), 7)])) {
        Err(e @ RunError::IndivisibleDim { divisor: 2, given: 7, .. }) => assert!(e.to_string().contains("D = 2*(D/2)"), "{e}"),
        other => panic!("{other:?}"),
    }
    let odd = [("x", Tensor::f32(vec![2, 5], vec![0.0; 10]).unwrap()), ("w", Tensor::f32(vec![2], vec![0.0; 2]).unwrap())];
    assert!(p.run("h", odd, &RunOptions::default()).is_err());
}

#[test]
fn random_inputs_run_and_are_deterministic() {
    let p = program();
    let dims = HashMap::new();
    let a = p.random_inputs("pick", 42, &dims).unwrap();
    assert_eq!(a, p.random_inputs("pick", 42, &dims).unwrap());
    let names: Vec<&str> = a.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["x", "seg", "m"]);
    let opts = RunOptions { dims: p.random_dims("pick", &dims).unwrap(), ..RunOptions::default() };
    let out = p.run("pick", a.clone(), &opts).unwrap();
    assert_eq!(out[0].0, "y");
    assert_eq!(out[0].1.shape, vec![8, 8, 16]);
    let expect_y: Vec<f64> = a[0].1.to_f64_vec().iter().map(|v| f64::from((*v as f32) + 1.0)).collect();
    assert_eq!(out[0].1.to_f64_vec(), expect_y);
}

#[test]
fn a_runtime_shape_mismatch_is_an_interp_error() {
    let p = program();
    let x = Tensor::f32(vec![1, 2, 3], vec![0.0; 6]).unwrap();
    let seg = Tensor::i32(vec![1, 2], vec![0, 1]).unwrap();
    let m = Tensor::new(DType::Bool, vec![2], TensorData::Bool(vec![true, false])).unwrap();
    // 3 is not a multiple of H = 2.
    let err = p.run("pick", [("x", x), ("seg", seg), ("m", m)], &RunOptions::default()).unwrap_err();
    assert!(matches!(err, RunError::Interp(_)), "{err}");
}

#[test]
fn compile_errors_keep_source_and_render() {
    let err = Program::from_source("fn f(x: f32[N]) -> f32[N] {\n  return x + y\n}\n", "bad.attn").unwrap_err();
    assert!(!err.diagnostics.is_empty());
    assert!(err.to_string().starts_with("bad.attn: 1 error in the program"), "{err}");
    let text = err.render(false);
    assert!(text.contains("bad.attn:2:"), "{text}");
}

#[test]
fn from_file_errors() {
    let missing = std::env::temp_dir().join("attn-runtime-definitely-missing.attn");
    assert!(matches!(Program::from_file(&missing), Err(LoadError::Unreadable { .. })));
}

#[test]
fn typo_suggestions() {
    let names = vec!["query".to_string(), "key".to_string(), "v".to_string()];
    assert_eq!(suggest("qurey", &names), Some("query".into()));
    assert_eq!(suggest("Key", &names), Some("key".into()));
    assert_eq!(suggest("w", &names), None);
    assert_eq!(suggest("zzzzzz", &names), None);
}

#[test]
fn borrowed_inputs_run_like_owned_ones_on_every_host_target() {
    let p = program();
    let inputs = p.random_inputs("pick", 5, &HashMap::new()).unwrap();
    let dims = p.random_dims("pick", &HashMap::new()).unwrap();
    let views: Vec<TensorRef> = inputs.iter().map(|(_, t)| TensorRef::of(t)).collect();
    for target in [Target::Cpu, Target::Interp] {
        let opts = RunOptions { dims: dims.clone(), target };
        let cpu = CpuOptions { threads: 1 };
        p.prepare_cpu("pick", &cpu).unwrap();
        let owned = p.run_with("pick", inputs.clone(), &opts, &cpu).unwrap();
        assert_eq!(p.run_borrowed("pick", &views, &opts, &cpu).unwrap(), owned, "{target}");
    }
}

#[test]
fn borrowed_inputs_are_checked() {
    let p = program();
    let opts = RunOptions::default();
    let cpu = CpuOptions::default();
    let x = [1.0f32, 2.0];
    let s = [3.0f32];
    let seg = [0i32];
    let err = p.run_borrowed("scale", &[TensorRef::f32(&[2], &x)], &opts, &cpu).unwrap_err();
    assert!(matches!(&err, RunError::MissingInputs { names, .. } if names == &["s"]), "{err}");
    assert!(err.to_string().contains("missing input for `scale`: `s`"), "{err}");
    let three = [TensorRef::f32(&[2], &x), TensorRef::f32(&[], &s), TensorRef::f32(&[], &s)];
    let err = p.run_borrowed("scale", &three, &opts, &cpu).unwrap_err();
    assert!(matches!(err, RunError::Interp(ExecError::InputCount { expected: 2, actual: 3, .. })), "{err}");
    let err = p.run_borrowed("scale", &[TensorRef::f32(&[2], &x), TensorRef::i32(&[], &seg)], &opts, &cpu).unwrap_err();
    assert!(matches!(&err, RunError::InputDType { param, .. } if param == "s"), "{err}");
    let err = p.run_borrowed("scale", &[TensorRef::f32(&[3], &x), TensorRef::f32(&[], &s)], &opts, &cpu).unwrap_err();
    assert_eq!(err.param(), Some("x"), "{err}");
    let out = p.run_borrowed("scale", &[TensorRef::f32(&[2], &x), TensorRef::f32(&[], &s)], &opts, &cpu).unwrap();
    assert_eq!(out[0].1.to_f64_vec(), vec![3.0, 6.0]);
    let err = p.run_borrowed("nope", &[], &opts, &cpu).unwrap_err();
    assert!(matches!(err, RunError::UnknownEntry { .. }), "{err}");
}

/// Results written into the caller's buffers: in place on the CPU, copied in by the
/// interpreter; a result without a buffer comes back owned; buffers that do not fit are
/// refused before anything is written.
#[test]
fn results_go_into_the_callers_buffers() {
    let p = program();
    let x = [1.0f32, 2.0];
    let s = [3.0f32];
    let inputs = [TensorRef::f32(&[2], &x), TensorRef::f32(&[], &s)];
    let cpu = CpuOptions { threads: 1 };
    for target in [Target::Cpu, Target::Interp] {
        let opts = RunOptions { target, ..RunOptions::default() };
        let mut y = [f32::NAN; 2];
        let mut outs = [Some(OutRef { shape: &[2], data: OutData::F32(&mut y) })];
        let written = p.run_borrowed_into("scale", &inputs, &mut outs, &opts, &cpu).unwrap();
        assert_eq!(written, vec![("out".to_string(), None)], "{target}");
        assert_eq!(y, [3.0, 6.0], "{target}");
        let mut none = [None];
        let owned = p.run_borrowed_into("scale", &inputs, &mut none, &opts, &cpu).unwrap();
        assert_eq!(owned[0].1.as_ref().map(|t| t.to_f64_vec()), Some(vec![3.0, 6.0]), "{target}");

        let mut wrong = [7.0f32; 3];
        let mut outs = [Some(OutRef { shape: &[3], data: OutData::F32(&mut wrong) })];
        let err = p.run_borrowed_into("scale", &inputs, &mut outs, &opts, &cpu).unwrap_err();
        assert!(err.to_string().contains("result `out` is f32[3] (3 elements), but the result is f32[2]"), "{target}: {err}");
        assert_eq!(wrong, [7.0; 3], "{target}: a refused buffer is left as it was");
        let mut ints = [0i32; 2];
        let mut outs = [Some(OutRef { shape: &[2], data: OutData::I32(&mut ints) })];
        let err = p.run_borrowed_into("scale", &inputs, &mut outs, &opts, &cpu).unwrap_err();
        assert!(matches!(err, RunError::Output(CpuError::OutputBuffer { .. })), "{target}: {err}");
        let err = p.run_borrowed_into("scale", &inputs, &mut [None, None], &opts, &cpu).unwrap_err();
        assert!(err.to_string().contains("2 result buffer(s) given for 1 result(s)"), "{target}: {err}");
    }
}

/// The split gradients give the gradients of `Program::grad` bit for bit: the forward returns
/// the result and the flash op's saved result and log-sum-exp, the backward takes them instead
/// of running the flash forward again (ALiBi: the slopes' gradient too).
#[test]
fn split_gradients_are_the_gradients() {
    let src = "fn alibi(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D], slopes: f32[H]) -> f32[B, H, S, D] {
    let scores = q @ k.T / sqrt(D)
    let (b, h, i, j) = indices(scores)
    return softmax(where(j <= i, scores + slopes[h] * (j - i), -inf), axis = -1) @ v
}";
    let p = Program::from_source(src, "alibi.attn").unwrap();
    let dims = HashMap::from([("B".to_string(), 2), ("H".to_string(), 3), ("S".to_string(), 37), ("D".to_string(), 8)]);
    let inputs = p.random_inputs("alibi", 7, &dims).unwrap();
    let grad = p.grad("alibi", None).unwrap();
    let mut with_cot = inputs.clone();
    with_cot.push(("d_out".to_string(), inputs[0].1.clone()));
    let opts = RunOptions { target: Target::Cpu, ..Default::default() };
    let want = grad.run("alibi_grad", with_cot.clone(), &opts).unwrap();
    let split = p.grad_split("alibi", None).unwrap().expect("a fused backward has a split");
    let fwd = split.run("alibi_fwd", inputs.clone(), &opts).unwrap();
    let names: Vec<&str> = fwd.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["out", "saved_out0", "saved_lse0"]);
    assert_eq!(fwd[0].1, want[0].1, "the forward's result");
    let mut bwd_inputs = with_cot;
    bwd_inputs.extend(fwd[1..].iter().cloned());
    let got = split.run("alibi_bwd", bwd_inputs, &opts).unwrap();
    assert_eq!(got.len(), 4);
    for ((gn, g), (wn, w)) in got.iter().zip(&want[1..]) {
        assert_eq!((gn, g), (wn, w), "gradient {wn}");
    }
    // An unfused derivative has no split.
    let additive = "fn f(q: f32[S, D], k: f32[S, D], v: f32[S, D], w: f32[D]) -> f32[S, D] {
    let (i, j) = indices(q @ k.T)
    return softmax(sum(tanh(unsqueeze(q, 1) + unsqueeze(k, 0)) * w, axis = -1), axis = -1) @ v
}";
    let p = Program::from_source(additive, "f.attn").unwrap();
    assert!(p.grad_split("f", None).unwrap().is_none());
}
