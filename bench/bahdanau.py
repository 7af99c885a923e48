#!/usr/bin/env python3
"""examples/bahdanau.attn (additive attention) on attnc's CPU target against PyTorch eager.

attnc fuses `softmax(vᵀ tanh(W q_i + U k_j)) @ k` into one flash op whose scores are formed
tile by tile from the two projections; PyTorch eager does what the formula says: it broadcasts
the projections to a [B, M, N, A] tensor, applies tanh, multiplies by v and sums (the usual
PyTorch implementation of Bahdanau attention).

Two kinds of inputs, both the same for the two frameworks (`--input` files):
- `trained`: q, k ~ N(0, 1), W, U ~ N(0, 1/fan-in), v ~ N(0, 1/A), so the projections are
  O(1) as in a trained layer (attnc's score kernel takes its narrow form);
- `wide`: W, U ~ N(0, 1) as `attnc bench` draws them, so the projections reach |x| ~ 40
  (attnc's wide form). PyTorch's time does not depend on the values.

Before timing, both run once on the trained inputs, which must agree to
max|diff| / max|ref| < 1e-4. Then --rounds interleaved rounds of --iters runs each; the table
shows the medians, PyTorch time / attnc time (> 1: attnc is faster), and the memory each holds
beyond inputs and outputs (attnc: its report; PyTorch: the rise of the peak resident set size
during one call, in a fresh process, less the output).

    python3 bench/bahdanau.py                          # B=1, S=N=2048, A=Dq=Dk=128, 1 thread
    python3 bench/bahdanau.py --sizes 512,1024 --rounds 1
    python3 bench/bahdanau.py --target cuda --attnc gpu_bin/attnc --sizes 1024,2048

Uses bench/.venv (made by bench/compare.py) and target/release/attnc (built unless --no-build or
--attnc). With --target cuda both run on the GPU: attnc's kernel time against PyTorch's, timed
with CUDA events, in the python3 found on the path (which must have torch with CUDA); the memory
column is then PyTorch's peak allocation beyond inputs and output.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from example_bench import ROOT, attnc_json, ensure_venv

EXAMPLE = ROOT / "examples" / "bahdanau.attn"
NAMES = ["q", "k", "w_q", "w_k", "v_a"]


def bahdanau_torch(t, q, k, w_q, w_k, v_a):
    """PyTorch eager additive attention; shapes as in examples/bahdanau.attn."""
    qa = (q @ w_q).unsqueeze(2)  # [B, M, 1, A]
    ka = (k @ w_k).unsqueeze(1)  # [B, 1, N, A]
    scores = (t.tanh(qa + ka) * v_a).sum(-1)  # [B, M, N]
    return t.softmax(scores, dim=-1) @ k


def peak_rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def torch_memory(inputs, threads):
    """Run in a fresh process: the rise of VmHWM during one call, less the output."""
    import numpy as np
    import torch

    torch.set_num_threads(threads)
    arrays = [torch.from_numpy(np.load(Path(inputs) / f"{n}.npy")) for n in NAMES]
    with torch.no_grad():
        bahdanau_torch(torch, *[a[..., :4, :] if a.dim() == 3 else a for a in arrays])
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = peak_rss()
        out = bahdanau_torch(torch, *arrays)
        extra = peak_rss() - before - out.numel() * 4
    print(json.dumps({"extra_bytes": max(extra, 0)}))


def torch_time(torch, arrays, iters, gpu):
    """Median ms of `iters` PyTorch calls (after one warm-up); CUDA events on the GPU."""
    samples = []
    with torch.no_grad():
        bahdanau_torch(torch, *arrays)
        for _ in range(iters):
            if gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                bahdanau_torch(torch, *arrays)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                bahdanau_torch(torch, *arrays)
                samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def torch_gpu_memory(torch, arrays):
    """PyTorch's peak GPU allocation during one call beyond its inputs and output, in bytes."""
    with torch.no_grad():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = bahdanau_torch(torch, *arrays)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before - out.numel() * out.element_size()


