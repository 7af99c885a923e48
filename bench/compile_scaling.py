"""Compile time against program length: a chain of N lets, `attnc build --emit clif`.

Usage: python3 bench/compile_scaling.py [ATTNC_BINARY ...]   (default: target/release/attnc)

Writes the programs to a temporary folder, then times each length ROUNDS times, the lengths
(and binaries) interleaved, and prints the minimum and its ratio to the 1k-let time. Linear
compile time gives 10x from 1k to 10k lets.
"""

import pathlib
import subprocess
import sys
import tempfile
import time

LENGTHS = [1000, 2000, 5000, 10000]
ROUNDS = 7


def program(n: int) -> str:
    lines = ["fn chain(x: f32[S, D]) -> f32[S, D] {"]
    prev = "x"
    for i in range(n):
        lines.append(f"    let t{i} = {prev} * 0.5 + x")
        prev = f"t{i}"
    lines += [f"    return {prev}", "}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    root = pathlib.Path(__file__).resolve().parent.parent
    bins = sys.argv[1:] or [str(root / "target/release/attnc")]
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for n in LENGTHS:
            files[n] = pathlib.Path(tmp) / f"lets{n}.attn"
            files[n].write_text(program(n))
        best = {(b, n): float("inf") for b in bins for n in LENGTHS}
        for _ in range(ROUNDS):
            for n in LENGTHS:
                for b in bins:
                    start = time.perf_counter()
                    subprocess.run([b, "build", "--emit", "clif", str(files[n])], stdout=subprocess.DEVNULL, check=True)
                    best[(b, n)] = min(best[(b, n)], time.perf_counter() - start)
    for b in bins:
        print(b)
        for n in LENGTHS:
            print(f"  {n:>6} lets: {best[(b, n)] * 1e3:8.1f} ms  ({best[(b, n)] / best[(b, LENGTHS[0])]:.1f}x 1k)")


if __name__ == "__main__":
    main()
