//! Serving forms end to end on the cpu target: partial attentions with their log-sum-exps
//! (`examples/lse_merge.attn`'s `partial`, one fused flash op each) merged exactly into the
//! attention over all keys, and attention sinks (`examples/sinks.attn`) against the definition
//! with the sink as an extra key of no value.

use attn_runtime::{Program, RunOptions, Target, Tensor};
use std::collections::HashMap;
use std::path::PathBuf;

fn example(name: &str) -> Program {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples").join(name);
    Program::from_file(&path).expect("example compiles")
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}

fn tensor(shape: &[usize], seed: u64) -> Tensor {
    Tensor::f32(shape.to_vec(), values(shape.iter().product(), seed)).expect("tensor")
}

/// Rows `lo..hi` of axis 2 of a `[B, H, T, D]` tensor.
fn keys(t: &Tensor, lo: usize, hi: usize) -> Tensor {
    let (s, x) = (t.shape.clone(), t.to_f64_vec());
    let (outer, rows, d) = (s[0] * s[1], s[2], s[3]);
    let mut out = Vec::new();
    for o in 0..outer {
        for r in lo..hi {
            out.extend(x[(o * rows + r) * d..(o * rows + r + 1) * d].iter().map(|v| *v as f32));
        }
    }
    Tensor::f32(vec![s[0], s[1], hi - lo, d], out).expect("tensor")
}

/// Runs `entry` on the CPU target with one thread and with three; asserts the same bits.
/// Returns the program compiled (for its allocation statistics).
fn same_bits_on_one_and_three_threads(
    program: &Program,
    entry: &str,
    inputs: &[(&str, Tensor)],
    dims: &[(&str, usize)],
) -> attn_runtime::cpu::CpuProgram {
    let tensors: Vec<Tensor> = inputs.iter().map(|(_, t)| t.clone()).collect();
    let dims: HashMap<String, i64> = dims.iter().map(|(k, v)| (k.to_string(), *v as i64)).collect();
    let mut compiled = program.compile_cpu(entry, &attn_runtime::cpu::CpuOptions { threads: 1 }).expect("compiles");
    let one = compiled.run_tensors(&tensors, &dims).expect("runs");
    compiled.set_threads(3).expect("a valid thread count");
    assert_eq!(one, compiled.run_tensors(&tensors, &dims).expect("runs"), "3 threads differ from 1");
    compiled
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    a.to_f64_vec().iter().zip(b.to_f64_vec()).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

fn cpu(dims: &[(&str, i64)]) -> RunOptions {
    RunOptions { dims: dims.iter().map(|(k, v)| (k.to_string(), *v)).collect::<HashMap<_, _>>(), target: Target::Cpu }
}

#[test]
fn partial_attentions_merged_by_their_log_sum_exps_are_the_whole_attention() {
    let program = example("lse_merge.attn");
    let (b, h, s, t, d) = (1, 2, 37, 150, 24);
    let (q, k, v) = (tensor(&[b, h, s, d], 1), tensor(&[b, h, t, d], 2), tensor(&[b, h, t, d], 3));
    let part = |lo: usize, hi: usize| {
        let inputs = [("q", q.clone()), ("k", keys(&k, lo, hi)), ("v", keys(&v, lo, hi))];
        program.run("partial", inputs, &cpu(&[])).expect("partial runs")
    };
    let whole = part(0, t);
    let (first, second) = (part(0, 61), part(61, t));
    let merged = program
        .run(
            "lse_merge",
            [("o1", first[0].1.clone()), ("lse1", first[1].1.clone()), ("o2", second[0].1.clone()), ("lse2", second[1].1.clone())],
            &cpu(&[]),
        )
        .expect("merge runs");
    assert!(max_diff(&merged[0].1, &whole[0].1) < 1e-5, "out differs by {}", max_diff(&merged[0].1, &whole[0].1));
    assert!(max_diff(&merged[1].1, &whole[1].1) < 1e-5, "lse differs by {}", max_diff(&merged[1].1, &whole[1].1));
    // The log-sum-exp is the softmax's normaliser: the interpreter's of the same program.
    let interp = program
        .run(
            "partial",
            [("q", q.clone()), ("k", k.clone()), ("v", v.clone())],
            &RunOptions { dims: HashMap::new(), target: Target::Interp },
        )
        .expect("interpreter runs");
    assert!(max_diff(&interp[1].1, &whole[1].1) < 1e-5);
}

#[test]
fn a_sink_is_an_extra_key_of_no_value() {
    let program = example("sinks.attn");
    let (b, h, s, d) = (1, 3, 70, 16);
    let (q, k, v, sink) = (tensor(&[b, h, s, d], 4), tensor(&[b, h, s, d], 5), tensor(&[b, h, s, d], 6), tensor(&[h], 7));
    let got =
        program.run("sinks", [("q", q.clone()), ("k", k.clone()), ("v", v.clone()), ("sink", sink.clone())], &cpu(&[])).expect("runs");
    // out_i = Σ_{j ≤ i} e^(s_ij) v_j / (e^(sink_h) + Σ_{j ≤ i} e^(s_ij)), in f64.
    let (q, k, v, sink) = (q.to_f64_vec(), k.to_f64_vec(), v.to_f64_vec(), sink.to_f64_vec());
    let mut want = vec![0.0f64; b * h * s * d];
    for hh in 0..h {
        for i in 0..s {
            let row = |x: &[f64], r: usize| x[(hh * s + r) * d..(hh * s + r + 1) * d].to_vec();
            let qi = row(&q, i);
            let scores: Vec<f64> =
                (0..=i).map(|j| qi.iter().zip(row(&k, j)).map(|(a, c)| a * c).sum::<f64>() / (d as f64).sqrt()).collect();
            let m = scores.iter().fold(sink[hh], |m, x| m.max(*x));
            let denom = (sink[hh] - m).exp() + scores.iter().map(|x| (x - m).exp()).sum::<f64>();
            for (j, sc) in scores.iter().enumerate() {
                let w = (sc - m).exp() / denom;
                for (c, vj) in row(&v, j).iter().enumerate() {
                    want[(hh * s + i) * d + c] += w * vj;
                }
            }
        }
    }
    let got = got[0].1.to_f64_vec();
    let worst = got.iter().zip(&want).fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst < 1e-5, "max |diff| {worst}");
}

