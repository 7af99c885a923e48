#!/usr/bin/env python3
"""attnc's CUDA target against PyTorch on the same GPU, in one interleaved run.

For every case (B=4, H=16, D in {64, 128}, S in {1024, 4096, 16384}, causal and not, f16 and
bf16) it times, one after the other:

  - attnc: `attnc bench FILE --target cuda --json` on a generated .attn program (kernel time
    measured with CUDA events, median of --iters runs);
  - PyTorch `scaled_dot_product_attention` restricted to its flash / cuDNN backends;
  - FlexAttention (`torch.nn.attention.flex_attention`, compiled) with the same mask, when this
    PyTorch has it.

TFLOP/s count useful FLOPs: 4*B*H*S*S*D, half of that for causal (FlashAttention's convention).
The table (markdown) goes to stdout, and with --out to a file for docs/performance.md.

    python3 bench/compare_gpu.py                      # every case
    python3 bench/compare_gpu.py --quick              # S=1024 and 4096, D=128, f16 only
    python3 bench/compare_gpu.py --check              # also compare attnc's output with SDPA

Needs: an NVIDIA GPU (sm_80+), PyTorch with CUDA, a release build of attnc
(`cargo build --release -p attn-runtime`), NVRTC (see docs/cuda.md).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROGRAM = """\
fn attention(q: {t}[B, H, S, D], k: {t}[B, H, S, D], v: {t}[B, H, S, D]) -> {t}[B, H, S, D] {{
    let scores = q @ k.T / sqrt(D)
{body}
}}
"""
CAUSAL = """    let (b, h, i, j) = indices(scores)
    return softmax(where(j <= i, scores, -inf), axis = -1) @ v"""
PLAIN = """    return softmax(scores, axis = -1) @ v"""


def flops(b, h, s, d, causal):
    f = 4.0 * b * h * s * s * d
    return f / 2 if causal else f


def attnc_time(attnc, path, b, h, s, d, iters, warmup):
    cmd = [str(attnc), "bench", str(path), "--target", "cuda", "--json",
           "--iters", str(iters), "--warmup", str(warmup),
           "--dim", f"B={b}", "--dim", f"H={h}", "--dim", f"S={s}", "--dim", f"D={d}"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    for line in out.stdout.splitlines():
        if line.startswith("json: "):
            return json.loads(line[len("json: "):])["median_ms"]
    raise RuntimeError(f"no json line in: {out.stdout}")


def torch_time(fn, iters, warmup):
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sdpa_fn(q, k, v, causal):
    import torch
    import torch.nn.functional as F
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    except ImportError:
        sdpa_kernel, backends = None, None

    def run():
        if sdpa_kernel is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def flex_fn(q, k, v, causal):
    import torch
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    compiled = torch.compile(flex_attention)
    block_mask = None
    if causal:
        b, h, s, _ = q.shape
        block_mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, s, s, device=q.device)
    return lambda: compiled(q, k, v, block_mask=block_mask)


def check_output(attnc, path, q, k, v, causal, tmp):
    """Runs attnc on the same tensors (f16 via .npy) and compares with SDPA."""
    import numpy as np
    import torch
    names = {}
    for name, t in (("q", q), ("k", k), ("v", v)):
        p = Path(tmp) / f"{name}.npy"
        np.save(p, t.float().cpu().numpy().astype(np.float16))
        names[name] = p
    out = Path(tmp) / "out.npy"
    cmd = [str(attnc), "run", str(path), "--target", "cuda", "--output", f"out={out}"]
    for name, p in names.items():
        cmd += ["--input", f"{name}={p}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"attnc run failed: {res.stderr.strip()}")
    got = torch.from_numpy(np.load(out).astype(np.float32))
    want = sdpa_fn(q, k, v, causal)().float().cpu()
    return (got - want).abs().max().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attnc", default=str(ROOT / "target" / "release" / "attnc"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--check", action="store_true", help="compare attnc's f16 output with SDPA")
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args()

    import torch
    if not torch.cuda.is_available():
        sys.exit("error: PyTorch sees no CUDA device")
    if not Path(args.attnc).exists():
        sys.exit(f"error: {args.attnc} not found (cargo build --release -p attn-runtime)")
    device = torch.cuda.get_device_name(0)
    dtypes = ["f16"] if args.quick else ["f16", "bf16"]
    dims = [128] if args.quick else [64, 128]
    seqs = [1024, 4096] if args.quick else [1024, 4096, 16384]
    b, h = 4, 16
    torch_dtype = {"f16": torch.float16, "bf16": torch.bfloat16}

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for t in dtypes:
            for causal in (False, True):
                path = Path(tmp) / f"attn_{t}_{'causal' if causal else 'full'}.attn"
                path.write_text(PROGRAM.format(t=t, body=CAUSAL if causal else PLAIN))
                for d in dims:
                    for s in seqs:
                        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch_dtype[t]) for _ in range(3))
                        f = flops(b, h, s, d, causal)
                        a_ms = attnc_time(args.attnc, path, b, h, s, d, args.iters, args.warmup)
                        s_ms = torch_time(sdpa_fn(q, k, v, causal), args.iters, args.warmup)
                        flex = flex_fn(q, k, v, causal)
                        x_ms = torch_time(flex, args.iters, args.warmup) if flex is not None else None
                        err = None
                        if args.check and t == "f16" and s <= 4096:
                            err = check_output(args.attnc, path, q, k, v, causal, tmp)
                        rows.append((t, d, s, causal, f / a_ms / 1e9, f / s_ms / 1e9,
                                     None if x_ms is None else f / x_ms / 1e9, err))
                        r = rows[-1]
                        print(f"# {t} D={d} S={s} {'causal' if causal else 'full'}: attnc {r[4]:.1f}, "
                              f"sdpa {r[5]:.1f}, flex {'-' if r[6] is None else f'{r[6]:.1f}'} TFLOP/s", file=sys.stderr)
                        del q, k, v
                        torch.cuda.empty_cache()

    lines = [f"GPU: {device}; B={b}, H={h}; TFLOP/s (useful FLOPs; causal counts half); median of {args.iters} runs.", "",
             "| dtype | D | S | mask | attnc | SDPA (flash/cuDNN) | FlexAttention | attnc/SDPA | attnc/Flex |" + (" max abs err |" if args.check else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if args.check else "")]
    for t, d, s, causal, a, sd, fx, err in rows:
        fx_text = "-" if fx is None else f"{fx:.1f}"
        ratio_fx = "-" if fx is None else f"{a / fx:.2f}"
        line = f"| {t} | {d} | {s} | {'causal' if causal else 'none'} | {a:.1f} | {sd:.1f} | {fx_text} | {a / sd:.2f} | {ratio_fx} |"
        if args.check:
            line += f" {'-' if err is None else f'{err:.2e}'} |"
        lines.append(line)
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
