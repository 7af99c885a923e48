//! Kernel tests against f64 references, on every path this CPU can run.

use super::*;

/// Sizes that hit every tail: 0, 1, below/at/above a vector, a micro-tile and a panel.
const SIZES: [usize; 11] = [0, 1, 3, 7, 17, 31, 33, 64, 65, 127, 130];

/// Deterministic values in [-1, 1) (xorshift; no seed files, no external RNG state).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32) / (1u64 << 23) as f32 - 1.0
    }

    fn vec(&mut self, len: usize) -> Vec<f32> {
        (0..len).map(|_| self.next()).collect()
    }
}

/// Sentinel written around and inside `C` before a call.
const SENTINEL: f32 = 12345.5;

/// Runs one product on `g.isa` and compares every element of `C`'s storage with an f64
/// reference: the tile within tolerance, everything outside the tile untouched.
fn check(layout: Layout, g: Gemm, rng: &mut Rng) {
    let run = match layout {
        Layout::Nt => sgemm_nt,
        Layout::Nn => sgemm_nn,
    };
    check_with(run, layout, g, rng);
}

type Product = fn(&Gemm, &[f32], &[f32], &mut [f32]) -> Result<(), KernelError>;

/// [`check`] for the product `run`.
fn check_with(run: Product, layout: Layout, g: Gemm, rng: &mut Rng) {
    let (b_rows, b_row) = match layout {
        Layout::Nt => (g.n, g.k),
        Layout::Nn => (g.k, g.n),
    };
    // Strides beyond the rows, with one spare element at the end of each buffer.
    let a = rng.vec(g.m * g.lda + 1);
    let b = rng.vec(b_rows * g.ldb + 1);
    let mut c = vec![SENTINEL; g.m * g.ldc + 1];
    let old: Vec<f32> = rng.vec(g.m * g.n);
    for i in 0..g.m {
        for j in 0..g.n {
            // An overwritten C is never read: NaN there must not leak into the result.
            c[i * g.ldc + j] = if g.accumulate { old[i * g.n + j] } else { f32::NAN };
        }
    }
    run(&g, &a, &b, &mut c).unwrap();
    assert!(b_row <= g.ldb);
    for (idx, got) in c.iter().enumerate() {
        let ldc = g.ldc.max(1);
        let (i, j) = (idx / ldc, idx % ldc);
        if i >= g.m || j >= g.n {
            assert_eq!(*got, SENTINEL, "{layout:?} {g:?}: wrote outside C at {idx}");
            continue;
        }
        let (mut sum, mut mag) = (0.0f64, 0.0f64);
        for p in 0..g.k {
            let bv = match layout {
                Layout::Nt => b[j * g.ldb + p],
                Layout::Nn => b[p * g.ldb + j],
            };
            let prod = a[i * g.lda + p] as f64 * bv as f64;
            sum += prod;
            mag += prod.abs();
        }
        let alpha = g.alpha as f64;
        let prior = if g.accumulate { old[i * g.n + j] as f64 } else { 0.0 };
        let want = alpha * sum + prior;
        // f32 accumulation over k terms: error ≤ ~k·eps·Σ|a·b|.
        let tol = (g.k as f64 + 2.0) * 1.2e-7 * (alpha.abs() * mag + prior.abs()) + 1e-30;
        let err = (*got as f64 - want).abs();
        assert!(err <= tol, "{layout:?} {g:?}: C[{i},{j}] = {got}, want {want} (err {err:e} > {tol:e})");
    }
}

/// A product of shape `(m, n, k)` on `isa` varied by the case number `case`: strides padded
/// past the rows, alpha 1 or `odd_alpha`, accumulating or not.
fn varied(isa: Isa, layout: Layout, (m, n, k): (usize, usize, usize), case: usize, odd_alpha: f32) -> Gemm {
    let mut g = Gemm::dense(layout, m, n, k);
    g.isa = isa;
    g.lda += case % 3;
    g.ldb += case % 5;
    g.ldc += case % 4;
    g.alpha = if case.is_multiple_of(2) { 1.0 } else { odd_alpha };
    g.accumulate = case % 3 == 1;
    g
}

/// Every (m, n) pair of [`SIZES`] with a rotating k, padded strides, alpha and accumulate
/// varied, on both layouts and every path.
#[test]
fn gemm_matches_f64_at_odd_shapes() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for isa in available_isas() {
        for layout in [Layout::Nt, Layout::Nn] {
            let mut case = 0usize;
            for (im, &m) in SIZES.iter().enumerate() {
                for (jn, &n) in SIZES.iter().enumerate() {
                    let k = SIZES[(im * 3 + jn * 5 + 1) % SIZES.len()];
                    case += 1;
                    check(layout, varied(isa, layout, (m, n, k), case, -0.75), &mut rng);
                }
            }
        }
    }
}

/// The few-rows kernels at every row count up to a block and past it, odd `n` and `k` (the
/// 16-lane tails), padded strides, alpha and accumulate varied.
#[test]
fn gemv_matches_f64() {
    let mut rng = Rng(0x5eed);
    for isa in available_isas() {
        for (layout, run) in [(Layout::Nt, gemv_nt as Product), (Layout::Nn, gemv_nn)] {
            let mut case = 0usize;
            for m in [0, 1, 2, 3, 4, 5, 9] {
                for (n, k) in [(1, 1), (3, 17), (64, 128), (65, 64), (130, 31), (7, 0), (0, 5)] {
                    case += 1;
                    check_with(run, layout, varied(isa, layout, (m, n, k), case, 0.375), &mut rng);
                }
            }
        }
    }
}

