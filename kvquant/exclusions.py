"""Which options exclude which: every rule in one table, checked for a whole config and for each layer.

A rule names the option it refuses or drops (the config field), when it applies, what happens, and why.

* ``scope="config"`` rules read the whole config (:class:`ConfigFacts`); they are checked when a config is
  loaded or built and always raise :class:`~kvquant.errors.ConfigError` (``action="error"``).
* ``scope="layer"`` rules read one layer as the model gives it (:class:`LayerFacts`: its precisions, whether it
  is a sliding-window layer, the model's logit softcap). ``action="drop"``: the layer does not get that option,
  and the plan (:mod:`kvquant.plan`) reports it once per cache; ``action="error"``: the config cannot serve
  the model.

The table is data: :data:`RULES`. Adding an option that excludes another means adding a row here, with a test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from .errors import ConfigError


@dataclass(frozen=True)
class ConfigFacts:
    """What the config-wide rules read: the options set and what the config's precisions need."""

    ladder_tokens: int
    ladder2_tokens: int
    heavy_tokens: int
    offload: bool
    evict: bool
    #: some layer evicts with per-head budgets (``evict.budget: adakv``)
    adakv: bool
    #: the eviction policy replaces single tokens at decode time (h2o / tova)
    decode_time_evict: bool
    residual_step: int | None
    block_size: int
    #: the per-channel precisions (keys quantized a whole block at a time) the config names, sorted
    per_channel: tuple[str, ...]


@dataclass(frozen=True)
class LayerFacts:
    """What the per-layer rules read: the layer's options and precisions, and what the model does there."""

    ladder_tokens: int
    ladder2_tokens: int
    heavy_tokens: int
    evict: bool
    residual_step: int | None
    block_size: int
    center_keys: bool
    sliding: bool
    #: some K or V of the layer is a codebook precision (``tq*``, ``tqv*``, ``tqt*``, ``tqc-*``)
    codebook: bool
    #: some K of the layer is a codebook precision (its head space removes a per-channel key mean)
    codebook_keys: bool
    #: some K or V of the layer is per-channel (``int*-channel``: one scale per block of tokens)
    per_channel: bool
    #: the model caps its attention logits (Gemma 2's ``attn_logit_softcapping``)
    softcap: bool


Facts = ConfigFacts | LayerFacts


@dataclass(frozen=True)
class Exclusion:
    """One rule: ``feature`` is refused (``error``) or not given to a layer (``drop``) when ``applies``."""

    feature: str
    scope: Literal["config", "layer"]
    action: Literal["error", "drop"]
    applies: Callable[[Facts], bool]
    why: str

    def message(self, facts: Facts) -> str:
        """The one-line error or report, naming the field first."""
        return f"{self.feature}: {self.why.format(f=facts)}"


RULES: tuple[Exclusion, ...] = (
    # ---- whole config: combinations no layer can serve
    Exclusion("ladder_tokens", "config", "error", lambda f: bool(f.ladder_tokens and f.offload),
              "not supported together with offload (use one of them)"),
    Exclusion("heavy_tokens", "config", "error", lambda f: bool(f.heavy_tokens and f.offload),
              "not supported together with offload (use one of them)"),
    Exclusion("ladder_tokens", "config", "error", lambda f: bool(f.ladder_tokens and f.evict),
              "not supported together with evict (kept tokens are not a suffix)"),
    Exclusion("heavy_tokens", "config", "error", lambda f: bool(f.heavy_tokens and f.evict),
              "not supported together with evict (kept tokens are not the prompt's rows)"),
    Exclusion("offload", "config", "error", lambda f: f.offload and f.evict,
              "not supported together with evict yet (use one of them)"),
    Exclusion("residual_step", "config", "error",
              lambda f: f.adakv and f.residual_step not in (None, f.block_size),
              "{f.residual_step} with evict.budget adakv (per-head lanes move whole blocks of a head from its tail); "
              "use the default (block_size {f.block_size})"),
    Exclusion("evict.policy", "config", "error", lambda f: f.decode_time_evict and bool(f.per_channel),
              "h2o / tova replace single tokens in place, which {f.per_channel[0]} (keys quantized a whole block "
              "at a time) cannot do; use a per-token key precision (int8-token, int4, ...)"),
    # ---- one layer: what its precisions, its attention and the model allow
    Exclusion("residual_step", "layer", "error",
              lambda f: f.per_channel and f.residual_step not in (None, f.block_size),
              "{f.residual_step} must be block_size ({f.block_size}) with a per-block precision (int*-channel: one "
              "scale per block of tokens)"),
    Exclusion("center_keys", "layer", "error", lambda f: f.center_keys and f.softcap,
              "key centering is exact only without attention logit softcapping; set center_keys: false for "
              "this model"),
    Exclusion("softcap", "layer", "error", lambda f: f.codebook_keys and f.softcap,
              "codebook (tq*) keys remove a per-channel key mean, which is not exact under attention logit "
              "softcapping; use int*/fp8 keys on this model"),
    Exclusion("evict", "layer", "drop", lambda f: f.evict and f.sliding,
              "a sliding-window layer keeps its window instead"),
    Exclusion("ladder_tokens", "layer", "drop", lambda f: bool(f.ladder_tokens and f.sliding),
              "a sliding-window layer drops old rows, the ladder refines the newest of a growing history"),
    Exclusion("ladder_tokens", "layer", "drop", lambda f: bool(f.ladder_tokens and not f.codebook),
              "no K or V of the layer is a codebook precision: nothing to refine"),
    Exclusion("ladder2_tokens", "layer", "drop",
              lambda f: bool(f.ladder2_tokens and (f.sliding or not f.codebook)),
              "the second rung refines the ladder's rows, which this layer does not keep"),
    Exclusion("heavy_tokens", "layer", "drop", lambda f: bool(f.heavy_tokens and f.sliding),
              "a sliding-window layer drops the prompt rows heavy rows would keep"),
    Exclusion("heavy_tokens", "layer", "drop", lambda f: bool(f.heavy_tokens and not f.codebook),
              "no K or V of the layer is a codebook precision: nothing to refine"),
)


def violations(facts: Facts, scope: Literal["config", "layer"]) -> list[Exclusion]:
    """The rules of ``scope`` that apply to ``facts``, in table order."""
    return [r for r in RULES if r.scope == scope and r.applies(facts)]


def check(facts: Facts, scope: Literal["config", "layer"]) -> list[Exclusion]:
    """Raise :class:`ConfigError` for the first ``error`` rule that applies; return the ``drop`` rules that do."""
    hits = violations(facts, scope)
    for rule in hits:
        if rule.action == "error":
            raise ConfigError(rule.message(facts))
    return [r for r in hits if r.action == "drop"]


def dropped(rules: Iterable[Exclusion]) -> frozenset[str]:
    """The features the given drop rules take away."""
    return frozenset(r.feature for r in rules)
