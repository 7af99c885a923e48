"""The Python package against NumPy references, the reference interpreter and bad input."""

from __future__ import annotations

import array
import gc
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import attnc

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

SDPA = """
fn sdpa(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D]) -> f32[B, H, S, D] {
    return softmax(q @ k.T / sqrt(D), axis = -1) @ v
}
"""


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def sdpa_ref(q, k, v, bias=None):
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64) / np.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    return softmax(s) @ v.astype(np.float64)


def assert_normwise_close(got: np.ndarray, want: np.ndarray, rel: float = 1e-4) -> None:
    """``max |got - want| <= rel * max |want|``, as the Rust conformance tests compare."""
    if not np.issubdtype(want.dtype, np.floating):
        np.testing.assert_array_equal(got, want)
        return
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite)
    scale = max(float(np.abs(want[finite]).max(initial=0.0)), 1e-6)
    worst = float(np.abs(got[finite].astype(np.float64) - want[finite]).max(initial=0.0))
    assert worst <= rel * scale, f"error {worst:.3e} of scale {scale:.3e}"


def randn(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


# ---- results ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1, 16, 8), (2, 3, 100, 32), (1, 2, 257, 64)])
def test_sdpa_matches_numpy(shape):
    rng = np.random.default_rng(1)
    q, k, v = (randn(rng, *shape) for _ in range(3))
    prog = attnc.compile(SDPA)
    out = prog(q, k, v)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == shape
    np.testing.assert_allclose(out, sdpa_ref(q, k, v), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(prog(q=q, k=k, v=v), out)
    np.testing.assert_array_equal(prog(q, v=v, k=k), out)


def test_causal_alibi_matches_numpy():
    rng = np.random.default_rng(2)
    B, H, S, D = 2, 4, 70, 16
    q, k, v = (randn(rng, B, H, S, D) for _ in range(3))
    slopes = (2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32)
    i = np.arange(S)[:, None]
    j = np.arange(S)[None, :]
    bias = slopes[:, None, None] * (j - i)
    bias = np.where(j <= i, bias, -np.inf)
    out = attnc.compile(EXAMPLES / "alibi.attn")(q, k, v, slopes)
    np.testing.assert_allclose(out, sdpa_ref(q, k, v, bias), rtol=1e-4, atol=1e-5)


def test_document_mask_reads_i32_segment_ids():
    rng = np.random.default_rng(3)
    B, H, S, D = 1, 2, 40, 8
    q, k, v = (randn(rng, B, H, S, D) for _ in range(3))
    seg = np.sort(rng.integers(0, 3, size=(B, S))).astype(np.int32)
    same = seg[:, None, :, None] == seg[:, None, None, :]
    causal = np.arange(S)[None, :] <= np.arange(S)[:, None]
    bias = np.where(same & causal, 0.0, -np.inf)
    out = attnc.compile(EXAMPLES / "document_mask.attn")(q, k, v, seg)
    np.testing.assert_allclose(out, sdpa_ref(q, k, v, bias), rtol=1e-4, atol=1e-5)


def reformer_ref(qk, v, rot, chunks):
    """Reformer LSH attention (one hash round, shared QK), written from the paper in NumPy."""
    B, H, S, D = qk.shape
    C = S // chunks
    out = np.zeros((B, H, S, D))
    for b in range(B):
        for h in range(H):
            x = qk[b, h].astype(np.float64)
            xr = x @ rot
            perm = np.argsort(np.argmax(np.concatenate([xr, -xr], axis=1), axis=1), kind="stable")
            q, vv = x[perm], v[b, h].astype(np.float64)[perm]
            k = q / np.linalg.norm(q, axis=1, keepdims=True)
            for n in range(chunks):
                rows, prev = slice(n * C, (n + 1) * C), slice(((n - 1) % chunks) * C, ((n - 1) % chunks + 1) * C)
                s = q[rows] @ np.concatenate([k[rows], k[prev]]).T / np.sqrt(D)
                s[np.arange(C), np.arange(C)] -= 1e5
                out[b, h, perm[rows]] = softmax(s) @ np.concatenate([vv[rows], vv[prev]])
    return out


def test_reformer_matches_numpy():
    rng = np.random.default_rng(7)
    B, H, NC, C, D, NR = 2, 3, 4, 8, 16, 4
    qk, v = (randn(rng, B, H, NC * C, D) for _ in range(2))
    rot = randn(rng, D, NR)
    out = attnc.compile(EXAMPLES / "reformer.attn").run(qk, v, rot, dims={"NC": NC})
    np.testing.assert_allclose(out, reformer_ref(qk, v, rot, NC), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.attn")), ids=lambda p: p.stem)
def test_every_example_matches_the_interpreter(path):
    cpu = attnc.compile(path, threads=2)
    interp = attnc.compile(path, target="interp")
    dims = cpu.random_dims()
    inputs = cpu.random_inputs(seed=7, dims=dims)
    got = cpu.run(**inputs, dims=dims)
    want = interp.run(**inputs, dims=dims)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want) == len(cpu.outputs)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert_normwise_close(g, w)


def test_several_outputs_come_back_as_a_tuple_in_order():
    prog = attnc.compile(EXAMPLES / "alignment.attn")
    assert [name for name, _, _ in prog.outputs] == ["context", "weights"]
    context, weights = prog(**prog.random_inputs(seed=1, dims={"M": 5, "N": 9}))
    assert context.shape[1] == 5 and weights.shape[1:] == (5, 9)
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-5)


def test_results_go_into_the_callers_arrays():
    rng = np.random.default_rng(3)
    q, k, v = (randn(rng, 1, 2, 33, 8) for _ in range(3))
    prog = attnc.compile(SDPA)
    want = prog(q, k, v)
    # Dense float32: written in place by the kernels (whatever it held before).
    out = np.full_like(want, np.nan)
    assert prog.run(q, k, v, out=out) is out
    np.testing.assert_array_equal(out, want)
    # The layout the caller chooses: a [B, S, H, D] buffer seen as [B, H, S, D].
    seq_major = np.zeros((1, 33, 2, 8), np.float32)
    prog.run(q, k, v, out=seq_major.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(seq_major, want.transpose(0, 2, 1, 3))
    # Reversed strides, float16 and float64: written once after the run, rounded to nearest.
    backwards = np.zeros_like(want)[..., ::-1]
    prog.run(q, k, v, out=backwards)
    np.testing.assert_array_equal(backwards, want)
    for dtype in (np.float16, np.float64):
        narrow = np.zeros(want.shape, dtype)
        prog.run(q, k, v, out=narrow)
        np.testing.assert_array_equal(narrow, want.astype(dtype))
    # An output that is an input: the inputs are read whole before it is written.
    q2 = q.copy()
    prog.run(q2, k, v, out=q2)
    np.testing.assert_array_equal(q2, want)
    # Several results: one buffer or None each; None comes back fresh.
    align = attnc.compile(EXAMPLES / "alignment.attn")
    inputs = align.random_inputs(seed=1, dims={"M": 5, "N": 9})
    context, weights = align(**inputs)
    buf = np.empty_like(weights)
    got = align.run(**inputs, out=(None, buf))
    assert got[1] is buf and got[0] is not None
    np.testing.assert_array_equal(got[0], context)
    np.testing.assert_array_equal(buf, weights)


def test_int_and_bool_results_go_into_the_callers_arrays():
    prog = attnc.compile("fn f(x: f32[N]) -> (pos: bool[N], idx: i32[N]) {\n    return x > 0.0, cast(x * 10.0, i32)\n}\n")
    x = np.linspace(-1, 1, 9, dtype=np.float32)
    pos, idx = prog(x)
    got_pos, got_idx = np.zeros(18, bool)[::2], np.zeros(9, np.int32)
    assert prog.run(x, out=(got_pos, got_idx))[0] is got_pos
    np.testing.assert_array_equal(got_pos, pos)
    np.testing.assert_array_equal(got_idx, idx)
    with pytest.raises(attnc.DTypeError, match="a float32 buffer cannot hold it"):
        prog.run(x, out=(None, np.zeros(9, np.float32)))
    # A bool result's shape is checked after the run (the kernels store it as int32): the
    # buffer is still left as it was.
    wrong = np.ones(8, bool)
    with pytest.raises(attnc.ShapeError, match="has shape \\[8\\], but the result is bool\\[9\\]"):
        prog.run(x, out=(wrong, None))
    assert wrong.all()


def test_bad_output_buffers_are_refused_before_the_run():
    rng = np.random.default_rng(3)
    q, k, v = (randn(rng, 1, 2, 16, 8) for _ in range(3))
    prog = attnc.compile(SDPA)
    cases = [
        (np.zeros((1, 2, 16, 9), np.float32), attnc.ShapeError, r"result `out` is f32\[1, 2, 16, 9\].*but the result is f32\[1, 2, 16, 8\]"),
        (np.zeros((1, 2, 16, 8), np.int32), attnc.DTypeError, "a int32 buffer cannot hold it"),
        (np.broadcast_to(np.zeros((1, 1, 16, 8), np.float32), (1, 2, 16, 8)), attnc.LayoutError, "read-only|share memory"),
        ([1.0], attnc.DTypeError, "must be a NumPy array or a torch tensor"),
    ]
    for buf, error, message in cases:
        before = buf.copy() if isinstance(buf, np.ndarray) else None
        with pytest.raises(error, match=message):
            prog.run(q, k, v, out=buf)
        if before is not None:
            np.testing.assert_array_equal(buf, before)
    shared = np.lib.stride_tricks.as_strided(np.zeros(64, np.float32), (1, 2, 16, 8), (0, 0, 4, 4))
    with pytest.raises(attnc.LayoutError, match="share memory"):
        prog.run(q, k, v, out=shared)
    frozen = np.zeros((1, 2, 16, 8), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(attnc.LayoutError, match="read-only"):
        prog.run(q, k, v, out=frozen)
    with pytest.raises(attnc.ArgumentError, match="one array"):
        prog.run(q, k, v, out=(None, None))
    align = attnc.compile(EXAMPLES / "alignment.attn")
    inputs = align.random_inputs(seed=1, dims={"M": 5, "N": 9})
    with pytest.raises(attnc.ArgumentError, match="2 results"):
        align.run(**inputs, out=np.zeros(1, np.float32))
    both = np.zeros(64 * 64, np.float32)
    context, weights = align(**inputs)
    with pytest.raises(attnc.LayoutError, match="overlap"):
        align.run(**inputs, out=(both[: context.size].reshape(context.shape), both[: weights.size].reshape(weights.shape)))


def test_float16_inputs_are_widened_exactly():
    rng = np.random.default_rng(4)
    q, k, v = (randn(rng, 1, 2, 33, 16).astype(np.float16) for _ in range(3))
    prog = attnc.compile(SDPA)
    np.testing.assert_array_equal(prog(q, k, v), prog(*(x.astype(np.float32) for x in (q, k, v))))


def test_float64_arrays_and_python_floats_are_rounded_to_f32():
    # As the command line reads a float64 .npy file for an f32 parameter: each value rounded to
    # the nearest f32.
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 2, 16, 8)) for _ in range(3))
    assert q.dtype == np.float64
    prog = attnc.compile(SDPA)
    f32 = [x.astype(np.float32) for x in (q, k, v)]
    np.testing.assert_array_equal(prog(q, k, v), prog(*f32))
    np.testing.assert_array_equal(prog(q=q, k=f32[1], v=v), prog(*f32))
    # Any layout: the conversion copies.
    np.testing.assert_array_equal(prog(q, k, np.asfortranarray(v)), prog(*f32))
    scale = attnc.compile("fn scale(x: f32[N], s: f32) -> f32[N] { return x * s }")
    x = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    np.testing.assert_array_equal(scale(x, 0.1), x * np.float32(0.1))
    np.testing.assert_array_equal(scale([1.0, 2.0, 3.0], s=0.1), x * np.float32(0.1))
    # Only f32 parameters take float64, as on the command line: f16 is not rounded unasked.
    half = attnc.compile("fn h(x: f16[N]) -> f16[N] { return x }")
    with pytest.raises(attnc.DTypeError, match=r"`x` is declared f16\[N\] but a float64 array"):
        half(np.zeros(3))