/// Sequence ids: `lens` tokens of sequence 0, then of 1, ...
fn ids(lens: &[usize]) -> Tensor {
    let v: Vec<i32> = lens.iter().enumerate().flat_map(|(s, n)| std::iter::repeat_n(s as i32, *n)).collect();
    Tensor::i32(vec![v.len()], v).expect("ids")
}

#[test]
fn a_packed_ragged_batch_matches_the_interpreter_as_its_ids_change() {
    let program = example("varlen.attn");
    let (h, d) = (2, 16);
    // Two batches of the same size with sequences cut differently (boundaries off the tiles),
    // run on one compiled program: the tile tables follow the ids of each run.
    let t = 300;
    let (q, k, v) = (tensor(&[h, t, d], 8), tensor(&[h, t, d], 9), tensor(&[h, t, d], 10));
    let compiled = program.compile_cpu("varlen", &attn_runtime::cpu::CpuOptions { threads: 2 }).expect("compiles");
    for lens in [&[37usize, 150, 1, 112][..], &[300][..], &[100, 100, 100][..], &[37, 150, 1, 112][..]] {
        let inputs = vec![q.clone(), k.clone(), v.clone(), ids(lens)];
        let want = program
            .run(
                "varlen",
                [("q", q.clone()), ("k", k.clone()), ("v", v.clone()), ("seq", ids(lens))],
                &RunOptions { dims: HashMap::new(), target: Target::Interp },
            )
            .expect("interpreter runs");
        let got = compiled.run_tensors(&inputs, &HashMap::new()).expect("cpu runs");
        let diff = max_diff(&got[0], &want[0].1);
        assert!(diff < 1e-5, "{lens:?}: max |diff| {diff}");
    }
}

#[test]
fn a_batch_of_packed_documents_matches_the_interpreter_as_its_ids_change() {
    let program = example("document_mask.attn");
    let (b, h, s, d) = (2, 2, 200, 16);
    let (q, k, v) = (tensor(&[b, h, s, d], 11), tensor(&[b, h, s, d], 12), tensor(&[b, h, s, d], 13));
    let compiled = program.compile_cpu("document_mask", &attn_runtime::cpu::CpuOptions { threads: 2 }).expect("compiles");
    let seg = |lens: [&[usize]; 2]| {
        let v: Vec<i32> = lens.iter().flat_map(|l| l.iter().enumerate().flat_map(|(x, n)| std::iter::repeat_n(x as i32, *n))).collect();
        Tensor::i32(vec![b, s], v).expect("seg")
    };
    for lens in [[&[70usize, 130][..], &[200][..]], [&[200][..], &[1, 99, 100][..]], [&[70, 130][..], &[200][..]]] {
        let ids = seg(lens);
        let want = program
            .run(
                "document_mask",
                [("q", q.clone()), ("k", k.clone()), ("v", v.clone()), ("seg", ids.clone())],
                &RunOptions { dims: HashMap::new(), target: Target::Interp },
            )
            .expect("interpreter runs");
        let got = compiled.run_tensors(&[q.clone(), k.clone(), v.clone(), ids], &HashMap::new()).expect("cpu runs");
        let diff = max_diff(&got[0], &want[0].1);
        assert!(diff < 1e-5, "{lens:?}: max |diff| {diff}");
    }
}

