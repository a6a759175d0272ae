"""kvquant: quantize and compress the KV cache of transformers LLMs, and measure what it costs.

Quick start::

    import kvquant
    model = kvquant.wrap(model)                  # generate() now uses a quantized KV cache (int8-kchannel)
    out = model.generate(**inputs, max_new_tokens=200)

    cache = kvquant.QuantizedKVCache(model, kvquant.KVQuantConfig.preset("mixed-int4-int8"))
    out = model.generate(**inputs, cache=cache, max_new_tokens=200)
    print(cache.memory_report())
"""

from .cache import QuantizedKVCache, QuantizedLayer
from .config import DEFAULT_PRESET, PRESETS, ConfigError, KVPrecision, KVQuantConfig
from .errors import KVQuantError
from .quantizers import PRECISIONS, make_quantizer
from .shape import ModelShape
from .simulate import SimulatedQuantCache
from .wrap import unwrap, wrap

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_PRESET",
    "PRECISIONS",
    "PRESETS",
    "ConfigError",
    "KVPrecision",
    "KVQuantError",
    "KVQuantConfig",
    "ModelShape",
    "QuantizedKVCache",
    "QuantizedLayer",
    "SimulatedQuantCache",
    "make_quantizer",
    "unwrap",
    "wrap",
]
