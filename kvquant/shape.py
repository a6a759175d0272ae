"""The shape of a model's KV cache, read from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .errors import InputError


def held_dtype(model_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a cache holds a model's full-precision K/V in (sink tokens, the residual window, tokens held
    while static scales wait): float16 for a float32 model (or when the dtype is not known), else the model's own
    dtype. A float32 model whose K/V overflow float16 has those buffers widened to float32."""
    return torch.float16 if model_dtype in (None, torch.float32) else model_dtype


def model_dtype(model: Any) -> torch.dtype | None:
    """The floating dtype of ``model`` (``model.dtype``), None for a :class:`ModelShape` or anything without one."""
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


@dataclass(frozen=True)
class ModelShape:
    """Layers, KV heads and head_dim: all that sizing and validating a KV config needs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_query_heads: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"model shape: {name} must be an integer >= 1, got {v!r}")

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """Read the shape from a transformers ``PretrainedConfig`` (text config for multimodal models)."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        layers = getattr(config, "num_hidden_layers", None)
        q_heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
        if not layers or not kv_heads:
            raise InputError(
                f"model: {type(config).__name__} has no attention KV heads "
                "(num_hidden_layers / num_key_value_heads missing): kvquant needs a decoder with a KV cache"
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // q_heads
        return cls(int(layers), int(kv_heads), int(head_dim), int(q_heads) if q_heads else None)

    @classmethod
    def of(cls, model_or_config: Any) -> ModelShape:
        if isinstance(model_or_config, ModelShape):
            return model_or_config
        return cls.from_config(getattr(model_or_config, "config", model_or_config))

    def as_dict(self) -> dict[str, int]:
        return {"layers": self.num_layers, "kv_heads": self.num_kv_heads, "head_dim": self.head_dim}


def sliding_windows(model_or_config: Any, num_layers: int) -> list[int | None]:
    """Per-layer sliding-window length from a transformers config, ``None`` for full-attention layers.

    ``layer_types`` (Gemma 2/3, Qwen2/3, ...) marks ``sliding_attention`` layers; without it a set
    ``sliding_window`` (Mistral) applies to every layer, as transformers' ``DynamicCache`` does.
    """
    if isinstance(model_or_config, ModelShape):
        return [None] * num_layers
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return [None] * num_layers
    if types is None:
        return [int(window)] * num_layers
    return [int(window) if t == "sliding_attention" else None for t in list(types)[:num_layers]]
