#!/usr/bin/env python3
"""attnc's multi-threaded CPU runs from torch on PyTorch's OpenMP team (the default once
``attnc.torch`` is imported) against attnc's own worker threads, switched in one process by
``attnc._attnc.share_openmp``, interleaved for several rounds, medians compared. Cases: the
GQA decode step (B=1, 32 query heads over 8 key/value heads, T=128, D=128) and a training
step's attention (B=1 H=8 S=1024 D=64 causal, forward+backward).

    python python/bench/openmp.py [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch_sdpa import per_call  # this directory's (run as a script: python/bench is on the path)

import attnc
import attnc.torch as at


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    team = attnc._attnc.shared_openmp()
    if team is None:
        raise SystemExit("no OpenMP team is shared (ATTNC_OPENMP=0, or this torch does not use OpenMP)")
    g = torch.Generator().manual_seed(0)

    def r(*shape, grad=False):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    q, k, v = r(1, 32, 1, 128), r(1, 8, 128, 128), r(1, 8, 128, 128)
    p = [r(1, 8, 1024, 64, grad=True) for _ in range(3)]

    def decode():
        at.sdpa(q, k, v, enable_gqa=True)

    def train():
        out = at.sdpa(*p, is_causal=True)
        out.backward(torch.ones_like(out))

    print(f"# {args.threads} thread(s), torch {torch.__version__}, {args.rounds} rounds interleaved; team: {team}")
    print("| case | OpenMP team | attnc's threads | ratio |")
    print("|---|---|---|---|")
    for name, fn, unit, label in [("decode T=128 H=32/8 D=128", decode, 1e6, "us"), ("S=1024 D=64 causal fwd+bwd", train, 1e3, "ms")]:
        times = {"team": [], "own": []}
        for _ in range(args.rounds):
            for mode in times:
                attnc._attnc.share_openmp(team if mode == "team" else None)
                times[mode].append(per_call(fn, 0.3))
        attnc._attnc.share_openmp(team)
        a, b = statistics.median(times["team"]), statistics.median(times["own"])
        print(f"| {name} | {a * unit:.1f} {label} | {b * unit:.1f} {label} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
