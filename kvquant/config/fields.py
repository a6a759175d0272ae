"""The config's field vocabulary: bounds checked at load, the option and top-level field names, ``check_int``
and :class:`KVPrecision` (the K / V precisions of one KV head)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

BITS_TO_PRECISION = {2: "int2", 4: "int4", 8: "int8", 16: "fp16"}
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")

# Bounds checked at load: a value outside them is a typo or a misunderstanding, never a useful setting, and
# some of them would allocate memory in proportion (sink tokens are preallocated per sequence).
MAX_GROUP_SIZE = 1024
MAX_HEADROOM = 100.0
MAX_SINK_TOKENS = 1024  # StreamingLLM keeps 4; each one is preallocated in full precision per sequence
MAX_RESIDUAL_TOKENS = 1 << 16
MAX_MODEL_DIM = 1 << 20  # model_shape values (layers, KV heads, head_dim)
MAX_OFFLOAD_KEEP = 1 << 20  # offload.keep_recent_blocks
OFFLOAD_DEVICES = ("cpu",)  # the host tier of ``offload`` (pinned host memory on CUDA)
MAX_CAPACITY = 1 << 24  # tokens preallocated per sequence (QuantizedKVCache / wrap capacity=)


def check_int(value: Any, name: str, lo: int, hi: int, error: type[ValueError] = ConfigError) -> int:
    """``value`` if it is an integer (not a bool) in ``[lo, hi]``, else ``error`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise error(f"{name}: {value!r} must be an integer from {lo} to {hi}")
    return value


@dataclass(frozen=True)
class KVPrecision:
    """The precisions of the keys and the values of one KV head (``None`` in an override: inherit)."""

    key: str | None
    value: str | None

    def as_yaml(self) -> str | dict[str, str]:
        if self.key == self.value:
            return self.key
        return {k: v for k, v in (("key", self.key), ("value", self.value)) if v}

    def over(self, base: KVPrecision) -> KVPrecision:
        """This override applied on top of ``base``."""
        return KVPrecision(self.key or base.key, self.value or base.value)


#: The preset ``kvquant.wrap(model)`` and ``QuantizedKVCache(model)`` use when given no config: chosen by


_OPTION_FIELDS = {
    "group_size",
    "headroom",
    "share_kv_scale",
    "block_size",
    "scales_file",
    "check_finite",
    "rotate",
    "sink_tokens",
    "residual_tokens",
    "residual_step",
    "ladder_tokens",
    "ladder2_tokens",
    "heavy_tokens",
    "center_keys",
    "codebook_gain",
    "codebook_search",
    "offload",
}
_TOP_LEVEL = {"default", "layers", "heads", "name", "description", "model_shape", "evict"} | _OPTION_FIELDS
MAX_EVICT_TOKENS = 1 << 16  # evict.window / evict.sinks


STATIC_SCALE = {"int8", "fp8-e4m3", "fp8-e5m2"}  # the precisions whose static scale headroom widens
