//! Dim binding and input checks.

use super::*;

#[test]
fn binds_names_and_solves_products_across_inputs() {
    // `x` comes first, so H*D can only be solved after `h` binds H.
    let mut g = Graph::new("bind");
    param(&mut g, "x", f32ty(&["S", "H*D"]));
    param(&mut g, "h", f32ty(&["H"]));
    param(&mut g, "q", f32ty(&["B", "S"]));
    let env = bind_dims(&g, &[vec![5, 512], vec![8], vec![2, 5]], &HashMap::new()).unwrap();
    assert_eq!(env, dims(&[("S", 5), ("H", 8), ("D", 64), ("B", 2)]));
}

#[test]
fn given_dims_help_solving() {
    let mut g = Graph::new("bind");
    param(&mut g, "x", f32ty(&["H*D", "2*S+1"]));
    let env = bind_dims(&g, &[vec![512, 9]], &dims(&[("H", 8)])).unwrap();
    assert_eq!(env, dims(&[("S", 4), ("H", 8), ("D", 64)]));
}

#[test]
fn conflicting_sizes_name_both_places() {
    let mut g = Graph::new("bind");
    param(&mut g, "q", f32ty(&["S", "D"]));
    param(&mut g, "k", f32ty(&["S", "D"]));
    let err = bind_dims(&g, &[vec![7, 4], vec![9, 4]], &HashMap::new()).unwrap_err();
    assert_eq!(
        err,
        ExecError::DimMismatch {
            param: "k".into(),
            axis: 0,
            dim: "S".into(),
            expected: 7,
            actual: 9,
            bound_from: "bound by `q` axis 0".into()
        }
    );
    assert_eq!(err.to_string(), "`k` axis 0 has size 9, but S = 7 (bound by `q` axis 0)");

    let err = bind_dims(&g, &[vec![7, 4], vec![7, 4]], &dims(&[("S", 3)])).unwrap_err();
    assert!(matches!(&err, ExecError::DimMismatch { param, expected: 3, actual: 7, .. } if param == "q"), "{err}");
    assert!(err.to_string().contains("--dim"), "{err}");
}

#[test]
fn conflicting_expression_names_its_bindings() {
    let mut g = Graph::new("bind");
    param(&mut g, "h", f32ty(&["H"]));
    param(&mut g, "d", f32ty(&["D"]));
    param(&mut g, "x", f32ty(&["H*D"]));
    let err = bind_dims(&g, &[vec![8], vec![65], vec![512]], &HashMap::new()).unwrap_err();
    let ExecError::DimMismatch { param, dim, expected, actual, bound_from, .. } = &err else { panic!("{err}") };
    assert_eq!((param.as_str(), dim.as_str(), *expected, *actual), ("x", "D*H", 520, 512));
    assert_eq!(bound_from, "D = 65 bound by `d` axis 0; H = 8 bound by `h` axis 0");
}

#[test]
fn fixed_dims_are_checked() {
    let mut g = Graph::new("bind");
    param(&mut g, "x", f32ty(&["4", "D"]));
    let err = bind_dims(&g, &[vec![5, 2]], &HashMap::new()).unwrap_err();
    assert_eq!(err, ExecError::FixedDim { param: "x".into(), axis: 0, expected: 4, actual: 5, declared: "f32[4, D]".into() });
}

#[test]
fn unsolvable_dims() {
    let mut g = Graph::new("bind");
    param(&mut g, "x", f32ty(&["H*D"]));
    // 500 is not a multiple of 8.
    let err = bind_dims(&g, &[vec![500]], &dims(&[("H", 8)])).unwrap_err();
    assert!(matches!(&err, ExecError::Unsolvable { param, axis: 0, dim, .. } if param == "x" && dim == "D*H"), "{err}");
    // Two unknowns: the error suggests giving one.
    let err = bind_dims(&g, &[vec![512]], &HashMap::new()).unwrap_err();
    assert!(matches!(&err, ExecError::Unsolvable { .. }), "{err}");
    assert!(err.to_string().contains("--dim D=N"), "{err}");
}

#[test]
fn unbound_dims_are_reported() {
    let g = dim_value(&["S"], Dim::sym("T"));
    let err = bind_dims(&g, &[vec![3]], &HashMap::new()).unwrap_err();
    assert_eq!(err, ExecError::UnboundDim { name: "T".into() });
    assert!(err.to_string().contains("--dim T=N"));
    let out = run(&g, &[tf(&[3], &[0.; 3])], &dims(&[("T", 11)])).unwrap();
    assert_eq!(out, vec![ti(&[], &[11])]);
}

#[test]
fn negative_sizes_and_bad_given_dims() {
    let g = one_op(&[("x", f32ty(&["S"]))], Op::Slice { axis: 0, start: Dim::constant(4), end: Dim::sym("S") });
    let err = bind_dims(&g, &[vec![2]], &HashMap::new()).unwrap_err();
    assert!(matches!(&err, ExecError::NegativeDim { value: -2, .. }), "{err}");
    let err = bind_dims(&g, &[vec![6]], &dims(&[("S", -1)])).unwrap_err();
    assert_eq!(err, ExecError::GivenDim { name: "S".into(), value: -1 });
}

#[test]
fn input_checks() {
    let mut g = Graph::new("inputs");
    let x = param(&mut g, "x", f32ty(&["B", "S"]));
    g.add_output("x", x);
    let no = HashMap::new();
    let err = run(&g, &[], &no).unwrap_err();
    assert_eq!(err, ExecError::InputCount { expected: 1, actual: 0, missing: vec!["x".into()] });
    let err = run(&g, &[ti(&[2, 2], &[1, 2, 3, 4])], &no).unwrap_err();
    assert!(matches!(err, ExecError::InputDType { expected: DType::F32, actual: DType::I32, .. }));
    let err = run(&g, &[tf(&[4], &[1., 2., 3., 4.])], &no).unwrap_err();
    assert_eq!(err, ExecError::InputRank { param: "x".into(), expected: 2, actual: 1, declared: "f32[B, S]".into() });
    // A tensor built by hand whose storage is too short.
    let short = Tensor { dtype: DType::F32, shape: vec![2, 3], data: crate::tensor::TensorData::F32(vec![0.; 5]) };
    let err = run(&g, &[short], &no).unwrap_err();
    assert!(matches!(err, ExecError::InputData { expected: 6, actual: 5, .. }), "{err}");
    // And the happy path returns the input unchanged.
    assert_eq!(run(&g, &[tf(&[1, 2], &[1., 2.])], &no).unwrap(), vec![tf(&[1, 2], &[1., 2.])]);
}