def test_buffer_protocol_and_array_like_inputs():
    prog = attnc.compile("fn scale(x: f32[N]) -> f32[N] { return x * 2.0 }")
    buf = array.array("f", [1.0, 2.0, 3.5])
    np.testing.assert_array_equal(prog(buf), [2.0, 4.0, 7.0])
    np.testing.assert_array_equal(prog(memoryview(buf)), [2.0, 4.0, 7.0])

    class ArrayLike:
        def __array__(self, dtype=None, copy=None):
            return np.array([1.0, -1.0], dtype=np.float32)

    np.testing.assert_array_equal(prog(ArrayLike()), [2.0, -2.0])


# ---- zero copy ----------------------------------------------------------------------------


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_contiguous_f32_inputs_are_read_in_place():
    rng = np.random.default_rng(5)
    q, k, v = (randn(rng, 1, 2, 16, 8) for _ in range(3))
    prog = attnc.compile(SDPA)
    assert prog._compiled._input_addresses((q, k, v)) == [address(q), address(k), address(v)]
    # The same for named arguments, and for an i32 input.
    seg = np.zeros((1, 16), dtype=np.int32)
    doc = attnc.compile(EXAMPLES / "document_mask.attn")
    got = doc._compiled._input_addresses((q, k), {"seg": seg, "v": v})
    assert got == [address(q), address(k), address(v), address(seg)]
    # float16 is widened into a buffer of attnc's own: the check can tell a copy apart.
    half = q.astype(np.float16)
    assert prog._compiled._input_addresses((half, k, v))[0] != address(half)


