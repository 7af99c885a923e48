"""``attnc.torch.sdpa`` against ``torch.nn.functional.scaled_dot_product_attention``: outputs and
gradients, masks of every layout, causality, scales, GQA, dtypes, and the errors. Skipped
without torch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import torch.nn.functional as F  # noqa: E402

import attnc  # noqa: E402
import attnc.torch as at  # noqa: E402

B, H, L, S, E = 2, 4, 13, 17, 8


def inputs(hk=H, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, hk, S, E, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, hk, S, E + 3, generator=g).to(dtype).requires_grad_()
    return q, k, v


def masks():
    g = torch.Generator().manual_seed(1)
    return {
        "none": None,
        "bool [L, S]": torch.rand(L, S, generator=g) > 0.3,
        "bool [B, 1, L, S]": torch.rand(B, 1, L, S, generator=g) > 0.3,
        "bool expanded": (torch.rand(1, 1, L, S, generator=g) > 0.3).expand(B, H, L, S),
        "float [B, H, L, S]": torch.randn(B, H, L, S, generator=g),
        "float [1, S]": torch.randn(1, S, generator=g),
    }


CASES = [
    (name, kw)
    for name in masks()
    for kw in ({}, {"scale": 0.3}, {"enable_gqa": True, "hk": 2}, {"enable_gqa": True, "hk": 1})
] + [("none", {"is_causal": True}), ("none", {"is_causal": True, "enable_gqa": True, "hk": 2})]


@pytest.mark.parametrize("mask_name,kw", CASES, ids=[f"{m}-{sorted(k.items())}" for m, k in CASES])
def test_sdpa_matches_torch_with_gradients(mask_name, kw):
    kw = dict(kw)
    q, k, v = inputs(hk=kw.pop("hk", H))
    mask = masks()[mask_name]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    got = at.sdpa(q, k, v, attn_mask=mask, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    cot = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), cot), torch.autograd.grad(want, (q, k, v), cot)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)


SEQ_MAJOR_CASES = [
    ("q, k, v", (True, True, True), {}),
    ("q, k, v causal GQA", (True, True, True), {"is_causal": True, "enable_gqa": True, "hk": 2}),
    ("q only, masked", (True, False, False), {"mask": True}),
    ("k and v, GQA folded", (False, True, True), {"enable_gqa": True, "hk": 2}),
]


@pytest.mark.parametrize("layout,kw", [c[1:] for c in SEQ_MAJOR_CASES], ids=[c[0] for c in SEQ_MAJOR_CASES])
def test_sequence_major_views_are_read_in_place(layout, kw):
    """transformers hands over ``[B, S, H, D]`` projections as ``[B, H, S, D]`` transposed
    views: without gradients they are read in place, and a sequence-major query gets its result
    written sequence-major (returned as the transposed view torch gives); outputs and gradients
    as torch's."""
    kw = dict(kw)
    hk, masked = kw.pop("hk", H), kw.pop("mask", False)
    g = torch.Generator().manual_seed(9)
    shapes = [(B, H, L, E), (B, hk, S, E), (B, hk, S, E + 3)]
    made = [
        torch.randn(b, n, h, e, generator=g).transpose(1, 2) if seq else torch.randn(b, h, n, e, generator=g)
        for (b, h, n, e), seq in zip(shapes, layout)
    ]
    q, k, v = (t.requires_grad_() if t.is_leaf else t for t in made)
    leaves = [t.requires_grad_() for t in made if t.is_leaf]
    mask = (torch.rand(B, 1, L, S, generator=g) > 0.3) if masked else None
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    at._SDPA_PROGRAMS.clear()
    with torch.no_grad():
        plain = at.sdpa(q, k, v, attn_mask=mask, **kw)
    torch.testing.assert_close(plain, want, rtol=1e-5, atol=2e-6)
    (key,) = at._SDPA_PROGRAMS
    fold = key[-2]
    assert key[-1] == (layout[0] and not fold, layout[1], layout[2])
    # The result is written in the query's memory order.
    assert plain.transpose(1, 2).is_contiguous() == (layout[0] and not fold)
    # With gradients, dense copies (the backward rereads rows, and strided ones alias in the
    # caches); outputs and gradients as torch's either way.
    got = at.sdpa(q, k, v, attn_mask=mask, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    assert (False, False, False) in {key[-1] for key in at._SDPA_PROGRAMS}
    cot = torch.randn_like(want)
    if leaves:
        for a, b in zip(torch.autograd.grad(got, leaves, cot), torch.autograd.grad(want, leaves, cot)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)


def test_grouped_query_heads_fold_into_rows_where_the_scores_ignore_them():
    """Grouped-query attention whose scores depend on neither the query's head nor its
    position (a decode step against a cache with a padding mask broadcast over heads and
    queries; no mask) runs each K/V head's query heads as rows of one attention: outputs and
    gradients as torch's. A causal call keeps the heads apart."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, 8, 1, E, generator=g).requires_grad_()
    k = torch.randn(B, 2, S, E, generator=g).requires_grad_()
    v = torch.randn(B, 2, S, E, generator=g).requires_grad_()
    pad = torch.ones(B, 1, 1, S, dtype=torch.bool)
    pad[0, ..., :3] = False
    at._SDPA_PROGRAMS.clear()
    for kw in ({"attn_mask": pad}, {}, {"attn_mask": torch.randn(1, S, generator=g)}):
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        got = at.sdpa(q, k, v, enable_gqa=True, **kw)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
        cot = torch.randn_like(want)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), cot), torch.autograd.grad(want, (q, k, v), cot)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)
    assert at._SDPA_PROGRAMS and all(key[-2] for key in at._SDPA_PROGRAMS), "every variant folded"
    at.sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert any(not key[-2] for key in at._SDPA_PROGRAMS), "a causal call is not folded"


def test_a_float_mask_gets_its_gradient():
    q, k, v = inputs()
    mask = torch.randn(1, H, L, S, requires_grad=True)
    cot = torch.randn(B, H, L, E + 3)
    (a,) = torch.autograd.grad(at.sdpa(q, k, v, attn_mask=mask), mask, cot)
    (b,) = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), mask, cot)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_types_run_and_keep_their_dtype(dtype, tol):
    q, k, v = (t.detach() for t in inputs(dtype=dtype))
    got = at.sdpa(q, k, v, is_causal=True)
    assert got.dtype == dtype
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_one_compile_serves_every_sequence_length():
    at._SDPA_PROGRAMS.clear()
    for s in (5, 64, 129):
        q, k, v = (torch.randn(1, 2, s, 16) for _ in range(3))
        with torch.no_grad():
            torch.testing.assert_close(at.sdpa(q, k, v, is_causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert len(at._SDPA_PROGRAMS) == 1


def test_what_it_cannot_do_is_an_error():
    q, k, v = (t.detach() for t in inputs())
    for p in (1.0, -0.1, "x"):
        with pytest.raises(attnc.ArgumentError, match="dropout_p"):
            at.sdpa(q, k, v, dropout_p=p)
    with pytest.raises(attnc.ArgumentError, match="is_causal"):
        at.sdpa(q, k, v, attn_mask=torch.ones(L, S, dtype=torch.bool), is_causal=True)
    with pytest.raises(attnc.DTypeError, match="float64"):
        at.sdpa(q.double(), k.double(), v.double())
    with pytest.raises(attnc.DTypeError, match="attn_mask"):
        at.sdpa(q, k, v, attn_mask=torch.ones(L, S, dtype=torch.int32))
    # Heads that differ without enable_gqa, as torch refuses them.
    q2, k2, v2 = (t.detach() for t in inputs(hk=2))
    with pytest.raises(attnc.ShapeError):
        at.sdpa(q2, k2, v2)


def test_torch_compile_traces_it_without_a_graph_break():
    class Block(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return at.sdpa(q * 2.0, k, v, attn_mask=mask, enable_gqa=True).sum(-1)

    compiled = torch.compile(Block(), fullgraph=True, backend="aot_eager")  # fullgraph: a break raises
    q, k, v = inputs(hk=2)
    mask = torch.randn(1, 1, L, S, requires_grad=True)
    got = compiled(q, k, v, mask)
    want = F.scaled_dot_product_attention(q * 2.0, k, v, attn_mask=mask, enable_gqa=True).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v, mask)), torch.autograd.grad(want.sum(), (q, k, v, mask))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)


def test_torch_compile_traces_sinks_with_their_gradient():
    # gpt-oss's sinks (attnc.hf's s_aux) through the registered op: no graph break, the same
    # values and gradients as eager.
    class Block(torch.nn.Module):
        def forward(self, q, k, v, sinks):
            return at._sdpa(q, k, v, None, 0.0, True, None, True, None, sinks).sum(-1)

    q, k, v = inputs(hk=2)
    sinks = torch.randn(H, requires_grad=True)
    compiled = torch.compile(Block(), fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v, sinks), Block()(q, k, v, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v, sinks)), torch.autograd.grad(want.sum(), (q, k, v, sinks))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)


def test_the_registered_op_passes_torch_opcheck():
    q, k, v = (t.detach() for t in inputs())
    for mask, causal in ((None, True), (torch.rand(L, S) > 0.3, False), (torch.randn(1, H, L, S), False)):
        torch.library.opcheck(torch.ops.attnc.sdpa.default, (q, k, v, mask, 0.0, causal, None, False, None))
    torch.library.opcheck(torch.ops.attnc.sdpa.default, (q, k, v, None, 0.0, True, None, False, None, torch.randn(H)))


def test_the_saving_op_passes_opcheck_and_the_backward_graph_holds_no_forward(graph_recorder):
    q, k, v = inputs(hk=2)
    mask = torch.randn(1, H, L, S, requires_grad=True)
    for m, causal in ((None, True), (mask, False)):
        torch.library.opcheck(torch.ops.attnc.sdpa_saving.default, (q, k, v, m, 0.0, causal, None, True, None))
    backend, graphs = graph_recorder
    f = torch.compile(lambda q, k, v, m: at.sdpa(q, k, v, attn_mask=m, enable_gqa=True), fullgraph=True, backend=backend)
    got, want = f(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v, mask)), torch.autograd.grad(want.sum(), (q, k, v, mask))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)
    assert any("sdpa_saving" in t for t in graphs["fw"]), graphs["fw"]
    assert any("sdpa_backward" in t for t in graphs["bw"]) and not any("sdpa_saving" in t or t.endswith("attnc.sdpa.default") for t in graphs["bw"]), graphs["bw"]


@pytest.mark.parametrize("hk", [H, 2], ids=["mha", "gqa"])
def test_masks_of_whole_blocks_match_torch_with_gradients(hk):
    # Masks as transformers builds them, long enough for several tiles: their tiles are
    # classified from the values (block bounds), on the CPU per batch index. Batch index 0 is
    # left-padded (its keys before 150 masked, the diagonal kept so that no row is empty);
    # then three packed documents of 100, the mask expanded over the batch.
    g = torch.Generator().manual_seed(5)
    n = 300
    pos = torch.arange(n)
    causal = pos[None, :] <= pos[:, None]
    padded = torch.stack([causal & ((pos[None, :] >= 150) | (pos[None, :] == pos[:, None])), causal])[:, None]
    docs = pos // 100
    packed = (causal & (docs[None, :] == docs[:, None]))[None, None].expand(B, 1, n, n)
    for mask in (padded, packed):
        q = torch.randn(B, H, n, E, generator=g).requires_grad_()
        k, v = (torch.randn(B, hk, n, E, generator=g).requires_grad_() for _ in range(2))
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hk != H)
        got = at.sdpa(q, k, v, attn_mask=mask, enable_gqa=hk != H)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
        cot = torch.randn(want.shape, generator=g)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), cot), torch.autograd.grad(want, (q, k, v), cot)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)
