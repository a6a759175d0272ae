"""``KVQuantConfig``: which precision each (layer, KV head) stores its K and V in.

A config is a default precision plus overrides per layer and per (layer, KV head), for K and V
together or separately, and a few storage options. It reads and writes YAML and JSON::

    default: int8                 # every K and V, unless overridden below
    group_size: 32                # channels per (scale, zero) group for int4 / int2
    layers:
      0: fp16                     # both K and V of every head of layer 0
      5: {key: int8, value: int4}
    heads:
      "3.1": int8                 # layer 3, KV head 1
      "7.0": {key: fp16}          # only the keys of layer 7, head 0
    evict: {policy: snapkv, keep: 0.5, window: 32, sinks: 4, budget: uniform}   # optional: keep fewer tokens

A precision is a name from :data:`kvquant.quantizers.PRECISIONS`, or ``{bits: 2|4|8|16}``.
Every error names the field it is about, e.g. ``heads."3.9": KV head 9 out of range``.

The package's modules: :mod:`.schema` (the dataclass), :mod:`.fields` (bounds, field names, :class:`KVPrecision`),
:mod:`.presets`, :mod:`.checks` (each field's own bounds) and :mod:`.load` (parsing the text and nested fields).
"""

from __future__ import annotations

from ..errors import ConfigError
from .fields import _TOP_LEVEL, CONFIG_SUFFIXES, MAX_CAPACITY, KVPrecision, check_int
from .presets import DEFAULT_PRESET, PRESETS
from .schema import KVQuantConfig

__all__ = ["CONFIG_SUFFIXES", "ConfigError", "DEFAULT_PRESET", "KVPrecision", "KVQuantConfig", "MAX_CAPACITY",
           "PRESETS", "_TOP_LEVEL", "check_int"]  # fmt: skip
