"""``attnc.torch.varlen_attention``: FlashAttention's ``flash_attn_varlen_func`` conventions on a
ragged batch packed without padding, against torch attention run sequence by sequence in
float64 (bottom-right aligned causality, grouped-query heads), forward and gradients. Skipped
without torch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import attnc  # noqa: E402
import attnc.torch as at  # noqa: E402


def reference(q, k, v, cu_q, cu_k, causal, scale):
    """Each sequence alone: float64 softmax attention, K/V heads repeated for the groups."""
    outs = []
    groups = q.shape[1] // k.shape[1]
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s] : cu_q[s + 1]].double().transpose(0, 1)
        ks = k[cu_k[s] : cu_k[s + 1]].double().repeat_interleave(groups, dim=1).transpose(0, 1)
        vs = v[cu_k[s] : cu_k[s + 1]].double().repeat_interleave(groups, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * scale
        if causal:
            lq, lk = qs.shape[1], ks.shape[1]
            # Bottom-right: query x sees keys up to lk - lq + x.
            masked = torch.arange(lk)[None, :] > (torch.arange(lq)[:, None] + lk - lq)
            scores = scores.masked_fill(masked, float("-inf"))
        outs.append((torch.softmax(scores, dim=-1) @ vs).transpose(0, 1))
    return torch.cat(outs, dim=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_matches_attention_run_sequence_by_sequence(causal, heads):
    g = torch.Generator().manual_seed(5)
    lens_q, lens_k = [3, 40, 1, 70], [30, 100, 1, 70]
    cu_q = [0] + list(torch.tensor(lens_q).cumsum(0).tolist())
    cu_k = [0] + list(torch.tensor(lens_k).cumsum(0).tolist())
    h, hk = heads
    q = torch.randn(cu_q[-1], h, 16, generator=g, requires_grad=True)
    k = torch.randn(cu_k[-1], hk, 16, generator=g, requires_grad=True)
    v = torch.randn(cu_k[-1], hk, 12, generator=g, requires_grad=True)
    out = at.varlen_attention(q, k, v, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), causal=causal)
    want = reference(q, k, v, cu_q, cu_k, causal, 16**-0.5)
    assert out.shape == (cu_q[-1], h, 12)
    assert float((out.detach().double() - want.detach()).abs().max()) < 1e-5
    cot = torch.randn(want.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out.double() * cot).sum(), (q, k, v))
    ref = torch.autograd.grad((want * cot).sum(), (q, k, v))
    for a, b in zip(got, ref):
        assert float((a.double() - b).abs().max()) < 1e-4 * max(1.0, float(b.abs().max()))


def test_one_program_serves_every_batch():
    # Differently cut batches reuse one compiled program; the tiles follow each batch's tables.
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(64, 2, 8, generator=g) for _ in range(3))
    before = len(at._VARLEN_PROGRAMS)
    for cuts in ([0, 64], [0, 1, 30, 64], [0, 32, 64]):
        cu = torch.tensor(cuts)
        out = at.varlen_attention(q, k, v, cu, cu, causal=True, softmax_scale=0.5)
        assert float((out.double() - reference(q, k, v, cuts, cuts, True, 0.5)).abs().max()) < 1e-5
    assert len(at._VARLEN_PROGRAMS) <= before + 1


def test_bad_tables_are_clear_errors():
    q = torch.randn(5, 2, 8)
    with pytest.raises(attnc.ShapeError, match="cu_seqlens_q"):
        at.varlen_attention(q, q, q, torch.tensor([0, 4]), torch.tensor([0, 5]))
    with pytest.raises(attnc.ShapeError, match="as many sequences"):
        at.varlen_attention(q, q, q, torch.tensor([0, 5]), torch.tensor([0, 2, 5]))
    with pytest.raises(attnc.ShapeError, match="no more queries than keys"):
        at.varlen_attention(q, q[:3], q[:3], torch.tensor([0, 5]), torch.tensor([0, 3]), causal=True)


def test_torch_compile_traces_it_without_a_graph_break():
    # The registered op `attnc::varlen` (fullgraph: a break raises): values and gradients as
    # eager; the sequence tables are inputs, so another batch needs no new program.
    def attend(q, k, v, cu_q, cu_k):
        return at.varlen_attention(q * 2.0, k, v, cu_q, cu_k, causal=True).sum(-1)

    g = torch.Generator().manual_seed(7)
    cu_q, cu_k = torch.tensor([0, 3, 43], dtype=torch.int32), torch.tensor([0, 30, 130], dtype=torch.int32)
    q = torch.randn(43, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(130, 2, 16, generator=g, requires_grad=True) for _ in range(2))
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v, cu_q, cu_k), attend(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)
    other = torch.tensor([0, 20, 43], dtype=torch.int32), torch.tensor([0, 65, 130], dtype=torch.int32)
    torch.testing.assert_close(compiled(q, k, v, *other), attend(q, k, v, *other), rtol=1e-5, atol=2e-6)
    torch.library.opcheck(torch.ops.attnc.varlen.default, (q, k, v, cu_q, cu_k, True, None))


def test_the_compiled_backward_reads_what_the_forward_saved(graph_recorder):
    # With gradients, the compiled forward is `attnc::varlen_saving` (the result, the flash
    # output and its log-sum-exp); the backward graph reads them and runs no forward again.
    # Values and gradients as eager, in float32 and bfloat16.
    backend, graphs = graph_recorder
    g = torch.Generator().manual_seed(11)
    cu_q, cu_k = torch.tensor([0, 5, 37], dtype=torch.int32), torch.tensor([0, 9, 70], dtype=torch.int32)
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(37, 4, 16, generator=g).to(dtype).requires_grad_()
        k, v = (torch.randn(70, 2, 16, generator=g).to(dtype).requires_grad_() for _ in range(2))

        def attend(q, k, v, cu_q, cu_k):
            return at.varlen_attention(q, k, v, cu_q, cu_k, causal=True)

        torch._dynamo.reset()
        compiled = torch.compile(attend, fullgraph=True, backend=backend)
        got, want = compiled(q, k, v, cu_q, cu_k), attend(q, k, v, cu_q, cu_k)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        cot = torch.randn(got.shape, generator=g).to(dtype)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), cot), torch.autograd.grad(want, (q, k, v), cot)):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        assert any("varlen_saving" in t for t in graphs["fw"]), graphs["fw"]
        assert any("varlen_backward" in t for t in graphs["bw"]), graphs["bw"]
        assert not any("varlen_saving" in t or t.endswith("attnc.varlen.default") for t in graphs["bw"]), graphs["bw"]
    saved = torch.ops.attnc.varlen_saving(q.float(), k.float(), v.float(), cu_q, cu_k, True, None)
    assert [tuple(t.shape) for t in saved] == [(37, 4, 16), (2, 2, 37, 16), (2, 2, 37)]
    torch.library.opcheck(torch.ops.attnc.varlen_saving.default, (q.float(), k.float(), v.float(), cu_q, cu_k, True, None))