class DLPackOnly:
    """An object with only the DLPack protocol (as JAX or CuPy arrays on the CPU)."""

    def __init__(self, a: np.ndarray):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_dlpack_objects_are_read_in_place():
    rng = np.random.default_rng(6)
    q, k, v = (randn(rng, 1, 1, 16, 8) for _ in range(3))
    prog = attnc.compile(SDPA)
    np.testing.assert_array_equal(prog(DLPackOnly(q), k, v), prog(q, k, v))
    arr, _ = attnc._as_array(DLPackOnly(q))
    assert address(arr) == address(q)


def test_dlpack_capsules_are_read_in_place():
    rng = np.random.default_rng(7)
    q, k, v = (randn(rng, 1, 1, 16, 8) for _ in range(3))
    prog = attnc.compile(SDPA)
    want = prog(q, k, v)
    for capsule in (k.__dlpack__(), k.__dlpack__(max_version=(1, 0))):
        np.testing.assert_array_equal(prog(q, capsule, v), want)
        assert prog._compiled._input_addresses((q, capsule, v))[1] == address(k)
    # A capsule that holds something else is refused, and so is a strided one's wrong dtype.
    import datetime

    with pytest.raises(attnc.LayoutError, match="not an unused DLPack tensor") as e:
        prog(q, datetime.datetime_CAPI, v)
    assert e.value.param == "k"
    with pytest.raises(attnc.DTypeError, match="int64"):
        prog(q, k.astype(np.int64).__dlpack__(), v)


