"""CUDA tensors handed to the cuda target by device pointer (attnc.Program on CUDA tensors,
attnc.torch.sdpa on CUDA tensors). The device cases run where PyTorch sees a GPU; the rest
(result shapes, clear errors without a GPU) run everywhere."""

import numpy as np
import pytest

import attnc

torch = pytest.importorskip("torch")

GPU = torch.cuda.is_available()
CAUSAL = """
fn attn(q: f16[B, H, S, D], k: f16[B, H, S, D], v: f16[B, H, S, D]) -> f16[B, H, S, D] {
    let scores = q @ k.T / sqrt(D)
    let (b, h, i, j) = indices(scores)
    return softmax(where(j <= i, scores, -inf), axis = -1) @ v
}
"""


def test_result_shapes_are_known_before_the_run():
    prog = attnc.compile(CAUSAL, target="cuda")
    assert prog._compiled._output_shapes([[2, 3, 5, 8]] * 3, None) == [("f16", [2, 3, 5, 8])]
    with pytest.raises(attnc.ShapeError):
        prog._compiled._output_shapes([[2, 3, 5, 8], [2, 3, 5, 8], [2, 3, 5, 9]], None)


@pytest.mark.skipif(GPU, reason="a GPU is present: the error path without one is not exercised")
def test_without_a_gpu_a_device_run_is_a_clear_error():
    prog = attnc.compile(CAUSAL, target="cuda")
    spec = [(0, "f16", [1, 1, 4, 8])] * 3
    with pytest.raises(attnc.RunError, match="CUDA target is not available"):
        prog._compiled._run_cuda(spec, [(0, "f16", [1, 1, 4, 8])], 0, None, None)
    with pytest.raises(attnc.ArgumentError, match="compiled for `cuda`"):
        attnc.compile(CAUSAL)._compiled._run_cuda(spec, spec[:1], 0, None, None)


gpu = pytest.mark.skipif(not GPU, reason="PyTorch sees no CUDA device")


@gpu
def test_a_program_runs_on_cuda_tensors_in_place():
    prog = attnc.compile(CAUSAL, target="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 130, 64, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    out = prog(q, k, v)
    assert out.is_cuda and out.dtype == torch.float16 and out.shape == q.shape
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert (out.float() - ref).abs().max().item() < 2e-3
    with pytest.raises(attnc.LayoutError, match="target='cuda'"):
        attnc.compile(CAUSAL)(q, k, v)


@gpu
def test_a_cuda_program_writes_into_the_callers_tensor():
    prog = attnc.compile(CAUSAL, target="cuda")
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(1, 2, 70, 64, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    assert prog.run(q, k, v, out=out) is out
    torch.testing.assert_close(out, prog(q, k, v), rtol=0, atol=0)
    with pytest.raises(attnc.LayoutError, match="dense torch tensor"):
        prog.run(q, k, v, out=torch.empty(1, 70, 2, 64, device="cuda", dtype=torch.float16).transpose(1, 2))
    with pytest.raises(attnc.ShapeError, match="but the result is"):
        prog.run(q, k, v, out=torch.empty(1, 2, 70, 64, device="cuda"))


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sdpa_on_cuda_tensors_matches_torch_forward_and_gradients(dtype):
    import attnc.torch as at

    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 4, 200, 128, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    out = at.sdpa(q, k, v, is_causal=True)
    assert out.is_cuda and out.dtype == dtype
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
    refs = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
    tol = 2e-2 if dtype == torch.float16 else 1e-1
    assert (out.float() - ref).abs().max().item() < tol
    for got, want in zip(grads, refs):
        assert got.is_cuda and (got.float() - want).abs().max().item() < tol * max(1.0, want.abs().max().item())


@gpu
def test_sdpa_dropout_on_cuda_tensors_is_repeatable():
    import attnc.torch as at

    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16)
    torch.manual_seed(3)
    a = at.sdpa(q, q, q, dropout_p=0.3)
    torch.manual_seed(3)
    b = at.sdpa(q, q, q, dropout_p=0.3)
    assert torch.equal(a, b)
    assert not torch.equal(a, at.sdpa(q, q, q))


@gpu
def test_flex_attention_on_cuda_tensors_with_alibi_and_a_causal_block_mask():
    import attnc.torch as at

    B, H, S, D = 2, 4, 256, 64
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], device="cuda")

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    out = at.flex_attention(q, k, v, score_mod=alibi, block_mask=at.create_block_mask(causal, B, H, S, S))
    assert out.is_cuda and out.dtype == torch.float16
    i = torch.arange(S, device="cuda")
    bias = slopes[:, None, None] * (i[None, None, :] - i[None, :, None]).float()
    bias = bias.masked_fill(i[None, None, :] > i[None, :, None], float("-inf"))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias[None])
    assert (out.float() - ref).abs().max().item() < 2e-2


@gpu
def test_varlen_and_paged_attention_on_cuda_tensors_match_the_cpu():
    import attnc.torch as at

    g = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 37, 100, 230], dtype=torch.int32)
    q, k, v = (torch.randn(230, 4, 64, generator=g).half() for _ in range(3))
    want = at.varlen_attention(q.float(), k.float(), v.float(), cu, cu, 130, 130, causal=True)
    got = at.varlen_attention(q.cuda(), k.cuda(), v.cuda(), cu, cu, 130, 130, causal=True)
    assert got.is_cuda and (got.float().cpu() - want).abs().max().item() < 1e-2

    pages = torch.randn(40, 16, 2, 64, generator=g).half()
    table = torch.randperm(40, generator=g)[:30].reshape(3, 10).int()
    lens = torch.tensor([5, 100, 160], dtype=torch.int32)
    qd = torch.randn(3, 1, 4, 64, generator=g).half()
    want = at.paged_attention(qd.float(), pages.float(), pages.float(), table, lens)
    got = at.paged_attention(qd.cuda(), pages.cuda(), pages.cuda(), table.cuda(), lens.cuda())
    assert got.is_cuda and (got.float().cpu() - want).abs().max().item() < 1e-2


@gpu
def test_torch_compile_runs_the_ops_on_cuda_tensors():
    # The registered ops (attnc::program, attnc::program_saving) on CUDA tensors: as eager, no graph break.
    import attnc.torch as at

    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, 4, 130, 64, device="cuda", dtype=torch.float16, generator=g, requires_grad=True) for _ in range(3))
    slopes = torch.rand(4, device="cuda", requires_grad=True)
    prog = attnc.compile(CAUSAL, target="cuda")

    def f(q, k, v):
        flex = at.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi))
        return flex.float().sum(-1) + prog(q, k, v).float().sum(-1)

    got, want = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v), f(q, k, v)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v, slopes)), torch.autograd.grad(want.sum(), (q, k, v, slopes))):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