/// Shapes that cross the cache blocks (k > KC, n > NC) and the attention tile shapes.
#[test]
fn gemm_matches_f64_across_blocks() {
    let mut rng = Rng(42);
    let shapes = [(3, 1100, 9), (5, 33, 600), (13, 70, 257), (64, 64, 64), (128, 128, 128), (65, 64, 1000)];
    for isa in available_isas() {
        for layout in [Layout::Nt, Layout::Nn] {
            for (s, &(m, n, k)) in shapes.iter().enumerate() {
                let mut g = Gemm::dense(layout, m, n, k);
                g.isa = isa;
                g.accumulate = s.is_multiple_of(2);
                g.alpha = 0.5;
                g.ldc += 3;
                check(layout, g, &mut rng);
            }
        }
    }
}

/// The C ABI entry points run the dispatched path and agree with the safe wrappers.
#[test]
fn c_abi_entry_points_match_wrappers() {
    let mut rng = Rng(7);
    let (m, n, k) = (9, 21, 13);
    let a = rng.vec(m * k);
    let b = rng.vec(n * k);
    for (layout, entry) in
        [(Layout::Nt, attnc_sgemm_nt as unsafe extern "C" fn(_, _, _, _, _, _, _, _, _, _, _)), (Layout::Nn, attnc_sgemm_nn)]
    {
        let ldb = if layout == Layout::Nt { k } else { n };
        let mut want = vec![1.0; m * n];
        let mut g = Gemm::dense(layout, m, n, k);
        g.alpha = 2.0;
        g.accumulate = true;
        let run = if layout == Layout::Nt { sgemm_nt } else { sgemm_nn };
        run(&g, &a, &b, &mut want).unwrap();
        let mut got = vec![1.0; m * n];
        // SAFETY: dense buffers of exactly the shapes passed.
        unsafe { entry(m, n, k, a.as_ptr(), k, b.as_ptr(), ldb, got.as_mut_ptr(), n, 2.0, 1) };
        assert_eq!(got, want);
    }
    // The additive scores' entry point, against its wrapper.
    let w = rng.vec(k);
    let mut want = vec![0.0; m * n];
    additive_nt(isa(), (m, n, k), &a, &b, &mut want, 0.5, &w).unwrap();
    let mut got = vec![0.0; m * n];
    // SAFETY: dense buffers of exactly the shapes passed.
    unsafe { attnc_additive_nt(m, n, k, a.as_ptr(), k, b.as_ptr(), k, got.as_mut_ptr(), n, 0.5, w.as_ptr()) };
    assert_eq!(got, want);
}

#[test]
fn transpose_copies_every_element_across_block_edges() {
    // 13 x 21 inside leading dimensions 24 (source) and 16 (destination): partial 8 x 8 blocks
    // on both edges, and padding that must stay untouched.
    let (rows, cols, lds, ldd) = (13, 21, 24, 16);
    let src: Vec<f32> = (0..rows * lds).map(|x| x as f32).collect();
    let mut dst = vec![-1.0f32; cols * ldd];
    // SAFETY: `src` holds rows·lds and `dst` cols·ldd elements.
    unsafe { super::attnc_transpose_f32(src.as_ptr(), lds, rows, cols, dst.as_mut_ptr(), ldd) };
    for c in 0..cols {
        for r in 0..ldd {
            let want = if r < rows { src[r * lds + c] } else { -1.0 };
            assert_eq!(dst[c * ldd + r], want, "row {r} col {c}");
        }
    }
}

#[test]
fn wrappers_reject_bad_strides_and_short_slices() {
    let g = Gemm { lda: 3, ..Gemm::dense(Layout::Nn, 2, 2, 4) };
    assert_eq!(sgemm_nn(&g, &[0.0; 8], &[0.0; 8], &mut [0.0; 4]), Err(KernelError::LeadingDim { operand: "a", ld: 3, row: 4 }));
    let g = Gemm::dense(Layout::Nt, 2, 3, 4);
    assert_eq!(sgemm_nt(&g, &[0.0; 8], &[0.0; 11], &mut [0.0; 6]), Err(KernelError::TooShort { operand: "b", len: 11, need: 12 }));
    assert_eq!(sgemm_nt(&g, &[0.0; 8], &[0.0; 12], &mut [0.0; 5]), Err(KernelError::TooShort { operand: "c", len: 5, need: 6 }));
    // Empty shapes need no storage at all.
    let g = Gemm::dense(Layout::Nt, 0, 5, 7);
    assert_eq!(sgemm_nt(&g, &[], &[0.0; 35], &mut []), Ok(()));
    assert_eq!(exp_sum(Isa::Portable, &[1.0, 2.0], &mut [0.0], 0.0), Err(KernelError::TooShort { operand: "y", len: 1, need: 2 }));
}

#[test]
fn isa_names_round_trip_and_detection_is_consistent() {
    for i in [Isa::Portable, Isa::Avx2, Isa::Avx512] {
        assert_eq!(i.name().parse::<Isa>(), Ok(i));
    }
    assert!(matches!("sse9".parse::<Isa>(), Err(KernelError::UnknownIsa(_))));
    assert_eq!(choose(Isa::Avx512, Some("avx2")), Isa::Avx2);
    assert_eq!(choose(Isa::Avx512, Some(" Portable ")), Isa::Portable);
    assert_eq!(choose(Isa::Avx2, Some("avx512")), Isa::Avx2, "never above what the CPU has");
    assert_eq!(choose(Isa::Avx2, Some("sse9")), Isa::Avx2, "unknown values are ignored");
    assert_eq!(choose(Isa::Avx512, None), Isa::Avx512);
    assert!(isa().is_supported());
    assert_eq!(available_isas().first(), Some(&Isa::Portable));
    assert!(available_isas().contains(&isa()));
}

/// Distance in units in the last place between two non-negative floats (inf is one past MAX).
fn ulps(a: f32, b: f32) -> u32 {
    a.to_bits().abs_diff(b.to_bits())
}

