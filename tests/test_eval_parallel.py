"""Evaluation across processes (``--procs``), ``--device auto``, and caches over layers on different devices.

A CPU has one device, so layers in different dtypes stand in for layers on different GPUs: transformers'
``device_map="auto"`` moves each layer's inputs to that layer's device with accelerate hooks; here hooks move
them to the layer's dtype, and every cache layer must follow what its first K/V is.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers.cache_utils import DynamicCache

from kvquant import QuantizedKVCache
from kvquant.eval.parallel import merge_rows, shard_configs
from kvquant.eval.recipe import RecipeError, parse_recipe
from kvquant.eval.runner import run_recipe
from kvquant.transformers_compat import cache_kw

TIMING = ("seconds", "tok_per_s")


def _recipe(stories_path, tmp_path, name, **extra):
    data = {"model": str(stories_path), "data": "tinystories", "window": 32, "max_windows": 2, "prefill": 8,
            "protocol": ["decode", "simulated"], "bos": True, "threads": 1,
            "generation": {"prompts": 1, "prompt_tokens": 8, "new_tokens": 4},
            "configs": ["reference", "int8", "fp8-e4m3", "int4", "hf-quanto-int8"], "out": str(tmp_path / name)}
    data.update(extra)
    return parse_recipe(data)


def _untimed(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_shards_cover_every_config_once():
    configs = ["reference", "a", "b", "c"]
    shards = [shard_configs(configs, r, 2) for r in range(2)]
    assert shards == [["a", "c"], ["b"]]
    assert shard_configs(["reference", "a"], 1, 2) == ["reference"]


def test_two_processes_give_the_same_rows(stories_path, tmp_path):
    from kvquant.eval.parallel import run_parallel

    one = run_recipe(_recipe(stories_path, tmp_path, "one"), quiet=True, progress=False).rows

    out = run_parallel(_recipe(stories_path, tmp_path, "two"), 2, quiet=True)
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["processes"] == 2
    assert _untimed(doc["results"]) == json.loads(json.dumps(_untimed(one), default=str))
    assert any(r["status"] == "skipped" for r in one) and any(r["config"] == "fp8-e4m3" for r in one)


def test_merge_rows_restores_the_single_process_order(stories_path, tmp_path):
    recipe = _recipe(stories_path, tmp_path, "m")
    r0 = [{"config": c, "protocol": p, "status": "ok"} for p in ("decode", "simulated") for c in ("reference", "int8")]
    r1 = [{"config": c, "protocol": p, "status": s} for p in ("decode", "simulated")
          for c, s in (("reference", "ok"), ("fp8-e4m3", "ok"), ("hf-quanto-int8", "skipped"))]
    r1 += [{"config": "int4", "protocol": "decode", "status": "error"}]
    got = [(r["protocol"], r["config"]) for r in merge_rows(recipe, [r0, r1])]
    assert got == [("decode", "reference"), ("decode", "int8"), ("decode", "fp8-e4m3"), ("decode", "int4"),
                   ("decode", "hf-quanto-int8"), ("simulated", "reference"), ("simulated", "int8"),
                   ("simulated", "fp8-e4m3"), ("simulated", "hf-quanto-int8")]


def test_device_auto_runs_and_matches_cpu(stories_path, tmp_path):
    pytest.importorskip("accelerate")
    kw = {"configs": ["int8"], "protocol": "decode", "generation": False, "max_windows": 1}
    cpu = run_recipe(_recipe(stories_path, tmp_path, "cpu", **kw), quiet=True, progress=False).rows
    auto = run_recipe(_recipe(stories_path, tmp_path, "auto", device="auto", **kw), quiet=True, progress=False)
    assert _untimed(auto.rows) == _untimed(cpu)


def _mixed(model, layer: int, dtype: torch.dtype):
    """``model`` with one decoder layer in ``dtype``; hooks move its inputs there and its output back (as
    accelerate's hooks move tensors between the devices of a device_map)."""
    m = copy.deepcopy(model)
    block = m.model.layers[layer].to(dtype)

    def cast(x, to):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(to)
        if isinstance(x, tuple):
            return tuple(cast(y, to) for y in x)
        return x

    block.register_forward_pre_hook(
        lambda mod, args, kwargs: (cast(args, dtype), {k: cast(v, dtype) for k, v in kwargs.items()}),
        with_kwargs=True)
    block.register_forward_hook(lambda mod, args, out: cast(out, torch.float32))
    return m


def test_cache_layers_follow_the_dtype_of_their_first_kv(stories):
    model, _ = stories
    m = _mixed(model, 1, torch.bfloat16)
    ids = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(input_ids=ids, **cache_kw(DynamicCache(config=m.config))).logits
        for preset in ("fp32", "int8-token"):
            cache = QuantizedKVCache(m, preset)
            logits = m(input_ids=ids[:, :16], **cache_kw(cache)).logits
            for t in range(16, 24):  # one-token decode through the mixed-dtype cache
                logits = torch.cat([logits, m(input_ids=ids[:, t:t + 1], **cache_kw(cache)).logits], dim=1)
            assert [layer.dtype for layer in cache.layers[:3]] == [torch.float32, torch.bfloat16, torch.float32]
            assert all(layer.store.device == layer.device == torch.device("cpu") for layer in cache.layers)
            assert cache.layers[1].store.dense.dtype is None or cache.layers[1].store.dense.dtype == torch.bfloat16
            if preset == "fp32":  # passthrough: the mixed model's numbers up to bf16 rounding (measured max 0.032)
                torch.testing.assert_close(logits, ref, atol=0.1, rtol=0)
            top1 = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
            assert top1 >= 0.9, (preset, top1)


def test_first_window_scores_only_the_later_windows(stories_path, tmp_path):
    """``first_window: 1`` scores window 2 exactly as a run over windows 1-2 scores it, and a skip past the text's
    last window is a one-line RecipeError naming the field."""
    kw = {"configs": ["int8"], "protocol": "decode", "generation": False}
    both = run_recipe(_recipe(stories_path, tmp_path, "both", **kw), quiet=True, progress=False).rows
    later = run_recipe(_recipe(stories_path, tmp_path, "later", max_windows=1, first_window=1, **kw), quiet=True,
                       progress=False).rows  # fmt: skip
    assert [r["config"] for r in later] == [r["config"] for r in both]
    for a, b in zip(both, later, strict=True):
        assert len(b["windows"]) == 1 and b["windows"][0] == a["windows"][1]
    with pytest.raises(RecipeError, match="first_window"):
        run_recipe(_recipe(stories_path, tmp_path, "none", first_window=10**6, **kw), quiet=True, progress=False)
