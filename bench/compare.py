#!/usr/bin/env python3
"""attnc's CPU target against PyTorch and ONNX Runtime on the same shapes and data, interleaved.

Timing (the default). For every case it times, one after the other and for several rounds:

  - attnc: `attnc bench FILE --json` (median of --iters runs inside one process; the program is
    compiled once, inputs are seeded random N(0, 1) data that `--save-inputs` writes to .npy);
  - PyTorch on those same arrays: `scaled_dot_product_attention` for plain (no mask), causal
    (`is_causal=True`), ALiBi (slopes[h]·(j - i), -inf above the diagonal, as a float
    `attn_mask`), the sliding window (j <= i and i - j <= 256, as a float `attn_mask`) and
    decode; eager code for soft-capping (q@kᵀ·scale, 50·tanh(·/50), masked_fill, softmax, @v:
    SDPA has no score-modification hook) and for the transformer block
    (examples/transformer_block.attn: layer_norm, matmuls, SDPA with is_causal, erf GELU,
    residuals);
  - ONNX Runtime's opset-23 `Attention` op (plain, causal through `is_causal=1`, ALiBi and the
    sliding window through its float `attn_mask` input, decode); soft-capping and the block
    have no ONNX Runtime peer.

The cases: B=1 H=8, D in {64, 128} x S in {1024, 4096} for plain, causal, ALiBi and soft-capped
attention; the transformer block at S=1024 (Dh=64, so E=512, F=2048); decode of one query per
head against a KV cache of 32768 positions (H=32, D=128); each on every --threads count. --all
adds D=128 S=16384 and the sliding window at S=16384.

Before timing, each kind of case is run once at S=320 (a decode cache of 320) by `attnc run` and
by its peers on the same inputs, and the run stops unless every output agrees with attnc's to
max|diff| / max|attnc| < 1e-3.

Each number is the median over rounds of per-round medians; the table shows milliseconds, a
rate and attnc's speed-up over each peer (peer time / attnc time: > 1 means attnc is faster).
The rate is useful GFLOP/s: 4·B·H·S·N·D for attention, half of that for causal masks (causal,
ALiBi, soft-capping), 4·B·H·D·Σ_i min(i+1, W+1) for the sliding window; for the block, its six
matrix products, 2·B·S·E·(4E + 2F), plus its causal attention, 2·B·S²·E. For decode it is GB/s
of K and V read; the DRAM read bandwidth (the faster of torch.sum and a matrix-vector product
over a 1 GiB f32 array, on the same threads, timed interleaved with the decode rounds) is
measured alongside, and a line after the table gives attnc's decode bandwidth as a fraction of
it. A peer that fails (e.g. out of memory), would need more than 16 GiB (or more than the
machine has available), or takes longer than 60 s for one call is reported as "—".

Memory (--memory). For plain attention at B=1 H=8 D=128 and S in {4096, 8192, 16384}, on every
--threads count, the peak resident memory of one call beyond its inputs and output, each
framework in a fresh process:

  - attnc: the peak RSS of `attnc run` on the saved inputs (as GNU time reports it), less the
    inputs, the output, and attnc's fixed overhead (its code, compiler and JIT-compiled entry:
    the same measurement at S=256, less what attnc reports holding there); beside it, what
    `attnc bench` reports holding (intermediates, tile tables and per-thread scratch);
  - PyTorch SDPA and ONNX Runtime (bench/peak_memory.py): one call on a tiny input first, then
    the inputs are loaded, the peak RSS is reset (/proc/self/clear_refs), the call is made once,
    and the rise of VmHWM less the output is reported.

Every child runs with glibc's mmap threshold fixed, so that freed large buffers leave the
resident set. A peer that would need more than 16 GiB (ONNX Runtime's Attention materialises
the B·H·S² probabilities) is skipped. RSS includes allocator and page effects: differences below
about 0.5 MiB are noise. Needs GNU time (/usr/bin/time).

    python3 bench/compare.py                  # the timing table above, 1 and 2 threads
    python3 bench/compare.py --quick          # only D=128 S=1024 (and decode), 2 rounds
    python3 bench/compare.py --all            # also S=16384 and the sliding window, then --memory (long)
    python3 bench/compare.py --memory         # the memory table only
    python3 bench/compare.py --train          # training: attnc --grad against PyTorch autograd,
                                              # causal, ALiBi, soft-capping, D=128, S=1024 and 4096
    python3 bench/compare.py --train --memory # the peak memory of one training step, S=4096, 8192, 16384
    python3 bench/compare.py --cases block,softcap --sizes 256 --threads 2 --rounds 1
                                              # only these kinds, at these sequence lengths
    python3 bench/compare.py --out FILE       # also write the markdown tables to FILE
    python3 bench/compare.py --no-build       # use target/release/attnc as it is
    python3 bench/compare.py --isa avx2       # an AVX2 machine on an AVX-512 one: attnc with
                                              # ATTNC_ISA=avx2, PyTorch held to AVX2 (ATen, MKL,
                                              # oneDNN); ONNX Runtime cannot be held (MLAS picks
                                              # its kernels from cpuid), the header says so

--cases takes plain, causal, alibi, softcap, sliding, block, decode (a kind named there runs
even where the mode would leave it out); --sizes replaces the sequence lengths of every case but
decode (whose cache stays at 32768) and of the memory table. --rounds, --iters and --threads set
the interleaved rounds per case, the timed runs per round and the thread counts.

The script makes its own virtual environment (bench/.venv, gitignored) with torch, onnx,
onnxruntime and numpy from PyPI on first use, and builds attnc in release mode unless told not to.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / "bench" / ".venv"
PACKAGES = ["numpy", "torch", "onnx", "onnxruntime"]

KINDS = ("plain", "causal", "alibi", "softcap", "sliding", "block", "decode")
CAUSAL_KINDS = ("causal", "alibi", "softcap")
WINDOW = 256  # the sliding window: key j is visible from query i when j <= i and i - j <= WINDOW
SOFTCAP = 50.0  # examples/softcap.attn's cap
BLOCK_HEADS, BLOCK_FFN = 8, 2048  # examples/transformer_block.attn: `dim H = 8`, and F
CHECK_S = 320  # the sequence length of the correctness check: longer than the window
CHECK_TOLERANCE = 1e-3  # max|diff| / max|attnc| allowed in the check
PEER_MEMORY_LIMIT = 16 << 30  # bytes a peer may need
PEER_CALL_LIMIT_S = 60.0  # seconds one peer call may take
DRAM_BYTES = 1 << 30  # the array read to measure the DRAM read bandwidth
MEMORY_REFERENCE_S = 256  # where attnc's fixed memory overhead is measured
# Keeps glibc from raising its mmap threshold when large buffers are freed, so that freed
# buffers leave the resident set instead of being kept for reuse (set for the memory children).
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "131072"}

SLIDING = f"""\
const W = {WINDOW}
fn sliding(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D]) -> f32[B, H, S, D] {{
    let scores = q @ k.T / sqrt(D)
    let (b, h, i, j) = indices(scores)
    return softmax(where(j <= i && i - j <= W, scores, -inf), axis = -1) @ v
}}
"""


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


def attnc_binary(build=True):
    exe = ROOT / "target" / "release" / "attnc"
    if build:
        subprocess.run(["cargo", "build", "--release", "-p", "attn-runtime", "--bin", "attnc"], cwd=ROOT, check=True)
    elif not exe.exists():
        sys.exit(f"{exe} does not exist: build it (cargo build --release) or leave out --no-build")
    return exe


def note(text):
    print(f"  {text}", file=sys.stderr, flush=True)


def memory_limit():
    """Bytes a peer may allocate: PEER_MEMORY_LIMIT, or what the machine has available if less."""
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return min(PEER_MEMORY_LIMIT, available)


def size(n):
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def gbs(nbytes, ms):
    return nbytes / ms / 1e6


class Case:
    """One shape and kind: attention [B, H, S, D] (decode: one query against a cache of kv
    positions), or the transformer block [B, S, H·d] with head width d."""

    def __init__(self, kind, s, d, threads, b=1, h=8, kv=None):
        self.kind, self.b, self.h, self.s, self.d, self.threads = kind, b, h, s, d, threads
        self.kv = kv if kv is not None else s

    def label(self):
        if self.kind == "decode":
            return f"decode H={self.h} D={self.d} KV={self.kv}, {self.threads}T"
        if self.kind == "block":
            return f"block S={self.s} E={self.h * self.d} F={BLOCK_FFN}, {self.threads}T"
        return f"{self.kind} H={self.h} D={self.d} S={self.s}, {self.threads}T"

    def resized(self, s):
        """The same kind and threads at sequence length (decode: cache length) s."""
        if self.kind == "decode":
            return Case("decode", 1, self.d, self.threads, self.b, self.h, kv=s)
        return Case(self.kind, s, self.d, self.threads, self.b, self.h)

    def program(self, tmp):
        if self.kind == "sliding":
            path = Path(tmp) / "sliding.attn"
            path.write_text(SLIDING)
            return path
        files = {
            "plain": "sdpa.attn",
            "causal": "causal.attn",
            "alibi": "alibi.attn",
            "softcap": "softcap.attn",
            "decode": "decode.attn",
            "block": "transformer_block.attn",
        }
        return ROOT / "examples" / files[self.kind]

    def entry(self):
        return "block" if self.kind == "block" else None

    def dims(self):
        if self.kind == "decode":
            return {"B": self.b, "H": self.h, "T": self.kv, "D": self.d}
        if self.kind == "block":
            return {"B": self.b, "S": self.s, "Dh": self.d, "F": BLOCK_FFN}
        return {"B": self.b, "H": self.h, "S": self.s, "D": self.d}

    def flops(self):
        b, h, s, d = self.b, self.h, self.s, self.d
        if self.kind == "block":
            e = h * d
            return 2.0 * b * s * e * (4 * e + 2 * BLOCK_FFN) + 2.0 * b * s * s * e
        if self.kind == "sliding":
            return 4.0 * b * h * d * sum(min(i + 1, WINDOW + 1) for i in range(s))
        full = 4.0 * b * h * s * self.kv * d
        return full / 2 if self.kind in CAUSAL_KINDS else full

    def rate(self, ms):
        """GB/s of K and V for decode, useful GFLOP/s otherwise."""
        if ms is None:
            return None
        if self.kind == "decode":
            return gbs(2.0 * self.b * self.h * self.kv * self.d * 4, ms)
        return self.flops() / ms / 1e6


def attnc_command(exe, command, case, path):
    """`attnc COMMAND PATH` with the case's threads and entry."""
    cmd = [str(exe), command, str(path), "--threads", str(case.threads)]
    if case.entry():
        cmd += ["--entry", case.entry()]
    return cmd


