"""Standard errors, the paired --compare test, baseline settings and reports that describe what ran."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml

from kvquant import KVQuantConfig
from kvquant.eval.baselines import HF_DEFAULTS, make_method
from kvquant.eval.cli import main
from kvquant.eval.compare import compare_text, paired_difference, t_quantile
from kvquant.eval.metrics import DriftAccumulator, token_drift
from kvquant.eval.recipe import load_recipe
from kvquant.eval.report import _protocol_line, cell
from kvquant.transformers_compat import cache_kw

RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("recipes").glob("*.yaml"))


def test_t_quantiles_match_tables():
    for dof, want in ((1, 12.706), (3, 3.182), (5, 2.571), (30, 2.042)):
        assert t_quantile(0.975, dof) == pytest.approx(want, abs=1e-3)


def test_per_window_standard_errors():
    g = torch.Generator().manual_seed(0)
    acc = DriftAccumulator()
    per_window_kl = []
    for i in range(4):
        ref = torch.randn(50, 20, generator=g)
        q = ref + (0.1 + 0.1 * i) * torch.randn(50, 20, generator=g)
        d = token_drift(ref, q, torch.randint(0, 20, (50,), generator=g))
        per_window_kl.append(d["kl"].mean().item())
        acc.add(d, window=i)
    s = acc.summary()
    m = sum(per_window_kl) / 4
    se = math.sqrt(sum((x - m) ** 2 for x in per_window_kl) / 3) / 2
    assert s["kl_mean_se"] == pytest.approx(se) and s["n_windows"] == 4
    assert s["delta_ppl_se"] > 0 and s["top1_se"] >= 0
    assert [w["window"] for w in s["windows"]] == [0, 1, 2, 3]
    one = DriftAccumulator()
    one.add(d)
    assert one.summary()["kl_mean_se"] is None  # one window: no standard error, not a made-up one


def test_cells_show_plus_minus():
    row = {"delta_ppl": 0.0123, "delta_ppl_se": 0.004, "kl_mean": 0.0021, "kl_mean_se": 0.0003, "top1": 0.98,
           "top1_se": None}  # fmt: skip
    assert cell(row, "delta_ppl") == "+0.0123 ± 0.0040"
    assert cell(row, "kl_mean") == "0.0021 ± 3.00e-04"
    assert cell(row, "top1") == "0.9800"


def test_paired_difference_verdicts():
    a = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95]
    same = paired_difference(a, [x + 0.001 * (-1) ** i for i, x in enumerate(a)], "KL mean", True)
    assert not same.beyond_noise
    worse = paired_difference(a, [x + 0.5 + 0.01 * i for i, x in enumerate(a)], "KL mean", True)
    assert worse.beyond_noise and worse.better == "A" and worse.t_crit == pytest.approx(2.571, abs=1e-3)
    higher_top1 = paired_difference([x + 0.5 for x in a], a, "top-1", False)
    assert higher_top1.better == "A"


def test_compare_on_a_results_file(tmp_path, capsys):
    def row(name, kls):
        windows = [{"window": i, "n": 10, "ppl": 10 + k, "ppl_ref": 10, "delta_ppl": k, "kl_mean": k, "top1": 1 - k}
                   for i, k in enumerate(kls)]  # fmt: skip
        return {"config": name, "protocol": "decode", "status": "ok", "windows": windows}

    rows = [row("a", [0.010, 0.012, 0.011, 0.013]), row("b", [0.020, 0.023, 0.021, 0.022]),
            row("c", [0.0101, 0.0119, 0.0111, 0.0129])]  # fmt: skip
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"meta": {}, "results": rows}))
    assert main([str(path), "--compare", "a,b"]) == 0
    out = capsys.readouterr().out
    assert "KL mean" in out and "differ beyond noise" in out and "A is better" in out
    text = compare_text(rows, "a", "c")
    assert "no difference beyond noise" in text
    assert main([str(path), "--compare", "a,zzz"]) == 2
    assert "'zzz' has no results" in capsys.readouterr().err


def test_hf_baselines_default_to_the_strongest_documented_setting():
    hqq = make_method("hf-hqq-int4")
    assert hqq.options == {**HF_DEFAULTS, "axis_key": 1, "axis_value": 1}
    assert "strongest documented" in hqq.description and "transformers' default" not in hqq.description
    default = make_method("hf-hqq-int4:axis=0")
    assert default.options == HF_DEFAULTS and "transformers' default setting" in default.description
    custom = make_method("hf-quanto-int4:group=32:residual=64")
    assert custom.options["q_group_size"] == 32 and custom.options["residual_length"] == 64
    assert "strongest" not in custom.description and "residual_length 64" in custom.description
    quanto = make_method("hf-quanto-int4")
    assert "strongest documented setting = transformers' default setting" in quanto.description
    for bad, msg in (("hf-hqq-int4:axis=2", "axis_key must be one of"), ("hf-hqq-int4:foo=1", "option 'foo=1'"),
                     ("hf-hqq-int4:group=x", "not an integer"), ("hf-fp8:axis=1", "takes no options")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            make_method(bad)


def test_hf_options_reach_transformers(stories):
    model, _ = stories
    cache = make_method("hf-hqq-int4:axis=0:group=8:residual=16").decode_cache(model)
    layer = cache.layers[0]
    assert (layer.axis_key, layer.axis_value, layer.q_group_size, layer.residual_length) == (0, 0, 8, 16)


def test_int8_scale_presets():
    shared, separate = KVQuantConfig.preset("int8-shared"), KVQuantConfig.preset("int8-separate")
    assert shared.share_kv_scale and not separate.share_kv_scale
    assert shared.default == separate.default == KVQuantConfig.preset("int8").default
    assert KVQuantConfig.preset("int8").share_kv_scale  # int8 is the alias of int8-shared


def test_int8_separate_scales_differ_from_shared(stories):
    import kvquant
    from kvquant import QuantizedKVCache

    model, tok = stories
    # static scales are taken once a row holds 16 real tokens: a prompt longer than that
    ids = tok("Once upon a time there was a little girl named Lily. She loved to play outside in the park "
              "with her friends.", return_tensors="pt").input_ids  # fmt: skip
    assert ids.shape[1] > 16
    states = {}
    for name in ("int8-shared", "int8-separate"):
        with kvquant.wrapped(model, name), torch.no_grad():
            cache = QuantizedKVCache(model, name)
            model(ids, **cache_kw(cache), use_cache=True)
        g = cache.layers[0].store.groups[0]
        states[name] = (next(iter(g.key.state.values())), next(iter(g.value.state.values())))
    k, v = states["int8-shared"]
    assert torch.equal(k, v)  # one scale for K and V of each head
    k, v = states["int8-separate"]
    assert not torch.equal(k, v)


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_shipped_recipes_decode_exactly_and_describe_no_settings(path):
    data = yaml.safe_load(path.read_text())
    assert data.get("decode_chunk", 1) == 1, "shipped recipes use exact one-token decode"
    desc = data.get("description", "")
    settings = re.search(r"\d+\s*(tokens|prefilled|windows)|steps of|windows of|\d+\s*-token", desc)
    assert settings is None, f"{path.name}: settings belong to the generated protocol line, not the description"


def test_protocol_line_follows_overrides():
    recipe = load_recipe(RECIPES[0].parent / "default.yaml", {"window": 200, "prefill": 50, "decode_chunk": 8})
    meta = {"recipe": recipe.to_dict(), "windows": {"decode": 3}}
    line = _protocol_line(meta, "decode")
    assert "3 windows of 200 tokens, prefill 50" in line and "8 tokens per step (fast mode" in line
    assert "the 149 targets after the prefill" in line
    exact = _protocol_line({"recipe": load_recipe(RECIPES[0].parent / "default.yaml").to_dict()}, "decode")
    assert "one token per step (exact token-by-token decode)" in exact
