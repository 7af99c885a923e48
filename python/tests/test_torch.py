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
    with pytest.raises(attnc.DTypeError, match="float64"):
        prog(q, k, v.double())
    with pytest.raises(attnc.DTypeError, match="bfloat16"):
        prog(q, k, v.bfloat16())
    with pytest.raises(attnc.LayoutError):
        prog(q, k.transpose(2, 3).contiguous().transpose(2, 3), v)
    with pytest.raises(attnc.ShapeError):
        prog(q, k, v[0])


def test_autograd_function_runs_forward_and_names_the_missing_backward():
    q, k, v = qkv(1, 2, 16, 8, seed=5, requires_grad=True)
    attention = attnc.torch.attention(attnc.compile(EXAMPLES / "sdpa.attn"))
    out = attention(q, k, v=v)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v), rtol=1e-4, atol=1e-5)
    assert out.requires_grad
    with pytest.raises(NotImplementedError, match="backward pass"):
        out.sum().backward()
    with torch.no_grad():
        assert not attention(q, k, v).requires_grad
    with pytest.raises(attnc.ArgumentError, match="missing input"):
        attention(q, k)
