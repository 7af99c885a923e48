"""Fused attention dropout through ``attnc.torch.sdpa(dropout_p=...)``: against a float64
reference whose keep mask comes from an independent NumPy Philox4x32-10 of the documented
counter layout, forward and gradients; the keep rate; repeatability under ``torch.manual_seed``;
``torch.compile``. Skipped without torch."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import attnc.torch as at  # noqa: E402


def philox(ctr: np.ndarray, key0: int) -> np.ndarray:
    """Philox4x32-10 of counters ``ctr`` (``[..., 4]`` uint64 holding u32) under key ``(key0, 0)``."""
    c = [ctr[..., n].astype(np.uint64) for n in range(4)]
    k0, k1 = np.uint64(key0 & 0xFFFFFFFF), np.uint64(0)
    mask = np.uint64(0xFFFFFFFF)
    for r in range(10):
        if r:
            k0 = (k0 + np.uint64(0x9E3779B9)) & mask
            k1 = (k1 + np.uint64(0xBB67AE85)) & mask
        p0 = np.uint64(0xD2511F53) * c[0]
        p1 = np.uint64(0xCD9E8D57) * c[2]
        c = [((p1 >> np.uint64(32)) ^ c[1] ^ k0) & mask, p1 & mask, ((p0 >> np.uint64(32)) ^ c[3] ^ k1) & mask, p0 & mask]
    return np.stack(c, axis=-1)


def keep_factor(seed: int, shape, p: float) -> torch.Tensor:
    """Dropout's factor on every weight of ``shape`` (``[..., L, S]``): key ``j = 64 b + 16 w + l``
    takes word ``w`` of counter ``(16 b + l, i, batch, 0)``; kept when its top 24 bits reach
    ``ceil(p 2^24)``, then scaled by ``1 / (1 - p)`` rounded to float32."""
    *lead, m, n = shape
    batch = int(np.prod(lead)) if lead else 1
    bb, ii, jj = np.meshgrid(np.arange(batch), np.arange(m), np.arange(n), indexing="ij")
    ctr = np.stack([((jj >> 6) << 4) | (jj & 15), ii, bb, np.zeros_like(jj)], axis=-1).astype(np.uint64)
    words = philox(ctr, seed)
    w = np.take_along_axis(words, ((jj >> 4) & 3)[..., None].astype(np.int64), axis=-1)[..., 0]
    kept = (w >> np.uint64(8)) >= np.uint64(int(np.ceil(p * 2**24)))
    scale = float(np.float32(1.0 / (1.0 - p)))
    return torch.from_numpy(np.where(kept, scale, 0.0).reshape(shape))


def test_dropout_matches_its_definition_forward_and_backward():
    g = torch.Generator().manual_seed(3)
    b, h, L, S, E, p, seed = 2, 3, 37, 150, 16, 0.3, 12345
    q, k, v = (torch.randn(b, h, n, E, generator=g, requires_grad=True) for n in (L, S, S))
    for causal in (False, True):
        out = at._sdpa(q, k, v, None, p, causal, None, False, None, None, torch.tensor(seed, dtype=torch.int32))
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        s = qd @ kd.transpose(-1, -2) / E**0.5
        if causal:
            s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
        want = (torch.softmax(s, -1) * keep_factor(seed, (b, h, L, S), p)) @ vd
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-6)
        cot = torch.randn(out.shape, generator=g)
        got = torch.autograd.grad(out, (q, k, v), cot)
        ref = torch.autograd.grad(want, (qd, kd, vd), cot.double())
        for a, r in zip(got, ref):
            torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=5e-6)


def test_dropout_keeps_one_minus_p_and_repeats_under_manual_seed():
    # Uniform weights over S keys against V = I: out[i, j] = z_ij / S, the mask itself.
    L = S = 256
    q = torch.zeros(1, 2, L, S)
    v = torch.eye(S).expand(1, 2, S, S).contiguous()
    torch.manual_seed(0)
    a = at.sdpa(q, q, v, dropout_p=0.25) * S
    b = at.sdpa(q, q, v, dropout_p=0.25) * S
    torch.manual_seed(0)
    again = at.sdpa(q, q, v, dropout_p=0.25) * S
    assert torch.equal(a, again), "the same torch seed gives another mask"
    assert not torch.equal(a, b), "two calls drew the same mask"
    kept = (a > 0.5).double().mean().item()
    assert abs(kept - 0.75) < 5 * (0.75 * 0.25 / a.numel()) ** 0.5, kept
    torch.testing.assert_close(a[a > 0.5], torch.full_like(a[a > 0.5], 1 / 0.75))


def test_dropout_under_torch_compile_keeps_its_mask_in_the_backward():
    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            return at.sdpa(q, k, v, dropout_p=0.2, is_causal=True)

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g, requires_grad=True) for _ in range(3))
    compiled = torch.compile(Block(), fullgraph=True, backend="aot_eager")
    torch.manual_seed(7)
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    # The eager call with the same torch seed draws the same dropout seed, so the same mask.
    torch.manual_seed(7)
    want = Block()(q, k, v)
    torch.testing.assert_close(out, want)
    for a, r in zip(grads, torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=5e-6)


def test_dropout_with_sinks_fuses_the_log_sum_exp_too():
    # gpt-oss's sinks with attention dropout: the sink joins each denominator, the weights
    # (over the keys) drop; the sinks' gradient included.
    g = torch.Generator().manual_seed(4)
    b, h, L, E, p, seed = 1, 3, 40, 8, 0.25, 99
    q, k, v = (torch.randn(b, h, L, E, generator=g, requires_grad=True) for _ in range(3))
    sinks = torch.randn(h, generator=g, requires_grad=True)
    out = at._sdpa(q, k, v, None, p, True, None, False, None, sinks, torch.tensor(seed, dtype=torch.int32))
    qd, kd, vd, sd = (t.detach().double().requires_grad_() for t in (q, k, v, sinks))
    s = (qd @ kd.transpose(-1, -2) / E**0.5).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    logits = torch.cat([s, sd.reshape(1, h, 1, 1).expand(b, h, L, 1)], dim=-1)
    w = torch.softmax(logits, dim=-1)[..., :-1]
    want = (w * keep_factor(seed, (b, h, L, L), p)) @ vd
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-6)
    cot = torch.randn(out.shape, generator=g)
    for a, r in zip(torch.autograd.grad(out, (q, k, v, sinks), cot), torch.autograd.grad(want, (qd, kd, vd, sd), cot.double())):
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=5e-6)
