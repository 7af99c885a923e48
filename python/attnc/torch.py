"""PyTorch integration: an attnc program as a ``torch.autograd.Function``.

``attnc.torch.attention(prog)`` returns a callable that takes and returns torch tensors and
records itself in the autograd graph. Its backward pass runs the program's derived gradient
program (:meth:`attnc.Program.grad`): attnc differentiates the ``.attn`` source itself, score
modifications and masks included, so a learnable bias or slope gets its gradient too.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch as _torch
from torch.utils.dlpack import to_dlpack as _to_dlpack

from . import Program, _attnc, _bind
from ._errors import ArgumentError, DTypeError, LayoutError, ShapeError

_FLOAT = ("f32", "f16", "bf16")


def _torch_openmp() -> Optional[str]:
    """The OpenMP runtime PyTorch loaded (its ``libgomp``, or Intel's or LLVM's), from the
    process's memory map; ``None`` when there is none, off Linux, or with ``ATTNC_OPENMP=0``."""
    import os

    if os.environ.get("ATTNC_OPENMP", "").strip() == "0" or "OpenMP" not in _torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split(None, 5)[-1].strip() for line in maps if line.count(" ") >= 5]
    except OSError:
        return None
    for stem in ("libgomp", "libiomp5", "libomp"):
        for path in paths:
            if os.path.basename(path).startswith(stem + ".") or os.path.basename(path).startswith(stem + "-"):
                return path
    return None


def _share_torch_threads() -> None:
    """Multi-threaded attnc runs from here on go to PyTorch's OpenMP team (see python/README.md,
    "Threads"): PyTorch's OpenMP threads spin for a while after each of its parallel operations,
    and attnc's own threads would share the cores with them."""
    path = _torch_openmp()
    if path is not None:
        try:
            _attnc.share_openmp(path)
        except OSError:
            pass


_share_torch_threads()


