//! FlashAttention's forward test matrix (`tests/test_flash_attn.py`, `test_flash_attn_output`)
//! on the CPU target in f32, against a float64 reference written here from FlashAttention's
//! definitions, not from attnc's interpreter:
//!
//! - scores `q·kᵀ / √D`; soft-capping `cap · tanh(s / cap)`; ALiBi `− slope_h · |i + N − M − j|`;
//! - causal aligned to the bottom right (query `i` sees key `j` when `j ≤ i + N − M`), and local
//!   windows `(left, right)` around that diagonal;
//! - multi-head, grouped-query (3 query heads per K/V head) and multi-query attention;
//! - a row with no key left gives zeros.
//!
//! Head widths 32 to 256 (40, 59, 80, 96, 111, 160, 192, 224 among them) and sequence pairs such
//! as 113×203, 108×256 and 1023×1024, as FlashAttention's test. A sample runs by default (and in
//! CI); `ATTNC_FA_MATRIX=full cargo test --release -p attn-runtime --test flash_conformance`
//! runs every width with every pair.

use attn_runtime::cpu::CpuOptions;
use attn_runtime::{Program, Tensor};
use attn_tests::{F32_TOLERANCE, normwise_error};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// FlashAttention's head widths.
const WIDTHS: &[usize] = &[32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256];
/// FlashAttention's (query length, key length) pairs.
const PAIRS: &[(usize, usize)] =
    &[(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048)];

/// One column of the matrix: what the attention does besides softmax(q·kᵀ/√D)·v.
#[derive(Clone, Copy, Debug)]
struct Variant {
    causal: bool,
    /// Keys `i + N − M − left ..= i + N − M + right`.
    window: Option<(i64, i64)>,
    softcap: Option<f64>,
    alibi: bool,
    /// Query heads per K/V head (1: multi-head; the number of query heads: multi-query).
    group: usize,
}

const fn variant(causal: bool, window: Option<(i64, i64)>, softcap: Option<f64>, alibi: bool, group: usize) -> Variant {
    Variant { causal, window, softcap, alibi, group }
}

const VARIANTS: &[Variant] = &[
    variant(false, None, None, false, 1),
    variant(true, None, None, false, 1),
    variant(false, Some((17, 5)), None, false, 1),
    variant(true, Some((64, 0)), None, false, 3),
    variant(false, None, Some(50.0), false, 3),
    variant(true, None, Some(50.0), false, 1),
    variant(false, None, None, true, 1),
    variant(true, None, None, true, 6),
];

/// Query heads, and the batch.
const HEADS: usize = 6;
const BATCH: usize = 1;