def run_attnc(exe, case, path, iters, warmup=1, save=None, extra=()):
    """`attnc bench --json` on the case; its json line as a dict."""
    cmd = attnc_command(exe, "bench", case, path) + ["--json", "--iters", str(iters), "--warmup", str(warmup), *extra]
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


def input_flags(inputs_dir):
    return [f for p in sorted(Path(inputs_dir).glob("*.npy")) for f in ("--input", f"{p.stem}={p}")]


def median_time(fn, iters):
    """Milliseconds: the median of `iters` timed calls after an untimed one."""
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def sdpa(q, k, v, mask=None, causal=False):
    import torch
    import torch.nn.functional as F

    with torch.inference_mode():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def torch_softcap(q, k, v, future, cap=SOFTCAP):
    """examples/softcap.attn as PyTorch eager code; `future` is True where j > i."""
    import torch

    with torch.inference_mode():
        s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        s = cap * torch.tanh(s / cap)
        return torch.softmax(s.masked_fill(future, float("-inf")), dim=-1) @ v


def torch_block(x, ln1_g, ln1_b, w_q, w_k, w_v, w_o, ln2_g, ln2_b, w1, w2):
    """examples/transformer_block.attn's `block` as PyTorch eager code."""
    import torch
    import torch.nn.functional as F

    b, s, e = x.shape

    def split_heads(t):
        return t.view(b, s, BLOCK_HEADS, e // BLOCK_HEADS).transpose(1, 2)

    with torch.inference_mode():
        h = F.layer_norm(x, (e,), ln1_g, ln1_b, eps=1e-5)
        heads = F.scaled_dot_product_attention(split_heads(h @ w_q), split_heads(h @ w_k), split_heads(h @ w_v), is_causal=True)
        y = x + heads.transpose(1, 2).reshape(b, s, e) @ w_o
        h = F.layer_norm(y, (e,), ln2_g, ln2_b, eps=1e-5)
        return y + F.gelu(h @ w1) @ w2


def ort_attention(threads, d, causal=False, masked=False):
    """An ONNX Runtime session running one opset-23 `Attention` node on Q [B, H, S, D] and K, V
    [B, H, N, D] of any sizes (and a float attn_mask [1 or B, 1 or H, S, N] when masked); None,
    with a note, if this ONNX Runtime cannot run it."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    shapes = {"Q": ["B", "H", "S", "D"], "K": ["B", "H", "N", "D"], "V": ["B", "H", "N", "D"]}
    if masked:
        shapes["attn_mask"] = ["MB", "MH", "S", "N"]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in shapes.items()]
    output = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["B", "H", "S", "D"])
    node = helper.make_node("Attention", list(shapes), ["Y"], is_causal=int(causal), scale=float(d) ** -0.5)
    graph = helper.make_graph([node], "attention", inputs, [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    # The newest IR version this onnx writes can be newer than the runtime reads; opset 23
    # needs IR version 11.
    model.ir_version = 11
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    try:
        return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # an ORT without opset 23 Attention: report, keep going
        note(f"onnxruntime: {e}".splitlines()[0])
        return None


def relative_positions(s, n):
    """j - i as an [S, N] float32 array (exact below 2^24)."""
    import numpy as np

    return np.arange(n, dtype=np.float32)[None, :] - np.arange(s, dtype=np.float32)[:, None]


class Peers:
    """The PyTorch and ONNX Runtime calls for one case, on the arrays attnc used. A peer is None
    ("—" in the table) where the case has none, or where it would need more memory than
    memory_limit(), fails, or takes longer than PEER_CALL_LIMIT_S for a call (probe())."""

    def __init__(self, case, inputs_dir):
        import numpy as np
        import torch

        self.case = case
        torch.set_num_threads(case.threads)
        arrays = {p.stem: np.load(p) for p in Path(inputs_dir).glob("*.npy")}
        tensors = {name: torch.from_numpy(a) for name, a in arrays.items()}
        self.torch = self.ort = None
        if case.kind == "block":
            self.torch = lambda: torch_block(**tensors)
            return
        q, k, v = (arrays[n] for n in ("q", "k", "v"))
        tq, tk, tv = (tensors[n] for n in ("q", "k", "v"))
        s, n = q.shape[2], k.shape[2]
        scores = q.shape[0] * q.shape[1] * s * n * 4  # bytes of one B·H·S·N f32 array
        if case.kind == "softcap":
            # Eager code holds up to three score-sized arrays at once.
            if self._fits("torch", 3 * scores):
                future = torch.from_numpy(relative_positions(s, n) > 0)
                self.torch = lambda: torch_softcap(tq, tk, tv, future)
            return
        mask = None
        if case.kind in ("alibi", "sliding"):
            heads = q.shape[1] if case.kind == "alibi" else 1
            if not self._fits("torch and onnxruntime", heads * s * n * 4, what="the mask"):
                return
            mask = self._mask(arrays, heads, s, n)
        tmask = torch.from_numpy(mask) if mask is not None else None
        causal = case.kind == "causal"
        self.torch = lambda: sdpa(tq, tk, tv, tmask, causal)
        # ONNX Runtime's Attention materialises the B·H·S·N probabilities.
        if not self._fits("onnxruntime", scores):
            return
        session = ort_attention(case.threads, q.shape[-1], causal=causal, masked=mask is not None)
        if session is not None:
            feeds = {"Q": q, "K": k, "V": v}
            if mask is not None:
                feeds["attn_mask"] = mask
            self.ort = lambda: session.run(None, feeds)[0]

    def _fits(self, peer, need, what="it"):
        limit = memory_limit()
        if need <= limit:
            return True
        note(f"{self.case.label()}: {peer} skipped: {what} would need {size(need)}, more than {size(limit)}")
        return False

    def _mask(self, arrays, heads, s, n):
        """The float attn_mask [1, heads, S, N] of an ALiBi or sliding-window case."""
        import numpy as np

        rel = relative_positions(s, n)
        mask = np.zeros((1, heads, s, n), np.float32)
        if self.case.kind == "alibi":
            for h, slope in enumerate(arrays["slopes"].astype(np.float32)):
                np.multiply(rel, slope, out=mask[0, h])
            hidden = rel > 0
        else:
            hidden = (rel > 0) | (rel < -WINDOW)
        for h in range(heads):
            np.copyto(mask[0, h], -np.inf, where=hidden)
        return mask

    def calls(self):
        return {"torch": self.torch, "ort": self.ort}

    def probe(self):
        """Calls each peer once; drops those that fail or take longer than PEER_CALL_LIMIT_S."""
        for name, fn in self.calls().items():
            if fn is None:
                continue
            try:
                t = time.perf_counter()
                fn()
                seconds = time.perf_counter() - t
            except Exception as e:  # out of memory, an op this runtime lacks: a "—" in the table
                note(f"{self.case.label()}: {name} failed: {e}".splitlines()[0])
                setattr(self, name, None)
                continue
            if seconds > PEER_CALL_LIMIT_S:
                note(f"{self.case.label()}: {name} skipped: one call took {seconds:.1f} s")
                setattr(self, name, None)


def dram_reads():
    """Two reads of a DRAM_BYTES f32 array on torch's current thread count, timed to measure the
    DRAM read bandwidth decode is compared with: torch.sum, and a matrix-vector product (MKL's
    gemv streams the matrix as decode streams K and V). The faster one counts."""
    import torch

    x = torch.ones(DRAM_BYTES // 4)
    matrix, ones = x.view(-1, 1 << 14), torch.ones(1 << 14)
    return {"dram sum": x.sum, "dram matvec": lambda: matrix @ ones}


def check(exe, case, tmp):
    """Runs the case's kind at CHECK_S with `attnc run` and its peers on the same inputs; exits
    unless they agree."""
    import numpy as np

    small = case.resized(CHECK_S)
    path = small.program(tmp)
    with tempfile.TemporaryDirectory(dir=tmp) as work:
        inputs, outputs = Path(work) / "inputs", Path(work) / "outputs"
        run_attnc(exe, small, path, 1, warmup=0, save=inputs)
        cmd = attnc_command(exe, "run", small, path) + input_flags(inputs) + ["--out-dir", str(outputs)]
        subprocess.run(cmd, check=True, capture_output=True)
        (out,) = outputs.glob("*.npy")
        ref = np.load(out)
        peers = Peers(small, inputs)
        for name, fn in peers.calls().items():
            if fn is None:
                continue
            error = float(np.abs(np.asarray(fn()) - ref).max() / np.abs(ref).max())
            print(f"check: {small.label()}: {name} vs attnc: max|diff|/max|attnc| = {error:.1e}", flush=True)
            if not error < CHECK_TOLERANCE:
                sys.exit(f"{name} and attnc disagree on {small.label()} ({error:.1e} >= {CHECK_TOLERANCE}): fix the peer or attnc")


def fmt(x, digits=1):
    return "—" if x is None else f"{x:.{digits}f}"


def markdown(cols, rows):
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + ["| " + " | ".join(r) + " |" for r in rows]


def timing_cases(args):
    kinds = set(args.cases) if args.cases else {"plain", "causal", "alibi", "softcap", "block", "decode"} | ({"sliding"} if args.all else set())
    seqs = args.sizes or ([1024] if args.quick else [1024, 4096])
    heads_d = [128] if args.quick else [64, 128]
    shapes = [(d, s) for s in seqs for d in heads_d]
    if args.all and not args.sizes:
        shapes.append((128, 16384))
    cases = []
    for t in args.threads:
        for d, s in shapes:
            cases += [Case(kind, s, d, t) for kind in ("plain", "causal", "alibi", "softcap") if kind in kinds]
        if "sliding" in kinds:
            cases += [Case("sliding", s, 128, t) for s in args.sizes or [16384]]
        if "block" in kinds:
            cases += [Case("block", s, 64, t, h=BLOCK_HEADS) for s in args.sizes or [1024]]
        if "decode" in kinds:
            cases.append(Case("decode", 1, 128, t, h=32, kv=32768))
    return cases


def machine(exe):
    """One line naming the CPU, its vector extensions and the kernel path attnc dispatches to
    (ATTNC_ISA lowers it), as `attnc bench` reports them."""
    out = subprocess.run(
        [str(exe), "bench", str(ROOT / "examples" / "sdpa.attn"), "--dim", "S=8", "--iters", "1", "--warmup", "0", "--peak", "1", "--json"],
        capture_output=True, text=True,
    )
    info = next((json.loads(l[len("json: "):]) for l in out.stdout.splitlines() if l.startswith("json: ")), {})
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((l.split(":", 1)[1].split() for l in f if l.startswith("flags")), []))
    except OSError:
        pass
    isa = [x for x in ("avx512f", "avx2", "fma") if x in flags]
    return (
        f"CPU: {info.get('cpu', 'unknown')} ({', '.join(isa) or 'no AVX'}, {os.cpu_count()} logical cores); "
        f"attnc kernels on the {info.get('isa', '?')} path"
        + (f" (ATTNC_ISA={os.environ['ATTNC_ISA']})" if os.environ.get("ATTNC_ISA") else "")
    )


# What `--isa avx2` sets: attnc's path, and PyTorch's (its own kernels, MKL's and oneDNN's). Read
# when the libraries load, so they are set before the script re-runs itself in its venv.
AVX2_ENV = {
    "ATTNC_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


def peers_isa(torch):
    """One line saying which vector path each peer runs on."""
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        cap = "unknown"
    held = " (held by --isa avx2)" if os.environ.get("ATEN_CPU_CAPABILITY") else ""
    return f"peers: PyTorch kernels on {cap}{held}; ONNX Runtime's MLAS picks its own from cpuid (no override)"


def timing(args, exe):
    """The timing table, as markdown lines."""
    import onnxruntime
    import torch

    cases = timing_cases(args)
    rounds = 2 if args.quick else args.rounds
    header = (
        f"attnc vs PyTorch {torch.__version__} and ONNX Runtime {onnxruntime.__version__} "
        f"(fp32, CPU, medians of {rounds} interleaved rounds of {args.iters} runs)\n{machine(exe)}\n{peers_isa(torch)}"
    )
    print(header, flush=True)
    rows, decode_lines = [], []
    with tempfile.TemporaryDirectory() as tmp:
        checked = set()
        for case in cases:
            if case.kind not in checked:
                check(exe, case, tmp)
                checked.add(case.kind)
        for case in cases:
            path = case.program(tmp)
            with tempfile.TemporaryDirectory(dir=tmp) as inputs:
                run_attnc(exe, case, path, 1, save=inputs)
                peers = Peers(case, inputs)
            peers.probe()
            calls = {name: fn for name, fn in peers.calls().items() if fn is not None}
            if case.kind == "decode":
                calls.update(dram_reads())
            times = {name: [] for name in ["attnc", "torch", "ort", *calls]}
            for _ in range(rounds):
                times["attnc"].append(run_attnc(exe, case, path, args.iters)["median_ms"])
                for name, fn in calls.items():
                    times[name].append(median_time(fn, args.iters))
            med = {k: statistics.median(v) if v else None for k, v in times.items()}
            ratio = lambda peer: med[peer] / med["attnc"] if med[peer] else None
            row = [case.label()]
            row += [fmt(med["attnc"], 2), fmt(case.rate(med["attnc"]))]
            row += [fmt(med["torch"], 2), fmt(case.rate(med["torch"]))]
            row += [fmt(med["ort"], 2), fmt(case.rate(med["ort"]))]
            row += [fmt(ratio("torch"), 2), fmt(ratio("ort"), 2)]
            rows.append(row)
            print(" | ".join(row), flush=True)
            if case.kind == "decode":
                total, matvec = gbs(DRAM_BYTES, med["dram sum"]), gbs(DRAM_BYTES, med["dram matvec"])
                dram, attnc = max(total, matvec), case.rate(med["attnc"])
                decode_lines.append(
                    f"- {case.label()}: DRAM read {dram:.1f} GB/s (sum {total:.1f}, matvec {matvec:.1f}); "
                    f"attnc reads K and V at {attnc:.1f} GB/s, {100 * attnc / dram:.0f}% of it"
                )
            del peers, calls  # before the next case builds its masks
    cols = ["case", "attnc ms", "attnc rate", "torch ms", "torch rate", "ort ms", "ort rate", "torch/attnc", "ort/attnc"]
    lines = [header, "", "rate: GFLOP/s (useful FLOPs), GB/s of K and V for decode", ""] + markdown(cols, rows)
    if decode_lines:
        lines += [
            "",
            f"Decode against the DRAM read bandwidth (the faster of torch.sum and a matrix-vector product over "
            f"{DRAM_BYTES >> 30} GiB of f32, on the same threads, interleaved with the decode rounds):",
            "",
        ]
        lines += decode_lines
    return lines


class TrainPeer:
    """PyTorch autograd on a training case: forward plus backward with the cotangent attnc used
    (`d_out`), for causal SDPA, ALiBi (the float mask built from learnable slopes inside the
    call, so the slopes get their gradient as attnc's do) and soft-capping (eager code)."""

    def __init__(self, case, inputs_dir):
        import numpy as np
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(case.threads)
        arrays = {p.stem: np.load(p) for p in Path(inputs_dir).glob("*.npy")}
        self.leaves = {n: torch.from_numpy(arrays[n]).requires_grad_(True) for n in ("q", "k", "v", "slopes") if n in arrays}
        q, k, v = (self.leaves[n] for n in ("q", "k", "v"))
        g = torch.from_numpy(arrays["d_out"])
        s, n = q.shape[2], k.shape[2]
        rel = torch.from_numpy(relative_positions(s, n))
        future = rel > 0
        if case.kind == "causal":
            forward = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif case.kind == "alibi":
            slopes = self.leaves["slopes"]
            forward = lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=(slopes[None, :, None, None] * rel).masked_fill(future, float("-inf"))
            )
        else:

            def forward():
                t = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
                t = SOFTCAP * torch.tanh(t / SOFTCAP)
                return torch.softmax(t.masked_fill(future, float("-inf")), dim=-1) @ v

        def step():
            for t in self.leaves.values():
                t.grad = None
            forward().backward(g)

        self.step = step

    def grads(self):
        """Each input's gradient after one step, as `d_<name>` arrays."""
        self.step()
        return {f"d_{n}": t.grad.numpy() for n, t in self.leaves.items()}


def train_check(exe, case, tmp):
    """attnc's gradients (`attnc run --grad`) against PyTorch autograd's at CHECK_S; exits unless
    they agree."""
    import numpy as np

    small = case.resized(CHECK_S)
    path = small.program(tmp)
    with tempfile.TemporaryDirectory(dir=tmp) as work:
        inputs, outputs = Path(work) / "inputs", Path(work) / "outputs"
        run_attnc(exe, small, path, 1, warmup=0, save=inputs, extra=["--grad"])
        cmd = attnc_command(exe, "run", small, path) + ["--grad"] + input_flags(inputs) + ["--out-dir", str(outputs)]
        subprocess.run(cmd, check=True, capture_output=True)
        for name, want in TrainPeer(small, inputs).grads().items():
            got = np.load(outputs / f"{name}.npy")
            error = float(np.abs(got - want).max() / np.abs(got).max())
            print(f"check: {small.label()}: torch {name} vs attnc: max|diff|/max|attnc| = {error:.1e}", flush=True)
            if not error < CHECK_TOLERANCE:
                sys.exit(f"torch and attnc gradients disagree on {small.label()} ({error:.1e}): fix the peer or attnc")


def training(args, exe):
    """The training table (--train): forward plus backward against PyTorch autograd."""
    import torch

    kinds = [k for k in ("causal", "alibi", "softcap") if not args.cases or k in args.cases]
    seqs = args.sizes or ([1024] if args.quick else [1024, 4096])
    cases = [Case(kind, s, 128, t) for t in args.threads for s in seqs for kind in kinds]
    rounds = 2 if args.quick else args.rounds
    header = (
        f"training: attnc --grad vs PyTorch {torch.__version__} autograd (fp32, CPU, forward plus backward, "
        f"medians of {rounds} interleaved rounds of {args.iters} runs)\n{machine(exe)}"
    )
    print(header, flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            train_check(exe, Case(kind, CHECK_S, 128, args.threads[0]), tmp)
        for case in cases:
            path = case.program(tmp)
            with tempfile.TemporaryDirectory(dir=tmp) as inputs:
                run_attnc(exe, case, path, 1, save=inputs, extra=["--grad"])
                peer = TrainPeer(case, inputs)
            times = {"fwd": [], "train": [], "torch": []}
            for _ in range(rounds):
                times["fwd"].append(run_attnc(exe, case, path, args.iters)["median_ms"])
                times["train"].append(run_attnc(exe, case, path, args.iters, extra=["--grad"])["median_ms"])
                times["torch"].append(median_time(peer.step, args.iters))
            med = {k: statistics.median(v) for k, v in times.items()}
            row = [case.label(), fmt(med["fwd"], 2), fmt(med["train"], 2), fmt((med["train"] - med["fwd"]) / med["fwd"], 2)]
            row += [fmt(med["torch"], 2), fmt(med["torch"] / med["train"], 2)]
            rows.append(row)
            print(" | ".join(row), flush=True)
            del peer
    cols = ["case", "attnc fwd ms", "attnc fwd+bwd ms", "attnc bwd/fwd", "torch fwd+bwd ms", "torch/attnc"]
    return [header, ""] + markdown(cols, rows)


def attnc_peak_rss(cmd):
    """Runs an attnc command with a fixed mmap threshold; its peak RSS in bytes.

    GNU time reports it: the peak a child's rusage reports includes the resident set of the
    process it was forked from (this Python, possibly after it held GiBs), and time's is small."""
    time_exe = shutil.which("time", path="/usr/bin:/bin")
    if time_exe is None:
        sys.exit("--memory needs GNU time (/usr/bin/time; Debian and Ubuntu: apt-get install time)")
    with tempfile.NamedTemporaryFile("r") as report:
        cmd = [time_exe, "--format", "%M", "--output", report.name, *cmd]
        out = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **FIXED_MMAP_THRESHOLD})
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
        return int(report.read().split()[-1]) * 1024