/// Chunked prefill over a ragged batch: sequence `s` brings `q_lens[s]` new queries against
/// `kv_lens[s]` keys (its cache and itself), bottom-right aligned. The cpu target against the
/// interpreter and against attention computed sequence by sequence in f64.
#[test]
fn a_ragged_chunked_prefill_is_bottom_right_aligned_per_sequence() {
    let program = example("varlen_kv.attn");
    let (q_lens, kv_lens) = ([5usize, 40, 1, 70, 0], [30usize, 100, 1, 70, 9]);
    let (tq, tk, h, d) = (q_lens.iter().sum::<usize>(), kv_lens.iter().sum::<usize>(), 2, 16);
    let (q, k, v) = (tensor(&[h, tq, d], 14), tensor(&[h, tk, d], 15), tensor(&[h, tk, d], 16));
    let table = |f: &dyn Fn(usize, usize) -> i32, lens: &[usize]| {
        let v: Vec<i32> = lens.iter().enumerate().flat_map(|(s, n)| (0..*n).map(move |x| f(s, x))).collect();
        Tensor::i32(vec![v.len()], v).expect("table")
    };
    let seq_q = table(&|s, _| s as i32, &q_lens);
    let seq_k = table(&|s, _| s as i32, &kv_lens);
    let pos_q = table(&|s, x| (kv_lens[s] - q_lens[s] + x) as i32, &q_lens);
    let pos_k = table(&|_, x| x as i32, &kv_lens);
    let inputs =
        [("q", q.clone()), ("k", k.clone()), ("v", v.clone()), ("seq_q", seq_q), ("seq_k", seq_k), ("pos_q", pos_q), ("pos_k", pos_k)];
    let got = program.run("varlen_kv", inputs.clone(), &cpu(&[])).expect("cpu runs");
    let interp = program.run("varlen_kv", inputs, &RunOptions { dims: HashMap::new(), target: Target::Interp }).expect("interpreter runs");
    assert!(max_diff(&got[0].1, &interp[0].1) < 1e-5, "cpu vs interpreter: {}", max_diff(&got[0].1, &interp[0].1));
    // Sequence by sequence: query x of sequence s sees keys 0 ..= kv_len - q_len + x of it.
    let (q, k, v, got) = (q.to_f64_vec(), k.to_f64_vec(), v.to_f64_vec(), got[0].1.to_f64_vec());
    let (mut q0, mut k0, mut worst) = (0, 0, 0.0f64);
    for (ql, kl) in q_lens.iter().zip(&kv_lens) {
        for hh in 0..h {
            for x in 0..*ql {
                let row = &q[(hh * tq + q0 + x) * d..][..d];
                let keys = kl - ql + x + 1;
                let s: Vec<f64> = (0..keys)
                    .map(|j| row.iter().zip(&k[(hh * tk + k0 + j) * d..][..d]).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt())
                    .collect();
                let m = s.iter().fold(f64::NEG_INFINITY, |a, b| a.max(*b));
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for c in 0..d {
                    let want: f64 = s.iter().enumerate().map(|(j, sj)| (sj - m).exp() / z * v[(hh * tk + k0 + j) * d + c]).sum();
                    worst = worst.max((want - got[(hh * tq + q0 + x) * d + c]).abs());
                }
            }
        }
        q0 += ql;
        k0 += kl;
    }
    assert!(worst < 1e-5, "max |diff| {worst}");
}

/// A paged KV cache (`examples/paged_decode.attn`, read in place through the block table): pages
/// shuffled in the pool, last pages partly filled, two queries per sequence bottom-right aligned;
/// against attention over each sequence's tokens gathered densely in f64.
#[test]
fn paged_decode_matches_dense_attention_over_each_sequences_pages() {
    let table = [vec![7, 2, 11, 5], vec![9, 0, 0, 0], vec![3, 10, 6, 0]];
    paged_case((2, 8, 12, 4), &[13, 4, 9], &table);
}

/// The same with more queries than the few-rows products take (chunked prefill against the
/// cache), pages of 3 rows (no key tile starts on a page boundary), and table entries outside
/// the pool where no valid token lies (clamped, as `paged` defines; masked by the lengths).
#[test]
fn paged_prefill_with_odd_pages_and_stray_table_entries() {
    let table = [vec![4, 17, 1, 0, 9, 12, 2, -1, 99, 99, 99, 99], vec![6, 3, 8, 10, 11, 5, 13, 14, 15, 16, 7, 99]];
    paged_case((9, 16, 18, 3), &[21, 33], &table);
}

