#!/usr/bin/env python3
"""What calling attnc from Python costs over calling it from Rust.

1. A tiny program (sdpa, B=H=1, S=16, D=16): the time of ``prog(q, k, v)`` against the same
   run timed inside Rust (``Compiled._bench_native``: the same binding of the arrays, then
   ``Program::run_borrowed`` in a loop with no Python per run). The difference is the Python
   overhead: argument handling, GIL release and result arrays. Target: <= 20 us.
2. sdpa D=128 S=1024 (B=1, H=8, one thread): the Python call against ``attnc bench`` on the same
   sizes. Target: within 3%.

Every pair is measured interleaved, several rounds, and the medians are compared. Run from
the repository root after ``pip install ./python`` and ``cargo build --release --bin attnc``:

    python python/bench/overhead.py [--attnc target/release/attnc] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import attnc

ROOT = Path(__file__).resolve().parents[2]
SDPA = ROOT / "examples" / "sdpa.attn"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def tiny(rounds: int) -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 16, 16), dtype=np.float32) for _ in range(3))
    prog = attnc.compile(SDPA, threads=1)
    calls = 5000
    prog(q, k, v)
    py, native = [], []
    for _ in range(rounds):
        py.append(per_call(lambda: prog(q, k, v), calls))
        native.append(prog._compiled._bench_native((q, k, v), calls)[1])
    kw = [per_call(lambda: prog(q=q, k=k, v=v), calls) for _ in range(rounds)]
    p, n, w = statistics.median(py), statistics.median(native), statistics.median(kw)
    print("tiny sdpa B=H=1 S=16 D=16, one thread, median of", rounds, "rounds of", calls, "calls")
    print(f"  rust (run_borrowed in a loop)   {n * 1e6:8.2f} us/call")
    print(f"  python prog(q, k, v)            {p * 1e6:8.2f} us/call   overhead {(p - n) * 1e6:6.2f} us (target <= 20)")
    print(f"  python prog(q=q, k=k, v=v)      {w * 1e6:8.2f} us/call   overhead {(w - n) * 1e6:6.2f} us")


def large(attnc_bin: str, rounds: int) -> None:
    dims = {"B": 1, "H": 8, "S": 1024, "D": 128}
    prog = attnc.compile(SDPA, threads=1)
    inputs = prog.random_inputs(seed=0, dims=dims)
    args = (inputs["q"], inputs["k"], inputs["v"])
    for _ in range(2):
        prog(*args)
    cmd = [attnc_bin, "bench", str(SDPA), "--threads", "1", "--iters", "10", "--json"]
    for name, size in dims.items():
        cmd += ["--dim", f"{name}={size}"]
    py, cli = [], []
    for _ in range(rounds):
        times = []
        for _ in range(10):
            start = time.perf_counter()
            prog(*args)
            times.append(time.perf_counter() - start)
        py.append(statistics.median(times))
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        line = next(l for l in out.splitlines() if l.startswith("json: "))
        cli.append(json.loads(line[len("json: "):])["median_ms"] / 1e3)
    p, c = statistics.median(py), statistics.median(cli)
    print(f"sdpa B=1 H=8 S=1024 D=128, one thread, median of {rounds} interleaved rounds (10 runs each)")
    print(f"  attnc bench                     {c * 1e3:8.2f} ms")
    print(f"  python prog(q, k, v)            {p * 1e3:8.2f} ms   python / bench = {p / c:.3f} (target <= 1.03)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attnc", default=str(ROOT / "target" / "release" / "attnc"), help="the attnc binary")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per comparison")
    parser.add_argument("--skip-large", action="store_true", help="only the tiny-program overhead")
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; Python {platform.python_version()}; attnc {attnc.__version__}")
    tiny(args.rounds)
    if not args.skip_large:
        if not Path(args.attnc).is_file():
            print(f"{args.attnc} not found: cargo build --release --bin attnc (or --skip-large)", file=sys.stderr)
            return 2
        large(args.attnc, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
