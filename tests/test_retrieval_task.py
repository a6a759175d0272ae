"""passkey / needle as ``kvquant eval`` tasks (eval/retrieval_task.py): recipe fields, the run on stories260K,
tables with the reference's accuracy, heatmaps per config, the frontier plot, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvquant.eval import cli
from kvquant.eval.recipe import RecipeError, parse_recipe
from kvquant.eval.retrieval_task import family, heatmap_files

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "tinystories-stories260k.yaml"
BASE = {"model": "m", "data": "d.txt", "configs": ["int4"]}


def test_tasks_and_retrieval_fields():
    r = parse_recipe(BASE)
    assert r.tasks == ["ppl"] and r.protocol == ["decode"] and r.retrieval.lengths[-1] == 8192
    r = parse_recipe({**BASE, "tasks": "passkey,needle", "retrieval": {"lengths": [512, 256], "depths": [1, 0, 0.5]}})
    assert r.tasks == ["passkey", "needle"] and r.protocol == []  # no ppl task: no protocol runs
    assert r.retrieval.lengths == [256, 512] and r.retrieval.depths == [0.0, 0.5, 1.0] and r.retrieval.trials == 1


@pytest.mark.parametrize("extra, field", [
    ({"tasks": ["ppl", "riddle"]}, "tasks"),
    ({"tasks": ["passkey", "passkey"]}, "tasks"),
    ({"tasks": []}, "tasks"),
    ({"retrieval": {"lengths": [8]}}, "retrieval.lengths"),
    ({"retrieval": {"lengths": "1024"}}, "retrieval.lengths"),
    ({"retrieval": {"depths": [1.5]}}, "retrieval.depths"),
    ({"retrieval": {"trials": 0}}, "retrieval.trials"),
    ({"retrieval": {"depth": [0.5]}}, "retrieval.depth"),
    ({"retrieval": [1024]}, "retrieval"),
])  # fmt: skip
def test_bad_fields_name_themselves(extra, field):
    with pytest.raises(RecipeError, match=f"^{field}:"):
        parse_recipe({**BASE, **extra})


def test_family_places_configs_on_the_frontier():
    class Cfg:
        def __init__(self, bits, evict):
            self.bits, self.has_evict = bits, evict

        def to_dict(self):
            return {"evict": {"policy": "snapkv"}} if self.has_evict else {}

        def avg_bits(self, model):
            return self.bits

    def m(bits, evict):
        return SimpleNamespace(kind="kvquant", config=Cfg(bits, evict))

    assert [family(m(4.6, False), None), family(m(16, True), None), family(m(4.6, True), None),
            family(m(16, False), None)] == ["bits", "evict", "bits+evict", "full"]  # fmt: skip
    assert family(SimpleNamespace(kind="baseline"), None) == "baseline"
    assert heatmap_files(["ppl", "passkey"], ["hf-hqq-int4:axis=0"]) == ["heatmap-passkey-hf-hqq-int4_axis=0.png"]


def test_eval_runs_passkey_and_needle_with_heatmaps_and_frontier(shared, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [str(RECIPE), "--tasks", "ppl,passkey,needle", "--lengths", "320,448", "--depths", "0.5",
            "--configs", "fp32,int4,hf-hqq-int4", "--protocol", "decode", "--window", "40", "--prefill", "16",
            "--decode-chunk", "8", "--max-windows", "1", "--no-generation", "--out", str(out), "--quiet"]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "task passkey" in printed and "task needle" in printed and "reference acc." in printed
    data = json.loads((out / "results.json").read_text())
    cases = data["retrieval"]
    assert len(cases) == 2 * 4 * 2  # tasks x configs (reference included) x (2 lengths x 1 depth)
    for task in ("passkey", "needle"):
        lines = {x["config"]: x for x in data["meta"]["retrieval"][task]}
        assert set(lines) == {"reference", "fp32", "int4", "hf-hqq-int4"}
        ref = lines["reference"]
        for x in lines.values():
            assert x["status"] == "ok" and x["reference_accuracy"] == ref["accuracy"] and x["kv_vs_fp16"] > 0
        assert lines["fp32"]["agrees_with_reference"] == 1.0  # fp32 passthrough answers as the reference does
        assert lines["int4"]["kv_vs_fp16"] < lines["fp32"]["kv_vs_fp16"]
        assert lines["int4"]["family"] == "bits" and lines["hf-hqq-int4"]["family"] == "baseline"
        for c in lines:
            assert (out / heatmap_files([task], [c])[0]).stat().st_size > 1000
    mine = [r for r in cases if r["config"] == "int4"]
    assert all(r["kv_bytes"] > 0 and r["tokens"] > r["length"] for r in mine)
    assert (out / "frontier.png").stat().st_size > 1000
    md = (out / "report.md").read_text()
    assert "## passkey" in md and "## needle" in md and "heatmap-needle-int4.png" in md and "frontier.png" in md
    # the heatmaps are outputs like the others: not overwritten without --force
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "out:" in err and err.count("\n") == 1


def test_lengths_beyond_the_model_are_refused_before_the_run(shared, tmp_path, capsys):
    rc = cli.main([str(RECIPE), "--tasks", "passkey", "--lengths", "4096", "--configs", "int4", "--no-generation",
                   "--out", str(tmp_path / "o"), "--quiet"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "error: retrieval.lengths: 4096 is beyond the model's max_position_embeddings (512)" in err


def test_too_short_for_the_needle_is_refused_before_the_run(shared, tmp_path, capsys):
    rc = cli.main([str(RECIPE), "--tasks", "ppl,needle", "--lengths", "64,256", "--configs", "int4", "--no-generation",
                   "--out", str(tmp_path / "o"), "--quiet"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "error: retrieval.lengths: 64 tokens cannot hold the needle" in err


def test_bad_cli_lists_are_one_line(capsys):
    assert cli.main([str(RECIPE), "--tasks", "passkey", "--depths", "0,half"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--depths:" in err
