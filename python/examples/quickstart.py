"""attnc from Python: compile a program, call it on NumPy arrays, compare with PyTorch.

    python python/examples/quickstart.py
"""

from pathlib import Path

import numpy as np

import attnc

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# Compile: a path or the program text. The last function of the file is the entry point.
prog = attnc.compile(EXAMPLES / "causal.attn")
print(prog.signature)

# Call: dims (B, H, S, D) come from the shapes; float32 arrays are read in place.
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 8, 512, 64), dtype=np.float32) for _ in range(3))
out = prog(q, k, v)  # or prog(q=q, k=k, v=v)
print("out:", out.dtype, out.shape)

# Check against plain NumPy.
scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(64.0)
scores[..., np.triu_indices(512, 1)[0], np.triu_indices(512, 1)[1]] = -np.inf
weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
reference = (weights / weights.sum(axis=-1, keepdims=True)) @ v
print("max |attnc - numpy|:", float(np.abs(out - reference).max()))

# What the compiler made of it: one fused flash op, half of its tiles skipped.
print(prog.emit("opt").splitlines()[-1])

# Compare with PyTorch when it is installed: torch tensors in, torch tensors out.
try:
    import torch
except ImportError:
    print("torch is not installed; skipping the comparison (pip install torch)")
else:
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    mine = prog(tq, tk, tv)
    theirs = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    print("max |attnc - torch sdpa|:", float((mine - theirs).abs().max()))
