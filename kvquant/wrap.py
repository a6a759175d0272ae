"""``kvquant.wrap(model, config)``: one line to make ``generate()`` use a quantized KV cache."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from .attention import install_attention
from .cache import QuantizedKVCache
from .config import MAX_CAPACITY, KVQuantConfig, check_int


def wrap(model: Any, config: KVQuantConfig | str | Path = "int8", capacity: int | None = None) -> Any:
    """Install the ``kvquant`` attention and make ``model.generate()`` use a :class:`QuantizedKVCache`.

    Args:
        model: a transformers decoder (Llama, Mistral, Qwen2/3, ...). Modified in place and returned.
        config: a :class:`KVQuantConfig`, a preset name or a YAML/JSON config path.
        capacity: tokens to preallocate per sequence in each new cache (optional).

    ``generate()`` builds a fresh cache per call unless ``cache=`` is passed. Forward calls with
    other caches (``DynamicCache``, transformers' ``QuantizedCache``) or none use plain SDPA.
    """
    if capacity is not None:
        check_int(capacity, "capacity", 1, MAX_CAPACITY)
    cfg = KVQuantConfig.load(config)
    cfg.resolve(model)  # validate against the model now, not at the first token
    install_attention(model)
    model.kvquant_config = cfg
    model.kvquant_capacity = capacity
    if getattr(model, "_kvquant_original_generate", None) is None:
        original = model.generate

        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any) -> Any:
            wants_cache = kwargs.get("use_cache", True) is not False
            if wants_cache and kwargs.get("cache") is None and kwargs.get("past_key_values") is None:
                kwargs["cache"] = QuantizedKVCache(model, model.kvquant_config, model.kvquant_capacity)
            return original(*args, **kwargs)

        model._kvquant_original_generate = original
        model.generate = generate
    return model


def unwrap(model: Any, attn_implementation: str = "sdpa") -> Any:
    """Undo :func:`wrap`: restore ``generate`` and the attention implementation."""
    original = getattr(model, "_kvquant_original_generate", None)
    if original is not None:
        model.generate = original
        model._kvquant_original_generate = None
    model.set_attn_implementation(attn_implementation)
    return model
