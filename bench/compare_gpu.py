#!/usr/bin/env python3
"""attnc's CUDA target against PyTorch on the same GPU, in one interleaved run.

For every case (B=4, H=16, D in {64, 128}, S in {1024, 4096, 16384}, f16 and bf16; masks:
none, causal, ALiBi (causal, per-head slopes) and soft-capping (causal, cap 50)) it times, one
after the other:

  - attnc: `attnc bench FILE --target cuda --json` on a generated .attn program (kernel time
    measured with CUDA events, median of --iters runs);
  - PyTorch `scaled_dot_product_attention` restricted to its flash / cuDNN backends (none and
    causal only: SDPA has no flash path for a bias or a score modification);
  - FlexAttention (`torch.nn.attention.flex_attention`, compiled) with the same mask and score
    modification, when this PyTorch has it.

TFLOP/s count useful FLOPs: 4*B*H*S*S*D, half of that for the causal masks (FlashAttention's
convention). Ratios are attnc's rate over the peer's (peer time / attnc time: > 1 means attnc
is faster). The table (markdown) goes to stdout, and with --out to a file for
docs/performance.md.

    python3 bench/compare_gpu.py                      # every case
    python3 bench/compare_gpu.py --quick              # S=1024 and 4096, D=128, f16 only
    python3 bench/compare_gpu.py --cases alibi,softcap --dtypes bf16
    python3 bench/compare_gpu.py --check              # also compare attnc's output with PyTorch
    python3 bench/compare_gpu.py --train --cases none,causal --seqs 1024,4096
                                                      # training steps: attnc --grad vs SDPA

Needs: an NVIDIA GPU (sm_80+), PyTorch with CUDA, a release build of attnc
(`cargo build --release -p attnc`), NVRTC (see docs/cuda.md).
"""

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("none", "causal", "alibi", "softcap")
CAP = 50.0  # examples/softcap.attn's cap

PROGRAM = """\
fn attention(q: {t}[B, H, S, D], k: {t}[B, H, S, D], v: {t}[B, H, S, D]{extra}) -> {t}[B, H, S, D] {{
    let scores = q @ k.T / sqrt(D)
{body}
}}
"""
BODIES = {
    "none": ("", "    return softmax(scores, axis = -1) @ v"),
    "causal": ("", """    let (b, h, i, j) = indices(scores)
    return softmax(where(j <= i, scores, -inf), axis = -1) @ v"""),
    "alibi": (", slopes: {t}[H]", """    let (b, h, i, j) = indices(scores)
    let biased = scores + slopes[h] * (j - i)
    return softmax(where(j <= i, biased, -inf), axis = -1) @ v"""),
    "softcap": ("", f"""    let capped = {CAP} * tanh(scores / {CAP})
    let (b, h, i, j) = indices(scores)
    return softmax(where(j <= i, capped, -inf), axis = -1) @ v"""),
}


def flops(b, h, s, d, kind):
    f = 4.0 * b * h * s * s * d
    return f if kind == "none" else f / 2


def slopes(h):
    return [2.0 ** (-8.0 * (i + 1) / h) for i in range(h)]


def attnc_time(attnc, path, b, h, s, d, iters, warmup, extra=()):
    cmd = [str(attnc), "bench", str(path), "--target", "cuda", "--json",
           "--iters", str(iters), "--warmup", str(warmup),
           "--dim", f"B={b}", "--dim", f"H={h}", "--dim", f"S={s}", "--dim", f"D={d}", *extra]
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


def sdpa_fn(q, k, v, kind):
    import torch.nn.functional as F
    if kind not in ("none", "causal"):
        return None
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    except ImportError:
        sdpa_kernel, backends = None, None

    def run():
        if sdpa_kernel is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=kind == "causal")
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, is_causal=kind == "causal")
    return run


def reference(q, k, v, kind, sl):
    """The case in float32 PyTorch eager code (the accuracy reference for --check)."""
    import torch
    qf, kf, vf = q.float(), k.float(), v.float()
    s = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[2]
    i = torch.arange(n, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None, :]
    if kind == "alibi":
        s = s + sl.view(1, -1, 1, 1) * (j - i).float()
    if kind == "softcap":
        s = CAP * torch.tanh(s / CAP)
    if kind != "none":
        s = s.masked_fill(j > i, float("-inf"))
    return torch.softmax(s, dim=-1) @ vf


_FLEX = {}


def flex_fn(q, k, v, kind, sl):
    import torch
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    if "compiled" not in _FLEX:
        # One compile per shape, dtype and score modification: more than dynamo's default
        # limit of 8, past which it would silently run flex_attention eagerly (materialising
        # the S x S scores).
        import torch._dynamo
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 1024)
        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
    compiled = _FLEX["compiled"]
    block_mask = None
    if kind != "none":
        _, _, s, _ = q.shape
        block_mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, s, s, device=q.device)
    score_mod = None
    if kind == "alibi":
        def score_mod(score, b, h, i, j):
            return score + sl[h] * (j - i)
    elif kind == "softcap":
        def score_mod(score, b, h, i, j):
            return CAP * torch.tanh(score / CAP)
    return lambda: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)


