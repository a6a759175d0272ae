"""Long-context retrieval tasks (eval/longcontext.py): case construction, scoring, and the run loop."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvquant
from kvquant.eval.longcontext import (
    accuracy_table,
    build_case,
    heatmap,
    is_correct,
    run_retrieval,
    summary,
)
from kvquant.text import tokenize


@pytest.fixture(scope="module")
def haystack(stories, tinystories_text):
    _, tok = stories
    return tokenize(tinystories_text, tok)


@pytest.mark.parametrize("task", ["passkey", "needle"])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_case_has_exact_length_and_needle_at_depth(stories, haystack, task, depth):
    _, tok = stories
    case = build_case(task, tok, haystack, 300, depth, trial=0, seed=1)
    assert case.ids.shape == (300,)
    needle = tok(f" {case.answer}", add_special_tokens=False)["input_ids"]
    text_after = tok.decode(case.ids[case.needle_start :].tolist())
    assert case.answer in text_after.split("?")[0]  # the needle follows needle_start, before the question
    assert case.answer not in tok.decode(case.ids[: case.needle_start].tolist())
    assert len(needle) >= 1
    # depth is a fraction of the haystack: the needle starts round(depth * fill) tokens into it
    intro = build_case(task, tok, haystack, 300, 0.0, trial=5).needle_start  # the instruction's length
    assert case.haystack_tokens > 50
    assert case.needle_start == intro + round(depth * case.haystack_tokens)


def test_cases_are_reproducible_and_vary_by_trial(stories, haystack):
    _, tok = stories
    a = build_case("passkey", tok, haystack, 200, 0.5, trial=0)
    b = build_case("passkey", tok, haystack, 200, 0.5, trial=0)
    c = build_case("passkey", tok, haystack, 200, 0.5, trial=1)
    assert torch.equal(a.ids, b.ids) and a.answer == b.answer
    assert not torch.equal(a.ids, c.ids)


def test_bad_arguments_name_the_field(stories, haystack):
    _, tok = stories
    with pytest.raises(ValueError, match="^depths:"):
        build_case("passkey", tok, haystack, 200, 1.5)
    with pytest.raises(ValueError, match="^lengths:"):
        build_case("passkey", tok, haystack, 10, 0.5)
    with pytest.raises(ValueError, match="^task:"):
        build_case("riddle", tok, haystack, 200, 0.5)
    with pytest.raises(ValueError, match="^data:"):
        build_case("passkey", tok, haystack[:50], 400, 0.5)


def test_exact_match_scoring():
    assert is_correct(" 68412. Remember it.", "68412")
    assert not is_correct(" 6841. 68412", "68412")  # the first number counts
    assert not is_correct(" 684120", "68412")
    assert not is_correct(" the pass key", "68412")


def test_passthrough_config_answers_like_dynamic_cache(stories, haystack, tmp_path):
    model, tok = stories
    kvquant.wrap(model, "fp32")  # QuantizedKVCache needs the kvquant attention; DynamicCache runs SDPA
    caches = {
        "reference": lambda: DynamicCache(config=model.config),
        "fp32": lambda: kvquant.QuantizedKVCache(model, "fp32"),
        "int4": lambda: kvquant.QuantizedKVCache(model, "int4"),
    }
    seen = []
    rows = run_retrieval(model, tok, haystack, caches, task="passkey", lengths=(224, 320), depths=(0.0, 1.0),
                         on_case=seen.append)
    kvquant.unwrap(model)
    assert len(rows) == len(seen) == 2 * 2 * 3
    by = {(r["config"], r["length"], r["depth"]): r for r in rows}
    for n in (224, 320):
        for d in (0.0, 1.0):
            assert by[("fp32", n, d)]["generated"] == by[("reference", n, d)]["generated"]
            assert by[("fp32", n, d)]["kv_bytes"] > by[("int4", n, d)]["kv_bytes"] > 0
            assert by[("reference", n, d)]["kv_bytes"] is None
    s = {r["config"]: r for r in summary(rows)}
    assert s["fp32"]["agrees_with_reference"] == 1.0
    acc = accuracy_table(rows)["reference"]
    assert set(acc) == {(224, 0.0), (224, 1.0), (320, 0.0), (320, 1.0)}
    heatmap(rows, "int4", tmp_path / "int4.png")
    assert (tmp_path / "int4.png").stat().st_size > 1000