/// Runs `paged_decode.attn` with `m` queries of width `d` per sequence, 2 heads, a pool of `np`
/// pages of `p` rows, sequences of `lens` tokens and the block `table`; checks the CPU against
/// the interpreter and an f64 reference over each sequence's tokens.
fn paged_case((m, d, np, p): (usize, usize, usize, usize), lens: &[usize], table: &[Vec<i32>]) {
    let program = example("paged_decode.attn");
    let (b, h, mp) = (lens.len(), 2usize, table[0].len());
    let (q, kp, vp) = (tensor(&[b, h, m, d], 20), tensor(&[np, p, h, d], 21), tensor(&[np, p, h, d], 22));
    let bt = Tensor::i32(vec![b, mp], table.iter().flatten().copied().collect()).expect("table");
    let ln = Tensor::i32(vec![b], lens.iter().map(|x| *x as i32).collect()).expect("lens");
    let inputs = [("q", q.clone()), ("k_pages", kp.clone()), ("v_pages", vp.clone()), ("block_table", bt), ("lens", ln)];
    let got = program.run("paged_decode", inputs.clone(), &cpu(&[])).expect("cpu runs");
    let interp =
        program.run("paged_decode", inputs, &RunOptions { dims: HashMap::new(), target: Target::Interp }).expect("interpreter runs");
    assert!(max_diff(&got[0].1, &interp[0].1) < 1e-5);
    let (q, kp, vp, got) = (q.to_f64_vec(), kp.to_f64_vec(), vp.to_f64_vec(), got[0].1.to_f64_vec());
    // Token t of sequence s, head hh: row t % p of page table[s][t / p].
    let row = |x: &[f64], s: usize, t: usize, hh: usize| x[((table[s][t / p] as usize * p + t % p) * h + hh) * d..][..d].to_vec();
    let mut worst = 0.0f64;
    for s in 0..b {
        for hh in 0..h {
            for i in 0..m {
                let qi = &q[((s * h + hh) * m + i) * d..][..d];
                let seen = lens[s] - m + i + 1;
                let sc: Vec<f64> =
                    (0..seen).map(|t| qi.iter().zip(row(&kp, s, t, hh)).map(|(a, c)| a * c).sum::<f64>() / (d as f64).sqrt()).collect();
                let mx = sc.iter().fold(f64::NEG_INFINITY, |a, c| a.max(*c));
                let z: f64 = sc.iter().map(|x| (x - mx).exp()).sum();
                for c in 0..d {
                    let want: f64 = sc.iter().enumerate().map(|(t, x)| (x - mx).exp() / z * row(&vp, s, t, hh)[c]).sum();
                    worst = worst.max((want - got[((s * h + hh) * m + i) * d + c]).abs());
                }
            }
        }
    }
    assert!(worst < 1e-5, "max |diff| {worst}");
}

/// `[NP, P, H, D]` → `[NP, H, P, D]`.
fn swap_page_axes(t: &Tensor) -> Tensor {
    let (s, x) = (t.shape.clone(), t.to_f64_vec());
    let (np, p, h, d) = (s[0], s[1], s[2], s[3]);
    let mut out = vec![0.0f32; x.len()];
    for a in 0..np {
        for r in 0..p {
            for hh in 0..h {
                for c in 0..d {
                    out[((a * h + hh) * p + r) * d + c] = x[((a * p + r) * h + hh) * d + c] as f32;
                }
            }
        }
    }
    Tensor::f32(vec![np, h, p, d], out).expect("tensor")
}

/// `examples/paged_decode.attn`'s `paged_decode_hnd`, the pages in FlashInfer's HND layout
/// permuted into `paged`: still read in place (its schedule says so), and equal to the NHD entry
/// on the same cache.
#[test]
fn pages_in_hnd_layout_are_read_in_place_like_nhd() {
    let source = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/paged_decode.attn")).expect("example");
    let schedules = attn_runtime::emit(&source, attn_runtime::Stage::Schedule).expect("schedules");
    let schedule = schedules.split("schedule ").find(|s| s.starts_with("paged_decode_hnd ")).expect("the HND entry's schedule");
    assert!(schedule.contains("k paged: table") && schedule.contains("v paged: table"), "{schedule}");
    let program = example("paged_decode.attn");
    let (b, h, m, d, np, p, mp) = (2usize, 3usize, 5usize, 16usize, 9usize, 5usize, 4usize);
    let (q, kp, vp) = (tensor(&[b, h, m, d], 30), tensor(&[np, p, h, d], 31), tensor(&[np, p, h, d], 32));
    let bt = Tensor::i32(vec![b, mp], vec![8, 1, 4, 6, 0, 7, 3, 2]).expect("table");
    let ln = Tensor::i32(vec![b], vec![19, 11]).expect("lens");
    let inputs =
        |k: Tensor, v: Tensor| [("q", q.clone()), ("k_pages", k), ("v_pages", v), ("block_table", bt.clone()), ("lens", ln.clone())];
    let want = program.run("paged_decode", inputs(kp.clone(), vp.clone()), &cpu(&[])).expect("nhd runs");
    let got = program.run("paged_decode_hnd", inputs(swap_page_axes(&kp), swap_page_axes(&vp)), &cpu(&[])).expect("hnd runs");
    assert!(max_diff(&got[0].1, &want[0].1) < 1e-6);
}