# ---- the program object -------------------------------------------------------------------


def test_signature_entries_and_params():
    prog = attnc.compile(EXAMPLES / "transformer_block.attn")
    assert prog.entries == ["mha", "ffn", "block"]
    assert prog.entry == "block"
    assert prog.signature.startswith("block(x: f32[B, S, 8*Dh], ln1_g: f32[8*Dh]")  # dim H = 8
    ffn = attnc.compile(EXAMPLES / "transformer_block.attn", entry="ffn")
    assert ffn.params == [("x", "f32", ["B", "S", "E"]), ("w1", "f32", ["E", "F"]), ("w2", "f32", ["F", "E"])]
    assert "ffn(" in repr(ffn) and "on cpu" in repr(ffn)


@pytest.mark.parametrize("stage", attnc.STAGES)
def test_emit_every_stage(stage):
    text = attnc.compile(EXAMPLES / "causal.attn").emit(stage)
    assert text.strip()
    if stage == "opt":
        assert "flash[" in text
    if stage == "cuda":
        assert "__global__" in text


def test_explain_shows_the_fusion_and_tile_map():
    text = attnc.compile(EXAMPLES / "causal.attn").explain(dims={"S": 1024})
    assert "flash" in text and "skipped" in text


def test_compiled_programs_are_cached_per_source_entry_and_target():
    a = attnc.compile(SDPA)
    assert attnc.compile(SDPA)._compiled._identity == a._compiled._identity
    assert attnc.compile(SDPA, target="interp")._compiled._identity != a._compiled._identity
    assert attnc.compile(SDPA, threads=1)._compiled._identity != a._compiled._identity
    attnc.clear_cache()
    assert attnc.compile(SDPA)._compiled._identity != a._compiled._identity


