"""PyTorch integration: an attnc program as a ``torch.autograd.Function``.

``attnc.torch.attention(prog)`` returns a callable that takes and returns torch tensors and
records itself in the autograd graph. Its backward pass runs the program's derived gradient
program (:meth:`attnc.Program.grad`): attnc differentiates the ``.attn`` source itself, score
modifications and masks included, so a learnable bias or slope gets its gradient too.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch as _torch

from . import Program
from ._errors import ArgumentError

_FLOAT = ("f32", "f16", "bf16")


def attention(prog: Program) -> Callable[..., Any]:
    """A callable running ``prog`` on torch tensors, differentiable by autograd.

    Arguments bind as in :class:`attnc.Program` (positional, or by parameter name); tensors
    are made contiguous first. The forward pass runs ``prog``; the backward pass runs
    ``prog.grad(wrt=...)`` for the inputs that need gradients (compiled once per set and
    cached), which recomputes the forward values it needs.
    """
    names = [name for name, _, _ in prog.params]
    is_float = [dtype in _FLOAT for _, dtype, _ in prog.params]
    float_results = [dtype in _FLOAT for _, dtype, _ in prog.outputs]
    grads: Dict[Tuple[str, ...], Program] = {}

    def grad_program(wrt: Tuple[str, ...]) -> Program:
        if wrt not in grads:
            grads[wrt] = prog.grad(list(wrt))
        return grads[wrt]

    class _Attention(_torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *inputs: Any) -> Any:  # type: ignore[override]
            ctx.save_for_backward(*[x if isinstance(x, _torch.Tensor) else None for x in inputs])
            ctx.others = [None if isinstance(x, _torch.Tensor) else x for x in inputs]
            return prog(*inputs)

        @staticmethod
        def backward(ctx: Any, *cotangents: _torch.Tensor) -> Any:  # type: ignore[override]
            saved = ctx.saved_tensors
            inputs = [s if s is not None else o for s, o in zip(saved, ctx.others)]
            wrt = tuple(n for n, f, need in zip(names, is_float, ctx.needs_input_grad) if f and need)
            if not wrt:
                return (None,) * len(names)
            cots = [c.detach().contiguous() for c, f in zip(cotangents, float_results) if f]
            outs = grad_program(wrt)(*inputs, *cots)
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


def _bind(names: List[str], args: tuple, named: dict, entry: str) -> tuple:
    if len(args) > len(names):
        raise ArgumentError(f"`{entry}` takes {len(names)} inputs ({', '.join(names)}) but {len(args)} were given")
    slots: List[Optional[Any]] = list(args) + [None] * (len(names) - len(args))
    for key, value in named.items():
        if key not in names:
            raise ArgumentError(f"`{entry}` has no parameter named `{key}` (its parameters: {', '.join(names)})")
        i = names.index(key)
        if slots[i] is not None:
            raise ArgumentError(f"input `{key}` is given more than once")
        slots[i] = value
    missing = [n for n, s in zip(names, slots) if s is None]
    if missing:
        raise ArgumentError(f"missing input{'s' if len(missing) > 1 else ''} for `{entry}`: {', '.join(missing)}")
    return tuple(slots)
