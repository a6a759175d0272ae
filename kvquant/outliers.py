"""Outlier and offset key channels: detect them in a prefill, and warn when the config cannot hold them.

Per-token and per-head key scales (``int8``, ``int8-token``, ``int4``, ``fp8-*``, ...) spend their
range on a few large channels or on a per-channel offset (q/k/v bias), and lose everything else;
per-channel keys (``int*-channel``) do not. On a model whose keys show such channels, a cache whose
keys are quantized per token or per head logs one warning naming a per-channel preset.

Statistics, per (layer, KV head), over the first chunk written (the prefill; its first token, often
an attention sink, left out), with ``mean_c``, ``std_c``, ``rms_c`` of key channel ``c`` over tokens:

* offset ratio  ``max_c |mean_c| / median_c std_c``  (a bias-like per-channel offset)
* outlier ratio ``max_c rms_c / median_c rms_c``       (a few channels of large magnitude)

Thresholds sit between the ratios of SmolLM2-135M and those of its outlier stress variants (docs/measurements.md,
``python benchmarks/outlier_warning.py``). The warning quotes the preset's line of the stress run
(:mod:`kvquant.measured`).
"""

from __future__ import annotations

import logging

import torch

from .config import KVPrecision, KVQuantConfig
from .measured import RECOMMENDED, STRESS
from .quantizers import CHANNEL, CHANNEL_PREFIX, FLOAT_DTYPES

logger = logging.getLogger("kvquant")

OFFSET_RATIO = 24.0
OUTLIER_RATIO = 24.0
MIN_TOKENS = 16  # fewer prefill tokens give no usable channel statistics

def key_channel_ratios(keys: torch.Tensor) -> tuple[float, float]:
    """``(offset ratio, outlier ratio)``, the largest over batch rows and heads, of ``keys[B, H, T, D]``."""
    k = keys[:, :, 1:].detach().float() if keys.shape[2] > 1 else keys.detach().float()
    mean, std = k.mean(dim=2), k.std(dim=2)
    rms = k.pow(2).mean(dim=2).sqrt()
    tiny = torch.finfo(torch.float32).tiny
    offset = mean.abs().amax(dim=-1) / std.median(dim=-1).values.clamp_min(tiny)
    outlier = rms.amax(dim=-1) / rms.median(dim=-1).values.clamp_min(tiny)
    return float(offset.max()), float(outlier.max())


def key_is_per_channel(precision: str | None) -> bool:
    """True for key precisions that hold outlier / offset channels: per channel (``int*-channel``; ``tqc-<widths>``,
    which centres each channel and gives it its own width), or not quantized."""
    return (precision is None or precision in CHANNEL or precision in FLOAT_DTYPES
            or precision.startswith(CHANNEL_PREFIX))


def safer_preset(plan: list[list[KVPrecision]]) -> str:
    """The per-channel preset of about the same key width as ``plan``'s quantized keys."""
    wide = any(p.key in ("int8", "int8-token", "fp8-e4m3", "fp8-e5m2") for row in plan for p in row)
    return RECOMMENDED["8-bit (the wrap() default)"] if wide else RECOMMENDED["~4.6-bit"]


def short_list(names: list[str], most: int = 3, width: int = 24) -> str:
    """``names`` for a one-line message: at most ``most`` of them, each cut to ``width`` characters, then a count."""
    shown = [n if len(n) <= width else n[: width - 3] + "..." for n in names[:most]]
    rest = len(names) - len(shown)
    return ", ".join(shown) + (f" and {rest} more" if rest else "")


class OutlierWatch:
    """One per cache: checks each layer's first chunk of keys and logs at most one warning."""

    def __init__(self, config: KVQuantConfig, plan: list[list[KVPrecision]]) -> None:
        self.config_name = config.name or "this config"
        self.risky = sorted({p.key for row in plan for p in row if not key_is_per_channel(p.key)})
        self.active = bool(self.risky)
        self.safer = safer_preset(plan) if self.active else None
        self.finding: str | None = None  # the warning's text, once logged

    def observe(self, layer_idx: int, keys: torch.Tensor) -> None:
        """Look at the first keys written to layer ``layer_idx`` (model space, before any transform)."""
        if not self.active or self.finding is not None or keys.shape[2] < MIN_TOKENS:
            return
        offset, outlier = key_channel_ratios(keys)
        if offset <= OFFSET_RATIO and outlier <= OUTLIER_RATIO:
            return
        kind = "offset" if offset / OFFSET_RATIO >= outlier / OUTLIER_RATIO else "outlier"
        name = self.config_name if self.config_name in STRESS else next((p for p in self.risky if p in STRESS), None)
        note = f"{name!r} on the {STRESS[name].line()}" if name else ""
        self.finding = (
            f"kvquant: layer {layer_idx}'s keys show {kind} channels (offset ratio {offset:.0f}, outlier ratio "
            f"{outlier:.0f}; thresholds {OFFSET_RATIO:.0f} / {OUTLIER_RATIO:.0f}) and {self.config_name!r} "
            f"quantizes keys per token or per head ({short_list(self.risky)}), which loses accuracy on such "
            f"models{': ' + note if note else ''}. Use a per-channel key preset such as {self.safer!r}."
        )
        logger.warning(self.finding)
        self.active = False