def test_interp_target_agrees():
    rng = np.random.default_rng(8)
    q, k, v = (randn(rng, 1, 2, 20, 8) for _ in range(3))
    np.testing.assert_allclose(attnc.compile(SDPA, target="interp")(q, k, v), sdpa_ref(q, k, v), rtol=1e-5, atol=1e-6)


def test_the_gil_is_released_while_a_program_runs():
    rng = np.random.default_rng(9)
    q, k, v = (randn(rng, 1, 4, 1024, 64) for _ in range(3))
    prog = attnc.compile(SDPA, threads=1)
    prog(q, k, v)
    start = time.perf_counter()
    for _ in range(3):
        prog(q, k, v)
    call = (time.perf_counter() - start) / 3
    # A Python thread keeps running while another is inside the program: the longest pause
    # between its steps stays far below one call (holding the GIL would pause it for a call).
    worker = threading.Thread(target=lambda: [prog(q, k, v) for _ in range(4)])
    worker.start()
    longest, last = 0.0, time.perf_counter()
    while worker.is_alive():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    assert longest < 0.5 * call, f"a Python thread stalled {longest * 1e3:.1f} ms; one call takes {call * 1e3:.1f} ms"


# ---- bad input ----------------------------------------------------------------------------


@pytest.fixture
def qkv():
    rng = np.random.default_rng(10)
    return tuple(randn(rng, 1, 2, 16, 8) for _ in range(3))


def test_wrong_dtype(qkv):
    q, k, v = qkv
    prog = attnc.compile(SDPA)
    with pytest.raises(attnc.DTypeError, match=r"`v` is declared f32\[B, H, S, D\] but a complex64 array") as e:
        prog(q, k, v.astype(np.complex64))
    assert e.value.param == "v" and isinstance(e.value, TypeError)
    with pytest.raises(attnc.DTypeError, match="int32"):
        attnc.compile(EXAMPLES / "document_mask.attn")(q, k, v, np.zeros((1, 16), dtype=np.int64))
    with pytest.raises(attnc.DTypeError):
        prog(q, k, "not an array")
    with pytest.raises(attnc.DTypeError):
        prog(q, k, None)
    with pytest.raises(attnc.DTypeError):
        prog(q, k, np.array([object()]))


def test_wrong_rank_and_mismatched_shapes(qkv):
    q, k, v = qkv
    prog = attnc.compile(SDPA)
    with pytest.raises(attnc.ShapeError, match=r"`v` has 3 axes") as e:
        prog(q, k, v[0])
    assert "E0401" in str(e.value) and "`v` is declared f32[B, H, S, D] here" in str(e.value)
    assert isinstance(e.value, ValueError) and e.value.param == "v"
    with pytest.raises(attnc.ShapeError, match="D"):
        prog(q, k, np.zeros((1, 2, 16, 4), dtype=np.float32))


