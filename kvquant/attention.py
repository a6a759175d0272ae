"""The ``kvquant`` attention implementation, registered with transformers' ``AttentionInterface``.

When a :class:`~kvquant.view.LayerView` was published for the key states (they come from a
:class:`~kvquant.QuantizedKVCache`; the contract is :mod:`kvquant.view`), attention reads the
quantized history through the layer's block tables (Triton on CUDA, the torch block walk
elsewhere: :func:`kvquant.kernels.dispatch.attend`). Otherwise
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
from .errors import ModelError
from .view import BatchView, LayerView

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
    view: LayerView | BatchView | None = handoff.take(key)
    softcap = kwargs.get("softcap")
    if isinstance(view, BatchView):
        return _attend_batch(module, query, key, value, view, scaling, softcap), None
    if view is None and softcap is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    for unsupported in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"kvquant attention: {unsupported!r} is not supported by this model path")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    mask = _bool_mask(attention_mask)
    if view is None:  # another cache, softcapped logits (SDPA has no softcap): plain softmax attention
        return _softcapped_attention(query, key, value, mask, scaling, softcap), None
    from kvquant.kernels.dispatch import attend

    if view.commit is not None:
        row_start = first_real_token(mask, query.shape[0]) if view.past_len == 0 else None
        view.commit(row_start, {"module": module, "queries": query, "scaling": scaling, "mask": mask})
    out = attend(query, key, value, view.store, view.past_len, mask, scaling, softcap)
    return out.transpose(1, 2).contiguous(), None


def _attend_batch(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, view: BatchView,
    scaling: float | None, softcap: float | None,
) -> torch.Tensor:
    """Attention of packed sequences (``query[1, Hq, T, D]``): each sequence's slice of the chunk is written into
    its own store, then every sequence attends causally over its own history and its own slice, the sequences
    of one pool batched (:func:`kvquant.packed_attention.attend_segments`); ``out[1, T, Hq, D]``."""
    from .packed_attention import attend_segments

    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    for s, n, v in zip(view.starts, view.lengths, view.views, strict=True):
        if v.commit is not None:
            v.commit(None, {"module": module, "queries": query[:, :, s:s + n], "scaling": scaling, "mask": None})
    out = attend_segments(query, key, value, [v.store for v in view.views], [v.past_len for v in view.views],
                          view.starts, view.lengths, scaling, softcap)  # fmt: skip
    return out.transpose(1, 2).contiguous()


def first_real_token(mask: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """Per row, the first key position that some query may see (``[B]``), from a boolean 4D mask.

    Keys that no query sees are left padding; ``None`` (no mask) means no padding. A row that sees
    nothing gets the mask's length.
    """
    if mask is None:
        return None
    seen = mask.any(dim=1).any(dim=1)  # [B or 1, L]
    L = seen.shape[-1]
    pos = torch.arange(L, device=mask.device)
    return torch.where(seen, pos, L).amin(dim=-1).expand(batch)


def _bool_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """transformers' 4D mask as booleans (True = attend); additive float masks are converted."""
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2 if mask.is_floating_point() else mask.bool()
    if mask is not None and mask.ndim != 4:
        raise ValueError(f"attention_mask: expected a 4D mask, got shape {tuple(mask.shape)}")
    return mask


def _softcapped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float,
    softcap: float,
) -> torch.Tensor:
    """Softmax attention with logit softcapping over full-precision K/V; ``out[B, Tq, Hq, D]``."""
    from kvquant.kernels.attention_torch import cap_scores

    rep = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(rep, dim=1).float(), value.repeat_interleave(rep, dim=1).float()
    scores = cap_scores(query.float() @ k.transpose(-1, -2) * scaling, softcap)
    if mask is not None:
        mask = mask[..., : k.shape[2]]
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    if mask is not None:  # rows with no visible key give 0 (softmax over nothing is NaN)
        out = torch.where(mask.any(dim=-1, keepdim=True), out, torch.zeros_like(out))
    return out.to(query.dtype).transpose(1, 2).contiguous()


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
        raise ModelError(f"model: {name} is not a transformers model (no .config)")
    if getattr(config, "is_encoder_decoder", False):
        raise ModelError(f"model: {name} is an encoder-decoder; kvquant serves decoder-only models")
    if not getattr(model, "_supports_attention_backend", False):
        raise ModelError(
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
    if getattr(model, "_kvquant_ids_hook", None) is None:  # once per model (kept by unwrap: it only checks)
        model._kvquant_ids_hook = model.base_model.register_forward_pre_hook(check_bound_ids, with_kwargs=True)
    return before


def check_bound_ids(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of the decoder: a :class:`~kvquant.QuantizedKVCache` bound to token ids (prefix reuse,
    :meth:`~kvquant.QuantizedKVCache.from_pool`) refuses input ids that do not extend its own, before anything is
    written (:meth:`~kvquant.QuantizedKVCache.check_ids`)."""
    from .cache import QuantizedKVCache

    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(cache, QuantizedKVCache) and cache.token_ids is not None and isinstance(ids, torch.Tensor):
        cache.check_ids(ids)
