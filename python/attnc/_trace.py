"""Tracing FlexAttention's ``score_mod`` and ``mask_mod`` into ``.attn`` expressions.

The user's function is called once on symbols (:class:`Sym`): the score and the four indices
``b``, ``h``, ``q_idx``, ``kv_idx``. Arithmetic, comparisons, ``&``/``|``/``~``, the torch
functions and tensor methods in :data:`_UNARY` and :data:`_FUNCS`, ``torch.where``, and
indexing of captured tensors by symbols are recorded as ``.attn`` text; a captured tensor
becomes a parameter of the program (``x0``, ``x1``, ...), read where the program reads it.
Anything else (Python ``if`` or ``and`` on a symbol, an unsupported function) raises
:class:`TraceError` naming the construct.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from ._errors import ArgumentError


class TraceError(ArgumentError):
    """A score or mask function that cannot be traced into a program."""


class Tracer:
    """The captured tensors of one trace, in order of first use."""

    def __init__(self) -> None:
        self.tensors: List[torch.Tensor] = []

    def capture(self, t: torch.Tensor) -> str:
        for n, seen in enumerate(self.tensors):
            if seen is t:
                return f"x{n}"
        self.tensors.append(t)
        return f"x{len(self.tensors) - 1}"


def _kind_of_value(x: Any) -> str:
    if isinstance(x, bool):
        return "b"
    if isinstance(x, int):
        return "i"
    return "f"


class Sym:
    """A traced value: ``.attn`` text and its kind (``f`` float, ``i`` integer, ``b`` bool)."""

    __slots__ = ("text", "kind", "tracer")

    def __init__(self, text: str, kind: str, tracer: Tracer) -> None:
        self.text, self.kind, self.tracer = text, kind, tracer

    # -- operands ---------------------------------------------------------------------------
    def _lift(self, x: Any) -> "Sym":
        if isinstance(x, Sym):
            return x
        if isinstance(x, bool):
            return Sym("true" if x else "false", "b", self.tracer)
        if isinstance(x, int):
            return Sym(f"({x})", "i", self.tracer)
        if isinstance(x, float):
            if x != x:
                raise TraceError("a NaN constant in a score or mask function")
            if x in (float("inf"), float("-inf")):
                return Sym("inf" if x > 0 else "(-inf)", "f", self.tracer)
            return Sym(f"({x!r})", "f", self.tracer)
        if isinstance(x, torch.Tensor):
            if x.dim() != 0:
                raise TraceError(
                    f"a captured tensor of shape {tuple(x.shape)} used whole; index it by the indices (bias[h], table[q_idx - kv_idx])"
                )
            name = self.tracer.capture(x)
            return Sym(name, "b" if x.dtype == torch.bool else ("f" if x.is_floating_point() else "i"), self.tracer)
        raise TraceError(f"a {type(x).__name__} in a score or mask function (numbers, tensors and the arguments only)")

    def _bin(self, op: str, other: Any, reverse: bool = False, kind: Optional[str] = None) -> "Sym":
        a, b = self, self._lift(other)
        if reverse:
            a, b = b, a
        if kind is None:
            kind = "f" if "f" in (a.kind, b.kind) else "i"
        return Sym(f"({a.text} {op} {b.text})", kind, self.tracer)

    def __add__(self, o: Any) -> "Sym":
        return self._bin("+", o)

    def __radd__(self, o: Any) -> "Sym":
        return self._bin("+", o, True)

    def __sub__(self, o: Any) -> "Sym":
        return self._bin("-", o)

    def __rsub__(self, o: Any) -> "Sym":
        return self._bin("-", o, True)

    def __mul__(self, o: Any) -> "Sym":
        return self._bin("*", o)

    def __rmul__(self, o: Any) -> "Sym":
        return self._bin("*", o, True)

    def __truediv__(self, o: Any) -> "Sym":
        return self._bin("/", o, kind="f")

    def __rtruediv__(self, o: Any) -> "Sym":
        return self._bin("/", o, True, kind="f")

    def __floordiv__(self, o: Any) -> "Sym":
        other = self._lift(o)
        q = f"floor({self.text} / {other.text})"
        if "f" in (self.kind, other.kind):
            return Sym(q, "f", self.tracer)
        return Sym(f"cast({q}, i32)", "i", self.tracer)

    def __mod__(self, o: Any) -> "Sym":
        return self._bin("%", o)

    def __rmod__(self, o: Any) -> "Sym":
        return self._bin("%", o, True)

    def __pow__(self, o: Any) -> "Sym":
        return self._bin("**", o, kind="f")

    def __neg__(self) -> "Sym":
        return Sym(f"(-{self.text})", self.kind, self.tracer)

    def __abs__(self) -> "Sym":
        return Sym(f"abs({self.text})", self.kind, self.tracer)

    def __lt__(self, o: Any) -> "Sym":
        return self._bin("<", o, kind="b")

    def __le__(self, o: Any) -> "Sym":
        return self._bin("<=", o, kind="b")

    def __gt__(self, o: Any) -> "Sym":
        return self._bin(">", o, kind="b")

    def __ge__(self, o: Any) -> "Sym":
        return self._bin(">=", o, kind="b")

    def __eq__(self, o: Any) -> "Sym":  # type: ignore[override]
        return self._bin("==", o, kind="b")

    def __ne__(self, o: Any) -> "Sym":  # type: ignore[override]
        return self._bin("!=", o, kind="b")

    def __and__(self, o: Any) -> "Sym":
        return self._bin("&&", o, kind="b")

    __rand__ = __and__

    def __or__(self, o: Any) -> "Sym":
        return self._bin("||", o, kind="b")

    __ror__ = __or__

    def __invert__(self) -> "Sym":
        return Sym(f"(!{self.text})", "b", self.tracer)

    def __bool__(self) -> bool:
        raise TraceError(
            "a score or mask function used a traced value as a Python bool (`if`, `and`, `or`, `not`, "
            "or a chained comparison): write torch.where(c, a, b), `&`, `|`, `~` instead"
        )

    def __index__(self) -> int:
        raise TraceError("a traced index used as a Python int (a list index, range, or slice bound)")

    __hash__ = None  # type: ignore[assignment]

    # -- tensor methods and torch functions ------------------------------------------------
    def float(self) -> "Sym":
        return Sym(f"cast({self.text}, f32)", "f", self.tracer)

    def int(self) -> "Sym":
        return Sym(f"cast({self.text}, i32)", "i", self.tracer)

    long = int

    def bool(self) -> "Sym":
        return Sym(f"cast({self.text}, bool)", "b", self.tracer)

    def to(self, dtype: Any = None, *args: Any, **kw: Any) -> "Sym":
        dtype = kw.get("dtype", dtype)
        if isinstance(dtype, torch.dtype):
            if dtype.is_floating_point:
                return self.float()
            return self.bool() if dtype == torch.bool else self.int()
        return self

    def abs(self) -> "Sym":
        return abs(self)

    def clamp(self, min: Any = None, max: Any = None) -> "Sym":
        out = self
        if min is not None:
            out = Sym(f"max({out.text}, {self._lift(min).text})", _join(out, self._lift(min)), self.tracer)
        if max is not None:
            out = Sym(f"min({out.text}, {self._lift(max).text})", _join(out, self._lift(max)), self.tracer)
        return out

    clamp_min = lambda self, m: self.clamp(min=m)  # noqa: E731
    clamp_max = lambda self, m: self.clamp(max=m)  # noqa: E731

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        tracer = next(a.tracer for a in _flat(args) if isinstance(a, Sym))
        name = getattr(func, "__name__", str(func))
        if name == "__getitem__":
            return _index(tracer, args[0], args[1])
        if name in _UNARY and len(args) == 1:
            x = _sym(tracer, args[0])
            return Sym(f"{_UNARY[name]}({x.text})", "f" if name not in ("abs", "neg", "negative") else x.kind, tracer)
        if name == "where":
            c, a, b = (_sym(tracer, x) for x in args)
            return Sym(f"where({c.text}, {a.text}, {b.text})", _join(a, b), tracer)
        if name in _FUNCS:
            op, kind = _FUNCS[name]
            xs = [_sym(tracer, x) for x in args]
            if op in ("&&", "||", "+", "-", "*", "/", "<", "<=", ">", ">=", "==", "!=", "%", "**"):
                a, b = xs
                return Sym(f"({a.text} {op} {b.text})", kind or _join(a, b), tracer)
            if op == "!":
                return Sym(f"(!{xs[0].text})", "b", tracer)
            return Sym(f"{op}({', '.join(x.text for x in xs)})", kind or _join(*xs), tracer)
        if name in ("clamp", "clip"):
            return _sym(tracer, args[0]).clamp(*args[1:], **kwargs)
        if name == "type_as":
            return _sym(tracer, args[0])
        if name in ("to", "float", "int", "long", "bool"):
            return getattr(_sym(tracer, args[0]), name)(*args[1:], **kwargs)
        raise TraceError(f"`{name}` in a score or mask function cannot be traced into attnc (see attnc.torch.flex_attention)")


_UNARY = {
    "exp": "exp", "log": "log", "sqrt": "sqrt", "rsqrt": "rsqrt", "tanh": "tanh", "sigmoid": "sigmoid",
    "sin": "sin", "cos": "cos", "abs": "abs", "floor": "floor", "relu": "relu", "neg": "neg", "negative": "neg",
}
_FUNCS = {
    "add": ("+", None), "__add__": ("+", None), "__radd__": ("+", None),
    "sub": ("-", None), "__sub__": ("-", None),
    "mul": ("*", None), "__mul__": ("*", None), "__rmul__": ("*", None),
    "div": ("/", "f"), "true_divide": ("/", "f"), "__truediv__": ("/", "f"),
    "remainder": ("%", None), "__mod__": ("%", None),
    "pow": ("**", "f"), "__pow__": ("**", "f"),
    "lt": ("<", "b"), "__lt__": ("<", "b"), "le": ("<=", "b"), "__le__": ("<=", "b"),
    "gt": (">", "b"), "__gt__": (">", "b"), "ge": (">=", "b"), "__ge__": (">=", "b"),
    "eq": ("==", "b"), "__eq__": ("==", "b"), "ne": ("!=", "b"), "__ne__": ("!=", "b"),
    "logical_and": ("&&", "b"), "__and__": ("&&", "b"), "bitwise_and": ("&&", "b"),
    "logical_or": ("||", "b"), "__or__": ("||", "b"), "bitwise_or": ("||", "b"),
    "logical_not": ("!", "b"), "__invert__": ("!", "b"), "bitwise_not": ("!", "b"),
    "minimum": ("min", None), "maximum": ("max", None), "atan2": ("atan2", "f"),
}


def _join(*xs: Sym) -> str:
    kinds = {x.kind for x in xs}
    return "f" if "f" in kinds else ("i" if "i" in kinds else "b")


def _flat(args: Any) -> List[Any]:
    out: List[Any] = []
    for a in args:
        if isinstance(a, (tuple, list)):
            out.extend(_flat(a))
        else:
            out.append(a)
    return out


def _sym(tracer: Tracer, x: Any) -> Sym:
    return x if isinstance(x, Sym) else Sym("0", "i", tracer)._lift(x)


def _index(tracer: Tracer, table: Any, index: Any) -> Sym:
    if not isinstance(table, torch.Tensor):
        raise TraceError(f"indexing a {type(table).__name__} by a traced value (index captured tensors only)")
    parts = index if isinstance(index, tuple) else (index,)
    if len(parts) != table.dim() or any(p is Ellipsis or p is None or isinstance(p, slice) for p in parts):
        raise TraceError(f"a captured tensor of shape {tuple(table.shape)} indexed by {len(parts)} index(es): give one index per axis")
    subs = []
    for p in parts:
        s = _sym(tracer, p)
        if s.kind == "f":
            raise TraceError("a captured tensor indexed by a float")
        subs.append(s.text if s.kind == "i" else f"cast({s.text}, i32)")
    name = tracer.capture(table)
    kind = "b" if table.dtype == torch.bool else ("f" if table.is_floating_point() else "i")
    return Sym(f"{name}[{', '.join(subs)}]", kind, tracer)


def trace(fn: Callable, names: Tuple[str, ...], kinds: Tuple[str, ...], tracer: Tracer, what: str) -> Sym:
    """``fn`` applied to symbols ``names`` of ``kinds``; the result as a symbol."""
    args = [Sym(n, k, tracer) for n, k in zip(names, kinds)]
    try:
        out = fn(*args)
    except TraceError:
        raise
    except Exception as e:  # the user's code failed on a symbol: say where
        raise TraceError(f"the {what} could not be traced: {type(e).__name__}: {e}") from None
    return _sym(tracer, out)
