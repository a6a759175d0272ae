"""Issue 10: outlier stress variants, per-channel keys at every width, exact key centering before
rotation, per-channel calibration candidates, the measured default and the outlier warning."""

from __future__ import annotations

import logging

import pytest
import torch

import kvquant
from kvquant import KVPrecision, KVQuantConfig, ModelShape, QuantizedKVCache
from kvquant.attention import install_attention
from kvquant.eval.recipe import RecipeError, parse_recipe
from kvquant.models import load_model
from kvquant.outliers import OFFSET_RATIO, OUTLIER_RATIO, key_channel_ratios, short_list
from kvquant.quantizers import make_quantizer
from kvquant.store import LayerStore
from kvquant.stress import split_spec
from kvquant.transformers_compat import cache_kw, output_cache

TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
    "friends. One day, she saw a big red ball under a tree. She ran to get it, but a dog took it first. "
    "Lily was sad, so her mom gave her a hug and they went home to bake a cake together."
)


@pytest.fixture(scope="module")
def variants(stories_path):
    """stories260K and its stress variants, each loaded fresh (the builders work in place)."""
    out = {}
    for name in ("", "+koutlier", "+kbias", "+wide256"):
        lm = load_model(f"{stories_path}{name}", progress=False)
        install_attention(lm.model)  # QuantizedKVCache needs the kvquant attention; DynamicCache still runs SDPA
        out[name or "base"] = lm.model
    out["tok"] = lm.tokenizer
    return out


def _ids(tok, n=64):
    return tok(TEXT, return_tensors="pt").input_ids[:, :n]


def _prefill_keys(model, ids):
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
    return [layer.keys for layer in cache.layers]


def test_split_spec_names_unknown_variants():
    assert split_spec("smollm2-135m+kbias+wide256") == ("smollm2-135m", ["kbias", "wide256"])
    with pytest.raises(ValueError, match="unknown stress variant 'kbig'"):
        split_spec("smollm2-135m+kbig")
    with pytest.raises(RecipeError, match="unknown stress variant"):
        parse_recipe({"model": ["smollm2-135m", "smollm2-135m+nope"], "data": "kjv", "configs": ["int8"]})
    r = parse_recipe({"model": ["a", "b+kbias"], "data": "kjv", "configs": ["int8"]})
    assert r.models == ["a", "b+kbias"] and r.model == "a"


def test_exact_variants_compute_the_same_function(variants):
    """koutlier and wide256 change the keys, not the model: logits equal the base model's (fp32 rounding)."""
    ids = _ids(variants["tok"])
    with torch.no_grad():
        base = variants["base"](ids).logits
        for name in ("+koutlier", "+wide256"):
            torch.testing.assert_close(variants[name](ids).logits, base, atol=2e-4, rtol=0)  # measured 5e-5
    assert variants["+wide256"].config.head_dim == 256
    assert _prefill_keys(variants["+wide256"], ids)[0].shape[-1] == 256


def test_stress_variants_show_outlier_statistics(variants):
    """The detector's statistics: base stories260K under both thresholds, koutlier / kbias over one."""
    ids = _ids(variants["tok"])
    for name, expect in (("base", False), ("+koutlier", True), ("+kbias", True)):
        worst = [key_channel_ratios(k) for k in _prefill_keys(variants[name], ids)]
        over = any(o > OFFSET_RATIO or r > OUTLIER_RATIO for o, r in worst)
        assert over == expect, (name, worst)
    assert variants["+kbias"].model.layers[0].self_attn.k_proj.bias is not None


def test_int8_channel_round_trip_error_bound():
    """Per channel over a block: |x - x_hat| <= scale/2 per channel (plus fp16 rounding of scale/zero)."""
    q = make_quantizer("int8-channel", 64, block_size=32)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 64, 64, generator=g) + torch.linspace(-40, 40, 64)  # per-channel offsets
    parts = q.quantize(x, {})
    y = q.dequantize(parts, {}, torch.float32)
    blocks = x.reshape(2, 3, 2, 32, 64)
    step = ((blocks.amax(3) - blocks.amin(3)) / 255).repeat_interleave(32, dim=2)
    err = (y - x).abs()
    assert bool((err <= step * 0.5 + 0.02).all())  # 0.02: fp16 rounding of zero (|lo| <= 45)
    assert q.bits_per_element() == pytest.approx(8 + 32 / 32)


