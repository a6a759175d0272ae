"""Parsing a config's YAML / JSON text and its nested fields (precisions, layer and head keys, ``evict``,
``offload``) into typed values; every error names its field."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from ..evict import BUDGETS, DECODE_POLICIES, POLICIES, EvictConfig
from ..quantizers import (
    PRECISIONS,
    is_precision,
)
from .fields import (
    BITS_TO_PRECISION,
    MAX_EVICT_TOKENS,
    MAX_OFFLOAD_KEEP,
    OFFLOAD_DEVICES,
    KVPrecision,
    check_int,
)


# ---------------------------------------------------------------------- parsing helpers
def _check_offload(value: Any) -> dict[str, Any] | None:
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



def _parse_text(text: str, path: Path) -> Any:
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


def _refuse_float_key(key: Any, where: str) -> None:
    """A key YAML read as a number with a fraction (``2.10`` -> ``2.1``) lost what was written: refuse it."""
    if isinstance(key, float):
        raise ConfigError(
            f"{where}: YAML reads this key as the number {key!r}, so \"2.10\" and \"2.1\" look alike; quote it "
            f"(heads: {{\"2.10\": int2}} for layer 2, head 10)"
        )


def _parse_index(value: Any, where: str) -> int:
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


def _parse_pair(value: Any, where: str, partial: bool = False) -> KVPrecision:
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


def _parse_evict(value: Any, where: str, base: EvictConfig | None = None) -> EvictConfig:
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
            layer = _parse_index(k, f"{where}.layers.{k}")
            cfg.layers[layer] = None if v is None else _parse_evict(v, f"{where}.layers.{k}", cfg)
    return cfg
