"""The ``kvquant`` attention implementation, registered with transformers' ``AttentionInterface``.

When a :class:`~kvquant.view.LayerView` was published for the key states (they come from a
:class:`~kvquant.QuantizedKVCache`; the contract is :mod:`kvquant.view`), attention reads the
quantized history through the layer's block tables (Triton on CUDA, the torch block walk
elsewhere: :func:`kvquant.kernels.attend`). Otherwise
(no cache, ``DynamicCache``, transformers' own quantized caches) it is plain SDPA, so a wrapped
model still runs every other cache correctly.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import view as handoff
from .view import LayerView

ATTN_NAME = "kvquant"


def kvquant_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature; returns ``(out[B, Tq, Hq, D], None)``."""
    view: LayerView | None = handoff.take(key)
    if view is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    from kvquant.kernels import attend

    for unsupported in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"kvquant attention: {unsupported!r} is not supported by this model path")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2 if mask.is_floating_point() else mask.bool()
    if mask is not None and mask.ndim != 4:
        raise ValueError(f"attention_mask: expected a 4D mask, got shape {tuple(mask.shape)}")
    out = attend(query, key, value, view.store, view.past_len, mask, scaling)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def register() -> None:
    """Register the ``kvquant`` attention and its (SDPA-style boolean) mask with transformers."""
    AttentionInterface.register(ATTN_NAME, kvquant_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def check_supported(model: Any) -> None:
    """Raise a clear error for models that kvquant cannot serve."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"model: {name} is not a transformers model (no .config)")
    if getattr(config, "is_encoder_decoder", False):
        raise TypeError(f"model: {name} is an encoder-decoder; kvquant serves decoder-only models")
    if not getattr(model, "_supports_attention_backend", False):
        raise TypeError(
            f"model: {name} does not use transformers' AttentionInterface, so its attention cannot read "
            "a quantized cache (supported: Llama, Mistral, Qwen2/3, Gemma, Phi3 and other models that do)"
        )


def install_attention(model: Any) -> str | None:
    """Switch ``model`` to the ``kvquant`` attention implementation; returns the implementation it had."""
    check_supported(model)
    register()
    before = getattr(model.config, "_attn_implementation", None)
    if before != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
    return before
