"""``kvquant calibrate`` / ``show-config`` on the real stories260K model (fast: short windows)."""

from __future__ import annotations

import argparse
import time
import types

import pytest
import torch
import yaml

from kvquant import KVQuantConfig, ModelShape
from kvquant.allocate import allocate, layer_upgrade, parse_candidates, plan_avg_bits, random_allocation
from kvquant.calibrate import CACHE_NAME, calibrate, cmd_show_config, config_table, register
from kvquant.sensitivity import (
    _call,
    _kl_mean,
    calibration_windows,
    estimate_fisher,
    measure_kl,
    spearman,
    unit_config,
)
from kvquant.simulate import SimulatedQuantCache
from kvquant.transformers_compat import cache_kw

CANDS = "int2,int8,fp16"
KW = dict(calib_window=64, calib_windows=2, samples=2, method="fisher")



@pytest.fixture(scope="module")
def stories_text(tinystories_text):
    return tinystories_text


@pytest.fixture(scope="module")
def first_run(stories, stories_text, tmp_path_factory):
    model, tok = stories
    out = tmp_path_factory.mktemp("cal") / "stories.yaml"
    # head_dim 8: int2 6 bits, int8 8 bits, fp16 16 bits per element (int2 carries an fp16 scale+zero per 8)
    res = calibrate(model, tok, stories_text, 7.0, candidates=CANDS, output=out, model_name="stories260K",
                    data_name="tinystories", command="kvquant calibrate (test)", **KW)
    return res


