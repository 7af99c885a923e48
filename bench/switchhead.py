#!/usr/bin/env python3
"""examples/switchhead.attn on attnc's CPU target against PyTorch eager with the same routing.

PyTorch computes what a
plain eager implementation of SwitchHead (Csordás et al.) does: each head's router
`sigmoid(x W_S)` and its top-2 experts, every expert's value projection for every token
(`x @ W_V[h]`, all X experts at once), the two chosen ones gathered and weighted; attention with
`scaled_dot_product_attention`; and the output projection the same way. Routing is the same
because the weights and the rule (top-2 of sigmoid gates, ties to the lower index) are.

Before timing, both run once at the benchmark's shape on the same inputs (`attnc run`), which
must agree to max|diff| / max|ref| < 1e-4. Those inputs are scaled as a trained layer's would
be (weights N(0, 1/fan-in)): with `attnc bench`'s N(0, 1) weights most gates saturate to exactly
1.0 in f32, and top-2 among ties is the lower index in attnc but unspecified in PyTorch. The
timings use `attnc bench`'s own inputs; neither framework's time depends on the values. Then --rounds interleaved rounds of --iters runs each; the table shows the medians and
PyTorch time / attnc time (> 1: attnc is faster), and the memory attnc reports holding.

    python3 bench/switchhead.py                      # B=1 E=256 Dh=64 X=8, S in 1024, 4096
    python3 bench/switchhead.py --sizes 512 --threads 2 --rounds 1

Uses bench/.venv (made by bench/compare.py) and target/release/attnc (built unless --no-build).
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from example_bench import ROOT, attnc_json, ensure_venv

EXAMPLE = ROOT / "examples" / "switchhead.attn"


def dims(args, s):
    return {"B": args.batch, "S": s, "E": args.width, "Dh": args.head, "X": args.experts}


def attnc(exe, d, threads, iters):
    cmd = [str(exe), "bench", str(EXAMPLE), "--json", "--iters", str(iters), "--warmup", "1", "--threads", str(threads)]
    cmd += [a for k, v in d.items() for a in ("--dim", f"{k}={v}")]
    return attnc_json(cmd)


def attnc_output(exe, d, inputs, out_dir):
    cmd = [str(exe), "run", str(EXAMPLE), "--out-dir", str(out_dir)]
    cmd += [a for k, v in d.items() for a in ("--dim", f"{k}={v}")]
    cmd += [a for p in sorted(Path(inputs).glob("*.npy")) for a in ("--input", f"{p.stem}={p}")]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
    import numpy as np

    return np.load(next(Path(out_dir).glob("*.npy")))


def switchhead_torch(t, x, w_q, w_k, w_v, w_o, w_sv, w_so):
    """PyTorch eager SwitchHead; shapes as in examples/switchhead.attn."""
    F = t.nn.functional
    xs = x.unsqueeze(1)  # [B, 1, S, E]
    q, k = xs @ w_q, xs @ w_k  # [B, H, S, Dh]
    gv, ev = t.topk(t.sigmoid(xs @ w_sv), 2, dim=-1)  # [B, H, S, 2]
    v_all = t.einsum("bse,hxed->bhsxd", x, w_v)  # every expert's values
    v = (t.gather(v_all, 3, ev[..., None].expand(*ev.shape, v_all.shape[-1])) * gv[..., None]).sum(3)
    a = F.scaled_dot_product_attention(q, k, v)  # [B, H, S, Dh]
    go, eo = t.topk(t.sigmoid(xs @ w_so), 2, dim=-1)
    o_all = t.einsum("bhsd,hxde->bhsxe", a, w_o)  # every expert's output projection
    o = (t.gather(o_all, 3, eo[..., None].expand(*eo.shape, o_all.shape[-1])) * go[..., None]).sum(3)
    return o.sum(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024,4096", help="sequence lengths, comma-separated")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--width", type=int, default=256, help="model width E")
    ap.add_argument("--head", type=int, default=64, help="head width Dh")
    ap.add_argument("--experts", type=int, default=8, help="experts per head X")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--no-build", action="store_true")
    args = ap.parse_args()
    ensure_venv(__file__)
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    exe = ROOT / "target" / "release" / "attnc"
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "-p", "attn-runtime", "--bin", "attnc"], cwd=ROOT, check=True)
    print(f"SwitchHead, attnc vs PyTorch {torch.__version__} eager, {args.threads} thread(s), "
          f"B={args.batch} E={args.width} Dh={args.head} X={args.experts}, H=2, top-2")
    rows = []
    for s in [int(v) for v in args.sizes.split(",")]:
        d = dims(args, s)
        with tempfile.TemporaryDirectory() as tmp:
            inputs, outs = Path(tmp) / "in", Path(tmp) / "out"
            inputs.mkdir()
            outs.mkdir()
            first = attnc(exe, d, args.threads, 1)
            rng = np.random.default_rng(0)
            e, dh, x = args.width, args.head, args.experts
            shapes = {
                "x": ((args.batch, s, e), 1.0),
                "w_q": ((2, e, dh), e**-0.5),
                "w_k": ((2, e, dh), e**-0.5),
                "w_v": ((2, x, e, dh), e**-0.5),
                "w_o": ((2, x, dh, e), dh**-0.5),
                "w_sv": ((2, e, x), e**-0.5),
                "w_so": ((2, e, x), e**-0.5),
            }
            arrays = []
            for name, (shape, scale) in shapes.items():
                a = (rng.standard_normal(shape) * scale).astype(np.float32)
                np.save(inputs / f"{name}.npy", a)
                arrays.append(torch.from_numpy(a))
            with torch.no_grad():
                ref = switchhead_torch(torch, *arrays).numpy()
            got = attnc_output(exe, d, inputs, outs)
            err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
            if not err < 1e-4:
                sys.exit(f"S={s}: attnc and PyTorch disagree: max|diff|/max|ref| = {err:.2e}")
            times = {"attnc": [], "torch": []}
            for _ in range(args.rounds):
                times["attnc"].append(attnc(exe, d, args.threads, args.iters)["median_ms"])
                runs = []
                with torch.no_grad():
                    for _ in range(args.iters):
                        t0 = time.perf_counter()
                        switchhead_torch(torch, *arrays)
                        runs.append((time.perf_counter() - t0) * 1e3)
                times["torch"].append(statistics.median(runs))
            a, t = statistics.median(times["attnc"]), statistics.median(times["torch"])
            row = f"S={s} | {a:.2f} | {t:.2f} | {t / a:.2f} | {first['extra_bytes'] / 2**20:.1f} | {err:.1e}"
            print(row, flush=True)
            rows.append(row)
    print("\n| case | attnc ms | torch ms | torch/attnc | attnc memory MiB | max|diff|/max|ref| |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r} |")


if __name__ == "__main__":
    main()
