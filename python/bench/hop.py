#!/usr/bin/env python3
"""How torch tensors reach the binding: the same program call on three CPU tensors
(B=H=1 S=16 D=16, one thread), handed over as NumPy arrays (``tensor.numpy()``, the path
before DLPack) and as DLPack capsules (``torch.utils.dlpack.to_dlpack``, the path
``attnc.torch`` takes), beside the whole ``attnc.torch.sdpa`` call and torch's own
``scaled_dot_product_attention``; interleaved, several rounds, best and median per call.
Also the per-tensor cost of each export alone.

    python python/bench/hop.py [--rounds 15] [--calls 2000]
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
    args = ap.parse_args()
    torch.set_num_threads(1)
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


if __name__ == "__main__":
    main()
