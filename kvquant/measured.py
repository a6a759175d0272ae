"""What each preset measured on SmolLM2-135M and its outlier stress variants (issue 10).

The run is ``kvquant eval recipes/stress-outliers.yaml`` (:data:`STRESS_RUN` says its size and protocol);
each entry of :data:`STRESS` is a preset's worst model there, read from the data file
``kvquant/data/stress_presets.json`` that :func:`worst_by_config` fills from the run's ``results.json`` files in
``docs/results/`` (``tests/test_measured.py`` checks that they agree). ``kvquant presets``,
the README and the outlier warning quote them; a preset whose worst model loses more than
:data:`LIMIT_PCT` perplexity is marked as failing on outlier models.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

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


def _recorded() -> tuple[str, tuple[str, ...], dict[str, StressResult]]:
    data = json.loads(files("kvquant").joinpath("data/stress_presets.json").read_text())
    return data["run"], tuple(data["results"]), {k: StressResult(**v) for k, v in data["presets"].items()}


#: The run the numbers come from (size stated: windows x tokens, scored tokens, protocol), where its reports are
#: (the summary of each part of the run, one folder per model inside), and each preset's worst model there: all
#: read from ``kvquant/data/stress_presets.json``, which is filled from the run's ``results.json`` files.
STRESS_RUN, STRESS_RESULTS, STRESS = _recorded()

#: Presets that are another preset under a second name (measured once, under the first name).
ALIASES = {"int8-shared": "int8"}


def stress_result(preset: str) -> StressResult | None:
    """The stress run's worst model for ``preset`` (aliases resolved), or None when it was not measured."""
    return STRESS.get(ALIASES.get(preset, preset))


#: The presets the README recommends, by width: each holds on every model of the stress run.
RECOMMENDED = {"8-bit (the wrap() default)": "int8-kchannel", "~4.6-bit": "int4-kchannel-sinks"}
