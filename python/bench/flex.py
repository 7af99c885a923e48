#!/usr/bin/env python3
"""``attnc.torch.flex_attention`` against the same attention in eager PyTorch (scores
materialised, ``score_mod`` applied by broadcasting) and against torch's own
``flex_attention`` (forward only: torch has no CPU backward), ALiBi (causal) and soft-capping,
B=1 H=8 D=64, interleaved for several rounds, medians compared (issue target: >= 3x eager).

With ``--compile``, the cold compile instead (issue target: <= 50 ms, and no recompile for a
new sequence length): for each function of the attention-gym collection, every cache emptied
(``attnc.clear_cache()`` and ``attnc.torch``'s), the first call at S=256 less a warm one (tracing,
the ``.attn`` program, optimising, scheduling, Cranelift), forward alone and forward+backward
(the derived backward program too); then the first call at S=512, which must compile nothing.

With ``--ops``, the forward+backward of the ops ``torch.compile`` puts in the graph, run
eagerly (ALiBi, causal): ``attnc::program``, whose backward runs the derived program and so the
forward again (what ``flex_attention`` compiled to before), against ``attnc::program_saving`` +
``attnc::program_backward``, whose forward saves the output and log-sum-exp for the backward,
beside the eager ``flex_attention``.

    python python/bench/flex.py [--rounds 3] [--threads 1] [--seqs 1024,2048] [--compile] [--ops]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import attnc.torch as at

warnings.filterwarnings("ignore")
H = 8
SLOPES = torch.tensor([2.0 ** (-8 * (n + 1) / H) for n in range(H)])


def alibi(s, b, h, qi, ki):
    return s + SLOPES[h] * (ki - qi)


def causal(b, h, qi, ki):
    return qi >= ki


def softcap(s, b, h, qi, ki):
    return 30.0 * torch.tanh(s / 30.0)


CASES = {"alibi (causal)": (alibi, causal), "soft-capping": (softcap, None)}


def eager(q, k, v, score_mod, mask_mod):
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    L, S = s.shape[-2:]
    b = torch.arange(q.shape[0])[:, None, None, None]
    h = torch.arange(H)[None, :, None, None]
    i = torch.arange(L)[None, None, :, None]
    j = torch.arange(S)[None, None, None, :]
    s = score_mod(s, b, h, i, j)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, i, j), float("-inf"))
    return torch.softmax(s, -1) @ v


def timed(fn, seconds=0.5):
    fn()
    n, start = 0, time.perf_counter()
    while n < 2 or time.perf_counter() - start < seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


# The attention-gym functions (as python/tests/test_torch_flex.py has them), at B=1 H=8.
TABLE = torch.randn(2 * 512 - 1)
HEAD_BIAS = torch.randn(H, 512, 512)
DOCS = torch.arange(512) // 100
GYM = {
    "alibi": (alibi, causal, []),
    "soft-capping": (softcap, None, []),
    "sliding window": (None, lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= 64), []),
    "prefix lm": (None, lambda b, h, qi, ki: (ki <= 32) | (qi >= ki), []),
    "document mask": (None, lambda b, h, qi, ki: (DOCS[qi] == DOCS[ki]) & (qi >= ki), []),
    "relative position bias": (lambda s, b, h, qi, ki: s + TABLE[qi - ki + 511], None, [TABLE]),
    "causal, learned bias table": (lambda s, b, h, qi, ki: s + HEAD_BIAS[h, qi, ki], causal, [HEAD_BIAS]),
}


def cold_compiles(rounds: int) -> None:
    import attnc

    print(f"# torch {torch.__version__}, 1 thread, B=1 H={H} D=64 f32; best of {rounds} cold starts, ms")
    print("| function | fwd: cold − warm | fwd+bwd: cold − warm | S=512 after S=256: programs compiled |\n|---|---|---|---|")
    for name, (sm, mm, captured) in GYM.items():
        fwd, both, new = [], [], []
        for _ in range(rounds):
            for grad in (False, True):
                attnc.clear_cache()
                for cache in (at._FLEX_PROGRAMS, at._FLEX_SPLITS):
                    cache.clear()
                g = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(1, H, 256, 64, generator=g).requires_grad_(grad) for _ in range(3))
                for t in captured:
                    t.requires_grad_(grad)
                mask = at.create_block_mask(mm, None, None, 256, 256) if mm else None

                def call():
                    out = at.flex_attention(q, k, v, score_mod=sm, block_mask=mask)
                    if grad:
                        out.sum().backward()

                with torch.set_grad_enabled(grad):
                    start = time.perf_counter()
                    call()
                    cold = time.perf_counter() - start
                    warm = min(timed(call, 0.0) for _ in range(3))
                (both if grad else fwd).append((cold - warm) * 1e3)
                if grad:
                    programs = len(at._FLEX_PROGRAMS) + len(at._FLEX_SPLITS)
                    q, k, v = (torch.randn(1, H, 512, 64, generator=g).requires_grad_() for _ in range(3))
                    mask = at.create_block_mask(mm, None, None, 512, 512) if mm else None
                    call()
                    new.append(len(at._FLEX_PROGRAMS) + len(at._FLEX_SPLITS) - programs)
        print(f"| {name} | {min(fwd):.1f} | {min(both):.1f} | {max(new)} |", flush=True)


def compiled_ops(rounds: int, seqs: list) -> None:
    from attnc._ops import _flex_key, call_key
    from attnc._trace import Tracer, trace

    tracer = Tracer()
    mod = trace(alibi, ("scores", "b", "h", "i", "j"), ("f", "i", "i", "i", "i"), tracer, "score_mod")
    mask = trace(causal, ("b", "h", "i", "j"), ("i", "i", "i", "i"), tracer, "mask_mod")
    text = at._flex_source("f32", False, None, mod, mask, ((torch.float32, 1),))
    key = _flex_key(text, False)
    bm = at.create_block_mask(causal, None, None, 16, 16)
    print(f"# torch {torch.__version__}, 1 thread, B=1 H={H} D=64 f32, ALiBi causal, forward+backward, {rounds} rounds interleaved, ms")
    print("| S | program + program_backward (backward reruns the forward) | program_saving + program_backward | eager flex_attention |\n|---|---|---|---|")
    for s in seqs:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, H, s, 64, generator=g).requires_grad_() for _ in range(3))
        slopes = SLOPES.clone().requires_grad_()
        cot = torch.randn(1, H, s, 64, generator=g)
        cases = {
            "flex": lambda: torch.ops.attnc.program(key, [q, k, v, slopes])[0].backward(cot),
            "saving": lambda: call_key(key, [q, k, v, slopes]).backward(cot),
            "eager": lambda: at.flex_attention(q, k, v, score_mod=lambda sc, b, h, qi, ki: sc + slopes[h] * (ki - qi), block_mask=bm).backward(cot),
        }
        times: dict = {name: [] for name in cases}
        for _ in range(rounds):
            for name, f in cases.items():
                times[name].append(timed(f) * 1e3)
        best = {name: min(xs) for name, xs in times.items()}
        med = {name: statistics.median(xs) for name, xs in times.items()}
        print(f"| {s} | {best['flex']:.1f} / {med['flex']:.1f} | {best['saving']:.1f} / {med['saving']:.1f} | {best['eager']:.1f} / {med['eager']:.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seqs", default="1024,2048")
    ap.add_argument("--compile", action="store_true", help="time cold compiles of the attention-gym functions instead")
    ap.add_argument("--ops", action="store_true", help="time the torch.compile ops' forward+backward instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.ops:
        torch.set_num_threads(1)
        compiled_ops(args.rounds, [int(x) for x in args.seqs.split(",")])
        return
    if args.compile:
        torch.set_num_threads(1)
        cold_compiles(args.rounds)
        return
    print(f"# torch {torch.__version__}, {args.threads} thread(s), B=1 H={H} D=64 f32, {args.rounds} rounds interleaved, ms")
    print("| case | S | pass | attnc | eager | torch flex | eager/attnc | flex/attnc |\n|---|---|---|---|---|---|---|---|")
    for name, (sm, mm) in CASES.items():
        for s in (int(x) for x in args.seqs.split(",")):
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, H, s, 64, generator=g) for _ in range(3))
            bm_a = at.create_block_mask(mm, None, None, s, s) if mm else None
            bm_t = torch_block_mask(mm, None, None, s, s, device="cpu") if mm else None
            for grad in (False, True):
                qg, kg, vg = (x.clone().requires_grad_(grad) for x in (q, k, v))

                def step(f):
                    def run():
                        out = f()
                        if grad:
                            out.backward(torch.ones_like(out))

                    return run

                ours = step(lambda: at.flex_attention(qg, kg, vg, score_mod=sm, block_mask=bm_a))
                theirs = step(lambda: eager(qg, kg, vg, sm, mm))
                flex = None if grad else step(lambda: torch_flex(q, k, v, score_mod=sm, block_mask=bm_t))
                a, b, c = [], [], []
                with torch.set_grad_enabled(grad):
                    for _ in range(args.rounds):
                        a.append(timed(ours))
                        b.append(timed(theirs))
                        if flex is not None:
                            c.append(timed(flex))
                ma, mb = statistics.median(a), statistics.median(b)
                mc = statistics.median(c) if c else None
                flex_cols = f"{mc * 1e3:.1f} | {mc / ma:.2f}" if mc else "— | —"
                print(f"| {name} | {s} | {'fwd+bwd' if grad else 'fwd'} | {ma * 1e3:.1f} | {mb * 1e3:.1f} | "
                      f"{flex_cols.split(' | ')[0]} | {mb / ma:.2f} | {flex_cols.split(' | ')[1]} |", flush=True)


if __name__ == "__main__":
    main()