/// Runs the row kernel `run` on every path and every tail of `x` (its last `len` elements for
/// each `len` up to 40, and the whole), and hands `check` the path, the inputs, the outputs and
/// what `run` returned.
fn on_every_tail<T>(x: &[f32], run: impl Fn(Isa, &[f32], &mut [f32]) -> T, mut check: impl FnMut(Isa, &[f32], &[f32], T)) {
    for isa in available_isas() {
        for len in (0..=40).chain([x.len()]) {
            let xs = &x[x.len() - len..];
            let mut y = vec![0.0; len];
            let got = run(isa, xs, &mut y);
            check(isa, xs, &y, got);
        }
    }
}

/// `exp` within 2 ulp of the correctly rounded result over the whole useful range (subnormal
/// results included), with the special values exact, on every path and every tail length.
#[test]
fn exp_matches_f64_over_wide_range() {
    let mut x: Vec<f32> = (0..40_000).map(|i| -110.0 + i as f32 * 0.005).collect();
    x.extend([
        f32::NEG_INFINITY,
        f32::INFINITY,
        f32::NAN,
        -100.0,
        88.0,
        88.72,
        88.73,
        -87.3,
        -103.9,
        -0.0,
        1e-30,
        -1e-8,
        f32::MIN,
        f32::MAX,
    ]);
    on_every_tail(
        &x,
        |isa, xs, y| exp_sum(isa, xs, y, 0.0).unwrap(),
        |isa, xs, y, sum| {
            let mut want_sum = 0.0f64;
            for (xi, yi) in xs.iter().zip(y) {
                let want = (*xi as f64).exp() as f32;
                if xi.is_nan() {
                    assert!(yi.is_nan(), "{isa}: exp(NaN) = {yi}");
                    continue;
                }
                want_sum += want as f64;
                // Results below `FLUSH_BELOW` are 0.
                let flushed = want < super::exp::FLUSH_BELOW * 1.001 && *yi == 0.0;
                assert!(flushed || ulps(*yi, want) <= 2, "{isa}: exp({xi}) = {yi:e}, want {want:e}");
            }
            if xs.iter().any(|v| v.is_nan()) {
                assert!(sum.is_nan());
            } else if want_sum.is_finite() {
                assert!((sum as f64 - want_sum).abs() <= 1e-5 * want_sum + 1e-37, "{isa}: sum {sum} vs {want_sum}");
            } else {
                assert_eq!(sum, f32::INFINITY);
            }
        },
    );
}

/// The shift is subtracted in f32 before `exp`, as the online softmax computes `exp(s - max)`;
/// the C ABI works in place.
#[test]
fn exp_sum_shifts_and_runs_in_place() {
    let x: Vec<f32> = (0..37).map(|i| i as f32 * 0.7 - 9.0).collect();
    for isa in available_isas() {
        let mut y = vec![0.0; x.len()];
        let sum = exp_sum(isa, &x, &mut y, 3.5).unwrap();
        let mut want_sum = 0.0;
        for (xi, yi) in x.iter().zip(&y) {
            let want = ((xi - 3.5) as f64).exp() as f32;
            want_sum += want as f64;
            assert!(ulps(*yi, want) <= 2, "{isa}: exp({xi} - 3.5) = {yi}, want {want}");
        }
        assert!((sum as f64 - want_sum).abs() <= 1e-6 * want_sum);
    }
    let mut buf = x.clone();
    // SAFETY: `buf` holds `len` elements; the entry point allows x == y.
    unsafe { attnc_exp_f32(buf.as_ptr(), buf.as_mut_ptr(), buf.len()) };
    for (xi, yi) in x.iter().zip(&buf) {
        assert!(ulps(*yi, (*xi as f64).exp() as f32) <= 2);
    }
}

