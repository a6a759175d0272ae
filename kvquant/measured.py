"""What each preset measured on SmolLM2-135M and its outlier stress variants (issue 10).

The run is ``kvquant eval recipes/stress-outliers.yaml`` (:data:`STRESS_RUN` says its size and protocol);
each entry of :data:`STRESS` is a preset's worst model there, copied from the run's ``results.json``
files in ``docs/results/`` (``tests/test_measured.py`` checks that they agree). ``kvquant presets``,
the README and the outlier warning quote them; a preset whose worst model loses more than
:data:`LIMIT_PCT` perplexity is marked as failing on outlier models.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: The run the numbers come from (size stated: windows x tokens, scored tokens, protocol).
STRESS_RUN = (
    "recipes/stress-outliers.yaml: SmolLM2-135M and its +koutlier, +kbias, +wide256 stress variants, "
    "WikiText-2, exact one-token decode; default and int4-kchannel-*sinks presets and int8: 2 windows x 448 "
    "tokens (400 prefilled, 94 targets scored per model); the other presets: a sweep of 2 windows x 208 tokens "
    "(192 prefilled, 30 targets)"
)
#: Where the run's reports are (the summary of each part of the run, one folder per model inside).
STRESS_RESULTS = ("docs/results/stress-outliers", "docs/results/stress-outliers-b")
#: A preset holds when every model of the run stays within this perplexity increase (%) ...
LIMIT_PCT = 1.0
#: ... and no stress model's KL exceeds this multiple of the real model's (and :data:`KL_FLOOR`): a preset that
#: loses accuracy only on outlier models shows it in KL first (the perplexity of a short run is noisy).
KL_RATIO = 2.0
KL_FLOOR = 1e-3


@dataclass(frozen=True)
class StressResult:
    """A preset's worst model in the stress run: Δppl in % of that model's reference perplexity (with its
    standard error over windows), the largest mean KL(reference || preset) over the models, and the KL on
    the real model (no stress variant)."""

    worst_delta_ppl_pct: float
    worst_delta_ppl_se: float
    worst_model: str
    max_kl: float
    max_kl_model: str
    base_kl: float

    @property
    def kl_grows(self) -> bool:
        """Some stress model's KL is over :data:`KL_RATIO` x the real model's (and over :data:`KL_FLOOR`)."""
        return self.max_kl > max(KL_RATIO * self.base_kl, KL_FLOOR)

    @property
    def holds(self) -> bool:
        """Within :data:`LIMIT_PCT` perplexity on every model of the run, and no KL blow-up on a stress model."""
        return self.worst_delta_ppl_pct <= LIMIT_PCT and not self.kl_grows

    def verdict(self) -> str:
        """``holds``, or why the preset fails on outlier models."""
        if self.holds:
            return "holds"
        why = [f"{self.worst_delta_ppl_pct:+.1f}% ppl"] if self.worst_delta_ppl_pct > LIMIT_PCT else []
        if self.kl_grows:
            why.append(f"KL {self.max_kl / max(self.base_kl, 1e-30):.0f}x the real model's")
        return f"FAILS on outlier models ({', '.join(why)})"

    def line(self) -> str:
        """One line for ``kvquant presets`` and the outlier warning."""
        return (
            f"stress suite: worst {self.worst_delta_ppl_pct:+.2f}% ppl (± {self.worst_delta_ppl_se:.2f}, "
            f"{self.worst_model}), KL up to {self.max_kl:.1e} ({self.max_kl_model}; {self.base_kl:.1e} on the "
            f"real model): {self.verdict()}"
        )


def worst_by_config(rows: Iterable[Mapping[str, Any]]) -> dict[str, StressResult]:
    """Each config's worst model over the summary rows of a multi-model eval (``results.json`` ``rows``
    with ``model``, ``config``, ``delta_ppl_pct``, ``delta_ppl_pct_se``, ``kl_mean``; other rows skipped).
    The real model is the one named without a ``+VARIANT``."""
    by: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("kind") != "reference":
            by.setdefault(r["config"], []).append(r)
    out = {}
    for config, rs in by.items():
        ppl = max(rs, key=lambda r: r["delta_ppl_pct"])
        kl = max(rs, key=lambda r: r["kl_mean"])
        base = next(r for r in rs if "+" not in r["model"])
        out[config] = StressResult(
            round(ppl["delta_ppl_pct"], 2),
            round(ppl["delta_ppl_pct_se"] or 0.0, 2),
            ppl["model"],
            _sig(kl["kl_mean"]),
            kl["model"],
            _sig(base["kl_mean"]),
        )
    return out


def _sig(x: float) -> float:
    return float(f"{x:.2g}")


#: preset -> its worst model in the stress run (filled from the run's results.json; see the module doc).
STRESS: dict[str, StressResult] = {
    "fp16": StressResult(0.03, 0.15, "smollm2-135m+kbias", 4.6e-06, "smollm2-135m+kbias", 2.8e-07),
    "bf16": StressResult(0.05, 0.0, "smollm2-135m+koutlier", 0.0003, "smollm2-135m+kbias", 1.4e-05),
    "fp32": StressResult(0.0, 0.0, "smollm2-135m+wide256", 5.9e-12, "smollm2-135m+kbias", 3.3e-12),
    "int8": StressResult(23.1, 8.18, "smollm2-135m+koutlier", 0.23, "smollm2-135m+koutlier", 0.015),
    "int8-separate": StressResult(4.68, 15.21, "smollm2-135m+koutlier", 0.05, "smollm2-135m+koutlier", 0.0074),
    "int8-token": StressResult(-0.91, 2.12, "smollm2-135m+kbias", 0.031, "smollm2-135m+koutlier", 0.00048),
    "int4": StressResult(173.21, 722.14, "smollm2-135m+kbias", 1.3, "smollm2-135m+kbias", 0.047),
    "int2": StressResult(70519.97, 243312.29, "smollm2-135m+kbias", 6.8, "smollm2-135m+koutlier", 1.4),
    "fp8-e4m3": StressResult(11.86, 50.7, "smollm2-135m+kbias", 0.091, "smollm2-135m+kbias", 0.0046),
    "fp8-e5m2": StressResult(25.97, 60.57, "smollm2-135m+kbias", 0.45, "smollm2-135m+kbias", 0.019),
    "int8-kchannel": StressResult(-0.01, 0.07, "smollm2-135m+wide256", 5.5e-05, "smollm2-135m+kbias", 4.5e-05),
    "int4-kchannel": StressResult(-1.33, 3.8, "smollm2-135m", 0.0066, "smollm2-135m+koutlier", 0.0062),
    "int4-kchannel-sinks": StressResult(-0.08, 1.53, "smollm2-135m", 0.0063, "smollm2-135m+kbias", 0.0062),
    "int4-kchannel-g16-sinks": StressResult(-0.09, 0.19, "smollm2-135m+kbias", 0.0052, "smollm2-135m+kbias", 0.0044),
    "mixed-int4-int8": StressResult(-0.51, 3.39, "smollm2-135m+wide256", 0.035, "smollm2-135m+koutlier", 0.0088),
}

#: Presets that are another preset under a second name (measured once, under the first name).
ALIASES = {"int8-shared": "int8"}


def stress_result(preset: str) -> StressResult | None:
    """The stress run's worst model for ``preset`` (aliases resolved), or None when it was not measured."""
    return STRESS.get(ALIASES.get(preset, preset))


#: The presets the README recommends, by width: each holds on every model of the stress run.
RECOMMENDED = {"8-bit (the wrap() default)": "int8-kchannel", "~4.6-bit": "int4-kchannel-sinks"}
