#!/usr/bin/env python3
"""The machine code of a program's CUDA kernels, without a GPU: `attnc build --emit cuda`,
compiled by NVRTC for an architecture (sm_90a by default, Hopper's `wgmma` path) with the
compile-time defines a run would set, then disassembled by nvdisasm. Prints ptxas's register
and spill report per kernel and, for each kernel (or the one `--kernel` names), the sequence of
its synchronisation and tensor-core instructions with the special-function work between them
(`HGMMA` warpgroup products, `WARPGROUP.DEPBAR` waits, `BAR.SYNC` barriers, `DEPBAR` copy waits,
mbarrier arrivals and waits (`SYNCS.*`, `ARRIVES.LDGSTSBAR`: an arrival once copies land), TMA
copies (`UTMALDG`),
counts of `MUFU.EX2`): enough to see whether a softmax overlaps the products in flight.

    python3 bench/sass.py FILE.attn [--entry NAME] [--grad] [--arch sm_90a]
        [-D ATTNC_HD_0=128 ...] [--kernel attnc_s0_flash] [--full]

NVRTC: ATTNC_NVRTC_LIB, else ~/.cache/attnc/nvrtc (what .ci/run installs). nvdisasm: the PyPI
package nvidia-cuda-nvdisasm, installed into ~/.cache/attnc/nvdisasm on first use. The attnc
binary: ATTNC_BIN (default target/release/attnc).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

CACHE = Path.home() / ".cache" / "attnc"


def nvrtc_lib() -> ctypes.CDLL:
    path = os.environ.get("ATTNC_NVRTC_LIB") or str(CACHE / "nvrtc/nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
    if not Path(path).is_file():
        sys.exit(f"sass.py: no NVRTC at {path} (run .ci/run once, or set ATTNC_NVRTC_LIB)")
    return ctypes.CDLL(path)


def nvdisasm() -> str:
    found = sorted((CACHE / "nvdisasm").glob("nvidia/*/bin/nvdisasm"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
                        "--target", str(CACHE / "nvdisasm"), "nvidia-cuda-nvdisasm"], check=True)
        found = sorted((CACHE / "nvdisasm").glob("nvidia/*/bin/nvdisasm"))
    if not found:
        sys.exit("sass.py: nvidia-cuda-nvdisasm installed no nvdisasm")
    return str(found[-1])


def compile_cubin(lib: ctypes.CDLL, source: str, options: list[str]) -> tuple[bytes, str]:
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"attnc.cu", 0, None, None) != 0:
        sys.exit("sass.py: nvrtcCreateProgram failed")
    opts = [o.encode() for o in options]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace")
    if rc != 0:
        sys.exit(f"sass.py: NVRTC failed:\n{text}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    return cubin.raw, text


# The instructions the summary keeps (operands shortened), and those it counts between them.
KEEP = re.compile(r"\b(HGMMA\.\S+|WARPGROUP\.\S+(?: gsb\d, 0x\d+)?|BAR\.SYNC\S*|DEPBAR\S*(?: SB\d, 0x\d+)?|LDGDEPBAR|BAR\.ARV\S*|ARRIVES\.\S+|SYNCS\.ARRIVE\S*|SYNCS\.PHASECHK\S*|UTMALDG\S*)")
COUNT = re.compile(r"\b(MUFU\.EX2|MUFU\.TANH|HMMA\.\S+)")


def summary(sass: str, kernel: str | None) -> None:
    for section in re.split(r"\n(?=//-+ \.text\.)", sass):
        m = re.match(r"//-+ \.text\.(\S+)", section)
        if not m or (kernel and m.group(1) != kernel):
            continue
        print(f"== {m.group(1)}")
        runs: list[list] = []  # [text, repeat]
        counts: dict[str, int] = {}

        def flush() -> None:
            if counts:
                runs.append([", ".join(f"{n} {k}" for k, n in counts.items()), 1])
                counts.clear()

        for line in section.splitlines():
            k = KEEP.search(line)
            if k:
                flush()
                word = k.group(1)
                if runs and runs[-1][0] == word:
                    runs[-1][1] += 1
                else:
                    runs.append([word, 1])
                continue
            c = COUNT.search(line)
            if c:
                counts[c.group(1)] = counts.get(c.group(1), 0) + 1
        flush()
        for text, n in runs:
            print(f"  {text}" + (f" ×{n}" if n > 1 else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--entry")
    ap.add_argument("--grad", action="store_true")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="NAME=VALUE, e.g. ATTNC_HD_0=128")
    ap.add_argument("--kernel", help="summarise only this kernel (e.g. attnc_s0_flash)")
    ap.add_argument("--full", action="store_true", help="print the whole disassembly instead of the summary")
    args = ap.parse_args()
    attnc = os.environ.get("ATTNC_BIN", "target/release/attnc")
    cmd = [attnc, "build", args.file, "--target", "cuda", "--emit", "cuda"]
    if args.entry:
        cmd += ["--entry", args.entry]
    if args.grad:
        cmd.append("--grad")
    source = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    options = [f"--gpu-architecture={args.arch}", "--std=c++17", "--ptxas-options=-v"] + [f"-D{d}" for d in args.defines]
    cubin, log = compile_cubin(nvrtc_lib(), source, options)
    for line in log.splitlines():
        if "Compiling entry function" in line or "registers" in line or "spill" in line or "Performance" in line:
            print(line)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm(), f.name], check=True, capture_output=True, text=True).stdout
    if args.full:
        print(sass)
    else:
        summary(sass, args.kernel)


if __name__ == "__main__":
    main()
