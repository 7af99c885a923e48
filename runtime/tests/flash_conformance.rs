//! FlashAttention's test matrix (`tests/test_flash_attn.py`, `test_flash_attn_output`: the
//! output, and the gradients of q, k and v) on the CPU target in f32, against a float64
//! reference written here from FlashAttention's definitions, not from attnc's interpreter:
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

    /// The float64 reference at `(m, n, d)` from FlashAttention's definitions: the output and,
    /// given the output's cotangent `d_out`, the gradients of q, k and v (K/V heads summing over
    /// their group).
    fn reference(&self, (m, n, d): (usize, usize, usize), [q, k, v, slopes]: [&[f64]; 4], d_out: Option<&[f64]>) -> [Vec<f64>; 4] {
        let kv_heads = HEADS / self.group;
        let mut out = vec![0.0; BATCH * HEADS * m * d];
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        let mut p = vec![0.0; n];
        // ∂(modified score)/∂(q·k/√D) per key of the row.
        let mut slope = vec![1.0; n];
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
                            let t = (s / cap).tanh();
                            slope[j] = 1.0 - t * t;
                            s = cap * t;
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
                    p.iter_mut().for_each(|s| *s = (*s - max).exp() / sum);
                    let row = ((b * HEADS + h) * m + i) * d;
                    let kv_row = |j: usize| ((b * kv_heads + kh) * n + j) * d;
                    for (j, w) in p.iter().enumerate() {
                        for (oc, vc) in out[row..row + d].iter_mut().zip(&v[kv_row(j)..][..d]) {
                            *oc += w * vc;
                        }
                    }
                    let Some(g) = d_out else { continue };
                    let g = &g[row..row + d];
                    let dp: Vec<f64> = (0..n).map(|j| g.iter().zip(&v[kv_row(j)..][..d]).map(|(a, c)| a * c).sum()).collect();
                    let delta: f64 = p.iter().zip(&dp).map(|(a, c)| a * c).sum();
                    for j in 0..n {
                        let ds = p[j] * (dp[j] - delta) * slope[j] / (d as f64).sqrt();
                        for c in 0..d {
                            dq[row + c] += ds * k[kv_row(j) + c];
                            dk[kv_row(j) + c] += ds * q[row + c];
                            dv[kv_row(j) + c] += p[j] * g[c];
                        }
                    }
                }
            }
        }
        [out, dq, dk, dv]
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

/// Cells whose gradients are checked too: a sample of them by default (the reference's
/// backward is slow in a debug build), every one with `ATTNC_FA_MATRIX=full`.
fn with_gradients(k: usize) -> bool {
    std::env::var("ATTNC_FA_MATRIX").is_ok_and(|v| v == "full") || k < 2
}

#[test]
fn flash_attention_test_matrix_matches_a_float64_reference() {
    let mut failures = Vec::new();
    let qkv = ["q", "k", "v"].map(String::from);
    for (n_variant, var) in VARIANTS.iter().enumerate() {
        let program = Program::from_source(&var.source(), "fa.attn").unwrap_or_else(|e| panic!("{var:?}: {}", e.render(false)));
        let forward = program.compile_cpu("fa", &CpuOptions { threads: 2 }).expect("compiles");
        let backward =
            program.grad("fa", Some(&qkv)).expect("derives").compile_cpu("fa_grad", &CpuOptions { threads: 2 }).expect("compiles");
        for (cell, (d, (m, n))) in cells().into_iter().enumerate() {
            let mut rng = StdRng::seed_from_u64((n_variant * 1000 + d) as u64);
            let kv = HEADS / var.group;
            let mut inputs = vec![
                random(&mut rng, vec![BATCH, HEADS, m, d]),
                random(&mut rng, vec![BATCH, kv, n, d]),
                random(&mut rng, vec![BATCH, kv, n, d]),
                Tensor::f32(vec![HEADS], (0..HEADS).map(|h| 2f32.powf(-8.0 * (h + 1) as f32 / HEADS as f32)).collect()).expect("slopes"),
            ];
            let dims: HashMap<String, i64> = [("R".to_string(), var.group as i64)].into();
            let f: Vec<Vec<f64>> = inputs.iter().map(Tensor::to_f64_vec).collect();
            let grads = with_gradients(cell);
            let d_out = grads.then(|| random(&mut rng, vec![BATCH, HEADS, m, d]));
            let g = d_out.as_ref().map(Tensor::to_f64_vec);
            let want = var.reference((m, n, d), [&f[0], &f[1], &f[2], &f[3]], g.as_deref());
            let got = match d_out {
                Some(t) => {
                    inputs.push(t);
                    backward.run_tensors(&inputs, &dims).expect("runs")
                }
                None => forward.run_tensors(&inputs, &dims).expect("runs"),
            };
            for (k, (name, want)) in ["out", "d_q", "d_k", "d_v"].iter().zip(&want).take(got.len()).enumerate() {
                let err = normwise_error(&got[k].to_f64_vec(), want);
                if err.is_nan() || err > F32_TOLERANCE {
                    failures.push(format!("{var:?} D={d} M={m} N={n} {name}: normwise error {err:e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} failure(s):\n  {}", failures.len(), failures.join("\n  "));
}