def attnc_memory(exe, case, path, inputs, save, grad=False):
    """attnc's peak RSS of one call of `attnc run` on the inputs beyond its inputs and outputs
    (fixed overhead included), and what `attnc bench` reports holding, in bytes. With `grad`,
    of the entry with its gradients (inputs plus d_out, outputs plus d_q, d_k, d_v)."""
    extra = ["--grad"] if grad else []
    reported = run_attnc(exe, case, path, 1, warmup=0, save=inputs if save else None, extra=extra)["extra_bytes"]
    cmd = attnc_command(exe, "run", case, path) + extra + input_flags(inputs)
    arrays = (8 if grad else 4) * case.b * case.h * case.s * case.d * 4
    return attnc_peak_rss(cmd) - arrays, reported


def peer_memory(framework, case, inputs):
    """The peak RSS increase of one call beyond its output in a fresh process (peak_memory.py);
    None, with a note, if it fails. Framework `torch-train` is a training step of the case's
    kind (TrainPeer)."""
    cmd = [sys.executable, str(ROOT / "bench" / "peak_memory.py"), framework, str(inputs), str(case.threads), case.kind]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **FIXED_MMAP_THRESHOLD})
    if out.returncode != 0:
        note(f"{case.label()}: {framework} failed (exit {out.returncode}): {out.stderr.strip()[-500:]}")
        return None
    return json.loads(out.stdout)["extra_bytes"]


