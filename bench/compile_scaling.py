"""Compile time against program length: a chain of N lets, `attnc build --emit clif`.

Usage: python3 bench/compile_scaling.py [--optimizer] [--rounds N] [ATTNC_BINARY ...]
(default binary: target/release/attnc)

Writes the programs to a temporary folder, then times each length ROUNDS times, the lengths
(and binaries) interleaved, and prints the minimum and its ratio to the 1k-let time. Linear
compile time gives 10x from 1k to 10k lets.

With --optimizer it times the optimizer alone instead: `attnc --timings build --emit opt`, the
"optimize" time `--timings` prints (0.1 ms resolution).
"""

import argparse
import pathlib
import re
import subprocess
import tempfile
import time

LENGTHS = [1000, 2000, 5000, 10000]


def program(n: int) -> str:
    lines = ["fn chain(x: f32[S, D]) -> f32[S, D] {"]
    prev = "x"
    for i in range(n):
        lines.append(f"    let t{i} = {prev} * 0.5 + x")
        prev = f"t{i}"
    lines += [f"    return {prev}", "}"]
    return "\n".join(lines) + "\n"


def time_whole(binary: str, path: pathlib.Path) -> float:
    start = time.perf_counter()
    subprocess.run([binary, "build", "--emit", "clif", str(path)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def time_optimizer(binary: str, path: pathlib.Path) -> float:
    run = subprocess.run(
        [binary, "--timings", "build", "--emit", "opt", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=True,
    )
    found = re.search(r"optimize ([\d.]+) ms", run.stderr)
    if found is None:
        raise SystemExit(f"no optimize time in the --timings output of {binary}:\n{run.stderr}")
    return float(found.group(1)) / 1e3


def main() -> None:
    root = pathlib.Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binaries", nargs="*", default=[str(root / "target/release/attnc")])
    parser.add_argument("--optimizer", action="store_true", help="time the optimizer alone (attnc --timings)")
    parser.add_argument("--rounds", type=int, default=None, help="timings per length (default 7, 15 with --optimizer)")
    args = parser.parse_args()
    rounds = args.rounds or (15 if args.optimizer else 7)
    measure = time_optimizer if args.optimizer else time_whole
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for n in LENGTHS:
            files[n] = pathlib.Path(tmp) / f"lets{n}.attn"
            files[n].write_text(program(n))
        best = {(b, n): float("inf") for b in args.binaries for n in LENGTHS}
        for _ in range(rounds):
            for n in LENGTHS:
                for b in args.binaries:
                    best[(b, n)] = min(best[(b, n)], measure(b, files[n]))
    for b in args.binaries:
        print(b)
        for n in LENGTHS:
            print(f"  {n:>6} lets: {best[(b, n)] * 1e3:8.1f} ms  ({best[(b, n)] / best[(b, LENGTHS[0])]:.1f}x 1k)")


if __name__ == "__main__":
    main()