/// Sigmoid rows on every path against `ir::semantics`' definition (each step rounded to f32),
/// with the tails and non-finite inputs, and in place through the C ABI.
#[test]
fn sigmoid_rows_match_the_definition() {
    let r = |v: f64| v as f32 as f64;
    let want = |x: f32| r(1.0 / r(1.0 + r((-(x as f64)).exp())));
    let mut x: Vec<f32> = (0..67).map(|i| (i as f32 - 33.0) * 1.37).collect();
    x.extend([0.0, -0.0, 41.0, 42.0, -87.0, -88.5, -89.0, -200.0, 200.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
    for isa in available_isas() {
        for n in [0, 1, 7, 17, x.len()] {
            let mut y = vec![7.0; n];
            sigmoid(isa, &x[..n], &mut y).unwrap();
            for (xi, yi) in x.iter().zip(&y) {
                let w = want(*xi);
                if w.is_nan() {
                    assert!(yi.is_nan(), "{isa}: sigmoid({xi}) = {yi}");
                } else {
                    // The kernels' `exp` flushes below 2^-60 (sigmoid 1 there, as rounded anyway)
                    // and is within 2 ulp elsewhere; sigmoid near 0 is `exp(x)` itself.
                    assert!((*yi as f64 - w).abs() <= 4e-7 * w + 1e-38, "{isa}: sigmoid({xi}) = {yi}, want {w}");
                }
            }
        }
    }
    let mut buf = x.clone();
    // SAFETY: `buf` holds `len` elements; the entry point allows x == y.
    unsafe { attnc_sigmoid_f32(buf.as_ptr(), buf.as_mut_ptr(), buf.len()) };
    for (xi, yi) in x.iter().zip(&buf) {
        assert!(yi.is_nan() == xi.is_nan() && (xi.is_nan() || (*yi as f64 - want(*xi)).abs() <= 4e-7 * want(*xi) + 1e-38));
    }
}

/// A whole-row softmax on every path against the f64 definition, at every tail length, in
/// place through the C ABI, and with the non-finite rows of `ir::semantics`: no element above
/// `-inf` gives 0, a NaN or `+inf` element gives NaN.
#[test]
fn softmax_row_is_the_softmax_of_the_row() {
    let mut rng = Rng(0x5eed_50f7);
    for isa in available_isas() {
        for n in SIZES {
            let x: Vec<f32> = rng.vec(n).iter().map(|v| v * 30.0).collect();
            let mut y = vec![7.0; n];
            softmax_row(isa, &x, &mut y).unwrap();
            let m = x.iter().fold(f64::NEG_INFINITY, |m, v| m.max(*v as f64));
            let den: f64 = x.iter().map(|v| (*v as f64 - m).exp()).sum();
            for (k, (xi, yi)) in x.iter().zip(&y).enumerate() {
                let want = (*xi as f64 - m).exp() / den;
                // `x - max` rounds in f32 (|x - max| < 60: 4e-6 relative in `exp`).
                assert!((*yi as f64 - want).abs() <= 1e-5 * want + 1e-18, "{isa} n={n} [{k}]: {yi} vs {want}");
            }
        }
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let rows: [(&[f32], Option<f32>); 5] = [
            (&[-inf; 9], Some(0.0)),
            (&[-inf, nan, -inf], None),
            (&[1.0, 2.0, nan, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], None),
            (&[inf, 0.0, -inf], None),
            (&[-inf, 3.0, -inf], Some(-1.0)),
        ];
        for (row, fill) in rows {
            let mut y = vec![7.0; row.len()];
            softmax_row(isa, row, &mut y).unwrap();
            match fill {
                Some(-1.0) => assert_eq!(y, [0.0, 1.0, 0.0], "{isa}"),
                Some(v) => assert!(y.iter().all(|y| *y == v), "{isa} {row:?}: {y:?}"),
                None => assert!(y.iter().all(|y| y.is_nan()), "{isa} {row:?}: {y:?}"),
            }
        }
    }
    let x: Vec<f32> = (0..21).map(|i| (i as f32 * 0.9).sin() * 5.0).collect();
    let mut buf = x.clone();
    // SAFETY: `buf` holds `len` elements; the entry point allows x == y.
    unsafe { attnc_softmax_row_f32(buf.as_ptr(), buf.as_mut_ptr(), buf.len()) };
    let mut want = vec![0.0; x.len()];
    softmax_row(Isa::Portable, &x, &mut want).unwrap();
    for (got, want) in buf.iter().zip(&want) {
        assert!((got - want).abs() <= 1e-6 * want);
    }
}

/// A softmax step over tiles of one row, with and without a bias and a score factor, on every
/// path: the running
/// state and rescaled accumulator give the same softmax as an f64 reference; the shift moves
/// only past the slack; an all `-inf` first tile is skipped.
#[test]
fn softmax_step_is_an_online_softmax() {
    let n = 37;
    let tiles: Vec<Vec<f32>> = vec![
        vec![f32::NEG_INFINITY; n],
        (0..n).map(|i| (i as f32 * 0.7).sin() * 3.0).collect(),
        (0..n).map(|i| (i as f32 * 0.3).cos() * 3.0 + 2.0).collect(),
        (0..n).map(|i| i as f32 * 0.5 + 6.0).collect(),
    ];
    let bias: Vec<f32> = (0..n).map(|i| if i == 5 { f32::NEG_INFINITY } else { -(i as f32) * 0.25 }).collect();
    let v: Vec<f64> = (0..n).map(|i| i as f64 - 11.0).collect();
    for isa in available_isas() {
        for (with_bias, factor) in [(false, 1.0f32), (true, 1.0), (true, 0.5)] {
            for len in [0, 1, 16, 17, n] {
                let (mut state, mut acc, mut all) = ((f32::NEG_INFINITY, 0.0f32), 0.0f64, Vec::new());
                for t in &tiles {
                    let mut y = vec![7.0; len];
                    let b = with_bias.then(|| &bias[..len]);
                    let old = state.0;
                    let scale = softmax_step(isa, &t[..len], factor, b, &mut y, &mut state).unwrap();
                    assert!(
                        state.0 == old || old == f32::NEG_INFINITY || state.0 > old + 8.0,
                        "{isa}: shift moved from {old} to {}",
                        state.0
                    );
                    acc = acc * scale as f64 + y.iter().zip(&v).map(|(p, v)| *p as f64 * v).sum::<f64>();
                    all.extend(
                        (0..len).map(|k| (factor * t[k]) as f64 + if with_bias { bias[k] as f64 } else { 0.0 }).zip(v.iter().copied()),
                    );
                }
                let m = all.iter().map(|x| x.0).fold(f64::NEG_INFINITY, f64::max);
                let (num, den) = all.iter().fold((0.0, 0.0), |(n, d), (s, v)| (n + (s - m).exp() * v, d + (s - m).exp()));
                if len == 0 {
                    assert_eq!((state.0, state.1, acc), (f32::NEG_INFINITY, 0.0, 0.0));
                    continue;
                }
                let got = acc / state.1 as f64;
                assert!(
                    (got - num / den).abs() <= 1e-5 * (num / den).abs().max(1.0),
                    "{isa} bias={with_bias} len={len}: {got} vs {}",
                    num / den
                );
            }
        }
    }
    assert_eq!(
        softmax_step(Isa::Portable, &[1.0; 4], 1.0, Some(&[0.0; 3]), &mut [0.0; 4], &mut (0.0, 0.0)),
        Err(KernelError::TooShort { operand: "bias", len: 3, need: 4 })
    );
}

/// The softmax step's one pass (the shift kept): its bounded `exp` within 2 ulp of the correctly
/// rounded result down to the flush, within 1 ulp above `e⁻²⁰`, on every path and tail length.
#[test]
fn softmax_step_kept_shift_is_exp() {
    let mut x: Vec<f32> = (0..10_000).map(|i| 8.0 - i as f32 * 0.005).collect();
    // Far below the flush (what the bounded form's steps make of these is masked off), around
    // it, and the special values.
    x.extend([f32::NEG_INFINITY, f32::MIN, -1e30, -200.0, -100.0, -89.0, -88.0, -87.5, -60.0, -41.6, -41.588_8, -41.58, -0.0]);
    for isa in available_isas() {
        for len in (0..=33).chain([x.len()]) {
            let xs = &x[x.len() - len..];
            let mut y = vec![0.0; len];
            let mut state = (0.0f32, 2.0f32);
            let factor = softmax_step(isa, xs, 1.0, None, &mut y, &mut state).unwrap();
            assert_eq!((factor, state.0), (1.0, 0.0), "{isa}: the shift moved");
            let mut want_sum = 2.0f64;
            for (xi, yi) in xs.iter().zip(&y) {
                let want = (*xi as f64).exp() as f32;
                want_sum += want as f64;
                let flushed = want < super::exp::FLUSH_BELOW * 1.001 && *yi == 0.0;
                let tol = if *xi >= -20.0 { 1 } else { 2 };
                assert!(flushed || ulps(*yi, want) <= tol, "{isa}: exp({xi}) = {yi:e}, want {want:e}");
            }
            assert!((state.1 as f64 - want_sum).abs() <= 1e-6 * want_sum, "{isa}: sum {} vs {want_sum}", state.1);
        }
        // A NaN score stays NaN, and so does the running sum; the lanes beside it are kept.
        for at in [0, 5, 8, 13, 16, 20] {
            let mut xs: Vec<f32> = (0..21).map(|i| -(i as f32)).collect();
            xs[at] = f32::NAN;
            let mut y = vec![0.0; xs.len()];
            let mut state = (0.0f32, 0.0f32);
            softmax_step(isa, &xs, 1.0, None, &mut y, &mut state).unwrap();
            assert!(y[at].is_nan() && state.1.is_nan(), "{isa}: NaN at {at}");
            for (i, (xi, yi)) in xs.iter().zip(&y).enumerate().filter(|(i, _)| *i != at) {
                assert!(ulps(*yi, (*xi as f64).exp() as f32) <= 1, "{isa}: NaN at {at}, y[{i}] = {yi}");
            }
        }
    }
}

/// A step whose row passes the running max by more than the slack part-way through: the
/// outputs already written with the old shift are rescaled to the new one, which is the row's
/// max, and the running sum with them. Every path, jumps at every vector position.
#[test]
fn softmax_step_moves_the_shift_mid_row() {
    let n = 45;
    for isa in available_isas() {
        for at in [0, 3, 7, 8, 15, 16, 31, 32, 44] {
            let x: Vec<f32> = (0..n).map(|i| if i == at { 30.0 } else { (i as f32 * 0.37).sin() * 4.0 }).collect();
            let mut y = vec![0.0; n];
            let mut state = (1.0f32, 3.0f32);
            let factor = softmax_step(isa, &x, 1.0, None, &mut y, &mut state).unwrap();
            assert_eq!(state.0, 30.0, "{isa} at {at}");
            let f = (1.0f64 - 30.0).exp();
            assert!(ulps(factor, f as f32) <= 2, "{isa} at {at}: factor {factor} vs {f}");
            let mut want_sum = 3.0 * f;
            for (i, (xi, yi)) in x.iter().zip(&y).enumerate() {
                // `exp(x − 30)` with the argument rounded to f32, as every path computes it, or
                // (before the jump) `exp(x − 1)` times the factor.
                let rest = ((xi - 30.0) as f64).exp();
                let before = ((xi - 1.0) as f64).exp() * f;
                want_sum += rest;
                let near = |want: f64| (*yi as f64 - want).abs() <= 4e-7 * want;
                assert!(near(rest) || (i < at && near(before)), "{isa} at {at}: y[{i}] = {yi:e}, want {rest:e}");
            }
            assert!((state.1 as f64 - want_sum).abs() <= 1e-6 * want_sum, "{isa} at {at}: sum {} vs {want_sum}", state.1);
        }
    }
}

/// `tanh` within a few ulp of f64 across the polynomial/exp boundary, saturated far out, odd,
/// NaN kept; every tail length on every path.
#[test]
fn tanh_matches_f64() {
    let mut x: Vec<f32> = (-400..=400).map(|i| i as f32 * 0.0125).collect();
    x.extend([
        0.0,
        -0.0,
        0.624_999_9,
        0.625,
        -0.625,
        9.0,
        10.0,
        20.0,
        -40.0,
        1e-30,
        f32::MAX,
        f32::MIN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ]);
    on_every_tail(
        &x,
        |isa, xs, y| tanh(isa, xs, y).unwrap(),
        |isa, xs, y, ()| {
            for (xi, yi) in xs.iter().zip(y) {
                if xi.is_nan() {
                    assert!(yi.is_nan(), "{isa}: tanh(NaN) = {yi}");
                    continue;
                }
                let want = (*xi as f64).tanh() as f32;
                assert!(ulps(*yi, want) <= 4, "{isa}: tanh({xi}) = {yi:e}, want {want:e}");
            }
        },
    );
    let mut buf = x.clone();
    // SAFETY: `buf` holds `len` elements; the entry point allows x == y.
    unsafe { attnc_tanh_f32(buf.as_ptr(), buf.as_mut_ptr(), buf.len()) };
    assert_eq!(buf[0], (-5.0f64).tanh() as f32);
}

/// GELU against the exact erf form in f64: absolute error within a few 1e-7 times `|x|`, the
/// negative tail relatively accurate, every tail length on every path.
#[test]
fn gelu_matches_f64() {
    let mut x: Vec<f32> = (-800..=800).map(|i| i as f32 * 0.0125).collect();
    x.extend([-12.0, -9.0, 30.0, 0.0, -0.0, 1e-20]);
    on_every_tail(
        &x,
        |isa, xs, y| gelu(isa, xs, y).unwrap(),
        |isa, xs, y, ()| {
            for (xi, yi) in xs.iter().zip(y) {
                let v = *xi as f64;
                let want = 0.5 * v * (1.0 + libm::erf(v / std::f64::consts::SQRT_2));
                let err = (*yi as f64 - want).abs();
                assert!(err <= 4e-7 * v.abs().max(1.0) + 2e-6 * want.abs(), "{isa}: gelu({xi}) = {yi:e}, want {want:e}");
            }
        },
    );
}

/// Layer and RMS norm rows against an f64 reference, in place and out of place, with and
/// without a shift.
#[test]
fn norm_rows_match_f64() {
    let mut rng = Rng(7);
    for n in [1, 3, 8, 17, 64, 130] {
        let x: Vec<f32> = rng.vec(n).iter().map(|v| v * 3.0 + 0.5).collect();
        let (g, b) = (rng.vec(n), rng.vec(n));
        for rms in [false, true] {
            let mean = if rms { 0.0 } else { x.iter().map(|v| *v as f64).sum::<f64>() / n as f64 };
            let var = x.iter().map(|v| (*v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
            for with_beta in [false, true] {
                let beta = if with_beta { b.as_ptr() } else { std::ptr::null() };
                let mut y = x.clone();
                // SAFETY: every buffer holds `n` elements; in place is allowed.
                unsafe { attnc_norm_row_f32(y.as_ptr(), g.as_ptr(), beta, y.as_mut_ptr(), n, 1e-5, rms as u32) };
                for i in 0..n {
                    let mut want = (x[i] as f64 - mean) / (var + 1e-5).sqrt() * g[i] as f64;
                    if with_beta {
                        want += b[i] as f64;
                    }
                    assert!(ulps(y[i], want as f32) <= 1, "n={n} rms={rms}: {} vs {want}", y[i]);
                }
            }
        }
    }
}

#[test]
fn flash_bwd_row_matches_an_f64_reference_on_every_path() {
    let mut rng = Rng(41);
    for isa in available_isas() {
        for n in SIZES {
            // Flags: plain softmax, softmax of tanh-staged scores, sigmoid weights. A column
            // bias of 90 with every lse 90 higher gives the same weights, but lanes past `n`
            // (which read lse 0) overflow: they must stay out of the sums.
            for (flags, cbias) in [(0u32, -0.25f32), (1, -0.25), (2, -0.25), (0, 90.0)] {
                let s0: Vec<f32> = rng.vec(n).iter().map(|x| 4.0 * x).collect();
                let dp0 = rng.vec(n);
                // A row of lse with one query that keeps no key (-inf).
                let lse: Vec<f32> = (0..n).map(|r| if r == 1 { f32::NEG_INFINITY } else { 0.5 + rng.next() + cbias.max(0.0) }).collect();
                let delta = rng.vec(n);
                let rbias = rng.vec(n);
                let (alpha, factor) = (0.3f32, 1.5f32);
                let weights = rng.vec(n);
                let (mut s, mut dp, mut df, mut sums) = (s0.clone(), dp0.clone(), vec![0.0f32; n], [0.0f32; 2]);
                // SAFETY: every row holds `n` elements.
                unsafe {
                    exp::flash_bwd_row(
                        isa,
                        s.as_mut_ptr(),
                        dp.as_mut_ptr(),
                        lse.as_ptr(),
                        delta.as_ptr(),
                        rbias.as_ptr(),
                        n,
                        (alpha, factor, cbias),
                        flags,
                        (df.as_mut_ptr(), weights.as_ptr(), sums.as_mut_ptr()),
                    )
                };
                let (mut want0, mut want1) = (0.0f64, 0.0f64);
                for r in 0..n {
                    let u = f64::from(alpha) * f64::from(s0[r]);
                    let u = if flags & 1 != 0 { u.tanh() } else { u };
                    let x = f64::from(factor) * u + f64::from(cbias) + f64::from(rbias[r]);
                    let (w, dfr) = if flags & 2 != 0 {
                        let w = 1.0 / (1.0 + (-x).exp());
                        (w, f64::from(dp0[r]) * w * (1.0 - w))
                    } else if lse[r] == f32::NEG_INFINITY {
                        (0.0, 0.0)
                    } else {
                        let w = (x - f64::from(lse[r])).exp();
                        (w, w * (f64::from(dp0[r]) - f64::from(delta[r])))
                    };
                    let scale = f64::from(alpha) * f64::from(factor);
                    let d = if flags & 1 != 0 { scale * (1.0 - u * u) } else { scale };
                    let close = |got: f32, want: f64| (f64::from(got) - want).abs() <= 1e-5 * want.abs().max(1.0);
                    assert!(close(s[r], w), "{isa} n={n} flags={flags} r={r}: p {} vs {w}", s[r]);
                    assert!(close(df[r], dfr), "{isa} n={n} flags={flags} r={r}: dF {} vs {dfr}", df[r]);
                    assert!(close(dp[r], dfr * d), "{isa} n={n} flags={flags} r={r}: dS {} vs {}", dp[r], dfr * d);
                    want0 += dfr;
                    want1 += dfr * f64::from(weights[r]);
                }
                assert!(
                    (f64::from(sums[0]) - want0).abs() <= 1e-5 * (n as f64 + 1.0),
                    "{isa} n={n} flags={flags}: Σ dF {} vs {want0}",
                    sums[0]
                );
                assert!(
                    (f64::from(sums[1]) - want1).abs() <= 1e-5 * (n as f64 + 1.0),
                    "{isa} n={n} flags={flags}: Σ dF·w {} vs {want1}",
                    sums[1]
                );
            }
        }
    }
}

/// `alpha · Σ_a w[a]·tanh(q[a] + k[a])` in f64.
fn additive_ref(q: &[f32], k: &[f32], w: &[f32], alpha: f32) -> f64 {
    let s: f64 = q.iter().zip(k).zip(w).map(|((x, y), w)| f64::from(*w) * (f64::from(*x) + f64::from(*y)).tanh()).sum();
    f64::from(alpha) * s
}

#[test]
fn additive_scores_match_f64_on_every_path() {
    let mut rng = Rng(7);
    // Shapes across the 64- and 16-key blocks, tails and a single row; inputs scaled so that
    // some rows and tiles leave the product form's range (the direct form then runs).
    for isa in available_isas() {
        for &(m, n, k, scale) in
            &[(1, 1, 1, 1.0), (3, 17, 5, 1.0), (7, 64, 128, 2.0), (5, 81, 33, 0.5), (4, 130, 12, 12.0), (2, 20, 9, 30.0)]
        {
            let q: Vec<f32> = rng.vec(m * k).iter().map(|x| x * scale).collect();
            let kk: Vec<f32> = rng.vec(n * k).iter().map(|x| x * scale).collect();
            let w = rng.vec(k);
            let mut c = vec![f32::NAN; m * n];
            crate::additive_nt(isa, (m, n, k), &q, &kk, &mut c, 0.5, &w).unwrap();
            for r in 0..m {
                for col in 0..n {
                    let want = additive_ref(&q[r * k..(r + 1) * k], &kk[col * k..(col + 1) * k], &w, 0.5);
                    let bound: f64 = w.iter().map(|x| f64::from(x.abs())).sum::<f64>() * 1e-6 + 1e-6;
                    let got = f64::from(c[r * n + col]);
                    assert!((got - want).abs() <= bound, "{isa} {m}x{n}x{k} x{scale} [{r},{col}]: {got} vs {want}");
                }
            }
        }
        // Infinities and NaN follow the scalar semantics: tanh(±inf) = ±1, NaN propagates.
        let (q, kk, w) = ([f32::INFINITY, 0.5, 0.1, f32::NAN], [0.25, -0.5, 0.3, 1.0], [1.0, 2.0, 3.0]);
        let mut c = [0.0f32; 4];
        crate::additive_nt(isa, (4, 1, 1), &q, &kk[..1], &mut c, 1.0, &w[..1]).unwrap();
        assert_eq!(c[0], 1.0, "{isa}");
        assert!((f64::from(c[1]) - 0.75f64.tanh()).abs() < 1e-6, "{isa}");
        assert!(c[3].is_nan(), "{isa}");
    }
}

/// The rows of `pool` (pages of `page` rows, `row_stride` and `page_stride` elements apart,
/// `pages` of them) through the first `table_len` entries of `table`, from key `first`.
fn pool_rows(
    pool: &[f32],
    table: &[i32],
    (row_stride, page_stride, page, pages): (usize, usize, usize, usize),
    table_len: usize,
    first: usize,
) -> PagedRows {
    PagedRows { base: pool.as_ptr(), row_stride, page_stride, page, pages, table: table.as_ptr(), table_stride: 1, table_len, first }
}

/// The paged few-rows products against an f64 product over the rows gathered densely: rows of
/// `B` from key `first` on, through a shuffled table with ids outside the pool (clamped), pages
/// of 1, 3 and 16 rows (row and page strides wider than a row, as a head of a `[NP, P, H, D]`
/// pool), every row-block size of `A`, overwriting and accumulating; and nothing done when the
/// rows run past the table.
#[test]
fn paged_products_read_rows_through_the_table() {
    let mut rng = Rng(11);
    let table: Vec<i32> = vec![5, 2, -3, 7, 0, 99, 4, 1, 6, 3, 2, 5];
    let (np, width, spare) = (8usize, 37usize, 5usize);
    for page in [1usize, 3, 16] {
        let (row_stride, page_stride) = (width + spare, page * (width + spare) + 3);
        let pool = rng.vec(np * page_stride + 1);
        // The pool's rows through the first `table_len` entries of the table, from key `first`.
        let paged = |table_len: usize, first: usize| pool_rows(&pool, &table, (row_stride, page_stride, page, np), table_len, first);
        let row_of = |t: usize| {
            let id = (table[t / page].max(0) as usize).min(np - 1);
            id * page_stride + (t % page) * row_stride
        };
        for layout in [Layout::Nt, Layout::Nn] {
            for (m, first, count) in [(1, 0, 1), (2, page / 2, page + 2), (4, 1, 3 * page), (5, 0, (table.len() * page).min(40))] {
                let (n, k) = if layout == Layout::Nt { (count, width) } else { (width, count) };
                let a = rng.vec(m * k);
                let rows = paged(table.len(), first);
                for accumulate in [0u32, 1] {
                    let old = rng.vec(m * n);
                    let mut c = old.clone();
                    let entry = if layout == Layout::Nt { attnc_gemv_nt_paged } else { attnc_gemv_nn_paged };
                    // SAFETY: dense A and C of the shapes passed; every row through the table
                    // lies inside `pool`, the table row holds `table_len` entries.
                    unsafe { entry(m, n, k, a.as_ptr(), k, &rows, c.as_mut_ptr(), n, 0.5, accumulate) };
                    for i in 0..m {
                        for j in 0..n {
                            let dot: f64 = (0..k)
                                .map(|p| {
                                    let (key, col) = if layout == Layout::Nt { (first + j, p) } else { (first + p, j) };
                                    a[i * k + p] as f64 * pool[row_of(key) + col] as f64
                                })
                                .sum();
                            let want = 0.5 * dot + if accumulate == 1 { old[i * n + j] as f64 } else { 0.0 };
                            let got = c[i * n + j] as f64;
                            assert!((got - want).abs() < 1e-4, "{layout:?} page {page} m {m} first {first}: ({i}, {j}) {got} vs {want}");
                        }
                    }
                }
            }
        }
        // Rows past the table's last page: C untouched.
        let rows = paged(2, 0);
        let a = rng.vec(width);
        let mut c = vec![SENTINEL; 2 * page + 1];
        // SAFETY: as above; the call must refuse the rows past the table.
        unsafe { attnc_gemv_nt_paged(1, 2 * page + 1, width, a.as_ptr(), width, &rows, c.as_mut_ptr(), 2 * page + 1, 1.0, 0) };
        assert!(c.iter().all(|x| *x == SENTINEL));
    }
}

/// The grouped paged products against an f64 product per head over its rows gathered densely:
/// heads at a stride inside each page wider than a row (HND-like) and narrower (NHD-like) and 0
/// (heads sharing their rows), pages of 1, 3 and 16 rows through a table with ids outside the
/// pool, a walk starting inside a page, one head or three (in blocks of two when rows are wide),
/// 1–4 rows of `A` per head, overwriting and accumulating,
/// on every ISA here; the C ABI entry refuses rows past the table.
#[test]
fn grouped_paged_products_walk_every_head_of_a_page() {
    let mut rng = Rng(12);
    let table: Vec<i32> = vec![5, 2, -3, 7, 0, 99, 4, 1, 6, 3, 2, 5];
    let np = 8usize;
    // Width 512 (2 KiB rows): NHD-like heads in blocks of two, the last block one head.
    for (heads, page, width) in [(3usize, 1usize, 37usize), (3, 3, 37), (3, 16, 37), (1, 3, 37), (3, 3, 512)] {
        // (head stride, row stride): HND-like, NHD-like, shared rows.
        for (hs, rs) in [(page * (width + 2) + 1, width + 2), (width + 1, heads * (width + 1) + 2), (0, width + 3)] {
            let page_stride = hs.max(1) * heads + page * rs + 5;
            let pool = rng.vec(np * page_stride + 1);
            let rows = |first: usize, table_len: usize| pool_rows(&pool, &table, (rs, page_stride, page, np), table_len, first);
            let row_of = |h: usize, t: usize| (table[t / page].max(0) as usize).min(np - 1) * page_stride + (t % page) * rs + h * hs;
            for layout in [Layout::Nt, Layout::Nn] {
                for (m, first, count) in [(1, 0, 1), (2, page / 2, page + 2), (4, 1, 3 * page), (3, 0, (table.len() * page).min(40))] {
                    let (n, k) = if layout == Layout::Nt { (count, width) } else { (width, count) };
                    // Per head: A's rows `m·k + 2` apart, C's `m·n + 1`.
                    let (a_stride, c_stride) = (m * k + 2, m * n + 1);
                    let a = rng.vec(heads * a_stride);
                    let group = HeadGroup { heads, a_stride, b_stride: hs, c_stride };
                    for accumulate in [false, true] {
                        let old = rng.vec(heads * c_stride);
                        for isa in available_isas() {
                            let mut c = old.clone();
                            let shape = heads::Shape { m, n, k, lda: k, ldc: n, alpha: 0.5, accumulate };
                            // SAFETY: every head's A and C lie inside `a` and `c`; every row
                            // through the table inside `pool`.
                            unsafe { heads::run(isa, layout, &shape, a.as_ptr(), &rows(first, table.len()), &group, c.as_mut_ptr()) };
                            for h in 0..heads {
                                for i in 0..m {
                                    for j in 0..n {
                                        let dot: f64 = (0..k)
                                            .map(|p| {
                                                let (key, col) = if layout == Layout::Nt { (first + j, p) } else { (first + p, j) };
                                                a[h * a_stride + i * k + p] as f64 * pool[row_of(h, key) + col] as f64
                                            })
                                            .sum();
                                        let at = h * c_stride + i * n + j;
                                        let want = 0.5 * dot + if accumulate { old[at] as f64 } else { 0.0 };
                                        let got = c[at] as f64;
                                        let case = format!("{isa} {layout:?} page {page} strides {hs}/{rs} m {m} first {first}");
                                        assert!((got - want).abs() < 1e-4, "{case}: head {h} ({i}, {j}) {got} vs {want}");
                                    }
                                }
                            }
                            // Between the heads' rows of C: untouched.
                            for h in 0..heads {
                                assert_eq!(c[h * c_stride + m * n], old[h * c_stride + m * n]);
                            }
                        }
                    }
                }
            }
            // Rows past the table's last page: C untouched.
            let a = rng.vec(heads * width);
            let group = HeadGroup { heads, a_stride: width, b_stride: hs, c_stride: 2 * page + 1 };
            let mut c = vec![SENTINEL; heads * (2 * page + 1)];
            // SAFETY: as above; the call must refuse the rows past the table.
            unsafe {
                attnc_gemv_nt_paged_heads(
                    1,
                    2 * page + 1,
                    width,
                    a.as_ptr(),
                    width,
                    &rows(0, 2),
                    &group,
                    c.as_mut_ptr(),
                    2 * page + 1,
                    1.0,
                    0,
                )
            };
            assert!(c.iter().all(|x| *x == SENTINEL));
        }
    }
}
