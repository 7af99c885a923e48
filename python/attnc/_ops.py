"""The drop-ins of :mod:`attnc.torch` as ``torch.library`` ops (``attnc::sdpa``, ``attnc::flex``,
``attnc::varlen``, ``attnc::paged``, and the backward ops of the differentiable ones), each with a
fake implementation and an autograd formula. Under ``torch.compile`` the drop-ins call these,
so a model that uses them compiles without a graph break; an op's implementation is the eager
path (the backward ops call the derived programs directly, below autograd)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch as _torch

from . import Program
from ._errors import ArgumentError
from .torch import _compile_entry, _run_plain, _sdpa, _sdpa_prepare, _varlen_prepare, paged_attention, varlen_attention

# ---- torch.library: attnc::sdpa for torch.compile --------------------------------------------


@_torch.library.custom_op("attnc::sdpa", mutates_args=())
def _sdpa_op(
    query: _torch.Tensor,
    key: _torch.Tensor,
    value: _torch.Tensor,
    attn_mask: Optional[_torch.Tensor],
    dropout_p: float,
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    softcap: Optional[float],
    sinks: Optional[_torch.Tensor] = None,
    seed: Optional[_torch.Tensor] = None,
) -> _torch.Tensor:
    with _torch.no_grad():
        # Dense, as the fake implementation says (a sequence-major result is a transposed view).
        return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks, seed).clone(
            memory_format=_torch.contiguous_format
        )


@_sdpa_op.register_fake
def _sdpa_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks=None, seed=None):  # type: ignore[no-untyped-def]
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


@_torch.library.custom_op("attnc::sdpa_backward", mutates_args=())
def _sdpa_backward_op(
    grad: _torch.Tensor,
    query: _torch.Tensor,
    key: _torch.Tensor,
    value: _torch.Tensor,
    attn_mask: Optional[_torch.Tensor],
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    softcap: Optional[float],
    sinks: Optional[_torch.Tensor] = None,
    dropout_p: float = 0.0,
    seed: Optional[_torch.Tensor] = None,
) -> Tuple[_torch.Tensor, _torch.Tensor, _torch.Tensor, _torch.Tensor, _torch.Tensor]:
    # A custom op runs below autograd: the derived program is called directly. A float mask is
    # taken whole (no broadcast axis folded away), so that its gradient is per element. Dropout
    # draws the forward's weights again from its seed.
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    mask = attn_mask.contiguous() if float_mask and attn_mask is not None else attn_mask
    # (Dense tensors, `in_place=False`: the program's layout is the caller's.)
    prog, _, args, _, _ = _sdpa_prepare(query, key, value, mask, is_causal, scale, enable_gqa, softcap, sinks, dropout_p, in_place=False)
    if dropout_p > 0.0 and seed is not None:
        args.append(seed.to(_torch.int32).reshape(()))
    wrt = ["q", "k", "v"] + (["mask"] if float_mask else []) + (["sink"] if sinks is not None else [])
    cot = grad.to(args[0].dtype)
    outs = prog.grad(wrt)(*(a.detach() for a in args), cot)
    grads = dict(zip(wrt, (g.to(query.dtype) for g in outs[len(outs) - len(wrt) :])))
    mask_grad = grads["mask"].reshape(attn_mask.shape) if float_mask and attn_mask is not None else query.new_empty(0)
    sink_grad = grads["sink"] if sinks is not None else query.new_empty(0)
    return grads["q"], grads["k"], grads["v"], mask_grad, sink_grad


@_sdpa_backward_op.register_fake
def _sdpa_backward_fake(grad, query, key, value, attn_mask, is_causal, scale, enable_gqa, softcap, sinks=None, dropout_p=0.0, seed=None):  # type: ignore[no-untyped-def]
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    mask_grad = attn_mask.new_empty(attn_mask.shape) if float_mask else query.new_empty(0)
    sink_grad = sinks.new_empty(sinks.shape) if sinks is not None else query.new_empty(0)
    return _torch.empty_like(query), _torch.empty_like(key), _torch.empty_like(value), mask_grad, sink_grad


# ---- torch.library: attnc::flex for torch.compile --------------------------------------------

# Per program text, threads and target: the compiled program.
_FLEX_TEXTS: Dict[Tuple[str, int, str], Program] = {}


def _flex_program(text: str, cuda: bool) -> Program:
    """The traced ``flex_attention`` program ``text`` (see :func:`attnc.torch._flex_source`), compiled once
    per thread count and target."""
    threads, target = _torch.get_num_threads(), "cuda" if cuda else "cpu"
    key_ = (text, threads, target)
    if key_ not in _FLEX_TEXTS:
        _FLEX_TEXTS[key_] = _compile_entry(text, "flex", threads, target)
    return _FLEX_TEXTS[key_]


def _flex_args(query: _torch.Tensor, key: _torch.Tensor, value: _torch.Tensor, captured: List[_torch.Tensor], wide: bool) -> List[_torch.Tensor]:
    """The program's inputs, detached; bfloat16 widened to float32 on the CPU where ``wide``
    (the derived programs take float32; a plain run widens as it reads)."""
    args = [t.detach() for t in (query, key, value)]
    if wide and query.dtype == _torch.bfloat16 and not query.is_cuda:
        args = [a.float() for a in args]
    return args + [c.detach() for c in captured]


@_torch.library.custom_op("attnc::flex", mutates_args=())
def _flex_op(
    query: _torch.Tensor, key: _torch.Tensor, value: _torch.Tensor, captured: List[_torch.Tensor], program: str, return_lse: bool
) -> Tuple[_torch.Tensor, _torch.Tensor]:
    prog = _flex_program(program, query.is_cuda)
    if return_lse:
        split = prog.grad_split(["q"])
        if split is None:
            raise ArgumentError("return_lse=True: this score modification has no fused form that saves the log-sum-exp")
        saved = split[0](*(a.contiguous() for a in _flex_args(query, key, value, captured, True)))
        out, lse = saved[0], saved[-1].reshape(query.shape[:3])
    else:
        with _torch.no_grad():
            out, lse = _run_plain(prog, _flex_args(query, key, value, captured, False)), query.new_empty(0, dtype=_torch.float32)
    return out.to(query.dtype).contiguous(), lse


@_flex_op.register_fake
def _flex_fake(query, key, value, captured, program, return_lse):  # type: ignore[no-untyped-def]
    lse = query.new_empty(query.shape[:3] if return_lse else (0,), dtype=_torch.float32)
    return query.new_empty((*query.shape[:-1], value.shape[-1])), lse


@_torch.library.custom_op("attnc::flex_backward", mutates_args=())
def _flex_backward_op(
    grad: _torch.Tensor, query: _torch.Tensor, key: _torch.Tensor, value: _torch.Tensor, captured: List[_torch.Tensor], program: str
) -> List[_torch.Tensor]:
    # Below autograd: the derived program is called directly, for q, k, v and every float
    # captured tensor (the others get an empty gradient, dropped by the autograd formula).
    args = _flex_args(query, key, value, captured, True)
    floats = [f"x{n}" for n, c in enumerate(captured) if c.is_floating_point()]
    wrt = ["q", "k", "v"] + floats
    outs = _flex_program(program, query.is_cuda).grad(wrt)(*args, grad.to(args[0].dtype).contiguous())
    found = dict(zip(wrt, outs[len(outs) - len(wrt) :]))
    dq, dk, dv = (found[n].to(t.dtype) for n, t in (("q", query), ("k", key), ("v", value)))
    return [dq, dk, dv] + [found[f"x{n}"] if c.is_floating_point() else c.new_empty(0) for n, c in enumerate(captured)]


@_flex_backward_op.register_fake
def _flex_backward_fake(grad, query, key, value, captured, program):  # type: ignore[no-untyped-def]
    rest = [c.new_empty(c.shape) if c.is_floating_point() else c.new_empty(0) for c in captured]
    return [_torch.empty_like(query), _torch.empty_like(key), _torch.empty_like(value)] + rest


def _flex_setup(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    query, key, value, captured, program, _ = inputs
    ctx.save_for_backward(query, key, value, *captured)
    ctx.program = program
    ctx.mark_non_differentiable(output[1])


def _flex_backward(ctx: Any, grad: _torch.Tensor, _lse_grad: Any) -> Tuple[Any, ...]:
    query, key, value, *captured = ctx.saved_tensors
    grads = _torch.ops.attnc.flex_backward(grad, query, key, value, captured, ctx.program)
    rest = [g if c.is_floating_point() else None for g, c in zip(grads[3:], captured)]
    return grads[0], grads[1], grads[2], rest, None, None


_flex_op.register_autograd(_flex_backward, setup_context=_flex_setup)


def _sdpa_setup(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks, seed = inputs
    ctx.save_for_backward(query, key, value, attn_mask, sinks, seed)
    ctx.flags = (is_causal, scale, enable_gqa, softcap)
    ctx.dropout_p = dropout_p


def _sdpa_backward(ctx: Any, grad: _torch.Tensor) -> Tuple[Any, ...]:
    query, key, value, attn_mask, sinks, seed = ctx.saved_tensors
    dq, dk, dv, dm, ds = _torch.ops.attnc.sdpa_backward(grad, query, key, value, attn_mask, *ctx.flags, sinks, ctx.dropout_p, seed)
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    sink_grad = ds.to(sinks.dtype) if sinks is not None else None
    return dq, dk, dv, (dm if float_mask else None), None, None, None, None, None, sink_grad, None


_sdpa_op.register_autograd(_sdpa_backward, setup_context=_sdpa_setup)


# ---- torch.library: attnc::varlen and attnc::paged for torch.compile -------------------------


@_torch.library.custom_op("attnc::varlen", mutates_args=())
def _varlen_op(
    q: _torch.Tensor, k: _torch.Tensor, v: _torch.Tensor, cu_seqlens_q: _torch.Tensor, cu_seqlens_k: _torch.Tensor, causal: bool, scale: Optional[float]
) -> _torch.Tensor:
    with _torch.no_grad():
        return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, softmax_scale=scale).contiguous()


@_varlen_op.register_fake
def _varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale):  # type: ignore[no-untyped-def]
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@_torch.library.custom_op("attnc::varlen_backward", mutates_args=())
def _varlen_backward_op(
    grad: _torch.Tensor,
    q: _torch.Tensor,
    k: _torch.Tensor,
    v: _torch.Tensor,
    cu_seqlens_q: _torch.Tensor,
    cu_seqlens_k: _torch.Tensor,
    causal: bool,
    scale: Optional[float],
) -> Tuple[_torch.Tensor, _torch.Tensor, _torch.Tensor]:
    # Below autograd: the derived program is called directly.
    prog, _, args = _varlen_prepare(q.detach(), k.detach(), v.detach(), cu_seqlens_q, cu_seqlens_k, causal, scale)
    args = [a.float() if a.dtype == _torch.bfloat16 and not a.is_cuda else a for a in args]
    outs = prog.grad(["q", "k", "v"])(*args, grad.to(args[0].dtype).contiguous())
    return outs[-3].to(q.dtype), outs[-2].to(k.dtype), outs[-1].to(v.dtype)


@_varlen_backward_op.register_fake
def _varlen_backward_fake(grad, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale):  # type: ignore[no-untyped-def]
    return _torch.empty_like(q), _torch.empty_like(k), _torch.empty_like(v)


def _varlen_setup(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    q, k, v, cu_q, cu_k, causal, scale = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k)
    ctx.flags = (causal, scale)


def _varlen_backward(ctx: Any, grad: _torch.Tensor) -> Tuple[Any, ...]:
    q, k, v, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _torch.ops.attnc.varlen_backward(grad, q, k, v, cu_q, cu_k, *ctx.flags)
    return dq, dk, dv, None, None, None, None


_varlen_op.register_autograd(_varlen_backward, setup_context=_varlen_setup)


@_torch.library.custom_op("attnc::paged", mutates_args=())
def _paged_op(
    q: _torch.Tensor,
    k_cache: _torch.Tensor,
    v_cache: _torch.Tensor,
    block_table: _torch.Tensor,
    cache_seqlens: _torch.Tensor,
    causal: bool,
    scale: Optional[float],
) -> _torch.Tensor:
    return paged_attention(q, k_cache, v_cache, block_table, cache_seqlens, causal=causal, softmax_scale=scale).contiguous()


@_paged_op.register_fake
def _paged_fake(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale):  # type: ignore[no-untyped-def]
    return q.new_empty((*q.shape[:-1], v_cache.shape[-1]))