def memory(args, exe):
    """The peak-memory table, as markdown lines."""
    header = "Peak memory of one plain attention call beyond inputs and output (MiB), B=1 H=8 D=128, a fresh process each"
    print(header, flush=True)
    mib = lambda n: None if n is None else n / (1 << 20)
    path = ROOT / "examples" / "sdpa.attn"
    fixed = {}
    with tempfile.TemporaryDirectory() as inputs:
        for t in args.threads:
            measured, reported = attnc_memory(exe, Case("plain", MEMORY_REFERENCE_S, 128, t), path, inputs, save=True)
            fixed[t] = measured - reported
    rows = []
    for s in args.sizes or [4096, 8192, 16384]:
        with tempfile.TemporaryDirectory() as inputs:
            for n, t in enumerate(args.threads):
                case = Case("plain", s, 128, t)
                measured, reported = attnc_memory(exe, case, path, inputs, save=n == 0)
                torch_extra = peer_memory("torch", case, inputs)
                # ONNX Runtime's Attention materialises the H·S² probabilities.
                probabilities = case.b * case.h * s * s * 4
                limit = memory_limit()
                if probabilities <= limit:
                    ort_extra = peer_memory("ort", case, inputs)
                else:
                    note(f"{case.label()}: onnxruntime skipped: it would need {size(probabilities)}, more than {size(limit)}")
                    ort_extra = None
                row = [case.label(), fmt(mib(measured - fixed[t]), 2), fmt(mib(reported), 2), fmt(mib(torch_extra), 2), fmt(mib(ort_extra), 2)]
                rows.append(row)
                print(" | ".join(row), flush=True)
    cols = ["case", "attnc", "attnc (own count)", "torch", "ort"]
    overhead = ", ".join(f"{mib(fixed[t]):.1f} MiB on {t}T" for t in args.threads)
    return [header, ""] + markdown(cols, rows) + [
        "",
        f"attnc: peak RSS of `attnc run` less inputs, output and its fixed overhead ({overhead}: its code, compiler "
        f"and JIT-compiled entry, measured at S={MEMORY_REFERENCE_S}); own count: intermediates, tile tables and "
        "per-thread scratch as `attnc bench` reports them. torch, ort: rise of the peak RSS during one call, less the output.",
    ]