def test_any_strides_are_copied_once_natively(qkv):
    q, k, v = qkv
    prog = attnc.compile(SDPA)
    want = prog(q, k, v)
    transposed = np.swapaxes(np.swapaxes(k, 2, 3).copy(), 2, 3)  # k's values, column-major
    reversed_ = np.ascontiguousarray(k[:, :, ::-1])[:, :, ::-1]  # negative strides
    broadcast = np.broadcast_to(k[:, :1], k.shape)  # stride 0 over heads
    every_other = np.zeros((1, 2, 16, 16), dtype=np.float32)[..., ::2]
    every_other[...] = k
    raw = np.zeros(k.size * 4 + 1, dtype=np.uint8)
    unaligned = raw[1:].view(np.float32).reshape(k.shape)  # a float32 at an odd address
    unaligned[...] = k
    for view in (transposed, reversed_, every_other, unaligned):
        assert not view.flags.c_contiguous or not view.flags.aligned
        np.testing.assert_array_equal(prog(q, view, v), want)
        # Copied into a dense buffer of attnc's own, not read in place.
        assert prog._compiled._input_addresses((q, view, v))[1] != address(view)
    np.testing.assert_array_equal(prog(q, broadcast, v), prog(q, np.ascontiguousarray(broadcast), v))
    # A byte order other than the machine's is a dtype the parameter does not take.
    with pytest.raises(attnc.DTypeError, match="declared f32") as e:
        prog(q, k.astype(k.dtype.newbyteorder()), v)
    assert e.value.param == "k"


def test_missing_unknown_repeated_and_extra_arguments(qkv):
    q, k, v = qkv
    prog = attnc.compile(SDPA)
    with pytest.raises(attnc.ArgumentError, match=r"missing input for `sdpa`: `v`"):
        prog(q, k)
    with pytest.raises(attnc.ArgumentError, match=r"no parameter named `vv` \(its parameters: q, k, v\)"):
        prog(q, k, vv=v)
    doc = attnc.compile(EXAMPLES / "document_mask.attn")
    with pytest.raises(attnc.ArgumentError, match=r"no parameter named `segs`; did you mean `seg`\?"):
        doc(q, k, v, segs=np.zeros((1, 16), dtype=np.int32))
    with pytest.raises(attnc.ArgumentError, match="given more than once"):
        prog(q, k, v, q=q)
    with pytest.raises(attnc.ArgumentError, match="takes 3 inputs"):
        prog(q, k, v, v)
    assert isinstance(attnc.ArgumentError("x"), TypeError)


def test_dims(qkv):
    q, k, v = qkv
    prog = attnc.compile(SDPA)
    np.testing.assert_array_equal(prog.run(q, k, v, dims={"S": 16}), prog(q, k, v))
    with pytest.raises(attnc.ShapeError, match="no dimension named `Z`"):
        prog.run(q, k, v, dims={"Z": 3})
    with pytest.raises(attnc.ShapeError):
        prog.run(q, k, v, dims={"S": 17})
    with pytest.raises(attnc.RunError, match="more than 268435456 elements"):
        prog.random_inputs(dims={"S": 1 << 40})


def test_huge_sizes_fail_cleanly():
    prog = attnc.compile("fn outer(x: f32[N, 1]) -> f32[N, N] { return x @ x.T }")
    with pytest.raises(attnc.RunError, match="elements|allocate"):
        prog(np.zeros((300_000, 1), dtype=np.float32))  # 9e10 results: refused, not attempted


def test_bad_source():
    with pytest.raises(attnc.CompileError) as e:
        attnc.compile("fn f(x: f32[N]) -> f32[N] {\n    return x + y\n}")
    err = e.value
    assert err.code == "E0101"
    assert "unknown name `y`" in str(err) and "return x + y" in str(err)
    (d,) = err.diagnostics
    assert (d["line"], d["column"], d["code"], d["severity"]) == (2, 16, "E0101", "error")
    with pytest.raises(attnc.CompileError):
        attnc.compile("fn f(" + "(" * 100_000)
    with pytest.raises(attnc.CompileError):
        attnc.compile("fn f(x: f32[N]) -> f32[N] { return " + "-" * 200_000 + "x }")
    with pytest.raises(attnc.CompileError):
        attnc.compile("\x00\xff garbage {")


