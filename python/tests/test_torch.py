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


def test_bad_tensors():
    q, k, v = qkv(1, 1, 16, 8, seed=4)
    prog = attnc.compile(EXAMPLES / "sdpa.attn")
    # float64 is rounded to the parameter's f32, as the command line rounds it.
    torch.testing.assert_close(prog(q, k, v.double()), prog(q, k, v), rtol=0, atol=0)
    with pytest.raises(attnc.DTypeError, match="bfloat16"):
        prog(q, k, v.bfloat16())
    with pytest.raises(attnc.LayoutError):
        prog(q, k.transpose(2, 3).contiguous().transpose(2, 3), v)
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