def train_memory(args, exe):
    """The training peak-memory table (--train --memory), as markdown lines."""
    kinds = [k for k in ("causal", "alibi", "softcap") if not args.cases or k in args.cases]
    t = args.threads[0]
    header = (
        f"Peak memory of one training step (forward plus backward) beyond inputs, outputs and gradients (MiB), "
        f"B=1 H=8 D=128, {t} thread(s), a fresh process each"
    )
    print(header, flush=True)
    mib = lambda n: None if n is None else n / (1 << 20)
    fixed = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            case = Case(kind, MEMORY_REFERENCE_S, 128, t)
            with tempfile.TemporaryDirectory(dir=tmp) as inputs:
                measured, reported = attnc_memory(exe, case, case.program(tmp), inputs, save=True, grad=True)
                fixed[kind] = measured - reported
        rows = []
        for s in args.sizes or [4096, 8192, 16384]:
            for kind in kinds:
                case = Case(kind, s, 128, t)
                with tempfile.TemporaryDirectory(dir=tmp) as inputs:
                    measured, reported = attnc_memory(exe, case, case.program(tmp), inputs, save=True, grad=True)
                    # PyTorch keeps B·H·S² weights for its backward (ALiBi's float mask and the
                    # eager soft-capping keep several such tensors; SDPA's causal path on the CPU
                    # keeps O(S)).
                    scores = case.b * case.h * s * s * 4
                    need = scores * (1 if kind == "causal" else 6)
                    limit = memory_limit()
                    if kind == "causal" or need <= limit:
                        torch_extra = peer_memory("torch-train", case, inputs)
                    else:
                        note(f"{case.label()}: torch skipped: it would need about {size(need)}, more than {size(limit)}")
                        torch_extra = None
                row = [case.label(), fmt(mib(measured - fixed[kind]), 2), fmt(mib(reported), 2), fmt(mib(torch_extra), 2)]
                rows.append(row)
                print(" | ".join(row), flush=True)
    cols = ["case", "attnc", "attnc (own count)", "torch"]
    overhead = ", ".join(f"{mib(v):.1f} MiB ({k})" for k, v in fixed.items())
    return [header, ""] + markdown(cols, rows) + [
        "",
        f"attnc: peak RSS of `attnc run --grad` less inputs (q, k, v, d_out), outputs (out, d_q, d_k, d_v) and its fixed "
        f"overhead ({overhead}, measured at S={MEMORY_REFERENCE_S}); own count: intermediates, tile tables and per-thread "
        "scratch as `attnc bench --grad` reports them. torch: rise of the peak RSS during one forward plus backward, "
        "less the output and the gradients.",
    ]


