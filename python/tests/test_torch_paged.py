"""``attnc.torch.paged_attention``: FlashAttention's ``flash_attn_with_kvcache`` conventions on a
paged KV cache (NHD pages shuffled in the pool, entries past each sequence's pages, the last page
partly filled), against float64 attention over each sequence's tokens gathered from the pages;
grouped-query heads, decode and a few queries, bottom-right causal and not. Skipped without
torch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import attnc  # noqa: E402
import attnc.torch as at  # noqa: E402


def reference(q, k_cache, v_cache, table, lens, causal, scale):
    out = torch.zeros(q.shape[:3] + (v_cache.shape[3],), dtype=torch.float64)
    page = k_cache.shape[1]
    groups = q.shape[2] // k_cache.shape[2]
    for b in range(q.shape[0]):
        n = int(lens[b])
        rows = [(int(table[b, t // page]), t % page) for t in range(n)]
        k = torch.stack([k_cache[p, r] for p, r in rows]).double().repeat_interleave(groups, dim=1)  # [n, H, D]
        v = torch.stack([v_cache[p, r] for p, r in rows]).double().repeat_interleave(groups, dim=1)
        qs = q[b].double()  # [S, H, D]
        scores = torch.einsum("shd,nhd->hsn", qs, k) * scale
        if causal:
            s = q.shape[1]
            masked = torch.arange(n)[None, :] > (torch.arange(s)[:, None] + n - s)
            scores = scores.masked_fill(masked, float("-inf"))
        out[b] = torch.einsum("hsn,nhd->shd", torch.softmax(scores, dim=-1), v)
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("queries", [1, 3])
def test_matches_attention_over_the_gathered_pages(causal, heads, queries):
    g = torch.Generator().manual_seed(9)
    (h, hk), d, page, pool = heads, 16, 4, 11
    lens = torch.tensor([9, 3, 14], dtype=torch.int32)
    table = torch.tensor([[7, 2, 10, -1], [4, -1, -1, -1], [0, 9, 5, 1]], dtype=torch.int32)
    q = torch.randn(3, queries, h, d, generator=g)
    k_cache = torch.randn(pool, page, hk, d, generator=g)
    v_cache = torch.randn(pool, page, hk, d + 2, generator=g)
    got = at.paged_attention(q, k_cache, v_cache, table, lens, causal=causal)
    want = reference(q, k_cache, v_cache, table, lens, causal, d**-0.5)
    assert got.shape == (3, queries, h, d + 2)
    assert (got.double() - want).abs().max() < 1e-5
    # The same program for another cache size and batch (no recompilation needed): one sequence.
    got1 = at.paged_attention(q[1:2], k_cache, v_cache, table[1:2, :2], lens[1:2], causal=causal, softmax_scale=0.3)
    want1 = reference(q[1:2], k_cache, v_cache, table[1:2, :2], lens[1:2], causal, 0.3)
    assert (got1.double() - want1).abs().max() < 1e-5


def test_bad_inputs_are_clear_errors():
    q, kc = torch.zeros(2, 1, 4, 8), torch.zeros(5, 4, 2, 8)
    table, lens = torch.zeros(2, 3, dtype=torch.int32), torch.tensor([4, 12], dtype=torch.int32)
    with pytest.raises(attnc.ShapeError, match="cache_seqlens"):
        at.paged_attention(q, kc, kc, table, torch.tensor([4, 13], dtype=torch.int32))
    with pytest.raises(attnc.ShapeError, match="block_table"):
        at.paged_attention(q, kc, kc, table[:1], lens)
    with pytest.raises(attnc.ShapeError, match="multiple"):
        at.paged_attention(torch.zeros(2, 1, 3, 8), kc, kc, table, lens)
    with pytest.raises(attnc.DTypeError):
        at.paged_attention(q.double(), kc, kc, table, lens)


def test_torch_compile_traces_it_without_a_graph_break():
    # The registered op `attnc::paged` (fullgraph: a break raises), as eager.
    def decode(q, k_cache, v_cache, table, lens):
        return at.paged_attention(q * 2.0, k_cache, v_cache, table, lens, causal=True)

    g = torch.Generator().manual_seed(10)
    lens = torch.tensor([9, 3, 14], dtype=torch.int32)
    table = torch.tensor([[7, 2, 10, -1], [4, -1, -1, -1], [0, 9, 5, 1]], dtype=torch.int32)
    q = torch.randn(3, 1, 4, 16, generator=g)
    k_cache, v_cache = (torch.randn(11, 4, 2, 16, generator=g) for _ in range(2))
    compiled = torch.compile(decode, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k_cache, v_cache, table, lens), decode(q, k_cache, v_cache, table, lens), rtol=0, atol=0)
    torch.library.opcheck(torch.ops.attnc.paged.default, (q, k_cache, v_cache, table, lens, True, None))