/// A paged read that something other than a flash op uses (here also returned) is gathered into
/// a copy instead (the schedule shows no paged operand), with the same values.
#[test]
fn a_paged_read_used_elsewhere_is_gathered_with_the_same_values() {
    let src = "
fn both(q: f32[B, H, M, D], k_pages: f32[NP, P, H, D], block_table: i32[B, MP]) -> (o: f32[B, H, M, D], k: f32[B, MP*P, H, D]) {
    let kk = paged(k_pages, block_table)
    let k = permute(kk, [0, 2, 1, 3])
    return softmax(q @ k.T, axis = -1) @ k, kk
}
";
    let schedule = attn_runtime::emit(src, attn_runtime::Stage::Schedule).expect("schedules");
    assert!(!schedule.contains("paged: table"), "{schedule}");
    let program = Program::from_source(src, "both.attn").expect("compiles");
    let (q, kp) = (tensor(&[1, 2, 3, 8], 40), tensor(&[5, 3, 2, 8], 41));
    let bt = Tensor::i32(vec![1, 3], vec![4, -2, 9]).expect("table");
    let inputs = [("q", q), ("k_pages", kp), ("block_table", bt)];
    let got = program.run("both", inputs.clone(), &cpu(&[])).expect("cpu runs");
    let want = program.run("both", inputs, &RunOptions { dims: HashMap::new(), target: Target::Interp }).expect("interpreter runs");
    for (g, w) in got.iter().zip(&want) {
        assert!(max_diff(&g.1, &w.1) < 1e-5);
    }
}

/// A cache long enough that decode splits its keys (split-KV, run split-major for a paged
/// cache, then merged): the same result as the interpreter, with a shuffled pool, and the same
/// bits on any thread count.
#[test]
fn a_long_paged_cache_decodes_in_key_splits_like_the_interpreter() {
    let program = example("paged_decode.attn");
    let (b, h, m, d, p, mp) = (2usize, 3usize, 1usize, 8usize, 16usize, 300usize);
    let np = b * mp;
    // Page k of sequence s is pool page (k·7 + s·301) mod np: shuffled (sequences share some).
    let table: Vec<i32> = (0..b).flat_map(|s| (0..mp).map(move |k| ((k * 7 + s * 301) % np) as i32)).collect();
    let (q, kp, vp) = (tensor(&[b, h, m, d], 50), tensor(&[np, p, h, d], 51), tensor(&[np, p, h, d], 52));
    let bt = Tensor::i32(vec![b, mp], table).expect("table");
    let ln = Tensor::i32(vec![b], vec![4500, 3001]).expect("lens");
    let inputs = [("q", q), ("k_pages", kp), ("v_pages", vp), ("block_table", bt), ("lens", ln)];
    let got = program.run("paged_decode", inputs.clone(), &cpu(&[])).expect("cpu runs");
    let want = program
        .run("paged_decode", inputs.clone(), &RunOptions { dims: HashMap::new(), target: Target::Interp })
        .expect("interpreter runs");
    assert!(max_diff(&got[0].1, &want[0].1) < 1e-5, "max |diff| {}", max_diff(&got[0].1, &want[0].1));
    // The same bits on one thread and on three (the splits merge in a fixed order).
    let dims = [("B", b), ("H", h), ("M", m), ("D", d), ("NP", np), ("P", p), ("MP", mp)];
    let compiled = same_bits_on_one_and_three_threads(&program, "paged_decode", &inputs, &dims);
    assert!(compiled.alloc_stats().expect("stats").partial_bytes > 0, "the keys were not split");
}

/// A pool of no pages is an error on the cpu target and in the interpreter, not a read outside
/// the pages.
#[test]
fn a_pool_of_no_pages_is_an_error() {
    let program = example("paged_decode.attn");
    let empty = Tensor::f32(vec![0, 4, 2, 8], Vec::new()).expect("tensor");
    let bt = Tensor::i32(vec![1, 2], vec![0, 1]).expect("table");
    let ln = Tensor::i32(vec![1], vec![5]).expect("lens");
    let inputs = [("q", tensor(&[1, 2, 1, 8], 60)), ("k_pages", empty.clone()), ("v_pages", empty), ("block_table", bt), ("lens", ln)];
    for opts in [cpu(&[]), RunOptions { dims: HashMap::new(), target: Target::Interp }] {
        let err = program.run("paged_decode", inputs.clone(), &opts).expect_err("no pages");
        assert!(err.to_string().contains("no pages"), "{err}");
    }
}

/// Attention with dropout of the weights over `[B, H, M, D]` queries and `[B, H, N, D]` keys,
/// causal (bottom-right) or not.
const DROPOUT: &str = "
fn attend(q: f32[B, H, M, D], k: f32[B, H, N, D], v: f32[B, H, N, D], seed: i32) -> f32[B, H, M, D] {
    let scores = q @ k.T / sqrt(D)
    return dropout(softmax(scores, axis = -1), seed, p = 0.2) @ v
}
fn causal(q: f32[B, H, M, D], k: f32[B, H, N, D], v: f32[B, H, N, D], seed: i32) -> f32[B, H, M, D] {
    let scores = q @ k.T / sqrt(D)
    let (b, h, i, j) = indices(scores)
    let masked = where(j <= i + N - M, scores, -inf)
    return dropout(softmax(masked, axis = -1), seed, p = 0.2) @ v
}
";

