"""The exceptions attnc raises. Every one is an :class:`AttncError`."""

from __future__ import annotations

from typing import Any, Dict, List, Optional


class AttncError(Exception):
    """Base class of every error attnc raises."""


class CompileError(AttncError):
    """The program does not compile.

    ``str(err)`` is the rendered diagnostic (code, message, the source line with the span
    marked); ``err.code`` is the first error's code (``E0101``...), ``err.diagnostics`` a list
    of dicts with ``code``, ``severity``, ``message``, ``line``, ``column`` (1-based), ``span``
    (byte offsets), ``label`` and ``help``.
    """

    code: str = ""
    diagnostics: List[Dict[str, Any]] = []


class ShapeError(AttncError, ValueError):
    """Input shapes that do not fit the parameters' types or each other, or dims that are
    missing, unknown or contradict the program. ``str(err)`` is the rendered diagnostic when
    it is about one parameter (``err.param``)."""

    param: Optional[str] = None
    message: str = ""


class DTypeError(AttncError, TypeError):
    """An input whose element type is not its parameter's (nor losslessly widened to it)."""

    param: Optional[str] = None
    message: str = ""


class LayoutError(AttncError, ValueError):
    """An input that cannot be read in place: not C-contiguous, or misaligned."""

    param: Optional[str] = None


class ArgumentError(AttncError, TypeError):
    """Wrong arguments: a missing, unknown or repeated input, too many inputs, an unknown
    entry point, target or stage."""

    message: str = ""


class RunError(AttncError, RuntimeError):
    """The run itself failed: the target is unavailable (no GPU), memory ran out, or an
    internal error."""

    param: Optional[str] = None
    message: str = ""
