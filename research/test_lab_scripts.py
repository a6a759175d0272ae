"""Analysis helpers of the issue-14 benchmark scripts: copy distances (token_drift --by-copy) and the nll excess
over KL (nll_excess.py), on small synthetic inputs."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "research" / f"{name}.py")
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


def test_lab_pre_rope_keys_turn_back_exactly():
    """codebook_lab --key-space pre-rope: `turn(..., back=True)` undoes transformers' rotary embedding."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    lab = load("codebook_lab")
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 3, 17, 64, generator=g)
    ang = torch.arange(17.0)[:, None] * 10000.0 ** (-torch.arange(32.0) / 32)
    emb = torch.cat((ang, ang), -1)[None]
    cos, sin = emb.cos(), emb.sin()
    _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)
    assert torch.allclose(lab.turn(k, cos[:, None], sin[:, None]), k_rot, atol=1e-6)
    assert torch.allclose(lab.turn(k_rot, cos[:, None], sin[:, None], back=True), k, atol=1e-5)
    assert not torch.allclose(k_rot, k, atol=1e-2)


def test_lab_pre_rope_widths_keep_the_bits_and_treat_rope_partners_alike():
    lab = load("codebook_lab")
    e_q = torch.ones(64)
    e_q[3] = 8.0  # the query energy of channel 3 turns into its RoPE partner 35 and back
    var_k = torch.ones(64)
    name = lab.pre_rope_widths("tqc-" + "3" * 64, e_q, var_k)
    widths = [int(c) for c in name[len("tqc-"):]]
    assert sum(widths) == 192
    assert widths[3] == widths[35] > max(w for j, w in enumerate(widths) if j not in (3, 35))


def test_lab_second_refinement_halves_what_is_left():
    """codebook_lab --ladder2: a second sign bit at each channel's mean |residual| lowers the error of a refined row
    (to ~1 - 2/pi of it on Gaussian residuals), and leaves an exact row exact."""
    lab = load("codebook_lab")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 1024, 64, generator=g)
    x1 = x + 0.1 * torch.randn(1, 2, 1024, 64, generator=g)
    x2 = lab.second_refinement(x, x1)
    ratio = float((x2 - x).pow(2).mean() / (x1 - x).pow(2).mean())
    assert 0.3 < ratio < 0.42  # 1 - 2/pi = 0.363
    assert torch.equal(lab.second_refinement(x, x), x)
