"""PyTorch tensors in and out, against torch's own attention. Skipped without torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import attnc  # noqa: E402
import attnc.torch  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def qkv(*shape, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g, requires_grad=requires_grad) for _ in range(3))


def test_sdpa_matches_torch():
    q, k, v = qkv(2, 4, 100, 32)
    out = attnc.compile(EXAMPLES / "sdpa.attn")(q, k, v)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == q.shape
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def test_causal_matches_torch():
    q, k, v = qkv(1, 2, 129, 64, seed=1)
    out = attnc.compile(EXAMPLES / "causal.attn")(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def test_tensors_are_read_in_place():
    q, k, v = qkv(1, 2, 16, 8, seed=2)
    prog = attnc.compile(EXAMPLES / "sdpa.attn")
    arrays = [attnc._as_array(t)[0] for t in (q, k, v)]
    assert prog._compiled._input_addresses(tuple(arrays)) == [t.data_ptr() for t in (q, k, v)]


def test_mixed_numpy_and_torch_inputs_give_torch():
    q, k, v = qkv(1, 1, 16, 8, seed=3)
    out = attnc.compile(EXAMPLES / "sdpa.attn")(q.numpy(), k, v=v.numpy())
    assert isinstance(out, torch.Tensor)


def test_tensors_as_they_come():
    q, k, v = qkv(1, 2, 16, 8, seed=4)
    prog = attnc.compile(EXAMPLES / "sdpa.attn")
    want = prog(q, k, v)
    # float64 is rounded to the parameter's f32, as the command line rounds it.
    torch.testing.assert_close(prog(q, k, v.double()), want, rtol=0, atol=0)
    # Any strides: a transposed view, a stride-0 broadcast; copied once in the binding.
    transposed = k.transpose(2, 3).contiguous().transpose(2, 3)
    torch.testing.assert_close(prog(q, transposed, v), want, rtol=0, atol=0)
    broadcast = k[:, :1].expand(k.shape)
    torch.testing.assert_close(prog(q, broadcast, v), prog(q, broadcast.contiguous(), v), rtol=0, atol=0)
    capsules = [attnc._as_array(t)[0] for t in (q, transposed, v)]
    addresses = prog._compiled._input_addresses(tuple(capsules))
    assert addresses[0] == q.data_ptr() and addresses[2] == v.data_ptr() and addresses[1] != transposed.data_ptr()
    # bfloat16 and float16 widen exactly into an f32 parameter.
    for dtype in (torch.bfloat16, torch.float16):
        low = [t.to(dtype) for t in (q, k, v)]
        torch.testing.assert_close(prog(*low), prog(*[t.float() for t in low]), rtol=0, atol=0)


def test_results_go_into_the_callers_tensors():
    q, k, v = qkv(1, 2, 16, 8, seed=5)
    prog = attnc.compile(EXAMPLES / "sdpa.attn")
    want = prog(q, k, v)
    out = torch.full_like(want, float("nan"))
    assert prog.run(q, k, v, out=out) is out
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # transformers' layout, chosen by the caller: [B, S, H, D] memory seen as [B, H, S, D].
    seq_major = torch.zeros(1, 16, 2, 8)
    prog.run(q, k, v, out=seq_major.transpose(1, 2))
    torch.testing.assert_close(seq_major, want.transpose(1, 2), rtol=0, atol=0)
    low = torch.zeros(want.shape, dtype=torch.bfloat16)
    prog.run(q, k, v, out=low)
    torch.testing.assert_close(low, want.bfloat16(), rtol=0, atol=0)
    # No gradients through out= (as torch's out= arguments): refused, and the buffer untouched.
    with pytest.raises(attnc.ArgumentError, match="records no gradients"):
        prog.run(q.requires_grad_(), k, v, out=out)
    with pytest.raises(attnc.ArgumentError, match="records no gradients"):
        prog.run(q.detach(), k, v, out=torch.zeros(want.shape, requires_grad=True))
    with torch.no_grad():
        prog.run(q, k, v, out=out)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    with pytest.raises(attnc.ShapeError, match="but the result is"):
        prog.run(q.detach(), k, v, out=torch.zeros(1, 2, 16, 4))


def test_bfloat16_programs_take_and_give_bfloat16():
    double = attnc.compile("fn double(x: bf16[N]) -> bf16[N] {\n    return x + x\n}\n")
    x = torch.randn(64).bfloat16()
    out = double(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, x + x, rtol=0, atol=0)
    with pytest.raises(attnc.DTypeError, match="declared bf16"):
        double(x.float())


def test_bad_tensors():
    q, k, v = qkv(1, 1, 16, 8, seed=4)
    prog = attnc.compile(EXAMPLES / "sdpa.attn")
    with pytest.raises(attnc.DTypeError, match=r"int64 array was given; convert it .* x.float\(\) for torch") as e:
        prog(q, k, v.long())
    assert e.value.param == "v"
    with pytest.raises(attnc.DTypeError, match="complex64"):
        prog(q, k, torch.complex(v, v))
    with pytest.raises(attnc.ShapeError):
        prog(q, k, v[0])


def grads_of(fn, *inputs, seed=7):
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out * g).sum().backward()
    result = [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    return out.detach(), result


def test_gradients_match_torch_sdpa():
    q, k, v = qkv(2, 2, 37, 16, seed=5, requires_grad=True)
    attention = attnc.torch.attention(attnc.compile(EXAMPLES / "causal.attn"))
    out, got = grads_of(attention, q, k, v)
    want_out, want = grads_of(lambda *a: torch.nn.functional.scaled_dot_product_attention(*a, is_causal=True), q, k, v)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_alibi_slopes_get_their_gradient():
    B, H, S, D = 1, 4, 20, 8
    q, k, v = qkv(B, H, S, D, seed=6, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)

    def reference(q, k, v, slopes):
        i = torch.arange(S)[:, None]
        j = torch.arange(S)[None, :]
        bias = slopes[:, None, None] * (j - i)
        bias = bias.masked_fill(j > i, float("-inf"))
        return torch.softmax(q @ k.transpose(-1, -2) / D**0.5 + bias, dim=-1) @ v

    attention = attnc.torch.attention(attnc.compile(EXAMPLES / "alibi.attn"))
    out, got = grads_of(attention, q, k, v, slopes)
    want_out, want = grads_of(reference, q, k, v, slopes)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_only_the_inputs_that_need_gradients_get_them():
    q, k, v = qkv(1, 1, 9, 4, seed=8)
    v.requires_grad_(True)
    attention = attnc.torch.attention(attnc.compile(EXAMPLES / "sdpa.attn"))
    attention(q, k, v=v).sum().backward()
    assert v.grad is not None and q.grad is None and k.grad is None
    with torch.no_grad():
        assert not attention(q, k, v).requires_grad
    with pytest.raises(attnc.ArgumentError, match="missing input"):
        attention(q, k)


def test_a_plain_call_on_tensors_that_require_grad_is_differentiable():
    q, k, v = qkv(1, 2, 11, 8, seed=9, requires_grad=True)
    prog = attnc.compile(EXAMPLES / "causal.attn")
    out, got = grads_of(prog, q, k, v)
    want_out, want = grads_of(lambda *x: torch.nn.functional.scaled_dot_product_attention(*x, is_causal=True), q, k, v)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert not prog(q, k, v).requires_grad


def test_training_example_runs():
    import runpy
    import sys

    example = Path(__file__).resolve().parents[1] / "examples" / "train_alibi.py"
    argv = sys.argv
    sys.argv = [str(example), "--steps", "5"]
    try:
        runpy.run_path(str(example), run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None)
    finally:
        sys.argv = argv


def test_multi_threaded_runs_share_torchs_openmp_team():
    # attnc.torch hands multi-threaded CPU runs to PyTorch's OpenMP team (its threads spin
    # after PyTorch's parallel operations and would take the cores from attnc's own threads);
    # the team gives the bits attnc's own threads give, forward and backward.
    import os
    import subprocess
    import sys

    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("this PyTorch does not use OpenMP")
    path = attnc._attnc.shared_openmp()
    assert path is not None and os.path.basename(path).startswith(("libgomp", "libiomp5", "libomp"))
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        results = {}
        for mode in ("team", "own"):
            attnc._attnc.share_openmp(path if mode == "team" else None)
            q, k, v = qkv(2, 4, 150, 32, seed=7, requires_grad=True)
            out = attnc.torch.sdpa(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))
            results[mode] = [out.detach(), q.grad, k.grad, v.grad]
        for a, b in zip(results["team"], results["own"]):
            assert torch.equal(a, b)
    finally:
        attnc._attnc.share_openmp(path)
        torch.set_num_threads(threads)
    # A library that is not loaded is refused and changes nothing; ATTNC_OPENMP=0 opts out.
    with pytest.raises(OSError, match="not an OpenMP runtime loaded"):
        attnc._attnc.share_openmp("/nonexistent/libgomp.so.1")
    assert attnc._attnc.shared_openmp() == path
    code = "import attnc, attnc.torch; print(attnc._attnc.shared_openmp())"
    env = dict(os.environ, ATTNC_OPENMP="0")
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip() == "None"


def test_torch_compile_traces_any_program_without_a_graph_break():
    # Any attnc.Program called in a compiled model is the registered op `attnc::program`
    # (fullgraph: a break raises): values and gradients as eager, a learned parameter's too,
    # and sizes torch.compile makes symbolic (a new length) evaluated from the program's dims.
    prog = attnc.compile(EXAMPLES / "alibi.attn")

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.slopes = torch.nn.Parameter(torch.rand(2))

        def forward(self, q, k, v):
            return prog(q * 2.0, k, v, self.slopes).sum(-1)

    block = Block()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    for s in (16, 40, 23):
        q, k, v = (t.requires_grad_() for t in qkv(1, 2, s, 8, seed=s))
        got, want = compiled(q, k, v), block(q, k, v)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
        inputs = (q, k, v, block.slopes)
        for a, b in zip(torch.autograd.grad(got.sum(), inputs), torch.autograd.grad(want.sum(), inputs)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)


def test_torch_compile_traces_programs_of_several_results_and_compound_dims():
    align = attnc.compile(EXAMPLES / "alignment.attn")
    split = attnc.compile("fn halves(x: f32[S, 2*D]) -> (a: f32[S, D], n: i32[S]) {\n    return x[:, 0::2] + x[:, 1::2], cast(x[:, 0] > 0.0, i32)\n}\n")

    def f(dec, enc, x):
        context, weights = align(dec, enc)
        a, n = split(x)
        return context.sum() + weights.sum() + a.sum() * n.sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    g = torch.Generator().manual_seed(2)
    for m, s in ((5, 9), (7, 12)):
        inputs = align.random_inputs(seed=m, dims={"M": m, "N": s})
        dec, enc = (torch.from_numpy(inputs[n]).requires_grad_() for n in ("dec", "enc"))
        x = torch.randn(s, 6, generator=g, requires_grad=True)
        got, want = compiled(dec, enc, x), f(dec, enc, x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(torch.autograd.grad(got, (dec, enc, x)), torch.autograd.grad(want, (dec, enc, x))):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # out= under torch.compile: the results copied into the caller's tensors, as eager writes them.
    x = torch.randn(4, 6, generator=g)
    a_out, n_out = torch.full((4, 3), float("nan"), dtype=torch.float64), torch.empty(4, dtype=torch.int32)
    into = torch.compile(lambda x, a, n: split.run(x, out=(a, n)), fullgraph=True, backend="aot_eager")
    got = into(x, a_out, n_out)
    assert got[0] is a_out and got[1] is n_out
    want = split(x)
    torch.testing.assert_close(a_out, want[0].double())
    assert torch.equal(n_out, want[1])
    only_a = torch.compile(lambda x, a: split.run(x, out=(a, None)), fullgraph=True, backend="aot_eager")
    a_out.fill_(float("nan"))
    got = only_a(x, a_out)
    assert got[0] is a_out and torch.equal(got[1], want[1])
    torch.testing.assert_close(a_out, want[0].double())
    for bad, match in (((torch.empty(3, 3), None), "shape"), ((None, torch.empty(4)), "does not hold")):
        with pytest.raises(Exception, match=match):
            torch.compile(lambda x: split.run(x, out=bad), fullgraph=True, backend="aot_eager")(x)
    with pytest.raises(Exception, match="records no gradients"):
        torch.compile(lambda x: split.run(x, out=(torch.empty(4, 3), None)), fullgraph=True, backend="aot_eager")(x.requires_grad_())
    with pytest.raises(Exception, match="dims= is not supported under torch.compile"):
        torch.compile(lambda x: split.run(x, dims={"S": 4}), fullgraph=True, backend="aot_eager")(torch.randn(3, 6))


def test_the_registered_program_op_passes_torch_opcheck():
    from attnc._ops import _program_key

    prog = attnc.compile(EXAMPLES / "alibi.attn")
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 16, 8, seed=3))
    torch.library.opcheck(torch.ops.attnc.program.default, (_program_key(prog), [q, k, v, torch.rand(2, requires_grad=True)]))


def test_under_torch_compile_the_backward_reads_what_the_forward_saved(graph_recorder):
    # With gradients, the forward is `attnc::program_saving` (the split forward: results plus
    # each flash op's output and log-sum-exp) and the backward `attnc::program_backward` on
    # them, so the backward graph holds no second forward.
    backend, graphs = graph_recorder
    prog = attnc.compile(EXAMPLES / "alibi.attn")
    slopes = torch.rand(2, requires_grad=True)
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 32, 8, seed=9))
    f = torch.compile(lambda q, k, v: prog(q, k, v, slopes), fullgraph=True, backend=backend)
    got = f(q, k, v)
    grads = torch.autograd.grad(got.sum(), (q, k, v, slopes))
    want = prog(q, k, v, slopes)
    for a, b in zip(grads, torch.autograd.grad(want.sum(), (q, k, v, slopes))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)
    assert any("program_saving" in t for t in graphs["fw"]), graphs["fw"]
    assert any("program_backward" in t for t in graphs["bw"]), graphs["bw"]
    assert not any(t.endswith("attnc.program.default") or "program_saving" in t for t in graphs["bw"]), graphs["bw"]
