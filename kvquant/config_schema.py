"""The config schema: field bounds, :class:`KVPrecision`, the option fields and the per-field checks and parsers that
:class:`~kvquant.config.KVQuantConfig` applies when it loads (every error names the field it is about)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .evict import BUDGETS, DECODE_POLICIES, POLICIES, EvictConfig
from .quantizers import (
    CHANNEL_PREFIX,
    CODEBOOK,
    GAINS,
    PRECISIONS,
    TRELLIS,
    VECTOR,
    is_precision,
)

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


OPTION_FIELDS = {
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
TOP_LEVEL = {"default", "layers", "heads", "name", "description", "model_shape", "evict"} | OPTION_FIELDS
MAX_EVICT_TOKENS = 1 << 16  # evict.window / evict.sinks



STATIC_SCALE = {"int8", "fp8-e4m3", "fp8-e5m2"}  # the precisions whose static scale headroom widens


def is_codebook(precision: str) -> bool:
    return precision in CODEBOOK or precision in VECTOR or precision in TRELLIS or precision.startswith(CHANNEL_PREFIX)


def _check_group_size(gs: Any) -> None:
    if gs is not None and (
        not isinstance(gs, int) or isinstance(gs, bool) or not 0 < gs <= MAX_GROUP_SIZE or gs & (gs - 1)
    ):
        raise ConfigError(f"group_size: {gs!r} must be a power of two from 1 to {MAX_GROUP_SIZE}")


def _check_headroom(hr: Any) -> None:
    if (
        not isinstance(hr, (int, float)) or isinstance(hr, bool) or not math.isfinite(hr)
        or not 1.0 <= hr <= MAX_HEADROOM
    ):
        raise ConfigError(f"headroom: {hr!r} must be a number from 1.0 to {MAX_HEADROOM:g}")


def _check_block_size(bs: Any) -> None:
    if not isinstance(bs, int) or isinstance(bs, bool) or bs < 16 or bs > 4096 or bs & (bs - 1):
        raise ConfigError(f"block_size: {bs!r} must be a power of two between 16 and 4096")


def _check_choice(name: str, choices: tuple[str, ...]) -> Any:
    def check(value: Any) -> None:
        if value not in choices:
            raise ConfigError(f"{name}: {value!r} must be one of {', '.join(choices)}")

    return check


def _check_bool(name: str, optional: bool = False) -> Any:
    def check(value: Any) -> None:
        if not isinstance(value, bool) and not (optional and value is None):
            raise ConfigError(f"{name}: {value!r} must be true{', false or null' if optional else ' or false'}")

    return check


def _check_tokens(name: str, hi: int) -> Any:
    return lambda value: check_int(value, name, 0, hi)


def _check_residual_step(value: Any) -> None:
    if value is not None:
        check_int(value, "residual_step", 1, 4096)


def _check_scales_file(value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"scales_file: {value!r} must be a path")


#: each field's own bounds, checked on construction and on every assignment (constraints between fields are
#: checked by ``_check_options``)
FIELD_CHECKS: dict[str, Any] = {
    "group_size": _check_group_size,
    "headroom": _check_headroom,
    "block_size": _check_block_size,
    "rotate": _check_choice("rotate", ("none", "keys", "kv")),
    "sink_tokens": _check_tokens("sink_tokens", MAX_SINK_TOKENS),
    "residual_tokens": _check_tokens("residual_tokens", MAX_RESIDUAL_TOKENS),
    "residual_step": _check_residual_step,
    "ladder_tokens": _check_tokens("ladder_tokens", MAX_RESIDUAL_TOKENS),
    "ladder2_tokens": _check_tokens("ladder2_tokens", MAX_RESIDUAL_TOKENS),
    "heavy_tokens": _check_tokens("heavy_tokens", MAX_RESIDUAL_TOKENS),
    "share_kv_scale": _check_bool("share_kv_scale"),
    "check_finite": _check_bool("check_finite"),
    "codebook_search": _check_bool("codebook_search"),
    "center_keys": _check_bool("center_keys", optional=True),
    "codebook_gain": _check_choice("codebook_gain", tuple(GAINS)),
    "scales_file": _check_scales_file,
}


# ---------------------------------------------------------------------- parsing helpers
def check_offload(value: Any) -> dict[str, Any] | None:
    """``offload``: ``None``/``false`` or ``{device: cpu, keep_recent_blocks: N}`` (N >= 0, default 2), normalised."""
    if value is None or value is False:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"offload: expected {{device: cpu, keep_recent_blocks: N}} or null, got {value!r}")
    extra = sorted(set(map(str, value)) - {"device", "keep_recent_blocks"})
    if extra:
        raise ConfigError(f"offload.{extra[0]}: unknown field (known: device, keep_recent_blocks)")
    device = value.get("device", "cpu")
    if device not in OFFLOAD_DEVICES:
        raise ConfigError(f"offload.device: {device!r} must be one of {', '.join(OFFLOAD_DEVICES)} (host memory)")
    keep = check_int(value.get("keep_recent_blocks", 2), "offload.keep_recent_blocks", 0, MAX_OFFLOAD_KEEP)
    return {"device": device, "keep_recent_blocks": keep}



def parse_text(text: str, path: Path) -> Any:
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: neither YAML nor JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"config file {path}: neither a YAML nor a JSON mapping of fields (got {type(data).__name__})"
        )
    return data


def refuse_float_key(key: Any, where: str) -> None:
    """A key YAML read as a number with a fraction (``2.10`` -> ``2.1``) lost what was written: refuse it."""
    if isinstance(key, float):
        raise ConfigError(
            f"{where}: YAML reads this key as the number {key!r}, so \"2.10\" and \"2.1\" look alike; quote it "
            f"(heads: {{\"2.10\": int2}} for layer 2, head 10)"
        )


def parse_index(value: Any, where: str) -> int:
    try:
        idx = int(str(value))
    except ValueError:
        raise ConfigError(f"{where}: {value!r} is not an index") from None
    if idx < 0:
        raise ConfigError(f"{where}: index {idx} must be >= 0")
    return idx


def _parse_precision(value: Any, where: str) -> str:
    if isinstance(value, Mapping):
        keys = set(map(str, value))
        if keys == {"bits"}:
            bits = value["bits"]
            if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS_TO_PRECISION:
                raise ConfigError(f"{where}.bits: {bits!r} is not supported (choose 2, 4, 8 or 16)")
            return BITS_TO_PRECISION[bits]
        if keys == {"precision"}:
            value = value["precision"]
        else:
            raise ConfigError(f"{where}: expected a precision name or {{bits: N}}, got {dict(value)!r}")
    if not is_precision(value):
        raise ConfigError(f"{where}: unknown precision {value!r} (known: {', '.join(PRECISIONS)})")
    return value


def parse_pair(value: Any, where: str, partial: bool = False) -> KVPrecision:
    """A precision for K and V together, or ``{key: ..., value: ...}`` (one of them if ``partial``)."""
    if isinstance(value, Mapping) and set(map(str, value)) & {"key", "value"}:
        extra = set(map(str, value)) - {"key", "value"}
        if extra:
            raise ConfigError(f"{where}.{sorted(extra)[0]}: unknown field (use key / value)")
        k = _parse_precision(value["key"], f"{where}.key") if "key" in value else None
        v = _parse_precision(value["value"], f"{where}.value") if "value" in value else None
        if not partial and (k is None or v is None):
            raise ConfigError(f"{where}: needs both key and value")
        return KVPrecision(k, v)
    p = _parse_precision(value, where)
    return KVPrecision(p, p)


def parse_evict(value: Any, where: str, base: EvictConfig | None = None) -> EvictConfig:
    """``evict: {policy, keep, window, sinks, budget, layers}`` (a layer override: the same fields but ``layers``,
    on top of ``base``); raises :class:`ConfigError` naming the field."""
    if isinstance(value, EvictConfig):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping like {{policy: snapkv, keep: 0.5}}, got {value!r}")
    known = EvictConfig.FIELDS if base is not None else (*EvictConfig.FIELDS, "layers")
    for k in value:
        if str(k) not in known:
            raise ConfigError(f"{where}.{k}: unknown field (known: {', '.join(known)})")
    start = base or EvictConfig()
    fields_ = {n: value.get(n, getattr(start, n)) for n in EvictConfig.FIELDS}
    policy = fields_["policy"]
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ConfigError(f"{where}.policy: {policy!r} is not one of {', '.join(POLICIES)} (or a scorer object)")
    elif not callable(getattr(policy, "score", None)):
        raise ConfigError(f"{where}.policy: {policy!r} is neither a policy name nor an object with a score() method")
    keep = fields_["keep"]
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0.0 < keep <= 1.0:
        raise ConfigError(f"{where}.keep: {keep!r} must be a fraction in (0, 1]")
    check_int(fields_["window"], f"{where}.window", 0, MAX_EVICT_TOKENS)
    check_int(fields_["sinks"], f"{where}.sinks", 0, MAX_EVICT_TOKENS)
    if fields_["budget"] not in BUDGETS:
        raise ConfigError(f"{where}.budget: {fields_['budget']!r} must be one of {', '.join(BUDGETS)}")
    if fields_["budget"] == "adakv" and isinstance(policy, str) and policy in DECODE_POLICIES:
        raise ConfigError(f"{where}.budget: adakv applies to prefill-time policies; {policy} keeps a uniform budget")
    cfg = EvictConfig(**{**fields_, "keep": float(keep)})
    if base is None:
        layers = value.get("layers") or {}
        if not isinstance(layers, Mapping):
            raise ConfigError(f"{where}.layers: expected a mapping like {{0: {{keep: 1.0}}, 3: null}}, got {layers!r}")
        for k, v in layers.items():
            layer = parse_index(k, f"{where}.layers.{k}")
            cfg.layers[layer] = None if v is None else parse_evict(v, f"{where}.layers.{k}", cfg)
    return cfg
