"""``attnc.torch.ring_attention`` on 2 and 4 gloo processes of this machine against
single-process attention (torch's SDPA on the whole sequence): outputs and gradients, causal
(load-balanced chunks) and not. Skipped without torch."""

from __future__ import annotations

import os
import socket

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

B, H, S, D = 1, 2, 48, 16


def whole(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g) for _ in range(4)]  # q, k, v, d_out


def worker(rank, world, port, causal, results):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from attnc._ring import shard
        from attnc.torch import ring_attention

        q, k, v, dout = (shard(x, world, rank, causal) for x in whole())
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        out = ring_attention(q, k, v, causal=causal)
        out.backward(dout)
        results[rank] = [t.detach().clone() for t in (out, q.grad, k.grad, v.grad)]
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_matches_one_process(world, causal):
    from attnc._ring import unshard

    # Forked, so that the workers need not import this file by name.
    ctx = mp.get_context("fork")
    manager = ctx.Manager()
    results = manager.dict()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, causal, results)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    got = [unshard([results[r][n] for r in range(world)], causal) for n in range(4)]
    q, k, v, dout = (x.clone().requires_grad_(n < 3) for n, x in enumerate(whole()))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    grads = torch.autograd.grad(want, (q, k, v), dout)
    for g, w in zip(got, [want.detach(), *grads]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
