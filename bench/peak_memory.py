#!/usr/bin/env python3
"""The peak memory of one plain attention call by a peer, in this fresh process.

    python bench/peak_memory.py torch|ort INPUTS_DIR THREADS

Run by `compare.py --memory` inside bench/.venv. It loads q, k and v from INPUTS_DIR/*.npy,
calls the framework once on a tiny input (thread pools, lazy initialisation), resets the peak
resident set size (VmHWM, by writing 5 to /proc/self/clear_refs), calls PyTorch's
scaled_dot_product_attention or ONNX Runtime's Attention op once on the inputs, and prints
{"extra_bytes": N}: the rise of VmHWM during the call less the output it returns.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch

from compare import ort_attention, sdpa


def peak_rss():
    """This process's peak resident set size since the last reset_peak_rss(), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main():
    framework, inputs, threads = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
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
