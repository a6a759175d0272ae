"""Issue 10: the measured preset table (kvquant.measured) agrees with the recorded stress run, every
preset ran on every model, and the default / recommended presets meet the acceptance lines there."""

from __future__ import annotations

import json
from pathlib import Path

from kvquant import DEFAULT_PRESET, PRESETS
from kvquant.eval.recipe import load_recipe
from kvquant.measured import ALIASES, LIMIT_PCT, RECOMMENDED, STRESS, STRESS_RESULTS, worst_by_config

ROOT = Path(__file__).resolve().parent.parent


def _rows() -> list[dict]:
    rows = []
    for folder in STRESS_RESULTS:
        rows += json.loads((ROOT / folder / "results.json").read_text())["rows"]
    return rows


def test_table_matches_the_recorded_run():
    assert worst_by_config(_rows()) == STRESS


def test_every_preset_ran_on_every_model_of_the_recipe():
    recipe = load_recipe(ROOT / "recipes" / "stress-outliers.yaml")
    ok = {(r["model"], r["config"]) for r in _rows() if r["status"] == "ok"}
    aliases = set(ALIASES)  # int8-shared is int8
    for model in recipe.models:
        for preset in set(PRESETS) - aliases:
            assert (model, preset) in ok, (model, preset)
    assert set(PRESETS) - aliases <= set(recipe.configs)


def test_default_meets_the_int8_line_and_recommended_presets_hold():
    rows = [r for r in _rows() if r["status"] == "ok" and r["config"] == DEFAULT_PRESET]
    assert len(rows) == 4
    assert all(r["delta_ppl_pct"] <= 0.1 and r["kl_mean"] <= 1e-3 for r in rows), rows
    for preset in RECOMMENDED.values():
        assert preset in PRESETS and STRESS[preset].holds
        assert STRESS[preset].worst_delta_ppl_pct <= LIMIT_PCT
