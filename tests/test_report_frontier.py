"""The report's opening lines (``recommend:``), the frontier plot and its non-overlapping labels."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvquant.config import DEFAULT_PRESET
from kvquant.eval.labels import label_boxes, place_labels
from kvquant.eval.recipe import RecipeError, load_recipe, parse_recipe
from kvquant.eval.report import markdown, plot, recommendation_lines

ROOT = Path(__file__).resolve().parents[1]


def _overlaps(a, b) -> bool:
    return min(a[2], b[2]) > max(a[0], b[0]) and min(a[3], b[3]) > max(a[1], b[1])


def test_labels_of_crowded_points_do_not_overlap():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    # a tight cluster (the case of several 0.27x configs) plus a few far points
    pts = [(0.27 + 0.002 * i, 0.005 + 0.0003 * (i % 3), f"config-number-{i}") for i in range(8)]
    pts += [(0.5, 0.02, "int8-kchannel"), (0.31, 0.01, "int4-kchannel-sinks"), (0.42, 0.012, "hf-hqq-int4")]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o")
    ax.set_yscale("log")
    ax.margins(0.2)
    fig.tight_layout()
    boxes = label_boxes(place_labels(ax, pts, bold={"int8-kchannel"}))
    assert len(boxes) == len(pts)
    for a, b in itertools.combinations(boxes, 2):
        assert not _overlaps(a, b), (a, b)
    plt.close(fig)


def _row(config, kind, kv, kl, dppl, **extra):
    return {"config": config, "kind": kind, "protocol": "decode", "status": "ok", "kv_vs_fp16": kv,
            "kl_mean": kl, "kl_mean_se": kl / 10, "delta_ppl": dppl, "delta_ppl_se": 0.01, "top1": 0.97,
            "top1_se": 0.01, **extra}  # fmt: skip


def _result(recommend):
    rows = [
        {"config": "reference", "kind": "reference", "protocol": "decode", "status": "ok", "kv_vs_fp16": 2.0,
         "kl_mean": 0.0, "delta_ppl": 0.0, "ppl": 4.0},
        _row("int8-kchannel", "kvquant", 0.502, 3.1e-5, 0.001),
        _row("int4-kchannel-sinks", "kvquant", 0.318, 0.0071, 0.02),
        _row("hf-hqq-int4", "baseline", 0.727, 0.036, 0.17),
        {"config": "hf-quanto-int4", "kind": "baseline", "protocol": "decode", "status": "skipped",
         "reason": "optimum-quanto is not installed"},
    ]  # fmt: skip
    recipe = SimpleNamespace(name="t", model="m", data="kjv", protocol=["decode"], recommend=recommend,
                             description="")  # fmt: skip
    return SimpleNamespace(recipe=recipe, rows=rows, meta={}, ok_rows=lambda: [r for r in rows if r["status"] == "ok"])


def test_recommendation_lines_carry_this_runs_numbers():
    lines = recommendation_lines(_result({"int4-kchannel-sinks": "4-bit", "hf-quanto-int4": "a baseline"}))
    text = "\n".join(lines)
    assert "`int4-kchannel-sinks`: 4-bit — holds 0.318x" in text
    assert "KL 0.0071 ± 7.10e-04" in text or "KL 0.0071 ± 0.0007" in text
    assert "`hf-quanto-int4`: a baseline — not measured in this run (optimum-quanto is not installed)" in text
    assert recommendation_lines(_result({})) == []


def test_frontier_plot_is_written(tmp_path):
    path = tmp_path / "kv_vs_quality.png"
    assert plot(_result({"int8-kchannel": "default"}), path)
    assert path.stat().st_size > 10_000


def test_recommend_field_is_checked():
    base = {"model": "m", "data": "kjv", "configs": ["reference", "int8-kchannel"]}
    r = parse_recipe({**base, "recommend": {"int8-kchannel": "  the   default "}})
    assert r.recommend == {"int8-kchannel": "the default"}
    with pytest.raises(RecipeError, match=r"^recommend\.int4: not in configs"):
        parse_recipe({**base, "recommend": {"int4": "x"}})
    with pytest.raises(RecipeError, match=r"^recommend\.int8-kchannel: must be a non-empty line"):
        parse_recipe({**base, "recommend": {"int8-kchannel": ""}})
    with pytest.raises(RecipeError, match=r"^recommend: must be a mapping"):
        parse_recipe({**base, "recommend": ["int8-kchannel"]})


def test_default_recipe_shows_the_product():
    """`make eval` compares the wrap() default, the recommended 4-bit preset and a generic low-bit tier with
    the strongest transformers baselines, and its report opens with what to use."""
    r = load_recipe(str(ROOT / "recipes" / "default.yaml"))
    assert DEFAULT_PRESET in r.recommend and "int4-kchannel-sinks" in r.recommend
    assert any(Path(c).stem.startswith("codebook-") for c in r.recommend), "no low-bit tier recommended"
    assert {"hf-hqq-int4", "hf-quanto-int4"} <= set(r.configs)
    assert r.protocol == ["decode"] and r.decode_chunk == 1
    result = _result({DEFAULT_PRESET: "the default"})
    result.meta = None  # markdown must open with the recommendations before it reads any metadata
    with pytest.raises(TypeError):
        markdown(result, None)
    head = recommendation_lines(result)
    assert head[0].startswith("**Which config to use**")