def _logits(model, cfg, ids, prefill=24):
    """Teacher-forced logits through a kvquant cache: prefill, then exact one-token decode."""
    cache = QuantizedKVCache(model, cfg)
    with torch.no_grad():
        out = [model(ids[:, :prefill], **cache_kw(cache), use_cache=True).logits]
        for t in range(prefill, ids.shape[1]):
            out.append(model(ids[:, t:t + 1], **cache_kw(cache), use_cache=True).logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("extra", [{"rotate": "keys"}, {"rotate": "kv"}, {}])
def test_key_centering_is_exact_end_to_end(variants, extra):
    """Removing one per-channel key mean (fixed at prefill) leaves every softmax unchanged: with fp32
    storage, centered and uncentered caches give the reference's logits, on the key-bias model."""
    model, ids = variants["+kbias"], _ids(variants["tok"])
    with torch.no_grad():
        ref = model(ids).logits
    for center in (False, True):
        out = _logits(model, {"default": "fp32", **extra, "center_keys": center}, ids)
        torch.testing.assert_close(out, ref, atol=2e-4, rtol=0)  # measured 8e-5


@pytest.mark.parametrize("extra", [{"rotate": "kv", "sink_tokens": 2}, {"residual_tokens": 16, "block_size": 16}])
def test_key_centering_with_fp16_dense_buffers(variants, extra):
    """Sink and residual tokens are held in fp16 (for an fp32 model): the offset costs precision there,
    the centered keys do not (measured max |logit error| 0.022 -> 0.002 and 0.26 -> 0.013)."""
    model, ids = variants["+kbias"], _ids(variants["tok"])
    with torch.no_grad():
        ref = model(ids).logits
    err = {c: float((_logits(model, {"default": "fp32", **extra, "center_keys": c}, ids) - ref).abs().max())
           for c in (False, True)}
    assert err[True] < 0.2 * err[False] and err[True] < 0.05, err


def test_centering_before_rotation_holds_a_key_offset(variants):
    """On the key-bias model, rotated per-token int4 keys lose far less with the mean removed first."""
    model, ids = variants["+kbias"], _ids(variants["tok"])
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits, -1)

    def kl(cfg):
        lq = torch.log_softmax(_logits(model, cfg, ids), -1)
        return float((ref.exp() * (ref - lq)).sum(-1)[0, 24:].mean())

    base = {"default": {"key": "int4", "value": "fp16"}, "group_size": 8, "rotate": "keys"}
    kl_plain, kl_centered = kl({**base, "center_keys": False}), kl(base)
    assert kl_centered < 0.5 * kl_plain, (kl_centered, kl_plain)


def test_center_keys_state_follows_the_batch():
    cfg = KVQuantConfig.from_dict({"default": "int8-token", "rotate": "keys"})
    assert cfg.centers_keys and not KVQuantConfig.from_dict({"default": "int8"}).centers_keys
    store = LayerStore([KVPrecision("int8-token", "int8-token")] * 2, cfg, 16, 3, torch.device("cpu"))
    k = torch.randn(3, 2, 20, 16) + torch.arange(3.0).view(3, 1, 1, 1) * 10
    store.append(k, torch.randn(3, 2, 20, 16))
    torch.testing.assert_close(store.space.key_mean[:, :, 0], k.mean(2))
    store.index_batch(torch.tensor([2, 0]))
    torch.testing.assert_close(store.space.key_mean[:, :, 0], k.mean(2)[[2, 0]])
    store.reset()
    assert store.space.key_mean is None
    with pytest.raises(kvquant.ConfigError, match="center_keys"):
        KVQuantConfig.from_dict({"center_keys": "yes"})


def _warnings(caplog, model, cfg, ids):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvquant"):
        cache = QuantizedKVCache(model, cfg)
        with torch.no_grad():
            model(ids, **cache_kw(cache), use_cache=True)
            model(ids[:, -1:], **cache_kw(cache), use_cache=True)
    return [r.getMessage() for r in caplog.records if "outlier" in r.getMessage() or "offset" in r.getMessage()]