def attnc_output(attnc, path, tensors, tmp):
    """Runs attnc on the same tensors (one .safetensors file, which keeps f16 and bf16) and
    returns its output as float32."""
    import numpy as np
    import torch
    from safetensors.torch import save_file
    inputs = Path(tmp) / "inputs.safetensors"
    save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, str(inputs))
    out = Path(tmp) / "out.npy"
    cmd = [str(attnc), "run", str(path), "--target", "cuda", "--input", str(inputs), "--output", f"out={out}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"attnc run failed: {res.stderr.strip()}")
    return torch.from_numpy(np.load(out).astype(np.float32))


def rel_err(got, want):
    return ((got - want).norm() / want.norm()).item()


def program_text(t, kind):
    """The .attn program of a case: dtype `t`, mask `kind`."""
    extra, body = BODIES[kind]
    return PROGRAM.format(t=t, extra=extra.format(t=t), body=body)


def write_program(tmp, t, kind):
    """The case's .attn program in `tmp`; returns its path."""
    path = Path(tmp) / f"attn_{t}_{kind}.attn"
    path.write_text(program_text(t, kind))
    return path


def case_tensors(b, h, s, d, dtype, count):
    """`count` seeded random [b, h, s, d] tensors on the GPU (the same for every run of a case)."""
    import torch
    gen = torch.Generator(device="cuda").manual_seed(s * 1000 + d)
    return [torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=gen) for _ in range(count)]


