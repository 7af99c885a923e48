"""PyTorch integration: an attnc program as a ``torch.autograd.Function``.

``attnc.torch.attention(prog)`` returns a callable that takes and returns torch tensors and
records itself in the autograd graph. attnc has no backward pass yet (it is being built: the
backward derived from the IR and fused into a flash backward kernel), so calling ``backward``
through it raises ``NotImplementedError``. Use it for inference, under ``torch.no_grad()`` or on
tensors that do not require grad.
"""

from __future__ import annotations

from typing import Any, Callable

import torch as _torch

from . import Program

_NO_BACKWARD = (
    "attnc does not compute gradients yet: its backward pass (derived from the IR and fused "
    "into a flash backward kernel) has not landed. Run attnc programs under torch.no_grad() "
    "for inference, or compute this block with PyTorch where you train."
)


def attention(prog: Program) -> Callable[..., Any]:
    """A callable running ``prog`` on torch tensors, recorded by autograd (whose backward
    raises ``NotImplementedError`` until attnc has a backward pass). Positional and named
    arguments bind as in :class:`attnc.Program`."""
    names = [name for name, _, _ in prog.params]

    class _Attention(_torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *inputs: _torch.Tensor) -> Any:  # type: ignore[override]
            out = prog(*inputs)
            return out

        @staticmethod
        def backward(ctx: Any, *grads: _torch.Tensor) -> Any:  # type: ignore[override]
            raise NotImplementedError(_NO_BACKWARD)

    def call(*args: Any, **named: Any) -> Any:
        if named:
            args = _bind(names, args, named, prog.entry)
        return _Attention.apply(*args)

    call.__name__ = prog.entry
    call.__doc__ = f"attnc program {prog.signature}"
    return call


def _bind(names: list, args: tuple, named: dict, entry: str) -> tuple:
    from ._errors import ArgumentError

    if len(args) > len(names):
        raise ArgumentError(f"`{entry}` takes {len(names)} inputs ({', '.join(names)}) but {len(args)} were given")
    slots = list(args) + [None] * (len(names) - len(args))
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
