"""Ring attention (context parallelism) over a ``torch.distributed`` process group.

Each rank holds a shard of the sequence: with ``causal=True`` the sequence is cut into
``2 * world`` chunks and rank ``r`` holds chunks ``r`` and ``2 * world - 1 - r`` (the causal
load balancing of Megatron's context parallelism: every rank does the same work); without it,
chunk ``r`` of ``world``. K and V blocks travel around the ring; each rank runs attnc's fused
attention of its queries against the block it holds and merges the partial results exactly
with their log-sum-exps. The backward passes K, V and their gradient accumulators around the
ring once more and runs attnc's fused backward of each block pair against the merged output and
log-sum-exp (as FlashAttention-2's backward does per tile), so no rank ever holds the whole
sequence.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ._errors import ArgumentError, DTypeError, ShapeError

# Per (causal, scale, threads): (forward, backward) programs of one block pair.
_PAIR: Dict[Tuple[bool, Optional[float], int], Tuple[Any, Any]] = {}


def _pair_programs(causal: bool, scale: Optional[float]) -> Tuple[Any, Any]:
    from . import compile as compile_program
    from .torch import _sdpa_source

    threads = torch.get_num_threads()
    key = (causal, scale, threads)
    if key not in _PAIR:
        prog = compile_program(_sdpa_source(4, "f32", None, causal, False, scale), entry="sdpa", threads=threads)
        split = prog.grad_split(["q", "k", "v"])
        if split is None:  # pragma: no cover - the fused backward exists for these programs
            raise ArgumentError("ring attention needs attnc's fused backward")
        _PAIR[key] = split
    return _PAIR[key]


def _forward_pair(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """One block pair's output and per-row log-sum-exp."""
    fwd, _ = _pair_programs(causal, scale)
    out, _, lse = fwd(q, k, v)
    return out, lse


