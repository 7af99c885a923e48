"""attnc as ``torch.library`` ops, for ``torch.compile``: the drop-ins of :mod:`attnc.torch`
(``attnc::sdpa`` and ``attnc::sdpa_saving``, ``attnc::varlen`` and ``attnc::varlen_saving``,
``attnc::paged``) and any
program (``attnc::program`` and ``attnc::program_saving``, which ``flex_attention``'s traced
programs take too), with the backward ops of the differentiable ones, each with a fake
implementation and an autograd formula. Under ``torch.compile`` the Python API calls these, so
a model that uses it compiles without a graph break; an op's implementation is the eager path,
and the backward ops run the split or derived programs directly, below autograd."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch as _torch

from . import Program
from ._errors import ArgumentError
from .torch import _compile_entry, _sdpa, _sdpa_prepare, _varlen_prepare, _varlen_program, paged_attention, varlen_attention

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


# Per sdpa program and the inputs differentiated: its split forward/backward (None: none).
_SDPA_SPLITS: Dict[Tuple[Program, Tuple[str, ...]], Optional[Tuple[Program, Program]]] = {}


def _sdpa_grad_setup(
    query: _torch.Tensor,
    key: _torch.Tensor,
    value: _torch.Tensor,
    attn_mask: Optional[_torch.Tensor],
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    softcap: Optional[float],
    sinks: Optional[_torch.Tensor],
    dropout_p: float,
    seed: Optional[_torch.Tensor],
) -> Tuple[Program, Optional[Tuple[Program, Program]], List[_torch.Tensor], List[str], _torch.dtype]:
    """An sdpa call with gradients as its forward and backward ops run it: the program, its
    split (None where it has none), its inputs, the inputs differentiated, the result's dtype.
    A float mask is taken whole (no broadcast axis folded away), so that its gradient is per
    element; tensors dense (`in_place=False`: the program's layout is the caller's)."""
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    mask = attn_mask.contiguous() if float_mask and attn_mask is not None else attn_mask
    prog, _, args, out_dtype, _ = _sdpa_prepare(query, key, value, mask, is_causal, scale, enable_gqa, softcap, sinks, dropout_p, in_place=False)
    if dropout_p > 0.0 and seed is not None:
        args.append(seed.to(_torch.int32).reshape(()))
    wrt = ["q", "k", "v"] + (["mask"] if float_mask else []) + (["sink"] if sinks is not None else [])
    if (prog, tuple(wrt)) not in _SDPA_SPLITS:
        _SDPA_SPLITS[prog, tuple(wrt)] = prog.grad_split(wrt)
    return prog, _SDPA_SPLITS[prog, tuple(wrt)], [a.detach() for a in args], wrt, out_dtype


@_torch.library.custom_op("attnc::sdpa_saving", mutates_args=())
def _sdpa_saving_op(
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
) -> List[_torch.Tensor]:
    # The forward with gradients wanted: the result, then what the split backward reads (each
    # flash op's output and log-sum-exp), or the result alone where there is no split.
    _, split, args, _, out_dtype = _sdpa_grad_setup(query, key, value, attn_mask, is_causal, scale, enable_gqa, softcap, sinks, dropout_p, seed)
    with _torch.no_grad():
        if split is None:
            outs = [_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks, seed)]
        else:
            found = split[0](*args)
            outs = list(found) if isinstance(found, tuple) else [found]
    return [outs[0].to(out_dtype).contiguous()] + [o.contiguous() for o in outs[1:]]


@_sdpa_saving_op.register_fake
def _sdpa_saving_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks=None, seed=None):  # type: ignore[no-untyped-def]
    _, split, args, _, _ = _sdpa_grad_setup(query, key, value, attn_mask, is_causal, scale, enable_gqa, softcap, sinks, dropout_p, seed)
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))
    return [out] + ([] if split is None else _empty_results(split[0], args)[1:])


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
    sinks: Optional[_torch.Tensor],
    dropout_p: float,
    seed: Optional[_torch.Tensor],
    saved: List[_torch.Tensor],
) -> Tuple[_torch.Tensor, _torch.Tensor, _torch.Tensor, _torch.Tensor, _torch.Tensor]:
    # A custom op runs below autograd: the split backward on what `attnc::sdpa_saving` saved,
    # or (nothing saved) the derived program, which runs the forward again. Dropout draws the
    # forward's weights again from its seed.
    prog, split, args, wrt, _ = _sdpa_grad_setup(query, key, value, attn_mask, is_causal, scale, enable_gqa, softcap, sinks, dropout_p, seed)
    cot = grad.to(args[0].dtype).contiguous()
    if saved and split is not None:
        outs = split[1](*args, cot, *saved)
    else:
        outs = prog.grad(wrt)(*args, cot)
    grads = dict(zip(wrt, (g.to(query.dtype) for g in outs[len(outs) - len(wrt) :])))
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    mask_grad = grads["mask"].reshape(attn_mask.shape) if float_mask and attn_mask is not None else query.new_empty(0)
    sink_grad = grads["sink"] if sinks is not None else query.new_empty(0)
    return grads["q"], grads["k"], grads["v"], mask_grad, sink_grad


@_sdpa_backward_op.register_fake
def _sdpa_backward_fake(grad, query, key, value, attn_mask, is_causal, scale, enable_gqa, softcap, sinks, dropout_p, seed, saved):  # type: ignore[no-untyped-def]
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    mask_grad = attn_mask.new_empty(attn_mask.shape) if float_mask else query.new_empty(0)
    sink_grad = sinks.new_empty(sinks.shape) if sinks is not None else query.new_empty(0)
    return _torch.empty_like(query), _torch.empty_like(key), _torch.empty_like(value), mask_grad, sink_grad


# ---- flex_attention under torch.compile: its traced program, through attnc::program ------------

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



def _sdpa_setup(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks, seed = inputs
    # (`attnc::sdpa_saving`'s outputs past the result are what its backward reads.)
    saved = list(output[1:]) if isinstance(output, (list, tuple)) else []
    ctx.save_for_backward(query, key, value, attn_mask, sinks, seed, *saved)
    ctx.flags = (is_causal, scale, enable_gqa, softcap)
    ctx.dropout_p = dropout_p
    if saved:
        ctx.mark_non_differentiable(*saved)


def _sdpa_backward(ctx: Any, grad: Any, *_saved_grads: Any) -> Tuple[Any, ...]:
    query, key, value, attn_mask, sinks, seed, *saved = ctx.saved_tensors
    grad = grad[0] if isinstance(grad, (list, tuple)) else grad
    dq, dk, dv, dm, ds = _torch.ops.attnc.sdpa_backward(grad, query, key, value, attn_mask, *ctx.flags, sinks, ctx.dropout_p, seed, saved)
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    sink_grad = ds.to(sinks.dtype) if sinks is not None else None
    return dq, dk, dv, (dm if float_mask else None), None, None, None, None, None, sink_grad, None


_sdpa_op.register_autograd(_sdpa_backward, setup_context=_sdpa_setup)
_sdpa_saving_op.register_autograd(_sdpa_backward, setup_context=_sdpa_setup)


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


# Per varlen program: its split forward/backward over q, k and v (None: none).
_VARLEN_SPLITS: Dict[Program, Optional[Tuple[Program, Program]]] = {}


def _varlen_split(prog: Program) -> Optional[Tuple[Program, Program]]:
    if prog not in _VARLEN_SPLITS:
        _VARLEN_SPLITS[prog] = prog.grad_split(["q", "k", "v"])
    return _VARLEN_SPLITS[prog]


def _varlen_grad_setup(
    q: _torch.Tensor, k: _torch.Tensor, v: _torch.Tensor, cu_seqlens_q: _torch.Tensor, cu_seqlens_k: _torch.Tensor, causal: bool, scale: Optional[float]
) -> Tuple[Program, Optional[Tuple[Program, Program]], List[_torch.Tensor]]:
    """A varlen call with gradients as its forward and backward ops run it: the program, its
    split, and its inputs (bfloat16 widened on the CPU, as the eager autograd function reads it)."""
    prog, _, args = _varlen_prepare(q.detach(), k.detach(), v.detach(), cu_seqlens_q, cu_seqlens_k, causal, scale)
    args = [a.float() if a.dtype == _torch.bfloat16 and not a.is_cuda else a for a in args]
    return prog, _varlen_split(prog), args


@_torch.library.custom_op("attnc::varlen_saving", mutates_args=())
def _varlen_saving_op(
    q: _torch.Tensor, k: _torch.Tensor, v: _torch.Tensor, cu_seqlens_q: _torch.Tensor, cu_seqlens_k: _torch.Tensor, causal: bool, scale: Optional[float]
) -> List[_torch.Tensor]:
    # The forward with gradients wanted: the result, then what the split backward reads (the
    # flash op's output and log-sum-exp), or the result alone where there is no split.
    _, split, args = _varlen_grad_setup(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
    with _torch.no_grad():
        if split is None:
            outs = [varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, softmax_scale=scale)]
        else:
            found = split[0](*args)
            outs = list(found) if isinstance(found, tuple) else [found]
    return [outs[0].to(q.dtype).contiguous()] + [o.contiguous() for o in outs[1:]]


@_varlen_saving_op.register_fake
def _varlen_saving_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale):  # type: ignore[no-untyped-def]
    # The sequence tables' values are not known here, only their lengths (one entry per token).
    prog, _ = _varlen_program(q, causal, scale)
    split = _varlen_split(prog)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if split is None:
        return [out]
    tables = [q.new_empty((n,), dtype=_torch.int32) for n in (q.shape[0], k.shape[0], q.shape[0], k.shape[0])]
    return [out] + _empty_results(split[0], [q, k, v, *tables])[1:]


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
    saved: List[_torch.Tensor],
) -> Tuple[_torch.Tensor, _torch.Tensor, _torch.Tensor]:
    # Below autograd: the split backward on what `attnc::varlen_saving` saved, or (nothing
    # saved) the derived program, which runs the forward again.
    prog, split, args = _varlen_grad_setup(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
    cot = grad.to(args[0].dtype).contiguous()
    if saved and split is not None:
        outs = split[1](*args, cot, *saved)
    else:
        outs = prog.grad(["q", "k", "v"])(*args, cot)
    return outs[-3].to(q.dtype), outs[-2].to(k.dtype), outs[-1].to(v.dtype)


@_varlen_backward_op.register_fake
def _varlen_backward_fake(grad, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, saved):  # type: ignore[no-untyped-def]
    return _torch.empty_like(q), _torch.empty_like(k), _torch.empty_like(v)


def _varlen_setup(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    q, k, v, cu_q, cu_k, causal, scale = inputs
    # (`attnc::varlen_saving`'s outputs past the result are what its backward reads.)
    saved = list(output[1:]) if isinstance(output, (list, tuple)) else []
    ctx.save_for_backward(q, k, v, cu_q, cu_k, *saved)
    ctx.flags = (causal, scale)
    if saved:
        ctx.mark_non_differentiable(*saved)


def _varlen_backward(ctx: Any, grad: Any, *_saved_grads: Any) -> Tuple[Any, ...]:
    q, k, v, cu_q, cu_k, *saved = ctx.saved_tensors
    grad = grad[0] if isinstance(grad, (list, tuple)) else grad
    dq, dk, dv = _torch.ops.attnc.varlen_backward(grad, q, k, v, cu_q, cu_k, *ctx.flags, saved)
    return dq, dk, dv, None, None, None, None


_varlen_op.register_autograd(_varlen_backward, setup_context=_varlen_setup)
_varlen_saving_op.register_autograd(_varlen_backward, setup_context=_varlen_setup)


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


# ---- attnc::program: any attnc.Program called under torch.compile ------------------------------

# Programs called under torch.compile, by the key the ops name them with.
_PROGRAMS: Dict[str, Program] = {}
# Their derived gradient programs (every float parameter differentiated), by key.
_GRADS: Dict[str, Program] = {}
# Their split forward/backward programs (`Program.grad_split`), by key; None where there is none.
_SPLITS: Dict[str, Optional[Tuple[Program, Program]]] = {}
_FLOATS = ("f32", "f16", "bf16")
_TORCH_DTYPES = {"f32": _torch.float32, "f16": _torch.float16, "bf16": _torch.bfloat16, "i32": _torch.int32, "bool": _torch.bool}


def call_program(prog: Program, args: Tuple[Any, ...], named: Dict[str, Any]) -> Any:
    """``prog(*args, **named)`` under ``torch.compile``: the registered ops on the inputs in
    parameter order (Python numbers become 0-d tensors of the parameter's dtype), so the graph
    has no break; differentiable in its float inputs."""
    from . import _bind

    key = _program_key(prog)
    dtypes = _param_dtypes(key)
    slots = _bind([name for name, _, _ in prog.params], args, named, prog.entry)
    inputs = [x if isinstance(x, _torch.Tensor) else _torch.tensor(x, dtype=_TORCH_DTYPES[d]) for x, d in zip(slots, dtypes)]
    return call_key(key, inputs)


def call_key(key: str, inputs: List[_torch.Tensor], saving: bool = False) -> Any:
    """The program registered under ``key`` on ``inputs`` (in parameter order), as an op: with
    gradients wanted and a split form, ``attnc::program_saving``, whose forward also returns
    what the backward reads (each flash op's result and log-sum-exp), so that the backward does
    not run the forward again; else ``attnc::program``. ``saving=True`` always takes the split
    forward and returns all it returns (``flex_attention``'s ``return_lse`` reads the last)."""
    results = _result_count(key)
    if saving or (_torch.is_grad_enabled() and any(t.requires_grad for t in inputs) and _has_split(key)):
        outs = _torch.ops.attnc.program_saving(key, inputs)
        if saving:
            return outs
        outs = outs[:results]
    else:
        outs = _torch.ops.attnc.program(key, inputs)
    return outs[0] if results == 1 else tuple(outs)


@_torch.compiler.assume_constant_result
def _program_key(prog: Program) -> str:
    """The name the ops call ``prog`` by (registered here; run once while tracing, its result
    a constant of the graph): entry, target, threads and a digest of the source."""
    return _register(prog)


def _register(prog: Program) -> str:
    import hashlib

    key = f"{prog.entry}:{prog.target}:{prog._compiled.threads}:{hashlib.sha1(prog.source.encode()).hexdigest()[:20]}"
    _PROGRAMS.setdefault(key, prog)
    return key


@_torch.compiler.assume_constant_result
def _flex_key(text: str, cuda: bool) -> str:
    """The key of the traced ``flex_attention`` program ``text``, compiled and registered."""
    return _register(_flex_program(text, cuda))


@_torch.compiler.assume_constant_result
def _param_dtypes(key: str) -> Tuple[str, ...]:
    return tuple(dtype for _, dtype, _ in _PROGRAMS[key].params)


@_torch.compiler.assume_constant_result
def _result_count(key: str) -> int:
    return len(_PROGRAMS[key].outputs)


@_torch.compiler.assume_constant_result
def _has_split(key: str) -> bool:
    return _split(key) is not None


def _split(key: str) -> Optional[Tuple[Program, Program]]:
    if key not in _SPLITS:
        wrt = _wrt(_PROGRAMS[key])
        _SPLITS[key] = _PROGRAMS[key].grad_split(list(wrt)) if wrt else None
    return _SPLITS[key]


def _wrt(prog: Program) -> Tuple[str, ...]:
    """The parameters the ops differentiate: every float one."""
    return tuple(name for name, dtype, _ in prog.params if dtype in _FLOATS)


@_torch.library.custom_op("attnc::program", mutates_args=())
def _program_op(key: str, inputs: List[_torch.Tensor]) -> List[_torch.Tensor]:
    with _torch.no_grad():
        outs = _PROGRAMS[key](*inputs)
    return [o.contiguous() for o in (outs if isinstance(outs, tuple) else (outs,))]


@_program_op.register_fake
def _program_fake(key, inputs):  # type: ignore[no-untyped-def]
    return _empty_results(_PROGRAMS[key], inputs)


def _empty_results(prog: Program, inputs: List[_torch.Tensor]) -> List[_torch.Tensor]:
    """Empty tensors of ``prog``'s results on ``inputs``: their dtypes, and shapes from the
    program's dims (symbolic where the inputs' are)."""
    shapes = _result_shapes(prog, [list(t.shape) for t in inputs])
    device = inputs[0].device if inputs else None
    return [_torch.empty(shape, dtype=_TORCH_DTYPES[dtype], device=device) for (_, dtype, _), shape in zip(prog.outputs, shapes)]


@_torch.library.custom_op("attnc::program_saving", mutates_args=())
def _program_saving_op(key: str, inputs: List[_torch.Tensor]) -> List[_torch.Tensor]:
    split = _split(key)
    if split is None:
        raise ArgumentError(f"`{_PROGRAMS[key].entry}` has no split form that saves what its backward reads")
    with _torch.no_grad():
        outs = split[0](*inputs)
    return [o.contiguous() for o in (outs if isinstance(outs, tuple) else (outs,))]


@_program_saving_op.register_fake
def _program_saving_fake(key, inputs):  # type: ignore[no-untyped-def]
    split = _split(key)
    if split is None:
        raise ArgumentError(f"`{_PROGRAMS[key].entry}` has no split form that saves what its backward reads")
    return _empty_results(split[0], inputs)


def _result_shapes(prog: Program, shapes: List[List[Any]]) -> List[List[Any]]:
    """The results' shapes for inputs of ``shapes``: from the program itself where every size
    is a number; where some are symbolic (``torch.compile``'s dynamic shapes), each result dim
    is its expression (``S``, ``H*Dh``, ``2*(D/2)``) evaluated over the sizes the parameters
    bind, names or whole expressions."""
    if all(isinstance(n, int) for shape in shapes for n in shape):
        return [shape for _, shape in prog._compiled._output_shapes(shapes, None)]
    import ast

    bound: Dict[str, Any] = {}
    sizes = [(d, n) for (_, _, dims), shape in zip(prog.params, shapes) for d, n in zip(dims, shape)]
    for d, n in sizes:
        bound.setdefault(d, n)
    # Names inside compound sizes, solved one at a time: `2*D` gives D, `G*R` gives R once G is
    # known, `S+4` gives S.
    for _ in range(len(sizes)):
        progress = False
        for d, n in sizes:
            node = ast.parse(d, mode="eval").body
            if not isinstance(node, ast.BinOp) or not isinstance(node.op, (ast.Mult, ast.Add, ast.Sub)):
                continue
            known = {side: _known(side, bound) for side in (node.left, node.right)}
            unknown = [side for side, k in known.items() if k is None and isinstance(side, ast.Name)]
            if len(unknown) != 1 or sum(k is None for k in known.values()) != 1:
                continue
            (name,) = unknown
            other = known[node.right if name is node.left else node.left]
            if isinstance(node.op, ast.Mult):
                bound[name.id] = n // other
            elif isinstance(node.op, ast.Add):
                bound[name.id] = n - other
            else:
                bound[name.id] = n + other if name is node.left else other - n
            progress = True
        if not progress:
            break

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in bound:
            return bound[node.id]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            a, b = value(node.left), value(node.right)
            ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b, ast.Div: lambda: a // b}
            return ops[type(node.op)]()
        raise ArgumentError(
            f"`{prog.entry}`'s result size `{ast.unparse(node)}` is not given by its inputs' sizes, so torch.compile cannot "
            "infer it: call the program outside the compiled region (or pass dims= eagerly)"
        )

    return [[bound[d] if d in bound else value(ast.parse(d, mode="eval")) for d in dims] for _, _, dims in prog.outputs]


def _known(node: Any, bound: Dict[str, Any]) -> Any:
    """A size's value where ``node`` is a number or a bound name, else None."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    return None


@_torch.library.custom_op("attnc::program_backward", mutates_args=())
def _program_backward_op(key: str, inputs: List[_torch.Tensor], cotangents: List[_torch.Tensor], saved: List[_torch.Tensor]) -> List[_torch.Tensor]:
    # Below autograd: the split backward on what the forward saved, or, without it, the derived
    # program (which runs the forward again); every float parameter differentiated.
    prog = _PROGRAMS[key]
    wrt = _wrt(prog)
    cots = [c.contiguous() for c, (_, dtype, _) in zip(cotangents, prog.outputs) if dtype in _FLOATS]
    if saved:
        split = _split(key)
        if split is None:
            raise ArgumentError(f"`{prog.entry}` has no split form that saves what its backward reads")
        program, extra = split[1], list(saved)
    else:
        if key not in _GRADS:
            _GRADS[key] = prog.grad(list(wrt))
        program, extra = _GRADS[key], []
    with _torch.no_grad():
        outs = program(*inputs, *cots, *extra)
    outs = outs if isinstance(outs, tuple) else (outs,)
    found = dict(zip(wrt, outs[len(outs) - len(wrt) :]))
    return [found[name].to(t.dtype) if name in found else t.new_empty(0) for (name, _, _), t in zip(prog.params, inputs)]


@_program_backward_op.register_fake
def _program_backward_fake(key, inputs, cotangents, saved):  # type: ignore[no-untyped-def]
    prog = _PROGRAMS[key]
    return [_torch.empty_like(t) if dtype in _FLOATS else t.new_empty(0) for (_, dtype, _), t in zip(prog.params, inputs)]


def _program_setup(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    key, tensors = inputs
    prog = _PROGRAMS[key]
    n = len(prog.outputs)
    ctx.key, ctx.inputs = key, len(tensors)
    # (The saving op's extra outputs, past the results, are what its backward reads.)
    ctx.save_for_backward(*tensors, *output[n:])
    ctx.mark_non_differentiable(*[o for o, (_, dtype, _) in zip(output, prog.outputs) if dtype not in _FLOATS], *output[n:])


def _program_backward(ctx: Any, cotangents: List[Optional[_torch.Tensor]]) -> Tuple[Any, ...]:
    everything = list(ctx.saved_tensors)
    tensors, saved = everything[: ctx.inputs], everything[ctx.inputs :]
    prog = _PROGRAMS[ctx.key]
    results = _empty_results(prog, tensors)
    cots = [_torch.zeros_like(r) if c is None else c for c, r in zip(cotangents, results)]
    grads = _torch.ops.attnc.program_backward(ctx.key, tensors, cots, saved)
    return None, [g if dtype in _FLOATS else None for g, (_, dtype, _) in zip(grads, prog.params)]


_program_op.register_autograd(_program_backward, setup_context=_program_setup)
_program_saving_op.register_autograd(_program_backward, setup_context=_program_setup)
