"""``kvquant.wrap(model, config)``: one line to make ``generate()`` use a quantized KV cache; reversible."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .attention import install_attention
from .cache import QuantizedKVCache
from .config import DEFAULT_PRESET, MAX_CAPACITY, KVQuantConfig, check_int
from .transformers_compat import CACHE_ARG


def wrap(model: Any, config: KVQuantConfig | str | Path = DEFAULT_PRESET, capacity: int | None = None) -> Any:
    """Install the ``kvquant`` attention and make ``model.generate()`` use a :class:`QuantizedKVCache`.

    Args:
        model: a transformers decoder (Llama, Mistral, Qwen2/3, ...). Modified in place and returned.
        config: a :class:`KVQuantConfig`, a preset name or a YAML/JSON config path. Default:
            :data:`~kvquant.config.DEFAULT_PRESET` (``int8-kchannel``: keys INT8 per channel, values INT8
            per token), chosen because it holds on models with outlier and offset key channels.
        capacity: tokens to preallocate per sequence in each new cache (optional).

    ``generate()`` builds a fresh cache per call unless one is passed (``cache=``, or ``past_key_values=``
    on transformers before 5.24: :data:`~kvquant.transformers_compat.CACHE_ARG`). Forward calls with
    other caches (``DynamicCache``, transformers' ``QuantizedCache``) or none use plain SDPA.
    :func:`unwrap` restores the model's attention implementation and ``generate``.
    """
    if capacity is not None:
        check_int(capacity, "capacity", 1, MAX_CAPACITY)
    cfg = KVQuantConfig.load(config)
    cfg.resolve(model)  # validate against the model now, not at the first token
    before = install_attention(model)
    if getattr(model, "_kvquant_original_attn", None) is None:
        model._kvquant_original_attn = before or "sdpa"
    model.kvquant_config = cfg
    model.kvquant_capacity = capacity
    if getattr(model, "_kvquant_original_generate", None) is None:
        original = model.generate

        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any) -> Any:
            wants_cache = kwargs.get("use_cache", True) is not False
            if wants_cache and kwargs.get("cache") is None and kwargs.get("past_key_values") is None:
                kwargs[CACHE_ARG] = QuantizedKVCache(model, model.kvquant_config, model.kvquant_capacity)
            return original(*args, **kwargs)

        model._kvquant_original_generate = original
        model.generate = generate
    return model


def unwrap(model: Any, attn_implementation: str | None = None) -> Any:
    """Undo :func:`wrap`: restore ``generate`` and the attention implementation the model had before
    (or ``attn_implementation`` when given)."""
    original = getattr(model, "_kvquant_original_generate", None)
    if original is not None:
        model.generate = original
        model._kvquant_original_generate = None
    impl = attn_implementation or getattr(model, "_kvquant_original_attn", None) or "sdpa"
    model._kvquant_original_attn = None
    model.set_attn_implementation(impl)
    for name in ("kvquant_config", "kvquant_capacity"):
        if hasattr(model, name):
            delattr(model, name)
    return model


@contextlib.contextmanager
def wrapped(
    model: Any, config: KVQuantConfig | str | Path = DEFAULT_PRESET, capacity: int | None = None
) -> Iterator[Any]:
    """``with kvquant.wrapped(model, cfg):`` -- :func:`wrap` on entry, :func:`unwrap` on exit."""
    wrap(model, config, capacity)
    try:
        yield model
    finally:
        unwrap(model)