def _backward_pair(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, causal: bool, scale: Optional[float]
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block pair's share of dq, dk, dv, against the merged output and log-sum-exp."""
    _, bwd = _pair_programs(causal, scale)
    return bwd(q, k, v, dout, out, lse)


def _merge(out: torch.Tensor, lse: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    new = torch.logaddexp(lse, l2)
    a = torch.exp(lse - new).nan_to_num(0.0).unsqueeze(-1)
    b = torch.exp(l2 - new).nan_to_num(0.0).unsqueeze(-1)
    return out * a + o2 * b, new


def _chunks(world: int, rank: int, causal: bool) -> List[int]:
    return [rank, 2 * world - 1 - rank] if causal else [rank]


def _visible(qc: int, kc: int, causal: bool) -> Optional[bool]:
    """How query chunk ``qc`` sees key chunk ``kc``: ``False`` all keys, ``True`` causally
    (the diagonal), ``None`` not at all."""
    if not causal:
        return False
    if kc < qc:
        return False
    return True if kc == qc else None


def _ring_pass(tensors: List[torch.Tensor], group: Any) -> List[torch.Tensor]:
    """Sends ``tensors`` to the next rank and returns the previous rank's."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt, prev = dist.get_global_rank(group, (rank + 1) % world), dist.get_global_rank(group, (rank - 1) % world)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prev, group) for r in received]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return received


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, causal: bool, scale: Optional[float]) -> torch.Tensor:  # type: ignore[override]
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        mine = _chunks(world, rank, causal)
        qs = q.chunk(len(mine), dim=2)
        outs = [torch.zeros(*x.shape[:-1], v.shape[-1]) for x in qs]
        lses = [torch.full(x.shape[:-1], float("-inf")) for x in qs]
        kv = [k.contiguous(), v.contiguous()]
        for step in range(world):
            owner = (rank - step) % world
            ks, vs = kv[0].chunk(len(mine), dim=2), kv[1].chunk(len(mine), dim=2)
            for a, qc in enumerate(mine):
                for b, kc in enumerate(_chunks(world, owner, causal)):
                    how = _visible(qc, kc, causal)
                    if how is None:
                        continue
                    o2, l2 = _forward_pair(qs[a].contiguous(), ks[b].contiguous(), vs[b].contiguous(), how, scale)
                    outs[a], lses[a] = _merge(outs[a], lses[a], o2, l2)
            if step + 1 < world:
                kv = _ring_pass(kv, group)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> Any:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        mine = _chunks(world, rank, causal)
        n = len(mine)
        qs, os_, ls, ds = (x.chunk(n, dim=2) for x in (q, out, lse, dout.contiguous()))
        dq = [torch.zeros_like(x) for x in qs]
        travel = [k.contiguous(), v.contiguous(), torch.zeros_like(k), torch.zeros_like(v)]
        for step in range(world):
            owner = (rank - step) % world
            ks, vs = travel[0].chunk(n, dim=2), travel[1].chunk(n, dim=2)
            dks, dvs = list(travel[2].chunk(n, dim=2)), list(travel[3].chunk(n, dim=2))
            for a, qc in enumerate(mine):
                for b, kc in enumerate(_chunks(world, owner, causal)):
                    how = _visible(qc, kc, causal)
                    if how is None:
                        continue
                    g = _backward_pair(
                        qs[a].contiguous(), ks[b].contiguous(), vs[b].contiguous(),
                        os_[a].contiguous(), ls[a].contiguous(), ds[a].contiguous(), how, scale,
                    )
                    dq[a] += g[0]
                    dks[b] = dks[b] + g[1]
                    dvs[b] = dvs[b] + g[2]
            travel = [travel[0], travel[1], torch.cat(dks, dim=2), torch.cat(dvs, dim=2)]
            # Every step passes the block on; after `world` passes its gradients are home.
            travel = _ring_pass(travel, group)
        return torch.cat(dq, dim=2), travel[2], travel[3], None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any = None, causal: bool = False, scale: Optional[float] = None
) -> torch.Tensor:
    """Attention over a sequence sharded across the ranks of ``group`` (see the module's
    docstring for the layout: :func:`shard` cuts a whole tensor that way, :func:`unshard` puts
    the pieces back). ``q``, ``k``, ``v``: this rank's ``[B, H, S_local, D]`` float32 shards.
    Differentiable."""
    if not dist.is_available() or not dist.is_initialized():
        raise ArgumentError("ring_attention needs an initialised torch.distributed process group")
    group = group if group is not None else dist.group.WORLD
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ShapeError(f"{name} must be a 4-d tensor [B, H, S_local, D]")
        if t.dtype != torch.float32:
            raise DTypeError(f"ring_attention runs float32 shards, not {t.dtype}")
    if causal and q.shape[2] % 2:
        raise ShapeError(f"with causal=True each rank holds two chunks, so its {q.shape[2]} rows must be even (see shard)")
    return _Ring.apply(q, k, v, group, bool(causal), scale)


def shard(x: torch.Tensor, world: int, rank: int, causal: bool) -> torch.Tensor:
    """Rank ``rank``'s shard of a whole ``[..., S, D]`` tensor in :func:`ring_attention`'s
    layout (``S`` a multiple of ``2 * world`` with ``causal``, of ``world`` without)."""
    n = 2 * world if causal else world
    if x.shape[-2] % n:
        raise ShapeError(f"the sequence length {x.shape[-2]} is not a multiple of {n}")
    pieces = x.chunk(n, dim=-2)
    return torch.cat([pieces[c] for c in _chunks(world, rank, causal)], dim=-2)


def unshard(shards: List[torch.Tensor], causal: bool) -> torch.Tensor:
    """The whole tensor from every rank's shard (in rank order), undoing :func:`shard`."""
    world = len(shards)
    n = 2 if causal else 1
    pieces: List[Optional[torch.Tensor]] = [None] * (n * world)
    for rank, s in enumerate(shards):
        for c, piece in zip(_chunks(world, rank, causal), s.chunk(n, dim=-2)):
            pieces[c] = piece
    return torch.cat([p for p in pieces if p is not None], dim=-2)
