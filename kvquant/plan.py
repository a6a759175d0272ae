"""The plan: what each layer of a cache really gets, resolved once from the config and the model.

``resolve(config, model)`` reads the config's precision map and options, the model's shape, its sliding-window
layers and its attention logit softcap, applies every exclusion rule (:data:`kvquant.exclusions.RULES`), and
returns a :class:`Plan` with one :class:`LayerPlan` per layer: the layer's per-KV-head precisions and the
options it is given. A store is built from its :class:`LayerPlan` and reads no option from the config.

An option the config asks for that a layer cannot take is either an error (the config cannot serve the model)
or dropped for that layer; :meth:`Plan.report` says which, once per cache, as one warning per option.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .config import KVPrecision, KVQuantConfig, is_codebook
from .evict import EvictConfig
from .exclusions import Exclusion, LayerFacts, check
from .quantizers import CHANNEL
from .shape import ModelShape, sliding_windows


@dataclass(frozen=True)
class LayerPlan:
    """One layer as it will be stored: ``row[h]`` is KV head ``h``'s precision, and the options it gets
    (0 / ``False`` / ``None``: not on this layer, whatever the config says; :attr:`dropped` names why)."""

    index: int
    row: tuple[KVPrecision, ...]
    #: the sliding window (``None``: a full-attention layer)
    window: int | None
    #: the layer evicts (the config's ``evict``, not on sliding-window layers)
    evict: bool
    #: the evicting layer keeps a different set per KV head (``evict.budget: adakv``): per-head block lanes
    lanes: bool
    offload: bool
    sink_tokens: int
    residual_tokens: int
    #: tokens quantized at a time past the residual window (``residual_step``, default ``block_size``)
    residual_step: int
    ladder_tokens: int
    ladder2_tokens: int
    heavy_tokens: int
    rotate_keys: bool
    rotate_values: bool
    center_keys: bool
    #: the options the config sets that this layer does not get, with the rule that took each
    dropped: tuple[Exclusion, ...] = ()


@dataclass(frozen=True)
class Plan:
    """Every layer's :class:`LayerPlan`, in layer order."""

    layers: tuple[LayerPlan, ...]

    @property
    def rows(self) -> list[list[KVPrecision]]:
        """``rows[layer][kv_head] -> KVPrecision`` (what :meth:`KVQuantConfig.resolve` returns)."""
        return [list(lp.row) for lp in self.layers]

    def drops(self) -> dict[str, tuple[str, list[int]]]:
        """``option -> (why, layers)`` for every option some layer does not get (first rule's reason)."""
        out: dict[str, tuple[str, list[int]]] = {}
        for lp in self.layers:
            for rule in lp.dropped:
                why, layers = out.setdefault(rule.feature, (rule.why, []))
                if lp.index not in layers:
                    layers.append(lp.index)
        return out

    def report(self) -> None:
        """One warning per dropped option, naming the layers and the reason."""
        for feature, (why, layers) in self.drops().items():
            shown = ", ".join(map(str, layers[:12])) + (", ..." if len(layers) > 12 else "")
            warnings.warn(f"{feature}: not on layer{'s' if len(layers) > 1 else ''} {shown}: {why}",
                          UserWarning, stacklevel=3)


def layer_plan(
    config: KVQuantConfig,
    row: Sequence[KVPrecision],
    index: int = 0,
    window: int | None = None,
    softcap: bool = False,
) -> LayerPlan:
    """The plan of one layer storing ``row`` under ``config`` (errors raise :class:`~kvquant.errors.ConfigError`)."""
    keys = {p.key for p in row}
    names = keys | {p.value for p in row}
    ev: EvictConfig | None = config.evict
    spec = None if ev is None else ev.layers.get(index, ev)
    facts = LayerFacts(
        ladder_tokens=config.ladder_tokens, ladder2_tokens=config.ladder2_tokens, heavy_tokens=config.heavy_tokens,
        evict=spec is not None, residual_step=config.residual_step, block_size=config.block_size,
        center_keys=config.centers_keys, sliding=window is not None, codebook=any(map(is_codebook, names)),
        codebook_keys=any(map(is_codebook, keys)), per_channel=bool(names & set(CHANNEL)), softcap=softcap,
    )
    drops = check(facts, "layer")
    gone = {r.feature for r in drops}
    evict = spec is not None and "evict" not in gone
    ladder = 0 if "ladder_tokens" in gone else config.ladder_tokens
    return LayerPlan(
        index=index, row=tuple(row), window=window, evict=evict,
        lanes=evict and spec is not None and spec.budget == "adakv", offload=config.offload is not None,
        sink_tokens=config.sink_tokens, residual_tokens=config.residual_tokens,
        residual_step=config.residual_step or config.block_size, ladder_tokens=ladder,
        ladder2_tokens=config.ladder2_tokens if ladder and "ladder2_tokens" not in gone else 0,
        heavy_tokens=0 if "heavy_tokens" in gone else config.heavy_tokens,
        rotate_keys=config.rotate in ("keys", "kv"), rotate_values=config.rotate == "kv",
        center_keys=config.centers_keys, dropped=tuple(drops),
    )  # fmt: skip


def logit_softcap(model: Any) -> float | None:
    """A transformers model's (or config's) attention logit softcap (``attn_logit_softcapping``), or None."""
    if isinstance(model, ModelShape):
        return None
    config = model.config if hasattr(model, "config") else model
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    value = getattr(config, "attn_logit_softcapping", None)
    return float(value) if value else None


def resolve(config: KVQuantConfig, model: Any) -> Plan:
    """Validate ``config`` against ``model`` (a transformers model or config, or a :class:`ModelShape`) and
    return its :class:`Plan`; a config the model cannot take raises :class:`~kvquant.errors.ConfigError`."""
    shape = ModelShape.of(model)
    rows = config.resolve(shape)
    windows = sliding_windows(model, shape.num_layers)
    softcap = logit_softcap(model) is not None
    return Plan(tuple(layer_plan(config, row, i, windows[i], softcap) for i, row in enumerate(rows)))