/// The attention with dropout, its gradients for `d_out`, in f64 from the definition: the
/// weights `P` of every row, each times dropout's factor `z` (`semantics::dropout_keeps` at the
/// score's position, the batch index row-major over (b, h)).
fn dropout_reference((q, k, v, d_out): (&Tensor, &Tensor, &Tensor, &Tensor), seed: i32, rate: f64, causal: bool) -> [Vec<f64>; 4] {
    use attn_compiler::ir::semantics::{dropout_keeps, dropout_scale};
    let (bh, m, n, d) = (q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3]);
    let (q, k, v, g) = (q.to_f64_vec(), k.to_f64_vec(), v.to_f64_vec(), d_out.to_f64_vec());
    let [mut out, mut dq, mut dk, mut dv] = [vec![0.0; bh * m * d], vec![0.0; bh * m * d], vec![0.0; bh * n * d], vec![0.0; bh * n * d]];
    let scale = (d as f64).sqrt();
    for b in 0..bh {
        let row = |x: &[f64], rows: usize, r: usize| x[(b * rows + r) * d..(b * rows + r + 1) * d].to_vec();
        for i in 0..m {
            let (qi, gi) = (row(&q, m, i), row(&g, m, i));
            let live = |j: usize| !causal || j <= i + n - m;
            let s: Vec<f64> = (0..n).map(|j| qi.iter().zip(row(&k, n, j)).map(|(a, c)| a * c).sum::<f64>() / scale).collect();
            let mx = (0..n).filter(|j| live(*j)).map(|j| s[j]).fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = (0..n).filter(|j| live(*j)).map(|j| (s[j] - mx).exp()).sum();
            let p: Vec<f64> = (0..n).map(|j| if live(j) { (s[j] - mx).exp() / z } else { 0.0 }).collect();
            let keep: Vec<f64> =
                (0..n).map(|j| if dropout_keeps(seed, b as u32, i as u32, j as u32, rate) { dropout_scale(rate) } else { 0.0 }).collect();
            let dp: Vec<f64> = (0..n).map(|j| keep[j] * gi.iter().zip(row(&v, n, j)).map(|(a, c)| a * c).sum::<f64>()).collect();
            let delta: f64 = (0..n).map(|j| p[j] * dp[j]).sum();
            for j in 0..n {
                let (vj, kj) = (row(&v, n, j), row(&k, n, j));
                let ds = p[j] * (dp[j] - delta) / scale;
                for c in 0..d {
                    out[(b * m + i) * d + c] += p[j] * keep[j] * vj[c];
                    dq[(b * m + i) * d + c] += ds * kj[c];
                    dk[(b * n + j) * d + c] += ds * qi[c];
                    dv[(b * n + j) * d + c] += p[j] * keep[j] * gi[c];
                }
            }
        }
    }
    [out, dq, dk, dv]
}

/// Fused dropout (forward: few-rows products for decode and split keys; backward) gives what
/// its definition gives, causal or not, and the same bits on one thread and on three.
#[test]
fn dropout_fused_into_flash_attention_matches_its_definition() {
    let program = Program::from_source(DROPOUT, "dropout.attn").expect("compiles");
    for (entry, causal, (b, h, m, n, d), seed) in
        [("causal", true, (2, 3, 150, 150, 16), 7), ("attend", false, (1, 2, 1, 3000, 32), -3), ("causal", true, (1, 2, 3, 700, 8), 11)]
    {
        let (q, k, v, g) = (tensor(&[b, h, m, d], 60), tensor(&[b, h, n, d], 61), tensor(&[b, h, n, d], 62), tensor(&[b, h, m, d], 63));
        let seed_t = Tensor::i32(vec![], vec![seed]).expect("seed");
        let grad = program.grad(entry, None).expect("derivable");
        let inputs = [("q", q.clone()), ("k", k.clone()), ("v", v.clone()), ("seed", seed_t.clone()), ("d_out", g.clone())];
        let got = grad.run(&format!("{entry}_grad"), inputs.clone(), &cpu(&[])).expect("cpu runs");
        let want = dropout_reference((&q, &k, &v, &g), seed, 0.2, causal);
        for ((name, t), w) in got.iter().zip(&want) {
            let worst = t.to_f64_vec().iter().zip(w).fold(0.0f64, |mx, (a, b)| mx.max((a - b).abs()));
            assert!(worst < 2e-5, "{entry} {b}x{h}x{m}x{n}: {name} differs by {worst}");
        }
        // The forward alone, fused (the few-rows path for short query blocks).
        let fwd = program.run(entry, [("q", q.clone()), ("k", k.clone()), ("v", v.clone()), ("seed", seed_t.clone())], &cpu(&[]));
        let fwd = fwd.expect("cpu runs");
        let worst = fwd[0].1.to_f64_vec().iter().zip(&want[0]).fold(0.0f64, |mx, (a, b)| mx.max((a - b).abs()));
        assert!(worst < 2e-5, "{entry} forward differs by {worst}");
        // Bit-reproducible across thread counts.
        let dims: HashMap<String, i64> =
            [("B", b), ("H", h), ("M", m), ("N", n), ("D", d)].iter().map(|(k, v)| (k.to_string(), *v as i64)).collect();
        let tensors: Vec<Tensor> = inputs.iter().map(|(_, t)| t.clone()).collect();
        let mut compiled = grad.compile_cpu(&format!("{entry}_grad"), &attn_runtime::cpu::CpuOptions { threads: 1 }).expect("compiles");
        let one = compiled.run_tensors(&tensors, &dims).expect("runs");
        compiled.set_threads(3).expect("a valid thread count");
        assert_eq!(one, compiled.run_tensors(&tensors, &dims).expect("runs"), "{entry}: 3 threads differ from 1");
    }
}

