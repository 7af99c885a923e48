//! Causal linear attention in blocks ([`attn_compiler::ir::Op::PrefixAttention`]):
//! `out_i = Σ_{j ≤ i} (q_i · k_j) v_j` for one batch index, with one `D × Dv` state.
//!
//! Per block of `B` positions (in order, or from the end when `reverse`):
//! `out_b = Q_b · state + mask(Q_b · K_bᵀ) · V_b`, then `state += K_bᵀ · V_b`. Four products per
//! block on the GEMM microkernels: O(S·(B·D + D·Dv)) time and O(D·Dv + B² + B·D) memory.

use super::{Gemm, KernelError, isa, sgemm_nn, sgemm_nt};

/// One batch index: `q`, `k` are `s × d`, `v` and `out` `s × dv`, dense row-major.
pub fn prefix_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    (s, d, dv): (usize, usize, usize),
    block: usize,
    reverse: bool,
) -> Result<(), KernelError> {
    let block = block.max(1);
    for (name, len, need) in [("q", q.len(), s * d), ("k", k.len(), s * d), ("v", v.len(), s * dv), ("out", out.len(), s * dv)] {
        if len < need {
            return Err(KernelError::TooShort { operand: name, len, need });
        }
    }
    let mut state = vec![0.0f32; d * dv];
    let mut scores = vec![0.0f32; block * block];
    let mut keys_t = vec![0.0f32; d * block];
    let gemm = |m, n, kk, lda, ldb, ldc, accumulate| Gemm { m, n, k: kk, lda, ldb, ldc, alpha: 1.0, accumulate, isa: isa() };
    let blocks = s.div_ceil(block);
    for step in 0..blocks {
        let b = if reverse { blocks - 1 - step } else { step };
        let (r0, rows) = (b * block, block.min(s - b * block));
        let qb = &q[r0 * d..(r0 + rows) * d];
        let kb = &k[r0 * d..(r0 + rows) * d];
        let vb = &v[r0 * dv..(r0 + rows) * dv];
        let ob = &mut out[r0 * dv..(r0 + rows) * dv];
        // The earlier blocks, through the state.
        sgemm_nn(&gemm(rows, dv, d, d, dv, dv, false), qb, &state, ob)?;
        // Within the block: the scores, masked to j ≤ i (j ≥ i when reverse), times V.
        let a = &mut scores[..rows * rows];
        sgemm_nt(&gemm(rows, rows, d, d, d, rows, false), qb, kb, a)?;
        for i in 0..rows {
            let row = &mut a[i * rows..(i + 1) * rows];
            let dropped = if reverse { &mut row[..i] } else { &mut row[i + 1..] };
            dropped.fill(0.0);
        }
        sgemm_nn(&gemm(rows, dv, rows, rows, dv, dv, true), a, vb, ob)?;
        // state += K_bᵀ · V_b.
        let kt = &mut keys_t[..d * rows];
        // SAFETY: `kb` holds `rows` rows of `d`, `kt` `d` rows of `rows`; they do not overlap.
        unsafe { super::rows::transpose(kb.as_ptr(), d, rows, d, kt.as_mut_ptr(), rows) };
        sgemm_nn(&gemm(d, dv, rows, rows, dv, dv, true), kt, vb, &mut state)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The direct O(S²) sum, in f64.
    fn direct(q: &[f32], k: &[f32], v: &[f32], (s, d, dv): (usize, usize, usize), reverse: bool) -> Vec<f64> {
        let mut out = vec![0.0f64; s * dv];
        for i in 0..s {
            for j in 0..s {
                if (reverse && j < i) || (!reverse && j > i) {
                    continue;
                }
                let w: f64 = (0..d).map(|x| f64::from(q[i * d + x]) * f64::from(k[j * d + x])).sum();
                for y in 0..dv {
                    out[i * dv + y] += w * f64::from(v[j * dv + y]);
                }
            }
        }
        out
    }

    #[test]
    fn blocks_match_the_direct_sum_at_odd_sizes() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        for (s, d, dv, block) in [(1, 1, 1, 64), (7, 3, 5, 4), (130, 16, 9, 64), (65, 72, 8, 64), (0, 4, 4, 64)] {
            let q: Vec<f32> = (0..s * d).map(|_| next()).collect();
            let k: Vec<f32> = (0..s * d).map(|_| next()).collect();
            let v: Vec<f32> = (0..s * dv).map(|_| next()).collect();
            for reverse in [false, true] {
                let mut out = vec![f32::NAN; s * dv];
                prefix_attention(&q, &k, &v, &mut out, (s, d, dv), block, reverse).expect("sizes fit");
                let want = direct(&q, &k, &v, (s, d, dv), reverse);
                let scale = want.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
                let err = out.iter().zip(&want).fold(0.0f64, |m, (a, b)| m.max((f64::from(*a) - b).abs()));
                assert!(err / scale < 1e-5, "s={s} d={d} dv={dv} reverse={reverse}: {err} of {scale}");
            }
        }
        let short = prefix_attention(&[0.0; 3], &[0.0; 4], &[0.0; 4], &mut [0.0; 4], (2, 2, 2), 64, false);
        assert_eq!(short, Err(KernelError::TooShort { operand: "q", len: 3, need: 4 }));
    }
}
