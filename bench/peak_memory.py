#!/usr/bin/env python3
"""The peak memory of one plain attention call (or one training step) by a peer, in this
fresh process.

    python bench/peak_memory.py torch|ort|torch-train INPUTS_DIR THREADS [KIND]

Run by `compare.py --memory` inside bench/.venv. It loads q, k and v from INPUTS_DIR/*.npy,
calls the framework once on a tiny input (thread pools, lazy initialisation), resets the peak
resident set size (VmHWM, by writing 5 to /proc/self/clear_refs), calls PyTorch's
scaled_dot_product_attention or ONNX Runtime's Attention op once on the inputs, and prints
{"extra_bytes": N}: the rise of VmHWM during the call less the output it returns.

`torch-train` runs compare.py's TrainPeer of KIND (causal, alibi, softcap): one forward plus
backward with PyTorch autograd on the inputs (d_out included), after one step at S=16; the
output and the gradients it leaves are not counted.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch

from compare import Case, TrainPeer, ort_attention, sdpa


def peak_rss():
    """This process's peak resident set size since the last reset_peak_rss(), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def train(inputs, threads, kind):
    """Peak RSS rise of one training step of `kind` on `inputs`, less its output and gradients."""
    import tempfile

    q = np.load(inputs / "q.npy")
    b, h, s, d = q.shape
    with tempfile.TemporaryDirectory() as tiny:
        rng = np.random.default_rng(0)
        for p in inputs.glob("*.npy"):
            x = np.load(p)
            shape = tuple(16 if n == s else n for n in x.shape)
            np.save(Path(tiny) / p.name, rng.standard_normal(shape, dtype=np.float32))
        TrainPeer(Case(kind, 16, d, threads), tiny).step()
    peer = TrainPeer(Case(kind, s, d, threads), inputs)
    reset_peak_rss()
    before = peak_rss()
    peer.step()
    grads = sum(t.grad.nbytes for t in peer.leaves.values())
    output = b * h * s * d * 4
    print(json.dumps({"extra_bytes": peak_rss() - before - grads - output}))


def main():
    framework, inputs, threads = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    if framework == "torch-train":
        return train(inputs, threads, sys.argv[4])
    q, k, v = (np.load(inputs / f"{n}.npy") for n in ("q", "k", "v"))
    b, h, _, d = q.shape
    tiny = [np.random.default_rng(0).standard_normal((b, h, 16, d), dtype=np.float32) for _ in range(3)]
    if framework == "torch":
        torch.set_num_threads(threads)
        call = lambda q, k, v: sdpa(*(torch.from_numpy(x) for x in (q, k, v))).numpy()
    else:
        session = ort_attention(threads, d)
        call = lambda q, k, v: session.run(None, {"Q": q, "K": k, "V": v})[0]
    call(*tiny)
    reset_peak_rss()
    before = peak_rss()
    out = call(q, k, v)
    print(json.dumps({"extra_bytes": peak_rss() - before - out.nbytes}))


if __name__ == "__main__":
    main()