/// The fused kernel's keep mask, read off its output (uniform weights over `N` keys against
/// `V = I`: `out[i, j] = z_ij / N`): the keep rate is `1 − p`, masks of different key tiles,
/// rows, heads and seeds are independent, and a seed gives the same mask every time.
#[test]
fn fused_dropout_keeps_one_minus_p_independently_across_tiles() {
    let program = Program::from_source(DROPOUT, "dropout.attn").expect("compiles");
    let (h, m, n) = (2usize, 256usize, 256usize);
    let q = Tensor::f32(vec![1, h, m, n], vec![0.0; h * m * n]).expect("q");
    let k = Tensor::f32(vec![1, h, n, n], vec![0.0; h * n * n]).expect("k");
    let eye: Vec<f32> = (0..h * n * n).map(|x| f32::from(u8::from(x % n == (x / n) % n))).collect();
    let v = Tensor::f32(vec![1, h, n, n], eye).expect("v");
    let mask = |seed: i32| -> Vec<bool> {
        let inputs = [("q", q.clone()), ("k", k.clone()), ("v", v.clone()), ("seed", Tensor::i32(vec![], vec![seed]).expect("seed"))];
        let out = program.run("attend", inputs, &cpu(&[])).expect("runs");
        out[0].1.to_f64_vec().iter().map(|x| *x * n as f64 > 0.5).collect()
    };
    let (a, b) = (mask(1), mask(2));
    assert_eq!(a, mask(1), "the same seed gives another mask");
    let total = a.len() as f64;
    let rate = |xs: &[bool]| xs.iter().filter(|x| **x).count() as f64 / xs.len() as f64;
    // Within five standard deviations of a binomial proportion.
    let near = |got: f64, want: f64, count: f64| (got - want).abs() < 5.0 * (want * (1.0 - want) / count).sqrt();
    assert!(near(rate(&a), 0.8, total), "keep rate {}", rate(&a));
    // Pairs 64 keys apart (another key tile), a row apart, a head apart, a seed apart: kept
    // together at (1 − p)².
    let at = |hh: usize, i: usize, j: usize| (hh * m + i) * n + j;
    let pairs = |other: &dyn Fn(usize, usize, usize) -> Option<bool>| {
        let mut both = Vec::new();
        for hh in 0..h {
            for i in 0..m {
                for j in 0..n {
                    if let Some(o) = other(hh, i, j) {
                        both.push(a[at(hh, i, j)] && o);
                    }
                }
            }
        }
        both
    };
    for (what, both) in [
        ("the next key tile", pairs(&|hh, i, j| (j + 64 < n).then(|| a[at(hh, i, j + 64)]))),
        ("the next row", pairs(&|hh, i, j| (i + 1 < m).then(|| a[at(hh, i + 1, j)]))),
        ("the next head", pairs(&|hh, i, j| (hh + 1 < h).then(|| a[at(hh + 1, i, j)]))),
        ("another seed", pairs(&|hh, i, j| Some(b[at(hh, i, j)]))),
    ] {
        assert!(near(rate(&both), 0.64, both.len() as f64), "kept with {what}: {}", rate(&both));
    }
}

/// Dropout not fused into attention (element-wise, inside a reduction, under a transpose) gives
/// the interpreter's bits on the cpu target.
#[test]
fn unfused_dropout_is_the_interpreters() {
    let source = "
fn f(x: f32[B, S, D], seed: i32) -> (a: f32[B, S], b: f32[B, S, D], c: f32[D, S]) {
    let a = sum(dropout(x * 2.0, seed, p = 0.5), axis = -1)
    let b = dropout(x, seed, p = 0.25) + 1.0
    let c = dropout(x[0], seed, p = 0.5).T
    return a, b, c
}
";
    let program = Program::from_source(source, "dropout.attn").expect("compiles");
    let inputs = [("x", tensor(&[2, 70, 33], 70)), ("seed", Tensor::i32(vec![], vec![-9]).expect("seed"))];
    let got = program.run("f", inputs.clone(), &cpu(&[])).expect("cpu runs");
    let want = program.run("f", inputs, &RunOptions { dims: HashMap::new(), target: Target::Interp }).expect("interpreter runs");
    for ((name, a), (_, b)) in got.iter().zip(&want) {
        assert_eq!(a.to_f64_vec(), b.to_f64_vec(), "{name}");
    }
}

