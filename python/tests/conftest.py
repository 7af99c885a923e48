"""Fixtures shared by the torch tests."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest


@pytest.fixture
def graph_recorder() -> Tuple[Any, Dict[str, List[str]]]:
    """A ``torch.compile`` backend (AOT autograd, run eagerly) that records the functions its
    forward (``"fw"``) and backward (``"bw"``) graphs call, and the record."""
    pytest.importorskip("torch")
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: Dict[str, List[str]] = {}

    def keep(name: str) -> Any:
        def compiler(gm: Any, _: Any) -> Any:
            graphs[name] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")), graphs