def write_inputs(directory, d, kind, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    b, m, n, a, dq, dk = d["B"], d["M"], d["N"], d["A"], d["Dq"], d["Dk"]
    trained = kind == "trained"
    shapes = {
        "q": ((b, m, dq), 1.0),
        "k": ((b, n, dk), 1.0),
        "w_q": ((dq, a), dq**-0.5 if trained else 1.0),
        "w_k": ((dk, a), dk**-0.5 if trained else 1.0),
        "v_a": ((a,), a**-0.5 if trained else 1.0),
    }
    arrays = []
    for name, (shape, scale) in shapes.items():
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        np.save(Path(directory) / f"{name}.npy", x)
        arrays.append(x)
    return arrays


def attnc_args(d, inputs):
    args = [a for k, v in d.items() for a in ("--dim", f"{k}={v}")]
    return args + [a for n in NAMES for a in ("--input", f"{n}={Path(inputs) / (n + '.npy')}")]


def attnc_bench(exe, d, inputs, threads, iters, target):
    cmd = [exe, "bench", EXAMPLE, "--json", "--iters", iters, "--warmup", 1, "--threads", threads, "--target", target]
    return attnc_json(cmd + attnc_args(d, inputs))


def attnc_output(exe, d, inputs, out_dir, target):
    cmd = [str(exe), "run", str(EXAMPLE), "--out-dir", str(out_dir), "--threads", "1", "--target", target]
    cmd += attnc_args(d, inputs)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
    import numpy as np

    return np.load(next(Path(out_dir).glob("*.npy")))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2048", help="S = M = N, comma-separated")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--width", type=int, default=128, help="attention width A (and Dq = Dk)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--target", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--attnc", help="the attnc binary (default: target/release/attnc, built)")
    ap.add_argument("--torch-memory", nargs=2, metavar=("INPUTS", "THREADS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    gpu = args.target == "cuda"
    if not gpu:
        ensure_venv(__file__)
    if args.torch_memory:
        return torch_memory(args.torch_memory[0], int(args.torch_memory[1]))
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    exe = Path(args.attnc) if args.attnc else ROOT / "target" / "release" / "attnc"
    if not (args.no_build or args.attnc):
        subprocess.run(["cargo", "build", "--release", "-p", "attn-runtime", "--bin", "attnc"], cwd=ROOT, check=True)
    where = f"on {torch.cuda.get_device_name(0)}" if gpu else f"{args.threads} thread(s)"
    print(f"Bahdanau additive attention, attnc vs PyTorch {torch.__version__} eager, {where}, "
          f"B={args.batch} A=Dq=Dk={args.width}")
    rows = []
    for s in [int(v) for v in args.sizes.split(",")]:
        w = args.width
        d = {"B": args.batch, "M": s, "N": s, "A": w, "Dq": w, "Dk": w}
        with tempfile.TemporaryDirectory() as tmp:
            dirs = {kind: Path(tmp) / kind for kind in ("trained", "wide")}
            arrays = {}
            for kind, path in dirs.items():
                path.mkdir()
                arrays[kind] = [torch.from_numpy(a).to(args.target) for a in write_inputs(path, d, kind)]
            outs = Path(tmp) / "out"
            outs.mkdir()
            with torch.no_grad():
                ref = bahdanau_torch(torch, *arrays["trained"]).cpu().numpy()
            got = attnc_output(exe, d, dirs["trained"], outs, args.target)
            err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
            if not err < 1e-4:
                sys.exit(f"S={s}: attnc and PyTorch disagree: max|diff|/max|ref| = {err:.2e}")
            times = {"torch": [], "trained": [], "wide": []}
            report = {}
            for _ in range(args.rounds):
                for kind in ("trained", "wide"):
                    r = attnc_bench(exe, d, dirs[kind], args.threads, args.iters, args.target)
                    report[kind] = r
                    times[kind].append(r["median_ms"])
                times["torch"].append(torch_time(torch, arrays["trained"], args.iters, gpu))
            if gpu:
                torch_extra = torch_gpu_memory(torch, arrays["trained"])
            else:
                mem = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--torch-memory", str(dirs["trained"]),
                                      str(args.threads)], capture_output=True, text=True)
                torch_extra = json.loads(mem.stdout.strip().splitlines()[-1])["extra_bytes"] if mem.returncode == 0 else float("nan")
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append((s, med, report, torch_extra, err))
    r0 = rows[0][2]["trained"]
    if not gpu:
        print(f"machine: {r0['cpu']}, attnc kernels on the {r0['isa']} path")
    print(f"{'S':>6} {'torch ms':>10} {'attnc ms':>10} {'ratio':>7} {'attnc wide ms':>14} {'ratio':>7} "
          f"{'torch extra MiB':>16} {'attnc extra MiB':>16} {'max err':>9}")
    digits = 3 if gpu else 1  # milliseconds: GPU times are around one
    for s, med, report, torch_extra, err in rows:
        # attnc's memory report is the CPU executor's; on the GPU it has none.
        attnc_extra = "-" if gpu else f"{report['trained']['extra_bytes'] / 2**20:.2f}"
        print(f"{s:>6} {med['torch']:>10.{digits}f} {med['trained']:>10.{digits}f} {med['torch'] / med['trained']:>7.2f} "
              f"{med['wide']:>14.{digits}f} {med['torch'] / med['wide']:>7.2f} {torch_extra / 2**20:>16.1f} "
              f"{attnc_extra:>16} {err:>9.1e}")


if __name__ == "__main__":
    main()