# ------------------------------------------------------------------ allocation (no model)
def test_greedy_takes_the_most_sensitive_units_first():
    L, H = 4, 2
    s4 = torch.rand(L, H, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    sens = {"int4": s4, "int8": torch.zeros(L, H, 2, dtype=torch.float64)}
    bits = {"int4": 5.0, "int8": 8.0}
    # 3 of 16 units can afford int8: 5 + 3 * 3 / 16 avg bits
    alloc = allocate(sens, bits, 5.0 + 9 / 16, kv_separate=True)
    chosen = {(li, h, k) for li in range(L) for h in range(H) for k in (0, 1)
              if (alloc.plan[li][h].key if k == 0 else alloc.plan[li][h].value) == "int8"}
    top3 = {tuple(int(i) for i in torch.nonzero(s4 == v)[0]) for v in s4.flatten().sort(descending=True).values[:3]}
    assert chosen == top3
    assert alloc.avg_bits == pytest.approx(5.0 + 9 / 16)
    assert alloc.predicted_kl == pytest.approx(float(s4.sum()) - sum(float(s4[u]) for u in top3))


def test_heads_together_without_kv_separate():
    sens = {"int4": torch.rand(3, 2, 2, dtype=torch.float64), "int8": torch.zeros(3, 2, 2, dtype=torch.float64)}
    alloc = allocate(sens, {"int4": 5.0, "int8": 8.0}, 6.5)
    assert all(p.key == p.value for row in alloc.plan for p in row)
    assert alloc.avg_bits <= 6.5


def test_baseline_policies_fit_the_budget():
    shape = ModelShape(30, 3, 64)
    bits = {"int4": 5.0, "int8": 8.0, "fp16": 16.0}
    plan = layer_upgrade(shape, bits, 6.0)
    assert [row[0].key for row in plan[:10]] == ["int8"] * 10 and plan[10][0].key == "int4"
    assert plan_avg_bits(plan, bits) == pytest.approx(6.0)
    for seed in range(3):
        r = random_allocation(shape, bits, 6.0, seed)
        assert 5.8 <= plan_avg_bits(r, bits) <= 6.0 + 1e-9


def test_candidate_errors_name_the_option():
    with pytest.raises(ValueError, match=r"^--candidates: unknown precision 'int5'"):
        parse_candidates("int4,int5")
    with pytest.raises(ValueError, match="--candidates"):
        parse_candidates("int4,int4")


# ------------------------------------------------------------------ on stories260K
def test_budget_honoured_and_spent(first_run, stories):
    model, _ = stories
    shape = ModelShape.of(model)
    assert first_run.bits == {"int2": 6.0, "int8": 8.0, "fp16": 16.0}
    assert first_run.config.avg_bits(shape) <= 7.0
    # the cheapest upgrade (int2 -> int8 of one head, K and V) would not have fitted any more
    step = 2 * (first_run.bits["int8"] - first_run.bits["int2"]) / (2 * shape.num_layers * shape.num_kv_heads)
    assert first_run.config.avg_bits(shape) > 7.0 - step - 1e-9


@pytest.mark.parametrize("budget", [6.0, 6.5, 9.0])
@pytest.mark.parametrize("kv_separate", [False, True])
def test_other_budgets_reuse_the_cache_and_fit(first_run, stories, stories_text, budget, kv_separate, monkeypatch,
                                               tmp_path):
    model, tok = stories

    def boom(*a, **k):
        raise AssertionError("measured again: the cache was not used")

    monkeypatch.setattr("kvquant.calibrate.estimate_fisher", boom)
    t0 = time.perf_counter()
    res = calibrate(model, tok, stories_text, budget, candidates=CANDS, output=tmp_path / "b.yaml",
                    cache_path=first_run.cache_path, heatmap=False, kv_separate=kv_separate,
                    model_name="stories260K", data_name="tinystories", **KW)
    assert res.cache_hit
    assert res.config.avg_bits(model) <= budget + 1e-9
    assert time.perf_counter() - t0 < 10
    if budget > 7.0:  # more bits never predict more loss
        assert res.allocation.predicted_kl <= first_run.allocation.predicted_kl


def test_cache_key_changes_with_candidates(first_run, stories, stories_text, tmp_path):
    model, tok = stories
    res = calibrate(model, tok, stories_text, 9.0, candidates="int2,fp16", output=tmp_path / "a.yaml",
                    cache_path=first_run.cache_path, heatmap=False, **KW)
    assert not res.cache_hit
    again = calibrate(model, tok, stories_text, 7.0, candidates="fp16,int2", output=tmp_path / "b.yaml",
                      cache_path=first_run.cache_path, heatmap=False, **KW)
    assert again.cache_hit


def test_yaml_round_trip_and_header(first_run, stories):
    model, _ = stories
    path = first_run.output
    assert path.name == "stories.yaml" and (path.parent / CACHE_NAME).is_file()
    assert first_run.heatmap is not None and first_run.heatmap.stat().st_size > 1000
    text = path.read_text()
    assert text.startswith("# kvquant calibrated KV-cache config")
    assert "tokens used: 2 window(s) x 64 tokens" in text and "kvquant calibrate (test)" in text
    loaded = KVQuantConfig.from_file(path)
    assert loaded.resolve(model) == first_run.allocation.plan
    assert loaded.avg_bits(model) == pytest.approx(first_run.config.avg_bits(model))
    assert yaml.safe_load(text)["model_shape"] == {"layers": 5, "kv_heads": 4, "head_dim": 8}
    # the simulated cache reads it as is
    ids = first_run.tokens.ids[:1, :16]
    model(ids, **cache_kw(SimulatedQuantCache(model, path)), use_cache=True)


def test_calibration_tokens_come_from_the_end(first_run):
    t = first_run.tokens
    assert t.end == t.corpus_tokens and t.end - t.start == 128
    with pytest.raises(ValueError, match="--calib-windows"):
        calibration_windows(torch.arange(100), 64, 2)


def test_errors(stories, stories_text, tmp_path):
    model, tok = stories
    with pytest.raises(ValueError, match=r"^--budget-bits: 1.0 is below the cheapest candidate \(int4: 8.000"):
        calibrate(model, tok, stories_text, 1.0, candidates="int4,fp16", output=tmp_path / "x.yaml", **KW)
    with pytest.raises(ValueError, match="^--candidates: unknown precision 'int5'"):
        calibrate(model, tok, stories_text, 6.0, candidates="int4,int5", **KW)
    no_kv = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=8))
    with pytest.raises(ValueError, match="no attention KV heads") as e:
        calibrate(no_kv, tok, stories_text, 6.0, **KW)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "x.yaml").exists()


# ------------------------------------------------------------------ sensitivity
def test_layer_skipping_forward_matches_the_full_forward(stories):
    model, _ = stories
    torch.manual_seed(0)
    ids = torch.randint(3, 512, (1, 48))
    sens = measure_kl(model, ids, ["int2", "fp16"], "fp16")
    base = KVQuantConfig()
    with torch.no_grad():
        ref = _call(model, SimulatedQuantCache(model, unit_config(base, "fp16")), input_ids=ids)
        for layer, head, kind in ((3, 2, 1), (0, 1, 0)):
            full = _call(model, SimulatedQuantCache(model, unit_config(base, "fp16", layer, head, kind, "int2")),
                         input_ids=ids)
            assert sens.values["int2"][layer, head, kind] == pytest.approx(
                _kl_mean(torch.log_softmax(ref, -1), full), rel=1e-4, abs=1e-7)
    assert (sens.values["int2"] > 0).all() and (sens.values["fp16"] == 0).all()
    # the fisher estimate ranks the units like the measurement does
    fisher = estimate_fisher(model, ids, ["int2", "fp16"], "fp16", samples=8)
    assert spearman(sens.values["int2"], fisher.values["int2"]) > 0.6