def comma_list(convert):
    return lambda text: [convert(x) for x in text.split(",")]


def kind(text):
    if text not in KINDS:
        raise argparse.ArgumentTypeError(f"unknown case kind {text!r} (kinds: {', '.join(KINDS)})")
    return text


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only D=128 S=1024 (and decode), 2 rounds")
    ap.add_argument("--all", action="store_true", help="also S=16384 and the sliding window, then the memory table")
    ap.add_argument("--memory", action="store_true", help="only the peak-memory table")
    ap.add_argument("--train", action="store_true", help="only the training table: forward plus backward against PyTorch autograd")
    ap.add_argument("--cases", type=comma_list(kind), help=f"only these kinds, comma-separated ({', '.join(KINDS)})")
    ap.add_argument("--sizes", type=comma_list(int), help="sequence lengths, comma-separated, for every case but decode")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case")
    ap.add_argument("--iters", type=int, default=5, help="timed runs per round")
    ap.add_argument("--threads", type=comma_list(int), default=[1, 2], help="thread counts, comma-separated")
    ap.add_argument("--out", type=Path, help="also write the markdown tables here")
    ap.add_argument("--isa", choices=["avx2", "portable"], help="attnc's kernel path (ATTNC_ISA); avx2 also holds PyTorch to AVX2")
    ap.add_argument("--no-build", action="store_true", help="use target/release/attnc as it is, without cargo build")
    return ap.parse_args(argv)


def main():
    args = parse_args()
    if args.isa == "avx2":
        os.environ.update(AVX2_ENV)
    elif args.isa:
        os.environ["ATTNC_ISA"] = args.isa
    ensure_venv()

    exe = attnc_binary(build=not args.no_build)
    sections = []
    if args.train:
        if not args.memory:
            sections.append(training(args, exe))
        else:
            sections.append(train_memory(args, exe))
    elif not args.memory:
        sections.append(timing(args, exe))
    if (args.memory or args.all) and not args.train:
        sections.append(memory(args, exe))
    text = "\n\n".join("\n".join(lines) for lines in sections)
    print()
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
