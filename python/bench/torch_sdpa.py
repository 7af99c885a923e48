#!/usr/bin/env python3
"""``attnc.torch.sdpa`` against ``torch.nn.functional.scaled_dot_product_attention``, from torch,
on torch tensors: each case timed interleaved (attnc, sdpa, attnc, ...) for several rounds,
medians compared. Cases (f32, one thread unless --threads):

- overhead: B=H=1 S=16 D=16 without gradients (issue target: <= 15 us per call);
- decode: one query against T=128 cached keys, B=1 H=32 D=128, causal, GQA 32/8;
- prefill: B=1 H=8 S=1024 D=64 causal, forward only and forward+backward;
- transformers' bool masks ``[B, 1, S, S]`` at B=2 H=8 S=1024 D=64: causal with left padding,
  and four packed documents, forward and forward+backward (attnc skips the tiles the mask
  clears, from its block bounds);
- training with attention dropout (``dropout_p=0.1``): the same prefill, forward and
  forward+backward, at S=1024 and S=4096 (torch's CPU kernels have no fused dropout: they
  form the S×S weights).

Run from the repository root after ``pip install ./python`` into an environment with torch:

    python python/bench/torch_sdpa.py [--rounds 5] [--threads 1] [--cases overhead,decode] [--best]

With ``--ops``: the prefill forward+backward through the ops ``torch.compile`` puts in the
graph, run eagerly: ``attnc::sdpa`` (its backward runs the derived program, so the forward
again) against ``attnc::sdpa_saving`` (the forward also returns the output and log-sum-exp the
backward reads), beside eager ``attnc.torch.sdpa`` and torch's; then the same for a packed
ragged batch through ``attnc::varlen`` and ``attnc::varlen_saving``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import attnc.torch as at


def per_call(fn, seconds: float = 0.2) -> float:
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s, grad=False: torch.randn(*s, generator=g).requires_grad_(grad)  # noqa: E731
    tiny = [r(1, 1, 16, 16) for _ in range(3)]
    yield "overhead B=H=1 S=16 D=16", lambda f: lambda: f(*tiny), False
    q, k, v = r(1, 32, 1, 128), r(1, 8, 128, 128), r(1, 8, 128, 128)
    yield "decode T=128 H=32/8 D=128", lambda f: lambda: f(q, k, v, enable_gqa=True), False
    p = [r(1, 8, 1024, 64) for _ in range(3)]
    yield "prefill S=1024 D=64 causal", lambda f: lambda: f(*p, is_causal=True), False
    pg = [r(1, 8, 1024, 64, grad=True) for _ in range(3)]

    def train(f):
        def step():
            out = f(*pg, is_causal=True)
            out.backward(torch.ones_like(out))

        return step

    yield "prefill S=1024 D=64 causal, fwd+bwd", train, True
    # transformers' masks (bool [B, 1, S, S], as its "sdpa" mask function builds them): causal
    # with batch index 0 left-padded by 256 tokens; four packed documents of 256 tokens each.
    pos = torch.arange(1024)
    causal = pos[None, :] <= pos[:, None]
    padded = torch.stack([causal & (pos[None, :] >= 256) & (pos[:, None] >= 256), causal])[:, None]
    packed = (causal & (pos[None, :] // 256 == pos[:, None] // 256))[None, None].expand(2, 1, 1024, 1024).contiguous()
    for what, mask in (("padding mask", padded), ("packed mask", packed)):
        m = [r(2, 8, 1024, 64, grad=True) for _ in range(3)]
        yield f"{what} B=2 S=1024 D=64, fwd", lambda f, m=m, mask=mask: lambda: f(*m, attn_mask=mask), False

        def train_masked(f, m=m, mask=mask):
            def step():
                out = f(*m, attn_mask=mask)
                out.backward(torch.ones_like(out))

            return step

        yield f"{what} B=2 S=1024 D=64, fwd+bwd", train_masked, True
    for s in (1024, 4096):
        d = [r(1, 8, s, 64, grad=True) for _ in range(3)]
        yield f"dropout 0.1 S={s} D=64 causal, fwd", lambda f, d=d: lambda: f(*d, is_causal=True, dropout_p=0.1), False

        def train_dropout(f, d=d):
            def step():
                out = f(*d, is_causal=True, dropout_p=0.1)
                out.backward(torch.ones_like(out))

            return step

        yield f"dropout 0.1 S={s} D=64 causal, fwd+bwd", train_dropout, True


def ops(rounds: int, pick) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 1024, 64, generator=g).requires_grad_() for _ in range(3))
    cot = torch.randn(1, 8, 1024, 64, generator=g)
    flags = (0.0, True, None, False, None)
    steps = {
        "attnc::sdpa (backward reruns the forward)": lambda: torch.ops.attnc.sdpa(q, k, v, None, *flags).backward(cot),
        "attnc::sdpa_saving": lambda: torch.ops.attnc.sdpa_saving(q, k, v, None, *flags)[0].backward(cot),
        "attnc.torch.sdpa, eager": lambda: at.sdpa(q, k, v, is_causal=True).backward(cot),
        "torch sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(cot),
    }
    table("prefill S=1024 D=64 causal, fwd+bwd", steps, rounds, pick)
    # A packed ragged batch (sequences of 256, 768 and 1024 tokens), H=8 D=64, causal.
    cu = torch.tensor([0, 256, 1024, 2048], dtype=torch.int32)
    pq, pk, pv = (torch.randn(2048, 8, 64, generator=g).requires_grad_() for _ in range(3))
    pcot = torch.randn(2048, 8, 64, generator=g)
    steps = {
        "attnc::varlen (backward reruns the forward)": lambda: torch.ops.attnc.varlen(pq, pk, pv, cu, cu, True, None).backward(pcot),
        "attnc::varlen_saving": lambda: torch.ops.attnc.varlen_saving(pq, pk, pv, cu, cu, True, None)[0].backward(pcot),
        "attnc.torch.varlen_attention, eager": lambda: at.varlen_attention(pq, pk, pv, cu, cu, causal=True).backward(pcot),
    }
    print()
    table("varlen 256+768+1024 tokens H=8 D=64 causal, fwd+bwd", steps, rounds, pick)


def table(title: str, steps, rounds: int, pick) -> None:  # type: ignore[no-untyped-def]
    """Times each of ``steps`` (interleaved, ``rounds`` rounds) and prints a table of ms."""
    times: dict = {name: [] for name in steps}
    for _ in range(rounds):
        for name, f in steps.items():
            times[name].append(per_call(f, 1.0))
    print(f"| {title} | ms |\n|---|---|")
    for name, xs in times.items():
        print(f"| {name} | {pick(xs) * 1e3:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cases", default="", help="only the cases whose name starts with one of these (comma-separated)")
    ap.add_argument("--best", action="store_true", help="the best round of each instead of the median (on a shared machine, less of its neighbours' load)")
    ap.add_argument("--ops", action="store_true", help="time the torch.compile ops' forward+backward instead")
    args = ap.parse_args()
    wanted = [c for c in args.cases.split(",") if c]
    pick = min if args.best else statistics.median
    torch.set_num_threads(args.threads)
    stat = "best" if args.best else "median"
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), {stat} of {args.rounds} rounds interleaved")
    if args.ops:
        ops(args.rounds, pick)
        return
    print("| case | attnc | sdpa | sdpa/attnc |\n|---|---|---|---|")
    for name, make, grad in cases():
        if wanted and not any(name.startswith(w) for w in wanted):
            continue
        ours, theirs = make(at.sdpa), make(F.scaled_dot_product_attention)
        a, b = [], []
        with torch.set_grad_enabled(grad):
            for _ in range(args.rounds):
                a.append(per_call(ours))
                b.append(per_call(theirs))
        ma, mb = pick(a), pick(b)
        unit, k = ("us", 1e6) if mb < 1e-3 else ("ms", 1e3)
        print(f"| {name} | {ma * k:.1f} {unit} | {mb * k:.1f} {unit} | {mb / ma:.2f} |", flush=True)


if __name__ == "__main__":
    main()