/// Sigmoid attention with dropout of its weights, fused (no normaliser: each weight dropped
/// alone), forward and gradients as the interpreter gives them.
#[test]
fn sigmoid_attention_with_dropout_matches_the_interpreter() {
    let source = "
fn f(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D], seed: i32) -> f32[B, H, S, D] {
    let s = q @ k.T / sqrt(D) - 2.0
    return dropout(sigmoid(s), seed, p = 0.3) @ v
}
";
    let program = Program::from_source(source, "sigmoid_dropout.attn").expect("compiles");
    assert!(attn_runtime::emit(source, attn_runtime::Stage::Opt).expect("optimises").contains("weights=sigmoid, score="), "not fused");
    let (b, h, s, d) = (1, 2, 90, 16);
    let inputs = [
        ("q", tensor(&[b, h, s, d], 80)),
        ("k", tensor(&[b, h, s, d], 81)),
        ("v", tensor(&[b, h, s, d], 82)),
        ("seed", Tensor::i32(vec![], vec![5]).expect("seed")),
        ("d_out", tensor(&[b, h, s, d], 83)),
    ];
    let grad = program.grad("f", None).expect("derivable");
    let got = grad.run("f_grad", inputs.clone(), &cpu(&[])).expect("cpu runs");
    let want = grad.run("f_grad", inputs, &RunOptions { dims: HashMap::new(), target: Target::Interp }).expect("interpreter runs");
    for ((name, a), (_, w)) in got.iter().zip(&want) {
        assert!(max_diff(a, w) < 2e-5, "{name} differs by {}", max_diff(a, w));
    }
}

/// Decode against a paged cache with every per-head part a work item walking several heads
/// together must keep apart: ALiBi slopes per head (a separable score), the lengths' mask,
/// dropout of the weights (keyed by the head's batch index) and the log-sum-exp; 8 heads and
/// split keys, so that the heads are walked in groups (4 of the 8). Against the interpreter,
/// the same bits on 1 and 3 threads.
#[test]
fn paged_decode_walking_heads_together_keeps_each_heads_parts() {
    let src = "
fn f(q: f32[B, H, M, D], k_pages: f32[NP, P, H, D], v_pages: f32[NP, P, H, D], block_table: i32[B, MP], lens: i32[B],
     slopes: f32[H], seed: i32) -> (o: f32[B, H, M, D], lse: f32[B, H, M]) {
    let k = permute(paged(k_pages, block_table), [0, 2, 1, 3])
    let v = permute(paged(v_pages, block_table), [0, 2, 1, 3])
    let scores = q @ k.T / sqrt(D)
    let (b, h, i, t) = indices(scores)
    let pos = lens[b] - M + i
    let biased = where(t <= pos, scores - slopes[h] * (pos - t), -inf)
    return dropout(softmax(biased, axis = -1), seed, p = 0.1) @ v, logsumexp(biased, axis = -1)
}
";
    let schedule = attn_runtime::emit(src, attn_runtime::Stage::Schedule).expect("schedules");
    assert!(schedule.contains("k paged: table") && schedule.contains("dropout"), "{schedule}");
    let program = Program::from_source(src, "grouped.attn").expect("compiles");
    let (b, h, m, d, p, mp) = (2usize, 8usize, 2usize, 16usize, 16usize, 300usize);
    let np = b * mp;
    let table: Vec<i32> = (0..b).flat_map(|s| (0..mp).map(move |k| ((k * 11 + s * 300) % np) as i32)).collect();
    let slopes = Tensor::f32(vec![h], (0..h).map(|x| 0.5f32.powi(x as i32 + 1)).collect()).expect("slopes");
    let inputs = [
        ("q", tensor(&[b, h, m, d], 60)),
        ("k_pages", tensor(&[np, p, h, d], 61)),
        ("v_pages", tensor(&[np, p, h, d], 62)),
        ("block_table", Tensor::i32(vec![b, mp], table).expect("table")),
        ("lens", Tensor::i32(vec![b], vec![4700, 2100]).expect("lens")),
        ("slopes", slopes),
        ("seed", Tensor::i32(vec![], vec![17]).expect("seed")),
    ];
    let got = program.run("f", inputs.clone(), &cpu(&[])).expect("cpu runs");
    let want = program.run("f", inputs.clone(), &RunOptions { dims: HashMap::new(), target: Target::Interp }).expect("interpreter runs");
    for (g, w) in got.iter().zip(&want) {
        assert!(max_diff(&g.1, &w.1) < 1e-5, "{}: max |diff| {}", g.0, max_diff(&g.1, &w.1));
    }
    let dims = [("B", b), ("H", h), ("M", m), ("D", d), ("NP", np), ("P", p), ("MP", mp)];
    same_bits_on_one_and_three_threads(&program, "f", &inputs, &dims);
}