def test_bad_compile_arguments(tmp_path):
    with pytest.raises(attnc.ArgumentError, match="no function named `nope`"):
        attnc.compile(SDPA, entry="nope")
    with pytest.raises(attnc.ArgumentError, match="unknown target `tpu`"):
        attnc.compile(SDPA, target="tpu")
    with pytest.raises(attnc.ArgumentError, match="unknown stage"):
        attnc.compile(SDPA).emit("asm")
    with pytest.raises(attnc.ArgumentError, match="threads"):
        attnc.compile(SDPA, threads=-1)
    with pytest.raises(attnc.ArgumentError):
        attnc.compile(42)
    with pytest.raises(FileNotFoundError):
        attnc.compile(tmp_path / "missing.attn")
    with pytest.raises(attnc.CompileError, match="defines no function") as e:
        attnc.compile("dim D = 4")
    assert e.value.code == "E0112"


def test_cuda_without_a_gpu_is_a_clear_error(qkv):
    prog = attnc.compile(SDPA, target="cuda")
    try:
        out = prog(*qkv)
    except attnc.RunError as e:
        assert "CUDA" in str(e) or "GPU" in str(e) or "NVRTC" in str(e) or "driver" in str(e)
    else:  # a machine with a GPU: then it must agree
        np.testing.assert_allclose(out, sdpa_ref(*qkv), rtol=1e-3, atol=1e-4)


def test_errors_leave_the_interpreter_usable(qkv):
    prog = attnc.compile(SDPA)
    for _ in range(200):
        with pytest.raises(attnc.AttncError):
            prog(qkv[0], qkv[1], qkv[2][0])
    gc.collect()
    np.testing.assert_allclose(prog(*qkv), sdpa_ref(*qkv), rtol=1e-4, atol=1e-5)


# ---- gradients ----------------------------------------------------------------------------


def test_grad_program_matches_numpy_backward():
    rng = np.random.default_rng(11)
    q, k, v, d_out = (randn(rng, 1, 2, 19, 8) for _ in range(4))
    grad = attnc.compile(SDPA).grad()
    assert grad.entry == "sdpa_grad"
    assert [n for n, _, _ in grad.params] == ["q", "k", "v", "d_out"]
    assert [n for n, _, _ in grad.outputs] == ["out", "d_q", "d_k", "d_v"]
    out, d_q, d_k, d_v = grad(q, k, v, d_out)
    scale = 1 / np.sqrt(8.0)
    p = softmax(q.astype(np.float64) @ np.swapaxes(k, -1, -2) * scale)
    dp = d_out.astype(np.float64) @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    want = [p @ v, ds @ k * scale, np.swapaxes(ds, -1, -2) @ q * scale, np.swapaxes(p, -1, -2) @ d_out]
    for got, w in zip((out, d_q, d_k, d_v), want):
        assert_normwise_close(got, w)


def test_grad_wrt_and_errors():
    prog = attnc.compile(EXAMPLES / "alibi.attn")
    only = prog.grad(wrt=["slopes"])
    assert [n for n, _, _ in only.outputs] == ["out", "d_slopes"]
    assert prog.grad(wrt=["slopes"])._compiled._identity == only._compiled._identity
    inputs = only.random_inputs(seed=3, dims={"S": 12})
    out, d_slopes = only(**inputs)
    assert d_slopes.shape == (inputs["slopes"].shape[0],) and np.isfinite(d_slopes).all()
    with pytest.raises(attnc.ArgumentError, match="no parameter has that name"):
        prog.grad(wrt=["slope"])
    with pytest.raises(attnc.ArgumentError, match="only floating-point parameters"):
        attnc.compile(EXAMPLES / "document_mask.attn").grad(wrt=["seg"])
