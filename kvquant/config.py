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
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from .config_schema import (
    CONFIG_SUFFIXES,
    FIELD_CHECKS,
    MAX_CAPACITY,
    MAX_MODEL_DIM,
    OPTION_FIELDS,
    STATIC_SCALE,
    TOP_LEVEL,
    KVPrecision,
    check_int,
    check_offload,
    is_codebook,
    parse_evict,
    parse_index,
    parse_pair,
    parse_text,
    refuse_float_key,
)
from .errors import ConfigError, InputError
from .evict import EvictConfig
from .exclusions import ConfigFacts
from .exclusions import check as check_exclusions
from .inputs import read_text
from .outputs import check_output, write_text
from .presets import DEFAULT_PRESET, PRESETS
from .quantizers import (
    CHANNEL,
    CHANNEL_PREFIX,
    CODEBOOK,
    GROUPED,
    PRECISIONS,
    VECTOR,
    is_precision,
    make_quantizer,
)
from .shape import ModelShape, model_dtype

__all__ = ["ConfigError", "KVPrecision", "KVQuantConfig", "PRESETS", "DEFAULT_PRESET", "check_int", "is_codebook",
           "MAX_CAPACITY", "CONFIG_SUFFIXES"]


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
        data = parse_text(text, p)
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
        unknown = sorted(set(map(str, data)) - TOP_LEVEL)
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown field (known: {', '.join(sorted(TOP_LEVEL))})")
        cfg = cls()
        if "default" in data:
            cfg.default = parse_pair(data["default"], "default")
        layers = data.get("layers") or {}
        if not isinstance(layers, Mapping):
            raise ConfigError(f"layers: expected a mapping like {{0: int8, 5: {{key: int8}}}}, got {layers!r}")
        for k, v in layers.items():
            refuse_float_key(k, f"layers.{k}")
            layer = parse_index(k, f"layers.{k}")
            cfg.layers[layer] = parse_pair(v, f"layers.{k}", partial=True)
        heads = data.get("heads") or {}
        if not isinstance(heads, Mapping):
            raise ConfigError("heads: expected a mapping like {\"3.1\": int8}")
        for k, v in heads.items():
            if isinstance(v, Mapping) and not (set(map(str, v)) & {"key", "value", "bits", "precision"}):
                # nested form {layer: {head: spec}}
                layer = parse_index(k, f"heads.{k}")
                if not v:
                    raise ConfigError(f"heads.{k}: empty; expected {{head: precision}}")
                for hk, hv in v.items():
                    refuse_float_key(hk, f"heads.{k}.{hk}")
                    head = parse_index(hk, f"heads.{k}.{hk}")
                    cfg.heads[(layer, head)] = parse_pair(hv, f"heads.{k}.{hk}", partial=True)
                continue
            refuse_float_key(k, f"heads.{k}")
            parts = str(k).split(".")
            if len(parts) != 2:
                raise ConfigError(f'heads."{k}": expected "layer.head", e.g. "3.1"')
            layer = parse_index(parts[0], f'heads."{k}"')
            head = parse_index(parts[1], f'heads."{k}"')
            cfg.heads[(layer, head)] = parse_pair(v, f'heads."{k}"', partial=True)
        for name in OPTION_FIELDS:
            if name in data:
                setattr(cfg, name, data[name])
        for name in ("name", "description"):
            if data.get(name) is not None and not isinstance(data[name], str):
                raise ConfigError(f"{name}: {data[name]!r} must be a string")
        cfg.name = data.get("name")
        cfg.description = data.get("description")
        cfg.model_shape = data.get("model_shape")
        if data.get("evict") is not None:
            cfg.evict = parse_evict(data["evict"], "evict")
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
        if name in FIELD_CHECKS and self.__dict__.get("_built"):
            FIELD_CHECKS[name](value)
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
        for name, check in FIELD_CHECKS.items():
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
        self.offload = check_offload(self.offload)
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
            if f.name in OPTION_FIELDS and getattr(self, f.name) != getattr(defaults, f.name):
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
            changes["evict"] = parse_evict(changes["evict"], "evict")
        cfg = replace(self, **{"layers": dict(self.layers), "heads": dict(self.heads), **changes})
        cfg._check_options()
        return cfg

    def __str__(self) -> str:
        return self.name or self.to_yaml()


# ---------------------------------------------------------------------- field checks