def test_outlier_warning_fires_once_and_names_a_safer_preset(variants, caplog):
    ids = _ids(variants["tok"])
    msgs = _warnings(caplog, variants["+kbias"], "int8", ids)
    assert len(msgs) == 1 and "int8-kchannel" in msgs[0] and "'int8'" in msgs[0]
    assert "int4-kchannel" in _warnings(caplog, variants["+koutlier"], "int4", ids)[0]
    # silent: a per-channel key preset on the stress model, any preset on the plain model
    assert _warnings(caplog, variants["+kbias"], "int8-kchannel", ids) == []
    assert _warnings(caplog, variants["base"], "int8", ids) == []
    # channel-width codebook keys centre and size each channel: silent too
    hd = ModelShape.of(variants["+kbias"]).head_dim
    tqc = KVQuantConfig(default=KVPrecision("tqc-" + "4" * hd, "int4"))
    assert _warnings(caplog, variants["+kbias"], tqc, ids) == []


def test_outlier_warning_stays_one_short_line():
    """A config with dozens of per-head key precisions (tqc widths) is named by a few of them and a count."""
    names = [f"tqc-{i:064d}" for i in range(60)] + ["tqv3"]
    text = short_list(names)
    assert text.endswith(" and 58 more") and len(text) < 120 and "\n" not in text
    assert short_list(["int8", "int4"]) == "int8, int4"


def test_wrap_default_is_the_measured_preset(variants):
    model = variants["base"]
    try:
        kvquant.wrap(model)
        assert model.kvquant_config.name == kvquant.DEFAULT_PRESET == "int8-kchannel"
    finally:
        kvquant.unwrap(model)


def test_int8_kchannel_is_near_lossless_on_stress_variants(variants):
    """Teacher-forced, exact decode: the default holds on every stress variant (top-1 and KL)."""
    ids = _ids(variants["tok"])
    for name in ("+koutlier", "+kbias", "+wide256"):
        model = variants[name]
        with torch.no_grad():
            ref = torch.log_softmax(model(ids).logits, -1)
        lq = torch.log_softmax(_logits(model, {"default": {"key": "int8-channel", "value": "int8-token"},
                                               "block_size": 16}, ids), -1)
        kl = float((ref.exp() * (ref - lq)).sum(-1)[0, 24:].mean())
        top1 = float((ref.argmax(-1) == lq.argmax(-1))[0, 24:].double().mean())
        assert kl < 1e-3 and top1 >= 0.95, (name, kl, top1)


def test_calibration_picks_per_channel_keys_on_the_bias_model(variants):
    """Per-channel candidates compete in calibration, K and V separately: on the key-bias model the
    keys choose int4-channel over per-token int4 at the same budget."""
    from kvquant.calibrate import calibrate

    model, tok = variants["+kbias"], variants["tok"]
    res = calibrate(model, tok, TEXT * 4, budget_bits=6.0, candidates="int4,int4-channel,int8-token,fp16",
                    kv_separate=True, method="kl", calib_windows=1, calib_window=64)
    plan = res.config.resolve(model)
    keys = [p.key for row in plan for p in row]
    assert keys.count("int4-channel") > keys.count("int4"), keys


def test_eval_runs_every_config_on_every_stress_model(shared, stories_path, tmp_path):
    """``model:`` as a list (here through --model a,b): one run per model, one summary side by side,
    exact one-token decode, standard errors over windows."""
    import json
    from pathlib import Path

    from kvquant.eval import cli

    recipe = Path(__file__).resolve().parent.parent / "recipes" / "tinystories-stories260k.yaml"
    out = tmp_path / "out"
    argv = [str(recipe), "--model", f"{stories_path},{stories_path}+kbias", "--configs", "int8,int8-kchannel",
            "--protocol", "decode", "--window", "40", "--prefill", "24", "--decode-chunk", "1",
            "--max-windows", "2", "--no-generation", "--out", str(out), "--quiet"]
    assert cli.main(argv) == 0
    summary = json.loads((out / "results.json").read_text())
    ok = [r for r in summary["rows"] if r["status"] == "ok"]
    assert {(r["model"].rsplit("/", 1)[-1], r["config"]) for r in ok} == {
        (m, c) for m in ("hf", "hf+kbias") for c in ("reference", "int8", "int8-kchannel")
    }
    assert all(r["delta_ppl_pct_se"] is not None and r["kl_mean_se"] is not None for r in ok)
    md = (out / "report.md").read_text()
    assert "| int8-kchannel |" in md and "worst Δppl" in md
    assert (out / "stories260K-hf+kbias" / "report.md").is_file()
