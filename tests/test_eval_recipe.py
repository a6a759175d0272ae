"""Recipe validation: every bad field gives a one-line error that starts with the field's name."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvquant.eval.recipe import RecipeError, load_recipe, parse_recipe

REPO = Path(__file__).resolve().parent.parent
GOOD = {"model": "some/model", "data": "kjv", "configs": ["fp16", "int8"]}


def test_good_recipe_defaults():
    r = parse_recipe(dict(GOOD))
    assert r.protocol == ["decode"] and r.window == 1024 and r.max_windows == 4 and r.decode_chunk == 1
    assert r.out == "results/eval" and r.generation is not None


@pytest.mark.parametrize(
    "change, field",
    [
        ({"windw": 512}, "windw"),
        ({"window": "big"}, "window"),
        ({"window": 1}, "window"),
        ({"window": True}, "window"),
        ({"stride": 0}, "stride"),
        ({"stride": 2048}, "stride"),
        ({"max_windows": -3}, "max_windows"),
        ({"first_window": -1}, "first_window"),
        ({"prefill": 4096}, "prefill"),
        ({"decode_chunk": 0}, "decode_chunk"),
        ({"protocol": "fake-quant"}, "protocol"),
        ({"protocol": ["decode", "nope"]}, "protocol"),
        ({"dtype": "float8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"bos": "yes"}, "bos"),
        ({"seed": -1}, "seed"),
        ({"configs": []}, "configs"),
        ({"configs": "fp16,fp16"}, "configs"),
        ({"configs": ["fp16", "int5"]}, "configs[1]"),
        ({"configs": ["hf-hqq-int4x"]}, "configs[0]"),
        ({"configs": ["bnb-int3"]}, "configs[0]"),
        ({"configs": [7]}, "configs[0]"),
        ({"generation": {"prompts": -1}}, "generation.prompts"),
        ({"generation": {"tokens": 3}}, "generation.tokens"),
        ({"generation": "lots"}, "generation"),
        ({"model": None}, "model"),
        ({"data": ""}, "data"),
        ({"out": 3}, "out"),
    ],
)
def test_bad_field_one_line_error(change, field):
    data = {**GOOD, **change}
    with pytest.raises(RecipeError) as ei:
        parse_recipe(data, source="r.yaml")
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith(f"{field}:"), msg
    assert msg.endswith("(r.yaml)")
    assert isinstance(ei.value, ValueError)


def test_bad_config_file_reports_the_core_error(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("default: int7\n")
    with pytest.raises(RecipeError) as ei:
        parse_recipe({**GOOD, "configs": [str(cfg)]})
    msg = str(ei.value)
    assert msg.startswith("configs[0]:") and "default" in msg and "\n" not in msg


def test_config_file_resolved(tmp_path):
    cfg = tmp_path / "mine.yaml"
    cfg.write_text("default: int8\nlayers:\n  0: fp16\n")
    r = parse_recipe({**GOOD, "configs": ["int4", str(cfg)]})
    assert r.resolved_configs == {str(cfg): str(cfg)}


def test_invalid_yaml_is_one_line(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("model: [unclosed\n")
    with pytest.raises(RecipeError) as ei:
        load_recipe(p)
    assert str(ei.value).startswith("recipe:") and "\n" not in str(ei.value)


def test_missing_recipe_file():
    with pytest.raises(RecipeError, match=r"^recipe: .*not found"):
        load_recipe("/nonexistent/recipe.yaml")


def test_overrides_apply_before_validation(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(GOOD))
    r = load_recipe(p, {"window": 128, "configs": ["int4"], "protocol": "simulated", "max_windows": None})
    assert r.window == 128 and r.configs == ["int4"] and r.protocol == ["simulated"] and r.max_windows == 4
    with pytest.raises(RecipeError, match=r"^window:"):
        load_recipe(p, {"window": 0})


def test_shared_placeholder_expands(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQUANT_SHARED", str(tmp_path))
    r = parse_recipe({**GOOD, "model": "${KVQUANT_SHARED}/models/x", "data": "$KVQUANT_SHARED/data/t.txt"})
    assert r.model == f"{tmp_path}/models/x" and r.data == f"{tmp_path}/data/t.txt"


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_validate(path):
    r = load_recipe(path)
    assert r.configs and r.name == path.stem
