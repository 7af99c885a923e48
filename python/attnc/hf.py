"""attnc as an attention backend of Hugging Face transformers.

::

    import attnc.hf
    attnc.hf.register()                       # the name "attnc"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attnc")
    # or, on a model already built: model.set_attn_implementation("attnc")

:func:`register` adds :func:`attention_forward` to transformers' ``AttentionInterface`` and
transformers' own SDPA mask function to its ``AttentionMaskInterface`` under the same name,
so that the model builds the padding, causal and sliding-window masks it builds for "sdpa" and
hands them over (without a mask function transformers passes ``attention_mask=None`` and
padding would be silently ignored). Attention then runs through :func:`attnc.torch.sdpa`:
grouped-query attention without repeating K and V, the mask read at its broadcast size,
Gemma 2's ``softcap``, gpt-oss's attention sinks (``s_aux``: one logit per head in every
softmax denominator, through the fused log-sum-exp), the decode step against a KV cache,
differentiable for training.
transformers is an optional dependency (``pip install transformers``).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch as _torch

from ._errors import ArgumentError
from .torch import _sdpa


def register(name: str = "attnc") -> str:
    """Registers attnc with transformers under ``name`` (attention and mask functions); returns
    the name, for ``attn_implementation=``."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ArgumentError(f"attnc.hf needs transformers (pip install transformers): {e}") from None
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def attention_forward(
    module: _torch.nn.Module,
    query: _torch.Tensor,
    key: _torch.Tensor,
    value: _torch.Tensor,
    attention_mask: Optional[_torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[_torch.Tensor] = None,
    position_bias: Optional[_torch.Tensor] = None,
    **kwargs: Any,
) -> Tuple[_torch.Tensor, None]:
    """transformers' attention function: ``query`` ``[B, Hq, L, D]``, ``key`` and ``value``
    ``[B, Hkv, S, D]`` (a KV cache's keys included), the mask the registered mask function made
    (bool ``[B, 1, L, S]``, or ``None`` when a causal mask is enough); returns the output as
    ``[B, L, Hq, D]`` and no attention weights."""
    if position_bias is not None:
        raise ArgumentError("a position bias (T5-style) is not supported by attnc's transformers backend yet")
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > q_len:
        # As transformers' SDPA backend: a causal mask over the first L keys (top-left aligned).
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    groups = getattr(module, "num_key_value_groups", 1)
    out = _sdpa(query, key, value, attention_mask, dropout, causal, scaling, groups > 1, softcap, s_aux)
    return out.transpose(1, 2).contiguous(), None
