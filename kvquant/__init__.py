"""kvquant: quantize and compress the KV cache of transformers LLMs, and measure what it costs.

Quick start::

    import kvquant
    model = kvquant.wrap(model)                  # generate() now uses a quantized KV cache (int8-kchannel)
    out = model.generate(**inputs, max_new_tokens=200)
    kvquant.unwrap(model)                        # back to the model's own attention (or: with kvquant.wrapped(...))

    cache = kvquant.QuantizedKVCache(model, kvquant.KVQuantConfig.preset("mixed-int4-int8"))
    out = model.generate(**inputs, cache=cache, max_new_tokens=200)
    print(cache.memory_report())
"""

from .blocks import KVCacheFull
from .cache import QuantizedKVCache
from .config import DEFAULT_PRESET, PRESETS, ConfigError, KVPrecision, KVQuantConfig
from .errors import KVQuantError
from .pool import PagedKVPool
from .quantizers import PRECISIONS
from .scheduler import Scheduler
from .shape import ModelShape
from .wrap import unwrap, wrap, wrapped

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_PRESET",
    "PRECISIONS",
    "PRESETS",
    "ConfigError",
    "KVCacheFull",
    "KVPrecision",
    "KVQuantError",
    "KVQuantConfig",
    "ModelShape",
    "PagedKVPool",
    "QuantizedKVCache",
    "Scheduler",
    "unwrap",
    "wrap",
    "wrapped",
]
