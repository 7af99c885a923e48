#!/usr/bin/env python3
"""attnc's CPU target against PyTorch and ONNX Runtime on the same shapes and data, interleaved.

For every case it times, one after the other and for several rounds:

  - attnc: `attnc bench FILE --json` (median of --iters runs inside one process; the program is
    compiled once, inputs are seeded random N(0, 1) data that `--save-inputs` writes to .npy);
  - PyTorch `torch.nn.functional.scaled_dot_product_attention` on those same arrays: plain,
    `is_causal=True`, and causal ALiBi as a float `attn_mask` (slopes[h]·(j - i), -inf above
    the diagonal);
  - ONNX Runtime's opset-23 `Attention` op (plain and `is_causal=1`; ALiBi through its float
    `attn_mask` input).

Each number is the median over rounds of per-round medians; the table shows milliseconds,
useful GFLOP/s (4·B·H·M·N·D, half of that for causal masks) or GB/s for decode (K and V
bytes), and attnc's speed-up over each peer (peer time / attnc time: > 1 means attnc is
faster).

    python3 bench/compare.py              # the issue's table: B=1 H=8 D in {64,128} S in {1024,4096}, 1 and 2 threads, decode
    python3 bench/compare.py --quick      # D=128 S=1024 and decode only, fewer rounds
    python3 bench/compare.py --all        # also S=16384 and a sliding window (long)
    python3 bench/compare.py --out FILE   # also write the markdown table to FILE

The script makes its own virtual environment (bench/.venv, gitignored) with torch, onnx,
onnxruntime and numpy from PyPI on first use, and builds attnc in release mode if needed.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / "bench" / ".venv"
PACKAGES = ["numpy", "torch", "onnx", "onnxruntime"]


def ensure_venv():
    """Re-runs this script inside bench/.venv, creating it and installing the peers first."""
    if Path(sys.prefix).resolve() == VENV.resolve():
        return
    python = VENV / "bin" / "python"
    if not python.exists():
        print(f"creating {VENV} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    probe = subprocess.run([str(python), "-c", "import numpy, torch, onnx, onnxruntime"], capture_output=True)
    if probe.returncode != 0:
        print(f"installing {', '.join(PACKAGES)} into {VENV} (once) ...", file=sys.stderr)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *PACKAGES], check=True)
    os.execv(str(python), [str(python), str(Path(__file__).resolve()), *sys.argv[1:]])


def attnc_binary():
    exe = ROOT / "target" / "release" / "attnc"
    subprocess.run(["cargo", "build", "--release", "-p", "attn-runtime", "--bin", "attnc"], cwd=ROOT, check=True)
    return exe


SLIDING = """\
const W = 128
fn sliding(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D]) -> f32[B, H, S, D] {
    let scores = q @ k.T / sqrt(D)
    let (b, h, i, j) = indices(scores)
    return softmax(where(j <= i && i - j <= W, scores, -inf), axis = -1) @ v
}
"""


class Case:
    """One shape and attention kind."""

    def __init__(self, kind, b, h, s, d, threads, kv=None):
        self.kind, self.b, self.h, self.s, self.d, self.threads = kind, b, h, s, d, threads
        self.kv = kv if kv is not None else s

    def label(self):
        if self.kind == "decode":
            return f"decode H={self.h} D={self.d} KV={self.kv}, {self.threads}T"
        return f"{self.kind} H={self.h} D={self.d} S={self.s}, {self.threads}T"

    def program(self, tmp):
        files = {"plain": "sdpa.attn", "causal": "causal.attn", "alibi": "alibi.attn", "decode": "decode.attn"}
        if self.kind == "sliding":
            path = Path(tmp) / "sliding.attn"
            path.write_text(SLIDING)
            return path
        return ROOT / "examples" / files[self.kind]

    def dims(self):
        if self.kind == "decode":
            return {"B": self.b, "H": self.h, "T": self.kv, "D": self.d}
        return {"B": self.b, "H": self.h, "S": self.s, "D": self.d}

    def flops(self):
        full = 4.0 * self.b * self.h * (1 if self.kind == "decode" else self.s) * self.kv * self.d
        if self.kind in ("causal", "alibi"):
            return full / 2
        if self.kind == "sliding":
            return 4.0 * self.b * self.h * self.s * min(self.s, 129) * self.d
        return full

    def bytes(self):
        return 2.0 * self.b * self.h * self.kv * self.d * 4


def run_attnc(exe, case, path, iters, save=None):
    cmd = [str(exe), "bench", str(path), "--json", "--threads", str(case.threads), "--iters", str(iters), "--warmup", "1"]
    for k, v in case.dims().items():
        cmd += ["--dim", f"{k}={v}"]
    # The peak is not used here; giving one skips measuring it.
    cmd += ["--peak", "1"]
    if save:
        cmd += ["--save-inputs", str(save)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
    for line in out.stdout.splitlines():
        if line.startswith("json: "):
            return json.loads(line[len("json: "):])
    raise RuntimeError(f"no json line from attnc: {out.stdout}")


def median_time(fn, iters):
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


class Peers:
    """PyTorch and ONNX Runtime callables for one case, on the arrays attnc used."""

    def __init__(self, case, inputs_dir):
        import numpy as np
        import torch

        self.case = case
        torch.set_num_threads(case.threads)
        load = lambda name: np.load(Path(inputs_dir) / f"{name}.npy")
        self.q, self.k, self.v = (load(n) for n in ("q", "k", "v"))
        self.mask = None
        s, n = self.q.shape[2], self.k.shape[2]
        i = np.arange(s)[:, None]
        j = np.arange(n)[None, :]
        if case.kind == "alibi":
            slopes = load("slopes").astype(np.float32)
            bias = slopes[:, None, None] * (j - i)[None, :, :].astype(np.float32)
            self.mask = np.where((j <= i)[None], bias, -np.inf).astype(np.float32)[None]
        elif case.kind == "sliding":
            keep = (j <= i) & (i - j <= 128)
            self.mask = np.where(keep, 0.0, -np.inf).astype(np.float32)[None, None]
        self.tq, self.tk, self.tv = (torch.from_numpy(x) for x in (self.q, self.k, self.v))
        self.tmask = torch.from_numpy(self.mask) if self.mask is not None else None
        self.ort = self._ort_session()

    def torch_call(self):
        import torch
        import torch.nn.functional as F

        causal = self.case.kind == "causal"
        with torch.inference_mode():
            return F.scaled_dot_product_attention(self.tq, self.tk, self.tv, attn_mask=self.tmask, is_causal=causal)

    def _ort_session(self):
        import onnxruntime as ort
        from onnx import TensorProto, helper

        names = ["Q", "K", "V"] + (["attn_mask"] if self.mask is not None else [])
        arrays = [self.q, self.k, self.v] + ([self.mask] if self.mask is not None else [])
        inputs = [helper.make_tensor_value_info(nm, TensorProto.FLOAT, list(a.shape)) for nm, a in zip(names, arrays)]
        output = helper.make_tensor_value_info("Y", TensorProto.FLOAT, list(self.q.shape))
        node = helper.make_node("Attention", names, ["Y"], is_causal=int(self.case.kind == "causal"), scale=float(self.q.shape[-1]) ** -0.5)
        graph = helper.make_graph([node], "attention", inputs, [output])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
        # The newest IR version this onnx writes can be newer than the runtime reads; opset 23
        # needs IR version 11.
        model.ir_version = 11
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.case.threads
        opts.inter_op_num_threads = 1
        try:
            sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # an ORT without opset 23 Attention: report, keep going
            print(f"  onnxruntime: {e}".splitlines()[0], file=sys.stderr)
            return None
        self.feeds = dict(zip(names, arrays))
        return sess

    def ort_call(self):
        return self.ort.run(None, self.feeds)


def fmt(x, digits=1):
    return "—" if x is None else f"{x:.{digits}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="D=128 S=1024 and decode only, 2 rounds")
    ap.add_argument("--all", action="store_true", help="also S=16384 and a sliding window")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case")
    ap.add_argument("--iters", type=int, default=5, help="timed runs per round")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--out", type=Path, help="also write the markdown table here")
    args = ap.parse_args()
    ensure_venv()
    import torch

    exe = attnc_binary()
    threads = [int(t) for t in args.threads.split(",")]
    cases = []
    shapes = [(128, 1024)] if args.quick else [(64, 1024), (128, 1024), (64, 4096), (128, 4096)]
    if args.all:
        shapes.append((128, 16384))
    for t in threads:
        for d, s in shapes:
            for kind in ("plain", "causal", "alibi"):
                cases.append(Case(kind, 1, 8, s, d, t))
        if args.all:
            cases.append(Case("sliding", 1, 8, 16384, 128, t))
        cases.append(Case("decode", 1, 32, 1, 128, t, kv=32768))
    rounds = 2 if args.quick else args.rounds
    import onnxruntime

    header = (
        f"attnc vs PyTorch {torch.__version__} SDPA and ONNX Runtime {onnxruntime.__version__} Attention "
        f"(fp32, CPU, medians of {rounds} interleaved rounds of {args.iters} runs)"
    )
    print(header)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            inputs = Path(tmp) / "inputs"
            path = case.program(tmp)
            run_attnc(exe, case, path, 1, save=inputs)
            peers = Peers(case, inputs)
            times = {"attnc": [], "torch": [], "ort": []}
            for _ in range(rounds):
                times["attnc"].append(run_attnc(exe, case, path, args.iters)["median_ms"])
                times["torch"].append(median_time(peers.torch_call, args.iters))
                if peers.ort is not None:
                    times["ort"].append(median_time(peers.ort_call, args.iters))
            med = {k: statistics.median(v) if v else None for k, v in times.items()}
            rate = (lambda ms: case.bytes() / ms / 1e6) if case.kind == "decode" else (lambda ms: case.flops() / ms / 1e6)
            row = [
                case.label(),
                fmt(med["attnc"], 2),
                fmt(rate(med["attnc"])),
                fmt(med["torch"], 2),
                fmt(rate(med["torch"])),
                fmt(med["ort"], 2),
                fmt(rate(med["ort"]) if med["ort"] else None),
                fmt(med["torch"] / med["attnc"], 2),
                fmt(med["ort"] / med["attnc"] if med["ort"] else None, 2),
            ]
            rows.append(row)
            print(" | ".join(row), flush=True)
            del peers
    cols = ["case", "attnc ms", "attnc rate", "torch ms", "torch rate", "ort ms", "ort rate", "torch/attnc", "ort/attnc"]
    table = [header, "", "rate: GFLOP/s (useful FLOPs), GB/s of K and V for decode", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(table)
    print()
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
