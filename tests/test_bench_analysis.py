"""Analysis helpers of the issue-14 benchmark scripts: copy distances (token_drift --by-copy) and the nll excess
over KL (nll_excess.py), on small synthetic inputs."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_copy_distance_finds_the_last_earlier_bigram():
    td = load("token_drift")
    ids = [1, 5, 6, 9, 5, 6, 7, 5, 6]
    assert td.copy_distance(ids, 8) == 3  # bigram (5, 6) at 4-5, the last one before 7-8
    assert td.copy_distance(ids, 5) == 3  # (5, 6) at 1-2
    assert td.copy_distance(ids, 2) is None  # its first occurrence
    assert td.copy_distance(ids, 6) is None  # (6, 7) never occurred before
    assert td.copy_distance([4, 4, 4], 2) == 1  # the bigram right before
    assert [td.copy_bin(d) for d in (None, 1, 15, 16, 255, 256, 4000)] == [
        "no earlier bigram", "copied from 1-15 back", "copied from 1-15 back", "copied from 16-255 back",
        "copied from 16-255 back", "copied from >= 256 back", "copied from >= 256 back"]  # fmt: skip


def _results(tmp_path: Path, rows: list[tuple[float, float, float]]) -> str:
    windows = [{"ppl": p, "ppl_ref": r, "kl_mean": k} for p, r, k in rows]
    data = {"results": [{"config": "reference", "kind": "reference", "windows": []},
                        {"config": "recipes/configs/a.yaml", "kind": "kvquant", "windows": windows}]}  # fmt: skip
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_nll_excess_pools_runs_and_subtracts_kl(tmp_path, capsys):
    ne = load("nll_excess")
    rows = [(10.0 * math.exp(0.004), 10.0, 0.003), (20.0 * math.exp(0.002), 20.0, 0.003)]
    path = _results(tmp_path, rows)
    assert ne.mean_se([1.0, 3.0]) == (2.0, 1.0)
    assert ne.main([f"a={path}=a", f"a={path}=a"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    # 4 windows pooled: Δnll 0.003 +- 0.0005774, KL 0.003 +- 0, excess 0 +- 0.0005774
    assert line == "| a | 4 | +0.0030 ± 0.0006 | +0.0030 ± 0.0000 | +0.0000 ± 0.0006 |"
    with pytest.raises(SystemExit, match="no config 'b'"):
        ne.main([f"a={path}=b"])
    with pytest.raises(SystemExit, match="LABEL=RESULTS_JSON=CONFIG"):
        ne.main([path])