# ------------------------------------------------------------------ show-config and the CLI
def test_show_config(first_run, capsys):
    cmd_show_config(argparse.Namespace(config=str(first_run.output), model=None, context=1024))
    out = capsys.readouterr().out
    assert out.count("\n") >= 5 + 3
    avg = first_run.config.avg_bits(ModelShape(5, 4, 8))
    assert f"avg bits per K/V element (scale/zero overhead included): {avg:.4f}" in out
    table = config_table(KVQuantConfig.preset("int4"), ModelShape(2, 3, 64))
    assert "int4/int4" in table and "5.0000" in table


def test_show_config_needs_a_shape(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("default: int8\n")
    with pytest.raises(ValueError, match="^--model: needed"):
        cmd_show_config(argparse.Namespace(config=str(p), model=None, context=1024))


def test_register_adds_both_commands(first_run, stories_path, capsys):
    parser = argparse.ArgumentParser(prog="kvquant")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["calibrate", "--model", "m", "--budget-bits", "6", "--kv-separate", "-o", "c.yaml"])
    assert args.func.__name__ == "cmd_calibrate" and args.kv_separate and args.budget_bits == 6.0
    assert args.candidates == "int4,int4-channel,int8-token,int8-channel,fp16"
    args = parser.parse_args(["show-config", str(first_run.output), "--model", str(stories_path)])
    assert args.func(args) == 0
    assert "layer" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["calibrate", "--help"])
    helptext = capsys.readouterr().out
    assert "examples:" in helptext and "--budget-bits" in helptext


def test_cli_end_to_end(stories_path, tmp_path, capsys):
    from kvquant.cli import main

    out = tmp_path / "cli.yaml"
    rc = main(["calibrate", "--model", str(stories_path), "--data", "tinystories", "--budget-bits", "7.5",
               "--candidates", CANDS, "--calib-window", "64", "--calib-windows", "1", "--samples", "2",
               "--no-heatmap", "-o", str(out)])
    assert rc == 0
    assert "avg bits" in capsys.readouterr().out
    assert KVQuantConfig.from_file(out).avg_bits(ModelShape(5, 4, 8)) <= 7.5
    assert f"--budget-bits 7.5 --candidates {CANDS} --method fisher --calib-window 64" in out.read_text()
    assert main(["show-config", str(out)]) == 0
    assert "avg bits per K/V element" in capsys.readouterr().out
    # bad options: a one-line error naming the option, exit status 2, before any model is loaded
    assert main(["calibrate", "--model", "/nonexistent", "--budget-bits", "6", "--candidates", "int4,int9",
                 "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--candidates: unknown precision 'int9'" in err


def test_cache_is_keyed_by_content_not_labels(first_run, stories, stories_text, tmp_path, monkeypatch):
    model, tok = stories
    monkeypatch.setattr("kvquant.calibrate.estimate_fisher", lambda *a, **k: pytest.fail("measured again"))
    res = calibrate(model, tok, stories_text, 7.0, candidates=CANDS, output=tmp_path / "c.yaml",
                    cache_path=first_run.cache_path, heatmap=False, model_name="another name", data_name="x", **KW)
    assert res.cache_hit
    # other text is another measurement
    monkeypatch.undo()
    res = calibrate(model, tok, stories_text[:-200], 7.0, candidates=CANDS, output=tmp_path / "d.yaml",
                    cache_path=first_run.cache_path, heatmap=False, **KW)
    assert not res.cache_hit


def test_measured_method_end_to_end(stories, stories_text, tmp_path):
    model, tok = stories
    res = calibrate(model, tok, stories_text, 7.0, candidates=CANDS, method="kl", calib_window=32, calib_windows=1,
                    output=tmp_path / "kl.yaml", heatmap=False)
    assert res.sensitivity.method == "kl" and "sensitivity: kl -- measured" in res.header
    assert res.config.avg_bits(model) <= 7.0
    # int2 costs more KL than int8 for every unit: measured, not estimated, so this holds exactly
    assert (res.sensitivity.values["int2"] > res.sensitivity.values["int8"]).all()
    part = measure_kl(model, res.tokens.ids, ["int2", "fp16"], "fp16", layers_subset=[1])
    assert torch.isnan(part.values["int2"][0]).all() and not torch.isnan(part.values["int2"][1]).any()
    assert torch.allclose(part.values["int2"][1], res.sensitivity.values["int2"][1])