def attention(prog: Program) -> Callable[..., Any]:
    """A callable running ``prog`` on torch tensors, differentiable by autograd.

    Arguments bind as in :class:`attnc.Program` (positional, or by parameter name); tensors
    are made contiguous first. When the derivative is fused (flash attention), the forward
    pass runs ``prog.grad_split(wrt)``'s forward, which also returns each flash op's result and
    log-sum-exp; they are saved, and the backward pass runs the split's backward on them,
    without running the attention forward again. Otherwise the backward pass runs
    ``prog.grad(wrt=...)``, which recomputes the forward values it needs. Either is compiled
    once per set of inputs that need gradients and cached.
    """
    names = [name for name, _, _ in prog.params]
    is_float = [dtype in _FLOAT for _, dtype, _ in prog.params]
    float_results = [dtype in _FLOAT for _, dtype, _ in prog.outputs]
    results = len(prog.outputs)
    grads: Dict[Tuple[str, ...], Program] = {}
    splits: Dict[Tuple[str, ...], Optional[Tuple[Program, Program]]] = {}

    def grad_program(wrt: Tuple[str, ...]) -> Program:
        if wrt not in grads:
            grads[wrt] = prog.grad(list(wrt))
        return grads[wrt]

    def split_programs(wrt: Tuple[str, ...]) -> Optional[Tuple[Program, Program]]:
        if wrt not in splits:
            splits[wrt] = prog.grad_split(list(wrt))
        return splits[wrt]

    class _Attention(_torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *inputs: Any) -> Any:  # type: ignore[override]
            wrt = tuple(n for n, f, need in zip(names, is_float, ctx.needs_input_grad) if f and need)
            split = split_programs(wrt) if wrt else None
            ctx.wrt, ctx.split = wrt, split
            ctx.others = [None if isinstance(x, _torch.Tensor) else x for x in inputs]
            tensors = [x if isinstance(x, _torch.Tensor) else None for x in inputs]
            if split is None:
                ctx.save_for_backward(*tensors)
                return prog(*inputs)
            outs = split[0](*inputs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            ctx.save_for_backward(*tensors, *outs[results:])
            ctx.mark_non_differentiable(*[o for o, f in zip(outs[:results], float_results) if not f])
            return outs[0] if results == 1 else outs[:results]

        @staticmethod
        def backward(ctx: Any, *cotangents: _torch.Tensor) -> Any:  # type: ignore[override]
            saved = ctx.saved_tensors
            inputs = [s if s is not None else o for s, o in zip(saved[: len(names)], ctx.others)]
            wrt = ctx.wrt
            if not wrt:
                return (None,) * len(names)
            cots = [c.detach().contiguous() for c, f in zip(cotangents, float_results) if f]
            if ctx.split is None:
                program, extra = grad_program(wrt), []
            else:
                program, extra = ctx.split[1], list(saved[len(names) :])
            outs = program(*inputs, *cots, *extra)
            outs = outs if isinstance(outs, tuple) else (outs,)
            found = dict(zip(wrt, outs[len(outs) - len(wrt) :]))
            return tuple(found.get(n) for n in names)

    def call(*args: Any, **named: Any) -> Any:
        if named:
            args = _bind(names, args, named, prog.entry)
        args = tuple(a.contiguous() if isinstance(a, _torch.Tensor) else a for a in args)
        return _Attention.apply(*args)

    call.__name__ = prog.entry
    call.__doc__ = f"attnc program {prog.signature}, differentiable"
    return call


# ---- attnc.torch.sdpa: torch.nn.functional.scaled_dot_product_attention -----------------------

_DTYPE_NAMES = {_torch.float32: "f32", _torch.float16: "f16"}
# Per variant: the program, and it wrapped for autograd.
_SDPA_PROGRAMS: Dict[Tuple[Any, ...], Tuple[Program, Callable[..., Any]]] = {}


def sdpa(
    query: _torch.Tensor,
    key: _torch.Tensor,
    value: _torch.Tensor,
    attn_mask: Optional[_torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> _torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``, computed by attnc.

    The same arguments and meaning: ``query`` ``(..., Hq, L, E)``, ``key`` ``(..., H, S, E)``,
    ``value`` ``(..., H, S, Ev)``; ``attn_mask`` a bool mask (``True``: takes part) or a float
    mask added to the scores, broadcastable to ``(..., Hq, L, S)`` (broadcast axes are read in
    place, never expanded); ``is_causal`` the top-left causal mask (key ``j`` visible from query
    ``i`` when ``j <= i``); ``scale`` default ``1/sqrt(E)``; ``enable_gqa`` lets ``Hq`` be a
    multiple of ``H`` (query head ``h`` reads key/value head ``h // (Hq / H)``; K and V are
    never repeated). Differentiable: gradients flow to query, key, value and a float mask.

    The program behind each combination of rank, dtype, mask layout, causality, GQA and scale
    is compiled once (the first call) and reused for every size: a new sequence length
    compiles nothing. float32 and float16 run as they are; bfloat16 runs in float32 (converted
    on the way in and out).

    ``dropout_p`` in ``[0, 1)`` drops each attention weight with that probability (the kept ones
    scaled by ``1 / (1 - dropout_p)``), fused into the attention: which weights drop comes from a
    counter-based generator (Philox4x32-10) under a seed drawn from torch's default generator
    for every call (so ``torch.manual_seed`` makes it repeatable), and the backward pass draws
    the same ones again instead of storing a mask. As with torch, pass ``dropout_p=0.0`` when
    not training.
    """
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, None)


def _sdpa(
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
    """:func:`sdpa`, and with ``softcap`` the scaled scores soft-capped first,
    ``softcap * tanh(s / softcap)`` (Gemma 2's attention logit soft-capping); with ``sinks``
    (one logit per query head, gpt-oss's ``s_aux``) each head's sink joins every softmax
    denominator, through the fused log-sum-exp (``examples/sinks.attn``), differentiable.
    With ``dropout_p > 0``, ``seed`` (a 0-d int32 tensor) is dropout's seed: drawn from torch's
    generator when not given."""
    p = 0.0 if type(dropout_p) is float and dropout_p == 0.0 else _dropout_rate(dropout_p)
    if p > 0.0 and seed is None:
        seed = _torch.randint(-(2**31), 2**31 - 1, (), dtype=_torch.int32)
    if _torch.compiler.is_compiling():
        # Under torch.compile: the registered op (`attnc::sdpa`, with a fake implementation and
        # an autograd formula), so the graph has no break.
        # With gradients, `attnc::sdpa_saving` also returns what the backward reads (the
        # output and log-sum-exp), so that it does not run the forward again.
        flags = (p, bool(is_causal), scale, bool(enable_gqa), softcap, sinks, seed)
        if _torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, attn_mask, sinks)):
            return _torch.ops.attnc.sdpa_saving(query, key, value, attn_mask, *flags)[0]
        return _torch.ops.attnc.sdpa(query, key, value, attn_mask, *flags)
    prog, differentiable, args, out_dtype, seq_major = _sdpa_prepare(query, key, value, attn_mask, is_causal, scale, enable_gqa, softcap, sinks, p)
    if seed is not None and p > 0.0:
        args.append(seed.to(_torch.int32).reshape(()))
    out = _run_either(prog, differentiable, args, out_dtype)
    # A sequence-major result is returned as the `[..., H, L, D]` view torch's sdpa gives.
    return out.transpose(-3, -2) if seq_major[0] else out


def _dropout_rate(dropout_p: Any) -> float:
    """``dropout_p`` checked: a number in ``[0, 1)``."""
    try:
        p = float(dropout_p)
    except (TypeError, ValueError):
        raise ArgumentError(f"dropout_p must be a number in [0, 1), not {type(dropout_p).__name__}") from None
    if not 0.0 <= p < 1.0:
        raise ArgumentError(f"dropout_p must be in [0, 1) (the probability of dropping a weight), got {dropout_p}")
    return p


def _cached(
    cache: Dict[Tuple[Any, ...], Tuple[Program, Callable[..., Any]]], key_: Tuple[Any, ...], compile_: Callable[[], Program]
) -> Tuple[Program, Callable[..., Any]]:
    """The program ``cache`` holds under ``key_`` with its autograd function, compiled by
    ``compile_`` (and kept) the first time."""
    found = cache.get(key_)
    if found is None:
        prog = compile_()
        found = (prog, attention(prog))
        cache[key_] = found
    return found


def _run_either(prog: Program, differentiable: Callable[..., Any], args: List[_torch.Tensor], out_dtype: _torch.dtype) -> _torch.Tensor:
    """``prog``'s first result: through autograd when an argument needs a gradient, else
    straight through the binding; in ``out_dtype``."""
    if _torch.is_grad_enabled() and any([a.requires_grad for a in args]):
        if not args[0].is_cuda and any([a.dtype == _torch.bfloat16 for a in args]):
            # bfloat16 on the CPU runs in float32: the autograd function saves float32 copies
            # once (a plain run reads bfloat16 itself).
            args = [a.float() if a.dtype == _torch.bfloat16 else a for a in args]
        out = differentiable(*args)
    else:
        out = _run_plain(prog, args)
    return out.to(out_dtype) if out.dtype != out_dtype else out


def _attention_args(tensors: List[_torch.Tensor], what: str, cuda: bool = False) -> Tuple[List[_torch.Tensor], str]:
    """q, k and v as a program takes them, and the program's dtype name (bfloat16 is ``f32`` on
    the CPU, whose binding widens it as it reads, and ``bf16`` on CUDA); a clear error for
    another dtype."""
    if tensors[0].dtype == _torch.bfloat16:
        return list(tensors), "bf16" if cuda else "f32"
    args = list(tensors)
    dtype = _DTYPE_NAMES.get(args[0].dtype)
    if dtype is None:
        raise DTypeError(f"{what} runs float32, float16 and bfloat16 tensors, not {tensors[0].dtype}")
    return args, dtype


def _sdpa_prepare(
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
    in_place: bool = True,
) -> Tuple[Program, Callable[..., Any], List[_torch.Tensor], _torch.dtype, Tuple[bool, bool, bool]]:
    """The checked arguments of an :func:`_sdpa` call: its program (compiled on first use), the
    program as an autograd function, the program's inputs (without dropout's seed, the last
    parameter when ``dropout_p > 0``), the result's dtype, and which of q, k and v the program
    takes sequence-major (``[..., S, H, D]``; with q so, the result is ``[..., L, H, D]``, to be
    transposed back). ``in_place=False`` takes none so (every tensor dense)."""

    if is_causal and attn_mask is not None:
        raise ArgumentError("attn_mask and is_causal=True cannot both be given (as in torch): fold the causal mask into attn_mask")
    cuda = isinstance(query, _torch.Tensor) and query.is_cuda
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, _torch.Tensor):
            raise ArgumentError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        if (t.device != query.device) if cuda else not t.is_cpu:
            raise LayoutError(f"{name} is on {t.device}; attnc.torch.sdpa runs CPU tensors, or CUDA tensors on one device, not {query.device} and {t.device}")
    if query.dim() < 2 or key.dim() != query.dim() or value.dim() != query.dim():
        raise ShapeError(
            f"query, key and value must have the same rank, at least 2: got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise DTypeError(f"query, key and value must have one dtype: got {query.dtype}, {key.dtype}, {value.dtype}")
    out_dtype = query.dtype
    # (float32 and float16 looked up directly: this runs on every call.)
    dtype = _DTYPE_NAMES.get(out_dtype)
    args, dtype = ([query, key, value], dtype) if dtype is not None else _attention_args([query, key, value], "attnc.torch.sdpa", cuda)
    gqa = bool(enable_gqa) and query.dim() >= 3 and query.shape[-3] != key.shape[-3]
    mask_key: Optional[Tuple[Any, ...]] = None
    if attn_mask is not None:
        if not isinstance(attn_mask, _torch.Tensor):
            raise ArgumentError(f"attn_mask must be a torch.Tensor or None, not {type(attn_mask).__name__}")
        if attn_mask.dim() > query.dim():
            raise ShapeError(f"attn_mask {tuple(attn_mask.shape)} has more axes than the scores {tuple(query.shape[:-1]) + (key.shape[-2],)}")
        if attn_mask.dtype == _torch.bool:
            kind = "bool"
        elif attn_mask.dtype == out_dtype:
            kind = dtype
        else:
            raise DTypeError(f"attn_mask must be bool or the query's dtype ({out_dtype}), not {attn_mask.dtype}")
        # Broadcast axes (size 1, or stride 0 from `expand`) are size-1 axes of the program's
        # mask parameter, so the mask is read in place at its own size.
        ones = tuple(n == 1 or s == 0 for n, s in zip(attn_mask.shape, attn_mask.stride()))
        index = tuple(0 if one else slice(None) for one in ones)
        mask = attn_mask[index].reshape([1 if one else n for one, n in zip(ones, attn_mask.shape)])
        args.append(mask)
        mask_key = (kind, ones)
    if sinks is not None:
        heads = query.shape[-3] if query.dim() >= 3 else 0
        if not isinstance(sinks, _torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != heads:
            got = tuple(sinks.shape) if isinstance(sinks, _torch.Tensor) else type(sinks).__name__
            raise ShapeError(f"sinks must be one logit per query head, a tensor of shape ({heads},): got {got}")
        args.append(sinks.to(args[0].dtype))
    threads = _torch.get_num_threads()
    cap = None if softcap is None else float(softcap)
    drop = float(dropout_p)
    target = "cuda" if cuda else "cpu"
    # Folded groups: one work item of the CPU backward per K/V head, so with gradients only
    # where there are at least as many K/V heads (times the batch) as threads.
    grad = _torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    fold = _foldable(gqa, bool(is_causal), mask_key, sinks is not None, drop) and (cuda or not grad or key[..., 0, 0].numel() >= threads)
    # Transposed views of sequence-major memory (transformers' `[B, S, H, D]` projections seen
    # as `[B, H, S, D]`) are read in place, and the result written sequence-major when the
    # query is (CPU, without gradients). The backward reads each row many times, and rows
    # `H·D` apart alias in the caches: there the autograd function's dense copies, made once,
    # are faster (`python/bench/hop.py --layout`). On CUDA the tensors are made contiguous.
    seq_major = (False, False, False)
    if in_place and not grad and not cuda and query.dim() >= 3 and not (query.is_contiguous() and key.is_contiguous() and value.is_contiguous()):
        seq_major = (not fold and _seq_major(query), _seq_major(key), _seq_major(value))
        args[:3] = [t.transpose(-3, -2) if seq else t for t, seq in zip(args[:3], seq_major)]
    key_ = (query.dim(), dtype, mask_key, bool(is_causal), gqa, None if scale is None else float(scale), cap, threads, sinks is not None, drop, target, fold, seq_major)
    found = _SDPA_PROGRAMS.get(key_)
    if found is None:
        found = _cached(
            _SDPA_PROGRAMS,
            key_,
            lambda: _compile(
                _sdpa_source(query.dim(), dtype, mask_key, bool(is_causal), gqa, scale, cap, sinks is not None, drop, fold, seq_major), threads, target
            ),
        )
    return found[0], found[1], args, out_dtype, seq_major


def _seq_major(t: _torch.Tensor) -> bool:
    """Whether ``t`` (``[..., H, S, D]``) is a transposed view of dense ``[..., S, H, D]``
    memory, and not dense itself."""
    return not t.is_contiguous() and t.transpose(-3, -2).is_contiguous()


def _run_plain(prog: Program, args: List[_torch.Tensor]) -> _torch.Tensor:
    """``prog``'s first result on CPU tensors, without autograd, straight through the binding:
    each tensor goes over as a DLPack capsule, read in place where dense (any other strides,
    and bfloat16 or float16 for a float32 parameter, are copied once in the binding). On CUDA
    tensors, the program reads and writes device memory (``Program``'s CUDA path)."""
    if args[0].is_cuda:
        out = prog(*args)
        return out[0] if isinstance(out, tuple) else out
    return _torch.from_numpy(prog._compiled.run(tuple([_to_dlpack(a) for a in args]), None, None)[0])


def _compile(text: str, threads: int, target: str = "cpu") -> Program:
    from . import compile as _compile_program

    return _compile_program(text, entry="sdpa", threads=threads, target=target)


def _sdpa_source(
    rank: int,
    dtype: str,
    mask: Optional[Tuple[str, Tuple[bool, ...]]],
    causal: bool,
    gqa: bool,
    scale: Optional[float],
    softcap: Optional[float] = None,
    sinks: bool = False,
    dropout_p: float = 0.0,
    fold: bool = False,
    seq_major: Tuple[bool, bool, bool] = (False, False, False),
) -> str:
    """The ``.attn`` program of one ``sdpa`` variant (see :func:`sdpa`); with ``sinks``, a
    parameter ``sink`` of one logit per query head joins each softmax denominator; with
    ``dropout_p``, the weights are dropped under the last parameter, ``seed``. With ``fold``
    (grouped-query attention whose scores do not depend on the query's position or head: no
    causal mask, a mask broadcast over heads and queries, no sinks, no dropout), each K/V
    head's ``G`` query heads are rows of one attention: ``q`` as ``[..., Hk, G*L, E]`` against
    ``k`` ``[..., Hk, S, E]``, so K and V are read once per group (a decode step's ``G`` rows
    take one pass over the cache instead of ``G``).

    ``seq_major`` says, for ``q``, ``k`` and ``v``, whether the caller's tensor lies in memory
    with its sequence axis outside its head axis (``[..., S, H, E]``, the layout of
    transformers' projections, handed over as a transposed view): such a parameter is declared
    in that layout and permuted in the program, which the flash kernels read in place; with
    ``q`` so, the result is written in that layout too (``[..., L, H, Ev]``)."""
    if fold:
        return _sdpa_folded_source(rank, dtype, mask, scale, softcap, seq_major[1:])
    lead = [f"N{n}" for n in range(rank - 3)] if gqa else [f"N{n}" for n in range(rank - 2)]
    heads_q, heads_kv = (["Hk*G"], ["Hk"]) if gqa else ([], [])
    q = lead + heads_q + ["L", "E"]
    k = lead + heads_kv + ["S", "E"]
    v = lead + heads_kv + ["S", "Ev"]
    out = lead + heads_q + ["L", "Ev"]
    # The scores' axes, as the caller sees them (a mask aligns with these, right to left).
    seen = lead + heads_q + ["L", "S"]
    params, body, names = _declare(dtype, rank, zip(("q", "k", "v"), (q, k, v), seq_major))
    if gqa:
        g = len(lead) + 1  # the group axis
        body += [
            f"let qg = reshape({names[0]}, [{', '.join(lead + ['Hk', 'G', 'L', 'E'])}])",
            f"let kg = unsqueeze({names[1]}, {g})",
            f"let vg = unsqueeze({names[2]}, {g})",
        ]
        qn, kn, vn = "qg", "kg", "vg"
    else:
        qn, kn, vn = names
    body.append(_scores_line(qn, kn, scale, softcap))
    score_rank = len(seen) + (1 if gqa else 0)
    if mask is not None:
        kind, ones = mask
        dims = [("1" if one else seen[len(seen) - len(ones) + a]) for a, one in enumerate(ones)]
        params.append(f"mask: {kind}[{', '.join(dims)}]")
        m = "mask"
        if gqa and len(ones) >= 3:
            h = len(ones) - 3
            split = dims[:h] + (["1", "1"] if ones[h] else ["Hk", "G"]) + dims[h + 1 :]
            body.append(f"let mg = reshape(mask, [{', '.join(split)}])")
            m = "mg"
        body.append(f"let masked = where({m}, scores, -inf)" if kind == "bool" else f"let masked = scores + {m}")
    else:
        body.append("let masked = scores")
    if causal:
        names = [f"a{n}" for n in range(score_rank - 2)] + ["i", "j"]
        body.append(f"let ({', '.join(names)}) = indices(masked)")
        body.append("let kept = where(j <= i, masked, -inf)")
    else:
        body.append("let kept = masked")
    weights = "softmax(kept, axis = -1)"
    if dropout_p > 0.0:
        weights = f"dropout({weights}, seed, p = {float(dropout_p)!r})"
    body.append(f"let attended = {weights} @ {vn}")
    if sinks:
        # out · σ(lse − sink): the sink as one more logit in each row's denominator, with no
        # value (examples/sinks.attn); the log-sum-exp fuses into the attention's flash op.
        head_axis = (heads_q[0] if gqa else lead[-1]) if (gqa or lead) else None
        if head_axis is None:
            raise ShapeError("attention sinks need a head axis (query of rank 3 or more)")
        params.append(f"sink: {dtype}[{head_axis}]")
        body.append("let lse = logsumexp(kept, axis = -1)")
        # The sink broadcast against lse's [..., heads, L] (or [..., Hk, G, L]).
        body.append("let sg = unsqueeze(reshape(sink, [Hk, G]), 2)" if gqa else "let sg = unsqueeze(sink, 1)")
        body.append(f"let result = attended * unsqueeze(sigmoid(lse - sg), {score_rank - 1})")
    else:
        body.append("let result = attended")
    if dropout_p > 0.0:
        params.append("seed: i32")
    result = f"reshape(result, [{', '.join(out)}])" if gqa else "result"
    if seq_major[0]:
        swap = _swap(rank)
        body.append(f"return permute({result}, {swap})")
        out = [out[a] for a in swap]
    else:
        body.append(f"return {result}")
    head = f"fn sdpa({', '.join(params)}) -> {dtype}[{', '.join(out)}] {{"
    return "\n".join([head] + ["    " + line for line in body] + ["}", ""])


def _swap(rank: int) -> List[int]:
    """The permutation that swaps a rank-``rank`` tensor's head and position axes (the last
    but two and the last but one)."""
    return list(range(rank - 3)) + [rank - 2, rank - 3, rank - 1]


def _declare(dtype: str, rank: int, tensors: Any) -> Tuple[List[str], List[str], List[str]]:
    """For each ``(name, axes, seq_major)``: the parameter's declaration (its axes in memory
    order: heads and positions swapped when sequence-major), the lines that permute the
    sequence-major ones back to ``[..., H, S, E]``, and the name each is used by after them."""
    params: List[str] = []
    body: List[str] = []
    names: List[str] = []
    swap = _swap(rank)
    for name, axes, seq in tensors:
        params.append(f"{name}: {dtype}[{', '.join([axes[a] for a in swap] if seq else axes)}]")
        if seq:
            body.append(f"let {name}h = permute({name}, {swap})")
        names.append(f"{name}h" if seq else name)
    return params, body, names


def _scores_line(q: str, k: str, scale: Optional[float], softcap: Optional[float]) -> str:
    """``let scores = ...``: ``q @ k.T`` scaled (``1/sqrt(E)`` by default), soft-capped as
    ``softcap * tanh(s / softcap)`` when ``softcap`` is given."""
    factor = "/ sqrt(E)" if scale is None else f"* {float(scale)!r}"
    if softcap is None:
        return f"let scores = {q} @ {k}.T {factor}"
    return f"let scores = {float(softcap)!r} * tanh({q} @ {k}.T {factor} / {float(softcap)!r})"


def _sdpa_folded_source(
    rank: int,
    dtype: str,
    mask: Optional[Tuple[str, Tuple[bool, ...]]],
    scale: Optional[float],
    softcap: Optional[float],
    seq_major: Tuple[bool, bool] = (False, False),
) -> str:
    """:func:`_sdpa_source`'s grouped-query program with each group's query heads folded into
    rows (``fold``): the mask, when given, is broadcast over heads and queries, so it lines up
    with the folded scores ``[..., Hk, G*L, S]`` as it is. ``seq_major``: whether ``k`` and
    ``v`` are taken as ``[..., S, Hk, E]`` (the query's heads and rows fold only when dense)."""
    lead = [f"N{n}" for n in range(rank - 3)]
    q, k, v = lead + ["Hk*G", "L", "E"], lead + ["Hk", "S", "E"], lead + ["Hk", "S", "Ev"]
    seen = lead + ["Hk*G", "L", "S"]
    params, body, (_, kn, vn) = _declare(dtype, rank, zip(("q", "k", "v"), (q, k, v), (False, *seq_major)))
    body += [f"let rows = reshape(q, [{', '.join(lead + ['Hk', 'G*L', 'E'])}])", _scores_line("rows", kn, scale, softcap)]
    if mask is not None:
        kind, ones = mask
        dims = [("1" if one else seen[len(seen) - len(ones) + a]) for a, one in enumerate(ones)]
        params.append(f"mask: {kind}[{', '.join(dims)}]")
        body.append("let kept = where(mask, scores, -inf)" if kind == "bool" else "let kept = scores + mask")
    else:
        body.append("let kept = scores")
    body.append(f"let attended = softmax(kept, axis = -1) @ {vn}")
    body.append(f"return reshape(attended, [{', '.join(lead + ['Hk*G', 'L', 'Ev'])}])")
    head = f"fn sdpa({', '.join(params)}) -> {dtype}[{', '.join(lead + ['Hk*G', 'L', 'Ev'])}] {{"
    return "\n".join([head] + ["    " + line for line in body] + ["}", ""])


def _foldable(gqa: bool, causal: bool, mask: Optional[Tuple[str, Tuple[bool, ...]]], sinks: bool, dropout_p: float) -> bool:
    """Whether a grouped-query ``sdpa`` variant can fold each group's query heads into rows
    (:func:`_sdpa_source`'s ``fold``): its scores depend on neither the query's head nor its
    position (no causal mask, no sinks, no dropout, a mask broadcast over both)."""
    if not gqa or causal or sinks or dropout_p > 0.0:
        return False
    if mask is None:
        return True
    ones = mask[1]
    return all(ones[a] for a in range(-min(3, len(ones)), -1))


# ---- attnc.torch.flex_attention: torch.nn.attention.flex_attention -----------------------------


class BlockMask:
    """What :func:`create_block_mask` returns: the mask function and the sizes it was made for.
    attnc classifies tiles (full, partial, empty) from the mask expression itself when it
    compiles, so nothing is materialised here. torch's own ``BlockMask`` is accepted too."""

    def __init__(self, mask_mod: Callable[..., Any], shape: Tuple[Any, Any, int, int]) -> None:
        self.mask_mod = mask_mod
        self.shape = shape

    def __repr__(self) -> str:
        return f"attnc.torch.BlockMask(shape={self.shape}, mask_mod={getattr(self.mask_mod, '__name__', self.mask_mod)})"


def create_block_mask(
    mask_mod: Callable[..., Any], B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int, device: Any = None, **_: Any
) -> BlockMask:
    """``torch.nn.attention.flex_attention.create_block_mask``: a mask from ``mask_mod(b, h,
    q_idx, kv_idx) -> bool`` (True: takes part). The sizes are recorded, not baked in: the
    program that uses it runs at any size."""
    if not callable(mask_mod):
        raise ArgumentError(f"mask_mod must be a function (b, h, q_idx, kv_idx) -> bool, not {type(mask_mod).__name__}")
    return BlockMask(mask_mod, (B, H, Q_LEN, KV_LEN))


# Per traced program (text and captured tensors' kinds): the program and its autograd wrapper.
_FLEX_PROGRAMS: Dict[Tuple[Any, ...], Tuple[Program, Callable[..., Any]]] = {}


def flex_attention(
    query: _torch.Tensor,
    key: _torch.Tensor,
    value: _torch.Tensor,
    score_mod: Optional[Callable[..., Any]] = None,
    block_mask: Optional[Any] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    **_: Any,
) -> _torch.Tensor:
    """``torch.nn.attention.flex_attention.flex_attention``, computed by attnc.

    ``query`` ``[B, Hq, L, E]``, ``key`` ``[B, H, S, E]``, ``value`` ``[B, H, S, Ev]``.
    ``score_mod(score, b, h, q_idx, kv_idx)`` and the block mask's ``mask_mod(b, h, q_idx,
    kv_idx)`` are traced once into an ``.attn`` program (arithmetic, comparisons, ``&``, ``|``,
    ``~``, ``torch.where``, ``torch.tanh``/``exp``/``sigmoid``/..., and indexing captured tensors
    by the indices). Captured tensors (ALiBi slopes, bias tables, document ids) become inputs of
    the program, with gradients for float ones. The program is compiled once per traced
    expression and reused at every sequence length; masked tiles are skipped where the mask is
    a function of positions. ``return_lse=True`` also returns the per-row log-sum-exp of the
    modified, masked scores ``[B, Hq, L]`` (natural log, as torch's), which is not differentiable;
    with gradients, the forward runs once more to form it.
    """
    from ._trace import Tracer, trace

    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, _torch.Tensor) or t.dim() != 4:
            raise ShapeError(f"{name} must be a 4-d torch.Tensor [B, H, S, D]")
        if t.device != query.device or t.device.type not in ("cpu", "cuda"):
            raise LayoutError(
                f"{name} is on {t.device}; attnc.torch.flex_attention runs CPU tensors, or CUDA tensors on one device, not {query.device} and {t.device}"
            )
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise DTypeError(f"query, key and value must have one dtype: got {query.dtype}, {key.dtype}, {value.dtype}")
    out_dtype = query.dtype
    cuda = query.device.type == "cuda"
    # bfloat16 runs as it is on CUDA; on the CPU in float32 (the binding widens it).
    dtype = {"float32": "f32", "float16": "f16", "bfloat16": "bf16" if cuda else "f32"}.get(str(out_dtype).replace("torch.", ""))
    if dtype is None:
        raise DTypeError(f"attnc.torch.flex_attention runs float32, float16 and bfloat16 tensors, not {out_dtype}")
    gqa = query.shape[1] != key.shape[1]
    if gqa and not enable_gqa:
        raise ShapeError(f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True for grouped-query attention")
    tracer = Tracer()
    mod = None
    if score_mod is not None:
        mod = trace(score_mod, ("scores", "b", "h", "i", "j"), ("f", "i", "i", "i", "i"), tracer, "score_mod")
    mask = None
    if block_mask is not None:
        mask_mod = getattr(block_mask, "mask_mod", None)
        if mask_mod is None:
            raise ArgumentError("block_mask must come from create_block_mask (attnc's or torch's)")
        mask = trace(mask_mod, ("b", "h", "i", "j"), ("i", "i", "i", "i"), tracer, "mask_mod")
        if mask.kind != "b":
            raise ArgumentError("mask_mod must return a bool (a comparison, `&`, `|`, `~`)")
    captured = [_captured(t) for t in tracer.tensors]
    kinds = tuple((c.dtype, c.dim()) for c in captured)
    scale_ = None if scale is None else float(scale)
    if _torch.compiler.is_compiling():
        # Under torch.compile: the traced program (compiled while tracing) through its ops,
        # `attnc::program` or, with gradients or `return_lse`, `attnc::program_saving`, whose
        # forward also returns the output and log-sum-exp; the captured tensors are inputs, so
        # the graph has no break.
        from ._ops import _flex_key, _has_split, call_key

        name = _flex_key(_flex_source(dtype, gqa, scale_, mod, mask, kinds), cuda)
        inputs = [query, key, value, *captured]
        if return_lse:
            if not _has_split(name):
                raise ArgumentError("return_lse=True: this score modification has no fused form that saves the log-sum-exp")
            outs = call_key(name, inputs, saving=True)
            out, lse = outs[0], outs[-1].reshape(query.shape[:3])
        else:
            out = call_key(name, inputs)
        out = out.to(out_dtype) if out.dtype != out_dtype else out
        return (out, lse) if return_lse else out
    threads = _torch.get_num_threads()
    target = "cuda" if cuda else "cpu"
    key_ = (dtype, gqa, scale_, None if mod is None else mod.text, None if mask is None else mask.text, kinds, threads, target)
    found = _cached(
        _FLEX_PROGRAMS, key_, lambda: _compile_entry(_flex_source(dtype, gqa, scale_, mod, mask, kinds), "flex", threads, target)
    )
    prog, differentiable = found
    args = [query, key, value]
    grad = _torch.is_grad_enabled() and any(a.requires_grad for a in (*args, *captured))
    if out_dtype == _torch.bfloat16 and not cuda and (grad or return_lse):
        # The autograd function saves float32 copies once (a plain run reads bfloat16 itself).
        args = [a.float() for a in args]
    args += captured
    lse = None
    if return_lse:
        split = _FLEX_SPLITS.get(key_, False)
        if split is False:
            split = _FLEX_SPLITS[key_] = prog.grad_split(["q"])
        if split is None:
            raise ArgumentError("return_lse=True: this score modification has no fused form that saves the log-sum-exp")
        saved = split[0](*(a.detach().contiguous() for a in args))
        lse = saved[-1].reshape(query.shape[0], query.shape[1], query.shape[2])
        if not grad:
            out = saved[0]
            return (out.to(out_dtype) if out.dtype != out_dtype else out), lse
    if grad:
        out = differentiable(*args)
    else:
        out = _run_plain(prog, args)
    out = out.to(out_dtype) if out.dtype != out_dtype else out
    return (out, lse) if return_lse else out


# Per traced program: its split forward (for return_lse), or None when it has none.
_FLEX_SPLITS: Dict[Tuple[Any, ...], Optional[Tuple[Program, Program]]] = {}


def _captured(t: _torch.Tensor) -> _torch.Tensor:
    """A captured tensor as the program reads it: float as float32 (differentiable), integers as
    int32, bool as bool."""
    if t.dtype == _torch.bool:
        return t
    if t.is_floating_point():
        return t if t.dtype == _torch.float32 else t.float()
    return t.to(_torch.int32)


def _compile_entry(text: str, entry: str, threads: int, target: str = "cpu") -> Program:
    from . import compile as _compile_program

    return _compile_program(text, entry=entry, threads=threads, target=target)


def _flex_source(dtype: str, gqa: bool, scale: Optional[float], mod: Any, mask: Any, kinds: Tuple[Tuple[Any, int], ...]) -> str:
    """The ``.attn`` program of one traced ``flex_attention`` (see :func:`flex_attention`)."""
    heads_q, heads_kv = ("Hk*R", "Hk") if gqa else ("H", "H")
    params = [
        f"q: {dtype}[B, {heads_q}, L, E]",
        f"k: {dtype}[B, {heads_kv}, S, E]",
        f"v: {dtype}[B, {heads_kv}, S, Ev]",
    ]
    for n, (dt, rank) in enumerate(kinds):
        t = {_torch.bool: "bool", _torch.int32: "i32"}.get(dt, "f32")
        dims = ", ".join(f"X{n}_{a}" for a in range(rank))
        params.append(f"x{n}: {t}[{dims}]" if rank else f"x{n}: {t}")
    factor = "/ sqrt(E)" if scale is None else f"* {scale!r}"
    if gqa:
        body = [
            "let qg = reshape(q, [B, Hk, R, L, E])",
            f"let scores = qg @ unsqueeze(k, 2).T {factor}",
            "let (b, hk, r, i, j) = indices(scores)",
            "let h = hk * R + r",
        ]
        vv, out = "unsqueeze(v, 2)", "[B, Hk*R, L, Ev]"
    else:
        body = [f"let scores = q @ k.T {factor}", "let (b, h, i, j) = indices(scores)"]
        vv, out = "v", None
    s = "scores" if mod is None else (mod.text if mod.kind == "f" else f"cast({mod.text}, f32)")
    body.append(f"let modified = {s}")
    weights = "softmax(modified, axis = -1)" if mask is None else f"softmax(where({mask.text}, modified, -inf), axis = -1)"
    body.append(f"let o = {weights} @ {vv}")
    body.append(f"return reshape(o, {out})" if out else "return o")
    head = f"fn flex({', '.join(params)}) -> {dtype}[B, {heads_q}, L, Ev] {{"
    return "\n".join([head] + ["    " + line for line in body] + ["}", ""])


def ring_attention(*args: Any, **kwargs: Any) -> _torch.Tensor:
    """Context-parallel attention over a ``torch.distributed`` group: see
    :func:`attnc._ring.ring_attention` (and ``attnc._ring.shard``/``unshard`` for the layout)."""
    from ._ring import ring_attention as ring

    return ring(*args, **kwargs)


# ---- attnc.torch.varlen_attention: FlashAttention's flash_attn_varlen_func ----------------------

_VARLEN_PROGRAMS: Dict[Tuple[Any, ...], Tuple[Program, Callable[..., Any]]] = {}


def varlen_attention(
    q: _torch.Tensor,
    k: _torch.Tensor,
    v: _torch.Tensor,
    cu_seqlens_q: _torch.Tensor,
    cu_seqlens_k: _torch.Tensor,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
) -> _torch.Tensor:
    """Attention over a ragged batch packed without padding, with FlashAttention's
    ``flash_attn_varlen_func`` conventions: ``q`` ``[total_q, H, D]``, ``k`` ``[total_k, Hk, D]``
    and ``v`` ``[total_k, Hk, Dv]`` (``H`` a multiple of ``Hk``: grouped-query attention without
    repeating K and V), sequence ``s`` being rows ``cu_seqlens_q[s] .. cu_seqlens_q[s + 1]`` of
    ``q`` and ``cu_seqlens_k[s] ..`` of ``k`` and ``v``; ``causal`` aligned bottom-right (the
    last query of a sequence sees every one of its keys, as FlashAttention aligns it when a
    sequence has fewer queries than keys: chunked prefill, a prefix cache). Returns
    ``[total_q, H, Dv]``, differentiable. The sequence tables are inputs of one compiled program
    (``examples/varlen_kv.attn``'s form), reused for every batch; each call classifies the
    tiles from them, so tiles across two sequences are skipped. ``max_seqlen_*`` are accepted
    for compatibility and not needed."""
    del max_seqlen_q, max_seqlen_k
    if _torch.compiler.is_compiling():
        # Under torch.compile: the registered op (`attnc::varlen`), so the graph has no break
        # (the sequence tables are read where it runs).
        # With gradients, `attnc::varlen_saving` also returns what the backward reads.
        cu_q, cu_k = _torch.as_tensor(cu_seqlens_q), _torch.as_tensor(cu_seqlens_k)
        flags = (bool(causal), None if softmax_scale is None else float(softmax_scale))
        if _torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return _torch.ops.attnc.varlen_saving(q, k, v, cu_q, cu_k, *flags)[0]
        return _torch.ops.attnc.varlen(q, k, v, cu_q, cu_k, *flags)
    prog, differentiable, args = _varlen_prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    return _run_either(prog, differentiable, args, q.dtype)


def _varlen_prepare(
    q: _torch.Tensor, k: _torch.Tensor, v: _torch.Tensor, cu_seqlens_q: Any, cu_seqlens_k: Any, causal: bool, softmax_scale: Optional[float]
) -> Tuple[Program, Callable[..., Any], List[_torch.Tensor]]:
    """The checked arguments of a :func:`varlen_attention` call: its program (compiled on first
    use), the program as an autograd function, and its inputs (q, k, v, then the sequence
    tables)."""
    cuda = isinstance(q, _torch.Tensor) and q.is_cuda
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, _torch.Tensor) or t.dim() != 3:
            raise ShapeError(f"{name} must be a [tokens, heads, head width] tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if (t.device != q.device) if cuda else (t.device.type != "cpu"):
            raise LayoutError(f"{name} is on {t.device}; attnc.torch.varlen_attention runs CPU tensors, or CUDA tensors on one device")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise DTypeError(f"q, k and v must have one dtype: got {q.dtype}, {k.dtype}, {v.dtype}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if v.shape[1] != kv_heads or k.shape[0] != v.shape[0] or k.shape[2] != q.shape[2] or kv_heads == 0 or heads % kv_heads:
        raise ShapeError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must share tokens and heads, k the width of q {tuple(q.shape)}, "
            "and q's heads be a multiple of theirs"
        )
    cu = []
    for name, c, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        c = _torch.as_tensor(c)
        if c.dim() != 1 or c.numel() < 1 or c.dtype.is_floating_point:
            raise ShapeError(f"{name} must be a 1-d integer tensor of cumulative lengths, got {tuple(c.shape)} {c.dtype}")
        c = c.to(_torch.int64).cpu()
        if int(c[0]) != 0 or int(c[-1]) != total or bool((c[1:] < c[:-1]).any()):
            raise ShapeError(f"{name} must rise from 0 to {total} (the packed tokens), got {c.tolist()}")
        cu.append(c)
    if cu[0].numel() != cu[1].numel():
        raise ShapeError(f"cu_seqlens_q and cu_seqlens_k must name as many sequences: {cu[0].numel() - 1} and {cu[1].numel() - 1}")
    lens_q, lens_k = cu[0][1:] - cu[0][:-1], cu[1][1:] - cu[1][:-1]
    if causal and bool((lens_q > lens_k).any()):
        raise ShapeError("causal (bottom-right aligned) needs each sequence to have no more queries than keys")
    seqs = _torch.arange(lens_q.numel())
    seq_q, seq_k = _torch.repeat_interleave(seqs, lens_q), _torch.repeat_interleave(seqs, lens_k)
    # Positions in each sequence; the queries' shifted so that the last sits at the last key.
    pos_k = _torch.arange(k.shape[0]) - cu[1][seq_k]
    pos_q = _torch.arange(q.shape[0]) - cu[0][seq_q] + (lens_k - lens_q)[seq_q]
    args, _ = _attention_args([q, k, v], "attnc.torch.varlen_attention", cuda)
    # The sequence tables stay on the host (a CUDA call passes them as host copies too).
    args += [t.to(_torch.int32) for t in (seq_q, seq_k, pos_q, pos_k)]
    prog, differentiable = _varlen_program(q, causal, softmax_scale)
    return prog, differentiable, args


def _varlen_program(q: _torch.Tensor, causal: bool, softmax_scale: Optional[float]) -> Tuple[Program, Callable[..., Any]]:
    """The :func:`varlen_attention` program for ``q``'s dtype and device (compiled on first use)
    and its autograd function: what a call's shapes and flags decide, not its sequence tables."""
    cuda = q.is_cuda
    _, dtype = _attention_args([q], "attnc.torch.varlen_attention", cuda)
    threads = _torch.get_num_threads()
    scale = None if softmax_scale is None else float(softmax_scale)
    target = "cuda" if cuda else "cpu"
    key_ = (dtype, bool(causal), scale, threads, target)
    return _cached(_VARLEN_PROGRAMS, key_, lambda: _compile_entry(_varlen_source(dtype, bool(causal), scale), "varlen", threads, target))


def _varlen_source(dtype: str, causal: bool, scale: Optional[float]) -> str:
    """The ``.attn`` program of :func:`varlen_attention` (heads in groups of ``G`` query heads
    per K/V head)."""
    factor = "/ sqrt(E)" if scale is None else f"* {scale!r}"
    keep = "seq_q[i] == seq_k[j] && pos_k[j] <= pos_q[i]" if causal else "seq_q[i] == seq_k[j]"
    return "\n".join(
        [
            f"fn varlen(q: {dtype}[Tq, Hk*G, E], k: {dtype}[Tk, Hk, E], v: {dtype}[Tk, Hk, Ev],",
            "          seq_q: i32[Tq], seq_k: i32[Tk], pos_q: i32[Tq], pos_k: i32[Tk]) -> "
            f"{dtype}[Tq, Hk*G, Ev] {{",
            "    let qh = permute(reshape(q, [Tq, Hk, G, E]), [1, 2, 0, 3])      # [Hk, G, Tq, E]",
            "    let kh = unsqueeze(permute(k, [1, 0, 2]), 1)                     # [Hk, 1, Tk, E]",
            "    let vh = unsqueeze(permute(v, [1, 0, 2]), 1)                     # [Hk, 1, Tk, Ev]",
            f"    let scores = qh @ kh.T {factor}",
            "    let (h, g, i, j) = indices(scores)",
            f"    let out = softmax(where({keep}, scores, -inf), axis = -1) @ vh",
            "    return reshape(permute(out, [2, 0, 1, 3]), [Tq, Hk*G, Ev])",
            "}",
            "",
        ]
    )

_PAGED_PROGRAMS: Dict[Tuple[Any, ...], Tuple[Program, Callable[..., Any]]] = {}


def paged_attention(
    q: _torch.Tensor,
    k_cache: _torch.Tensor,
    v_cache: _torch.Tensor,
    block_table: _torch.Tensor,
    cache_seqlens: _torch.Tensor,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
) -> _torch.Tensor:
    """Attention of new queries against a paged KV cache read in place through its block table,
    with FlashAttention's ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=…,
    block_table=…)`` conventions: ``q`` ``[B, Sq, H, D]``, ``k_cache`` ``[pages, page size, Hk,
    D]`` and ``v_cache`` ``[pages, page size, Hk, Dv]`` (vLLM's and FlashAttention's NHD layout;
    ``H`` a multiple of ``Hk``), ``block_table`` int ``[B, pages per sequence]`` (entries past a
    sequence's pages are ignored; ids outside the pool read its nearest page) and
    ``cache_seqlens`` ``[B]``, each sequence's cached tokens (the new queries' keys included).
    ``causal`` aligns bottom-right: query ``x`` of ``Sq`` sees tokens up to ``cache_seqlens[b] −
    Sq + x`` (decode: ``Sq = 1`` sees them all); else every cached token. Returns ``[B, Sq, H,
    Dv]``. One compiled program (``paged(pages, table)``, docs/serving.md) serves every batch,
    cache size and length: the pages are never copied, and key tiles past every sequence's end
    are skipped. Not differentiable (a cache is not trained). CPU tensors, or CUDA tensors
    (the table and lengths are read on the host)."""
    if _torch.compiler.is_compiling():
        # Under torch.compile: the registered op (`attnc::paged`), so the graph has no break
        # (the table and lengths are read where it runs).
        # (Detached, as the eager call's result has no history: a cache is not trained.)
        table, lens = _torch.as_tensor(block_table), _torch.as_tensor(cache_seqlens)
        scale = None if softmax_scale is None else float(softmax_scale)
        return _torch.ops.attnc.paged(q.detach(), k_cache.detach(), v_cache.detach(), table, lens, bool(causal), scale)
    cuda = isinstance(q, _torch.Tensor) and q.is_cuda
    for name, t, rank in (("q", q, 4), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        if not isinstance(t, _torch.Tensor) or t.dim() != rank:
            raise ShapeError(f"{name} must be a {rank}-d tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if (t.device != q.device) if cuda else (t.device.type != "cpu"):
            raise LayoutError(f"{name} is on {t.device}; attnc.torch.paged_attention runs CPU tensors, or CUDA tensors on one device")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise DTypeError(f"q, k_cache and v_cache must have one dtype: got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    batch, heads, kv_heads = q.shape[0], q.shape[2], k_cache.shape[2]
    if (
        v_cache.shape[:3] != k_cache.shape[:3]
        or k_cache.shape[3] != q.shape[3]
        or kv_heads == 0
        or heads % kv_heads
        or k_cache.shape[0] == 0
    ):
        raise ShapeError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must share pages, page size and heads, "
            f"k_cache the width of q {tuple(q.shape)}, q's heads be a multiple of theirs, and the pool hold a page"
        )
    table, lens = _torch.as_tensor(block_table), _torch.as_tensor(cache_seqlens)
    if table.dim() != 2 or table.shape[0] != batch or table.dtype.is_floating_point:
        raise ShapeError(f"block_table must be an integer [batch, pages per sequence] tensor, got {tuple(table.shape)} {table.dtype}")
    if lens.dim() != 1 or lens.shape[0] != batch or lens.dtype.is_floating_point:
        raise ShapeError(f"cache_seqlens must be an integer [batch] tensor, got {tuple(lens.shape)} {lens.dtype}")
    room = table.shape[1] * k_cache.shape[1]
    if bool((lens < (q.shape[1] if causal else 0)).any()) or bool((lens > room).any()):
        raise ShapeError(
            f"cache_seqlens {lens.tolist()} must lie within the table's {room} tokens"
            + (f" and hold the {q.shape[1]} new queries' keys (causal)" if causal else "")
        )
    args, dtype = _attention_args([q, k_cache, v_cache], "attnc.torch.paged_attention", cuda)
    # The table and lengths on the host: the tiles are classified from them there (a CUDA call
    # passes them as host copies too; a table already on the GPU is read back once per call).
    args += [table.to(_torch.int32).cpu().contiguous(), lens.to(_torch.int32).cpu().contiguous()]
    threads = _torch.get_num_threads()
    scale = None if softmax_scale is None else float(softmax_scale)
    target = "cuda" if cuda else "cpu"
    key_ = (dtype, bool(causal), scale, threads, target)
    found = _cached(
        _PAGED_PROGRAMS, key_, lambda: _compile_entry(_paged_source(dtype, bool(causal), scale), "paged_kv", threads, target)
    )
    with _torch.no_grad():
        return _run_either(found[0], found[1], args, q.dtype)


def _paged_source(dtype: str, causal: bool, scale: Optional[float]) -> str:
    """The ``.attn`` program of :func:`paged_attention`: query heads in groups of ``G`` per K/V
    head, each group's rows ``g·S + x`` (so that K and V stay a transpose of the paged read,
    which the flash kernel reads in place), query ``x = r % S``."""
    factor = "/ sqrt(E)" if scale is None else f"* {scale!r}"
    keep = "j <= lens[b] - S + r % S" if causal else "j < lens[b]"
    return "\n".join(
        [
            f"fn paged_kv(q: {dtype}[B, S, Hk*G, E], k_pages: {dtype}[NP, P, Hk, E], v_pages: {dtype}[NP, P, Hk, Ev],",
            f"            block_table: i32[B, MP], lens: i32[B]) -> {dtype}[B, S, Hk*G, Ev] {{",
            "    let qh = reshape(permute(reshape(q, [B, S, Hk, G, E]), [0, 2, 3, 1, 4]), [B, Hk, G*S, E])",
            "    let k = permute(paged(k_pages, block_table), [0, 2, 1, 3])       # [B, Hk, MP*P, E], in place",
            "    let v = permute(paged(v_pages, block_table), [0, 2, 1, 3])",
            f"    let scores = qh @ k.T {factor}",
            "    let (b, h, r, j) = indices(scores)",
            f"    let out = softmax(where({keep}, scores, -inf), axis = -1) @ v   # [B, Hk, G*S, Ev]",
            "    return reshape(permute(reshape(out, [B, Hk, G, S, Ev]), [0, 3, 1, 2, 4]), [B, S, Hk*G, Ev])",
            "}",
            "",
        ]
    )


# The drop-ins as torch.library ops, for torch.compile (registered on import).
from . import _ops  # noqa: E402, F401
