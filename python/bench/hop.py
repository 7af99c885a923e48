#!/usr/bin/env python3
"""How torch tensors reach the binding: the same program call on three CPU tensors
(B=H=1 S=16 D=16, one thread), handed over as NumPy arrays (``tensor.numpy()``, the path
before DLPack) and as DLPack capsules (``torch.utils.dlpack.to_dlpack``, the path
``attnc.torch`` takes), beside the whole ``attnc.torch.sdpa`` call and torch's own
``scaled_dot_product_attention``; interleaved, several rounds, best and median per call.
Also the per-tensor cost of each export alone.

With ``--layout``, the same for transformers' layout instead: causal prefill (B=1 S=1024, 8
heads of 64, one thread), q/k/v as ``[B, S, H, D]`` projections seen as ``[B, H, S, D]``
transposed views, and the result wanted as ``[B, S, H, D]``: read in place (what
``attnc.torch.sdpa`` does now) against copied to dense ``[B, H, S, D]`` first and the result
copied back (what it did before), forward and forward+backward, interleaved.

With ``--out``, results written into the caller's tensors (``Program.run(..., out=)``):
causal attention (B=1, 8 heads of 64, one thread) at S = 128 and 1024 through
``examples/causal.attn``, a fresh result against ``out=`` a dense tensor (written in place by
the kernels) and against ``out=`` a ``[B, S, H, D]`` tensor seen as ``[B, H, S, D]`` (written
once after the run), beside a fresh result copied into that layout by torch, interleaved.

    python python/bench/hop.py [--rounds 15] [--calls 2000] [--layout] [--out]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import timeit

import torch
from torch.utils.dlpack import to_dlpack

import attnc.torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--layout", action="store_true", help="time sequence-major q/k/v read in place against copied")
    ap.add_argument("--out", action="store_true", help="time results written into the caller's tensors against fresh ones")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.layout:
        layout(args.rounds)
        return
    if args.out:
        out(args.rounds)
        return
    q, k, v = (torch.randn(1, 1, 16, 16) for _ in range(3))
    attnc.torch.sdpa(q, k, v)
    prog = next(iter(attnc.torch._SDPA_PROGRAMS.values()))[0]
    run = prog._compiled.run
    calls = {
        "binding, numpy() arrays": lambda: torch.from_numpy(run((q.numpy(), k.numpy(), v.numpy()), None, None)[0]),
        "binding, DLPack capsules": lambda: torch.from_numpy(run((to_dlpack(q), to_dlpack(k), to_dlpack(v)), None, None)[0]),
        "attnc.torch.sdpa": lambda: attnc.torch.sdpa(q, k, v),
        "torch sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
    }
    times: dict = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            for _ in range(args.calls // 10):
                call()
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread, {args.rounds} rounds interleaved")
    print("| call | best | median |\n|---|---|---|")
    for name, xs in times.items():
        print(f"| {name} | {min(xs):.2f} us | {statistics.median(xs):.2f} us |")
    print("\n| export, per tensor | best |\n|---|---|")
    for name, export in (("tensor.numpy()", lambda: q.numpy()), ("to_dlpack(tensor)", lambda: to_dlpack(q)), ("tensor.__dlpack__()", lambda: q.__dlpack__())):
        best = min(timeit.repeat(export, number=100_000, repeat=5)) / 100_000 * 1e6
        print(f"| {name} | {best:.2f} us |")


def layout(rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1024, 8, 64, generator=g).transpose(1, 2).requires_grad_() for _ in range(3))

    def in_place() -> torch.Tensor:
        return attnc.torch.sdpa(q, k, v, is_causal=True).transpose(1, 2).contiguous()

    def copied() -> torch.Tensor:
        dense = [t.contiguous() for t in (q, k, v)]
        return attnc.torch.sdpa(*dense, is_causal=True).transpose(1, 2).contiguous()

    def step(f):  # type: ignore[no-untyped-def]
        def run() -> None:
            f().sum().backward()

        return run

    cases = {"fwd, in place": in_place, "fwd, copied": copied, "fwd+bwd, in place": step(in_place), "fwd+bwd, copied": step(copied)}
    times: dict = {name: [] for name in cases}
    for _ in range(rounds):
        for name, f in cases.items():
            with torch.set_grad_enabled(name.startswith("fwd+bwd")):
                f()
                start = time.perf_counter()
                for _ in range(3):
                    f()
                times[name].append((time.perf_counter() - start) / 3 * 1e3)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread, {rounds} rounds interleaved")
    print("| case | best | median |\n|---|---|---|")
    for name, xs in times.items():
        print(f"| {name} | {min(xs):.2f} ms | {statistics.median(xs):.2f} ms |")


def out(rounds: int) -> None:
    from pathlib import Path

    prog = attnc.compile(Path(__file__).resolve().parents[2] / "examples" / "causal.attn")
    g = torch.Generator().manual_seed(0)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread, {rounds} rounds interleaved")
    print("| S | case | best | median |\n|---|---|---|---|")
    for s in (128, 1024):
        q, k, v = (torch.randn(1, 8, s, 64, generator=g) for _ in range(3))
        dense = torch.empty(1, 8, s, 64)
        seq_major = torch.empty(1, s, 8, 64)
        cases = {
            "fresh result": lambda: prog(q, k, v),
            "out= dense (in place)": lambda: prog.run(q, k, v, out=dense),
            "fresh, then copied to [B, S, H, D]": lambda: seq_major.copy_(prog(q, k, v).transpose(1, 2)),
            "out= [B, S, H, D] view": lambda: prog.run(q, k, v, out=seq_major.transpose(1, 2)),
        }
        reps = max(3, 3000 // s)
        times: dict = {name: [] for name in cases}
        for _ in range(rounds):
            for name, f in cases.items():
                f()
                start = time.perf_counter()
                for _ in range(reps):
                    f()
                times[name].append((time.perf_counter() - start) / reps * 1e6)
        for name, xs in times.items():
            print(f"| {s} | {name} | {min(xs):.1f} us | {statistics.median(xs):.1f} us |")


if __name__ == "__main__":
    main()
