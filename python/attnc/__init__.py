"""attnc: a compiler for attention.

Write attention the way papers do, in a ``.attn`` program::

    fn sdpa(q: f32[B, H, S, D], k: f32[B, H, S, D], v: f32[B, H, S, D]) -> f32[B, H, S, D] {
        return softmax(q @ k.T / sqrt(D), axis = -1) @ v
    }

compile it once, and call it on NumPy arrays or PyTorch tensors::

    import attnc, numpy as np
    prog = attnc.compile("examples/sdpa.attn")
    out = prog(q, k, v)              # or prog(q=q, k=k, v=v)

attnc fuses the softmax and the two products into one flash-attention kernel (no S x S
matrix), compiled to native code for this CPU. Dims (``B``, ``H``, ``S``, ``D``) are taken from
the input shapes; contiguous float32 inputs are read in place, never copied; the GIL is
released while the program runs.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from . import _attnc
from ._errors import (
    ArgumentError,
    AttncError,
    CompileError,
    DTypeError,
    LayoutError,
    RunError,
    ShapeError,
)

__version__: str = _attnc.__version__

__all__ = [
    "compile",
    "clear_cache",
    "Program",
    "AttncError",
    "ArgumentError",
    "CompileError",
    "DTypeError",
    "LayoutError",
    "RunError",
    "ShapeError",
]

#: The pipeline stages :meth:`Program.emit` prints.
STAGES = ("ast", "ir", "opt", "schedule", "clif", "cuda")


def compile(
    path_or_source: Union[str, "os.PathLike[str]"],
    *,
    entry: Optional[str] = None,
    target: str = "cpu",
    threads: Optional[int] = None,
) -> "Program":
    """Compiles a ``.attn`` program and returns a callable :class:`Program`.

    ``path_or_source`` is a path (a ``pathlib.Path``, or a string naming an existing file or
    ending in ``.attn``) or the program text itself. ``entry`` names the function to run (the
    last one in the file by default). ``target`` is ``"cpu"`` (native code, the default),
    ``"interp"`` (the reference interpreter) or ``"cuda"`` (NVIDIA GPUs; checked when it runs).
    ``threads`` is the CPU thread count (``None``: one per core).

    Compiled programs are cached per (source, entry, target, threads) within the process, so
    calling ``compile`` again with the same arguments is cheap.

    Raises :class:`CompileError` (with the rendered diagnostic) if the program does not
    compile, :class:`ArgumentError` for an unknown entry or target, ``OSError`` if a path
    cannot be read.
    """
    source, file_name = _source_of(path_or_source)
    if threads is not None and (not isinstance(threads, int) or threads < 0):
        raise ArgumentError(f"threads must be a non-negative int or None, not {threads!r}")
    return Program(_attnc.compile(source, file_name, entry, target, threads))


def clear_cache() -> None:
    """Forgets every compiled program (the cache keeps the 64 most recent)."""
    _attnc.clear_cache()


def _source_of(path_or_source: Any) -> Tuple[str, str]:
    if isinstance(path_or_source, os.PathLike):
        path = os.fspath(path_or_source)
    elif isinstance(path_or_source, str):
        text = path_or_source
        looks_like_path = "\n" not in text and "{" not in text and (text.endswith(".attn") or os.path.isfile(text))
        if not looks_like_path:
            return text, "<source>"
        path = text
    else:
        raise ArgumentError(f"compile() takes a path or the program text, not a {type(path_or_source).__name__}")
    with open(path, encoding="utf-8") as f:
        return f.read(), str(path)


class Program:
    """One entry point of a compiled ``.attn`` program, for one target. Call it.

    ``prog(q, k, v)``, ``prog(q=q, k=k, v=v)`` or a mix run it; :meth:`run` also takes
    ``dims`` for dimensions the input shapes do not determine. Inputs are NumPy arrays,
    PyTorch tensors (through DLPack, straight into the binding), or anything ``numpy.asarray``
    accepts (the buffer protocol, ``__array__``). Dense inputs of the parameter's storage type
    are read in place; any other strides (a transposed view, a stride-0 broadcast) or float type
    (float16, bfloat16, float64 for an f32 parameter) are copied once, natively. One result
    comes back as an array, several as a tuple in the order of :attr:`outputs`; torch tensors
    when any input was a torch tensor.
    """

    __slots__ = ("_compiled", "_differentiable", "_bf16_results")

    def __init__(self, compiled: "_attnc.Compiled") -> None:
        self._compiled = compiled
        # Results declared bf16 (NumPy has none: they come back float32, and as torch.bfloat16
        # tensors when the inputs were torch tensors).
        self._bf16_results = tuple(i for i, (_, dtype, _) in enumerate(compiled.outputs) if dtype == "bf16")
        # The program as a torch.autograd.Function (attnc.torch.attention), made on the first
        # call with tensors that require grad.
        self._differentiable: Optional[Any] = None

    def __call__(self, *args: Any, **named: Any) -> Any:
        """Runs the program: positional inputs in parameter order, or by parameter name."""
        return self._run(args, named, None)

    def _run_cuda(
        self, torch: Any, args: Tuple[Any, ...], named: Dict[str, Any], dims: Optional[Dict[str, int]], given: Optional[Tuple[Any, ...]] = None
    ) -> Any:
        """The run on CUDA tensors: a program compiled for ``cuda`` reads and writes them in
        device memory (device 0, PyTorch's context), ordered on the current stream; results
        are new tensors on that device, or the dense CUDA tensors ``given`` for them. CPU
        tensors and Python numbers among the inputs are moved there first."""
        device = next(a.device for a in (*args, *named.values(), *(given or ())) if isinstance(a, torch.Tensor) and a.is_cuda)
        if self.target != "cuda":
            raise LayoutError(
                f"a torch tensor on {device} was given; this program runs on {self.target}: compile it with target='cuda' (or pass x.cpu())"
            )
        if device.index not in (None, 0):
            raise LayoutError(f"a torch tensor on {device} was given; the cuda target runs on device 0 (cuda:0)")
        slots = _bind([name for name, _, _ in self.params], args, named, self.entry)
        inputs = []
        known: Dict[int, np.ndarray] = {}
        for i, ((name, dtype, _), x) in enumerate(zip(self.params, slots)):
            want = _TORCH_OF[dtype](torch)
            t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=want)
            if t.dtype != want:
                raise DTypeError(f"input `{name}` is {t.dtype}; the parameter is {dtype} ({want})")
            if dtype == "i32" and t.dim() <= 2 and not t.is_cuda:
                known[i] = t.contiguous().numpy()  # a host copy (a size, a seed, ids): no copy back
            inputs.append(t.to(device).contiguous())
        shapes = [list(t.shape) for t in inputs]
        specs = self._compiled._output_shapes(shapes, dims)
        outs = [torch.empty(shape, dtype=_TORCH_OF[d](torch), device=device) for d, shape in specs]
        for i, o in enumerate(given or ()):
            if o is None:
                continue
            name, (d, shape) = self.outputs[i][0], specs[i]
            if not isinstance(o, torch.Tensor) or o.device != device or not o.is_contiguous():
                raise LayoutError(f"out for result `{name}` must be a dense torch tensor on {device} (the CUDA target writes device memory in place)")
            if o.dtype != _TORCH_OF[d](torch) or list(o.shape) != list(shape):
                raise ShapeError(f"out for result `{name}` is {o.dtype}{list(o.shape)}, but the result is {_TORCH_OF[d](torch)}{list(shape)}")
            outs[i] = o
        stream = torch.cuda.current_stream(device).cuda_stream
        self._compiled._run_cuda(
            [(t.data_ptr(), d, list(t.shape)) for t, (_, d, _) in zip(inputs, self.params)],
            [(o.data_ptr(), d, list(o.shape)) for o, (d, _) in zip(outs, specs)],
            stream,
            dims,
            known or None,
        )
        return outs[0] if len(outs) == 1 else tuple(outs)

    def run(self, *args: Any, dims: Optional[Mapping[str, int]] = None, out: Any = None, **named: Any) -> Any:
        """Like calling the program, with ``dims={"NAME": size}`` for dimensions the inputs do
        not determine (a result's size, say); given dims that the inputs do determine are
        checked against them.

        ``out`` writes the results into arrays or tensors the caller made, in whatever layout
        they chose (any strides), and returns them: one for a one-result program, else a tuple
        with one per result (``None`` for a fresh one). Each must have its result's shape and a
        dtype that holds it (float results: float32, float16, bfloat16, float64; int32; bool)
        and be writable, with no two elements sharing memory. A dense one of the result's
        storage type (float32 for float results) is written by the kernels in place; any other
        is written once, natively, after the run, and so is one that overlaps an input (the
        inputs are read whole first). Each is checked before the program runs, so a refused one
        is left as it was; if the run itself fails (an index out of range), an in-place one may
        have been partly written. As with torch's ``out=``, no gradients are recorded: inputs
        that require grad, or an output tensor that does, raise ``ArgumentError``. CUDA
        programs take dense CUDA tensors of the result's exact dtype."""
        dims_ = dict(dims) if dims is not None else None
        if out is None:
            return self._run(args, named, dims_)
        return self._run(args, named, dims_, self._outs(out))

    def _outs(self, out: Any) -> Tuple[Any, ...]:
        """``out`` as one entry per result."""
        n = len(self._compiled.outputs)
        if isinstance(out, (tuple, list)):
            if len(out) != n:
                names = ", ".join(name for name, _, _ in self._compiled.outputs)
                raise ArgumentError(f"out= takes one array (or None) per result ({names}), but {len(out)} were given")
            return tuple(out)
        if n != 1:
            names = ", ".join(name for name, _, _ in self._compiled.outputs)
            raise ArgumentError(f"this program has {n} results ({names}): give out= a tuple with one array (or None) per result")
        return (out,)

    def _run(self, args: Tuple[Any, ...], named: Dict[str, Any], dims: Optional[Dict[str, int]], outs: Optional[Tuple[Any, ...]] = None) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and torch.compiler.is_compiling():
            # Under torch.compile: the registered op `attnc::program`, so the graph has no break.
            if dims is not None:
                raise ArgumentError("dims= is not supported under torch.compile: call the program outside the compiled region")
            from ._ops import call_program  # (importing attnc.torch, which registers the ops)

            if outs is None:
                return call_program(self, args, named)
            return self._compiled_into(torch, call_program(self, args, named), args, named, outs)
        if outs is not None and torch is not None:
            tensors = [a for a in (*args, *named.values(), *outs) if isinstance(a, torch.Tensor)]
            if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
                raise ArgumentError(
                    "out= records no gradients (as torch's out= arguments): call without out=, or under torch.no_grad(), or detach the tensors"
                )
        if torch is not None and dims is None and outs is None and torch.is_grad_enabled():
            tensors = [a for a in (*args, *named.values()) if isinstance(a, torch.Tensor)]
            if any(t.requires_grad for t in tensors):
                # Tensors that require grad: the call records itself in autograd (the backward
                # runs the derived program), instead of returning a result with no history.
                if self._differentiable is None:
                    from .torch import attention

                    self._differentiable = attention(self)
                return self._differentiable(*args, **named)
        as_torch = False
        if torch is not None and not all(type(a) is np.ndarray for a in (*args, *named.values(), *(outs or ()))):
            if any(isinstance(a, torch.Tensor) and a.is_cuda for a in (*args, *named.values(), *(outs or ()))):
                return self._run_cuda(torch, args, named, dims, outs)
            if "attnc.torch" not in sys.modules:
                # Torch tensors: attnc.torch hands multi-threaded runs to PyTorch's OpenMP team.
                from . import torch as _attnc_torch  # noqa: F401
        if not all(type(a) is np.ndarray for a in args):
            converted = []
            for a in args:
                arr, is_torch = _as_array(a)
                converted.append(arr)
                as_torch |= is_torch
            args = tuple(converted)
        if named:
            for name, value in named.items():
                if type(value) is not np.ndarray:
                    named[name], is_torch = _as_array(value)
                    as_torch |= is_torch
        if outs is None:
            results = self._compiled.run(args, named or None, dims)
        else:
            results = self._compiled.run(args, named or None, dims, tuple(None if o is None else _as_out(o, name) for o, (name, _, _) in zip(outs, self.outputs)))
        if as_torch:
            import torch

            results = [None if o is None else torch.from_numpy(o) for o in results]
            for i in self._bf16_results:
                if results[i] is not None:
                    results[i] = results[i].bfloat16()
        if outs is not None:
            results = [o if r is None else r for o, r in zip(outs, results)]
        return results[0] if len(results) == 1 else tuple(results)

    def _compiled_into(self, torch: Any, found: Any, args: Tuple[Any, ...], named: Dict[str, Any], outs: Tuple[Any, ...]) -> Any:
        """``out=`` under ``torch.compile``: the results copied into the given tensors (the
        graph's own buffers are the compiler's to plan), with the eager path's checks: no
        gradients, tensors of the result's shape and a dtype that holds it."""
        tensors = [a for a in (*args, *named.values(), *outs) if isinstance(a, torch.Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            raise ArgumentError("out= records no gradients (as torch's out= arguments): call without out=, or under torch.no_grad(), or detach the tensors")
        results = found if isinstance(found, tuple) else (found,)
        written = []
        for o, r, (name, dtype, _) in zip(outs, results, self.outputs):
            if o is None:
                written.append(r)
                continue
            if not isinstance(o, torch.Tensor):
                raise ArgumentError(f"out= for `{name}` under torch.compile takes a torch tensor, not {type(o).__name__}")
            if tuple(o.shape) != tuple(r.shape):
                raise ArgumentError(f"out= for `{name}` has shape {tuple(o.shape)}, but the result is {tuple(r.shape)}")
            holds = o.dtype.is_floating_point if dtype in ("f32", "f16", "bf16") else o.dtype == r.dtype
            if not holds:
                raise ArgumentError(f"out= for `{name}` is {o.dtype}, which does not hold the result's {r.dtype}")
            written.append(o.copy_(r))
        return written[0] if len(written) == 1 else tuple(written)

    def emit(self, stage: str) -> str:
        """The text of a pipeline stage for this entry point: ``"ast"`` (the parsed program),
        ``"ir"`` (the graph IR), ``"opt"`` (optimised: flash ops and their tile classes),
        ``"schedule"``, ``"clif"`` (Cranelift IR, the CPU code) or ``"cuda"`` (CUDA C++)."""
        return self._compiled.emit(stage)

    def explain(self, dims: Optional[Mapping[str, int]] = None) -> str:
        """What the optimizer did and why: rules fired, fusions made or refused, the cost
        model's choices, and each flash op's tile map at ``dims`` (representative sizes for the
        dims not given)."""
        return self._compiled.explain(dict(dims) if dims is not None else None)

    def grad(self, wrt: Optional[List[str]] = None) -> "Program":
        """This entry point with its gradients, as a new program (``<entry>_grad``).

        It takes this program's inputs plus a cotangent ``d_<result>`` for each float result
        (the gradient of your loss with respect to that result), and returns the results
        followed by ``d_<param>`` for each float parameter, or for each name in ``wrt``.
        Integer and bool parameters have no gradient. The derivative rules and subgradients are
        in docs/language.md ("Differentiation").
        """
        return Program(self._compiled.grad(list(wrt) if wrt is not None else None))

    def grad_split(self, wrt: Optional[List[str]] = None) -> Optional[Tuple["Program", "Program"]]:
        """The gradients in two halves, for autograd: ``(forward, backward)``. ``forward``
        returns the results, then each fused flash op's result and log-sum-exp (``saved_out0``,
        ``saved_lse0``, ...); ``backward`` takes the inputs, a cotangent per float result and
        those saved values, and returns the gradients (as :meth:`grad` does) without running the
        flash forward again. ``None`` when the backward is not fused: use :meth:`grad`."""
        split = self._compiled.grad_split(list(wrt) if wrt is not None else None)
        return None if split is None else (Program(split[0]), Program(split[1]))

    def random_inputs(self, seed: int = 0, dims: Optional[Mapping[str, int]] = None) -> Dict[str, np.ndarray]:
        """Seeded random inputs, by parameter name, as ``attnc run --random-inputs`` makes them:
        floats from N(0, 1), ``i32`` inputs as sorted segment ids, bools as coin flips; each dim
        not in ``dims`` (nor fixed by the program) is 8. ``prog(**prog.random_inputs())`` runs."""
        return self._compiled.random_inputs(seed, dict(dims) if dims is not None else None)

    def random_dims(self, dims: Optional[Mapping[str, int]] = None) -> Dict[str, int]:
        """The size of every dimension of the entry point: ``dims``, the program's ``dim``
        items, and 8 for the rest (what :meth:`random_inputs` uses). Pass it to :meth:`run` as
        ``dims=`` when the shapes alone do not determine every dim (``C*L`` from a width)."""
        return self._compiled.random_dims(dict(dims) if dims is not None else None)

    @property
    def entry(self) -> str:
        """The name of the function this program runs."""
        return self._compiled.entry

    @property
    def entries(self) -> List[str]:
        """Every function of the source, in order (compile with ``entry=`` to run another)."""
        return self._compiled.entries

    @property
    def signature(self) -> str:
        """``name(q: f32[B, S, D], ...) -> (out: f32[B, S, D])``."""
        return self._compiled.signature

    @property
    def params(self) -> List[Tuple[str, str, List[str]]]:
        """The parameters: ``(name, dtype, [dim, ...])`` each."""
        return self._compiled.params

    @property
    def outputs(self) -> List[Tuple[str, str, List[str]]]:
        """The results, in the order they are returned: ``(name, dtype, [dim, ...])`` each."""
        return self._compiled.outputs

    @property
    def target(self) -> str:
        """``"cpu"``, ``"interp"`` or ``"cuda"``."""
        return self._compiled.target

    @property
    def source(self) -> str:
        """The program text."""
        return self._compiled.source

    @property
    def warnings(self) -> str:
        """The program's warnings (unused names...), rendered; empty if none."""
        return self._compiled.warnings

    def __repr__(self) -> str:
        return f"<attnc.Program {self.signature} on {self.target}>"


def _bind(names: List[str], args: Tuple[Any, ...], named: Dict[str, Any], entry: str) -> Tuple[Any, ...]:
    """Positional and named inputs as one tuple in parameter order, with clear errors for
    too many, unknown, repeated or missing ones."""
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


# attnc's dtype names as torch dtypes (looked up when torch is loaded).
_TORCH_OF = {
    "f32": lambda t: t.float32,
    "f16": lambda t: t.float16,
    "bf16": lambda t: t.bfloat16,
    "i32": lambda t: t.int32,
    "bool": lambda t: t.bool,
}


def _as_out(x: Any, name: str) -> Any:
    """A buffer for result ``name`` as the binding writes it: a NumPy array as it is, a CPU
    torch tensor as a DLPack capsule of it (never a copy: the result must land in ``x``)."""
    if isinstance(x, np.ndarray):
        return x
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if not x.is_cpu:
            raise LayoutError(f"out for result `{name}` is on {x.device}; this program runs on the CPU")
        try:
            return torch.utils.dlpack.to_dlpack(x)
        except (BufferError, TypeError, RuntimeError) as e:
            raise LayoutError(f"cannot write result `{name}` into a torch tensor of dtype {x.dtype}: {e}") from None
    raise DTypeError(f"out for result `{name}` must be a NumPy array or a torch tensor, not {type(x).__name__}")


def _as_array(x: Any) -> Tuple[Any, bool]:
    """``x`` as the binding reads it, without copying, and whether it was a torch tensor: a
    NumPy array, or for a torch tensor on the CPU a DLPack capsule of it (any strides and
    float type: the binding reads a dense tensor in place and copies any other once)."""
    if isinstance(x, np.ndarray) or type(x).__name__ == "PyCapsule":
        # (A capsule is read as a DLPack tensor, a "dltensor" or "dltensor_versioned" one.)
        return x, False
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if not x.is_cpu:
            raise LayoutError(
                f"a torch tensor on {x.device} was given; this program runs on the CPU, so pass x.cpu()"
            )
        try:
            # A quarter of `numpy()`'s cost per call, and it carries strides and bfloat16.
            return torch.utils.dlpack.to_dlpack(x), True
        except (BufferError, TypeError, RuntimeError) as e:
            raise LayoutError(f"cannot read a torch tensor of dtype {x.dtype} through DLPack: {e}") from None
    if hasattr(x, "__dlpack__") and not hasattr(x, "__array__") and not hasattr(x, "__array_interface__"):
        try:
            return np.from_dlpack(x), False
        except (BufferError, TypeError, RuntimeError) as e:
            raise LayoutError(f"cannot read a {type(x).__name__} through DLPack: {e}") from None
    try:
        return np.asarray(x), False
    except (TypeError, ValueError) as e:
        raise DTypeError(f"cannot read a {type(x).__name__} as an array: {e}") from None
