"""KVQuantConfig: presets, YAML/JSON round trips, resolution, avg bits, and one-line field errors."""

from __future__ import annotations

import pytest

from kvquant import PRESETS, ConfigError, KVPrecision, KVQuantConfig, ModelShape

SHAPE = ModelShape(num_layers=4, num_kv_heads=2, head_dim=64)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_resolves(name):
    cfg = KVQuantConfig.preset(name)
    plan = cfg.resolve(SHAPE)
    assert len(plan) == 4 and all(len(row) == 2 for row in plan)
    assert 2 <= cfg.avg_bits(SHAPE) <= 32


def test_avg_bits_counts_overhead():
    assert KVQuantConfig.preset("fp16").avg_bits(SHAPE) == 16
    assert KVQuantConfig.preset("int8").avg_bits(SHAPE) == 8  # static per-head scale: no per-token bytes
    assert KVQuantConfig.preset("int8-token").avg_bits(SHAPE) == 8 + 16 / 64
    assert KVQuantConfig.preset("int4").avg_bits(SHAPE) == 4 + 32 / 32  # fp16 scale + zero per 32 channels
    assert KVQuantConfig.from_dict({"default": "int4", "group_size": 64}).avg_bits(SHAPE) == 4.5


def test_overrides_layer_then_head_k_and_v_separately():
    cfg = KVQuantConfig.from_dict({
        "default": "int4",
        "layers": {1: "int8", 2: {"key": "fp16"}},
        "heads": {"1.0": {"value": "fp16"}, "3.1": {"bits": 8}},
    })
    plan = cfg.resolve(SHAPE)
    assert plan[0] == [KVPrecision("int4", "int4")] * 2
    assert plan[1] == [KVPrecision("int8", "fp16"), KVPrecision("int8", "int8")]
    assert plan[2] == [KVPrecision("fp16", "int4")] * 2
    assert plan[3][1] == KVPrecision("int8", "int8") and plan[3][0] == KVPrecision("int4", "int4")


def test_nested_heads_form():
    cfg = KVQuantConfig.from_dict({"default": "int8", "heads": {2: {1: "fp16"}}})
    assert cfg.resolve(SHAPE)[2][1] == KVPrecision("fp16", "fp16")


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_file_round_trip(tmp_path, suffix):
    cfg = KVQuantConfig.from_dict({
        "default": {"key": "int8-token", "value": "int4"}, "group_size": 16, "headroom": 1.5,
        "layers": {0: "fp16"}, "heads": {"2.1": {"key": "fp8-e4m3"}},
    })
    path = tmp_path / f"c{suffix}"
    cfg.save(path, header="made by a test")
    back = KVQuantConfig.from_file(path)
    assert back.resolve(SHAPE) == cfg.resolve(SHAPE)
    assert back.group_size == 16 and back.headroom == 1.5
    assert back.avg_bits(SHAPE) == cfg.avg_bits(SHAPE)


def test_example_config_in_recipes_loads():
    from kvquant.paths import REPO_ROOT

    for path in sorted((REPO_ROOT / "recipes" / "configs").glob("*.yaml")):
        KVQuantConfig.from_file(path).resolve(ModelShape(30, 3, 64))


def test_load_accepts_preset_names():
    assert KVQuantConfig.load("int4").name == "int4"
    assert KVQuantConfig.from_file("fp8-e5m2").default == KVPrecision("fp8-e5m2", "fp8-e5m2")


# ---------------------------------------------------------------------- one-line errors naming the field
def _error(fn) -> str:
    with pytest.raises(ConfigError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_error_head_out_of_range():
    msg = _error(lambda: KVQuantConfig.from_dict({"heads": {"1.7": "int8"}}).resolve(SHAPE))
    assert msg.startswith('heads."1.7"') and "KV head 7" in msg


def test_error_layer_out_of_range():
    assert _error(lambda: KVQuantConfig.from_dict({"layers": {9: "int8"}}).resolve(SHAPE)).startswith("layers.9")


def test_error_bits_5():
    assert _error(lambda: KVQuantConfig.from_dict({"layers": {0: {"bits": 5}}})).startswith("layers.0.bits")
    assert _error(lambda: KVQuantConfig.from_dict({"default": {"bits": 5}})).startswith("default.bits")


def test_error_group_size_not_dividing_head_dim():
    msg = _error(lambda: KVQuantConfig.from_dict({"default": "int4", "group_size": 128}).resolve(SHAPE))
    assert msg.startswith("group_size") and "head_dim 64" in msg
    assert _error(lambda: KVQuantConfig.from_dict({"group_size": 24})).startswith("group_size")


def test_error_unknown_preset_and_precision():
    assert _error(lambda: KVQuantConfig.preset("int5")).startswith("preset")
    assert _error(lambda: KVQuantConfig.load("int5")).startswith("config")
    assert _error(lambda: KVQuantConfig.from_dict({"default": "int5"})).startswith("default")
    assert _error(lambda: KVQuantConfig.from_dict({"defualt": "int8"})).startswith("defualt")


def test_error_file_neither_yaml_nor_json(tmp_path):
    bad = tmp_path / "bad.cfg"
    bad.write_text("default: [int8\n  - : :\n")
    assert _error(lambda: KVQuantConfig.from_file(bad)).startswith("config file")
    plain = tmp_path / "plain.txt"
    plain.write_text("just some words")
    assert "neither" in _error(lambda: KVQuantConfig.from_file(plain))
    js = tmp_path / "x.json"
    js.write_text("{not json")
    assert _error(lambda: KVQuantConfig.from_file(js)).startswith("config file")


def test_error_config_for_another_model(tmp_path):
    cfg = KVQuantConfig.from_dict({"default": "int8", "model_shape": {"layers": 30, "kv_heads": 3, "head_dim": 64}})
    assert _error(lambda: cfg.resolve(SHAPE)).startswith("model_shape.layers")


def test_error_bad_options():
    assert _error(lambda: KVQuantConfig.from_dict({"headroom": 0.5})).startswith("headroom")
    assert _error(lambda: KVQuantConfig.from_dict({"block_size": 100})).startswith("block_size")


@pytest.mark.parametrize("spec", [None, 3, 2.5, ["int8"]])
def test_config_load_of_a_non_spec_is_a_config_error(spec):
    with pytest.raises(ConfigError, match="^config: expected a preset name"):
        KVQuantConfig.load(spec)


def test_residual_step_with_adakv_is_refused():
    """AdaKV lane layers flush a head's tail a whole block at a time: another residual_step is an error, not ignored."""
    with pytest.raises(ConfigError, match="residual_step: 1 with evict.budget adakv"):
        KVQuantConfig.from_dict({"default": "int4", "residual_tokens": 8, "residual_step": 1,
                                 "evict": {"policy": "snapkv", "keep": 0.5, "budget": "adakv"}})
    KVQuantConfig.from_dict({"default": "int4", "residual_tokens": 8, "residual_step": 1,
                             "evict": {"policy": "snapkv", "keep": 0.5}})
