//! The verifier names each broken invariant: a correct schedule passes, and each test breaks one
//! invariant of one pass and finds it named.

use super::*;

/// A schedule with a gather (a fault site), a slice, a matmul and a flash op with its merge.
fn planned() -> (Schedule, Policy) {
    let src = "fn f(q: f32[B, S, D], k: f32[B, S, D], v: f32[B, S, D], t: f32[N, D], i: i32[S]) -> (o: f32[B, S, D], p: f32[B, 2, D]) {
        let e = t[i]
        let o = softmax(q @ (k + e).T / sqrt(D), axis = -1) @ v
        let p = q @ k.T @ v
        return o, p[:, 0:2]
    }";
    let checked = crate::check(src).unwrap_or_else(|d| panic!("{}", d[0]));
    let g = crate::opt::optimize(&checked.module.graphs[0], &crate::opt::OptOptions::default()).graph;
    let policy = Policy::default();
    let s = schedule(&g, &policy).unwrap_or_else(|e| panic!("{e}"));
    (s, policy)
}

/// The findings on `s`, which must be some.
fn findings(s: &Schedule, policy: &Policy) -> Vec<VerifyError> {
    verify(s, policy).expect_err("the verifier finds the broken invariant")
}

fn step_of(s: &Schedule, name: &str) -> usize {
    s.steps.iter().position(|st| st.kernel.name() == name).unwrap_or_else(|| panic!("a {name} step in\n{s}"))
}

#[test]
fn a_scheduled_program_verifies() {
    let (s, policy) = planned();
    assert_eq!(verify(&s, &policy), Ok(()));
    assert!(s.fault.is_some() && !s.checks.is_empty(), "the test program has a fault site and a slice:\n{s}");
}

#[test]
fn a_view_past_its_buffer_is_named() {
    let (mut s, policy) = planned();
    let m = step_of(&s, "matmul");
    let Kernel::MatMul { c, .. } = &mut s.steps[m].kernel else { unreachable!() };
    c.offset = c.offset.add(&Dim::constant(1));
    assert!(findings(&s, &policy).iter().any(|e| matches!(e, VerifyError::ViewOutOfBounds { .. })), "{:?}", findings(&s, &policy));
}

#[test]
fn a_buffer_read_before_it_is_written_is_named() {
    let (mut s, policy) = planned();
    // Drop the step writing the matmul's result: its reader now reads an unwritten buffer.
    let m = step_of(&s, "matmul");
    let c = s.steps[m].writes[0];
    s.steps.remove(m);
    let found = findings(&s, &policy);
    assert!(found.iter().any(|e| matches!(e, VerifyError::ReadBeforeWrite { buffer, .. } if *buffer == c)), "{found:?}");
}

#[test]
fn reads_that_are_not_the_kernels_operands_are_named() {
    let (mut s, policy) = planned();
    let m = step_of(&s, "matmul");
    s.steps[m].reads.pop();
    assert!(findings(&s, &policy).iter().any(|e| matches!(e, VerifyError::Touches { .. })));
}

#[test]
fn an_output_nobody_writes_is_named() {
    let (mut s, policy) = planned();
    let out = s.outputs[1];
    for st in &mut s.steps {
        if st.writes.contains(&out) {
            st.writes.retain(|b| *b != out);
        }
    }
    assert!(findings(&s, &policy).iter().any(|e| matches!(e, VerifyError::OutputUnwritten { output: 1, .. })));
}

#[test]
fn a_missing_integer_is_named() {
    let (mut s, policy) = planned();
    // The last slots are dims; the renderers would find no slot for this one.
    let last = s.ints.len() - 1;
    s.ints.remove(last);
    assert!(findings(&s, &policy).iter().any(|e| matches!(e, VerifyError::MissingInt { .. })));
}

#[test]
fn a_work_count_in_another_slot_is_named() {
    let (mut s, policy) = planned();
    s.steps[0].work = s.steps[1].work;
    assert!(findings(&s, &policy).iter().any(|e| matches!(e, VerifyError::WorkSlot { .. })));
}

#[test]
fn a_missing_tuning_value_is_named() {
    let (mut s, policy) = planned();
    let f = step_of(&s, "flash");
    let slot = s.tuning(f, Tuning::BlockN).expect("a block size");
    s.ints[slot] = IntValue::Tuning { step: f + 100, param: Tuning::BlockN };
    assert!(findings(&s, &policy).iter().any(|e| matches!(e, VerifyError::MissingInt { value, .. } if value.contains("BlockN"))));
}

#[test]
fn an_integer_held_twice_is_named() {
    let (mut s, policy) = planned();
    let dup = s.ints[0].clone();
    s.ints.push(dup);
    assert!(findings(&s, &policy).iter().any(|e| matches!(e, VerifyError::DuplicateInt { first: 0, .. })));
}

#[test]
fn a_flash_step_with_another_steps_tables_is_named() {
    let (mut s, policy) = planned();
    let f = step_of(&s, "flash");
    let Kernel::FlashMerge(m) = &mut s.steps[f + 1].kernel else { panic!("the merge follows the flash step") };
    m.tiles = m.partials;
    let found = findings(&s, &policy);
    assert!(found.iter().any(|e| matches!(e, VerifyError::BufferKind { what, .. } if what.contains("tile table"))), "{found:?}");
    let Kernel::Flash(k) = &mut s.steps[f].kernel else { unreachable!() };
    k.step += 1;
    assert!(findings(&s, &policy).iter().any(|e| matches!(e, VerifyError::StepIndex { .. })));
}

#[test]
fn a_checked_index_without_its_site_is_named() {
    let (mut s, policy) = planned();
    s.sites.clear();
    assert!(findings(&s, &policy).iter().any(|e| matches!(e, VerifyError::Site { sites: 0, .. })));
}

#[test]
fn a_parameter_in_the_wrong_buffer_is_named() {
    let (mut s, policy) = planned();
    s.params.swap(0, 1);
    assert!(findings(&s, &policy).iter().any(|e| matches!(e, VerifyError::BufferKind { what, .. } if what == "parameter 0")));
}

#[test]
fn a_view_out_of_bounds_only_at_some_sizes_is_found() {
    // In bounds when every dim is 1 or 2; out of bounds at the larger samples.
    let (mut s, policy) = planned();
    let m = step_of(&s, "matmul");
    let Kernel::MatMul { a, .. } = &mut s.steps[m].kernel else { unreachable!() };
    a.offset = Dim::sym("S").sub(&Dim::constant(2)).mul(&Dim::sym("S"));
    let found = findings(&s, &policy);
    assert!(
        found.iter().any(|e| matches!(e, VerifyError::ViewOutOfBounds { sizes, .. } if !sizes.contains("=1 ") && !sizes.contains("=2 "))),
        "{found:?}"
    );
}