impl Variant {
    /// The `.attn` program: the group of query heads sharing a K/V head is an axis of its own,
    /// K and V broadcast over it (examples/gqa.attn).
    fn source(&self) -> String {
        let mut body = String::from("    let s0 = qg @ kg.T / sqrt(D)\n    let (b, g, r, i, j) = indices(s0)\n");
        let mut s = "s0".to_string();
        if let Some(cap) = self.softcap {
            body.push_str(&format!("    let s1 = {cap:?} * tanh({s} / {cap:?})\n"));
            s = "s1".into();
        }
        if self.alibi {
            body.push_str(&format!("    let s2 = {s} - slopes[g * R + r] * cast(abs(i + (N - M) - j), f32)\n"));
            s = "s2".into();
        }
        let mut keep = Vec::new();
        if self.causal {
            keep.push("j <= i + (N - M)".to_string());
        }
        if let Some((left, right)) = self.window {
            keep.push(format!("j >= i + (N - M) - {left}"));
            keep.push(format!("j <= i + (N - M) + {right}"));
        }
        let weights = if keep.is_empty() {
            format!("softmax({s}, axis = -1)")
        } else {
            format!("softmax(where({}, {s}, -inf), axis = -1)", keep.join(" && "))
        };
        format!(
            "fn fa(q: f32[B, G*R, M, D], k: f32[B, G, N, D], v: f32[B, G, N, D], slopes: f32[G*R]) -> f32[B, G*R, M, D] {{
    let qg = reshape(q, [B, G, R, M, D])
    let kg = unsqueeze(k, 2)
    let vg = unsqueeze(v, 2)
{body}    return reshape({weights} @ vg, [B, G*R, M, D])
}}
"
        )
    }

    /// The float64 reference at `(m, n, d)` from FlashAttention's definitions.
    fn reference(&self, (m, n, d): (usize, usize, usize), q: &[f64], k: &[f64], v: &[f64], slopes: &[f64]) -> Vec<f64> {
        let kv_heads = HEADS / self.group;
        let mut out = vec![0.0; BATCH * HEADS * m * d];
        let mut p = vec![0.0; n];
        for b in 0..BATCH {
            for h in 0..HEADS {
                let kh = h / self.group;
                for i in 0..m {
                    let qi = &q[((b * HEADS + h) * m + i) * d..][..d];
                    let diag = i as i64 + n as i64 - m as i64;
                    let mut max = f64::NEG_INFINITY;
                    for (j, pj) in p.iter_mut().enumerate() {
                        let kj = &k[((b * kv_heads + kh) * n + j) * d..][..d];
                        let mut s = qi.iter().zip(kj).map(|(a, c)| a * c).sum::<f64>() / (d as f64).sqrt();
                        if let Some(cap) = self.softcap {
                            s = cap * (s / cap).tanh();
                        }
                        if self.alibi {
                            s -= slopes[h] * (diag - j as i64).abs() as f64;
                        }
                        let j = j as i64;
                        let keep = (!self.causal || j <= diag) && self.window.is_none_or(|(l, r)| j >= diag - l && j <= diag + r);
                        *pj = if keep { s } else { f64::NEG_INFINITY };
                        max = max.max(*pj);
                    }
                    if max == f64::NEG_INFINITY {
                        continue;
                    }
                    let sum: f64 = p.iter().map(|s| (s - max).exp()).sum();
                    let o = &mut out[((b * HEADS + h) * m + i) * d..][..d];
                    for (j, s) in p.iter().enumerate() {
                        let w = (s - max).exp() / sum;
                        for (oc, vc) in o.iter_mut().zip(&v[((b * kv_heads + kh) * n + j) * d..][..d]) {
                            *oc += w * vc;
                        }
                    }
                }
            }
        }
        out
    }
}

fn random(rng: &mut StdRng, shape: Vec<usize>) -> Tensor {
    let n = shape.iter().product();
    Tensor::f32(shape, (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()).expect("tensor")
}

/// The (width, pair) cells to run: every one with `ATTNC_FA_MATRIX=full`, else a sample of
/// odd widths and short uneven pairs.
fn cells() -> Vec<(usize, (usize, usize))> {
    if std::env::var("ATTNC_FA_MATRIX").is_ok_and(|v| v == "full") {
        WIDTHS.iter().flat_map(|d| PAIRS.iter().map(move |p| (*d, *p))).collect()
    } else {
        vec![(40, (113, 203)), (59, (128, 217)), (111, (108, 256)), (256, (113, 211))]
    }
}

#[test]
fn flash_attention_test_matrix_matches_a_float64_reference() {
    let mut failures = Vec::new();
    for (n_variant, var) in VARIANTS.iter().enumerate() {
        let program = Program::from_source(&var.source(), "fa.attn").unwrap_or_else(|e| panic!("{var:?}: {}", e.render(false)));
        let compiled = program.compile_cpu("fa", &CpuOptions { threads: 2 }).expect("compiles");
        for (d, (m, n)) in cells() {
            let mut rng = StdRng::seed_from_u64((n_variant * 1000 + d) as u64);
            let kv = HEADS / var.group;
            let inputs = vec![
                random(&mut rng, vec![BATCH, HEADS, m, d]),
                random(&mut rng, vec![BATCH, kv, n, d]),
                random(&mut rng, vec![BATCH, kv, n, d]),
                Tensor::f32(vec![HEADS], (0..HEADS).map(|h| 2f32.powf(-8.0 * (h + 1) as f32 / HEADS as f32)).collect()).expect("slopes"),
            ];
            let dims: HashMap<String, i64> = [("R".to_string(), var.group as i64)].into();
            let got = compiled.run_tensors(&inputs, &dims).expect("runs")[0].to_f64_vec();
            let f = |t: &Tensor| t.to_f64_vec();
            let want = var.reference((m, n, d), &f(&inputs[0]), &f(&inputs[1]), &f(&inputs[2]), &f(&inputs[3]));
            let err = normwise_error(&got, &want);
            if err.is_nan() || err > F32_TOLERANCE {
                failures.push(format!("{var:?} D={d} M={m} N={n}: normwise error {err:e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{} failure(s):\n  {}", failures.len(), failures.join("\n  "));
}
