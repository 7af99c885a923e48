"""``attnc.torch.flex_attention`` on the score and mask functions of the attention-gym
collection: forward against torch's own ``flex_attention`` (CPU, eager) and, with gradients
(torch has no CPU backward), against the same attention in eager PyTorch. Tracing errors name
the construct. Skipped without torch."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention as torch_flex  # noqa: E402

import attnc  # noqa: E402
import attnc.torch as at  # noqa: E402

warnings.filterwarnings("ignore", message=".*flex_attention.*")
B, H, L, S, E = 2, 4, 33, 33, 16
SLOPES = torch.rand(H, generator=torch.Generator().manual_seed(3)).requires_grad_()
TABLE = torch.randn(2 * S - 1, generator=torch.Generator().manual_seed(4)).requires_grad_()
HEAD_BIAS = torch.randn(H, L, S, generator=torch.Generator().manual_seed(5)).requires_grad_()
DOCS = torch.tensor([0] * 10 + [1] * 15 + [2] * 8)

# name: (score_mod, mask_mod, captured tensors with gradients)
CASES = {
    "alibi": (lambda s, b, h, qi, ki: s + SLOPES[h] * (ki - qi), lambda b, h, qi, ki: qi >= ki, [SLOPES]),
    "soft-capping": (lambda s, b, h, qi, ki: 20.0 * torch.tanh(s / 20.0), None, []),
    "sliding window": (None, lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= 8), []),
    "prefix lm": (None, lambda b, h, qi, ki: (ki <= 5) | (qi >= ki), []),
    "document mask": (None, lambda b, h, qi, ki: (DOCS[qi] == DOCS[ki]) & (qi >= ki), []),
    "relative position bias": (lambda s, b, h, qi, ki: s + TABLE[qi - ki + S - 1], None, [TABLE]),
    "causal, learned bias table": (lambda s, b, h, qi, ki: s + HEAD_BIAS[h, qi, ki], lambda b, h, qi, ki: qi >= ki, [HEAD_BIAS]),
    "chunked (floor division)": (None, lambda b, h, qi, ki: qi // 8 == ki // 8, []),
}


def eager(q, k, v, score_mod, mask_mod):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    b, h = torch.arange(B)[:, None, None, None], torch.arange(H)[None, :, None, None]
    i, j = torch.arange(L)[None, None, :, None], torch.arange(S)[None, None, None, :]
    if score_mod is not None:
        s = score_mod(s, b, h, i, j)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, i, j).expand_as(s), float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("heads_kv", [H, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", list(CASES))
def test_flex_attention_matches_torch_and_eager_with_gradients(name, heads_kv):
    score_mod, mask_mod, captured = CASES[name]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, E, generator=g).requires_grad_()
    k, v = (torch.randn(B, heads_kv, S, E, generator=g).requires_grad_() for _ in range(2))
    gqa = heads_kv != H
    ours = at.create_block_mask(mask_mod, None, None, L, S) if mask_mod else None
    theirs = torch_block_mask(mask_mod, None, None, L, S, device="cpu") if mask_mod else None
    got = at.flex_attention(q, k, v, score_mod=score_mod, block_mask=ours, enable_gqa=gqa)
    with torch.no_grad():
        flex = torch_flex(q.detach(), k.detach(), v.detach(), score_mod=score_mod, block_mask=theirs, enable_gqa=gqa)
    torch.testing.assert_close(got.detach(), flex, rtol=1e-5, atol=5e-6)
    want = eager(q, k, v, score_mod, mask_mod)
    cot = torch.randn(want.shape, generator=g)
    inputs = (q, k, v, *captured)
    for a, b in zip(torch.autograd.grad(got, inputs, cot), torch.autograd.grad(want, inputs, cot)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)
    # torch's own BlockMask works as well.
    if theirs is not None:
        with torch.no_grad():
            torch.testing.assert_close(at.flex_attention(q, k, v, score_mod=score_mod, block_mask=theirs, enable_gqa=gqa), got.detach())


def test_one_compile_serves_every_sequence_length():
    at._FLEX_PROGRAMS.clear()
    mask = at.create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= 16), None, None, 64, 64)
    for s in (7, 64, 300):
        q = torch.randn(1, 2, s, 16)
        with torch.no_grad():
            want = eager_window(q, 16)
            torch.testing.assert_close(at.flex_attention(q, q, q, block_mask=mask), want, rtol=1e-5, atol=5e-6)
    assert len(at._FLEX_PROGRAMS) == 1


def eager_window(q, w):
    s = (q @ q.transpose(-1, -2)) / q.shape[-1] ** 0.5
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(q.shape[2])[None, :]
    return torch.softmax(s.masked_fill(~((i >= j) & (i - j <= w)), float("-inf")), -1) @ q


def test_what_cannot_be_traced_is_an_error_that_names_it():
    q = torch.randn(1, 2, 8, 16)

    def python_if(s, b, h, qi, ki):
        return s if qi > ki else -s

    with pytest.raises(attnc.ArgumentError, match="Python bool"):
        at.flex_attention(q, q, q, score_mod=python_if)
    with pytest.raises(attnc.ArgumentError, match="erf"):
        at.flex_attention(q, q, q, score_mod=lambda s, b, h, qi, ki: torch.special.erf(s))
    with pytest.raises(attnc.ArgumentError, match="used whole"):
        at.flex_attention(q, q, q, score_mod=lambda s, b, h, qi, ki: s + torch.ones(3))
    with pytest.raises(attnc.ArgumentError, match="return a bool"):
        at.flex_attention(q, q, q, block_mask=at.create_block_mask(lambda b, h, qi, ki: qi - ki, None, None, 8, 8))


@pytest.mark.parametrize("heads_kv", [H, 2], ids=["mha", "gqa"])
def test_return_lse_is_torchs(heads_kv):
    score_mod, mask_mod, _ = CASES["alibi"]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, L, E, generator=g)
    k, v = (torch.randn(B, heads_kv, S, E, generator=g) for _ in range(2))
    gqa = heads_kv != H
    with torch.no_grad():
        out, lse = at.flex_attention(q, k, v, score_mod=score_mod, block_mask=at.create_block_mask(mask_mod, None, None, L, S), enable_gqa=gqa, return_lse=True)
        want_out, want_lse = torch_flex(
            q, k, v, score_mod=score_mod, block_mask=torch_block_mask(mask_mod, None, None, L, S, device="cpu"), enable_gqa=gqa, return_lse=True
        )
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=5e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=5e-6)
    # With gradients the output is differentiable and the lse the same.
    qg = q.clone().requires_grad_()
    out2, lse2 = at.flex_attention(qg, k, v, score_mod=score_mod, block_mask=at.create_block_mask(mask_mod, None, None, L, S), enable_gqa=gqa, return_lse=True)
    assert out2.requires_grad and not lse2.requires_grad
    torch.testing.assert_close(lse2, want_lse, rtol=1e-5, atol=5e-6)


def test_examples_lse_merge_joins_two_partial_attentions_exactly():
    from pathlib import Path

    merge = attnc.compile(Path(__file__).resolve().parents[2] / "examples" / "lse_merge.attn")
    g = torch.Generator().manual_seed(6)
    q = torch.randn(B, H, L, E, generator=g)
    k, v = (torch.randn(B, H, S, E, generator=g) for _ in range(2))
    with torch.no_grad():
        o1, l1 = at.flex_attention(q, k[:, :, :20], v[:, :, :20], return_lse=True)
        o2, l2 = at.flex_attention(q, k[:, :, 20:], v[:, :, 20:], return_lse=True)
        out, lse = merge(o1, l1, o2, l2)
        want, want_lse = at.flex_attention(q, k, v, return_lse=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=2e-6)
    # A part that saw no key contributes nothing.
    empty = torch.full_like(l1, float("-inf"))
    again, lse_again = merge(o1, l1, torch.zeros_like(o2), empty)
    torch.testing.assert_close(again, o1)
    torch.testing.assert_close(lse_again, l1)


@pytest.mark.parametrize("name", ["alibi", "soft-capping", "document mask", "relative position bias", "chunked (floor division)"])
def test_torch_compile_traces_flex_attention_without_a_graph_break(name):
    # The traced program runs as the registered ops `attnc::program(_saving)` (fullgraph: a break raises),
    # with the captured tensors as its inputs: the same values and gradients as eager.
    score_mod, mask_mod, captured = CASES[name]

    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            mask = at.create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2]) if mask_mod else None
            return at.flex_attention(q * 2.0, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=True).sum(-1)

    g = torch.Generator().manual_seed(6)
    q = torch.randn(B, H, L, E, generator=g).requires_grad_()
    k, v = (torch.randn(B, 2, S, E, generator=g).requires_grad_() for _ in range(2))
    compiled = torch.compile(Block(), fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v), Block()(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    inputs = (q, k, v, *captured)
    for a, b in zip(torch.autograd.grad(got.sum(), inputs), torch.autograd.grad(want.sum(), inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)


def test_torch_compile_traces_return_lse():
    score_mod = CASES["alibi"][0]

    def attend(q, k, v):
        return at.flex_attention(q, k, v, score_mod=score_mod, return_lse=True)

    q, k, v = (torch.randn(B, H, L, E) for _ in range(3))
    got = torch.compile(attend, fullgraph=True, backend="aot_eager")(q, k, v)
    want = attend(q, k, v)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_the_flex_programs_op_passes_torch_opcheck():
    from attnc._ops import _flex_key
    from attnc._trace import Tracer, trace

    tracer = Tracer()
    mod = trace(CASES["alibi"][0], ("scores", "b", "h", "i", "j"), ("f", "i", "i", "i", "i"), tracer, "score_mod")
    slopes = SLOPES.detach().requires_grad_()
    key = _flex_key(at._flex_source("f32", False, None, mod, None, ((torch.float32, 1),)), False)
    q, k, v = (torch.randn(B, H, L, E, requires_grad=True) for _ in range(3))
    for op in (torch.ops.attnc.program.default, torch.ops.attnc.program_saving.default):
        torch.library.opcheck(op, (key, [q, k, v, slopes]))
