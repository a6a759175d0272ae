"""The named configs (presets) a user picks by name: ``kvquant presets`` lists them, :meth:`KVQuantConfig.load
<kvquant.config.KVQuantConfig.load>` resolves a name to one."""

from __future__ import annotations

from typing import Any

#: The preset ``kvquant.wrap(model)`` and ``QuantizedKVCache(model)`` use when given no config: chosen by
#: measurement, it holds within +0.1% perplexity and KL <= 1e-3 on SmolLM2 and on every outlier stress
#: model (docs/results/stress-outliers.md).
DEFAULT_PRESET = "int8-kchannel"

# Presets: name -> (default precision(s), description, extra fields).
PRESETS: dict[str, tuple[Any, str, dict[str, Any]]] = {
    "fp16": ("fp16", "float16 passthrough: the FP16 reference, through kvquant's own store", {}),
    "bf16": ("bf16", "bfloat16 passthrough", {}),
    "fp32": ("fp32", "float32 passthrough (exact for fp32 models)", {}),
    "int8": ("int8", "INT8, one scale per (layer, KV head) shared by K and V (alias of int8-shared)", {}),
    "int8-shared": ("int8", "INT8, one static scale per (layer, KV head) shared by K and V (the seed design)", {}),
    "int8-separate": (
        "int8",
        "INT8, separate static K and V scales per (layer, KV head)",
        {"share_kv_scale": False},
    ),
    "int8-token": ("int8-token", "INT8, one scale per token and KV head", {}),
    "int4": ("int4", "INT4 asymmetric, groups of 32 along head_dim", {}),
    "int2": ("int2", "INT2 asymmetric, groups of 32 along head_dim", {}),
    "fp8-e4m3": ("fp8-e4m3", "FP8 e4m3, one scale per (layer, KV head)", {}),
    "fp8-e5m2": ("fp8-e5m2", "FP8 e5m2, one scale per (layer, KV head)", {}),
    "int8-kchannel": (
        {"key": "int8-channel", "value": "int8-token"},
        "keys INT8 per channel over blocks of block_size tokens (the newest, unfilled block in fp16), "
        "values INT8 per token",
        {},
    ),
    "int4-kchannel": (
        {"key": "int4-channel", "value": "int4"},
        "keys INT4 per channel over blocks of block_size tokens (the newest, unfilled block in fp16), "
        "values INT4 per token, groups of 32 along head_dim (KIVI)",
        {},
    ),
    "int4-kchannel-sinks": (
        {"key": "int4-channel", "value": "int4"},
        "int4-kchannel plus the first 4 tokens of each sequence (attention sinks) kept in fp16",
        {"sink_tokens": 4},
    ),
    "int4-kchannel-g16-sinks": (
        {"key": "int4-channel", "value": "int4"},
        "int4-kchannel-sinks with values in groups of 16 along head_dim (finer value scales)",
        {"sink_tokens": 4, "group_size": 16},
    ),
    "mixed-int4-int8": (
        {"key": "int8-token", "value": "int4"},
        "keys INT8 per token (keys carry outlier channels), values INT4 g32",
        {},
    ),
}
