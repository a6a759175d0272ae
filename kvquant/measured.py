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
    "WikiText-2, 2 windows x 448 tokens (400 prefilled, 47 scored per window by exact one-token decode)"
)
#: Where the run's reports are (the summary of each part of the run, one folder per model inside).
STRESS_RESULTS = ("docs/results/stress-outliers", "docs/results/stress-outliers-b")
#: A recommended preset stays within this perplexity increase (%) on every model of the run.
LIMIT_PCT = 1.0


@dataclass(frozen=True)
class StressResult:
    """A preset's worst model in the stress run: Δppl in % of that model's reference perplexity (with its
    standard error over windows), and the largest mean KL(reference || preset) over the models."""

    worst_delta_ppl_pct: float
    worst_delta_ppl_se: float
    worst_model: str
    max_kl: float
    max_kl_model: str

    @property
    def holds(self) -> bool:
        """Within :data:`LIMIT_PCT` perplexity on every model of the run."""
        return self.worst_delta_ppl_pct <= LIMIT_PCT

    def line(self) -> str:
        """One line for ``kvquant presets`` and the outlier warning."""
        verdict = "holds" if self.holds else "FAILS on outlier models"
        return (
            f"stress suite: worst {self.worst_delta_ppl_pct:+.2f}% ppl (± {self.worst_delta_ppl_se:.2f}, "
            f"{self.worst_model}), KL up to {self.max_kl:.1e} ({self.max_kl_model}): {verdict}"
        )


def worst_by_config(rows: Iterable[Mapping[str, Any]]) -> dict[str, StressResult]:
    """Each config's worst model over the summary rows of a multi-model eval (``results.json`` ``rows``
    with ``model``, ``config``, ``delta_ppl_pct``, ``delta_ppl_pct_se``, ``kl_mean``; other rows skipped)."""
    by: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("kind") != "reference":
            by.setdefault(r["config"], []).append(r)
    out = {}
    for config, rs in by.items():
        ppl = max(rs, key=lambda r: r["delta_ppl_pct"])
        kl = max(rs, key=lambda r: r["kl_mean"])
        out[config] = StressResult(round(ppl["delta_ppl_pct"], 2), round(ppl["delta_ppl_pct_se"] or 0.0, 2),
                                   ppl["model"], float(f"{kl['kl_mean']:.2g}"), kl["model"])
    return out


#: preset -> its worst model in the stress run (filled from the run's results.json; see the module doc).
STRESS: dict[str, StressResult] = {}

#: The presets the README recommends, by width: each holds on every model of the stress run.
RECOMMENDED = {"8-bit (the wrap() default)": "int8-kchannel", "~4.6-bit": "int4-kchannel-sinks"}