def sdpa_train_fn(q, k, v, dout, kind):
    """One training step of SDPA (flash / cuDNN backends): forward, then backward with the
    cotangent `dout` into fresh gradients of q, k and v."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(*leaves, is_causal=kind == "causal")
        out.backward(dout)
    return step


def training(args, dtypes, dims, seqs, kinds):
    """The training table (--train): attnc `bench --grad` (forward plus the fused backward,
    gradients of every input) against one SDPA training step, interleaved per case. Times in
    ms; the ratio is SDPA time / attnc time."""
    import torch
    b, h = 4, 16
    torch_dtype = {"f16": torch.float16, "bf16": torch.bfloat16}
    rows = []
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for t in dtypes:
            for kind in kinds:
                if kind not in ("none", "causal"):
                    print(f"# {kind}: skipped (SDPA has no fused path for it)", file=sys.stderr)
                    continue
                path = write_program(tmp, t, kind)
                for d in dims:
                    for s in seqs:
                        q, k, v, dout = case_tensors(b, h, s, d, torch_dtype[t], 4)
                        try:
                            a_ms = attnc_time(args.attnc, path, b, h, s, d, args.iters, args.warmup, extra=["--grad"])
                        except RuntimeError as e:
                            print(f"# {t} D={d} S={s} {kind}: attnc failed: {e}", file=sys.stderr)
                            a_ms = None
                        s_ms = torch_time(sdpa_train_fn(q, k, v, dout, kind), args.iters, args.warmup)
                        rows.append((t, d, s, kind, a_ms, s_ms))
                        fmt = lambda x: "-" if x is None else f"{x:.3f}"
                        print(f"# train {t} D={d} S={s} {kind}: attnc {fmt(a_ms)} ms, sdpa {fmt(s_ms)} ms"
                              f" [{time.time() - started:.0f} s]", file=sys.stderr, flush=True)
                        del q, k, v, dout
                        torch.cuda.empty_cache()
    fmt = lambda x: "-" if x is None else f"{x:.3f}"
    # Three significant digits: far from parity, two decimals would print 0.00.
    ratio = lambda a, p: "-" if a is None or p is None else f"{p / a:.3g}"
    lines = [f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; B={b}, H={h}; one training step "
             f"(forward plus backward, gradients of q, k, v); median ms of {args.iters} runs after {args.warmup} warm-ups.",
             "", "| dtype | D | S | mask | attnc ms | SDPA ms | SDPA/attnc |", "|---|---|---|---|---|---|---|"]
    for t, d, s, kind, a, sd in rows:
        lines.append(f"| {t} | {d} | {s} | {kind} | {fmt(a)} | {fmt(sd)} | {ratio(a, sd)} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attnc", default=str(ROOT / "target" / "release" / "attnc"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="S=1024 and 4096, D=128, f16 only")
    ap.add_argument("--cases", help=f"comma-separated subset of {','.join(KINDS)}")
    ap.add_argument("--dtypes", help="comma-separated subset of f16,bf16")
    ap.add_argument("--dims", help="comma-separated head widths (default 64,128)")
    ap.add_argument("--seqs", help="comma-separated sequence lengths (default 1024,4096,16384)")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compiles take a while)")
    ap.add_argument("--check", action="store_true",
                    help="also compare attnc's and SDPA's outputs with a float32 reference (S <= 4096)")
    ap.add_argument("--train", action="store_true",
                    help="the training table instead: attnc --grad against one SDPA training step (none and causal)")
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args()

    import torch
    if not torch.cuda.is_available():
        sys.exit("error: PyTorch sees no CUDA device")
    if not Path(args.attnc).exists():
        sys.exit(f"error: {args.attnc} not found (cargo build --release -p attnc)")
    device = torch.cuda.get_device_name(0)
    split = lambda text, default, conv=str: [conv(x) for x in text.split(",")] if text else default
    kinds = split(args.cases, list(KINDS))
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        sys.exit(f"error: unknown case {bad[0]!r} (expected one of {', '.join(KINDS)})")
    dtypes = split(args.dtypes, ["f16"] if args.quick else ["f16", "bf16"])
    dims = split(args.dims, [128] if args.quick else [64, 128], int)
    seqs = split(args.seqs, [1024, 4096] if args.quick else [1024, 4096, 16384], int)
    if args.train:
        table = training(args, dtypes, dims, seqs, kinds)
        print(table)
        if args.out:
            Path(args.out).write_text(table + "\n")
        return
    b, h = 4, 16
    torch_dtype = {"f16": torch.float16, "bf16": torch.bfloat16}
    sl = torch.tensor(slopes(h), device="cuda", dtype=torch.float32)

    rows = []
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for t in dtypes:
            # The slopes in the case's dtype, as the program declares them (also for the peers).
            slt = sl.to(torch_dtype[t])
            for kind in kinds:
                path = write_program(tmp, t, kind)
                for d in dims:
                    for s in seqs:
                        q, k, v = case_tensors(b, h, s, d, torch_dtype[t], 3)
                        f = flops(b, h, s, d, kind)
                        try:
                            a_ms = attnc_time(args.attnc, path, b, h, s, d, args.iters, args.warmup)
                        except RuntimeError as e:
                            print(f"# {t} D={d} S={s} {kind}: attnc failed: {e}", file=sys.stderr)
                            a_ms = None
                        sdpa = sdpa_fn(q, k, v, kind)
                        s_ms = torch_time(sdpa, args.iters, args.warmup) if sdpa is not None else None
                        flex = None if args.no_flex else flex_fn(q, k, v, kind, slt)
                        x_ms = torch_time(flex, args.iters, args.warmup) if flex is not None else None
                        err = None
                        if args.check and s <= 4096 and a_ms is not None:
                            tensors = {"q": q, "k": k, "v": v}
                            if kind == "alibi":
                                tensors["slopes"] = slt
                            want = reference(q, k, v, kind, slt.float()).cpu()
                            err = (rel_err(attnc_output(args.attnc, path, tensors, tmp), want),
                                   rel_err(sdpa().float().cpu(), want) if sdpa is not None else
                                   rel_err(flex().float().cpu(), want) if flex is not None else None)
                        rate = lambda ms: None if ms is None else f / ms / 1e9
                        rows.append((t, d, s, kind, rate(a_ms), rate(s_ms), rate(x_ms), err))
                        r = rows[-1]
                        fmt = lambda x: "-" if x is None else f"{x:.1f}"
                        print(f"# {t} D={d} S={s} {kind}: attnc {fmt(r[4])}, sdpa {fmt(r[5])}, flex {fmt(r[6])} TFLOP/s"
                              + (f", rel err attnc {err[0]:.1e}" if err else "")
                              + f" [{time.time() - started:.0f} s]", file=sys.stderr, flush=True)
                        del q, k, v
                        torch.cuda.empty_cache()

    fmt = lambda x: "-" if x is None else f"{x:.1f}"
    ratio = lambda a, p: "-" if a is None or p is None else f"{a / p:.2f}"
    head = "| dtype | D | S | mask | attnc | SDPA (flash/cuDNN) | FlexAttention | attnc/SDPA | attnc/Flex |"
    rule = "|---|---|---|---|---|---|---|---|---|"
    if args.check:
        head += " rel err attnc | rel err peer |"
        rule += "---|---|"
    lines = [f"GPU: {device}; torch {torch.__version__}; B={b}, H={h}; TFLOP/s (useful FLOPs; causal masks count half); "
             f"median of {args.iters} runs after {args.warmup} warm-ups.", "", head, rule]
    for t, d, s, kind, a, sd, fx, err in rows:
        line = f"| {t} | {d} | {s} | {kind} | {fmt(a)} | {fmt(sd)} | {fmt(fx)} | {ratio(a, sd)} | {ratio(a, fx)} |"
        if args.check:
            e = lambda x: "-" if x is None else f"{x:.1e}"
            line += f" {e(err[0]) if err else '-'} | {e(err[1]) if err else '-'} |"
        lines.append(line)
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
