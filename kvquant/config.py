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
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError, InputError
from .evict import BUDGETS, DECODE_POLICIES, POLICIES, EvictConfig
from .exclusions import ConfigFacts
from .exclusions import check as check_exclusions
from .inputs import read_text
from .outputs import check_output, write_text
from .quantizers import (
    CHANNEL,
    CHANNEL_PREFIX,
    CODEBOOK,
    GAINS,
    GROUPED,
    PRECISIONS,
    TRELLIS,
    VECTOR,
    is_precision,
    make_quantizer,
)
from .shape import ModelShape, model_dtype

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

__all__ = ["ConfigError", "KVPrecision", "KVQuantConfig", "PRESETS", "check_int"]


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


@dataclass
class KVQuantConfig:
    """Precision plan for a KV cache: a default plus per-layer and per-(layer, KV head) overrides.

    Args:
        default: precision of every K and V unless overridden.
        layers: ``{layer: KVPrecision}`` overrides for whole layers.
        heads: ``{(layer, kv_head): KVPrecision}`` overrides, applied after ``layers``.
        group_size: channels per group for ``int4``/``int2``; ``None`` means 32, or head_dim if smaller.
        headroom: multiplier on the calibrated max for static scales (``int8``, ``fp8-*``); > 1 leaves
            room for values larger than the prefill's, at some resolution. Default 1.5: on stories260K,
            scales from a 5-token prompt clip later tokens at 1.0 (93% top-1 vs FP16) but not at 1.5 (98%).
        share_kv_scale: ``int8`` keys and values of a head share one scale (the seed design).
        block_size: tokens per storage block (memory grows by whole blocks).
        scales_file: static K/V scales measured on calibration text instead of each prefill: a kvquant scales
            file (``kvquant export --format kvquant``) or a serving-engine export directory (``--format vllm``);
            see :mod:`kvquant.scales`.
        check_finite: reject NaN/Inf K/V when written (one reduction per write; on CUDA an asynchronous
            device-side check, no host synchronisation: it raises at the next synchronisation).
        rotate: ``none``, ``keys`` or ``kv``: store K (and V) Hadamard-rotated per head; queries are rotated
            alike and the output un-rotated, so attention is unchanged while outlier channels are spread.
        sink_tokens: the first N tokens of each sequence are kept in full precision (attention sinks).
        residual_tokens: the newest R tokens stay in full precision; older ones are quantized a whole
            block at a time, once (KIVI's residual). Per-channel key precisions imply this mode.
        residual_step: tokens quantized at a time once the residual window is full; ``None`` (default):
            ``block_size``, so the window holds ``R`` to ``R + block_size - 1`` tokens. ``1``: it holds exactly
            ``R`` (every new token pushes the oldest one into the pool). Any value from 1 to ``block_size``;
            per-block precisions (``int*-channel``: one scale per block of tokens) need ``block_size``.
        ladder_tokens: an age ladder: the N newest quantized tokens of each (layer, KV head) whose K (or V) is a
            codebook code (``tq*``, ``tqv*``, ``tqc-*``, ``tqt*``) also keep one refinement bit per coordinate (an
            embedded code: the base code plus a bit that splits its cell, ``Codebook.refine``; for the trellis
            ``tqt*``, the sign of the coordinate's residual, ``TrellisCodebook.refine``), so they read at about the next
            width's error; older tokens drop the bit and read at the base width, never re-coded. The bits are
            held in a small ring beside the residual window (``D / 8`` bytes per row; counted in the bytes held).
            Not held for sliding-window layers or per-head lanes; excludes ``evict`` and ``offload``. The Triton
            path decodes the ring's rows (refined) beside the residual window and reads the older pool in-kernel.
            0 (default): off.
        ladder2_tokens: a second rung on the age ladder: the N newest of its ``ladder_tokens`` rows (so N <=
            ``ladder_tokens``) keep one more bit per coordinate, the sign of the coordinate's residual against its
            refined value, which moves by the refined cell's mean absolute residual (``SecondRung``; ~1/3 of the
            refined row's error on Gaussian rows). Another ``D / 8`` bytes per row, held in a second ring; a row
            that ages past it drops that bit and reads refined once. For ``tq*``, ``tqc-*`` and ``tqt*`` rows
            (``tqv*`` rows keep the first rung). 0 (default): off.
        heavy_tokens: heavy rows: the N prompt rows of each (layer, KV head) with a codebook K (or V) that the
            prompt's own attention weighs most (H2O's score: softmax weight summed over every prompt query) keep the
            first rung's bit per coordinate for good, picked when the prompt is written (rows of the age ladder,
            the sinks and the residual window excepted); :mod:`kvquant.heavy`. ``D / 8 + 1`` bytes per row and
            side, plus a 2-byte position per (row, head); counted in the bytes held. Needs the model's queries (a
            model wrapped by kvquant, whose attention passes them); not for sliding-window layers or per-head lanes;
            excludes ``evict`` and ``offload``. The Triton kernels read the pool as it is; each heavy row's base term
            in their softmax is then traded for its refined one (``swap_rows``). 0 (default): off.
        center_keys: subtract one per-channel key mean per (sequence, KV head), fixed from the prefill
            (sink tokens left out), from every stored key before rotating and quantizing. Exact: a query
            sees ``q.(k - mu) = q.k - q.mu`` for every key, a shift common to all of its scores, which
            softmax ignores. ``None`` (default): on when ``rotate`` rotates keys, so a bias offset is
            not spread over every channel.
        codebook_gain: how a codebook precision (``tq*``, ``tqv*``, ``tqt*``, ``tqc-*``) picks each row's stored
            norm: ``unbiased`` (default) makes the row's projection on itself exact, so scores and attention
            outputs are not shrunk by the code's MSE; ``mse`` is the least-squares norm (the least row error,
            shrunk by ~the code's relative MSE). See
            :func:`kvquant.quantizers.codebook.row_gain`.
        codebook_search: ``tqc-*`` keys search each row's code scale for the least score-weighted error (default
            true; encoder only, same bytes and decoders): rows with a value far out on a narrow channel are no
            longer clipped there. ``false``: the RMS scale alone.
            See :class:`kvquant.quantizers.codebook.ChannelCodebook`.
        evict: keep only some tokens (:class:`~kvquant.evict.EvictConfig`: ``{policy, keep, window, sinks,
            budget, layers}``); ``None`` keeps every token. The kept tokens are stored in this config's
            precisions; see :mod:`kvquant.evict`.
        offload: ``{device: cpu, keep_recent_blocks: N}``: the newest N full blocks of each sequence (and the blocks
            holding its sink tokens) stay on the compute device, older full blocks move to host memory (pinned on
            CUDA) and are fetched back, tile by tile and one tile ahead, by the attention that reads them
            (:mod:`kvquant.offload`). ``None`` (default): every block stays on the compute device.
        name: preset or file name, for reports.
    """

    default: KVPrecision = field(default_factory=lambda: KVPrecision("int8", "int8"))
    layers: dict[int, KVPrecision] = field(default_factory=dict)
    heads: dict[tuple[int, int], KVPrecision] = field(default_factory=dict)
    group_size: int | None = None
    headroom: float = 1.5
    share_kv_scale: bool = True
    block_size: int = 128
    scales_file: str | None = None
    check_finite: bool = True
    rotate: str = "none"
    sink_tokens: int = 0
    residual_tokens: int = 0
    residual_step: int | None = None
    ladder_tokens: int = 0
    ladder2_tokens: int = 0
    heavy_tokens: int = 0
    center_keys: bool | None = None
    codebook_gain: str = "unbiased"
    codebook_search: bool = True
    offload: dict[str, Any] | None = None
    name: str | None = None
    description: str | None = None
    model_shape: dict[str, int] | None = None
    evict: EvictConfig | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def preset(cls, name: str) -> KVQuantConfig:
        """A named preset: ``fp16``, ``int8``, ``int8-token``, ``int4``, ``fp8-e4m3``, ... (see ``PRESETS``)."""
        if name not in PRESETS:
            raise ConfigError(f"preset: unknown {name!r} (known: {', '.join(PRESETS)})")
        default, description, extra = PRESETS[name]
        cfg = cls.from_dict({"default": default, **extra})
        cfg.name = name
        cfg.description = description
        return cfg

    @classmethod
    def load(cls, spec: str | Path | Mapping[str, Any] | KVQuantConfig) -> KVQuantConfig:
        """A preset name, a YAML/JSON file path, a mapping, or a config (returned as is)."""
        if isinstance(spec, KVQuantConfig):
            return spec
        if isinstance(spec, Mapping):
            return cls.from_dict(spec)
        if isinstance(spec, str) and spec in PRESETS:
            return cls.preset(spec)
        if not isinstance(spec, (str, Path)):
            raise ConfigError(f"config: expected a preset name, a file path, a mapping or a config, got {spec!r}")
        return cls.from_file(spec)

    @classmethod
    def from_file(cls, path: str | Path) -> KVQuantConfig:
        """Read a YAML or JSON config file (a preset name is accepted too)."""
        p = Path(path)
        if not p.is_file():
            if str(path) in PRESETS:
                return cls.preset(str(path))
            raise ConfigError(f"config: {str(path)!r} is neither a file nor a preset (presets: {', '.join(PRESETS)})")
        try:
            text = read_text(p, "config")
        except InputError as e:  # not readable or not UTF-8: still a config error, naming the file
            raise ConfigError(str(e)) from None
        data = _parse_text(text, p)
        cfg = cls.from_dict(data, source=str(p))
        cfg.name = cfg.name or p.stem
        if cfg.scales_file:  # a relative path is relative to the config file, wherever the command runs
            sf = Path(cfg.scales_file).expanduser()
            cfg.scales_file = str(sf if sf.is_absolute() else p.resolve().parent / sf)
        return cfg

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> KVQuantConfig:
        """Build from a mapping with the YAML schema above; raises :class:`ConfigError` naming the field."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
        unknown = sorted(set(map(str, data)) - _TOP_LEVEL)
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown field (known: {', '.join(sorted(_TOP_LEVEL))})")
        cfg = cls()
        if "default" in data:
            cfg.default = _parse_pair(data["default"], "default")
        layers = data.get("layers") or {}
        if not isinstance(layers, Mapping):
            raise ConfigError(f"layers: expected a mapping like {{0: int8, 5: {{key: int8}}}}, got {layers!r}")
        for k, v in layers.items():
            _refuse_float_key(k, f"layers.{k}")
            layer = _parse_index(k, f"layers.{k}")
            cfg.layers[layer] = _parse_pair(v, f"layers.{k}", partial=True)
        heads = data.get("heads") or {}
        if not isinstance(heads, Mapping):
            raise ConfigError("heads: expected a mapping like {\"3.1\": int8}")
        for k, v in heads.items():
            if isinstance(v, Mapping) and not (set(map(str, v)) & {"key", "value", "bits", "precision"}):
                # nested form {layer: {head: spec}}
                layer = _parse_index(k, f"heads.{k}")
                if not v:
                    raise ConfigError(f"heads.{k}: empty; expected {{head: precision}}")
                for hk, hv in v.items():
                    _refuse_float_key(hk, f"heads.{k}.{hk}")
                    head = _parse_index(hk, f"heads.{k}.{hk}")
                    cfg.heads[(layer, head)] = _parse_pair(hv, f"heads.{k}.{hk}", partial=True)
                continue
            _refuse_float_key(k, f"heads.{k}")
            parts = str(k).split(".")
            if len(parts) != 2:
                raise ConfigError(f'heads."{k}": expected "layer.head", e.g. "3.1"')
            layer = _parse_index(parts[0], f'heads."{k}"')
            head = _parse_index(parts[1], f'heads."{k}"')
            cfg.heads[(layer, head)] = _parse_pair(v, f'heads."{k}"', partial=True)
        for name in _OPTION_FIELDS:
            if name in data:
                setattr(cfg, name, data[name])
        for name in ("name", "description"):
            if data.get(name) is not None and not isinstance(data[name], str):
                raise ConfigError(f"{name}: {data[name]!r} must be a string")
        cfg.name = data.get("name")
        cfg.description = data.get("description")
        cfg.model_shape = data.get("model_shape")
        if data.get("evict") is not None:
            cfg.evict = _parse_evict(data["evict"], "evict")
        cfg._check_options()
        cfg._check_no_ops()
        cfg._warn_no_ops(set(map(str, data)))
        return cfg

    def __post_init__(self) -> None:
        """Every bound is enforced however a config is built (``KVQuantConfig(...)``, ``from_dict``, ``replace``)."""
        self._check_plan()
        self._check_options()
        object.__setattr__(self, "_built", True)

    def __setattr__(self, name: str, value: Any) -> None:
        """An assignment after construction is checked against the field's own bounds (a refused value is not
        set); constraints between fields are checked again by :meth:`validate`, before any cache uses it."""
        if name in _FIELD_CHECKS and self.__dict__.get("_built"):
            _FIELD_CHECKS[name](value)
        object.__setattr__(self, name, value)

    def _check_plan(self) -> None:
        if not isinstance(self.default, KVPrecision):
            raise ConfigError(f"default: {self.default!r} must be a KVPrecision (or use KVQuantConfig.from_dict)")
        if not isinstance(self.layers, dict) or not all(
            isinstance(k, int) and not isinstance(k, bool) and k >= 0 and isinstance(v, KVPrecision)
            for k, v in self.layers.items()
        ):
            raise ConfigError("layers: must map layer indices (int >= 0) to KVPrecision")
        if not isinstance(self.heads, dict) or not all(
            isinstance(k, tuple) and len(k) == 2 and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                         for i in k) and isinstance(v, KVPrecision)
            for k, v in self.heads.items()
        ):
            raise ConfigError("heads: must map (layer, kv_head) index pairs to KVPrecision")
        for p in (self.default, *self.layers.values(), *self.heads.values()):
            for name in (p.key, p.value):
                if name is not None and not is_precision(name):
                    raise ConfigError(f"default: unknown precision {name!r} (known: {', '.join(PRECISIONS)})")

    def _check_options(self) -> None:
        for name, check in _FIELD_CHECKS.items():
            check(getattr(self, name))
        bs = self.block_size
        if self.residual_step is not None:
            check_int(self.residual_step, "residual_step", 1, bs)
        if self.ladder2_tokens > self.ladder_tokens:
            raise ConfigError(
                f"ladder2_tokens: {self.ladder2_tokens} exceeds ladder_tokens ({self.ladder_tokens}); the second "
                "rung's rows are the ladder's youngest"
            )
        if self.evict is not None and not isinstance(self.evict, EvictConfig):
            raise ConfigError(f"evict: expected a mapping like {{policy: snapkv, keep: 0.5}}, got {self.evict!r}")
        check_exclusions(self.facts(), "config")
        self.offload = _check_offload(self.offload)
        if self.model_shape is not None:
            if not isinstance(self.model_shape, Mapping) or set(self.model_shape) - {"layers", "kv_heads", "head_dim"}:
                raise ConfigError("model_shape: expected {layers: N, kv_heads: N, head_dim: N}")
            for key, v in self.model_shape.items():
                check_int(v, f"model_shape.{key}", 1, MAX_MODEL_DIM)
        self._check_evict()

    def facts(self) -> ConfigFacts:
        """What the config-wide exclusion rules (:data:`kvquant.exclusions.RULES`) read of this config."""
        ev = self.evict
        specs = () if ev is None else (ev, *(c for c in ev.layers.values() if c is not None))
        return ConfigFacts(
            ladder_tokens=self.ladder_tokens, ladder2_tokens=self.ladder2_tokens, heavy_tokens=self.heavy_tokens,
            offload=self.offload not in (None, False), evict=ev is not None,
            adakv=any(c.budget == "adakv" for c in specs),
            decode_time_evict=ev is not None and ev.decode_time, residual_step=self.residual_step,
            block_size=self.block_size, per_channel=tuple(sorted(self.precisions() & set(CHANNEL))),
        )

    def _check_no_ops(self) -> None:
        """An option that would silently do nothing for the precisions a config file or mapping names is refused
        (a config built directly may be given its rows elsewhere, e.g. by a LayerStore, and is not checked here)."""
        for name in ("ladder_tokens", "heavy_tokens"):
            if getattr(self, name) and not any(is_codebook(p) for p in self.precisions()):
                raise ConfigError(
                    f"{name}: {getattr(self, name)} does nothing here: no K or V is a codebook precision (tq*, tqv*, "
                    f"tqt*, tqc-*; the config stores {', '.join(sorted(self.precisions()))}); drop it or use one"
                )

    def _warn_no_ops(self, given: set[str]) -> None:
        """Warn about options a file or mapping sets that do nothing for the precisions this config names."""
        precisions = self.precisions()
        uses = {
            "codebook_gain": any(is_codebook(p) for p in precisions),
            "codebook_search": any(p.startswith(CHANNEL_PREFIX) for p in precisions),
            "headroom": bool(precisions & STATIC_SCALE),
            "share_kv_scale": "int8" in precisions,
            "group_size": bool(precisions & set(GROUPED)),
            "ladder2_tokens": any(is_codebook(p) and p not in VECTOR for p in precisions),
        }
        idle = sorted(n for n, used in uses.items() if n in given and not used)
        if idle:
            warnings.warn(f"{', '.join(idle)}: {'does' if len(idle) == 1 else 'do'} nothing for the precisions this "
                          f"config stores ({', '.join(sorted(precisions))})", UserWarning, stacklevel=3)

    def _check_evict(self) -> None:
        """The ``evict`` field's bound against ``sink_tokens`` (its exclusions: :data:`kvquant.exclusions.RULES`)."""
        ev = self.evict
        if ev is None or not ev.decode_time:
            return
        sinks = min([ev.sinks, *(c.sinks for c in ev.layers.values() if c is not None)])
        if sinks < self.sink_tokens:
            raise ConfigError(
                f"evict.sinks: {sinks} is fewer than sink_tokens {self.sink_tokens}; h2o / tova must never replace "
                "a full-precision sink token"
            )

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict[str, Any]:
        """The YAML/JSON form (round-trips through :meth:`from_dict`)."""
        out: dict[str, Any] = {}
        if self.name:
            out["name"] = self.name
        if self.description:
            out["description"] = self.description
        out["default"] = self.default.as_yaml()
        defaults = KVQuantConfig()
        for f in fields(self):
            if f.name in _OPTION_FIELDS and getattr(self, f.name) != getattr(defaults, f.name):
                out[f.name] = getattr(self, f.name)
        if self.model_shape:
            out["model_shape"] = dict(self.model_shape)
        if self.evict is not None:
            out["evict"] = self.evict.to_dict()
        if self.layers:
            out["layers"] = {i: p.as_yaml() for i, p in sorted(self.layers.items())}
        if self.heads:
            out["heads"] = {f"{li}.{h}": p.as_yaml() for (li, h), p in sorted(self.heads.items())}
        return out

    def to_yaml(self, header: str | None = None) -> str:
        body = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)
        if header:
            body = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + body
        return body

    def save(self, path: str | Path, header: str | None = None, force: bool = True) -> None:
        """Write YAML (``.yaml``/``.yml``) or JSON (``.json``), chosen by the suffix, atomically.

        Any other suffix raises :class:`~kvquant.errors.OutputError`; so does an existing file when
        ``force`` is false.
        """
        if self.evict is not None and not isinstance(self.evict.policy, str):
            raise ConfigError(f"evict.policy: a Python scorer ({self.evict.policy_name}) cannot be saved to a file")
        p = check_output(path, CONFIG_SUFFIXES, "config", force=force)
        text = json.dumps(self.to_dict(), indent=2) + "\n" if p.suffix.lower() == ".json" else self.to_yaml(header)
        write_text(p, text, force=force, what="config")

    # ------------------------------------------------------------------ resolution
    @property
    def centers_keys(self) -> bool:
        """Whether stored keys have the prefill's per-channel mean removed (``center_keys``, default: with rotation)."""
        return self.rotate in ("keys", "kv") if self.center_keys is None else self.center_keys

    def effective_group_size(self, head_dim: int) -> int:
        return self.group_size if self.group_size is not None else min(32, head_dim)

    def resolve(self, shape: ModelShape | Any) -> list[list[KVPrecision]]:
        """Validate against the model and return ``plan[layer][kv_head] -> KVPrecision``."""
        shape = ModelShape.of(shape)
        self.validate(shape)
        plan = [[self.default] * shape.num_kv_heads for _ in range(shape.num_layers)]
        for layer, p in self.layers.items():
            plan[layer] = [p.over(x) for x in plan[layer]]
        for (layer, head), p in self.heads.items():
            plan[layer][head] = p.over(plan[layer][head])
        return plan

    def validate(self, shape: ModelShape | Any) -> None:
        """Raise :class:`ConfigError` (naming the field) if this config cannot serve the model."""
        self._check_plan()  # fields changed after construction: their combinations are checked here
        self._check_options()
        shape = ModelShape.of(shape)
        if self.model_shape:
            for key, actual in shape.as_dict().items():
                want = self.model_shape.get(key)
                if want is not None and want != actual:
                    raise ConfigError(
                        f"model_shape.{key}: the config was made for {want}, the model has {actual} "
                        "(a config for another model?)"
                    )
        for layer in self.layers:
            if layer >= shape.num_layers:
                raise ConfigError(f"layers.{layer}: layer {layer} out of range (model has {shape.num_layers})")
        for layer in self.evict.layers if self.evict is not None else ():
            if layer >= shape.num_layers:
                raise ConfigError(f"evict.layers.{layer}: layer {layer} out of range (model has {shape.num_layers})")
        for layer, head in self.heads:
            where = f'heads."{layer}.{head}"'
            if layer >= shape.num_layers:
                raise ConfigError(f"{where}: layer {layer} out of range (model has {shape.num_layers} layers)")
            if head >= shape.num_kv_heads:
                raise ConfigError(
                    f"{where}: KV head {head} out of range (model has {shape.num_kv_heads} KV heads)"
                )
        gs = self.effective_group_size(shape.head_dim)
        if self.uses_grouped() and shape.head_dim % gs:
            raise ConfigError(f"group_size: {gs} does not divide head_dim {shape.head_dim}")
        for p in self.precisions() & (set(GROUPED) | set(CHANNEL)):
            bits = GROUPED.get(p) or CHANNEL[p]
            codes_per_unit = 8 if bits == 3 else 8 // bits
            if shape.head_dim % codes_per_unit:
                raise ConfigError(f"default: {p} packs {codes_per_unit} codes together; head_dim {shape.head_dim} "
                                  f"is not a multiple of {codes_per_unit}")
        for p in sorted(self.precisions() & set(CODEBOOK)):
            if shape.head_dim & (shape.head_dim - 1) or shape.head_dim < 8:
                raise ConfigError(f"default: {p} rotates by Hadamard and needs a power-of-two head_dim >= 8, "
                                  f"not {shape.head_dim}")
        for p in sorted(p for p in self.precisions() if p.startswith(CHANNEL_PREFIX)):
            try:
                make_quantizer(p, shape.head_dim)
            except ValueError as e:
                raise ConfigError(f"default: {p[:12]}...: {e}") from None
        if self.rotate != "none" and shape.head_dim & (shape.head_dim - 1):
            raise ConfigError(f"rotate: the Hadamard rotation needs a power-of-two head_dim, not {shape.head_dim}")

    def check_model(self, shape: ModelShape | Any) -> None:
        """Everything a cache of this config would refuse for the model, before any work: :meth:`validate` and
        the ``scales_file`` read and checked against the model's shape (:class:`ConfigError` /
        :class:`kvquant.scales.ScalesError`, naming the field and the file)."""
        self.validate(shape)
        if self.scales_file:
            from .scales import load_scales

            load_scales(self.scales_file, ModelShape.of(shape), model_dtype(shape))

    def precisions(self) -> set[str]:
        out = {self.default.key, self.default.value}
        for p in [*self.layers.values(), *self.heads.values()]:
            out |= {p.key, p.value}
        return out - {None}

    def uses_grouped(self) -> bool:
        return bool(self.precisions() & set(GROUPED))

    def bits(self, precision: str, head_dim: int) -> float:
        """Stored bits per element of one precision, scale/zero overhead included."""
        return make_quantizer(
            precision, head_dim, self.effective_group_size(head_dim), block_size=self.block_size
        ).bits_per_element()

    def avg_bits(self, shape: ModelShape | Any) -> float:
        """Average stored bits per K/V element over the whole model, scale and zero overhead included.

        Full-precision sink and residual tokens (``sink_tokens``, ``residual_tokens``) are a fixed
        number of tokens, not a per-token cost, and are not in this figure; ``memory_report()``
        counts them in the bytes a cache actually holds.
        """
        shape = ModelShape.of(shape)
        plan = self.resolve(shape)
        total = sum(
            self.bits(p.key, shape.head_dim) + self.bits(p.value, shape.head_dim) for row in plan for p in row
        )
        return total / (2 * shape.num_layers * shape.num_kv_heads)

    def with_updates(self, **changes: Any) -> KVQuantConfig:
        if isinstance(changes.get("evict"), Mapping):
            changes["evict"] = _parse_evict(changes["evict"], "evict")
        cfg = replace(self, **{"layers": dict(self.layers), "heads": dict(self.heads), **changes})
        cfg._check_options()
        return cfg

    def __str__(self) -> str:
        return self.name or self.to_yaml()


# ---------------------------------------------------------------------- field checks
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
_FIELD_CHECKS: dict[str, Any] = {
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
